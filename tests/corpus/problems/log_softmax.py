# Log-softmax over dimension 1, as in a classifier head with many classes.
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return F.log_softmax(x, dim=self.dim)


batch_size = 256
num_classes = 8192


def get_inputs():
    return [torch.rand(batch_size, num_classes)]


def get_init_inputs():
    return [1]
