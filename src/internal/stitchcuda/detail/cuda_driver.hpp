// The CUDA driver API (libcuda.so.1, opened by the run-time loader): importable without a GPU. The jit layer
// implements it; the profiler and the executor use it too.
#pragma once

#include <cuda.h>

#include <string>

#include <stitchcuda/error.hpp>

namespace stitchcuda::jit::detail {

/// Driver entry points, resolved through cuGetProcAddress for the toolkit's API version.
struct DriverApi {
  decltype(&::cuInit) Init = nullptr;
  decltype(&::cuDriverGetVersion) DriverGetVersion = nullptr;
  decltype(&::cuDeviceGetCount) DeviceGetCount = nullptr;
  decltype(&::cuDeviceGet) DeviceGet = nullptr;
  decltype(&::cuDeviceGetName) DeviceGetName = nullptr;
  decltype(&::cuDeviceGetAttribute) DeviceGetAttribute = nullptr;
  decltype(&::cuDeviceTotalMem) DeviceTotalMem = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) DevicePrimaryCtxRetain = nullptr;
  decltype(&::cuCtxGetCurrent) CtxGetCurrent = nullptr;
  decltype(&::cuCtxSetCurrent) CtxSetCurrent = nullptr;
  decltype(&::cuCtxGetDevice) CtxGetDevice = nullptr;
  decltype(&::cuCtxSynchronize) CtxSynchronize = nullptr;
  decltype(&::cuGetErrorName) GetErrorName = nullptr;
  decltype(&::cuGetErrorString) GetErrorString = nullptr;
  decltype(&::cuLibraryLoadData) LibraryLoadData = nullptr;
  decltype(&::cuLibraryUnload) LibraryUnload = nullptr;
  decltype(&::cuLibraryGetKernel) LibraryGetKernel = nullptr;
  decltype(&::cuKernelGetAttribute) KernelGetAttribute = nullptr;
  decltype(&::cuKernelSetAttribute) KernelSetAttribute = nullptr;
  decltype(&::cuKernelGetFunction) KernelGetFunction = nullptr;
  decltype(&::cuOccupancyMaxActiveBlocksPerMultiprocessor) OccupancyMaxActiveBlocksPerMultiprocessor = nullptr;
  decltype(&::cuLaunchKernelEx) LaunchKernelEx = nullptr;
  decltype(&::cuMemcpyAsync) MemcpyAsync = nullptr;
  decltype(&::cuStreamSynchronize) StreamSynchronize = nullptr;
  decltype(&::cuStreamCreate) StreamCreate = nullptr;
  decltype(&::cuStreamDestroy) StreamDestroy = nullptr;
  int version = 0;  ///< driver API version, e.g. 13000
};

/// The driver, loaded and initialized once; Unavailable says why not (no libcuda, no device).
Result<const DriverApi*> driver();

/// "CUDA_ERROR_X: text" for a driver result.
std::string describe(CUresult r);

/// Error value for a failed driver call: `what` says which operation failed.
Error cuda_error(CUresult r, const std::string& what, ErrorCode code = ErrorCode::CudaError);

/// Makes a context current: the current one if any, else `device`'s primary context (shared
/// with PyTorch's runtime). Returns the device of the current context.
Result<int> ensure_context(const DriverApi& api, int device);

}  // namespace stitchcuda::jit::detail
