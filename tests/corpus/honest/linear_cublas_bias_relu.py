# corpus: honest problem=linear_relu
# cuBLAS does the GEMM (x @ W^T, true fp32); a custom epilogue kernel fuses the bias add and ReLU
# in one pass over the product. The nn.Linear is only a parameter holder, so weights match.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
extern "C" __global__ void bias_relu(const float* h, const float* bias, float* y, long long n, int cols) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    y[i] = fmaxf(h[i] + bias[i % cols], 0.0f);
}
"""

_bias_relu = jit.compile(SOURCE, "bias_relu")


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        h = torch.matmul(x, self.linear.weight.t())
        y = torch.empty_like(h)
        n, cols = h.numel(), h.shape[-1]
        _bias_relu(min((n + 255) // 256, 8192), 256, h, self.linear.bias, y, n, cols)
        return y
