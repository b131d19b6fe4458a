"""`stitchcuda bench graph`: optimize(model) end to end on small models, speed-ups against eager PyTorch
and torch.compile (default mode) measured in the same run, plus where the time went (capture, kernel
generation and checks). Floors: each model's bytes and FLOPs are small, so launch overhead dominates
eager PyTorch; the stitched program replays as one CUDA graph, which is where most of its gain comes from.
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Linear-ReLU-Linear-GELU(tanh)-Linear: every activation fits a cuBLASLt epilogue."""

    def __init__(self, d_in: int = 1024, hidden: int = 2048, d_out: int = 1024):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.l3(F.gelu(self.l2(F.relu(self.l1(x))), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: layer norms, attention through matmuls and softmax, exact-GELU MLP."""

    def __init__(self, d=256, heads=8):
        super().__init__()
        self.heads, self.ln1, self.ln2 = heads, nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        return torch.log_softmax(self.fc(x.mean(dim=(2, 3))), dim=-1)


def cases():
    return [("mlp_b64", MLP(), (torch.randn(64, 1024),)), ("transformer_block_b4_s128", Block(), (torch.randn(4, 128, 256),)),
            ("cnn_b8_32x32", CNN(), (torch.randn(8, 3, 32, 32),))]


def run(json_output: bool = False) -> int:
    if not torch.cuda.is_available():
        print("bench graph: no GPU (torch.cuda.is_available() is False); nothing measured")
        return 3
    from ..graph import optimize

    torch.manual_seed(0)
    results = {}
    for name, model, inputs in cases():
        model = model.cuda().eval()
        inputs = tuple(t.cuda() for t in inputs)
        t0 = time.perf_counter()
        fast = optimize(model, inputs, progress=False)
        total = time.perf_counter() - t0
        r = fast.report
        results[name] = {"status": r.status, "reason": r.reason, **{k: round(v, 4) if isinstance(v, float) else v
                                                                    for k, v in r.timing.items()},
                         "groups": {k: sum(g["kind"] == k for g in r.groups) for k in {g["kind"] for g in r.groups}},
                         "fallbacks": len(r.fallbacks), "verified": r.verification.get("passed"),
                         "max_rel_error_fp64": r.verification.get("max_rel_error_fp64"),
                         "optimize_seconds": round(total, 2),
                         "stage_seconds": {k: round(v, 2) for k, v in r.stage_seconds.items()}}
    out = {"device": torch.cuda.get_device_name(), "models": results}
    print(json.dumps(out) if json_output else json.dumps(out, indent=2))
    return 0
