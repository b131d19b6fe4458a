// stitchcuda::torch — launch jit kernels on PyTorch tensors, on PyTorch's current stream.
// Only forward declarations here; the implementation (src/torch/) is the one place that includes LibTorch.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include <stitchcuda/jit.hpp>

namespace at {
class Tensor;
}

namespace stitchcuda::torch {

/// One kernel argument: a tensor (its data pointer is passed), an integer, a float or a bool.
/// A tensor is held by reference and must outlive the launch call.
using Arg = std::variant<const at::Tensor*, std::int64_t, double, bool>;

/// Launches `kernel` with tensors and scalars. Checks that tensors are CUDA tensors on one device,
/// contiguous, and of the element type that `signature` declares for them (entries like
/// "const float*", from jit::declared_signature or given by the caller; empty skips the dtype check).
/// Scalars are converted to the parameter's PTX type. A null cfg.stream means PyTorch's current
/// stream on the tensors' device.
Result<void> launch(const jit::Kernel& kernel, jit::LaunchConfig cfg, const std::vector<Arg>& args,
                    const std::vector<std::string>& signature = {});

/// Checks tensors and scalars as `launch` does and packs them once, for callers that launch the same
/// arguments many times. `device` receives the tensors' device (-1 when there are no tensors).
Result<jit::KernelArgs> pack(const jit::Kernel& kernel, const std::vector<Arg>& args,
                             const std::vector<std::string>& signature, int& device);

/// PyTorch's current stream (a CUstream) on `device`.
void* current_stream(int device);

}  // namespace stitchcuda::torch
