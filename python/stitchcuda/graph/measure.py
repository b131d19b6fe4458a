"""The GPU facts, timing and verification the pipeline's stages share: the device's SM count and
description, the Verifier's timer, the GPU memory in use, the whole-program verification and the final
speed measurement with the keep decision's rule, and the report's per-stage seconds and memory peaks."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..verify import hardware  # describe() through the module: tests give it a GPU of their choice
from ..verify import program as whole_program  # EXACT_COPY_LIMIT_BYTES read at each call (tests lower it)
from ..verify import timing as verify_timing  # a module name: measure_speed() has an argument called measure
from .capture import Graph, under_autocast
from .groups import GraphPlan
from .report import Report
from .state import PipelineState

__all__ = ["device_facts", "hardware_record", "time_ms", "allocated", "copy_ms", "timed_stage", "record_peak",
           "flat_tensors", "verify_program", "fp64_too_large", "VARIANT_TIE", "MEASURE_ROUNDS", "MEASURE_REPEATS",
           "KEEP_MARGIN", "not_faster", "measure_speed", "verify_state"]

# Program variants whose times are within this share of the fastest's are a tie (the timer's spread on
# one model): of those, the one whose plan holds the least working memory is kept.
VARIANT_TIE = 0.02


def device_facts() -> tuple[int, str]:
    """(SM count, name) of the current GPU, as the Verifier describes it."""
    gpu = hardware.describe()
    if gpu["gpu"] is None:
        raise RuntimeError("no usable CUDA device (the driver sees none)")
    return gpu["sms"], gpu["gpu"]


def hardware_record() -> dict[str, str]:
    """The machine the program is verified on, recorded in the artifact: the Verifier's description of
    the GPU, the architecture its kernels are built for (sm_90a on Hopper), driver, CUDA and torch."""
    from .. import _C

    gpu = hardware.describe()
    arch = gpu["arch"] + ("a" if gpu["arch"].startswith("sm_9") else "")
    return {"device": gpu["gpu"], "arch": arch, "driver": str(_C.driver_version()), "cuda": gpu["cuda"],
            "torch": torch.__version__}


def time_ms(fn, repeats: int = 30) -> float:
    """Milliseconds per call of `fn()`: the median on the Verifier's protocol (verify.timing.measure:
    L2 flushed and persisting L2 reset before each call), so optimize()'s speed-ups mean what the
    Verifier's do."""
    return verify_timing.measure(fn, repeats=repeats, warmup=3).median_ms


def allocated() -> int:
    """The GPU memory PyTorch's allocator has handed out (0 without a GPU)."""
    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0


def copy_ms(moved: int) -> float:
    """Milliseconds to read and write `moved` bytes at the GPU's memory bandwidth (the Verifier's table;
    2 TB/s when unknown)."""
    return moved / ((hardware.describe().get("dram_tb_s") or 2.0) * 1e12) * 1e3


@contextlib.contextmanager
def timed_stage(report: Report, stage: str) -> Iterator[None]:
    """Adds the block's wall seconds to report.stage_seconds[stage] (a stage that runs again, a rebuild
    after a traced mismatch, adds up)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        report.stage_seconds[stage] = report.stage_seconds.get(stage, 0.0) + time.perf_counter() - t0


def record_peak(report: Report, stage: str) -> None:
    """Records the process's GPU memory peak so far at the end of `stage` (never resets the counter:
    a caller measuring optimize()'s own peak keeps its measurement)."""
    report.stage_peak_bytes[stage] = max(int(torch.cuda.max_memory_allocated()), report.stage_peak_bytes.get(stage, 0))


def flat_tensors(inputs) -> list[torch.Tensor]:
    return [t.contiguous() for t in pytree.tree_flatten(tuple(inputs))[0] if isinstance(t, torch.Tensor)]


def verify_program(model, optimized: Any, example_inputs, sets: int, plan: GraphPlan) -> dict:
    """The whole program against the module, judged by the Verifier (verify.program.verify_whole): the
    example inputs, then fresh random sets, under the tolerance table for the plan's precision; the
    error against an fp64 copy of the model too. {passed, input_sets, max_abs_error, max_rel_error_fp64,
    detail}."""
    graph = getattr(optimized, "_graph", None)
    # A graph captured under torch.autocast is judged against the model under that autocast (its fp64 copy
    # stays exact: autocast leaves fp64 tensors alone).
    return whole_program.verify_whole(under_autocast(model, getattr(graph, "autocast", None)), optimized,
                                      example_inputs, sets, plan.tolerance_precision,
                                      no_exact=fp64_too_large(plan, graph), release=getattr(optimized, "release", None))


def fp64_too_large(plan: GraphPlan, graph: Graph | None = None) -> str:
    """Why an fp64 copy of the model would not fit, or "": attention in fp64 runs PyTorch's math path,
    which materializes every score (batch x heads x queries x keys) — 14 GB for one 256 MiB attention;
    and any fp64 forward doubles the weights, the inputs and the working set, which optimize() may not
    hold beyond twice the model's largest tensor (its memory allowance over the eager forward)."""
    if graph is not None:
        floating = [v for v in (*graph.inputs, *graph.weights) if v.dtype.is_floating_point]
        need = 2 * (sum(v.numel * v.dtype.itemsize for v in floating) + graph.working_set_bytes())
        allowance = max(whole_program.EXACT_COPY_LIMIT_BYTES, 2 * graph.largest_tensor_bytes())
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
    if worst > whole_program.EXACT_COPY_LIMIT_BYTES:
        return (f"the fp64 attention would materialize {worst / 2**30:.1f} GiB of scores (no fused fp64 kernel), "
                f"above the {whole_program.EXACT_COPY_LIMIT_BYTES >> 20} MiB limit")
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


def not_faster(timing: dict) -> str:
    """Why the measured program does not beat eager ("" when it does): its median not below eager's by
    KEEP_MARGIN, or faster in at most half of the alternating rounds."""
    rounds = timing.get("rounds", 1)
    faster = timing.get("rounds_faster", rounds)
    stitched, eager = timing["stitched_ms"], timing["eager_ms"]
    if stitched * (1 + KEEP_MARGIN) < eager and 2 * faster > rounds:
        return ""
    return (f"{stitched:.4f} ms against eager {eager:.4f} ms per call, faster in {faster} of {rounds} alternating "
            f"rounds; kept only {KEEP_MARGIN:.0%} faster and in most rounds")


def measure_speed(model, optimized: Any, example_inputs, compare_compile: bool) -> dict:
    """Eager's and the program's ms per call on the example inputs (the median of MEASURE_ROUNDS
    alternating rounds, eager first in odd rounds, the program first in even ones) and, with
    `compare_compile`, torch.compile's; `rounds_faster`: in how many rounds the program was faster."""
    model = under_autocast(model, getattr(getattr(optimized, "_graph", None), "autocast", None))
    with torch.no_grad():
        eager_ms, stitched_ms = [], []
        for r in range(MEASURE_ROUNDS):
            for side in (("eager", "stitched") if r % 2 == 0 else ("stitched", "eager")):
                if side == "eager":
                    optimized.release()  # the model runs without the program's buffers beside it
                    eager_ms.append(time_ms(lambda: model(*example_inputs), repeats=MEASURE_REPEATS))
                else:
                    stitched_ms.append(time_ms(lambda: optimized(*example_inputs), repeats=MEASURE_REPEATS))
        eager, stitched = statistics.median(eager_ms), statistics.median(stitched_ms)
        timing = {"eager_ms": eager, "stitched_ms": stitched, "speedup_eager": eager / stitched,
                  "rounds_faster": sum(s < e for s, e in zip(stitched_ms, eager_ms)), "rounds": MEASURE_ROUNDS}
        if compare_compile:
            try:
                compiled = torch.compile(model)
                compiled(*example_inputs)
                timing["compile_ms"] = time_ms(lambda: compiled(*example_inputs))
                timing["speedup_compile"] = timing["compile_ms"] / stitched
            except Exception as exc:  # torch.compile may be unavailable (no compiler); say so
                timing["compile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return timing


def verify_state(state: PipelineState, optimized: Any) -> dict:
    """verify_program on the state's model, example inputs, plan and verify_sets."""
    return verify_program(state.model, optimized, state.example_inputs, state.options.verify_sets, state.plan)
