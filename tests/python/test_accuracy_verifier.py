"""The accuracy rule in the Verifier's comparison (verify/tolerance.py judge_output): a 16-bit output (or an fp32
one under the tf32/bf16 policies) outside the table around the reference's is judged against a high-precision
reference by the rule graph mode uses, both errors reported; planted errors just below and just above the bound
pass and fail; fp32 at the fp32 policy, shape and dtype problems keep the table's verdict."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from stitchcuda.verify.report import VerifyReport
from stitchcuda.verify.tolerance import (ACCURACY_FACTOR, HighPrecision, Tolerance, accuracy_error, accuracy_floor,
                                         judge_output, judge_outputs, wants_reference)


def _outputs(dtype: torch.dtype, seed: int = 0):
    """(the reference's output: a chain of `dtype` ops rounding after each; the same math in fp64; the inputs'
    largest-magnitude output element's index is irrelevant: errors are planted where |truth| is small)."""
    gen = torch.Generator().manual_seed(seed)
    x, w = (torch.randn(128, 96, generator=gen, dtype=torch.float64) for _ in range(2))
    xs, ws = x.to(dtype), w.to(dtype)
    eager = (torch.tanh(xs * 1.7 + ws) * ws - xs * 0.3) * 40
    exact = (torch.tanh(xs.double() * 1.7 + ws.double()) * ws.double() - xs.double() * 0.3) * 40
    return eager, exact


def _planted(eager: torch.Tensor, exact: torch.Tensor, share: float) -> tuple[torch.Tensor, int]:
    """The truth rounded once to eager's dtype, with one element (where |truth| is smallest, so the table's
    bound there is about its atol) moved by `share` times the rule's bound."""
    bound = ACCURACY_FACTOR * accuracy_error(eager, exact) + accuracy_floor(eager.dtype)
    where = int(exact.abs().argmin())
    wrong = exact.clone()
    wrong.view(-1)[where] += share * bound * float(exact.abs().max())
    return wrong.to(eager.dtype), where


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("share, ok", [(0.9, True), (1.1, False)])
def test_a_planted_error_just_below_and_just_above_the_bound(dtype, share, ok):
    eager, exact = _outputs(dtype)
    got, where = _planted(eager, exact, share)
    result = judge_output(0, eager, got, Tolerance(), exact=exact)
    assert result.mismatches >= 1  # outside the table: the rule, not the table, decides
    assert result.ok is ok and result.accuracy is not None and result.accuracy["ok"] is ok
    assert result.accuracy["reference"] == "fp64"
    # Both errors against the truth are reported; the candidate's is the planted one.
    assert result.err_vs_fp64 == pytest.approx(share * result.accuracy["bound"], rel=0.02)
    assert result.reference_err_vs_fp64 == result.accuracy["eager_error"] > 0
    if ok:
        assert result.problem == ""
    else:
        assert "by the accuracy rule" in result.problem and "above the bound" in result.problem


def test_rounding_once_is_accepted_and_the_report_says_so_in_strict_json():
    eager, exact = _outputs(torch.bfloat16)
    once = exact.to(torch.bfloat16)
    report = VerifyReport(outputs=judge_outputs([eager], [once], Tolerance(), exact=[exact]))
    (out,) = report.outputs
    assert out.ok and out.accuracy["ok"] and out.err_vs_fp64 < out.reference_err_vs_fp64
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["outputs"][0]["accuracy"]["bound"] == pytest.approx(out.accuracy["bound"])
    assert VerifyReport.from_dict(data).outputs[0].accuracy == out.accuracy


def test_a_nan_is_a_failure_with_no_infinity_in_the_report():
    eager, exact = _outputs(torch.float16)
    got = exact.to(torch.float16)
    got[3, 5] = float("nan")
    out = judge_output(0, eager, got, Tolerance(), exact=exact)
    assert not out.ok and "NaN" in out.problem and out.err_vs_fp64 is None and out.accuracy["error"] is None
    json.dumps(VerifyReport(outputs=[out]).to_dict(), allow_nan=False)


def test_fp32_at_the_fp32_policy_keeps_the_table():
    eager, exact = _outputs(torch.float32)
    got = eager.clone()
    got[0, 0] += 1e-2  # far outside fp32's 1e-4, though small against the output's scale
    out = judge_output(0, eager, got, Tolerance(), exact=exact)
    assert not out.ok and out.accuracy is None and out.mismatches == 1
    assert not wants_reference([torch.float32, torch.int64], Tolerance())


def test_fp32_under_the_tf32_policy_is_the_rules_to_judge():
    eager, exact = _outputs(torch.float32)
    policy = Tolerance.for_precision("tf32")
    assert policy.precision == "tf32" and wants_reference([torch.float32], policy)
    # A product rounded to TF32 (10 mantissa bits), and one with an error well past the rule's bound.
    tf32 = ((exact.float().view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)
    assert judge_output(0, eager, tf32, policy, exact=exact).ok
    far = tf32.clone()
    far.view(-1)[int(exact.abs().argmin())] += 0.05 * float(exact.abs().max())
    out = judge_output(0, eager, far, policy, exact=exact)
    assert not out.ok and out.accuracy is not None and not out.accuracy["ok"]


def test_shape_dtype_and_count_problems_stay_failures():
    eager, exact = _outputs(torch.bfloat16)
    assert "shape" in judge_output(0, eager, eager[:, :5], Tolerance(), exact=exact).problem
    wrong_dtype = judge_output(0, eager, exact.float(), Tolerance(), exact=exact)
    assert not wrong_dtype.ok and "dtype" in wrong_dtype.problem and wrong_dtype.accuracy is None
    # A reference no finer than the output is no truth to judge by.
    assert judge_output(0, eager, eager, Tolerance(), exact=eager).accuracy is None
    (count,) = judge_outputs([eager, eager], [eager], Tolerance())
    assert not count.ok and "returns 1 outputs, the reference 2" in count.problem


def test_the_policy_travels_with_the_tolerance():
    policy = Tolerance.for_precision("bf16")
    assert Tolerance.from_dict(policy.to_dict()) == policy
    assert Tolerance.from_dict({"fp32": [1e-4, 1e-4]}).precision == "fp32"  # a dict of an older writer
    with pytest.raises(ValueError, match="precision must be one of fp32, tf32, bf16"):
        Tolerance(precision="fp8")


class _Bf16Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.fc(x)
        return torch.tanh(h) * h - x * 0.3, (h > 0).sum()


def test_the_fp64_forward_the_rule_judges_by():
    torch.manual_seed(0)
    model = _Bf16Chain().to(torch.bfloat16).eval()
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    high = HighPrecision(model)
    exact, count = high.outputs([x])
    assert exact.dtype == torch.float64 and model.fc.weight.dtype == torch.bfloat16  # the model is untouched
    with torch.no_grad():
        eager, eager_count = model(x)
        wide = copy.deepcopy(model).double()(x.double())[0]
    assert torch.equal(exact, wide) and count.dtype == torch.int64 and int(count) == int(eager_count)
    # A candidate rounding the fp64 result once passes by it, whatever the table says.
    out = judge_outputs([eager, eager_count], [exact.to(torch.bfloat16), eager_count], Tolerance(),
                        exact=[exact, count])
    assert all(o.ok for o in out) and out[0].accuracy["ok"] and out[1].accuracy is None


def test_a_reference_with_no_fp64_forward_leaves_the_table_to_judge():
    class Half(torch.nn.Module):
        def forward(self, x):
            if x.dtype == torch.float64:
                raise RuntimeError("no fp64 kernel for this op")
            return x * 2

    high = HighPrecision(Half())
    assert high.outputs([torch.ones(3, dtype=torch.float16)]) is None
    assert high.note == "no fp64 reference: RuntimeError: no fp64 kernel for this op"
    assert high.outputs([torch.ones(3, dtype=torch.float16)]) is None  # not tried again
