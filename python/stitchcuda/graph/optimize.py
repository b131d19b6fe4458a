"""`stitchcuda.optimize(model, example_inputs)`: capture, plan, generate, verify, and return a module that
runs the stitched program — or the original model with the reason, whenever any stage cannot proceed.
"""

from __future__ import annotations

import copy
import html
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from ..program import Program, ProgramModule
from ..verify.harness import first_difference
from .capture import CaptureError, Graph, capture
from .lower import Lowering, LoweringError, check_group, reference_values, tolerance
from .planner import GENERATED, OfflinePlanner, Plan

__all__ = ["optimize", "OptimizedModule", "Report"]


class _Progress:
    """One line per long step on a terminal or in Jupyter; silent in logs and CI."""

    def __init__(self, enabled: bool | None) -> None:
        if enabled is None:
            enabled = (sys.stderr.isatty() or "ipykernel" in sys.modules) and not os.environ.get("CI")
        self.enabled = enabled

    def step(self, text: str):
        progress = self

        class _Step:
            def __enter__(self):
                self.t0 = time.perf_counter()
                if progress.enabled:
                    print(f"[stitchcuda] {text}…", end="", file=sys.stderr, flush=True)
                return self

            def __exit__(self, *exc):
                if progress.enabled:
                    print(f" {'failed' if exc[0] else 'done'} ({time.perf_counter() - self.t0:.1f} s)",
                          file=sys.stderr, flush=True)
                return False

        return _Step()


@dataclass
class Report:
    """What optimize() did and why: groups, kernels, fallbacks, verification, speed-ups."""

    status: str = "eager"                  # "optimized" or "eager" (nothing replaced)
    reason: str = ""                       # why eager, when it is
    decisions: list[tuple[str, str]] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)
    fallbacks: list[dict] = field(default_factory=list)
    verification: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    op_counts: dict = field(default_factory=dict)
    stage_seconds: dict = field(default_factory=dict)

    @property
    def kernels(self) -> list[dict]:
        return [g for g in self.groups if g.get("source")]

    def to_dict(self) -> dict:
        return {"status": self.status, "reason": self.reason, "decisions": self.decisions, "groups": self.groups,
                "fallbacks": self.fallbacks, "verification": self.verification, "timing": self.timing,
                "op_counts": self.op_counts, "stage_seconds": self.stage_seconds}

    def __str__(self) -> str:
        lines = [f"StitchCUDA report: {self.status}" + (f" — {self.reason}" if self.reason else "")]
        if self.timing:
            t = self.timing
            lines.append(f"  time per forward: stitched {t.get('stitched_ms', float('nan')):.4f} ms, eager "
                         f"{t.get('eager_ms', float('nan')):.4f} ms"
                         + (f", torch.compile {t['compile_ms']:.4f} ms" if t.get("compile_ms") else ""))
            lines.append(f"  speed-up: {t.get('speedup_eager', float('nan')):.2f}x vs eager"
                         + (f", {t['speedup_compile']:.2f}x vs torch.compile" if t.get("speedup_compile") else ""))
        if self.verification:
            v = self.verification
            lines.append(f"  verification: {'passed' if v.get('passed') else 'FAILED'} on {v.get('input_sets', 0)} "
                         f"input set(s), max |error| {v.get('max_abs_error', 0):.3g}, max relative error vs fp64 "
                         f"{v.get('max_rel_error_fp64', 0):.3g}")
        for d, why in self.decisions:
            lines.append(f"  decision: {d} ({why})")
        views = sum(g["kind"] == "view" for g in self.groups)
        for g in self.groups:
            if g["kind"] != "view":
                lines.append(f"  [{g['kind']:9}] {g['nodes']}: {g['reason']}")
        if views:
            lines.append(f"  [view     ] {views} view(s) of buffers without a copy")
        for f in self.fallbacks:
            lines.append(f"  fallback {f['group']}: {f['reason']}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(g['kind'])}</td><td><code>{html.escape(g['nodes'])}</code></td>"
                       f"<td>{html.escape(g['reason'])}</td></tr>" for g in self.groups)
        head = html.escape(str(self).splitlines()[0])
        timing = "<br>".join(html.escape(l.strip()) for l in str(self).splitlines()[1:4])
        return (f"<div><b>{head}</b><br>{timing}<table><tr><th>kind</th><th>ops</th><th>why</th></tr>{rows}"
                "</table></div>")


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
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.multi_processor_count, props.name


def _hardware() -> dict[str, str]:
    """The machine the program is verified on, recorded in the artifact."""
    from .. import _C

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"device": props.name, "arch": f"sm_{props.major}{props.minor}" + ("a" if props.major == 9 else ""),
            "driver": str(_C.driver_version()), "cuda": str(torch.version.cuda or ""), "torch": torch.__version__}


def _time_ms(fn, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    flush = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(repeats):
        flush.zero_()  # evict L2 between trials
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


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


def _random_like(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator(device=t.device).manual_seed(seed)
    if t.is_floating_point():
        scale = t.float().abs().max().item() if t.numel() else 1.0
        return (torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32) * max(scale, 1e-3)).to(t.dtype)
    return t.clone()


def optimize(model: torch.nn.Module, example_inputs: Sequence[Any], *, llm: Any = None, precision: str = "fp32",
             graphs: bool = True, verify_sets: int = 3, measure: bool = True, compare_compile: bool = True,
             progress: bool | None = None, isolated: bool = True) -> OptimizedModule:
    """Optimizes `model` for inputs shaped like `example_inputs` (on a CUDA device).

    Returns an OptimizedModule whose `.report` says what was done and why; when a stage cannot proceed
    (capture, lowering, verification, no GPU) the module runs the original model and the report says why.
    `llm` is reserved for the LLM agents (graph mode uses the built-in Planner and template Coder).
    `isolated`: each generated group is checked against its ATen subgraph in the Verifier's isolated
    worker process (a fault or hang in generated code becomes a fallback reason); False checks them in
    this process, which saves the worker's start-up.
    """
    report = Report()
    steps = _Progress(progress)
    example_inputs = tuple(example_inputs)
    if llm is not None:
        report.decisions.append(("built-in Planner and template Coder",
                                 "LLM agents do not drive graph mode yet; the llm argument is ignored"))
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
                from ..verify import default_pool

                pool = default_pool()
                report.decisions.append(("group checks in the Verifier's isolated worker",
                                         "generated code runs apart from this process until it matches ATen"))
            for g in plan.groups:
                if g.kind not in GENERATED:
                    continue
                ok, why, code = check_group(graph, plan, g, values, constants, sm_count, pool)
                codes[id(g)] = code
                if not ok:
                    fallback.add(id(g))
                    report.fallbacks.append({"group": g.name, "kind": g.kind, "reason": why})
            report.stage_seconds["generate_and_check"] = time.perf_counter() - t0
        with steps.step("building the program"):
            lowering = Lowering(graph, plan, constants, sm_count)
            program = lowering.build(plan.groups, graph.inputs, graph.outputs, fallback, _hardware())
            program.compile_kernels()
        for g in plan.groups:
            if g.kind in ("view", "constant") and not _used(g, lowering):
                continue
            entry = {"kind": "aten (fallback)" if id(g) in fallback else g.kind,
                     "nodes": ", ".join(n.op.removeprefix("aten::") for n in g.nodes), "reason": g.reason}
            code = codes.get(id(g))
            if code is not None and id(g) not in fallback:
                entry.update(kernel=code.name, source=code.source, launch=f"grid {code.grid}, block {code.block}",
                             strategy=code.description)
            report.groups.append(entry)
        runner = None
        if graphs:
            with steps.step("choosing CUDA graph replay or direct launches"):
                runner, decision = _choose_replay(program, [t.contiguous() for t in flat_inputs])
                report.decisions.append(decision)
        else:
            program.set_replay("direct", "graphs=False was requested")  # carried into the saved artifact
        optimized = OptimizedModule(model, program, graph, report, graphs=graphs, runner=runner)
        with steps.step(f"verifying on {verify_sets} input set(s)"):
            report.verification = _verify(model, optimized, example_inputs, verify_sets, plan)
        if not report.verification["passed"]:
            report.status = "eager"
            report.reason = "the stitched program does not match the model: " + report.verification["detail"]
            optimized._runner = None
            return optimized
        report.status = "optimized"
        if measure:
            with steps.step("measuring"):
                report.timing = _measure(model, optimized, example_inputs, compare_compile)
        return optimized
    except (CaptureError, LoweringError) as exc:
        report.reason = str(exc)
        return OptimizedModule(model, None, None, report)
    except Exception as exc:  # anything else: never break the caller, say what happened
        report.reason = f"{type(exc).__name__} while optimizing: {exc}"
        return OptimizedModule(model, None, None, report)
    finally:
        model.train(was_training)


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


def _used(g, lowering: Lowering) -> bool:
    return any(v is not None and v.name in lowering.buf for n in g.nodes for v in n.outputs)


def _verify(model, optimized: OptimizedModule, example_inputs, sets: int, plan: Plan) -> dict:
    """The whole program against the module: example inputs, then fresh random sets; errors vs fp64 too."""
    worst_abs, worst_rel = 0.0, 0.0
    detail = ""
    passed = True
    try:  # an fp64 copy of the model for the error against exact arithmetic (the caller's model is untouched)
        exact_model = copy.deepcopy(model).double()
    except Exception:
        exact_model = None
    for k in range(sets):
        inputs = example_inputs if k == 0 else pytree.tree_map(
            lambda t: _random_like(t, 1234 + k) if isinstance(t, torch.Tensor) else t, example_inputs)
        with torch.no_grad():
            want = pytree.tree_flatten(model(*inputs))[0]
            got = pytree.tree_flatten(optimized(*inputs))[0]
            exact = None
            if exact_model is not None:
                try:
                    exact = pytree.tree_flatten(exact_model(*pytree.tree_map(
                        lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, inputs)))[0]
                except Exception:
                    exact = None
        for i, (w, g) in enumerate(zip(want, got)):
            if not isinstance(w, torch.Tensor):
                continue
            if g.shape != w.shape or g.dtype != w.dtype:
                return {"passed": False, "input_sets": k + 1, "max_abs_error": float("inf"), "max_rel_error_fp64": float("inf"),
                        "detail": f"output {i} is {g.dtype}{list(g.shape)}, the model's {w.dtype}{list(w.shape)}"}
            atol, rtol = tolerance(w.dtype, plan.precision)
            # NaN where the model has NaN is no error; NaN anywhere else is an infinite one.
            diff = torch.nan_to_num((g.float() - w.float()).abs(), nan=float("inf")).masked_fill(
                g.isnan() & w.isnan(), 0.0)
            worst_abs = max(worst_abs, float(diff.max()) if diff.numel() else 0.0)
            if exact is not None and diff.numel():
                # Normwise: max |got - exact| / max |exact| (elementwise ratios explode near zero).
                ref = exact[i].double()
                scale = float(ref.abs().max()) or 1.0
                worst_rel = max(worst_rel, float((g.double() - ref).abs().max()) / scale)
            problem = first_difference(str(i), g, w, atol, rtol) if passed else None
            if problem:
                passed = False
                detail = f"input set {k}, {problem.replace('the reference', 'the model')}"
    return {"passed": passed, "input_sets": sets, "max_abs_error": worst_abs, "max_rel_error_fp64": worst_rel,
            "detail": detail}


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
