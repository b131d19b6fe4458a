"""stitchcuda.log: the `stitchcuda` loggers (level from STITCHCUDA_LOG, stderr unless the application
configured logging, the root logger untouched) and the progress views (plain lines off a terminal and
in CI, rich redrawn in place on one, cut to its width), and the resume hint after Ctrl-C."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from stitchcuda import log

# ---- logging -------------------------------------------------------------------------------------

EMIT = textwrap.dedent('''
    import json, logging, os, sys
    root_before = (list(logging.getLogger().handlers), logging.getLogger().level)
    import stitchcuda
    from stitchcuda import log
    graph = log.get_logger("stitchcuda.graph")
    graph.debug("debug-record"); graph.info("info-record"); graph.warning("warning-record")
    root = logging.getLogger()
    report = {"root_unchanged": (list(root.handlers), root.level) == root_before,
              "name": graph.name, "short": log.get_logger("graph").name}
    if os.environ.get("APP_CONFIGURES"):
        logging.basicConfig(stream=sys.stdout, format="APP %(name)s %(message)s")
        graph.warning("after-app-config")
        os.environ["STITCHCUDA_LOG"] = "loud"
        log.configure()
    print(json.dumps(report))
''')


def _emit(subprocess_env: dict, **env: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in subprocess_env.items() if k != "STITCHCUDA_LOG"}, **env}
    return subprocess.run([sys.executable, "-c", EMIT], env=env, capture_output=True, text=True, timeout=120)


def test_stitchcuda_log_sets_the_level_and_records_go_to_stderr(subprocess_env):
    out = _emit(subprocess_env, STITCHCUDA_LOG="debug")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report == {"root_unchanged": True, "name": "stitchcuda.graph", "short": "stitchcuda.graph"}
    lines = out.stderr.splitlines()
    assert "[stitchcuda.graph] debug: debug-record" in lines
    assert "[stitchcuda.graph] info-record" in lines
    assert "[stitchcuda.graph] warning: warning-record" in lines


def test_default_level_and_an_application_that_configures_logging(subprocess_env):
    out = _emit(subprocess_env, APP_CONFIGURES="1")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["root_unchanged"]
    # Unset: the logger inherits the root's WARNING, so info and debug stay quiet.
    assert "warning-record" in out.stderr and "info-record" not in out.stderr and "debug-record" not in out.stderr
    # Once the application has a root handler, records go there alone: no second copy on stderr.
    assert "APP stitchcuda.graph after-app-config" in out.stdout and "after-app-config" not in out.stderr
    # A bad value is named, with the values that work.
    assert "STITCHCUDA_LOG must be one of debug, info, warning, error, got 'loud'" in out.stdout


def test_configure_reads_the_variable_again(monkeypatch):
    logger = log.get_logger()
    before = logger.level
    try:
        monkeypatch.setenv("STITCHCUDA_LOG", "info")
        log.configure()
        assert logger.isEnabledFor(20) and not logger.isEnabledFor(10)
        monkeypatch.setenv("STITCHCUDA_LOG", "ERROR")
        log.configure()
        assert logger.getEffectiveLevel() == 40
        assert sum(isinstance(h, log._StderrHandler) for h in logger.handlers) == 1  # configured twice, one handler
    finally:
        logger.setLevel(before)


# ---- progress off a terminal -----------------------------------------------------------------------


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_mode_follows_the_stream_and_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    assert log.StepProgress(stream=io.StringIO()).mode == "plain"   # a file or a pipe
    assert log.StepProgress(stream=FakeTerminal()).mode == "live"
    assert log.StepProgress(False, stream=FakeTerminal()).mode == "off"
    monkeypatch.setenv("CI", "true")
    assert log.StepProgress(stream=FakeTerminal()).mode == "plain"  # CI logs keep whole lines
    monkeypatch.setenv("CI", "0")
    assert log.StepProgress(stream=FakeTerminal()).mode == "live"


def test_steps_are_plain_lines_off_a_terminal():
    out = io.StringIO()
    progress = log.StepProgress(stream=out)
    with progress.step("capturing"):
        pass
    with pytest.raises(ValueError):
        with progress.step("verifying on 3 input set(s)"):
            raise ValueError("mismatch")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[stitchcuda] capturing…"
    assert re.fullmatch(r"\[stitchcuda\] capturing: done \(\d+\.\d s\)", lines[1])
    assert re.fullmatch(r"\[stitchcuda\] verifying on 3 input set\(s\): failed \(\d+\.\d s\)", lines[3])
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_steps_disabled_print_nothing():
    out = io.StringIO()
    with log.StepProgress(False, stream=out).step("capturing"):
        log.note("nobody is listening")
    assert out.getvalue() == ""


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run folder as the loop writes it: the budget in config.json, usage in trajectories.jsonl."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"budget": {"attempts": 5}}))
    return run


def _calls(run: Path, *tokens: int) -> None:
    with open(run / "trajectories.jsonl", "a") as f:
        for n in tokens:
            f.write(json.dumps({"agent": "coder", "usage": {"total_tokens": n}, "messages": []}) + "\n")


EVENTS = [
    {"stage": "plan", "attempt": 0, "plan": 0, "best_speedup": 0.0, "message": "planning add_relu"},
    {"stage": "code", "attempt": 0, "plan": 1, "best_speedup": 0.0, "message": "attempt 1: writing from the plan"},
    {"stage": "verify", "attempt": 0, "plan": 1, "best_speedup": 0.0, "message": "attempt 1"},
    {"stage": "feedback", "attempt": 1, "plan": 1, "best_speedup": 0.0,
     "message": "attempt 1: compile error: identifier \"z\" is undefined at line 4 of the candidate's CUDA source"},
    {"stage": "code", "attempt": 1, "plan": 1, "best_speedup": 0.0, "message": "attempt 2: revising from feedback"},
    {"stage": "feedback", "attempt": 2, "plan": 1, "best_speedup": 1.5, "message": "attempt 2: correct, 1.50x"},
    {"stage": "done", "attempt": 2, "plan": 1, "best_speedup": 1.5, "message": "target reached: 1.50x >= 1.30x"},
]


def _feed(progress: log.LoopProgress, run: Path) -> None:
    for i, event in enumerate(EVENTS):
        if i == 1:
            _calls(run, 1000)  # the plan's call
        if event["stage"] == "feedback":
            _calls(run, 300, 200)  # the attempt's Coder and VerifierAgent calls
        progress(event)
    progress.close()


def test_loop_progress_is_one_plain_line_per_event(run_dir):
    out = io.StringIO()
    _feed(log.LoopProgress(run_dir, stream=out), run_dir)
    lines = out.getvalue().splitlines()
    assert len(lines) == len(EVENTS)
    assert lines[0].startswith("[plan] attempt 1 of 5, plan 0, best -, 0 tokens, 0:00: planning add_relu")
    assert lines[1].startswith("[code] attempt 1 of 5, plan 1, best -, 1,000 tokens")  # budget read from config.json
    assert lines[4].startswith("[code] attempt 2 of 5, plan 1, best -, 1,500 tokens")
    assert lines[5].startswith("[feedback] attempt 2 of 5, plan 1, best 1.50x, 2,000 tokens")
    assert lines[6].startswith("[done] 2 attempts, plan 1, best 1.50x, 2,000 tokens") and "target reached" in lines[6]


def test_token_count_survives_a_rewritten_file(run_dir):
    count = log._TokenCount(run_dir)
    _calls(run_dir, 10, 20)
    with open(run_dir / "trajectories.jsonl", "a") as f:
        f.write('{"usage": {"total_tokens": 5')  # a line still being written is not counted yet
    assert count() == 30
    (run_dir / "trajectories.jsonl").write_text(json.dumps({"usage": {"total_tokens": 7}}) + "\n")  # a resume's rewrite
    assert count() == 7


# ---- progress on a terminal ------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _screen_lines(raw: str) -> list[str]:
    """What the terminal got, control sequences removed, one entry per drawn line."""
    return [line for line in re.split(r"[\r\n]", ANSI.sub("", raw)) if line.strip()]


def test_loop_progress_on_a_terminal_is_redrawn_and_keeps_a_table(run_dir):
    raw = io.StringIO()
    console = Console(file=raw, force_terminal=True, width=60, height=30, color_system="standard")
    _feed(log.LoopProgress(run_dir, console=console), run_dir)
    text = raw.getvalue()
    assert "\x1b[2K" in text and "\x1b[?25l" in text  # rich erased and redrew lines, with the cursor hidden
    lines = _screen_lines(text)
    assert all(len(line) <= 60 for line in lines), [line for line in lines if len(line) > 60]
    # Printed at close: the whole table of attempts, then the last status line.
    table_start = max(i for i, line in enumerate(lines) if line.split()[:3] == ["#", "plan", "best"])
    rows = lines[table_start + 1:]
    assert rows[0].split()[:5] == ["1", "1", "-", "1,500", "0.0"] and "compile error" in rows[0]
    assert rows[1].split()[:5] == ["2", "1", "1.50x", "2,000", "0.0"] and "correct, 1.50x" in rows[1]
    assert rows[0].endswith("…")  # the long outcome is cut to the width, not wrapped
    assert rows[2].startswith("[done] 2 attempts, plan 1, best 1.50x, 2,000 tokens")
    # While running, the status line said which attempt of how many.
    assert any(line.startswith("[code] attempt 2 of 5, plan 1") for line in lines)


def test_steps_on_a_terminal_show_the_note_and_leave_one_line_each():
    raw = io.StringIO()
    console = Console(file=raw, force_terminal=True, width=72, color_system="standard")
    progress = log.StepProgress(console=console)
    with progress.step("generating and checking 12 group(s)"):
        log.note("t1:code: attempt 1: writing from the plan of the first target")
    log.note("after the step: not shown anywhere")
    lines = _screen_lines(raw.getvalue())
    assert all(len(line) <= 72 for line in lines)
    assert any("t1:code: attempt 1" in line and line.endswith("…") for line in lines)  # the note, cut to fit
    assert not any("after the step" in line for line in lines)
    assert re.match(r"✓ generating and checking 12 group\(s\) \(done, ", lines[-1])


def test_optimize_steps_use_the_progress_view():
    from stitchcuda.graph import report

    assert report._Progress is log.StepProgress  # optimize.py's `steps = _Progress(progress)`


# ---- Ctrl-C ---------------------------------------------------------------------------------------

PROBLEM = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x, y):
            return torch.relu(x + y)

    def get_inputs():
        return [torch.randn(64, 32), torch.randn(64, 32)]

    def get_init_inputs():
        return []
''')


PLAN = json.dumps({"summary": "One fused elementwise kernel for the add and the ReLU.",
                   "steps": [{"title": "Write one fused add+ReLU kernel", "detail": "One thread per element."}],
                   "fusion_groups": [{"ops": ["add", "relu"], "kernel": "add_relu", "rationale": "one pass"}],
                   "bottlenecks": ["DRAM bandwidth"], "risks": [], "constraints": ["fp32 outputs"]})


@pytest.mark.slow
def test_ctrl_c_says_how_to_resume_and_the_hint_works(tmp_path, subprocess_env):
    (tmp_path / "add_relu.py").write_text(PROBLEM)
    (tmp_path / "slow_model.py").write_text(textwrap.dedent(f'''
        import time
        def answer(messages):
            print("model called", flush=True)
            time.sleep(0.5)
            if "You are the Planner" in messages[-1]["content"]:
                return {PLAN!r}
            return "```python\\nclass NotTheModel: pass\\n```"  # a candidate without ModelNew: no usable attempt
    '''))
    env = dict(subprocess_env, PYTHONPATH=f"{tmp_path}:{subprocess_env['PYTHONPATH']}")
    env.pop("CI", None)
    child = subprocess.Popen([sys.executable, "-m", "stitchcuda", "optimize", "--mode", "program", "add_relu.py",
                              "--llm", "python:slow_model:answer", "--attempts", "1", "--static-only",
                              "--run-dir", "runs/r1"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "model called\n"  # the Planner's call is under way
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 130, stderr
    assert "interrupted. The run is kept in runs/r1; continue it with" in stderr
    hint = stderr.strip().splitlines()[-1].strip()
    assert hint == "stitchcuda optimize --resume runs/r1"
    assert (tmp_path / "runs/r1/config.json").is_file()

    # The hint is a command that works: the run continues from its record (its one attempt finds no
    # usable candidate: exit 1) and finishes it.
    resumed = subprocess.run([sys.executable, "-m", "stitchcuda", *hint.split()[1:]], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode in (0, 1), resumed.stdout + resumed.stderr
    assert "interrupted" not in resumed.stderr and (tmp_path / "runs/r1/summary.json").is_file()
    events = [json.loads(line) for line in (tmp_path / "runs/r1/events.jsonl").read_text().splitlines()]
    assert [e["stage"] for e in events].count("resume") == 1 and events[-1]["stage"] == "done"


def test_ctrl_c_in_graph_mode(monkeypatch, tmp_path, capsys):
    import importlib

    from stitchcuda.cli import main

    optimize_module = importlib.import_module("stitchcuda.graph.optimize")
    seen: list[dict] = []

    def interrupted_optimize(model, inputs, **kwargs):
        seen.append(kwargs)
        if "run_dir" in kwargs:  # the agents had started and recorded their run
            Path(kwargs["run_dir"]).mkdir(parents=True)
            (Path(kwargs["run_dir"]) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(optimize_module, "optimize", interrupted_optimize)
    problem = tmp_path / "add_relu.py"
    problem.write_text(PROBLEM)
    assert main(["optimize", str(problem)]) == 130
    assert "graph mode without --llm records no run" in capsys.readouterr().err

    run = tmp_path / "graph_run"
    rules = tmp_path / "rules.json"  # --llm is checked before any work: the rules file exists
    rules.write_text(json.dumps([{"pattern": ".", "reply": "no plan here"}]))
    assert main(["optimize", str(problem), "--llm", f"scripted:{rules}", "--run-dir", str(run)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].strip() == f"stitchcuda optimize --resume {run}"
    assert callable(seen[-1]["on_event"])  # the agents' events reach the live view

    monkeypatch.chdir(tmp_path)  # no --run-dir: the CLI names the folder itself, as optimize() would
    assert main(["optimize", str(problem), "--llm", "scripted:rules.json"]) == 130
    named = Path(seen[-1]["run_dir"])
    assert named.parent == Path("runs") and named.name.endswith("-Model")
    assert f"--resume {named}" in capsys.readouterr().err
