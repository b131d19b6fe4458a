"""A DenseNet-like dense block (eight BN-ReLU-1x1 conv-BN-ReLU-3x3 conv layers, each concatenated onto the running feature map) and a pooling transition.
Largest tensor: 308 MB (fp32) final concatenation (384 channels at 56x56); ~250 GFLOP."""

import torch
import torch.nn as nn

BATCH, IN_CHANNELS, GROWTH, LAYERS, BOTTLENECK, SIZE = 64, 128, 32, 8, 4, 56


def _trained_bn(channels: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 2.0)
    return bn


class _DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int, bottleneck: int):
        super().__init__()
        self.body = nn.Sequential(
            _trained_bn(cin), nn.ReLU(inplace=True), nn.Conv2d(cin, bottleneck * growth, 1, bias=False),
            _trained_bn(bottleneck * growth), nn.ReLU(inplace=True),
            nn.Conv2d(bottleneck * growth, growth, 3, padding=1, bias=False))

    def forward(self, features):
        return self.body(torch.cat(features, dim=1))


class Model(nn.Module):
    def __init__(self, in_channels: int, growth: int, layers: int, bottleneck: int):
        super().__init__()
        self.layers = nn.ModuleList(_DenseLayer(in_channels + i * growth, growth, bottleneck) for i in range(layers))
        out = in_channels + layers * growth
        self.transition = nn.Sequential(_trained_bn(out), nn.ReLU(inplace=True),
                                        nn.Conv2d(out, out // 2, 1, bias=False), nn.AvgPool2d(2))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return self.transition(torch.cat(features, dim=1))


def get_inputs():
    return [torch.randn(BATCH, IN_CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [IN_CHANNELS, GROWTH, LAYERS, BOTTLENECK]
