// A real HTTP/1.1 server on 127.0.0.1 for the llm tests and benchmark: it speaks the OpenAI and
// Anthropic protocols (echoing the last user message), streams, and fails on request.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace stitchcuda_test {

/// A request as the server read it.
struct SeenRequest {
  std::string method;
  std::string path;
  std::map<std::string, std::string> headers;  ///< names in lower case
  std::string body;

  /// A header's value, "" when absent (`name` in lower case).
  std::string header(const std::string& name) const;
};

/// What the server does with one request.
struct ScriptedReply {
  int status = 200;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;  ///< further headers
  std::string body;                 ///< sent with Content-Length when `chunks` is empty
  std::vector<std::string> chunks;  ///< else sent with chunked transfer encoding, one write each
  int delay_ms = 0;                 ///< before the status line: a slow first byte
  int chunk_delay_ms = 0;           ///< between chunks
  int cut_after_chunks = -1;        ///< close the connection after this many chunks, the stream unfinished
  bool drop = false;                ///< close the connection without answering
};

/// Threaded server: one thread accepts, one thread serves each connection (keep-alive).
class LocalServer {
 public:
  using Handler = std::function<ScriptedReply(const SeenRequest&)>;

  /// Listens on 127.0.0.1 at a free port; answers with protocol_reply until told otherwise.
  LocalServer();
  ~LocalServer();
  LocalServer(const LocalServer&) = delete;
  LocalServer& operator=(const LocalServer&) = delete;

  /// "http://127.0.0.1:PORT".
  std::string url() const;
  /// Replies for the next requests, in order, before the handler answers again.
  void queue(ScriptedReply reply);
  /// Replaces the handler that answers when the queue is empty.
  void set_handler(Handler handler);
  /// Every request read so far.
  std::vector<SeenRequest> requests() const;
  /// How many requests were read.
  std::size_t request_count() const;
  /// How many connections were accepted.
  std::size_t connection_count() const;

 private:
  void accept_loop();
  void serve(int fd);
  ScriptedReply next_reply(const SeenRequest& request);
  bool pause(int ms);  // false when the server is stopping

  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;
  std::condition_variable stop_signal_;
  std::deque<ScriptedReply> queued_;
  Handler handler_;
  std::vector<SeenRequest> seen_;
  std::vector<int> open_fds_;
  std::vector<std::thread> connections_;
  std::thread acceptor_;
};

/// The text of the last user message (OpenAI or Anthropic request body), "" if none.
std::string last_user_message(const SeenRequest& request);

/// A whole OpenAI chat completion.
ScriptedReply openai_reply(const std::string& text, const std::string& finish_reason = "stop",
                           int prompt_tokens = 10, int completion_tokens = 5);
/// An OpenAI stream: one chunk per piece, then finish_reason, a usage chunk and [DONE].
ScriptedReply openai_stream(const std::vector<std::string>& pieces, const std::string& finish_reason = "stop");
/// A whole Anthropic message.
ScriptedReply anthropic_reply(const std::string& text, const std::string& stop_reason = "end_turn",
                              int input_tokens = 12, int output_tokens = 6);
/// An Anthropic stream: message_start, one text delta per piece, message_delta, message_stop.
ScriptedReply anthropic_stream(const std::vector<std::string>& pieces, const std::string& stop_reason = "end_turn");
/// An error reply in the OpenAI shape {"error": {"message": ...}}.
ScriptedReply error_reply(int status, const std::string& message,
                          std::vector<std::pair<std::string, std::string>> headers = {});
/// The default: "echo: <last user message>" in the protocol the path names, streamed when asked.
ScriptedReply protocol_reply(const SeenRequest& request);

}  // namespace stitchcuda_test
