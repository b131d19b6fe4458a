"""Linear layer with bias and SiLU: a GEMM whose activation must run as a separate fused kernel."""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS, IN_FEATURES, OUT_FEATURES = 4096, 1024, 2048


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return F.silu(self.fc(x))


def get_inputs():
    return [torch.randn(TOKENS, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES]
