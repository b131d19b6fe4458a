"""Tasks (KernelBench files and live modules), the tolerance policy, output comparison and the
report's schema. CPU only."""

from __future__ import annotations

import json
import math

import pytest
import torch

from stitchcuda.verify import ERROR_KINDS, Finding, Task, TaskError, Tolerance, VerifyConfig, VerifyReport
from stitchcuda.verify.report import compare_output, fp64_error

PROBLEM = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x):
        return torch.relu(self.linear(x))

batch_size = 16
features = 32
scale = 0.5

def get_inputs():
    return [torch.rand(batch_size, features)]

def get_init_inputs():
    return [features]
'''


class Doubler(torch.nn.Module):
    """A live reference for from_module (module level, so it pickles)."""

    def forward(self, x):
        return x * 2


def make_doubler_inputs(seed=None):
    return [torch.randn(8, 4)]


def test_from_source_reads_sizes_inputs_and_init_inputs():
    task = Task.from_source(PROBLEM, "relu_linear")
    assert task.name == "relu_linear"
    assert task.sizes == {"batch_size": 16, "features": 32, "scale": 0.5}
    assert task.init_inputs() == [32]
    a, b = task.make_inputs(1), task.make_inputs(1)
    assert torch.equal(a[0], b[0]) and a[0].shape == (16, 32)
    assert not torch.equal(task.make_inputs(2)[0], a[0])


def test_reference_weights_follow_the_seed():
    task = Task.from_source(PROBLEM)
    m1, m2, m3 = task.build_reference(5), task.build_reference(5), task.build_reference(6)
    assert torch.equal(m1.linear.weight, m2.linear.weight)
    assert not torch.equal(m1.linear.weight, m3.linear.weight)


def test_from_file(tmp_path):
    path = tmp_path / "level1_relu.py"
    path.write_text(PROBLEM)
    task = Task.from_file(path)
    assert task.name == "level1_relu" and task.source == PROBLEM


@pytest.mark.parametrize("source, needle", [
    ("import torch\ndef get_inputs():\n    return []\n", "does not define Model"),
    ("class Model:\n    pass\n", "get_inputs"),
    ("def (:\n", "not valid Python"),
    ("", "empty"),
    ("import torch\nclass Model:\n    pass\ndef get_inputs():\n    return []\n", "not an nn.Module"),
    ("raise ValueError('boom')\nModel = 1\ndef get_inputs(): pass\n", "raised while loading"),
])
def test_bad_references_are_clear_task_errors(source, needle):
    with pytest.raises(TaskError, match=needle):
        Task.from_source(source, "bad")


def test_missing_file_is_a_task_error(tmp_path):
    with pytest.raises(TaskError, match="cannot read"):
        Task.from_file(tmp_path / "absent.py")


def test_failing_generators_are_task_errors():
    src = PROBLEM.replace("return [torch.rand(batch_size, features)]", "raise RuntimeError('no inputs')")
    task = Task.from_source(src)
    with pytest.raises(TaskError, match="no inputs"):
        task.make_inputs(0)


def test_spec_round_trip_rebuilds_the_same_task():
    task = Task.from_source(PROBLEM, "p", tolerance=Tolerance.uniform(1e-3, 1e-3))
    again = Task.from_spec(task.to_spec())
    assert again.source == task.source and again.tolerance == task.tolerance and again.key == task.key
    assert torch.equal(again.make_inputs(3)[0], task.make_inputs(3)[0])


def test_from_module_pickles_and_rejects_lambdas():
    task = Task.from_module(Doubler(), make_doubler_inputs, init_inputs=[])
    assert task.name == "Doubler"
    again = Task.from_spec(task.to_spec())
    x = again.make_inputs(0)[0]
    assert torch.equal(again.build_reference(0)(x), x * 2)
    with pytest.raises(TaskError, match="module level"):
        Task.from_module(Doubler(), lambda: [torch.ones(1)])
    with pytest.raises(TaskError, match="nn.Module"):
        Task.from_module(object(), make_doubler_inputs)


def test_tolerance_policy_by_dtype():
    tol = Tolerance()
    assert tol.for_dtype(torch.float32) == (1e-4, 1e-4)
    assert tol.for_dtype(torch.float16) == (1e-2, 1e-2)
    assert tol.for_dtype(torch.bfloat16) == (1e-2, 1e-2)
    assert tol.for_dtype(torch.int64) == (0.0, 0.0)
    assert tol.for_dtype(torch.bool) == (0.0, 0.0)
    custom = Tolerance(fp32=(1e-3, 0.0))
    assert custom.for_dtype(torch.float32) == (1e-3, 0.0)
    assert Tolerance.uniform(0.1, 0.2).for_dtype(torch.float16) == (0.1, 0.2)
    assert Tolerance.from_dict(custom.to_dict()) == custom


def test_compare_within_and_outside_tolerance():
    e = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    ok = compare_output(0, e, e + 5e-5, 1e-4, 1e-4)
    assert ok.ok and ok.mismatches == 0 and ok.max_abs_err == pytest.approx(5e-5, rel=1e-2)
    g = e.clone()
    g[1, 0] = 3.1
    bad = compare_output(0, e, g, 1e-4, 1e-4)
    assert not bad.ok and bad.mismatches == 1
    assert bad.first_mismatches == [{"index": [1, 0], "expected": 3.0, "got": pytest.approx(3.1)}]
    assert bad.max_rel_err == pytest.approx(0.1 / 3, rel=1e-4)
    # A wider atol (inputs of larger magnitude than the problem's) accepts the same difference.
    assert compare_output(0, e, g, 1e-4, 1e-4, atol_scale=2000.0).ok


def test_compare_reports_shape_dtype_nan_and_type_problems():
    e = torch.zeros(2, 3)
    assert "shape [3, 2]" in compare_output(0, e, torch.zeros(3, 2), 1e-4, 1e-4).problem
    assert "dtype float16" in compare_output(0, e, torch.zeros(2, 3, dtype=torch.float16), 1e-4, 1e-4).problem
    g = e.clone()
    g[0, 1] = math.nan
    nan = compare_output(0, e, g, 1e-4, 1e-4)
    assert not nan.ok and "1 NaN" in nan.problem and nan.first_mismatches[0]["got"] == "nan"
    assert "expected a tensor" in compare_output(0, e, [1], 1e-4, 1e-4).problem
    # NaN where the reference has NaN is a match.
    assert compare_output(0, g, g.clone(), 1e-4, 1e-4).ok
    ints = torch.arange(4)
    assert compare_output(0, ints, ints.clone(), 0, 0).ok
    assert not compare_output(0, ints, ints + 1, 0, 0).ok


def test_fp64_error_is_normwise():
    ref64 = torch.tensor([1.0, -4.0], dtype=torch.float64)
    assert fp64_error(torch.tensor([1.0, -4.0]), ref64) == 0.0
    assert fp64_error(torch.tensor([1.4, -4.0]), ref64) == pytest.approx(0.1)
    assert fp64_error(torch.tensor([1.0]), ref64) is None


def test_report_schema_and_json_round_trip():
    report = VerifyReport(compiled=True)
    report.add("input-mutated", "major", "changed an input", "input 0: 3 elements")
    report.add("input-mutated", "major", "changed an input", "input 0: 3 elements")  # deduplicated
    report.add("nondeterministic", "minor", "runs disagree", "output 0")
    report.fail("incorrect", "wrong")
    report.fail("runtime", "second cause is not kept")
    data = json.loads(report.to_json())
    for key in ("compiled", "correct", "hack", "findings", "outputs", "speedup", "timing", "profile",
                "error", "feedback"):
        assert key in data
    assert data["hack"] is True and data["correct"] is False
    assert data["error"] == {"kind": "incorrect", "message": "wrong"}
    assert data["speedup"] == {"eager": None, "compile": None}
    assert [f["rule"] for f in data["findings"]] == ["input-mutated", "nondeterministic"]
    assert set(data["findings"][0]) >= {"rule", "severity", "message", "evidence", "line"}
    again = VerifyReport.from_dict(data)
    assert again.findings[0] == Finding("input-mutated", "major", "changed an input", None, "input 0: 3 elements")
    assert again.hack and again.error["kind"] == "incorrect"
    assert set(ERROR_KINDS) == {"load", "compile", "runtime", "crash", "timeout", "oom", "illegal-address",
                                "device-assert", "incorrect", "bad-reference", "bad-candidate"}


def test_config_validation():
    with pytest.raises(ValueError, match="at least 5"):
        VerifyConfig(trials=3)
    with pytest.raises(ValueError, match="seeds"):
        VerifyConfig(trials=5, seeds=[1, 2])
    with pytest.raises(ValueError, match="device"):
        VerifyConfig(device="tpu")
    cfg = VerifyConfig(trials=6, seeds=list(range(10, 16)), tolerance=Tolerance.uniform(1e-3, 1e-3))
    assert cfg.trial_seeds() == list(range(10, 16))
    assert VerifyConfig.from_dict(cfg.to_dict()) == cfg
