// HTTP routes of the batching server (http.hpp).
#include "http.hpp"

#include <memory>

#include <sys/socket.h>

namespace stitchcuda_server {

static void answer(httplib::Response& res, int status, const std::string& body) {
  res.status = status;
  res.set_content(body, "application/json");
}

void install_routes(httplib::Server& server, Batcher& batcher, const HttpOptions& options) {
  const int threads = options.threads;
  server.new_task_queue = [threads] { return new httplib::ThreadPool(std::size_t(threads)); };
  server.set_payload_max_length(options.max_body_bytes);
  // Clients that keep their connection open send many requests on it: closing it every few requests (the
  // library's default is 5) costs a reconnect each time, and under load a burst of reconnects overflows
  // the listen queue.
  server.set_keep_alive_max_count(1u << 20);
  // Small answers written in pieces would otherwise wait on Nagle's algorithm and the peer's delayed ACK
  // (about 40 ms each).
  server.set_tcp_nodelay(true);
  const std::size_t limit = options.max_body_bytes;
  // Errors httplib raises itself (404, 413, 400 on a broken request line) carry no body: say what failed.
  server.set_error_handler([limit](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string why = res.status == 404   ? "no route " + req.method + " " + req.path + ": POST /v1/infer, GET /healthz, GET /metrics"
                      : res.status == 413 ? "the body is larger than " + std::to_string(limit) + " bytes (--max-body-bytes)"
                                          : "the request is malformed (HTTP status " + std::to_string(res.status) + ")";
    res.set_content(error_json(why), "application/json");
  });
  server.Get("/healthz", [&batcher](const httplib::Request&, httplib::Response& res) {
    answer(res, 200, batcher.model().describe_json());
  });
  server.Get("/metrics", [&batcher](const httplib::Request&, httplib::Response& res) {
    answer(res, 200, batcher.metrics().json());
  });
  server.Post("/v1/infer", [&batcher](const httplib::Request& req, httplib::Response& res) {
    auto parsed = parse_request(batcher.model(), req.get_header_value("Content-Type"), req.body);
    if (!parsed.sample) return answer(res, parsed.refusal.status, error_json(parsed.refusal.message));
    const bool base64 = parsed.sample->base64_answer;
    auto future = batcher.submit(std::move(*parsed.sample));
    if (!future) return answer(res, 503, error_json("the server is draining or its queue is full: retry later"));
    Answer a = future->get();  // a submitted sample is always answered: drain runs what is queued
    if (!a.error.empty()) return answer(res, 500, error_json("the batch failed: " + a.error));
    answer(res, 200, encode_answer(batcher.model(), a.outputs, base64, a.batch_rows, a.padded_rows));
  });
}

int bind_server(httplib::Server& server, const std::string& host, int port) {
  // The socket-options hook sees the listening socket before bind: keep it, to listen again on it with a
  // longer queue once the library has listened with its own.
  auto socket = std::make_shared<int>(-1);
  server.set_socket_options([socket](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);  // what the library's default does
    *socket = sock;
  });
  const int bound = port == 0 ? server.bind_to_any_port(host) : (server.bind_to_port(host, port) ? port : -1);
  if (bound > 0 && *socket >= 0) ::listen(*socket, SOMAXCONN);
  return bound;
}

void stop_and_drain(httplib::Server& server, Batcher& batcher) {
  server.stop();
  batcher.drain();
}

}  // namespace stitchcuda_server
