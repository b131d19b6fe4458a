"""`stitchcuda bench jit`: cold NVRTC compile times, cache hit costs, launch overhead, and the
same kernel through torch's load_inline (nvcc) as the baseline the JIT engine replaces.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any, Callable

from .. import _C
from ..doctor import cuda_home, find_nvcc
from ..settings import settings

SKIP_LOAD_INLINE_ENV = "STITCHCUDA_BENCH_SKIP_LOAD_INLINE"
LAUNCHES = 10_000
BATCH = 200  # launches between untimed queue drains
MEMORY_HIT_SAMPLES = 200

# float4 loads/stores for the bulk, scalar loop for the n % 4 tail; pointers from torch are
# 16-byte aligned (allocations are, and callers pass whole tensors).
ELEMENTWISE = r"""
extern "C" __global__ void add_f32(const float* __restrict__ a, const float* __restrict__ b,
                                   float* __restrict__ out, long long n) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long n4 = n / 4;
  const float4* a4 = reinterpret_cast<const float4*>(a);
  const float4* b4 = reinterpret_cast<const float4*>(b);
  float4* out4 = reinterpret_cast<float4*>(out);
  for (long long i = first; i < n4; i += stride) {
    const float4 x = a4[i], y = b4[i];
    out4[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
  }
  for (long long i = n4 * 4 + first; i < n; i += stride) out[i] = a[i] + b[i];
}
"""

# y = alpha * x + y in bf16 storage with fp32 arithmetic, two elements per thread.
BF16_AXPY = r"""
#include <cuda_bf16.h>
extern "C" __global__ void axpy_bf16(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y,
                                     float alpha, long long n) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(x);
  __nv_bfloat162* y2 = reinterpret_cast<__nv_bfloat162*>(y);
  for (long long i = first; i < n / 2; i += stride) {
    const float2 xf = __bfloat1622float2(x2[i]);
    const float2 yf = __bfloat1622float2(y2[i]);
    y2[i] = __floats2bfloat162_rn(fmaf(alpha, xf.x, yf.x), fmaf(alpha, xf.y, yf.y));
  }
  if (first == 0 && (n & 1))
    y[n - 1] = __float2bfloat16(fmaf(alpha, __bfloat162float(x[n - 1]), __bfloat162float(y[n - 1])));
}
"""

# One partial sum per block: grid-stride accumulation, then cub::BlockReduce across the block.
CUB_REDUCE = r"""
#include <cub/block/block_reduce.cuh>
constexpr int kBlock = 256;
extern "C" __global__ void __launch_bounds__(kBlock)
block_sum_f32(const float* __restrict__ in, float* __restrict__ partial, long long n) {
  using BlockReduce = cub::BlockReduce<float, kBlock>;
  __shared__ typename BlockReduce::TempStorage temp;
  float sum = 0.f;
  for (long long i = (long long)blockIdx.x * kBlock + threadIdx.x; i < n; i += (long long)gridDim.x * kBlock)
    sum += in[i];
  const float block_sum = BlockReduce(temp).Sum(sum);
  if (threadIdx.x == 0) partial[blockIdx.x] = block_sum;
}
"""

# C[M,N] = A[M,K] @ B[K,N], row-major fp32; one 32x32 output tile per block of 32x32 threads,
# A and B staged through shared memory one 32-wide K slice at a time.
TILED_GEMM = r"""
#define TILE 32
extern "C" __global__ void __launch_bounds__(TILE * TILE)
sgemm_tiled(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
            int M, int N, int K) {
  __shared__ float As[TILE][TILE];
  __shared__ float Bs[TILE][TILE];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
  float acc = 0.f;
  for (int k0 = 0; k0 < K; k0 += TILE) {
    As[ty][tx] = (row < M && k0 + tx < K) ? A[(long long)row * K + k0 + tx] : 0.f;
    Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(long long)(k0 + ty) * N + col] : 0.f;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < TILE; ++k) acc = fmaf(As[ty][k], Bs[k][tx], acc);
    __syncthreads();
  }
  if (row < M && col < N) C[(long long)row * N + col] = acc;
}
"""

KERNELS: dict[str, tuple[str, str]] = {
    "elementwise": (ELEMENTWISE, "add_f32"),
    "bf16": (BF16_AXPY, "axpy_bf16"),
    "cub_reduce": (CUB_REDUCE, "block_sum_f32"),
    "tiled_gemm": (TILED_GEMM, "sgemm_tiled"),
}

# The load_inline baseline: the same kernel plus the host wrapper load_inline needs.
_LOAD_INLINE_WRAPPER = r"""
#include <torch/extension.h>
torch::Tensor add(torch::Tensor a, torch::Tensor b) {
  auto out = torch::empty_like(a);
  const long long n = a.numel();
  const int block = 256;
  const int grid = (int)std::min<long long>((n / 4 + block - 1) / block + 1, 65535);
  add_f32<<<grid, block>>>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), n);
  return out;
}
"""


def _median(samples: list[float]) -> float:
    return float(statistics.median(samples))


def _unique(source: str) -> str:
    # A fresh comment changes the cache key and NVRTC's input, so nothing compiled before applies.
    return f"// stitchcuda bench {uuid.uuid4().hex}\n{source}"


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter_ns()
    result = fn()
    return (time.perf_counter_ns() - start) / 1e6, result


def _cold_compiles(repeats: int, notes: dict[str, Any]) -> dict[str, float]:
    # NVRTC's first call in a process loads the library and its builtins; keep that out of the
    # first kernel's numbers by compiling something unrelated (no CCCL headers: no PCH is made).
    notes["nvrtc_first_call_ms"] = round(
        _timed(lambda: _C.compile(_unique('extern "C" __global__ void warm() {}'), "warm.cu", {}, False))[0], 3)
    cold: dict[str, float] = {}
    for name, (source, _) in KERNELS.items():
        samples = []
        for _ in range(repeats):
            ms, _module = _timed(lambda: _C.compile(_unique(source), "bench.cu", {}, False))
            samples.append(ms)
        cold[name] = round(_median(samples), 3)
        if name == "cub_reduce":
            # NVRTC keeps a precompiled header for CCCL in-process, so only the first cub compile
            # pays for parsing the headers; later ones (the median) reuse it.
            notes["cub_reduce_first_ms"] = round(samples[0], 3)
        notes.setdefault("compile_cold_samples_ms", {})[name] = [round(s, 3) for s in samples]
    return cold


def _cache_hits(notes: dict[str, Any]) -> tuple[float, float]:
    """(disk hit ms, memory hit µs), measured on a temporary cache folder."""
    previous = _C.cache_dir()
    with tempfile.TemporaryDirectory(prefix="stitchcuda-bench-cache-") as folder:
        _C.set_cache_dir(folder)
        try:
            source = _unique(ELEMENTWISE)
            _C.compile(source, "bench.cu", {}, True)  # the miss that writes the disk entry
            disk = []
            for _ in range(20):
                _C.cache_clear_memory()
                ms, module = _timed(lambda: _C.compile(source, "bench.cu", {}, True))
                if module.origin != "disk":
                    raise RuntimeError(f"expected a disk hit, got origin {module.origin!r}")
                disk.append(ms)
            _C.compile(source, "bench.cu", {}, True)
            memory = []
            for _ in range(MEMORY_HIT_SAMPLES):
                start = time.perf_counter_ns()
                _C.compile(source, "bench.cu", {}, True)
                memory.append((time.perf_counter_ns() - start) / 1e3)
            notes["cache_stats_during_hits"] = dict(_C.cache_stats())
        finally:
            _C.set_cache_dir(previous)
    return round(_median(disk), 4), round(_median(memory), 3)


def _torch_arch(arch: str) -> str:
    """sm_90a -> 9.0a, the spelling TORCH_CUDA_ARCH_LIST uses."""
    digits = arch.split("_", 1)[1]
    suffix = digits[-1] if digits[-1].isalpha() else ""
    digits = digits.rstrip("abcdefghijklmnopqrstuvwxyz")
    return f"{digits[:-1]}.{digits[-1]}{suffix}"


def _load_inline_seconds(notes: dict[str, Any]) -> float | None:
    if settings().bench_skip_load_inline:
        notes["load_inline"] = f"skipped: {SKIP_LOAD_INLINE_ENV} is set"
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        notes["load_inline"] = f"skipped: nvcc not found under {cuda_home()} or on PATH"
        return None
    saved = {k: os.environ.get(k) for k in ("TORCH_CUDA_ARCH_LIST", "PATH", "CUDA_HOME")}
    try:
        # Same target as the NVRTC numbers, or torch would build for every architecture it knows.
        if not saved["TORCH_CUDA_ARCH_LIST"]:
            os.environ["TORCH_CUDA_ARCH_LIST"] = _torch_arch(_C.default_arch())
        os.environ.setdefault("CUDA_HOME", os.path.dirname(os.path.dirname(nvcc)))
        # torch runs `ninja` from PATH; the venv's ninja sits beside the interpreter.
        if shutil.which("ninja") is None:
            os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        from torch.utils.cpp_extension import load_inline

        with tempfile.TemporaryDirectory(prefix="stitchcuda-bench-load-inline-") as build:
            start = time.perf_counter()
            load_inline(name=f"stitchcuda_bench_add_{uuid.uuid4().hex[:12]}",
                        cpp_sources="torch::Tensor add(torch::Tensor a, torch::Tensor b);",
                        cuda_sources=ELEMENTWISE + _LOAD_INLINE_WRAPPER, functions=["add"],
                        build_directory=build, verbose=False)
            seconds = time.perf_counter() - start
        notes["load_inline"] = (f"nvcc {nvcc}, TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}, "
                                "fresh build folder")
        return round(seconds, 3)
    except Exception as exc:  # the baseline is optional; its failure is reported, not fatal
        notes["load_inline"] = f"failed: {type(exc).__name__}: {str(exc).strip()[-2000:]}"
        return None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launch_overhead(notes: dict[str, Any]) -> dict[str, float] | None:
    if _C.device_count() == 0:
        ok, reason = _C.driver_available()
        notes["launch_us"] = "skipped: no GPU" + ("" if ok else f" ({reason})")
        return None
    import torch

    from ..jit import compile as jit_compile
    from ..verify.compare import first_difference
    from ..verify.tolerance import tolerance

    kernel = jit_compile(ELEMENTWISE, "add_f32")
    a = torch.randn(1024, device="cuda")
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    n, grid, block = a.numel(), 1, 256
    for _ in range(100):  # warm: module load, first-launch setup
        kernel(grid, block, a, b, out, n)
    torch.cuda.synchronize()
    if first_difference("out", out, a + b, *tolerance(out.dtype)) is not None:
        raise RuntimeError("the benchmark kernel computed a wrong result")
    samples = []
    clock = time.perf_counter_ns
    for i in range(LAUNCHES):
        # Drain the queue every BATCH launches (untimed): a full queue makes a launch wait for the
        # GPU, and the number would then be kernel time rather than host overhead.
        if i % BATCH == 0:
            torch.cuda.synchronize()
        start = clock()
        kernel(grid, block, a, b, out, n)
        samples.append(clock() - start)
    torch.cuda.synchronize()
    python_us = _median(samples) / 1e3
    # "cpp": a launch prepared once and enqueued many times (what a C++ server replaying a program
    # pays); "cpp_checked": Kernel::launch, which validates every call.
    cpp_us = _C.bench_launch_us(kernel._native, grid, block, [a, b, out, n], LAUNCHES, prepared=True)
    cpp_checked_us = _C.bench_launch_us(kernel._native, grid, block, [a, b, out, n], LAUNCHES)
    torch.cuda.synchronize()
    if first_difference("out", out, a + b, *tolerance(out.dtype)) is not None:
        raise RuntimeError("the benchmark kernel computed a wrong result in the C++ launch loop")
    notes["launch"] = (f"{LAUNCHES} launches of add_f32 on {n} floats, grid {grid}, block {block}; "
                       f"queue drained every {BATCH} launches (untimed)")
    return {"python": round(python_us, 3), "cpp": round(float(cpp_us), 3),
            "cpp_checked": round(float(cpp_checked_us), 3)}


def run(repeats: int = 5) -> dict[str, Any]:
    """Runs the benchmark; the result is the JSON object `stitchcuda bench jit --json` prints."""
    if repeats < 5:
        raise ValueError("repeats must be at least 5 (cold compile times are medians)")
    notes: dict[str, Any] = {"arch": _C.default_arch(), "nvrtc": _C.nvrtc_version(), "repeats": repeats}
    if _C.device_count() > 0:
        notes["device"] = _C.device_info(0)["name"]
    cold = _cold_compiles(repeats, notes)
    disk_hit_ms, memory_hit_us = _cache_hits(notes)
    load_inline_s = _load_inline_seconds(notes)
    launch_us = _launch_overhead(notes)
    return {
        "compile_cold_ms": cold,
        "disk_hit_ms": disk_hit_ms,
        "memory_hit_us": memory_hit_us,
        "load_inline_s": load_inline_s,
        "launch_us": launch_us,
        "ratio_vs_load_inline": (round(load_inline_s * 1000 / cold["elementwise"], 1)
                                 if load_inline_s is not None else None),
        "notes": notes,
    }


def format_result(result: dict[str, Any]) -> str:
    """A readable table of run()'s result."""
    rows = [(f"cold compile {name}", f"{ms:.1f} ms") for name, ms in result["compile_cold_ms"].items()]
    notes = result["notes"]
    if "cub_reduce_first_ms" in notes:
        rows.append(("  cub_reduce first in process", f"{notes['cub_reduce_first_ms']:.1f} ms"))
    rows += [("disk cache hit", f"{result['disk_hit_ms']:.3f} ms"),
             ("memory cache hit", f"{result['memory_hit_us']:.1f} µs")]
    if result["load_inline_s"] is None:
        rows.append(("load_inline (nvcc)", f"n/a — {notes.get('load_inline', '')}"))
    else:
        rows.append(("load_inline (nvcc)", f"{result['load_inline_s']:.2f} s"))
        rows.append(("  NVRTC speed-up", f"{result['ratio_vs_load_inline']:.0f}x"))
    if result["launch_us"] is None:
        rows.append(("launch overhead", f"n/a — {notes.get('launch_us', '')}"))
    else:
        rows.append(("launch overhead, Python", f"{result['launch_us']['python']:.2f} µs"))
        rows.append(("launch overhead, C++", f"{result['launch_us']['cpp']:.2f} µs"))
    width = max(len(label) for label, _ in rows)
    header = f"stitchcuda bench jit — {notes['arch']}, NVRTC {notes['nvrtc']}, median of {notes['repeats']}"
    return "\n".join([header] + [f"  {label:<{width}}  {value}" for label, value in rows])
