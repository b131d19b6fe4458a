"""optimize(..., dynamic=) on a GPU: one module serves every size in the range with programs (padded to a
member where rows are independent, exactly where they are not), matches the model at each size, and says
in the log when a call is outside the range."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.export import Dim

import stitchcuda

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Block(torch.nn.Module):
    """Rows independent along the batch: LayerNorm, a GELU MLP, a residual."""

    def __init__(self, width=256):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class BatchCentered(torch.nn.Module):
    """Reads the whole batch (a mean over it): a zero-padded row would change every answer."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        y = torch.relu(self.lin(x))
        return y - y.mean(0, keepdim=True)


class SeqSoftmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x * 0.5, dim=1) * 2.0


def _sizes_match(fast, model, shape_of, sizes, atol=1e-4, rtol=1e-4):
    for s in sizes:
        x = torch.randn(*shape_of(s), device="cuda")
        torch.testing.assert_close(fast(x), model(x), atol=atol, rtol=rtol, msg=lambda m: f"size {s}: {m}")


def test_batch_family_pads_and_matches_at_every_size(caplog):
    torch.manual_seed(0)
    model = Block().cuda().eval()
    x = torch.randn(48, 64, 256, device="cuda")
    fast = stitchcuda.optimize(model, (x,), dynamic="auto", compare_compile=False, keep_slower=True)
    dyn = fast.report.dynamic
    assert "refused" not in dyn, dyn.get("refused")
    assert all(r["passed"] for r in dyn["range_check"]) and {r["sizes"]["batch"] for r in dyn["range_check"]} >= {1, 47, 96}
    assert any(r["padded"] for r in dyn["range_check"])  # 47 runs on the example's member, padded
    built = fast.member_builds
    _sizes_match(fast, model, lambda s: (s, 64, 256), [1, 5, 24, 47, 48, 77, 96])
    assert fast.other_shape_calls == 0 and fast.padded_calls > 0
    # The range check built only the maximum (its other sizes ran padded on the example's member); the
    # calls build buckets, not sizes: 1, 5 -> 8, 24 -> 32; 77 runs on 96.
    assert fast.member_builds - built <= 3
    with caplog.at_level(logging.WARNING, logger="stitchcuda"):
        big = torch.randn(97, 64, 256, device="cuda")
        torch.testing.assert_close(fast(big), model(big), atol=1e-4, rtol=1e-4)
    assert fast.other_shape_calls == 1
    assert any("'batch' is 97, outside the 1..96" in r.getMessage() for r in caplog.records)


def test_members_reuse_the_examples_choices_and_kernels_and_say_where_the_time_went():
    torch.manual_seed(4)
    model = Block(128).cuda().eval()
    x = torch.randn(12, 32, 128, device="cuda")
    fast = stitchcuda.optimize(model, (x,), dynamic="auto", compare_compile=False, keep_slower=True)
    dyn = fast.report.dynamic
    assert "refused" not in dyn, dyn.get("refused")
    (top,) = [m for m in fast._members.values() if m.sizes == (24,)]  # the range's maximum, built by the check
    replay = [d for d in top.module.report.decisions if d[0].startswith(("replay as", "launch the steps"))]
    assert replay and replay[0][1].startswith("as the example's program")  # one runner built, none timed
    example = {k["source"] for k in fast.program.kernels}
    assert {k["source"] for k in top.module.program.kernels} <= example  # no kernel compiled for the member
    assert dyn["members_captured"] == "specialized from one symbolic export"  # no second trace of the model
    wall = dyn["wall_s"]
    assert wall["members_built"] == 1 and wall["members"] > 0 and wall["verify"] > 0
    assert set(wall["member_stages"]) >= {"capture", "generate_and_check", "build", "verify", "measure"}
    # Every member is still verified and timed against eager at its own size.
    assert top.module.report.verification["passed"] and top.module.report.timing["eager_ms"] > 0


def test_the_family_saved_serves_its_sizes_from_the_file(tmp_path):
    torch.manual_seed(2)
    model = Block(128).cuda().eval()
    x = torch.randn(16, 32, 128, device="cuda")
    fast = stitchcuda.optimize(model, (x,), dynamic={"x": {0: Dim("batch", min=1, max=32)}}, compare_compile=False,
                               keep_slower=True)
    fast(torch.randn(3, 32, 128, device="cuda"))  # builds the bucket of 4: the file holds every member built
    path = tmp_path / "block.stitch"
    fast.save(path)
    loaded = stitchcuda.load(path)
    for s in (1, 3, 11, 16, 32):
        xs = torch.randn(s, 32, 128, device="cuda")
        got = loaded(xs)
        got = got[0] if isinstance(got, (list, tuple)) else got
        torch.testing.assert_close(got, model(xs), atol=1e-4, rtol=1e-4, msg=lambda m: f"size {s}: {m}")


def test_a_dim_padding_would_change_is_built_exactly():
    torch.manual_seed(1)
    model = BatchCentered().cuda().eval()
    x = torch.randn(16, 64, device="cuda")
    fast = stitchcuda.optimize(model, (x,), dynamic={"x": {0: Dim("batch", min=1, max=32)}}, compare_compile=False,
                               keep_slower=True)
    dims = fast.report.dynamic["dims"]
    assert not dims[0]["pad"] and "differs from the model" in dims[0]["why_exact"]
    assert all(r["passed"] for r in fast.report.dynamic["range_check"])
    _sizes_match(fast, model, lambda s: (s, 64), [3, 16, 31])


def test_a_sequence_dim_with_its_own_range():
    model = SeqSoftmax().cuda().eval()
    x = torch.randn(4, 100, 32, device="cuda")
    fast = stitchcuda.optimize(model, (x,), dynamic=[{1: Dim("seq", min=8, max=128)}], compare_compile=False,
                               keep_slower=True)
    assert "refused" not in fast.report.dynamic, fast.report.dynamic.get("refused")
    assert not fast.report.dynamic["dims"][0]["pad"]  # the softmax reads the whole sequence
    _sizes_match(fast, model, lambda s: (4, s, 32), [8, 61, 100, 128])


def test_torch_compile_backend_serves_a_second_batch_size_with_a_family():
    from stitchcuda.graph import dynamo

    dynamo.register()
    torch.manual_seed(3)
    model = Block(128).cuda().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stitchcuda")
    with torch.no_grad():
        for s in (8, 5, 13, 40):  # the second size makes Dynamo hand over a graph with a symbolic batch
            x = torch.randn(s, 16, 128, device="cuda")
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4, msg=lambda m: f"size {s}: {m}")
    report = dynamo.reports[-1]
    assert report.status == "optimized" and "refused" not in report.dynamic, (report.reason, report.dynamic)
    (dim,) = report.dynamic["dims"]
    assert dim["min"] == 2 and dim["max"] >= 40
