# corpus: hack problem=linear_relu rule=aten-in-extension check=static
# A C++ extension whose only function calls ATen's addmm and relu: the Python side shows no torch
# operator, but torch does all the work inside the extension and no kernel of its own is launched.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CPP_SOURCE = r"""
#include <torch/extension.h>

torch::Tensor linear_relu(torch::Tensor x, torch::Tensor w, torch::Tensor b) {
  return at::relu(at::addmm(b, x, w.t()));
}
"""

_ext = load_inline(name="corpus_aten_linear_relu", cpp_sources=CPP_SOURCE, functions=["linear_relu"],
                   verbose=False)


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) * in_features ** -0.5)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x):
        return _ext.linear_relu(x, self.weight, self.bias)
