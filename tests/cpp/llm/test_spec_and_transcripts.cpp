// The spec string and connect()'s errors, transcripts (recorded, replayed by hash and in order,
// free of keys), the request hash, and the scripted backend.
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>
#include <stitchcuda/llm.hpp>

#include "catch_shim.hpp"
#include "connect_local.hpp"
#include "local_server.hpp"
#include "temp_dir.hpp"

using namespace stitchcuda;
using namespace stitchcuda::llm;
using namespace stitchcuda_test;
using Json = nlohmann::json;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<Json> read_lines(const std::string& path) {
  std::vector<Json> lines;
  std::istringstream in(read_file(path));
  for (std::string line; std::getline(in, line);) lines.push_back(Json::parse(line));
  return lines;
}

}  // namespace

TEST_CASE("parse_spec splits provider, model and base URL", "[llm][spec]") {
  auto hosted = parse_spec("openai:gpt-4.1");
  REQUIRE(hosted);
  CHECK(hosted->provider == "openai");
  CHECK(hosted->model == "gpt-4.1");
  CHECK(hosted->base_url.empty());
  auto local = parse_spec("openai:qwen3-32b@http://127.0.0.1:8000/v1/");
  REQUIRE(local);
  CHECK(local->model == "qwen3-32b");
  CHECK(local->base_url == "http://127.0.0.1:8000/v1");
  auto claude = parse_spec("anthropic:claude-sonnet-4-5");
  REQUIRE(claude);
  CHECK(claude->provider == "anthropic");
  auto replay = parse_spec("replay:runs/x@2/llm.jsonl");  // a path keeps its '@'
  REQUIRE(replay);
  CHECK(replay->model == "runs/x@2/llm.jsonl");
  CHECK(replay->base_url.empty());
}

TEST_CASE("bad specs are errors that say what is wrong", "[llm][spec]") {
  auto unknown = connect("gemini:pro");
  REQUIRE_FALSE(unknown);
  CHECK(unknown.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(unknown.error().message, "unknown model provider 'gemini'"));
  CHECK(contains(unknown.error().message, "known providers: openai, anthropic, replay, scripted"));
  for (const char* malformed : {"gpt-4.1", ":gpt", "openai:", "openai:@http://x", "replay:"}) {
    auto r = connect(malformed);
    REQUIRE_FALSE(r);
    CHECK(contains(r.error().message, "malformed model spec"));
  }
  auto no_scheme = connect("openai:m@127.0.0.1:8000");
  REQUIRE_FALSE(no_scheme);
  CHECK(contains(no_scheme.error().message, "must start with http:// or https://"));
  auto python = connect("python:pkg.mod:fn");
  REQUIRE_FALSE(python);
  CHECK(contains(python.error().message, "resolved by the Python package"));
}

TEST_CASE("a missing API key names the variable to set; nothing is sent", "[llm][spec]") {
  ::unsetenv("OPENAI_API_KEY");
  ::unsetenv("ANTHROPIC_API_KEY");
  auto openai = connect("openai:gpt-4.1");
  REQUIRE_FALSE(openai);
  CHECK(openai.error().code == ErrorCode::Unavailable);
  CHECK(contains(openai.error().message, "set the environment variable OPENAI_API_KEY"));
  auto anthropic = connect("anthropic:claude-sonnet-4-5");
  REQUIRE_FALSE(anthropic);
  CHECK(contains(anthropic.error().message, "ANTHROPIC_API_KEY"));
  ConnectOptions named;
  named.server.api_key_env = "MY_GATEWAY_KEY";
  ::unsetenv("MY_GATEWAY_KEY");
  auto gateway = connect("openai:m@http://127.0.0.1:9/v1", named);  // a named variable is required
  REQUIRE_FALSE(gateway);
  CHECK(contains(gateway.error().message, "MY_GATEWAY_KEY"));
  ::setenv("MY_GATEWAY_KEY", "gw-key-0123456789", 1);
  CHECK(connect("openai:m@http://127.0.0.1:9/v1", named));
  ::unsetenv("MY_GATEWAY_KEY");
}

TEST_CASE("a recorded run replays exactly, by hash and in order", "[llm][transcript]") {
  TempDir dir;
  const std::string path = dir.str() + "/llm.jsonl";
  LocalServer server;
  ConnectOptions options = quick_retries();
  options.reliability.record_path = path;
  auto live = connect_local(server, "openai", options);
  Options o;
  o.temperature = 0.0;
  REQUIRE(live->complete(ask("first"), o));
  REQUIRE(live->complete(ask("second"), o));
  server.queue(error_reply(400, "context too long"));
  REQUIRE_FALSE(live->complete(ask("third"), o));

  const auto lines = read_lines(path);
  REQUIRE(lines.size() == 3);
  CHECK(lines[0]["hash"] == request_hash(ask("first"), o));
  CHECK(lines[0]["backend"] == live->name());
  CHECK(lines[0]["completion"]["text"] == "echo: first");
  CHECK(lines[0]["options"]["temperature"] == 0.0);
  CHECK(lines[2]["error"]["http_status"] == 400);

  auto by_hash = connect("replay:" + path);
  REQUIRE(by_hash);
  auto second = (*by_hash)->complete(ask("second"), o);  // out of order: found by its hash
  REQUIRE(second);
  CHECK(second->text == "echo: second");
  CHECK(second->usage.total_tokens == 15);
  CHECK(second->model == "local-model");
  auto third = (*by_hash)->complete(ask("third"), o);
  REQUIRE_FALSE(third);
  CHECK(third.error().http_status == 400);
  CHECK(contains(third.error().message, "context too long"));
  auto unknown = (*by_hash)->complete(ask("never asked"), o);
  REQUIRE_FALSE(unknown);
  CHECK(unknown.error().code == ErrorCode::NotFound);
  CHECK(contains(unknown.error().message, "replay_match=order"));
  Options other = o;
  other.temperature = 0.7;  // a different sampling option is a different request
  CHECK_FALSE((*by_hash)->complete(ask("first"), other));

  ConnectOptions in_order;
  in_order.replay_match = ReplayMatch::Order;
  auto ordered = connect("replay:" + path, in_order);
  REQUIRE(ordered);
  auto a = (*ordered)->complete(ask("whatever"));
  REQUIRE(a);
  CHECK(a->text == "echo: first");
  CHECK((*ordered)->complete(ask("whatever"))->text == "echo: second");
  CHECK_FALSE((*ordered)->complete(ask("whatever")));  // the recorded error
  auto past_end = (*ordered)->complete(ask("whatever"));
  REQUIRE_FALSE(past_end);
  CHECK(contains(past_end.error().message, "has 3 calls and all were replayed"));
}

TEST_CASE("transcripts never hold an API key, even one pasted into a message", "[llm][transcript][secrets]") {
  TempDir dir;
  const std::string path = dir.str() + "/llm.jsonl";
  LocalServer server;
  ConnectOptions options = quick_retries();
  options.server.api_key = "sk-live-transcript-secret-777";
  options.reliability.record_path = path;
  auto backend = connect_local(server, "openai", options);
  REQUIRE(backend->complete(ask("my key is sk-live-transcript-secret-777, keep it")));
  CHECK(server.requests().at(0).header("authorization") == "Bearer sk-live-transcript-secret-777");
  const std::string text = read_file(path);
  CHECK_FALSE(contains(text, "sk-live-transcript-secret-777"));
  CHECK(contains(text, "my key is [redacted], keep it"));
  CHECK(read_lines(path).size() == 1);  // still valid JSON
}

TEST_CASE("record() wraps any backend", "[llm][transcript]") {
  TempDir dir;
  auto scripted = scripted_backend({{"ping", {"pong"}}});
  REQUIRE(scripted);
  auto recording = record(*scripted, dir.str() + "/t.jsonl");
  REQUIRE(recording);
  REQUIRE((*recording)->complete(ask("ping")));
  const auto lines = read_lines(dir.str() + "/t.jsonl");
  REQUIRE(lines.size() == 1);
  CHECK(lines[0]["completion"]["text"] == "pong");
  auto unwritable = record(*scripted, dir.str() + "/no/such/folder/t.jsonl");
  REQUIRE_FALSE(unwritable);
  CHECK(unwritable.error().code == ErrorCode::IoError);
}

TEST_CASE("a missing or damaged transcript is an error naming the file and line", "[llm][transcript]") {
  TempDir dir;
  auto missing = connect("replay:" + dir.str() + "/absent.jsonl");
  REQUIRE_FALSE(missing);
  CHECK(missing.error().code == ErrorCode::IoError);
  const auto damaged = dir.write("bad.jsonl", "{\"hash\": \"x\", \"completion\": {}}\nnot json\n");
  auto bad = connect("replay:" + damaged.string());
  REQUIRE_FALSE(bad);
  CHECK(contains(bad.error().message, "line 2"));
}

TEST_CASE("request_hash covers what changes an answer and nothing else", "[llm][transcript]") {
  Options a;
  a.json_schema = R"({"type": "object", "required": ["x"]})";
  Options b = a;
  b.json_schema = R"({ "required" : ["x"], "type":"object" })";  // same schema, other spelling
  b.stream = true;
  b.timeout_s = 5;
  CHECK(request_hash(ask("q"), a) == request_hash(ask("q"), b));
  Options c = a;
  c.seed = 1;
  CHECK(request_hash(ask("q"), a) != request_hash(ask("q"), c));
  CHECK(request_hash(ask("q"), a) != request_hash({{"system", "s"}, {"user", "q"}}, a));
  CHECK(request_hash(ask("q"), a).size() == 64);
}

TEST_CASE("scripted: the first matching rule answers, its replies in turn", "[llm][scripted]") {
  auto backend = scripted_backend({{"compile error", {"fixed v1", "fixed v2"}}, {"^write", {"first draft"}}});
  REQUIRE(backend);
  CHECK((*backend)->complete(ask("write a kernel"))->text == "first draft");
  CHECK((*backend)->complete(ask("there was a compile error"))->text == "fixed v1");
  CHECK((*backend)->complete(ask("another compile error"))->text == "fixed v2");
  CHECK((*backend)->complete(ask("compile error again"))->text == "fixed v2");  // the last repeats
  auto none = (*backend)->complete(ask("something else"));
  REQUIRE_FALSE(none);
  CHECK(none.error().code == ErrorCode::NotFound);
  CHECK(contains(none.error().message, "patterns: 'compile error', '^write'"));
  auto bad = scripted_backend({{"(", {"x"}}});
  REQUIRE_FALSE(bad);
  CHECK(contains(bad.error().message, "is not a valid regular expression"));
}

TEST_CASE("scripted: rules from a file through connect()", "[llm][scripted]") {
  TempDir dir;
  const auto path = dir.write("rules.json", R"([{"pattern": "hello", "reply": "hi"},
                                               {"pattern": ".", "replies": ["a", "b"]}])");
  auto backend = connect("scripted:" + path.string());
  REQUIRE(backend);
  auto reply = (*backend)->complete(ask("hello there"));
  REQUIRE(reply);
  CHECK(reply->text == "hi");
  CHECK(reply->usage.prompt_tokens == 3);  // 11 characters, estimated
  CHECK((*backend)->complete(ask("x"))->text == "a");
  CHECK((*backend)->complete(ask("x"))->text == "b");
  const auto broken = dir.write("broken.json", R"({"pattern": "x"})");
  auto bad = connect("scripted:" + broken.string());
  REQUIRE_FALSE(bad);
  CHECK(contains(bad.error().message, "is not a JSON list"));
}
