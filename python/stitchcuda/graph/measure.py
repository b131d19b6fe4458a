"""The GPU facts, timing and verification the pipeline's stages share: the device's SM count and
description, the Verifier's timer, the GPU memory in use, the whole-program verification and the final
speed measurement with the keep decision's rule, and the report's per-stage seconds and memory peaks."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any, Sequence

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
           "KEEP_MARGIN", "not_faster", "measure_speed", "verify_state", "LOSSES_LISTED", "losing_groups", "loss_text",
           "group_times", "explain_loss", "kernels_of_groups", "OTHER_STEPS", "no_truth_needed"]

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


def verify_program(model, optimized: Any, example_inputs, sets: int, plan: GraphPlan, no_exact: str = "") -> dict:
    """The whole program against the module, judged by the Verifier (verify.program.verify_whole): the
    example inputs, then fresh random sets, under the tolerance table for the plan's precision; the
    error against an fp64 copy of the model too. {passed, input_sets, max_abs_error, max_rel_error_fp64,
    detail}."""
    graph = getattr(optimized, "_graph", None)
    # A graph captured under torch.autocast is judged against the model under that autocast (its fp64 copy
    # stays exact: autocast leaves fp64 tensors alone).
    verdict = whole_program.verify_whole(under_autocast(model, getattr(graph, "autocast", None)), optimized,
                                         example_inputs, sets, plan.tolerance_precision,
                                         no_exact=no_exact or fp64_too_large(plan, graph),
                                         release=getattr(optimized, "release", None))
    verdict["precision"] = plan.tolerance_precision  # what judged it: a check of the same program at another size
    return verdict


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
    """verify_program on the state's model, example inputs, plan and verify_sets. A dynamic family's member
    (state.decided) makes the fp64 copy only where it decides (no_truth_needed): the example's verification
    reports the error against it."""
    spared = no_truth_needed(state.graph, state.plan.tolerance_precision) if state.decided is not None else ""
    return verify_program(state.model, optimized, state.example_inputs, state.options.verify_sets, state.plan,
                          no_exact=spared)


def no_truth_needed(graph: Graph, precision: str) -> str:
    """Why an fp64 copy of the model would decide nothing in a verification of `graph`'s outputs at
    `precision`, or "" where it would: an fp64 result judges only the outputs under the accuracy rule
    (16-bit ones, fp32 ones under TF32); fp32 outputs at fp32 are judged by the tolerance table, and the
    copy (the weights again in fp64, and its forward) would only add the error against it to the report."""
    from ..verify.tolerance import by_accuracy

    if any(by_accuracy(v.dtype, precision) for v in graph.outputs if v is not None):
        return ""
    return "its outputs are judged by the tolerance table alone (fp32 at fp32), which an fp64 result does not change"


# ---- why a program loses -------------------------------------------------------------------------------
#
# A program slower than eager is dropped; the report then says which of its kernels cost more than the ATen
# ops they replace. Each generated kernel is timed under CUPTI in one call of the program (the groups that
# share it, every layer's copy of a block's norm, add up), against the ATen ops of those groups timed alone
# the same way (on inputs of the recorded shapes: ATen's time does not depend on the values); the cuBLASLt,
# cuDNN and ATen steps together are one more row. Biggest loss first.

LOSSES_LISTED = 5  # rows named in the fallback's reason and warning; report.timing["slower_groups"] has all
OTHER_STEPS = "cuBLASLt, cuDNN, ATen and copy steps"  # the kind of the row of every kernel no group is named after


def losing_groups(rows: Sequence[dict]) -> list[dict]:
    """The rows (each {kernel, kind, nodes, groups, us, aten_us}: a generated kernel and the groups that run
    it, program and ATen microseconds per call) whose program time passes their ATen ops', with `loss_us`,
    biggest loss first. A row without both times is left out."""
    timed = [r for r in rows if isinstance(r.get("us"), (int, float)) and isinstance(r.get("aten_us"), (int, float))]
    return sorted(({**r, "loss_us": r["us"] - r["aten_us"]} for r in timed if r["us"] > r["aten_us"]),
                  key=lambda r: -r["loss_us"])


def loss_text(losses: Sequence[dict], limit: int = LOSSES_LISTED) -> str:
    """The losing rows in one sentence (the fallback's reason and warning): "" when none."""
    if not losses:
        return ""
    parts = []
    for r in losses[:limit]:
        what = f"kernel {r['kernel']}" if r.get("kernel") else r.get("kind", "steps")
        count = r.get("groups", 1)
        parts.append(f"{what} ({count} group{'s' if count != 1 else ''}: {r.get('nodes', '')}) {r['us']:.1f} us "
                     f"against ATen's {r['aten_us']:.1f} us (+{r['loss_us']:.1f} us)")
    more = f"; {len(losses) - limit} more in report.timing['slower_groups']" if len(losses) > limit else ""
    return "kernels slower than their ATen ops, biggest loss first: " + "; ".join(parts) + more


def kernels_of_groups(plan: GraphPlan, entries: Sequence[dict]) -> dict[int, str]:
    """id(group) -> the name of the generated kernel it runs, read from the report's group entries, which are
    in plan order but leave out the views and constants nothing read."""
    found: dict[int, str] = {}
    k = 0
    for g in plan.groups:
        if k >= len(entries):
            break
        e = entries[k]
        if g.kind in ("view", "constant") and (e.get("kind") != g.kind or
                                              e.get("nodes") != ", ".join(n.op.removeprefix("aten::") for n in g.nodes)):
            continue  # left out of the entries
        if e.get("kernel"):
            found[id(g)] = e["kernel"]
        k += 1
    return found


def _kernel_us(call, calls: int = 3) -> dict[str, float]:
    """Microseconds per call of each kernel `call()` launches, by name, under CUPTI (one untimed call first)."""
    from .. import profile

    call()
    torch.cuda.synchronize()
    with profile.trace(kernels=True, memory=False, api_calls=False) as t:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for k in t.trace.kernels:
        times[str(k.name)] = times.get(str(k.name), 0.0) + k.duration_ns / calls / 1e3
    return times


def _aten_us(state: PipelineState, g: Any) -> float | None:
    """Microseconds per call of the group's ATen ops alone (its sub-problem, as the agents profile a target), on
    its weights and constants and on stand-ins of the recorded shapes for the rest (normal values, zeros for
    integers: valid indices); None where they cannot run apart."""
    from .targets import subproblem

    try:
        values = {}
        for v in g.inputs():
            if v.kind != "weight":
                values[v.name] = state.constants.get(v.name)
                if values[v.name] is None:
                    values[v.name] = torch.zeros(v.shape, dtype=v.dtype, device="cuda")
                    if v.dtype.is_floating_point:
                        values[v.name].normal_()
        sub = subproblem(state.graph, [g], values, g.name)
        model, _ = sub.build()
        feed = [(v.data if v.kind == "weight" else values[v.name]).contiguous() for v in sub.inputs]
        with torch.no_grad():
            return sum(_kernel_us(lambda: model(*feed)).values())
    except Exception:  # an op that cannot run on its own (a data-dependent size): that row is not compared
        return None


def group_times(state: PipelineState) -> tuple[list[dict], str]:
    """(one row per generated kernel of the program and one for its other steps: {kernel, kind, nodes, groups,
    us, aten_us}, ""), or ([], why not) where CUPTI or the program cannot be timed. Needs a GPU."""
    plan, program = state.plan, getattr(state.optimized, "program", None)
    if program is None:
        return [], "no program to time"
    try:
        state.optimized.release()  # its working memory, while a runner without CUDA graphs is timed
        executor = program.executor(graphs=False)
        feed = [t.contiguous() for t in state.contiguous_inputs or flat_tensors(state.example_inputs)]
        with torch.no_grad():
            program_us = _kernel_us(lambda: executor.run(feed))
        executor.release()
    except Exception as exc:  # no CUPTI, a program that cannot run apart: the fallback's reason stays as it was
        return [], f"not measured: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    kernel_of = kernels_of_groups(plan, state.report.groups)
    rows: dict[str, dict] = {}
    signatures: dict[tuple, float | None] = {}  # the same ops on the same shapes (every layer's copy) timed once
    for g in plan.groups:
        if g.kind == "constant":  # computed once from the weights, in neither forward
            continue
        key = (tuple(n.op for n in g.nodes), tuple((v.shape, v.dtype, v.kind) for v in g.inputs()))
        if key not in signatures:
            signatures[key] = _aten_us(state, g)
        # A GEMM's generated kernel is its epilogue beside cuBLASLt's product: the group goes with the other steps.
        name = kernel_of.get(id(g), "") if g.kind != "gemm" else ""
        row = rows.setdefault(name, {"kernel": name, "kind": g.kind if name else OTHER_STEPS, "groups": 0,
                                     "nodes": ", ".join(n.op.removeprefix("aten::") for n in g.nodes) if name else "",
                                     "aten_us": 0.0})
        row["groups"] += 1
        aten = signatures[key]
        row["aten_us"] = None if row["aten_us"] is None or aten is None else row["aten_us"] + aten
    for name, row in rows.items():
        row["us"] = sum(us for k, us in program_us.items() if _base_name(k) == name)
    if "" in rows:  # every kernel no generated group is named after: cuBLASLt, cuDNN, ATen, layout copies
        rows[""]["us"] = sum(us for k, us in program_us.items() if _base_name(k) not in rows)
    return list(rows.values()), ""


def _base_name(kernel: str) -> str:
    return kernel.split("(", 1)[0]


def explain_loss(state: PipelineState) -> str:
    """Why the program lost to eager, per kernel (group_times, losing_groups): recorded in
    report.timing ("slower_groups", or "slower_groups_note" where they could not be timed) and in the group
    entries of the generated kernels (`us`, `aten_us`: the report's per-group time plot), and returned as
    loss_text's sentence for the fallback's reason ("" when nothing was found slower)."""
    rows, why = group_times(state)
    timing = state.report.timing
    if why:
        timing["slower_groups_note"] = why
        return ""
    losses = losing_groups(rows)
    timing["slower_groups"] = losses
    # Each generated kernel's groups share its shapes (they are in its source): each entry gets the share.
    per_kernel = {r["kernel"]: r for r in rows if r["kernel"] and r["groups"] and r["aten_us"] is not None}
    for entry in state.report.groups:
        r = per_kernel.get(entry.get("kernel", ""))
        if r is not None and entry.get("kind") != "gemm":
            entry["us"], entry["aten_us"] = r["us"] / r["groups"], r["aten_us"] / r["groups"]
    return loss_text(losses)
