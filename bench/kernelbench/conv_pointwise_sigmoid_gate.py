"""Pointwise (1x1) convolution producing a sigmoid gate that multiplies the input: x * sigmoid(conv1x1(x)).
Largest tensor: 205 MB (fp32); 26 GFLOP."""

import torch
import torch.nn as nn

BATCH, CHANNELS, SIZE = 64, 256, 56


class Model(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.gate = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.gate(x))


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS]
