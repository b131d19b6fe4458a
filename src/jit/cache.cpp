// KernelCache: an LRU of loaded modules in memory over a content-addressed store on disk.
// Disk entries carry a checksum of their payload; anything that does not verify is deleted
// and rebuilt. Writes go to a temporary file in the same folder and are renamed into place,
// so a reader never sees a partial entry.
#include <stitchcuda/jit.hpp>

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <list>
#include <mutex>
#include <unordered_map>

#include <stitchcuda/detail/settings.hpp>
#include <stitchcuda/detail/sha256.hpp>
#include "ptx.hpp"

namespace stitchcuda::jit {
namespace fs = std::filesystem;
namespace {

// A cache entry holds one module's CUBIN, PTX and metadata: far below this.
constexpr std::uintmax_t kMaxEntryBytes = 256ull << 20;


constexpr char kMagic[8] = {'S', 'T', 'C', 'H', 'J', 'I', 'T', '\x01'};
constexpr std::uint32_t kFormat = 1;

void put_u64(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out += char((v >> (8 * i)) & 0xff);
}

bool get_u64(std::string_view& in, std::uint64_t& v) {
  if (in.size() < 8) return false;
  v = 0;
  for (int i = 0; i < 8; ++i) v |= std::uint64_t(static_cast<unsigned char>(in[i])) << (8 * i);
  in.remove_prefix(8);
  return true;
}

void put_field(std::string& out, std::string_view s) {
  put_u64(out, s.size());
  out.append(s);
}

bool get_field(std::string_view& in, std::string& s) {
  std::uint64_t n = 0;
  if (!get_u64(in, n) || in.size() < n) return false;
  s.assign(in.substr(0, n));
  in.remove_prefix(n);
  return true;
}

std::string serialize(const Binary& b) {
  std::string payload;
  put_field(payload, b.key);
  put_field(payload, b.program_name);
  put_field(payload, b.arch);
  put_field(payload, b.cubin);
  put_field(payload, b.ptx);
  put_field(payload, b.log);
  put_u64(payload, b.lowered_names.size());
  for (auto& [expr, symbol] : b.lowered_names) {
    put_field(payload, expr);
    put_field(payload, symbol);
  }
  std::string out(kMagic, sizeof(kMagic));
  for (int i = 0; i < 4; ++i) out += char((kFormat >> (8 * i)) & 0xff);
  put_u64(out, payload.size());
  auto digest = stitchcuda::detail::Sha256().update(payload).digest();
  out.append(reinterpret_cast<const char*>(digest.data()), digest.size());
  out += payload;
  return out;
}

// Returns false for anything that is not a complete, verified entry for `key`.
bool deserialize(std::string_view in, const std::string& key, Binary& b) {
  if (in.size() < sizeof(kMagic) + 4 + 8 + 32 || std::memcmp(in.data(), kMagic, sizeof(kMagic)) != 0) return false;
  in.remove_prefix(sizeof(kMagic));
  std::uint32_t format = 0;
  for (int i = 0; i < 4; ++i) format |= std::uint32_t(static_cast<unsigned char>(in[i])) << (8 * i);
  in.remove_prefix(4);
  if (format != kFormat) return false;
  std::uint64_t size = 0;
  if (!get_u64(in, size) || in.size() != 32 + size) return false;
  auto stored = in.substr(0, 32);
  in.remove_prefix(32);
  auto digest = stitchcuda::detail::Sha256().update(in).digest();
  if (std::memcmp(stored.data(), digest.data(), 32) != 0) return false;
  std::uint64_t n = 0;
  if (!get_field(in, b.key) || b.key != key || !get_field(in, b.program_name) || !get_field(in, b.arch) ||
      !get_field(in, b.cubin) || !get_field(in, b.ptx) || !get_field(in, b.log) || !get_u64(in, n) || n > 100000)
    return false;
  for (std::uint64_t i = 0; i < n; ++i) {
    std::string expr, symbol;
    if (!get_field(in, expr) || !get_field(in, symbol)) return false;
    b.lowered_names.emplace_back(std::move(expr), std::move(symbol));
  }
  return in.empty();
}

Error io_error(const std::string& dir, const std::string& why) {
  return Error{ErrorCode::IoError,
               "the kernel cache folder '" + dir + "' cannot be used (" + why +
                   "): set STITCHCUDA_CACHE_DIR to a writable folder, or to an empty string to disable the disk cache",
               {},
               {}};
}

}  // namespace

struct KernelCache::Impl {
  std::string dir;
  std::size_t capacity = 512;
  std::string warning;
  mutable std::mutex mu;
  std::list<std::string> order;  // most recently used first
  struct Slot {
    std::shared_ptr<Module> module;
    std::list<std::string>::iterator pos;
  };
  std::unordered_map<std::string, Slot> entries;
  std::unordered_map<std::string, std::shared_future<Result<std::shared_ptr<Module>>>> inflight;
  CacheStats stats;

  void remember(const std::string& key, std::shared_ptr<Module> module) {
    if (auto it = entries.find(key); it != entries.end()) {
      order.erase(it->second.pos);
      entries.erase(it);
    }
    order.push_front(key);
    entries[key] = Slot{std::move(module), order.begin()};
    while (entries.size() > capacity && !order.empty()) {
      entries.erase(order.back());
      order.pop_back();
    }
  }

  std::string path_of(const std::string& key) const {
    if (dir.empty()) return {};
    return (fs::path(dir) / "v1" / key.substr(0, 2) / (key + ".bin")).string();
  }

  // Reads an entry; a damaged one is removed and counted. Only a regular file (not a link to /dev/zero,
  // a FIFO or a folder put in its place) of at most kMaxEntryBytes is read.
  std::shared_ptr<const Binary> read(const std::string& key) {
    std::string path = path_of(key);
    if (path.empty()) return nullptr;
    std::error_code ec;
    const auto status = fs::symlink_status(path, ec);
    if (ec || status.type() == fs::file_type::not_found) return nullptr;
    auto damaged = [&] {
      std::error_code ignored;
      fs::remove(path, ignored);  // a file or a link; a folder in its place stays (and is never read)
      std::lock_guard lock(mu);
      ++stats.corrupt_entries;
      return nullptr;
    };
    if (status.type() != fs::file_type::regular) return damaged();
    const auto size = fs::file_size(path, ec);
    if (ec || size > kMaxEntryBytes) return damaged();
    std::ifstream in(path, std::ios::binary);
    if (!in) return nullptr;
    std::string data(size, '\0');
    in.read(data.data(), std::streamsize(size));
    data.resize(std::size_t(in.gcount()));
    auto b = std::make_shared<Binary>();
    if (!deserialize(data, key, *b)) return damaged();
    b->kernels = detail::parse_ptx_kernels(b->ptx);
    return b;
  }

  bool write(const Binary& b) {
    std::string path = path_of(b.key);
    if (path.empty()) return true;
    static std::atomic<unsigned> counter{0};
    std::error_code ec;
    fs::create_directories(fs::path(path).parent_path(), ec);
    std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      if (!out) return false;
      std::string data = serialize(b);
      out.write(data.data(), std::streamsize(data.size()));
      out.flush();
      if (!out) {
        out.close();
        fs::remove(tmp, ec);
        return false;
      }
    }
    fs::rename(tmp, path, ec);
    if (ec) {
      fs::remove(tmp, ec);
      return false;
    }
    return true;
  }
};

KernelCache::KernelCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KernelCache::~KernelCache() = default;

Result<std::shared_ptr<KernelCache>> KernelCache::open(std::string dir, std::size_t memory_entries) {
  auto impl = std::make_unique<Impl>();
  impl->capacity = std::max<std::size_t>(memory_entries, 1);
  if (!dir.empty()) {
    std::error_code ec;
    fs::path root = fs::absolute(fs::path(dir), ec);
    if (ec) return tl::unexpected(io_error(dir, ec.message()));
    fs::create_directories(root / "v1", ec);
    if (ec) return tl::unexpected(io_error(dir, ec.message()));
    // Prove we can write: a folder we can list but not write would fail every store later.
    fs::path probe = root / "v1" / (".probe." + std::to_string(::getpid()));
    {
      std::ofstream out(probe, std::ios::binary | std::ios::trunc);
      out << "ok";
      if (!out) return tl::unexpected(io_error(dir, "not writable"));
    }
    fs::remove(probe, ec);
    impl->dir = root.string();
  }
  return std::shared_ptr<KernelCache>(new KernelCache(std::move(impl)));
}

namespace {
std::mutex g_global_mu;
std::shared_ptr<KernelCache> g_global;
}  // namespace

std::string KernelCache::default_dir() {
  using stitchcuda::detail::environment;
  // An empty STITCHCUDA_CACHE_DIR disables the disk store.
  if (auto env = stitchcuda::detail::raw_setting(stitchcuda::detail::Setting::cache_dir)) return *env;
  if (auto xdg = environment("XDG_CACHE_HOME")) return (fs::path(*xdg) / "stitchcuda").string();
  if (auto home = environment("HOME")) return (fs::path(*home) / ".cache" / "stitchcuda").string();
  return (fs::temp_directory_path() / "stitchcuda-cache").string();
}

std::shared_ptr<KernelCache> KernelCache::global() {
  std::lock_guard lock(g_global_mu);
  if (!g_global) {
    std::string dir = default_dir();
    auto opened = open(dir);
    if (opened) {
      g_global = *opened;
    } else {
      g_global = *open("");
      g_global->impl_->warning = opened.error().message + " — using a memory-only cache";
    }
  }
  return g_global;
}

Result<void> KernelCache::set_global_dir(std::string dir) {
  auto opened = open(std::move(dir));
  if (!opened) return tl::unexpected(opened.error());
  std::lock_guard lock(g_global_mu);
  g_global = *opened;
  return {};
}

const std::string& KernelCache::dir() const { return impl_->dir; }

std::string KernelCache::warning() const {
  std::lock_guard lock(impl_->mu);
  return impl_->warning;
}

std::string KernelCache::entry_path(const std::string& key) const { return impl_->path_of(key); }

CacheStats KernelCache::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

void KernelCache::clear_memory() {
  std::lock_guard lock(impl_->mu);
  impl_->entries.clear();
  impl_->order.clear();
}

Result<std::shared_ptr<Module>> KernelCache::get(std::string_view source, const CompileOptions& options,
                                                 std::string_view program_name) {
  auto key = Compiler::cache_key(source, options, program_name);
  if (!key) return tl::unexpected(key.error());
  Impl& c = *impl_;
  std::promise<Result<std::shared_ptr<Module>>> promise;
  {
    std::unique_lock lock(c.mu);
    if (auto it = c.entries.find(*key); it != c.entries.end()) {
      ++c.stats.memory_hits;
      c.order.splice(c.order.begin(), c.order, it->second.pos);
      return it->second.module->with_origin("memory");
    }
    if (auto it = c.inflight.find(*key); it != c.inflight.end()) {
      auto waiting = it->second;
      ++c.stats.memory_hits;
      lock.unlock();
      auto result = waiting.get();
      if (!result) return result;
      return (*result)->with_origin("memory");
    }
    c.inflight.emplace(*key, promise.get_future().share());
  }

  Result<std::shared_ptr<Module>> result = fail(ErrorCode::Internal, "unset");
  // Waiters block on the promise: it must be fulfilled whatever happens below.
  try {
    if (auto binary = c.read(*key)) {
      auto module = Module::create(std::move(binary));
      module->set_origin("disk");
      std::lock_guard lock(c.mu);
      ++c.stats.disk_hits;
      result = module;
    } else {
      {
        std::lock_guard lock(c.mu);
        ++c.stats.misses;
        ++c.stats.compiles;
      }
      auto compiled = Compiler::compile(source, options, program_name);
      if (compiled) {
        bool stored = c.write(*compiled);
        auto module = Module::create(std::make_shared<const Binary>(std::move(*compiled)));
        std::lock_guard lock(c.mu);
        if (!stored) ++c.stats.disk_errors;
        result = module;
      } else {
        result = tl::unexpected(compiled.error());  // failures are never cached
      }
    }
  } catch (const std::exception& e) {
    result = fail(ErrorCode::Internal, std::string("compiling through the kernel cache failed unexpectedly: ") + e.what());
  }
  std::lock_guard lock(c.mu);
  if (result) c.remember(*key, *result);
  c.inflight.erase(*key);
  promise.set_value(result);
  return result;
}

Result<std::shared_ptr<Module>> build(std::string_view source, const CompileOptions& options,
                                      std::string_view program_name) {
  return KernelCache::global()->get(source, options, program_name);
}

}  // namespace stitchcuda::jit
