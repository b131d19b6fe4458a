// ReliableBackend: the policy every backend is used through — rate limits, retries with back-off,
// one deadline and cancellation for the whole call, the length check, totals and the transcript.
#include <stitchcuda/llm.hpp>
#include <stitchcuda/secrets.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <random>

#include "rate_limiter.hpp"
#include "transcript.hpp"

namespace stitchcuda::llm {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_until(Clock::time_point deadline) {
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

std::string seconds_text(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", s);
  return text;
}

// A rough token count before the server says: about four characters a token in English and code.
double estimated_tokens(const std::vector<Message>& messages, const Options& options) {
  std::size_t chars = 0;
  for (const auto& m : messages) chars += m.content.size();
  return double(chars) / 4.0 + options.max_tokens.value_or(0);
}

Error with_note(Error e, const std::string& note) {
  e.message += " (" + note + ")";
  return e;
}

}  // namespace

struct ReliableBackend::Impl {
  std::shared_ptr<Backend> inner;
  ReliabilityOptions options;
  detail::RateLimiter limiter;
  std::unique_ptr<detail::TranscriptWriter> transcript;
  mutable std::mutex mu;  // guards totals and random
  Totals totals;
  std::mt19937_64 random{std::random_device{}()};

  Impl(std::shared_ptr<Backend> inner_backend, ReliabilityOptions reliability)
      : inner(std::move(inner_backend)), options(std::move(reliability)), limiter(options.limits) {}

  double backoff(int retry) {
    const RetryPolicy& p = options.retry;
    const double base = std::min(p.max_backoff_s, p.initial_backoff_s * std::pow(2.0, retry - 1));
    std::lock_guard lock(mu);
    std::uniform_real_distribution<double> factor(1.0 - p.jitter, 1.0 + p.jitter);
    return std::max(0.0, base * factor(random));
  }

  // Waits for the rate limiter; an error when the wait is cancelled or would pass the deadline.
  Result<void> wait_for_quota(double tokens, Clock::time_point deadline, const CancelToken& cancel) {
    const double wait = limiter.reserve(tokens);
    if (wait <= 0) return {};
    if (wait > seconds_until(deadline))
      return fail(ErrorCode::Timeout, "the client-side rate limit (requests_per_minute / tokens_per_minute) would "
                                      "delay this call by " + seconds_text(wait) + " s, past its timeout");
    if (cancel.wait_for(wait)) return fail(ErrorCode::Cancelled, "cancelled while waiting for the rate limit");
    return {};
  }

  template <class Change>
  void count(Change&& change) {
    std::lock_guard lock(mu);
    change(totals);
  }

  // A reply cut at max_tokens is a failure unless the caller accepts partial replies.
  Result<Completion> check_length(Completion c, const Options& o, const std::string& name) const {
    if (c.finish_reason != "length" || o.allow_truncated) return c;
    Error e{ErrorCode::LlmError,
            name + ": the reply hit the length limit (finish_reason 'length'" +
                (o.max_tokens ? ", max_tokens = " + std::to_string(*o.max_tokens) : std::string()) + ", " +
                std::to_string(c.usage.completion_tokens) +
                " completion tokens) and is cut off; raise max_tokens, or set allow_truncated to accept partial replies",
            c.text,
            {}};
    e.http_status = 200;
    return tl::unexpected(std::move(e));
  }
};

ReliableBackend::ReliableBackend(std::unique_ptr<Impl> impl)
    : Backend(impl->inner->name()), impl_(std::move(impl)) {}

ReliableBackend::~ReliableBackend() = default;

Result<std::shared_ptr<ReliableBackend>> ReliableBackend::wrap(std::shared_ptr<Backend> inner,
                                                               ReliabilityOptions options) {
  if (!inner) return fail(ErrorCode::InvalidArgument, "ReliableBackend::wrap needs a backend");
  if (options.retry.max_attempts < 1)
    return fail(ErrorCode::InvalidArgument, "max_attempts = " + std::to_string(options.retry.max_attempts) +
                                                "; it counts the first request, so it must be at least 1");
  if (options.retry.jitter < 0 || options.retry.jitter > 1)
    return fail(ErrorCode::InvalidArgument, "jitter must be between 0 and 1");
  auto impl = std::make_unique<Impl>(std::move(inner), std::move(options));
  if (!impl->options.record_path.empty()) {
    auto writer = detail::TranscriptWriter::open(impl->options.record_path);
    if (!writer) return tl::unexpected(writer.error());
    impl->transcript = std::move(*writer);
  }
  return std::shared_ptr<ReliableBackend>(new ReliableBackend(std::move(impl)));
}

Result<Completion> ReliableBackend::complete(const std::vector<Message>& sent_messages, const Options& options,
                                             const TextCallback& on_text) {
  Impl& impl = *impl_;
  // No secret the process knows leaves in a prompt, nor comes back in a reply (a model echoing a key).
  std::vector<Message> messages = sent_messages;
  for (Message& m : messages) m.content = secrets::redact(m.content);
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(std::clamp(options.timeout_s, 0.0, 1e6)));
  const double estimate = estimated_tokens(messages, options);
  impl.count([](Totals& t) { ++t.calls; });

  bool delivered = false;  // once text reached the caller, a retry would repeat it
  const TextCallback forward = on_text ? TextCallback([&](std::string_view piece) {
    delivered = true;
    on_text(secrets::redact(piece));  // a key split across two pieces keeps at most 7 characters in each
  })
                                       : TextCallback();
  Result<Completion> outcome = fail(ErrorCode::Internal, "no attempt was made");
  int sent = 0;  // requests sent so far
  for (;;) {
    // Every request takes a request slot; only the first takes the tokens (a retry replaces it).
    if (auto quota = impl.wait_for_quota(sent == 0 ? estimate : 0.0, deadline, options.cancel); !quota) {
      outcome = tl::unexpected(quota.error());
      break;
    }
    Options this_try = options;
    this_try.timeout_s = seconds_until(deadline);
    this_try.connect_timeout_s = std::min(options.connect_timeout_s, this_try.timeout_s);
    if (this_try.timeout_s <= 0) {
      outcome = fail(ErrorCode::Timeout, "the call's " + seconds_text(options.timeout_s) + " s timeout passed");
      break;
    }
    outcome = impl.inner->complete(messages, this_try, forward);
    ++sent;
    impl.count([](Totals& t) { ++t.attempts; });
    if (outcome) break;

    const Error& e = outcome.error();
    if (!e.transient || delivered || sent >= impl.options.retry.max_attempts) break;
    const bool asked = e.retry_after_s >= 0;
    if (asked && e.retry_after_s > impl.options.retry.max_retry_after_s) {
      outcome = tl::unexpected(with_note(e, "the server asked to retry after " + seconds_text(e.retry_after_s) +
                                                " s, more than max_retry_after_s"));
      break;
    }
    const double wait = asked ? e.retry_after_s : impl.backoff(sent);
    if (wait >= seconds_until(deadline)) {
      outcome = tl::unexpected(with_note(e, "not retried: waiting " + seconds_text(wait) +
                                                " s would pass the call's timeout"));
      break;
    }
    impl.count([](Totals& t) { ++t.retries; });
    if (options.cancel.wait_for(wait)) {
      outcome = tl::unexpected(with_note(Error{ErrorCode::Cancelled, "cancelled while waiting to retry", {}, {}},
                                         "last failure: " + e.message));
      break;
    }
  }

  if (outcome) {
    outcome->text = secrets::redact(outcome->text);
    const Usage& u = outcome->usage;
    impl.limiter.correct(double(u.prompt_tokens + u.completion_tokens) - estimate);
    const Prices& p = impl.options.prices;
    const double cost = (double(u.prompt_tokens) * p.prompt_per_million +
                         double(u.completion_tokens) * p.completion_per_million) / 1e6;
    impl.count([&](Totals& t) {
      t.usage.prompt_tokens += u.prompt_tokens;
      t.usage.completion_tokens += u.completion_tokens;
      t.usage.total_tokens += u.total_tokens;
      t.cost_usd += cost;
    });
    outcome->latency_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    outcome->attempts = sent;
    outcome = impl.check_length(std::move(*outcome), options, name());
  } else if (sent > 1 && outcome.error().code != ErrorCode::Cancelled) {
    outcome = tl::unexpected(with_note(outcome.error(), "gave up after " + std::to_string(sent) + " attempts"));
  }
  if (!outcome) impl.count([](Totals& t) { ++t.failures; });
  if (impl.transcript) impl.transcript->write(name(), messages, options, outcome);
  return outcome;
}

Totals ReliableBackend::totals() const {
  std::lock_guard lock(impl_->mu);
  return impl_->totals;
}

const std::shared_ptr<Backend>& ReliableBackend::inner() const { return impl_->inner; }

}  // namespace stitchcuda::llm
