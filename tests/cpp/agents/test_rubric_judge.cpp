// The rubric's LLM judge: what it is shown, its answer refining the items, every way its answer can be
// unusable (kept neutral by the Rubric), and its calls recorded with the attempt in the run directory.
#include "agents_fixtures.hpp"

using namespace agents_test;
using stitchcuda::agents::RubricJudge;

namespace {

const char* kLowerAnti = R"({"items": [
  {"dimension": "anti-hacking", "score": 2, "reason": "line 9 returns torch's GELU; the kernel writes a scratch buffer"},
  {"dimension": "cuda-engineering", "score": 3, "reason": "same"},
  {"dimension": "operator-coverage", "score": 3, "reason": "same"},
  {"dimension": "skill-compliance", "score": 3, "reason": "same"}]})";

rubric::Input judged_input() {
  rubric::Input in;
  in.candidate.python = "class ModelNew:\n    def forward(self, x):\n        return torch.nn.functional.gelu(x + 1.0)\n";
  in.candidate.cuda = {"__global__ void k(float* y) { y[0] = 0.f; }"};
  in.outcome.compiled = in.outcome.correct = true;
  in.outcome.speedup = 1.4;
  in.task.asks = {"Write one fused add-GELU kernel"};
  return in;
}

std::shared_ptr<RubricJudge> judge_with(std::shared_ptr<Recorder> model) {
  AgentOptions options;
  options.doc_snippets = 0;
  auto judge = std::make_shared<RubricJudge>(model, shipped_prompts(), options);
  judge->set_reference(kReference);
  return judge;
}

}  // namespace

TEST_CASE("RubricJudge: shown the code, the verdict and the detectors' items; lowers anti-hacking with a reason",
          "[agents]") {
  auto model = std::make_shared<Recorder>(std::vector<std::string>{std::string("```json\n") + kLowerAnti + "\n```"});
  auto judge = judge_with(model);
  const rubric::Rubric rubric(judge);
  const rubric::Scorecard card = rubric.score(judged_input());
  REQUIRE(model->calls() == 1);
  const std::string sent = model->last_user(0);
  CHECK(contains(sent, "You are the Rubric judge"));
  CHECK(contains(sent, "torch.nn.functional.gelu(x + 1.0)"));          // the reference and the candidate
  CHECK(contains(sent, "__global__ void k"));                           // its CUDA
  CHECK(contains(sent, "speed-up over eager 1.4x"));                   // the verdict
  CHECK(contains(sent, "anti-hacking 5/5"));                            // the detectors' items
  CHECK(contains(sent, "Write one fused add-GELU kernel"));             // what was asked
  CHECK(card.judged);
  CHECK(card[rubric::Dimension::anti_hacking].score == 2);
  CHECK(contains(card[rubric::Dimension::anti_hacking].reason, "line 9 returns torch's GELU"));
  const auto calls = judge->take_exchanges();
  REQUIRE(calls.size() == 1);
  CHECK(calls[0].agent == "judge");
  CHECK(calls[0].prompt_name == "rubric_judge");
  CHECK(calls[0].prompt_sha256 == sha_of("rubric_judge"));
  CHECK(calls[0].error.empty());
  CHECK(judge->take_exchanges().empty());  // taken once
}

TEST_CASE("RubricJudge: an unusable answer leaves the detectors' items, says why, and is recorded", "[agents]") {
  const std::string raise = R"({"items": [{"dimension": "anti-hacking", "score": 5, "reason": "fine"},
    {"dimension": "cuda-engineering", "score": 5, "reason": "x"}, {"dimension": "operator-coverage", "score": 5, "reason": "x"},
    {"dimension": "skill-compliance", "score": 5, "reason": "x"}]})";
  struct Case {
    std::string reply, note;
  };
  const std::vector<Case> cases = {
      {"The candidate looks honest to me.", "holds no JSON object"},
      {R"({"items": [{"dimension": "anti-hacking", "score": 9}]})", "a list of the four items"},
      {R"({"items": [{"dimension": "cuda-engineering", "score": 3}, {}, {}, {}]})", "must be \"anti-hacking\""},
      {R"({"items": [{"dimension": "anti-hacking", "score": 0}, {"dimension": "cuda-engineering", "score": 3},
          {"dimension": "operator-coverage", "score": 3}, {"dimension": "skill-compliance", "score": 3}]})", "outside 1-5"},
      {raise, "raised anti-hacking"},
  };
  for (const auto& c : cases) {
    auto judge = judge_with(std::make_shared<Recorder>(std::vector<std::string>{c.reply}));
    const rubric::Rubric rubric(judge);
    rubric::Input in = judged_input();
    in.outcome.findings = {{"library-does-heavy-work", rubric::Severity::minor, "gelu"}};  // anti-hacking 4
    const rubric::Scorecard card = rubric.score(in);
    const rubric::Scorecard plain = rubric::Rubric().score(in);
    INFO(c.reply);
    CHECK(contains(card.judge_note, c.note));
    CHECK(card[rubric::Dimension::anti_hacking].score == plain[rubric::Dimension::anti_hacking].score);
    CHECK(judge->take_exchanges().size() == 1);
  }
}

TEST_CASE("Optimizer with a judge: its calls are in attempt.json and trajectories.jsonl, usage and resume", "[agents]") {
  TempDir tmp;
  const std::string run = (tmp.path() / "run").string();
  auto verifier = std::make_shared<FakeVerifier>();
  auto judge_model = std::make_shared<Recorder>(std::vector<std::string>{kLowerAnti}, 100);
  Agents agents = make_agents(planner_backend(), std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")}));
  agents.judge = judge_with(judge_model);
  agents.rubric = std::make_shared<rubric::Rubric>(agents.judge);
  Budget budget;
  budget.attempts = 1;
  Optimizer optimizer(std::move(agents), verifier, budget);
  auto outcome = optimizer.run(make_problem(), run);
  REQUIRE(outcome);
  REQUIRE(outcome->attempts.size() == 1);
  const auto& a = outcome->attempts[0];
  CHECK(a.scorecard.judged);
  CHECK(a.scorecard[rubric::Dimension::anti_hacking].score == 2);
  REQUIRE(a.judge_exchanges.size() == 1);
  CHECK(outcome->usage.total_tokens == 100);  // the judge's call is counted
  CHECK(contains(judge_model->last_user(0), "def get_inputs"));  // the problem's reference was shown

  const Json saved = Json::parse(read(fs::path(run) / "attempts" / "001" / "attempt.json"));
  REQUIRE(saved["judge_exchanges"].size() == 1);
  CHECK(saved["judge_exchanges"][0]["agent"] == "judge");
  CHECK(Json::parse(read(fs::path(run) / "attempts" / "001" / "rubric.json"))["judged"] == true);
  std::vector<Json> records;
  for (const auto& l : lines_of(fs::path(run) / "trajectories.jsonl")) records.push_back(Json::parse(l));
  REQUIRE(records.size() == 3);  // the plan's call, the Coder's, the judge's
  CHECK(records[2]["agent"] == "judge");
  CHECK(records[2]["skill"].is_null());
  CHECK(records[2]["reward"].is_null());
  CHECK(records[2]["attempt"] == 1);

  // A resume reads the judge's calls back: the same usage, nothing asked again.
  Budget same;
  same.attempts = 1;
  Agents again = make_agents(planner_backend(), std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")}));
  Optimizer second(std::move(again), verifier, same);
  auto resumed = second.resume(make_problem(), run);
  REQUIRE(resumed);
  CHECK(resumed->usage.total_tokens == 100);
  CHECK(resumed->attempts[0].judge_exchanges.size() == 1);
}
