"""`torch.compile(model, backend="stitchcuda")`: the same pipeline on each graph Dynamo hands over.

Registered with Dynamo when this module is imported (stitchcuda imports it) and through the
`torch_dynamo_backends` entry point of an installed package. A graph that cannot be optimized runs as
Dynamo gave it, and the reason is kept in `reports`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .optimize import OptimizedModule, optimize

__all__ = ["backend", "reports"]

reports: list[Any] = []  # one Report per graph compiled, most recent last


def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], **options: Any) -> Callable:
    """A Dynamo backend: optimize the graph for its example inputs, else run it unchanged."""
    options.setdefault("measure", False)
    options.setdefault("progress", False)
    # Dynamo's graph modules are in training mode whatever the user's model is in: that model's mode is
    # already in the traced ops (a dropout traced in eval mode is gone), so the flag says nothing here.
    gm.eval()
    fast: OptimizedModule = optimize(gm, example_inputs, **options)
    reports.append(fast.report)
    if fast.report.status != "optimized":
        return gm.forward

    def run(*args):
        out = fast(*args)
        return out if isinstance(out, (tuple, list)) else (out,)

    return run


def register() -> None:
    """Makes backend="stitchcuda" known to torch.compile (idempotent)."""
    try:
        from torch._dynamo.backends.registry import _BACKENDS, register_backend
    except ImportError:  # a torch without Dynamo: torch.compile is unavailable anyway
        return
    if "stitchcuda" not in _BACKENDS:
        register_backend(name="stitchcuda")(backend)
