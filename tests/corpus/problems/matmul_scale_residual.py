# Matrix multiply with a fused epilogue: relu(a @ b * scale + c).
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, a, b, c):
        return torch.relu(torch.matmul(a, b) * self.scale + c)


m = 512
k = 1024
n = 1024
scale = 0.125


def get_inputs():
    return [torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)]


def get_init_inputs():
    return [scale]
