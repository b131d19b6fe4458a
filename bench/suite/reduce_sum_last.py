"""Sum over the last dimension of a 3-D tensor after a square: per-row energy of [B, T, D]."""

import torch
import torch.nn as nn

BATCH, TOKENS, DIM = 32, 1024, 512


class Model(nn.Module):
    def forward(self, x):
        return torch.sum(x * x, dim=-1)


def get_inputs():
    return [torch.randn(BATCH, TOKENS, DIM)]


def get_init_inputs():
    return []
