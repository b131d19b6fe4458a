"""Casts between dtypes are elementwise ops the planner fuses into their neighbours: a bf16/fp16 Llama-like
block (RMSNorm with its fp32 upcast and downcast, rotary embedding with rotate_half written through chunk,
SwiGLU, residual adds) plans with no group made of casts alone, its norms one kernel each, and its 16-bit
program compiles with NVRTC for sm_90. The same plan shapes in fp32 run through the CUDA emulator (it has
no 16-bit types) against eager."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from stitchcuda.graph import Lowering, OfflinePlanner, capture, reference_values

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_graph_emulated import run_program  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, unavailable  # noqa: E402


class _RMSNorm(nn.Module):
    """Statistics in fp32, the result cast back before the scale (how Llama's reference code writes it)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Block(nn.Module):
    """One decoder layer: RMSNorm, q/k/v with rotary embedding, SDPA, output projection and residual;
    RMSNorm, SwiGLU and residual."""

    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 128, seq: int = 16):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.n1, self.n2 = _RMSNorm(dim), _RMSNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32),
                             1.0 / 10000 ** (torch.arange(0, self.head_dim, 2) / self.head_dim))
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.n1(x)
        q, k, v = (p(h).view(b, t, self.heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _planned(dtype: torch.dtype):
    torch.manual_seed(0)
    model = _Block().eval().to(dtype)
    x = torch.randn(2, 16, 64, dtype=dtype)
    graph = capture(model, (x,))
    return graph, OfflinePlanner().plan(graph)


def _ops(group) -> list[str]:
    return [n.op.removeprefix("aten::") for n in group.nodes]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_no_cast_stands_alone_in_a_16_bit_llama_block(dtype):
    graph, plan = _planned(dtype)
    casts = [n for n in graph.nodes if n.op == "aten::_to_copy"]
    assert len(casts) == 6, [n.op for n in graph.nodes]  # two norms' up and down, SwiGLU's silu in fp32 and back
    generated = [g for g in plan.groups if g.kind in ("pointwise", "reduction")]
    # Before: 9 kernels — each norm's upcast and square apart from its reduction (the upcast value, read by
    # the square and the scaling, stored in fp32 with the square), the residual add before the second norm
    # on its own, each rotate_half's negation on its own (the RoPE kernel then read the negated half and the
    # other half as a concatenation's pieces).
    assert [(g.kind, _ops(g)) for g in generated] == [
        ("reduction", ["_to_copy", "pow.Tensor_Scalar", "mean.dim", "add.Tensor", "rsqrt", "mul.Tensor", "_to_copy",
                       "mul.Tensor"]),
        ("pointwise", ["mul.Tensor", "cat", "mul.Tensor", "add.Tensor"] * 2),  # q's and k's RoPE, x read rotated
        # The residual add joins the second norm, which also stores the sum the last add reads.
        ("reduction", ["add.Tensor", "_to_copy", "pow.Tensor_Scalar", "mean.dim", "add.Tensor", "rsqrt", "mul.Tensor",
                       "_to_copy", "mul.Tensor"]),
        ("pointwise", ["_to_copy", "sigmoid", "mul.Tensor", "_to_copy", "mul.Tensor"]),  # SwiGLU
        ("pointwise", ["add.Tensor"]),
    ], [(g.kind, _ops(g)) for g in generated]
    # Every cast is inside a group that computes something besides casts; no negation is a kernel of its own.
    owner = {id(n): g for g in plan.groups for n in g.nodes}
    for n in casts:
        assert any(op not in ("_to_copy", "clone") for op in _ops(owner[id(n)])), _ops(owner[id(n)])
    assert not any(_ops(g) == ["neg"] for g in plan.groups)
    norm, second = generated[0], generated[2]
    assert [n.op for n in norm.params["prologue"]] == ["aten::_to_copy", "aten::pow.Tensor_Scalar"]
    assert "recomputed where the row's ops read them" in norm.reason and "stores" not in norm.params
    (residual,) = second.params["stores"]
    assert residual.producer is second.nodes[0] and residual.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_16_bit_block_program_compiles_for_sm_90(dtype):
    graph, plan = _planned(dtype)
    values = reference_values(graph, [torch.randn(2, 16, 64, dtype=dtype)])
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    lowering = Lowering(graph, plan, constants)
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    program.compile_kernels("sm_90a")
    norms = [c for g, c in ((g, lowering.main_kernels.get(id(g))) for g in plan.groups)
             if c is not None and g.kind == "reduction"]
    assert len(norms) == 2 and "more value(s) of the row stored" in norms[1].description
    ctype = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half"}[dtype]
    for code in norms:
        # The norm reads the 16-bit row and writes the 16-bit result; no fp32 copy of the row is an argument.
        assert f"const {ctype}* __restrict__ in0" in code.source and f"{ctype}* __restrict__ y" in code.source
        assert "const float* __restrict__" not in code.source.split("__global__")[1].split(")")[0]


class _ResidualNorm(nn.Module):
    """fp32 stand-in of the 16-bit norm's shape for the emulator: s = x + r is returned (the residual stream,
    which the norm's kernel stores), h = s * 1.5 is read by the square and by the scaling, as the upcast is."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x, r):
        s = x + r
        h = s * 1.5
        return s, self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")
@pytest.mark.parametrize("dim", [64, 2048], ids=["warp-per-row", "row-in-registers"])
def test_a_norm_that_reads_its_prologues_value_again_gives_eager_results(tmp_path, dim):
    torch.manual_seed(3)
    model = _ResidualNorm(dim).eval()
    x, r = torch.randn(3, 5, dim), torch.randn(3, 5, dim)
    graph = capture(model, (x, r))
    plan = OfflinePlanner().plan(graph)
    generated = [(g.kind, _ops(g)) for g in plan.groups if g.kind in ("pointwise", "reduction")]
    # One kernel: it adds the residual on load (x and r read once), and stores the sum s as well as the norm.
    assert generated == [("reduction", ["add.Tensor", "mul.Tensor", "pow.Tensor_Scalar", "mean.dim", "add.Tensor",
                                        "rsqrt", "mul.Tensor", "mul.Tensor"])], generated
    values = reference_values(graph, [x, r])
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    lowering = Lowering(graph, plan, constants)
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    (norm,) = [g for g in plan.groups if g.kind == "reduction"]
    assert "more value(s) of the row stored" in lowering.main_kernels[id(norm)].description
    assert len(program.kernels) == 1
    got = run_program(EmulatedJit(tmp_path), program, [x, r], {**constants, **values})
    with torch.no_grad():
        want = model(x, r)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


class _AutocastAttentionInput(nn.Module):
    """A pre-norm attention's input under autocast: the fp32 layer norm's output is cast to bf16 once per
    projection that reads it (three identical casts in the captured graph)."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) + self.k(h) * self.v(h)


def _interpret(graph, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The Graph's own nodes run by torch in order (not the exported program): what the planner's graph
    computes, so a rewrite of its nodes is checked against the model."""
    env = {v.name: t for v, t in zip(graph.inputs, inputs)}
    env.update({w.name: w.data for w in graph.weights})

    def value(a):
        if isinstance(a, (list, tuple)):
            return type(a)(value(x) for x in a)
        return env[a.name] if hasattr(a, "name") and hasattr(a, "producer") else a

    for n in graph.nodes:
        result = n.target(*value(n.args), **{k: value(v) for k, v in n.kwargs.items()})
        for v, r in zip(n.outputs, result if isinstance(result, (tuple, list)) else [result]):
            if v is not None:
                env[v.name] = r
    return [env[v.name] for v in graph.outputs]


def test_autocasts_repeated_casts_merge_into_one_that_joins_the_norm():
    torch.manual_seed(4)
    model, x = _AutocastAttentionInput().eval(), torch.randn(2, 16, 64)
    graph = capture(model, (x,), autocast=("cpu", torch.bfloat16))
    of_norm = [n for n in graph.nodes if n.op == "aten::_to_copy" and n.args[0].producer is not None
               and n.args[0].producer.op == "aten::native_layer_norm"]
    assert len(of_norm) == 3  # autocast casts the norm's output for each projection
    plan = OfflinePlanner().plan(graph)
    assert any(d.startswith("2 repeated cast(s) merged") for d, _ in plan.decisions), plan.decisions
    assert sum(n.op == "aten::_to_copy" and n.args[0].producer is not None
               and n.args[0].producer.op == "aten::native_layer_norm" for n in graph.nodes) == 1
    (norm,) = [g for g in plan.groups if g.kind == "reduction"]
    assert _ops(norm) == ["native_layer_norm", "_to_copy"] and norm.params["result"].dtype == torch.bfloat16
    assert not any(set(_ops(g)) == {"_to_copy"} for g in plan.groups if g.kind == "pointwise" and
                   g.nodes[0].args[0].producer is not None and g.nodes[0].args[0].producer.op == "aten::native_layer_norm")
    # The rewired graph still computes the model under its autocast, value for value.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
    (got,) = _interpret(graph, [x])
    assert got.dtype == want.dtype and torch.equal(got, want)
    # Its program compiles (the norm's kernel stores the bf16 cast, read by the three projections).
    values = reference_values(graph, [x])  # the graph holds the casts: run without autocast, as programs are
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    lowering = Lowering(graph, plan, constants)
    lowering.build(plan.groups, graph.inputs, graph.outputs).compile_kernels("sm_90a")
    assert "__nv_bfloat16* __restrict__ y" in lowering.main_kernels[id(norm)].source


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_16_bit_block_runs_its_fused_norms_on_a_gpu(dtype):
    import stitchcuda

    torch.manual_seed(0)
    model = _Block().eval().to(device="cuda", dtype=dtype)
    x = torch.randn(2, 16, 64, device="cuda", dtype=dtype)
    # keep_slower: the program's mechanics, not its speed at this size
    fast = stitchcuda.optimize(model, (x,), compare_compile=False, keep_slower=True, progress=False)
    assert fast.report.status == "optimized", str(fast.report)
    assert fast.report.verification["passed"], fast.report.verification
    # Both fused norms passed their group checks (a group that fell back is listed as "aten (fallback)").
    norms = [g for g in fast.report.groups if g["kind"] == "reduction" and "_to_copy" in g["nodes"]]
    assert len(norms) == 2, (fast.report.groups, fast.report.fallbacks)
    for _ in range(3):
        xs = torch.randn(2, 16, 64, device="cuda", dtype=dtype)
        with torch.no_grad():
            want = model(xs)
            torch.testing.assert_close(fast(xs).float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_16_bit_layer_norm_is_planned_and_lowered_with_its_row_in_registers(dtype):
    model = nn.Sequential(nn.LayerNorm(768)).eval().to(dtype)
    x = torch.randn(4, 16, 768, dtype=dtype)
    graph = capture(model, (x,))
    plan = OfflinePlanner().plan(graph)
    (norm,) = [g for g in plan.groups if g.kind == "reduction"]
    assert "a warp per row, the row held in registers" in norm.reason, norm.reason
    lowering = Lowering(graph, plan, {})
    lowering.build(plan.groups, graph.inputs, graph.outputs)
    code = lowering.main_kernels[id(norm)]
    assert "row held in registers" in code.description and "16-bit operands" in code.description


class _ResidualThen(nn.Module):
    """s = x + r, read by a row reduction and returned (a pre-norm block's residual stream)."""

    def __init__(self, kind: str, dim: int):
        super().__init__()
        self.kind, self.norm = kind, nn.LayerNorm(dim)

    def forward(self, x, r):
        s = x + r
        y = {"layer_norm": lambda: self.norm(s), "softmax": lambda: torch.softmax(s, -1),
             "mean": lambda: s.mean(-1, keepdim=True)}[self.kind]()
        return s, y * 2


@pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")
@pytest.mark.parametrize("kind", ["layer_norm", "softmax", "mean"])
@pytest.mark.parametrize("dim", [64, 768, 40000], ids=["warp-per-row", "row-in-registers", "shared-memory"])
def test_a_16_bit_residual_sum_read_again_later_is_stored_by_the_reduction_that_adds_it(tmp_path, monkeypatch,
                                                                                      kind, dim):
    import test_graph_emulated
    from test_lowp_templates import _soft

    torch.manual_seed(dim)
    model = _ResidualThen(kind, dim).eval()
    with torch.no_grad():
        model.norm.weight.add_(0.1 * torch.randn(dim))
    model = model.to(torch.bfloat16)
    x, r = (torch.randn(3, 2, dim, dtype=torch.bfloat16) for _ in range(2))
    graph = capture(model, (x, r))
    plan = OfflinePlanner().plan(graph)
    (red,) = [g for g in plan.groups if g.kind == "reduction"]
    assert _ops(red)[0] == "add.Tensor" and red.params["kept_input"].name == graph.outputs[0].name
    assert not any(_ops(g) == ["add.Tensor"] for g in plan.groups)  # no kernel of its own for the sum
    values = reference_values(graph, [x, r])
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    lowering = Lowering(graph, plan, constants)
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    assert "its input stored as computed" in lowering.main_kernels[id(red)].description
    # The program's 16-bit kernels in the emulator, with the software fp16/bf16 header.
    monkeypatch.setattr(test_graph_emulated, "_fp32_only", _soft)
    monkeypatch.setitem(test_graph_emulated._PROGRAM_DTYPES, "bf16", torch.bfloat16)
    s, y = run_program(EmulatedJit(tmp_path), program, [x, r], {**constants, **values})
    with torch.no_grad():
        want_s, want_y = model(x, r)
    assert torch.equal(s, want_s)
    torch.testing.assert_close(y.float(), want_y.float(), atol=2 ** -6, rtol=2 ** -7)  # a 16-bit step apart
    # The same model in fp32 keeps the add a kernel of its own (the rule is for 16-bit chains for now).
    fp32 = OfflinePlanner().plan(capture(model.float(), (x.float(), r.float())))
    assert any(_ops(g) == ["add.Tensor"] for g in fp32.groups)
