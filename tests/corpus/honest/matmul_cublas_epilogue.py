# corpus: honest problem=matmul_scale_residual
# cuBLAS GEMM (torch.matmul), then one custom kernel for scale, residual add and ReLU, so the
# product is read once instead of three times.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
extern "C" __global__ void scale_add_relu(const float* h, const float* c, float* y, float scale, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    y[i] = fmaxf(h[i] * scale + c[i], 0.0f);
}
"""

_epilogue = jit.compile(SOURCE, "scale_add_relu")


class ModelNew(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, a, b, c):
        h = torch.matmul(a, b)
        c = c.expand_as(h).contiguous()
        y = torch.empty_like(h)
        n = h.numel()
        _epilogue(min((n + 255) // 256, 8192), 256, h, c, y, float(self.scale), n)
        return y
