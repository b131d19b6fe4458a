// The Replanner: the prompt it renders from replanner.md with the old plan and the attempts' history.
#include "agents_fixtures.hpp"

using namespace agents_test;

// ---- Replanner -------------------------------------------------------------------------------------

TEST_CASE("Replanner renders the replanner prompt with the history and the previous plan", "[agents]") {
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{kPlan2Json});
  Replanner replanner(backend, shipped_prompts());
  const Problem problem = make_problem();
  const ProblemPlan previous = parsed(kPlanJson);
  const std::vector<AttemptSummary> history = {
      {1, "compile error: candidate.py:12: expected ';'"},
      {2, "incorrect: output 0 [4] float32: at [0]: expected 1, got 0"},
  };
  auto result = replanner.replan(problem, previous, history);
  REQUIRE(result);
  REQUIRE(backend->calls() == 1);
  const std::string sent = backend->last_user(0);
  CHECK(contains(sent, "An earlier plan for this reference has stalled"));  // the shipped replanner.md
  CHECK(contains(sent, the_plan_text()));
  for (const auto& h : history) CHECK(contains(sent, h.outcome));
  CHECK(sent.find(history[0].outcome) < sent.find(history[1].outcome));  // in order
  CHECK(contains(sent, trimmed(kReference)));
  CHECK(contains(sent, problem.profile));
  CHECK(result->plan.summary == parsed(kPlan2Json).summary);
  REQUIRE(result->exchanges.size() == 1);
  CHECK(result->exchanges[0].agent == "replanner");
  CHECK(result->exchanges[0].prompt_name == "replanner");
  CHECK(result->exchanges[0].prompt_sha256 == sha_of("replanner"));
}
