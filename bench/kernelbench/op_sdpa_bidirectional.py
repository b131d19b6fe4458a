"""Non-causal scaled_dot_product_attention: batch 16, 16 heads, 2048 tokens, head dim 128.
Largest tensor: 268 MB (fp32) per q/k/v; 550 GFLOP (scores would be 4.3 GB if materialized)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, HEADS, SEQ, HEAD_DIM = 16, 16, 2048, 128


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def get_inputs():
    return [torch.randn(BATCH, HEADS, SEQ, HEAD_DIM) for _ in range(3)]


def get_init_inputs():
    return []
