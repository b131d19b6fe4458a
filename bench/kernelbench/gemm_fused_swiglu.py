"""SwiGLU with a fused gate/up projection: one Linear(4096 -> 2 x 10240), chunk, silu(gate) * up.
Largest tensor: 336 MB (fp32) projection output; 687 GFLOP."""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS, DIM, HIDDEN = 4096, 4096, 10240


class Model(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_gate_up = nn.Linear(dim, 2 * hidden, bias=False)

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return F.silu(gate) * up


def get_inputs():
    return [torch.randn(TOKENS, DIM)]


def get_init_inputs():
    return [DIM, HIDDEN]
