// Summaries of a Trace (busy time, idle gaps, per-kernel aggregates, host time per launch) and its
// Chrome / Perfetto JSON export. Pure functions of the records: tested on machines without a GPU.
#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

#include <stitchcuda/profile.hpp>

namespace stitchcuda::profile {
namespace {

struct Interval {
  std::uint64_t start, end;
};

// Every GPU activity with a positive duration: zero-length or untimed records would split a gap
// without occupying the GPU, so they take no part in busy time or gaps.
std::vector<Interval> gpu_intervals(const Trace& trace) {
  std::vector<Interval> out;
  auto add = [&](const auto& records) {
    for (const auto& r : records)
      if (r.end_ns > r.start_ns) out.push_back({r.start_ns, r.end_ns});
  };
  add(trace.kernels);
  add(trace.memcpys);
  add(trace.memsets);
  return out;
}

}  // namespace

const char* to_string(MemcpyKind kind) noexcept {
  switch (kind) {
    case MemcpyKind::HostToDevice: return "HtoD";
    case MemcpyKind::DeviceToHost: return "DtoH";
    case MemcpyKind::DeviceToDevice: return "DtoD";
    case MemcpyKind::HostToHost: return "HtoH";
    case MemcpyKind::PeerToPeer: return "PtoP";
    case MemcpyKind::Array: return "Array";
    case MemcpyKind::Unknown: break;
  }
  return "Unknown";
}

TraceSummary Trace::summary() const {
  TraceSummary s;
  s.kernel_launches = kernels.size();
  s.memcpy_count = memcpys.size();
  s.memset_count = memsets.size();

  // Busy time and gaps: sort, then sweep, merging intervals that overlap or touch.
  std::vector<Interval> intervals = gpu_intervals(*this);
  std::sort(intervals.begin(), intervals.end(),
            [](const Interval& a, const Interval& b) { return a.start < b.start; });
  if (!intervals.empty()) {
    std::uint64_t run_start = intervals.front().start, run_end = intervals.front().end;
    const std::uint64_t first = run_start;
    for (std::size_t i = 1; i < intervals.size(); ++i) {
      const Interval& next = intervals[i];
      if (next.start <= run_end) {
        run_end = std::max(run_end, next.end);
        continue;
      }
      s.busy_ns += run_end - run_start;
      const std::uint64_t gap = next.start - run_end;
      s.gaps.total_ns += gap;
      s.gaps.count += 1;
      s.gaps.largest_ns = std::max(s.gaps.largest_ns, gap);
      run_start = next.start;
      run_end = next.end;
    }
    s.busy_ns += run_end - run_start;
    s.span_ns = run_end - first;
  }

  // Per-kernel aggregates, grouped by the demangled name.
  std::map<std::string, KernelGroup> groups;
  for (const KernelRecord& k : kernels) {
    const std::uint64_t d = k.duration_ns();
    s.kernel_ns += d;
    KernelGroup& g = groups[k.name];
    if (g.count == 0) {
      g.name = k.name;
      g.min_ns = d;
    }
    g.count += 1;
    g.total_ns += d;
    g.min_ns = std::min(g.min_ns, d);
    g.max_ns = std::max(g.max_ns, d);
  }
  for (auto& [name, g] : groups) {
    g.mean_ns = double(g.total_ns) / double(g.count);
    g.share = s.kernel_ns ? double(g.total_ns) / double(s.kernel_ns) : 0.0;
    s.kernels.push_back(std::move(g));
  }
  std::stable_sort(s.kernels.begin(), s.kernels.end(),
                   [](const KernelGroup& a, const KernelGroup& b) { return a.total_ns > b.total_ns; });

  // Host time per launch: a runtime call (cudaLaunchKernel) and the driver call under it can share a
  // correlation id, so the outermost (longest) call stands for the launch, never their sum.
  std::unordered_map<std::uint32_t, std::uint64_t> call_ns;
  for (const ApiRecord& a : api_calls) {
    std::uint64_t& ns = call_ns[a.correlation_id];
    ns = std::max(ns, a.duration_ns());
  }
  std::set<std::uint32_t> counted;  // a correlation id enqueues one activity; count it once regardless
  auto attribute = [&](const auto& records) {
    for (const auto& r : records) {
      auto it = call_ns.find(r.correlation_id);
      if (r.correlation_id == 0 || it == call_ns.end() || !counted.insert(r.correlation_id).second) continue;
      s.launches_with_api += 1;
      s.launch_api_ns += it->second;
    }
  };
  attribute(kernels);
  attribute(memcpys);
  attribute(memsets);
  if (s.launches_with_api) s.api_ns_per_launch = double(s.launch_api_ns) / double(s.launches_with_api);
  return s;
}

// ---- Chrome / Perfetto trace-event JSON ----
namespace {

void append_json_string(std::string& out, std::string_view text) {
  out += '"';
  for (unsigned char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += char(c);
        }
    }
  }
  out += '"';
}

// Trace-event timestamps are microseconds; three decimals keep CUPTI's nanoseconds.
std::string micros(std::uint64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%llu.%03llu", static_cast<unsigned long long>(ns / 1000),
                static_cast<unsigned long long>(ns % 1000));
  return buf;
}

// GPU devices and the host are separate processes in the viewer; these ids keep them apart.
constexpr long kHostPid = 1;
long gpu_pid(int device) { return 100 + device; }

class EventWriter {
 public:
  explicit EventWriter(std::uint64_t origin_ns) : origin_(origin_ns) {}

  // args: pre-rendered JSON members without braces ("\"grid\":[1,1,1],...").
  void complete(std::string_view name, std::string_view category, long pid, std::uint64_t tid,
                std::uint64_t start_ns, std::uint64_t end_ns, const std::string& args) {
    begin();
    out_ += "{\"ph\":\"X\",\"name\":";
    append_json_string(out_, name);
    out_ += ",\"cat\":";
    append_json_string(out_, category);
    out_ += ",\"pid\":" + std::to_string(pid) + ",\"tid\":" + std::to_string(tid);
    const std::uint64_t start = start_ns > origin_ ? start_ns - origin_ : 0;
    out_ += ",\"ts\":" + micros(start) + ",\"dur\":" + micros(end_ns > start_ns ? end_ns - start_ns : 0);
    out_ += ",\"args\":{" + args + "}}";
  }

  // One end of a flow arrow ("s" at the launch call, "f" at the GPU work), bound to the enclosing slice.
  void flow(bool start, std::uint32_t id, long pid, std::uint64_t tid, std::uint64_t at_ns) {
    begin();
    out_ += std::string("{\"ph\":\"") + (start ? "s" : "f") + "\",\"name\":\"launch\",\"cat\":\"launch\",\"id\":" +
            std::to_string(id) + ",\"pid\":" + std::to_string(pid) + ",\"tid\":" + std::to_string(tid) +
            ",\"ts\":" + micros(at_ns > origin_ ? at_ns - origin_ : 0) + (start ? "" : ",\"bp\":\"e\"") + "}";
  }

  void name_process(long pid, const std::string& name) {
    begin();
    out_ += "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" + std::to_string(pid) + ",\"args\":{\"name\":";
    append_json_string(out_, name);
    out_ += "}}";
  }

  void name_thread(long pid, std::uint64_t tid, const std::string& name) {
    begin();
    out_ += "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" + std::to_string(pid) +
            ",\"tid\":" + std::to_string(tid) + ",\"args\":{\"name\":";
    append_json_string(out_, name);
    out_ += "}}";
  }

  std::string finish() { return "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[" + out_ + "]}"; }

 private:
  void begin() {
    if (!out_.empty()) out_ += ',';
  }
  std::uint64_t origin_;
  std::string out_;
};

// Appended piece by piece: `"[" + std::to_string(...)` trips GCC 12's false -Wrestrict warning.
std::string dim_json(const jit::Dim3& d) {
  std::string s = "[";
  s += std::to_string(d.x);
  s += ',';
  s += std::to_string(d.y);
  s += ',';
  s += std::to_string(d.z);
  s += ']';
  return s;
}

std::string field(std::string_view key, std::uint64_t value) {
  std::string s = "\"";
  s += key;
  s += "\":";
  s += std::to_string(value);
  return s;
}

}  // namespace

std::string Trace::to_chrome_json() const {
  // Times are relative to the earliest record, so the viewer opens at 0 rather than at boot time.
  std::uint64_t origin = UINT64_MAX;
  auto earliest = [&](const auto& records) {
    for (const auto& r : records)
      if (r.start_ns || r.end_ns) origin = std::min(origin, r.start_ns);
  };
  earliest(kernels);
  earliest(memcpys);
  earliest(memsets);
  earliest(api_calls);
  if (origin == UINT64_MAX) origin = 0;

  EventWriter w(origin);
  std::set<std::pair<int, std::uint32_t>> streams;  // (device, stream) tracks to label
  std::set<std::uint32_t> threads;

  for (const KernelRecord& k : kernels) {
    std::string args = "\"mangled\":";
    append_json_string(args, k.mangled_name);
    args += ",\"grid\":" + dim_json(k.grid) + ",\"block\":" + dim_json(k.block) + "," +
            field("registers", std::uint64_t(k.registers_per_thread)) + "," +
            field("static_shared_bytes", std::uint64_t(k.static_shared_bytes)) + "," +
            field("dynamic_shared_bytes", std::uint64_t(k.dynamic_shared_bytes)) + "," +
            field("local_bytes_per_thread", k.local_bytes_per_thread) + "," + field("stream", k.stream_id) + "," +
            field("correlation", k.correlation_id) + "," + field("graph", k.graph_id) + "," +
            field("device", std::uint64_t(k.device));
    w.complete(k.name, "kernel", gpu_pid(k.device), k.stream_id, k.start_ns, k.end_ns, args);
    streams.insert({k.device, k.stream_id});
  }
  for (const MemcpyRecord& m : memcpys) {
    std::string args = field("bytes", m.bytes) + ",\"kind\":\"" + to_string(m.kind) + "\"," +
                       field("stream", m.stream_id) + "," + field("correlation", m.correlation_id) + "," +
                       field("graph", m.graph_id);
    w.complete(std::string("Memcpy ") + to_string(m.kind), "memcpy", gpu_pid(m.device), m.stream_id, m.start_ns,
               m.end_ns, args);
    streams.insert({m.device, m.stream_id});
  }
  for (const MemsetRecord& m : memsets) {
    std::string args = field("bytes", m.bytes) + "," + field("value", m.value) + "," + field("stream", m.stream_id) +
                       "," + field("correlation", m.correlation_id) + "," + field("graph", m.graph_id);
    w.complete("Memset", "memset", gpu_pid(m.device), m.stream_id, m.start_ns, m.end_ns, args);
    streams.insert({m.device, m.stream_id});
  }
  for (const ApiRecord& a : api_calls) {
    std::string args = field("correlation", a.correlation_id) + "," + field("process", a.process_id);
    w.complete(a.name, a.domain == ApiDomain::Runtime ? "cuda_runtime" : "cuda_driver", kHostPid, a.thread_id,
               a.start_ns, a.end_ns, args);
    threads.insert(a.thread_id);
  }

  // Flow arrows from each launch call to the first GPU work it enqueued. The outermost call of a
  // correlation id (a runtime call wrapping a driver call) is where the arrow starts.
  std::unordered_map<std::uint32_t, const ApiRecord*> launcher;
  for (const ApiRecord& a : api_calls) {
    if (a.correlation_id == 0) continue;
    const ApiRecord*& best = launcher[a.correlation_id];
    if (!best || a.duration_ns() > best->duration_ns()) best = &a;
  }
  std::set<std::uint32_t> linked;
  auto link = [&](const auto& records) {
    for (const auto& r : records) {
      auto it = launcher.find(r.correlation_id);
      if (it == launcher.end() || !linked.insert(r.correlation_id).second) continue;
      w.flow(true, r.correlation_id, kHostPid, it->second->thread_id, it->second->start_ns);
      w.flow(false, r.correlation_id, gpu_pid(r.device), r.stream_id, r.start_ns);
    }
  };
  link(kernels);
  link(memcpys);
  link(memsets);

  std::set<int> devices;
  for (const auto& [device, stream] : streams) {
    if (devices.insert(device).second) w.name_process(gpu_pid(device), "GPU " + std::to_string(device));
    w.name_thread(gpu_pid(device), stream, "stream " + std::to_string(stream));
  }
  if (!threads.empty()) w.name_process(kHostPid, "host");
  for (std::uint32_t t : threads) w.name_thread(kHostPid, t, "thread " + std::to_string(t));
  return w.finish();
}

}  // namespace stitchcuda::profile
