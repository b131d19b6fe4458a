// Metrics (CUPTI range profiler): metric names checked against a chip with the host API alone, the
// fields and classification built from metric values, clear errors without a GPU; on a GPU ([gpu]) a
// device-to-device copy that saturates DRAM and an FMA loop that saturates the SMs.
#include <algorithm>
#include <string>
#include <vector>

#include <stitchcuda/jit.hpp>
#include <stitchcuda/profile.hpp>

#include "catch_shim.hpp"
#include "gpu.hpp"

using namespace stitchcuda;
using namespace stitchcuda::profile;
using stitchcuda_test::contains;
using stitchcuda_test::DeviceBuffer;

namespace {

const char* const kCopy = R"(extern "C" __global__ void copy4(const float4* __restrict__ in, float4* __restrict__ out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i];
}
)";

// Eight independent FMA chains per thread: the FMA pipe, not latency, is the limit.
const char* const kFma = R"(extern "C" __global__ void fma_loop(float* out, int iterations) {
  float x0 = threadIdx.x * 1e-3f, x1 = x0 + 1, x2 = x0 + 2, x3 = x0 + 3, x4 = x0 + 4, x5 = x0 + 5, x6 = x0 + 6, x7 = x0 + 7;
  const float m = 0.999f, a = 1e-3f;
  for (int i = 0; i < iterations; ++i) {
    x0 = fmaf(x0, m, a); x1 = fmaf(x1, m, a); x2 = fmaf(x2, m, a); x3 = fmaf(x3, m, a);
    x4 = fmaf(x4, m, a); x5 = fmaf(x5, m, a); x6 = fmaf(x6, m, a); x7 = fmaf(x7, m, a);
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;
}
)";

jit::Kernel kernel_of(std::string_view source, std::string_view name) {
  auto module = jit::build(source);
  if (!module) FAIL("build failed: " << module.error().describe());
  auto kernel = (*module)->kernel(name);
  if (!kernel) FAIL("kernel lookup failed: " << kernel.error().describe());
  return *kernel;
}

bool cupti_loads() { return bool(Tracer::available()); }

std::vector<KernelMetrics> collect_or_fail(const std::function<void()>& workload, const MetricsOptions& options = {}) {
  auto result = Metrics::collect(workload, options);
  if (!result) FAIL("Metrics::collect failed: " << result.error().describe());
  return *result;
}

}  // namespace

TEST_CASE("the speed-of-light metric names exist on GH100 (host API, no GPU)", "[profile]") {
  if (!cupti_loads()) STITCHCUDA_SKIP("CUPTI is not loadable here: " + Tracer::available().error().message);
  auto chips = Metrics::supported_chips();
  REQUIRE(chips);
  CHECK(std::find(chips->begin(), chips->end(), "GH100") != chips->end());
  const auto names = speed_of_light_metrics();
  CHECK(names.size() == 9);
  auto ok = Metrics::validate(names, "GH100");
  if (!ok) FAIL(ok.error().describe());
  auto passes = Metrics::passes(names, "GH100");
  REQUIRE(passes);
  CHECK(*passes >= 1);
  // A subset cannot need more passes than the whole set.
  auto one = Metrics::passes({"gpu__time_duration.sum"}, "GH100");
  REQUIRE(one);
  CHECK(*one >= 1);
  CHECK(*one <= *passes);
}

TEST_CASE("an unknown metric name is an InvalidArgument that names it", "[profile]") {
  if (!cupti_loads()) STITCHCUDA_SKIP("CUPTI is not loadable here");
  auto bad = Metrics::validate({"sm__throughput.avg.pct_of_peak_sustained_elapsed", "sm__no_such_counter.sum"}, "GH100");
  REQUIRE_FALSE(bad);
  CHECK(bad.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(bad.error().message, "sm__no_such_counter.sum"));
  CHECK_FALSE(contains(bad.error().message, "sm__throughput"));
  auto passes = Metrics::passes({"dram__nothing_here.sum"}, "GH100");
  REQUIRE_FALSE(passes);
  CHECK(passes.error().code == ErrorCode::InvalidArgument);
  auto empty = Metrics::validate({}, "GH100");
  REQUIRE_FALSE(empty);
  CHECK(empty.error().code == ErrorCode::InvalidArgument);
}

TEST_CASE("a chip CUPTI does not know is Unavailable, with the reason", "[profile]") {
  if (!cupti_loads()) STITCHCUDA_SKIP("CUPTI is not loadable here");
  auto bad = Metrics::validate(speed_of_light_metrics(), "ZZ999");
  REQUIRE_FALSE(bad);
  CHECK(bad.error().code == ErrorCode::Unavailable);
  CHECK(contains(bad.error().message, "profiler unavailable"));
  CHECK(contains(bad.error().message, "ZZ999"));
}

TEST_CASE("metric values fill the named fields and the measurement classify() takes", "[profile]") {
  KernelMetrics k = make_kernel_metrics("copy4", 3,
                                        {{"sm__throughput.avg.pct_of_peak_sustained_elapsed", 21.0},
                                         {"gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", 91.0},
                                         {"gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 90.0},
                                         {"sm__warps_active.avg.pct_of_peak_sustained_active", 80.0},
                                         {"gpu__time_duration.sum", 125000.0},
                                         {"dram__bytes_read.sum", 268435456.0},
                                         {"dram__bytes_write.sum", 268435456.0},
                                         {"some__other.sum", 7.0}});
  CHECK(k.name == "copy4");
  CHECK(k.index == 3);
  CHECK(k.sm_throughput_pct == 21.0);
  CHECK(k.memory_throughput_pct == 91.0);
  CHECK(k.dram_throughput_pct == 90.0);
  CHECK(k.l1_throughput_pct == 0.0);  // not collected
  CHECK(k.achieved_occupancy_pct == 80.0);
  CHECK(k.duration_ns == 125000.0);
  CHECK(k.value("some__other.sum") == 7.0);
  CHECK_FALSE(k.value("l1tex__throughput.avg.pct_of_peak_sustained_active"));

  KernelMeasurement m = k.measurement();
  CHECK(m.name == "copy4");
  CHECK(m.duration_ns == 125000.0);
  REQUIRE(m.dram_bytes);
  CHECK(*m.dram_bytes == 536870912.0);
  REQUIRE(m.achieved_occupancy);
  CHECK(*m.achieved_occupancy == Approx(0.8));
  REQUIRE(m.sm_throughput);
  CHECK(*m.sm_throughput == Approx(0.21));
  REQUIRE(m.memory_throughput);
  CHECK(*m.memory_throughput == Approx(0.91));
  CHECK(classify(m).bound == Bound::Memory);

  // Without the occupancy or byte metrics, those stay unknown rather than 0.
  KernelMeasurement bare = make_kernel_metrics("k", 0, {{"gpu__time_duration.sum", 10.0}}).measurement();
  CHECK_FALSE(bare.dram_bytes);
  CHECK_FALSE(bare.achieved_occupancy);
  CHECK_FALSE(bare.sm_throughput);
}

TEST_CASE("measured throughputs decide between the roofs", "[profile]") {
  KernelMeasurement m;
  m.name = "fma_loop";
  m.duration_ns = 1e5;
  m.dram_bytes = 1e3;  // bytes alone would say latency-bound: the counters know better
  m.sm_throughput = 0.93;
  m.memory_throughput = 0.02;
  Finding f = classify(m);
  CHECK(f.bound == Bound::Compute);
  CHECK(f.roofline_fraction == Approx(0.93));
  REQUIRE(f.compute_fraction);
  CHECK(*f.compute_fraction == Approx(0.93));
  CHECK(f.measured);
  CHECK(contains(advise(f).front(), "compute-bound with its SMs at 93% of peak throughput"));

  m.sm_throughput = 0.10;
  m.memory_throughput = 0.12;
  CHECK(classify(m).bound == Bound::Latency);

  m.sm_throughput = 0.30;
  m.memory_throughput = 0.55;
  f = classify(m);
  CHECK(f.bound == Bound::Memory);
  CHECK(contains(advise(f).front(), "memory throughput at 55% of peak"));
  // Without the counters, the datasheet roofs and their texts apply.
  KernelMeasurement by_bytes;
  by_bytes.duration_ns = 1e6;
  by_bytes.dram_bytes = 2.0e9;  // 2 TB/s of 4.3
  Finding datasheet = classify(by_bytes);
  CHECK_FALSE(datasheet.measured);
  CHECK(contains(advise(datasheet).front(), "DRAM at 47% of peak"));

  // Gaps between launches still come first.
  m.launches = 10;
  m.gap_ns = 5e5;
  CHECK(classify(m).bound == Bound::Launch);
}

TEST_CASE("without a GPU, collecting metrics is a clear Unavailable error", "[profile]") {
  auto none = Metrics::collect(nullptr);
  REQUIRE_FALSE(none);
  CHECK(none.error().code == ErrorCode::InvalidArgument);
  if (stitchcuda_test::has_gpu()) STITCHCUDA_SKIP("a GPU is present: the rest is for machines without one");
  bool ran = false;
  auto result = Metrics::collect([&] { ran = true; });
  REQUIRE_FALSE(result);
  CHECK_FALSE(ran);
  CHECK(result.error().code == ErrorCode::Unavailable);
  CHECK(contains(result.error().message, "profiler unavailable"));
  CHECK(contains(result.error().message, "no CUDA device"));
  auto chip = Metrics::chip_name(0);
  REQUIRE_FALSE(chip);
  CHECK(chip.error().code == ErrorCode::Unavailable);
}

TEST_CASE("a device-to-device copy saturates DRAM and is memory-bound", "[profile][gpu]") {
  REQUIRE_GPU();
  const int n4 = 1 << 24;  // float4 elements: 256 MiB each way, far beyond L2
  DeviceBuffer<float> in(std::size_t(n4) * 4), out(std::size_t(n4) * 4);
  const jit::Kernel copy = kernel_of(kCopy, "copy4");
  jit::KernelArgs args;
  args.pointer(in.get()).pointer(out.get()).i32(n4);
  jit::LaunchConfig cfg;
  cfg.grid = {unsigned(n4 / 256), 1, 1};
  cfg.block = {256, 1, 1};
  REQUIRE(copy.launch(cfg, args));  // warm: module loaded, pages touched
  REQUIRE(jit::Driver::synchronize());

  auto chip = Metrics::chip_name(0);
  REQUIRE(chip);
  CHECK_FALSE(chip->empty());
  auto kernels = collect_or_fail([&] { REQUIRE(copy.launch(cfg, args)); });
  REQUIRE(kernels.size() == 1);
  const KernelMetrics& k = kernels.front();
  INFO("range '" << k.name << "': dram " << k.dram_throughput_pct << "%, mem " << k.memory_throughput_pct << "%, sm "
                 << k.sm_throughput_pct << "%, " << k.duration_ns << " ns, read " << k.dram_bytes_read << " B, written "
                 << k.dram_bytes_written << " B");
  CHECK(k.index == 0);
  CHECK(k.dram_throughput_pct > 60.0);
  CHECK(k.dram_throughput_pct <= 100.5);
  CHECK(k.duration_ns > 0.0);
  const double bytes = double(n4) * 16.0;
  CHECK(k.dram_bytes_read == Approx(bytes).epsilon(0.25));  // up to an L2 (50 MB) may stay cached between passes
  CHECK(k.dram_bytes_written == Approx(bytes).epsilon(0.25));
  Finding f = classify(k.measurement());
  CHECK(f.bound == Bound::Memory);
}

TEST_CASE("an FMA loop saturates the SMs and is compute-bound", "[profile][gpu]") {
  REQUIRE_GPU();
  auto info = jit::Driver::device(0);
  REQUIRE(info);
  const unsigned blocks = unsigned(info->multiprocessors) * 8;
  DeviceBuffer<float> out(std::size_t(blocks) * 256);
  const jit::Kernel fma = kernel_of(kFma, "fma_loop");
  jit::KernelArgs args;
  args.pointer(out.get()).i32(4096);
  jit::LaunchConfig cfg;
  cfg.grid = {blocks, 1, 1};
  cfg.block = {256, 1, 1};
  REQUIRE(fma.launch(cfg, args));
  REQUIRE(jit::Driver::synchronize());

  auto kernels = collect_or_fail([&] { REQUIRE(fma.launch(cfg, args)); });
  REQUIRE(kernels.size() == 1);
  const KernelMetrics& k = kernels.front();
  INFO("sm " << k.sm_throughput_pct << "%, mem " << k.memory_throughput_pct << "%, dram " << k.dram_throughput_pct
             << "%, occupancy " << k.achieved_occupancy_pct << "%");
  CHECK(k.sm_throughput_pct > 60.0);
  CHECK(k.dram_throughput_pct < 10.0);
  CHECK(classify(k.measurement()).bound == Bound::Compute);
}

TEST_CASE("one range per launch, in order; bad names and too many launches are errors; CUPTI is released",
          "[profile][gpu]") {
  REQUIRE_GPU();
  const int n4 = 1 << 16;
  DeviceBuffer<float> in(std::size_t(n4) * 4), out(std::size_t(n4) * 4), fout(256);
  const jit::Kernel copy = kernel_of(kCopy, "copy4");
  const jit::Kernel fma = kernel_of(kFma, "fma_loop");
  jit::KernelArgs copy_args, fma_args;
  copy_args.pointer(in.get()).pointer(out.get()).i32(n4);
  fma_args.pointer(fout.get()).i32(64);
  jit::LaunchConfig copy_cfg, fma_cfg;
  copy_cfg.grid = {unsigned(n4 / 256), 1, 1};
  copy_cfg.block = {256, 1, 1};
  fma_cfg.grid = {1, 1, 1};
  fma_cfg.block = {256, 1, 1};
  auto workload = [&] {
    REQUIRE(copy.launch(copy_cfg, copy_args));
    REQUIRE(fma.launch(fma_cfg, fma_args));
    REQUIRE(copy.launch(copy_cfg, copy_args));
  };

  MetricsOptions options;
  options.metrics = {"gpu__time_duration.sum", "dram__bytes_read.sum"};
  auto kernels = collect_or_fail(workload, options);
  REQUIRE(kernels.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    INFO("range " << i << ": '" << kernels[i].name << "'");
    CHECK(kernels[i].index == i);
    CHECK(kernels[i].duration_ns > 0.0);
    CHECK(kernels[i].values.size() == 2);
  }

  options.metrics = {"gpu__time_duration.sum", "sm__not_a_metric.sum"};
  bool ran = false;
  auto bad = Metrics::collect([&] { ran = true; }, options);
  REQUIRE_FALSE(bad);
  CHECK(bad.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(bad.error().message, "sm__not_a_metric.sum"));
  CHECK_FALSE(ran);

  options.metrics = {"gpu__time_duration.sum"};
  options.max_kernels = 2;
  auto too_many = Metrics::collect(workload, options);
  CHECK_FALSE(too_many);

  // A Tracer recording blocks the range profiler; once stopped, both work again.
  {
    auto tracer = Tracer::start();
    REQUIRE(tracer);
    auto blocked = Metrics::collect(workload);
    REQUIRE_FALSE(blocked);
    CHECK(blocked.error().code == ErrorCode::Unavailable);
    CHECK(contains(blocked.error().message, "Tracer is recording"));
    REQUIRE(tracer->stop());
  }
  options.max_kernels = 16;
  CHECK(collect_or_fail(workload, options).size() == 3);
  auto tracer = Tracer::start();
  REQUIRE(tracer);
  REQUIRE(tracer->stop());
}
