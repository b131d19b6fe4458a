// The Planner: the prompt it renders from planner.md, the plan it returns, the re-asks after an invalid
// plan and giving up after max_repairs + 1 of them.
#include "agents_fixtures.hpp"

using namespace agents_test;

// ---- Planner ---------------------------------------------------------------------------------------

TEST_CASE("Planner renders the planner prompt and returns the parsed plan", "[agents]") {
  auto backend = planner_backend();
  Planner planner(backend, shipped_prompts(), nullptr, AgentOptions{{}, 0, 2});
  const Problem problem = make_problem();
  auto result = planner.plan(problem);
  REQUIRE(result);
  REQUIRE(backend->calls() == 1);
  REQUIRE(backend->call(0).size() == 1);
  CHECK(backend->call(0)[0].role == "user");
  const std::string sent = backend->last_user(0);
  CHECK(contains(sent, "You are the Planner of StitchCUDA"));  // the shipped planner.md
  CHECK(contains(sent, trimmed(kReference)));
  CHECK(contains(sent, "GPU: NVIDIA H200 (sm_90), 132 SMs"));
  CHECK(contains(sent, trimmed(problem.hardware.describe())));
  CHECK(contains(sent, problem.profile));
  CHECK(contains(sent, "\"required\": [\"summary\", \"steps\"]"));  // the schema
  CHECK_FALSE(contains(sent, "{{"));

  CHECK(result->plan.to_json() == parsed(kPlanJson).to_json());
  CHECK(result->plan.steps.at(0).title == "Write one fused add-GELU kernel");
  REQUIRE(result->exchanges.size() == 1);
  const auto& e = result->exchanges[0];
  CHECK(e.agent == "planner");
  CHECK(e.prompt_name == "planner");
  CHECK(e.prompt_sha256 == sha_of("planner"));
  CHECK(e.reply == kPlanJson);
  CHECK(e.error.empty());
  REQUIRE(e.messages.size() == 1);
  CHECK(e.messages[0].content == sent);
}

TEST_CASE("Planner re-asks once with the validation error and uses the corrected plan", "[agents]") {
  const std::string bad = GENERATE(std::string("I would fuse the add and the GELU."),
                                   std::string(R"({"summary": "Fuse them."})"));
  auto problem_of_bad = ProblemPlan::parse(bad);
  REQUIRE_FALSE(problem_of_bad);
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{bad, kPlanJson});
  Planner planner(backend, shipped_prompts());
  auto result = planner.plan(make_problem());
  REQUIRE(result);
  REQUIRE(backend->calls() == 2);
  REQUIRE(result->exchanges.size() == 2);
  CHECK(result->exchanges[0].reply == bad);
  CHECK(result->exchanges[1].reply == kPlanJson);
  CHECK(result->plan.summary == "Fuse the add and the GELU into one elementwise kernel.");
  // The re-ask carries the conversation so far and says what was wrong.
  const auto& second = backend->call(1);
  REQUIRE(second.size() >= 2);
  CHECK(second.front().content == backend->last_user(0));
  CHECK(std::any_of(second.begin(), second.end(),
                    [&](const llm::Message& m) { return m.role == "assistant" && m.content == bad; }));
  CHECK(second.back().role == "user");
  CHECK(contains(backend->last_user(1), problem_of_bad.error().message));
  if (contains(bad, "summary")) CHECK(contains(backend->last_user(1), "steps: missing"));
}

TEST_CASE("Planner gives up after max_repairs + 1 invalid replies, naming the last problem", "[agents]") {
  SECTION("max_repairs = 1: two replies") {
    auto backend = std::make_shared<Recorder>(
        std::vector<std::string>{"no JSON here at all", R"({"summary": "Fuse them.", "steps": []})"});
    Planner planner(backend, shipped_prompts(), nullptr, AgentOptions{{}, 0, 1});
    auto result = planner.plan(make_problem());
    REQUIRE_FALSE(result);
    CHECK(backend->calls() == 2);
    CHECK(result.error().code == ErrorCode::LlmError);
    CHECK(contains(result.error().message, "steps"));  // the last reply's problem...
    CHECK(contains(result.error().message, "non-empty array"));
    CHECK_FALSE(contains(result.error().message, "holds no JSON object"));  // ...not the first one's
  }
  SECTION("the default max_repairs = 2: three replies") {
    auto backend = std::make_shared<Recorder>(std::vector<std::string>{R"({"summary": "x"})"});
    Planner planner(backend, shipped_prompts());
    auto result = planner.plan(make_problem());
    REQUIRE_FALSE(result);
    CHECK(backend->calls() == 3);
    CHECK(result.error().code == ErrorCode::LlmError);
    CHECK(contains(result.error().message, "steps: missing"));
  }
  SECTION("a backend error passes through without a re-ask") {
    auto backend = scripted_recorder({{"this pattern matches no prompt", {kPlanJson}}});
    Planner planner(backend, shipped_prompts());
    auto result = planner.plan(make_problem());
    REQUIRE_FALSE(result);
    CHECK(backend->calls() == 1);
    CHECK(result.error().code == ErrorCode::NotFound);  // the scripted backend's own error
  }
}
