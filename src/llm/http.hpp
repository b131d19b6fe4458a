// HTTP POST over libcurl for the model backends: pooled connections, a deadline, cancellation,
// bodies streamed as they arrive, and transport failures classified for the retry policy.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <stitchcuda/llm.hpp>

namespace stitchcuda::llm::detail {

/// One POST to a model server.
struct HttpPost {
  std::string url;
  std::vector<std::string> headers;  ///< "Name: value" lines; they may hold keys, so never printed
  std::string body;
  double connect_timeout_s = 10.0;
  double timeout_s = 600.0;  ///< the whole exchange, last byte included
  const CancelToken* cancel = nullptr;
  std::size_t max_reply_bytes = 32u << 20;
};

/// What came back. Every status is a reply here: the backend decides what a status means.
struct HttpReply {
  long status = 0;
  std::string content_type;
  std::string body;           ///< the body, unless a sink took it (2xx with a sink)
  double retry_after_s = -1;  ///< from Retry-After or retry-after-ms, when the server sent one
};

/// Takes a 2xx body as it arrives; returning false stops the transfer.
using BodySink = std::function<bool(std::string_view bytes)>;

/// Pooled libcurl connections, so requests to one server reuse warm connections. Thread safe.
class HttpClient {
 public:
  HttpClient();
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  /// Sends `post`. Transport failures are errors: LlmError with `transient` set for a refused or
  /// broken connection, Timeout past `timeout_s`, Cancelled, LlmError for a reply over
  /// max_reply_bytes, and Internal("stopped") when the sink asked to stop.
  Result<HttpReply> send(const HttpPost& post, const BodySink& sink = {});

 private:
  struct Pool;
  std::unique_ptr<Pool> pool_;
};

/// The message Internal errors carry when a sink stopped a transfer (the backend knows why).
inline constexpr std::string_view kStoppedBySink = "stopped by the reply reader";

}  // namespace stitchcuda::llm::detail
