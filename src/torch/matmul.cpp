// Matmul steps through cuBLASLt: row-major operands mapped onto cuBLASLt's column-major view, fused
// bias/ReLU/GELU epilogues, strided batches with broadcast operands. The library is the
// libcublasLt.so.13 PyTorch already loaded (one CUDA major per process), found by the run-time loader.
//
// tf32x3 (fp32 accuracy on TF32 tensor cores): each fp32 operand x is split by one kernel into
// hi = x with its 13 low mantissa bits cleared (exactly a TF32 value) and lo = x - hi (exact in fp32), and
// c = a_lo b_hi + a_hi b_lo + a_hi b_hi as TF32 products accumulated in c (the lo*lo term, 2^-22 of the
// product, is dropped). The hi*hi product carries nearly all of the magnitude, and tensor cores add each
// k-step into their fp32 accumulator with truncation, an error that grows with the number of steps: it
// is summed in chunks of at most kSplitChunk along K, each chunk added to c by cuBLASLt's epilogue in
// round-to-nearest fp32. The bias and activation epilogue runs on the last chunk only. A large a is split
// a block of rows at a time (kSplitBlockBytes of split parts, never fewer rows than keep about two waves of
// output tiles busy), each block's products writing its own rows of c, so the scratch holds one block of
// a's parts rather than all of them, and c is read and written no more often than unblocked. A large b
// stored as [N, K] (a linear layer's weight: a block of c's columns is a block of b's rows, contiguous) is
// split a block at a time the same way, each block's products writing its columns of c; a is then split
// whole when its parts fit kSplitWideBytes, else a block of rows at a time inside each of b's blocks (a
// split again per block of b: b's blocks are made as large as a's then, so that happens rarely).
// When the parts split_blocks would hold stay large beside c (a down-projection: few columns, a long K,
// and the output floor per block keeps a whole), both operands are split a slab of K at a time instead
// (batch 1, a not transposed): the parts hold (M + N) x slab elements of each, the three products of a
// slab accumulate into c, and every slab after the first adds two reads and writes of c (its two lo
// products) — memory traded back for bandwidth (k_block).
#include "steps.hpp"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>

#include <stitchcuda/detail/dynamic_library.hpp>
#include <stitchcuda/detail/settings.hpp>
#include <stitchcuda/jit.hpp>

namespace stitchcuda::torch::detail {
namespace {

struct LtApi {
  decltype(&::cublasLtCreate) Create = nullptr;
  decltype(&::cublasLtDestroy) Destroy = nullptr;
  decltype(&::cublasLtMatmulDescCreate) DescCreate = nullptr;
  decltype(&::cublasLtMatmulDescDestroy) DescDestroy = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) DescSetAttribute = nullptr;
  decltype(&::cublasLtMatrixLayoutCreate) LayoutCreate = nullptr;
  decltype(&::cublasLtMatrixLayoutDestroy) LayoutDestroy = nullptr;
  decltype(&::cublasLtMatrixLayoutSetAttribute) LayoutSetAttribute = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) PreferenceCreate = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) PreferenceDestroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) PreferenceSetAttribute = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) AlgoGetHeuristic = nullptr;
  decltype(&::cublasLtMatmul) Matmul = nullptr;
  cublasLtHandle_t handle = nullptr;  // shared: cuBLASLt handles are thread-safe
};

Result<const LtApi*> lt() {
  static std::once_flag once;
  static Result<LtApi> loaded = fail(ErrorCode::Internal, "cuBLASLt not loaded");
  std::call_once(once, [] {
    stitchcuda::detail::LibrarySearch search{
        "libcublasLt.so.13", stitchcuda::detail::Setting::cublaslt, {"libcublasLt.so.13"},
        "cuBLASLt (libcublasLt.so.13) was not found: install PyTorch built for CUDA 13 (it ships cuBLASLt), "
        "the CUDA 13 toolkit's libraries on the library path, or set STITCHCUDA_CUBLASLT to the library's path"};
    for (const std::string& path : stitchcuda::detail::in_toolkit("libcublasLt.so.13"))
      search.candidates.push_back(path);
    for (const std::string& folder : stitchcuda::detail::torch_folders())
      search.candidates.push_back(folder + "/libcublasLt.so.13");
    auto lib = stitchcuda::detail::load_library(search);
    if (!lib) {
      loaded = tl::unexpected(lib.error());
      return;
    }
    LtApi api;
    std::string missing;
    auto bind = [&](auto& fn, const char* name) {
      if (!lib->bind(fn, name)) missing += std::string(" ") + name;
    };
    bind(api.Create, "cublasLtCreate");
    bind(api.Destroy, "cublasLtDestroy");
    bind(api.DescCreate, "cublasLtMatmulDescCreate");
    bind(api.DescDestroy, "cublasLtMatmulDescDestroy");
    bind(api.DescSetAttribute, "cublasLtMatmulDescSetAttribute");
    bind(api.LayoutCreate, "cublasLtMatrixLayoutCreate");
    bind(api.LayoutDestroy, "cublasLtMatrixLayoutDestroy");
    bind(api.LayoutSetAttribute, "cublasLtMatrixLayoutSetAttribute");
    bind(api.PreferenceCreate, "cublasLtMatmulPreferenceCreate");
    bind(api.PreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
    bind(api.PreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
    bind(api.AlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
    bind(api.Matmul, "cublasLtMatmul");
    if (!missing.empty()) {
      loaded = fail(ErrorCode::Unavailable, "the cuBLASLt at '" + lib->path + "' lacks:" + missing +
                                                "; use the cuBLASLt of CUDA 13");
      return;
    }
    if (cublasStatus_t s = api.Create(&api.handle); s != CUBLAS_STATUS_SUCCESS) {
      loaded = fail(ErrorCode::CudaError, "cublasLtCreate failed with status " + std::to_string(int(s)));
      return;
    }
    loaded = api;
  });
  if (!loaded) return tl::unexpected(loaded.error());
  return &*loaded;
}

cudaDataType_t data_type(DType d) {
  switch (d) {
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f64: return CUDA_R_64F;
    default: return CUDA_R_32F;
  }
}

cublasLtEpilogue_t epilogue_of(Epilogue e) {
  switch (e) {
    case Epilogue::relu: return CUBLASLT_EPILOGUE_RELU;
    case Epilogue::gelu: return CUBLASLT_EPILOGUE_GELU;
    case Epilogue::bias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::bias_relu: return CUBLASLT_EPILOGUE_RELU_BIAS;
    case Epilogue::bias_gelu: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case Epilogue::none: break;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

std::int64_t rows(const TensorSpec& s) { return s.shape[s.shape.size() - 2]; }
std::int64_t cols(const TensorSpec& s) { return s.shape.back(); }
std::int64_t matrices(const TensorSpec& s) { return s.numel() / std::max<std::int64_t>(1, rows(s) * cols(s)); }

std::string status_text(cublasStatus_t s) { return "cuBLASLt status " + std::to_string(int(s)); }

// Elements of K per hi*hi product in tf32x3; STITCHCUDA_TF32X3_CHUNK overrides it (0: the whole K), for
// measuring the trade between accuracy and the result's extra read-modify-writes (bench program).
constexpr std::int64_t kSplitChunk = 512;

using stitchcuda::detail::count_setting;
using stitchcuda::detail::Setting;

std::int64_t split_chunk(std::int64_t k) {
  const auto v = count_setting(Setting::tf32x3_chunk);
  if (!v) return kSplitChunk;
  return *v == 0 ? std::max<std::int64_t>(k, 1) : *v;
}

// How tf32x3 blocks its operands: rows of a split at a time (a_rows; m: all at once) and rows of a
// transposed b, i.e. columns of c (b_rows; n: all). a alone is blocked as long as b's parts fit
// kSplitWholeBBytes: rows whose two parts fit kSplitBlockBytes, but at least kSplitBlockOutputs outputs per
// block (smaller products leave SMs idle), a multiple of 128. A larger b that can be blocked is: a stays
// whole up to kSplitWideBytes of parts (else blocks of that size), and b's blocks take kSplitBlockBytes
// (kSplitWideBytes when a is blocked too: a is split again for every block of b). STITCHCUDA_TF32X3_ROWS
// and STITCHCUDA_TF32X3_COLS override the two (0: whole), for tests and measurements.
constexpr std::int64_t kSplitBlockBytes = 64ll << 20;
constexpr std::int64_t kSplitWholeBBytes = 128ll << 20;
constexpr std::int64_t kSplitWideBytes = 256ll << 20;
constexpr std::int64_t kSplitBlockOutputs = 8ll << 20;

struct SplitBlocks {
  std::int64_t a_rows, b_rows;
};

SplitBlocks split_blocks(std::int64_t m, std::int64_t n, std::int64_t k, bool block_a, bool block_b) {
  const std::int64_t k1 = std::max<std::int64_t>(k, 1), m1 = std::max<std::int64_t>(m, 1), n1 = std::max<std::int64_t>(n, 1);
  // Rows of an operand whose two parts fit `bytes`, but at least `at_least`, a multiple of 128, at most `all`.
  auto rows = [&](std::int64_t bytes, std::int64_t at_least, std::int64_t all) {
    const std::int64_t r = (std::max(bytes / (8 * k1), at_least) + 127) / 128 * 128;
    return std::clamp<std::int64_t>(r, 1, all);
  };
  auto outputs_per = [](std::int64_t other) { return (kSplitBlockOutputs + other - 1) / other; };
  SplitBlocks s{m1, n1};
  if (!block_b || 8 * n1 * k1 <= kSplitWholeBBytes) {
    s.b_rows = n1;
    if (block_a) s.a_rows = rows(kSplitBlockBytes, outputs_per(n1), m1);
  } else {
    if (block_a && 8 * m1 * k1 > kSplitWideBytes) s.a_rows = rows(kSplitWideBytes, outputs_per(n1), m1);
    s.b_rows = rows(s.a_rows < m1 ? kSplitWideBytes : kSplitBlockBytes, outputs_per(s.a_rows), n1);
  }
  if (const auto v = count_setting(Setting::tf32x3_rows); v && block_a)
    s.a_rows = *v == 0 ? m1 : std::clamp<std::int64_t>(*v, 1, m1);
  if (const auto v = count_setting(Setting::tf32x3_cols); v && block_b)
    s.b_rows = *v == 0 ? n1 : std::clamp<std::int64_t>(*v, 1, n1);
  return s;
}

// Slabs of K: used when the parts split_blocks holds exceed both kSlabAfterBytes and four times c; then
// two slabs (half of K, rounded up to the chunk), when they hold fewer parts than the blocks: a
// transformer's 4096 -> 1024 projection over 8192 tokens holds 144 MiB instead of 288 MiB of blocks, for
// one more pair of passes over c (more slabs cost more than they save: GPT's 3072 -> 768 projection over
// 16384 tokens ran 8% slower end to end in three slabs than in blocks). A square 4096 product (192 MiB of
// parts, three times c) keeps its blocks. STITCHCUDA_TF32X3_KBLOCK overrides the choice (0: never; else
// that many elements, rounded down to the chunk, at least one), for tests and measurements. Returns 0 for
// no slabs (also when a slab would span K).
constexpr std::int64_t kSlabAfterBytes = 160ll << 20;

std::int64_t k_block(std::int64_t m, std::int64_t n, std::int64_t k, const SplitBlocks& blocks) {
  const std::int64_t chunk = split_chunk(k);
  std::int64_t kb = 0;
  if (const auto v = count_setting(Setting::tf32x3_kblock)) {
    if (*v == 0) return 0;
    kb = std::max(chunk, *v / chunk * chunk);
  } else {
    const std::int64_t parts = 8 * k * (blocks.a_rows + blocks.b_rows), c_bytes = 4 * m * n;
    if (parts <= std::max(4 * c_bytes, kSlabAfterBytes)) return 0;
    kb = ((k + 1) / 2 + chunk - 1) / chunk * chunk;
    if (8 * (m + n) * kb >= parts) return 0;
  }
  return kb < k ? kb : 0;
}

// Which of tf32x3's products run as one (STITCHCUDA_TF32X3_FUSE_LO: 0, 1, or 2, the default).
// 1: the two lo products — a's parts laid out side by side along K as [a_lo | a_hi] and b's as
// [b_hi | b_lo], one product over 2K gives a_lo b_hi + a_hi b_lo (its accumulator holds only the small
// terms, so its truncation is 2^-11 of the hi*hi product's), one read-modify-write of c and one launch
// fewer. 2: with them the first hi*hi chunk — [a_lo | a_hi | a_hi's first chunk] and
// [b_hi | b_lo | b_hi's first chunk] over 2K + chunk, the small terms first along K and that chunk's after
// them, as the chunk alone would add them — one more pass over c fewer; where K fits one chunk, all three
// products are one, writing c once with the epilogue. The first chunk of a_hi and b_hi is stored twice:
// 8 + 4 chunk / K bytes of parts per operand element. Batch 1, a not transposed, K a multiple of 4 (each
// part's rows start 16-byte aligned), and not in slabs of K. Returns 0 (apart), 1 or 2.
int fuse_products(std::int64_t batch, bool transpose_a, std::int64_t k) {
  const std::int64_t level = count_setting(Setting::tf32x3_fuse_lo).value_or(2);
  if (level == 0 || batch != 1 || transpose_a || k % 4 != 0) return 0;
  return level >= 2 ? 2 : 1;
}

// bf16 products on fp32 operands (STITCHCUDA_BF16_CAST): cuBLASLt's CUBLAS_COMPUTE_32F_FAST_16BF on fp32
// operands picks TF32 kernels (its results carry TF32's rounding and run at TF32's rate), so a matmul of
// precision bf16 may instead convert each operand to bf16 into scratch (one pass: 4 bytes read, 2 written
// per element) and run a BF16 x BF16 -> FP32 product, fp32 accumulation, at the tensor cores' bf16 rate.
// 1 or unset: where K >= kCastMinK, a product long enough that the conversion's traffic is small beside
// the compute it halves (on an H200, whole programs against the same with FAST_16BF: 1.6-1.8x on four
// GEMM-with-epilogue problems, 1.03-1.19x on three transformer blocks); 2: every bf16 matmul; 0: none
// (FAST_16BF). Graph mode's planner mirrors this rule (stitchcuda.graph.planner.bf16_products) and marks
// the shorter products tf32.
constexpr std::int64_t kCastMinK = 256;

bool cast_to_bf16(std::int64_t k) {
  const std::int64_t level = count_setting(Setting::bf16_cast).value_or(1);
  return level >= 2 || (level == 1 && k >= kCastMinK);
}

// cuBLASLt's heuristic ranks algorithms by a model of the GPU, and its first is not always the fastest
// for a shape (an epilogue, a split along K). A single-call matmul (not tf32x3, not accumulating into c)
// times the heuristic's first kTuneCandidates on its own operands at its first run outside stream
// capture and keeps the fastest, once per shape per process (on an H100 at TF32: 2-3% on a SwiGLU
// projection pair, a GPT decoder, a GEMM with bias and clamp; no loss elsewhere). STITCHCUDA_MATMUL_TUNE=0
// takes the heuristic's first instead.
constexpr int kTuneCandidates = 8;
bool matmul_tuning() { return count_setting(Setting::matmul_tune).value_or(1) >= 1; }

// A candidate must beat the heuristic's first by this fraction to replace it: closer than that is noise.
constexpr double kTuneMargin = 0.02;

// Each split part starts on a 256-byte boundary (cuBLASLt's tensor-core kernels want 16-byte alignment).
constexpr std::int64_t kSplitAlign = 64;  // floats
std::int64_t aligned(std::int64_t n) { return (n + kSplitAlign - 1) / kSplitAlign * kSplitAlign; }

constexpr const char* kSplitName = "stitchcuda_tf32x3_split";
constexpr const char* kSlabName = "stitchcuda_tf32x3_split_slab";
constexpr const char* kCastName = "stitchcuda_bf16_cast";
// bf16 elements, rounded up so that the second operand's copy starts on a 256-byte boundary too.
std::int64_t aligned16(std::int64_t n) { return (n + 127) / 128 * 128; }
constexpr const char* kSplitSource = R"CUDA(
__device__ __forceinline__ void split_one(float v, float& h, float& l) {
  // h: a TF32 value (the tensor cores read it exactly); l = v - h is exact. An infinity or a NaN (whatever
  // its payload) stays whole in h, with l = 0.
  h = isnan(v) ? v : __uint_as_float(__float_as_uint(v) & 0xffffe000u);
  l = isfinite(v) ? v - h : 0.0f;
}
__device__ __forceinline__ void split_four(float4 v, float4& h, float4& l) {
  split_one(v.x, h.x, l.x);
  split_one(v.y, h.y, l.y);
  split_one(v.z, h.z, l.z);
  split_one(v.w, h.w, l.w);
}
__device__ __forceinline__ void split_four(float4 v, float4* hi, float4* lo) {
  float4 h, l;
  split_four(v, h, l);
  *hi = h;
  *lo = l;
}
extern "C" __global__ void stitchcuda_tf32x3_split(const float* __restrict__ x, float* __restrict__ hi,
                                                   float* __restrict__ lo, long long n) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long done = 0;
  if (((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(hi) |
        reinterpret_cast<unsigned long long>(lo)) & 15ull) == 0) {
    const long long n4 = n / 4;
    for (long long i = first; i < n4; i += stride)
      split_four(reinterpret_cast<const float4*>(x)[i], reinterpret_cast<float4*>(hi) + i, reinterpret_cast<float4*>(lo) + i);
    done = n4 * 4;
  }
  for (long long i = done + first; i < n; i += stride) split_one(x[i], hi[i], lo[i]);
}
// x rounded to bf16, to nearest even (a NaN stays a NaN; an infinity, or a value that rounds past the
// largest bf16, is an infinity), written as raw 16-bit values.
__device__ __forceinline__ unsigned short to_bf16(float v) {
  const unsigned int u = __float_as_uint(v);
  if (isnan(v)) return (unsigned short)((u >> 16) | 0x40u);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
extern "C" __global__ void stitchcuda_bf16_cast(const float* __restrict__ x, unsigned short* __restrict__ y,
                                                long long n) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long done = 0;
  if (((reinterpret_cast<unsigned long long>(x) & 15ull) | (reinterpret_cast<unsigned long long>(y) & 7ull)) == 0) {
    const long long n4 = n / 4;
    for (long long i = first; i < n4; i += stride) {
      const float4 v = reinterpret_cast<const float4*>(x)[i];
      const unsigned long long packed = (unsigned long long)to_bf16(v.x) | ((unsigned long long)to_bf16(v.y) << 16) |
                                        ((unsigned long long)to_bf16(v.z) << 32) | ((unsigned long long)to_bf16(v.w) << 48);
      reinterpret_cast<unsigned long long*>(y)[i] = packed;
    }
    done = n4 * 4;
  }
  for (long long i = done + first; i < n; i += stride) y[i] = to_bf16(x[i]);
}
// `rows` x `cols` of x (row stride `ld`) split into rows x cols parts of row stride `out_ld`: a slab of K
// (out_ld = cols: dense), or rows whose parts sit side by side along K (out_ld = 2 cols: fused lo products;
// 2 cols + chunk with the first hi*hi chunk). hi_again > 0: the first `again_cols` of each row of hi are
// written a second time, hi_again floats after hi.
extern "C" __global__ void stitchcuda_tf32x3_split_slab(const float* __restrict__ x, long long ld, long long rows,
                                                        long long cols, float* __restrict__ hi, float* __restrict__ lo,
                                                        long long out_ld, long long hi_again, long long again_cols) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if ((cols & 3) == 0 && (ld & 3) == 0 && (out_ld & 3) == 0 && (hi_again & 3) == 0 && (again_cols & 3) == 0 &&
      ((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(hi) |
        reinterpret_cast<unsigned long long>(lo)) & 15ull) == 0) {
    const long long cols4 = cols / 4, n4 = rows * cols4;
    for (long long i = first; i < n4; i += stride) {
      const long long r = i / cols4, c = i - r * cols4;
      float4 h, l;
      split_four(reinterpret_cast<const float4*>(x + r * ld)[c], h, l);
      reinterpret_cast<float4*>(hi + r * out_ld)[c] = h;
      reinterpret_cast<float4*>(lo + r * out_ld)[c] = l;
      if (hi_again > 0 && 4 * c < again_cols) reinterpret_cast<float4*>(hi + hi_again + r * out_ld)[c] = h;
    }
    return;
  }
  for (long long i = first; i < rows * cols; i += stride) {
    const long long r = i / cols, c = i - r * cols;
    float h, l;
    split_one(x[r * ld + c], h, l);
    hi[r * out_ld + c] = h;
    lo[r * out_ld + c] = l;
    if (hi_again > 0 && c < again_cols) hi[hi_again + r * out_ld + c] = h;
  }
}
)CUDA";

// The split kernels (whole operand or block, and slab of K), compiled once per architecture through the
// kernel cache.
Result<jit::Kernel> split_kernel(const char* name = kSplitName) {
  auto module = jit::build(kSplitSource, jit::CompileOptions{}, "tf32x3_split.cu");
  if (!module) return tl::unexpected(module.error());
  return (*module)->kernel(name);
}

}  // namespace

struct PreparedMatmul::Descriptors {
  const LtApi* api = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool swap = true;        // the column-major call's first operand is the program's b
  bool uses_bias = false;
  bool reads_c = false;
  float alpha = 1.0f, beta = 0.0f;
  double alpha64 = 1.0, beta64 = 0.0;
  bool f64 = false;
  std::size_t workspace_needed = 0;

  // Tuning (matmul_tuning): cuBLASLt's first few heuristic candidates for `op`, timed on the step's own
  // operands at its first run outside stream capture; the fastest replaces `algo`. `tune_key` names the
  // problem (shape, types, epilogue, device) so that equal matmuls share one measurement.
  std::vector<cublasLtMatmulAlgo_t> candidates;
  std::string tune_key;
  std::mutex tune_mutex;
  std::atomic<bool> tuned{false};

  // tf32x3: the calls in order, each a cuBLASLt matmul over parts of the split operands.
  enum Part : std::uint8_t { b_hi, b_lo, a_hi, a_lo };
  struct Call {
    cublasLtMatmulDesc_t op = nullptr;  // `plain` or `op` (the last call: the epilogue)
    cublasLtMatrixLayout_t first = nullptr, second = nullptr;  // owned
    Part first_part = b_hi, second_part = a_hi;
    std::int64_t first_offset = 0, second_offset = 0;  // elements into the part (a chunk along K)
    cublasLtMatmulAlgo_t algo{};
  };
  bool split = false;
  cublasLtMatmulDesc_t plain = nullptr;  // op without the epilogue and bias
  // The calls for one tile of c: a block of `block_rows` rows of a (or the last, shorter one) by a block
  // of `block_cols` rows of b (or the last one), each tile with the layout of its part of c.
  struct Tile {
    std::vector<Call> calls;
    cublasLtMatrixLayout_t out = nullptr;  // owned; null: the whole of c (d.out)
  };
  Tile tiles[2][2];  // [a's last block][b's last block]
  // Slabs of K (k_block > 0): the calls of a slab that is not the last, and of the last one (the epilogue's).
  std::int64_t k_block = 0;
  bool b_transposed = false;
  Tile slabs[2];
  std::int64_t rows_total = 0, block_rows = 0, cols_total = 0, block_cols = 0, k_total = 0;
  std::int64_t a_elems = 0, b_elems = 0;  // elements of one block of a's split parts, of b's
  std::optional<jit::Kernel> splitter, slab_splitter;
  // bf16 products (cast_to_bf16): a's and b's bf16 copies in the scratch, b's first; the layouts in
  // `first` and `second` are bf16.
  bool cast16 = false;
  std::int64_t a_count = 0, b_count = 0;
  std::optional<jit::Kernel> caster;
  // The lo products fused (fuse_products): a's parts are rows [a_lo | a_hi] of 2K; b's are rows [b_hi | b_lo]
  // of 2K when b is transposed (a weight [N, K]), else b_hi's K rows stacked on b_lo's (b_stacked). With the
  // first hi*hi chunk (hi_extra of K, the whole K when it fits one chunk): rows of 2K + hi_extra ending in
  // that much of a_hi or b_hi again, or b_hi's first hi_extra rows stacked after b_lo's.
  bool fused = false, b_stacked = false;
  std::int64_t hi_extra = 0;
  std::int64_t width() const { return 2 * k_total + hi_extra; }  // of each row of fused parts
  // Where the split kernel writes hi a second time, in floats after hi, and how much of each row (of K,
  // or of a stacked b split as one row).
  std::int64_t hi_again(Part hi) const {
    if (!hi_extra) return 0;
    return hi == a_hi ? k_total : b_stacked ? 2 * b_elems : 2 * k_total;
  }
  std::int64_t again_cols(Part hi) const {
    return hi == b_hi && b_stacked ? hi_extra * (b_elems / k_total) : hi_extra;
  }

  // Where each part starts in the scratch (floats).
  std::int64_t part_offset(Part p) const {
    if (fused) {
      const std::int64_t a0 = aligned(b_elems / k_total * width());
      switch (p) {
        case b_hi: return 0;
        case b_lo: return b_stacked ? b_elems : k_total;
        case a_lo: return a0;
        case a_hi: return a0 + k_total;
      }
    }
    switch (p) {
      case b_hi: return 0;
      case b_lo: return aligned(b_elems);
      case a_hi: return 2 * aligned(b_elems);
      case a_lo: return 2 * aligned(b_elems) + aligned(a_elems);
    }
    return 0;
  }
};

namespace {

// Tuned algorithms by problem (Descriptors::tune_key plus the device), shared by every program in the process.
std::mutex tuned_mutex;
std::map<std::string, cublasLtMatmulAlgo_t>& tuned_algorithms() {
  static std::map<std::string, cublasLtMatmulAlgo_t> algorithms;
  return algorithms;
}

// GPU milliseconds per call of `call` with `algo` on `stream`: one warm call, then enough calls to fill
// about a millisecond (2 to 20); infinity when a call fails.
double time_algorithm(const std::function<cublasStatus_t(const cublasLtMatmulAlgo_t*)>& call,
                      const cublasLtMatmulAlgo_t& algo, cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  auto timed = [&](int calls) -> double {
    if (cudaEventRecord(start, stream) != cudaSuccess) return inf;
    for (int i = 0; i < calls; ++i)
      if (call(&algo) != CUBLAS_STATUS_SUCCESS) return inf;
    float ms = 0;
    if (cudaEventRecord(stop, stream) != cudaSuccess || cudaEventSynchronize(stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, start, stop) != cudaSuccess)
      return inf;
    return double(ms) / calls;
  };
  const double warm = timed(1);
  if (!(warm < inf)) return inf;
  return timed(std::clamp(int(1.0 / std::max(warm, 1e-3)), 2, 20));
}

// Times d.candidates through `call` (one cuBLASLt call of the step with the given algorithm) and keeps
// the fastest in d.algo; see matmul_tuning.
void tune(PreparedMatmul::Descriptors& d, const std::function<cublasStatus_t(const cublasLtMatmulAlgo_t*)>& call,
          void* stream, int device) {
  if (d.candidates.empty() || d.tuned.load(std::memory_order_acquire)) return;
  std::lock_guard lock(d.tune_mutex);
  if (d.tuned.load(std::memory_order_relaxed)) return;
  const auto s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return;  // inside a graph capture: the heuristic's first now, tuned at a later direct run
  }
  const std::string key = d.tune_key + " dev" + std::to_string(device);
  {
    std::lock_guard cache(tuned_mutex);
    if (auto it = tuned_algorithms().find(key); it != tuned_algorithms().end()) {
      d.algo = it->second;
      d.tuned.store(true, std::memory_order_release);
      return;
    }
  }
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    if (start) cudaEventDestroy(start);
    cudaGetLastError();
    d.tuned.store(true, std::memory_order_release);  // keep the heuristic's first
    return;
  }
  std::size_t best = 0;
  const double first = time_algorithm(call, d.candidates[0], s, start, stop);
  double best_ms = first;
  for (std::size_t i = 1; i < d.candidates.size(); ++i) {
    const double ms = time_algorithm(call, d.candidates[i], s, start, stop);
    if (ms < best_ms && ms < first * (1.0 - kTuneMargin)) best = i, best_ms = ms;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGetLastError();  // a candidate that failed to launch left no error behind for the next step
  d.algo = d.candidates[best];
  {
    std::lock_guard cache(tuned_mutex);
    tuned_algorithms().emplace(key, d.algo);
  }
  d.tuned.store(true, std::memory_order_release);
}

}  // namespace

PreparedMatmul::~PreparedMatmul() {
  if (!d_ || !d_->api) return;
  auto destroy = [&](Descriptors::Tile& tile) {
    for (auto& call : tile.calls) {
      if (call.first) d_->api->LayoutDestroy(call.first);
      if (call.second) d_->api->LayoutDestroy(call.second);
    }
    if (tile.out) d_->api->LayoutDestroy(tile.out);
  };
  for (auto& row : d_->tiles)
    for (auto& tile : row) destroy(tile);
  for (auto& tile : d_->slabs) destroy(tile);
  if (d_->first) d_->api->LayoutDestroy(d_->first);
  if (d_->second) d_->api->LayoutDestroy(d_->second);
  if (d_->out) d_->api->LayoutDestroy(d_->out);
  if (d_->plain) d_->api->DescDestroy(d_->plain);
  if (d_->op) d_->api->DescDestroy(d_->op);
}

std::size_t PreparedMatmul::scratch_bytes() const {
  if (d_ && d_->cast16) return std::size_t(aligned16(d_->b_count) + aligned16(d_->a_count)) * 2;
  if (!d_ || !d_->split) return 0;
  if (d_->fused)  // rows of 2K + hi_extra: b's, then a's from an aligned start
    return std::size_t(aligned(d_->b_elems / d_->k_total * d_->width()) + d_->a_elems / d_->k_total * d_->width()) *
           sizeof(float);
  return std::size_t(2 * aligned(d_->a_elems) + 2 * aligned(d_->b_elems)) * sizeof(float);
}

std::size_t PreparedMatmul::workspace_needed() const { return d_ ? d_->workspace_needed : 0; }

Result<std::unique_ptr<PreparedMatmul>> PreparedMatmul::create(const Matmul& m, const Program& program,
                                                               std::size_t workspace_bytes) {
  auto api = lt();
  if (!api) return tl::unexpected(api.error());
  const TensorSpec& A = program.buffer(m.a)->spec;
  const TensorSpec& B = program.buffer(m.b)->spec;
  const TensorSpec& C = program.buffer(m.c)->spec;
  for (auto* s : {&A, &B, &C})
    if (!s->is_contiguous())
      return fail(ErrorCode::InvalidArgument, "matmul operands must be contiguous (got " + s->describe() +
                                                  "): insert a copy step or a contiguous view first");

  std::unique_ptr<PreparedMatmul> p(new PreparedMatmul());
  p->d_ = std::make_unique<Descriptors>();
  Descriptors& d = *p->d_;
  d.api = *api;
  d.uses_bias = m.bias.has_value();
  d.reads_c = m.beta != 0.0;
  d.f64 = C.dtype == DType::f64;
  d.alpha = float(m.alpha), d.beta = float(m.beta), d.alpha64 = m.alpha, d.beta64 = m.beta;

  // Row-major X[r, c] is column-major X^T[c, r] with leading dimension c. The program wants
  // C[M, N] = op(a) @ op(b); cuBLASLt computes C^T[N, M] = op(b)^T @ op(a)^T in column-major, so its
  // first operand is b's memory and its second is a's, each transposed exactly when the program's is.
  const std::int64_t M = rows(C), N = cols(C);
  const std::int64_t K = m.transpose_a ? rows(A) : cols(A);
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  d.split = m.precision == ComputePrecision::tf32x3 && K > 0;  // an empty product is the epilogue alone
  if (d.split && (A.dtype != DType::f32 || B.dtype != DType::f32 || C.dtype != DType::f32))
    return fail(ErrorCode::InvalidArgument, "tf32x3 matmuls take f32 operands (got " + A.describe() + " @ " +
                                                B.describe() + " -> " + C.describe() + ")");
  if (d.f64) compute = CUBLAS_COMPUTE_64F;
  else if (C.dtype == DType::f32 && (m.precision == ComputePrecision::tf32 || d.split))
    compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  else if (C.dtype == DType::f32 && m.precision == ComputePrecision::bf16) compute = CUBLAS_COMPUTE_32F_FAST_16BF;
  d.cast16 = m.precision == ComputePrecision::bf16 && A.dtype == DType::f32 && B.dtype == DType::f32 &&
             C.dtype == DType::f32 && K > 0 && cast_to_bf16(K);
  if (d.cast16) compute = CUBLAS_COMPUTE_32F, d.a_count = A.numel(), d.b_count = B.numel();
  cudaDataType_t scale = d.f64 ? CUDA_R_64F : CUDA_R_32F;
  auto check = [](cublasStatus_t s, const char* what) -> Result<void> {
    if (s != CUBLAS_STATUS_SUCCESS) return fail(ErrorCode::CudaError, std::string(what) + " failed: " + status_text(s));
    return {};
  };
  cublasOperation_t op_first = m.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_second = m.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  auto describe_op = [&](cublasLtMatmulDesc_t& desc, bool with_epilogue) -> Result<void> {
    if (auto r = check(d.api->DescCreate(&desc, compute, scale), "cublasLtMatmulDescCreate"); !r) return r;
    d.api->DescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first));
    d.api->DescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second));
    if (!with_epilogue) return {};
    cublasLtEpilogue_t epi = epilogue_of(m.epilogue);
    if (auto r = check(d.api->DescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)), "setting the epilogue"); !r)
      return r;
    if (d.uses_bias) {
      cudaDataType_t bias_type = data_type(program.buffer(*m.bias)->spec.dtype);
      d.api->DescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type));
    }
    return {};
  };
  if (auto r = describe_op(d.op, true); !r) return tl::unexpected(r.error());
  if (d.split)
    if (auto r = describe_op(d.plain, false); !r) return tl::unexpected(r.error());

  // Stored (column-major) shapes: b's memory is [cols(B) x rows(B)], a's is [cols(A) x rows(A)]. A
  // layout of `r_used x c_used` inside that storage (ld = cols(s)) is a chunk along K for tf32x3.
  auto layout = [&](cublasLtMatrixLayout_t& out, const TensorSpec& s, std::int64_t batch, std::int64_t r_used = -1,
                    std::int64_t c_used = -1) -> Result<void> {
    const std::uint64_t r = std::uint64_t(cols(s)), c = std::uint64_t(rows(s));
    const std::uint64_t ru = r_used < 0 ? r : std::uint64_t(r_used), cu = c_used < 0 ? c : std::uint64_t(c_used);
    const cudaDataType_t type = d.cast16 && &s != &C ? CUDA_R_16BF : data_type(s.dtype);  // a bf16 copy of a or b
    if (auto st = check(d.api->LayoutCreate(&out, type, ru, cu, std::int64_t(r)), "cublasLtMatrixLayoutCreate"); !st)
      return st;
    if (batch > 1) {
      int count = int(batch);
      std::int64_t stride = matrices(s) == 1 ? 0 : std::int64_t(r * c);
      d.api->LayoutSetAttribute(out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count));
      d.api->LayoutSetAttribute(out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride));
    }
    return {};
  };
  if (auto r = layout(d.first, B, m.batch); !r) return tl::unexpected(r.error());
  if (auto r = layout(d.second, A, m.batch); !r) return tl::unexpected(r.error());
  if (auto r = layout(d.out, C, m.batch); !r) return tl::unexpected(r.error());

  auto no_algorithm = [&](cublasStatus_t s, const std::string& what) {
    return fail(ErrorCode::Unavailable,
                "cuBLASLt has no algorithm for this matmul" + what + " (M=" + std::to_string(M) + ", N=" +
                    std::to_string(N) + ", K=" + std::to_string(K) + ", " + to_string(C.dtype) + ", epilogue " +
                    to_string(m.epilogue) + ", " + status_text(s) + "): use an ATen step (aten::mm/addmm) or another epilogue");
  };
  auto pick = [&](cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t first, cublasLtMatrixLayout_t second,
                  cublasLtMatmulAlgo_t& algo, const std::string& what, cublasLtMatrixLayout_t out = nullptr) -> Result<void> {
    if (!out) out = d.out;
    cublasLtMatmulPreference_t pref = nullptr;
    if (auto r = check(d.api->PreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate"); !r) return r;
    std::uint64_t ws = workspace_bytes;
    d.api->PreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    // The plain path (one call per run) asks for candidates to time when tuning is on.
    const bool tune = &algo == &d.algo && d.tune_key.size() > 0;
    cublasLtMatmulHeuristicResult_t results[kTuneCandidates]{};
    int found = 0;
    cublasStatus_t s = d.api->AlgoGetHeuristic(d.api->handle, desc, first, second, out, out, pref,
                                               tune ? kTuneCandidates : 1, results, &found);
    d.api->PreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS || found == 0) return no_algorithm(s, what);
    algo = results[0].algo;
    for (int i = 0; i < found; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      d.workspace_needed = std::max(d.workspace_needed, results[i].workspaceSize);
      if (tune) d.candidates.push_back(results[i].algo);
      if (!tune) break;
    }
    if (d.candidates.size() < 2) d.candidates.clear(), d.tune_key.clear();
    return {};
  };
  if (!d.split && !d.reads_c && matmul_tuning()) {
    d.tune_key = std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K) + " b" +
                 std::to_string(m.batch) + (m.transpose_a ? " ta" : "") + (m.transpose_b ? " tb" : "") + " " +
                 to_string(A.dtype) + to_string(B.dtype) + to_string(C.dtype) + " c" + std::to_string(int(compute)) +
                 (d.cast16 ? " bf16copies" : "") + " e" + std::to_string(int(m.epilogue)) +
                 (d.uses_bias ? " bias" : "") + " ws" + std::to_string(workspace_bytes);
  }
  if (!d.split) {
    if (auto r = pick(d.op, d.first, d.second, d.algo, d.cast16 ? " on bf16 copies of its operands" : ""); !r)
      return tl::unexpected(r.error());
    if (d.cast16) {
      auto caster = split_kernel(kCastName);
      if (!caster) return tl::unexpected(caster.error());
      d.caster = std::move(*caster);
    }
    return p;
  }

  // tf32x3: a_lo b_hi and a_hi b_lo over the whole K (plain descriptor), then a_hi b_hi in chunks along K,
  // the last one with the epilogue; per tile of c when an operand is blocked (batch 1, a not transposed: a
  // block of a's rows is contiguous; b transposed: a block of b's rows is), the calls' layouts made once
  // per tile shape (full or last block of each operand).
  using Part = Descriptors::Part;
  const SplitBlocks blocks = split_blocks(M, N, K, m.batch == 1 && !m.transpose_a, m.batch == 1 && m.transpose_b);
  d.rows_total = M, d.cols_total = N, d.k_total = K;
  d.block_rows = std::min(blocks.a_rows, M), d.block_cols = std::min(blocks.b_rows, N);
  d.a_elems = d.block_rows < M ? d.block_rows * K : A.numel();
  d.b_elems = d.block_cols < N ? d.block_cols * K : B.numel();
  auto splitter = split_kernel();
  if (!splitter) return tl::unexpected(splitter.error());
  d.splitter = std::move(*splitter);
  // Where K lies in each operand's column-major storage: b's rows (r) when transposed, its columns (c)
  // otherwise; a's the other way round.
  const bool b_k_in_rows = m.transpose_b, a_k_in_rows = !m.transpose_a;
  // A chunk of `kc` along K of an operand (of `used` of its M or N rows when blocked: -1, all). A block's
  // parts are stored like the operand's first rows: the same leading dimension.
  auto chunk_layout = [&](cublasLtMatrixLayout_t& out, const TensorSpec& s, bool k_in_rows, std::int64_t kc,
                          std::int64_t used = -1) {
    return k_in_rows ? layout(out, s, m.batch, kc, used) : layout(out, s, m.batch, used, kc);
  };
  auto chunk_offset = [](const TensorSpec& s, bool k_in_rows, std::int64_t k0) {
    return k_in_rows ? k0 : k0 * cols(s);
  };
  // `kc` along K of split parts laid out on their own: K in the stored rows (column-major [kc x other], ld
  // w: each of the `other` rows holds w floats) or in the columns ([other x kc], ld other).
  auto part_layout = [&](cublasLtMatrixLayout_t& out, bool k_in_rows, std::int64_t other, std::int64_t w,
                         std::int64_t kc) {
    return check(d.api->LayoutCreate(&out, CUDA_R_32F, std::uint64_t(k_in_rows ? kc : other),
                                     std::uint64_t(k_in_rows ? other : kc), k_in_rows ? w : other),
                 "cublasLtMatrixLayoutCreate");
  };
  if (const std::int64_t kb = m.batch == 1 && !m.transpose_a ? k_block(M, N, K, blocks) : 0; kb > 0) {
    // Slabs of K: each slab's parts are dense — a's [M, w] (column-major [w x M], ld w), b's [N, w] when
    // transposed ([w x N], ld w), else [w, N] ([N x w], ld N) — and its calls read chunks of them.
    d.k_block = kb, d.b_transposed = m.transpose_b;
    d.block_rows = M, d.block_cols = N;
    d.a_elems = M * kb, d.b_elems = N * kb;
    auto slab_splitter = split_kernel(kSlabName);
    if (!slab_splitter) return tl::unexpected(slab_splitter.error());
    d.slab_splitter = std::move(*slab_splitter);
    auto add_slab = [&](Descriptors::Tile& tile, std::int64_t w, bool last) -> Result<void> {
      auto add_call = [&](cublasLtMatmulDesc_t desc, Part fp, Part sp, std::int64_t k0, std::int64_t kc,
                          const char* what) -> Result<void> {
        Descriptors::Call call;
        call.op = desc, call.first_part = fp, call.second_part = sp;
        tile.calls.push_back(call);  // owned from here, as in add_calls
        Descriptors::Call& c = tile.calls.back();
        if (auto r = part_layout(c.first, b_k_in_rows, N, w, kc); !r) return r;
        if (auto r = part_layout(c.second, a_k_in_rows, M, w, kc); !r) return r;
        c.first_offset = b_k_in_rows ? k0 : k0 * N;
        c.second_offset = a_k_in_rows ? k0 : k0 * M;
        return pick(desc, c.first, c.second, c.algo, what);
      };
      if (auto r = add_call(d.plain, Part::b_hi, Part::a_lo, 0, w, " (tf32x3 slab, a_lo b_hi)"); !r) return r;
      if (auto r = add_call(d.plain, Part::b_lo, Part::a_hi, 0, w, " (tf32x3 slab, a_hi b_lo)"); !r) return r;
      const std::int64_t chunk = split_chunk(K);
      for (std::int64_t k0 = 0; k0 < w; k0 += chunk) {
        const std::int64_t kc = std::min(chunk, w - k0);
        const bool epilogue = last && k0 + kc >= w;
        if (auto r = add_call(epilogue ? d.op : d.plain, Part::b_hi, Part::a_hi, k0, kc, " (tf32x3 slab, a_hi b_hi chunk)");
            !r)
          return r;
      }
      return {};
    };
    if (auto r = add_slab(d.slabs[0], kb, false); !r) return tl::unexpected(r.error());
    if (auto r = add_slab(d.slabs[1], K - (K - 1) / kb * kb, true); !r) return tl::unexpected(r.error());
    return p;
  }
  // The lo products fused, with the first hi*hi chunk or not (fuse_products): their parts side by side along
  // K, written by the row splitter.
  const int fuse = fuse_products(m.batch, m.transpose_a, K);
  d.fused = fuse > 0, d.b_stacked = d.fused && !m.transpose_b;
  d.hi_extra = fuse == 2 ? std::min(split_chunk(K), K) : 0;
  if (d.fused) {
    auto row_splitter = split_kernel(kSlabName);
    if (!row_splitter) return tl::unexpected(row_splitter.error());
    d.slab_splitter = std::move(*row_splitter);
  }
  auto add_calls = [&](Descriptors::Tile& tile, std::int64_t rows_used, std::int64_t cols_used) -> Result<void> {
    if (rows_used >= 0 || cols_used >= 0)  // a tile of c: cols_used of its N (cuBLASLt's rows) by rows_used
      if (auto r = layout(tile.out, C, m.batch, cols_used, rows_used); !r) return r;
    cublasLtMatrixLayout_t out = tile.out ? tile.out : d.out;
    const std::int64_t m_used = rows_used < 0 ? M : rows_used, n_used = cols_used < 0 ? N : cols_used;
    auto add_call = [&](cublasLtMatmulDesc_t desc, Part fp, Part sp, std::int64_t k0, std::int64_t kc,
                        const char* what) -> Result<void> {
      Descriptors::Call call;
      call.op = desc, call.first_part = fp, call.second_part = sp;
      tile.calls.push_back(call);  // owned from here: the destructor frees its layouts whatever fails next
      Descriptors::Call& c = tile.calls.back();
      if (d.fused) {  // a's rows and a transposed b's hold 2K + hi_extra floats; a stacked b's parts are [., N]
        if (auto r = part_layout(c.first, b_k_in_rows, n_used, d.width(), kc); !r) return r;
        if (auto r = part_layout(c.second, a_k_in_rows, m_used, d.width(), kc); !r) return r;
        c.first_offset = d.b_stacked ? k0 * N : k0;
        c.second_offset = k0;
      } else {
        if (auto r = chunk_layout(c.first, B, b_k_in_rows, kc, cols_used); !r) return r;
        if (auto r = chunk_layout(c.second, A, a_k_in_rows, kc, rows_used); !r) return r;
        c.first_offset = chunk_offset(B, b_k_in_rows, k0);
        c.second_offset = chunk_offset(A, a_k_in_rows, k0);
      }
      return pick(desc, c.first, c.second, c.algo, what, out);
    };
    if (d.fused) {  // [b_hi | b_lo (| b_hi's first chunk)] . [a_lo | a_hi (| a_hi's)], from b_hi's and a_lo's starts
      const bool all = d.hi_extra == K;  // the three products in one: c written once, with the epilogue
      if (auto r = add_call(all ? d.op : d.plain, Part::b_hi, Part::a_lo, 0, d.width(),
                            all ? " (tf32x3, the three products fused)" : " (tf32x3, a_lo b_hi + a_hi b_lo fused)");
          !r || all)
        return r;
    } else {
      if (auto r = add_call(d.plain, Part::b_hi, Part::a_lo, 0, K, " (tf32x3, a_lo b_hi)"); !r) return r;
      if (auto r = add_call(d.plain, Part::b_lo, Part::a_hi, 0, K, " (tf32x3, a_hi b_lo)"); !r) return r;
    }
    const std::int64_t chunk = split_chunk(K);
    for (std::int64_t k0 = d.hi_extra; k0 < K; k0 += chunk) {  // after the first chunk when it is fused
      const std::int64_t kc = std::min(chunk, K - k0);
      const bool last = k0 + kc >= K;
      if (auto r = add_call(last ? d.op : d.plain, Part::b_hi, Part::a_hi, k0, kc, " (tf32x3, a_hi b_hi chunk)"); !r)
        return r;
    }
    return {};
  };
  const bool rows_blocked = d.block_rows < M, cols_blocked = d.block_cols < N;
  const std::int64_t row_tail = rows_blocked ? M % d.block_rows : 0, col_tail = cols_blocked ? N % d.block_cols : 0;
  for (int last_rows = 0; last_rows < 2; ++last_rows)
    for (int last_cols = 0; last_cols < 2; ++last_cols) {
      if ((last_rows && !row_tail) || (last_cols && !col_tail)) continue;
      const std::int64_t rows_used = !rows_blocked ? -1 : last_rows ? row_tail : d.block_rows;
      const std::int64_t cols_used = !cols_blocked ? -1 : last_cols ? col_tail : d.block_cols;
      if (auto r = add_calls(d.tiles[last_rows][last_cols], rows_used, cols_used); !r) return tl::unexpected(r.error());
    }
  return p;
}

Result<void> PreparedMatmul::run(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, const at::Tensor* bias,
                                 void* workspace, std::size_t workspace_bytes, void* stream, void* scratch) const {
  const Descriptors& d = *d_;
  if (d.uses_bias) {
    const void* ptr = bias->data_ptr();
    d.api->DescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, sizeof(ptr));
  }
  const void* alpha = d.f64 ? static_cast<const void*>(&d.alpha64) : static_cast<const void*>(&d.alpha);
  const void* beta = d.f64 ? static_cast<const void*>(&d.beta64) : static_cast<const void*>(&d.beta);
  // A split or conversion kernel over `n` elements: a float4 per thread, a grid-stride loop past 8192 blocks.
  auto launch_split = [&](const jit::Kernel& kernel, std::int64_t n, const jit::KernelArgs& args) -> Result<void> {
    jit::LaunchConfig cfg;
    cfg.block = {256, 1, 1};
    cfg.grid = {unsigned(std::clamp<std::int64_t>((n / 4 + 255) / 256, 1, 8192)), 1, 1};
    cfg.stream = stream;
    cfg.device = c.get_device();
    return kernel.launch(cfg, args);
  };
  // One cuBLASLt call computing the whole product (every path but tf32x3), its algorithm tuned first.
  auto single_call = [&](const void* first, const void* second) -> Result<void> {
    auto call = [&](const cublasLtMatmulAlgo_t* algo) {
      return d.api->Matmul(d.api->handle, d.op, alpha, first, d.first, second, d.second, beta, c.data_ptr(), d.out,
                           c.data_ptr(), d.out, algo, workspace, workspace_bytes, static_cast<cudaStream_t>(stream));
    };
    tune(*d_, call, stream, c.get_device());
    cublasStatus_t s = call(&d.algo);
    if (s != CUBLAS_STATUS_SUCCESS) return fail(ErrorCode::CudaError, "cublasLtMatmul failed: " + status_text(s));
    return {};
  };
  if (d.cast16) {
    if (!scratch) return fail(ErrorCode::Internal, "a bf16 matmul ran without its conversion scratch");
    auto* b16 = static_cast<std::uint16_t*>(scratch);
    auto* a16 = b16 + aligned16(d.b_count);
    auto convert = [&](const at::Tensor& x, std::uint16_t* y, std::int64_t n) -> Result<void> {
      jit::KernelArgs args;
      args.pointer(x.data_ptr()).pointer(y).i64(n);
      return launch_split(*d.caster, n, args);
    };
    if (auto r = convert(b, b16, d.b_count); !r) return r;
    if (a.data_ptr() == b.data_ptr() && d.a_count == d.b_count) {
      a16 = b16;  // x @ x^T: one copy
    } else if (auto r = convert(a, a16, d.a_count); !r) {
      return r;
    }
    return single_call(b16, a16);
  }
  if (!d.split) return single_call(b.data_ptr(), a.data_ptr());
  if (!scratch) return fail(ErrorCode::Internal, "a tf32x3 matmul ran without its split scratch");
  float* parts = static_cast<float*>(scratch);
  auto split = [&](const float* x, std::int64_t n, Descriptors::Part hi, Descriptors::Part lo) -> Result<void> {
    jit::KernelArgs args;
    args.pointer(x).pointer(parts + d.part_offset(hi)).pointer(parts + d.part_offset(lo)).i64(n);
    return launch_split(*d.splitter, n, args);
  };
  using Part = Descriptors::Part;
  const float one = 1.0f;
  // `rows` x `cols` of x (row stride ld) into parts of row stride out_ld (the row splitter), the first hi*hi
  // chunk's share of hi written again where that chunk joins the fused lo products.
  auto split_rows = [&](const float* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, Part hi, Part lo,
                        std::int64_t out_ld) -> Result<void> {
    jit::KernelArgs args;
    args.pointer(x).i64(ld).i64(rows).i64(cols).pointer(parts + d.part_offset(hi)).pointer(parts + d.part_offset(lo))
        .i64(out_ld).i64(d.hi_again(hi)).i64(d.again_cols(hi));
    return launch_split(*d.slab_splitter, rows * cols, args);
  };
  if (d.k_block > 0) {  // slabs of K: split both operands' slab, then its calls, c accumulating
    auto split_slab = [&](const float* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, Part hi,
                          Part lo) { return split_rows(x, ld, rows, cols, hi, lo, cols); };
    const float* a_data = static_cast<const float*>(a.data_ptr());
    const float* b_data = static_cast<const float*>(b.data_ptr());
    const std::int64_t M = d.rows_total, N = d.cols_total, K = d.k_total;
    bool first = true;
    for (std::int64_t k0 = 0; k0 < K; k0 += d.k_block) {
      const std::int64_t w = std::min(d.k_block, K - k0);
      if (auto r = split_slab(a_data + k0, K, M, w, Part::a_hi, Part::a_lo); !r) return r;
      auto r = d.b_transposed ? split_slab(b_data + k0, K, N, w, Part::b_hi, Part::b_lo)
                              : split_slab(b_data + k0 * N, N, w, N, Part::b_hi, Part::b_lo);
      if (!r) return r;
      const Descriptors::Tile& slab = d.slabs[k0 + w >= K];
      for (std::size_t i = 0; i < slab.calls.size(); ++i) {
        const Descriptors::Call& call = slab.calls[i];
        const float* first_part = parts + d.part_offset(call.first_part) + call.first_offset;
        const float* second_part = parts + d.part_offset(call.second_part) + call.second_offset;
        cublasStatus_t s = d.api->Matmul(d.api->handle, call.op, alpha, first_part, call.first, second_part, call.second,
                                         first ? beta : &one, c.data_ptr(), d.out, c.data_ptr(), d.out, &call.algo,
                                         workspace, workspace_bytes, static_cast<cudaStream_t>(stream));
        first = false;
        if (s != CUBLAS_STATUS_SUCCESS)
          return fail(ErrorCode::CudaError, "cublasLtMatmul failed (tf32x3 product " + std::to_string(i + 1) + " of " +
                                                std::to_string(slab.calls.size()) + ", slab at K " + std::to_string(k0) +
                                                "): " + status_text(s));
      }
    }
    return {};
  }
  const bool rows_blocked = d.block_rows < d.rows_total, cols_blocked = d.block_cols < d.cols_total;
  const float* a_data = static_cast<const float*>(a.data_ptr());
  const float* b_data = static_cast<const float*>(b.data_ptr());
  // `rows` rows of an operand (K floats each, or a stacked b whole) into its parts: side by side along K
  // when products are fused (a stacked b as one row, the first rows of its hi part again after its lo part
  // with the first hi*hi chunk), else each part whole.
  auto split_operand = [&](const float* x, std::int64_t rows, Part hi, Part lo) -> Result<void> {
    const std::int64_t n = rows * d.k_total;
    if (d.fused && hi == Part::b_hi && d.b_stacked)
      return d.hi_extra ? split_rows(x, n, 1, n, hi, lo, n) : split(x, n, hi, lo);
    if (d.fused) return split_rows(x, d.k_total, rows, d.k_total, hi, lo, d.width());
    return split(x, n, hi, lo);
  };
  if (!cols_blocked)  // b whole: N rows of K when transposed (blocks are only made of those), K rows of N else
    if (auto r = split_operand(b_data, d.b_elems / d.k_total, Part::b_hi, Part::b_lo); !r) return r;
  if (!rows_blocked)
    if (auto r = split_operand(a_data, d.a_elems / d.k_total, Part::a_hi, Part::a_lo); !r) return r;
  // b's blocks outside, a's inside: a blocked alone is split once per block, as unblocked; both blocked,
  // a is split again for each block of b.
  for (std::int64_t n0 = 0; n0 < d.cols_total; n0 += d.block_cols) {
    const std::int64_t cols_here = std::min(d.block_cols, d.cols_total - n0);
    if (cols_blocked) {
      if (auto r = split_operand(b_data + n0 * d.k_total, cols_here, Part::b_hi, Part::b_lo); !r) return r;
      if (d.uses_bias) {  // the bias of these columns
        const void* ptr = static_cast<const char*>(bias->data_ptr()) + n0 * bias->element_size();
        d.api->DescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, sizeof(ptr));
      }
    }
    for (std::int64_t r0 = 0; r0 < d.rows_total; r0 += d.block_rows) {
      const std::int64_t rows_here = std::min(d.block_rows, d.rows_total - r0);
      if (rows_blocked)
        if (auto r = split_operand(a_data + r0 * d.k_total, rows_here, Part::a_hi, Part::a_lo); !r) return r;
      const Descriptors::Tile& tile = d.tiles[rows_here < d.block_rows][cols_here < d.block_cols];
      const cublasLtMatrixLayout_t out = tile.out ? tile.out : d.out;
      float* c_tile = static_cast<float*>(c.data_ptr()) + r0 * d.cols_total + n0;
      for (std::size_t i = 0; i < tile.calls.size(); ++i) {
        const Descriptors::Call& call = tile.calls[i];
        const float* first = parts + d.part_offset(call.first_part) + call.first_offset;
        const float* second = parts + d.part_offset(call.second_part) + call.second_offset;
        cublasStatus_t s = d.api->Matmul(d.api->handle, call.op, alpha, first, call.first, second, call.second,
                                         i == 0 ? beta : &one, c_tile, out, c_tile, out, &call.algo, workspace,
                                         workspace_bytes, static_cast<cudaStream_t>(stream));
        if (s != CUBLAS_STATUS_SUCCESS)
          return fail(ErrorCode::CudaError,
                      "cublasLtMatmul failed (tf32x3 product " + std::to_string(i + 1) + " of " +
                          std::to_string(tile.calls.size()) +
                          (rows_blocked || cols_blocked ? ", tile at row " + std::to_string(r0) + ", column " +
                                                              std::to_string(n0)
                                                        : std::string()) +
                          "): " + status_text(s));
      }
    }
  }
  return {};
}

}  // namespace stitchcuda::torch::detail
