// libcupti.so.13 loaded at run time, shared by the Tracer (activity API) and Metrics (range profiler):
// one loader, one search order, one way of turning a CUPTI failure into "profiler unavailable: why, fix".
#pragma once

#include <cupti.h>
#include <cupti_profiler_host.h>
#include <cupti_profiler_target.h>
#include <cupti_range_profiler.h>
#include <cupti_target.h>

#include <cstdint>
#include <string>

#include <stitchcuda/error.hpp>

namespace stitchcuda::profile::detail {

/// CUPTI entry points. The activity ones are required; the profiler ones are checked by Metrics
/// (profiler_missing), so a CUPTI without them can still trace.
struct CuptiApi {
  decltype(&::cuptiGetVersion) GetVersion = nullptr;
  decltype(&::cuptiGetResultString) GetResultString = nullptr;
  decltype(&::cuptiGetTimestamp) GetTimestamp = nullptr;
  decltype(&::cuptiSubscribe) Subscribe = nullptr;
  decltype(&::cuptiSubscribe_v2) Subscribe_v2 = nullptr;  // optional: names the other subscriber
  decltype(&::cuptiUnsubscribe) Unsubscribe = nullptr;
  decltype(&::cuptiActivityEnable) ActivityEnable = nullptr;
  decltype(&::cuptiActivityDisable) ActivityDisable = nullptr;
  decltype(&::cuptiActivityRegisterCallbacks) ActivityRegisterCallbacks = nullptr;
  decltype(&::cuptiActivityFlushAll) ActivityFlushAll = nullptr;
  decltype(&::cuptiActivityGetNextRecord) ActivityGetNextRecord = nullptr;
  decltype(&::cuptiActivityGetNumDroppedRecords) ActivityGetNumDroppedRecords = nullptr;
  decltype(&::cuptiGetCallbackName) GetCallbackName = nullptr;
  decltype(&::cuptiActivitySetAttribute) ActivitySetAttribute = nullptr;  // optional
  decltype(&::cuptiActivityEnableRuntimeApi) ActivityEnableRuntimeApi = nullptr;  // optional (per-call selection)
  decltype(&::cuptiActivityEnableDriverApi) ActivityEnableDriverApi = nullptr;    // optional

  // Range profiler (target side) and profiler host API.
  decltype(&::cuptiProfilerInitialize) ProfilerInitialize = nullptr;
  decltype(&::cuptiProfilerDeInitialize) ProfilerDeInitialize = nullptr;
  decltype(&::cuptiDeviceGetChipName) DeviceGetChipName = nullptr;
  decltype(&::cuptiProfilerGetCounterAvailability) ProfilerGetCounterAvailability = nullptr;
  decltype(&::cuptiProfilerHostInitialize) HostInitialize = nullptr;
  decltype(&::cuptiProfilerHostDeinitialize) HostDeinitialize = nullptr;
  decltype(&::cuptiProfilerHostGetSupportedChips) HostGetSupportedChips = nullptr;
  decltype(&::cuptiProfilerHostGetMetricProperties) HostGetMetricProperties = nullptr;
  decltype(&::cuptiProfilerHostConfigAddMetrics) HostConfigAddMetrics = nullptr;
  decltype(&::cuptiProfilerHostGetConfigImageSize) HostGetConfigImageSize = nullptr;
  decltype(&::cuptiProfilerHostGetConfigImage) HostGetConfigImage = nullptr;
  decltype(&::cuptiProfilerHostGetNumOfPasses) HostGetNumOfPasses = nullptr;
  decltype(&::cuptiProfilerHostEvaluateToGpuValues) HostEvaluateToGpuValues = nullptr;
  decltype(&::cuptiRangeProfilerEnable) RangeProfilerEnable = nullptr;
  decltype(&::cuptiRangeProfilerDisable) RangeProfilerDisable = nullptr;
  decltype(&::cuptiRangeProfilerSetConfig) RangeProfilerSetConfig = nullptr;
  decltype(&::cuptiRangeProfilerStart) RangeProfilerStart = nullptr;
  decltype(&::cuptiRangeProfilerStop) RangeProfilerStop = nullptr;
  decltype(&::cuptiRangeProfilerDecodeData) RangeProfilerDecodeData = nullptr;
  decltype(&::cuptiRangeProfilerGetCounterDataSize) RangeProfilerGetCounterDataSize = nullptr;
  decltype(&::cuptiRangeProfilerCounterDataImageInitialize) RangeProfilerCounterDataImageInitialize = nullptr;
  decltype(&::cuptiRangeProfilerGetCounterDataInfo) RangeProfilerGetCounterDataInfo = nullptr;
  decltype(&::cuptiRangeProfilerCounterDataGetRangeInfo) RangeProfilerCounterDataGetRangeInfo = nullptr;

  std::string path;             ///< the library that was loaded
  std::uint32_t version = 0;    ///< cuptiGetVersion
  std::string profiler_missing; ///< profiler functions this CUPTI lacks ("" when all are there)
};

/// CUPTI, loaded once (search order in docs/profile.md); Unavailable says why not. Never unloaded.
Result<const CuptiApi*> cupti();

/// CUPTI's text for a result code.
std::string result_text(const CuptiApi& api, CUptiResult r);

/// Unavailable error for a failed CUPTI call: `what` names the call; privileges, another subscriber
/// (`other` names it when CUPTI does) and initialisation failures get their fix appended.
Error cupti_error(const CuptiApi& api, CUptiResult r, const std::string& what, const std::string& other = {});

/// Whether a Tracer is recording in this process (the range profiler refuses to start beside it).
bool tracer_recording();

}  // namespace stitchcuda::profile::detail
