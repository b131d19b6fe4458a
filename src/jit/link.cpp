// nvJitLink found next to NVRTC (or in the toolkit), the device runtime archive, and one link.
#include "link.hpp"

#include <filesystem>
#include <mutex>
#include <vector>

#include <nvJitLink.h>

#include <stitchcuda/detail/dynamic_library.hpp>

#include "nvrtc.hpp"

namespace stitchcuda::jit::detail {
namespace {

namespace fs = std::filesystem;

// The versioned entry points of nvJitLink 13 (the header's inline wrappers call these).
struct JitLinkApi {
  decltype(&::__nvJitLinkCreate_13_0) Create = nullptr;
  decltype(&::__nvJitLinkDestroy_13_0) Destroy = nullptr;
  decltype(&::__nvJitLinkAddData_13_0) AddData = nullptr;
  decltype(&::__nvJitLinkAddFile_13_0) AddFile = nullptr;
  decltype(&::__nvJitLinkComplete_13_0) Complete = nullptr;
  decltype(&::__nvJitLinkGetLinkedCubinSize_13_0) GetLinkedCubinSize = nullptr;
  decltype(&::__nvJitLinkGetLinkedCubin_13_0) GetLinkedCubin = nullptr;
  decltype(&::__nvJitLinkGetErrorLogSize_13_0) GetErrorLogSize = nullptr;
  decltype(&::__nvJitLinkGetErrorLog_13_0) GetErrorLog = nullptr;
};

// Folders that hold the CUDA libraries of this process, most specific first: NVRTC's (torch's wheels
// keep nvJitLink and libcudadevrt.a beside it), the toolkit's.
std::vector<fs::path> library_folders() {
  std::vector<fs::path> out;
  if (auto api = nvrtc(); api && !(*api)->path.empty()) out.push_back(fs::path((*api)->path).parent_path());
  for (const std::string& home : stitchcuda::detail::toolkit_folders()) out.push_back(fs::path(home) / "lib64");
  return out;
}

Result<JitLinkApi> load() {
  stitchcuda::detail::LibrarySearch search{
      "libnvJitLink.so.13", stitchcuda::detail::Setting::nvjitlink, {},
      "nvJitLink (libnvJitLink.so.13), needed to link the CUDA device runtime, was not found: install the CUDA 13 "
      "toolkit at /usr/local/cuda, set CUDA_HOME, or set STITCHCUDA_NVJITLINK to the library's path"};
  for (const fs::path& dir : library_folders()) search.candidates.push_back((dir / "libnvJitLink.so.13").string());
  search.candidates.push_back("libnvJitLink.so.13");
  auto lib = stitchcuda::detail::load_library(search);
  if (!lib) return tl::unexpected(lib.error());
  JitLinkApi api;
  auto bind = [&](auto& fn, const char* name) { return lib->bind(fn, name); };
  bool ok = bind(api.Create, "__nvJitLinkCreate_13_0") && bind(api.Destroy, "__nvJitLinkDestroy_13_0") &&
            bind(api.AddData, "__nvJitLinkAddData_13_0") && bind(api.AddFile, "__nvJitLinkAddFile_13_0") &&
            bind(api.Complete, "__nvJitLinkComplete_13_0") &&
            bind(api.GetLinkedCubinSize, "__nvJitLinkGetLinkedCubinSize_13_0") &&
            bind(api.GetLinkedCubin, "__nvJitLinkGetLinkedCubin_13_0") &&
            bind(api.GetErrorLogSize, "__nvJitLinkGetErrorLogSize_13_0") &&
            bind(api.GetErrorLog, "__nvJitLinkGetErrorLog_13_0");
  if (!ok)
    return fail(ErrorCode::Unavailable, "the nvJitLink found lacks the CUDA 13 entry points: use the nvJitLink of "
                                        "the same CUDA 13 installation as NVRTC");
  return api;
}

Result<const JitLinkApi*> jit_link() {
  static std::once_flag once;
  static Result<JitLinkApi> loaded = fail(ErrorCode::Internal, "not loaded");
  std::call_once(once, [] { loaded = load(); });
  if (!loaded) return tl::unexpected(loaded.error());
  return &*loaded;
}

struct HandleGuard {
  const JitLinkApi* api;
  nvJitLinkHandle handle = nullptr;
  ~HandleGuard() {
    if (handle) api->Destroy(&handle);
  }
};

}  // namespace

Result<std::string> cudadevrt_path() {
  std::error_code ec;
  if (auto env = stitchcuda::detail::text_setting(stitchcuda::detail::Setting::cudadevrt)) {
    if (fs::is_regular_file(*env, ec)) return *env;
    return fail(ErrorCode::Unavailable, "STITCHCUDA_CUDADEVRT points to '" + *env +
                                            "', which is not a file: point it at libcudadevrt.a or unset it");
  }
  std::string where;
  for (const fs::path& dir : library_folders()) {
    fs::path candidate = dir / "libcudadevrt.a";
    if (fs::is_regular_file(candidate, ec)) return candidate.string();
    where += "\n  " + candidate.string();
  }
  return fail(ErrorCode::Unavailable,
              "the CUDA device runtime (libcudadevrt.a) was not found: install the CUDA 13 toolkit or set "
              "STITCHCUDA_CUDADEVRT to the archive's path",
              "looked for:" + where);
}

Result<std::string> link_device_runtime(const std::string& relocatable_cubin, const std::string& arch) {
  if (arch.rfind("sm_", 0) != 0)
    return fail(ErrorCode::InvalidArgument, "linking the device runtime needs a real architecture (sm_90a), not '" +
                                                arch + "': compile for the device that will run the code");
  auto loaded = jit_link();
  if (!loaded) return tl::unexpected(loaded.error());
  auto devrt = cudadevrt_path();
  if (!devrt) return tl::unexpected(devrt.error());
  const JitLinkApi& api = **loaded;
  HandleGuard guard{&api};
  const std::string arch_flag = "-arch=" + arch;
  const char* options[] = {arch_flag.c_str()};
  if (nvJitLinkResult r = api.Create(&guard.handle, 1, options); r != NVJITLINK_SUCCESS)
    return fail(ErrorCode::Internal, "nvJitLinkCreate failed (" + std::to_string(int(r)) + ") for " + arch_flag);
  auto error_log = [&] {
    std::size_t n = 0;
    std::string log;
    if (api.GetErrorLogSize(guard.handle, &n) == NVJITLINK_SUCCESS && n > 1) {
      log.resize(n);
      api.GetErrorLog(guard.handle, log.data());
      while (!log.empty() && log.back() == '\0') log.pop_back();
    }
    return log;
  };
  if (nvJitLinkResult r = api.AddData(guard.handle, NVJITLINK_INPUT_CUBIN, relocatable_cubin.data(),
                                      relocatable_cubin.size(), "kernel.cubin");
      r != NVJITLINK_SUCCESS)
    return fail(ErrorCode::CompileError, "nvJitLink could not read the relocatable CUBIN (" + std::to_string(int(r)) +
                                             "): was it compiled with -rdc=true for " + arch + "?", error_log());
  if (nvJitLinkResult r = api.AddFile(guard.handle, NVJITLINK_INPUT_LIBRARY, devrt->c_str()); r != NVJITLINK_SUCCESS)
    return fail(ErrorCode::CompileError, "nvJitLink could not add '" + *devrt + "' (" + std::to_string(int(r)) + ")",
                error_log());
  if (nvJitLinkResult r = api.Complete(guard.handle); r != NVJITLINK_SUCCESS) {
    std::string log = error_log();
    return fail(ErrorCode::CompileError,
                "linking with the device runtime failed" + (log.empty() ? std::string() : ": " + log.substr(0, log.find('\n'))),
                log);
  }
  std::size_t n = 0;
  if (api.GetLinkedCubinSize(guard.handle, &n) != NVJITLINK_SUCCESS || n == 0)
    return fail(ErrorCode::Internal, "nvJitLink produced no CUBIN");
  std::string cubin(n, '\0');
  if (api.GetLinkedCubin(guard.handle, cubin.data()) != NVJITLINK_SUCCESS)
    return fail(ErrorCode::Internal, "nvJitLink could not hand back the linked CUBIN");
  return cubin;
}

}  // namespace stitchcuda::jit::detail
