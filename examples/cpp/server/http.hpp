// The batching server's HTTP front (cpp-httplib, no torch): POST /v1/infer, GET /healthz, GET /metrics,
// and the 4xx answers for bad requests. main.cpp and the tests put it in front of a Batcher.
#pragma once

#include <cstddef>

#include <httplib.h>

#include "batcher.hpp"

namespace stitchcuda_server {

struct HttpOptions {
  std::size_t max_body_bytes = 64u << 20;  ///< larger bodies get 413
  int threads = 64;  ///< connections served at once: at least the concurrent clients expected
};

/// Routes `server` to `batcher`, limits bodies, and answers every error with {"error": "..."}.
void install_routes(httplib::Server& server, Batcher& batcher, const HttpOptions& options);

/// Binds `server` to host:port (0: any free port) with a listen queue of SOMAXCONN rather than the library's
/// 5, which a burst of clients connecting at once overflows (each lost connect costs a second, then an
/// error). Returns the port, or -1.
int bind_server(httplib::Server& server, const std::string& host, int port);

/// The shutdown (SIGTERM): no new connections, queued requests run at once instead of waiting out their
/// window, every accepted request is answered; a request still being read gets 503. The listening thread
/// returns once the last answer is written.
void stop_and_drain(httplib::Server& server, Batcher& batcher);

}  // namespace stitchcuda_server
