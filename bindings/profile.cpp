// Python face of stitchcuda::profile (as the submodule stitchcuda._C.profile): the Tracer and its
// records, summaries, Chrome JSON, roofline diagnosis and range-profiler metrics. Thin: conversion only.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include <stitchcuda/profile.hpp>

#include "errors.hpp"

namespace py = pybind11;
using namespace stitchcuda;
using namespace stitchcuda::profile;

namespace stitchcuda::bindings {
namespace {

py::tuple dim3(const jit::Dim3& d) { return py::make_tuple(d.x, d.y, d.z); }

jit::Dim3 to_dim3(const py::sequence& s) {
  if (s.size() != 3) throw_error(Error{ErrorCode::InvalidArgument, "grid and block are (x, y, z) tuples", {}, {}});
  return jit::Dim3{s[0].cast<unsigned>(), s[1].cast<unsigned>(), s[2].cast<unsigned>()};
}

MemcpyKind memcpy_kind(const std::string& s) {
  for (MemcpyKind k : {MemcpyKind::Unknown, MemcpyKind::HostToDevice, MemcpyKind::DeviceToHost, MemcpyKind::DeviceToDevice,
                       MemcpyKind::HostToHost, MemcpyKind::PeerToPeer, MemcpyKind::Array})
    if (s == to_string(k)) return k;
  throw_error(Error{ErrorCode::InvalidArgument, "memcpy kind '" + s + "' is not one of HtoD, DtoH, DtoD, HtoH, PtoP, Array, Unknown", {}, {}});
}

const char* unit_name(MathUnit u) { return u == MathUnit::Bf16Tensor ? "bf16_tensor" : "fp32"; }

MathUnit unit_of(const std::string& s) {
  if (s == "fp32") return MathUnit::Fp32;
  if (s == "bf16_tensor") return MathUnit::Bf16Tensor;
  throw_error(Error{ErrorCode::InvalidArgument, "math unit '" + s + "' is not 'fp32' or 'bf16_tensor'", {}, {}});
}

template <class T>
std::string repr_of(const char* type, const T& r) {
  return std::string("<") + type + " " + r.name + " " + std::to_string(r.duration_ns()) + " ns>";
}

}  // namespace

void bind_profile(py::module_& parent) {
  py::module_ m = parent.def_submodule("profile", "stitchcuda::profile: CUPTI tracing, metrics, diagnosis");

  py::class_<KernelRecord>(m, "KernelRecord", "One kernel execution on the GPU (timestamps in ns, CUPTI's clock).")
      .def(py::init<>())
      .def_readwrite("name", &KernelRecord::name)
      .def_readwrite("mangled_name", &KernelRecord::mangled_name)
      .def_readwrite("start_ns", &KernelRecord::start_ns)
      .def_readwrite("end_ns", &KernelRecord::end_ns)
      .def_property_readonly("duration_ns", &KernelRecord::duration_ns)
      .def_property("grid", [](const KernelRecord& r) { return dim3(r.grid); },
                    [](KernelRecord& r, const py::sequence& s) { r.grid = to_dim3(s); })
      .def_property("block", [](const KernelRecord& r) { return dim3(r.block); },
                    [](KernelRecord& r, const py::sequence& s) { r.block = to_dim3(s); })
      .def_readwrite("registers_per_thread", &KernelRecord::registers_per_thread)
      .def_readwrite("static_shared_bytes", &KernelRecord::static_shared_bytes)
      .def_readwrite("dynamic_shared_bytes", &KernelRecord::dynamic_shared_bytes)
      .def_readwrite("local_bytes_per_thread", &KernelRecord::local_bytes_per_thread)
      .def_readwrite("stream_id", &KernelRecord::stream_id)
      .def_readwrite("correlation_id", &KernelRecord::correlation_id)
      .def_readwrite("graph_id", &KernelRecord::graph_id)
      .def_readwrite("device", &KernelRecord::device)
      .def("__repr__", [](const KernelRecord& r) { return repr_of("KernelRecord", r); });

  py::class_<MemcpyRecord>(m, "MemcpyRecord", "One memory copy on the GPU.")
      .def(py::init<>())
      .def_property("kind", [](const MemcpyRecord& r) { return std::string(to_string(r.kind)); },
                    [](MemcpyRecord& r, const std::string& s) { r.kind = memcpy_kind(s); })
      .def_readwrite("bytes", &MemcpyRecord::bytes)
      .def_readwrite("start_ns", &MemcpyRecord::start_ns)
      .def_readwrite("end_ns", &MemcpyRecord::end_ns)
      .def_property_readonly("duration_ns", &MemcpyRecord::duration_ns)
      .def_readwrite("stream_id", &MemcpyRecord::stream_id)
      .def_readwrite("correlation_id", &MemcpyRecord::correlation_id)
      .def_readwrite("graph_id", &MemcpyRecord::graph_id)
      .def_readwrite("device", &MemcpyRecord::device);

  py::class_<MemsetRecord>(m, "MemsetRecord", "One memset on the GPU.")
      .def(py::init<>())
      .def_readwrite("bytes", &MemsetRecord::bytes)
      .def_readwrite("value", &MemsetRecord::value)
      .def_readwrite("start_ns", &MemsetRecord::start_ns)
      .def_readwrite("end_ns", &MemsetRecord::end_ns)
      .def_property_readonly("duration_ns", &MemsetRecord::duration_ns)
      .def_readwrite("stream_id", &MemsetRecord::stream_id)
      .def_readwrite("correlation_id", &MemsetRecord::correlation_id)
      .def_readwrite("graph_id", &MemsetRecord::graph_id)
      .def_readwrite("device", &MemsetRecord::device);

  py::class_<ApiRecord>(m, "ApiRecord", "One CUDA runtime or driver call on a host thread.")
      .def(py::init<>())
      .def_readwrite("name", &ApiRecord::name)
      .def_property("domain", [](const ApiRecord& r) { return r.domain == ApiDomain::Runtime ? "runtime" : "driver"; },
                    [](ApiRecord& r, const std::string& s) {
                      if (s != "runtime" && s != "driver")
                        throw_error(Error{ErrorCode::InvalidArgument, "domain is 'runtime' or 'driver'", {}, {}});
                      r.domain = s == "runtime" ? ApiDomain::Runtime : ApiDomain::Driver;
                    })
      .def_readwrite("start_ns", &ApiRecord::start_ns)
      .def_readwrite("end_ns", &ApiRecord::end_ns)
      .def_property_readonly("duration_ns", &ApiRecord::duration_ns)
      .def_readwrite("correlation_id", &ApiRecord::correlation_id)
      .def_readwrite("thread_id", &ApiRecord::thread_id)
      .def_readwrite("process_id", &ApiRecord::process_id)
      .def("__repr__", [](const ApiRecord& r) { return repr_of("ApiRecord", r); });

  py::class_<IdleGaps>(m, "IdleGaps", "Idle periods of the GPU between activities.")
      .def_readonly("total_ns", &IdleGaps::total_ns)
      .def_readonly("count", &IdleGaps::count)
      .def_readonly("largest_ns", &IdleGaps::largest_ns);

  py::class_<KernelGroup>(m, "KernelGroup", "Launches of kernels sharing one name.")
      .def_readonly("name", &KernelGroup::name)
      .def_readonly("count", &KernelGroup::count)
      .def_readonly("total_ns", &KernelGroup::total_ns)
      .def_readonly("mean_ns", &KernelGroup::mean_ns)
      .def_readonly("min_ns", &KernelGroup::min_ns)
      .def_readonly("max_ns", &KernelGroup::max_ns)
      .def_readonly("share", &KernelGroup::share);

  py::class_<TraceSummary>(m, "TraceSummary", "Numbers derived from a Trace's records.")
      .def_readonly("span_ns", &TraceSummary::span_ns)
      .def_readonly("busy_ns", &TraceSummary::busy_ns)
      .def_readonly("gaps", &TraceSummary::gaps)
      .def_readonly("kernel_launches", &TraceSummary::kernel_launches)
      .def_readonly("memcpy_count", &TraceSummary::memcpy_count)
      .def_readonly("memset_count", &TraceSummary::memset_count)
      .def_readonly("kernel_ns", &TraceSummary::kernel_ns)
      .def_readonly("kernels", &TraceSummary::kernels)
      .def_readonly("launches_with_api", &TraceSummary::launches_with_api)
      .def_readonly("launch_api_ns", &TraceSummary::launch_api_ns)
      .def_readonly("api_ns_per_launch", &TraceSummary::api_ns_per_launch)
      .def_property_readonly("busy_fraction", &TraceSummary::busy_fraction)
      .def_property_readonly("gap_fraction", &TraceSummary::gap_fraction);

  py::class_<Trace>(m, "Trace", "Everything one Tracer scope recorded.")
      .def(py::init<>())
      .def_readwrite("kernels", &Trace::kernels)
      .def_readwrite("memcpys", &Trace::memcpys)
      .def_readwrite("memsets", &Trace::memsets)
      .def_readwrite("api_calls", &Trace::api_calls)
      .def_readwrite("dropped_records", &Trace::dropped_records)
      .def("summary", &Trace::summary)
      .def("to_chrome_json", &Trace::to_chrome_json);

  py::class_<Tracer>(m, "Tracer", "Records GPU activity through CUPTI between start() and stop().")
      .def_static("start", [](bool kernels, bool memory, bool api_calls, bool all_api_calls, bool warm_up,
                              std::size_t buffer_bytes) {
            TracerOptions o;
            o.warm_up = warm_up;
            o.kernels = kernels;
            o.memory = memory;
            o.api_calls = api_calls;
            o.all_api_calls = all_api_calls;
            o.buffer_bytes = buffer_bytes;
            return unwrap(Tracer::start(o));
          }, py::arg("kernels") = true, py::arg("memory") = true, py::arg("api_calls") = true,
          py::arg("all_api_calls") = false, py::arg("warm_up") = true, py::arg("buffer_bytes") = TracerOptions{}.buffer_bytes)
      .def("stop", [](Tracer& t) {
            Result<Trace> r = [&] {
              py::gil_scoped_release release;  // synchronizes the device
              return t.stop();
            }();
            return unwrap(std::move(r));
          })
      .def_property_readonly("active", &Tracer::active);

  m.def("available", [] {
    auto r = Tracer::available();
    return py::make_tuple(bool(r), r ? std::string() : r.error().message);
  });
  m.def("cupti_path", [] { return unwrap(Tracer::cupti_path()); });
  m.def("timestamp_ns", [] { return unwrap(Tracer::timestamp_ns()); });

  py::class_<DeviceCeilings>(m, "DeviceCeilings", "The ceilings a kernel is measured against (H200 by default).")
      .def(py::init([](const std::string& name, double fp32, double bf16, double dram, double launch, double tf32) {
             DeviceCeilings c;
             c.name = name;
             c.fp32_flops_per_s = fp32;
             c.bf16_tensor_flops_per_s = bf16;
             c.dram_bytes_per_s = dram;
             c.launch_overhead_ns = launch;
             c.tf32_tensor_flops_per_s = tf32;
             return c;
           }), py::arg("name") = DeviceCeilings{}.name, py::arg("fp32_flops_per_s") = DeviceCeilings{}.fp32_flops_per_s,
           py::arg("bf16_tensor_flops_per_s") = DeviceCeilings{}.bf16_tensor_flops_per_s,
           py::arg("dram_bytes_per_s") = DeviceCeilings{}.dram_bytes_per_s,
           py::arg("launch_overhead_ns") = DeviceCeilings{}.launch_overhead_ns,
           py::arg("tf32_tensor_flops_per_s") = DeviceCeilings{}.tf32_tensor_flops_per_s)
      .def_readwrite("name", &DeviceCeilings::name)
      .def_readwrite("fp32_flops_per_s", &DeviceCeilings::fp32_flops_per_s)
      .def_readwrite("bf16_tensor_flops_per_s", &DeviceCeilings::bf16_tensor_flops_per_s)
      .def_readwrite("tf32_tensor_flops_per_s", &DeviceCeilings::tf32_tensor_flops_per_s)
      .def_readwrite("dram_bytes_per_s", &DeviceCeilings::dram_bytes_per_s)
      .def_readwrite("launch_overhead_ns", &DeviceCeilings::launch_overhead_ns)
      .def_static("h200", &DeviceCeilings::h200)
      .def_static("for_device", &DeviceCeilings::for_device, py::arg("device_name"),
                  "The table's ceilings for a device name (torch.cuda.get_device_name()), or None when unknown.");

  py::class_<DiagnosisRules>(m, "DiagnosisRules", "Thresholds of the classification.")
      .def(py::init<>())
      .def_readwrite("launch_gap_share", &DiagnosisRules::launch_gap_share)
      .def_readwrite("latency_below", &DiagnosisRules::latency_below)
      .def_readwrite("near_roof", &DiagnosisRules::near_roof)
      .def_readwrite("low_occupancy", &DiagnosisRules::low_occupancy);

  py::class_<KernelMeasurement>(m, "KernelMeasurement", "What is known about a kernel; unknown values are None.")
      .def(py::init([](const std::string& name, double duration_ns, std::optional<double> flops,
                       std::optional<double> dram_bytes, std::optional<double> achieved_occupancy, const std::string& unit,
                       std::size_t launches, double gap_ns, std::optional<double> sm_throughput,
                       std::optional<double> memory_throughput) {
             KernelMeasurement k;
             k.name = name;
             k.duration_ns = duration_ns;
             k.flops = flops;
             k.dram_bytes = dram_bytes;
             k.achieved_occupancy = achieved_occupancy;
             k.unit = unit_of(unit);
             k.launches = launches;
             k.gap_ns = gap_ns;
             k.sm_throughput = sm_throughput;
             k.memory_throughput = memory_throughput;
             return k;
           }), py::arg("name") = "", py::arg("duration_ns") = 0.0, py::arg("flops") = py::none(),
           py::arg("dram_bytes") = py::none(), py::arg("achieved_occupancy") = py::none(), py::arg("unit") = "fp32",
           py::arg("launches") = 1, py::arg("gap_ns") = 0.0, py::arg("sm_throughput") = py::none(),
           py::arg("memory_throughput") = py::none())
      .def_readwrite("name", &KernelMeasurement::name)
      .def_readwrite("duration_ns", &KernelMeasurement::duration_ns)
      .def_readwrite("flops", &KernelMeasurement::flops)
      .def_readwrite("dram_bytes", &KernelMeasurement::dram_bytes)
      .def_readwrite("achieved_occupancy", &KernelMeasurement::achieved_occupancy)
      .def_property("unit", [](const KernelMeasurement& k) { return unit_name(k.unit); },
                    [](KernelMeasurement& k, const std::string& s) { k.unit = unit_of(s); })
      .def_readwrite("launches", &KernelMeasurement::launches)
      .def_readwrite("gap_ns", &KernelMeasurement::gap_ns)
      .def_readwrite("sm_throughput", &KernelMeasurement::sm_throughput)
      .def_readwrite("memory_throughput", &KernelMeasurement::memory_throughput)
      .def_static("from_summary", &KernelMeasurement::from, py::arg("summary"), py::arg("name") = "trace");

  py::class_<Finding>(m, "Finding", "A kernel placed on the roofline, with the numbers behind its class.")
      .def_readonly("name", &Finding::name)
      .def_property_readonly("bound", [](const Finding& f) { return std::string(to_string(f.bound)); })
      .def_readonly("roofline_fraction", &Finding::roofline_fraction)
      .def_readonly("sol_ns", &Finding::sol_ns)
      .def_readonly("duration_ns", &Finding::duration_ns)
      .def_readonly("compute_fraction", &Finding::compute_fraction)
      .def_readonly("memory_fraction", &Finding::memory_fraction)
      .def_readonly("arithmetic_intensity", &Finding::arithmetic_intensity)
      .def_readonly("ridge_intensity", &Finding::ridge_intensity)
      .def_readonly("achieved_occupancy", &Finding::achieved_occupancy)
      .def_readonly("launches", &Finding::launches)
      .def_readonly("gap_share", &Finding::gap_share)
      .def_readonly("measured", &Finding::measured);

  m.def("classify", [](const KernelMeasurement& k, const DeviceCeilings& c, const DiagnosisRules& r) { return classify(k, c, r); },
        py::arg("measurement"), py::arg("ceilings") = DeviceCeilings{}, py::arg("rules") = DiagnosisRules{});
  m.def("advise_finding", [](const Finding& f, const DiagnosisRules& r) { return advise(f, r); }, py::arg("finding"),
        py::arg("rules") = DiagnosisRules{});
  m.def("advise_summary", [](const TraceSummary& s, const DeviceCeilings& c, const DiagnosisRules& r) { return advise(s, c, r); },
        py::arg("summary"), py::arg("ceilings") = DeviceCeilings{}, py::arg("rules") = DiagnosisRules{});

  py::class_<KernelMetrics>(m, "KernelMetrics", "Hardware metrics of one kernel launch (range profiler).")
      .def_readonly("name", &KernelMetrics::name)
      .def_readonly("index", &KernelMetrics::index)
      .def_readonly("sm_throughput_pct", &KernelMetrics::sm_throughput_pct)
      .def_readonly("memory_throughput_pct", &KernelMetrics::memory_throughput_pct)
      .def_readonly("dram_throughput_pct", &KernelMetrics::dram_throughput_pct)
      .def_readonly("l1_throughput_pct", &KernelMetrics::l1_throughput_pct)
      .def_readonly("l2_throughput_pct", &KernelMetrics::l2_throughput_pct)
      .def_readonly("achieved_occupancy_pct", &KernelMetrics::achieved_occupancy_pct)
      .def_readonly("duration_ns", &KernelMetrics::duration_ns)
      .def_readonly("dram_bytes_read", &KernelMetrics::dram_bytes_read)
      .def_readonly("dram_bytes_written", &KernelMetrics::dram_bytes_written)
      .def_property_readonly("values", [](const KernelMetrics& k) {
        py::dict d;
        for (const auto& [name, v] : k.values) d[py::str(name)] = v;
        return d;
      })
      .def("measurement", &KernelMetrics::measurement)
      .def("__repr__", [](const KernelMetrics& k) {
        return "<KernelMetrics #" + std::to_string(k.index) + " " + k.name + " sm " + std::to_string(k.sm_throughput_pct) +
               "% dram " + std::to_string(k.dram_throughput_pct) + "%>";
      });
  m.def("make_kernel_metrics", &make_kernel_metrics, py::arg("name"), py::arg("index"), py::arg("values"));
  m.def("speed_of_light_metrics", &speed_of_light_metrics);
  m.def("collect_metrics", [](const std::function<void()>& workload, const std::vector<std::string>& metrics,
                              std::size_t max_kernels, int device) {
          MetricsOptions o;
          o.metrics = metrics;
          o.max_kernels = max_kernels;
          o.device = device;
          return unwrap(Metrics::collect(workload, o));  // the GIL stays held: the workload is Python
        }, py::arg("workload"), py::arg("metrics") = std::vector<std::string>{},
        py::arg("max_kernels") = MetricsOptions{}.max_kernels, py::arg("device") = -1);
  m.def("validate_metrics", [](const std::vector<std::string>& metrics, const std::string& chip) {
          unwrap(Metrics::validate(metrics, chip));
        }, py::arg("metrics"), py::arg("chip"));
  m.def("metric_passes", [](const std::vector<std::string>& metrics, const std::string& chip) {
          return unwrap(Metrics::passes(metrics, chip));
        }, py::arg("metrics"), py::arg("chip"));
  m.def("supported_chips", [] { return unwrap(Metrics::supported_chips()); });
  m.def("chip_name", [](int device) { return unwrap(Metrics::chip_name(device)); }, py::arg("device") = 0);
}

}  // namespace stitchcuda::bindings
