// The batching server's command line and serving loop (cli.hpp), shared by the GPU server (main.cpp) and the
// tests' CPU stand-in, which differ only in the runner that loads the model.
#include "cli.hpp"

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>

#include <pthread.h>
#include <unistd.h>

#include "http.hpp"

namespace stitchcuda_server {

static constexpr const char* kUsage =
    "usage: server MODEL.stitch [--eager MODEL.pt] [--host H] [--port N] [--max-wait-us N] [--workers N]\n"
    "              [--max-queue N] [--max-body-bytes N] [--http-threads N]\n"
    "Serves the artifact over HTTP: POST /v1/infer (one sample, JSON), GET /healthz (the inputs and outputs),\n"
    "GET /metrics (requests, batches, padding). Requests are batched up to the artifact's dim 0 (a program,\n"
    "whose partial batches are padded with zero rows) or its batch dim's max (a program family, whose\n"
    "batches run at their own size).\n"
    "  --eager MODEL.pt    run this TorchScript module in LibTorch eager instead of the artifact (the same\n"
    "                      inputs and outputs): the baseline for the load test\n"
    "  --host H            address to listen on (default 127.0.0.1)\n"
    "  --port N            port (default 8000; 0: any free port, printed)\n"
    "  --max-wait-us N     longest a request waits for others to fill its batch (default 1000)\n"
    "  --workers N         batches in flight at once, each on its own CUDA stream (default 2)\n"
    "  --max-queue N       queued requests at most; beyond it 503 (default 4096)\n"
    "  --max-body-bytes N  larger bodies get 413 (default 67108864)\n"
    "  --http-threads N    connections served at once (default 128)\n"
    "Exits 0 after SIGTERM/SIGINT (drained), 1 on an error (the message names it), 2 on bad usage.\n";

// What `path` serves and its runner (the eager twin instead where `eager` names one); false after printing
// why the artifact cannot be served.
static bool load_model(const std::string& path, const std::string& eager, int workers, const Runners& runners,
                       std::optional<ServedModel>& model, Loaded& runner) {
  namespace program = stitchcuda::program;
  auto serve = [&](auto loaded, auto served_from, auto runner_for) {
    std::string why;
    if (!loaded) why = "loading it failed: " + loaded.error().describe();
    else if ((model = served_from(*loaded, why)))
      runner = eager.empty() ? runner_for(std::move(*loaded), *model, workers) : runners.eager(eager, *model, workers);
    if (!model) std::fprintf(stderr, "error: %s cannot be served: %s\n", path.c_str(), why.c_str());
    return model.has_value();
  };
  char head[8] = {};
  std::ifstream(path, std::ios::binary).read(head, sizeof head);
  if (program::is_family_artifact(std::string_view(head, sizeof head)))
    return serve(program::ProgramFamily::load(path), ServedModel::from_family, runners.family);
  return serve(program::Program::load(path), ServedModel::from_program, runners.program);
}

// A non-negative number after a flag, or -1.
static long number_after(int argc, char** argv, int& i) {
  if (i + 1 >= argc) return -1;
  char* end = nullptr;
  const long v = std::strtol(argv[++i], &end, 10);
  return *end == '\0' && v >= 0 ? v : -1;
}

int serve_main(int argc, char** argv, const Runners& runners) {
  // SIGTERM/SIGINT go to the waiting thread below only: blocked here, before any thread starts.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  std::string path, eager, host = "127.0.0.1";
  long port = 8000, wait_us = 1000, workers = 2, queue = 4096, body = 64l << 20, threads = 128;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (arg == "--eager" || arg == "--host") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "server: %s needs a value\n%s", arg.c_str(), kUsage);
        return 2;
      }
      (arg == "--eager" ? eager : host) = argv[++i];
      continue;
    }
    long* n = arg == "--port" ? &port : arg == "--max-wait-us" ? &wait_us : arg == "--workers" ? &workers
            : arg == "--max-queue" ? &queue : arg == "--max-body-bytes" ? &body : arg == "--http-threads" ? &threads
            : nullptr;
    if (n) {
      *n = number_after(argc, argv, i);
      const bool positive_needed = n != &port && n != &wait_us;
      if (*n < 0 || (positive_needed && *n == 0) || (n == &port && *n > 65535)) {
        std::fprintf(stderr, "server: %s needs a %s number\n%s", arg.c_str(), positive_needed ? "positive" : "non-negative", kUsage);
        return 2;
      }
      continue;
    }
    if (arg.rfind("-", 0) == 0 || !path.empty()) {
      std::fprintf(stderr, "server: unexpected argument '%s'\n%s", arg.c_str(), kUsage);
      return 2;
    }
    path = arg;
  }
  if (path.empty()) {
    std::fprintf(stderr, "server: which artifact? give MODEL.stitch\n%s", kUsage);
    return 2;
  }

  std::optional<ServedModel> model;
  Loaded runner;
  if (!load_model(path, eager, int(workers), runners, model, runner)) return 1;
  if (!runner.runner) {
    std::fprintf(stderr, "error: %s%s\n", runner.unavailable ? "no GPU: " : "", runner.why.c_str());
    return 1;
  }

  Batcher batcher(*model, *runner.runner,
                  {.max_wait = std::chrono::microseconds(wait_us), .max_queue = std::size_t(queue), .workers = int(workers)});
  httplib::Server server;
  install_routes(server, batcher, {.max_body_bytes = std::size_t(body), .threads = int(threads)});
  const int bound = bind_server(server, host, int(port));
  if (bound < 0) {
    std::fprintf(stderr, "error: cannot listen on %s:%ld (in use, or not an address of this machine)\n", host.c_str(), port);
    return 1;
  }
  std::printf("listening on http://%s:%d  runner=%s max_batch=%lld%s max_wait_us=%ld workers=%ld\n", host.c_str(), bound,
              eager.empty() ? "stitched" : "eager", static_cast<long long>(model->max_batch),
              model->fixed_batch ? "" : " (family: batches at their own size)", wait_us, workers);
  std::fflush(stdout);

  std::atomic<bool> signalled{false};
  std::thread stopper([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    signalled = true;
    stop_and_drain(server, batcher);
  });
  server.listen_after_bind();
  // listen returned by itself (a socket error) rather than by a signal: wake the stopper to end it.
  // The signal is blocked everywhere, so it stays pending for sigwait alone.
  if (!signalled) kill(getpid(), SIGTERM);
  stopper.join();
  batcher.drain();  // idempotent: done already unless listen failed
  std::printf("drained %s\n", batcher.metrics().json().c_str());
  return 0;
}

}  // namespace stitchcuda_server
