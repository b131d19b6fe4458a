// The agents that talk to a model (Planner, Coder, Replanner) and the Optimizer loop, driven by recorded
// and scripted backends, the shipped prompts and a fake Verifier that judges a candidate by a marker in
// its text: the prompts each agent sends, the re-ask rules, the Skill 1 -> Skill 2 journey to the target,
// what the run directory holds, the budgets, replanning, resuming, and hacked candidates.
#include "catch_shim.hpp"
#include "temp_dir.hpp"

#include <algorithm>
#include <deque>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include <nlohmann/json.hpp>

#include <stitchcuda/agents.hpp>

using stitchcuda::ErrorCode;
using stitchcuda::Result;
using stitchcuda::agents::Agents;
using stitchcuda::agents::AgentOptions;
using stitchcuda::agents::AttemptSummary;
using stitchcuda::agents::Budget;
using stitchcuda::agents::Coder;
using stitchcuda::agents::CoderRequest;
using stitchcuda::agents::Event;
using stitchcuda::agents::Optimizer;
using stitchcuda::agents::Outcome;
using stitchcuda::agents::Plan;
using stitchcuda::agents::Planner;
using stitchcuda::agents::Problem;
using stitchcuda::agents::PromptLibrary;
using stitchcuda::agents::Replanner;
using stitchcuda::agents::Report;
using stitchcuda::agents::VerifierAgent;
using stitchcuda_test::contains;
using stitchcuda_test::TempDir;
using Json = nlohmann::json;
namespace fs = std::filesystem;
namespace llm = stitchcuda::llm;
namespace rubric = stitchcuda::rubric;

namespace {

// ---- fixtures ------------------------------------------------------------------------------------

std::string read(const fs::path& path) { return stitchcuda_test::read_file(path); }

std::vector<std::string> lines_of(const fs::path& path) {
  std::vector<std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(line);
  return out;
}

// Rendering may merge a value's final newline with the template's: compare without it.
std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

std::shared_ptr<const PromptLibrary> shipped_prompts() {
  static std::shared_ptr<const PromptLibrary> lib = [] {
    const auto folder = fs::path(__FILE__).parent_path().parent_path().parent_path().parent_path() /
                        "python/stitchcuda/agents/prompts";
    auto loaded = PromptLibrary::load(folder.string());
    REQUIRE(loaded);
    return std::make_shared<const PromptLibrary>(std::move(*loaded));
  }();
  return lib;
}

std::string sha_of(const std::string& prompt) {
  auto p = shipped_prompts()->get(prompt);
  REQUIRE(p);
  return (*p)->sha256;
}

const char* kReference =
    "import torch\n"
    "\n"
    "class Model(torch.nn.Module):\n"
    "    def forward(self, x):\n"
    "        return torch.nn.functional.gelu(x + 1.0)\n"
    "\n"
    "def get_inputs():\n"
    "    return [torch.randn(4, device='cuda')]\n"
    "\n"
    "def get_init_inputs():\n"
    "    return []\n";

Problem make_problem() {
  Problem p;
  p.name = "add_gelu";
  p.reference = kReference;
  p.hardware.gpu = "NVIDIA H200";
  p.hardware.arch = "sm_90";
  p.hardware.sms = 132;
  p.hardware.dram_tb_s = 4.8;
  p.hardware.cuda = "13.0";
  p.profile = "aten::gelu 64% of GPU time; aten::add 36%; 2 launches per forward";
  return p;
}

const char* kPlanJson = R"({"summary": "Fuse the add and the GELU into one elementwise kernel.",
  "steps": [{"title": "Write one fused add-GELU kernel", "detail": "one thread per element, float4 loads"}],
  "fusion_groups": [{"ops": ["add", "gelu"], "kernel": "k_add_gelu", "rationale": "one pass over DRAM"}],
  "bottlenecks": ["DRAM bandwidth"], "risks": ["erf accuracy"], "constraints": ["float32 in and out"]})";

const char* kPlan2Json = R"({"summary": "Second plan: a simpler grid-stride kernel without vector loads.",
  "steps": [{"title": "Grid-stride scalar kernel for add-GELU", "detail": "no float4, no shared memory"}]})";

Plan parsed(const char* json) {
  auto p = Plan::parse(json);
  REQUIRE(p);
  return *p;
}

// A Coder reply: prose, one ```python block defining ModelNew with `marker` in a comment, prose.
std::string candidate_reply(const std::string& marker) {
  return "Here is the module.\n\n```python\nimport torch\nfrom stitchcuda import jit\n\n# marker: " + marker +
         "\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x  # " + marker +
         "\n```\nThe kernel is fused.\n";
}

/// A backend that records every conversation it is sent and answers from a queue (the last reply
/// repeating), or passes the call to `inner`. `tokens` > 0 sets each answer's usage to that many tokens.
class Recorder final : public llm::Backend {
 public:
  explicit Recorder(std::vector<std::string> replies, std::int64_t tokens = 0)
      : Backend("recorder"), replies_(std::move(replies)), tokens_(tokens) {}
  explicit Recorder(std::shared_ptr<llm::Backend> inner, std::int64_t tokens = 0)
      : Backend("recorder:" + inner->name()), inner_(std::move(inner)), tokens_(tokens) {}

  Result<llm::Completion> complete(const std::vector<llm::Message>& messages, const llm::Options& options,
                                   const llm::TextCallback& on_text) override {
    std::lock_guard lock(mu_);
    calls_.push_back(messages);
    llm::Completion c;
    if (inner_) {
      auto r = inner_->complete(messages, options, on_text);
      if (!r) return r;
      c = *r;
    } else {
      REQUIRE_FALSE(replies_.empty());
      c.text = replies_[std::min(served_, replies_.size() - 1)];
      c.finish_reason = "stop";
      ++served_;
    }
    if (tokens_ > 0) c.usage = {tokens_ * 6 / 10, tokens_ - tokens_ * 6 / 10, tokens_};
    return c;
  }

  std::size_t calls() const { return calls_.size(); }
  const std::vector<llm::Message>& call(std::size_t i) const { return calls_.at(i); }
  /// The last user message of call `i`.
  std::string last_user(std::size_t i) const {
    const auto& m = calls_.at(i);
    for (auto it = m.rbegin(); it != m.rend(); ++it)
      if (it->role == "user") return it->content;
    return "";
  }

 private:
  std::mutex mu_;
  std::vector<std::string> replies_;
  std::size_t served_ = 0;
  std::shared_ptr<llm::Backend> inner_;
  std::int64_t tokens_ = 0;
  std::vector<std::vector<llm::Message>> calls_;
};

std::shared_ptr<Recorder> scripted_recorder(std::vector<llm::ScriptRule> rules, std::int64_t tokens = 0) {
  auto backend = llm::scripted_backend(std::move(rules));
  REQUIRE(backend);
  return std::make_shared<Recorder>(*backend, tokens);
}

/// Judges a candidate by the marker in its text.
class FakeVerifier final : public stitchcuda::agents::Verifier {
 public:
  Result<Report> verify(const Problem& problem, const std::string& candidate) override {
    ++calls;
    seen.push_back(candidate);
    CHECK(problem.reference == kReference);
    Report r;
    r.wall_s = 0.01;
    if (contains(candidate, "SYNTAX")) {
      r.compiled = false;
      r.error_kind = "compile";
      r.error_message = "1 error detected in the compilation of the candidate";
      r.compile_log = "candidate.py:12: error: expected ';'";
    } else if (contains(candidate, "WRONG")) {
      r.compiled = true;
      r.correct = false;
      r.error_kind = "incorrect";
      r.error_message = "1 of 1 outputs differ from the reference";
      r.mismatches = {"output 0 [4] float32: 4 elements outside tolerance; at [0]: expected 1, got 0"};
    } else if (contains(candidate, "SLOW")) {
      r.compiled = r.correct = true;
      r.speedup_eager = 0.8;
      r.bottleneck = "DRAM at 31% of peak with 4-byte loads";
      r.top_kernel = "k_add_gelu (97% of GPU time)";
    } else if (contains(candidate, "FAST")) {
      r.compiled = r.correct = true;
      r.speedup_eager = 2.5;
    } else if (contains(candidate, "HACK")) {
      r.compiled = r.correct = true;
      r.speedup_eager = 10.0;
      r.findings = {{"torch-does-heavy-work", rubric::Severity::major, "torch.nn.functional.gelu(x + 1.0)"}};
      r.finding_messages = {"forward computes GELU with torch, not with a custom kernel."};
      r.finding_lines = {9};
    } else {
      return stitchcuda::fail(ErrorCode::Internal, "the fake verifier found no marker in the candidate");
    }
    return r;
  }
  int calls = 0;
  std::vector<std::string> seen;
};

Agents make_agents(std::shared_ptr<Recorder> planner, std::shared_ptr<Recorder> coder,
                   std::shared_ptr<Recorder> replanner = nullptr) {
  AgentOptions options;
  options.doc_snippets = 0;
  Agents a;
  a.planner = std::make_shared<Planner>(planner, shipped_prompts(), nullptr, options);
  a.coder = std::make_shared<Coder>(coder, shipped_prompts(), nullptr, options);
  a.verifier_agent = std::make_shared<VerifierAgent>();  // deterministic feedback
  if (replanner) a.replanner = std::make_shared<Replanner>(replanner, shipped_prompts(), nullptr, options);
  a.rubric = std::make_shared<rubric::Rubric>();
  a.prompts = shipped_prompts();
  return a;
}

std::shared_ptr<Recorder> planner_backend(std::int64_t tokens = 0) {
  return std::make_shared<Recorder>(std::vector<std::string>{kPlanJson}, tokens);
}

std::string the_plan_text() { return trimmed(parsed(kPlanJson).describe()); }

}  // namespace

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
  auto problem_of_bad = Plan::parse(bad);
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

// ---- Coder -----------------------------------------------------------------------------------------

TEST_CASE("Coder Skill 1 renders coder_plan with the plan and extracts ModelNew", "[agents]") {
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")});
  Coder coder(backend, shipped_prompts(), nullptr, AgentOptions{{}, 0, 2});
  const Problem problem = make_problem();
  const Plan plan = parsed(kPlanJson);
  CoderRequest request;
  request.skill = rubric::Skill::from_plan;
  request.problem = &problem;
  request.plan = &plan;
  auto result = coder.write(request);
  REQUIRE(result);
  REQUIRE(backend->calls() == 1);
  const std::string sent = backend->last_user(0);
  CHECK(contains(sent, "Implement the plan below"));  // the shipped coder_plan.md
  CHECK(contains(sent, the_plan_text()));
  CHECK(contains(sent, trimmed(kReference)));
  CHECK(contains(sent, "GPU: NVIDIA H200 (sm_90), 132 SMs"));
  CHECK_FALSE(contains(sent, "Your previous candidate"));
  CHECK(contains(result->extraction.code, "class ModelNew(torch.nn.Module):"));
  CHECK(contains(result->extraction.code, "# marker: FAST"));
  CHECK_FALSE(contains(result->extraction.code, "```"));
  CHECK_FALSE(contains(result->extraction.code, "The kernel is fused."));
  REQUIRE(result->exchanges.size() == 1);
  CHECK(result->exchanges[0].agent == "coder");
  CHECK(result->exchanges[0].prompt_name == "coder_plan");
  CHECK(result->exchanges[0].prompt_sha256 == sha_of("coder_plan"));
}

TEST_CASE("Coder re-asks after a reply without a usable candidate", "[agents]") {
  const std::string bad = GENERATE(std::string("```python\nimport torch\nprint('no model here')\n```\n"),
                                   std::string("```python\nimport torch\nclass ModelNew(torch.nn.Module):\n    def f"));
  auto why = stitchcuda::agents::extract_code(bad);
  REQUIRE_FALSE(why);
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{bad, candidate_reply("SLOW")});
  Coder coder(backend, shipped_prompts());
  const Problem problem = make_problem();
  const Plan plan = parsed(kPlanJson);
  CoderRequest request;
  request.problem = &problem;
  request.plan = &plan;
  auto result = coder.write(request);
  REQUIRE(result);
  REQUIRE(backend->calls() == 2);
  REQUIRE(result->exchanges.size() == 2);
  CHECK(contains(result->extraction.code, "# marker: SLOW"));
  CHECK(contains(result->extraction.code, "class ModelNew"));
  CHECK(contains(backend->last_user(1), why.error().message));  // says what was wrong
  CHECK(backend->call(1).front().content == backend->last_user(0));
  const auto& second = backend->call(1);
  CHECK(std::any_of(second.begin(), second.end(),
                    [&](const llm::Message& m) { return m.role == "assistant" && m.content == bad; }));

  SECTION("and gives up, keeping every call, when every reply is unusable") {
    auto hopeless = std::make_shared<Recorder>(std::vector<std::string>{bad});
    Coder stubborn(hopeless, shipped_prompts(), nullptr, AgentOptions{{}, 0, 1});
    auto failed = stubborn.write(request);
    REQUIRE(failed);
    CHECK(failed->extraction.code.empty());
    CHECK(contains(failed->problem, "no usable candidate in 2 replies"));
    CHECK(failed->exchanges.size() == 2);
    CHECK(hopeless->calls() == 2);
  }
}

TEST_CASE("Coder Skill 2 renders coder_feedback with the previous candidate and the feedback", "[agents]") {
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")});
  Coder coder(backend, shipped_prompts());
  const Problem problem = make_problem();
  const Plan plan = parsed(kPlanJson);
  CoderRequest request;
  request.skill = rubric::Skill::from_feedback;
  request.problem = &problem;
  request.plan = &plan;
  request.previous = "import torch\nclass ModelNew(torch.nn.Module):\n    pass  # previous-version-7\n";
  request.feedback = "The candidate runs but its outputs are wrong.\n- output 0 [4] float32: expected 1, got 0\n";
  auto result = coder.write(request);
  REQUIRE(result);
  REQUIRE(backend->calls() == 1);
  const std::string sent = backend->last_user(0);
  CHECK(contains(sent, "Revise your previous candidate"));  // the shipped coder_feedback.md
  CHECK(contains(sent, "## Your previous candidate"));
  CHECK(contains(sent, trimmed(request.previous)));
  CHECK(contains(sent, trimmed(request.feedback)));
  CHECK(contains(sent, the_plan_text()));  // shown when given
  CHECK(contains(sent, trimmed(kReference)));
  REQUIRE(result->exchanges.size() == 1);
  CHECK(result->exchanges[0].prompt_name == "coder_feedback");
  CHECK(result->exchanges[0].prompt_sha256 == sha_of("coder_feedback"));
  CHECK(contains(result->extraction.code, "# marker: FAST"));
}

TEST_CASE("Coder refuses a request missing its inputs without calling the model", "[agents]") {
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")});
  Coder coder(backend, shipped_prompts());
  const Problem problem = make_problem();
  const Plan plan = parsed(kPlanJson);
  CoderRequest no_problem;
  no_problem.plan = &plan;
  auto a = coder.write(no_problem);
  REQUIRE_FALSE(a);
  CHECK(a.error().code == ErrorCode::InvalidArgument);

  CoderRequest no_plan;
  no_plan.problem = &problem;
  auto b = coder.write(no_plan);
  REQUIRE_FALSE(b);
  CHECK(b.error().code == ErrorCode::InvalidArgument);

  CoderRequest no_previous;
  no_previous.skill = rubric::Skill::from_feedback;
  no_previous.problem = &problem;
  no_previous.feedback = "fix it";
  auto c = coder.write(no_previous);
  REQUIRE_FALSE(c);
  CHECK(c.error().code == ErrorCode::InvalidArgument);
  CHECK(backend->calls() == 0);
}

// ---- Replanner -------------------------------------------------------------------------------------

TEST_CASE("Replanner renders the replanner prompt with the history and the previous plan", "[agents]") {
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{kPlan2Json});
  Replanner replanner(backend, shipped_prompts());
  const Problem problem = make_problem();
  const Plan previous = parsed(kPlanJson);
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
  auto plan1 = Plan::parse(read(run / "plans" / "plan-1.json"));
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
  REQUIRE(trajectories.size() == 4);  // one per Coder call
  for (std::size_t i = 0; i < trajectories.size(); ++i) {
    INFO("trajectory " << i + 1);
    auto t = Json::parse(trajectories[i]);
    REQUIRE(t.contains("skill"));
    REQUIRE(t.contains("reward"));
    CHECK(t["skill"] == (i == 0 ? 1 : 2));
    CHECK(t["reward"]["value"] == at[i].reward.value);
    CHECK(t["attempt"] == static_cast<int>(i) + 1);
  }
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
  auto plan2 = Plan::parse(read(run / "plans" / "plan-2.json"));
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
  CHECK(lines_of(fs::path(run) / "trajectories.jsonl").size() == 3);
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
    CHECK(lines_of(run / "trajectories.jsonl").size() == 4);  // every Coder call, failed ones included
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
