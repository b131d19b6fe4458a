// The Optimizer loop, driven by recorded and scripted backends, the shipped prompts and a fake Verifier
// that judges a candidate by a marker in its text: the Skill 1 -> Skill 2 journey to the target, what the
// run directory and trajectories.jsonl hold, the budgets, replanning, resuming (budget and usage carried
// over), and hacked candidates.
#include "agents_fixtures.hpp"

using namespace agents_test;

// ---- the Optimizer -----------------------------------------------------------------------------------

TEST_CASE("Optimizer: compile error, wrong output, slow, fast, with everything recorded", "[agents]") {
  TempDir tmp;
  const fs::path run = tmp.path() / "run";
  auto planner = planner_backend();
  auto coder = scripted_recorder({{"ModelNew", {candidate_reply("SYNTAX"), candidate_reply("WRONG"),
                                                candidate_reply("SLOW"), candidate_reply("FAST"),
                                                candidate_reply("SLOW")}}});
  auto verifier = std::make_shared<FakeVerifier>();
  Budget budget;
  budget.attempts = 6;
  budget.target_speedup = 2.0;
  Optimizer optimizer(make_agents(planner, coder), verifier, budget);
  const Problem problem = make_problem();
  std::vector<Event> events;
  auto outcome = optimizer.run(problem, run.string(), R"({"llm": {"spec": "scripted:x", "api_key": "sk-live-4242"}})",
                               [&](const Event& e) { events.push_back(e); });
  REQUIRE(outcome);

  // The journey and where it stops.
  REQUIRE(outcome->attempts.size() == 4);
  CHECK(verifier->calls == 4);
  CHECK(coder->calls() == 4);
  CHECK(planner->calls() == 1);
  CHECK(contains(outcome->stop_reason, "target"));
  CHECK(outcome->run_dir == run.string());
  CHECK(contains(outcome->best, "# marker: FAST"));
  CHECK(contains(outcome->best, "class ModelNew"));
  CHECK(outcome->best_speedup == 2.5);
  CHECK(outcome->best_attempt == 4);
  CHECK(outcome->plans == 1);
  CHECK(outcome->verified);
  const auto& at = outcome->attempts;
  for (std::size_t i = 0; i < at.size(); ++i) {
    INFO("attempt " << i + 1);
    CHECK(at[i].index == static_cast<int>(i) + 1);
    CHECK(at[i].plan == 1);
    CHECK(at[i].coder_error.empty());
    CHECK(at[i].candidate == verifier->seen.at(i));
    CHECK(at[i].skill == (i == 0 ? rubric::Skill::from_plan : rubric::Skill::from_feedback));
    REQUIRE(at[i].exchanges.size() == 1);
    CHECK(at[i].exchanges[0].prompt_name == (i == 0 ? "coder_plan" : "coder_feedback"));
  }
  CHECK(contains(at[0].candidate, "SYNTAX"));
  CHECK(contains(at[1].candidate, "WRONG"));
  CHECK(contains(at[2].candidate, "SLOW"));
  CHECK(contains(at[3].candidate, "FAST"));

  // Feedback: what to fix first, then the bottleneck.
  CHECK(at[0].feedback.kind == "compile");
  CHECK(contains(at[0].feedback.text, "candidate.py:12"));
  CHECK(contains(at[0].feedback.text, "expected ';'"));
  CHECK(at[1].feedback.kind == "incorrect");
  CHECK(contains(at[1].feedback.text, "expected 1, got 0"));
  CHECK(at[2].feedback.kind == "slow");  // correct but short of the target
  CHECK(contains(at[2].feedback.text, "DRAM at 31%"));

  // Rewards: zero until correct; the fast candidate earns more than the slow one.
  CHECK(at[0].reward.value == 0.0);
  CHECK_FALSE(at[0].reward.correct);
  CHECK(at[1].reward.value == 0.0);
  CHECK(at[2].reward.value > 0.0);
  CHECK(at[2].reward.correct);
  CHECK(at[3].reward.value > at[2].reward.value);
  CHECK(at[0].reward.lambda == 1.0);  // Skill 1's lambda
  CHECK(at[3].reward.lambda == 0.7);  // Skill 2's

  // The prompts the Coder received: the plan first, then each previous candidate with its feedback.
  CHECK(contains(coder->last_user(0), "Implement the plan below"));
  CHECK(contains(coder->last_user(0), the_plan_text()));
  for (std::size_t i = 1; i < 4; ++i) {
    INFO("Coder call " << i + 1);
    const std::string sent = coder->last_user(i);
    CHECK(contains(sent, "## Your previous candidate"));
    CHECK(contains(sent, trimmed(at[i - 1].candidate)));
    CHECK(contains(sent, trimmed(at[i - 1].feedback.text)));
  }
  CHECK(contains(coder->last_user(1), "candidate.py:12"));
  CHECK(contains(coder->last_user(2), "expected 1, got 0"));
  CHECK(contains(coder->last_user(3), "DRAM at 31%"));
  CHECK_FALSE(contains(coder->last_user(3), "# marker: SYNTAX"));  // only the latest candidate is shown

  // Progress events, mirrored in events.jsonl.
  REQUIRE_FALSE(events.empty());
  CHECK(events.front().stage == "plan");
  CHECK(events.back().stage == "done");
  CHECK(events.back().best_speedup == 2.5);
  for (const char* stage : {"code", "verify", "feedback"})
    CHECK(std::any_of(events.begin(), events.end(), [&](const Event& e) { return e.stage == stage; }));
  CHECK(lines_of(run / "events.jsonl").size() == events.size());

  // ---- the run directory ----
  const std::string config = read(run / "config.json");
  CHECK(Json::parse(config)["llm"]["api_key"] == "<redacted>");
  CHECK(Json::parse(config)["llm"]["spec"] == "scripted:x");
  CHECK_FALSE(contains(config, "sk-live-4242"));
  CHECK(read(run / "problem.py") == kReference);
  CHECK(fs::exists(run / "hardware.json"));
  CHECK(fs::exists(run / "prompts" / "index.json"));
  if (fs::exists(run / "prompts" / "index.json")) {
    auto index = Json::parse(read(run / "prompts" / "index.json"));
    CHECK(index["coder_plan"]["sha256"] == sha_of("coder_plan"));
    CHECK(index["planner"]["sha256"] == sha_of("planner"));
  }
  REQUIRE(fs::exists(run / "plans" / "plan-1.json"));
  auto plan1 = ProblemPlan::parse(read(run / "plans" / "plan-1.json"));
  REQUIRE(plan1);
  CHECK(plan1->to_json() == parsed(kPlanJson).to_json());
  CHECK_FALSE(fs::exists(run / "plans" / "plan-2.json"));
  for (int i = 1; i <= 4; ++i) {
    const fs::path folder = run / "attempts" / ("00" + std::to_string(i));
    INFO(folder.string());
    for (const char* f : {"candidate.py", "report.json", "feedback.md", "rubric.json", "reward.json", "attempt.json"})
      CHECK(fs::exists(folder / f));
    CHECK(read(folder / "candidate.py") == at[i - 1].candidate);
    CHECK(read(folder / "feedback.md") == at[i - 1].feedback.text);
    CHECK(Json::parse(read(folder / "reward.json"))["value"] == at[i - 1].reward.value);
    CHECK(Json::parse(read(folder / "attempt.json"))["index"] == i);
    CHECK_NOTHROW(Json::parse(read(folder / "report.json")));
    CHECK_NOTHROW(Json::parse(read(folder / "rubric.json")));
  }
  CHECK_FALSE(fs::exists(run / "attempts" / "005"));
  CHECK(read(run / "best.py") == outcome->best);

  auto summary = Json::parse(read(run / "summary.json"));
  CHECK(summary["best_attempt"] == 4);
  CHECK(summary["best_speedup"] == 2.5);
  CHECK(summary["stop_reason"] == outcome->stop_reason);
  CHECK(summary["plans"] == 1);
  REQUIRE(summary["attempts"].size() == 4);
  CHECK(summary["attempts"][0]["skill"] == 1);
  CHECK(summary["attempts"][3]["skill"] == 2);
  CHECK(Json::parse(outcome->summary_json())["best_attempt"] == 4);

  auto trajectories = lines_of(run / "trajectories.jsonl");
  REQUIRE(trajectories.size() == 5);  // the Planner's call, then one per Coder call (feedback is deterministic)
  CHECK(Json::parse(trajectories[0])["agent"] == "planner");
  CHECK(Json::parse(trajectories[0])["reward"].is_null());
  for (std::size_t i = 1; i < trajectories.size(); ++i) {
    INFO("trajectory " << i);
    auto t = Json::parse(trajectories[i]);
    const auto& a = at[i - 1];
    CHECK(t["agent"] == "coder");
    CHECK(t["problem"] == "add_gelu");
    CHECK(t["run_id"] == "run");
    CHECK(t["model"] == a.exchanges[0].model);  // the scripted backend's name: it answered
    CHECK(contains(t["model"].get<std::string>(), "scripted"));
    CHECK(t["skill"] == (i == 1 ? 1 : 2));
    CHECK(t["attempt"] == static_cast<int>(i));
    CHECK(t["prompt_name"] == (i == 1 ? "coder_plan" : "coder_feedback"));
    CHECK(t["reward"]["value"] == a.reward.value);
    CHECK(t["reward"]["total"] == a.scorecard.total());
    CHECK(t["reward"]["rubric"]["skill-compliance"] == a.scorecard[rubric::Dimension::skill_compliance].score);
    CHECK(t["completion"][0]["content"] == a.exchanges[0].reply);
  }
  // Why the first two earned nothing, in words a filter can match.
  CHECK(contains(Json::parse(trajectories[1])["reward"]["why_zero"].get<std::string>(), "incorrect: compile: "));
  CHECK(contains(Json::parse(trajectories[2])["reward"]["why_zero"].get<std::string>(), "incorrect: incorrect: "));
  CHECK(Json::parse(trajectories[3])["reward"]["why_zero"] == "");
}

TEST_CASE("Optimizer stops when the attempt budget is spent", "[agents]") {
  TempDir tmp;
  auto coder = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("WRONG")});
  auto verifier = std::make_shared<FakeVerifier>();
  Budget budget;
  budget.attempts = 2;
  budget.target_speedup = 2.0;
  Optimizer optimizer(make_agents(planner_backend(), coder), verifier, budget);
  auto outcome = optimizer.run(make_problem(), (tmp.path() / "run").string());
  REQUIRE(outcome);
  CHECK(outcome->attempts.size() == 2);
  CHECK(verifier->calls == 2);
  CHECK(coder->calls() == 2);
  CHECK(contains(outcome->stop_reason, "attempt"));
  CHECK(outcome->best.empty());
  CHECK(outcome->best_attempt == 0);
  CHECK(outcome->best_speedup == 0.0);
  CHECK(Json::parse(read(tmp.path() / "run" / "summary.json"))["best_attempt"] == 0);
}

TEST_CASE("Optimizer replans after consecutive failures, within the replan budget", "[agents]") {
  TempDir tmp;
  const fs::path run = tmp.path() / "run";
  auto coder = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("WRONG")});
  auto replanner = std::make_shared<Recorder>(std::vector<std::string>{kPlan2Json});
  auto verifier = std::make_shared<FakeVerifier>();
  Budget budget;
  budget.attempts = 5;
  budget.replans = 1;
  budget.replan_after_failures = 2;
  budget.target_speedup = 2.0;
  Optimizer optimizer(make_agents(planner_backend(), coder, replanner), verifier, budget);
  auto outcome = optimizer.run(make_problem(), run.string());
  REQUIRE(outcome);
  REQUIRE(outcome->attempts.size() == 5);
  CHECK(outcome->plans == 2);
  CHECK(replanner->calls() == 1);  // the second stall finds the replan budget spent
  CHECK(contains(outcome->stop_reason, "attempt"));
  CHECK(fs::exists(run / "plans" / "plan-2.json"));
  CHECK_FALSE(fs::exists(run / "plans" / "plan-3.json"));
  auto plan2 = ProblemPlan::parse(read(run / "plans" / "plan-2.json"));
  REQUIRE(plan2);
  CHECK(plan2->summary == parsed(kPlan2Json).summary);

  const auto& at = outcome->attempts;
  const int plans[] = {1, 1, 2, 2, 2};
  for (std::size_t i = 0; i < 5; ++i) {
    INFO("attempt " << i + 1);
    CHECK(at[i].plan == plans[i]);
  }
  // The replanner saw the old plan and what the first two attempts showed.
  const std::string sent = replanner->last_user(0);
  CHECK(contains(sent, "An earlier plan for this reference has stalled"));
  CHECK(contains(sent, the_plan_text()));
  CHECK(contains(sent, "incorrect"));
  // A new plan starts over from Skill 1 with that plan.
  CHECK(at[2].skill == rubric::Skill::from_plan);
  CHECK(at[3].skill == rubric::Skill::from_feedback);
  REQUIRE(coder->calls() == 5);
  CHECK(contains(coder->last_user(2), "Grid-stride scalar kernel for add-GELU"));
  CHECK_FALSE(contains(coder->last_user(1), "Grid-stride scalar kernel for add-GELU"));
}

TEST_CASE("Optimizer stops when the token budget is spent", "[agents]") {
  TempDir tmp;
  // 1000 tokens per call: plan 1000, attempt 1 -> 2000, attempt 2 -> 3000 >= 2500: stop.
  auto planner = planner_backend(1000);
  auto coder = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("WRONG")}, 1000);
  auto verifier = std::make_shared<FakeVerifier>();
  Budget budget;
  budget.attempts = 10;
  budget.tokens = 2500;
  Optimizer optimizer(make_agents(planner, coder), verifier, budget);
  auto outcome = optimizer.run(make_problem(), (tmp.path() / "run").string());
  REQUIRE(outcome);
  CHECK(outcome->attempts.size() == 2);
  CHECK(coder->calls() == 2);
  CHECK(contains(outcome->stop_reason, "token"));
  CHECK(outcome->usage.total_tokens == 3000);
  CHECK(outcome->usage.prompt_tokens == 1800);
  CHECK(outcome->usage.completion_tokens == 1200);
}

TEST_CASE("Optimizer resumes a run without repeating finished attempts", "[agents]") {
  TempDir tmp;
  const std::string run = (tmp.path() / "run").string();
  const Problem problem = make_problem();
  auto verifier = std::make_shared<FakeVerifier>();
  {
    auto coder = std::make_shared<Recorder>(
        std::vector<std::string>{candidate_reply("WRONG first"), candidate_reply("WRONG second")});
    Budget budget;
    budget.attempts = 2;
    budget.target_speedup = 2.0;
    Optimizer first(make_agents(planner_backend(), coder), verifier, budget);
    auto outcome = first.run(problem, run);
    REQUIRE(outcome);
    REQUIRE(outcome->attempts.size() == 2);
  }
  REQUIRE(verifier->calls == 2);

  auto planner = planner_backend();
  auto coder = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")});
  Budget budget;
  budget.attempts = 4;
  budget.target_speedup = 2.0;
  Optimizer second(make_agents(planner, coder), verifier, budget);
  auto outcome = second.resume(problem, run);
  REQUIRE(outcome);
  CHECK(verifier->calls == 3);  // only the new attempt was verified
  CHECK(planner->calls() == 0);  // the plan was read back
  CHECK(coder->calls() == 1);
  REQUIRE(outcome->attempts.size() == 3);
  CHECK(contains(outcome->attempts[0].candidate, "WRONG first"));
  CHECK(contains(outcome->attempts[1].candidate, "WRONG second"));
  const auto& third = outcome->attempts[2];
  CHECK(third.index == 3);
  CHECK(third.skill == rubric::Skill::from_feedback);
  CHECK(contains(third.candidate, "# marker: FAST"));
  CHECK(contains(outcome->stop_reason, "target"));
  CHECK(outcome->best_attempt == 3);
  CHECK(outcome->best_speedup == 2.5);
  CHECK(outcome->plans == 1);

  // Attempt 3 revised attempt 2, with its feedback.
  const std::string sent = coder->last_user(0);
  CHECK(contains(sent, "## Your previous candidate"));
  CHECK(contains(sent, "WRONG second"));
  CHECK_FALSE(contains(sent, "WRONG first"));
  CHECK(contains(sent, "expected 1, got 0"));

  CHECK(fs::exists(fs::path(run) / "attempts" / "003" / "attempt.json"));
  CHECK(read(fs::path(run) / "best.py") == outcome->best);
  CHECK(lines_of(fs::path(run) / "trajectories.jsonl").size() == 4);  // the plan's call, three Coder calls
  CHECK(Json::parse(read(fs::path(run) / "summary.json"))["best_attempt"] == 3);
}

TEST_CASE("Optimizer never picks a hacked candidate, however fast", "[agents]") {
  TempDir tmp;
  const fs::path run = tmp.path() / "run";
  auto coder = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("HACK"), candidate_reply("SLOW")});
  auto verifier = std::make_shared<FakeVerifier>();
  Budget budget;
  budget.attempts = 2;
  budget.target_speedup = 2.0;
  Optimizer optimizer(make_agents(planner_backend(), coder), verifier, budget);
  auto outcome = optimizer.run(make_problem(), run.string());
  REQUIRE(outcome);
  REQUIRE(outcome->attempts.size() == 2);  // 10x did not end the run at the 2x target
  CHECK(contains(outcome->stop_reason, "attempt"));
  const auto& hacked = outcome->attempts[0];
  CHECK(hacked.report.hack());
  CHECK(hacked.reward.value == 0.0);
  CHECK(hacked.reward.hack);
  CHECK(hacked.feedback.kind == "hack");
  CHECK(contains(hacked.feedback.text, "torch-does-heavy-work"));
  CHECK(Json::parse(read(run / "attempts" / "001" / "reward.json"))["value"] == 0.0);
  CHECK(outcome->best_attempt == 2);
  CHECK(outcome->best_speedup == 0.8);
  CHECK(contains(outcome->best, "SLOW"));
  CHECK_FALSE(contains(outcome->best, "HACK"));
  CHECK(read(run / "best.py") == outcome->best);

  SECTION("with only hacked candidates there is no best") {
    TempDir other;
    auto cheater = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("HACK")});
    auto v = std::make_shared<FakeVerifier>();
    Optimizer o(make_agents(planner_backend(), cheater), v, budget);
    auto result = o.run(make_problem(), (other.path() / "run").string());
    REQUIRE(result);
    CHECK(result->attempts.size() == 2);
    CHECK(result->best.empty());
    CHECK(result->best_attempt == 0);
    CHECK(result->best_speedup == 0.0);
    for (const auto& a : result->attempts) CHECK(a.reward.value == 0.0);
  }
}

TEST_CASE("Optimizer: a Coder that gives no candidate spends an attempt; a failing Verifier ends the run", "[agents]") {
  TempDir tmp;
  const fs::path run = tmp.path() / "run";
  const Problem problem = make_problem();
  Budget budget;
  budget.attempts = 4;
  budget.target_speedup = 2.0;

  SECTION("no usable candidate after the re-asks: an attempt without a candidate, then Skill 1 again") {
    // max_repairs = 2: three unusable replies make attempt 1 fail; attempt 2 gets FAST.
    auto coder = std::make_shared<Recorder>(std::vector<std::string>{
        "I cannot write that.", "Still no code.", "Sorry.", candidate_reply("FAST")}, 1000);
    auto verifier = std::make_shared<FakeVerifier>();
    Optimizer optimizer(make_agents(planner_backend(), coder), verifier, budget);
    auto outcome = optimizer.run(problem, run.string());
    REQUIRE(outcome);
    REQUIRE(outcome->attempts.size() == 2);
    CHECK(coder->calls() == 4);
    CHECK(verifier->calls == 1);  // nothing to verify in attempt 1
    const auto& failed = outcome->attempts[0];
    CHECK(failed.candidate.empty());
    CHECK_FALSE(failed.coder_error.empty());
    CHECK(failed.exchanges.size() == 3);
    CHECK(failed.reward.value == 0.0);
    CHECK(outcome->attempts[1].skill == rubric::Skill::from_plan);  // nothing to revise
    CHECK(outcome->best_attempt == 2);
    CHECK(contains(outcome->stop_reason, "target"));
    CHECK(lines_of(run / "trajectories.jsonl").size() == 5);  // the plan's and every Coder call, failed ones included
    CHECK(outcome->usage.total_tokens == 4000);  // the failed calls' tokens count too (the planner reports none)
    CHECK(Json::parse(read(run / "attempts" / "001" / "report.json"))["error"] == failed.coder_error);
  }

  SECTION("a Verifier error is not the candidate's fault: the run fails with it") {
    auto coder = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("UNKNOWN")});
    auto verifier = std::make_shared<FakeVerifier>();
    Optimizer optimizer(make_agents(planner_backend(), coder), verifier, budget);
    auto outcome = optimizer.run(problem, run.string());
    REQUIRE_FALSE(outcome);
    CHECK(outcome.error().code == ErrorCode::Internal);
    CHECK(contains(outcome.error().message, "no marker"));
    CHECK(verifier->calls == 1);
  }
}

// ---- resuming keeps the run's totals; the budget is recorded -------------------------------------

TEST_CASE("Optimizer: usage counts every call of the run, before a resume too", "[agents]") {
  TempDir tmp;
  const std::string run = (tmp.path() / "run").string();
  const Problem problem = make_problem();
  auto verifier = std::make_shared<FakeVerifier>();
  Budget budget;
  budget.attempts = 2;
  budget.target_speedup = 2.0;
  // 1000 tokens per call: the plan and two attempts.
  Optimizer first(make_agents(planner_backend(1000), std::make_shared<Recorder>(
                                                          std::vector<std::string>{candidate_reply("WRONG")}, 1000)),
                  verifier, budget);
  auto before = first.run(problem, run);
  REQUIRE(before);
  REQUIRE(before->usage.total_tokens == 3000);

  SECTION("a finished run resumed does nothing new and reports the same totals") {
    auto planner = planner_backend(1000);
    auto coder = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")}, 1000);
    Optimizer again(make_agents(planner, coder), verifier, budget);
    auto after = again.resume(problem, run);
    REQUIRE(after);
    CHECK(planner->calls() + coder->calls() == 0);
    CHECK(after->attempts.size() == 2);
    CHECK(after->usage.total_tokens == 3000);
    CHECK(after->usage.prompt_tokens == before->usage.prompt_tokens);
    CHECK(after->usage.completion_tokens == before->usage.completion_tokens);
    CHECK(Json::parse(read(fs::path(run) / "summary.json"))["usage"]["total_tokens"] == 3000);
  }
  SECTION("a killed attempt is done again; the totals are the same as had it finished") {
    fs::remove(fs::path(run) / "attempts" / "002" / "attempt.json");  // killed before it was recorded
    auto coder = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("WRONG again")}, 1000);
    Optimizer again(make_agents(planner_backend(1000), coder), verifier, budget);
    auto after = again.resume(problem, run);
    REQUIRE(after);
    CHECK(coder->calls() == 1);
    CHECK(after->attempts.size() == 2);
    CHECK(after->usage.total_tokens == 3000);
  }
  SECTION("a token budget holds across resumes") {
    Budget tight = budget;
    tight.attempts = 10;
    tight.tokens = 2500;
    auto coder = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")}, 1000);
    Optimizer again(make_agents(planner_backend(1000), coder), verifier, tight);
    auto after = again.resume(problem, run);
    REQUIRE(after);
    CHECK(coder->calls() == 0);  // 3000 tokens were spent before the resume
    CHECK(contains(after->stop_reason, "token budget spent (3000 tokens)"));
  }
}

TEST_CASE("Optimizer records the budget in config.json, and on resume what changed", "[agents]") {
  TempDir tmp;
  const fs::path run = tmp.path() / "run";
  const Problem problem = make_problem();
  auto verifier = std::make_shared<FakeVerifier>();
  Budget budget;
  budget.attempts = 1;
  budget.tokens = 50000;
  Optimizer first(make_agents(planner_backend(), std::make_shared<Recorder>(
                                                      std::vector<std::string>{candidate_reply("WRONG")})),
                  verifier, budget);
  REQUIRE(first.run(problem, run.string(), R"({"budget": {"attempts": 99}, "problem": "add_gelu"})"));
  auto config = Json::parse(read(run / "config.json"));
  CHECK(config["budget"] == Json::parse(budget.to_json()));  // the Optimizer's, whole, over the caller's
  CHECK(config["problem"] == "add_gelu");
  auto saved = Budget::from_json(config["budget"].dump());
  REQUIRE(saved);
  CHECK(saved->attempts == 1);
  CHECK(saved->tokens == 50000);
  CHECK(saved->replans == Budget{}.replans);

  Budget more = *saved;
  more.attempts = 3;
  std::vector<Event> events;
  Optimizer second(make_agents(planner_backend(), std::make_shared<Recorder>(
                                                       std::vector<std::string>{candidate_reply("WRONG")})),
                   verifier, more);
  auto outcome = second.resume(problem, run.string(), [&](const Event& e) { events.push_back(e); });
  REQUIRE(outcome);
  CHECK(outcome->attempts.size() == 3);
  config = Json::parse(read(run / "config.json"));
  CHECK(config["budget"]["attempts"] == 3);
  REQUIRE(config["resumes"].size() == 1);
  CHECK(config["resumes"][0]["attempts_done"] == 1);
  CHECK(config["resumes"][0]["budget_changes"] == Json{{"attempts", {{"saved", 1}, {"now", 3}}}});
  REQUIRE_FALSE(events.empty());
  CHECK(events.front().stage == "resume");
  CHECK(contains(events.front().message, "attempts 1 -> 3"));
  auto logged = lines_of(run / "events.jsonl");
  CHECK(std::any_of(logged.begin(), logged.end(), [](const std::string& l) {
    return Json::parse(l)["stage"] == "resume" && Json::parse(l)["budget"]["attempts"] == 3;
  }));

  SECTION("a budget field of the wrong type is an error naming it") {
    auto bad = Budget::from_json(R"({"attempts": "three", "tokens": 1.5})");
    REQUIRE_FALSE(bad);
    CHECK(contains(bad.error().message, "attempts"));
    CHECK(contains(bad.error().message, "tokens"));
  }
}

// ---- what the rubric is given ------------------------------------------------------------------------

TEST_CASE("Optimizer without a GPU: unverified, not incorrect; a fixed compile error counts as followed", "[agents]") {
  TempDir tmp;
  // The fix changes code, not only the marker comment (an unchanged candidate addresses nothing).
  std::string revised = candidate_reply("STATIC");
  revised.replace(revised.find("return x  #"), 11, "return x * 1.0  #");
  auto coder = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("SYNTAX"), revised});
  auto verifier = std::make_shared<FakeVerifier>();
  Budget budget;
  budget.attempts = 4;
  Optimizer optimizer(make_agents(planner_backend(), coder), verifier, budget);
  auto outcome = optimizer.run(make_problem(), (tmp.path() / "run").string());
  REQUIRE(outcome);
  REQUIRE(outcome->attempts.size() == 2);  // the first that compiles and passes the static checks ends it
  CHECK_FALSE(outcome->verified);
  const auto& broken = outcome->attempts[0];
  const auto& fixed = outcome->attempts[1];
  CHECK(broken.reward.zero_reason == "not compiled");
  CHECK(fixed.reward.zero_reason == "unverified");
  CHECK(fixed.reward.value == 0.0);
  // A candidate that did not compile never outscores one that did.
  CHECK(broken.scorecard.total() == 4);
  CHECK(fixed.scorecard.total() >= broken.scorecard.total());
  // The compile error the feedback asked to fix is gone: followed, not "still fails".
  const auto& compliance = fixed.scorecard[rubric::Dimension::skill_compliance];
  REQUIRE_FALSE(compliance.evidence.empty());
  CHECK(contains(compliance.evidence[0], "followed"));
  CHECK(contains(compliance.evidence[0], "compiles now"));
  CHECK(compliance.score == 5);
  auto lines = lines_of(tmp.path() / "run" / "trajectories.jsonl");
  CHECK(Json::parse(lines.back())["reward"]["why_zero"] == "unverified");
}

TEST_CASE("Optimizer scores a kernel step's CUDA source", "[agents]") {
  TempDir tmp;
  // A vectorized kernel: the rubric must read the source inside the kernel step's JSON text.
  const std::string reply =
      "```cuda\n"
      "// FAST\n"
      "extern \"C\" __global__ void add_gelu(const float4* x, float4* y, int n) {\n"
      "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
      "  if (i < n) { float4 v = x[i]; y[i] = v; }\n"
      "}\n"
      "```\n\n```json\n{\"kernel\": \"add_gelu\", \"grid\": [\"ceil_div(out0.numel, 1024)\"], \"block\": [256], "
      "\"args\": [\"in0\", \"out0\", \"ceil_div(out0.numel, 4)\"]}\n```\n";
  auto coder = std::make_shared<Recorder>(std::vector<std::string>{reply});
  auto verifier = std::make_shared<FakeVerifier>();
  Budget budget;
  budget.attempts = 1;
  Problem problem = make_problem();
  problem.answer = "kernel_step";
  problem.target = "inputs: in0 [4] float32\noutputs: out0 [4] float32";
  Optimizer optimizer(make_agents(planner_backend(), coder), verifier, budget);
  auto outcome = optimizer.run(problem, (tmp.path() / "run").string());
  REQUIRE(outcome);
  REQUIRE(outcome->attempts.size() == 1);
  const auto& a = outcome->attempts[0];
  REQUIRE(stitchcuda::agents::KernelStep::parse(a.candidate));
  CHECK(verifier->seen.at(0) == a.candidate);  // the Verifier is given the kernel step's canonical text
  const auto& engineering = a.scorecard[rubric::Dimension::cuda_engineering];
  CHECK(engineering.score == 2);  // one kernel, vectorized access
  CHECK(contains(engineering.reason, "vectorized access"));
}
