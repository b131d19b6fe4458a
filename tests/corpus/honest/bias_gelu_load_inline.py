# corpus: honest problem=bias_gelu
# Bias + GELU as a load_inline extension: one thread per element, each row's bias read through the
# column index; launched on PyTorch's current stream.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void bias_gelu_kernel(const float* __restrict__ x, const float* __restrict__ bias,
                                 float* __restrict__ y, long long n, int cols) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    float v = x[i] + bias[i % cols];
    y[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
  }
}

torch::Tensor bias_gelu(torch::Tensor x, torch::Tensor bias) {
  TORCH_CHECK(x.is_cuda() && bias.is_cuda(), "bias_gelu: CUDA tensors expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "bias_gelu: float32 expected");
  TORCH_CHECK(x.size(-1) == bias.numel(), "bias_gelu: bias does not match the last dimension");
  auto xc = x.contiguous();
  auto bc = bias.contiguous();
  auto y = torch::empty_like(xc);
  long long n = xc.numel();
  if (n == 0) return y;
  bias_gelu_kernel<<<(unsigned)((n + 255) / 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      xc.data_ptr<float>(), bc.data_ptr<float>(), y.data_ptr<float>(), n, (int)bc.numel());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}
"""

CPP_SOURCE = "torch::Tensor bias_gelu(torch::Tensor x, torch::Tensor bias);"

_ext = load_inline(name="corpus_bias_gelu", cpp_sources=CPP_SOURCE, cuda_sources=CUDA_SOURCE,
                   functions=["bias_gelu"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features) * 0.1)

    def forward(self, x):
        return _ext.bias_gelu(x, self.bias)
