"""torchvision's models as users have them (random weights, the library's own definitions), on any
machine: captured, planned and compiled (classifiers, ShuffleNet's channel shuffle, DenseNet's concatenations, a
segmentation model's dict output). ResNet's conv -> batch norm -> [+ residual] -> ReLU epilogues
are found for cuDNN's fused convolutions; ViT's attention (nn.MultiheadAttention, whose packed
projection traces as a bmm against its weight expanded over the tokens) stores each weight once. The
GPU tests run the programs (tests/python/test_gpu_graph.py)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import stitchcuda
from stitchcuda.graph import Lowering, OfflinePlanner, capture
from stitchcuda.graph.lower import constant_values
from stitchcuda.program import DTYPES

models = pytest.importorskip("torchvision.models")

PLANNED = "planned and compiled only"


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name.startswith("segmentation."):  # a dict output ({"out": ...}), bilinear upsampling to the input's size
        return getattr(models.segmentation, name.split(".")[1])(weights=None, weights_backbone=None).eval()
    return getattr(models, name)(weights=None).eval()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the plan-only path runs where there is no GPU")
@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v3_small", "vit_b_16", "swin_t", "shufflenet_v2_x1_0",
                                  "densenet121", "segmentation.lraspp_mobilenet_v3_large"])
def test_each_model_is_captured_planned_and_compiled(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = stitchcuda.optimize(_model(name), (torch.randn(2, 3, 224, 224),), progress=False)
    assert PLANNED in fast.report.reason, fast.report.reason
    assert not fast.report.fallbacks


def test_resnet_epilogues_are_found_for_cudnns_fused_convolutions():
    graph = capture(_model("resnet50"), (torch.randn(2, 3, 224, 224),))
    plan = OfflinePlanner().plan(graph)
    convolutions = sum(n.op == "aten::convolution" for n in graph.nodes)
    residual = [m for m in plan.conv_epilogues.values() if m["z"] is not None]
    # 53 convolutions: the stem and each bottleneck's first two end in BN -> ReLU (33); each bottleneck's
    # last adds the shortcut before its ReLU (16: the last block's epilogue is fused into the global
    # average pool's loads instead, and in the 4 blocks with a projected shortcut the shortcut's batch norm
    # is computed in the same kernel as the sum, so its result never reaches memory: 11 left for cuDNN).
    assert convolutions == 53 and len(plan.conv_epilogues) == 44 and len(residual) == 11
    merged = [g for g in plan.groups if g.kind == "pointwise"
              and [n.op for n in g.nodes].count("aten::_native_batch_norm_legit_no_training") == 2]
    assert len(merged) == 4
    assert all(m["bn"] is not None for m in plan.conv_epilogues.values())


def test_vits_attention_stores_each_weight_once():
    model = _model("vit_b_16")
    graph = capture(model, (torch.randn(2, 3, 224, 224),))
    plan = OfflinePlanner().plan(graph)
    constants = constant_values(graph, {g.nodes[0].out.name for g in plan.groups if g.kind == "constant"})
    program = Lowering(graph, plan, constants).build(plan.groups, graph.inputs, graph.outputs)
    stored = sum(math.prod(b["shape"]) * DTYPES[b["dtype"]].itemsize for b in program.buffers if b["role"] == "weight")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stored <= weights * 1.001, (stored / 2**20, weights / 2**20)  # not 12 x 2 x 1.4 GB of expansions
    broadcast = [g for g in plan.groups if g.kind == "gemm" and "broadcast over the batch" in g.reason]
    assert len(broadcast) == 12  # every layer's packed input projection


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["resnet18", "vit_b_16"])
def test_gpu_the_model_runs_as_a_verified_program(name, monkeypatch):
    # True fp32 convolutions and matmuls in the model and the program alike: with TF32 on, cuDNN's NHWC and
    # NCHW algorithms round differently, beyond fp32's 1e-4 (measured on the H200: 8.6e-4 on ResNet-18).
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = _model(name).cuda()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = stitchcuda.optimize(model, (x,), keep_slower=True, measure=False, compare_compile=False,
                                   progress=False)
    report = fast.report
    assert report.status == "optimized" and report.verification["passed"], report.reason
    if name == "resnet18":
        assert any(d.startswith("convolution epilogues") for d, _ in report.decisions), report.decisions
    x2 = torch.randn_like(x)
    torch.testing.assert_close(fast(x2), model(x2), rtol=1e-4, atol=1e-4)
