// CUPTI's activity records (hand-built with the CUDA 13 layouts) converted into StitchCUDA's records:
// every field the Tracer reports is checked here, without a GPU.
#include <string>
#include <vector>

#include "profile/activity.hpp"

#include "catch_shim.hpp"

using namespace stitchcuda::profile;
using stitchcuda::profile::detail::append_activity;
using stitchcuda::profile::detail::demangle;
using stitchcuda::profile::detail::PendingApi;

TEST_CASE("a concurrent-kernel record becomes a KernelRecord with a demangled name", "[profile]") {
  CUpti_ActivityKernel10 k{};
  k.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
  k.name = "_Z5scaleIfEvPT_S0_i";
  k.start = 1000;
  k.end = 3500;
  k.gridX = 8192;
  k.gridY = 2;
  k.gridZ = 1;
  k.blockX = 128;
  k.blockY = 1;
  k.blockZ = 1;
  k.registersPerThread = 18;
  k.staticSharedMemory = 256;
  k.dynamicSharedMemory = 4096;
  k.localMemoryPerThread = 16;
  k.streamId = 13;
  k.correlationId = 77;
  k.graphId = 5;
  k.deviceId = 1;
  Trace trace;
  std::vector<PendingApi> api;
  append_activity(reinterpret_cast<const CUpti_Activity*>(&k), trace, api);
  REQUIRE(trace.kernels.size() == 1);
  const KernelRecord& r = trace.kernels[0];
  CHECK(r.name == "void scale<float>(float*, float, int)");
  CHECK(r.mangled_name == "_Z5scaleIfEvPT_S0_i");
  CHECK(r.start_ns == 1000);
  CHECK(r.end_ns == 3500);
  CHECK(r.duration_ns() == 2500);
  CHECK(r.grid.x == 8192);
  CHECK(r.grid.y == 2);
  CHECK(r.block.x == 128);
  CHECK(r.registers_per_thread == 18);
  CHECK(r.static_shared_bytes == 256);
  CHECK(r.dynamic_shared_bytes == 4096);
  CHECK(r.local_bytes_per_thread == 16);
  CHECK(r.stream_id == 13);
  CHECK(r.correlation_id == 77);
  CHECK(r.graph_id == 5);
  CHECK(r.device == 1);
  CHECK(api.empty());
}

TEST_CASE("extern \"C\" and missing kernel names are kept as they are", "[profile]") {
  CHECK(demangle("add") == "add");
  CHECK(demangle(nullptr).empty());
  CHECK(demangle("_Z3fooi") == "foo(int)");
}

TEST_CASE("memcpy, memset and API records are converted; other kinds are ignored", "[profile]") {
  Trace trace;
  std::vector<PendingApi> api;

  CUpti_ActivityMemcpy6 copy{};
  copy.kind = CUPTI_ACTIVITY_KIND_MEMCPY;
  copy.copyKind = CUPTI_ACTIVITY_MEMCPY_KIND_DTOH;
  copy.bytes = 1 << 20;
  copy.start = 10;
  copy.end = 20;
  copy.streamId = 3;
  copy.correlationId = 4;
  append_activity(reinterpret_cast<const CUpti_Activity*>(&copy), trace, api);

  CUpti_ActivityMemset4 set{};
  set.kind = CUPTI_ACTIVITY_KIND_MEMSET;
  set.bytes = 512;
  set.value = 0xff;
  set.start = 30;
  set.end = 35;
  set.streamId = 3;
  append_activity(reinterpret_cast<const CUpti_Activity*>(&set), trace, api);

  CUpti_ActivityAPI call{};
  call.kind = CUPTI_ACTIVITY_KIND_RUNTIME;
  call.cbid = 211;
  call.start = 1;
  call.end = 9;
  call.threadId = 1234;
  call.processId = 99;
  call.correlationId = 4;
  append_activity(reinterpret_cast<const CUpti_Activity*>(&call), trace, api);
  call.kind = CUPTI_ACTIVITY_KIND_DRIVER;
  append_activity(reinterpret_cast<const CUpti_Activity*>(&call), trace, api);

  CUpti_Activity other{};
  other.kind = CUPTI_ACTIVITY_KIND_MARKER;
  append_activity(&other, trace, api);

  REQUIRE(trace.memcpys.size() == 1);
  CHECK(trace.memcpys[0].kind == MemcpyKind::DeviceToHost);
  CHECK(trace.memcpys[0].bytes == (1u << 20));
  CHECK(trace.memcpys[0].duration_ns() == 10);
  CHECK(trace.memcpys[0].correlation_id == 4);
  REQUIRE(trace.memsets.size() == 1);
  CHECK(trace.memsets[0].bytes == 512);
  CHECK(trace.memsets[0].value == 0xff);
  REQUIRE(api.size() == 2);
  CHECK(api[0].record.domain == ApiDomain::Runtime);
  CHECK(api[1].record.domain == ApiDomain::Driver);
  CHECK(api[0].cbid == 211);
  CHECK(api[0].record.thread_id == 1234);
  CHECK(api[0].record.process_id == 99);
  CHECK(api[0].record.correlation_id == 4);
  CHECK(api[0].record.duration_ns() == 8);
  CHECK(trace.kernels.empty());
  CHECK(detail::memcpy_kind(CUPTI_ACTIVITY_MEMCPY_KIND_HTOA) == MemcpyKind::Array);
  CHECK(detail::memcpy_kind(200) == MemcpyKind::Unknown);
}
