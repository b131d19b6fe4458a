// Token buckets with reservations: a reservation may take the level below zero, and the next
// caller waits for the refill, so concurrent callers queue fairly without a background thread.
#include "rate_limiter.hpp"

#include <algorithm>

namespace stitchcuda::llm::detail {

RateLimiter::RateLimiter(const RateLimits& limits) {
  const auto now = Clock::now();
  for (auto [bucket, per_minute] : {std::pair{&requests_, limits.requests_per_minute},
                                    std::pair{&tokens_, limits.tokens_per_minute}}) {
    if (per_minute <= 0) continue;
    bucket->per_second = per_minute / 60.0;
    bucket->capacity = std::max(1.0, bucket->per_second);  // one second's worth
    bucket->level = bucket->capacity;
    bucket->updated = now;
  }
}

void RateLimiter::Bucket::refill(Clock::time_point now) {
  const double elapsed = std::chrono::duration<double>(now - updated).count();
  level = std::min(capacity, level + elapsed * per_second);
  updated = now;
}

double RateLimiter::Bucket::reserve(double cost, Clock::time_point now) {
  if (per_second <= 0) return 0;
  refill(now);
  // A cost above the capacity waits for a full bucket and leaves a debt, rather than never going.
  const double needed = std::min(cost, capacity);
  const double wait = level >= needed ? 0.0 : (needed - level) / per_second;
  level -= cost;
  return wait;
}

double RateLimiter::reserve(double tokens) {
  std::lock_guard lock(mu_);
  const auto now = Clock::now();
  return std::max(requests_.reserve(1.0, now), tokens_.reserve(tokens, now));
}

void RateLimiter::correct(double token_difference) {
  std::lock_guard lock(mu_);
  if (tokens_.per_second <= 0) return;
  tokens_.refill(Clock::now());
  tokens_.level = std::min(tokens_.capacity, tokens_.level - token_difference);
}

}  // namespace stitchcuda::llm::detail
