"""An EfficientNet-like stage: three MBConv blocks (1x1 expand x6, depthwise 5x5, squeeze-excitation gate, 1x1 project, SiLU, residual).
Largest tensor: 616 MB (fp32) expanded activation (384 channels at 56x56); ~140 GFLOP, dominated by memory traffic."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, CHANNELS, SIZE, EXPANSION, SE_RATIO, BLOCKS = 128, 64, 56, 6, 0.25, 3


def _trained_bn(channels: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 2.0)
    return bn


class _MBConvSE(nn.Module):
    def __init__(self, channels: int, expansion: int, se_ratio: float):
        super().__init__()
        hidden, squeezed = channels * expansion, max(1, int(channels * se_ratio))
        self.expand = nn.Conv2d(channels, hidden, 1, bias=False)
        self.bn0 = _trained_bn(hidden)
        self.depthwise = nn.Conv2d(hidden, hidden, 5, padding=2, groups=hidden, bias=False)
        self.bn1 = _trained_bn(hidden)
        self.se_reduce = nn.Conv2d(hidden, squeezed, 1)
        self.se_expand = nn.Conv2d(squeezed, hidden, 1)
        self.project = nn.Conv2d(hidden, channels, 1, bias=False)
        self.bn2 = _trained_bn(channels)

    def forward(self, x):
        h = F.silu(self.bn0(self.expand(x)))
        h = F.silu(self.bn1(self.depthwise(h)))
        s = F.adaptive_avg_pool2d(h, 1)
        h = h * torch.sigmoid(self.se_expand(F.silu(self.se_reduce(s))))
        return x + self.bn2(self.project(h))


class Model(nn.Module):
    def __init__(self, channels: int, expansion: int, se_ratio: float, blocks: int):
        super().__init__()
        self.blocks = nn.Sequential(*[_MBConvSE(channels, expansion, se_ratio) for _ in range(blocks)])

    def forward(self, x):
        return self.blocks(x)


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS, EXPANSION, SE_RATIO, BLOCKS]
