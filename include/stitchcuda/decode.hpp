// stitchcuda::program::DecodePrograms — a causal LM's prefill and decode programs over one static KV cache
// (their states), as data: the pair's checks (inputs, logits, states paired by name with one layout) and
// its file, both programs in one container with their weights stored once. torch::Generator
// (generator.hpp) runs the token loop (greedy or sampled) over it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <stitchcuda/error.hpp>
#include <stitchcuda/program.hpp>

namespace stitchcuda::program {

/// Both programs compute `forward(input_ids, cache_position) -> logits` of one model in the static-cache
/// style (docs/decode.md): inputs, in buffer-id order, the token ids i64/i32 [batch, tokens] and the cache
/// positions i64/i32 [tokens]; one output, the logits [batch, k, vocab] (floating point) of the last k <= tokens
/// positions (every one, or the last alone); the cache as
/// states, read and written in place. The prefill takes the prompt (tokens = prompt_length), the decode one
/// token. Their states are the same tensors: paired by name, each pair of one layout.
struct DecodePrograms {
  Program prefill;
  Program decode;
  std::int64_t max_length = 0;  ///< cache positions: a prompt and its new tokens fit in 0..max_length-1

  /// Both programs, their inputs and logits against each other, and the states paired by name. Each
  /// problem is an InvalidArgument naming the program and buffer ("decode's state 'layer0_keys' is ...").
  Result<void> validate() const;
  /// (prefill state id, decode state id) for every state, by name, in the prefill's buffer-id order.
  std::vector<std::pair<BufferId, BufferId>> state_pairs() const;
  std::int64_t batch() const;          ///< the prefill's token ids' dim 0 (0 where the pair has none)
  std::int64_t prompt_length() const; ///< the prefill's token ids' dim 1
  std::int64_t vocab() const;         ///< the logits' last dim

  /// The file: its own magic and version; each program as `.stitch` bytes without its weights, then every
  /// distinct weight once (the two programs of one model share all of them).
  std::string serialize() const;
  /// Reads the file's bytes: header, checksums, every field, both programs, then validate().
  static Result<DecodePrograms> deserialize(std::string_view bytes);
  /// Writes the file atomically (validates first).
  Result<void> save(const std::string& path) const;
  /// Reads and checks a file written by save.
  static Result<DecodePrograms> load(const std::string& path);
};

/// Decode-pair file format version written by this library.
inline constexpr std::uint32_t kDecodeArtifactVersion = 1;

/// Whether `bytes` (a file's first bytes: 8 suffice) start a prefill + decode pair's file.
bool is_decode_artifact(std::string_view bytes) noexcept;

}  // namespace stitchcuda::program
