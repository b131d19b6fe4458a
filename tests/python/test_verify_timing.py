"""Pieces of the GPU timing protocol whose logic can be checked without a GPU: the CUPTI window
analysis (kernels inside/outside the timed windows, overlapping streams counted once), and the
driver-API persisting-L2 probe reporting why it is unavailable."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stitchcuda.verify import gpu
from stitchcuda.verify.harness import classify_exception
from stitchcuda.errors import CompileError


def kernel(name, start, end, stream=7):
    return SimpleNamespace(name=name, start_ns=start, end_ns=end, duration_ns=end - start, stream_id=stream)


class FakeScope:
    def __init__(self, kernels, memcpys=()):
        self.trace = SimpleNamespace(kernels=kernels, memcpys=list(memcpys), memsets=[])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def summary(self):
        raise RuntimeError("no summary in this fake")


def fake_check(kernels, monkeypatch, memcpys=()):
    monkeypatch.setattr(gpu, "_SYNC", lambda: None)
    monkeypatch.setattr(gpu.time, "sleep", lambda s: None)
    check = object.__new__(gpu.CuptiCheck)
    check.available, check.reason = True, ""
    check._trace = lambda **kw: FakeScope(kernels, memcpys)
    check._advise = lambda s: []
    check._marker = lambda *a: None
    check._flag = None
    return check


M = "stitchcuda_verify_marker"


def test_kernels_inside_windows_union_over_streams(monkeypatch):
    kernels = [kernel(M, 0, 1), kernel("a", 10, 30, 7), kernel("b", 20, 40, 9), kernel(M, 50, 51),
               kernel(M, 100, 101), kernel("a", 110, 120), kernel(M, 130, 131)]
    result = fake_check(kernels, monkeypatch).measure(lambda: None, [[]], calls=2)
    assert result["available"] and result["outside_count"] == 0
    # Window 1: [10, 40] busy = 30 ns; window 2: 10 ns; the median of two is their mean.
    assert result["kernel_ms_per_call"] == pytest.approx(20e-6)
    assert result["streams"] == [7, 9]
    assert result["kernels"][0]["name"] == "a" and result["kernels"][0]["calls"] == 2


def test_copies_count_as_gpu_work_but_not_as_kernel_time(monkeypatch):
    kernels = [kernel(M, 0, 1), kernel("a", 10, 20), kernel(M, 50, 51)]
    copies = [SimpleNamespace(start_ns=15, end_ns=40, duration_ns=25, stream_id=7)]  # overlaps "a"
    result = fake_check(kernels, monkeypatch, copies).measure(lambda: None, [[]], calls=1)
    assert result["kernel_ms_per_call"] == pytest.approx(10e-6)
    assert result["gpu_ms_per_call"] == pytest.approx(30e-6)  # [10, 40], the overlap counted once


def test_kernels_outside_windows_are_reported(monkeypatch):
    kernels = [kernel(M, 0, 1), kernel("a", 10, 30), kernel(M, 50, 51), kernel("late", 60, 90, 3),
               kernel(M, 100, 101), kernel("a", 110, 120), kernel(M, 130, 131), kernel("late", 140, 200, 3)]
    result = fake_check(kernels, monkeypatch).measure(lambda: None, [[]], calls=2)
    assert result["outside_count"] == 2
    assert result["outside_window"][0]["name"] == "late" and result["outside_window"][0]["stream_id"] == 3


def test_missing_markers_make_the_check_unavailable(monkeypatch):
    result = fake_check([kernel("a", 0, 1)], monkeypatch).measure(lambda: None, [[]], calls=2)
    assert not result["available"] and "marker" in result["reason"]


def test_persisting_l2_probe_without_a_driver():
    probe = gpu.PersistingL2()
    if probe.available:
        pytest.skip("a CUDA driver is installed here")
    assert "driver API unavailable" in probe.reason
    assert probe.state() == {"limit_bytes": -1, "window_bytes": -1}
    probe.reset()  # a no-op, not an error


@pytest.mark.parametrize("exc, kind", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), "illegal-address"),
    (RuntimeError("CUDA error: device-side assert triggered"), "device-assert"),
    # PyTorch's hint about device-side assertions follows every CUDA error; the fault decides the kind.
    (RuntimeError("CUDA error: an illegal memory access was encountered\nCompile with `TORCH_USE_CUDA_DSA` "
                  "to enable device-side assertions."), "illegal-address"),
    (RuntimeError("CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable "
                  "device-side assertions."), "device-assert"),
    (RuntimeError("CUDA out of memory. Tried to allocate 4.00 PiB"), "oom"),
    (MemoryError(), "oom"),
    (CompileError("nvrtc failed"), "compile"),
    (RuntimeError("Error building extension 'fused'"), "compile"),
    (ValueError("shapes do not match"), "runtime"),
])
def test_exception_kinds(exc, kind):
    assert classify_exception(exc) == kind


def native_kernel(name, start, end, stream=7):
    import stitchcuda.profile as prof

    k = prof.KernelRecord()
    k.name, k.mangled_name, k.start_ns, k.end_ns, k.stream_id = name, name, start, end, stream
    return k


def real_advice_check(kernels, monkeypatch):
    import stitchcuda.profile as prof

    check = fake_check(kernels, monkeypatch)
    check._advise, check._new_trace = prof.advise, prof.Trace
    return check


def test_advice_is_about_one_call_not_the_markers_and_syncs_between_calls(monkeypatch):
    # One kernel per call, calls far apart (the syncs): no launch-gap advice for a single-kernel candidate.
    kernels = []
    for i in range(10):
        t = i * 1_000_000
        kernels += [native_kernel(M, t, t + 1_000), native_kernel("add_relu", t + 20_000, t + 80_000),
                    native_kernel(M, t + 100_000, t + 101_000)]
    result = real_advice_check(kernels, monkeypatch).measure(lambda: None, [[]], calls=10)
    assert result["summary"]["kernel_launches"] == 1, result["summary"]
    assert not any("gaps between" in a for a in result["advice"]), result["advice"]
    # Two kernels with a long host gap between them inside each call: that gap is the candidate's own.
    kernels = []
    for i in range(10):
        t = i * 1_000_000
        kernels += [native_kernel(M, t, t + 1_000), native_kernel("scale", t + 20_000, t + 22_000),
                    native_kernel("shift", t + 80_000, t + 82_000), native_kernel(M, t + 100_000, t + 101_000)]
    result = real_advice_check(kernels, monkeypatch).measure(lambda: None, [[]], calls=10)
    assert result["summary"]["kernel_launches"] == 2
    assert result["advice"] and "gaps between 2 launches" in result["advice"][0], result["advice"]


def scripted_timer(monkeypatch, calls):
    """Replaces the event functions of gpu.py: each timed call's stream and end events land at the
    (stream_ms, end_ms) given for it, after a start at 0."""
    script = iter(calls)
    state = {}

    class Event:
        def __init__(self, enable_timing=True):
            self.at = None

    def record(event):
        order = state.setdefault("order", [])
        order.append(event)
        if len(order) == 3:  # start, stream, end of one call
            stream_ms, end_ms = next(script)
            order[0].at, order[1].at, order[2].at = 0.0, stream_ms, end_ms
            state["order"] = []

    monkeypatch.setattr(gpu, "_EVENT", Event)
    monkeypatch.setattr(gpu, "_RECORD", record)
    monkeypatch.setattr(gpu, "_ELAPSED", lambda a, b: b.at - a.at)
    monkeypatch.setattr(gpu, "_SYNC", lambda: None)
    monkeypatch.setattr(gpu, "_EVENT_SYNC", lambda e: None)


def test_a_call_is_charged_its_stream_time_unless_work_outlived_the_stream(monkeypatch):
    # Sync round trips measured at 12 us typically, 20 us at most.
    sync = gpu.SyncLatency(typical_ms=0.012, high_ms=0.020)
    calls = [(0.150, 0.162),   # a typical sync: the stream's time
             (0.150, 0.169),   # a slow sync, still within what bare syncs took: the stream's time
             (0.150, 0.400)]   # the end came 0.25 ms after the stream: work elsewhere, charged
    scripted_timer(monkeypatch, calls)
    flush, persisting = (lambda: None), SimpleNamespace(reset=lambda: None)
    times, _ = gpu.time_calls(lambda: None, [()], iters=3, warmup=0, flush=flush, persisting=persisting, sync=sync)
    assert times == pytest.approx([0.150, 0.150, 0.388])
