// Transcripts: the request hash, writing calls as JSONL, the recording wrapper, and the replay
// backend that answers from a transcript by hash or in order.
#include "transcript.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include <stitchcuda/detail/sha256.hpp>
#include <stitchcuda/secrets.hpp>

namespace stitchcuda::llm {
namespace {

using Json = nlohmann::json;

constexpr int kFormatVersion = 1;

Json messages_json(const std::vector<Message>& messages) {
  Json list = Json::array();
  for (const auto& m : messages) list.push_back({{"role", m.role}, {"content", m.content}});
  return list;
}

// JSON given as text is hashed by its value, so whitespace and key order do not change the hash.
Json json_text_value(const std::string& text) {
  Json parsed = Json::parse(text, nullptr, false);
  return parsed.is_discarded() ? Json(text) : parsed;
}

// The options that change what a model answers; set fields only.
Json answer_options_json(const Options& o) {
  Json j = Json::object();
  if (o.temperature) j["temperature"] = *o.temperature;
  if (o.top_p) j["top_p"] = *o.top_p;
  if (o.max_tokens) j["max_tokens"] = *o.max_tokens;
  if (!o.stop.empty()) j["stop"] = o.stop;
  if (o.seed) j["seed"] = *o.seed;
  if (!o.json_schema.empty()) j["json_schema"] = json_text_value(o.json_schema);
  if (!o.extra_json.empty()) j["extra"] = json_text_value(o.extra_json);
  return j;
}

Json completion_json(const Completion& c) {
  return {{"text", c.text},
          {"finish_reason", c.finish_reason},
          {"usage",
           {{"prompt_tokens", c.usage.prompt_tokens},
            {"completion_tokens", c.usage.completion_tokens},
            {"total_tokens", c.usage.total_tokens}}},
          {"latency_ms", c.latency_ms},
          {"model", c.model},
          {"id", c.id},
          {"attempts", c.attempts}};
}

ErrorCode code_named(const std::string& name) {
  for (auto code : {ErrorCode::InvalidArgument, ErrorCode::CompileError, ErrorCode::LaunchError, ErrorCode::CudaError,
                    ErrorCode::NotFound, ErrorCode::Unavailable, ErrorCode::IoError, ErrorCode::LlmError,
                    ErrorCode::Timeout, ErrorCode::Cancelled, ErrorCode::Internal})
    if (name == to_string(code)) return code;
  return ErrorCode::Internal;
}

std::string string_at(const Json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// A recorded outcome, as it is replayed.
Result<Completion> outcome_from(const Json& line) {
  if (auto e = line.find("error"); e != line.end() && e->is_object()) {
    Error error{code_named(string_at(*e, "code")), string_at(*e, "message"), string_at(*e, "log"), {}};
    error.http_status = e->value("http_status", 0);
    return tl::unexpected(std::move(error));  // not transient: it is what the run ended with
  }
  const Json c = line.value("completion", Json::object());
  Completion out;
  out.text = string_at(c, "text");
  out.finish_reason = string_at(c, "finish_reason");
  const Json u = c.value("usage", Json::object());
  out.usage.prompt_tokens = u.value("prompt_tokens", std::int64_t{0});
  out.usage.completion_tokens = u.value("completion_tokens", std::int64_t{0});
  out.usage.total_tokens = u.value("total_tokens", out.usage.prompt_tokens + out.usage.completion_tokens);
  out.model = string_at(c, "model");
  out.id = string_at(c, "id");
  return out;
}

class RecordingBackend final : public Backend {
 public:
  RecordingBackend(std::shared_ptr<Backend> inner, std::unique_ptr<detail::TranscriptWriter> writer)
      : Backend(inner->name()), inner_(std::move(inner)), writer_(std::move(writer)) {}

  Result<Completion> complete(const std::vector<Message>& messages, const Options& options,
                              const TextCallback& on_text) override {
    auto outcome = inner_->complete(messages, options, on_text);
    writer_->write(name(), messages, options, outcome);
    return outcome;
  }

 private:
  std::shared_ptr<Backend> inner_;
  std::unique_ptr<detail::TranscriptWriter> writer_;
};

class ReplayBackend final : public Backend {
 public:
  struct Entry {
    std::string hash;
    Result<Completion> outcome;
  };

  ReplayBackend(std::string path, std::vector<Entry> entries, ReplayMatch match)
      : Backend("replay:" + path), path_(std::move(path)), entries_(std::move(entries)), match_(match) {
    for (std::size_t i = 0; i < entries_.size(); ++i) by_hash_[entries_[i].hash].push_back(i);
  }

  Result<Completion> complete(const std::vector<Message>& messages, const Options& options,
                              const TextCallback& on_text) override {
    const auto start = std::chrono::steady_clock::now();
    auto index = pick(messages, options);
    if (!index) return tl::unexpected(index.error());
    Result<Completion> outcome = entries_[*index].outcome;
    if (!outcome) return outcome;
    outcome->latency_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    outcome->attempts = 1;
    if (options.stream && on_text && !outcome->text.empty()) on_text(outcome->text);
    return outcome;
  }

 private:
  Result<std::size_t> pick(const std::vector<Message>& messages, const Options& options) {
    if (match_ == ReplayMatch::Order) {
      const std::size_t i = next_.fetch_add(1);
      if (i >= entries_.size())
        return fail(ErrorCode::NotFound, "the transcript " + path_ + " has " + std::to_string(entries_.size()) +
                                             " calls and all were replayed; this run makes more calls than the recorded one");
      return i;
    }
    const std::string hash = request_hash(messages, options);
    std::lock_guard lock(mu_);
    auto found = by_hash_.find(hash);
    if (found == by_hash_.end())
      return fail(ErrorCode::NotFound,
                  "no call in the transcript " + path_ + " (" + std::to_string(entries_.size()) +
                      " calls) matches this request (hash " + hash.substr(0, 12) +
                      "): its messages or options differ from the recorded run's; replay in order "
                      "(replay_match=order) to answer regardless of the request");
    // The same request recorded several times is answered in recorded order, the last repeating.
    std::size_t& served = served_[hash];
    const auto& indices = found->second;
    const std::size_t i = indices[std::min(served, indices.size() - 1)];
    ++served;
    return i;
  }

  std::string path_;
  std::vector<Entry> entries_;
  ReplayMatch match_;
  std::atomic<std::size_t> next_{0};
  std::mutex mu_;
  std::unordered_map<std::string, std::vector<std::size_t>> by_hash_;
  std::unordered_map<std::string, std::size_t> served_;
};

}  // namespace

std::string request_hash(const std::vector<Message>& messages, const Options& options) {
  // nlohmann's objects are ordered maps: dump() is canonical.
  const Json request = {{"messages", messages_json(messages)}, {"options", answer_options_json(options)}};
  return stitchcuda::detail::sha256_hex(request.dump());
}

namespace detail {

Result<std::unique_ptr<TranscriptWriter>> TranscriptWriter::open(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "a");
  if (!file)
    return fail(ErrorCode::IoError, "the transcript " + path + " cannot be opened for appending (" +
                                        std::strerror(errno) + "); choose a writable path");
  return std::unique_ptr<TranscriptWriter>(new TranscriptWriter(file));
}

TranscriptWriter::~TranscriptWriter() { std::fclose(file_); }

void TranscriptWriter::write(const std::string& backend, const std::vector<Message>& messages, const Options& options,
                             const Result<Completion>& outcome) {
  Json line = {{"v", kFormatVersion},
               {"hash", request_hash(messages, options)},
               {"backend", backend},
               {"messages", messages_json(messages)},
               {"options", answer_options_json(options)}};
  if (outcome) {
    line["completion"] = completion_json(*outcome);
  } else {
    const Error& e = outcome.error();
    line["error"] = {{"code", to_string(e.code)}, {"message", e.message}, {"log", e.log}, {"http_status", e.http_status}};
  }
  // A secret in a message (or echoed in an error) is scrubbed; "[redacted]" keeps the JSON valid.
  // Invalid UTF-8 from a server is replaced rather than making the line unwritable.
  const std::string text = secrets::redact(line.dump(-1, ' ', false, Json::error_handler_t::replace)) + "\n";
  std::lock_guard lock(mu_);
  std::fwrite(text.data(), 1, text.size(), file_);
  std::fflush(file_);
}

}  // namespace detail

Result<std::shared_ptr<Backend>> record(std::shared_ptr<Backend> inner, const std::string& path) {
  if (!inner) return fail(ErrorCode::InvalidArgument, "record() needs a backend to record");
  auto writer = detail::TranscriptWriter::open(path);
  if (!writer) return tl::unexpected(writer.error());
  return std::shared_ptr<Backend>(std::make_shared<RecordingBackend>(std::move(inner), std::move(*writer)));
}

Result<std::shared_ptr<Backend>> replay_backend(const std::string& path, ReplayMatch match) {
  std::ifstream in(path);
  if (!in)
    return fail(ErrorCode::IoError, "the transcript " + path + " cannot be read (" + std::strerror(errno) +
                                        "); record one with record= / record_path, or check the path");
  std::vector<ReplayBackend::Entry> entries;
  std::string text;
  for (int number = 1; std::getline(in, text); ++number) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const Json line = Json::parse(text, nullptr, false);
    if (line.is_discarded() || !line.is_object() || !line.contains("hash") ||
        !(line.contains("completion") || line.contains("error")))
      return fail(ErrorCode::InvalidArgument, "line " + std::to_string(number) + " of the transcript " + path +
                                                  " is not a recorded call (a JSON object with hash and completion or error)");
    entries.push_back({string_at(line, "hash"), outcome_from(line)});
  }
  return std::shared_ptr<Backend>(std::make_shared<ReplayBackend>(path, std::move(entries), match));
}

}  // namespace stitchcuda::llm
