"""Row-wise maximum (amax over the last axis) of a (131072, 4096) matrix.
Largest tensor: 2.1 GB (fp32) input; floor ~2.1 GB read."""

import torch
import torch.nn as nn

ROWS, COLS = 131072, 4096


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.amax(x, dim=-1)


def get_inputs():
    return [torch.randn(ROWS, COLS)]


def get_init_inputs():
    return []
