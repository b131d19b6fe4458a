// Bindings of the agents layer: retrieval, prompts, code extraction, problem plans, Verifier reports, and
// `optimize`, which runs the C++ Optimizer with a Python verify function — on a worker thread with the
// GIL released, so that Ctrl-C is seen while models and verification run.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>

#include <stitchcuda/agents.hpp>

#include "errors.hpp"
#include "interrupt.hpp"

namespace py = pybind11;

namespace stitchcuda::bindings {
namespace {

using namespace stitchcuda::agents;

py::object json_loads(const std::string& text) { return py::module_::import("json").attr("loads")(text); }

template <class T>
T get_or(const py::dict& d, const char* key, T fallback) {
  return d.contains(key) && !d[key].is_none() ? d[key].cast<T>() : fallback;
}

Hardware to_hardware(const py::dict& d) {
  check_keys(d, {"gpu", "arch", "sms", "memory_gib", "dram_tb_s", "fp32_tflops", "tf32_tflops", "cuda"}, "hardware key");
  Hardware h;
  h.gpu = get_or<std::string>(d, "gpu", h.gpu);
  h.arch = get_or<std::string>(d, "arch", "");
  h.sms = get_or<int>(d, "sms", 0);
  h.memory_gib = get_or<double>(d, "memory_gib", 0.0);
  h.dram_tb_s = get_or<double>(d, "dram_tb_s", 0.0);
  h.fp32_tflops = get_or<double>(d, "fp32_tflops", 0.0);
  h.tf32_tflops = get_or<double>(d, "tf32_tflops", 0.0);
  h.cuda = get_or<std::string>(d, "cuda", "");
  return h;
}

Problem to_problem(const py::dict& d) {
  check_keys(d, {"name", "reference", "profile", "hardware", "answer", "target"}, "problem key");
  Problem p;
  p.name = get_or<std::string>(d, "name", "");
  p.reference = get_or<std::string>(d, "reference", "");
  p.profile = get_or<std::string>(d, "profile", "");
  p.answer = get_or<std::string>(d, "answer", p.answer);
  p.target = get_or<std::string>(d, "target", "");
  if (p.answer != "model_new" && p.answer != "kernel_step")
    invalid("the problem's 'answer' is '" + p.answer + "'; expected 'model_new' or 'kernel_step'");
  if (d.contains("hardware") && !d["hardware"].is_none()) p.hardware = to_hardware(d["hardware"].cast<py::dict>());
  if (p.name.empty()) invalid("the problem needs a 'name' (the problem file's stem)");
  if (p.reference.empty()) invalid("the problem needs a 'reference' (the KernelBench-format source)");
  return p;
}

Budget to_budget(const py::dict& d) {
  check_keys(d, {"attempts", "replans", "wall_s", "tokens", "target_speedup", "replan_after_failures", "stagnation"},
             "budget key");
  Budget b;
  b.attempts = get_or<int>(d, "attempts", b.attempts);
  b.replans = get_or<int>(d, "replans", b.replans);
  b.wall_s = get_or<double>(d, "wall_s", b.wall_s);
  b.tokens = get_or<std::int64_t>(d, "tokens", b.tokens);
  b.target_speedup = get_or<double>(d, "target_speedup", b.target_speedup);
  b.replan_after_failures = get_or<int>(d, "replan_after_failures", b.replan_after_failures);
  b.stagnation = get_or<int>(d, "stagnation", b.stagnation);
  if (b.attempts < 1) invalid("budget attempts must be at least 1, got " + std::to_string(b.attempts));
  if (b.replans < 0) invalid("budget replans must be 0 or more, got " + std::to_string(b.replans));
  if (b.wall_s < 0 || b.tokens < 0 || b.target_speedup < 0) invalid("budget wall_s, tokens and target_speedup must be >= 0");
  return b;
}

py::dict prompt_dict(const Prompt& p) {
  py::dict d;
  d["version"] = p.version, d["sha256"] = p.sha256, d["path"] = p.path, d["text"] = p.text;
  return d;
}

py::dict extraction_dict(const Extraction& e) {
  py::list blocks;
  for (const CodeBlock& b : e.blocks) {
    py::dict d;
    d["language"] = b.language, d["code"] = b.code, d["line"] = b.line, d["closed"] = b.closed;
    blocks.append(d);
  }
  py::dict d;
  d["code"] = e.code, d["blocks"] = blocks, d["truncated"] = e.truncated, d["notes"] = e.notes;
  return d;
}

py::object optional_number(const std::optional<double>& x) { return x ? py::object(py::float_(*x)) : py::object(py::none()); }

py::dict report_dict(const Report& r) {
  py::list findings;
  for (std::size_t i = 0; i < r.findings.size(); ++i) {
    py::dict f;
    f["rule"] = r.findings[i].rule;
    f["severity"] = rubric::to_string(r.findings[i].severity);
    f["evidence"] = r.findings[i].evidence;
    f["message"] = i < r.finding_messages.size() ? r.finding_messages[i] : std::string();
    f["line"] = i < r.finding_lines.size() ? r.finding_lines[i] : 0;
    findings.append(f);
  }
  py::dict d;
  d["compiled"] = r.compiled, d["correct"] = r.correct, d["static_only"] = r.static_only, d["hack"] = r.hack();
  d["speedup_eager"] = optional_number(r.speedup_eager), d["speedup_compile"] = optional_number(r.speedup_compile);
  d["findings"] = findings, d["error_kind"] = r.error_kind, d["error_message"] = r.error_message;
  d["compile_log"] = r.compile_log, d["mismatches"] = r.mismatches, d["bottleneck"] = r.bottleneck;
  d["top_kernel"] = r.top_kernel, d["candidate_ms"] = r.candidate_ms, d["wall_s"] = r.wall_s;
  return d;
}

py::dict event_dict(const Event& e) {
  py::dict d;
  d["stage"] = e.stage, d["attempt"] = e.attempt, d["plan"] = e.plan, d["best_speedup"] = e.best_speedup;
  d["message"] = e.message;
  return d;
}

// The exception text of a Python error, as one line ("ValueError: bad input").
std::string exception_text(py::error_already_set& e) {
  try {
    return std::string(py::str(e.type().attr("__name__"))) + ": " + std::string(py::str(e.value()));
  } catch (py::error_already_set&) {
    return e.what();
  }
}

Report crash_report(const std::string& message) {
  Report r;
  r.compiled = false;
  r.error_kind = "crash";
  r.error_message = message;
  return r;
}

// The Verifier as Python gives it: verify_fn(candidate_source) -> VerifyReport JSON. Never throws: a
// raising function or an unreadable answer is a crash report.
class PythonVerifier final : public Verifier {
 public:
  PythonVerifier(py::object fn, PendingError& pending) : fn_(std::move(fn)), pending_(pending) {}
  ~PythonVerifier() override {
    py::gil_scoped_acquire gil;  // the last reference may be dropped without the GIL
    fn_ = py::object();
  }

  Result<Report> verify(const Problem&, const std::string& candidate) override {
    if (pending_.cancel.cancelled()) return crash_report("the run was interrupted before this candidate was verified");
    std::string json;
    {
      py::gil_scoped_acquire gil;
      try {
        py::object out = fn_(candidate);
        if (!py::isinstance<py::str>(out))
          return crash_report("the verify function returned " +
                              std::string(py::str(py::type::handle_of(out).attr("__name__"))) +
                              ", not a VerifyReport JSON string");
        json = out.cast<std::string>();
      } catch (py::error_already_set& e) {
        if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit)) {
          std::string text = exception_text(e);
          pending_.keep(std::move(e));
          return crash_report("verification was interrupted (" + text + ")");
        }
        return crash_report("the verify function raised " + exception_text(e));
      } catch (const std::exception& e) {
        return crash_report(std::string("the verify function failed: ") + e.what());
      }
    }
    auto report = Report::from_json(json);
    if (!report) return crash_report("the verify function's report cannot be read: " + report.error().message);
    return report;
  }

 private:
  py::object fn_;
  PendingError& pending_;
};

// The run's model: the connected backend, refusing new calls once the run is interrupted (a backend
// only looks at the token while it waits, and a Python backend not at all).
class InterruptibleBackend final : public llm::Backend {
 public:
  InterruptibleBackend(std::shared_ptr<llm::Backend> inner, llm::CancelToken cancel)
      : Backend(inner->name()), inner_(std::move(inner)), cancel_(std::move(cancel)) {}
  Result<llm::Completion> complete(const std::vector<llm::Message>& messages, const llm::Options& options,
                                   const llm::TextCallback& on_text) override {
    if (cancel_.cancelled()) return fail(ErrorCode::Cancelled, "the run was interrupted");
    return inner_->complete(messages, options, on_text);
  }

 private:
  std::shared_ptr<llm::Backend> inner_;
  llm::CancelToken cancel_;
};

// What `options` may set, beside the budget.
struct LoopOptions {
  bool verifier_llm = true;
  bool judge = false;  // the rubric's LLM judge (off by default)
  std::string prompts_dir, prompts_override, docs_dir;
  AgentOptions agent;
  rubric::RewardConfig reward;
};

LoopOptions to_loop_options(const py::dict& d) {
  check_keys(d,
             {"verifier_llm", "judge", "prompts_dir", "prompts_override", "docs_dir", "doc_snippets", "max_repairs",
              "temperature", "top_p", "max_tokens", "seed", "timeout", "tau", "r_max", "lambda_plan",
              "lambda_feedback"},
             "optimize option");
  LoopOptions o;
  o.verifier_llm = get_or<bool>(d, "verifier_llm", true);
  o.judge = get_or<bool>(d, "judge", false);
  o.prompts_dir = get_or<std::string>(d, "prompts_dir", "");
  o.prompts_override = get_or<std::string>(d, "prompts_override", "");
  o.docs_dir = get_or<std::string>(d, "docs_dir", "");
  o.agent.doc_snippets = get_or<std::size_t>(d, "doc_snippets", o.agent.doc_snippets);
  o.agent.max_repairs = get_or<int>(d, "max_repairs", o.agent.max_repairs);
  auto& llm = o.agent.llm;
  if (d.contains("temperature") && !d["temperature"].is_none()) llm.temperature = d["temperature"].cast<double>();
  if (d.contains("top_p") && !d["top_p"].is_none()) llm.top_p = d["top_p"].cast<double>();
  if (d.contains("max_tokens") && !d["max_tokens"].is_none()) llm.max_tokens = d["max_tokens"].cast<int>();
  if (d.contains("seed") && !d["seed"].is_none()) llm.seed = d["seed"].cast<std::int64_t>();
  if (d.contains("timeout") && !d["timeout"].is_none()) llm.timeout_s = d["timeout"].cast<double>();
  o.reward.tau = get_or<double>(d, "tau", o.reward.tau);
  o.reward.r_max = get_or<double>(d, "r_max", o.reward.r_max);
  o.reward.lambda_plan = get_or<double>(d, "lambda_plan", o.reward.lambda_plan);
  o.reward.lambda_feedback = get_or<double>(d, "lambda_feedback", o.reward.lambda_feedback);
  unwrap(o.reward.validate());
  if (o.prompts_dir.empty()) invalid("optimize needs options['prompts_dir'] (stitchcuda.agents.PROMPTS_DIR)");
  return o;
}

py::dict outcome_dict(const Outcome& o) {
  py::list attempts;
  for (const AttemptRecord& a : o.attempts) attempts.append(json_loads(to_json(a)));
  py::dict usage;
  usage["prompt_tokens"] = o.usage.prompt_tokens;
  usage["completion_tokens"] = o.usage.completion_tokens;
  usage["total_tokens"] = o.usage.total_tokens;
  py::dict d;
  d["run_dir"] = o.run_dir, d["best"] = o.best, d["best_attempt"] = o.best_attempt, d["best_speedup"] = o.best_speedup;
  d["verified"] = o.verified, d["stop_reason"] = o.stop_reason, d["plans"] = o.plans, d["usage"] = usage;
  d["wall_s"] = o.wall_s, d["overhead_s"] = o.overhead_s, d["attempts"] = attempts;
  d["summary"] = json_loads(o.summary_json());
  return d;
}

py::dict optimize(const py::dict& problem_dict, std::shared_ptr<llm::ReliableBackend> backend, py::object verify_fn,
                  const py::dict& budget_dict, const std::string& run_dir, const std::string& config_json, bool resume,
                  py::object on_event, const py::dict& options_dict) {
  if (!backend) invalid("optimize needs a model backend (stitchcuda.llm.connect(...))");
  if (!PyCallable_Check(verify_fn.ptr())) invalid("verify_fn must be callable: verify_fn(candidate_source) -> str");
  if (!on_event.is_none() && !PyCallable_Check(on_event.ptr())) invalid("on_event must be callable or None");
  if (resume && run_dir.empty()) invalid("resuming needs the run directory");
  const Problem problem = to_problem(problem_dict);
  const Budget budget = to_budget(budget_dict);
  LoopOptions options = to_loop_options(options_dict);

  PendingError pending;
  options.agent.llm.cancel = pending.cancel;  // Ctrl-C and a raising callback end the model calls
  auto prompts = std::make_shared<const PromptLibrary>(unwrap(PromptLibrary::load(options.prompts_dir, options.prompts_override)));
  std::shared_ptr<const Retriever> docs;
  if (!options.docs_dir.empty()) docs = std::make_shared<const Retriever>(unwrap(Retriever::from_folder(options.docs_dir)));
  std::shared_ptr<llm::Backend> model = std::make_shared<InterruptibleBackend>(backend, pending.cancel);
  Agents agents;
  agents.planner = std::make_shared<const Planner>(model, prompts, docs, options.agent);
  agents.coder = std::make_shared<const Coder>(model, prompts, docs, options.agent);
  agents.verifier_agent =
      std::make_shared<const VerifierAgent>(options.verifier_llm ? model : nullptr, prompts, options.agent);
  agents.replanner = std::make_shared<const Replanner>(model, prompts, docs, options.agent);
  if (options.judge) agents.judge = std::make_shared<RubricJudge>(model, prompts, options.agent);
  agents.rubric = std::make_shared<const rubric::Rubric>(agents.judge);
  agents.reward = options.reward;
  agents.prompts = prompts;  // recorded in the run directory's prompts/
  auto verifier = std::make_shared<PythonVerifier>(std::move(verify_fn), pending);
  const Optimizer optimizer(std::move(agents), verifier, budget);

  const std::string path = run_dir.empty() ? RunDirectory::fresh_path("runs", problem.name) : run_dir;
  EventCallback callback = [&](const Event& e) {
    if (on_event.is_none() || pending.set()) return;
    py::gil_scoped_acquire gil;
    try {
      on_event(event_dict(e));
    } catch (py::error_already_set& err) {
      pending.keep(std::move(err));
    }
  };

  Result<Outcome> result = run_interruptible<Outcome>(
      [&] { return resume ? optimizer.resume(problem, path, callback) : optimizer.run(problem, path, config_json, callback); },
      pending, "the optimization loop");
  pending.raise();
  py::dict out = outcome_dict(unwrap(std::move(result)));
  out["notes"] = py::list();
  return out;
}

// The Coder's first prompt for one request, without a model: {text, prompt_name, prompt_sha256, snippets}.
py::dict coder_prompt(const py::dict& problem_dict, int skill, const std::string& plan_text, const std::string& previous,
                      const std::string& feedback, const py::dict& options_dict) {
  check_keys(options_dict, {"prompts_dir", "prompts_override", "docs_dir", "doc_snippets"}, "coder_prompt option");
  const Problem problem = to_problem(problem_dict);
  const std::string dir = get_or<std::string>(options_dict, "prompts_dir", "");
  if (dir.empty()) invalid("coder_prompt needs options['prompts_dir'] (stitchcuda.agents.PROMPTS_DIR)");
  if (skill != 1 && skill != 2) invalid("skill must be 1 (from the plan) or 2 (from feedback), got " + std::to_string(skill));
  auto prompts = std::make_shared<const PromptLibrary>(
      unwrap(PromptLibrary::load(dir, get_or<std::string>(options_dict, "prompts_override", ""))));
  std::shared_ptr<const Retriever> docs;
  const std::string docs_dir = get_or<std::string>(options_dict, "docs_dir", "");
  if (!docs_dir.empty()) docs = std::make_shared<const Retriever>(unwrap(Retriever::from_folder(docs_dir)));
  AgentOptions agent;
  agent.doc_snippets = get_or<std::size_t>(options_dict, "doc_snippets", agent.doc_snippets);
  std::optional<ProblemPlan> plan;
  if (!plan_text.empty()) plan = unwrap(ProblemPlan::parse(plan_text));
  CoderRequest request;
  request.skill = skill == 1 ? rubric::Skill::from_plan : rubric::Skill::from_feedback;
  request.problem = &problem;
  request.plan = plan ? &*plan : nullptr;
  request.previous = previous;
  request.feedback = feedback;
  CoderPrompt p = unwrap(Coder(nullptr, prompts, docs, agent).prompt(request));
  py::dict d;
  d["text"] = p.text, d["prompt_name"] = p.prompt_name, d["prompt_sha256"] = p.prompt_sha256, d["snippets"] = p.snippets;
  return d;
}

// A Verifier report from its JSON ("" = no report: the Coder gave no candidate).
Report report_of(const std::string& json) { return json.empty() ? Report{} : unwrap(Report::from_json(json)); }

// An attempt scored the way the loop scores it: {scorecard: {items, total, text}, reward: {value, ...}}.
py::dict score_attempt_dict(const std::string& candidate, const std::string& report_json, int skill,
                            std::vector<std::string> asks, std::optional<std::string> previous,
                            std::optional<std::string> previous_report_json, const py::dict& config) {
  check_keys(config, {"tau", "r_max", "lambda_plan", "lambda_feedback"}, "reward config key");
  if (skill != 1 && skill != 2) invalid("skill must be 1 (from the plan) or 2 (from feedback), got " + std::to_string(skill));
  rubric::RewardConfig c;
  c.tau = get_or<double>(config, "tau", c.tau), c.r_max = get_or<double>(config, "r_max", c.r_max);
  c.lambda_plan = get_or<double>(config, "lambda_plan", c.lambda_plan);
  c.lambda_feedback = get_or<double>(config, "lambda_feedback", c.lambda_feedback);
  const Report report = report_of(report_json);
  std::optional<Report> previous_report;
  if (previous_report_json) previous_report = report_of(*previous_report_json);
  AttemptScore s = unwrap(score_attempt(rubric::Rubric(), candidate, report,
                                        skill == 1 ? rubric::Skill::from_plan : rubric::Skill::from_feedback,
                                        std::move(asks), previous ? &*previous : nullptr,
                                        previous_report ? &*previous_report : nullptr, c));
  py::list items;
  for (const rubric::Item& item : s.scorecard.items) {
    py::dict d;
    d["dimension"] = rubric::to_string(item.dimension), d["score"] = item.score, d["reason"] = item.reason;
    d["evidence"] = item.evidence;
    items.append(d);
  }
  py::dict card;
  card["items"] = items, card["total"] = s.scorecard.total(), card["text"] = s.scorecard.describe();
  const rubric::Reward& r = s.reward;
  py::dict reward;
  reward["value"] = r.value, reward["correct"] = r.correct, reward["hack"] = r.hack, reward["speedup"] = r.speedup;
  reward["total"] = r.total, reward["normalized"] = r.normalized, reward["lambda"] = r.lambda;
  reward["shaped"] = r.shaped, reward["capped"] = r.capped, reward["zero_reason"] = r.zero_reason;
  reward["text"] = r.describe();
  py::dict out;
  out["scorecard"] = card, out["reward"] = reward, out["verified"] = s.input.outcome.verified;
  return out;
}

}  // namespace

void bind_agents(py::module_& m) {
  py::module_ am = m.def_submodule("agents", "the StitchCUDA agents: retrieval, prompts, plans, the optimization loop");
  auto as_dict = [](const Snippet& s) {
    py::dict d;
    d["id"] = s.id, d["title"] = s.title, d["text"] = s.text, d["score"] = s.score;
    return d;
  };
  py::class_<Retriever>(am, "Retriever")
      .def_static("from_folder", [](const std::string& dir) { return unwrap(Retriever::from_folder(dir)); })
      .def_static("from_documents", [](std::vector<std::pair<std::string, std::string>> docs) {
        return Retriever::from_documents(std::move(docs));
      })
      .def("search", [as_dict](const Retriever& r, const std::string& query, std::size_t k) {
        py::list out;
        for (const Snippet& s : r.search(query, k)) out.append(as_dict(s));
        return out;
      }, py::arg("query"), py::arg("k") = 3)
      .def("snippets", [as_dict](const Retriever& r) {
        py::list out;
        for (const Snippet& s : r.snippets()) out.append(as_dict(s));
        return out;
      })
      .def_static("tokenize", &Retriever::tokenize);

  py::class_<PromptLibrary>(am, "PromptLibrary")
      .def_static("load", [](const std::string& dir, const std::string& override_dir) {
        return unwrap(PromptLibrary::load(dir, override_dir));
      }, py::arg("dir"), py::arg("override_dir") = "")
      .def_static("required_names", &PromptLibrary::required_names)
      .def("prompts", [](const PromptLibrary& lib) {
        py::dict out;
        for (const auto& [name, p] : lib.prompts()) out[py::str(name)] = prompt_dict(p);
        return out;
      })
      .def("render", [](const PromptLibrary& lib, const std::string& name, const std::map<std::string, std::string>& values) {
        return unwrap(lib.render(name, values));
      }, py::arg("name"), py::arg("values"));

  am.def("extract_code", [](const std::string& reply, const std::string& finish_reason) {
    return extraction_dict(unwrap(extract_code(reply, finish_reason)));
  }, py::arg("reply"), py::arg("finish_reason") = "");
  am.def("extract_kernel_step", [](const std::string& reply, const std::string& finish_reason) {
    return extraction_dict(unwrap(extract_kernel_step(reply, finish_reason)));
  }, py::arg("reply"), py::arg("finish_reason") = "");
  // A kernel step's canonical text, validated and normalized (InvalidArgumentError names each problem).
  am.def("kernel_step_parse", [](const std::string& text) { return unwrap(KernelStep::parse(text)).to_json(); },
         py::arg("text"));
  // (the problem plan as JSON, the plan as the numbered text prompts show)
  am.def("problem_plan_parse", [](const std::string& text) {
    ProblemPlan plan = unwrap(ProblemPlan::parse(text));
    return py::make_tuple(plan.to_json(), plan.describe());
  }, py::arg("text"));
  am.def("problem_plan_schema", [] { return problem_plan_schema(); });
  am.def("report_schema", [] { return report_schema(); });
  am.def("report_from_json", [](const std::string& json) { return report_dict(unwrap(Report::from_json(json))); },
         py::arg("json"));
  am.def("fresh_run_path", &RunDirectory::fresh_path, py::arg("root"), py::arg("problem"));
  am.def("coder_prompt", &coder_prompt, py::arg("problem"), py::arg("skill"), py::arg("plan"), py::arg("previous"),
         py::arg("feedback"), py::arg("options"));
  am.def("score_attempt", &score_attempt_dict, py::arg("candidate"), py::arg("report_json"), py::arg("skill"),
         py::arg("asks"), py::arg("previous"), py::arg("previous_report_json"), py::arg("config"));
  am.def("optimize", &optimize, py::arg("problem"), py::arg("llm_backend"), py::arg("verify_fn"), py::arg("budget"),
         py::arg("run_dir"), py::arg("config_json"), py::arg("resume"), py::arg("on_event"), py::arg("options"));
}

}  // namespace stitchcuda::bindings
