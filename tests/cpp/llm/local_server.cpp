// LocalServer over POSIX sockets, and the OpenAI / Anthropic replies the llm tests script with.
#include "local_server.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace stitchcuda_test {
namespace {

using Json = nlohmann::json;

bool send_all(int fd, const std::string& data) {
  std::size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += std::size_t(n);
  }
  return true;
}

std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  const auto first = s.find_first_not_of(" \t\r");
  if (first == std::string::npos) return {};
  return s.substr(first, s.find_last_not_of(" \t\r") - first + 1);
}

const char* reason_phrase(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 429: return "Too Many Requests";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 529: return "Overloaded";
    default: return "Status";
  }
}

// Reads one request from `buffer` + the socket; false when the peer closed or sent garbage.
bool read_request(int fd, std::string& buffer, SeenRequest& out) {
  std::size_t header_end;
  while ((header_end = buffer.find("\r\n\r\n")) == std::string::npos) {
    char chunk[16384];
    const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
    if (n <= 0) return false;
    buffer.append(chunk, std::size_t(n));
  }
  const std::string head = buffer.substr(0, header_end);
  buffer.erase(0, header_end + 4);
  std::size_t line_end = head.find("\r\n");
  const std::string request_line = head.substr(0, line_end);
  const auto sp1 = request_line.find(' ');
  const auto sp2 = request_line.find(' ', sp1 + 1);
  if (sp1 == std::string::npos || sp2 == std::string::npos) return false;
  out = SeenRequest{};
  out.method = request_line.substr(0, sp1);
  out.path = request_line.substr(sp1 + 1, sp2 - sp1 - 1);
  while (line_end != std::string::npos && line_end < head.size()) {
    const std::size_t next = head.find("\r\n", line_end + 2);
    const std::string line = head.substr(line_end + 2, next == std::string::npos ? std::string::npos : next - line_end - 2);
    const auto colon = line.find(':');
    if (colon != std::string::npos) out.headers[lower(line.substr(0, colon))] = trim(line.substr(colon + 1));
    line_end = next;
  }
  const std::size_t length = std::stoul(out.header("content-length").empty() ? "0" : out.header("content-length"));
  while (buffer.size() < length) {
    char chunk[16384];
    const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
    if (n <= 0) return false;
    buffer.append(chunk, std::size_t(n));
  }
  out.body = buffer.substr(0, length);
  buffer.erase(0, length);
  return true;
}

std::string sse(const Json& data, const std::string& event = {}) {
  std::string out;
  if (!event.empty()) out += "event: " + event + "\n";
  return out + "data: " + data.dump() + "\n\n";
}

}  // namespace

std::string SeenRequest::header(const std::string& name) const {
  auto it = headers.find(name);
  return it == headers.end() ? std::string() : it->second;
}

LocalServer::LocalServer() : handler_(protocol_reply) {
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0 || ::pipe(wake_pipe_) != 0) throw std::runtime_error("LocalServer: no socket");
  int on = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;  // any free port
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(listen_fd_, 512) != 0)
    throw std::runtime_error("LocalServer: cannot listen on 127.0.0.1");
  socklen_t len = sizeof addr;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  acceptor_ = std::thread([this] { accept_loop(); });
}

LocalServer::~LocalServer() {
  stopping_ = true;
  {
    std::lock_guard lock(mu_);
    stop_signal_.notify_all();
  }
  [[maybe_unused]] auto w = ::write(wake_pipe_[1], "x", 1);
  acceptor_.join();
  {
    std::lock_guard lock(mu_);
    for (int fd : open_fds_) ::shutdown(fd, SHUT_RDWR);  // wakes threads blocked in recv
  }
  for (auto& t : connections_) t.join();
  ::close(listen_fd_);
  ::close(wake_pipe_[0]);
  ::close(wake_pipe_[1]);
}

std::string LocalServer::url() const { return "http://127.0.0.1:" + std::to_string(port_); }

void LocalServer::queue(ScriptedReply reply) {
  std::lock_guard lock(mu_);
  queued_.push_back(std::move(reply));
}

void LocalServer::set_handler(Handler handler) {
  std::lock_guard lock(mu_);
  handler_ = std::move(handler);
}

std::vector<SeenRequest> LocalServer::requests() const {
  std::lock_guard lock(mu_);
  return seen_;
}

std::size_t LocalServer::request_count() const {
  std::lock_guard lock(mu_);
  return seen_.size();
}

std::size_t LocalServer::connection_count() const {
  std::lock_guard lock(mu_);
  return connections_.size();
}

void LocalServer::accept_loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_pipe_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0 || stopping_) return;
    if (!(fds[0].revents & POLLIN)) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    int on = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);  // stream chunks leave at once
    std::lock_guard lock(mu_);
    open_fds_.push_back(fd);
    connections_.emplace_back([this, fd] { serve(fd); });
  }
}

bool LocalServer::pause(int ms) {
  if (ms <= 0) return !stopping_;
  std::unique_lock lock(mu_);
  stop_signal_.wait_for(lock, std::chrono::milliseconds(ms), [&] { return stopping_.load(); });
  return !stopping_;
}

ScriptedReply LocalServer::next_reply(const SeenRequest& request) {
  Handler handler;
  {
    std::lock_guard lock(mu_);
    seen_.push_back(request);
    if (!queued_.empty()) {
      ScriptedReply reply = std::move(queued_.front());
      queued_.pop_front();
      return reply;
    }
    handler = handler_;
  }
  return handler(request);  // outside the lock: a handler may be slow
}

void LocalServer::serve(int fd) {
  std::string buffer;
  SeenRequest request;
  while (!stopping_ && read_request(fd, buffer, request)) {
    const ScriptedReply reply = next_reply(request);
    if (!pause(reply.delay_ms) || reply.drop) break;
    std::string head = "HTTP/1.1 " + std::to_string(reply.status) + " " + reason_phrase(reply.status) + "\r\n" +
                       "Content-Type: " + reply.content_type + "\r\n";
    for (const auto& [name, value] : reply.headers) head += name + ": " + value + "\r\n";
    if (reply.chunks.empty()) {
      head += "Content-Length: " + std::to_string(reply.body.size()) + "\r\n\r\n";
      if (!send_all(fd, head + reply.body)) break;
      continue;
    }
    head += "Transfer-Encoding: chunked\r\n\r\n";
    if (!send_all(fd, head)) break;
    bool cut = false;
    for (std::size_t i = 0; i < reply.chunks.size(); ++i) {
      if (reply.cut_after_chunks >= 0 && int(i) >= reply.cut_after_chunks) {
        cut = true;
        break;
      }
      if (i > 0 && !pause(reply.chunk_delay_ms)) break;
      char size[32];
      std::snprintf(size, sizeof size, "%zx\r\n", reply.chunks[i].size());
      if (!send_all(fd, size + reply.chunks[i] + "\r\n")) break;
    }
    if (cut || !send_all(fd, "0\r\n\r\n")) break;
  }
  {
    std::lock_guard lock(mu_);
    open_fds_.erase(std::remove(open_fds_.begin(), open_fds_.end(), fd), open_fds_.end());
  }
  ::shutdown(fd, SHUT_RDWR);
  ::close(fd);
}

std::string last_user_message(const SeenRequest& request) {
  const Json body = Json::parse(request.body, nullptr, false);
  if (body.is_discarded() || !body.contains("messages")) return {};
  std::string text;
  for (const auto& m : body["messages"])
    if (m.value("role", "") == "user") text = m.value("content", "");
  return text;
}

ScriptedReply openai_reply(const std::string& text, const std::string& finish_reason, int prompt_tokens,
                           int completion_tokens) {
  const Json body = {{"id", "chatcmpl-local-1"},
                     {"object", "chat.completion"},
                     {"model", "local-model"},
                     {"choices",
                      {{{"index", 0},
                        {"message", {{"role", "assistant"}, {"content", text}}},
                        {"finish_reason", finish_reason}}}},
                     {"usage",
                      {{"prompt_tokens", prompt_tokens},
                       {"completion_tokens", completion_tokens},
                       {"total_tokens", prompt_tokens + completion_tokens}}}};
  ScriptedReply reply;
  reply.body = body.dump();
  return reply;
}

ScriptedReply openai_stream(const std::vector<std::string>& pieces, const std::string& finish_reason) {
  ScriptedReply reply;
  reply.content_type = "text/event-stream";
  const Json base = {{"id", "chatcmpl-local-2"}, {"object", "chat.completion.chunk"}, {"model", "local-model"}};
  for (const auto& piece : pieces) {
    Json chunk = base;
    chunk["choices"] = {{{"index", 0}, {"delta", {{"content", piece}}}, {"finish_reason", nullptr}}};
    reply.chunks.push_back(sse(chunk));
  }
  Json last = base;
  last["choices"] = {{{"index", 0}, {"delta", Json::object()}, {"finish_reason", finish_reason}}};
  reply.chunks.push_back(sse(last));
  Json usage = base;
  usage["choices"] = Json::array();
  usage["usage"] = {{"prompt_tokens", 10}, {"completion_tokens", int(pieces.size())},
                    {"total_tokens", 10 + int(pieces.size())}};
  reply.chunks.push_back(sse(usage));
  reply.chunks.push_back("data: [DONE]\n\n");
  return reply;
}

ScriptedReply anthropic_reply(const std::string& text, const std::string& stop_reason, int input_tokens,
                              int output_tokens) {
  const Json body = {{"id", "msg_local_1"},
                     {"type", "message"},
                     {"role", "assistant"},
                     {"model", "local-claude"},
                     {"content", {{{"type", "text"}, {"text", text}}}},
                     {"stop_reason", stop_reason},
                     {"usage", {{"input_tokens", input_tokens}, {"output_tokens", output_tokens}}}};
  ScriptedReply reply;
  reply.body = body.dump();
  return reply;
}

ScriptedReply anthropic_stream(const std::vector<std::string>& pieces, const std::string& stop_reason) {
  ScriptedReply reply;
  reply.content_type = "text/event-stream";
  reply.chunks.push_back(sse({{"type", "message_start"},
                              {"message",
                               {{"id", "msg_local_2"},
                                {"model", "local-claude"},
                                {"usage", {{"input_tokens", 12}, {"output_tokens", 1}}}}}},
                             "message_start"));
  reply.chunks.push_back(sse({{"type", "content_block_start"}, {"index", 0}}, "content_block_start"));
  reply.chunks.push_back("event: ping\ndata: {\"type\": \"ping\"}\n\n");
  for (const auto& piece : pieces)
    reply.chunks.push_back(sse({{"type", "content_block_delta"}, {"index", 0},
                                {"delta", {{"type", "text_delta"}, {"text", piece}}}},
                               "content_block_delta"));
  reply.chunks.push_back(sse({{"type", "content_block_stop"}, {"index", 0}}, "content_block_stop"));
  reply.chunks.push_back(sse({{"type", "message_delta"},
                              {"delta", {{"stop_reason", stop_reason}}},
                              {"usage", {{"output_tokens", int(pieces.size())}}}},
                             "message_delta"));
  reply.chunks.push_back(sse({{"type", "message_stop"}}, "message_stop"));
  return reply;
}

ScriptedReply error_reply(int status, const std::string& message, std::vector<std::pair<std::string, std::string>> headers) {
  ScriptedReply reply;
  reply.status = status;
  reply.body = Json{{"error", {{"message", message}, {"type", "test_error"}}}}.dump();
  reply.headers = std::move(headers);
  return reply;
}

ScriptedReply protocol_reply(const SeenRequest& request) {
  const Json body = Json::parse(request.body, nullptr, false);
  const bool stream = !body.is_discarded() && body.value("stream", false);
  const std::string text = "echo: " + last_user_message(request);
  // Three pieces, so a streaming client sees more than one.
  const std::size_t third = text.size() / 3;
  const std::vector<std::string> pieces = {text.substr(0, third), text.substr(third, third), text.substr(2 * third)};
  const auto ends_with = [&](const std::string& suffix) {
    return request.path.size() >= suffix.size() &&
           request.path.compare(request.path.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with("/chat/completions")) return stream ? openai_stream(pieces) : openai_reply(text);
  if (ends_with("/v1/messages")) return stream ? anthropic_stream(pieces) : anthropic_reply(text);
  return error_reply(404, "no route " + request.path);
}

}  // namespace stitchcuda_test
