// The source detectors on small CUDA snippets: each technique is found in code, and the same word in a
// comment or a string literal is not; inline PTX (asm operands) counts as code.
#include <algorithm>
#include <random>

#include <stitchcuda/rubric.hpp>

#include "catch_shim.hpp"

using namespace stitchcuda::rubric;

namespace {

Techniques scan(const std::string& cuda) { return detect_techniques({cuda}); }

const Sighting* sighting(const Techniques& t, Technique technique) {
  for (const Sighting& s : t.sightings)
    if (s.technique == technique) return &s;
  return nullptr;
}

}  // namespace

TEST_CASE("strip_cuda blanks comments and literals, keeps length, lines and asm operands", "[rubric]") {
  const std::string src =
      "// __shared__ in a line comment\n"
      "/* float4 in a\n block comment */ int x = 1'000;\n"
      "const char* s = \"wmma \\\" __shfl_sync\"; char c = '\"';\n"
      "auto raw = R\"x(cp.async )\" here)x\";\n"
      "asm volatile(\"mma.sync.aligned.m16n8k8\" : : );\n";
  const std::string clean = strip_cuda(src);
  REQUIRE(clean.size() == src.size());
  CHECK(std::count(clean.begin(), clean.end(), '\n') == std::count(src.begin(), src.end(), '\n'));
  CHECK_FALSE(stitchcuda_test::contains(clean, "__shared__"));
  CHECK_FALSE(stitchcuda_test::contains(clean, "float4"));
  CHECK_FALSE(stitchcuda_test::contains(clean, "wmma"));
  CHECK_FALSE(stitchcuda_test::contains(clean, "__shfl_sync"));
  CHECK_FALSE(stitchcuda_test::contains(clean, "cp.async"));
  CHECK(stitchcuda_test::contains(clean, "int x = 1'000;"));  // a digit separator opens no literal
  CHECK(stitchcuda_test::contains(clean, "mma.sync.aligned"));
}

TEST_CASE("strip_python blanks comments, strings and docstrings", "[rubric]") {
  const std::string src =
      "# tile the softmax\n"
      "def f(x):\n"
      "    \"\"\"uses float4\n    and wmma\"\"\"\n"
      "    s = 'gelu' + r\"bias\"\n"
      "    return softmax_kernel(x)  # fused\n";
  const std::string clean = strip_python(src);
  REQUIRE(clean.size() == src.size());
  for (const char* gone : {"tile", "float4", "wmma", "gelu", "bias", "fused"})
    CHECK_FALSE(stitchcuda_test::contains(clean, gone));
  CHECK(stitchcuda_test::contains(clean, "return softmax_kernel(x)"));
}

TEST_CASE("shared-memory tiling needs __shared__ and a block barrier", "[rubric]") {
  const std::string tiled =
      "__global__ void k(const float* a, float* c) {\n"
      "  __shared__ float tile[32][33];\n"
      "  tile[threadIdx.y][threadIdx.x] = a[threadIdx.x];\n"
      "  __syncthreads();\n"
      "  c[threadIdx.x] = tile[threadIdx.x][threadIdx.y];\n"
      "}\n";
  auto t = scan(tiled);
  CHECK(t.kernels == 1);
  REQUIRE(t.has(Technique::shared_tiling));
  CHECK(sighting(t, Technique::shared_tiling)->line == 2);
  CHECK(sighting(t, Technique::shared_tiling)->excerpt == "__shared__ float tile[32][33];");
  CHECK(stitchcuda_test::contains(sighting(t, Technique::shared_tiling)->describe(), "cuda[0]:2:"));

  CHECK_FALSE(scan("__global__ void k(float* c) { __shared__ float s[32]; c[0] = 1; }").has(Technique::shared_tiling));
  // A cooperative-groups barrier counts.
  CHECK(scan("__global__ void k() { __shared__ float s[32]; cg::this_thread_block().sync(); }")
            .has(Technique::shared_tiling));
  // In a comment or a string it does not.
  CHECK_FALSE(scan("__global__ void k() { /* __shared__ float s[32]; */ __syncthreads(); }").has(Technique::shared_tiling));
  CHECK_FALSE(scan("__global__ void k() { printf(\"__shared__\"); __syncthreads(); }").has(Technique::shared_tiling));
}

TEST_CASE("vectorized access: vector types, __ldg, reinterpret_cast, PTX vector loads", "[rubric]") {
  CHECK(scan("__global__ void k(const float* a) { float4 v = reinterpret_cast<const float4*>(a)[0]; }")
            .has(Technique::vectorized));
  CHECK(scan("__global__ void k(const float* a, float* b) { b[0] = __ldg(a); }").has(Technique::vectorized));
  CHECK(scan("__global__ void k(const __half* a) { auto v = *reinterpret_cast<const __half2*>(a); }")
            .has(Technique::vectorized));
  CHECK(scan("__global__ void k() { asm(\"ld.global.v4.f32 {%0,%1,%2,%3}, [%4];\"); }").has(Technique::vectorized));
  CHECK_FALSE(scan("__global__ void k(const float* a, float* b) { b[0] = a[0]; } // float4 later").has(Technique::vectorized));
  CHECK_FALSE(scan("__global__ void k() { printf(\"use float4 and __ldg\"); }").has(Technique::vectorized));
  CHECK_FALSE(scan("__global__ void k(float4x) {}").has(Technique::vectorized));  // a longer name is not the type
}

TEST_CASE("tensor cores: wmma, mma_sync, PTX mma.sync and wgmma", "[rubric]") {
  CHECK(scan("__global__ void k() { nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> c; }")
            .has(Technique::tensor_cores));
  CHECK(scan("__global__ void k() { mma_sync(c, a, b, c); }").has(Technique::tensor_cores));
  CHECK(scan("__global__ void k() { asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 ...\"); }")
            .has(Technique::tensor_cores));
  CHECK(scan("__global__ void k() { __asm__ __volatile__(\"wgmma.mma_async.sync.aligned.m64n128k16\"); }")
            .has(Technique::tensor_cores));
  CHECK_FALSE(scan("__global__ void k() { printf(\"mma.sync\"); }").has(Technique::tensor_cores));
  CHECK_FALSE(scan("__global__ void k() { } // TODO: wmma / mma.sync").has(Technique::tensor_cores));
  CHECK_FALSE(scan("__global__ void k(int comma) { int command = comma; }").has(Technique::tensor_cores));
}

TEST_CASE("async copies: cp.async, memcpy_async, TMA", "[rubric]") {
  CHECK(scan("__global__ void k() { asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16;\"); }")
            .has(Technique::async_copies));
  CHECK(scan("__global__ void k() { cuda::memcpy_async(block, dst, src, n, pipe); }").has(Technique::async_copies));
  auto tma = scan("__global__ void k() {\n asm volatile(\"cp.async.bulk.tensor.2d.shared::cluster.global\");\n}");
  REQUIRE(tma.has(Technique::async_copies));
  CHECK(sighting(tma, Technique::async_copies)->line == 2);
  CHECK(scan("__global__ void k(const __grid_constant__ CUtensorMap map) {}").has(Technique::async_copies));
  CHECK_FALSE(scan("__global__ void k() { /* cp.async */ const char* s = \"memcpy_async\"; }").has(Technique::async_copies));
}

TEST_CASE("warp shuffles: __shfl_*_sync, __reduce_*_sync, PTX shfl.sync", "[rubric]") {
  CHECK(scan("__global__ void k(float v) { v += __shfl_down_sync(0xffffffff, v, 16); }").has(Technique::warp_shuffles));
  CHECK(scan("__global__ void k(float v) { v += __shfl_xor_sync(0xffffffffu, v, 1); }").has(Technique::warp_shuffles));
  CHECK(scan("__global__ void k(unsigned v) { v = __reduce_add_sync(~0u, v); }").has(Technique::warp_shuffles));
  CHECK(scan("__global__ void k() { asm(\"shfl.sync.bfly.b32 %0, %1, 1, 31, -1;\"); }").has(Technique::warp_shuffles));
  CHECK_FALSE(scan("__global__ void k(float v) { // __shfl_down_sync(0xffffffff, v, 16)\n }").has(Technique::warp_shuffles));
}

TEST_CASE("detectors count kernels across sources and report the first sighting of each technique", "[rubric]") {
  auto t = detect_techniques({"__global__ void a(float* x) { x[0] = 1; }",
                              "// header\n__global__ void b(const float4* x) {}\n__global__ void c(float4* y) {}"});
  CHECK(t.kernels == 3);
  REQUIRE(t.sightings.size() == 1);
  CHECK(t.sightings[0].source == 1);
  CHECK(t.sightings[0].line == 2);
  CHECK_FALSE(t.has(Technique::fused_launches));  // a fact, never seen in source
  CHECK(detect_techniques({}).kernels == 0);
  CHECK(detect_techniques({"// __global__ void k() {}"}).kernels == 0);
}

TEST_CASE("scanners keep length and newlines on arbitrary bytes and never run past the end", "[rubric]") {
  std::mt19937 rng(7);
  const std::string alphabet = "ab_R\"'\\/*#()\n 1asm{}.";
  for (int round = 0; round < 2000; ++round) {
    std::string text(rng() % 40, ' ');
    for (char& c : text) c = alphabet[rng() % alphabet.size()];
    const std::string cuda = strip_cuda(text), python = strip_python(text);
    REQUIRE(cuda.size() == text.size());
    REQUIRE(python.size() == text.size());
    REQUIRE(std::count(cuda.begin(), cuda.end(), '\n') == std::count(text.begin(), text.end(), '\n'));
    REQUIRE(std::count(python.begin(), python.end(), '\n') == std::count(text.begin(), text.end(), '\n'));
    (void)detect_techniques({text});
  }
}
