// VerifierAgent: turns a Verifier's Report into what the Coder reads next — the first thing to fix
// (compile error, run-time failure, untrustworthy result, wrong output) or, once correct, the measured
// bottleneck — with the concrete asks the rubric checks compliance against; optionally refined by a model.
#include <stitchcuda/agents.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sstream>

#include "conversation.hpp"

namespace stitchcuda::agents {
namespace {

// Error kinds that mean the candidate ran (or started to) and failed. The kinds that stop a candidate
// before it runs ("compile", "bad-candidate", "bad-reference") are reported as "compile".
bool is_runtime_kind(std::string_view kind) {
  static const std::vector<std::string_view> kinds = {"crash",         "timeout", "oom",  "illegal-address",
                                                      "device-assert", "runtime", "load"};
  return std::find(kinds.begin(), kinds.end(), kind) != kinds.end();
}

// Compiler logs and messages can be long; asks stay one line.
std::string clip(std::string_view text, std::size_t limit = 240) {
  std::string s(text.substr(0, text.find('\n')));
  if (s.size() > limit) s = s.substr(0, limit) + "...";
  return s;
}

std::string speed(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", x);
  return buf;
}

/// The feedback being written: text lines and the asks, which also end the text as a list.
struct Draft {
  std::string kind;
  std::vector<std::string> lines;
  std::vector<std::string> asks;

  void line(std::string s) { lines.push_back(std::move(s)); }
  void ask(std::string s) { asks.push_back(std::move(s)); }

  Feedback finish() && {
    Feedback f;
    f.kind = std::move(kind);
    for (const auto& l : lines) f.text += l + "\n";
    if (!asks.empty()) {
      f.text += "\nWhat to do next:\n";
      for (const auto& a : asks) f.text += "- " + a + "\n";
    }
    f.asks = std::move(asks);
    return f;
  }
};

// "[rule] line 42: message" for the finding at `i`.
std::string finding_heading(const Report& r, std::size_t i) {
  std::string s = "[" + r.findings[i].rule + "]";
  int line = i < r.finding_lines.size() ? r.finding_lines[i] : 0;
  if (line > 0) s += " line " + std::to_string(line);
  std::string message = i < r.finding_messages.size() ? r.finding_messages[i] : "";
  return s + (message.empty() ? "" : ": " + message);
}

std::vector<std::size_t> findings_of(const Report& r, rubric::Severity severity) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < r.findings.size(); ++i)
    if (r.findings[i].severity == severity) out.push_back(i);
  return out;
}

// Lists the major findings with their evidence and asks to remove each.
void add_majors(Draft& d, const Report& r) {
  for (std::size_t i : findings_of(r, rubric::Severity::major)) {
    d.line("- " + finding_heading(r, i));
    if (!r.findings[i].evidence.empty()) d.line("  Evidence: " + r.findings[i].evidence);
    int line = i < r.finding_lines.size() ? r.finding_lines[i] : 0;
    std::string message = i < r.finding_messages.size() ? r.finding_messages[i] : "";
    d.ask("remove the [" + r.findings[i].rule + "] problem" + (line > 0 ? " at line " + std::to_string(line) : "") +
          (message.empty() ? "" : ": " + clip(message)));
  }
}

void add_minors(Draft& d, const Report& r) {
  auto minors = findings_of(r, rubric::Severity::minor);
  if (minors.empty()) return;
  d.line("");
  d.line("Worth a look:");
  for (std::size_t i : minors) {
    std::string evidence = r.findings[i].evidence;
    d.line("- " + finding_heading(r, i) + (evidence.empty() ? "" : " Evidence: " + clip(evidence)));
  }
}

// ---- compile -----------------------------------------------------------------------------------

/// One error line of a compiler log: where ("line 12" in the candidate file, or "kernel.cu:12" when
/// the Verifier could not map it) and the message.
struct LogError {
  std::string where;
  std::string message;
};

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

// Reads "line 12: error: msg" (mapped by the Verifier), "kernel.cu:12: error: msg" and NVRTC's own
// "kernel.cu(12): error: msg"; warnings and notes are not errors. Hand-parsed: logs can be long.
std::optional<LogError> parse_log_line(std::string_view l) {
  if (starts_with(l, "line ")) {
    std::size_t i = 5, digits = 0;
    while (i < l.size() && l[i] >= '0' && l[i] <= '9') ++i, ++digits;
    if (digits == 0 || !starts_with(l.substr(i), ": ")) return std::nullopt;
    std::string_view rest = l.substr(i + 2);
    if (starts_with(rest, "warning") || starts_with(rest, "remark") || starts_with(rest, "note")) return std::nullopt;
    for (std::string_view p : {"error: ", "fatal error: ", "catastrophic error: "})
      if (starts_with(rest, p)) rest.remove_prefix(p.size());
    return LogError{std::string(l.substr(0, i)), std::string(rest)};
  }
  for (std::string_view marker : {": error: ", ": fatal error: ", ": catastrophic error: "}) {
    std::size_t pos = l.find(marker);
    if (pos == std::string_view::npos || pos == 0) continue;
    std::string_view where = l.substr(0, pos);
    if (where.find_first_of("0123456789") == std::string_view::npos) continue;
    return LogError{std::string(where), std::string(l.substr(pos + marker.size()))};
  }
  return std::nullopt;
}

std::vector<LogError> compile_errors(const std::string& log) {
  std::vector<LogError> out;
  std::istringstream in(log);
  std::string line;
  while (std::getline(in, line))
    if (auto e = parse_log_line(line)) out.push_back(std::move(*e));
  return out;
}

// The log as the Verifier wrote it, cut after enough lines to fix the first errors.
void add_log(Draft& d, const std::string& log) {
  constexpr std::size_t kMaxLines = 80;
  d.line("Compiler log (line numbers are the candidate file's):");
  std::istringstream in(log);
  std::string line;
  std::size_t n = 0, dropped = 0;
  while (std::getline(in, line)) {
    if (n++ < kMaxLines) d.line(line);
    else ++dropped;
  }
  if (dropped) d.line("... (" + std::to_string(dropped) + " more log lines)");
}

void compile_feedback(Draft& d, const Report& r) {
  d.kind = "compile";
  std::string message = r.error_message.empty() ? "" : ": " + r.error_message;
  if (r.error_kind == "compile" || r.error_kind.empty()) d.line("The candidate did not compile" + message);
  else d.line("The candidate did not compile or load (" + r.error_kind + ")" + message);
  if (!r.compile_log.empty()) add_log(d, r.compile_log);

  constexpr std::size_t kMaxAsks = 5;
  auto errors = compile_errors(r.compile_log);
  for (std::size_t i = 0; i < errors.size() && i < kMaxAsks; ++i)
    d.ask("fix the compile error at " + errors[i].where + ": " + clip(errors[i].message));
  if (errors.size() > kMaxAsks)
    d.ask("then fix the " + std::to_string(errors.size() - kMaxAsks) + " further errors of the log");
  if (errors.empty()) d.ask("fix the error" + (r.error_message.empty() ? std::string(" so the candidate compiles") : ": " + clip(r.error_message)));
  if (r.hack()) {
    d.line("");
    d.line("Once it compiles, the result would still not be trusted:");
    add_majors(d, r);
  }
}

// ---- runtime -----------------------------------------------------------------------------------

/// What a run-time failure of this kind usually means, and the ask that follows from it.
struct Hint {
  std::string cause;
  std::string ask;
};

Hint runtime_hint(const Report& r) {
  const std::string& kind = r.error_kind;
  if (kind == "illegal-address")
    return {"A kernel read or wrote outside its buffers, or at a misaligned address. Check every global index "
            "against the tensor's numel (an `if (i < n)` guard when the grid is rounded up), the grid size "
            "against numel, the strides of non-contiguous inputs (or call .contiguous()), and the 16-byte "
            "alignment of float4 loads.",
            "guard every global index with its bound and size the grid from numel"};
  if (kind == "timeout") {
    if (!r.compiled)
      return {"Loading and compiling the candidate took longer than the limit: look for builds at import time, "
              "huge unrolled templates, or a loop at module level that never ends.",
              "make loading fast: compile once, keep templates and unrolling small"};
    return {"A kernel (or the host code) never finished. Look for loops whose bound or index never changes, "
            "a __syncthreads() inside a branch not every thread of the block takes (the pairing breaks and the "
            "block hangs), spin-waits on flags, or a grid far larger than the work.",
            "make every loop advance to its bound and every __syncthreads() reachable by all threads of the block"};
  }
  if (kind == "oom")
    return {"The candidate ran out of memory: look for workspaces allocated per call or per element, tensors "
            "kept alive across calls, or a size computed from the wrong dimension.",
            "allocate only what the outputs need, sized from the right dimensions"};
  if (kind == "device-assert")
    return {"A device-side assert fired: an index out of range in a kernel's assert or in a torch op fed by the "
            "candidate's values (gather/embedding indices, class labels).",
            "check the range of every index a kernel computes or passes on"};
  if (kind == "crash")
    return {"The process died (segfault or abort) while running the candidate: host code writing through a bad "
            "pointer (data_ptr of a freed temporary, wrong dtype), a launch with invalid arguments, or an "
            "illegal access that took the process down.",
            "check the pointers, dtypes and launch arguments passed to each kernel"};
  if (kind == "load")
    return {"The candidate failed while its module was being loaded: imports, module-level code, or the "
            "kernel build.",
            "make the module load: fix its imports and module-level code"};
  return {"Python raised while running the candidate: read the exception; check argument counts, dtypes and "
          "shapes passed to the kernels and the launch configuration.",
          "fix the exception at its source (arguments, dtypes, shapes, launch configuration)"};
}

void runtime_feedback(Draft& d, const Report& r) {
  d.kind = "runtime";
  d.line("The candidate failed at run time (" + r.error_kind + ")" +
         (r.error_message.empty() ? "." : ": " + r.error_message));
  Hint hint = runtime_hint(r);
  d.line("Likely cause: " + hint.cause);
  if (!r.compile_log.empty()) add_log(d, r.compile_log);
  if (!r.error_message.empty()) d.ask("fix the " + r.error_kind + " failure: " + clip(r.error_message));
  d.ask(hint.ask);
  if (r.hack()) {
    d.line("");
    d.line("Once it runs, the result would still not be trusted:");
    add_majors(d, r);
  }
}

// ---- hack, incorrect ---------------------------------------------------------------------------

void hack_feedback(Draft& d, const Report& r) {
  d.kind = "hack";
  d.line("The result cannot be trusted: the Verifier found " + std::to_string(findings_of(r, rubric::Severity::major).size()) +
         " major problem(s). Fix these before anything else:");
  add_majors(d, r);
  if (!r.correct && !r.mismatches.empty()) {
    d.line("");
    d.line("The outputs are also wrong:");
    for (const auto& m : r.mismatches) d.line("- " + m);
  }
}

/// A mismatch line of the Report split back into its parts (the format Report::mismatches documents).
struct Mismatch {
  std::string output;    ///< "output 0"
  std::string what;      ///< "812 elements outside tolerance (...)" or the problem text
  std::string at;        ///< "[0, 3]" ("" when no element is named)
  std::string expected;  ///< "1.25"
  std::string got;       ///< "0"
};

Mismatch split_mismatch(const std::string& line) {
  Mismatch m;
  std::size_t colon = line.find(": ");
  std::size_t first_at = line.find("; at ");
  if (colon == std::string::npos || (first_at != std::string::npos && colon > first_at)) {
    m.what = line;
    return m;
  }
  std::size_t space = line.find(' ', line.find(' ') + 1);  // "output 0 [64, 128]..." -> "output 0"
  m.output = line.substr(0, std::min(space, colon));
  m.what = line.substr(colon + 2, first_at == std::string::npos ? std::string::npos : first_at - colon - 2);
  if (first_at == std::string::npos) return m;
  std::string element = line.substr(first_at + 5, line.find("; at ", first_at + 5) - first_at - 5);
  std::size_t e = element.find("]: expected "), g = element.find(", got ");
  if (e == std::string::npos || g == std::string::npos || g < e) return m;
  m.at = element.substr(0, e + 1);
  m.expected = element.substr(e + 12, g - e - 12);
  m.got = element.substr(g + 6);
  return m;
}

std::optional<double> to_number(const std::string& s) {
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  double x = std::strtod(s.c_str(), &end);
  return end && *end == '\0' ? std::optional<double>(x) : std::nullopt;
}

// What the pattern of a mismatch suggests checking.
std::string mismatch_hint(const Mismatch& m) {
  auto lower = [](std::string s) {
    for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
    return s;
  };
  std::string got = lower(m.got), what = lower(m.what);
  if (got.find("nan") != std::string::npos || what.find("nan where") != std::string::npos)
    return "NaN where the reference has a number: look for uninitialized shared memory or registers, a division "
           "by zero, or exp() overflowing without subtracting the maximum";
  if (got.find("inf") != std::string::npos || what.find("inf where") != std::string::npos)
    return "an overflow: accumulate in float32, subtract the maximum before exp()";
  if (what.find("shape") != std::string::npos) return "return exactly the reference's shape";
  if (what.find("dtype") != std::string::npos) return "return the reference's dtype, without down-casting";
  auto g = to_number(m.got), e = to_number(m.expected);
  if (g && e && *g == 0.0 && *e != 0.0)
    return "a zero where a value belongs: the element was probably never written (grid not covering every "
           "element, an early return, or a wrong output offset)";
  return "check the index arithmetic (strides, transposes, which dimension is reduced), boundary handling and the "
         "accumulator's precision";
}

void incorrect_feedback(Draft& d, const Report& r) {
  d.kind = "incorrect";
  d.line("The candidate runs but its outputs are wrong" + (r.error_message.empty() ? std::string(".") : ": " + r.error_message));
  if (r.mismatches.empty()) {
    d.ask("make every output match the reference within tolerance");
    return;
  }
  d.line("Mismatches (first wrong elements):");
  for (const auto& line : r.mismatches) d.line("- " + line);
  constexpr std::size_t kMaxAsks = 3;
  for (std::size_t i = 0; i < r.mismatches.size() && i < kMaxAsks; ++i) {
    Mismatch m = split_mismatch(r.mismatches[i]);
    std::string subject = m.output.empty() ? "an output" : m.output;
    if (!m.at.empty())
      d.ask(subject + " differs at " + m.at + " (expected " + m.expected + ", got " + m.got + "): " + mismatch_hint(m));
    else
      d.ask(subject + ": " + clip(m.what) + ": " + mismatch_hint(m));
  }
}

// ---- unverified, correct, slow -----------------------------------------------------------------

void unverified_feedback(Draft& d) {
  d.kind = "unverified";
  d.line("The candidate compiled and passed the static checks, but it was not run: verification was static only "
         "(no GPU), so its results are unverified — neither correctness nor speed is known.");
  d.ask("check by reading that every output element is written and every index stays within its tensor");
}

void timed_feedback(Draft& d, const Report& r, double target) {
  bool short_of_target = target > 0.0 && r.speedup_eager && *r.speedup_eager < target;
  d.kind = short_of_target ? "slow" : "correct";
  if (r.speedup_eager || r.speedup_compile) {
    std::string s = "Correct. Speed-up:";
    if (r.speedup_eager) s += " " + speed(*r.speedup_eager) + " over eager PyTorch";
    if (r.speedup_compile) s += std::string(r.speedup_eager ? "," : "") + " " + speed(*r.speedup_compile) + " over torch.compile";
    d.line(s + ".");
  } else {
    d.line("Correct (not timed).");
  }
  if (r.speedup_eager && *r.speedup_eager < 1.0) d.line("It is slower than eager PyTorch.");
  if (short_of_target) d.line("The target is " + speed(target) + " over eager: not reached yet.");
  if (r.candidate_ms > 0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "Time per forward: %.4f ms.", r.candidate_ms);
    d.line(buf);
  }
  if (!r.bottleneck.empty()) d.line("Bottleneck: " + r.bottleneck);
  if (!r.top_kernel.empty()) d.line("Most GPU time: " + r.top_kernel + ".");

  if (!r.bottleneck.empty()) d.ask("attack the bottleneck: " + clip(r.bottleneck));
  if (!r.top_kernel.empty()) d.ask("optimize " + r.top_kernel + " first: it dominates the GPU time");
  if (r.speedup_compile && *r.speedup_compile < 1.0)
    d.ask("close the gap to torch.compile (" + speed(*r.speedup_compile) +
          "): fuse what it fuses (elementwise chains into one kernel) and run any matmuls or convolutions on "
          "tensor cores");
  if (r.bottleneck.empty() && r.top_kernel.empty())
    d.ask("cut launches by fusing operators, vectorize memory access (float4), and tile the heavy operators "
          "through shared memory or tensor cores");
}

// The model's reading of the report, appended to the deterministic text; any failure leaves that text.
void refine(Feedback& f, llm::Backend& llm, const PromptLibrary& prompts, const AgentOptions& options,
            const Problem& problem, const std::string& candidate) {
  Exchange ex;
  ex.agent = "verifier";
  ex.model = llm.name();
  ex.prompt_name = "verifier";
  try {
    auto prompt = prompts.get("verifier");
    if (!prompt) {
      ex.error = prompt.error().message;
      f.exchange = std::move(ex);
      return;
    }
    ex.prompt_sha256 = (*prompt)->sha256;
    auto text = prompts.render("verifier", {{"reference", problem.reference},
                                            {"candidate", detail::fenced_candidate(candidate)},
                                            {"report", f.text},
                                            {"hardware", problem.hardware.describe()}});
    if (!text) {
      ex.error = text.error().message;
      f.exchange = std::move(ex);
      return;
    }
    ex.messages = {llm::Message{"user", *text}};
    const auto start = std::chrono::steady_clock::now();
    auto reply = llm.complete(ex.messages, options.llm);
    ex.latency_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!reply) {
      ex.error = reply.error().message;
    } else {
      ex.reply = reply->text;
      ex.finish_reason = reply->finish_reason;
      ex.usage = reply->usage;
      if (!reply->model.empty()) ex.model = reply->model;
      if (reply->text.find_first_not_of(" \t\r\n") == std::string::npos) ex.error = "the model's reply was empty";
      else f.text += "\nDiagnosis:\n" + reply->text + (reply->text.back() == '\n' ? "" : "\n");
    }
  } catch (const std::exception& e) {  // a backend that breaks its no-throw contract
    ex.error = std::string("the model call threw: ") + e.what();
  } catch (...) {
    ex.error = "the model call threw an unknown exception";
  }
  f.exchange = std::move(ex);
}

}  // namespace

VerifierAgent::VerifierAgent(std::shared_ptr<llm::Backend> llm, std::shared_ptr<const PromptLibrary> prompts,
                             AgentOptions options)
    : llm_(std::move(llm)), prompts_(std::move(prompts)), options_(std::move(options)) {}

Feedback VerifierAgent::feedback(const Problem& problem, const std::string& candidate, const Report& report,
                                 double target_speedup) const {
  // Precedence: what stops the candidate earliest is what the Coder must fix first.
  Draft d;
  bool runtime = is_runtime_kind(report.error_kind);
  if (!runtime && (!report.compiled || report.error_kind == "compile")) compile_feedback(d, report);
  else if (runtime) runtime_feedback(d, report);
  else if (report.hack()) hack_feedback(d, report);
  else if (report.static_only) unverified_feedback(d);
  else if (!report.correct) incorrect_feedback(d, report);
  else timed_feedback(d, report, target_speedup);
  add_minors(d, report);
  Feedback f = std::move(d).finish();
  if (llm_ && prompts_) refine(f, *llm_, *prompts_, options_, problem, candidate);
  return f;
}

}  // namespace stitchcuda::agents
