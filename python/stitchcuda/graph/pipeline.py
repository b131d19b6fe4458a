"""Graph mode's stages, in order: capture -> plan -> check -> agents -> build -> verify and repair ->
measure. Each stage is a function of the PipelineState (graph/state.py) that fills its part and returns
None to go on or a Fallback that ends the run with the original model (and the reason). run_pipeline()
walks STAGES; an exception no stage expects is a StitchCUDA bug, reported as one (never a quiet "runs
eagerly"). Without a GPU, plan_only() runs capture, plan and build (NVRTC needs no GPU) for the report.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ..log import StepProgress, get_logger
from ..verify import hardware
from .agents import AgentBudget, run_agents
from .build import (Decided, build_program, decided_by, member_variants, nothing_to_gain, owning_constants,
                    planned_entries, record_unheld, used_in)
from .capture import CaptureError, Graph, capture
from .checks import check_groups, memory_target
from .lower import Lowering, LoweringError, constant_values
from .measure import (allocated, device_facts, explain_loss, measure_speed, not_faster, record_peak, timed_stage,
                      verify_state)
from .module import OptimizedModule, model_name
from .merge_launches import with_merge_decision
from .options import OptimizeOptions
from .groups import GENERATED, Group
from .planner import OfflinePlanner
from .repair import repair
from .report import Report
from .state import PipelineState
from .targets import merged_group

__all__ = ["Fallback", "STAGES", "run_pipeline", "run_stages", "plan_only", "capture_stage", "plan_stage", "check_stage",
           "agents_stage", "build_stage", "verify_stage", "measure_stage"]

log = get_logger(__name__)


@dataclass
class Fallback:
    """A stage's decision that the original model runs: `reason` becomes the report's. `keep_program`:
    the program built stays on the returned module (its .program, to inspect or save), unused by calls."""

    reason: str
    keep_program: bool = False


def capture_stage(state: PipelineState) -> Fallback | None:
    """The model as a core-ATen graph (graph/capture.py); starts the Verifier's worker meanwhile."""
    if state.options.isolated:
        from ..verify import trusted_pool  # the worker pool's module starts nothing on import, but is large

        state.pool = trusted_pool()
        state.pool.start()  # a first call's worker imports torch while the model is captured and planned
    report = state.report
    with state.steps.step("capturing"):
        t0 = time.perf_counter()
        state.graph = _specialized(state) or capture(state.model, state.example_inputs)
        report.stage_seconds["capture"] = time.perf_counter() - t0
    record_peak(report, "capture")
    report.op_counts = state.graph.op_counts()
    report.decisions += state.graph.notes
    return None


def _specialized(state: PipelineState) -> Graph | None:
    """The graph read from the program `state.exported` gives (a dynamic family's: the model exported
    once with its dims symbolic, specialized to these sizes), or None to export as usual: none given, or
    one that cannot be read (said in the log; the export that follows decides)."""
    if state.exported is None:
        return None
    try:
        return capture(state.model, state.example_inputs, exported=state.exported())
    except Exception as exc:  # the family's shortcut only: the model is exported at these sizes instead
        log.info("capture: the specialized symbolic export was not read (%s: %s); exporting at these sizes",
                 type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


def plan_stage(state: PipelineState) -> Fallback | None:
    """The offline Planner's groups (graph/planner.py) for this GPU's peaks; a plan with values no program
    buffer holds ends here."""
    options, report = state.options, state.report
    planner = OfflinePlanner(precision=options.precision, graphs=options.graphs, peaks=hardware.describe(),
                             split_tf32=options.split_tf32)
    with timed_stage(report, "plan"):
        state.plan = planner.plan(state.graph)
    report.decisions += state.plan.decisions
    report.groups = planned_entries(state.plan)  # what ran replaces it once the program is built
    unheld = record_unheld(state.plan, report)
    if unheld:
        return Fallback(unheld + ": the model runs eagerly")
    state.flat_inputs = [t for t in pytree.tree_flatten(state.example_inputs)[0] if isinstance(t, torch.Tensor)]
    state.sm_count, _ = device_facts()
    return None


def check_stage(state: PipelineState) -> Fallback | None:
    """Every generated group against its ATen subgraph (graph/checks.py); a failing one runs on ATen."""
    plan, report = state.plan, state.report
    with state.steps.step(f"generating and checking {sum(g.kind in GENERATED for g in plan.groups)} group(s)"):
        t0 = time.perf_counter()
        if state.pool is not None:
            report.decisions.append(("group checks in the Verifier's isolated worker",
                                     "generated code runs apart from this process until it matches ATen; "
                                     "recorded tensors reach it as CUDA IPC handles, not copies"))
        state.constants, state.values = check_groups(
            state.graph, plan, state.flat_inputs, state.sm_count, state.pool, t0, state.options.budget_s, report,
            state.fallback, keep_all=state.options.agents, room=state.start_bytes + memory_target(state.graph),
            forward=lambda: state.model(*state.example_inputs))
        report.stage_seconds["generate_and_check"] = time.perf_counter() - t0
    record_peak(report, "generate_and_check")
    state.offline_groups = list(plan.groups)
    return None


def agents_stage(state: PipelineState) -> Fallback | None:
    """With llm= (or resume=): the agents on the offline plan (graph/agents.py); each target's winner
    replaces its groups (an LLM kernel step), sends them to ATen, or leaves them."""
    options = state.options
    if not options.agents:
        log.info("agents: not run (no llm= given: the offline plan and template kernels only)")
        return None
    with state.steps.step("the agents: profile, choose targets, write and verify kernel steps"):
        t0 = time.perf_counter()
        drive_agents(state, AgentBudget(options.attempts, options.tokens, options.wall_s, options.max_targets,
                                        options.concurrency))
        state.report.stage_seconds["agents"] = time.perf_counter() - t0
    return None


def drive_agents(state: PipelineState, budget: AgentBudget) -> None:
    """The agents' run (run_agents) on the state's plan; the report gets one row per target and the run
    directory, the plan the LLM kernel steps that won, `fallback` the groups where ATen won."""
    from ..agents import hardware as agents_hardware  # the agents' layer sits above graph mode
    from ..verify import VerifyConfig, default_pool

    options, report, plan = state.options, state.report, state.plan
    # compare_compile=False spares each target's reference its torch.compile (tens of seconds a target).
    run = run_agents(state.graph, plan, state.values, state.constants, options.llm, name=model_name(state.model),
                     sm_count=state.sm_count, machine=agents_hardware(), run_dir=options.run_dir,
                     resume=options.resume, budget=budget, pool=default_pool(), on_event=options.on_event,
                     verify_config=VerifyConfig(compile_baseline=options.compare_compile))
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
            state.fallback.update(id(g) for g in res.groups if g.kind in GENERATED)
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


def build_stage(state: PipelineState) -> Fallback | None:
    """The Program (graph/build.py), in each variant worth timing; nothing is built when no program of the
    plan can beat the model."""
    state.values = None  # every recorded intermediate is freed here: the checks that read them are done
    plan = state.plan
    idle = "" if state.options.keep_slower else nothing_to_gain(plan, state.fallback, state.graph)
    if idle:
        # Building, verifying and timing such a program would only spend optimize()'s time and memory
        # (a fresh input set as large as the model's inputs) on the model's own calls.
        return Fallback(f"{idle}: the original model runs (nothing was built; keep_slower=True builds the program)")
    # From here on the constants only go into programs, which store them as host bytes anyway: host
    # copies give the GPU memory of those computed into tensors of their own (a folded mask, a value
    # computed from weights) back to the build, verification and timing. A view of a weight (a
    # transposed projection) holds nothing of its own and stays: a host copy would only add host memory.
    for name in owning_constants(state.constants, state.model):
        state.constants[name] = state.constants[name].to("cpu")
    state.contiguous_inputs = [t.contiguous() for t in state.flat_inputs]
    # The program's variants, timed against each other when there are several: the convolution chains'
    # layout (channels-last, NCHW) and, in the first layout, the convolution epilogues cuDNN can fuse
    # (planner.conv_epilogues) as one cuDNN call each instead of a convolution and a generated kernel.
    state.variants = [(layout, False) for layout in ([plan.channels_last, frozenset()] if plan.channels_last
                                                     else [frozenset()])]
    if plan.conv_epilogues:
        state.variants.append((state.variants[0][0], True))
    if state.decided is not None:  # a family member: the example's variant, not timed again
        state.variants = member_variants(plan, state.decided)
    with state.steps.step("building the program"), timed_stage(state.report, "build"):
        state.optimized = build_program(state)
    record_peak(state.report, "build")
    return None


def verify_stage(state: PipelineState) -> Fallback | None:
    """The whole program against the model (the Verifier's verify_whole); on a mismatch the repair
    policies (graph/repair.py) in order; still mismatching, the model runs eagerly."""
    report = state.report
    with state.steps.step(f"verifying on {state.options.verify_sets} input set(s)"), timed_stage(report, "verify"):
        report.verification = verify_state(state, state.optimized)
    record_peak(report, "verify")
    if not state.passed:
        repair(state)
    if not state.passed:
        return Fallback("the stitched program does not match the model: " + report.verification["detail"],
                        keep_program=True)
    return None


def measure_stage(state: PipelineState) -> Fallback | None:
    """Eager's and the program's time (the Verifier's timer): the program is kept only when faster, unless
    keep_slower."""
    options, report = state.options, state.report
    report.status = "optimized"
    if not (options.measure or not options.keep_slower):
        return None
    with state.steps.step("measuring"), timed_stage(report, "measure"):
        report.timing = measure_speed(state.model, state.optimized, state.example_inputs,
                                      options.compare_compile and options.measure)
    record_peak(report, "measure")
    why = not_faster(report.timing)
    # The kernels that cost more than their ATen ops, in report.timing; a family member's loss is said by its
    # times alone (the example's program, built first, carries this analysis).
    lost = explain_loss(state) if why and state.decided is None else ""
    if not options.keep_slower and why:
        return Fallback(f"the stitched program is not faster than the model on the example inputs ({why}, by the "
                        f"Verifier's timer){'; ' + lost if lost else ''}: the original model runs (keep_slower=True "
                        "keeps the program)", keep_program=True)
    return None


STAGES: tuple[tuple[str, Callable[[PipelineState], Fallback | None]], ...] = (
    ("capture", capture_stage), ("plan", plan_stage), ("check", check_stage), ("agents", agents_stage),
    ("build", build_stage), ("verify", verify_stage), ("measure", measure_stage))


def run_pipeline(model: torch.nn.Module, example_inputs: tuple, options: OptimizeOptions,
                 decided: Decided | None = None, exported: Callable[[], Any] | None = None) -> OptimizedModule:
    """optimize() on a module in eval mode and its positional inputs (keyword inputs already appended).
    A dynamic family's programs (graph/dynamic.py) pass `decided`, the choices a member takes from the
    example's program (build.Decided) instead of timing them — the module returned carries its own as
    `.decided` where a program was built — and `exported`, which gives the core-ATen program to capture
    from instead of exporting the model again."""
    state = PipelineState(model, tuple(example_inputs), options, steps=StepProgress(options.progress),
                          decided=decided, exported=exported)
    if not torch.cuda.is_available():
        state.report.reason = "no CUDA device: the model runs eagerly"
        if options.agents:
            state.report.reason += " (the agents did not run: they profile and verify kernels on a GPU)"
        plan_only(model, state.example_inputs, options.precision, options.graphs, state.report)
        return _eager(state, None)
    devices = {t.device for t in pytree.tree_flatten(state.example_inputs)[0] if isinstance(t, torch.Tensor)}
    devices |= {p.device for p in model.parameters()}
    if any(d.type != "cuda" for d in devices):
        return _eager(state, Fallback(f"the model and inputs must be on a CUDA device (found "
                                      f"{sorted(map(str, devices))}): call model.cuda() and move the inputs"))
    state.start_bytes = allocated()  # what optimize() found allocated: its own memory is measured above this
    return run_stages(state)


def run_stages(state: PipelineState, stages: tuple = STAGES) -> OptimizedModule:
    """Runs `stages` in order on `state` (each logged at INFO with its seconds). The first Fallback ends the
    run with the original model; CaptureError and LoweringError (what graph mode cannot take) do too, with
    their message; any other exception is a StitchCUDA bug: the report and the log say so, with the
    traceback, and the original model runs."""
    stage = "start"
    try:
        for stage, run in stages:
            t0 = time.perf_counter()
            stop = run(state)
            log.info("stage %s: %s (%.2f s)", stage, "stop: " + stop.reason if stop else "done",
                     time.perf_counter() - t0)
            if stop is not None:
                return _eager(state, stop)
        if state.optimized is not None and state.optimized.program is not None:
            state.optimized.decided = decided_by(state)
        return state.optimized
    except (CaptureError, LoweringError) as exc:  # what graph mode cannot take, with the reason and the fix
        return _eager(state, Fallback(str(exc)))
    except torch.OutOfMemoryError as exc:
        return _eager(state, Fallback(f"out of GPU memory in the {stage} stage ({str(exc).splitlines()[0]})"))
    except Exception as exc:  # a StitchCUDA bug: said as one, with the traceback, and the model runs
        return _internal_error(state, stage, exc)


def _eager(state: PipelineState, stop: Fallback | None) -> OptimizedModule:
    """The module that runs the original model, with the fallback's reason in the report and one warning
    in the log; `keep_program` leaves the built program on it (not run)."""
    report = state.report
    if stop is not None:
        report.status, report.reason = "eager", stop.reason
    log.warning("optimize(%s) runs the original model: %s", model_name(state.model), report.reason)
    if stop is not None and stop.keep_program and state.optimized is not None:
        state.optimized._runner = None
        return state.optimized
    return OptimizedModule(state.model, None, None, report)


def _internal_error(state: PipelineState, stage: str, exc: BaseException) -> OptimizedModule:
    report = state.report
    report.internal_error = traceback.format_exc()
    first = str(exc).splitlines()[0] if str(exc) else ""
    report.status = "eager"
    report.reason = (f"a StitchCUDA bug stopped optimize() in the {stage} stage ({type(exc).__name__}: {first}); the "
                     "original model runs instead. Please report it with the traceback (report.internal_error)")
    log.error("optimize(%s): internal error in the %s stage; the original model runs", model_name(state.model), stage,
              exc_info=exc)
    return OptimizedModule(state.model, None, None, report)


def plan_only(model: torch.nn.Module, example_inputs: tuple, precision: str, graphs: bool, report: Report) -> None:
    """Without a GPU: capture, plan, lower and compile (NVRTC needs no GPU), so the report shows what
    would run. Nothing is verified or timed; what stops it only adds to the reason (a StitchCUDA bug
    says so, its traceback in report.internal_error)."""
    try:
        graph = capture(model, example_inputs)
        report.op_counts = graph.op_counts()
        report.decisions += graph.notes
        plan = OfflinePlanner(precision=precision, graphs=graphs).plan(graph)
        report.decisions += plan.decisions
        report.groups = planned_entries(plan)
        unheld = record_unheld(plan, report)
        if unheld:
            report.reason += f"; planned only: {unheld}"
            return
        constants = constant_values(graph, {g.nodes[0].out.name for g in plan.groups
                                            if g.kind == "constant" and g.nodes[0].outputs})
        lowering = Lowering(graph, plan, constants)
        program = lowering.build(plan.groups, graph.inputs, graph.outputs)
        report.decisions[:] = with_merge_decision(report.decisions, lowering.b)
        program.compile_kernels()
        report.groups = []
        for g in plan.groups:
            if g.kind in ("view", "constant") and not used_in(g, lowering):
                continue
            entry = {"kind": g.kind, "nodes": ", ".join(n.op.removeprefix("aten::") for n in g.nodes), "reason": g.reason}
            code = lowering.main_kernels.get(id(g))
            if code is not None:
                entry.update(kernel=code.name, source=code.source, launch=f"grid {code.grid}, block {code.block}",
                             strategy=code.description)
            report.groups.append(entry)
        steps = [s["kind"] for s in program.steps]
        report.reason += (f"; planned and compiled only: {len(steps)} steps ({steps.count('kernel')} generated kernels, "
                          f"{steps.count('matmul')} cuBLASLt matmuls, {steps.count('aten')} ATen steps), "
                          "unverified until run on a GPU")
    except (CaptureError, LoweringError) as exc:  # planning is a courtesy here; the eager model is the answer
        report.reason += f"; planning without a GPU stopped: {type(exc).__name__}: {exc}"
    except Exception as exc:
        report.internal_error = traceback.format_exc()
        report.reason += (f"; planning without a GPU stopped on a StitchCUDA bug: {type(exc).__name__}: {exc} "
                          "(traceback in report.internal_error)")
        log.error("planning without a GPU: internal error", exc_info=exc)
