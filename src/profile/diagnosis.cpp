// Roofline placement and bottleneck classification, and the short advice texts built from them.
// Pure logic over numbers: every rule is exercised on machines without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include <stitchcuda/profile.hpp>

namespace stitchcuda::profile {
namespace {

std::string percent(double fraction) { return std::to_string(static_cast<long>(std::lround(fraction * 100.0))) + "%"; }

// "1.25 us", "3.40 ms": enough precision for a sentence.
std::string duration_text(double ns) {
  char buf[48];
  if (ns >= 1e6)
    std::snprintf(buf, sizeof(buf), "%.2f ms", ns / 1e6);
  else if (ns >= 1e3)
    std::snprintf(buf, sizeof(buf), "%.2f us", ns / 1e3);
  else
    std::snprintf(buf, sizeof(buf), "%.0f ns", ns);
  return buf;
}

std::string label(const std::string& name) { return name.empty() ? std::string("the kernel") : name; }

}  // namespace

std::optional<DeviceCeilings> DeviceCeilings::for_device(std::string_view device_name) {
  // Matched by model name inside the driver's longer names ("NVIDIA H200", "NVIDIA H100 80GB HBM3",
  // "NVIDIA A100-SXM4-80GB"), the most specific first. The H200's row is measured (docs/profile.md);
  // the others are datasheet peaks: dense tensor-core rates, the memory's rated bandwidth.
  struct Row {
    std::string_view model, also;  // both must appear in the name ("" matches any)
    double fp32, tf32, bf16, dram;  // TFLOP/s, TB/s
  };
  static constexpr Row kRows[] = {
      {"H100", "PCIe", 51.2, 378.0, 756.0, 2.0},
      {"H100", "NVL", 60.0, 417.5, 835.0, 3.9},
      {"H100", "", 67.0, 494.7, 989.4, 3.35},  // SXM5 (80GB HBM3)
      {"A100", "SXM4-80GB", 19.5, 156.0, 312.0, 2.039},
      {"A100", "80GB", 19.5, 156.0, 312.0, 1.935},  // 80GB PCIe
      {"A100", "", 19.5, 156.0, 312.0, 1.555},      // 40GB, SXM4 and PCIe
      {"L40S", "", 91.6, 183.0, 362.1, 0.864},
  };
  if (device_name.find("H200") != std::string_view::npos) {  // and GH200, the same memory and SMs
    DeviceCeilings c = h200();
    c.name = std::string(device_name);
    return c;
  }
  for (const Row& row : kRows) {
    if (device_name.find(row.model) == std::string_view::npos || device_name.find(row.also) == std::string_view::npos)
      continue;
    DeviceCeilings c;
    c.name = std::string(device_name);
    c.fp32_flops_per_s = row.fp32 * 1e12;
    c.tf32_tensor_flops_per_s = row.tf32 * 1e12;
    c.bf16_tensor_flops_per_s = row.bf16 * 1e12;
    c.dram_bytes_per_s = row.dram * 1e12;
    return c;
  }
  return std::nullopt;
}

const char* to_string(Bound bound) noexcept {
  switch (bound) {
    case Bound::Memory: return "memory";
    case Bound::Compute: return "compute";
    case Bound::Latency: return "latency";
    case Bound::Launch: return "launch";
    case Bound::Unknown: break;
  }
  return "unknown";
}

KernelMeasurement KernelMeasurement::from(const TraceSummary& summary, std::string name) {
  KernelMeasurement m;
  m.name = std::move(name);
  m.duration_ns = double(summary.busy_ns);
  m.launches = summary.kernel_launches + summary.memcpy_count + summary.memset_count;
  m.gap_ns = double(summary.gaps.total_ns);
  return m;
}

Finding classify(const KernelMeasurement& m, const DeviceCeilings& ceilings, const DiagnosisRules& rules) {
  Finding f;
  f.name = m.name;
  f.duration_ns = m.duration_ns;
  f.launches = m.launches;
  f.achieved_occupancy = m.achieved_occupancy;
  const double peak_flops = m.unit == MathUnit::Bf16Tensor ? ceilings.bf16_tensor_flops_per_s : ceilings.fp32_flops_per_s;
  f.ridge_intensity = ceilings.dram_bytes_per_s > 0 ? peak_flops / ceilings.dram_bytes_per_s : 0.0;
  const double wall_ns = m.duration_ns + std::max(0.0, m.gap_ns);
  f.gap_share = wall_ns > 0 ? std::max(0.0, m.gap_ns) / wall_ns : 0.0;

  // Speed of light: the time the kernel would take at the ceiling of whichever unit it needs most.
  double compute_ns = 0.0, memory_ns = 0.0;
  if (m.flops && peak_flops > 0) compute_ns = *m.flops / peak_flops * 1e9;
  if (m.dram_bytes && ceilings.dram_bytes_per_s > 0) memory_ns = *m.dram_bytes / ceilings.dram_bytes_per_s * 1e9;
  f.sol_ns = std::max(compute_ns, memory_ns);
  if (m.duration_ns > 0) {
    if (m.flops) f.compute_fraction = compute_ns / m.duration_ns;
    if (m.dram_bytes) f.memory_fraction = memory_ns / m.duration_ns;
    f.roofline_fraction = f.sol_ns / m.duration_ns;
  }
  if (m.flops && m.dram_bytes && *m.dram_bytes > 0) f.arithmetic_intensity = *m.flops / *m.dram_bytes;

  // Measured throughputs (the range profiler's SM and memory %) are against the device's real peaks,
  // so when both are known they decide between the roofs instead of the datasheet ceilings.
  const bool measured = m.sm_throughput && m.memory_throughput && m.duration_ns > 0;
  f.measured = measured;
  if (measured) {
    f.compute_fraction = *m.sm_throughput;
    f.memory_fraction = *m.memory_throughput;
    f.roofline_fraction = std::max(*m.sm_throughput, *m.memory_throughput);
  }

  // Order matters: idle time between launches hides every other limiter, so it is judged first.
  if (m.launches > 1 && f.gap_share >= rules.launch_gap_share) {
    f.bound = Bound::Launch;
  } else if (measured) {
    if (f.roofline_fraction < rules.latency_below)
      f.bound = Bound::Latency;
    else
      f.bound = *m.sm_throughput >= *m.memory_throughput ? Bound::Compute : Bound::Memory;
  } else if (m.duration_ns <= 0 || (!m.flops && !m.dram_bytes)) {
    f.bound = Bound::Unknown;
  } else if (f.roofline_fraction < rules.latency_below) {
    // Far below both roofs: the units wait (dependent loads, too few warps, synchronisation).
    f.bound = Bound::Latency;
  } else {
    f.bound = compute_ns >= memory_ns ? Bound::Compute : Bound::Memory;
  }
  return f;
}

std::vector<std::string> advise(const Finding& f, const DiagnosisRules& rules) {
  std::vector<std::string> out;
  const std::string who = label(f.name);
  const bool low_occupancy = f.achieved_occupancy && *f.achieved_occupancy < rules.low_occupancy;
  switch (f.bound) {
    case Bound::Launch:
      out.push_back(percent(f.gap_share) + " of the time is gaps between " + std::to_string(f.launches) +
                    " launches: fuse kernels or capture a CUDA graph");
      break;
    case Bound::Memory:
      if (f.measured) {
        // Measured memory throughput covers L1, L2 and DRAM: name the unit by what was measured.
        if (f.roofline_fraction >= rules.near_roof)
          out.push_back(who + " is memory-bound at " + percent(f.memory_fraction.value_or(0.0)) +
                        " of peak memory throughput: move fewer bytes (fuse with neighbours, keep data in "
                        "shared memory or registers, use a narrower type)");
        else
          out.push_back("memory throughput at " + percent(f.memory_fraction.value_or(0.0)) + " of peak in " + who +
                        ": use 16-byte vector loads, check coalescing and shared-memory bank conflicts");
      } else if (f.roofline_fraction >= rules.near_roof)
        out.push_back(who + " is memory-bound at " + percent(f.memory_fraction.value_or(0.0)) +
                      " of DRAM peak: move fewer bytes (fuse with neighbours, keep data in shared memory, "
                      "use a narrower type)");
      else
        out.push_back("DRAM at " + percent(f.memory_fraction.value_or(0.0)) + " of peak in " + who +
                      ": use 16-byte vector loads and check coalescing");
      break;
    case Bound::Compute:
      if (f.measured) {
        // SM throughput is the busiest SM pipe (FMA, ALU, tensor, load/store issue), not FLOP/s alone.
        if (f.roofline_fraction >= rules.near_roof)
          out.push_back(who + " is compute-bound with its SMs at " + percent(f.compute_fraction.value_or(0.0)) +
                        " of peak throughput: do less work per element (algebraic simplification, fewer "
                        "instructions) or use lower-precision tensor cores");
        else
          out.push_back("SMs at " + percent(f.compute_fraction.value_or(0.0)) + " of peak throughput in " + who +
                        ": use tensor cores (wgmma/mma), tile through shared memory and raise ILP");
      } else if (f.roofline_fraction >= rules.near_roof)
        out.push_back(who + " is compute-bound at " + percent(f.compute_fraction.value_or(0.0)) +
                      " of peak FLOP/s: do less math (algebraic simplification) or use lower-precision tensor cores");
      else
        out.push_back("math at " + percent(f.compute_fraction.value_or(0.0)) + " of peak FLOP/s in " + who +
                      ": use tensor cores (wgmma/mma), tile through shared memory and raise ILP");
      break;
    case Bound::Latency:
      out.push_back(who + " reaches " + percent(f.roofline_fraction) +
                    " of its roofline: it waits on latency; hide it with more parallel work per SM "
                    "(more blocks, asynchronous copies, fewer dependent loads)");
      break;
    case Bound::Unknown:
      out.push_back(who + " cannot be placed on the roofline: measure its DRAM bytes or count its FLOPs");
      break;
  }
  if (low_occupancy && f.bound != Bound::Launch)
    out.push_back("achieved occupancy " + percent(*f.achieved_occupancy) +
                  ": fewer registers or less shared memory per block, or more blocks");
  if (f.sol_ns > 0 && f.duration_ns > f.sol_ns && f.bound != Bound::Launch)
    out.push_back("speed of light " + duration_text(f.sol_ns) + " vs measured " + duration_text(f.duration_ns));
  return out;
}

std::vector<std::string> advise(const TraceSummary& s, const DeviceCeilings& ceilings, const DiagnosisRules& rules) {
  std::vector<std::string> out;
  const std::size_t activities = s.kernel_launches + s.memcpy_count + s.memset_count;
  if (activities == 0) {
    out.push_back("nothing ran on the GPU inside the trace");
    return out;
  }
  if (activities > 1 && s.gap_fraction() >= rules.launch_gap_share)
    out.push_back(percent(s.gap_fraction()) + " of the time is gaps between " + std::to_string(activities) +
                  " launches: fuse kernels or capture a CUDA graph");
  if (!s.kernels.empty() && s.kernels.size() > 1 && s.kernels.front().share >= 0.5)
    out.push_back(s.kernels.front().name + " takes " + percent(s.kernels.front().share) +
                  " of kernel time: optimise it first");
  if (s.kernel_launches > 0 && s.launches_with_api > 0) {
    const double mean_kernel_ns = double(s.kernel_ns) / double(s.kernel_launches);
    if (s.api_ns_per_launch > mean_kernel_ns)
      out.push_back("each launch call costs " + duration_text(s.api_ns_per_launch) + " of host time, more than the " +
                    duration_text(mean_kernel_ns) + " a kernel runs: the host cannot keep the GPU fed; "
                    "capture a CUDA graph or fuse kernels");
  } else if (s.kernel_launches > 0) {
    const double mean_kernel_ns = double(s.kernel_ns) / double(s.kernel_launches);
    if (mean_kernel_ns < ceilings.launch_overhead_ns && s.kernel_launches > 1)
      out.push_back("kernels run " + duration_text(mean_kernel_ns) + " on average, below the " +
                    duration_text(ceilings.launch_overhead_ns) + " a launch costs: fuse them or capture a CUDA graph");
  }
  return out;
}

}  // namespace stitchcuda::profile
