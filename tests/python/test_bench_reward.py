"""`stitchcuda bench reward` on the CPU (static mode): its JSON carries the throughput both ways, the
service's own overhead, both populations and their agreement; `--gpus N` runs the scaling over N
stand-in devices with the same verdicts at every count. The GPU figures come from the GPU machine."""

from __future__ import annotations

import json

import pytest

from stitchcuda import cli
from stitchcuda.bench import reward

pytestmark = pytest.mark.slow


def bench(capsys, *args: str) -> tuple[int, dict]:
    code = cli.main(["bench", "reward", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_reward_bench_measures_both_populations_through_the_service(capsys):
    code, r = bench(capsys, "--candidates", "8")
    assert code == 0 and r["mode"] == "static" and r["per_minute_per_gpu"] is None and r["target_ok"] is None
    assert r["candidates"] == r["honest"] == 8  # the target's population: honest candidates only
    assert r["mixed"]["candidates"] == 8 and 0 < r["mixed"]["honest"] < 8
    for p in (r, r["mixed"]):
        assert p["same_scores"] == 8  # static scores do not depend on the path
        assert p["alone"]["per_minute"] > 0 and p["service"]["per_minute"] > 0
        assert len(p["overhead_rounds"]) == reward.ROUNDS and p["overhead"] is not None
        assert all(x["run_s"] is not None for x in p["slowest"])
    # The service's workers cannot be busier than its wall time: its own share is not negative.
    assert min(r["overhead_rounds"]) > -0.05
    assert r["scaling"]["workers"] == 2


def test_reward_bench_scales_over_stand_in_gpus(capsys):
    code, r = bench(capsys, "--gpus", "2", "--candidates", "6")
    assert code == 0 and r["benchmark"] == "reward-gpus" and r["mode"] == "static"
    assert [x["gpus"] for x in r["runs"]] == [1, 2] and [x["candidates"] for x in r["runs"]] == [6, 12]
    assert r["runs"][0]["efficiency"] == pytest.approx(1.0) and r["runs"][1]["efficiency"] > 0
    assert r["same_verdicts"] and all(x["same_verdicts_as_one_gpu"] == x["candidates"] for x in r["runs"])
    assert "skipped" in r["disturbance"]
    assert r["queue"] and all({"t", "queued", "running"} <= set(s) for s in r["queue"])


def test_gpu_counts_double_up_to_the_asked_count():
    assert reward.gpu_counts(1) == [1]
    assert reward.gpu_counts(4) == [1, 2, 4]
    assert reward.gpu_counts(6) == [1, 2, 4, 6]
    assert reward.gpu_counts(8) == [1, 2, 4, 8]


def test_bad_counts_are_usage_errors(capsys):
    assert cli.main(["bench", "reward", "--gpus", "0"]) == 2
    assert "--gpus must be at least 1" in capsys.readouterr().err
