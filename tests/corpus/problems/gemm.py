# A GEMM with a short reduction dimension (a wide projection): C = A @ B, A (m, k), B (k, n).
# The 256 MB output makes even the memory-bound speed-of-light time (~63 us) far above the cost of a
# Python-level call, so a cached answer shows up as impossibly fast.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return torch.matmul(a, b)


m = 8192
k = 256
n = 8192


def get_inputs():
    return [torch.rand(m, k), torch.rand(k, n)]


def get_init_inputs():
    return []
