# corpus: honest problem=layer_norm
# Two-pass LayerNorm (mean, then centered variance) with each row cached in dynamic shared memory;
# compiled lazily on first use and wrapped in an autograd Function.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
__device__ float block_sum(float v, float* slots) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) slots[warp] = v;
  __syncthreads();
  float r = lane < warps ? slots[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
  return r;
}

extern "C" __global__ void layer_norm_two_pass(const float* x, const float* w, const float* b, float* y,
                                               int cols, float eps) {
  extern __shared__ float row[];  // cols floats
  __shared__ float slots[32];
  const float* in = x + (long long)blockIdx.x * cols;
  float* out = y + (long long)blockIdx.x * cols;
  float s = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) { float v = in[c]; row[c] = v; s += v; }
  float mean = block_sum(s, slots) / cols;  // block_sum's barriers also publish row[]
  float q = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) { float d = row[c] - mean; q += d * d; }
  float rstd = rsqrtf(block_sum(q, slots) / cols + eps);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) out[c] = (row[c] - mean) * rstd * w[c] + b[c];
}
"""

_kernel = None


def _layer_norm_kernel():
    global _kernel
    if _kernel is None:
        _kernel = jit.compile(SOURCE, "layer_norm_two_pass")
    return _kernel


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        cols = weight.numel()
        rows = x.numel() // cols
        y = torch.empty_like(x)
        if rows > 0:
            _layer_norm_kernel()(rows, 256, x, weight, bias, y, cols, eps, shared_mem=4 * cols)
        return y


class ModelNew(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x):
        if x.shape[-1] * 4 > 49152:  # the default dynamic shared memory limit
            raise ValueError("rows longer than 12288 floats do not fit this kernel's shared memory")
        return _LayerNorm.apply(x.contiguous(), self.norm.weight, self.norm.bias, float(self.norm.eps))
