"""A two-level U-Net: double 3x3 conv + BN + ReLU units, max-pool down, transposed-conv up, skip connections by channel concatenation, 1x1 output conv.
Largest tensor: 268 MB (fp32) concatenated skip at 256x256; ~200 GFLOP."""

import torch
import torch.nn as nn

BATCH, IN_CHANNELS, BASE, SIZE, OUT_CHANNELS = 16, 3, 32, 256, 2


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    layers = []
    for c in (cin, cout):
        bn = nn.BatchNorm2d(cout)
        with torch.no_grad():
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 2.0)
        layers += [nn.Conv2d(c, cout, 3, padding=1, bias=False), bn, nn.ReLU(inplace=True)]
    return nn.Sequential(*layers)


class Model(nn.Module):
    def __init__(self, in_channels: int, base: int, out_channels: int):
        super().__init__()
        self.enc1, self.enc2 = _double_conv(in_channels, base), _double_conv(base, 2 * base)
        self.bottom = _double_conv(2 * base, 4 * base)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * base, 2 * base, 2, stride=2), _double_conv(4 * base, 2 * base)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * base, base, 2, stride=2), _double_conv(2 * base, base)
        self.out = nn.Conv2d(base, out_channels, 1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        s1 = self.enc1(x)
        s2 = self.enc2(self.pool(s1))
        h = self.bottom(self.pool(s2))
        h = self.dec2(torch.cat([self.up2(h), s2], dim=1))
        h = self.dec1(torch.cat([self.up1(h), s1], dim=1))
        return self.out(h)


def get_inputs():
    return [torch.randn(BATCH, IN_CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [IN_CHANNELS, BASE, OUT_CHANNELS]
