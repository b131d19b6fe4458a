"""The template Coder: readable CUDA C++ for each fused group the offline Planner forms.

- pointwise groups: one expression body per element, broadcasting and arbitrary input strides through
  index arithmetic; a 16-byte (float4) vectorized path when every operand is contiguous fp32 of the
  output's shape;
- row reductions over the trailing contiguous dimensions: online softmax / log-softmax, one-pass
  (Welford) layer norm, sum / mean / amax / amin — a warp per row for short rows, a block per row with
  a shared-memory combine of the warps' partials for long ones; long fp32 rows of softmax, log-softmax
  and layer/group norm (up to 32,768 elements) are held in registers, so that memory sees one read and
  one write per element with 16-byte accesses; elementwise prologues (computing the input on load),
  epilogues (applying a statistic to its row) and output functions (on each result before the store)
  fuse the ops around a reduction into its kernel.

Every kernel is `extern "C"`, computes in fp32 (fp16/bf16 are converted on load and store) and takes its
sizes as arguments where they vary; shapes that select the code path are baked in as constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["KernelCode", "PointwiseInput", "RowPrologue", "pointwise_kernel", "row_reduction_kernel",
           "column_reduction_kernel", "depthwise_conv_kernel", "POINTWISE_OPS", "REDUCTIONS", "is_pointwise"]

_PRELUDE = r"""#include <cuda_fp16.h>
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

_CTYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.bool: "bool"}
FUSABLE_DTYPES = set(_CTYPE)


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


def _lit(x: float) -> str:
    x = float(x)
    if math.isnan(x):
        return "__int_as_float(0x7fc00000)"
    if math.isinf(x):
        return "__int_as_float(0x7f800000)" if x > 0 else "__int_as_float(0xff800000)"
    return f"{x!r}f"


def _scalar(a) -> str | None:
    if isinstance(a, bool):
        return "1.0f" if a else "0.0f"
    if isinstance(a, (int, float)):
        return _lit(a)
    return None


# Each entry: (op name, function of (args as C expressions or Python scalars, kwargs) -> C expression).
def _binary(fmt: str) -> Callable:
    def emit(a, kw):
        x, y = a[0], a[1]
        alpha = kw.get("alpha", a[2] if len(a) > 2 else None)
        if alpha not in (1, 1.0, None, "1.0f"):
            y = f"({alpha if isinstance(alpha, str) else _lit(alpha)} * {y})"
        return fmt.format(x=x, y=y)
    return emit


def _unary(fmt: str) -> Callable:
    return lambda a, kw: fmt.format(x=a[0])


def _gelu(a, kw):
    approximate = kw.get("approximate", a[1] if len(a) > 1 else "none")
    x = a[0]
    if approximate == "tanh":
        return f"(0.5f * {x} * (1.0f + tanhf(0.7978845608028654f * ({x} + 0.044715f * {x} * {x} * {x}))))"
    return f"({x} * 0.5f * (1.0f + erff({x} * 0.7071067811865476f)))"


def _clamp(a, kw):
    x = a[0]
    lo = kw.get("min", a[1] if len(a) > 1 else None)
    hi = kw.get("max", a[2] if len(a) > 2 else None)
    if lo is not None:
        x = f"nanmax({x}, {lo})"
    if hi is not None:
        x = f"nanmin({x}, {hi})"
    return x


def _pow(a, kw):
    e = a[1]
    if e in ("2.0f", "2"):
        return f"({a[0]} * {a[0]})"
    if e in ("0.5f",):
        return f"sqrtf({a[0]})"
    return f"powf({a[0]}, {e})"


def _where(a, kw):
    return f"(({a[0]}) != 0.0f ? ({a[1]}) : ({a[2]}))"


def _hardtanh(a, kw):
    lo = a[1] if len(a) > 1 else "-1.0f"
    hi = a[2] if len(a) > 2 else "1.0f"
    return f"nanmin(nanmax({a[0]}, {lo}), {hi})"


def _leaky(a, kw):
    slope = a[1] if len(a) > 1 else kw.get("negative_slope", "0.01f")
    return f"({a[0]} > 0.0f ? {a[0]} : {a[0]} * {slope})"


def _batch_norm(a, kw):
    # _native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps)
    x, w, b, mean, var = a[0], a[1], a[2], a[3], a[4]
    eps = a[6] if len(a) > 6 else kw.get("eps", "1e-05f")
    y = f"(({x} - {mean}) * rsqrtf({var} + {eps}))"
    if w not in (None, "None"):
        y = f"({y} * {w})"
    if b not in (None, "None"):
        y = f"({y} + {b})"
    return y


POINTWISE_OPS: dict[str, Callable] = {
    "aten::add.Tensor": _binary("({x} + {y})"), "aten::add.Scalar": _binary("({x} + {y})"),
    "aten::sub.Tensor": _binary("({x} - {y})"), "aten::sub.Scalar": _binary("({x} - {y})"),
    "aten::rsub.Scalar": _binary("({y} - {x})"),
    "aten::mul.Tensor": _binary("({x} * {y})"), "aten::mul.Scalar": _binary("({x} * {y})"),
    "aten::div.Tensor": _binary("({x} / {y})"), "aten::div.Scalar": _binary("({x} / {y})"),
    "aten::maximum": _binary("nanmax({x}, {y})"), "aten::minimum": _binary("nanmin({x}, {y})"),
    "aten::neg": _unary("(-{x})"), "aten::relu": _unary("({x} != {x} ? {x} : fmaxf({x}, 0.0f))"),
    "aten::sigmoid": _unary("(1.0f / (1.0f + expf(-{x})))"), "aten::tanh": _unary("tanhf({x})"),
    "aten::exp": _unary("expf({x})"), "aten::log": _unary("logf({x})"), "aten::log1p": _unary("log1pf({x})"),
    "aten::expm1": _unary("expm1f({x})"), "aten::sqrt": _unary("sqrtf({x})"), "aten::rsqrt": _unary("rsqrtf({x})"),
    "aten::abs": _unary("fabsf({x})"), "aten::sin": _unary("sinf({x})"), "aten::cos": _unary("cosf({x})"),
    "aten::erf": _unary("erff({x})"), "aten::reciprocal": _unary("(1.0f / {x})"),
    "aten::floor": _unary("floorf({x})"), "aten::ceil": _unary("ceilf({x})"), "aten::trunc": _unary("truncf({x})"),
    "aten::silu": _unary("({x} / (1.0f + expf(-{x})))"), "aten::gelu": _gelu,
    "aten::clamp": _clamp, "aten::clamp_min": lambda a, kw: f"nanmax({a[0]}, {a[1]})",
    "aten::clamp_max": lambda a, kw: f"nanmin({a[0]}, {a[1]})",
    "aten::pow.Tensor_Scalar": _pow, "aten::pow.Tensor_Tensor": lambda a, kw: f"powf({a[0]}, {a[1]})",
    "aten::where.self": _where, "aten::hardtanh": _hardtanh, "aten::leaky_relu": _leaky,
    "aten::eq.Tensor": _binary("(float)({x} == {y})"), "aten::eq.Scalar": _binary("(float)({x} == {y})"),
    "aten::ne.Tensor": _binary("(float)({x} != {y})"), "aten::ne.Scalar": _binary("(float)({x} != {y})"),
    "aten::gt.Tensor": _binary("(float)({x} > {y})"), "aten::gt.Scalar": _binary("(float)({x} > {y})"),
    "aten::ge.Tensor": _binary("(float)({x} >= {y})"), "aten::ge.Scalar": _binary("(float)({x} >= {y})"),
    "aten::lt.Tensor": _binary("(float)({x} < {y})"), "aten::lt.Scalar": _binary("(float)({x} < {y})"),
    "aten::le.Tensor": _binary("(float)({x} <= {y})"), "aten::le.Scalar": _binary("(float)({x} <= {y})"),
    "aten::logical_not": _unary("(float)({x} == 0.0f)"),
    "aten::_to_copy": _unary("{x}"), "aten::clone": _unary("{x}"), "aten::alias": _unary("{x}"),
    "aten::_native_batch_norm_legit_no_training": _batch_norm,
}


def is_pointwise(op: str) -> bool:
    return op in POINTWISE_OPS


@dataclass
class PointwiseInput:
    """One tensor a pointwise kernel reads, with its strides (elements) over the group's output shape."""

    key: str
    dtype: torch.dtype
    strides: tuple[int, ...]  # 0 where broadcast
    offset: int = 0

    def linear(self, shape: tuple[int, ...]) -> bool:
        expected = 1
        for extent, stride in zip(reversed(shape), reversed(self.strides)):
            if extent != 1 and stride != expected:
                return False
            expected *= extent
        return self.offset == 0


def _split(value: str, shape: tuple[int, ...], dims: list[int]) -> list[str]:
    """Statements splitting the flat `value` into the coordinates c{d} of `dims` (innermost last). 32-bit
    when the extents allow: a division by a constant is then a multiply-high and a shift, where a 64-bit
    one costs several times that — per element, in a kernel whose index arithmetic can outweigh its
    arithmetic (a batch norm's parameters read by channel in an epilogue)."""
    n = 1
    for d in dims:
        n *= shape[d]
    t, suffix = ("unsigned", "u") if n < 2 ** 31 else ("long long", "LL")
    return [f"{t} r = ({t})({value});"] + [f"const {t} c{d} = r % {shape[d]}{suffix}; r /= {shape[d]}{suffix};"
                                           for d in reversed(dims)]


def _element_indices(shape: tuple[int, ...], inputs: list[PointwiseInput]) -> tuple[list[str], list[str]]:
    """For the element at flat index `i` of `shape`: the statements splitting i into coordinates c0..
    (none when every input is laid out like the output) and each input's element index."""
    coords: list[str] = []
    if not all(inp.linear(shape) for inp in inputs):
        coords += _split("i", shape, list(range(len(shape))))
    indices = []
    for inp in inputs:
        if inp.linear(shape):
            indices.append("i")
            continue
        terms = [f"c{d} * {st}LL" for d, st in enumerate(inp.strides) if st != 0 and shape[d] != 1]
        if inp.offset:
            terms.append(f"{inp.offset}LL")
        indices.append(" + ".join(terms) or "0")
    return coords, indices


def pointwise_kernel(name: str, shape: tuple[int, ...], inputs: list[PointwiseInput],
                     body: list[str], results: list[tuple[str, str, torch.dtype]], sm_count: int = 132) -> KernelCode:
    """A fused elementwise kernel. `body` are C statements over the float variables `in0..inK`
    (the inputs' values) defining the result variables; `results` maps (key, variable, dtype)."""
    n = 1
    for e in shape:
        n *= e
    params = [f"const {_CTYPE[i.dtype]}* __restrict__ p{k}" for k, i in enumerate(inputs)]
    params += [f"{_CTYPE[dt]}* __restrict__ q{k}" for k, (_, _, dt) in enumerate(results)]
    params.append("long long n")
    fn_params = [f"float in{k}" for k in range(len(inputs))] + [f"float& r{k}" for k in range(len(results))]
    lines = [_PRELUDE, f"// {name}: {len(body)} fused elementwise op(s) over {list(shape)}",
             f"__device__ __forceinline__ void {name}_body({', '.join(fn_params)}) {{"]
    lines += [f"  {s}" for s in body]
    lines += [f"  r{k} = {var};" for k, (_, var, _) in enumerate(results)]
    lines.append("}")
    all_linear = all(i.linear(shape) for i in inputs)
    vectorized = (all_linear and n % 4 == 0 and all(i.dtype == torch.float32 for i in inputs)
                  and all(dt == torch.float32 for _, _, dt in results))
    # Broadcast or strided operands over a last dimension of a multiple of 4: four consecutive outputs share
    # every coordinate but the last, so each operand is one 16-byte load, one value repeated, or four loads.
    grouped = not vectorized and not all_linear and len(shape) > 0 and shape[-1] % 4 == 0
    lines.append(f'extern "C" __global__ void {name}({", ".join(params)}) {{')
    if grouped:
        lines += _grouped_pointwise_loop(name, shape, inputs, results)
        threads, work = 256, n // 4
    elif vectorized:
        # 16-byte loads and stores: four elements per thread and iteration.
        lines.append("  const long long n4 = n / 4;")
        lines.append("  for (long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x; v < n4; "
                     "v += (long long)gridDim.x * blockDim.x) {")
        for k in range(len(inputs)):
            lines.append(f"    const float4 a{k} = reinterpret_cast<const float4*>(p{k})[v];")
        for k in range(len(results)):
            lines.append(f"    float4 b{k};")
        for lane in "xyzw":
            call = [f"a{k}.{lane}" for k in range(len(inputs))] + [f"b{k}.{lane}" for k in range(len(results))]
            lines.append(f"    {name}_body({', '.join(call)});")
        for k in range(len(results)):
            lines.append(f"    reinterpret_cast<float4*>(q{k})[v] = b{k};")
        lines.append("  }")
        threads, work = 256, n // 4
    else:
        lines.append("  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; "
                     "i += (long long)gridDim.x * blockDim.x) {")
        coords, indices = _element_indices(shape, inputs)
        lines += [f"    {c}" for c in coords]
        lines += [f"    const float v{k} = ld(p{k}, {index});" for k, index in enumerate(indices)]
        for k in range(len(results)):
            lines.append(f"    float o{k};")
        call = [f"v{k}" for k in range(len(inputs))] + [f"o{k}" for k in range(len(results))]
        lines.append(f"    {name}_body({', '.join(call)});")
        for k in range(len(results)):
            lines.append(f"    st(q{k}, i, o{k});")
        lines.append("  }")
        threads, work = 256, n
    lines.append("}")
    grid = max(1, min((work + threads - 1) // threads, sm_count * 16))
    args = [("in", i.key) for i in inputs] + [("out", key) for key, _, _ in results] + [("i64", n)]
    kind = ("vectorized float4" if vectorized else "strided/broadcast, four outputs per thread and step" if grouped
            else "linear" if all_linear else "strided/broadcast")
    return KernelCode("\n".join(lines) + "\n", name, grid, threads, args,
                      f"{len(body)} elementwise op(s), {kind}, {len(inputs)} input(s), {len(results)} output(s)",
                      vectorized)


def _grouped_pointwise_loop(name: str, shape: tuple[int, ...], inputs: list[PointwiseInput],
                            results: list[tuple[str, str, torch.dtype]]) -> list[str]:
    """The loop of a pointwise kernel over groups of four consecutive outputs (the last extent a multiple
    of 4). Per operand: `vec` — fp32, unit stride along the last dimension and every other term a multiple
    of 4, so one 16-byte load; `splat` — broadcast along the last dimension, one load repeated; `gather` —
    four loads. fp32 results are stored 16 bytes at a time. The 16-byte path runs when every pointer it
    reads or writes that way is 16-byte aligned; otherwise the same loop takes scalar accesses."""
    last = len(shape) - 1
    kinds = []
    for inp in inputs:
        stride = inp.strides[last]
        others = [st for d, st in enumerate(inp.strides) if d != last and shape[d] != 1]
        if inp.dtype == torch.float32 and stride == 1 and all(st % 4 == 0 for st in others) and inp.offset % 4 == 0:
            kinds.append("vec")
        else:
            kinds.append("splat" if stride == 0 else "gather")
    wide = [f"p{k}" for k, kd in enumerate(kinds) if kd == "vec"] + \
           [f"q{k}" for k, (_, _, dt) in enumerate(results) if dt == torch.float32]
    aligned = " | ".join(f"reinterpret_cast<unsigned long long>({p})" for p in wide) or "0ULL"
    coords = _split("i", shape, list(range(len(shape))))
    L = [f"  const bool wide = (({aligned}) & 15ULL) == 0;",
         "  const long long n4 = n / 4;",
         "  for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < n4; "
         "g += (long long)gridDim.x * blockDim.x) {",
         "    const long long i = 4 * g;"]
    L += [f"    {c}" for c in coords]
    for k, (inp, kd) in enumerate(zip(inputs, kinds)):
        terms = [f"c{d} * {st}LL" for d, st in enumerate(inp.strides) if st != 0 and shape[d] != 1]
        if inp.offset:
            terms.append(f"{inp.offset}LL")
        index = " + ".join(terms) or "0"
        if kd == "vec":
            L += [f"    const long long e{k} = {index};",
                  f"    const float4 a{k} = wide ? *reinterpret_cast<const float4*>(p{k} + e{k})"
                  f" : make_float4(p{k}[e{k}], p{k}[e{k} + 1], p{k}[e{k} + 2], p{k}[e{k} + 3]);"]
        elif kd == "splat":
            L += [f"    const float s{k} = ld(p{k}, {index});",
                  f"    const float4 a{k} = make_float4(s{k}, s{k}, s{k}, s{k});"]
        else:
            step = inp.strides[last]
            L += [f"    const long long e{k} = {index};",
                  f"    const float4 a{k} = make_float4(ld(p{k}, e{k}), ld(p{k}, e{k} + {step}LL), "
                  f"ld(p{k}, e{k} + {2 * step}LL), ld(p{k}, e{k} + {3 * step}LL));"]
    L += [f"    float4 b{k};" for k in range(len(results))]
    for lane in "xyzw":
        call = [f"a{k}.{lane}" for k in range(len(inputs))] + [f"b{k}.{lane}" for k in range(len(results))]
        L.append(f"    {name}_body({', '.join(call)});")
    for k, (_, _, dt) in enumerate(results):
        scalar = f"st(q{k}, i, b{k}.x); st(q{k}, i + 1, b{k}.y); st(q{k}, i + 2, b{k}.z); st(q{k}, i + 3, b{k}.w);"
        if dt == torch.float32:
            L.append(f"    if (wide) *reinterpret_cast<float4*>(q{k} + i) = b{k}; else {{ {scalar} }}")
        else:
            L.append(f"    {scalar}")
    L.append("  }")
    return L


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
        return [f"const {_CTYPE[i.dtype]}* __restrict__ {i.key}" for i in self.inputs]

    def pointers(self) -> str:
        """The inputs as trailing call arguments (", in0, in1"), "" when there are none."""
        return "".join(f", {i.key}" for i in self.inputs)

    def value_function(self, name: str, suffix: str = "x") -> list[str]:
        """`{name}_{suffix}(i, [extra..], in0, ..)`: the value at flat index i (of the reduction input for a
        prologue, of the output for an epilogue)."""
        shape, linear = self.shape, [i.linear(self.shape) for i in self.inputs]
        params = ", ".join(["long long i", *[f"float {e}" for e in self.extra],
                            *[f"const {_CTYPE[i.dtype]}* __restrict__ p_{i.key}" for i in self.inputs]])
        L = [f"__device__ __forceinline__ float {name}_{suffix}({params}) {{"]
        coords, indices = _element_indices(shape, self.inputs)
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
                            *[f"const {_CTYPE[i.dtype]}* __restrict__ p_{i.key}" for i in self.inputs]])
        L = [f"__device__ __forceinline__ float {name}_{suffix}c({params}) {{"]
        for inp in self.inputs:
            terms = [f"c{d} * {st}LL" for d, st in enumerate(inp.strides) if st != 0 and shape[d] != 1]
            index = " + ".join(terms + ([f"{inp.offset}LL"] if inp.offset else [])) or "0"
            L.append(f"  const float {inp.key} = ld(p_{inp.key}, {index});")
        L += [f"  {b}" for b in self.body] + [f"  return {self.result};", "}"]
        return L

    def vector_kinds(self, cols: int) -> list[str] | None:
        """Per input, how the register path reads four consecutive values of a row — "row" (fp32, the
        reduction input's own layout: one 16-byte load), "col" (fp32, a vector over the reduced dimensions
        repeated over rows: one 16-byte load), "scalar" (one value), and, when only the last dimension is
        reduced, "based4"/"based1" (unit stride along it from a base that depends on the row: a causal mask
        [S, S] over [B, H, S, S] scores; one 16-byte load when fp32 with 16-byte row bases, else four loads)
        and "per_row" (one value per row) — or None when some input fits none of them."""
        kinds = []
        full = self.shape
        last_only = bool(full) and full[-1] == cols
        for inp in self.inputs:
            fp32 = inp.dtype == torch.float32
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


def row_reduction_kernel(name: str, kind: str, rows: int, cols: int, dtype: torch.dtype,
                         out_dtype: torch.dtype | None = None, eps: float = 1e-5, has_weight: bool = False,
                         has_bias: bool = False, sm_count: int = 132,
                         prologue: RowPrologue | None = None, epilogue: RowPrologue | None = None,
                         output: RowPrologue | None = None, groups: int = 0, group_hw: int = 0) -> KernelCode:
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
    """
    if kind not in REDUCTIONS:
        raise ValueError(f"unknown reduction '{kind}'")
    if epilogue is not None and (kind not in ("sum", "mean", "amax", "amin") or epilogue.extra != ("stat",)):
        raise ValueError(f"an epilogue applies to sum/mean/amax/amin and reads 'stat', not {kind}/{epilogue.extra}")
    extras = ("yv", "mx") if kind == "sum_exp" else ("yv",)
    if output is not None and (output.extra != extras or epilogue is not None):
        raise ValueError(f"an output function of {kind} reads {extras} and excludes an epilogue, got {output.extra}")
    if kind == "group_norm" and (groups <= 0 or group_hw <= 0 or cols % group_hw):
        raise ValueError(f"group_norm needs groups > 0 and a group_hw dividing cols, got {groups}, {group_hw}, {cols}")
    out_dtype = out_dtype or dtype
    if (dtype == torch.float32 and cols % 4 == 0 and CACHED_ROW_MIN <= cols <= CACHED_ROW_MAX
            and ((kind in NORMALIZING and out_dtype == torch.float32) or (kind in STATISTICS and epilogue is None))):
        return _cached_row_kernel(name, kind, rows, cols, eps, has_weight, has_bias, prologue, output, groups,
                                  group_hw, out_dtype)
    ch = _channel(groups, group_hw, cols)
    X = (lambda idx: f"ld(x, {idx})") if prologue is None else \
        (lambda idx: f"{name}_x({idx}{prologue.pointers()})")
    tpr = 32 if cols <= 1024 else (256 if cols <= 4096 else 512)  # threads per row
    rpb = 4 if tpr == 32 else 1                                     # rows per block
    warps = tpr // 32
    T, U = _CTYPE[dtype], _CTYPE[out_dtype]
    params = [f"const {T}* __restrict__ x"] if prologue is None else prologue.params()
    if has_weight:
        params.append(f"const {T}* __restrict__ w")
    if has_bias:
        params.append(f"const {T}* __restrict__ b")
    if epilogue:
        params += epilogue.params()
    if output:
        params += output.params()
    params += [f"{U}* __restrict__ y", "long long rows", "long long cols"]

    def Y(idx: str, value: str) -> str:  # the store of one result, through the output function if any
        more = ", m" if kind == "sum_exp" else ""  # the row's maximum, which sum_exp's output reads
        return f"st(y, {idx}, {value})" if output is None else \
            f"st(y, {idx}, {name}_o({idx}, {value}{more}{output.pointers()}))"

    L = [_PRELUDE, _ROW_PRELUDE, *(prologue.value_function(name) if prologue else []),
         *(epilogue.value_function(name, "e") if epilogue else []),
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
              f"    const float v = {X('base + c')};",
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
              f"    const float v = {X('base + c')};",
              # __fdividef: an IEEE division expands to a call with a slow-path branch, which keeps each
              # iteration's load apart (one in flight per thread); the approximate one is two instructions.
              "    n += 1.0f; const float d = v - mean; mean += __fdividef(d, n); m2 += d * (v - mean);",
              "  }",
              "  warp_welford(n, mean, m2);"]
        block_combine(["n", "mean", "m2"], "  if (lane >= WARPS) { n = 0.0f; mean = 0.0f; m2 = 0.0f; }\n  warp_welford(n, mean, m2);")
        L += [f"  const float rstd = rsqrtf(m2 / (float)cols + {_lit(eps)});",
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
              f"    const float v = {X('base + c')}; {step};",
              "  }",
              f"  a = {reduce}(a);"]
        block_combine(["a"], f"  if (lane >= WARPS) a = {init};\n  a = {reduce}(a);")
        final = "a / (float)cols" if kind == "mean" else "a"
        if epilogue is None:
            L.append(f"  if (t == 0) {Y('row', final)};")
        else:  # every thread holds the statistic after the combine
            L += [f"  const float stat = {final};",
                  f"  for (long long c = t; c < cols; c += TPR) st(y, base + c, {name}_e(base + c, stat"
                  f"{epilogue.pointers()}));"]
    L.append("}")
    args = _reduction_args(has_weight, has_bias, rows, cols, prologue, epilogue, output)
    grid = (rows + rpb - 1) // rpb
    return KernelCode("\n".join(L) + "\n", name, grid, tpr * rpb, args,
                      f"{kind} over {rows} rows of {cols}, {'warp' if tpr == 32 else 'block'} per row, warp shuffles"
                      + (" + shared-memory combine" if shared else "") + (", Welford" if kind in ("layer_norm", "group_norm") else "")
                      + (", online" if kind in ("softmax", "log_softmax", "sum_exp") else "")
                      + (f", {len(prologue.body)} elementwise op(s) fused into the loads" if prologue else "")
                      + (f", {len(epilogue.body)} elementwise op(s) applying the {kind} to its row" if epilogue else "")
                      + (f", {len(output.body)} elementwise op(s) applied before the store" if output else ""))


def column_reduction_kernel(name: str, kind: str, outer: int, reduce: int, inner: int, dtype: torch.dtype,
                            out_dtype: torch.dtype | None = None, prologue: RowPrologue | None = None) -> KernelCode:
    """sum/mean/amax/amin over the middle extent of a contiguous [outer, reduce, inner] tensor (a sum over
    an NCHW tensor's channels, a mean over a sequence): y is [outer, inner]. A block covers 32 columns of
    one outer index; its 32 lanes read consecutive columns (coalesced), its 8 warps split the reduced
    extent, and a shared-memory combine of the 8 partials finishes. Arguments: x (or the prologue's
    inputs), y."""
    if kind not in ("sum", "mean", "amax", "amin"):
        raise ValueError(f"a column reduction is sum, mean, amax or amin, not '{kind}'")
    out_dtype = out_dtype or dtype
    init = {"sum": "0.0f", "mean": "0.0f", "amax": "-__int_as_float(0x7f800000)",
            "amin": "__int_as_float(0x7f800000)"}[kind]
    step = {"sum": "a += v", "mean": "a += v", "amax": "a = nanmax(a, v)", "amin": "a = nanmin(a, v)"}[kind]
    combine = {"sum": "a += p", "mean": "a += p", "amax": "a = nanmax(a, p)", "amin": "a = nanmin(a, p)"}[kind]
    X = (lambda idx: f"ld(x, {idx})") if prologue is None else (lambda idx: f"{name}_x({idx}{prologue.pointers()})")
    params = [f"const {_CTYPE[dtype]}* __restrict__ x"] if prologue is None else prologue.params()
    params.append(f"{_CTYPE[out_dtype]}* __restrict__ y")
    final = f"a / {reduce}.0f" if kind == "mean" else "a"
    L = [_PRELUDE, *(prologue.value_function(name) if prologue else []),
         f"// {name}: {kind} over the middle extent {reduce} of [{outer}, {reduce}, {inner}]"
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
    args: list[tuple[str, object]] = [("in", "x")] if prologue is None else [("in", i.key) for i in prologue.inputs]
    args.append(("out", "y"))
    grid = (-(-inner // 32), outer, 1)
    return KernelCode("\n".join(L) + "\n", name, grid, (32, 8, 1), args,
                      f"{kind} over the middle extent {reduce} of [{outer}, {reduce}, {inner}]: 32 coalesced columns "
                      "per block, 8 warps splitting the extent, shared-memory combine"
                      + (f", {len(prologue.body)} elementwise op(s) fused into the loads" if prologue else ""))


# ---- depthwise convolution ----

DEPTHWISE_MAX_TAPS = 49  # up to 7x7: the taps are unrolled


def depthwise_conv_kernel(name: str, x_shape: tuple[int, int, int, int], kernel: tuple[int, int],
                          stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                          dtype: torch.dtype, out_dtype: torch.dtype | None = None, has_bias: bool = False,
                          output: RowPrologue | None = None, sm_count: int = 132) -> KernelCode:
    """A 2-D convolution with one filter per channel (groups = in = out channels, a [C, 1, kh, kw] weight)
    over a contiguous NCHW input, accumulated in fp32. Each thread computes VEC consecutive outputs of one
    output row: per filter row it loads the input segment those outputs share once (VEC + kw - 1 values at
    stride 1) and applies every tap from registers. An `output` function (a batch norm and activation after
    the convolution) maps each result (`yv`) before the store, so the convolution's output is never stored.
    Arguments: x, weight, [bias], [output inputs], y, n (the number of outputs)."""
    n_, c_, h, w = x_shape
    kh, kw = kernel
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    if kh * kw > DEPTHWISE_MAX_TAPS or min(kh, kw, sh, sw, dh, dw) < 1 or min(ph, pw) < 0:
        raise ValueError(f"depthwise convolution of kernel {kernel}, stride {stride}, padding {padding}, "
                         f"dilation {dilation} has no template (up to {DEPTHWISE_MAX_TAPS} taps, positive sizes)")
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if oh <= 0 or ow <= 0:
        raise ValueError(f"depthwise convolution of a {h}x{w} input with kernel {kernel} has an empty output")
    if output is not None and output.extra != ("yv",):
        raise ValueError(f"an output function reads 'yv', got {output.extra}")
    out_dtype = out_dtype or dtype
    vec = 4 if ow % 4 == 0 else (2 if ow % 2 == 0 else 1)
    seg = (vec - 1) * sw + (kw - 1) * dw + 1  # input values a thread's VEC outputs read per filter row
    owv = ow // vec
    total = n_ * c_ * oh * owv
    T, U = _CTYPE[dtype], _CTYPE[out_dtype]
    params = [f"const {T}* __restrict__ x", f"const {T}* __restrict__ wt"]
    if has_bias:
        params.append(f"const {T}* __restrict__ bias")
    if output:
        params += output.params()
    params += [f"{U}* __restrict__ y", "long long n"]
    # The output function at the output's coordinates (n, c, oy, ox + j): its per-channel operands are
    # read once for a thread's outputs.
    value = (lambda j, v: v) if output is None else \
        (lambda j, v: f"{name}_oc(n, c, oy, ox + {j}, {v}{output.pointers()})")
    right = kw - 1 - pw  # halo to the right of a thread's four outputs (stride 1, same width)
    # The common case (stride 1, no dilation, fp32, "same" width, a multiple of 4): each thread loads its
    # four inputs of a filter row with one 16-byte load and takes the halo from its neighbours' registers.
    shuffled = (dtype == torch.float32 and (sh, sw, dh, dw) == (1, 1, 1, 1) and vec == 4 and ow == w
                and 0 <= pw <= 4 and 0 <= right <= 4)
    init = "ld(bias, c)" if has_bias else "0.0f"

    ix_t, sfx = ("unsigned", "u") if total < 2 ** 31 else ("long long", "LL")  # 32-bit division when it fits

    def head(g: str) -> list[str]:  # coordinates of the thread's outputs, its planes, accumulators
        return [f"    const {ix_t} gi = ({ix_t}){g};",
                f"    const int ox = (int)(gi % {owv}{sfx}) * {vec};",
                f"    const {ix_t} rest = gi / {owv}{sfx};",
                f"    const int oy = (int)(rest % {oh}{sfx});",
                f"    const {ix_t} nc = rest / {oh}{sfx};  // n * C + c",
                f"    const long long plane = (long long)nc;",
                f"    const int c = (int)(nc % {c_}{sfx});",
                f"    const long long n = (long long)(nc / {c_}{sfx});",
                f"    const {T}* xp = x + plane * {h * w}LL;",
                f"    const {T}* wp = wt + c * {kh * kw};",
                f"    float acc[{vec}];",
                "#pragma unroll",
                f"    for (int j = 0; j < {vec}; ++j) acc[j] = {init};",
                "#pragma unroll",
                f"    for (int r = 0; r < {kh}; ++r) {{",
                f"      const int iy = oy * {sh} - {ph} + r * {dh};",
                # Predicated loads, no branch around a row: every load of the unrolled taps stays in one
                # basic block, all in flight together.
                f"      const bool row_in = iy >= 0 && iy < {h};",
                f"      float in[{seg}];"]

    taps = ["#pragma unroll",
            f"      for (int q = 0; q < {kw}; ++q) {{",
            f"        const float tap = ld(wp, r * {kw} + q);",
            "#pragma unroll",
            f"        for (int j = 0; j < {vec}; ++j) acc[j] += tap * in[j * {sw} + q * {dw}];",
            "      }",
            "    }",
            f"    const long long o = plane * {oh * ow}LL + (long long)oy * {ow} + ox;"]
    generic = [f"  for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < {total}LL; "
               "g += (long long)gridDim.x * blockDim.x) {",
               *head("g"),
               f"      const int x0 = ox * {sw} - {pw};",
               "#pragma unroll",
               f"      for (int k = 0; k < {seg}; ++k) {{",
               "        const int ix = x0 + k;",
               f"        in[k] = (row_in && ix >= 0 && ix < {w}) ? ld(xp, (long long)iy * {w} + ix) : 0.0f;",
               "      }",
               *taps,
               "#pragma unroll",
               f"    for (int j = 0; j < {vec}; ++j) st(y, o + j, {value('j', 'acc[j]')});",
               "  }"]
    L = [_PRELUDE, *(output.coordinate_function(name) if output else []),
         f"// {name}: depthwise {kh}x{kw} convolution (stride {sh}x{sw}, padding {ph}x{pw}, dilation {dh}x{dw}) "
         f"over [{n_}, {c_}, {h}, {w}] -> [{n_}, {c_}, {oh}, {ow}], {vec} output(s) per thread",
         f'extern "C" __global__ void __launch_bounds__(256) {name}({", ".join(params)}) {{']
    if shuffled:
        comp = "xyzw"
        wide_ptrs = ["x"] + (["y"] if out_dtype == torch.float32 else [])
        aligned = " | ".join(f"reinterpret_cast<unsigned long long>({p})" for p in wide_ptrs)
        left_halo, right_halo = [], []
        for k in range(pw):  # input ox - pw + k: the left neighbour's component 4 - pw + k
            left_halo += [f"      {{ const float nb = __shfl_up_sync(0xffffffffu, mid.{comp[4 - pw + k]}, 1);",
                          f"        const int ix = ox - {pw - k};",
                          f"        in[{k}] = ix < 0 ? 0.0f : lane != 0 ? nb : (row_in ? xp[(long long)iy * {w} + ix] : 0.0f); }}"]
        for k in range(right):  # input ox + 4 + k: the right neighbour's component k
            right_halo += [f"      {{ const float nb = __shfl_down_sync(0xffffffffu, mid.{comp[k]}, 1);",
                           f"        const int ix = ox + {4 + k};",
                           f"        in[{pw + 4 + k}] = ix >= {w} ? 0.0f : lane != 31 ? nb : "
                           f"(row_in ? xp[(long long)iy * {w} + ix] : 0.0f); }}"]
        store = (["      *reinterpret_cast<float4*>(y + o) = make_float4("
                  + ", ".join(value(str(j), f"acc[{j}]") for j in range(4)) + ");"]
                 if out_dtype == torch.float32 else
                 ["#pragma unroll", f"      for (int j = 0; j < 4; ++j) st(y, o + j, {value('j', 'acc[j]')});"])
        L += [f"  const bool wide = (({aligned}) & 15ULL) == 0;",
              "  if (wide) {",
              # Whole warps iterate together (the halo comes through shuffles): lanes past the end compute
              # the last group again and store nothing.
              "  const int lane = threadIdx.x & 31;",
              "  for (long long g0 = blockIdx.x * (long long)blockDim.x + (threadIdx.x & ~31); "
              f"g0 < {total}LL; g0 += (long long)gridDim.x * blockDim.x) {{",
              "    const bool valid = g0 + lane < " + f"{total}LL;",
              f"    const long long g = valid ? g0 + lane : {total - 1}LL;",
              *head("g"),
              f"      const float4 mid = row_in ? *reinterpret_cast<const float4*>(xp + (long long)iy * {w} + ox)"
              " : make_float4(0.0f, 0.0f, 0.0f, 0.0f);",
              *[f"      in[{pw + j}] = mid.{comp[j]};" for j in range(4)],
              *left_halo, *right_halo,
              *taps,
              "    if (valid) {", *store, "    }",
              "  }",
              "  return;",
              "  }"]
    L += generic + ["}"]
    how = ("one 16-byte load per filter row, the halo from neighbouring lanes' registers" if shuffled
           else "each filter row's input segment loaded once")
    threads = 256
    grid = max(1, min(-(-total // threads), sm_count * 16))
    args = [("in", "x"), ("in", "weight")] + ([("in", "bias")] if has_bias else [])
    args += [("in", i.key) for i in output.inputs] if output else []
    args += [("out", "y"), ("i64", n_ * c_ * oh * ow)]
    return KernelCode("\n".join(L) + "\n", name, grid, threads, args,
                      f"depthwise {kh}x{kw} convolution over [{n_}, {c_}, {h}, {w}], {vec} outputs per thread, "
                      f"{how}"
                      + (f", {len(output.body)} elementwise op(s) applied before the store" if output else ""))


def _channel(groups: int, group_hw: int, cols: int):
    """The weight/bias index of the row's element `c`: c itself, or a group norm's channel."""
    if not groups:
        return lambda c: c
    per_group = cols // group_hw
    return lambda c: f"((row % {groups}LL) * {per_group}LL + ({c}) / {group_hw}LL)"


def _reduction_args(has_weight: bool, has_bias: bool, rows: int, cols: int, prologue: RowPrologue | None,
                    epilogue: RowPrologue | None = None, output: RowPrologue | None = None) -> list[tuple[str, object]]:
    args: list[tuple[str, object]] = [("in", "x")] if prologue is None else [("in", i.key) for i in prologue.inputs]
    if has_weight:
        args.append(("in", "weight"))
    if has_bias:
        args.append(("in", "bias"))
    for extra in (epilogue, output):
        if extra:
            args += [("in", i.key) for i in extra.inputs]
    return args + [("out", "y"), ("i64", rows), ("i64", cols)]


# ---- long fp32 rows held in registers ----

CACHED_ROW_MAX = 32768  # 8 float4 per thread at 1,024 threads
CACHED_ROW_MIN = 128    # a warp's float4 loads cover the row at least once

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


def _cached_row_kernel(name: str, kind: str, rows: int, cols: int, eps: float, has_weight: bool,
                       has_bias: bool, prologue: RowPrologue | None = None, output: RowPrologue | None = None,
                       groups: int = 0, group_hw: int = 0, out_dtype: torch.dtype = torch.float32) -> KernelCode:
    """Softmax, log-softmax, layer or group norm over fp32 rows, a warp or a block per row: the row is read
    once from memory with 16-byte loads into registers (VPT float4 per thread), reduced there (exact
    two-pass statistics, one exp per element) and written once with 16-byte stores. Rows that are not
    16-byte aligned (a view at an odd offset) take scalar loads into the same registers. The statistics
    (sum, mean, amax, amin, sum_exp) read the same way and store one value per row."""
    stat = kind in STATISTICS
    c4 = cols // 4
    if c4 <= 256:  # up to 1,024 columns: a warp per row, eight rows per block, no barrier or shared memory
        tpr, rpb = 32, 8
    else:
        tpr, rpb = 128, 1
        while tpr < 1024 and tpr * 4 < c4:  # about four float4 per thread
            tpr *= 2
    vpt = -(-c4 // tpr)
    params = ["const float* __restrict__ x"] if prologue is None else prologue.params()
    ptrs = ["x + row * cols", "y + row * cols"]
    kinds = prologue.vector_kinds(cols) if prologue else None
    # What must be 16-byte aligned for the vector path: the row's start in every row-shaped operand.
    checked = (["xr"] if prologue is None else []) + ([] if stat else ["yr"])
    if kinds:
        checked += [f"{i.key} + row * cols" if k == "row" else i.key
                    for i, k in zip(prologue.inputs, kinds) if k in ("row", "col", "based4")]
    if has_weight:
        params.append("const float* __restrict__ w")
    if has_bias:
        params.append("const float* __restrict__ b")
    if output:
        params += output.params()
    params += [f"{_CTYPE[out_dtype]}* __restrict__ y", "long long rows", "long long cols"]
    # A group norm reads its weight and bias by channel, one element at a time: not part of the vector check.
    vector_wb = not groups
    aligned = " | ".join(f"reinterpret_cast<unsigned long long>({p})" for p in
                         checked + (["w"] if has_weight and vector_wb else []) + (["b"] if has_bias and vector_wb else [])) \
        or "0ULL"
    per_row = "one warp per row" if tpr == 32 else f"one block of {tpr} threads per row"
    L = [_PRELUDE, _ROW_PRELUDE,
         f"// {name}: {kind} over rows of {cols}, {per_row}, the row held in registers",
         f"#define TPR {tpr}", f"#define RPB {rpb}", f"#define WARPS {tpr // 32}", f"#define VPT {vpt}",
         f"#define C4 {c4}", f"#define COLS {cols}LL",
         _BLOCK_PRELUDE if tpr > 32 else _WARP_ROW_PRELUDE,
         "__device__ __forceinline__ float4 load4(const float* p, int c4, bool vec) {",
         "  return vec ? reinterpret_cast<const float4*>(p)[c4] : make_float4(p[4 * c4], p[4 * c4 + 1], p[4 * c4 + 2], p[4 * c4 + 3]);",
         "}",
         "__device__ __forceinline__ void store4(float* p, int c4, float4 v, bool vec) {",
         "  if (vec) { reinterpret_cast<float4*>(p)[c4] = v; return; }",
         "  p[4 * c4] = v.x; p[4 * c4 + 1] = v.y; p[4 * c4 + 2] = v.z; p[4 * c4 + 3] = v.w;",
         "}",
         *(_cached_prologue(name, prologue, kinds) if prologue else []),
         *((output.value_function(name, "o") if stat else _cached_output(name, output)) if output else []),
         f'extern "C" __global__ void __launch_bounds__(TPR * RPB) {name}({", ".join(params)}) {{',
         "  const long long row = (long long)blockIdx.x * RPB + threadIdx.x / TPR;",
         "  const int t = threadIdx.x % TPR;",
         "  if (row >= rows) return;",  # a whole row's threads leave together: no barrier is left waiting
         "  __shared__ float sh[WARPS];",
         *([f"  const float* xr = {ptrs[0]};"] if prologue is None else []),
         *([] if stat else [f"  float* yr = {ptrs[1]};"]),
         f"  const bool vec = (({aligned}) & 15ULL) == 0;",
         "  float4 v[VPT];",
         "#pragma unroll",
         "  for (int k = 0; k < VPT; ++k) {",
         "    const int c = t + k * TPR;",
         "    v[k] = c < C4 ? " + ("load4(xr, c, vec)" if prologue is None else
                                    f"{name}_x4(row, c, vec{prologue.pointers()})")
         + " : make_float4(0.0f, 0.0f, 0.0f, 0.0f);",
         "  }"]

    def each(body: list[str]) -> None:
        L.extend(["#pragma unroll", "  for (int k = 0; k < VPT; ++k) {",
                  "    if (t + k * TPR >= C4) break;", *[f"    {b}" for b in body], "  }"])

    def store(c: str, value: str) -> str:  # one float4 of results, through the output function if any
        if output is not None:
            value = f"{name}_o4(row, {c}, {value}{output.pointers()})"
        return f"store4(yr, {c}, {value}, vec);"

    if stat:
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
        L.append(f"  const float rstd = rsqrtf(block_sum(q, sh) / (float)cols + {_lit(eps)});")
        body = ["const int c = t + k * TPR;",
                "float4 o = make_float4((v[k].x - mean) * rstd, (v[k].y - mean) * rstd, (v[k].z - mean) * rstd, "
                "(v[k].w - mean) * rstd);"]
        ch = _channel(groups, group_hw, cols)
        for flag, ptr, op, var in ((has_weight, "w", "*=", "g"), (has_bias, "b", "+=", "h")):
            if not flag:
                continue
            if groups:
                body.append(f"const float4 {var} = make_float4({ptr}[{ch('4 * c')}], {ptr}[{ch('4 * c + 1')}], "
                            f"{ptr}[{ch('4 * c + 2')}], {ptr}[{ch('4 * c + 3')}]);")
            else:
                body.append(f"const float4 {var} = load4({ptr}, c, vec);")
            body.append(f"o.x {op} {var}.x; o.y {op} {var}.y; o.z {op} {var}.z; o.w {op} {var}.w;")
        body.append(store("c", "o"))
        each(body)
    L.append("}")
    args = _reduction_args(has_weight, has_bias, rows, cols, prologue, None, output)
    if prologue:
        what_in = "16-byte" if kinds else "scalar"
        fused = f", {len(prologue.body)} elementwise op(s) fused into the loads ({what_in})"
    else:
        fused = ""
    what = ("exact two-pass mean and variance" if kind in ("layer_norm", "group_norm") else
            "max, then one exp per element" if kind in ("softmax", "log_softmax", "sum_exp") else "16-byte loads")
    io = "one read, one value per row" if stat else "one read and one write"
    if output:
        fused += f", {len(output.body)} elementwise op(s) applied before the store"
    return KernelCode("\n".join(L) + "\n", name, -(-rows // rpb), tpr * rpb, args,
                      f"{kind} over {rows} rows of {cols}, {'warp' if tpr == 32 else 'block'} per row, row held in registers "
                      f"({vpt} float4 per thread), {io}, {what}{fused}", vectorized=True)


def _cached_output(name: str, output: RowPrologue) -> list[str]:
    """`{name}_o4(row, c4, v, in0, ..)`: the output function on one float4 of results."""
    L = output.value_function(name, "o")
    params = ", ".join(["long long row", "int c4", "float4 v",
                        *[f"const {_CTYPE[i.dtype]}* __restrict__ p_{i.key}" for i in output.inputs]])
    args = "".join(f", p_{i.key}" for i in output.inputs)
    L += [f"__device__ __forceinline__ float4 {name}_o4({params}) {{",
          "  const long long i = row * COLS + 4LL * c4;",
          f"  return make_float4({name}_o(i, v.x{args}), {name}_o(i + 1, v.y{args}), "
          f"{name}_o(i + 2, v.z{args}), {name}_o(i + 3, v.w{args}));",
          "}"]
    return L


def _cached_prologue(name: str, prologue: RowPrologue, kinds: list[str] | None) -> list[str]:
    """`{name}_x4(row, c4, vec, in0, ..)`: four consecutive values of the reduction input (one float4 of
    the row), 16-byte loads of each operand when `kinds` allows, else the scalar value function."""
    L = prologue.value_function(name)
    params = ", ".join(["long long row", "int c4", "bool vec",
                        *[f"const {_CTYPE[i.dtype]}* __restrict__ p_{i.key}" for i in prologue.inputs]])
    L.append(f"__device__ __forceinline__ float4 {name}_x4({params}) {{")
    if kinds is None:
        args = "".join(f", p_{i.key}" for i in prologue.inputs)
        L.append("  const long long i = row * COLS + 4LL * c4;")
        L.append(f"  return make_float4({name}_x(i{args}), {name}_x(i + 1{args}), {name}_x(i + 2{args}), "
                 f"{name}_x(i + 3{args}));")
        L.append("}")
        return L
    shape = prologue.shape
    if any(k in ("based4", "based1", "per_row") for k in kinds):  # the row's coordinates (all but the last)
        L += [f"  {c}" for c in _split("row", shape, list(range(len(shape) - 1)))]
    for inp, k in zip(prologue.inputs, kinds):
        a, p = f"a_{inp.key}", f"p_{inp.key}"
        if k == "row":
            L.append(f"  const float4 {a} = load4({p} + row * COLS, c4, vec);")
        elif k == "col":
            L.append(f"  const float4 {a} = load4({p}, c4, vec);")
        elif k in ("based4", "based1", "per_row"):
            terms = [f"c{d} * {st}LL" for d, st in enumerate(inp.strides[:-1]) if st != 0 and shape[d] != 1]
            base = " + ".join(terms + ([f"{inp.offset}LL"] if inp.offset else [])) or "0LL"
            L.append(f"  const long long b_{inp.key} = {base};")
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
