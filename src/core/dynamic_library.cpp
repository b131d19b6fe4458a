// Finds and opens the run-time CUDA libraries, one search for all of them (see dynamic_library.hpp).
#include <stitchcuda/detail/dynamic_library.hpp>

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <filesystem>

namespace stitchcuda::detail {
namespace {

namespace fs = std::filesystem;

// The file a handle was loaded from (the loader's own search resolves a soname to a path).
std::string loaded_path(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name) return map->l_name;
  return fallback;
}

// The loader's reason, worth showing only where the file is there but would not load (a wrong
// architecture, a missing dependency); a missing file says nothing new.
std::string reason_if_present(const std::string& candidate) {
  const char* why = dlerror();
  std::error_code ec;
  if (!why || candidate.find('/') == std::string::npos || !fs::exists(candidate, ec)) return "";
  return std::string(" (") + why + ")";
}

}  // namespace

void* DynamicLibrary::symbol(const char* name) const { return dlsym(handle, name); }

Result<DynamicLibrary> load_library(const LibrarySearch& search) {
  const SettingInfo& variable = info(search.override_variable);
  if (auto path = text_setting(search.override_variable)) {
    if (void* handle = dlopen(path->c_str(), RTLD_NOW | RTLD_LOCAL))
      return DynamicLibrary{handle, loaded_path(handle, *path)};
    const char* why = dlerror();
    return fail(ErrorCode::Unavailable,
                std::string(variable.name) + " points to '" + *path + "', which could not be loaded: point it at a " +
                    search.soname + " or unset it",
                why ? why : "");
  }
  std::string looked = "looked for:\n  " + search.soname + " (already loaded)";
  if (void* handle = dlopen(search.soname.c_str(), RTLD_NOW | RTLD_NOLOAD))
    return DynamicLibrary{handle, loaded_path(handle, search.soname)};
  for (const std::string& candidate : search.candidates) {
    if (void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL))
      return DynamicLibrary{handle, loaded_path(handle, candidate)};
    looked += "\n  " + candidate + reason_if_present(candidate);
  }
  return fail(ErrorCode::Unavailable, search.not_found, looked);
}

std::vector<std::string> toolkit_folders() {
  std::vector<std::string> out;
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"})
    if (auto home = environment(var)) out.push_back(*home);
  out.push_back("/usr/local/cuda");
  return out;
}

std::vector<std::string> in_toolkit(const std::string& file) {
  std::vector<std::string> out;
  for (const std::string& home : toolkit_folders()) out.push_back((fs::path(home) / "lib64" / file).string());
  return out;
}

std::vector<std::string> torch_folders() {
  std::vector<std::string> out;
  for (const char* soname : {"libcudart.so.13", "libnvrtc.so.13"}) {
    void* handle = dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
    if (!handle) continue;
    std::string folder = fs::path(loaded_path(handle, "")).parent_path().string();
    dlclose(handle);  // NOLOAD took a reference: give it back
    if (!folder.empty() && std::find(out.begin(), out.end(), folder) == out.end()) out.push_back(folder);
  }
  return out;
}

}  // namespace stitchcuda::detail
