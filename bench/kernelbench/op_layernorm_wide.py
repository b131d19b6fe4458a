"""nn.LayerNorm with affine weights over 8192-wide rows of a 65536-token activation.
Largest tensor: 2.1 GB (fp32); floor ~4.3 GB moved."""

import torch
import torch.nn as nn

TOKENS, DIM = 65536, 8192


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        with torch.no_grad():  # trained-looking affine parameters
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.2, 0.2)

    def forward(self, x):
        return self.norm(x)


def get_inputs():
    return [torch.randn(TOKENS, DIM)]


def get_init_inputs():
    return [DIM]
