"""A ViT-B/16-like image classifier (16 x 16 patch convolution, class token, learned positions, pre-LayerNorm
encoder layers with GELU MLPs, a linear head on the class token): 12 layers x 768, 12 heads, 32 images of
224 x 224; output the 1000 logits. About 1.1 TFLOP per forward."""

import torch
import torch.nn as nn

from _layers import EncoderLayer, init_small

VARIANTS = ("bf16", "fp16", "autocast-bf16")
BATCH, IMAGE, PATCH, LAYERS, DIM, HEADS, CLASSES = 32, 224, 16, 12, 768, 12, 1000
SMALL = {"BATCH": 2, "IMAGE": 32, "LAYERS": 1, "DIM": 64, "HEADS": 4, "CLASSES": 10}


class Model(nn.Module):
    def __init__(self, image, patch, layers, dim, heads, classes):
        super().__init__()
        self.patches = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.positions = nn.Parameter(0.02 * torch.randn(1, (image // patch) ** 2 + 1, dim))
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, 4 * dim, pre_norm=True, eps=1e-6)
                                    for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, classes)
        init_small(self)

    def forward(self, images):
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1) + self.positions
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))


def get_inputs():
    return [torch.randn(BATCH, 3, IMAGE, IMAGE)]


def get_init_inputs():
    return [IMAGE, PATCH, LAYERS, DIM, HEADS, CLASSES]
