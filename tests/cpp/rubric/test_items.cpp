// The four rubric items at their boundaries, and the Judge: used when valid, ignored (deterministic
// scores kept) when it fails, throws or answers out of range; it may never forgive a finding.
#include <memory>
#include <stdexcept>

#include <stitchcuda/rubric.hpp>

#include "catch_shim.hpp"

using namespace stitchcuda;
using namespace stitchcuda::rubric;

namespace {

const char* kNaive =
    "__global__ void add_bias_relu(const float* x, const float* b, float* y, int n, int c) {\n"
    "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "  if (i < n) y[i] = fmaxf(x[i] + b[i % c], 0.f);\n"
    "}\n";

const char* kTuned =
    "// tiled GEMM with a fused bias + GELU epilogue\n"
    "__global__ void gemm_bias_gelu(const float* a, const float* w, const float* bias, float* y) {\n"
    "  __shared__ float tile_a[32][33];\n"
    "  float4 v = reinterpret_cast<const float4*>(a)[threadIdx.x];\n"
    "  tile_a[threadIdx.y][threadIdx.x] = v.x;\n"
    "  __syncthreads();\n"
    "  float acc = tile_a[threadIdx.x][threadIdx.y];\n"
    "  acc += __shfl_down_sync(0xffffffff, acc, 16);\n"
    "  y[threadIdx.x] = gelu(acc + bias[threadIdx.x]);\n"
    "}\n";

Input with_findings(std::vector<Finding> findings) {
  Input in;
  in.outcome.findings = std::move(findings);
  return in;
}

Finding minor(std::string rule) { return {std::move(rule), Severity::minor, "x"}; }
Finding major(std::string rule) { return {std::move(rule), Severity::major, "return torch.matmul(a, b)"}; }

}  // namespace

TEST_CASE("anti-hacking: 5 without findings, minus one per minor down to 2, 1 with any major", "[rubric]") {
  CHECK(score_anti_hacking(with_findings({})).score == 5);
  CHECK(score_anti_hacking(with_findings({minor("a")})).score == 4);
  CHECK(score_anti_hacking(with_findings({minor("a"), minor("b")})).score == 3);
  CHECK(score_anti_hacking(with_findings({minor("a"), minor("b"), minor("c")})).score == 2);
  CHECK(score_anti_hacking(with_findings({minor("a"), minor("b"), minor("c"), minor("d"), minor("e")})).score == 2);
  // The same finding reported twice (static and dynamic) counts once.
  CHECK(score_anti_hacking(with_findings({minor("a"), minor("a")})).score == 4);
  Item hacked = score_anti_hacking(with_findings({minor("a"), major("torch-does-heavy-work")}));
  CHECK(hacked.score == 1);
  REQUIRE(hacked.evidence.size() == 2);
  CHECK(hacked.evidence[1] == "major torch-does-heavy-work: return torch.matmul(a, b)");
  CHECK(severity_from_string("major") == Severity::major);
  CHECK(severity_from_string("minor") == Severity::minor);
  CHECK_FALSE(severity_from_string("MAJOR").has_value());
}

TEST_CASE("CUDA engineering: 1 + techniques found, capped at 5; launches and attributes are facts", "[rubric]") {
  Input in;
  CHECK(score_cuda_engineering(in).score == 1);  // no kernel at all
  CHECK(stitchcuda_test::contains(score_cuda_engineering(in).reason, "no __global__"));

  in.candidate.cuda = {kNaive};
  CHECK(score_cuda_engineering(in).score == 1);
  in.facts.reference_launches = 3;
  in.facts.candidate_launches = 3;  // not fewer: not fused
  CHECK(score_cuda_engineering(in).score == 1);
  in.facts.candidate_launches = 1;
  Item fused = score_cuda_engineering(in);
  CHECK(fused.score == 2);
  CHECK(stitchcuda_test::contains(fused.reason, "fused launches"));

  in.candidate.cuda = {kTuned};  // tiling, vectorized, shuffles, + fused = 4 techniques
  CHECK(score_cuda_engineering(in).score == 5);
  in.facts.candidate_launches.reset();
  Item tuned = score_cuda_engineering(in);
  CHECK(tuned.score == 4);
  CHECK(tuned.evidence.size() == 3);

  in.facts.kernels = {{"gemm_bias_gelu", 255, 4224}};
  tuned = score_cuda_engineering(in);
  CHECK(tuned.score == 4);  // attributes are evidence, not points
  CHECK(stitchcuda_test::contains(tuned.evidence.back(), "likely spills"));

  in.candidate.cuda = {std::string(kTuned) +
                       "__global__ void k2() { asm volatile(\"mma.sync.aligned.m16n8k8\"); asm(\"cp.async.ca.shared.global [%0], [%1], 16;\"); }\n"};
  in.facts.candidate_launches = 1;
  CHECK(score_cuda_engineering(in).score == 5);  // 6 techniques, capped
}

TEST_CASE("operator coverage: the share of reference GPU time served by custom kernels", "[rubric]") {
  Input in;
  in.candidate.cuda = {kNaive};
  CHECK(score_operator_coverage(in).score == 3);  // no profile: neutral
  in.candidate.cuda.clear();
  CHECK(score_operator_coverage(in).score == 1);  // no profile and no kernel

  auto with = [](double covered) {
    Input i;
    i.facts.operators = {{"aten::mm", covered, true}, {"aten::relu", 1.0 - covered, false}};
    return score_operator_coverage(i).score;
  };
  CHECK(with(1.0) == 5);
  CHECK(with(0.9) == 5);
  CHECK(with(0.89) == 4);
  CHECK(with(0.7) == 4);
  CHECK(with(0.69) == 3);
  CHECK(with(0.5) == 3);
  CHECK(with(0.49) == 2);
  CHECK(with(0.25) == 2);
  CHECK(with(0.24) == 1);

  // Only the ReLU covered while the GEMM dominates: 1, and the reason names the heavy operator.
  in.facts.operators = {{"aten::mm", 85.0, false}, {"aten::add", 10.0, false}, {"aten::relu", 5.0, true}};
  Item relu_only = score_operator_coverage(in);
  CHECK(relu_only.score == 1);
  CHECK(stitchcuda_test::contains(relu_only.reason, "5%"));
  CHECK(stitchcuda_test::contains(relu_only.reason, "aten::mm"));
  // Shares are weights: they need not sum to 1; bad ones are ignored.
  in.facts.operators = {{"aten::mm", 85.0, true}, {"aten::relu", -1.0, false}, {"aten::add", 15.0, false}};
  CHECK(score_operator_coverage(in).score == 4);
}

TEST_CASE("skill 1 compliance: share of plan steps whose techniques and keywords are in the code", "[rubric]") {
  Input in;
  in.task.skill = Skill::from_plan;
  in.candidate.cuda = {kTuned};
  in.candidate.python = "class ModelNew(nn.Module):\n    def forward(self, x):\n        return ext.gemm_bias_gelu(x)\n";
  CHECK(score_skill_compliance(in).score == 3);  // no steps: neutral

  in.task.asks = {"Tile the GEMM through shared memory", "Load inputs with float4",
                  "Fuse bias and GELU into the GEMM epilogue", "Reduce partial sums with warp shuffles"};
  in.facts.reference_launches = 3;
  in.facts.candidate_launches = 1;
  Item all = score_skill_compliance(in);
  CHECK(all.score == 5);
  CHECK(all.reason == "4 of 4 plan steps followed.");

  in.task.asks.push_back("Use tensor cores (wmma) for the main loop");  // not in the code
  CHECK(score_skill_compliance(in).score == 4);  // 4/5 = 0.8
  in.task.asks.push_back("Pipeline loads with cp.async");
  CHECK(score_skill_compliance(in).score == 3);  // 4/6

  // Keywords only in comments or docstrings do not count.
  Input claims;
  claims.candidate.cuda = {"// layernorm with welford\n__global__ void k(float* y) { y[0] = 0; }\n"};
  claims.candidate.python = "\"\"\"layernorm welford\"\"\"\n";
  claims.task.asks = {"Compute layernorm statistics with Welford"};
  CHECK(score_skill_compliance(claims).score == 1);
  claims.candidate.cuda = {"__global__ void layernorm_welford(float* y) { y[0] = 0; }\n"};
  CHECK(score_skill_compliance(claims).score == 5);
  // Unknown launch counts make a fusion-only step unverifiable, not missed.
  claims.task.asks = {"Fuse everything"};
  CHECK(score_skill_compliance(claims).score == 3);
}

TEST_CASE("skill 2 compliance: repairs by outcome, optimisations by what changed", "[rubric]") {
  Input in;
  in.task.skill = Skill::from_feedback;
  in.task.previous.cuda = {kNaive};
  in.candidate.cuda = {kNaive};
  in.task.asks = {"Fix the out-of-bounds read in add_bias_relu"};
  in.outcome.compiled = in.outcome.correct = true;
  CHECK(score_skill_compliance(in).score == 1);  // unchanged candidate addresses nothing

  in.candidate.cuda = {std::string(kNaive) + "// fixed\n__global__ void other(float* y) { y[0] = 1; }\n"};
  CHECK(score_skill_compliance(in).score == 5);
  in.outcome.correct = false;
  CHECK(score_skill_compliance(in).score == 1);

  in.outcome.correct = true;
  in.candidate.cuda = {kTuned};
  in.task.asks = {"Vectorize the loads with float4", "Use tensor cores for the GEMM"};
  Item half = score_skill_compliance(in);
  CHECK(half.score == 3);
  CHECK(half.reason == "1 of 2 asks addressed.");
  // A keyword already in the previous candidate is no evidence of the revision.
  in.task.previous.cuda = {"__global__ void k(float* y) { float bias_gelu = 0; }\n"};
  in.candidate.cuda = {"__global__ void k(float* y) { float bias_gelu = 0; }\n__global__ void k2() {}\n"};
  in.task.asks = {"Apply bias_gelu"};
  CHECK(score_skill_compliance(in).score == 1);
}

namespace {

// A scripted judge: returns what it was built with, fails, or throws.
class ScriptedJudge : public Judge {
 public:
  enum class Mode { echo_plus_one, fail, throws, bad_score, raise_hack };
  explicit ScriptedJudge(Mode mode) : mode_(mode) {}
  Result<Items> refine(const Input&, const Items& items) override {
    ++calls;
    Items out = items;
    switch (mode_) {
      case Mode::echo_plus_one:
        for (Item& i : out) i.score = std::min(5, i.score + 1), i.reason = "judge: " + i.reason;
        return out;
      case Mode::fail: return fail(ErrorCode::LlmError, "HTTP 503 from the judge model");
      case Mode::throws: throw std::runtime_error("parse error in judge reply");
      case Mode::bad_score: out[1].score = 7; return out;
      case Mode::raise_hack: out[0].score = 5; return out;
    }
    return out;
  }
  int calls = 0;

 private:
  Mode mode_;
};

Input sample() {
  Input in;
  in.candidate.cuda = {kNaive};
  in.outcome = {true, true, 1.2, {minor("library-does-heavy-work")}};
  in.facts.operators = {{"aten::mm", 0.6, true}, {"aten::relu", 0.4, false}};
  return in;
}

}  // namespace

TEST_CASE("judge: refines when valid, deterministic scores kept when it fails", "[rubric]") {
  const Input in = sample();
  const Scorecard plain = Rubric().score(in);
  CHECK_FALSE(plain.judged);
  CHECK(plain.judge_note.empty());
  CHECK(plain.total() == 4 + 1 + 3 + 3);
  CHECK(stitchcuda_test::contains(plain.describe(), "anti-hacking 4/5"));

  auto echo = std::make_shared<ScriptedJudge>(ScriptedJudge::Mode::echo_plus_one);
  const Scorecard refined = Rubric(echo).score(in);
  CHECK(echo->calls == 1);
  CHECK(refined.judged);
  CHECK(refined[Dimension::cuda_engineering].score == 2);
  CHECK(refined[Dimension::anti_hacking].score == 4);  // may not rise above the detector's 4
  CHECK(stitchcuda_test::contains(refined.judge_note, "kept 4"));

  for (auto mode : {ScriptedJudge::Mode::fail, ScriptedJudge::Mode::throws, ScriptedJudge::Mode::bad_score}) {
    const Scorecard card = Rubric(std::make_shared<ScriptedJudge>(mode)).score(in);
    CHECK_FALSE(card.judged);
    CHECK(card.total() == plain.total());
    CHECK(stitchcuda_test::contains(card.judge_note, "deterministic scores kept"));
  }
  CHECK(stitchcuda_test::contains(Rubric(std::make_shared<ScriptedJudge>(ScriptedJudge::Mode::fail)).score(in).judge_note,
                                  "HTTP 503"));

  Input hacked = sample();
  hacked.outcome.findings.push_back(major("calls-reference-model"));
  const Scorecard forgiven = Rubric(std::make_shared<ScriptedJudge>(ScriptedJudge::Mode::raise_hack)).score(hacked);
  CHECK(forgiven[Dimension::anti_hacking].score == 1);
}

TEST_CASE("skill 2 repairs are judged against the previous candidate's failure", "[rubric]") {
  Input in;
  in.task.skill = Skill::from_feedback;
  in.task.previous.cuda = {kNaive};
  in.candidate.cuda = {std::string(kNaive) + "__global__ void other(float* y) { y[0] = 1; }\n"};  // changed code
  in.task.asks = {"fix the compile error at line 3: expected a \";\""};
  VerifyOutcome not_compiled;  // compiled = false
  VerifyOutcome unverified;    // compiled, checked statically, never run
  unverified.compiled = true;
  unverified.verified = false;
  VerifyOutcome wrong;
  wrong.compiled = true;
  VerifyOutcome right;
  right.compiled = right.correct = true;
  auto verdict = [&](const VerifyOutcome& before, const VerifyOutcome& now) {
    in.task.previous_outcome = before;
    in.outcome = now;
    const Item item = score_skill_compliance(in);
    REQUIRE(item.evidence.size() == 1);
    return item.evidence[0].substr(0, item.evidence[0].find(':'));
  };
  // Without a GPU the fix of a compile error shows: the candidate compiles now.
  CHECK(verdict(not_compiled, unverified) == "followed");
  CHECK(verdict(not_compiled, wrong) == "followed");  // the compile error asked about is gone
  CHECK(verdict(not_compiled, not_compiled) == "missed");
  in.task.asks = {"fix the mismatch at [0, 3] (expected 1.25, got 0)"};
  CHECK(verdict(wrong, right) == "followed");
  CHECK(verdict(wrong, unverified) == "unverifiable");  // not run: whether it is fixed is unknown
  CHECK(verdict(wrong, wrong) == "missed");
  CHECK(verdict(wrong, not_compiled) == "missed");
  in.task.previous_outcome = wrong;
  in.outcome = unverified;
  CHECK(score_skill_compliance(in).reason == "no checkable ask: neutral.");

  // With the previous outcome unknown, an unverified candidate shows nothing either way.
  in.task.previous_outcome.reset();
  in.outcome = unverified;
  CHECK(stitchcuda_test::contains(score_skill_compliance(in).evidence.at(0), "unverifiable"));
  in.outcome = wrong;
  CHECK(stitchcuda_test::contains(score_skill_compliance(in).evidence.at(0), "still fails"));

  // An ask about a finding is met when the rule no longer fires.
  VerifyOutcome hacked = right;
  hacked.findings = {major("torch-does-heavy-work")};
  in.task.asks = {"remove the [torch-does-heavy-work] problem at line 9: forward computes GELU with torch"};
  CHECK(verdict(hacked, right) == "followed");
  CHECK(verdict(hacked, hacked) == "missed");
}

TEST_CASE("a candidate that did not compile scores 1 on every item and never outscores a compiled one", "[rubric]") {
  Input broken;
  broken.candidate.cuda = {kTuned};  // rich in techniques, but it never compiled
  broken.task.asks = {"Vectorize the loads with float4"};
  broken.outcome.compiled = false;
  auto judge = std::make_shared<ScriptedJudge>(ScriptedJudge::Mode::echo_plus_one);
  const Scorecard card = Rubric(judge).score(broken);
  CHECK(card.total() == 4);
  CHECK(judge->calls == 0);  // nothing for a judge to credit
  for (const Item& item : card.items) {
    CHECK(item.score == 1);
    CHECK(item.reason == "the candidate did not compile: nothing of it is credited.");
    REQUIRE_FALSE(item.evidence.empty());
    CHECK(stitchcuda_test::contains(item.evidence[0], "detector: "));  // what the detectors saw is kept
  }
  // The detector saw techniques (it would score above 1); none is credited.
  CHECK(stitchcuda_test::contains(card[Dimension::cuda_engineering].evidence[0], "technique(s)"));
  CHECK_FALSE(stitchcuda_test::contains(card[Dimension::cuda_engineering].evidence[0], "detector: 1/5"));

  Input compiled;
  compiled.candidate.cuda = {kNaive};
  compiled.outcome.compiled = true;
  compiled.outcome.verified = false;  // static only
  compiled.outcome.findings = {major("calls-reference-model"), minor("a")};
  CHECK(Rubric().score(compiled).total() >= card.total());
}
