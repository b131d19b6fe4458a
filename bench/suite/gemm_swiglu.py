"""SwiGLU feed-forward: silu(x W_gate) * (x W_up), then the down projection (three GEMMs, a gated product)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS, DIM, HIDDEN = 2048, 1024, 2816


class Model(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def get_inputs():
    return [torch.randn(TOKENS, DIM)]


def get_init_inputs():
    return [DIM, HIDDEN]
