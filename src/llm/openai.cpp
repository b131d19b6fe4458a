// The OpenAI chat-completions protocol, spoken by OpenAI and by local servers (vLLM, SGLang,
// llama.cpp, Ollama): the request body, the reply, and the stream's chunks.
#include <stitchcuda/llm.hpp>

#include "http_backend.hpp"

namespace stitchcuda::llm {
namespace {

using detail::Json;
using detail::text_field;

constexpr std::string_view kHostedUrl = "https://api.openai.com/v1";
constexpr std::string_view kDefaultKeyVariable = "OPENAI_API_KEY";
constexpr std::string_view kEndpoint = "an OpenAI-compatible chat-completions endpoint";

void read_usage(const Json& usage, Usage& out) {
  if (!usage.is_object()) return;
  out.prompt_tokens = usage.value("prompt_tokens", std::int64_t{0});
  out.completion_tokens = usage.value("completion_tokens", std::int64_t{0});
  out.total_tokens = usage.value("total_tokens", out.prompt_tokens + out.completion_tokens);
}

std::vector<std::string> headers_for(const ServerConfig& config, const std::string& key) {
  std::vector<std::string> headers;
  if (!key.empty()) headers.push_back("Authorization: Bearer " + key);
  if (!config.organization.empty()) headers.push_back("OpenAI-Organization: " + config.organization);
  for (const auto& [name, value] : config.headers) headers.push_back(name + ": " + value);
  return headers;
}

class OpenAIBackend final : public detail::HttpBackend {
 public:
  OpenAIBackend(ServerConfig config, const std::string& key, std::string key_variable)
      : HttpBackend(detail::backend_name("openai", config),
                    detail::base_url_or(config.base_url, kHostedUrl) + "/chat/completions", headers_for(config, key),
                    std::move(key_variable), !key.empty(), config.max_reply_bytes),
        model_(config.model),
        hosted_(config.base_url.empty()) {}

 private:
  Result<std::string> request_body(const std::vector<Message>& messages, const Options& options) const override {
    if (auto ok = detail::check_messages(messages); !ok) return tl::unexpected(ok.error());
    Json list = Json::array();
    for (const auto& m : messages) list.push_back({{"role", m.role}, {"content", m.content}});
    Json body = {{"model", model_}, {"messages", std::move(list)}};
    if (options.temperature) body["temperature"] = *options.temperature;
    if (options.top_p) body["top_p"] = *options.top_p;
    // OpenAI's newer models take only max_completion_tokens; local servers know max_tokens.
    if (options.max_tokens) body[hosted_ ? "max_completion_tokens" : "max_tokens"] = *options.max_tokens;
    if (!options.stop.empty()) body["stop"] = options.stop;
    if (options.seed) body["seed"] = *options.seed;
    if (!options.json_schema.empty()) {
      auto schema = detail::parse_object(options.json_schema, "json_schema");
      if (!schema) return tl::unexpected(schema.error());
      // A bare schema gets a name; {"name", "schema", "strict"} is passed as given.
      const bool wrapped = schema->contains("schema") && schema->contains("name");
      Json format = wrapped ? std::move(*schema) : Json{{"name", "reply"}, {"schema", std::move(*schema)}};
      body["response_format"] = {{"type", "json_schema"}, {"json_schema", std::move(format)}};
    }
    if (options.stream) {
      body["stream"] = true;
      body["stream_options"] = {{"include_usage", true}};  // else a streamed reply has no token counts
    }
    if (auto ok = detail::merge_extra(body, options); !ok) return tl::unexpected(ok.error());
    return body.dump();
  }

  Result<Completion> read_reply(const std::string& body, const std::string& content_type) const override {
    const Json j = Json::parse(body, nullptr, false);
    if (j.is_discarded())
      return tl::unexpected(unreadable_reply(body, content_type, kEndpoint, "; check the base URL (it usually ends in /v1)"));
    auto choices = j.is_object() ? j.find("choices") : j.end();
    if (!j.is_object() || choices == j.end() || !choices->is_array())
      return tl::unexpected(wrong_shape(body, kEndpoint, "'choices' list"));
    if (choices->empty())
      return tl::unexpected(detail::llm_error(
          name() + " returned an empty choice list: the server produced no answer: " + detail::excerpt(body), body, 200));
    const Json& choice = choices->front();
    const Json message = choice.is_object() ? choice.value("message", Json::object()) : Json::object();
    if (const std::string refusal = text_field(message, "refusal"); !refusal.empty())
      return tl::unexpected(detail::llm_error(name() + ": the model refused: " + refusal, body, 200));
    Completion c;
    c.text = text_field(message, "content");  // null when the model only called tools
    c.finish_reason = text_field(choice, "finish_reason");
    if (auto u = j.find("usage"); u != j.end()) read_usage(*u, c.usage);
    c.model = text_field(j, "model");
    c.id = text_field(j, "id");
    return c;
  }

  bool read_event(std::string_view, std::string_view data, detail::StreamState& state,
                  const TextCallback& on_text) const override {
    if (data == "[DONE]") {
      state.complete = true;
      return true;
    }
    const Json j = Json::parse(data, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      state.error = malformed_event(data);
      return false;
    }
    if (j.contains("error")) {
      state.error = detail::llm_error(name() + " reported an error in its stream: " + detail::server_message(data),
                                      std::string(data), 200);
      return false;
    }
    Completion& c = state.completion;
    if (c.id.empty()) c.id = text_field(j, "id");
    if (c.model.empty()) c.model = text_field(j, "model");
    if (auto u = j.find("usage"); u != j.end()) read_usage(*u, c.usage);
    auto choices = j.find("choices");
    if (choices == j.end() || !choices->is_array() || choices->empty()) return true;  // e.g. the usage chunk
    const Json& choice = choices->front();
    if (auto delta = choice.find("delta"); delta != choice.end()) state.deliver(text_field(*delta, "content"), on_text);
    if (std::string finish = text_field(choice, "finish_reason"); !finish.empty()) {
      c.finish_reason = std::move(finish);
      state.complete = true;  // [DONE] may still follow, with the usage chunk before it
    }
    return true;
  }

  std::string_view missing_end() const override { return "without a finish_reason or [DONE]"; }

  std::string model_;
  bool hosted_;
};

}  // namespace

Result<std::shared_ptr<Backend>> openai_backend(ServerConfig config) {
  return detail::make_http_backend<OpenAIBackend>(std::move(config), "openai", kDefaultKeyVariable);
}

}  // namespace stitchcuda::llm
