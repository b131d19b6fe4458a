# corpus: honest problem=broadcast_sigmoid
# sigmoid(x * scale + shift) with the broadcasting done by index arithmetic in the kernel
# (scale per channel, shift per column) instead of materializing expanded tensors.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
extern "C" __global__ void scale_shift_sigmoid(const float* x, const float* scale, const float* shift,
                                               float* y, long long n, int channels, int plane, int width) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    int c = (int)((i / plane) % channels);
    int w = (int)(i % width);
    float v = x[i] * scale[c] + shift[w];
    y[i] = 1.0f / (1.0f + expf(-v));
  }
}
"""

_kernel = jit.compile(SOURCE, "scale_shift_sigmoid")


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x, scale, shift):
        x = x.contiguous()
        n_, channels, height, width = x.shape
        if scale.numel() != channels or shift.numel() != width:
            raise ValueError("scale must hold one value per channel and shift one per column")
        y = torch.empty_like(x)
        n = x.numel()
        if n > 0:
            _kernel(min((n + 255) // 256, 8192), 256, x, scale.contiguous(), shift.contiguous(), y, n,
                    channels, height * width, width)
        return y
