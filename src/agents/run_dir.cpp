// RunDirectory: everything one optimization run leaves on disk, written so that an interrupted run can
// be resumed (attempt.json is written last, so its presence marks a finished attempt) and so that
// trajectories.jsonl can be read as training data. Whole files are replaced atomically (temp + rename).
#include <stitchcuda/agents.hpp>
#include <stitchcuda/secrets.hpp>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

namespace stitchcuda::agents {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// Model replies and candidates may hold invalid UTF-8 (a reply cut inside a character): replace it
// rather than fail to record the run.
std::string dump(const Json& j, int indent = -1) { return j.dump(indent, ' ', false, Json::error_handler_t::replace); }

tl::unexpected<Error> io_error(const std::string& what, const fs::path& path, int err) {
  return fail(ErrorCode::IoError, what + " '" + path.string() + "': " + std::strerror(err));
}

tl::unexpected<Error> io_error(const std::string& what, const fs::path& path, const std::error_code& ec) {
  return fail(ErrorCode::IoError, what + " '" + path.string() + "': " + ec.message());
}

Result<void> make_dirs(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error("cannot create the folder", dir, ec);
  return {};
}

Result<void> write_all(int fd, std::string_view data, const fs::path& path) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return io_error("cannot write", path, errno);
    data.remove_prefix(static_cast<std::size_t>(n));
  }
  return {};
}

// Writes a temporary file beside `path`, syncs it and renames it into place: a reader (or a resumed run)
// sees the old file or the new one, never a part.
Result<void> write_atomic(const fs::path& path, std::string_view raw) {
  // Nothing a run writes keeps a secret the process knows (a key a candidate read, a reply echoing one).
  const std::string clean = secrets::redact(raw);
  const std::string_view data = clean;
  static std::atomic<unsigned> counter{0};
  fs::path tmp = path;
  tmp += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return io_error("cannot write", path, errno);
  auto written = write_all(fd, data, path);
  int err = 0;
  if (written && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && written && err == 0) err = errno;
  if (!written || err != 0) {
    ::unlink(tmp.c_str());
    return written ? io_error("cannot write", path, err) : written;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    ::unlink(tmp.c_str());
    return io_error("cannot move a finished file into", path, err);
  }
  return {};
}

// The whole line in one write(2) with O_APPEND (more only after a short write), so lines do not interleave.
Result<void> append_line(const fs::path& path, const std::string& line) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return io_error("cannot open for appending", path, errno);
  auto written = write_all(fd, secrets::redact(line) + "\n", path);
  if (::close(fd) != 0 && written) return io_error("cannot write", path, errno);
  return written;
}

Result<std::string> read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error("cannot read", path, errno);
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) return io_error("cannot read", path, errno);
  return s.str();
}

Result<Json> parse_json(std::string_view text, const std::string& what) {
  try {
    return Json::parse(text);
  } catch (const Json::parse_error& e) {
    return fail(ErrorCode::InvalidArgument, what + " is not valid JSON: " + e.what());
  }
}

// Appended rather than concatenated: GCC 12 reports a false -Wrestrict for "'" + std::string.
std::string quoted(const fs::path& p) {
  std::string s = "'";
  s += p.string();
  s += '\'';
  return s;
}

bool present(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// A key naming a secret: equal to or ending with api_key/key/token/secret/password/authorization, or
// containing api_key/apikey/secret/password. "max_tokens" and other budgets ("tokens") are not secrets.
bool secret_key(const std::string& key) {
  std::string k = lower(key);
  for (std::string_view part : {"api_key", "apikey", "secret", "password"})
    if (k.find(part) != std::string::npos) return true;
  for (std::string_view suffix : {"key", "token", "authorization"})
    if (ends_with(k, suffix)) return true;
  return false;
}

// Replaces the values of secret keys, through nested objects and arrays; a null or empty value is kept
// (it holds nothing and shows the setting was not given). HTTP headers written as [name, value] pairs
// count as keys too.
void redact(Json& j) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      bool empty = it->is_null() || (it->is_string() && it->get_ref<const std::string&>().empty());
      if (secret_key(it.key()) && !empty) *it = "<redacted>";
      else redact(*it);
    }
  } else if (j.is_array()) {
    if (j.size() == 2 && j[0].is_string() && j[1].is_string() && secret_key(j[0].get<std::string>())) {
      j[1] = "<redacted>";
      return;
    }
    for (auto& item : j) redact(item);
  }
}

// ---- lenient reading of what this file wrote (a missing key reads as its default) -----------------

const Json* member(const Json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}
std::string str(const Json& j, const char* key) {
  const Json* v = member(j, key);
  return v && v->is_string() ? v->get<std::string>() : std::string();
}
double num(const Json& j, const char* key) {
  const Json* v = member(j, key);
  return v && v->is_number() ? v->get<double>() : 0.0;
}
std::int64_t integer(const Json& j, const char* key) {
  const Json* v = member(j, key);
  return v && v->is_number() ? v->get<std::int64_t>() : 0;
}
bool flag(const Json& j, const char* key) {
  const Json* v = member(j, key);
  return v && v->is_boolean() && v->get<bool>();
}
std::vector<std::string> strings(const Json& j, const char* key) {
  std::vector<std::string> out;
  if (const Json* v = member(j, key); v && v->is_array())
    for (const auto& s : *v)
      if (s.is_string()) out.push_back(s.get<std::string>());
  return out;
}
const Json& array(const Json& j, const char* key) {
  static const Json empty = Json::array();
  const Json* v = member(j, key);
  return v && v->is_array() ? *v : empty;
}

// ---- records as JSON, and back -----------------------------------------------------------------

Json usage_json(const llm::Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens}, {"completion_tokens", u.completion_tokens}, {"total_tokens", u.total_tokens}};
}
llm::Usage usage_from(const Json& j) {
  llm::Usage u;
  u.prompt_tokens = integer(j, "prompt_tokens");
  u.completion_tokens = integer(j, "completion_tokens");
  u.total_tokens = integer(j, "total_tokens");
  return u;
}

Json messages_json(const std::vector<llm::Message>& messages) {
  Json out = Json::array();
  for (const auto& m : messages) out.push_back({{"role", m.role}, {"content", m.content}});
  return out;
}

Json exchange_json(const Exchange& e) {
  return {{"agent", e.agent},
          {"model", e.model},
          {"messages", messages_json(e.messages)},
          {"reply", e.reply},
          {"finish_reason", e.finish_reason},
          {"usage", usage_json(e.usage)},
          {"latency_s", e.latency_s},
          {"error", e.error},
          {"prompt", {{"name", e.prompt_name}, {"sha256", e.prompt_sha256}}},
          {"snippets", e.snippets}};
}
Exchange exchange_from(const Json& j) {
  Exchange e;
  e.agent = str(j, "agent");
  e.model = str(j, "model");
  for (const auto& m : array(j, "messages")) e.messages.push_back({str(m, "role"), str(m, "content")});
  e.reply = str(j, "reply");
  e.finish_reason = str(j, "finish_reason");
  if (const Json* u = member(j, "usage")) e.usage = usage_from(*u);
  e.latency_s = num(j, "latency_s");
  e.error = str(j, "error");
  if (const Json* p = member(j, "prompt")) {
    e.prompt_name = str(*p, "name");
    e.prompt_sha256 = str(*p, "sha256");
  }
  e.snippets = strings(j, "snippets");
  return e;
}

Json optional_json(const std::optional<double>& x) { return x ? Json(*x) : Json(nullptr); }
std::optional<double> optional_from(const Json& j, const char* key) {
  const Json* v = member(j, key);
  return v && v->is_number() ? std::optional<double>(v->get<double>()) : std::nullopt;
}

Json report_json(const Report& r) {
  Json findings = Json::array();
  for (std::size_t i = 0; i < r.findings.size(); ++i)
    findings.push_back({{"rule", r.findings[i].rule},
                        {"severity", rubric::to_string(r.findings[i].severity)},
                        {"message", i < r.finding_messages.size() ? r.finding_messages[i] : ""},
                        {"line", i < r.finding_lines.size() ? r.finding_lines[i] : 0},
                        {"evidence", r.findings[i].evidence}});
  return {{"compiled", r.compiled},
          {"correct", r.correct},
          {"static_only", r.static_only},
          {"speedup_eager", optional_json(r.speedup_eager)},
          {"speedup_compile", optional_json(r.speedup_compile)},
          {"findings", findings},
          {"error_kind", r.error_kind},
          {"error_message", r.error_message},
          {"compile_log", r.compile_log},
          {"mismatches", r.mismatches},
          {"bottleneck", r.bottleneck},
          {"top_kernel", r.top_kernel},
          {"candidate_ms", r.candidate_ms},
          {"wall_s", r.wall_s},
          {"json", r.json}};
}
Report report_from(const Json& j) {
  Report r;
  r.compiled = flag(j, "compiled");
  r.correct = flag(j, "correct");
  r.static_only = flag(j, "static_only");
  r.speedup_eager = optional_from(j, "speedup_eager");
  r.speedup_compile = optional_from(j, "speedup_compile");
  for (const auto& f : array(j, "findings")) {
    rubric::Finding finding;
    finding.rule = str(f, "rule");
    finding.severity = rubric::severity_from_string(str(f, "severity")).value_or(rubric::Severity::minor);
    finding.evidence = str(f, "evidence");
    r.findings.push_back(std::move(finding));
    r.finding_messages.push_back(str(f, "message"));
    r.finding_lines.push_back(static_cast<int>(integer(f, "line")));
  }
  r.error_kind = str(j, "error_kind");
  r.error_message = str(j, "error_message");
  r.compile_log = str(j, "compile_log");
  r.mismatches = strings(j, "mismatches");
  r.bottleneck = str(j, "bottleneck");
  r.top_kernel = str(j, "top_kernel");
  r.candidate_ms = num(j, "candidate_ms");
  r.wall_s = num(j, "wall_s");
  r.json = str(j, "json");
  return r;
}

Json feedback_json(const Feedback& f) {
  return {{"kind", f.kind}, {"text", f.text}, {"asks", f.asks},
          {"exchange", f.exchange ? exchange_json(*f.exchange) : Json(nullptr)}};
}
Feedback feedback_from(const Json& j) {
  Feedback f;
  f.kind = str(j, "kind");
  f.text = str(j, "text");
  f.asks = strings(j, "asks");
  if (const Json* e = member(j, "exchange")) f.exchange = exchange_from(*e);
  return f;
}

Json scorecard_json(const rubric::Scorecard& card) {
  Json items = Json::array();
  for (const auto& item : card.items)
    items.push_back({{"dimension", rubric::to_string(item.dimension)},
                     {"score", item.score},
                     {"reason", item.reason},
                     {"evidence", item.evidence}});
  return {{"items", items}, {"total", card.total()}, {"judged", card.judged}, {"judge_note", card.judge_note}};
}
Result<rubric::Scorecard> scorecard_from(const Json& j) {
  rubric::Scorecard card;
  const Json& items = array(j, "items");
  if (items.size() > card.items.size())
    return fail(ErrorCode::InvalidArgument, "the scorecard has " + std::to_string(items.size()) + " items; expected 4");
  for (std::size_t k = 0; k < items.size(); ++k) {
    // Items are stored in Dimension order; each keeps the dimension it names (a default-made card names
    // anti-hacking four times, and must read back the same).
    auto& item = card.items[k];
    item.dimension = static_cast<rubric::Dimension>(k);
    if (std::string name = str(items[k], "dimension"); !name.empty()) {
      bool known = false;
      for (std::size_t d = 0; d < card.items.size(); ++d)
        if (name == rubric::to_string(static_cast<rubric::Dimension>(d))) item.dimension = static_cast<rubric::Dimension>(d), known = true;
      if (!known)
        return fail(ErrorCode::InvalidArgument, "rubric item " + std::to_string(k) + " has an unknown dimension '" + name + "'");
    }
    item.score = static_cast<int>(integer(items[k], "score"));
    item.reason = str(items[k], "reason");
    item.evidence = strings(items[k], "evidence");
  }
  card.judged = flag(j, "judged");
  card.judge_note = str(j, "judge_note");
  return card;
}

Json reward_json(const rubric::Reward& r) {
  return {{"value", r.value},   {"correct", r.correct},       {"hack", r.hack},     {"speedup", r.speedup},
          {"total", r.total},   {"normalized", r.normalized}, {"lambda", r.lambda}, {"shaped", r.shaped},
          {"capped", r.capped}, {"zero_reason", r.zero_reason}};
}
rubric::Reward reward_from(const Json& j) {
  rubric::Reward r;
  r.value = num(j, "value");
  r.correct = flag(j, "correct");
  r.hack = flag(j, "hack");
  r.speedup = num(j, "speedup");
  r.total = static_cast<int>(integer(j, "total"));
  r.normalized = num(j, "normalized");
  r.lambda = num(j, "lambda");
  r.shaped = num(j, "shaped");
  r.capped = flag(j, "capped");
  r.zero_reason = str(j, "zero_reason");
  return r;
}

Json attempt_json(const AttemptRecord& a) {
  Json exchanges = Json::array();
  for (const auto& e : a.exchanges) exchanges.push_back(exchange_json(e));
  Json judge = Json::array();
  for (const auto& e : a.judge_exchanges) judge.push_back(exchange_json(e));
  return {{"index", a.index},
          {"plan", a.plan},
          {"skill", static_cast<int>(a.skill)},
          {"candidate", a.candidate},
          {"coder_error", a.coder_error},
          {"report", report_json(a.report)},
          {"feedback", feedback_json(a.feedback)},
          {"scorecard", scorecard_json(a.scorecard)},
          {"reward", reward_json(a.reward)},
          {"exchanges", exchanges},
          {"judge_exchanges", judge},
          {"wall_s", a.wall_s},
          {"llm_s", a.llm_s},
          {"verify_s", a.verify_s}};
}
Result<AttemptRecord> attempt_from(const Json& j) {
  if (!j.is_object()) return fail(ErrorCode::InvalidArgument, "an attempt record must be a JSON object");
  AttemptRecord a;
  a.index = static_cast<int>(integer(j, "index"));
  a.plan = static_cast<int>(integer(j, "plan"));
  auto skill = integer(j, "skill");
  if (skill != 1 && skill != 2)
    return fail(ErrorCode::InvalidArgument, "skill is " + std::to_string(skill) + "; expected 1 or 2");
  a.skill = static_cast<rubric::Skill>(skill);
  a.candidate = str(j, "candidate");
  a.coder_error = str(j, "coder_error");
  if (const Json* r = member(j, "report")) a.report = report_from(*r);
  if (const Json* f = member(j, "feedback")) a.feedback = feedback_from(*f);
  if (const Json* s = member(j, "scorecard")) {
    auto card = scorecard_from(*s);
    if (!card) return tl::unexpected(card.error());
    a.scorecard = std::move(*card);
  }
  if (const Json* r = member(j, "reward")) a.reward = reward_from(*r);
  for (const auto& e : array(j, "exchanges")) a.exchanges.push_back(exchange_from(e));
  for (const auto& e : array(j, "judge_exchanges")) a.judge_exchanges.push_back(exchange_from(e));
  a.wall_s = num(j, "wall_s");
  a.llm_s = num(j, "llm_s");
  a.verify_s = num(j, "verify_s");
  return a;
}

// ---- trajectories.jsonl ----------------------------------------------------------------------------
// One record per model call, every record with the same keys and value types (null where a key does
// not apply), so `datasets.load_dataset("json", ...)` reads a run as it is: `messages` is the whole
// conversation (what was sent, then the reply), `prompt` and `completion` the same split for
// prompt/completion trainers. Documented in docs/agents.md ("Trajectories"); Python checks records
// against stitchcuda.agents.TRAJECTORY_SCHEMA.

// The first line of `text`, at most `limit` characters.
std::string first_line(std::string_view text, std::size_t limit = 300) {
  std::string s(text.substr(0, text.find('\n')));
  if (s.size() > limit) s = s.substr(0, limit) + "...";
  return s;
}

// Why an attempt's reward is 0, in one of four words a filter can match: "incorrect: ...", "hack: <rule>",
// "no candidate: ...", "unverified"; "" when it is not 0.
std::string why_zero(const AttemptRecord& a) {
  if (a.reward.value != 0.0) return "";
  if (a.candidate.empty()) return "no candidate: " + first_line(a.coder_error);
  const Report& r = a.report;
  std::string rules;
  for (const rubric::Finding& f : r.findings)
    if (f.severity == rubric::Severity::major && rules.find(f.rule) == std::string::npos)
      rules += (rules.empty() ? "" : ", ") + f.rule;
  if (!rules.empty()) return "hack: " + rules;
  if (r.compiled && r.static_only) return "unverified";
  if (!r.compiled || !r.correct || !r.error_kind.empty()) {
    const std::string kind = !r.error_kind.empty() ? r.error_kind : r.compiled ? "incorrect" : "compile";
    std::string what = !r.error_message.empty() ? r.error_message : r.mismatches.empty() ? "" : r.mismatches.front();
    return "incorrect: " + kind + (what.empty() ? "" : ": " + first_line(what));
  }
  return "shaped reward is 0: " + a.reward.describe();  // possible only at lambda 2 with every item at 1
}

// The reward and its named parts (the rubric by item name).
Json trajectory_reward(const AttemptRecord& a) {
  Json items = Json::object();
  for (const auto& item : a.scorecard.items) items[rubric::to_string(item.dimension)] = item.score;
  const auto& r = a.reward;
  return {{"value", r.value},           {"correct", r.correct}, {"hack", r.hack},       {"speedup", r.speedup},
          {"rubric", items},            {"total", r.total},     {"normalized", r.normalized},
          {"lambda", r.lambda},         {"why_zero", why_zero(a)}};
}

// What a record says beside the call itself.
struct RecordContext {
  std::string run_id;
  std::string problem;
  Json plan = nullptr;     // the plan the call made or followed (1-based)
  Json attempt = nullptr;  // null for the first Planner call
  Json skill = nullptr;    // 1 or 2 for the Coder
  std::string feedback_kind;
  Json reward = nullptr;   // the Coder's attempt's reward; null for the other agents
};

Json trajectory_json(const RecordContext& c, const Exchange& e) {
  Json prompt = messages_json(e.messages);
  Json reply = {{"role", "assistant"}, {"content", e.reply}};
  Json messages = prompt;
  messages.push_back(reply);
  return {{"run_id", c.run_id},
          {"problem", c.problem},
          {"model", e.model},
          {"agent", e.agent},
          {"prompt_name", e.prompt_name},
          {"prompt_sha256", e.prompt_sha256},
          {"plan", c.plan},
          {"attempt", c.attempt},
          {"skill", c.skill},
          {"messages", messages},
          {"prompt", prompt},
          {"completion", Json::array({reply})},
          {"finish_reason", e.finish_reason},
          {"error", e.error},
          {"usage", usage_json(e.usage)},
          {"latency_s", e.latency_s},
          {"snippets", e.snippets},
          {"feedback_kind", c.feedback_kind},
          {"reward", c.reward}};
}

// The run's id: its folder's name (a trailing separator is not a name).
std::string run_id_of(const std::string& path) {
  fs::path p = fs::path(path).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

// The trajectories.jsonl lines of plan `n`'s calls; `attempts_done`: the attempts before it.
std::vector<std::string> plan_lines(const std::string& run_id, int n, const ProblemPlanResult& plan,
                                    const std::string& problem, int attempts_done) {
  std::vector<std::string> lines;
  RecordContext context{run_id, problem, n};
  for (const auto& e : plan.exchanges) {
    // The first plan comes before any attempt; a replan follows the attempts that stalled.
    context.attempt = e.agent == "planner" ? Json(nullptr) : Json(attempts_done);
    lines.push_back(dump(trajectory_json(context, e)));
  }
  return lines;
}

// The lines of an attempt's calls: the Coder's (with the attempt's reward), then the VerifierAgent's.
std::vector<std::string> attempt_lines(const std::string& run_id, const AttemptRecord& attempt, const std::string& problem) {
  std::vector<std::string> lines;
  const RecordContext coder{run_id, problem, attempt.plan, attempt.index, static_cast<int>(attempt.skill),
                            attempt.feedback.kind, trajectory_reward(attempt)};
  for (const auto& e : attempt.exchanges) lines.push_back(dump(trajectory_json(coder, e)));
  if (attempt.feedback.exchange) {
    const RecordContext verifier{run_id, problem, attempt.plan, attempt.index, nullptr, attempt.feedback.kind, nullptr};
    lines.push_back(dump(trajectory_json(verifier, *attempt.feedback.exchange)));
  }
  // The rubric judge's calls: marked as the judge's, with no skill and no reward of their own.
  const RecordContext judge{run_id, problem, attempt.plan, attempt.index, nullptr, attempt.feedback.kind, nullptr};
  for (const auto& e : attempt.judge_exchanges) lines.push_back(dump(trajectory_json(judge, e)));
  return lines;
}

std::string attempt_folder(int index) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%03d", index);
  return buf;
}

// Prompt names come from file names; keep them inside prompts/.
std::string safe_name(std::string_view name, std::string_view fallback) {
  std::string out;
  for (char c : name) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-') ? c : '_';
  if (out.empty() || out.find_first_not_of('.') == std::string::npos) return std::string(fallback);
  return out;
}

}  // namespace

std::string to_json(const AttemptRecord& attempt) { return dump(attempt_json(attempt), 2); }
std::string to_json(const Exchange& exchange) { return dump(exchange_json(exchange)); }

Result<RunDirectory> RunDirectory::create(const std::string& path) {
  if (path.empty()) return fail(ErrorCode::InvalidArgument, "the run directory's path is empty");
  std::error_code ec;
  auto status = fs::status(path, ec);
  if (fs::exists(status)) {
    if (!fs::is_directory(status))
      return fail(ErrorCode::InvalidArgument, "'" + path + "' exists and is not a folder: choose another --run-dir");
    bool empty = fs::is_empty(path, ec);
    if (ec) return io_error("cannot list", path, ec);
    if (!empty)
      return fail(ErrorCode::InvalidArgument, "'" + path + "' already holds files: choose another --run-dir, or use "
                                              "--resume to continue the run there");
  }
  RunDirectory dir(path);
  for (const char* sub : {"attempts", "plans"})
    if (auto ok = make_dirs(fs::path(path) / sub); !ok) return tl::unexpected(ok.error());
  return dir;
}

Result<RunDirectory> RunDirectory::open(const std::string& path) {
  std::error_code ec;
  auto status = fs::status(path, ec);
  if (!fs::exists(status)) return fail(ErrorCode::NotFound, "run directory '" + path + "' does not exist");
  if (!fs::is_directory(status)) return fail(ErrorCode::InvalidArgument, "'" + path + "' is not a folder");
  fs::path p(path);
  if (!present(p / "config.json") && !present(p / "problem.py") && !fs::is_directory(p / "attempts", ec))
    return fail(ErrorCode::InvalidArgument,
                "'" + path + "' is not a run directory (it has no config.json, problem.py or attempts/)");
  return RunDirectory(path);
}

std::string RunDirectory::fresh_path(const std::string& root, const std::string& problem) {
  std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &utc);
  std::string base = (fs::path(root) / (std::string(stamp) + "-" + safe_name(problem, "problem"))).string();
  std::string candidate = base;
  for (int n = 2; present(candidate); ++n) candidate = base + "-" + std::to_string(n);
  return candidate;
}

Result<void> RunDirectory::write_config(const std::string& config_json) const {
  auto j = parse_json(config_json, "the run's configuration");
  if (!j) return tl::unexpected(j.error());
  redact(*j);
  return write_atomic(fs::path(path_) / "config.json", dump(*j, 2) + "\n");
}

Result<void> RunDirectory::write_problem(const Problem& problem) const {
  if (auto ok = write_atomic(fs::path(path_) / "problem.py", problem.reference); !ok) return ok;
  const Hardware& h = problem.hardware;
  Json hw = {{"gpu", h.gpu},
             {"arch", h.arch},
             {"sms", h.sms},
             {"memory_gib", h.memory_gib},
             {"dram_tb_s", h.dram_tb_s},
             {"fp32_tflops", h.fp32_tflops},
             {"tf32_tflops", h.tf32_tflops},
             {"cuda", h.cuda}};
  return write_atomic(fs::path(path_) / "hardware.json", dump(hw, 2) + "\n");
}

Result<void> RunDirectory::write_prompts(const PromptLibrary& prompts) const {
  fs::path dir = fs::path(path_) / "prompts";
  if (auto ok = make_dirs(dir); !ok) return ok;
  Json index = Json::object();
  for (const auto& [name, prompt] : prompts.prompts()) {
    std::string file = safe_name(name, "prompt") + ".md";
    if (auto ok = write_atomic(dir / file, prompt.text); !ok) return ok;
    // path: where the template was read ("" when built from a string); file: its copy in this run.
    index[name] = {{"version", prompt.version}, {"sha256", prompt.sha256}, {"path", prompt.path}, {"file", "prompts/" + file}};
  }
  return write_atomic(dir / "index.json", dump(index, 2) + "\n");
}

Result<void> RunDirectory::write_plan(int n, const ProblemPlanResult& plan, const std::string& problem,
                                      int attempts_done) const {
  if (n < 1) return fail(ErrorCode::InvalidArgument, "plan numbers start at 1, got " + std::to_string(n));
  fs::path dir = fs::path(path_) / "plans";
  if (auto ok = make_dirs(dir); !ok) return ok;
  std::string stem = "plan-" + std::to_string(n);
  if (auto ok = write_atomic(dir / (stem + ".json"), plan.plan.to_json() + "\n"); !ok) return ok;
  Json calls = Json::array();
  for (const auto& e : plan.exchanges) calls.push_back(exchange_json(e));
  if (auto ok = write_atomic(dir / (stem + ".calls.json"), dump(calls, 2) + "\n"); !ok) return ok;
  for (const auto& line : plan_lines(run_id_of(path_), n, plan, problem, attempts_done))
    if (auto ok = append_line(fs::path(path_) / "trajectories.jsonl", line); !ok) return ok;
  return {};
}

Result<void> RunDirectory::write_attempt(const AttemptRecord& attempt, const std::string& problem) const {
  if (attempt.index < 1)
    return fail(ErrorCode::InvalidArgument, "attempt numbers start at 1, got " + std::to_string(attempt.index));
  fs::path dir = fs::path(path_) / "attempts" / attempt_folder(attempt.index);
  if (auto ok = make_dirs(dir); !ok) return ok;

  std::string report = attempt.report.json;
  if (attempt.candidate.empty()) report = dump(Json{{"error", attempt.coder_error}}, 2);
  else if (report.empty()) report = dump(report_json(attempt.report), 2);  // a Verifier that wrote no JSON
  const std::pair<const char*, std::string> files[] = {
      {"candidate.py", attempt.candidate},
      {"report.json", report + "\n"},
      {"feedback.md", attempt.feedback.text},
      {"rubric.json", dump(scorecard_json(attempt.scorecard), 2) + "\n"},
      {"reward.json", dump(reward_json(attempt.reward), 2) + "\n"},
      {"attempt.json", to_json(attempt) + "\n"},  // last: its presence marks a finished attempt
  };
  for (const auto& [name, text] : files)
    if (auto ok = write_atomic(dir / name, text); !ok) return ok;
  for (const auto& line : attempt_lines(run_id_of(path_), attempt, problem))
    if (auto ok = append_line(fs::path(path_) / "trajectories.jsonl", line); !ok) return ok;
  return {};
}

Result<void> RunDirectory::write_trajectories(const Saved& saved, const std::string& problem) const {
  const std::string run_id = run_id_of(path_);
  std::string text;
  // In the order the run made the calls: each plan after the attempts that came before it.
  std::size_t next = 0;
  for (std::size_t k = 0; k < saved.plans.size(); ++k) {
    const int n = static_cast<int>(k) + 1;
    for (; next < saved.attempts.size() && saved.attempts[next].plan < n; ++next)
      for (const auto& line : attempt_lines(run_id, saved.attempts[next], problem)) text += line + "\n";
    for (const auto& line : plan_lines(run_id, n, saved.plans[k], problem, static_cast<int>(next))) text += line + "\n";
  }
  for (; next < saved.attempts.size(); ++next)
    for (const auto& line : attempt_lines(run_id, saved.attempts[next], problem)) text += line + "\n";
  return write_atomic(fs::path(path_) / "trajectories.jsonl", text);
}

Result<void> RunDirectory::write_best(const std::string& candidate) const {
  return write_atomic(fs::path(path_) / "best.py", candidate);
}

Result<void> RunDirectory::write_summary(const std::string& summary_json) const {
  if (auto j = parse_json(summary_json, "the run's summary"); !j) return tl::unexpected(j.error());
  std::string text = summary_json;
  if (text.empty() || text.back() != '\n') text += '\n';
  return write_atomic(fs::path(path_) / "summary.json", text);
}

Result<void> RunDirectory::append_event(const std::string& event_json) const {
  auto j = parse_json(event_json, "an event");
  if (!j) return tl::unexpected(j.error());
  return append_line(fs::path(path_) / "events.jsonl", dump(*j));  // re-dumped: one line, whatever came in
}

Result<RunDirectory::Saved> RunDirectory::load() const {
  Saved saved;
  fs::path root(path_);
  if (present(root / "config.json")) {
    auto text = read_text(root / "config.json");
    if (!text) return tl::unexpected(text.error());
    saved.config_json = std::move(*text);
  }
  // plan-1, plan-2... up to the first missing number.
  for (int n = 1;; ++n) {
    fs::path file = root / "plans" / ("plan-" + std::to_string(n) + ".json");
    if (!present(file)) break;
    auto text = read_text(file);
    if (!text) return tl::unexpected(text.error());
    auto plan = ProblemPlan::parse(*text);
    if (!plan) return fail(ErrorCode::InvalidArgument, quoted(file) + ": " + plan.error().message);
    ProblemPlanResult made{std::move(*plan), {}};
    // The calls that made it count in the run's usage; a plan whose calls file is gone made none known.
    fs::path calls = root / "plans" / ("plan-" + std::to_string(n) + ".calls.json");
    if (present(calls)) {
      auto calls_text = read_text(calls);
      if (!calls_text) return tl::unexpected(calls_text.error());
      auto j = parse_json(*calls_text, quoted(calls));
      if (!j) return tl::unexpected(j.error());
      if (j->is_array())
        for (const auto& e : *j) made.exchanges.push_back(exchange_from(e));
    }
    saved.plans.push_back(std::move(made));
  }

  std::vector<std::pair<int, fs::path>> folders;
  std::error_code ec;
  if (fs::is_directory(root / "attempts", ec)) {
    for (fs::directory_iterator it(root / "attempts", ec), end; !ec && it != end; it.increment(ec)) {
      std::string name = it->path().filename().string();
      if (name.empty() || name.size() > 9 || name.find_first_not_of("0123456789") != std::string::npos) continue;
      folders.emplace_back(std::stoi(name), it->path());
    }
    if (ec) return io_error("cannot list", root / "attempts", ec);
  }
  std::sort(folders.begin(), folders.end());
  for (const auto& folder : folders) {
    fs::path file = folder.second / "attempt.json";
    if (!present(file)) continue;  // interrupted before it finished: the resumed run repeats it
    auto text = read_text(file);
    if (!text) return tl::unexpected(text.error());
    auto j = parse_json(*text, quoted(file));
    if (!j) return tl::unexpected(j.error());
    auto attempt = attempt_from(*j);
    if (!attempt) return fail(ErrorCode::InvalidArgument, quoted(file) + ": " + attempt.error().message);
    saved.attempts.push_back(std::move(*attempt));
  }
  return saved;
}

}  // namespace stitchcuda::agents
