"""What optimize() returns and how it is called: OptimizedModule (the stitched program, or the original
model where optimization did not apply) and the helpers that take a call's inputs apart the same way."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ..errors import InvalidArgumentError, StitchError
from ..log import get_logger
from ..program import DTYPES, Program, ProgramModule, dtype_name
from .capture import Graph, under_autocast, warn_other_autocast
from .report import Report

__all__ = ["OptimizedModule", "NoProgramError", "FunctionModule", "KeywordCall", "is_setting", "same_setting",
           "shapes_text", "model_name", "as_module", "refuse_training", "as_args", "as_kwargs", "input_label",
           "positional_call"]

log = get_logger(__name__)


class NoProgramError(StitchError, RuntimeError):
    """An OptimizedModule that runs the original model has no program to save; the message says why."""

    code = "NotFound"


class OptimizedModule(torch.nn.Module):
    """Runs the stitched program (or the original module when optimization did not apply).

    Inference only: the program computes the eval-mode forward (dropout off, batch norm with its running
    statistics) and records no autograd graph. It is called like the original — the same positional and
    keyword inputs — and ``.train(True)`` raises InvalidArgumentError: train ``.original`` and call
    optimize() again. The program is stitched for the input shapes and dtypes optimize() saw; a call with
    others runs ``.original``, logged at WARNING once per shape set (``other_shape_calls`` counts them);
    optimize(..., dynamic=) builds a module that serves a range of sizes (graph/dynamic.py)."""

    def __init__(self, original: torch.nn.Module, program: Program | None, graph: Graph | None, report: Report,
                 graphs: bool = True, runner: ProgramModule | None = None) -> None:
        super().__init__()
        self.training = False
        self.original = original
        self.report = report
        self.program = program
        self._graph = graph
        self._keywords: tuple[str, ...] = ()  # keyword inputs, in the order the program takes them after args
        self._arity = 0  # positional inputs of the call optimize() saw
        self._settings: dict[int, Any] = {}  # inputs without a tensor, fixed (KeywordCall)
        self.other_shape_calls = 0  # calls whose inputs had other shapes or dtypes: the original model ran
        self._warned: set = set()
        if runner is None and program is not None:
            runner = ProgramModule(program, graphs=graphs)
        self._runner = runner

    def train(self, mode: bool = True) -> "OptimizedModule":
        if mode:
            raise InvalidArgumentError(
                "an OptimizedModule is inference-only: its program computes the eval-mode forward and has no "
                "backward. Train the original model (this module's .original), then call stitchcuda.optimize() "
                "on it again in eval mode.")
        return super().train(False)

    def forward(self, *args, **kwargs):
        if self._runner is None:
            return self.original(*args, **kwargs)
        flat, _ = pytree.tree_flatten(positional_call(args, kwargs, self._arity, self._keywords, self._settings))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        wanted = [(tuple(v.shape), v.dtype) for v in self._graph.inputs]
        given = [(tuple(t.shape), t.dtype) for t in tensors]
        if given != wanted:
            # The program is stitched for the shapes optimize() saw: other shapes (a serving loop's last,
            # smaller batch) run on the original model, correct and eager, with one warning per shape set.
            self.other_shape_calls += 1
            key = tuple(given)
            if key not in self._warned:
                self._warned.add(key)
                log.warning("%s: inputs %s differ from the %s this program was stitched for: the original model runs "
                            "for them (optimize() with dynamic= serves a range of sizes; or call optimize() with such "
                            "inputs for a program of their own)", model_name(self.original), shapes_text(given),
                            shapes_text(wanted))
            return under_autocast(self.original, self._graph.autocast)(*args, **kwargs)
        # The graph holds its autocast's casts; the executor's ATen steps run with autocast excluded.
        warn_other_autocast(self._graph, self._warned)
        outs = self._runner.executor.run([t.contiguous() for t in tensors])
        return pytree.tree_unflatten(self._graph.output_leaves(outs), self._graph.out_spec)

    def release(self) -> None:
        """Gives the program's working memory (its arena, static inputs and outputs, captured graph) back
        to PyTorch's allocator until the next call, which allocates it again; the weights stay. optimize()
        calls it before running the original model beside the program, so the two forwards' working sets
        are never held at once."""
        if self._runner is not None:
            self._runner.release()

    def save(self, path: str | os.PathLike) -> None:
        """Writes the stitched program as a `.stitch` artifact (CUBINs included) for C++ servers."""
        if self.program is None:
            raise NoProgramError(f"nothing to save: optimize() kept the original model, which runs eagerly "
                                 f"({self.report.reason}); save() writes a stitched program, so save the "
                                 "result of an optimize() whose report.status is 'optimized'")
        self.program.save(path)


class FunctionModule(torch.nn.Module):
    """A plain function as a module, so that it is captured like one. A bound method of a module keeps
    that module as a child: its weights are the program's weights and its mode is checked."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.training = False  # a function has no mode of its own
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            self.owner = owner
        self.fn = fn
        self._stitchcuda_name = getattr(fn, "__qualname__", None) or type(fn).__name__

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class KeywordCall(torch.nn.Module):
    """`module(*args, **kwargs)` taking the keyword inputs' values after the positional ones, in `names`
    order: capture, verification and timing pass positional inputs only. `settings` (position in that
    order -> value) are the inputs without a tensor (a flag such as use_cache=False, None, a number),
    fixed at the values optimize() saw: the call's inputs leave them out."""

    def __init__(self, module: torch.nn.Module, arity: int, names: tuple[str, ...],
                 settings: dict[int, Any] | None = None) -> None:
        super().__init__()
        self.training = False
        self.module, self.arity, self.names = module, arity, names
        self.settings = dict(settings or {})
        self._stitchcuda_name = model_name(module)

    def forward(self, *inputs):
        given = iter(inputs)
        full = [self.settings[i] if i in self.settings else next(given)
                for i in range(len(inputs) + len(self.settings))]
        return self.module(*full[:self.arity], **dict(zip(self.names, full[self.arity:])))


def is_setting(value: Any) -> bool:
    """An input that holds no tensor (a flag, a number, a string, None): the program is specialized to it."""
    return not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value))


def same_setting(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value whose == is not a truth value
        return a is b


def shapes_text(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> str:
    """[f32[8, 16], i64[8]]: input shapes and dtypes as the program's messages write them."""
    return "[" + ", ".join(f"{dtype_name(d) if d in DTYPES.values() else d}{list(s)}" for s, d in specs) + "]"


def model_name(model: torch.nn.Module) -> str:
    return getattr(model, "_stitchcuda_name", None) or type(model).__name__


def as_module(model: Any) -> torch.nn.Module:
    if isinstance(model, torch.nn.Module):
        return model
    if callable(model):
        return FunctionModule(model)
    raise InvalidArgumentError(f"optimize() takes an nn.Module or a function of tensors, not a {type(model).__name__}")


def refuse_training(model: torch.nn.Module) -> None:
    """InvalidArgumentError when the module or any submodule is in training mode (optimize() no longer
    switches it to eval mode behind the caller's back)."""
    training = [name for name, m in model.named_modules() if m.training]
    if training:
        who = "the model is" if training[0] == "" else f"its submodule '{training[0]}' is"
        raise InvalidArgumentError(
            f"{who} in training mode: call model.eval() first. optimize() builds an inference program (dropout "
            "off, batch norm with its running statistics, no backward), which a training-mode forward does not "
            "compute.")


def as_args(args: Any) -> tuple:
    """The positional inputs as a tuple: from a tuple, a list, one tensor, or None (no positional input)."""
    if args is None:
        return ()
    if isinstance(args, torch.Tensor):
        return (args,)
    if isinstance(args, (tuple, list)):
        return tuple(args)
    hint = ": keyword inputs go in kwargs=" if isinstance(args, dict) else ""
    raise InvalidArgumentError(f"args must be the model's positional inputs as a tuple or a list, or one tensor; "
                               f"got a {type(args).__name__}{hint}")


def as_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidArgumentError(f"kwargs must be a dict of the model's keyword inputs by name; got a "
                                   f"{type(kwargs).__name__}")
    return dict(kwargs)


def input_label(i: int, arity: int, keywords: tuple[str, ...]) -> str:
    """How an input at position `i` of the program's order is named: "mask=" or "positional input 2: "."""
    return f"{keywords[i - arity]}=" if i >= arity else f"positional input {i}: "


def positional_call(args: tuple, kwargs: dict[str, Any], arity: int, keywords: tuple[str, ...],
                     settings: dict[int, Any] | None = None) -> tuple:
    """A call's inputs in the order the program takes them: the positional ones, then the keyword inputs
    optimize() saw, in its order (any of them may come positionally, as Python allows). `settings`: the
    inputs without a tensor optimize() saw, by position in that order; a call may leave a keyword one out
    (its value then is the one optimize() saw) and must not give another value."""
    settings = settings or {}
    optional = {keywords[i - arity] for i in settings if i >= arity}
    rest = keywords[max(len(args) - arity, 0):]
    if not kwargs and not rest and not settings:
        return args
    missing = [k for k in rest if k not in kwargs and k not in optional]
    unknown = sorted(set(kwargs) - set(rest))
    if missing or unknown:
        raise InvalidArgumentError(
            f"this program takes {arity} positional input(s) and the keyword input(s) {list(keywords)} as optimize() "
            f"saw them; this call " + (f"lacks {missing}" if missing else "") + (" and " if missing and unknown else "")
            + (f"gives {unknown}, which optimize() did not see" if unknown else "")
            + ": call optimize() again with the inputs this call uses")
    ordered = args + tuple(kwargs[k] if k in kwargs else settings[arity + keywords.index(k)] for k in rest)
    for i, value in settings.items():
        if i < len(ordered) and not same_setting(ordered[i], value):
            raise InvalidArgumentError(
                f"{input_label(i, arity, keywords)}{ordered[i]!r} differs from the {value!r} optimize() saw: the program is specialized to "
                "the inputs without a tensor it was optimized with; call optimize() again with this value")
    return ordered
