"""Pointwise over NCHW with per-channel broadcasting: x * sigmoid(a_c * x) + b_c + residual."""

import torch
import torch.nn as nn

BATCH, CHANNELS, SIZE = 32, 128, 64


class Model(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.rand(channels, 1, 1) + 0.5)
        self.beta = nn.Parameter(torch.randn(channels, 1, 1) * 0.1)

    def forward(self, x, residual):
        return x * torch.sigmoid(self.alpha * x) + self.beta + residual


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE), torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS]
