// The batcher without a GPU: concurrent submitters get their own answers, batches never exceed the
// program's batch, the latency window holds, padding is counted, failures and draining lose nothing.
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "batcher.hpp"
#include "catch_shim.hpp"
#include "server/cpu_runner.hpp"

using namespace stitchcuda_server;
using namespace std::chrono_literals;
using stitchcuda_test::contains;

namespace {

constexpr int kBatch = 4, kIn = 3, kOut = 2;

ServedModel linear_model() {
  std::string why;
  auto m = ServedModel::from_program(stitchcuda_test::linear_program(kBatch, kIn, kOut), why);
  REQUIRE(m);
  return *m;
}

Sample sample_of(float a, float b, float c) {
  const float x[kIn] = {a, b, c};
  return {{std::string(reinterpret_cast<const char*>(x), sizeof x)}, false};
}

std::vector<float> floats(const std::string& bytes) {
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

// Records what each batch held: the rows past the real ones must be zero.
class RecordingRunner : public stitchcuda_test::CpuLinearRunner {
 public:
  using CpuLinearRunner::CpuLinearRunner;
  std::string run(int worker, const std::vector<std::string>& in, std::vector<std::string>& out) override {
    {
      std::lock_guard lock(seen_mu);
      rows_seen.push_back(in[0].size() / (kIn * sizeof(float)));
    }
    if (fail) return "device lost (test)";
    if (hold.count()) std::this_thread::sleep_for(hold);
    return CpuLinearRunner::run(worker, in, out);
  }
  bool fail = false;
  std::chrono::milliseconds hold{0};
  std::mutex seen_mu;
  std::vector<std::size_t> rows_seen;  // rows handed over, per batch
};

}  // namespace

TEST_CASE("server batcher: concurrent submitters each get their own rows, in batches of at most B", "[server]") {
  auto p = stitchcuda_test::linear_program(kBatch, kIn, kOut);
  RecordingRunner runner(p);
  Batcher batcher(linear_model(), runner, {.max_wait = 2ms, .max_queue = 10000, .workers = 2});
  constexpr int kThreads = 8, kEach = 60;
  std::atomic<int> wrong{0}, lost{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < kThreads; ++t)
    clients.emplace_back([&, t] {
      for (int r = 0; r < kEach; ++r) {
        const float a = float(t), b = float(r), c = float(t * 1000 + r);  // unique per request
        auto f = batcher.submit(sample_of(a, b, c));
        if (!f) {
          lost++;
          continue;
        }
        Answer ans = f->get();
        const float x[kIn] = {a, b, c};
        if (!ans.error.empty() || ans.outputs.size() != 1 || floats(ans.outputs[0]) != runner.row(x)) wrong++;
        if (ans.batch_rows < 1 || ans.batch_rows > kBatch || ans.batch_rows + ans.padded_rows != kBatch) wrong++;
      }
    });
  for (auto& c : clients) c.join();
  CHECK(lost == 0);
  CHECK(wrong == 0);
  auto m = batcher.metrics();
  CHECK(m.requests == kThreads * kEach);
  CHECK(m.failed == 0);
  REQUIRE(m.batch_sizes.size() == kBatch + 1);
  std::uint64_t rows = 0, batches = 0;
  for (std::size_t n = 0; n < m.batch_sizes.size(); ++n) rows += n * m.batch_sizes[n], batches += m.batch_sizes[n];
  CHECK(rows == kThreads * kEach);
  CHECK(batches == m.batches);
  CHECK(m.batches == std::uint64_t(runner.calls));
  CHECK(m.padded_rows == m.batches * kBatch - rows);
  // Eight clients against a batch of four: most batches must have gathered company.
  CHECK(m.batches < std::uint64_t(kThreads * kEach));
}

TEST_CASE("server batcher: a lone request waits out the window, a full batch does not wait", "[server]") {
  auto p = stitchcuda_test::linear_program(kBatch, kIn, kOut);
  RecordingRunner runner(p);
  {
    Batcher batcher(linear_model(), runner, {.max_wait = 80ms});
    const auto t0 = std::chrono::steady_clock::now();
    auto f = batcher.submit(sample_of(1, 2, 3));
    REQUIRE(f);
    Answer a = f->get();
    const auto waited = std::chrono::steady_clock::now() - t0;
    CHECK(waited >= 80ms);
    CHECK(waited < 2s);
    CHECK(a.batch_rows == 1);
    CHECK(a.padded_rows == kBatch - 1);
    CHECK(batcher.metrics().padded_rows == kBatch - 1);
  }
  {
    Batcher batcher(linear_model(), runner, {.max_wait = 20s});
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::future<Answer>> fs;
    for (int i = 0; i < kBatch; ++i) fs.push_back(*batcher.submit(sample_of(float(i), 0, 0)));
    for (auto& f : fs) {
      Answer a = f.get();
      CHECK(a.batch_rows == kBatch);
      CHECK(a.padded_rows == 0);
    }
    CHECK(std::chrono::steady_clock::now() - t0 < 5s);
    CHECK(batcher.metrics().padded_rows == 0);
  }
}

TEST_CASE("server batcher: a failed batch answers each of its requests with the error", "[server]") {
  auto p = stitchcuda_test::linear_program(kBatch, kIn, kOut);
  RecordingRunner runner(p);
  runner.fail = true;
  Batcher batcher(linear_model(), runner, {.max_wait = 1ms});
  auto f = batcher.submit(sample_of(1, 1, 1));
  REQUIRE(f);
  Answer a = f->get();
  CHECK(contains(a.error, "device lost (test)"));
  CHECK(batcher.metrics().failed == 1);
  runner.fail = false;
  CHECK(batcher.submit(sample_of(1, 1, 1))->get().error.empty());  // and the next batch runs
}

TEST_CASE("server batcher: draining runs every queued request, then refuses new ones", "[server]") {
  auto p = stitchcuda_test::linear_program(kBatch, kIn, kOut);
  RecordingRunner runner(p);
  // Fewer than a batch, with a long window: without the drain they would wait 10 s.
  Batcher batcher(linear_model(), runner, {.max_wait = 10s, .max_queue = 3});
  std::vector<std::future<Answer>> fs;
  for (int i = 0; i < 3; ++i) fs.push_back(*batcher.submit(sample_of(float(i), 0, 0)));
  CHECK_FALSE(batcher.submit(sample_of(9, 9, 9)));  // the queue holds 3 at most
  const auto t0 = std::chrono::steady_clock::now();
  batcher.drain();
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  for (auto& f : fs) {
    REQUIRE(f.wait_for(0s) == std::future_status::ready);
    CHECK(f.get().error.empty());
  }
  CHECK_FALSE(batcher.submit(sample_of(1, 1, 1)));
  auto m = batcher.metrics();
  CHECK(m.requests == 3);
  CHECK(m.refused == 2);
}

TEST_CASE("server batcher: a family's partial batches run at their own size, unpadded", "[server]") {
  std::string why;
  auto family = stitchcuda_test::linear_family({1, 2, 4}, kIn, kOut, true);
  auto model = ServedModel::from_family(family, why);
  REQUIRE(model);
  RecordingRunner runner(family.members[0].program);
  Batcher batcher(*model, runner, {.max_wait = 30ms});
  std::vector<std::future<Answer>> fs;
  for (int i = 0; i < 3; ++i) fs.push_back(*batcher.submit(sample_of(float(i), 1, -1)));
  for (int i = 0; i < 3; ++i) {
    Answer a = fs[std::size_t(i)].get();
    const float x[kIn] = {float(i), 1, -1};
    CHECK(a.error.empty());
    CHECK(floats(a.outputs.at(0)) == runner.row(x));
    CHECK(a.batch_rows == 3);
    CHECK(a.padded_rows == 0);
  }
  auto m = batcher.metrics();
  CHECK(m.batches == 1);
  CHECK(m.padded_rows == 0);
  CHECK(m.batch_sizes.at(3) == 1);
  CHECK(runner.rows_seen == std::vector<std::size_t>{3});  // the runner got three rows, not four
}
