// The reward R = I_correct · (1 − I_hack) · min((s + τ)(1 + λ·r̂), R_max) against hand-computed values
// for both skills, the indicators that zero it, the cap, and config validation.
#include <cmath>

#include <stitchcuda/rubric.hpp>

#include "catch_shim.hpp"

using namespace stitchcuda;
using namespace stitchcuda::rubric;

namespace {

// A scorecard whose four scores are `a, b, c, d`.
Scorecard card(int a, int b, int c, int d) {
  Scorecard s;
  const int scores[] = {a, b, c, d};
  for (std::size_t k = 0; k < 4; ++k) s.items[k] = Item{static_cast<Dimension>(k), scores[k], "", {}};
  return s;
}

VerifyOutcome ok(double speedup) { return {true, true, speedup, {}}; }

Reward reward_ok(const VerifyOutcome& o, const Scorecard& s, Skill skill, const RewardConfig& c = {}) {
  auto r = reward(o, s, skill, c);
  if (!r) FAIL(r.error().describe());
  return *r;
}

}  // namespace

TEST_CASE("normalized rubric score r̂ = (total − 4)/16 − 0.5", "[rubric]") {
  CHECK(normalized_rubric(4) == Approx(-0.5));
  CHECK(normalized_rubric(12) == Approx(0.0));
  CHECK(normalized_rubric(16) == Approx(0.25));
  CHECK(normalized_rubric(20) == Approx(0.5));
}

TEST_CASE("reward matches hand-computed values for both skills", "[rubric]") {
  // s = 2, total = 16: r̂ = 0.25. Skill 1: 2.3 · 1.25 = 2.875. Skill 2: 2.3 · (1 + 0.7·0.25) = 2.7025.
  const Scorecard sixteen = card(4, 4, 4, 4);
  Reward r1 = reward_ok(ok(2.0), sixteen, Skill::from_plan);
  CHECK(r1.value == Approx(2.875));
  CHECK(r1.total == 16);
  CHECK(r1.normalized == Approx(0.25));
  CHECK(r1.lambda == Approx(1.0));
  CHECK_FALSE(r1.capped);
  CHECK(r1.correct);
  CHECK_FALSE(r1.hack);
  CHECK(r1.zero_reason.empty());
  CHECK(reward_ok(ok(2.0), sixteen, Skill::from_feedback).value == Approx(2.7025));

  // s = 1.5, total = 8 (r̂ = −0.25): Skill 1: 1.8 · 0.75 = 1.35; Skill 2: 1.8 · 0.825 = 1.485.
  CHECK(reward_ok(ok(1.5), card(5, 1, 1, 1), Skill::from_plan).value == Approx(1.35));
  CHECK(reward_ok(ok(1.5), card(5, 1, 1, 1), Skill::from_feedback).value == Approx(1.485));
  // Neutral rubric (total 12): R = s + τ.
  CHECK(reward_ok(ok(0.8), card(3, 3, 3, 3), Skill::from_plan).value == Approx(1.1));
  // All 5s: 0.5 slower than eager still earns (0.5 + 0.3) · 1.5 = 1.2 for a correct honest kernel.
  CHECK(reward_ok(ok(0.5), card(5, 5, 5, 5), Skill::from_plan).value == Approx(1.2));
}

TEST_CASE("reward is capped at R_max", "[rubric]") {
  // s = 4, all 5s: 4.3 · 1.5 = 6.45 > 5.
  Reward r = reward_ok(ok(4.0), card(5, 5, 5, 5), Skill::from_plan);
  CHECK(r.value == Approx(5.0));
  CHECK(r.shaped == Approx(6.45));
  CHECK(r.capped);
  RewardConfig wide;
  wide.r_max = 10.0;
  CHECK(reward_ok(ok(4.0), card(5, 5, 5, 5), Skill::from_plan, wide).value == Approx(6.45));
  // Skill 2, total 20: 1 + 0.7·0.5 = 1.35; s = 3.7 → 4.0 · 1.35 = 5.4 → 5; s = 3 → 4.455.
  CHECK(reward_ok(ok(3.7), card(5, 5, 5, 5), Skill::from_feedback).value == Approx(5.0));
  CHECK(reward_ok(ok(3.0), card(5, 5, 5, 5), Skill::from_feedback).value == Approx(3.3 * 1.35));
}

TEST_CASE("a hack, an incorrect, an unverified or an uncompiled candidate earns 0", "[rubric]") {
  VerifyOutcome hacked = ok(3.0);
  hacked.findings = {{"library-does-heavy-work", Severity::minor, ""},
                     {"torch-does-heavy-work", Severity::major, "torch.matmul"},
                     {"input-keyed-cache", Severity::major, ""}};
  Reward h = reward_ok(hacked, card(1, 5, 5, 5), Skill::from_plan);
  CHECK(h.value == 0.0);
  CHECK(h.hack);
  CHECK(h.correct);
  CHECK(h.zero_reason == "hack: torch-does-heavy-work, input-keyed-cache");
  CHECK(h.describe() == "R=0: hack: torch-does-heavy-work, input-keyed-cache");
  CHECK(h.shaped > 0.0);  // the parts are still logged

  // Minor findings alone do not zero it.
  VerifyOutcome minor_only = ok(2.0);
  minor_only.findings = {{"hard-coded-shape", Severity::minor, "4096"}};
  CHECK(reward_ok(minor_only, card(4, 4, 4, 4), Skill::from_plan).value == Approx(2.875));

  Reward wrong = reward_ok({true, false, 5.0, {}}, card(5, 5, 5, 5), Skill::from_plan);
  CHECK(wrong.value == 0.0);
  CHECK_FALSE(wrong.correct);
  CHECK(wrong.zero_reason == "incorrect");
  // Compiled and statically checked, never run: unverified, which is not a wrong answer.
  VerifyOutcome unrun{true, false, 0.0, {}};
  unrun.verified = false;
  Reward unverified = reward_ok(unrun, card(5, 5, 5, 5), Skill::from_plan);
  CHECK(unverified.value == 0.0);
  CHECK_FALSE(unverified.correct);
  CHECK(unverified.zero_reason == "unverified");
  unrun.correct = true;  // a static check cannot make it correct
  CHECK(reward_ok(unrun, card(5, 5, 5, 5), Skill::from_plan).zero_reason == "unverified");
  Reward broken = reward_ok({false, false, 0.0, {}}, card(5, 5, 5, 5), Skill::from_feedback);
  CHECK(broken.value == 0.0);
  CHECK(broken.zero_reason == "not compiled");
  // "compiled = false, correct = true" is inconsistent input; not compiled wins.
  CHECK(reward_ok({false, true, 2.0, {}}, card(5, 5, 5, 5), Skill::from_plan).value == 0.0);
  VerifyOutcome both = {true, false, 2.0, {{"constant-output", Severity::major, ""}}};
  CHECK(reward_ok(both, card(5, 5, 5, 5), Skill::from_plan).zero_reason == "incorrect; hack: constant-output");
}

TEST_CASE("reward treats a missing or absurd speed-up as 0 and rejects bad input", "[rubric]") {
  CHECK(reward_ok(ok(std::nan("")), card(3, 3, 3, 3), Skill::from_plan).value == Approx(0.3));
  CHECK(reward_ok(ok(-1.0), card(3, 3, 3, 3), Skill::from_plan).value == Approx(0.3));
  CHECK(reward_ok(ok(INFINITY), card(3, 3, 3, 3), Skill::from_plan).speedup == 0.0);

  auto bad_score = reward(ok(1.0), card(3, 3, 0, 3), Skill::from_plan);
  REQUIRE_FALSE(bad_score);
  CHECK(bad_score.error().code == ErrorCode::InvalidArgument);
  CHECK(stitchcuda_test::contains(bad_score.error().message, "operator-coverage"));

  RewardConfig config;
  CHECK(config.validate().has_value());
  config.lambda_feedback = 3.0;
  CHECK_FALSE(reward(ok(1.0), card(3, 3, 3, 3), Skill::from_plan, config));
  config = {};
  config.r_max = 0.0;
  CHECK_FALSE(config.validate());
  config = {};
  config.tau = std::nan("");
  CHECK_FALSE(config.validate());

  // Configurable constants are used: τ = 0, λ = 0 → R = s.
  RewardConfig plain{0.0, 5.0, 0.0, 0.0};
  CHECK(reward_ok(ok(1.7), card(1, 1, 1, 1), Skill::from_plan, plain).value == Approx(1.7));
}

TEST_CASE("rubric and reward together: honest tuned kernel beats naive; hacker gets 0", "[rubric]") {
  Input naive;
  naive.candidate.cuda = {"__global__ void relu(const float* x, float* y, int n) {\n"
                          "  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = fmaxf(x[i], 0.f);\n}\n"};
  naive.outcome = ok(1.1);
  Input tuned = naive;
  tuned.candidate.cuda = {"__global__ void relu4(const float4* x, float4* y, int n) {\n"
                          "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                          "  if (i < n) { float4 v = __ldg(x + i); y[i] = make_float4(fmaxf(v.x, 0.f), fmaxf(v.y, 0.f),"
                          " fmaxf(v.z, 0.f), fmaxf(v.w, 0.f)); }\n}\n"};
  tuned.facts.reference_launches = 2;
  tuned.facts.candidate_launches = 1;
  Rubric rubric;
  const double r_naive = reward_ok(naive.outcome, rubric.score(naive), Skill::from_plan).value;
  const double r_tuned = reward_ok(tuned.outcome, rubric.score(tuned), Skill::from_plan).value;
  CHECK(r_tuned > r_naive);

  Input hacker = tuned;
  hacker.outcome.findings = {{"calls-reference-model", Severity::major, "self.ref = Model()"}};
  const Scorecard card_h = rubric.score(hacker);
  CHECK(card_h[Dimension::anti_hacking].score == 1);
  CHECK(reward_ok(hacker.outcome, card_h, Skill::from_plan).value == 0.0);
}
