"""What every template shares: the CUDA prelude (typed loads and stores, NaN-propagating max/min),
the generated kernel's description, and the elementwise inputs and functions other kernels call."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

PRELUDE = r"""#include <cuda_fp16.h>
#include <cuda_bf16.h>
__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, long long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float ld(const bool* p, long long i) { return p[i] ? 1.0f : 0.0f; }
__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(__half* p, long long i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void st(__nv_bfloat16* p, long long i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void st(bool* p, long long i, float v) { p[i] = v != 0.0f; }
// NaN-propagating max/min, as torch.maximum / torch.amax behave. Written as one select (a + b is NaN
// when either is), which compiles without branches: nested conditionals put every load of an unrolled
// reduction loop in its own basic block, one load in flight per thread.
__device__ __forceinline__ float nanmax(float a, float b) { const float m = fmaxf(a, b); return (a != a || b != b) ? a + b : m; }
__device__ __forceinline__ float nanmin(float a, float b) { const float m = fminf(a, b); return (a != a || b != b) ? a + b : m; }
"""

# 16-byte loads and stores of four consecutive floats, scalar ones where the address is not 16-byte
# aligned (`vec`): the register-row kernels' and the scans' access to a row.
VECTOR_IO = r"""
__device__ __forceinline__ float4 load4(const float* p, int c4, bool vec) {
  return vec ? reinterpret_cast<const float4*>(p)[c4]
             : make_float4(p[4 * c4], p[4 * c4 + 1], p[4 * c4 + 2], p[4 * c4 + 3]);
}
__device__ __forceinline__ void store4(float* p, int c4, float4 v, bool vec) {
  if (vec) { reinterpret_cast<float4*>(p)[c4] = v; return; }
  p[4 * c4] = v.x; p[4 * c4 + 1] = v.y; p[4 * c4 + 2] = v.z; p[4 * c4 + 3] = v.w;
}
"""

# The same four-value accesses of 16-bit rows: one 8-byte load or store of four halves (converted to and
# from fp32 in registers, rounded once at the store), scalar where the address is not aligned. Each overload
# is one line, so a source stripped of its 16-bit lines (the CUDA emulator's fp32 build) stays whole. Only
# kernels with a 16-bit operand include them: an fp32 kernel's source is unchanged.
VECTOR_IO_16 = r"""
__device__ __forceinline__ float4 load4(const __half* p, int c4, bool vec) { if (vec) { const uint2 u = reinterpret_cast<const uint2*>(p)[c4]; const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x)), b = __half22float2(*reinterpret_cast<const __half2*>(&u.y)); return make_float4(a.x, a.y, b.x, b.y); } return make_float4(__half2float(p[4 * c4]), __half2float(p[4 * c4 + 1]), __half2float(p[4 * c4 + 2]), __half2float(p[4 * c4 + 3])); }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p, int c4, bool vec) { if (vec) { const uint2 u = reinterpret_cast<const uint2*>(p)[c4]; const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x)), b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y)); return make_float4(a.x, a.y, b.x, b.y); } return make_float4(__bfloat162float(p[4 * c4]), __bfloat162float(p[4 * c4 + 1]), __bfloat162float(p[4 * c4 + 2]), __bfloat162float(p[4 * c4 + 3])); }
__device__ __forceinline__ void store4(__half* p, int c4, float4 v, bool vec) { const __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w); if (vec) { uint2 u; u.x = *reinterpret_cast<const unsigned*>(&a); u.y = *reinterpret_cast<const unsigned*>(&b); reinterpret_cast<uint2*>(p)[c4] = u; return; } p[4 * c4] = a.x; p[4 * c4 + 1] = a.y; p[4 * c4 + 2] = b.x; p[4 * c4 + 3] = b.y; }
__device__ __forceinline__ void store4(__nv_bfloat16* p, int c4, float4 v, bool vec) { const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w); if (vec) { uint2 u; u.x = *reinterpret_cast<const unsigned*>(&a); u.y = *reinterpret_cast<const unsigned*>(&b); reinterpret_cast<uint2*>(p)[c4] = u; return; } p[4 * c4] = a.x; p[4 * c4 + 1] = a.y; p[4 * c4 + 2] = b.x; p[4 * c4 + 3] = b.y; }
"""

# Eight consecutive values per access of the 16-bit elementwise kernels: one 16-byte load or store of eight
# halves, two float4 of fp32 (an operand of another dtype in the same kernel), fp32 math in between and
# one rounding at the store. `v` counts groups of eight. One line per 16-bit overload, as above.
VECTOR8_IO = r"""
__device__ __forceinline__ void load8(const float* p, long long v, float* o) {
  const float4 a = reinterpret_cast<const float4*>(p)[2 * v], b = reinterpret_cast<const float4*>(p)[2 * v + 1];
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
__device__ __forceinline__ void store8(float* p, long long v, const float* o) {
  reinterpret_cast<float4*>(p)[2 * v] = make_float4(o[0], o[1], o[2], o[3]);
  reinterpret_cast<float4*>(p)[2 * v + 1] = make_float4(o[4], o[5], o[6], o[7]);
}
__device__ __forceinline__ void load8(const __half* p, long long v, float* o) { const uint4 u = reinterpret_cast<const uint4*>(p)[v]; const __half2* h = reinterpret_cast<const __half2*>(&u); for (int j = 0; j < 4; ++j) { const float2 f = __half22float2(h[j]); o[2 * j] = f.x; o[2 * j + 1] = f.y; } }
__device__ __forceinline__ void load8(const __nv_bfloat16* p, long long v, float* o) { const uint4 u = reinterpret_cast<const uint4*>(p)[v]; const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u); for (int j = 0; j < 4; ++j) { const float2 f = __bfloat1622float2(h[j]); o[2 * j] = f.x; o[2 * j + 1] = f.y; } }
__device__ __forceinline__ void store8(__half* p, long long v, const float* o) { uint4 u; __half2* h = reinterpret_cast<__half2*>(&u); for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(o[2 * j], o[2 * j + 1]); reinterpret_cast<uint4*>(p)[v] = u; }
__device__ __forceinline__ void store8(__nv_bfloat16* p, long long v, const float* o) { uint4 u; __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u); for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(o[2 * j], o[2 * j + 1]); reinterpret_cast<uint4*>(p)[v] = u; }
"""

HALF_DTYPES = (torch.float16, torch.bfloat16)

CTYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.bool: "bool"}
FUSABLE_DTYPES = set(CTYPE)


@dataclass
class KernelCode:
    """A generated kernel: source, entry point, launch geometry and the arguments' order."""

    source: str
    name: str
    grid: int | tuple[int, ...]
    block: int | tuple[int, ...]
    args: list[tuple[str, object]] = field(default_factory=list)  # ("in"/"out", key) or ("i64", value)
    description: str = ""
    vectorized: bool = False
    shared_mem: int = 0  # dynamic shared memory per block (bytes)
    extent: "Extent | None" = None  # the outer extent its source leaves to the launch, if any

    def at(self, value: int) -> "KernelCode":
        """This kernel launched for another outer extent (`extent.value`'s meaning: the elements of a pointwise
        kernel, the rows of a row reduction, the images of a layout conversion): the same source, so one
        compiled kernel serves every size it allows, with the extent's argument and the grid computed from
        `value`. ValueError, naming the reason, where the source was written for sizes `value` is not."""
        e = self.extent
        if e is None:
            raise ValueError(f"kernel {self.name} fixes every extent in its source: generate it for the new size")
        why = e.refuses(value)
        if why:
            raise ValueError(f"kernel {self.name} cannot serve {value}: {why}; generate it for that size")
        args = list(self.args)
        if e.arg is not None:
            args[e.arg] = (args[e.arg][0], value)
        blocks = e.blocks(value)
        grid = blocks if isinstance(self.grid, int) else tuple(
            blocks if a == e.axis else g for a, g in enumerate(self.grid))
        return dataclasses.replace(self, args=args, grid=grid)


@dataclass(frozen=True)
class Extent:
    """How a kernel follows its outermost extent without a new source (a batch that varies): `value`, the
    extent as generated (in the unit of the kernel's argument `arg` — an index into KernelCode.args — or of
    grid dimension `axis` alone where no argument carries it), and the grid along `axis`: ceil(value * scale
    / unit) blocks, at most `cap` (0: no cap; a grid-stride loop covers the rest). The source serves the
    multiples of `align` in 1..`limit` (0: no limit): float4 loads need whole vectors, 32-bit index
    arithmetic a bound, a grid dimension its 65,535."""

    value: int
    arg: int | None
    axis: int = 0
    unit: int = 1
    scale: int = 1
    cap: int = 0
    align: int = 1
    limit: int = 0

    def blocks(self, value: int) -> int:
        n = max(1, -(-(value * self.scale) // self.unit))
        return min(n, self.cap) if self.cap else n

    def refuses(self, value: int) -> str:
        """Why the source does not serve `value` ("" when it does)."""
        if value < 1:
            return "an extent below 1"
        if value % self.align:
            return f"its source takes multiples of {self.align}"
        if self.limit and value > self.limit:
            return f"its source's index arithmetic holds at most {self.limit}"
        return ""



def images_extent(value: int, args: list, per_image: int, per_block: int, cap: int, output: "RowPrologue | None",
                  limit: int = 0) -> "Extent | None":
    """The Extent of an image kernel (pooling, a depthwise convolution) whose last argument counts what it
    covers (`value`, `per_image` of it an image, `per_block` a block of its grid-stride loop, at most `cap`
    blocks): any number of images, unless an output function's coordinates were written for one image
    (an extent of 1 leaves its coordinate out of the function's indices)."""
    if output is not None and value <= per_image:
        return None
    return Extent(value, len(args) - 1, unit=per_block, cap=cap, align=per_image, limit=limit)


@dataclass
class PointwiseInput:
    """One tensor a pointwise kernel reads, with its strides (elements) over the group's output shape."""

    key: str
    dtype: torch.dtype
    strides: tuple[int, ...]  # 0 where broadcast
    offset: int = 0
    # Read rotated by half along the last dimension, as RoPE's rotate_half(x) = cat(-x[..., h:], x[..., :h])
    # reads x: h (half the last extent) for such an input, 0 otherwise. Element c of the last dimension is
    # x's element (c + h) mod 2h, negated for c < h.
    rotate: int = 0
    # A concatenation read in place (`aten::cat` in an elementwise chain): its pieces along dimension
    # `cat_dim` of the group's shape, each loaded where the coordinate falls in its range; `key`, `strides`
    # and `offset` are then unused. A kernel takes one pointer per piece.
    pieces: tuple["CatPiece", ...] = ()
    cat_dim: int = -1

    def linear(self, shape: tuple[int, ...]) -> bool:
        if self.rotate or self.pieces:
            return False
        expected = 1
        for extent, stride in zip(reversed(shape), reversed(self.strides)):
            if extent != 1 and stride != expected:
                return False
            expected *= extent
        return self.offset == 0


@dataclass(frozen=True)
class CatPiece:
    """One piece of a concatenation read in place: its buffer's key, its strides over the group's shape
    and the range [start, end) it covers along the concatenated dimension."""

    key: str
    strides: tuple[int, ...]
    start: int
    end: int


def piece_params(k: int, inp: PointwiseInput, ctype: str) -> list[str]:
    """A kernel's pointer parameters for input `k`: p{k}, or p{k}_0.. for a concatenation's pieces."""
    if not inp.pieces:
        return [f"const {ctype}* __restrict__ p{k}"]
    return [f"const {ctype}* __restrict__ p{k}_{j}" for j in range(len(inp.pieces))]


def piece_args(inp: PointwiseInput) -> list[tuple[str, str]]:
    """The ("in", key) arguments of an input, in piece_params' order."""
    return [("in", piece.key) for piece in inp.pieces] if inp.pieces else [("in", inp.key)]


def _piece_index(inp: PointwiseInput, piece: CatPiece, shape: tuple[int, ...]) -> str:
    """A piece's element index from the coordinates c0.., its own coordinate along the concatenated
    dimension counted from its start."""
    terms = []
    for d, stride in enumerate(piece.strides):
        if stride == 0 or shape[d] == 1:
            continue
        c = f"(c{d} - {piece.start})" if d == inp.cat_dim and piece.start else f"c{d}"
        terms.append(f"{c} * {stride}LL")
    return " + ".join(terms) or "0"


def piece_select(k: int, inp: PointwiseInput, shape: tuple[int, ...], load) -> str:
    """The C expression choosing input `k`'s piece by its coordinate along the concatenated dimension:
    load(pointer, index, piece) for the piece whose range holds it (only that one is read)."""
    parts = [load(f"p{k}_{j}", _piece_index(inp, piece, shape), piece) for j, piece in enumerate(inp.pieces)]
    expr = parts[-1]
    for j in range(len(parts) - 2, -1, -1):
        expr = f"(c{inp.cat_dim} < {inp.pieces[j].end} ? {parts[j]} : {expr})"
    return expr


def split_coordinates(value: str, shape: tuple[int, ...], dims: list[int]) -> list[str]:
    """Statements splitting the flat `value` into the coordinates c{d} of `dims` (innermost last). 32-bit
    when the extents allow: a division by a constant is then a multiply-high and a shift, where a 64-bit
    one costs several times that — per element, in a kernel whose index arithmetic can outweigh its
    arithmetic (a batch norm's parameters read by channel in an epilogue)."""
    n = 1
    for d in dims:
        n *= shape[d]
    t, suffix = ("unsigned", "u") if n < 2 ** 31 else ("long long", "LL")
    # The outermost coordinate is what the others leave (the value lies within the extents): its extent
    # stays out of the source, so one kernel serves every size of it (a batch that varies).
    return [f"{t} r = ({t})({value});"] + [f"const {t} c{d} = r % {shape[d]}{suffix}; r /= {shape[d]}{suffix};"
                                           for d in reversed(dims[1:])] + [f"const {t} c{d} = r;" for d in dims[:1]]


def element_index(inp: PointwiseInput, shape: tuple[int, ...], dims: int | None = None) -> str:
    """C expression of `inp`'s element index from the coordinates c0.. of its first `dims` dimensions (all by
    default), broadcast dimensions left out."""
    dims = len(shape) if dims is None else dims
    last = len(shape) - 1
    terms = [(f"((c{d} + {inp.rotate}) % {2 * inp.rotate})" if inp.rotate and d == last else f"c{d}")
             + f" * {inp.strides[d]}LL" for d in range(dims) if inp.strides[d] != 0 and shape[d] != 1]
    return " + ".join(terms + ([f"{inp.offset}LL"] if inp.offset else [])) or "0"


def element_indices(shape: tuple[int, ...], inputs: list[PointwiseInput]) -> tuple[list[str], list[str]]:
    """For the element at flat index `i` of `shape`: the statements splitting i into coordinates c0..
    (none when every input is laid out like the output) and each input's element index."""
    coords: list[str] = []
    if not all(inp.linear(shape) for inp in inputs):
        coords += split_coordinates("i", shape, list(range(len(shape))))
    indices = []
    for inp in inputs:
        if inp.linear(shape):
            indices.append("i")
            continue
        indices.append("" if inp.pieces else element_index(inp, shape))  # pieces: piece_select
    return coords, indices



@dataclass
class RowPrologue:
    """Elementwise ops computing the reduction's input from other tensors, fused into its loads: `body`
    are C statements over `in0..inK` (the inputs' values) ending in the float variable `result`; each
    input's strides are over `shape`, the reduction input's shape (0 where broadcast)."""

    shape: tuple[int, ...]
    inputs: list[PointwiseInput]
    body: list[str]
    result: str
    extra: tuple[str, ...] = ()  # float values the body reads besides its inputs (an epilogue's "stat")

    def params(self) -> list[str]:
        return [f"const {CTYPE[i.dtype]}* __restrict__ {i.key}" for i in self.inputs]

    def pointers(self) -> str:
        """The inputs as trailing call arguments (", in0, in1"), "" when there are none."""
        return "".join(f", {i.key}" for i in self.inputs)

    def value_function(self, name: str, suffix: str = "x") -> list[str]:
        """`{name}_{suffix}(i, [extra..], in0, ..)`: the value at flat index i (of the reduction input for a
        prologue, of the output for an epilogue)."""
        shape = self.shape
        params = ", ".join(["long long i", *[f"float {e}" for e in self.extra],
                            *[f"const {CTYPE[i.dtype]}* __restrict__ p_{i.key}" for i in self.inputs]])
        L = [f"__device__ __forceinline__ float {name}_{suffix}({params}) {{"]
        coords, indices = element_indices(shape, self.inputs)
        L += [f"  {c}" for c in coords]
        L += [f"  const float {inp.key} = ld(p_{inp.key}, {index});" for inp, index in zip(self.inputs, indices)]
        L += [f"  {b}" for b in self.body] + [f"  return {self.result};", "}"]
        return L

    def coordinate_function(self, name: str, suffix: str = "o") -> list[str]:
        """`{name}_{suffix}c(c0, .., c{r-1}, [extra..], in0, ..)`: the same value at coordinates the caller
        already holds — no division, and the loads of an operand broadcast along the dimensions the
        caller varies (a per-channel parameter across a thread's four outputs) are one load the
        compiler shares between the calls."""
        shape = self.shape
        params = ", ".join([*[f"long long c{d}" for d in range(len(shape))], *[f"float {e}" for e in self.extra],
                            *[f"const {CTYPE[i.dtype]}* __restrict__ p_{i.key}" for i in self.inputs]])
        L = [f"__device__ __forceinline__ float {name}_{suffix}c({params}) {{"]
        for inp in self.inputs:
            L.append(f"  const float {inp.key} = ld(p_{inp.key}, {element_index(inp, shape)});")
        L += [f"  {b}" for b in self.body] + [f"  return {self.result};", "}"]
        return L

    def vector_kinds(self, cols: int, half: bool = False) -> list[str] | None:
        """Per input, how the register path reads four consecutive values of a row — "row" (fp32, the
        reduction input's own layout: one 16-byte load), "col" (fp32, a vector over the reduced dimensions
        repeated over rows: one 16-byte load), "scalar" (one value), and, when only the last dimension is
        reduced, "based4"/"based1" (unit stride along it from a base that depends on the row: a causal mask
        [S, S] over [B, H, S, S] scores; one 16-byte load when fp32 with 16-byte row bases, else four loads)
        and "per_row" (one value per row) — or None when some input fits none of them. With `half` (the
        kernel has VECTOR_IO_16's overloads) fp16/bf16 operands take "row" and "col" too: one 8-byte load."""
        kinds = []
        full = self.shape
        last_only = bool(full) and full[-1] == cols
        for inp in self.inputs:
            fp32 = inp.dtype == torch.float32 or (half and inp.dtype in HALF_DTYPES)
            if fp32 and not inp.offset and inp.linear(full):
                kinds.append("row")
                continue
            if all(st == 0 for st in inp.strides):
                kinds.append("scalar")
                continue
            if fp32 and not inp.offset and self._repeated_over_rows(inp, cols):
                kinds.append("col")
                continue
            if last_only and (inp.strides[-1] in (0, 1) or cols == 1):
                if inp.strides[-1] == 0 or cols == 1:
                    kinds.append("per_row")
                else:
                    whole = fp32 and inp.offset % 4 == 0 and all(
                        st % 4 == 0 for d, st in enumerate(inp.strides[:-1]) if full[d] != 1)
                    kinds.append("based4" if whole else "based1")
                continue
            return None
        return kinds

    def _repeated_over_rows(self, inp: PointwiseInput, cols: int) -> bool:
        """Whether `inp` is one contiguous vector over the reduced (trailing) dimensions, broadcast over rows."""
        full = self.shape
        tail, n = [], 1
        for d in range(len(full) - 1, -1, -1):
            if n == cols:
                break
            tail.append(d)
            n *= full[d]
        expected, ok = 1, n == cols
        for d in tail:
            if full[d] != 1 and inp.strides[d] != expected:
                ok = False
            expected *= full[d]
        return ok and all(inp.strides[d] == 0 or full[d] == 1 for d in range(len(full)) if d not in tail)


def nhwc_pixel_loop(c4: int, oh: int, ow: int) -> list[str]:
    """The grid-stride loop of a channels-last kernel over `total` (a value of the kernel's, from its
    arguments: N x OH x OW x C/4) items, each four consecutive channels (c) of one output pixel (n, oy,
    ox): adjacent threads take adjacent channels, so their 16-byte loads and stores are coalesced. Opens
    the loop body; the caller closes it."""
    return ["  for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < total; "
            "g += (long long)gridDim.x * blockDim.x) {",
            f"    const int c = (int)(g % {c4}LL) * 4;",
            f"    long long rest = g / {c4}LL;",
            f"    const int ox = (int)(rest % {ow}LL);",
            f"    rest /= {ow}LL;",
            f"    const int oy = (int)(rest % {oh}LL);",
            f"    const long long n = rest / {oh}LL;"]
