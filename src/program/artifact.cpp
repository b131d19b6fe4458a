// The `.stitch` artifact of one program, in the program layer's container (detail/container.hpp): the
// program's buffers and steps, precision, hardware and replay as JSON sections, then its kernels and weights.
// Reading trusts nothing: every length is bounded, every checksum verified, every field type-checked.
#include <stitchcuda/program.hpp>
#include <stitchcuda/decode.hpp>
#include <stitchcuda/family.hpp>
#include <stitchcuda/jit.hpp>

#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include <stitchcuda/detail/container.hpp>

namespace stitchcuda::program {
namespace {

using nlohmann::json;
using detail::Field;
using detail::Malformed;

const detail::ContainerKind kArtifact{{'S', 'T', 'I', 'T', 'C', 'H', '\x00', '\x01'}, kArtifactVersion,
                                      "stitchcuda.program", "artifact", "not a valid .stitch artifact",
                                      "not a .stitch file"};

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

// ---- reading ----

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

}  // namespace

std::string Program::serialize() const {
  json program = {{"buffers", json::array()}, {"steps", json::array()}, {"kernels", json::array()}};
  for (const Buffer& b : buffers) program["buffers"].push_back(buffer_json(b));
  for (const Step& s : steps) program["steps"].push_back(step_json(s));
  for (const KernelSource& k : kernels)
    program["kernels"].push_back({{"name", k.name}, {"options", k.options}, {"arch", k.arch}, {"signature", k.signature}});

  // The sections view these texts and the program's own kernels and weights: nothing large is copied twice.
  const std::string program_text = program.dump();  // compact: programs grow with their steps
  const std::string precision_text =
      json{{"matmul", to_string(precision.matmul)}, {"cudnn_tf32", precision.cudnn_tf32}}.dump(1);
  const std::string hardware_text = json{{"device", verified_on.device}, {"arch", verified_on.arch},
                                         {"driver", verified_on.driver}, {"cuda", verified_on.cuda},
                                         {"torch", verified_on.torch}}.dump(1);
  const std::string replay_text = json{{"mode", to_string(replay.mode)}, {"reason", replay.reason}}.dump(1);
  std::vector<std::pair<std::string, std::string_view>> views;
  views.emplace_back("program", program_text);
  views.emplace_back("precision", precision_text);
  views.emplace_back("hardware", hardware_text);
  if (replay.mode != Replay::unmeasured) views.emplace_back("replay", replay_text);
  for (std::size_t k = 0; k < kernels.size(); ++k) {
    views.emplace_back(kernel_section(k, "source"), kernels[k].source);
    views.emplace_back(kernel_section(k, "cubin"), kernels[k].cubin);
  }
  for (const auto& [id, bytes] : weights) views.emplace_back(weight_section(id), bytes);
  return detail::write_container(kArtifact, json::object(), views);
}

Result<Program> Program::deserialize(std::string_view bytes) {
  // A family or a decode pair starts with a header of its own: name the loader that reads it.
  if (is_family_artifact(bytes))
    return fail(ErrorCode::InvalidArgument, "a program family (one program per size of a dynamic range), not a single "
                                            "program: load it with FamilyExecutor::load in C++ or stitchcuda.load in Python");
  if (is_decode_artifact(bytes))
    return fail(ErrorCode::InvalidArgument, "a prefill + decode pair (a token loop), not a single program: load it with "
                                            "Generator::load in C++ or stitchcuda.load in Python");
  return detail::read_checked<Program>(kArtifact, bytes, "program", [](const detail::Container& file) {
    const auto& sections = file.sections;
    auto section = [&](const std::string& name) { return file.section(name); };
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
    return p;
  });
}

Result<void> Program::save(const std::string& path) const { return detail::save_checked(kArtifact, path, *this); }

Result<Program> Program::load(const std::string& path) {
  return detail::load_container_file(kArtifact, path, &Program::deserialize);
}

}  // namespace stitchcuda::program
