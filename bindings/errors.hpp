// Turning stitchcuda::Error values into the typed Python exceptions of stitchcuda.errors.
#pragma once

#include <pybind11/pybind11.h>

#include <stitchcuda/error.hpp>

namespace stitchcuda::bindings {

/// Raises the Python exception matching `e.code` (stitchcuda.errors._from_native builds it).
[[noreturn]] void throw_error(const Error& e);

/// The value of a Result, or the matching Python exception.
template <class T>
T unwrap(Result<T>&& r) {
  if (!r) throw_error(r.error());
  return std::move(*r);
}

/// Raises if a Result<void> failed.
inline void unwrap(Result<void>&& r) {
  if (!r) throw_error(r.error());
}

}  // namespace stitchcuda::bindings
