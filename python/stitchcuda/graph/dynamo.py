"""`torch.compile(model, backend="stitchcuda")`: the same pipeline on each graph Dynamo hands over.

Registered with Dynamo when this module is imported (stitchcuda imports it) and through the
`torch_dynamo_backends` entry point of an installed package. A graph that cannot be optimized runs as
Dynamo gave it, with one warning in the log saying why, and the reason is kept in `reports`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..log import get_logger
from .optimize import OptimizedModule, optimize
from .report import Report

__all__ = ["backend", "reports", "not_static", "training_ops", "symbolic_sizes", "SymbolicSizes", "DYNAMIC_REACH"]

reports: list[Any] = []  # one Report per graph compiled, most recent last
log = get_logger(__name__)


def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], **options: Any) -> Callable:
    """A Dynamo backend: optimize the graph for its example inputs, else run it unchanged."""
    options.setdefault("measure", False)
    options.setdefault("progress", False)
    why = training_ops(gm)
    if not why and not_static(gm, example_inputs):
        symbolic = symbolic_sizes(gm, example_inputs)
        if isinstance(symbolic, SymbolicSizes):
            return _dynamic_backend(gm, example_inputs, symbolic, options)
        why = symbolic
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


# A graph with symbolic sizes serves this many times the size Dynamo compiled it at (at least DYNAMIC_MIN_MAX):
# a family's members are built for a bounded range; larger sizes run as Dynamo gave the graph.
DYNAMIC_REACH = 4
DYNAMIC_MIN_MAX = 64


@dataclass
class SymbolicSizes:
    """Where a Dynamo graph's symbolic sizes come from: `positions` of the SymInt arguments, each with its
    symbol; `carriers`: symbol -> the (tensor argument index among the tensors, axis) whose extent it is;
    `ranges`: symbol -> (min, max) served."""

    positions: list[tuple[int, Any]]
    carriers: dict[Any, list[tuple[int, int]]]
    ranges: dict[Any, tuple[int, int]]


def symbolic_sizes(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> SymbolicSizes | str:
    """The graph's symbolic sizes, each read from a tensor argument's extent, with the range a family will
    serve; or why not (a symbol no tensor extent carries: a size computed inside the model, a number
    argument)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    positions, carriers, ranges = [], {}, {}
    tensor_index = 0
    for k, (node, value) in enumerate(zip(placeholders, example_inputs)):
        val = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) or isinstance(val, torch.SymInt):
            positions.append((k, (val if isinstance(val, torch.SymInt) else value).node.expr))
            continue
        if isinstance(value, torch.Tensor):
            if isinstance(val, torch.Tensor):
                for axis, extent in enumerate(val.shape):
                    if isinstance(extent, torch.SymInt):
                        carriers.setdefault(extent.node.expr, []).append((tensor_index, axis))
            tensor_index += 1
    for k, symbol in positions:
        if symbol not in carriers:
            return (f"dynamic shapes ({symbol}): Dynamo passes a symbolic size no tensor argument's extent carries, "
                    "so this graph runs as Dynamo gave it; torch.compile(..., dynamic=False) compiles one program per "
                    "shape instead")
        value = example_inputs[k]
        hint = value.node.hint if isinstance(value, torch.SymInt) else int(value)
        lower = 2  # Dynamo specializes sizes 0 and 1 apart: a call of size 1 gets a graph of its own
        ranges[symbol] = (lower, max(DYNAMIC_REACH * int(hint), DYNAMIC_MIN_MAX))
    return SymbolicSizes(positions, carriers, ranges)


class _SizesFromTensors(torch.nn.Module):
    """A Dynamo graph called with its tensors alone: each symbolic size argument is read from the extent
    that carries it."""

    def __init__(self, gm: torch.fx.GraphModule, symbolic: SymbolicSizes, arity: int) -> None:
        super().__init__()
        self.gm, self.arity = gm, arity
        self.sizes = {k: symbolic.carriers[symbol][0] for k, symbol in symbolic.positions}
        self._stitchcuda_name = "dynamo graph"

    def forward(self, *tensors):
        args, given = [], iter(tensors)
        for k in range(self.arity):
            if k in self.sizes:
                i, axis = self.sizes[k]
                args.append(tensors[i].shape[axis])
            else:
                args.append(next(given))
        return self.gm(*args)


def _dynamic_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], symbolic: SymbolicSizes,
                     options: dict[str, Any]) -> Callable:
    """A graph with symbolic sizes: optimize(..., dynamic=) over its tensors, one dim per symbol, served
    within SymbolicSizes.ranges; outside them (or wherever the family cannot serve) the graph runs as
    Dynamo gave it."""
    from torch.export import Dim

    # Aliases without Dynamo's marks (a tensor Dynamo saw vary carries them, and export would make it
    # symbolic everywhere): the static captures of the family's members see plain tensors.
    tensors = [v.detach() if isinstance(v, torch.nn.Parameter) else v.view_as(v)
               for v in example_inputs if isinstance(v, torch.Tensor)]
    wrapper = _SizesFromTensors(gm, symbolic, len(example_inputs))
    dims = {symbol: Dim(f"s_{str(symbol)}", min=lo, max=hi) for symbol, (lo, hi) in symbolic.ranges.items()}
    spec: list[Any] = [None] * len(tensors)
    for symbol, carriers in symbolic.carriers.items():
        if symbol in dims:
            for i, axis in carriers:
                spec[i] = dict(spec[i] or {})
                spec[i][axis] = dims[symbol]
    gm.eval()
    wrapper.eval()
    # Outside Dynamo's frame evaluation (the family's captures, checks and first calls run the wrapper,
    # which Dynamo would otherwise try to compile again from inside this compilation)...
    with torch._guards.tracing(None):  # and outside its tracing context, whose fake mode makes sizes symbolic
        fast: OptimizedModule = torch._dynamo.disable(optimize)(wrapper, tensors, dynamic=spec, **options)
    reports.append(fast.report)
    why = fast.report.reason if fast.report.status != "optimized" else fast.report.dynamic.get("refused", "")
    if why:
        log.warning("torch.compile backend: a graph with symbolic sizes (%s) runs as Dynamo gave it: %s",
                    ", ".join(f"{d['name']} {d['min']}..{d['max']}" for d in fast.report.dynamic.get("dims", [])), why)
        return gm.forward
    sizes = {k for k, _ in symbolic.positions}

    def run(*args):
        out = fast(*(a for k, a in enumerate(args) if k not in sizes))
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
