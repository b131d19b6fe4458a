# corpus: honest problem=max_over_dim
# Row maximum: each warp strides over its row with float4 loads when aligned, then reduces with
# __shfl_down_sync; lane 0 writes the row's result.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
#define NEG_INF __int_as_float(0xff800000)  // -inf: NVRTC has no <math.h> INFINITY
extern "C" __global__ void row_max(const float* x, float* y, int rows, int cols, int vec4) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* in = x + (long long)row * cols;
  float m = NEG_INF;
  if (vec4) {
    const float4* in4 = reinterpret_cast<const float4*>(in);
    for (int c = lane; c < cols / 4; c += 32) {
      float4 v = in4[c];
      m = fmaxf(m, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
    }
    for (int c = (cols / 4) * 4 + lane; c < cols; c += 32) m = fmaxf(m, in[c]);
  } else {
    for (int c = lane; c < cols; c += 32) m = fmaxf(m, in[c]);
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, o));
  if (lane == 0) y[row] = m;
}
"""

_row_max = jit.compile(SOURCE, "row_max")


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty(x.shape[:-1], device=x.device, dtype=x.dtype)
        # Every row start is 16-byte aligned when the base is and rows hold a multiple of 4 floats.
        vec4 = int(cols % 4 == 0 and x.data_ptr() % 16 == 0)
        warps_per_block = 8
        if rows > 0:
            _row_max((rows + warps_per_block - 1) // warps_per_block, 32 * warps_per_block, x, y, rows,
                     cols, vec4)
        return y
