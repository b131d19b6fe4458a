"""Overlapping 3x3 stride-2 max pooling (padding 1) of 192-channel 112x112 feature maps, as after a ResNet stem.
Largest tensor: 1.23 GB (fp32) input, 308 MB output; floor ~1.5 GB moved."""

import torch
import torch.nn as nn

BATCH, CHANNELS, SIZE = 128, 192, 112


class Model(nn.Module):
    def __init__(self, kernel: int, stride: int, padding: int):
        super().__init__()
        self.pool = nn.MaxPool2d(kernel, stride, padding)

    def forward(self, x):
        return self.pool(x)


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [3, 2, 1]
