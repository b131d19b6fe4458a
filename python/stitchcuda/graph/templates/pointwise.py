"""Fused elementwise kernels: one body per element, a 16-byte path for contiguous operands, four outputs
per step for broadcast ones."""

from __future__ import annotations

import math

import torch

from ...settings import settings
from .common import (CTYPE, HALF_DTYPES, PRELUDE, VECTOR8_IO, VECTOR_IO_16, Extent, KernelCode, PointwiseInput,
                     element_index, element_indices, piece_args, piece_params, piece_select, split_coordinates)


# How a streaming (vectorized) kernel covers its tensor: "once" (the default) — as many blocks as the
# tensor needs, each thread loading ONCE_FLOAT4 float4 of each operand (all loads issued before any is
# used) and leaving, as ATen's vectorized elementwise kernels do; "stride" — a grid of 16 blocks per SM,
# each thread looping over the tensor a grid apart. On an H100 the one pass moved a 3.2 GB two-input
# select at 3.09 TB/s against the loop's 2.9 (1.043 against 1.094 ms, the same machine and call; 1.058
# against 1.117 in an earlier one). STITCHCUDA_POINTWISE_LOOP picks one, to measure the two.
POINTWISE_LOOPS = ("once", "stride")
ONCE_FLOAT4 = {2: 4, 4: 2}  # float4 per operand and thread by operand count (inputs + outputs), else 1


def outer_free(shape: tuple[int, ...]) -> str:
    """A shape in a kernel's comment without its outermost extent ("[N, 256, 64]"), which the kernel takes
    from its arguments: the same code at every size of it is one source, compiled once."""
    return "[" + ", ".join(["N", *map(str, shape[1:])]) + "]" if shape else "[]"


def outer_varies(shape: tuple[int, ...], inputs: list[PointwiseInput]) -> bool:
    """Whether a pointwise kernel of `shape` serves other outermost extents as generated: not when that
    extent is 1 (its coordinate, always 0, is left out of every index) nor when a concatenation's pieces
    lie along it (their boundaries are in the source)."""
    return bool(shape) and shape[0] > 1 and not any(i.pieces and i.cat_dim == 0 for i in inputs)


def pointwise_loop() -> str:
    """STITCHCUDA_POINTWISE_LOOP (settings().pointwise_loop), "once" when unset; a bad value raises
    SettingsError (a ValueError) naming the values it takes."""
    return settings().pointwise_loop


def body_function(name: str, inputs: int, body: list[str], results: list[tuple[str, str, torch.dtype]]) -> list[str]:
    """`{name}_body(in0.., r0..)`: the fused ops of one element, from its inputs' values to its results."""
    fn_params = [f"float in{k}" for k in range(inputs)] + [f"float& r{k}" for k in range(len(results))]
    return ([f"__device__ __forceinline__ void {name}_body({', '.join(fn_params)}) {{"] + [f"  {s}" for s in body]
            + [f"  r{k} = {var};" for k, (_, var, _) in enumerate(results)] + ["}"])


def element_load(k: int, inp: PointwiseInput, shape: tuple[int, ...], index: str) -> str:
    """The C expression of input `k`'s value at the coordinates c0.. (`index`: its element index, unused for a
    concatenation's pieces): a piece chosen by range, RoPE's rotated half negated, or one load."""
    if inp.pieces:
        return piece_select(k, inp, shape, lambda p, e, _: f"ld({p}, {e})")
    if inp.rotate:
        return f"c{len(shape) - 1} < {inp.rotate} ? -ld(p{k}, {index}) : ld(p{k}, {index})"
    return f"ld(p{k}, {index})"


def pointwise_kernel(name: str, shape: tuple[int, ...], inputs: list[PointwiseInput],
                     body: list[str], results: list[tuple[str, str, torch.dtype]], sm_count: int = 132) -> KernelCode:
    """A fused elementwise kernel. `body` are C statements over the float variables `in0..inK`
    (the inputs' values) defining the result variables; `results` maps (key, variable, dtype)."""
    n = 1
    for e in shape:
        n *= e
    params = [p for k, i in enumerate(inputs) for p in piece_params(k, i, CTYPE[i.dtype])]
    params += [f"{CTYPE[dt]}* __restrict__ q{k}" for k, (_, _, dt) in enumerate(results)]
    params.append("long long n")
    lines = [PRELUDE, f"// {name}: {len(body)} fused elementwise op(s) over {outer_free(shape)}",
             *body_function(name, len(inputs), body, results)]
    all_linear = all(i.linear(shape) for i in inputs)
    vectorized = (all_linear and n % 4 == 0 and all(i.dtype == torch.float32 for i in inputs)
                  and all(dt == torch.float32 for _, _, dt in results))
    dtypes = [i.dtype for i in inputs] + [dt for _, _, dt in results]
    if all_linear and n % 8 == 0 and any(dt in HALF_DTYPES for dt in dtypes) \
            and all(dt in (torch.float32, *HALF_DTYPES) for dt in dtypes):
        return eight_wide_pointwise_kernel(name, shape, n, inputs, body, results, params)
    # The index arithmetic of strided operands splits n into coordinates: 32-bit below 2^31 (split_coordinates).
    limit = 0 if all_linear else (2 ** 31 - 1 if n < 2 ** 31 else 0)
    # Broadcast or strided operands over a last dimension of a multiple of 4: four consecutive outputs share
    # every coordinate but the last, so each operand is one 16-byte load, one value repeated, or four loads.
    rotated = any(i.rotate for i in inputs)  # RoPE's rotate_half: one element at a time, its own index and sign
    if rotated and (not shape or any(i.rotate and 2 * i.rotate != shape[-1] for i in inputs)):
        raise ValueError(f"a rotated input must rotate half of the last extent of {list(shape)}")
    # A concatenation along the last dimension takes the groups of four only where every piece boundary
    # is a multiple of 4 (the four outputs then read one piece).
    grouped = not vectorized and not all_linear and not rotated and len(shape) > 0 and shape[-1] % 4 == 0 and all(
        i.cat_dim != len(shape) - 1 or all(piece.start % 4 == 0 for piece in i.pieces) for i in inputs if i.pieces)
    # A vectorized kernel of at most four operands takes two float4 of each per step (below); more
    # operands' registers, doubled, would cost the occupancy the extra loads buy.
    deep = vectorized and len(inputs) + len(results) <= 4
    once = vectorized and pointwise_loop() == "once"
    per = next((v for k, v in sorted(ONCE_FLOAT4.items()) if len(inputs) + len(results) <= k), 1)
    lines.append(f'extern "C" __global__ void {name}({", ".join(params)}) {{')

    def step(offsets: list[str], indent: str = "    ", guarded: bool = False) -> None:
        """float4 of every operand at v + each offset, all loaded before any is used, then computed and
        stored; `guarded`: the j-th only where ok{j} (loads of the others read zeros)."""
        zero = "make_float4(0.0f, 0.0f, 0.0f, 0.0f)"
        for k in range(len(inputs)):
            for j, off in enumerate(offsets):
                load = f"reinterpret_cast<const float4*>(p{k})[v{off}]"
                value = f"ok{j} ? {load} : {zero}" if guarded else load
                lines.append(f"{indent}const float4 a{k}_{j} = {value};")
        for j, off in enumerate(offsets):
            for k in range(len(results)):
                lines.append(f"{indent}float4 b{k}_{j};")
            for lane in "xyzw":
                call = [f"a{k}_{j}.{lane}" for k in range(len(inputs))] + \
                       [f"b{k}_{j}.{lane}" for k in range(len(results))]
                lines.append(f"{indent}{name}_body({', '.join(call)});")
        for j, off in enumerate(offsets):
            for k in range(len(results)):
                store = f"reinterpret_cast<float4*>(q{k})[v{off}] = b{k}_{j};"
                lines.append(f"{indent}" + (f"if (ok{j}) {store}" if guarded else store))

    grid = None  # the capped grid below, unless a form sets its own
    if once:
        # `per` float4 of each operand per thread, a block's threads adjacent in each (coalesced); every
        # load before any use, then the stores; the grid covers the tensor once.
        offsets = [f" + {j}LL * blockDim.x" for j in range(per)]
        lines.append("  const long long n4 = n / 4;")
        lines.append(f"  const long long v = blockIdx.x * ({per}LL * blockDim.x) + threadIdx.x;")
        lines += [f"  const bool ok{j} = v{off} < n4;" for j, off in enumerate(offsets)]
        step(offsets, "  ", guarded=True)
        threads = 256
        grid = max(1, -(-(n // 4) // (threads * per)))
    elif grouped:
        if any(dt in HALF_DTYPES for dt in dtypes):  # 16-bit operands: four values per 8-byte access
            lines.insert(1, VECTOR_IO_16)
        lines += _grouped_pointwise_loop(name, shape, inputs, results)
        threads, work = 256, n // 4
    elif vectorized:
        # 16-byte loads and stores, four elements per load. Two float4 of each operand per thread and
        # iteration, both loads issued before either is used: twice the bytes in flight of one (a
        # streaming op on a grid of 16 blocks per SM otherwise waits on one load per thread at a time);
        # the last float4 of a thread, if odd, alone (`deep`; otherwise one float4 per step).
        lines.append("  const long long n4 = n / 4, stride = (long long)gridDim.x * blockDim.x;")
        lines.append("  long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x;")
        if deep:
            lines.append("  for (; v + stride < n4; v += 2 * stride) {")
            step(["", " + stride"])
            lines.append("  }")
            lines.append("  if (v < n4) {")
        else:
            lines.append("  for (; v < n4; v += stride) {")
        step([""])
        lines.append("  }")
        threads, work = 256, n // 4
    else:
        lines.append("  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; "
                     "i += (long long)gridDim.x * blockDim.x) {")
        coords, indices = element_indices(shape, inputs)
        lines += [f"    {c}" for c in coords]
        lines += [f"    const float v{k} = {element_load(k, inp, shape, index)};"
                  for k, (inp, index) in enumerate(zip(inputs, indices))]
        for k in range(len(results)):
            lines.append(f"    float o{k};")
        call = [f"v{k}" for k in range(len(inputs))] + [f"o{k}" for k in range(len(results))]
        lines.append(f"    {name}_body({', '.join(call)});")
        for k in range(len(results)):
            lines.append(f"    st(q{k}, i, o{k});")
        lines.append("  }")
        threads, work = 256, n
    lines.append("}")
    if grid is None:
        grid = max(1, min((work + threads - 1) // threads, sm_count * 16))
    args = [a for i in inputs for a in piece_args(i)] + [("out", key) for key, _, _ in results] + [("i64", n)]
    # The source holds every extent but the outermost, which comes from n: the grid follows n as above.
    per_block = 4 * threads * per if once else 4 * threads if (vectorized or grouped) else threads
    inner = math.prod(shape[1:]) if len(shape) > 1 else 1
    align = math.lcm(inner, 4 if (vectorized or grouped) else 1)
    extent = Extent(n, len(args) - 1, unit=per_block, cap=0 if once else sm_count * 16, align=align, limit=limit)
    pieces = sum(len(i.pieces) for i in inputs)
    kind = (f"vectorized float4, {per} per operand and thread in one pass (no grid-stride loop)" if once
            else "vectorized float4, two per thread and step" if deep else "vectorized float4" if vectorized
            else "rotated halves (RoPE)" if rotated
            else "strided/broadcast, four outputs per thread and step" if grouped
            else "linear" if all_linear else "strided/broadcast")
    read = f", a concatenation's {pieces} pieces read in place" if pieces else ""
    return KernelCode("\n".join(lines) + "\n", name, grid, threads, args,
                      f"{len(body)} elementwise op(s), {kind}, {len(inputs)} input(s){read}, {len(results)} output(s)",
                      vectorized, extent=extent if outer_varies(shape, inputs) else None)


def eight_wide_pointwise_kernel(name: str, shape: tuple[int, ...], n: int, inputs: list[PointwiseInput], body: list[str],
                           results: list[tuple[str, str, torch.dtype]], params: list[str]) -> KernelCode:
    """pointwise_kernel's form for contiguous operands when some are fp16/bf16 (n a multiple of 8; it builds
    for fp32 operands too, which is how the emulator, without 16-bit types, checks its indexing): each
    thread takes EIGHT_PER groups of eight consecutive elements, a 16-byte load of each 16-bit operand per
    group (two of an fp32 one), all loads before any use; the body in fp32, each result rounded once at
    its 16-byte store. Where a pointer is not 16-byte aligned (a view at an odd offset) the same groups take
    scalar loads and stores. The grid covers the tensor once, as the fp32 one-pass form does."""
    operands = len(inputs) + len(results)
    per = 2 if operands <= 4 else 1  # groups of eight per thread: more operands' registers would cost occupancy
    pointers = [f"p{k}" for k in range(len(inputs))] + [f"q{k}" for k in range(len(results))]
    aligned = " | ".join(f"reinterpret_cast<unsigned long long>({p})" for p in pointers)
    L = [PRELUDE, VECTOR8_IO, f"// {name}: {len(body)} fused elementwise op(s) over {outer_free(shape)}",
         *body_function(name, len(inputs), body, results),
         f'extern "C" __global__ void {name}({", ".join(params)}) {{',
         "  const long long n8 = n / 8;",
         f"  const long long v0 = blockIdx.x * ({per}LL * blockDim.x) + threadIdx.x;",
         f"  const bool wide = (({aligned}) & 15ULL) == 0;"]
    for j in range(per):
        L.append(f"  const long long v{j + 1} = v0 + {j}LL * blockDim.x;")
        for k in range(len(inputs)):
            L += [f"  float a{k}_{j}[8];",
                  f"  if (v{j + 1} < n8) {{ if (wide) load8(p{k}, v{j + 1}, a{k}_{j}); "
                  f"else for (int e = 0; e < 8; ++e) a{k}_{j}[e] = ld(p{k}, 8 * v{j + 1} + e); }}"]
    for j in range(per):
        L.append(f"  if (v{j + 1} < n8) {{")
        L += [f"    float b{k}_{j}[8];" for k in range(len(results))]
        L.append("#pragma unroll")
        L.append("    for (int e = 0; e < 8; ++e) "
                 f"{name}_body({', '.join([f'a{k}_{j}[e]' for k in range(len(inputs))] + [f'b{k}_{j}[e]' for k in range(len(results))])});")
        for k in range(len(results)):
            L.append(f"    if (wide) store8(q{k}, v{j + 1}, b{k}_{j}); "
                     f"else for (int e = 0; e < 8; ++e) st(q{k}, 8 * v{j + 1} + e, b{k}_{j}[e]);")
        L.append("  }")
    L.append("}")
    threads = 256
    grid = max(1, -(-(n // 8) // (threads * per)))
    args = [a for i in inputs for a in piece_args(i)] + [("out", key) for key, _, _ in results] + [("i64", n)]
    extent = Extent(n, len(args) - 1, unit=8 * threads * per, align=math.lcm(8, math.prod(shape[1:]) if shape else 1)) \
        if outer_varies(shape, inputs) else None
    return KernelCode("\n".join(L) + "\n", name, grid, threads, args,
                      f"{len(body)} elementwise op(s), vectorized 16-bit: eight values per 16-byte access, {per} "
                      f"group(s) of eight per thread in one pass, fp32 math, {len(inputs)} input(s), "
                      f"{len(results)} output(s)", True, extent=extent)


def _grouped_pointwise_loop(name: str, shape: tuple[int, ...], inputs: list[PointwiseInput],
                            results: list[tuple[str, str, torch.dtype]]) -> list[str]:
    """The loop of a pointwise kernel over groups of four consecutive outputs (the last extent a multiple
    of 4). Per operand: `vec` — fp32, unit stride along the last dimension and every other term a multiple
    of 4, so one 16-byte load; `vec16` — the same layout in fp16/bf16, one 8-byte load of four halves;
    `splat` — broadcast along the last dimension, one load repeated; `gather` — four loads. fp32 results
    are stored 16 bytes at a time, 16-bit ones 8 bytes. The vector path runs when every pointer it reads
    or writes that way is 16-byte aligned; otherwise the same loop takes scalar accesses."""
    last = len(shape) - 1
    kinds = []
    for inp in inputs:
        if inp.pieces:
            kinds.append("cat")
            continue
        stride = inp.strides[last]
        others = [st for d, st in enumerate(inp.strides) if d != last and shape[d] != 1]
        unit = stride == 1 and all(st % 4 == 0 for st in others) and inp.offset % 4 == 0
        if unit and inp.dtype == torch.float32:
            kinds.append("vec")
        elif unit and inp.dtype in HALF_DTYPES:
            kinds.append("vec16")
        else:
            kinds.append("splat" if stride == 0 else "gather")
    wide = [f"p{k}" for k, kd in enumerate(kinds) if kd in ("vec", "vec16")] + \
           [f"q{k}" for k, (_, _, dt) in enumerate(results) if dt in (torch.float32, *HALF_DTYPES)]
    aligned = " | ".join(f"reinterpret_cast<unsigned long long>({p})" for p in wide) or "0ULL"
    coords = split_coordinates("i", shape, list(range(len(shape))))
    L = [f"  const bool wide = (({aligned}) & 15ULL) == 0;",
         "  const long long n4 = n / 4;",
         "  for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < n4; "
         "g += (long long)gridDim.x * blockDim.x) {",
         "    const long long i = 4 * g;"]
    L += [f"    {c}" for c in coords]
    for k, (inp, kd) in enumerate(zip(inputs, kinds)):
        if kd == "cat":  # the one piece the four outputs read: a 16-byte load where it can, else four
            def four(p: str, e: str, piece, dtype=inp.dtype) -> str:
                step = piece.strides[last]
                gather = (f"make_float4(ld({p}, {e}), ld({p}, {e} + {step}LL), ld({p}, {e} + {2 * step}LL), "
                          f"ld({p}, {e} + {3 * step}LL))")
                others = [st for d, st in enumerate(piece.strides) if d != last and shape[d] != 1]
                if dtype != torch.float32 or step != 1 or any(st % 4 for st in others):
                    return gather
                return (f"((reinterpret_cast<unsigned long long>({p}) & 15ULL) == 0 ? "
                        f"*reinterpret_cast<const float4*>({p} + ({e})) : {gather})")
            L.append(f"    const float4 a{k} = {piece_select(k, inp, shape, four)};")
            continue
        index = element_index(inp, shape)
        if kd == "vec":
            L += [f"    const long long e{k} = {index};",
                  f"    const float4 a{k} = wide ? *reinterpret_cast<const float4*>(p{k} + e{k})"
                  f" : make_float4(p{k}[e{k}], p{k}[e{k} + 1], p{k}[e{k} + 2], p{k}[e{k} + 3]);"]
        elif kd == "vec16":
            L.append(f"    const float4 a{k} = load4(p{k} + ({index}), 0, wide);")
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
        elif dt in HALF_DTYPES:
            L.append(f"    store4(q{k} + i, 0, b{k}, wide);")
        else:
            L.append(f"    {scalar}")
    L.append("  }")
    return L
