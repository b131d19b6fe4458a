// The pybind11 module stitchcuda._C: one bind_* function per layer, and error translation.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stitchcuda/detail/settings.hpp>
#include <stitchcuda/secrets.hpp>

#include "errors.hpp"

namespace py = pybind11;

namespace stitchcuda::bindings {

void bind_jit(py::module_& m);
void bind_llm(py::module_& m);
void bind_profile(py::module_& m);
void bind_program(py::module_& m);
void bind_rubric(py::module_& m);
void bind_agents(py::module_& m);

void throw_error(const Error& e) {
  py::list diagnostics;
  for (auto& d : e.diagnostics)
    diagnostics.append(py::make_tuple(d.file, d.line, d.column, d.severity, d.message, d.source_line));
  py::object make = py::module_::import("stitchcuda.errors").attr("_from_native");
  py::object exc = make(to_string(e.code), e.message, e.log, diagnostics, e.http_status, e.transient);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

}  // namespace stitchcuda::bindings

PYBIND11_MODULE(_C, m) {
  m.doc() = "StitchCUDA native core (see the stitchcuda package for the Python API)";
  m.def("version", [] { return std::string(stitchcuda::version()); });
  py::module_ sm = m.def_submodule("secrets", "the process's secrets, scrubbed by value from what is written or sent");
  sm.def("remember", [](const std::string& value) { stitchcuda::secrets::remember(value); }, py::arg("value"));
  sm.def("remember_environment", &stitchcuda::secrets::remember_environment);
  sm.def("redact", [](const std::string& text) { return stitchcuda::secrets::redact(text); }, py::arg("text"));
  sm.def("looks_secret", [](const std::string& name) { return stitchcuda::secrets::looks_secret(name); });
  sm.def("count", &stitchcuda::secrets::count);
  // The C++ side's rows of the settings table (stitchcuda.settings lists them beside the Python ones).
  m.def("cpp_settings", [] {
    py::list rows;
    for (const auto& row : stitchcuda::detail::settings_table())
      rows.append(py::dict(py::arg("name") = std::string(row.name), py::arg("type") = std::string(row.type),
                           py::arg("fallback") = std::string(row.fallback),
                           py::arg("reason") = std::string(row.reason)));
    return rows;
  });
  stitchcuda::bindings::bind_jit(m);
  stitchcuda::bindings::bind_llm(m);
  stitchcuda::bindings::bind_profile(m);
  stitchcuda::bindings::bind_program(m);
  stitchcuda::bindings::bind_rubric(m);
  stitchcuda::bindings::bind_agents(m);
}
