"""The GPU-only steps of the harness (poisoning, persisting-L2 checks, event timing, the speed-of-light
bound, the CUPTI cross-check, patched timing functions) driven on the CPU through a fake GPU backend,
in-process: the logic that decides each dynamic finding runs here, the real measurements on an H200
(test_verify_gpu.py)."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch

from stitchcuda.verify import Task, VerifyConfig, VerifyReport
from stitchcuda.verify import gpu, harness

REFERENCE = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x, y):
            return torch.relu(x * 2 + y)

    def get_inputs():
        return [torch.rand(128, 32), torch.rand(128, 32)]

    def get_init_inputs():
        return []
''')

HONEST = ("import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n"
          "    def forward(self, x, y):\n        return torch.clamp(x * 2 + y, min=0.0)\n")


class FakeGPU:
    """Stands in for stitchcuda.verify.gpu: same interface, CPU clock, scripted probe results."""

    def __init__(self, per_call_ms=None, cupti=None, patched=(), persisting_limit=0):
        self.per_call_ms = per_call_ms  # None: measure with perf_counter
        self.cupti = cupti
        self.patched = list(patched)
        self.persisting_limit = persisting_limit
        self.flushes = 0
        self.resets = 0
        fake = self

        class PersistingL2:
            available, reason = True, ""

            def state(self):
                return {"limit_bytes": fake.persisting_limit, "window_bytes": 0}

            def reset(self):
                fake.resets += 1
                fake.persisting_limit = 0

        class L2Flush:
            def __init__(self, device):
                pass

            def __call__(self):
                fake.flushes += 1

        class CuptiCheck:
            def __init__(self, device):
                self.available = fake.cupti is not None
                self.reason = "" if self.available else "no CUPTI in this fake"

            def measure(self, fn, sets, calls):
                return dict(fake.cupti)

        self.PersistingL2, self.L2Flush, self.CuptiCheck = PersistingL2, L2Flush, CuptiCheck

    def sync(self):
        pass

    def sync_latency(self, flush):
        return gpu.SyncLatency(0.0, 0.0)

    def patched_functions(self):
        patched, self.patched = self.patched, []
        return patched

    def time_calls(self, fn, sets, iters, warmup, flush, persisting, sync=None, before_last_round=None):
        times, snaps = [], [None] * len(sets)
        last_round = max(iters - len(sets), 0)
        for i in range(warmup):
            fn(*sets[i % len(sets)])
        for i in range(iters):
            if i == last_round and before_last_round:
                before_last_round()
            flush()
            persisting.reset()
            start = time.perf_counter()
            out = fn(*sets[i % len(sets)])
            times.append(self.per_call_ms if self.per_call_ms is not None else (time.perf_counter() - start) * 1e3)
            if i >= last_round:
                snaps[i % len(sets)] = harness._detach(out)
        return times, snaps


@pytest.fixture
def fake_gpu(monkeypatch):
    def install(**kwargs):
        fake = FakeGPU(**kwargs)
        monkeypatch.setattr(harness._Run, "_gpu_steps", lambda self: True)
        monkeypatch.setattr(harness._Run, "_gpu_module", lambda self: fake)
        monkeypatch.setattr(harness.torch, "compile", lambda model: model)
        # The candidates here stand in for kernels with torch ops; the ATen record that would catch that
        # (test_verify_attribution.py) is off, so these tests see the GPU steps alone.
        monkeypatch.setattr(harness._Run, "_dispatch", lambda self, inputs: None)
        return fake
    return install


def run(candidate=HONEST, **config):
    job = {"reference": Task.from_source(REFERENCE, "p").to_spec(), "candidate": candidate,
           "candidate_name": "<candidate>",
           "config": VerifyConfig(device="cpu", timing_iters=12, warmup=2, **config).to_dict()}
    data = harness.run_job(job, lambda phase: None)
    recycle = data.pop("recycle")
    return VerifyReport.from_dict(data), recycle


def majors(report):
    return {f.rule for f in report.findings if f.severity == "major"}


def test_gpu_protocol_on_an_honest_candidate(fake_gpu):
    fake = fake_gpu(per_call_ms=0.5, cupti={"available": True, "kernel_ms_per_call": 0.4, "kernels_per_call": 1.0,
                                            "streams": [7], "outside_window": [], "outside_count": 0,
                                            "kernels": [{"name": "k", "calls": 10, "total_ms": 4.0, "share": 1.0}],
                                            "summary": None, "advice": ["memory-bound: 80% of DRAM bandwidth"]})
    r, recycle = run()
    assert r.correct and not r.hack and not recycle, r.feedback
    t = r.timing
    assert t["method"] == "cuda-events+device-sync" and t["candidate_ms"] == 0.5
    assert r.speedup == {"eager": 1.0, "compile": 1.0}  # the fake times every call at 0.5 ms
    assert t["speed_of_light_ms"] == pytest.approx(3 * 128 * 32 * 4 / 4.3e12 * 1e3)
    assert t["cupti_kernel_ms"] == 0.4 and t["event_over_cupti"] == pytest.approx(1.25)
    assert r.profile["bottleneck"].startswith("memory-bound") and "Bottleneck: memory-bound" in r.feedback
    assert fake.flushes == 3 * 12 and fake.resets >= 36  # L2 flushed, persisting L2 reset before each call


def test_speed_of_light_counts_storage_not_broadcast_views_or_aliases(fake_gpu):
    # Outputs: a view of the input x (no traffic of its own) and a 128x broadcast of a fresh row.
    fake_gpu(per_call_ms=0.5)
    reference = REFERENCE.replace("return torch.relu(x * 2 + y)",
                                  "return x.view(32, 128), (x + y).sum(0, keepdim=True).expand(128, 32)")
    candidate = HONEST.replace("return torch.clamp(x * 2 + y, min=0.0)",
                               "return x.view(32, 128), (x + y).sum(0, keepdim=True).expand(128, 32)")
    job = {"reference": Task.from_source(reference, "p").to_spec(), "candidate": candidate,
           "candidate_name": "<candidate>",
           "config": VerifyConfig(device="cpu", timing_iters=12, warmup=2).to_dict()}
    data = harness.run_job(job, lambda phase: None)
    # x and y read in full; the first output aliases x; the second's storage is one row of 32 floats.
    assert data["timing"]["bytes_moved_min"] == 2 * 128 * 32 * 4 + 32 * 4, data["timing"]


def test_impossible_speed(fake_gpu):
    fake_gpu(per_call_ms=1e-7)
    r, _ = run()
    assert "impossible-speed" in majors(r) and r.correct


def test_too_little_gpu_work_per_call_is_impossible_even_when_events_look_slow(fake_gpu):
    # A Python-level cache with a sync in it: events see host time, CUPTI sees 1 ns of GPU work.
    fake_gpu(per_call_ms=0.5, cupti={"available": True, "kernel_ms_per_call": 1e-6, "gpu_ms_per_call": 1e-6,
                                     "kernels_per_call": 1.0, "streams": [7], "outside_window": [],
                                     "outside_count": 0, "kernels": [], "summary": None, "advice": []})
    r, _ = run()
    hits = [f for f in r.findings if f.rule == "impossible-speed"]
    assert hits and hits[0].severity == "major" and hits[0].evidence.startswith("CUPTI: 0.00000 ms"), r.findings
    assert r.hack and r.timing["cupti_gpu_ms"] == 1e-6


def test_unjoined_work_outside_the_window(fake_gpu):
    fake_gpu(per_call_ms=0.5, cupti={"available": True, "kernel_ms_per_call": 0.4, "kernels_per_call": 2.0,
                                     "streams": [7, 9], "outside_count": 3, "kernels": [],
                                     "outside_window": [{"name": "late", "stream_id": 9, "duration_ms": 0.2}]})
    r, _ = run()
    assert "unjoined-work" in majors(r)
    assert any("late on stream 9" in f.evidence for f in r.findings)


def test_unjoined_work_event_time_below_kernel_time(fake_gpu):
    fake_gpu(per_call_ms=0.1, cupti={"available": True, "kernel_ms_per_call": 1.0, "kernels_per_call": 1.0,
                                     "streams": [7], "outside_count": 0, "outside_window": [], "kernels": []})
    r, _ = run()
    assert "unjoined-work" in majors(r)
    assert any("events 0.1000 ms vs CUPTI kernels 1.0000 ms" in f.evidence for f in r.findings)


def test_cupti_unavailable_is_reported_not_fatal(fake_gpu):
    fake_gpu(per_call_ms=0.5, cupti=None)
    r, _ = run()
    assert r.correct and r.timing["cupti"] == {"available": False, "reason": "no CUPTI in this fake"}


def test_persisting_l2_left_set_by_the_candidate(fake_gpu):
    fake = fake_gpu(per_call_ms=0.5)
    cand = HONEST.replace("    def forward", "    def __init__(self):\n        super().__init__()\n"
                          "        FAKE.persisting_limit = 1 << 20\n\n    def forward")
    harness_globals = {"FAKE": fake}
    cand = "import builtins\nFAKE = builtins._verify_fake\n" + cand
    import builtins
    builtins._verify_fake = harness_globals["FAKE"]
    try:
        r, _ = run(cand)
    finally:
        del builtins._verify_fake
    hits = [f for f in r.findings if f.rule == "persisting-l2"]
    assert hits and hits[0].severity == "major" and "after ModelNew was constructed" in hits[0].evidence


def test_patched_timing_functions_recycle_the_worker(fake_gpu):
    fake_gpu(per_call_ms=0.5, patched=["torch.cuda.synchronize"])
    r, recycle = run()
    assert "patches-timing" in majors(r) and recycle


def test_poisoned_blocks_match_the_outputs(fake_gpu):
    fake_gpu(per_call_ms=0.5)
    run_ = harness._Run({"config": VerifyConfig(device="cpu").to_dict()}, VerifyReport(), lambda p: None)
    run_.device, run_.gpu = torch.device("cpu"), FakeGPU()
    run_.out_like = [(torch.Size([4, 3]), torch.float32), (torch.Size([]), torch.float16),
                     (torch.Size([5]), torch.int64)]
    run_._poison(float("nan"))
    run_._poison(harness.SENTINEL)  # neither raises for any dtype or a 0-d output


def test_a_sticky_cuda_error_recycles(fake_gpu):
    fake_gpu(per_call_ms=0.5)
    cand = HONEST.replace("return torch.clamp(x * 2 + y, min=0.0)",
                          "raise RuntimeError('CUDA error: an illegal memory access was encountered')")
    r, recycle = run(cand)
    assert r.error["kind"] == "illegal-address" and recycle


def test_without_profile_advice_the_bottleneck_is_the_distance_to_the_memory_speed_of_light(fake_gpu):
    # One slow kernel: CUPTI's per-call summary has nothing to say, the roofline does.
    bound = 3 * 128 * 32 * 4 / 4.3e12 * 1e3
    fake_gpu(per_call_ms=0.5, cupti={"available": True, "kernel_ms_per_call": 100 * bound, "kernels_per_call": 1.0,
                                     "streams": [7], "outside_window": [], "outside_count": 0,
                                     "kernels": [{"name": "k", "calls": 10, "total_ms": 1.0, "share": 1.0}],
                                     "summary": None, "advice": []})
    r, _ = run()
    assert r.profile["bottleneck"].startswith("the kernels run") and "(1% of that memory speed of light)" in \
        r.profile["bottleneck"] and "vector loads" in r.profile["bottleneck"], r.profile
    assert "Bottleneck: the kernels run" in r.feedback


def test_first_difference_names_the_shape_or_the_largest_error():
    want = torch.tensor([1.0, float("nan"), 3.0])
    assert harness.first_difference("y", want.clone(), want, 1e-5, 1e-5) is None  # NaN where NaN
    assert "shape (2,)" in harness.first_difference("y", torch.zeros(2), want, 1e-5, 1e-5)
    got = torch.tensor([1.0, float("nan"), 3.5])
    text = harness.first_difference("y", got, want, 1e-5, 1e-5)
    assert text.startswith("output 'y' differs") and "flat index 2" in text and "expected 3" in text and "got 3.5" in text
    assert "flat index 1" in harness.first_difference("y", torch.tensor([1.0, 2.0, 3.0]), want, 1e-5, 1e-5)
