"""A two-layer bidirectional nn.GRU (input 320, hidden 384) over 640 steps, mean-pooled over time, linear classifier.
Largest tensor: 126 MB (fp32) per-layer output sequence; ~350 GFLOP in 1280 dependent steps per direction (latency-bound in eager)."""

import torch
import torch.nn as nn

BATCH, SEQ, INPUT, HIDDEN, LAYERS, NUM_CLASSES = 64, 640, 320, 384, 2, 40


class Model(nn.Module):
    def __init__(self, input_size: int, hidden: int, layers: int, num_classes: int):
        super().__init__()
        self.gru = nn.GRU(input_size, hidden, layers, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, num_classes)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out.mean(dim=1))


def get_inputs():
    return [torch.randn(BATCH, SEQ, INPUT)]


def get_init_inputs():
    return [INPUT, HIDDEN, LAYERS, NUM_CLASSES]
