// Trace summaries and the Chrome JSON export, from synthetic records: overlapping streams, gaps,
// zero-length and untimed records, unsorted input, host calls sharing a correlation id.
#include <string>

#include <nlohmann/json.hpp>

#include <stitchcuda/profile.hpp>

#include "catch_shim.hpp"

using namespace stitchcuda::profile;
using stitchcuda_test::contains;

namespace {

KernelRecord kernel(std::string name, std::uint64_t start, std::uint64_t end, std::uint32_t stream = 1,
                    std::uint32_t correlation = 0) {
  KernelRecord k;
  k.name = name;
  k.mangled_name = "_Z" + name;
  k.start_ns = start;
  k.end_ns = end;
  k.stream_id = stream;
  k.correlation_id = correlation;
  k.grid = {4, 2, 1};
  k.block = {128, 1, 1};
  return k;
}

ApiRecord api(std::string name, ApiDomain domain, std::uint64_t start, std::uint64_t end, std::uint32_t correlation,
              std::uint32_t thread = 7) {
  ApiRecord a;
  a.name = std::move(name);
  a.domain = domain;
  a.start_ns = start;
  a.end_ns = end;
  a.correlation_id = correlation;
  a.thread_id = thread;
  return a;
}

}  // namespace

TEST_CASE("an empty trace summarises to zeros", "[profile]") {
  const TraceSummary s = Trace{}.summary();
  CHECK(s.span_ns == 0);
  CHECK(s.busy_ns == 0);
  CHECK(s.gaps.count == 0);
  CHECK(s.kernel_launches == 0);
  CHECK(s.kernels.empty());
  CHECK(s.busy_fraction() == 0.0);
  CHECK(s.gap_fraction() == 0.0);
  CHECK(s.api_ns_per_launch == 0.0);
}

TEST_CASE("busy time is the union of overlapping activities on two streams", "[profile]") {
  Trace t;
  // Stream 1: [1100,1200) and [1300,1400); stream 2 overlaps both: [1150,1350). Union [1100,1400).
  t.kernels = {kernel("a", 1100, 1200, 1), kernel("b", 1300, 1400, 1), kernel("c", 1150, 1350, 2)};
  // After an idle 100 ns, a copy, then a memset that starts exactly when the copy ends (no gap).
  MemcpyRecord copy;
  copy.start_ns = 1500;
  copy.end_ns = 1600;
  copy.bytes = 4096;
  MemsetRecord set;
  set.start_ns = 1600;
  set.end_ns = 1650;
  t.memcpys = {copy};
  t.memsets = {set};

  const TraceSummary s = t.summary();
  CHECK(s.span_ns == 550);
  CHECK(s.busy_ns == 450);
  CHECK(s.gaps.total_ns == 100);
  CHECK(s.gaps.count == 1);
  CHECK(s.gaps.largest_ns == 100);
  CHECK(s.kernel_launches == 3);
  CHECK(s.memcpy_count == 1);
  CHECK(s.memset_count == 1);
  CHECK(s.kernel_ns == 100 + 100 + 200);  // overlap counted per kernel
  CHECK(s.busy_fraction() == Approx(450.0 / 550.0));
  CHECK(s.busy_ns + s.gaps.total_ns == s.span_ns);
}

TEST_CASE("gaps come out the same from unsorted input; zero-length and untimed records take no time", "[profile]") {
  Trace t;
  t.kernels = {kernel("k", 1060, 1070), kernel("k", 1000, 1010), kernel("k", 1020, 1030),
               kernel("k", 1040, 1040),  // zero length, inside the second gap: must not split it
               kernel("k", 0, 0)};       // CUPTI could not time it: must not stretch the span to 0
  const TraceSummary s = t.summary();
  CHECK(s.span_ns == 70);
  CHECK(s.busy_ns == 30);
  CHECK(s.gaps.count == 2);
  CHECK(s.gaps.total_ns == 40);
  CHECK(s.gaps.largest_ns == 30);
  CHECK(s.kernel_launches == 5);
  REQUIRE(s.kernels.size() == 1);
  CHECK(s.kernels[0].count == 5);
  CHECK(s.kernels[0].min_ns == 0);
  CHECK(s.kernels[0].max_ns == 10);
  CHECK(s.gap_fraction() == Approx(40.0 / 70.0));
}

TEST_CASE("a kernel nested inside a longer one adds no busy time", "[profile]") {
  Trace t;
  t.kernels = {kernel("outer", 100, 1000, 1), kernel("inner", 200, 300, 2), kernel("after", 1000, 1100, 1)};
  const TraceSummary s = t.summary();
  CHECK(s.busy_ns == 1000);
  CHECK(s.span_ns == 1000);
  CHECK(s.gaps.count == 0);
}

TEST_CASE("identical intervals on two streams count once; a lone copy is a trace too", "[profile]") {
  Trace t;
  t.kernels = {kernel("x", 500, 900, 1), kernel("x", 500, 900, 2)};
  TraceSummary s = t.summary();
  CHECK(s.busy_ns == 400);
  CHECK(s.span_ns == 400);
  CHECK(s.kernel_ns == 800);
  CHECK(s.busy_fraction() == Approx(1.0));

  Trace copies;
  MemcpyRecord copy;
  copy.start_ns = 10;
  copy.end_ns = 30;
  copies.memcpys = {copy, copy};
  s = copies.summary();
  CHECK(s.kernel_launches == 0);
  CHECK(s.kernels.empty());
  CHECK(s.memcpy_count == 2);
  CHECK(s.busy_ns == 20);
  CHECK(s.gaps.count == 0);
}

TEST_CASE("kernels are grouped by name, longest total first, ties by name", "[profile]") {
  Trace t;
  t.kernels = {kernel("relu", 0, 50),      kernel("gemm", 100, 200), kernel("relu", 300, 350),
               kernel("gemm", 400, 700),   kernel("relu", 800, 850), kernel("copy", 900, 1300)};
  const TraceSummary s = t.summary();
  REQUIRE(s.kernels.size() == 3);
  CHECK(s.kernels[0].name == "copy");  // 400 ns, ties with gemm and sorts first by name
  CHECK(s.kernels[1].name == "gemm");
  CHECK(s.kernels[2].name == "relu");
  const KernelGroup& gemm = s.kernels[1];
  CHECK(gemm.count == 2);
  CHECK(gemm.total_ns == 400);
  CHECK(gemm.mean_ns == Approx(200.0));
  CHECK(gemm.min_ns == 100);
  CHECK(gemm.max_ns == 300);
  CHECK(gemm.share == Approx(400.0 / 950.0));
  CHECK(s.kernels[2].count == 3);
  CHECK(s.kernels[2].mean_ns == Approx(50.0));
  double shares = 0;
  for (const auto& g : s.kernels) shares += g.share;
  CHECK(shares == Approx(1.0));
}

TEST_CASE("host time per launch takes the outermost call of each correlation id", "[profile]") {
  Trace t;
  t.kernels = {kernel("a", 1000, 1100, 1, 1), kernel("b", 1200, 1300, 1, 2), kernel("c", 1400, 1500, 1, 3)};
  // Launch 1: a runtime call wrapping a driver call with the same id (50 ns, not 80). Launch 2: 20 ns.
  // Launch 3 has no traced call; an unrelated call (id 9) enqueued nothing.
  t.api_calls = {api("cudaLaunchKernel", ApiDomain::Runtime, 0, 50, 1), api("cuLaunchKernel", ApiDomain::Driver, 10, 40, 1),
                 api("cuLaunchKernelEx", ApiDomain::Driver, 60, 80, 2), api("cuCtxSynchronize", ApiDomain::Driver, 90, 990, 9)};
  const TraceSummary s = t.summary();
  CHECK(s.launches_with_api == 2);
  CHECK(s.launch_api_ns == 70);
  CHECK(s.api_ns_per_launch == Approx(35.0));
}

TEST_CASE("the Chrome trace has one complete event per record, tracks per stream and thread", "[profile]") {
  Trace t;
  KernelRecord k = kernel("scale<float>(float*, \"q\")", 10'000, 12'500, 3, 1);
  k.registers_per_thread = 32;
  k.dynamic_shared_bytes = 1024;
  t.kernels = {k, kernel("other", 13'000, 14'000, 4, 2)};
  MemcpyRecord copy;
  copy.kind = MemcpyKind::HostToDevice;
  copy.bytes = 64;
  copy.start_ns = 9'000;
  copy.end_ns = 9'500;
  copy.stream_id = 3;
  t.memcpys = {copy};
  t.api_calls = {api("cuLaunchKernelEx", ApiDomain::Driver, 8'000, 8'750, 1, 42)};

  const nlohmann::json doc = nlohmann::json::parse(t.to_chrome_json());
  REQUIRE(doc.contains("traceEvents"));
  int complete = 0, process_names = 0, thread_names = 0, flow_starts = 0, flow_ends = 0;
  for (const auto& e : doc["traceEvents"]) {
    REQUIRE(e.contains("ph"));
    REQUIRE(e.contains("pid"));
    if (e["ph"] == "X") {
      ++complete;
      CHECK(e.contains("tid"));
      CHECK(e.contains("ts"));
      CHECK(e.contains("dur"));
      CHECK(e.contains("cat"));
    } else if (e["ph"] == "M" && e["name"] == "process_name") {
      ++process_names;
    } else if (e["ph"] == "M" && e["name"] == "thread_name") {
      ++thread_names;
    } else if (e["ph"] == "s") {
      ++flow_starts;  // the launch call of correlation 1, on host thread 42
      CHECK(e["id"] == 1);
      CHECK(e["tid"] == 42);
    } else if (e["ph"] == "f") {
      ++flow_ends;  // the kernel it launched, on stream 3
      CHECK(e["id"] == 1);
      CHECK(e["tid"] == 3);
      CHECK(e["bp"] == "e");
      CHECK(e["ts"].get<double>() == Approx(2.0));
    }
  }
  CHECK(complete == 4);
  CHECK(process_names == 2);  // GPU 0 and the host
  CHECK(thread_names == 3);   // streams 3 and 4, host thread 42
  CHECK(flow_starts == 1);    // only correlation 1 has a traced launch call
  CHECK(flow_ends == 1);

  bool saw_kernel = false, saw_api = false, saw_copy = false;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] != "X") continue;
    if (e["name"] == "scale<float>(float*, \"q\")") {
      saw_kernel = true;
      CHECK(e["cat"] == "kernel");
      CHECK(e["tid"] == 3);
      // Times are microseconds from the earliest record (the API call at 8000 ns).
      CHECK(e["ts"].get<double>() == Approx(2.0));
      CHECK(e["dur"].get<double>() == Approx(2.5));
      CHECK(e["args"]["grid"] == nlohmann::json::array({4, 2, 1}));
      CHECK(e["args"]["registers"] == 32);
      CHECK(e["args"]["dynamic_shared_bytes"] == 1024);
      CHECK(e["args"]["correlation"] == 1);
    } else if (e["cat"] == "cuda_driver") {
      saw_api = true;
      CHECK(e["name"] == "cuLaunchKernelEx");
      CHECK(e["tid"] == 42);
      CHECK(e["ts"].get<double>() == Approx(0.0));
      CHECK(e["pid"] != t.kernels[0].device + 100);  // host and GPU are separate processes
    } else if (e["cat"] == "memcpy") {
      saw_copy = true;
      CHECK(e["name"] == "Memcpy HtoD");
      CHECK(e["args"]["bytes"] == 64);
    }
  }
  CHECK(saw_kernel);
  CHECK(saw_api);
  CHECK(saw_copy);
}

TEST_CASE("an empty trace exports valid JSON with no events", "[profile]") {
  const nlohmann::json doc = nlohmann::json::parse(Trace{}.to_chrome_json());
  CHECK(doc["traceEvents"].empty());
}

TEST_CASE("memcpy kinds have stable short names", "[profile]") {
  CHECK(std::string(to_string(MemcpyKind::HostToDevice)) == "HtoD");
  CHECK(std::string(to_string(MemcpyKind::DeviceToHost)) == "DtoH");
  CHECK(std::string(to_string(MemcpyKind::DeviceToDevice)) == "DtoD");
  CHECK(std::string(to_string(MemcpyKind::Unknown)) == "Unknown");
  CHECK(contains(to_string(MemcpyKind::PeerToPeer), "PtoP"));
}
