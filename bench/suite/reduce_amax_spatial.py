"""Global max pooling as a reduction: amax over H and W of an NCHW tensor (the last two dimensions)."""

import torch
import torch.nn as nn

BATCH, CHANNELS, SIZE = 64, 256, 64


class Model(nn.Module):
    def forward(self, x):
        return torch.amax(x, dim=(2, 3))


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return []
