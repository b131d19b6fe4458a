// The `.stitch` artifact: a fixed header (magic, format version, manifest length, manifest SHA-256),
// a JSON manifest listing sections with their offsets, sizes and SHA-256, then the sections' bytes.
// Reading trusts nothing: every length is bounded, every checksum verified, every field type-checked.
#include <stitchcuda/program.hpp>
#include <stitchcuda/family.hpp>
#include <stitchcuda/jit.hpp>

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include <stitchcuda/detail/sha256.hpp>

namespace stitchcuda::program {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr char kMagic[8] = {'S', 'T', 'I', 'T', 'C', 'H', '\x00', '\x01'};
constexpr std::size_t kHeaderBytes = 8 + 4 + 8 + 32;
// A manifest is metadata (buffers, steps, section table); weights and CUBINs are sections.
constexpr std::uint64_t kMaxManifestBytes = 64ull << 20;
constexpr const char* kFormatName = "stitchcuda.program";

// ---- writing ----

json number(double v) {
  // JSON has no NaN or infinity; they travel as strings so attributes such as clamp(max=inf) survive.
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

const char* access_name(Access a) {
  return a == Access::read ? "read" : a == Access::write ? "write" : "read_write";
}

json buffer_json(const Buffer& b) {
  return {{"id", b.id}, {"role", to_string(b.role)}, {"dtype", to_string(b.spec.dtype)},
          {"shape", b.spec.shape}, {"strides", b.spec.strides}, {"name", b.name}};
}

json attributes_json(const Attributes& attributes) {
  json out = json::object();
  for (const auto& [name, value] : attributes) {
    if (auto* i = std::get_if<std::int64_t>(&value)) out[name] = {{"int", *i}};
    else if (auto* d = std::get_if<double>(&value)) out[name] = {{"double", number(*d)}};
    else if (auto* b = std::get_if<bool>(&value)) out[name] = {{"bool", *b}};
    else if (auto* s = std::get_if<std::string>(&value)) out[name] = {{"string", *s}};
    else if (auto* is = std::get_if<std::vector<std::int64_t>>(&value)) out[name] = {{"ints", *is}};
    else {
      json list = json::array();
      for (double x : std::get<std::vector<double>>(value)) list.push_back(number(x));
      out[name] = {{"doubles", list}};
    }
  }
  return out;
}

json step_json(const Step& step) {
  json j = {{"kind", step_kind(step)}};
  if (auto* k = std::get_if<KernelLaunch>(&step)) {
    j["kernel"] = k->kernel;
    j["grid"] = k->grid;
    j["block"] = k->block;
    j["shared_mem_bytes"] = k->shared_mem_bytes;
    json args = json::array();
    for (const KernelArg& a : k->args) {
      if (auto* b = std::get_if<BufferArg>(&a)) args.push_back({{"buffer", b->buffer}, {"access", access_name(b->access)}});
      else if (auto* i = std::get_if<std::int32_t>(&a)) args.push_back({{"i32", *i}});
      else if (auto* l = std::get_if<std::int64_t>(&a)) args.push_back({{"i64", *l}});
      else if (auto* f = std::get_if<float>(&a)) args.push_back({{"f32", number(*f)}});
      else args.push_back({{"f64", number(std::get<double>(a))}});
    }
    j["args"] = args;
  } else if (auto* m = std::get_if<Matmul>(&step)) {
    j.update({{"a", m->a}, {"b", m->b}, {"c", m->c}, {"bias", m->bias ? json(*m->bias) : json(nullptr)},
              {"transpose_a", m->transpose_a}, {"transpose_b", m->transpose_b}, {"batch", m->batch},
              {"alpha", number(m->alpha)}, {"beta", number(m->beta)}, {"epilogue", to_string(m->epilogue)},
              {"precision", to_string(m->precision)}});
  } else if (auto* op = std::get_if<AtenOp>(&step)) {
    j.update({{"op", op->op}, {"inputs", op->inputs}, {"outputs", op->outputs},
              {"attributes", attributes_json(op->attributes)}});
  } else {
    const View& v = std::get<View>(step);
    j.update({{"view", to_string(v.kind)}, {"source", v.source}, {"result", v.result},
              {"storage_offset", v.storage_offset}});
  }
  return j;
}

std::string kernel_section(std::size_t k, const char* part) { return "kernel." + std::to_string(k) + "." + part; }
std::string weight_section(BufferId id) { return "weight." + std::to_string(id); }

void put_le(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += char((v >> (8 * i)) & 0xff);
}

std::uint64_t get_le(std::string_view in, std::size_t at, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t(static_cast<unsigned char>(in[at + i])) << (8 * i);
  return v;
}

// ---- reading: a cursor over untrusted JSON that names the path of whatever is wrong ----

struct Malformed {
  std::string what;
};

class Field {
 public:
  Field(const json& j, std::string path) : j_(j), path_(std::move(path)) {}

  Field operator[](const char* key) const {
    if (!j_.is_object()) throw Malformed{path_ + " is not an object"};
    auto it = j_.find(key);
    if (it == j_.end()) throw Malformed{"missing field '" + path_ + "." + key + "'"};
    return Field(*it, path_ + "." + key);
  }
  bool has(const char* key) const { return j_.is_object() && j_.contains(key); }
  std::vector<Field> items() const {
    if (!j_.is_array()) throw Malformed{path_ + " is not a list"};
    std::vector<Field> out;
    for (std::size_t i = 0; i < j_.size(); ++i) out.emplace_back(j_[i], path_ + "[" + std::to_string(i) + "]");
    return out;
  }
  std::vector<std::pair<std::string, Field>> members() const {
    if (!j_.is_object()) throw Malformed{path_ + " is not an object"};
    std::vector<std::pair<std::string, Field>> out;
    for (auto it = j_.begin(); it != j_.end(); ++it) out.emplace_back(it.key(), Field(it.value(), path_ + "." + it.key()));
    return out;
  }
  std::int64_t integer(std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                       std::int64_t hi = std::numeric_limits<std::int64_t>::max()) const {
    if (!j_.is_number_integer()) throw Malformed{path_ + " is not an integer"};
    if (j_.is_number_unsigned() && j_.get<std::uint64_t>() > std::uint64_t(hi))
      throw Malformed{path_ + " = " + std::to_string(j_.get<std::uint64_t>()) + " is out of range"};
    std::int64_t v = j_.get<std::int64_t>();
    if (v < lo || v > hi) throw Malformed{path_ + " = " + std::to_string(v) + " is out of range"};
    return v;
  }
  std::uint32_t u32() const { return std::uint32_t(integer(0, std::numeric_limits<std::uint32_t>::max())); }
  std::uint64_t size() const {
    if (!j_.is_number_unsigned() && !(j_.is_number_integer() && j_.get<std::int64_t>() >= 0))
      throw Malformed{path_ + " is not a size"};
    return j_.get<std::uint64_t>();
  }
  double number() const {
    if (j_.is_number()) return j_.get<double>();
    if (j_.is_string()) {
      const auto& s = j_.get_ref<const std::string&>();
      if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
      if (s == "inf") return std::numeric_limits<double>::infinity();
      if (s == "-inf") return -std::numeric_limits<double>::infinity();
    }
    throw Malformed{path_ + " is not a number"};
  }
  bool boolean() const {
    if (!j_.is_boolean()) throw Malformed{path_ + " is not true or false"};
    return j_.get<bool>();
  }
  std::string text() const {
    if (!j_.is_string()) throw Malformed{path_ + " is not a string"};
    return j_.get<std::string>();
  }
  std::vector<std::int64_t> integers() const {
    std::vector<std::int64_t> out;
    for (const Field& f : items()) out.push_back(f.integer());
    return out;
  }
  std::vector<BufferId> ids() const {
    std::vector<BufferId> out;
    for (const Field& f : items()) out.push_back(f.u32());
    return out;
  }
  // An enum value by its to_string name.
  template <class E, std::size_t N>
  E choice(const E (&options)[N]) const {
    std::string s = text();
    for (E e : options)
      if (s == to_string(e)) return e;
    throw Malformed{path_ + " = \"" + s + "\" is not a known value"};
  }
  bool is_null() const { return j_.is_null(); }

 private:
  const json& j_;
  std::string path_;
};

constexpr BufferRole kRoles[] = {BufferRole::input, BufferRole::output, BufferRole::weight, BufferRole::intermediate,
                                 BufferRole::state};
constexpr DType kDTypes[] = {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i32, DType::i64, DType::u8, DType::boolean};
constexpr Epilogue kEpilogues[] = {Epilogue::none, Epilogue::relu, Epilogue::gelu, Epilogue::bias, Epilogue::bias_relu, Epilogue::bias_gelu};
constexpr ComputePrecision kPrecisions[] = {ComputePrecision::fp32, ComputePrecision::tf32x3, ComputePrecision::tf32,
                                            ComputePrecision::bf16};
constexpr ViewKind kViews[] = {ViewKind::reshape, ViewKind::permute, ViewKind::slice};
constexpr Replay kReplays[] = {Replay::graph, Replay::direct};  // "unmeasured" is never written

Attributes read_attributes(const Field& f) {
  Attributes out;
  for (const auto& [name, value] : f.members()) {
    if (value.has("int")) out[name] = value["int"].integer();
    else if (value.has("double")) out[name] = value["double"].number();
    else if (value.has("bool")) out[name] = value["bool"].boolean();
    else if (value.has("string")) out[name] = value["string"].text();
    else if (value.has("ints")) out[name] = value["ints"].integers();
    else if (value.has("doubles")) {
      std::vector<double> list;
      for (const Field& x : value["doubles"].items()) list.push_back(x.number());
      out[name] = std::move(list);
    } else {
      throw Malformed{"attribute '" + name + "' has no int, double, bool, string, ints or doubles value"};
    }
  }
  return out;
}

Step read_step(const Field& f) {
  std::string kind = f["kind"].text();
  if (kind == "kernel") {
    KernelLaunch k;
    k.kernel = f["kernel"].u32();
    auto dims = [&](const char* key) {
      auto items = f[key].items();
      if (items.size() != 3) throw Malformed{"step field '" + std::string(key) + "' must hold 3 extents"};
      return std::array<std::uint32_t, 3>{items[0].u32(), items[1].u32(), items[2].u32()};
    };
    k.grid = dims("grid");
    k.block = dims("block");
    k.shared_mem_bytes = f["shared_mem_bytes"].u32();
    for (const Field& a : f["args"].items()) {
      if (a.has("buffer")) {
        std::string access = a["access"].text();
        Access acc = access == "read" ? Access::read : access == "write" ? Access::write : Access::read_write;
        if (access != "read" && access != "write" && access != "read_write")
          throw Malformed{"kernel argument access \"" + access + "\" is not read, write or read_write"};
        k.args.emplace_back(BufferArg{a["buffer"].u32(), acc});
      } else if (a.has("i32")) {
        k.args.emplace_back(std::int32_t(a["i32"].integer(std::numeric_limits<std::int32_t>::min(),
                                                            std::numeric_limits<std::int32_t>::max())));
      } else if (a.has("i64")) {
        k.args.emplace_back(a["i64"].integer());
      } else if (a.has("f32")) {
        k.args.emplace_back(float(a["f32"].number()));
      } else if (a.has("f64")) {
        k.args.emplace_back(a["f64"].number());
      } else {
        throw Malformed{"a kernel argument is neither a buffer nor an i32, i64, f32 or f64 scalar"};
      }
    }
    return k;
  }
  if (kind == "matmul") {
    Matmul m;
    m.a = f["a"].u32();
    m.b = f["b"].u32();
    m.c = f["c"].u32();
    if (!f["bias"].is_null()) m.bias = f["bias"].u32();
    m.transpose_a = f["transpose_a"].boolean();
    m.transpose_b = f["transpose_b"].boolean();
    m.batch = f["batch"].integer();
    m.alpha = f["alpha"].number();
    m.beta = f["beta"].number();
    m.epilogue = f["epilogue"].choice(kEpilogues);
    m.precision = f["precision"].choice(kPrecisions);
    return m;
  }
  if (kind == "aten") return AtenOp{f["op"].text(), f["inputs"].ids(), read_attributes(f["attributes"]), f["outputs"].ids()};
  if (kind == "view")
    return View{f["view"].choice(kViews), f["source"].u32(), f["result"].u32(), f["storage_offset"].integer()};
  throw Malformed{"step kind \"" + kind + "\" is not kernel, matmul, aten or view"};
}

json parse_json(std::string_view text, const std::string& what) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw Malformed{what + " is not valid JSON"};
  return j;
}

tl::unexpected<Error> corrupt(const std::string& what) {
  return fail(ErrorCode::InvalidArgument, "not a valid .stitch artifact: " + what);
}

}  // namespace

std::string Program::serialize() const {
  json program = {{"buffers", json::array()}, {"steps", json::array()}, {"kernels", json::array()}};
  for (const Buffer& b : buffers) program["buffers"].push_back(buffer_json(b));
  for (const Step& s : steps) program["steps"].push_back(step_json(s));
  for (const KernelSource& k : kernels)
    program["kernels"].push_back({{"name", k.name}, {"options", k.options}, {"arch", k.arch}, {"signature", k.signature}});

  std::vector<std::pair<std::string, std::string>> sections;
  sections.emplace_back("program", program.dump());  // compact: programs grow with their steps
  sections.emplace_back("precision", json{{"matmul", to_string(precision.matmul)}, {"cudnn_tf32", precision.cudnn_tf32}}.dump(1));
  sections.emplace_back("hardware", json{{"device", verified_on.device}, {"arch", verified_on.arch},
                                         {"driver", verified_on.driver}, {"cuda", verified_on.cuda},
                                         {"torch", verified_on.torch}}.dump(1));
  if (replay.mode != Replay::unmeasured)
    sections.emplace_back("replay", json{{"mode", to_string(replay.mode)},
                                         {"reason", replay.reason}}.dump(1));
  for (std::size_t k = 0; k < kernels.size(); ++k) {
    sections.emplace_back(kernel_section(k, "source"), kernels[k].source);
    sections.emplace_back(kernel_section(k, "cubin"), kernels[k].cubin);
  }
  for (const auto& [id, bytes] : weights) sections.emplace_back(weight_section(id), bytes);

  json manifest = {{"format", kFormatName}, {"version", kArtifactVersion}, {"library", stitchcuda::version()},
                   {"sections", json::array()}};
  std::uint64_t offset = 0;
  for (const auto& [name, bytes] : sections) {
    manifest["sections"].push_back({{"name", name}, {"offset", offset}, {"size", bytes.size()},
                                    {"sha256", detail::sha256_hex(bytes)}});
    offset += bytes.size();
  }
  std::string manifest_text = manifest.dump(1);

  std::string out(kMagic, sizeof(kMagic));
  put_le(out, kArtifactVersion, 4);
  put_le(out, manifest_text.size(), 8);
  auto digest = detail::Sha256().update(manifest_text).digest();
  out.append(reinterpret_cast<const char*>(digest.data()), digest.size());
  out += manifest_text;
  for (const auto& section : sections) out += section.second;
  return out;
}

Result<Program> Program::deserialize(std::string_view bytes) {
  if (bytes.size() < kHeaderBytes)
    return corrupt("the file holds " + std::to_string(bytes.size()) + " bytes, fewer than the " +
                   std::to_string(kHeaderBytes) + "-byte header (truncated?)");
  if (is_family_artifact(bytes))
    return fail(ErrorCode::InvalidArgument, "a program family (one program per size of a dynamic range), not a single "
                                            "program: load it with FamilyExecutor::load in C++ or stitchcuda.load in Python");
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) return corrupt("wrong magic bytes (not a .stitch file)");
  auto version = std::uint32_t(get_le(bytes, 8, 4));
  if (version != kArtifactVersion)
    return corrupt("format version " + std::to_string(version) + " is not supported; this library reads version " +
                   std::to_string(kArtifactVersion) + " (re-export the artifact with a matching StitchCUDA)");
  std::uint64_t manifest_size = get_le(bytes, 12, 8);
  if (manifest_size > bytes.size() - kHeaderBytes || manifest_size > kMaxManifestBytes)
    return corrupt("the manifest claims " + std::to_string(manifest_size) + " bytes but only " +
                   std::to_string(bytes.size() - kHeaderBytes) + " follow the header (truncated?)");
  std::string_view manifest_text = bytes.substr(kHeaderBytes, manifest_size);
  auto digest = detail::Sha256().update(manifest_text).digest();
  if (std::memcmp(bytes.data() + 20, digest.data(), digest.size()) != 0)
    return corrupt("the manifest's SHA-256 does not match (the file was modified or damaged)");
  std::string_view payload = bytes.substr(kHeaderBytes + manifest_size);

  try {
    json manifest_json = parse_json(manifest_text, "the manifest");
    Field manifest(manifest_json, "manifest");
    if (manifest["format"].text() != kFormatName) throw Malformed{"manifest.format is not \"" + std::string(kFormatName) + "\""};
    if (manifest["version"].integer() != kArtifactVersion)
      throw Malformed{"manifest.version differs from the header's format version"};

    // Sections must tile the payload exactly, in order: a gap, overlap or trailing byte is damage.
    std::map<std::string, std::string_view> sections;
    std::uint64_t expected_offset = 0;
    for (const Field& s : manifest["sections"].items()) {
      std::string name = s["name"].text();
      std::uint64_t offset = s["offset"].size(), size = s["size"].size();
      if (offset != expected_offset || size > payload.size() || offset > payload.size() - size)
        throw Malformed{"section '" + name + "' at offset " + std::to_string(offset) + " with " + std::to_string(size) +
                        " bytes lies outside the " + std::to_string(payload.size()) + " payload bytes (truncated?)"};
      std::string_view data = payload.substr(offset, size);
      if (detail::sha256_hex(data) != s["sha256"].text())
        throw Malformed{"section '" + name + "' fails its SHA-256 check (the file was modified or damaged)"};
      if (!sections.emplace(name, data).second) throw Malformed{"section '" + name + "' appears twice"};
      expected_offset = offset + size;
    }
    if (expected_offset != payload.size())
      throw Malformed{std::to_string(payload.size() - expected_offset) + " bytes follow the last section"};
    auto section = [&](const std::string& name) {
      auto it = sections.find(name);
      if (it == sections.end()) throw Malformed{"missing section '" + name + "'"};
      return it->second;
    };

    Program p;
    json program_json = parse_json(section("program"), "section 'program'");
    Field program(program_json, "program");
    for (const Field& b : program["buffers"].items()) {
      Buffer buf;
      buf.id = b["id"].u32();
      buf.role = b["role"].choice(kRoles);
      buf.spec.dtype = b["dtype"].choice(kDTypes);
      buf.spec.shape = b["shape"].integers();
      buf.spec.strides = b["strides"].integers();
      buf.name = b["name"].text();
      p.buffers.push_back(std::move(buf));
    }
    for (const Field& s : program["steps"].items()) p.steps.push_back(read_step(s));
    auto kernel_list = program["kernels"].items();
    for (std::size_t k = 0; k < kernel_list.size(); ++k) {
      const Field& kf = kernel_list[k];
      KernelSource ks;
      ks.name = kf["name"].text();
      for (const Field& o : kf["options"].items()) ks.options.push_back(o.text());
      ks.arch = kf["arch"].text();
      for (const Field& t : kf["signature"].items()) ks.signature.push_back(t.text());
      ks.source = std::string(section(kernel_section(k, "source")));
      ks.cubin = std::string(section(kernel_section(k, "cubin")));
      // A file is data: its kernels may include only the toolkit's headers and carry only code-generation
      // flags (a stored --pre-include=/etc/passwd would make NVRTC read that file).
      jit::CompileOptions stored;
      stored.extra_flags = ks.options;
      if (auto ok = jit::check_includes(ks.source, stored); !ok)
        throw Malformed{"kernel " + std::to_string(k) + " ('" + ks.name + "'): " + ok.error().message};
      p.kernels.push_back(std::move(ks));
    }
    json precision_json = parse_json(section("precision"), "section 'precision'");
    Field precision(precision_json, "precision");
    p.precision.matmul = precision["matmul"].choice(kPrecisions);
    p.precision.cudnn_tf32 = precision["cudnn_tf32"].boolean();
    json hardware_json = parse_json(section("hardware"), "section 'hardware'");
    Field hardware(hardware_json, "hardware");
    p.verified_on = HardwareInfo{hardware["device"].text(), hardware["arch"].text(), hardware["driver"].text(),
                                 hardware["cuda"].text(), hardware["torch"].text()};
    if (sections.count("replay")) {  // optional: written when the program's replay mode was measured
      json replay_json = parse_json(section("replay"), "section 'replay'");
      Field replay(replay_json, "replay");
      p.replay.mode = replay["mode"].choice(kReplays);
      p.replay.reason = replay["reason"].text();
    }

    // Every section must be one this reader understands, so nothing in the file goes unchecked.
    for (const auto& [name, data] : sections) {
      if (name == "program" || name == "precision" || name == "hardware" || name == "replay") continue;
      if (name.rfind("kernel.", 0) == 0) {
        bool known = false;
        for (std::size_t k = 0; k < p.kernels.size() && !known; ++k)
          known = name == kernel_section(k, "source") || name == kernel_section(k, "cubin");
        if (!known) throw Malformed{"section '" + name + "' names no kernel of the program"};
        continue;
      }
      if (name.rfind("weight.", 0) == 0) {
        std::string digits = name.substr(7);
        if (digits.empty() || digits.size() > 10 || digits.find_first_not_of("0123456789") != std::string::npos ||
            std::stoull(digits) > std::numeric_limits<BufferId>::max())
          throw Malformed{"section '" + name + "' does not name a buffer id"};
        p.weights[BufferId(std::stoull(digits))] = std::string(data);
        continue;
      }
      throw Malformed{"unknown section '" + name + "'"};
    }
    if (auto ok = p.validate(); !ok) return corrupt("the stored program does not validate: " + ok.error().message);
    return p;
  } catch (const Malformed& m) {
    return corrupt(m.what);
  } catch (const std::exception& e) {
    // A safety net: the checks above should leave nothing for nlohmann or the library to throw.
    return corrupt(std::string("unexpected parse failure: ") + e.what());
  }
}

Result<void> Program::save(const std::string& path) const {
  if (auto ok = validate(); !ok) return tl::unexpected(ok.error());
  static std::atomic<unsigned> counter{0};
  std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  std::error_code ec;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return fail(ErrorCode::IoError, "cannot write '" + tmp + "': check that the folder exists and is writable");
    std::string data = serialize();
    out.write(data.data(), std::streamsize(data.size()));
    out.flush();
    if (!out) {
      out.close();
      fs::remove(tmp, ec);
      return fail(ErrorCode::IoError, "writing '" + tmp + "' failed (disk full?)");
    }
  }
  // rename is atomic within one folder: a reader sees the old artifact or the new one, never a part.
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    return fail(ErrorCode::IoError, "cannot move the artifact into '" + path + "': " + ec.message());
  }
  return {};
}

Result<Program> Program::load(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return fail(ErrorCode::NotFound, "no artifact at '" + path + "'");
  const std::uintmax_t size = fs::file_size(path, ec);
  if (ec) return fail(ErrorCode::IoError, "cannot read the size of '" + path + "': " + ec.message());
  std::ifstream in(path, std::ios::binary);
  if (!in) return fail(ErrorCode::IoError, "cannot open '" + path + "' for reading");
  // The header first: its manifest length is checked against the file's size, and held to what a manifest
  // can be, before anything the size of the file is allocated.
  std::string data(std::min<std::uintmax_t>(size, kHeaderBytes), '\0');
  in.read(data.data(), std::streamsize(data.size()));
  if (std::uintmax_t(in.gcount()) != data.size()) return fail(ErrorCode::IoError, "reading '" + path + "' failed");
  if (data.size() == kHeaderBytes) {
    const std::uint64_t manifest_size = get_le(data, 12, 8);
    if (manifest_size > size - kHeaderBytes || manifest_size > kMaxManifestBytes)
      return fail(ErrorCode::InvalidArgument, "'" + path + "' is not a valid StitchCUDA artifact: the manifest claims " +
                                                  std::to_string(manifest_size) + " bytes of a " + std::to_string(size) +
                                                  "-byte file (at most " + std::to_string(kMaxManifestBytes) + ")");
  }
  try {
    data.resize(size);
  } catch (const std::bad_alloc&) {
    return fail(ErrorCode::IoError, "'" + path + "' (" + std::to_string(size) + " bytes) does not fit in memory");
  }
  if (size > kHeaderBytes) {
    in.read(data.data() + kHeaderBytes, std::streamsize(size - kHeaderBytes));
    if (std::uintmax_t(in.gcount()) != size - kHeaderBytes)
      return fail(ErrorCode::IoError, "reading '" + path + "' failed (the file changed while it was read?)");
  }
  auto program = deserialize(data);
  if (!program) {
    Error e = program.error();
    e.message = "'" + path + "' is " + e.message;
    return tl::unexpected(std::move(e));
  }
  return program;
}

}  // namespace stitchcuda::program
