// Retrieval for prompts and the recorded model call the Planner, Replanner and Coder share.
#include "conversation.hpp"

#include <chrono>
#include <exception>

#include <nlohmann/json.hpp>

namespace stitchcuda::agents::detail {

std::pair<std::string, std::vector<std::string>> retrieve(const Retriever* docs, std::size_t k,
                                                          const std::string& query) {
  std::pair<std::string, std::vector<std::string>> out;
  if (docs == nullptr || k == 0) return out;
  for (const Snippet& s : docs->search(query, k)) {
    out.first += s.text;
    if (!out.first.empty() && out.first.back() != '\n') out.first += '\n';
    out.first += '\n';
    out.second.push_back(s.id);
  }
  while (!out.first.empty() && out.first.back() == '\n') out.first.pop_back();
  return out;
}

Exchange call(llm::Backend& llm, const llm::Options& options, std::string agent, std::vector<llm::Message> messages,
              const Prompt& prompt, const std::vector<std::string>& snippets, Error* error) {
  Exchange e;
  e.agent = std::move(agent);
  e.model = llm.name();  // until the server names the model that answered
  e.messages = std::move(messages);
  e.prompt_name = prompt.name;
  e.prompt_sha256 = prompt.sha256;
  e.snippets = snippets;
  const auto start = std::chrono::steady_clock::now();
  Result<llm::Completion> reply = [&]() -> Result<llm::Completion> {
    try {
      return llm.complete(e.messages, options);
    } catch (const std::exception& ex) {  // a user's backend must not take the loop down
      return fail(ErrorCode::LlmError, std::string("the model backend threw: ") + ex.what());
    }
  }();
  e.latency_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!reply) {
    e.error = reply.error().message;
    *error = reply.error();
    return e;
  }
  e.reply = reply->text;
  e.finish_reason = reply->finish_reason;
  e.usage = reply->usage;
  if (!reply->model.empty()) e.model = reply->model;
  return e;
}

std::string fenced_candidate(const std::string& candidate) {
  auto fence = [](const char* language, std::string body) {
    if (body.empty() || body.back() != '\n') body += '\n';
    return std::string("```") + language + "\n" + body + "```";
  };
  // Its JSON text holds the source as one escaped string: unreadable for a model revising it.
  if (auto step = KernelStep::parse(candidate)) {
    nlohmann::ordered_json launch{{"kernel", step->kernel}, {"grid", step->grid}, {"block", step->block},
                          {"shared_bytes", step->shared_bytes}, {"args", step->args}};
    return fence("cuda", step->source) + "\n\n" +
           fence("json", launch.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
  }
  return fence("python", candidate);
}

}  // namespace stitchcuda::agents::detail
