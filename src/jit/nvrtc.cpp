// Finds and loads libnvrtc once per process; every failure says where it looked.
#include "nvrtc.hpp"

#include <mutex>

#include <stitchcuda/detail/dynamic_library.hpp>

namespace stitchcuda::jit::detail {
namespace {

using stitchcuda::detail::in_toolkit;
using stitchcuda::detail::LibrarySearch;
using stitchcuda::detail::load_library;
using stitchcuda::detail::Setting;
using stitchcuda::detail::torch_folders;

Result<NvrtcApi> load() {
  LibrarySearch search{"libnvrtc.so.13", Setting::nvrtc, {"libnvrtc.so.13"},
                       "NVRTC (libnvrtc.so.13) was not found: install the CUDA 13 toolkit at /usr/local/cuda, "
                       "set CUDA_HOME, or set STITCHCUDA_NVRTC to the library's path"};
  for (const std::string& path : in_toolkit("libnvrtc.so.13")) search.candidates.push_back(path);
  search.candidates.push_back("/usr/local/cuda-13.0/lib64/libnvrtc.so.13");
  for (const std::string& folder : torch_folders()) search.candidates.push_back(folder + "/libnvrtc.so.13");
  auto lib = load_library(search);
  if (!lib) return tl::unexpected(lib.error());
  const std::string& path = lib->path;
  NvrtcApi api;
  bool ok = lib->bind(api.GetErrorString, "nvrtcGetErrorString") && lib->bind(api.Version, "nvrtcVersion") &&
            lib->bind(api.GetNumSupportedArchs, "nvrtcGetNumSupportedArchs") &&
            lib->bind(api.GetSupportedArchs, "nvrtcGetSupportedArchs") &&
            lib->bind(api.CreateProgram, "nvrtcCreateProgram") &&
            lib->bind(api.DestroyProgram, "nvrtcDestroyProgram") &&
            lib->bind(api.CompileProgram, "nvrtcCompileProgram") && lib->bind(api.GetPTXSize, "nvrtcGetPTXSize") &&
            lib->bind(api.GetPTX, "nvrtcGetPTX") && lib->bind(api.GetCUBINSize, "nvrtcGetCUBINSize") &&
            lib->bind(api.GetCUBIN, "nvrtcGetCUBIN") && lib->bind(api.GetProgramLogSize, "nvrtcGetProgramLogSize") &&
            lib->bind(api.GetProgramLog, "nvrtcGetProgramLog") &&
            lib->bind(api.AddNameExpression, "nvrtcAddNameExpression") &&
            lib->bind(api.GetLoweredName, "nvrtcGetLoweredName");
  if (!ok)
    return fail(ErrorCode::Unavailable, "the NVRTC at '" + path +
                                            "' lacks required functions: use the NVRTC of CUDA 12.4 or newer");
  api.path = path;
  api.Version(&api.major, &api.minor);
  return api;
}

}  // namespace

Result<const NvrtcApi*> nvrtc() {
  static std::once_flag once;
  static Result<NvrtcApi> loaded = fail(ErrorCode::Internal, "not loaded");
  std::call_once(once, [] { loaded = load(); });
  if (!loaded) return tl::unexpected(loaded.error());
  return &*loaded;
}

}  // namespace stitchcuda::jit::detail
