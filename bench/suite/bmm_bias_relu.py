"""Batched matmul of two inputs ([B, M, K] @ [B, K, N]) followed by a broadcast bias and ReLU."""

import torch
import torch.nn as nn

BATCH, M, K, N = 32, 512, 256, 512


class Model(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(n) * 0.1)

    def forward(self, a, b):
        return torch.relu(torch.bmm(a, b) + self.bias)


def get_inputs():
    return [torch.randn(BATCH, M, K), torch.randn(BATCH, K, N)]


def get_init_inputs():
    return [N]
