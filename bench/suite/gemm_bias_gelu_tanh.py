"""Linear layer with bias and tanh-approximated GELU on a 3-D input (batch x tokens x features)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, TOKENS, IN_FEATURES, OUT_FEATURES = 8, 256, 1024, 3072


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return F.gelu(self.fc(x), approximate="tanh")


def get_inputs():
    return [torch.randn(BATCH, TOKENS, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES]
