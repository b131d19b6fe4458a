"""graph/attention.py finds attention in captured graphs — SDPA calls and attention written out the ways users
and benchmark problems write it — and describes it exactly (the description, evaluated, gives the module's
output); look-alikes that are not a fusable attention are left alone."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from stitchcuda.graph import capture
from stitchcuda.graph.attention import find_attention

B, H, N, D = 2, 4, 16, 32


def _qkv(heads_kv: int = H, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, N, D, generator=g), torch.randn(B, heads_kv, N, D, generator=g),
            torch.randn(B, heads_kv, N, D, generator=g))


def _find(module, args):
    graph = capture(module.eval(), args)
    return graph, find_attention(graph)


def _value(x, inputs):
    """A graph value computed from the example inputs by replaying its producers (weights from the graph)."""
    if x.name in inputs:
        return inputs[x.name]
    if x.kind == "weight":
        return x.data

    def resolve(a):
        return _value(a, inputs) if hasattr(a, "producer") else type(a)(map(resolve, a)) if isinstance(
            a, (list, tuple)) else a

    p = x.producer
    return p.target(*resolve(p.args), **{k: resolve(a) for k, a in p.kwargs.items()})


def _evaluate(found, graph, args):
    """The attention the description says, computed from the example inputs in fp64."""
    inputs = {v.name: a for v, a in zip(graph.inputs, args)}
    q, k, v = (_value(x, inputs).double() for x in (found.q, found.k, found.v))
    rep = found.heads // found.kv_heads
    k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    s = q @ k.transpose(-1, -2) * found.scale
    if found.causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if found.mask is not None:
        m = _value(found.mask, inputs)
        if found.mask_kind == "additive":
            s = s + m.double()
        elif found.mask_kind == "drop":
            s = s.masked_fill(m, found.mask_value)
        else:
            s = s.masked_fill(~m, found.mask_value if found.mask_value is not None else float("-inf"))
    return torch.softmax(s, -1) @ v


class ManualCausal(nn.Module):  # the textbook form, mask from torch.triu
    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.triu(torch.ones(N, N, dtype=torch.bool), diagonal=1), float("-inf"))
        return torch.softmax(s, dim=-1) @ v


class GPT2Style(nn.Module):  # a registered tril buffer, compared with 0, dropout in eval
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64))
        self.drop = nn.Dropout(0.1)

    def forward(self, q, k, v):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :N, :N] == 0, float("-inf"))
        return self.drop(F.softmax(att, dim=-1)) @ v


class AdditiveMask(nn.Module):  # HF eager style: scaling by mul, mask added
    def forward(self, q, k, v, mask):
        w = torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask
        return torch.matmul(nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


class PaddingMask(nn.Module):  # key padding: True marks a padded key
    def forward(self, q, k, v, pad):
        s = q @ k.transpose(-1, -2) / 8
        return s.masked_fill(pad[:, None, None, :], float("-inf")).softmax(-1) @ v


class ManualGQA(nn.Module):  # Llama's repeat_kv written with repeat_interleave
    def forward(self, q, k, v):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5, -1) @ v


class SdpaCausal(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class SdpaGQA(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.3)


WRITTEN = {"manual-causal": (ManualCausal, dict(causal=True, mask_kind=None, scale=D ** -0.5)),
           "gpt2-buffer": (GPT2Style, dict(causal=True, mask_kind=None, scale=D ** -0.5)),
           "additive-mask": (AdditiveMask, dict(causal=False, mask_kind="additive", scale=0.125)),
           "padding-mask": (PaddingMask, dict(causal=False, mask_kind="drop", scale=1 / 8)),
           "gqa-repeat-interleave": (ManualGQA, dict(causal=False, kv_heads=2, scale=D ** -0.5)),
           "sdpa-causal": (SdpaCausal, dict(causal=True, kind="sdpa", scale=D ** -0.5)),
           "sdpa-gqa": (SdpaGQA, dict(kv_heads=2, kind="sdpa", scale=0.3))}


@pytest.mark.parametrize("case", list(WRITTEN))
def test_attention_is_found_and_described_exactly(case):
    cls, expected = WRITTEN[case]
    kv_heads = expected.get("kv_heads", H)
    q, k, v = _qkv(kv_heads)
    args = (q, k, v)
    if case == "additive-mask":
        args += (torch.randn(B, 1, N, N),)
    if case == "padding-mask":
        pad = torch.zeros(B, N, dtype=torch.bool)
        pad[0, 11:] = True
        args += (pad,)
    module = cls()
    graph, found = _find(module, args)
    assert len(found) == 1
    a = found[0]
    assert a.kind == expected.get("kind", "written")
    assert (a.batch, a.heads, a.kv_heads, a.q_len, a.kv_len, a.head_dim) == (B, H, kv_heads, N, N, D)
    assert a.causal == expected.get("causal", False)
    assert a.mask_kind == expected.get("mask_kind")
    assert a.scale == pytest.approx(expected["scale"], rel=1e-6)
    assert a.q is graph.inputs[0] and a.k is graph.inputs[1] and a.v is graph.inputs[2]
    assert a.output is graph.outputs[0]
    torch.testing.assert_close(_evaluate(a, graph, args).float(), module(*args), atol=1e-5, rtol=1e-5)


def test_a_softmax_taken_in_fp32_between_bf16_matmuls_is_absorbed():
    """HF's eager attention at bf16: softmax(dtype=float32).to(bf16) — casts the fused kernel's fp32 softmax makes
    unnecessary."""
    q, k, v = (x.bfloat16() for x in _qkv())
    mask = torch.randn(B, 1, N, N).bfloat16()
    graph, found = _find(AdditiveMask(), (q, k, v, mask))
    assert len(found) == 1 and found[0].mask is graph.inputs[3] and found[0].output is graph.outputs[0]
    assert sum(n.op == "aten::_to_copy" for n in found[0].nodes) == 2


def test_multihead_attention_without_weights_is_an_sdpa_over_its_projections():
    mha = nn.MultiheadAttention(D, H, batch_first=True)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    x = torch.randn(B, N, D)
    graph, found = _find(Block(), (x,))
    assert len(found) == 1
    a = found[0]
    assert (a.kind, a.heads, a.kv_heads, a.q_len, a.head_dim, a.causal) == ("sdpa", H, H, N, D // H, False)
    assert a.q.kind == "node"  # a view of the packed projection, read through strides
    sdpa = _value(a.output, {graph.inputs[0].name: x})
    torch.testing.assert_close(_evaluate(a, graph, (x,)).float(), sdpa, atol=1e-5, rtol=1e-5)


def test_a_vision_attention_block_discarding_its_weights_is_found():
    """A benchmark-style block: pixels as tokens through nn.MultiheadAttention whose averaged weights are thrown
    away (export drops them), so the written-out attention inside is fusable: [B*H, N, D] matmuls."""

    class VisionAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.norm = nn.MultiheadAttention(128, 4), nn.LayerNorm(128)

        def forward(self, x):
            b, c, h, w = x.shape
            x = x.view(b, c, h * w).permute(2, 0, 1)
            a, _ = self.attn(x, x, x)
            return self.norm(a + x).permute(1, 2, 0).reshape(b, c, h, w)

    x = torch.randn(2, 128, 8, 8)
    graph, found = _find(VisionAttention(), (x,))
    assert len(found) == 1
    a = found[0]
    assert (a.kind, a.heads, a.q_len, a.kv_len, a.head_dim, a.causal, a.mask) == ("written", 8, 64, 64, 32, False, None)
    assert a.scale == pytest.approx(32 ** -0.5)
    inputs = {graph.inputs[0].name: x}
    torch.testing.assert_close(_evaluate(a, graph, (x,)).float(), _value(a.output, inputs), atol=1e-5, rtol=1e-5)


def test_multihead_attention_returning_weights_is_not_fused():
    """Its averaged probabilities are an output: the scores must exist, nothing to fuse."""
    _, found = _find(nn.MultiheadAttention(D, H, batch_first=True), (torch.randn(B, N, D),) * 3)
    assert found == []


class SoftmaxOverQueries(nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-2) @ v


class LogSoftmax(nn.Module):
    def forward(self, q, k, v):
        return torch.log_softmax(q @ k.transpose(-1, -2), dim=-1) @ v


class ReturnsWeights(nn.Module):
    def forward(self, q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return p @ v, p


class LearnedTemperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.rand(H, 1, 1) + 0.5)

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * self.t, dim=-1) @ v


class Gating(nn.Module):  # softmax then an elementwise product, no second matmul
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) * (v @ v.transpose(-1, -2))


class ProbabilitiesOnTheRight(nn.Module):
    def forward(self, q, k, v):
        return v.transpose(-1, -2) @ torch.softmax(q @ k.transpose(-1, -2), dim=-1)


class NoTranspose(nn.Module):  # q @ k with k [.., D, N] as given: not a q k^T of key rows
    def forward(self, q, k, v):
        return torch.softmax(q @ k.reshape(B, H, D, N), dim=-1) @ v


@pytest.mark.parametrize("cls", [SoftmaxOverQueries, LogSoftmax, ReturnsWeights, LearnedTemperature, Gating,
                                 ProbabilitiesOnTheRight, NoTranspose], ids=lambda c: c.__name__)
def test_look_alikes_do_not_match(cls):
    _, found = _find(cls(), _qkv())
    assert found == []


def test_a_tiled_kv_repeat_is_not_taken_for_gqa():
    """k.repeat(1, 2, 1, 1) puts query head h on kv head h % 2, not h // 2: the repeated tensor is read as is."""

    class Tiled(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.repeat(1, 2, 1, 1).transpose(-1, -2), -1) @ v.repeat(1, 2, 1, 1)

    q, k, v = _qkv(2)
    graph, found = _find(Tiled(), (q, k, v))
    assert len(found) == 1 and found[0].kv_heads == H and found[0].k is not graph.inputs[1]


def test_the_exactness_check_can_fail():
    """The evaluation the tests compare with differs from the module when the description is wrong."""
    q, k, v = _qkv()
    graph, (a,) = _find(ManualCausal(), (q, k, v))
    a.causal = False
    assert not torch.allclose(_evaluate(a, graph, (q, k, v)).float(), ManualCausal()(q, k, v), atol=1e-3)


# ---- found attention, computed by the fused kernel (CPU emulator) -------------------------------------------

def _emulator():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
    from cpu_emulator import emulator
    return emulator


@pytest.mark.skipif(_emulator().unavailable() is not None, reason="CUDA emulator unavailable")
@pytest.mark.parametrize("case", ["manual-causal", "gqa-repeat-interleave", "additive-mask", "sdpa-gqa"])
def test_the_fused_kernel_computes_what_was_found(tmp_path, case):
    """Capture, find, generate the kernel from the description alone and run it: the module's output."""
    import re

    from stitchcuda.graph.templates.attention import flash_attention_kernel

    emulator = _emulator()
    cls, expected = WRITTEN[case]
    q, k, v = _qkv(expected.get("kv_heads", H), seed=3)
    args = (q, k, v) + ((torch.randn(B, 1, N, N),) if case == "additive-mask" else ())
    module = cls()
    graph, (a,) = _find(module, args)
    code = flash_attention_kernel("found", batch=a.batch, heads=a.heads, kv_heads=a.kv_heads, q_len=a.q_len,
                                  kv_len=a.kv_len, head_dim=a.head_dim, dtype=a.q.dtype, causal=a.causal,
                                  mask_dtype=a.mask.dtype if a.mask is not None else None)
    inputs = {x.name: t for x, t in zip(graph.inputs, args)}
    tensors = {"q": inputs[a.q.name], "k": inputs[a.k.name], "v": inputs[a.v.name], "o": torch.empty_like(q)}
    call = [tensors.get(key) if kind in ("in", "out") else key for kind, key in code.args]
    call[-1] = a.scale
    if a.mask is not None:  # [B, 1, N, N]: the head dimension broadcast
        call[3] = inputs[a.mask.name]
        call[-5:-1] = [N * N, 0, N, 1]
    source = "\n".join(l for l in code.source.splitlines() if not re.search(r"__half|__nv_bfloat16|#include <cuda_", l))
    kernel = emulator.EmulatedModule(emulator.EmulatedJit(tmp_path), source).kernel(code.name)
    kernel(code.grid, code.block, *call, shared_mem=code.shared_mem)
    torch.testing.assert_close(tensors["o"], module(*args), atol=1e-4, rtol=1e-4)
