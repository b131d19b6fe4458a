"""Matmul with bias (8192 -> 4096), nn.Dropout (identity in eval mode) and a clamp to [-0.5, 0.5].
Largest tensor: 268 MB (fp32) input; 550 GFLOP."""

import torch
import torch.nn as nn

TOKENS, IN_FEATURES, OUT_FEATURES = 8192, 8192, 4096


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int, p: float):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features) * in_features ** -0.5)
        self.bias = nn.Parameter(torch.randn(out_features) * 0.02)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return torch.clamp(self.drop(x @ self.weight + self.bias), -0.5, 0.5)


def get_inputs():
    return [torch.randn(TOKENS, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES, 0.1]
