"""The load test's model (scripts/server-load), in the KernelBench problem format (Model, get_inputs,
get_init_inputs): four pre-norm MLP blocks of a transformer's width and a final LayerNorm,
x f32[batch, 1024] -> f32[batch, 1024]. Its rows are independent, so a batch pads."""

import torch
import torch.nn as nn

BATCH, DIM, HIDDEN, BLOCKS = 32, 1024, 4096, 4


class Model(nn.Module):
    def __init__(self, dim: int, hidden: int, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return [DIM, HIDDEN, BLOCKS]
