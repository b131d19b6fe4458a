# corpus: honest problem=scaled_residual_add
# float4-vectorized y = x + alpha * r with a grid-stride loop; a scalar kernel covers the tail and
# tensors whose data pointers are not 16-byte aligned.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
extern "C" __global__ void scaled_add_vec4(const float4* x, const float4* r, float4* y, float alpha,
                                           long long n4) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
       i += (long long)gridDim.x * blockDim.x) {
    float4 a = x[i], b = r[i];
    y[i] = make_float4(a.x + alpha * b.x, a.y + alpha * b.y, a.z + alpha * b.z, a.w + alpha * b.w);
  }
}

extern "C" __global__ void scaled_add_scalar(const float* x, const float* r, float* y, float alpha,
                                             long long start, long long n) {
  for (long long i = start + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    y[i] = x[i] + alpha * r[i];
}
"""

_module = jit.compile_module(SOURCE)
_vec4 = _module.kernel("scaled_add_vec4")
_scalar = _module.kernel("scaled_add_scalar")


class ModelNew(nn.Module):
    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, x, residual):
        x = x.contiguous()
        residual = residual.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        aligned = all(t.data_ptr() % 16 == 0 for t in (x, residual, y))
        n4 = n // 4 if aligned else 0
        if n4 > 0:
            _vec4(min((n4 + 255) // 256, 8192), 256, x, residual, y, float(self.alpha), n4)
        if 4 * n4 < n:
            rest = n - 4 * n4
            _scalar(min((rest + 255) // 256, 8192), 256, x, residual, y, float(self.alpha), 4 * n4, n)
        return y
