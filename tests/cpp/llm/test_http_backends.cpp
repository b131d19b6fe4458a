// The OpenAI-compatible and Anthropic backends against the local server: what they send (body
// fields, headers, keys) and what they make of plain and streamed replies.
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <stitchcuda/llm.hpp>

#include "catch_shim.hpp"
#include "connect_local.hpp"
#include "local_server.hpp"

using namespace stitchcuda;
using namespace stitchcuda::llm;
using namespace stitchcuda_test;
using Json = nlohmann::json;

TEST_CASE("openai: a plain request carries the options and the reply is read whole", "[llm][openai]") {
  LocalServer server;
  ::setenv("STITCHCUDA_TEST_OPENAI_KEY", "sk-test-plain-0123456789", 1);
  ConnectOptions options = quick_retries();
  options.server.api_key_env = "STITCHCUDA_TEST_OPENAI_KEY";
  options.server.organization = "org-42";
  options.server.headers = {{"X-Trace", "abc"}};
  auto backend = connect_local(server, "openai", options);
  CHECK(backend->name() == "openai:local-model@" + server.url() + "/v1");

  Options o;
  o.temperature = 0.25;
  o.top_p = 0.5;
  o.max_tokens = 64;
  o.stop = {"END"};
  o.seed = 7;
  o.json_schema = R"({"type": "object", "properties": {"x": {"type": "integer"}}})";
  o.extra_json = R"({"top_k": 20, "temperature": 0.5})";
  auto reply = backend->complete({{"system", "be brief"}, {"user", "hello"}}, o);
  REQUIRE(reply);
  CHECK(reply->text == "echo: hello");
  CHECK(reply->finish_reason == "stop");
  CHECK(reply->usage.prompt_tokens == 10);
  CHECK(reply->usage.completion_tokens == 5);
  CHECK(reply->usage.total_tokens == 15);
  CHECK(reply->model == "local-model");
  CHECK(reply->id == "chatcmpl-local-1");
  CHECK(reply->attempts == 1);
  CHECK(reply->latency_ms > 0);

  const auto seen = server.requests();
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].method == "POST");
  CHECK(seen[0].path == "/v1/chat/completions");
  CHECK(seen[0].header("authorization") == "Bearer sk-test-plain-0123456789");
  CHECK(seen[0].header("openai-organization") == "org-42");
  CHECK(seen[0].header("x-trace") == "abc");
  CHECK(seen[0].header("content-type") == "application/json");
  const Json body = Json::parse(seen[0].body);
  CHECK(body["model"] == "local-model");
  CHECK(body["messages"] == Json::array({{{"role", "system"}, {"content", "be brief"}},
                                         {{"role", "user"}, {"content", "hello"}}}));
  CHECK(body["temperature"] == 0.5);  // extra_json overrides
  CHECK(body["top_k"] == 20);
  CHECK(body["top_p"] == 0.5);
  CHECK(body["max_tokens"] == 64);  // a local server: max_tokens, not max_completion_tokens
  CHECK(body["stop"] == Json::array({"END"}));
  CHECK(body["seed"] == 7);
  CHECK(body["response_format"]["type"] == "json_schema");
  CHECK(body["response_format"]["json_schema"]["name"] == "reply");
  CHECK(body["response_format"]["json_schema"]["schema"]["properties"]["x"]["type"] == "integer");
  CHECK_FALSE(body.contains("stream"));
  ::unsetenv("STITCHCUDA_TEST_OPENAI_KEY");
}

TEST_CASE("openai: a local server gets no Authorization header when no key is set", "[llm][openai]") {
  LocalServer server;
  ::unsetenv("OPENAI_API_KEY");
  auto backend = connect_local(server);
  REQUIRE(backend->complete(ask("hi")));
  CHECK(server.requests().at(0).header("authorization").empty());
}

TEST_CASE("openai: streaming passes each piece on and assembles the same completion", "[llm][openai][stream]") {
  LocalServer server;
  server.queue(openai_stream({"Hel", "lo, ", "world"}));
  auto backend = connect_local(server);
  Options o;
  o.stream = true;
  std::vector<std::string> pieces;
  auto reply = backend->complete(ask("greet"), o, [&](std::string_view p) { pieces.emplace_back(p); });
  REQUIRE(reply);
  CHECK(pieces == std::vector<std::string>{"Hel", "lo, ", "world"});
  CHECK(reply->text == "Hello, world");
  CHECK(reply->finish_reason == "stop");
  CHECK(reply->usage.completion_tokens == 3);  // from the include_usage chunk
  CHECK(reply->usage.total_tokens == 13);
  CHECK(reply->id == "chatcmpl-local-2");
  const Json body = Json::parse(server.requests().at(0).body);
  CHECK(body["stream"] == true);
  CHECK(body["stream_options"]["include_usage"] == true);
  CHECK(server.requests().at(0).header("accept") == "text/event-stream");
}

TEST_CASE("openai: a server that ignores stream=true still answers, in one piece", "[llm][openai][stream]") {
  LocalServer server;
  server.queue(openai_reply("whole reply"));
  auto backend = connect_local(server);
  Options o;
  o.stream = true;
  std::vector<std::string> pieces;
  auto reply = backend->complete(ask("x"), o, [&](std::string_view p) { pieces.emplace_back(p); });
  REQUIRE(reply);
  CHECK(reply->text == "whole reply");
  CHECK(pieces == std::vector<std::string>{"whole reply"});
}

TEST_CASE("anthropic: headers, the system prompt apart, max_tokens by default", "[llm][anthropic]") {
  LocalServer server;
  ::setenv("ANTHROPIC_API_KEY", "sk-ant-test-0123456789", 1);
  auto backend = connect_local(server, "anthropic");
  Options o;
  o.stop = {"###"};
  auto reply = backend->complete({{"system", "rule one"}, {"system", "rule two"}, {"user", "ping"}}, o);
  REQUIRE(reply);
  CHECK(reply->text == "echo: ping");
  CHECK(reply->finish_reason == "stop");  // end_turn, in OpenAI's words
  CHECK(reply->usage.prompt_tokens == 12);
  CHECK(reply->usage.completion_tokens == 6);
  CHECK(reply->usage.total_tokens == 18);
  CHECK(reply->model == "local-claude");
  CHECK(reply->id == "msg_local_1");

  const auto seen = server.requests().at(0);
  CHECK(seen.path == "/v1/messages");
  CHECK(seen.header("x-api-key") == "sk-ant-test-0123456789");
  CHECK(seen.header("anthropic-version") == "2023-06-01");
  CHECK(seen.header("authorization").empty());
  const Json body = Json::parse(seen.body);
  CHECK(body["system"] == "rule one\n\nrule two");
  CHECK(body["messages"] == Json::array({{{"role", "user"}, {"content", "ping"}}}));
  CHECK(body["max_tokens"] == 4096);
  CHECK(body["stop_sequences"] == Json::array({"###"}));
  ::unsetenv("ANTHROPIC_API_KEY");
}

TEST_CASE("anthropic: streamed events assemble text, usage and stop reason", "[llm][anthropic][stream]") {
  LocalServer server;
  server.queue(anthropic_stream({"a", "b", "c", "d"}, "max_tokens"));
  auto backend = connect_local(server, "anthropic");
  Options o;
  o.stream = true;
  o.allow_truncated = true;
  std::string streamed;
  auto reply = backend->complete(ask("letters"), o, [&](std::string_view p) { streamed += p; });
  REQUIRE(reply);
  CHECK(streamed == "abcd");
  CHECK(reply->text == "abcd");
  CHECK(reply->finish_reason == "length");  // max_tokens, translated
  CHECK(reply->usage.prompt_tokens == 12);
  CHECK(reply->usage.completion_tokens == 4);
  CHECK(reply->id == "msg_local_2");
  CHECK(Json::parse(server.requests().at(0).body)["stream"] == true);
}

TEST_CASE("anthropic: json_schema is refused with the reason, before any request", "[llm][anthropic]") {
  LocalServer server;
  auto backend = connect_local(server, "anthropic");
  Options o;
  o.json_schema = R"({"type": "object"})";
  auto reply = backend->complete(ask("x"), o);
  REQUIRE_FALSE(reply);
  CHECK(reply.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(reply.error().message, "json_schema is not supported by the Anthropic backend"));
  CHECK(server.request_count() == 0);
}

TEST_CASE("sequential calls reuse one warm connection, plain or streamed", "[llm]") {
  LocalServer server;
  auto backend = connect_local(server);
  Options streamed;
  streamed.stream = true;
  for (int i = 0; i < 5; ++i) {
    REQUIRE(backend->complete(ask("plain")));
    REQUIRE(backend->complete(ask("streamed"), streamed, [](std::string_view) {}));
  }
  CHECK(server.request_count() == 10);
  CHECK(server.connection_count() == 1);
}

TEST_CASE("bad messages and options fail before a request is sent", "[llm]") {
  LocalServer server;
  auto backend = connect_local(server);
  auto no_messages = backend->complete({});
  REQUIRE_FALSE(no_messages);
  CHECK(no_messages.error().code == ErrorCode::InvalidArgument);
  auto bad_role = backend->complete({{"tool", "x"}});
  REQUIRE_FALSE(bad_role);
  CHECK(contains(bad_role.error().message, "role 'tool'"));
  Options o;
  o.extra_json = "[1, 2]";
  auto bad_extra = backend->complete(ask("x"), o);
  REQUIRE_FALSE(bad_extra);
  CHECK(contains(bad_extra.error().message, "extra_json must be a JSON object"));
  CHECK(server.request_count() == 0);
  CHECK(backend->totals().failures == 3);
}
