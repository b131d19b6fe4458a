// Server-sent events parser (the subset of the WHATWG rules model servers use: event, data, comments).
#include "event_stream.hpp"

namespace stitchcuda::llm::detail {

bool EventStreamParser::feed(std::string_view bytes) {
  if (stopped_) return false;
  buffer_.append(bytes);
  std::size_t start = 0;
  for (std::size_t nl; (nl = buffer_.find('\n', start)) != std::string::npos; start = nl + 1) {
    std::string_view text(buffer_.data() + start, nl - start);
    if (!text.empty() && text.back() == '\r') text.remove_suffix(1);
    if (!line(text)) {
      stopped_ = true;
      break;
    }
  }
  buffer_.erase(0, start);  // once per feed, not per line: long streams stay linear
  return !stopped_;
}

bool EventStreamParser::line(std::string_view text) {
  if (text.empty()) {  // a blank line ends the event
    bool go_on = true;
    if (has_data_) go_on = handler_(event_, data_);
    event_.clear();
    data_.clear();
    has_data_ = false;
    return go_on;
  }
  if (text.front() == ':') return true;  // comment, e.g. keep-alive pings
  const auto colon = text.find(':');
  std::string_view field = text.substr(0, colon);
  std::string_view value = colon == std::string_view::npos ? std::string_view() : text.substr(colon + 1);
  if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  if (field == "data") {
    if (has_data_) data_ += '\n';
    data_.append(value);
    has_data_ = true;
  } else if (field == "event") {
    event_.assign(value);
  }
  return true;
}

}  // namespace stitchcuda::llm::detail
