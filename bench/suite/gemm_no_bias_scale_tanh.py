"""Plain matmul against a weight without bias (x @ W), a temperature scale and tanh."""

import torch
import torch.nn as nn

TOKENS, IN_FEATURES, OUT_FEATURES = 2048, 2048, 2048


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int, temperature: float):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features) / in_features ** 0.5)
        self.temperature = temperature

    def forward(self, x):
        return torch.tanh((x @ self.weight) / self.temperature)


def get_inputs():
    return [torch.randn(TOKENS, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES, 2.0]
