"""Layout conversion at a channels-last chain's edges: NCHW to NHWC as a tiled transpose at the input
edge, and at the output edge the elementwise ops that read NHWC values and write an NCHW result, with the
NHWC operands staged through the same tiles."""

from __future__ import annotations

import torch

from .common import CTYPE, PRELUDE, Extent, KernelCode, PointwiseInput, element_index
from .pointwise import body_function

TILE = 32  # a 32 x 32 tile of (channels, pixels) per block: each warp's loads and stores are 32 consecutive values
ROWS = 8   # the block's rows of threads; each thread moves TILE / ROWS values of its tile


def nchw_to_nhwc_kernel(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> KernelCode:
    """Copies a contiguous [N, C, H, W] tensor into NHWC order ([N, H, W, C] in memory). Per image, the
    [C, H*W] matrix is transposed in 32 x 32 tiles through shared memory: a warp reads 32 consecutive
    pixels of one channel and writes 32 consecutive channels of one pixel, so both sides are coalesced,
    where an elementwise copy in either order makes one of them a gather with a stride of C or H*W
    elements. The tile's row is padded by one element so that reading its columns hits 32 different
    banks. Arguments: x, y."""
    if len(shape) != 4:
        raise ValueError(f"an NCHW to NHWC conversion takes a 4-d shape, got {shape}")
    n, c, h, w = shape
    hw = h * w
    if min(n, c, hw) <= 0:
        raise ValueError(f"an NCHW to NHWC conversion of an empty tensor {shape}")
    if n > 65535 or -(-c // TILE) > 65535:
        raise ValueError(f"{shape}: more images or channel tiles than a grid dimension holds (65,535)")
    T = CTYPE[dtype]
    source = "\n".join([
        "#include <cuda_fp16.h>",
        "#include <cuda_bf16.h>",
        f"// {name}: [N, {c}, {h}, {w}] NCHW to NHWC, {TILE}x{TILE} tiles of (channels, pixels) through shared memory",
        f"#define TILE {TILE}",
        f"#define ROWS {ROWS}",
        f'extern "C" __global__ void __launch_bounds__(TILE * ROWS) {name}(const {T}* __restrict__ x, '
        f"{T}* __restrict__ y) {{",
        f"  __shared__ {T} tile[TILE][TILE + 1];",
        f"  const long long image = (long long)blockIdx.z * {c}LL * {hw}LL;",
        "  const int p0 = blockIdx.x * TILE, c0 = blockIdx.y * TILE;",
        "  // Read: lanes along the pixels of one channel.",
        "#pragma unroll",
        "  for (int r = threadIdx.y; r < TILE; r += ROWS) {",
        "    const int ch = c0 + r, p = p0 + threadIdx.x;",
        f"    if (ch < {c} && p < {hw}) tile[r][threadIdx.x] = x[image + (long long)ch * {hw}LL + p];",
        "  }",
        "  __syncthreads();",
        "  // Write: lanes along the channels of one pixel.",
        "#pragma unroll",
        "  for (int r = threadIdx.y; r < TILE; r += ROWS) {",
        "    const int p = p0 + r, ch = c0 + threadIdx.x;",
        f"    if (ch < {c} && p < {hw}) y[image + (long long)p * {c}LL + ch] = tile[threadIdx.x][r];",
        "  }",
        "}",
    ]) + "\n"
    grid = (-(-hw // TILE), -(-c // TILE), n)
    # The images are the grid's third dimension: the source serves any number of them (up to 65,535).
    return KernelCode(source, name, grid, (TILE, ROWS), [("in", "in0"), ("out", "out0")],
                      extent=Extent(n, None, axis=2, limit=65535), description=
                      f"NCHW to NHWC of [{n}, {c}, {h}, {w}]: {TILE}x{TILE} tiles through shared memory, "
                      "coalesced reads and writes")


def pointwise_from_nhwc_kernel(name: str, shape: tuple[int, ...], inputs: list[PointwiseInput], body: list[str],
                               results: list[tuple[str, str, torch.dtype]]) -> KernelCode:
    """A fused elementwise kernel at a channels-last chain's output edge: contiguous [N, C, H, W] results
    from operands some of which are stored NHWC (a convolution's output, a residual). Iterating NCHW, an
    NHWC operand is a gather with a stride of C elements (a 32-byte sector fetched per 4-byte value);
    here each block takes a 32 x 32 tile of (channels, pixels) of one image, stages every NHWC operand's
    tile through shared memory with lanes along the channels, then computes with lanes along the pixels,
    reading the other operands at their own strides and storing coalesced. Arguments as pointwise_kernel's."""
    if len(shape) != 4:
        raise ValueError(f"an NHWC edge kernel takes a 4-d shape, got {shape}")
    n, c, h, w = shape
    hw = h * w
    if min(n, c, hw) <= 0 or n > 65535 or -(-c // TILE) > 65535:
        raise ValueError(f"no NHWC edge kernel for {shape} (empty, or more images or channel tiles than a grid "
                         "dimension holds)")
    staged = [k for k, i in enumerate(inputs) if i.strides[1] == 1 and c > 1 and i.strides[3] != 0]
    if not staged:
        raise ValueError("an NHWC edge kernel needs an operand stored channels-last")
    params = [f"const {CTYPE[i.dtype]}* __restrict__ p{k}" for k, i in enumerate(inputs)]
    params += [f"{CTYPE[dt]}* __restrict__ q{k}" for k, (_, _, dt) in enumerate(results)]
    params.append("long long n")
    coords = ["        const long long c0 = blockIdx.z, c1 = ch;",
              f"        const long long c2 = p / {w}, c3 = p % {w};"]
    L = [PRELUDE, f"// {name}: {len(body)} fused elementwise op(s) over [N, {c}, {h}, {w}], NCHW results, "
         f"{len(staged)} NHWC operand(s) staged through {TILE}x{TILE} tiles",
         f"#define TILE {TILE}", f"#define ROWS {ROWS}",
         *body_function(name, len(inputs), body, results),
         f'extern "C" __global__ void __launch_bounds__(TILE * ROWS) {name}({", ".join(params)}) {{',
         *[f"  __shared__ float t{k}[TILE][TILE + 1];" for k in staged],
         "  const int px0 = blockIdx.x * TILE, ch0 = blockIdx.y * TILE;",
         "  // Stage: lanes along the channels of one pixel (the NHWC operands' unit stride).",
         "#pragma unroll",
         "  for (int r = threadIdx.y; r < TILE; r += ROWS) {",
         "    const int p = px0 + r, ch = ch0 + threadIdx.x;",
         f"    if (ch < {c} && p < {hw}) {{",
         *coords,
         *[f"        t{k}[r][threadIdx.x] = ld(p{k}, {element_index(inputs[k], shape)});" for k in staged],
         "    }",
         "  }",
         "  __syncthreads();",
         "  // Compute: lanes along the pixels of one channel (the results' unit stride).",
         "#pragma unroll",
         "  for (int r = threadIdx.y; r < TILE; r += ROWS) {",
         "    const int ch = ch0 + r, p = px0 + threadIdx.x;",
         f"    if (ch < {c} && p < {hw}) {{",
         *coords,
         *[f"        const float v{k} = " + (f"t{k}[threadIdx.x][r];" if k in staged else
                                             f"ld(p{k}, {element_index(i, shape)});") for k, i in enumerate(inputs)],
         *[f"        float o{k};" for k in range(len(results))],
         f"        {name}_body(" + ", ".join([f"v{k}" for k in range(len(inputs))] +
                                            [f"o{k}" for k in range(len(results))]) + ");",
         *[f"        st(q{k}, (c0 * {c} + c1) * {hw}LL + p, o{k});" for k in range(len(results))],
         "    }",
         "  }",
         "}"]
    grid = (-(-hw // TILE), -(-c // TILE), n)
    args = [("in", i.key) for i in inputs] + [("out", key) for key, _, _ in results] + [("i64", n * c * hw)]
    # n counts elements (the pointwise kernels' argument); the images, n / (C * H * W), are the grid's third dimension.
    return KernelCode("\n".join(L) + "\n", name, grid, (TILE, ROWS), args, extent=Extent(
                          n * c * hw, len(args) - 1, axis=2, unit=c * hw, align=c * hw, limit=65535 * c * hw)
                      if n > 1 else None, description=
                      f"{len(body)} elementwise op(s) at a channels-last chain's output edge: {len(staged)} NHWC "
                      f"operand(s) staged through {TILE}x{TILE} tiles in shared memory, NCHW results stored coalesced")
