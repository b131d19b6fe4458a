"""3x3x3 volumetric convolution (32 -> 64 channels, with bias) followed by GELU, on 32x64x64 volumes.
Largest tensor: 268 MB (fp32) output; 116 GFLOP."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, IN_CHANNELS, OUT_CHANNELS, DEPTH, SIZE = 8, 32, 64, 32, 64


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, 3, padding=1)

    def forward(self, x):
        return F.gelu(self.conv(x))


def get_inputs():
    return [torch.randn(BATCH, IN_CHANNELS, DEPTH, SIZE, SIZE)]


def get_init_inputs():
    return [IN_CHANNELS, OUT_CHANNELS]
