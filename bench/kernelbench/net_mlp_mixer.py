"""An MLP-Mixer-like classifier: patch-embedding conv, two mixer blocks (token-mixing MLP over the transposed sequence, channel-mixing MLP), pooled head.
Largest tensor: 154 MB (fp32) channel-MLP hidden activation; ~280 GFLOP."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, IMAGE, PATCH, DIM, TOKEN_HIDDEN, CHANNEL_HIDDEN, DEPTH, NUM_CLASSES = 64, 224, 16, 768, 384, 3072, 2, 1000


class _MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_fc1, self.token_fc2 = nn.Linear(tokens, token_hidden), nn.Linear(token_hidden, tokens)
        self.channel_fc1, self.channel_fc2 = nn.Linear(dim, channel_hidden), nn.Linear(channel_hidden, dim)

    def forward(self, x):
        y = self.norm1(x).transpose(1, 2)  # (batch, dim, tokens): mix along the tokens
        x = x + self.token_fc2(F.gelu(self.token_fc1(y))).transpose(1, 2)
        return x + self.channel_fc2(F.gelu(self.channel_fc1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, image: int, patch: int, dim: int, token_hidden: int, channel_hidden: int, depth: int,
                 num_classes: int):
        super().__init__()
        tokens = (image // patch) ** 2
        self.stem = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*[_MixerBlock(tokens, dim, token_hidden, channel_hidden) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images):
        x = self.stem(images).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


def get_inputs():
    return [torch.randn(BATCH, 3, IMAGE, IMAGE)]


def get_init_inputs():
    return [IMAGE, PATCH, DIM, TOKEN_HIDDEN, CHANNEL_HIDDEN, DEPTH, NUM_CLASSES]
