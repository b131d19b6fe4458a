"""Batched matmul of queries by transposed keys, scaled by 1/sqrt(d), then softmax over the keys (attention weights).
Largest tensor: 1.07 GB (fp32) output (64 x 2048 x 2048); 69 GFLOP."""

import torch
import torch.nn as nn

BATCH, SEQ, DIM = 64, 2048, 128


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = dim ** -0.5

    def forward(self, q, k):
        return torch.softmax(torch.bmm(q, k.transpose(1, 2)) * self.scale, dim=-1)


def get_inputs():
    return [torch.randn(BATCH, SEQ, DIM), torch.randn(BATCH, SEQ, DIM)]


def get_init_inputs():
    return [DIM]
