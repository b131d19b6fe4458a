# corpus: honest problem=scaled_residual_add
# The same elementwise op as a torch C++/CUDA extension (load_inline), launched on PyTorch's
# current stream.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void scaled_add_kernel(const float* x, const float* r, float* y, float alpha, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    y[i] = x[i] + alpha * r[i];
}

torch::Tensor scaled_add(torch::Tensor x, torch::Tensor r, double alpha) {
  TORCH_CHECK(x.is_cuda() && r.is_cuda(), "scaled_add: CUDA tensors expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && r.scalar_type() == torch::kFloat, "scaled_add: float32 expected");
  TORCH_CHECK(x.sizes() == r.sizes(), "scaled_add: shapes differ");
  auto xc = x.contiguous();
  auto rc = r.contiguous();
  auto y = torch::empty_like(xc);
  long long n = xc.numel();
  if (n == 0) return y;
  long long blocks = (n + 255) / 256;
  if (blocks > 8192) blocks = 8192;
  scaled_add_kernel<<<(unsigned)blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      xc.data_ptr<float>(), rc.data_ptr<float>(), y.data_ptr<float>(), (float)alpha, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}
"""

CPP_SOURCE = "torch::Tensor scaled_add(torch::Tensor x, torch::Tensor r, double alpha);"

_ext = load_inline(name="corpus_scaled_add", cpp_sources=CPP_SOURCE, cuda_sources=CUDA_SOURCE,
                   functions=["scaled_add"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, x, residual):
        return _ext.scaled_add(x, residual, float(self.alpha))
