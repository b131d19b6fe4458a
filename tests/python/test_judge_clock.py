"""The judge's clock: a candidate's claimed times are held to the time the judge itself saw its timed phase
take (less the same phase run empty before the candidate loaded). Real worker processes and the real wire on
the CPU: a candidate that rewrites the harness's timer claims 1000x less than it took and scores 0; the same
candidate without the rewrite passes with a reward above 0, and the worker the forger touched is not reused.
The jobs go to the pool as check() sends them, without check()'s source rules, which would flag a CPU-only
candidate for compiling no CUDA: here only the judge's verdict decides."""

from __future__ import annotations

import math
import textwrap

import pytest

from stitchcuda import rubric
from stitchcuda.verify import VerifyConfig, WorkerPool, jobs
from stitchcuda.verify.judge import _judge_clock
from stitchcuda.verify.report import VerifyReport
from stitchcuda.verify.task import Task

# 20 ms a call on each side (the candidate adds with numpy: no ATen operator does its work), well above the
# judge's slack, so the clock can tell a forged time from a real one.
REFERENCE = textwrap.dedent('''
    import time
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x):
            time.sleep(0.02)
            return x * 2

    def get_inputs():
        return [torch.rand(32, 8)]
''')
HONEST = textwrap.dedent('''
    import time
    import torch
    import torch.nn as nn

    class ModelNew(nn.Module):
        def forward(self, x):
            time.sleep(0.02)
            return torch.from_numpy(x.numpy() + x.numpy())
''')
# The forger does the work at the honest speed and makes the harness's perf_counter advance 1 us a read:
# every call it is timed for claims 0.001 ms.
FORGER = textwrap.dedent('''
    import sys
    import time as _time

    class _Clock:
        def __init__(self):
            self.now = 0.0

        def perf_counter(self):
            self.now += 1e-6
            return self.now

        def __getattr__(self, name):
            return getattr(_time, name)

    sys.modules["stitchcuda.verify.harness"].time = _Clock()
''') + HONEST
CONFIG = VerifyConfig(device="cpu", timing_iters=12, warmup=1, compile_time_limit_s=120,
                      run_time_limit_s=60)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(devices=["cpu"]) as p:
        yield p


def check(reference: str, candidate: str, config: VerifyConfig, pool: WorkerPool) -> VerifyReport:
    job = jobs.ModelJob(Task.from_source(reference).to_spec(), candidate, config.to_dict())
    return VerifyReport.from_dict(pool.run(job, config.compile_time_limit_s, config.run_time_limit_s))


def _reward(report, source: str) -> float:
    return rubric.reward(report, rubric.score(report, python=source))["value"]


def test_a_candidate_whose_times_disagree_with_the_judges_clock_scores_zero_and_an_honest_one_passes(pool):
    honest = check(REFERENCE, HONEST, config=CONFIG, pool=pool)
    assert honest.correct and not honest.hack, honest.feedback
    clock = honest.timing["judge_clock"]
    assert clock["calls"] == 13 and clock["timed_phase_ms"] >= 13 * 20  # the judge saw 13 sleeps of 20 ms
    assert honest.timing["candidate_ms"] >= 20 and "candidate_ms_claimed" not in honest.timing
    assert not any(f.rule == "forged-timing" for f in honest.findings)
    assert _reward(honest, HONEST) > 0

    replaced = pool.replacements
    forged = check(REFERENCE, FORGER, config=CONFIG, pool=pool)
    rules = {f.rule for f in forged.findings}
    assert "forged-timing" in rules and forged.hack, forged.feedback
    evidence = next(f.evidence for f in forged.findings if f.rule == "forged-timing")
    assert "claimed median 0.00100 ms" in evidence and "judge's clock" in evidence
    # The speed the judge uses is its own clock's, not the claim's.
    assert forged.timing["candidate_ms_claimed"] == pytest.approx(0.001)
    assert forged.timing["candidate_ms"] >= 10
    assert forged.speedup["eager"] < 5
    assert _reward(forged, FORGER) == 0
    # The forger's worker (its harness rewritten) was replaced: the next honest candidate is measured honestly.
    assert pool.replacements == replaced + 1
    again = check(REFERENCE, HONEST, config=CONFIG, pool=pool)
    assert again.correct and not again.hack and again.timing["candidate_ms"] >= 20, again.feedback


def test_the_worker_runs_the_empty_phase_before_any_candidate_code_and_brackets_the_timed_calls():
    """The calibration's messages are the harness's own only if they come before the candidate is loaded."""
    import json

    from stitchcuda.verify import harness

    events: list[str] = []
    # The candidate says when its module runs, through the same progress channel the phases use.
    spy = "import builtins\nbuiltins.__stitchcuda_test_events__.append('candidate imported')\n" + HONEST
    import builtins

    builtins.__stitchcuda_test_events__ = events  # type: ignore[attr-defined]
    try:
        job = {"reference": Task.from_source(REFERENCE).to_spec(), "candidate": spy, "baselines": "judge",
               "config": VerifyConfig(device="cpu", timing_iters=4, warmup=1).to_dict()}
        data = harness.run_job(job, events.append)
        judged = list(events)
        events.clear()
        worker_timed = harness.run_job(dict(job, baselines="worker"), events.append)
    finally:
        del builtins.__stitchcuda_test_events__  # type: ignore[attr-defined]
    assert data["correct"], json.dumps(data)[:2000]
    assert judged == ["calibrate", "calibrated", "compile", "candidate imported", "run", "timed", "timed-end"]
    assert data["timing"]["candidate_total_ms"] >= 4 * 20
    assert worker_timed["correct"] and events[:2] == ["compile", "candidate imported"]  # no calibration there


# ---- the rule itself, on clocks written by hand ---------------------------------------------------------


def _held(clock, **timing):
    report = VerifyReport(compiled=True, correct=True, timing=dict(timing))
    judged = _judge_clock(report, clock, VerifyConfig(device="cpu", timing_iters=10, warmup=0))
    return judged, {f.rule: f.evidence for f in report.findings}, report.timing.get("judge_clock")


def test_the_clock_rule_subtracts_the_empty_phase_and_refuses_each_kind_of_disagreement():
    clock = {"calibrate": [0.0], "calibrated": [0.1], "timed": [1.0], "timed-end": [2.0]}  # 1 s, 0.1 s empty
    judged, findings, seen = _held(clock, candidate_ms=80.0, candidate_total_ms=800.0)
    assert judged is None and not findings  # 80 ms a call over (1000 - 150 - 20) / 10 = 83 ms: consistent
    assert seen["per_call_floor_ms"] == pytest.approx(83.0)
    judged, findings, _ = _held(clock, candidate_ms=30.0, candidate_total_ms=300.0)
    assert judged == pytest.approx(83.0) and "forged-timing" in findings  # under half the judge's 83 ms
    judged, findings, _ = _held(clock, candidate_ms=150.0, candidate_total_ms=1500.0)
    assert judged == pytest.approx(100.0) and "1500.000 ms > 1000.000 ms" in findings["forged-timing"]
    # A forged "timed-end" sent early is overruled by the harness's later one: the window is the widest.
    judged, findings, seen = _held(dict(clock, **{"timed-end": [1.01, 2.0]}), candidate_ms=1.0)
    assert "forged-timing" in findings and seen["timed_phase_ms"] == pytest.approx(1000.0)
    judged, findings, _ = _held({"calibrate": [0.0], "calibrated": [0.1]}, candidate_ms=1.0)
    assert math.isinf(judged) and findings["forged-timing"] == "phase messages seen: calibrate, calibrated"
    assert _held(None, candidate_ms=1.0)[0] is None  # a claim with no clock to hold it to
