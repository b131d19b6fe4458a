"""The pooling template: 2-D average and max pooling give PyTorch's answers for every configuration the
Planner hands it (kernel, stride, padding, dilation, ceil mode, count_include_pad, divisor_override, NaN),
run on the CPU through the corpus's CUDA emulator against torch; the Planner's choice of which pools
become the template and which stay on ATen, and why; the lowered program (no indices buffer, the
elementwise ops after the pool applied before the store) validating and compiling with NVRTC; and, on a
GPU, optimize() of the two KernelBench pooling problems at a small size matching eager.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, EmulatedModule, unavailable  # noqa: E402

from stitchcuda import jit  # noqa: E402
from stitchcuda.graph import Lowering, OfflinePlanner, capture, reference_values  # noqa: E402
from stitchcuda.graph.layout import is_channels_last  # noqa: E402
from stitchcuda.graph.templates import (PointwiseInput, RowPrologue, pool_output_size, pooling_blocker,  # noqa: E402
                                        pooling_kernel)
from stitchcuda.graph.templates.common import PRELUDE  # noqa: E402

emulated = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")
KERNELBENCH = Path(__file__).resolve().parents[2] / "bench" / "kernelbench"


def _fp32_only(source: str) -> str:
    """The emulator has no fp16/bf16 types: drop their includes and overloads (fp32 kernels do not use them)."""
    return "\n".join(l for l in source.splitlines() if not re.search(r"__half|__nv_bfloat16|#include <cuda_", l))


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("emulated-pooling"))


def _launch_all(emu, codes, tensors):
    """Builds every kernel in one emulated module (one C++ compile for all) and launches each on its tensors."""
    body = "".join(code.source[len(PRELUDE):] for code in codes)
    module = EmulatedModule(emu, _fp32_only(PRELUDE + body))
    for code, t in zip(codes, tensors):
        kernel = module.kernel(code.name)
        kernel(code.grid, code.block, *[t[key] if kind in ("in", "out") else key for kind, key in code.args])


def _reference(kind, x, kernel, stride, padding, dilation=(1, 1), ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    if kind == "max":
        return F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)
    return F.avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)


def _grid():
    """Every kernel 2/3/5 x stride 1/2/3 x padding 0/1/2 (PyTorch allows padding up to half the window)
    x ceil mode, with count_include_pad both ways for the average. Inputs alternate between rows of a
    multiple of 4 (the 16-byte path) and odd ones (per-element loads), with odd heights."""
    cases = []
    for kind, k, s, p, ceil in itertools.product(("avg", "max"), (2, 3, 5), (1, 2, 3), (0, 1, 2), (False, True)):
        if p > k // 2:
            continue
        for include in ((True, False) if kind == "avg" else (True,)):
            shape = (2, 3, 11, 16) if len(cases) % 2 == 0 else (1, 2, 9, 13)
            cases.append((kind, shape, (k, k), (s, s), (p, p), ceil, include))
    return cases


@emulated
def test_every_kernel_stride_padding_and_rounding_matches_torch(emu):
    cases = _grid()
    assert len(cases) == 126
    torch.manual_seed(0)
    codes, tensors, expected = [], [], []
    for i, (kind, shape, k, s, p, ceil, include) in enumerate(cases):
        x = torch.randn(shape)
        want = _reference(kind, x, k, s, p, ceil_mode=ceil, count_include_pad=include)
        assert want.shape[-2:] == (pool_output_size(shape[2], k[0], s[0], p[0], 1, ceil),
                                   pool_output_size(shape[3], k[1], s[1], p[1], 1, ceil))
        codes.append(pooling_kernel(f"pool{i}", kind, shape, k, s, p, (1, 1), ceil, include))
        tensors.append({"x": x, "y": torch.full_like(want, float("nan"))})
        expected.append(want)
    # Both load paths are covered: 16-byte loads with the halo from neighbouring lanes, and per-element.
    assert any("16-byte" in c.description and "halo" in c.description for c in codes)
    assert any("segment loaded once" in c.description for c in codes)
    _launch_all(emu, codes, tensors)
    for case, t, want in zip(cases, tensors, expected):
        # The same sum in the same order and the same division as PyTorch: equal, not merely close.
        torch.testing.assert_close(t["y"], want, atol=0, rtol=0, msg=lambda m, c=case: f"{c}: {m}")


# (kind, shape, kernel, stride, padding, dilation, ceil_mode, count_include_pad, divisor_override)
_SPECIAL = [
    ("avg", (2, 3, 10, 12), (3, 3), (1, 1), (1, 1), (1, 1), False, False, None),    # op_avgpool_same's pool
    ("max", (2, 3, 12, 16), (3, 3), (2, 2), (1, 1), (1, 1), False, True, None),     # op_maxpool_overlap's pool
    ("avg", (2, 2, 10, 8), (5, 5), (3, 3), (2, 2), (1, 1), True, False, 7),         # divisor_override wins
    ("avg", (2, 2, 9, 12), (3, 3), (1, 1), (1, 1), (1, 1), True, True, 4),
    ("avg", (1, 3, 7, 9), (2, 3), (2, 1), (1, 0), (1, 1), True, False, None),       # non-square, odd sizes
    ("avg", (1, 3, 13, 20), (3, 2), (1, 2), (1, 1), (1, 1), True, True, None),
    ("max", (1, 3, 7, 9), (2, 3), (2, 1), (1, 0), (2, 1), True, True, None),        # dilated rows
    ("max", (2, 2, 12, 16), (3, 3), (1, 1), (1, 1), (2, 2), False, True, None),     # dilated, 16-byte path
    ("max", (1, 2, 11, 12), (3, 3), (1, 1), (1, 1), (3, 3), True, True, None),
    ("max", (1, 2, 2, 8), (2, 2), (1, 1), (1, 1), (3, 3), False, True, None),       # windows of padding only
    ("max", (1, 2, 6, 160), (3, 3), (1, 1), (1, 1), (1, 1), False, True, None),     # a row spans two warps
    ("avg", (1, 2, 9, 132), (3, 3), (2, 2), (1, 1), (1, 1), True, False, None),     # lane 31 ends a row
    ("max", (3, 5, 6, 6), (2, 2), (2, 2), (0, 0), (1, 1), False, True, None),       # rows shorter than a warp
    ("avg", (1, 1, 3, 2), (3, 3), (1, 1), (1, 1), (1, 1), False, False, None),      # fewer outputs than a group
    ("max", (4, 9, 9), (3, 3), (2, 2), (1, 1), (1, 1), True, True, None),           # unbatched [C, H, W]
    ("avg", (1, 2, 20, 24), (8, 8), (1, 1), (4, 4), (1, 1), False, False, None),    # the largest window
    ("max", (1, 2, 20, 24), (8, 1), (1, 1), (4, 0), (3, 1), True, True, None),      # tall and dilated
]


@emulated
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
def test_non_square_dilated_overridden_and_unusual_shapes_match_torch(emu, misaligned):
    # A misaligned input or output takes the per-element loads or stores: the same answers.
    torch.manual_seed(1)
    codes, tensors, expected = [], [], []
    for i, (kind, shape, k, s, p, d, ceil, include, divisor) in enumerate(_SPECIAL):
        x = torch.randn(shape) * 4
        want = _reference(kind, x, k, s, p, d, ceil, include, divisor)
        if misaligned:
            xs = torch.empty(x.numel() + 1)
            xs[1:] = x.flatten()
            x = xs[1:].view(shape)
        ys = torch.full((want.numel() + 1,), float("nan"))
        y = (ys[1:] if misaligned else ys[:-1]).view(want.shape)
        codes.append(pooling_kernel(f"special{i}", kind, shape, k, s, p, d, ceil, include, divisor))
        tensors.append({"x": x, "y": y})
        expected.append(want)
    _launch_all(emu, codes, tensors)
    for case, t, want in zip(_SPECIAL, tensors, expected):
        torch.testing.assert_close(t["y"], want, atol=0, rtol=0, msg=lambda m, c=case: f"{c}: {m}")


@emulated
def test_max_pooling_propagates_nan_and_keeps_infinities_as_torch(emu):
    torch.manual_seed(2)
    shapes = [(2, 3, 12, 16), (2, 3, 11, 13)]  # the 16-byte path, the per-element one
    configs = [((3, 3), (2, 2), (1, 1)), ((3, 3), (1, 1), (1, 1)), ((2, 2), (2, 2), (0, 0))]
    codes, tensors, expected, cases = [], [], [], []
    for shape, (k, s, p) in itertools.product(shapes, configs):
        x = torch.randn(shape)
        flat = x.view(-1)
        flat[torch.randperm(flat.numel())[:9]] = float("nan")
        flat[torch.randperm(flat.numel())[:9]] = float("inf")
        x[0, 0, 2:6, 2:6] = float("-inf")  # whole windows of -inf give -inf, not the padding's
        x[1, 1, :, 0] = float("nan")  # NaN at the left edge, read from a neighbour's registers or loaded
        want = F.max_pool2d(x, k, s, p)
        assert want.isnan().any() and want.isneginf().any()
        codes.append(pooling_kernel(f"nanmax{len(codes)}", "max", shape, k, s, p))
        tensors.append({"x": x, "y": torch.zeros_like(want)})
        expected.append(want)
        cases.append((shape, k, s, p))
    _launch_all(emu, codes, tensors)
    for case, t, want in zip(cases, tensors, expected):
        torch.testing.assert_close(t["y"], want, atol=0, rtol=0, equal_nan=True, msg=lambda m, c=case: f"{c}: {m}")
    # The average of a window holding a NaN or both infinities is NaN too, as in torch.
    x = tensors[0]["x"]
    code = pooling_kernel("nanavg", "avg", tuple(x.shape), (3, 3), (1, 1), (1, 1), count_include_pad=False)
    y = torch.zeros_like(x)
    _launch_all(emu, [code], [{"x": x, "y": y}])
    torch.testing.assert_close(y, F.avg_pool2d(x, 3, 1, 1, count_include_pad=False), equal_nan=True)


@emulated
def test_pooling_applies_its_output_function_before_the_store(emu):
    # relu(pool(x) * scale[c] + 1): the per-channel operand is read by the output's coordinates.
    torch.manual_seed(3)
    scale = torch.randn(3)
    cases = [("avg", (2, 3, 8, 12), (3, 3), (1, 1), (1, 1)), ("max", (2, 3, 12, 16), (3, 3), (2, 2), (1, 1)),
             ("max", (2, 3, 9, 11), (2, 2), (2, 2), (0, 0))]
    codes, tensors, expected = [], [], []
    for i, (kind, shape, k, s, p) in enumerate(cases):
        x = torch.randn(shape)
        pooled = _reference(kind, x, k, s, p)
        output = RowPrologue(tuple(pooled.shape), [PointwiseInput("o0", torch.float32, (0, 1, 0, 0))],
                             ["const float t0 = yv * o0;", "const float t1 = t0 + 1.0f;",
                              "const float t2 = fmaxf(t1, 0.0f);"], "t2", ("yv",))
        code = pooling_kernel(f"pool_relu{i}", kind, shape, k, s, p, output=output)
        assert code.args[:3] == [("in", "x"), ("in", "o0"), ("out", "y")] and code.args[3][0] == "i64"  # its groups
        assert "3 elementwise op(s) applied before the store" in code.description
        codes.append(code)
        tensors.append({"x": x, "o0": scale, "y": torch.full_like(pooled, float("nan"))})
        expected.append(torch.relu(pooled * scale.view(1, 3, 1, 1) + 1))
    _launch_all(emu, codes, tensors)
    for t, want in zip(tensors, expected):
        torch.testing.assert_close(t["y"], want, atol=1e-6, rtol=1e-6)


def test_the_output_size_rule_is_pytorchs():
    # Ceil mode rounds up unless the last window would start past the input and its left padding.
    for size, k, s, p, d, ceil in itertools.product((1, 2, 5, 8, 13), (1, 2, 3, 5), (1, 2, 3), (0, 1, 2), (1, 2),
                                                      (False, True)):
        if p > k // 2 or size + 2 * p < d * (k - 1) + 1:
            continue
        got = pool_output_size(size, k, s, p, d, ceil)
        want = F.max_pool1d(torch.zeros(1, 1, size), k, s, p, d, ceil).shape[-1]
        assert got == want, (size, k, s, p, d, ceil)


def test_unsupported_configurations_say_why():
    f32 = torch.float32
    assert pooling_blocker("max", (1, 2, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1), False, f32) is None
    assert "fp32, fp16 and bf16" in pooling_blocker("max", (1, 2, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1), False,
                                                      torch.float64)
    assert "64 taps" in pooling_blocker("avg", (1, 2, 16, 16), (9, 9), (1, 1), (0, 0), (1, 1), False, f32)
    assert "more than half" in pooling_blocker("avg", (1, 2, 8, 8), (3, 3), (1, 1), (2, 2), (1, 1), False, f32)
    assert "5-D input" in pooling_blocker("avg", (1, 2, 4, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1), False, f32)
    with pytest.raises(ValueError, match="has no template here: .*64 taps"):
        pooling_kernel("big", "max", (1, 1, 16, 16), (9, 9), (1, 1), (4, 4))
    with pytest.raises(ValueError, match="no dilation"):
        pooling_kernel("dil", "avg", (1, 1, 16, 16), (3, 3), (1, 1), (1, 1), (2, 2))
    with pytest.raises(ValueError, match="divisor_override"):
        pooling_kernel("div", "avg", (1, 1, 16, 16), (3, 3), (1, 1), (1, 1), divisor_override=0)


def test_every_path_and_dtype_compiles_with_nvrtc_without_spilling():
    # Half and bfloat16 read and write through the conversions, summing in fp32.
    for dtype, (kind, shape, k, s, p, d, ceil, include, divisor) in itertools.product(
            (torch.float32, torch.float16, torch.bfloat16), _SPECIAL[:4]):
        code = pooling_kernel(f"k_{kind}_{str(dtype)[6:]}", kind, shape, k, s, p, d, ceil, include, divisor, dtype)
        assert ("16-byte" in code.description) == (dtype == torch.float32 and shape[-1] % 4 == 0)
        jit.compile(code.source, code.name)
    # The largest windows keep the values they hold in registers (fewer rows per thread when tall).
    for i, (kind, shape, k, s, p, d, ceil, include, divisor) in enumerate(_SPECIAL[-2:]):
        code = pooling_kernel(f"large{i}", kind, shape, k, s, p, d, ceil, include, divisor)
        assert ".local" not in jit.compile_module(code.source, program_name=f"large{i}.cu").ptx


def test_the_benchmark_shapes_read_each_row_once_with_loads_in_flight_together():
    # op_avgpool_same: 4x4 outputs per thread, six input rows (each one 16-byte load and two shuffles);
    # op_maxpool_overlap: four outputs, three rows of two 16-byte loads and one shuffle. No local memory,
    # and every 16-byte load of an iteration in one basic block, ahead of the first shuffle.
    avg = pooling_kernel("avgpool_same", "avg", (128, 128, 128, 128), (3, 3), (1, 1), (1, 1), count_include_pad=False)
    mx = pooling_kernel("maxpool_overlap", "max", (128, 192, 112, 112), (3, 3), (2, 2), (1, 1))
    assert "4x4 outputs per thread, 1 16-byte load(s) per input row, 2 halo" in avg.description
    assert "1x4 outputs per thread, 2 16-byte load(s) per input row, 1 halo" in mx.description
    for code, wide_loads in ((avg, 6), (mx, 6)):
        ptx = jit.compile_module(code.source, program_name=f"{code.name}.cu").ptx
        assert ".local" not in ptx
        blocks = re.split(r"\n\$L__\w+:", ptx)
        wide = [b for b in blocks if "ld.global.nc.v4.f32" in b]
        assert any(b.count("ld.global.nc.v4.f32") >= wide_loads and b.index("ld.global.nc.v4.f32") <
                   (b.index("shfl") if "shfl" in b else len(b)) for b in wide), code.name


# ---- the Planner and the lowering ----------------------------------------------------------------


class Pools(nn.Module):
    def forward(self, x):
        a = F.avg_pool2d(x, 3, 1, 1, count_include_pad=False)
        b = F.max_pool2d(x, 3, 2, 1)
        c, idx = F.max_pool2d(x, 2, return_indices=True)
        d = F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, divisor_override=5)
        e = F.max_pool2d(x, 3, 1, 1, dilation=2)
        f = F.avg_pool2d(x, 9, 1, 4)  # 81 taps
        g = F.avg_pool3d(x.unsqueeze(1), 2)
        return a, b, c, idx, d, e, f, g


def planned(model, *inputs):
    graph = capture(model.eval(), inputs)
    return graph, OfflinePlanner().plan(graph)


def test_the_planner_makes_pools_template_groups_and_says_why_not_for_the_rest():
    graph, plan = planned(Pools(), torch.randn(2, 3, 12, 12))
    groups = [g for g in plan.groups if g.kind not in ("view", "constant")]
    by_op = [(g.kind, g.nodes[0].op.removeprefix("aten::"), g.reason) for g in groups]
    pools = [(op, why) for kind, op, why in by_op if kind == "pool"]
    assert [op for op, _ in pools] == ["avg_pool2d", "max_pool2d_with_indices", "avg_pool2d",
                                       "max_pool2d_with_indices"], by_op
    assert all("template kernel" in why for _, why in pools)
    aten = {op: why for kind, op, why in by_op if kind == "aten"}
    indices = [why for kind, op, why in by_op if kind == "aten" and op == "max_pool2d_with_indices"]
    assert indices == ["max pooling whose indices are used stays an ATen step (the template computes the values "
                       "only)"]
    assert "81 taps" not in aten["avg_pool2d"] and "up to 64 taps" in aten["avg_pool2d"]
    assert "avg_pool3d" in aten and "no template" in aten["avg_pool3d"]
    d = next(g for g in groups if g.kind == "pool" and g.params["divisor_override"] == 5)
    assert d.params["ceil_mode"] and d.params["stride"] == (2, 2) and d.params["count_include_pad"]
    e = next(g for g in groups if g.kind == "pool" and g.params["dilation"] == (2, 2))
    assert e.params["pool"] == "max" and e.params["padding"] == (1, 1)


def test_other_dtypes_and_used_indices_stay_on_aten():
    graph, plan = planned(nn.MaxPool2d(2), torch.randn(1, 2, 8, 8, dtype=torch.float64))
    (g,) = [g for g in plan.groups if g.kind != "view"]
    assert g.kind == "aten" and "torch.float64 pooling" in g.reason

    class Unpool(nn.Module):
        def forward(self, x):
            y, i = F.max_pool2d(x, 2, return_indices=True)
            return F.max_unpool2d(y, i, 2)

    graph, plan = planned(Unpool(), torch.randn(1, 2, 8, 8))
    assert not [g for g in plan.groups if g.kind == "pool"]


class PoolBlock(nn.Module):
    """A max pool whose indices nothing reads, then a per-channel scale and ReLU; an average pool after."""

    def __init__(self, c=4):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(c, 1, 1))

    def forward(self, x):
        y = torch.relu(F.max_pool2d(x, 3, 2, 1) * self.scale + 0.5)
        return F.avg_pool2d(y, 2, 2, ceil_mode=True, count_include_pad=False)


def test_the_lowered_program_has_no_indices_buffer_and_the_epilogue_before_the_store(emu):
    model, x = PoolBlock().eval(), torch.randn(2, 4, 15, 16)
    graph, plan = planned(model, x)
    kinds = [(g.kind, [n.op.removeprefix("aten::") for n in g.nodes]) for g in plan.groups if g.kind != "constant"]
    assert kinds == [("pool", ["max_pool2d_with_indices", "mul.Tensor", "add.Tensor", "relu"]),
                     ("pool", ["avg_pool2d"])], kinds
    values = reference_values(graph, [x])
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    lowering = Lowering(graph, plan, constants)
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    program.validate()
    assert [s["kind"] for s in program.steps] == ["kernel", "kernel"]
    assert all(b["dtype"] != "i64" for b in program.buffers)  # no buffer for the unused indices
    assert len(lowering.kernels) == 2
    for _, code in lowering.kernels:
        jit.compile(code.source, code.name)
    if unavailable() is not None:
        return
    # The generated kernels, bound as the lowering binds them, give the model's values.
    (g1, first), (g2, second) = lowering.kernels
    mid = torch.full(tuple(g1.params["result"].shape), float("nan"))
    scale = model.scale.detach().reshape(-1)
    _launch_all(emu, [first], [{"x": x, "o0": scale, "y": mid}])
    torch.testing.assert_close(mid, torch.relu(F.max_pool2d(x, 3, 2, 1) * model.scale + 0.5), atol=1e-6, rtol=1e-6)
    out = torch.full(tuple(graph.outputs[0].shape), float("nan"))
    _launch_all(emu, [second], [{"x": mid, "y": out}])
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), atol=1e-6, rtol=1e-6)


class ConvPoolConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        return self.b(F.max_pool2d(torch.relu(self.a(x)), 2))


def test_a_channels_last_input_is_pooled_where_it_lies(stitch_settings, monkeypatch):
    # Between two convolutions of a channels-last plan the pool reads NHWC and writes NHWC (the
    # channels-last template: four channels per thread); kept NCHW, the NCHW template runs.
    stitch_settings(STITCHCUDA_CHANNELS_LAST="on")  # planned whatever this process's TF32 flags
    from stitchcuda.graph import reference_values

    x = torch.randn(2, 16, 64, 64)
    graph, plan = planned(ConvPoolConv(), x)
    (pool,) = [g for g in plan.groups if g.kind == "pool"]
    assert plan.channels_last
    values = reference_values(graph, [x])  # the first convolution's bias, viewed for the kernel after it
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    nhwc = Lowering(graph, plan, constants)
    nhwc.build(plan.groups, graph.inputs, graph.outputs).validate()
    assert not nhwc.on_aten
    (code,) = [code for g, code in nhwc.kernels if g is pool]
    assert "pool_nhwc" in code.name and "four channels per thread" in code.description
    assert is_channels_last(*nhwc.spec[nhwc.buf[pool.nodes[-1].out.name]][:2])
    plan.channels_last = frozenset()
    nchw = Lowering(graph, plan, constants)
    nchw.build(plan.groups, graph.inputs, graph.outputs).validate()
    assert [g for g, _ in nchw.kernels if g is pool] and not nchw.on_aten


# ---- on a GPU ---------------------------------------------------------------------------------------


def _kernelbench(stem: str, **sizes):
    spec = importlib.util.spec_from_file_location(f"kb_{stem}", KERNELBENCH / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, value in sizes.items():
        setattr(module, name, value)
    return module


@pytest.mark.gpu
@pytest.mark.parametrize("stem", ["op_avgpool_same", "op_maxpool_overlap"])
def test_the_kernelbench_pooling_problems_run_as_the_template_and_match_eager(stem):
    import stitchcuda

    problem = _kernelbench(stem, BATCH=4, CHANNELS=16, SIZE=40)
    model = problem.Model(*problem.get_init_inputs()).cuda().eval()
    inputs = [t.cuda() for t in problem.get_inputs()]
    fast = stitchcuda.optimize(model, inputs, compare_compile=False, keep_slower=True)
    assert fast.report.status == "optimized", str(fast.report)
    assert not fast.report.fallbacks, fast.report.fallbacks
    (pool,) = [g for g in fast.report.groups if g["kind"] == "pool"]
    assert pool["kernel"].startswith(("avgpool", "maxpool")) and "16-byte" in pool["strategy"]
    for seed in range(3):  # fresh inputs; NaN and infinities where the max pool must keep them
        torch.manual_seed(seed)
        x = torch.randn_like(inputs[0])
        if stem == "op_maxpool_overlap":
            x.view(-1)[::97] = float("nan")
            x.view(-1)[5::89] = float("-inf")
        with torch.no_grad():
            torch.testing.assert_close(fast(x), model(x), atol=1e-6, rtol=1e-6, equal_nan=True)
