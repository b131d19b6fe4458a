// stitchcuda::jit — compile CUDA C++ with NVRTC, cache the result, load it and launch it.
// No CUDA header is included here: streams and devices are plain handles and indices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <stitchcuda/error.hpp>

namespace stitchcuda::jit {

/// When to use NVRTC precompiled headers (they pay for heavy headers such as CUB).
enum class PchMode {
  Off,   ///< never
  Auto,  ///< when the source includes CCCL headers (cub/, cuda/, thrust/)
  On,    ///< always
};

/// How NVRTC compiles one program. Every field takes part in the cache key.
struct CompileOptions {
  std::string arch;                       ///< "sm_90a", "sm_80", "compute_90"; empty: the current device's, else sm_90a
  int cpp_standard = 17;                  ///< 17 or 20
  std::vector<std::string> include_paths; ///< extra folders searched by #include
  std::vector<std::pair<std::string, std::string>> defines;  ///< NAME, VALUE ("" gives -DNAME)
  std::vector<std::pair<std::string, std::string>> headers;  ///< in-memory headers: include name, contents
  bool fast_math = false;                 ///< --use_fast_math
  bool line_info = false;                 ///< -lineinfo, for profilers
  int max_registers = 0;                  ///< register cap per thread; 0 = none
  std::vector<std::string> name_expressions;  ///< template instantiations to export, e.g. "scale<float>"
  PchMode pch = PchMode::Auto;            ///< precompiled headers
  std::vector<std::string> extra_flags;   ///< further NVRTC flags, passed as given
  /// Relocatable device code linked with the CUDA device runtime (libcudadevrt.a, through nvJitLink):
  /// kernels may then launch CUDA graphs (device graph launch) or grids from the device. Needs an
  /// sm_XX architecture; the PTX of such a module cannot be loaded on its own.
  bool device_runtime = false;
  /// Untrusted source (a candidate's): the include rule of `check_includes` applies to this compile.
  /// The process-wide `confine_includes()` makes it apply to every compile.
  bool confined = false;
};

/// The include rule for untrusted source: every `#include` of the source and of the in-memory headers
/// names an in-memory header or a header inside the CUDA toolkit's include folders (CCCL among them),
/// reached without absolute paths, `..`, computed (macro) includes or links out of those folders;
/// `include_paths` must lie inside them; `extra_flags` are limited to code-generation flags and macro
/// definitions (no -I, --pre-include, -include). The text is read as the preprocessor reads it (line
/// splices, CR-LF and CR line ends, `%:` digraphs, trigraphs, form feeds and vertical tabs before `#`,
/// comments and string literals, `__has_include`); a quoted include that a same-named file in the working
/// folder would answer is refused, and name expressions, macro values and `program_name` (a bare file
/// name) can carry no directive. InvalidArgument names the directive or flag and the rule.
Result<void> check_includes(std::string_view source, const CompileOptions& options,
                            std::string_view program_name = "kernel.cu");
/// From now on, for the rest of the process, every compile follows the include rule (as `confined`):
/// the Verifier's worker calls it before it loads a candidate. It cannot be undone.
void confine_includes() noexcept;
/// Whether confine_includes() was called in this process.
bool includes_confined() noexcept;

/// Scalar or pointer type of one kernel parameter, as PTX declares it.
enum class ParamKind { U8, S8, U16, S16, U32, S32, U64, S64, F16, F32, F64, Bytes };

/// The PTX spelling of a parameter kind: "u64", "f32", "bytes"...
const char* to_string(ParamKind kind) noexcept;

/// One kernel parameter: its PTX type, size and alignment in bytes.
struct ParamInfo {
  ParamKind kind = ParamKind::Bytes;  ///< U64 for pointers
  std::size_t size = 0;               ///< bytes
  std::size_t align = 0;              ///< bytes
};

/// A kernel entry point found in the compiled program.
struct KernelInfo {
  std::string name;                ///< the symbol (mangled unless extern "C")
  std::vector<ParamInfo> params;   ///< in declaration order
};

/// What one compile produced: machine code and everything needed to load and launch it.
struct Binary {
  std::string program_name;        ///< file name used in diagnostics ("kernel.cu")
  std::string arch;                ///< resolved architecture, e.g. "sm_90a"
  std::string cubin;               ///< machine code for arch (empty for compute_XX targets)
  std::string ptx;                 ///< PTX of the same program
  std::string log;                 ///< NVRTC's log (warnings)
  std::vector<std::pair<std::string, std::string>> lowered_names;  ///< name expression, symbol
  std::vector<KernelInfo> kernels; ///< entry points, parsed from the PTX
  std::string key;                 ///< cache key (hex SHA-256)
  double compile_ms = 0.0;         ///< wall time NVRTC took (0 when read from disk; see Module::compile_ms)

  /// The kernel called `name`: an extern "C" name, a symbol, or a name expression.
  const KernelInfo* find_kernel(std::string_view name) const;
  /// Whether the cubin runs on a device of this compute capability (else the PTX is JIT-compiled).
  bool cubin_runs_on(int cc_major, int cc_minor) const;
};

/// NVRTC front end: CUDA C++ source to CUBIN and PTX, in this process.
class Compiler {
 public:
  /// Compiles `source`; a rejected program comes back as a CompileError with mapped diagnostics.
  static Result<Binary> compile(std::string_view source, const CompileOptions& options,
                                std::string_view program_name = "kernel.cu");
  /// The cache key `compile` would produce for these inputs (resolves the architecture).
  static Result<std::string> cache_key(std::string_view source, const CompileOptions& options,
                                       std::string_view program_name = "kernel.cu");
  /// NVRTC version as "MAJOR.MINOR", or Unavailable.
  static Result<std::string> nvrtc_version();
  /// Where NVRTC was loaded from, or Unavailable.
  static Result<std::string> nvrtc_path();
  /// Architectures this NVRTC can target ("sm_75", ..., "sm_90a", ...).
  static Result<std::vector<std::string>> supported_archs();
  /// The current device's architecture ("sm_90a" on an H200), or sm_90a without a GPU.
  static std::string default_arch();
  /// Folders always on the include path (CUDA toolkit headers and CCCL).
  static std::vector<std::string> system_include_paths();
};

/// Hit, miss and error counts of a KernelCache.
struct CacheStats {
  std::uint64_t memory_hits = 0;     ///< served from memory
  std::uint64_t disk_hits = 0;       ///< served from the disk store
  std::uint64_t misses = 0;          ///< needed a compile
  std::uint64_t compiles = 0;        ///< compiles actually run (concurrent misses share one)
  std::uint64_t corrupt_entries = 0; ///< disk entries found damaged and rebuilt
  std::uint64_t disk_errors = 0;     ///< disk writes that failed (the compile still succeeded)
};

class Module;

/// In-memory LRU plus an on-disk content-addressed store of compiled modules.
/// Two threads asking for one key wait for one compile. Disk entries are written to a
/// temporary file in the same folder and renamed; a damaged entry is rebuilt, never trusted.
class KernelCache {
 public:
  /// A cache storing entries under `dir` (empty: memory only). Fails if `dir` is unusable.
  static Result<std::shared_ptr<KernelCache>> open(std::string dir, std::size_t memory_entries = 512);
  /// The process-wide cache: STITCHCUDA_CACHE_DIR, else $XDG_CACHE_HOME/stitchcuda, else
  /// ~/.cache/stitchcuda; an empty STITCHCUDA_CACHE_DIR disables the disk store.
  static std::shared_ptr<KernelCache> global();
  /// Replaces the process-wide cache (empty dir: memory only).
  static Result<void> set_global_dir(std::string dir);
  /// The folder the process-wide cache would use, from the environment.
  static std::string default_dir();

  /// The loaded module for this source and options, compiling only on a miss.
  Result<std::shared_ptr<Module>> get(std::string_view source, const CompileOptions& options,
                                      std::string_view program_name = "kernel.cu");
  /// Counters since this cache was opened.
  CacheStats stats() const;
  /// Drops every in-memory entry (disk entries stay).
  void clear_memory();
  /// The disk folder ("" when memory only).
  const std::string& dir() const;
  /// Why the process-wide cache fell back to memory only ("" when it did not).
  std::string warning() const;
  /// Path of the disk entry for a key ("" when memory only).
  std::string entry_path(const std::string& key) const;

  ~KernelCache();
  KernelCache(const KernelCache&) = delete;
  KernelCache& operator=(const KernelCache&) = delete;

 private:
  struct Impl;
  explicit KernelCache(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Compiles through the process-wide cache: the common entry point.
Result<std::shared_ptr<Module>> build(std::string_view source, const CompileOptions& options = {},
                                      std::string_view program_name = "kernel.cu");

/// Three grid or block dimensions.
struct Dim3 {
  unsigned x = 1, y = 1, z = 1;  ///< extents
};

/// How to launch a kernel.
struct LaunchConfig {
  Dim3 grid;                        ///< blocks
  Dim3 block;                       ///< threads per block
  std::size_t shared_mem_bytes = 0; ///< dynamic shared memory; above 48 KB is opted into
  void* stream = nullptr;           ///< CUstream; nullptr = the legacy default stream
  Dim3 cluster{0, 0, 0};            ///< thread-block cluster; x = 0 means no cluster
  int device = -1;                  ///< device whose primary context to use when none is current
};

/// Kernel arguments packed as the driver wants them, in declaration order.
class KernelArgs {
 public:
  /// A device pointer.
  KernelArgs& pointer(const void* p);
  /// A 32-bit signed integer.
  KernelArgs& i32(std::int32_t v);
  /// A 64-bit signed integer.
  KernelArgs& i64(std::int64_t v);
  /// A 32-bit unsigned integer.
  KernelArgs& u32(std::uint32_t v);
  /// A 32-bit float.
  KernelArgs& f32(float v);
  /// A 64-bit float.
  KernelArgs& f64(double v);
  /// A trivially copyable struct passed by value.
  KernelArgs& bytes(const void* data, std::size_t size, std::size_t align);
  /// Number of arguments added.
  std::size_t size() const { return offsets_.size(); }
  /// Size in bytes of argument i.
  std::size_t size_of(std::size_t i) const { return sizes_[i]; }
  /// Pointers to each argument's value, as cuLaunchKernel takes them.
  std::vector<void*> pointers() const;
  /// Removes every argument.
  void clear();

 private:
  void push(const void* data, std::size_t size, std::size_t align);
  std::vector<unsigned char> storage_;
  std::vector<std::size_t> offsets_;
  std::vector<std::size_t> sizes_;
};

/// Per-device facts about a kernel, read from the driver.
struct KernelAttributes {
  int num_registers = 0;              ///< registers per thread
  int static_shared_bytes = 0;        ///< __shared__ arrays
  int max_dynamic_shared_bytes = 0;   ///< currently allowed dynamic shared memory
  int local_bytes = 0;                ///< local memory (spills, stack) per thread
  int const_bytes = 0;                ///< __constant__ data
  int max_threads_per_block = 0;      ///< limited by registers and __launch_bounds__
  int ptx_version = 0;                ///< e.g. 90
  int binary_version = 0;             ///< e.g. 90
};

/// A device as the driver reports it.
struct DeviceInfo {
  int index = 0;                          ///< ordinal
  std::string name;                       ///< e.g. "NVIDIA H200"
  int cc_major = 0, cc_minor = 0;         ///< compute capability
  int multiprocessors = 0;                ///< SM count
  std::size_t total_memory = 0;           ///< bytes
  int max_threads_per_block = 0;          ///< hardware limit
  int max_shared_per_block_optin = 0;     ///< bytes, with opt-in
  int max_shared_per_multiprocessor = 0;  ///< bytes
  int l2_bytes = 0;                       ///< L2 cache size
  int clock_khz = 0;                      ///< SM clock
  std::string arch() const;               ///< "sm_90a" for 9.0, "sm_86" for 8.6
};

/// The CUDA driver as seen by this process.
struct Driver {
  /// Whether libcuda could be loaded and initialized; the reason otherwise.
  static Result<void> available();
  /// Driver API version, e.g. 13000.
  static Result<int> version();
  /// Number of devices (0 when no driver or no GPU).
  static int device_count();
  /// Facts about one device.
  static Result<DeviceInfo> device(int index);
  /// Blocks until all work on the current device has finished; reports asynchronous faults.
  static Result<void> synchronize(int device = -1);
};

class Kernel;

/// A launch checked once and enqueued many times (a C++ server replaying a step): only the
/// stream may change between calls. Enqueues on the calling thread's current CUDA context.
class PreparedLaunch {
 public:
  /// Enqueues the kernel on `stream` (nullptr: the stream given to Kernel::prepare).
  Result<void> launch(void* stream = nullptr) const;
  PreparedLaunch(PreparedLaunch&&) = default;
  PreparedLaunch& operator=(PreparedLaunch&&) = default;
  PreparedLaunch(const PreparedLaunch&) = delete;
  PreparedLaunch& operator=(const PreparedLaunch&) = delete;

 private:
  friend class Kernel;
  PreparedLaunch() = default;
  std::shared_ptr<Module> module_;  // keeps the loaded code alive
  std::string name_;
  void* handle_ = nullptr;          // CUkernel
  LaunchConfig cfg_;
  KernelArgs args_;
  std::vector<void*> pointers_;     // into args_'s storage, which moves with it
};

/// One kernel of a loaded module.
class Kernel {
 public:
  /// The name asked for (extern "C" name or name expression).
  const std::string& name() const { return name_; }
  /// The symbol in the binary.
  const std::string& symbol() const { return info_->name; }
  /// Parameters, as declared in PTX.
  const std::vector<ParamInfo>& params() const { return info_->params; }
  /// The module this kernel lives in.
  const std::shared_ptr<Module>& module() const { return module_; }
  /// Attributes on a device (-1: the current one).
  Result<KernelAttributes> attributes(int device = -1) const;
  /// Resident blocks per SM for this block size and dynamic shared memory.
  Result<int> max_active_blocks_per_sm(int block_size, std::size_t dynamic_shared_bytes = 0,
                                       int device = -1) const;
  /// Validates the configuration and arguments, then enqueues the kernel on cfg.stream.
  Result<void> launch(const LaunchConfig& cfg, const KernelArgs& args) const;
  /// Validates once (as launch does) and returns a launch that can be enqueued repeatedly.
  Result<PreparedLaunch> prepare(const LaunchConfig& cfg, KernelArgs args) const;

 private:
  friend class Module;
  friend class PreparedLaunch;
  // Every check of launch(); makes a context current, opts into shared memory; returns the CUkernel.
  Result<void*> validate(const LaunchConfig& cfg, const KernelArgs& args) const;
  static Result<void> enqueue(void* handle, const std::string& name, const LaunchConfig& cfg, void** args);
  Kernel(std::shared_ptr<Module> module, std::string name, const KernelInfo* info, void* handle)
      : module_(std::move(module)), name_(std::move(name)), info_(info), handle_(handle) {}
  std::shared_ptr<Module> module_;
  std::string name_;
  const KernelInfo* info_;
  void* handle_;  // CUkernel, null until the module is loaded on a GPU
};

/// A compiled program, loaded into the driver on first use (so lookups work without a GPU).
class Module : public std::enable_shared_from_this<Module> {
 public:
  /// Wraps a compiled binary; nothing is loaded yet.
  static std::shared_ptr<Module> create(std::shared_ptr<const Binary> binary);
  /// The compiled program.
  const Binary& binary() const { return *binary_; }
  /// Where this module came from: "compiled", "memory" or "disk".
  const std::string& origin() const { return origin_; }
  /// Sets the origin (used by the cache).
  void set_origin(std::string origin) { origin_ = std::move(origin); }
  /// What obtaining this handle cost in NVRTC time: the compile's time, 0 for a cache hit.
  double compile_ms() const { return origin_ == "compiled" ? binary_->compile_ms : 0.0; }
  /// The kernel called `name`; NotFound lists the kernels that exist.
  Result<Kernel> kernel(std::string_view name);
  /// Loads the binary into the driver (CUlibrary) if not yet loaded.
  Result<void*> library();
  /// Another handle on the same loaded module, reporting a different origin.
  std::shared_ptr<Module> with_origin(std::string origin) const;

  /// Driver state shared by every handle on one compiled program (opaque).
  struct State;

 private:
  Module(std::shared_ptr<const Binary> binary, std::shared_ptr<State> state)
      : binary_(std::move(binary)), state_(std::move(state)) {}
  Result<void*> kernel_handle(const std::string& symbol);
  friend class Kernel;
  std::shared_ptr<const Binary> binary_;
  std::shared_ptr<State> state_;
  std::string origin_ = "compiled";
};

/// Parses the parameter types of `__global__ void name(...)` from source ("const float*", "int").
/// Empty when the kernel is not found or is a template.
std::vector<std::string> declared_signature(std::string_view source, std::string_view kernel_name);

}  // namespace stitchcuda::jit
