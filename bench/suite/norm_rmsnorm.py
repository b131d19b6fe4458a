"""RMSNorm written with torch ops: x * rsqrt(mean(x^2, -1) + eps) * weight (pointwise, row mean, pointwise)."""

import torch
import torch.nn as nn

TOKENS, DIM = 8192, 2048


class Model(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, x):
        rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x * rms * self.weight


def get_inputs():
    return [torch.randn(TOKENS, DIM)]


def get_init_inputs():
    return [DIM, 1e-6]
