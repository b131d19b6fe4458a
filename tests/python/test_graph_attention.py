"""Attention written out inside optimize()'s plan: the planner replaces the matmul -> scale -> mask -> softmax ->
matmul nodes by one attention group (an ATen SDPA step, or the fused template where asked), the lowered program
never holds the N x N scores, and the whole program — run on the CPU, kernels through the corpus's CUDA
emulator and ATen steps through torch — gives the module's output."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, unavailable  # noqa: E402
from test_graph_emulated import run_program  # noqa: E402  (the program's steps on the CPU)

from stitchcuda.graph import Lowering, OfflinePlanner, capture, reference_values  # noqa: E402
from stitchcuda.graph.accuracy import group_reference  # noqa: E402
from stitchcuda.graph.attention import find_attention, reference  # noqa: E402
from stitchcuda.graph.lower import group_inputs, working_bytes  # noqa: E402

B, H, N, D = 2, 4, 24, 32

emulated = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")


# ---- hand-written attention, the ways models write it ----------------------------------------------------------

class TriuCausal(nn.Module):  # the textbook causal form: a triu mask filled with -inf
    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.triu(torch.ones(N, N, dtype=torch.bool), diagonal=1), float("-inf"))
        return torch.softmax(s, dim=-1) @ v


class BufferCausal(nn.Module):  # a registered tril buffer compared with 0, K transposed by permute, dropout in eval
    def __init__(self):
        super().__init__()
        self.register_buffer("tril", torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64))
        self.drop = nn.Dropout(0.2)

    def forward(self, q, k, v):
        s = torch.matmul(q, k.permute(0, 1, 3, 2)) * (1.0 / math.sqrt(k.size(-1)))
        s = s.masked_fill(self.tril[:, :, :N, :N] == 0, float("-inf"))
        return self.drop(torch.softmax(s, -1)) @ v


class Additive(nn.Module):  # an additive mask (HF's eager form), K transposed with explicit dims
    def forward(self, q, k, v, mask):
        w = torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask
        return torch.matmul(torch.softmax(w, dim=-1), v)


class PaddingDrop(nn.Module):  # key padding: True hides a key (masked_fill)
    def forward(self, q, k, v, pad):
        s = q @ k.transpose(-1, -2) / 8
        return s.masked_fill(pad[:, None, None, :], -1e9).softmax(-1) @ v


class WhereKeep(nn.Module):  # torch.where(keep, scores, -inf): True attends
    def forward(self, q, k, v, keep):
        s = q @ k.transpose(-1, -2) * D ** -0.5
        return torch.softmax(torch.where(keep, s, torch.tensor(float("-inf"))), -1) @ v


class RepeatGQA(nn.Module):  # Llama's repeat_kv with repeat_interleave
    def forward(self, q, k, v):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5, -1) @ v


class ExpandGQA(nn.Module):  # HF's repeat_kv: [:, :, None].expand().reshape(), causal
    def forward(self, q, k, v):
        b, hkv, n, d = k.shape
        k = k[:, :, None].expand(b, hkv, 2, n, d).reshape(b, hkv * 2, n, d)
        v = v[:, :, None].expand(b, hkv, 2, n, d).reshape(b, hkv * 2, n, d)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, -1) @ v


class PixelAttention(nn.Module):  # pixels as tokens through nn.MultiheadAttention, its weights discarded
    def __init__(self):
        super().__init__()
        self.attn, self.norm = nn.MultiheadAttention(64, 2, bias=False), nn.LayerNorm(64)  # no bias: the CPU runner
        # computes plain products only

    def forward(self, x):
        b, c, h, w = x.shape
        t = x.view(b, c, h * w).permute(2, 0, 1)
        a, _ = self.attn(t, t, t)
        return self.norm(a + t).permute(1, 2, 0).reshape(b, c, h, w)


def _qkv(kv_heads: int = H, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, N, D, generator=g), torch.randn(B, kv_heads, N, D, generator=g),
            torch.randn(B, kv_heads, N, D, generator=g))


def _case(name: str):
    """(module, inputs, expected (causal, mask kind, kv heads)) of one hand-written form."""
    if name == "pixels":
        torch.manual_seed(0)
        return PixelAttention().eval(), (torch.randn(2, 64, 4, 6),), (False, None, 4)
    kv = 2 if name.endswith("gqa") else H
    args = _qkv(kv)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0, 17:] = True
    keep = torch.rand(B, 1, N, N, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[..., 0] = True  # every query attends to some key
    extra = {"additive": (torch.randn(B, 1, N, N),), "padding-drop": (pad,), "where-keep": (keep,)}.get(name, ())
    module = {"triu-causal": TriuCausal, "buffer-causal": BufferCausal, "additive": Additive,
              "padding-drop": PaddingDrop, "where-keep": WhereKeep, "repeat-gqa": RepeatGQA,
              "expand-gqa": ExpandGQA}[name]()
    expected = {"triu-causal": (True, None), "buffer-causal": (True, None), "additive": (False, "additive"),
                "padding-drop": (False, "drop"), "where-keep": (False, "keep"), "repeat-gqa": (False, None),
                "expand-gqa": (True, None)}[name]
    return module.eval(), args + extra, (*expected, kv)


CASES = ["triu-causal", "buffer-causal", "additive", "padding-drop", "where-keep", "repeat-gqa", "expand-gqa",
         "pixels"]


def _plan(module, inputs, attention="sdpa"):
    graph = capture(module, inputs)
    return graph, OfflinePlanner(attention=attention).plan(graph)


@pytest.mark.parametrize("name", CASES)
def test_the_plan_holds_one_attention_step_instead_of_matmul_and_softmax_groups(name):
    module, inputs, (causal, mask_kind, kv_heads) = _case(name)
    graph, plan = _plan(module, inputs)
    (group,) = [g for g in plan.groups if g.kind == "attention"]
    a = group.params["attention"]
    assert (a.causal, a.mask_kind, a.kv_heads, group.params["impl"]) == (causal, mask_kind, kv_heads, "sdpa")
    assert "scaled_dot_product_attention" in group.reason and "never in memory" in group.reason
    ops = {n.op for n in group.nodes}
    assert {"aten::bmm", "aten::_softmax"} <= ops
    # No other group computes the scores or their softmax (the GEMMs left are the projections: pixels).
    rest = [n for g in plan.groups if g is not group for n in g.nodes]
    assert not any(n.op == "aten::_softmax" or n.outputs and n.out is not None
                   and tuple(n.out.shape[-2:]) == (a.q_len, a.kv_len) for n in rest)
    # A causal mask the step no longer reads is not kept (nor computed, nor stored as a constant).
    if causal:
        assert not any(g.kind == "constant" and g.nodes[0].out.dtype == torch.bool for g in plan.groups)


def test_attention_off_keeps_the_written_groups():
    module, inputs, _ = _case("triu-causal")
    _, plan = _plan(module, inputs, attention="off")
    assert not any(g.kind == "attention" for g in plan.groups)
    assert any(g.kind == "reduction" and g.params.get("kind") == "softmax" for g in plan.groups)
    with pytest.raises(ValueError, match="attention must be one of"):
        OfflinePlanner(attention="flash")


def test_a_fill_that_does_not_mask_keeps_the_written_groups_and_says_why():
    class SoftFill(nn.Module):  # masked scores set to -1, not hidden: no boolean mask computes that
        def forward(self, q, k, v, pad):
            return (q @ k.transpose(-1, -2) / 8).masked_fill(pad[:, None, None, :], -1.0).softmax(-1) @ v

    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[:, 20:] = True
    _, plan = _plan(SoftFill().eval(), (*_qkv(), pad))
    assert not any(g.kind == "attention" for g in plan.groups)
    (why,) = [r for d, r in plan.decisions if d.startswith("attention at")]
    assert "filled with -1.0" in why


def _program(graph, plan, inputs):
    values = reference_values(graph, list(inputs))
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    return Lowering(graph, plan, constants).build(plan.groups, graph.inputs, graph.outputs), values  # weights too


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("emulated"))


@emulated
@pytest.mark.parametrize("name", CASES)
def test_the_sdpa_program_gives_the_module_output(emu, name):
    module, inputs, _ = _case(name)
    graph, plan = _plan(module, inputs)
    program, values = _program(graph, plan, inputs)
    steps = [s.get("op") for s in program.steps if s["kind"] == "aten"]
    assert "aten::scaled_dot_product_attention" in steps and "aten::_softmax" not in steps
    (got,) = run_program(emu, program, list(inputs), values)
    with torch.no_grad():
        want = module(*inputs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@emulated
@pytest.mark.parametrize("name", ["triu-causal", "additive", "padding-drop", "expand-gqa", "pixels"])
def test_the_fused_template_program_gives_the_module_output(emu, name):
    module, inputs, _ = _case(name)
    graph, plan = _plan(module, inputs, attention="fused")
    (group,) = [g for g in plan.groups if g.kind == "attention"]
    assert group.params["impl"] == "fused" and "fused attention template" in group.reason
    program, values = _program(graph, plan, inputs)
    assert not any(s.get("op") == "aten::scaled_dot_product_attention" for s in program.steps)
    assert sum(s["kind"] == "kernel" for s in program.steps) >= 1
    (got,) = run_program(emu, program, list(inputs), values)
    with torch.no_grad():
        want = module(*inputs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_head_dim_the_template_lacks_falls_back_to_sdpa_and_says_so():
    q, k, v = (torch.randn(1, 2, 8, 40) for _ in range(3))
    _, plan = _plan(RepeatGQA().eval(), (torch.randn(1, 4, 8, 40), k, v), attention="fused")
    (group,) = [g for g in plan.groups if g.kind == "attention"]
    assert group.params["impl"] == "sdpa" and "the template cannot: head dims 40" in group.reason


class SdpaCall(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


class LongTriuCausal(nn.Module):  # TriuCausal at any length
    def forward(self, q, k, v):
        n = q.shape[-2]
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1), float("-inf"))
        return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("module, dtype, n, d, impl", [
    (LongTriuCausal(), torch.float32, 256, 64, "fused"),  # written out, fp32 at 64: the FMA kernel led SDPA
    (LongTriuCausal(), torch.float32, 256, 128, "sdpa"),  # fp32 at 128: 0.83x of SDPA's memory-efficient kernel
    (LongTriuCausal(), torch.float32, 256, 32, "sdpa"),  # fp32 at 32: not measured
    (SdpaCall(True), torch.bfloat16, 256, 128, "fused"),  # an SDPA call at bf16: the mma.sync kernel led flash
    (SdpaCall(False), torch.float16, 197, 64, "fused"),
    (SdpaCall(False), torch.bfloat16, 256, 96, None),  # no kernel measured at 96: the call stays SDPA's
    (SdpaCall(True), torch.bfloat16, 64, 64, None),  # fewer queries than the measured shapes
], ids=["written-fp32-d64", "written-fp32-d128", "written-fp32-d32", "sdpa-bf16-d128", "sdpa-fp16-d64", "sdpa-bf16-d96", "sdpa-short"])
def test_auto_takes_prefill_attention_where_the_template_was_measured_ahead(module, dtype, n, d, impl):
    inputs = tuple(torch.randn(1, 4, n, d).to(dtype) for _ in range(3))
    _, plan = _plan(module.eval(), inputs, attention="auto")
    groups = [g for g in plan.groups if g.kind == "attention"]
    assert [g.params["impl"] for g in groups] == ([impl] if impl else [])
    if impl == "fused":
        assert any("as the fused prefill template" in text and "measured ahead of SDPA" in why
                   for text, why in plan.decisions)


def test_auto_leaves_masked_prefill_attention_to_sdpa():
    q, k, v = (torch.randn(1, 4, 256, 64) for _ in range(3))
    additive = torch.randn(1, 1, 256, 256)
    _, plan = _plan(Additive().eval(), (q, k, v, additive), attention="auto")
    assert [g.params["impl"] for g in plan.groups if g.kind == "attention"] == ["sdpa"]


def test_the_bf16_tensor_core_path_compiles_with_nvrtc():
    module, inputs, _ = _case("additive")
    inputs = tuple(x.bfloat16() for x in inputs)
    graph, plan = _plan(module, inputs, attention="fused")
    program, _ = _program(graph, plan, inputs)
    program.compile_kernels("sm_90a")
    (kernel,) = [k for k in program.kernels if "wmma" in k["source"]]
    assert "__nv_bfloat16" in kernel["source"]


# ---- memory: neither the program nor the group's check holds the scores -------------------------------------------

def test_neither_the_program_nor_the_group_check_plans_the_scores():
    n = 2048  # 2 heads of 2,048 x 2,048 fp32 scores: 32 MiB, against 0.5 MiB for q, k, v each
    q, k, v = (torch.randn(1, 2, n, 32) for _ in range(3))

    class Long(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-1, -2) * 32 ** -0.5, -1) @ v

    graph = capture(Long().eval(), (q, k, v))
    scores = 2 * n * n * 4
    budget = 4 * q.numel() * 4  # q, k, v and the output

    def planned(plan, groups, inputs, outputs):
        return working_bytes(Lowering(graph, plan, {}).build(groups, inputs, outputs))

    off = OfflinePlanner(attention="off").plan(graph)
    assert planned(off, off.groups, graph.inputs, graph.outputs) >= scores  # the written-out form holds them
    for attention in ("sdpa", "fused"):
        plan = OfflinePlanner(attention=attention).plan(graph)
        assert planned(plan, plan.groups, graph.inputs, graph.outputs) < budget
        (group,) = [g for g in plan.groups if g.kind == "attention"]
        inputs = group_inputs(group)
        assert [v.name for v in inputs] == [v.name for v in graph.inputs]
        assert planned(plan, [group], inputs, group.outputs({v.name for v in graph.outputs})) < budget


def test_the_accuracy_reference_of_an_attention_group_is_computed_in_slices():
    module, inputs, _ = _case("padding-drop")
    graph, plan = _plan(module, inputs)
    (group,) = [g for g in plan.groups if g.kind == "attention"]
    a = group.params["attention"]
    slices: list[int] = []
    row = B * H * N * 8  # one query row's fp64 scores, over every (batch, head)
    q, k, v, pad = inputs
    got = reference(a, q, k, v, pad[:, None, None, :], dtype=torch.float64, slice_bytes=5 * row, slices=slices)
    assert slices == [5, 5, 5, 5, 4]
    with torch.no_grad():
        want = module(*(x.double() if x.is_floating_point() else x for x in inputs))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # The accuracy rule reads this reference for the group instead of running its nodes.
    ref = group_reference(group, reference_values(graph, list(inputs)), torch.float64)
    assert list(ref) == [a.output.name]
    torch.testing.assert_close(ref[a.output.name], want, atol=1e-12, rtol=1e-12)


def test_the_found_attention_is_the_one_the_recognizer_describes():
    module, inputs, _ = _case("expand-gqa")
    graph, plan = _plan(module, inputs)
    (group,) = [g for g in plan.groups if g.kind == "attention"]
    (found,) = find_attention(graph)
    a = group.params["attention"]
    assert (a.q.name, a.k.name, a.v.name, a.output.name) == (found.q.name, found.k.name, found.v.name,
                                                             found.output.name)
    assert [v.name for v in group_inputs(group)] == [v.name for v in graph.inputs]
