# corpus: honest problem=bias_gelu
# Bias add and exact erf GELU fused in one elementwise kernel; the bias is created exactly as the
# reference creates it, so the seeded weights match.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
extern "C" __global__ void bias_gelu(const float* x, const float* bias, float* y, long long n, int cols) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    float v = x[i] + bias[i % cols];
    y[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
  }
}
"""

_bias_gelu = jit.compile(SOURCE, "bias_gelu")


class ModelNew(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features) * 0.1)

    def forward(self, x):
        x = x.contiguous()
        cols = self.bias.numel()
        if x.shape[-1] != cols:
            raise ValueError(f"last dimension {x.shape[-1]} does not match the bias ({cols})")
        y = torch.empty_like(x)
        n = x.numel()
        _bias_gelu(min((n + 255) // 256, 8192), 256, x, self.bias.contiguous(), y, n, cols)
        return y
