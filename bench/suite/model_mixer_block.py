"""An MLP-Mixer-style block: token mixing (MLP across patches, via transpose) and channel mixing, pre-norm."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, PATCHES, CHANNELS, TOKEN_HIDDEN, CHANNEL_HIDDEN = 32, 196, 512, 256, 2048


class Model(nn.Module):
    def __init__(self, patches: int, channels: int, token_hidden: int, channel_hidden: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(channels), nn.LayerNorm(channels)
        self.t1, self.t2 = nn.Linear(patches, token_hidden), nn.Linear(token_hidden, patches)
        self.c1, self.c2 = nn.Linear(channels, channel_hidden), nn.Linear(channel_hidden, channels)

    def forward(self, x):
        y = self.ln1(x).transpose(1, 2)                       # [B, C, P]: mix across patches
        x = x + self.t2(F.gelu(self.t1(y))).transpose(1, 2)
        return x + self.c2(F.gelu(self.c1(self.ln2(x))))


def get_inputs():
    return [torch.randn(BATCH, PATCHES, CHANNELS)]


def get_init_inputs():
    return [PATCHES, CHANNELS, TOKEN_HIDDEN, CHANNEL_HIDDEN]
