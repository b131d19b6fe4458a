# corpus: honest problem=conv_bn_relu
# cuDNN runs the convolution; custom kernels compute the per-channel batch statistics (training
# mode, deterministic: one block per channel) and apply BatchNorm + ReLU in one fused pass.
import torch
import torch.nn as nn
import torch.nn.functional as F
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

// Block c: mean and biased variance of channel c of an (N, C, HW) tensor, centered two-pass.
extern "C" __global__ void channel_stats(const float* x, float* mean, float* var, int n, int c, int hw) {
  __shared__ float slots[32];
  int ch = blockIdx.x;
  long long count = (long long)n * hw;
  float s = 0.0f;
  for (long long j = threadIdx.x; j < count; j += blockDim.x) {
    long long b = j / hw, p = j % hw;
    s += x[(b * c + ch) * hw + p];
  }
  float mu = block_sum(s, slots) / (float)count;
  float q = 0.0f;
  for (long long j = threadIdx.x; j < count; j += blockDim.x) {
    long long b = j / hw, p = j % hw;
    float d = x[(b * c + ch) * hw + p] - mu;
    q += d * d;
  }
  float v = block_sum(q, slots) / (float)count;
  if (threadIdx.x == 0) { mean[ch] = mu; var[ch] = v; }
}

extern "C" __global__ void bn_relu(const float* x, const float* mean, const float* var, const float* gamma,
                                   const float* beta, float* y, long long total, int c, int hw, float eps) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    int ch = (int)((i / hw) % c);
    float v = (x[i] - mean[ch]) * rsqrtf(var[ch] + eps) * gamma[ch] + beta[ch];
    y[i] = fmaxf(v, 0.0f);
  }
}
"""

_module = jit.compile_module(SOURCE)
_channel_stats = _module.kernel("channel_stats")
_bn_relu = _module.kernel("bn_relu")


class ModelNew(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(out_channels)  # parameters and running statistics live here

    def forward(self, x):
        h = F.conv2d(x, self.conv.weight, self.conv.bias, padding=1).contiguous()
        n, c, height, width = h.shape
        hw = height * width
        bn = self.bn
        if self.training or not bn.track_running_stats:
            mean = torch.empty(c, device=h.device, dtype=h.dtype)
            var = torch.empty(c, device=h.device, dtype=h.dtype)
            _channel_stats(c, 256, h, mean, var, n, c, hw)
            if self.training and bn.track_running_stats:
                with torch.no_grad():
                    bn.num_batches_tracked += 1
                    momentum = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
                    count = n * hw
                    bn.running_mean.mul_(1.0 - momentum).add_(mean, alpha=momentum)
                    bn.running_var.mul_(1.0 - momentum).add_(var * (count / max(count - 1, 1)), alpha=momentum)
        else:
            mean, var = bn.running_mean, bn.running_var
        y = torch.empty_like(h)
        total = h.numel()
        _bn_relu(min((total + 255) // 256, 8192), 256, h, mean, var, bn.weight, bn.bias, y, total, c, hw,
                 float(bn.eps))
        return y
