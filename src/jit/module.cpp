// Loading compiled programs into the driver and launching their kernels.
// Modules are loaded as context-independent CUlibrary objects, so one load serves every
// context; launches go to whatever context is current (PyTorch's primary context).
// Every launch is checked here first — argument count and sizes against the PTX, grid and
// block limits, shared memory against the device — so mistakes come back as clear errors.
#include <stitchcuda/jit.hpp>

#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

#include <stitchcuda/detail/cuda_driver.hpp>
#include "ptx.hpp"

namespace stitchcuda::jit {

struct Module::State {
  std::mutex mu;
  CUlibrary library = nullptr;
  std::unordered_map<std::string, CUkernel> kernels;
  struct Limits {
    int max_threads = 0;
    int static_shared = 0;
    int dynamic_allowed = 0;
    int optin = 0;
    int cc_major = 0;
    bool non_portable_clusters = false;
  };
  std::map<std::pair<CUkernel, int>, Limits> limits;

  ~State() {
    if (library)
      if (auto api = detail::driver()) (*api)->LibraryUnload(library);
  }
};

std::shared_ptr<Module> Module::create(std::shared_ptr<const Binary> binary) {
  return std::shared_ptr<Module>(new Module(std::move(binary), std::make_shared<State>()));
}

std::shared_ptr<Module> Module::with_origin(std::string origin) const {
  auto m = std::shared_ptr<Module>(new Module(binary_, state_));
  m->origin_ = std::move(origin);
  return m;
}

Result<void*> Module::library() {
  auto loaded = detail::driver();
  if (!loaded) return tl::unexpected(loaded.error());
  const auto& api = **loaded;
  std::lock_guard lock(state_->mu);
  if (state_->library) return static_cast<void*>(state_->library);
  // Initialize the context first: loading needs the driver initialized, launching needs a context.
  auto dev = detail::ensure_context(api, -1);
  if (!dev) return tl::unexpected(dev.error());
  int major = 0, minor = 0;
  api.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, *dev);
  api.DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, *dev);
  // Loading is lazy, so a cubin for the wrong GPU would only fail at the first lookup: choose the
  // image up front. A cubin for another architecture (or a compute_XX target) uses the driver's PTX JIT.
  const void* image = binary_->cubin_runs_on(major, minor) ? static_cast<const void*>(binary_->cubin.data())
                                                            : static_cast<const void*>(binary_->ptx.c_str());
  CUresult r = api.LibraryLoadData(&state_->library, image, nullptr, nullptr, 0, nullptr, nullptr, 0);
  if (r != CUDA_SUCCESS) {
    state_->library = nullptr;
    return tl::unexpected(detail::cuda_error(
        r, "loading the module compiled for " + binary_->arch + " (compile for this GPU's architecture: " +
               Compiler::default_arch() + ")"));
  }
  return static_cast<void*>(state_->library);
}

Result<void*> Module::kernel_handle(const std::string& symbol) {
  auto lib = library();
  if (!lib) return tl::unexpected(lib.error());
  std::lock_guard lock(state_->mu);
  if (auto it = state_->kernels.find(symbol); it != state_->kernels.end()) return static_cast<void*>(it->second);
  auto api = *detail::driver();
  CUkernel k = nullptr;
  if (CUresult r = api->LibraryGetKernel(&k, static_cast<CUlibrary>(*lib), symbol.c_str()); r != CUDA_SUCCESS)
    return tl::unexpected(detail::cuda_error(r, "looking up kernel '" + symbol + "'", ErrorCode::NotFound));
  state_->kernels.emplace(symbol, k);
  return static_cast<void*>(k);
}

Result<Kernel> Module::kernel(std::string_view name) {
  const KernelInfo* info = binary_->find_kernel(name);
  if (!info) {
    std::string names;
    for (auto& k : binary_->kernels) names += (names.empty() ? "" : ", ") + k.name;
    for (auto& [expr, symbol] : binary_->lowered_names) names += (names.empty() ? "" : ", ") + expr;
    std::string hint = name.find('<') != std::string_view::npos
                           ? " (a template instantiation must be listed in name_expressions)"
                           : " (a kernel that is not extern \"C\" has a mangled name: declare it extern \"C\" or "
                             "use name_expressions)";
    return fail(ErrorCode::NotFound, "no kernel named '" + std::string(name) + "' in " + binary_->program_name +
                                         "; it defines: " + (names.empty() ? "(no kernels)" : names) + hint);
  }
  // Resolve the handle now when a GPU can load the module; otherwise (compile-only machines,
  // or a module this GPU cannot run) the launch resolves it and reports why it cannot.
  void* handle = nullptr;
  if (Driver::device_count() > 0)
    if (auto h = kernel_handle(info->name)) handle = *h;
  return Kernel(shared_from_this(), std::string(name), info, handle);
}

// ---- arguments ----

void KernelArgs::push(const void* data, std::size_t size, std::size_t align) {
  std::size_t offset = (storage_.size() + align - 1) / align * align;
  storage_.resize(offset + size);
  std::memcpy(storage_.data() + offset, data, size);
  offsets_.push_back(offset);
  sizes_.push_back(size);
}

KernelArgs& KernelArgs::pointer(const void* p) { push(&p, sizeof(p), alignof(void*)); return *this; }
KernelArgs& KernelArgs::i32(std::int32_t v) { push(&v, 4, 4); return *this; }
KernelArgs& KernelArgs::i64(std::int64_t v) { push(&v, 8, 8); return *this; }
KernelArgs& KernelArgs::u32(std::uint32_t v) { push(&v, 4, 4); return *this; }
KernelArgs& KernelArgs::f32(float v) { push(&v, 4, 4); return *this; }
KernelArgs& KernelArgs::f64(double v) { push(&v, 8, 8); return *this; }
KernelArgs& KernelArgs::bytes(const void* data, std::size_t size, std::size_t align) {
  push(data, size, std::max<std::size_t>(align, 1));
  return *this;
}

std::vector<void*> KernelArgs::pointers() const {
  std::vector<void*> out;
  out.reserve(offsets_.size());
  // storage_ is 16-byte aligned by the allocator; offsets keep each value's own alignment.
  for (auto off : offsets_) out.push_back(const_cast<unsigned char*>(storage_.data()) + off);
  return out;
}

void KernelArgs::clear() {
  storage_.clear();
  offsets_.clear();
  sizes_.clear();
}

// ---- kernels ----

namespace {

std::string dims(const Dim3& d) {
  return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}

Result<void> check_dims(const LaunchConfig& cfg) {
  const Dim3& b = cfg.block;
  const Dim3& g = cfg.grid;
  if (b.x == 0 || b.y == 0 || b.z == 0)
    return fail(ErrorCode::LaunchError, "block " + dims(b) + " has a zero dimension: every dimension must be at least 1");
  if (b.x > 1024 || b.y > 1024 || b.z > 64)
    return fail(ErrorCode::LaunchError, "block " + dims(b) + " exceeds the per-dimension limits (1024, 1024, 64)");
  if (std::uint64_t(b.x) * b.y * b.z > 1024)
    return fail(ErrorCode::LaunchError, "block " + dims(b) + " has " + std::to_string(std::uint64_t(b.x) * b.y * b.z) +
                                            " threads; a block holds at most 1024");
  if (g.x == 0 || g.y == 0 || g.z == 0)
    return fail(ErrorCode::LaunchError, "grid " + dims(g) + " has a zero dimension: every dimension must be at least 1");
  if (g.x > 2147483647u || g.y > 65535 || g.z > 65535)
    return fail(ErrorCode::LaunchError, "grid " + dims(g) + " exceeds the limits (2147483647, 65535, 65535)");
  if (cfg.cluster.x > 0) {
    const Dim3& c = cfg.cluster;
    if (c.y == 0 || c.z == 0 || g.x % c.x || g.y % c.y || g.z % c.z)
      return fail(ErrorCode::LaunchError, "grid " + dims(g) + " is not a multiple of cluster " + dims(c));
  }
  return {};
}

}  // namespace

Result<void*> Kernel::validate(const LaunchConfig& cfg, const KernelArgs& args) const {
  const auto& params = info_->params;
  if (args.size() != params.size())
    return fail(ErrorCode::InvalidArgument, "kernel '" + name_ + "' takes " + std::to_string(params.size()) +
                                                " argument(s) but " + std::to_string(args.size()) + " were given");
  for (std::size_t i = 0; i < params.size(); ++i)
    if (args.size_of(i) != params[i].size)
      return fail(ErrorCode::InvalidArgument,
                  "argument " + std::to_string(i) + " of kernel '" + name_ + "' is " + std::to_string(args.size_of(i)) +
                      " bytes but the kernel declares " + std::to_string(params[i].size) + " (" +
                      to_string(params[i].kind) + ")");
  if (auto ok = check_dims(cfg); !ok) return tl::unexpected(ok.error());

  auto loaded = detail::driver();
  if (!loaded) return tl::unexpected(loaded.error());
  const auto& api = **loaded;
  auto dev = detail::ensure_context(api, cfg.device);
  if (!dev) return tl::unexpected(dev.error());
  void* h = handle_;
  if (!h) {
    auto got = module_->kernel_handle(info_->name);
    if (!got) return tl::unexpected(got.error());
    h = *got;
  }
  auto kernel = static_cast<CUkernel>(h);

  Module::State& st = *module_->state_;
  Module::State::Limits lim;
  {
    std::lock_guard lock(st.mu);
    auto key = std::make_pair(kernel, *dev);
    auto it = st.limits.find(key);
    if (it == st.limits.end()) {
      Module::State::Limits fresh;
      api.KernelGetAttribute(&fresh.max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, kernel, *dev);
      api.KernelGetAttribute(&fresh.static_shared, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, kernel, *dev);
      api.KernelGetAttribute(&fresh.dynamic_allowed, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, kernel, *dev);
      api.DeviceGetAttribute(&fresh.optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, *dev);
      api.DeviceGetAttribute(&fresh.cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, *dev);
      it = st.limits.emplace(key, fresh).first;
    }
    lim = it->second;
  }
  const std::uint64_t threads = std::uint64_t(cfg.block.x) * cfg.block.y * cfg.block.z;
  if (threads > std::uint64_t(lim.max_threads))
    return fail(ErrorCode::LaunchError, "block " + dims(cfg.block) + " has " + std::to_string(threads) +
                                            " threads but kernel '" + name_ + "' allows at most " +
                                            std::to_string(lim.max_threads) +
                                            " (its __launch_bounds__ or register use): use a smaller block");
  if (cfg.shared_mem_bytes > std::size_t(lim.dynamic_allowed)) {
    const std::size_t room = std::size_t(std::max(lim.optin - lim.static_shared, 0));
    if (cfg.shared_mem_bytes > room)
      return fail(ErrorCode::LaunchError,
                  "kernel '" + name_ + "' asks for " + std::to_string(cfg.shared_mem_bytes) +
                      " bytes of dynamic shared memory; this device allows at most " + std::to_string(room) + " (" +
                      std::to_string(lim.optin) + " per block minus " + std::to_string(lim.static_shared) + " static)");
    if (CUresult r = api.KernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(cfg.shared_mem_bytes),
                                            kernel, *dev);
        r != CUDA_SUCCESS)
      return tl::unexpected(detail::cuda_error(r, "raising the dynamic shared memory limit", ErrorCode::LaunchError));
    std::lock_guard lock(st.mu);
    st.limits[{kernel, *dev}].dynamic_allowed = int(cfg.shared_mem_bytes);
  }

  if (cfg.cluster.x > 0) {
    if (lim.cc_major < 9)
      return fail(ErrorCode::LaunchError, "thread-block clusters need compute capability 9.0 or newer");
    const unsigned size = cfg.cluster.x * cfg.cluster.y * cfg.cluster.z;
    if (size > 16)
      return fail(ErrorCode::LaunchError, "cluster " + dims(cfg.cluster) + " has " + std::to_string(size) +
                                              " blocks; at most 16 are possible (8 portably)");
    if (size > 8 && !lim.non_portable_clusters) {
      if (CUresult r = api.KernelSetAttribute(CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1, kernel, *dev);
          r != CUDA_SUCCESS)
        return tl::unexpected(detail::cuda_error(r, "allowing a non-portable cluster size", ErrorCode::LaunchError));
      std::lock_guard lock(st.mu);
      st.limits[{kernel, *dev}].non_portable_clusters = true;
    }
  }
  return h;
}

Result<void> Kernel::enqueue(void* handle, const std::string& name, const LaunchConfig& cfg, void** args) {
  auto loaded = detail::driver();
  if (!loaded) return tl::unexpected(loaded.error());
  CUlaunchAttribute attrs[1];
  CUlaunchConfig lc{};
  lc.gridDimX = cfg.grid.x;
  lc.gridDimY = cfg.grid.y;
  lc.gridDimZ = cfg.grid.z;
  lc.blockDimX = cfg.block.x;
  lc.blockDimY = cfg.block.y;
  lc.blockDimZ = cfg.block.z;
  lc.sharedMemBytes = unsigned(cfg.shared_mem_bytes);
  lc.hStream = static_cast<CUstream>(cfg.stream);
  if (cfg.cluster.x > 0) {
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[0].value.clusterDim.x = cfg.cluster.x;
    attrs[0].value.clusterDim.y = cfg.cluster.y;
    attrs[0].value.clusterDim.z = cfg.cluster.z;
    lc.attrs = attrs;
    lc.numAttrs = 1;
  }
  if (CUresult r = (*loaded)->LaunchKernelEx(&lc, reinterpret_cast<CUfunction>(handle), args, nullptr);
      r != CUDA_SUCCESS)
    return tl::unexpected(detail::cuda_error(
        r, "launching '" + name + "' with grid " + dims(cfg.grid) + ", block " + dims(cfg.block) + ", " +
               std::to_string(cfg.shared_mem_bytes) + " B shared",
        ErrorCode::LaunchError));
  return {};
}

Result<void> Kernel::launch(const LaunchConfig& cfg, const KernelArgs& args) const {
  auto handle = validate(cfg, args);
  if (!handle) return tl::unexpected(handle.error());
  auto ptrs = args.pointers();
  return enqueue(*handle, name_, cfg, ptrs.data());
}

Result<PreparedLaunch> Kernel::prepare(const LaunchConfig& cfg, KernelArgs args) const {
  auto handle = validate(cfg, args);
  if (!handle) return tl::unexpected(handle.error());
  PreparedLaunch p;
  p.module_ = module_;
  p.name_ = name_;
  p.handle_ = *handle;
  p.cfg_ = cfg;
  p.args_ = std::move(args);
  p.pointers_ = p.args_.pointers();
  return p;
}

Result<void> PreparedLaunch::launch(void* stream) const {
  if (!stream) return Kernel::enqueue(handle_, name_, cfg_, const_cast<void**>(pointers_.data()));
  LaunchConfig cfg = cfg_;
  cfg.stream = stream;
  return Kernel::enqueue(handle_, name_, cfg, const_cast<void**>(pointers_.data()));
}

Result<KernelAttributes> Kernel::attributes(int device) const {
  auto loaded = detail::driver();
  if (!loaded) return tl::unexpected(loaded.error());
  const auto& api = **loaded;
  auto dev = detail::ensure_context(api, device);
  if (!dev) return tl::unexpected(dev.error());
  void* h = handle_;
  if (!h) {
    auto got = module_->kernel_handle(info_->name);
    if (!got) return tl::unexpected(got.error());
    h = *got;
  }
  auto k = static_cast<CUkernel>(h);
  int target = device < 0 ? *dev : device;
  KernelAttributes a;
  auto get = [&](int& out, CUfunction_attribute attr) { api.KernelGetAttribute(&out, attr, k, target); };
  get(a.num_registers, CU_FUNC_ATTRIBUTE_NUM_REGS);
  get(a.static_shared_bytes, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES);
  get(a.max_dynamic_shared_bytes, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES);
  get(a.local_bytes, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES);
  get(a.const_bytes, CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES);
  get(a.max_threads_per_block, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
  get(a.ptx_version, CU_FUNC_ATTRIBUTE_PTX_VERSION);
  get(a.binary_version, CU_FUNC_ATTRIBUTE_BINARY_VERSION);
  return a;
}

Result<int> Kernel::max_active_blocks_per_sm(int block_size, std::size_t dynamic_shared_bytes, int device) const {
  if (block_size <= 0 || block_size > 1024)
    return fail(ErrorCode::InvalidArgument, "block size " + std::to_string(block_size) + " must be in 1..1024");
  auto loaded = detail::driver();
  if (!loaded) return tl::unexpected(loaded.error());
  const auto& api = **loaded;
  auto dev = detail::ensure_context(api, device);
  if (!dev) return tl::unexpected(dev.error());
  void* h = handle_;
  if (!h) {
    auto got = module_->kernel_handle(info_->name);
    if (!got) return tl::unexpected(got.error());
    h = *got;
  }
  CUfunction f = nullptr;
  if (CUresult r = api.KernelGetFunction(&f, static_cast<CUkernel>(h)); r != CUDA_SUCCESS)
    return tl::unexpected(detail::cuda_error(r, "cuKernelGetFunction"));
  int blocks = 0;
  if (CUresult r = api.OccupancyMaxActiveBlocksPerMultiprocessor(&blocks, f, block_size, dynamic_shared_bytes);
      r != CUDA_SUCCESS)
    return tl::unexpected(detail::cuda_error(r, "computing occupancy"));
  return blocks;
}

}  // namespace stitchcuda::jit
