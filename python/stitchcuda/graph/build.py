"""The build stage's work: the Program lowered from the plan, in each variant worth timing (channels-last
against NCHW, cuDNN-fused convolution epilogues against generated ones), the runner kept (CUDA graph
replay or direct launches), and the report's view of what was built (groups, memory)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..program import DTYPES, Program, ProgramModule
from .capture import Graph
from .lower import Lowering, working_bytes
from .measure import VARIANT_TIE, allocated, copy_ms, hardware_record, time_ms
from .merge_launches import with_merge_decision
from .module import OptimizedModule
from .groups import GENERATED, GraphPlan
from .report import Report
from .state import PipelineState, Variant

__all__ = ["build_program", "build_variant", "owning_constants", "program_memory", "choose_variant", "planned_bytes",
           "buffer_bytes", "variant_decisions", "choose_replay", "LAUNCH_US", "REPLAY_COPY_MARGIN", "replay_estimate",
           "nothing_to_gain", "is_replay_decision", "planned_entries", "record_unheld", "group_entries", "used_in",
           "Decided", "decided_by", "member_variants"]


def build_program(state: PipelineState) -> OptimizedModule:
    """The program of the state's plan; with several variants (a channels-last plan against the same plan
    in NCHW: the edges' conversions can cost more than cuDNN's own; fused convolution epilogues against
    generated ones), each is built and timed and the fastest kept (later rebuilds keep that one)."""
    plan, report = state.plan, state.report
    if len(state.variants) == 1:
        plan.channels_last, plan.fuse_conv_epilogues = state.variants[0]
        return build_variant(state)[0]
    # One program alive at a time: each is timed, then freed before the next is built (two arenas and two
    # replay runners at once would add a whole forward's activations to optimize's peak); the one chosen
    # is rebuilt at the end unless it was the last one built (its kernels come from the cache then).
    last, times, planned, described = None, {}, {}, {}
    for variant in state.variants:
        plan.channels_last, plan.fuse_conv_epilogues = variant
        last = None
        candidate, ms = build_variant(state)
        times[variant] = ms
        planned[variant] = planned_bytes(candidate.program)
        described[variant] = (list(report.groups), list(report.decisions))
        last, candidate = (variant, candidate), None
    chosen = choose_variant(times, planned)
    state.variants[:] = [chosen]  # later rebuilds (a traced mismatch) keep it
    plan.channels_last, plan.fuse_conv_epilogues = chosen
    if last[0] == chosen:
        best = last[1]
        report.groups, report.decisions[:] = described[chosen]  # the report describes the program kept
    else:
        last = None
        best = build_variant(state)[0]
    report.decisions[:] = [d for d in report.decisions if not d[0].startswith("convolution ")]
    report.decisions += variant_decisions(times, chosen, len(plan.conv_epilogues), planned)
    return best


def build_variant(state: PipelineState) -> tuple[OptimizedModule, float]:
    """The program in the plan's current variant, its runner, and its milliseconds per call where it was
    timed (a replay choice, or several variants to compare; inf otherwise). Rewrites the report's groups,
    memory and replay decision to describe it."""
    plan, report, graphs = state.plan, state.report, state.options.graphs
    lowering = Lowering(state.graph, plan, state.constants, state.sm_count)
    program = lowering.build(plan.groups, state.graph.inputs, state.graph.outputs, state.fallback, hardware_record())
    report.decisions[:] = with_merge_decision(report.decisions, lowering.b)
    program.compile_kernels()
    # The kernels of this program (its layout, its fused epilogues), not the group checks' programs.
    report.groups = group_entries(plan, lowering, state.fallback, lowering.main_kernels)
    runner, ms = None, float("inf")
    held: dict[bool, int] = {}
    report.memory = program_memory(program)
    decided = state.decided
    if graphs and decided is not None and decided.replay in ("graph", "direct"):
        # A family member runs as the example's program was found to run fastest: one runner, not two timed.
        why = f"as the example's program ({decided.why})"
        program.set_replay(decided.replay, why)
        runner = ProgramModule(program, graphs=decided.replay == "graph")
        report.decisions[:] = [d for d in report.decisions if not is_replay_decision(d)] + [(REPLAY_TITLES[
            decided.replay == "graph"], why)]
    elif graphs:
        runner, decision, ms = choose_replay(program, state.contiguous_inputs, held)
        report.decisions[:] = [d for d in report.decisions if not is_replay_decision(d)] + [decision]
        kept = program.replay["mode"] == "graph"
        if kept in held:
            report.memory["runner_bytes"] = held[kept]
    else:
        program.set_replay("direct", "graphs=False was requested")  # carried into the saved artifact
        if len(state.variants) > 1:
            runner = ProgramModule(program, graphs=False)
            ms = time_ms(lambda: runner.executor.run(state.contiguous_inputs))
    return OptimizedModule(state.model, program, state.graph, report, graphs=graphs, runner=runner), ms


def owning_constants(constants: dict[str, torch.Tensor], model: torch.nn.Module) -> list[str]:
    """The constants whose memory is their own: not views of the model's parameters or buffers."""
    shared = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return [name for name, t in constants.items() if t.untyped_storage().data_ptr() not in shared]



def program_memory(program: Program) -> dict[str, int]:
    """Report.memory's static part: the bytes of the program's own weights (constants and weights in a
    layout of their own, uploaded by each runner), of the weights its runners read in place from the
    model's parameters (Program.share_weight: no copy), of its planned arena, and what a call plans in all
    beside its inputs (planned_bytes: the arena, the most storages outside it alive at one step — ATen
    results, large intermediates — and the outputs; library workspaces are not in it)."""
    own = shared = 0
    for b in program.buffers:
        if b["role"] == "weight":
            n = buffer_bytes(b)
            if b["id"] in program.shared_weights:
                shared += n
            else:
                own += n
    return {"weights_bytes": int(own), "shared_weights_bytes": int(shared),
            "arena_bytes": int(program.buffer_plan()["arena_bytes"]), "planned_bytes": planned_bytes(program)}


def choose_variant(times: dict[Variant, float], planned: dict[Variant, int]
                    ) -> Variant:
    """The program variant to keep, by ms per call (`times`) and planned working memory in bytes
    (`planned`, planned_bytes): the fastest, unless another within VARIANT_TIE of it plans less memory (a
    channels-last chain's edge copies for a convolution that runs about as fast in NCHW). Ties on both:
    the first tried."""
    fastest = min(times.values())
    close = [v for v in times if times[v] <= fastest * (1 + VARIANT_TIE)]
    return min(close, key=lambda v: (planned.get(v, 0), times[v]))


def planned_bytes(program: Program) -> int:
    """The GPU memory a run of `program` plans beside its inputs: its arena, the most bytes of storages
    outside it alive at one step, and its outputs."""
    return working_bytes(program) + sum(buffer_bytes(b) for b in program.buffers if b["role"] == "output")


def buffer_bytes(b: dict) -> int:
    """The bytes of a program buffer's elements (one of Program.buffers)."""
    return math.prod(b["shape"]) * DTYPES[b["dtype"]].itemsize


def variant_decisions(times: dict[Variant, float], chosen: Variant,
                       epilogues: int, planned: dict[Variant, int] | None = None
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



def choose_replay(program: Program, inputs: list[torch.Tensor],
                   held: dict[bool, int] | None = None) -> tuple[ProgramModule, tuple[str, str], float]:
    """Times the program replayed as one CUDA graph and launched step by step on the example inputs and
    keeps the faster runner. A replay saves host time per launch but copies the inputs into, and the
    outputs out of, the graph's own buffers: on a few large kernels the copies cost more than they save.
    Returns the runner, the decision and its milliseconds per call (inf when neither mode ran); `held`
    receives, per mode timed (True: graph), the GPU memory its runner held after its timed calls."""
    held = {} if held is None else held

    def timed(runner: ProgramModule, graphs: bool) -> float:
        before = allocated()
        ms = time_ms(lambda: runner.executor.run(inputs))
        held[graphs] = held.get(graphs, 0) + allocated() - before
        return ms

    copies_ms, saved_ms = replay_estimate(program)
    if copies_ms > REPLAY_COPY_MARGIN * saved_ms:
        # Not worth building: the graph runner's static copies would add every input and output to the
        # process's memory to save less than the copies cost.
        why = (f"estimated, not measured: a replay copies the inputs and outputs ({copies_ms:.3f} ms at the GPU's "
               f"memory bandwidth) to save about {saved_ms:.3f} ms of launches ({len(program.steps)} steps)")
        program.set_replay("direct", why)
        before = allocated()
        runner = ProgramModule(program, graphs=False)
        held[False] = allocated() - before  # its weights
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
            before = allocated()
            runner = ProgramModule(program, graphs=graphs)
            held[graphs] = allocated() - before  # its weights
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
    decision = REPLAY_TITLES[use_graph]
    program.set_replay("graph" if use_graph else "direct", why)  # a saved artifact runs the same way
    kept = runners.pop(False, None) if not use_graph else None
    runners.clear()
    return kept or ProgramModule(program, graphs=use_graph), (decision, why), times[use_graph]


# A CUDA graph replay saves about this much host time per launched step, and a replay is measured only
# when its copies of the inputs and outputs cost less than REPLAY_COPY_MARGIN times what it saves.
LAUNCH_US = 5.0
REPLAY_COPY_MARGIN = 4.0


def replay_estimate(program: Program) -> tuple[float, float]:
    """(ms a replay spends copying the inputs in and the outputs out, ms of launches it saves), from the
    buffers' sizes, the GPU's memory bandwidth (the Verifier's table; 2 TB/s when unknown) and
    LAUNCH_US per step."""
    moved = 2 * sum(buffer_bytes(b) for b in program.buffers if b["role"] in ("input", "output"))  # read, write
    return copy_ms(moved), len(program.steps) * LAUNCH_US / 1e3



def nothing_to_gain(plan: GraphPlan, fallback: set[int], graph: Graph | None = None) -> str:
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
    if copy_ms(moved) <= REPLAY_COPY_MARGIN * LAUNCH_US / 1e3:
        return ""
    what = ", ".join(n.op.removeprefix("aten::") for g in computing for n in g.nodes)
    return (f"nothing to gain: the one step that computes ({what}) runs on ATen, as the model does, and a CUDA "
            f"graph replay would copy {moved / 2 / 2**20:,.0f} MiB of inputs and outputs to save one launch")


REPLAY_TITLES = {True: "replay as one CUDA graph", False: "launch the steps directly (no CUDA graph)"}


def is_replay_decision(decision: tuple[str, str]) -> bool:
    return decision[0] in REPLAY_TITLES.values()


@dataclass(frozen=True)
class Decided:
    """What optimize() timed on the example's program that a dynamic family's other members take from it
    instead of timing again at their size (graph/dynamic.py): the variant kept (convolution chains
    channels-last, convolution epilogues fused in cuDNN) and the runner (`replay`: "graph", "direct", or ""
    where none was measured); `why`: the measurement. Every member is still checked, verified and timed
    against eager at its own size."""

    channels_last: bool
    fused_epilogues: bool
    replay: str
    why: str


def decided_by(state: PipelineState) -> Decided:
    """The timed choices of the state's built program."""
    replay = state.optimized.program.replay
    mode = replay.get("mode", "")
    return Decided(bool(state.plan.channels_last), bool(state.plan.fuse_conv_epilogues),
                   mode if mode in ("graph", "direct") else "", replay.get("reason", ""))


def member_variants(plan: GraphPlan, decided: Decided) -> list[Variant]:
    """A member's one variant: the example's choice, in this plan's values (a plan without a
    channels-last chain or a fusable epilogue has only the plain one)."""
    return [(plan.channels_last if decided.channels_last else frozenset(),
             decided.fused_epilogues and bool(plan.conv_epilogues))]


def planned_entries(plan: GraphPlan) -> list[dict]:
    """The plan as report entries before anything is built (views and constants left out)."""
    return [{"kind": "aten (fallback)" if "unheld" in g.params else g.kind,
             "nodes": ", ".join(n.op.removeprefix("aten::") for n in g.nodes), "reason": g.reason}
            for g in plan.groups if g.kind not in ("view", "constant")]


def record_unheld(plan: GraphPlan, report: Report) -> str:
    """Records the ATen fallback groups whose values no program buffer holds (the planner's "unheld");
    returns why the program cannot be built around them, or "" when there are none."""
    groups = [g for g in plan.groups if "unheld" in g.params]
    for g in groups:
        report.fallbacks.append({"group": g.name, "kind": "aten", "reason": g.reason})
    if not groups:
        return ""
    first = groups[0]
    return (f"the stitched program cannot be built: {len(groups)} node(s) work on values no program buffer holds "
            f"(first: {first.nodes[0].op} '{first.name}' on {first.params['unheld']}; buffers hold "
            f"{', '.join(sorted(DTYPES))}); the rest of the model is planned (the report's groups)")


def group_entries(plan: GraphPlan, lowering: Lowering, fallback: set[int], codes: dict) -> list[dict]:
    """One report entry per group that ran: its kind, ops, why, and the kernel it became."""
    entries = []
    for g in plan.groups:
        if g.kind in ("view", "constant") and not used_in(g, lowering):
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


def used_in(g, lowering: Lowering) -> bool:
    return any(v is not None and v.name in lowering.buf for n in g.nodes for v in n.outputs)
