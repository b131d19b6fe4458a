"""1x1 convolution producing a gate: x * sigmoid(conv1x1(x)) + per-channel bias (an attention-like gating)."""

import torch
import torch.nn as nn

BATCH, CHANNELS, SIZE = 16, 256, 32


class Model(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.gate = nn.Conv2d(channels, channels, 1)
        self.shift = nn.Parameter(torch.randn(1, channels, 1, 1) * 0.1)

    def forward(self, x):
        return x * torch.sigmoid(self.gate(x)) + self.shift


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS]
