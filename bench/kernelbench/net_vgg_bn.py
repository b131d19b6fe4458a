"""A VGG-style classifier: eight 3x3 conv + batch norm + ReLU layers in five max-pooled stages, global pooling, MLP head.
Largest tensor: 411 MB (fp32) first-stage activation; ~490 GFLOP."""

import torch
import torch.nn as nn

BATCH, IMAGE, NUM_CLASSES = 32, 224, 1000
STAGES = ((64,), (128,), (256, 256), (512, 512), (512, 512))


def _trained_bn(channels: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():  # non-trivial running statistics, as after training
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 2.0)
    return bn


class Model(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        layers, channels = [], 3
        for stage in STAGES:
            for width in stage:
                layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), _trained_bn(width),
                           nn.ReLU(inplace=True)]
                channels = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Linear(channels, 1024), nn.ReLU(inplace=True), nn.Dropout(0.5),
                                  nn.Linear(1024, num_classes))

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


def get_inputs():
    return [torch.randn(BATCH, 3, IMAGE, IMAGE)]


def get_init_inputs():
    return [NUM_CLASSES]
