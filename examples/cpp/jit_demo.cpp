// jit_demo: compile a CUDA kernel at run time with stitchcuda::jit, inspect it, and launch it
// when a GPU is present. Without one it still compiles, and says so.
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <dlfcn.h>

#include <stitchcuda/stitchcuda.hpp>

namespace jit = stitchcuda::jit;

static const char* kSource = R"(
extern "C" __global__ void add(const float* a, const float* b, float* c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}
)";

static int failed(const stitchcuda::Error& e) {
  std::fprintf(stderr, "error (%s): %s\n", stitchcuda::to_string(e.code), e.describe().c_str());
  return 1;
}

// StitchCUDA launches kernels but leaves memory to the application (PyTorch, cudaMalloc, ...).
// Here a few driver entry points are opened directly, so the demo needs no CUDA headers.
struct DriverMemory {
  using Ptr = unsigned long long;  // CUdeviceptr
  int (*init)(unsigned);
  int (*retain_primary_context)(void**, int);
  int (*set_current_context)(void*);
  int (*alloc)(Ptr*, size_t);
  int (*free)(Ptr);
  int (*to_device)(Ptr, const void*, size_t);
  int (*to_host)(void*, Ptr, size_t);

  bool open() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) return false;
    auto sym = [lib](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      return fn != nullptr;
    };
    void* ctx = nullptr;
    return sym(init, "cuInit") && sym(retain_primary_context, "cuDevicePrimaryCtxRetain") &&
           sym(set_current_context, "cuCtxSetCurrent") && sym(alloc, "cuMemAlloc_v2") &&
           sym(free, "cuMemFree_v2") && sym(to_device, "cuMemcpyHtoD_v2") &&
           sym(to_host, "cuMemcpyDtoH_v2") && init(0) == 0 &&
           retain_primary_context(&ctx, 0) == 0 && set_current_context(ctx) == 0;
  }
};

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const bool help = !std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h");
    std::fprintf(help ? stdout : stderr,
                 "%susage: jit_demo\n"
                 "Compiles a vector-add CUDA kernel at run time (NVRTC, through the kernel cache), prints its\n"
                 "architecture, size and parameters, and launches it where a GPU is present. Takes no arguments.\n"
                 "Prints 'ok' after a checked launch, 'no GPU: compiled only' without a GPU; exits 1 on an error.\n",
                 help ? "" : (std::string("jit_demo: unexpected argument '") + argv[i] + "'\n").c_str());
    return help ? 0 : 2;
  }
  // Compile (or fetch from the kernel cache) and look at what came out.
  auto module = jit::build(kSource);
  if (!module) return failed(module.error());
  const jit::Binary& bin = (*module)->binary();
  std::printf("arch: %s\ncubin: %zu bytes\norigin: %s\n", bin.arch.c_str(), bin.cubin.size(),
              (*module)->origin().c_str());

  auto add = (*module)->kernel("add");
  if (!add) return failed(add.error());
  std::printf("kernel %s:", add->name().c_str());
  for (const jit::ParamInfo& p : add->params()) std::printf(" %zu-byte", p.size);
  std::printf("\n");

  if (jit::Driver::device_count() == 0) {
    std::printf("no GPU: compiled only\n");
    return 0;
  }

  DriverMemory mem{};
  if (!mem.open()) {
    std::fprintf(stderr, "error: cannot open the CUDA driver for allocation\n");
    return 1;
  }
  const unsigned n = 1u << 20;
  const size_t bytes = n * sizeof(float);
  std::vector<float> a(n), b(n), c(n);
  for (unsigned i = 0; i < n; ++i) a[i] = float(i), b[i] = 2.0f * float(i);
  DriverMemory::Ptr da = 0, db = 0, dc = 0;
  if (mem.alloc(&da, bytes) || mem.alloc(&db, bytes) || mem.alloc(&dc, bytes) ||
      mem.to_device(da, a.data(), bytes) || mem.to_device(db, b.data(), bytes)) {
    std::fprintf(stderr, "error: device allocation or copy failed\n");
    return 1;
  }

  jit::KernelArgs args;  // in declaration order; launch checks them against the kernel's parameters
  args.pointer(reinterpret_cast<void*>(da)).pointer(reinterpret_cast<void*>(db))
      .pointer(reinterpret_cast<void*>(dc)).i32(int(n));
  jit::LaunchConfig cfg;
  cfg.block = {256, 1, 1};
  cfg.grid = {(n + 255) / 256, 1, 1};  // one thread per element
  if (auto r = add->launch(cfg, args); !r) return failed(r.error());
  if (auto r = jit::Driver::synchronize(); !r) return failed(r.error());

  const bool copied = mem.to_host(c.data(), dc, bytes) == 0;
  mem.free(da), mem.free(db), mem.free(dc);
  if (!copied) {
    std::fprintf(stderr, "error: copy to host failed\n");
    return 1;
  }
  for (unsigned i = 0; i < n; ++i) {
    if (c[i] != a[i] + b[i]) {
      std::fprintf(stderr, "error: c[%u] = %g, expected %g\n", i, c[i], a[i] + b[i]);
      return 1;
    }
  }
  std::printf("ok\n");
  return 0;
}
