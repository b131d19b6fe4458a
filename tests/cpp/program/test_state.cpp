// Program state (BufferRole::state, a KV cache): read before any step writes it, written in place, never
// in the arena, never given bytes, and kept by the `.stitch` artifact as a spec alone.
#include <string>

#include <stitchcuda/program.hpp>

#include "catch_shim.hpp"

using namespace stitchcuda;
using namespace stitchcuda::program;
using stitchcuda_test::contains;

namespace {

TensorSpec f32(std::vector<std::int64_t> shape) { return TensorSpec::contiguous(std::move(shape), DType::f32); }

// A decode step's shape: a [2, 8, 4] cache written at one position by index_copy_, then read by a matmul.
struct CacheProgram {
  Program program;
  BufferId cache = 0, scores = 0;
};

CacheProgram cache_program() {
  ProgramBuilder b;
  BufferId pos = b.input(TensorSpec::contiguous({1}, DType::i64), "cache_position");
  BufferId k = b.input(f32({2, 1, 4}), "k");
  BufferId q = b.input(f32({2, 1, 4}), "q");
  BufferId cache = b.state(f32({2, 8, 4}), "layer0.k_cache");
  BufferId scores = b.output(f32({2, 1, 8}), "scores");
  b.aten("aten::index_copy_", {cache, pos, k}, {cache}, {{"dim", std::int64_t(1)}});
  b.matmul(Matmul{q, cache, scores, std::nullopt, false, true, 2});
  auto p = b.build();
  if (!p) FAIL(p.error().describe() << "\n" << p.error().log);
  return {*p, cache, scores};
}

std::string rejection(const Program& p) {
  auto ok = p.validate();
  REQUIRE_FALSE(ok.has_value());
  CHECK(ok.error().code == ErrorCode::InvalidArgument);
  return ok.error().message;
}

}  // namespace

TEST_CASE("a state is read before any step writes it and updated in place", "[program]") {
  CacheProgram c = cache_program();
  const Buffer* cache = c.program.buffer(c.cache);
  REQUIRE(cache != nullptr);
  CHECK(cache->role == BufferRole::state);
  CHECK(std::string(to_string(BufferRole::state)) == "state");

  // Read first (the previous runs' values), with no step writing it at all.
  ProgramBuilder b;
  BufferId q = b.input(f32({2, 1, 4}));
  BufferId kv = b.state(f32({2, 8, 4}));
  BufferId out = b.output(f32({2, 1, 8}));
  b.matmul(Matmul{q, kv, out, std::nullopt, false, true, 2});
  CHECK(b.build().has_value());

  // A kernel writes a slice of the state through a view.
  ProgramBuilder w;
  BufferId src = w.input(f32({4}));
  BufferId st = w.state(f32({8, 4}));
  BufferId row = w.view(ViewKind::slice, st, f32({4}), 12);
  BufferId o = w.output(f32({8, 4}));
  std::uint32_t kernel = w.kernel(KernelSource{"extern \"C\" __global__ void put(const float* a, float* b) {}", "put",
                                               {}, {}, {}, {"const float*", "float*"}});
  w.launch(KernelLaunch{kernel, {1, 1, 1}, {32, 1, 1}, 0, {BufferArg{src, Access::read}, BufferArg{row, Access::write}}});
  w.aten("aten::clone", {st}, {o});
  CHECK(w.build().has_value());
}

TEST_CASE("liveness planning leaves states out of the arena", "[program]") {
  CacheProgram c = cache_program();
  auto plan = c.program.plan();
  REQUIRE(plan.has_value());
  CHECK(plan->find(c.cache) == nullptr);
  CHECK(plan->arena_bytes == 0);
}

TEST_CASE("a state holds at least one element and no stored bytes", "[program]") {
  ProgramBuilder b;
  BufferId x = b.input(f32({4}));
  b.state(f32({0, 4}), "empty");
  BufferId y = b.output(f32({4}));
  b.aten("aten::relu", {x}, {y});
  std::string message = rejection(b.peek());
  CHECK(contains(message, "state buffer 'empty'"));
  CHECK(contains(message, "at least one element"));

  CacheProgram c = cache_program();
  c.program.weights[c.cache] = std::string(2 * 8 * 4 * 4, '\0');
  message = rejection(c.program);
  CHECK(contains(message, "'layer0.k_cache'"));
  CHECK(contains(message, "not a weight buffer"));
}

TEST_CASE("a view of a state cannot be an output's storage", "[program]") {
  // Views are intermediates: a program cannot return a state's memory to the caller as an output.
  ProgramBuilder b;
  BufferId x = b.input(f32({4}));
  BufferId st = b.state(f32({4}), "s");
  BufferId y = b.output(f32({4}));
  b.aten("aten::add.Tensor", {x, st}, {y});
  Program p = b.peek();
  p.steps.push_back(View{ViewKind::reshape, st, y, 0});
  std::string message = rejection(p);
  CHECK(contains(message, "view result"));
  CHECK(contains(message, "must be an intermediate buffer, not output"));
}

TEST_CASE("the artifact keeps a state's spec and no bytes; its loader validates it as data", "[program]") {
  CacheProgram c = cache_program();
  std::string bytes = c.program.serialize();
  CHECK(bytes.find("weight." + std::to_string(c.cache)) == std::string::npos);
  auto loaded = Program::deserialize(bytes);
  if (!loaded) FAIL(loaded.error().describe());
  CHECK(loaded->serialize() == bytes);
  const Buffer* cache = loaded->buffer(c.cache);
  REQUIRE(cache != nullptr);
  CHECK(cache->role == BufferRole::state);
  CHECK(cache->spec == f32({2, 8, 4}));
  CHECK(cache->name == "layer0.k_cache");
  CHECK(loaded->weights.empty());

  // A file that stores bytes for a state (written by hand, or altered) is refused.
  Program altered = c.program;
  altered.weights[c.cache] = std::string(cache->spec.storage_bytes(), '\x01');
  auto refused = Program::deserialize(altered.serialize());
  REQUIRE_FALSE(refused.has_value());
  CHECK(contains(refused.error().message, "not a valid .stitch artifact"));
  CHECK(contains(refused.error().message, "not a weight buffer"));
}
