// Anthropic's Messages API: the system prompt apart, max_tokens required, x-api-key and
// anthropic-version headers, and its typed stream events (message_start ... message_stop).
#include <stitchcuda/llm.hpp>

#include "http_backend.hpp"

namespace stitchcuda::llm {
namespace {

using detail::Json;
using detail::text_field;

constexpr std::string_view kHostedUrl = "https://api.anthropic.com";
constexpr std::string_view kDefaultKeyVariable = "ANTHROPIC_API_KEY";
constexpr std::string_view kEndpoint = "an Anthropic Messages endpoint";
constexpr int kDefaultMaxTokens = 4096;  // the API has no default; this fits every current model

// Anthropic's stop reasons in the OpenAI words Completion uses.
std::string finish_reason_of(const std::string& stop_reason) {
  if (stop_reason == "end_turn" || stop_reason == "stop_sequence") return "stop";
  if (stop_reason == "max_tokens") return "length";
  if (stop_reason == "tool_use") return "tool_calls";
  return stop_reason;
}

void read_usage(const Json& usage, Usage& out) {
  if (!usage.is_object()) return;
  // message_start carries the input count, message_delta the final output count.
  if (auto in = usage.find("input_tokens"); in != usage.end() && in->is_number()) out.prompt_tokens = in->get<std::int64_t>();
  if (auto o = usage.find("output_tokens"); o != usage.end() && o->is_number()) out.completion_tokens = o->get<std::int64_t>();
  out.total_tokens = out.prompt_tokens + out.completion_tokens;
}

// Both "https://api.anthropic.com" and ".../v1" are written as the base URL in the wild.
std::string messages_url(const ServerConfig& config) {
  const std::string base = detail::base_url_or(config.base_url, kHostedUrl);
  const bool has_version = base.size() >= 3 && base.compare(base.size() - 3, 3, "/v1") == 0;
  return base + (has_version ? "/messages" : "/v1/messages");
}

std::vector<std::string> headers_for(const ServerConfig& config, const std::string& key) {
  std::vector<std::string> headers;
  if (!key.empty()) headers.push_back("x-api-key: " + key);
  headers.push_back("anthropic-version: " + config.anthropic_version);
  for (const auto& [name, value] : config.headers) headers.push_back(name + ": " + value);
  return headers;
}

class AnthropicBackend final : public detail::HttpBackend {
 public:
  AnthropicBackend(ServerConfig config, const std::string& key, std::string key_variable)
      : HttpBackend(detail::backend_name("anthropic", config), messages_url(config), headers_for(config, key),
                    std::move(key_variable), !key.empty(), config.max_reply_bytes),
        model_(config.model) {}

 private:
  Result<std::string> request_body(const std::vector<Message>& messages, const Options& options) const override {
    if (auto ok = detail::check_messages(messages); !ok) return tl::unexpected(ok.error());
    if (!options.json_schema.empty())
      return fail(ErrorCode::InvalidArgument,
                  "json_schema is not supported by the Anthropic backend: describe the format in the prompt, "
                  "or use an OpenAI-compatible server");
    std::string system;
    Json list = Json::array();
    for (const auto& m : messages) {
      if (m.role == "system") {
        system += (system.empty() ? "" : "\n\n") + m.content;  // the API takes one system prompt
      } else {
        list.push_back({{"role", m.role}, {"content", m.content}});
      }
    }
    if (list.empty())
      return fail(ErrorCode::InvalidArgument,
                  "the Anthropic API needs a user message besides the system prompt");
    Json body = {{"model", model_},
                 {"messages", std::move(list)},
                 {"max_tokens", options.max_tokens.value_or(kDefaultMaxTokens)}};
    if (!system.empty()) body["system"] = system;
    if (options.temperature) body["temperature"] = *options.temperature;
    if (options.top_p) body["top_p"] = *options.top_p;
    if (!options.stop.empty()) body["stop_sequences"] = options.stop;
    if (options.stream) body["stream"] = true;
    if (auto ok = detail::merge_extra(body, options); !ok) return tl::unexpected(ok.error());
    return body.dump();
  }

  Result<Completion> read_reply(const std::string& body, const std::string& content_type) const override {
    const Json j = Json::parse(body, nullptr, false);
    if (j.is_discarded()) return tl::unexpected(unreadable_reply(body, content_type, kEndpoint, ""));
    auto content = j.is_object() ? j.find("content") : j.end();
    if (!j.is_object() || content == j.end() || !content->is_array())
      return tl::unexpected(wrong_shape(body, kEndpoint, "'content' list"));
    Completion c;
    for (const auto& block : *content)  // thinking and tool blocks are not the reply's text
      if (text_field(block, "type") == "text") c.text += text_field(block, "text");
    c.finish_reason = finish_reason_of(text_field(j, "stop_reason"));
    if (auto u = j.find("usage"); u != j.end()) read_usage(*u, c.usage);
    c.model = text_field(j, "model");
    c.id = text_field(j, "id");
    return c;
  }

  bool read_event(std::string_view event, std::string_view data, detail::StreamState& state,
                  const TextCallback& on_text) const override {
    const Json j = Json::parse(data, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      state.error = malformed_event(data);
      return false;
    }
    const std::string type = event.empty() ? text_field(j, "type") : std::string(event);
    Completion& c = state.completion;
    if (type == "message_start") {
      const Json message = j.value("message", Json::object());
      c.id = text_field(message, "id");
      c.model = text_field(message, "model");
      if (auto u = message.find("usage"); u != message.end()) read_usage(*u, c.usage);
    } else if (type == "content_block_delta") {
      const Json delta = j.value("delta", Json::object());
      if (text_field(delta, "type") == "text_delta") state.deliver(text_field(delta, "text"), on_text);
    } else if (type == "message_delta") {
      if (std::string stop = text_field(j.value("delta", Json::object()), "stop_reason"); !stop.empty())
        c.finish_reason = finish_reason_of(stop);
      if (auto u = j.find("usage"); u != j.end()) read_usage(*u, c.usage);
    } else if (type == "message_stop") {
      state.complete = true;
    } else if (type == "error") {
      const Json error = j.value("error", Json::object());
      Error e = detail::llm_error(name() + " reported an error in its stream: " + text_field(error, "message") + " (" +
                                      text_field(error, "type") + ")",
                                  std::string(data), 200);
      // An overloaded server mid-stream is worth a retry, as long as nothing was delivered yet.
      e.transient = state.delivered == 0 && text_field(error, "type") == "overloaded_error";
      state.error = std::move(e);
      return false;
    }
    return true;  // ping, content_block_start/stop and event types added later
  }

  std::string_view missing_end() const override { return "without message_stop"; }

  std::string model_;
};

}  // namespace

Result<std::shared_ptr<Backend>> anthropic_backend(ServerConfig config) {
  return detail::make_http_backend<AnthropicBackend>(std::move(config), "anthropic", kDefaultKeyVariable);
}

}  // namespace stitchcuda::llm
