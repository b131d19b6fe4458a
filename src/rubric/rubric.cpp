// The Rubric (detectors, then an optional Judge that may fail) and the reward of the StitchCUDA method.
#include <stitchcuda/rubric.hpp>

#include <cmath>
#include <cstdio>
#include <exception>

namespace stitchcuda::rubric {

const char* to_string(Severity severity) noexcept { return severity == Severity::major ? "major" : "minor"; }

std::optional<Severity> severity_from_string(std::string_view name) noexcept {
  if (name == "major") return Severity::major;
  if (name == "minor") return Severity::minor;
  return std::nullopt;
}

const char* to_string(Dimension dimension) noexcept {
  switch (dimension) {
    case Dimension::anti_hacking: return "anti-hacking";
    case Dimension::cuda_engineering: return "cuda-engineering";
    case Dimension::operator_coverage: return "operator-coverage";
    case Dimension::skill_compliance: return "skill-compliance";
  }
  return "?";
}

int Scorecard::total() const {
  int sum = 0;
  for (const Item& item : items) sum += item.score;
  return sum;
}

std::string Scorecard::describe() const {
  std::string out;
  for (const Item& item : items)
    out += std::string(to_string(item.dimension)) + " " + std::to_string(item.score) + "/5: " + item.reason + "\n";
  if (!judge_note.empty()) out += "judge: " + judge_note + "\n";
  return out;
}

namespace {

// Why a Judge's items cannot be used ("" when they can).
std::string invalid_items(const Items& items) {
  for (std::size_t k = 0; k < items.size(); ++k) {
    if (items[k].dimension != static_cast<Dimension>(k))
      return "item " + std::to_string(k) + " is " + to_string(items[k].dimension) + ", expected " +
             to_string(static_cast<Dimension>(k));
    if (items[k].score < 1 || items[k].score > 5)
      return std::string(to_string(items[k].dimension)) + " score " + std::to_string(items[k].score) + " is outside 1-5";
  }
  return {};
}

}  // namespace

Scorecard Rubric::score(const Input& input) const {
  Scorecard card;
  card.items = {score_anti_hacking(input), score_cuda_engineering(input), score_operator_coverage(input),
                score_skill_compliance(input)};
  if (!input.outcome.compiled) {
    // Code that never compiled has shown no technique, covered no operator and followed no step: were
    // its source credited, a broken candidate could outscore one that compiles. Every item takes the
    // floor (total 4, the least any compiled candidate can have); what the detectors saw stays as evidence.
    for (Item& item : card.items) {
      item.evidence.insert(item.evidence.begin(), "detector: " + std::to_string(item.score) + "/5, " + item.reason);
      item.score = 1;
      item.reason = "the candidate did not compile: nothing of it is credited.";
    }
    return card;
  }
  if (!judge_) return card;
  Result<Items> refined = fail(ErrorCode::Internal, "the judge returned nothing");
  try {
    refined = judge_->refine(input, card.items);
  } catch (const std::exception& e) {
    refined = fail(ErrorCode::Internal, std::string("the judge threw: ") + e.what());
  } catch (...) {
    refined = fail(ErrorCode::Internal, "the judge threw a non-standard exception");
  }
  // A failed judge is neutral: the detectors' items stand.
  if (!refined) {
    card.judge_note = "judge failed, deterministic scores kept: " + refined.error().message;
    return card;
  }
  if (std::string why = invalid_items(*refined); !why.empty()) {
    card.judge_note = "judge answer invalid, deterministic scores kept: " + why;
    return card;
  }
  Item& hack = (*refined)[static_cast<std::size_t>(Dimension::anti_hacking)];
  const Item& detected = card[Dimension::anti_hacking];
  if (hack.score > detected.score) {
    // Findings are facts; a judge may find more hacking, never forgive what the Verifier found.
    card.judge_note = "judge raised anti-hacking from " + std::to_string(detected.score) + " to " +
                      std::to_string(hack.score) + "; kept " + std::to_string(detected.score);
    hack.score = detected.score;
    hack.evidence.insert(hack.evidence.end(), detected.evidence.begin(), detected.evidence.end());
  }
  card.items = std::move(*refined);
  card.judged = true;
  return card;
}

Result<void> RewardConfig::validate() const {
  auto finite = [](double x) { return std::isfinite(x); };
  if (!finite(tau) || !finite(r_max) || !finite(lambda_plan) || !finite(lambda_feedback))
    return fail(ErrorCode::InvalidArgument, "reward config: every constant must be a finite number.");
  if (r_max <= 0) return fail(ErrorCode::InvalidArgument, "reward config: r_max must be positive.");
  if (tau < 0) return fail(ErrorCode::InvalidArgument, "reward config: tau must not be negative.");
  for (double lambda : {lambda_plan, lambda_feedback})
    if (lambda < 0 || lambda > 2)
      return fail(ErrorCode::InvalidArgument,
                  "reward config: lambda must lie in [0, 2] so that 1 + lambda * r_hat stays non-negative.");
  return {};
}

double normalized_rubric(int total) noexcept { return (total - 4) / 16.0 - 0.5; }

std::string Reward::describe() const {
  char buf[160];
  if (!zero_reason.empty()) return "R=0: " + zero_reason;
  std::snprintf(buf, sizeof buf, "R=%g (s=%g, total=%d, r=%g, lambda=%g, shaped=%g%s)", value, speedup, total,
                normalized, lambda, shaped, capped ? ", capped" : "");
  return buf;
}

Result<Reward> reward(const VerifyOutcome& outcome, const Scorecard& scores, Skill skill, const RewardConfig& config) {
  if (auto ok = config.validate(); !ok) return tl::unexpected(ok.error());
  for (const Item& item : scores.items)
    if (item.score < 1 || item.score > 5)
      return fail(ErrorCode::InvalidArgument, std::string("reward: ") + to_string(item.dimension) + " score " +
                                                  std::to_string(item.score) + " is outside 1-5.");
  Reward r;
  // A candidate never run (static verification only) is not known to be correct: unverified, which a
  // reader of the reward must not take for a wrong answer.
  r.correct = outcome.compiled && outcome.verified && outcome.correct;
  if (!outcome.compiled) r.zero_reason = "not compiled";
  else if (!outcome.verified) r.zero_reason = "unverified";
  else if (!outcome.correct) r.zero_reason = "incorrect";
  for (const Finding& f : outcome.findings)
    if (f.severity == Severity::major) {
      r.zero_reason += r.hack ? ", " : (r.zero_reason.empty() ? "hack: " : "; hack: ");
      r.zero_reason += f.rule;
      r.hack = true;
    }
  r.speedup = std::isfinite(outcome.speedup) && outcome.speedup > 0 ? outcome.speedup : 0.0;
  r.total = scores.total();
  r.normalized = normalized_rubric(r.total);
  r.lambda = skill == Skill::from_feedback ? config.lambda_feedback : config.lambda_plan;
  r.shaped = (r.speedup + config.tau) * (1.0 + r.lambda * r.normalized);
  r.capped = r.shaped > config.r_max;
  r.value = r.correct && !r.hack ? std::min(r.shaped, config.r_max) : 0.0;
  return r;
}

}  // namespace stitchcuda::rubric
