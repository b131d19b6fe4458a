// Matmul steps through cuBLASLt: row-major operands mapped onto cuBLASLt's column-major view, fused
// bias/ReLU/GELU epilogues, strided batches with broadcast operands. The library is the
// libcublasLt.so.13 PyTorch already loaded (one CUDA major per process), found with dlopen.
#include "steps.hpp"

#include <cublasLt.h>
#include <dlfcn.h>

#include <mutex>

namespace stitchcuda::program::detail {
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
    void* lib = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      loaded = fail(ErrorCode::Unavailable,
                    "cuBLASLt (libcublasLt.so.13) could not be loaded: install PyTorch built for CUDA 13 "
                    "(it ships cuBLASLt) or the CUDA 13 toolkit's libraries on the library path");
      return;
    }
    LtApi api;
    std::string missing;
    auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn) missing += std::string(" ") + name;
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
      loaded = fail(ErrorCode::Unavailable, "libcublasLt.so.13 lacks:" + missing);
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
};

PreparedMatmul::~PreparedMatmul() {
  if (!d_ || !d_->api) return;
  if (d_->first) d_->api->LayoutDestroy(d_->first);
  if (d_->second) d_->api->LayoutDestroy(d_->second);
  if (d_->out) d_->api->LayoutDestroy(d_->out);
  if (d_->op) d_->api->DescDestroy(d_->op);
}

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
  if (d.f64) compute = CUBLAS_COMPUTE_64F;
  else if (C.dtype == DType::f32 && m.precision == ComputePrecision::tf32) compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  else if (C.dtype == DType::f32 && m.precision == ComputePrecision::bf16) compute = CUBLAS_COMPUTE_32F_FAST_16BF;
  cudaDataType_t scale = d.f64 ? CUDA_R_64F : CUDA_R_32F;
  auto check = [](cublasStatus_t s, const char* what) -> Result<void> {
    if (s != CUBLAS_STATUS_SUCCESS) return fail(ErrorCode::CudaError, std::string(what) + " failed: " + status_text(s));
    return {};
  };
  if (auto r = check(d.api->DescCreate(&d.op, compute, scale), "cublasLtMatmulDescCreate"); !r)
    return tl::unexpected(r.error());
  cublasOperation_t op_first = m.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_second = m.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  d.api->DescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first));
  d.api->DescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second));
  cublasLtEpilogue_t epi = epilogue_of(m.epilogue);
  if (auto r = check(d.api->DescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)), "setting the epilogue"); !r)
    return tl::unexpected(r.error());
  if (d.uses_bias) {
    cudaDataType_t bias_type = data_type(program.buffer(*m.bias)->spec.dtype);
    d.api->DescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type));
  }

  // Stored (column-major) shapes: b's memory is [cols(B) x rows(B)], a's is [cols(A) x rows(A)].
  auto layout = [&](cublasLtMatrixLayout_t& out, const TensorSpec& s, std::int64_t batch) -> Result<void> {
    const std::uint64_t r = std::uint64_t(cols(s)), c = std::uint64_t(rows(s));
    if (auto st = check(d.api->LayoutCreate(&out, data_type(s.dtype), r, c, std::int64_t(r)), "cublasLtMatrixLayoutCreate"); !st)
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

  cublasLtMatmulPreference_t pref = nullptr;
  if (auto r = check(d.api->PreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate"); !r) return tl::unexpected(r.error());
  std::uint64_t ws = workspace_bytes;
  d.api->PreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t s = d.api->AlgoGetHeuristic(d.api->handle, d.op, d.first, d.second, d.out, d.out, pref, 1, &result, &found);
  d.api->PreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS || found == 0)
    return fail(ErrorCode::Unavailable,
                "cuBLASLt has no algorithm for this matmul (M=" + std::to_string(M) + ", N=" + std::to_string(N) +
                    ", K=" + std::to_string(K) + ", " + to_string(C.dtype) + ", epilogue " + to_string(m.epilogue) +
                    ", " + status_text(s) + "): use an ATen step (aten::mm/addmm) or another epilogue");
  d.algo = result.algo;
  d.workspace_needed = result.workspaceSize;
  return p;
}

Result<void> PreparedMatmul::run(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, const at::Tensor* bias,
                                 void* workspace, std::size_t workspace_bytes, void* stream) const {
  const Descriptors& d = *d_;
  if (d.uses_bias) {
    const void* ptr = bias->data_ptr();
    d.api->DescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, sizeof(ptr));
  }
  const void* alpha = d.f64 ? static_cast<const void*>(&d.alpha64) : static_cast<const void*>(&d.alpha);
  const void* beta = d.f64 ? static_cast<const void*>(&d.beta64) : static_cast<const void*>(&d.beta);
  cublasStatus_t s = d.api->Matmul(d.api->handle, d.op, alpha, b.data_ptr(), d.first, a.data_ptr(), d.second, beta,
                                   c.data_ptr(), d.out, c.data_ptr(), d.out, &d.algo, workspace, workspace_bytes,
                                   static_cast<cudaStream_t>(stream));
  if (s != CUBLAS_STATUS_SUCCESS) return fail(ErrorCode::CudaError, "cublasLtMatmul failed: " + status_text(s));
  return {};
}

}  // namespace stitchcuda::program::detail
