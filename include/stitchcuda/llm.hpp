// stitchcuda::llm — one interface to the models the agents talk to: hosted APIs, local
// OpenAI-compatible servers (vLLM, SGLang, llama.cpp, Ollama), Anthropic, transcripts and scripts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <stitchcuda/error.hpp>

namespace stitchcuda::llm {

/// One turn of a conversation.
struct Message {
  std::string role;     ///< "system", "user" or "assistant"
  std::string content;  ///< the text
};

/// Lets one thread stop calls another thread is waiting on; copies share one flag.
class CancelToken {
 public:
  /// A token nobody has cancelled yet.
  CancelToken();
  /// Ends every call holding this token with ErrorCode::Cancelled (within ~25 ms).
  void cancel() const;
  /// Whether cancel() was called.
  bool cancelled() const;
  /// Sleeps up to `seconds`, waking at once on cancel(); true when cancelled.
  bool wait_for(double seconds) const;

  /// The shared flag (opaque).
  struct State;

 private:
  std::shared_ptr<State> state_;
};

/// How to answer one request. Unset sampling fields leave the server's defaults.
struct Options {
  std::optional<double> temperature;  ///< sampling temperature
  std::optional<double> top_p;        ///< nucleus sampling mass
  std::optional<int> max_tokens;      ///< completion token limit (Anthropic requires one: 4096 when unset)
  std::vector<std::string> stop;      ///< stop sequences
  std::optional<std::int64_t> seed;   ///< sampling seed, where the server honours one (Anthropic has none)
  std::string json_schema;            ///< JSON Schema the reply must follow (OpenAI-compatible servers); "" = free text
  std::string extra_json;             ///< JSON object of provider fields merged into the request body ("" = none)
  bool stream = false;                ///< stream the reply, passing pieces to the callback as they arrive
  bool allow_truncated = false;       ///< accept a reply cut at max_tokens instead of failing
  double connect_timeout_s = 10.0;    ///< limit for establishing one connection
  double timeout_s = 600.0;           ///< limit for the whole call: every attempt and wait included
  CancelToken cancel;                 ///< cancel() ends the call with ErrorCode::Cancelled
};

/// Tokens one request (or a run) consumed.
struct Usage {
  std::int64_t prompt_tokens = 0;      ///< tokens read
  std::int64_t completion_tokens = 0;  ///< tokens written
  std::int64_t total_tokens = 0;       ///< as the server counts them (usually the sum)
};

/// A model's answer.
struct Completion {
  std::string text;           ///< the reply
  std::string finish_reason;  ///< "stop", "length", "tool_calls"...: OpenAI's words, Anthropic's translated
  Usage usage;                ///< tokens, as the server reported them (zero where it did not)
  double latency_ms = 0.0;    ///< wall time of the call that produced it, retries and waits included
  std::string model;          ///< the model the server says answered
  std::string id;             ///< the provider's id of the reply ("chatcmpl-...", "msg_...")
  int attempts = 1;           ///< requests sent to get it (1 + retries)
};

/// Receives pieces of a streamed reply as they arrive, in order.
using TextCallback = std::function<void(std::string_view piece)>;

/// A model: the one thing agents need. Implementations are thread safe: several calls may run at once.
class Backend {
 public:
  /// `name` says what the backend talks to ("openai:gpt-4.1@http://..."); it never holds a secret.
  explicit Backend(std::string name) : name_(std::move(name)) {}
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  /// Answers a conversation. A failed call is an Error: LlmError (with http_status and transient
  /// set where they apply), Timeout, Cancelled, InvalidArgument for unusable messages or options.
  virtual Result<Completion> complete(const std::vector<Message>& messages, const Options& options = {},
                                      const TextCallback& on_text = {}) = 0;
  /// What this backend talks to, for logs and transcripts.
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

// ---- reliability: retries, rate limits, accounting — once, around any backend ----

/// When and how often a failed request is sent again.
struct RetryPolicy {
  int max_attempts = 4;            ///< requests per call, first included (1 = never retry)
  double initial_backoff_s = 0.5;  ///< wait before the first retry; doubles after each
  double max_backoff_s = 30.0;     ///< cap on one back-off wait
  double jitter = 0.25;            ///< each wait is scaled by a random factor in [1 - jitter, 1 + jitter]
  double max_retry_after_s = 120;  ///< a server asking to wait longer than this fails the call instead
};

/// Client-side limits, so a long run stays within the provider's quota (0 = no limit).
struct RateLimits {
  double requests_per_minute = 0;  ///< requests sent, retries included
  double tokens_per_minute = 0;    ///< prompt + completion tokens (estimated before, corrected after)
};

/// Prices in US dollars per million tokens, for the cost total (0 = not counted).
struct Prices {
  double prompt_per_million = 0;      ///< input tokens
  double completion_per_million = 0;  ///< output tokens
};

/// What ReliableBackend adds to the backend it wraps.
struct ReliabilityOptions {
  RetryPolicy retry;        ///< retries
  RateLimits limits;        ///< client-side rate limits
  Prices prices;            ///< for cost_usd
  std::string record_path;  ///< append every call to this JSONL transcript ("" = no transcript)
};

/// Counters of a ReliableBackend since it was made: the usage and cost of a run.
struct Totals {
  std::int64_t calls = 0;     ///< complete() calls
  std::int64_t attempts = 0;  ///< requests sent
  std::int64_t retries = 0;   ///< requests sent again after a transient failure
  std::int64_t failures = 0;  ///< calls that ended in an error
  Usage usage;                ///< tokens of the successful calls
  double cost_usd = 0;        ///< from Prices
};

/// Wraps any backend with retries (exponential back-off with jitter on connection errors, 408, 409,
/// 429, 5xx and 529, honouring Retry-After; none on other statuses), the call's timeout and
/// cancellation, client-side rate limits, a length check, usage and cost totals, and a transcript.
class ReliableBackend final : public Backend {
 public:
  /// Fails when the transcript cannot be opened for appending.
  static Result<std::shared_ptr<ReliableBackend>> wrap(std::shared_ptr<Backend> inner,
                                                       ReliabilityOptions options = {});
  ~ReliableBackend() override;

  /// The wrapped backend's answer; see the class comment for what is added.
  Result<Completion> complete(const std::vector<Message>& messages, const Options& options = {},
                              const TextCallback& on_text = {}) override;
  /// Counters since this backend was made.
  Totals totals() const;
  /// The backend it wraps.
  const std::shared_ptr<Backend>& inner() const;

  /// Internal state (opaque).
  struct Impl;

 private:
  explicit ReliableBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- backends ----

/// Where an HTTP model server is and how to authenticate; nothing here is ever printed but the URL.
struct ServerConfig {
  std::string model;        ///< model name as the server knows it
  std::string base_url;     ///< "" = the provider's hosted API; else e.g. "http://127.0.0.1:8000/v1"
  std::string api_key_env;  ///< variable holding the key; "" = OPENAI_API_KEY or ANTHROPIC_API_KEY
  std::string api_key;      ///< the key itself, instead of the variable (never written anywhere)
  std::string organization; ///< OpenAI-Organization header ("" = none)
  std::vector<std::pair<std::string, std::string>> headers;  ///< further HTTP headers: name, value
  std::string anthropic_version = "2023-06-01";  ///< anthropic-version header
  std::size_t max_reply_bytes = 32u << 20;       ///< longer replies fail instead of filling memory
};

/// An OpenAI-compatible chat-completions server (OpenAI, vLLM, SGLang, llama.cpp, Ollama...).
/// The key is required for the hosted API (no base_url) or when api_key_env is named; a local
/// server gets one only where the variable is set.
Result<std::shared_ptr<Backend>> openai_backend(ServerConfig config);
/// Anthropic's Messages API; the key rule is the same, with ANTHROPIC_API_KEY.
Result<std::shared_ptr<Backend>> anthropic_backend(ServerConfig config);

/// How a replay finds the recorded answer to a request.
enum class ReplayMatch {
  Hash,   ///< by request_hash(); one request recorded several times is answered in recorded order
  Order,  ///< the n-th call gets the n-th record, whatever it asks
};
/// Answers from a JSONL transcript written by ReliableBackend or record(): a run reproduced exactly,
/// recorded errors included.
Result<std::shared_ptr<Backend>> replay_backend(const std::string& path, ReplayMatch match = ReplayMatch::Hash);
/// Wraps `inner` so every call is appended to a JSONL transcript at `path` (no secret is written).
Result<std::shared_ptr<Backend>> record(std::shared_ptr<Backend> inner, const std::string& path);
/// The key a transcript stores a request under: SHA-256 of the messages and of the options that
/// change the answer (not stream, timeouts or cancellation).
std::string request_hash(const std::vector<Message>& messages, const Options& options);

/// One rule of a scripted backend.
struct ScriptRule {
  std::string pattern;               ///< ECMAScript regular expression searched in the last user message
  std::vector<std::string> replies;  ///< given in turn, the last one repeating
};
/// Answers by the first rule whose pattern matches; NotFound when none does. For tests.
Result<std::shared_ptr<Backend>> scripted_backend(std::vector<ScriptRule> rules, std::string name = "scripted");
/// Reads rules from a JSON file: [{"pattern": "...", "reply": "..."} or {"pattern", "replies": [...]}, ...].
Result<std::vector<ScriptRule>> load_script(const std::string& path);

// ---- one spec string for the CLI and Python ----

/// A parsed PROVIDER:MODEL[@BASE_URL].
struct Spec {
  std::string provider;  ///< "openai", "anthropic", "replay", "scripted"
  std::string model;     ///< model name, or the file of replay: and scripted:
  std::string base_url;  ///< "" = the provider's default
};

/// The providers connect() knows.
std::vector<std::string> known_providers();
/// Parses "openai:gpt-4.1", "openai:qwen3-32b@http://127.0.0.1:8000/v1", "anthropic:claude-sonnet-4-5",
/// "replay:runs/x/llm.jsonl", "scripted:rules.json"; InvalidArgument says what is wrong.
Result<Spec> parse_spec(std::string_view spec);

/// Everything connect() may be told besides the spec.
struct ConnectOptions {
  ServerConfig server;                    ///< model and base_url are taken from the spec
  ReplayMatch replay_match = ReplayMatch::Hash;  ///< for replay:
  ReliabilityOptions reliability;         ///< retries, limits, prices, transcript
};

/// The backend a spec names, wrapped in ReliableBackend. Fails at once on an unknown provider, a
/// malformed spec, a missing API key (naming the variable to set) or an unreadable file.
Result<std::shared_ptr<ReliableBackend>> connect(std::string_view spec, const ConnectOptions& options = {});

}  // namespace stitchcuda::llm
