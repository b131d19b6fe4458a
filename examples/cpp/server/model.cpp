// Request parsing and validation against the served program's inputs, and answer encoding (model.hpp).
#include "model.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

namespace stitchcuda_server {

namespace program = stitchcuda::program;
using program::DType;
using nlohmann::json;

std::size_t TensorSlot::bytes() const {
  std::size_t n = program::dtype_size(dtype);
  for (auto d : shape) n *= std::size_t(d);
  return n;
}

static std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A state (a KV cache) is read and updated in place run after run: the rows of a batch would share it and
// the workers' streams would race on it. Such a program is a token loop's step, not a request's forward.
static bool has_state(const program::Program& p, std::string& why) {
  for (const auto& b : p.buffers)
    if (b.role == program::BufferRole::state) {
      why = "the program has a state, '" + (b.name.empty() ? "buffer " + std::to_string(b.id) : b.name) + "' (" +
            b.spec.describe() + "), which each run reads and updates in place (a KV cache): the server batches "
            "requests and runs batches on several streams at once, which would mix their states. Serve a program "
            "without states, or run a saved prefill + decode pair with `serve generate` (docs/decode.md)";
      return true;
    }
  return false;
}

std::optional<ServedModel> ServedModel::from_program(const program::Program& p, std::string& why) {
  if (has_state(p, why)) return std::nullopt;
  ServedModel m;
  auto add = [&](const program::Buffer& b, std::vector<TensorSlot>& to, const char* kind) {
    const std::string name = b.name.empty() ? kind + std::to_string(to.size()) : b.name;
    if (b.spec.shape.empty()) {
      why = std::string(kind) + " '" + name + "' is a scalar: every input and output needs the batch as dim 0";
      return false;
    }
    if (!b.spec.is_contiguous()) {
      why = std::string(kind) + " '" + name + "' is not contiguous (" + b.spec.describe() +
            "): the server splits batches by rows";
      return false;
    }
    if (m.max_batch == 0) m.max_batch = b.spec.shape[0];
    if (b.spec.shape[0] != m.max_batch) {
      why = std::string(kind) + " '" + name + "' has dim 0 = " + std::to_string(b.spec.shape[0]) +
            ", the first input's is " + std::to_string(m.max_batch) + ": every input and output needs the batch as dim 0";
      return false;
    }
    to.push_back({name, b.spec.dtype, {b.spec.shape.begin() + 1, b.spec.shape.end()}});
    return true;
  };
  // Inputs first: the first input's dim 0 is the batch.
  for (auto role : {program::BufferRole::input, program::BufferRole::output})
    for (const auto& b : p.buffers)
      if (b.role == role && !add(b, role == program::BufferRole::input ? m.inputs : m.outputs,
                                 role == program::BufferRole::input ? "input" : "output"))
        return std::nullopt;
  if (m.inputs.empty() || m.outputs.empty() || m.max_batch < 1) {
    why = "the program has no input or no output, or a batch of 0: nothing to serve";
    return std::nullopt;
  }
  return m;
}

std::optional<ServedModel> ServedModel::from_family(const program::ProgramFamily& f, std::string& why) {
  if (auto ok = f.validate(); !ok) {
    why = ok.error().message;
    return std::nullopt;
  }
  for (const auto& member : f.members)
    if (has_state(member.program, why)) return std::nullopt;
  if (f.dims.size() != 1) {
    why = "the family varies " + std::to_string(f.dims.size()) + " dims; the server stacks requests along one, the "
          "batch: serve a family whose only dim is dim 0 of every input and output";
    return std::nullopt;
  }
  const program::DynamicDim& dim = f.dims[0];
  const auto& first = f.members[0].program;
  for (auto [role, axes] :
       {std::pair{program::BufferRole::input, &dim.inputs}, std::pair{program::BufferRole::output, &dim.outputs}}) {
    const char* kind = role == program::BufferRole::input ? "input" : "output";
    const auto buffers = program::io_buffers(first, role);
    for (std::uint32_t i = 0; i < buffers.size(); ++i)
      if (std::find(axes->begin(), axes->end(), std::pair<std::uint32_t, std::uint32_t>{i, 0}) == axes->end() ||
          std::count_if(axes->begin(), axes->end(), [&](const auto& a) { return a.first == i; }) != 1) {
        why = "dim '" + dim.name + "' is not dim 0 (alone) of " + kind + " " + std::to_string(i) + " ('" + buffers[i]->name +
              "'): the server stacks requests along dim 0 of every input and output";
        return std::nullopt;
      }
  }
  if (dim.min != 1 || dim.max > kMaxFamilyBatch) {
    why = "dim '" + dim.name + "' ranges over " + std::to_string(dim.min) + ".." + std::to_string(dim.max) +
          ": the server runs every batch from 1 to at most " + std::to_string(kMaxFamilyBatch) + " requests";
    return std::nullopt;
  }
  if (!dim.pad) {  // members are unique and in range: fewer than max of them leave a size unserved
    std::vector<char> served(std::size_t(dim.max) + 1, 0);
    for (const auto& m : f.members) served[std::size_t(m.sizes[0])] = 1;
    const auto gap = std::find(served.begin() + 1, served.end(), 0);
    if (gap != served.end()) {
      why = "dim '" + dim.name + "' does not pad and no member serves a batch of " + std::to_string(gap - served.begin()) +
            ": the server runs whatever batch the window gathers; build the family with pad = true, or a member per size";
      return std::nullopt;
    }
  }
  auto m = from_program(first, why);
  if (!m) return std::nullopt;
  m->max_batch = dim.max;
  m->fixed_batch = false;
  return m;
}

static json slot_json(const TensorSlot& s) {
  return {{"name", s.name}, {"dtype", program::to_string(s.dtype)}, {"shape", s.shape}};
}

std::string ServedModel::describe_json() const {
  json j{{"max_batch", max_batch}, {"fixed_batch", fixed_batch}, {"inputs", json::array()}, {"outputs", json::array()}};
  for (const auto& s : inputs) j["inputs"].push_back(slot_json(s));
  for (const auto& s : outputs) j["outputs"].push_back(slot_json(s));
  return j.dump();
}

std::string error_json(std::string_view message) { return json{{"error", message}}.dump(); }

// ---- base64 ----

static constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  for (std::size_t i = 0; i < in.size(); i += 3) {
    std::uint32_t v = std::uint32_t(std::uint8_t(in[i])) << 16;
    if (i + 1 < in.size()) v |= std::uint32_t(std::uint8_t(in[i + 1])) << 8;
    if (i + 2 < in.size()) v |= std::uint8_t(in[i + 2]);
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += i + 1 < in.size() ? kB64[(v >> 6) & 63] : '=';
    out += i + 2 < in.size() ? kB64[v & 63] : '=';
  }
  return out;
}

std::optional<std::string> base64_decode(std::string_view in) {
  if (in.size() % 4) return std::nullopt;
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
  };
  std::string out;
  out.reserve(in.size() / 4 * 3);
  for (std::size_t i = 0; i < in.size(); i += 4) {
    const bool last = i + 4 == in.size();
    const int pad = last ? (in[i + 3] == '=') + (in[i + 2] == '=') : 0;
    if (pad == 1 && in[i + 2] == '=') return std::nullopt;  // "x=y=" is not padding
    std::uint32_t v = 0;
    for (int k = 0; k < 4 - pad; ++k) {
      const int d = value(in[i + k]);
      if (d < 0) return std::nullopt;
      v |= std::uint32_t(d) << (18 - 6 * k);
    }
    out += char(v >> 16);
    if (pad < 2) out += char((v >> 8) & 0xff);
    if (pad < 1) out += char(v & 0xff);
  }
  return out;
}

// ---- JSON numbers <-> bytes ----

template <class T>
static void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

// Appends one element; "" or why the value does not fit the dtype.
static std::string append_element(const json& v, DType dtype, std::string& out) {
  switch (dtype) {
    case DType::f32:
    case DType::f64:
      if (!v.is_number()) return "expected a number, got " + std::string(v.type_name());
      dtype == DType::f32 ? put(out, v.get<float>()) : put(out, v.get<double>());
      return {};
    case DType::i32:
    case DType::i64:
    case DType::u8: {
      if (!v.is_number_integer()) return "expected an integer, got " + v.dump();
      const bool neg = v.is_number_integer() && !v.is_number_unsigned() && v.get<std::int64_t>() < 0;
      const std::int64_t lo = dtype == DType::u8 ? 0 : dtype == DType::i32 ? std::numeric_limits<std::int32_t>::min()
                                                                           : std::numeric_limits<std::int64_t>::min();
      const std::int64_t hi = dtype == DType::u8 ? 255 : dtype == DType::i32 ? std::numeric_limits<std::int32_t>::max()
                                                                             : std::numeric_limits<std::int64_t>::max();
      if (!neg && v.get<std::uint64_t>() > std::uint64_t(hi)) return v.dump() + " is out of range for " + program::to_string(dtype);
      const std::int64_t x = v.get<std::int64_t>();
      if (x < lo || x > hi) return v.dump() + " is out of range for " + program::to_string(dtype);
      if (dtype == DType::i32) put(out, std::int32_t(x));
      else if (dtype == DType::i64) put(out, x);
      else put(out, std::uint8_t(x));
      return {};
    }
    case DType::boolean:
      if (!v.is_boolean()) return "expected true or false, got " + v.dump();
      put(out, std::uint8_t(v.get<bool>()));
      return {};
    case DType::f16:
    case DType::bf16:
      break;
  }
  return std::string(program::to_string(dtype)) + " values are sent as base64 (\"base64\": ...), not as numbers";
}

// Flattens nested lists that must have `shape` from `depth` on; "" or the first problem (with its index path).
static std::string flatten(const json& v, const std::vector<std::int64_t>& shape, std::size_t depth, DType dtype,
                           std::string& out, const std::string& at) {
  if (depth == shape.size()) {
    auto why = append_element(v, dtype, out);
    return why.empty() ? why : "at " + at + ": " + why;
  }
  if (!v.is_array()) return "at " + at + ": expected a list of " + std::to_string(shape[depth]) + ", got " + v.type_name();
  if (std::int64_t(v.size()) != shape[depth])
    return "at " + at + ": expected a list of " + std::to_string(shape[depth]) + ", got " + std::to_string(v.size()) +
           " elements";
  for (std::size_t i = 0; i < v.size(); ++i)
    if (auto why = flatten(v[i], shape, depth + 1, dtype, out, at + "[" + std::to_string(i) + "]"); !why.empty())
      return why;
  return {};
}

static json unflatten(const char*& p, const std::vector<std::int64_t>& shape, std::size_t depth, DType dtype) {
  if (depth == shape.size()) {
    auto take = [&p]<class T>(T) {
      T v;
      std::memcpy(&v, p, sizeof v);
      p += sizeof v;
      return v;
    };
    switch (dtype) {
      case DType::f32: return take(float{});
      case DType::f64: return take(double{});
      case DType::i32: return take(std::int32_t{});
      case DType::i64: return take(std::int64_t{});
      case DType::u8: return take(std::uint8_t{});
      case DType::boolean: return take(std::uint8_t{}) != 0;
      default: return nullptr;  // f16/bf16 are always answered as base64
    }
  }
  json list = json::array();
  for (std::int64_t i = 0; i < shape[depth]; ++i) list.push_back(unflatten(p, shape, depth + 1, dtype));
  return list;
}

static Parsed refuse(int status, std::string message) { return {std::nullopt, {status, std::move(message)}}; }

Parsed parse_request(const ServedModel& model, std::string_view content_type, std::string_view body) {
  // "application/json" with or without parameters ("; charset=utf-8").
  const auto media = content_type.substr(0, content_type.find(';'));
  if (media != "application/json")
    return refuse(415, "Content-Type is '" + std::string(content_type) + "': send the body as application/json");
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return refuse(400, "the body is not valid JSON");
  if (!j.is_object() || !j.contains("inputs") || !j["inputs"].is_array())
    return refuse(400, "the body needs {\"inputs\": [...]}: one entry per input, in the order GET /healthz lists");
  const auto& in = j["inputs"];
  if (in.size() != model.inputs.size())
    return refuse(400, "got " + std::to_string(in.size()) + " inputs, the program takes " +
                           std::to_string(model.inputs.size()) + " (GET /healthz lists them)");
  Sample sample;
  if (j.contains("answer")) {
    if (j["answer"] != "base64" && j["answer"] != "lists")
      return refuse(400, "\"answer\" is " + j["answer"].dump() + ": use \"lists\" or \"base64\"");
    sample.base64_answer = j["answer"] == "base64";
  }
  for (std::size_t i = 0; i < in.size(); ++i) {
    const auto& slot = model.inputs[i];
    const std::string who = "input " + std::to_string(i) + " ('" + slot.name + "')";
    const auto& e = in[i];
    if (!e.is_object()) return refuse(400, who + " is not an object {\"dtype\", \"shape\", \"data\" or \"base64\"}");
    if (!e.contains("dtype") || !e["dtype"].is_string())
      return refuse(400, who + " has no \"dtype\": it takes " + program::to_string(slot.dtype));
    if (e["dtype"] != program::to_string(slot.dtype))
      return refuse(400, who + " has dtype " + e["dtype"].get<std::string>() + ", the program takes " +
                             program::to_string(slot.dtype));
    if (!e.contains("shape") || !e["shape"].is_array())
      return refuse(400, who + " has no \"shape\": one sample is " + shape_text(slot.shape));
    std::vector<std::int64_t> shape;
    for (const auto& d : e["shape"]) {
      if (!d.is_number_integer()) return refuse(400, who + " has a shape of non-integers: " + e["shape"].dump());
      shape.push_back(d.get<std::int64_t>());
    }
    if (shape != slot.shape)
      return refuse(400, who + " has shape " + shape_text(shape) + ", one sample is " + shape_text(slot.shape) +
                             " (the batch dim is the server's: send one sample)");
    std::string bytes;
    if (e.contains("base64")) {
      if (!e["base64"].is_string()) return refuse(400, who + ": \"base64\" must be a string");
      auto decoded = base64_decode(e["base64"].get<std::string_view>());
      if (!decoded) return refuse(400, who + ": \"base64\" is not valid base64 (RFC 4648, padded)");
      bytes = std::move(*decoded);
      if (bytes.size() != slot.bytes())
        return refuse(400, who + " has " + std::to_string(bytes.size()) + " bytes, " + shape_text(slot.shape) + " " +
                               program::to_string(slot.dtype) + " is " + std::to_string(slot.bytes()));
    } else if (e.contains("data")) {
      bytes.reserve(slot.bytes());
      if (auto why = flatten(e["data"], slot.shape, 0, slot.dtype, bytes, "data"); !why.empty())
        return refuse(400, who + ": " + why);
    } else {
      return refuse(400, who + " has neither \"data\" (nested lists) nor \"base64\" (little-endian bytes)");
    }
    sample.inputs.push_back(std::move(bytes));
  }
  return {std::move(sample), {}};
}

std::string encode_answer(const ServedModel& model, const std::vector<std::string>& outputs, bool base64,
                          int batch_rows, int padded_rows) {
  json j{{"outputs", json::array()}, {"batch", batch_rows}, {"padded", padded_rows}};
  for (std::size_t i = 0; i < model.outputs.size(); ++i) {
    const auto& slot = model.outputs[i];
    json o = slot_json(slot);
    if (base64 || slot.dtype == DType::f16 || slot.dtype == DType::bf16) {
      o["base64"] = base64_encode(outputs[i]);
    } else {
      const char* p = outputs[i].data();
      o["data"] = unflatten(p, slot.shape, 0, slot.dtype);
    }
    j["outputs"].push_back(std::move(o));
  }
  return j.dump();
}

}  // namespace stitchcuda_server
