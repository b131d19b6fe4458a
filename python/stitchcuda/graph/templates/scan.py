"""Inclusive scans along one dimension of fp32 tensors (cumsum, cumprod), combined in ATen's own order so
the results are eager's bit for bit, with elementwise ops fused before (on load) and after (on store).

What. Along the innermost dimension (`_row_scan`): a group of lanes per row (a whole warp for long rows),
each lane holding a contiguous run of each tile in registers (16-byte loads and stores), the tile
combined by a Sklansky network (the levels inside a run in registers, the rest by warp shuffles), the
running total carried from tile to tile, and the next tiles' loads in flight while one is combined —
no shared memory, no block barrier. Along another dimension (`_column_scan`): a thread per column of
[outer, length, inner], lanes on consecutive columns (coalesced), sequential down the column, eight
loads issued ahead of their adds.

Why ATen's order. A long fp32 scan's result depends on the order its sums are rounded, and the checks
compare a group with eager elementwise (verify/tolerance.py: fp32 1e-4 + 1e-4 |x|). ATen's CUDA scan of
the innermost dimension works in tiles of 2^(L+1) elements (L from the row count and length,
`aten_tile`), folds the previous tiles' total into each tile's first element and runs a Sklansky
network over the tile; over 131,072-element rows its own error against fp64 reaches 1e-3 where the
partial sums cross zero. A blocked work-efficient scan (sequential runs per thread, a shuffle scan of
the runs' totals) is about 7x closer to fp64 there, yet differs from eager by more than the tolerance on
roughly a third of such rows, so the group check would put it back on ATen. In ATen's order nothing
differs; the time goes to the memory side instead: ATen's kernel synchronizes its block L+3 times per
tile, through shared memory, with two loads per thread in flight (op_cumsum_long_rows: 1.40 ms, 1.5 TB/s;
torch.compile's generated scan 0.82 ms). Along another
dimension ATen adds sequentially down each column, which this kernel does too. A tensor with a single
row (numel = its length) is scanned by ATen with CUB's device-wide scan in another order: the Planner
leaves it there, where it is at the memory floor already.

Floor: one read and one write of the tensor — op_cumsum_long_rows' 2048 x 131072 fp32 is 2 x 1.07 GB,
about 0.5 ms at the H200's ~4.3 TB/s of copy bandwidth; the combine is (L + 1) / 2 adds per element in
registers (L = 7 there: tiles of 256) and six shuffles per lane and tile. Measured with
`stitchcuda bench kernelbench --only op_cumsum_long_rows`.
"""

from __future__ import annotations

import math

import torch

from .common import CTYPE, PRELUDE, VECTOR_IO, KernelCode, RowPrologue
from .rows import cached_output, cached_prologue

SCANS = ("cumsum", "cumprod")
_INIT = {"cumsum": "0.0f", "cumprod": "1.0f"}  # ATen's initial total (0 + -0 is +0: its first element too)
# Leaves every float as it is, -0 and NaN included: a lane that takes no part in a level combines with
# it, one select per level instead of one per element.
_NEUTRAL = {"cumsum": "-0.0f", "cumprod": "1.0f"}
# Each combine rounds on its own, as ATen's do: `__fadd_rn` / `__fmul_rn` are never contracted into an FMA
# with a product computed on load or an add applied on store. (A host compiler running the kernel, as
# the tests' CPU emulator does, rounds each operation anyway.)
_COMBINE = {"cumsum": ("__fadd_rn", "+"), "cumprod": ("__fmul_rn", "*")}
SCAN_EXTENT_MAX = 2 ** 30  # a row's length and the count of rows or columns: indexed with 32-bit integers
_COLUMN_UNROLL = 8  # loads a column's thread issues before their adds
_WARPS = 4  # warps per block of the row kernel: rows are independent, a small block spreads them over the SMs


def _combine_macro(kind: str) -> str:
    intrinsic, op = _COMBINE[kind]
    return (f"#if defined(__CUDACC__)\n#define COMBINE(a, b) {intrinsic}(a, b)\n#else\n"
            f"#define COMBINE(a, b) ((a) {op} (b))\n#endif")


def aten_tile(rows: int, cols: int) -> int:
    """The tile ATen's CUDA scan of the innermost dimension uses for `rows` rows of `cols`: 2^(L+1)
    elements, L = clamp((9 + ceil_log2(cols) - ceil_log2(rows)) / 2, 4, 9) in unsigned 32-bit arithmetic
    (ScanUtils.cuh, get_log_num_threads_x_inner_scan: a difference below -9 wraps around to L = 9)."""
    lx = 0
    while (1 << lx) < cols:
        lx += 1
    ly = 0
    while (1 << ly) < rows:
        ly += 1
    level = ((9 + ((lx - ly) & 0xFFFFFFFF)) & 0xFFFFFFFF) // 2
    return 2 << min(max(4, level), 9)


def scan_kernel(name: str, kind: str, shape: tuple[int, ...], dim: int, prologue: RowPrologue | None = None,
                output: RowPrologue | None = None, out_dtype: torch.dtype = torch.float32) -> KernelCode:
    """An inclusive `kind` scan of a contiguous fp32 tensor of `shape` along `dim`, in ATen's order
    (results equal to eager's on the GPU). Arguments: x — or, with a `prologue`, its inputs (in0..): the
    scan's input computed on load, never stored — then an `output` function's inputs (o0..), which maps
    each result (`yv`) to the value stored (of `out_dtype`), then y."""
    if kind not in SCANS:
        raise ValueError(f"unknown scan '{kind}': the template computes {', '.join(SCANS)}")
    shape = tuple(int(e) for e in shape)
    if not shape or any(e <= 0 for e in shape):
        raise ValueError(f"a scan needs a tensor with at least one dimension and no empty one, got {list(shape)}")
    rank = len(shape)
    if not -rank <= dim < rank:
        raise ValueError(f"dim {dim} is out of range for a tensor of rank {rank}")
    dim %= rank
    if prologue is not None and tuple(prologue.shape) != shape:
        raise ValueError(f"the prologue computes a {list(prologue.shape)} input, the scan's is {list(shape)}")
    if output is not None and (output.extra != ("yv",) or tuple(output.shape) != shape):
        raise ValueError(f"an output function reads 'yv' over {list(shape)}, got {output.extra} over "
                         f"{list(output.shape)}")
    if out_dtype not in CTYPE or out_dtype == torch.bool:
        raise ValueError(f"a scan stores fp32, fp16 or bf16 values, not {out_dtype}")
    outer, length, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])
    if max(outer * inner, length) > SCAN_EXTENT_MAX:
        raise ValueError(f"{kind} over {outer * inner} rows of {length}: past the template's 32-bit indexing "
                         f"({SCAN_EXTENT_MAX} elements per row, rows or columns)")
    if dim == rank - 1:
        return _row_scan(name, kind, outer, length, prologue, output, out_dtype)
    return _column_scan(name, kind, outer, length, inner, prologue, output, out_dtype)


def row_scan_layout(rows: int, cols: int) -> dict[str, int]:
    """How `_row_scan` lays out `rows` rows of `cols`: ATen's `tile`, `lanes` per row, `run` consecutive
    elements per lane and tile (8 where the tile allows: two 16-byte loads), `tiles` per stage (about 32
    values per lane in flight) and the number of `stages` per row.

    A row that fits in one of ATen's tiles takes the smallest power of two that holds it instead: element
    i of a Sklansky network only ever adds elements below it, at the levels of i's own bits, so its sums
    are the same in any tile that holds the row (100,000 rows of 7: ATen's tile is 1,024 elements, 512
    threads per row; here 8, a lane per row)."""
    tile = aten_tile(rows, cols)
    if cols <= tile:
        tile = max(8, 1 << (cols - 1).bit_length())
    lanes = min(32, tile // 8)
    run = tile // lanes
    tiles = max(1, min(32 // run, -(-cols // tile)))
    return {"tile": tile, "lanes": lanes, "run": run, "tiles": tiles, "stages": -(-cols // (tiles * tile))}




def _row_scan(name: str, kind: str, rows: int, cols: int, prologue: RowPrologue | None, output: RowPrologue | None,
              out_dtype: torch.dtype) -> KernelCode:
    """Rows of `cols` contiguous elements. Lanes p = 0..LANES-1 of a row hold elements [p RUN, (p+1) RUN) of
    each tile; a stage is TILES tiles; two register buffers alternate, one loading while the other is
    combined and stored.

    Loads never branch, so that a stage's loads are all in flight at once: rows past the end (whose lanes
    still take every shuffle) read the last row, and the tail of the last tile reads the row's last
    elements again. Neither reaches a stored value: a Sklansky level only carries lower elements into
    higher ones, so whatever fills a tile past the row's end stays there. The body is instantiated for
    16-byte and for scalar accesses and the kernel picks one by the pointers' alignment."""
    lay = row_scan_layout(rows, cols)
    tile, lanes, run, tiles, stages = lay["tile"], lay["lanes"], lay["run"], lay["tiles"], lay["stages"]
    per_warp = 32 // lanes
    vec = cols % 4 == 0  # every 4-aligned run of a row is whole: 16-byte accesses where the pointers allow
    store_vec = vec and out_dtype == torch.float32
    kinds = prologue.vector_kinds(cols) if prologue is not None and vec else None
    init, neutral = _INIT[kind], _NEUTRAL[kind]
    n = tiles * run

    params = ["const float* __restrict__ x"] if prologue is None else prologue.params()
    if output is not None:
        params += output.params()
    params.append(f"{CTYPE[out_dtype]}* __restrict__ y")
    names = ", ".join(p.split()[-1] for p in params)
    ptrs = prologue.pointers() if prologue is not None else ""
    optrs = output.pointers() if output is not None else ""
    # What must be 16-byte aligned for the vector path (COLS % 4 == 0 keeps every row's start aligned).
    aligned = (["x"] if prologue is None else []) + (["y"] if store_vec else [])
    if kinds:
        aligned += [i.key for i, k in zip(prologue.inputs, kinds) if k in ("row", "col", "based4")]
    aligned_expr = " | ".join(f"reinterpret_cast<unsigned long long>({p})" for p in aligned) or "0ULL"

    helpers: list[str] = []
    if prologue is not None:
        helpers += cached_prologue(name, prologue, kinds) if vec else prologue.value_function(name)
    if output is not None:
        helpers += cached_output(name, output) if store_vec else output.value_function(name, "o")

    def load(buf: str, stage: str) -> list[str]:
        L = ["{", f"  const int c0 = ({stage}) * {tiles * tile} + p * RUN;"]
        for d in range(tiles):
            if vec:
                for q in range(run // 4):
                    src = "load4(xr, c4, VEC)" if prologue is None else f"{name}_x4(lrow, c4, VEC{ptrs})"
                    e = d * run + 4 * q
                    L.append(f"  {{ const int c4 = upto(c0 + {d * tile + 4 * q}, (int)COLS - 4) >> 2; "
                             f"const float4 t = {src}; {buf}[{e}] = t.x; {buf}[{e + 1}] = t.y; {buf}[{e + 2}] = t.z; "
                             f"{buf}[{e + 3}] = t.w; }}")
            else:
                for j in range(run):
                    at = f"lrow * COLS + upto(c0 + {d * tile + j}, (int)COLS - 1)"
                    src = f"ld(x, {at})" if prologue is None else f"{name}_x({at}{ptrs})"
                    L.append(f"  {buf}[{d * run + j}] = {src};")
        return L + ["}"]

    def combine(buf: str, stage: str) -> list[str]:
        L = ["{", f"  const int c0 = ({stage}) * {tiles * tile} + p * RUN;"]
        for d in range(tiles):
            v = [f"{buf}[{d * run + j}]" for j in range(run)]
            L.append(f"  // tile {d}: the running total into its first element, then the Sklansky levels")
            L.append(f"  {v[0]} = COMBINE({v[0]}, p == 0 ? carry : {neutral});")
            s = 1
            while s < run:  # levels inside a lane's run: j takes the last element of its 2s block's lower half
                for j in range(run):
                    if j & s:
                        L.append(f"  {v[j]} = COMBINE({v[j]}, {v[(j & ~(2 * s - 1)) + s - 1]});")
                s *= 2
            s = 1
            while s < lanes:  # levels across lanes: each 2s-lane block's upper half takes its lower half's last
                L.append(f"  {{ const float t = __shfl_sync(0xffffffffu, {v[-1]}, (lane & ~{2 * s - 1}) + {s - 1}); "
                         f"const float u = (p & {s}) != 0 ? t : {neutral};")
                L += [f"    {v[j]} = COMBINE({v[j]}, u);" for j in range(run)]
                L.append("  }")
                s *= 2
            L.append(f"  carry = __shfl_sync(0xffffffffu, {v[-1]}, lane | {lanes - 1});")
            if store_vec:
                for q in range(run // 4):
                    value = f"make_float4({v[4 * q]}, {v[4 * q + 1]}, {v[4 * q + 2]}, {v[4 * q + 3]})"
                    if output is not None:
                        value = f"{name}_o4(row, c >> 2, {value}{optrs})"
                    L.append(f"  {{ const int c = c0 + {d * tile + 4 * q}; "
                             f"if (ok && c < COLS) store4(yr, c >> 2, {value}, VEC); }}")
            else:
                for j in range(run):
                    value = v[j] if output is None else f"{name}_o(row * COLS + c, {v[j]}{optrs})"
                    L.append(f"  {{ const int c = c0 + {d * tile + j}; "
                             f"if (ok && c < COLS) st(y, row * COLS + c, {value}); }}")
        return L + ["}"]

    def indent(lines: list[str], depth: int) -> list[str]:
        return [" " * depth + line for line in lines]

    fused = ""
    if prologue is not None:
        fused += f", {len(prologue.body)} elementwise op(s) fused into the loads" + (" (16-byte)" if kinds else "")
    if output is not None:
        fused += f", {len(output.body)} elementwise op(s) applied before the store"
    what = (f"{kind} over {rows} rows of {cols} in ATen's order (tiles of {tile}, Sklansky network, running total "
            f"carried): {lanes} lanes per row, {run} consecutive elements per lane in registers, "
            + (f"{tiles} tile(s) per stage with the next stage's loads in flight, " if stages > 1 else "one stage, ")
            + f"{'16-byte' if vec else 'scalar'} accesses{fused}")
    L = [PRELUDE, _combine_macro(kind),
         f"#define ROWS {rows}LL", f"#define COLS {cols}LL", f"#define LANES {lanes}", f"#define RUN {run}",
         "__device__ __forceinline__ int upto(int c, int last) { return c < last ? c : last; }",
         *([VECTOR_IO] if vec else []), *helpers,
         f"// {name}: {what}",
         "template <bool VEC>",
         f"__device__ __forceinline__ void {name}_rows({', '.join(params)}) {{",
         "  const int lane = threadIdx.x & 31, p = lane & (LANES - 1);",
         f"  const long long row = ((long long)blockIdx.x * {_WARPS} + (threadIdx.x >> 5)) * {per_warp} "
         "+ lane / LANES;",
         "  const bool ok = row < ROWS;",
         "  const long long lrow = ok ? row : ROWS - 1;  // the row a lane loads: rows past the end read the last",
         *(["  const float* xr = x + lrow * COLS;"] if prologue is None and vec else []),
         *(["  float* yr = y + row * COLS;"] if store_vec else []),
         f"  float carry = {init};",
         f"  float a[{n}], b[{n}];",
         *indent(load("a", "0"), 2),
         "#pragma unroll 1",
         f"  for (int s = 0; s < {stages}; s += 2) {{",
         f"    if (s + 1 < {stages}) {{  // the next stage's loads go out before this one is combined",
         *indent(load("b", "s + 1"), 6),
         "    }",
         *indent(combine("a", "s"), 4),
         f"    if (s + 1 >= {stages}) break;",
         f"    if (s + 2 < {stages}) {{",
         *indent(load("a", "s + 2"), 6),
         "    }",
         *indent(combine("b", "s + 1"), 4),
         "  }",
         "}",
         f'extern "C" __global__ void __launch_bounds__({32 * _WARPS}) {name}({", ".join(params)}) {{',
         *([f"  if ((({aligned_expr}) & 15ULL) == 0) {name}_rows<true>({names});",
            f"  else {name}_rows<false>({names});"] if vec else [f"  {name}_rows<false>({names});"]),
         "}"]
    args: list[tuple[str, object]] = [("in", "x")] if prologue is None else [("in", i.key) for i in prologue.inputs]
    if output is not None:
        args += [("in", i.key) for i in output.inputs]
    args.append(("out", "y"))
    rows_per_block = _WARPS * per_warp
    return KernelCode("\n".join(L) + "\n", name, -(-rows // rows_per_block), 32 * _WARPS, args, what,
                      vectorized=vec)


def _column_scan(name: str, kind: str, outer: int, length: int, inner: int, prologue: RowPrologue | None,
                 output: RowPrologue | None, out_dtype: torch.dtype) -> KernelCode:
    """A middle dimension of [outer, length, inner]: a thread per column (o, i), consecutive threads on
    consecutive i, each adding down its column in order as ATen does; a step issues eight loads before its
    eight adds so that a thread has several loads in flight."""
    init = _INIT[kind]
    columns = outer * inner
    params = ["const float* __restrict__ x"] if prologue is None else prologue.params()
    if output is not None:
        params += output.params()
    params.append(f"{CTYPE[out_dtype]}* __restrict__ y")
    X = (lambda i: f"ld(x, {i})") if prologue is None else (lambda i: f"{name}_x({i}{prologue.pointers()})")
    Y = (lambda i, v: f"st(y, {i}, {v})") if output is None else \
        (lambda i, v: f"st(y, {i}, {name}_o({i}, {v}{output.pointers()}))")
    u = _COLUMN_UNROLL
    fused = ""
    if prologue is not None:
        fused += f", {len(prologue.body)} elementwise op(s) fused into the loads"
    if output is not None:
        fused += f", {len(output.body)} elementwise op(s) applied before the store"
    what = (f"{kind} down {columns} columns of {length} ([{outer}, {length}, {inner}]) in ATen's order: a thread "
            f"per column, sequential, {u} loads ahead{fused}")
    L = [PRELUDE, _combine_macro(kind), *(prologue.value_function(name) if prologue is not None else []),
         *(output.value_function(name, "o") if output is not None else []),
         f"// {name}: {what}",
         f"#define LEN {length}LL", f"#define INNER {inner}LL",
         f'extern "C" __global__ void __launch_bounds__(256) {name}({", ".join(params)}) {{',
         "  const long long col = (long long)blockIdx.x * 256 + threadIdx.x;",
         f"  if (col >= {columns}LL) return;",
         "  const long long o = col / INNER;",
         "  const long long base = o * (LEN * INNER) + (col - o * INNER);",
         f"  float acc = {init};",
         "  long long l = 0;",
         f"  for (; l + {u} <= LEN; l += {u}) {{",
         f"    float t[{u}];",
         "#pragma unroll",
         f"    for (int k = 0; k < {u}; ++k) t[k] = {X('base + (l + k) * INNER')};",
         "#pragma unroll",
         f"    for (int k = 0; k < {u}; ++k) {{ acc = COMBINE(acc, t[k]); {Y('base + (l + k) * INNER', 'acc')}; }}",
         "  }",
         f"  for (; l < LEN; ++l) {{ acc = COMBINE(acc, {X('base + l * INNER')}); {Y('base + l * INNER', 'acc')}; }}",
         "}"]
    args: list[tuple[str, object]] = [("in", "x")] if prologue is None else [("in", i.key) for i in prologue.inputs]
    if output is not None:
        args += [("in", i.key) for i in output.inputs]
    args.append(("out", "y"))
    return KernelCode("\n".join(L) + "\n", name, -(-columns // 256), 256, args, what)
