// Report: the part of a Verifier's verdict (Python's VerifyReport.to_json()) the agents read, with the
// bad outputs and the profile turned into the sentences feedback quotes; and the JSON Schema of that
// verdict (report_schema()), versioned so that a reader never guesses at a format it does not know.
#include <stitchcuda/agents.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

namespace stitchcuda::agents {
namespace {

using Json = nlohmann::json;

// The report format this reader understands; Python's stitchcuda.verify.report.SCHEMA_VERSION writes it.
constexpr int kSchemaVersion = 1;

// A missing key, a null and a value of another type all read as "not given": a report written by an
// older or newer Verifier still yields what it has.
const Json* member(const Json& object, const char* key) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(key);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

bool get_bool(const Json& object, const char* key) {
  const Json* v = member(object, key);
  return v && v->is_boolean() && v->get<bool>();
}

std::string get_string(const Json& object, const char* key) {
  const Json* v = member(object, key);
  return v && v->is_string() ? v->get<std::string>() : std::string();
}

std::optional<double> get_number(const Json& object, const char* key) {
  const Json* v = member(object, key);
  if (!v || !v->is_number()) return std::nullopt;
  double x = v->get<double>();
  return std::isfinite(x) ? std::optional<double>(x) : std::nullopt;
}

// "%.6g": enough digits to compare values, none of the float32-to-double noise (0.10000000149011612).
std::string format_number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

// A scalar of a first_mismatches entry as the Verifier wrote it: numbers, or "nan"/"inf" strings.
std::string value_text(const Json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return v.dump();
  if (v.is_number()) return format_number(v.get<double>());
  return v.dump();
}

// "[64, 128]" for a shape or an element index.
std::string list_text(const Json* list) {
  std::string out = "[";
  if (list && list->is_array())
    for (std::size_t i = 0; i < list->size(); ++i) out += (i ? ", " : "") + value_text((*list)[i]);
  return out + "]";
}

// One sentence per bad output: "output 0 [64, 128] float32: 812 elements outside tolerance (max abs err
// 0.5, max rel err 1); at [0, 3]: expected 1.25, got 0".
std::string describe_output(const Json& o) {
  const Json* index = member(o, "index");
  std::string text = "output " + (index ? value_text(*index) : std::string("?")) + " " + list_text(member(o, "shape"));
  if (std::string dtype = get_string(o, "dtype"); !dtype.empty()) text += " " + dtype;
  text += ": ";
  if (std::string problem = get_string(o, "problem"); !problem.empty()) {
    text += problem;
  } else {
    const Json* count = member(o, "mismatches");
    if (count && count->is_number() && count->get<double>() > 0) {
      text += value_text(*count) + " elements outside tolerance";
      std::string errs;
      if (auto abs = get_number(o, "max_abs_err")) errs = "max abs err " + format_number(*abs);
      if (auto rel = get_number(o, "max_rel_err")) errs += (errs.empty() ? "" : ", ") + ("max rel err " + format_number(*rel));
      if (!errs.empty()) text += " (" + errs + ")";
    } else {
      text += "differs from the reference";
    }
  }
  if (const Json* first = member(o, "first_mismatches"); first && first->is_array()) {
    for (const Json& m : *first) {
      const Json* expected = member(m, "expected");
      const Json* got = member(m, "got");
      text += "; at " + list_text(member(m, "index")) + ": expected " + (expected ? value_text(*expected) : "null") +
              ", got " + (got ? value_text(*got) : "null");
    }
  }
  return text;
}

// The kernel with the largest share: "k_gelu (71% of GPU time)".
std::string top_kernel_text(const Json& profile) {
  const Json* kernels = member(profile, "kernels");
  if (!kernels || !kernels->is_array()) return "";
  const Json* best = nullptr;
  double best_share = -1.0;
  for (const Json& k : *kernels) {
    if (get_string(k, "name").empty()) continue;
    double share = get_number(k, "share").value_or(0.0);
    if (!best || share > best_share) best = &k, best_share = share;
  }
  if (!best) return "";
  std::string text = get_string(*best, "name");
  if (get_number(*best, "share")) text += " (" + std::to_string(std::lround(best_share * 100.0)) + "% of GPU time)";
  return text;
}

// The profile's diagnosis: its "bottleneck" sentence, else the summary's "diagnosis" (a sentence or a
// list of them).
std::string bottleneck_text(const Json& profile) {
  if (std::string b = get_string(profile, "bottleneck"); !b.empty()) return b;
  const Json* summary = member(profile, "summary");
  const Json* diagnosis = summary ? member(*summary, "diagnosis") : nullptr;
  if (!diagnosis) return "";
  if (diagnosis->is_string()) return diagnosis->get<std::string>();
  std::string out;
  if (diagnosis->is_array())
    for (const Json& d : *diagnosis)
      if (d.is_string() && !d.get<std::string>().empty()) out += (out.empty() ? "" : "; ") + d.get<std::string>();
  return out;
}

}  // namespace

bool Report::hack() const {
  return std::any_of(findings.begin(), findings.end(),
                     [](const rubric::Finding& f) { return f.severity == rubric::Severity::major; });
}

Result<Report> Report::from_json(std::string_view json) {
  Json j;
  try {
    j = Json::parse(json);
  } catch (const Json::parse_error& e) {
    // e.what() names the line and column; byte is the offset for tools that want it.
    return fail(ErrorCode::InvalidArgument,
                "the Verifier's report is not valid JSON (at byte " + std::to_string(e.byte) + "): " + e.what());
  }
  if (!j.is_object())
    return fail(ErrorCode::InvalidArgument,
                std::string("the Verifier's report must be a JSON object, not ") + j.type_name());

  // The version first: every other key is read leniently (absent = not given), which is only safe for
  // a format whose meaning is known. A report without one predates the versioned format.
  const auto version = j.find("schema_version");
  if (version == j.end() || version->is_null())
    return fail(ErrorCode::InvalidArgument,
                "the Verifier's report has no schema_version; this reader reads schema_version " +
                    std::to_string(kSchemaVersion) + " (written by stitchcuda.verify's VerifyReport.to_json())");
  if (!version->is_number_integer())
    return fail(ErrorCode::InvalidArgument, "the Verifier's report has schema_version " + version->dump() +
                                                ", not an integer; this reader reads schema_version " +
                                                std::to_string(kSchemaVersion));
  if (version->get<long long>() != kSchemaVersion)
    return fail(ErrorCode::InvalidArgument, "the Verifier's report has schema_version " + version->dump() +
                                                "; this reader reads schema_version " + std::to_string(kSchemaVersion) +
                                                " only (update StitchCUDA's C++ side and Python side together)");

  Report r;
  r.json = std::string(json);
  r.compiled = get_bool(j, "compiled");
  r.correct = get_bool(j, "correct");
  r.static_only = get_bool(j, "static_only");
  r.wall_s = get_number(j, "wall_s").value_or(0.0);
  r.compile_log = get_string(j, "compile_log");
  if (const Json* speedup = member(j, "speedup")) {
    r.speedup_eager = get_number(*speedup, "eager");
    r.speedup_compile = get_number(*speedup, "compile");
  }
  if (const Json* timing = member(j, "timing")) r.candidate_ms = get_number(*timing, "candidate_ms").value_or(0.0);
  if (const Json* error = member(j, "error")) {
    r.error_kind = get_string(*error, "kind");
    r.error_message = get_string(*error, "message");
  }
  if (const Json* findings = member(j, "findings"); findings && findings->is_array()) {
    for (const Json& f : *findings) {
      if (!f.is_object()) continue;
      rubric::Finding finding;
      finding.rule = get_string(f, "rule");
      // The Verifier writes only "major" and "minor"; anything else is not a reason to reject the candidate.
      finding.severity = rubric::severity_from_string(get_string(f, "severity")).value_or(rubric::Severity::minor);
      finding.evidence = get_string(f, "evidence");
      r.findings.push_back(std::move(finding));
      r.finding_messages.push_back(get_string(f, "message"));
      auto line = get_number(f, "line");
      r.finding_lines.push_back(line && *line > 0 ? static_cast<int>(*line) : 0);
    }
  }
  if (const Json* outputs = member(j, "outputs"); outputs && outputs->is_array())
    for (const Json& o : *outputs)
      if (const Json* ok = member(o, "ok"); ok && ok->is_boolean() && !ok->get<bool>())
        r.mismatches.push_back(describe_output(o));
  if (const Json* profile = member(j, "profile"); profile && profile->is_object()) {
    r.top_kernel = top_kernel_text(*profile);
    r.bottleneck = bottleneck_text(*profile);
  }
  return r;
}

const std::string& report_schema() {
  // Kept in step with Python's VerifyReport.to_dict() (tests/python/test_judge.py validates a real
  // report against it) and with from_json above, which reads a subset of these keys.
  static const std::string schema = R"({
  "$schema": "http://json-schema.org/draft-07/schema#",
  "$id": "stitchcuda.verify_report/1",
  "title": "StitchCUDA Verifier report",
  "description": "What stitchcuda.verify.check() concluded about one candidate (VerifyReport.to_json()).",
  "type": "object",
  "required": ["schema_version", "compiled", "correct", "hack", "findings", "outputs", "speedup", "timing",
               "profile", "error", "feedback", "compile_log", "trials", "static_only", "wall_s"],
  "properties": {
    "schema_version": {"const": 1, "description": "The format's version; readers refuse any other."},
    "compiled": {"type": "boolean", "description": "The candidate loaded and its kernels compiled."},
    "correct": {"type": "boolean", "description": "Every correctness trial passed."},
    "hack": {"type": "boolean", "description": "Any finding of severity major."},
    "findings": {
      "type": "array",
      "items": {
        "type": "object",
        "required": ["rule", "severity", "message"],
        "properties": {
          "rule": {"type": "string"},
          "severity": {"enum": ["major", "minor"]},
          "message": {"type": "string"},
          "line": {"type": ["integer", "null"], "description": "Line in the candidate file."},
          "evidence": {"type": "string"}
        }
      }
    },
    "outputs": {
      "type": "array",
      "items": {
        "type": "object",
        "required": ["index", "shape", "dtype", "ok"],
        "properties": {
          "index": {"type": "integer"},
          "shape": {"type": "array", "items": {"type": "integer"}},
          "dtype": {"type": "string"},
          "ok": {"type": "boolean"},
          "max_abs_err": {"type": ["number", "null"]},
          "max_rel_err": {"type": ["number", "null"]},
          "mismatches": {"type": "integer", "minimum": 0},
          "err_vs_fp64": {"type": ["number", "null"]},
          "reference_err_vs_fp64": {"type": ["number", "null"]},
          "first_mismatches": {
            "type": "array",
            "items": {
              "type": "object",
              "required": ["index", "expected", "got"],
              "properties": {"index": {"type": "array", "items": {"type": "integer"}},
                             "expected": {"type": ["number", "string", "boolean"]},
                             "got": {"type": ["number", "string", "boolean"]}}
            }
          },
          "problem": {"type": "string"}
        }
      }
    },
    "speedup": {
      "type": "object",
      "required": ["eager", "compile"],
      "properties": {"eager": {"type": ["number", "null"]}, "compile": {"type": ["number", "null"]}}
    },
    "timing": {
      "type": "object",
      "description": "Measurements (ms): candidate_ms, eager_ms, compile_ms, speed_of_light_ms...",
      "properties": {"candidate_ms": {"type": "number"}, "eager_ms": {"type": "number"},
                     "compile_ms": {"type": "number"}, "speed_of_light_ms": {"type": "number"}}
    },
    "profile": {"type": ["object", "null"]},
    "error": {
      "type": ["object", "null"],
      "required": ["kind", "message"],
      "properties": {
        "kind": {"enum": ["load", "compile", "runtime", "crash", "timeout", "oom", "illegal-address",
                          "device-assert", "incorrect", "bad-reference", "bad-candidate"]},
        "message": {"type": "string"}
      }
    },
    "feedback": {"type": "string"},
    "compile_log": {"type": "string"},
    "trials": {"type": "array", "items": {"type": "object"}},
    "static_only": {"type": "boolean", "description": "Compiled and checked statically only: unverified."},
    "wall_s": {"type": "number", "minimum": 0}
  }
})";
  return schema;
}

rubric::VerifyOutcome Report::outcome() const {
  rubric::VerifyOutcome o;
  o.compiled = compiled;
  o.correct = correct;
  o.speedup = speedup_eager.value_or(0.0);
  o.findings = findings;
  return o;
}

}  // namespace stitchcuda::agents
