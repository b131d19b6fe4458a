// The scripted backend: rules mapping a pattern in the last user message to replies, so tests
// (of agents, of the loop) get answers that depend on the prompt, without a server.
#include <stitchcuda/llm.hpp>

#include <chrono>
#include <fstream>
#include <mutex>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

namespace stitchcuda::llm {
namespace {

using Json = nlohmann::json;

// Scripted replies have no tokenizer; four characters a token is close enough for totals.
std::int64_t estimated_tokens(std::size_t chars) { return std::int64_t((chars + 3) / 4); }

class ScriptedBackend final : public Backend {
 public:
  struct CompiledRule {
    ScriptRule rule;
    std::regex pattern;
    std::size_t served = 0;
  };

  ScriptedBackend(std::vector<CompiledRule> rules, std::string name)
      : Backend(std::move(name)), rules_(std::move(rules)) {}

  Result<Completion> complete(const std::vector<Message>& messages, const Options& options,
                              const TextCallback& on_text) override {
    const auto start = std::chrono::steady_clock::now();
    const Message* last_user = nullptr;
    std::size_t prompt_chars = 0;
    for (const auto& m : messages) {
      prompt_chars += m.content.size();
      if (m.role == "user") last_user = &m;
    }
    if (!last_user) return fail(ErrorCode::InvalidArgument, "a scripted backend answers the last user message; there is none");
    Completion c;
    {
      std::lock_guard lock(mu_);  // rules advance through their replies
      CompiledRule* match = nullptr;
      for (auto& r : rules_)
        if (std::regex_search(last_user->content, r.pattern)) {
          match = &r;
          break;
        }
      if (!match) {
        std::string patterns;
        for (const auto& r : rules_) patterns += (patterns.empty() ? "'" : ", '") + r.rule.pattern + "'";
        std::string excerpt = last_user->content.substr(0, 120);
        return fail(ErrorCode::NotFound, "no scripted rule matches the last user message \"" + excerpt +
                                             "\" (patterns: " + (patterns.empty() ? "none" : patterns) + ")");
      }
      const auto& replies = match->rule.replies;
      c.text = replies[std::min(match->served, replies.size() - 1)];
      ++match->served;
    }
    c.finish_reason = "stop";
    c.model = name();
    c.usage.prompt_tokens = estimated_tokens(prompt_chars);
    c.usage.completion_tokens = estimated_tokens(c.text.size());
    c.usage.total_tokens = c.usage.prompt_tokens + c.usage.completion_tokens;
    if (options.stream && on_text && !c.text.empty()) on_text(c.text);
    c.latency_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    return c;
  }

 private:
  std::mutex mu_;
  std::vector<CompiledRule> rules_;
};

}  // namespace

Result<std::shared_ptr<Backend>> scripted_backend(std::vector<ScriptRule> rules, std::string name) {
  std::vector<ScriptedBackend::CompiledRule> compiled;
  for (std::size_t i = 0; i < rules.size(); ++i) {
    if (rules[i].replies.empty())
      return fail(ErrorCode::InvalidArgument, "scripted rule " + std::to_string(i) + " ('" + rules[i].pattern +
                                                  "') has no reply");
    try {
      std::regex pattern(rules[i].pattern, std::regex::ECMAScript);
      compiled.push_back({std::move(rules[i]), std::move(pattern), 0});
    } catch (const std::regex_error& e) {
      return fail(ErrorCode::InvalidArgument, "scripted rule " + std::to_string(i) + ": '" + rules[i].pattern +
                                                  "' is not a valid regular expression (" + e.what() + ")");
    }
  }
  return std::shared_ptr<Backend>(std::make_shared<ScriptedBackend>(std::move(compiled), std::move(name)));
}

Result<std::vector<ScriptRule>> load_script(const std::string& path) {
  std::ifstream in(path);
  if (!in) return fail(ErrorCode::IoError, "the script " + path + " cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  const Json j = Json::parse(text.str(), nullptr, false);
  const char* shape = "a JSON list of {\"pattern\": ..., \"reply\": ...} or {\"pattern\": ..., \"replies\": [...]}";
  if (j.is_discarded() || !j.is_array()) return fail(ErrorCode::InvalidArgument, "the script " + path + " is not " + shape);
  std::vector<ScriptRule> rules;
  for (const auto& item : j) {
    ScriptRule rule;
    if (!item.is_object() || !item.contains("pattern") || !item["pattern"].is_string())
      return fail(ErrorCode::InvalidArgument, "the script " + path + " is not " + shape);
    rule.pattern = item["pattern"].get<std::string>();
    if (auto r = item.find("reply"); r != item.end() && r->is_string()) rule.replies.push_back(r->get<std::string>());
    if (auto rs = item.find("replies"); rs != item.end() && rs->is_array())
      for (const auto& r : *rs)
        if (r.is_string()) rule.replies.push_back(r.get<std::string>());
    rules.push_back(std::move(rule));
  }
  return rules;
}

}  // namespace stitchcuda::llm
