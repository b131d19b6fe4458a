"""The verify stage's repairs: when the whole program does not match the model, REPAIR_POLICIES are tried
in order — each says when it applies and what it changes, then the program is rebuilt and verified again —
until one makes it match or none applies (the model then runs eagerly, with the mismatch as the reason)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..log import get_logger
from ..verify.compare import first_difference, tolerance_used
from ..verify.program import input_set
from ..verify.tolerance import tolerance
from .build import build_program
from .capture import Graph, Value
from .checks import STEP_DOWN, lossy_gemm, memory_target, step_down
from .lower import Lowering, stream_values
from .measure import allocated, flat_tensors, record_peak, timed_stage, verify_state
from .groups import GENERATED, Group, GraphPlan
from .state import PipelineState

__all__ = ["RepairPolicy", "REPAIR_POLICIES", "repair", "TRACE_ROUNDS", "TRACE_WINDOWS", "RESTORE_LATE", "restore_late",
           "trace_mismatch", "windows_of"]

log = get_logger(__name__)

# Whole-program mismatches traced and fixed, each by sending one group to ATen, before giving up.
TRACE_ROUNDS = 3
# A traced mismatch runs at most this many diagnostic programs (windows of the watched outputs, trace_mismatch).
TRACE_WINDOWS = 24
# How many of the GEMMs a whole-program mismatch stepped down are tried again at their own precision, latest first.
RESTORE_LATE = 2


@dataclass(frozen=True)
class RepairPolicy:
    """One way to repair a program that does not match the model. `applies(state)`: whether it can act
    on this state (the program failed verification, and what `when` says holds); `apply(state)` makes the
    change `changes` describes, rebuilds and verifies, and returns False when it found nothing to change.
    It is tried up to `rounds` times while the program still does not match."""

    name: str
    when: str
    changes: str
    applies: Callable[[PipelineState], bool]
    apply: Callable[[PipelineState], bool]
    rounds: int = 1


def repair(state: PipelineState, policies: tuple[RepairPolicy, ...] | None = None) -> None:
    """Tries `policies` (REPAIR_POLICIES) in order on a program that failed verification."""
    for policy in REPAIR_POLICIES if policies is None else policies:
        for _ in range(policy.rounds):
            if state.passed or not policy.applies(state):
                break
            log.info("repair: %s (%s): %s", policy.name, policy.when, policy.changes)
            if not policy.apply(state):
                break


def rebuild_and_verify(state: PipelineState, title: str) -> None:
    """The program built again from the state's plan (the failing one let go first: one program alive at a
    time) and verified; the report's verification is the new one's."""
    with state.steps.step(title), timed_stage(state.report, "trace_and_rebuild"):
        state.optimized = None  # its runner's memory goes before the next one is built
        state.optimized = build_program(state)
        state.report.verification = verify_state(state, state.optimized)
    record_peak(state.report, "trace_and_rebuild")


def _agents_changed_plan(state: PipelineState) -> bool:
    return state.plan.groups != state.offline_groups


def _drop_agents_steps(state: PipelineState) -> bool:
    # A kernel step passed its target's checks but the whole program does not match: keep the verified
    # offline program instead of losing every gain.
    detail = state.report.verification["detail"]
    state.plan.groups = state.offline_groups
    rebuild_and_verify(state, "rebuilding without the agents' kernel steps")
    for t in state.report.targets:
        if t["winner"] == "llm":
            t["winner"], t["note"] = "template", f"dropped: the whole program with it did not match ({detail})"
    state.report.decisions.append(("the agents' kernel steps left out", f"the whole program with them did not match "
                                   f"the model: {detail}"))
    return True


def _lossy_gemms(state: PipelineState) -> list[tuple[Group, str]]:
    return [(g, g.params["precision"]) for g in state.plan.groups if lossy_gemm(g) and id(g) not in state.fallback]


def _step_down_gemms(state: PipelineState) -> bool:
    # Precision before blame: a tf32x3 product within fp32's tolerance of SGEMM, or bf16 products within
    # bf16's, can still move a result that later ops amplify (a state-space scan's exponentials, a deep
    # stack of residual blocks), and tracing would then blame the groups downstream of it. Every such GEMM
    # steps down first (tf32x3 to SGEMM, bf16 products to TF32).
    lossy = _lossy_gemms(state)
    why = f"the whole program did not match the model ({state.report.verification['detail']})"
    for g, _ in lossy:
        step_down(g, state.report, why)
    rebuild_and_verify(state, f"rebuilding with {len(lossy)} GEMM(s) at higher precision")
    if state.passed:
        restore_late(state, lossy)
    return True


def _trace_to_a_group(state: PipelineState) -> bool:
    report = state.report
    with state.steps.step("tracing the mismatch to a group"), timed_stage(report, "trace_and_rebuild"):
        state.optimized.release()  # the mismatching program's working memory, while the diagnosis runs
        traced_inputs = flat_tensors(input_set(state.example_inputs, report.verification.get("failed_set") or 0))
        # What the memory target leaves beside the diagnosis's own forward (the program's, then ATen's):
        # the room its watched outputs may take at once.
        room = state.start_bytes + memory_target(state.graph) - allocated() - state.graph.working_set_bytes()
        culprit, why = trace_mismatch(state.graph, state.plan, state.constants, state.sm_count, state.fallback,
                                      traced_inputs, room=max(room, 0))
        traced_inputs = None
    if culprit is None:
        return False
    mismatch = (f"the whole program did not match the model ({report.verification['detail']}); traced to "
                f"this group: {why}")
    state.fallback.add(id(culprit))
    report.fallbacks.append({"group": culprit.name, "kind": culprit.kind, "reason": mismatch})
    rebuild_and_verify(state, f"rebuilding with {culprit.name} on ATen")
    return True


REPAIR_POLICIES: tuple[RepairPolicy, ...] = (
    RepairPolicy("drop the agents' kernel steps", "the agents replaced groups of the offline plan",
                 "the offline plan's groups come back (each agents' target's winner becomes the template path)",
                 _agents_changed_plan, _drop_agents_steps),
    RepairPolicy("GEMM precision step-down", "a GEMM still runs at a lossier precision (tf32x3, bf16 products)",
                 "every such GEMM steps down (tf32x3 to SGEMM, bf16 products to TF32); once the program matches, "
                 f"the latest {RESTORE_LATE} go back one at a time while it still matches",
                 lambda state: bool(_lossy_gemms(state)), _step_down_gemms),
    RepairPolicy("trace the mismatch to a group", "a generated group is left to suspect",
                 "the first group whose output differs from ATen's (or the nearest its tolerance) runs on ATen",
                 lambda state: True, _trace_to_a_group, rounds=TRACE_ROUNDS),
)


def restore_late(state: PipelineState, lowered: list[tuple[Group, str]]) -> None:
    """After a whole-program mismatch stepped every lossy GEMM down (`lowered`: each with the precision it
    had) and the program then matched: the latest of them (in program order) go back to their precision one
    at a time, each kept only if the whole program still matches. An error amplified downstream (a decay's
    exponential in a state-space scan) comes from a product early in the graph; a late one (an output
    projection) has little after it to amplify its error, and keeps its tensor-core speed. The state keeps
    the program that last passed."""
    report = state.report
    for g, precision in list(reversed(lowered))[:RESTORE_LATE]:
        lower, lower_name, name = STEP_DOWN[precision]
        g.params["precision"] = precision
        with state.steps.step(f"rebuilding with {g.name} as {name} again"), timed_stage(report, "trace_and_rebuild"):
            state.optimized = None  # one program alive at a time
            try:
                candidate = build_program(state)
                result = verify_state(state, candidate)
            except Exception as exc:  # a repair attempt: the stepped-down program still stands, the reason recorded
                candidate, result = None, {"passed": False, "detail": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
        if not result["passed"]:
            g.params["precision"] = lower
            report.decisions.append((f"{g.name}: {lower_name} kept", f"as {name} again, the whole program did not "
                                     f"match the model ({result['detail']})"))
            candidate = None
            # The program that passed, built again from the same plan (its kernels come from the cache):
            # the same program, so its verification stands.
            state.optimized = build_program(state)
            break
        state.optimized, report.verification = candidate, result
        report.decisions[:] = [d for d in report.decisions if d[0] != f"{g.name}: {lower_name} instead of {name}"]
        report.decisions.append((f"{g.name}: {name} again", f"after every lossy GEMM stepped down, this later one "
                                 f"went back to {name} and the whole program still matched the model"))


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
    windows = windows_of(watched, room)
    if room is not None:  # at most TRACE_WINDOWS diagnostic runs: past that, time goes before memory
        room = max(room, -(-sum(v.numel * v.dtype.itemsize for v in watched) // TRACE_WINDOWS), 1)
        windows = windows_of(watched, room)
        while len(windows) > TRACE_WINDOWS:  # values that pack badly: larger windows until they fit
            room *= 2
            windows = windows_of(watched, room)
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


def windows_of(values: list[Value], room: int | None) -> list[list[Value]]:
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
