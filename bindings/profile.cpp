// Bindings of the profile layer (filled in by its owner).
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace stitchcuda::bindings {

void bind_profile(py::module_& m) { (void)m; }

}  // namespace stitchcuda::bindings
