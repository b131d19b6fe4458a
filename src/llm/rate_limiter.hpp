// Client-side rate limits: token buckets for requests and tokens per minute that refill
// continuously. A caller reserves before sending and is told how long to wait first.
#pragma once

#include <chrono>
#include <mutex>

#include <stitchcuda/llm.hpp>

namespace stitchcuda::llm::detail {

/// Spreads requests evenly: bursts of at most one second's worth, then the per-minute rate.
class RateLimiter {
 public:
  explicit RateLimiter(const RateLimits& limits);
  /// Reserves one request and an estimate of its tokens; returns the seconds to wait before sending.
  double reserve(double tokens);
  /// Corrects the token reservation once the real count is known (positive: more were used).
  void correct(double token_difference);

 private:
  using Clock = std::chrono::steady_clock;
  struct Bucket {
    double per_second = 0;  // 0: no limit
    double capacity = 0;
    double level = 0;       // negative: reserved ahead of the refill
    Clock::time_point updated;
    void refill(Clock::time_point now);
    double reserve(double cost, Clock::time_point now);
  };
  std::mutex mu_;
  Bucket requests_;
  Bucket tokens_;
};

}  // namespace stitchcuda::llm::detail
