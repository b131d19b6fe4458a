"""optimize(model) on a GPU: an MLP, a transformer block and a CNN block come back optimized, correct on
fresh inputs, with a report; a generated group that is wrong falls back to ATen with the reason; the
artifact reproduces the module bitwise; torch.compile(backend=...) runs the same pipeline.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stitchcuda
from stitchcuda.bench import graph as bench_graph
from stitchcuda.graph import templates

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _exact_fp32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def MLP():
    return bench_graph.MLP(256, 512, 128)


def Attention():
    return bench_graph.Block(d=64, heads=4)


class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))).mean(dim=(2, 3))


def _check(model, inputs, fresh):
    torch.manual_seed(0)
    model = model.cuda().eval()
    fast = stitchcuda.optimize(model, inputs, compare_compile=False)
    assert fast.report.status == "optimized", str(fast.report)
    assert fast.report.verification["passed"] and fast.report.timing["speedup_eager"] > 0
    # Groups were checked in the worker: none fell back because the worker failed to run them.
    worker_failures = [f for f in fast.report.fallbacks if f["reason"].split(":")[0] in
                       ("runtime", "crash", "timeout", "load", "oom", "illegal-address", "device-assert")]
    assert not worker_failures, worker_failures
    assert any("isolated worker" in d for d, _ in fast.report.decisions)
    for _ in range(3):
        xs = fresh()
        with torch.no_grad():
            torch.testing.assert_close(fast(*xs), model(*xs), atol=1e-4, rtol=1e-4)
    return fast


def test_mlp_uses_cublaslt_epilogues_and_is_correct():
    fast = _check(MLP(), (torch.randn(64, 256, device="cuda"),), lambda: (torch.randn(64, 256, device="cuda"),))
    kinds = [g["kind"] for g in fast.report.groups]
    assert kinds.count("gemm") == 3 and "pointwise" not in kinds, fast.report  # relu and tanh-GELU fused
    assert "bias_relu" in str(fast.report) and "bias_gelu" in str(fast.report)


def test_transformer_block_is_correct():
    fast = _check(Attention(), (torch.randn(2, 16, 64, device="cuda"),), lambda: (torch.randn(2, 16, 64, device="cuda"),))
    kinds = {g["kind"] for g in fast.report.groups}
    assert {"gemm", "reduction", "pointwise"} <= kinds
    assert any(g.get("kernel", "").startswith("layer_norm") for g in fast.report.groups)
    assert any(g.get("kernel", "").startswith("softmax") for g in fast.report.groups)


def test_cnn_block_keeps_the_convolution_in_cudnn():
    fast = _check(ConvBlock(), (torch.randn(4, 16, 12, 12, device="cuda"),),
                  lambda: (torch.randn(4, 16, 12, 12, device="cuda"),))
    groups = fast.report.groups
    assert any(g["kind"] == "aten" and "convolution" in g["nodes"] for g in groups)
    # BN + ReLU computed on load by the global mean: one kernel, the activation never stored.
    assert any(g["kind"] == "reduction" and "batch_norm" in g["nodes"] and "mean" in g["nodes"] for g in groups), groups


class DepthwiseBlock(nn.Module):
    def __init__(self, c=32, stride=1):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=stride, padding=1, groups=c, bias=stride == 2)
        self.bn = nn.BatchNorm2d(c)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.2, 0.2)
            self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        return F.silu(self.bn(self.conv(x)))


@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_convolution_runs_as_one_template_kernel(stride):
    fresh = lambda: (torch.randn(4, 32, 28, 28, device="cuda"),)  # noqa: E731
    fast = _check(DepthwiseBlock(stride=stride), fresh(), fresh)
    assert not fast.report.fallbacks, fast.report.fallbacks
    (conv,) = [g for g in fast.report.groups if g["kind"] == "conv"]
    assert conv["kernel"].startswith("depthwise") and "batch_norm" in conv["nodes"] and "sigmoid" in conv["nodes"]


class _BigPointwise(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x) * x + 1.0


def test_replay_mode_is_measured_and_the_kept_runner_is_the_one_named(tmp_path):
    # One kernel over 64 MiB: a graph replay would add a copy of the input and of the output (256 MiB of
    # traffic against the kernel's 128 MiB), so the direct launch must be measured faster and kept.
    x = torch.randn(4096, 4096, device="cuda")
    fast = stitchcuda.optimize(_BigPointwise().cuda().eval(), (x,), measure=False)
    assert fast.report.status == "optimized", str(fast.report)
    chosen = [(d, why) for d, why in fast.report.decisions if why.startswith("measured on the example inputs")]
    assert len(chosen) == 1, fast.report.decisions
    decision, why = chosen[0]
    assert decision.startswith("launch the steps directly"), chosen
    graph_ms = float(why.split("CUDA graph replay ")[1].split(" ms")[0])
    direct_ms = float(why.split("direct launches ")[1].split(" ms")[0])
    assert direct_ms < graph_ms, why
    before = fast._runner.stats()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), torch.sigmoid(x) * x + 1.0)
    after = fast._runner.stats()
    assert after["replays"] == before["replays"] and after["eager_runs"] == before["eager_runs"] + 1
    # The choice travels with the artifact: a server loading it launches directly too.
    assert fast.program.replay == {"mode": "direct", "reason": why}
    fast.save(tmp_path / "big.stitch")
    loaded = stitchcuda.load(tmp_path / "big.stitch")
    for _ in range(3):
        torch.testing.assert_close(loaded(x), torch.sigmoid(x) * x + 1.0)
    assert loaded.stats()["replays"] == 0 and loaded.stats()["eager_runs"] == 3


@pytest.mark.parametrize("isolated", [True, False])
def test_a_wrong_group_falls_back_to_aten_with_the_reason(monkeypatch, isolated):
    monkeypatch.setitem(templates.POINTWISE_OPS, "aten::relu", lambda a, kw: f"({a[0]} + 1.0f)")
    model = ConvBlock().cuda().eval()
    x = torch.randn(2, 16, 8, 8, device="cuda")
    fast = stitchcuda.optimize(model, (x,), measure=False, isolated=isolated)
    assert fast.report.status == "optimized"
    assert any("differs from ATen" in f["reason"] for f in fast.report.fallbacks), fast.report.fallbacks
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-4, rtol=1e-4)


def test_saved_artifact_reproduces_the_module(tmp_path):
    model = MLP().cuda().eval()
    x = torch.randn(64, 256, device="cuda")
    fast = stitchcuda.optimize(model, (x,), measure=False)
    fast.save(tmp_path / "mlp.stitch")
    loaded = stitchcuda.load(tmp_path / "mlp.stitch")
    assert torch.equal(loaded(x), fast(x))
    hardware = loaded.program.verified_on
    assert hardware["device"] == torch.cuda.get_device_name() and hardware["arch"].startswith("sm_")
    assert hardware["torch"] == torch.__version__


def test_torch_compile_backend():
    from stitchcuda.graph import dynamo

    dynamo.register()
    model = MLP().cuda().eval()
    compiled = torch.compile(model, backend="stitchcuda")
    x = torch.randn(64, 256, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    assert dynamo.reports and dynamo.reports[-1].status == "optimized", dynamo.reports[-1]
