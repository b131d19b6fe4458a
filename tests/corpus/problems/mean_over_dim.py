# Mean over the middle dimension of a 3-D tensor (a strided, not a row, reduction).
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.mean(x, dim=self.dim)


batch_size = 32
reduce_size = 512
inner = 1024


def get_inputs():
    return [torch.rand(batch_size, reduce_size, inner)]


def get_init_inputs():
    return [1]
