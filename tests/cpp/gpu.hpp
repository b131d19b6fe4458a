// GPU test support: skip without a device, and device memory through the driver API.
// libcuda is dlopen'ed (as the library does), so the test binary links and runs on machines without it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <dlfcn.h>

#include <stitchcuda/jit.hpp>

#include "catch_shim.hpp"

namespace stitchcuda_test {

inline bool has_gpu() { return stitchcuda::jit::Driver::device_count() > 0; }

/// Why there is no device, in the driver's words ("" when one is present).
inline std::string no_gpu_reason() {
  auto ok = stitchcuda::jit::Driver::available();
  if (!ok) return ok.error().message;
  return "the driver reports no devices";
}

/// The few driver entry points the tests need that the library does not offer (allocation, copies).
/// Declared by hand, with the driver's stable C ABI, so no CUDA header is needed.
class CudaMemoryApi {
 public:
  using CUresult = int;
  using CUdeviceptr = unsigned long long;

  static CudaMemoryApi& get() {
    static CudaMemoryApi api;
    return api;
  }

  CUdeviceptr alloc(std::size_t bytes) {
    CUdeviceptr p = 0;
    check(mem_alloc_(&p, bytes), "cuMemAlloc");
    return p;
  }
  void free(CUdeviceptr p) { mem_free_(p); }
  void upload(CUdeviceptr dst, const void* src, std::size_t bytes) {
    check(htod_(dst, src, bytes), "cuMemcpyHtoD");
  }
  void download(void* dst, CUdeviceptr src, std::size_t bytes) {
    check(dtoh_(dst, src, bytes), "cuMemcpyDtoH");
  }

 private:
  CudaMemoryApi() {
    handle_ = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!handle_) throw std::runtime_error("cannot dlopen libcuda.so.1");
    auto init = sym<CUresult (*)(unsigned)>("cuInit");
    auto device_get = sym<CUresult (*)(int*, int)>("cuDeviceGet");
    auto retain = sym<CUresult (*)(void**, int)>("cuDevicePrimaryCtxRetain");
    auto set_current = sym<CUresult (*)(void*)>("cuCtxSetCurrent");
    mem_alloc_ = sym<CUresult (*)(CUdeviceptr*, std::size_t)>("cuMemAlloc_v2");
    mem_free_ = sym<CUresult (*)(CUdeviceptr)>("cuMemFree_v2");
    htod_ = sym<CUresult (*)(CUdeviceptr, const void*, std::size_t)>("cuMemcpyHtoD_v2");
    dtoh_ = sym<CUresult (*)(void*, CUdeviceptr, std::size_t)>("cuMemcpyDtoH_v2");
    // Make device 0's primary context current: the library launches into the current context,
    // so kernels and these allocations share one address space.
    int device = 0;
    void* ctx = nullptr;
    check(init(0), "cuInit");
    check(device_get(&device, 0), "cuDeviceGet");
    check(retain(&ctx, device), "cuDevicePrimaryCtxRetain");
    check(set_current(ctx), "cuCtxSetCurrent");
  }
  template <class F>
  F sym(const char* name) {
    void* p = ::dlsym(handle_, name);
    if (!p) throw std::runtime_error(std::string("libcuda lacks ") + name);
    return reinterpret_cast<F>(p);
  }
  static void check(CUresult r, const char* what) {
    if (r != 0) throw std::runtime_error(std::string(what) + " failed with CUresult " + std::to_string(r));
  }

  void* handle_ = nullptr;
  CUresult (*mem_alloc_)(CUdeviceptr*, std::size_t) = nullptr;
  CUresult (*mem_free_)(CUdeviceptr) = nullptr;
  CUresult (*htod_)(CUdeviceptr, const void*, std::size_t) = nullptr;
  CUresult (*dtoh_)(void*, CUdeviceptr, std::size_t) = nullptr;
};

/// A device array of T, freed on scope exit.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t count) : count_(count) {
    ptr_ = CudaMemoryApi::get().alloc(count * sizeof(T));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { CudaMemoryApi::get().free(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void upload(const std::vector<T>& host) {
    CudaMemoryApi::get().upload(ptr_, host.data(), host.size() * sizeof(T));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    CudaMemoryApi::get().download(host.data(), ptr_, count_ * sizeof(T));
    return host;
  }
  const void* get() const { return reinterpret_cast<const void*>(static_cast<std::uintptr_t>(ptr_)); }
  std::size_t size() const { return count_; }

 private:
  CudaMemoryApi::CUdeviceptr ptr_ = 0;
  std::size_t count_ = 0;
};

}  // namespace stitchcuda_test

/// Ends the test case as skipped, with the driver's reason, when no CUDA device is present.
#define REQUIRE_GPU()                                                                    \
  do {                                                                                   \
    if (!stitchcuda_test::has_gpu()) {                                                   \
      STITCHCUDA_SKIP("no CUDA device: " + stitchcuda_test::no_gpu_reason());            \
    }                                                                                    \
  } while (0)
