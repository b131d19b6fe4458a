// Bindings of the rubric layer: dictionaries in, dictionaries out (python/stitchcuda/rubric.py wraps them).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stitchcuda/rubric.hpp>

#include "errors.hpp"

namespace py = pybind11;

namespace stitchcuda::bindings {
namespace {

using namespace stitchcuda::rubric;

template <class T>
T get(const py::dict& d, const char* key, T fallback) {
  return d.contains(key) && !d[key].is_none() ? d[key].cast<T>() : fallback;
}

Candidate candidate_of(const py::dict& d) {
  Candidate c;
  c.cuda = get<std::vector<std::string>>(d, "cuda", {});
  c.python = get<std::string>(d, "python", "");
  return c;
}

VerifyOutcome outcome_of(const py::dict& d) {
  VerifyOutcome o;
  o.compiled = get<bool>(d, "compiled", false);
  o.correct = get<bool>(d, "correct", false);
  o.speedup = get<double>(d, "speedup", 0.0);
  // false: compiled and checked statically, never run (no GPU): the reward says "unverified".
  o.verified = get<bool>(d, "verified", true);
  if (d.contains("findings"))
    for (auto f : d["findings"].cast<py::list>()) {
      auto fd = f.cast<py::dict>();
      Finding finding;
      finding.rule = get<std::string>(fd, "rule", "");
      auto severity = severity_from_string(get<std::string>(fd, "severity", "minor"));
      if (!severity) throw_error(Error{ErrorCode::InvalidArgument, "finding '" + finding.rule + "': severity must be 'major' or 'minor'"});
      finding.severity = *severity;
      finding.evidence = get<std::string>(fd, "evidence", "");
      o.findings.push_back(std::move(finding));
    }
  return o;
}

Skill skill_of(int s) {
  if (s != 1 && s != 2) throw_error(Error{ErrorCode::InvalidArgument, "skill must be 1 (from the plan) or 2 (from feedback)"});
  return s == 1 ? Skill::from_plan : Skill::from_feedback;
}

Input input_of(const py::dict& d) {
  Input in;
  if (d.contains("candidate")) in.candidate = candidate_of(d["candidate"].cast<py::dict>());
  if (d.contains("outcome")) in.outcome = outcome_of(d["outcome"].cast<py::dict>());
  if (d.contains("facts") && !d["facts"].is_none()) {
    auto f = d["facts"].cast<py::dict>();
    if (f.contains("kernels"))
      for (auto k : f["kernels"].cast<py::list>()) {
        auto kd = k.cast<py::dict>();
        in.facts.kernels.push_back({get<std::string>(kd, "name", ""), get<int>(kd, "registers", 0),
                                    get<std::size_t>(kd, "shared_bytes", 0)});
      }
    if (f.contains("reference_launches") && !f["reference_launches"].is_none())
      in.facts.reference_launches = f["reference_launches"].cast<int>();
    if (f.contains("candidate_launches") && !f["candidate_launches"].is_none())
      in.facts.candidate_launches = f["candidate_launches"].cast<int>();
    if (f.contains("operators"))
      for (auto o : f["operators"].cast<py::list>()) {
        auto od = o.cast<py::dict>();
        in.facts.operators.push_back({get<std::string>(od, "op", ""), get<double>(od, "share", 0.0),
                                      get<bool>(od, "covered", false)});
      }
  }
  if (d.contains("task")) {
    auto t = d["task"].cast<py::dict>();
    in.task.skill = skill_of(get<int>(t, "skill", 1));
    in.task.asks = get<std::vector<std::string>>(t, "asks", {});
    if (t.contains("previous") && !t["previous"].is_none()) in.task.previous = candidate_of(t["previous"].cast<py::dict>());
    // The Verifier's outcome of the previous candidate: repair asks are judged against its failure.
    if (t.contains("previous_outcome") && !t["previous_outcome"].is_none())
      in.task.previous_outcome = outcome_of(t["previous_outcome"].cast<py::dict>());
    in.task.summary = get<std::string>(t, "summary", "");
  }
  return in;
}

py::dict scorecard_dict(const Scorecard& card) {
  py::dict out;
  py::list items;
  for (const Item& item : card.items) {
    py::dict d;
    d["dimension"] = to_string(item.dimension), d["score"] = item.score, d["reason"] = item.reason;
    d["evidence"] = item.evidence;
    items.append(d);
  }
  out["items"] = items, out["total"] = card.total(), out["judged"] = card.judged, out["judge_note"] = card.judge_note;
  out["text"] = card.describe();
  return out;
}

}  // namespace

void bind_rubric(py::module_& m) {
  py::module_ rm = m.def_submodule("rubric", "rubric items and the reward");
  rm.def("score", [](const py::dict& input) { return scorecard_dict(Rubric().score(input_of(input))); },
         "Scores one candidate: {candidate, outcome, facts, task} -> scorecard dict");
  rm.def("reward", [](const py::dict& outcome, const std::vector<int>& scores, int skill, const py::dict& config) {
    if (scores.size() != 4) throw_error(Error{ErrorCode::InvalidArgument, "the scorecard has four item scores"});
    Scorecard card;
    for (std::size_t i = 0; i < 4; ++i) card.items[i].dimension = static_cast<Dimension>(i), card.items[i].score = scores[i];
    RewardConfig c;
    c.tau = get<double>(config, "tau", c.tau), c.r_max = get<double>(config, "r_max", c.r_max);
    c.lambda_plan = get<double>(config, "lambda_plan", c.lambda_plan);
    c.lambda_feedback = get<double>(config, "lambda_feedback", c.lambda_feedback);
    Reward r = unwrap(reward(outcome_of(outcome), card, skill_of(skill), c));
    py::dict d;
    d["value"] = r.value, d["correct"] = r.correct, d["hack"] = r.hack, d["speedup"] = r.speedup, d["total"] = r.total;
    d["normalized"] = r.normalized, d["lambda"] = r.lambda, d["shaped"] = r.shaped, d["capped"] = r.capped;
    d["zero_reason"] = r.zero_reason, d["text"] = r.describe();
    return d;
  }, py::arg("outcome"), py::arg("scores"), py::arg("skill") = 1, py::arg("config") = py::dict());
}

}  // namespace stitchcuda::bindings
