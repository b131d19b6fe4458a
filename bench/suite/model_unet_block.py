"""A small U-Net level: conv+GroupNorm+SiLU encoder, max-pool, bottleneck, nearest upsample, skip concat, decoder."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, CHANNELS, SIZE, WIDTH = 8, 32, 64, 64


class _ConvNormAct(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout)

    def forward(self, x):
        return F.silu(self.norm(self.conv(x)))


class Model(nn.Module):
    def __init__(self, channels: int, width: int):
        super().__init__()
        self.enc = _ConvNormAct(channels, width)
        self.mid = _ConvNormAct(width, 2 * width)
        self.up = nn.Conv2d(2 * width, width, 1)
        self.dec = _ConvNormAct(2 * width, width)
        self.head = nn.Conv2d(width, channels, 1)

    def forward(self, x):
        skip = self.enc(x)
        y = self.mid(F.max_pool2d(skip, 2))
        y = self.up(F.interpolate(y, scale_factor=2.0, mode="nearest"))
        return self.head(self.dec(torch.cat([y, skip], dim=1))) + x


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS, WIDTH]
