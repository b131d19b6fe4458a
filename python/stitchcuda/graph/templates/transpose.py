"""Layout conversion at a channels-last chain's edge: NCHW to NHWC as a tiled transpose."""

from __future__ import annotations

import torch

from .common import _CTYPE, KernelCode

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
    T = _CTYPE[dtype]
    source = "\n".join([
        "#include <cuda_fp16.h>",
        "#include <cuda_bf16.h>",
        f"// {name}: [{n}, {c}, {h}, {w}] NCHW to NHWC, {TILE}x{TILE} tiles of (channels, pixels) through shared memory",
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
    return KernelCode(source, name, grid, (TILE, ROWS), [("in", "in0"), ("out", "out0")],
                      f"NCHW to NHWC of [{n}, {c}, {h}, {w}]: {TILE}x{TILE} tiles through shared memory, "
                      "coalesced reads and writes")
