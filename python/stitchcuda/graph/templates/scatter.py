"""Writes into a program state at positions an index gives (a KV cache's `index_copy_` at the cache positions),
the source's elementwise producers (RoPE) computed in the same kernel, and small int64 bookkeeping (a cache's
position counter) computed exactly, in integers."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from .common import CTYPE, PRELUDE, VECTOR8_IO, KernelCode, PointwiseInput, element_index, split_coordinates
from .pointwise import body_function, element_load

# int64 elementwise values this many elements or fewer (positions, counters) are computed by one block.
INTEGER_MAX_ELEMENTS = 64

# The integer ops and their C over `long long` operands: x op alpha * y, alpha an int (1 when absent).
INTEGER_OPS = {"aten::add.Tensor": "+", "aten::sub.Tensor": "-"}

VECTOR = 8  # source elements per thread along the last dimension: one 16-byte store of 16-bit values


def integer_expression(op: str, x: str, y: str, alpha: int = 1) -> str:
    """C of `op` (INTEGER_OPS) over the long long expressions `x` and `y`, exact in 64-bit integers (wrapping
    as ATen's int64 arithmetic does)."""
    scaled = y if alpha == 1 else f"({alpha}LL * {y})"
    return f"(long long)((unsigned long long)({x}) {INTEGER_OPS[op]} (unsigned long long)({scaled}))"


@dataclass
class IntegerChain:
    """int64 elementwise values over `shape` (at most INTEGER_MAX_ELEMENTS elements): `inputs` are int64
    tensors (strides over `shape`, keys naming their buffers), read in the body as `in0..`; `body` are C
    statements over `long long` defining variables; `results` (buffer key, variable) are stored contiguous."""

    shape: tuple[int, ...]
    inputs: list[PointwiseInput]
    body: list[str]
    results: list[tuple[str, str]]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def function(self, name: str) -> list[str]:
        """`{name}(i, p0.., r0..)`: every variable of the chain at its flat element `i`."""
        params = ["long long i", *[f"const long long* __restrict__ p{k}" for k in range(len(self.inputs))],
                  *[f"long long& r{k}" for k in range(len(self.results))]]
        L = [f"__device__ __forceinline__ void {name}({', '.join(params)}) {{"]
        if any(e != 1 for e in self.shape) and not all(i.linear(self.shape) for i in self.inputs):
            L += [f"  {c}" for c in split_coordinates("i", self.shape, list(range(len(self.shape))))]
        for k, inp in enumerate(self.inputs):
            index = "i" if inp.linear(self.shape) else element_index(inp, self.shape)
            L.append(f"  const long long in{k} = p{k}[{index}];")
        L += [f"  {s}" for s in self.body] + [f"  r{k} = {var};" for k, (_, var) in enumerate(self.results)] + ["}"]
        return L

    def params(self, c: int) -> list[str]:
        return ([f"const long long* __restrict__ j{c}_{k}" for k in range(len(self.inputs))]
                + [f"long long* __restrict__ z{c}_{k}" for k in range(len(self.results))])

    def args(self) -> list[tuple[str, str]]:
        return [("in", i.key) for i in self.inputs] + [("out", key) for key, _ in self.results]

    def stores(self, name: str, c: int, thread: str) -> list[str]:
        """Statements storing the chain's results at element `thread` (a thread of block 0 each)."""
        pointers = [f"j{c}_{k}" for k in range(len(self.inputs))]
        outs = [f"o{c}_{k}" for k in range(len(self.results))]
        return [f"  if (blockIdx.x == 0 && {thread} < {self.numel}LL) {{",
                *[f"    long long {o};" for o in outs],
                f"    {name}_int{c}({', '.join([thread, *pointers, *outs])});",
                *[f"    z{c}_{k}[{thread}] = {o};" for k, o in enumerate(outs)], "  }"]


def integer_kernel(name: str, chains: list[IntegerChain]) -> KernelCode:
    """int64 elementwise chains (a cache's positions and counter, `cumulative_length + n`) in one launch of
    one block, each element computed by its own thread in 64-bit integer arithmetic: exact, where a float
    kernel would round past 2^24."""
    if not chains or any(ch.numel > INTEGER_MAX_ELEMENTS for ch in chains):
        raise ValueError(f"integer chains of 1 to {INTEGER_MAX_ELEMENTS} elements each, not "
                         f"{[ch.numel for ch in chains]}")
    L = [f"// {name}: {len(chains)} int64 elementwise chain(s), one thread per element"]
    for c, ch in enumerate(chains):
        L += ch.function(f"{name}_int{c}")
    params = [p for c, ch in enumerate(chains) for p in ch.params(c)]
    L.append(f'extern "C" __global__ void {name}({", ".join(params)}) {{')
    L.append("  const long long t = threadIdx.x;")
    for c, ch in enumerate(chains):
        L += ch.stores(name, c, "t")
    L.append("}")
    args = [a for ch in chains for a in ch.args()]
    return KernelCode("\n".join(L) + "\n", name, 1, INTEGER_MAX_ELEMENTS, args,
                      f"{len(chains)} int64 chain(s), {sum(ch.numel for ch in chains)} element(s), exact integer "
                      "arithmetic, one block")


@dataclass
class CacheTarget:
    """One state written at the index: its buffer key, dtype and strides (elements), its extent along the
    indexed dimension, and the body variable written into it."""

    key: str
    dtype: torch.dtype
    strides: tuple[int, ...]
    extent: int
    var: str


@dataclass
class CacheIndex:
    """Where a write's positions come from: an int64 buffer (`key`, `stride` elements apart along the indexed
    dimension) or, with `chain` set, the variable `var` of that integer chain (of the indexed dimension's
    extent) computed by the writing thread itself."""

    key: str = ""
    stride: int = 1
    chain: int = -1
    var: str = ""


def cache_write_kernel(name: str, shape: tuple[int, ...], dim: int, inputs: list[PointwiseInput], body: list[str],
                       targets: list[CacheTarget], index: CacheIndex, stores: list[tuple[str, str, torch.dtype]] = (),
                       chains: list[IntegerChain] = ()) -> KernelCode:
    """`state.index_copy_(dim, index, source)` for each target, the sources computed by `body` (C statements
    over the float inputs in0.., pointwise_kernel's body) over `shape`, the sources' shape: the element of
    `shape` at coordinates c is written at c with c[dim] replaced by index[c[dim]]. Each thread takes VECTOR
    consecutive elements of the last dimension (where it divides), loads each input's eight with one 16-byte
    load (two for fp32) where they lie adjacent and aligned, and stores them with one 16-byte store per state
    (two for fp32) where the state's address allows, else one at a time; any state and input strides. `stores` (key, variable, dtype): values others read too (a rotated key), stored contiguous over
    `shape`. `chains`: int64 bookkeeping computed in the same launch (threads of block 0 store it), one of
    which may give the index.

    A position outside [0, extent) is skipped: nothing is written for it and nothing is raised on the device
    (ATen raises on the host for such an index; the program's own callers keep positions inside the cache,
    as StaticCacheGenerator checks a sequence's length before it runs)."""
    rank = len(shape)
    if not 0 <= dim < rank - 1:
        raise ValueError(f"the indexed dimension must precede the last of {list(shape)}, not {dim}")
    if any(len(t.strides) != rank for t in targets) or not targets:
        raise ValueError(f"every target must have the source's rank {rank}")
    last = rank - 1
    per = VECTOR if shape[-1] % VECTOR == 0 else 1
    n = math.prod(shape)
    groups = n // per
    params = [f"const {CTYPE[i.dtype]}* __restrict__ p{k}" for k, i in enumerate(inputs)]
    if index.chain < 0:
        params.append("const long long* __restrict__ idx")
    params += [p for c, ch in enumerate(chains) for p in ch.params(c)]
    params += [f"{CTYPE[t.dtype]}* __restrict__ w{k}" for k, t in enumerate(targets)]
    params += [f"{CTYPE[dt]}* __restrict__ q{k}" for k, (_, _, dt) in enumerate(stores)]
    params.append("long long n")
    results = [("", t.var, t.dtype) for t in targets] + list(stores)
    L = [PRELUDE, VECTOR8_IO,
         f"// {name}: {len(targets)} state(s) written along dimension {dim} at the index over [{', '.join(map(str, shape))}]"]
    L += body_function(name, len(inputs), body, results)
    for c, ch in enumerate(chains):
        L += ch.function(f"{name}_int{c}")
    L.append(f'extern "C" __global__ void {name}({", ".join(params)}) {{')
    L.append("  const long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;")
    for c, ch in enumerate(chains):
        L += ch.stores(name, c, "g")
    L.append(f"  if (g >= n / {per}) return;")
    L.append(f"  const long long i = g * {per};")
    # the last coordinate of the thread's first element is c{last}b; the loop below steps c{last} from it
    L += [f"  {s}".replace(f" c{last} = ", f" c{last}b = ") for s in split_coordinates("i", shape, list(range(rank)))]
    if index.chain < 0:
        L.append(f"  const long long pos = idx[c{dim} * {index.stride}LL];")
    else:
        ch = chains[index.chain]
        pointers = [f"j{index.chain}_{k}" for k in range(len(ch.inputs))]
        outs = [f"x{k}" for k in range(len(ch.results))]
        which = next(k for k, (_, var) in enumerate(ch.results) if var == index.var)
        L += [f"  long long {', '.join(outs)};",
              f"  {name}_int{index.chain}({', '.join([f'(long long)c{dim}', *pointers, *outs])});",
              f"  const long long pos = x{which};"]
    wide = [k for k, inp in enumerate(inputs) if per > 1 and _eight_in_a_row(inp, shape)]
    for k in wide:  # eight adjacent values: one 16-byte load where aligned (RoPE's rotated half: negated whole)
        inp = inputs[k]
        at = re.sub(rf"\bc{last}\b", f"c{last}b", element_index(inp, shape))
        L += [f"  float a{k}[{per}];",
              f"  {{ const long long b = {at}; if ((reinterpret_cast<unsigned long long>(p{k} + b) & 15ULL) == 0) "
              f"load8(p{k} + b, 0, a{k}); else for (int e = 0; e < {per}; ++e) a{k}[e] = ld(p{k}, b + e); }}"]
        if inp.rotate:
            L.append(f"  if (c{last}b < {inp.rotate}) for (int e = 0; e < {per}; ++e) a{k}[e] = -a{k}[e];")
    L += [f"  float o{k}[{per}];" for k in range(len(results))]
    L.append("#pragma unroll")
    L.append(f"  for (int e = 0; e < {per}; ++e) {{")
    if len(wide) < len(inputs):
        L.append(f"    const auto c{last} = c{last}b + e;")
    L += [f"    const float v{k} = " + (f"a{k}[e];" if k in wide else f"{element_load(k, inp, shape, element_index(inp, shape))};")
          for k, inp in enumerate(inputs)]
    call = [f"v{k}" for k in range(len(inputs))] + [f"o{k}[e]" for k in range(len(results))]
    L.append(f"    {name}_body({', '.join(call)});")
    L.append("  }")
    for k in range(len(stores)):  # contiguous over `shape`: element i onwards
        o = f"o{len(targets) + k}"
        L.append(_store(f"q{k}", "i", o, per))
    for k, t in enumerate(targets):
        offset = " + ".join(f"{'pos' if d == dim else f'c{d}'} * {t.strides[d]}LL" for d in range(rank)
                            if d != last and (d == dim or shape[d] != 1))
        offset = " + ".join(x for x in (offset, f"c{last}b * {t.strides[last]}LL") if x)
        L.append(f"  if (pos >= 0 && pos < {t.extent}LL) {{")
        L.append(f"    const long long at = {offset};")
        L.append("  " + _store(f"w{k}", "at", f"o{k}", per, step=t.strides[last]))
        L.append("  }")
    L.append("}")
    source = "\n".join(L)
    threads = min(256, max(INTEGER_MAX_ELEMENTS if chains else 32, -(-groups // 32) * 32))
    grid = max(1, -(-groups // threads))
    args = [("in", i.key) for i in inputs]
    if index.chain < 0:
        args.append(("in", index.key))
    args += [a for ch in chains for a in ch.args()]
    args += [("out", t.key) for t in targets] + [("out", key) for key, _, _ in stores] + [("i64", n)]
    what = (f"{len(targets)} state(s) written at the index, {len(body)} elementwise op(s) on the way, "
            f"{per} element(s) per thread" + (" (16-byte stores)" if per > 1 else "")
            + (f", {len(stores)} value(s) stored for other readers" if stores else "")
            + (f", {len(chains)} int64 chain(s)" if chains else ""))
    return KernelCode(source + "\n", name, grid, threads, args, what, per > 1)


def _eight_in_a_row(inp: PointwiseInput, shape: tuple[int, ...]) -> bool:
    """Whether a thread's VECTOR elements of `inp` (from a last coordinate that is a multiple of VECTOR) lie
    adjacent in memory from a multiple of VECTOR: unit stride along the last dimension, every other stride
    and the offset multiples of VECTOR, and a rotated half of whole groups (never a concatenation's pieces)."""
    if inp.pieces or inp.strides[-1] != 1 or inp.offset % VECTOR or inp.rotate % VECTOR:
        return False
    return all(st % VECTOR == 0 for d, st in enumerate(inp.strides[:-1]) if shape[d] != 1)


def _store(pointer: str, at: str, values: str, per: int, step: int = 1) -> str:
    """`per` values stored from element `at` on, `step` elements apart: one store8 where they are adjacent and
    the address is 16-byte aligned, else one at a time."""
    if per == 1 or step != 1:
        return (f"  for (int e = 0; e < {per}; ++e) st({pointer}, {at} + e * {step}LL, {values}[e]);" if per > 1
                else f"  st({pointer}, {at}, {values}[0]);")
    return (f"  if ((reinterpret_cast<unsigned long long>({pointer} + {at}) & 15ULL) == 0) store8({pointer} + {at}, 0, "
            f"{values}); else for (int e = 0; e < {per}; ++e) st({pointer}, {at} + e, {values}[e]);")
