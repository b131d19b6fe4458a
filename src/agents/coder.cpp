// The Coder: Skill 1 writes a candidate from the plan (coder_plan.md), Skill 2 revises the previous
// candidate from the Verifier's feedback (coder_feedback.md). What it must answer is the problem's:
// the contract of prompts/answer_<answer>.md is rendered into the prompt's {{answer}}, and the reply is
// read as that answer, re-asked a bounded number of times when it is unusable.
#include <stitchcuda/agents.hpp>

#include "conversation.hpp"

namespace stitchcuda::agents {
namespace {

/// How the Coder reads one kind of answer, and what it asks for when a reply is unusable.
struct AnswerFormat {
  std::string prompt;  ///< the contract's template
  std::string again;   ///< the re-ask's instruction
  Result<Extraction> (*extract)(const Exchange&);
};

Result<Extraction> model_new(const Exchange& e) { return extract_code(e.reply, e.finish_reason); }

// A graph-mode target wants a kernel step. A reply holding a ModelNew instead is still a candidate:
// the Verifier judges it against the sub-problem, so the attempt teaches something, but it can never be
// stitched into the program. Neither: the kernel step's fault is what the model is told.
Result<Extraction> kernel_step(const Exchange& e) {
  auto step = extract_kernel_step(e.reply, e.finish_reason);
  if (step) return step;
  auto module = extract_code(e.reply, e.finish_reason);
  if (!module) return step;
  module->notes.push_back("a ModelNew, not a kernel step: judged, never part of the program");
  module->notes.push_back("no kernel step: " + step.error().message);
  return module;
}

Result<AnswerFormat> answer_format(const std::string& answer) {
  if (answer == "model_new")
    return AnswerFormat{"answer_model_new", "Answer again with one complete ```python block that defines class ModelNew.",
                        &model_new};
  if (answer == "kernel_step")
    return AnswerFormat{"answer_kernel_step",
                        "Answer again with one ```cuda block holding the kernel and one ```json block saying how to launch it.",
                        &kernel_step};
  return fail(ErrorCode::InvalidArgument,
              "Problem.answer is '" + answer + "'; expected \"model_new\" (a ModelNew module) or \"kernel_step\" (a graph-mode kernel)");
}

}  // namespace

Coder::Coder(std::shared_ptr<llm::Backend> llm, std::shared_ptr<const PromptLibrary> prompts,
             std::shared_ptr<const Retriever> docs, AgentOptions options)
    : llm_(std::move(llm)), prompts_(std::move(prompts)), docs_(std::move(docs)), options_(std::move(options)) {}

Result<CoderPrompt> Coder::prompt(const CoderRequest& request) const {
  if (!prompts_) return fail(ErrorCode::InvalidArgument, "the Coder needs prompts");
  if (request.problem == nullptr) return fail(ErrorCode::InvalidArgument, "CoderRequest.problem is required");
  const bool from_plan = request.skill == rubric::Skill::from_plan;
  if (from_plan && request.plan == nullptr)
    return fail(ErrorCode::InvalidArgument, "Skill 1 (from the plan) needs CoderRequest.plan");
  if (!from_plan && (request.previous.empty() || request.feedback.empty()))
    return fail(ErrorCode::InvalidArgument, "Skill 2 (from feedback) needs CoderRequest.previous and .feedback");
  auto format = answer_format(request.problem->answer);
  if (!format) return tl::unexpected(format.error());

  const std::string plan_text = request.plan ? request.plan->describe() : "";
  const std::string prompt_name = from_plan ? "coder_plan" : "coder_feedback";
  auto chosen = prompts_->get(prompt_name);
  if (!chosen) return tl::unexpected(chosen.error());
  auto [docs, ids] = detail::retrieve(docs_.get(), options_.doc_snippets, from_plan ? plan_text : request.feedback);
  std::map<std::string, std::string> values{{"reference", request.problem->reference},
                                            {"plan", plan_text},
                                            {"hardware", request.problem->hardware.describe()},
                                            {"target", request.problem->target},
                                            {"docs", docs}};
  if (!from_plan) values["previous"] = detail::fenced_candidate(request.previous), values["feedback"] = request.feedback;
  // The contract may itself name the target (a kernel step's buffers): rendered with the same values.
  auto contract = prompts_->render(format->prompt, values);
  if (!contract) return tl::unexpected(contract.error());
  values["answer"] = std::move(*contract);
  auto text = prompts_->render(prompt_name, values);
  if (!text) return tl::unexpected(text.error());
  return CoderPrompt{std::move(*text), prompt_name, (*chosen)->sha256, std::move(ids)};
}

Result<CoderResult> Coder::write(const CoderRequest& request) const {
  if (!llm_ || !prompts_) return fail(ErrorCode::InvalidArgument, "the Coder needs a model backend and prompts");
  auto first = prompt(request);
  if (!first) return tl::unexpected(first.error());
  auto format = answer_format(request.problem->answer);
  if (!format) return tl::unexpected(format.error());
  auto chosen = prompts_->get(first->prompt_name);
  if (!chosen) return tl::unexpected(chosen.error());

  CoderResult result;
  std::string problem;
  auto extraction = detail::converse(*llm_, options_, "coder", **chosen, first->snippets, std::move(first->text),
                                     format->extract, format->again, result.exchanges, problem);
  if (!extraction) return tl::unexpected(extraction.error());
  if (*extraction)
    result.extraction = std::move(***extraction);
  else
    result.problem = "the Coder's model gave no usable candidate in " + std::to_string(options_.max_repairs + 1) +
                     " replies; the last: " + problem;
  return result;
}

}  // namespace stitchcuda::agents
