// The agents that talk to a model: the Planner (and the Replanner built on it) writes a validated plan,
// the Coder writes or revises a candidate. Each renders its prompt from the library, adds the retrieved
// documentation, calls the backend, and re-asks a bounded number of times when the reply is unusable.
#include <stitchcuda/agents.hpp>

#include <chrono>
#include <exception>
#include <optional>
#include <type_traits>

namespace stitchcuda::agents {
namespace {

// The retrieved sections as prompt text, and their ids for the record.
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

// One call to the model, recorded as an Exchange whether it succeeded or not.
Exchange call(llm::Backend& llm, const llm::Options& options, std::string agent, std::vector<llm::Message> messages,
              const Prompt& prompt, const std::vector<std::string>& snippets, Error* error) {
  Exchange e;
  e.agent = std::move(agent);
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
  return e;
}

// Asks until `parse` accepts a reply: an unusable one is answered with parse's error and `again`, up to
// `repairs` times. Every call is appended to `exchanges`. A backend error ends it; so does running out
// of repairs, which leaves `problem` with the last reply's fault and returns nothing.
template <class Parse>
Result<std::optional<std::invoke_result_t<Parse, const Exchange&>>> converse(
    llm::Backend& llm, const AgentOptions& options, const std::string& agent, const Prompt& prompt,
    const std::vector<std::string>& snippets, std::string text, Parse parse, const std::string& again,
    std::vector<Exchange>& exchanges, std::string& problem) {
  std::vector<llm::Message> messages{{"user", std::move(text)}};
  for (int round = 0; round <= options.max_repairs; ++round) {
    Error error;
    Exchange e = call(llm, options.llm, agent, messages, prompt, snippets, &error);
    const bool failed = !e.error.empty();
    exchanges.push_back(e);
    if (failed) return tl::unexpected(error);
    auto parsed = parse(e);
    if (parsed) return std::optional(std::move(parsed));
    problem = parsed.error().message;
    messages.push_back({"assistant", e.reply});
    messages.push_back({"user", "Your answer cannot be used: " + problem + "\n" + again});
  }
  return std::nullopt;
}

}  // namespace

Planner::Planner(std::shared_ptr<llm::Backend> llm, std::shared_ptr<const PromptLibrary> prompts,
                 std::shared_ptr<const Retriever> docs, AgentOptions options)
    : llm_(std::move(llm)), prompts_(std::move(prompts)), docs_(std::move(docs)), options_(std::move(options)) {}

Result<PlanResult> Planner::ask(const std::string& agent, const std::string& prompt_name,
                                std::map<std::string, std::string> values, const std::string& query) const {
  if (!llm_ || !prompts_) return fail(ErrorCode::InvalidArgument, "the " + agent + " needs a model backend and prompts");
  auto prompt = prompts_->get(prompt_name);
  if (!prompt) return tl::unexpected(prompt.error());
  auto [docs, ids] = retrieve(docs_.get(), options_.doc_snippets, query);
  values["docs"] = docs;
  values["schema"] = plan_schema();
  auto text = prompts_->render(prompt_name, values);
  if (!text) return tl::unexpected(text.error());

  PlanResult result;
  std::string problem;
  auto plan = converse(*llm_, options_, agent, **prompt, ids, std::move(*text),
                       [](const Exchange& e) { return Plan::parse(e.reply); },
                       "Answer again with only the corrected JSON object that follows the schema.", result.exchanges,
                       problem);
  if (!plan) return tl::unexpected(plan.error());
  if (!*plan)
    return fail(ErrorCode::LlmError, "the " + agent + "'s model gave no valid plan in " +
                                         std::to_string(options_.max_repairs + 1) + " replies; the last: " + problem);
  result.plan = std::move(***plan);
  return result;
}

Result<PlanResult> Planner::plan(const Problem& problem) const {
  return ask("planner", "planner",
             {{"reference", problem.reference}, {"hardware", problem.hardware.describe()}, {"profile", problem.profile}},
             problem.reference + "\n" + problem.profile);
}

Result<PlanResult> Replanner::replan(const Problem& problem, const Plan& previous,
                                     const std::vector<AttemptSummary>& history) const {
  std::string lines;
  for (const AttemptSummary& a : history) lines += "attempt " + std::to_string(a.index) + ": " + a.outcome + "\n";
  return ask("replanner", "replanner",
             {{"reference", problem.reference},
              {"hardware", problem.hardware.describe()},
              {"previous_plan", previous.describe()},
              {"history", lines},
              {"profile", problem.profile}},
             lines + previous.summary);
}

Coder::Coder(std::shared_ptr<llm::Backend> llm, std::shared_ptr<const PromptLibrary> prompts,
             std::shared_ptr<const Retriever> docs, AgentOptions options)
    : llm_(std::move(llm)), prompts_(std::move(prompts)), docs_(std::move(docs)), options_(std::move(options)) {}

Result<CoderResult> Coder::write(const CoderRequest& request) const {
  if (!llm_ || !prompts_) return fail(ErrorCode::InvalidArgument, "the Coder needs a model backend and prompts");
  if (request.problem == nullptr) return fail(ErrorCode::InvalidArgument, "CoderRequest.problem is required");
  const bool from_plan = request.skill == rubric::Skill::from_plan;
  if (from_plan && request.plan == nullptr)
    return fail(ErrorCode::InvalidArgument, "Skill 1 (from the plan) needs CoderRequest.plan");
  if (!from_plan && (request.previous.empty() || request.feedback.empty()))
    return fail(ErrorCode::InvalidArgument, "Skill 2 (from feedback) needs CoderRequest.previous and .feedback");

  const std::string plan_text = request.plan ? request.plan->describe() : "";
  const std::string prompt_name = from_plan ? "coder_plan" : "coder_feedback";
  auto prompt = prompts_->get(prompt_name);
  if (!prompt) return tl::unexpected(prompt.error());
  auto [docs, ids] = retrieve(docs_.get(), options_.doc_snippets, from_plan ? plan_text : request.feedback);
  std::map<std::string, std::string> values{{"reference", request.problem->reference},
                                            {"plan", plan_text},
                                            {"hardware", request.problem->hardware.describe()},
                                            {"docs", docs}};
  if (!from_plan) values["previous"] = request.previous, values["feedback"] = request.feedback;
  auto text = prompts_->render(prompt_name, values);
  if (!text) return tl::unexpected(text.error());

  CoderResult result;
  std::string problem;
  auto extraction = converse(*llm_, options_, "coder", **prompt, ids, std::move(*text),
                             [](const Exchange& e) { return extract_code(e.reply, e.finish_reason); },
                             "Answer again with one complete ```python block that defines class ModelNew.",
                             result.exchanges, problem);
  if (!extraction) return tl::unexpected(extraction.error());
  if (*extraction)
    result.extraction = std::move(***extraction);
  else
    result.problem = "the Coder's model gave no usable candidate in " + std::to_string(options_.max_repairs + 1) +
                     " replies; the last: " + problem;
  return result;
}

}  // namespace stitchcuda::agents
