// stitchcuda::torch::Generator — generation from a prefill + decode pair (decode.hpp) without Python: the
// prefill over the prompt, then one decode step per new token, both executors over one KV cache (the
// prefill executor's states handed to the decode executor), the next token chosen on the device (argmax,
// or a seeded draw: SamplingOptions) and the decode step replayed as a CUDA graph. Needs LibTorch (target
// stitchcuda::torch).
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

/// How generate() chooses each new token, and where it stops. The default: greedy (the argmax), no end token.
/// The rules and the operations are StaticCacheGenerator.generate's in Python (next_tokens): seeded alike,
/// both draw the same tokens.
struct SamplingOptions {
  bool do_sample = false;      ///< false: the argmax of the logits; true: a draw from their softmax
  double temperature = 1.0;    ///< sampling: the logits are divided by it (> 0) before the softmax, in fp32
  std::int64_t top_k = 0;      ///< sampling: only the k likeliest tokens (ties kept); 0: all
  double top_p = 1.0;          ///< sampling: only the fewest likeliest tokens whose probability reaches it, (0, 1]
  std::uint64_t seed = 0;      ///< sampling: each generate() call draws from a generator started at this seed
  std::int64_t eos_token_id = -1;  ///< >= 0: a sequence that produced it repeats it; generation ends once all have
};

/// An InvalidArgument error naming the option and the fix where `options` are unusable (a temperature of
/// 0 with do_sample, top_k below 0, top_p outside (0, 1], ...; sampling options without do_sample).
Result<void> check_sampling(const SamplingOptions& options);

/// The next token of each row of `logits` [rows, vocab] (any device, the CPU included), int64 [rows], with no
/// host sync: the argmax, or with do_sample a draw (at::multinomial from a generator of the logits' device
/// started at options.seed, as torch.Generator(device).manual_seed(seed)) from the softmax of
/// logits / temperature in fp32 cut to top_k and top_p.
/// Errors: unusable options (check_sampling), logits that are not [rows, vocab] floating point.
Result<at::Tensor> next_tokens(const at::Tensor& logits, const SamplingOptions& options);

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

  /// The continuation of `prompt`, integer token ids [batch, prompt_length] on any device: the new tokens,
  /// int64 [batch, max_new_tokens] on the GPU (the prompt is not repeated), chosen as `options` say (greedy
  /// by default). With an eos_token_id, fewer columns: up to the first where every sequence shows it. The
  /// loop never waits for the host (with an eos_token_id, once every kEosCheckEvery tokens); the caller's
  /// stream (nullptr: PyTorch's current one) orders it. Refused before anything runs: a prompt of another
  /// shape, a sequence past max_length (the last new token is not written to the cache: prompt_length +
  /// max_new_tokens - 1 positions must fit), unusable options (check_sampling).
  Result<at::Tensor> generate(const at::Tensor& prompt, std::int64_t max_new_tokens, const SamplingOptions& options = {},
                              void* stream = nullptr);
  /// As above on the host: batch * prompt_length ids, row-major, in; batch * n ids out, n = max_new_tokens
  /// (or fewer with an eos_token_id: the size over the batch).
  Result<std::vector<std::int64_t>> generate(const std::vector<std::int64_t>& prompt, std::int64_t max_new_tokens,
                                             const SamplingOptions& options = {});

  /// How many tokens the loop queues between two reads of its eos flags: each read waits for the steps
  /// before it, so reading once per token would keep the host from queueing ahead.
  static constexpr std::int64_t kEosCheckEvery = 16;

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
