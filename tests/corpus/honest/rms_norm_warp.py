# corpus: honest problem=rms_norm
# One warp per row: sum of squares reduced with warp shuffles, then x * rsqrt(mean + eps) * weight.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
extern "C" __global__ void rms_norm_warp(const float* x, const float* w, float* y, int rows, int cols,
                                         float eps) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* in = x + (long long)row * cols;
  float* out = y + (long long)row * cols;
  float ss = 0.0f;
  for (int c = lane; c < cols; c += 32) { float v = in[c]; ss += v * v; }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  float r = rsqrtf(ss / cols + eps);
  for (int c = lane; c < cols; c += 32) out[c] = in[c] * r * w[c];
}
"""

_rms_norm = jit.compile(SOURCE, "rms_norm_warp")


class ModelNew(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        x = x.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty_like(x)
        warps_per_block = 8
        grid = (rows + warps_per_block - 1) // warps_per_block
        if rows > 0:
            _rms_norm(grid, 32 * warps_per_block, x, self.weight, y, rows, cols, float(self.eps))
        return y
