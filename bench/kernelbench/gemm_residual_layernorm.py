"""Post-norm residual: LayerNorm(x + Linear(x)) with a square 4096x4096 projection, as in a BERT output layer.
Largest tensor: 134 MB (fp32); 275 GFLOP."""

import torch
import torch.nn as nn

TOKENS, DIM = 8192, 4096


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(x + self.proj(x))


def get_inputs():
    return [torch.randn(TOKENS, DIM)]


def get_init_inputs():
    return [DIM]
