"""Tall-skinny GEMM: 262144 rows of 1024 features projected to 256 with bias, then sigmoid (memory and compute balanced).
Largest tensor: 1.07 GB (fp32) input; 137 GFLOP."""

import torch
import torch.nn as nn

ROWS, IN_FEATURES, OUT_FEATURES = 262144, 1024, 256


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return torch.sigmoid(self.fc(x))


def get_inputs():
    return [torch.randn(ROWS, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES]
