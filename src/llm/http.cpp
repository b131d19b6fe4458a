// HttpClient: libcurl's multi interface driven from the calling thread, so a call can watch its
// cancellation token and deadline while it waits, and each pooled handle keeps its connection warm.
#include "http.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <string>

#include <stitchcuda/detail/settings.hpp>
#include <stitchcuda/secrets.hpp>

namespace stitchcuda::llm::detail {
namespace {

using Clock = std::chrono::steady_clock;

// How often a waiting call looks at its cancellation token: the latency of cancel().
constexpr int kPollMs = 25;
// Idle connections kept per client; more concurrent calls than this open extra ones.
constexpr std::size_t kMaxIdle = 64;
// Of an error reply, this much is kept for the message; the rest is only counted.
constexpr std::size_t kErrorBodyKept = 64 * 1024;

void init_curl_once() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// Loopback never goes through a proxy: a local model server (and the tests' server) must be
// reached directly even where http_proxy is set for the hosted APIs.
const std::string& no_proxy_list() {
  static const std::string list = [] {
    std::string out = "127.0.0.1,localhost,::1";
    for (const char* var : {"NO_PROXY", "no_proxy"})
      if (auto v = stitchcuda::detail::environment(var)) out = *v + "," + out;
    return out;
  }();
  return list;
}

bool starts_with_nocase(std::string_view text, std::string_view prefix) {
  if (text.size() < prefix.size()) return false;
  for (std::size_t i = 0; i < prefix.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(text[i])) != prefix[i]) return false;
  return true;
}

std::string_view trimmed(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Retry-After is seconds or an HTTP date; -1 when neither parses.
double parse_retry_after(std::string_view value) {
  const std::string text(value);
  char* end = nullptr;
  const double seconds = std::strtod(text.c_str(), &end);
  if (end != text.c_str() && *end == '\0' && seconds >= 0) return seconds;
  const time_t when = curl_getdate(text.c_str(), nullptr);
  if (when < 0) return -1;
  return std::max(0.0, std::difftime(when, std::time(nullptr)));
}

// The state of one transfer, shared with libcurl's callbacks.
struct Transfer {
  const BodySink* sink = nullptr;
  const CancelToken* cancel = nullptr;
  std::size_t max_bytes = 0;
  std::size_t received = 0;
  HttpReply reply;
  bool cancelled = false;
  bool too_large = false;
  bool sink_stopped = false;
};

size_t on_header(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const std::string_view line(data, size * count);
  if (starts_with_nocase(line, "http/")) {
    // A new response (after a redirect or an interim 1xx): forget the previous one's headers.
    t->reply = HttpReply{};
    const auto space = line.find(' ');
    if (space != std::string_view::npos) t->reply.status = std::strtol(std::string(line.substr(space + 1, 3)).c_str(), nullptr, 10);
  } else if (starts_with_nocase(line, "content-type:")) {
    t->reply.content_type = std::string(trimmed(line.substr(13)));
  } else if (starts_with_nocase(line, "retry-after-ms:")) {
    const double ms = parse_retry_after(trimmed(line.substr(15)));
    if (ms >= 0) t->reply.retry_after_s = ms / 1000.0;  // the finer of the two wins
  } else if (starts_with_nocase(line, "retry-after:")) {
    if (t->reply.retry_after_s < 0) t->reply.retry_after_s = parse_retry_after(trimmed(line.substr(12)));
  }
  return size * count;
}

size_t on_body(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t n = size * count;
  if (t->cancel && t->cancel->cancelled()) {
    t->cancelled = true;
    return 0;  // anything but n aborts the transfer
  }
  t->received += n;
  if (t->received > t->max_bytes) {
    t->too_large = true;
    return 0;
  }
  const bool success = t->reply.status >= 200 && t->reply.status < 300;
  if (success && t->sink && *t->sink) {
    if (!(*t->sink)(std::string_view(data, n))) {
      t->sink_stopped = true;
      return 0;
    }
  } else if (t->reply.body.size() < kErrorBodyKept || success) {
    t->reply.body.append(data, n);
  }
  return n;
}

std::string seconds_text(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", s);
  return text;
}

Error transport_error(ErrorCode code, std::string message, bool transient) {
  Error e{code, secrets::redact(message), {}, {}};
  e.transient = transient;
  return e;
}

}  // namespace

struct HttpClient::Pool {
  struct Connection {
    CURLM* multi = nullptr;
    CURL* easy = nullptr;
  };
  std::mutex mu;
  std::vector<Connection> idle;

  Connection acquire() {
    {
      std::lock_guard lock(mu);
      if (!idle.empty()) {
        Connection c = idle.back();
        idle.pop_back();
        return c;
      }
    }
    return Connection{curl_multi_init(), curl_easy_init()};
  }

  void release(Connection c) {
    {
      std::lock_guard lock(mu);
      if (idle.size() < kMaxIdle) {
        idle.push_back(c);
        return;
      }
    }
    destroy(c);
  }

  static void destroy(Connection c) {
    if (c.easy) curl_easy_cleanup(c.easy);
    if (c.multi) curl_multi_cleanup(c.multi);
  }

  ~Pool() {
    for (auto& c : idle) destroy(c);
  }
};

HttpClient::HttpClient() : pool_(std::make_unique<Pool>()) { init_curl_once(); }

HttpClient::~HttpClient() = default;

Result<HttpReply> HttpClient::send(const HttpPost& post, const BodySink& sink) {
  const auto start = Clock::now();
  const double timeout_s = std::clamp(post.timeout_s, 0.0, 1e6);  // no overflow in the arithmetic below
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  if (post.cancel && post.cancel->cancelled())
    return tl::unexpected(transport_error(ErrorCode::Cancelled, "cancelled before the request to " + post.url, false));
  if (timeout_s <= 0)
    return tl::unexpected(transport_error(ErrorCode::Timeout, "no time left to send the request to " + post.url, false));

  auto connection = pool_->acquire();
  if (!connection.multi || !connection.easy) {
    Pool::destroy(connection);
    return tl::unexpected(transport_error(ErrorCode::Internal, "libcurl could not create a handle", false));
  }
  CURL* easy = connection.easy;
  curl_easy_reset(easy);  // keeps the live connection, forgets the previous request's options

  Transfer transfer;
  transfer.sink = &sink;
  transfer.cancel = post.cancel;
  transfer.max_bytes = post.max_reply_bytes;
  char error_text[CURL_ERROR_SIZE] = {0};

  curl_slist* headers = nullptr;
  for (const auto& h : post.headers) headers = curl_slist_append(headers, h.c_str());
  headers = curl_slist_append(headers, "Content-Type: application/json");
  headers = curl_slist_append(headers, "Expect:");  // no 100-continue round trip before the body

  const long timeout_ms = std::max(1L, long(std::ceil(timeout_s * 1000.0)));
  const long connect_ms =
      std::max(1L, std::min(timeout_ms, long(std::ceil(std::clamp(post.connect_timeout_s, 0.0, 1e6) * 1000.0))));
  curl_easy_setopt(easy, CURLOPT_URL, post.url.c_str());
  curl_easy_setopt(easy, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(easy, CURLOPT_POST, 1L);
  curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE_LARGE, curl_off_t(post.body.size()));
  curl_easy_setopt(easy, CURLOPT_POSTFIELDS, post.body.data());
  curl_easy_setopt(easy, CURLOPT_HTTPHEADER, headers);
  static const std::string user_agent = std::string("stitchcuda/") + version();
  curl_easy_setopt(easy, CURLOPT_USERAGENT, user_agent.c_str());
  curl_easy_setopt(easy, CURLOPT_NOPROXY, no_proxy_list().c_str());
  curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);  // threads: no SIGALRM for DNS timeouts
  curl_easy_setopt(easy, CURLOPT_TCP_KEEPALIVE, 1L);  // long generations idle the connection
  curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, connect_ms);
  curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, timeout_ms);
  curl_easy_setopt(easy, CURLOPT_ERRORBUFFER, error_text);
  curl_easy_setopt(easy, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(easy, CURLOPT_HEADERDATA, &transfer);
  curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(easy, CURLOPT_WRITEDATA, &transfer);

  CURLM* multi = connection.multi;
  curl_multi_add_handle(multi, easy);
  CURLcode result = CURLE_OK;
  bool finished = false;
  bool past_deadline = false;
  for (;;) {
    int running = 0;
    if (curl_multi_perform(multi, &running) != CURLM_OK) break;
    if (running == 0) {
      int queued = 0;
      while (CURLMsg* msg = curl_multi_info_read(multi, &queued)) {
        if (msg->msg == CURLMSG_DONE) {
          result = msg->data.result;
          finished = true;
        }
      }
      break;
    }
    if (post.cancel && post.cancel->cancelled()) {
      transfer.cancelled = true;
      break;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      past_deadline = true;
      break;
    }
    curl_multi_poll(multi, nullptr, 0, int(std::min<long long>(left, kPollMs)), nullptr);
  }
  curl_multi_remove_handle(multi, easy);
  curl_easy_reset(easy);  // no pointer into this call (headers, buffers, callbacks' data) outlives it
  curl_slist_free_all(headers);
  pool_->release(connection);

  const auto elapsed_s = std::chrono::duration<double>(Clock::now() - start).count();
  if (transfer.cancelled)
    return tl::unexpected(transport_error(ErrorCode::Cancelled, "cancelled while waiting for " + post.url, false));
  if (transfer.too_large)
    return tl::unexpected(transport_error(
        ErrorCode::LlmError,
        "the reply from " + post.url + " exceeds the limit of " + std::to_string(post.max_reply_bytes) +
            " bytes (max_reply_bytes); raise it if such replies are expected",
        false));
  if (transfer.sink_stopped)
    return tl::unexpected(transport_error(ErrorCode::Internal, std::string(kStoppedBySink), false));
  if (past_deadline || (finished && result == CURLE_OPERATION_TIMEDOUT)) {
    // A connect timeout with time to spare is a connection failure worth retrying; running out
    // of the call's time is not.
    const bool connect_phase = transfer.reply.status == 0 && elapsed_s + 1e-3 < timeout_s;
    if (connect_phase)
      return tl::unexpected(transport_error(
          ErrorCode::LlmError,
          "could not connect to " + post.url + " within the " + seconds_text(post.connect_timeout_s) +
              " s connect timeout",
          true));
    return tl::unexpected(transport_error(
        ErrorCode::Timeout,
        "no complete reply from " + post.url + " within the " + seconds_text(timeout_s) + " s timeout (" +
            (transfer.reply.status == 0 ? std::string("no response had begun")
                                        : std::to_string(transfer.received) + " bytes of the reply had arrived") +
            "); raise timeout_s if the model needs longer",
        false));
  }
  if (!finished)
    return tl::unexpected(transport_error(ErrorCode::Internal, "libcurl stopped driving the request to " + post.url, false));
  if (result == CURLE_OK) return std::move(transfer.reply);

  const std::string detail = error_text[0] ? std::string(error_text) : std::string(curl_easy_strerror(result));
  switch (result) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_SSL_CONNECT_ERROR:
      return tl::unexpected(transport_error(ErrorCode::LlmError, "could not reach " + post.url + ": " + detail +
                                                                     "; is the server running at that address?",
                                            true));
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return tl::unexpected(
          transport_error(ErrorCode::LlmError, "the connection to " + post.url + " broke: " + detail, true));
    case CURLE_URL_MALFORMAT:
    case CURLE_UNSUPPORTED_PROTOCOL:
      return tl::unexpected(transport_error(ErrorCode::InvalidArgument,
                                            "the URL '" + post.url + "' cannot be used: " + detail, false));
    default:
      return tl::unexpected(
          transport_error(ErrorCode::LlmError, "the request to " + post.url + " failed: " + detail, false));
  }
}

}  // namespace stitchcuda::llm::detail
