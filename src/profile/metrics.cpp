// Per-kernel hardware metrics through the CUPTI range profiler and profiler host API (CUDA 13): the
// host API turns metric names into a config image for the chip, the range profiler records one range
// per kernel launch (auto range) and replays each kernel for as many passes as the counters need.
#include <algorithm>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <stitchcuda/profile.hpp>

#include <stitchcuda/detail/cuda_driver.hpp>
#include "cupti.hpp"

namespace stitchcuda::profile {

std::vector<std::string> speed_of_light_metrics() {
  return {"sm__throughput.avg.pct_of_peak_sustained_elapsed",
          "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
          "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
          "l1tex__throughput.avg.pct_of_peak_sustained_active",
          "lts__throughput.avg.pct_of_peak_sustained_elapsed",
          "sm__warps_active.avg.pct_of_peak_sustained_active",
          "gpu__time_duration.sum",
          "dram__bytes_read.sum",
          "dram__bytes_write.sum"};
}

std::optional<double> KernelMetrics::value(const std::string& metric) const {
  for (const auto& [name, v] : values)
    if (name == metric) return v;
  return std::nullopt;
}

KernelMeasurement KernelMetrics::measurement() const {
  KernelMeasurement m;
  m.name = name;
  m.duration_ns = duration_ns;
  if (value("dram__bytes_read.sum") || value("dram__bytes_write.sum")) m.dram_bytes = dram_bytes_read + dram_bytes_written;
  if (value("sm__warps_active.avg.pct_of_peak_sustained_active")) m.achieved_occupancy = achieved_occupancy_pct / 100.0;
  if (value("sm__throughput.avg.pct_of_peak_sustained_elapsed")) m.sm_throughput = sm_throughput_pct / 100.0;
  if (auto mem = value("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"))
    m.memory_throughput = *mem / 100.0;
  else if (auto dram = value("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"))
    m.memory_throughput = *dram / 100.0;
  return m;
}

KernelMetrics make_kernel_metrics(std::string name, std::size_t index, std::vector<std::pair<std::string, double>> values) {
  KernelMetrics k;
  k.name = std::move(name);
  k.index = index;
  k.values = std::move(values);
  const std::pair<const char*, double KernelMetrics::*> fields[] = {
      {"sm__throughput.avg.pct_of_peak_sustained_elapsed", &KernelMetrics::sm_throughput_pct},
      {"gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", &KernelMetrics::memory_throughput_pct},
      {"gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", &KernelMetrics::dram_throughput_pct},
      {"l1tex__throughput.avg.pct_of_peak_sustained_active", &KernelMetrics::l1_throughput_pct},
      {"lts__throughput.avg.pct_of_peak_sustained_elapsed", &KernelMetrics::l2_throughput_pct},
      {"sm__warps_active.avg.pct_of_peak_sustained_active", &KernelMetrics::achieved_occupancy_pct},
      {"gpu__time_duration.sum", &KernelMetrics::duration_ns},
      {"dram__bytes_read.sum", &KernelMetrics::dram_bytes_read},
      {"dram__bytes_write.sum", &KernelMetrics::dram_bytes_written},
  };
  for (const auto& [metric, field] : fields)
    if (auto v = k.value(metric)) k.*field = *v;
  return k;
}

namespace {

using detail::CuptiApi;
using detail::cupti_error;

Result<const CuptiApi*> profiler_api() {
  auto api = detail::cupti();
  if (!api) return api;
  if (!(*api)->profiler_missing.empty())
    return fail(ErrorCode::Unavailable, "profiler unavailable: the CUPTI at '" + (*api)->path +
                                            "' lacks the range profiler:" + (*api)->profiler_missing +
                                            "; use the CUPTI of CUDA 13");
  return api;
}

// A profiler host object (metric names -> config image, counter data -> values), released on scope exit.
class HostObject {
 public:
  static Result<HostObject> create(const CuptiApi& api, const std::string& chip, const std::vector<std::uint8_t>& availability) {
    CUpti_Profiler_Host_Initialize_Params p{};
    p.structSize = CUpti_Profiler_Host_Initialize_Params_STRUCT_SIZE;
    p.profilerType = CUPTI_PROFILER_TYPE_RANGE_PROFILER;
    p.pChipName = chip.c_str();
    p.pCounterAvailabilityImage = availability.empty() ? nullptr : availability.data();
    if (CUptiResult r = api.HostInitialize(&p); r != CUPTI_SUCCESS || !p.pHostObject) {
      Error e = cupti_error(api, r, "initialising the profiler host API for chip '" + chip + "'");
      e.message += "; this CUPTI does not support that chip: use the CUPTI of the CUDA release that supports it";
      return tl::unexpected(std::move(e));
    }
    return HostObject(api, p.pHostObject);
  }
  HostObject(HostObject&& o) noexcept : api_(o.api_), object_(std::exchange(o.object_, nullptr)) {}
  HostObject& operator=(HostObject&&) = delete;
  HostObject(const HostObject&) = delete;
  ~HostObject() {
    if (!object_) return;
    CUpti_Profiler_Host_Deinitialize_Params p{};
    p.structSize = CUpti_Profiler_Host_Deinitialize_Params_STRUCT_SIZE;
    p.pHostObject = object_;
    api_->HostDeinitialize(&p);
  }
  CUpti_Profiler_Host_Object* get() const { return object_; }

  // InvalidArgument naming the first metric the chip does not have.
  Result<void> check(const std::vector<std::string>& metrics, const std::string& chip) const {
    if (metrics.empty()) return fail(ErrorCode::InvalidArgument, "no metric names given");
    for (const auto& name : metrics) {
      CUpti_Profiler_Host_GetMetricProperties_Params p{};
      p.structSize = CUpti_Profiler_Host_GetMetricProperties_Params_STRUCT_SIZE;
      p.pHostObject = object_;
      p.pMetricName = name.c_str();
      if (CUptiResult r = api_->HostGetMetricProperties(&p); r != CUPTI_SUCCESS)
        return fail(ErrorCode::InvalidArgument, "unknown metric '" + name + "' on chip " + chip + " (" +
                                                    detail::result_text(*api_, r) +
                                                    "): use a name Nsight Compute lists for this device "
                                                    "(ncu --query-metrics)");
    }
    return {};
  }

  // The config image scheduling `metrics`; check() them first for a precise error.
  Result<std::vector<std::uint8_t>> config_image(const std::vector<std::string>& metrics, const std::string& chip) const {
    if (auto ok = check(metrics, chip); !ok) return tl::unexpected(ok.error());
    std::vector<const char*> names;
    for (const auto& m : metrics) names.push_back(m.c_str());
    CUpti_Profiler_Host_ConfigAddMetrics_Params add{};
    add.structSize = CUpti_Profiler_Host_ConfigAddMetrics_Params_STRUCT_SIZE;
    add.pHostObject = object_;
    add.ppMetricNames = names.data();
    add.numMetrics = names.size();
    if (CUptiResult r = api_->HostConfigAddMetrics(&add); r != CUPTI_SUCCESS) {
      Error e = cupti_error(*api_, r, "adding metrics to the profiler configuration");
      e.code = ErrorCode::InvalidArgument;
      return tl::unexpected(std::move(e));
    }
    CUpti_Profiler_Host_GetConfigImageSize_Params size{};
    size.structSize = CUpti_Profiler_Host_GetConfigImageSize_Params_STRUCT_SIZE;
    size.pHostObject = object_;
    if (CUptiResult r = api_->HostGetConfigImageSize(&size); r != CUPTI_SUCCESS)
      return tl::unexpected(cupti_error(*api_, r, "sizing the profiler config image"));
    std::vector<std::uint8_t> image(size.configImageSize);
    CUpti_Profiler_Host_GetConfigImage_Params get{};
    get.structSize = CUpti_Profiler_Host_GetConfigImage_Params_STRUCT_SIZE;
    get.pHostObject = object_;
    get.configImageSize = image.size();
    get.pConfigImage = image.data();
    if (CUptiResult r = api_->HostGetConfigImage(&get); r != CUPTI_SUCCESS)
      return tl::unexpected(cupti_error(*api_, r, "building the profiler config image"));
    return image;
  }

 private:
  HostObject(const CuptiApi& api, CUpti_Profiler_Host_Object* object) : api_(&api), object_(object) {}
  const CuptiApi* api_;
  CUpti_Profiler_Host_Object* object_;
};

Result<std::size_t> count_passes(const CuptiApi& api, std::vector<std::uint8_t>& image) {
  CUpti_Profiler_Host_GetNumOfPasses_Params p{};
  p.structSize = CUpti_Profiler_Host_GetNumOfPasses_Params_STRUCT_SIZE;
  p.configImageSize = image.size();
  p.pConfigImage = image.data();
  if (CUptiResult r = api.HostGetNumOfPasses(&p); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(api, r, "counting replay passes"));
  return p.numOfPasses;
}

// Undoes, in reverse order, what a collection set up: whatever the path out (error, exception).
class Cleanup {
 public:
  explicit Cleanup(const CuptiApi& api) : api_(api) {}
  ~Cleanup() {
    if (started_) {
      CUpti_RangeProfiler_Stop_Params p{};
      p.structSize = CUpti_RangeProfiler_Stop_Params_STRUCT_SIZE;
      p.pRangeProfilerObject = object_;
      api_.RangeProfilerStop(&p);
    }
    if (object_) {
      CUpti_RangeProfiler_Disable_Params p{};
      p.structSize = CUpti_RangeProfiler_Disable_Params_STRUCT_SIZE;
      p.pRangeProfilerObject = object_;
      api_.RangeProfilerDisable(&p);
    }
    if (initialized_) {
      CUpti_Profiler_DeInitialize_Params p{};
      p.structSize = CUpti_Profiler_DeInitialize_Params_STRUCT_SIZE;
      api_.ProfilerDeInitialize(&p);
    }
  }
  Cleanup(const Cleanup&) = delete;
  Cleanup& operator=(const Cleanup&) = delete;
  bool initialized_ = false;
  CUpti_RangeProfiler_Object* object_ = nullptr;
  bool started_ = false;

 private:
  const CuptiApi& api_;
};

}  // namespace

Result<std::vector<std::string>> Metrics::supported_chips() {
  auto loaded = profiler_api();
  if (!loaded) return tl::unexpected(loaded.error());
  CUpti_Profiler_Host_GetSupportedChips_Params p{};
  p.structSize = CUpti_Profiler_Host_GetSupportedChips_Params_STRUCT_SIZE;
  if (CUptiResult r = (*loaded)->HostGetSupportedChips(&p); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(**loaded, r, "listing the chips the profiler host API supports"));
  std::vector<std::string> chips;
  for (std::size_t i = 0; i < p.numChips; ++i)
    if (p.ppChipNames[i]) chips.emplace_back(p.ppChipNames[i]);
  return chips;
}

Result<void> Metrics::validate(const std::vector<std::string>& metrics, const std::string& chip) {
  auto loaded = profiler_api();
  if (!loaded) return tl::unexpected(loaded.error());
  auto host = HostObject::create(**loaded, chip, {});
  if (!host) return tl::unexpected(host.error());
  return host->check(metrics, chip);
}

Result<std::size_t> Metrics::passes(const std::vector<std::string>& metrics, const std::string& chip) {
  auto loaded = profiler_api();
  if (!loaded) return tl::unexpected(loaded.error());
  auto host = HostObject::create(**loaded, chip, {});
  if (!host) return tl::unexpected(host.error());
  auto image = host->config_image(metrics, chip);
  if (!image) return tl::unexpected(image.error());
  return count_passes(**loaded, *image);
}

Result<std::string> Metrics::chip_name(int device) {
  if (jit::Driver::device_count() <= device || device < 0)
    return fail(ErrorCode::Unavailable, "profiler unavailable: no CUDA device " + std::to_string(device) +
                                            " to read the chip name of; run on a machine with an NVIDIA GPU");
  auto loaded = profiler_api();
  if (!loaded) return tl::unexpected(loaded.error());
  const CuptiApi& api = **loaded;
  CUpti_Profiler_Initialize_Params init{};
  init.structSize = CUpti_Profiler_Initialize_Params_STRUCT_SIZE;
  if (CUptiResult r = api.ProfilerInitialize(&init); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(api, r, "cuptiProfilerInitialize"));
  CUpti_Device_GetChipName_Params p{};
  p.structSize = CUpti_Device_GetChipName_Params_STRUCT_SIZE;
  p.deviceIndex = std::size_t(device);
  CUptiResult r = api.DeviceGetChipName(&p);
  std::string chip = r == CUPTI_SUCCESS && p.pChipName ? p.pChipName : "";
  CUpti_Profiler_DeInitialize_Params deinit{};
  deinit.structSize = CUpti_Profiler_DeInitialize_Params_STRUCT_SIZE;
  api.ProfilerDeInitialize(&deinit);
  if (r != CUPTI_SUCCESS) return tl::unexpected(cupti_error(api, r, "cuptiDeviceGetChipName"));
  return chip;
}

Result<std::vector<KernelMetrics>> Metrics::collect(const std::function<void()>& workload, const MetricsOptions& options) {
  if (!workload) return fail(ErrorCode::InvalidArgument, "Metrics::collect needs a workload to run");
  if (options.max_kernels == 0) return fail(ErrorCode::InvalidArgument, "MetricsOptions::max_kernels must be at least 1");
  if (detail::tracer_recording())
    return fail(ErrorCode::Unavailable, "profiler unavailable: a stitchcuda::profile::Tracer is recording in this "
                                        "process; stop it before collecting metrics (kernel replay would distort "
                                        "its timeline)");
  if (jit::Driver::device_count() <= 0) {
    auto driver = jit::Driver::available();
    return fail(ErrorCode::Unavailable, "profiler unavailable: no CUDA device to collect metrics on (" +
                                            (driver ? std::string("the driver reports no devices") : driver.error().message) +
                                            "); run on a machine with an NVIDIA GPU");
  }
  auto loaded = profiler_api();
  if (!loaded) return tl::unexpected(loaded.error());
  const CuptiApi& api = **loaded;
  auto driver = jit::detail::driver();
  if (!driver) return tl::unexpected(driver.error());
  auto device = jit::detail::ensure_context(**driver, options.device);
  if (!device) return tl::unexpected(device.error());
  CUcontext ctx = nullptr;
  if (CUresult r = (*driver)->CtxGetCurrent(&ctx); r != CUDA_SUCCESS || !ctx)
    return tl::unexpected(jit::detail::cuda_error(r, "cuCtxGetCurrent"));
  const std::vector<std::string> metrics = options.metrics.empty() ? speed_of_light_metrics() : options.metrics;

  // Declared before the Cleanup, so CUPTI is disabled while the images it was given still exist.
  std::vector<std::uint8_t> availability, config, counter_data;
  Cleanup cleanup(api);
  CUpti_Profiler_Initialize_Params init{};
  init.structSize = CUpti_Profiler_Initialize_Params_STRUCT_SIZE;
  if (CUptiResult r = api.ProfilerInitialize(&init); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(api, r, "cuptiProfilerInitialize"));
  cleanup.initialized_ = true;

  CUpti_Device_GetChipName_Params chip_params{};
  chip_params.structSize = CUpti_Device_GetChipName_Params_STRUCT_SIZE;
  chip_params.deviceIndex = std::size_t(*device);
  if (CUptiResult r = api.DeviceGetChipName(&chip_params); r != CUPTI_SUCCESS || !chip_params.pChipName)
    return tl::unexpected(cupti_error(api, r, "cuptiDeviceGetChipName"));
  const std::string chip = chip_params.pChipName;

  // Which counters this context may read (some are reserved, e.g. under MIG or by another profiler).
  CUpti_Profiler_GetCounterAvailability_Params avail{};
  avail.structSize = CUpti_Profiler_GetCounterAvailability_Params_STRUCT_SIZE;
  avail.ctx = ctx;
  if (CUptiResult r = api.ProfilerGetCounterAvailability(&avail); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(api, r, "reading counter availability"));
  availability.resize(avail.counterAvailabilityImageSize);
  avail.pCounterAvailabilityImage = availability.data();
  if (CUptiResult r = api.ProfilerGetCounterAvailability(&avail); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(api, r, "reading counter availability"));

  auto host = HostObject::create(api, chip, availability);
  if (!host) return tl::unexpected(host.error());
  auto config_image = host->config_image(metrics, chip);
  if (!config_image) return tl::unexpected(config_image.error());
  config = std::move(*config_image);

  CUpti_RangeProfiler_Enable_Params enable{};
  enable.structSize = CUpti_RangeProfiler_Enable_Params_STRUCT_SIZE;
  enable.ctx = ctx;
  if (CUptiResult r = api.RangeProfilerEnable(&enable); r != CUPTI_SUCCESS || !enable.pRangeProfilerObject)
    return tl::unexpected(cupti_error(api, r, "enabling the range profiler"));
  cleanup.object_ = enable.pRangeProfilerObject;

  std::vector<const char*> names;
  for (const auto& m : metrics) names.push_back(m.c_str());
  CUpti_RangeProfiler_GetCounterDataSize_Params size{};
  size.structSize = CUpti_RangeProfiler_GetCounterDataSize_Params_STRUCT_SIZE;
  size.pRangeProfilerObject = cleanup.object_;
  size.pMetricNames = names.data();
  size.numMetrics = names.size();
  // One range more than asked for: a workload that fills it launched too many kernels (CUPTI may drop
  // the ranges past the image without counting them as dropped).
  const std::size_t capacity = options.max_kernels + 1;
  size.maxNumOfRanges = capacity;
  size.maxNumRangeTreeNodes = std::uint32_t(capacity);
  if (CUptiResult r = api.RangeProfilerGetCounterDataSize(&size); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(api, r, "sizing the counter data image"));
  counter_data.resize(size.counterDataSize);
  CUpti_RangeProfiler_CounterDataImage_Initialize_Params image{};
  image.structSize = CUpti_RangeProfiler_CounterDataImage_Initialize_Params_STRUCT_SIZE;
  image.pRangeProfilerObject = cleanup.object_;
  image.counterDataSize = counter_data.size();
  image.pCounterData = counter_data.data();
  if (CUptiResult r = api.RangeProfilerCounterDataImageInitialize(&image); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(api, r, "initialising the counter data image"));

  // Auto range + kernel replay: every launch is its own range, replayed until all passes are done.
  CUpti_RangeProfiler_SetConfig_Params set{};
  set.structSize = CUpti_RangeProfiler_SetConfig_Params_STRUCT_SIZE;
  set.pRangeProfilerObject = cleanup.object_;
  set.configSize = config.size();
  set.pConfig = config.data();
  set.counterDataImageSize = counter_data.size();
  set.pCounterDataImage = counter_data.data();
  set.range = CUPTI_AutoRange;
  set.replayMode = CUPTI_KernelReplay;
  set.maxRangesPerPass = capacity;
  set.numNestingLevels = 1;
  set.minNestingLevel = 1;
  set.passIndex = 0;
  set.targetNestingLevel = 1;
  if (CUptiResult r = api.RangeProfilerSetConfig(&set); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(api, r, "configuring the range profiler"));

  CUpti_RangeProfiler_Start_Params start{};
  start.structSize = CUpti_RangeProfiler_Start_Params_STRUCT_SIZE;
  start.pRangeProfilerObject = cleanup.object_;
  if (CUptiResult r = api.RangeProfilerStart(&start); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(api, r, "starting the range profiler"));
  cleanup.started_ = true;

  std::exception_ptr thrown;
  try {
    workload();
  } catch (...) {
    thrown = std::current_exception();
  }
  auto synced = jit::Driver::synchronize(*device);

  CUpti_RangeProfiler_Stop_Params stop{};
  stop.structSize = CUpti_RangeProfiler_Stop_Params_STRUCT_SIZE;
  stop.pRangeProfilerObject = cleanup.object_;
  CUptiResult stopped = api.RangeProfilerStop(&stop);
  cleanup.started_ = false;
  if (thrown) std::rethrow_exception(thrown);  // Cleanup releases CUPTI on the way out
  if (!synced) return fail(ErrorCode::LaunchError, "work inside the profiled workload failed: " + synced.error().message);
  if (stopped != CUPTI_SUCCESS) return tl::unexpected(cupti_error(api, stopped, "stopping the range profiler"));

  CUpti_RangeProfiler_DecodeData_Params decode{};
  decode.structSize = CUpti_RangeProfiler_DecodeData_Params_STRUCT_SIZE;
  decode.pRangeProfilerObject = cleanup.object_;
  if (CUptiResult r = api.RangeProfilerDecodeData(&decode); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(api, r, "decoding the counter data"));
  if (decode.numOfRangeDropped > 0)
    return fail(ErrorCode::InvalidArgument, "the workload launched more kernels than MetricsOptions::max_kernels = " +
                                                std::to_string(options.max_kernels) + " (" +
                                                std::to_string(decode.numOfRangeDropped) +
                                                " launches not measured): raise max_kernels or profile less at once");

  CUpti_RangeProfiler_GetCounterDataInfo_Params info{};
  info.structSize = CUpti_RangeProfiler_GetCounterDataInfo_Params_STRUCT_SIZE;
  info.pCounterDataImage = counter_data.data();
  info.counterDataImageSize = counter_data.size();
  if (CUptiResult r = api.RangeProfilerGetCounterDataInfo(&info); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(api, r, "reading the number of ranges"));
  if (info.numTotalRanges > options.max_kernels)
    return fail(ErrorCode::InvalidArgument, "the workload launched more kernels than MetricsOptions::max_kernels = " +
                                                std::to_string(options.max_kernels) +
                                                ": raise max_kernels or profile less at once");

  std::vector<KernelMetrics> out;
  std::vector<double> values(metrics.size());
  for (std::size_t i = 0; i < info.numTotalRanges; ++i) {
    CUpti_RangeProfiler_CounterData_GetRangeInfo_Params range{};
    range.structSize = CUpti_RangeProfiler_CounterData_GetRangeInfo_Params_STRUCT_SIZE;
    range.pCounterDataImage = counter_data.data();
    range.counterDataImageSize = counter_data.size();
    range.rangeIndex = i;
    range.rangeDelimiter = "/";
    std::string name;
    // The name's storage belongs to CUPTI (its header does not hand ownership over): copy, never free.
    if (api.RangeProfilerCounterDataGetRangeInfo(&range) == CUPTI_SUCCESS && range.rangeName) name = range.rangeName;
    CUpti_Profiler_Host_EvaluateToGpuValues_Params eval{};
    eval.structSize = CUpti_Profiler_Host_EvaluateToGpuValues_Params_STRUCT_SIZE;
    eval.pHostObject = host->get();
    eval.pCounterDataImage = counter_data.data();
    eval.counterDataImageSize = counter_data.size();
    eval.rangeIndex = i;
    eval.ppMetricNames = names.data();
    eval.numMetrics = names.size();
    eval.pMetricValues = values.data();
    if (CUptiResult r = api.HostEvaluateToGpuValues(&eval); r != CUPTI_SUCCESS)
      return tl::unexpected(cupti_error(api, r, "evaluating metrics of range " + std::to_string(i)));
    std::vector<std::pair<std::string, double>> named;
    for (std::size_t m = 0; m < metrics.size(); ++m) named.emplace_back(metrics[m], values[m]);
    out.push_back(make_kernel_metrics(std::move(name), i, std::move(named)));
  }
  return out;
}

}  // namespace stitchcuda::profile
