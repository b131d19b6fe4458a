# corpus: honest problem=layer_norm
# One block per row: Welford mean/variance per thread, merged across the warp with shuffles and
# across warps through shared memory (Chan's formula), then the affine normalized write.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
struct Stats { float n, mean, m2; };

__device__ __forceinline__ Stats merge(Stats a, Stats b) {
  float n = a.n + b.n;
  if (n == 0.0f) return a;
  float delta = b.mean - a.mean;
  float wb = b.n / n;
  Stats r;
  r.n = n;
  r.mean = a.mean + delta * wb;
  r.m2 = a.m2 + b.m2 + delta * delta * a.n * wb;
  return r;
}

__device__ __forceinline__ Stats warp_merge(Stats s) {
  for (int o = 16; o > 0; o >>= 1) {
    Stats other;
    other.n = __shfl_xor_sync(0xffffffffu, s.n, o);
    other.mean = __shfl_xor_sync(0xffffffffu, s.mean, o);
    other.m2 = __shfl_xor_sync(0xffffffffu, s.m2, o);
    s = merge(s, other);
  }
  return s;
}

extern "C" __global__ void layer_norm_welford(const float* x, const float* w, const float* b, float* y,
                                              int cols, float eps) {
  __shared__ float sn[32], smean[32], sm2[32];
  __shared__ float row_mean, row_rstd;
  const float* in = x + (long long)blockIdx.x * cols;
  float* out = y + (long long)blockIdx.x * cols;
  Stats s = {0.0f, 0.0f, 0.0f};
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = in[c];
    s.n += 1.0f;
    float delta = v - s.mean;
    s.mean += delta / s.n;
    s.m2 += delta * (v - s.mean);
  }
  s = warp_merge(s);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) { sn[warp] = s.n; smean[warp] = s.mean; sm2[warp] = s.m2; }
  __syncthreads();
  if (warp == 0) {
    Stats t = {0.0f, 0.0f, 0.0f};
    if (lane < warps) { t.n = sn[lane]; t.mean = smean[lane]; t.m2 = sm2[lane]; }
    t = warp_merge(t);
    if (lane == 0) { row_mean = t.mean; row_rstd = rsqrtf(t.m2 / t.n + eps); }
  }
  __syncthreads();
  float mean = row_mean, rstd = row_rstd;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) out[c] = (in[c] - mean) * rstd * w[c] + b[c];
}
"""

_layer_norm = jit.compile(SOURCE, "layer_norm_welford")


class ModelNew(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)  # holds weight, bias and eps, as the reference's does

    def forward(self, x):
        x = x.contiguous()
        cols = self.norm.weight.numel()
        if x.shape[-1] != cols:
            raise ValueError(f"last dimension {x.shape[-1]} is not the normalized size {cols}")
        rows = x.numel() // cols
        y = torch.empty_like(x)
        if rows > 0:
            _layer_norm(rows, 256, x, self.norm.weight, self.norm.bias, y, cols, float(self.norm.eps))
        return y
