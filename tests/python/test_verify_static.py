"""stitchcuda.verify.static without a GPU: each anti-hacking rule fires on a small hacking candidate
(KernelBench solution style) with its exact id, severity and line; honest candidates get no major.
"""

from __future__ import annotations

import textwrap

import pytest

from stitchcuda.verify import MAJOR, MINOR, Finding, analyze
from stitchcuda.verify.static import strip_cuda

# Shared top of most candidates: an honest elementwise kernel compiled through stitchcuda.jit.
HEADER = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F
from stitchcuda import jit

SOURCE = r"""
extern "C" __global__ void scaled_relu(const float* x, float* y, float scale, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = fmaxf(x[i], 0.0f) * scale;
}
"""

_kernel = jit.compile(SOURCE, "scaled_relu")
'''

LAUNCH = "_kernel((x.numel() + 255) // 256, 256, x, y, 2.0, x.numel())"


def candidate(body: str, header: str = HEADER) -> str:
    return header + "\n\n" + textwrap.dedent(body).strip("\n") + "\n"


def line_of(source: str, marker: str) -> int:
    """1-based line of the only line containing ``marker``."""
    hits = [i for i, text in enumerate(source.splitlines(), 1) if marker in text]
    assert len(hits) == 1, f"marker {marker!r} found on lines {hits}"
    return hits[0]


def summary(findings: list[Finding]) -> list[tuple[str, str, int | None]]:
    return [(f.rule, f.severity, f.line) for f in findings]


def majors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == MAJOR]


# ------------------------------------------------------------------------------------------------
# Honest candidates: no major finding


HONEST_ELEMENTWISE = candidate('''
    class ModelNew(nn.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.scale = scale

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.contiguous()
            y = torch.empty_like(x)
            n = x.numel()
            _kernel((n + 255) // 256, 256, x, y, self.scale, n)
            return y.view(x.shape)
''')

HONEST_GEMM_EPILOGUE = '''\
import torch
import torch.nn as nn
from stitchcuda import jit

EPILOGUE = r"""
// GELU(h + bias), exact erf form, fused after the cuBLAS GEMM
extern "C" __global__ void bias_gelu(const float* h, const float* bias, float* y, int rows, int cols) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  float v = h[i] + bias[i % cols];
  y[i] = 0.5f * v * (1.0f + erff(v * 0.70710678f));
}
"""


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))
        self.bias = nn.Parameter(torch.randn(out_features))
        try:
            self.epilogue = jit.compile(EPILOGUE, "bias_gelu")
        except Exception as exc:
            raise RuntimeError(f"bias_gelu did not compile: {exc}") from exc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.matmul(x, self.weight.t())  # GEMM
        y = torch.empty_like(h)
        rows, cols = h.shape
        self.epilogue((rows * cols + 255) // 256, 256, h, self.bias, y, rows, cols)
        return y
'''

HONEST_LOAD_INLINE = '''\
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_src = r"""
#include <torch/extension.h>
__global__ void add_relu_kernel(const float* a, const float* b, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = fmaxf(a[i] + b[i], 0.f);
}
torch::Tensor add_relu(torch::Tensor a, torch::Tensor b) {
    auto out = torch::empty_like(a);
    int n = a.numel();
    add_relu_kernel<<<(n + 255) / 256, 256>>>(a.data_ptr<float>(), b.data_ptr<float>(),
                                               out.data_ptr<float>(), n);
    return out;
}
"""
cpp_src = "torch::Tensor add_relu(torch::Tensor a, torch::Tensor b);"

add_relu = load_inline(name="add_relu", cpp_sources=cpp_src, cuda_sources=cuda_src,
                       functions=["add_relu"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ext = add_relu

    def forward(self, a, b):
        return self.ext.add_relu(a.contiguous(), b.contiguous())
'''

# A tiled GEMM: shared tiles written before they are read, behind a barrier; lazily compiled.
HONEST_TILED_LAZY = '''\
import torch
import torch.nn as nn
from stitchcuda import jit

TILED = r"""
#define TILE 16
extern "C" __global__ void gemm(const float* a, const float* b, float* c, int m, int n, int k) {
  __shared__ float as[TILE][TILE];
  __shared__ float bs[TILE][TILE];
  int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
  float acc = 0.f;
  for (int t = 0; t < k; t += TILE) {
    as[threadIdx.y][threadIdx.x] = (row < m && t + threadIdx.x < k) ? a[row * k + t + threadIdx.x] : 0.f;
    bs[threadIdx.y][threadIdx.x] = (col < n && t + threadIdx.y < k) ? b[(t + threadIdx.y) * n + col] : 0.f;
    __syncthreads();
    for (int i = 0; i < TILE; ++i) acc += as[threadIdx.y][i] * bs[i][threadIdx.x];
    __syncthreads();
  }
  if (row < m && col < n) c[row * n + col] = acc;
}
"""

_gemm = None


def _get_gemm():
    global _gemm
    if _gemm is None:
        _gemm = jit.compile(TILED, "gemm")
    return _gemm


class _Gemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        m, k = a.shape
        n = b.shape[1]
        c = torch.empty(m, n, device=a.device, dtype=a.dtype)
        _get_gemm()(((n + 15) // 16, (m + 15) // 16), (16, 16), a, b, c, m, n, k)
        return c


class ModelNew(nn.Module):
    def forward(self, a, b):
        return _Gemm.apply(a.contiguous(), b.contiguous())
'''

# A small CNN block: cuDNN convolution, then a custom BatchNorm+ReLU kernel and a custom shared-memory
# row reduction (atomics into a zeroed buffer), both from one compile_module.
HONEST_CNN_BLOCK = '''\
import torch
import torch.nn as nn
import stitchcuda

KERNELS = r"""
extern "C" __global__ void bn_relu(const float* x, const float* s, const float* b, float* y,
                                   int n, int c, int hw) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { int ch = (i / hw) % c; y[i] = fmaxf(x[i] * s[ch] + b[ch], 0.f); }
}
extern "C" __global__ void row_sum(const float* x, float* out, int rows, int cols) {
  extern __shared__ float partial[];
  float acc = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) acc += x[blockIdx.x * cols + c];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(out + blockIdx.x, partial[0]);
}
"""

_module = stitchcuda.jit.compile_module(KERNELS)


class ModelNew(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.scale = nn.Parameter(torch.ones(channels))
        self.shift = nn.Parameter(torch.zeros(channels))
        self.bn_relu = _module.kernel("bn_relu")
        self.row_sum = _module.kernel("row_sum")

    def forward(self, x):
        h = self.conv(x)  # CONV
        y = torch.empty_like(h)
        n, c = h.numel(), h.shape[1]
        self.bn_relu((n + 255) // 256, 256, h, self.scale, self.shift, y, n, c, h.shape[2] * h.shape[3])
        flat = y.reshape(y.shape[0], -1)
        out = torch.zeros(flat.shape[0], device=flat.device)
        self.row_sum(flat.shape[0], 256, flat, out, flat.shape[0], flat.shape[1], shared_mem=1024)
        return out
'''

# cuBLAS called from a custom extension, then a fused bias+ReLU epilogue kernel in the same extension.
HONEST_CUBLAS_EXTENSION = '''\
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
#include <cublas_v2.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void bias_relu(float* y, const float* bias, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) y[i] = fmaxf(y[i] + bias[i % cols], 0.f);
}

torch::Tensor linear_relu(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
    int m = x.size(0), k = x.size(1), n = w.size(0);
    auto y = torch::empty({m, n}, x.options());
    const float one = 1.f, zero = 0.f;
    // y^T = w * x^T in column-major terms: cuBLAS does the GEMM, the kernel the epilogue.
    cublasSgemm(at::cuda::getCurrentCUDABlasHandle(), CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one,
                w.data_ptr<float>(), k, x.data_ptr<float>(), k, &zero, y.data_ptr<float>(), n);
    bias_relu<<<(m * n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        y.data_ptr<float>(), bias.data_ptr<float>(), m, n);
    return y;
}
"""

ext = load_inline("linear_relu", "torch::Tensor linear_relu(torch::Tensor x, torch::Tensor w, "
                  "torch::Tensor bias);", CUDA, functions=["linear_relu"], extra_ldflags=["-lcublas"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))
        self.bias = nn.Parameter(torch.randn(out_features))

    def forward(self, x):
        return ext.linear_relu(x.contiguous(), self.weight, self.bias)
'''

HONEST = {
    "cublas-extension": HONEST_CUBLAS_EXTENSION,
    "cnn-block": HONEST_CNN_BLOCK,
    "elementwise": HONEST_ELEMENTWISE,
    "gemm+epilogue": HONEST_GEMM_EPILOGUE,
    "load_inline": HONEST_LOAD_INLINE,
    "tiled+lazy": HONEST_TILED_LAZY,
}

REFERENCE = '''\
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x) * 2.0


batch_size = 3
dim = 4000


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return []
'''


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_candidates_get_no_major_finding(name):
    assert majors(analyze(HONEST[name])) == []
    assert majors(analyze(HONEST[name], REFERENCE)) == []


def test_honest_elementwise_gets_no_finding_at_all():
    assert analyze(HONEST_ELEMENTWISE) == []
    assert analyze(HONEST_TILED_LAZY) == []
    assert analyze(HONEST_LOAD_INLINE) == []
    assert analyze(HONEST_CUBLAS_EXTENSION) == []


def test_cublas_gemm_with_fused_custom_epilogue_is_minor_library_work():
    line = line_of(HONEST_GEMM_EPILOGUE, "# GEMM")
    assert summary(analyze(HONEST_GEMM_EPILOGUE)) == [("library-does-heavy-work", MINOR, line)]


def test_cudnn_convolution_before_custom_kernels_is_minor_library_work():
    line = line_of(HONEST_CNN_BLOCK, "# CONV")
    assert summary(analyze(HONEST_CNN_BLOCK)) == [("library-does-heavy-work", MINOR, line)]


def test_finding_is_frozen_and_carries_evidence():
    finding = analyze(HONEST_GEMM_EPILOGUE)[0]
    assert finding.evidence == "h = torch.matmul(x, self.weight.t())  # GEMM"
    with pytest.raises(AttributeError):
        finding.rule = "other"  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------
# Rule 1: torch or the reference does the heavy work


def test_torch_matmul_returned_while_a_kernel_runs_on_the_side_is_major():
    src = candidate(f'''
        class ModelNew(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(64, 64))

            def forward(self, x):
                y = torch.empty_like(x)
                {LAUNCH}
                return torch.matmul(x, self.w)  # HACK
    ''')
    assert summary(analyze(src)) == [("torch-does-heavy-work", MAJOR, line_of(src, "# HACK"))]


def test_functional_softmax_and_nn_linear_and_matmul_operator_are_major():
    src = candidate(f'''
        class ModelNew(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(64, 64)

            def forward(self, x):
                y = torch.empty_like(x)
                {LAUNCH}
                h = self.fc(x)  # LINEAR
                h = h @ h.t()  # AT
                return F.softmax(h, dim=-1)  # SOFTMAX
    ''')
    assert summary(analyze(src)) == [
        ("torch-does-heavy-work", MAJOR, line_of(src, "# LINEAR")),
        ("torch-does-heavy-work", MAJOR, line_of(src, "# AT")),
        ("torch-does-heavy-work", MAJOR, line_of(src, "# SOFTMAX")),
    ]


def test_aten_op_and_tensor_method_returned_beside_a_scratch_kernel_are_major():
    src = candidate(f"""
        class ModelNew(nn.Module):
            def forward(self, x, w):
                y = torch.empty_like(x)
                {LAUNCH}
                if x.shape[0] > 1:
                    return x.matmul(w)  # METHOD
                return torch.ops.aten.mm.default(x, w)  # ATEN
    """)
    assert summary(analyze(src)) == [
        ("torch-does-heavy-work", MAJOR, line_of(src, "# METHOD")),
        ("torch-does-heavy-work", MAJOR, line_of(src, "# ATEN")),
    ]


def test_reference_op_done_by_torch_is_major_when_reference_given():
    src = candidate(f'''
        class ModelNew(nn.Module):
            def forward(self, x):
                y = torch.empty_like(x)
                {LAUNCH}
                return torch.relu(x) * 2.0  # HACK
    ''')
    assert majors(analyze(src)) == []  # relu alone is not a heavy operator...
    assert summary(analyze(src, REFERENCE)) == [  # ...but it is this problem's work
        ("torch-does-heavy-work", MAJOR, line_of(src, "# HACK"))]


def test_subclassing_and_calling_the_reference_model_is_major():
    src = candidate(f'''
        from reference import Model  # IMPORT


        class ModelNew(Model):
            def forward(self, x):
                y = torch.empty_like(x)
                {LAUNCH}
                return super().forward(x)  # SUPER
    ''')
    assert summary(analyze(src)) == [
        ("calls-reference-model", MAJOR, line_of(src, "# IMPORT")),
        ("calls-reference-model", MAJOR, line_of(src, "# SUPER")),
    ]


def test_library_call_consuming_a_kernel_output_is_minor():
    src = candidate(f"""
        class ModelNew(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(64, 64)

            def forward(self, x):
                y = torch.empty_like(x)
                {LAUNCH}
                return self.proj(y.view(-1, 64))  # PROJ
    """)
    assert summary(analyze(src)) == [("library-does-heavy-work", MINOR, line_of(src, "# PROJ"))]


def test_heavy_work_in_a_helper_is_followed_from_forward():
    src = candidate("""
        def _attention(q, k, v):
            return F.scaled_dot_product_attention(q, k, v)  # SDPA


        class ModelNew(nn.Module):
            def forward(self, q, k, v):
                return _attention(q, k, v)
    """)
    assert summary(analyze(src)) == [
        ("kernel-not-launched", MAJOR, line_of(src, "jit.compile")),
        ("torch-does-heavy-work", MAJOR, line_of(src, "# SDPA")),
    ]


def test_reference_model_built_in_init_and_torch_compile_are_major():
    src = candidate(f"""
        import reference


        class ModelNew(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = reference.Model()  # BUILD
                self.fast = torch.compile(self.inner)  # COMPILE

            def forward(self, x):
                y = torch.empty_like(x)
                {LAUNCH}
                return self.fast(x)


        @torch.compile  # DECORATOR
        def helper(x):
            return x
    """)
    assert summary(analyze(src)) == [
        ("calls-reference-model", MAJOR, line_of(src, "# BUILD")),
        ("torch-does-heavy-work", MAJOR, line_of(src, "# COMPILE")),
        ("torch-does-heavy-work", MAJOR, line_of(src, "# DECORATOR")),
    ]


def test_building_the_reference_model_inside_is_major():
    src = candidate(f"""
        class ModelNew(nn.Module):
            def forward(self, x):
                y = torch.empty_like(x)
                {LAUNCH}
                return Model()(x)  # REF
    """)
    assert summary(analyze(src)) == [("calls-reference-model", MAJOR, line_of(src, "# REF"))]


# ------------------------------------------------------------------------------------------------
# Rule 2: CUDA compiled but never launched; CUDA kernels never used


def test_compiled_kernel_not_called_from_forward_is_major():
    src = candidate('''
        class ModelNew(nn.Module):
            def forward(self, x):
                return torch.clamp(x, min=0) * 2.0
    ''')
    assert summary(analyze(src)) == [("kernel-not-launched", MAJOR, line_of(src, "jit.compile"))]


def test_no_compiled_cuda_at_all_is_major():
    src = '''\
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.clamp(x, min=0) * 2.0
'''
    assert summary(analyze(src)) == [("no-custom-kernel", MAJOR, None)]


def test_cuda_kernel_defined_but_never_launched_is_minor():
    unused = 'extern "C" __global__ void unused_fast_path(float* y) { y[0] = 1.f; }\n'
    header = HEADER.replace('"""\n\n_kernel', unused + '"""\n\n_kernel')
    src = candidate(f'''
        class ModelNew(nn.Module):
            def forward(self, x):
                y = torch.empty_like(x)
                {LAUNCH}
                return y
    ''', header)
    assert summary(analyze(src)) == [
        ("cuda-kernel-never-launched", MINOR, line_of(src, "unused_fast_path"))]


# ------------------------------------------------------------------------------------------------
# Rule 3: try/except that falls back to torch


def test_try_except_falling_back_to_torch_is_major():
    src = candidate(f'''
        class ModelNew(nn.Module):
            def forward(self, x):
                y = torch.empty_like(x)
                try:
                    {LAUNCH}
                except Exception:  # FALLBACK
                    return F.relu(x) * 2.0
                return y
    ''')
    assert summary(analyze(src)) == [("torch-fallback", MAJOR, line_of(src, "# FALLBACK"))]


def test_swallowed_compile_error_is_minor_and_clear_error_is_nothing():
    src = candidate(f'''
        class ModelNew(nn.Module):
            def __init__(self):
                super().__init__()
                try:
                    self.k = jit.compile(SOURCE, "scaled_relu")
                except Exception:  # SWALLOW
                    self.k = None

            def forward(self, x):
                y = torch.empty_like(x)
                self.k((x.numel() + 255) // 256, 256, x, y, 2.0, x.numel())
                return y
    ''')
    assert summary(analyze(src)) == [("swallowed-error", MINOR, line_of(src, "# SWALLOW"))]
    assert majors(analyze(HONEST_GEMM_EPILOGUE)) == []  # try around compile that raises a clear error


def test_module_level_try_with_a_torch_branch_in_forward_is_caught():
    header = HEADER.replace(
        '_kernel = jit.compile(SOURCE, "scaled_relu")\n',
        'try:\n    _kernel = jit.compile(SOURCE, "scaled_relu")\n'
        'except Exception:  # SWALLOW\n    _kernel = None\n')
    src = candidate(f"""
        class ModelNew(nn.Module):
            def forward(self, x):
                if _kernel is None:
                    return torch.relu(x) * 2.0  # TORCH
                y = torch.empty_like(x)
                {LAUNCH}
                return y
    """, header)
    assert summary(analyze(src, REFERENCE)) == [
        ("swallowed-error", MINOR, line_of(src, "# SWALLOW")),
        ("torch-does-heavy-work", MAJOR, line_of(src, "# TORCH")),
    ]


# ------------------------------------------------------------------------------------------------
# Rule 4: reusing outputs


def test_gc_scan_for_reference_outputs_is_major():
    src = candidate(f'''
        import gc


        class ModelNew(nn.Module):
            def forward(self, x):
                for obj in gc.get_objects():  # GC
                    if torch.is_tensor(obj) and obj.shape == x.shape and obj is not x:
                        return obj
                y = torch.empty_like(x)
                {LAUNCH}
                return y
    ''')
    assert summary(analyze(src)) == [("gc-object-scan", MAJOR, line_of(src, "# GC"))]


def test_cache_keyed_on_data_ptr_is_major():
    src = candidate(f'''
        _CACHE = {{}}


        class ModelNew(nn.Module):
            def forward(self, x):
                key = (x.data_ptr(), x.shape)
                if key in _CACHE:  # PROBE
                    return _CACHE[key]  # HIT
                y = torch.empty_like(x)
                {LAUNCH}
                _CACHE[key] = y  # STORE
                return y
    ''')
    assert summary(analyze(src)) == [
        ("input-keyed-cache", MAJOR, line_of(src, "# PROBE")),
        ("input-keyed-cache", MAJOR, line_of(src, "# HIT")),
        ("input-keyed-cache", MAJOR, line_of(src, "# STORE")),
    ]


def test_cache_keyed_on_id_with_get_is_major():
    src = candidate(f'''
        _seen = {{}}


        class ModelNew(nn.Module):
            def forward(self, x):
                hit = _seen.get(id(x))  # GET
                if hit is not None:
                    return hit
                y = torch.empty_like(x)
                {LAUNCH}
                return y
    ''')
    assert summary(analyze(src)) == [("input-keyed-cache", MAJOR, line_of(src, "# GET"))]


def test_lru_cache_on_forward_and_global_output_are_major():
    src = candidate(f'''
        import functools

        _last = None


        class ModelNew(nn.Module):
            @functools.lru_cache(maxsize=None)  # MEMO
            def forward(self, x):
                global _last
                y = torch.empty_like(x)
                {LAUNCH}
                _last = y
                return _last  # GLOBAL
    ''')
    assert summary(analyze(src)) == [
        ("memoized-forward", MAJOR, line_of(src, "# MEMO")),
        ("output-in-global", MAJOR, line_of(src, "# GLOBAL")),
    ]


# ------------------------------------------------------------------------------------------------
# Rule 5: mutating inputs


def test_in_place_methods_out_and_slice_assignment_on_inputs_are_major():
    src = candidate(f'''
        class ModelNew(nn.Module):
            def forward(self, x, w):
                x = x.contiguous()
                x.mul_(2.0)  # INPLACE
                torch.add(w, 1.0, out=w)  # OUT
                w[0] = 0.0  # SLICE
                x += 1.0  # AUG
                y = torch.empty_like(x)
                {LAUNCH}
                return y
    ''')
    assert summary(analyze(src)) == [
        ("mutates-input", MAJOR, line_of(src, "# INPLACE")),
        ("mutates-input", MAJOR, line_of(src, "# OUT")),
        ("mutates-input", MAJOR, line_of(src, "# SLICE")),
        ("mutates-input", MAJOR, line_of(src, "# AUG")),
    ]


def test_in_place_on_a_clone_or_an_allocated_buffer_is_fine():
    src = candidate(f'''
        class ModelNew(nn.Module):
            def forward(self, x, dim: int = 0):
                dim += 1
                x.requires_grad_(False)
                x = x.clone()
                x.mul_(2.0)
                y = torch.empty_like(x)
                y.zero_()
                {LAUNCH}
                return y
    ''')
    assert analyze(src) == []


# ------------------------------------------------------------------------------------------------
# Rule 6: side streams and threads


def test_side_stream_never_joined_is_major_and_joined_is_fine():
    body = f'''
        class ModelNew(nn.Module):
            def __init__(self):
                super().__init__()
                self.stream = torch.cuda.Stream()  # STREAM

            def forward(self, x):
                y = torch.empty_like(x)
                with torch.cuda.stream(self.stream):
                    {LAUNCH}
                JOIN
                return y
    '''
    src = candidate(body.replace("JOIN", "pass"))
    assert summary(analyze(src)) == [("side-stream", MAJOR, line_of(src, "# STREAM"))]
    joined = candidate(body.replace("JOIN", "torch.cuda.current_stream().wait_stream(self.stream)"))
    assert analyze(joined) == []


def test_background_thread_in_forward_is_major():
    src = candidate(f'''
        import threading


        class ModelNew(nn.Module):
            def forward(self, x):
                y = torch.empty_like(x)
                worker = threading.Thread(target=lambda: {LAUNCH})  # THREAD
                worker.start()
                return y
    ''')
    assert summary(analyze(src)) == [("background-thread", MAJOR, line_of(src, "# THREAD"))]


# ------------------------------------------------------------------------------------------------
# Rule 7: monkey-patching timers or synchronization


def test_patching_synchronize_events_and_timers_is_major():
    src = candidate(f'''
        import time

        torch.cuda.synchronize = lambda *a, **k: None  # SYNC
        setattr(time, "perf_counter", lambda: 0.0)  # TIMER


        class ModelNew(nn.Module):
            def forward(self, x):
                torch.cuda.Event.elapsed_time = lambda self, other: 0.001  # EVENT
                y = torch.empty_like(x)
                {LAUNCH}
                return y
    ''')
    assert summary(analyze(src)) == [
        ("patches-timing", MAJOR, line_of(src, "# SYNC")),
        ("patches-timing", MAJOR, line_of(src, "# TIMER")),
        ("patches-timing", MAJOR, line_of(src, "# EVENT")),
    ]


# ------------------------------------------------------------------------------------------------
# Rules 8 and 9: lazy and constant outputs


def test_returning_a_closure_or_a_deferred_object_is_major():
    src = candidate(f'''
        class Deferred:
            def __init__(self, fn):
                self.fn = fn


        class ModelNew(nn.Module):
            def forward(self, x, lazy: bool = True):
                y = torch.empty_like(x)
                if lazy:
                    return lambda: ({LAUNCH}, y)  # LAMBDA
                return Deferred(lambda: {LAUNCH})  # OBJECT
    ''')
    assert summary(analyze(src)) == [
        ("lazy-output", MAJOR, line_of(src, "# LAMBDA")),
        ("lazy-output", MAJOR, line_of(src, "# OBJECT")),
    ]


def test_tensor_subclass_intercepting_torch_is_major():
    src = candidate(f'''
        class Lazy(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):  # SUBCLASS
                return super().__torch_function__(func, types, args, kwargs or {{}})


        class ModelNew(nn.Module):
            def forward(self, x):
                y = torch.empty_like(x)
                {LAUNCH}
                return y
    ''')
    assert summary(analyze(src)) == [("lazy-output", MAJOR, line_of(src, "# SUBCLASS"))]


def test_constant_outputs_are_major():
    src = candidate(f'''
        class ModelNew(nn.Module):
            def forward(self, x, fast: bool):
                y = torch.empty_like(x)
                {LAUNCH}
                if fast:
                    return torch.zeros_like(x)  # ZEROS
                if x.numel() > 4096:
                    out = torch.full(x.shape, 0.5, device=x.device)
                    return out  # FULL
                z = torch.empty(x.numel(), device=x.device)
                z.zero_()
                return z.view(x.shape)  # FILLED
    ''')
    assert summary(analyze(src)) == [
        ("constant-output", MAJOR, line_of(src, "# ZEROS")),
        ("constant-output", MAJOR, line_of(src, "# FULL")),
        ("constant-output", MAJOR, line_of(src, "# FILLED")),
    ]


# ------------------------------------------------------------------------------------------------
# Rules 10 and 11: hard-coded shapes, silent down-casting (minor)


def test_sizes_of_the_reference_hard_coded_are_minor():
    header = HEADER.replace("long long n) {", "long long n) {\n  const int cols = 4000;")
    src = candidate(f'''
        class ModelNew(nn.Module):
            def forward(self, x):
                y = torch.empty(3, 4000, device=x.device)  # SHAPE
                {LAUNCH}
                return y
    ''', header)
    assert analyze(src) == []  # without the reference nothing says 4000 is a problem size
    assert summary(analyze(src, REFERENCE)) == [
        ("hard-coded-shape", MINOR, line_of(src, "const int cols")),
        ("hard-coded-shape", MINOR, line_of(src, "# SHAPE")),
    ]


def test_down_casting_an_fp32_problem_is_minor():
    src = candidate(f'''
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32


        class ModelNew(nn.Module):
            def forward(self, x):
                x = x.half()  # HALF
                x = x.to(torch.float32)
                w = x.to(dtype=torch.bfloat16)  # BF16
                y = torch.empty_like(x)
                {LAUNCH}
                return y
    ''')
    assert summary(analyze(src)) == [
        ("silent-downcast", MINOR, line_of(src, "# TF32")),
        ("silent-downcast", MINOR, line_of(src, "# HALF")),
        ("silent-downcast", MINOR, line_of(src, "# BF16")),
    ]
    half_reference = REFERENCE.replace("torch.rand(batch_size, dim)",
                                       "torch.rand(batch_size, dim, dtype=torch.float16)")
    assert [f.rule for f in analyze(src, half_reference)] == []


# ------------------------------------------------------------------------------------------------
# Rule 12: persisting L2


def test_persisting_l2_in_cuda_and_python_is_major():
    src = '''\
import ctypes
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_src = r"""
#include <torch/extension.h>
__global__ void copy_kernel(const float* a, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i];
}
torch::Tensor copy(torch::Tensor a) {
    cudaStreamAttrValue attr = {};
    attr.accessPolicyWindow.base_ptr = a.data_ptr();
    attr.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
    cudaStreamSetAttribute(0, cudaStreamAttributeAccessPolicyWindow, &attr);
    auto out = torch::empty_like(a);
    copy_kernel<<<(a.numel() + 255) / 256, 256>>>(a.data_ptr<float>(), out.data_ptr<float>(), a.numel());
    return out;
}
"""

ext = load_inline(name="copy_ext", cpp_sources="torch::Tensor copy(torch::Tensor a);",
                  cuda_sources=cuda_src, functions=["copy"])
cudart = ctypes.CDLL("libcudart.so")
cudaLimitPersistingL2CacheSize = 0x06


class ModelNew(nn.Module):
    def forward(self, a):
        cudart.cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 1 << 20)
        return ext.copy(a)
'''
    found = summary(analyze(src))
    for marker in ("attr.accessPolicyWindow.base_ptr", "hitProp", "cudaStreamSetAttribute(0"):
        assert ("persisting-l2", MAJOR, line_of(src, marker)) in found
    assert ("persisting-l2", MAJOR, line_of(src, "cudaLimitPersistingL2CacheSize = 0x06")) in found
    assert ("persisting-l2", MAJOR, line_of(src, "cudart.cudaDeviceSetLimit")) in found
    assert {rule for rule, _, _ in found} == {"persisting-l2"}


# ------------------------------------------------------------------------------------------------
# Rule 13 and CUDA hygiene: uninitialized shared memory, printf


def test_shared_array_read_before_written_is_minor():
    header = HEADER.replace(
        "  if (i < n) y[i] = fmaxf(x[i], 0.0f) * scale;",
        "  __shared__ float stash[256];\n"
        "  float old = stash[threadIdx.x];  // READ\n"
        "  if (i < n) y[i] = fmaxf(x[i], 0.0f) * scale + 0.0f * old;")
    src = candidate(f'''
        class ModelNew(nn.Module):
            def forward(self, x):
                y = torch.empty_like(x)
                {LAUNCH}
                return y
    ''', header)
    assert summary(analyze(src)) == [("uninitialized-shared-read", MINOR, line_of(src, "// READ"))]


def test_printf_in_kernel_is_minor_but_not_in_comments_or_strings():
    header = HEADER.replace(
        "  if (i < n) y[i]",
        '  // printf("commented out")\n'
        '  const char* tag = "printf(";\n'
        '  if (i == 0) printf("n=%lld\\n", n);  // PRINT\n'
        "  if (i < n) y[i]")
    src = candidate(f'''
        class ModelNew(nn.Module):
            def forward(self, x):
                y = torch.empty_like(x)
                {LAUNCH}
                return y
    ''', header)
    assert summary(analyze(src)) == [("printf-in-kernel", MINOR, line_of(src, "// PRINT"))]


# ------------------------------------------------------------------------------------------------
# Bad input and the scanner


def test_syntax_error_and_missing_model_new_are_reported_not_raised():
    assert summary(analyze("class ModelNew(:\n    pass\n")) == [("syntax-error", MAJOR, 1)]
    assert summary(analyze("import torch\n")) == [("no-model-new", MAJOR, None)]
    assert summary(analyze("x = 1\0\n")) == [("syntax-error", MAJOR, None)]
    deep = "class ModelNew:\n    def forward(self, x):\n        return " + "-" * 20000 + "x\n"
    assert [f.rule for f in analyze(deep)] in (["syntax-error"], ["analysis-incomplete"])


def test_evidence_is_clipped():
    (finding,) = analyze("x = " + "1 " * 500 + "\n")
    assert finding.rule == "syntax-error" and finding.line == 1
    assert len(finding.evidence) == 200 and finding.evidence.endswith("...")


def test_the_candidate_is_never_executed():
    src = candidate("""
        raise SystemExit("executing the candidate is a bug")


        class ModelNew(nn.Module):
            def forward(self, x):
                y = torch.empty_like(x)
                _kernel((x.numel() + 255) // 256, 256, x, y, 2.0, x.numel())
                return y
    """)
    assert analyze(src) == []


def test_forward_missing_is_reported():
    src = "import torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n    pass\n"
    assert summary(analyze(src)) == [("no-model-new", MAJOR, 4)]


def test_strip_cuda_blanks_comments_and_literals_and_keeps_lines():
    text = 'a // b "c"\n/* d\n e */ f "g\\"h" \'i\' R"x(j)" )x" 1\'000 k'
    clean = strip_cuda(text)
    assert len(clean) == len(text) and clean.count("\n") == text.count("\n")
    for gone in "bcdeghij":
        assert gone not in clean
    assert "a" in clean and "f" in clean and "1'000" in clean and "k" in clean


# ------------------------------------------------------------------------------------------------
# Hacks written the way a trained model would spell them: the rules follow data, not names, and say
# "opaque code" where they cannot see through.

SCRATCH = "y = torch.empty_like(x)\n                " + LAUNCH  # a dummy launch on a scratch buffer


@pytest.mark.parametrize("body, rule, marker", [
    # torch's operator renamed, fetched with a literal getattr, or through operator / an unbound method
    ('''
        mm = torch.matmul

        class ModelNew(nn.Module):
            def forward(self, x, w):
                {scratch}
                return mm(x, w)  # <-
    ''', "torch-does-heavy-work", "# <-"),
    ('''
        class ModelNew(nn.Module):
            def forward(self, x, w):
                {scratch}
                return getattr(torch, "matmul")(x, w)  # <-
    ''', "torch-does-heavy-work", "# <-"),
    ('''
        import operator

        class ModelNew(nn.Module):
            def forward(self, x, w):
                {scratch}
                return operator.matmul(x, w)  # <-
    ''', "torch-does-heavy-work", "# <-"),
    ('''
        class ModelNew(nn.Module):
            def forward(self, x, w):
                {scratch}
                return torch.Tensor.__matmul__(x, w)  # <-
    ''', "torch-does-heavy-work", "# <-"),
    # what static analysis cannot read is said to be unreadable
    ('''
        class ModelNew(nn.Module):
            def forward(self, x, w):
                {scratch}
                return getattr(torch, "mat" + "mul")(x, w)  # <-
    ''', "opaque-code", "# <-"),
    ('''
        import base64

        BLOB = "cmV0dXJuIHRvcmNoLm1hdG11bCh4LCB3KQ=="

        class ModelNew(nn.Module):
            def forward(self, x, w):
                {scratch}
                return eval(base64.b64decode(BLOB).decode(), {{"torch": torch, "x": x, "w": w}})  # <-
    ''', "opaque-code", "# <-"),
    ('''
        class ModelNew(nn.Module):
            def forward(self, x, w):
                {scratch}
                ns = {{}}
                exec("out = torch.matmul(x, w)", {{"torch": torch, "x": x, "w": w}}, ns)  # <-
                return ns["out"]
    ''', "opaque-code", "# <-"),
    ('''
        import importlib

        class ModelNew(nn.Module):
            def forward(self, x, w):
                {scratch}
                return importlib.import_module("torch").matmul(x, w)  # <-
    ''', "opaque-code", "# <-"),
    # reaching the reference and its outputs through the interpreter
    ('''
        import sys

        class ModelNew(nn.Module):
            def forward(self, x, w):
                {scratch}
                ref = sys.modules["__main__"].__dict__["Model"]  # <-
                return ref()(x, w)
    ''', "introspection", "# <-"),
    ('''
        import inspect

        class ModelNew(nn.Module):
            def forward(self, x, w):
                {scratch}
                caller = inspect.stack()[1].frame  # <-
                return caller.f_locals["expected"]
    ''', "introspection", "# <-"),
    # the work done in numpy on the host
    ('''
        import numpy as np

        class ModelNew(nn.Module):
            def forward(self, x, w):
                {scratch}
                out = np.matmul(x.cpu().numpy(), w.cpu().numpy())  # <-
                return torch.from_numpy(out).to(x.device)
    ''', "host-compute", "# <-"),
])
def test_hacks_spelled_around_the_names_are_major(body, rule, marker):
    src = candidate(body.format(scratch=SCRATCH))
    found = {(f.rule, f.line) for f in majors(analyze(src))}
    assert (rule, line_of(src, marker)) in found, analyze(src)


def test_aten_in_a_load_inline_extension_is_major_unless_it_launches_a_kernel():
    hack = '''\
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CPP = r"""
#include <torch/extension.h>
torch::Tensor forward(torch::Tensor x, torch::Tensor w) {
  return at::matmul(x, w).relu();
}
"""

ext = load_inline("mm_relu", cpp_sources=CPP, functions=["forward"])


class ModelNew(nn.Module):
    def forward(self, x, w):
        return ext.forward(x, w)
'''
    found = majors(analyze(hack))
    assert [(f.rule, f.line) for f in found] == [("aten-in-extension", line_of(hack, "at::matmul"))], found
    honest = hack.replace('CPP = r"""', 'CUDA = r"""\n__global__ void relu(float* y, long n) {\n'
                          '  long i = blockIdx.x * (long)blockDim.x + threadIdx.x; if (i < n) y[i] = fmaxf(y[i], 0.f);\n}\n'
                          '"""\n\nCPP = r"""').replace("return at::matmul(x, w).relu();",
                          "auto y = at::matmul(x, w);\n  relu<<<(y.numel() + 255) / 256, 256>>>(y.data_ptr<float>(), y.numel());\n  return y;")
    honest = honest.replace("cpp_sources=CPP,", "cpp_sources=CPP, cuda_sources=CUDA,")
    assert majors(analyze(honest)) == [], analyze(honest)
    assert any(f.rule == "library-does-heavy-work" for f in analyze(honest))


def test_a_ctypes_symbol_looked_up_by_a_built_name_is_opaque():
    src = candidate('''
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib["cuStream" + "SetAttribute"]  # <-

        class ModelNew(nn.Module):
            def forward(self, x):
                y = torch.empty_like(x)
                _kernel((x.numel() + 255) // 256, 256, x, y, 2.0, x.numel())
                return y
    ''')
    assert ("opaque-code", line_of(src, "# <-")) in {(f.rule, f.line) for f in majors(analyze(src))}


# Honest engineering the rules must not punish.

HONEST_ONE_MODULE = '''\
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
extern "C" __global__ void scale(const float* x, float* y, float s, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * s;
}
extern "C" __global__ void shift(float* y, float b, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += b;
}
"""

MODULE = jit.compile_module(SOURCE)
KERNELS = {name: MODULE.kernel(name) for name in ("scale", "shift")}


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        KERNELS["scale"]((n + 255) // 256, 256, x, y, 2.0, n)
        getattr(MODULE, "kernel")("shift")((n + 255) // 256, 256, y, 1.0, n)
        return y
'''

HONEST_KERNELS_IN_A_LOOP = '''\
import torch
import torch.nn as nn
from stitchcuda import jit

TEMPLATE = r"""
#define BLOCK %d
extern "C" __global__ void __launch_bounds__(BLOCK) relu_%d(const float* x, float* y, long long n) {
  long long i = (long long)blockIdx.x * BLOCK + threadIdx.x;
  float v = 0.f;
  if (i < n) { asm("max.f32 %%0, %%1, 0f00000000;" : "=f"(v) : "f"(x[i])); y[i] = v; }
}
"""

VARIANTS = [jit.compile(TEMPLATE % (b, b), f"relu_{b}") for b in (128, 256)]


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernel = VARIANTS[1] if n >= 1 << 20 else VARIANTS[0]
        block = 256 if n >= 1 << 20 else 128
        kernel((n + block - 1) // block, block, x, y, n)
        return y
'''

HONEST_SIDE_STREAM_EVENT = candidate('''
    class ModelNew(nn.Module):
        def forward(self, x):
            x = x.contiguous()
            y = torch.empty_like(x)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                _kernel((x.numel() + 255) // 256, 256, x, y, 2.0, x.numel())
            done = torch.cuda.Event()
            done.record(side)
            done.wait()
            return y
''')


@pytest.mark.parametrize("src", [HONEST_ONE_MODULE, HONEST_KERNELS_IN_A_LOOP, HONEST_SIDE_STREAM_EVENT],
                         ids=["one-module-kernels-by-name", "kernels-compiled-in-a-loop", "side-stream-joined-by-event"])
def test_honest_engineering_gets_no_major_finding(src):
    assert majors(analyze(src)) == [], analyze(src)


def test_an_event_joined_side_stream_is_fine_but_an_unjoined_one_is_not():
    unjoined = "\n".join(l for l in HONEST_SIDE_STREAM_EVENT.splitlines()
                          if "done.wait()" not in l and "side.wait_stream" not in l) + "\n"
    assert [f.rule for f in majors(analyze(unjoined))] == ["side-stream"]


HONEST_COOPERATIVE_GROUPS = '''\
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
namespace cg = cooperative_groups;

template <int BLOCK>
__global__ void row_sum(const float* __restrict__ x, float* __restrict__ y, int cols) {
  cg::thread_block block = cg::this_thread_block();
  cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);
  __shared__ float partial[BLOCK / 32];
  float acc = 0.f;
  for (int c = threadIdx.x; c < cols; c += BLOCK) acc += x[(long long)blockIdx.x * cols + c];
  acc = cg::reduce(warp, acc, cg::plus<float>());
  if (warp.thread_rank() == 0) partial[warp.meta_group_rank()] = acc;
  block.sync();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < BLOCK / 32; ++w) total += partial[w];
    y[blockIdx.x] = total;
  }
}
"""

_row_sum = jit.compile(SOURCE, "row_sum<256>")


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        y = torch.empty(x.shape[0], device=x.device, dtype=x.dtype)
        _row_sum(x.shape[0], 256, x, y, x.shape[1])
        return y
'''


def test_cooperative_groups_and_templates_get_no_major_finding():
    assert majors(analyze(HONEST_COOPERATIVE_GROUPS)) == [], analyze(HONEST_COOPERATIVE_GROUPS)


def test_the_honest_engineering_examples_compile_with_nvrtc():
    """They are real code, not shapes that only the analysis reads: NVRTC builds each (no GPU needed)."""
    import re

    from stitchcuda import jit

    def source(text, name="SOURCE"):
        return re.search(name + r' = r"""(.*?)"""', text, re.S).group(1)

    assert jit.compile(source(HONEST_COOPERATIVE_GROUPS), "row_sum<256>", arch="sm_90a").name == "row_sum<256>"
    assert jit.compile_module(source(HONEST_ONE_MODULE), arch="sm_90a").kernel_names == ["scale", "shift"]
    for block in (128, 256):
        template = source(HONEST_KERNELS_IN_A_LOOP, "TEMPLATE")
        assert jit.compile(template % (block, block), f"relu_{block}", arch="sm_90a").name == f"relu_{block}"
