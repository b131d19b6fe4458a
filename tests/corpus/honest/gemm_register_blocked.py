# corpus: honest problem=gemm
# Register-blocked GEMM: a 64x64 output tile per block of 16x16 threads, each thread accumulating
# a 4x4 micro-tile (rows ty + 16i, columns tx + 16j) from 64x16 / 16x64 shared tiles.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
#define BM 64
#define BN 64
#define BK 16

extern "C" __global__ void __launch_bounds__(256) gemm_4x4(const float* a, const float* b, float* c,
                                                          int m, int n, int k) {
  __shared__ float as[BM][BK + 1];
  __shared__ float bs[BK][BN];
  int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 16 + tx;
  int bm = blockIdx.y * BM, bn = blockIdx.x * BN;
  float acc[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  for (int t = 0; t < k; t += BK) {
    for (int l = 0; l < 4; ++l) {
      int idx = tid + l * 256;
      int ar = idx / BK, ac = idx % BK;  // A tile: 64 rows x 16 columns
      int gr = bm + ar, gc = t + ac;
      as[ar][ac] = (gr < m && gc < k) ? a[(long long)gr * k + gc] : 0.0f;
      int br = idx / BN, bc = idx % BN;  // B tile: 16 rows x 64 columns
      int hr = t + br, hc = bn + bc;
      bs[br][bc] = (hr < k && hc < n) ? b[(long long)hr * n + hc] : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < BK; ++kk) {
      float av[4], bv[4];
      for (int i = 0; i < 4; ++i) av[i] = as[ty + 16 * i][kk];
      for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx + 16 * j];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i) {
    int row = bm + ty + 16 * i;
    if (row >= m) continue;
    for (int j = 0; j < 4; ++j) {
      int col = bn + tx + 16 * j;
      if (col < n) c[(long long)row * n + col] = acc[i][j];
    }
  }
}
"""

_gemm = jit.compile(SOURCE, "gemm_4x4")


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        a = a.contiguous()
        b = b.contiguous()
        m, k = a.shape
        k2, n = b.shape
        if k != k2:
            raise ValueError(f"inner dimensions differ: {k} and {k2}")
        c = torch.empty(m, n, device=a.device, dtype=a.dtype)
        if m > 0 and n > 0:
            _gemm(((n + 63) // 64, (m + 63) // 64), (16, 16), a, b, c, m, n, k)
        return c
