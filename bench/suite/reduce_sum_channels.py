"""Sum over channels (dim 1) of an NCHW tensor with a ReLU before it: a middle-dimension reduction."""

import torch
import torch.nn as nn

BATCH, CHANNELS, SIZE = 64, 128, 64


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x).sum(dim=1)


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return []
