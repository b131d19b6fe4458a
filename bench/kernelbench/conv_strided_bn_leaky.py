"""Stride-2 3x3 downsampling convolution (64 -> 128 channels, 224 -> 112), inference batch norm, LeakyReLU(0.1).
Largest tensor: 822 MB (fp32) input; 118 GFLOP."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, IN_CHANNELS, OUT_CHANNELS, SIZE = 64, 64, 128, 224


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, slope: float):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.slope = slope
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        return F.leaky_relu(self.bn(self.conv(x)), self.slope)


def get_inputs():
    return [torch.randn(BATCH, IN_CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [IN_CHANNELS, OUT_CHANNELS, 0.1]
