"""A ConvNeXt-T-like classifier (4 x 4 patchify stem, stages of 3, 3, 9 and 3 blocks of a 7 x 7 depthwise
convolution, channels-last LayerNorm, a 4x GELU MLP and layer scale, downsampling between stages, a
LayerNorm and linear head): widths 96 to 768, 32 images of 224 x 224; output the 1000 logits. About 0.29 TFLOP
per forward."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VARIANTS = ("bf16", "fp16", "autocast-bf16")
BATCH, IMAGE, DIMS, DEPTHS, CLASSES = 32, 224, (96, 192, 384, 768), (3, 3, 9, 3), 1000
SMALL = {"BATCH": 2, "IMAGE": 32, "DIMS": (8, 16, 32, 64), "DEPTHS": (1, 1, 1, 1), "CLASSES": 10}


class _ChannelsFirstNorm(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor, as ConvNeXt's downsampling layers normalize."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(0.1 * torch.rand(dim) + 0.05)

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.fc2(F.gelu(self.fc1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 3, 1, 2)


class Model(nn.Module):
    def __init__(self, dims, depths, classes):
        super().__init__()
        layers = [nn.Conv2d(3, dims[0], 4, stride=4), _ChannelsFirstNorm(dims[0], eps=1e-6)]
        for stage, (dim, depth) in enumerate(zip(dims, depths)):
            if stage:
                layers += [_ChannelsFirstNorm(dims[stage - 1], eps=1e-6), nn.Conv2d(dims[stage - 1], dim, 2, stride=2)]
            layers += [_Block(dim) for _ in range(depth)]
        self.features = nn.Sequential(*layers)
        self.norm, self.head = nn.LayerNorm(dims[-1], eps=1e-6), nn.Linear(dims[-1], classes)

    def forward(self, images):
        return self.head(self.norm(self.features(images).mean((2, 3))))


def get_inputs():
    return [torch.randn(BATCH, 3, IMAGE, IMAGE)]


def get_init_inputs():
    return [DIMS, DEPTHS, CLASSES]
