// The .stitch artifact: a round trip keeps every field, save is atomic, and a truncated, flipped,
// wrong-version, wrong-magic or hand-edited file is a clear error, never a crash.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>
#include <stitchcuda/program.hpp>

#include <stitchcuda/detail/sha256.hpp>
#include "catch_shim.hpp"
#include "temp_dir.hpp"

using namespace stitchcuda;
using namespace stitchcuda::program;
using stitchcuda_test::contains;
namespace fs = std::filesystem;

namespace {

TensorSpec f32(std::vector<std::int64_t> shape) { return TensorSpec::contiguous(std::move(shape), DType::f32); }

std::string pattern(std::size_t n, unsigned seed) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i) s[i] = char((i * 131 + seed * 7) & 0xff);  // every byte value, NULs included
  return s;
}

// A program with every step kind, attribute type, kernel table entry, weight and provenance field.
Program sample_program() {
  ProgramBuilder b;
  BufferId x = b.input(f32({8, 16}), "x");
  BufferId w = b.weight(f32({16, 32}), pattern(16 * 32 * 4, 1), "w");
  BufferId bias = b.weight(f32({32}), pattern(32 * 4, 2), "bias");
  BufferId h = b.intermediate(f32({8, 32}), "h");
  BufferId s = b.intermediate(TensorSpec::contiguous({8, 32}, DType::f32));
  BufferId y = b.output(f32({128}), "y");
  std::uint32_t k = b.kernel(KernelSource{"extern \"C\" __global__ void scale(const float* x, float* y, float s, long long n) {}",
                                          "scale", {"--use_fast_math", "-lineinfo"}, pattern(777, 3), "sm_90a",
                                          {"const float*", "float*", "float", "long long"}});
  Matmul m{x, w, h, bias, false, false, 1, 0.5, 0.0, Epilogue::bias_gelu, ComputePrecision::tf32};
  b.matmul(m);
  b.launch(KernelLaunch{k, {2, 3, 1}, {128, 2, 1}, 4096,
                        {BufferArg{h, Access::read}, BufferArg{s, Access::write}, 1.5f, std::int64_t(1) << 40}});
  BufferId flat = b.view(ViewKind::reshape, s, f32({256}));
  BufferId half = b.view(ViewKind::slice, flat, f32({128}), 128);
  b.aten("aten::clamp.out", {half}, {y},
         {{"min", -std::numeric_limits<double>::infinity()}, {"max", 6.0}, {"inplace", true},
          {"mode", std::string("tanh")}, {"dims", std::vector<std::int64_t>{-1, 0, 3}},
          {"scales", std::vector<double>{0.1, std::numeric_limits<double>::quiet_NaN()}}, {"count", std::int64_t(-7)}});
  b.precision(PrecisionPolicy{ComputePrecision::tf32, false});
  b.verified_on(HardwareInfo{"NVIDIA H200", "sm_90a", "13000", "13.0", "2.11.0+cu130"});
  auto p = b.build();
  if (!p) FAIL(p.error().describe() << "\n" << p.error().log);
  p->replay = {Replay::direct, "CUDA graph replay 0.106 ms, direct launches 0.037 ms per call"};
  return *p;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void put_le(std::string& out, std::size_t at, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out[at + i] = char((v >> (8 * i)) & 0xff);
}

// Re-packs an artifact after `edit` changed its manifest or sections, with fresh checksums, so the
// reader's checks past the checksums (fields, bounds, validation) are what the test exercises.
template <class Edit>
std::string repack(const std::string& bytes, Edit edit) {
  std::uint64_t manifest_size = 0;
  for (int i = 0; i < 8; ++i) manifest_size |= std::uint64_t(static_cast<unsigned char>(bytes[12 + i])) << (8 * i);
  auto manifest = nlohmann::json::parse(bytes.substr(52, manifest_size));
  std::string payload = bytes.substr(52 + manifest_size);
  std::vector<std::pair<std::string, std::string>> sections;
  for (auto& s : manifest["sections"])
    sections.emplace_back(s["name"].get<std::string>(),
                          payload.substr(s["offset"].get<std::size_t>(), s["size"].get<std::size_t>()));
  edit(manifest, sections);
  if (manifest.contains("sections")) {
    manifest["sections"] = nlohmann::json::array();
    std::size_t offset = 0;
    for (auto& [name, data] : sections) {
      manifest["sections"].push_back({{"name", name}, {"offset", offset}, {"size", data.size()},
                                      {"sha256", stitchcuda::detail::sha256_hex(data)}});
      offset += data.size();
    }
  }
  std::string text = manifest.dump();
  std::string out = bytes.substr(0, 52);
  put_le(out, 12, text.size(), 8);
  auto digest = stitchcuda::detail::Sha256().update(text).digest();
  out.replace(20, 32, reinterpret_cast<const char*>(digest.data()), 32);
  out += text;
  for (auto& section : sections) out += section.second;
  return out;
}

std::string rejection(std::string_view bytes) {
  auto p = Program::deserialize(bytes);
  REQUIRE_FALSE(p.has_value());
  CHECK(p.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(p.error().message, "not a valid .stitch artifact"));
  return p.error().message;
}

using Sections = std::vector<std::pair<std::string, std::string>>;

}  // namespace

TEST_CASE("an artifact round trip keeps every field", "[program]") {
  Program original = sample_program();
  std::string bytes = original.serialize();
  CHECK(bytes.compare(0, 8, std::string("STITCH\0\1", 8)) == 0);
  auto loaded = Program::deserialize(bytes);
  if (!loaded) FAIL(loaded.error().describe());
  CHECK(loaded->serialize() == bytes);  // deterministic, and nothing lost or added

  REQUIRE(loaded->buffers.size() == original.buffers.size());
  for (std::size_t i = 0; i < original.buffers.size(); ++i) {
    CHECK(loaded->buffers[i].id == original.buffers[i].id);
    CHECK(loaded->buffers[i].spec == original.buffers[i].spec);
    CHECK(loaded->buffers[i].role == original.buffers[i].role);
    CHECK(loaded->buffers[i].name == original.buffers[i].name);
  }
  CHECK(loaded->weights == original.weights);
  REQUIRE(loaded->kernels.size() == 1);
  CHECK(loaded->kernels[0].cubin == original.kernels[0].cubin);
  CHECK(loaded->kernels[0].source == original.kernels[0].source);
  CHECK(loaded->kernels[0].options == original.kernels[0].options);
  CHECK(loaded->kernels[0].signature == original.kernels[0].signature);
  CHECK(loaded->kernels[0].arch == "sm_90a");
  CHECK(loaded->precision == original.precision);
  CHECK(loaded->verified_on == original.verified_on);
  CHECK(loaded->replay == original.replay);
  CHECK(loaded->replay.mode == Replay::direct);

  const auto& launch = std::get<KernelLaunch>(loaded->steps[1]);
  CHECK(launch.grid == std::array<std::uint32_t, 3>{2, 3, 1});
  CHECK(launch.shared_mem_bytes == 4096);
  CHECK(std::get<float>(launch.args[2]) == 1.5f);
  CHECK(std::get<std::int64_t>(launch.args[3]) == (std::int64_t(1) << 40));
  const auto& m = std::get<Matmul>(loaded->steps[0]);
  CHECK(m.epilogue == Epilogue::bias_gelu);
  CHECK(m.precision == ComputePrecision::tf32);
  CHECK(m.alpha == 0.5);
  CHECK(m.bias.has_value());
  CHECK(std::get<View>(loaded->steps[3]).storage_offset == 128);
  const auto& op = std::get<AtenOp>(loaded->steps[4]);
  CHECK(op.op == "aten::clamp.out");
  CHECK(std::isinf(std::get<double>(op.attributes.at("min"))));
  CHECK(std::isnan(std::get<std::vector<double>>(op.attributes.at("scales"))[1]));
  CHECK(std::get<std::vector<std::int64_t>>(op.attributes.at("dims")) == std::vector<std::int64_t>{-1, 0, 3});
  CHECK(std::get<std::string>(op.attributes.at("mode")) == "tanh");
  CHECK(std::get<bool>(op.attributes.at("inplace")));
  CHECK(std::get<std::int64_t>(op.attributes.at("count")) == -7);

  auto plan_before = original.plan(), plan_after = loaded->plan();
  REQUIRE(plan_before.has_value());
  REQUIRE(plan_after.has_value());
  CHECK(plan_before->arena_bytes == plan_after->arena_bytes);
}

TEST_CASE("save writes atomically and load reads it back", "[program]") {
  stitchcuda_test::TempDir dir;
  const fs::path path = dir.path() / "model.stitch";
  Program p = sample_program();
  REQUIRE(p.save(path.string()).has_value());
  auto loaded = Program::load(path.string());
  if (!loaded) FAIL(loaded.error().describe());
  CHECK(loaded->serialize() == p.serialize());

  // Overwriting replaces the whole file and leaves no temporary file behind.
  p.verified_on.device = "another device";
  REQUIRE(p.save(path.string()).has_value());
  CHECK(Program::load(path.string())->verified_on.device == "another device");
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    ++files;
    CHECK(e.path().filename() == "model.stitch");
  }
  CHECK(files == 1);

  SECTION("a missing file is NotFound") {
    auto missing = Program::load((dir.path() / "nope.stitch").string());
    REQUIRE_FALSE(missing.has_value());
    CHECK(missing.error().code == ErrorCode::NotFound);
    CHECK(contains(missing.error().message, "nope.stitch"));
  }
  SECTION("an unwritable folder is an IoError and leaves nothing") {
    auto bad = p.save((dir.path() / "no-such-folder" / "m.stitch").string());
    REQUIRE_FALSE(bad.has_value());
    CHECK(bad.error().code == ErrorCode::IoError);
  }
  SECTION("an invalid program is not saved") {
    Program broken = p;
    std::get<AtenOp>(broken.steps[4]).op = "clamp";
    const fs::path other = dir.path() / "broken.stitch";
    auto r = broken.save(other.string());
    REQUIRE_FALSE(r.has_value());
    CHECK(contains(r.error().message, "malformed op name"));
    CHECK_FALSE(fs::exists(other));
  }
  SECTION("a damaged file names the path and the damage") {
    std::string bytes = read_file(path);
    bytes[bytes.size() - 1] ^= 0x40;
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    auto damaged = Program::load(path.string());
    REQUIRE_FALSE(damaged.has_value());
    CHECK(contains(damaged.error().message, path.string()));
    CHECK(contains(damaged.error().message, "section 'weight.2' fails its SHA-256 check"));
  }
}

TEST_CASE("wrong magic and wrong version are named", "[program]") {
  std::string bytes = sample_program().serialize();
  std::string magic = bytes;
  magic[0] = 'X';
  CHECK(contains(rejection(magic), "wrong magic bytes"));
  std::string version = bytes;
  version[8] = 2;
  std::string msg = rejection(version);
  CHECK(contains(msg, "format version 2 is not supported"));
  CHECK(contains(msg, "reads version 1"));
  CHECK(contains(rejection(std::string_view(bytes).substr(0, 30)), "fewer than the 52-byte header"));
  CHECK(contains(rejection(bytes + "x"), "1 bytes follow the last section"));
}

TEST_CASE("every truncation and every flipped byte is an error, never a crash", "[program]") {
  const std::string bytes = sample_program().serialize();
  REQUIRE(bytes.size() > 64 * 8);
  for (int i = 0; i < 64; ++i) {
    std::size_t cut = bytes.size() * std::size_t(i) / 64;
    INFO("truncated to " << cut << " of " << bytes.size() << " bytes");
    rejection(std::string_view(bytes).substr(0, cut));
  }
  for (int i = 0; i < 64; ++i) {
    std::size_t at = (bytes.size() - 1) * std::size_t(i) / 63;  // first and last byte included
    std::string flipped = bytes;
    flipped[at] = char(flipped[at] ^ 0xff);
    INFO("byte " << at << " of " << bytes.size() << " flipped");
    rejection(flipped);
  }
  for (std::size_t at = 0; at < 52; ++at) {  // every header byte, each a different check
    std::string flipped = bytes;
    flipped[at] = char(flipped[at] ^ 0x01);
    INFO("header byte " << at << " flipped");
    rejection(flipped);
  }
}

TEST_CASE("a re-checksummed but edited artifact is still checked field by field", "[program]") {
  const std::string bytes = sample_program().serialize();
  REQUIRE(Program::deserialize(repack(bytes, [](auto&, auto&) {})).has_value());  // repack itself is faithful

  SECTION("a manifest without its format") {
    auto edited = repack(bytes, [](nlohmann::json& m, Sections&) { m.erase("format"); });
    CHECK(contains(rejection(edited), "missing field 'manifest.format'"));
  }
  SECTION("a manifest without sections") {
    auto edited = repack(bytes, [](nlohmann::json& m, Sections&) { m.erase("sections"); });
    CHECK(contains(rejection(edited), "missing field 'manifest.sections'"));
  }
  SECTION("a manifest version that disagrees with the header") {
    auto edited = repack(bytes, [](nlohmann::json& m, Sections&) { m["version"] = 7; });
    CHECK(contains(rejection(edited), "manifest.version differs"));
  }
  SECTION("a manifest that is not JSON") {
    std::string text = "{not json";
    std::string edited = bytes.substr(0, 52);
    put_le(edited, 12, text.size(), 8);
    auto digest = stitchcuda::detail::Sha256().update(text).digest();
    edited.replace(20, 32, reinterpret_cast<const char*>(digest.data()), 32);
    CHECK(contains(rejection(edited + text), "the manifest is not valid JSON"));
  }
  SECTION("a buffer without a dtype") {
    auto edited = repack(bytes, [](nlohmann::json&, Sections& s) {
      auto program = nlohmann::json::parse(s[0].second);
      program["buffers"][1].erase("dtype");
      s[0].second = program.dump();
    });
    CHECK(contains(rejection(edited), "missing field 'program.buffers[1].dtype'"));
  }
  SECTION("a field of the wrong type") {
    auto edited = repack(bytes, [](nlohmann::json&, Sections& s) {
      auto program = nlohmann::json::parse(s[0].second);
      program["steps"][1]["grid"][0] = "two";
      s[0].second = program.dump();
    });
    CHECK(contains(rejection(edited), "program.steps[1].grid[0] is not an integer"));
  }
  SECTION("a missing section") {
    auto edited = repack(bytes, [](nlohmann::json&, Sections& s) {
      std::erase_if(s, [](auto& sec) { return sec.first == "hardware"; });
    });
    CHECK(contains(rejection(edited), "missing section 'hardware'"));
  }
  SECTION("a replay mode nobody writes") {
    auto edited = repack(bytes, [](nlohmann::json&, Sections& s) {
      for (auto& sec : s)
        if (sec.first == "replay") sec.second = R"({"mode": "sometimes", "reason": ""})";
    });
    CHECK(contains(rejection(edited), "replay.mode = \"sometimes\" is not a known value"));
  }
  SECTION("an unmeasured program writes no replay section and reads back unmeasured") {
    Program p = sample_program();
    p.replay = {};
    std::string plain = p.serialize();
    CHECK(plain.find("\"replay\"") == std::string::npos);
    auto loaded = Program::deserialize(plain);
    REQUIRE(loaded.has_value());
    CHECK(loaded->replay.mode == Replay::unmeasured);
  }
  SECTION("an unknown section") {
    auto edited = repack(bytes, [](nlohmann::json&, Sections& s) { s.emplace_back("surprise", "?"); });
    CHECK(contains(rejection(edited), "unknown section 'surprise'"));
  }
  SECTION("weights of the wrong size") {
    auto edited = repack(bytes, [](nlohmann::json&, Sections& s) {
      for (auto& sec : s)
        if (sec.first == "weight.1") sec.second.pop_back();
    });
    CHECK(contains(rejection(edited), "weight buffer 'w' (#1) holds 2047 bytes"));
  }
  SECTION("a stored program that does not validate") {
    auto edited = repack(bytes, [](nlohmann::json&, Sections& s) {
      auto program = nlohmann::json::parse(s[0].second);
      program["steps"][4]["op"] = "clamp";
      s[0].second = program.dump();
    });
    std::string msg = rejection(edited);
    CHECK(contains(msg, "does not validate"));
    CHECK(contains(msg, "step 4 (aten)"));
  }
  SECTION("an out-of-range id") {
    auto edited = repack(bytes, [](nlohmann::json&, Sections& s) {
      auto program = nlohmann::json::parse(s[0].second);
      program["steps"][0]["a"] = std::int64_t(1) << 40;
      s[0].second = program.dump();
    });
    CHECK(contains(rejection(edited), "program.steps[0].a = 1099511627776 is out of range"));
  }
}

TEST_CASE("an artifact is data: stored options and includes that would read files are refused", "[program]") {
  const std::string bytes = sample_program().serialize();
  SECTION("a stored --pre-include") {
    auto edited = repack(bytes, [](nlohmann::json&, Sections& s) {
      auto program = nlohmann::json::parse(s[0].second);
      program["kernels"][0]["options"].push_back("--pre-include=/etc/passwd");
      s[0].second = program.dump();
    });
    const std::string why = rejection(edited);
    CHECK(contains(why, "kernel 0 ('scale')"));
    CHECK(contains(why, "NVRTC flag '--pre-include=/etc/passwd' is not allowed"));
  }
  SECTION("a stored source including a file") {
    auto edited = repack(bytes, [](nlohmann::json&, Sections& s) {
      for (auto& sec : s)
        if (sec.first == "kernel.0.source") sec.second = "#include \"/proc/self/environ\"\n" + sec.second;
    });
    CHECK(contains(rejection(edited), "absolute paths and '..' are not allowed"));
  }
}

TEST_CASE("load checks the manifest's length against the file before allocating", "[program]") {
  stitchcuda_test::TempDir tmp;
  const std::string bytes = sample_program().serialize();
  const auto path = (tmp.path() / "huge-claim.stitch").string();
  {
    std::string header = bytes.substr(0, 52);
    put_le(header, 12, std::uint64_t(4) << 30, 8);  // a 4 GiB manifest in a 52-byte file
    std::ofstream(path, std::ios::binary) << header;
  }
  auto loaded = Program::load(path);
  REQUIRE_FALSE(loaded);
  CHECK(contains(loaded.error().message, "the manifest claims 4294967296 bytes of a 52-byte file"));
  // A sparse file of 4 GiB whose header claims a manifest of the whole file: refused from the header.
  const auto sparse = (tmp.path() / "sparse.stitch").string();
  {
    std::string header = bytes.substr(0, 52);
    put_le(header, 12, (std::uint64_t(4) << 30) - 52, 8);
    std::ofstream(sparse, std::ios::binary) << header;
  }
  std::filesystem::resize_file(sparse, std::uint64_t(4) << 30);
  auto big = Program::load(sparse);
  REQUIRE_FALSE(big);
  CHECK(contains(big.error().message, "at most 67108864"));
}
