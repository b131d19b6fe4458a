// CancelToken: a flag shared by copies, with a wait that wakes as soon as it is raised.
#include <stitchcuda/llm.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>

namespace stitchcuda::llm {

struct CancelToken::State {
  std::atomic<bool> cancelled{false};
  std::mutex mu;
  std::condition_variable wake;
};

CancelToken::CancelToken() : state_(std::make_shared<State>()) {}

void CancelToken::cancel() const {
  {
    std::lock_guard lock(state_->mu);  // a waiter between its check and its wait must not miss this
    state_->cancelled = true;
  }
  state_->wake.notify_all();
}

bool CancelToken::cancelled() const { return state_->cancelled.load(std::memory_order_relaxed); }

bool CancelToken::wait_for(double seconds) const {
  std::unique_lock lock(state_->mu);
  if (seconds > 0) {
    // Capped: a huge wait would overflow the clock arithmetic, and nobody waits eleven days.
    state_->wake.wait_for(lock, std::chrono::duration<double>(std::min(seconds, 1e6)),
                          [&] { return state_->cancelled.load(); });
  }
  return state_->cancelled.load();
}

}  // namespace stitchcuda::llm
