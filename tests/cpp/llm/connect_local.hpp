// Connecting the llm backends to the tests' LocalServer, with retry waits short enough for tests.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <stitchcuda/llm.hpp>

#include "catch_shim.hpp"
#include "local_server.hpp"

namespace stitchcuda_test {

/// A conversation of one user message.
inline std::vector<stitchcuda::llm::Message> ask(const std::string& text) { return {{"user", text}}; }

/// Three attempts, 5 ms back-off without jitter: retries are visible but cost no test time.
inline stitchcuda::llm::ConnectOptions quick_retries() {
  stitchcuda::llm::ConnectOptions options;
  options.reliability.retry.max_attempts = 3;
  options.reliability.retry.initial_backoff_s = 0.005;
  options.reliability.retry.jitter = 0.0;
  return options;
}

/// `provider` ("openai" or "anthropic") at the server; the base URL is the server's /v1.
inline std::shared_ptr<stitchcuda::llm::ReliableBackend> connect_local(
    const LocalServer& server, const std::string& provider = "openai",
    const stitchcuda::llm::ConnectOptions& options = quick_retries()) {
  auto backend = stitchcuda::llm::connect(provider + ":local-model@" + server.url() + "/v1", options);
  if (!backend) FAIL("connect failed: " << backend.error().describe());
  return *backend;
}

/// `reply`, sent only after `delay_ms`: a slow first byte.
inline ScriptedReply delayed(ScriptedReply reply, int delay_ms) {
  reply.delay_ms = delay_ms;
  return reply;
}

/// Seconds since `start`.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace stitchcuda_test
