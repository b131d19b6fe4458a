// The batching server's request handling without a GPU: the served model read from a program, every bad
// request's 4xx and message, nested lists and base64 in, answers out.
#include <cstring>

#include <nlohmann/json.hpp>

#include "catch_shim.hpp"
#include "model.hpp"
#include "server/cpu_runner.hpp"

using namespace stitchcuda_server;
using stitchcuda_test::contains;
namespace program = stitchcuda::program;

namespace {

ServedModel model_of(const program::Program& p) {
  std::string why;
  auto m = ServedModel::from_program(p, why);
  REQUIRE(m);
  return *m;
}

// A body for linear_program(batch, 3, 2): x is one f32[3] sample.
const char* kGood = R"({"inputs": [{"dtype": "f32", "shape": [3], "data": [1.5, -2, 0.25]}]})";

Refusal refused(const ServedModel& m, std::string_view body, std::string_view type = "application/json") {
  auto parsed = parse_request(m, type, body);
  REQUIRE_FALSE(parsed.sample);
  return parsed.refusal;
}

}  // namespace

TEST_CASE("server: the served model takes dim 0 of every input and output as the batch", "[server]") {
  auto m = model_of(stitchcuda_test::linear_program(8, 3, 2));
  CHECK(m.max_batch == 8);
  REQUIRE(m.inputs.size() == 1);
  CHECK(m.inputs[0].name == "x");
  CHECK(m.inputs[0].shape == std::vector<std::int64_t>{3});
  CHECK(m.inputs[0].bytes() == 12);
  CHECK(m.outputs[0].shape == std::vector<std::int64_t>{2});
  auto health = nlohmann::json::parse(m.describe_json());
  CHECK(health["max_batch"] == 8);
  CHECK(health["inputs"][0]["dtype"] == "f32");

  // An output whose dim 0 is not the batch cannot be split by rows.
  program::Program odd;
  odd.buffers.push_back({0, program::TensorSpec::contiguous({4, 3}), program::BufferRole::input, "x"});
  odd.buffers.push_back({1, program::TensorSpec::contiguous({2, 3}), program::BufferRole::output, "y"});
  std::string why;
  CHECK_FALSE(ServedModel::from_program(odd, why));
  CHECK(contains(why, "output 'y' has dim 0 = 2, the first input's is 4"));
  odd.buffers[1].spec = program::TensorSpec::contiguous({});
  CHECK_FALSE(ServedModel::from_program(odd, why));
  CHECK(contains(why, "scalar"));
}

TEST_CASE("server: a program with a state is refused at load, naming the state and what to do", "[server]") {
  // A KV cache read and updated in place run after run: batched rows and concurrent streams would share it.
  program::ProgramBuilder b;
  auto x = b.input(program::TensorSpec::contiguous({4, 3}), "x");
  auto pos = b.input(program::TensorSpec::contiguous({1}, program::DType::i64), "cache_position");
  auto cache = b.state(program::TensorSpec::contiguous({4, 8, 3}), "layer0.k_cache");
  auto y = b.output(program::TensorSpec::contiguous({4, 3}), "y");
  b.aten("aten::index_copy_", {cache, pos, x}, {cache}, {{"dim", std::int64_t(1)}});
  b.aten("aten::sum.dim_IntList", {cache}, {y}, {{"dim", std::vector<std::int64_t>{1}}});
  auto stateful = b.build();
  REQUIRE(stateful.has_value());
  std::string why;
  CHECK_FALSE(ServedModel::from_program(*stateful, why));
  CHECK(contains(why, "the program has a state, 'layer0.k_cache' (f32[4, 8, 3])"));
  CHECK(contains(why, "serve generate"));

  // In a family too: its members are served the same way.
  program::ProgramFamily family;
  family.dims.push_back({"batch", 1, 4, true, {{0, 0}}, {{0, 0}}});
  family.members.push_back({{4}, *stateful});
  REQUIRE(family.validate().has_value());
  CHECK_FALSE(ServedModel::from_family(family, why));
  CHECK(contains(why, "'layer0.k_cache'"));
}

TEST_CASE("server: a program family is served at every batch up to its batch dim's max", "[server]") {
  std::string why;
  auto m = ServedModel::from_family(stitchcuda_test::linear_family({1, 2, 4, 16}, 3, 2, true), why);
  REQUIRE(m);
  CHECK(m->max_batch == 16);
  CHECK_FALSE(m->fixed_batch);
  CHECK(m->rows_for(5) == 5);
  CHECK(m->inputs[0].shape == std::vector<std::int64_t>{3});
  CHECK(nlohmann::json::parse(m->describe_json())["fixed_batch"] == false);
  auto fixed = model_of(stitchcuda_test::linear_program(8, 3, 2));
  CHECK(fixed.rows_for(5) == 8);
  CHECK(nlohmann::json::parse(fixed.describe_json())["fixed_batch"] == true);

  // Exact sizes only: every batch up to the max needs its member.
  CHECK(ServedModel::from_family(stitchcuda_test::linear_family({1, 2, 3}, 3, 2, false), why));
  CHECK_FALSE(ServedModel::from_family(stitchcuda_test::linear_family({1, 2, 4}, 3, 2, false), why));
  CHECK(contains(why, "dim 'batch' does not pad and no member serves a batch of 3"));
  auto family = stitchcuda_test::linear_family({2, 4}, 3, 2, true);
  family.dims[0].min = 2;
  CHECK_FALSE(ServedModel::from_family(family, why));
  CHECK(contains(why, "ranges over 2..4: the server runs every batch from 1"));
  family = stitchcuda_test::linear_family({1}, 3, 2, true);
  family.dims[0].outputs.clear();  // one member: the family is valid, but y is not split by the batch
  CHECK_FALSE(ServedModel::from_family(family, why));
  CHECK(contains(why, "dim 'batch' is not dim 0 (alone) of output 0 ('y')"));
  family.dims.clear();
  CHECK_FALSE(ServedModel::from_family(family, why));
  CHECK(contains(why, "dims is empty"));  // the family's own validation first
}

TEST_CASE("server: a good request in nested lists or base64 becomes the sample's bytes", "[server]") {
  auto m = model_of(stitchcuda_test::linear_program(4, 3, 2));
  auto parsed = parse_request(m, "application/json; charset=utf-8", kGood);
  REQUIRE(parsed.sample);
  const float want[3] = {1.5f, -2.0f, 0.25f};
  REQUIRE(parsed.sample->inputs.size() == 1);
  REQUIRE(parsed.sample->inputs[0].size() == sizeof want);
  CHECK(std::memcmp(parsed.sample->inputs[0].data(), want, sizeof want) == 0);
  CHECK_FALSE(parsed.sample->base64_answer);

  const std::string b64 = base64_encode(std::string_view(reinterpret_cast<const char*>(want), sizeof want));
  auto again = parse_request(
      m, "application/json",
      R"({"answer": "base64", "inputs": [{"dtype": "f32", "shape": [3], "base64": ")" + b64 + "\"}]}");
  REQUIRE(again.sample);
  CHECK(again.sample->inputs[0] == parsed.sample->inputs[0]);
  CHECK(again.sample->base64_answer);
}

TEST_CASE("server: each bad request gets its 4xx and a message naming the problem", "[server]") {
  auto m = model_of(stitchcuda_test::linear_program(4, 3, 2));
  auto check = [&](std::string_view body, int status, std::string_view message, std::string_view type = "application/json") {
    auto r = refused(m, body, type);
    INFO(body);
    CHECK(r.status == status);
    CHECK(contains(r.message, message));
  };
  check(kGood, 415, "send the body as application/json", "text/plain");
  check(kGood, 415, "Content-Type is ''", "");
  check(R"({"inputs": [)", 400, "not valid JSON");
  check(R"([1, 2])", 400, "needs {\"inputs\": [...]}");
  check(R"({"inputs": []})", 400, "got 0 inputs, the program takes 1");
  check(R"({"inputs": [3]})", 400, "is not an object");
  check(R"({"inputs": [{"shape": [3], "data": [1, 2, 3]}]})", 400, "has no \"dtype\": it takes f32");
  check(R"({"inputs": [{"dtype": "f16", "shape": [3], "data": [1, 2, 3]}]})", 400, "has dtype f16, the program takes f32");
  check(R"({"inputs": [{"dtype": "f32", "data": [1, 2, 3]}]})", 400, "has no \"shape\"");
  check(R"({"inputs": [{"dtype": "f32", "shape": [1, 3], "data": [[1, 2, 3]]}]})", 400,
        "has shape [1, 3], one sample is [3]");
  check(R"({"inputs": [{"dtype": "f32", "shape": ["3"], "data": [1, 2, 3]}]})", 400, "shape of non-integers");
  check(R"({"inputs": [{"dtype": "f32", "shape": [3], "data": [1, 2]}]})", 400,
        "at data: expected a list of 3, got 2 elements");
  check(R"({"inputs": [{"dtype": "f32", "shape": [3], "data": [1, "2", 3]}]})", 400,
        "at data[1]: expected a number, got string");
  check(R"({"inputs": [{"dtype": "f32", "shape": [3], "data": 7}]})", 400, "expected a list of 3, got number");
  check(R"({"inputs": [{"dtype": "f32", "shape": [3]}]})", 400, "neither \"data\"");
  check(R"({"inputs": [{"dtype": "f32", "shape": [3], "base64": "AAAA"}]})", 400, "has 3 bytes, [3] f32 is 12");
  check(R"({"inputs": [{"dtype": "f32", "shape": [3], "base64": "A*AA"}]})", 400, "not valid base64");
  check(R"({"inputs": [{"dtype": "f32", "shape": [3], "base64": 5}]})", 400, "must be a string");
  check(std::string(R"({"answer": "xml", )") + (kGood + 1), 400, "use \"lists\" or \"base64\"");
}

TEST_CASE("server: integer, bool and half inputs are checked against their dtype", "[server]") {
  program::Program p;
  p.buffers.push_back({0, program::TensorSpec::contiguous({2, 2}, program::DType::i32), program::BufferRole::input, "ids"});
  p.buffers.push_back({1, program::TensorSpec::contiguous({2}, program::DType::boolean), program::BufferRole::input, "mask"});
  p.buffers.push_back({2, program::TensorSpec::contiguous({2, 1}, program::DType::f16), program::BufferRole::input, "h"});
  p.buffers.push_back({3, program::TensorSpec::contiguous({2, 2}, program::DType::f32), program::BufferRole::output, "y"});
  auto m = model_of(p);
  auto body = [](std::string ids, std::string mask, std::string half) {
    return R"({"inputs": [{"dtype": "i32", "shape": [2], "data": )" + ids +
           R"(}, {"dtype": "bool", "shape": [], "data": )" + mask + R"(}, {"dtype": "f16", "shape": [1], )" + half + "}]}";
  };
  auto ok = parse_request(m, "application/json", body("[7, -3]", "true", R"("base64": "ADw=")"));
  REQUIRE(ok.sample);
  std::int32_t ids[2];
  std::memcpy(ids, ok.sample->inputs[0].data(), sizeof ids);
  CHECK(ids[0] == 7);
  CHECK(ids[1] == -3);
  CHECK(ok.sample->inputs[1] == std::string(1, '\1'));
  CHECK(ok.sample->inputs[2] == std::string("\x00\x3c", 2));  // 1.0 in f16

  CHECK(contains(refused(m, body("[7, 2.5]", "true", R"("base64": "ADw=")")).message, "expected an integer, got 2.5"));
  CHECK(contains(refused(m, body("[7, 3000000000]", "true", R"("base64": "ADw=")")).message, "out of range for i32"));
  CHECK(contains(refused(m, body("[7, 1]", "1", R"("base64": "ADw=")")).message, "expected true or false"));
  CHECK(contains(refused(m, body("[7, 1]", "false", R"("data": [1.0])")).message, "f16 values are sent as base64"));
}

TEST_CASE("server: answers come back as nested lists, or base64 where asked", "[server]") {
  auto m = model_of(stitchcuda_test::linear_program(4, 3, 2));
  const float y[2] = {0.5f, -4.0f};
  const std::vector<std::string> outputs{std::string(reinterpret_cast<const char*>(y), sizeof y)};
  auto lists = nlohmann::json::parse(encode_answer(m, outputs, false, 3, 1));
  CHECK(lists["batch"] == 3);
  CHECK(lists["padded"] == 1);
  CHECK(lists["outputs"][0]["name"] == "y");
  CHECK(lists["outputs"][0]["data"] == nlohmann::json::array({0.5, -4.0}));
  auto b64 = nlohmann::json::parse(encode_answer(m, outputs, true, 1, 3));
  CHECK(base64_decode(b64["outputs"][0]["base64"].get<std::string>()) == outputs[0]);
}

TEST_CASE("server: base64 round-trips every length and refuses what is not base64", "[server]") {
  std::string bytes;
  for (int n = 0; n < 7; ++n) {
    CHECK(base64_decode(base64_encode(bytes)) == bytes);
    bytes += char(0xf0 + n);
  }
  CHECK(base64_encode("abc") == "YWJj");
  CHECK(base64_encode("ab") == "YWI=");
  CHECK_FALSE(base64_decode("YWI"));
  CHECK_FALSE(base64_decode("YW=j"));
  CHECK_FALSE(base64_decode("Y=I="));
}
