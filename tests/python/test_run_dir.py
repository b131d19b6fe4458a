"""stitchcuda.agents.run_dir reads what the C++ loop writes (a real run of the loop, on the CPU with a scripted
model and static verification) and writes graph-mode runs the same way: atomic files, secrets redacted,
resumable, readable while going or after a kill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stitchcuda import _C, agents
from stitchcuda.agents.run_dir import REDACTED, RunDir, read_json, redact_keys
from stitchcuda.errors import InvalidArgumentError, NotFoundError
from test_agents_loop import GOOD, PROBLEM, ScriptedModel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    """A run the C++ RunDirectory wrote: a compile error, then a fix (two attempts)."""
    root = tmp_path_factory.mktemp("loop")
    problem = root / "add_relu.py"
    problem.write_text(PROBLEM)
    events: list[dict] = []
    out = agents.optimize_problem(problem, ScriptedModel(), attempts=4, run_dir=root / "run", on_event=events.append,
                                  static_only=True)
    return root / "run", out, events


def test_reads_what_the_cpp_loop_wrote(loop_run):
    path, out, events = loop_run
    run = RunDir.open(path, mode="program")
    assert RunDir.is_run(path) and run.id == "run"
    assert run.config()["problem"] == "add_relu" and run.config()["budget"]["attempts"] == 4
    assert run.summary()["problem"] == "add_relu" and run.summary()["best_attempt"] == out["best_attempt"] == 2
    assert run.best() == GOOD and run.failed() is None and isinstance(run.hardware(), dict)
    attempts = run.attempts()
    assert [a["index"] for a in attempts] == [1, 2]
    for mine, theirs in zip(attempts, out["attempts"]):  # what the loop returned is what the folder holds
        assert (mine["skill"], mine["candidate"], mine["feedback"]["kind"]) == \
            (theirs["skill"], theirs["candidate"], theirs["feedback"]["kind"])
        assert mine["report"]["error_kind"] == theirs["report"]["error_kind"]
    assert [e["stage"] for e in run.events()] == [e["stage"] for e in events]
    calls = run.trajectories()
    assert calls == agents.read_trajectories(path) and all(agents.validate_trajectory(c) == [] for c in calls)


def test_an_interrupted_attempt_and_a_cut_line_are_left_out(loop_run, tmp_path):
    import shutil

    path, _, _ = loop_run
    copy = Path(shutil.copytree(path, tmp_path / "killed"))
    (copy / "attempts" / "003").mkdir()
    (copy / "attempts" / "003" / "candidate.py").write_text("# killed before attempt.json")
    with open(copy / "events.jsonl", "a") as f:
        f.write('{"stage": "code", "mess')  # a kill in the middle of a line
    (copy / "summary.json").unlink()
    run = RunDir(copy)
    assert [a["index"] for a in run.attempts()] == [1, 2]
    assert len(run.events()) == len(RunDir(path).events())
    assert run.summary() is None and run.config() is not None


def test_open_refuses_what_is_not_a_run(tmp_path, loop_run):
    with pytest.raises(NotFoundError, match="is not a run directory .no readable config.json"):
        RunDir.open(tmp_path)
    with pytest.raises(NotFoundError, match="is not a graph-mode run directory: its config.json says mode"):
        RunDir.open(loop_run[0], mode="graph")
    assert not RunDir.is_run(tmp_path) and RunDir(tmp_path).attempts() == [] and RunDir(tmp_path).events() == []


def test_create_refuses_a_used_folder(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(InvalidArgumentError, match="exists and is not empty"):
        RunDir.create(tmp_path / "used")
    run = RunDir.create(tmp_path / "a" / "b")
    assert run.path.is_dir() and not any(run.path.iterdir())
    assert RunDir.create(tmp_path / "a" / "b").path == run.path  # an empty folder may be used


def test_writes_are_atomic_redacted_and_read_back(tmp_path):
    secret = "sk-test-run-dir-0123456789abcdef"
    _C.secrets.remember(secret)
    run = RunDir.create(tmp_path / "graph")
    options = {"api_key": "k1", "headers": {"Authorization": "x"}, "token": "", "max_tokens": 5}
    run.write_config({"mode": "graph", "model": "m", "call_options": options, "note": secret})
    config = run.config()
    assert config["call_options"] == {"api_key": REDACTED, "headers": {"Authorization": REDACTED}, "token": "",
                                      "max_tokens": 5}
    assert secret not in (run.path / "config.json").read_text() and config["mode"] == "graph"
    run.write_json("plans/targets.json", [{"id": "t1", "groups": ["g0"]}])
    assert run.read("plans/targets.json") == [{"id": "t1", "groups": ["g0"]}]
    assert not list(run.path.rglob("*.tmp"))
    run.append_event({"stage": "start", "message": f"key {secret}"})
    run.append_event({"stage": "done", "message": "ok"})
    assert [e["stage"] for e in run.events()] == ["start", "done"] and secret not in json.dumps(run.events())
    run.write_failed("the backend refused the key", "2026-01-01T00:00:00Z")
    assert run.failed() == {"error": "the backend refused the key", "time": "2026-01-01T00:00:00Z"}
    assert RunDir.open(run.path, mode="graph").config()["model"] == "m"


def test_graph_targets_are_program_runs(tmp_path, loop_run):
    import shutil

    run = RunDir.create(tmp_path / "graph")
    run.write_config({"mode": "graph"})
    shutil.copytree(loop_run[0], run.path / "targets" / "t2")
    (run.path / "targets" / "t1").mkdir(parents=True)
    targets = run.targets()
    assert list(targets) == ["t1", "t2"] and [a["index"] for a in targets["t2"].attempts()] == [1, 2]
    assert targets["t1"].attempts() == [] and RunDir(tmp_path / "none").targets() == {}


def test_helpers():
    assert read_json("/nonexistent/file.json") is None
    assert redact_keys([{"password": "p", "list": [{"secret_value": 1}]}, 3]) == \
        [{"password": REDACTED, "list": [{"secret_value": REDACTED}]}, 3]
