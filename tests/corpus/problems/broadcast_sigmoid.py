# Elementwise with broadcasting: sigmoid(x * per-channel scale + per-column shift).
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x, scale, shift):
        return torch.sigmoid(x * scale + shift)


batch_size = 16
channels = 64
height = 32
width = 32


def get_inputs():
    return [torch.randn(batch_size, channels, height, width), torch.rand(channels, 1, 1),
            torch.randn(width)]


def get_init_inputs():
    return []
