// ProgramFamily: one rule per validation failure (each naming its field), the call's sizes and the member
// choice with and without padding, the family file's round trip with each distinct weight stored once,
// and truncated, damaged or mistaken files as clear errors.
#include <filesystem>
#include <fstream>
#include <string>

#include <stitchcuda/family.hpp>

#include "catch_shim.hpp"
#include "temp_dir.hpp"

using namespace stitchcuda;
using namespace stitchcuda::program;
using stitchcuda_test::contains;

namespace {

// Weight bytes with every byte value, so a stored copy is easy to count in the file.
std::string weight_bytes(std::size_t n, unsigned seed) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i) s[i] = char((i * 61 + seed * 13 + 5) & 0xff);
  return s;
}

// y f32[batch, seq, 8] = x f32[batch, seq, 8] * scale f32[8], and a per-sample sum f32[batch].
Program scaled(std::int64_t batch, std::int64_t seq, unsigned seed = 1, DType dtype = DType::f32) {
  ProgramBuilder b;
  BufferId x = b.input(TensorSpec::contiguous({batch, seq, 8}, dtype), "x");
  BufferId scale = b.weight(TensorSpec::contiguous({8}, dtype), weight_bytes(8 * dtype_size(dtype), seed), "scale");
  BufferId y = b.output(TensorSpec::contiguous({batch, seq, 8}, dtype), "y");
  BufferId total = b.output(TensorSpec::contiguous({batch}, dtype), "total");
  b.aten("aten::mul.Tensor", {x, scale}, {y});
  b.aten("aten::sum.dim_IntList", {y}, {total}, {{"dim", std::vector<std::int64_t>{1, 2}}});
  auto p = b.build();
  if (!p) FAIL(p.error().describe());
  return std::move(*p);
}

DynamicDim batch_dim(std::int64_t max, bool pad) { return {"batch", 1, max, pad, {{0, 0}}, {{0, 0}, {1, 0}}}; }
DynamicDim seq_dim(std::int64_t max, bool pad) { return {"seq", 1, max, pad, {{0, 1}}, {{0, 1}}}; }

// Batch buckets 1, 2, 4, 8 at seq 16.
ProgramFamily buckets() {
  ProgramFamily f;
  f.dims = {batch_dim(8, true)};
  for (std::int64_t b : {1, 2, 4, 8}) f.members.push_back({{b}, scaled(b, 16)});
  return f;
}

std::string rejection(const ProgramFamily& f) {
  auto ok = f.validate();
  REQUIRE_FALSE(ok.has_value());
  CHECK(ok.error().code == ErrorCode::InvalidArgument);
  return ok.error().message;
}

std::size_t occurrences(const std::string& hay, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = hay.find(needle); at != std::string::npos; at = hay.find(needle, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("a family of batch buckets validates and lists its members", "[program][family]") {
  ProgramFamily f = buckets();
  REQUIRE(f.validate().has_value());
  CHECK(f.member_sizes() == std::vector<std::vector<std::int64_t>>{{1}, {2}, {4}, {8}});
  auto inputs = io_buffers(f.members[2].program, BufferRole::input);
  REQUIRE(inputs.size() == 1);
  CHECK(inputs[0]->spec.shape == std::vector<std::int64_t>{4, 16, 8});
  CHECK(io_buffers(f.members[2].program, BufferRole::output).size() == 2);
}

TEST_CASE("family validation names the field of each problem", "[program][family]") {
  SECTION("dims") {
    ProgramFamily f = buckets();
    f.dims.clear();
    CHECK(contains(rejection(f), "dims is empty"));
    f = buckets();
    f.dims[0].name.clear();
    CHECK(contains(rejection(f), "dims[0].name is empty"));
    f = buckets();
    f.dims.push_back(seq_dim(16, false));
    f.dims[1].name = "batch";
    CHECK(contains(rejection(f), "dims[1].name 'batch' names an earlier dim"));
    f = buckets();
    f.dims[0].min = 0;
    CHECK(contains(rejection(f), "dims[0].min = 0 is outside 1..2147483647"));
    f = buckets();
    f.dims[0].max = 0;
    CHECK(contains(rejection(f), "dims[0].max = 0 is outside 1..2147483647"));
    f = buckets();
    f.dims[0].max = std::int64_t(1) << 31;
    CHECK(contains(rejection(f), "dims[0].max = 2147483648 is outside"));
    f = buckets();
    f.dims[0].inputs.clear();
    CHECK(contains(rejection(f), "dims[0].inputs is empty"));
    f = buckets();
    f.dims[0].outputs.push_back({1, 0});
    CHECK(contains(rejection(f), "dims[0].outputs[2] = (1, 0) is named before"));
  }
  SECTION("axes against the members' programs") {
    ProgramFamily f = buckets();
    f.dims[0].inputs = {{1, 0}};
    CHECK(contains(rejection(f), "dims[0].inputs[0] names input 1 but members[0].program has 1 input(s)"));
    f = buckets();
    f.dims[0].outputs = {{1, 1}};
    CHECK(contains(rejection(f),
                   "dims[0].outputs[0] names axis 1 of members[0].program's output 1 ('total'), which is f32[1] (rank 1)"));
    f = buckets();
    f.dims[0].inputs = {{0, 2}};  // axis 2 is 8 everywhere, not the batch
    CHECK(contains(rejection(f),
                   "members[0].program's input 0 ('x') is f32[1, 16, 8]: its axis 2 carries dim 'batch', whose size is 1"));
  }
  SECTION("members") {
    ProgramFamily f = buckets();
    f.members.clear();
    CHECK(contains(rejection(f), "members is empty"));
    f = buckets();
    f.members[1].sizes = {2, 16};
    CHECK(contains(rejection(f), "members[1].sizes has 2 entries for 1 dims"));
    f = buckets();
    f.members.push_back({{9}, scaled(9, 16)});
    CHECK(contains(rejection(f), "members[4].sizes[0] = 9 is outside dim 'batch''s range 1..8"));
    f = buckets();
    f.members[2].sizes = {3};
    CHECK(contains(rejection(f), "members[2].program's input 0 ('x') is f32[4, 16, 8]: its axis 0 carries dim 'batch', whose "
                                 "size is 3 (members[2].sizes[0])"));
    f = buckets();
    f.members[3].program = scaled(8, 17);
    CHECK(contains(rejection(f), "members[3].program's input 0 ('x') is f32[8, 17, 8], the first member's is f32[1, 16, 8]"));
    f = buckets();
    f.members[1].program = scaled(2, 16, 1, DType::f16);
    CHECK(contains(rejection(f), "members[1].program's input 0 ('x') is f16[2, 16, 8], the first member's is f32[1, 16, 8]"));
    f = buckets();
    f.members.push_back({{4}, scaled(4, 16)});
    CHECK(contains(rejection(f), "members[4].sizes (batch=4) are members[2]'s too"));
    f = buckets();
    f.members[2].program.steps.clear();
    CHECK(contains(rejection(f), "members[2].program does not validate"));
  }
  SECTION("a family whose every dim pads needs its member at the maximum") {
    ProgramFamily f = buckets();
    f.members.pop_back();
    CHECK(contains(rejection(f), "members has none at the maximum (batch=8)"));
    f.dims[0].pad = false;  // served only exactly: fine without it
    CHECK(f.validate().has_value());
  }
  SECTION("check_member for a member added later") {
    ProgramFamily f = buckets();
    CHECK(f.check_member({{3}, scaled(3, 16)}).has_value());
    CHECK(contains(f.check_member({{4}, scaled(4, 16)}).error().message, "members[4].sizes (batch=4) are members[2]'s too"));
    CHECK(contains(f.check_member({{3}, scaled(3, 15)}).error().message, "members[4].program's input 0 ('x') is f32[3, 15, 8]"));
    ProgramFamily empty;
    empty.dims = {batch_dim(8, false)};
    CHECK(empty.check_member({{5}, scaled(5, 16)}).has_value());
  }
}

TEST_CASE("a call's sizes come from its inputs and must lie in range", "[program][family]") {
  ProgramFamily f = buckets();
  CHECK(*f.sizes_of({{3, 16, 8}}) == std::vector<std::int64_t>{3});
  CHECK(contains(f.sizes_of({{300, 16, 8}}).error().message,
                 "dim 'batch' is 300, outside 1..8: the family serves that range"));
  CHECK(contains(f.sizes_of({{0, 16, 8}}).error().message, "dim 'batch' is 0, outside 1..8"));
  CHECK(contains(f.sizes_of({{3, 17, 8}}).error().message,
                 "input 0 axis 1 is 17 but the family's programs take 16 there (f32[1, 16, 8] in its first member)"));
  CHECK(contains(f.sizes_of({{3, 16}}).error().message, "input 0 has rank 2 but the family's input 0 has rank 3"));
  CHECK(contains(f.sizes_of({{3, 16, 8}, {3}}).error().message, "the family takes 1 input(s) but 2 were given"));
  // Two inputs carrying one dim must agree.
  DynamicDim both{"batch", 1, 8, true, {{0, 0}, {1, 0}}, {}};
  std::vector<TensorSpec> reference{TensorSpec::contiguous({1, 4}), TensorSpec::contiguous({1})};
  CHECK(*call_sizes({both}, reference, {{5, 4}, {5}}) == std::vector<std::int64_t>{5});
  CHECK(contains(call_sizes({both}, reference, {{5, 4}, {6}}).error().message,
                 "dim 'batch' is 5 at input 0 axis 0 but 6 at input 1 axis 0: the inputs must agree on it"));
}

TEST_CASE("the member choice: exact sizes first, else the smallest padded member", "[program][family]") {
  const std::vector<std::vector<std::int64_t>> sizes{{1, 16}, {4, 16}, {8, 16}, {4, 32}, {8, 64}};
  SECTION("one dim pads, the other is served only exactly") {
    std::vector<DynamicDim> dims{batch_dim(8, true), seq_dim(64, false)};
    CHECK(*select_member(dims, sizes, {4, 16}) == 1);
    CHECK(*select_member(dims, sizes, {3, 16}) == 1);  // padded to 4, not 8
    CHECK(*select_member(dims, sizes, {5, 16}) == 2);
    CHECK(*select_member(dims, sizes, {2, 32}) == 3);
    auto none = select_member(dims, sizes, {3, 20});
    REQUIRE_FALSE(none.has_value());
    CHECK(contains(none.error().message, "no member serves batch=3, seq=20: the members are (batch=1, seq=16), "
                                         "(batch=4, seq=16)"));
    CHECK(contains(none.error().message, "'seq' do(es) not pad, so those sizes are served only exactly"));
    CHECK_FALSE(select_member(dims, sizes, {5, 32}).has_value());  // no batch >= 5 at seq 32
  }
  SECTION("both dims pad: the smallest padded volume wins") {
    std::vector<DynamicDim> dims{batch_dim(8, true), seq_dim(64, true)};
    CHECK(*select_member(dims, sizes, {2, 20}) == 3);  // (4, 32): 128 elements, less than (8, 64)
    CHECK(*select_member(dims, sizes, {5, 17}) == 4);
    CHECK(*select_member(dims, sizes, {1, 16}) == 0);
  }
  SECTION("no padding at all") {
    std::vector<DynamicDim> dims{batch_dim(8, false), seq_dim(64, false)};
    CHECK(*select_member(dims, sizes, {8, 64}) == 4);
    CHECK_FALSE(select_member(dims, sizes, {3, 16}).has_value());
  }
  CHECK(contains(select_member({batch_dim(8, true)}, sizes, {1, 2}).error().message, "2 size(s) given for 1 dims"));
  ProgramFamily f = buckets();
  CHECK(*f.select({3}) == 2);
}

TEST_CASE("the family file round-trips and stores each distinct weight once", "[program][family]") {
  ProgramFamily f = buckets();
  f.members[3].program.replay = {Replay::graph, "measured"};
  f.members[3].program.verified_on = {"NVIDIA H100", "sm_90a", "13000", "13.0", "2.11.0"};
  const std::string bytes = f.serialize();
  CHECK(is_family_artifact(bytes));
  CHECK_FALSE(is_family_artifact(f.members[0].program.serialize()));
  CHECK(occurrences(bytes, weight_bytes(32, 1)) == 1);  // four members, one scale

  auto back = ProgramFamily::deserialize(bytes);
  REQUIRE(back.has_value());
  REQUIRE(back->dims.size() == 1);
  CHECK(back->dims[0].name == "batch");
  CHECK(back->dims[0].max == 8);
  CHECK(back->dims[0].pad);
  CHECK(back->dims[0].inputs == f.dims[0].inputs);
  CHECK(back->dims[0].outputs == f.dims[0].outputs);
  REQUIRE(back->members.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(back->members[i].sizes == f.members[i].sizes);
    CHECK(back->members[i].program.serialize() == f.members[i].program.serialize());
  }
  CHECK(back->members[3].program.replay.reason == "measured");

  SECTION("members with their own weights keep them") {
    f.members[1].program = scaled(2, 16, 7);
    const std::string own = f.serialize();
    CHECK(occurrences(own, weight_bytes(32, 1)) == 1);
    CHECK(occurrences(own, weight_bytes(32, 7)) == 1);
    auto again = ProgramFamily::deserialize(own);
    REQUIRE(again.has_value());
    CHECK(again->members[1].program.weights.begin()->second == weight_bytes(32, 7));
    CHECK(again->members[2].program.weights.begin()->second == weight_bytes(32, 1));
  }
}

TEST_CASE("a damaged or mistaken family file is a clear error", "[program][family]") {
  const std::string bytes = buckets().serialize();
  auto error = [](std::string_view b) {
    auto r = ProgramFamily::deserialize(b);
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == ErrorCode::InvalidArgument);
    return r.error().message;
  };
  CHECK(contains(error(bytes.substr(0, 30)), "fewer than the 52-byte header (truncated?)"));
  CHECK(contains(error(bytes.substr(0, 200)), "the manifest claims"));
  CHECK(contains(error(bytes.substr(0, bytes.size() - 1)), "remain (truncated?)"));
  CHECK(contains(error(bytes + "x"), "1 bytes follow the last section"));
  std::string flipped = bytes;
  flipped[flipped.size() - 3] ^= 0x20;  // inside the last weight
  CHECK(contains(error(flipped), "section 'weight.0' fails its SHA-256 check"));
  std::string manifest = bytes;
  manifest[60] ^= 0x01;
  CHECK(contains(error(manifest), "the manifest's SHA-256 does not match"));
  std::string version = bytes;
  version[8] = 9;
  CHECK(contains(error(version), "format version 9 is not supported"));
  CHECK(contains(error(scaled(1, 16).serialize()),
                 "wrong magic bytes (a single program's .stitch file loads with Program::load"));

  SECTION("a single-program loader names the family's loader") {
    auto p = Program::deserialize(bytes);
    REQUIRE_FALSE(p.has_value());
    CHECK(contains(p.error().message, "program family"));
    CHECK(contains(p.error().message, "FamilyExecutor::load"));
  }
}

TEST_CASE("the family file saves atomically and loads back", "[program][family]") {
  stitchcuda_test::TempDir dir;
  const std::string path = (dir.path() / "mlp.family.stitch").string();
  ProgramFamily f = buckets();
  REQUIRE(f.save(path).has_value());
  auto back = ProgramFamily::load(path);
  REQUIRE(back.has_value());
  CHECK(back->member_sizes() == f.member_sizes());
  auto p = Program::load(path);
  REQUIRE_FALSE(p.has_value());
  CHECK(contains(p.error().message, "is a program family"));

  auto missing = ProgramFamily::load((dir.path() / "nothing").string());
  CHECK(missing.error().code == ErrorCode::NotFound);
  {
    std::ofstream cut(path, std::ios::binary | std::ios::trunc);
    cut << f.serialize().substr(0, 100);
  }
  auto truncated = ProgramFamily::load(path);
  REQUIRE_FALSE(truncated.has_value());
  CHECK(contains(truncated.error().message, "' is not a valid program family file"));

  ProgramFamily bad = buckets();
  bad.members.clear();
  CHECK(contains(bad.save(path).error().message, "members is empty"));
}
