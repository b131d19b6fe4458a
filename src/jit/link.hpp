// Linking relocatable device code with the CUDA device runtime (libcudadevrt.a) through nvJitLink,
// loaded at run time like NVRTC: kernels that launch graphs or grids from the device need it.
#pragma once

#include <string>

#include <stitchcuda/error.hpp>

namespace stitchcuda::jit::detail {

/// libcudadevrt.a: STITCHCUDA_CUDADEVRT, beside the loaded NVRTC (PyTorch's CUDA wheels ship both),
/// $CUDA_HOME/lib64, then /usr/local/cuda/lib64. Unavailable lists where it looked.
Result<std::string> cudadevrt_path();

/// Links a relocatable CUBIN (NVRTC with -rdc=true) for `arch` ("sm_90a") with the device runtime
/// into a loadable CUBIN. Unavailable when nvJitLink or libcudadevrt.a is missing; CompileError with
/// nvJitLink's log when the link fails (an undefined device function, for one).
Result<std::string> link_device_runtime(const std::string& relocatable_cubin, const std::string& arch);

}  // namespace stitchcuda::jit::detail
