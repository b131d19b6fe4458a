"""Linear layer (4096 -> 8192, bias) followed by the tanh approximation of GELU, as in a GPT MLP up-projection.
Largest tensor: 268 MB (fp32) output; 550 GFLOP."""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS, IN_FEATURES, OUT_FEATURES = 8192, 4096, 8192


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return F.gelu(self.fc(x), approximate="tanh")


def get_inputs():
    return [torch.randn(TOKENS, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES]
