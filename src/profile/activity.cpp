// Conversion of CUPTI's CUDA 13 activity records into KernelRecord, MemcpyRecord, MemsetRecord and
// pending API calls, with demangled kernel names.
#include "activity.hpp"

#include <cxxabi.h>

#include <cstdlib>

namespace stitchcuda::profile::detail {

std::string demangle(const char* symbol) {
  if (!symbol) return {};
  int status = 0;
  char* readable = abi::__cxa_demangle(symbol, nullptr, nullptr, &status);
  if (status != 0 || !readable) return symbol;  // extern "C" names are not mangled
  std::string out = readable;
  std::free(readable);
  return out;
}

MemcpyKind memcpy_kind(std::uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return MemcpyKind::HostToDevice;
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return MemcpyKind::DeviceToHost;
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return MemcpyKind::DeviceToDevice;
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return MemcpyKind::HostToHost;
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return MemcpyKind::PeerToPeer;
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOA:
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOH:
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOA:
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOD:
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOA: return MemcpyKind::Array;
    default: return MemcpyKind::Unknown;
  }
}

namespace {

// Every GPU activity record says when, where and for which launch it ran, under the same names.
template <class Record, class Activity>
void copy_placement(Record& r, const Activity* a) {
  r.start_ns = a->start;
  r.end_ns = a->end;
  r.stream_id = a->streamId;
  r.correlation_id = a->correlationId;
  r.graph_id = a->graphId;
  r.device = int(a->deviceId);
}

}  // namespace

void append_activity(const CUpti_Activity* activity, Trace& trace, std::vector<PendingApi>& api) {
  switch (activity->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(activity);
      KernelRecord r;
      r.mangled_name = k->name ? k->name : "";
      r.name = demangle(k->name);
      copy_placement(r, k);
      r.grid = {unsigned(k->gridX), unsigned(k->gridY), unsigned(k->gridZ)};
      r.block = {unsigned(k->blockX), unsigned(k->blockY), unsigned(k->blockZ)};
      r.registers_per_thread = k->registersPerThread;
      r.static_shared_bytes = k->staticSharedMemory;
      r.dynamic_shared_bytes = k->dynamicSharedMemory;
      r.local_bytes_per_thread = k->localMemoryPerThread;
      trace.kernels.push_back(std::move(r));
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(activity);
      MemcpyRecord r;
      r.kind = memcpy_kind(m->copyKind);
      r.bytes = m->bytes;
      copy_placement(r, m);
      trace.memcpys.push_back(r);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(activity);
      MemsetRecord r;
      r.bytes = m->bytes;
      r.value = m->value;
      copy_placement(r, m);
      trace.memsets.push_back(r);
      break;
    }
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER: {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(activity);
      PendingApi p;
      p.record.domain = activity->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? ApiDomain::Runtime : ApiDomain::Driver;
      p.record.start_ns = a->start;
      p.record.end_ns = a->end;
      p.record.correlation_id = a->correlationId;
      p.record.thread_id = a->threadId;
      p.record.process_id = a->processId;
      p.cbid = a->cbid;
      api.push_back(p);
      break;
    }
    default: break;
  }
}

}  // namespace stitchcuda::profile::detail
