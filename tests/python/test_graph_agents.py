"""Graph mode with the agents, on the CPU: targets as KernelBench sub-problems, the Planner's choice and
its errors, kernel steps (launch expressions, binding, the ModelNew the Verifier judges), and a whole
scripted run with static verification: run directory, trajectories, a hacking reply scored 0, resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from stitchcuda.errors import StitchError
from stitchcuda.graph import targets as T
from stitchcuda.graph.agents import AgentBudget, fingerprint, run_agents
from stitchcuda.graph.capture import capture
from stitchcuda.graph.lower import reference_values
from stitchcuda.graph.planner import OfflinePlanner
from stitchcuda.verify import Task, check

DATA = Path(__file__).resolve().parent / "data"
SCAN = (DATA / "scan_kernel.cu").read_text()


@pytest.fixture(autouse=True)
def _cumsum_on_aten(monkeypatch):
    """These tests give the agents ATen's cumsum as their target (the planner's scan template would take it
    otherwise): the scan template is switched off here."""
    from stitchcuda.graph.planner import Group, OfflinePlanner

    monkeypatch.setattr(OfflinePlanner, "_scan", staticmethod(
        lambda node: Group("aten", [node], "cumsum stays an ATen step (the scan template is off in this test)")))


class ScanModel(torch.nn.Module):
    def __init__(self, cols: int = 256) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(cols))

    def forward(self, x):
        return torch.log1p(torch.cumsum(torch.sigmoid(x) * self.w, dim=-1))


class NormModel(torch.nn.Module):
    """A node with several outputs (native_layer_norm) and a view between groups."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)

    def forward(self, x):
        return torch.tanh(self.norm(x).reshape(8, 4, 64) * 2.0)


def planned(model, x):
    model = model.eval()
    graph = capture(model, (x,))
    plan = OfflinePlanner().plan(graph)
    values = reference_values(graph, [x])
    return graph, plan, values


def computing(plan) -> list[str]:
    return [gid for gid, g in T.group_ids(plan).items() if g.kind in T.COMPUTING]


@pytest.mark.parametrize("make", [lambda: (ScanModel(), torch.randn(16, 256)), lambda: (NormModel(), torch.randn(32, 64))])
def test_a_target_is_a_kernelbench_problem_that_computes_what_its_groups_compute(make):
    model, x = make()
    graph, plan, values = planned(model, x)
    ids = T.group_ids(plan)
    first, last = computing(plan)[0], computing(plan)[-1]
    order = list(ids)
    groups = [ids[g] for g in order[order.index(first):order.index(last) + 1]]
    sub = T.subproblem(graph, groups, values, "t1")
    task = Task.from_source(sub.source, "t1")  # the Verifier's own loader accepts it
    ref = task.build_reference(0)
    feed = [(v.data if v.kind == "weight" else values[v.name]) for v in sub.inputs]
    got = ref(*feed)
    got = got if isinstance(got, tuple) else (got,)
    for v, t in zip(sub.outputs, got):
        assert torch.equal(t, values[v.name]), v.name
    made = task.make_inputs(1)
    assert [tuple(t.shape) for t in made] == [tuple(v.shape) for v in sub.inputs]
    for v, t in zip(sub.inputs, made):  # inputs stay in the recorded range (a domain such as log's holds)
        recorded = v.data if v.kind == "weight" else values[v.name]
        assert t.dtype == recorded.dtype and float(t.min()) >= float(recorded.min()) - 1e-6
    assert "in0:" in sub.describe() and "out0:" in sub.describe()


def test_the_planner_choice_is_checked_and_every_problem_named():
    graph, plan, _ = planned(ScanModel(), torch.randn(16, 256))
    g = computing(plan)
    assert len(g) == 3
    ok = T.parse_targets('Here: {"targets": [{"groups": ["%s", "%s"], "strategy": "fuse"}]}' % (g[1], g[0]), plan)
    assert ok[0].id == "t1" and ok[0].groups == [g[0], g[1]] and ok[0].strategy == "fuse"
    with pytest.raises(T.TargetError) as e:
        T.parse_targets(json.dumps({"targets": [{"groups": [g[0], g[2]]}, {"groups": ["g99"]},
                                                {"groups": [g[0]]}, {"groups": []}]}), plan)
    text = str(e.value)
    assert f"not adjacent ({g[1]} lies between them" in text and "unknown g99" in text
    assert "a non-empty list" in text
    with pytest.raises(T.TargetError, match="already in targets"):
        T.parse_targets(json.dumps({"targets": [{"groups": [g[0]]}, {"groups": [g[0], g[1]]}]}), plan)
    with pytest.raises(T.TargetError, match="at most 1"):
        T.parse_targets(json.dumps({"targets": [{"groups": [g[0]]}, {"groups": [g[1]]}]}), plan, limit=1)
    with pytest.raises(T.TargetError, match="no JSON object"):
        T.parse_targets("the cumsum, I think", plan)
    assert T.parse_targets('{"targets": []}', plan) == []


def test_the_planner_reads_measured_time_launches_and_floor_per_group():
    graph, plan, _ = planned(ScanModel(), torch.randn(16, 256))
    g = computing(plan)
    profile = {g[1]: {"time_us": 41.25, "launches": 1.0, "floor_us": 3.5}}
    table = T.describe_graph(plan, graph, profile)
    row = next(l for l in table.splitlines() if l.startswith(f"| {g[1]} |"))
    assert "cumsum" in row and "| 41.2 | 1 | 3.5 |" in row and "float32[16, 256]" in row
    short = T.describe_graph(plan, graph, profile, limit=1)
    assert f"| {g[1]} |" in short and f"| {g[0]} |" not in short and "2 lighter group(s) not shown" in short
    floor = T.floor_of([T.group_ids(plan)[g[1]]], graph, 4.0e12, 60e12)
    assert floor["bytes"] == 2 * 16 * 256 * 4 and floor["floor_us"] == pytest.approx(floor["bytes"] / 4.0e12 * 1e6)


def test_launch_expressions_are_evaluated_over_the_shapes_and_nothing_else():
    shapes = {"in0": (64, 4096), "out0": (64, 4096)}
    assert T.evaluate("in0.shape[0]", shapes) == 64
    assert T.evaluate("ceil_div(out0.numel, 1000)", shapes) == 263
    assert T.evaluate("min(in0.shape[-1] / 3, 1024) % 7", shapes) == 1024 % 7
    assert T.evaluate("4 * (32 + 1)", shapes) == 132
    for bad, why in [("in2.shape[0]", "not a buffer"), ("in0.shape[5]", "does not exist"),
                     ("__import__('os')", "not allowed"), ("in0.numel ** 2", "not allowed"),
                     ("ceil_div(4, 0)", "divides by zero"), ("in0.shape[", "not an expression")]:
        with pytest.raises(T.KernelStepError, match=re.escape(why)):
            T.evaluate(bad, shapes)


def scan_target(cols=256):
    graph, plan, values = planned(ScanModel(cols), torch.randn(16, cols))
    ids = T.group_ids(plan)
    return graph, plan, values, T.subproblem(graph, [ids[g] for g in computing(plan)], values, "t1")


LAUNCH = {"kernel": "scan_sigmoid_log1p", "grid": ["in0.shape[0]"], "block": [1024], "shared_bytes": 0,
          "args": ["in0", "in1", "out0", "in0.shape[0]", "in0.shape[1]"]}


def reply(source=SCAN, launch=LAUNCH) -> str:
    return f"```cuda\n{source}```\n```json\n{json.dumps(launch)}\n```\n"


def test_a_kernel_step_binds_to_the_target_and_its_modelnew_passes_the_static_rules():
    from stitchcuda import _C

    *_, sub = scan_target()
    extracted = _C.agents.extract_kernel_step(reply(), "")
    step = T.KernelStep.parse(extracted["code"])
    code = T.kernel_code(step, sub)
    assert code.grid == (16, 1, 1) and code.block == (1024, 1, 1) and code.shared_mem == 0
    assert code.args == [("in", "in0"), ("in", "in1"), ("out", "out0"), ("i32", 16), ("i32", 256)]
    report = check(Task.from_source(sub.source, "t1"), T.wrapper_source(step, sub), static_only=True)
    assert report.compiled and not report.hack, [(f.rule, f.message) for f in report.findings]

    wrong = T.KernelStep.parse(_C.agents.extract_kernel_step(reply(launch={**LAUNCH, "args": LAUNCH["args"][:4]}), "")["code"])
    with pytest.raises(T.KernelStepError, match="takes 5 parameters, the step binds 4"):
        T.kernel_code(wrong, sub)
    swapped = {**LAUNCH, "args": ["in0", "in1", "in0.shape[0]", "out0", "in0.shape[1]"]}
    with pytest.raises(T.KernelStepError, match="not a pointer|takes no scalar"):
        T.kernel_code(T.KernelStep.parse(_C.agents.extract_kernel_step(reply(launch=swapped), "")["code"]), sub)
    huge = {**LAUNCH, "block": [2048]}
    with pytest.raises(T.KernelStepError, match="limit is 1024"):
        T.kernel_code(T.KernelStep.parse(_C.agents.extract_kernel_step(reply(launch=huge), "")["code"]), sub)
    with pytest.raises(StitchError, match="kernel 'nope' is not a __global__ function"):
        _C.agents.extract_kernel_step(reply(launch={**LAUNCH, "kernel": "nope"}), "")


HACK = """```python
import torch

class ModelNew(torch.nn.Module):
    def forward(self, in0, in1):
        return torch.log1p(torch.cumsum(torch.sigmoid(in0) * in1, dim=-1))
```
"""

PLAN = {"summary": "One pass per row.", "steps": [{"title": "Scan each row in one block", "detail": "shuffles"}],
        "fusion_groups": [], "bottlenecks": ["DRAM"], "risks": ["order of sums"], "constraints": ["fp32"]}


class Script:
    def __init__(self, replies):
        self.replies, self.coder = replies, 0
        self.planner_calls = 0

    def __call__(self, messages):
        first = messages[0]["content"]
        if "## The groups" in first:
            self.planner_calls += 1
            if self.planner_calls == 1:
                return '{"targets": [{"groups": ["g7"]}]}'  # unknown: re-asked with the error
            ids = re.findall(r"^\| (g\d+) \| (?:pointwise|aten) \|", first, re.M)
            assert "unknown g7" in messages[-1]["content"]
            return json.dumps({"targets": [{"groups": ids, "strategy": "one block per row"}]})
        if first.startswith("You are the Planner"):
            return json.dumps(PLAN)
        if first.startswith("You are the Verifier"):
            return "Fix it."
        self.coder += 1
        return self.replies[min(self.coder, len(self.replies)) - 1]


def test_a_scripted_graph_run_records_everything_scores_a_hack_zero_and_resumes(tmp_path):
    graph, plan, values = planned(ScanModel(), torch.randn(16, 256))
    script = Script([HACK, reply()])
    run = tmp_path / "run"
    out = run_agents(graph, plan, values, {}, script, name="ScanModel", sm_count=132, machine={"gpu": "none"},
                     run_dir=run, budget=AgentBudget(attempts=2), static_only=True)
    [res] = out.targets
    assert res.target.groups == computing(plan)
    for name in ("config.json", "hardware.json", "graph.json", "plans/targets.json", "plans/targets.calls.json",
                 "prompts/index.json", "summary.json", "events.jsonl", "trajectories.jsonl"):
        assert (run / name).is_file(), name
    config = json.loads((run / "config.json").read_text())
    assert config["mode"] == "graph" and config["fingerprint"] == fingerprint(graph)
    calls = json.loads((run / "plans" / "targets.calls.json").read_text())
    assert len(calls) == 2 and calls[0]["prompt_name"] == "graph_planner"
    tdir = run / "targets" / "01-t1"
    assert "class Model" in (tdir / "problem.py").read_text()
    hack = json.loads((tdir / "attempts" / "001" / "attempt.json").read_text())
    assert any(f["severity"] == "major" for f in hack["report"]["findings"]), hack["report"]
    assert hack["reward"]["value"] == 0
    step = json.loads((tdir / "attempts" / "002" / "attempt.json").read_text())
    assert json.loads(step["candidate"])["kernel_step"] == 1 and step["report"]["compiled"]
    # Unverified (no GPU): nothing may win on a static check alone.
    assert res.winner != "llm" and res.code is None
    records = [json.loads(l) for l in (run / "trajectories.jsonl").read_text().splitlines()]
    assert [r["agent"] for r in records[:2]] == ["planner", "planner"]
    assert sum(r["agent"] == "coder" for r in records) == 2
    assert all(set(r) >= {"messages", "prompt", "completion", "agent", "problem", "run_id", "reward"} for r in records)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["targets"][0]["target"] == "t1" and summary["usage"] == out.usage

    # Resume: nothing is asked again, the totals are the run's.
    again = Script([reply()])
    out2 = run_agents(graph, plan, values, {}, again, name="ScanModel", sm_count=132, machine={"gpu": "none"},
                      resume=run, budget=AgentBudget(attempts=2), static_only=True)
    assert again.coder == 0 and again.planner_calls == 0
    assert out2.targets[0].llm["attempts"] == 2
    with pytest.raises(StitchError, match="made for another graph"):
        other = planned(ScanModel(128), torch.randn(16, 128))
        run_agents(*other, {}, again, name="ScanModel", sm_count=132, machine={}, resume=run, static_only=True)
