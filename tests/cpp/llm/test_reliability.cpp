// ReliableBackend's policy with the local server and scripted backends: cancellation, the call's
// deadline across retries, client-side rate limits, totals and cost, and 64 concurrent calls.
#include <chrono>
#include <cmath>
#include <latch>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <stitchcuda/llm.hpp>

#include "catch_shim.hpp"
#include "connect_local.hpp"
#include "local_server.hpp"

using namespace stitchcuda;
using namespace stitchcuda::llm;
using namespace stitchcuda_test;

namespace {

std::shared_ptr<ReliableBackend> scripted_with(const ReliabilityOptions& options) {
  auto inner = scripted_backend({{".*", {"fine"}}});
  REQUIRE(inner);
  auto backend = ReliableBackend::wrap(*inner, options);
  REQUIRE(backend);
  return *backend;
}

// A thread that cancels `token` after `ms` milliseconds.
std::thread cancel_after(const CancelToken& token, int ms) {
  return std::thread([token, ms] {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    token.cancel();
  });
}

}  // namespace

TEST_CASE("cancel() ends a call waiting on a slow server within a poll interval", "[llm][cancel]") {
  LocalServer server;
  server.queue(delayed(openai_reply("late"), 3000));
  auto backend = connect_local(server);
  Options o;
  std::thread canceller = cancel_after(o.cancel, 100);
  const auto start = std::chrono::steady_clock::now();
  auto reply = backend->complete(ask("x"), o);
  const double elapsed = seconds_since(start);
  canceller.join();
  REQUIRE_FALSE(reply);
  CHECK(reply.error().code == ErrorCode::Cancelled);
  CHECK(elapsed >= 0.09);
  CHECK(elapsed < 0.5);
}

TEST_CASE("cancel() ends a call waiting to retry", "[llm][cancel]") {
  LocalServer server;
  server.queue(error_reply(429, "wait", {{"Retry-After", "10"}}));
  auto backend = connect_local(server);
  Options o;
  std::thread canceller = cancel_after(o.cancel, 100);
  const auto start = std::chrono::steady_clock::now();
  auto reply = backend->complete(ask("x"), o);
  canceller.join();
  REQUIRE_FALSE(reply);
  CHECK(reply.error().code == ErrorCode::Cancelled);
  CHECK(contains(reply.error().message, "cancelled while waiting to retry"));
  CHECK(contains(reply.error().message, "HTTP 429"));
  CHECK(seconds_since(start) < 0.5);
  CHECK(server.request_count() == 1);
}

TEST_CASE("a retry that would pass the call's timeout is not attempted", "[llm][deadline]") {
  LocalServer server;
  server.queue(error_reply(503, "busy", {{"Retry-After", "2"}}));
  auto backend = connect_local(server);
  Options o;
  o.timeout_s = 1.0;
  const auto start = std::chrono::steady_clock::now();
  auto reply = backend->complete(ask("x"), o);
  REQUIRE_FALSE(reply);
  CHECK(seconds_since(start) < 0.5);
  CHECK(reply.error().http_status == 503);
  CHECK(contains(reply.error().message, "not retried: waiting 2 s would pass the call's timeout"));
}

TEST_CASE("requests_per_minute spreads calls out: one second's burst, then the rate", "[llm][rate]") {
  ReliabilityOptions limited;
  limited.limits.requests_per_minute = 1200;  // 20 a second, bursts of 20
  auto backend = scripted_with(limited);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 30; ++i) REQUIRE(backend->complete(ask("x")));
  const double elapsed = seconds_since(start);
  CHECK(elapsed >= 0.45);  // the 10 beyond the burst at 20/s
  CHECK(elapsed < 2.0);

  auto unlimited = scripted_with({});
  const auto free_start = std::chrono::steady_clock::now();
  for (int i = 0; i < 30; ++i) REQUIRE(unlimited->complete(ask("x")));
  CHECK(seconds_since(free_start) < 0.2);
}

TEST_CASE("tokens_per_minute holds back calls whose tokens outrun the quota", "[llm][rate]") {
  ReliabilityOptions limited;
  limited.limits.tokens_per_minute = 60000;  // 1000 a second
  auto backend = scripted_with(limited);
  const std::string prompt(4000, 'p');  // ~1000 tokens estimated, ~1001 counted
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 2; ++i) REQUIRE(backend->complete(ask(prompt)));
  const double elapsed = seconds_since(start);
  CHECK(elapsed >= 0.9);  // the second waits ~1 s for the bucket to refill
  CHECK(elapsed < 2.0);
}

TEST_CASE("a rate-limit wait longer than the call's timeout fails at once", "[llm][rate]") {
  ReliabilityOptions limited;
  limited.limits.requests_per_minute = 60;  // one a second
  auto backend = scripted_with(limited);
  REQUIRE(backend->complete(ask("x")));
  Options o;
  o.timeout_s = 0.2;
  auto reply = backend->complete(ask("x"), o);
  REQUIRE_FALSE(reply);
  CHECK(reply.error().code == ErrorCode::Timeout);
  CHECK(contains(reply.error().message, "client-side rate limit"));
}

TEST_CASE("totals add up usage and cost across calls", "[llm][totals]") {
  LocalServer server;
  server.queue(openai_reply("a", "stop", 1000, 500));
  server.queue(openai_reply("b", "stop", 3000, 1500));
  ConnectOptions options = quick_retries();
  options.reliability.prices = {2.0, 8.0};  // dollars per million tokens
  auto backend = connect_local(server, "openai", options);
  REQUIRE(backend->complete(ask("1")));
  REQUIRE(backend->complete(ask("2")));
  const Totals t = backend->totals();
  CHECK(t.calls == 2);
  CHECK(t.attempts == 2);
  CHECK(t.usage.prompt_tokens == 4000);
  CHECK(t.usage.completion_tokens == 2000);
  CHECK(t.usage.total_tokens == 6000);
  CHECK(std::abs(t.cost_usd - (4000 * 2.0 + 2000 * 8.0) / 1e6) < 1e-12);
}

TEST_CASE("bad reliability options are refused", "[llm]") {
  auto inner = scripted_backend({{".*", {"x"}}});
  REQUIRE(inner);
  ReliabilityOptions none;
  none.retry.max_attempts = 0;
  auto r = ReliableBackend::wrap(*inner, none);
  REQUIRE_FALSE(r);
  CHECK(contains(r.error().message, "max_attempts = 0"));
}

TEST_CASE("64 concurrent calls complete, each exactly once", "[llm][concurrency]") {
  LocalServer server;
  auto backend = connect_local(server);
  constexpr int kCalls = 64;
  std::vector<std::string> replies(kCalls);
  std::vector<int> errors(kCalls, 0);
  std::latch go(kCalls);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCalls; ++i) {
    threads.emplace_back([&, i] {
      Options o;
      o.stream = i % 2 == 1;  // half of them streamed
      std::string streamed;
      go.arrive_and_wait();
      auto reply = backend->complete(ask("call " + std::to_string(i)), o,
                                     [&](std::string_view piece) { streamed += piece; });
      if (!reply || (o.stream && streamed != reply->text)) {
        errors[i] = 1;
        return;
      }
      replies[i] = reply->text;
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kCalls; ++i) {
    CHECK(errors[i] == 0);
    CHECK(replies[i] == "echo: call " + std::to_string(i));
  }
  CHECK(server.request_count() == std::size_t(kCalls));
  std::multiset<std::string> asked;
  for (const auto& r : server.requests()) asked.insert(last_user_message(r));
  for (int i = 0; i < kCalls; ++i) CHECK(asked.count("call " + std::to_string(i)) == 1);
  const Totals t = backend->totals();
  CHECK(t.calls == kCalls);
  CHECK(t.attempts == kCalls);
  CHECK(t.failures == 0);
}
