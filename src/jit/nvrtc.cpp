// Finds and loads libnvrtc once per process; every failure says where it looked.
#include "nvrtc.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <vector>

namespace stitchcuda::jit::detail {
namespace {

template <class F>
bool bind(void* lib, F& fn, const char* name) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  return fn != nullptr;
}

Result<NvrtcApi> load() {
  std::vector<std::string> tried;
  void* lib = nullptr;
  std::string path;
  auto attempt = [&](const std::string& candidate, int extra_flags) {
    if (lib) return;
    tried.push_back(candidate);
    lib = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL | extra_flags);
    if (lib) path = candidate;
  };
  if (const char* env = std::getenv("STITCHCUDA_NVRTC"); env && *env) {
    attempt(env, 0);
    if (!lib)
      return fail(ErrorCode::Unavailable,
                  std::string("STITCHCUDA_NVRTC points to '") + env +
                      "', which could not be loaded: point it at a libnvrtc.so.13 or unset it");
  }
  // One process, one CUDA major: prefer the NVRTC PyTorch (or anyone) already loaded.
  attempt("libnvrtc.so.13", RTLD_NOLOAD);
  attempt("libnvrtc.so.13", 0);
  if (const char* home = std::getenv("CUDA_HOME"); home && *home)
    attempt(std::string(home) + "/lib64/libnvrtc.so.13", 0);
  if (const char* home = std::getenv("CUDA_PATH"); home && *home)
    attempt(std::string(home) + "/lib64/libnvrtc.so.13", 0);
  attempt("/usr/local/cuda/lib64/libnvrtc.so.13", 0);
  attempt("/usr/local/cuda-13.0/lib64/libnvrtc.so.13", 0);
  if (!lib) {
    std::string where;
    for (auto& t : tried) where += "\n  " + t;
    return fail(ErrorCode::Unavailable,
                "NVRTC (libnvrtc.so.13) was not found: install the CUDA 13 toolkit at /usr/local/cuda, "
                "set CUDA_HOME, or set STITCHCUDA_NVRTC to the library's path",
                "looked for:" + where);
  }
  NvrtcApi api;
  bool ok = bind(lib, api.GetErrorString, "nvrtcGetErrorString") && bind(lib, api.Version, "nvrtcVersion") &&
            bind(lib, api.GetNumSupportedArchs, "nvrtcGetNumSupportedArchs") &&
            bind(lib, api.GetSupportedArchs, "nvrtcGetSupportedArchs") &&
            bind(lib, api.CreateProgram, "nvrtcCreateProgram") &&
            bind(lib, api.DestroyProgram, "nvrtcDestroyProgram") &&
            bind(lib, api.CompileProgram, "nvrtcCompileProgram") && bind(lib, api.GetPTXSize, "nvrtcGetPTXSize") &&
            bind(lib, api.GetPTX, "nvrtcGetPTX") && bind(lib, api.GetCUBINSize, "nvrtcGetCUBINSize") &&
            bind(lib, api.GetCUBIN, "nvrtcGetCUBIN") && bind(lib, api.GetProgramLogSize, "nvrtcGetProgramLogSize") &&
            bind(lib, api.GetProgramLog, "nvrtcGetProgramLog") &&
            bind(lib, api.AddNameExpression, "nvrtcAddNameExpression") &&
            bind(lib, api.GetLoweredName, "nvrtcGetLoweredName");
  if (!ok)
    return fail(ErrorCode::Unavailable, "the NVRTC at '" + path +
                                            "' lacks required functions: use the NVRTC of CUDA 12.4 or newer");
  // Report the real file, not the soname we asked for.
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(api.Version), &info) && info.dli_fname) path = info.dli_fname;
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
