// Python face of stitchcuda::jit: compile, modules, kernels, launches on tensors, the cache, devices.
// Thin: argument conversion and error translation only; behaviour lives in src/.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <chrono>
#include <optional>

#include <stitchcuda/jit.hpp>
#include <stitchcuda/torch.hpp>

#include "errors.hpp"

namespace py = pybind11;
using namespace stitchcuda;

namespace stitchcuda::bindings {
namespace {

// A module plus the source it came from, so kernels can learn their declared signature.
struct PyModule {
  std::shared_ptr<jit::Module> module;
  std::string source;
};

struct PyKernel {
  jit::Kernel kernel;
  std::vector<std::string> signature;
};

jit::PchMode pch_mode(const std::string& s) {
  if (s == "off") return jit::PchMode::Off;
  if (s == "auto") return jit::PchMode::Auto;
  if (s == "on") return jit::PchMode::On;
  throw_error(Error{ErrorCode::InvalidArgument, "pch = '" + s + "' is not one of 'off', 'auto', 'on'", {}, {}});
}

jit::CompileOptions to_options(const py::dict& d) {
  static const char* known[] = {"arch", "std", "include_paths", "defines", "headers", "fast_math", "line_info",
                                "max_registers", "name_expressions", "pch", "extra_flags", "device_runtime",
                                "confined"};
  jit::CompileOptions o;
  for (auto [k, v] : d) {
    std::string key = py::str(k);
    if (std::find_if(std::begin(known), std::end(known), [&](const char* n) { return key == n; }) == std::end(known)) {
      std::string list;
      for (auto n : known) list += (list.empty() ? "" : ", ") + std::string(n);
      throw_error(Error{ErrorCode::InvalidArgument, "unknown compile option '" + key + "'; known options: " + list, {}, {}});
    }
    if (v.is_none()) continue;
    if (key == "arch") o.arch = v.cast<std::string>();
    else if (key == "std") o.cpp_standard = v.cast<int>();
    else if (key == "include_paths") o.include_paths = v.cast<std::vector<std::string>>();
    else if (key == "defines")
      for (auto [name, value] : v.cast<py::dict>())
        o.defines.emplace_back(py::str(name), value.is_none() ? std::string() : std::string(py::str(value)));
    else if (key == "headers")
      for (auto [name, text] : v.cast<py::dict>()) o.headers.emplace_back(py::str(name), py::str(text));
    else if (key == "fast_math") o.fast_math = v.cast<bool>();
    else if (key == "line_info") o.line_info = v.cast<bool>();
    else if (key == "max_registers") o.max_registers = v.cast<int>();
    else if (key == "name_expressions") o.name_expressions = v.cast<std::vector<std::string>>();
    else if (key == "pch") o.pch = pch_mode(v.cast<std::string>());
    else if (key == "extra_flags") o.extra_flags = v.cast<std::vector<std::string>>();
    else if (key == "device_runtime") o.device_runtime = v.cast<bool>();
    else if (key == "confined") o.confined = v.cast<bool>();
  }
  return o;
}

jit::Dim3 to_dim3(const py::handle& h, const char* what, jit::Dim3 dflt = {}) {
  if (h.is_none()) return dflt;
  if (PyLong_Check(h.ptr())) {
    long long v = h.cast<long long>();
    if (v < 0 || v > 0xffffffffLL)
      throw_error(Error{ErrorCode::InvalidArgument, std::string(what) + " = " + std::to_string(v) + " is out of range", {}, {}});
    return jit::Dim3{unsigned(v), 1, 1};
  }
  if (py::isinstance<py::tuple>(h) || py::isinstance<py::list>(h)) {
    auto seq = h.cast<py::sequence>();
    if (seq.size() < 1 || seq.size() > 3)
      throw_error(Error{ErrorCode::InvalidArgument, std::string(what) + " must have 1 to 3 dimensions", {}, {}});
    unsigned d[3] = {1, 1, 1};
    for (std::size_t i = 0; i < seq.size(); ++i) {
      long long v = seq[i].cast<long long>();
      if (v < 0 || v > 0xffffffffLL)
        throw_error(Error{ErrorCode::InvalidArgument, std::string(what) + " dimension " + std::to_string(i) + " = " +
                                                          std::to_string(v) + " is out of range", {}, {}});
      d[i] = unsigned(v);
    }
    return jit::Dim3{d[0], d[1], d[2]};
  }
  throw_error(Error{ErrorCode::InvalidArgument, std::string(what) + " must be an int or a tuple of 1 to 3 ints", {}, {}});
}

void* to_stream(const py::handle& h) {
  if (h.is_none()) return nullptr;
  if (PyLong_Check(h.ptr())) return reinterpret_cast<void*>(h.cast<std::uintptr_t>());
  if (py::hasattr(h, "cuda_stream")) return reinterpret_cast<void*>(h.attr("cuda_stream").cast<std::uintptr_t>());
  throw_error(Error{ErrorCode::InvalidArgument, "stream must be None, an int handle or a torch.cuda.Stream", {}, {}});
}

// Tensors stay referenced by `keep` for the duration of the call.
std::vector<torch::Arg> to_args(const py::handle& seq_h, std::vector<at::Tensor>& keep) {
  if (!py::isinstance<py::sequence>(seq_h) || py::isinstance<py::str>(seq_h))
    throw_error(Error{ErrorCode::InvalidArgument, "args must be a list or tuple", {}, {}});
  auto seq = py::reinterpret_borrow<py::sequence>(seq_h);
  const std::size_t n = seq.size();
  keep.reserve(n);
  std::vector<torch::Arg> out;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    py::object a = seq[i];
    PyObject* p = a.ptr();
    if (THPVariable_Check(p)) {
      keep.push_back(THPVariable_Unpack(p));
      out.emplace_back(&keep.back());
    } else if (PyBool_Check(p)) {
      out.emplace_back(p == Py_True);
    } else if (PyLong_Check(p)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(p, &overflow);
      if (overflow)
        throw_error(Error{ErrorCode::InvalidArgument, "argument " + std::to_string(i) + " does not fit in 64 bits", {}, {}});
      out.emplace_back(std::int64_t(v));
    } else if (PyFloat_Check(p)) {
      out.emplace_back(PyFloat_AsDouble(p));
    } else {
      throw_error(Error{ErrorCode::InvalidArgument, "argument " + std::to_string(i) + " has type " +
                                                        std::string(py::str(py::type::handle_of(a).attr("__name__"))) +
                                                        "; kernels take tensors, ints, floats and bools", {}, {}});
    }
  }
  return out;
}

py::dict device_dict(const jit::DeviceInfo& d) {
  py::dict out;
  out["index"] = d.index;
  out["name"] = d.name;
  out["cc_major"] = d.cc_major;
  out["cc_minor"] = d.cc_minor;
  out["multiprocessors"] = d.multiprocessors;
  out["total_memory"] = d.total_memory;
  out["max_threads_per_block"] = d.max_threads_per_block;
  out["max_shared_per_block_optin"] = d.max_shared_per_block_optin;
  out["max_shared_per_multiprocessor"] = d.max_shared_per_multiprocessor;
  out["l2_bytes"] = d.l2_bytes;
  out["clock_khz"] = d.clock_khz;
  out["arch"] = d.arch();
  return out;
}

}  // namespace

void bind_jit(py::module_& m) {
  m.def("nvrtc_version", [] { return unwrap(jit::Compiler::nvrtc_version()); });
  m.def("nvrtc_path", [] { return unwrap(jit::Compiler::nvrtc_path()); });
  m.def("supported_archs", [] { return unwrap(jit::Compiler::supported_archs()); });
  m.def("default_arch", &jit::Compiler::default_arch);
  m.def("system_include_paths", &jit::Compiler::system_include_paths);
  m.def("declared_signature", &jit::declared_signature, py::arg("source"), py::arg("kernel_name"));
  m.def("check_includes", [](const std::string& source, const py::dict& options, const std::string& program_name) {
    unwrap(jit::check_includes(source, to_options(options), program_name));
  }, py::arg("source"), py::arg("options"), py::arg("program_name") = "kernel.cu");
  m.def("confine_includes", &jit::confine_includes);
  m.def("includes_confined", &jit::includes_confined);

  m.def("driver_available", [] {
    auto ok = jit::Driver::available();
    return py::make_tuple(bool(ok), ok ? std::string() : ok.error().message);
  });
  m.def("driver_version", [] { return unwrap(jit::Driver::version()); });
  m.def("device_count", &jit::Driver::device_count);
  m.def("device_info", [](int i) { return device_dict(unwrap(jit::Driver::device(i))); }, py::arg("index") = 0);
  m.def("synchronize", [](int device) {
    Result<void> r;
    {
      py::gil_scoped_release release;
      r = jit::Driver::synchronize(device);
    }
    unwrap(std::move(r));
  }, py::arg("device") = -1);

  py::class_<PyKernel>(m, "Kernel")
      .def_property_readonly("name", [](const PyKernel& k) { return k.kernel.name(); })
      .def_property_readonly("symbol", [](const PyKernel& k) { return k.kernel.symbol(); })
      .def_property("signature", [](const PyKernel& k) { return k.signature; },
                    [](PyKernel& k, std::vector<std::string> s) { k.signature = std::move(s); })
      .def_property_readonly("params", [](const PyKernel& k) {
        py::list out;
        for (auto& p : k.kernel.params()) out.append(py::make_tuple(jit::to_string(p.kind), p.size));
        return out;
      })
      .def("attributes", [](const PyKernel& k, int device) {
        auto a = unwrap(k.kernel.attributes(device));
        py::dict d;
        d["num_registers"] = a.num_registers;
        d["static_shared_bytes"] = a.static_shared_bytes;
        d["max_dynamic_shared_bytes"] = a.max_dynamic_shared_bytes;
        d["local_bytes"] = a.local_bytes;
        d["const_bytes"] = a.const_bytes;
        d["max_threads_per_block"] = a.max_threads_per_block;
        d["ptx_version"] = a.ptx_version;
        d["binary_version"] = a.binary_version;
        return d;
      }, py::arg("device") = -1)
      .def("max_active_blocks_per_sm", [](const PyKernel& k, int block, std::size_t smem, int device) {
        return unwrap(k.kernel.max_active_blocks_per_sm(block, smem, device));
      }, py::arg("block_size"), py::arg("shared_mem") = 0, py::arg("device") = -1)
      .def("launch", [](const PyKernel& k, py::handle grid, py::handle block, py::handle args, std::size_t shared_mem,
                        py::handle stream, py::handle cluster, py::handle signature) {
        jit::LaunchConfig cfg;
        cfg.grid = to_dim3(grid, "grid");
        cfg.block = to_dim3(block, "block");
        cfg.cluster = to_dim3(cluster, "cluster", jit::Dim3{0, 0, 0});
        cfg.shared_mem_bytes = shared_mem;
        cfg.stream = to_stream(stream);
        std::vector<at::Tensor> keep;
        auto converted = to_args(args, keep);
        if (signature.is_none()) {
          unwrap(torch::launch(k.kernel, cfg, converted, k.signature));
        } else {
          unwrap(torch::launch(k.kernel, cfg, converted, signature.cast<std::vector<std::string>>()));
        }
      }, py::arg("grid"), py::arg("block"), py::arg("args"), py::arg("shared_mem") = 0, py::arg("stream") = py::none(),
         py::arg("cluster") = py::none(), py::arg("signature") = py::none());

  py::class_<PyModule>(m, "Module")
      .def_property_readonly("arch", [](const PyModule& m) { return m.module->binary().arch; })
      .def_property_readonly("ptx", [](const PyModule& m) { return m.module->binary().ptx; })
      .def_property_readonly("cubin", [](const PyModule& m) { return py::bytes(m.module->binary().cubin); })
      .def_property_readonly("log", [](const PyModule& m) { return m.module->binary().log; })
      .def_property_readonly("key", [](const PyModule& m) { return m.module->binary().key; })
      .def_property_readonly("compile_ms", [](const PyModule& m) { return m.module->compile_ms(); })
      .def_property_readonly("origin", [](const PyModule& m) { return m.module->origin(); })
      .def_property_readonly("kernel_names", [](const PyModule& m) {
        std::vector<std::string> out;
        for (auto& k : m.module->binary().kernels) out.push_back(k.name);
        return out;
      })
      .def_property_readonly("lowered_names", [](const PyModule& m) {
        py::dict d;
        for (auto& [expr, symbol] : m.module->binary().lowered_names) d[py::str(expr)] = symbol;
        return d;
      })
      .def("kernel", [](PyModule& m, const std::string& name) {
        Result<jit::Kernel> k = fail(ErrorCode::Internal, "unset");
        {
          py::gil_scoped_release release;
          k = m.module->kernel(name);
        }
        return PyKernel{unwrap(std::move(k)), jit::declared_signature(m.source, name)};
      }, py::arg("name"));

  m.def("compile", [](const std::string& source, const std::string& program_name, const py::dict& options, bool cache) {
    auto opts = to_options(options);
    Result<std::shared_ptr<jit::Module>> mod = fail(ErrorCode::Internal, "unset");
    {
      // Compiles take long enough that other Python threads should run meanwhile.
      py::gil_scoped_release release;
      if (cache) {
        mod = jit::KernelCache::global()->get(source, opts, program_name);
      } else {
        auto bin = jit::Compiler::compile(source, opts, program_name);
        if (bin) mod = jit::Module::create(std::make_shared<const jit::Binary>(std::move(*bin)));
        else mod = tl::unexpected(bin.error());
      }
    }
    return PyModule{unwrap(std::move(mod)), source};
  }, py::arg("source"), py::arg("program_name") = "kernel.cu", py::arg("options") = py::dict(), py::arg("cache") = true);
  m.def("cache_key", [](const std::string& source, const std::string& program_name, const py::dict& options) {
    return unwrap(jit::Compiler::cache_key(source, to_options(options), program_name));
  }, py::arg("source"), py::arg("program_name") = "kernel.cu", py::arg("options") = py::dict());

  m.def("cache_stats", [] {
    auto s = jit::KernelCache::global()->stats();
    py::dict d;
    d["memory_hits"] = s.memory_hits;
    d["disk_hits"] = s.disk_hits;
    d["misses"] = s.misses;
    d["compiles"] = s.compiles;
    d["corrupt_entries"] = s.corrupt_entries;
    d["disk_errors"] = s.disk_errors;
    return d;
  });
  m.def("cache_clear_memory", [] { jit::KernelCache::global()->clear_memory(); });
  m.def("cache_dir", [] { return jit::KernelCache::global()->dir(); });
  m.def("cache_warning", [] { return jit::KernelCache::global()->warning(); });
  m.def("set_cache_dir", [](const std::string& dir) { unwrap(jit::KernelCache::set_global_dir(dir)); }, py::arg("path"));
  m.def("default_cache_dir", &jit::KernelCache::default_dir);
  m.def("cache_entry_path", [](const std::string& key) { return jit::KernelCache::global()->entry_path(key); });

  // Host time per launch from C++, with arguments packed once: what a C++ server pays.
  m.def("bench_launch_us", [](const PyKernel& k, py::handle grid, py::handle block, py::handle args, int n,
                              bool prepared) {
    jit::LaunchConfig cfg;
    cfg.grid = to_dim3(grid, "grid");
    cfg.block = to_dim3(block, "block");
    std::vector<at::Tensor> keep;
    auto converted = to_args(args, keep);
    int device = -1;
    auto packed = unwrap(torch::pack(k.kernel, converted, k.signature, device));
    if (device < 0) device = 0;
    cfg.device = device;
    cfg.stream = torch::current_stream(device);
    unwrap(k.kernel.launch(cfg, packed));  // warm-up, and proof the arguments are right
    // prepared: validated once, then only the driver call per launch (a C++ server replaying steps).
    std::optional<jit::PreparedLaunch> ready;
    if (prepared) ready.emplace(unwrap(k.kernel.prepare(cfg, packed)));
    std::vector<double> us(std::size_t(std::max(n, 1)));
    {
      py::gil_scoped_release release;
      // Drain the queue every `batch` launches (untimed): once the driver's queue is full, a launch
      // waits for the GPU and the number would be kernel time, not host overhead.
      const std::size_t batch = 200;
      for (std::size_t i = 0; i < us.size(); ++i) {
        if (i % batch == 0 && !jit::Driver::synchronize(device)) break;
        auto t0 = std::chrono::steady_clock::now();
        auto r = ready ? ready->launch() : k.kernel.launch(cfg, packed);
        auto t1 = std::chrono::steady_clock::now();
        if (!r) break;
        us[i] = std::chrono::duration<double, std::micro>(t1 - t0).count();
      }
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  }, py::arg("kernel"), py::arg("grid"), py::arg("block"), py::arg("args"), py::arg("n") = 10000,
     py::arg("prepared") = false);
}

}  // namespace stitchcuda::bindings
