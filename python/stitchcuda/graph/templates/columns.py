"""Reductions over a block of middle dimensions: coalesced columns, warps splitting the reduced extent."""

from __future__ import annotations

import torch

from .common import CTYPE, PRELUDE, Extent, KernelCode, RowPrologue


def _column_inputs(name: str, dtype: torch.dtype, prologue: RowPrologue | None):
    """(the element load X(idx), the kernel's input parameters, its input arguments): x itself, or the
    prologue's inputs with its value function computing x on load."""
    if prologue is None:
        return (lambda idx: f"ld(x, {idx})"), [f"const {CTYPE[dtype]}* __restrict__ x"], [("in", "x")]
    return ((lambda idx: f"{name}_x({idx}{prologue.pointers()})"), prologue.params(),
            [("in", i.key) for i in prologue.inputs])


def _column_code(name: str, lines: list[str], outer: int, inner: int, args: list, description: str,
                 extent: Extent | None = None) -> KernelCode:
    """The kernel of a column reduction: a block per 32 columns of one outer index, 8 warps."""
    return KernelCode("\n".join(lines) + "\n", name, (-(-inner // 32), outer, 1), (32, 8, 1), [*args, ("out", "y")],
                      description, extent=extent)


def column_extent(outer: int, reduce: int, inner: int, prologue: RowPrologue | None = None) -> Extent | None:
    """The outer extent as the grid's second dimension (up to 65,535): the source holds only the reduced and
    inner extents. A prologue's coordinates are 32-bit while its elements number below 2^31, which bounds
    the outer extent; an outer extent of 1 leaves its coordinate out of the prologue's indices (None)."""
    limit = 65535
    if prologue is not None:
        if outer <= 1:
            return None
        if outer * reduce * inner < 2 ** 31:
            limit = min(limit, (2 ** 31 - 1) // (reduce * inner))
    return Extent(outer, None, axis=1, limit=limit)


def column_reduction_kernel(name: str, kind: str, outer: int, reduce: int, inner: int, dtype: torch.dtype,
                            out_dtype: torch.dtype | None = None, prologue: RowPrologue | None = None) -> KernelCode:
    """sum/mean/amax/amin over the middle extent of a contiguous [outer, reduce, inner] tensor (a sum over
    an NCHW tensor's channels, a mean over a sequence): y is [outer, inner]. A block covers 32 columns of
    one outer index; its 32 lanes read consecutive columns (coalesced), its 8 warps split the reduced
    extent, and a shared-memory combine of the 8 partials finishes. Arguments: x (or the prologue's
    inputs), y."""
    if kind in ("argmax", "argmin"):
        return _column_arg_kernel(name, kind, outer, reduce, inner, dtype, prologue)
    if kind not in ("sum", "mean", "amax", "amin"):
        raise ValueError(f"a column reduction is sum, mean, amax, amin, argmax or argmin, not '{kind}'")
    out_dtype = out_dtype or dtype
    init = {"sum": "0.0f", "mean": "0.0f", "amax": "-__int_as_float(0x7f800000)",
            "amin": "__int_as_float(0x7f800000)"}[kind]
    step = {"sum": "a += v", "mean": "a += v", "amax": "a = nanmax(a, v)", "amin": "a = nanmin(a, v)"}[kind]
    combine = {"sum": "a += p", "mean": "a += p", "amax": "a = nanmax(a, p)", "amin": "a = nanmin(a, p)"}[kind]
    X, params, args = _column_inputs(name, dtype, prologue)
    params.append(f"{CTYPE[out_dtype]}* __restrict__ y")
    final = f"a / {reduce}.0f" if kind == "mean" else "a"
    L = [PRELUDE, *(prologue.value_function(name) if prologue else []),
         f"// {name}: {kind} over the middle extent {reduce} of [N, {reduce}, {inner}]"
         + (f", {len(prologue.body)} elementwise op(s) fused into the loads" if prologue else ""),
         f'extern "C" __global__ void __launch_bounds__(256) {name}({", ".join(params)}) {{',
         "  __shared__ float sh[8][33];",
         "  const long long col = (long long)blockIdx.x * 32 + threadIdx.x;",
         "  const long long o = blockIdx.y;",
         f"  float a = {init};",
         f"  if (col < {inner}LL) {{",
         "#pragma unroll 4",
         f"    for (long long r = threadIdx.y; r < {reduce}LL; r += 8) {{",
         f"      const float v = {X(f'(o * {reduce}LL + r) * {inner}LL + col')};",
         f"      {step};",
         "    }",
         "  }",
         "  sh[threadIdx.y][threadIdx.x] = a;",
         "  __syncthreads();",
         f"  if (threadIdx.y == 0 && col < {inner}LL) {{",
         "    for (int k = 1; k < 8; ++k) {",
         "      const float p = sh[k][threadIdx.x];",
         f"      {combine};",
         "    }",
         f"    st(y, o * {inner}LL + col, {final});",
         "  }",
         "}"]
    return _column_code(name, L, outer, inner, args,
                        f"{kind} over the middle extent {reduce} of [{outer}, {reduce}, {inner}]: 32 coalesced columns "
                        "per block, 8 warps splitting the extent, shared-memory combine"
                        + (f", {len(prologue.body)} elementwise op(s) fused into the loads" if prologue else ""),
                        column_extent(outer, reduce, inner, prologue))


def _column_arg_kernel(name: str, kind: str, outer: int, reduce: int, inner: int, dtype: torch.dtype,
                       prologue: RowPrologue | None = None) -> KernelCode:
    """argmax/argmin over the middle extent of a contiguous [outer, reduce, inner] tensor (a segmentation
    map's class per pixel), with torch's answer: the first index of the extreme value, a NaN counting as
    the extreme (its first index). The column reduction's geometry; each thread keeps (value, index) over
    increasing indices, and the 8 warps' pairs are combined in shared memory. y: int64 [outer, inner]."""
    better = ">" if kind == "argmax" else "<"
    if prologue is None and dtype == torch.float32 and inner % 4 == 0 and inner >= 128:
        return _column_arg_kernel_4(name, kind, better, outer, reduce, inner)
    X, params, args = _column_inputs(name, dtype, prologue)
    params.append("long long* __restrict__ y")
    L = [PRELUDE, *(prologue.value_function(name) if prologue else []),
         f"// {name}: {kind} over the middle extent {reduce} of [N, {reduce}, {inner}]"
         + (f", {len(prologue.body)} elementwise op(s) fused into the loads" if prologue else ""),
         *_first_function(better),
         f'extern "C" __global__ void __launch_bounds__(256) {name}({", ".join(params)}) {{',
         "  __shared__ float shv[8][33];",
         "  __shared__ long long shi[8][33];",
         "  const long long col = (long long)blockIdx.x * 32 + threadIdx.x;",
         "  const long long o = blockIdx.y;",
         "  float a = 0.0f;",
         "  long long ai = -1;",
         f"  if (col < {inner}LL) {{",
         "#pragma unroll 4",
         f"    for (long long r = threadIdx.y; r < {reduce}LL; r += 8) {{",
         f"      const float v = {X(f'(o * {reduce}LL + r) * {inner}LL + col')};",
         "      if (first(v, r, a, ai)) { a = v; ai = r; }",
         "    }",
         "  }",
         "  shv[threadIdx.y][threadIdx.x] = a;",
         "  shi[threadIdx.y][threadIdx.x] = ai;",
         "  __syncthreads();",
         f"  if (threadIdx.y == 0 && col < {inner}LL) {{",
         "    for (int k = 1; k < 8; ++k)",
         "      if (shi[k][threadIdx.x] >= 0 && first(shv[k][threadIdx.x], shi[k][threadIdx.x], a, ai)) {",
         "        a = shv[k][threadIdx.x];",
         "        ai = shi[k][threadIdx.x];",
         "      }",
         f"    y[o * {inner}LL + col] = ai;",
         "  }",
         "}"]
    return _column_code(name, L, outer, inner, args,
                        f"{kind} over the middle extent {reduce} of [{outer}, {reduce}, {inner}]: 32 coalesced columns "
                        "per block, 8 warps splitting the extent, (value, index) pairs combined in shared memory, "
                        "torch's first-index and NaN rules"
                        + (f", {len(prologue.body)} elementwise op(s) fused into the loads" if prologue else ""),
                        column_extent(outer, reduce, inner, prologue))


def _first_function(better: str) -> list[str]:
    """torch's order for argmax/argmin: whether (v, i) comes before (a, ai)."""
    return ["// Whether (v, i) comes before (a, ai) in torch's order: a NaN first, then the extreme value, then the",
            "// smaller index; ai < 0 is no value yet.",
            "__device__ __forceinline__ bool first(float v, long long i, float a, long long ai) {",
            "  if (ai < 0) return true;",
            "  if (v != v) return a == a || i < ai;",
            "  if (a != a) return false;",
            f"  return v {better} a || (v == a && i < ai);",
            "}"]


def _column_arg_kernel_4(name: str, kind: str, better: str, outer: int, reduce: int, inner: int) -> KernelCode:
    """The fp32 argmax/argmin over the middle extent with four columns per thread: 16-byte loads (512 bytes
    per warp instruction instead of 128, four times the bytes in flight for the same loop), a block per 128
    columns, 8 warps splitting the extent, then 128 threads combining the 8 warps' pairs of a column each.
    A misaligned x (a view at an odd offset) takes four scalar loads instead (inner % 4 == 0, so every
    row start shares x's alignment)."""
    L = [PRELUDE, f"// {name}: {kind} over the middle extent {reduce} of [N, {reduce}, {inner}], 4 columns per thread",
         *_first_function(better),
         f'extern "C" __global__ void __launch_bounds__(256) {name}(const float* __restrict__ x, '
         "long long* __restrict__ y) {",
         "  __shared__ float shv[8][132];",
         "  __shared__ long long shi[8][132];",
         "  const long long col0 = (long long)blockIdx.x * 128 + threadIdx.x * 4;",
         "  const long long o = blockIdx.y;",
         "  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};",
         "  long long ai[4] = {-1, -1, -1, -1};",
         f"  if (col0 < {inner}LL) {{  // inner % 4 == 0: all four columns exist",
         f"    const float* p = x + (o * {reduce}LL + threadIdx.y) * {inner}LL + col0;",
         "    if ((reinterpret_cast<unsigned long long>(x) & 15) == 0) {",
         "#pragma unroll 4",
         f"      for (long long r = threadIdx.y; r < {reduce}LL; r += 8, p += 8 * {inner}LL) {{",
         "        const float4 v = *reinterpret_cast<const float4*>(p);",
         "        if (first(v.x, r, a[0], ai[0])) { a[0] = v.x; ai[0] = r; }",
         "        if (first(v.y, r, a[1], ai[1])) { a[1] = v.y; ai[1] = r; }",
         "        if (first(v.z, r, a[2], ai[2])) { a[2] = v.z; ai[2] = r; }",
         "        if (first(v.w, r, a[3], ai[3])) { a[3] = v.w; ai[3] = r; }",
         "      }",
         "    } else {",
         f"      for (long long r = threadIdx.y; r < {reduce}LL; r += 8, p += 8 * {inner}LL) {{",
         "#pragma unroll",
         "        for (int j = 0; j < 4; ++j) {",
         "          const float v = p[j];",
         "          if (first(v, r, a[j], ai[j])) { a[j] = v; ai[j] = r; }",
         "        }",
         "      }",
         "    }",
         "  }",
         "#pragma unroll",
         "  for (int j = 0; j < 4; ++j) {",
         "    shv[threadIdx.y][threadIdx.x * 4 + j] = a[j];",
         "    shi[threadIdx.y][threadIdx.x * 4 + j] = ai[j];",
         "  }",
         "  __syncthreads();",
         "  const int t = threadIdx.y * 32 + threadIdx.x;  // one column per thread of the first 128",
         "  const long long col = (long long)blockIdx.x * 128 + t;",
         f"  if (t < 128 && col < {inner}LL) {{",
         "    float b = shv[0][t];",
         "    long long bi = shi[0][t];",
         "    for (int k = 1; k < 8; ++k)",
         "      if (shi[k][t] >= 0 && first(shv[k][t], shi[k][t], b, bi)) {",
         "        b = shv[k][t];",
         "        bi = shi[k][t];",
         "      }",
         f"    y[o * {inner}LL + col] = bi;",
         "  }",
         "}"]
    return KernelCode("\n".join(L) + "\n", name, (-(-inner // 128), outer, 1), (32, 8, 1), [("in", "x"), ("out", "y")],
                      extent=column_extent(outer, reduce, inner), description=
                      f"{kind} over the middle extent {reduce} of [{outer}, {reduce}, {inner}]: 4 columns per thread "
                      "(16-byte loads; scalar when x is misaligned), 128 columns per block, 8 warps splitting the "
                      "extent, (value, index) pairs combined in shared memory, torch's first-index and NaN rules")
