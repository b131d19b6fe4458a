# corpus: honest problem=linear_relu
# The whole layer in one kernel: a 32x32 shared-memory tiled GEMM of x (M,K) against W (N,K) with
# the bias add and ReLU applied to the accumulator before the single store.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
#define TILE 32
#define ROWS_PER_THREAD 4  // blockDim = (32, 8): each thread owns 4 rows of the output tile

extern "C" __global__ void linear_bias_relu(const float* x, const float* w, const float* bias, float* y,
                                            int m, int n, int k) {
  __shared__ float xs[TILE][TILE + 1];
  __shared__ float ws[TILE][TILE + 1];  // ws[j][kk] = W[col0 + j][k0 + kk]
  int tx = threadIdx.x, ty = threadIdx.y;
  int row0 = blockIdx.y * TILE, col0 = blockIdx.x * TILE;
  float acc[ROWS_PER_THREAD] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int k0 = 0; k0 < k; k0 += TILE) {
    for (int r = 0; r < ROWS_PER_THREAD; ++r) {
      int tr = ty + 8 * r;
      int xr = row0 + tr, wr = col0 + tr, kk = k0 + tx;
      xs[tr][tx] = (xr < m && kk < k) ? x[(long long)xr * k + kk] : 0.0f;
      ws[tr][tx] = (wr < n && kk < k) ? w[(long long)wr * k + kk] : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < TILE; ++kk) {
      float wv = ws[tx][kk];
      for (int r = 0; r < ROWS_PER_THREAD; ++r) acc[r] += xs[ty + 8 * r][kk] * wv;
    }
    __syncthreads();
  }
  int col = col0 + tx;
  if (col >= n) return;
  float b = bias[col];
  for (int r = 0; r < ROWS_PER_THREAD; ++r) {
    int row = row0 + ty + 8 * r;
    if (row < m) y[(long long)row * n + col] = fmaxf(acc[r] + b, 0.0f);
  }
}
"""

_kernel = jit.compile(SOURCE, "linear_bias_relu")


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        x = x.contiguous()
        w = self.linear.weight.contiguous()
        k = x.shape[-1]
        m = x.numel() // k
        n = w.shape[0]
        y = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
        if m > 0 and n > 0:
            _kernel(((n + 31) // 32, (m + 31) // 32), (32, 8), x, w, self.linear.bias, y, m, n, k)
        return y
