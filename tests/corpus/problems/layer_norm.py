# LayerNorm over the hidden dimension of a (batch, sequence, hidden) activation.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x):
        return self.norm(x)


batch_size = 16
seq_len = 256
hidden = 1024


def get_inputs():
    return [torch.rand(batch_size, seq_len, hidden)]


def get_init_inputs():
    return [hidden]
