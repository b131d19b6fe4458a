# corpus: honest problem=rms_norm
# One block per row with float4 loads when the row length allows it; a try around the compile
# re-raises with a clear message instead of hiding the failure.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
__device__ float block_sum(float v, float* slots) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) slots[warp] = v;
  __syncthreads();
  float r = lane < warps ? slots[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
  return r;
}

// cols % 4 == 0 and 16-byte aligned rows: checked by the caller.
extern "C" __global__ void rms_norm_vec4(const float4* x, const float4* w, float4* y, int cols4, float eps) {
  __shared__ float slots[32];
  const float4* in = x + (long long)blockIdx.x * cols4;
  float4* out = y + (long long)blockIdx.x * cols4;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < cols4; c += blockDim.x) {
    float4 v = in[c];
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  float r = rsqrtf(block_sum(ss, slots) / (4.0f * cols4) + eps);
  for (int c = threadIdx.x; c < cols4; c += blockDim.x) {
    float4 v = in[c], g = w[c];
    out[c] = make_float4(v.x * r * g.x, v.y * r * g.y, v.z * r * g.z, v.w * r * g.w);
  }
}

extern "C" __global__ void rms_norm_scalar(const float* x, const float* w, float* y, int cols, float eps) {
  __shared__ float slots[32];
  const float* in = x + (long long)blockIdx.x * cols;
  float* out = y + (long long)blockIdx.x * cols;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) { float v = in[c]; ss += v * v; }
  float r = rsqrtf(block_sum(ss, slots) / cols + eps);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) out[c] = in[c] * r * w[c];
}
"""

try:
    _module = jit.compile_module(SOURCE)
except Exception as exc:
    raise RuntimeError(f"rms_norm kernels failed to compile: {exc}") from exc
_vec4 = _module.kernel("rms_norm_vec4")
_scalar = _module.kernel("rms_norm_scalar")


class ModelNew(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        x = x.contiguous()
        w = self.weight.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty_like(x)
        if rows == 0:
            return y
        if cols % 4 == 0 and all(t.data_ptr() % 16 == 0 for t in (x, w, y)):
            _vec4(rows, 256, x, w, y, cols // 4, float(self.eps))
        else:
            _scalar(rows, 256, x, w, y, cols, float(self.eps))
        return y
