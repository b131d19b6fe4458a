// The batching server end to end on 127.0.0.1 without a GPU: a .stitch saved and loaded, the real HTTP
// front and batcher, a CPU runner computing the program, and real HTTP clients, good and bad.
#include <cstring>
#include <mutex>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "catch_shim.hpp"
#include "http.hpp"
#include "server/cpu_runner.hpp"
#include "temp_dir.hpp"

using namespace stitchcuda_server;
using namespace std::chrono_literals;
using stitchcuda_test::contains;
using nlohmann::json;

namespace {

// The front on an ephemeral port of 127.0.0.1, listening on its own thread until the test ends.
struct LiveServer {
  LiveServer(Batcher& batcher, HttpOptions options) {
    install_routes(server, batcher, options);
    port = bind_server(server, "127.0.0.1", 0);
    REQUIRE(port > 0);
    thread = std::thread([this] { server.listen_after_bind(); });
  }
  ~LiveServer() {
    server.stop();
    thread.join();
  }
  httplib::Server server;
  int port = 0;
  std::thread thread;
};

std::string body_for(const std::vector<float>& x) {
  return json{{"inputs", {{{"dtype", "f32"}, {"shape", {x.size()}}, {"data", x}}}}}.dump();
}

}  // namespace

TEST_CASE("server http: concurrent clients get their own answers; bad requests get 4xx and it stays up", "[server]") {
  constexpr int kBatch = 8, kIn = 5, kOut = 3;
  stitchcuda_test::TempDir dir;
  const std::string path = dir.str() + "/linear.stitch";
  REQUIRE(stitchcuda_test::linear_program(kBatch, kIn, kOut).save(path));
  auto loaded = stitchcuda::program::Program::load(path);
  REQUIRE(loaded);
  std::string why;
  auto model = ServedModel::from_program(*loaded, why);
  REQUIRE(model);
  stitchcuda_test::CpuLinearRunner runner(*loaded);
  Batcher batcher(*model, runner, {.max_wait = 2ms, .workers = 2});
  LiveServer live(batcher, {.max_body_bytes = 4096, .threads = 32});

  httplib::Client probe("127.0.0.1", live.port);
  auto health = probe.Get("/healthz");
  REQUIRE(health);
  CHECK(health->status == 200);
  CHECK(json::parse(health->body)["max_batch"] == kBatch);

  constexpr int kClients = 16, kEach = 25;
  std::atomic<int> wrong{0}, failed{0};
  std::mutex mutex;
  std::string failures;
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c)
    clients.emplace_back([&, c] {
      httplib::Client cli("127.0.0.1", live.port);
      cli.set_keep_alive(true);  // as a serving client does: one connection, many requests
      for (int r = 0; r < kEach; ++r) {
        std::vector<float> x(kIn);
        for (int i = 0; i < kIn; ++i) x[std::size_t(i)] = float(c) - float(r) * 0.5f + float(i) * 0.25f;
        const auto t0 = std::chrono::steady_clock::now();
        auto res = cli.Post("/v1/infer", body_for(x), "application/json");
        if (!res || res->status != 200) {
          std::lock_guard lock(mutex);
          failures += (res ? std::to_string(res->status) + " " + res->body : httplib::to_string(res.error())) +
                      " after " + std::to_string((std::chrono::steady_clock::now() - t0) / 1ms) + " ms; ";
          failed++;
          continue;
        }
        auto got = json::parse(res->body)["outputs"][0]["data"].get<std::vector<float>>();
        if (got != runner.row(x.data())) wrong++;
      }
    });
  for (auto& t : clients) t.join();
  INFO(failures);
  CHECK(failed == 0);
  CHECK(wrong == 0);

  // Bad requests: each its status and a JSON message naming the problem.
  auto refused = [&](httplib::Result res, int status, std::string_view message) {
    REQUIRE(res);
    CHECK(res->status == status);
    INFO(res->body);
    CHECK(contains(json::parse(res->body)["error"].get<std::string>(), message));
  };
  refused(probe.Post("/v1/infer", body_for({1, 2, 3, 4, 5}), "text/plain"), 415, "application/json");
  refused(probe.Post("/v1/infer", "{\"inputs\": ", "application/json"), 400, "not valid JSON");
  refused(probe.Post("/v1/infer", body_for({1, 2, 3}), "application/json"), 400, "has shape [3], one sample is [5]");
  refused(probe.Post("/v1/infer", std::string(10000, ' '), "application/json"), 413, "larger than 4096 bytes");
  refused(probe.Get("/v1/nothing"), 404, "no route GET /v1/nothing");

  // Still up, and every good request was counted once.
  httplib::Client after("127.0.0.1", live.port);
  auto res = after.Post("/v1/infer", body_for({1, 0, 0, 0, 0}), "application/json");
  REQUIRE(res);
  CHECK(res->status == 200);
  auto answer = json::parse(res->body);
  CHECK(answer["batch"].get<int>() + answer["padded"].get<int>() == kBatch);
  auto metrics = json::parse(after.Get("/metrics")->body);
  CHECK(metrics["requests"] == kClients * kEach + 1);
  CHECK(metrics["failed"] == 0);
}

TEST_CASE("server http: stop_and_drain answers every accepted request at once (what SIGTERM does)", "[server]") {
  constexpr int kBatch = 8, kIn = 2, kOut = 2;
  auto p = stitchcuda_test::linear_program(kBatch, kIn, kOut);
  std::string why;
  auto model = ServedModel::from_program(p, why);
  REQUIRE(model);
  stitchcuda_test::CpuLinearRunner runner(p);
  // A long window: the three requests are still waiting for company when the stop comes.
  Batcher batcher(*model, runner, {.max_wait = 10s});
  auto live = std::make_unique<LiveServer>(batcher, HttpOptions{});
  std::atomic<int> answered{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 3; ++c)
    clients.emplace_back([&, c] {
      httplib::Client cli("127.0.0.1", live->port);
      auto res = cli.Post("/v1/infer", body_for({float(c), 1}), "application/json");
      if (res && res->status == 200 && json::parse(res->body)["batch"] == 3) answered++;
    });
  for (int i = 0; i < 1000 && batcher.metrics().queued < 3; ++i) std::this_thread::sleep_for(5ms);
  REQUIRE(batcher.metrics().queued == 3);  // accepted, inside their window
  const auto t0 = std::chrono::steady_clock::now();
  stop_and_drain(live->server, batcher);  // what the server does on SIGTERM
  for (auto& t : clients) t.join();
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);  // the drain did not wait out the 10 s window
  CHECK(answered == 3);
  CHECK(batcher.metrics().requests == 3);
  live.reset();
}

TEST_CASE("server http: a family file is served with concurrent clients, every batch at its own size", "[server]") {
  constexpr int kIn = 4, kOut = 3;
  stitchcuda_test::TempDir dir;
  const std::string path = dir.str() + "/linear.family.stitch";
  REQUIRE(stitchcuda_test::linear_family({1, 2, 4, 8}, kIn, kOut, true).save(path));
  auto loaded = stitchcuda::program::ProgramFamily::load(path);
  REQUIRE(loaded);
  std::string why;
  auto model = ServedModel::from_family(*loaded, why);
  REQUIRE(model);
  stitchcuda_test::CpuLinearRunner runner(loaded->members[0].program);
  Batcher batcher(*model, runner, {.max_wait = 2ms, .workers = 2});
  LiveServer live(batcher, {.threads = 16});

  httplib::Client probe("127.0.0.1", live.port);
  auto health = json::parse(probe.Get("/healthz")->body);
  CHECK(health["max_batch"] == 8);
  CHECK(health["fixed_batch"] == false);
  std::atomic<int> wrong{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 6; ++c)
    clients.emplace_back([&, c] {
      httplib::Client cli("127.0.0.1", live.port);
      for (int r = 0; r < 10; ++r) {
        const std::vector<float> x{float(c), float(r), -1.0f, 0.5f};
        auto res = cli.Post("/v1/infer", body_for(x), "application/json");
        if (!res || res->status != 200) {
          wrong++;
          continue;
        }
        auto answer = json::parse(res->body);
        if (answer["outputs"][0]["data"].get<std::vector<float>>() != runner.row(x.data()) || answer["padded"] != 0) wrong++;
      }
    });
  for (auto& t : clients) t.join();
  CHECK(wrong == 0);
  auto metrics = json::parse(probe.Get("/metrics")->body);
  CHECK(metrics["requests"] == 60);
  CHECK(metrics["padded_rows"] == 0);
}
