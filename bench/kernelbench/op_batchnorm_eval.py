"""Inference-mode nn.BatchNorm2d (running statistics, affine) over 128-channel 128x128 feature maps.
Largest tensor: 1.07 GB (fp32) input and output; floor ~2.1 GB moved."""

import torch
import torch.nn as nn

BATCH, CHANNELS, SIZE = 128, 128, 128


class Model(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)
        with torch.no_grad():  # non-trivial running statistics, as after training
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.2, 0.2)

    def forward(self, x):
        return self.bn(x)


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS]
