// Every way a model server fails, one test each, against the local server: what is retried (and
// how often, after how long), what fails at once, and what the error says.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include <stitchcuda/llm.hpp>

#include "catch_shim.hpp"
#include "connect_local.hpp"
#include "local_server.hpp"

using namespace stitchcuda;
using namespace stitchcuda::llm;
using namespace stitchcuda_test;

namespace {

// A port on 127.0.0.1 with nothing listening: bound, then released.
int unused_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

Options streaming() {
  Options o;
  o.stream = true;
  return o;
}

}  // namespace

TEST_CASE("429 with Retry-After: waits as long as the server asked, then succeeds", "[llm][failure]") {
  LocalServer server;
  server.queue(error_reply(429, "slow down", {{"Retry-After", "1"}}));
  auto backend = connect_local(server);
  const auto start = std::chrono::steady_clock::now();
  auto reply = backend->complete(ask("after the limit"));
  const double elapsed = seconds_since(start);
  REQUIRE(reply);
  CHECK(reply->text == "echo: after the limit");
  CHECK(reply->attempts == 2);
  CHECK(server.request_count() == 2);
  CHECK(elapsed >= 0.95);  // Retry-After, not the 5 ms back-off
  CHECK(elapsed < 3.0);
  CHECK(backend->totals().retries == 1);
}

TEST_CASE("retry-after-ms is honoured to the millisecond", "[llm][failure]") {
  LocalServer server;
  server.queue(error_reply(429, "slow down", {{"retry-after-ms", "150"}, {"Retry-After", "5"}}));
  auto backend = connect_local(server);
  const auto start = std::chrono::steady_clock::now();
  REQUIRE(backend->complete(ask("x")));
  const double elapsed = seconds_since(start);
  CHECK(elapsed >= 0.14);
  CHECK(elapsed < 1.0);  // the finer header wins over Retry-After: 5
}

TEST_CASE("a Retry-After beyond max_retry_after_s fails at once instead of sleeping", "[llm][failure]") {
  LocalServer server;
  server.queue(error_reply(429, "quota exhausted", {{"Retry-After", "3600"}}));
  auto backend = connect_local(server);
  const auto start = std::chrono::steady_clock::now();
  auto reply = backend->complete(ask("x"));
  CHECK(seconds_since(start) < 1.0);
  REQUIRE_FALSE(reply);
  CHECK(reply.error().http_status == 429);
  CHECK(contains(reply.error().message, "quota exhausted"));
  CHECK(contains(reply.error().message, "asked to retry after 3.6e+03 s"));
  CHECK(server.request_count() == 1);
}

TEST_CASE("500 then success: one retry after the back-off", "[llm][failure]") {
  LocalServer server;
  server.queue(error_reply(500, "internal hiccup"));
  auto backend = connect_local(server);
  auto reply = backend->complete(ask("second time lucky"));
  REQUIRE(reply);
  CHECK(reply->text == "echo: second time lucky");
  CHECK(reply->attempts == 2);
  CHECK(server.request_count() == 2);
  const Totals t = backend->totals();
  CHECK(t.calls == 1);
  CHECK(t.attempts == 2);
  CHECK(t.retries == 1);
  CHECK(t.failures == 0);
}

TEST_CASE("the back-off doubles between retries", "[llm][failure]") {
  LocalServer server;
  server.queue(error_reply(500, "one"));
  server.queue(error_reply(502, "two"));
  ConnectOptions options = quick_retries();
  options.reliability.retry.initial_backoff_s = 0.05;  // then 0.1
  auto backend = connect_local(server, "openai", options);
  const auto start = std::chrono::steady_clock::now();
  auto reply = backend->complete(ask("x"));
  const double elapsed = seconds_since(start);
  REQUIRE(reply);
  CHECK(reply->attempts == 3);
  CHECK(elapsed >= 0.149);
  CHECK(elapsed < 0.6);
}

TEST_CASE("408, 409, 503 and 529 are retried; after max_attempts the last error is reported", "[llm][failure]") {
  LocalServer server;
  server.queue(error_reply(408, "timeout"));
  server.queue(error_reply(409, "conflict"));
  server.queue(error_reply(529, "overloaded"));
  auto backend = connect_local(server);  // 3 attempts
  auto reply = backend->complete(ask("x"));
  REQUIRE_FALSE(reply);
  CHECK(reply.error().code == ErrorCode::LlmError);
  CHECK(reply.error().http_status == 529);
  CHECK(contains(reply.error().message, "HTTP 529 (overloaded): overloaded"));
  CHECK(contains(reply.error().message, "gave up after 3 attempts"));
  CHECK(server.request_count() == 3);
  CHECK(backend->totals().failures == 1);
  server.queue(error_reply(503, "down"));
  auto again = backend->complete(ask("y"));
  REQUIRE(again);
  CHECK(again->attempts == 2);
}

TEST_CASE("401 fails at once with the server's message, the variable to check, and no key", "[llm][failure]") {
  LocalServer server;
  ::setenv("STITCHCUDA_TEST_BAD_KEY", "sk-secret-do-not-print-42", 1);
  // A careless server that echoes the key back: it must still never reach the error.
  server.set_handler([](const SeenRequest& r) {
    return error_reply(401, "Incorrect API key provided: " + r.header("authorization"));
  });
  ConnectOptions options = quick_retries();
  options.server.api_key_env = "STITCHCUDA_TEST_BAD_KEY";
  auto backend = connect_local(server, "openai", options);
  auto reply = backend->complete(ask("x"));
  REQUIRE_FALSE(reply);
  const Error& e = reply.error();
  CHECK(e.code == ErrorCode::LlmError);
  CHECK(e.http_status == 401);
  CHECK_FALSE(e.transient);
  CHECK(server.request_count() == 1);
  CHECK(contains(e.message, "HTTP 401 (unauthorized): Incorrect API key provided: Bearer [redacted]"));
  CHECK(contains(e.message, "check the API key in STITCHCUDA_TEST_BAD_KEY"));
  CHECK_FALSE(contains(e.message, "sk-secret-do-not-print-42"));
  CHECK_FALSE(contains(e.log, "sk-secret-do-not-print-42"));
  CHECK_FALSE(contains(e.describe(), "sk-secret-do-not-print-42"));
  ::unsetenv("STITCHCUDA_TEST_BAD_KEY");
}

TEST_CASE("400, 403 and 404 fail at once, each naming what to check", "[llm][failure]") {
  LocalServer server;
  auto backend = connect_local(server);
  server.queue(error_reply(400, "max_tokens is too large"));
  auto bad = backend->complete(ask("x"));
  REQUIRE_FALSE(bad);
  CHECK(bad.error().http_status == 400);
  CHECK(contains(bad.error().message, "max_tokens is too large"));
  server.queue(error_reply(403, "no access to this model"));
  auto forbidden = backend->complete(ask("x"));
  REQUIRE_FALSE(forbidden);
  CHECK(contains(forbidden.error().message, "no API key was sent: set OPENAI_API_KEY"));
  server.queue(error_reply(404, "The model `nope` does not exist"));
  auto missing = backend->complete(ask("x"));
  REQUIRE_FALSE(missing);
  CHECK(contains(missing.error().message, "does not exist; check the model name and the base URL"));
  CHECK(server.request_count() == 3);  // none retried
}

TEST_CASE("slow first byte: the call ends with Timeout at its deadline", "[llm][failure]") {
  LocalServer server;
  server.queue(delayed(openai_reply("too late"), 3000));
  auto backend = connect_local(server);
  Options o;
  o.timeout_s = 0.3;
  const auto start = std::chrono::steady_clock::now();
  auto reply = backend->complete(ask("x"), o);
  const double elapsed = seconds_since(start);
  REQUIRE_FALSE(reply);
  CHECK(reply.error().code == ErrorCode::Timeout);
  CHECK(contains(reply.error().message, "within the 0.3 s timeout (no response had begun)"));
  CHECK(elapsed >= 0.29);
  CHECK(elapsed < 1.0);
  CHECK(server.request_count() == 1);  // no time was left for a retry
}

TEST_CASE("a stream cut mid-way fails without a retry, keeping the partial text", "[llm][failure][stream]") {
  LocalServer server;
  ScriptedReply cut = openai_stream({"The ", "answer ", "is ", "42"});
  cut.cut_after_chunks = 2;
  server.queue(cut);
  auto backend = connect_local(server);
  std::string delivered;
  auto reply = backend->complete(ask("x"), streaming(), [&](std::string_view p) { delivered += p; });
  REQUIRE_FALSE(reply);
  CHECK(reply.error().code == ErrorCode::LlmError);
  CHECK(contains(reply.error().message, "was cut after 11 characters of the reply"));
  CHECK(reply.error().log == "The answer ");
  CHECK(delivered == "The answer ");  // a retry would have delivered these twice
  CHECK(server.request_count() == 1);
}

TEST_CASE("a stream cut before any text is retried", "[llm][failure][stream]") {
  LocalServer server;
  ScriptedReply cut = openai_stream({"never"});
  cut.cut_after_chunks = 0;
  server.queue(cut);
  auto backend = connect_local(server);
  std::string delivered;
  auto reply = backend->complete(ask("retry me"), streaming(), [&](std::string_view p) { delivered += p; });
  REQUIRE(reply);
  CHECK(reply->text == "echo: retry me");
  CHECK(delivered == "echo: retry me");
  CHECK(reply->attempts == 2);
}

TEST_CASE("a stream that ends cleanly without a finish is incomplete, not a reply", "[llm][failure][stream]") {
  LocalServer server;
  ScriptedReply unfinished = openai_stream({"half"});
  unfinished.chunks.resize(1);  // the first piece only, then a proper end of body
  server.queue(unfinished);
  auto backend = connect_local(server);
  auto reply = backend->complete(ask("x"), streaming(), [](std::string_view) {});
  REQUIRE_FALSE(reply);
  CHECK(contains(reply.error().message, "ended after 4 characters without a finish_reason or [DONE]"));
}

TEST_CASE("malformed JSON in a reply is an error naming it, not retried", "[llm][failure]") {
  LocalServer server;
  ScriptedReply broken;
  broken.body = R"({"choices": [{"message": {"content": "x"})";
  server.queue(broken);
  auto backend = connect_local(server);
  auto reply = backend->complete(ask("x"));
  REQUIRE_FALSE(reply);
  CHECK(reply.error().code == ErrorCode::LlmError);
  CHECK(contains(reply.error().message, "sent malformed JSON: {\"choices\""));
  CHECK(server.request_count() == 1);
}

TEST_CASE("malformed JSON inside a stream stops it with the offending event", "[llm][failure][stream]") {
  LocalServer server;
  ScriptedReply broken;
  broken.content_type = "text/event-stream";
  broken.chunks = {"data: {\"choices\": [{\"delta\": {\"content\": \"ok\"}}]}\n\n", "data: {not json\n\n"};
  server.queue(broken);
  auto backend = connect_local(server);
  auto reply = backend->complete(ask("x"), streaming(), [](std::string_view) {});
  REQUIRE_FALSE(reply);
  CHECK(contains(reply.error().message, "malformed JSON in its stream: {not json"));
}

TEST_CASE("an empty choice list is an error saying so", "[llm][failure]") {
  LocalServer server;
  ScriptedReply empty;
  empty.body = R"({"id": "x", "model": "m", "choices": []})";
  server.queue(empty);
  auto backend = connect_local(server);
  auto reply = backend->complete(ask("x"));
  REQUIRE_FALSE(reply);
  CHECK(contains(reply.error().message, "returned an empty choice list"));
  CHECK(reply.error().http_status == 200);
}

TEST_CASE("a server that is not OpenAI-compatible is named as such", "[llm][failure]") {
  LocalServer server;
  ScriptedReply html;
  html.content_type = "text/html";
  html.body = "<html><body>Welcome to nginx!</body></html>";
  server.queue(html);
  ScriptedReply other_json;
  other_json.body = R"({"status": "ok"})";
  server.queue(other_json);
  auto backend = connect_local(server);
  auto first = backend->complete(ask("x"));
  REQUIRE_FALSE(first);
  CHECK(contains(first.error().message, "is not an OpenAI-compatible chat-completions endpoint: it answered text/html"));
  CHECK(contains(first.error().message, "check the base URL"));
  auto second = backend->complete(ask("x"));
  REQUIRE_FALSE(second);
  CHECK(contains(second.error().message, "its JSON reply has no 'choices' list"));
}

TEST_CASE("an unreachable base URL is retried, then named", "[llm][failure]") {
  const std::string url = "http://127.0.0.1:" + std::to_string(unused_port()) + "/v1";
  auto backend = connect("openai:m@" + url, quick_retries());
  REQUIRE(backend);
  auto reply = (*backend)->complete(ask("x"));
  REQUIRE_FALSE(reply);
  CHECK(reply.error().code == ErrorCode::LlmError);
  CHECK(contains(reply.error().message, "could not reach " + url + "/chat/completions"));
  CHECK(contains(reply.error().message, "is the server running at that address?"));
  CHECK(contains(reply.error().message, "gave up after 3 attempts"));
  CHECK((*backend)->totals().attempts == 3);
}

TEST_CASE("a dropped connection is retried", "[llm][failure]") {
  LocalServer server;
  ScriptedReply drop;
  drop.drop = true;
  server.queue(drop);
  auto backend = connect_local(server);
  auto reply = backend->complete(ask("x"));
  REQUIRE(reply);
  CHECK(reply->attempts == 2);
}

TEST_CASE("a reply cut at the length limit is an error unless partial replies are allowed", "[llm][failure]") {
  LocalServer server;
  server.queue(openai_reply("partial ans", "length", 10, 16));
  server.queue(openai_reply("partial ans", "length", 10, 16));
  auto backend = connect_local(server);
  Options o;
  o.max_tokens = 16;
  auto reply = backend->complete(ask("x"), o);
  REQUIRE_FALSE(reply);
  CHECK(reply.error().code == ErrorCode::LlmError);
  CHECK(contains(reply.error().message, "hit the length limit (finish_reason 'length', max_tokens = 16, 16 completion tokens)"));
  CHECK(reply.error().log == "partial ans");
  CHECK(backend->totals().usage.completion_tokens == 16);  // the tokens were spent all the same
  o.allow_truncated = true;
  auto allowed = backend->complete(ask("x"), o);
  REQUIRE(allowed);
  CHECK(allowed->finish_reason == "length");
  CHECK(allowed->text == "partial ans");
}

TEST_CASE("a reply larger than max_reply_bytes is refused, not buffered", "[llm][failure]") {
  LocalServer server;
  server.queue(openai_reply(std::string(100000, 'x')));
  ConnectOptions options = quick_retries();
  options.server.max_reply_bytes = 4096;
  auto backend = connect_local(server, "openai", options);
  auto reply = backend->complete(ask("x"));
  REQUIRE_FALSE(reply);
  CHECK(contains(reply.error().message, "exceeds the limit of 4096 bytes (max_reply_bytes)"));
  CHECK(server.request_count() == 1);
}

TEST_CASE("anthropic: an overloaded error event before any text is retried", "[llm][failure][anthropic]") {
  LocalServer server;
  ScriptedReply overloaded;
  overloaded.content_type = "text/event-stream";
  overloaded.chunks = {"event: error\ndata: {\"type\": \"error\", \"error\": {\"type\": \"overloaded_error\", "
                       "\"message\": \"Overloaded\"}}\n\n"};
  server.queue(overloaded);
  auto backend = connect_local(server, "anthropic");
  auto reply = backend->complete(ask("again"), streaming(), [](std::string_view) {});
  REQUIRE(reply);
  CHECK(reply->text == "echo: again");
  CHECK(reply->attempts == 2);
}

TEST_CASE("anthropic: a 529 with the Anthropic error shape is retried and its message kept", "[llm][failure][anthropic]") {
  LocalServer server;
  ScriptedReply overloaded;
  overloaded.status = 529;
  overloaded.body = R"({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})";
  for (int i = 0; i < 3; ++i) server.queue(overloaded);
  auto backend = connect_local(server, "anthropic");
  auto reply = backend->complete(ask("x"));
  REQUIRE_FALSE(reply);
  CHECK(contains(reply.error().message, "HTTP 529 (overloaded): Overloaded"));
  CHECK(server.request_count() == 3);
}
