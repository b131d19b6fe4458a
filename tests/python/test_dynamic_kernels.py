"""Kernels that take their outermost extent (a batch that varies) as a launch argument: the pointwise, row
reduction and layout templates write the same source at every size of it, and KernelCode.at() computes the
argument and the grid for another size — one compiled kernel serving two sizes, run through the CUDA
emulator against torch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, EmulatedModule, unavailable  # noqa: E402

from stitchcuda.graph.templates import (PointwiseInput, RowPrologue, column_reduction_kernel,  # noqa: E402
                                        depthwise_conv_kernel, depthwise_conv_nhwc_kernel, nchw_to_nhwc_kernel,
                                        pointwise_kernel, pooling_kernel, pooling_nhwc_kernel, row_reduction_kernel)

emulated = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("emulated"))


def _launch(emu, code, tensors: dict) -> None:
    kernel = EmulatedModule(emu, "\n".join(
        line for line in code.source.splitlines() if "__half" not in line and "__nv_bfloat16" not in line
        and "#include <cuda_" not in line)).kernel(code.name)
    args = [tensors[key] if kind in ("in", "out") else key for kind, key in code.args]
    kernel(code.grid, code.block, *args, shared_mem=code.shared_mem)


def _gelu_bias(shape, bias_strides, sm_count=132):
    """x * sigmoid(1.702 x) + b over `shape`, b broadcast with `bias_strides`."""
    inputs = [PointwiseInput("x", torch.float32, tuple(torch.empty(shape).stride())),
              PointwiseInput("b", torch.float32, bias_strides)]
    body = ["const float t0 = in0 / (1.0f + expf(-1.702f * in0)) + in1;"]
    return pointwise_kernel("k", shape, inputs, body, [("y", "t0", torch.float32)], sm_count)


@pytest.mark.parametrize("inner, bias", [((64,), (0, 1)), ((3, 40), (0, 0, 1)), ((5, 6), (0, 1, 0)), ((64,), (64, 1))],
                         ids=["rows-broadcast-four-wide", "3d-last-broadcast", "middle-broadcast-strided",
                              "contiguous-vectorized-one-pass"])
def test_a_pointwise_source_is_the_same_at_every_batch(inner, bias):
    a, b = _gelu_bias((6, *inner), bias, 2), _gelu_bias((23, *inner), bias, 2)
    assert a.source == b.source  # the batch is nowhere in the source: one NVRTC compile serves both
    moved = a.at(b.extent.value)
    assert (moved.grid, moved.args) == (b.grid, b.args)  # the grid is computed from the size as the template does


@emulated
def test_a_grid_stride_kernel_keeps_its_capped_grid_at_any_batch(stitch_settings, emu):
    # The grid-stride form: at most 16 blocks per SM, the loop covers the rest (sm_count=1: 16 blocks).
    stitch_settings(STITCHCUDA_POINTWISE_LOOP="stride")
    small, large = _gelu_bias((4, 64), (64, 1), sm_count=1), _gelu_bias((2000, 64), (64, 1), sm_count=1)
    assert small.source == large.source and "v + stride < n4" in small.source
    assert (small.grid, small.at(2000 * 64).grid) == (1, 16) == (small.grid, large.grid)
    x, b = torch.randn(1500, 64), torch.randn(1500, 64)
    y = torch.full_like(x, float("nan"))
    _launch(emu, small.at(x.numel()), {"x": x, "b": b, "y": y})
    torch.testing.assert_close(y, x * torch.sigmoid(1.702 * x) + b, atol=1e-5, rtol=1e-5)


@emulated
def test_one_pointwise_kernel_serves_two_batches(emu):
    code = _gelu_bias((4, 3, 40), (0, 0, 1))
    for batch in (4, 7):
        x, bias = torch.randn(batch, 3, 40), torch.randn(40)
        y = torch.full_like(x, float("nan"))
        _launch(emu, code.at(x.numel()), {"x": x, "b": bias, "y": y})
        torch.testing.assert_close(y, x * torch.sigmoid(1.702 * x) + bias, atol=1e-5, rtol=1e-5)


def test_a_pointwise_kernel_refuses_sizes_its_source_was_not_written_for():
    code = _gelu_bias((6, 3, 40), (0, 0, 1))
    with pytest.raises(ValueError, match="multiples of 120"):  # a batch of 3 x 40 elements at a time
        code.at(7 * 120 + 4)
    # An outermost extent of 1 leaves its coordinate out of every index: that source serves 1 alone.
    single = _gelu_bias((1, 3, 40), (0, 0, 1))
    assert single.extent is None
    with pytest.raises(ValueError, match="generate it for the new size"):
        single.at(240)


@pytest.mark.parametrize("kind, cols", [("softmax", 100), ("layer_norm", 512), ("log_softmax", 3001)],
                         ids=["warp-per-row", "row-in-registers", "block-per-row"])
def test_a_row_reduction_source_is_the_same_at_every_row_count(kind, cols):
    ln = kind == "layer_norm"
    a, b = (row_reduction_kernel("r", kind, rows, cols, torch.float32, has_weight=ln, has_bias=ln)
            for rows in (8, 37))
    assert a.source == b.source
    assert (a.at(37).grid, a.at(37).args) == (b.grid, b.args)


@emulated
@pytest.mark.parametrize("cols", [100, 512], ids=["warp-per-row", "row-in-registers"])
def test_one_row_kernel_serves_two_row_counts(emu, cols):
    code = row_reduction_kernel("r", "layer_norm", 8, cols, torch.float32, has_weight=True, has_bias=True)
    w, bias = torch.randn(cols), torch.randn(cols)
    for rows in (8, 13):
        x = torch.randn(rows, cols) * 2 + 1
        y = torch.full_like(x, float("nan"))
        launch = code.at(rows)
        fresh = row_reduction_kernel("r", "layer_norm", rows, cols, torch.float32, has_weight=True, has_bias=True)
        assert (launch.source, launch.grid, launch.args) == (fresh.source, fresh.grid, fresh.args)
        _launch(emu, launch, {"x": x, "weight": w, "bias": bias, "y": y})
        torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (cols,), w, bias, 1e-5), atol=1e-4, rtol=1e-4)


@emulated
def test_a_row_kernel_with_a_broadcast_prologue_serves_whole_batches(emu):
    # softmax(x + m) over rows of [batch, 3, 64], m broadcast over the batch: the prologue's coordinates
    # below the batch are in the source, so the rows come in multiples of 3.
    prologue = RowPrologue((2, 3, 64), [PointwiseInput("in0", torch.float32, (192, 64, 1)),
                                        PointwiseInput("in1", torch.float32, (0, 64, 1))],
                           ["const float t0 = in0 + in1;"], "t0")
    code = row_reduction_kernel("r", "softmax", 6, 64, torch.float32, prologue=prologue)
    with pytest.raises(ValueError, match="multiples of 3"):
        code.at(10)
    m = torch.randn(3, 64)
    for batch in (2, 5):
        x = torch.randn(batch, 3, 64)
        y = torch.full_like(x, float("nan"))
        _launch(emu, code.at(3 * batch), {"in0": x, "in1": m, "y": y})
        torch.testing.assert_close(y, torch.softmax(x + m, -1), atol=1e-5, rtol=1e-5)


@emulated
def test_one_layout_conversion_serves_any_number_of_images(emu):
    code = nchw_to_nhwc_kernel("t", (2, 5, 3, 7), torch.float32)
    assert code.source == nchw_to_nhwc_kernel("t", (9, 5, 3, 7), torch.float32).source
    x = torch.randn(4, 5, 3, 7)
    y = torch.full((4, 3, 7, 5), float("nan"))
    launch = code.at(4)
    assert launch.grid == (code.grid[0], code.grid[1], 4)
    _launch(emu, launch, {"in0": x, "out0": y})
    torch.testing.assert_close(y, x.permute(0, 2, 3, 1))


@pytest.mark.parametrize("kind", ["sum", "argmax"])
def test_a_column_reduction_source_is_the_same_at_every_outer_extent(kind):
    a, b = (column_reduction_kernel("c", kind, outer, 24, 40, torch.float32) for outer in (3, 10))
    assert a.source == b.source and (a.at(10).grid, a.at(10).args) == (b.grid, b.args)


@emulated
def test_one_column_reduction_serves_two_batches(emu):
    # A mean over a sequence of [batch, 24, 40], the outer extent the grid's second dimension.
    code = column_reduction_kernel("c", "mean", 3, 24, 40, torch.float32)
    for batch in (3, 6):
        x = torch.randn(batch, 24, 40)
        y = torch.full((batch, 40), float("nan"))
        _launch(emu, code.at(batch), {"x": x, "y": y})
        torch.testing.assert_close(y, x.mean(1), atol=1e-5, rtol=1e-5)


IMAGE_KERNELS = {
    "max-pool": lambda n: pooling_kernel("p", "max", (n, 3, 12, 16), (2, 2), (2, 2), (0, 0)),
    "avg-pool-clipped": lambda n: pooling_kernel("p", "avg", (n, 3, 9, 11), (3, 3), (2, 2), (1, 1),
                                                 count_include_pad=False),
    "max-pool-nhwc": lambda n: pooling_nhwc_kernel("p", "max", (n, 8, 12, 12), (3, 3), (1, 1), (1, 1)),
    "depthwise": lambda n: depthwise_conv_kernel("d", (n, 4, 10, 12), (3, 3), (1, 1), (1, 1), (1, 1), torch.float32),
    "depthwise-strided": lambda n: depthwise_conv_kernel("d", (n, 4, 11, 9), (3, 3), (2, 2), (1, 1), (1, 1),
                                                         torch.float32),
    "depthwise-nhwc": lambda n: depthwise_conv_nhwc_kernel("d", (n, 8, 10, 10), (3, 3), (1, 1), (1, 1), (1, 1)),
}


@pytest.mark.parametrize("kind", list(IMAGE_KERNELS))
def test_pooling_and_depthwise_sources_are_the_same_at_every_batch(kind):
    a, b = IMAGE_KERNELS[kind](2), IMAGE_KERNELS[kind](7)
    assert a.source == b.source
    moved = a.at(b.extent.value)
    assert (moved.grid, moved.args) == (b.grid, b.args)


@emulated
@pytest.mark.parametrize("kind", ["max-pool", "avg-pool-clipped", "depthwise-strided"])
def test_one_pooling_or_depthwise_kernel_serves_two_batches(emu, kind):
    torch.manual_seed(5)
    code = IMAGE_KERNELS[kind](2)
    for batch in (2, 5):
        fresh = IMAGE_KERNELS[kind](batch)
        if kind.startswith("depthwise"):
            x, weight = torch.randn(batch, 4, 11, 9), torch.randn(4, 1, 3, 3)
            want = torch.nn.functional.conv2d(x, weight, None, (2, 2), (1, 1), (1, 1), 4)
            tensors = {"x": x, "weight": weight}
        else:
            x = torch.randn(batch, 3, 12, 16) if kind == "max-pool" else torch.randn(batch, 3, 9, 11)
            want = (torch.nn.functional.max_pool2d(x, 2, 2) if kind == "max-pool" else
                    torch.nn.functional.avg_pool2d(x, 3, 2, 1, count_include_pad=False))
            tensors = {"x": x}
        y = torch.full_like(want, float("nan"))
        _launch(emu, code.at(fresh.extent.value), {**tensors, "y": y})
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
