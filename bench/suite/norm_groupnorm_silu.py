"""GroupNorm (32 groups) followed by SiLU on an NCHW activation, as in diffusion U-Nets."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, CHANNELS, SIZE, GROUPS = 32, 256, 64, 32


class Model(nn.Module):
    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.2, 0.2)

    def forward(self, x):
        return F.silu(self.norm(x))


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS, GROUPS]
