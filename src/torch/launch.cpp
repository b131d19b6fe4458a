// The torch bridge: kernel arguments from at::Tensor, launched on PyTorch's current stream.
// This folder is the only library code that includes LibTorch headers.
#include <stitchcuda/torch.hpp>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>
#include <optional>

namespace stitchcuda::torch {
namespace {

// "const float*" -> Float; nullopt when the type is unknown or not a pointer (no check then).
std::optional<c10::ScalarType> pointee_dtype(std::string type) {
  if (type.empty() || type.back() != '*') return std::nullopt;
  type.pop_back();
  for (const char* q : {"const ", " const", "volatile "})
    for (auto pos = type.find(q); pos != std::string::npos; pos = type.find(q)) type.erase(pos, std::strlen(q));
  while (!type.empty() && type.back() == ' ') type.pop_back();
  while (!type.empty() && type.front() == ' ') type.erase(0, 1);
  struct Row { const char* name; c10::ScalarType dtype; };
  static const Row rows[] = {
      {"float", c10::kFloat},          {"float2", c10::kFloat},         {"float4", c10::kFloat},
      {"double", c10::kDouble},        {"double2", c10::kDouble},       {"half", c10::kHalf},
      {"__half", c10::kHalf},          {"half2", c10::kHalf},           {"__half2", c10::kHalf},
      {"__nv_bfloat16", c10::kBFloat16}, {"nv_bfloat16", c10::kBFloat16}, {"__nv_bfloat162", c10::kBFloat16},
      {"int", c10::kInt},              {"int32_t", c10::kInt},          {"int4", c10::kInt},
      {"long long", c10::kLong},       {"int64_t", c10::kLong},         {"long", c10::kLong},
      {"short", c10::kShort},          {"int16_t", c10::kShort},        {"int8_t", c10::kChar},
      {"signed char", c10::kChar},     {"uint8_t", c10::kByte},         {"unsigned char", c10::kByte},
      {"bool", c10::kBool}};
  for (auto& r : rows)
    if (type == r.name) return r.dtype;
  return std::nullopt;
}

std::string position(std::size_t i, const jit::Kernel& k) {
  return "argument " + std::to_string(i) + " of kernel '" + k.name() + "'";
}

}  // namespace

void* current_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

Result<jit::KernelArgs> pack(const jit::Kernel& kernel, const std::vector<Arg>& args,
                             const std::vector<std::string>& signature, int& device) {
  const auto& params = kernel.params();
  if (args.size() != params.size())
    return fail(ErrorCode::InvalidArgument, "kernel '" + kernel.name() + "' takes " + std::to_string(params.size()) +
                                                " argument(s) but " + std::to_string(args.size()) + " were given");
  // Tensors are checked before anything touches the driver, so mistakes are reported on any machine.
  device = -1;
  jit::KernelArgs packed;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const auto& p = params[i];
    if (auto t = std::get_if<const at::Tensor*>(&args[i])) {
      const at::Tensor& x = **t;
      if (!x.defined()) return fail(ErrorCode::InvalidArgument, position(i, kernel) + " is an undefined tensor");
      if (!x.is_cuda())
        return fail(ErrorCode::InvalidArgument, position(i, kernel) + " is a " + x.device().str() +
                                                    " tensor; kernels need CUDA tensors: move it with .cuda()");
      if (device >= 0 && x.get_device() != device)
        return fail(ErrorCode::InvalidArgument, position(i, kernel) + " is on cuda:" + std::to_string(x.get_device()) +
                                                    " but earlier tensors are on cuda:" + std::to_string(device));
      device = x.get_device();
      if (!x.is_contiguous())
        return fail(ErrorCode::InvalidArgument, position(i, kernel) + " is not contiguous (strides " +
                                                    c10::str(x.strides()) + "): pass x.contiguous()");
      if (p.size != 8)
        return fail(ErrorCode::InvalidArgument, position(i, kernel) + " is a tensor, but the kernel declares a " +
                                                    std::to_string(p.size) + "-byte value there, not a pointer");
      if (i < signature.size())
        if (auto want = pointee_dtype(signature[i]); want && *want != x.scalar_type())
          return fail(ErrorCode::InvalidArgument, position(i, kernel) + " is " + std::string(c10::toString(x.scalar_type())) +
                                                      " but the kernel declares '" + signature[i] + "' (" +
                                                      std::string(c10::toString(*want)) + "): convert it with .to()");
      packed.pointer(x.data_ptr());
    } else if (auto v = std::get_if<std::int64_t>(&args[i])) {
      switch (p.kind) {
        case jit::ParamKind::S32: case jit::ParamKind::U32:
          if (*v < std::numeric_limits<std::int32_t>::min() || *v > std::numeric_limits<std::uint32_t>::max())
            return fail(ErrorCode::InvalidArgument, position(i, kernel) + " = " + std::to_string(*v) +
                                                        " does not fit the kernel's 32-bit parameter");
          packed.i32(static_cast<std::int32_t>(*v));
          break;
        case jit::ParamKind::S64: case jit::ParamKind::U64: packed.i64(*v); break;
        case jit::ParamKind::F32: packed.f32(static_cast<float>(*v)); break;
        case jit::ParamKind::F64: packed.f64(static_cast<double>(*v)); break;
        case jit::ParamKind::U8: case jit::ParamKind::S8: {
          auto b = static_cast<std::int8_t>(*v);
          packed.bytes(&b, 1, 1);
          break;
        }
        case jit::ParamKind::U16: case jit::ParamKind::S16: {
          auto s = static_cast<std::int16_t>(*v);
          packed.bytes(&s, 2, 2);
          break;
        }
        default:
          return fail(ErrorCode::InvalidArgument, position(i, kernel) + " is an integer, but the kernel declares " +
                                                      std::to_string(p.size) + " bytes of another type there");
      }
    } else if (auto f = std::get_if<double>(&args[i])) {
      if (p.kind == jit::ParamKind::F32) packed.f32(static_cast<float>(*f));
      else if (p.kind == jit::ParamKind::F64) packed.f64(*f);
      else
        return fail(ErrorCode::InvalidArgument, position(i, kernel) + " is a float, but the kernel declares an integer "
                                                    "or pointer there: pass an int or a tensor");
    } else if (auto b = std::get_if<bool>(&args[i])) {
      if (p.size != 1)
        return fail(ErrorCode::InvalidArgument, position(i, kernel) + " is a bool, but the kernel declares " +
                                                    std::to_string(p.size) + " bytes there");
      std::uint8_t byte = *b ? 1 : 0;
      packed.bytes(&byte, 1, 1);
    }
  }
  return packed;
}

Result<void> launch(const jit::Kernel& kernel, jit::LaunchConfig cfg, const std::vector<Arg>& args,
                    const std::vector<std::string>& signature) {
  int device = -1;
  auto packed = pack(kernel, args, signature, device);
  if (!packed) return tl::unexpected(packed.error());
  if (device < 0) device = cfg.device >= 0 ? cfg.device : static_cast<int>(c10::cuda::current_device());
  // Make the tensors' device current, as PyTorch itself would before a launch.
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cfg.device = device;
  if (!cfg.stream) cfg.stream = current_stream(device);
  return kernel.launch(cfg, *packed);
}

}  // namespace stitchcuda::torch
