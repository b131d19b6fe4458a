# corpus: honest problem=mean_over_dim
# Mean over a middle dimension: the tensor is viewed as (outer, reduce, inner) and one thread owns
# one (outer, inner) column, so a warp reads consecutive addresses at every step; four partial sums
# keep the loads independent.
import math

import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
extern "C" __global__ void mean_middle(const float* x, float* y, long long outer, int reduce, long long inner) {
  long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= outer * inner) return;
  long long o = idx / inner, i = idx % inner;
  const float* base = x + o * reduce * inner + i;
  float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
  int r = 0;
  for (; r + 3 < reduce; r += 4) {
    a0 += base[(long long)r * inner];
    a1 += base[(long long)(r + 1) * inner];
    a2 += base[(long long)(r + 2) * inner];
    a3 += base[(long long)(r + 3) * inner];
  }
  for (; r < reduce; ++r) a0 += base[(long long)r * inner];
  y[idx] = ((a0 + a1) + (a2 + a3)) / (float)reduce;
}
"""

_mean = jit.compile(SOURCE, "mean_middle")


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        x = x.contiguous()
        dim = self.dim % x.dim()
        outer = math.prod(x.shape[:dim])
        reduce = x.shape[dim]
        inner = math.prod(x.shape[dim + 1:])
        out_shape = x.shape[:dim] + x.shape[dim + 1:]
        y = torch.empty(out_shape, device=x.device, dtype=x.dtype)
        total = outer * inner
        if total > 0:
            _mean((total + 255) // 256, 256, x, y, outer, reduce, inner)
        return y
