// The batcher: window, batch assembly with zero padding, split of the answers (batcher.hpp).
#include "batcher.hpp"

#include <cstring>

#include <nlohmann/json.hpp>

namespace stitchcuda_server {

std::string BatcherMetrics::json() const {
  return nlohmann::json{{"requests", requests}, {"batches", batches},         {"padded_rows", padded_rows},
                        {"failed", failed},     {"refused", refused},         {"queued", queued},
                        {"batch_sizes", batch_sizes}}
      .dump();
}

Batcher::Batcher(ServedModel model, Runner& runner, BatcherOptions options)
    : model_(std::move(model)), runner_(runner), options_(options) {
  metrics_.batch_sizes.assign(std::size_t(model_.max_batch) + 1, 0);
  for (int w = 0; w < std::max(1, options_.workers); ++w) workers_.emplace_back([this, w] { work(w); });
}

Batcher::~Batcher() { drain(); }

std::optional<std::future<Answer>> Batcher::submit(Sample sample) {
  std::lock_guard lock(mutex_);
  if (draining_ || queue_.size() >= options_.max_queue) {
    metrics_.refused++;
    return std::nullopt;
  }
  queue_.push_back({std::move(sample), {}, std::chrono::steady_clock::now()});
  auto future = queue_.back().promise.get_future();
  // A worker waits for a full batch or the window's end: a full batch wakes it early.
  wake_.notify_one();
  return future;
}

void Batcher::drain() {
  {
    std::lock_guard lock(mutex_);
    draining_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_)
    if (t.joinable()) t.join();
}

BatcherMetrics Batcher::metrics() const {
  std::lock_guard lock(mutex_);
  BatcherMetrics m = metrics_;
  m.queued = queue_.size();
  return m;
}

void Batcher::work(int worker) {
  const auto full = std::size_t(model_.max_batch);
  for (;;) {
    std::vector<Pending> batch;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return draining_ || !queue_.empty(); });
      if (queue_.empty()) return;  // draining, nothing left
      // The oldest request's window bounds the wait: run when the batch is full, the window ends or the
      // server drains (a draining server does not wait for company).
      const auto deadline = queue_.front().queued + options_.max_wait;
      wake_.wait_until(lock, deadline, [&] { return draining_ || queue_.size() >= full; });
      if (queue_.empty()) continue;  // another worker took them
      const std::size_t n = std::min(full, queue_.size());
      for (std::size_t i = 0; i < n; ++i) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      if (!queue_.empty()) wake_.notify_one();  // the rest start their own window now
    }
    run_batch(worker, batch);
  }
}

void Batcher::run_batch(int worker, std::vector<Pending>& batch) {
  const int real = int(batch.size());
  const auto rows = std::size_t(model_.rows_for(real));
  // Row r of input i is request r's sample; rows past the batch (a program's fixed batch) stay zero.
  std::vector<std::string> inputs;
  for (std::size_t i = 0; i < model_.inputs.size(); ++i) {
    const std::size_t row = model_.inputs[i].bytes();
    std::string buf(row * rows, '\0');
    for (std::size_t r = 0; r < batch.size(); ++r) std::memcpy(buf.data() + r * row, batch[r].sample.inputs[i].data(), row);
    inputs.push_back(std::move(buf));
  }
  std::vector<std::string> outputs(model_.outputs.size());
  std::string error;
  try {
    error = runner_.run(worker, inputs, outputs);
  } catch (const std::exception& e) {  // a runner's bug fails its batch, not the server
    error = std::string("the runner threw: ") + e.what();
  }
  for (std::size_t o = 0; error.empty() && o < outputs.size(); ++o)
    if (outputs[o].size() != model_.outputs[o].bytes() * rows)
      error = "the runner returned " + std::to_string(outputs[o].size()) + " bytes for output '" +
              model_.outputs[o].name + "', expected " + std::to_string(model_.outputs[o].bytes() * rows);
  {
    std::lock_guard lock(mutex_);
    metrics_.batches++;
    metrics_.requests += std::uint64_t(real);
    metrics_.padded_rows += rows - std::size_t(real);
    metrics_.batch_sizes[std::size_t(real)]++;
    if (!error.empty()) metrics_.failed += std::uint64_t(real);
  }
  for (std::size_t r = 0; r < batch.size(); ++r) {
    Answer a;
    a.batch_rows = real;
    a.padded_rows = int(rows) - real;
    a.error = error;
    if (error.empty())
      for (std::size_t o = 0; o < outputs.size(); ++o) {
        const std::size_t row = model_.outputs[o].bytes();
        a.outputs.emplace_back(outputs[o].data() + r * row, row);
      }
    batch[r].promise.set_value(std::move(a));
  }
}

}  // namespace stitchcuda_server
