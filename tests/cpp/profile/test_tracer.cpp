// The CUPTI Tracer: clear Unavailable errors where there is no GPU, and on a GPU ([gpu]) the records of
// jit kernels launched on two streams, one Tracer at a time, and summaries that add up.
#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <dlfcn.h>

#include <stitchcuda/jit.hpp>
#include <stitchcuda/profile.hpp>

#include "catch_shim.hpp"
#include "gpu.hpp"
#include "kernels.hpp"

using namespace stitchcuda;
using namespace stitchcuda::profile;
using stitchcuda_test::contains;
using stitchcuda_test::DeviceBuffer;

namespace {

// A template kernel, so the trace shows a mangled symbol that demangles to "scale<float>".
const char* const kScale = R"(template <class T>
__global__ void scale(T* x, T factor, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= factor;
}
)";

// A non-blocking stream from the driver (the library has no stream API; the tests need two).
class Stream {
 public:
  Stream() {
    stitchcuda_test::CudaMemoryApi::get();  // makes the primary context current
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) throw std::runtime_error("libcuda.so.1 is not loaded");
    create_ = reinterpret_cast<int (*)(void**, unsigned)>(::dlsym(lib, "cuStreamCreate"));
    destroy_ = reinterpret_cast<int (*)(void*)>(::dlsym(lib, "cuStreamDestroy_v2"));
    if (!create_ || !destroy_ || create_(&stream_, 1 /* CU_STREAM_NON_BLOCKING */) != 0)
      throw std::runtime_error("cuStreamCreate failed");
  }
  ~Stream() { destroy_(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* get() const { return stream_; }

 private:
  void* stream_ = nullptr;
  int (*create_)(void**, unsigned) = nullptr;
  int (*destroy_)(void*) = nullptr;
};

jit::Kernel kernel_of(std::string_view source, std::string_view name, const jit::CompileOptions& options = {}) {
  auto module = jit::build(source, options);
  if (!module) FAIL("build failed: " << module.error().describe());
  auto kernel = (*module)->kernel(name);
  if (!kernel) FAIL("kernel lookup failed: " << kernel.error().describe());
  return *kernel;
}

Tracer start_or_fail() {
  auto tracer = Tracer::start();
  if (!tracer) FAIL("Tracer::start failed: " << tracer.error().describe());
  return std::move(*tracer);
}

}  // namespace

TEST_CASE("without a GPU, starting a Tracer is a clear Unavailable error", "[profile]") {
  if (stitchcuda_test::has_gpu()) STITCHCUDA_SKIP("a GPU is present: this test is for machines without one");
  auto tracer = Tracer::start();
  REQUIRE_FALSE(tracer);
  CHECK(tracer.error().code == ErrorCode::Unavailable);
  CHECK(contains(tracer.error().message, "profiler unavailable"));
  CHECK(contains(tracer.error().message, "no CUDA device"));
}

TEST_CASE("CUPTI is found or its absence explained, without attaching", "[profile]") {
  auto ok = Tracer::available();
  auto path = Tracer::cupti_path();
  CHECK(bool(ok) == bool(path));
  if (ok) {
    CHECK(contains(*path, "libcupti"));
  } else {
    CHECK(ok.error().code == ErrorCode::Unavailable);
    CHECK(contains(ok.error().message, "libcupti.so.13"));
  }
}

TEST_CASE("the Tracer records jit kernels on two streams with names, shapes and launches", "[profile][gpu]") {
  REQUIRE_GPU();
  const int n = 1 << 20;
  DeviceBuffer<float> a(std::vector<float>(n, 1.0f)), b(std::vector<float>(n, 2.0f)), c(n), x(std::vector<float>(n, 3.0f));
  jit::CompileOptions scale_options;
  scale_options.name_expressions = {"scale<float>"};
  const jit::Kernel add = kernel_of(kVectorAdd, "add");
  const jit::Kernel scale = kernel_of(kScale, "scale<float>", scale_options);
  Stream first, second;

  Tracer tracer = start_or_fail();
  REQUIRE(tracer.active());
  // A second Tracer while this one records is refused, and does not disturb this one.
  auto nested = Tracer::start();
  REQUIRE_FALSE(nested);
  CHECK(nested.error().code == ErrorCode::Unavailable);
  CHECK(contains(nested.error().message, "another stitchcuda::profile::Tracer is recording"));

  jit::KernelArgs add_args;
  add_args.pointer(a.get()).pointer(b.get()).pointer(c.get()).i32(n);
  jit::LaunchConfig add_cfg;
  add_cfg.grid = {unsigned((n + 255) / 256), 1, 1};
  add_cfg.block = {256, 1, 1};
  add_cfg.stream = first.get();
  for (int i = 0; i < 3; ++i) REQUIRE(add.launch(add_cfg, add_args));

  jit::KernelArgs scale_args;
  scale_args.pointer(x.get()).f32(0.5f).i32(n);
  jit::LaunchConfig scale_cfg;
  scale_cfg.grid = {unsigned((n + 127) / 128), 1, 1};
  scale_cfg.block = {128, 1, 1};
  scale_cfg.stream = second.get();
  for (int i = 0; i < 2; ++i) REQUIRE(scale.launch(scale_cfg, scale_args));

  auto trace = tracer.stop();
  if (!trace) FAIL("stop failed: " << trace.error().describe());
  CHECK_FALSE(tracer.active());
  auto again = tracer.stop();
  REQUIRE_FALSE(again);
  CHECK(again.error().code == ErrorCode::InvalidArgument);

  CHECK(trace->dropped_records == 0);
  REQUIRE(trace->kernels.size() == 5);
  std::set<std::uint32_t> add_streams, scale_streams;
  for (const KernelRecord& k : trace->kernels) {
    INFO(k.name << " / " << k.mangled_name);
    CHECK(k.end_ns > k.start_ns);
    CHECK(k.correlation_id != 0);
    CHECK(k.registers_per_thread > 0);
    CHECK(k.graph_id == 0);
    if (k.name == "add") {
      CHECK(k.grid.x == add_cfg.grid.x);
      CHECK(k.block.x == 256);
      add_streams.insert(k.stream_id);
    } else {
      CHECK(contains(k.name, "scale<float>"));
      CHECK(k.mangled_name != k.name);
      CHECK(k.grid.x == scale_cfg.grid.x);
      CHECK(k.block.x == 128);
      scale_streams.insert(k.stream_id);
    }
  }
  REQUIRE(add_streams.size() == 1);
  REQUIRE(scale_streams.size() == 1);
  CHECK(*add_streams.begin() != *scale_streams.begin());

  const TraceSummary s = trace->summary();
  CHECK(s.kernel_launches == 5);
  REQUIRE(s.kernels.size() == 2);
  std::size_t counted = 0;
  for (const auto& g : s.kernels) counted += g.count;
  CHECK(counted == 5);
  CHECK(s.busy_ns <= s.kernel_ns);
  CHECK(s.busy_ns + s.gaps.total_ns == s.span_ns);
  // Every launch went through cuLaunchKernelEx, traced with the kernel's correlation id.
  CHECK(s.launches_with_api == 5);
  CHECK(s.api_ns_per_launch > 0);
  CHECK(std::any_of(trace->api_calls.begin(), trace->api_calls.end(),
                    [](const ApiRecord& r) { return contains(r.name, "cuLaunchKernel"); }));
  CHECK(contains(trace->to_chrome_json(), "scale<float>"));
}

TEST_CASE("copies are traced, and CUPTI is released so a new Tracer can start", "[profile][gpu]") {
  REQUIRE_GPU();
  const int n = 1 << 16;
  DeviceBuffer<float> buffer(n);
  {
    Tracer tracer = start_or_fail();
    buffer.upload(std::vector<float>(n, 1.0f));
    auto trace = tracer.stop();
    REQUIRE(trace);
    REQUIRE_FALSE(trace->memcpys.empty());
    CHECK(trace->memcpys.front().kind == MemcpyKind::HostToDevice);
    CHECK(trace->memcpys.front().bytes == n * sizeof(float));
  }
  {
    // Nothing launched: an empty trace, not an error.
    Tracer tracer = start_or_fail();
    auto trace = tracer.stop();
    REQUIRE(trace);
    CHECK(trace->kernels.empty());
    CHECK(trace->summary().busy_ns == 0);
  }
  {
    // A Tracer destroyed while recording releases CUPTI too.
    Tracer dropped = start_or_fail();
  }
  Tracer last = start_or_fail();
  CHECK(last.stop());
}

TEST_CASE("CUPTI's clock reads without a GPU and moves forward", "[profile]") {
  if (!Tracer::available()) STITCHCUDA_SKIP("CUPTI is not loadable here: " + Tracer::available().error().message);
  auto first = Tracer::timestamp_ns();
  REQUIRE(first);
  auto second = Tracer::timestamp_ns();
  REQUIRE(second);
  CHECK(*first > 0);
  CHECK(*second >= *first);
}
