// Server-sent events (text/event-stream): the framing OpenAI and Anthropic stream replies in.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace stitchcuda::llm::detail {

/// Splits a byte stream into events, however the network cuts it.
class EventStreamParser {
 public:
  /// Gets each complete event: its `event:` name ("" when none) and its `data:` lines joined by
  /// '\n'. Returns false to stop parsing.
  using Handler = std::function<bool(std::string_view event, std::string_view data)>;

  explicit EventStreamParser(Handler handler) : handler_(std::move(handler)) {}
  /// Consumes bytes as they arrive; false once the handler asked to stop.
  bool feed(std::string_view bytes);

 private:
  bool line(std::string_view text);
  Handler handler_;
  std::string buffer_;  // bytes after the last complete line
  std::string event_;
  std::string data_;
  bool has_data_ = false;
  bool stopped_ = false;
};

}  // namespace stitchcuda::llm::detail
