# corpus: honest problem=row_softmax
# One block per row: block-wide max, then block-wide sum of exp(x - max) (warp shuffles, then one
# shared slot per warp), then the normalized write.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
#define NEG_INF __int_as_float(0xff800000)  // -inf: NVRTC has no <math.h> INFINITY
template <bool IsMax>
__device__ float block_reduce(float v, float* slots) {
  for (int o = 16; o > 0; o >>= 1) {
    float other = __shfl_xor_sync(0xffffffffu, v, o);
    v = IsMax ? fmaxf(v, other) : v + other;
  }
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // slots may still be read from the previous reduction
  if (lane == 0) slots[warp] = v;
  __syncthreads();
  float r = lane < warps ? slots[lane] : (IsMax ? NEG_INF : 0.0f);
  for (int o = 16; o > 0; o >>= 1) {
    float other = __shfl_xor_sync(0xffffffffu, r, o);
    r = IsMax ? fmaxf(r, other) : r + other;
  }
  return r;  // every thread holds the block's result
}

extern "C" __global__ void softmax_rows(const float* x, float* y, int cols) {
  __shared__ float slots[32];
  const float* in = x + (long long)blockIdx.x * cols;
  float* out = y + (long long)blockIdx.x * cols;
  float m = NEG_INF;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, in[c]);
  m = block_reduce<true>(m, slots);
  float s = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) s += expf(in[c] - m);
  s = block_reduce<false>(s, slots);
  float inv = 1.0f / s;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) out[c] = expf(in[c] - m) * inv;
}
"""

_softmax = jit.compile(SOURCE, "softmax_rows")


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty_like(x)
        if rows > 0:
            _softmax(rows, 256, x, y, cols)  # 256 threads: a multiple of 32, at most 32 warps
        return y
