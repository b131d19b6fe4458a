// What the llm client adds to a request over the server's own latency (the target: <= 2 ms),
// against a bare keep-alive socket to the same local server in the same run; --json for one object.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <stitchcuda/llm.hpp>

#include "local_server.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// One keep-alive connection that sends prepared bytes and reads a whole reply, nothing more.
// The baseline: it pays only for the local server and the loopback.
class BareClient {
 public:
  explicit BareClient(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(std::uint16_t(port));
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      std::perror("connect");
      std::exit(1);
    }
    int on = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
  }
  ~BareClient() { ::close(fd_); }

  // Sends the request and reads until the reply is complete (Content-Length or the last chunk).
  bool exchange(const std::string& request) {
    if (::send(fd_, request.data(), request.size(), MSG_NOSIGNAL) != ssize_t(request.size())) return false;
    std::string in;
    for (;;) {
      char buf[16384];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) return false;
      in.append(buf, std::size_t(n));
      const auto head_end = in.find("\r\n\r\n");
      if (head_end == std::string::npos) continue;
      const auto length_at = in.find("Content-Length: ");
      if (length_at != std::string::npos && length_at < head_end) {
        const std::size_t length = std::strtoul(in.c_str() + length_at + 16, nullptr, 10);
        if (in.size() >= head_end + 4 + length) return true;
      } else if (in.size() >= 5 && in.compare(in.size() - 5, 5, "0\r\n\r\n") == 0) {
        return true;
      }
    }
  }

 private:
  int fd_ = -1;
};

struct Measured {
  double bare_us = 0;
  double client_us = 0;
};

Measured measure(int port, stitchcuda::llm::Backend& backend, bool stream, int requests) {
  const std::vector<stitchcuda::llm::Message> messages = {{"user", "Reply with the single word: pong"}};
  // The body the client sends, so both paths move the same bytes.
  Json body = {{"model", "local-model"}, {"messages", {{{"role", "user"}, {"content", messages[0].content}}}}};
  if (stream) {
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
  }
  const std::string payload = body.dump();
  const std::string request = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:" + std::to_string(port) +
                              "\r\nContent-Type: application/json\r\nContent-Length: " +
                              std::to_string(payload.size()) + "\r\n\r\n" + payload;
  stitchcuda::llm::Options options;
  options.stream = stream;
  const stitchcuda::llm::TextCallback ignore_text = [](std::string_view) {};

  BareClient bare(port);
  std::vector<double> bare_us, client_us;
  for (int warmup = 0; warmup < 20; ++warmup) {  // connections, allocator, server threads
    bare.exchange(request);
    (void)backend.complete(messages, options, ignore_text);
  }
  // Interleaved, so both paths see the same machine state.
  for (int i = 0; i < requests; ++i) {
    auto t0 = Clock::now();
    if (!bare.exchange(request)) std::exit(1);
    auto t1 = Clock::now();
    auto reply = backend.complete(messages, options, ignore_text);
    auto t2 = Clock::now();
    if (!reply) {
      std::fprintf(stderr, "the client failed: %s\n", reply.error().describe().c_str());
      std::exit(1);
    }
    bare_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    client_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
  }
  return {median(bare_us), median(client_us)};
}

Json summary(const Measured& m) {
  return {{"server_round_trip_us", m.bare_us},
          {"client_us", m.client_us},
          {"overhead_us", m.client_us - m.bare_us},
          {"ratio", m.bare_us > 0 ? m.client_us / m.bare_us : 0.0}};
}

}  // namespace

int main(int argc, char** argv) {
  int requests = 2000;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (std::strcmp(argv[i], "--requests") == 0 && i + 1 < argc) {
      requests = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--requests N] [--json]\n", argv[0]);
      return 2;
    }
  }
  stitchcuda_test::LocalServer server;
  const int port = std::atoi(server.url().substr(server.url().rfind(':') + 1).c_str());
  stitchcuda::llm::ConnectOptions options;
  options.server.api_key = "sk-bench-not-a-real-key";
  auto backend = stitchcuda::llm::connect("openai:local-model@" + server.url() + "/v1", options);
  if (!backend) {
    std::fprintf(stderr, "%s\n", backend.error().describe().c_str());
    return 1;
  }
  const Measured plain = measure(port, **backend, false, requests);
  const Measured streamed = measure(port, **backend, true, requests);
  constexpr double kTargetUs = 2000.0;
  const double worst = std::max(plain.client_us - plain.bare_us, streamed.client_us - streamed.bare_us);
  const Json out = {{"requests", requests},
                    {"plain", summary(plain)},
                    {"stream", summary(streamed)},
                    {"target_overhead_us", kTargetUs},
                    {"meets_target", worst <= kTargetUs},
                    {"method", "medians over interleaved requests; baseline: the same bytes over one bare "
                               "keep-alive socket to the same local server"}};
  if (json) {
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  std::printf("llm client overhead over the local server (%d requests each, medians)\n", requests);
  std::printf("  %-7s %12s %12s %12s %8s\n", "", "bare (us)", "client (us)", "overhead", "ratio");
  for (const auto& [name, m] : {std::pair{"plain", plain}, std::pair{"stream", streamed}})
    std::printf("  %-7s %12.1f %12.1f %12.1f %8.2f\n", name, m.bare_us, m.client_us, m.client_us - m.bare_us,
                m.bare_us > 0 ? m.client_us / m.bare_us : 0.0);
  std::printf("  target: overhead <= %.0f us per request: %s\n", kTargetUs, worst <= kTargetUs ? "met" : "MISSED");
  return 0;
}
