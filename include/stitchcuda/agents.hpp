// stitchcuda::agents — the StitchCUDA method: a Planner that writes a structured plan from the reference
// and its profile, a Coder with two skills (from the plan; from feedback), a VerifierAgent that turns the
// Verifier's report into feedback, a Replanner, and the Optimizer loop that composes them with the Rubric,
// budgets and a run directory. Shared machinery: retrieval over the documentation corpus (BM25), prompt
// files, code extraction. Pure C++, no CUDA or LibTorch header; the Verifier itself is given by the caller
// (Python's stitchcuda.verify, or any implementation of agents::Verifier).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <stitchcuda/error.hpp>
#include <stitchcuda/llm.hpp>
#include <stitchcuda/rubric.hpp>

namespace stitchcuda::agents {

/// One retrievable unit: a `## ` section of a markdown document (or the text before the first one).
struct Snippet {
  std::string id;      ///< "coalescing_and_vector_loads#vector-loads": document name, '#', section slug
  std::string title;   ///< "Coalescing and vector loads — Vector loads"
  std::string text;    ///< the section's markdown, heading included
  double score = 0.0;  ///< BM25 score for the query that returned it (0 in snippets())
};

/// BM25 parameters (the usual defaults).
struct Bm25 {
  double k1 = 1.2;  ///< term-frequency saturation
  double b = 0.75;  ///< length normalization
};

/// Ranks documentation sections for a query with Okapi BM25; titles count twice.
class Retriever {
 public:
  /// Indexes documents given as (name, markdown) pairs; a name becomes the ids' prefix.
  static Retriever from_documents(std::vector<std::pair<std::string, std::string>> documents, Bm25 params = {});
  /// Indexes every `*.md` file of `dir` (README.md excepted), in name order. NotFound when the folder
  /// does not exist, InvalidArgument when it holds no markdown.
  static Result<Retriever> from_folder(const std::string& dir, Bm25 params = {});

  /// The `k` best sections for `query` (those sharing at least one term), best first; ties by id.
  std::vector<Snippet> search(std::string_view query, std::size_t k = 3) const;
  /// Every indexed section, in document order.
  const std::vector<Snippet>& snippets() const { return snippets_; }

  /// Lower-case word tokens: letters, digits and '_' ("__shfl_xor_sync", "fp32", "cp"), minus stop words.
  static std::vector<std::string> tokenize(std::string_view text);

 private:
  Retriever() = default;
  void index();
  std::vector<Snippet> snippets_;
  std::vector<std::vector<std::pair<std::size_t, int>>> postings_;  // term index -> (snippet, tf)
  std::vector<std::string> terms_;                                    // sorted vocabulary
  std::vector<double> lengths_;                                       // tokens per snippet
  double mean_length_ = 0.0;
  Bm25 params_;
};

// ---- prompts: versioned files, overridable from a folder -----------------------------------------

/// One prompt template. Files are `<name>.md`; an optional first line `<!-- version: N -->` gives the
/// version. Placeholders are `{{key}}`; `{{#key}}...{{/key}}` keeps its body only when key is non-empty.
struct Prompt {
  std::string name;     ///< "planner", "coder_plan", "coder_feedback", "answer_model_new", "replanner", "verifier"
  std::string version;  ///< from the version line ("0" when absent)
  std::string text;     ///< the template, version line removed
  std::string path;     ///< where it was read ("" for built from a string)
  std::string sha256;   ///< of `text`, so a run records exactly which prompt it used
};

/// The prompts the agents use: the shipped folder, with files of an override folder replacing those of
/// the same name.
class PromptLibrary {
 public:
  /// The prompt names every library must hold.
  static const std::vector<std::string>& required_names();
  /// Reads `<dir>/*.md`, then `<override_dir>/*.md` over it ("" = none). NotFound names a missing folder
  /// or a required prompt absent from both; InvalidArgument a template whose `{{#key}}` is not closed.
  static Result<PromptLibrary> load(const std::string& dir, const std::string& override_dir = "");
  /// From (name, text) pairs (tests, embedding without files); same checks.
  static Result<PromptLibrary> from_texts(const std::vector<std::pair<std::string, std::string>>& prompts);
  /// The prompt called `name`; NotFound lists the names there are.
  Result<const Prompt*> get(const std::string& name) const;
  /// Fills a template. InvalidArgument names a placeholder without a value (every one must be given;
  /// pass "" for an empty one).
  Result<std::string> render(const std::string& name, const std::map<std::string, std::string>& values) const;
  /// All prompts, by name.
  const std::map<std::string, Prompt>& prompts() const { return prompts_; }

 private:
  std::map<std::string, Prompt> prompts_;
};

// ---- code extraction ----------------------------------------------------------------------------

/// One fenced block of a reply.
struct CodeBlock {
  std::string language;  ///< the fence's info string, lower case ("python", "cuda", "" when none)
  std::string code;      ///< the block's text
  int line = 0;          ///< 1-based line of the opening fence in the reply
  bool closed = true;    ///< false: the reply ended inside the block
};

/// The candidate a Coder's reply contains.
struct Extraction {
  std::string code;                 ///< the Python source defining ModelNew ("" when none was found)
  std::vector<CodeBlock> blocks;    ///< every fenced block, in order
  bool truncated = false;           ///< the reply was cut (finish reason "length", or an unclosed fence)
  std::vector<std::string> notes;   ///< what the extractor decided and why ("picked block 2 of 3: defines ModelNew")
};

/// Finds the candidate in a reply: the block (```python, ```py or unlabeled) that defines `class ModelNew`,
/// the last such when several do; a reply with no fence that is itself Python defining ModelNew; CUDA blocks
/// are never the candidate. `finish_reason` "length" marks it truncated. Errors (LlmError, naming what to
/// ask the model): no block defines ModelNew, the chosen block is cut off, the reply is empty.
Result<Extraction> extract_code(std::string_view reply, std::string_view finish_reason = "");

/// What the Coder answers for a graph-mode target: one CUDA kernel the Program launches without Python.
/// Launch dimensions, dynamic shared memory and scalar arguments are expressions over the target's
/// shapes ("ceil_div(out0.numel, 1024)", "in0.shape[1]", "4096"); buffers are named in0.., out0..
/// (the target's inputs and outputs, in the order the prompt lists them). Expressions are evaluated
/// where the shapes are known (Python's lowering); here only their form is checked.
struct KernelStep {
  std::string source;                  ///< CUDA source holding the kernel (extern "C" __global__)
  std::string kernel;                  ///< entry point
  std::vector<std::string> grid;       ///< 1-3 expressions
  std::vector<std::string> block;      ///< 1-3 expressions
  std::string shared_bytes = "0";      ///< dynamic shared memory per block, an expression
  std::vector<std::string> args;       ///< in declaration order: "in0", "out1", or a scalar expression

  /// The canonical text (a JSON object with "kernel_step": 1 and the fields above): what a run records
  /// as the candidate and what parse() reads back.
  std::string to_json() const;
  /// From the canonical text. InvalidArgument lists every problem ("grid: 1-3 entries", "kernel 'k' is
  /// not a __global__ function of the source").
  static Result<KernelStep> parse(std::string_view json);
};

/// Finds a kernel step in a reply: a ```cuda (or ```cpp / ```c++ / ```cu) block holding the kernel and a
/// ```json block with {"kernel", "grid", "block", "shared_bytes"?, "args"}; the last of each when several.
/// Extraction::code is KernelStep::to_json(). Errors (LlmError, saying what to send): no CUDA block, no
/// launch block, invalid JSON or fields, a kernel name the source does not define, a cut-off reply.
Result<Extraction> extract_kernel_step(std::string_view reply, std::string_view finish_reason = "");

// ---- the problem plan -----------------------------------------------------------------------------
// What the Planner writes for one problem: how to implement it. Not the graph partition (Python's
// stitchcuda.graph GraphPlan) and not a Program's memory layout (BufferPlan).

/// One step of a problem plan.
struct ProblemPlanStep {
  std::string title;   ///< "Fuse bias, GELU and residual into the GEMM epilogue"
  std::string detail;  ///< how, in a few sentences
};

/// Operators one kernel is to compute.
struct FusionGroup {
  std::vector<std::string> ops;  ///< reference operators, in order ("linear", "gelu", "add")
  std::string kernel;            ///< the kernel's name or the library call ("cublasLt matmul + epilogue")
  std::string rationale;         ///< why fusing them pays (bytes saved, launches saved)
};

/// The Planner's output; JSON with these keys (problem_plan_schema()).
struct ProblemPlan {
  std::string summary;                     ///< one paragraph
  std::vector<ProblemPlanStep> steps;      ///< at least one
  std::vector<FusionGroup> fusion_groups;  ///< may be empty
  std::vector<std::string> bottlenecks;    ///< expected after the change
  std::vector<std::string> risks;          ///< correctness risks (numerics, aliasing, shapes)
  std::vector<std::string> constraints;    ///< what must hold (dtypes, layouts, no torch ops in forward)

  /// The plan as JSON (the schema's layout).
  std::string to_json() const;
  /// The plan as a numbered text for prompts.
  std::string describe() const;
  /// Parses a JSON object (a reply may wrap it in prose or a ```json fence: the first balanced object
  /// is taken). InvalidArgument lists every schema violation ("steps[1].title: missing"), so a model can
  /// be asked again with the message.
  static Result<ProblemPlan> parse(std::string_view text);
};
/// The JSON Schema a problem plan follows (also sent as a structured-output schema where the server supports it).
const std::string& problem_plan_schema();
/// The JSON Schema of a Verifier report (Python's VerifyReport.to_json(), "schema_version": 1), the
/// format Report::from_json reads; it refuses a report without that version or with another one.
const std::string& report_schema();

// ---- what the agents know about the problem and the machine -------------------------------------

/// The GPU the candidate is for, as the Planner is told.
struct Hardware {
  std::string gpu = "unknown GPU";  ///< "NVIDIA H200"
  std::string arch;                 ///< "sm_90"
  int sms = 0;                      ///< streaming multiprocessors (0 = unknown)
  double memory_gib = 0.0;          ///< device memory
  double dram_tb_s = 0.0;           ///< peak DRAM bandwidth (0 = unknown)
  double fp32_tflops = 0.0;         ///< peak FP32 (non-tensor) throughput
  double tf32_tflops = 0.0;         ///< peak dense TF32 tensor-core throughput
  std::string cuda;                 ///< CUDA version ("13.0")
  /// A few lines for prompts.
  std::string describe() const;
};

/// The problem being optimized.
struct Problem {
  std::string name;             ///< "block_gelu" (the file's stem), or a graph-mode target's id
  std::string reference;        ///< KernelBench-format Python source (Model, get_inputs, get_init_inputs)
  Hardware hardware;            ///< the target GPU
  std::string profile;          ///< the reference's profile as text (top kernels, launches, gaps); may be ""
  /// What the Coder answers: "model_new" (a Python module defining ModelNew: program mode) or
  /// "kernel_step" (one CUDA kernel and its launch: a graph-mode target). Picks the answer contract the
  /// Coder's prompts show (prompts/answer_<answer>.md) and how its reply is read.
  std::string answer = "model_new";
  /// Graph mode: the target described for the Coder (its inputs in0.. and outputs out0.., with shapes
  /// and dtypes); shown in the Coder's prompts when non-empty.
  std::string target;
};

// ---- one exchange with a model, as recorded ------------------------------------------------------

/// A call to a model and its answer, for the run directory and trajectories.
struct Exchange {
  std::string agent;                   ///< "planner", "coder", "verifier", "replanner", "judge"
  std::string model;                   ///< the model that answered (as the server said, else the backend's name)
  std::vector<llm::Message> messages;  ///< what was sent
  std::string reply;                   ///< what came back ("" on failure)
  std::string finish_reason;           ///< as the backend reported
  llm::Usage usage;                    ///< tokens
  double latency_s = 0.0;              ///< wall time of the call
  std::string error;                   ///< the call's error message ("" when it succeeded)
  std::string prompt_name;             ///< template used
  std::string prompt_sha256;           ///< its hash
  std::vector<std::string> snippets;   ///< ids of retrieved documentation sections put in the prompt
};

/// How the agents call their model.
struct AgentOptions {
  llm::Options llm;                    ///< sampling and limits of each call (max_tokens, temperature...)
  std::size_t doc_snippets = 3;        ///< retrieved sections per prompt (0 = none)
  int max_repairs = 2;                 ///< Planner: re-asks after an invalid plan; Coder: after an unusable reply
};

// ---- the agents --------------------------------------------------------------------------------

/// What the Planner (and Replanner) produced.
struct ProblemPlanResult {
  ProblemPlan plan;                 ///< the validated plan
  std::vector<Exchange> exchanges;  ///< every call made (re-asks included)
};

/// Reads the reference, the hardware and the profile; writes a validated ProblemPlan.
class Planner {
 public:
  /// `docs` may be null (no retrieval).
  Planner(std::shared_ptr<llm::Backend> llm, std::shared_ptr<const PromptLibrary> prompts,
          std::shared_ptr<const Retriever> docs = nullptr, AgentOptions options = {});
  /// The plan. An invalid plan is re-asked with the validation error up to max_repairs times; then
  /// LlmError carrying the last problem. Backend errors pass through.
  Result<ProblemPlanResult> plan(const Problem& problem) const;

 protected:
  /// Asks with `prompt` (rendered from `values`) and validates, re-asking on invalid JSON.
  Result<ProblemPlanResult> ask(const std::string& agent, const std::string& prompt, std::map<std::string, std::string> values,
                         const std::string& query) const;
  std::shared_ptr<llm::Backend> llm_;
  std::shared_ptr<const PromptLibrary> prompts_;
  std::shared_ptr<const Retriever> docs_;
  AgentOptions options_;
};

/// What a Verifier concluded about one candidate: the fields of a VerifyReport the agents read.
struct Report {
  bool compiled = false;                    ///< loaded and its kernels compiled
  bool correct = false;                     ///< every correctness trial passed
  bool static_only = false;                 ///< no GPU run: compile and static rules only (unverified)
  std::optional<double> speedup_eager;      ///< over eager PyTorch
  std::optional<double> speedup_compile;    ///< over torch.compile
  std::vector<rubric::Finding> findings;    ///< every finding
  std::vector<std::string> finding_messages;///< the message of each finding (same order)
  std::vector<int> finding_lines;           ///< line of each finding in the candidate (0 = none)
  std::string error_kind;                   ///< "compile", "incorrect", "timeout"... ("" = none)
  std::string error_message;                ///< the first failure, in words
  std::string compile_log;                  ///< compiler messages, lines mapped to the candidate file
  std::vector<std::string> mismatches;      ///< "output 0 [64, 128] float32: 812 elements outside tolerance; at [0, 3]: expected 1.25, got 0.0"
  std::string bottleneck;                   ///< the profile's diagnosis of the candidate ("" when not profiled)
  std::string top_kernel;                   ///< "k_gelu (71% of GPU time)" ("" when not profiled)
  double candidate_ms = 0.0;                ///< median time of one forward (0 = not timed)
  double wall_s = 0.0;                      ///< how long verification took
  std::string json;                         ///< the report as the Verifier wrote it

  /// Any major finding.
  bool hack() const;
  /// From a VerifyReport's JSON (stitchcuda.verify's to_json()); unknown keys are ignored.
  static Result<Report> from_json(std::string_view json);
  /// The rubric's view of it.
  rubric::VerifyOutcome outcome() const;
};

/// Verifies candidates: implemented by the caller (Python wraps stitchcuda.verify; a C++ server may wrap
/// its own harness). Must never throw; a crashing candidate is a Report with error_kind "crash".
class Verifier {
 public:
  virtual ~Verifier() = default;
  /// The verdict on `candidate` (Python source defining ModelNew) against `problem.reference`.
  virtual Result<Report> verify(const Problem& problem, const std::string& candidate) = 0;
};

/// What the Coder is asked to do.
struct CoderRequest {
  rubric::Skill skill = rubric::Skill::from_plan;  ///< Skill 1 or Skill 2
  const Problem* problem = nullptr;                 ///< required
  const ProblemPlan* plan = nullptr;                ///< required for Skill 1, shown for Skill 2 when given
  std::string previous;                             ///< Skill 2: the candidate to revise
  std::string feedback;                             ///< Skill 2: the VerifierAgent's text
};

/// What the Coder wrote.
struct CoderResult {
  Extraction extraction;            ///< the candidate (extraction.code; "" when there is none)
  std::string problem;              ///< why there is no candidate after the re-asks ("" when there is one)
  std::vector<Exchange> exchanges;  ///< every call made (re-asks included)
};

/// The prompt the Coder sends first for a request: what write() asks the model, built without calling it
/// (so that a training set holds exactly the text the agents send).
struct CoderPrompt {
  std::string text;                   ///< the rendered prompt, sent as one user message
  std::string prompt_name;            ///< "coder_plan" (Skill 1) or "coder_feedback" (Skill 2)
  std::string prompt_sha256;          ///< the template's hash
  std::vector<std::string> snippets;  ///< ids of the documentation sections it includes
};

/// Writes CUDA from a plan (Skill 1) or revises a candidate from feedback (Skill 2). The answer it asks
/// for is the problem's (Problem::answer): the contract in prompts/answer_<answer>.md fills the
/// `{{answer}}` of coder_plan.md and coder_feedback.md, and the reply is read with extract_code
/// ("model_new") or extract_kernel_step ("kernel_step"; a reply that holds a ModelNew instead is taken
/// as that ModelNew, with a note: it is judged, never part of the program).
class Coder {
 public:
  Coder(std::shared_ptr<llm::Backend> llm, std::shared_ptr<const PromptLibrary> prompts,
        std::shared_ptr<const Retriever> docs = nullptr, AgentOptions options = {});
  /// The candidate. A reply without a usable candidate (none, truncated) is re-asked saying what was
  /// wrong, up to max_repairs times; then a result without code whose `problem` says why (the calls
  /// are kept: they are trajectories too). InvalidArgument for a request missing its inputs or a problem
  /// whose answer is neither "model_new" nor "kernel_step"; backend errors pass through.
  Result<CoderResult> write(const CoderRequest& request) const;
  /// The first prompt write() sends for `request` (no model is called; `llm` may be null). Same
  /// InvalidArgument errors as write().
  Result<CoderPrompt> prompt(const CoderRequest& request) const;

 private:
  std::shared_ptr<llm::Backend> llm_;
  std::shared_ptr<const PromptLibrary> prompts_;
  std::shared_ptr<const Retriever> docs_;
  AgentOptions options_;
};

/// Feedback for the Coder: what to fix first, or which bottleneck to attack.
struct Feedback {
  std::string kind;                ///< "compile", "runtime", "incorrect", "hack", "slow", "correct", "unverified"
  std::string text;                ///< the message the Coder reads
  std::vector<std::string> asks;   ///< the concrete requests in it (the rubric checks compliance against them)
  std::optional<Exchange> exchange;///< the LLM call that refined it, when one did
};

/// Turns a Report into Feedback: deterministic (compile error lines, first mismatches, findings, the
/// bottleneck diagnosis), then, with a backend, refined by the model's diagnosis (appended; a failing
/// call leaves the deterministic text).
class VerifierAgent {
 public:
  /// `llm` may be null: deterministic feedback only.
  explicit VerifierAgent(std::shared_ptr<llm::Backend> llm = nullptr, std::shared_ptr<const PromptLibrary> prompts = nullptr,
                         AgentOptions options = {});
  /// The feedback on `report` for `candidate`; `target_speedup` (> 0) is said when the candidate is
  /// correct but short of it.
  Feedback feedback(const Problem& problem, const std::string& candidate, const Report& report,
                    double target_speedup = 0.0) const;

 private:
  std::shared_ptr<llm::Backend> llm_;
  std::shared_ptr<const PromptLibrary> prompts_;
  AgentOptions options_;
};

/// The rubric's optional LLM judge (rubric::Judge): renders `rubric_judge.md` with the candidate, the
/// Verifier's findings and the detectors' items, and reads back the four items as JSON. The Rubric keeps
/// the detectors' items when the judge fails or answers out of bounds, and never lets it raise
/// anti-hacking; each call is kept for the attempt's record (take_exchanges).
class RubricJudge : public rubric::Judge {
 public:
  RubricJudge(std::shared_ptr<llm::Backend> llm, std::shared_ptr<const PromptLibrary> prompts, AgentOptions options = {});
  Result<rubric::Items> refine(const rubric::Input& input, const rubric::Items& items) override;
  /// The calls made since the last take (agent "judge"), oldest first.
  std::vector<Exchange> take_exchanges();
  /// The reference the candidates implement (shown in the prompt; the Optimizer sets it per run).
  void set_reference(std::string reference);

 private:
  std::shared_ptr<llm::Backend> llm_;
  std::shared_ptr<const PromptLibrary> prompts_;
  AgentOptions options_;
  std::mutex mu_;
  std::vector<Exchange> exchanges_;
  std::string reference_;
};

/// One attempt as the Replanner sees it.
struct AttemptSummary {
  int index = 0;             ///< 1-based
  std::string outcome;       ///< "compile error: ...", "incorrect: ...", "correct, 1.42x"
};

/// Writes a new plan when progress stalls, from the old plan and what the attempts showed.
class Replanner : public Planner {
 public:
  using Planner::Planner;
  /// A new plan that avoids what failed. Same re-ask rule as Planner::plan.
  Result<ProblemPlanResult> replan(const Problem& problem, const ProblemPlan& previous,
                            const std::vector<AttemptSummary>& history) const;
};

// ---- the run directory ---------------------------------------------------------------------------

/// One attempt as recorded.
struct AttemptRecord {
  int index = 0;                       ///< 1-based
  int plan = 0;                        ///< which plan it followed (1 = first, 2 = after the first replan...)
  rubric::Skill skill = rubric::Skill::from_plan;
  std::string candidate;               ///< the source ("" when the Coder failed)
  std::string coder_error;             ///< why there is no candidate ("" when there is)
  Report report;                       ///< the Verifier's verdict (default when no candidate)
  Feedback feedback;                   ///< what the Coder is told next
  rubric::Scorecard scorecard;         ///< the rubric's items
  rubric::Reward reward;               ///< the reward
  std::vector<Exchange> exchanges;     ///< the Coder's calls for this attempt
  std::vector<Exchange> judge_exchanges;  ///< the rubric judge's calls for it (none without a judge)
  double wall_s = 0.0;                 ///< the attempt's wall time
  double llm_s = 0.0;                  ///< of which waiting for models
  double verify_s = 0.0;               ///< of which verifying (compile and GPU)
};

/// The folder a run writes: config.json (secrets redacted), hardware.json, problem.py, prompts/ (with
/// hashes), plans/plan-N.json, attempts/NNN/{candidate.py, report.json, feedback.md, rubric.json, reward.json},
/// best.py, summary.json, trajectories.jsonl (one record per model call: docs/agents.md, "Trajectories")
/// and events.jsonl (the progress). The run's id is the folder's name.
class RunDirectory {
 public:
  /// Creates `path` (must not exist or be empty). IoError names what could not be written.
  static Result<RunDirectory> create(const std::string& path);
  /// Opens an existing run to resume it; NotFound / InvalidArgument when it is not a run directory.
  static Result<RunDirectory> open(const std::string& path);
  /// A fresh name under `root`: "<root>/<UTC yyyymmdd-hhmmss>-<problem>" (made unique).
  static std::string fresh_path(const std::string& root, const std::string& problem);

  const std::string& path() const { return path_; }

  /// config.json; values of keys naming secrets (key, token, secret, password, authorization) become "<redacted>".
  Result<void> write_config(const std::string& config_json) const;
  Result<void> write_problem(const Problem& problem) const;
  Result<void> write_prompts(const PromptLibrary& prompts) const;
  /// plans/plan-N.json (N is 1-based), the calls that made it, and one trajectories.jsonl record per
  /// call. `problem` is the problem's name; `attempts_done` the attempts finished when the plan was made
  /// (a replan's record names it as its attempt; the first plan's attempt is null).
  Result<void> write_plan(int n, const ProblemPlanResult& plan, const std::string& problem, int attempts_done = 0) const;
  /// attempts/NNN/ and one trajectories.jsonl record per model call of the attempt: the Coder's (with
  /// the reward) and the VerifierAgent's.
  Result<void> write_attempt(const AttemptRecord& attempt, const std::string& problem) const;
  /// best.py (atomic replace).
  Result<void> write_best(const std::string& candidate) const;
  /// summary.json (atomic replace).
  Result<void> write_summary(const std::string& summary_json) const;
  /// Appends one JSON line to events.jsonl.
  Result<void> append_event(const std::string& event_json) const;

  /// What a resumed run reads back.
  struct Saved {
    std::string config_json;               ///< "" when absent
    std::vector<ProblemPlanResult> plans;  ///< plan-1, plan-2... in order, with the calls that made them
    std::vector<AttemptRecord> attempts;   ///< finished attempts only (attempt.json present), in order
  };
  /// Reads the plans (and their calls) and the finished attempts (attempt.json is written last: an
  /// attempt folder without attempt.json was interrupted and is dropped).
  Result<Saved> load() const;
  /// Replaces trajectories.jsonl with the records of `saved`, in the order the calls were made: what a
  /// resumed run starts from, so that a kill between an attempt's files and its records leaves neither
  /// a missing nor a repeated record.
  Result<void> write_trajectories(const Saved& saved, const std::string& problem) const;

 private:
  explicit RunDirectory(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

/// An attempt as one JSON object (index, plan, skill, candidate, coder_error, report, feedback, scorecard,
/// reward, exchanges, times): what attempts/NNN/ holds, and what RunDirectory::load reads back.
std::string to_json(const AttemptRecord& attempt);
/// An exchange as JSON (agent, model, messages, reply, finish_reason, usage, latency_s, error, prompt, snippets).
std::string to_json(const Exchange& exchange);

// ---- the loop ------------------------------------------------------------------------------------

/// Limits of one optimization run (0 = no limit). A run records its budget in config.json ("budget");
/// a resumed run records the budget it continues with there too, and what changed, in "resumes" and
/// in a "resume" event.
struct Budget {
  int attempts = 8;                  ///< Coder calls that produce a candidate to verify
  int replans = 2;                   ///< new plans after the first
  double wall_s = 0.0;               ///< whole run
  std::int64_t tokens = 0;           ///< prompt + completion tokens of all calls
  double target_speedup = 0.0;       ///< stop once a correct, unhacked candidate reaches it
  int replan_after_failures = 3;     ///< consecutive attempts without a correct candidate before replanning
  int stagnation = 3;                ///< consecutive correct attempts without a better speed-up before replanning

  /// The budget as JSON (every field, by its name).
  std::string to_json() const;
  /// The fields `json` holds over `defaults` (unknown keys ignored; a field of the wrong type is
  /// InvalidArgument): how a resumed run reads back the budget it was saved with.
  static Result<Budget> from_json(std::string_view json, const Budget& defaults);
  /// The same over the default budget.
  static Result<Budget> from_json(std::string_view json);
};

/// Something the loop reports as it goes (for progress views and events.jsonl).
struct Event {
  std::string stage;        ///< "plan", "code", "verify", "feedback", "replan", "done"
  int attempt = 0;          ///< current attempt (0 before the first)
  int plan = 0;             ///< current plan
  double best_speedup = 0;  ///< best correct, unhacked speed-up so far (0 = none yet)
  std::string message;      ///< one line
};
using EventCallback = std::function<void(const Event&)>;

/// How the loop scores one attempt, and how anyone else scoring a candidate (an RL reward) does it too.
struct AttemptScore {
  rubric::Input input;          ///< what the rubric read
  rubric::Scorecard scorecard;  ///< its items
  rubric::Reward reward;        ///< R and its parts
};

/// Scores `candidate` the way the Optimizer scores an attempt: the rubric reads the candidate's CUDA
/// (written inline in its Python, or a kernel step's source) and the Verifier's `report` (a static-only
/// report is unverified); `asks` are the plan's step titles (Skill 1) or the previous feedback's asks
/// (Skill 2), and Skill 2 passes the revised candidate and its report (may be null). InvalidArgument for
/// an invalid reward config.
Result<AttemptScore> score_attempt(const rubric::Rubric& rubric, const std::string& candidate, const Report& report,
                                   rubric::Skill skill, std::vector<std::string> asks, const std::string* previous,
                                   const Report* previous_report, const rubric::RewardConfig& config);

/// The agents a loop uses; any may be replaced by a user's subclass or configuration.
struct Agents {
  std::shared_ptr<const Planner> planner;
  std::shared_ptr<const Coder> coder;
  std::shared_ptr<const VerifierAgent> verifier_agent;
  std::shared_ptr<const Replanner> replanner;
  std::shared_ptr<const rubric::Rubric> rubric;
  std::shared_ptr<RubricJudge> judge;  ///< the rubric's judge, when it has one (its calls are recorded)
  rubric::RewardConfig reward;
  std::shared_ptr<const PromptLibrary> prompts;  ///< recorded in the run directory (prompts/) when set
};

/// The end of a run.
struct Outcome {
  std::string run_dir;               ///< where everything is
  std::string best;                  ///< best correct, unhacked candidate ("" when none)
  int best_attempt = 0;              ///< its attempt (0 = none)
  double best_speedup = 0.0;         ///< its speed-up over eager
  bool verified = true;              ///< false when verification was static only (no GPU)
  std::string stop_reason;           ///< "target reached", "attempt budget spent", "wall-time budget spent"...
  std::vector<AttemptRecord> attempts;  ///< all attempts, resumed ones included
  int plans = 0;                     ///< plans made (1 + replans)
  llm::Usage usage;                  ///< tokens of every call of the run, before a resume too (plans, Coder, VerifierAgent)
  double wall_s = 0.0;               ///< this process's time on the run
  double overhead_s = 0.0;           ///< wall_s minus model, verification time: the loop's own cost
  std::string summary_json() const;  ///< what summary.json holds
};

/// Plans, codes, verifies, gives feedback, replans, within a budget; records everything in a RunDirectory.
class Optimizer {
 public:
  Optimizer(Agents agents, std::shared_ptr<Verifier> verifier, Budget budget = {});
  /// Runs `problem` into a new run directory at `run_dir` (created; "" = RunDirectory::fresh_path("runs", name)).
  /// `config_json` is written (redacted) as config.json. Errors: the directory cannot be created, the
  /// Planner fails for good, the Coder or Verifier fail in a way that is not the candidate's fault.
  Result<Outcome> run(const Problem& problem, const std::string& run_dir = "", const std::string& config_json = "{}",
                      const EventCallback& on_event = {}) const;
  /// Continues the run in `run_dir`: finished attempts and plans are read back, not repeated; the budget
  /// (this Optimizer's) counts them and every saved call's tokens. config.json's "budget" becomes this
  /// budget; what differs from the saved one is listed in its "resumes" and in a "resume" event.
  Result<Outcome> resume(const Problem& problem, const std::string& run_dir, const EventCallback& on_event = {}) const;

 private:
  Result<void> check() const;
  Result<Outcome> drive(const Problem& problem, RunDirectory dir, RunDirectory::Saved saved,
                        const EventCallback& on_event) const;
  Agents agents_;
  std::shared_ptr<Verifier> verifier_;
  Budget budget_;
};

}  // namespace stitchcuda::agents
