// The one place the C++ library reads its environment: the table of STITCHCUDA_* variables (name, type,
// default, reason) and typed reads. The Python settings table lists the same rows (stitchcuda._C.cpp_settings).
#include <stitchcuda/detail/settings.hpp>

#include <array>
#include <cstdlib>

namespace stitchcuda::detail {
namespace {

constexpr std::array<SettingInfo, 15> kTable{{
    {Setting::nvrtc, "STITCHCUDA_NVRTC", "path", "", "the libnvrtc.so.13 to load instead of searching the process, the toolkit and torch's folders"},
    {Setting::nvjitlink, "STITCHCUDA_NVJITLINK", "path", "", "the libnvJitLink.so.13 to load instead of searching beside NVRTC and in the toolkit"},
    {Setting::cupti, "STITCHCUDA_CUPTI", "path", "", "the libcupti.so.13 the profiler loads instead of searching the process and the toolkit"},
    {Setting::cublaslt, "STITCHCUDA_CUBLASLT", "path", "", "the libcublasLt.so.13 the executor's matmuls load instead of the one torch loaded"},
    {Setting::libcuda, "STITCHCUDA_LIBCUDA", "path", "", "the CUDA driver library to load instead of the system's libcuda.so.1"},
    {Setting::cudadevrt, "STITCHCUDA_CUDADEVRT", "path", "", "the libcudadevrt.a linked into device-launched graphs instead of the one beside NVRTC"},
    {Setting::cache_dir, "STITCHCUDA_CACHE_DIR", "path", "$XDG_CACHE_HOME/stitchcuda or ~/.cache/stitchcuda", "where compiled kernels are kept across processes; empty keeps them in memory only"},
    {Setting::large_storage_bytes, "STITCHCUDA_LARGE_STORAGE_BYTES", "count", "33554432", "storages this large or larger live outside the executor's arena; 0 keeps every one inside, to measure the rule"},
    {Setting::tf32x3_chunk, "STITCHCUDA_TF32X3_CHUNK", "count", "512", "elements of K per hi*hi product in tf32x3; 0 is the whole K, to measure accuracy against passes over c"},
    {Setting::tf32x3_rows, "STITCHCUDA_TF32X3_ROWS", "count", "", "rows of a split per block in tf32x3 (chosen by size when unset; 0 is all), for tests and measurements"},
    {Setting::tf32x3_cols, "STITCHCUDA_TF32X3_COLS", "count", "", "rows of a transposed b split per block in tf32x3 (chosen by size when unset; 0 is all), for tests and measurements"},
    {Setting::tf32x3_kblock, "STITCHCUDA_TF32X3_KBLOCK", "count", "", "elements of K per slab in tf32x3 (chosen by size when unset; 0 is never), for tests and measurements"},
    {Setting::tf32x3_fuse_lo, "STITCHCUDA_TF32X3_FUSE_LO", "count", "2", "which tf32x3 products run as one: 0 none, 1 the two lo products, 2 those and the first hi chunk"},
    {Setting::bf16_cast, "STITCHCUDA_BF16_CAST", "count", "1", "bf16 matmuls of fp32 operands convert to bf16: 0 never, 1 where K >= 256, 2 always"},
    {Setting::matmul_tune, "STITCHCUDA_MATMUL_TUNE", "count", "1", "1 times cuBLASLt's candidate algorithms at a matmul's first run and keeps the fastest; 0 takes the heuristic's first"},
}};

// info() indexes the table by the enum's value.
constexpr bool in_enum_order() {
  for (std::size_t i = 0; i < kTable.size(); ++i)
    if (static_cast<std::size_t>(kTable[i].setting) != i) return false;
  return true;
}
static_assert(in_enum_order(), "the rows of kTable follow the order of enum Setting");

const char* read(Setting s) { return std::getenv(info(s).name.data()); }

}  // namespace

std::span<const SettingInfo> settings_table() { return kTable; }

const SettingInfo& info(Setting s) { return kTable[static_cast<std::size_t>(s)]; }

std::optional<std::string> text_setting(Setting s) {
  const char* v = read(s);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

std::optional<std::string> raw_setting(Setting s) {
  const char* v = read(s);
  if (!v) return std::nullopt;
  return std::string(v);
}

std::optional<std::int64_t> count_setting(Setting s) {
  const char* v = read(s);
  if (!v || !*v) return std::nullopt;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (*end != '\0' || n < 0) return std::nullopt;
  return n;
}

std::optional<std::string> environment(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

}  // namespace stitchcuda::detail
