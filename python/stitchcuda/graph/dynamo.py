"""`torch.compile(model, backend="stitchcuda")`: the same pipeline on each graph Dynamo hands over.

Registered with Dynamo when this module is imported (stitchcuda imports it) and through the
`torch_dynamo_backends` entry point of an installed package. A graph that cannot be optimized runs as
Dynamo gave it, with one warning in the log saying why, and the reason is kept in `reports`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ..log import get_logger
from .optimize import OptimizedModule, optimize
from .report import Report

__all__ = ["backend", "reports", "not_static", "training_ops"]

reports: list[Any] = []  # one Report per graph compiled, most recent last
log = get_logger(__name__)


def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], **options: Any) -> Callable:
    """A Dynamo backend: optimize the graph for its example inputs, else run it unchanged."""
    options.setdefault("measure", False)
    options.setdefault("progress", False)
    why = not_static(gm, example_inputs) or training_ops(gm)
    if why:  # refused before capture: a graph StitchCUDA cannot stitch, said in one line
        reports.append(Report(reason=why))
        log.warning("torch.compile backend: %s", why)
        return gm.forward
    # Dynamo's graph modules are in training mode whatever the user's model is in: that model's mode is
    # already in the traced ops (training_ops refused a training-mode dropout or batch norm above).
    gm.eval()
    fast: OptimizedModule = optimize(gm, example_inputs, **options)  # logs its own fallback, with the reason
    reports.append(fast.report)
    if fast.report.status != "optimized":
        return gm.forward

    def run(*args):
        out = fast(*args)
        return out if isinstance(out, (tuple, list)) else (out,)

    return run


def not_static(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    """Why the graph has no static shapes ("" when it has): Dynamo marks a dimension dynamic after a call
    with another size (a second batch size) and hands over a graph taking symbolic sizes (s77), which a
    stitched program, built for fixed shapes, cannot take."""
    symbols = [str(e) for e in example_inputs if isinstance(e, torch.SymInt)]
    symbols += [n.name for n in gm.graph.nodes
                if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.SymInt)]
    if not symbols:
        return ""
    return (f"dynamic shapes ({', '.join(sorted(set(symbols)))}): Dynamo made a size symbolic after a call with other "
            "shapes, and a stitched program is built for fixed shapes, so this graph runs as Dynamo gave it; "
            "torch.compile(..., dynamic=False) compiles one program per shape instead")


# Functions whose `training` argument, when true, computes a training-mode forward (a random dropout mask,
# batch statistics), which the inference program does not compute.
_MODE_FUNCTIONS = tuple(getattr(torch.nn.functional, name) for name in (
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "batch_norm"))


def training_ops(gm: torch.fx.GraphModule) -> str:
    """Why the graph computes a training-mode forward ("" when it does not): a dropout or batch norm
    traced with training=True, as optimize() refuses a module in training mode."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in _MODE_FUNCTIONS:
            continue
        try:
            bound = inspect.signature(n.target).bind(*n.args, **n.kwargs)
        except TypeError:  # not a call this signature takes: nothing to say about it
            continue
        bound.apply_defaults()  # F.dropout trains unless told otherwise
        if bound.arguments.get("training") is True and bound.arguments.get("p", 1) != 0:
            return (f"the model is in training mode ({n.target.__name__} traced with training=True): call "
                    "model.eval() first. StitchCUDA builds an inference program (dropout off, batch norm with its "
                    "running statistics, no backward), which a training-mode forward does not compute; this graph "
                    "runs as Dynamo gave it")
    return ""


def register() -> None:
    """Makes backend="stitchcuda" known to torch.compile (idempotent)."""
    try:
        from torch._dynamo.backends.registry import _BACKENDS, register_backend
    except ImportError:  # a torch without Dynamo: torch.compile is unavailable anyway
        return
    if "stitchcuda" not in _BACKENDS:
        register_backend(name="stitchcuda")(backend)
