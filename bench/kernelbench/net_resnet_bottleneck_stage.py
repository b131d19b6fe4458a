"""A ResNet stage of four bottleneck blocks (1x1 reduce, 3x3, 1x1 expand, BN), the first with stride 2 and a projection shortcut.
Largest tensor: 205 MB (fp32) input (256 channels at 56x56); ~132 GFLOP."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, IN_CHANNELS, WIDTH, OUT_CHANNELS, SIZE, BLOCKS = 64, 256, 128, 512, 56, 4


def _trained_bn(channels: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 2.0)
    return bn


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, cout: int, stride: int):
        super().__init__()
        self.reduce = nn.Sequential(nn.Conv2d(cin, width, 1, bias=False), _trained_bn(width), nn.ReLU(inplace=True))
        self.spatial = nn.Sequential(nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False),
                                     _trained_bn(width), nn.ReLU(inplace=True))
        self.expand = nn.Sequential(nn.Conv2d(width, cout, 1, bias=False), _trained_bn(cout))
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), _trained_bn(cout))

    def forward(self, x):
        out = self.expand(self.spatial(self.reduce(x)))
        return F.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class Model(nn.Module):
    def __init__(self, in_channels: int, width: int, out_channels: int, blocks: int):
        super().__init__()
        self.blocks = nn.Sequential(_Bottleneck(in_channels, width, out_channels, 2),
                                    *[_Bottleneck(out_channels, width, out_channels, 1) for _ in range(blocks - 1)])

    def forward(self, x):
        return self.blocks(x)


def get_inputs():
    return [torch.randn(BATCH, IN_CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [IN_CHANNELS, WIDTH, OUT_CHANNELS, BLOCKS]
