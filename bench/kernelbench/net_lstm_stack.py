"""A six-layer nn.LSTM (input 256, hidden 512) over 512 steps, then a per-step linear projection to 128 features.
Largest tensor: 50 MB (fp32) per-layer output sequence; ~600 GFLOP in 3072 dependent steps (latency-bound in eager)."""

import torch
import torch.nn as nn

BATCH, SEQ, INPUT, HIDDEN, LAYERS, OUT = 48, 512, 256, 512, 6, 128


class Model(nn.Module):
    def __init__(self, input_size: int, hidden: int, layers: int, out_features: int):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, out_features)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out)


def get_inputs():
    return [torch.randn(BATCH, SEQ, INPUT)]


def get_init_inputs():
    return [INPUT, HIDDEN, LAYERS, OUT]
