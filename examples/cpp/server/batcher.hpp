// The batching server's batcher (no torch, no HTTP): a bounded queue of samples, workers that gather up to
// the largest batch within a latency window, pad the rest with zero rows where a program runs one batch
// size (a family runs the batch as it is), run it once through a Runner and hand each request its rows.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model.hpp"

namespace stitchcuda_server {

/// Runs whole batches: the GPU program (main.cpp), or a CPU computation in the tests.
class Runner {
 public:
  virtual ~Runner() = default;
  /// `inputs`: one buffer per program input, of ServedModel::rows_for(requests) rows each: max_batch for a
  /// program (padding rows are zero), the batch's requests for a family. Fills `outputs` (one buffer per
  /// program output, as many rows) and returns "", or returns why it failed.
  /// Worker `worker` calls it only from its own thread, so a runner may keep a stream per worker.
  virtual std::string run(int worker, const std::vector<std::string>& inputs, std::vector<std::string>& outputs) = 0;
};

/// One request's result: its outputs (one sample's rows), or the error that failed its batch.
struct Answer {
  std::vector<std::string> outputs;
  std::string error;      ///< "" when it ran
  int batch_rows = 0;     ///< requests in the batch it ran in
  int padded_rows = 0;    ///< zero rows added to fill that batch
};

struct BatcherOptions {
  std::chrono::microseconds max_wait{1000};  ///< longest a request waits for others to fill its batch
  std::size_t max_queue = 4096;              ///< queued samples at most; beyond it submit refuses (503)
  int workers = 1;                           ///< batches in flight at once (each its own stream)
};

/// Counters since start.
struct BatcherMetrics {
  std::uint64_t requests = 0;     ///< samples answered (ran or failed)
  std::uint64_t batches = 0;      ///< runs of the program
  std::uint64_t padded_rows = 0;  ///< zero rows run to fill partial batches (a fixed-batch program's)
  std::uint64_t failed = 0;       ///< samples whose batch failed
  std::uint64_t refused = 0;      ///< submits refused (queue full or draining)
  std::uint64_t queued = 0;       ///< waiting now
  std::vector<std::uint64_t> batch_sizes;  ///< [n]: batches that held n requests (index 0 unused)
  std::string json() const;
};

class Batcher {
 public:
  Batcher(ServedModel model, Runner& runner, BatcherOptions options);
  ~Batcher();  ///< drains
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  /// Queues one sample; its future is answered once its batch ran. Empty (refused) when the queue is full
  /// or the batcher drains. Samples must have the model's per-sample sizes (parse_request checks them).
  std::optional<std::future<Answer>> submit(Sample sample);
  /// Stops taking samples, runs every queued one, joins the workers. Idempotent.
  void drain();
  BatcherMetrics metrics() const;
  const ServedModel& model() const { return model_; }

 private:
  struct Pending {
    Sample sample;
    std::promise<Answer> promise;
    std::chrono::steady_clock::time_point queued;
  };
  void work(int worker);
  void run_batch(int worker, std::vector<Pending>& batch);

  ServedModel model_;
  Runner& runner_;
  BatcherOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Pending> queue_;
  bool draining_ = false;
  BatcherMetrics metrics_;
  std::vector<std::thread> workers_;
};

}  // namespace stitchcuda_server
