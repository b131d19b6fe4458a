"""Layout planning, on any machine: a convolution chain is planned channels-last — its convolutions'
inputs, filters and results NHWC in memory, one conversion at the chain's edge, the elementwise groups
between the convolutions iterating in NHWC order — and the rest of the graph keeps its layout. (The
programs' results against eager PyTorch are checked on the GPU: tests/python/test_gpu_graph.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stitchcuda
from stitchcuda import jit
from stitchcuda.graph.capture import capture
from stitchcuda.graph.layout import channels_last_strides, is_channels_last
from stitchcuda.graph.lower import Lowering, fold_batch_norm
from stitchcuda.graph.build import group_entries
from stitchcuda.graph.planner import OfflinePlanner


class _ResidualBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        z = F.relu(self.b2(self.c2(y)) + y)
        return self.pool(z).mean((2, 3))


@pytest.fixture(autouse=True)
def _tf32_convolutions(stitch_settings, monkeypatch):
    """Channels-last is planned for tensor-core convolutions: fp32 ones while cuDNN may use TF32 (PyTorch's
    default, set here so that no other test's flags decide)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    stitch_settings(STITCHCUDA_CHANNELS_LAST=None)


def _lowered(model, x):
    graph = capture(model.eval(), (x,))
    plan = OfflinePlanner().plan(graph)
    lowering = Lowering(graph, plan, _constants(graph, plan, (x,)), 132)
    lowering.build(plan.groups, graph.inputs, graph.outputs)
    return graph, plan, lowering


def _layout(lowering, name):
    shape, strides, _ = lowering.spec[lowering.buf[name]]
    return shape, strides


def test_true_fp32_convolutions_keep_their_layout(monkeypatch):
    """With TF32 off for cuDNN, an fp32 chain's convolutions run on CUDA cores, where NHWC gains nothing
    and costs cuDNN workspace: no value is planned channels-last, and no layout variant is timed."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    graph, plan, lowering = _lowered(_ResidualBlock(), torch.randn(4, 16, 64, 64))
    assert plan.channels_last == frozenset()
    assert not [d for d in plan.decisions if d[0].startswith("convolution chains channels-last")]
    assert ("convolutions through cuDNN in fp32", "torch.backends.cudnn.allow_tf32 at call time") in plan.decisions
    convs = [n for g in plan.groups for n in g.nodes if n.op == "aten::convolution"]
    assert convs and not any(is_channels_last(*_layout(lowering, n.out.name)) for n in convs)


def test_a_model_with_tf32_convolutions_is_judged_at_tf32s_tolerance(monkeypatch):
    """With cuDNN's TF32 on (PyTorch's default) the model's own convolutions round to TF32, and an NHWC or
    folded-batch-norm algorithm rounds differently by more than 1e-4: the program's outputs are judged at
    TF32's tolerance, its matmuls still computed in fp32; with the flag off, at fp32's."""
    from stitchcuda.verify import tolerance

    _, plan, _ = _lowered(_ResidualBlock(), torch.randn(4, 16, 64, 64))  # the fixture: allow_tf32 on
    assert plan.precision == "fp32" and plan.tolerance_precision == "tf32"
    (why,) = [why for d, why in plan.decisions if d == "outputs judged at TF32's tolerance"]
    assert "2 fp32 convolution(s)" in why and "allow_tf32" in why
    assert tolerance(torch.float32, plan.tolerance_precision) == (1e-2, 1e-2)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    _, plan, _ = _lowered(_ResidualBlock(), torch.randn(4, 16, 64, 64))
    assert plan.tolerance_precision == "fp32"
    assert not [d for d, _ in plan.decisions if d.startswith("outputs judged")]
    # No convolution: nothing to judge differently, whatever the flag.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    _, plan, _ = _lowered(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), torch.randn(4, 16))
    assert plan.tolerance_precision == "fp32"


def test_the_channels_last_knob_overrides_the_precision_rule(stitch_settings, monkeypatch):
    """STITCHCUDA_CHANNELS_LAST=on plans the chain channels-last in true fp32 too (the NHWC path tested or
    timed at fp32's tolerance), off never plans it, and a value it does not know is an error naming it."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    stitch_settings(STITCHCUDA_CHANNELS_LAST="on")
    _, plan, _ = _lowered(_ResidualBlock(), torch.randn(4, 16, 64, 64))
    assert plan.channels_last
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    stitch_settings(STITCHCUDA_CHANNELS_LAST="off")
    _, plan, _ = _lowered(_ResidualBlock(), torch.randn(4, 16, 64, 64))
    assert plan.channels_last == frozenset()
    stitch_settings(STITCHCUDA_CHANNELS_LAST="always")
    with pytest.raises(ValueError, match="STITCHCUDA_CHANNELS_LAST must be one of auto, on, off, got 'always'"):
        _lowered(_ResidualBlock(), torch.randn(4, 16, 64, 64))


def test_a_convolution_chain_is_planned_channels_last_with_the_reason():
    graph, plan, lowering = _lowered(_ResidualBlock(), torch.randn(4, 16, 64, 64))
    convs = [n for g in plan.groups for n in g.nodes if n.op == "aten::convolution"]
    assert len(convs) == 2
    for n in convs:  # input, filter and result of each convolution
        for v in (n.args[0], n.args[1], n.out):
            assert v.name in plan.channels_last
    decision = [d for d in plan.decisions if d[0].startswith("convolution chains channels-last")]
    assert decision and "cuDNN" in decision[0][1]
    # Filters and results are NHWC in memory; the graph's input is converted once, by one generated copy.
    for n in convs:
        assert is_channels_last(*_layout(lowering, n.args[1].name))
        assert is_channels_last(*_layout(lowering, n.out.name))
    assert not is_channels_last(*_layout(lowering, graph.inputs[0].name))
    copies = [code for _, code in lowering.kernels if code.name.startswith("to_nhwc")]
    # The input is contiguous NCHW: a tiled transpose over (channels, pixels) of each image.
    assert len(copies) == 1 and "[N, 16, 64, 64] NCHW to NHWC" in copies[0].source
    assert copies[0].grid == (64 * 64 // 32, 1, 4) and copies[0].block == (32, 8)
    jit.compile(copies[0].source, copies[0].name)


def test_elementwise_groups_between_convolutions_run_in_nhwc_order():
    graph, plan, lowering = _lowered(_ResidualBlock(), torch.randn(4, 16, 64, 64))
    pointwise = [g for g in plan.groups if g.kind == "pointwise"]
    assert len(pointwise) == 2
    for g in pointwise:
        out = g.nodes[-1].out
        shape, strides = _layout(lowering, out.name)
        assert strides == channels_last_strides(shape)
    sources = {code.name: code.source for _, code in lowering.kernels}
    fused = [src for name, src in sources.items() if name.startswith("fused")]
    # The loop runs over (N, H, W, C): the last extent is the channel count, 32.
    assert fused and all("over [N, 64, 64, 32]" in src for src in fused)


def test_the_chains_output_edge_stages_its_nhwc_operands_through_tiles():
    class Returned(nn.Module):  # the residual sum is returned: NCHW, as the model's caller expects
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(16, 32, 3, padding=1), nn.Conv2d(32, 32, 3, padding=1)

        def forward(self, x):
            y = F.relu(self.c1(x))
            return F.relu(self.c2(y) + y)

    graph, plan, lowering = _lowered(Returned(), torch.randn(2, 16, 64, 64))
    (edge,) = [code for _, code in lowering.kernels if code.name.startswith("fused_edge")]
    # Both operands of the add are NHWC chain values: both staged; the result is stored NCHW.
    assert "2 NHWC operand(s) staged through 32x32 tiles" in edge.source
    assert edge.grid == (64 * 64 // 32, 1, 2) and edge.block == (32, 8)
    assert not is_channels_last(*_layout(lowering, graph.outputs[0].name))
    jit.compile(edge.source, edge.name)
    # Inside the chain the elementwise groups still iterate in NHWC order.
    inside = [code for _, code in lowering.kernels if code.name.startswith("fused") and "edge" not in code.name]
    assert len(inside) == 1 and "over [N, 64, 64, 32]" in inside[0].source


def test_the_chain_ends_where_a_step_needs_its_own_layout():
    graph, plan, lowering = _lowered(_ResidualBlock(), torch.randn(4, 16, 64, 64))
    pool = next(n for g in plan.groups for n in g.nodes if n.op == "aten::max_pool2d_with_indices")
    pooled = [(shape, strides) for shape, strides, _ in lowering.spec.values() if shape == pool.outputs[0].shape]
    # Pooling over NHWC data writes NHWC (the channels-last template: the values alone, no indices);
    # the mean's row reduction reads rows, so the pooled values get one contiguous copy, its input.
    assert sum(is_channels_last(*layout) for layout in pooled) == 1
    assert _layout(lowering, pool.outputs[0].name)[1] == (32 * 32 * 32, 32 * 32, 32, 1)
    out_shape, out_strides = _layout(lowering, graph.outputs[0].name)
    assert out_strides == (out_shape[1], 1)


def test_graphs_without_convolutions_keep_their_layouts():
    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            return torch.relu(self.fc(x)).reshape(2, 4, 4, 32) * 2.0

    graph, plan, lowering = _lowered(Mlp(), torch.randn(32, 32))
    assert plan.channels_last == frozenset()
    assert not [d for d in plan.decisions if "channels-last" in d[0]]
    assert not [code for _, code in lowering.kernels if code.name.startswith("to_nhwc")]


def test_a_depthwise_template_convolution_is_not_made_channels_last():
    class Depthwise(nn.Module):
        def __init__(self):
            super().__init__()
            self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)

        def forward(self, x):
            return F.relu6(self.dw(x))

    graph, plan, lowering = _lowered(Depthwise(), torch.randn(2, 32, 16, 16))
    assert any(g.kind == "conv" for g in plan.groups)  # the generated depthwise kernel reads NCHW
    assert plan.channels_last == frozenset()


def test_a_depthwise_convolution_inside_the_chain_joins_it_and_one_whose_result_is_returned_stays_nchw():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.expand, self.dw = nn.Conv2d(16, 32, 1), nn.Conv2d(32, 32, 3, padding=1, groups=32)
            self.project, self.side = nn.Conv2d(32, 16, 1), nn.Conv2d(16, 16, 3, padding=1, groups=16)

        def forward(self, x):
            inside = F.relu6(self.dw(F.relu(self.expand(x))))  # between two 1x1 convolutions
            return self.project(inside), F.relu(self.side(x * 2))  # returned: graph outputs keep their layout

    graph, plan, lowering = _lowered(Block(), torch.randn(2, 16, 64, 64))
    dw_inside, dw_side = [g for g in plan.groups if g.kind == "conv"]
    (inside,) = dw_inside.outputs(set())
    assert inside.name in plan.channels_last  # the fused ReLU6's result, NHWC for the projection
    assert not {v.name for v in dw_side.outputs(set())} & plan.channels_last
    names = [code.name for _, code in lowering.kernels]
    assert sum(n.startswith("depthwise_nhwc") for n in names) == 1 and sum(n.startswith("depthwise_") for n in names) == 2
    assert sum(n.startswith("to_nhwc") for n in names) == 1  # the chain's one edge: x into the expansion


def test_small_convolutions_and_rgb_stems_stay_nchw():
    class Stem(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 32, 3, padding=1)

        def forward(self, x):
            return F.relu(self.c(x))

    _, plan, _ = _lowered(Stem(), torch.randn(4, 3, 64, 64))  # three input channels
    assert plan.channels_last == frozenset()
    _, plan, _ = _lowered(_ResidualBlock(), torch.randn(1, 16, 8, 8))  # a launch-bound input
    assert plan.channels_last == frozenset()


# ---- convolution epilogues cuDNN fuses (planner.conv_epilogues) ----

class _Epilogues(nn.Module):
    """Every epilogue shape: conv -> BN -> ReLU, conv -> BN -> + z -> ReLU, conv with bias -> ReLU, and
    three that are not cuDNN's: conv -> BN -> SiLU, a BN alone, a convolution whose result two ops read."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)
        self.c3 = nn.Conv2d(32, 32, 1)
        self.c4, self.b4 = nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32, affine=False)
        self.c5, self.b5 = nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c6 = nn.Conv2d(32, 32, 1)
        for bn in (self.b1, self.b2, self.b4, self.b5):
            with torch.no_grad():
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
                if bn.affine:
                    bn.weight.uniform_(0.5, 1.5)
                    bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))             # fused: relu
        y = F.relu(self.b2(self.c2(y)) + y)         # fused: add_relu, z = y
        y = F.relu(self.c3(y))                      # fused: relu with the convolution's own bias
        y = F.silu(self.b4(self.c4(y)))             # SiLU: no cuDNN epilogue
        y = self.b5(self.c5(y))                     # no ReLU
        h = self.c6(y)
        return F.relu(h) + h                        # h read twice


def test_the_planner_finds_the_epilogues_cudnn_fuses_and_only_those():
    graph = capture(_Epilogues().eval(), (torch.randn(2, 16, 32, 32),))
    plan = OfflinePlanner().plan(graph)
    found = sorted(((m["conv"].name, m["bn"] is not None, m["z"] is not None) for m in plan.conv_epilogues.values()))
    assert found == [("convolution", True, False), ("convolution_1", True, True), ("convolution_2", False, False)]
    assert not plan.fuse_conv_epilogues  # optimize() times the fused program against the other and chooses
    # The residual's z is the block's input (the first ReLU's result).
    add_relu = next(m for m in plan.conv_epilogues.values() if m["z"] is not None)
    assert add_relu["z"] is next(m for m in plan.conv_epilogues.values() if m["conv"].name == "convolution")["out"]


class _InputResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x):
        return F.relu(self.conv(x) + x)


def test_a_fused_residual_reads_the_inputs_channels_last_copy():
    """relu(conv(x) + x) fused in cuDNN over a channels-last chain: the residual z is the program's NCHW
    input, which the chain already copied to NHWC for the convolution; the fused call reads that copy
    (given NCHW, cuDNN's call would make a channels-last copy of its own, one more input-sized tensor)."""
    graph = capture(_InputResidual().eval(), (torch.randn(8, 32, 64, 64),))
    plan = OfflinePlanner().plan(graph)
    assert plan.channels_last and plan.conv_epilogues
    plan.fuse_conv_epilogues = True
    program = Lowering(graph, plan, {}, 132).build(plan.groups, graph.inputs, graph.outputs)
    fused = next(s for s in program.steps if s["kind"] == "aten" and s["op"] == "aten::cudnn_convolution_add_relu")
    buffers = {b["id"]: b for b in program.buffers}
    x_in, z_in = buffers[fused["inputs"][0]], buffers[fused["inputs"][2]]
    assert x_in["id"] == z_in["id"] and x_in["role"] == "intermediate"
    assert is_channels_last(z_in["shape"], z_in["strides"])


def _constants(graph, plan, inputs) -> dict:
    """The values of the plan's constant groups (a bias viewed for the kernel after its convolution), as
    optimize() hands them to the lowering."""
    from stitchcuda.graph import reference_values

    values = reference_values(graph, list(inputs))
    return {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}


def test_fused_epilogues_lower_to_cudnns_fused_convolutions_with_the_batch_norm_folded():
    x = torch.randn(4, 16, 64, 64)
    graph = capture(_Epilogues().eval(), (x,))
    plan = OfflinePlanner().plan(graph)
    plan.fuse_conv_epilogues = True
    constants = _constants(graph, plan, (x,))
    lowering = Lowering(graph, plan, constants, 132)
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    aten = [s for s in program.steps if s["kind"] == "aten"]
    fused = [s for s in aten if s["op"].startswith("aten::cudnn_convolution")]
    assert [s["op"] for s in fused] == ["aten::cudnn_convolution_relu", "aten::cudnn_convolution_add_relu",
                                        "aten::cudnn_convolution_relu"]
    assert sum(s["op"] == "aten::convolution" for s in aten) == 3  # the three that are not cuDNN's
    buffers = {b["id"]: b for b in program.buffers}
    first = fused[0]
    assert first["attributes"] == {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}
    assert fused[1]["attributes"]["alpha"] == 1.0
    # The chain is channels-last: input, folded filter and result NHWC in memory.
    x_in, w_in, b_in = (buffers[i] for i in first["inputs"])
    assert is_channels_last(w_in["shape"], w_in["strides"]) and w_in["name"].endswith(".folded")
    assert is_channels_last(x_in["shape"], x_in["strides"]) and b_in["shape"] == [32]
    out = buffers[first["outputs"][0]]
    assert out["strides"] == list(channels_last_strides(out["shape"]))
    # Three epilogue kernels fewer than the program without fusion.
    plan.fuse_conv_epilogues = False
    unfused = Lowering(graph, plan, constants, 132)
    unfused.build(plan.groups, graph.inputs, graph.outputs)
    assert len(unfused.kernels) - len(lowering.kernels) == 3
    # The report says which ran: cuDNN's fused call for the three epilogues, a generated kernel otherwise.
    entries = group_entries(plan, lowering, set(), lowering.main_kernels)
    in_cudnn = [e for e in entries if "fused with its convolution in cuDNN's cudnn_convolution" in e["reason"]]
    assert len(in_cudnn) == 3 and not any("kernel" in e for e in in_cudnn), in_cudnn
    unfused_entries = group_entries(plan, unfused, set(), unfused.main_kernels)
    assert not any("cuDNN's cudnn_convolution" in e["reason"] for e in unfused_entries)

    def generated(rows):
        return sum("kernel" in e for e in rows)

    assert generated(unfused_entries) - generated(entries) == 3


def test_every_fused_step_binds_to_its_aten_schema():
    # Creation resolves every ATen step in the dispatcher and checks its arguments before it needs a GPU:
    # without one, the error is the missing device, not the step.
    x = torch.randn(2, 16, 32, 32)
    graph = capture(_Epilogues().eval(), (x,))
    plan = OfflinePlanner().plan(graph)
    plan.fuse_conv_epilogues = True
    program = Lowering(graph, plan, _constants(graph, plan, (x,)), 132).build(plan.groups, graph.inputs, graph.outputs)
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine creation goes on to run; tests/python/test_gpu_graph.py runs it")
    with pytest.raises(stitchcuda.StitchError, match=r"no CUDA device|CUDA driver \(libcuda"):
        program.executor()
    # The same check fails a step whose arguments do not fit the schema, before it looks for a GPU.
    b = stitchcuda.ProgramBuilder()
    x, w, bias = b.input([1, 4, 8, 8]), b.weight(torch.zeros(4, 4, 3, 3)), b.weight(torch.zeros(4))
    b.aten("aten::cudnn_convolution_relu", [x, w, bias], [b.output([1, 4, 6, 6])], stride=[1, 1], padding=[0, 0],
           dilation=[1, 1], group=1)
    with pytest.raises(stitchcuda.InvalidArgumentError, match=r"step 0 \(aten aten::cudnn_convolution_relu\)"):
        b.build().executor()


def test_folding_a_batch_norm_into_the_filter_and_bias_matches_the_two_ops():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 12, 12, dtype=torch.float64)
    w, b = torch.randn(16, 8, 3, 3, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    gamma, beta = torch.rand(16, dtype=torch.float64) + 0.5, torch.randn(16, dtype=torch.float64)
    mean, var = torch.randn(16, dtype=torch.float64), torch.rand(16, dtype=torch.float64) + 0.5
    for bias, g, bt in ((b, gamma, beta), (None, gamma, beta), (b, None, None)):
        want = F.batch_norm(F.conv2d(x, w, bias, padding=1), mean, var, g, bt, training=False, eps=1e-3)
        w2, b2 = fold_batch_norm(w, bias, g, bt, mean, var, 1e-3)
        torch.testing.assert_close(F.conv2d(x, w2, b2, padding=1), want, rtol=1e-12, atol=1e-12)
    # In the filter's dtype, computed in float64: the fp32 fold is the fp64 fold rounded once.
    w2, b2 = fold_batch_norm(w.float(), b.float(), gamma.float(), beta.float(), mean.float(), var.float(), 1e-5)
    exact = fold_batch_norm(w.float().double(), b.float().double(), gamma.float().double(), beta.float().double(),
                            mean.float().double(), var.float().double(), 1e-5)
    assert w2.dtype == b2.dtype == torch.float32
    assert torch.equal(w2, exact[0].float()) and torch.equal(b2, exact[1].float())


def test_the_report_says_which_program_variant_was_timed_faster():
    import importlib

    opt = importlib.import_module("stitchcuda.graph.build")
    nhwc = frozenset({"x"})
    times = {(nhwc, False): 2.0, (frozenset(), False): 2.5, (nhwc, True): 1.8}
    decisions = dict(opt.variant_decisions(times, (nhwc, True), 3))
    assert decisions.keys() == {"convolution chains channels-last (measured)",
                                "convolution epilogues fused in cuDNN (measured)"}
    assert "channels-last 2.0000 ms, NCHW 2.5000 ms" in decisions["convolution chains channels-last (measured)"]
    why = decisions["convolution epilogues fused in cuDNN (measured)"]
    assert "3 convolution(s)" in why and "1.8000 ms, a convolution and a generated epilogue kernel 2.0000 ms" in why
    # NCHW only (no chain worth converting), the generated epilogues faster.
    decisions = opt.variant_decisions({(frozenset(), False): 1.0, (frozenset(), True): 1.2}, (frozenset(), False), 1)
    assert [d[0] for d in decisions] == ["convolution epilogues as generated kernels (measured)"]


def test_variants_within_the_timers_spread_are_decided_by_their_planned_memory():
    """The fastest variant is kept unless another is within VARIANT_TIE of it and plans less working
    memory (a channels-last chain whose edge copy of a large input buys nothing measurable): then that one,
    and the report says why with both times and both plans."""
    import importlib

    opt = importlib.import_module("stitchcuda.graph.build")
    nhwc, nchw = (frozenset({"x"}), False), (frozenset(), False)
    mib = 1 << 20
    assert opt.choose_variant({nhwc: 1.00, nchw: 1.01}, {nhwc: 1568 * mib, nchw: 784 * mib}) == nchw
    assert opt.choose_variant({nhwc: 1.00, nchw: 1.05}, {nhwc: 1568 * mib, nchw: 784 * mib}) == nhwc  # a real gain
    assert opt.choose_variant({nhwc: 1.00, nchw: 1.01}, {nhwc: 784 * mib, nchw: 784 * mib}) == nhwc  # the faster
    assert opt.choose_variant({nhwc: float("inf"), nchw: 1.0}, {nhwc: 0, nchw: 784 * mib}) == nchw  # one failed
    decisions = dict(opt.variant_decisions({nhwc: 1.00, nchw: 1.01}, nchw, 0, {nhwc: 1568 * mib, nchw: 784 * mib}))
    why = decisions["program variants within 2%: the one planning less memory kept (measured)"]
    assert "1.0100 ms planning 784 MiB against the fastest's 1.0000 ms planning 1,568 MiB" in why
    assert "convolution chains kept NCHW (measured)" in decisions
