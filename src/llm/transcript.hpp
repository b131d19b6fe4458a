// JSONL transcripts of model calls: one line per call with the request, its hash and the outcome.
// Written by ReliableBackend and record(); read back by replay_backend().
#pragma once

#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <stitchcuda/llm.hpp>

namespace stitchcuda::llm::detail {

/// Appends whole lines to a transcript, flushed one by one so a killed run keeps what it did.
/// Every line is scrubbed of remembered secrets. Thread safe.
class TranscriptWriter {
 public:
  /// IoError naming the path when the file cannot be opened for appending.
  static Result<std::unique_ptr<TranscriptWriter>> open(const std::string& path);
  ~TranscriptWriter();

  /// Appends one call and its outcome.
  void write(const std::string& backend, const std::vector<Message>& messages, const Options& options,
             const Result<Completion>& outcome);

 private:
  explicit TranscriptWriter(std::FILE* file) : file_(file) {}
  std::mutex mu_;
  std::FILE* file_;
};

}  // namespace stitchcuda::llm::detail
