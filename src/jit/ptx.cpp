// PTX declares each parameter as `.param [.align N] .TYPE [.ptr ...] NAME[[SIZE]]`; that is
// all the launcher needs to check argument counts and sizes before the driver sees them.
#include "ptx.hpp"

#include <regex>
#include <string>

namespace stitchcuda::jit::detail {
namespace {

ParamKind kind_of(const std::string& type, std::size_t& size) {
  struct Row { const char* name; ParamKind kind; std::size_t size; };
  static const Row rows[] = {
      {"u8", ParamKind::U8, 1},   {"s8", ParamKind::S8, 1},   {"b8", ParamKind::U8, 1},
      {"u16", ParamKind::U16, 2}, {"s16", ParamKind::S16, 2}, {"b16", ParamKind::U16, 2},
      {"f16", ParamKind::F16, 2}, {"u32", ParamKind::U32, 4}, {"s32", ParamKind::S32, 4},
      {"b32", ParamKind::U32, 4}, {"f32", ParamKind::F32, 4}, {"u64", ParamKind::U64, 8},
      {"s64", ParamKind::S64, 8}, {"b64", ParamKind::U64, 8}, {"f64", ParamKind::F64, 8}};
  for (auto& r : rows)
    if (type == r.name) {
      size = r.size;
      return r.kind;
    }
  size = 0;
  return ParamKind::Bytes;
}

}  // namespace

std::vector<KernelInfo> parse_ptx_kernels(std::string_view ptx) {
  static const std::regex entry(R"(\.entry\s+([A-Za-z_$][A-Za-z0-9_$]*)\s*\()");
  static const std::regex param(
      R"(\.param\s+(?:\.align\s+(\d+)\s+)?\.([a-z]+[0-9]+)\s+(?:\.ptr\s+(?:\.[a-z]+\s+)*(?:\.align\s+\d+\s+)?)?[A-Za-z_$][A-Za-z0-9_$]*(?:\[(\d+)\])?)");
  std::vector<KernelInfo> out;
  std::string text(ptx);
  for (std::sregex_iterator it(text.begin(), text.end(), entry), end; it != end; ++it) {
    KernelInfo k;
    k.name = (*it)[1];
    std::size_t open = std::size_t(it->position(0) + it->length(0));
    std::size_t close = text.find(')', open);
    if (close == std::string::npos) continue;
    std::string params = text.substr(open, close - open);
    for (std::sregex_iterator p(params.begin(), params.end(), param), pend; p != pend; ++p) {
      ParamInfo info;
      std::size_t elem = 0;
      info.kind = kind_of((*p)[2], elem);
      if ((*p)[3].matched) {  // byte array: a struct passed by value
        info.kind = ParamKind::Bytes;
        info.size = std::stoul((*p)[3]) * (elem ? elem : 1);
      } else {
        info.size = elem;
      }
      info.align = (*p)[1].matched ? std::stoul((*p)[1]) : std::max<std::size_t>(elem, 1);
      k.params.push_back(info);
    }
    out.push_back(std::move(k));
  }
  return out;
}

}  // namespace stitchcuda::jit::detail

namespace stitchcuda::jit {

const char* to_string(ParamKind kind) noexcept {
  switch (kind) {
    case ParamKind::U8: return "u8";
    case ParamKind::S8: return "s8";
    case ParamKind::U16: return "u16";
    case ParamKind::S16: return "s16";
    case ParamKind::U32: return "u32";
    case ParamKind::S32: return "s32";
    case ParamKind::U64: return "u64";
    case ParamKind::S64: return "s64";
    case ParamKind::F16: return "f16";
    case ParamKind::F32: return "f32";
    case ParamKind::F64: return "f64";
    case ParamKind::Bytes: return "bytes";
  }
  return "bytes";
}

}  // namespace stitchcuda::jit
