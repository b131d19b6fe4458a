# corpus: honest problem=gemm
# Classic shared-memory tiled GEMM: 16x16 tiles of A and B staged in shared memory behind
# barriers, zero-padded at the edges so any M, N, K works.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
#define TILE 16
extern "C" __global__ void gemm_tiled(const float* a, const float* b, float* c, int m, int n, int k) {
  __shared__ float as[TILE][TILE];
  __shared__ float bs[TILE][TILE + 1];
  int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
  float acc = 0.0f;
  for (int t = 0; t < k; t += TILE) {
    as[threadIdx.y][threadIdx.x] = (row < m && t + threadIdx.x < k) ? a[(long long)row * k + t + threadIdx.x] : 0.0f;
    bs[threadIdx.y][threadIdx.x] = (col < n && t + threadIdx.y < k) ? b[(long long)(t + threadIdx.y) * n + col] : 0.0f;
    __syncthreads();
    for (int i = 0; i < TILE; ++i) acc += as[threadIdx.y][i] * bs[i][threadIdx.x];
    __syncthreads();
  }
  if (row < m && col < n) c[(long long)row * n + col] = acc;
}
"""

_gemm = jit.compile(SOURCE, "gemm_tiled")


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
            _gemm(((n + 15) // 16, (m + 15) // 16), (16, 16), a, b, c, m, n, k)
        return c
