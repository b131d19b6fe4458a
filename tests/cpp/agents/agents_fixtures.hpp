// Fixtures of the agents' tests (test_planner, test_replanner, test_coder, test_optimizer): the shipped
// prompts, a problem and its plans, a recording backend that answers from a queue or a scripted backend,
// and a fake Verifier that judges a candidate by a marker in its text.
#pragma once

#include "catch_shim.hpp"
#include "temp_dir.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include <nlohmann/json.hpp>

#include <stitchcuda/agents.hpp>

namespace agents_test {

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
using stitchcuda::agents::ProblemPlan;
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

// ---- fixtures ------------------------------------------------------------------------------------

inline std::string read(const fs::path& path) { return stitchcuda_test::read_file(path); }

inline std::vector<std::string> lines_of(const fs::path& path) {
  std::vector<std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(line);
  return out;
}

// Rendering may merge a value's final newline with the template's: compare without it.
inline std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

inline std::shared_ptr<const PromptLibrary> shipped_prompts() {
  static std::shared_ptr<const PromptLibrary> lib = [] {
    const auto folder = std::filesystem::path(STITCHCUDA_PROMPTS_DIR);  // tests.cmake
    auto loaded = PromptLibrary::load(folder.string());
    REQUIRE(loaded);
    return std::make_shared<const PromptLibrary>(std::move(*loaded));
  }();
  return lib;
}

inline std::string sha_of(const std::string& prompt) {
  auto p = shipped_prompts()->get(prompt);
  REQUIRE(p);
  return (*p)->sha256;
}

inline const char* kReference =
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

inline Problem make_problem() {
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

inline const char* kPlanJson = R"({"summary": "Fuse the add and the GELU into one elementwise kernel.",
  "steps": [{"title": "Write one fused add-GELU kernel", "detail": "one thread per element, float4 loads"}],
  "fusion_groups": [{"ops": ["add", "gelu"], "kernel": "k_add_gelu", "rationale": "one pass over DRAM"}],
  "bottlenecks": ["DRAM bandwidth"], "risks": ["erf accuracy"], "constraints": ["float32 in and out"]})";

inline const char* kPlan2Json = R"({"summary": "Second plan: a simpler grid-stride kernel without vector loads.",
  "steps": [{"title": "Grid-stride scalar kernel for add-GELU", "detail": "no float4, no shared memory"}]})";

inline ProblemPlan parsed(const char* json) {
  auto p = ProblemPlan::parse(json);
  REQUIRE(p);
  return *p;
}

// A Coder reply: prose, one ```python block defining ModelNew with `marker` in a comment, prose.
inline std::string candidate_reply(const std::string& marker) {
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

inline std::shared_ptr<Recorder> scripted_recorder(std::vector<llm::ScriptRule> rules, std::int64_t tokens = 0) {
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
    } else if (contains(candidate, "STATIC")) {  // what a machine without a GPU can say: compiled, not run
      r.compiled = true;
      r.static_only = true;
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

inline Agents make_agents(std::shared_ptr<Recorder> planner, std::shared_ptr<Recorder> coder,
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

inline std::shared_ptr<Recorder> planner_backend(std::int64_t tokens = 0) {
  return std::make_shared<Recorder>(std::vector<std::string>{kPlanJson}, tokens);
}

inline std::string the_plan_text() { return trimmed(parsed(kPlanJson).describe()); }

}  // namespace agents_test
