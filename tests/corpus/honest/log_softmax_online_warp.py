# corpus: honest problem=log_softmax
# One warp per row: an online pass for max and rescaled sum, merged with shuffles, then
# y = (x - max) - log(sum) in a second pass; the reduced dimension is moved last first.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
#define NEG_INF __int_as_float(0xff800000)  // -inf: NVRTC has no <math.h> INFINITY
__device__ __forceinline__ float rescale(float m, float M) { return m == NEG_INF ? 0.0f : expf(m - M); }

extern "C" __global__ void log_softmax_warp(const float* x, float* y, int rows, int cols) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* in = x + (long long)row * cols;
  float* out = y + (long long)row * cols;
  float m = NEG_INF, s = 0.0f;
  for (int c = lane; c < cols; c += 32) {
    float v = in[c];
    if (v > m) { s = s * rescale(m, v) + 1.0f; m = v; }
    else { s += expf(v - m); }
  }
  for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    float M = fmaxf(m, m2);
    s = s * rescale(m, M) + s2 * rescale(m2, M);
    m = M;
  }
  float lse = logf(s);  // (x - max) - log(sum), as torch does: no rounding of max + log(sum)
  for (int c = lane; c < cols; c += 32) out[c] = (in[c] - m) - lse;
}
"""

_kernel = jit.compile(SOURCE, "log_softmax_warp")


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        moved = x.movedim(self.dim, -1).contiguous()
        cols = moved.shape[-1]
        rows = moved.numel() // cols
        y = torch.empty_like(moved)
        warps_per_block = 4
        if rows > 0:
            _kernel((rows + warps_per_block - 1) // warps_per_block, 32 * warps_per_block, moved, y, rows, cols)
        return y.movedim(-1, self.dim)
