// The Planner: renders its prompt with the reference, the GPU, the profile and retrieved documentation,
// and re-asks a bounded number of times until the reply is a valid ProblemPlan. The Replanner
// (replanner.cpp) asks the same way with its own prompt.
#include <stitchcuda/agents.hpp>

#include "conversation.hpp"

namespace stitchcuda::agents {

Planner::Planner(std::shared_ptr<llm::Backend> llm, std::shared_ptr<const PromptLibrary> prompts,
                 std::shared_ptr<const Retriever> docs, AgentOptions options)
    : llm_(std::move(llm)), prompts_(std::move(prompts)), docs_(std::move(docs)), options_(std::move(options)) {}

Result<ProblemPlanResult> Planner::ask(const std::string& agent, const std::string& prompt_name,
                                       std::map<std::string, std::string> values, const std::string& query) const {
  if (!llm_ || !prompts_) return fail(ErrorCode::InvalidArgument, "the " + agent + " needs a model backend and prompts");
  auto prompt = prompts_->get(prompt_name);
  if (!prompt) return tl::unexpected(prompt.error());
  auto [docs, ids] = detail::retrieve(docs_.get(), options_.doc_snippets, query);
  values["docs"] = docs;
  values["schema"] = problem_plan_schema();
  auto text = prompts_->render(prompt_name, values);
  if (!text) return tl::unexpected(text.error());

  ProblemPlanResult result;
  std::string problem;
  auto plan = detail::converse(*llm_, options_, agent, **prompt, ids, std::move(*text),
                               [](const Exchange& e) { return ProblemPlan::parse(e.reply); },
                               "Answer again with only the corrected JSON object that follows the schema.",
                               result.exchanges, problem);
  if (!plan) return tl::unexpected(plan.error());
  if (!*plan)
    return fail(ErrorCode::LlmError, "the " + agent + "'s model gave no valid plan in " +
                                         std::to_string(options_.max_repairs + 1) + " replies; the last: " + problem);
  result.plan = std::move(***plan);
  return result;
}

Result<ProblemPlanResult> Planner::plan(const Problem& problem) const {
  return ask("planner", "planner",
             {{"reference", problem.reference}, {"hardware", problem.hardware.describe()}, {"profile", problem.profile},
              // The plan is for what the Coder will answer: a ModelNew, or one kernel step of a graph target.
              {"model_new", problem.answer == "kernel_step" ? "" : "1"},
              {"kernel_step", problem.answer == "kernel_step" ? "1" : ""},
              {"target", problem.target}},
             problem.reference + "\n" + problem.profile);
}

}  // namespace stitchcuda::agents
