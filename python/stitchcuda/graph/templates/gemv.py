"""Decode-shaped matrix products (a few rows of x times nn.Linear weights) as one generated GEMV kernel that reads
several sibling weights sharing x (a transformer's q, k and v; an MLP's gate and up) and can apply SiLU(gate) * up
before its store (graph/projections.py merges such GEMM groups into one "gemv" group).

Why a kernel of our own. At M = 1..16 rows a projection is a pass over its weight: its time is its bytes. A
Llama decode step per layer reads (bf16, H100 at 3.35 TB/s; bytes = weight + x + y, the floor bytes / 3.35 TB/s):

    Llama-1.1B (hidden 2048, intermediate 5632, 32 heads, 4 KV heads, head dim 64), 22 layers:
      q,k,v merged   [2560 x 2048]   10.49 MB   3.13 us at M = 1   (3.15 us at M = 8, 3.17 us at M = 16)
      o              [2048 x 2048]    8.40 MB   2.51 us            (2.52, 2.54)
      gate,up merged [11264 x 2048]  46.16 MB  13.78 us            (13.84, 13.90)
      down           [2048 x 5632]   23.08 MB   6.89 us            (6.92, 6.96)
      a layer 88.1 MB, 22 layers 1.94 GB, lm_head [32000 x 2048] 131 MB: a step's floor 0.62 ms.
    Llama-3-8B (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, head dim 128), 32 layers:
      q,k,v merged   [6144 x 4096]   50.35 MB  15.03 us at M = 1   (15.07, 15.12)
      o              [4096 x 4096]   33.57 MB  10.02 us            (10.06, 10.09)
      gate,up merged [28672 x 4096] 234.95 MB  70.13 us            (70.27, 70.43)
      down           [4096 x 14336] 117.48 MB  35.07 us            (35.14, 35.23)
      a layer 436 MB, 32 layers 13.96 GB, lm_head [128256 x 4096] 1.05 GB: a step's floor 4.48 ms.

At 1.1B a layer's floor is about 26 us against 7 launches of these products alone (q, k, v, o, gate, up and the
SiLU * up kernel beside down) at 1-3 us each inside a CUDA graph: the launches are a large share. Merging q, k, v
into one launch and gate, up and SiLU * up into another takes 4 launches a layer away; x rows being read once
per block from shared memory instead of once per weight changes little (x is 4 KB against megabytes of weight).

The kernel: one warp per output column (a row of each weight it reads: two, gate and up, with the SiLU
epilogue), x's rows staged in shared memory as fp32 (a K tile at a time where M x K floats pass 48 KB), each
lane reading the weight row eight elements (16 bytes at 16-bit) at a time, fp32 accumulation, one warp-shuffle
sum per row of x, bias and residual added and SiLU(gate) * up applied in fp32 before the one rounding at the
store. Split-K is not written: every Llama shape above has 2,048 columns or more, 256 blocks of 8 warps (and
the block drops to 4 warps where fewer than two blocks an SM would start), which fills 132 SMs twice.
"""

from __future__ import annotations

import torch

from ...errors import InvalidArgumentError
from .common import CTYPE, PRELUDE, VECTOR8_IO, KernelCode

__all__ = ["GEMV_MAX_ROWS", "GEMV_MAX_WEIGHTS", "gemv_kernel"]

GEMV_MAX_ROWS = 16  # rows of x (tokens x batch) up to which a product is a pass over its weight
GEMV_MAX_WEIGHTS = 3  # weights one kernel reads (q, k and v)
EPILOGUES = ("none", "silu_mul")
_SHARED_FLOATS = 12288  # x's staged tile: 48 KB of fp32, the static shared memory a block may declare
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tile(rows: int, k: int) -> int:
    """The K extent of x staged at once: all of K where rows x K floats fit, else a multiple of 256 (a warp's
    eight-wide pass) that does."""
    if rows * k <= _SHARED_FLOATS:
        return k
    return max(256, (_SHARED_FLOATS // rows) // 256 * 256)


def gemv_kernel(name: str, *, rows: int, k: int, columns: list[int], dtype: torch.dtype,
                bias: list[bool] | None = None, epilogue: str = "none", residual: list[bool] | None = None,
                sms: int = 132) -> KernelCode:
    """y_j = x @ W_j^T (+ b_j) (+ r_j) for the weights W_j [columns[j], k] (row-major, as nn.Linear holds them)
    sharing x [rows, k]; with `epilogue="silu_mul"`, two weights (gate, up) of equal columns and one output
    silu(x @ gate^T + b_0) * (x @ up^T + b_1) (+ r_0). Arguments: x, w0.., the biases present (b{j}), the
    residuals present (r{o}), the outputs y{o} [rows, columns] contiguous; every tensor contiguous, of `dtype`."""
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(f"gemv_kernel: dtype {dtype} is not fp32, fp16 or bf16")
    if not 1 <= rows <= GEMV_MAX_ROWS:
        raise InvalidArgumentError(f"gemv_kernel: {rows} rows of x; the kernel takes 1 to {GEMV_MAX_ROWS} (a larger M is a GEMM)")
    if not 1 <= len(columns) <= GEMV_MAX_WEIGHTS or min(columns) < 1 or k < 1:
        raise InvalidArgumentError(f"gemv_kernel: columns {columns} and k {k}: 1 to {GEMV_MAX_WEIGHTS} weights of at least "
                         "one row and one column each")
    if epilogue not in EPILOGUES:
        raise InvalidArgumentError(f"gemv_kernel: epilogue {epilogue!r} is not one of {EPILOGUES}")
    silu = epilogue == "silu_mul"
    if silu and (len(columns) != 2 or columns[0] != columns[1]):
        raise InvalidArgumentError(f"gemv_kernel: silu_mul takes two weights (gate, up) of equal rows, not {columns}")
    bias = list(bias) if bias is not None else [False] * len(columns)
    outputs = 1 if silu else len(columns)
    residual = list(residual) if residual is not None else [False] * outputs
    if len(bias) != len(columns) or len(residual) != outputs:
        raise InvalidArgumentError(f"gemv_kernel: {len(bias)} bias flags for {len(columns)} weights, {len(residual)} "
                         f"residual flags for {outputs} outputs")
    t = CTYPE[dtype]
    vector = k % 8 == 0  # every weight row starts 16-byte aligned and splits into whole groups of eight
    tile = _tile(rows, k)
    # One warp a column: a column is one row of each weight (gate and up together with silu_mul).
    total = columns[0] if silu else sum(columns)
    warps = 8 if -(-total // 8) >= 2 * sms else 4
    threads = 32 * warps
    blocks = -(-total // warps)

    params = [f"const {t}* __restrict__ x"] + [f"const {t}* __restrict__ w{j}" for j in range(len(columns))]
    params += [f"const {t}* __restrict__ b{j}" for j in range(len(columns)) if bias[j]]
    params += [f"const {t}* __restrict__ r{o}" for o in range(outputs) if residual[o]]
    params += [f"{t}* __restrict__ y{o}" for o in range(outputs)]
    args = [("in", "x")] + [("in", f"w{j}") for j in range(len(columns))]
    args += [("in", f"b{j}") for j in range(len(columns)) if bias[j]]
    args += [("in", f"r{o}") for o in range(outputs) if residual[o]]
    args += [("out", f"y{o}") for o in range(outputs)]

    # Which weight the warp's column falls in (warp-uniform): its row n there, its pointers, output and width.
    def pointer(prefix: str, j: int, present: list[bool]) -> str:
        return f"{prefix}{j}" if present[j] else "nullptr"

    if silu:
        select = [f"  const int n = col, ncols = {columns[0]};",
                  f"  const {t}* wa = w0; const {t}* wb = w1; {t}* y = y0;",
                  f"  const {t}* ba = {pointer('b', 0, bias)}; const {t}* bb = {pointer('b', 1, bias)};",
                  f"  const {t}* r = {pointer('r', 0, residual)};"]
    else:
        select = [f"  int n = col, ncols = {columns[0]}; const {t}* wa = w0; {t}* y = y0;",
                  f"  const {t}* ba = {pointer('b', 0, bias)}; const {t}* r = {pointer('r', 0, residual)};"]
        start = columns[0]
        for j in range(1, len(columns)):
            select.append(f"  if (col >= {start}) {{ n = col - {start}; ncols = {columns[j]}; wa = w{j}; y = y{j}; "
                          f"ba = {pointer('b', j, bias)}; r = {pointer('r', j, residual)}; }}")
            start += columns[j]
    accs = ["acc_a"] + (["acc_b"] if silu else [])
    decl = " ".join(f"float {a}[{rows}];" for a in accs)
    zero = " ".join(f"{a}[m] = 0.0f;" for a in accs)
    if vector:
        fma = []
        for a, w in zip(accs, ("ua", "ub")):
            fma.append(f"        {a}[m] += {w}[0] * p.x + {w}[1] * p.y + {w}[2] * p.z + {w}[3] * p.w"
                       f" + {w}[4] * q.x + {w}[5] * q.y + {w}[6] * q.z + {w}[7] * q.w;")
        loads = ["      float ua[8]; load8(ra, kg + g, ua);"]
        if silu:
            loads.append("      float ub[8]; load8(rb, kg + g, ub);")
        inner = [
            "    // Each lane a group of eight of K a pass (one 16-byte load of a 16-bit weight row), x's rows from",
            "    // shared memory as two float4.",
            "    const int kg = k0 >> 3, groups = kt >> 3;",
            "#pragma unroll 4",
            "    for (int g = lane; g < groups; g += 32) {",
            *loads,
            "#pragma unroll",
            f"      for (int m = 0; m < {rows}; ++m) {{",
            f"        const float4 p = xs4[m * ({tile} / 4) + 2 * g], q = xs4[m * ({tile} / 4) + 2 * g + 1];",
            *fma,
            "      }",
            "    }",
        ]
    else:
        fma = [f"        {a}[m] += {w} * xs[m * {tile} + c];" for a, w in zip(accs, ("ua", "ub"))]
        loads = ["      const float ua = ld(ra, k0 + c);"] + (["      const float ub = ld(rb, k0 + c);"] if silu else [])
        inner = [
            "    // K is no multiple of eight: weight rows are not 16-byte aligned; a lane takes every 32nd element.",
            "    for (int c = lane; c < kt; c += 32) {",
            *loads,
            "#pragma unroll",
            f"      for (int m = 0; m < {rows}; ++m) {{",
            *fma,
            "      }",
            "    }",
        ]
    if silu:
        result = ("      const float g = acc_a[m] + (ba != nullptr ? ld(ba, n) : 0.0f),"
                  " u = acc_b[m] + (bb != nullptr ? ld(bb, n) : 0.0f);\n"
                  "      float v = g / (1.0f + expf(-g)) * u;")
    else:
        result = "      float v = acc_a[m] + (ba != nullptr ? ld(ba, n) : 0.0f);"
    reduce_b = "      acc_b[m] = warp_sum(acc_b[m]);\n" if silu else ""
    rb = f"  const {t}* rb = wb + (long long)n * {k};\n" if silu else ""
    source = f"""{PRELUDE}{VECTOR8_IO if vector else ""}
__device__ __forceinline__ float warp_sum(float v) {{
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}}
// {rows} row(s) of x [{rows}, {k}] times {"gate and up" if silu else f"{len(columns)} weight(s)"} {columns} x {k}
// ({epilogue}); one warp a column, {warps} warps a block, x staged {tile} columns at a time.
extern "C" __global__ void __launch_bounds__({threads}) {name}({", ".join(params)}) {{
  __shared__ float4 xs4[{-(-rows * tile // 4)}];  // float4: 16-byte aligned for the vector reads
  float* xs = reinterpret_cast<float*>(xs4);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int col = blockIdx.x * {warps} + warp;
  const bool active = col < {total};
{chr(10).join(select)}
  const {t}* ra = wa + (long long)n * {k};
{rb}  {decl}
#pragma unroll
  for (int m = 0; m < {rows}; ++m) {{ {zero} }}
  for (int k0 = 0; k0 < {k}; k0 += {tile}) {{
    const int kt = {k} - k0 < {tile} ? {k} - k0 : {tile};
    if (k0 > 0) __syncthreads();  // every warp done with the last tile
    for (int i = threadIdx.x; i < {rows * tile}; i += {threads}) {{
      const int m = i / {tile}, c = i - m * {tile};
      xs[i] = c < kt ? ld(x, (long long)m * {k} + k0 + c) : 0.0f;
    }}
    __syncthreads();
    if (!active) continue;
{chr(10).join(inner)}
  }}
  if (!active) return;
#pragma unroll
  for (int m = 0; m < {rows}; ++m) {{
    acc_a[m] = warp_sum(acc_a[m]);
{reduce_b}    if (lane == m) {{
{result}
      if (r != nullptr) v += ld(r, (long long)m * ncols + n);
      st(y, (long long)m * ncols + n, v);
    }}
  }}
}}
"""
    what = "SiLU(gate) * up" if silu else f"{len(columns)} weight(s)"
    return KernelCode(source, name, blocks, threads, args,
                      description=f"GEMV of {rows} row(s) x {k} against {what} ({columns} rows), {warps} warps a "
                                  f"block, one a column, {'16-byte' if vector else 'scalar'} weight loads",
                      vectorized=vector)
