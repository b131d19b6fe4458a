// Loading and launching on a real device: results checked against the CPU, shared memory above
// 48 KB, clusters, attributes, occupancy, and clear errors for bad configurations. Tagged [gpu].
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <stitchcuda/jit.hpp>

#include "catch_shim.hpp"
#include "gpu.hpp"
#include "kernels.hpp"

using namespace stitchcuda;
using namespace stitchcuda::jit;
using stitchcuda_test::contains;
using stitchcuda_test::DeviceBuffer;

namespace {


Kernel kernel_of(std::string_view source, std::string_view name, const CompileOptions& options = {}) {
  auto module = build(source, options);
  if (!module) FAIL("build failed: " << module.error().describe());
  auto kernel = (*module)->kernel(name);
  if (!kernel) FAIL("kernel lookup failed: " << kernel.error().describe());
  return *kernel;
}

void launch_ok(const Kernel& k, const LaunchConfig& cfg, const KernelArgs& args) {
  auto launched = k.launch(cfg, args);
  if (!launched) FAIL("launch failed: " << launched.error().describe());
  auto synced = Driver::synchronize();
  if (!synced) FAIL("synchronize failed: " << synced.error().describe());
}

LaunchConfig config(unsigned grid, unsigned block, std::size_t shared = 0) {
  LaunchConfig cfg;
  cfg.grid = {grid, 1, 1};
  cfg.block = {block, 1, 1};
  cfg.shared_mem_bytes = shared;
  return cfg;
}

}  // namespace

TEST_CASE("the driver describes the device", "[jit][launch][gpu]") {
  REQUIRE_GPU();
  REQUIRE(Driver::available());
  auto version = Driver::version();
  REQUIRE(version);
  CHECK(*version >= 12000);
  auto info = Driver::device(0);
  REQUIRE(info);
  CHECK_FALSE(info->name.empty());
  CHECK(info->multiprocessors > 0);
  CHECK(info->max_threads_per_block == 1024);
  CHECK(info->max_shared_per_block_optin > 48 * 1024);
  CHECK(info->arch() == Compiler::default_arch());
  auto missing = Driver::device(Driver::device_count());
  REQUIRE_FALSE(missing);
  CHECK(missing.error().code == ErrorCode::InvalidArgument);
}

TEST_CASE("vector add matches the CPU element by element", "[jit][launch][gpu]") {
  REQUIRE_GPU();
  const int n = 100'003;  // not a multiple of the block size: the tail is guarded
  std::vector<float> a(n), b(n);
  for (int i = 0; i < n; ++i) {
    a[i] = 0.5f * static_cast<float>(i);
    b[i] = std::sin(static_cast<float>(i));
  }
  DeviceBuffer<float> da(a), db(b), dc(std::vector<float>(n, -1.0f));
  const Kernel add = kernel_of(kVectorAdd, "add");
  KernelArgs args;
  args.pointer(da.get()).pointer(db.get()).pointer(dc.get()).i32(n);
  launch_ok(add, config((n + 255) / 256, 256), args);

  const std::vector<float> c = dc.download();
  int wrong = 0;
  for (int i = 0; i < n; ++i) {
    if (c[i] != a[i] + b[i] && wrong++ < 5) FAIL_CHECK("c[" << i << "] = " << c[i] << ", want " << a[i] + b[i]);
  }
  CHECK(wrong == 0);
}

TEST_CASE("a prepared launch is validated once and enqueued repeatedly", "[jit][launch][gpu]") {
  REQUIRE_GPU();
  const int n = 4099;
  std::vector<float> a(n), b(n);
  for (int i = 0; i < n; ++i) {
    a[i] = static_cast<float>(i);
    b[i] = 1.0f;
  }
  DeviceBuffer<float> da(a), db(b), dc(std::vector<float>(n, -1.0f));
  const Kernel add = kernel_of(kVectorAdd, "add");
  KernelArgs args;
  args.pointer(da.get()).pointer(db.get()).pointer(dc.get()).i32(n);
  auto prepared = add.prepare(config((n + 255) / 256, 256), args);
  if (!prepared) FAIL("prepare failed: " << prepared.error().describe());
  for (int rep = 0; rep < 3; ++rep) {
    auto launched = prepared->launch();
    if (!launched) FAIL("prepared launch failed: " << launched.error().describe());
  }
  auto synced = Driver::synchronize();
  if (!synced) FAIL(synced.error().describe());
  const std::vector<float> c = dc.download();
  int wrong = 0;
  for (int i = 0; i < n; ++i) wrong += c[i] != a[i] + 1.0f;
  CHECK(wrong == 0);

  // The checks happen in prepare: a bad configuration never yields a prepared launch.
  auto bad = add.prepare(config(1, 2048), args);
  REQUIRE_FALSE(bad);
  CHECK(bad.error().code == ErrorCode::LaunchError);
}

TEST_CASE("a bfloat16 kernel computes within bf16 tolerance", "[jit][launch][gpu]") {
  REQUIRE_GPU();
  const char* source = R"(#include <cuda_bf16.h>
extern "C" __global__ void scale_bf16(const float* in, float* out, float s, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    __nv_bfloat16 x = __float2bfloat16(in[i]);
    out[i] = __bfloat162float(__hmul(x, __float2bfloat16(s)));
  }
}
)";
  const int n = 4096;
  const float s = 1.75f;
  std::vector<float> in(n);
  for (int i = 0; i < n; ++i) in[i] = std::cos(0.01f * static_cast<float>(i)) * 10.0f;
  DeviceBuffer<float> din(in), dout(n);
  KernelArgs args;
  args.pointer(din.get()).pointer(dout.get()).f32(s).i32(n);
  launch_ok(kernel_of(source, "scale_bf16"), config(n / 128, 128), args);

  const std::vector<float> out = dout.download();
  int wrong = 0;
  for (int i = 0; i < n; ++i) {
    const float want = in[i] * s;
    // bf16 keeps 8 significant bits; two roundings stay within ~1%.
    if (std::fabs(out[i] - want) > 1e-2f + 1e-2f * std::fabs(want) && wrong++ < 5)
      FAIL_CHECK("out[" << i << "] = " << out[i] << ", want " << want);
  }
  CHECK(wrong == 0);
}

TEST_CASE("dynamic shared memory above 48 KB is opted into; above the device limit is refused",
          "[jit][launch][gpu]") {
  REQUIRE_GPU();
  const char* source = R"(extern "C" __global__ void reverse_in_shared(float* data, int n) {
  extern __shared__ float tile[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) tile[i] = data[i];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) data[i] = tile[n - 1 - i];
}
)";
  const Kernel k = kernel_of(source, "reverse_in_shared");
  const std::size_t bytes = 100 * 1024;
  const int n = static_cast<int>(bytes / sizeof(float));
  std::vector<float> host(n);
  for (int i = 0; i < n; ++i) host[i] = static_cast<float>(i);
  DeviceBuffer<float> d(host);
  KernelArgs args;
  args.pointer(d.get()).i32(n);
  launch_ok(k, config(1, 256, bytes), args);
  const std::vector<float> out = d.download();
  CHECK(out.front() == static_cast<float>(n - 1));
  CHECK(out[n / 3] == static_cast<float>(n - 1 - n / 3));
  CHECK(out.back() == 0.0f);

  auto info = Driver::device(0);
  REQUIRE(info);
  const int limit = info->max_shared_per_block_optin;
  auto too_much = k.launch(config(1, 256, static_cast<std::size_t>(limit) + 1), args);
  REQUIRE_FALSE(too_much);
  INFO(too_much.error().describe());
  CHECK(too_much.error().code == ErrorCode::LaunchError);
  CHECK(contains(too_much.error().message, std::to_string(limit)));
}

TEST_CASE("a cluster launch gives each block its rank in the cluster", "[jit][launch][gpu]") {
  REQUIRE_GPU();
  auto info = Driver::device(0);
  REQUIRE(info);
  if (info->cc_major < 9) STITCHCUDA_SKIP("thread-block clusters need sm_90 or newer");
  const char* source = R"(extern "C" __global__ void cluster_rank(unsigned* out) {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (threadIdx.x == 0) out[blockIdx.x] = rank;
}
)";
  const unsigned blocks = 8;
  DeviceBuffer<unsigned> d(std::vector<unsigned>(blocks, 99u));
  KernelArgs args;
  args.pointer(d.get());
  LaunchConfig cfg = config(blocks, 32);
  cfg.cluster = {2, 1, 1};
  launch_ok(kernel_of(source, "cluster_rank"), cfg, args);
  const std::vector<unsigned> ranks = d.download();
  for (unsigned b = 0; b < blocks; ++b) {
    INFO("block " << b);
    CHECK(ranks[b] == b % 2);
  }

  // The grid must divide into whole clusters.
  cfg.grid = {blocks + 1, 1, 1};
  auto uneven = kernel_of(source, "cluster_rank").launch(cfg, args);
  REQUIRE_FALSE(uneven);
  CHECK((uneven.error().code == ErrorCode::LaunchError ||
         uneven.error().code == ErrorCode::InvalidArgument));
}

TEST_CASE("kernel attributes and occupancy come from the driver", "[jit][launch][gpu]") {
  REQUIRE_GPU();
  const char* source = R"(extern "C" __global__ void staged(float* x) {
  __shared__ float stage[256];
  stage[threadIdx.x] = x[threadIdx.x];
  __syncthreads();
  x[threadIdx.x] = stage[255 - threadIdx.x];
}
extern "C" __global__ void __launch_bounds__(128) bounded(float* x) { x[threadIdx.x] *= 2.0f; }
)";
  const Kernel staged = kernel_of(source, "staged");
  auto attrs = staged.attributes();
  REQUIRE(attrs);
  CHECK(attrs->num_registers > 0);
  CHECK(attrs->max_threads_per_block > 0);
  CHECK(attrs->static_shared_bytes == 1024);  // 256 floats
  CHECK(attrs->binary_version == 10 * Driver::device(0)->cc_major + Driver::device(0)->cc_minor);

  auto blocks = staged.max_active_blocks_per_sm(256);
  REQUIRE(blocks);
  CHECK(*blocks > 0);

  auto bounded_attrs = kernel_of(source, "bounded").attributes();
  REQUIRE(bounded_attrs);
  CHECK(bounded_attrs->max_threads_per_block == 128);
}

TEST_CASE("bad launch configurations are refused with a clear reason", "[jit][launch][gpu]") {
  REQUIRE_GPU();
  const Kernel add = kernel_of(kVectorAdd, "add");
  DeviceBuffer<float> d(1024);
  KernelArgs args;
  args.pointer(d.get()).pointer(d.get()).pointer(d.get()).i32(1024);

  auto refused = [&](const LaunchConfig& cfg, const KernelArgs& a) {
    auto r = add.launch(cfg, a);
    REQUIRE_FALSE(r);
    INFO(r.error().describe());
    CHECK((r.error().code == ErrorCode::LaunchError || r.error().code == ErrorCode::InvalidArgument));
    CHECK_FALSE(r.error().message.empty());
    return r.error();
  };

  SECTION("empty block") {
    LaunchConfig cfg = config(1, 0);
    refused(cfg, args);
  }
  SECTION("empty grid") {
    LaunchConfig cfg = config(0, 32);
    refused(cfg, args);
  }
  SECTION("block.x above 1024") {
    const Error e = refused(config(1, 2048), args);
    CHECK(contains(e.message, "2048"));
    CHECK(contains(e.message, "1024"));
  }
  SECTION("grid.y above 65535") {
    LaunchConfig cfg = config(1, 32);
    cfg.grid.y = 70000;
    const Error e = refused(cfg, args);
    CHECK(contains(e.message, "70000"));
    CHECK(contains(e.message, "65535"));
  }
  SECTION("too few arguments") {
    KernelArgs two;
    two.pointer(d.get()).pointer(d.get());
    const Error e = refused(config(1, 32), two);
    CHECK(contains(e.message, "4"));  // expected
    CHECK(contains(e.message, "2"));  // given
  }
  SECTION("an argument of the wrong size") {
    KernelArgs wide;
    wide.pointer(d.get()).pointer(d.get()).pointer(d.get()).i64(1024);  // PTX says 32-bit
    const Error e = refused(config(1, 32), wide);
    CHECK(contains(e.message, "8"));
    CHECK(contains(e.message, "4"));
  }
  SECTION("more threads than __launch_bounds__ allows") {
    const Kernel bounded = kernel_of(
        R"(extern "C" __global__ void __launch_bounds__(128) bounded(float* x) { x[threadIdx.x] += 1.0f; })",
        "bounded");
    KernelArgs one;
    one.pointer(d.get());
    auto r = bounded.launch(config(1, 256), one);
    REQUIRE_FALSE(r);
    INFO(r.error().describe());
    CHECK((r.error().code == ErrorCode::LaunchError || r.error().code == ErrorCode::InvalidArgument));
    CHECK(contains(r.error().message, "128"));
    CHECK(contains(r.error().message, "256"));
  }
  // A refused launch leaves the context healthy.
  launch_ok(add, config(4, 256), args);
}
