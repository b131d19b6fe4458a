// The Optimizer: plan, then code / verify / feed back within a budget, replanning when attempts keep
// failing or stop improving; every step is recorded in the run directory, so a killed run resumes
// where it stopped. The Rubric scores each candidate and the reward goes into trajectories.jsonl.
#include <stitchcuda/agents.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <type_traits>

#include <nlohmann/json.hpp>

namespace stitchcuda::agents {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string speed(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3gx", x);
  return buf;
}

// CUDA sources written inline in the candidate's Python: triple-quoted literals holding a __global__.
// The rubric scans CUDA only where it is told it is.
std::vector<std::string> inline_cuda(const std::string& python) {
  std::vector<std::string> out;
  for (const char* quote : {"\"\"\"", "'''"}) {
    std::size_t at = 0;
    while ((at = python.find(quote, at)) != std::string::npos) {
      const std::size_t end = python.find(quote, at + 3);
      if (end == std::string::npos) break;
      std::string body = python.substr(at + 3, end - at - 3);
      if (body.find("__global__") != std::string::npos) out.push_back(std::move(body));
      at = end + 3;
    }
  }
  return out;
}

// The code the rubric reads of a candidate: a kernel step's CUDA source (it has no Python), else the
// ModelNew module with the CUDA written inline in it.
rubric::Candidate rubric_candidate(const std::string& candidate) {
  if (auto step = KernelStep::parse(candidate)) return {{step->source}, ""};
  return {inline_cuda(candidate), candidate};
}

// The Verifier's result as the rubric takes it: a static-only report was never run, so it is
// unverified, not incorrect.
rubric::VerifyOutcome rubric_outcome(const Report& report) {
  rubric::VerifyOutcome outcome = report.outcome();
  outcome.verified = !report.static_only;
  return outcome;
}

void add_usage(llm::Usage& total, const std::vector<Exchange>& exchanges) {
  for (const Exchange& e : exchanges) {
    total.prompt_tokens += e.usage.prompt_tokens;
    total.completion_tokens += e.usage.completion_tokens;
    total.total_tokens += e.usage.total_tokens;
  }
}

// Every call an attempt made: the Coder's and the VerifierAgent's.
std::vector<Exchange> calls_of(const AttemptRecord& a) {
  std::vector<Exchange> calls = a.exchanges;
  if (a.feedback.exchange) calls.push_back(*a.feedback.exchange);
  calls.insert(calls.end(), a.judge_exchanges.begin(), a.judge_exchanges.end());
  return calls;
}

nlohmann::json budget_json(const Budget& b) {
  return {{"attempts", b.attempts},
          {"replans", b.replans},
          {"wall_s", b.wall_s},
          {"tokens", b.tokens},
          {"target_speedup", b.target_speedup},
          {"replan_after_failures", b.replan_after_failures},
          {"stagnation", b.stagnation}};
}

double latency_of(const std::vector<Exchange>& exchanges) {
  double s = 0;
  for (const Exchange& e : exchanges) s += e.latency_s;
  return s;
}

// What an attempt came to, in a few words (history for the Replanner, events).
std::string describe_outcome(const AttemptRecord& a) {
  if (!a.coder_error.empty()) return "no candidate: " + a.coder_error.substr(0, 200);
  const Report& r = a.report;
  if (r.hack()) return "rejected (" + (r.findings.empty() ? std::string("hack") : r.findings.front().rule) + ")";
  if (!r.error_kind.empty()) return r.error_kind + ": " + r.error_message.substr(0, 200);
  if (r.static_only) return r.compiled ? "compiled (unverified: no GPU)" : "does not compile";
  if (!r.correct) return "incorrect" + (r.mismatches.empty() ? std::string() : ": " + r.mismatches.front().substr(0, 200));
  return "correct, " + (r.speedup_eager ? speed(*r.speedup_eager) + " over eager" : std::string("not timed"));
}

// A candidate that may be the answer: correct (or, without a GPU, compiled) and trusted.
bool usable(const AttemptRecord& a) {
  if (!a.coder_error.empty() || a.report.hack() || !a.report.compiled) return false;
  return a.report.correct || a.report.static_only;
}

double speedup_of(const AttemptRecord& a) { return a.report.speedup_eager.value_or(0.0); }

}  // namespace

Result<AttemptScore> score_attempt(const rubric::Rubric& rubric, const std::string& candidate, const Report& report,
                                   rubric::Skill skill, std::vector<std::string> asks, const std::string* previous,
                                   const Report* previous_report, const rubric::RewardConfig& config) {
  if (auto ok = config.validate(); !ok) return tl::unexpected(ok.error());
  AttemptScore out;
  out.input.candidate = rubric_candidate(candidate);
  out.input.outcome = rubric_outcome(report);
  out.input.task.skill = skill;
  out.input.task.asks = std::move(asks);
  if (previous) out.input.task.previous = rubric_candidate(*previous);
  if (previous_report) out.input.task.previous_outcome = rubric_outcome(*previous_report);
  out.scorecard = rubric.score(out.input);
  auto r = rubric::reward(out.input.outcome, out.scorecard, skill, config);
  if (!r) return tl::unexpected(r.error());
  out.reward = *r;
  return out;
}

std::string Budget::to_json() const { return budget_json(*this).dump(); }

Result<Budget> Budget::from_json(std::string_view text) { return from_json(text, Budget{}); }

Result<Budget> Budget::from_json(std::string_view text, const Budget& defaults) {
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return fail(ErrorCode::InvalidArgument, "a budget is a JSON object");
  Budget b = defaults;
  std::string wrong;
  auto take = [&](const char* key, auto& field) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return;
    using T = std::decay_t<decltype(field)>;
    const bool ok = std::is_floating_point_v<T> ? it->is_number() : it->is_number_integer();
    if (!ok) {
      wrong += std::string(wrong.empty() ? "" : ", ") + key;
      return;
    }
    field = it->get<T>();
  };
  take("attempts", b.attempts);
  take("replans", b.replans);
  take("wall_s", b.wall_s);
  take("tokens", b.tokens);
  take("target_speedup", b.target_speedup);
  take("replan_after_failures", b.replan_after_failures);
  take("stagnation", b.stagnation);
  if (!wrong.empty()) return fail(ErrorCode::InvalidArgument, "budget field(s) of the wrong type: " + wrong);
  return b;
}

std::string Outcome::summary_json() const {
  nlohmann::json j;
  j["run_dir"] = run_dir;
  j["best_attempt"] = best_attempt;
  j["best_speedup"] = best_speedup;
  j["verified"] = verified;
  j["stop_reason"] = stop_reason;
  j["plans"] = plans;
  j["usage"] = {{"prompt_tokens", usage.prompt_tokens},
                {"completion_tokens", usage.completion_tokens},
                {"total_tokens", usage.total_tokens}};
  j["wall_s"] = wall_s;
  j["overhead_s"] = overhead_s;
  j["attempts"] = nlohmann::json::array();
  for (const AttemptRecord& a : attempts)
    j["attempts"].push_back({{"index", a.index},
                             {"plan", a.plan},
                             {"skill", static_cast<int>(a.skill)},
                             {"outcome", describe_outcome(a)},
                             {"feedback_kind", a.feedback.kind},
                             {"speedup", a.report.speedup_eager ? nlohmann::json(*a.report.speedup_eager) : nlohmann::json()},
                             {"reward", a.reward.value},
                             {"rubric_total", a.scorecard.total()},
                             {"wall_s", a.wall_s},
                             {"llm_s", a.llm_s},
                             {"verify_s", a.verify_s}});
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

Optimizer::Optimizer(Agents agents, std::shared_ptr<Verifier> verifier, Budget budget)
    : agents_(std::move(agents)), verifier_(std::move(verifier)), budget_(budget) {}

Result<void> Optimizer::check() const {
  if (!agents_.planner || !agents_.coder || !agents_.verifier_agent || !agents_.rubric || !verifier_)
    return fail(ErrorCode::InvalidArgument, "the Optimizer needs a planner, coder, verifier agent, rubric and verifier");
  return agents_.reward.validate();
}

Result<Outcome> Optimizer::run(const Problem& problem, const std::string& run_dir, const std::string& config_json,
                               const EventCallback& on_event) const {
  const std::string path = run_dir.empty() ? RunDirectory::fresh_path("runs", problem.name) : run_dir;
  if (auto ok = check(); !ok) return tl::unexpected(ok.error());  // before anything is written
  // The budget this run keeps is recorded whole: a resumed run starts from it.
  nlohmann::json config = nlohmann::json::parse(config_json, nullptr, false);
  if (config.is_discarded() || !config.is_object())
    return fail(ErrorCode::InvalidArgument, "the run's configuration must be a JSON object");
  config["budget"] = budget_json(budget_);
  auto dir = RunDirectory::create(path);
  if (!dir) return tl::unexpected(dir.error());
  if (auto ok = dir->write_config(config.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)); !ok)
    return tl::unexpected(ok.error());
  if (auto ok = dir->write_problem(problem); !ok) return tl::unexpected(ok.error());
  if (agents_.prompts)
    if (auto ok = dir->write_prompts(*agents_.prompts); !ok) return tl::unexpected(ok.error());
  return drive(problem, std::move(*dir), {}, on_event);
}

Result<Outcome> Optimizer::resume(const Problem& problem, const std::string& run_dir,
                                  const EventCallback& on_event) const {
  auto dir = RunDirectory::open(run_dir);
  if (!dir) return tl::unexpected(dir.error());
  auto saved = dir->load();
  if (!saved) return tl::unexpected(saved.error());
  // The records of what was read back, exactly: an interrupted attempt's lines go, a finished one's stay.
  if (auto ok = dir->write_trajectories(*saved, problem.name); !ok) return tl::unexpected(ok.error());
  // The budget it goes on with is this Optimizer's; config.json says so, and what changed from the saved one.
  nlohmann::json config = nlohmann::json::parse(saved->config_json.empty() ? "{}" : saved->config_json, nullptr, false);
  if (config.is_discarded() || !config.is_object()) config = nlohmann::json::object();
  const nlohmann::json before = config.contains("budget") && config["budget"].is_object() ? config["budget"] : nlohmann::json::object();
  const nlohmann::json now = budget_json(budget_);
  nlohmann::json changes = nlohmann::json::object();
  std::string said;
  for (const auto& [key, value] : now.items()) {
    if (before.contains(key) && before[key] == value) continue;
    changes[key] = {{"saved", before.contains(key) ? before[key] : nlohmann::json()}, {"now", value}};
    said += (said.empty() ? "" : ", ") + key + " " + (before.contains(key) ? before[key].dump() : "unset") + " -> " + value.dump();
  }
  config["budget"] = now;
  if (!config.contains("resumes") || !config["resumes"].is_array()) config["resumes"] = nlohmann::json::array();
  config["resumes"].push_back({{"attempts_done", saved->attempts.size()}, {"budget_changes", changes}});
  if (auto ok = dir->write_config(config.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)); !ok)
    return tl::unexpected(ok.error());
  const Event resumed{"resume", static_cast<int>(saved->attempts.size()), static_cast<int>(saved->plans.size()), 0.0,
                      "resuming after " + std::to_string(saved->attempts.size()) + " attempts; budget " +
                          (said.empty() ? std::string("as saved") : said)};
  (void)dir->append_event(nlohmann::json{{"stage", resumed.stage}, {"attempt", resumed.attempt}, {"plan", resumed.plan},
                                         {"best_speedup", resumed.best_speedup}, {"message", resumed.message},
                                         {"budget", now}, {"budget_changes", changes}}
                              .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  if (on_event) {
    try {
      on_event(resumed);
    } catch (const std::exception&) {  // a progress view must not stop the run
    }
  }
  return drive(problem, std::move(*dir), std::move(*saved), on_event);
}

Result<Outcome> Optimizer::drive(const Problem& problem, RunDirectory dir, RunDirectory::Saved saved,
                                 const EventCallback& on_event) const {
  const auto started = Clock::now();
  if (auto ok = check(); !ok) return tl::unexpected(ok.error());
  if (agents_.judge) agents_.judge->set_reference(problem.reference);

  Outcome out;
  out.run_dir = dir.path();
  out.attempts = std::move(saved.attempts);
  std::vector<ProblemPlan> plans;
  // Usage counts every call of the run, those before a kill too, so a token budget holds across resumes.
  for (ProblemPlanResult& p : saved.plans) {
    add_usage(out.usage, p.exchanges);
    plans.push_back(std::move(p.plan));
  }
  for (const AttemptRecord& a : out.attempts) add_usage(out.usage, calls_of(a));
  double waited_s = 0.0;  // model and verification time in this process: not the loop's own cost

  const AttemptRecord* best = nullptr;
  auto consider = [&](const AttemptRecord& a) {
    if (!usable(a)) return;
    if (best == nullptr || speedup_of(a) > speedup_of(*best)) best = &a;
  };
  for (const AttemptRecord& a : out.attempts) consider(a);

  auto emit = [&](const std::string& stage, const std::string& message) {
    Event e{stage, static_cast<int>(out.attempts.size()), static_cast<int>(plans.size()),
            best ? speedup_of(*best) : 0.0, message};
    // events.jsonl is a progress log: losing a line must not stop the run (the attempt files are the record).
    (void)dir.append_event(nlohmann::json{{"stage", e.stage}, {"attempt", e.attempt}, {"plan", e.plan},
                                          {"best_speedup", e.best_speedup}, {"message", e.message}}
                               .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    if (on_event) {
      try {
        on_event(e);
      } catch (const std::exception&) {  // a progress view must not stop the run
      }
    }
  };
  auto add_tokens = [&](const std::vector<Exchange>& exchanges) {
    waited_s += latency_of(exchanges);
    add_usage(out.usage, exchanges);
  };

  if (plans.empty()) {
    emit("plan", "planning " + problem.name);
    auto planned = agents_.planner->plan(problem);
    if (!planned) return tl::unexpected(planned.error());
    add_tokens(planned->exchanges);
    if (auto ok = dir.write_plan(1, *planned, problem.name); !ok) return tl::unexpected(ok.error());
    plans.push_back(planned->plan);
  }

  // Counters since the current plan began.
  int failures = 0, stagnant = 0;
  double plan_best = 0.0;
  for (const AttemptRecord& a : out.attempts) {
    if (a.plan != static_cast<int>(plans.size())) continue;
    if (!usable(a)) {
      ++failures;
    } else {
      failures = 0;
      if (speedup_of(a) > plan_best) plan_best = speedup_of(a), stagnant = 0;
      else ++stagnant;
    }
  }

  while (true) {
    const bool target_met = best && budget_.target_speedup > 0 && speedup_of(*best) >= budget_.target_speedup;
    if (target_met) { out.stop_reason = "target reached: " + speed(speedup_of(*best)) + " >= " + speed(budget_.target_speedup); break; }
    if (best && best->report.static_only) { out.stop_reason = "compiled and passed the static checks (unverified: no GPU to run it)"; break; }
    if (budget_.attempts > 0 && static_cast<int>(out.attempts.size()) >= budget_.attempts) { out.stop_reason = "attempt budget spent (" + std::to_string(budget_.attempts) + ")"; break; }
    if (budget_.wall_s > 0 && seconds_since(started) >= budget_.wall_s) { out.stop_reason = "wall-time budget spent"; break; }
    if (budget_.tokens > 0 && out.usage.total_tokens >= budget_.tokens) { out.stop_reason = "token budget spent (" + std::to_string(out.usage.total_tokens) + " tokens)"; break; }

    // Replan when the current plan keeps failing or stopped paying.
    const int replans_done = static_cast<int>(plans.size()) - 1;
    const bool stuck = (budget_.replan_after_failures > 0 && failures >= budget_.replan_after_failures) ||
                       (budget_.stagnation > 0 && stagnant >= budget_.stagnation);
    if (stuck && replans_done < budget_.replans && agents_.replanner) {
      emit("replan", failures > 0 ? std::to_string(failures) + " attempts without a correct candidate"
                                  : std::to_string(stagnant) + " correct attempts without a better speed-up");
      std::vector<AttemptSummary> history;
      for (const AttemptRecord& a : out.attempts) history.push_back({a.index, describe_outcome(a)});
      auto replanned = agents_.replanner->replan(problem, plans.back(), history);
      if (!replanned) return tl::unexpected(replanned.error());
      add_tokens(replanned->exchanges);
      if (auto ok = dir.write_plan(static_cast<int>(plans.size()) + 1, *replanned, problem.name,
                                   static_cast<int>(out.attempts.size()));
          !ok)
        return tl::unexpected(ok.error());
      plans.push_back(replanned->plan);
      failures = stagnant = 0;
      plan_best = 0.0;
      continue;
    }

    const auto attempt_start = Clock::now();
    AttemptRecord rec;
    rec.index = static_cast<int>(out.attempts.size()) + 1;
    rec.plan = static_cast<int>(plans.size());
    // Skill 2 revises the last candidate of this plan with its feedback; a new plan starts from Skill 1.
    const AttemptRecord* previous = nullptr;
    for (auto it = out.attempts.rbegin(); it != out.attempts.rend(); ++it)
      if (it->plan == rec.plan) { if (!it->candidate.empty()) previous = &*it; break; }
    CoderRequest request;
    request.problem = &problem;
    request.plan = &plans.back();
    if (previous) {
      request.skill = rubric::Skill::from_feedback;
      request.previous = previous->candidate;
      request.feedback = previous->feedback.text;
    }
    rec.skill = request.skill;
    emit("code", "attempt " + std::to_string(rec.index) + (previous ? ": revising from feedback" : ": writing from the plan"));
    auto written = agents_.coder->write(request);
    if (!written) return tl::unexpected(written.error());  // the backend failed: stop, resumable
    rec.exchanges = written->exchanges;
    rec.candidate = written->extraction.code;
    rec.coder_error = written->problem;  // the model's fault: an attempt spent, the run goes on
    add_tokens(rec.exchanges);
    rec.llm_s = latency_of(rec.exchanges);

    if (!rec.candidate.empty()) {
      emit("verify", "attempt " + std::to_string(rec.index));
      const auto verify_start = Clock::now();
      auto report = verifier_->verify(problem, rec.candidate);
      rec.verify_s = seconds_since(verify_start);
      waited_s += rec.verify_s;
      if (!report) return tl::unexpected(report.error());
      rec.report = std::move(*report);
      rec.feedback = agents_.verifier_agent->feedback(problem, rec.candidate, rec.report, budget_.target_speedup);
      if (rec.feedback.exchange) {
        add_tokens({*rec.feedback.exchange});
        rec.llm_s += rec.feedback.exchange->latency_s;
      }
    } else {
      rec.feedback.kind = "coder";
      rec.feedback.text = "The previous answer held no usable candidate: " + rec.coder_error;
    }

    std::vector<std::string> asks;
    if (previous) asks = previous->feedback.asks;
    else for (const ProblemPlanStep& s : plans.back().steps) asks.push_back(s.title);
    auto scored = score_attempt(*agents_.rubric, rec.candidate, rec.report, rec.skill, std::move(asks),
                                previous ? &previous->candidate : nullptr, previous ? &previous->report : nullptr,
                                agents_.reward);
    if (agents_.judge) {  // the judge's calls belong to this attempt's record
      rec.judge_exchanges = agents_.judge->take_exchanges();
      add_tokens(rec.judge_exchanges);
      for (const Exchange& e : rec.judge_exchanges) rec.llm_s += e.latency_s;
    }
    if (scored) rec.scorecard = scored->scorecard, rec.reward = scored->reward;
    rec.wall_s = seconds_since(attempt_start);
    if (auto ok = dir.write_attempt(rec, problem.name); !ok) return tl::unexpected(ok.error());

    out.attempts.push_back(std::move(rec));
    best = nullptr;  // the vector may have moved: find the best again
    for (const AttemptRecord& a : out.attempts) consider(a);
    const AttemptRecord& last = out.attempts.back();
    if (!usable(last)) {
      ++failures;
    } else {
      failures = 0;
      if (speedup_of(last) > plan_best) plan_best = speedup_of(last), stagnant = 0;
      else ++stagnant;
    }
    if (best == &last) {
      if (auto ok = dir.write_best(last.candidate); !ok) return tl::unexpected(ok.error());
    }
    emit("feedback", "attempt " + std::to_string(last.index) + ": " + describe_outcome(last));
  }

  if (best) {
    out.best = best->candidate;
    out.best_attempt = best->index;
    out.best_speedup = speedup_of(*best);
  }
  for (const AttemptRecord& a : out.attempts)
    if (a.report.static_only) out.verified = false;
  out.plans = static_cast<int>(plans.size());
  out.wall_s = seconds_since(started);
  out.overhead_s = std::max(0.0, out.wall_s - waited_s);
  nlohmann::json summary = nlohmann::json::parse(out.summary_json());
  summary["problem"] = problem.name;
  if (auto ok = dir.write_summary(summary.dump(2, ' ', false, nlohmann::json::error_handler_t::replace)); !ok)
    return tl::unexpected(ok.error());
  emit("done", out.stop_reason);
  return out;
}

}  // namespace stitchcuda::agents
