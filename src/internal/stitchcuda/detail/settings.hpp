// The environment the C++ library reads, in one place: every STITCHCUDA_* variable with its type, default
// and reason (the table in src/core/settings.cpp), and the few other variables it honours (CUDA_HOME...).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace stitchcuda::detail {

/// The STITCHCUDA_* variables the C++ reads. Each is read when it is used, not cached: tests and the bench
/// change the executor's knobs between runs of one process; a library path is read once, when that
/// library is first loaded.
enum class Setting {
  nvrtc,
  nvjitlink,
  cupti,
  cublaslt,
  libcuda,
  cudadevrt,
  cache_dir,
  large_storage_bytes,
  tf32x3_chunk,
  tf32x3_rows,
  tf32x3_cols,
  tf32x3_kblock,
  tf32x3_fuse_lo,
  bf16_cast,
  matmul_tune,
};

/// A row of the table: `type` is "path" or "count" (a non-negative integer); `fallback` is what
/// applies when the variable is unset ("" where the code searches or decides itself).
struct SettingInfo {
  Setting setting;
  std::string_view name;
  std::string_view type;
  std::string_view fallback;
  std::string_view reason;
};

/// Every row, in the order of the enum (bound as stitchcuda._C.cpp_settings() for the Python table).
std::span<const SettingInfo> settings_table();
const SettingInfo& info(Setting s);

/// A path variable: nullopt when unset or empty.
std::optional<std::string> text_setting(Setting s);
/// A variable whose empty value means something (STITCHCUDA_CACHE_DIR="" turns the disk cache off).
std::optional<std::string> raw_setting(Setting s);
/// A count: nullopt when unset, empty or not a non-negative integer (the caller's default then applies).
std::optional<std::int64_t> count_setting(Setting s);

/// Any other variable the library honours (CUDA_HOME, HOME, NO_PROXY, an API key's variable): nullopt when
/// unset or empty.
std::optional<std::string> environment(const std::string& name);

}  // namespace stitchcuda::detail
