"""A small image classifier: three conv+BN+ReLU stages with max pooling, global average pool, linear head."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, CHANNELS, SIZE, CLASSES = 32, 3, 64, 100


def _stage(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class Model(nn.Module):
    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.s1, self.s2, self.s3 = _stage(channels, 32), _stage(32, 64), _stage(64, 128)
        self.fc = nn.Linear(128, classes)

    def forward(self, x):
        x = F.max_pool2d(self.s1(x), 2)
        x = F.max_pool2d(self.s2(x), 2)
        x = self.s3(x)
        return self.fc(x.mean(dim=(2, 3)))


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS, CLASSES]
