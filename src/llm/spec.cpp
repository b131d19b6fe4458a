// The spec string PROVIDER:MODEL[@BASE_URL] that the CLI and Python use to name a model, and
// connect(), which builds the named backend inside ReliableBackend.
#include <stitchcuda/llm.hpp>

#include <algorithm>

namespace stitchcuda::llm {
namespace {

constexpr std::string_view kSpecShape =
    "expected PROVIDER:MODEL[@BASE_URL], e.g. openai:gpt-4.1, openai:qwen3-32b@http://127.0.0.1:8000/v1, "
    "anthropic:claude-sonnet-4-5, replay:runs/x/llm.jsonl";

std::string provider_list() {
  std::string list;
  for (const auto& p : known_providers()) list += (list.empty() ? "" : ", ") + p;
  return list;
}

bool is_url(std::string_view text) { return text.rfind("http://", 0) == 0 || text.rfind("https://", 0) == 0; }

}  // namespace

std::vector<std::string> known_providers() { return {"openai", "anthropic", "replay", "scripted"}; }

Result<Spec> parse_spec(std::string_view text) {
  const auto colon = text.find(':');
  if (colon == std::string_view::npos || colon == 0)
    return fail(ErrorCode::InvalidArgument, "malformed model spec '" + std::string(text) + "': " + std::string(kSpecShape));
  Spec spec;
  spec.provider = std::string(text.substr(0, colon));
  std::string_view rest = text.substr(colon + 1);
  if (spec.provider == "python")
    return fail(ErrorCode::InvalidArgument, "'" + std::string(text) +
                                                "': python:MODULE:FUNCTION specs are resolved by the Python package "
                                                "(stitchcuda.llm.connect), not by the C++ library");
  const auto known = known_providers();
  if (std::find(known.begin(), known.end(), spec.provider) == known.end())
    return fail(ErrorCode::InvalidArgument, "unknown model provider '" + spec.provider + "' in '" + std::string(text) +
                                                "'; known providers: " + provider_list() +
                                                " (python: from Python); local servers such as vLLM and Ollama are "
                                                "openai:MODEL@BASE_URL");
  if (spec.provider == "replay" || spec.provider == "scripted") {
    // The rest is a path, which may hold '@' and ':'.
    if (rest.empty())
      return fail(ErrorCode::InvalidArgument, "malformed model spec '" + std::string(text) + "': " + spec.provider +
                                                  ": needs a file, e.g. " + spec.provider + ":runs/x/llm.jsonl");
    spec.model = std::string(rest);
    return spec;
  }
  const auto at = rest.find('@');
  spec.model = std::string(rest.substr(0, at));
  if (at != std::string_view::npos) {
    spec.base_url = std::string(rest.substr(at + 1));
    if (!is_url(spec.base_url))
      return fail(ErrorCode::InvalidArgument, "malformed model spec '" + std::string(text) + "': the base URL '" +
                                                  spec.base_url + "' must start with http:// or https://");
    while (!spec.base_url.empty() && spec.base_url.back() == '/') spec.base_url.pop_back();
  }
  if (spec.model.empty())
    return fail(ErrorCode::InvalidArgument, "malformed model spec '" + std::string(text) + "': no model name; " +
                                                std::string(kSpecShape));
  return spec;
}

Result<std::shared_ptr<ReliableBackend>> connect(std::string_view text, const ConnectOptions& options) {
  auto spec = parse_spec(text);
  if (!spec) return tl::unexpected(spec.error());
  Result<std::shared_ptr<Backend>> backend = fail(ErrorCode::Internal, "unset");
  if (spec->provider == "openai" || spec->provider == "anthropic") {
    ServerConfig server = options.server;
    server.model = spec->model;
    server.base_url = spec->base_url;
    backend = spec->provider == "openai" ? openai_backend(std::move(server)) : anthropic_backend(std::move(server));
  } else if (spec->provider == "replay") {
    backend = replay_backend(spec->model, options.replay_match);
  } else {
    auto rules = load_script(spec->model);
    if (!rules) return tl::unexpected(rules.error());
    backend = scripted_backend(std::move(*rules), "scripted:" + spec->model);
  }
  if (!backend) return tl::unexpected(backend.error());
  return ReliableBackend::wrap(std::move(*backend), options.reliability);
}

}  // namespace stitchcuda::llm
