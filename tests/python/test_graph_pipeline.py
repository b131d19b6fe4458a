"""Graph mode's stage pipeline (graph/pipeline.py, graph/repair.py, graph/options.py) on the CPU: the options
mirror optimize()'s keyword arguments, each repair policy applies when its condition holds and changes what it
says, a fallback is logged once with its reason, and an internal error is reported as a StitchCUDA bug with its
traceback instead of a quiet "runs eagerly"."""

from __future__ import annotations

import importlib
import inspect
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import stitchcuda
from stitchcuda.graph.capture import CaptureError, capture
from stitchcuda.graph.options import OptimizeOptions
from stitchcuda.graph.planner import Group, OfflinePlanner
from stitchcuda.graph.report import Report
from stitchcuda.graph.state import PipelineState
from stitchcuda.log import StepProgress

pipeline = importlib.import_module("stitchcuda.graph.pipeline")
repair = importlib.import_module("stitchcuda.graph.repair")
optimize_module = importlib.import_module("stitchcuda.graph.optimize")


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _state(plan=None, passed=False, **fields) -> PipelineState:
    report = Report()
    report.verification = {"passed": passed, "detail": "output 0 differs from the model"}
    state = PipelineState(nn.Identity(), (), OptimizeOptions(progress=False), report=report,
                          steps=StepProgress(False), plan=plan, **fields)
    return state


def _gemm(name: str, precision: str) -> Group:
    return Group("gemm", [SimpleNamespace(name=name)], "", params={"precision": precision})


@pytest.fixture
def builds(monkeypatch):
    """Rebuilds and verifications as a list of the plan's GEMM precisions at each build; the program
    matches once no GEMM is tf32x3."""
    built = []

    def build_program(state):
        built.append(tuple(g.params.get("precision") for g in state.plan.groups))
        return SimpleNamespace(program=built[-1], release=lambda: None)

    def verify_state(state, optimized):
        bad = "tf32x3" in optimized.program
        return {"passed": not bad, "detail": "output 0 differs" if bad else ""}

    monkeypatch.setattr(repair, "build_program", build_program)
    monkeypatch.setattr(repair, "verify_state", verify_state)
    return built


def test_optimize_options_are_optimizes_keyword_arguments_with_the_same_defaults():
    params = {n: p for n, p in inspect.signature(optimize_module.optimize).parameters.items()
              if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert tuple(params) == OptimizeOptions.names()
    defaults = OptimizeOptions()
    assert all(getattr(defaults, n) == p.default for n, p in params.items())
    assert not defaults.agents and OptimizeOptions(llm="scripted:x").agents and OptimizeOptions(resume="run").agents


def test_the_stages_run_in_the_documented_order():
    assert [name for name, _ in pipeline.STAGES] == ["capture", "plan", "check", "agents", "build", "verify", "measure"]
    assert [p.name for p in repair.REPAIR_POLICIES] == [
        "drop the agents' kernel steps", "GEMM precision step-down", "trace the mismatch to a group"]


def test_the_step_down_policy_applies_to_lossy_gemms_and_steps_them_down(builds):
    policy = repair.REPAIR_POLICIES[1]
    early, late = _gemm("qkv", "tf32x3"), _gemm("out", "tf32x3")
    plan = SimpleNamespace(groups=[early, late])
    state = _state(plan, offline_groups=[early, late])
    assert policy.applies(state)
    assert policy.apply(state)
    # Stepped down, the program matched; the latest went back to tf32x3 and broke it, so it stayed SGEMM.
    assert builds == [("fp32", "fp32"), ("fp32", "tf32x3"), ("fp32", "fp32")]
    assert early.params["precision"] == late.params["precision"] == "fp32" and state.passed
    titles = [d for d, _ in state.report.decisions]
    assert "qkv: SGEMM instead of tf32x3" in titles and "out: SGEMM kept" in titles
    assert not policy.applies(state)  # nothing lossy is left
    state.fallback.add(id(early))
    early.params["precision"] = "tf32x3"
    assert not policy.applies(state)  # a GEMM on ATen has nothing to step down


def test_the_agents_policy_applies_only_when_the_agents_changed_the_plan(builds):
    policy = repair.REPAIR_POLICIES[0]
    offline = [_gemm("a", "fp32")]
    state = _state(SimpleNamespace(groups=list(offline)), offline_groups=offline)
    assert not policy.applies(state)
    step = Group("kernel_step", [SimpleNamespace(name="a")], "LLM")
    state.plan.groups = [step]
    state.report.targets = [{"target": "t0", "winner": "llm"}, {"target": "t1", "winner": "aten"}]
    assert policy.applies(state) and policy.apply(state)
    assert state.plan.groups == offline and builds == [("fp32",)] and state.passed
    assert state.report.targets[0]["winner"] == "template" and "did not match" in state.report.targets[0]["note"]
    assert state.report.targets[1]["winner"] == "aten"
    assert ("the agents' kernel steps left out" in [d for d, _ in state.report.decisions])


def test_the_trace_policy_sends_the_traced_group_to_aten_and_stops_when_none_is_found(builds, monkeypatch):
    policy = repair.REPAIR_POLICIES[2]
    culprit = _gemm("fc2", "tf32x3")
    graph = SimpleNamespace(working_set_bytes=lambda: 0, inputs=[], outputs=[])
    state = _state(SimpleNamespace(groups=[culprit]), graph=graph, optimized=SimpleNamespace(release=lambda: None))
    monkeypatch.setattr(repair, "memory_target", lambda graph: 0)
    monkeypatch.setattr(repair, "input_set", lambda inputs, index: ())
    found = iter([(culprit, "output 'fc2' differs from ATen"), (None, "no generated group is left to suspect")])
    monkeypatch.setattr(repair, "trace_mismatch", lambda *a, **k: next(found))
    assert policy.applies(state) and policy.rounds == repair.TRACE_ROUNDS
    assert policy.apply(state)
    assert id(culprit) in state.fallback and state.report.fallbacks[0]["group"] == "fc2"
    assert "traced to this group: output 'fc2' differs" in state.report.fallbacks[0]["reason"]
    assert not policy.apply(state)  # nothing traced: the policy says it changed nothing


def test_repair_tries_the_policies_in_order_and_stops_once_the_program_matches(builds):
    calls = []

    def policy(name, fixes):
        def apply(state):
            calls.append(name)
            state.report.verification = {"passed": fixes, "detail": "still differs"}
            return True
        return repair.RepairPolicy(name, "always", "nothing", lambda state: True, apply, rounds=2)

    state = _state(SimpleNamespace(groups=[]))
    repair.repair(state, (policy("first", False), policy("second", True), policy("third", True)))
    assert calls == ["first", "first", "second"] and state.passed


def test_a_fallback_is_logged_once_at_warning_with_its_reason(caplog):
    model = _Mlp().eval()
    state = _state(optimized=None)
    state.model = model
    stages = (("capture", lambda s: None), ("plan", lambda s: pipeline.Fallback("nothing to gain: a test says so")))
    with caplog.at_level(logging.INFO, logger="stitchcuda"):
        fast = pipeline.run_stages(state, stages)
    assert fast.report.status == "eager" and fast.report.reason == "nothing to gain: a test says so"
    assert fast.program is None and fast(torch.ones(2, 64)).shape == (2, 16)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "runs the original model: nothing to gain: a test says so" in warnings[0].getMessage()
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.levelno == logging.INFO] == [
        "stage capture", "stage plan"]


def test_an_internal_error_is_reported_as_a_stitchcuda_bug_with_its_traceback(caplog):
    def broken_plan(state):
        return {}["a key the planner forgot"]

    state = _state()
    with caplog.at_level(logging.WARNING, logger="stitchcuda"):
        fast = pipeline.run_stages(state, (("capture", lambda s: None), ("plan", broken_plan)))
    report = fast.report
    assert report.status == "eager" and fast.program is None
    assert report.reason.startswith("a StitchCUDA bug stopped optimize() in the plan stage (KeyError:")
    assert "Traceback" in report.internal_error and "broken_plan" in report.internal_error
    assert "internal error (a StitchCUDA bug" in str(report) and report.to_dict()["internal_error"]
    assert Report.from_dict(report.to_dict()).internal_error == report.internal_error
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info and "internal error in the plan stage" in errors[0].getMessage()


def test_what_graph_mode_cannot_take_is_a_reason_not_a_bug():
    def refuse(state):
        raise CaptureError("torch.export cannot trace this model: a data-dependent branch")

    fast = pipeline.run_stages(_state(), (("capture", refuse),))
    assert fast.report.reason == "torch.export cannot trace this model: a data-dependent branch"
    assert not fast.report.internal_error


def test_planning_without_a_gpu_reports_a_bug_as_one(monkeypatch):
    class Broken(OfflinePlanner):
        def plan(self, graph):
            raise AttributeError("'Group' object has no attribute 'strategy'")

    monkeypatch.setattr(pipeline, "OfflinePlanner", Broken)
    report = Report()
    pipeline.plan_only(_Mlp().eval(), (torch.randn(4, 64),), "fp32", True, report)
    assert "planning without a GPU stopped on a StitchCUDA bug: AttributeError" in report.reason
    assert "Traceback" in report.internal_error


@pytest.mark.skipif(torch.cuda.is_available(), reason="the path without a GPU")
def test_optimize_without_a_gpu_says_why_the_agents_did_not_run(caplog):
    with caplog.at_level(logging.WARNING, logger="stitchcuda"):
        fast = stitchcuda.optimize(_Mlp().eval(), (torch.randn(4, 64),), llm="scripted:none", progress=False)
    assert fast.report.reason.startswith("no CUDA device: the model runs eagerly (the agents did not run: they "
                                         "profile and verify kernels on a GPU); planned and compiled only")
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1


def test_save_on_the_original_model_is_a_typed_error_that_says_what_to_do():
    from stitchcuda.errors import StitchError
    from stitchcuda.graph.module import NoProgramError, OptimizedModule

    report = Report(reason="no CUDA device: the model runs eagerly")
    fast = OptimizedModule(_Mlp().eval(), None, None, report)
    with pytest.raises(NoProgramError, match=r"nothing to save: .*\(no CUDA device: the model runs eagerly\).*"
                                             r"report.status is 'optimized'") as caught:
        fast.save("never.stitch")
    assert isinstance(caught.value, StitchError) and isinstance(caught.value, RuntimeError)


def test_the_planner_sees_the_same_plan_through_the_stages():
    """plan_only (the pipeline without a GPU) reports the planner's groups for a small MLP."""
    model, x = _Mlp().eval(), torch.randn(4, 64)
    report = Report()
    pipeline.plan_only(model, (x,), "fp32", True, report)
    plan = OfflinePlanner().plan(capture(model, (x,)))
    assert [g["kind"] for g in report.groups] == [g.kind for g in plan.groups if g.kind not in ("view", "constant")]
    assert "planned and compiled only" in report.reason


def test_the_backend_refuses_a_training_mode_graph_as_optimize_does(caplog):
    from stitchcuda.graph import dynamo

    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.25)).train()
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="stitchcuda"):
        out = torch.compile(model, backend="stitchcuda")(torch.randn(4, 8))
    assert out.shape == (4, 8)
    reason = dynamo.reports[-1].reason
    assert reason.startswith("the model is in training mode (dropout traced with training=True): call model.eval()")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("stitchcuda")] == [
        f"torch.compile backend: {reason}"]
    with pytest.raises(stitchcuda.InvalidArgumentError, match="in training mode: call model.eval"):
        stitchcuda.optimize(model, (torch.randn(4, 8),))
    model.eval()
    torch._dynamo.reset()
    torch.compile(model, backend="stitchcuda")(torch.randn(4, 8))
    assert not dynamo.reports[-1].reason.startswith("the model is in training mode")


def test_a_second_batch_size_gives_the_backend_a_symbolic_graph_it_optimizes_over_a_range(caplog):
    from stitchcuda.graph import dynamo

    model = _Mlp().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stitchcuda")
    with torch.no_grad():
        compiled(torch.randn(2, 64))  # no GPU: planned only, and optimize() warned that the model runs
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stitchcuda"):
            x = torch.randn(3, 64)
            out = compiled(x)
    torch.testing.assert_close(out, model(x))  # ran, as Dynamo gave it (no GPU here)
    report = dynamo.reports[-1]
    # The symbolic size is a dim read from x's axis 0, served from 2 (Dynamo gives size 1 a graph of its own)
    # to DYNAMIC_REACH times this call's size, at least 64; export found the graph can vary it.
    (dim,) = report.dynamic["dims"]
    assert (dim["min"], dim["max"]) == (2, 64) and dim["inputs"][-1][1] == 0
    assert report.dynamic["guards"] == [f"'{dim['name']}' in 2..64"]
    messages = [r.getMessage() for r in caplog.records if r.name == "stitchcuda.graph.dynamo"]
    assert len(messages) == 1 and "a graph with symbolic sizes" in messages[0] and "no CUDA device" in messages[0]
    assert "proxy" not in messages[0]


def test_a_symbolic_size_no_tensor_carries_is_refused_with_the_reason():
    from stitchcuda.graph.dynamo import symbolic_sizes

    class Graph(torch.nn.Module):
        def forward(self, n, x):
            return x * n

    gm = torch.fx.symbolic_trace(Graph())
    n_node, x_node = [node for node in gm.graph.nodes if node.op == "placeholder"]
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    env = ShapeEnv()
    n_node.meta["example_value"] = env.create_unbacked_symint()
    x_node.meta["example_value"] = torch.empty(3)
    why = symbolic_sizes(gm, [n_node.meta["example_value"], torch.randn(3)])
    assert isinstance(why, str) and "no tensor argument's extent carries" in why


def test_a_data_dependent_branch_prints_one_warning_not_torchs_fx_graph(capfd, caplog):
    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x - 1

    fast = stitchcuda.optimize(Branchy().eval(), (torch.randn(4, 4),), progress=False)
    assert "torch.export could not capture the model (GuardOnDataDependentSymNode" in fast.report.reason
    err = capfd.readouterr().err  # torch's partial FX graph (printed twice) and its symbolic-shapes warning: gone
    assert "def forward" not in err and "Unable to find user code" not in err, err
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("stitchcuda")]
    assert len(ours) == 1 and ours[0].startswith("optimize(Branchy) runs the original model"), ours


def test_reading_an_output_specs_types_raises_no_futurewarning():
    import warnings

    import torch.utils._pytree as pytree
    capture_module = importlib.import_module("stitchcuda.graph.capture")

    _, spec = pytree.tree_flatten({"a": [torch.ones(1), (torch.ones(1), torch.ones(1))]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert capture_module._library_types(spec) == []
        assert len(capture_module._children(spec)) == 1


def test_the_report_writes_schema_2_and_reads_a_schema_1_report():
    from stitchcuda.errors import InvalidArgumentError
    from stitchcuda.graph.report import SCHEMA, SCHEMAS_READ, Decision

    report = Report(reason="no CUDA device: the model runs eagerly", decisions=[Decision("matmuls in true fp32", "default")],
                    verification={"passed": True, "input_sets": 3, "detail": ""})
    data = report.to_dict()
    assert data["schema"] == SCHEMA == "stitchcuda.graph.report/2" and data["internal_error"] == ""
    older = {k: v for k, v in data.items() if k != "internal_error"} | {"schema": "stitchcuda.graph.report/1"}
    again = Report.from_dict(older)
    assert again.internal_error == "" and again.decisions == [("matmuls in true fp32", "default")]
    assert again.decisions[0].title == "matmuls in true fp32" and again.verification["input_sets"] == 3
    assert SCHEMAS_READ == ("stitchcuda.graph.report/1", SCHEMA)
    with pytest.raises(InvalidArgumentError, match="reads 'stitchcuda.graph.report/1' and 'stitchcuda.graph.report/2'"):
        Report.from_dict({**data, "schema": "stitchcuda.graph.report/0"})
