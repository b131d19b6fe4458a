"""A 4-layer MLP classifier head: Linear+ReLU, Linear+GELU(tanh), Linear+SiLU, Linear, log-softmax."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, IN_FEATURES, HIDDEN, CLASSES = 1024, 1024, 2048, 1000


class Model(nn.Module):
    def __init__(self, in_features: int, hidden: int, classes: int):
        super().__init__()
        self.l1, self.l2 = nn.Linear(in_features, hidden), nn.Linear(hidden, hidden)
        self.l3, self.l4 = nn.Linear(hidden, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        x = F.relu(self.l1(x))
        x = F.gelu(self.l2(x), approximate="tanh")
        x = F.silu(self.l3(x))
        return torch.log_softmax(self.l4(x), dim=-1)


def get_inputs():
    return [torch.randn(BATCH, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, HIDDEN, CLASSES]
