"""What a pool reuses across candidates of one task, and where a check's time goes: the judge's reference run
is made once per task (its baselines kept even when its outputs are let go), and every report says how
long each phase took on the caller's clock (timing["phases_s"]). Real workers on the CPU, sandboxed."""

from __future__ import annotations

import pytest

from stitchcuda.verify import VerifyConfig, WorkerPool, check
from stitchcuda.verify.judge import ReferenceCache, ReferenceRun
from stitchcuda.verify.pool import PHASE_NAMES, _phases

PROBLEM = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


def get_inputs():
    return [torch.rand(16, 64)]


def get_init_inputs():
    return []
"""
CANDIDATE = """import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        e = (x - x.max(dim=-1, keepdim=True).values).exp()
        return e / e.sum(dim=-1, keepdim=True)
"""
CONFIG = VerifyConfig(device="cpu", timing_iters=5, warmup=1)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(["cpu"]) as p:
        yield p


def test_phases_follow_the_worker_messages():
    clock = {"calibrate": [1.0, 1.0], "calibrated": [1.5, 1.5], "compile": [1.6, 1.6], "run": [2.0, 2.0],
             "timed": [3.0, 3.0], "timed-end": [3.5, 4.0]}
    got = _phases(0.25, 0.5, clock, 4.5)
    assert got["worker_start"] == pytest.approx(0.25)
    assert got["setup"] == pytest.approx(0.6)  # up to the calibration, and from its end to the load
    assert got["calibration"] == pytest.approx(0.5) and got["load"] == pytest.approx(0.4)
    assert got["trials"] == pytest.approx(1.0) and got["timed"] == pytest.approx(1.0)  # to the last timed-end
    assert got["after"] == pytest.approx(0.5) and got["receive"] >= 0
    static = _phases(None, 0.5, {}, 0.75)
    assert set(static) == {"static", "receive"} and static["static"] == pytest.approx(0.25)
    assert set(got) | set(static) <= set(PHASE_NAMES)


def test_a_task_reference_runs_once_and_every_phase_is_timed(pool):
    first = check(PROBLEM, CANDIDATE + "# 1\n", config=CONFIG, pool=pool)
    second = check(PROBLEM, CANDIDATE + "# 2\n", config=CONFIG, pool=pool)
    assert first.correct and second.correct and first.error is None
    one, two = first.timing["phases_s"], second.timing["phases_s"]
    assert {"setup", "load", "trials", "timed", "after", "receive", "reference", "judge"} <= set(one)
    assert "reference" not in two and "judge" in two  # the judge's reference run was kept for the task
    assert all(v >= 0 for v in (*one.values(), *two.values()))
    # The phases add up to no more than the check's wall time (the caller's static rules are the rest).
    assert sum(two.values()) <= second.wall_s + 0.05
    assert second.timing["eager_ms"] == first.timing["eager_ms"]


def test_outputs_let_go_are_made_again_without_timing_the_baselines_again(pool):
    pool.references = ReferenceCache(limit_bytes=0)  # no outputs kept: every check runs the reference again
    try:
        first = check(PROBLEM, CANDIDATE + "# 3\n", config=CONFIG, pool=pool)
        second = check(PROBLEM, CANDIDATE + "# 4\n", config=CONFIG, pool=pool)
    finally:
        pool.references = ReferenceCache()
    assert first.correct and second.correct
    assert "reference" in first.timing["phases_s"] and "reference" in second.timing["phases_s"]
    # The second run made the outputs only: the baseline is the first run's measurement, not a new one.
    assert second.timing["eager_ms"] == first.timing["eager_ms"] and second.speedup["eager"] > 0


def test_the_cache_keeps_facts_of_runs_too_large_to_keep():
    cache = ReferenceCache(limit_bytes=1)
    run = ReferenceRun({"judge": {"facts": {"eager_ms": 2.0}}}, {}, None)
    run.nbytes = 10
    cache.put(("task",), run)
    assert cache.get(("task",)) is None and cache.facts(("task",)) == {"eager_ms": 2.0}
    broken = ReferenceRun({"error": {"kind": "bad-reference", "message": "x"}, "judge": {"facts": {"eager_ms": 1.0}}},
                          {}, None)
    cache.put(("broken",), broken)
    assert cache.facts(("broken",)) is None  # a failed run teaches nothing


def test_the_judges_float32_pass_reads_every_chunk():
    import torch

    from stitchcuda.verify.judge import CLEAR_CHUNK, _clearly_within

    expected = torch.rand(2 * CLEAR_CHUNK + 5)
    assert _clearly_within(expected, expected.clone(), 1e-5, 1e-5)
    for where in (0, CLEAR_CHUNK, 2 * CLEAR_CHUNK + 4):  # first chunk, a chunk's first element, the short last chunk
        got = expected.clone()
        got[where] += 1e-3
        assert not _clearly_within(expected, got, 1e-5, 1e-5)
        got[where] = float("nan")
        assert not _clearly_within(expected, got, 1e-5, 1e-5)
    infinite = expected.clone()
    infinite[CLEAR_CHUNK + 1] = float("inf")  # the comparator, not this pass, decides on an infinite reference
    assert not _clearly_within(infinite, infinite.clone(), 1e-5, 1e-5)
    half = torch.rand(1000).half()
    assert _clearly_within(half, half.clone(), 1e-3, 1e-3) and not _clearly_within(half, half.float(), 1e-3, 1e-3)
    # Half the bound: an error of 0.4 of it passes here, 0.6 of it goes to the full comparator.
    bound = 1e-4 + 1e-4 * expected.abs()
    assert _clearly_within(expected, expected + 0.4 * bound, 1e-4, 1e-4)
    assert not _clearly_within(expected, expected + 0.6 * bound, 1e-4, 1e-4)


def test_the_reference_outputs_rms_is_computed_once_per_run(pool, monkeypatch):
    from stitchcuda.verify import harness

    calls = []
    real = harness.output_rms
    monkeypatch.setattr(harness, "output_rms", lambda outputs: calls.append(1) or real(outputs))
    pool.references = ReferenceCache()  # a new reference run, judged twice
    first = check(PROBLEM, CANDIDATE + "# 5\n", config=CONFIG, pool=pool)
    second = check(PROBLEM, CANDIDATE + "# 6\n", config=CONFIG, pool=pool)
    assert first.correct and second.correct
    assert len(calls) == CONFIG.trials  # once per trial for the first candidate, none for the second
