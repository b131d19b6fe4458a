"""Post-norm residual: LayerNorm(x + dropout-free branch) on a 3-D activation, wide rows (4096)."""

import torch
import torch.nn as nn

BATCH, TOKENS, DIM = 4, 1024, 4096


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x, branch):
        return self.norm(x + branch)


def get_inputs():
    return [torch.randn(BATCH, TOKENS, DIM), torch.randn(BATCH, TOKENS, DIM)]


def get_init_inputs():
    return [DIM]
