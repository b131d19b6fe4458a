// The four deterministic detectors: anti-hacking (Verifier findings), CUDA engineering (source
// techniques and launch counts), operator coverage (share of reference GPU time) and skill compliance
// (a keyword heuristic over plan steps or feedback asks). Thresholds are documented in docs/rubric.md.
#include <stitchcuda/rubric.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <optional>
#include <set>
#include <sstream>

#include "scan.hpp"

namespace stitchcuda::rubric {
namespace {

std::string format_share(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f%%", 100.0 * x);
  return buf;
}

// Score of a fraction in [0, 1]: the same ladder for coverage and compliance.
int ladder(double fraction) {
  if (fraction >= 0.9) return 5;
  if (fraction >= 0.7) return 4;
  if (fraction >= 0.5) return 3;
  if (fraction >= 0.25) return 2;
  return 1;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

// ---- anti-hacking -------------------------------------------------------------------------------

Item score_anti_hacking(const Input& input) {
  Item item{Dimension::anti_hacking, 5, "no Verifier findings.", {}};
  int major = 0, minor = 0;
  std::set<std::pair<std::string, std::string>> seen;  // the same finding twice is one finding
  for (const Finding& f : input.outcome.findings) {
    if (!seen.emplace(f.rule, f.evidence).second) continue;
    (f.severity == Severity::major ? major : minor) += 1;
    item.evidence.push_back(std::string(to_string(f.severity)) + " " + f.rule +
                            (f.evidence.empty() ? "" : ": " + f.evidence));
  }
  if (major > 0) {
    item.score = 1;
    item.reason = std::to_string(major) + " major finding(s): the result cannot be trusted.";
  } else if (minor > 0) {
    item.score = std::max(2, 5 - minor);
    item.reason = std::to_string(minor) + " minor finding(s), no major one.";
  }
  return item;
}

// ---- CUDA engineering ----------------------------------------------------------------------------

Item score_cuda_engineering(const Input& input) {
  Item item{Dimension::cuda_engineering, 1, "", {}};
  const Techniques found = detect_techniques(input.candidate.cuda);
  if (found.kernels == 0) {
    item.reason = "no __global__ kernel in the candidate's CUDA.";
    return item;
  }
  std::vector<std::string> names;
  for (const Sighting& s : found.sightings) {
    names.push_back(to_string(s.technique));
    item.evidence.push_back(s.describe());
  }
  const Facts& facts = input.facts;
  if (facts.reference_launches && facts.candidate_launches) {
    const std::string counts = std::to_string(*facts.candidate_launches) + " launches per forward against the reference's " +
                               std::to_string(*facts.reference_launches);
    if (*facts.candidate_launches < *facts.reference_launches) {
      names.push_back(to_string(Technique::fused_launches));
      item.evidence.push_back(std::string(to_string(Technique::fused_launches)) + ": " + counts);
    } else {
      item.evidence.push_back("not fused: " + counts);
    }
  }
  for (const KernelAttributes& k : facts.kernels) {
    std::string line = "kernel " + k.name + ": " + std::to_string(k.registers) + " registers, " +
                       std::to_string(k.shared_bytes) + " bytes shared";
    // 255 is the per-thread cap: the compiler spilled or is about to.
    if (k.registers >= 255) line += " (at the register cap: likely spills)";
    item.evidence.push_back(line);
  }
  const int n = static_cast<int>(names.size());
  item.score = std::min(5, 1 + n);
  if (n == 0) {
    item.reason = "custom kernels, but none of the techniques the rubric looks for (a naive kernel).";
  } else {
    std::string list;
    for (std::size_t k = 0; k < names.size(); ++k) list += (k ? ", " : "") + names[k];
    item.reason = std::to_string(n) + " technique(s): " + list + ".";
  }
  return item;
}

// ---- operator coverage ---------------------------------------------------------------------------

Item score_operator_coverage(const Input& input) {
  Item item{Dimension::operator_coverage, 3, "", {}};
  double total = 0.0, covered = 0.0;
  const OperatorShare* heaviest = nullptr;
  for (const OperatorShare& op : input.facts.operators) {
    if (!std::isfinite(op.share) || op.share < 0) {
      item.evidence.push_back("ignored " + op.op + ": share is not a non-negative number");
      continue;
    }
    total += op.share;
    if (op.covered) covered += op.share;
    if (!heaviest || op.share > heaviest->share) heaviest = &op;
  }
  if (total <= 0.0) {
    item.reason = "no operator profile of the reference: neutral.";
    if (detect_techniques(input.candidate.cuda).kernels == 0) {
      item.score = 1;
      item.reason = "no custom kernel covers any operator.";
    }
    return item;
  }
  const double fraction = covered / total;
  for (const OperatorShare& op : input.facts.operators)
    if (std::isfinite(op.share) && op.share >= 0)
      item.evidence.push_back(op.op + " " + format_share(op.share / total) + (op.covered ? " covered" : " not covered"));
  item.score = ladder(fraction);
  item.reason = "custom kernels serve " + format_share(fraction) + " of the reference's GPU time";
  if (heaviest && !heaviest->covered) item.reason += "; the heaviest operator (" + heaviest->op + ") is not covered";
  item.reason += ".";
  return item;
}

// ---- skill compliance ----------------------------------------------------------------------------

namespace {

// Phrases of plan steps and feedback that name a technique (matched at a word start, lower case).
struct Phrase {
  const char* text;
  Technique technique;
};
constexpr Phrase kPhrases[] = {
    {"shared memory", Technique::shared_tiling}, {"shared-memory", Technique::shared_tiling},
    {"smem", Technique::shared_tiling},          {"tiling", Technique::shared_tiling},
    {"tiled", Technique::shared_tiling},         {"tile", Technique::shared_tiling},
    {"vectoriz", Technique::vectorized},         {"vector load", Technique::vectorized},
    {"vector access", Technique::vectorized},    {"float4", Technique::vectorized},
    {"int4", Technique::vectorized},             {"half2", Technique::vectorized},
    {"128-bit", Technique::vectorized},          {"__ldg", Technique::vectorized},
    {"tensor core", Technique::tensor_cores},    {"tensor-core", Technique::tensor_cores},
    {"wmma", Technique::tensor_cores},           {"wgmma", Technique::tensor_cores},
    {"mma", Technique::tensor_cores},            {"cp.async", Technique::async_copies},
    {"async cop", Technique::async_copies},      {"asynchronous cop", Technique::async_copies},
    {"memcpy_async", Technique::async_copies},   {"tma", Technique::async_copies},
    {"bulk cop", Technique::async_copies},       {"warp shuffle", Technique::warp_shuffles},
    {"shuffle", Technique::warp_shuffles},       {"shfl", Technique::warp_shuffles},
    {"warp-level", Technique::warp_shuffles},    {"warp reduc", Technique::warp_shuffles},
    {"fuse", Technique::fused_launches},         {"fusing", Technique::fused_launches},
    {"fusion", Technique::fused_launches},       {"single kernel", Technique::fused_launches},
    {"one kernel", Technique::fused_launches},
};

// Words that carry no checkable content in a plan step or an ask.
const std::set<std::string, std::less<>> kStopWords = {
    "the", "and", "with", "into", "from", "that", "this", "these", "those", "each", "use", "uses", "using",
    "implement", "implementation", "write", "kernel", "kernels", "cuda", "custom", "compute", "computes",
    "output", "outputs", "input", "inputs", "tensor", "tensors", "then", "than", "for", "per", "over",
    "make", "should", "will", "step", "instead", "avoid", "all", "any", "via", "its", "their", "them",
    "memory", "shared", "launch", "launches", "warp", "warps", "block", "blocks", "thread", "threads",
    "fast", "faster", "efficient", "optimize", "optimise", "improve", "keep", "when", "where", "which",
    "one", "two", "only", "also", "same", "other", "there", "here", "more", "less", "time", "operation",
    "operations", "load", "loads", "store", "stores", "access", "accesses", "single", "async", "asynchronous",
    "copy", "copies", "core", "cores", "level", "bit", "add", "adds", "call", "calls", "bottleneck",
    "result", "results", "value", "values", "data", "both", "after", "before", "does", "done", "through",
    "across", "within", "without", "while", "like", "such", "must", "need", "needs", "every", "everything",
    "possible", "better", "first", "next", "rather", "what", "work"};

// Repair asks are judged by the outcome, not by words in the code.
constexpr const char* kRepairWords[] = {"fix", "error", "bug", "mismatch", "incorrect", "wrong", "crash",
                                         "compile", "nan", "out-of-bounds", "out of bounds", "illegal",
                                         "segfault", "race", "uninitiali", "fail", "repair"};

bool at_word_start(const std::string& text, std::size_t pos) {
  return pos == 0 || !(std::isalnum(static_cast<unsigned char>(text[pos - 1])) || text[pos - 1] == '_');
}

bool has_phrase(const std::string& text, std::string_view phrase) {
  for (std::size_t pos = text.find(phrase); pos != std::string::npos; pos = text.find(phrase, pos + 1))
    if (at_word_start(text, pos)) return true;
  return false;
}

// Lower-case words (letters, digits, '_') of at least four characters that are no stop words and
// no part of a technique phrase the text contains.
std::vector<std::string> content_words(const std::string& text) {
  std::set<std::string> phrase_words;
  for (const Phrase& p : kPhrases)
    if (has_phrase(text, p.text)) {
      std::string word;
      for (char c : std::string(p.text) + " ") {
        if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') word += c;
        else if (!word.empty()) phrase_words.insert(std::exchange(word, {}));
      }
    }
  std::vector<std::string> out;
  std::string word;
  auto flush = [&] {
    const bool technique_word = std::any_of(phrase_words.begin(), phrase_words.end(), [&](const std::string& p) {
      return word.compare(0, p.size(), p) == 0;  // "tiles" is the phrase "tile"
    });
    if (word.size() >= 4 && !kStopWords.count(word) && !technique_word &&
        std::find(out.begin(), out.end(), word) == out.end() &&
        !std::isdigit(static_cast<unsigned char>(word[0])))
      out.push_back(word);
    word.clear();
  };
  for (char c : text) {
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') word += c;
    else flush();
  }
  flush();
  return out;
}

// The candidate's code as the heuristic reads it: comments and literals blanked, lower case.
struct Code {
  std::string all;     // every stripped source, joined
  std::string fresh;   // only lines absent from the previous candidate (all of it when unknown)
  bool changed = true; // differs from the previous candidate (true when unknown)
};

std::vector<std::string> stripped_lines(const Candidate& c) {
  std::vector<std::string> lines;
  auto add = [&](const std::string& clean) {
    std::istringstream in(lower(clean));
    for (std::string line; std::getline(in, line);) {
      const auto first = line.find_first_not_of(" \t\r");
      if (first == std::string::npos) continue;
      lines.push_back(line.substr(first, line.find_last_not_of(" \t\r") - first + 1));
    }
  };
  for (const std::string& cuda : c.cuda) add(strip_cuda(cuda));
  add(strip_python(c.python));
  return lines;
}

Code read_code(const Candidate& now, const Candidate& previous) {
  Code code;
  const auto lines = stripped_lines(now);
  const bool known_previous = !previous.cuda.empty() || !previous.python.empty();
  const auto before = stripped_lines(previous);
  const std::set<std::string> old(before.begin(), before.end());
  for (const std::string& line : lines) {
    code.all += line + "\n";
    if (!known_previous || !old.count(line)) code.fresh += line + "\n";
  }
  if (known_previous) code.changed = lines != before;
  return code;
}

enum class Verdict { followed, missed, unverifiable };

struct Check {
  Verdict verdict = Verdict::unverifiable;
  std::string why;
};

// An ask (or step) is missed when a technique it names is absent (one the facts cannot show is
// skipped); met when a named technique is present; otherwise met when at least half of its content
// words occur in `haystack`, and unverifiable when it has none.
Check check_ask(const std::string& ask, const Techniques& techniques, const Facts& facts, const std::string& haystack) {
  const std::string text = lower(ask);
  std::set<Technique> named;
  for (const Phrase& p : kPhrases)
    if (has_phrase(text, p.text)) named.insert(p.technique);
  int detected = 0;
  for (Technique t : named) {
    bool present;
    if (t == Technique::fused_launches) {
      if (!facts.reference_launches || !facts.candidate_launches) continue;  // unknown: skip
      present = *facts.candidate_launches < *facts.reference_launches;
    } else {
      present = techniques.has(t);
    }
    if (!present) return {Verdict::missed, std::string(to_string(t)) + " not found"};
    ++detected;
  }
  // The technique is the checkable content of such a step; its prose ("partial sums") rarely is code.
  if (detected > 0) return {Verdict::followed, std::to_string(detected) + " named technique(s) found"};
  const auto words = content_words(text);
  if (words.empty()) return {Verdict::unverifiable, "nothing checkable"};
  std::vector<std::string> found, missing;
  for (const std::string& w : words) (haystack.find(w) != std::string::npos ? found : missing).push_back(w);
  std::string why = std::to_string(found.size()) + "/" + std::to_string(words.size()) + " keywords";
  if (!missing.empty()) {
    why += " (missing:";
    for (const auto& m : missing) why += " " + m;
    why += ")";
  }
  return {2 * found.size() >= words.size() ? Verdict::followed : Verdict::missed, why};
}

bool is_repair(const std::string& ask) {
  const std::string text = lower(ask);
  return std::any_of(std::begin(kRepairWords), std::end(kRepairWords),
                     [&](const char* w) { return has_phrase(text, w); });
}

// How far a candidate got, in the order the Verifier stops it.
enum class Stage { not_compiled, failed, unverified, passed };

Stage stage_of(const VerifyOutcome& o) {
  if (!o.compiled) return Stage::not_compiled;
  if (!o.verified) return Stage::unverified;  // compiled, never run: neither failed nor passed
  return o.correct ? Stage::passed : Stage::failed;
}

bool fires(const VerifyOutcome& o, const std::string& rule) {
  return std::any_of(o.findings.begin(), o.findings.end(), [&](const Finding& f) { return f.rule == rule; });
}

// An ask about a finding of the previous candidate ("remove the [rule] problem ...") is met when the
// rule no longer fires; nothing when the ask names none of its findings.
std::optional<Check> check_finding(const std::string& ask, const VerifyOutcome& now, const VerifyOutcome& before) {
  for (const Finding& f : before.findings) {
    if (f.rule.empty() || ask.find("[" + f.rule + "]") == std::string::npos) continue;
    if (fires(now, f.rule)) return Check{Verdict::missed, "the [" + f.rule + "] finding still fires"};
    return Check{Verdict::followed, "the [" + f.rule + "] finding is gone"};
  }
  return std::nullopt;
}

// A repair ask is judged by what it repairs: the failure of the previous candidate against the new
// outcome (an unverified candidate cannot show that a run-time failure is gone). Nothing when the
// previous candidate had not failed: the ask is then read like any other.
std::optional<Check> check_repair(const VerifyOutcome& now, const std::optional<VerifyOutcome>& before) {
  const Stage after = stage_of(now);
  if (!before) {  // what failed before is unknown: only a correct candidate shows the repair
    if (after == Stage::passed) return Check{Verdict::followed, "repair: the candidate now compiles and is correct"};
    if (after == Stage::unverified)
      return Check{Verdict::unverifiable, "repair: the candidate compiles but was not run, so whether it is fixed is unknown"};
    return Check{Verdict::missed, "repair: the candidate still fails"};
  }
  switch (stage_of(*before)) {
    case Stage::not_compiled:
      if (after == Stage::not_compiled) return Check{Verdict::missed, "repair: the candidate still does not compile"};
      return Check{Verdict::followed, "repair: the candidate compiles now; it did not before"};
    case Stage::failed:
      if (after == Stage::passed) return Check{Verdict::followed, "repair: it failed when run before; now it is correct"};
      if (after == Stage::unverified)
        return Check{Verdict::unverifiable, "repair: it compiles but was not run, so whether the failure is gone is unknown"};
      if (after == Stage::failed) return Check{Verdict::missed, "repair: it still fails when run"};
      return Check{Verdict::missed, "repair: it no longer compiles (it did before)"};
    case Stage::unverified:
    case Stage::passed:
      if (after == Stage::not_compiled) return Check{Verdict::missed, "repair: it no longer compiles (it did before)"};
      if (after == Stage::failed) return Check{Verdict::missed, "repair: it now fails when run"};
      return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace

Item score_skill_compliance(const Input& input) {
  Item item{Dimension::skill_compliance, 3, "", {}};
  const Task& task = input.task;
  const bool feedback = task.skill == Skill::from_feedback;
  const char* noun = feedback ? "ask" : "plan step";
  const Techniques techniques = detect_techniques(input.candidate.cuda);
  const Code code = read_code(input.candidate, feedback ? task.previous : Candidate{});
  int followed = 0, checkable = 0;
  for (const std::string& ask : task.asks) {
    std::optional<Check> judged;
    if (feedback && !code.changed) judged = Check{Verdict::missed, "the candidate is unchanged"};
    if (!judged && feedback && task.previous_outcome) judged = check_finding(ask, input.outcome, *task.previous_outcome);
    if (!judged && feedback && is_repair(ask)) judged = check_repair(input.outcome, task.previous_outcome);
    const Check check = judged ? *judged : check_ask(ask, techniques, input.facts, feedback ? code.fresh : code.all);
    const char* mark = check.verdict == Verdict::followed ? "followed" : check.verdict == Verdict::missed ? "missed" : "unverifiable";
    item.evidence.push_back(std::string(mark) + ": \"" + ask + "\" (" + check.why + ")");
    if (check.verdict == Verdict::unverifiable) continue;
    ++checkable;
    if (check.verdict == Verdict::followed) ++followed;
  }
  if (checkable == 0) {
    item.reason = std::string("no checkable ") + noun + ": neutral.";
    return item;
  }
  item.score = ladder(static_cast<double>(followed) / checkable);
  item.reason = std::to_string(followed) + " of " + std::to_string(checkable) + " " + noun + "s " +
                (feedback ? "addressed" : "followed") + ".";
  return item;
}

}  // namespace stitchcuda::rubric
