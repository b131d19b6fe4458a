"""Causal attention written out: scores masked above the diagonal with masked_fill(-inf), softmax, then V."""

import torch
import torch.nn as nn

BATCH, HEADS, SEQ, HEAD_DIM = 4, 8, 1024, 64


class Model(nn.Module):
    def __init__(self, seq: int, head_dim: int):
        super().__init__()
        self.scale = head_dim ** -0.5
        self.register_buffer("future", torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1))

    def forward(self, q, k, v):
        scores = (q @ k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(self.future, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


def get_inputs():
    return [torch.randn(BATCH, HEADS, SEQ, HEAD_DIM) for _ in range(3)]


def get_init_inputs():
    return [SEQ, HEAD_DIM]
