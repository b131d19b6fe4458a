"""check() judges a 16-bit output by the accuracy rule, as graph mode does: a bf16 candidate that computes in
fp32 and rounds once (outside the table around the reference's chain of bf16 roundings) passes, one with an
error planted just below the rule's bound passes, one just above it fails with both errors in the report."""

from __future__ import annotations

import textwrap

import pytest
import torch

from stitchcuda.verify import Task, VerifyConfig, WorkerPool, check
from stitchcuda.verify.compare import compare_output

pytestmark = pytest.mark.slow

REFERENCE = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x, w):
            return (torch.tanh(x * 1.7 + w) * w - x * 0.3) * 40   # bf16: every op rounds

    def get_inputs():
        return [torch.randn(128, 96).bfloat16(), torch.randn(128, 96).bfloat16()]

    def get_init_inputs():
        return []
''')


def _candidate(share: float | None) -> str:
    """ModelNew: the reference's math in fp64, rounded once to bf16; with `share`, one element (where the truth
    is smallest) moved by `share` times the accuracy rule's bound, computed as the rule does."""
    plant = "" if share is None else textwrap.dedent(f'''
        chain = ((torch.tanh(x * 1.7 + w) * w - x * 0.3) * 40).double()
        scale = truth.abs().max()
        bound = 2 * (chain - truth).abs().max() / scale + 2.0 ** -8
        truth = truth.clone()
        truth.view(-1)[truth.abs().argmin()] += {share} * bound * scale
    ''')
    return "import torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n    def forward(self, x, w):\n" + \
        textwrap.indent("truth = (torch.tanh(x.double() * 1.7 + w.double()) * w.double() - x.double() * 0.3) * 40\n"
                        + plant + "return truth.bfloat16()\n", " " * 8)


CONFIG = VerifyConfig(device="cpu", timing_iters=3, warmup=1, compile_time_limit_s=60, run_time_limit_s=60,
                      compile_baseline=False, profile=False)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(devices=["cpu"]) as p:
        yield p


def test_the_table_alone_would_reject_rounding_once():
    torch.manual_seed(42)
    x, w = torch.randn(128, 96).bfloat16(), torch.randn(128, 96).bfloat16()
    eager = (torch.tanh(x * 1.7 + w) * w - x * 0.3) * 40
    once = ((torch.tanh(x.double() * 1.7 + w.double()) * w.double() - x.double() * 0.3) * 40).bfloat16()
    assert not compare_output(0, eager, once, 1e-2, 1e-2).ok


@pytest.mark.parametrize("share, ok", [(None, True), (0.9, True), (1.1, False)], ids=["once", "below", "above"])
def test_check_judges_a_bf16_output_by_the_accuracy_rule(pool, share, ok):
    report = check(Task.from_source(REFERENCE, "bf16_chain"), _candidate(share), config=CONFIG, pool=pool)
    assert report.correct is ok, (report.error, [o.accuracy for o in report.outputs])
    (out,) = report.outputs
    assert out.accuracy is not None and out.accuracy["reference"] == "fp64"
    assert out.err_vs_fp64 == out.accuracy["error"] and out.reference_err_vs_fp64 == out.accuracy["eager_error"] > 0
    if ok:
        assert out.accuracy["error"] <= out.accuracy["bound"]
    else:
        assert "accuracy rule" in report.error["message"] and "above the bound" in (out.problem or report.error["message"])
