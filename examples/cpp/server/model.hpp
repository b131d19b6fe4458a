// The batching server's pure half (no torch, no HTTP): what one request holds, how it is read from JSON
// and checked against the artifact's inputs, and how an answer is written back. Tested without a GPU.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <stitchcuda/family.hpp>
#include <stitchcuda/program.hpp>

namespace stitchcuda_server {

/// One input or output of the served program, as one sample sees it (the batch dim left out).
struct TensorSlot {
  std::string name;                  ///< the buffer's name, or "input0", "output0", ...
  stitchcuda::program::DType dtype;  ///< element type
  std::vector<std::int64_t> shape;   ///< per-sample shape: the buffer's shape without dim 0
  std::size_t bytes() const;         ///< bytes of one sample
};

/// What the server serves: every input and output has the batch as dim 0. A program runs one batch size,
/// its extent there (a smaller batch is padded with zero rows); a program family runs every batch from 1
/// to its batch dim's max as it is (the family itself may pad it to one of its members).
struct ServedModel {
  std::vector<TensorSlot> inputs;
  std::vector<TensorSlot> outputs;
  std::int64_t max_batch = 0;
  bool fixed_batch = true;  ///< a program: every batch runs max_batch rows; a family: its own rows

  /// The largest batch a family may declare here: the batcher keeps a counter per batch size.
  static constexpr std::int64_t kMaxFamilyBatch = 1 << 16;

  /// From a loaded program; an error (std::nullopt with `why` set) when the program has a state (runs of it
  /// cannot be batched or run concurrently), a buffer is not contiguous or its dim 0 differs from the first
  /// input's.
  static std::optional<ServedModel> from_program(const stitchcuda::program::Program& program, std::string& why);
  /// From a loaded family whose one dim is the batch: dim 0 of every input and output, from 1 to at most
  /// kMaxFamilyBatch, every size served (the dim pads, or a member per size). An error says which not.
  static std::optional<ServedModel> from_family(const stitchcuda::program::ProgramFamily& family, std::string& why);
  /// Rows a batch of `requests` samples runs with: max_batch for a program, the requests for a family.
  std::int64_t rows_for(std::int64_t requests) const { return fixed_batch ? max_batch : requests; }
  /// {"max_batch": B, "fixed_batch": bool, "inputs": [{"name", "dtype", "shape"}], "outputs": [...]}: what
  /// /healthz reports.
  std::string describe_json() const;
};

/// One sample's inputs: raw little-endian bytes per input, in the program's input order.
struct Sample {
  std::vector<std::string> inputs;
  bool base64_answer = false;  ///< answer with base64 bytes instead of nested lists
};

/// A request the server refuses: the HTTP status (4xx) and a message naming the problem and the fix.
struct Refusal {
  int status = 400;
  std::string message;
};

/// Reads a POST /v1/infer body (docs: examples/cpp/README.md) into a Sample, or says why not.
/// `content_type` is the request's header; anything but application/json is refused with 415.
struct Parsed {
  std::optional<Sample> sample;
  Refusal refusal;  ///< meaningful when sample is empty
};
Parsed parse_request(const ServedModel& model, std::string_view content_type, std::string_view body);

/// The JSON answer for one sample: its outputs (nested lists, or base64 where asked or for f16/bf16), and
/// the batch it ran in (rows of real requests and zero rows of padding).
std::string encode_answer(const ServedModel& model, const std::vector<std::string>& outputs, bool base64,
                          int batch_rows, int padded_rows);

/// {"error": message}.
std::string error_json(std::string_view message);

/// Standard base64 (RFC 4648, with padding).
std::string base64_encode(std::string_view bytes);
/// The bytes, or nothing when `text` is not base64.
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace stitchcuda_server
