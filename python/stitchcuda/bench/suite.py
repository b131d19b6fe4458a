"""`stitchcuda bench suite`, `stitchcuda bench kernelbench` and `stitchcuda bench DIR`: every problem in a
folder of KernelBench-format files (Model, get_inputs, get_init_inputs) through eager PyTorch,
torch.compile (default and mode="reduce-overhead"), `stitchcuda.optimize` and, with --llm, optimize with
the agents, timed in one run, with the outputs checked against eager, memory against eager's, geomean
speed-ups over eager and fast_p per class, per KernelBench level and overall.

Options (flags win over the environment):
  --dir DIR        the folder of problem files (`bench DIR` is the same as `bench kernelbench --dir DIR`).
                   `suite`: STITCHCUDA_SUITE_DIR, else `bench/suite` found by walking up from this file;
                   `kernelbench`: `bench/kernelbench` found the same way (STITCHCUDA_SUITE_DIR does not
                   apply to it, so a shell set up for the suite cannot redirect it silently). The files
                   of its `level<N>` subfolders are problems too (KernelBench's own layout), each row
                   carrying its level.
  --only a,b       file stems to run (STITCHCUDA_SUITE_ONLY); names that match no file are reported.
  --chunk K/N      every N-th problem from the K-th, 1-based (STITCHCUDA_SUITE_CHUNK), for runs that must
                   fit a time limit; N runs cover the folder once.
  --results F      a JSON-lines file: each finished row is appended (and flushed) at once, and a problem
                   already in the file is not run again, so a killed run continues where it stopped (delete
                   a problem's line to measure it again; one file per folder). The table and summary cover
                   every row in the file that matches the selected problems. Only rows made the same
                   way are reused (ROW_SETTINGS: timed, no-compile or compile-only, the same --llm). A file holding
                   rows of another --precision is refused (exit 2): precisions never share a file (a row
                   without a precision is fp32).
  --precision P    fp32 (default), tf32 or bf16: torch's flags for every column of each problem, set around
                   its columns and restored after (precision_flags, TORCH_FLAGS), and optimize(precision=P);
                   outputs are judged under the tolerance for P (verify.tolerance). --compile-only plans with
                   OfflinePlanner(precision=P).
  --llm SPEC       a further column: optimize(model, inputs, llm=SPEC), the agents after the offline plan
                   (agents_ms, agents_correct, speedup_agents, agents_s, agents_run_dir, and per target
                   the winner and every attempt's speed-up over the target's ATen ops).
  --csv FILE       the rows as CSV (CSV_COLUMNS), rewritten after every problem.
  --html FILE      a self-contained HTML report (stitchcuda/bench/html.py; needs matplotlib).
  --no-compile     eager and StitchCUDA only: the two torch.compile columns are skipped (rows of mode
                   "no-compile", never reused by a full run), for quicker runs that diagnose StitchCUDA's
                   own columns (memory, a setting's effect); the compile-based ratios are then absent.
  --compile-only   no timing: each problem is loaded, its FLOPs and bytes counted on the meta device, and
                   captured, planned, lowered and compiled on the CPU (plan_model); runs without a GPU.
  --gpus N         the problems spread over N GPUs of this machine (Spread): N bench processes of this
                   command, the i-th with CUDA_VISIBLE_DEVICES set to the i-th GPU this process sees, each
                   taking the next untaken problem from a shared queue (whole networks first) and writing
                   its rows to its own results file (F.gpu<i> beside --results F, folded into F at the end
                   or by the next run after a kill); the rows are merged in the problems' order and
                   reported once, as one process reports them, with a "gpus" section in the JSON
                   ({gpus, wall_s, per_gpu: [{gpu, device, name, problems, wall_s, exits}], devices}). A
                   process that dies is replaced on its GPU while problems are left; the problem it had
                   taken is an error row ("process") with its exit code and last stderr lines. With
                   --compile-only the processes run on the CPU (CUDA_VISIBLE_DEVICES=""), so N is not
                   bounded by the GPUs. Not with --chunk (exit 2); more GPUs than visible: exit 2.
  --scaling        the selection on 1 GPU, then on --gpus N (default 1), each run from empty compile caches
                   of its own, and a "scaling" section: both walls, speed-up, efficiency = wall_1 /
                   (N x wall_N), and per problem whether the two runs agree (compare_runs: status, failing
                   stages and correctness the same, AGREEMENT_COLUMNS within SPEEDUP_TOLERANCE). Not with
                   --results (exit 2): a resumed run's wall time means nothing.
  --queue DIR      (internal) makes this process one of a --gpus run's: it takes its problems from DIR.
  --json           one JSON object on stdout: {device, suite_dir, precision, torch_flags, tolerance, repeats, resumed,
                   summary: {overall, classes: {name: {...}}}, models: [row, ...]}; without a GPU (exit 3),
                   with no folder, nothing selected or a bad STITCHCUDA_SUITE_CHUNK (exit 2) it is
                   {"error": "..."} (a bad flag is argparse's usage error on stderr, exit 2).

Each row: `class` from the file name's prefix before the first `_` (op: single op, conv: conv + epilogue,
gemm: GEMM + epilogue, net and model: whole network, anything else: other); eager_ms, compile_ms
(torch.compile default), reduce_overhead_ms, best_compile_mode / best_compile_ms (the faster of the two
for this problem), stitch_ms and the speed-ups over eager of each (speedup_*), stitch_vs_best_compile
(best compile ms / StitchCUDA ms), eager_after_ms (eager timed again after StitchCUDA's column, the
program's buffers released: how far the baseline moved within the row); optimize_s (optimize's wall seconds) and, from the first call, the
seconds of both torch.compile modes (*_first_call_s); correctness on three input sets (`input_sets`: the
example inputs and get_inputs() again under torch.manual_seed(1) and (2), each against eager); memory:
eager_peak_bytes (the peak allocated during one warm eager forward, the second, above what was allocated
before it), optimize_peak_bytes (the same around the optimize call; this process's allocations only),
optimize_device_peak_bytes (the GPU's: the larger of that and, over the group checks, this process's
allocations at a check plus what the isolated Verifier worker allocated for it), largest_tensor_bytes (the
largest single input or eager output) and memory_ratio = optimize device peak / (eager peak + 2 x largest
tensor), whose target is <= 1; forward_largest_tensor_bytes (the largest tensor the eager forward makes,
its intermediates included, or its inputs' and outputs') and memory_ratio_forward (the same ratio with it:
the target read as the forward's largest tensor), stage_peak_bytes (the peak so far at the end of each of optimize's stages,
on the same basis, and "check_with_worker": where the peak was reached), program_memory (the report's memory:
the kept program's weights_bytes, shared_weights_bytes, arena_bytes and runner_bytes, all its runner held
after its timed calls), peak_sites (only with STITCHCUDA_MEMORY_SITES=N: the N largest groups of the
blocks alive at optimize()'s peak, by the code that allocated them; bench.memory), stage_seconds
(optimize's wall seconds per stage, from its report), precision_decisions (why a tf32x3 GEMM went to
SGEMM, or a bf16-product one to TF32, stayed there or came back: title -> reason), fallback_reasons (each group left on ATen: group ->
the first line of why); `precision`, and
`matmuls` (the planner's decision: "matmuls in true fp32", "matmuls may use tf32", ...),
`tf32x3_steps` (the program's matmuls that ran as 3xTF32 after the checks), `decisions` (the titles of
optimize()'s decisions: the program variant kept, group checks written in place, GEMMs sent to SGEMM) and
`keep_timing` (optimize()'s own measurement behind keeping the program or the model: eager_ms,
stitched_ms, rounds_faster, rounds).

Error against exact arithmetic (err_fp64): one fp64 reference per problem, a deep copy of the model and
the example inputs cast to float64 on the GPU (fp64_reference; skipped, with the reason in fp64_note,
when the float64 weights, inputs and outputs would exceed FP64_BUDGET_BYTES, or when the model does not
run in float64), and for each column on the example inputs (eager, compile, reduce_overhead, stitch,
agents) {max_abs, max_rel, tolerance_used}: max |got - ref|, that over max |ref| (norm-wise: elementwise
ratios explode near zero), and the largest share of the precision's tolerance (atol + rtol * |ref|) an
element uses (<= 1: within it), the worst output of each. A StitchCUDA that falls back to eager has
eager's error. The summary gives the median max_rel per column and the median ratio StitchCUDA / eager.

Timing: the Verifier's protocol (stitchcuda.verify.measure: CUDA events, warm-up calls first, L2 flushed
and persisting L2 reset before every trial), median of 30. Outputs are compared by the Verifier's
comparator under its tolerance table for the precision (fp32: atol = rtol = 1e-4; tf32 and bf16: 1e-2
for every float output). At fp32 matmuls and cuDNN convolutions run in true fp32 (TF32 off) for every
column, so the comparison and the tolerance are fair; at tf32 and bf16 every column runs with the same
flags (TORCH_FLAGS).
An optimized problem is correct only if all three input sets match; one whose optimize falls back to
eager counts as correct at its eager time (status "eager"); a wrong StitchCUDA result counts as 1x in the
geomeans.

At KernelBench sizes memory decides whether a run finishes: every column's models, outputs and compiled
caches are dropped between columns and problems (torch._dynamo.reset, gc.collect, empty_cache), a CUDA
out-of-memory error is recorded in its column's error like any other exception, and one problem's failure
never stops the run (a sticky CUDA error, such as an illegal address, does poison the process: resume
with --results in a fresh one).

Each problem compiles inside the timed pass (its first call, not timed): on the H200 the 40-model suite
through all four columns takes about two minutes that way. (A pool of processes compiling every model
first was slower there: eight processes contending for the CPUs did not finish 20 models in nine
minutes.) Rows are printed to stderr as `[suite-row] {json}` as they finish, so a run cut short still
reports what it measured.

Roofline: `flops` and `bytes` per row (problem_work, on the meta device): FLOPs by torch's formulas for
matmuls, convolutions and attention and one per element of the largest tensor for every other op that
computes; bytes are the parameters, buffers, inputs and outputs, each moved once. A column's achieved
rate is flops / time, its bandwidth bytes / time.

Summary (per class, per level and overall): models, correct, optimized, geomean speed-ups over eager of
compile default, reduce-overhead, the best compile mode per problem, StitchCUDA and the agents, the
geomeans of StitchCUDA and the agents over the best compile mode, slower_than_eager (problems whose
measured StitchCUDA speed-up is below 0.98), eager_drifted (rows whose eager, timed again after StitchCUDA's
column as eager_after_ms, moved by more than EAGER_DRIFT from eager_ms), optimize_s_median / optimize_s_max, memory_over_target
(problems whose memory_ratio exceeds 1; memory_over_target_forward: whose memory_ratio_forward does), and fast_p: KernelBench's metric, for p = 0, 0.5 and 1, the
share of ALL the problems (those that failed included) whose result is correct and whose speed-up over
the baseline is strictly greater than p — against eager and against the best compile mode.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import gc
import glob
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable

import torch
import torch.utils._pytree as pytree

from ..settings import settings
from . import memory

REPEATS = 30
FRESH_SEEDS = (1, 2)  # the two input sets made again by get_inputs(), beside the example inputs
SLOW = 0.98  # a StitchCUDA speed-up below this is a slowdown, not noise
# eager_after_ms against eager_ms: a move beyond this share (either way) counts in the summary's eager_drifted.
EAGER_DRIFT = 0.03
EXIT_USAGE, EXIT_NO_GPU = 2, 3

# The file name's prefix names the problem's class; the summary is kept per class and overall.
CLASSES = {"op": "single op", "conv": "conv + epilogue", "gemm": "GEMM + epilogue", "net": "whole network",
           "model": "whole network"}
CLASS_ORDER = ("single op", "conv + epilogue", "GEMM + epilogue", "whole network", "other")
BENCHES = ("suite", "kernelbench")  # the folders under bench/ this runner knows by name
LEVEL_FOLDER = re.compile(r"level\d+")
FAST_P = (0.0, 0.5, 1.0)  # the thresholds of fast_p in the summary
ROW_PREFIX = "[suite-row] "  # a finished row on stderr, as one JSON line after this prefix

# --precision: torch's flags for every column of a problem (eager, both torch.compile modes, StitchCUDA),
# and optimize(precision=...) for StitchCUDA. float32_matmul_precision "highest" is allow_tf32 off, "high"
# TF32 matmuls; "medium" lets fp32 matmuls use bf16 where torch has such a path (in torch 2.11 oneDNN's
# CPU matmuls; its CUDA matmuls then use TF32).
TORCH_FLAGS = {"fp32": {"float32_matmul_precision": "highest", "cudnn_allow_tf32": False},
               "tf32": {"float32_matmul_precision": "high", "cudnn_allow_tf32": True},
               "bf16": {"float32_matmul_precision": "medium", "cudnn_allow_tf32": True}}
PRECISION_WORDS = {  # the table's header
    "fp32": "fp32: TF32 off for matmuls and convolutions in every column",
    "tf32": "tf32: TF32 matmuls and cuDNN convolutions in every column, StitchCUDA's matmuls in TF32",
    "bf16": "bf16: torch at float32_matmul_precision 'medium' with cuDNN TF32 in every column, StitchCUDA's "
            "matmuls in bf16"}
# The fp64 reference is skipped when its float64 weights, inputs and outputs would exceed this.
FP64_BUDGET_BYTES = 8 << 30
ERROR_COLUMNS = ("eager", "compile", "reduce_overhead", "stitch", "agents")  # the keys of a row's err_fp64


def problem_class(stem: str) -> str:
    """The class of a problem file's stem: its prefix before the first `_` (none: "other")."""
    prefix, sep, _ = stem.partition("_")
    return CLASSES.get(prefix, "other") if sep else "other"


def _repository_folder(name: str) -> Path | None:
    """The nearest `bench/<name>` above this file (the repository's)."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "bench" / name).is_dir():
            return parent / "bench" / name
    return None


def suite_dir() -> Path | None:
    """STITCHCUDA_SUITE_DIR, else the nearest `bench/suite` above this file (the repository's)."""
    return settings().suite_dir or _repository_folder("suite")


def default_dir(bench: str) -> Path | None:
    """The folder `stitchcuda bench <bench>` runs without --dir."""
    return suite_dir() if bench == "suite" else _repository_folder(bench)


def parse_chunk(chunk: str) -> tuple[int, int]:
    """(K, N) of "K/N" with 1 <= K <= N; ValueError otherwise."""
    k, _, n = chunk.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"--chunk / STITCHCUDA_SUITE_CHUNK must be K/N with 1 <= K <= N, got {chunk!r}")
    return int(k), int(n)


def _only_names(only: str | None) -> set[str]:
    return {s.strip() for s in (only or "").split(",") if s.strip()}


def problem_level(path: Path) -> str | None:
    """The KernelBench level a problem file belongs to: the name of its folder when that is `level<N>`
    (KernelBench's own layout: level1/ single ops, level2/ fusions, level3/ whole networks), else None."""
    return path.parent.name if LEVEL_FOLDER.fullmatch(path.parent.name) else None


def _problem_paths(folder: Path) -> list[Path]:
    """Every problem file of `folder`: its own *.py, then those of its `level<N>` subfolders in level
    order, each folder sorted by name, so KernelBench's top folder runs whole (a leading underscore marks
    a helper, not a problem)."""
    levels = sorted((d for d in folder.iterdir() if d.is_dir() and LEVEL_FOLDER.fullmatch(d.name)),
                    key=lambda d: _level_key(d.name))
    return [p for d in [folder, *levels] for p in sorted(d.glob("*.py")) if not p.name.startswith("_")]


def model_files(folder: Path, only: str | None = None, chunk: str | None = None) -> list[Path]:
    """The folder's problem files (with those of its `level<N>` subfolders), sorted; `only` is a
    comma-separated list of stems; `chunk` "K/N" keeps every N-th file from the K-th (1-based), so N
    runs cover the folder once, each with a mix of kinds."""
    files = _problem_paths(folder)
    wanted = _only_names(only)
    if wanted:
        files = [p for p in files if p.stem in wanted]
    if chunk:
        try:
            k, n = parse_chunk(chunk)
        except ValueError as exc:
            raise SystemExit(f"bench suite: {exc}") from None
        files = files[k - 1::n]
    return files


def load(path: Path) -> ModuleType:
    """Imports a KernelBench-format file (Model, get_inputs, get_init_inputs) as a module."""
    spec = importlib.util.spec_from_file_location(f"stitchcuda_suite_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(module, name):
            raise AttributeError(f"{path.name} has no {name} (KernelBench format: Model, get_inputs, get_init_inputs)")
    return module


def _time_ms(fn: Callable[[], Any], warmup: int = 3, repeats: int = REPEATS) -> float:
    from ..verify import measure

    return measure(fn, repeats=repeats, warmup=warmup).median_ms


def _tolerance(precision: str = "fp32") -> tuple[float, float]:
    """(atol, rtol) for an fp32 output at `precision` (the Verifier's table)."""
    from ..verify.tolerance import tolerance

    return tolerance(torch.float32, precision)


# torch's per-backend fp32_precision settings, the API beside the legacy flags (where this torch has them).
_PRECISION_KNOBS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
                    "mkldnn.rnn")


def _precision_knobs() -> list[Any]:
    knobs = []
    for path in _PRECISION_KNOBS:
        knob: Any = torch.backends
        for part in filter(None, path.split(".")):
            knob = getattr(knob, part, None)
        if knob is not None and hasattr(knob, "fp32_precision"):
            knobs.append(knob)
    return knobs


def _readable(get: Callable[[], Any]) -> Any:
    """A legacy flag's value, or None where torch refuses to read it (it was set through both APIs)."""
    try:
        return get()
    except RuntimeError:
        return None


@contextlib.contextmanager
def precision_flags(precision: str):
    """torch's flags at `precision` (TORCH_FLAGS) for the block, restored on the way out, also when the
    block raises. Both of torch's APIs are saved: the legacy flags (float32_matmul_precision,
    cudnn.allow_tf32) and the per-backend fp32_precision settings they shadow, so the caller's settings
    come back as they were (a state that already mixed the two APIs, which torch refuses to read, reads
    consistently afterwards, with the same per-backend settings). Yields the flags."""
    if precision not in TORCH_FLAGS:
        raise ValueError(f"precision must be one of {', '.join(TORCH_FLAGS)}, not {precision!r}")
    flags = TORCH_FLAGS[precision]
    knobs = _precision_knobs()
    saved = [knob.fp32_precision for knob in knobs]
    matmul = _readable(torch.get_float32_matmul_precision)
    cudnn = _readable(lambda: torch.backends.cudnn.allow_tf32)
    try:
        torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
        torch.backends.cudnn.allow_tf32 = flags["cudnn_allow_tf32"]
        yield flags
    finally:
        if matmul is not None:
            torch.set_float32_matmul_precision(matmul)
        if cudnn is not None:
            torch.backends.cudnn.allow_tf32 = cudnn
        for knob, value in zip(knobs, saved):
            knob.fp32_precision = value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _compare(got: Any, want: Any, precision: str = "fp32") -> tuple[bool, float, str]:
    """(all close, max |error|, what differs first) for two output structures, by the Verifier's
    comparator and its tolerance table at `precision`."""
    from ..verify.compare import first_difference, largest_error, max_abs_error
    from ..verify.tolerance import tolerance

    got_flat, want_flat = pytree.tree_flatten(got)[0], pytree.tree_flatten(want)[0]
    if len(got_flat) != len(want_flat):
        return False, math.inf, f"{len(got_flat)} outputs, eager has {len(want_flat)}"
    worst, ok, detail = 0.0, True, ""
    for i, (g, w) in enumerate(zip(got_flat, want_flat)):
        if not isinstance(w, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            return False, math.inf, f"output {i}: {getattr(g, 'dtype', type(g))} {list(getattr(g, 'shape', []))}, " \
                                    f"eager {w.dtype} {list(w.shape)}"
        worst = max(worst, max_abs_error(g, w))
        if ok and first_difference(str(i), g, w, *tolerance(w.dtype, precision)) is not None:
            ok = False
            err, idx = largest_error(g, w)
            detail = (f"output {i}: max |error| {err:.3g} at flat index {idx} (eager "
                      f"{w.flatten()[idx].item():.6g}, StitchCUDA {g.flatten()[idx].item():.6g})")
    return ok, worst, detail


# ---- memory ----


def _free_gpu() -> None:
    """Drops what one column or problem left: compiled caches (they hold the model), cycles (an exception's
    frames hold its tensors), and the allocator's cached blocks, so the next problem starts empty."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def _peak_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn's result, the most bytes allocated while it ran above what was allocated before it)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - before


def largest_tensor_bytes(*structures: Any) -> int:
    """The bytes of the largest single tensor in the given (nested) inputs and outputs."""
    tensors = [t for s in structures for t in pytree.tree_flatten(s)[0] if isinstance(t, torch.Tensor)]
    return max((t.numel() * t.element_size() for t in tensors), default=0)


def forward_largest_tensor_bytes(model: torch.nn.Module, inputs: tuple) -> int:
    """The bytes of the largest tensor one eager forward of `model` makes (every ATen op's result, the
    intermediates included), at least its inputs' largest."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.largest = max(self.largest, largest_tensor_bytes(out))
            return out

    mode = Largest()
    mode.largest = largest_tensor_bytes(inputs)
    with torch.no_grad(), mode:
        model(*inputs)
    return mode.largest


def memory_ratio(optimize_peak: int | None, eager_peak: int | None, largest: int | None) -> float | None:
    """optimize peak / (eager peak + 2 x largest tensor): optimize may hold the model's working set plus an
    input and an output copy (a reference and a candidate) before it costs more than the target of 1."""
    if optimize_peak is None or eager_peak is None or largest is None:
        return None
    budget = eager_peak + 2 * largest
    return optimize_peak / budget if budget > 0 else None


# ---- error against exact arithmetic ----


def _float64(value: Any) -> Any:
    return pytree.tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def _fp64_bytes(*structures: Any) -> int:
    """The bytes of the tensors in `structures` once every floating one is float64."""
    tensors = [t for s in structures for t in pytree.tree_flatten(s)[0] if isinstance(t, torch.Tensor)]
    return sum(t.numel() * (8 if t.is_floating_point() else t.element_size()) for t in tensors)


def fp64_reference(model: torch.nn.Module, inputs: tuple, outputs: Any,
                   budget: int = FP64_BUDGET_BYTES) -> tuple[Any, str]:
    """(the model's outputs on `inputs` in float64, in host memory; a note, "" or what the reference is
    not) from a deep copy of the model and the inputs cast to float64 on their device; or (None, why
    there is none): the float64 weights, inputs and `outputs` (eager's) would take more than `budget`
    bytes, or the model cannot be copied to or run in float64. The copy is dropped before returning."""
    need = _fp64_bytes([*model.parameters(), *model.buffers()], inputs, outputs)
    if need > budget:
        return None, (f"skipped: the float64 weights, inputs and outputs would take {need / 2**30:.1f} GiB, above the "
                      f"{budget / 2**30:g} GiB budget")
    try:
        wide = copy.deepcopy(model).double()
    except Exception as exc:
        return None, f"skipped: the model cannot be copied to float64 ({_first_line(exc)})"
    try:
        with torch.no_grad():
            ref = wide(*_float64(inputs))
    except Exception as exc:  # an op without a float64 kernel, a tensor the model makes in fp32, out of memory
        return None, f"skipped: the model does not run in float64 ({_first_line(exc)})"
    finally:
        del wide
    flat = pytree.tree_flatten(ref)[0]
    narrow = [i for i, t in enumerate(flat)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64]
    note = (f"output(s) {narrow} are {flat[narrow[0]].dtype} in the float64 run (the model casts): their error is "
            "against that" if narrow else "")
    return pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, ref), note


def fp64_errors(got: Any, ref: Any, precision: str = "fp32") -> dict | None:
    """{max_abs, max_rel, tolerance_used} of `got` (a column's outputs) against `ref` (fp64_reference's),
    the worst floating output of each: max |got - ref|; that over max |ref| (norm-wise: elementwise ratios
    explode near zero); the largest share of atol + rtol * |ref| an element uses, under the tolerance
    for the output's dtype at `precision` (<= 1: within it). Computed on got's device, in slices.
    None when the reference has no floating output; infinite when the outputs differ in number or shape."""
    from ..verify.compare import CHUNK_ELEMENTS, abs_error, tolerance_used
    from ..verify.tolerance import tolerance

    got_flat, ref_flat = pytree.tree_flatten(got)[0], pytree.tree_flatten(ref)[0]
    floats = [i for i, r in enumerate(ref_flat) if isinstance(r, torch.Tensor) and r.is_floating_point()]
    if not floats:
        return None
    out = {"max_abs": 0.0, "max_rel": 0.0, "tolerance_used": 0.0}
    if len(got_flat) != len(ref_flat):
        return dict.fromkeys(out, math.inf)
    for i in floats:
        g, r = got_flat[i], ref_flat[i]
        if not isinstance(g, torch.Tensor) or g.shape != r.shape:
            return dict.fromkeys(out, math.inf)
        atol, rtol = tolerance(g.dtype if g.is_floating_point() else torch.float32, precision)
        g_flat, r_flat = g.detach().reshape(-1), r.reshape(-1)
        worst = scale = used = 0.0
        for start in range(0, r_flat.numel(), CHUNK_ELEMENTS):
            rc, gc = r_flat[start:start + CHUNK_ELEMENTS].to(g.device), g_flat[start:start + CHUNK_ELEMENTS]
            worst = max(worst, float(abs_error(gc, rc).max()))
            finite = rc[torch.isfinite(rc)]
            if finite.numel():
                scale = max(scale, float(finite.abs().max()))
            used = max(used, tolerance_used(gc, rc, atol, rtol))
        out["max_abs"] = max(out["max_abs"], worst)
        out["max_rel"] = max(out["max_rel"], worst / scale if scale > 0 else worst)
        out["tolerance_used"] = max(out["tolerance_used"], used)
    return out


def _record_error(row: dict, column: str, got: Any, reference: Any) -> None:
    """The column's error against the fp64 reference into row["err_fp64"] (nothing without a reference)."""
    if reference is None:
        return
    try:
        errors = fp64_errors(got, reference, row.get("precision", "fp32"))
    except Exception as exc:  # out of memory for a slice: the column has no error, the row says why
        row.setdefault("fp64_errors", {})[column] = _first_line(exc)
        return
    if errors is not None:
        row["err_fp64"][column] = errors


def _fp64_column(row: dict, model: torch.nn.Module, inputs: tuple, want: Any) -> Any:
    """The problem's fp64 reference (fp64_reference) and eager's error against it; records err_fp64
    (None when there is no reference) and fp64_note. Returns the reference or None."""
    try:
        reference, note = fp64_reference(model, inputs, want)
    except Exception as exc:  # a bug here is the row's note, never the run's end
        reference, note = None, f"skipped: {_first_line(exc)}"
    _free_gpu()  # the float64 copy of the model
    row["err_fp64"] = {} if reference is not None else None
    if note:
        row["fp64_note"] = note
    _record_error(row, "eager", want, reference)
    return reference


# Where _compiled_ms hands the first call's output: reduce-overhead's output lives in its CUDA graph's pool
# and the next replay overwrites it, so its error is taken there, before the timing.
_FIRST_OUTPUT: contextvars.ContextVar[Callable[[Any], None] | None] = contextvars.ContextVar("first_output",
                                                                                           default=None)


@contextlib.contextmanager
def _first_output_to(receive: Callable[[Any], None] | None):
    token = _FIRST_OUTPUT.set(receive)
    try:
        yield
    finally:
        _FIRST_OUTPUT.reset(token)


# ---- work: FLOPs and bytes for the roofline ----


def _work_meter() -> Any:
    """A dispatch mode counting one forward's FLOPs: torch's formulas where it has one (matmuls,
    convolutions, attention), else one per element of the op's largest tensor (elementwise ops,
    reductions, norms: an estimate). Views and other aliasing ops count nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class WorkMeter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.flops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            packet = func._overloadpacket
            if packet in flop_registry:
                self.flops += int(flop_registry[packet](*args, **kwargs, out_val=out))
            elif not any(r.alias_info is not None for r in func._schema.returns):
                sizes = [t.numel() for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
                self.flops += max(sizes, default=0)
            return out

    return WorkMeter()


def problem_work(module: ModuleType) -> dict:
    """{flops, bytes} of one forward, from the model and inputs built on the meta device (no memory, no
    GPU): `bytes` is the traffic no implementation avoids — parameters, buffers, inputs and outputs, each
    read or written once — so bytes / time is the bandwidth a problem achieved and FLOPs / time its
    compute rate, the two axes of the roofline."""
    with torch.device("meta"):
        torch.manual_seed(0)
        model = module.Model(*module.get_init_inputs()).eval()
        inputs = [torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) and t.device.type != "meta"
                  else t for t in module.get_inputs()]  # a tensor made outside the device context
    meter = _work_meter()
    with torch.no_grad(), meter:
        out = model(*inputs)
    unique = {id(t): t for t in [*model.parameters(), *model.buffers(), *pytree.tree_leaves((inputs, out))]
              if isinstance(t, torch.Tensor)}
    return {"flops": meter.flops, "bytes": sum(t.numel() * t.element_size() for t in unique.values())}


def _record_work(row: dict, module: ModuleType) -> None:
    try:
        row.update(problem_work(module))
    except Exception as exc:  # an op without a meta kernel: the roofline leaves this problem out
        row["work_error"] = _first_line(exc)


# ---- one problem ----


def _to_gpu(inputs: Iterable[Any]) -> tuple:
    return tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs)


def _on_gpu(path: Path) -> tuple[ModuleType, torch.nn.Module, tuple]:
    """The file's module, its model (seed 0, eval mode) and example inputs, on the GPU."""
    module = load(path)
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).cuda().eval()
    return module, model, _to_gpu(module.get_inputs())


def _clone(out: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


def _eager(row: dict, model: torch.nn.Module, inputs: tuple) -> Any:
    """Eager's reference outputs; records eager_ms, eager_peak_bytes and largest_tensor_bytes."""
    with torch.no_grad():
        want = _clone(model(*inputs))  # the first call also allocates the libraries' lazy workspaces

        def forward() -> None:  # its output is counted in the peak, then dropped
            model(*inputs)

        # The peak of a second, warm forward: eager's steady working set, output included.
        _, row["eager_peak_bytes"] = _peak_bytes(forward)
        row["largest_tensor_bytes"] = largest_tensor_bytes(inputs, want)
        row["forward_largest_tensor_bytes"] = forward_largest_tensor_bytes(model, inputs)
        row["eager_ms"] = _time_ms(lambda: model(*inputs))
    return want


def _compiled_ms(model, inputs, mode: str | None) -> tuple[float, float]:
    """(median milliseconds per call, seconds the first call took: compilation, from the caches if warm)."""
    torch._dynamo.reset()  # a fresh cache per model and mode: no recompilation limits, no cross-talk
    compiled = torch.compile(model, mode=mode) if mode else torch.compile(model)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = compiled(*inputs)  # compiles (and, for reduce-overhead, starts recording CUDA graphs)
        first_s = time.perf_counter() - t0
        receive = _FIRST_OUTPUT.get()
        if receive is not None:
            receive(out)
        del out
        return _time_ms(lambda: compiled(*inputs), warmup=5), first_s


def _compile_columns(row: dict, model: torch.nn.Module, inputs: tuple, reference: Any = None) -> None:
    for key, mode in (("compile_ms", None), ("reduce_overhead_ms", "reduce-overhead")):
        column = key.removesuffix("_ms")
        receive = (lambda out, column=column: _record_error(row, column, out, reference)) if reference is not None \
            else None
        try:
            with _first_output_to(receive):
                row[key], first_s = _compiled_ms(model, inputs, mode)
            row[key.removesuffix("_ms") + "_first_call_s"] = round(first_s, 2)
        except Exception as exc:  # no compiler toolchain, a dynamo failure, out of memory: the row says so
            row["errors"][key.removesuffix("_ms")] = _first_line(exc)
        _free_gpu()  # the compiled graphs (and reduce-overhead's CUDA-graph pool) go before the next column


def _check_set(name: str, run: Callable[[], tuple[Any, Any]], precision: str = "fp32") -> dict:
    """One input set's verdict; `run` returns (StitchCUDA's outputs, eager's). Errors are the verdict."""
    try:
        with torch.no_grad():
            got, want = run()
            ok, worst, detail = _compare(got, want, precision)
    except Exception as exc:  # out of memory on a fresh set, a failing replay: this set is not correct
        return {"inputs": name, "correct": False, "error": _first_line(exc)}
    entry: dict[str, Any] = {"inputs": name, "correct": ok, "max_abs_error": worst}
    if detail:
        entry["mismatch"] = detail
    return entry


def _fresh_set(module: ModuleType, model: torch.nn.Module, fast: Any, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    inputs = _to_gpu(module.get_inputs())
    want = _clone(model(*inputs))  # before StitchCUDA's call, in case either writes into its inputs
    return fast(*inputs), want


def _input_sets(module: ModuleType, model: torch.nn.Module, fast: Any, inputs: tuple, want: Any,
                precision: str = "fp32") -> list[dict]:
    """StitchCUDA against eager on the example inputs and on get_inputs() under each of FRESH_SEEDS: a
    program that is right for one set of values only (a stale buffer, a baked-in constant) fails here.
    Judged under the tolerance for `precision`."""
    sets = [_check_set("example", lambda: (fast(*inputs), want), precision)]
    for seed in FRESH_SEEDS:
        sets.append(_check_set(f"seed={seed}", lambda seed=seed: _fresh_set(module, model, fast, seed), precision))
        gc.collect()  # the fresh set's tensors and outputs go before the next one
    return sets


def _matmul_decision(report: Any) -> str | None:
    """The planner's decision on matmul precision ("matmuls in true fp32", "matmuls may use tf32", ...)."""
    return next((d for d, _ in getattr(report, "decisions", None) or [] if str(d).startswith("matmuls")), None)


def _record_report(row: dict, fast: Any) -> None:
    report = fast.report
    kinds = sorted({g["kind"] for g in report.groups})
    row.update(status=report.status, reason=report.reason, fallbacks=len(report.fallbacks),
               groups={k: sum(g["kind"] == k for g in report.groups) for k in kinds})
    if report.fallbacks:
        # Which groups stayed on ATen and why, a line each: a group whose check failed decides a row's speed
        # (one elementwise group on ATen is the whole op), and the report is not kept.
        row["fallback_reasons"] = {str(f.get("group")): str(f.get("reason", "")).splitlines()[0][:300]
                                   for f in report.fallbacks}
    matmuls = _matmul_decision(report)
    if matmuls:
        row["matmuls"] = matmuls
    if getattr(report, "memory", None):
        row["program_memory"] = dict(report.memory)  # what the kept program holds: weights, arena, runner
    # What optimize() decided, by title (the variant kept, checks written in place, GEMMs sent to SGEMM):
    # the reasons stay in the report; the row keeps a line each to read a run's results by.
    row["decisions"] = [str(d[0]) for d in getattr(report, "decisions", None) or []]
    # A GEMM's precision changed by a check (tf32x3 sent to SGEMM or bf16 products to TF32, kept there, or
    # restored): the reason too, the detail of the mismatch that decided it (a row's speed depends on it,
    # and the report is not kept).
    from ..graph.optimize import PRECISION_TITLES

    precision = {str(d[0]): str(d[1]) for d in getattr(report, "decisions", None) or []
                 if str(d[0]).endswith(PRECISION_TITLES)}
    if precision:
        row["precision_decisions"] = precision
    if getattr(report, "stage_seconds", None):
        # Where optimize_s went (capture, planning, generating and checking, building, verifying, ...).
        row["stage_seconds"] = {stage: round(float(s), 3) for stage, s in report.stage_seconds.items()}
    timing = getattr(report, "timing", None) or {}
    if "stitched_ms" in timing:
        # optimize()'s own keep-or-eager measurement, beside the column's: where the two disagree (a program
        # kept as faster that the column times slower), the row shows by how much.
        row["keep_timing"] = {k: timing[k] for k in ("eager_ms", "stitched_ms", "rounds_faster", "rounds")
                              if k in timing}
    if fast.program is not None:
        row["replay"] = fast.program.replay["mode"]  # graph or direct, as measured by optimize
        # What ran, not what was planned: a tf32x3 GEMM that missed its check runs as SGEMM.
        row["tf32x3_steps"] = sum(s["kind"] == "matmul" and s.get("precision") == "tf32x3" for s in fast.program.steps)


def _stitch_column(row: dict, module: ModuleType, model: torch.nn.Module, inputs: tuple, want: Any,
                   reference: Any = None) -> None:
    from ..graph import optimize

    precision = row.get("precision", "fp32")
    try:
        t0 = time.perf_counter()
        base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        sites = settings().memory_sites  # allocation sites of optimize()'s peak to keep (bench.memory); 0: none
        with memory.recording() if sites else contextlib.nullcontext():
            fast, row["optimize_peak_bytes"] = _peak_bytes(lambda: optimize(model, inputs, measure=False,
                                                                            progress=False, precision=precision))
            if sites:  # where optimize's peak came from (recording stacks slows it: optimize_s is not comparable)
                row["peak_sites"] = memory.peak_sites(torch.cuda.memory._snapshot(), top=sites)
        row["optimize_s"] = time.perf_counter() - t0
        # Where optimize's peak was reached: the peak so far at the end of each of its stages, above what
        # was allocated before it (the first stage that reaches optimize_peak_bytes holds the peak).
        row["stage_peak_bytes"] = {stage: peak - base
                                   for stage, peak in (getattr(fast.report, "stage_peak_bytes", None) or {}).items()}
        # The GPU's, not this process's: a group check's isolated worker allocates beside what this
        # process holds at the check.
        row["optimize_device_peak_bytes"] = max(row["optimize_peak_bytes"],
                                                row["stage_peak_bytes"].get("check_with_worker", 0))
        row["memory_ratio"] = memory_ratio(row["optimize_device_peak_bytes"], row.get("eager_peak_bytes"),
                                           row.get("largest_tensor_bytes"))
        row["memory_ratio_forward"] = memory_ratio(row["optimize_device_peak_bytes"], row.get("eager_peak_bytes"),
                                                   row.get("forward_largest_tensor_bytes"))
        _record_report(row, fast)
        if fast.report.status == "optimized":
            sets = _input_sets(module, model, fast, inputs, want, precision)
            errors = [s["max_abs_error"] for s in sets if "max_abs_error" in s]
            row.update(input_sets=sets, correct=all(s["correct"] for s in sets),
                       max_abs_error=max(errors) if errors else None)
            wrong = next((s for s in sets if not s["correct"]), None)
            if wrong is not None:
                row["mismatch"] = f"{wrong['inputs']}: {wrong.get('mismatch') or wrong.get('error')}"
            with torch.no_grad():
                if reference is not None:
                    _record_error(row, "stitch", fast(*inputs), reference)
                row["stitch_ms"] = _time_ms(lambda: fast(*inputs))
                # Eager again, last and without the program's buffers beside it: eager_ms was taken before
                # the compile columns, and a drift between the two (clocks, what those columns leave
                # behind) shows here instead of hiding in the speed-up.
                fast.release()
                row["eager_after_ms"] = _time_ms(lambda: model(*inputs))
        else:  # the original model runs: correct by construction on every set, at eager speed
            row.update(correct=True, stitch_ms=row["eager_ms"], max_abs_error=0.0,
                       input_sets=[{"inputs": n, "correct": True, "max_abs_error": 0.0, "eager_fallback": True}
                                   for n in ("example", *(f"seed={s}" for s in FRESH_SEEDS))])
            if (row.get("err_fp64") or {}).get("eager") is not None:
                row["err_fp64"]["stitch"] = dict(row["err_fp64"]["eager"])  # eager's outputs, eager's error
    except Exception as exc:  # out of memory in optimize, a failing replay: the row says so
        row["errors"]["stitchcuda"] = _first_line(exc)
        row["traceback"] = traceback.format_exc(limit=6)
        row["correct"] = False


def add_speedups(row: dict) -> dict:
    """The row's best compile mode and its speed-ups over eager (and StitchCUDA's over the best mode)."""
    modes = [(row[k], mode) for k, mode in (("compile_ms", "default"), ("reduce_overhead_ms", "reduce-overhead"))
             if row.get(k)]
    if modes:
        row["best_compile_ms"], row["best_compile_mode"] = min(modes)
    for key, name in (("compile_ms", "speedup_compile"), ("reduce_overhead_ms", "speedup_reduce_overhead"),
                      ("best_compile_ms", "speedup_best_compile"), ("stitch_ms", "speedup_stitch"),
                      ("agents_ms", "speedup_agents")):
        if row.get(key) and row.get("eager_ms"):
            row[name] = row["eager_ms"] / row[key]
    for key, name in (("stitch_ms", "stitch_vs_best_compile"), ("agents_ms", "agents_vs_best_compile")):
        if row.get(key) and row.get("best_compile_ms"):
            row[name] = row["best_compile_ms"] / row[key]
    return row


def _attempt_speedups(target_dir: str) -> list[float | None]:
    """Each finished attempt's speed-up over the target's ATen ops, in order (None: not correct, or a
    hack), from the target's run directory."""
    from ..agents.cli import _attempt_records

    out: list[float | None] = []
    for record in _attempt_records(Path(target_dir)):
        report = record.get("report") or {}
        hack = any(f.get("severity") == "major" for f in report.get("findings") or [])
        ok = report.get("correct") and not report.get("static_only") and not hack
        out.append(float(report["speedup_eager"]) if ok and report.get("speedup_eager") else None)
    return out


def _target_entry(target: dict) -> dict:
    """One agents' target as the row keeps it: the winner, each candidate's speed-up, and every attempt's."""
    llm, template = target.get("llm") or {}, target.get("template") or {}
    return {"target": target.get("target"), "ops": target.get("ops"), "winner": target.get("winner"),
            "template_speedup": template.get("speedup") if template.get("correct") else None,
            "llm_speedup": llm.get("speedup"), "llm_attempt": llm.get("attempt"),
            "attempts": _attempt_speedups(target["run_dir"]) if target.get("run_dir") else []}


def _agents_column(row: dict, module: ModuleType, model: torch.nn.Module, inputs: tuple, want: Any, llm: str,
                   reference: Any = None) -> None:
    """optimize(llm=...): the agents after the offline plan. The same three input sets and timer as the
    StitchCUDA column; the targets with each attempt's speed-up (from the run directory)."""
    from .. import _C
    from ..graph import optimize

    try:
        t0 = time.perf_counter()
        # Named after the problem file (every KernelBench model is a `Model`): runs/<UTC time>-<stem>.
        run_dir = _C.agents.fresh_run_path("runs", row["model"])
        precision = row.get("precision", "fp32")
        fast = optimize(model, inputs, llm=llm, measure=False, progress=False, run_dir=run_dir, precision=precision)
        row["agents_s"] = time.perf_counter() - t0
        report = fast.report
        row.update(agents_status=report.status, agents_run_dir=report.run_dir,
                   agents_targets=[_target_entry(t) for t in report.targets])
        if report.status == "optimized":
            sets = _input_sets(module, model, fast, inputs, want, precision)
            row.update(agents_input_sets=sets, agents_correct=all(s["correct"] for s in sets))
            with torch.no_grad():
                if reference is not None:
                    _record_error(row, "agents", fast(*inputs), reference)
                row["agents_ms"] = _time_ms(lambda: fast(*inputs))
        else:  # the original model runs
            row.update(agents_correct=True, agents_ms=row.get("eager_ms"), agents_reason=report.reason)
            if (row.get("err_fp64") or {}).get("eager") is not None:
                row["err_fp64"]["agents"] = dict(row["err_fp64"]["eager"])
    except Exception as exc:  # a backend that cannot be reached, out of memory: the row says so
        row["errors"]["agents"] = _first_line(exc)
        row["agents_correct"] = False


def _new_row(path: Path, mode: str, precision: str = "fp32") -> dict:
    row: dict[str, Any] = {"model": path.stem, "class": problem_class(path.stem), "mode": mode,
                           "precision": precision, "errors": {}}
    level = problem_level(path)
    if level:
        row["level"] = level
    return row


def run_model(path: Path, llm: str | None = None, precision: str = "fp32", compile_columns: bool = True) -> dict:
    """One problem's row: times, speed-ups, correctness, memory, report status, FLOPs and bytes, every
    column's error against an fp64 reference; with `llm`, the agents' column too. `precision`: what
    optimize() gets and which tolerance judges the outputs; torch's flags are the caller's
    (precision_flags). `compile_columns=False` (--no-compile) skips both torch.compile columns (mode
    "no-compile"). Errors recorded, never raised. The caller frees the GPU after it (its tensors die
    with this frame)."""
    row = _new_row(path, "timed" if compile_columns else "no-compile", precision)
    if llm:
        row["llm"] = llm
    try:
        module, model, inputs = _on_gpu(path)
        want = _eager(row, model, inputs)
    except Exception as exc:  # the model itself does not load or run: nothing else can be measured
        row["errors"]["eager"] = _first_line(exc)
        row["correct"] = False
        return row
    _record_work(row, module)
    reference = _fp64_column(row, model, inputs, want)
    if compile_columns:
        _compile_columns(row, model, inputs, reference)
    _stitch_column(row, module, model, inputs, want, reference)
    if llm:
        _free_gpu()
        _agents_column(row, module, model, inputs, want, llm, reference)
    return add_speedups(row)


def plan_model(path: Path, precision: str = "fp32") -> dict:
    """One problem's row without timing (--compile-only, e.g. on a machine without a GPU): the file
    loads, its FLOPs and bytes are counted on the meta device, and graph mode captures, plans (with
    OfflinePlanner(precision=precision)), lowers and compiles every kernel with NVRTC on the CPU, as
    optimize() does where there is no GPU. Nothing runs on a GPU: no times, no speed-ups, `correct`
    None (unknown). The model and inputs are built on the CPU, so this suits problems that fit in host
    memory."""
    from ..graph.optimize import _plan_only
    from ..graph.report import Report

    row = _new_row(path, "compile-only", precision)
    try:
        module = load(path)
        _record_work(row, module)
        torch.manual_seed(0)
        model = module.Model(*module.get_init_inputs()).eval()
        inputs = tuple(module.get_inputs())
    except Exception as exc:  # the model itself does not load or build
        row["errors"]["eager"] = _first_line(exc)
        row["correct"] = False
        return row
    report = Report()
    t0 = time.perf_counter()
    _plan_only(model, inputs, precision, True, report)  # never raises: a failure is in the reason
    row["optimize_s"] = time.perf_counter() - t0
    kinds = sorted({g["kind"] for g in report.groups})
    row.update(status="compiled" if report.groups else "not compiled", reason=report.reason.lstrip("; "),
               groups={k: sum(g["kind"] == k for g in report.groups) for k in kinds},
               kernels=len(report.kernels), correct=None)
    matmuls = _matmul_decision(report)
    if matmuls:
        row["matmuls"] = matmuls
    if not report.groups:
        row["errors"]["stitchcuda"] = row["reason"][:300]
    return row


def _run_one(path: Path, llm: str | None = None, compile_only: bool = False, precision: str = "fp32",
             no_compile: bool = False) -> dict:
    """run_model (or plan_model), and whatever escapes it (a bug here, not in the problem) as the row's
    error."""
    extra = {"precision": precision} if precision != "fp32" else {}
    timed = {**extra, "compile_columns": False} if no_compile else extra
    try:
        row = plan_model(path, **extra) if compile_only else run_model(path, llm, **timed) if llm else \
            run_model(path, **timed)
    except Exception as exc:
        row = {**_new_row(path, _mode(compile_only, no_compile), precision), "correct": False,
               "errors": {"bench": _first_line(exc)}, "traceback": traceback.format_exc(limit=6)}
        if llm and not compile_only:
            row["llm"] = llm
    _free_gpu()
    return row


# ---- results file (resume) ----


def jsonable(value: Any) -> Any:
    """`value` with non-finite floats (an output of the wrong shape has an infinite error) as None, so
    every line and object printed is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def _dumps(value: Any) -> str:
    return json.dumps(jsonable(value), default=str, allow_nan=False)


def _mode(compile_only: bool, no_compile: bool) -> str:
    """A row's mode: how it was measured (ROW_SETTINGS)."""
    return "compile-only" if compile_only else "no-compile" if no_compile else "timed"


# What a row was measured with: a resumed run reuses only rows made the same way (a compile-only row
# is no timed measurement; a row without the agents is not one with them). Rows of older files have no
# such keys and read as these defaults. A file never mixes precisions (precision_conflict).
ROW_SETTINGS = {"mode": "timed", "llm": None, "precision": "fp32"}


def row_settings(row: dict) -> dict:
    return {key: row.get(key, default) for key, default in ROW_SETTINGS.items()}


def read_results(path: Path, settings: dict | None = None) -> dict[str, dict]:
    """The rows already in a results file, by problem (a later line wins); with `settings`, only rows
    made with them (row_settings). A line that does not parse (the last one, cut short by a killed run)
    is skipped, so that problem runs again."""
    rows: dict[str, dict] = {}
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("model"), str):
            if settings is None or row_settings(row) == {**ROW_SETTINGS, **settings}:
                rows[row["model"]] = row
    return rows


def _part_files(results: Path) -> list[Path]:
    """The files a --gpus run's processes write beside `results` (F.gpu0, F.gpu1, ...), sorted."""
    if not results.parent.is_dir():
        return []
    return sorted(p for p in results.parent.glob(glob.escape(results.name) + ".gpu*")
                  if PART.fullmatch(p.name[len(results.name):]))


def precision_conflict(results: Path, precision: str) -> str | None:
    """Why `results` cannot take rows of `precision`: it (or a file a killed --gpus run left beside it)
    holds rows of another precision (a row without one is fp32). None when it can."""
    others: dict[str, int] = {}
    for path in [results, *_part_files(results)]:
        for row in read_results(path).values():
            other = row.get("precision") or "fp32"
            if other != precision:
                others[other] = others.get(other, 0) + 1
    if not others:
        return None
    held = ", ".join(f"{n} at {p}" for p, n in sorted(others.items()))
    first = sorted(others)[0]
    return (f"--results {results} holds rows of another precision ({held}) and this run is --precision {precision}: "
            f"rows of different precisions never share a results file; pass another --results file, or "
            f"--precision {first} to continue that run")


# ---- CSV ----

# The CSV's columns: one line per problem, the row's numbers and verdicts (the JSON-lines file keeps
# everything, the input sets and agents' targets too).
# err_fp64_<column>_<max_abs|max_rel>: a column's error against the fp64 reference (row["err_fp64"]).
_ERROR_CSV = {f"err_fp64_{c}_{stat}": (c, stat) for c in ERROR_COLUMNS[:4] for stat in ("max_abs", "max_rel")}
CSV_COLUMNS = ("model", "level", "class", "mode", "precision", "llm", "status", "correct", "eager_ms", "compile_ms",
               "reduce_overhead_ms", "best_compile_mode", "best_compile_ms", "stitch_ms", "eager_after_ms", "agents_ms",
               "speedup_compile", "speedup_reduce_overhead", "speedup_best_compile", "speedup_stitch",
               "speedup_agents", "stitch_vs_best_compile", "agents_vs_best_compile", "agents_correct",
               "optimize_s", "agents_s", "fallbacks", "kernels", "max_abs_error", *_ERROR_CSV, "fp64_note", "flops",
               "bytes", "eager_peak_bytes", "optimize_peak_bytes", "optimize_device_peak_bytes", "memory_ratio",
               "forward_largest_tensor_bytes", "memory_ratio_forward", "errors")


def _csv_value(row: dict, key: str) -> Any:
    if key in _ERROR_CSV:
        column, stat = _ERROR_CSV[key]
        value = ((row.get("err_fp64") or {}).get(column) or {}).get(stat)
    else:
        value = row.get(key, "fp32" if key == "precision" else None)
    if key == "errors":
        return "; ".join(f"{stage}: {text}" for stage, text in (value or {}).items())
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    return "" if value is None else value


def write_csv(path: Path, rows: list[dict]) -> None:
    """`rows` as CSV (CSV_COLUMNS, a header line first), replaced whole and atomically: rewritten after
    every problem, so a killed run leaves a CSV of what it finished."""
    import csv
    import io

    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow([_csv_value(row, key) for key in CSV_COLUMNS])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text.getvalue(), encoding="utf-8")
    os.replace(tmp, path)


def append_result(path: Path, row: dict) -> None:
    """Appends one row as one line, on disk before the next problem starts (a kill loses at most that one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as f:  # writes always go to the end; reading may seek
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")  # a killed run's cut-off line stays alone on its line, and is skipped
        f.write((_dumps(row) + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


# ---- summary ----


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _stitch_speedup(row: dict) -> float | None:
    """StitchCUDA's speed-up as the geomeans count it: a wrong result earns nothing (1x, eager speed)."""
    if "speedup_stitch" not in row:
        return None
    return row["speedup_stitch"] if row.get("correct") else 1.0


def _agents_speedup(row: dict) -> float | None:
    """The agents' column as the geomeans count it (a wrong result: 1x)."""
    if "speedup_agents" not in row:
        return None
    return row["speedup_agents"] if row.get("agents_correct") else 1.0


def fast_p(rows: list[dict], speedup: Callable[[dict], float | None]) -> dict[str, float] | None:
    """KernelBench's fast_p for p in FAST_P: the share of ALL the rows (failed ones too) whose result is
    correct and whose speed-up over the baseline is strictly greater than p. `speedup(row)` is the
    row's speed-up when its result is correct, else None. fast_0 is the share correct; fast_1 the
    share correct and faster than the baseline. None when no row has a speed-up (nothing was timed)."""
    values = [speedup(r) for r in rows]
    if not rows or all(v is None for v in values):
        return None
    return {format(p, "g"): sum(v is not None and v > p for v in values) / len(rows) for p in FAST_P}


def _when_correct(key: str, correct: str = "correct") -> Callable[[dict], float | None]:
    return lambda r: r.get(key) if r.get(correct) and r.get(key) else None


def _best_compile_speedup(row: dict) -> float | None:
    """The faster torch.compile mode for this problem (rows from older files have no best column; rows
    written by other tools may have the best column only)."""
    present = [row[k] for k in ("speedup_compile", "speedup_reduce_overhead") if row.get(k)]
    return max(present) if present else row.get("speedup_best_compile")


def summarize(rows: list[dict]) -> dict:
    """Counts and geomean speed-ups over eager of one group of rows (each geomean over the problems that
    column has a time for; StitchCUDA's wrong results count as 1x)."""
    out: dict[str, Any] = {"models": len(rows), "correct": sum(bool(r.get("correct")) for r in rows)}
    out["share_correct"] = out["correct"] / len(rows) if rows else 0.0
    out["optimized"] = sum(r.get("status") == "optimized" for r in rows)
    out["compiled"] = sum(r.get("status") == "compiled" for r in rows)  # --compile-only rows
    best = {id(r): _best_compile_speedup(r) for r in rows}
    columns: dict[str, list[float]] = {
        "speedup_compile": [r["speedup_compile"] for r in rows if "speedup_compile" in r],
        "speedup_reduce_overhead": [r["speedup_reduce_overhead"] for r in rows if "speedup_reduce_overhead" in r],
        "speedup_best_compile": [b for b in best.values() if b],
        "speedup_stitch": [s for s in map(_stitch_speedup, rows) if s is not None],
        "stitch_vs_best_compile": [_stitch_speedup(r) / best[id(r)] for r in rows
                                   if _stitch_speedup(r) is not None and best[id(r)]],
        "speedup_agents": [s for s in map(_agents_speedup, rows) if s is not None],
        "agents_vs_best_compile": [_agents_speedup(r) / best[id(r)] for r in rows
                                   if _agents_speedup(r) is not None and best[id(r)]],
    }
    for name, values in columns.items():
        out[f"geomean_{name}"] = _geomean(values)
        out[f"models_with_{name}"] = len(values)
    # Baselines: eager (KernelBench's) and the faster torch.compile mode; the agents only when they ran.
    out["fast_p"] = {"stitch": fast_p(rows, _when_correct("speedup_stitch")),
                     "stitch_vs_best_compile": fast_p(rows, _when_correct("stitch_vs_best_compile"))}
    if any("agents_ms" in r or "agents_correct" in r for r in rows):
        out["fast_p"]["agents"] = fast_p(rows, _when_correct("speedup_agents", "agents_correct"))
        out["fast_p"]["agents_vs_best_compile"] = fast_p(rows, _when_correct("agents_vs_best_compile",
                                                                             "agents_correct"))
    out["slower_than_eager"] = sum(r["speedup_stitch"] < SLOW for r in rows if r.get("speedup_stitch"))
    walls = [r["optimize_s"] for r in rows if isinstance(r.get("optimize_s"), (int, float))]
    out["optimize_s_median"] = statistics.median(walls) if walls else None
    out["optimize_s_max"] = max(walls) if walls else None
    ratios = [r["memory_ratio"] for r in rows if isinstance(r.get("memory_ratio"), (int, float))]
    out["memory_over_target"] = sum(x > 1 for x in ratios)
    out["memory_over_target_forward"] = sum(r["memory_ratio_forward"] > 1 for r in rows
                                            if isinstance(r.get("memory_ratio_forward"), (int, float)))
    out["models_with_memory_ratio"] = len(ratios)
    # Eager timed at the end of a row against its first timing: the rows whose eager moved by more than
    # EAGER_DRIFT either way (their speed-ups are read against a baseline that moved within the row).
    drifts = [r["eager_after_ms"] / r["eager_ms"] for r in rows
              if isinstance(r.get("eager_after_ms"), (int, float)) and r.get("eager_ms")]
    out["eager_drifted"] = sum(abs(d - 1) > EAGER_DRIFT for d in drifts)
    out["models_with_eager_after"] = len(drifts)
    out.update(_error_summary(rows))
    return out


def _max_rel(row: dict, column: str) -> float | None:
    value = ((row.get("err_fp64") or {}).get(column) or {}).get("max_rel")
    return value if isinstance(value, (int, float)) else None


def error_ratio(row: dict, column: str = "stitch") -> float | None:
    """The column's max_rel against the fp64 reference over eager's (1.0 when both are exact, inf when only
    eager is); None without both."""
    got, eager = _max_rel(row, column), _max_rel(row, "eager")
    if got is None or eager is None:
        return None
    if eager == 0:
        return 1.0 if got == 0 else math.inf
    return got / eager


def _error_summary(rows: list[dict]) -> dict:
    """err_fp64_median: each column's median max_rel against the fp64 reference; the median ratios
    StitchCUDA / eager and torch.compile (default) / eager (error_ratio), each over the rows that have both."""
    medians = {}
    for column in ERROR_COLUMNS:
        values = [v for v in (_max_rel(r, column) for r in rows) if v is not None]
        if values:
            medians[column] = statistics.median(values)
    out: dict[str, Any] = {"err_fp64_median": medians}
    for column, key in (("stitch", "stitch_eager"), ("compile", "compile_eager")):
        values = [v for v in (error_ratio(r, column) for r in rows) if v is not None]
        out[f"err_ratio_{key}_median"] = statistics.median(values) if values else None
        out[f"models_with_err_ratio_{key}"] = len(values)
    return out


def summarize_classes(rows: list[dict]) -> dict[str, dict]:
    """summarize() per problem class, in CLASS_ORDER, for the classes present."""
    by_class: dict[str, list[dict]] = {}
    for r in rows:
        by_class.setdefault(r.get("class") or problem_class(r.get("model", "")), []).append(r)
    return {c: summarize(by_class[c]) for c in CLASS_ORDER if c in by_class}


def _level_key(level: str) -> tuple[int, str]:
    digits = level.removeprefix("level")
    return (int(digits) if digits.isdigit() else 1 << 30, level)


def summarize_levels(rows: list[dict]) -> dict[str, dict]:
    """summarize() per KernelBench level (level1, level2, ...), for the rows that have one."""
    by_level: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("level"):
            by_level.setdefault(r["level"], []).append(r)
    return {name: summarize(by_level[name]) for name in sorted(by_level, key=_level_key)}


def full_summary(rows: list[dict]) -> dict:
    """{overall, classes} and, when any row comes from a `level<N>` folder, levels."""
    summary = {"overall": summarize(rows), "classes": summarize_classes(rows)}
    levels = summarize_levels(rows)
    if levels:
        summary["levels"] = levels
    return summary


# ---- text ----


def _fmt(v: Any, spec: str) -> str:
    """`v` formatted with `spec`, or a dash as wide as the column when there is no number."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, spec)
    width = spec.split(".")[0].rstrip("df")
    return format("-", f">{width}") if width else "-"


def _row_line(r: dict) -> str:
    passed = [s["correct"] for s in r.get("input_sets", [])]
    ok = ("-" if r.get("correct", False) is None else "yes" if r.get("correct") else "NO") + \
        (f" {sum(passed)}/{len(passed)}" if passed else "")  # None: not run (--compile-only)
    return (f"{r['model'][:34]:34} {str(r.get('class', '-'))[:15]:15} {_fmt(r.get('eager_ms'), '8.4f')} "
            f"{_fmt(r.get('compile_ms'), '8.4f')} {_fmt(r.get('reduce_overhead_ms'), '8.4f')} "
            f"{_fmt(r.get('stitch_ms'), '8.4f')} {_fmt(r.get('speedup_compile'), '7.2f')} "
            f"{_fmt(r.get('speedup_reduce_overhead'), '7.2f')} {_fmt(r.get('speedup_best_compile'), '7.2f')} "
            f"{_fmt(r.get('speedup_stitch'), '8.2f')} {_fmt(r.get('stitch_vs_best_compile'), '7.2f')} {ok:>7} "
            f"{str(r.get('status', '-')):>9} {_fmt(r.get('fallbacks'), '3d')} {_fmt(r.get('optimize_s'), '6.1f')} "
            f"{_fmt(r.get('memory_ratio'), '5.2f')}")


def _memory_note(r: dict) -> str:
    """Where optimize's memory went, for a row over its target: the device peak, the stage that first
    reached it (the stage peaks are cumulative), the budget's parts and what the kept program holds."""
    from ..graph.report import program_memory_text

    ratio, peak = r.get("memory_ratio"), r.get("optimize_device_peak_bytes") or r.get("optimize_peak_bytes")
    if not isinstance(ratio, (int, float)) or ratio <= 1 or not peak:
        return ""
    stages = r.get("stage_peak_bytes") or {}
    at = next((stage for stage, b in stages.items() if b >= 0.99 * peak), None)
    gib = 2 ** 30
    return (f"    memory: {peak / gib:.2f} GiB peak" + (f", reached by {at}" if at else "") +
            f"; eager peak {(r.get('eager_peak_bytes') or 0) / gib:.2f} GiB, largest tensor "
            f"{(r.get('largest_tensor_bytes') or 0) / gib:.2f} GiB" +
            (f" (the forward's {r['forward_largest_tensor_bytes'] / gib:.2f}: ratio "
             f"{_fmt(r.get('memory_ratio_forward'), '.2f')})" if r.get("forward_largest_tensor_bytes") else "") +
            "; stages: " +
            ", ".join(f"{stage} {b / gib:.2f}" for stage, b in stages.items()) +
            (f"; program: {program_memory_text(r['program_memory'])}" if r.get("program_memory") else ""))


def _row_notes(r: dict) -> list[str]:
    lines = [f"    {stage} error: {err}" for stage, err in r.get("errors", {}).items()]
    lines += [f"    {s['inputs']} wrong: {s.get('mismatch') or s.get('error')}"
              for s in r.get("input_sets", []) if not s.get("correct")]
    if r.get("mismatch") and not r.get("input_sets"):
        lines.append(f"    mismatch: {r['mismatch']}")
    if r.get("status") == "eager" and r.get("reason"):
        lines.append(f"    eager because: {r['reason'][:200]}")
    memory = _memory_note(r)
    if memory:
        lines.append(memory)
    errors = r.get("err_fp64")
    if errors:
        names = {"eager": "eager", "compile": "compile", "reduce_overhead": "r-o", "stitch": "stitch",
                 "agents": "agents"}
        lines.append("    vs fp64 (max rel): " + ", ".join(f"{names[c]} {_fmt(errors[c].get('max_rel'), '.2e')}"
                                                         for c in ERROR_COLUMNS if c in errors))
    elif r.get("fp64_note") and r.get("mode") != "compile-only":
        lines.append(f"    vs fp64: {r['fp64_note'][:200]}")
    return lines


def _rows_precision(rows: list[dict]) -> str:
    return next((r["precision"] for r in rows if r.get("precision")), "fp32")


def _class_line(name: str, s: dict) -> str:
    return (f"{name[:15]:15} {s['models']:4d} {s['correct']:4d} {_fmt(s['geomean_speedup_compile'], '7.2f')} "
            f"{_fmt(s['geomean_speedup_reduce_overhead'], '7.2f')} {_fmt(s['geomean_speedup_best_compile'], '7.2f')} "
            f"{_fmt(s['geomean_speedup_stitch'], '8.2f')} {_fmt(s['geomean_stitch_vs_best_compile'], '7.2f')} "
            f"{s['slower_than_eager']:6d} {_fmt(s['optimize_s_median'], '7.1f')} {_fmt(s['optimize_s_max'], '7.1f')} "
            f"{s['memory_over_target']:5d} {s.get('memory_over_target_forward', 0):5d}")


def format_table(rows: list[dict], summary: dict, device: str, title: str = "suite",
                 precision: str | None = None) -> str:
    """Per-problem rows, a per-class table, then the overall lines. `summary` is full_summary()'s
    {overall, classes}, or summarize()'s flat overall (the classes are then computed from `rows`).
    `precision` (default: the rows') names the flags and the tolerance in the header."""
    overall = summary.get("overall", summary)
    classes = summary.get("classes") or summarize_classes(rows)
    precision = precision or _rows_precision(rows)
    atol, rtol = _tolerance(precision)
    head = (f"{'model':34} {'class':15} {'eager':>8} {'compile':>8} {'r-o':>8} {'stitch':>8} {'x comp':>7} "
            f"{'x r-o':>7} {'x best':>7} {'x stitch':>8} {'st/best':>7} {'ok':>7} {'status':>9} {'fb':>3} "
            f"{'opt s':>6} {'mem':>5}")
    lines = [f"StitchCUDA {title} on {device} (ms per forward; precision {PRECISION_WORDS[precision]}; outputs "
             f"within atol {atol:g}, rtol {rtol:g} of eager; speed-ups vs eager; st/best: StitchCUDA vs the faster "
             f"compile mode; mem: optimize peak / (eager peak + 2 x largest input or output); class table: "
             f"mem>1 over it, fwd>1 over it with the forward's largest tensor, intermediates included)",
             head, "-" * len(head)]
    for r in rows:
        lines += [_row_line(r), *_row_notes(r)]
    class_head = (f"{'class':15} {'n':>4} {'ok':>4} {'x comp':>7} {'x r-o':>7} {'x best':>7} {'x stitch':>8} "
                  f"{'st/best':>7} {'<0.98':>6} {'opt med':>7} {'opt max':>7} {'mem>1':>5} {'fwd>1':>5}")
    lines += ["", class_head, "-" * len(class_head)]
    lines += [_class_line(name, s) for name, s in classes.items()]
    if summary.get("levels"):
        lines += ["-" * len(class_head)] + [_class_line(name, s) for name, s in summary["levels"].items()]
    lines += ["-" * len(class_head), _class_line("overall", overall), ""]
    s = overall
    lines.append(f"geomean speed-up vs eager: torch.compile {_fmt(s['geomean_speedup_compile'], '.3f')}x, "
                 f"reduce-overhead {_fmt(s['geomean_speedup_reduce_overhead'], '.3f')}x, "
                 f"best compile mode {_fmt(s['geomean_speedup_best_compile'], '.3f')}x, "
                 f"StitchCUDA {_fmt(s['geomean_speedup_stitch'], '.3f')}x; StitchCUDA vs best compile mode "
                 f"{_fmt(s['geomean_stitch_vs_best_compile'], '.3f')}x")
    if s.get("compiled") and not s.get("models_with_speedup_stitch"):  # a --compile-only run: nothing ran
        planned = "" if precision == "fp32" else \
            f" with precision={precision} (OfflinePlanner(precision={precision!r}): matmuls may use {precision})"
        lines[-1] = (f"compile-only: {s['compiled']}/{s['models']} captured, planned{planned} and compiled; nothing "
                     f"timed or checked; optimize s median {_fmt(s['optimize_s_median'], '.1f')} max "
                     f"{_fmt(s['optimize_s_max'], '.1f')}")
        return "\n".join(lines)
    lines.append(f"correct: {s['correct']}/{s['models']} ({100 * s['share_correct']:.0f}%), "
                 f"optimized (not eager): {s['optimized']}/{s['models']}, StitchCUDA < {SLOW}x eager: "
                 f"{s['slower_than_eager']}, optimize s median {_fmt(s['optimize_s_median'], '.1f')} max "
                 f"{_fmt(s['optimize_s_max'], '.1f')}, memory ratio > 1: {s['memory_over_target']}/"
                 f"{s['models_with_memory_ratio']} (against the forward's largest tensor, intermediates "
                 f"included: {s.get('memory_over_target_forward', '-')})")
    medians = s.get("err_fp64_median") or {}
    if medians:
        names = {"eager": "eager", "compile": "compile", "reduce_overhead": "reduce-overhead", "stitch": "StitchCUDA",
                 "agents": "agents"}
        lines.append("error vs fp64 (median max rel): " + ", ".join(f"{names[c]} {v:.2e}" for c, v in medians.items())
                     + f"; StitchCUDA / eager median {_fmt(s.get('err_ratio_stitch_eager_median'), '.2f')}x over "
                       f"{s.get('models_with_err_ratio_stitch_eager', 0)} problem(s)")
    if s.get("geomean_speedup_agents") is not None:
        lines.append(f"agents (--llm): geomean {_fmt(s['geomean_speedup_agents'], '.3f')}x vs eager, "
                     f"{_fmt(s['geomean_agents_vs_best_compile'], '.3f')}x vs best compile mode")
    names = {"stitch": "StitchCUDA vs eager", "stitch_vs_best_compile": "StitchCUDA vs best compile",
             "agents": "agents vs eager", "agents_vs_best_compile": "agents vs best compile"}
    shares = [f"{names[k]} " + " ".join(f"{p}:{v:.2f}" for p, v in f.items())
              for k, f in (s.get("fast_p") or {}).items() if f]
    if shares:
        lines.append("fast_p (share of all problems correct and faster than p x the baseline): " + "; ".join(shares))
    return "\n".join(lines)


# ---- several GPUs: one bench process per GPU, one shared queue ----

# Two runs of a problem agree when their status, failing stages and correctness match and each of these
# speed-ups is within SPEEDUP_TOLERANCE of the other (max / min - 1): timings move between runs and
# GPUs, verdicts must not.
SPEEDUP_TOLERANCE = 0.15
AGREEMENT_COLUMNS = ("speedup_stitch", "speedup_best_compile", "speedup_agents")
STDERR_TAIL = 20  # lines of a bench process's stderr kept for the rows it could not finish
STOP_GRACE_S = 5.0  # after Ctrl-C, how long a bench process may take to stop before it is killed
PART = re.compile(r"\.gpu\d+")  # the suffix of a --gpus process's own results file beside --results F


def _device_count() -> int:
    try:
        from .. import _C

        return _C.device_count()  # the driver's count under this process's CUDA_VISIBLE_DEVICES, no context
    except Exception:  # no native module, no driver
        return 0


def child_devices(n: int, compile_only: bool, environ: dict[str, str] | None = None,
                  count: int | None = None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES value for each of `n` bench processes: the i-th GPU this process sees
    (an entry of its own CUDA_VISIBLE_DEVICES when it has one, else i); "" for every process of a
    --compile-only run, which needs no GPU. `count` is the driver's device count (default: asked).
    ValueError, naming both counts and the fix, when fewer than `n` GPUs are visible."""
    if compile_only:
        return [""] * n
    environ = os.environ if environ is None else environ
    count = _device_count() if count is None else count
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    # The driver stops at the first entry it cannot use, so its count says how many entries hold.
    visible = [t.strip() for t in listed.split(",")][:count] if listed is not None else [str(i) for i in range(count)]
    if n > len(visible):
        where = f" (CUDA_VISIBLE_DEVICES={listed!r})" if listed is not None else ""
        raise ValueError(f"--gpus {n} asks for {n} GPUs but this machine shows {len(visible)}{where}; pass "
                         f"--gpus {len(visible)} or fewer" + (", or make more GPUs visible through "
                                                              "CUDA_VISIBLE_DEVICES" if listed is not None else ""))
    return visible[:n]


def _device_names(devices: list[str]) -> list[str]:
    """The name of each device of child_devices() ("cpu" for ""), by the driver (no context is made)."""
    from .. import _C

    names = []
    for index, device in enumerate(devices):
        try:
            names.append(_C.device_info(index)["name"] if device else "cpu")
        except Exception:  # a driver without the name: the index says which one
            names.append(f"GPU {device}")
    return names


def _devices_label(names: list[str]) -> str:
    """"2 x NVIDIA H200" for identical devices, else their names in order."""
    if names and all(name == names[0] for name in names):
        return f"{len(names)} x {names[0]}"
    return ", ".join(names)


def queue_order(files: list[Path]) -> list[Path]:
    """The order the bench processes take problems in: whole networks first (their optimize captures,
    compiles and checks the most groups: the long poles), then the rest, each in folder order. A process
    takes the next problem no other has taken as soon as it finishes one, so no GPU idles while problems
    wait, however unequal they are (at KernelBench sizes they differ a hundredfold)."""
    return sorted(files, key=lambda p: problem_class(p.stem) != "whole network" and problem_level(p) != "level3")


def _queue_files(queue: Path) -> list[Path]:
    try:
        return [Path(p) for p in json.loads((queue / "queue.json").read_text(encoding="utf-8"))]
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bench: --queue {queue} is not the queue of a --gpus run ({exc})") from None


def claim(queue: Path, index: int) -> bool:
    """Takes problem `index` of the shared queue for this process; False when another process has it.
    Creating the claim file is atomic (O_EXCL); it holds the taker's pid, so the parent knows which
    process a problem without a row was lost with."""
    try:
        fd = os.open(queue / "claims" / str(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def _claims(queue: Path) -> dict[int, int]:
    """Problem index -> the pid of the process that took it (0: it died before writing its pid)."""
    out = {}
    for path in (queue / "claims").iterdir():
        text = path.read_text().strip()
        out[int(path.name)] = int(text) if text.isdigit() else 0
    return out


def _ended(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit {code})"
    return f"exited with {code}"


def _child_environment(device: str, extra: dict[str, str]) -> dict[str, str]:
    """This process's environment for a bench process on `device`: its CUDA_VISIBLE_DEVICES, this
    process's kernel cache, this package first on the path (from a source checkout), the selection
    variables dropped (the queue is the selection)."""
    from .. import jit

    env = {k: v for k, v in os.environ.items()
           if k not in ("STITCHCUDA_SUITE_DIR", "STITCHCUDA_SUITE_ONLY", "STITCHCUDA_SUITE_CHUNK")}
    root = Path(__file__).resolve().parents[2]
    # A source checkout (python/) goes first so the processes run this code; an installed package's
    # site-packages does not (it would come before the standard library).
    if root.name not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = os.pathsep.join([str(root), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env["STITCHCUDA_CACHE_DIR"] = jit.cache_dir()
    env["CUDA_VISIBLE_DEVICES"] = device
    return {**env, **extra}


def _interrupt_on_sigterm() -> Callable[[], None]:
    """SIGTERM (a job's time limit, `timeout`) raises KeyboardInterrupt, so the bench processes are
    stopped as on Ctrl-C; returns what restores the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@dataclass
class _Child:
    """One bench process of a Spread: its GPU, its process, the tail of its stderr."""

    gpu: int
    proc: subprocess.Popen
    stdout: Path
    started: float
    ended: float | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=STDERR_TAIL))
    reader: threading.Thread | None = None


class Spread:
    """`files` run by one bench process per device (`--gpus N`): the same command (`bench BENCH --dir
    FOLDER --json`) with CUDA_VISIBLE_DEVICES set to its GPU and `--queue` to a shared queue, from which
    each takes the next untaken problem (queue_order); each appends its rows to its own results file
    (`parts`). Their [suite-row] lines are passed on to stderr as they come, their other stderr lines
    prefixed with their GPU. A process that dies having taken a problem is replaced on its GPU while
    problems are left; a problem without a row becomes an error row naming the process's exit code and
    its last stderr lines. Ctrl-C (or SIGTERM) stops every process (SIGINT, then SIGKILL after
    STOP_GRACE_S)."""

    def __init__(self, bench: str, folder: Path, files: list[Path], devices: list[str], work: Path,
                 parts: list[Path], *, llm: str | None, compile_only: bool, json_output: bool,
                 env: dict[str, str] | None = None, on_row: Callable[[dict], None] | None = None,
                 precision: str = "fp32", no_compile: bool = False) -> None:
        self.bench, self.folder, self.devices, self.parts = bench, folder, devices, parts
        self.names = _device_names(devices)
        self.llm, self.compile_only, self.json_output = llm, compile_only, json_output
        self.no_compile = no_compile
        self.precision = precision
        self.env, self.on_row = env or {}, on_row
        self.files = queue_order(files)
        self.queue = work / "queue"
        (self.queue / "claims").mkdir(parents=True)
        (self.queue / "queue.json").write_text(json.dumps([str(p.resolve()) for p in self.files]), encoding="utf-8")
        self.children: list[_Child] = []
        self.lock = threading.Lock()  # one line at a time on stdout and stderr, one CSV writer
        self.started = self.ended = 0.0

    def _say(self, line: str) -> None:
        with self.lock:
            print(line, file=sys.stderr, flush=True)

    def _command(self, gpu: int) -> list[str]:
        command = [sys.executable, "-m", "stitchcuda", "bench", self.bench, "--dir", str(self.folder), "--queue",
                   str(self.queue), "--results", str(self.parts[gpu]), "--json"]
        if self.compile_only:
            command.append("--compile-only")
        if self.no_compile:
            command.append("--no-compile")
        if self.llm:
            command += ["--llm", self.llm]
        if self.precision != "fp32":
            command += ["--precision", self.precision]
        return command

    def _start(self, gpu: int) -> None:
        stdout = self.queue.parent / f"gpu{gpu}-{sum(c.gpu == gpu for c in self.children)}.json"
        with stdout.open("wb") as out:  # the process's JSON report: the hardware it ran on
            proc = subprocess.Popen(self._command(gpu), env=_child_environment(self.devices[gpu], self.env),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE, text=True,
                                    errors="replace")
        child = _Child(gpu, proc, stdout, time.perf_counter())
        child.reader = threading.Thread(target=self._relay, args=(child,), daemon=True)
        child.reader.start()
        self.children.append(child)
        self._say(f"[gpus] GPU {gpu} ({self.names[gpu]}, CUDA_VISIBLE_DEVICES={self.devices[gpu]!r}): pid {proc.pid}")

    def _relay(self, child: _Child) -> None:
        for line in child.proc.stderr:
            line = line.rstrip("\n")
            if not line.startswith(ROW_PREFIX):
                child.tail.append(line)
                self._say(f"[gpu {child.gpu}] {line}")
                continue
            try:
                row = json.loads(line[len(ROW_PREFIX):])
            except json.JSONDecodeError:
                row = None
            with self.lock:
                print(line, file=sys.stderr, flush=True)
                if isinstance(row, dict):
                    if not self.json_output:
                        print(f"[suite] {row.get('model')}: done (GPU {child.gpu})", flush=True)
                    if self.on_row is not None:
                        self.on_row(row)

    def run(self) -> Spread:
        restore = _interrupt_on_sigterm()
        self.started = time.perf_counter()
        try:
            for gpu in range(min(len(self.devices), len(self.files))):
                self._start(gpu)
            while self._poll():
                time.sleep(0.1)
        except BaseException:  # Ctrl-C, SIGTERM, a process that cannot start: none is left running
            self._stop()
            raise
        finally:
            restore()
        self.ended = time.perf_counter()
        for child in self.children:  # the last lines; a lingering grandchild holding the pipe is not waited for
            child.reader.join(timeout=2)
        return self

    def _poll(self) -> bool:
        """Notes the processes that ended, replaces one that died after taking a problem while problems
        are left (each replacement follows a taken problem, so this ends); True while any runs."""
        for child in list(self.children):
            if child.ended is not None or child.proc.poll() is None:
                continue
            child.ended = time.perf_counter()
            code = child.proc.returncode
            if code == 0:
                continue
            claims = _claims(self.queue)
            taken = [i for i, pid in claims.items() if pid == child.proc.pid]
            what = f"[gpus] GPU {child.gpu}: pid {child.proc.pid} {_ended(code)}"
            if taken and len(claims) < len(self.files):
                self._say(f"{what} after taking {self.files[max(taken)].stem}; starting another for the problems left")
                self._start(child.gpu)
            else:
                self._say(what)
        return any(c.ended is None for c in self.children)

    def _stop(self) -> None:
        live = [c for c in self.children if c.proc.poll() is None]
        try:
            for child in live:
                child.proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in live:
                try:
                    child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
        finally:  # a second Ctrl-C while they stop: kill them at once
            for child in live:
                if child.proc.poll() is None:
                    child.proc.kill()
                child.proc.wait()
        self._say(f"[gpus] stopped {len(live)} bench process(es)")

    def rows(self) -> dict[str, dict]:
        """Every queued problem's row, by stem: the one its process wrote, else an error row."""
        mode = _mode(self.compile_only, self.no_compile)
        measured: dict[str, dict] = {}
        for part in self.parts:
            measured.update(read_results(part))
        claims = _claims(self.queue)
        by_pid = {c.proc.pid: c for c in self.children}
        for index, path in enumerate(self.files):
            if path.stem not in measured:
                measured[path.stem] = self._lost_row(_new_row(path, mode, self.precision),
                                                     by_pid.get(claims.get(index, -1)))
        return measured

    def _lost_row(self, row: dict, child: _Child | None) -> dict:
        """A problem whose process ended without writing its row (`child`), or that no process reached."""
        if self.llm:
            row["llm"] = self.llm
        row["correct"] = False
        if child is not None:
            text = f"the bench process on GPU {child.gpu} (pid {child.proc.pid}) {_ended(child.proc.returncode)} " \
                   "before writing this problem's row"
            row["process"] = {"gpu": child.gpu, "device": self.devices[child.gpu], "pid": child.proc.pid,
                              "exit": child.proc.returncode, "stderr_tail": list(child.tail)}
            tail = list(child.tail)
        else:
            last = {c.gpu: c for c in self.children}  # the last process of each GPU
            text = "not run: every bench process ended before reaching it (" + \
                   ", ".join(f"GPU {c.gpu} {_ended(c.proc.returncode)}" for c in last.values()) + ")"
            row["process"] = {"exits": {str(g): c.proc.returncode for g, c in last.items()}}
            tail = next((list(c.tail) for c in last.values() if c.tail), [])
        if tail:
            text += "; its last stderr lines:\n" + "\n".join(f"      {line}" for line in tail[-5:])
        row["errors"]["process"] = text
        return row

    def section(self) -> dict:
        """The "gpus" section of the JSON: the devices, the wall time, what each GPU ran and how long."""
        claims = _claims(self.queue)
        per_gpu = []
        for gpu in sorted({c.gpu for c in self.children}):
            mine = [c for c in self.children if c.gpu == gpu]
            pids = {c.proc.pid for c in mine}
            per_gpu.append({"gpu": gpu, "device": self.devices[gpu], "name": self.names[gpu],
                            "problems": [self.files[i].stem for i in sorted(claims) if claims[i] in pids],
                            "wall_s": max(c.ended for c in mine) - min(c.started for c in mine),
                            "exits": [c.proc.returncode for c in mine]})
        return {"gpus": len(self.devices), "wall_s": self.ended - self.started, "per_gpu": per_gpu,
                "devices": self.names, "queue": "one shared queue, whole networks first; each process takes "
                                                "the next problem no other has taken"}

    def hardware(self) -> dict | None:
        """The hardware the first process that finished reports (its JSON on stdout)."""
        for child in self.children:
            try:
                report = json.loads(child.stdout.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(report, dict) and isinstance(report.get("hardware"), dict):
                return report["hardware"]
        return None


def fold_parts(results: Path) -> int:
    """The rows a --gpus run's processes left in their own files beside `results` (F.gpu0, F.gpu1, ...:
    the run was killed before it merged them) appended to `results`, the files removed; how many rows."""
    count = 0
    for part in _part_files(results):
        for row in read_results(part).values():
            append_result(results, row)
            count += 1
        part.unlink()
    return count


def compare_runs(one: list[dict], many: list[dict], tolerance: float = SPEEDUP_TOLERANCE) -> list[dict]:
    """Per problem of `many`, whether its row agrees with the same problem's row in `one`: the same
    status, the same failing stages, the same correctness, and each speed-up of AGREEMENT_COLUMNS that
    either row has present in both and within `tolerance` (max / min - 1)."""
    first = {r["model"]: r for r in one}
    out = []
    for r in many:
        a = first.get(r["model"], {})
        entry: dict[str, Any] = {"model": r["model"], "status": [a.get("status"), r.get("status")],
                                 "correct": [a.get("correct"), r.get("correct")]}
        differences = [f"{key} {a.get(key)} vs {r.get(key)}" for key in ("status", "correct")
                       if a.get(key) != r.get(key)]
        stages = sorted(a.get("errors") or {}), sorted(r.get("errors") or {})
        if stages[0] != stages[1]:
            differences.append(f"errors in {', '.join(stages[0]) or 'nothing'} vs {', '.join(stages[1]) or 'nothing'}")
        for key in AGREEMENT_COLUMNS:
            x, y = a.get(key), r.get(key)
            if x is None and y is None:
                continue
            entry[key] = [x, y]
            if not (isinstance(x, (int, float)) and isinstance(y, (int, float)) and x > 0 and y > 0):
                differences.append(f"{key} {_fmt(x, '.2f')} vs {_fmt(y, '.2f')}")
            elif max(x, y) / min(x, y) - 1 > tolerance:
                differences.append(f"{key} {x:.2f} vs {y:.2f} ({100 * (max(x, y) / min(x, y) - 1):.0f}% apart)")
        out.append({**entry, "agree": not differences, "differences": differences})
    return out


def scaling_report(one: Spread, many: Spread, rows_one: list[dict], rows_many: list[dict]) -> dict:
    """The "scaling" section: both walls, speed-up, efficiency = wall_1 / (N x wall_N), per-problem
    agreement (compare_runs), and the one-GPU run's own section, summary and rows."""
    n, wall_1, wall_n = len(many.devices), one.ended - one.started, many.ended - many.started
    problems = compare_runs(rows_one, rows_many)
    note = ("N = 1: both runs used the one GPU, so efficiency is 1.0 by definition; the printed value is "
            "run-to-run variation" if n == 1 else
            f"efficiency 1.0 is perfect scaling over {n} GPUs")
    return {"gpus": n, "wall_1_s": wall_1, "wall_n_s": wall_n, "speedup": wall_1 / wall_n if wall_n else None,
            "efficiency": wall_1 / (n * wall_n) if wall_n else None, "note": note + "; each run started with "
            "empty compile caches of its own: StitchCUDA's kernel cache and torch.compile's",
            "agree": sum(p["agree"] for p in problems), "compared": ["status", "errors", "correct", *AGREEMENT_COLUMNS],
            "tolerance": SPEEDUP_TOLERANCE, "problems": problems,
            "one_gpu": {"gpus": one.section(), "summary": full_summary(rows_one), "models": rows_one}}


def format_gpus(section: dict) -> str:
    """The lines after the table of a --gpus run: the devices, the wall time, what each GPU ran."""
    on_cpu = not any(g["device"] for g in section["per_gpu"]) and all(n == "cpu" for n in section["devices"])
    where = (f"in {section['gpus']} processes on the CPU" if on_cpu else
             f"on {section['gpus']} GPU(s) ({_devices_label(section['devices'])})")
    lines = [f"{where}: wall {section['wall_s']:.1f} s; {section['queue']}"]
    for g in section["per_gpu"]:
        exits = [code for code in g["exits"] if code != 0]
        lines.append(f"  GPU {g['gpu']} ({g['name']}, CUDA_VISIBLE_DEVICES={g['device']!r}): {len(g['problems'])} "
                     f"problem(s) in {g['wall_s']:.1f} s" + (f"; process exits {g['exits']}" if exits else ""))
    return "\n".join(lines)


def format_scaling(s: dict) -> str:
    n = s["gpus"]
    lines = [f"scaling: 1 GPU {s['wall_1_s']:.1f} s, {n} GPU(s) {s['wall_n_s']:.1f} s: {_fmt(s['speedup'], '.2f')}x, "
             f"efficiency {_fmt(s['efficiency'], '.2f')} = wall_1 / ({n} x wall_{n}) ({s['note']})",
             f"agreement: {s['agree']}/{len(s['problems'])} problems agree between the two runs (status, failing "
             f"stages and correctness the same; {', '.join(AGREEMENT_COLUMNS)} within {s['tolerance']:.0%})"]
    lines += [f"  {p['model']}: {'; '.join(p['differences'])}" for p in s["problems"] if not p["agree"]]
    return "\n".join(lines)


def _spread_usage(gpus: int, chunk: str | None, chunk_from_flag: bool, results: Path | str | None,
                  scaling_run: bool) -> str | None:
    """Why --gpus / --scaling cannot run with these options, or None."""
    if chunk:
        source = "--chunk" if chunk_from_flag else f"STITCHCUDA_SUITE_CHUNK={chunk}"
        return (f"--gpus splits the selected problems over the GPUs itself, and {source} selects a share for a "
                f"separate run; pass one of them (--only picks the problems of a --gpus run)")
    if scaling_run and results is not None:
        return ("--scaling measures every problem twice, from scratch, and a resumed run's wall time means "
                "nothing; drop --results (--json carries both runs' rows)")
    return None


# ---- entry points ----


def _refuse(bench: str, message: str, code: int, json_output: bool) -> int:
    """An early exit: the message as {"error": ...} under --json (stdout stays JSON), else as text."""
    print(_dumps({"error": message}) if json_output else f"bench {bench}: {message}")
    return code


def _setting(flag: str | None, name: str) -> str | None:
    """The flag's value, else the setting `name`'s (flags win)."""
    return flag if flag is not None else getattr(settings(), name)


def _measure_all(files: list[Path], done: dict[str, dict], results: Path | None, json_output: bool, *,
                 llm: str | None = None, compile_only: bool = False, csv: Path | None = None,
                 claim: Callable[[int], bool] | None = None, precision: str = "fp32",
                 no_compile: bool = False) -> list[dict]:
    """The selected problems' rows in order: from `done` (the results file) or measured now, each problem's
    columns under torch's flags for `precision` (precision_flags: at fp32, TF32 off everywhere), restored
    after it. The CSV, when asked for, is rewritten after each problem. With `claim` (a process of a
    --gpus run), a problem is measured only when claim(its index) takes it from the shared queue; the
    others are left out."""
    rows = []
    for index, path in enumerate(files):
        if path.stem in done:
            rows.append(done[path.stem])
            continue
        if claim is not None and not claim(index):
            continue
        with precision_flags(precision):
            row = _run_one(path, llm, compile_only, precision, no_compile) \
                if (llm or compile_only or no_compile or precision != "fp32") else _run_one(path)
        rows.append(row)
        if results is not None:
            append_result(results, row)
        if csv is not None:
            write_csv(csv, rows)
        # One line per problem on stderr as it finishes, so a run cut short still reports what it measured.
        print(ROW_PREFIX + _dumps(row), file=sys.stderr, flush=True)
        if not json_output:
            print(f"[suite] {row['model']}: done", flush=True)
    return rows


def _hardware(compile_only: bool) -> dict:
    """The GPU as the Verifier describes it (its peaks draw the roofline); {"gpu": None} without one."""
    from ..verify import describe

    try:
        return describe()
    except Exception:  # the native module is missing a table entry, a broken driver: no peaks, no ceiling
        return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not compile_only else None}


def run_suite(bench: str = "suite", *, folder: Path | str | None = None, only: str | None = None,
              chunk: str | None = None, results: Path | str | None = None, json_output: bool = False,
              llm: str | None = None, csv: Path | str | None = None, html: Path | str | None = None,
              compile_only: bool = False, gpus: int = 1, scaling: bool = False,
              queue: Path | str | None = None, precision: str = "fp32", no_compile: bool = False) -> int:
    """`stitchcuda bench <bench>` over `folder` (default: default_dir(bench)); `only`, `chunk` fall back to
    STITCHCUDA_SUITE_ONLY / _CHUNK; `results` a JSON-lines file to append to and resume from; `llm` adds
    the agents' column (optimize(llm=...)); `csv` and `html` are written from every selected row at the
    end (the CSV after each problem too); `compile_only` plans and compiles without timing (plan_model),
    the one mode that runs without a GPU; `no_compile` times eager and StitchCUDA without the torch.compile
    columns. `gpus` > 1 runs the problems in that many bench processes, one
    per GPU (Spread); `scaling` runs them on one GPU, then on `gpus`, and compares the two runs; `queue`
    makes this process one of a Spread's: it takes its problems from that shared queue. `precision`
    (fp32, tf32, bf16): torch's flags for every column (TORCH_FLAGS), optimize(precision=...) and the
    tolerance outputs are judged by; recorded in every row and in the JSON.
    Exit codes: 0 measured, 2 usage (no folder, nothing selected, a bad chunk, --html without
    matplotlib, --llm or --no-compile with --compile-only, --gpus with a chunk, more GPUs than visible, --scaling with
    --results, an unknown precision, a results file holding rows of another precision), 3 no GPU."""
    if precision not in TORCH_FLAGS:
        return _refuse(bench, f"--precision must be one of {', '.join(TORCH_FLAGS)}, not {precision!r}", EXIT_USAGE,
                       json_output)
    if llm and compile_only:
        return _refuse(bench, "--llm needs a GPU run; it cannot be combined with --compile-only", EXIT_USAGE,
                       json_output)
    if no_compile and compile_only:
        return _refuse(bench, "--no-compile times eager and StitchCUDA; --compile-only times nothing: pass one of "
                       "them", EXIT_USAGE, json_output)
    if not torch.cuda.is_available() and not compile_only:
        return _refuse(bench, "no GPU (torch.cuda.is_available() is False); nothing measured "
                       "(--compile-only plans and compiles each problem without one)", EXIT_NO_GPU, json_output)
    if html is not None:
        from .html import matplotlib_missing

        missing = matplotlib_missing()
        if missing:  # before hours of measuring, not after
            return _refuse(bench, missing, EXIT_USAGE, json_output)
    folder = Path(folder) if folder is not None else default_dir(bench)
    if folder is None or not folder.is_dir():
        return _refuse(bench, f"no problem folder ({folder or f'bench/{bench} not found above ' + __file__}); "
                       "pass --dir" + (" or set STITCHCUDA_SUITE_DIR" if bench == "suite" else ""),
                       EXIT_USAGE, json_output)
    chunk_from_flag = chunk is not None
    try:  # a bad STITCHCUDA_SUITE_CHUNK is refused here (argparse has checked the flag)
        only, chunk = _setting(only, "suite_only"), _setting(chunk, "suite_chunk")
    except ValueError as exc:
        return _refuse(bench, str(exc), EXIT_USAGE, json_output)
    spread = (gpus > 1 or scaling) and queue is None
    devices: list[str] = []
    if spread:
        try:
            problem = _spread_usage(gpus, chunk, chunk_from_flag, results, scaling)
            if problem:
                raise ValueError(problem)
            devices = child_devices(gpus, compile_only)
        except ValueError as exc:
            return _refuse(bench, str(exc), EXIT_USAGE, json_output)
    files = _queue_files(Path(queue)) if queue is not None else model_files(folder, only, chunk)
    unknown = _only_names(only) - {p.stem for p in _problem_paths(folder)} if queue is None else set()
    if unknown:  # at KernelBench scale a typo would otherwise just shrink the run
        print(f"bench {bench}: --only names no file in {folder}: {', '.join(sorted(unknown))}", file=sys.stderr)
    if not files and queue is None:
        return _refuse(bench, f"no problem files in {folder} match only={only!r} chunk={chunk!r}", EXIT_USAGE,
                       json_output)

    results = Path(results) if results is not None else None
    csv = Path(csv) if csv is not None else None
    settings = {"mode": _mode(compile_only, no_compile), "llm": llm or None, "precision": precision}
    conflict = precision_conflict(results, precision) if results is not None and queue is None else None
    if conflict:  # before fold_parts: a killed run's rows of another precision stay where they are
        return _refuse(bench, conflict, EXIT_USAGE, json_output)
    if spread and results is not None:
        fold_parts(results)  # rows of a killed --gpus run, before they count as done
    done = read_results(results, settings) if results is not None else {}
    title = f"bench {bench} ({folder})"
    if spread:
        return _run_spread(bench, folder, files, done, results, devices, settings, title=title, scaling_run=scaling,
                           json_output=json_output, csv=csv, html=html)
    rows = _measure_all(files, done, results, json_output, llm=llm, compile_only=compile_only, csv=csv,
                        claim=(lambda index: claim(Path(queue), index)) if queue is not None else None,
                        precision=precision, no_compile=no_compile)
    hardware = _hardware(compile_only)
    device = hardware.get("gpu") or (torch.cuda.get_device_name() if torch.cuda.is_available() else
                                     "no GPU (compile-only)")
    return _report(rows, hardware, device, title, folder=folder, settings=settings,
                   resumed=sum(p.stem in done for p in files), json_output=json_output, csv=csv, html=html)


def _report(rows: list[dict], hardware: dict, device: str, title: str, *, folder: Path, settings: dict,
            resumed: int, json_output: bool, csv: Path | None, html: Path | str | None,
            sections: dict | None = None, text: list[str] = ()) -> int:
    """The end of every run: the CSV, the HTML report, and the JSON object (with `sections` added) or the
    table (with the `text` lines after it)."""
    if csv is not None:
        write_csv(csv, rows)  # also when every row came from the results file
    summary = full_summary(rows)
    if html is not None:
        from .html import write_report

        write_report(Path(html), rows, summary, hardware=hardware, title=title, mode=settings["mode"],
                     precision=settings.get("precision", "fp32"))
    precision = settings.get("precision", "fp32")
    if json_output:
        atol, rtol = _tolerance(precision)
        print(_dumps({"device": device, "suite_dir": str(folder), "tolerance": {"atol": atol, "rtol": rtol},
                      "torch_flags": TORCH_FLAGS[precision], "repeats": REPEATS, "resumed": resumed, **settings,
                      "hardware": hardware, "summary": summary, **(sections or {}), "models": rows}))
    else:
        print("\n".join([format_table(rows, summary, device, title=title, precision=precision), *text]))
    return 0


def _run_spread(bench: str, folder: Path, files: list[Path], done: dict[str, dict], results: Path | None,
                devices: list[str], settings: dict, *, title: str, scaling_run: bool, json_output: bool,
                csv: Path | None, html: Path | str | None) -> int:
    """--gpus N (and --scaling): the problems not in `done` through Spread, on one GPU first with
    --scaling; the rows merged in the problems' order and reported once, as a single process reports
    them, with the "gpus" (and "scaling") sections. With --results F the processes write F.gpu0,
    F.gpu1, ... beside it, folded into F when they are done (or by the next run, after a kill)."""
    llm, compile_only, precision = settings["llm"], settings["mode"] == "compile-only", settings["precision"]
    no_compile = settings["mode"] == "no-compile"
    todo = [p for p in files if p.stem not in done]
    seen: dict[str, dict] = {}

    def on_row(row: dict) -> None:  # the CSV after each problem, as a single process writes it
        seen[row.get("model")] = row
        write_csv(csv, [done[p.stem] if p.stem in done else seen[p.stem] for p in files
                        if p.stem in done or p.stem in seen])

    def spread(devices: list[str], work: Path, parts: list[Path], env: dict[str, str], on_row=None) -> Spread:
        return Spread(bench, folder, todo, devices, work, parts, llm=llm, compile_only=compile_only,
                      json_output=json_output, env=env, on_row=on_row, precision=precision,
                      no_compile=no_compile).run()

    def caches(side: Path) -> dict[str, str]:  # with --scaling, neither run profits from the other's compiles
        return {"STITCHCUDA_CACHE_DIR": str(side / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(side / "inductor"),
                "TRITON_CACHE_DIR": str(side / "triton")}

    def rows_of(run: Spread) -> list[dict]:
        measured = run.rows()
        return [done[p.stem] if p.stem in done else measured[p.stem] for p in files]

    with tempfile.TemporaryDirectory(prefix="stitchcuda-gpus-") as tmp:
        work = Path(tmp)
        one = None
        if scaling_run:
            one = spread(devices[:1], work / "one", [work / "one" / "rows.gpu0.jsonl"], caches(work / "one"))
        parts = [results.with_name(f"{results.name}.gpu{i}") if results is not None else work / f"rows.gpu{i}.jsonl"
                 for i in range(len(devices))]
        try:
            many = spread(devices, work / "many", parts, caches(work / "many") if scaling_run else {},
                          on_row if csv is not None else None)
        except KeyboardInterrupt:
            print(f"bench {bench}: interrupted; " + (f"the finished rows wait in {results.name}.gpu<i> beside "
                  f"{results} for the next run" if results is not None else "no rows kept (no --results)"),
                  file=sys.stderr, flush=True)
            raise
        rows = rows_of(many)
        if results is not None:  # the measured rows into F, in the problems' order; a lost problem runs again
            for row in rows:
                if row["model"] not in done and "process" not in row:
                    append_result(results, row)
            for part in parts:
                part.unlink(missing_ok=True)
        sections = {"gpus": many.section()}
        if one is not None:
            sections["scaling"] = scaling_report(one, many, rows_of(one), rows)
        # As the processes describe their device (the roofline's peaks), read before their reports go.
        hardware = many.hardware() or (one.hardware() if one is not None else None) or \
            {"gpu": None if compile_only else many.names[0]}
    device = (f"no GPU (compile-only, {len(devices)} processes)" if compile_only else _devices_label(many.names))
    text = [format_gpus(sections["gpus"])] + ([format_scaling(sections["scaling"])] if one is not None else [])
    return _report(rows, hardware, device, title,
                   folder=folder, settings=settings, resumed=sum(p.stem in done for p in files),
                   json_output=json_output, csv=csv, html=html, sections=sections, text=["", *text])


def run(json_output: bool = False) -> int:
    """`stitchcuda bench suite [--json]` as scripts/gpu-check calls it: options from the environment."""
    return run_suite("suite", json_output=json_output)
