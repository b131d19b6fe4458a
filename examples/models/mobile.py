"""A MobileNet-style inverted residual block in the KernelBench problem format: a 1x1 expansion, a
depthwise 3x3 convolution (one filter per channel), a 1x1 projection, batch norms, ReLU6 and the residual
add. The depthwise convolution and its batch norm + ReLU6 are one template kernel; `make run` shows it."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, CHANNELS, SIZE, EXPAND = 8, 32, 28, 4


class Model(nn.Module):
    def __init__(self, channels: int, expand: int):
        super().__init__()
        hidden = channels * expand
        self.expand, self.bn1 = nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden)
        self.depthwise = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False)
        self.bn2 = nn.BatchNorm2d(hidden)
        self.project, self.bn3 = nn.Conv2d(hidden, channels, 1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x):
        h = F.relu6(self.bn1(self.expand(x)))
        h = F.relu6(self.bn2(self.depthwise(h)))
        return x + self.bn3(self.project(h))


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS, EXPAND]
