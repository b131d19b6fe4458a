"""`stitchcuda.optimize(model, example_inputs)`: capture, plan, generate, verify, and return a module that
runs the stitched program — or the original model with the reason, whenever any stage cannot proceed.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from ..program import Program, ProgramModule
from ..verify.hardware import describe
from ..verify.compare import first_difference, tolerance_used
from ..verify.program import input_set, verify_whole
from ..verify.tolerance import tolerance
from ..verify import timing as verify_timing  # a module name: optimize() has an argument called measure
from .capture import CaptureError, Graph, capture
from .lower import Lowering, LoweringError, check_group, reference_values
from .agents import AgentBudget, run_agents
from .planner import GENERATED, Group, OfflinePlanner, GraphPlan
from .report import Report, _Progress
from .targets import merged_group

__all__ = ["optimize", "OptimizedModule", "Report", "BUDGET_S", "trace_mismatch"]

# Seconds of generating and checking groups after which the rest stay on ATen (optimize's budget_s).
BUDGET_S = 60.0
# Whole-program mismatches traced and fixed, each by sending one group to ATen, before giving up.
TRACE_ROUNDS = 3


class OptimizedModule(torch.nn.Module):
    """Runs the stitched program (or the original module when optimization did not apply)."""

    def __init__(self, original: torch.nn.Module, program: Program | None, graph: Graph | None, report: Report,
                 graphs: bool = True, runner: ProgramModule | None = None) -> None:
        super().__init__()
        self.original = original
        self.report = report
        self.program = program
        self._graph = graph
        if runner is None and program is not None:
            runner = ProgramModule(program, graphs=graphs)
        self._runner = runner

    def forward(self, *args, **kwargs):
        if self._runner is None:
            return self.original(*args, **kwargs)
        flat, _ = pytree.tree_flatten((args, kwargs))
        tensors = [t.contiguous() for t in flat if isinstance(t, torch.Tensor)]
        outs = self._runner.executor.run(tensors)
        return pytree.tree_unflatten(outs, self._graph.out_spec)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the stitched program as a `.stitch` artifact (CUBINs included) for C++ servers."""
        if self.program is None:
            raise RuntimeError(f"nothing to save: the model runs eagerly ({self.report.reason})")
        self.program.save(path)


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


def _choose_replay(program: Program, inputs: list[torch.Tensor]) -> tuple[ProgramModule, tuple[str, str]]:
    """Times the program replayed as one CUDA graph and launched step by step on the example inputs and
    keeps the faster runner. A replay saves host time per launch but copies the inputs into, and the
    outputs out of, the graph's own buffers: on a few large kernels the copies cost more than they save."""
    times: dict[bool, float] = {}
    errors: dict[bool, str] = {}
    runners: dict[bool, ProgramModule] = {}
    for graphs in (True, False):
        try:
            runner = ProgramModule(program, graphs=graphs)
            times[graphs] = _time_ms(lambda r=runner: r.executor.run(inputs))
            runners[graphs] = runner
        except Exception as exc:  # the other mode may still run; verification judges the one kept
            errors[graphs] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    if len(times) == 2:
        graph_ms, direct_ms = times[True], times[False]
        use_graph = graph_ms <= direct_ms
        why = (f"measured on the example inputs: CUDA graph replay {graph_ms:.4f} ms, direct launches "
               f"{direct_ms:.4f} ms per call")
    elif times:
        use_graph = next(iter(times))
        why = f"the other mode failed: {errors[not use_graph]}"
    else:  # neither ran: keep the graph runner and let verification report the failure
        return ProgramModule(program, graphs=True), ("replay as one CUDA graph", f"neither mode ran: {errors[True]}")
    decision = "replay as one CUDA graph" if use_graph else "launch the steps directly (no CUDA graph)"
    program.set_replay("graph" if use_graph else "direct", why)  # a saved artifact runs the same way
    return runners[use_graph], (decision, why)


def optimize(model: torch.nn.Module, example_inputs: Sequence[Any], *, llm: Any = None, precision: str = "fp32",
             graphs: bool = True, verify_sets: int = 3, measure: bool = True, compare_compile: bool = True,
             progress: bool | None = None, isolated: bool = True, run_dir: str | os.PathLike | None = None,
             resume: str | os.PathLike | None = None, attempts: int = 3, tokens: int = 0, wall_s: float = 0.0,
             max_targets: int = 4, concurrency: int = 4, on_event: Any = None, budget_s: float = BUDGET_S,
             keep_slower: bool = False) -> OptimizedModule:
    """Optimizes `model` for inputs shaped like `example_inputs` (on a CUDA device).

    Returns an OptimizedModule whose `.report` says what was done and why; when a stage cannot proceed
    (capture, lowering, verification, no GPU) the module runs the original model and the report says why.
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
    """
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
    was_training = model.training
    model.eval()
    try:
        with steps.step("capturing"):
            t0 = time.perf_counter()
            graph = capture(model, example_inputs)
            report.stage_seconds["capture"] = time.perf_counter() - t0
        report.op_counts = graph.op_counts()
        planner = OfflinePlanner(precision=precision, graphs=graphs)
        plan = planner.plan(graph)
        report.decisions += plan.decisions
        flat_inputs = [t for t in pytree.tree_flatten(example_inputs)[0] if isinstance(t, torch.Tensor)]
        values = reference_values(graph, flat_inputs)
        constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups
                     if g.kind == "constant" and g.nodes[0].outputs and g.nodes[0].out.name in values}
        sm_count, device_name = _device_facts()
        fallback: set[int] = set()
        codes = {}
        with steps.step(f"generating and checking {sum(g.kind in GENERATED for g in plan.groups)} group(s)"):
            t0 = time.perf_counter()
            pool = None
            if isolated:
                from ..verify import trusted_pool

                pool = trusted_pool()
                report.decisions.append(("group checks in the Verifier's isolated worker",
                                         "generated code runs apart from this process until it matches ATen; "
                                         "recorded tensors reach it as CUDA IPC handles, not copies"))
            deadline = t0 + budget_s if budget_s and budget_s > 0 else float("inf")
            unchecked = 0
            for g in plan.groups:
                if g.kind not in GENERATED:
                    continue
                if time.perf_counter() > deadline:
                    unchecked += 1
                    fallback.add(id(g))
                    report.fallbacks.append({"group": g.name, "kind": g.kind, "reason": f"not checked: the time "
                                             f"budget of {budget_s:g} s (budget_s=) was spent on earlier groups"})
                    continue
                ok, why, code = check_group(graph, plan, g, values, constants, sm_count, pool)
                codes[id(g)] = code
                if not ok:
                    fallback.add(id(g))
                    report.fallbacks.append({"group": g.name, "kind": g.kind, "reason": why})
            report.stage_seconds["generate_and_check"] = time.perf_counter() - t0
            if unchecked:
                report.decisions.append((f"{unchecked} group(s) left on ATen unchecked",
                                         f"optimize's time budget of {budget_s:g} s ran out (budget_s=)"))
        offline_groups = list(plan.groups)
        if llm is not None or resume is not None:
            with steps.step("the agents: profile, choose targets, write and verify kernel steps"):
                t0 = time.perf_counter()
                _drive_agents(graph, plan, values, constants, sm_count, llm, report, fallback,
                              name=type(model).__name__, run_dir=run_dir, resume=resume,
                              budget=AgentBudget(attempts, tokens, wall_s, max_targets, concurrency), on_event=on_event,
                              compare_compile=compare_compile)
                report.stage_seconds["agents"] = time.perf_counter() - t0
        values = None  # every recorded intermediate is freed here: the checks that read them are done
        contiguous_inputs = [t.contiguous() for t in flat_inputs]

        def build() -> OptimizedModule:
            lowering = Lowering(graph, plan, constants, sm_count)
            program = lowering.build(plan.groups, graph.inputs, graph.outputs, fallback, _hardware())
            program.compile_kernels()
            report.groups = _group_entries(plan, lowering, fallback, codes)
            runner = None
            if graphs:
                runner, decision = _choose_replay(program, contiguous_inputs)
                report.decisions[:] = [d for d in report.decisions if not _is_replay_decision(d)] + [decision]
            else:
                program.set_replay("direct", "graphs=False was requested")  # carried into the saved artifact
            return OptimizedModule(model, program, graph, report, graphs=graphs, runner=runner)

        with steps.step("building the program"):
            optimized = build()
        with steps.step(f"verifying on {verify_sets} input set(s)"):
            report.verification = _verify(model, optimized, example_inputs, verify_sets, plan)
        if not report.verification["passed"] and plan.groups != offline_groups:
            # A kernel step passed its target's checks but the whole program does not match: keep the
            # verified offline program instead of losing every gain.
            detail = report.verification["detail"]
            plan.groups = offline_groups
            with steps.step("rebuilding without the agents' kernel steps"):
                optimized = build()
                report.verification = _verify(model, optimized, example_inputs, verify_sets, plan)
            for t in report.targets:
                if t["winner"] == "llm":
                    t["winner"], t["note"] = "template", f"dropped: the whole program with it did not match ({detail})"
            report.decisions.append(("the agents' kernel steps left out", f"the whole program with them did not match "
                                     f"the model: {detail}"))
        for _ in range(TRACE_ROUNDS):
            if report.verification["passed"]:
                break
            with steps.step("tracing the mismatch to a group"):
                culprit, why = trace_mismatch(graph, plan, constants, sm_count, fallback,
                                              _flat_tensors(input_set(example_inputs,
                                                                      report.verification.get("failed_set") or 0)))
            if culprit is None:
                break
            fallback.add(id(culprit))
            report.fallbacks.append({"group": culprit.name, "kind": culprit.kind, "reason": "the whole program did "
                                     f"not match the model ({report.verification['detail']}); traced to this group: "
                                     f"{why}"})
            with steps.step(f"rebuilding with {culprit.name} on ATen"):
                optimized = build()
                report.verification = _verify(model, optimized, example_inputs, verify_sets, plan)
        if not report.verification["passed"]:
            report.status = "eager"
            report.reason = "the stitched program does not match the model: " + report.verification["detail"]
            optimized._runner = None
            return optimized
        report.status = "optimized"
        if measure or not keep_slower:
            with steps.step("measuring"):
                report.timing = _measure(model, optimized, example_inputs, compare_compile and measure)
            t = report.timing
            if not keep_slower and t["stitched_ms"] >= t["eager_ms"]:
                report.status = "eager"
                report.reason = (f"the stitched program is not faster than the model on the example inputs "
                                 f"({t['stitched_ms']:.4f} ms against eager {t['eager_ms']:.4f} ms per call, by "
                                 "the Verifier's timer): the original model runs (keep_slower=True keeps the "
                                 "program)")
                optimized._runner = None
        return optimized
    except (CaptureError, LoweringError) as exc:
        report.reason = str(exc)
        return OptimizedModule(model, None, None, report)
    except Exception as exc:  # anything else: never break the caller, say what happened
        report.reason = f"{type(exc).__name__} while optimizing: {exc}"
        return OptimizedModule(model, None, None, report)
    finally:
        model.train(was_training)


def _flat_tensors(inputs) -> list[torch.Tensor]:
    return [t.contiguous() for t in pytree.tree_flatten(tuple(inputs))[0] if isinstance(t, torch.Tensor)]


def _is_replay_decision(decision: tuple[str, str]) -> bool:
    return decision[0] in ("replay as one CUDA graph", "launch the steps directly (no CUDA graph)")


def trace_mismatch(graph: Graph, plan: GraphPlan, constants: dict, sm_count: int, fallback: set[int],
                   inputs: list[torch.Tensor]) -> tuple[Group | None, str]:
    """The group that makes a whole program differ from the model: the program is built again with
    every generated group's outputs as extra outputs and run on `inputs`; each is compared with ATen's
    value on the same inputs, in program order. The first group outside its tolerance is the culprit
    (its inputs, earlier groups' outputs, were within theirs); when none is outside, the one nearest to
    its limit (errors that add up along the graph). Returns (group, why) or (None, why)."""
    suspects = [g for g in plan.groups if (g.kind in GENERATED or g.kind == "kernel_step") and id(g) not in fallback]
    if not suspects:
        return None, "no generated group is left to suspect"
    graph_outputs = {v.name for v in graph.outputs}
    owner: dict[str, Group] = {}
    watched = []
    for g in suspects:
        for v in g.outputs(graph_outputs):
            if v.name not in owner:
                owner[v.name] = g
                if v.name not in graph_outputs:
                    watched.append(v)
    outputs = list(graph.outputs) + watched
    try:
        program = Lowering(graph, plan, constants, sm_count).build(plan.groups, graph.inputs, outputs, fallback)
        program.compile_kernels()
        got = program.executor(graphs=False).run(inputs)
    except Exception as exc:  # the diagnosis cannot run: the caller keeps what it has
        return None, f"the diagnostic program did not run ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    names = [v.name for v in outputs]
    want = reference_values(graph, inputs, keep=set(names))
    worst: tuple[float, Group | None, str] = (0.0, None, "")
    for g in suspects:
        for name, value in zip(names, got):
            if owner.get(name) is not g or name not in want:
                continue
            expected = want[name]
            atol, rtol = tolerance(expected.dtype, plan.precision)
            problem = first_difference(name, value, expected, atol, rtol, reference="ATen")
            if problem:
                return g, problem
            ratio = tolerance_used(value, expected, atol, rtol)
            if ratio > worst[0]:
                worst = (ratio, g, f"within its tolerance but nearest its limit ({ratio:.2f} of it at '{name}'): "
                                   "errors add up along the graph")
    return worst[1], worst[2] or "no group's output differs"


def _plan_only(model, example_inputs, precision: str, graphs: bool, report: Report) -> None:
    """Without a GPU: capture, plan, lower and compile (NVRTC needs no GPU), so the report shows what
    would run. Nothing is verified or timed; any failure only adds to the reason."""
    was_training = model.training
    model.eval()
    try:
        graph = capture(model, example_inputs)
        report.op_counts = graph.op_counts()
        plan = OfflinePlanner(precision=precision, graphs=graphs).plan(graph)
        report.decisions += plan.decisions
        flat = [t for t in pytree.tree_flatten(example_inputs)[0] if isinstance(t, torch.Tensor)]
        values = reference_values(graph, flat)
        constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups
                     if g.kind == "constant" and g.nodes[0].out.name in values}
        lowering = Lowering(graph, plan, constants)
        program = lowering.build(plan.groups, graph.inputs, graph.outputs)
        program.compile_kernels()
        codes = {id(g): code for g, code in lowering.kernels}
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
    finally:
        model.train(was_training)


def _group_entries(plan: GraphPlan, lowering: Lowering, fallback: set[int], codes: dict) -> list[dict]:
    """One report entry per group that ran: its kind, ops, why, and the kernel it became."""
    entries = []
    for g in plan.groups:
        if g.kind in ("view", "constant") and not _used(g, lowering):
            continue
        entry = {"kind": "aten (fallback)" if id(g) in fallback else g.kind,
                 "nodes": ", ".join(n.op.removeprefix("aten::") for n in g.nodes), "reason": g.reason}
        code = g.params.get("code") if g.kind == "kernel_step" else codes.get(id(g))
        if code is not None and id(g) not in fallback:
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
    return verify_whole(model, optimized, example_inputs, sets, plan.precision)


def _measure(model, optimized: OptimizedModule, example_inputs, compare_compile: bool) -> dict:
    with torch.no_grad():
        eager = _time_ms(lambda: model(*example_inputs))
        stitched = _time_ms(lambda: optimized(*example_inputs))
        timing = {"eager_ms": eager, "stitched_ms": stitched, "speedup_eager": eager / stitched}
        if compare_compile:
            try:
                compiled = torch.compile(model)
                compiled(*example_inputs)
                timing["compile_ms"] = _time_ms(lambda: compiled(*example_inputs))
                timing["speedup_compile"] = timing["compile_ms"] / stitched
            except Exception as exc:  # torch.compile may be unavailable (no compiler); say so
                timing["compile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return timing
