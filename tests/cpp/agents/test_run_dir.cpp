// The run directory: the layout a run leaves, a round trip through load() that gives back every field
// of an attempt, interrupted attempts dropped, secrets redacted from config.json, and the refusals that
// keep one run from overwriting another.
#include "catch_shim.hpp"
#include "temp_dir.hpp"

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include <stitchcuda/agents.hpp>

using stitchcuda::ErrorCode;
using stitchcuda::agents::AttemptRecord;
using stitchcuda::agents::Exchange;
using stitchcuda::agents::ProblemPlan;
using stitchcuda::agents::ProblemPlanResult;
using stitchcuda::agents::Problem;
using stitchcuda::agents::PromptLibrary;
using stitchcuda::agents::Report;
using stitchcuda::agents::RunDirectory;
using stitchcuda_test::contains;
using stitchcuda_test::TempDir;
using Json = nlohmann::json;
namespace fs = std::filesystem;
namespace rubric = stitchcuda::rubric;

namespace {

std::string read(const fs::path& path) { return stitchcuda_test::read_file(path); }

std::vector<Json> read_lines(const fs::path& path) {
  std::vector<Json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(Json::parse(line));
  return out;
}

const char* kReportJson =
    R"({"schema_version": 1, "compiled": true, "correct": true, "hack": false, "findings": [{"rule": "hardcoded-shape", "severity": "minor", "message": "assumes 128 columns.", "line": 30, "evidence": "const int N = 128;"}], "outputs": [], "speedup": {"eager": 1.5, "compile": null}, "timing": {"candidate_ms": 0.2}, "profile": {"kernels": [{"name": "k_gelu", "share": 0.8}], "bottleneck": "memory-bound"}, "error": null, "feedback": "", "compile_log": "", "trials": [], "static_only": false, "wall_s": 2.0})";

Exchange exchange(const std::string& agent, const std::string& reply) {
  Exchange e;
  e.agent = agent;
  e.model = "gpt-4.1-2025-04-14";
  e.messages = {{"system", "You write CUDA."}, {"user", "Write ModelNew for:\nclass Model: ..."}};
  e.reply = reply;
  e.finish_reason = "stop";
  e.usage = {1200, 800, 2000};
  e.latency_s = 3.25;
  e.prompt_name = "coder_plan";
  e.prompt_sha256 = std::string(64, 'a');
  e.snippets = {"coalescing#vector-loads", "reductions#shuffles"};
  return e;
}

AttemptRecord finished_attempt() {
  AttemptRecord a;
  a.index = 1;
  a.plan = 1;
  a.skill = rubric::Skill::from_plan;
  a.candidate = "import torch\nclass ModelNew(torch.nn.Module):\n    pass\n";
  auto report = Report::from_json(kReportJson);
  REQUIRE(report);
  a.report = *report;
  a.feedback.kind = "correct";
  a.feedback.text = "Correct. Speed-up: 1.50x over eager PyTorch.\nBottleneck: memory-bound\n";
  a.feedback.asks = {"attack the bottleneck: memory-bound"};
  Exchange diag = exchange("verifier", "Use float4 loads.");
  diag.error = "";
  a.feedback.exchange = diag;
  for (auto& item : a.scorecard.items) item.score = 4;
  a.scorecard.items[0].dimension = rubric::Dimension::anti_hacking;
  a.scorecard.items[1].dimension = rubric::Dimension::cuda_engineering;
  a.scorecard.items[2].dimension = rubric::Dimension::operator_coverage;
  a.scorecard.items[3].dimension = rubric::Dimension::skill_compliance;
  a.scorecard.items[1].score = 2;
  a.scorecard.items[1].reason = "no shared-memory tiling.";
  a.scorecard.items[1].evidence = {"cuda[0]:12: float4 v = x4[i];"};
  a.scorecard.judged = true;
  a.scorecard.judge_note = "judge agreed";
  a.reward.value = 2.1;
  a.reward.correct = true;
  a.reward.speedup = 1.5;
  a.reward.total = 14;
  a.reward.normalized = 0.125;
  a.reward.lambda = 1.0;
  a.reward.shaped = 2.025;
  Exchange failed = exchange("coder", "");
  failed.error = "the reply defines no ModelNew";
  a.exchanges = {failed, exchange("coder", "```python\nclass ModelNew: ...\n```")};
  a.wall_s = 12.5;
  a.llm_s = 6.5;
  a.verify_s = 5.0;
  return a;
}

AttemptRecord failed_attempt() {
  AttemptRecord a;
  a.index = 2;
  a.plan = 1;
  a.skill = rubric::Skill::from_feedback;
  a.coder_error = "the model's reply was cut off at max_tokens";
  a.feedback.kind = "compile";
  a.exchanges = {exchange("coder", "```python\nclass ModelNew")};
  for (auto& item : a.scorecard.items) item.score = 1;
  a.reward.zero_reason = "not compiled";
  return a;
}

ProblemPlan plan() {
  ProblemPlan p;
  p.summary = "Fuse the GEMM epilogue.";
  p.steps = {{"Use cuBLASLt with a GELU epilogue", "bias and GELU in the epilogue"}};
  p.fusion_groups = {{{"linear", "gelu"}, "cublasLt matmul + epilogue", "saves one round trip"}};
  p.bottlenecks = {"GEMM throughput"};
  p.risks = {"tanh approximation of GELU"};
  p.constraints = {"float32 in and out"};
  return p;
}

}  // namespace

TEST_CASE("a run directory round-trips plans and attempts", "[agents]") {
  TempDir tmp;
  const std::string root = (tmp.path() / "run").string();
  auto dir = RunDirectory::create(root);
  REQUIRE(dir);
  CHECK(dir->path() == root);

  REQUIRE(dir->write_config(R"({"model": "openai:gpt-4.1", "api_key": "sk-live-123456789", "max_tokens": 4096})"));
  Problem problem;
  problem.name = "block_gelu";
  problem.reference = "class Model: ...\n";
  problem.hardware.gpu = "NVIDIA H200";
  problem.hardware.sms = 132;
  REQUIRE(dir->write_problem(problem));

  std::vector<std::pair<std::string, std::string>> texts;
  for (const auto& name : PromptLibrary::required_names())
    texts.emplace_back(name, "<!-- version: 3 -->\n" + name + " prompt {{reference}}\n");
  auto prompts = PromptLibrary::from_texts(texts);
  REQUIRE(prompts);
  REQUIRE(dir->write_prompts(*prompts));

  ProblemPlanResult made{plan(), {exchange("planner", "{\"summary\": ...}")}};
  REQUIRE(dir->write_plan(1, made, problem.name));
  AttemptRecord first = finished_attempt(), second = failed_attempt();
  REQUIRE(dir->write_attempt(first, problem.name));
  REQUIRE(dir->write_attempt(second, problem.name));
  REQUIRE(dir->write_best(first.candidate));
  REQUIRE(dir->write_summary(R"({"best_speedup": 1.5})"));
  REQUIRE(dir->append_event("{\n  \"stage\": \"plan\",\n  \"attempt\": 0\n}"));
  REQUIRE(dir->append_event(R"({"stage": "done"})"));

  const fs::path run(root);
  SECTION("the layout") {
    for (const char* f : {"config.json", "problem.py", "hardware.json", "prompts/index.json", "prompts/verifier.md",
                          "plans/plan-1.json", "plans/plan-1.calls.json", "best.py", "summary.json",
                          "trajectories.jsonl", "events.jsonl"})
      CHECK(fs::exists(run / f));
    for (const char* f : {"candidate.py", "report.json", "feedback.md", "rubric.json", "reward.json", "attempt.json"})
      CHECK(fs::exists(run / "attempts" / "001" / f));
    CHECK(read(run / "problem.py") == problem.reference);
    CHECK(Json::parse(read(run / "hardware.json"))["sms"] == 132);
    CHECK(read(run / "best.py") == first.candidate);
    CHECK(read(run / "attempts/001/report.json") == std::string(kReportJson) + "\n");  // the Verifier's own JSON
    CHECK(Json::parse(read(run / "attempts/002/report.json")) == Json{{"error", second.coder_error}});
    CHECK(read(run / "attempts/001/feedback.md") == first.feedback.text);
    auto rubric_json = Json::parse(read(run / "attempts/001/rubric.json"));
    CHECK(rubric_json["total"] == 14);
    CHECK(rubric_json["items"][1]["dimension"] == "cuda-engineering");
    CHECK(rubric_json["items"][1]["evidence"][0] == "cuda[0]:12: float4 v = x4[i];");
    CHECK(Json::parse(read(run / "attempts/001/reward.json"))["value"] == 2.1);
    CHECK(read(run / "prompts/verifier.md") == "verifier prompt {{reference}}\n");
    auto index = Json::parse(read(run / "prompts/index.json"));
    CHECK(index["verifier"]["version"] == "3");
    CHECK(index["verifier"]["sha256"] == (*prompts->get("verifier"))->sha256);
    CHECK(Json::parse(read(run / "plans/plan-1.calls.json"))[0]["agent"] == "planner");

    auto events = read_lines(run / "events.jsonl");
    REQUIRE(events.size() == 2);  // the pretty-printed event became one line
    CHECK(events[0]["stage"] == "plan");
  }

  SECTION("trajectories: one record per model call, every record with the same keys") {
    auto lines = read_lines(run / "trajectories.jsonl");
    // The Planner's call; attempt 1's two Coder calls and the VerifierAgent's; attempt 2's Coder call.
    REQUIRE(lines.size() == 5);
    const std::vector<std::string> agents = {"planner", "coder", "coder", "verifier", "coder"};
    auto keys_of = [](const Json& j) {
      std::vector<std::string> keys;
      for (const auto& item : j.items()) keys.push_back(item.key());
      return keys;
    };
    for (const char* key : {"messages", "prompt", "completion", "problem", "run_id", "model", "agent", "prompt_name",
                            "prompt_sha256", "skill", "attempt", "reward"})
      CHECK(lines[0].contains(key));
    for (std::size_t i = 0; i < lines.size(); ++i) {
      INFO("record " << i);
      const Json& t = lines[i];
      CHECK(keys_of(t) == keys_of(lines[0]));
      CHECK(t["agent"] == agents[i]);
      CHECK(t["run_id"] == "run");
      CHECK(t["problem"] == "block_gelu");
      CHECK(t["model"] == "gpt-4.1-2025-04-14");
      CHECK(t["prompt_sha256"] == std::string(64, 'a'));
      // messages = prompt + the reply as the last, assistant message; completion = that message alone.
      REQUIRE(t["completion"].size() == 1);
      CHECK(t["completion"][0]["role"] == "assistant");
      Json whole = t["prompt"];
      whole.push_back(t["completion"][0]);
      CHECK(t["messages"] == whole);
      CHECK(t["prompt"][1]["content"] == "Write ModelNew for:\nclass Model: ...");
      CHECK(t["latency_s"].is_number_float());
    }
    // Who and when: the first plan precedes every attempt; only the Coder has a skill and a reward.
    CHECK(lines[0]["attempt"].is_null());
    CHECK(lines[0]["plan"] == 1);
    for (std::size_t i : {0, 3}) {
      CHECK(lines[i]["skill"].is_null());
      CHECK(lines[i]["reward"].is_null());
    }
    CHECK(lines[3]["attempt"] == 1);
    CHECK(lines[3]["feedback_kind"] == "correct");
    CHECK(lines[3]["completion"][0]["content"] == "Use float4 loads.");
    CHECK(lines[1]["attempt"] == 1);
    CHECK(lines[1]["skill"] == 1);
    CHECK(lines[1]["error"] == "the reply defines no ModelNew");
    CHECK(lines[2]["completion"][0]["content"] == "```python\nclass ModelNew: ...\n```");
    CHECK(lines[2]["usage"]["total_tokens"] == 2000);
    CHECK(lines[2]["prompt_name"] == "coder_plan");
    const Json& reward = lines[2]["reward"];
    CHECK(reward["value"] == 2.1);
    CHECK(reward["lambda"] == 1.0);
    CHECK(reward["total"] == 14);
    CHECK(reward["rubric"] == Json{{"anti-hacking", 4}, {"cuda-engineering", 2}, {"operator-coverage", 4},
                                   {"skill-compliance", 4}});
    CHECK(reward["why_zero"] == "");
    CHECK(lines[4]["attempt"] == 2);
    CHECK(lines[4]["skill"] == 2);
    CHECK(lines[4]["reward"]["value"] == 0.0);
    CHECK(lines[4]["reward"]["why_zero"] == "no candidate: the model's reply was cut off at max_tokens");
  }

  SECTION("write_trajectories rebuilds the file from what load reads back, dropping an unfinished attempt") {
    const std::string appended = read(run / "trajectories.jsonl");
    auto saved = dir->load();
    REQUIRE(saved);
    REQUIRE(dir->write_trajectories(*saved, problem.name));
    CHECK(read(run / "trajectories.jsonl") == appended);  // the same records, in the same order

    fs::remove(run / "attempts" / "002" / "attempt.json");  // killed after its records were appended
    saved = dir->load();
    REQUIRE(saved);
    REQUIRE(dir->write_trajectories(*saved, problem.name));
    auto lines = read_lines(run / "trajectories.jsonl");
    REQUIRE(lines.size() == 4);  // attempt 2's record is gone: the resumed run writes it again
    CHECK(lines.back()["agent"] == "verifier");
    CHECK(lines.back()["attempt"] == 1);
  }

  SECTION("load gives every field back") {
    auto opened = RunDirectory::open(root);
    REQUIRE(opened);
    auto saved = opened->load();
    REQUIRE(saved);
    CHECK(contains(saved->config_json, "<redacted>"));
    REQUIRE(saved->plans.size() == 1);
    CHECK(saved->plans[0].plan.to_json() == plan().to_json());
    REQUIRE(saved->plans[0].exchanges.size() == 1);  // the calls that made it: their tokens count on resume
    CHECK(saved->plans[0].exchanges[0].usage.total_tokens == 2000);
    CHECK(saved->plans[0].exchanges[0].model == "gpt-4.1-2025-04-14");
    REQUIRE(saved->attempts.size() == 2);

    const AttemptRecord& a = saved->attempts[0];
    CHECK(stitchcuda::agents::to_json(a) == stitchcuda::agents::to_json(first));
    CHECK(a.index == 1);
    CHECK(a.skill == rubric::Skill::from_plan);
    CHECK(a.candidate == first.candidate);
    CHECK(a.report.json == kReportJson);
    CHECK(a.report.compiled);
    CHECK(a.report.correct);
    REQUIRE(a.report.speedup_eager);
    CHECK(*a.report.speedup_eager == 1.5);
    CHECK_FALSE(a.report.speedup_compile);
    CHECK(a.report.top_kernel == "k_gelu (80% of GPU time)");
    CHECK(a.report.bottleneck == "memory-bound");
    REQUIRE(a.report.findings.size() == 1);
    CHECK(a.report.findings[0].evidence == "const int N = 128;");
    CHECK(a.report.finding_lines == std::vector<int>{30});
    CHECK(a.report.finding_messages == first.report.finding_messages);
    CHECK(a.report.candidate_ms == 0.2);
    CHECK(a.feedback.kind == "correct");
    CHECK(a.feedback.text == first.feedback.text);
    CHECK(a.feedback.asks == first.feedback.asks);
    REQUIRE(a.feedback.exchange);
    CHECK(a.feedback.exchange->reply == "Use float4 loads.");
    CHECK(a.scorecard.total() == 14);
    CHECK(a.scorecard.items[1].reason == "no shared-memory tiling.");
    CHECK(a.scorecard.items[1].evidence == first.scorecard.items[1].evidence);
    CHECK(a.scorecard.judged);
    CHECK(a.scorecard.judge_note == "judge agreed");
    CHECK(a.reward.value == 2.1);
    CHECK(a.reward.correct);
    CHECK(a.reward.normalized == 0.125);
    CHECK(a.reward.shaped == 2.025);
    REQUIRE(a.exchanges.size() == 2);
    CHECK(a.exchanges[0].error == "the reply defines no ModelNew");
    CHECK(a.exchanges[1].messages.size() == 2);
    CHECK(a.exchanges[1].messages[0].role == "system");
    CHECK(a.exchanges[1].usage.completion_tokens == 800);
    CHECK(a.exchanges[1].latency_s == 3.25);
    CHECK(a.exchanges[1].prompt_sha256 == std::string(64, 'a'));
    CHECK(a.exchanges[1].snippets == first.exchanges[1].snippets);
    CHECK(a.wall_s == 12.5);
    CHECK(a.llm_s == 6.5);
    CHECK(a.verify_s == 5.0);

    const AttemptRecord& b = saved->attempts[1];
    CHECK(stitchcuda::agents::to_json(b) == stitchcuda::agents::to_json(second));
    CHECK(b.skill == rubric::Skill::from_feedback);
    CHECK(b.candidate.empty());
    CHECK(b.coder_error == second.coder_error);
    CHECK_FALSE(b.feedback.exchange);
    CHECK(b.reward.zero_reason == "not compiled");
  }

  SECTION("an attempt folder without attempt.json was interrupted and is dropped") {
    AttemptRecord third = finished_attempt();
    third.index = 3;
    REQUIRE(dir->write_attempt(third, problem.name));
    fs::remove(run / "attempts" / "003" / "attempt.json");
    fs::create_directories(run / "attempts" / "005");
    std::ofstream(run / "attempts" / "005" / "candidate.py") << "class ModelNew: ...";
    fs::create_directories(run / "attempts" / "notes");
    auto saved = dir->load();
    REQUIRE(saved);
    REQUIRE(saved->attempts.size() == 2);
    CHECK(saved->attempts[0].index == 1);
    CHECK(saved->attempts[1].index == 2);
  }

  SECTION("a corrupt attempt.json is an error, not a silently repeated attempt") {
    std::ofstream(run / "attempts" / "002" / "attempt.json") << "{\"index\": 2, ";
    auto saved = dir->load();
    REQUIRE_FALSE(saved);
    CHECK(saved.error().code == ErrorCode::InvalidArgument);
    CHECK(contains(saved.error().message, "002"));
  }
}

TEST_CASE("config.json redacts secrets, keeps budgets", "[agents]") {
  TempDir tmp;
  auto dir = RunDirectory::create(tmp.str());  // an empty existing folder is fine
  REQUIRE(dir);
  REQUIRE(dir->write_config(R"({
    "llm": {"spec": "openai:gpt-4.1", "api_key": "sk-live-123456789", "API_KEY_ENV": "OPENAI_API_KEY",
            "max_tokens": 4096, "headers": {"Authorization": "Bearer abcdef"}, "x-api-key": "k1",
            "access_token": "tok-1", "empty_token": ""},
    "budget": {"tokens": 200000, "attempts": 8},
    "servers": [{"name": "local", "password": "hunter2"}, ["Authorization", "Bearer zzz"]],
    "clientSecret": {"nested": "s3"},
    "key": 7
  })"));
  std::string text = read(tmp.path() / "config.json");
  auto j = Json::parse(text);
  CHECK(j["llm"]["api_key"] == "<redacted>");
  CHECK(j["llm"]["API_KEY_ENV"] == "<redacted>");  // contains api_key: redacted though it names a variable
  CHECK(j["llm"]["headers"]["Authorization"] == "<redacted>");
  CHECK(j["llm"]["x-api-key"] == "<redacted>");
  CHECK(j["llm"]["access_token"] == "<redacted>");
  CHECK(j["llm"]["empty_token"] == "");  // nothing to hide
  CHECK(j["clientSecret"] == "<redacted>");
  CHECK(j["key"] == "<redacted>");
  CHECK(j["servers"][0]["password"] == "<redacted>");
  CHECK(j["servers"][1][1] == "<redacted>");
  CHECK(j["llm"]["max_tokens"] == 4096);
  CHECK(j["budget"]["tokens"] == 200000);
  CHECK(j["llm"]["spec"] == "openai:gpt-4.1");
  CHECK(j["servers"][0]["name"] == "local");
  for (const char* secret : {"sk-live", "abcdef", "hunter2", "zzz", "tok-1", "s3\""}) CHECK_FALSE(contains(text, secret));

  auto bad = dir->write_config("{\"api_key\": ");
  REQUIRE_FALSE(bad);
  CHECK(bad.error().code == ErrorCode::InvalidArgument);
  CHECK(read(tmp.path() / "config.json") == text);  // the old file stays whole
}

TEST_CASE("create refuses a folder that holds files; open wants a run", "[agents]") {
  TempDir tmp;
  tmp.write("old/notes.txt", "a previous run");
  auto taken = RunDirectory::create((tmp.path() / "old").string());
  REQUIRE_FALSE(taken);
  CHECK(contains(taken.error().message, "--run-dir"));
  CHECK(contains(taken.error().message, "--resume"));
  CHECK(read(tmp.path() / "old/notes.txt") == "a previous run");

  auto file = RunDirectory::create((tmp.path() / "old" / "notes.txt").string());
  REQUIRE_FALSE(file);

  auto missing = RunDirectory::open((tmp.path() / "nope").string());
  REQUIRE_FALSE(missing);
  CHECK(missing.error().code == ErrorCode::NotFound);
  auto not_a_run = RunDirectory::open((tmp.path() / "old").string());
  REQUIRE_FALSE(not_a_run);
  CHECK(not_a_run.error().code == ErrorCode::InvalidArgument);

  auto fresh = RunDirectory::create((tmp.path() / "deep" / "new").string());
  REQUIRE(fresh);
  CHECK(fs::is_directory(tmp.path() / "deep" / "new" / "attempts"));
  CHECK(RunDirectory::open(fresh->path()));  // a run just created can be resumed
  CHECK_FALSE(RunDirectory::create(fresh->path()));

  AttemptRecord zero;
  CHECK_FALSE(fresh->write_attempt(zero, "p"));  // attempts count from 1
  CHECK_FALSE(fresh->append_event("not json"));
  CHECK_FALSE(fresh->write_summary("{"));

  // A folder removed under a running run: the error names the file and the system's reason.
  fs::remove_all(fresh->path());
  auto lost = fresh->write_best("class ModelNew: ...");
  REQUIRE_FALSE(lost);
  CHECK(lost.error().code == ErrorCode::IoError);
  CHECK(contains(lost.error().message, "best.py"));
  CHECK(contains(lost.error().message, "No such file or directory"));
  CHECK_FALSE(fs::exists(fresh->path()));
}

TEST_CASE("fresh paths are stamped, sanitized and unique", "[agents]") {
  TempDir tmp;
  std::string p = RunDirectory::fresh_path(tmp.str(), "my problem/../v2");
  CHECK(fs::path(p).parent_path() == tmp.path());
  std::string name = fs::path(p).filename().string();
  CHECK(std::regex_match(name, std::regex(R"(\d{8}-\d{6}-my_problem_.._v2)")));

  fs::create_directories(p);
  std::string second = RunDirectory::fresh_path(tmp.str(), "my problem/../v2");
  // Same second: suffixed; the next second: a new stamp. Either way, a path that does not exist yet.
  CHECK(second != p);
  CHECK_FALSE(fs::exists(second));
  if (fs::path(second).filename().string().substr(0, 15) == name.substr(0, 15)) CHECK(second == p + "-2");
}

TEST_CASE("a replan's records name the attempts before it; plans load back with their calls", "[agents]") {
  TempDir tmp;
  // A trailing separator is not the run's name.
  auto dir = RunDirectory::create((tmp.path() / "20261203-004200-block_gelu").string() + "/");
  REQUIRE(dir);
  ProblemPlanResult first{plan(), {exchange("planner", "{\"summary\": ...}")}};
  ProblemPlanResult second{plan(), {exchange("replanner", "not JSON"), exchange("replanner", "{\"summary\": ...}")}};
  second.plan.summary = "A simpler plan.";
  REQUIRE(dir->write_plan(1, first, "block_gelu"));
  REQUIRE(dir->write_plan(2, second, "block_gelu", 3));
  auto lines = read_lines(fs::path(dir->path()) / "trajectories.jsonl");
  REQUIRE(lines.size() == 3);
  CHECK(lines[0]["attempt"].is_null());
  for (std::size_t i : {1, 2}) {
    CHECK(lines[i]["agent"] == "replanner");
    CHECK(lines[i]["attempt"] == 3);
    CHECK(lines[i]["plan"] == 2);
    CHECK(lines[i]["reward"].is_null());
  }
  CHECK(lines[0]["run_id"] == "20261203-004200-block_gelu");

  // Rebuilt from the records, a replan comes after the attempts before it and names how many.
  stitchcuda::agents::AttemptRecord done;
  done.index = 1;
  done.plan = 1;
  done.exchanges = {exchange("coder", "```python\nclass ModelNew: ...\n```")};
  auto saved = dir->load();
  REQUIRE(saved);
  saved->attempts = {done};
  REQUIRE(dir->write_trajectories(*saved, "block_gelu"));
  auto rebuilt = read_lines(fs::path(dir->path()) / "trajectories.jsonl");
  REQUIRE(rebuilt.size() == 4);
  CHECK(rebuilt[0]["agent"] == "planner");
  CHECK(rebuilt[1]["agent"] == "coder");
  CHECK(rebuilt[2]["agent"] == "replanner");
  CHECK(rebuilt[2]["attempt"] == 1);

  REQUIRE(saved->plans.size() == 2);
  CHECK(saved->plans[1].plan.summary == "A simpler plan.");
  REQUIRE(saved->plans[1].exchanges.size() == 2);
  CHECK(saved->plans[1].exchanges[0].reply == "not JSON");
}
