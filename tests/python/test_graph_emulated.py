"""The template Coder's kernels give PyTorch's answers: each generated kernel is run on the CPU through
the corpus's CUDA emulator (tests/corpus/cpu_emulator: warp shuffles, __syncthreads, shared memory) and
compared with torch — warp-per-row and block-per-row reductions, broadcast and vectorized pointwise code.
Whole lowered programs run too (run_program: kernel steps emulated, ATen steps by torch, views as
aliases), so the planner's groups and the lowering's buffers and launches are checked together. The GPU
tests run the same kernels for real; these catch indexing, combine and wiring bugs on any machine.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, EmulatedModule, unavailable  # noqa: E402

from stitchcuda import jit  # noqa: E402
from stitchcuda.graph.templates import (PointwiseInput, RowPrologue, column_reduction_kernel,  # noqa: E402
                                        RowProduct, depthwise_conv_kernel, nchw_to_nhwc_kernel,
                                        normalized_rows_kernel, pointwise_kernel, row_reduction_kernel, split_rows)

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")


def _fp32_only(source: str) -> str:
    """The emulator has no fp16/bf16 types: drop their includes and overloads (fp32 kernels do not use them)."""
    return "\n".join(l for l in source.splitlines()
                     if not re.search(r"__half|__nv_bfloat16|#include <cuda_", l))


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("emulated"))


def _run(emu, code, tensors: dict):
    """Builds the kernel for the emulator and launches it with the geometry the template chose."""
    kernel = EmulatedModule(emu, _fp32_only(code.source)).kernel(code.name)
    args = [tensors[key] if kind in ("in", "out") else key for kind, key in code.args]
    kernel(code.grid, code.block, *args, shared_mem=code.shared_mem)


@pytest.mark.parametrize("rows, cols", [(6, 16), (3, 100), (2, 3001), (2, 5002), (2, 3000), (3, 5000), (11, 1024),
                                        (3, 260)],
                         ids=["warp-short", "warp-long", "block-256", "block-512", "registers-full", "registers-partial",
                              "registers-warp", "registers-warp-partial"])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "layer_norm", "sum", "mean", "amax", "amin"])
def test_row_reductions_match_torch(emu, kind, rows, cols):
    torch.manual_seed(rows * cols)
    x = torch.randn(rows, cols) * 3 + 1
    w, b = torch.randn(cols), torch.randn(cols)
    ln = kind == "layer_norm"
    code = row_reduction_kernel(f"r_{kind}", kind, rows, cols, torch.float32, eps=1e-5, has_weight=ln, has_bias=ln)
    expected = {"softmax": lambda: torch.softmax(x, -1), "log_softmax": lambda: torch.log_softmax(x, -1),
                "layer_norm": lambda: torch.nn.functional.layer_norm(x, (cols,), w, b, 1e-5),
                "sum": lambda: x.sum(-1), "mean": lambda: x.mean(-1), "amax": lambda: x.amax(-1),
                "amin": lambda: x.amin(-1)}[kind]()
    y = torch.full_like(expected, float("nan"))
    _run(emu, code, {"x": x, "weight": w, "bias": b, "y": y})
    torch.testing.assert_close(y, expected, atol=1e-4 * (cols ** 0.5 if kind == "sum" else 1), rtol=1e-4)


def test_softmax_of_a_row_of_minus_infinity_is_nan_as_in_torch(emu):
    x = torch.randn(4, 64)
    x[1] = float("-inf")
    code = row_reduction_kernel("r_inf", "softmax", 4, 64, torch.float32)
    y = torch.zeros(4, 64)
    _run(emu, code, {"x": x, "y": y})
    torch.testing.assert_close(y, torch.softmax(x, -1), equal_nan=True)


@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "layer_norm"])
def test_rows_held_in_registers_take_scalar_loads_when_misaligned(emu, kind):
    rows, cols = 3, 2048
    code = row_reduction_kernel(f"r_{kind}_odd", kind, rows, cols, torch.float32, has_weight=True, has_bias=True)
    assert "row held in registers" in code.description and code.block == 128
    storage = torch.randn(rows * cols + 1)
    x = storage[1:].view(rows, cols)  # 4 bytes past a 16-byte boundary
    x[1, 7] = float("-inf") if kind != "layer_norm" else x[1, 7]
    w, b = torch.randn(cols), torch.randn(cols)
    expected = {"softmax": lambda: torch.softmax(x, -1), "log_softmax": lambda: torch.log_softmax(x, -1),
                "layer_norm": lambda: torch.nn.functional.layer_norm(x, (cols,), w, b, 1e-5)}[kind]()
    y = torch.full((rows * cols + 1,), float("nan"))[1:].view(rows, cols)
    _run(emu, code, {"x": x, "weight": w, "bias": b, "y": y})
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_a_row_of_minus_infinity_held_in_registers_is_nan_as_in_torch(emu):
    x = torch.randn(3, 2048)
    x[2] = float("-inf")
    for kind, fn in (("softmax", torch.softmax), ("log_softmax", torch.log_softmax)):
        code = row_reduction_kernel(f"r_inf_{kind}", kind, 3, 2048, torch.float32)
        y = torch.zeros(3, 2048)
        _run(emu, code, {"x": x, "y": y})
        torch.testing.assert_close(y, fn(x, -1), equal_nan=True)


def _prologue_case(rows, cols):
    """x = (a + b) * scale - shift[row]: a full-shape tensor, a row vector, a scalar and a per-row value."""
    a, b = torch.randn(rows, cols), torch.randn(cols)
    scale, shift = torch.tensor([1.5]), torch.randn(rows, 1)
    inputs = [PointwiseInput("in0", torch.float32, (cols, 1)), PointwiseInput("in1", torch.float32, (0, 1)),
              PointwiseInput("in2", torch.float32, (0, 0)), PointwiseInput("in3", torch.float32, (1, 0))]
    body = ["const float t0 = (in0 + in1);", "const float t1 = (t0 * in2);", "const float t2 = (t1 - in3);"]
    prologue = RowPrologue((rows, cols), inputs, body, "t2")
    tensors = {"in0": a, "in1": b, "in2": scale, "in3": shift}
    return prologue, tensors, (a + b) * scale - shift


@pytest.mark.parametrize("rows, cols", [(5, 40), (2, 3001), (3, 2048)], ids=["warp", "block", "registers"])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "layer_norm", "sum", "amax"])
def test_elementwise_prologue_is_computed_on_load(emu, kind, rows, cols):
    torch.manual_seed(cols)
    prologue, tensors, x = _prologue_case(rows, cols)
    w, b = torch.randn(cols), torch.randn(cols)
    ln = kind == "layer_norm"
    code = row_reduction_kernel(f"p_{kind}", kind, rows, cols, torch.float32, has_weight=ln, has_bias=ln,
                                prologue=prologue)
    assert [k for _, k in code.args[:4]] == ["in0", "in1", "in2", "in3"] and "x" not in [k for _, k in code.args]
    expected = {"softmax": lambda: torch.softmax(x, -1), "log_softmax": lambda: torch.log_softmax(x, -1),
                "layer_norm": lambda: torch.nn.functional.layer_norm(x, (cols,), w, b, 1e-5),
                "sum": lambda: x.sum(-1), "amax": lambda: x.amax(-1)}[kind]()
    y = torch.full_like(expected, float("nan"))
    _run(emu, code, {**tensors, "weight": w, "bias": b, "y": y})
    torch.testing.assert_close(y, expected, atol=1e-4 * (cols ** 0.5 if kind == "sum" else 1), rtol=1e-4)


def test_a_prologue_of_row_and_column_operands_loads_16_bytes_at_a_time(emu):
    rows, cols = 3, 2048
    a, r, bias = torch.randn(rows, cols), torch.randn(rows, cols), torch.randn(cols)
    inputs = [PointwiseInput("in0", torch.float32, (cols, 1)), PointwiseInput("in1", torch.float32, (cols, 1)),
              PointwiseInput("in2", torch.float32, (0, 1))]
    prologue = RowPrologue((rows, cols), inputs, ["const float t0 = ((in0 + in1) + in2);"], "t0")
    assert prologue.vector_kinds(cols) == ["row", "row", "col"]
    assert _prologue_case(rows, cols)[0].vector_kinds(cols) == ["row", "col", "scalar", "per_row"]
    code = row_reduction_kernel("p_ln", "layer_norm", rows, cols, torch.float32, prologue=prologue)
    assert "(16-byte)" in code.description and "load4(p_in0 + row * COLS" in code.source
    y = torch.empty(rows, cols)
    _run(emu, code, {"in0": a, "in1": r, "in2": bias, "y": y})
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(a + r + bias, (cols,)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cols", [128, 2048], ids=["warp", "block"])
def test_a_masked_scaled_softmax_reads_its_broadcast_operands_per_row(emu, cols):
    # Causal attention written out: scores [B, H, S, cols] * scale, a bool mask [S, cols] and a relative
    # bias [S, cols] repeated over batch and heads (a base per row, then unit stride), a per-head shift.
    torch.manual_seed(cols)
    b, h, s = 2, 3, 8
    scores, rel, head = torch.randn(b, h, s, cols), torch.randn(s, cols), torch.randn(h, 1, 1)
    mask = torch.triu(torch.ones(s, cols, dtype=torch.bool), diagonal=1)
    shape = (b, h, s, cols)
    inputs = [PointwiseInput("in0", torch.float32, (h * s * cols, s * cols, cols, 1)),
              PointwiseInput("in1", torch.bool, (0, 0, cols, 1)), PointwiseInput("in2", torch.float32, (0, 0, cols, 1)),
              PointwiseInput("in3", torch.float32, (0, 1, 0, 0))]
    body = ["const float t0 = in0 * 0.125f + in2 + in3;",
            "const float t1 = in1 != 0.0f ? -__int_as_float(0x7f800000) : t0;"]
    prologue = RowPrologue(shape, inputs, body, "t1")
    assert prologue.vector_kinds(cols) == ["row", "based1", "based4", "per_row"]
    code = row_reduction_kernel("masked", "softmax", b * h * s, cols, torch.float32, prologue=prologue)
    assert "(16-byte)" in code.description and "load4(p_in2 + b_in2, c4, vec)" in code.source
    y = torch.full(shape, float("nan"))
    _run(emu, code, {"in0": scores, "in1": mask, "in2": rel, "in3": head.reshape(h), "y": y})
    want = torch.softmax((scores * 0.125 + rel + head).masked_fill(mask, float("-inf")), -1)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, cols, path, reused", [(6, 48, "warp per row", 0), (2, 3002, "warp shuffles", 0),
                                                      (3, 4096, "held in registers", 1), (5, 520, "held in registers", 1),
                                                      (2, 20000, "held in registers", 0),
                                                      (2, 40000, "held in shared memory", 0)],
                         ids=["warp", "block", "registers", "registers-warp-partial", "registers-too-many-to-keep",
                              "shared"])
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
def test_rms_norm_epilogue_applies_the_statistic_to_the_row(emu, rows, cols, path, reused, misaligned):
    # mean(x * x) with the square as a prologue; then x * rsqrt(stat + eps) * w over the row, whose x comes
    # from the registers where the row is held there in at most four float4 per thread (`reused`).
    x, w = torch.randn(rows, cols) * 2, torch.randn(cols)
    if misaligned:  # rows at an odd float offset: scalar loads into the same registers
        x = torch.randn(rows * cols + 1)[1:].view(rows, cols)
    row = (cols, 1)
    prologue = RowPrologue((rows, cols), [PointwiseInput("in0", torch.float32, row)], ["const float t0 = (in0 * in0);"], "t0")
    epilogue = RowPrologue((rows, cols), [PointwiseInput("e0", torch.float32, row), PointwiseInput("e1", torch.float32, (0, 1))],
                           ["const float t0 = (stat + 1e-06f);", "const float t1 = rsqrtf(t0);",
                            "const float t2 = (e0 * t1);", "const float t3 = (t2 * e1);"], "t3", ("stat",))
    code = row_reduction_kernel("rms", "mean", rows, cols, torch.float32, prologue=prologue, epilogue=epilogue,
                                same_row={"e0": "in0"})
    assert [k for _, k in code.args] == ["in0", "e0", "e1", "y", rows, cols]
    assert path in code.description, code.description
    assert ("1 operand(s) from the registers" in code.description) == bool(reused), code.description
    y = torch.full((rows, cols), float("nan"))
    # The epilogue's own pointer to x is garbage where the registers serve it: a read of it would show.
    _run(emu, code, {"in0": x, "e0": torch.full_like(x, float("nan")) if reused else x, "e1": w, "y": y})
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_an_epilogue_reads_the_reduction_input_from_its_registers(emu):
    # x - mean(x) (centering) with no prologue: the epilogue's x is the row the reduction holds.
    rows, cols = 4, 1024
    x = torch.randn(rows, cols) + 3
    epilogue = RowPrologue((rows, cols), [PointwiseInput("e0", torch.float32, (cols, 1))], ["const float t0 = (e0 - stat);"],
                           "t0", ("stat",))
    code = row_reduction_kernel("center", "mean", rows, cols, torch.float32, epilogue=epilogue, same_row={"e0": "x"})
    assert "1 operand(s) from the registers" in code.description, code.description
    y = torch.full((rows, cols), float("nan"))
    _run(emu, code, {"x": x, "e0": torch.full_like(x, float("nan")), "y": y})
    torch.testing.assert_close(y, x - x.mean(-1, keepdim=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n, c, hw, groups, path", [(2, 6, 9, 3, "warp per row"), (2, 8, 1027, 8, "shared-memory combine"),
                                                     (2, 8, 1024, 4, "held in registers"), (2, 4, 1030, 2, "held in registers")],
                         ids=["warp", "block", "registers", "registers-channel-inside-a-vector"])
def test_group_norm_with_a_silu_applied_before_the_store(emu, n, c, hw, groups, path):
    # Rows are (sample, group) pairs; weight and bias are per channel; SiLU reads each result twice.
    x = torch.randn(n, c, hw) * 3 + 1
    w, b = torch.rand(c) + 0.5, torch.randn(c)
    cols = c // groups * hw
    output = RowPrologue((n, c, hw), [], ["const float t0 = (1.0f / (1.0f + expf(-yv)));", "const float t1 = (yv * t0);"],
                         "t1", ("yv",))
    code = row_reduction_kernel("gn", "group_norm", n * groups, cols, torch.float32, eps=1e-5, has_weight=True,
                                has_bias=True, output=output, groups=groups, group_hw=hw)
    assert path in code.description, code.description
    y = torch.full_like(x, float("nan"))
    _run(emu, code, {"x": x, "weight": w, "bias": b, "y": y})
    expected = torch.nn.functional.silu(torch.nn.functional.group_norm(x, groups, w, b, 1e-5))
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


class _LastPosition(torch.nn.Module):
    """A value read at given positions: y[:, idx] (index.Tensor with an absent leading index)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(16))

    def forward(self, x, idx):
        return torch.tanh(x * self.scale)[:, idx]


def test_indexing_with_an_absent_index_is_an_aten_step_that_runs(emu):
    torch.manual_seed(0)
    model, x, idx = _LastPosition().eval(), torch.randn(2, 8, 16), torch.tensor([7, 2])
    _, program, constants = _lowered(model, (x, idx))
    steps = [s for s in program.steps if s["kind"] == "aten" and s["op"] == "aten::index.Tensor"]
    assert steps and steps[0]["attributes"]["indices:present"] == [0, 1]
    (got,) = run_program(emu, program, [x, idx], constants)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x, idx), rtol=1e-5, atol=1e-5)


def test_an_output_function_reads_an_operand_by_index(emu):
    # softmax(x) * mask + r: a full-shape operand and a column vector, in the register path.
    rows, cols = 2, 2048
    x, r, mask = torch.randn(rows, cols), torch.randn(rows, cols), (torch.rand(cols) > 0.5).float()
    inputs = [PointwiseInput("o0", torch.float32, (0, 1)), PointwiseInput("o1", torch.float32, (cols, 1))]
    output = RowPrologue((rows, cols), inputs, ["const float t0 = ((yv * o0) + o1);"], "t0", ("yv",))
    code = row_reduction_kernel("sm", "softmax", rows, cols, torch.float32, output=output)
    assert "row held in registers" in code.description and [k for _, k in code.args][:3] == ["x", "o0", "o1"]
    y = torch.empty(rows, cols)
    _run(emu, code, {"x": x, "o0": mask, "o1": r, "y": y})
    torch.testing.assert_close(y, torch.softmax(x, -1) * mask + r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rows, cols", [(5, 40), (2, 3001)], ids=["warp", "block"])
def test_logsumexp_from_its_max_is_one_kernel_after_the_max(emu, rows, cols):
    # sum(exp(x - m[row])) with the shift and exp on load, then log(s) + m[row] applied to the stored sum.
    x = torch.randn(rows, cols) * 4
    m = x.amax(-1, keepdim=True)
    prologue = RowPrologue((rows, cols), [PointwiseInput("in0", torch.float32, (cols, 1)),
                                          PointwiseInput("in1", torch.float32, (1, 0))],
                           ["const float t0 = (in0 - in1);", "const float t1 = expf(t0);"], "t1")
    output = RowPrologue((rows, 1), [PointwiseInput("o0", torch.float32, (1, 0))],
                         ["const float t0 = logf(yv);", "const float t1 = (t0 + o0);"], "t1", ("yv",))
    code = row_reduction_kernel("lse", "sum", rows, cols, torch.float32, prologue=prologue, output=output)
    y = torch.full((rows, 1), float("nan"))
    _run(emu, code, {"in0": x, "in1": m, "o0": m, "y": y})
    torch.testing.assert_close(y, torch.logsumexp(x, -1, keepdim=True), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("outer, reduce, inner", [(3, 37, 70), (2, 5, 1), (1, 64, 32)])
@pytest.mark.parametrize("kind", ["sum", "mean", "amax", "amin"])
def test_column_reductions_match_torch(emu, kind, outer, reduce, inner):
    x = torch.randn(outer, reduce, inner) * 3
    x[0, reduce // 2, 0] = 50.0  # one extreme value in one column
    code = column_reduction_kernel(f"c_{kind}", kind, outer, reduce, inner, torch.float32)
    y = torch.full((outer, inner), float("nan"))
    _run(emu, code, {"x": x, "y": y})
    expected = {"sum": x.sum(1), "mean": x.mean(1), "amax": x.amax(1), "amin": x.amin(1)}[kind]
    torch.testing.assert_close(y, expected, atol=1e-4 * reduce ** 0.5, rtol=1e-4)


def test_column_reduction_with_a_relu_on_load(emu):
    x = torch.randn(2, 9, 4, 5)
    prologue = RowPrologue((2, 9, 4, 5), [PointwiseInput("in0", torch.float32, (180, 20, 5, 1))],
                           ["const float t0 = (in0 != in0 ? in0 : fmaxf(in0, 0.0f));"], "t0")
    code = column_reduction_kernel("c_relu", "sum", 2, 9, 20, torch.float32, prologue=prologue)
    y = torch.empty(2, 4, 5)
    _run(emu, code, {"in0": x, "y": y})
    torch.testing.assert_close(y, torch.relu(x).sum(1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="column reduction is sum, mean, amax, amin, argmax or argmin"):
        column_reduction_kernel("c_bad", "softmax", 2, 9, 20, torch.float32)


def test_an_epilogue_needs_a_statistic():
    epilogue = RowPrologue((2, 8), [], ["const float t0 = stat;"], "t0", ("stat",))
    with pytest.raises(ValueError, match="applies to sum/mean/amax/amin"):
        row_reduction_kernel("bad", "softmax", 2, 8, torch.float32, epilogue=epilogue)


def test_broadcast_pointwise_matches_torch(emu):
    a, bias = torch.randn(5, 7, 3), torch.randn(3)
    gate = torch.randn(5, 1, 3)
    shape = (5, 7, 3)
    inputs = [PointwiseInput("in0", torch.float32, (21, 3, 1)), PointwiseInput("in1", torch.float32, (0, 0, 1)),
              PointwiseInput("in2", torch.float32, (3, 0, 1))]
    body = ["const float t0 = (in0 + in1);",
            "const float t1 = (t0 * (1.0f / (1.0f + expf(-in2))));",
            "const float t2 = (t1 != t1 ? t1 : fmaxf(t1, 0.0f));"]
    code = pointwise_kernel("fused_bcast", shape, inputs, body, [("out0", "t2", torch.float32), ("out1", "t0", torch.float32)])
    assert not code.vectorized
    out0, out1 = torch.empty(shape), torch.empty(shape)
    _run(emu, code, {"in0": a, "in1": bias, "in2": gate, "out0": out0, "out1": out1})
    torch.testing.assert_close(out1, a + bias)
    torch.testing.assert_close(out0, torch.relu((a + bias) * torch.sigmoid(gate)))


@pytest.mark.parametrize("misaligned", [False, True], ids=["16-byte", "scalar-fallback"])
def test_grouped_broadcast_pointwise_matches_torch(emu, misaligned):
    # [N, C, H, W] with W a multiple of 4: a row-broadcast vector along W (one 16-byte load), a per-channel
    # parameter (broadcast along W: one value repeated), a transposed operand (four loads) and a view at an
    # odd offset (four loads). A misaligned output makes the same loop take scalar stores.
    torch.manual_seed(3)
    shape = (2, 3, 5, 8)
    x, w_row, chan = torch.randn(shape), torch.randn(8), torch.randn(3, 1, 1)
    t_storage = torch.randn(2, 3, 8, 5)
    t = t_storage.transpose(2, 3)
    flat = torch.randn(2 * 3 * 5 * 8 + 1)
    odd = flat[1:].view(shape)
    inputs = [PointwiseInput("in0", torch.float32, (120, 40, 8, 1)), PointwiseInput("in1", torch.float32, (0, 0, 0, 1)),
              PointwiseInput("in2", torch.float32, (0, 1, 0, 0)), PointwiseInput("in3", torch.float32, t.stride()),
              PointwiseInput("in4", torch.float32, (120, 40, 8, 1), offset=1)]
    body = ["const float t0 = (in0 + in1) * in2;", "const float t1 = t0 + in3 * in4;"]
    code = pointwise_kernel("fused_grouped", shape, inputs, body, [("out0", "t1", torch.float32)])
    assert "four outputs per thread" in code.description
    src = code.source
    assert "*reinterpret_cast<const float4*>(p0 + e0)" in src and "*reinterpret_cast<const float4*>(p1 + e1)" in src
    assert "make_float4(s2, s2, s2, s2)" in src
    assert "ld(p3, e3 + 5LL)" in src and "ld(p4, e4 + 1LL)" in src
    storage = torch.full((2 * 3 * 5 * 8 + 1,), float("nan"))
    out = storage[1:].view(shape) if misaligned else storage[:-1].view(shape)
    _run(emu, code, {"in0": x, "in1": w_row, "in2": chan.reshape(3), "in3": t_storage, "in4": flat, "out0": out})
    torch.testing.assert_close(out, (x + w_row) * chan + t * odd)


@pytest.mark.parametrize("rows, sm_count", [(64, 132), (1029, 1), (1024, 1)],
                         ids=["one-step", "two-deep-and-odd-tail", "two-deep-even"])
def test_vectorized_pointwise_matches_torch(stitch_settings, emu, rows, sm_count, monkeypatch):
    stitch_settings(STITCHCUDA_POINTWISE_LOOP="stride")
    # One SM's grid (16 blocks of 256 threads: 4,096 float4 per pass) over 1,029 rows of 32 runs the
    # two-deep loop and an odd last float4; 1,024 rows end on whole pairs; 64 rows take the single step.
    x = torch.randn(rows, 32)
    code = pointwise_kernel("fused_vec", (rows, 32), [PointwiseInput("in0", torch.float32, (32, 1))],
                            ["const float t0 = (in0 * 0.5f * (1.0f + erff(in0 * 0.7071067811865476f)));"],
                            [("out0", "t0", torch.float32)], sm_count=sm_count)
    assert code.vectorized and "v + stride < n4" in code.source and "two per thread" in code.description
    y = torch.full((rows, 32), float("nan"))
    _run(emu, code, {"in0": x, "out0": y})
    torch.testing.assert_close(y, torch.nn.functional.gelu(x))


@pytest.mark.parametrize("operands, per", [(1, 4), (3, 2), (5, 1)], ids=["four-per-thread", "two", "one"])
def test_a_one_pass_vectorized_pointwise_kernel_matches_torch(stitch_settings, emu, monkeypatch, operands, per):
    # The default (STITCHCUDA_POINTWISE_LOOP=once): a grid over the whole tensor, `per` float4 of each
    # operand per thread and no loop; 1,029 rows of 32 leave the last block partly idle (loads and stores guarded).
    stitch_settings(STITCHCUDA_POINTWISE_LOOP=None)
    rows = 1029
    xs = [torch.randn(rows, 32) for _ in range(operands)]
    inputs = [PointwiseInput(f"in{k}", torch.float32, (32, 1)) for k in range(operands)]
    body = ["float t0 = in0 * 0.5f;", *[f"t0 = t0 * 0.9f + in{k};" for k in range(1, operands)]]
    code = pointwise_kernel("fused_once", (rows, 32), inputs, body, [("out0", "t0", torch.float32)])
    assert code.vectorized and f"{per} per operand and thread in one pass" in code.description, code.description
    assert "stride" not in code.source and code.grid == -(-(rows * 8) // (256 * per))
    y = torch.full((rows, 32), float("nan"))
    _run(emu, code, {**{f"in{k}": x for k, x in enumerate(xs)}, "out0": y})
    want = xs[0] * 0.5
    for x in xs[1:]:
        want = want * 0.9 + x
    torch.testing.assert_close(y, want)


def test_the_pointwise_loop_setting_is_checked(stitch_settings, monkeypatch):
    stitch_settings(STITCHCUDA_POINTWISE_LOOP="unrolled")
    with pytest.raises(ValueError, match="STITCHCUDA_POINTWISE_LOOP must be one of once, stride, got 'unrolled'"):
        pointwise_kernel("f", (8, 4), [PointwiseInput("in0", torch.float32, (4, 1))], ["const float t0 = in0;"],
                         [("out0", "t0", torch.float32)])


def test_a_vectorized_pointwise_kernel_of_many_operands_keeps_one_float4_per_step(stitch_settings, emu, monkeypatch):
    stitch_settings(STITCHCUDA_POINTWISE_LOOP="stride")
    xs = [torch.randn(1029, 32) for _ in range(4)]
    inputs = [PointwiseInput(f"in{k}", torch.float32, (32, 1)) for k in range(4)]
    code = pointwise_kernel("fused_sum4", (1029, 32), inputs, ["const float t0 = (in0 + in1) * in2 - in3;"],
                            [("out0", "t0", torch.float32)], sm_count=1)
    assert code.vectorized and "v + stride < n4" not in code.source and "two per thread" not in code.description
    y = torch.full((1029, 32), float("nan"))
    _run(emu, code, {**{f"in{k}": x for k, x in enumerate(xs)}, "out0": y})
    torch.testing.assert_close(y, (xs[0] + xs[1]) * xs[2] - xs[3])


@pytest.mark.parametrize("kind", ["amax", "amin"])
@pytest.mark.parametrize("rows, cols", [(8, 40), (8, 3001), (8, 1024)], ids=["warp", "block", "registers"])
def test_amax_and_amin_propagate_nan_and_keep_infinities_as_torch(emu, kind, rows, cols):
    # NaN first, in the middle, last, beside an infinity of each sign; rows of infinities alone.
    x = torch.randn(rows, cols)
    x[0, 0] = x[1, cols // 2] = x[2, cols - 1] = float("nan")
    x[3, 1], x[3, 2] = float("inf"), float("nan")
    x[4, 1], x[4, 2] = float("nan"), float("-inf")
    x[5, :] = float("-inf")
    x[6, :] = float("inf")
    x[7, 3] = float("inf") if kind == "amax" else float("-inf")
    code = row_reduction_kernel(f"n_{kind}", kind, rows, cols, torch.float32)
    y = torch.zeros(rows)
    _run(emu, code, {"x": x, "y": y})
    torch.testing.assert_close(y, getattr(x, kind)(-1), equal_nan=True, atol=0, rtol=0)
    column = column_reduction_kernel(f"nc_{kind}", kind, 1, rows, cols, torch.float32)
    yc = torch.zeros(1, cols)
    _run(emu, column, {"x": x.unsqueeze(0), "y": yc})
    torch.testing.assert_close(yc, getattr(x, kind)(0, keepdim=True), equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("size, kernel, stride, padding, dilation, per_thread", [
    ((9, 12), (3, 3), (1, 1), (1, 1), (1, 1), 4),    # the usual same-size 3x3, 12 wide
    ((10, 13), (3, 3), (2, 2), (1, 1), (1, 1), 1),   # strided, an odd output width (7)
    ((8, 15), (5, 3), (1, 2), (2, 0), (1, 2), 2),    # rectangular, dilated, no padding along W (6 wide)
    ((7, 20), (5, 5), (1, 1), (2, 2), (1, 1), 4),    # 5x5 "same": two halo values from each neighbour
], ids=["3x3", "strided", "dilated", "5x5"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_depthwise_conv_matches_torch(emu, size, kernel, stride, padding, dilation, per_thread, bias):
    torch.manual_seed(size[0] * 7 + kernel[0])
    n, c = 2, 3
    x = torch.randn(n, c, *size)
    w, b = torch.randn(c, 1, *kernel), torch.randn(c)
    expected = torch.nn.functional.conv2d(x, w, b if bias else None, stride, padding, dilation, groups=c)
    code = depthwise_conv_kernel("dw", (n, c, *size), kernel, stride, padding, dilation, torch.float32,
                                 has_bias=bias)
    assert f"{per_thread} outputs per thread" in code.description
    # Stride 1, same width: the 16-byte load and neighbours' halo (at 12 and 20 wide, lanes 0 and 31 of
    # a warp fall inside rows and load their halo themselves); it falls back to the segment loop when a
    # pointer is not 16-byte aligned.
    assert ("halo from neighbouring lanes" in code.description) == (stride == (1, 1) and dilation == (1, 1))
    for misaligned in (False, True):
        storage = torch.full((expected.numel() + 1,), float("nan"))
        y = (storage[1:] if misaligned else storage[:-1]).view(expected.shape)
        _run(emu, code, {"x": x, "weight": w, "bias": b, "y": y})
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_depthwise_conv_applies_its_output_function(emu):
    # The convolution's result goes through a per-channel scale and SiLU before the store.
    torch.manual_seed(5)
    x, w, scale = torch.randn(2, 4, 6, 8), torch.randn(4, 1, 3, 3), torch.randn(4)
    output = RowPrologue((2, 4, 6, 8), [PointwiseInput("o0", torch.float32, (0, 1, 0, 0))],
                         ["const float t0 = yv * o0;", "const float t1 = t0 / (1.0f + expf(-t0));"], "t1", ("yv",))
    code = depthwise_conv_kernel("dw_silu", (2, 4, 6, 8), (3, 3), (1, 1), (1, 1), (1, 1), torch.float32, output=output)
    conv = torch.nn.functional.conv2d(x, w, None, 1, 1, groups=4) * scale.view(1, 4, 1, 1)
    for misaligned in (False, True):  # the shuffled 16-byte path, then the segment loop
        storage = torch.full((2 * 4 * 6 * 8 + 1,), float("nan"))
        y = (storage[1:] if misaligned else storage[:-1]).view(2, 4, 6, 8)
        _run(emu, code, {"x": x, "weight": w, "o0": scale, "y": y})
        torch.testing.assert_close(y, torch.nn.functional.silu(conv), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="has no template"):
        depthwise_conv_kernel("dw_big", (1, 1, 16, 16), (9, 9), (1, 1), (4, 4), (1, 1), torch.float32)


@pytest.mark.parametrize("rows, cols", [(5, 100), (3, 3000), (4, 512)], ids=["warp", "registers", "warp-registers"])
def test_sum_exp_is_a_log_sum_exp_in_one_pass(emu, rows, cols):
    # The output function reads the sum (yv) and the row's max (mx): log(yv) + mx is the log-sum-exp.
    torch.manual_seed(cols)
    x = torch.randn(rows, cols) * 20  # wide range: exp(x) alone would overflow fp32
    x[0, 7] = 1000.0
    x[1] = float("-inf")  # torch.logsumexp's -inf (the two-pass form written out would give NaN)
    output = RowPrologue((rows, 1), [], ["const float t0 = logf(yv);", "const float t1 = (mx + t0);"], "t1",
                         ("yv", "mx"))
    code = row_reduction_kernel("lse", "sum_exp", rows, cols, torch.float32, output=output)
    assert ("held in registers" in code.description) == (cols % 4 == 0 and cols >= 128)
    y = torch.full((rows,), float("nan"))
    _run(emu, code, {"x": x, "y": y})
    torch.testing.assert_close(y, torch.logsumexp(x, -1), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match=r"reads \('yv', 'mx'\)"):
        row_reduction_kernel("lse_bad", "sum_exp", rows, cols, torch.float32,
                             output=RowPrologue((rows, 1), [], ["const float t0 = logf(yv);"], "t0", ("yv",)))


@pytest.mark.parametrize("kind", ["sum", "mean", "amax"])
def test_a_split_row_reduces_in_two_passes_like_torch(emu, kind):
    # The lowering's two passes for a few very long rows: chunks of the row as rows of a (rows * split,
    # cols / split) view into an fp32 scratch row, then the chunks' results.
    rows, cols = 2, 1 << 18
    split = split_rows(rows, cols)
    assert split == 16
    torch.manual_seed(7)
    x = torch.randn(rows, cols) + 0.5
    partial, y = torch.full((rows, split), float("nan")), torch.full((rows,), float("nan"))
    _run(emu, row_reduction_kernel("chunks", kind, rows * split, cols // split, torch.float32), {"x": x, "y": partial})
    _run(emu, row_reduction_kernel("final", kind, rows, split, torch.float32), {"x": partial, "y": y})
    expected = {"sum": x.double().sum(-1), "mean": x.double().mean(-1), "amax": x.double().amax(-1)}[kind]
    torch.testing.assert_close(y.double(), expected, atol=1e-5 * (cols if kind == "sum" else 1) ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["log_softmax", "softmax", "layer_norm", "sum"])
def test_rows_beyond_the_registers_are_held_in_shared_memory(emu, kind):
    rows, cols = 2, 40000  # 10,000 float4: ten per thread of a 1,024-thread block
    torch.manual_seed(3)
    x = torch.randn(rows, cols) * 2
    code = row_reduction_kernel(f"s_{kind}", kind, rows, cols, torch.float32)
    assert "shared memory" in code.description and code.shared_mem == 16 * (cols // 4)
    expected = {"softmax": lambda: torch.softmax(x, -1), "log_softmax": lambda: torch.log_softmax(x, -1),
                "layer_norm": lambda: torch.nn.functional.layer_norm(x, (cols,)), "sum": lambda: x.sum(-1)}[kind]()
    y = torch.full_like(expected, float("nan"))
    _run(emu, code, {"x": x, "y": y})
    torch.testing.assert_close(y, expected, atol=1e-4 * (cols ** 0.5 if kind == "sum" else 1), rtol=1e-4)


@pytest.mark.parametrize("shape", [(2, 16, 8, 8), (3, 45, 7, 9), (1, 64, 32, 32), (2, 3, 5, 70)],
                         ids=["one-tile", "ragged", "square", "rgb"])
def test_the_nhwc_conversion_is_a_transpose_of_each_image(emu, shape):
    x = torch.randn(shape)
    y = torch.full((x.numel(),), float("nan"))
    _run(emu, nchw_to_nhwc_kernel("to_nhwc", shape, torch.float32), {"in0": x, "out0": y})
    assert torch.equal(y, x.permute(0, 2, 3, 1).contiguous().flatten())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.bool])
def test_the_nhwc_conversion_compiles_for_every_fusable_dtype(dtype):
    code = nchw_to_nhwc_kernel("to_nhwc", (2, 40, 9, 9), dtype)
    jit.compile(code.source, code.name)


@pytest.mark.parametrize("rows, cols", [(3, 4096), (5, 512), (2, 16384)], ids=["block", "warp", "two-inputs-full"])
def test_a_statistic_of_log_softmax_rows_normalizes_them_in_registers(emu, rows, cols):
    # KL(t || s) per row from the logits: exp(lt) * (lt - ls) summed, ls and lt never stored.
    torch.manual_seed(cols)
    s, t = torch.randn(rows, cols) * 2, torch.randn(rows, cols) * 2
    body = ["const float t0 = nrm1 - nrm0;", "const float t1 = expf(nrm1);", "const float t2 = t1 * t0;"]
    kl = RowProduct("sum", RowPrologue((rows, cols), [], body, "t2", ("nrm0", "nrm1")))
    code = normalized_rows_kernel("kl", rows, cols, ["log_softmax", "log_softmax"], [kl])
    y = torch.full((rows,), float("nan"))
    _run(emu, code, {"x0": s, "x1": t, "y0": y})
    ls, lt = torch.log_softmax(s.double(), -1), torch.log_softmax(t.double(), -1)
    torch.testing.assert_close(y.double(), (lt.exp() * (lt - ls)).sum(-1), atol=1e-4, rtol=1e-4)


def test_a_cross_entropy_picks_and_sums_log_probabilities_from_registers(emu):
    # The picked log-probability (a gather, NaN for an index out of range) and the row's sum of
    # log-probabilities (label smoothing's term), both from one read of the logits.
    rows, cols = 6, 2048
    torch.manual_seed(2)
    x = torch.randn(rows, cols) * 3
    index = torch.tensor([0, 5, cols - 1, 17, cols, -1])
    products = [RowProduct("gather", source=0, index="g0"),
                RowProduct("sum", RowPrologue((rows, cols), [], [], "nrm0", ("nrm0",)))]
    code = normalized_rows_kernel("ce", rows, cols, ["log_softmax"], products)
    picked, total = torch.full((rows, 1), 7.0), torch.full((rows,), float("nan"))
    _run(emu, code, {"x0": x, "g0": index, "y0": picked, "y1": total})
    ls = torch.log_softmax(x, -1)
    torch.testing.assert_close(picked[:4, 0], ls[torch.arange(4), index[:4]], atol=1e-5, rtol=1e-6)
    assert picked[4:].isnan().all()
    torch.testing.assert_close(total, ls.sum(-1), atol=1e-3, rtol=1e-5)


def test_softmax_rows_with_an_operand_and_an_output_function(emu):
    # max over the row of softmax(x) * w (w a per-column weight), then the output function 2 * value.
    rows, cols = 4, 1024
    torch.manual_seed(1)
    x, w = torch.randn(rows, cols), torch.rand(cols)
    prologue = RowPrologue((rows, cols), [PointwiseInput("in0", torch.float32, (0, 1))], ["const float t0 = nrm0 * in0;"],
                           "t0", ("nrm0",))
    output = RowPrologue((rows,), [], ["const float t1 = yv * 2.0f;"], "t1", ("yv",))
    code = normalized_rows_kernel("sm", rows, cols, ["softmax"], [RowProduct("amax", prologue, output)])
    y = torch.full((rows,), float("nan"))
    _run(emu, code, {"x0": x, "in0": w, "y0": y})
    torch.testing.assert_close(y, (torch.softmax(x, -1) * w).amax(-1) * 2, atol=1e-6, rtol=1e-5)


# ---- whole programs: the lowering's steps run in order, kernels in the emulator, ATen steps by torch ----

_PROGRAM_DTYPES = {"f32": torch.float32, "i64": torch.int64, "bool": torch.bool, "i32": torch.int32}


def _optional_lists(op, given: list, attributes: dict) -> list:
    """The step's inputs with each Tensor?[] argument (index.Tensor's indices) made one list, as the executor
    binds it: its entries the next inputs, None where "<name>:present" marks one absent."""
    args = op._schema.arguments
    if not any(str(a.type) == "List[Optional[Tensor]]" for a in args):
        return given
    out, k = [], 0
    for i, arg in enumerate(args):
        t = str(arg.type)
        if t == "List[Optional[Tensor]]":
            later = sum(str(a.type) == "Tensor" for a in args[i + 1:])
            flags = attributes.get(f"{arg.name}:present", [1] * (len(given) - k - later))
            entries = []
            for f in flags:
                entries.append(given[k] if f else None)
                k += bool(f)
            out.append(entries)
        elif "Tensor" in t and k < len(given):
            out.append(given[k])
            k += 1
    return out + given[k:]


def run_program(emu, program, inputs: list[torch.Tensor], constants: dict[str, torch.Tensor],
                states: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The program's outputs on the CPU: buffers allocated as it declares them (NaN-filled where floating,
    so a value no step writes shows), views as strided aliases, kernel steps through the emulator, ATen
    steps through torch.ops with the step's attributes. `states`: the tensors its states live in, by
    name (updated in place, as an executor updates the tensors shared with it)."""
    buffers: dict[int, torch.Tensor] = {}
    named_inputs = iter(inputs)
    for b in program.buffers:
        dtype = _PROGRAM_DTYPES[b["dtype"]]
        if b["role"] == "input":
            buffers[b["id"]] = next(named_inputs)
        elif b["role"] == "state":
            buffers[b["id"]] = states[b["name"]]
        elif b["role"] == "weight":  # laid out as the program stores it (a channels-last filter: NHWC)
            buffers[b["id"]] = torch.empty_strided(b["shape"], b["strides"], dtype=dtype).copy_(constants[b["name"]])
        else:
            t = torch.empty_strided(b["shape"], b["strides"], dtype=dtype)
            buffers[b["id"]] = t.fill_(float("nan")) if dtype.is_floating_point else t.zero_()
    kernels = program.kernels
    for step in program.steps:
        if step["kind"] == "view":
            src, spec = buffers[step["source"]], program.buffers[step["result"]]
            buffers[step["result"]] = src.as_strided(spec["shape"], spec["strides"],
                                                     src.storage_offset() + step["storage_offset"])
        elif step["kind"] == "kernel":
            k = kernels[step["kernel"]]
            kernel = EmulatedModule(emu, _fp32_only(k["source"])).kernel(k["name"])
            args = [_memory_order(buffers[v]) if kind in ("in", "out") else v for kind, v in step["args"]]
            kernel(step["grid"], step["block"], *args, shared_mem=step["shared_mem"])
        elif step["kind"] == "aten":
            name, _, overload = step["op"].removeprefix("aten::").partition(".")
            op = getattr(getattr(torch.ops.aten, name), overload or "default")
            attributes = {k: _PROGRAM_DTYPES.get(v, v) if k == "dtype" else v
                          for k, v in step["attributes"].items() if not k.endswith(":present")}
            given = [buffers[i] for i in step["inputs"]]
            given = _optional_lists(op, given, step["attributes"])
            # Optional tensors the step leaves out after its inputs (a convolution without a bias) are None,
            # as the executor binds them.
            for arg in op._schema.arguments[len(given):]:
                optional = isinstance(arg.type, torch.OptionalType)
                if not (optional and isinstance(arg.type.getElementType(), torch.TensorType)):
                    break
                if arg.name not in attributes:
                    given.append(None)
            names = [a.name for a in op._schema.arguments]
            if any(names.index(k) < len(given) for k in attributes if k in names):
                # A number between tensors (index_copy_(self, dim, index, source)): the tensors by schema name.
                tensors = [a.name for a in op._schema.arguments if "Tensor" in str(a.type) and a.name not in attributes]
                result = op(**dict(zip(tensors, given)), **attributes)
            else:
                result = op(*given, **attributes)
            for i, r in zip(step["outputs"], result if isinstance(result, (tuple, list)) else [result]):
                buffers[i].copy_(r)
        elif step["kind"] == "matmul" and step["epilogue"] == "none" and step["beta"] == 0.0:
            # cuBLASLt's product as the step declares it: the last two dimensions of each operand, transposed
            # when flagged, an operand of one matrix broadcast over the batch.
            a, b = buffers[step["a"]], buffers[step["b"]]
            a = a.transpose(-1, -2) if step["transpose_a"] else a
            b = b.transpose(-1, -2) if step["transpose_b"] else b
            c = buffers[step["c"]]
            c.copy_((step["alpha"] * torch.matmul(a.double(), b.double())).to(c.dtype).reshape(c.shape))
        else:
            raise NotImplementedError(f"step kind {step['kind']}")
    return [buffers[b["id"]] for b in program.buffers if b["role"] == "output"]


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor seen in its memory order (NHWC data as a contiguous [N, H, W, C]): the same pointer,
    which is all a kernel receives."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    view = t.permute(order)
    if view.is_contiguous() or t.is_contiguous():
        return view if view.is_contiguous() else t
    # A strided view (a column slice): the span of storage from its first element, as its pointer sees it.
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return t.as_strided((span,), (1,), t.storage_offset())


def _lowered(model, inputs):
    from stitchcuda.graph import Lowering, OfflinePlanner, capture, reference_values

    graph = capture(model, inputs)
    plan = OfflinePlanner().plan(graph)
    values = reference_values(graph, list(inputs))  # every value by name, the weights among them
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    program = Lowering(graph, plan, constants).build(plan.groups, graph.inputs, graph.outputs)
    return plan, program, values


class _KL(torch.nn.Module):
    def forward(self, s, t):
        return torch.nn.functional.kl_div(torch.log_softmax(s, -1), torch.log_softmax(t, -1), reduction="batchmean",
                                          log_target=True)


class _CrossEntropy(torch.nn.Module):
    def forward(self, x, target):
        return torch.nn.functional.cross_entropy(x, target, label_smoothing=0.1)


class _MeanSquare(torch.nn.Module):
    def forward(self, x):
        return (x * x).mean() + x.sum()


@pytest.mark.parametrize("model, inputs", [
    (_KL(), (torch.randn(6, 2048) * 2, torch.randn(6, 2048) * 2)),
    (_CrossEntropy(), (torch.randn(12, 1024) * 3, torch.tensor([0, 5, 1023, 17, 3, 900, 8, 8, 511, 2, 1, 100]))),
    (_MeanSquare(), (torch.randn(4, 1 << 16),)),
], ids=["kl-normalized-in-registers", "cross-entropy-gather-and-sum", "split-whole-tensor"])
def test_lowered_loss_programs_give_eager_results(emu, model, inputs):
    # The planner's groups, the lowering's buffers and launches and the kernels together: the program, run
    # step by step, returns eager's loss.
    plan, program, constants = _lowered(model, inputs)
    assert any(g.params.get("kind") == "normalized" or "split" in g.params for g in plan.groups)
    (got,) = run_program(emu, program, list(inputs), constants)
    with torch.no_grad():
        want = model(*inputs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


class _ConvThen(torch.nn.Module):
    """A convolution with a bias, read by elementwise ops only."""

    def __init__(self, conv: torch.nn.Module, then: str):
        super().__init__()
        self.conv, self.then = conv, then
        self.bn = torch.nn.BatchNorm2d(conv.out_channels)
        with torch.no_grad():  # running statistics away from the identity
            self.bn.running_mean.uniform_(-0.5, 0.5), self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        y = self.conv(x)
        if self.then.startswith("bn-"):
            y = self.bn(y)
            return torch.relu(y) if self.then == "bn-relu" else torch.nn.functional.leaky_relu(y, 0.1)
        if self.then == "gelu":
            return torch.nn.functional.gelu(y)
        if self.then == "gate":
            return x * torch.sigmoid(y)
        return torch.relu(y) if self.then == "relu" else torch.tanh(y)


@pytest.mark.parametrize("conv, then", [
    (torch.nn.Conv3d(3, 8, 3, padding=1), "gelu"),         # 3-D: no fused cuDNN epilogue of ours
    (torch.nn.Conv2d(6, 6, 1), "gate"),                     # 2-D, a sigmoid gate: not cuDNN's ReLU epilogue
    (torch.nn.ConvTranspose2d(5, 4, 2, stride=2), "tanh"),  # transposed
    (torch.nn.Conv2d(6, 6, 3, padding=1), "bn-leaky"),      # a batch norm, then not a ReLU
    (torch.nn.Conv2d(6, 6, 3, padding=1), "relu"),          # cuDNN's fused conv + bias + ReLU takes it back
    (torch.nn.Conv2d(6, 6, 3, padding=1), "bn-relu"),       # and conv + BN + ReLU
], ids=["conv3d-gelu", "conv2d-gate", "transposed-tanh", "conv2d-bn-leaky", "conv2d-relu", "conv2d-bn-relu"])
def test_a_convolution_bias_is_added_by_the_kernel_after_it(emu, conv, then):
    # cuDNN's convolution adds a bias in a pass of its own over the output: where only elementwise ops
    # read the result, the convolution runs without it and their kernel adds it on load.
    torch.manual_seed(3)
    model = _ConvThen(conv, then).eval()
    x = torch.randn(2, conv.in_channels, *((6, 7, 5) if isinstance(conv, torch.nn.Conv3d) else (9, 10)))
    if then == "gate":
        x = torch.randn(2, 6, 9, 10)
    plan, program, constants = _lowered(model, (x,))
    (step,) = [st for st in program.steps if st["kind"] == "aten" and "convolution" in st["op"]]
    assert len(step["inputs"]) == 2, step  # x and the filter: no bias
    pointwise = next(g for g in plan.groups if g.kind == "pointwise")
    assert pointwise.nodes[0].op == "aten::add.Tensor", [n.op for n in pointwise.nodes]
    # A ReLU epilogue stays cuDNN's to fuse (optimize() times both): its match takes the bias back.
    matches = list(plan.conv_epilogues.values())
    if then.endswith("relu"):
        (match,) = matches
        assert match["bias"] is not None and match["bias"].name == "p_conv_bias", match["bias"]
        assert (match["bn"] is not None) == (then == "bn-relu")
    else:
        assert not matches
    (got,) = run_program(emu, program, [x], constants)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)


def test_the_convolution_bias_rewrite_can_be_turned_off(stitch_settings, emu, monkeypatch):
    # STITCHCUDA_CONV_BIAS_APART=0 (to measure the rewrite): cuDNN's call keeps the bias, the program still
    # gives eager's result.
    stitch_settings(STITCHCUDA_CONV_BIAS_APART="0")
    torch.manual_seed(3)
    model = _ConvThen(torch.nn.Conv3d(3, 8, 3, padding=1), "gelu").eval()
    x = torch.randn(2, 3, 6, 7, 5)
    plan, program, constants = _lowered(model, (x,))
    (step,) = [st for st in program.steps if st["kind"] == "aten" and "convolution" in st["op"]]
    assert len(step["inputs"]) == 3, step
    (got,) = run_program(emu, program, [x], constants)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)


class _RMSNorm(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


def test_a_lowered_rms_norm_reads_its_row_once(emu):
    # The lowering tells the kernel that the scaling's x is the square's x: one read of the row.
    model, x = _RMSNorm(2048).eval(), torch.randn(3, 5, 2048)
    plan, program, constants = _lowered(model, (x,))
    (step,) = [s for s in program.steps if s["kind"] == "kernel"]
    kernel = program.kernels[step["kernel"]]
    assert "float4 h_e0" in kernel["source"], kernel["source"]
    (got,) = run_program(emu, program, [x], constants)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)


class _ScaledScores(torch.nn.Module):
    def forward(self, q, k):
        return torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.125, dim=-1)


def test_a_batched_product_with_a_transposed_operand_reads_it_in_place(emu):
    # q @ k^T over a batch: k is handed to the product with a transpose flag, not copied contiguous first.
    q, k = torch.randn(3, 40, 16), torch.randn(3, 24, 16)
    plan, program, constants = _lowered(_ScaledScores(), (q, k))
    (gemm,) = [g for g in plan.groups if g.kind == "gemm"]
    assert "b transposed in place" in gemm.reason, gemm.reason
    assert [s["kind"] for s in program.steps if s["kind"] != "view"] == ["matmul", "kernel"]
    (step,) = [s for s in program.steps if s["kind"] == "matmul"]
    assert step["transpose_b"] and step["batch"] == 3
    (got,) = run_program(emu, program, [q, k], constants)
    torch.testing.assert_close(got, _ScaledScores()(q, k), atol=1e-5, rtol=1e-5)


class _ConvChain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16)
        self.c2 = torch.nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.c2(y) + y)


def test_a_channels_last_chain_program_gives_eager_results(emu):
    # The input converted by the tiled transpose, cuDNN's NHWC convolutions (ATen here), the fused batch
    # norm, residual and ReLUs iterating in NHWC order, the result returned in the model's layout.
    torch.manual_seed(0)
    model = _ConvChain().eval()
    x = torch.randn(2, 16, 64, 64)
    plan, program, constants = _lowered(model, (x,))
    assert plan.channels_last
    assert any(k["name"].startswith("to_nhwc") and "32x32 tiles" in k["source"] for k in program.kernels)
    (got,) = run_program(emu, program, [x], constants)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), atol=1e-4, rtol=1e-4)


def _split_kernel_source() -> str:
    """The tf32x3 split kernel exactly as the program runtime compiles it (src/torch/matmul.cpp)."""
    text = (Path(__file__).resolve().parents[2] / "src" / "torch" / "matmul.cpp").read_text()
    return text[text.index('R"CUDA(') + len('R"CUDA('):text.index(')CUDA"')]


@pytest.mark.parametrize("offset", [0, 1], ids=["float4", "misaligned"])
def test_tf32x3_split_gives_an_exact_tf32_part_and_remainder(emu, offset):
    kernel = EmulatedModule(emu, _split_kernel_source()).kernel("stitchcuda_tf32x3_split")
    torch.manual_seed(7)
    x = (torch.randn(1 + 4099) * torch.logspace(-30, 30, 4100))[offset:]  # every magnitude, a ragged tail
    x[5], x[6], x[7], x[8] = float("inf"), float("-inf"), float("nan"), 1e-40  # and a subnormal
    x[9] = torch.tensor(0x7F800001, dtype=torch.int32).view(torch.float32)  # a NaN whose payload is in its low bits
    hi, lo = torch.full_like(x, 3.0), torch.full_like(x, 3.0)
    kernel((3, 1, 1), (256, 1, 1), x, hi, lo, x.numel())
    finite = torch.isfinite(x)
    assert int((hi.view(torch.int32)[finite] & 0x1FFF).abs().max()) == 0  # TF32: 10 mantissa bits, nothing below
    assert torch.equal(hi[finite] + lo[finite], x[finite])  # the remainder is exact
    # The remainder of a normal number is below one TF32 unit of it: the dropped lo * lo products are 2^-20
    # of x * y at most (a subnormal has fewer bits than that to begin with).
    normal = finite & (x.abs() >= torch.finfo(torch.float32).tiny)
    assert bool((lo[normal].abs() <= x[normal].abs() * 2.0 ** -10).all())
    assert hi[5] == float("inf") and hi[6] == float("-inf") and torch.isnan(hi[7]) and torch.isnan(hi[9])
    assert torch.equal(lo[5:8], torch.zeros(3)) and lo[9] == 0


def test_the_split_module_compiles_with_nvrtc_as_the_runtime_builds_it():
    # The runtime compiles this source once per architecture (src/torch/matmul.cpp: split_kernel); NVRTC
    # needs no GPU, so a source the emulator accepts but NVRTC rejects fails here, not on the device.
    module = jit.compile_module(_split_kernel_source())
    assert set(module.kernel_names) == {"stitchcuda_tf32x3_split", "stitchcuda_tf32x3_split_slab",
                                        "stitchcuda_bf16_cast"}
    assert "unsigned short" in str(module.kernel("stitchcuda_bf16_cast"))


@pytest.mark.parametrize("offset", [0, 1], ids=["float4", "misaligned"])
def test_bf16_cast_rounds_to_nearest_even_as_torch_does(emu, offset):
    # The conversion bf16 products start with (STITCHCUDA_BF16_CAST): torch's own rounding, bit for bit,
    # over every magnitude, ties, infinities, NaNs, subnormals and values that round past the largest bf16.
    kernel = EmulatedModule(emu, _split_kernel_source()).kernel("stitchcuda_bf16_cast")
    torch.manual_seed(11)
    x = (torch.randn(1 + 4099) * torch.logspace(-40, 38, 4100))[offset:]
    x[5], x[6], x[7], x[8] = float("inf"), float("-inf"), float("nan"), 1e-40
    x[9] = torch.finfo(torch.float32).max  # rounds up past bf16's largest: an infinity, as torch gives
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x00008000], dtype=torch.int64).to(torch.int32)
    x[10:14] = ties.view(torch.float32)  # halfway between two bf16 values: to the even one
    y = torch.full((x.numel(),), 0x7777, dtype=torch.int16)
    kernel((3, 1, 1), (256, 1, 1), x, y, x.numel())
    want = x.to(torch.bfloat16).view(torch.int16)
    finite = ~torch.isnan(x)
    assert torch.equal(y[finite], want[finite])
    assert torch.isnan(y.view(torch.bfloat16)[~finite].float()).all()


class _ClassMaps(torch.nn.Module):
    def forward(self, logits):
        return torch.argmax(logits, dim=1), torch.argmin(logits * 2, dim=1, keepdim=True)


def test_argmax_and_argmin_over_channels_follow_torchs_first_index_and_nan_rules(emu):
    # A segmentation map's class per pixel, across 37 channels split over 8 warps: ties between warps (the
    # first index wins), a NaN (it wins, its first index), a column of -inf (index 0).
    torch.manual_seed(3)
    x = torch.randint(-3, 4, (2, 37, 5, 9)).float()  # small integers: many ties
    x[0, 20, 1, 1] = x[0, 29, 1, 1] = float("nan")
    x[1, :, 2, 3] = float("-inf")
    x[1, 5, 4, 4], x[1, 13, 4, 4] = 100.0, 100.0
    model = _ClassMaps()
    plan, program, constants = _lowered(model, (x,))
    assert [g.params.get("kind") for g in plan.groups if g.kind == "reduction"] == ["argmax", "argmin"]
    got = run_program(emu, program, [x], constants)
    want = model(x)
    for g, w in zip(got, want):
        assert g.dtype == torch.int64 and torch.equal(g, w)


@pytest.mark.parametrize("offset", [0, 1], ids=["float4", "misaligned"])
@pytest.mark.parametrize("kind", ["argmax", "argmin"])
def test_a_class_map_of_four_columns_per_thread_follows_torchs_rules(emu, kind, offset):
    # 256 columns (two blocks of 128, four per thread), 37 classes over 8 warps: ties between warps and
    # within a thread's four columns (the first index wins), NaNs (the first NaN wins), a column of -inf.
    torch.manual_seed(11)
    outer, reduce, inner = 2, 37, 256
    storage = torch.randint(-3, 4, (outer * reduce * inner + 1,)).float()
    x = storage[offset:offset + outer * reduce * inner].view(outer, reduce, inner)  # offset 1: not 16-byte aligned
    x[0, 20, 5] = x[0, 29, 5] = float("nan")
    x[1, :, 130] = float("-inf")
    x[1, 5, 7] = x[1, 13, 7] = 100.0
    code = column_reduction_kernel(f"c_{kind}", kind, outer, reduce, inner, torch.float32)
    assert "4 columns per thread" in code.description and code.grid[0] == 2
    y = torch.full((outer, inner), -7, dtype=torch.int64)
    _run(emu, code, {"x": x, "y": y})
    assert torch.equal(y, getattr(torch, kind)(x, dim=1))


class _InvertedResidual(torch.nn.Module):
    """A MobileNet block: 1x1 expansion, depthwise 3x3 (stride 1 and 2), 1x1 projection, residual."""

    def __init__(self, stride: int):
        super().__init__()
        self.pw1, self.b1 = torch.nn.Conv2d(16, 32, 1), torch.nn.BatchNorm2d(32)
        self.dw, self.b2 = torch.nn.Conv2d(32, 32, 3, stride=stride, padding=1, groups=32), torch.nn.BatchNorm2d(32)
        self.pw2 = torch.nn.Conv2d(32, 16, 1)
        self.stride = stride

    def forward(self, x):
        h = torch.relu(self.b1(self.pw1(x)))
        h = torch.clamp(self.b2(self.dw(h)), 0, 6)
        y = self.pw2(h)
        return y + x if self.stride == 1 else y


@pytest.mark.parametrize("stride", [1, 2])
def test_a_depthwise_convolution_inside_a_channels_last_chain_runs_nhwc(emu, stride):
    # The depthwise convolution reads the expansion's NHWC output and writes NHWC for the projection: no
    # conversion around it, its batch norm and ReLU6 applied before its 16-byte stores.
    torch.manual_seed(stride)
    model = _InvertedResidual(stride).eval()
    with torch.no_grad():
        for bn in (model.b1, model.b2):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 16, 64, 64)  # 64 Ki elements: large enough for the chain to go channels-last
    plan, program, constants = _lowered(model, (x,))
    names = [k["name"] for k in program.kernels]
    assert any(n.startswith("depthwise_nhwc") for n in names) and sum(n.startswith("to_nhwc") for n in names) == 1
    (got,) = run_program(emu, program, [x], constants)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), atol=1e-4, rtol=1e-4)


def test_an_in_chain_depthwise_convolution_checked_alone_returns_the_models_layout(emu):
    # A group check builds the group as a program of its own, whose result is a returned buffer in the
    # model's (NCHW) layout: the NHWC template still runs, as in the chain, and one copy returns its result.
    # (Written straight into the returned buffer, its NHWC values read as NCHW: every MobileNet and
    # EfficientNet depthwise group failed its check and ran on ATen.)
    from stitchcuda.graph import Lowering, OfflinePlanner, capture, reference_values

    torch.manual_seed(5)
    model = _InvertedResidual(1).eval()
    x = torch.randn(2, 16, 64, 64)
    graph = capture(model, (x,))
    plan = OfflinePlanner().plan(graph)
    values = reference_values(graph, [x])
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    (group,) = [g for g in plan.groups if g.kind == "conv"]
    inputs = [v for v in group.inputs() if v.kind != "weight" and v.name not in constants]
    outputs = group.outputs({v.name for v in graph.outputs})
    program = Lowering(graph, plan, constants).build([group], inputs, outputs)
    assert [k["name"].split("_")[0] for k in program.kernels] == ["to", "depthwise"]
    assert any(k["name"].startswith("depthwise_nhwc") for k in program.kernels)
    (got,) = run_program(emu, program, [values[v.name].contiguous() for v in inputs], values)
    assert got.is_contiguous()
    torch.testing.assert_close(got, values[outputs[0].name], atol=1e-4, rtol=1e-4)


class _ConvPoolStage(torch.nn.Module):
    """A VGG-like stage: two 3x3 convolutions with batch norm and ReLU, then pooling, then a 1x1 convolution."""

    def __init__(self, pool: torch.nn.Module):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32)
        self.c2, self.b2 = torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.BatchNorm2d(32)
        self.pool, self.head = pool, torch.nn.Conv2d(32, 16, 1)

    def forward(self, x):
        y = torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))
        return self.head(torch.relu(self.pool(y)) * 2)


@pytest.mark.parametrize("pool", [torch.nn.MaxPool2d(2), torch.nn.MaxPool2d(3, 2, padding=1, ceil_mode=True),
                                  torch.nn.AvgPool2d(3, 2, padding=1, ceil_mode=True, count_include_pad=False)],
                         ids=["max2x2", "max3x3-ceil", "avg3x3-ceil-no-pad-count"])
def test_pooling_inside_a_channels_last_chain_runs_nhwc(emu, pool):
    # The pooling reads the second convolution's NHWC output and writes NHWC for the 1x1 convolution, its
    # ReLU and scale applied before the store, with PyTorch's window, divisor and NaN rules.
    torch.manual_seed(5)
    model = _ConvPoolStage(pool).eval()
    x = torch.randn(2, 16, 64, 64)
    plan, program, constants = _lowered(model, (x,))
    names = [k["name"] for k in program.kernels]
    assert any("pool_nhwc" in n for n in names), names
    assert sum(n.startswith("to_nhwc") for n in names) == 1
    (got,) = run_program(emu, program, [x], constants)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), atol=1e-4, rtol=1e-4)


def test_channels_last_max_pooling_returns_nan_for_a_window_holding_one(emu):
    from stitchcuda.graph.templates import pooling_nhwc_kernel

    torch.manual_seed(9)
    x = torch.randn(2, 8, 9, 9)
    x[1, 3, 4, 4] = float("nan")
    nhwc = x.contiguous(memory_format=torch.channels_last)
    code = pooling_nhwc_kernel("mp_nhwc", "max", (2, 8, 9, 9), (3, 3), (2, 2), (1, 1))
    want = torch.nn.functional.max_pool2d(x, 3, 2, 1)
    y = torch.full_like(want, 7.0).contiguous(memory_format=torch.channels_last)
    _run(emu, code, {"x": _memory_order(nhwc), "y": _memory_order(y)})  # the kernel sees the NHWC bytes
    assert torch.isnan(y[1, 3, 2, 2]) and torch.isnan(y).sum() == torch.isnan(want).sum() == 1
    torch.testing.assert_close(y, want, equal_nan=True)


def test_a_rotated_half_input_computes_ropes_rotation(emu):
    # RoPE: q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q[..., 8:], q[..., :8]); q a permuted view
    # ([B, S, H, D] stored, [B, H, S, D] read), cos and sin broadcast over the batch and heads.
    torch.manual_seed(5)
    b, h, s, d = 2, 3, 5, 16
    stored = torch.randn(b, s, h, d)
    q = stored.permute(0, 2, 1, 3)
    cos, sin = torch.randn(s, d), torch.randn(s, d)
    shape = (b, h, s, d)
    inputs = [PointwiseInput("in0", torch.float32, tuple(q.stride())),
              PointwiseInput("in1", torch.float32, (0, 0, d, 1)), PointwiseInput("in2", torch.float32, (0, 0, d, 1)),
              PointwiseInput("in3", torch.float32, tuple(q.stride()), rotate=d // 2)]
    body = ["const float t0 = in0 * in1;", "const float t1 = in3 * in2;", "const float t2 = t0 + t1;"]
    code = pointwise_kernel("fused_rope", shape, inputs, body, [("out0", "t2", torch.float32)])
    assert "rotated halves" in code.description and not code.vectorized
    out = torch.empty(shape)
    _run(emu, code, {"in0": stored, "in1": cos, "in2": sin, "in3": stored, "out0": out})
    rotated = torch.cat((-q[..., d // 2:], q[..., : d // 2]), dim=-1)
    torch.testing.assert_close(out, q * cos + rotated * sin)
    with pytest.raises(ValueError, match="must rotate half of the last extent"):
        pointwise_kernel("bad", shape, [PointwiseInput("in0", torch.float32, tuple(q.stride()), rotate=4)], [],
                         [("out0", "in0", torch.float32)])


def _tf32_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hi: x with its 13 low mantissa bits cleared (NaN kept whole), lo = x - hi (0 where x is not finite)."""
    hi = (x.view(torch.int32) & -8192).view(torch.float32)
    hi = torch.where(torch.isnan(x), x, hi)
    lo = torch.where(torch.isfinite(x), x - hi, torch.zeros_like(x))
    return hi, lo


@pytest.mark.parametrize("rows, cols, ld, offset", [(6, 16, 24, 8), (5, 7, 13, 3), (4, 8, 8, 0), (3, 12, 20, 2)],
                         ids=["float4", "scalar", "dense", "misaligned"])
@pytest.mark.parametrize("side_by_side", [0, 2, 3], ids=["parts", "fused", "fused-all"])
def test_tf32x3_slab_split_writes_an_exact_split_of_a_strided_slab(emu, rows, cols, ld, offset, side_by_side):
    # A slab of K: `rows` rows of `cols` elements, `ld` apart, starting `offset` floats in (2: not 16-byte
    # aligned, so the scalar path although cols and ld are multiples of 4), split into dense [rows, cols] parts;
    # or, for the fused lo products, into rows of 2 * cols holding [lo | hi] side by side (out_ld = 2 cols);
    # or, all three products fused, rows of 3 * cols holding [lo | hi | hi] (hi written again cols after).
    torch.manual_seed(rows * cols + ld)
    storage = torch.randn(offset + rows * ld + 4) * 100
    storage[offset + 1], storage[offset + 2], storage[offset + 3] = float("inf"), float("nan"), float("-inf")
    out_ld = side_by_side * cols if side_by_side else cols
    hi_again = cols if side_by_side == 3 else 0
    again_cols = cols if side_by_side == 3 else 0
    kernel = EmulatedModule(emu, _split_kernel_source()).kernel("stitchcuda_tf32x3_split_slab")
    if side_by_side:
        parts = torch.full((rows * out_ld,), 7.0)
        lo_at, hi_at = parts, parts[cols:]
    else:
        hi_at, lo_at = torch.full((rows * cols,), 7.0), torch.full((rows * cols,), 7.0)
    kernel(max(1, -(-rows * cols // 4 // 256)), 256, storage[offset:], ld, rows, cols, hi_at, lo_at, out_ld, hi_again,
           again_cols)
    if side_by_side:
        lo, hi = parts.view(rows, out_ld)[:, :cols], parts.view(rows, out_ld)[:, cols:2 * cols]
        if side_by_side == 3:
            torch.testing.assert_close(parts.view(rows, out_ld)[:, 2 * cols:], hi, rtol=0, atol=0, equal_nan=True)
    else:
        hi, lo = hi_at.view(rows, cols), lo_at.view(rows, cols)
    slab = storage[offset:].as_strided((rows, cols), (ld, 1))
    want_hi, want_lo = _tf32_split(slab)
    torch.testing.assert_close(hi, want_hi, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lo, want_lo, rtol=0, atol=0)
    finite = torch.isfinite(slab)
    assert torch.equal((hi + lo)[finite], slab[finite])  # exact



# ---- concatenations read in place by the elementwise kernel after them ----

class _DenseLayers(torch.nn.Module):
    """Two DenseNet layers: each concatenates the features so far and applies batch norm and ReLU to the
    concatenation before a convolution; the block returns the last concatenation's norm."""

    def __init__(self, c: int = 8, growth: int = 4):
        super().__init__()
        self.bn1, self.conv1 = torch.nn.BatchNorm2d(c), torch.nn.Conv2d(c, growth, 3, padding=1, bias=False)
        self.bn2, self.conv2 = torch.nn.BatchNorm2d(c + growth), torch.nn.Conv2d(c + growth, growth, 3, padding=1,
                                                                                   bias=False)
        self.bn3 = torch.nn.BatchNorm2d(c + 2 * growth)
        for bn in (self.bn1, self.bn2, self.bn3):
            with torch.no_grad():
                bn.running_mean.uniform_(-0.5, 0.5), bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        f1 = self.conv1(torch.relu(self.bn1(x)))
        f2 = self.conv2(torch.relu(self.bn2(torch.cat([x, f1], 1))))
        return torch.relu(self.bn3(torch.cat([x, f1, f2], 1)))


class _CatThen(torch.nn.Module):
    def __init__(self, dim: int, then: str = "tanh"):
        super().__init__()
        self.dim, self.then = dim, then

    def forward(self, a, b, c):
        y = torch.cat([torch.sigmoid(a), b, c * 2], self.dim)
        if self.then == "mm":  # a reader that is not elementwise: the concatenation is copied once
            return y @ y.transpose(-1, -2)
        if self.then == "returned":  # the concatenation is also an output: the kernel stores it
            return y, torch.tanh(y) + 1
        return torch.tanh(y) * 0.5



@pytest.mark.parametrize("layout", ["off", "on"])
def test_densenet_concatenations_are_read_in_place(stitch_settings, emu, layout, monkeypatch):
    # "on": the block planned channels-last, the pieces NHWC and the kernel iterating in NHWC order.
    stitch_settings(STITCHCUDA_CHANNELS_LAST=layout)
    torch.manual_seed(0)
    model = (_DenseLayers() if layout == "off" else _DenseLayers(16, 4)).eval()
    x = torch.randn(2, 8, 6, 8) if layout == "off" else torch.randn(1, 16, 64, 64)
    plan, program, constants = _lowered(model, (x,))
    assert bool(plan.channels_last) == (layout == "on")
    # Each concatenation opens the elementwise group of its batch norm and ReLU: no ATen cat.
    cats = [g for g in plan.groups for n in g.nodes if n.op == "aten::cat"]
    assert len(cats) == 2 and all(g.kind == "pointwise" and g.nodes[0].op == "aten::cat" for g in cats)
    assert not [s for s in program.steps if s["kind"] == "aten" and s["op"] == "aten::cat"]
    (got,) = run_program(emu, program, [x], constants)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim, shapes, path", [
    (1, [(2, 3, 8), (2, 5, 8), (2, 1, 8)], "g < n4"),       # not the last dim: groups of four outputs
    (-1, [(2, 3, 4), (2, 3, 8), (2, 3, 4)], "g < n4"),      # the last, boundaries multiples of 4
    (-1, [(2, 3, 5), (2, 3, 2), (2, 3, 7)], "i < n;"),      # the last, other boundaries: one at a time
    (0, [(1, 3, 5), (0, 3, 5), (2, 3, 5)], "i < n;"),       # an empty piece covers nothing
])
def test_a_concatenation_read_in_place_matches_eager(emu, dim, shapes, path):
    torch.manual_seed(1)
    a, b, c = (torch.randn(*s) for s in shapes)
    model = _CatThen(dim).eval()
    plan, program, constants = _lowered(model, (a, b, c))
    (group,) = [g for g in plan.groups if any(n.op == "aten::cat" for n in g.nodes)]
    assert group.kind == "pointwise"
    (kernel,) = [k for k in program.kernels if re.search(r"__restrict__ p\d+_0\b", k["source"])]  # a pointer a piece
    assert path in kernel["source"], kernel["source"]
    # In groups of four, a piece with unit stride along the last dimension is read 16 bytes at a time.
    assert ("reinterpret_cast<const float4*>(p0_" in kernel["source"]) == (path == "g < n4")
    (got,) = run_program(emu, program, [a, b, c], constants)
    torch.testing.assert_close(got, model(a, b, c), atol=1e-6, rtol=1e-6)


class _CatAlone(torch.nn.Module):
    def forward(self, x):
        return torch.cat([x], 1).relu() * 2  # DenseNet's first layer: its input concatenated alone


def test_a_concatenation_of_one_piece_is_read_in_place(emu):
    x = torch.randn(2, 6, 5, 3)
    plan, program, constants = _lowered(_CatAlone().eval(), (x,))
    (group,) = [g for g in plan.groups if any(n.op == "aten::cat" for n in g.nodes)]
    assert group.kind == "pointwise"
    assert not [s for s in program.steps if s["kind"] == "aten" and s["op"] == "aten::cat"]
    (got,) = run_program(emu, program, [x], constants)
    torch.testing.assert_close(got, x.relu() * 2, atol=0, rtol=0)


class _PermutedCopies(torch.nn.Module):
    """An einsum's operands: an elementwise result copied contiguous through views, twice."""

    def forward(self, a, b):
        y = torch.sigmoid(a) * b + 1.0  # [B, H, T, P], b broadcast over B and T
        first = y.permute(0, 2, 1, 3).contiguous() * 2.0  # [B, T, H, P]
        second = y.unsqueeze(2).transpose(1, 4).contiguous()  # [B, P, 1, T, H]
        return first, second


class _TransposedSum(torch.nn.Module):
    def forward(self, a, b, c):
        return torch.tanh((torch.sigmoid(a) * b).transpose(1, 2) + c)  # the product read transposed, once


@pytest.mark.parametrize("relayout", ["1", "0"])
def test_a_chain_read_only_by_copies_is_computed_in_their_layout(stitch_settings, emu, relayout, monkeypatch):
    stitch_settings(STITCHCUDA_RELAYOUT=relayout)
    torch.manual_seed(3)
    a, b = torch.randn(2, 3, 5, 8), torch.randn(3, 1, 8)
    model = _PermutedCopies().eval()
    plan, program, _ = _lowered(model, (a, b))
    copies = [g for g in plan.groups if g.kind == "pointwise" and any(n.op == "aten::clone" for n in g.nodes)]
    assert len(copies) == 2
    if relayout == "1":
        # The chain's group is gone: each copy computes sigmoid(a) * b + 1 itself, reading a and b through
        # the views, and y is never stored.
        assert all("relayout" in g.params and g.nodes[0].op == "aten::sigmoid" for g in copies)
        assert not [g for g in plan.groups if g.kind == "pointwise" and g not in copies]
        assert len(program.kernels) == 2
    else:
        assert not any("relayout" in g.params for g in copies) and len(program.kernels) == 3
    got = run_program(emu, program, [a, b], {})
    for g_, w in zip(got, model(a, b)):
        torch.testing.assert_close(g_, w, atol=1e-6, rtol=1e-6)


class _ChunkedEinsums(torch.nn.Module):
    """A state-space layer's chunked einsums (the suite's selective scan without its cumsums): a dt-weighted
    input from a column slice of a projection, read by two einsums, and a permuted output sum."""

    def forward(self, proj, dt, decay):
        b, l, _ = proj.shape
        h, p, t = 4, 8, 8
        xc = proj[..., : h * p].reshape(b, l // t, t, h, p)
        xdt = xc * torch.nn.functional.softplus(dt).reshape(b, l // t, t, h).unsqueeze(-1)
        y = torch.einsum("bhcts,bcshp->bhctp", decay, xdt)
        states = torch.einsum("bhcs,bcshp->bchp", decay[..., -1, :], xdt)
        y = y * 0.5 + xc.permute(0, 3, 1, 2, 4)
        return y.permute(0, 2, 3, 1, 4).reshape(b, l, h * p), states


def test_a_chain_read_through_views_by_another_elementwise_group_is_computed_there(emu):
    torch.manual_seed(9)
    a, b, c = torch.randn(2, 6, 10), torch.randn(6, 1), torch.randn(2, 10, 6)
    model = _TransposedSum().eval()
    plan, program, values = _lowered(model, (a, b, c))
    (group,) = [g for g in plan.groups if g.kind == "pointwise"]
    assert "relayout" in group.params and len(program.kernels) == 1
    (got,) = run_program(emu, program, [a, b, c], values)
    torch.testing.assert_close(got, model(a, b, c), atol=1e-6, rtol=1e-6)


def test_einsum_operands_computed_in_their_copies_layout_match_eager(emu):
    torch.manual_seed(4)
    proj, dt, decay = torch.randn(2, 32, 80), torch.randn(2, 32, 4), torch.rand(2, 4, 4, 8, 8)
    model = _ChunkedEinsums().eval()
    plan, program, values = _lowered(model, (proj, dt, decay))
    relaid = [g for g in plan.groups if "relayout" in g.params]
    # xdt computed in both einsums' copies (never stored), the output sum in its permuted copy.
    assert len(relaid) >= 3, [g.reason for g in plan.groups]
    got = run_program(emu, program, [proj, dt, decay], values)
    with torch.no_grad():
        for g_, w in zip(got, model(proj, dt, decay)):
            torch.testing.assert_close(g_, w, atol=1e-5, rtol=1e-5)


class _TokenMixing(torch.nn.Module):
    """An MLP-Mixer's token projection: a linear layer over the transposed layer norm."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(16), torch.nn.Linear(12, 20)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(self.norm(x).transpose(1, 2)))


def test_a_transposed_operand_reached_through_same_shape_views_is_read_in_place(emu):
    torch.manual_seed(6)
    model, x = _TokenMixing().eval(), torch.randn(3, 12, 16)
    plan, program, values = _lowered(model, (x,))
    (gemm,) = [g for g in plan.groups if g.kind == "gemm"]
    assert gemm.params["transpose_a"] and "a transposed in place" in gemm.reason, gemm.reason
    assert not [s for s in program.steps if s["kind"] == "aten" and s["op"] == "aten::contiguous"]
    (got,) = run_program(emu, program, [x], values)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)


class _TransposedBack(torch.nn.Module):
    def __init__(self, cut: int = 0):
        super().__init__()
        self.cut = cut

    def forward(self, x, y, bias):
        y = y * 2.0  # stored [B, C, R + cut]
        if self.cut:  # a causal conv1d's output cut to the sequence, as a state-space layer reads it
            y = y[..., : y.shape[-1] - self.cut]
        return x + y.transpose(1, 2) + bias  # read as [B, R, C]


@pytest.mark.parametrize("cut", [0, 3])
def test_an_operand_read_transposed_is_staged_through_tiles(emu, cut):
    torch.manual_seed(7)
    x, y, bias = torch.randn(3, 40, 36), torch.randn(3, 36, 40 + cut), torch.randn(36)
    model = _TransposedBack(cut).eval()
    plan, program, values = _lowered(model, (x, y, bias))
    (kernel,) = [k for k in program.kernels if k["name"].startswith("fused_transposed")]
    assert "1 NHWC operand(s) staged through 32x32 tiles" in kernel["source"]
    (got,) = run_program(emu, program, [x, y, bias], values)
    torch.testing.assert_close(got, model(x, y, bias), atol=1e-6, rtol=1e-6)


class _GatedConvs(torch.nn.Module):
    """A channels-last chain whose elementwise group between its convolutions reads an NCHW value."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.Conv2d(32, 16, 1)

    def forward(self, x, gate):
        return self.c2(torch.relu(self.c1(x) + torch.sigmoid(gate)))


def test_an_nchw_operand_of_an_nhwc_group_is_staged_through_tiles(stitch_settings, emu, monkeypatch):
    stitch_settings(STITCHCUDA_CHANNELS_LAST="on")
    torch.manual_seed(8)
    x, gate = torch.randn(1, 16, 64, 64), torch.randn(1, 32, 64, 64)
    model = _GatedConvs().eval()
    plan, program, values = _lowered(model, (x, gate))
    assert plan.channels_last
    # relu(c1(x) + sigmoid(gate)) iterates (N, H, W, C) and reads the gate NCHW: tiles of (pixels, channels).
    (kernel,) = [k for k in program.kernels if k["name"].startswith("fused_transposed")]
    assert "1 NHWC operand(s) staged through 32x32 tiles" in kernel["source"]
    (got,) = run_program(emu, program, [x, gate], values)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x, gate), atol=1e-5, rtol=1e-5)


def test_concatenations_in_place_can_be_turned_off(stitch_settings, monkeypatch):
    from stitchcuda.graph import OfflinePlanner, capture

    stitch_settings(STITCHCUDA_CAT_IN_PLACE="0")  # to measure them: ATen's copy, as before
    a, b, c = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 1, 8)
    plan = OfflinePlanner().plan(capture(_CatThen(1).eval(), (a, b, c)))
    (group,) = [g for g in plan.groups if any(n.op == "aten::cat" for n in g.nodes)]
    assert group.kind == "aten" and "STITCHCUDA_CAT_IN_PLACE=0" in group.reason


def test_a_concatenation_read_by_a_matmul_stays_aten_and_one_returned_is_stored(emu):
    torch.manual_seed(2)
    a, b, c = torch.randn(4, 3, 8), torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    # Read by a matmul: an ATen step copies it once, as before (this harness runs no tensor-list op).
    plan, program, _ = _lowered(_CatThen(1, "mm").eval(), (a, b, c))
    (group,) = [g for g in plan.groups if any(n.op == "aten::cat" for n in g.nodes)]
    assert group.kind == "aten" and "other than elementwise" in group.reason
    assert sum(s["kind"] == "aten" and s["op"] == "aten::cat" for s in program.steps) == 1
    # Returned as well as read: the kernel reads the pieces and stores the concatenation as an output.
    model = _CatThen(1, "returned").eval()
    plan, program, constants = _lowered(model, (a, b, c))
    (group,) = [g for g in plan.groups if any(n.op == "aten::cat" for n in g.nodes)]
    assert group.kind == "pointwise"
    got = run_program(emu, program, [a, b, c], constants)
    for g_, w in zip(got, model(a, b, c)):
        torch.testing.assert_close(g_, w, atol=1e-6, rtol=1e-6)
