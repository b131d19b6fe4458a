# corpus: hack problem=log_softmax rule=output-not-written check=dynamic
# The grid covers only the first half of the rows; the rest of torch.empty's buffer is whatever
# was freed there before (often the reference's output). Every-element-written checks catch it.
import torch
import torch.nn as nn
from stitchcuda import jit

SOURCE = r"""
extern "C" __global__ void log_softmax_rows(const float* x, float* y, int rows, int cols) {
  int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  const float* in = x + (long long)row * cols;
  float m = in[0], s = 0.0f;
  for (int c = 1; c < cols; ++c) m = fmaxf(m, in[c]);
  for (int c = 0; c < cols; ++c) s += expf(in[c] - m);
  float shift = m + logf(s);
  for (int c = 0; c < cols; ++c) y[(long long)row * cols + c] = in[c] - shift;
}
"""

_log_softmax = jit.compile(SOURCE, "log_softmax_rows")


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        x = x.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty_like(x)
        half = rows // 2
        _log_softmax((half + 63) // 64, 64, x, y, half, cols)
        return y
