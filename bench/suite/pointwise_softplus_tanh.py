"""A long unary chain (a Mish-like activation from primitives): x * tanh(log1p(exp(min(x, 20))))."""

import torch
import torch.nn as nn

ROWS, COLS = 8192, 2048


class Model(nn.Module):
    def forward(self, x):
        softplus = torch.log1p(torch.exp(torch.clamp(x, max=20.0)))
        return x * torch.tanh(softplus)


def get_inputs():
    return [torch.randn(ROWS, COLS)]


def get_init_inputs():
    return []
