// The Planner's ProblemPlan: its JSON Schema, parsing from a model's reply (prose and fences around the object
// are tolerated) with every schema violation reported at once, and its text for prompts. Also the
// hardware description the Planner reads.
#include <stitchcuda/agents.hpp>

#include <algorithm>
#include <cstdio>
#include <optional>

#include <nlohmann/json.hpp>

namespace stitchcuda::agents {
namespace {

using nlohmann::json;

/// A balanced `{...}` region of the text: where it starts and one past its end (npos: never closed).
struct Region {
  std::size_t begin = 0;
  std::size_t end = std::string_view::npos;
};

/// The balanced object starting at `begin` (a '{'); braces inside JSON strings do not count.
Region balanced(std::string_view text, std::size_t begin) {
  int depth = 0;
  bool in_string = false;
  for (std::size_t i = begin; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{') {
      ++depth;
    } else if (c == '}' && --depth == 0) {
      return {begin, i + 1};
    }
  }
  return {begin, std::string_view::npos};
}

/// 1-based line and column of byte `offset` in `text`.
std::string position(std::string_view text, std::size_t offset) {
  offset = std::min(offset, text.size());
  std::size_t line = 1, column = 1;
  for (std::size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') ++line, column = 1;
    else ++column;
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(column);
}

/// nlohmann's message without its "[json.exception...] parse error at line 1, column 9: " prefix, whose
/// position counts from the object rather than from the reply.
std::string parser_message(const std::string& what) {
  const std::size_t column = what.find("column ");
  const std::size_t colon = column == std::string::npos ? column : what.find(": ", column);
  return colon == std::string::npos ? what : what.substr(colon + 2);
}

/// The first balanced region of `text` that parses as a JSON object. A region that does not parse is
/// skipped whole, so an object nested in a broken plan is never taken for the plan.
Result<json> first_object(std::string_view text) {
  std::optional<Error> first_error;
  for (std::size_t at = text.find('{'); at != std::string_view::npos; at = text.find('{', at)) {
    const Region region = balanced(text, at);
    if (region.end == std::string_view::npos) {
      if (first_error) break;
      return fail(ErrorCode::InvalidArgument,
                  "plan is invalid: the JSON object starting at " + position(text, at) +
                      " of the reply is never closed (was the reply cut off?)");
    }
    const std::string_view candidate = text.substr(region.begin, region.end - region.begin);
    try {
      // Comments are tolerated: models annotate JSON with them.
      return json::parse(candidate.begin(), candidate.end(), nullptr, true, true);
    } catch (const json::parse_error& e) {
      if (!first_error) {
        const std::size_t byte = e.byte > 0 ? e.byte - 1 : 0;  // nlohmann counts from 1
        first_error = Error{ErrorCode::InvalidArgument,
                            "plan is invalid: the JSON object at " + position(text, at) +
                                " of the reply does not parse: at " + position(text, region.begin + byte) +
                                ": " + parser_message(e.what()),
                            {}, {}};
      }
    }
    at = region.end;
  }
  if (first_error) return tl::unexpected(*first_error);
  return fail(ErrorCode::InvalidArgument, "plan is invalid: the reply holds no JSON object; answer with one "
                                          "JSON object that follows the schema");
}

/// Validation with the path of each violation ("steps[1].title: missing"), all collected.
class Checker {
 public:
  std::vector<std::string> problems;

  /// A required non-empty string ("" after a violation).
  std::string text(const json& obj, const std::string& key, const std::string& path) {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) {
      problem(path, "missing");
      return "";
    }
    std::string s = optional_text(obj, key, path);
    if (it->is_string() && s.find_first_not_of(" \t\r\n") == std::string::npos) problem(path, "must not be empty");
    return s;
  }

  /// An optional string ("" when absent, null, or not a string).
  std::string optional_text(const json& obj, const std::string& key, const std::string& path) {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return "";
    if (!it->is_string()) {
      problem(path, "expected a string");
      return "";
    }
    return it->get<std::string>();
  }

  /// An optional array of strings (empty when absent or null); `non_empty` makes it required and non-empty.
  std::vector<std::string> strings(const json& obj, const std::string& key, const std::string& path,
                                   bool non_empty = false) {
    std::vector<std::string> out;
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) {
      if (non_empty) problem(path, "missing");
      return out;
    }
    const bool ok = it->is_array() && (!non_empty || !it->empty()) &&
                    std::all_of(it->begin(), it->end(), [](const json& v) { return v.is_string(); });
    if (!ok) {
      problem(path, non_empty ? "expected a non-empty array of strings" : "expected an array of strings");
      return out;
    }
    for (const auto& v : *it) out.push_back(v.get<std::string>());
    return out;
  }

  void problem(const std::string& path, const std::string& what) { problems.push_back(path + ": " + what); }
};

json to_json_value(const ProblemPlan& plan) {
  json steps = json::array(), groups = json::array();
  for (const auto& s : plan.steps) steps.push_back({{"title", s.title}, {"detail", s.detail}});
  for (const auto& g : plan.fusion_groups)
    groups.push_back({{"ops", g.ops}, {"kernel", g.kernel}, {"rationale", g.rationale}});
  return {{"summary", plan.summary},         {"steps", steps},          {"fusion_groups", groups},
          {"bottlenecks", plan.bottlenecks}, {"risks", plan.risks},     {"constraints", plan.constraints}};
}

void bullet_list(std::string& out, const char* heading, const std::vector<std::string>& items) {
  if (items.empty()) return;
  out += std::string("\n") + heading + ":\n";
  for (const auto& item : items) out += "- " + item + "\n";
}

std::string number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", x);
  return buf;
}

}  // namespace

std::string ProblemPlan::to_json() const { return to_json_value(*this).dump(2); }

std::string ProblemPlan::describe() const {
  std::string out = "Summary: " + summary + "\n\nSteps:\n";
  for (std::size_t i = 0; i < steps.size(); ++i) {
    out += std::to_string(i + 1) + ". " + steps[i].title + "\n";
    if (!steps[i].detail.empty()) out += "   " + steps[i].detail + "\n";
  }
  if (!fusion_groups.empty()) {
    out += "\nFusion groups (one kernel each):\n";
    for (const auto& g : fusion_groups) {
      std::string ops;
      for (const auto& op : g.ops) ops += (ops.empty() ? "" : " + ") + op;
      out += "- " + ops;
      if (!g.kernel.empty()) out += " -> " + g.kernel;
      if (!g.rationale.empty()) out += " (" + g.rationale + ")";
      out += "\n";
    }
  }
  bullet_list(out, "Expected bottlenecks", bottlenecks);
  bullet_list(out, "Risks", risks);
  bullet_list(out, "Constraints", constraints);
  return out;
}

Result<ProblemPlan> ProblemPlan::parse(std::string_view text) {
  auto parsed = first_object(text);
  if (!parsed) return tl::unexpected(parsed.error());
  const json& root = *parsed;
  Checker check;
  ProblemPlan plan;
  plan.summary = check.text(root, "summary", "summary");

  auto steps = root.find("steps");
  if (steps == root.end() || steps->is_null()) {
    check.problem("steps", "missing");
  } else if (!steps->is_array() || steps->empty()) {
    check.problem("steps", "expected a non-empty array of {title, detail} objects");
  } else {
    for (std::size_t i = 0; i < steps->size(); ++i) {
      const std::string path = "steps[" + std::to_string(i) + "]";
      const json& step = (*steps)[i];
      if (!step.is_object()) {
        check.problem(path, "expected an object with title and detail");
        continue;
      }
      plan.steps.push_back({check.text(step, "title", path + ".title"), check.optional_text(step, "detail", path + ".detail")});
    }
  }

  if (auto groups = root.find("fusion_groups"); groups != root.end() && !groups->is_null()) {
    if (!groups->is_array()) {
      check.problem("fusion_groups", "expected an array of {ops, kernel, rationale} objects");
    } else {
      for (std::size_t i = 0; i < groups->size(); ++i) {
        const std::string path = "fusion_groups[" + std::to_string(i) + "]";
        const json& group = (*groups)[i];
        if (!group.is_object()) {
          check.problem(path, "expected an object with ops, kernel and rationale");
          continue;
        }
        FusionGroup g;
        g.ops = check.strings(group, "ops", path + ".ops", true);
        g.kernel = check.optional_text(group, "kernel", path + ".kernel");
        g.rationale = check.optional_text(group, "rationale", path + ".rationale");
        plan.fusion_groups.push_back(std::move(g));
      }
    }
  }
  plan.bottlenecks = check.strings(root, "bottlenecks", "bottlenecks");
  plan.risks = check.strings(root, "risks", "risks");
  plan.constraints = check.strings(root, "constraints", "constraints");

  if (!check.problems.empty()) {
    std::string message = "plan is invalid: ";
    for (std::size_t i = 0; i < check.problems.size(); ++i) message += (i ? "; " : "") + check.problems[i];
    return fail(ErrorCode::InvalidArgument, message);
  }
  return plan;
}

const std::string& problem_plan_schema() {
  // Kept in step with ProblemPlan::parse: what the schema requires, parse reports when absent.
  static const std::string schema = R"({
  "$schema": "http://json-schema.org/draft-07/schema#",
  "title": "StitchCUDA optimization plan",
  "type": "object",
  "required": ["summary", "steps"],
  "properties": {
    "summary": {
      "type": "string", "minLength": 1, "pattern": "\\S",
      "description": "One paragraph: where the reference spends its time and the strategy to cut it."
    },
    "steps": {
      "type": "array", "minItems": 1,
      "description": "Ordered implementation steps.",
      "items": {
        "type": "object",
        "required": ["title"],
        "properties": {
          "title": {"type": "string", "minLength": 1, "pattern": "\\S", "description": "What to do, in one line."},
          "detail": {"type": "string", "description": "How: kernel structure, tiling, memory access, library calls."}
        }
      }
    },
    "fusion_groups": {
      "type": "array",
      "description": "Reference operators that one kernel (or one library call with an epilogue) computes together.",
      "items": {
        "type": "object",
        "required": ["ops"],
        "properties": {
          "ops": {"type": "array", "minItems": 1, "items": {"type": "string"}, "description": "Operators, in order."},
          "kernel": {"type": "string", "description": "The kernel's name or the library call."},
          "rationale": {"type": "string", "description": "Why fusing pays: bytes and launches saved."}
        }
      }
    },
    "bottlenecks": {"type": "array", "items": {"type": "string"}, "description": "What is expected to limit the result."},
    "risks": {"type": "array", "items": {"type": "string"}, "description": "Correctness risks: numerics, aliasing, shapes."},
    "constraints": {"type": "array", "items": {"type": "string"}, "description": "What must hold: dtypes, layouts, semantics."}
  }
})";
  return schema;
}

std::string Hardware::describe() const {
  std::string out = "GPU: " + gpu;
  if (!arch.empty()) out += " (" + arch + ")";
  if (sms > 0) out += ", " + std::to_string(sms) + " SMs";
  if (memory_gib > 0) out += ", " + number(memory_gib) + " GiB memory";
  out += "\n";
  std::vector<std::string> peaks;
  if (dram_tb_s > 0) peaks.push_back("DRAM " + number(dram_tb_s) + " TB/s");
  if (fp32_tflops > 0) peaks.push_back("FP32 " + number(fp32_tflops) + " TFLOP/s");
  if (tf32_tflops > 0) peaks.push_back("TF32 tensor cores " + number(tf32_tflops) + " TFLOP/s (dense)");
  if (!peaks.empty()) {
    out += "Peaks:";
    for (std::size_t i = 0; i < peaks.size(); ++i) out += (i ? ", " : " ") + peaks[i];
    out += "\n";
  }
  // The ridge point tells the Planner which kernels are memory-bound before any profile exists.
  if (dram_tb_s > 0 && fp32_tflops > 0)
    out += "FP32 kernels below " + number(fp32_tflops / dram_tb_s) + " FLOP/byte are memory-bound\n";
  if (!cuda.empty()) out += "CUDA " + cuda + "\n";
  return out;
}

}  // namespace stitchcuda::agents
