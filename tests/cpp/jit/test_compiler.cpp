// Compiler, Binary, Module lookups, declared_signature and KernelArgs: everything that needs NVRTC
// but no GPU, so these run on development machines and CI.
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include <stitchcuda/jit.hpp>

#include "catch_shim.hpp"
#include "gpu.hpp"
#include "kernels.hpp"
#include "temp_dir.hpp"

using namespace stitchcuda;
using namespace stitchcuda::jit;
using stitchcuda_test::contains;

namespace {


// Compiles and fails the test with the full compiler output when NVRTC says no.
Binary compile_ok(std::string_view source, const CompileOptions& options = {}) {
  auto result = Compiler::compile(source, options);
  if (!result) FAIL("compile failed: " << result.error().describe());
  return *result;
}

bool is_32bit_int(ParamKind k) { return k == ParamKind::U32 || k == ParamKind::S32; }

}  // namespace

TEST_CASE("compile produces CUBIN, PTX and the kernel's parameters", "[jit][compiler]") {
  const Binary bin = compile_ok(kVectorAdd);

  CHECK_FALSE(bin.cubin.empty());
  CHECK(contains(bin.ptx, ".entry add"));
  CHECK(bin.program_name == "kernel.cu");
  CHECK(bin.key.size() == 64);  // hex SHA-256
  CHECK(bin.compile_ms > 0.0);
  // Without a GPU the default target is the H200's; with one it is that device's.
  if (stitchcuda_test::has_gpu()) {
    CHECK(bin.arch == Compiler::default_arch());
  } else {
    CHECK(bin.arch == "sm_90a");
    CHECK(Compiler::default_arch() == "sm_90a");
  }

  const KernelInfo* add = bin.find_kernel("add");
  REQUIRE(add != nullptr);
  CHECK(add->name == "add");
  REQUIRE(add->params.size() == 4);
  for (int i = 0; i < 3; ++i) {  // pointers are 64-bit in PTX
    CHECK(add->params[i].kind == ParamKind::U64);
    CHECK(add->params[i].size == 8);
    CHECK(add->params[i].align == 8);
  }
  CHECK(is_32bit_int(add->params[3].kind));  // PTX declares int as .u32
  CHECK(add->params[3].size == 4);
  CHECK(add->params[3].align == 4);
  CHECK(bin.find_kernel("sub") == nullptr);
}

TEST_CASE("compile is reproducible: same inputs, same key", "[jit][compiler]") {
  const Binary a = compile_ok(kVectorAdd);
  auto key = Compiler::cache_key(kVectorAdd, {});
  REQUIRE(key);
  CHECK(*key == a.key);
  CHECK(*Compiler::cache_key(kVectorAdd, {}) == *key);
  // The program name shows up in diagnostics, so it is part of the key.
  CHECK(*Compiler::cache_key(kVectorAdd, {}, "other.cu") != *key);
  CHECK(*Compiler::cache_key(std::string(kVectorAdd) + "\n// changed\n", {}) != *key);
}

TEST_CASE("NVRTC facts are reported", "[jit][compiler]") {
  auto version = Compiler::nvrtc_version();
  REQUIRE(version);
  CHECK(contains(*version, "."));
  auto path = Compiler::nvrtc_path();
  REQUIRE(path);
  CHECK(contains(*path, "nvrtc"));
  auto archs = Compiler::supported_archs();
  REQUIRE(archs);
  const std::set<std::string> set(archs->begin(), archs->end());
  CHECK(set.count("sm_90a") == 1);
  CHECK(set.count("sm_80") == 1);
  CHECK_FALSE(Compiler::system_include_paths().empty());
}

TEST_CASE("a compile error maps to the caller's line, with its text", "[jit][compiler]") {
  // The undefined identifier is on line 5 of what the caller wrote, whatever the library prepends.
  const std::string source =
      "extern \"C\" __global__ void k(float* x) {\n"  // 1
      "  int i = threadIdx.x;\n"                     // 2
      "\n"                                           // 3
      "  // the next line is wrong on purpose\n"     // 4
      "  x[i] = undefined_thing * 2.0f;\n"           // 5
      "}\n";                                         // 6
  auto result = Compiler::compile(source, {});
  REQUIRE_FALSE(result);
  const Error& err = result.error();
  CHECK(err.code == ErrorCode::CompileError);
  CHECK(contains(err.log, "undefined_thing"));
  CHECK(contains(err.describe(), err.message));
  CHECK(contains(err.describe(), "undefined_thing"));

  REQUIRE_FALSE(err.diagnostics.empty());
  const Diagnostic& d = err.diagnostics.front();
  INFO("diagnostic: " << d.file << ":" << d.line << ": " << d.message);
  CHECK(d.line == 5);
  CHECK(d.severity == "error");
  CHECK(d.file == "kernel.cu");
  CHECK(contains(d.message, "undefined_thing"));
  CHECK(contains(d.source_line, "x[i] = undefined_thing * 2.0f;"));
}

TEST_CASE("defines reach the preprocessor", "[jit][compiler]") {
  const char* source = R"(extern "C" __global__ void k(int* out) { *out = MAGIC_VALUE; }
#ifndef FLAG_ONLY
#error FLAG_ONLY must be defined
#endif
)";
  CompileOptions options;
  options.defines = {{"MAGIC_VALUE", "123456789"}, {"FLAG_ONLY", ""}};
  const Binary bin = compile_ok(source, options);
  CHECK(contains(bin.ptx, "123456789"));

  CompileOptions other = options;
  other.defines[0].second = "987654321";
  CHECK(*Compiler::cache_key(source, other) != bin.key);

  auto missing = Compiler::compile(source, {});
  REQUIRE_FALSE(missing);
  CHECK(missing.error().code == ErrorCode::CompileError);
  CHECK(contains(missing.error().log, "MAGIC_VALUE"));
}

TEST_CASE("include_paths find headers on disk, and their contents are part of the key",
          "[jit][compiler]") {
  stitchcuda_test::TempDir dir;
  dir.write("my_consts.h", "#pragma once\n#define FROM_HEADER 424242\n");
  const char* source = R"(#include "my_consts.h"
extern "C" __global__ void k(int* out) { *out = FROM_HEADER; }
)";
  CompileOptions options;
  options.include_paths = {dir.str()};
  const Binary bin = compile_ok(source, options);
  CHECK(contains(bin.ptx, "424242"));

  // A stale binary must never be served after the header changed.
  dir.write("my_consts.h", "#pragma once\n#define FROM_HEADER 535353\n");
  auto changed_key = Compiler::cache_key(source, options);
  REQUIRE(changed_key);
  CHECK(*changed_key != bin.key);
  CHECK(contains(compile_ok(source, options).ptx, "535353"));

  auto without = Compiler::compile(source, {});
  REQUIRE_FALSE(without);
  CHECK(without.error().code == ErrorCode::CompileError);
  CHECK(contains(without.error().log, "my_consts.h"));
}

TEST_CASE("in-memory headers are included and keyed", "[jit][compiler]") {
  const char* source = R"(#include "gen/params.h"
extern "C" __global__ void k(int* out) { *out = TILE_ID; }
)";
  CompileOptions options;
  options.headers = {{"gen/params.h", "#define TILE_ID 987123\n"}};
  const Binary bin = compile_ok(source, options);
  CHECK(contains(bin.ptx, "987123"));

  CompileOptions other = options;
  other.headers[0].second = "#define TILE_ID 111222\n";
  CHECK(*Compiler::cache_key(source, other) != bin.key);
}

TEST_CASE("fast_math, line_info and max_registers change the key and the code", "[jit][compiler]") {
  const char* source = R"(extern "C" __global__ void d(float* a, const float* b) {
  a[threadIdx.x] = a[threadIdx.x] / b[threadIdx.x];
}
)";
  CompileOptions base;
  CompileOptions fast = base;
  fast.fast_math = true;
  CompileOptions lines = base;
  lines.line_info = true;
  CompileOptions regs = base;
  regs.max_registers = 32;

  std::set<std::string> keys;
  for (const auto* o : {&base, &fast, &lines, &regs}) {
    auto key = Compiler::cache_key(source, *o);
    REQUIRE(key);
    keys.insert(*key);
  }
  CHECK(keys.size() == 4);

  const Binary b = compile_ok(source, base);
  const Binary f = compile_ok(source, fast);
  const Binary l = compile_ok(source, lines);
  const Binary r = compile_ok(source, regs);
  CHECK(contains(b.ptx, "div.rn.f32"));  // IEEE division by default
  CHECK(contains(f.ptx, "approx"));      // --use_fast_math approximates it
  CHECK_FALSE(contains(b.ptx, ".loc"));
  CHECK(contains(l.ptx, ".loc"));        // -lineinfo emits source locations
  CHECK_FALSE(r.cubin.empty());
  CHECK(r.key != b.key);
}

TEST_CASE("cpp_standard 20 enables C++20 and 17 rejects it", "[jit][compiler]") {
  const char* source = R"(template <class T> concept Small = sizeof(T) <= 4;
template <Small T> __device__ T twice(T x) { return x + x; }
extern "C" __global__ void k(int* out) { *out = twice(*out); }
)";
  CompileOptions cxx20;
  cxx20.cpp_standard = 20;
  CHECK_FALSE(compile_ok(source, cxx20).cubin.empty());

  CompileOptions cxx17;
  cxx17.cpp_standard = 17;
  auto rejected = Compiler::compile(source, cxx17);
  REQUIRE_FALSE(rejected);
  CHECK(rejected.error().code == ErrorCode::CompileError);
  CHECK(*Compiler::cache_key(source, cxx17) != *Compiler::cache_key(source, cxx20));
}

TEST_CASE("name expressions export template instantiations", "[jit][compiler]") {
  const char* source = R"(template <typename T> __global__ void scale(T* x, T a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= a;
}
)";
  CompileOptions options;
  options.name_expressions = {"scale<float>", "scale<double>"};
  const Binary bin = compile_ok(source, options);

  REQUIRE(bin.lowered_names.size() == 2);
  std::set<std::string> names;
  for (const auto& [expr, symbol] : bin.lowered_names) {
    names.insert(expr);
    CHECK(symbol.rfind("_Z", 0) == 0);  // a mangled C++ symbol
  }
  CHECK(names == std::set<std::string>{"scale<float>", "scale<double>"});

  const KernelInfo* f = bin.find_kernel("scale<float>");
  const KernelInfo* d = bin.find_kernel("scale<double>");
  REQUIRE(f != nullptr);
  REQUIRE(d != nullptr);
  CHECK(f->name != d->name);
  REQUIRE(f->params.size() == 3);
  REQUIRE(d->params.size() == 3);
  CHECK(f->params[0].kind == ParamKind::U64);
  CHECK(f->params[1].kind == ParamKind::F32);
  CHECK(f->params[1].size == 4);
  CHECK(d->params[1].kind == ParamKind::F64);
  CHECK(d->params[1].size == 8);
  CHECK(is_32bit_int(f->params[2].kind));
  CHECK(bin.find_kernel(f->name) == f);  // the symbol works as well

  auto module = Module::create(std::make_shared<Binary>(bin));
  auto kernel = module->kernel("scale<double>");
  REQUIRE(kernel);
  CHECK(kernel->name() == "scale<double>");
  CHECK(kernel->symbol() == d->name);
  CHECK(kernel->params().size() == 3);
}

TEST_CASE("half and bfloat16 kernels compile, and 2-byte parameters are described", "[jit][compiler]") {
  const char* source = R"(#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void h(__half* x, __nv_bfloat16* y, __half hs, __nv_bfloat16 bs, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    x[i] = __hmul(x[i], hs);
    y[i] = __float2bfloat16(__bfloat162float(y[i]) * __bfloat162float(bs));
  }
}
)";
  const Binary bin = compile_ok(source);
  const KernelInfo* k = bin.find_kernel("h");
  REQUIRE(k != nullptr);
  REQUIRE(k->params.size() == 5);
  // PTX passes __half and __nv_bfloat16 as 2-byte aggregates.
  CHECK(k->params[2].size == 2);
  CHECK(k->params[2].align == 2);
  CHECK(k->params[3].size == 2);
}

TEST_CASE("a CUB block reduction compiles", "[jit][compiler]") {
  const char* source = R"(#include <cub/block/block_reduce.cuh>
extern "C" __global__ void block_sum(const float* in, float* out) {
  using Reduce = cub::BlockReduce<float, 128>;
  __shared__ typename Reduce::TempStorage scratch;
  float sum = Reduce(scratch).Sum(in[blockIdx.x * 128 + threadIdx.x]);
  if (threadIdx.x == 0) out[blockIdx.x] = sum;
}
)";
  const Binary bin = compile_ok(source);
  CHECK_FALSE(bin.cubin.empty());
  const KernelInfo* k = bin.find_kernel("block_sum");
  REQUIRE(k != nullptr);
  CHECK(k->params.size() == 2);
}

TEST_CASE("explicit architectures", "[jit][compiler]") {
  CompileOptions sm80;
  sm80.arch = "sm_80";
  const Binary bin = compile_ok(kVectorAdd, sm80);
  CHECK(bin.arch == "sm_80");
  CHECK_FALSE(bin.cubin.empty());
  CHECK(contains(bin.ptx, ".target sm_80"));
  CHECK(bin.key != compile_ok(kVectorAdd).key);

  // A virtual architecture yields PTX only.
  CompileOptions virt;
  virt.arch = "compute_90";
  const Binary ptx_only = compile_ok(kVectorAdd, virt);
  CHECK(ptx_only.cubin.empty());
  CHECK(contains(ptx_only.ptx, ".entry add"));
}

TEST_CASE("unsupported architectures are rejected with the supported list", "[jit][compiler]") {
  auto supported = Compiler::supported_archs();
  REQUIRE(supported);
  REQUIRE_FALSE(supported->empty());
  for (const std::string arch : {"sm_10", "sm_999"}) {
    CompileOptions options;
    options.arch = arch;
    auto result = Compiler::compile(kVectorAdd, options);
    REQUIRE_FALSE(result);
    INFO(result.error().message);
    CHECK(result.error().code == ErrorCode::InvalidArgument);
    CHECK(contains(result.error().message, arch));
    CHECK(contains(result.error().message, supported->front()));
    CHECK(contains(result.error().message, "sm_90"));
  }
}

TEST_CASE("bad options are rejected with a message naming them", "[jit][compiler]") {
  SECTION("unknown extra flag") {
    CompileOptions options;
    options.extra_flags = {"--no-such-flag"};
    auto result = Compiler::compile(kVectorAdd, options);
    REQUIRE_FALSE(result);
    INFO(result.error().describe());
    CHECK((result.error().code == ErrorCode::InvalidArgument ||
           result.error().code == ErrorCode::CompileError));
    CHECK(contains(result.error().message, "--no-such-flag"));
  }
  SECTION("C++14") {
    CompileOptions options;
    options.cpp_standard = 14;
    auto result = Compiler::compile(kVectorAdd, options);
    REQUIRE_FALSE(result);
    CHECK(result.error().code == ErrorCode::InvalidArgument);
    CHECK(contains(result.error().message, "14"));
  }
  SECTION("empty source") {
    auto result = Compiler::compile("", {});
    REQUIRE_FALSE(result);
    CHECK(result.error().code == ErrorCode::InvalidArgument);
  }
}

TEST_CASE("Module lookups work without a GPU", "[jit][compiler]") {
  auto module = Module::create(std::make_shared<Binary>(compile_ok(kVectorAdd)));
  CHECK(module->origin() == "compiled");

  auto add = module->kernel("add");
  REQUIRE(add);
  CHECK(add->name() == "add");
  CHECK(add->symbol() == "add");
  CHECK(add->params().size() == 4);
  CHECK(add->module() == module);

  auto missing = module->kernel("missing");
  REQUIRE_FALSE(missing);
  CHECK(missing.error().code == ErrorCode::NotFound);
  CHECK(contains(missing.error().message, "missing"));
  CHECK(contains(missing.error().message, "add"));  // lists what exists
}

TEST_CASE("without a GPU, driver work reports Unavailable", "[jit][compiler]") {
  if (stitchcuda_test::has_gpu()) STITCHCUDA_SKIP("a CUDA device is present");
  auto available = Driver::available();
  REQUIRE_FALSE(available);
  CHECK(available.error().code == ErrorCode::Unavailable);
  CHECK_FALSE(available.error().message.empty());
  CHECK(Driver::device_count() == 0);

  auto module = Module::create(std::make_shared<Binary>(compile_ok(kVectorAdd)));
  auto add = module->kernel("add");
  REQUIRE(add);
  KernelArgs args;
  int dummy = 0;
  args.pointer(&dummy).pointer(&dummy).pointer(&dummy).i32(1);
  LaunchConfig cfg;
  cfg.block = {32, 1, 1};
  auto launched = add->launch(cfg, args);
  REQUIRE_FALSE(launched);
  CHECK(launched.error().code == ErrorCode::Unavailable);
  auto attrs = add->attributes();
  REQUIRE_FALSE(attrs);
  CHECK(attrs.error().code == ErrorCode::Unavailable);
}

TEST_CASE("declared_signature reads parameter types from source", "[jit][compiler]") {
  const char* source = R"(
// a comment mentioning f(int x) must not confuse it
extern "C" __global__ void f(const float* __restrict__ a, float* b, int n) { }
__global__ void g(double x,
                  unsigned long long* out) { }
template <typename T> __global__ void t(T* x) { }
)";
  CHECK(declared_signature(source, "f") == std::vector<std::string>{"const float*", "float*", "int"});
  CHECK(declared_signature(source, "g") == std::vector<std::string>{"double", "unsigned long long*"});
  CHECK(declared_signature(source, "nope").empty());
  CHECK(declared_signature(source, "t").empty());  // templates are not described
}

TEST_CASE("KernelArgs packs values with their natural size and alignment", "[jit][compiler]") {
  KernelArgs args;
  int device_value = 0;
  args.i32(-7).f64(2.5).pointer(&device_value).u32(42u).f32(1.5f).i64(-(std::int64_t{1} << 40));
  struct alignas(16) Pod {
    float v[3];
  } pod{{1.f, 2.f, 3.f}};
  args.bytes(&pod, sizeof(pod), alignof(Pod));

  REQUIRE(args.size() == 7);
  const std::vector<std::size_t> sizes{4, 8, 8, 4, 4, 8, 16};
  for (std::size_t i = 0; i < sizes.size(); ++i) CHECK(args.size_of(i) == sizes[i]);

  const auto p = args.pointers();
  REQUIRE(p.size() == 7);
  auto aligned = [](const void* ptr, std::size_t a) {
    return reinterpret_cast<std::uintptr_t>(ptr) % a == 0;
  };
  CHECK(aligned(p[1], 8));  // a double after an int is padded to 8
  CHECK(aligned(p[2], 8));
  CHECK(aligned(p[5], 8));
  CHECK(aligned(p[6], 16));

  std::int32_t i32;
  double f64;
  const void* ptr;
  std::uint32_t u32;
  float f32;
  std::int64_t i64;
  std::memcpy(&i32, p[0], 4);
  std::memcpy(&f64, p[1], 8);
  std::memcpy(&ptr, p[2], 8);
  std::memcpy(&u32, p[3], 4);
  std::memcpy(&f32, p[4], 4);
  std::memcpy(&i64, p[5], 8);
  CHECK(i32 == -7);
  CHECK(f64 == 2.5);
  CHECK(ptr == &device_value);
  CHECK(u32 == 42u);
  CHECK(f32 == 1.5f);
  CHECK(i64 == -(std::int64_t{1} << 40));
  CHECK(std::memcmp(p[6], &pod, sizeof(pod)) == 0);

  args.clear();
  CHECK(args.size() == 0);
  CHECK(args.pointers().empty());
}

TEST_CASE("error codes have stable names", "[jit][compiler]") {
  CHECK(std::string(to_string(ErrorCode::CompileError)) == "CompileError");
  CHECK(std::string(to_string(ErrorCode::LaunchError)) == "LaunchError");
  CHECK(std::string(to_string(ErrorCode::InvalidArgument)) == "InvalidArgument");
  CHECK(std::string(to_string(ErrorCode::IoError)) == "IoError");
  const Error e{ErrorCode::CudaError, "what happened", "the log", {}};
  CHECK(contains(e.describe(), "what happened"));
  CHECK(contains(e.describe(), "the log"));
  CHECK_FALSE(std::string(version()).empty());
}

TEST_CASE("a cubin is loaded only where its machine code runs", "[jit]") {
  using stitchcuda::jit::Binary;
  Binary b;
  b.cubin = "\x7f" "ELF";
  b.arch = "sm_80";
  CHECK(b.cubin_runs_on(8, 0));
  CHECK(b.cubin_runs_on(8, 6));   // later minor of the same major
  CHECK_FALSE(b.cubin_runs_on(9, 0));
  b.arch = "sm_90a";
  CHECK(b.cubin_runs_on(9, 0));
  CHECK_FALSE(b.cubin_runs_on(10, 0));  // arch-specific code runs only on its target
  b.arch = "compute_90";
  CHECK_FALSE(b.cubin_runs_on(9, 0));   // PTX targets are JIT-compiled by the driver
}

TEST_CASE("the order of defines does not change the cache key", "[jit]") {
  using namespace stitchcuda::jit;
  const char* src = "extern \"C\" __global__ void k(int* x) { x[0] = A + B; }";
  CompileOptions ab, ba;
  ab.defines = {{"A", "1"}, {"B", "2"}};
  ba.defines = {{"B", "2"}, {"A", "1"}};
  auto k1 = Compiler::cache_key(src, ab);
  auto k2 = Compiler::cache_key(src, ba);
  REQUIRE(k1);
  REQUIRE(k2);
  CHECK(*k1 == *k2);
}

namespace {
// e_type of an ELF image: 1 = relocatable object, 2 = executable (a loadable CUBIN).
int elf_type(const std::string& image) {
  REQUIRE(image.size() > 18);
  REQUIRE(image.compare(0, 4, "\x7f" "ELF") == 0);
  return static_cast<unsigned char>(image[16]) | (static_cast<unsigned char>(image[17]) << 8);
}
}  // namespace

TEST_CASE("device_runtime links relocatable code with the CUDA device runtime", "[jit][compiler]") {
  // The device graph launcher the program executor uses: cudaGraphLaunch is defined in libcudadevrt.a.
  const char* launcher = R"(
extern "C" __global__ void launch_graph(cudaGraphExec_t exec) { cudaGraphLaunch(exec, cudaStreamGraphTailLaunch); }
)";
  CompileOptions relocatable;
  relocatable.arch = "sm_90a";
  relocatable.extra_flags = {"-rdc=true"};
  Binary unlinked = compile_ok(launcher, relocatable);
  CHECK(elf_type(unlinked.cubin) == 1);

  CompileOptions linked;
  linked.arch = "sm_90a";
  linked.device_runtime = true;
  Binary b = compile_ok(launcher, linked);
  CHECK(elf_type(b.cubin) == 2);
  REQUIRE(b.find_kernel("launch_graph") != nullptr);
  CHECK(b.find_kernel("launch_graph")->params.size() == 1);
  auto plain_key = Compiler::cache_key(launcher, relocatable);
  REQUIRE(plain_key);
  CHECK(b.key != *plain_key);

  SECTION("an undefined device function is a link error naming it") {
    auto r = Compiler::compile(R"(
extern __device__ int not_defined_anywhere(int);
extern "C" __global__ void k(int* x) { x[0] = not_defined_anywhere(x[0]); }
)", linked);
    REQUIRE_FALSE(r);
    CHECK(r.error().code == ErrorCode::CompileError);
    CHECK(contains(r.error().message + r.error().log, "not_defined_anywhere"));
  }
  SECTION("a PTX-only target cannot be linked") {
    CompileOptions virtual_arch = linked;
    virtual_arch.arch = "compute_90";
    auto r = Compiler::compile(launcher, virtual_arch);
    REQUIRE_FALSE(r);
    CHECK(r.error().code == ErrorCode::InvalidArgument);
    CHECK(contains(r.error().message, "sm_90a"));
  }
}
