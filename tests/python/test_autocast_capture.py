"""torch.autocast in graph mode: a model captured under autocast gets the casts autocast inserts as plain ATen
_to_copy nodes (torch.export ignores an autocast around the call, so capture enters it inside the forward),
the planner sees an explicit bf16 model, the graph replayed with autocast off computes what eager computes
under it (judged by the accuracy rule against fp64), and a call under another autocast warns once.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stitchcuda
from stitchcuda.graph import OfflinePlanner, capture, reference_values
from stitchcuda.graph.capture import autocast_as, autocast_in_effect, under_autocast, warn_other_autocast
from stitchcuda.verify.tolerance import judge_accuracy

HAS_GPU = torch.cuda.is_available()
BF16 = ("cpu", torch.bfloat16)


class _Block(nn.Module):
    """Two linears around a norm and a GELU: autocast runs the linears in bf16 (casting their fp32 weights
    and inputs), the rest as its lists say."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(2 * d)

    def forward(self, x):
        return self.down(F.gelu(self.norm(self.up(x))))


class _ExplicitBf16(nn.Module):
    """_Block as a bf16 model written by hand: what CPU autocast computes, cast by cast."""

    def __init__(self, block: _Block):
        super().__init__()
        self.block = block

    def forward(self, x):
        b, bf = self.block, torch.bfloat16
        h = F.linear(x.to(bf), b.up.weight.to(bf), b.up.bias.to(bf))
        h = F.gelu(F.layer_norm(h, h.shape[-1:], b.norm.weight, b.norm.bias, b.norm.eps))
        return F.linear(h, b.down.weight.to(bf), b.down.bias.to(bf))


def _case():
    torch.manual_seed(0)
    return _Block().eval(), torch.randn(32, 64)


def _casts(graph) -> list[torch.dtype]:
    return [n.out.dtype for n in graph.nodes if n.op == "aten::_to_copy"]


def _gemm_operands(plan) -> list[set[torch.dtype]]:
    return [{v.dtype for n in g.nodes for v in n.inputs if len(v.shape) == 2} for g in plan.groups if g.kind == "gemm"]


def test_a_model_captured_under_autocast_holds_its_casts():
    model, x = _case()
    plain = capture(model, (x,))
    assert plain.autocast is None and not _casts(plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_in_effect() == BF16
        graph = capture(model, (x,))
    assert graph.autocast == BF16
    # Each linear's weight and bias, and the first one's input (the second's comes in bf16 from the norm).
    assert _casts(graph) == [torch.bfloat16] * 5
    assert graph.outputs[0].dtype == torch.bfloat16  # what eager under autocast returns
    assert any("torch.autocast('cpu'" in title for title, _ in graph.notes)
    # No autocast is left in effect by the capture, and the explicit argument captures the same graph.
    assert autocast_in_effect() is None
    explicit = capture(model, (x,), autocast=BF16)
    assert [n.op for n in explicit.nodes] == [n.op for n in graph.nodes]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert capture(model, (x,), autocast=False).autocast is None


def test_the_plan_of_an_autocast_capture_is_the_explicit_bf16_models():
    model, x = _case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = capture(model, (x,))
    twin = capture(_ExplicitBf16(model).eval(), (x,))
    plan, twin_plan = OfflinePlanner().plan(graph), OfflinePlanner().plan(twin)
    assert [g.kind for g in plan.groups] == [g.kind for g in twin_plan.groups]
    assert _gemm_operands(plan) == _gemm_operands(twin_plan) == [{torch.bfloat16}, {torch.bfloat16}]


def test_the_replayed_graph_computes_eager_under_autocast_by_the_accuracy_rule():
    model, x = _case()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        graph = capture(model, (x,))
        eager = model(x)
        # Replayed inside the user's autocast: the graph's casts are explicit, so it runs with autocast off.
        with autocast_as(None):
            got = reference_values(graph, [x])[graph.outputs[0].name]
    with torch.no_grad():
        exact = copy_in_fp64(model)(x.double())
    verdict = judge_accuracy(got, eager, exact)
    assert got.dtype == eager.dtype == torch.bfloat16 and verdict.ok, verdict.describe()
    # The fp32 graph a capture without the autocast gives is not that forward: it returns fp32.
    plain = capture(model, (x,))
    assert reference_values(plain, [x])[plain.outputs[0].name].dtype == torch.float32


def copy_in_fp64(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).double()


def test_the_eager_reference_under_autocast_stays_exact_in_fp64():
    model, x = _case()
    wrapped = under_autocast(model, BF16)
    with torch.no_grad():
        assert wrapped(x).dtype == torch.bfloat16
        assert torch.equal(copy_in_fp64(wrapped)(x.double()), copy_in_fp64(model)(x.double()))
    assert under_autocast(model, None) is model


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_call_under_another_autocast_warns_once_per_setting():
    model, x = _case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = capture(model, (x,))
    records, logger = _Records(), logging.getLogger("stitchcuda.graph.capture")
    logger.addHandler(records)
    try:
        warned: set = set()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            warn_other_autocast(graph, warned)
        assert records.messages == []  # the captured autocast: nothing to say
        for _ in range(3):
            warn_other_autocast(graph, warned)
        assert len(records.messages) == 1
        assert "captured under torch.autocast('cpu', dtype=torch.bfloat16)" in records.messages[0]
        assert "called under no autocast" in records.messages[0]
        with torch.autocast("cpu", dtype=torch.float16):
            warn_other_autocast(graph, warned)
        assert len(records.messages) == 2 and "float16" in records.messages[1]
    finally:
        logger.removeHandler(records)


@pytest.mark.skipif(HAS_GPU, reason="the plan-only path runs where there is no GPU")
def test_optimize_under_autocast_plans_the_bf16_model_and_runs_it_as_autocast_does():
    model, x = _case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = stitchcuda.optimize(model, (x,), progress=False)
        eager = model(x)
        again = fast(x)
    report = fast.report
    assert any("torch.autocast('cpu'" in title for title, _ in report.decisions)
    assert "planned and compiled only" in report.reason, report.reason
    gemms = [g for g in report.groups if g["kind"] == "gemm"]
    assert len(gemms) == 2
    assert torch.equal(again, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_on_a_gpu_an_autocast_model_is_verified_and_computes_the_same_outside_autocast():
    model, x = _case()
    model, x = model.cuda(), x.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fast = stitchcuda.optimize(model, (x,), progress=False, keep_slower=True)
        eager = model(x)
    assert fast.report.status == "optimized", fast.report.reason
    inside = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        inside = fast(x)
    outside = fast(x)
    assert inside.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(inside, outside)  # the captured forward either way
    exact = copy_in_fp64(model)(x.double())
    verdict = judge_accuracy(outside, eager, exact)
    assert verdict.ok, verdict.describe()
