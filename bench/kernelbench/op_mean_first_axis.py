"""Mean over the leading axis of a tall (2048, 262144) matrix: a column reduction with a 1 MB result.
Largest tensor: 2.1 GB (fp32) input; floor ~2.1 GB read."""

import torch
import torch.nn as nn

ROWS, COLS = 2048, 262144


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x.mean(dim=0)


def get_inputs():
    return [torch.randn(ROWS, COLS)]


def get_init_inputs():
    return []
