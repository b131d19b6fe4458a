"""Causal scaled_dot_product_attention (is_causal=True): batch 32, 16 heads, 1024 tokens, head dim 128.
Largest tensor: 268 MB (fp32) per q/k/v; 137 GFLOP with the causal half skipped."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, HEADS, SEQ, HEAD_DIM = 32, 16, 1024, 128


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def get_inputs():
    return [torch.randn(BATCH, HEADS, SEQ, HEAD_DIM) for _ in range(3)]


def get_init_inputs():
    return []
