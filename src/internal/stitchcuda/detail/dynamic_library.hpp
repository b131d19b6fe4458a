// The one loader of run-time CUDA libraries (NVRTC, nvJitLink, CUPTI, the driver, cuBLASLt): dlopen'ed, never
// linked, so the library imports and compiles on machines without them; every failure lists where it looked.
#pragma once

#include <string>
#include <type_traits>
#include <vector>

#include <stitchcuda/detail/settings.hpp>
#include <stitchcuda/error.hpp>

namespace stitchcuda::detail {

/// How to find one library. The search: the file the override variable names (only it, when set); else a
/// copy already loaded in the process (one process, one CUDA major: torch's wheels bring theirs); else each
/// of `candidates` in order — a path, or the bare soname for the dynamic loader's own search.
struct LibrarySearch {
  std::string soname;               ///< e.g. "libnvrtc.so.13"
  Setting override_variable;        ///< its STITCHCUDA_* path variable
  std::vector<std::string> candidates;
  std::string not_found;            ///< the message when none loads: the problem and the fix
};

/// A loaded library: its handle (never closed) and the file it came from.
struct DynamicLibrary {
  void* handle = nullptr;
  std::string path;

  /// Resolves `name` into `fn`; false when the library lacks it.
  template <class F>
  bool bind(F& fn, const char* name) const {
    fn = reinterpret_cast<F>(symbol(name));
    return fn != nullptr;
  }
  void* symbol(const char* name) const;
};

/// Loads the library `search` describes, or Unavailable with its not_found message and, as the error's log,
/// "looked for:" and every path tried (with the loader's reason where a file exists but would not load).
Result<DynamicLibrary> load_library(const LibrarySearch& search);

/// The CUDA toolkit's folders, most specific first: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda.
std::vector<std::string> toolkit_folders();

/// `file` in each toolkit folder's lib64.
std::vector<std::string> in_toolkit(const std::string& file);

/// The folders of the CUDA libraries torch already loaded into this process (its runtime and NVRTC: the
/// nvidia/cu13/lib of its wheels, or the toolkit it was built against), without loading anything.
std::vector<std::string> torch_folders();

}  // namespace stitchcuda::detail
