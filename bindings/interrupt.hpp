// Native work that may take long (a model call, the optimization loop) runs on a worker thread with
// the GIL released while the calling thread looks for Ctrl-C; a signal or a Python callback's
// exception cancels the work and is raised once it has returned.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include <stitchcuda/error.hpp>
#include <stitchcuda/llm.hpp>

namespace stitchcuda::bindings {

/// The first Python exception raised while the work runs (by a callback, or KeyboardInterrupt from a
/// signal); keeping one cancels the work through `cancel`.
struct PendingError {
  std::mutex mu;
  std::optional<pybind11::error_already_set> error;
  llm::CancelToken cancel;

  void keep(pybind11::error_already_set&& e) {
    {
      std::lock_guard lock(mu);
      if (!error) error.emplace(std::move(e));
    }
    cancel.cancel();
  }
  bool set() {
    std::lock_guard lock(mu);
    return error.has_value();
  }
  /// Raises the kept exception, if any (with the GIL held).
  void raise() {
    if (error) throw std::move(*error);
  }
};

/// Runs `work` (returning Result<T>) on a worker thread with the GIL released, checking for signals
/// every 50 ms on this thread; a C++ exception escaping `work` becomes an Internal error naming `what`.
template <class T, class Work>
Result<T> run_interruptible(Work&& work, PendingError& pending, const std::string& what) {
  Result<T> result = fail(ErrorCode::Internal, what + " did not run");
  pybind11::gil_scoped_release release;
  std::mutex mu;
  std::condition_variable finished;
  bool done = false;
  std::thread worker([&] {
    Result<T> r = fail(ErrorCode::Internal, "unset");
    try {
      r = work();
    } catch (const std::exception& e) {  // nothing may escape a thread
      r = fail(ErrorCode::Internal, what + " threw: " + e.what());
    }
    std::lock_guard lock(mu);
    result = std::move(r);
    done = true;
    finished.notify_all();
  });
  std::unique_lock lock(mu);
  while (!finished.wait_for(lock, std::chrono::milliseconds(50), [&] { return done; })) {
    lock.unlock();
    {
      pybind11::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() != 0) pending.keep(pybind11::error_already_set());
    }
    lock.lock();
  }
  lock.unlock();
  worker.join();
  return result;
}

}  // namespace stitchcuda::bindings
