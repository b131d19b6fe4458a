"""A ResNet stage of three basic blocks (two 3x3 conv + BN each), the first downsampling 64 -> 128 channels with a 1x1 shortcut.
Largest tensor: 103 MB (fp32) input; ~165 GFLOP."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, IN_CHANNELS, OUT_CHANNELS, SIZE, BLOCKS = 128, 64, 128, 56, 3


def _trained_bn(channels: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 2.0)
    return bn


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _trained_bn(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = _trained_bn(cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), _trained_bn(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, blocks: int):
        super().__init__()
        self.blocks = nn.Sequential(_BasicBlock(in_channels, out_channels, 2),
                                    *[_BasicBlock(out_channels, out_channels, 1) for _ in range(blocks - 1)])

    def forward(self, x):
        return self.blocks(x)


def get_inputs():
    return [torch.randn(BATCH, IN_CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [IN_CHANNELS, OUT_CHANNELS, BLOCKS]
