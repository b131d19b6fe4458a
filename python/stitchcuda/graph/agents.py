"""Graph mode driven by the LLM agents: `optimize(model, inputs, llm=SPEC)` profiles each group of the
offline plan, lets the Planner choose targets, runs program mode's loop (Planner, Coder Skills 1 and 2,
VerifierAgent, Rubric) on each target as a KernelBench sub-problem whose answer is a kernel step, judges
the template path of the same groups with the same Verifier, and keeps the fastest verified candidate.

The run directory:

    runs/<UTC time>-<model>/
      config.json          mode "graph", model spec, budget, graph fingerprint (secrets redacted)
      hardware.json        the GPU as the Planner is told of it
      graph.json           every group: ops, shapes, offline strategy, measured time, launches, floor
      prompts/             graph_planner.md and index.json (version, sha256)
      plans/targets.json   the chosen targets; plans/targets.calls.json the Planner's calls
      targets/<id>/        a program-mode run directory per target (problem.py is the sub-problem,
                           attempts/NNN/ candidate, report, feedback, rubric, reward), plus template.json
                           (the template path's verdict) and result.json (the winner, written last)
      trajectories.jsonl   the Planner's calls and every target's records
      summary.json         per target: ATen, template and LLM speed-ups, the winner; usage, wall time
      events.jsonl         progress
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .. import _C
from ..agents.run_dir import append_event, read_json as _read_json, redact_keys as _redact
from ..agents.run_dir import write_json as _write_json, write_text as _write
from ..log import get_logger
from ..settings import settings
from .capture import Graph
from .groups import Group, GraphPlan
from .targets import (COMPUTING, KernelStep, KernelStepError, SubProblem, Target, TargetError, describe_graph,
                      evaluate, floor_of, group_ids, kernel_code, parse_targets, subproblem, wrapper_source)

__all__ = ["AgentBudget", "TargetResult", "GraphRun", "run_agents", "profile_groups", "program_wrapper_source"]

_log = get_logger(__name__)


@dataclass
class AgentBudget:
    """Limits of one graph-mode agent run: attempts per target, tokens and wall time for the whole model
    (0 = none; tokens are shared evenly among the targets), the most targets, and how many targets' model
    calls are in flight at once (verification is serialized on the GPU)."""

    attempts: int = 3
    tokens: int = 0
    wall_s: float = 0.0
    max_targets: int = 4
    concurrency: int = 4

    def to_dict(self) -> dict[str, Any]:
        return {"attempts": self.attempts, "tokens": self.tokens, "wall_s": self.wall_s,
                "max_targets": self.max_targets, "concurrency": self.concurrency}


@dataclass
class TargetResult:
    """What one target came to: the candidates judged and the one that won."""

    target: Target
    groups: list[Group]
    sub: SubProblem
    run_dir: str
    eager_ms: float | None = None         # the sub-problem's ATen ops, as the Verifier timed them
    template: dict[str, Any] = field(default_factory=dict)  # {correct, speedup, ms, why}
    llm: dict[str, Any] = field(default_factory=dict)       # {attempt, speedup, ms, attempts, stop_reason}
    winner: str = "template"             # "llm", "template" or "aten"
    template_s: float = 0.0              # judging the template path in this process (0 when resumed)
    code: Any = None                     # the winning kernel step's KernelCode (winner "llm")
    note: str = ""

    def row(self) -> dict[str, Any]:
        return {"target": self.target.id, "groups": self.target.groups, "strategy": self.target.strategy,
                "ops": ", ".join(n.op.removeprefix("aten::") for n in self.sub.nodes), "eager_ms": self.eager_ms,
                "template": self.template, "llm": {k: v for k, v in self.llm.items() if k != "candidate"},
                "winner": self.winner, "note": self.note, "run_dir": self.run_dir}


@dataclass
class GraphRun:
    run_dir: str
    targets: list[TargetResult]
    profile: dict[str, dict]
    usage: dict[str, int]
    wall_s: float
    overhead_s: float
    notes: list[str] = field(default_factory=list)


def _C_backend_type() -> type:
    from .. import _C

    return _C.LlmBackend


def fingerprint(graph: Graph) -> str:
    """What a resumed run must match: the ops and shapes of the graph."""
    text = ";".join(f"{n.op}:{[list(v.shape) for v in n.outputs if v is not None]}" for n in graph.nodes)
    text += "|" + ";".join(f"{list(v.shape)}{v.dtype}" for v in graph.inputs)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- profiling -----------------------------------------------------------------------------------


def _feed(sub: SubProblem, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [(v.data if v.kind == "weight" and v.data is not None else values[v.name]).contiguous() for v in sub.inputs]


def profile_groups(graph: Graph, plan: GraphPlan, values: dict[str, torch.Tensor], peaks: dict[str, float],
                   calls: int = 3) -> dict[str, dict]:
    """Per computing group: its ATen ops alone on the recorded inputs under CUPTI (kernel time per call,
    launches, idle gaps between its kernels) and its floor. Without a GPU or CUPTI the measured fields
    are None and `why` says so."""
    dram = float(peaks.get("dram_tb_s") or 0) * 1e12
    fp32 = float(peaks.get("fp32_tflops") or 0) * 1e12
    out: dict[str, dict] = {}
    tracing = torch.cuda.is_available()
    from .. import profile

    for gid, g in group_ids(plan).items():
        if g.kind not in COMPUTING:
            continue
        entry: dict[str, Any] = {"kind": g.kind, "ops": [n.op for n in g.nodes], "strategy": g.reason,
                                 **floor_of([g], graph, dram, fp32), "time_us": None, "launches": None, "gap_us": None}
        out[gid] = entry
        if not tracing:
            entry["why"] = "no GPU: not measured"
            continue
        try:
            sub = subproblem(graph, [g], values, gid)
            model, _ = sub.build()
            feed = _feed(sub, values)
            with torch.no_grad():
                model(*feed)
                torch.cuda.synchronize()
                with profile.trace(kernels=True, memory=False, api_calls=False) as t:
                    for _ in range(calls):
                        model(*feed)
                    torch.cuda.synchronize()
            kernels = sorted(t.trace.kernels, key=lambda k: k.start_ns)
            busy = sum(k.duration_ns for k in kernels) / calls / 1e3
            span = (kernels[-1].end_ns - kernels[0].start_ns) / calls / 1e3 if kernels else 0.0
            entry.update(time_us=busy, launches=len(kernels) / calls, gap_us=max(span - busy, 0.0))
        except Exception as exc:  # a group that cannot be profiled is still offered, unmeasured
            entry["why"] = f"not measured: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return out


# ---- the template path as a candidate ------------------------------------------------------------


def program_wrapper_source(program_bytes: bytes, sub: SubProblem) -> str:
    """A ModelNew that runs a stitched Program (the template path of a target's groups) with the C++
    executor, so the Verifier times and checks it exactly as it does an LLM's candidate."""
    params = ", ".join(f"in{k}" for k in range(len(sub.inputs)))
    feed = ", ".join(f"in{k}.contiguous()" for k in range(len(sub.inputs)))
    blob = base64.b64encode(program_bytes).decode()
    ret = "outs[0]" if len(sub.outputs) == 1 else "tuple(outs)"
    return "\n".join([
        '"""The template path of a StitchCUDA target: the offline Coder\'s program for its groups."""',
        "import base64", "import torch", "from stitchcuda import program as stitched", "",
        f"PROGRAM = {blob!r}", "", "",
        "class ModelNew(torch.nn.Module):", "    def __init__(self):", "        super().__init__()",
        "        self.executor = stitched.Program.deserialize(base64.b64decode(PROGRAM)).executor(graphs=False)", "",
        f"    def forward(self, {params}):", f"        outs = self.executor.run([{feed}])", f"        return {ret}", ""])


# ---- one target ----------------------------------------------------------------------------------


def _failed_report(kind: str, message: str) -> str:
    from ..verify.report import VerifyReport, build_feedback

    report = VerifyReport().fail(kind, message)
    report.feedback = build_feedback(report)
    return report.to_json()


def _bind_check(step: KernelStep, sub: SubProblem) -> None:
    """The launch expressions and buffer names against the target's shapes, before anything runs."""
    shapes = sub.shapes()
    for what, exprs in (("grid", step.grid), ("block", step.block), ("shared_bytes", [step.shared_bytes]),
                        ("args", step.args)):
        for e in exprs:
            e = e.strip()
            if re.fullmatch(r"(in|out)\d+", e):
                if e not in shapes:
                    raise KernelStepError(f"{what}: {e} is not a buffer of this target (there are {', '.join(shapes)})")
                continue
            evaluate(e, shapes)


def _best_kernel_step(attempts: list[dict]) -> dict | None:
    best = None
    for a in attempts:
        report = a.get("report") or {}
        cand = a.get("candidate") or ""
        if not cand.lstrip().startswith("{") or '"kernel_step"' not in cand:
            continue
        if not report.get("correct") or report.get("static_only") or _hack(report):
            continue
        s = report.get("speedup_eager")
        if s is None:
            continue
        if best is None or s > best["speedup"]:
            best = {"attempt": a.get("index"), "speedup": float(s), "candidate": cand,
                    "ms": report.get("candidate_ms")}
    return best


def _hack(report: dict) -> bool:
    if "hack" in report:
        return bool(report["hack"])
    return any(f.get("severity") == "major" for f in report.get("findings", []))


class _Runner:
    """Shared state of one graph-mode run: the backend, the Verifier's pool and the GPU lock."""

    def __init__(self, graph, plan, values, constants, sm_count, llm, root: Path, budget: AgentBudget,
                 machine: dict, pool, verify_config, static_only: bool, on_event, started: float, resume: bool):
        from ..agents import loop

        self.graph, self.plan, self.values, self.constants, self.sm_count = graph, plan, values, constants, sm_count
        self.root, self.budget, self.machine, self.pool, self.config = root, budget, machine, pool, verify_config
        self.static_only, self.on_event, self.started, self.resume = static_only, on_event, started, resume
        from .. import llm as llm_module

        if isinstance(llm, _C_backend_type()):
            llm = llm_module.Backend(llm, {})
        self.client = llm if isinstance(llm, llm_module.Backend) else llm_module.connect(llm)
        self.backend, self.backend_name, self.call_options = loop._native_backend(self.client)
        self.llm_spec = llm if isinstance(llm, str) else None
        self.gpu = threading.Lock()
        self.events = threading.Lock()

    def event(self, stage: str, message: str, **extra: Any) -> None:
        record = {"stage": stage, "message": message, "time_s": round(time.perf_counter() - self.started, 3), **extra}
        with self.events:
            append_event(self.root, record)
        if self.on_event is not None:
            try:
                self.on_event(record)
            except Exception:  # a progress view must not stop the run
                _log.debug("the on_event callback raised on %s", stage, exc_info=True)

    def verify(self, task, source: str, trusted: bool = False) -> str:
        from ..verify import check

        with self.gpu:  # one candidate on the GPU at a time: timings stay undisturbed
            kwargs = {"trusted": True} if trusted else {}
            if self.static_only:
                return check(task, source, static_only=True, **kwargs).to_json()
            return check(task, source, config=self.config, pool=self.pool, **kwargs).to_json()


def _template_verdict(r: _Runner, target: Target, groups: list[Group], sub: SubProblem, task: Any) -> dict:
    """The template path of the target's groups lowered alone and judged by the Verifier like a candidate."""
    from .lower import Lowering

    r.event("template", f"{target.id}: judging the template path of {', '.join(target.groups)}", target=target.id)
    try:
        lowering = Lowering(r.graph, r.plan, r.constants, r.sm_count)
        program = lowering.build(groups, sub.inputs, sub.outputs)
        program.compile_kernels()
        report = json.loads(r.verify(task, program_wrapper_source(program.serialize(), sub), trusted=True))
        steps = [s["kind"] for s in program.steps]
        return {"correct": bool(report.get("correct")), "hack": bool(report.get("hack")),
                "speedup": (report.get("speedup") or {}).get("eager"),
                "ms": (report.get("timing") or {}).get("candidate_ms"),
                "eager_ms": (report.get("timing") or {}).get("eager_ms"),
                "steps": steps, "why": (report.get("error") or {}).get("message", "")}
    except Exception as exc:  # the template path may not lower alone; the LLM may still win
        return {"correct": False, "speedup": None, "why": f"{type(exc).__name__}: {exc}"[:300]}


def _run_target(r: _Runner, target: Target, groups: list[Group], index: int, tokens: int) -> TargetResult:
    from ..agents import loop
    from ..verify import Task

    sub = subproblem(r.graph, groups, r.values, target.id, target.strategy)
    tdir = r.root / "targets" / f"{index:02d}-{target.id}"
    result = TargetResult(target, groups, sub, os.fspath(tdir))
    done = _read_json(tdir / "result.json")
    task = Task.from_source(sub.source, target.id)

    # The template path of these groups, judged like any candidate (cached: a resumed run keeps it).
    template = _read_json(tdir / "template.json")
    if template is None:
        t0 = time.perf_counter()
        template = _template_verdict(r, target, groups, sub, task)
        # Lowering, NVRTC and the Verifier's run (the worker's start on the first target): compile and GPU time.
        result.template_s = time.perf_counter() - t0
    result.template = template
    result.eager_ms = template.get("eager_ms")

    def verify(candidate: str) -> str:
        text = candidate if "\n" in candidate else candidate + "\n"
        if text.lstrip().startswith("{") and '"kernel_step"' in text:
            try:
                step = KernelStep.parse(text)
                _bind_check(step, sub)
            except (KernelStepError, ValueError) as exc:
                return _failed_report("compile", f"the kernel step cannot be bound to the target: {exc}")
            except Exception as exc:  # InvalidArgumentError from the C++ parser
                return _failed_report("compile", f"the kernel step is invalid: {exc}")
            text = wrapper_source(step, sub)
        return r.verify(task, text)

    problem = {"name": target.id, "reference": sub.source, "hardware": r.machine,
               "profile": f"Graph Planner's strategy for this target: {target.strategy}\n"
                          f"Template path: {template.get('steps', '?')}, "
                          f"{template.get('speedup') or 0:.2f}x over the ATen ops",
               "answer": "kernel_step", "target": sub.describe()}
    remaining = r.budget.wall_s - (time.perf_counter() - r.started) if r.budget.wall_s else 0.0
    budget = {"attempts": r.budget.attempts, "replans": 1, "tokens": tokens,
              "wall_s": max(remaining, 1.0) if r.budget.wall_s else 0.0}
    options = {"prompts_dir": os.fspath(loop.PROMPTS_DIR), "prompts_override": "",
               "docs_dir": os.fspath(settings().docs_dir or Path(loop.__file__).resolve().parent / "corpus"),
               **r.call_options}
    config = {"mode": "graph-target", "problem": target.id, "llm": r.backend_name, "llm_spec": r.llm_spec,
              "budget": budget, "target": target.to_dict(), "hardware": r.machine, "stitchcuda": _C.version()}
    resume = (tdir / "config.json").exists()
    r.event("target", f"{target.id}: {'resuming' if resume else 'starting'} the agents on {', '.join(target.groups)}",
            target=target.id)

    def on_event(e: dict) -> None:
        r.event(f"{target.id}:{e['stage']}", e["message"], target=target.id, attempt=e["attempt"])

    outcome = _C.agents.optimize(problem, r.backend, verify, budget, os.fspath(tdir), json.dumps(_redact(config)),
                                 resume, on_event, options)
    _write_json(tdir / "template.json", template)  # after the loop made the folder (it must start empty)
    best = _best_kernel_step(outcome["attempts"])
    result.llm = {"attempts": len(outcome["attempts"]), "stop_reason": outcome["stop_reason"],
                  "usage": outcome["usage"], "wall_s": outcome["wall_s"], "overhead_s": outcome["overhead_s"],
                  "verify_s": sum(a.get("verify_s", 0.0) for a in outcome["attempts"]),
                  "llm_s": sum(a.get("llm_s", 0.0) for a in outcome["attempts"])}
    if best is not None:
        result.llm.update(best)
    _decide(result, best)
    if done is not None and done.get("winner") != result.winner:
        result.note = (result.note + "; " if result.note else "") + f"the resumed run changed the winner from {done['winner']}"
    _write_json(tdir / "result.json", result.row())
    return result


def _decide(result: TargetResult, best: dict | None) -> None:
    """The fastest verified candidate: the LLM's kernel step, the template path, or the ATen ops (1.0x
    by definition: they are the sub-problem's reference)."""
    options = {"aten": 1.0}
    if result.template.get("correct") and not result.template.get("hack") and result.template.get("speedup"):
        options["template"] = float(result.template["speedup"])
    if best is not None:
        try:
            step = KernelStep.parse(best["candidate"])
            code = kernel_code(step, result.sub)  # verified code: compiling it here is safe
            options["llm"] = best["speedup"]
            result.code = code
        except Exception as exc:
            result.note = f"the best kernel step does not lower: {type(exc).__name__}: {exc}"[:300]
    result.winner = max(options, key=lambda k: options[k])
    if "template" not in options and result.winner == "aten" and "llm" not in options:
        result.note = result.note or f"the template path was not verified ({result.template.get('why', '')[:200]})"
    if result.winner != "llm":
        result.code = None


# ---- the Planner ---------------------------------------------------------------------------------


def _plan_targets(r: _Runner, graph_text: str, library, exchanges: list[dict]) -> list[Target]:
    from ..agents import Retriever

    docs = ""
    snippets: list[str] = []
    try:
        hits = Retriever.default().search("fuse adjacent operators one kernel memory-bound scan reduction " + graph_text[:400], k=3)
        docs = "\n\n".join(h["text"] for h in hits)
        snippets = [h["id"] for h in hits]
    except Exception:  # retrieval is help, not a requirement
        _log.debug("retrieval for the graph Planner failed; it plans without documentation", exc_info=True)
    hardware = "\n".join(f"- {k}: {v}" for k, v in r.machine.items())
    prompt = library.render("graph_planner", graph=graph_text, hardware=hardware, docs=docs,
                            max_targets=str(r.budget.max_targets))
    meta = library.prompts()["graph_planner"]
    messages = [{"role": "user", "content": prompt}]
    last_error = ""
    for ask in range(3):  # the first answer and two re-asks that name what was wrong
        t0 = time.perf_counter()
        reply = r.client.complete(messages)
        text = reply.text
        u = reply.usage
        exchanges.append({"agent": "planner", "messages": list(messages), "reply": text,
                          "finish_reason": reply.finish_reason,
                          "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                                    "total_tokens": u.total_tokens},
                          "latency_s": time.perf_counter() - t0, "error": "", "prompt_name": "graph_planner",
                          "prompt_sha256": meta["sha256"], "snippets": snippets})
        try:
            return parse_targets(text, r.plan, r.budget.max_targets)
        except TargetError as exc:
            last_error = str(exc)
            messages = messages + [{"role": "assistant", "content": text},
                                   {"role": "user", "content": f"That choice cannot be used: {last_error}. Answer again "
                                                               "with only the JSON object."}]
    r.event("plan", f"no usable target choice after 3 answers: {last_error}")
    return []


def _trajectory(exchange: dict, run_id: str, model: str) -> dict:
    """A Planner call as a trajectories.jsonl record, in the loop's record shape."""
    from ..agents import trajectory_record

    return trajectory_record({**exchange, "model": exchange.get("model") or model}, run_id=run_id, problem="graph")


# ---- the whole run -------------------------------------------------------------------------------


def run_agents(graph: Graph, plan: GraphPlan, values: dict[str, torch.Tensor], constants: dict[str, torch.Tensor],
               llm: Any, *, name: str, sm_count: int, machine: dict, run_dir: str | os.PathLike | None = None,
               resume: str | os.PathLike | None = None, budget: AgentBudget | None = None, pool: Any = None,
               verify_config: Any = None, static_only: bool = False,
               on_event: Callable[[dict], Any] | None = None) -> GraphRun:
    """Runs the agents on `plan`'s groups and returns each target's verdict (TargetResult.code is set
    where an LLM kernel step won). Everything is recorded under the run directory; `resume` continues a
    killed run (the graph must be the same)."""
    from ..agents import loop

    started = time.perf_counter()
    root, budget = _run_root(graph, name, run_dir, resume, budget or AgentBudget())
    r = _Runner(graph, plan, values, constants, sm_count, llm, root, budget, machine, pool, verify_config,
                static_only, on_event, started, resume is not None)
    if resume is None:
        _write_json(root / "config.json", _redact({
            "mode": "graph", "model": name, "llm": r.backend_name, "llm_spec": r.llm_spec, "budget": budget.to_dict(),
            "call_options": r.call_options, "fingerprint": fingerprint(graph), "precision": plan.precision,
            "stitchcuda": _C.version()}))
        _write_json(root / "hardware.json", machine)
    r.event("start", f"{'resuming' if resume is not None else 'starting'} graph-mode agents on {name}")
    library = loop.PromptLibrary.load(loop.PROMPTS_DIR)
    _record_prompts(root, library)
    profile, profile_s = _profiled(r, graph, plan, values, machine, root)
    exchanges: list[dict] = []
    targets, planning_s = _chosen_targets(r, graph, plan, profile, library, exchanges, root)
    planner_calls = _read_json(root / "plans" / "targets.calls.json") or []
    results = _run_targets(r, graph, plan, values, targets, planner_calls, budget, root)
    _write_trajectories(root, planner_calls, results, r.backend_name)
    usage = _usage(planner_calls, results)
    verify_s = sum(res.llm.get("verify_s", 0.0) + res.template_s for res in results)
    llm_s = sum(res.llm.get("llm_s", 0.0) for res in results) + sum(float(e.get("latency_s", 0.0)) for e in exchanges)
    waited = profile_s + planning_s + verify_s + llm_s
    wall = time.perf_counter() - started
    summary = {"mode": "graph", "model": name, "targets": [res.row() for res in results], "usage": usage,
               "wall_s": wall, "profile_groups": len(profile), "profile_s": profile_s, "verify_s": verify_s,
               "llm_s": llm_s}
    run = GraphRun(os.fspath(root), results, profile, usage, wall, 0.0)
    # The loop's own cost: wall time minus model calls and verification (targets overlap, so this is a
    # lower bound of the overhead when several ran at once; each target's own overhead_s is exact).
    run.overhead_s = max(wall - waited, 0.0) if len(results) <= 1 else \
        sum(res.llm.get("overhead_s", 0.0) for res in results)
    summary["overhead_s"] = run.overhead_s
    _write_json(root / "summary.json", summary)
    r.event("done", f"{sum(res.winner == 'llm' for res in results)} of {len(results)} target(s) won by an LLM kernel")
    return run


def _run_root(graph: Graph, name: str, run_dir: str | os.PathLike | None, resume: str | os.PathLike | None,
              budget: AgentBudget) -> tuple[Path, AgentBudget]:
    """The run directory (a resumed one checked against this graph, its budget taken back; a new one
    created empty) and the budget."""
    from ..errors import InvalidArgumentError, NotFoundError

    if resume is not None:
        root = Path(resume)
        saved = _read_json(root / "config.json")
        if saved is None:
            raise NotFoundError(f"'{root}' is not a graph-mode run directory (no readable config.json)")
        if saved.get("fingerprint") != fingerprint(graph):
            raise InvalidArgumentError(f"the run in '{root}' was made for another graph (fingerprint "
                                       f"{saved.get('fingerprint')}, this model's {fingerprint(graph)}): resume it "
                                       "with the same model and input shapes, or start a new run")
        return root, AgentBudget(**{**budget.to_dict(), **(saved.get("budget") or {})})
    root = Path(run_dir) if run_dir else Path(_C.agents.fresh_run_path("runs", name))
    if root.exists() and any(root.iterdir()):
        raise InvalidArgumentError(f"the run directory '{root}' exists and is not empty: choose another or resume it")
    root.mkdir(parents=True, exist_ok=True)
    return root, budget


def _record_prompts(root: Path, library: Any) -> None:
    """The graph Planner's prompt, with its version and hash, in the run directory (once)."""
    prompts = library.prompts()
    if "graph_planner" in prompts and not (root / "prompts" / "index.json").exists():
        _write(root / "prompts" / "graph_planner.md", prompts["graph_planner"]["text"])
        _write_json(root / "prompts" / "index.json",
                    {"graph_planner": {"version": prompts["graph_planner"]["version"],
                                       "sha256": prompts["graph_planner"]["sha256"]}})


def _profiled(r: "_Runner", graph: Graph, plan: GraphPlan, values: dict, machine: dict, root: Path
              ) -> tuple[dict, float]:
    """Each group's profile (graph.json; measured once, read back on resume) and the seconds it took."""
    profile = (_read_json(root / "graph.json") or {}).get("groups")
    if profile is not None:
        return profile, 0.0
    r.event("profile", "profiling each group of the reference")
    t0 = time.perf_counter()
    profile = profile_groups(graph, plan, values, machine)
    _write_json(root / "graph.json", {"groups": profile, "table": describe_graph(plan, graph, profile)})
    return profile, time.perf_counter() - t0


def _chosen_targets(r: "_Runner", graph: Graph, plan: GraphPlan, profile: dict, library: Any, exchanges: list[dict],
                    root: Path) -> tuple[list[Target], float]:
    """The Planner's targets (plans/targets.json; chosen once, read back on resume) and the seconds it took."""
    saved_targets = _read_json(root / "plans" / "targets.json")
    if saved_targets is not None:
        return [Target(t["id"], list(t["groups"]), t.get("strategy", "")) for t in saved_targets], 0.0
    r.event("plan", "the Planner chooses targets")
    t0 = time.perf_counter()
    targets = _plan_targets(r, describe_graph(plan, graph, profile), library, exchanges)
    _write_json(root / "plans" / "targets.json", [t.to_dict() for t in targets])
    _write_json(root / "plans" / "targets.calls.json", exchanges)
    return targets, time.perf_counter() - t0


def _run_targets(r: "_Runner", graph: Graph, plan: GraphPlan, values: dict, targets: list[Target],
                 planner_calls: list[dict], budget: AgentBudget, root: Path) -> list[TargetResult]:
    """Every target's run (budget.concurrency at once, each with its share of the tokens the Planner left);
    a target that fails is the template path with the reason."""
    ids = group_ids(plan)
    results: list[TargetResult] = []
    if not targets:
        return results
    share = budget.tokens // len(targets) if budget.tokens else 0
    spent = sum(int((e.get("usage") or {}).get("total_tokens", 0)) for e in planner_calls)
    if budget.tokens:
        share = max((budget.tokens - spent) // len(targets), 1)
    workers = max(1, min(budget.concurrency, len(targets)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stitchcuda-target") as ex:
        futures = [ex.submit(_run_target, r, t, [ids[g] for g in t.groups], k + 1, share) for k, t in enumerate(targets)]
        for t, f in zip(targets, futures):
            try:
                results.append(f.result())
            except Exception as exc:  # one target's failure leaves the others' results
                r.event("target", f"{t.id} failed: {type(exc).__name__}: {exc}"[:300], target=t.id)
                results.append(TargetResult(t, [ids[g] for g in t.groups], subproblem(graph, [ids[g] for g in t.groups], values, t.id),
                                            os.fspath(root / "targets"), winner="template",
                                            note=f"the agents failed: {type(exc).__name__}: {exc}"[:300]))
    return results


def _write_trajectories(root: Path, planner_calls: list[dict], results: list[TargetResult], backend_name: str) -> None:
    """trajectories.jsonl: the Planner's calls, then every target's records (rewritten whole each run)."""
    lines = [json.dumps(_trajectory(e, root.name, backend_name), default=str) for e in planner_calls]
    for res in results:
        path = Path(res.run_dir) / "trajectories.jsonl"
        if path.is_file():
            lines += [l for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]
    _write(root / "trajectories.jsonl", "\n".join(lines) + ("\n" if lines else ""))


def _usage(planner_calls: list[dict], results: list[TargetResult]) -> dict[str, int]:
    """The tokens of the Planner's calls and every target's model calls."""
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for e in planner_calls:
        for k in usage:
            usage[k] += int((e.get("usage") or {}).get(k, 0))
    for res in results:
        for k in usage:
            usage[k] += int((res.llm.get("usage") or {}).get(k, 0))
    return usage
