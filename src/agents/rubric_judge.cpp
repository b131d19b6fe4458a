// RubricJudge: the rubric's optional LLM judge. One call per candidate with rubric_judge.md; the reply
// is the four items as JSON. Whatever goes wrong is an error the Rubric turns into "deterministic scores
// kept" (a failed judge is neutral); every call is kept for the attempt's record.
#include <stitchcuda/agents.hpp>

#include <chrono>
#include <exception>
#include <sstream>

#include <nlohmann/json.hpp>

#include "conversation.hpp"

namespace stitchcuda::agents {
namespace {

using Json = nlohmann::json;

std::string describe_outcome(const rubric::VerifyOutcome& o) {
  std::ostringstream out;
  out << "compiled: " << (o.compiled ? "yes" : "no") << "; ";
  if (!o.verified) out << "not run (static checks only); ";
  else out << "correct: " << (o.correct ? "yes" : "no") << "; ";
  if (o.speedup > 0) out << "speed-up over eager " << o.speedup << "x; ";
  out << o.findings.size() << " finding(s)";
  for (const auto& f : o.findings)
    out << "\n- " << rubric::to_string(f.severity) << " " << f.rule << (f.evidence.empty() ? "" : ": " + f.evidence);
  return out.str();
}

std::string describe_items(const rubric::Items& items) {
  std::string out;
  for (const auto& i : items) {
    out += "- " + std::string(rubric::to_string(i.dimension)) + " " + std::to_string(i.score) + "/5: " + i.reason + "\n";
    for (const auto& e : i.evidence) out += "  evidence: " + e + "\n";
  }
  return out;
}

std::string describe_task(const rubric::Task& t) {
  std::string out = t.skill == rubric::Skill::from_plan ? "Skill 1: write from the Planner's plan.\n"
                                                        : "Skill 2: revise the previous candidate from the Verifier's feedback.\n";
  for (const auto& a : t.asks) out += "- " + a + "\n";
  return out;
}

std::string candidate_text(const rubric::Candidate& c) {
  std::string out = "```python\n" + c.python + (c.python.empty() || c.python.back() == '\n' ? "" : "\n") + "```\n";
  for (const auto& cuda : c.cuda)
    if (c.python.find(cuda) == std::string::npos)  // CUDA inline in the Python is shown once
      out += "\n```cuda\n" + cuda + (cuda.empty() || cuda.back() == '\n' ? "" : "\n") + "```\n";
  return out;
}

/// The JSON object of a reply: the whole text, a ```json fence, or the outermost braces.
Result<Json> object_of(const std::string& reply) {
  std::string text = reply;
  if (auto fence = text.find("```json"); fence != std::string::npos) {
    auto start = text.find('\n', fence);
    auto end = start == std::string::npos ? start : text.find("```", start);
    if (end != std::string::npos) text = text.substr(start + 1, end - start - 1);
  }
  auto first = text.find('{'), last = text.rfind('}');
  if (first == std::string::npos || last == std::string::npos || last < first)
    return fail(ErrorCode::InvalidArgument, "the judge's reply holds no JSON object");
  Json j = Json::parse(text.substr(first, last - first + 1), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return fail(ErrorCode::InvalidArgument, "the judge's reply is not valid JSON");
  return j;
}

/// The four items of a reply, in Dimension order, scores 1-5, each with its reason.
Result<rubric::Items> items_of(const std::string& reply, const rubric::Items& detected) {
  auto j = object_of(reply);
  if (!j) return tl::unexpected(j.error());
  const Json* items = j->contains("items") ? &(*j)["items"] : nullptr;
  if (!items || !items->is_array() || items->size() != detected.size())
    return fail(ErrorCode::InvalidArgument, "the judge's JSON needs \"items\": a list of the four items");
  rubric::Items out = detected;
  for (std::size_t k = 0; k < out.size(); ++k) {
    const Json& item = (*items)[k];
    const std::string want = rubric::to_string(out[k].dimension);
    if (!item.is_object() || item.value("dimension", std::string()) != want)
      return fail(ErrorCode::InvalidArgument, "item " + std::to_string(k + 1) + " must be \"" + want + "\"");
    if (!item.contains("score") || !item["score"].is_number_integer())
      return fail(ErrorCode::InvalidArgument, "item \"" + want + "\" needs an integer score");
    const int score = item["score"].get<int>();
    if (score < 1 || score > 5) return fail(ErrorCode::InvalidArgument, "item \"" + want + "\": score outside 1-5");
    out[k].score = score;
    const std::string reason = item.value("reason", std::string());
    if (!reason.empty() && score != detected[k].score) {
      out[k].reason = reason;
      out[k].evidence.push_back("judge: " + reason);
    }
  }
  return out;
}

}  // namespace

RubricJudge::RubricJudge(std::shared_ptr<llm::Backend> llm, std::shared_ptr<const PromptLibrary> prompts,
                         AgentOptions options)
    : llm_(std::move(llm)), prompts_(std::move(prompts)), options_(std::move(options)) {}

Result<rubric::Items> RubricJudge::refine(const rubric::Input& input, const rubric::Items& items) {
  if (!llm_ || !prompts_) return fail(ErrorCode::InvalidArgument, "the judge has no model or no prompts");
  Exchange ex;
  ex.agent = "judge";
  ex.model = llm_->name();
  ex.prompt_name = "rubric_judge";
  auto keep = [&](Exchange e) {
    std::lock_guard lock(mu_);
    exchanges_.push_back(std::move(e));
  };
  auto prompt = prompts_->get("rubric_judge");
  if (!prompt) {
    ex.error = prompt.error().message;
    keep(ex);
    return tl::unexpected(prompt.error());
  }
  ex.prompt_sha256 = (*prompt)->sha256;
  std::string reference;
  {
    std::lock_guard lock(mu_);
    reference = reference_.empty() ? "(not given)" : reference_;
  }
  auto text = prompts_->render("rubric_judge", {{"reference", reference},
                                                {"candidate", candidate_text(input.candidate)},
                                                {"task", describe_task(input.task)},
                                                {"outcome", describe_outcome(input.outcome)},
                                                {"items", describe_items(items)}});
  if (!text) {
    ex.error = text.error().message;
    keep(ex);
    return tl::unexpected(text.error());
  }
  ex.messages = {llm::Message{"user", *text}};
  const auto start = std::chrono::steady_clock::now();
  Result<llm::Completion> reply = fail(ErrorCode::Internal, "the judge's model was not called");
  try {
    reply = llm_->complete(ex.messages, options_.llm);
  } catch (const std::exception& e) {  // a backend that breaks its no-throw contract
    reply = fail(ErrorCode::Internal, std::string("the judge's model call threw: ") + e.what());
  }
  ex.latency_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!reply) {
    ex.error = reply.error().message;
    keep(ex);
    return tl::unexpected(reply.error());
  }
  ex.reply = reply->text;
  ex.finish_reason = reply->finish_reason;
  ex.usage = reply->usage;
  if (!reply->model.empty()) ex.model = reply->model;
  auto parsed = items_of(reply->text, items);
  if (!parsed) ex.error = parsed.error().message;
  keep(ex);
  return parsed;
}

void RubricJudge::set_reference(std::string reference) {
  std::lock_guard lock(mu_);
  reference_ = std::move(reference);
}

std::vector<Exchange> RubricJudge::take_exchanges() {
  std::lock_guard lock(mu_);
  std::vector<Exchange> out;
  out.swap(exchanges_);
  return out;
}

}  // namespace stitchcuda::agents
