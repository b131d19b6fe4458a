"""Linear layer with bias and ReLU (the cuBLASLt bias+ReLU epilogue case): [2048, 1024] @ [1024, 4096]."""

import torch
import torch.nn as nn
import torch.nn.functional as F

TOKENS, IN_FEATURES, OUT_FEATURES = 2048, 1024, 4096


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return F.relu(self.fc(x))


def get_inputs():
    return [torch.randn(TOKENS, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES]
