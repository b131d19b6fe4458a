"""`stitchcuda.optimize(model, args, kwargs)`: capture, plan, generate, verify, and return a module that
runs the stitched program — or the original model with the reason, whenever any stage cannot proceed.

optimize() turns its arguments into OptimizeOptions and the call's inputs into positional tensors, then
runs graph mode's stages (graph/pipeline.py)."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from .checks import PRECISION_TITLES, check_wants
from .dynamic import optimize_dynamic, parameter_names
from .module import (KeywordCall, OptimizedModule, as_args, as_kwargs, as_module, input_label, is_setting,
                     refuse_training)
from .options import BUDGET_S, OptimizeOptions
from .pipeline import run_pipeline
from .repair import TRACE_ROUNDS, TRACE_WINDOWS, trace_mismatch
from .report import Report

__all__ = ["optimize", "OptimizedModule", "OptimizeOptions", "Report", "BUDGET_S", "trace_mismatch", "check_wants",
           "PRECISION_TITLES", "TRACE_ROUNDS", "TRACE_WINDOWS"]


def optimize(model: torch.nn.Module | Callable[..., Any], args: Any = None, kwargs: dict[str, Any] | None = None, *,
             llm: Any = None, precision: str = "fp32", graphs: bool = True, verify_sets: int = 3, measure: bool = True,
             compare_compile: bool = True, progress: bool | None = None, isolated: bool = True,
             run_dir: str | os.PathLike | None = None, resume: str | os.PathLike | None = None, attempts: int = 3,
             tokens: int = 0, wall_s: float = 0.0, max_targets: int = 4, concurrency: int = 4, on_event: Any = None,
             budget_s: float = BUDGET_S, keep_slower: bool = False, split_tf32: bool = True,
             dynamic: Any = None) -> OptimizedModule:
    """Optimizes `model` for inference on inputs shaped like `args` and `kwargs` (on a CUDA device).

    `model`: an nn.Module in eval mode, or a plain function of tensors (a bound method of a module brings
    the module's weights along). A module with any submodule in training mode is refused with
    InvalidArgumentError: call model.eval() first (the program is the inference forward: dropout off,
    batch norm with its running statistics). `args`: the positional inputs, as a tuple or a list, or one
    tensor (a forward that takes one list argument: pass ``(xs,)``); `kwargs`: the keyword inputs, a dict.
    The result is called the same way: ``fast(*args, **kwargs)``. Inputs that hold no tensor (a flag such
    as ``use_cache=False``, None, a number) are fixed at the values given: the program is specialized to
    them, a call may leave such a keyword input out, and another value raises InvalidArgumentError.

    The program reads the model's parameters in place where it uses them as they are (no second copy of
    the weights); constants computed from weights are its own. Optimize again after changing the weights.

    Returns an OptimizedModule (inference only) whose `.report` says what was done and why; when a stage
    cannot proceed (capture, lowering, verification, no GPU) the module runs the original model and the
    report says why. Without a GPU the model is still captured and planned (and compiled where every
    value fits a program buffer), so the report shows what would run. An operator the program cannot
    hold (a complex tensor from torch.fft) does not stop the plan: it is an ATen group with the reason.
    `isolated`: each generated group is checked against its ATen subgraph in the Verifier's isolated
    worker process (a fault or hang in generated code becomes a fallback reason); False checks them in
    this process, which saves the worker's start-up.

    With `llm` (a spec such as ``openai:gpt-4.1``, a stitchcuda.llm.Backend or a callable), the agents
    join in after the offline plan: each group is profiled, the Planner picks targets (at most
    `max_targets`), the Coder writes a kernel step for each (`attempts` per target, `tokens` and `wall_s`
    for the whole model; `concurrency` targets' model calls at once), the Verifier judges it and the
    template path alike, and the faster verified one enters the program. The run is recorded in
    `run_dir` (default runs/<UTC time>-<model>); `resume` continues a killed run. Without `llm` nothing
    of this runs.

    Failing small and never slower: a group that cannot be built or checked runs on ATen alone; a whole
    program that does not match the model is traced to the group that causes it (each group's output
    against ATen's on the failing input set), that group runs on ATen and the rest stays generated. Groups
    still unchecked when `budget_s` seconds of generating and checking have passed stay on ATen (0: no
    limit). The program is kept only when the Verifier's timer finds it faster than the eager model on
    the example inputs (`keep_slower=True` keeps it regardless); otherwise the model runs eagerly and the
    report gives both times.

    `dynamic`: the input dims that may vary, and their ranges — "auto" (the batch, axis 0, over 1..2x the
    example's) or torch.export's dynamic_shapes form ({"x": {0: torch.export.Dim("batch", min=1, max=64)}}).
    The result then serves every size in range: a program per member size, built by this pipeline on
    first use, zero-padded to the next member along dims whose rows are independent (graph/dynamic.py);
    optimize() verifies it at the range's ends, a prime and the example before returning.

    `split_tf32`: at precision="fp32", a GEMM bound by fp32 arithmetic may run as three TF32 tensor-core
    products on operands split into a TF32 part and its remainder (tf32x3: fp32's accuracy, held to fp32's
    tolerance by every check) where the GPU's peaks say it is faster; False keeps cuBLAS's SGEMM for all.
    """
    original = as_module(model)
    refuse_training(original)
    positional = as_args(args)
    keywords = as_kwargs(kwargs)
    every = positional + tuple(keywords.values())
    settings = {i: v for i, v in enumerate(every) if is_setting(v)}
    traced = original
    if keywords or settings:
        # The pipeline sees positional tensor inputs only: keyword inputs follow args, in this order, and
        # inputs without a tensor are fixed in the traced call.
        traced = KeywordCall(original, len(positional), tuple(keywords), settings)
    tensors = tuple(v for i, v in enumerate(every) if i not in settings)
    options = OptimizeOptions(llm=llm, precision=precision, graphs=graphs, verify_sets=verify_sets, measure=measure,
                              compare_compile=compare_compile, progress=progress, isolated=isolated, run_dir=run_dir,
                              resume=resume, attempts=attempts, tokens=tokens, wall_s=wall_s, max_targets=max_targets,
                              concurrency=concurrency, on_event=on_event, budget_s=budget_s, keep_slower=keep_slower,
                              split_tf32=split_tf32, dynamic=dynamic)
    if dynamic is None:
        fast = run_pipeline(traced, tensors, options)
    else:
        declared = parameter_names(original)
        names = [declared[i] if i < len(declared) else f"input {i}" for i in range(len(positional))] + list(keywords)
        fast = optimize_dynamic(traced, tensors, options, [n for i, n in enumerate(names) if i not in settings])
    fast.original = original
    fast._arity, fast._keywords, fast._settings = len(positional), tuple(keywords), settings
    if settings:
        fast.report.decisions.append((
            f"{len(settings)} input(s) without a tensor fixed at the values optimize() saw",
            ", ".join(f"{input_label(i, len(positional), tuple(keywords))}{every[i]!r}" for i in settings)
            + ": the program is specialized to "
            "them; a call may leave a keyword one out, and another value raises InvalidArgumentError"))
    return fast
