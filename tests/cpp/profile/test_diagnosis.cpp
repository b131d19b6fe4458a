// Roofline classification and advice: one constructed case per class, with the exact class, the
// numbers behind it and the key phrases of the text the Coder reads.
#include <string>
#include <vector>

#include <stitchcuda/profile.hpp>

#include "catch_shim.hpp"

using namespace stitchcuda::profile;
using stitchcuda_test::contains;

namespace {

bool any_contains(const std::vector<std::string>& texts, std::string_view phrase) {
  for (const auto& t : texts)
    if (contains(t, phrase)) return true;
  return false;
}

std::string joined(const std::vector<std::string>& texts) {
  std::string out;
  for (const auto& t : texts) out += t + "\n";
  return out;
}

// H200: 4.3 TB/s moves 4.3 GB in exactly 1 ms; 67 TFLOP/s does 67 GFLOP in 1 ms.
constexpr double kOneMs = 1e6;

}  // namespace

TEST_CASE("the default ceilings are the H200's", "[profile]") {
  const DeviceCeilings c = DeviceCeilings::h200();
  CHECK(c.dram_bytes_per_s == Approx(4.3e12));
  CHECK(c.bf16_tensor_flops_per_s == Approx(790e12));
  CHECK(c.fp32_flops_per_s == Approx(67e12));
  CHECK(c.launch_overhead_ns > 0);
}

TEST_CASE("the hardware table knows the data-centre GPUs by the names their drivers report", "[profile]") {
  const auto h200 = DeviceCeilings::for_device("NVIDIA H200");
  REQUIRE(h200);
  CHECK(h200->dram_bytes_per_s == Approx(4.3e12));
  CHECK(h200->name == "NVIDIA H200");
  const auto sxm = DeviceCeilings::for_device("NVIDIA H100 80GB HBM3");
  const auto pcie = DeviceCeilings::for_device("NVIDIA H100 PCIe");
  REQUIRE(sxm);
  REQUIRE(pcie);
  CHECK(sxm->tf32_tensor_flops_per_s > 4 * sxm->fp32_flops_per_s);  // what makes tf32x3 worth planning
  CHECK(pcie->dram_bytes_per_s < sxm->dram_bytes_per_s);             // the more specific row wins
  const auto a100 = DeviceCeilings::for_device("NVIDIA A100-SXM4-80GB");
  const auto a100_40 = DeviceCeilings::for_device("NVIDIA A100-SXM4-40GB");
  REQUIRE(a100);
  REQUIRE(a100_40);
  CHECK(a100->dram_bytes_per_s > a100_40->dram_bytes_per_s);
  CHECK_FALSE(DeviceCeilings::for_device("NVIDIA GeForce GTX 1080"));  // unknown: no guess
}

TEST_CASE("a copy near DRAM peak is memory-bound at the roof", "[profile]") {
  KernelMeasurement m;
  m.name = "copy";
  m.duration_ns = 1.1 * kOneMs;
  m.dram_bytes = 4.3e9;
  m.flops = 1e9;
  const Finding f = classify(m);
  CHECK(f.bound == Bound::Memory);
  CHECK(f.sol_ns == Approx(kOneMs));
  REQUIRE(f.memory_fraction);
  CHECK(*f.memory_fraction == Approx(1.0 / 1.1));
  CHECK(f.roofline_fraction == Approx(1.0 / 1.1));
  REQUIRE(f.arithmetic_intensity);
  CHECK(*f.arithmetic_intensity == Approx(1e9 / 4.3e9));
  CHECK(f.ridge_intensity == Approx(67e12 / 4.3e12));
  const auto texts = advise(f);
  INFO(joined(texts));
  CHECK(any_contains(texts, "memory-bound at 91% of DRAM peak"));
  CHECK(any_contains(texts, "move fewer bytes"));
}

TEST_CASE("a memory-side kernel at 31% of DRAM peak is told to vectorise", "[profile]") {
  KernelMeasurement m;
  m.name = "layernorm";
  m.dram_bytes = 4.3e9;
  m.duration_ns = kOneMs / 0.31;
  const Finding f = classify(m);
  CHECK(f.bound == Bound::Memory);
  CHECK(f.roofline_fraction == Approx(0.31));
  CHECK_FALSE(f.compute_fraction);
  const auto texts = advise(f);
  INFO(joined(texts));
  CHECK(any_contains(texts, "DRAM at 31% of peak"));
  CHECK(any_contains(texts, "16-byte vector loads"));
  CHECK(any_contains(texts, "coalescing"));
  CHECK(any_contains(texts, "speed of light 1.00 ms"));
}

TEST_CASE("an FMA-heavy kernel is compute-bound; bf16 is judged against the tensor ceiling", "[profile]") {
  KernelMeasurement fp32;
  fp32.name = "fma";
  fp32.flops = 67e9;
  fp32.dram_bytes = 4.3e6;  // 1 us of traffic against 1 ms of math
  fp32.duration_ns = 1.2 * kOneMs;
  const Finding at_roof = classify(fp32);
  CHECK(at_roof.bound == Bound::Compute);
  CHECK(at_roof.roofline_fraction == Approx(1.0 / 1.2));
  CHECK(any_contains(advise(at_roof), "compute-bound at 83% of peak FLOP/s"));

  KernelMeasurement gemm;
  gemm.name = "gemm";
  gemm.unit = MathUnit::Bf16Tensor;
  gemm.flops = 790e9;
  gemm.dram_bytes = 4.3e8;
  gemm.duration_ns = 2 * kOneMs;
  const Finding half = classify(gemm);
  CHECK(half.bound == Bound::Compute);
  CHECK(half.sol_ns == Approx(kOneMs));
  REQUIRE(half.compute_fraction);
  CHECK(*half.compute_fraction == Approx(0.5));
  const auto texts = advise(half);
  INFO(joined(texts));
  CHECK(any_contains(texts, "math at 50% of peak FLOP/s"));
  CHECK(any_contains(texts, "tensor cores"));

  // The same FLOPs counted as fp32 would be impossible (11.8x the fp32 peak): the unit matters.
  gemm.unit = MathUnit::Fp32;
  CHECK(classify(gemm).roofline_fraction == Approx(790.0 / 67.0 / 2.0));
}

TEST_CASE("far below both roofs with low occupancy is latency-bound", "[profile]") {
  KernelMeasurement m;
  m.name = "gather";
  m.dram_bytes = 4.3e6;  // 1 us at peak
  m.duration_ns = 10'000;
  m.achieved_occupancy = 0.12;
  const Finding f = classify(m);
  CHECK(f.bound == Bound::Latency);
  CHECK(f.roofline_fraction == Approx(0.1));
  const auto texts = advise(f);
  INFO(joined(texts));
  CHECK(any_contains(texts, "reaches 10% of its roofline"));
  CHECK(any_contains(texts, "achieved occupancy 12%"));
  CHECK(any_contains(texts, "fewer registers"));
}

TEST_CASE("gaps between many launches make a workload launch-bound", "[profile]") {
  KernelMeasurement m;
  m.name = "model";
  m.launches = 212;
  m.duration_ns = 32'000;
  m.gap_ns = 68'000;
  m.dram_bytes = 4.3e7;  // would be memory-bound at the roof if gaps did not dominate
  const Finding f = classify(m);
  CHECK(f.bound == Bound::Launch);
  CHECK(f.gap_share == Approx(0.68));
  const auto texts = advise(f);
  INFO(joined(texts));
  REQUIRE_FALSE(texts.empty());
  CHECK(texts.front() == "68% of the time is gaps between 212 launches: fuse kernels or capture a CUDA graph");

  // One launch cannot be launch-bound, whatever idle time surrounds it.
  m.launches = 1;
  CHECK(classify(m).bound != Bound::Launch);
  // Below the threshold the kernel's own limiter shows.
  m.launches = 212;
  m.gap_ns = 10'000;
  CHECK(classify(m).bound == Bound::Memory);
}

TEST_CASE("without FLOPs or bytes a kernel is unknown, and the advice says what to measure", "[profile]") {
  KernelMeasurement m;
  m.name = "mystery";
  m.duration_ns = 5'000;
  const Finding f = classify(m);
  CHECK(f.bound == Bound::Unknown);
  CHECK(f.sol_ns == 0.0);
  CHECK(f.roofline_fraction == 0.0);
  CHECK(any_contains(advise(f), "measure its DRAM bytes or count its FLOPs"));
  CHECK(std::string(to_string(f.bound)) == "unknown");
  CHECK(std::string(to_string(Bound::Latency)) == "latency");
}

TEST_CASE("overridden ceilings and rules change the verdict", "[profile]") {
  KernelMeasurement m;
  m.dram_bytes = 4.3e9;
  m.duration_ns = kOneMs / 0.5;  // 50% of an H200
  CHECK(classify(m).bound == Bound::Memory);

  DeviceCeilings slow;
  slow.dram_bytes_per_s = 2.15e12;  // a GPU with half the bandwidth: the same kernel is at its roof
  CHECK(classify(m, slow).roofline_fraction == Approx(1.0));

  DiagnosisRules strict;
  strict.latency_below = 0.6;
  CHECK(classify(m, {}, strict).bound == Bound::Latency);
}

TEST_CASE("nonsense measurements give a verdict, never a crash", "[profile]") {
  KernelMeasurement zero;
  zero.flops = 0.0;
  zero.dram_bytes = 0.0;
  zero.duration_ns = 1000;
  CHECK(classify(zero).bound == Bound::Latency);  // nothing to do, yet it took time

  KernelMeasurement negative;
  negative.dram_bytes = 1e6;
  negative.duration_ns = -5;
  negative.gap_ns = -10;
  const Finding f = classify(negative);
  CHECK(f.bound == Bound::Unknown);
  CHECK(f.gap_share == 0.0);

  DiagnosisRules never_latency;
  never_latency.latency_below = 0.0;
  KernelMeasurement flops_only;
  flops_only.flops = 0.0;
  flops_only.duration_ns = 1000;
  const Finding odd = classify(flops_only, {}, never_latency);
  CHECK_FALSE(advise(odd, never_latency).empty());
}

TEST_CASE("a trace becomes one workload measurement and trace-level advice", "[profile]") {
  Trace t;
  for (int i = 0; i < 10; ++i) {
    KernelRecord k;
    k.name = i < 8 ? "small" : "big";
    k.start_ns = 1000 + std::uint64_t(i) * 10'000;
    k.end_ns = k.start_ns + (i < 8 ? 500 : 3000);
    k.correlation_id = std::uint32_t(i + 1);
    t.kernels.push_back(k);
    ApiRecord a;
    a.name = "cuLaunchKernelEx";
    a.correlation_id = k.correlation_id;
    a.start_ns = k.start_ns - 900;
    a.end_ns = a.start_ns + 4000;  // longer than every kernel: the host cannot keep up
    t.api_calls.push_back(a);
  }
  const TraceSummary s = t.summary();
  const KernelMeasurement m = KernelMeasurement::from(s, "step");
  CHECK(m.launches == 10);
  CHECK(m.duration_ns == Approx(8 * 500 + 2 * 3000));
  CHECK(m.gap_ns == Approx(double(s.span_ns) - (8 * 500 + 2 * 3000)));
  CHECK(classify(m).bound == Bound::Launch);

  const auto texts = advise(s);
  INFO(joined(texts));
  CHECK(any_contains(texts, "of the time is gaps between 10 launches"));
  CHECK(any_contains(texts, "big takes 60% of kernel time"));
  CHECK(any_contains(texts, "each launch call costs 4.00 us of host time"));
  CHECK(any_contains(advise(Trace{}.summary()), "nothing ran on the GPU"));
}
