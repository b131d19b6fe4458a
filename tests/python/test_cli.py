"""The command line: `python -m stitchcuda doctor|demo|bench jit`, run as a user would, in a
child process with its own cache folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stitchcuda import _C
from stitchcuda.cli import main


def run_cli(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stitchcuda", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_doctor_json_lists_every_check(subprocess_env):
    result = run_cli(["doctor", "--json"], subprocess_env)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    checks = {c["name"]: c for c in report["checks"]}
    for name in ("gpu", "driver", "cuda toolkit", "nvrtc", "architectures", "cupti", "torch",
                 "cache", "python"):
        assert name in checks, name
        assert set(checks[name]) == {"name", "ok", "detail", "fix", "required"}
    assert checks["nvrtc"]["ok"] and checks["nvrtc"]["detail"].startswith(_C.nvrtc_version())
    assert _C.default_arch() in checks["architectures"]["detail"]
    assert subprocess_env["STITCHCUDA_CACHE_DIR"] in checks["cache"]["detail"]
    if _C.device_count() == 0:  # no GPU is a note, not a failure
        assert checks["gpu"]["ok"] and "compile-only" in checks["gpu"]["fix"]
    for check in report["checks"]:
        if not check["ok"]:
            assert check["fix"], f"{check['name']} failed without saying what to do"


def test_doctor_text_report(subprocess_env):
    result = run_cli(["doctor"], subprocess_env)
    assert result.returncode == 0, result.stderr
    assert "nvrtc" in result.stdout and "All required checks passed." in result.stdout


def test_demo_compiles_and_runs_or_says_why_not(subprocess_env):
    result = run_cli(["demo"], subprocess_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "add_f32" in result.stdout and _C.default_arch() in result.stdout
    if _C.device_count() == 0:
        assert "launch skipped" in result.stdout
    else:
        assert "max |error| vs torch = 0" in result.stdout
    # The second run in the same cache folder finds the kernel on disk.
    again = run_cli(["demo"], subprocess_env)
    assert again.returncode == 0 and "from the disk cache" in again.stdout


def test_console_script_runs_the_same_cli(subprocess_env):
    script = Path(sys.executable).with_name("stitchcuda")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable} (package not installed)")
    result = subprocess.run([str(script), "demo"], env=subprocess_env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "add_f32" in result.stdout


@pytest.mark.slow
def test_bench_jit_json_has_the_required_keys(subprocess_env):
    subprocess_env["STITCHCUDA_BENCH_SKIP_LOAD_INLINE"] = "1"
    result = run_cli(["bench", "jit", "--json", "--repeats", "5"], subprocess_env)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)  # exactly one JSON object: anything else on stdout fails here
    assert set(out["compile_cold_ms"]) == {"elementwise", "bf16", "cub_reduce", "tiled_gemm"}
    assert all(ms > 0 for ms in out["compile_cold_ms"].values())
    assert out["disk_hit_ms"] > 0 and out["memory_hit_us"] > 0
    # A cache hit must be far cheaper than compiling.
    assert out["disk_hit_ms"] < out["compile_cold_ms"]["elementwise"]
    assert out["memory_hit_us"] / 1e3 < out["disk_hit_ms"]
    assert out["load_inline_s"] is None and "STITCHCUDA_BENCH_SKIP_LOAD_INLINE" in out["notes"]["load_inline"]
    assert out["ratio_vs_load_inline"] is None
    assert out["notes"]["cub_reduce_first_ms"] > 0
    assert len(out["notes"]["compile_cold_samples_ms"]["cub_reduce"]) == 5
    if _C.device_count() == 0:
        assert out["launch_us"] is None
    else:
        assert set(out["launch_us"]) == {"python", "cpp", "cpp_checked"}
        assert all(us > 0 for us in out["launch_us"].values())


@pytest.mark.parametrize("argv", [[], ["bench"], ["frobnicate"], ["bench", "jit", "--repeats", "2"]])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "doctor" in capsys.readouterr().out


# ---- stitchcuda optimize: --mode graph|program ------------------------------------------------------

PROBLEM = '''
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x)

def get_inputs():
    return [torch.randn(8, 8)]

def get_init_inputs():
    return []
'''


class _FakeReport:
    status = "eager"
    reason = ""
    kernels: list = []
    agents: dict = {}  # the agents did not run
    run_dir = ""

    def to_dict(self) -> dict:
        return {"status": self.status, "groups": []}

    def __str__(self) -> str:
        return "StitchCUDA report: eager (fake)"


@pytest.fixture
def graph_calls(monkeypatch) -> list[dict]:
    """Replaces graph mode's optimize(model, inputs, **kwargs) and records the keyword arguments."""
    import importlib

    optimize_module = importlib.import_module("stitchcuda.graph.optimize")  # the module: the package exports the function

    calls: list[dict] = []

    def fake(model, inputs, **kwargs):
        calls.append(kwargs)
        return type("Fast", (), {"report": _FakeReport()})()

    monkeypatch.setattr(optimize_module, "optimize", fake)
    return calls


@pytest.fixture
def problem_file(tmp_path: Path) -> Path:
    path = tmp_path / "relu.py"
    path.write_text(PROBLEM)
    return path


def test_optimize_defaults_to_graph_mode_without_agent_arguments(graph_calls, problem_file, capsys):
    assert main(["optimize", str(problem_file), "--precision", "tf32"]) == 0
    assert "fake" in capsys.readouterr().out
    # Exactly what graph mode passed before --mode existed: no agent keyword at all.
    assert graph_calls == [{"precision": "tf32", "compare_compile": True, "progress": None, "split_tf32": True}]
    # --sgemm keeps every fp32 matmul on cuBLAS's SGEMM.
    assert main(["optimize", str(problem_file), "--sgemm"]) == 0
    assert graph_calls[1]["split_tf32"] is False and graph_calls[1]["precision"] == "fp32"


@pytest.fixture
def rules(tmp_path: Path) -> str:
    """A scripted model spec whose file exists: --llm is checked before any work."""
    (tmp_path / "rules.json").write_text(json.dumps([{"pattern": ".", "reply": "no kernel"}]))
    return f"scripted:{tmp_path / 'rules.json'}"


def test_graph_mode_passes_only_the_given_agent_options(graph_calls, problem_file, tmp_path, rules):
    assert main(["optimize", str(problem_file), "--llm", rules, "--attempts", "2",
                 "--run-dir", str(tmp_path / "run")]) == 0
    kwargs = graph_calls[0]
    assert kwargs["llm"] == rules and kwargs["attempts"] == 2 and kwargs["run_dir"] == str(tmp_path / "run")
    assert not {"tokens", "wall_s", "resume"} & set(kwargs)
    assert main(["optimize", "--mode", "graph", str(problem_file), "--llm", rules, "--tokens", "900", "--wall-s", "60"]) == 0
    assert graph_calls[1]["tokens"] == 900 and graph_calls[1]["wall_s"] == 60.0 and "attempts" not in graph_calls[1]


def test_resume_takes_the_mode_the_run_recorded(graph_calls, problem_file, tmp_path, monkeypatch, capsys, rules):
    graph_run = tmp_path / "graph_run"
    graph_run.mkdir()
    (graph_run / "config.json").write_text(json.dumps({"mode": "graph", "llm_spec": rules,
                                                       "problem_path": str(problem_file)}))
    assert main(["optimize", "--resume", str(graph_run)]) == 0
    assert graph_calls[-1]["resume"] == str(graph_run) and graph_calls[-1]["llm"] == rules

    from stitchcuda.agents import cli as agents_cli

    program_runs: list = []
    monkeypatch.setattr(agents_cli, "run_program", lambda args, config: program_runs.append((args, config)) or 0)
    program_run = tmp_path / "program_run"
    program_run.mkdir()
    (program_run / "config.json").write_text(json.dumps({"mode": "program", "llm_spec": "scripted:r.json"}))
    assert main(["optimize", "--resume", str(program_run), "--attempts", "5"]) == 0
    args, config = program_runs[-1]
    assert args.attempts == 5 and args.replans is None and config["mode"] == "program"
    old_run = tmp_path / "old_run"  # made before runs recorded their mode: a program-mode run
    old_run.mkdir()
    (old_run / "config.json").write_text(json.dumps({"llm_spec": "scripted:r.json"}))
    assert main(["optimize", "--resume", str(old_run)]) == 0 and len(program_runs) == 2
    assert len(graph_calls) == 1

    capsys.readouterr()
    assert main(["optimize", "--mode", "graph", "--resume", str(program_run)]) == 2
    assert "program-mode run" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--mode", "program", "PROBLEM"], "give --llm SPEC"),
    (["PROBLEM", "--attempts", "3"], "--attempts needs --llm"),
    (["PROBLEM", "--static-only"], "--static-only is for --mode program"),
    (["--mode", "program", "PROBLEM", "--llm", "x:y", "--save", "out.stitch"], "--save is for --mode graph"),
    (["--mode", "tree", "PROBLEM"], ""),
    (["--resume", "/nonexistent/run"], "does not exist"),
])
def test_optimize_usage_errors(argv, message, problem_file, graph_calls, capsys):
    argv = [str(problem_file) if a == "PROBLEM" else a for a in argv]
    assert main(["optimize", *argv]) == 2
    assert message in capsys.readouterr().err
    assert graph_calls == []


def test_console_script_spawns_verifier_workers(subprocess_env, tmp_path):
    # The Verifier runs candidates in spawned workers, and spawning imports the parent's main script:
    # the console script must not run the CLI again there (multiprocessing's bootstrapping error).
    script = Path(sys.executable).with_name("stitchcuda")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable} (package not installed)")
    (tmp_path / "ref.py").write_text(PROBLEM)
    (tmp_path / "cand.py").write_text(PROBLEM.replace("class Model(", "class ModelNew("))
    result = subprocess.run([str(script), "check", "--reference", str(tmp_path / "ref.py"), "--candidate",
                             str(tmp_path / "cand.py"), "--device", "cpu", "--json"], env=subprocess_env,
                            capture_output=True, text=True, timeout=300)
    # Unguarded, the worker ran `check` again: a crash report naming the bootstrapping phase, printed twice.
    assert "bootstrapping" not in result.stdout + result.stderr, result.stdout
    assert len(result.stdout.splitlines()) == 1, result.stdout
    report = json.loads(result.stdout)
    assert report["trials"], report  # the candidate ran, in a worker
    assert report["error"] is None or report["error"]["kind"] != "crash", report["error"]
