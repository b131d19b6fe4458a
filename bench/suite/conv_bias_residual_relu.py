"""3x3 convolution with bias, a residual add of the input and ReLU (channels preserved)."""

import torch
import torch.nn as nn

BATCH, CHANNELS, SIZE = 16, 64, 56


class Model(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x) + x)


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS]
