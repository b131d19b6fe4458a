"""A MobileNetV2-like classifier: strided stem, twelve inverted-residual blocks (1x1 expand, depthwise 3x3, 1x1 project, ReLU6), 1x1 head conv, pooled linear classifier.
Largest tensor: 411 MB (fp32) expanded activation at 112x112; ~50 GFLOP, dominated by memory traffic."""

import torch
import torch.nn as nn

BATCH, IMAGE, NUM_CLASSES = 128, 224, 1000
# (expansion, output channels, repeats, first stride)
BLOCKS = ((1, 16, 1, 1), (4, 24, 2, 2), (6, 40, 2, 2), (6, 80, 3, 2), (6, 112, 2, 1), (6, 192, 2, 2))


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    bn = nn.BatchNorm2d(cout)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 2.0)
    layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), bn]
    if act:
        layers.append(nn.ReLU6(inplace=True))
    return nn.Sequential(*layers)


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expansion: int):
        super().__init__()
        hidden = cin * expansion
        layers = [] if expansion == 1 else [_conv_bn(cin, hidden, 1)]
        layers += [_conv_bn(hidden, hidden, 3, stride, groups=hidden), _conv_bn(hidden, cout, 1, act=False)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class Model(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        layers, channels = [_conv_bn(3, 32, 3, 2)], 32
        for expansion, cout, repeats, stride in BLOCKS:
            for i in range(repeats):
                layers.append(_InvertedResidual(channels, cout, stride if i == 0 else 1, expansion))
                channels = cout
        layers.append(_conv_bn(channels, 1024, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1024, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x).mean(dim=(2, 3)))


def get_inputs():
    return [torch.randn(BATCH, 3, IMAGE, IMAGE)]


def get_init_inputs():
    return [NUM_CLASSES]
