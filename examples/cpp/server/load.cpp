// load: a load test for the batching server on loopback. N clients send samples (a fixed pool of random
// inputs shaped as GET /healthz says) until a request count or a time limit, and it prints throughput and
// p50/p99 latency. With --reference PORT it first asks that server (e.g. the LibTorch-eager twin) for the
// answer to every pooled sample, or with --samples FILE it sends the samples of a file holding their expected
// answers (scripts/server-load computes them with PyTorch), and counts an answer as wrong when it differs
// beyond --tol.
//
//   load [--port N] [--clients N] [--requests N] [--seconds S] [--reference PORT | --samples FILE] [--tol T]
//        [--json]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "model.hpp"

using nlohmann::json;
using stitchcuda_server::base64_decode;
using stitchcuda_server::base64_encode;

static constexpr const char* kUsage =
    "usage: load [--host H] [--port N] [--clients N] [--requests N] [--seconds S] [--pool N]\n"
    "            [--reference PORT | --samples FILE] [--tol T] [--json]\n"
    "Sends POST /v1/infer from N concurrent clients (default 32) until --requests (default 10000) or\n"
    "--seconds (default 60) is reached; prints throughput and p50/p99 latency. --reference PORT checks every\n"
    "answer against that server's answer for the same sample (|a-b| <= tol * (1 + |b|), default tol 1e-2).\n"
    "--samples FILE sends the samples of FILE instead of random ones and checks each answer against the one\n"
    "FILE gives: a JSON list of {\"inputs\": [the request's inputs], \"outputs\": [{\"base64\": ...}, ...]}.\n"
    "Exits 0 when no request failed or was wrong, 1 otherwise, 2 on bad usage.\n";

// Bytes of one random sample for an input slot of /healthz (floats ~N(0,1), integers and bools zero).
static std::string random_sample(const json& slot, std::mt19937& rng) {
  std::int64_t n = 1;
  for (auto d : slot["shape"]) n *= d.get<std::int64_t>();
  const std::string dtype = slot["dtype"];
  std::normal_distribution<float> normal;
  std::string out;
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = normal(rng);
    if (dtype == "f32") out.append(reinterpret_cast<const char*>(&v), 4);
    else if (dtype == "f64") { const double d = v; out.append(reinterpret_cast<const char*>(&d), 8); }
    else if (dtype == "bf16") { std::uint32_t b; std::memcpy(&b, &v, 4); const auto h = std::uint16_t(b >> 16); out.append(reinterpret_cast<const char*>(&h), 2); }
    else if (dtype == "f16") { static const std::uint16_t k[] = {0x0000, 0x3800, 0xB800, 0x3C00, 0xBC00}; const auto h = k[rng() % 5]; out.append(reinterpret_cast<const char*>(&h), 2); }
    else out.append(dtype == "i64" ? 8 : dtype == "i32" ? 4 : 1, '\0');
  }
  return out;
}

// IEEE half to double: sign, 5-bit exponent (bias 15), 10-bit mantissa; subnormals, infinities, NaN.
static double half_value(std::uint16_t h) {
  const int exponent = (h >> 10) & 31, mantissa = h & 1023;
  const double sign = h & 0x8000 ? -1.0 : 1.0;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  if (exponent == 31) return mantissa ? NAN : sign * INFINITY;
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

// An answer's outputs as doubles (they come back as base64: the load test asks for it, cheaper to encode).
static std::vector<double> values(const json& answer, const json& health) {
  std::vector<double> v;
  for (std::size_t o = 0; o < answer["outputs"].size(); ++o) {
    const auto bytes = base64_decode(answer["outputs"][o]["base64"].get<std::string>()).value_or("");
    const std::string dtype = health["outputs"][o]["dtype"];
    const std::size_t size = dtype == "f64" || dtype == "i64" ? 8 : dtype == "f32" || dtype == "i32" ? 4 : dtype == "f16" || dtype == "bf16" ? 2 : 1;
    for (std::size_t i = 0; i + size <= bytes.size(); i += size) {
      if (dtype == "f32") { float f; std::memcpy(&f, bytes.data() + i, 4); v.push_back(f); }
      else if (dtype == "f64") { double d; std::memcpy(&d, bytes.data() + i, 8); v.push_back(d); }
      else if (dtype == "bf16") { std::uint32_t b = 0; std::memcpy(reinterpret_cast<char*>(&b) + 2, bytes.data() + i, 2); float f; std::memcpy(&f, &b, 4); v.push_back(f); }
      else if (dtype == "f16") { std::uint16_t h; std::memcpy(&h, bytes.data() + i, 2); v.push_back(half_value(h)); }
      else { std::int64_t x = 0; std::memcpy(&x, bytes.data() + i, std::min<std::size_t>(size, 8)); v.push_back(double(x)); }
    }
  }
  return v;
}

int main(int argc, char** argv) {
  std::string host = "127.0.0.1", samples_path;
  long port = 8000, clients = 32, requests = 10000, seconds = 60, pool = 64, reference = 0;
  double tol = 1e-2;
  bool as_json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return std::printf("%s", kUsage), 0;
    if (arg == "--json") { as_json = true; continue; }
    if (i + 1 >= argc) return std::fprintf(stderr, "load: %s needs a value\n%s", arg.c_str(), kUsage), 2;
    const char* v = argv[++i];
    char* end = nullptr;
    if (arg == "--host") { host = v; continue; }
    if (arg == "--samples") { samples_path = v; continue; }
    if (arg == "--tol") { tol = std::strtod(v, &end); if (*end || tol < 0) return std::fprintf(stderr, "load: --tol needs a number >= 0\n"), 2; continue; }
    long* n = arg == "--port" ? &port : arg == "--clients" ? &clients : arg == "--requests" ? &requests
            : arg == "--seconds" ? &seconds : arg == "--pool" ? &pool : arg == "--reference" ? &reference : nullptr;
    if (!n) return std::fprintf(stderr, "load: unexpected argument '%s'\n%s", arg.c_str(), kUsage), 2;
    *n = std::strtol(v, &end, 10);
    if (*end || *n <= 0) return std::fprintf(stderr, "load: %s needs a positive number\n", arg.c_str()), 2;
  }

  if (reference && !samples_path.empty())
    return std::fprintf(stderr, "load: --reference and --samples both say what is right: give one\n"), 2;

  httplib::Client probe(host, int(port));
  auto health_res = probe.Get("/healthz");
  if (!health_res || health_res->status != 200)
    return std::fprintf(stderr, "error: no server answers GET http://%s:%ld/healthz\n", host.c_str(), port), 1;
  const json health = json::parse(health_res->body);

  // The pool of samples, each a ready request body, and what each must be answered with where known.
  std::mt19937 rng(1234);
  std::vector<std::string> bodies;
  std::vector<std::vector<double>> expected;
  if (!samples_path.empty()) {
    std::ifstream in(samples_path);
    const json samples = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!samples.is_array() || samples.empty())
      return std::fprintf(stderr, "error: %s cannot be read as a JSON list of samples (see load --help)\n", samples_path.c_str()), 1;
    for (const auto& s : samples) {
      bool ok = s.is_object() && s.contains("inputs") && s.contains("outputs") && s["outputs"].is_array() &&
                s["outputs"].size() == health["outputs"].size();
      for (std::size_t o = 0; ok && o < s["outputs"].size(); ++o)
        ok = s["outputs"][o].is_object() && s["outputs"][o].contains("base64") && s["outputs"][o]["base64"].is_string();
      if (!ok)
        return std::fprintf(stderr, "error: %s: every sample needs \"inputs\" and \"outputs\", one {\"base64\": ...} per "
                                    "output of the server (%zu)\n", samples_path.c_str(), health["outputs"].size()), 1;
      bodies.push_back(json{{"answer", "base64"}, {"inputs", s["inputs"]}}.dump());
      expected.push_back(values(s, health));
    }
    pool = long(bodies.size());
  }
  for (long s = long(bodies.size()); s < pool; ++s) {
    json body{{"answer", "base64"}, {"inputs", json::array()}};
    for (const auto& slot : health["inputs"])
      body["inputs"].push_back({{"dtype", slot["dtype"]}, {"shape", slot["shape"]}, {"base64", base64_encode(random_sample(slot, rng))}});
    bodies.push_back(body.dump());
  }
  if (reference) {
    httplib::Client ref(host, int(reference));
    for (const auto& b : bodies) {
      auto r = ref.Post("/v1/infer", b, "application/json");
      if (!r || r->status != 200)
        return std::fprintf(stderr, "error: the reference server on port %ld did not answer: %s\n", reference, r ? r->body.c_str() : "no connection"), 1;
      expected.push_back(values(json::parse(r->body), health));
    }
  }

  std::atomic<long> next{0}, failed{0}, wrong{0};
  std::mutex mutex;
  std::vector<double> latency_ms;
  std::string first_error;
  const auto t0 = std::chrono::steady_clock::now();
  const auto stop_at = t0 + std::chrono::seconds(seconds);
  std::vector<std::thread> threads;
  for (long c = 0; c < clients; ++c)
    threads.emplace_back([&] {
      httplib::Client cli(host, int(port));
      cli.set_keep_alive(true);  // one connection per client, as a serving client keeps it
      cli.set_tcp_nodelay(true);  // a request's header and body go out at once, not 40 ms apart
      cli.set_read_timeout(std::chrono::seconds(seconds));
      std::vector<double> mine;
      for (long r; (r = next++) < requests && std::chrono::steady_clock::now() < stop_at;) {
        const auto& body = bodies[std::size_t(r % pool)];
        const auto s0 = std::chrono::steady_clock::now();
        auto res = cli.Post("/v1/infer", body, "application/json");
        mine.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count());
        if (!res || res->status != 200) {
          failed++;
          std::lock_guard lock(mutex);
          if (first_error.empty()) first_error = res ? std::to_string(res->status) + " " + res->body : httplib::to_string(res.error());
          continue;
        }
        if (!expected.empty()) {
          const auto got = values(json::parse(res->body), health);
          const auto& want = expected[std::size_t(r % pool)];
          bool same = got.size() == want.size();
          for (std::size_t i = 0; same && i < got.size(); ++i) same = std::fabs(got[i] - want[i]) <= tol * (1 + std::fabs(want[i]));
          if (!same) wrong++;
        }
      }
      std::lock_guard lock(mutex);
      latency_ms.insert(latency_ms.end(), mine.begin(), mine.end());
    });
  for (auto& t : threads) t.join();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::sort(latency_ms.begin(), latency_ms.end());
  auto pct = [&](double p) { return latency_ms.empty() ? 0.0 : latency_ms[std::min(latency_ms.size() - 1, std::size_t(p * double(latency_ms.size())))]; };
  const long sent = long(latency_ms.size());
  auto metrics = probe.Get("/metrics");
  json out{{"clients", clients}, {"requests", sent}, {"failed", failed.load()}, {"wrong", wrong.load()},
           {"checked", !expected.empty()}, {"seconds", wall}, {"throughput_rps", double(sent) / wall},
           {"p50_ms", pct(0.50)}, {"p99_ms", pct(0.99)},
           {"server", metrics && metrics->status == 200 ? json::parse(metrics->body) : json()}};
  if (as_json) std::printf("%s\n", out.dump().c_str());
  else
    std::printf("requests=%ld failed=%ld wrong=%ld%s clients=%ld seconds=%.2f throughput=%.1f req/s p50=%.3f ms p99=%.3f ms\n",
                sent, failed.load(), wrong.load(), expected.empty() ? " (unchecked)" : "", clients, wall, double(sent) / wall,
                pct(0.50), pct(0.99));
  if (!first_error.empty()) std::fprintf(stderr, "first failure: %s\n", first_error.c_str());
  return failed || wrong ? 1 : 0;
}
