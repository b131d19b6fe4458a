"""`stitchcuda.optimize(model, args, kwargs)`: capture, plan, generate, verify, and return a module that
runs the stitched program — or the original model with the reason, whenever any stage cannot proceed.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ..errors import InvalidArgumentError
from ..program import DTYPES, Program, ProgramModule
from ..verify.hardware import describe
from ..verify.compare import first_difference, tolerance_used
from ..verify.program import input_set, release_host_memory, verify_whole
from ..verify.tolerance import tolerance
from ..verify import timing as verify_timing  # a module name: optimize() has an argument called measure
from .capture import CaptureError, Graph, Value, capture
from .lower import (Lowering, LoweringError, check_group, constant_values, group_inputs, reference_values,
                    stream_values, working_bytes)
from .agents import AgentBudget, run_agents
from .planner import GENERATED, Group, OfflinePlanner, GraphPlan
from .report import Report, _Progress
from .targets import merged_group

__all__ = ["optimize", "OptimizedModule", "Report", "BUDGET_S", "trace_mismatch"]

# Seconds of generating and checking groups after which the rest stay on ATen (optimize's budget_s).
BUDGET_S = 60.0
# Whole-program mismatches traced and fixed, each by sending one group to ATen, before giving up.
TRACE_ROUNDS = 3
# A traced mismatch runs at most this many diagnostic programs (windows of the watched outputs, trace_mismatch).
TRACE_WINDOWS = 24


class OptimizedModule(torch.nn.Module):
    """Runs the stitched program (or the original module when optimization did not apply).

    Inference only: the program computes the eval-mode forward (dropout off, batch norm with its running
    statistics) and records no autograd graph. It is called like the original — the same positional and
    keyword inputs — and ``.train(True)`` raises InvalidArgumentError: train ``.original`` and call
    optimize() again. The program is stitched for the input shapes and dtypes optimize() saw; a call with
    others runs ``.original`` (a RuntimeWarning once per shape set; ``other_shape_calls`` counts them)."""

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
        self._settings: dict[int, Any] = {}  # inputs without a tensor, fixed (_KeywordCall)
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
        flat, _ = pytree.tree_flatten(_positional_call(args, kwargs, self._arity, self._keywords, self._settings))
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
                warnings.warn(
                    f"stitchcuda: inputs {_shapes(given)} differ from the {_shapes(wanted)} this program was "
                    "stitched for: the original model runs for them (call stitchcuda.optimize() with such inputs "
                    "for a program of their own)", RuntimeWarning, stacklevel=2)
            return self.original(*args, **kwargs)
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
            raise RuntimeError(f"nothing to save: the model runs eagerly ({self.report.reason})")
        self.program.save(path)


class _Function(torch.nn.Module):
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


class _KeywordCall(torch.nn.Module):
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
        self._stitchcuda_name = _model_name(module)

    def forward(self, *inputs):
        given = iter(inputs)
        full = [self.settings[i] if i in self.settings else next(given)
                for i in range(len(inputs) + len(self.settings))]
        return self.module(*full[:self.arity], **dict(zip(self.names, full[self.arity:])))


def _is_setting(value: Any) -> bool:
    """An input that holds no tensor (a flag, a number, a string, None): the program is specialized to it."""
    return not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value))


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value whose == is not a truth value
        return a is b


def _shapes(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> str:
    """[f32[8, 16], i64[8]]: input shapes and dtypes as the program's messages write them."""
    from ..program import dtype_name

    return "[" + ", ".join(f"{dtype_name(d) if d in DTYPES.values() else d}{list(s)}" for s, d in specs) + "]"


def _model_name(model: torch.nn.Module) -> str:
    return getattr(model, "_stitchcuda_name", None) or type(model).__name__


def _as_module(model: Any) -> torch.nn.Module:
    if isinstance(model, torch.nn.Module):
        return model
    if callable(model):
        return _Function(model)
    raise InvalidArgumentError(f"optimize() takes an nn.Module or a function of tensors, not a {type(model).__name__}")


def _refuse_training(model: torch.nn.Module) -> None:
    """InvalidArgumentError when the module or any submodule is in training mode (optimize() no longer
    switches it to eval mode behind the caller's back)."""
    training = [name for name, m in model.named_modules() if m.training]
    if training:
        who = "the model is" if training[0] == "" else f"its submodule '{training[0]}' is"
        raise InvalidArgumentError(
            f"{who} in training mode: call model.eval() first. optimize() builds an inference program (dropout "
            "off, batch norm with its running statistics, no backward), which a training-mode forward does not "
            "compute.")


def _as_args(args: Any) -> tuple:
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


def _as_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidArgumentError(f"kwargs must be a dict of the model's keyword inputs by name; got a "
                                   f"{type(kwargs).__name__}")
    return dict(kwargs)


def _input_label(i: int, arity: int, keywords: tuple[str, ...]) -> str:
    """How an input at position `i` of the program's order is named: "mask=" or "positional input 2: "."""
    return f"{keywords[i - arity]}=" if i >= arity else f"positional input {i}: "


def _positional_call(args: tuple, kwargs: dict[str, Any], arity: int, keywords: tuple[str, ...],
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
        if i < len(ordered) and not _same(ordered[i], value):
            raise InvalidArgumentError(
                f"{_input_label(i, arity, keywords)}{ordered[i]!r} differs from the {value!r} optimize() saw: the program is specialized to "
                "the inputs without a tensor it was optimized with; call optimize() again with this value")
    return ordered


def _device_facts() -> tuple[int, str]:
    """(SM count, name) of the current GPU, as the Verifier describes it."""
    gpu = describe()
    if gpu["gpu"] is None:
        raise RuntimeError("no usable CUDA device (the driver sees none)")
    return gpu["sms"], gpu["gpu"]


def _hardware() -> dict[str, str]:
    """The machine the program is verified on, recorded in the artifact: the Verifier's description of
    the GPU, the architecture its kernels are built for (sm_90a on Hopper), driver, CUDA and torch."""
    from .. import _C

    gpu = describe()
    arch = gpu["arch"] + ("a" if gpu["arch"].startswith("sm_9") else "")
    return {"device": gpu["gpu"], "arch": arch, "driver": str(_C.driver_version()), "cuda": gpu["cuda"],
            "torch": torch.__version__}


def _time_ms(fn, repeats: int = 30) -> float:
    """Milliseconds per call of `fn()`: the median on the Verifier's protocol (verify.timing.measure:
    L2 flushed and persisting L2 reset before each call), so optimize()'s speed-ups mean what the
    Verifier's do."""
    return verify_timing.measure(fn, repeats=repeats, warmup=3).median_ms


def _owning_constants(constants: dict[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    """The constants whose memory is their own: not views of the model's parameters or buffers."""
    shared = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return [name for name, t in constants.items() if t.untyped_storage().data_ptr() not in shared]


def _allocated() -> int:
    """The GPU memory PyTorch's allocator has handed out (0 without a GPU)."""
    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0


def _program_memory(program: Program) -> dict[str, int]:
    """Report.memory's static part: the bytes of the program's own weights (constants and weights in a
    layout of their own, uploaded by each runner), of the weights its runners read in place from the
    model's parameters (Program.share_weight: no copy), of its planned arena, and what a call plans in all
    beside its inputs (planned_bytes: the arena, the most storages outside it alive at one step — ATen
    results, large intermediates — and the outputs; library workspaces are not in it)."""
    own = shared = 0
    for b in program.buffers:
        if b["role"] == "weight":
            n = _buffer_bytes(b)
            if b["id"] in program.shared_weights:
                shared += n
            else:
                own += n
    return {"weights_bytes": int(own), "shared_weights_bytes": int(shared),
            "arena_bytes": int(program.buffer_plan()["arena_bytes"]), "planned_bytes": _planned_bytes(program)}


# Program variants whose times are within this share of the fastest's are a tie (the timer's spread on
# one model): of those, the one whose plan holds the least working memory is kept.
VARIANT_TIE = 0.02


def _choose_variant(times: dict[tuple[frozenset, bool], float], planned: dict[tuple[frozenset, bool], int]
                    ) -> tuple[frozenset, bool]:
    """The program variant to keep, by ms per call (`times`) and planned working memory in bytes
    (`planned`, _planned_bytes): the fastest, unless another within VARIANT_TIE of it plans less memory (a
    channels-last chain's edge copies for a convolution that runs about as fast in NCHW). Ties on both:
    the first tried."""
    fastest = min(times.values())
    close = [v for v in times if times[v] <= fastest * (1 + VARIANT_TIE)]
    return min(close, key=lambda v: (planned.get(v, 0), times[v]))


def _planned_bytes(program: Program) -> int:
    """The GPU memory a run of `program` plans beside its inputs: its arena, the most bytes of storages
    outside it alive at one step, and its outputs."""
    return working_bytes(program) + sum(_buffer_bytes(b) for b in program.buffers if b["role"] == "output")


def _buffer_bytes(b: dict) -> int:
    """The bytes of a program buffer's elements (one of Program.buffers)."""
    return math.prod(b["shape"]) * DTYPES[b["dtype"]].itemsize


def _variant_decisions(times: dict[tuple[frozenset, bool], float], chosen: tuple[frozenset, bool],
                       epilogues: int, planned: dict[tuple[frozenset, bool], int] | None = None
                       ) -> list[tuple[str, str]]:
    """The report's decisions on the program variants optimize() timed (ms per call on the example inputs,
    by (channels-last values, fused convolution epilogues)) and the one kept; `planned`: each variant's
    planned working memory, named when it decided a tie."""
    out = []
    fastest = min(times, key=times.get)
    if chosen != fastest and planned:
        out.append((f"program variants within {VARIANT_TIE:.0%}: the one planning less memory kept (measured)",
                    f"{times[chosen]:.4f} ms planning {planned[chosen] / 2**20:,.0f} MiB against the fastest's "
                    f"{times[fastest]:.4f} ms planning {planned[fastest] / 2**20:,.0f} MiB (VARIANT_TIE: the timer's "
                    "spread on one model)"))
    layouts = {layout for layout, _ in times}
    if len(layouts) > 1:
        nhwc = next(layout for layout in layouts if layout)
        out.append((f"convolution chains {'channels-last' if chosen[0] else 'kept NCHW'} (measured)",
                    f"on the example inputs: channels-last {times[(nhwc, False)]:.4f} ms, NCHW "
                    f"{times[(frozenset(), False)]:.4f} ms per call; cuDNN's tensor-core convolutions run on NHWC "
                    "data, at the price of a conversion at each chain's edges"))
    fused = next((v for v in times if v[1]), None)
    if fused is not None:
        out.append((f"convolution epilogues {'fused in cuDNN' if chosen[1] else 'as generated kernels'} (measured)",
                    f"on the example inputs: {epilogues} convolution(s) with their batch norm folded into the filter "
                    f"and the residual add and ReLU in cuDNN's fused call (cudnn_convolution_relu / _add_relu) "
                    f"{times[fused]:.4f} ms, a convolution and a generated epilogue kernel "
                    f"{times[(fused[0], False)]:.4f} ms per call"))
    return out


def _choose_replay(program: Program, inputs: list[torch.Tensor],
                   held: dict[bool, int] | None = None) -> tuple[ProgramModule, tuple[str, str], float]:
    """Times the program replayed as one CUDA graph and launched step by step on the example inputs and
    keeps the faster runner. A replay saves host time per launch but copies the inputs into, and the
    outputs out of, the graph's own buffers: on a few large kernels the copies cost more than they save.
    Returns the runner, the decision and its milliseconds per call (inf when neither mode ran); `held`
    receives, per mode timed (True: graph), the GPU memory its runner held after its timed calls."""
    held = {} if held is None else held

    def timed(runner: ProgramModule, graphs: bool) -> float:
        before = _allocated()
        ms = _time_ms(lambda: runner.executor.run(inputs))
        held[graphs] = held.get(graphs, 0) + _allocated() - before
        return ms

    copies_ms, saved_ms = _replay_estimate(program)
    if copies_ms > REPLAY_COPY_MARGIN * saved_ms:
        # Not worth building: the graph runner's static copies would add every input and output to the
        # process's memory to save less than the copies cost.
        why = (f"estimated, not measured: a replay copies the inputs and outputs ({copies_ms:.3f} ms at the GPU's "
               f"memory bandwidth) to save about {saved_ms:.3f} ms of launches ({len(program.steps)} steps)")
        program.set_replay("direct", why)
        before = _allocated()
        runner = ProgramModule(program, graphs=False)
        held[False] = _allocated() - before  # its weights
        try:
            ms = timed(runner, False)
        except Exception:  # verification reports the failure
            ms = float("inf")
        return runner, ("launch the steps directly (no CUDA graph)", why), ms
    times: dict[bool, float] = {}
    errors: dict[bool, str] = {}
    runners: dict[bool, ProgramModule] = {}
    # One runner alive at a time (each holds an arena of the program's intermediates, and the graph
    # runner static copies of its inputs and outputs): the graph runner is timed and let go, the direct
    # one timed and kept only if it wins; a winning graph runner is built again (its kernels are loaded).
    for graphs in (True, False):
        try:
            before = _allocated()
            runner = ProgramModule(program, graphs=graphs)
            held[graphs] = _allocated() - before  # its weights
            times[graphs] = timed(runner, graphs)
            if not graphs:
                runners[graphs] = runner
        except Exception as exc:  # the other mode may still run; verification judges the one kept
            errors[graphs] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        runner = None
    if len(times) == 2:
        graph_ms, direct_ms = times[True], times[False]
        use_graph = graph_ms <= direct_ms
        why = (f"measured on the example inputs: CUDA graph replay {graph_ms:.4f} ms, direct launches "
               f"{direct_ms:.4f} ms per call")
    elif times:
        use_graph = next(iter(times))
        why = f"the other mode failed: {errors[not use_graph]}"
    else:  # neither ran: keep the graph runner and let verification report the failure
        return (ProgramModule(program, graphs=True), ("replay as one CUDA graph", f"neither mode ran: {errors[True]}"),
                float("inf"))
    decision = "replay as one CUDA graph" if use_graph else "launch the steps directly (no CUDA graph)"
    program.set_replay("graph" if use_graph else "direct", why)  # a saved artifact runs the same way
    kept = runners.pop(False, None) if not use_graph else None
    runners.clear()
    return kept or ProgramModule(program, graphs=use_graph), (decision, why), times[use_graph]


# A CUDA graph replay saves about this much host time per launched step, and a replay is measured only
# when its copies of the inputs and outputs cost less than REPLAY_COPY_MARGIN times what it saves.
LAUNCH_US = 5.0
REPLAY_COPY_MARGIN = 4.0


def _replay_estimate(program: Program) -> tuple[float, float]:
    """(ms a replay spends copying the inputs in and the outputs out, ms of launches it saves), from the
    buffers' sizes, the GPU's memory bandwidth (the Verifier's table; 2 TB/s when unknown) and
    LAUNCH_US per step."""
    moved = 2 * sum(_buffer_bytes(b) for b in program.buffers if b["role"] in ("input", "output"))  # read, write
    return _copy_ms(moved), len(program.steps) * LAUNCH_US / 1e3


def _copy_ms(moved: int) -> float:
    """Milliseconds to read and write `moved` bytes at the GPU's memory bandwidth (the Verifier's table;
    2 TB/s when unknown)."""
    return moved / ((describe().get("dram_tb_s") or 2.0) * 1e12) * 1e3


def optimize(model: torch.nn.Module | Callable[..., Any], args: Any = None, kwargs: dict[str, Any] | None = None, *,
             llm: Any = None, precision: str = "fp32", graphs: bool = True, verify_sets: int = 3, measure: bool = True,
             compare_compile: bool = True, progress: bool | None = None, isolated: bool = True,
             run_dir: str | os.PathLike | None = None, resume: str | os.PathLike | None = None, attempts: int = 3,
             tokens: int = 0, wall_s: float = 0.0, max_targets: int = 4, concurrency: int = 4, on_event: Any = None,
             budget_s: float = BUDGET_S, keep_slower: bool = False, split_tf32: bool = True) -> OptimizedModule:
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

    `split_tf32`: at precision="fp32", a GEMM bound by fp32 arithmetic may run as three TF32 tensor-core
    products on operands split into a TF32 part and its remainder (tf32x3: fp32's accuracy, held to fp32's
    tolerance by every check) where the GPU's peaks say it is faster; False keeps cuBLAS's SGEMM for all.
    """
    original = _as_module(model)
    _refuse_training(original)
    positional = _as_args(args)
    keywords = _as_kwargs(kwargs)
    every = positional + tuple(keywords.values())
    settings = {i: v for i, v in enumerate(every) if _is_setting(v)}
    traced = original
    if keywords or settings:
        # The pipeline sees positional tensor inputs only: keyword inputs follow args, in this order, and
        # inputs without a tensor are fixed in the traced call.
        traced = _KeywordCall(original, len(positional), tuple(keywords), settings)
    tensors = tuple(v for i, v in enumerate(every) if i not in settings)
    fast = _optimize(traced, tensors, llm=llm, precision=precision, graphs=graphs, verify_sets=verify_sets,
                     measure=measure, compare_compile=compare_compile, progress=progress, isolated=isolated,
                     run_dir=run_dir, resume=resume, attempts=attempts, tokens=tokens, wall_s=wall_s,
                     max_targets=max_targets, concurrency=concurrency, on_event=on_event, budget_s=budget_s,
                     keep_slower=keep_slower, split_tf32=split_tf32)
    fast.original = original
    fast._arity, fast._keywords, fast._settings = len(positional), tuple(keywords), settings
    if settings:
        fast.report.decisions.append((
            f"{len(settings)} input(s) without a tensor fixed at the values optimize() saw",
            ", ".join(f"{_input_label(i, len(positional), tuple(keywords))}{every[i]!r}" for i in settings)
            + ": the program is specialized to "
            "them; a call may leave a keyword one out, and another value raises InvalidArgumentError"))
    return fast


def _optimize(model: torch.nn.Module, example_inputs: tuple, *, llm: Any, precision: str, graphs: bool,
              verify_sets: int, measure: bool, compare_compile: bool, progress: bool | None, isolated: bool,
              run_dir: str | os.PathLike | None, resume: str | os.PathLike | None, attempts: int, tokens: int,
              wall_s: float, max_targets: int, concurrency: int, on_event: Any, budget_s: float,
              keep_slower: bool, split_tf32: bool = True) -> OptimizedModule:
    """optimize() on a module in eval mode and its positional inputs (keyword inputs already appended)."""
    report = Report()
    steps = _Progress(progress)
    example_inputs = tuple(example_inputs)
    if not torch.cuda.is_available():
        report.reason = "no CUDA device: the model runs eagerly"
        _plan_only(model, example_inputs, precision, graphs, report)
        return OptimizedModule(model, None, None, report)
    devices = {t.device for t in pytree.tree_flatten(example_inputs)[0] if isinstance(t, torch.Tensor)}
    devices |= {p.device for p in model.parameters()}
    if any(d.type != "cuda" for d in devices):
        report.reason = (f"the model and inputs must be on a CUDA device (found {sorted(map(str, devices))}): "
                         "call model.cuda() and move the inputs")
        return OptimizedModule(model, None, None, report)
    start = _allocated()  # what optimize() found allocated: its own memory is measured above this
    pool = None
    try:
        if isolated:
            from ..verify import trusted_pool

            pool = trusted_pool()
            pool.start()  # a first call's worker imports torch while the model is captured and planned
        with steps.step("capturing"):
            t0 = time.perf_counter()
            graph = capture(model, example_inputs)
            report.stage_seconds["capture"] = time.perf_counter() - t0
        _peak(report, "capture")
        report.op_counts = graph.op_counts()
        report.decisions += graph.notes
        planner = OfflinePlanner(precision=precision, graphs=graphs, peaks=describe(), split_tf32=split_tf32)
        with _timed(report, "plan"):
            plan = planner.plan(graph)
        report.decisions += plan.decisions
        report.groups = _planned_entries(plan)  # what ran replaces it once the program is built
        unheld = _unheld(plan, report)
        if unheld:
            report.reason = unheld + ": the model runs eagerly"
            return OptimizedModule(model, None, None, report)
        flat_inputs = [t for t in pytree.tree_flatten(example_inputs)[0] if isinstance(t, torch.Tensor)]
        sm_count, device_name = _device_facts()
        fallback: set[int] = set()
        agents = llm is not None or resume is not None
        with steps.step(f"generating and checking {sum(g.kind in GENERATED for g in plan.groups)} group(s)"):
            t0 = time.perf_counter()
            if pool is not None:
                report.decisions.append(("group checks in the Verifier's isolated worker",
                                         "generated code runs apart from this process until it matches ATen; "
                                         "recorded tensors reach it as CUDA IPC handles, not copies"))
            constants, values = _check_groups(graph, plan, flat_inputs, sm_count, pool, t0, budget_s, report,
                                              fallback, keep_all=agents, room=start + _memory_target(graph),
                                              forward=lambda: model(*example_inputs))
            report.stage_seconds["generate_and_check"] = time.perf_counter() - t0
        _peak(report, "generate_and_check")
        offline_groups = list(plan.groups)
        if agents:
            with steps.step("the agents: profile, choose targets, write and verify kernel steps"):
                t0 = time.perf_counter()
                _drive_agents(graph, plan, values, constants, sm_count, llm, report, fallback,
                              name=_model_name(model), run_dir=run_dir, resume=resume,
                              budget=AgentBudget(attempts, tokens, wall_s, max_targets, concurrency), on_event=on_event,
                              compare_compile=compare_compile)
                report.stage_seconds["agents"] = time.perf_counter() - t0
        values = None  # every recorded intermediate is freed here: the checks that read them are done
        idle = "" if keep_slower else _nothing_to_gain(plan, fallback, graph)
        if idle:
            # Building, verifying and timing such a program would only spend optimize()'s time and memory
            # (a fresh input set as large as the model's inputs) on the model's own calls.
            report.status = "eager"
            report.reason = f"{idle}: the original model runs (nothing was built; keep_slower=True builds the program)"
            return OptimizedModule(model, None, None, report)
        # From here on the constants only go into programs, which store them as host bytes anyway: host
        # copies give the GPU memory of those computed into tensors of their own (a folded mask, a value
        # computed from weights) back to the build, verification and timing. A view of a weight (a
        # transposed projection) holds nothing of its own and stays: a host copy would only add host memory.
        for name in _owning_constants(constants, model):
            constants[name] = constants[name].to("cpu")
        contiguous_inputs = [t.contiguous() for t in flat_inputs]

        # The program's variants, timed against each other when there are several: the convolution chains'
        # layout (channels-last, NCHW) and, in the first layout, the convolution epilogues cuDNN can fuse
        # (planner.conv_epilogues) as one cuDNN call each instead of a convolution and a generated kernel.
        variants = [(layout, False) for layout in ([plan.channels_last, frozenset()] if plan.channels_last
                                                   else [frozenset()])]
        if plan.conv_epilogues:
            variants.append((variants[0][0], True))

        def build_one() -> tuple[OptimizedModule, float]:
            lowering = Lowering(graph, plan, constants, sm_count)
            program = lowering.build(plan.groups, graph.inputs, graph.outputs, fallback, _hardware())
            program.compile_kernels()
            # The kernels of this program (its layout, its fused epilogues), not the group checks' programs.
            report.groups = _group_entries(plan, lowering, fallback, lowering.main_kernels)
            runner, ms = None, float("inf")
            held: dict[bool, int] = {}
            report.memory = _program_memory(program)
            if graphs:
                runner, decision, ms = _choose_replay(program, contiguous_inputs, held)
                report.decisions[:] = [d for d in report.decisions if not _is_replay_decision(d)] + [decision]
                kept = program.replay["mode"] == "graph"
                if kept in held:
                    report.memory["runner_bytes"] = held[kept]
            else:
                program.set_replay("direct", "graphs=False was requested")  # carried into the saved artifact
                if len(variants) > 1:
                    runner = ProgramModule(program, graphs=False)
                    ms = _time_ms(lambda: runner.executor.run(contiguous_inputs))
            return OptimizedModule(model, program, graph, report, graphs=graphs, runner=runner), ms

        def build() -> OptimizedModule:
            """The program; with several variants (a channels-last plan against the same plan in NCHW: the
            edges' conversions can cost more than cuDNN's own; fused convolution epilogues against generated
            ones), each is built and timed and the fastest kept."""
            if len(variants) == 1:
                plan.channels_last, plan.fuse_conv_epilogues = variants[0]
                return build_one()[0]
            # One program alive at a time: each is timed, then freed before the next is built (two arenas
            # and two replay runners at once would add a whole forward's activations to optimize's peak);
            # the one chosen is rebuilt at the end unless it was the last one built (its kernels come from
            # the cache then).
            last, times, planned, described = None, {}, {}, {}
            for variant in variants:
                plan.channels_last, plan.fuse_conv_epilogues = variant
                last = None
                candidate, ms = build_one()
                times[variant] = ms
                planned[variant] = _planned_bytes(candidate.program)
                described[variant] = (list(report.groups), list(report.decisions))
                last, candidate = (variant, candidate), None
            chosen = _choose_variant(times, planned)
            variants[:] = [chosen]  # later rebuilds (a traced mismatch) keep it
            plan.channels_last, plan.fuse_conv_epilogues = chosen
            if last[0] == chosen:
                best = last[1]
                report.groups, report.decisions[:] = described[chosen]  # the report describes the program kept
            else:
                last = None
                best = build_one()[0]
            report.decisions[:] = [d for d in report.decisions if not d[0].startswith("convolution ")]
            report.decisions += _variant_decisions(times, chosen, len(plan.conv_epilogues), planned)
            return best

        with steps.step("building the program"), _timed(report, "build"):
            optimized = build()
        _peak(report, "build")
        with steps.step(f"verifying on {verify_sets} input set(s)"), _timed(report, "verify"):
            report.verification = _verify(model, optimized, example_inputs, verify_sets, plan)
        _peak(report, "verify")
        if not report.verification["passed"] and plan.groups != offline_groups:
            # A kernel step passed its target's checks but the whole program does not match: keep the
            # verified offline program instead of losing every gain.
            detail = report.verification["detail"]
            plan.groups = offline_groups
            with steps.step("rebuilding without the agents' kernel steps"), _timed(report, "trace_and_rebuild"):
                optimized = None  # its runner's memory goes before the next one is built
                optimized = build()
                report.verification = _verify(model, optimized, example_inputs, verify_sets, plan)
            for t in report.targets:
                if t["winner"] == "llm":
                    t["winner"], t["note"] = "template", f"dropped: the whole program with it did not match ({detail})"
            report.decisions.append(("the agents' kernel steps left out", f"the whole program with them did not match "
                                     f"the model: {detail}"))
        lossy = [(g, g.params["precision"]) for g in plan.groups if _lossy(g) and id(g) not in fallback]
        if not report.verification["passed"] and lossy:
            # Precision before blame: a tf32x3 product within fp32's tolerance of SGEMM, or bf16 products
            # within bf16's, can still move a result that later ops amplify (a state-space scan's
            # exponentials, a deep stack of residual blocks), and tracing would then blame the groups
            # downstream of it. Every such GEMM steps down first (tf32x3 to SGEMM, bf16 products to TF32).
            why = f"the whole program did not match the model ({report.verification['detail']})"
            for g, _ in lossy:
                _step_down(g, report, why)
            with steps.step(f"rebuilding with {len(lossy)} GEMM(s) at higher precision"), \
                    _timed(report, "trace_and_rebuild"):
                optimized = None
                optimized = build()
                report.verification = _verify(model, optimized, example_inputs, verify_sets, plan)
            _peak(report, "trace_and_rebuild")
            if report.verification["passed"]:
                optimized = _restore_late(lossy, report, steps, lambda: build(),
                                          lambda o: _verify(model, o, example_inputs, verify_sets, plan), optimized)
        for _ in range(TRACE_ROUNDS):
            if report.verification["passed"]:
                break
            with steps.step("tracing the mismatch to a group"), _timed(report, "trace_and_rebuild"):
                optimized.release()  # the mismatching program's working memory, while the diagnosis runs
                traced_inputs = _flat_tensors(input_set(example_inputs, report.verification.get("failed_set") or 0))
                # What the memory target leaves beside the diagnosis's own forward (the program's, then ATen's):
                # the room its watched outputs may take at once.
                room = start + _memory_target(graph) - _allocated() - graph.working_set_bytes()
                culprit, why = trace_mismatch(graph, plan, constants, sm_count, fallback, traced_inputs,
                                              room=max(room, 0))
                traced_inputs = None
            if culprit is None:
                break
            mismatch = (f"the whole program did not match the model ({report.verification['detail']}); traced to "
                        f"this group: {why}")
            fallback.add(id(culprit))
            report.fallbacks.append({"group": culprit.name, "kind": culprit.kind, "reason": mismatch})
            with steps.step(f"rebuilding with {culprit.name} on ATen"), _timed(report, "trace_and_rebuild"):
                optimized = None
                optimized = build()
                report.verification = _verify(model, optimized, example_inputs, verify_sets, plan)
            _peak(report, "trace_and_rebuild")
        if not report.verification["passed"]:
            report.status = "eager"
            report.reason = "the stitched program does not match the model: " + report.verification["detail"]
            optimized._runner = None
            return optimized
        report.status = "optimized"
        if measure or not keep_slower:
            with steps.step("measuring"), _timed(report, "measure"):
                report.timing = _measure(model, optimized, example_inputs, compare_compile and measure)
            _peak(report, "measure")
            why = _not_faster(report.timing)
            if not keep_slower and why:
                report.status = "eager"
                report.reason = (f"the stitched program is not faster than the model on the example inputs ({why}, "
                                 "by the Verifier's timer): the original model runs (keep_slower=True keeps the "
                                 "program)")
                optimized._runner = None
        return optimized
    except (CaptureError, LoweringError) as exc:
        report.reason = str(exc)
        return OptimizedModule(model, None, None, report)
    except Exception as exc:  # anything else: never break the caller, say what happened
        report.reason = f"{type(exc).__name__} while optimizing: {exc}"
        return OptimizedModule(model, None, None, report)


def _memory_target(graph: Graph) -> int:
    """The GPU memory optimize() plans to stay within, above what was allocated when it began: the eager
    forward's working set (estimated from the graph) plus twice its largest input or output (room for a
    reference and a candidate of it)."""
    largest = max((v.numel * v.dtype.itemsize for v in (*graph.inputs, *graph.outputs)), default=0)
    return graph.working_set_bytes() + 2 * largest


def check_wants(graph: Graph, plan: GraphPlan) -> dict[int, set[str]]:
    """For each generated group (by id): the recorded values its check reads and compares — the inputs its
    program reads (a GEMM's chosen operands: the source of a transposed view it reads in place, not the
    view), weights and constants aside, and its outputs."""
    outputs_all = {v.name for v in graph.outputs}
    constant_names = {g.nodes[0].out.name for g in plan.groups if g.kind == "constant" and g.nodes[0].outputs}
    return {id(g): {v.name for v in group_inputs(g) if v.kind != "weight" and v.name not in constant_names}
            | {v.name for v in g.outputs(outputs_all)} for g in plan.groups if g.kind in GENERATED}


def _check_groups(graph: Graph, plan: GraphPlan, inputs: list[torch.Tensor], sm_count: int, pool: Any, t0: float,
                  budget_s: float, report: Report, fallback: set[int], keep_all: bool, room: int | None = None,
                  forward: Callable[[], Any] | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Checks every generated group against ATen on the example inputs while the graph runs once: a
    group is checked once its recorded inputs and outputs exist, and a recorded value is freed
    once the groups that read it are checked (stream_values), so optimize() holds about the eager
    forward's working set, not every intermediate at once. Groups still unchecked when `budget_s`
    seconds have passed since `t0` stay on ATen. `room`: the allocated bytes a check should stay within
    (_memory_target above optimize's start); a check whose candidate outputs would pass it writes its
    large outputs into the recorded ones (check_group's room). `forward`: the model's own call on the
    example inputs, which gives the values when the checks want only the graph's inputs and outputs
    (stream_values). Returns the constant values (computed from weights alone) and, with `keep_all` (the
    agents read every value), all recorded values."""
    constant_names = {g.nodes[0].out.name for g in plan.groups if g.kind == "constant" and g.nodes[0].outputs}
    generated = [g for g in plan.groups if g.kind in GENERATED]
    wanted = check_wants(graph, plan)
    by_id = {id(g): g for g in generated}
    constants: dict[str, torch.Tensor] = {}
    deadline = t0 + budget_s if budget_s and budget_s > 0 else float("inf")
    unchecked = 0
    if keep_all:  # the agents profile and check groups later on the same recorded values
        values = reference_values(graph, inputs)
        constants.update({n: values[n] for n in constant_names if n in values})
        ready = [(id(g), values) for g in generated]
    else:
        values, ready = None, []
    results: dict[int, tuple[bool, str, Any]] = {}
    memo: dict = {}  # group program -> verdict: identical groups (every layer's copy) are checked once
    shared = in_place = 0

    def check(key, held: dict[str, torch.Tensor]) -> None:
        nonlocal unchecked
        g = by_id[key]
        if time.perf_counter() > deadline:
            unchecked += 1
            results[key] = (False, f"not checked: the time budget of {budget_s:g} s (budget_s=) was spent on "
                                   "earlier groups", None)
            return
        nonlocal shared, in_place
        try:
            stats: dict = {}
            results[key] = _checked(graph, plan, g, held, constants, sm_count, pool, report, memo, stats, room)
            lossy = _lossy(g)
            if not results[key][0] and _step_down(g, report, f"the {lossy} product failed its check: {results[key][1]}"):
                stats = {}
                results[key] = _checked(graph, plan, g, held, constants, sm_count, pool, report, memo, stats, room)
            shared += bool(stats.get("shared"))
            in_place += bool(stats.get("in_place"))
        except Exception as exc:  # a value the stream never produced, or a bug: this group alone falls back
            results[key] = (False, f"{type(exc).__name__} while checking: {str(exc).splitlines()[0][:200]}", None)

    if keep_all:
        for key, held in ready:
            check(key, held)
    elif wanted or constant_names:  # else nothing to check or keep: the graph need not run at all
        # Constants (values computed from weights alone) are kept as they arrive: a group reading one
        # comes after it in the graph and takes it from `constants`, as the program will.
        stream_values(graph, inputs, wanted, check, keep=constant_names, kept=constants, forward=forward)
        release_host_memory()  # the page-locked copies of outputs checked in place
    for g in generated:  # in plan order, so the report reads as the plan does
        ok, why, _ = results[id(g)]
        if not ok:
            fallback.add(id(g))
            report.fallbacks.append({"group": g.name, "kind": g.kind, "reason": why})
    if shared:
        report.decisions.append((f"{shared} group check(s) shared with an identical group",
                                 "the same kernels over the same shapes (a block's groups, repeated in every layer) are "
                                 "checked once on recorded values; the whole program is verified against the model on "
                                 "every input set"))
    if in_place:
        report.decisions.append((f"{in_place} group check(s) wrote their outputs in place",
                                 "a second copy of the outputs beside the recorded values would have passed the memory "
                                 "optimize() plans for (the eager forward's working set plus twice its largest input or "
                                 "output): the program wrote into the recorded tensors while their values waited in "
                                 "host memory, and got them back after the comparison"))
    if unchecked:
        report.decisions.append((f"{unchecked} group(s) left on ATen unchecked",
                                 f"optimize's time budget of {budget_s:g} s ran out (budget_s=)"))
    return constants, values


# A GEMM group's lossier precisions and the more accurate one each steps down to before ATen is the answer,
# with the report's names for the two: tf32x3 (fp32's accuracy from TF32 products, held to fp32's
# tolerance) to cuBLAS's SGEMM; bf16 products of fp32 operands (held to bf16's) to TF32, what cuBLASLt's
# FAST_16BF mode computes on such operands.
STEP_DOWN = {"tf32x3": ("fp32", "SGEMM", "tf32x3"), "bf16": ("tf32", "TF32", "bf16 products")}
# How the report's titles of those decisions end: stepped down, kept there after a retry, restored.
PRECISION_TITLES = tuple(title for _, lower_name, name in STEP_DOWN.values()
                         for title in (f"{lower_name} instead of {name}", f"{lower_name} kept", f"{name} again"))


def _lossy(g: Group) -> str | None:
    """The GEMM group's precision if it can step down (STEP_DOWN), else None. A bf16 GEMM of bf16 tensors
    computes as the model's dtype does: nothing to step down to."""
    precision = g.params.get("precision") if g.kind == "gemm" else None
    if precision not in STEP_DOWN:
        return None
    result = g.params.get("result")
    if precision == "bf16" and result is not None and result.dtype != torch.float32:
        return None
    return precision


def _step_down(g: Group, report: Report, why: str) -> bool:
    """A tf32x3 or bf16-product GEMM group that failed (its check, or a whole-program mismatch) steps down
    (STEP_DOWN), which keeps its cuBLASLt step and fused epilogue, before ATen is the answer; the report
    says why. False for any other group."""
    precision = _lossy(g)
    if precision is None:
        return False
    lower, lower_name, name = STEP_DOWN[precision]
    g.params["precision"] = lower
    report.decisions.append((f"{g.name}: {lower_name} instead of {name}", why))
    return True


# How many of the GEMMs a whole-program mismatch stepped down are tried again at their own precision, latest first.
RESTORE_LATE = 2


def _restore_late(lowered: list[tuple[Group, str]], report: Report, steps: Any, build: Callable[[], Any],
                  verify: Callable[[Any], dict], passing: Any) -> Any:
    """After a whole-program mismatch stepped every lossy GEMM down (`lowered`: each with the precision it
    had) and the program then matched: the latest of them (in program order) go back to their precision one
    at a time, each kept only if the whole program still matches. An error amplified downstream (a decay's
    exponential in a state-space scan) comes from a product early in the graph; a late one (an output
    projection) has little after it to amplify its error, and keeps its tensor-core speed. Returns the
    program that last passed."""
    kept = passing
    for g, precision in list(reversed(lowered))[:RESTORE_LATE]:
        lower, lower_name, name = STEP_DOWN[precision]
        g.params["precision"] = precision
        with steps.step(f"rebuilding with {g.name} as {name} again"), _timed(report, "trace_and_rebuild"):
            kept = None  # one program alive at a time
            try:
                candidate = build()
                result = verify(candidate)
            except Exception as exc:  # the stepped-down program still stands
                candidate, result = None, {"passed": False, "detail": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
        if not result["passed"]:
            g.params["precision"] = lower
            report.decisions.append((f"{g.name}: {lower_name} kept", f"as {name} again, the whole program did not "
                                     f"match the model ({result['detail']})"))
            candidate = None
            # The program that passed, built again from the same plan (its kernels come from the cache):
            # the same program, so its verification stands.
            kept = build()
            break
        kept, report.verification = candidate, result
        report.decisions[:] = [d for d in report.decisions if d[0] != f"{g.name}: {lower_name} instead of {name}"]
        report.decisions.append((f"{g.name}: {name} again", f"after every lossy GEMM stepped down, this later one "
                                 f"went back to {name} and the whole program still matched the model"))
    return kept


def _checked(graph: Graph, plan: GraphPlan, g: Group, held: dict, constants: dict, sm_count: int, pool: Any,
             report: Report, memo: dict | None = None, stats: dict | None = None,
             room: int | None = None) -> tuple[bool, str, Any]:
    """check_group, recording the GPU memory in use across both processes while it ran: this process's
    allocations at the check plus what the isolated worker allocated for it (stage "check_with_worker";
    the recorded tensors it reads through CUDA IPC are counted once, here). `memo` and `stats`: as
    check_group's. `room`: the allocated bytes the check should stay within; what is left of it beside this
    process's allocations goes to check_group, which checks large outputs in place when the candidate
    would not fit."""
    here = _allocated()
    stats = {} if stats is None else stats
    result = check_group(graph, plan, g, held, constants, sm_count, pool, stats=stats, memo=memo,
                         room=None if room is None else room - here)
    both = here + int(stats.get("worker_peak_bytes") or 0)
    report.stage_peak_bytes["check_with_worker"] = max(both, report.stage_peak_bytes.get("check_with_worker", 0))
    return result


def _nothing_to_gain(plan: GraphPlan, fallback: set[int], graph: Graph | None = None) -> str:
    """Why no program of `plan` can beat the model, or "" when one may: every group that computes runs on
    ATen, as the model does, and there is one such group at most, whose inputs and outputs are too large for
    a CUDA graph replay to pay (its copies of them would cost more than REPLAY_COPY_MARGIN times the launch
    it saves; small ones are worth timing: the program's one launch skips the module's Python call); no value
    is precomputed from the weights (a constant group the model recomputes every call) and no convolution
    epilogue can be fused by cuDNN. A model that only views its inputs has nothing to gain at any size."""
    computing = [g for g in plan.groups if g.kind != "view"]
    if not computing:
        return "nothing to gain: the model only views its inputs"
    if plan.conv_epilogues or any(g.kind == "constant" for g in computing) or len(computing) > 1:
        return ""
    if any((g.kind in GENERATED or g.kind == "kernel_step") and id(g) not in fallback for g in computing):
        return ""
    moved = 0
    if graph is not None:
        moved = 2 * sum(v.numel * v.dtype.itemsize for v in (*graph.inputs, *graph.outputs))  # read and write
    if _copy_ms(moved) <= REPLAY_COPY_MARGIN * LAUNCH_US / 1e3:
        return ""
    what = ", ".join(n.op.removeprefix("aten::") for g in computing for n in g.nodes)
    return (f"nothing to gain: the one step that computes ({what}) runs on ATen, as the model does, and a CUDA "
            f"graph replay would copy {moved / 2 / 2**20:,.0f} MiB of inputs and outputs to save one launch")


@contextlib.contextmanager
def _timed(report: Report, stage: str) -> Iterator[None]:
    """Adds the block's wall seconds to report.stage_seconds[stage] (a stage that runs again, a rebuild
    after a traced mismatch, adds up)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        report.stage_seconds[stage] = report.stage_seconds.get(stage, 0.0) + time.perf_counter() - t0


def _peak(report: Report, stage: str) -> None:
    """Records the process's GPU memory peak so far at the end of `stage` (never resets the counter:
    a caller measuring optimize()'s own peak keeps its measurement)."""
    report.stage_peak_bytes[stage] = max(int(torch.cuda.max_memory_allocated()), report.stage_peak_bytes.get(stage, 0))


def _flat_tensors(inputs) -> list[torch.Tensor]:
    return [t.contiguous() for t in pytree.tree_flatten(tuple(inputs))[0] if isinstance(t, torch.Tensor)]


def _is_replay_decision(decision: tuple[str, str]) -> bool:
    return decision[0] in ("replay as one CUDA graph", "launch the steps directly (no CUDA graph)")


def trace_mismatch(graph: Graph, plan: GraphPlan, constants: dict, sm_count: int, fallback: set[int],
                   inputs: list[torch.Tensor], room: int | None = None) -> tuple[Group | None, str]:
    """The group that makes a whole program differ from the model: the program is built again with
    generated groups' outputs as its outputs and run on `inputs`; each is compared with ATen's value on
    the same inputs, in program order. The first group outside its tolerance is the culprit (its inputs,
    earlier groups' outputs, were within theirs); when none is outside, the one nearest to its limit
    (errors that add up along the graph). Returns (group, why) or (None, why).

    `room`: the bytes the watched outputs of one diagnostic run may take (None: no limit). They are
    watched a window at a time, in program order: a program built up to the window's last group is run,
    its outputs compared and freed before the next window's, and the search stops at the first window
    with a group outside its tolerance; ATen's forward for a window runs only as far as its values. So the
    diagnosis holds about one forward's working set plus `room` — not every intermediate of the model at
    once (a ViT's 3.8 GB against its 0.5 GB forward). The windows are at most TRACE_WINDOWS: where `room`
    would cut more, they are made larger — a TRACE_WINDOWS-th of the outputs' bytes or more — until they
    fit (time before memory)."""
    suspects = [g for g in plan.groups if (g.kind in GENERATED or g.kind == "kernel_step") and id(g) not in fallback]
    if not suspects:
        return None, "no generated group is left to suspect"
    graph_outputs = {v.name for v in graph.outputs}
    position = {id(g): i for i, g in enumerate(plan.groups)}
    owner: dict[str, Group] = {}
    watched: list[Value] = []  # in program order: the suspects' outputs, each once
    for g in suspects:
        for v in g.outputs(graph_outputs):
            if v.name not in owner:
                owner[v.name] = g
                watched.append(v)
    windows = _windows(watched, room)
    if room is not None:  # at most TRACE_WINDOWS diagnostic runs: past that, time goes before memory
        room = max(room, -(-sum(v.numel * v.dtype.itemsize for v in watched) // TRACE_WINDOWS), 1)
        windows = _windows(watched, room)
        while len(windows) > TRACE_WINDOWS:  # values that pack badly: larger windows until they fit
            room *= 2
            windows = _windows(watched, room)
    worst: tuple[float, Group | None, str] = (0.0, None, "")
    for window in windows:
        last = max(position[id(owner[v.name])] for v in window)
        try:  # the groups up to the window's last one: nothing after it runs
            program = Lowering(graph, plan, constants, sm_count).build(plan.groups[:last + 1], graph.inputs,
                                                                       window, fallback)
            program.compile_kernels()
            got = program.executor(graphs=False).run(inputs)
        except Exception as exc:  # the diagnosis cannot run: the caller keeps what it has
            return None, f"the diagnostic program did not run ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        program = None  # its working memory goes before ATen's forward runs
        got_by_name = {v.name: value for v, value in zip(window, got)}
        got = None
        verdicts: dict[str, tuple[str, float]] = {}  # name -> (first difference or "", share of tolerance used)

        def compare(name: str, held: dict[str, torch.Tensor]) -> None:  # ATen's value, streamed, then let go
            if name in held:
                expected = held[name]
                atol, rtol = tolerance(expected.dtype, plan.tolerance_precision)
                value = got_by_name[name]
                verdicts[name] = (first_difference(name, value, expected, atol, rtol, reference="ATen"),
                                  tolerance_used(value, expected, atol, rtol))

        stream_values(graph, inputs, {name: {name} for name in got_by_name}, compare, stop_when_done=True)
        got_by_name.clear()
        for v in window:
            if v.name not in verdicts:
                continue
            problem, ratio = verdicts[v.name]
            if problem:
                return owner[v.name], problem
            if ratio > worst[0]:
                worst = (ratio, owner[v.name], f"within its tolerance but nearest its limit ({ratio:.2f} of it at "
                                               f"'{v.name}'): errors add up along the graph")
    return worst[1], worst[2] or "no group's output differs"


def _windows(values: list[Value], room: int | None) -> list[list[Value]]:
    """`values` cut in consecutive windows of at most `room` bytes each (one value alone where it is larger;
    one window without a limit)."""
    if room is None:
        return [list(values)] if values else []
    windows: list[list[Value]] = []
    size = 0
    for v in values:
        nbytes = v.numel * v.dtype.itemsize
        if windows and size + nbytes <= room:
            windows[-1].append(v)
            size += nbytes
        else:
            windows.append([v])
            size = nbytes
    return windows


def _plan_only(model, example_inputs, precision: str, graphs: bool, report: Report) -> None:
    """Without a GPU: capture, plan, lower and compile (NVRTC needs no GPU), so the report shows what
    would run. Nothing is verified or timed; any failure only adds to the reason."""
    try:
        graph = capture(model, example_inputs)
        report.op_counts = graph.op_counts()
        report.decisions += graph.notes
        plan = OfflinePlanner(precision=precision, graphs=graphs).plan(graph)
        report.decisions += plan.decisions
        report.groups = _planned_entries(plan)
        unheld = _unheld(plan, report)
        if unheld:
            report.reason += f"; planned only: {unheld}"
            return
        constants = constant_values(graph, {g.nodes[0].out.name for g in plan.groups
                                            if g.kind == "constant" and g.nodes[0].outputs})
        lowering = Lowering(graph, plan, constants)
        program = lowering.build(plan.groups, graph.inputs, graph.outputs)
        program.compile_kernels()
        codes = dict(lowering.main_kernels)
        report.groups = []
        for g in plan.groups:
            if g.kind in ("view", "constant") and not _used(g, lowering):
                continue
            entry = {"kind": g.kind, "nodes": ", ".join(n.op.removeprefix("aten::") for n in g.nodes), "reason": g.reason}
            code = codes.get(id(g))
            if code is not None:
                entry.update(kernel=code.name, source=code.source, launch=f"grid {code.grid}, block {code.block}",
                             strategy=code.description)
            report.groups.append(entry)
        steps = [s["kind"] for s in program.steps]
        report.reason += (f"; planned and compiled only: {len(steps)} steps ({steps.count('kernel')} generated kernels, "
                          f"{steps.count('matmul')} cuBLASLt matmuls, {steps.count('aten')} ATen steps), "
                          "unverified until run on a GPU")
    except Exception as exc:  # planning is a courtesy here; the eager model is the answer
        report.reason += f"; planning without a GPU stopped: {type(exc).__name__}: {exc}"


def _planned_entries(plan: GraphPlan) -> list[dict]:
    """The plan as report entries before anything is built (views and constants left out)."""
    return [{"kind": "aten (fallback)" if "unheld" in g.params else g.kind,
             "nodes": ", ".join(n.op.removeprefix("aten::") for n in g.nodes), "reason": g.reason}
            for g in plan.groups if g.kind not in ("view", "constant")]


def _unheld(plan: GraphPlan, report: Report) -> str:
    """Records the ATen fallback groups whose values no program buffer holds (the planner's "unheld");
    returns why the program cannot be built around them, or "" when there are none."""
    groups = [g for g in plan.groups if "unheld" in g.params]
    for g in groups:
        report.fallbacks.append({"group": g.name, "kind": "aten", "reason": g.reason})
    if not groups:
        return ""
    from ..program import DTYPES

    first = groups[0]
    return (f"the stitched program cannot be built: {len(groups)} node(s) work on values no program buffer holds "
            f"(first: {first.nodes[0].op} '{first.name}' on {first.params['unheld']}; buffers hold "
            f"{', '.join(sorted(DTYPES))}); the rest of the model is planned (the report's groups)")


def _group_entries(plan: GraphPlan, lowering: Lowering, fallback: set[int], codes: dict) -> list[dict]:
    """One report entry per group that ran: its kind, ops, why, and the kernel it became."""
    entries = []
    for g in plan.groups:
        if g.kind in ("view", "constant") and not _used(g, lowering):
            continue
        entry = {"kind": "aten (fallback)" if id(g) in fallback else g.kind,
                 "nodes": ", ".join(n.op.removeprefix("aten::") for n in g.nodes), "reason": g.reason}
        code = g.params.get("code") if g.kind == "kernel_step" else codes.get(id(g))
        if id(g) in lowering.on_aten and id(g) not in fallback:  # a layout that this template does not read
            entry["reason"] += f"; ran as ATen steps: {lowering.on_aten[id(g)]}"
        elif code is not None and id(g) not in fallback:
            entry.update(kernel=code.name, source=code.source, launch=f"grid {code.grid}, block {code.block}",
                         strategy=code.description)
        entries.append(entry)
    return entries


def _drive_agents(graph, plan: GraphPlan, values, constants, sm_count: int, llm, report: "Report", fallback: set[int], *,
                  name: str, run_dir, resume, budget: AgentBudget, on_event, compare_compile: bool = True) -> None:
    """The agents on the offline plan (graph/agents.py): each target's winner replaces its groups in
    `plan` (an LLM kernel step), or sends them to ATen (when ATen beat the template path), or leaves
    them (the template path won). The report gets one row per target and the run directory."""
    from ..agents import hardware
    from ..verify import VerifyConfig, default_pool

    # compare_compile=False spares each target's reference its torch.compile (tens of seconds a target).
    run = run_agents(graph, plan, values, constants, llm, name=name, sm_count=sm_count, machine=hardware(),
                     run_dir=run_dir, resume=resume, budget=budget, pool=default_pool(), on_event=on_event,
                     verify_config=VerifyConfig(compile_baseline=compare_compile))
    report.run_dir = run.run_dir
    report.agents = {"usage": run.usage, "wall_s": run.wall_s, "overhead_s": run.overhead_s,
                     "targets": len(run.targets)}
    replaced: dict[int, Group] = {}
    for res in run.targets:
        report.targets.append(res.row())
        if res.winner == "llm" and res.code is not None:
            merged = merged_group(res.groups, res.code, res.sub, f"LLM (attempt {res.llm.get('attempt')})")
            for g in res.groups:
                replaced[id(g)] = merged
        elif res.winner == "aten":
            fallback.update(id(g) for g in res.groups if g.kind in GENERATED)
    if replaced:
        groups, placed = [], set()
        for g in plan.groups:
            m = replaced.get(id(g))
            if m is None:
                groups.append(g)
            elif id(m) not in placed:
                groups.append(m)
                placed.add(id(m))
        plan.groups = groups
    won = sum(res.winner == "llm" for res in run.targets)
    report.decisions.append((f"agents: {won} of {len(run.targets)} target(s) run an LLM kernel step",
                             f"each target's candidates were judged by the Verifier (run directory {run.run_dir})"))


def _used(g, lowering: Lowering) -> bool:
    return any(v is not None and v.name in lowering.buf for n in g.nodes for v in n.outputs)


def _verify(model, optimized: OptimizedModule, example_inputs, sets: int, plan: GraphPlan) -> dict:
    """The whole program against the module, judged by the Verifier (verify.program.verify_whole): the
    example inputs, then fresh random sets, under the tolerance table for the plan's precision; the
    error against an fp64 copy of the model too. {passed, input_sets, max_abs_error, max_rel_error_fp64,
    detail}."""
    return verify_whole(model, optimized, example_inputs, sets, plan.tolerance_precision,
                        no_exact=_fp64_too_large(plan, getattr(optimized, "_graph", None)),
                        release=getattr(optimized, "release", None))


def _fp64_too_large(plan: GraphPlan, graph: Graph | None = None) -> str:
    """Why an fp64 copy of the model would not fit, or "": attention in fp64 runs PyTorch's math path,
    which materializes every score (batch x heads x queries x keys) — 14 GB for one 256 MiB attention;
    and any fp64 forward doubles the weights, the inputs and the working set, which optimize() may not
    hold beyond twice the model's largest tensor (its memory allowance over the eager forward)."""
    from ..verify.program import EXACT_COPY_LIMIT_BYTES

    if graph is not None:
        floating = [v for v in (*graph.inputs, *graph.weights) if v.dtype.is_floating_point]
        need = 2 * (sum(v.numel * v.dtype.itemsize for v in floating) + graph.working_set_bytes())
        allowance = max(EXACT_COPY_LIMIT_BYTES, 2 * graph.largest_tensor_bytes())
        if need > allowance:
            return (f"an fp64 copy of the model and its forward would take about {need / 2**20:,.0f} MiB, above "
                    f"optimize's memory allowance of {allowance / 2**20:,.0f} MiB (twice the largest tensor)")
    worst = 0
    for g in plan.groups:
        for n in g.nodes:
            if "scaled_dot_product" in n.op and len(n.args) >= 2 and all(hasattr(a, "shape") for a in n.args[:2]):
                q, k = n.args[0].shape, n.args[1].shape
                scores = 8 * k[-2] if len(k) >= 2 else 0
                for e in q[:-1]:
                    scores *= e
                worst = max(worst, scores)
    if worst > EXACT_COPY_LIMIT_BYTES:
        return (f"the fp64 attention would materialize {worst / 2**30:.1f} GiB of scores (no fused fp64 kernel), "
                f"above the {EXACT_COPY_LIMIT_BYTES >> 20} MiB limit")
    return ""


# The keep decision's timing: eager and the program timed in alternating rounds of MEASURE_REPEATS calls
# each (the Verifier's protocol per round), so that a drift of the GPU's or the host's state over the
# measurement (clocks ramping up, a busy neighbour) reaches both sides instead of favouring the one timed
# second.
MEASURE_ROUNDS = 3
MEASURE_REPEATS = 10
# The program is kept only when faster than eager by more than this share of eager's time (the median of
# the rounds) and in most rounds: a gain within the timer's spread on one model (VARIANT_TIE) is not one,
# and the model itself is the call that cannot be slower than the model.
KEEP_MARGIN = VARIANT_TIE


def _not_faster(timing: dict) -> str:
    """Why the measured program does not beat eager ("" when it does): its median not below eager's by
    KEEP_MARGIN, or faster in at most half of the alternating rounds."""
    rounds = timing.get("rounds", 1)
    faster = timing.get("rounds_faster", rounds)
    stitched, eager = timing["stitched_ms"], timing["eager_ms"]
    if stitched * (1 + KEEP_MARGIN) < eager and 2 * faster > rounds:
        return ""
    return (f"{stitched:.4f} ms against eager {eager:.4f} ms per call, faster in {faster} of {rounds} alternating "
            f"rounds; kept only {KEEP_MARGIN:.0%} faster and in most rounds")


def _measure(model, optimized: OptimizedModule, example_inputs, compare_compile: bool) -> dict:
    """Eager's and the program's ms per call on the example inputs (the median of MEASURE_ROUNDS
    alternating rounds, eager first in odd rounds, the program first in even ones) and, with
    `compare_compile`, torch.compile's; `rounds_faster`: in how many rounds the program was faster."""
    with torch.no_grad():
        eager_ms, stitched_ms = [], []
        for r in range(MEASURE_ROUNDS):
            for side in (("eager", "stitched") if r % 2 == 0 else ("stitched", "eager")):
                if side == "eager":
                    optimized.release()  # the model runs without the program's buffers beside it
                    eager_ms.append(_time_ms(lambda: model(*example_inputs), repeats=MEASURE_REPEATS))
                else:
                    stitched_ms.append(_time_ms(lambda: optimized(*example_inputs), repeats=MEASURE_REPEATS))
        eager, stitched = statistics.median(eager_ms), statistics.median(stitched_ms)
        timing = {"eager_ms": eager, "stitched_ms": stitched, "speedup_eager": eager / stitched,
                  "rounds_faster": sum(s < e for s, e in zip(stitched_ms, eager_ms)), "rounds": MEASURE_ROUNDS}
        if compare_compile:
            try:
                compiled = torch.compile(model)
                compiled(*example_inputs)
                timing["compile_ms"] = _time_ms(lambda: compiled(*example_inputs))
                timing["speedup_compile"] = timing["compile_ms"] / stitched
            except Exception as exc:  # torch.compile may be unavailable (no compiler); say so
                timing["compile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return timing
