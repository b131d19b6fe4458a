// The C++ settings table and its typed reads, and the one loader of run-time libraries: the override
// variable, the copy already loaded, the ordered search and the "looked for:" error.
#include <cstdlib>
#include <optional>
#include <set>
#include <string>

#include <stitchcuda/detail/dynamic_library.hpp>
#include <stitchcuda/detail/settings.hpp>

#include "catch_shim.hpp"
#include "temp_dir.hpp"

namespace sd = stitchcuda::detail;
using stitchcuda_test::contains;

namespace {

// Sets a variable for one test and puts the previous value back.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace

TEST_CASE("every C++ setting is a typed STITCHCUDA_ variable with a reason, listed once", "[settings]") {
  std::set<std::string_view> names;
  for (const sd::SettingInfo& row : sd::settings_table()) {
    CHECK(row.name.rfind("STITCHCUDA_", 0) == 0);
    CHECK((row.type == "path" || row.type == "count"));
    CHECK(!row.reason.empty());
    CHECK(&sd::info(row.setting) == &row);
    names.insert(row.name);
  }
  CHECK(names.size() == sd::settings_table().size());
  CHECK(sd::info(sd::Setting::cupti).name == "STITCHCUDA_CUPTI");
  CHECK(sd::info(sd::Setting::matmul_tune).fallback == "1");
}

TEST_CASE("a count setting takes non-negative integers and nothing else", "[settings]") {
  {
    ScopedEnv env("STITCHCUDA_TF32X3_CHUNK", "256");
    CHECK(sd::count_setting(sd::Setting::tf32x3_chunk) == 256);
  }
  for (const char* bad : {"", "-1", "12x", "abc"}) {
    ScopedEnv env("STITCHCUDA_TF32X3_CHUNK", bad);
    CHECK_FALSE(sd::count_setting(sd::Setting::tf32x3_chunk).has_value());
  }
  ScopedEnv unset("STITCHCUDA_TF32X3_CHUNK", nullptr);
  CHECK_FALSE(sd::count_setting(sd::Setting::tf32x3_chunk).has_value());
}

TEST_CASE("an empty cache folder is a value, an empty path is unset", "[settings]") {
  ScopedEnv cache("STITCHCUDA_CACHE_DIR", "");
  REQUIRE(sd::raw_setting(sd::Setting::cache_dir).has_value());
  CHECK(sd::raw_setting(sd::Setting::cache_dir)->empty());
  ScopedEnv nvrtc("STITCHCUDA_CUBLASLT", "");
  CHECK_FALSE(sd::text_setting(sd::Setting::cublaslt).has_value());
}

TEST_CASE("the toolkit's folders: CUDA_HOME, CUDA_PATH, then /usr/local/cuda", "[settings][loader]") {
  ScopedEnv home("CUDA_HOME", "/opt/cuda-a");
  ScopedEnv path("CUDA_PATH", "/opt/cuda-b");
  CHECK(sd::toolkit_folders() == std::vector<std::string>{"/opt/cuda-a", "/opt/cuda-b", "/usr/local/cuda"});
  CHECK(sd::in_toolkit("libx.so.1").front() == "/opt/cuda-a/lib64/libx.so.1");
}

TEST_CASE("the loader lists every place it looked, with the reason a present file would not load", "[loader]") {
  ScopedEnv unset("STITCHCUDA_CUBLASLT", nullptr);
  stitchcuda_test::TempDir dir;
  const std::string not_a_library = dir.write("libnothing.so.13", "text, not an ELF file").string();
  const std::string missing = (dir.path() / "absent" / "libnothing.so.13").string();
  auto lib = sd::load_library({"libnothing.so.13", sd::Setting::cublaslt, {"libnothing.so.13", missing, not_a_library},
                               "nothing (libnothing.so.13) was not found: install it"});
  REQUIRE_FALSE(lib.has_value());
  CHECK(lib.error().code == stitchcuda::ErrorCode::Unavailable);
  CHECK(lib.error().message == "nothing (libnothing.so.13) was not found: install it");
  const std::string& looked = lib.error().log;
  CHECK(looked.rfind("looked for:\n  libnothing.so.13 (already loaded)\n  libnothing.so.13\n  " + missing + "\n  " +
                         not_a_library + " (",
                     0) == 0);
}

TEST_CASE("the override variable alone is tried, and a wrong one is named with the fix", "[loader]") {
  ScopedEnv bad("STITCHCUDA_CUBLASLT", "/no/such/libcublasLt.so.13");
  auto lib = sd::load_library({"libc.so.6", sd::Setting::cublaslt, {"libc.so.6"}, "unused"});
  REQUIRE_FALSE(lib.has_value());
  CHECK(lib.error().message == "STITCHCUDA_CUBLASLT points to '/no/such/libcublasLt.so.13', which could not be "
                               "loaded: point it at a libc.so.6 or unset it");
}

TEST_CASE("a library already in the process is preferred and reported by its file", "[loader]") {
  ScopedEnv unset("STITCHCUDA_CUBLASLT", nullptr);
  auto lib = sd::load_library({"libc.so.6", sd::Setting::cublaslt, {}, "unused"});
  REQUIRE(lib.has_value());
  CHECK(lib->path.front() == '/');
  CHECK(contains(lib->path, "libc.so.6"));
  void (*fn)(void*) = nullptr;
  CHECK(lib->bind(fn, "free"));
  CHECK_FALSE(lib->bind(fn, "stitchcuda_no_such_symbol"));

  // The override wins over the copy already loaded, and reports the file it names.
  ScopedEnv named("STITCHCUDA_CUBLASLT", lib->path.c_str());
  auto again = sd::load_library({"libnothing.so.13", sd::Setting::cublaslt, {}, "unused"});
  REQUIRE(again.has_value());
  CHECK(again->path == lib->path);
}
