"""Strided (downsampling) 3x3 convolution with bias, batch norm and leaky ReLU."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, IN_CHANNELS, OUT_CHANNELS, SIZE = 16, 64, 128, 64


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(out_channels)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.3, 0.3)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        return F.leaky_relu(self.bn(self.conv(x)), 0.2)


def get_inputs():
    return [torch.randn(BATCH, IN_CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [IN_CHANNELS, OUT_CHANNELS]
