// CUPTI's entry points: libcupti.so.13 is loaded at run time (never linked) so the library imports and runs
// without it, and every failure to load or call it becomes an Unavailable value with the fix.
#include "cupti.hpp"

#include <stitchcuda/detail/dynamic_library.hpp>

namespace stitchcuda::profile::detail {
namespace {

// The toolkit keeps CUPTI in lib64 or, in older layouts, extras/CUPTI/lib64.
Result<CuptiApi> load_cupti() {
  stitchcuda::detail::LibrarySearch search{
      "libcupti.so.13", stitchcuda::detail::Setting::cupti, {"libcupti.so.13"},
      "profiler unavailable: CUPTI (libcupti.so.13) was not found: install the CUDA 13 toolkit's CUPTI, "
      "set CUDA_HOME, or set STITCHCUDA_CUPTI to the library's path"};
  for (const std::string& home : stitchcuda::detail::toolkit_folders())
    for (const char* folder : {"/lib64/", "/extras/CUPTI/lib64/"})
      search.candidates.push_back(home + folder + "libcupti.so.13");
  for (const std::string& folder : stitchcuda::detail::torch_folders())
    search.candidates.push_back(folder + "/libcupti.so.13");
  auto lib = stitchcuda::detail::load_library(search);
  if (!lib) {
    Error e = lib.error();
    if (e.message.rfind("profiler unavailable: ", 0) != 0) e.message = "profiler unavailable: " + e.message;
    return tl::unexpected(std::move(e));
  }
  CuptiApi api;
  std::string missing;
  auto bind = [&](auto& fn, const char* name, bool required = true) {
    if (!lib->bind(fn, name) && required) missing += std::string(" ") + name;
  };
  bind(api.GetVersion, "cuptiGetVersion");
  bind(api.GetResultString, "cuptiGetResultString");
  bind(api.Subscribe, "cuptiSubscribe");
  bind(api.Subscribe_v2, "cuptiSubscribe_v2", false);
  bind(api.Unsubscribe, "cuptiUnsubscribe");
  bind(api.ActivityEnable, "cuptiActivityEnable");
  bind(api.ActivityDisable, "cuptiActivityDisable");
  bind(api.ActivityRegisterCallbacks, "cuptiActivityRegisterCallbacks");
  bind(api.ActivityFlushAll, "cuptiActivityFlushAll");
  bind(api.ActivityGetNextRecord, "cuptiActivityGetNextRecord");
  bind(api.ActivityGetNumDroppedRecords, "cuptiActivityGetNumDroppedRecords");
  bind(api.GetCallbackName, "cuptiGetCallbackName");
  bind(api.ActivitySetAttribute, "cuptiActivitySetAttribute", false);
  bind(api.ActivityEnableRuntimeApi, "cuptiActivityEnableRuntimeApi", false);
  bind(api.ActivityEnableDriverApi, "cuptiActivityEnableDriverApi", false);
  bind(api.GetTimestamp, "cuptiGetTimestamp");
  // The range profiler's functions: Metrics refuses to run without them, tracing does not need them.
  auto bind_profiler = [&](auto& fn, const char* name) {
    if (!lib->bind(fn, name)) api.profiler_missing += std::string(" ") + name;
  };
  bind_profiler(api.ProfilerInitialize, "cuptiProfilerInitialize");
  bind_profiler(api.ProfilerDeInitialize, "cuptiProfilerDeInitialize");
  bind_profiler(api.DeviceGetChipName, "cuptiDeviceGetChipName");
  bind_profiler(api.ProfilerGetCounterAvailability, "cuptiProfilerGetCounterAvailability");
  bind_profiler(api.HostInitialize, "cuptiProfilerHostInitialize");
  bind_profiler(api.HostDeinitialize, "cuptiProfilerHostDeinitialize");
  bind_profiler(api.HostGetSupportedChips, "cuptiProfilerHostGetSupportedChips");
  bind_profiler(api.HostGetMetricProperties, "cuptiProfilerHostGetMetricProperties");
  bind_profiler(api.HostConfigAddMetrics, "cuptiProfilerHostConfigAddMetrics");
  bind_profiler(api.HostGetConfigImageSize, "cuptiProfilerHostGetConfigImageSize");
  bind_profiler(api.HostGetConfigImage, "cuptiProfilerHostGetConfigImage");
  bind_profiler(api.HostGetNumOfPasses, "cuptiProfilerHostGetNumOfPasses");
  bind_profiler(api.HostEvaluateToGpuValues, "cuptiProfilerHostEvaluateToGpuValues");
  bind_profiler(api.RangeProfilerEnable, "cuptiRangeProfilerEnable");
  bind_profiler(api.RangeProfilerDisable, "cuptiRangeProfilerDisable");
  bind_profiler(api.RangeProfilerSetConfig, "cuptiRangeProfilerSetConfig");
  bind_profiler(api.RangeProfilerStart, "cuptiRangeProfilerStart");
  bind_profiler(api.RangeProfilerStop, "cuptiRangeProfilerStop");
  bind_profiler(api.RangeProfilerDecodeData, "cuptiRangeProfilerDecodeData");
  bind_profiler(api.RangeProfilerGetCounterDataSize, "cuptiRangeProfilerGetCounterDataSize");
  bind_profiler(api.RangeProfilerCounterDataImageInitialize, "cuptiRangeProfilerCounterDataImageInitialize");
  bind_profiler(api.RangeProfilerGetCounterDataInfo, "cuptiRangeProfilerGetCounterDataInfo");
  bind_profiler(api.RangeProfilerCounterDataGetRangeInfo, "cuptiRangeProfilerCounterDataGetRangeInfo");
  api.path = lib->path;
  if (!missing.empty())
    return fail(ErrorCode::Unavailable, "profiler unavailable: the CUPTI at '" + api.path +
                                            "' lacks functions StitchCUDA needs:" + missing + "; use CUPTI of CUDA 13");
  api.GetVersion(&api.version);
  // Activity record layouts (CUpti_ActivityKernel10...) are those of the CUDA 13 headers we built with.
  if (api.version / 10000 != CUPTI_API_VERSION / 10000)
    return fail(ErrorCode::Unavailable, "profiler unavailable: the CUPTI at '" + api.path + "' has API version " +
                                            std::to_string(api.version) + ", StitchCUDA was built for " +
                                            std::to_string(CUPTI_API_VERSION) + ": use the CUPTI of CUDA 13");
  return api;
}

}  // namespace

// Never destroyed: CUPTI's own thread may hand back a buffer while the process exits.
Result<const CuptiApi*> cupti() {
  static const Result<CuptiApi>* loaded = new Result<CuptiApi>(load_cupti());
  if (!*loaded) return tl::unexpected(loaded->error());
  return &**loaded;
}

std::string result_text(const CuptiApi& api, CUptiResult r) {
  const char* text = nullptr;
  api.GetResultString(r, &text);
  return text ? text : "CUPTI error " + std::to_string(int(r));
}

// Turns a failed CUPTI call into a value naming the cause and the fix.
Error cupti_error(const CuptiApi& api, CUptiResult r, const std::string& what, const std::string& other) {
  std::string message = "profiler unavailable: " + what + " failed (" + result_text(api, r) + ")";
  if (r == CUPTI_ERROR_INSUFFICIENT_PRIVILEGES || r == CUPTI_ERROR_VIRTUALIZED_DEVICE_INSUFFICIENT_PRIVILEGES)
    message += ": this user may not profile the GPU; run as root, or set the driver option "
               "NVreg_RestrictProfilingToAdminUsers=0 (https://developer.nvidia.com/ERR_NVGPUCTRPERM)";
  else if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)
    message += ": another CUPTI client is attached" + (other.empty() ? std::string() : " (" + other + ")") +
               "; stop torch.profiler, Nsight Systems/Compute or cuda-gdb first, then trace again";
  else if (r == CUPTI_ERROR_NOT_INITIALIZED)
    message += ": CUPTI could not initialise; check that the driver and CUPTI are both from CUDA 13";
  return Error{ErrorCode::Unavailable, std::move(message), {}, {}};
}

}  // namespace stitchcuda::profile::detail
