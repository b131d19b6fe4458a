// The one CUPTI loader: libcupti.so.13 is dlopen'ed (never linked) so the library imports and runs
// without it, and every failure to load or call it becomes an Unavailable value with the fix.
#include "cupti.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <type_traits>
#include <vector>

namespace stitchcuda::profile::detail {
namespace {

Result<CuptiApi> load_cupti() {
  std::vector<std::string> tried;
  void* lib = nullptr;
  auto attempt = [&](const std::string& candidate, int extra_flags) {
    if (lib) return;
    tried.push_back(candidate);
    lib = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL | extra_flags);
  };
  if (const char* env = std::getenv("STITCHCUDA_CUPTI"); env && *env) {
    attempt(env, 0);
    if (!lib)
      return fail(ErrorCode::Unavailable, std::string("profiler unavailable: STITCHCUDA_CUPTI points to '") + env +
                                              "', which could not be loaded: point it at a libcupti.so.13 or unset it");
  }
  // One process, one CUDA major: prefer a CUPTI already loaded (PyTorch's wheels bring one).
  attempt("libcupti.so.13", RTLD_NOLOAD);
  attempt("libcupti.so.13", 0);
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
    if (const char* home = std::getenv(var); home && *home) {
      attempt(std::string(home) + "/lib64/libcupti.so.13", 0);
      attempt(std::string(home) + "/extras/CUPTI/lib64/libcupti.so.13", 0);
    }
  }
  attempt("/usr/local/cuda/lib64/libcupti.so.13", 0);
  attempt("/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13", 0);
  if (!lib) {
    std::string where;
    for (const auto& t : tried) where += "\n  " + t;
    return fail(ErrorCode::Unavailable,
                "profiler unavailable: CUPTI (libcupti.so.13) was not found: install the CUDA 13 toolkit's CUPTI, "
                "set CUDA_HOME, or set STITCHCUDA_CUPTI to the library's path",
                "looked for:" + where);
  }
  CuptiApi api;
  std::string missing;
  auto bind = [&](auto& fn, const char* name, bool required = true) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn && required) missing += std::string(" ") + name;
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
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn) api.profiler_missing += std::string(" ") + name;
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
  Dl_info info{};
  api.path = dladdr(reinterpret_cast<void*>(api.GetVersion), &info) && info.dli_fname ? info.dli_fname : tried.back();
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
