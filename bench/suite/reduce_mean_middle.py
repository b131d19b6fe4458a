"""Mean over the middle (sequence) dimension of [B, T, D]: mean pooling of token features, not the last dim."""

import torch
import torch.nn as nn

BATCH, TOKENS, DIM = 128, 1024, 512


class Model(nn.Module):
    def forward(self, x):
        return x.mean(dim=1)


def get_inputs():
    return [torch.randn(BATCH, TOKENS, DIM)]


def get_init_inputs():
    return []
