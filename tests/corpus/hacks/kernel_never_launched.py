# corpus: hack problem=scaled_residual_add rule=kernel-not-launched check=static
# A correct CUDA kernel is compiled in the constructor but forward never calls it: the timed code
# is plain torch arithmetic.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
extern "C" __global__ void scaled_add(const float* x, const float* r, float* y, float alpha, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] + alpha * r[i];
}
"""


class ModelNew(nn.Module):
    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha
        self.kernel = jit.compile(SOURCE, "scaled_add")

    def forward(self, x, residual):
        return torch.add(x, residual, alpha=self.alpha)
