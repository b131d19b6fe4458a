// The Verifier's report as the agents read it (Report::from_json on reports written the way Python's
// VerifyReport.to_json() writes them) and the VerifierAgent's feedback: the right kind by precedence, the
// facts a Coder needs in the text (compile lines, first mismatches, findings, the bottleneck), the asks,
// and the model's diagnosis appended — or left out, with the error recorded, when the call fails.
#include "catch_shim.hpp"

#include <algorithm>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include <stitchcuda/agents.hpp>

using stitchcuda::ErrorCode;
using stitchcuda::agents::Feedback;
using stitchcuda::agents::Problem;
using stitchcuda::agents::PromptLibrary;
using stitchcuda::agents::Report;
using stitchcuda::agents::VerifierAgent;
using stitchcuda_test::contains;
namespace llm = stitchcuda::llm;
namespace rubric = stitchcuda::rubric;

namespace {

// A candidate whose CUDA misspells threadIdx.x; NVRTC's lines mapped to the candidate file.
const char* kCompileFailure = R"json({
  "schema_version": 1, "compiled": false, "correct": false, "hack": false,
  "findings": [{"rule": "unguarded-index", "severity": "minor",
                "message": "the kernel indexes without comparing against the element count.",
                "line": 18, "evidence": "y[i] = v * 0.5f;"}],
  "outputs": [], "speedup": {"eager": null, "compile": null}, "timing": {}, "profile": null,
  "error": {"kind": "compile", "message": "NVRTC could not compile the candidate's CUDA: 2 errors"},
  "feedback": "FAILED (compile): ...",
  "compile_log": "line 14: error: identifier \"threadIdx_x\" is undefined\n    int i = blockIdx.x * blockDim.x + threadIdx_x;\nline 17: warning: variable \"unused\" was declared but never referenced\nline 19: error: expected a \";\"\n    y[i] = v",
  "trials": [], "static_only": false, "wall_s": 1.25
})json";

// Ran, but output 0 has zeros where the reference has values and output 1 has the wrong shape.
const char* kIncorrect = R"json({
  "schema_version": 1, "compiled": true, "correct": false, "hack": false, "findings": [],
  "outputs": [
    {"index": 0, "shape": [64, 128], "dtype": "float32", "ok": false, "max_abs_err": 0.5, "max_rel_err": 1.0,
     "mismatches": 812, "err_vs_fp64": null, "reference_err_vs_fp64": null,
     "first_mismatches": [{"index": [0, 3], "expected": 1.25, "got": 0.0},
                          {"index": [0, 4], "expected": -0.5, "got": 0.0}],
     "problem": ""},
    {"index": 1, "shape": [64], "dtype": "float32", "ok": false, "max_abs_err": null, "max_rel_err": null,
     "mismatches": 0, "first_mismatches": [], "problem": "shape [32] where the reference returns [64]"},
    {"index": 2, "shape": [64], "dtype": "float32", "ok": true, "max_abs_err": 0.0, "max_rel_err": 0.0,
     "mismatches": 0, "first_mismatches": [], "problem": ""}
  ],
  "speedup": {"eager": null, "compile": null}, "timing": {}, "profile": null,
  "error": {"kind": "incorrect", "message": "trial 0 (seed 0, normal inputs): output 0: 812 elements outside tolerance."},
  "feedback": "", "compile_log": "",
  "trials": [{"seed": 0, "distribution": "normal", "ok": false}], "static_only": false, "wall_s": 3.5
})json";

// Correct and profiled by CUPTI: the harness stores the first advice as "bottleneck".
const char* kCorrectProfiled = R"json({
  "schema_version": 1, "compiled": true, "correct": true, "hack": false,
  "findings": [{"rule": "hardcoded-shape", "severity": "minor", "message": "the kernel assumes 128 columns.",
                "line": 30, "evidence": "const int N = 128;"}],
  "outputs": [{"index": 0, "shape": [64, 128], "dtype": "float32", "ok": true, "max_abs_err": 1e-7,
               "max_rel_err": 2e-7, "mismatches": 0, "first_mismatches": [], "problem": ""}],
  "speedup": {"eager": 1.42, "compile": 0.91},
  "timing": {"candidate_ms": 0.1234, "trials": 100, "eager_ms": 0.175, "speed_of_light_ms": 0.02},
  "profile": {"kernels": [{"name": "k_bias", "calls": 10, "total_ms": 0.29, "share": 0.29},
                          {"name": "k_gelu", "calls": 10, "total_ms": 0.71, "share": 0.71}],
              "summary": {"span_ns": 130000, "busy_ns": 120000, "kernel_launches": 20, "busy_fraction": 0.92},
              "kernels_per_call": 2, "streams": [7],
              "advice": ["k_gelu reaches 38% of peak DRAM bandwidth: use 16-byte vector loads"],
              "bottleneck": "k_gelu reaches 38% of peak DRAM bandwidth: use 16-byte vector loads"},
  "error": null, "feedback": "Correct.", "compile_log": "", "trials": [], "static_only": false, "wall_s": 9.0
})json";

// Correct by the numbers, but torch does the GEMM.
const char* kHack = R"json({
  "schema_version": 1, "compiled": true, "correct": true, "hack": true,
  "findings": [{"rule": "torch-does-heavy-work", "severity": "major",
                "message": "torch.matmul does the GEMM the problem is about.", "line": 42,
                "evidence": "return torch.matmul(x, self.w)"},
               {"rule": "unused-kernel", "severity": "minor", "message": "k_add is compiled but never launched.",
                "line": null, "evidence": ""}],
  "outputs": [], "speedup": {"eager": 3.0, "compile": 2.0}, "timing": {"candidate_ms": 0.05}, "profile": null,
  "error": null, "feedback": "", "compile_log": "", "trials": [], "static_only": false, "wall_s": 4.0
})json";

Report parse(const char* json) {
  auto r = Report::from_json(json);
  REQUIRE(r);
  return *r;
}

Problem problem() {
  Problem p;
  p.name = "block_gelu";
  p.reference = "class Model(nn.Module):\n    def forward(self, x):\n        return torch.nn.functional.gelu(x @ self.w)\n";
  p.hardware.gpu = "NVIDIA H200";
  p.hardware.arch = "sm_90";
  return p;
}

Feedback feedback_of(const char* json, double target = 0.0) {
  return VerifierAgent().feedback(problem(), "class ModelNew: ...", parse(json), target);
}

bool any_ask_contains(const Feedback& f, std::string_view needle) {
  for (const auto& a : f.asks)
    if (contains(a, needle)) return true;
  return false;
}

}  // namespace

TEST_CASE("a compile failure's report keeps the log, the error and the findings", "[agents]") {
  Report r = parse(kCompileFailure);
  CHECK_FALSE(r.compiled);
  CHECK_FALSE(r.correct);
  CHECK(r.error_kind == "compile");
  CHECK(r.error_message == "NVRTC could not compile the candidate's CUDA: 2 errors");
  CHECK(contains(r.compile_log, "line 14: error: identifier \"threadIdx_x\" is undefined"));
  REQUIRE(r.findings.size() == 1);
  CHECK(r.findings[0].rule == "unguarded-index");
  CHECK(r.findings[0].severity == rubric::Severity::minor);
  CHECK(r.findings[0].evidence == "y[i] = v * 0.5f;");
  CHECK(r.finding_messages[0] == "the kernel indexes without comparing against the element count.");
  CHECK(r.finding_lines[0] == 18);
  CHECK_FALSE(r.speedup_eager.has_value());
  CHECK(r.wall_s == Approx(1.25));
  CHECK(r.json == kCompileFailure);
  CHECK_FALSE(r.hack());
}

TEST_CASE("bad outputs become mismatch lines with their first wrong elements", "[agents]") {
  Report r = parse(kIncorrect);
  REQUIRE(r.mismatches.size() == 2);  // output 2 is fine
  CHECK(r.mismatches[0] ==
        "output 0 [64, 128] float32: 812 elements outside tolerance (max abs err 0.5, max rel err 1); "
        "at [0, 3]: expected 1.25, got 0; at [0, 4]: expected -0.5, got 0");
  CHECK(r.mismatches[1] == "output 1 [64] float32: shape [32] where the reference returns [64]");
  CHECK(r.error_kind == "incorrect");
}

TEST_CASE("a profiled report names the top kernel and the bottleneck", "[agents]") {
  Report r = parse(kCorrectProfiled);
  CHECK(r.top_kernel == "k_gelu (71% of GPU time)");  // the largest share, wherever it is listed
  CHECK(r.bottleneck == "k_gelu reaches 38% of peak DRAM bandwidth: use 16-byte vector loads");
  REQUIRE(r.speedup_eager);
  CHECK(*r.speedup_eager == Approx(1.42));
  REQUIRE(r.speedup_compile);
  CHECK(*r.speedup_compile == Approx(0.91));
  CHECK(r.candidate_ms == Approx(0.1234));

  auto o = r.outcome();
  CHECK(o.compiled);
  CHECK(o.correct);
  CHECK(o.speedup == Approx(1.42));
  CHECK(o.findings.size() == 1);
}

TEST_CASE("the bottleneck falls back to the summary's diagnosis", "[agents]") {
  auto r = Report::from_json(R"({"schema_version": 1, "compiled": true, "correct": true,
    "profile": {"kernels": [{"name": "k", "share": 1.0}],
                "summary": {"diagnosis": ["launch-bound: 40 launches per call", "idle gaps 30%"]}}})");
  REQUIRE(r);
  CHECK(r->bottleneck == "launch-bound: 40 launches per call; idle gaps 30%");
  CHECK(r->top_kernel == "k (100% of GPU time)");
}

TEST_CASE("missing keys and nulls read as defaults; malformed JSON is an error", "[agents]") {
  auto empty = Report::from_json(R"({"schema_version": 1})");
  REQUIRE(empty);
  CHECK_FALSE(empty->compiled);
  CHECK(empty->mismatches.empty());
  CHECK(empty->outcome().speedup == 0.0);

  auto nulls = Report::from_json(R"({"schema_version": 1, "compiled": null, "speedup": null, "timing": null, "profile": null,
    "error": null, "findings": null, "outputs": null, "compile_log": null})");
  REQUIRE(nulls);
  CHECK(nulls->error_kind.empty());

  auto bad = Report::from_json(R"({"schema_version": 1, "compiled": tru)");
  REQUIRE_FALSE(bad);
  CHECK(bad.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(bad.error().message, "byte"));

  auto array = Report::from_json("[1, 2]");
  REQUIRE_FALSE(array);
  CHECK(array.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(array.error().message, "array"));
}

TEST_CASE("a report without schema_version 1 is refused, naming the versions", "[agents]") {
  auto legacy = Report::from_json(R"({"compiled": true, "correct": true})");
  REQUIRE_FALSE(legacy);
  CHECK(legacy.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(legacy.error().message, "no schema_version"));
  CHECK(contains(legacy.error().message, "schema_version 1"));

  auto newer = Report::from_json(R"({"schema_version": 2, "compiled": true, "correct": true})");
  REQUIRE_FALSE(newer);
  CHECK(newer.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(newer.error().message, "schema_version 2"));
  CHECK(contains(newer.error().message, "reads schema_version 1"));

  auto text = Report::from_json(R"({"schema_version": "1", "compiled": true})");
  REQUIRE_FALSE(text);
  CHECK(contains(text.error().message, "not an integer"));

  auto current = Report::from_json(R"({"schema_version": 1, "compiled": true, "correct": true})");
  REQUIRE(current);
  CHECK(current->correct);
}

TEST_CASE("the report schema is JSON naming the version from_json reads", "[agents]") {
  const auto schema = nlohmann::json::parse(stitchcuda::agents::report_schema());
  CHECK(schema["properties"]["schema_version"]["const"] == 1);
  CHECK(schema["$id"] == "stitchcuda.verify_report/1");
  const auto& required = schema["required"];
  for (const char* key : {"schema_version", "compiled", "correct", "static_only", "findings", "outputs", "speedup",
                          "timing", "profile", "error", "compile_log", "wall_s"})
    CHECK(std::find(required.begin(), required.end(), key) != required.end());
  // A report made of the schema's required keys with their simplest values is one from_json reads.
  nlohmann::json minimal = {{"schema_version", 1}, {"compiled", true}, {"correct", false}, {"hack", false},
                            {"findings", nlohmann::json::array()}, {"outputs", nlohmann::json::array()},
                            {"speedup", {{"eager", nullptr}, {"compile", nullptr}}}, {"timing", nlohmann::json::object()},
                            {"profile", nullptr}, {"error", {{"kind", "incorrect"}, {"message", "wrong"}}},
                            {"feedback", ""}, {"compile_log", ""}, {"trials", nlohmann::json::array()},
                            {"static_only", false}, {"wall_s", 0.5}};
  auto r = Report::from_json(minimal.dump());
  REQUIRE(r);
  CHECK(r->error_kind == "incorrect");
}

TEST_CASE("compile feedback quotes the log and asks for each error line", "[agents]") {
  Feedback f = feedback_of(kCompileFailure);
  CHECK(f.kind == "compile");
  CHECK(contains(f.text, "NVRTC could not compile the candidate's CUDA: 2 errors"));
  CHECK(contains(f.text, "line 14: error: identifier \"threadIdx_x\" is undefined\n"
                         "    int i = blockIdx.x * blockDim.x + threadIdx_x;"));
  CHECK(contains(f.text, "line 19: error: expected a \";\""));
  REQUIRE(f.asks.size() == 2);  // the warning is not an error
  CHECK(f.asks[0] == "fix the compile error at line 14: identifier \"threadIdx_x\" is undefined");
  CHECK(f.asks[1] == "fix the compile error at line 19: expected a \";\"");
  CHECK(contains(f.text, "Worth a look"));
  CHECK(contains(f.text, "[unguarded-index] line 18"));
  CHECK_FALSE(f.exchange.has_value());
}

TEST_CASE("an unmapped NVRTC log still yields asks naming the location", "[agents]") {
  Report r;
  r.compiled = false;
  r.error_kind = "compile";
  r.compile_log = "kernel.cu(7): error: too few arguments in function call\nkernel.cu:9:3: error: expected an expression";
  Feedback f = VerifierAgent().feedback(problem(), "", r);
  REQUIRE(f.asks.size() == 2);
  CHECK(f.asks[0] == "fix the compile error at kernel.cu(7): too few arguments in function call");
  CHECK(f.asks[1] == "fix the compile error at kernel.cu:9:3: expected an expression");
}

TEST_CASE("run-time failures get the cause and a hint for their kind", "[agents]") {
  Report r = parse(R"({"schema_version": 1, "compiled": true, "correct": false,
    "error": {"kind": "illegal-address", "message": "RuntimeError: CUDA error: an illegal memory access was encountered"}})");
  Feedback f = VerifierAgent().feedback(problem(), "", r);
  CHECK(f.kind == "runtime");
  CHECK(contains(f.text, "an illegal memory access was encountered"));
  CHECK(contains(f.text, "grid size"));
  CHECK(contains(f.text, "numel"));
  CHECK(any_ask_contains(f, "guard every global index"));

  r.error_kind = "timeout";
  r.error_message = "the candidate exceeded the 60 s limit for running the candidate; the worker was killed.";
  f = VerifierAgent().feedback(problem(), "", r);
  CHECK(f.kind == "runtime");
  CHECK(contains(f.text, "__syncthreads"));
  CHECK(contains(f.text, "never changes"));

  r.error_kind = "oom";
  f = VerifierAgent().feedback(problem(), "", r);
  CHECK(contains(f.text, "out of memory"));

  // A crash while loading is a run-time failure, not a compile error, though nothing compiled.
  r.compiled = false;
  r.error_kind = "crash";
  f = VerifierAgent().feedback(problem(), "", r);
  CHECK(f.kind == "runtime");
}

TEST_CASE("hack feedback names each major finding, its line and evidence", "[agents]") {
  Feedback f = feedback_of(kHack, 2.0);
  CHECK(f.kind == "hack");  // above its speed-up: an untrusted result is never "correct"
  CHECK(contains(f.text, "[torch-does-heavy-work] line 42: torch.matmul does the GEMM the problem is about."));
  CHECK(contains(f.text, "Evidence: return torch.matmul(x, self.w)"));
  REQUIRE_FALSE(f.asks.empty());
  CHECK(contains(f.asks[0], "remove the [torch-does-heavy-work] problem at line 42"));
  CHECK(contains(f.text, "Worth a look:\n- [unused-kernel]: k_add is compiled but never launched."));
  CHECK_FALSE(contains(f.text, "Speed-up"));
}

TEST_CASE("a compile error comes before a hack; the finding is still listed", "[agents]") {
  Report r = parse(kHack);
  r.compiled = false;
  r.error_kind = "compile";
  r.compile_log = "line 3: error: unknown type name 'flaot'";
  Feedback f = VerifierAgent().feedback(problem(), "", r);
  CHECK(f.kind == "compile");
  CHECK(contains(f.text, "[torch-does-heavy-work] line 42"));
  CHECK(f.asks[0] == "fix the compile error at line 3: unknown type name 'flaot'");
  CHECK(any_ask_contains(f, "torch-does-heavy-work"));
}

TEST_CASE("incorrect feedback shows the first mismatches and asks about them", "[agents]") {
  Feedback f = feedback_of(kIncorrect);
  CHECK(f.kind == "incorrect");
  CHECK(contains(f.text, "at [0, 3]: expected 1.25, got 0"));
  CHECK(contains(f.text, "shape [32] where the reference returns [64]"));
  REQUIRE(f.asks.size() == 2);
  CHECK(contains(f.asks[0], "output 0 differs at [0, 3] (expected 1.25, got 0): "));
  CHECK(contains(f.asks[0], "never written"));  // a zero where a value belongs
  CHECK(contains(f.asks[1], "output 1"));
  CHECK(contains(f.asks[1], "shape"));

  Report nan = parse(kIncorrect);
  nan.mismatches = {"output 0 [8] float16: 1 elements outside tolerance; at [5]: expected 0.25, got nan"};
  Feedback g = VerifierAgent().feedback(problem(), "", nan);
  REQUIRE(g.asks.size() == 1);
  CHECK(contains(g.asks[0], "output 0 differs at [5] (expected 0.25, got nan)"));
  CHECK(contains(g.asks[0], "uninitialized"));
}

TEST_CASE("a static-only report is unverified, not incorrect", "[agents]") {
  Report r = parse(R"({"schema_version": 1, "compiled": true, "correct": false, "static_only": true, "error": null,
    "findings": [], "outputs": []})");
  Feedback f = VerifierAgent().feedback(problem(), "", r);
  CHECK(f.kind == "unverified");
  CHECK(contains(f.text, "unverified"));
  CHECK(contains(f.text, "no GPU"));
}

TEST_CASE("correct feedback gives speed-ups, the bottleneck and the top kernel", "[agents]") {
  Feedback f = feedback_of(kCorrectProfiled);
  CHECK(f.kind == "correct");
  CHECK(contains(f.text, "1.42x over eager PyTorch"));
  CHECK(contains(f.text, "0.91x over torch.compile"));
  CHECK(contains(f.text, "Bottleneck: k_gelu reaches 38% of peak DRAM bandwidth: use 16-byte vector loads"));
  CHECK(contains(f.text, "k_gelu (71% of GPU time)"));
  CHECK(contains(f.text, "Worth a look:\n- [hardcoded-shape] line 30"));
  CHECK(any_ask_contains(f, "attack the bottleneck: k_gelu reaches 38%"));
  CHECK(any_ask_contains(f, "optimize k_gelu (71% of GPU time)"));
  CHECK(any_ask_contains(f, "torch.compile"));  // slower than torch.compile: asked to close the gap

  CHECK(feedback_of(kCorrectProfiled, 1.2).kind == "correct");
  Feedback slow = feedback_of(kCorrectProfiled, 2.0);
  CHECK(slow.kind == "slow");
  CHECK(contains(slow.text, "2.00x"));
  CHECK(contains(slow.text, "Bottleneck: "));
}

namespace {

std::shared_ptr<const PromptLibrary> prompts(const std::string& verifier) {
  std::vector<std::pair<std::string, std::string>> texts;
  for (const auto& name : PromptLibrary::required_names())
    texts.emplace_back(name, name == "verifier" ? verifier : name + " {{reference}}");
  auto lib = PromptLibrary::from_texts(texts);
  REQUIRE(lib);
  return std::make_shared<const PromptLibrary>(std::move(*lib));
}

const char* kVerifierPrompt =
    "Diagnose this.\n## Reference\n{{reference}}\n## Candidate\n{{candidate}}\n## Machine\n{{hardware}}\n## Report\n{{report}}\n";

/// A backend that breaks its contract by throwing.
class ThrowingBackend final : public llm::Backend {
 public:
  ThrowingBackend() : llm::Backend("throwing") {}
  stitchcuda::Result<llm::Completion> complete(const std::vector<llm::Message>&, const llm::Options&,
                                               const llm::TextCallback&) override {
    throw std::runtime_error("socket exploded");
  }
};

}  // namespace

TEST_CASE("a model's diagnosis is appended and the call recorded", "[agents]") {
  auto backend = llm::scripted_backend({{"Diagnose this", {"threadIdx_x is not a CUDA builtin: write threadIdx.x."}}});
  REQUIRE(backend);
  auto lib = prompts(kVerifierPrompt);
  VerifierAgent agent(*backend, lib);
  Report r = parse(kCompileFailure);
  Feedback plain = VerifierAgent().feedback(problem(), "class ModelNew: pass", r);
  Feedback f = agent.feedback(problem(), "class ModelNew: pass", r);

  CHECK(f.kind == "compile");
  CHECK(f.asks == plain.asks);
  CHECK(f.text == plain.text + "\nDiagnosis:\nthreadIdx_x is not a CUDA builtin: write threadIdx.x.\n");
  REQUIRE(f.exchange);
  const auto& ex = *f.exchange;
  CHECK(ex.agent == "verifier");
  CHECK(ex.prompt_name == "verifier");
  CHECK(ex.prompt_sha256 == (*lib->get("verifier"))->sha256);
  CHECK(ex.error.empty());
  CHECK(ex.reply == "threadIdx_x is not a CUDA builtin: write threadIdx.x.");
  CHECK(ex.finish_reason == "stop");
  CHECK(ex.usage.total_tokens > 0);
  REQUIRE(ex.messages.size() == 1);
  CHECK(ex.messages[0].role == "user");
  // The model sees the deterministic report, the reference, the candidate and the machine.
  CHECK(contains(ex.messages[0].content, "line 14: error: identifier \"threadIdx_x\" is undefined"));
  CHECK(contains(ex.messages[0].content, "return torch.nn.functional.gelu(x @ self.w)"));
  CHECK(contains(ex.messages[0].content, "class ModelNew: pass"));
  CHECK(contains(ex.messages[0].content, "NVIDIA H200"));
}

TEST_CASE("a failing model call leaves the deterministic feedback and records the error", "[agents]") {
  Report r = parse(kIncorrect);
  Feedback plain = VerifierAgent().feedback(problem(), "", r);

  auto unmatched = llm::scripted_backend({{"no prompt says this", {"never sent"}}});
  REQUIRE(unmatched);
  Feedback f = VerifierAgent(*unmatched, prompts(kVerifierPrompt)).feedback(problem(), "", r);
  CHECK(f.text == plain.text);
  CHECK(f.asks == plain.asks);
  REQUIRE(f.exchange);
  CHECK(f.exchange->reply.empty());
  CHECK(contains(f.exchange->error, "no scripted rule matches"));
  CHECK(f.exchange->messages.size() == 1);  // what was sent is kept for the record

  Feedback thrown = VerifierAgent(std::make_shared<ThrowingBackend>(), prompts(kVerifierPrompt)).feedback(problem(), "", r);
  CHECK(thrown.text == plain.text);
  REQUIRE(thrown.exchange);
  CHECK(contains(thrown.exchange->error, "socket exploded"));

  // A template asking for a value the agent does not give fails to render: no call is made.
  auto any = llm::scripted_backend({{".", {"anything"}}});
  REQUIRE(any);
  Feedback unrendered = VerifierAgent(*any, prompts("{{report}} {{history}}")).feedback(problem(), "", r);
  CHECK(unrendered.text == plain.text);
  REQUIRE(unrendered.exchange);
  CHECK(contains(unrendered.exchange->error, "history"));
  CHECK(unrendered.exchange->messages.empty());
}

TEST_CASE("a blank reply is not appended", "[agents]") {
  auto blank = llm::scripted_backend({{"Diagnose", {"  \n"}}});
  REQUIRE(blank);
  Report r = parse(kCorrectProfiled);
  Feedback f = VerifierAgent(*blank, prompts(kVerifierPrompt)).feedback(problem(), "", r);
  CHECK_FALSE(contains(f.text, "Diagnosis:"));
  REQUIRE(f.exchange);
  CHECK_FALSE(f.exchange->error.empty());
}

TEST_CASE("the model reads a kernel step as its CUDA and launch blocks; the call names the model", "[agents]") {
  auto backend = llm::scripted_backend({{"Diagnose this", {"Guard the index."}}});
  REQUIRE(backend);
  auto step = stitchcuda::agents::extract_kernel_step(
      "```cuda\nextern \"C\" __global__ void k(const float* x, float* y) { y[threadIdx.x] = x[threadIdx.x]; }\n```\n"
      "```json\n{\"kernel\": \"k\", \"grid\": [1], \"block\": [\"out0.numel\"], \"args\": [\"in0\", \"out0\"]}\n```\n");
  REQUIRE(step);
  Feedback f = VerifierAgent(*backend, prompts(kVerifierPrompt)).feedback(problem(), step->code, parse(kIncorrect));
  REQUIRE(f.exchange);
  const std::string sent = f.exchange->messages.at(0).content;
  CHECK(contains(sent, "```cuda\nextern \"C\" __global__ void k("));
  CHECK(contains(sent, "```json\n{\"kernel\":\"k\",\"grid\":[\"1\"],\"block\":[\"out0.numel\"]"));
  CHECK_FALSE(contains(sent, "\"kernel_step\""));
  CHECK(f.exchange->model == (*backend)->name());  // the scripted backend names itself as the model
}
