"""LayerNorm over the last dimension of a [tokens, 1024] activation (one-pass row statistics)."""

import torch
import torch.nn as nn

TOKENS, DIM = 32768, 1024


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.1, 0.1)

    def forward(self, x):
        return self.norm(x)


def get_inputs():
    return [torch.randn(TOKENS, DIM) * 2.0 + 1.0]


def get_init_inputs():
    return [DIM]
