// HttpBackend: one request/reply exchange shared by the protocols (plain or streamed), and the
// pieces both need: checks, keys, server error texts and the classification of statuses.
#include "http_backend.hpp"

#include "event_stream.hpp"
#include <stitchcuda/detail/settings.hpp>
#include <stitchcuda/secrets.hpp>

namespace stitchcuda::llm::detail {

void StreamState::deliver(const std::string& piece, const TextCallback& on_text) {
  if (piece.empty()) return;
  completion.text += piece;
  delivered += piece.size();
  if (on_text) on_text(piece);
}

HttpBackend::HttpBackend(std::string name, std::string url, std::vector<std::string> headers,
                         std::string key_variable, bool key_sent, std::size_t max_reply_bytes)
    : Backend(std::move(name)),
      url_(std::move(url)),
      headers_(std::move(headers)),
      key_variable_(std::move(key_variable)),
      key_sent_(key_sent),
      max_reply_bytes_(max_reply_bytes) {}

Result<Completion> HttpBackend::complete(const std::vector<Message>& messages, const Options& options,
                                         const TextCallback& on_text) {
  const auto start = std::chrono::steady_clock::now();
  auto body = request_body(messages, options);
  if (!body) return tl::unexpected(body.error());
  HttpPost post{url_, headers_, std::move(*body), options.connect_timeout_s, options.timeout_s, &options.cancel,
                max_reply_bytes_};
  Result<Completion> done = options.stream ? streamed(std::move(post), on_text) : plain(post);
  if (done) done->latency_ms = ms_since(start);
  return done;
}

Result<Completion> HttpBackend::plain(const HttpPost& post) {
  auto reply = http_.send(post);
  if (!reply) return tl::unexpected(reply.error());
  if (reply->status < 200 || reply->status >= 300)
    return tl::unexpected(status_error(*reply, name(), url_, key_variable_, key_sent_));
  return read_reply(reply->body, reply->content_type);
}

Result<Completion> HttpBackend::streamed(HttpPost post, const TextCallback& on_text) {
  post.headers.push_back("Accept: text/event-stream");
  StreamState state;
  EventStreamParser parser([&](std::string_view event, std::string_view data) {
    state.any_event = true;
    return read_event(event, data, state, on_text);
  });
  auto reply = http_.send(post, [&](std::string_view bytes) {
    if (!state.any_event) state.raw.append(bytes);
    return parser.feed(bytes);
  });
  if (state.error) return tl::unexpected(*state.error);
  if (!reply) {
    Error e = reply.error();
    if (state.delivered > 0 && e.code == ErrorCode::LlmError) {
      // Pieces already reached the caller: sending the request again would repeat them.
      e.message = "the stream from " + name() + " was cut after " + std::to_string(state.delivered) +
                  " characters of the reply (" + e.message + ")";
      e.log = secrets::redact(state.completion.text);
      e.transient = false;
    }
    return tl::unexpected(std::move(e));
  }
  if (reply->status < 200 || reply->status >= 300)
    return tl::unexpected(status_error(*reply, name(), url_, key_variable_, key_sent_));
  if (!state.any_event) {
    // Not a stream: a server that ignores stream=true, or one that does not speak this protocol.
    auto whole = read_reply(state.raw, reply->content_type);
    if (whole && on_text && !whole->text.empty()) on_text(whole->text);
    return whole;
  }
  if (!state.complete) {
    Error e = llm_error("the stream from " + name() + " ended after " + std::to_string(state.delivered) +
                            " characters " + std::string(missing_end()) + ": the reply is incomplete",
                        state.completion.text, 200);
    e.transient = state.delivered == 0;
    return tl::unexpected(std::move(e));
  }
  return std::move(state.completion);
}

Error HttpBackend::unreadable_reply(const std::string& body, const std::string& content_type,
                                    std::string_view endpoint, std::string_view hint) const {
  if (content_type.find("json") != std::string::npos)
    return llm_error(name() + " sent malformed JSON: " + excerpt(body), body, 200);
  return llm_error(url_ + " is not " + std::string(endpoint) + ": it answered " +
                       (content_type.empty() ? std::string("a body without a content type") : content_type) +
                       " instead of JSON: " + excerpt(body) + std::string(hint),
                   body, 200);
}

Error HttpBackend::wrong_shape(const std::string& body, std::string_view endpoint, std::string_view missing) const {
  const std::string said = server_message(body);
  if (!said.empty()) return llm_error(name() + " answered with an error: " + said, body, 200);
  return llm_error(url_ + " is not " + std::string(endpoint) + ": its JSON reply has no " + std::string(missing) +
                       ": " + excerpt(body),
                   body, 200);
}

Error HttpBackend::malformed_event(std::string_view data) const {
  return llm_error(name() + " sent malformed JSON in its stream: " + excerpt(data), std::string(data), 200);
}

Result<void> check_messages(const std::vector<Message>& messages) {
  if (messages.empty()) return fail(ErrorCode::InvalidArgument, "no messages: a request needs at least one user message");
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const auto& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant")
      return fail(ErrorCode::InvalidArgument, "message " + std::to_string(i) + " has role '" + role +
                                                  "'; roles are 'system', 'user' and 'assistant'");
  }
  return {};
}

std::string text_field(const Json& j, const char* key) {
  if (!j.is_object()) return {};
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

Result<Json> parse_object(std::string_view text, std::string_view field) {
  Json value = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded() || !value.is_object())
    return fail(ErrorCode::InvalidArgument,
                std::string(field) + " must be a JSON object, got: " + excerpt(text, 120));
  return value;
}

Result<void> merge_extra(Json& body, const Options& options) {
  if (options.extra_json.empty()) return {};
  auto extra = parse_object(options.extra_json, "extra_json");
  if (!extra) return tl::unexpected(extra.error());
  body.merge_patch(*extra);  // the caller's fields win, so any server-specific knob can be set
  return {};
}

std::string excerpt(std::string_view body, std::size_t limit) {
  std::string out;
  for (char c : body.substr(0, limit)) out += (c == '\n' || c == '\r' || c == '\t') ? ' ' : c;
  if (body.size() > limit) out += "...";
  return out;
}

std::string server_message(std::string_view body) {
  Json j = Json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return {};
  if (auto e = j.find("error"); e != j.end()) {
    if (e->is_string()) return e->get<std::string>();
    if (e->is_object()) {
      if (auto m = e->find("message"); m != e->end() && m->is_string()) return m->get<std::string>();
    }
  }
  if (auto m = j.find("message"); m != j.end() && m->is_string()) return m->get<std::string>();
  if (auto d = j.find("detail"); d != j.end() && d->is_string()) return d->get<std::string>();  // FastAPI servers
  return {};
}

Error llm_error(std::string message, std::string log, int http_status) {
  Error e{ErrorCode::LlmError, secrets::redact(message), secrets::redact(log), {}};
  e.http_status = http_status;
  return e;
}

Error status_error(const HttpReply& reply, const std::string& backend, const std::string& url,
                   const std::string& key_variable, bool key_sent) {
  const long s = reply.status;
  const bool transient = s == 408 || s == 409 || s == 429 || s >= 500;
  std::string said = server_message(reply.body);
  if (said.empty()) said = reply.body.empty() ? "(empty body)" : excerpt(reply.body);
  std::string what;
  std::string fix;
  if (s == 401 || s == 403) {
    what = s == 401 ? "unauthorized" : "forbidden";
    fix = key_sent ? "check the API key in " + key_variable + " and that it may use this model"
                   : "no API key was sent: set " + key_variable;
  } else if (s == 404) {
    what = "not found";
    fix = "check the model name and the base URL (the request went to " + url + ")";
  } else if (s == 400 || s == 422) {
    what = "bad request";
    fix = "the server rejected the request's fields; see its message";
  } else if (s == 429) {
    what = "rate limited";
  } else if (s == 529) {
    what = "overloaded";
  } else if (s >= 500) {
    what = "server error";
  } else {
    what = "unexpected status";
  }
  std::string message = backend + " answered HTTP " + std::to_string(s) + " (" + what + "): " + said;
  if (!fix.empty()) message += "; " + fix;
  Error e = llm_error(std::move(message), reply.body, int(s));
  e.transient = transient;
  e.retry_after_s = reply.retry_after_s;
  return e;
}

Result<std::string> api_key(const ServerConfig& config, const std::string& variable, std::string_view provider) {
  if (!config.api_key.empty()) {
    secrets::remember(config.api_key);
    return config.api_key;
  }
  if (auto value = stitchcuda::detail::environment(variable)) {
    secrets::remember(*value);
    return *value;
  }
  // A local server usually needs no key; the hosted API always does, and so does a named variable.
  if (config.base_url.empty() || !config.api_key_env.empty())
    return fail(ErrorCode::Unavailable,
                std::string(provider) + " needs an API key: set the environment variable " + variable +
                    " (export " + variable + "=...), or name another variable with api_key_env");
  return std::string();
}

std::string backend_name(std::string_view provider, const ServerConfig& config) {
  std::string name = std::string(provider) + ":" + config.model;
  if (!config.base_url.empty()) name += "@" + config.base_url;
  return name;
}

std::string base_url_or(const std::string& base_url, std::string_view hosted) {
  std::string url = base_url.empty() ? std::string(hosted) : base_url;
  while (!url.empty() && url.back() == '/') url.pop_back();
  return url;
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace stitchcuda::llm::detail
