"""`stitchcuda bench suite`, `stitchcuda bench kernelbench`, `stitchcuda bench lowp` and `stitchcuda bench DIR`:
every problem in a folder of KernelBench-format files (Model, get_inputs, get_init_inputs) through eager PyTorch,
torch.compile (default and mode="reduce-overhead"), `stitchcuda.optimize` and, with --llm, optimize with
the agents, timed in one run, with the outputs checked against eager, memory against eager's, geomean
speed-ups over eager and fast_p per class, per KernelBench level and overall.

This module is the driver: the options, a problem's columns (run_model, plan_model) and the run. Each job
beside it has a module of its own in bench/: problems.py (the folders, selection, class, level), precision.py
(torch's flags and the tolerance at a precision), reference.py (comparison with eager, the fp64 reference),
memory.py (peaks and their sites), results.py (the results file, resume, rows, CSV), tables.py (speed-ups,
summaries, the printed table) and gpus.py (--gpus: devices, the shared queue, Spread, --scaling). The
names callers have used from here stay importable from here.

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
  --small          every problem at its SMALL sizes (a module-level dict of its constants' small values).
  --compile-modes M,N  torch.compile modes timed beside default and reduce-overhead (max-autotune-no-cudagraphs,
                   max-autotune), each with its compile seconds; the best compile mode is chosen among all.
  VARIANTS         a file's module-level VARIANTS ("bf16", "fp16", "autocast-bf16": precision.VARIANT_DTYPES)
                   makes one row per variant, `stem[variant]`: the model and inputs cast to its dtype, or
                   every column (optimize() included) under torch.autocast; the row's `accuracy` judges each
                   column against the high-precision reference by precision.accuracy_verdict (bench/lowp;
                   docs/graph.md, "Low-precision suite").
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
import gc
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable

import torch
import torch.utils._pytree as pytree

from ..settings import settings as environment  # not `settings`: run_suite names a row's settings so
from . import memory
# The driver's rooms (each re-exported here, the names callers of suite have always used):
from .gpus import (AGREEMENT_COLUMNS, SPEEDUP_TOLERANCE, Spread, child_devices, claim, compare_runs, devices_label,
                   format_gpus, format_scaling, queue_files, queue_order, scaling_report, spread_usage)
from .memory import forward_largest_tensor_bytes, largest_tensor_bytes, memory_ratio
from .precision import (PRECISION_WORDS, TORCH_FLAGS, add_accuracy, cast_variant, judged_precision,
                        precision_flags, precision_knobs, tolerance, variant_autocast, variant_fields)
from .problems import (BENCHES, CLASS_ORDER, CLASSES, default_dir, folder_problems, helper_files, load, model_files,
                       only_names, parse_chunk, problem_class, problem_level, suite_dir)
from .problems import Problem, expand_variants, shrink
from .reference import FP64_BUDGET_BYTES, compare_outputs, fp64_errors, fp64_reference, reference_dtype
from .results import (CSV_COLUMNS, ERROR_COLUMNS, ROW_PREFIX, ROW_SETTINGS, append_result, dumps, first_line,
                      fold_parts, jsonable, new_row, precision_conflict, read_results, row_mode, row_settings,
                      write_csv)
from .tables import (COMPILE_MODES, EAGER_DRIFT, EXTRA_COMPILE_MODES, FAST_P, SLOW, add_speedups, error_ratio, fast_p, format_table, full_summary,
                     summarize, summarize_classes, summarize_levels)

REPEATS = 30
FRESH_SEEDS = (1, 2)  # the two input sets made again by get_inputs(), beside the example inputs
from ..cli_support import EXIT_FAILURE, EXIT_NO_GPU, EXIT_USAGE, refuse


def _time_ms(fn: Callable[[], Any], warmup: int = 3, repeats: int = REPEATS) -> float:
    from ..verify import measure

    return measure(fn, repeats=repeats, warmup=warmup).median_ms


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


def _record_error(row: dict, column: str, got: Any, reference: Any) -> None:
    """The column's error against the fp64 reference into row["err_fp64"] (nothing without a reference)."""
    if reference is None:
        return
    try:
        errors = fp64_errors(got, reference, row.get("precision", "fp32"))
    except Exception as exc:  # out of memory for a slice: the column has no error, the row says why
        row.setdefault("fp64_errors", {})[column] = first_line(exc)
        return
    if errors is not None:
        row["err_fp64"][column] = errors


def _fp64_column(row: dict, model: torch.nn.Module, inputs: tuple, want: Any) -> Any:
    """The problem's fp64 reference (fp64_reference) and eager's error against it; records err_fp64
    (None when there is no reference) and fp64_note. A variant's row (a 16-bit model) falls back to an
    fp32 reference where the fp64 one does not fit, and records which in reference_dtype. Outside
    autocast: the reference is the model in exact arithmetic, not the variant's. Returns the reference
    or None."""
    try:
        with torch.autocast("cuda", enabled=False):
            dtype = reference_dtype(model, inputs, want) if row.get("variant") else torch.float64
            reference, note = fp64_reference(model, inputs, want, dtype=dtype)
        if reference is not None:
            row["reference_dtype"] = str(dtype).removeprefix("torch.")
        floating = [t for t in pytree.tree_leaves(want) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if row.get("variant") and floating:  # the accuracy rule's floor is one rounding of this dtype
            row["output_dtype"] = str(floating[0].dtype).removeprefix("torch.")
    except Exception as exc:  # a bug here is the row's note, never the run's end
        reference, note = None, f"skipped: {first_line(exc)}"
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


def problem_work(module: ModuleType, variant: str | None = None) -> dict:
    """{flops, bytes} of one forward, from the model and inputs built on the meta device (no memory, no
    GPU): `bytes` is the traffic no implementation avoids — parameters, buffers, inputs and outputs, each
    read or written once — so bytes / time is the bandwidth a problem achieved and FLOPs / time its
    compute rate, the two axes of the roofline. A `variant`'s bytes are those of its dtype."""
    with torch.device("meta"):
        torch.manual_seed(0)
        model = module.Model(*module.get_init_inputs()).eval()
        inputs = [torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) and t.device.type != "meta"
                  else t for t in module.get_inputs()]  # a tensor made outside the device context
        model, inputs = cast_variant(model, tuple(inputs), variant)
    meter = _work_meter()
    with torch.no_grad(), meter:
        out = model(*inputs)
    unique = {id(t): t for t in [*model.parameters(), *model.buffers(), *pytree.tree_leaves((inputs, out))]
              if isinstance(t, torch.Tensor)}
    return {"flops": meter.flops, "bytes": sum(t.numel() * t.element_size() for t in unique.values())}


def _record_work(row: dict, module: ModuleType, variant: str | None = None) -> None:
    try:
        row.update(problem_work(module, variant))
    except Exception as exc:  # an op without a meta kernel: the roofline leaves this problem out
        row["work_error"] = first_line(exc)


def _to_gpu(inputs: Iterable[Any]) -> tuple:
    return tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs)


def _load(path: Path, small: bool = False) -> ModuleType:
    """The problem's module; with `small` (--small), at its SMALL sizes."""
    return shrink(load(path)) if small else load(path)


def _on_gpu(path: Path, small: bool = False, variant: str | None = None) -> tuple[ModuleType, torch.nn.Module, tuple]:
    """The file's module, its model (seed 0, eval mode) and example inputs, on the GPU, in the variant's dtype."""
    module = _load(path, small)
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).cuda().eval()
    return (module, *cast_variant(model, _to_gpu(module.get_inputs()), variant))


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


def _compile_columns(row: dict, model: torch.nn.Module, inputs: tuple, reference: Any = None,
                     extra_modes: Iterable[str] = ()) -> None:
    """torch.compile's columns: default and reduce-overhead, then each of `extra_modes` (--compile-modes),
    each with its first call's seconds (compilation) in <column>_first_call_s."""
    modes = ["default", "reduce-overhead", *(m for m in extra_modes if m not in ("default", "reduce-overhead"))]
    for key, mode in ((f"{COMPILE_MODES[m]}_ms", None if m == "default" else m) for m in modes):
        column = key.removesuffix("_ms")
        receive = (lambda out, column=column: _record_error(row, column, out, reference)) if reference is not None \
            else None
        try:
            with _first_output_to(receive):
                row[key], first_s = _compiled_ms(model, inputs, mode)
            row[key.removesuffix("_ms") + "_first_call_s"] = round(first_s, 2)
        except Exception as exc:  # no compiler toolchain, a dynamo failure, out of memory: the row says so
            row["errors"][key.removesuffix("_ms")] = first_line(exc)
        _free_gpu()  # the compiled graphs (and reduce-overhead's CUDA-graph pool) go before the next column


def _check_set(name: str, run: Callable[[], tuple[Any, Any]], precision: str = "fp32") -> dict:
    """One input set's verdict; `run` returns (StitchCUDA's outputs, eager's). Errors are the verdict."""
    try:
        with torch.no_grad():
            got, want = run()
            ok, worst, detail = compare_outputs(got, want, precision)
    except Exception as exc:  # out of memory on a fresh set, a failing replay: this set is not correct
        return {"inputs": name, "correct": False, "error": first_line(exc)}
    entry: dict[str, Any] = {"inputs": name, "correct": ok, "max_abs_error": worst}
    if detail:
        entry["mismatch"] = detail
    return entry


def _seeded_inputs(module: ModuleType, model: torch.nn.Module, seed: int, variant: str | None = None) -> tuple:
    """get_inputs() under torch.manual_seed(seed), on the GPU, in the variant's dtype."""
    torch.manual_seed(seed)
    return cast_variant(model, _to_gpu(module.get_inputs()), variant)[1]


def _fresh_set(module: ModuleType, model: torch.nn.Module, fast: Any, seed: int,
               variant: str | None = None) -> tuple[Any, Any]:
    inputs = _seeded_inputs(module, model, seed, variant)
    want = _clone(model(*inputs))  # before StitchCUDA's call, in case either writes into its inputs
    return fast(*inputs), want


def _input_sets(module: ModuleType, model: torch.nn.Module, fast: Any, inputs: tuple, want: Any,
                precision: str = "fp32", variant: str | None = None) -> list[dict]:
    """StitchCUDA against eager on the example inputs and on get_inputs() under each of FRESH_SEEDS: a
    program that is right for one set of values only (a stale buffer, a baked-in constant) fails here.
    Judged under the tolerance for `precision`."""
    sets = [_check_set("example", lambda: (fast(*inputs), want), precision)]
    for seed in FRESH_SEEDS:
        sets.append(_check_set(f"seed={seed}", lambda seed=seed: _fresh_set(module, model, fast, seed, variant),
                               precision))
        gc.collect()  # the fresh set's tensors and outputs go before the next one
    if variant is not None:  # a 16-bit row: the accuracy rule on every set, against the set's own reference
        for entry, seed in zip(sets, (None, *FRESH_SEEDS)):
            entry["accuracy"] = _set_accuracy(model, fast, inputs if seed is None else
                                              _seeded_inputs(module, model, seed, variant), precision)
            gc.collect()
    return sets


def _set_accuracy(model: torch.nn.Module, fast: Any, inputs: tuple, precision: str) -> dict:
    """StitchCUDA's accuracy verdict on one input set by the Verifier's rule (verify.tolerance.judge_accuracy,
    every floating output): its error and eager's against the high-precision reference of that set
    (float64, float32 where that does not fit), computed outside autocast; the worst output's numbers.
    Errors are the verdict (ok False), a missing reference an unknown one (ok None)."""
    from ..verify.tolerance import judge_accuracy

    try:
        with torch.no_grad():
            want, got = _clone(model(*inputs)), fast(*inputs)
            with torch.autocast("cuda", enabled=False):
                dtype = reference_dtype(model, inputs, want)
                ref, note = fp64_reference(model, inputs, want, dtype=dtype)
            if ref is None:
                return {"ok": None, "note": note}
            triples = [(g, w, r) for g, w, r in zip(*(pytree.tree_leaves(x) for x in (got, want, ref)))
                       if isinstance(r, torch.Tensor) and r.is_floating_point()]
            verdicts = [judge_accuracy(g, w, r.to(g.device), precision, "fp64" if r.dtype == torch.float64 else "fp32")
                        for g, w, r in triples]
    except Exception as exc:  # out of memory for the reference, a failing replay
        return {"ok": False, "error_text": first_line(exc)}
    if not verdicts:
        return {"ok": None, "note": "no floating output"}
    worst = max(verdicts, key=lambda v: v.error - v.bound)  # the output closest to (or furthest past) its bound
    return {k: v for k, v in worst.to_dict().items() if k in ("ok", "error", "eager_error", "bound", "floor")}


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
        sites = environment().memory_sites  # allocation sites of optimize()'s peak to keep (bench.memory); 0: none
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
            variant = row.get("variant")
            sets = _input_sets(module, model, fast, inputs, want, judged_precision(precision, variant), variant)
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
        row["errors"]["stitchcuda"] = first_line(exc)
        row["traceback"] = traceback.format_exc(limit=6)
        row["correct"] = False


def _attempt_speedups(target_dir: str) -> list[float | None]:
    """Each finished attempt's speed-up over the target's ATen ops, in order (None: not correct, or a
    hack), from the target's run directory."""
    from ..agents.run_dir import RunDir

    out: list[float | None] = []
    for record in RunDir(target_dir).attempts():
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
            variant = row.get("variant")
            sets = _input_sets(module, model, fast, inputs, want, judged_precision(precision, variant), variant)
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
        row["errors"]["agents"] = first_line(exc)
        row["agents_correct"] = False


def _problem_row(path: Path, mode: str, precision: str, variant: str | None = None, small: bool = False,
                 compile_modes: Iterable[str] = ()) -> dict:
    """A row's start (new_row), named `stem[variant]` with the variant's fields (precision.variant_fields)
    for a variant, and the settings a resumed run must match (results.ROW_SETTINGS): --small,
    --compile-modes."""
    row = new_row(path, mode, precision)
    if variant is not None:
        row.update(model=Problem(path, variant).name, **variant_fields(variant))
    if small:
        row["small"] = True
    if compile_modes:
        row["compile_modes"] = list(compile_modes)
    return row


def run_model(path: Path, llm: str | None = None, precision: str = "fp32", compile_columns: bool = True,
              variant: str | None = None, small: bool = False, compile_modes: Iterable[str] = ()) -> dict:
    """One problem's row: times, speed-ups, correctness, memory, report status, FLOPs and bytes, every
    column's error against an fp64 reference; with `llm`, the agents' column too. `precision`: what
    optimize() gets and which tolerance judges the outputs; torch's flags are the caller's
    (precision_flags). `compile_columns=False` (--no-compile) skips the torch.compile columns (mode
    "no-compile"); `compile_modes` adds modes to default and reduce-overhead (--compile-modes).
    `variant` (a name of the file's VARIANTS): the model and inputs cast to its dtype, and under autocast
    every column, optimize() included, runs inside torch.autocast (variant_autocast); the row gets the
    accuracy verdicts (precision.add_accuracy). `small`: the file's SMALL sizes. Errors recorded, never
    raised. The caller frees the GPU after it (its tensors die with this frame)."""
    row = _problem_row(path, "timed" if compile_columns else "no-compile", precision, variant, small, compile_modes)
    if llm:
        row["llm"] = llm
    with variant_autocast(variant, "cuda"):
        try:
            module, model, inputs = _on_gpu(path, small, variant)
            want = _eager(row, model, inputs)
        except Exception as exc:  # the model itself does not load or run: nothing else can be measured
            row["errors"]["eager"] = first_line(exc)
            row["correct"] = False
            return row
        _record_work(row, module, variant)
        reference = _fp64_column(row, model, inputs, want)
        if compile_columns:
            _compile_columns(row, model, inputs, reference, compile_modes)
        _stitch_column(row, module, model, inputs, want, reference)
        if llm:
            _free_gpu()
            _agents_column(row, module, model, inputs, want, llm, reference)
    if variant is not None:
        add_accuracy(row)
    return add_speedups(row)


def plan_model(path: Path, precision: str = "fp32", variant: str | None = None, small: bool = False) -> dict:
    """One problem's row without timing (--compile-only, e.g. on a machine without a GPU): the file
    loads, its FLOPs and bytes are counted on the meta device, and graph mode captures, plans (with
    OfflinePlanner(precision=precision)), lowers and compiles every kernel with NVRTC on the CPU, as
    optimize() does where there is no GPU. Nothing runs on a GPU: no times, no speed-ups, `correct`
    None (unknown). The model and inputs are built on the CPU, so this suits problems that fit in host
    memory (`small`: the file's SMALL sizes). A `variant`'s model and inputs are cast to its dtype; an
    autocast variant is planned under the CPU's torch.autocast at its dtype (the CUDA one does nothing to
    CPU tensors; the two cast the same matmul and convolution ops to 16 bits). The row records the
    reference's dtype a timed run would use (reference_dtype: float64 where it fits in FP64_BUDGET_BYTES)."""
    from ..graph.pipeline import plan_only
    from ..graph.report import Report

    row = _problem_row(path, "compile-only", precision, variant, small)
    try:
        module = _load(path, small)
        _record_work(row, module, variant)
        torch.manual_seed(0)
        model, inputs = cast_variant(module.Model(*module.get_init_inputs()).eval(), tuple(module.get_inputs()),
                                     variant)
        if variant is not None:
            row["reference_dtype"] = str(reference_dtype(model, inputs)).removeprefix("torch.")
    except Exception as exc:  # the model itself does not load or build
        row["errors"]["eager"] = first_line(exc)
        row["correct"] = False
        return row
    report = Report()
    t0 = time.perf_counter()
    with variant_autocast(variant, "cpu"):
        plan_only(model, inputs, precision, True, report)  # never raises: a failure is in the reason
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


def _run_one(path: Path | Problem, llm: str | None = None, compile_only: bool = False, precision: str = "fp32",
             no_compile: bool = False, small: bool = False, compile_modes: Iterable[str] = ()) -> dict:
    """run_model (or plan_model) of a problem (a file, or a file's variant), and whatever escapes it (a bug
    here, not in the problem) as the row's error. Only the settings that differ from the defaults are
    passed on."""
    problem = path if isinstance(path, Problem) else Problem(path)
    path, variant = problem.path, problem.variant
    extra = {**({"precision": precision} if precision != "fp32" else {}),
             **({"variant": variant} if variant is not None else {}), **({"small": True} if small else {})}
    timed = {**extra, **({"compile_columns": False} if no_compile else {}),
             **({"compile_modes": tuple(compile_modes)} if compile_modes else {})}
    try:
        row = plan_model(path, **extra) if compile_only else run_model(path, llm, **timed) if llm else \
            run_model(path, **timed)
    except Exception as exc:
        row = {**_problem_row(path, row_mode(compile_only, no_compile), precision, variant, small,
                              () if compile_only else compile_modes), "correct": False,
               "errors": {"bench": first_line(exc)}, "traceback": traceback.format_exc(limit=6)}
        if llm and not compile_only:
            row["llm"] = llm
    _free_gpu()
    return row


def _refuse(bench: str, message: str, code: int, json_output: bool) -> int:
    """An early exit: the message on stderr, and as {"error": ...} on stdout under --json (docs/cli.md)."""
    return refuse(f"bench {bench}", message, code, json_output)


def _answer(code: int, rows: list[dict]) -> int:
    """A run that measured (`code` 0) in which a problem did not load, ran wrong or raised: exit 1 (the
    benchmark ran, the answer is no)."""
    return EXIT_FAILURE if code == 0 and any(r.get("correct") is False for r in rows) else code


def _setting(flag: str | None, name: str) -> str | None:
    """The flag's value, else the setting `name`'s (flags win)."""
    return flag if flag is not None else getattr(environment(), name)


def _measure_all(files: list[Path] | list[Problem], done: dict[str, dict], results: Path | None,
                 json_output: bool, *, llm: str | None = None, compile_only: bool = False, csv: Path | None = None,
                 claim: Callable[[int], bool] | None = None, precision: str = "fp32",
                 no_compile: bool = False, small: bool = False, compile_modes: Iterable[str] = ()) -> list[dict]:
    """The selected problems' rows in order: from `done` (the results file) or measured now, each problem's
    columns under torch's flags for `precision` (precision_flags: at fp32, TF32 off everywhere), restored
    after it. The CSV, when asked for, is rewritten after each problem. With `claim` (a process of a
    --gpus run), a problem is measured only when claim(its index) takes it from the shared queue; the
    others are left out. `files` may be Problems (a file's variants: rows named `stem[variant]`)."""
    rows = []
    for index, path in enumerate(files):
        name = path.name if isinstance(path, Problem) else path.stem
        if name in done:
            rows.append(done[name])
            continue
        if claim is not None and not claim(index):
            continue
        with precision_flags(precision):
            row = _run_one(path, llm, compile_only, precision, no_compile, small, compile_modes) \
                if (llm or compile_only or no_compile or precision != "fp32" or small or compile_modes
                    or isinstance(path, Problem)) else _run_one(path)
        rows.append(row)
        if results is not None:
            append_result(results, row)
        if csv is not None:
            write_csv(csv, rows)
        # One line per problem on stderr as it finishes, so a run cut short still reports what it measured.
        print(ROW_PREFIX + dumps(row), file=sys.stderr, flush=True)
        if not json_output:
            print(f"[suite] {row['model']}: done", file=sys.stderr, flush=True)  # progress: stderr
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
              queue: Path | str | None = None, precision: str = "fp32", no_compile: bool = False,
              small: bool = False, compile_modes: Iterable[str] = ()) -> int:
    """`stitchcuda bench <bench>` over `folder` (default: default_dir(bench)); `only`, `chunk` fall back to
    STITCHCUDA_SUITE_ONLY / _CHUNK; `results` a JSON-lines file to append to and resume from; `llm` adds
    the agents' column (optimize(llm=...)); `csv` and `html` are written from every selected row at the
    end (the CSV after each problem too); `compile_only` plans and compiles without timing (plan_model),
    the one mode that runs without a GPU; `no_compile` times eager and StitchCUDA without the torch.compile
    columns. `gpus` > 1 runs the problems in that many bench processes, one
    per GPU (Spread); `scaling` runs them on one GPU, then on `gpus`, and compares the two runs; `queue`
    makes this process one of a Spread's: it takes its problems from that shared queue. `precision`
    (fp32, tf32, bf16): torch's flags for every column (TORCH_FLAGS), optimize(precision=...) and the
    tolerance outputs are judged by; recorded in every row and in the JSON. `small`: every problem at its
    SMALL sizes (--small); `compile_modes`: torch.compile modes timed beside default and reduce-overhead
    (--compile-modes, EXTRA_COMPILE_MODES). A file naming VARIANTS runs once per variant (expand_variants).
    Exit codes: 0 measured, 2 usage (no folder, nothing selected, a bad chunk, --html without
    matplotlib, --llm or --no-compile with --compile-only, --gpus with a chunk, more GPUs than visible, --scaling with
    --results, an unknown precision, a results file holding rows of another precision), 3 no GPU."""
    if precision not in TORCH_FLAGS:
        return _refuse(bench, f"--precision must be one of {', '.join(TORCH_FLAGS)}, not {precision!r}", EXIT_USAGE,
                       json_output)
    if llm and compile_only:
        return _refuse(bench, "--llm needs a GPU run; it cannot be combined with --compile-only", EXIT_USAGE,
                       json_output)
    compile_modes = tuple(compile_modes)
    unknown_modes = [m for m in compile_modes if m not in EXTRA_COMPILE_MODES]
    if unknown_modes:
        return _refuse(bench, f"--compile-modes takes {', '.join(EXTRA_COMPILE_MODES)} (default and reduce-overhead "
                       f"always run), not {', '.join(unknown_modes)}", EXIT_USAGE, json_output)
    if compile_modes and (compile_only or no_compile):
        return _refuse(bench, "--compile-modes adds timed torch.compile columns; it cannot be combined with "
                       f"--{'compile-only' if compile_only else 'no-compile'}", EXIT_USAGE, json_output)
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
            problem = spread_usage(gpus, chunk, chunk_from_flag, results, scaling)
            if problem:
                raise ValueError(problem)
            devices = child_devices(gpus, compile_only)
        except ValueError as exc:
            return _refuse(bench, str(exc), EXIT_USAGE, json_output)
    files = queue_files(Path(queue)) if queue is not None else model_files(folder, only, chunk)
    unknown = {n for n in only_names(only) if n.partition("[")[0] not in {p.stem for p in folder_problems(folder)}} \
        if queue is None else set()
    if unknown:  # at KernelBench scale a typo would otherwise just shrink the run
        print(f"bench {bench}: --only names no file in {folder}: {', '.join(sorted(unknown))}", file=sys.stderr)
    helpers = helper_files(folder) if queue is None else []
    if helpers:
        print(f"bench {bench}: skipped {', '.join(p.name for p in helpers)}: no Model (a module the problems "
              "import, not a problem)", file=sys.stderr)
    if not files and queue is None:
        return _refuse(bench, f"no problem files in {folder} match only={only!r} chunk={chunk!r}", EXIT_USAGE,
                       json_output)

    problems = expand_variants(files, only) if queue is None else []
    if spread and (small or compile_modes or any(p.variant for p in problems)):
        return _refuse(bench, "--gpus and --scaling do not pass VARIANTS, --small or --compile-modes to their "
                       "processes yet; run in one process", EXIT_USAGE, json_output)
    if any(p.variant for p in problems):
        files = problems  # one row per variant, named stem[variant]
    results = Path(results) if results is not None else None
    csv = Path(csv) if csv is not None else None
    settings = {"mode": row_mode(compile_only, no_compile), "llm": llm or None, "precision": precision,
                "small": small, "compile_modes": list(compile_modes)}
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
                        precision=precision, no_compile=no_compile, small=small, compile_modes=compile_modes)
    hardware = _hardware(compile_only)
    device = hardware.get("gpu") or (torch.cuda.get_device_name() if torch.cuda.is_available() else
                                     "no GPU (compile-only)")
    code = _report(rows, hardware, device, title, folder=folder, settings=settings,
                   resumed=sum(p.stem in done for p in files), json_output=json_output, csv=csv, html=html)
    return code if queue is not None else _answer(code, rows)  # a --gpus run's processes: the parent judges


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
        atol, rtol = tolerance(precision)
        print(dumps({"device": device, "suite_dir": str(folder), "tolerance": {"atol": atol, "rtol": rtol},
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
    device = (f"no GPU (compile-only, {len(devices)} processes)" if compile_only else devices_label(many.names))
    text = [format_gpus(sections["gpus"])] + ([format_scaling(sections["scaling"])] if one is not None else [])
    return _answer(_report(rows, hardware, device, title,
                           folder=folder, settings=settings, resumed=sum(p.stem in done for p in files),
                           json_output=json_output, csv=csv, html=html, sections=sections, text=["", *text]), rows)


def run(json_output: bool = False) -> int:
    """`stitchcuda bench suite [--json]` as scripts/gpu-check calls it: options from the environment."""
    return run_suite("suite", json_output=json_output)
