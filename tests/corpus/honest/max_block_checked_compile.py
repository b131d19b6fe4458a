# corpus: honest problem=max_over_dim
# One block per row, block-wide max through shared memory; the kernel is compiled in the
# constructor inside a try that re-raises with the kernel's name, never falling back to torch.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
#define NEG_INF __int_as_float(0xff800000)  // -inf: NVRTC has no <math.h> INFINITY
extern "C" __global__ void row_max_block(const float* x, float* y, int cols) {
  __shared__ float partial[256];
  const float* in = x + (long long)blockIdx.x * cols;
  float m = NEG_INF;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, in[c]);
  partial[threadIdx.x] = m;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] = fmaxf(partial[threadIdx.x], partial[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x == 0) y[blockIdx.x] = partial[0];
}
"""

_THREADS = 256  # a power of two, and the size of the shared array


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        try:
            self.row_max = jit.compile(SOURCE, "row_max_block")
        except Exception as exc:
            raise RuntimeError(f"row_max_block failed to compile: {exc}") from exc

    def forward(self, x):
        x = x.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty(x.shape[:-1], device=x.device, dtype=x.dtype)
        if rows > 0:
            self.row_max(rows, _THREADS, x, y, cols)
        return y
