// KernelCache: memory and disk hits, keys, corruption recovery, atomic writes, concurrent misses,
// unusable folders and the process-wide cache. NVRTC only; no GPU needed.
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <latch>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <stitchcuda/jit.hpp>
#include <sys/stat.h>

#include "catch_shim.hpp"
#include "temp_dir.hpp"

using namespace stitchcuda;
using namespace stitchcuda::jit;
using stitchcuda_test::contains;
namespace fs = std::filesystem;

namespace {

// A different constant gives a different program, so each test can make as many keys as it needs.
std::string source_with(int value) {
  return "extern \"C\" __global__ void k(int* out) { *out = " + std::to_string(value) + "; }\n";
}

std::shared_ptr<KernelCache> open_cache(const std::string& dir, std::size_t memory_entries = 512) {
  auto cache = KernelCache::open(dir, memory_entries);
  if (!cache) FAIL("KernelCache::open(" << dir << ") failed: " << cache.error().describe());
  return *cache;
}

std::shared_ptr<Module> get_ok(KernelCache& cache, const std::string& source,
                               const CompileOptions& options = {}) {
  auto module = cache.get(source, options);
  if (!module) FAIL("get failed: " << module.error().describe());
  REQUIRE(*module != nullptr);
  return *module;
}

// Every regular file under `dir`, normalized so it compares with entry_path().
std::set<std::string> files_under(const fs::path& dir) {
  std::set<std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files.insert(e.path().lexically_normal().string());
  return files;
}

std::string normalized(const std::string& path) { return fs::path(path).lexically_normal().string(); }

}  // namespace

TEST_CASE("a miss compiles, then memory serves, then a new cache reads the disk", "[jit][cache]") {
  stitchcuda_test::TempDir dir;
  const std::string src = source_with(1);
  std::string key, cubin;
  {
    auto cache = open_cache(dir.str());
    CHECK(normalized(cache->dir()) == normalized(dir.str()));
    auto first = get_ok(*cache, src);
    CHECK(first->origin() == "compiled");
    CHECK(first->binary().compile_ms > 0.0);
    key = first->binary().key;
    cubin = first->binary().cubin;
    CHECK(key == *Compiler::cache_key(src, {}));

    CacheStats s = cache->stats();
    CHECK(s.misses == 1);
    CHECK(s.compiles == 1);
    CHECK(s.memory_hits == 0);
    CHECK(s.disk_hits == 0);

    auto second = get_ok(*cache, src);
    CHECK(second->origin() == "memory");
    CHECK(&second->binary() == &first->binary());  // the same compiled program, not a copy
    s = cache->stats();
    CHECK(s.memory_hits == 1);
    CHECK(s.compiles == 1);

    const std::string entry = cache->entry_path(key);
    CHECK_FALSE(entry.empty());
    CHECK(fs::is_regular_file(entry));
    CHECK(contains(normalized(entry), normalized(dir.str())));
  }

  auto reopened = open_cache(dir.str());
  auto from_disk = get_ok(*reopened, src);
  CHECK(from_disk->origin() == "disk");
  CHECK(from_disk->binary().key == key);
  CHECK(from_disk->binary().cubin == cubin);
  CHECK(from_disk->binary().compile_ms == 0.0);
  REQUIRE(from_disk->binary().find_kernel("k") != nullptr);
  CHECK(from_disk->binary().find_kernel("k")->params.size() == 1);
  const CacheStats s = reopened->stats();
  CHECK(s.disk_hits == 1);
  CHECK(s.misses == 0);
  CHECK(s.compiles == 0);

  // Dropping memory falls back to disk, not to a compile.
  reopened->clear_memory();
  CHECK(get_ok(*reopened, src)->origin() == "disk");
  CHECK(reopened->stats().disk_hits == 2);
  CHECK(reopened->stats().compiles == 0);
}

TEST_CASE("the same source with different options is a different entry", "[jit][cache]") {
  stitchcuda_test::TempDir dir;
  auto cache = open_cache(dir.str());
  const std::string src = source_with(2);
  CompileOptions fast;
  fast.fast_math = true;
  auto a = get_ok(*cache, src);
  auto b = get_ok(*cache, src, fast);
  CHECK(a->binary().key != b->binary().key);
  CHECK(b->origin() == "compiled");
  CHECK(cache->stats().compiles == 2);
  CHECK(cache->entry_path(a->binary().key) != cache->entry_path(b->binary().key));
  CHECK(fs::is_regular_file(cache->entry_path(b->binary().key)));
}

TEST_CASE("the memory store is a bounded LRU backed by disk", "[jit][cache]") {
  stitchcuda_test::TempDir dir;
  auto cache = open_cache(dir.str(), 2);
  get_ok(*cache, source_with(10));
  get_ok(*cache, source_with(11));
  get_ok(*cache, source_with(12));  // evicts 10, the least recently used
  CHECK(get_ok(*cache, source_with(12))->origin() == "memory");
  CHECK(get_ok(*cache, source_with(10))->origin() == "disk");
  const CacheStats s = cache->stats();
  CHECK(s.compiles == 3);
  CHECK(s.disk_hits == 1);
  CHECK(s.memory_hits == 1);
}

TEST_CASE("a damaged disk entry is detected, counted and rebuilt", "[jit][cache]") {
  stitchcuda_test::TempDir dir;
  const std::string src = source_with(3);
  std::string key, cubin, entry;
  {
    auto cache = open_cache(dir.str());
    auto m = get_ok(*cache, src);
    key = m->binary().key;
    cubin = m->binary().cubin;
    entry = cache->entry_path(key);
  }
  REQUIRE(fs::is_regular_file(entry));
  const auto full_size = fs::file_size(entry);
  REQUIRE(full_size > 16);

  SECTION("truncated") { fs::resize_file(entry, full_size / 2); }
  SECTION("bytes flipped in the middle") {
    std::fstream f(entry, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(full_size / 2));
    char bytes[4];
    f.read(bytes, sizeof bytes);
    for (char& c : bytes) c = static_cast<char>(~c);
    f.seekp(static_cast<std::streamoff>(full_size / 2));
    f.write(bytes, sizeof bytes);
  }
  SECTION("emptied") { fs::resize_file(entry, 0); }

  {
    auto cache = open_cache(dir.str());
    auto rebuilt = get_ok(*cache, src);
    CHECK(rebuilt->origin() == "compiled");
    CHECK(rebuilt->binary().cubin == cubin);
    const CacheStats s = cache->stats();
    CHECK(s.corrupt_entries == 1);
    CHECK(s.disk_hits == 0);
    CHECK(s.compiles == 1);
  }
  // The rebuilt entry is whole again: a third cache trusts it.
  auto cache = open_cache(dir.str());
  auto again = get_ok(*cache, src);
  CHECK(again->origin() == "disk");
  CHECK(again->binary().cubin == cubin);
  CHECK(cache->stats().corrupt_entries == 0);
  CHECK(cache->stats().disk_hits == 1);
}

TEST_CASE("an entry that is not a regular file is never read: a link to /dev/zero, a FIFO, a folder", "[jit][cache]") {
  stitchcuda_test::TempDir dir;
  const std::string src = source_with(4);
  std::string entry, cubin;
  {
    auto cache = open_cache(dir.str());
    auto m = get_ok(*cache, src);
    entry = cache->entry_path(m->binary().key);
    cubin = m->binary().cubin;
  }
  fs::remove(entry);
  bool folder = false;
  SECTION("a symbolic link to /dev/zero") { fs::create_symlink("/dev/zero", entry); }
  SECTION("a FIFO") { REQUIRE(::mkfifo(entry.c_str(), 0600) == 0); }
  SECTION("a folder") {
    fs::create_directory(entry);
    folder = true;
  }
  SECTION("a file larger than any entry") {
    { std::ofstream(entry, std::ios::binary) << "x"; }
    fs::resize_file(entry, std::uintmax_t(1) << 30);  // sparse: reading it whole would take a GiB
  }
  auto cache = open_cache(dir.str());
  const auto start = std::chrono::steady_clock::now();
  auto rebuilt = get_ok(*cache, src);  // compiled again, not hung or exhausted
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
  CHECK(rebuilt->origin() == "compiled");
  CHECK(rebuilt->binary().cubin == cubin);
  CHECK(cache->stats().corrupt_entries == 1);
  if (!folder) CHECK(fs::is_regular_file(entry));  // replaced by a good entry
}

TEST_CASE("disk writes leave only entries behind (no temporary files)", "[jit][cache]") {
  stitchcuda_test::TempDir dir;
  auto cache = open_cache(dir.str());
  std::set<std::string> entries;
  for (int v = 20; v < 24; ++v)
    entries.insert(normalized(cache->entry_path(get_ok(*cache, source_with(v))->binary().key)));
  CHECK(entries.size() == 4);
  CHECK(files_under(dir.path()) == entries);
  CHECK(cache->stats().disk_errors == 0);
}

TEST_CASE("concurrent misses on one key share one compile", "[jit][cache]") {
  stitchcuda_test::TempDir dir;
  auto cache = open_cache(dir.str());
  const std::string src = source_with(4);
  constexpr int kThreads = 8;
  std::vector<std::shared_ptr<Module>> results(kThreads);
  std::vector<std::string> errors(kThreads);
  std::latch start(kThreads);  // release all threads at once so their misses overlap
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      auto m = cache->get(src, {});
      if (m)
        results[t] = *m;
      else
        errors[t] = m.error().describe();
    });
  }
  for (auto& th : threads) th.join();

  for (int t = 0; t < kThreads; ++t) {
    INFO("thread " << t << ": " << errors[t]);
    REQUIRE(results[t] != nullptr);
    CHECK(&results[t]->binary() == &results[0]->binary());  // one compile's output, shared
  }
  const CacheStats s = cache->stats();
  CHECK(s.compiles == 1);
  CHECK(s.memory_hits + s.misses == kThreads);
}

TEST_CASE("an unusable cache folder fails with IoError naming it", "[jit][cache]") {
  stitchcuda_test::TempDir dir;
  // A path below a regular file cannot be created, even by root (chmod would not stop root).
  dir.write("afile", "not a folder");
  const std::string bad = (dir.path() / "afile" / "cache").string();
  auto cache = KernelCache::open(bad);
  REQUIRE_FALSE(cache);
  CHECK(cache.error().code == ErrorCode::IoError);
  CHECK(contains(cache.error().message, bad));
}

TEST_CASE("an empty folder gives a memory-only cache", "[jit][cache]") {
  auto cache = open_cache("");
  CHECK(cache->dir().empty());
  const std::string src = source_with(5);
  auto first = get_ok(*cache, src);
  CHECK(first->origin() == "compiled");
  CHECK(cache->entry_path(first->binary().key).empty());
  CHECK(get_ok(*cache, src)->origin() == "memory");
  CHECK(cache->stats().memory_hits == 1);
  CHECK(cache->stats().compiles == 1);
}

TEST_CASE("a compile error is returned every time and never stored", "[jit][cache]") {
  stitchcuda_test::TempDir dir;
  auto cache = open_cache(dir.str());
  const std::string bad = "extern \"C\" __global__ void k(int* out) { *out = not_declared; }\n";
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto m = cache->get(bad, {});
    REQUIRE_FALSE(m);
    CHECK(m.error().code == ErrorCode::CompileError);
    CHECK(contains(m.error().log, "not_declared"));
  }
  auto key = Compiler::cache_key(bad, {});
  REQUIRE(key);
  CHECK_FALSE(fs::exists(cache->entry_path(*key)));
  CHECK(files_under(dir.path()).empty());
  CHECK(cache->stats().memory_hits == 0);
  CHECK(cache->stats().disk_hits == 0);
}

TEST_CASE("the process-wide cache follows set_global_dir and the environment", "[jit][cache]") {
  stitchcuda_test::TempDir dir;
  REQUIRE(KernelCache::set_global_dir(dir.str()));
  CHECK(normalized(KernelCache::global()->dir()) == normalized(dir.str()));

  const std::string src = source_with(6);
  auto first = build(src);
  REQUIRE(first);
  CHECK((*first)->origin() == "compiled");
  auto second = build(src);
  REQUIRE(second);
  CHECK((*second)->origin() == "memory");
  CHECK(fs::is_regular_file(KernelCache::global()->entry_path((*first)->binary().key)));

  REQUIRE(KernelCache::set_global_dir(""));
  CHECK(KernelCache::global()->dir().empty());

  // default_dir reads the environment each time; restore what the process had.
  const char* saved_env = std::getenv("STITCHCUDA_CACHE_DIR");
  const std::string saved = saved_env ? saved_env : "";
  ::setenv("STITCHCUDA_CACHE_DIR", dir.str().c_str(), 1);
  CHECK(KernelCache::default_dir() == dir.str());
  ::unsetenv("STITCHCUDA_CACHE_DIR");
  const char* saved_xdg_env = std::getenv("XDG_CACHE_HOME");
  const std::string saved_xdg = saved_xdg_env ? saved_xdg_env : "";
  ::setenv("XDG_CACHE_HOME", "/somewhere/xdg", 1);
  CHECK(normalized(KernelCache::default_dir()) == normalized("/somewhere/xdg/stitchcuda"));
  if (saved_xdg_env)
    ::setenv("XDG_CACHE_HOME", saved_xdg.c_str(), 1);
  else
    ::unsetenv("XDG_CACHE_HOME");
  if (saved_env) ::setenv("STITCHCUDA_CACHE_DIR", saved.c_str(), 1);
}
