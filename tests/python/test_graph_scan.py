"""The scan template (cumsum, cumprod): its kernels run on the CPU through the corpus's CUDA emulator and
give, bit for bit, what ATen's CUDA scan computes — a replica of ATen's combining order here in torch
fp32 (tiles of 2^(L+1), the running total folded into each tile's first element, a Sklansky network;
sequential down a column) — for short and long rows, several rows, the last dimension and others, with
elementwise ops fused on load and on store. Then the Planner's decisions, the lowered program, NVRTC,
and on a GPU the same kernels and optimize() against torch itself.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, EmulatedModule, unavailable  # noqa: E402

import stitchcuda  # noqa: E402
from stitchcuda import jit  # noqa: E402
from stitchcuda.graph import Lowering, OfflinePlanner, capture  # noqa: E402
from stitchcuda.graph.planner import GENERATED  # noqa: E402
from stitchcuda.graph.targets import COMPUTING, describe_graph  # noqa: E402
from stitchcuda.graph.templates import PointwiseInput, RowPrologue, aten_tile, scan_kernel  # noqa: E402
from stitchcuda.verify.tolerance import tolerance  # noqa: E402

ATOL, RTOL = tolerance(torch.float32)
_OPS = {"cumsum": (0.0, torch.add), "cumprod": (1.0, torch.mul)}


# ---- ATen's order, replayed in fp32 -----------------------------------------------------------------


def aten_rows(x: torch.Tensor, kind: str) -> torch.Tensor:
    """ATen's CUDA scan of the last dimension (ScanUtils.cuh, tensor_kernel_scan_innermost_dim), every
    combine one fp32 operation as there."""
    init, op = _OPS[kind]
    rows, cols = x.shape
    tile = aten_tile(rows, cols)
    out, total = torch.empty_like(x), torch.full((rows,), init)
    for c0 in range(0, cols, tile):
        n = min(tile, cols - c0)
        buf = torch.full((rows, tile), init)
        buf[:, :n] = x[:, c0:c0 + n]
        buf[:, 0] = op(buf[:, 0], total)
        s = 1
        while s < tile:  # the upper half of every 2s block takes the last element of its lower half
            b = buf.view(rows, tile // (2 * s), 2 * s)
            b[:, :, s:] = op(b[:, :, s:], b[:, :, s - 1:s])
            s *= 2
        out[:, c0:c0 + n] = buf[:, :n]
        total = buf[:, -1].clone()
    return out


def aten_columns(x: torch.Tensor, dim: int, kind: str) -> torch.Tensor:
    """ATen's CUDA scan of another dimension (tensor_kernel_scan_outer_dim): sequential from the initial value."""
    init, op = _OPS[kind]
    acc, out = torch.full_like(x.select(dim, 0), init), torch.empty_like(x)
    for i in range(x.shape[dim]):
        acc = op(acc, x.select(dim, i))
        out.select(dim, i).copy_(acc)
    return out


def sequential(x: torch.Tensor) -> torch.Tensor:
    """A running fp32 sum along the last dimension, one rounding per element: the naive order."""
    acc, out = torch.zeros(x.shape[0]), torch.empty_like(x)
    for c in range(x.shape[1]):
        acc = acc + x[:, c]
        out[:, c] = acc
    return out


def bitwise(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit patterns (NaN where NaN, -0 where -0)."""
    return got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32))


# ---- the kernels on the CPU emulator ----------------------------------------------------------------

# The emulator has the shuffles the reductions use; the scan's network reads another lane's value.
_SHFL = "template <class T> T __shfl_sync(unsigned, T v, int lane) { return emu_shuffle(v, lane & 31); }\n"


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if unavailable() is not None:
        pytest.skip(f"CUDA emulator: {unavailable()}")
    return EmulatedJit(tmp_path_factory.mktemp("emulated_scan"))


def _run(emu, code, tensors: dict) -> None:
    source = "\n".join(l for l in code.source.splitlines() if not re.search(r"__half|__nv_bfloat16|#include <cuda_", l))
    kernel = EmulatedModule(emu, _SHFL + source).kernel(code.name)
    kernel(code.grid, code.block, *[tensors[key] for _, key in code.args])


@pytest.mark.parametrize("rows, cols, kind", [(3, 1, "cumsum"), (3, 7, "cumsum"), (5, 7, "cumprod"), (4, 32, "cumsum"),
                                              (6, 1000, "cumsum"), (20, 1000, "cumprod"), (64, 1001, "cumsum"),
                                              (3, 4097, "cumsum"), (2, 4097, "cumprod"), (2, 70000, "cumsum")])
def test_row_scans_are_atens_order_bit_for_bit(emu, rows, cols, kind):
    torch.manual_seed(rows * cols)
    x = torch.randn(rows, cols) if kind == "cumsum" else 1 + 0.01 * torch.randn(rows, cols)
    code = scan_kernel("scan", kind, (rows, cols), -1)
    tile = aten_tile(rows, cols)
    if cols > tile:  # several tiles: ATen's (a row inside one tile takes the same sums in any tile holding it)
        assert f"tiles of {tile}," in code.description
    y = torch.full_like(x, float("nan"))
    _run(emu, code, {"x": x, "y": y})
    assert bitwise(y, aten_rows(x, kind)), (y - aten_rows(x, kind)).abs().max()
    exact = (torch.cumsum if kind == "cumsum" else torch.cumprod)(x.double(), -1)  # torch's CPU scan is this, rounded
    torch.testing.assert_close(y.double(), exact, atol=ATOL, rtol=RTOL)


def test_a_long_rows_error_is_atens_and_below_a_running_sums(emu):
    # 70,000 elements: against fp64 the kernel's error is exactly ATen's own (the same roundings), and a
    # running fp32 sum — one rounding per element at the partial sum's magnitude — is several times worse.
    torch.manual_seed(7)
    x = torch.randn(3, 70000)
    code = scan_kernel("long_row", "cumsum", (3, 70000), -1)
    y = torch.empty_like(x)
    _run(emu, code, {"x": x, "y": y})
    exact = x.double().cumsum(-1)

    def error(t):
        return (t.double() - exact).abs().max().item()

    ours, atens, naive = error(y), error(aten_rows(x, "cumsum")), error(sequential(x))
    assert ours == atens and 0 < ours < naive / 3, (ours, atens, naive)


def test_rows_that_are_not_16_byte_aligned_take_scalar_accesses(emu):
    rows, cols = 3, 1024
    storage = torch.randn(rows * cols + 1)
    code = scan_kernel("odd", "cumsum", (rows, cols), -1)
    assert "16-byte accesses" in code.description
    for offset in (0, 1):  # 4 bytes past a 16-byte boundary: the scalar body, the same sums
        x = storage[offset:offset + rows * cols].view(rows, cols)
        y = torch.full((rows * cols + 1,), float("nan"))[offset:offset + rows * cols].view(rows, cols)
        _run(emu, code, {"x": x, "y": y})
        assert bitwise(y, aten_rows(x, "cumsum")), offset


def test_signed_zeros_nans_and_infinities_land_where_aten_puts_them(emu):
    x = torch.randn(4, 300)
    x[0, :5] = -0.0                       # ATen's first combine is 0 + -0: +0, and +0 from there on
    x[2, 100], x[2, 200] = float("inf"), float("-inf")  # inf, then NaN from index 200
    x[3, 50] = float("nan")
    code = scan_kernel("special", "cumsum", (4, 300), -1)
    y = torch.empty_like(x)
    _run(emu, code, {"x": x, "y": y})
    assert bitwise(y, aten_rows(x, "cumsum"))
    assert not torch.signbit(y[0, :5]).any() and y[2, 150] == float("inf") and y[2, 200:].isnan().all()
    assert y[3, 50:].isnan().all() and not y[3, :50].isnan().any()
    # A product keeps -0 (1 * -0 is -0): lanes outside a level multiply by 1, which changes no float.
    p = torch.rand(3, 300) + 0.5
    p[0, 10], p[1, 20], p[2, :3] = 0.0, float("inf"), -0.0
    code = scan_kernel("special_prod", "cumprod", (3, 300), -1)
    z = torch.empty_like(p)
    _run(emu, code, {"x": p, "y": z})
    assert bitwise(z, aten_rows(p, "cumprod")) and (z[0, 10:] == 0).all() and z[1, 20:].isinf().all()
    assert torch.signbit(z[2, :3]).tolist() == [True, False, True]


@pytest.mark.parametrize("shape, dim, kind", [((4, 6, 5), 1, "cumsum"), ((3, 37, 70), 1, "cumprod"),
                                              ((4097, 3), 0, "cumsum"), ((2, 9, 1), 1, "cumsum"),
                                              ((70, 33), 0, "cumprod")])
def test_scans_along_other_dimensions_are_sequential_as_in_aten(emu, shape, dim, kind):
    torch.manual_seed(sum(shape))
    x = torch.randn(shape) if kind == "cumsum" else 1 + 0.05 * torch.randn(shape)
    code = scan_kernel("col", kind, shape, dim)
    assert "a thread per column" in code.description
    y = torch.full_like(x, float("nan"))
    _run(emu, code, {"x": x, "y": y})
    assert bitwise(y, aten_columns(x, dim, kind))
    exact = (torch.cumsum if kind == "cumsum" else torch.cumprod)(x.double(), dim)
    torch.testing.assert_close(y.double(), exact, atol=ATOL * shape[dim] ** 0.5, rtol=RTOL)


def _fused(shape):
    """x = (a + b) * scale - shift[row] on load (a full tensor, a row vector, a scalar, a per-row value);
    relu(y) + r on store."""
    rows, cols = shape
    a, b, scale, shift, r = torch.randn(rows, cols), torch.randn(cols), torch.tensor([1.5]), torch.randn(rows, 1), \
        torch.randn(rows, cols)
    inputs = [PointwiseInput("in0", torch.float32, (cols, 1)), PointwiseInput("in1", torch.float32, (0, 1)),
              PointwiseInput("in2", torch.float32, (0, 0)), PointwiseInput("in3", torch.float32, (1, 0))]
    body = ["const float t0 = (in0 + in1);", "const float t1 = (t0 * in2);", "const float t2 = (t1 - in3);"]
    prologue = RowPrologue(shape, inputs, body, "t2")
    output = RowPrologue(shape, [PointwiseInput("o0", torch.float32, (cols, 1))],
                         ["const float t0 = (yv != yv ? yv : fmaxf(yv, 0.0f));", "const float t1 = (t0 + o0);"], "t1",
                         ("yv",))
    tensors = {"in0": a, "in1": b, "in2": scale, "in3": shift, "o0": r}
    return prologue, output, tensors, (a + b) * scale - shift, r


@pytest.mark.parametrize("rows, cols", [(5, 64), (3, 1000), (3, 1001)], ids=["one-stage", "16-byte", "scalar"])
def test_elementwise_ops_before_and_after_a_row_scan_are_fused(emu, rows, cols):
    torch.manual_seed(cols)
    prologue, output, tensors, x, r = _fused((rows, cols))
    code = scan_kernel("fused", "cumsum", (rows, cols), -1, prologue, output)
    assert [k for _, k in code.args] == ["in0", "in1", "in2", "in3", "o0", "y"]
    assert "3 elementwise op(s) fused into the loads" in code.description
    assert ("(16-byte)" in code.description) == (cols % 4 == 0)
    y = torch.full((rows, cols), float("nan"))
    _run(emu, code, {**tensors, "y": y})
    assert bitwise(y, torch.relu(aten_rows(x, "cumsum")) + r)


def test_elementwise_ops_around_a_column_scan_are_fused(emu):
    x, w = torch.randn(3, 40, 6), torch.randn(6)
    shape = (3, 40, 6)
    inputs = [PointwiseInput("in0", torch.float32, (240, 6, 1)), PointwiseInput("in1", torch.float32, (0, 0, 1))]
    prologue = RowPrologue(shape, inputs, ["const float t0 = (in0 * in1);"], "t0")
    output = RowPrologue(shape, [], ["const float t0 = (yv * 0.5f);"], "t0", ("yv",))
    code = scan_kernel("colfused", "cumsum", shape, 1, prologue, output)
    y = torch.empty(shape)
    _run(emu, code, {"in0": x, "in1": w, "y": y})
    assert bitwise(y, aten_columns(x * w, 1, "cumsum") * 0.5)


def test_the_template_refuses_what_it_cannot_scan():
    with pytest.raises(ValueError, match="unknown scan 'logcumsumexp'"):
        scan_kernel("bad", "logcumsumexp", (2, 8), -1)
    with pytest.raises(ValueError, match="no empty one"):
        scan_kernel("bad", "cumsum", (2, 0), -1)
    with pytest.raises(ValueError, match="out of range"):
        scan_kernel("bad", "cumsum", (2, 8), 2)
    with pytest.raises(ValueError, match="reads 'yv'"):
        scan_kernel("bad", "cumsum", (2, 8), -1,
                    output=RowPrologue((2, 8), [], ["const float t0 = stat;"], "t0", ("stat",)))


# ---- NVRTC: what the GPU will run ---------------------------------------------------------------------


def _basic_blocks(ptx: str) -> list[str]:
    return re.split(r"\n\$L__\w+:|\n\s*@?%?\w*\s*bra(?:\.uni)?\s+\$L__\w+;", ptx)


def test_the_long_row_kernel_keeps_a_stage_of_loads_in_flight_in_registers():
    # op_cumsum_long_rows' shape: tiles of 256, a warp per row, 8 elements per lane, 4 tiles per stage.
    code = scan_kernel("long_rows", "cumsum", (2048, 131072), -1)
    assert "tiles of 256" in code.description and "32 lanes per row, 8 consecutive" in code.description
    assert code.grid == 512 and code.block == 128
    ptx = jit.compile_module(code.source, program_name="long_rows.cu").ptx
    assert ".local" not in ptx                       # the tiles stay in registers
    assert "bar.sync" not in ptx and ".shared" not in ptx
    # A stage's eight 16-byte loads are issued together: no branch between them.
    assert max(b.count("ld.global.nc.v4.f32") for b in _basic_blocks(ptx)) >= 8
    assert "fma" not in ptx and "add.rn.f32" in ptx  # every combine rounds on its own, as ATen's


def test_a_half_result_stores_through_the_scalar_path():
    output = RowPrologue((8, 256), [], ["const float t0 = yv;"], "t0", ("yv",))
    code = scan_kernel("to_half", "cumsum", (8, 256), -1, output=output, out_dtype=torch.float16)
    assert "__half* __restrict__ y" in code.source and "store4" not in code.source.split("// to_half")[1]
    jit.compile(code.source, code.name)


# ---- the Planner and the lowering ---------------------------------------------------------------------


class Scans(torch.nn.Module):
    def forward(self, x, y, z):
        a = torch.relu(torch.cumsum(x * 2 + 1, dim=-1))  # prologue and output function fused
        b = torch.cumprod(y, 1)                           # a middle dimension
        c = torch.cumsum(x.half(), -1)                    # fp16: ATen
        d = torch.cumsum(x, -1, dtype=torch.float64)      # fp64 result: ATen
        e = z.cumsum(0)                                   # one row: ATen's CUB scan
        f = torch.logcumsumexp(x, -1)                     # no template
        return a, b, c, d, e, f


def _planned():
    inputs = (torch.randn(16, 1000), torch.randn(5, 30, 7), torch.randn(4096))
    graph = capture(Scans().eval(), inputs)
    return graph, OfflinePlanner().plan(graph), inputs


def test_the_planner_makes_scan_groups_and_says_why_not_elsewhere():
    graph, plan, _ = _planned()
    groups = {tuple(n.op.removeprefix("aten::") for n in g.nodes): g for g in plan.groups}
    fused = groups[("mul.Tensor", "add.Tensor", "cumsum", "relu")]
    assert fused.kind == "scan" and f"tiles of {aten_tile(16, 1000)}" in fused.reason
    assert "fused into its loads" in fused.reason and "applied before the store" in fused.reason
    assert groups[("cumprod",)].kind == "scan" and "a thread per column (35)" in groups[("cumprod",)].reason
    reasons = [g.reason for g in plan.groups if g.kind == "aten"]
    assert any("cumsum of torch.float16" in r and "16 bits" in r for r in reasons)
    assert any("cumsum of torch.float32 into torch.float64" in r for r in reasons)
    assert any("single row of 4096" in r and "CUB" in r for r in reasons)
    assert any(r.startswith("aten::logcumsumexp has no template") for r in reasons)
    assert "scan" in GENERATED and "scan" in COMPUTING  # checked against ATen, profiled and offered to the agents
    table = describe_graph(plan, graph, None)
    assert "| scan | mul.Tensor, add.Tensor, cumsum, relu |" in table


def test_the_lowered_program_validates_and_its_scans_compile_with_nvrtc():
    graph, plan, _ = _planned()
    lowering = Lowering(graph, plan, {})
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    program.validate()
    scans = [(g, code) for g, code in lowering.kernels if g.kind == "scan"]
    assert len(scans) == 2
    for g, code in scans:
        jit.compile(code.source, code.name)
    (_, rows), = [(g, c) for g, c in scans if g.params["dim"] == 1 and len(g.nodes) == 4]
    assert [k for _, k in rows.args][-1] == "y" and len(rows.args) == 2  # x itself, computed on load: in0, then y


# ---- on a GPU: against torch ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("rows, cols", [(2048, 4096), (256, 131072), (64, 1001), (100_000, 7)])
@pytest.mark.parametrize("kind", ["cumsum", "cumprod"])
def test_on_the_gpu_a_row_scan_is_torchs_bit_for_bit(rows, cols, kind):
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device="cuda") if kind == "cumsum" else \
        1 + 0.001 * torch.randn(rows, cols, device="cuda")
    code = scan_kernel("gpu_scan", kind, (rows, cols), -1)
    y = torch.empty_like(x)
    jit.compile(code.source, code.name)(code.grid, code.block, x, y)
    want = (torch.cumsum if kind == "cumsum" else torch.cumprod)(x, -1)
    assert bitwise(y, want), (y - want).abs().max()


@pytest.mark.gpu
def test_on_the_gpu_a_column_scan_is_torchs_bit_for_bit():
    x = torch.randn(8, 3000, 96, device="cuda")
    code = scan_kernel("gpu_col", "cumsum", tuple(x.shape), 1)
    y = torch.empty_like(x)
    jit.compile(code.source, code.name)(code.grid, code.block, x, y)
    assert bitwise(y, torch.cumsum(x, 1))


class _LongRows(torch.nn.Module):
    def forward(self, x):
        return torch.cumsum(torch.sigmoid(x) * 2, dim=-1) + 1


@pytest.mark.gpu
def test_on_the_gpu_optimize_runs_a_cumsum_model_as_one_scan_kernel_matching_eager():
    model = _LongRows().cuda().eval()
    x = torch.randn(512, 16384, device="cuda")
    fast = stitchcuda.optimize(model, (x,), compare_compile=False, keep_slower=True)
    assert fast.report.status == "optimized", str(fast.report)
    assert not fast.report.fallbacks, fast.report.fallbacks
    (scan,) = [g for g in fast.report.groups if g["kind"] == "scan"]
    assert "sigmoid" in scan["nodes"] and "add.Tensor" in scan["nodes"] and scan["kernel"].startswith("cumsum")
    for _ in range(2):
        x = torch.randn(512, 16384, device="cuda")
        with torch.no_grad():
            torch.testing.assert_close(fast(x), model(x), atol=ATOL, rtol=RTOL)
