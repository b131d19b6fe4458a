// Turning stitchcuda::Error values into the typed Python exceptions of stitchcuda.errors.
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <initializer_list>
#include <string>

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

/// Raises InvalidArgumentError with `message` (which names the problem and the fix).
[[noreturn]] inline void invalid(const std::string& message) {
  throw_error(Error{ErrorCode::InvalidArgument, message, {}, {}});
}

/// An option dict's unknown key is an error listing the known ones: "unknown <what> 'x'; known: a, b".
inline void check_keys(const pybind11::dict& d, std::initializer_list<const char*> known, const char* what) {
  for (auto [k, v] : d) {
    const std::string key = pybind11::str(k);
    if (std::none_of(known.begin(), known.end(), [&](const char* n) { return key == n; })) {
      std::string list;
      for (auto n : known) {
        if (!list.empty()) list += ", ";
        list += n;
      }
      invalid("unknown " + std::string(what) + " '" + key + "'; known: " + list);
    }
  }
}

}  // namespace stitchcuda::bindings
