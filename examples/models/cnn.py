"""A small CNN in the KernelBench problem format: two conv + batch-norm + ReLU stages, global average
pooling, a linear classifier and log-softmax. `make run` optimizes it after the transformer block."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, CHANNELS, SIZE, CLASSES = 8, 3, 32, 10


class Model(nn.Module):
    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(channels, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        return torch.log_softmax(self.fc(x.mean(dim=(2, 3))), dim=-1)


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS, CLASSES]
