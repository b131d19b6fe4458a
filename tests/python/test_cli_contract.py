"""docs/cli.md's contract, run as a user meets it: each documented failure through the real `stitchcuda`
entry point in a child process, with its exit code, what stdout holds (nothing, or under --json exactly one
JSON object) and the line on stderr that says what is wrong.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
no_gpu_only = pytest.mark.skipif(HAS_GPU, reason="the no-GPU answer of a command; a GPU is present")

RELU = """\
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2.0


def get_inputs():
    return [torch.randn(32, 64)]


def get_init_inputs():
    return []
"""

# Problem files that go wrong in every way docs/cli.md names (the RELU problem with something added).
FILES = {
    "relu.py": RELU,
    "nomodel.py": "import torch\nX = 1\n",
    "raises.py": "raise RuntimeError('boom')\n" + RELU,
    "segv.py": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n" + RELU,
    "exit0.py": "import os\nos._exit(0)\n" + RELU,
    "exit7.py": "raise SystemExit(7)\n" + RELU,
    "exit7_inputs.py": RELU.replace('    return [torch.randn(32, 64)]', '    raise SystemExit(7)'),
    # The same, in the model graph mode runs in the command's own process: Model() and forward().
    "exit7_init.py": RELU.replace("class Model(nn.Module):\n", "class Model(nn.Module):\n    def __init__(self):\n"
                                  "        raise SystemExit(7)\n\n"),
    "exit0_forward.py": RELU.replace("        return torch.relu(x) * 2.0", "        import os\n        os._exit(0)"),
    "exit7_forward.py": RELU.replace("        return torch.relu(x) * 2.0", "        raise SystemExit(7)"),
    "segv_forward.py": RELU.replace("        return torch.relu(x) * 2.0",
                                    "        import os, signal\n        os.kill(os.getpid(), signal.SIGSEGV)"),
    "big.py": RELU + "#" * (1 << 20) + "\n",
    "helpers/shapes.py": "ROWS, COLS = 16, 8\n",
    "helpers/uses_sibling.py": "from shapes import ROWS, COLS\n" + RELU.replace("32, 64", "ROWS, COLS"),
    "cand.py": RELU.replace("class Model(", "class ModelNew("),
    "kb/shapes.py": "ROWS, COLS = 16, 8\n",  # a module the problems import: skipped, not a failed problem
    "kb/op_uses_shapes.py": "from shapes import ROWS, COLS\n" + RELU.replace("32, 64", "ROWS, COLS"),
    "kb/op_missing_import.py": "import no_such_helper\n" + RELU,
    "rules.json": json.dumps([{"pattern": ".", "reply": "no plan here"}]),
}


@dataclass
class Case:
    argv: list[str]
    code: int
    stderr: str = ""  # a fragment of stderr (the message)
    stdout: str = "empty"  # "empty", "error" (exactly {"error": message}), "json" (one JSON value), "any"
    env: dict[str, str] = field(default_factory=dict)


CLOSED = "http://127.0.0.1:{port}/v1"  # a port nothing listens on (filled in per run)

CASES = {
    # ---- usage: argparse and the command table
    "unknown command": Case(["frobnicate"], 2, "invalid choice"),
    "unknown option": Case(["doctor", "--frobnicate"], 2, "unrecognized arguments"),
    "no command": Case([], 2, "usage:"),
    "bench without a benchmark": Case(["bench"], 2, "usage:"),
    "llm without a subcommand": Case(["llm"], 2, "usage:"),
    "runs without a subcommand": Case(["runs"], 2, "usage:"),
    "bench jit with too few repeats": Case(["bench", "jit", "--repeats", "3"], 2, "at least 5"),
    # ---- llm ping: a backend that cannot answer is a "no"
    "llm ping, unknown provider": Case(["llm", "ping", "foo:bar", "--json"], 1, "unknown model provider 'foo'",
                                       "error"),
    "llm ping, no API key": Case(["llm", "ping", "openai:gpt-4.1", "--json"], 1, "OPENAI_API_KEY", "error"),
    "llm ping, no server": Case(["llm", "ping", "openai:m@" + CLOSED, "--json", "--timeout", "5"], 1, "127.0.0.1",
                                "error"),
    # ---- optimize: the problem file, bounded as `check` bounds its reference
    "optimize, no such file": Case(["optimize", "missing.py", "--json"], 2, "No such file", "error"),
    "optimize, no Model": Case(["optimize", "nomodel.py"], 2, "does not define Model"),
    "optimize, file raises": Case(["optimize", "raises.py"], 2, "RuntimeError: boom"),
    "optimize, a FIFO": Case(["optimize", "fifo.py"], 2, "not a regular file"),
    "optimize, /dev/zero": Case(["optimize", "/dev/zero", "--json"], 2, "not a regular file", "error"),
    "optimize, over 1 MiB": Case(["optimize", "big.py"], 2, "more than the 1048576 a problem file may have"),
    "optimize, segfault at import": Case(["optimize", "segv.py"], 2, "crashed while importing (SIGSEGV)"),
    "optimize, os._exit(0) at import": Case(["optimize", "exit0.py"], 2,
                                            "ended the process while importing (exit status 0)"),
    "optimize, SystemExit(7) at import": Case(["optimize", "exit7.py"], 2, "exit status 7"),
    "optimize, SystemExit(7) in get_inputs": Case(["optimize", "exit7_inputs.py", "--json"], 2, "sys.exit(7)", "error"),
    "optimize, SystemExit(7) in Model()": Case(["optimize", "exit7_init.py", "--json"], 2,
                                               "called sys.exit(7) while building its Model or its inputs", "error"),
    "optimize, os._exit(0) in forward": Case(["optimize", "exit0_forward.py"], 2,
                                             "ended the process while running Model.forward (exit status 0)"),
    "optimize, SystemExit(7) in forward": Case(["optimize", "exit7_forward.py", "--json"], 2,
                                               "called sys.exit(7) while running Model.forward", "error"),
    "optimize, segfault in forward": Case(["optimize", "segv_forward.py"], 2,
                                          "crashed while running Model.forward (SIGSEGV)"),
    "optimize program, segfault at import": Case(["optimize", "--mode", "program", "segv.py", "--llm",
                                                  "scripted:rules.json"], 2, "crashed while importing"),
    # ---- optimize: the options
    "optimize, a program-mode option in graph mode": Case(["optimize", "relu.py", "--static-only"], 2,
                                                          "--static-only is for --mode program"),
    "optimize, an agent option without --llm": Case(["optimize", "relu.py", "--attempts", "2", "--json"], 2,
                                                    "--attempts needs --llm", "error"),
    "optimize program without --llm": Case(["optimize", "--mode", "program", "relu.py"], 2, "give --llm SPEC"),
    "optimize, --resume of nothing": Case(["optimize", "--resume", "nowhere"], 2, "does not exist"),
    "optimize, --resume of a folder that is no run": Case(["optimize", "--resume", "helpers"], 2,
                                                          "is not a run directory"),
    # ---- optimize --llm, checked before any work in both modes
    "optimize, unknown model spec": Case(["optimize", "relu.py", "--llm", "foo:bar", "--json"], 2,
                                         "unknown model provider 'foo'", "error"),
    "optimize, no API key": Case(["optimize", "relu.py", "--llm", "openai:gpt-4.1", "--json"], 1, "OPENAI_API_KEY",
                                 "error"),
    "optimize, no server": Case(["optimize", "relu.py", "--llm", "openai:m@" + CLOSED], 1, "is not reachable"),
    "optimize, a python: spec that does not import": Case(["optimize", "relu.py", "--llm", "python:no_such_mod:fn"],
                                                          2, "importing 'no_such_mod' failed"),
    "optimize program, unknown model spec": Case(["optimize", "--mode", "program", "relu.py", "--llm", "foo:bar"], 2,
                                                 "unknown model provider 'foo'"),
    "optimize program, no API key": Case(["optimize", "--mode", "program", "relu.py", "--llm", "openai:gpt-4.1"], 1,
                                         "OPENAI_API_KEY"),
    "optimize program, no server": Case(["optimize", "--mode", "program", "relu.py", "--llm", "openai:m@" + CLOSED],
                                        1, "is not reachable"),
    # ---- bench DIR: a problem that does not load is a "no"; a helper module is no problem
    "bench DIR, a problem that does not load": Case(["bench", "kb", "--compile-only", "--json"], 1,
                                                    "skipped shapes.py: no Model", "json"),
    "bench DIR, every problem ran": Case(["bench", "kb", "--compile-only", "--only", "op_uses_shapes", "--json"], 0,
                                         '[suite-row] {"model": "op_uses_shapes"', "json"),
    # ---- runs
    "runs list, no runs folder yet": Case(["runs", "list", "--json"], 0, "", "json"),
    "runs list, a --root that does not exist": Case(["runs", "list", "--root", "nowhere", "--json"], 2, "no folder",
                                                    "error"),
    "runs show, no such run": Case(["runs", "show", "nope", "--json"], 2, "no run directory 'nope'", "error"),
    # ---- profile, check, bench: a file that cannot be used; no GPU
    "profile, no such file": Case(["profile", "missing.py", "--json"], 2, "No such file", "error"),
    "profile, a FIFO": Case(["profile", "fifo.py"], 2, "not a regular file"),
    # `check` reports bad input in its verdict (one JSON report), a "no"
    "check, a FIFO candidate": Case(["check", "--reference", "relu.py", "--candidate", "fifo.py", "--static-only",
                                     "--json"], 1, "", "json"),
}

NO_GPU_CASES = {
    "optimize --save without a GPU": Case(["optimize", "relu.py", "--save", "out.stitch"], 1, "out.stitch not written",
                                          "any"),
    "check without a GPU": Case(["check", "--reference", "relu.py", "--candidate", "cand.py", "--json"], 3,
                                "no usable CUDA GPU", "error"),
    "profile without a GPU": Case(["profile", "relu.py", "--json"], 3, "profiler unavailable", "error"),
    "bench program without a GPU": Case(["bench", "program", "--json"], 3, "", "error"),
    "bench DIR without a GPU": Case(["bench", "kb", "--json"], 3, "no GPU", "error"),
}


def _entry_point() -> list[str]:
    """The installed console script, as a user runs it; `python -m stitchcuda` where it is not installed."""
    script = Path(sys.executable).with_name("stitchcuda")
    return [str(script)] if script.exists() else [sys.executable, "-m", "stitchcuda"]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    os.mkfifo(tmp_path / "fifo.py")  # opened for reading, it would block until a writer comes: never read
    return tmp_path


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: a connection there is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(case: Case, cwd: Path, env: dict[str, str], port: int, timeout: float = 300) -> subprocess.CompletedProcess:
    argv = [a.replace("{port}", str(port)) for a in case.argv]
    env = {k: v for k, v in env.items() if k not in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")} | case.env
    return subprocess.run(_entry_point() + argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _check(case: Case, done: subprocess.CompletedProcess) -> None:
    said = f"exit {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"
    assert done.returncode == case.code, said
    assert case.stderr in done.stderr, said
    assert "Traceback" not in done.stderr, said
    if case.stdout == "empty":
        assert done.stdout == "", said
    elif case.stdout == "error":  # --json: exactly one object, the error, which stderr repeats for a person
        value = json.loads(done.stdout)
        assert list(value) == ["error"] and case.stderr in value["error"], said
    elif case.stdout == "json":
        json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_documented_failure(name, workdir, subprocess_env, closed_port):
    case = CASES[name]
    _check(case, _run(case, workdir, subprocess_env, closed_port))


@no_gpu_only
@pytest.mark.slow
@pytest.mark.parametrize("name", list(NO_GPU_CASES))
def test_documented_answer_without_a_gpu(name, workdir, subprocess_env, closed_port):
    case = NO_GPU_CASES[name]
    _check(case, _run(case, workdir, subprocess_env, closed_port))


def test_runs_list_json_is_an_empty_list_without_runs(workdir, subprocess_env, closed_port):
    assert json.loads(_run(CASES["runs list, no runs folder yet"], workdir, subprocess_env, closed_port).stdout) == []


# Every Python program a user may start answers --help with its usage, running nothing (a benchmark module
# once took `--help` for "run without --json" and measured for minutes).
HELP = {
    "stitchcuda": ([], ["--help"], "optimize"),
    "python -m stitchcuda": (["-m", "stitchcuda"], ["--help"], "--cmake-dir"),
    "stitchcuda optimize": ([], ["optimize", "--help"], "--llm SPEC"),
    "stitchcuda bench suite": ([], ["bench", "suite", "--help"], "--compile-only"),
    "python -m stitchcuda.bench.verify": (["-m", "stitchcuda.bench.verify"], ["--help"], "--json"),
    "python -m stitchcuda.bench.reward": (["-m", "stitchcuda.bench.reward"], ["--help"], "--json"),
    "python -m stitchcuda.bench.fingerprint": (["-m", "stitchcuda.bench.fingerprint"], ["--help"], "--out"),
    "python -m stitchcuda.settings": (["-m", "stitchcuda.settings"], ["--help"], "--markdown"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HELP))
def test_every_python_program_answers_help(name, subprocess_env, tmp_path):
    module, argv, mentions = HELP[name]
    command = ([sys.executable, *module] if module else _entry_point()) + argv
    done = subprocess.run(command, cwd=tmp_path, env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stdout[-2000:] + done.stderr[-2000:]
    assert mentions in done.stdout and done.stderr == "", done.stdout


@pytest.mark.slow
def test_a_problem_file_imports_the_modules_beside_it(workdir, subprocess_env, closed_port):
    """Run from elsewhere, a problem file still imports its sibling, as `python helpers/uses_sibling.py` would."""
    done = _run(Case(["optimize", "helpers/uses_sibling.py", "--json"], 0, stdout="json"), workdir, subprocess_env,
                closed_port)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["status"] in ("optimized", "eager"), report


@no_gpu_only
@pytest.mark.slow
def test_graph_mode_says_why_the_agents_did_not_run(workdir, subprocess_env, closed_port):
    done = _run(Case(["optimize", "relu.py", "--llm", "scripted:rules.json", "--json"], 0), workdir, subprocess_env,
                closed_port)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the agents did not run: no CUDA GPU here" in done.stderr
    assert "no CUDA GPU" in json.loads(done.stdout)["agents_not_run"]
    assert not (workdir / "runs").exists()  # nothing was recorded: the agents never started


@pytest.mark.slow
def test_program_mode_without_a_usable_plan_is_a_no_and_runs_list_says_failed(workdir, subprocess_env, closed_port):
    run_dir = workdir / "runs" / "no-plan"
    done = _run(Case(["optimize", "--mode", "program", "relu.py", "--llm", "scripted:rules.json", "--attempts", "1",
                      "--run-dir", str(run_dir)], 1), workdir, subprocess_env, closed_port)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "no valid plan" in done.stderr and f"--resume {run_dir}" in done.stderr
    listing = _run(Case(["runs", "list", "--json"], 0), workdir, subprocess_env, closed_port)
    [run] = json.loads(listing.stdout)
    assert run["finished"] is False and run["stop_reason"].startswith("failed: ")
    assert "no valid plan" in run["stop_reason"]
    table = _run(Case(["runs", "list"], 0), workdir, subprocess_env, closed_port)
    assert "failed: " in table.stdout and "running or interrupted" not in table.stdout


@pytest.mark.slow
def test_ctrl_c_while_the_problem_builds_exits_130_and_says_so(workdir, subprocess_env):
    marker = workdir / "building"
    (workdir / "slow.py").write_text(RELU.replace(
        "    return [torch.randn(32, 64)]",
        f"    open({str(marker)!r}, 'w').close()\n    import time\n    time.sleep(300)\n"
        "    return [torch.randn(32, 64)]"))
    proc = subprocess.Popen(_entry_point() + ["optimize", "slow.py"], cwd=workdir, env=subprocess_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), proc.communicate(timeout=5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err and out == ""


def test_a_forward_that_hangs_is_stopped_by_the_preflight():
    """graph mode's preflight runs forward in a child under the preflight's limit (120 s; 5 s here): a forward
    that never returns is stopped and named, and the caller goes on."""
    from stitchcuda.verify.task import TaskError, preflight

    hangs = RELU.replace("        return torch.relu(x) * 2.0", "        import time\n        time.sleep(1000)")
    started = time.monotonic()
    with pytest.raises(TaskError, match="'hangs.py' did not finish running Model.forward within 5 s; it was stopped"):
        preflight(hangs, "hangs.py", timeout_s=5, run_model=True)
    assert time.monotonic() - started < 60
    preflight(hangs, "hangs.py", timeout_s=60)  # importing it alone is fine: nothing calls forward
