"""`stitchcuda bench reward` on the CPU (static mode): its JSON carries the throughput on every path (the
Verifier alone, without its sandbox, through the service), the service's overhead and the sandbox's cost
as ratios of the same run, where the time went, both populations and their agreement; a deadline ends it
with what was measured; `--gpus N` runs the scaling over N stand-in devices with the same verdicts at every
count. The GPU figures come from the GPU machine."""

from __future__ import annotations

import json
import time

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
    assert r["stopped_at_deadline"] is False and r["deadline_s"] == reward.DEFAULT_DEADLINE_S
    for p in (r, r["mixed"]):
        assert p["done"] == 8 and p["rounds"] == reward.ROUNDS
        assert p["same_scores"] == 8  # static scores depend on neither the path nor the sandbox
        for path in reward.PATHS:
            assert p[path]["done"] == 8 and p[path]["per_minute"] > 0
        assert len(p["overhead_rounds"]) == reward.ROUNDS and p["overhead"] is not None
        # The sandbox's cost is a ratio of the same candidates' scoring time, measured in this run.
        assert len(p["sandbox_cost_rounds"]) == reward.ROUNDS and p["sandbox_cost"] is not None
        assert all(x["run_s"] is not None and x["task"].startswith("corpus/") for x in p["slowest"])
        # Where the time went: the worker's static check and the caller's share, on every path.
        for path in reward.PATHS:
            assert {"static", "caller"} <= set(p["phases"][path])
            assert sum(v["share"] for v in p["phases"][path].values()) == pytest.approx(1.0, abs=0.01)
    # The service's workers cannot be busier than its wall time: its own share is not negative.
    assert min(r["overhead_rounds"]) > -0.05
    assert r["scaling"]["workers"] == 2


def test_reward_bench_stops_at_its_deadline_and_still_reports(capsys):
    code = cli.main(["bench", "reward", "--json", "--candidates", "8", "--deadline", "0.5"])
    captured = capsys.readouterr()
    r = json.loads(captured.out)
    assert code == 0 and r["stopped_at_deadline"] is True and r["deadline_s"] == 0.5
    # The warm-up alone takes longer: nothing was measured, and the JSON says so rather than failing.
    assert r["rounds"] == 0 and r["done"] == 0 and r["mixed"]["rounds"] == 0
    assert r["scaling"] is None and r["elapsed_s"] < 120
    assert "bench reward: warming up" in captured.err  # progress goes to stderr; stdout is the one JSON object


def test_a_deadline_stops_taking_new_work_and_keeps_what_was_done():
    budget = reward.Budget(0.3)
    seconds, results = reward._parallel(2, list(range(200)), lambda _w, i: time.sleep(0.02) or i, budget)
    done = [x for x in results if x is not None]
    assert budget.hit and 0 < len(done) < 200 and seconds < 2.0
    assert done == list(range(len(done)))  # a prefix: the items taken were finished, no later one was started
    assert reward.Budget(None).expired() is False


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
    assert cli.main(["bench", "reward", "--deadline", "-1"]) == 2
    assert "--deadline must be 0 (none)" in capsys.readouterr().err
