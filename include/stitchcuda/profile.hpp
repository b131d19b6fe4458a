// stitchcuda::profile — what ran on the GPU (CUPTI activity trace), summaries of it, and a roofline
// diagnosis the agents can act on. No CUDA or CUPTI header is included: CUPTI is loaded at run time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <stitchcuda/error.hpp>
#include <stitchcuda/jit.hpp>

namespace stitchcuda::profile {

/// One kernel execution on the GPU.
struct KernelRecord {
  std::string name;                     ///< demangled name ("scale<float>(float*, int)"), else the symbol
  std::string mangled_name;             ///< the symbol as the driver saw it
  std::uint64_t start_ns = 0;           ///< GPU start timestamp
  std::uint64_t end_ns = 0;             ///< GPU end timestamp
  jit::Dim3 grid;                       ///< blocks
  jit::Dim3 block;                      ///< threads per block
  int registers_per_thread = 0;         ///< registers each thread holds
  int static_shared_bytes = 0;          ///< __shared__ arrays per block
  int dynamic_shared_bytes = 0;         ///< dynamic shared memory per block
  std::uint32_t local_bytes_per_thread = 0;  ///< local memory (spills, stack) per thread
  std::uint32_t stream_id = 0;          ///< CUPTI's stream id
  std::uint32_t correlation_id = 0;     ///< matches the ApiRecord of the launch call
  std::uint32_t graph_id = 0;           ///< CUDA graph that launched it (0: none)
  int device = 0;                       ///< device ordinal
  /// end - start, or 0 when the timestamps are missing or reversed.
  std::uint64_t duration_ns() const { return end_ns > start_ns ? end_ns - start_ns : 0; }
};

/// Direction of a memory copy.
enum class MemcpyKind { Unknown, HostToDevice, DeviceToHost, DeviceToDevice, HostToHost, PeerToPeer, Array };

/// "HtoD", "DtoH", "DtoD", "HtoH", "PtoP", "Array" or "Unknown".
const char* to_string(MemcpyKind kind) noexcept;

/// One memory copy on the GPU.
struct MemcpyRecord {
  MemcpyKind kind = MemcpyKind::Unknown;  ///< direction
  std::uint64_t bytes = 0;                ///< bytes copied
  std::uint64_t start_ns = 0;             ///< GPU start timestamp
  std::uint64_t end_ns = 0;               ///< GPU end timestamp
  std::uint32_t stream_id = 0;            ///< CUPTI's stream id
  std::uint32_t correlation_id = 0;       ///< matches the ApiRecord of the copy call
  std::uint32_t graph_id = 0;             ///< CUDA graph that ran it (0: none)
  int device = 0;                         ///< device ordinal
  /// end - start, or 0 when the timestamps are missing or reversed.
  std::uint64_t duration_ns() const { return end_ns > start_ns ? end_ns - start_ns : 0; }
};

/// One memset on the GPU.
struct MemsetRecord {
  std::uint64_t bytes = 0;                ///< bytes set
  std::uint32_t value = 0;                ///< value written
  std::uint64_t start_ns = 0;             ///< GPU start timestamp
  std::uint64_t end_ns = 0;               ///< GPU end timestamp
  std::uint32_t stream_id = 0;            ///< CUPTI's stream id
  std::uint32_t correlation_id = 0;       ///< matches the ApiRecord of the memset call
  std::uint32_t graph_id = 0;             ///< CUDA graph that ran it (0: none)
  int device = 0;                         ///< device ordinal
  /// end - start, or 0 when the timestamps are missing or reversed.
  std::uint64_t duration_ns() const { return end_ns > start_ns ? end_ns - start_ns : 0; }
};

/// Which CUDA API a host call belongs to.
enum class ApiDomain { Runtime, Driver };

/// One CUDA runtime or driver call on a host thread.
struct ApiRecord {
  std::string name;                   ///< "cuLaunchKernelEx", "cudaMemcpyAsync", ...
  ApiDomain domain = ApiDomain::Driver;  ///< runtime or driver
  std::uint64_t start_ns = 0;         ///< host timestamp (same clock as the GPU records)
  std::uint64_t end_ns = 0;           ///< host timestamp
  std::uint32_t correlation_id = 0;   ///< matches the GPU work it enqueued
  std::uint32_t thread_id = 0;        ///< host thread
  std::uint32_t process_id = 0;       ///< host process
  /// end - start, or 0 when the timestamps are missing or reversed.
  std::uint64_t duration_ns() const { return end_ns > start_ns ? end_ns - start_ns : 0; }
};

/// Idle periods of the GPU between consecutive activities (no kernel, copy or memset running).
struct IdleGaps {
  std::uint64_t total_ns = 0;    ///< sum of the gaps
  std::size_t count = 0;         ///< number of gaps
  std::uint64_t largest_ns = 0;  ///< the longest one
};

/// Launches of kernels sharing one (demangled) name.
struct KernelGroup {
  std::string name;          ///< demangled name
  std::size_t count = 0;     ///< launches
  std::uint64_t total_ns = 0;  ///< summed durations
  double mean_ns = 0.0;      ///< total / count
  std::uint64_t min_ns = 0;  ///< shortest launch
  std::uint64_t max_ns = 0;  ///< longest launch
  double share = 0.0;        ///< total / all kernels' summed durations (groups add up to 1)
};

/// Numbers derived from a Trace's records; a pure function of them.
/// Records with no duration (missing or zero-length timestamps) count as launches but take no time.
struct TraceSummary {
  std::uint64_t span_ns = 0;          ///< first GPU start to last GPU end
  std::uint64_t busy_ns = 0;          ///< union of kernel, memcpy and memset intervals
  IdleGaps gaps;                      ///< span - busy, split at each idle period
  std::size_t kernel_launches = 0;    ///< kernel records
  std::size_t memcpy_count = 0;       ///< memcpy records
  std::size_t memset_count = 0;       ///< memset records
  std::uint64_t kernel_ns = 0;        ///< summed kernel durations (overlap counted twice)
  std::vector<KernelGroup> kernels;   ///< per name, longest total first (ties: by name)
  std::size_t launches_with_api = 0;  ///< GPU activities whose launch call was traced
  std::uint64_t launch_api_ns = 0;    ///< host time in those calls (outermost call per correlation id)
  double api_ns_per_launch = 0.0;     ///< launch_api_ns / launches_with_api
  /// busy / span (0 for an empty trace).
  double busy_fraction() const { return span_ns ? double(busy_ns) / double(span_ns) : 0.0; }
  /// gaps / span (0 for an empty trace).
  double gap_fraction() const { return span_ns ? double(gaps.total_ns) / double(span_ns) : 0.0; }
};

/// Everything one Tracer scope recorded.
struct Trace {
  std::vector<KernelRecord> kernels;  ///< kernel executions, in completion order
  std::vector<MemcpyRecord> memcpys;  ///< memory copies
  std::vector<MemsetRecord> memsets;  ///< memsets
  std::vector<ApiRecord> api_calls;   ///< host CUDA calls
  std::uint64_t dropped_records = 0;  ///< records CUPTI lost (buffers full); non-zero makes summaries partial

  /// Busy time, gaps, launches, per-kernel aggregates, host time per launch.
  TraceSummary summary() const;
  /// Chrome / Perfetto trace-event JSON: one "X" event per record; GPU streams and host threads as
  /// tracks; a flow arrow from each launch call to the GPU work with its correlation id.
  std::string to_chrome_json() const;
};

/// What the Tracer records.
struct TracerOptions {
  bool kernels = true;              ///< concurrent kernel records
  bool memory = true;               ///< memcpy and memset records
  bool api_calls = true;            ///< runtime and driver calls that launch, copy, set or synchronize
  bool all_api_calls = false;       ///< every runtime and driver call (cudaGetDevice too): slower tracing
  /// start() launches one empty kernel on a private stream and waits for it, so that CUPTI's per-scope
  /// set-up of kernel timing is not charged to the traced work; its records are dropped (and with them
  /// anything another thread began before start() returned).
  bool warm_up = true;
  std::size_t buffer_bytes = 8u << 20;  ///< size of each activity buffer handed to CUPTI
};

/// Records GPU activity through CUPTI between start() and stop(); one per process at a time.
/// Destroying an active Tracer stops it and discards its records.
class Tracer {
 public:
  /// Begins recording. Unavailable (why, and how to fix) without a GPU or CUPTI, without permission,
  /// when another CUPTI client (torch.profiler, Nsight) is attached, or while another Tracer records.
  static Result<Tracer> start(const TracerOptions& options = {});
  /// Whether libcupti.so.13 can be loaded here (does not attach to anything).
  static Result<void> available();
  /// Where CUPTI was loaded from, or Unavailable.
  static Result<std::string> cupti_path();
  /// CUPTI's clock now (ns): the clock of ApiRecord and GPU timestamps, to place host events on a trace.
  static Result<std::uint64_t> timestamp_ns();

  /// Synchronizes the device, flushes CUPTI, releases it, and returns what was recorded.
  /// A second call is an InvalidArgument error.
  Result<Trace> stop();
  /// Whether this Tracer is still recording.
  bool active() const { return active_; }

  Tracer(Tracer&& other) noexcept;
  Tracer& operator=(Tracer&& other) noexcept;
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;
  ~Tracer();

 private:
  Tracer() = default;
  bool active_ = false;
};

// ---- roofline and diagnosis ----

/// The ceilings a kernel is measured against. This is StitchCUDA's one description of a GPU's peaks:
/// the roofline here, the Verifier's speed-of-light bound and the Planner's prompt (Python's
/// stitchcuda.verify.hardware) all read these numbers, so they cannot disagree.
struct DeviceCeilings {
  std::string name = "NVIDIA H200";          ///< what these numbers describe
  double fp32_flops_per_s = 67e12;           ///< FP32 without tensor cores (datasheet)
  double bf16_tensor_flops_per_s = 790e12;   ///< measured bf16 GEMM
  double dram_bytes_per_s = 4.3e12;          ///< measured device-to-device copy
  double launch_overhead_ns = 2000.0;        ///< typical host cost of one kernel launch
  double tf32_tensor_flops_per_s = 495e12;   ///< dense TF32 tensor cores (datasheet)
  /// The H200's numbers (measured: docs/profile.md).
  static DeviceCeilings h200() { return {}; }
  /// The table's entry for a device name as the driver reports it ("NVIDIA H200"; matched by the model
  /// name inside it), or nullopt for a GPU the table does not know: peaks are measured or read from a
  /// datasheet, never guessed.
  static std::optional<DeviceCeilings> for_device(std::string_view device_name);
};

/// Which math units a kernel's FLOPs run on.
enum class MathUnit { Fp32, Bf16Tensor };

/// What is known about a kernel (or a run of launches of it); unknown values stay empty.
struct KernelMeasurement {
  std::string name;                        ///< kernel or workload name, for the texts
  double duration_ns = 0.0;                ///< GPU time, summed over launches
  std::optional<double> flops;             ///< floating-point operations done
  std::optional<double> dram_bytes;        ///< bytes read from and written to DRAM
  std::optional<double> achieved_occupancy;  ///< 0..1 of the device's maximum warps
  MathUnit unit = MathUnit::Fp32;          ///< which FLOP ceiling applies
  std::size_t launches = 1;                ///< launches (kernels, copies, memsets) in duration_ns
  double gap_ns = 0.0;                     ///< GPU idle time between those launches
  std::optional<double> sm_throughput;     ///< measured SM throughput, 0..1 of peak (Metrics)
  std::optional<double> memory_throughput; ///< measured memory throughput, 0..1 of peak (Metrics)

  /// The whole GPU timeline of a trace as one workload (busy time, gaps, launches).
  static KernelMeasurement from(const TraceSummary& summary, std::string name = "trace");
};

/// What limits a kernel.
enum class Bound { Memory, Compute, Latency, Launch, Unknown };

/// "memory", "compute", "latency", "launch" or "unknown".
const char* to_string(Bound bound) noexcept;

/// Thresholds of the classification; the defaults are documented in docs/profile.md.
struct DiagnosisRules {
  double launch_gap_share = 0.5;   ///< idle share of the wall time at or above which a run is launch-bound
  double latency_below = 0.25;     ///< roofline fraction below which neither roof limits (latency/occupancy)
  double near_roof = 0.8;          ///< roofline fraction counted as at the roof
  double low_occupancy = 0.25;     ///< achieved occupancy counted as low
};

/// A kernel placed on the roofline, with the numbers that justify the class.
struct Finding {
  std::string name;                ///< from the measurement
  Bound bound = Bound::Unknown;    ///< the limiter
  double roofline_fraction = 0.0;  ///< speed-of-light time / duration (0 when unknown)
  double sol_ns = 0.0;             ///< max(flops / peak, bytes / bandwidth); 0 when neither is known
  double duration_ns = 0.0;        ///< measured GPU time
  std::optional<double> compute_fraction;  ///< achieved FLOP/s / peak (measured: SM throughput)
  std::optional<double> memory_fraction;   ///< achieved DRAM bytes/s / peak (measured: memory throughput)
  std::optional<double> arithmetic_intensity;  ///< flops / DRAM byte
  double ridge_intensity = 0.0;    ///< peak FLOP/s / bandwidth: above it a kernel can be compute-bound
  std::optional<double> achieved_occupancy;  ///< from the measurement
  std::size_t launches = 0;        ///< from the measurement
  double gap_share = 0.0;          ///< gaps / (duration + gaps)
  bool measured = false;           ///< the class comes from measured SM / memory throughput (Metrics)
};

/// Places a measurement on the roofline and names its limiter (rules in docs/profile.md). Measured
/// throughputs (sm_throughput and memory_throughput), when both are set, decide between the roofs.
Finding classify(const KernelMeasurement& measurement, const DeviceCeilings& ceilings = {},
                 const DiagnosisRules& rules = {});

/// Short texts the Coder can act on, most important first.
std::vector<std::string> advise(const Finding& finding, const DiagnosisRules& rules = {});
/// Advice for a whole trace: gaps between launches, the kernel that dominates, host cost per launch.
std::vector<std::string> advise(const TraceSummary& summary, const DeviceCeilings& ceilings = {},
                                const DiagnosisRules& rules = {});

// ---- hardware metrics (CUPTI range profiler) ----

/// Nsight Compute's names of the speed-of-light set that Metrics collects by default.
std::vector<std::string> speed_of_light_metrics();

/// What Metrics collects and how.
struct MetricsOptions {
  std::vector<std::string> metrics;  ///< metric names; empty: speed_of_light_metrics()
  std::size_t max_kernels = 1024;    ///< launches recorded; a workload launching more is an InvalidArgument
  int device = -1;                   ///< device whose context to use when none is current (-1: 0)
};

/// Hardware metrics of one kernel launch (one range of the range profiler).
struct KernelMetrics {
  std::string name;                ///< the range's name as CUPTI gives it (the kernel, in launch order)
  std::size_t index = 0;           ///< launch order within the workload
  double sm_throughput_pct = 0;    ///< sm__throughput.avg.pct_of_peak_sustained_elapsed
  double memory_throughput_pct = 0;  ///< gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed
  double dram_throughput_pct = 0;  ///< gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed
  double l1_throughput_pct = 0;    ///< l1tex__throughput.avg.pct_of_peak_sustained_active
  double l2_throughput_pct = 0;    ///< lts__throughput.avg.pct_of_peak_sustained_elapsed
  double achieved_occupancy_pct = 0;  ///< sm__warps_active.avg.pct_of_peak_sustained_active
  double duration_ns = 0;          ///< gpu__time_duration.sum
  double dram_bytes_read = 0;      ///< dram__bytes_read.sum
  double dram_bytes_written = 0;   ///< dram__bytes_write.sum
  std::vector<std::pair<std::string, double>> values;  ///< every collected metric, in request order
  /// The value of a collected metric by name, if it was collected.
  std::optional<double> value(const std::string& metric) const;
  /// Duration, DRAM bytes, occupancy and throughputs in the form classify() takes.
  KernelMeasurement measurement() const;
};

/// Fills the named fields of KernelMetrics from `values` (metric name, value); others are kept only in values.
KernelMetrics make_kernel_metrics(std::string name, std::size_t index,
                                  std::vector<std::pair<std::string, double>> values);

/// Per-kernel hardware counters through the CUPTI range profiler (auto range, kernel replay): each
/// launch inside the workload is one range, replayed as many passes as the metrics need.
struct Metrics {
  /// Runs `workload` once under the profiler and returns one entry per kernel launch, in launch order.
  /// Unavailable: no GPU, no CUPTI, no permission (CUPTI_ERROR_INSUFFICIENT_PRIVILEGES), another
  /// profiler attached, a Tracer recording. InvalidArgument: a metric name the device does not have.
  /// An exception thrown by the workload is rethrown after CUPTI is released.
  static Result<std::vector<KernelMetrics>> collect(const std::function<void()>& workload,
                                                    const MetricsOptions& options = {});
  /// Checks metric names against a chip ("GH100") with the host API only: no GPU needed.
  /// InvalidArgument names the first unknown metric; Unavailable when CUPTI or the chip is unsupported.
  static Result<void> validate(const std::vector<std::string>& metrics, const std::string& chip);
  /// Replay passes a set of metrics needs on a chip (host API only).
  static Result<std::size_t> passes(const std::vector<std::string>& metrics, const std::string& chip);
  /// Chips the loaded CUPTI's host API knows ("GH100", ...).
  static Result<std::vector<std::string>> supported_chips();
  /// The chip name of a device (needs the GPU).
  static Result<std::string> chip_name(int device = 0);
};

}  // namespace stitchcuda::profile
