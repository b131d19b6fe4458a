"""A ResNet bottleneck block: 1x1 reduce, 3x3, 1x1 expand (each conv+BN), identity shortcut, ReLU."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, CHANNELS, SIZE, WIDTH = 16, 256, 28, 64


def _bn(channels: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 1.5)
    return bn


class Model(nn.Module):
    def __init__(self, channels: int, width: int):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(channels, width, 1, bias=False), _bn(width)
        self.c2, self.b2 = nn.Conv2d(width, width, 3, padding=1, bias=False), _bn(width)
        self.c3, self.b3 = nn.Conv2d(width, channels, 1, bias=False), _bn(channels)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        return F.relu(self.b3(self.c3(y)) + x)


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS, WIDTH]
