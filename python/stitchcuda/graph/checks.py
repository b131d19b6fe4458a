"""The check stage's work: every generated group checked against its ATen subgraph on the example
inputs while the graph runs once (check_groups), and the GEMM precision step-down a failed check or a
whole-program mismatch takes before ATen is the answer (STEP_DOWN, step_down)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..verify.program import release_host_memory
from .accuracy import ACCEPTED
from .capture import Graph, autocast_as
from .lower import check_group, group_inputs, reference_values, stream_values
from .measure import allocated
from .groups import GENERATED, Group, GraphPlan
from .report import Report

__all__ = ["memory_target", "check_wants", "check_groups", "STEP_DOWN", "PRECISION_TITLES", "lossy_gemm", "step_down",
           "checked_group"]


def memory_target(graph: Graph) -> int:
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


def check_groups(graph: Graph, plan: GraphPlan, inputs: list[torch.Tensor], sm_count: int, pool: Any, t0: float,
                 budget_s: float, report: Report, fallback: set[int], keep_all: bool, room: int | None = None,
                 forward: Callable[[], Any] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Checks every generated group against ATen on the example inputs while the graph runs once: a
    group is checked once its recorded inputs and outputs exist, and a recorded value is freed
    once the groups that read it are checked (stream_values), so optimize() holds about the eager
    forward's working set, not every intermediate at once. Groups still unchecked when `budget_s`
    seconds have passed since `t0` stay on ATen. `room`: the allocated bytes a check should stay within
    (memory_target above optimize's start); a check whose candidate outputs would pass it writes its
    large outputs into the recorded ones (check_group's room). `forward`: the model's own call on the
    example inputs, which gives the values when the checks want only the graph's inputs and outputs
    (stream_values). Returns the constant values (computed from weights alone) and, with `keep_all` (the
    agents read every value), all recorded values."""
    constant_names = {g.nodes[0].out.name for g in plan.groups if g.kind == "constant" and g.nodes[0].outputs}
    generated = [g for g in plan.groups if g.kind in GENERATED]
    wanted = check_wants(graph, plan)
    checker = _GroupChecker(graph, plan, sm_count, pool, report, room,
                            t0 + budget_s if budget_s and budget_s > 0 else float("inf"), budget_s)
    checker.by_id = {id(g): g for g in generated}
    values = None
    if forward is not None and graph.autocast is not None:
        forward = _under(graph.autocast, forward)
    # The graph holds the casts of the autocast it was captured under: it and the groups' programs run
    # with autocast off, the model's own forward under the captured one (capture.py, torch.autocast).
    with autocast_as(None):
        if keep_all:  # the agents profile and check groups later on the same recorded values
            values = reference_values(graph, inputs)
            checker.constants.update({n: values[n] for n in constant_names if n in values})
            for g in generated:
                checker.check(id(g), values)
        elif wanted or constant_names:  # else nothing to check or keep: the graph need not run at all
            # Constants (values computed from weights alone) are kept as they arrive: a group reading one
            # comes after it in the graph and takes it from `constants`, as the program will.
            stream_values(graph, inputs, wanted, checker.check, keep=constant_names, kept=checker.constants,
                          forward=forward)
            release_host_memory()  # the page-locked copies of outputs checked in place
    for g in generated:  # in plan order, so the report reads as the plan does
        ok, why, _ = checker.results[id(g)]
        if not ok:
            fallback.add(id(g))
            report.fallbacks.append({"group": g.name, "kind": g.kind, "reason": why})
    checker.record_decisions()
    return checker.constants, values


def _under(autocast: tuple[str, torch.dtype], call: Callable[[], Any]) -> Callable[[], Any]:
    def called() -> Any:
        with autocast_as(autocast):
            return call()
    return called


class _GroupChecker:
    """check_groups' one check per generated group (stream_values calls `check` as each group's values
    arrive) and its tallies for the report."""

    def __init__(self, graph: Graph, plan: GraphPlan, sm_count: int, pool: Any, report: Report, room: int | None,
                 deadline: float, budget_s: float) -> None:
        self.graph, self.plan, self.sm_count, self.pool, self.report, self.room = graph, plan, sm_count, pool, report, room
        self.deadline, self.budget_s = deadline, budget_s
        self.by_id: dict[int, Group] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.results: dict[int, tuple[bool, str, Any]] = {}
        self.memo: dict = {}  # group program -> verdict: identical groups (every layer's copy) are checked once
        self.shared = self.in_place = self.unchecked = 0

    def check(self, key: int, held: dict[str, torch.Tensor]) -> None:
        g = self.by_id[key]
        if time.perf_counter() > self.deadline:
            self.unchecked += 1
            self.results[key] = (False, f"not checked: the time budget of {self.budget_s:g} s (budget_s=) was spent "
                                        "on earlier groups", None)
            return
        try:
            stats: dict = {}
            self.results[key] = self._checked(g, held, stats)
            lossy = lossy_gemm(g)
            if not self.results[key][0] and step_down(g, self.report, f"the {lossy} product failed its check: "
                                                                      f"{self.results[key][1]}"):
                stats = {}
                self.results[key] = self._checked(g, held, stats)
            self.shared += bool(stats.get("shared"))
            self.in_place += bool(stats.get("in_place"))
        except Exception as exc:  # a value the stream never produced, or a bug: this group alone falls back
            self.results[key] = (False, f"{type(exc).__name__} while checking: {str(exc).splitlines()[0][:200]}", None)

    def _checked(self, g: Group, held: dict[str, torch.Tensor], stats: dict) -> tuple[bool, str, Any]:
        return checked_group(self.graph, self.plan, g, held, self.constants, self.sm_count, self.pool, self.report,
                             self.memo, stats, self.room)

    def record_decisions(self) -> None:
        report = self.report
        accepted = [why for ok, why, _ in self.results.values() if ok and why.startswith(ACCEPTED)]
        if accepted:
            report.decisions.append((f"{len(accepted)} group check(s) passed by the accuracy rule",
                                     "their 16-bit (or reduced-policy) outputs differ from ATen's, but are as close "
                                     "to the group run in fp64 as the rule asks (verify/tolerance.py); first: "
                                     + accepted[0].removeprefix(ACCEPTED + ": ")))
        if self.shared:
            report.decisions.append((f"{self.shared} group check(s) shared with an identical group",
                                     "the same kernels over the same shapes (a block's groups, repeated in every layer) "
                                     "are checked once on recorded values; the whole program is verified against the "
                                     "model on every input set"))
        if self.in_place:
            report.decisions.append((f"{self.in_place} group check(s) wrote their outputs in place",
                                     "a second copy of the outputs beside the recorded values would have passed the "
                                     "memory optimize() plans for (the eager forward's working set plus twice its "
                                     "largest input or output): the program wrote into the recorded tensors while "
                                     "their values waited in host memory, and got them back after the comparison"))
        if self.unchecked:
            report.decisions.append((f"{self.unchecked} group(s) left on ATen unchecked",
                                     f"optimize's time budget of {self.budget_s:g} s ran out (budget_s=)"))


# A GEMM group's lossier precisions and the more accurate one each steps down to before ATen is the answer,
# with the report's names for the two: tf32x3 (fp32's accuracy from TF32 products, held to fp32's
# tolerance) to cuBLAS's SGEMM; bf16 products of fp32 operands (held to bf16's) to TF32, what cuBLASLt's
# FAST_16BF mode computes on such operands.
STEP_DOWN = {"tf32x3": ("fp32", "SGEMM", "tf32x3"), "bf16": ("tf32", "TF32", "bf16 products")}
# How the report's titles of those decisions end: stepped down, kept there after a retry, restored.
PRECISION_TITLES = tuple(title for _, lower_name, name in STEP_DOWN.values()
                         for title in (f"{lower_name} instead of {name}", f"{lower_name} kept", f"{name} again"))


def lossy_gemm(g: Group) -> str | None:
    """The GEMM group's precision if it can step down (STEP_DOWN), else None. A bf16 GEMM of bf16 tensors
    computes as the model's dtype does: nothing to step down to."""
    precision = g.params.get("precision") if g.kind == "gemm" else None
    if precision not in STEP_DOWN:
        return None
    result = g.params.get("result")
    if precision == "bf16" and result is not None and result.dtype != torch.float32:
        return None
    return precision


def step_down(g: Group, report: Report, why: str) -> bool:
    """A tf32x3 or bf16-product GEMM group that failed (its check, or a whole-program mismatch) steps down
    (STEP_DOWN), which keeps its cuBLASLt step and fused epilogue, before ATen is the answer; the report
    says why. False for any other group."""
    precision = lossy_gemm(g)
    if precision is None:
        return False
    lower, lower_name, name = STEP_DOWN[precision]
    g.params["precision"] = lower
    report.decisions.append((f"{g.name}: {lower_name} instead of {name}", why))
    return True



def checked_group(graph: Graph, plan: GraphPlan, g: Group, held: dict, constants: dict, sm_count: int, pool: Any,
             report: Report, memo: dict | None = None, stats: dict | None = None,
             room: int | None = None) -> tuple[bool, str, Any]:
    """check_group, recording the GPU memory in use across both processes while it ran: this process's
    allocations at the check plus what the isolated worker allocated for it (stage "check_with_worker";
    the recorded tensors it reads through CUDA IPC are counted once, here). `memo` and `stats`: as
    check_group's. `room`: the allocated bytes the check should stay within; what is left of it beside this
    process's allocations goes to check_group, which checks large outputs in place when the candidate
    would not fit."""
    here = allocated()
    stats = {} if stats is None else stats
    result = check_group(graph, plan, g, held, constants, sm_count, pool, stats=stats, memo=memo,
                         room=None if room is None else room - here)
    both = here + int(stats.get("worker_peak_bytes") or 0)
    report.stage_peak_bytes["check_with_worker"] = max(both, report.stage_peak_bytes.get("check_with_worker", 0))
    return result
