// CUPTI activity records (CUDA 13 layouts) turned into StitchCUDA's records: a pure conversion,
// kept apart from the Tracer so tests can feed it hand-built records on machines without a GPU.
#pragma once

#include <cupti_activity.h>

#include <cstdint>
#include <string>
#include <vector>

#include <stitchcuda/profile.hpp>

namespace stitchcuda::profile::detail {

/// A host API call whose name is looked up later (cuptiGetCallbackName), outside CUPTI's callbacks.
struct PendingApi {
  ApiRecord record;            ///< everything but the name
  CUpti_CallbackId cbid = 0;   ///< function id within record.domain
};

/// The readable form of a C++ symbol; the symbol itself when it is not mangled (extern "C").
std::string demangle(const char* symbol);

/// StitchCUDA's name for a CUpti_ActivityMemcpyKind.
MemcpyKind memcpy_kind(std::uint8_t kind);

/// Appends one activity record to `trace` (kernels, copies, memsets) or to `api` (runtime and driver
/// calls); other kinds are ignored.
void append_activity(const CUpti_Activity* activity, Trace& trace, std::vector<PendingApi>& api);

}  // namespace stitchcuda::profile::detail
