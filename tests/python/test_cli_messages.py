"""The command line's messages lead somewhere: `--version`; one table of exit codes, documented and used;
`--json` prints one JSON object whatever the outcome; `check` without a GPU says it needs one and offers
`--static-only`; a problem file that raises shows its exception; `llm ping python:MOD:FN` finds MOD in
the current folder; help cites no internal issue numbers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import stitchcuda
from stitchcuda import cli
from stitchcuda.cli import main

ROOT = Path(__file__).resolve().parents[2]
HAS_GPU = torch.cuda.is_available()

PROBLEM = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):                  # built in training mode, as every nn.Module is
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(torch.relu(self.proj(x)))

    def get_inputs():
        return [torch.randn(8, 16)]

    def get_init_inputs():
        return []
''')

JIT_CANDIDATE = textwrap.dedent('''
    import torch
    import torch.nn as nn
    from stitchcuda import jit

    _kernel = jit.compile(r"""
    extern "C" __global__ void relu(const float* x, float* y, int n) {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) y[i] = fmaxf(x[i], 0.0f);
    }""", "relu")

    class ModelNew(nn.Module):
        def forward(self, x):
            y = torch.empty_like(x)
            _kernel((x.numel() + 255) // 256, 256, x, y, x.numel())
            return y
''')

RELU_REFERENCE = textwrap.dedent('''
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x)

    def get_inputs():
        return [torch.randn(64, 64)]

    def get_init_inputs():
        return []
''')

RAISING = "import torch\nraise RuntimeError('the dataset folder is not mounted')\n"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name, text in (("problem", PROBLEM), ("cand", JIT_CANDIDATE), ("ref", RELU_REFERENCE), ("raising", RAISING)):
        out[name] = tmp_path / f"{name}.py"
        out[name].write_text(text)
    return out


def _one_json_object(text: str) -> dict:
    """stdout must be exactly one JSON object: anything else on it fails here."""
    value = json.loads(text)
    assert isinstance(value, dict), text
    return value


# ---- --version and the exit-code table ---------------------------------------------------------------


def test_version_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"stitchcuda {stitchcuda.__version__} (torch {torch.__version__}"), out


def test_the_exit_code_table_in_the_docs_is_the_one_the_code_uses():
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| (\d+) \| `(EXIT_\w+)` \|", section, flags=re.M))
    assert rows == {"0": "EXIT_OK", "1": "EXIT_FAILURE", "2": "EXIT_USAGE", "3": "EXIT_NO_GPU",
                    "130": "EXIT_INTERRUPTED"}, rows
    for code, name in rows.items():
        assert getattr(cli, name) == int(code), name


def test_help_cites_no_internal_issue_numbers(capsys):
    for argv in (["--help"], ["bench", "--help"], ["optimize", "--help"], ["check", "--help"], ["llm", "--help"]):
        assert main(argv) == 0
        text = capsys.readouterr().out
        assert not re.search(r"\bissue \d", text), (argv, text)


# ---- --json prints JSON, whatever the outcome ----------------------------------------------------------


def _json_cases(files: dict[str, Path], tmp: Path) -> list[tuple[list[str], int]]:
    """(argv, exit code) for every command that takes --json, run where this test runs."""
    no_gpu = 0 if HAS_GPU else 3
    cases = [
        (["doctor", "--json"], 0),
        (["llm", "ping", "scripted:" + str(tmp / "absent-rules.json"), "--json"], 1),
        (["llm", "ping", "nonsense:model", "--json"], 1),
        (["optimize", str(tmp / "absent.py"), "--json"], 2),
        (["optimize", str(files["raising"]), "--json"], 2),
        (["optimize", "--mode", "program", str(files["problem"]), "--llm", "x:y", "--json"], 2),
        (["profile", str(tmp / "absent.py"), "--json"], 2),
        (["check", "--reference", str(files["ref"]), "--candidate", str(files["cand"]), "--json", "--static-only"], 0),
    ]
    if not HAS_GPU:  # each of these would measure for minutes on a GPU (scripts/gpu-check runs them there)
        cases += [
            (["optimize", str(files["problem"]), "--json"], 0),  # planned and compiled only
            (["profile", str(files["problem"]), "--json"], no_gpu),
            (["check", "--reference", str(files["ref"]), "--candidate", str(files["cand"]), "--json"], no_gpu),
            (["bench", "program", "--json"], no_gpu),
            (["bench", "profile", "--json"], no_gpu),
            (["bench", "verify", "--json"], no_gpu),
            (["bench", "suite", "--json", "--only", "none"], no_gpu),
        ]
    return cases


def test_every_json_command_prints_one_json_object_and_the_documented_code(files, tmp_path, capsys):
    for argv, code in _json_cases(files, tmp_path):
        got = main(argv)
        out = capsys.readouterr()
        assert got == code, (argv, got, out.err[-500:])
        value = _one_json_object(out.out)
        if code in (2, 3) or argv[:2] == ["llm", "ping"]:
            assert set(value) == {"error"} and value["error"], (argv, value)
            if argv[:2] != ["bench", "suite"]:  # bench/suite.py's refusals go to stdout alone
                assert value["error"] in out.err, (argv, out.err)  # the same message for a person on stderr


@pytest.mark.skipif(HAS_GPU, reason="the no-GPU answers; on a GPU these commands measure")
def test_bench_graph_json_times_the_cpu_side_and_exits_3(capsys):
    assert main(["bench", "graph", "--json"]) == 3
    value = _one_json_object(capsys.readouterr().out)
    assert value["device"] is None and value["optimize_time_100_ops"]["ops"] >= 100


# ---- check without a GPU --------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU message; a GPU is present")
def test_check_without_a_gpu_says_it_needs_one_and_offers_static_only(files, capsys):
    argv = ["check", "--reference", str(files["ref"]), "--candidate", str(files["cand"])]
    assert main(argv) == 3
    out = capsys.readouterr()
    assert out.out == "" and "NOT correct" not in out.err  # a correct candidate is never called incorrect
    assert "no usable CUDA GPU" in out.err and "--static-only" in out.err and "--device cpu" in out.err
    assert out.err.count("\n") == 1
    # The way the message offers works here: compiled, static rules, nothing claimed about correctness.
    assert main(argv + ["--static-only"]) == 0
    text = capsys.readouterr().out
    assert "verdict   static checks only" in text and "compiled  True" in text
    assert "Incorrect" not in text and "not known until it runs on a GPU" in text


# ---- a problem file that raises --------------------------------------------------------------------------


def test_a_problem_file_that_raises_shows_the_exception(files, capsys):
    for argv in (["optimize", str(files["raising"])], ["profile", str(files["raising"])]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "RuntimeError: the dataset folder is not mounted" in err, (argv, err)
        assert "does not define" not in err and "Traceback" not in err
    assert main(["check", "--reference", str(files["raising"]), "--candidate", str(files["cand"]), "--json",
                 "--static-only"]) == 1
    report = _one_json_object(capsys.readouterr().out)
    assert report["error"]["kind"] == "bad-reference", report["error"]
    assert "raised while loading: RuntimeError: the dataset folder is not mounted" in report["error"]["message"]


def test_a_file_without_a_model_still_says_what_a_problem_file_needs(tmp_path, capsys):
    empty = tmp_path / "nothing.py"
    empty.write_text("x = 1\n")
    assert main(["optimize", str(empty)]) == 2
    assert "does not define Model or get_inputs" in capsys.readouterr().err


@pytest.mark.skipif(HAS_GPU, reason="without a GPU the command plans only")
def test_optimize_evaluates_a_problem_files_model_before_optimizing(files, capsys):
    # The file's Model is built in training mode (it has a dropout); the command optimizes its inference.
    assert main(["optimize", str(files["problem"]), "--json"]) == 0
    report = _one_json_object(capsys.readouterr().out)
    assert "planned and compiled only" in report["reason"] and "training mode" not in report["reason"]
    assert not [op for op in report["op_counts"] if "dropout" in op or "bernoulli" in op], report["op_counts"]


# ---- llm ping python:MODULE:FN from the current folder ---------------------------------------------------


def test_llm_ping_finds_a_python_backend_in_the_current_folder(subprocess_env, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_models.py").write_text("def answer(messages):\n    return 'pong'\n")
    # A launcher outside that folder, as the installed console script is: Python puts the script's
    # folder on sys.path, not the current one (`python -m` would hide the difference).
    launcher = tmp_path / "bin" / "stitchcuda_launcher.py"
    launcher.parent.mkdir()
    launcher.write_text("import sys\nfrom stitchcuda.cli import main\nsys.exit(main())\n")

    def ping(spec: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(launcher), "llm", "ping", spec, "--json"], cwd=work,
                              env=subprocess_env, capture_output=True, text=True, timeout=120)

    done = ping("python:my_models:answer")
    assert done.returncode == 0, done.stderr
    value = _one_json_object(done.stdout)
    assert value["reply"] == "pong" and value["backend"] == "python:my_models.answer"
    missing = ping("python:not_here:answer")
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    error = _one_json_object(missing.stdout)["error"]
    assert "importing 'not_here' failed" in error and "PYTHONPATH" in error
    wrong = ping("python:my_models:nothing")
    assert wrong.returncode == 1 and "has no attribute 'nothing'" in _one_json_object(wrong.stdout)["error"]


# ---- the repository speaks to its users ------------------------------------------------------------------


def test_no_file_cites_an_internal_issue_number_or_a_design_document_outside_the_repository():
    offenders = []
    for folder in ("python", "docs", "src", "include", "bindings", "examples", "scripts", "tests", "bench"):
        for path in (ROOT / folder).rglob("*"):
            if not path.is_file() or path.suffix not in (".py", ".md", ".cpp", ".hpp", ".h", ".cu", ".txt", ""):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for n, line in enumerate(text.splitlines(), 1):
                if re.search(r"\bissues? \d+\b(?!-)|DESIGN\.md", line) and path.name != Path(__file__).name:
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    for name in ("README.md", "CMakeLists.txt", "Makefile", "pyproject.toml"):
        for n, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bissues? \d+\b|DESIGN\.md", line):
                offenders.append(f"{name}:{n}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)
