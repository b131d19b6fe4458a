# Bias add followed by the exact (erf) GELU, as after a projection without bias.
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features) * 0.1)

    def forward(self, x):
        return F.gelu(x + self.bias)


batch_size = 256
features = 4096


def get_inputs():
    return [torch.randn(batch_size, features)]


def get_init_inputs():
    return [features]
