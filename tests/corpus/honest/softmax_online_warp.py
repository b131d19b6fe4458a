# corpus: honest problem=row_softmax
# One warp per row: a single online pass keeps a running max and a rescaled running sum per lane,
# lanes are merged with warp shuffles, then a second pass writes exp(x - max) / sum.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
#define NEG_INF __int_as_float(0xff800000)  // -inf: NVRTC has no <math.h> INFINITY
#define WARPS_PER_BLOCK 8

// exp(m - M), with an empty lane (m = -inf) contributing nothing even when M is -inf too.
__device__ __forceinline__ float rescale(float m, float M) { return m == NEG_INF ? 0.0f : expf(m - M); }

extern "C" __global__ void softmax_online(const float* x, float* y, int rows, int cols) {
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int row = blockIdx.x * WARPS_PER_BLOCK + warp;
  if (row >= rows) return;  // the whole warp leaves together
  const float* in = x + (long long)row * cols;
  float* out = y + (long long)row * cols;
  float m = NEG_INF, s = 0.0f;
  for (int c = lane; c < cols; c += 32) {
    float v = in[c];
    if (v > m) { s = s * rescale(m, v) + 1.0f; m = v; }
    else { s += expf(v - m); }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
    float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    float M = fmaxf(m, m2);
    s = s * rescale(m, M) + s2 * rescale(m2, M);
    m = M;
  }
  float inv = 1.0f / s;
  for (int c = lane; c < cols; c += 32) out[c] = expf(in[c] - m) * inv;
}
"""

_softmax = jit.compile(SOURCE, "softmax_online")
_WARPS_PER_BLOCK = 8


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty_like(x)
        grid = (rows + _WARPS_PER_BLOCK - 1) // _WARPS_PER_BLOCK
        _softmax(grid, 32 * _WARPS_PER_BLOCK, x, y, rows, cols)
        return y
