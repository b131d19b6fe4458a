"""Row reductions over trailing contiguous dimensions: a warp or a block per row, rows held in registers
where they fit, with prologues, epilogues and output functions fused around the reduction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .common import (CTYPE, HALF_DTYPES, PRELUDE, VECTOR_IO, VECTOR_IO_16, Extent, KernelCode, RowPrologue, element_index,
                     split_coordinates)
from .ops import float_literal

# ---- row reductions ----

REDUCTIONS = ("softmax", "log_softmax", "layer_norm", "group_norm", "sum", "mean", "amax", "amin", "sum_exp")
NORMALIZING = ("softmax", "log_softmax", "layer_norm", "group_norm")  # write a row of the input's shape
STATISTICS = ("sum", "mean", "amax", "amin", "sum_exp")                # write one value per row

_ROW_PRELUDE = r"""
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = nanmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_min(float v) {
  for (int o = 16; o > 0; o >>= 1) v = nanmin(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Combines (max, sum of exp(x - max)) pairs: the online-softmax state.
// An empty side (max -inf) gets exponent -inf, so its term is exp(-inf) = 0 with no branch: skipping the
// exponential behind a condition put each loop iteration's load in its own basic block.
__device__ __forceinline__ void softmax_combine(float& m, float& s, float m2, float s2) {
  const float inf = __int_as_float(0x7f800000);
  const float mm = nanmax(m, m2);
  const float da = m == -inf ? -inf : m - mm, db = m2 == -inf ? -inf : m2 - mm;
  m = mm; s = s * expf(da) + s2 * expf(db);
}
__device__ __forceinline__ void warp_softmax(float& m, float& s) {
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    softmax_combine(m, s, m2, s2);
  }
}
// Chan et al.'s combination of (count, mean, M2) Welford states.
__device__ __forceinline__ void welford_combine(float& n, float& mean, float& m2, float nb, float meanb, float m2b) {
  const float nn = n + nb;
  if (nn == 0.0f) return;
  const float delta = meanb - mean;
  mean += delta * (nb / nn);
  m2 += m2b + delta * delta * (n * nb / nn);
  n = nn;
}
__device__ __forceinline__ void warp_welford(float& n, float& mean, float& m2) {
  for (int o = 16; o > 0; o >>= 1) {
    const float nb = __shfl_xor_sync(0xffffffffu, n, o), mb = __shfl_xor_sync(0xffffffffu, mean, o),
                qb = __shfl_xor_sync(0xffffffffu, m2, o);
    welford_combine(n, mean, m2, nb, mb, qb);
  }
}
"""



def row_reduction_kernel(name: str, kind: str, rows: int, cols: int, dtype: torch.dtype,
                         out_dtype: torch.dtype | None = None, eps: float = 1e-5, has_weight: bool = False,
                         has_bias: bool = False, sm_count: int = 132,
                         prologue: RowPrologue | None = None, epilogue: RowPrologue | None = None,
                         output: RowPrologue | None = None, groups: int = 0, group_hw: int = 0,
                         same_row: dict[str, str] | None = None,
                         also: tuple[tuple[str, torch.dtype], ...] = (),
                         keep_input: torch.dtype | None = None) -> KernelCode:
    """A kernel reducing each of `rows` contiguous rows of `cols` elements.

    softmax/log_softmax/layer_norm write a row of the same size; sum/mean/amax/amin write one value, and
    so does sum_exp: sum(exp(x - max(x))) from one online pass, its output function reading the max (`mx`)
    too — a hand-written log-sum-exp in one read of the row.
    Arguments: x, [weight], [bias], [epilogue inputs], y, rows, cols — with a `prologue`, its inputs
    (in0..) instead of x: the reduction input is computed on load and never stored. An `epilogue`
    (sum/mean/amax/amin only) maps the row's statistic (`stat`) and its own inputs, element by element,
    to a y of the row's shape: an RMS norm's scaling, without storing the statistic. An `output` maps
    each result (`yv`) and its own inputs to the value stored: a SiLU after a group norm, the log of a
    sum (its inputs then indexed like the statistic). group_norm rows are (sample, group) pairs of
    cols = channels per group x `group_hw` elements, its weight and bias indexed by channel (`groups`).
    `same_row` names the epilogue inputs that read the elements the reduction read — epilogue key to "x"
    (the reduction input) or to a prologue input's key (an RMS norm's x, read by the square and by the
    scaling): where the row is held in registers they come from there instead of a second read.
    `also` lists more values of the epilogue's body, (C variable, dtype), each stored to its own output
    (y1, y2, .. after y): the residual sum an RMS norm's prologue adds, which the rest of the model reads,
    computed again from the row and written by the same kernel instead of by a kernel of its own.
    `keep_input` (a dtype) stores the reduction input the prologue computes to output `xs` as it is
    loaded: a residual sum that a layer norm reads and the rest of the model reads too.
    """
    if kind not in REDUCTIONS:
        raise ValueError(f"unknown reduction '{kind}'")
    if epilogue is not None and (kind not in ("sum", "mean", "amax", "amin") or epilogue.extra != ("stat",)):
        raise ValueError(f"an epilogue applies to sum/mean/amax/amin and reads 'stat', not {kind}/{epilogue.extra}")
    if also and epilogue is None:
        raise ValueError("more stored values (`also`) come from an epilogue's body: give the epilogue")
    if keep_input is not None and prologue is None:
        raise ValueError("keep_input stores what a prologue computes: give the prologue")
    extras = ("yv", "mx") if kind == "sum_exp" else ("yv",)
    if output is not None and (output.extra != extras or epilogue is not None):
        raise ValueError(f"an output function of {kind} reads {extras} and excludes an epilogue, got {output.extra}")
    if kind == "group_norm" and (groups <= 0 or group_hw <= 0 or cols % group_hw):
        raise ValueError(f"group_norm needs groups > 0 and a group_hw dividing cols, got {groups}, {group_hw}, {cols}")
    out_dtype = out_dtype or dtype
    if (dtype == torch.float32 and cols % 4 == 0 and CACHED_ROW_MIN <= cols <= SHARED_ROW_MAX
            and ((kind in NORMALIZING and out_dtype == torch.float32) or (kind in STATISTICS and epilogue is None)
                 or (epilogue is not None and out_dtype == torch.float32))):
        return _cached_row_kernel(name, kind, rows, cols, eps, has_weight, has_bias, prologue, output, groups,
                                  group_hw, out_dtype, epilogue, same_row, also=also, keep_input=keep_input)
    if ({dtype, out_dtype, *(dt for _, dt in also), keep_input or dtype} <= {torch.float32, *HALF_DTYPES}
            and cols % 4 == 0
            and CACHED_ROW_MIN <= cols <= SHARED_ROW_MAX
            and (kind in NORMALIZING or kind in STATISTICS)):
        # A 16-bit row (or result): the same register-row kernel, four values per 8-byte access of the
        # 16-bit operands, fp32 in registers, one rounding at the store.
        return _cached_row_kernel(name, kind, rows, cols, eps, has_weight, has_bias, prologue, output, groups,
                                  group_hw, out_dtype, epilogue, same_row, dtype, also, keep_input)
    if (dtype == out_dtype == torch.float32 and kind in ("softmax", "log_softmax", "layer_norm", "group_norm")
            and SHARED_ROW_MAX < cols <= CLUSTER_ROW_MAX and cluster_size(cols) and epilogue is None and output is None
            and keep_input is None):
        return _cluster_row_kernel(name, kind, rows, cols, eps, has_weight, has_bias, prologue, groups, group_hw)
    ch = _channel(groups, group_hw, cols)
    X = (lambda idx: f"ld(x, {idx})") if prologue is None else \
        (lambda idx: f"{name}_x({idx}{prologue.pointers()})")
    tpr = 32 if cols <= 1024 else (256 if cols <= 4096 else 512)  # threads per row
    rpb = 4 if tpr == 32 else 1                                     # rows per block
    warps = tpr // 32
    T, U = CTYPE[dtype], CTYPE[out_dtype]
    params = [f"const {T}* __restrict__ x"] if prologue is None else prologue.params()
    if has_weight:
        params.append(f"const {T}* __restrict__ w")
    if has_bias:
        params.append(f"const {T}* __restrict__ b")
    if epilogue:
        params += epilogue.params()
    if output:
        params += output.params()
    params += [f"{U}* __restrict__ y", *[f"{CTYPE[dt]}* __restrict__ y{j + 1}" for j, (_, dt) in enumerate(also)],
               *([f"{CTYPE[keep_input]}* __restrict__ xs"] if keep_input is not None else []),
               "long long rows", "long long cols"]
    kept = " st(xs, base + c, v);" if keep_input is not None else ""  # the input, stored as it is read
    more_results = [dataclasses.replace(epilogue, result=var) for var, _ in also]

    def Y(idx: str, value: str) -> str:  # the store of one result, through the output function if any
        more = ", m" if kind == "sum_exp" else ""  # the row's maximum, which sum_exp's output reads
        return f"st(y, {idx}, {value})" if output is None else \
            f"st(y, {idx}, {name}_o({idx}, {value}{more}{output.pointers()}))"

    L = [PRELUDE, _ROW_PRELUDE, *(prologue.value_function(name) if prologue else []),
         *(epilogue.value_function(name, "e") if epilogue else []),
         *[line for j, more in enumerate(more_results) for line in more.value_function(name, f"e{j + 1}")],
         *(output.value_function(name, "o") if output else []),
         f"// {name}: {kind} over rows of {cols} ({'a warp' if tpr == 32 else f'{tpr} threads'} per row)"
         + (f", {len(prologue.body)} elementwise op(s) fused into the loads" if prologue else ""),
         f"#define TPR {tpr}", f"#define RPB {rpb}", f"#define WARPS {warps}",
         f'extern "C" __global__ void __launch_bounds__(TPR * RPB) {name}({", ".join(params)}) {{',
         "  const long long row = (long long)blockIdx.x * RPB + threadIdx.x / TPR;",
         "  const int t = threadIdx.x % TPR;",
         "  const int lane = threadIdx.x & 31, warp = (threadIdx.x % TPR) >> 5;",
         "  if (row >= rows) return;",
         "  const long long base = row * cols;"]
    shared = warps > 1
    if shared:
        L.append("  __shared__ float sh[3][WARPS];")

    def block_combine(fields: list[str], combine: str):
        """After a warp-level reduction of `fields`, combine the warps' partials through shared memory."""
        if not shared:
            return
        for k, f in enumerate(fields):
            L.append(f"  if (lane == 0) sh[{k}][warp] = {f};")
        L.append("  __syncthreads();")
        init = ", ".join(f"sh[{k}][lane < WARPS ? lane : 0]" for k in range(len(fields)))
        L.append(f"  if (lane < WARPS) {{ {'; '.join(f'{f} = sh[{k}][lane]' for k, f in enumerate(fields))}; }}")
        L.append(combine)
        L.append("  __syncthreads();")
        del init

    xc = X("base + c")  # the row's element c
    if kind in ("softmax", "log_softmax", "sum_exp"):
        L += ["  float m = -__int_as_float(0x7f800000), s = 0.0f;",
              "  for (long long c = t; c < cols; c += TPR) {",
              f"    const float v = {X('base + c')};{kept}",
              "    softmax_combine(m, s, v, 1.0f);",
              "  }",
              "  warp_softmax(m, s);"]
        block_combine(["m", "s"], "  if (lane >= WARPS) { m = -__int_as_float(0x7f800000); s = 0.0f; }\n  warp_softmax(m, s);")
        if kind == "sum_exp":  # sum(exp(x - max(x))) in one read: a log-sum-exp with its max (m) at hand
            L.append(f"  if (t == 0) {Y('row', 's')};")
        elif kind == "softmax":
            L += ["  const float inv = 1.0f / s;",
                  f"  for (long long c = t; c < cols; c += TPR) {Y('base + c', f'expf({xc} - m) * inv')};"]
        else:
            L += ["  const float shift = m + logf(s);",
                  f"  for (long long c = t; c < cols; c += TPR) {Y('base + c', f'{xc} - shift')};"]
    elif kind in ("layer_norm", "group_norm"):
        L += ["  float n = 0.0f, mean = 0.0f, m2 = 0.0f;",
              "  for (long long c = t; c < cols; c += TPR) {",
              f"    const float v = {X('base + c')};{kept}",
              # __fdividef: an IEEE division expands to a call with a slow-path branch, which keeps each
              # iteration's load apart (one in flight per thread); the approximate one is two instructions.
              "    n += 1.0f; const float d = v - mean; mean += __fdividef(d, n); m2 += d * (v - mean);",
              "  }",
              "  warp_welford(n, mean, m2);"]
        block_combine(["n", "mean", "m2"], "  if (lane >= WARPS) { n = 0.0f; mean = 0.0f; m2 = 0.0f; }\n  warp_welford(n, mean, m2);")
        L += [f"  const float rstd = rsqrtf(m2 / (float)cols + {float_literal(eps)});",
              "  for (long long c = t; c < cols; c += TPR) {",
              f"    float v = ({X('base + c')} - mean) * rstd;"]
        if has_weight:
            L.append(f"    v *= ld(w, {ch('c')});")
        if has_bias:
            L.append(f"    v += ld(b, {ch('c')});")
        L += [f"    {Y('base + c', 'v')};", "  }"]
    else:
        init = {"sum": "0.0f", "mean": "0.0f", "amax": "-__int_as_float(0x7f800000)",
                "amin": "__int_as_float(0x7f800000)"}[kind]
        step = {"sum": "a += v", "mean": "a += v", "amax": "a = nanmax(a, v)", "amin": "a = nanmin(a, v)"}[kind]
        reduce = {"sum": "warp_sum", "mean": "warp_sum", "amax": "warp_max", "amin": "warp_min"}[kind]
        L += [f"  float a = {init};",
              "  for (long long c = t; c < cols; c += TPR) {",
              f"    const float v = {X('base + c')}; {step};{kept}",
              "  }",
              f"  a = {reduce}(a);"]
        block_combine(["a"], f"  if (lane >= WARPS) a = {init};\n  a = {reduce}(a);")
        final = "a / (float)cols" if kind == "mean" else "a"
        if epilogue is None:
            L.append(f"  if (t == 0) {Y('row', final)};")
        else:  # every thread holds the statistic after the combine
            L += [f"  const float stat = {final};"]
            if also:
                L += ["  for (long long c = t; c < cols; c += TPR) {",
                      f"    st(y, base + c, {name}_e(base + c, stat{epilogue.pointers()}));",
                      *[f"    st(y{j + 1}, base + c, {name}_e{j + 1}(base + c, stat{epilogue.pointers()}));"
                        for j in range(len(also))],
                      "  }"]
            else:
                L += [f"  for (long long c = t; c < cols; c += TPR) st(y, base + c, {name}_e(base + c, stat"
                      f"{epilogue.pointers()}));"]
    L.append("}")
    args = _reduction_args(has_weight, has_bias, rows, cols, prologue, epilogue, output, len(also),
                           keep_input is not None)
    grid = (rows + rpb - 1) // rpb
    return KernelCode("\n".join(L) + "\n", name, grid, tpr * rpb, args, extent=row_extent(
                          rows, args, rpb, (prologue, epilogue, output, *more_results), groups),
                      description=
                      f"{kind} over {rows} rows of {cols}, {'warp' if tpr == 32 else 'block'} per row, warp shuffles"
                      + (" + shared-memory combine" if shared else "") + (", Welford" if kind in ("layer_norm", "group_norm") else "")
                      + (", online" if kind in ("softmax", "log_softmax", "sum_exp") else "")
                      + (f", {len(prologue.body)} elementwise op(s) fused into the loads" if prologue else "")
                      + (f", {len(epilogue.body)} elementwise op(s) applying the {kind} to its row" if epilogue else "")
                      + (f", {len(output.body)} elementwise op(s) applied before the store" if output else "")
                      + (f", {len(also)} more value(s) of the row stored" if also else "")
                      + (", its input stored as computed" if keep_input is not None else ""))



def row_extent(rows: int, args: list, per_block: int, fused: tuple[RowPrologue | None, ...], groups: int = 0,
               scale: int = 1) -> Extent | None:
    """The row count as the launch's (a row kernel's source holds only the row's length): its argument is
    the first i64 of `args`, the grid ceil(rows * scale / per_block). With ops fused in (`fused`), each
    function's shape splits its flat index into coordinates below the outermost: the rows then come in
    multiples of what one outermost index holds, and its 32-bit arithmetic bounds them; a group norm's rows
    are whole images (multiples of `groups`). None where the outermost extent is 1 (left out of indices)."""
    align, limit = max(groups, 1), 0
    for f in fused:
        if f is None:
            continue
        outer, total = (f.shape[0], math.prod(f.shape)) if f.shape else (1, 1)
        if outer <= 1 or rows % outer or total % rows:
            return None
        align = math.lcm(align, rows // outer)
        if total < 2 ** 31:  # split_coordinates' unsigned arithmetic
            most = (2 ** 31 - 1) // (total // rows)
            limit = min(limit, most) if limit else most
    arg = next(k for k, (kind, _) in enumerate(args) if kind == "i64")
    return Extent(rows, arg, unit=per_block, scale=scale, align=align, limit=limit)


def _channel(groups: int, group_hw: int, cols: int):
    """The weight/bias index of the row's element `c`: c itself, or a group norm's channel."""
    if not groups:
        return lambda c: c
    per_group = cols // group_hw
    return lambda c: f"((row % {groups}LL) * {per_group}LL + ({c}) / {group_hw}LL)"


def _reduction_args(has_weight: bool, has_bias: bool, rows: int, cols: int, prologue: RowPrologue | None,
                    epilogue: RowPrologue | None = None, output: RowPrologue | None = None,
                    also: int = 0, keep_input: bool = False) -> list[tuple[str, object]]:
    args: list[tuple[str, object]] = [("in", "x")] if prologue is None else [("in", i.key) for i in prologue.inputs]
    if has_weight:
        args.append(("in", "weight"))
    if has_bias:
        args.append(("in", "bias"))
    for extra in (epilogue, output):
        if extra:
            args += [("in", i.key) for i in extra.inputs]
    return args + [("out", "y"), *[("out", f"y{j + 1}") for j in range(also)], *([("out", "xs")] if keep_input else []),
                   ("i64", rows), ("i64", cols)]


# ---- few long rows: split ----

SPLIT_MAX_ROWS = 256       # fewer rows than this leave most of a GPU's blocks idle at a block per row
SPLIT_MIN_COLS = 1 << 18   # below, one block per row finishes in a few microseconds anyway
SPLIT_CHUNK = 16384        # preferred chunk: a 1,024-thread block holding it in registers, 16 values each


def split_rows(rows: int, cols: int) -> int:
    """Into how many equal chunks each of `rows` rows of `cols` is split for a two-pass reduction (chunks
    reduced by their own blocks, then the chunks' results by a second kernel), or 0 to keep a block per
    row: enough rows already, short rows, or no divisor of `cols` giving a chunk of 4,096 to 32,768 that
    is a multiple of 4 (the float4 path)."""
    if rows >= SPLIT_MAX_ROWS or cols < SPLIT_MIN_COLS:
        return 0
    for chunk in (*range(SPLIT_CHUNK, 4095, -4), *range(SPLIT_CHUNK + 4, CACHED_ROW_MAX + 1, 4)):
        if cols % chunk == 0:
            return cols // chunk
    return 0


# ---- long fp32 rows held in registers ----

CACHED_ROW_MAX = 32768  # 8 float4 per thread at 1,024 threads
CACHED_ROW_MIN = 128    # a warp's float4 loads cover the row at least once
# Longer rows, up to a 224 KiB row, are held in the block's shared memory instead (more registers would
# halve the block): a vocabulary of 50,257 logits is still read once. Hopper's 227 KiB per block; a GPU
# with less cannot launch the kernel, and its group's check sends it back to ATen.
SHARED_ROW_MAX = 57344

_BLOCK_PRELUDE = r"""
// Reductions over the whole block (one row per block); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* sh) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x & 31) < WARPS ? sh[threadIdx.x & 31] : 0.0f;
  v = warp_sum(v);
  __syncthreads();  // sh is reused by the next reduction
  return v;
}
__device__ __forceinline__ float block_max(float v, float* sh) {
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x & 31) < WARPS ? sh[threadIdx.x & 31] : -__int_as_float(0x7f800000);
  v = warp_max(v);
  __syncthreads();
  return v;
}
__device__ __forceinline__ float block_min(float v, float* sh) {
  v = warp_min(v);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (threadIdx.x & 31) < WARPS ? sh[threadIdx.x & 31] : __int_as_float(0x7f800000);
  v = warp_min(v);
  __syncthreads();
  return v;
}
"""

_WARP_ROW_PRELUDE = r"""
// A warp holds the whole row: the row's reductions are the warp's (sh is unused).
__device__ __forceinline__ float block_sum(float v, float*) { return warp_sum(v); }
__device__ __forceinline__ float block_max(float v, float*) { return warp_max(v); }
__device__ __forceinline__ float block_min(float v, float*) { return warp_min(v); }
"""


# A prologue input's row kept in registers beside the reduction input's, per block: 4,096 float4 are 64 KiB,
# a quarter of an SM's register file (four float4 per thread at 1,024 threads, sixteen at 256).
KEPT_ROW_FLOAT4 = 4096


def _row_geometry(c4: int) -> tuple[int, int, int]:
    """(threads per row, rows per block, float4 per thread) of a row of `c4` float4 held by its threads:
    up to 1,024 columns a warp per row, eight rows per block, no barrier or shared memory; above, a block
    per row, grown to about four float4 per thread."""
    if c4 <= 256:
        return 32, 8, -(-c4 // 32)
    tpr = 128
    while tpr < 1024 and tpr * 4 < c4:
        tpr *= 2
    return tpr, 1, -(-c4 // tpr)


def _cached_row_kernel(name: str, kind: str, rows: int, cols: int, eps: float, has_weight: bool,
                       has_bias: bool, prologue: RowPrologue | None = None, output: RowPrologue | None = None,
                       groups: int = 0, group_hw: int = 0, out_dtype: torch.dtype = torch.float32,
                       epilogue: RowPrologue | None = None, same_row: dict[str, str] | None = None,
                       dtype: torch.dtype = torch.float32, also: tuple[tuple[str, torch.dtype], ...] = (),
                       keep_input: torch.dtype | None = None) -> KernelCode:
    """Softmax, log-softmax, layer or group norm over fp32 rows, a warp or a block per row: the row is read
    once from memory with 16-byte loads into registers (VPT float4 per thread), reduced there (exact
    two-pass statistics, one exp per element) and written once with 16-byte stores. Rows that are not
    16-byte aligned (a view at an odd offset) take scalar loads into the same registers. The statistics
    (sum, mean, amax, amin, sum_exp) read the same way and store one value per row — or, with an
    `epilogue` (sum, mean, amax, amin), apply it to the row: an RMS norm's x * rsqrt(stat + eps) * w,
    whose operands are read with 16-byte loads and whose results are written with 16-byte stores. An
    epilogue operand that is the row the reduction read (`same_row`) comes from the registers: the
    reduction input's own, or a copy of the prologue input's float4 kept beside them (KEPT_ROW_FLOAT4 per
    block at most: more would spill or cost blocks per SM). A second read of the row goes to DRAM once
    the rows in flight outgrow L2: an RMS norm that read it twice took the time of three passes over
    memory where its floor is two.

    `dtype` (the row's, with its weight and bias) and `out_dtype` may be fp16 or bf16, and so may the fused
    ops' operands: their rows are read and written four values per 8-byte access (VECTOR_IO_16), the
    arithmetic stays fp32 in registers and each result is rounded once at its store."""
    stat = kind in STATISTICS and epilogue is None
    c4 = cols // 4
    shared = cols > CACHED_ROW_MAX  # the row in shared memory, each thread's float4s where its registers were
    tpr, rpb, vpt = _row_geometry(c4)
    operand_dtypes = {dtype, out_dtype, *(dt for _, dt in also), keep_input or dtype,
                      *(i.dtype for f in (prologue, epilogue, output) if f for i in f.inputs)}
    half = bool(operand_dtypes & set(HALF_DTYPES))  # some 16-bit operand: the 16-bit load4/store4 overloads
    T = CTYPE[dtype]
    params = [f"const {T}* __restrict__ x"] if prologue is None else prologue.params()
    ptrs = ["x + row * cols", "y + row * cols"]
    kinds = prologue.vector_kinds(cols, half) if prologue else None
    # What must be 16-byte aligned for the vector path: the row's start in every row-shaped operand.
    checked = (["xr"] if prologue is None else []) + ([] if stat else ["yr"]) + [f"y{j + 1}r" for j in range(len(also))] \
        + (["xsr"] if keep_input is not None else [])
    ekinds = epilogue.vector_kinds(cols, half) if epilogue else None
    # Epilogue operands read from registers: epilogue key -> the float4 expression holding it at step k.
    pkinds = dict(zip((i.key for i in prologue.inputs), kinds)) if prologue and kinds else {}
    reuse = {}
    if epilogue is not None and ekinds and not shared:
        for inp, k in zip(epilogue.inputs, ekinds):
            src = (same_row or {}).get(inp.key)
            if k != "row" or src is None:
                continue
            if src == "x" and prologue is None:
                reuse[inp.key] = "v[k]"
            elif pkinds.get(src) == "row" and vpt * tpr * rpb <= KEPT_ROW_FLOAT4:
                reuse[inp.key] = f"r_{src}[k]"
    kept = sorted({r[2:-3] for r in reuse.values() if r.startswith("r_")})  # prologue inputs kept in registers
    for fused, fkinds in ((prologue, kinds), (epilogue, ekinds)):
        if fused is not None and fkinds:
            checked += [f"{i.key} + row * cols" if k == "row" else i.key
                        for i, k in zip(fused.inputs, fkinds) if k in ("row", "col", "based4")]
    if has_weight:
        params.append(f"const {T}* __restrict__ w")
    if has_bias:
        params.append(f"const {T}* __restrict__ b")
    if epilogue:
        params += epilogue.params()
    if output:
        params += output.params()
    params += [f"{CTYPE[out_dtype]}* __restrict__ y",
               *[f"{CTYPE[dt]}* __restrict__ y{j + 1}" for j, (_, dt) in enumerate(also)],
               *([f"{CTYPE[keep_input]}* __restrict__ xs"] if keep_input is not None else []), "long long rows",
               "long long cols"]
    # A group norm reads its weight and bias by channel, one element at a time: not part of the vector check.
    vector_wb = not groups
    aligned = " | ".join(f"reinterpret_cast<unsigned long long>({p})" for p in
                         checked + (["w"] if has_weight and vector_wb else []) + (["b"] if has_bias and vector_wb else [])) \
        or "0ULL"
    per_row = "one warp per row" if tpr == 32 else f"one block of {tpr} threads per row"
    L = [PRELUDE, _ROW_PRELUDE,
         f"// {name}: {kind} over rows of {cols}, {per_row}, the row held in registers",
         f"#define TPR {tpr}", f"#define RPB {rpb}", f"#define WARPS {tpr // 32}", f"#define VPT {vpt}",
         f"#define C4 {c4}", f"#define COLS {cols}LL",
         _BLOCK_PRELUDE if tpr > 32 else _WARP_ROW_PRELUDE,
         VECTOR_IO, *([VECTOR_IO_16] if half else []),
         *(cached_prologue(name, prologue, kinds, held=kept) if prologue else []),
         *(cached_prologue(name, epilogue, ekinds, "e", held=list(reuse)) if epilogue else []),
         *[line for j, (var, _) in enumerate(also)
           for line in cached_prologue(name, dataclasses.replace(epilogue, result=var), ekinds, f"e{j + 1}",
                                       held=list(reuse))],
         *((output.value_function(name, "o") if stat else cached_output(name, output)) if output else []),
         f'extern "C" __global__ void __launch_bounds__(TPR * RPB) {name}({", ".join(params)}) {{',
         "  const long long row = (long long)blockIdx.x * RPB + threadIdx.x / TPR;",
         "  const int t = threadIdx.x % TPR;",
         "  if (row >= rows) return;",  # a whole row's threads leave together: no barrier is left waiting
         "  __shared__ float sh[WARPS];",
         *([f"  const {T}* xr = {ptrs[0]};"] if prologue is None else []),
         *([] if stat else [f"  {CTYPE[out_dtype]}* yr = {ptrs[1]};"]),
         *[f"  {CTYPE[dt]}* y{j + 1}r = y{j + 1} + row * cols;" for j, (_, dt) in enumerate(also)],
         *([f"  {CTYPE[keep_input]}* xsr = xs + row * cols;"] if keep_input is not None else []),
         f"  const bool vec = (({aligned}) & 15ULL) == 0;",
         "  float4 v[VPT];",
         *[f"  float4 r_{key}[VPT];" for key in kept],
         "#pragma unroll",
         "  for (int k = 0; k < VPT; ++k) {",
         "    const int c = t + k * TPR;",
         *[f"    r_{key}[k] = c < C4 ? load4({key} + row * cols, c, vec) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);"
           for key in kept],
         "    v[k] = c < C4 ? " + ("load4(xr, c, vec)" if prologue is None else
                                    f"{name}_x4(row, c, vec{_operands(prologue, {k: f'r_{k}[k]' for k in kept})})")
         + " : make_float4(0.0f, 0.0f, 0.0f, 0.0f);",
         "  }"]

    def each(body: list[str]) -> None:
        L.extend(["#pragma unroll", "  for (int k = 0; k < VPT; ++k) {",
                  "    if (t + k * TPR >= C4) break;", *[f"    {b}" for b in body], "  }"])

    if keep_input is not None:  # the input the prologue computed, stored before anything changes it
        each(["store4(xsr, t + k * TPR, v[k], vec);"])

    def store(c: str, value: str) -> str:  # one float4 of results, through the output function if any
        if output is not None:
            value = f"{name}_o4(row, {c}, {value}{output.pointers()})"
        return f"store4(yr, {c}, {value}, vec);"

    if kind in STATISTICS:
        inf = "__int_as_float(0x7f800000)"
        if kind in ("sum", "mean"):
            L.append("  float a = 0.0f;")
            each(["a += (v[k].x + v[k].y) + (v[k].z + v[k].w);"])
            L.append("  a = block_sum(a, sh);" + (" a /= (float)cols;" if kind == "mean" else ""))
        elif kind in ("amax", "amin"):
            f = "nanmax" if kind == "amax" else "nanmin"
            L.append(f"  float a = {'-' if kind == 'amax' else ''}{inf};")
            each([f"a = {f}(a, {f}({f}(v[k].x, v[k].y), {f}(v[k].z, v[k].w)));"])
            L.append(f"  a = block_{kind[1:]}(a, sh);")
        else:  # sum_exp: the max, then the sum of exp(x - max) from the registers; a row of -inf sums to 0
            L.append(f"  float m = -{inf};")
            each(["m = nanmax(m, nanmax(nanmax(v[k].x, v[k].y), nanmax(v[k].z, v[k].w)));"])
            L += ["  m = block_max(m, sh);", f"  const float shift = m == -{inf} ? 0.0f : m;", "  float a = 0.0f;"]
            each(["a += (expf(v[k].x - shift) + expf(v[k].y - shift)) + (expf(v[k].z - shift) + expf(v[k].w - shift));"])
            L.append("  a = block_sum(a, sh);")
        if epilogue is not None:  # every thread holds the statistic after the block's reduction
            L.append("  const float stat = a;")
            each(["const int c = t + k * TPR;",
                  f"store4(yr, c, {name}_e4(row, c, vec, stat{_operands(epilogue, reuse)}), vec);",
                  *[f"store4(y{j + 1}r, c, {name}_e{j + 1}4(row, c, vec, stat{_operands(epilogue, reuse)}), vec);"
                    for j in range(len(also))]])
        else:
            more = ", m" if kind == "sum_exp" else ""
            value = "a" if output is None else f"{name}_o(row, a{more}{output.pointers()})"
            L.append(f"  if (t == 0) st(y, row, {value});")
    elif kind in ("softmax", "log_softmax"):
        L.append("  float m = -__int_as_float(0x7f800000);")
        each(["m = nanmax(m, nanmax(nanmax(v[k].x, v[k].y), nanmax(v[k].z, v[k].w)));"])
        L += ["  m = block_max(m, sh);", "  float s = 0.0f;"]
        if kind == "softmax":
            each(["v[k] = make_float4(expf(v[k].x - m), expf(v[k].y - m), expf(v[k].z - m), expf(v[k].w - m));",
                  "s += (v[k].x + v[k].y) + (v[k].z + v[k].w);"])
            L += ["  const float inv = 1.0f / block_sum(s, sh);"]
            each([store("t + k * TPR", "make_float4(v[k].x * inv, v[k].y * inv, v[k].z * inv, v[k].w * inv)")])
        else:
            each(["s += (expf(v[k].x - m) + expf(v[k].y - m)) + (expf(v[k].z - m) + expf(v[k].w - m));"])
            L += ["  const float shift = m + logf(block_sum(s, sh));"]
            each([store("t + k * TPR", "make_float4(v[k].x - shift, v[k].y - shift, v[k].z - shift, "
                        "v[k].w - shift)")])
    else:  # layer or group norm: exact mean, then the mean of squared deviations, both from registers
        L.append("  float s = 0.0f;")
        each(["s += (v[k].x + v[k].y) + (v[k].z + v[k].w);"])
        L += ["  const float mean = block_sum(s, sh) / (float)cols;", "  float q = 0.0f;"]
        each(["const float4 d = make_float4(v[k].x - mean, v[k].y - mean, v[k].z - mean, v[k].w - mean);",
              "q += (d.x * d.x + d.y * d.y) + (d.z * d.z + d.w * d.w);"])
        L.append(f"  const float rstd = rsqrtf(block_sum(q, sh) / (float)cols + {float_literal(eps)});")
        body = ["const int c = t + k * TPR;",
                "float4 o = make_float4((v[k].x - mean) * rstd, (v[k].y - mean) * rstd, (v[k].z - mean) * rstd, "
                "(v[k].w - mean) * rstd);"]
        ch = _channel(groups, group_hw, cols)
        for flag, ptr, op, var in ((has_weight, "w", "*=", "g"), (has_bias, "b", "+=", "h")):
            if not flag:
                continue
            if groups and half:
                body.append(f"const float4 {var} = make_float4(ld({ptr}, {ch('4 * c')}), ld({ptr}, {ch('4 * c + 1')}), "
                            f"ld({ptr}, {ch('4 * c + 2')}), ld({ptr}, {ch('4 * c + 3')}));")
            elif groups:
                body.append(f"const float4 {var} = make_float4({ptr}[{ch('4 * c')}], {ptr}[{ch('4 * c + 1')}], "
                            f"{ptr}[{ch('4 * c + 2')}], {ptr}[{ch('4 * c + 3')}]);")
            else:
                body.append(f"const float4 {var} = load4({ptr}, c, vec);")
            body.append(f"o.x {op} {var}.x; o.y {op} {var}.y; o.z {op} {var}.z; o.w {op} {var}.w;")
        body.append(store("c", "o"))
        each(body)
    L.append("}")
    held = "registers"
    if shared:  # every thread reads back only the float4s it stored: no barrier beyond the reductions'
        held = "shared memory"
        source = "\n".join(L).replace("  float4 v[VPT];", "  extern __shared__ float4 v4[];")
        source = source.replace("    v[k] = c < C4 ?", "    if (c < C4) v[k] =").replace(
            " : make_float4(0.0f, 0.0f, 0.0f, 0.0f);\n  }", ";\n  }", 1).replace("v[k]", "v4[t + k * TPR]")
        source = source.replace("the row held in registers", "the row held in shared memory")
        L = [source]
    args = _reduction_args(has_weight, has_bias, rows, cols, prologue, epilogue, output, len(also),
                           keep_input is not None)
    wide = "vector" if half else "16-byte"  # a 16-bit operand's access is 8 bytes
    if prologue:
        what_in = wide if kinds else "scalar"
        fused = f", {len(prologue.body)} elementwise op(s) fused into the loads ({what_in})"
    else:
        fused = ""
    if epilogue:
        fused += (f", {len(epilogue.body)} elementwise op(s) applying the {kind} to its row "
                  f"({wide if ekinds else 'scalar'}"
                  f"{f', {len(reuse)} operand(s) from the registers' if reuse else ''})")
    what = ("exact two-pass mean and variance" if kind in ("layer_norm", "group_norm") else
            "max, then one exp per element" if kind in ("softmax", "log_softmax", "sum_exp") else f"{wide} loads")
    io = "one read, one value per row" if stat else "one read and one write"
    if output:
        fused += f", {len(output.body)} elementwise op(s) applied before the store"
    if also:
        fused += f", {len(also)} more value(s) of the row stored"
    if keep_input is not None:
        fused += ", its input stored as computed"
    return KernelCode("\n".join(L) + "\n", name, -(-rows // rpb), tpr * rpb, args,
                      extent=row_extent(rows, args, rpb, (prologue, output, epilogue), groups), description=
                      f"{kind} over {rows} rows of {cols}, {'warp' if tpr == 32 else 'block'} per row, row held in {held} "
                      f"({vpt} float4 per thread), {io}, {what}{fused}"
                      + (", 16-bit operands four values per 8-byte access, fp32 in registers" if half else ""),
                      vectorized=True,
                      shared_mem=16 * c4 if shared else 0)


# Rows longer than one block's shared memory (a 128K- or 256K-entry vocabulary, 196,608 columns) are split
# over a thread-block cluster (Hopper): each block holds its part of the row in its own shared memory, and
# the row's statistics are combined through distributed shared memory, so the row is still read once and
# written once (a block per row reads it twice: an online pass for the statistics, another for the results). A part is at most CLUSTER_PART_MAX floats (200 KiB);
# up to CLUSTER_PART_PREFERRED (112 KiB) two blocks fit an SM and one's exchange overlaps the other's loads.
CLUSTER_SIZES = (2, 4, 8)  # portable cluster sizes
CLUSTER_PART_PREFERRED = 28672
CLUSTER_PART_MAX = 51200
CLUSTER_ROW_MAX = CLUSTER_SIZES[-1] * CLUSTER_PART_MAX
CLUSTER_THREADS = 512


def cluster_size(cols: int) -> int:
    """Blocks per row for a row of `cols` fp32 values split over a cluster (0: it does not split evenly
    into 16-byte parts of at most CLUSTER_PART_MAX floats)."""
    fits = [n for n in CLUSTER_SIZES if cols % (4 * n) == 0 and cols // n <= CLUSTER_PART_MAX]
    preferred = [n for n in fits if cols // n <= CLUSTER_PART_PREFERRED]
    return (preferred or fits or [0])[0]


def _cluster_row_kernel(name: str, kind: str, rows: int, cols: int, eps: float, has_weight: bool,
                        has_bias: bool, prologue: RowPrologue | None = None, groups: int = 0,
                        group_hw: int = 0) -> KernelCode:
    """Softmax, log-softmax, layer or group norm over fp32 rows too long for one block's shared memory: a
    cluster of `cluster_size(cols)` blocks per row, each loading its part of the row into its shared memory
    (16-byte loads; through the prologue's function, element by element, when one is fused), reducing it,
    and combining the blocks' results through distributed shared memory (every block adds them in the same
    order, so all agree); the row is then written from shared memory. One read and one write, where a
    block per row reads it twice (its second pass over a row of hundreds of KiB misses L2: a group norm of
    32 channels of 128 x 128 is a 512 KiB row). A group norm's rows are (sample, group) pairs, its weight
    and bias read by channel."""
    n = cluster_size(cols)
    if n == 0 or kind not in ("softmax", "log_softmax", "layer_norm", "group_norm"):
        raise ValueError(f"a cluster row kernel takes softmax, log_softmax, layer_norm or group_norm over rows that "
                         f"split into 16-byte parts of at most {CLUSTER_PART_MAX} floats, not {kind} over {cols}")
    if kind == "group_norm" and (groups <= 0 or group_hw <= 0 or cols % group_hw):
        raise ValueError(f"group_norm needs groups > 0 and a group_hw dividing cols, got {groups}, {group_hw}, {cols}")
    part = cols // n
    p4 = part // 4
    vpt = -(-p4 // CLUSTER_THREADS)
    inf = "__int_as_float(0x7f800000)"
    params = ["const float* __restrict__ x"] if prologue is None else prologue.params()
    if has_weight:
        params.append("const float* __restrict__ w")
    if has_bias:
        params.append("const float* __restrict__ b")
    params += ["float* __restrict__ y", "long long rows", "long long cols"]
    if prologue is None:
        load = "load4(x + base, c, vec)"
    else:
        load = "make_float4(" + ", ".join(f"{name}_x(base + 4LL * c + {j}{prologue.pointers()})" for j in range(4)) + ")"
    L = [PRELUDE, _ROW_PRELUDE, "#include <cooperative_groups.h>",
         f"// {name}: {kind} over rows of {cols}, a cluster of {n} blocks per row, each holding {part} of its "
         "values in shared memory",
         f"#define WARPS {CLUSTER_THREADS // 32}", f"#define CLUSTER {n}", f"#define PART {part}LL",
         f"#define P4 {p4}", f"#define VPT {vpt}",
         _BLOCK_PRELUDE, VECTOR_IO,
         r"""// The cluster's total of each block's `v` (one per block, every thread has it), in slot `k` of the
// blocks' `slots` (a slot per combine: a block still reading slot k never sees it overwritten).
__device__ __forceinline__ float cluster_sum(float v, float* slots, int k) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) slots[k] = v;
  cluster.sync();
  float total = 0.0f;
  for (int r = 0; r < CLUSTER; ++r) total += *cluster.map_shared_rank(&slots[k], r);
  return total;
}
__device__ __forceinline__ float cluster_max(float v, float* slots, int k) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) slots[k] = v;
  cluster.sync();
  float m = -__int_as_float(0x7f800000);
  for (int r = 0; r < CLUSTER; ++r) m = nanmax(m, *cluster.map_shared_rank(&slots[k], r));
  return m;
}""",
         *(prologue.value_function(name) if prologue else []),
         f'extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__({CLUSTER_THREADS}) '
         f'{name}({", ".join(params)}) {{',
         "  extern __shared__ float4 v4[];",
         "  __shared__ float sh[WARPS];",
         "  __shared__ float slots[3];",
         "  const long long row = blockIdx.x / CLUSTER;",
         "  const int part = blockIdx.x % CLUSTER;  // the block's rank in its cluster",
         "  const long long base = row * cols + part * PART;",
         "  const int t = threadIdx.x;",
         # Parts start 16-byte aligned in every row-shaped operand whose start is: 16-byte loads and stores
         # then, scalar ones for a view at an odd offset.
         "  const bool vec = ((reinterpret_cast<unsigned long long>(y)"
         + ("" if prologue is not None else " | reinterpret_cast<unsigned long long>(x)")
         + (" | reinterpret_cast<unsigned long long>(w)" if has_weight and not groups else "")
         + (" | reinterpret_cast<unsigned long long>(b)" if has_bias and not groups else "") + ") & 15ULL) == 0;"]

    def each(body: list[str]) -> None:
        L.extend(["#pragma unroll", "  for (int k = 0; k < VPT; ++k) {", "    const int c = t + k * " +
                  f"{CLUSTER_THREADS};", "    if (c >= P4) break;", *[f"    {b}" for b in body], "  }"])

    def out(value: str) -> str:
        return f"store4(y + base, c, {value}, vec);"

    if kind in ("softmax", "log_softmax"):
        L.append(f"  float m = -{inf};")
        each([f"const float4 v = {load};", "v4[c] = v;",
              "m = nanmax(m, nanmax(nanmax(v.x, v.y), nanmax(v.z, v.w)));"])
        L += ["  m = cluster_max(block_max(m, sh), slots, 0);", "  float s = 0.0f;"]
        each(["const float4 v = v4[c];",
              "s += (expf(v.x - m) + expf(v.y - m)) + (expf(v.z - m) + expf(v.w - m));"])
        L.append("  const float total = cluster_sum(block_sum(s, sh), slots, 1);")
        L.append("  cooperative_groups::this_cluster().sync();  // every block has read every slot: none is left")
        if kind == "softmax":
            L.append("  const float inv = 1.0f / total;")
            each(["const float4 v = v4[c];",
                  out("make_float4(expf(v.x - m) * inv, expf(v.y - m) * inv, expf(v.z - m) * inv, expf(v.w - m) * inv)")])
        else:
            L.append("  const float shift = m + logf(total);")
            each(["const float4 v = v4[c];", out("make_float4(v.x - shift, v.y - shift, v.z - shift, v.w - shift)")])
    else:  # layer or group norm: the exact mean, then the mean of squared deviations, both from shared memory
        L.append("  float s = 0.0f;")
        each([f"const float4 v = {load};", "v4[c] = v;", "s += (v.x + v.y) + (v.z + v.w);"])
        L += ["  const float mean = cluster_sum(block_sum(s, sh), slots, 0) / (float)cols;", "  float q = 0.0f;"]
        each(["const float4 v = v4[c];",
              "const float4 d = make_float4(v.x - mean, v.y - mean, v.z - mean, v.w - mean);",
              "q += (d.x * d.x + d.y * d.y) + (d.z * d.z + d.w * d.w);"])
        L.append(f"  const float rstd = rsqrtf(cluster_sum(block_sum(q, sh), slots, 1) / (float)cols + {float_literal(eps)});")
        L.append("  cooperative_groups::this_cluster().sync();  // every block has read every slot: none is left")
        body = ["const float4 v = v4[c];",
                "float4 o = make_float4((v.x - mean) * rstd, (v.y - mean) * rstd, (v.z - mean) * rstd, "
                "(v.w - mean) * rstd);"]
        ch = _channel(groups, group_hw, cols)
        for flag, ptr, op, var in ((has_weight, "w", "*=", "g"), (has_bias, "b", "+=", "h")):
            if not flag:
                continue
            if groups:  # by channel, one value at a time (a channel's run of group_hw columns)
                col = "part * PART + 4LL * c"
                body.append(f"const float4 {var} = make_float4(" + ", ".join(
                    f"{ptr}[{ch(f'{col} + {j}')}]" for j in range(4)) + ");")
            else:
                body.append(f"const float4 {var} = load4({ptr} + part * PART, c, vec);")
            body.append(f"o.x {op} {var}.x; o.y {op} {var}.y; o.z {op} {var}.z; o.w {op} {var}.w;")
        body.append(out("o"))
        each(body)
    L.append("}")
    args = _reduction_args(has_weight, has_bias, rows, cols, prologue, None, None)
    fused = f", {len(prologue.body)} elementwise op(s) fused into the loads (scalar)" if prologue else ""
    return KernelCode("\n".join(L) + "\n", name, rows * n, CLUSTER_THREADS, args,
                      extent=row_extent(rows, args, 1, (prologue,), groups, scale=n), description=
                      f"{kind} over {rows} rows of {cols}, a cluster of {n} blocks per row, each holding {part} values "
                      "in shared memory, statistics combined through distributed shared memory, one read and one "
                      f"write{fused}", vectorized=prologue is None, shared_mem=4 * part)


def cached_output(name: str, output: RowPrologue) -> list[str]:
    """`{name}_o4(row, c4, v, in0, ..)`: the output function on one float4 of results."""
    L = output.value_function(name, "o")
    params = ", ".join(["long long row", "int c4", "float4 v",
                        *[f"const {CTYPE[i.dtype]}* __restrict__ p_{i.key}" for i in output.inputs]])
    args = "".join(f", p_{i.key}" for i in output.inputs)
    L += [f"__device__ __forceinline__ float4 {name}_o4({params}) {{",
          "  const long long i = row * COLS + 4LL * c4;",
          f"  return make_float4({name}_o(i, v.x{args}), {name}_o(i + 1, v.y{args}), "
          f"{name}_o(i + 2, v.z{args}), {name}_o(i + 3, v.w{args}));",
          "}"]
    return L


def cached_prologue(name: str, prologue: RowPrologue, kinds: list[str] | None, suffix: str = "x",
                    held: list[str] = ()) -> list[str]:
    """`{name}_{suffix}4(row, c4, vec, [extra..], in0, ..)`: four consecutive values of the fused ops (one
    float4 of the row: the reduction input for a prologue, the result for an epilogue, whose extra is the
    row's statistic), 16-byte loads of each operand when `kinds` allows, else the scalar value function.
    The inputs in `held` ("row" kind) are passed as the float4 the caller holds instead of a pointer."""
    L = prologue.value_function(name, suffix)
    params = ", ".join(["long long row", "int c4", "bool vec", *[f"float {e}" for e in prologue.extra],
                        *[f"float4 h_{i.key}" if i.key in held else f"const {CTYPE[i.dtype]}* __restrict__ p_{i.key}"
                          for i in prologue.inputs]])
    L.append(f"__device__ __forceinline__ float4 {name}_{suffix}4({params}) {{")
    if kinds is None:
        args = "".join(f", {e}" for e in prologue.extra) + "".join(f", p_{i.key}" for i in prologue.inputs)
        f = f"{name}_{suffix}"
        L.append("  const long long i = row * COLS + 4LL * c4;")
        L.append(f"  return make_float4({f}(i{args}), {f}(i + 1{args}), {f}(i + 2{args}), {f}(i + 3{args}));")
        L.append("}")
        return L
    shape = prologue.shape
    if any(k in ("based4", "based1", "per_row") for k in kinds):  # the row's coordinates (all but the last)
        L += [f"  {c}" for c in split_coordinates("row", shape, list(range(len(shape) - 1)))]
    for inp, k in zip(prologue.inputs, kinds):
        a, p = f"a_{inp.key}", f"p_{inp.key}"
        if inp.key in held:
            L.append(f"  const float4 {a} = h_{inp.key};")
        elif k == "row":
            L.append(f"  const float4 {a} = load4({p} + row * COLS, c4, vec);")
        elif k == "col":
            L.append(f"  const float4 {a} = load4({p}, c4, vec);")
        elif k in ("based4", "based1", "per_row"):
            L.append(f"  const long long b_{inp.key} = {element_index(inp, shape, len(shape) - 1)};")
            if k == "based4":
                L.append(f"  const float4 {a} = load4({p} + b_{inp.key}, c4, vec);")
            elif k == "based1":
                e = f"b_{inp.key} + 4LL * c4"
                L.append(f"  const float4 {a} = make_float4(ld({p}, {e}), ld({p}, {e} + 1), ld({p}, {e} + 2), "
                         f"ld({p}, {e} + 3));")
            else:
                L.append(f"  const float s_{inp.key} = ld({p}, b_{inp.key});")
                L.append(f"  const float4 {a} = make_float4(s_{inp.key}, s_{inp.key}, s_{inp.key}, s_{inp.key});")
        else:
            L.append(f"  const float s_{inp.key} = ld({p}, 0);")
            L.append(f"  const float4 {a} = make_float4(s_{inp.key}, s_{inp.key}, s_{inp.key}, s_{inp.key});")
    L.append("  float4 out;")
    for lane in "xyzw":
        L.append("  {")
        L += [f"    const float {i.key} = a_{i.key}.{lane};" for i in prologue.inputs]
        L += [f"    {b}" for b in prologue.body]
        L.append(f"    out.{lane} = {prologue.result};")
        L.append("  }")
    L += ["  return out;", "}"]
    return L


def _operands(fused: RowPrologue, held: dict[str, str]) -> str:
    """The trailing call arguments of `fused`'s float4 function: each input's pointer, or the float4
    expression `held` gives for it."""
    return "".join(f", {held.get(i.key, i.key)}" for i in fused.inputs)


# ---- normalized rows feeding per-row results ----

NORMALIZED_ROW_VALUES = CACHED_ROW_MAX  # row elements held in registers, summed over the normalized inputs


@dataclass
class RowProduct:
    """One per-row result of normalized_rows_kernel. A statistic (`kind` sum, mean, amax or amin) of
    `prologue` — C over the normalized values nrm0.. (its `extra`) and its own inputs; None: the values of
    normalized input 0 themselves — stored through `output` when given; or `kind` "gather": the
    normalized value of input `source` at the column that the int64 tensor `index` (one per row) names,
    NaN where the index is out of range."""

    kind: str
    prologue: RowPrologue | None = None
    output: RowPrologue | None = None
    source: int = 0
    index: str = ""
    out_dtype: torch.dtype = torch.float32


def normalized_rows_kernel(name: str, rows: int, cols: int, norms: list[str], products: list[RowProduct]) -> KernelCode:
    """Per-row results of softmax or log-softmax rows (`norms[j]`: the kind of normalized input j) of fp32
    inputs x0, x1, .., never storing the normalized rows: each x_j row is read once into registers (float4
    loads), normalized there with the softmax kernels' own arithmetic (its max, then its sum of
    exponentials), and every product is computed from the registers in one more pass over them — a KL
    divergence between two log-softmaxes in one read of its logits, or a cross entropy's picked
    log-probability and its label-smoothing row sum. Arguments: x0.., then per product its prologue's and
    output's inputs, [its index], y<k>; rows, cols."""
    if not norms or any(n not in ("softmax", "log_softmax") for n in norms):
        raise ValueError(f"normalized inputs are softmax or log_softmax rows, got {norms}")
    if not products:
        raise ValueError("normalized_rows_kernel needs at least one product")
    nrm = tuple(f"nrm{j}" for j in range(len(norms)))
    for k, pr in enumerate(products):
        if pr.kind not in ("sum", "mean", "amax", "amin", "gather"):
            raise ValueError(f"product {k}: a statistic (sum, mean, amax, amin) or a gather, not '{pr.kind}'")
        if pr.prologue is not None and pr.prologue.extra != nrm:
            raise ValueError(f"product {k}: its prologue must read {nrm} as its extra values, got {pr.prologue.extra}")
        if pr.kind == "gather" and (not pr.index or pr.prologue or pr.output or not 0 <= pr.source < len(norms)):
            raise ValueError(f"product {k}: a gather names its index and a normalized input, with no prologue or output")
    if cols % 4 or cols < CACHED_ROW_MIN or cols * len(norms) > NORMALIZED_ROW_VALUES:
        raise ValueError(f"{len(norms)} normalized row(s) of {cols} do not fit the registers (a multiple of 4, "
                         f"{CACHED_ROW_MIN} to {NORMALIZED_ROW_VALUES} values in all)")
    c4 = cols // 4
    tpr, rpb, vpt = _row_geometry(c4)
    inf = "__int_as_float(0x7f800000)"

    def normalized(j: int, v: str) -> str:
        return f"{v} - f{j}" if norms[j] == "log_softmax" else f"expf({v} - m{j}) * f{j}"

    params = [f"const float* __restrict__ x{j}" for j in range(len(norms))]
    args: list[tuple[str, object]] = [("in", f"x{j}") for j in range(len(norms))]
    functions: list[str] = []
    for k, pr in enumerate(products):
        for fn, suffix in ((pr.prologue, f"x{k}"), (pr.output, f"o{k}")):
            if fn is not None:
                params += fn.params()
                args += [("in", i.key) for i in fn.inputs]
                functions += fn.value_function(name, suffix)
        if pr.kind == "gather":
            params.append(f"const long long* __restrict__ {pr.index}")
            args.append(("in", pr.index))
        params.append(f"{CTYPE[pr.out_dtype]}* __restrict__ y{k}")
        args.append(("out", f"y{k}"))
    params += ["long long rows", "long long cols"]
    args += [("i64", rows), ("i64", cols)]
    aligned = " | ".join(f"reinterpret_cast<unsigned long long>(x{j} + row * cols)" for j in range(len(norms)))
    L = [PRELUDE, _ROW_PRELUDE,
         f"// {name}: {len(products)} per-row result(s) of " + ", ".join(f"{n}(x{j})" for j, n in enumerate(norms))
         + f" over rows of {cols}, each row read once into registers",
         f"#define TPR {tpr}", f"#define RPB {rpb}", f"#define WARPS {tpr // 32}", f"#define VPT {vpt}",
         f"#define C4 {c4}", f"#define COLS {cols}LL",
         _BLOCK_PRELUDE if tpr > 32 else _WARP_ROW_PRELUDE,
         VECTOR_IO, *functions,
         f'extern "C" __global__ void __launch_bounds__(TPR * RPB) {name}({", ".join(params)}) {{',
         "  const long long row = (long long)blockIdx.x * RPB + threadIdx.x / TPR;",
         "  const int t = threadIdx.x % TPR;",
         "  if (row >= rows) return;",
         "  __shared__ float sh[WARPS];",
         f"  const bool vec = (({aligned}) & 15ULL) == 0;"]
    for j, norm in enumerate(norms):
        v = f"v{j}"
        L += [f"  float4 {v}[VPT];",
              "#pragma unroll",
              "  for (int k = 0; k < VPT; ++k) {",
              "    const int c = t + k * TPR;",
              f"    {v}[k] = c < C4 ? load4(x{j} + row * cols, c, vec) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);",
              "  }",
              f"  float m{j} = -{inf};",
              "#pragma unroll",
              "  for (int k = 0; k < VPT; ++k) {",
              "    if (t + k * TPR >= C4) break;",
              f"    m{j} = nanmax(m{j}, nanmax(nanmax({v}[k].x, {v}[k].y), nanmax({v}[k].z, {v}[k].w)));",
              "  }",
              f"  m{j} = block_max(m{j}, sh);",
              f"  float s{j} = 0.0f;",
              "#pragma unroll",
              "  for (int k = 0; k < VPT; ++k) {",
              "    if (t + k * TPR >= C4) break;",
              f"    s{j} += (expf({v}[k].x - m{j}) + expf({v}[k].y - m{j})) + (expf({v}[k].z - m{j}) + expf({v}[k].w - m{j}));",
              "  }",
              f"  s{j} = block_sum(s{j}, sh);",
              # the softmax / log-softmax kernels' arithmetic: one subtraction, or exp times 1 / sum
              f"  const float f{j} = " + (f"m{j} + logf(s{j});" if norm == "log_softmax" else f"1.0f / s{j};")]
    stats = [(k, pr) for k, pr in enumerate(products) if pr.kind != "gather"]
    init = {"sum": "0.0f", "mean": "0.0f", "amax": f"-{inf}", "amin": inf}
    step = {"sum": "a{k} += {v}", "mean": "a{k} += {v}", "amax": "a{k} = nanmax(a{k}, {v})",
            "amin": "a{k} = nanmin(a{k}, {v})"}
    if stats:
        L += [f"  float a{k} = {init[pr.kind]};" for k, pr in stats]
        L += ["#pragma unroll", "  for (int k = 0; k < VPT; ++k) {", "    if (t + k * TPR >= C4) break;",
              "    const long long i = row * COLS + 4LL * (t + k * TPR);"]
        for n, lane in enumerate("xyzw"):
            values = ", ".join(normalized(j, f"v{j}[k].{lane}") for j in range(len(norms)))
            for k, pr in stats:
                value = (f"{name}_x{k}(i + {n}, {values}{pr.prologue.pointers()})" if pr.prologue is not None
                         else normalized(0, f"v0[k].{lane}"))
                L.append("    " + step[pr.kind].format(k=k, v=value) + ";")
        L.append("  }")
        for k, pr in stats:
            reduce = {"sum": "block_sum", "mean": "block_sum", "amax": "block_max", "amin": "block_min"}[pr.kind]
            L.append(f"  a{k} = {reduce}(a{k}, sh);" + (f" a{k} /= (float)cols;" if pr.kind == "mean" else ""))
            value = f"a{k}" if pr.output is None else f"{name}_o{k}(row, a{k}{pr.output.pointers()})"
            L.append(f"  if (t == 0) st(y{k}, row, {value});")
    for k, pr in enumerate(products):
        if pr.kind == "gather":
            j = pr.source
            L += [f"  if (t == 0) {{",
                  f"    const long long c = {pr.index}[row];",
                  f"    st(y{k}, row, c >= 0 && c < COLS ? {normalized(j, f'x{j}[row * COLS + c]')} : "
                  "__int_as_float(0x7fc00000));",
                  "  }"]
    L.append("}")
    what = ", ".join(pr.kind if pr.kind == "gather" else f"{pr.kind} of {len(pr.prologue.body) if pr.prologue else 0} "
                     "elementwise op(s)" for pr in products)
    return KernelCode("\n".join(L) + "\n", name, -(-rows // rpb), tpr * rpb, args,
                      f"{what} per row over " + " and ".join(f"{n} rows" for n in norms) + f" of {cols} held in "
                      f"registers ({vpt} float4 per thread per input): each input read once, the normalized values "
                      "never stored", vectorized=True)
