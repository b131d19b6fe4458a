"""The 4-bit integer dtypes torch has (torch.uint4, torch.int4), which no program buffer holds: optimize() never
raises; their nodes are ATen groups whose reason names the dtype, the rest of the model is planned, and the
returned module computes what the model does. (fp8 and complex: tests/python/test_graph_lowp.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import stitchcuda

HAS_GPU = torch.cuda.is_available()
FOUR_BITS = [getattr(torch, name) for name in ("uint4", "int4") if hasattr(torch, name)]


class _ThroughFourBits(nn.Module):
    """Bytes read as a 4-bit dtype and back (a packed weight's round trip), then ordinary fp32 work."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, p, x):
        again = p.view(self.dtype).view(torch.uint8)
        return torch.relu(x * again.to(torch.float32)) + 1


def _inputs(device: str = "cpu"):
    torch.manual_seed(0)
    return (torch.randint(0, 16, (4, 16), dtype=torch.uint8, device=device),
            torch.randn(4, 16, device=device))


@pytest.mark.skipif(not FOUR_BITS, reason="this torch has no 4-bit dtypes")
@pytest.mark.skipif(HAS_GPU, reason="the plan-only path runs where there is no GPU")
@pytest.mark.parametrize("dtype", FOUR_BITS, ids=str)
def test_a_four_bit_dtype_is_an_aten_group_with_its_reason(dtype):
    model, inputs = _ThroughFourBits(dtype).eval(), _inputs()
    fast = stitchcuda.optimize(model, inputs, progress=False)
    name = str(dtype)
    held = [g for g in fast.report.groups if g["kind"] == "aten (fallback)"]
    assert held and all(name in g["reason"] and "no program buffer holds" in g["reason"] for g in held)
    assert any(g["kind"] == "pointwise" for g in fast.report.groups)  # the rest is planned
    assert name in fast.report.reason and fast.report.internal_error in (None, "")
    assert torch.equal(fast(*inputs), model(*inputs))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.skipif(not FOUR_BITS, reason="this torch has no 4-bit dtypes")
@pytest.mark.parametrize("dtype", FOUR_BITS, ids=str)
def test_on_a_gpu_a_four_bit_dtype_runs_the_model_and_says_why(dtype):
    model, inputs = _ThroughFourBits(dtype).eval(), _inputs("cuda")
    fast = stitchcuda.optimize(model, inputs, progress=False)
    assert fast.report.status == "eager" and str(dtype) in fast.report.reason
    assert fast.report.internal_error in (None, "")
    assert torch.equal(fast(*inputs), model(*inputs))
