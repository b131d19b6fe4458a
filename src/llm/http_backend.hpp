// The base of the HTTP backends (OpenAI-compatible, Anthropic): transport, timing, assembling a
// streamed reply, and the errors both protocols share. Each protocol supplies its formats.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>
#include <stitchcuda/llm.hpp>

#include "http.hpp"

namespace stitchcuda::llm::detail {

using Json = nlohmann::json;

/// A streamed reply as it is assembled, event by event.
struct StreamState {
  Completion completion;
  bool complete = false;       ///< the protocol's end marker arrived
  bool any_event = false;
  std::string raw;             ///< the bytes before the first event: a server that ignored stream=true
  std::size_t delivered = 0;   ///< characters passed to the caller's callback
  std::optional<Error> error;  ///< why the protocol stopped reading

  /// Appends a piece of text and passes it on.
  void deliver(const std::string& piece, const TextCallback& on_text);
};

/// One protocol over HTTP POST: complete() is shared; the formats are virtual.
class HttpBackend : public Backend {
 public:
  Result<Completion> complete(const std::vector<Message>& messages, const Options& options,
                              const TextCallback& on_text) final;

 protected:
  /// `headers` may hold the key (never printed); `key_variable` names where a key comes from.
  HttpBackend(std::string name, std::string url, std::vector<std::string> headers, std::string key_variable,
              bool key_sent, std::size_t max_reply_bytes);

  /// The JSON body of a request; InvalidArgument for unusable messages or options.
  virtual Result<std::string> request_body(const std::vector<Message>& messages, const Options& options) const = 0;
  /// A whole (not streamed) 2xx reply.
  virtual Result<Completion> read_reply(const std::string& body, const std::string& content_type) const = 0;
  /// One stream event; false stops the stream, with state.error saying why.
  virtual bool read_event(std::string_view event, std::string_view data, StreamState& state,
                          const TextCallback& on_text) const = 0;
  /// The words for "the end marker never came", e.g. "without a finish_reason or [DONE]".
  virtual std::string_view missing_end() const = 0;

  /// The error for a 2xx body this protocol cannot read: malformed JSON, or not JSON at all.
  Error unreadable_reply(const std::string& body, const std::string& content_type, std::string_view endpoint,
                         std::string_view hint) const;
  /// The error for a JSON reply without the field the protocol needs (the server's own error if it sent one).
  Error wrong_shape(const std::string& body, std::string_view endpoint, std::string_view missing) const;
  /// The error for malformed JSON inside a stream.
  Error malformed_event(std::string_view data) const;

  const std::string& url() const { return url_; }

 private:
  Result<Completion> plain(const HttpPost& post);
  Result<Completion> streamed(HttpPost post, const TextCallback& on_text);

  std::string url_;
  std::vector<std::string> headers_;
  std::string key_variable_;
  bool key_sent_;
  std::size_t max_reply_bytes_;
  HttpClient http_;
};

/// InvalidArgument unless there is a message and every role is system, user or assistant.
Result<void> check_messages(const std::vector<Message>& messages);

/// Parses a JSON object given as text in the option `field` ("extra_json", "json_schema").
Result<Json> parse_object(std::string_view text, std::string_view field);

/// Merges options.extra_json into a request body (its fields override); InvalidArgument if it is no object.
Result<void> merge_extra(Json& body, const Options& options);

/// The string at j[key], or "" when it is absent, null or not a string.
std::string text_field(const Json& j, const char* key);

/// The start of a body on one line, for error messages.
std::string excerpt(std::string_view body, std::size_t limit = 300);

/// The error text a server put in its body ({"error": {"message"}}, {"error": "..."}, {"message"}), or "".
std::string server_message(std::string_view body);

/// An LlmError with a redacted message and log.
Error llm_error(std::string message, std::string log = {}, int http_status = 0);

/// The Error for a non-2xx reply: LlmError with the status, the server's message and what to check;
/// transient (with the server's Retry-After) for 408, 409, 429, 5xx and 529.
Error status_error(const HttpReply& reply, const std::string& backend, const std::string& url,
                   const std::string& key_variable, bool key_sent);

/// The key to send: config.api_key, else the variable's value; "" where none is needed and none
/// is set. Unavailable, naming the variable, where one is needed (hosted API, or a variable named).
Result<std::string> api_key(const ServerConfig& config, const std::string& variable, std::string_view provider);

/// A backend B(config, key, key_variable) once the model is named and the key rule is met.
template <class B>
Result<std::shared_ptr<Backend>> make_http_backend(ServerConfig config, std::string_view provider,
                                                   std::string_view default_key_variable) {
  if (config.model.empty()) return fail(ErrorCode::InvalidArgument, std::string(provider) + " needs a model name");
  std::string variable = config.api_key_env.empty() ? std::string(default_key_variable) : config.api_key_env;
  auto key = api_key(config, variable, std::string(provider) + ":" + config.model);
  if (!key) return tl::unexpected(key.error());
  return std::shared_ptr<Backend>(std::make_shared<B>(std::move(config), *key, std::move(variable)));
}

/// "provider:model[@base_url]" for Backend::name.
std::string backend_name(std::string_view provider, const ServerConfig& config);

/// base_url without trailing slashes, or `hosted` when empty.
std::string base_url_or(const std::string& base_url, std::string_view hosted);

/// Milliseconds since `start`.
double ms_since(std::chrono::steady_clock::time_point start);

}  // namespace stitchcuda::llm::detail
