"""Linear layer (2048 -> 8192, bias) whose outputs are averaged per row: a GEMM feeding a reduction.
Largest tensor: 537 MB (fp32) GEMM output (never needed if fused); 550 GFLOP."""

import torch
import torch.nn as nn

TOKENS, IN_FEATURES, OUT_FEATURES = 16384, 2048, 8192


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return self.fc(x).mean(dim=1, keepdim=True)


def get_inputs():
    return [torch.randn(TOKENS, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES]
