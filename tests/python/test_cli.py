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
