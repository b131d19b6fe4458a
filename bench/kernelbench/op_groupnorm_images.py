"""nn.GroupNorm (32 groups, affine) over a batch of 256-channel 128x128 feature maps.
Largest tensor: 1.07 GB (fp32) input and output; floor ~2.1 GB moved."""

import torch
import torch.nn as nn

BATCH, CHANNELS, SIZE, GROUPS = 64, 256, 128, 32


class Model(nn.Module):
    def __init__(self, groups: int, channels: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.2, 0.2)

    def forward(self, x):
        return self.norm(x)


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [GROUPS, CHANNELS]
