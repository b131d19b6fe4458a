// The CUPTI Activity API behind Tracer: libcupti.so.13 is loaded at run time (never linked), records
// arrive in buffers CUPTI hands back on its own thread, and every failure becomes an Unavailable value.
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <stitchcuda/profile.hpp>

#include <stitchcuda/detail/cuda_driver.hpp>
#include "activity.hpp"
#include "cupti.hpp"

namespace stitchcuda::profile {
namespace {

using detail::CuptiApi;
using detail::cupti;
using detail::cupti_error;
using detail::PendingApi;

// ---- state shared with CUPTI's callbacks (plain function pointers, so it lives at namespace scope) ----

struct Recording {
  std::mutex mutex;
  bool active = false;
  std::size_t buffer_bytes = 8u << 20;
  Trace trace;
  std::vector<PendingApi> pending_api;  // names resolved in stop(), outside CUPTI's callbacks
  CUpti_SubscriberHandle subscriber = nullptr;
  std::vector<CUpti_ActivityKind> enabled;
  std::vector<std::pair<CUpti_CallbackDomain, CUpti_CallbackId>> disabled_calls;  // switched off one by one
  std::uint64_t since = 0;  // CUPTI time at the end of the warm-up; earlier records are the warm-up's
};

// Never destroyed, for the same reason as cupti(): callbacks can outlive static destructors.
Recording& recording() {
  static Recording* r = new Recording;
  return *r;
}

// CUPTI asks for an empty buffer (records 8-byte aligned) on the thread that is launching work. Fresh
// anonymous pages are zero and page-aligned, and only the pages records reach get touched; start()
// tells CUPTI the buffers come zeroed, or it clears all 8 MiB there, in the application's path. (What it
// did to the tracing overhead: docs/profile.md.)
void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records) {
  std::size_t bytes;
  {
    std::lock_guard lock(recording().mutex);
    bytes = recording().buffer_bytes;
  }
  void* pages = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  *buffer = pages == MAP_FAILED ? nullptr : static_cast<std::uint8_t*>(pages);
  *size = *buffer ? bytes : 0;
  *max_records = 0;  // as many as fit
}

// CUPTI hands back a filled buffer (on its own thread, or inside cuptiActivityFlushAll).
void CUPTIAPI buffer_completed(CUcontext context, std::uint32_t stream_id, std::uint8_t* buffer, std::size_t size,
                               std::size_t valid_bytes) {
  auto api = cupti();
  Recording& rec = recording();
  if (api && buffer) {
    std::lock_guard lock(rec.mutex);
    // A buffer completed after stop() belongs to no one: drop its records.
    if (rec.active) {
      CUpti_Activity* record = nullptr;
      while ((*api)->ActivityGetNextRecord(buffer, valid_bytes, &record) == CUPTI_SUCCESS) detail::append_activity(record, rec.trace, rec.pending_api);
      std::size_t dropped = 0;
      if ((*api)->ActivityGetNumDroppedRecords(context, stream_id, &dropped) == CUPTI_SUCCESS)
        rec.trace.dropped_records += dropped;
    }
  }
  if (buffer) munmap(buffer, size);
}

// The subscription only claims CUPTI, so that a second client is refused instead of stealing buffers.
void CUPTIAPI ignore_callback(void*, CUpti_CallbackDomain, CUpti_CallbackId, const void*) {}

void disable_kinds(const CuptiApi& api, Recording& rec) {
  // The calls switched off one by one go back on while their kind is still enabled (where turning them
  // on changes nothing), then the kinds go off: the next client starts from CUPTI's default.
  for (auto [domain, cbid] : rec.disabled_calls)
    (domain == CUPTI_CB_DOMAIN_RUNTIME_API ? api.ActivityEnableRuntimeApi : api.ActivityEnableDriverApi)(cbid, 1);
  rec.disabled_calls.clear();
  for (CUpti_ActivityKind kind : rec.enabled) api.ActivityDisable(kind);
  rec.enabled.clear();
}

// The calls a trace needs to place GPU work on the host timeline: launches (kernels, graphs, host
// functions), copies, memsets and synchronizations. PyTorch makes several other runtime and driver calls
// per launch (device queries, error checks); recording each costs CUPTI a record in the launching thread.
bool launches_or_moves_work(std::string_view name) {
  for (std::string_view part : {"Launch", "Memcpy", "Memset", "Synchronize"})
    if (name.find(part) != std::string_view::npos) return true;
  return false;
}

// With the RUNTIME and DRIVER kinds enabled (every call), switches off the records of the calls
// launches_or_moves_work() does not select, call by call; a call whose name CUPTI cannot give stays on.
// (Disabling from "all" is CUPTI's documented path; a later ActivityEnable of the kind restores all.)
CUptiResult keep_only_work_calls(const CuptiApi& api, Recording& rec) {
  for (auto [domain, count] : {std::pair{CUPTI_CB_DOMAIN_RUNTIME_API, int(CUPTI_RUNTIME_TRACE_CBID_SIZE)},
                               std::pair{CUPTI_CB_DOMAIN_DRIVER_API, int(CUPTI_DRIVER_TRACE_CBID_SIZE)}}) {
    auto enable = domain == CUPTI_CB_DOMAIN_RUNTIME_API ? api.ActivityEnableRuntimeApi : api.ActivityEnableDriverApi;
    for (int cbid = 1; cbid < count; ++cbid) {
      const char* name = nullptr;
      if (api.GetCallbackName(domain, CUpti_CallbackId(cbid), &name) != CUPTI_SUCCESS || !name) continue;
      if (launches_or_moves_work(name)) continue;
      if (CUptiResult r = enable(CUpti_CallbackId(cbid), 0); r != CUPTI_SUCCESS) return r;
      rec.disabled_calls.emplace_back(domain, CUpti_CallbackId(cbid));
    }
  }
  return CUPTI_SUCCESS;
}

// Leaves CUPTI as it was found, so torch.profiler or Nsight can attach after us (their buffers are not
// zeroed: CUPTI must go back to clearing them).
void disable_all(const CuptiApi& api, Recording& rec) {
  disable_kinds(api, rec);
  if (api.ActivitySetAttribute) {
    std::uint8_t zeroed = 0;
    std::size_t zeroed_size = sizeof zeroed;
    api.ActivitySetAttribute(CUPTI_ACTIVITY_ATTR_ZEROED_OUT_ACTIVITY_BUFFER, &zeroed_size, &zeroed);
  }
  if (rec.subscriber) {
    api.Unsubscribe(rec.subscriber);
    rec.subscriber = nullptr;
  }
}

// An empty kernel in PTX: the driver compiles it for whatever GPU is present (sm_75 and newer).
constexpr char kWarmUpPtx[] = R"(.version 8.0
.target sm_75
.address_size 64
.visible .entry stitchcuda_tracer_warm_up()
{
  ret;
}
)";

// A fixed cost per trace scope showed inside the traced work (bench profile, two lengths of the same
// workload; docs/profile.md has the numbers); most likely CUPTI preparing its kernel timing for the
// context at the first launch after the kinds are enabled (on Hopper it times kernels with semaphores
// written around each launch). One empty kernel on a private stream, launched and waited for here,
// pays it in start(). Returns the CUPTI time after it (records before it belong to the
// warm-up and are dropped), or 0 when there was nothing to warm: no current context (the first launch
// will pay instead) or a driver call failed (tracing goes on without it).
std::uint64_t warm_up(const CuptiApi& cupti_api) {
  auto loaded = jit::detail::driver();
  if (!loaded) return 0;
  const jit::detail::DriverApi& api = **loaded;
  CUcontext ctx = nullptr;
  if (api.CtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) return 0;
  static CUlibrary library = [&] {
    CUlibrary lib = nullptr;
    if (api.LibraryLoadData(&lib, kWarmUpPtx, nullptr, nullptr, 0, nullptr, nullptr, 0) != CUDA_SUCCESS) return CUlibrary{};
    return lib;
  }();
  CUkernel kernel = nullptr;
  if (!library || api.LibraryGetKernel(&kernel, library, "stitchcuda_tracer_warm_up") != CUDA_SUCCESS) return 0;
  CUstream stream = nullptr;
  if (api.StreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return 0;
  CUlaunchConfig config{};
  config.gridDimX = config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = config.blockDimY = config.blockDimZ = 1;
  config.hStream = stream;
  bool ran = api.LaunchKernelEx(&config, reinterpret_cast<CUfunction>(kernel), nullptr, nullptr) == CUDA_SUCCESS &&
             api.StreamSynchronize(stream) == CUDA_SUCCESS;
  api.StreamDestroy(stream);
  std::uint64_t now = 0;
  if (!ran || cupti_api.GetTimestamp(&now) != CUPTI_SUCCESS) return 0;
  return now;
}

// Removes what the warm-up recorded: every record that began before `since`.
void drop_before(std::uint64_t since, Trace& trace, std::vector<PendingApi>& pending) {
  if (!since) return;
  auto early = [since](const auto& r) { return r.start_ns < since; };
  std::erase_if(trace.kernels, early);
  std::erase_if(trace.memcpys, early);
  std::erase_if(trace.memsets, early);
  std::erase_if(pending, [since](const PendingApi& p) { return p.record.start_ns < since; });
}

// Guards start/stop: one Tracer per process, and no start while a stop is flushing.
std::mutex& lifecycle_mutex() {
  static std::mutex m;
  return m;
}
bool tracer_running = false;

}  // namespace

bool detail::tracer_recording() {
  std::lock_guard life(lifecycle_mutex());
  return tracer_running;
}

Result<void> Tracer::available() {
  auto api = cupti();
  if (!api) return tl::unexpected(api.error());
  return {};
}

Result<std::string> Tracer::cupti_path() {
  auto api = cupti();
  if (!api) return tl::unexpected(api.error());
  return (*api)->path;
}

Result<std::uint64_t> Tracer::timestamp_ns() {
  auto api = cupti();
  if (!api) return tl::unexpected(api.error());
  std::uint64_t now = 0;
  if (CUptiResult r = (*api)->GetTimestamp(&now); r != CUPTI_SUCCESS)
    return tl::unexpected(cupti_error(**api, r, "cuptiGetTimestamp"));
  return now;
}

Result<Tracer> Tracer::start(const TracerOptions& options) {
  std::lock_guard life(lifecycle_mutex());
  if (tracer_running)
    return fail(ErrorCode::Unavailable,
                "profiler unavailable: another stitchcuda::profile::Tracer is recording in this process; stop it "
                "before starting a new one (scopes cannot nest)");
  if (jit::Driver::device_count() <= 0) {
    auto driver = jit::Driver::available();
    return fail(ErrorCode::Unavailable, "profiler unavailable: no CUDA device to trace (" +
                                            (driver ? std::string("the driver reports no devices")
                                                    : driver.error().message) +
                                            "); run on a machine with an NVIDIA GPU");
  }
  auto loaded = cupti();
  if (!loaded) return tl::unexpected(loaded.error());
  const CuptiApi& api = **loaded;
  Recording& rec = recording();
  {
    std::lock_guard lock(rec.mutex);
    rec.trace = Trace{};
    rec.pending_api.clear();
    rec.buffer_bytes = options.buffer_bytes < 64 * 1024 ? 64 * 1024 : options.buffer_bytes;
  }

  CUptiResult r;
  std::string other;
  if (api.Subscribe_v2) {
    char other_name[CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN + 1] = {};
    CUpti_SubscriberParams params{};
    params.structSize = CUpti_SubscriberParams_STRUCT_SIZE;
    params.subscriberName = "StitchCUDA Tracer";
    params.oldSubscriberName = other_name;
    params.oldSubscriberSize = sizeof(other_name);
    r = api.Subscribe_v2(&rec.subscriber, ignore_callback, nullptr, &params);
    other = other_name;
  } else {
    r = api.Subscribe(&rec.subscriber, ignore_callback, nullptr);
  }
  if (r != CUPTI_SUCCESS) {
    rec.subscriber = nullptr;
    return tl::unexpected(cupti_error(api, r, "subscribing to CUPTI", other));
  }
  if (api.ActivitySetAttribute) {  // our buffers arrive zeroed (see buffer_requested); an old CUPTI clears them itself
    std::uint8_t zeroed = 1;
    std::size_t zeroed_size = sizeof zeroed;
    api.ActivitySetAttribute(CUPTI_ACTIVITY_ATTR_ZEROED_OUT_ACTIVITY_BUFFER, &zeroed_size, &zeroed);
  }
  if (r = api.ActivityRegisterCallbacks(buffer_requested, buffer_completed); r != CUPTI_SUCCESS) {
    disable_all(api, rec);
    return tl::unexpected(cupti_error(api, r, "registering activity buffers"));
  }
  std::vector<CUpti_ActivityKind> kinds;
  if (options.kernels) kinds.push_back(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  if (options.memory) {
    kinds.push_back(CUPTI_ACTIVITY_KIND_MEMCPY);
    kinds.push_back(CUPTI_ACTIVITY_KIND_MEMSET);
  }
  // Per-call selection needs CUDA 12.2's CUPTI; an older one records every call.
  const bool select_calls = options.api_calls && !options.all_api_calls && api.ActivityEnableRuntimeApi &&
                            api.ActivityEnableDriverApi;
  if (options.api_calls) {
    kinds.push_back(CUPTI_ACTIVITY_KIND_RUNTIME);
    kinds.push_back(CUPTI_ACTIVITY_KIND_DRIVER);
  }
  {
    std::lock_guard lock(rec.mutex);
    rec.active = true;
  }
  for (CUpti_ActivityKind kind : kinds) {
    if (r = api.ActivityEnable(kind); r != CUPTI_SUCCESS) {
      {
        std::lock_guard lock(rec.mutex);
        rec.active = false;
      }
      disable_all(api, rec);
      return tl::unexpected(cupti_error(api, r, "enabling activity kind " + std::to_string(int(kind))));
    }
    rec.enabled.push_back(kind);
  }
  if (select_calls) {
    if (r = keep_only_work_calls(api, rec); r != CUPTI_SUCCESS) {
      {
        std::lock_guard lock(rec.mutex);
        rec.active = false;
      }
      disable_all(api, rec);
      return tl::unexpected(cupti_error(api, r, "enabling the launch, copy and synchronize API records"));
    }
  }
  rec.since = options.warm_up && options.kernels ? warm_up(api) : 0;
  tracer_running = true;
  Tracer tracer;
  tracer.active_ = true;
  return tracer;
}

Result<Trace> Tracer::stop() {
  if (!active_)
    return fail(ErrorCode::InvalidArgument, "this Tracer was already stopped (or moved from): start a new one");
  active_ = false;
  std::lock_guard life(lifecycle_mutex());
  auto loaded = cupti();
  if (!loaded) return tl::unexpected(loaded.error());  // cannot happen: start() loaded it
  const CuptiApi& api = **loaded;
  Recording& rec = recording();

  // Records of work still running would arrive incomplete: wait for the device first. A fault inside
  // the scope is reported, but what was recorded is still flushed and CUPTI still released.
  // Disabling before the flush means the flush is the last delivery: nothing recorded after it is lost.
  auto synced = jit::Driver::synchronize();
  disable_kinds(api, rec);
  CUptiResult flushed = api.ActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  Trace trace;
  std::vector<PendingApi> pending;
  {
    std::lock_guard lock(rec.mutex);
    rec.active = false;
    trace = std::move(rec.trace);
    pending = std::move(rec.pending_api);
    drop_before(rec.since, trace, pending);
    rec.since = 0;
    rec.trace = Trace{};
    rec.pending_api.clear();
  }
  disable_all(api, rec);
  tracer_running = false;
  if (!synced)
    return fail(ErrorCode::LaunchError, "work inside the traced scope failed: " + synced.error().message);
  if (flushed != CUPTI_SUCCESS) return tl::unexpected(cupti_error(api, flushed, "flushing activity records"));

  for (PendingApi& p : pending) {
    const char* name = nullptr;
    const CUpti_CallbackDomain domain =
        p.record.domain == ApiDomain::Runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API;
    if (api.GetCallbackName(domain, p.cbid, &name) == CUPTI_SUCCESS && name)
      p.record.name = name;
    else
      p.record.name = "cbid " + std::to_string(p.cbid);
    trace.api_calls.push_back(std::move(p.record));
  }
  return trace;
}

Tracer::Tracer(Tracer&& other) noexcept : active_(other.active_) { other.active_ = false; }

Tracer& Tracer::operator=(Tracer&& other) noexcept {
  if (this != &other) {
    if (active_) (void)stop();
    active_ = other.active_;
    other.active_ = false;
  }
  return *this;
}

Tracer::~Tracer() {
  if (active_) (void)stop();
}

}  // namespace stitchcuda::profile
