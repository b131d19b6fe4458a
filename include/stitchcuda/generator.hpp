// stitchcuda::torch::Generator — greedy generation from a prefill + decode pair (decode.hpp) without Python:
// the prefill over the prompt, then one decode step per new token, both executors over one KV cache (the
// prefill executor's states handed to the decode executor), the next token chosen by argmax on the device
// and the decode step replayed as a CUDA graph. Needs LibTorch (target stitchcuda::torch).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <stitchcuda/decode.hpp>
#include <stitchcuda/error.hpp>
#include <stitchcuda/executor.hpp>

namespace stitchcuda::torch {

/// How a Generator runs its programs.
struct GeneratorOptions {
  int device = -1;     ///< CUDA device; -1: PyTorch's current device
  /// true: the decode step is captured once as a CUDA graph (after one eager step) and replayed at every
  /// token, the prefill as its program's measured replay choice says; false: every step launched directly.
  bool graphs = true;
};

/// Counters since creation.
struct GeneratorStats {
  std::uint64_t sequences = 0;  ///< generate() calls that succeeded (each: one prefill)
  std::uint64_t tokens = 0;     ///< new tokens they returned (each after the first: one decode step)
  ExecutorStats prefill, decode;  ///< the two executors' counters
};

/// Runs a DecodePrograms' token loop. generate() calls are serialized (the cache is one), so a Generator
/// may be shared between threads; each call starts from zeroed caches.
class Generator {
 public:
  /// Checks the pair (DecodePrograms::validate), then creates the prefill executor (its states zero-filled,
  /// its own) and the decode executor over those very states. Errors name the program at fault.
  static Result<std::unique_ptr<Generator>> create(program::DecodePrograms programs, GeneratorOptions options = {});
  /// DecodePrograms::load + create.
  static Result<std::unique_ptr<Generator>> load(const std::string& path, GeneratorOptions options = {});

  /// Greedy continuation of `prompt`, integer token ids [batch, prompt_length] on any device: the new
  /// tokens, int64 [batch, max_new_tokens] on the GPU (the prompt is not repeated). The loop never waits
  /// for the host; the caller's stream (nullptr: PyTorch's current one) orders it. Refused before anything
  /// runs: a prompt of another shape, or a sequence past max_length (the last new token is not written
  /// to the cache: prompt_length + max_new_tokens - 1 positions must fit).
  Result<at::Tensor> generate(const at::Tensor& prompt, std::int64_t max_new_tokens, void* stream = nullptr);
  /// As above on the host: batch * prompt_length ids, row-major, in; batch * max_new_tokens ids out.
  Result<std::vector<std::int64_t>> generate(const std::vector<std::int64_t>& prompt, std::int64_t max_new_tokens);

  std::int64_t batch() const;          ///< sequences per call
  std::int64_t prompt_length() const; ///< tokens per prompt
  std::int64_t max_length() const;    ///< cache positions
  std::int64_t vocab() const;         ///< logits per token
  int device() const;                 ///< CUDA device it runs on
  GeneratorStats stats() const;
  /// What a user should know before trusting the results (the executors' warnings).
  std::vector<std::string> warnings() const;

  struct Impl;
  explicit Generator(std::unique_ptr<Impl> impl);
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace stitchcuda::torch
