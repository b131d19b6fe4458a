// NVRTC loaded at run time (dlopen), so the library imports on machines without the toolkit.
#pragma once

#include <nvrtc.h>

#include <string>

#include <stitchcuda/error.hpp>

namespace stitchcuda::jit::detail {

/// The NVRTC entry points StitchCUDA uses, resolved from one loaded libnvrtc.
struct NvrtcApi {
  decltype(&::nvrtcGetErrorString) GetErrorString = nullptr;
  decltype(&::nvrtcVersion) Version = nullptr;
  decltype(&::nvrtcGetNumSupportedArchs) GetNumSupportedArchs = nullptr;
  decltype(&::nvrtcGetSupportedArchs) GetSupportedArchs = nullptr;
  decltype(&::nvrtcCreateProgram) CreateProgram = nullptr;
  decltype(&::nvrtcDestroyProgram) DestroyProgram = nullptr;
  decltype(&::nvrtcCompileProgram) CompileProgram = nullptr;
  decltype(&::nvrtcGetPTXSize) GetPTXSize = nullptr;
  decltype(&::nvrtcGetPTX) GetPTX = nullptr;
  decltype(&::nvrtcGetCUBINSize) GetCUBINSize = nullptr;
  decltype(&::nvrtcGetCUBIN) GetCUBIN = nullptr;
  decltype(&::nvrtcGetProgramLogSize) GetProgramLogSize = nullptr;
  decltype(&::nvrtcGetProgramLog) GetProgramLog = nullptr;
  decltype(&::nvrtcAddNameExpression) AddNameExpression = nullptr;
  decltype(&::nvrtcGetLoweredName) GetLoweredName = nullptr;
  std::string path;     ///< file it was loaded from
  int major = 0, minor = 0;
};

/// The process's NVRTC, loaded once: STITCHCUDA_NVRTC, an already loaded libnvrtc.so.13, the
/// loader's search path, then $CUDA_HOME/lib64, $CUDA_PATH/lib64, /usr/local/cuda/lib64, and the folder of
/// the CUDA runtime torch loaded.
Result<const NvrtcApi*> nvrtc();

}  // namespace stitchcuda::jit::detail
