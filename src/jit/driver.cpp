// Loads libcuda, resolves entry points by API version, and answers device questions.
#include <stitchcuda/detail/cuda_driver.hpp>

#include <algorithm>
#include <mutex>

#include <stitchcuda/detail/dynamic_library.hpp>
#include <stitchcuda/jit.hpp>

namespace stitchcuda::jit::detail {
namespace {

using GetProcAddress = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

Result<DriverApi> load() {
  // The driver is the system's (never a toolkit's stub library): only the dynamic loader's search.
  auto lib = stitchcuda::detail::load_library(
      {"libcuda.so.1", stitchcuda::detail::Setting::libcuda, {"libcuda.so.1"},
       "the CUDA driver (libcuda.so.1) is not installed on this machine: kernels can be compiled "
       "(for sm_90a by default) but not run; install an NVIDIA driver to run them"});
  if (!lib) return tl::unexpected(lib.error());
  GetProcAddress gpa = nullptr;
  decltype(&::cuDriverGetVersion) get_version = nullptr;
  if (!lib->bind(gpa, "cuGetProcAddress_v2") || !lib->bind(get_version, "cuDriverGetVersion"))
    return fail(ErrorCode::Unavailable, "the CUDA driver is too old (no cuGetProcAddress_v2): install a driver "
                                        "supporting CUDA 12.4 or newer");
  DriverApi api;
  get_version(&api.version);
  if (api.version < 12040)
    return fail(ErrorCode::Unavailable, "the CUDA driver supports CUDA " + std::to_string(api.version / 1000) +
                                            "." + std::to_string(api.version % 1000 / 10) +
                                            ", StitchCUDA needs 12.4 or newer: update the NVIDIA driver");
  // Ask for the 12.4 ABI of every entry point: it matches the unsuffixed declarations in cuda.h
  // (CUDA 13's versions of cuCtxGetDevice and cuCtxSynchronize take an extra context argument).
  const int want = 12040;
  std::string missing;
  auto bind = [&](auto& fn, const char* name) {
    void* p = nullptr;
    CUdriverProcAddressQueryResult status{};
    if (gpa(name, &p, want, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS || !p) {
      missing += std::string(" ") + name;
      return;
    }
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  bind(api.Init, "cuInit");
  bind(api.DriverGetVersion, "cuDriverGetVersion");
  bind(api.DeviceGetCount, "cuDeviceGetCount");
  bind(api.DeviceGet, "cuDeviceGet");
  bind(api.DeviceGetName, "cuDeviceGetName");
  bind(api.DeviceGetAttribute, "cuDeviceGetAttribute");
  bind(api.DeviceTotalMem, "cuDeviceTotalMem");
  bind(api.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  bind(api.CtxGetCurrent, "cuCtxGetCurrent");
  bind(api.CtxSetCurrent, "cuCtxSetCurrent");
  bind(api.CtxGetDevice, "cuCtxGetDevice");
  bind(api.CtxSynchronize, "cuCtxSynchronize");
  bind(api.GetErrorName, "cuGetErrorName");
  bind(api.GetErrorString, "cuGetErrorString");
  bind(api.LibraryLoadData, "cuLibraryLoadData");
  bind(api.LibraryUnload, "cuLibraryUnload");
  bind(api.LibraryGetKernel, "cuLibraryGetKernel");
  bind(api.KernelGetAttribute, "cuKernelGetAttribute");
  bind(api.KernelSetAttribute, "cuKernelSetAttribute");
  bind(api.KernelGetFunction, "cuKernelGetFunction");
  bind(api.OccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  bind(api.LaunchKernelEx, "cuLaunchKernelEx");
  bind(api.MemcpyAsync, "cuMemcpyAsync");
  bind(api.StreamSynchronize, "cuStreamSynchronize");
  bind(api.StreamCreate, "cuStreamCreate");
  bind(api.StreamDestroy, "cuStreamDestroy");
  if (!missing.empty())
    return fail(ErrorCode::Unavailable, "the CUDA driver lacks functions StitchCUDA needs:" + missing +
                                            "; update the NVIDIA driver");
  if (CUresult r = api.Init(0); r != CUDA_SUCCESS) {
    const char* name = nullptr;
    api.GetErrorName(r, &name);
    return fail(ErrorCode::Unavailable,
                std::string("the CUDA driver could not start (") + (name ? name : "?") +
                    "): no usable GPU; kernels can be compiled but not run");
  }
  return api;
}

}  // namespace

Result<const DriverApi*> driver() {
  static std::once_flag once;
  static Result<DriverApi> loaded = fail(ErrorCode::Internal, "not loaded");
  std::call_once(once, [] { loaded = load(); });
  if (!loaded) return tl::unexpected(loaded.error());
  return &*loaded;
}

std::string describe(CUresult r) {
  auto api = driver();
  const char* name = nullptr;
  const char* text = nullptr;
  if (api) {
    (*api)->GetErrorName(r, &name);
    (*api)->GetErrorString(r, &text);
  }
  return std::string(name ? name : "CUDA error " + std::to_string(int(r))) + ": " + (text ? text : "");
}

Error cuda_error(CUresult r, const std::string& what, ErrorCode code) {
  return Error{code, what + " failed: " + describe(r), {}, {}};
}

Result<int> ensure_context(const DriverApi& api, int device) {
  CUcontext ctx = nullptr;
  if (CUresult r = api.CtxGetCurrent(&ctx); r != CUDA_SUCCESS) return tl::unexpected(cuda_error(r, "cuCtxGetCurrent"));
  if (!ctx) {
    int count = 0;
    api.DeviceGetCount(&count);
    int index = device < 0 ? 0 : device;
    if (index >= count)
      return fail(ErrorCode::InvalidArgument, "device " + std::to_string(index) + " does not exist (this machine has " +
                                                  std::to_string(count) + " CUDA device(s))");
    CUdevice dev = 0;
    if (CUresult r = api.DeviceGet(&dev, index); r != CUDA_SUCCESS) return tl::unexpected(cuda_error(r, "cuDeviceGet"));
    if (CUresult r = api.DevicePrimaryCtxRetain(&ctx, dev); r != CUDA_SUCCESS)
      return tl::unexpected(cuda_error(r, "retaining the primary context"));
    if (CUresult r = api.CtxSetCurrent(ctx); r != CUDA_SUCCESS) return tl::unexpected(cuda_error(r, "cuCtxSetCurrent"));
  }
  CUdevice dev = 0;
  if (CUresult r = api.CtxGetDevice(&dev); r != CUDA_SUCCESS) return tl::unexpected(cuda_error(r, "cuCtxGetDevice"));
  return int(dev);
}

}  // namespace stitchcuda::jit::detail

namespace stitchcuda::jit {

std::string DeviceInfo::arch() const {
  std::string a = "sm_" + std::to_string(cc_major) + std::to_string(cc_minor);
  // Arch-specific ("a") targets unlock wgmma, setmaxnreg and friends; the cubin only serves this device anyway.
  if (cc_major >= 9) a += "a";
  return a;
}

Result<void> Driver::available() {
  auto api = detail::driver();
  if (!api) return tl::unexpected(api.error());
  return {};
}

Result<int> Driver::version() {
  auto api = detail::driver();
  if (!api) return tl::unexpected(api.error());
  return (*api)->version;
}

int Driver::device_count() {
  auto api = detail::driver();
  if (!api) return 0;
  int n = 0;
  if ((*api)->DeviceGetCount(&n) != CUDA_SUCCESS) return 0;
  return n;
}

Result<DeviceInfo> Driver::device(int index) {
  auto loaded = detail::driver();
  if (!loaded) return tl::unexpected(loaded.error());
  const auto& api = **loaded;
  int count = device_count();
  if (index < 0 || index >= count)
    return fail(ErrorCode::InvalidArgument, "device " + std::to_string(index) + " does not exist (this machine has " +
                                                std::to_string(count) + " CUDA device(s))");
  CUdevice dev = 0;
  if (CUresult r = api.DeviceGet(&dev, index); r != CUDA_SUCCESS) return tl::unexpected(detail::cuda_error(r, "cuDeviceGet"));
  DeviceInfo info;
  info.index = index;
  char name[256] = {};
  api.DeviceGetName(name, sizeof(name), dev);
  info.name = name;
  auto attr = [&](CUdevice_attribute a) {
    int v = 0;
    api.DeviceGetAttribute(&v, a, dev);
    return v;
  };
  info.cc_major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  info.cc_minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  info.multiprocessors = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  info.max_threads_per_block = attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
  info.max_shared_per_block_optin = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
  info.max_shared_per_multiprocessor = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
  info.l2_bytes = attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
  info.clock_khz = attr(CU_DEVICE_ATTRIBUTE_CLOCK_RATE);
  size_t total = 0;
  api.DeviceTotalMem(&total, dev);
  info.total_memory = total;
  return info;
}

Result<void> Driver::synchronize(int device) {
  auto loaded = detail::driver();
  if (!loaded) return tl::unexpected(loaded.error());
  auto dev = detail::ensure_context(**loaded, device);
  if (!dev) return tl::unexpected(dev.error());
  if (CUresult r = (*loaded)->CtxSynchronize(); r != CUDA_SUCCESS)
    return tl::unexpected(detail::cuda_error(r, "synchronizing the device (an earlier kernel faulted)",
                                             ErrorCode::LaunchError));
  return {};
}

}  // namespace stitchcuda::jit
