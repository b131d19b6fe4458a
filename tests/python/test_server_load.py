"""scripts/server-load without a GPU: its argument handling, and its whole serving run — a real server
process (the server's command line and HTTP front with the tests' CPU runner, tests/cpp/server/cpu_server.cpp),
the real load client, answers checked against PyTorch, lost requests counted, bad requests refused with
their 4xx while the server stays up, the drain at SIGTERM, the table — on a linear model built here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stitchcuda import ProgramBuilder
from stitchcuda.program import ProgramFamily
from stitchcuda.verify.cli import load_problem

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "server-load"
K, N, MAX_BATCH = 48, 24, 8

LINEAR_MODEL = f'''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.lin = nn.Linear(k, n)

    def forward(self, x):
        return self.lin(x)

def get_inputs():
    return [torch.randn({MAX_BATCH}, {K})]

def get_init_inputs():
    return [{K}, {N}]
'''


def built(name: str) -> Path:
    for folder in (os.environ.get("STITCHCUDA_GPU_BUILD"), ROOT / "build", ROOT / "build-gpu"):
        if folder and (Path(folder) / "tests" / "cpp" / name).is_file():
            return Path(folder) / "tests" / "cpp" / name
    pytest.skip(f"{name} is not built (tests/cpp/server/tests.cmake builds it where cpp-httplib is found)")


def run(args: list, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


def linear(batch: int, weight: torch.Tensor, bias: torch.Tensor):
    b = ProgramBuilder()
    x = b.input([batch, K], name="x")
    w = b.weight(weight.detach().contiguous(), name="w")
    bb = b.weight(bias.detach().contiguous(), name="bias")
    y = b.output([batch, N], name="y")
    b.matmul(x, w, y, bias=bb, transpose_b=True, epilogue="bias")
    return b.build()


@pytest.fixture
def served(tmp_path: Path):
    """The model file, a family of its linear layer for batches 1..MAX_BATCH, and a program of it as the
    stand-in's "eager twin"; `wrong_eager` holds other weights."""
    model_file = tmp_path / "linear.py"
    model_file.write_text(LINEAR_MODEL)
    lin = load_problem(model_file).build_reference(0).lin  # the weights the script's reference holds
    batch = dict(name="batch", min=1, max=MAX_BATCH, pad=True, inputs=[(0, 0)], outputs=[(0, 0)])
    stitched = tmp_path / "linear.stitch"
    ProgramFamily([batch], [((n,), linear(n, lin.weight, lin.bias)) for n in (1, 2, 4, 8)]).save(stitched)
    eager = tmp_path / "eager.stitch"
    linear(MAX_BATCH, lin.weight, lin.bias).save(eager)
    wrong_eager = tmp_path / "wrong.stitch"
    linear(MAX_BATCH, lin.weight + 0.5, lin.bias).save(wrong_eager)
    return {"model": model_file, "stitched": stitched, "eager": eager, "wrong_eager": wrong_eager}


def common(served: dict, tmp_path: Path) -> list:
    return ["--server", built("stitchcuda_server_cpu"), "--load", built("stitchcuda_server_load"),
            "--model", served["model"], "--stitched", served["stitched"], "--requests", 600, "--clients", 8,
            "--seconds", 60, "--warmup", 40, "--max-batch", MAX_BATCH, "--out", tmp_path / "out",
            "--build", tmp_path / "build"]


def test_a_run_checks_every_answer_refuses_bad_requests_and_prints_the_table(served, tmp_path, subprocess_env):
    done = run([*common(served, tmp_path), "--eager", served["eager"]], subprocess_env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    head = lines.index(next(ln for ln in lines if ln.startswith("runner ")))
    for name, line in zip(("stitchcuda", "eager"), lines[head + 1:head + 3]):
        assert line.split()[0] == name and line.split()[1] == "600" and line.endswith("ok"), line
        assert line.split()[6:9] == ["0", "0", "0"], line  # failed, wrong, lost
        assert "11/11" in line, line                       # ten kinds of bad request and the good one after them
    assert lines[head + 3].startswith("stitchcuda / eager: throughput ")
    rows = json.loads((tmp_path / "out" / "server_load.json").read_text())["rows"]
    assert [r["runner"] for r in rows] == ["stitchcuda", "eager"]
    # Few files in --out (a GPU call brings back eight at most): the samples stay beside the build.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "load_eager.log", "load_stitchcuda.log", "server_eager.log", "server_load.json", "server_stitchcuda.log"]
    assert len(json.loads((tmp_path / "build" / "server-load" / "samples.json").read_text())) == 64
    for r in rows:
        assert r["errors"] == [] and r["exit"] == 0 and r["requests"] == 600 and r["throughput_rps"] > 0
        assert r["p99_ms"] >= r["p50_ms"] > 0
        statuses = {b["case"]: (b["status"], b["reason"]) for b in r["bad_requests"]}
        assert statuses["malformed JSON"][0] == 400 and statuses["oversized body"][0] == 413
        assert statuses["wrong content type"][0] == 415 and statuses["unknown path"][0] == 404
        assert "shape" in statuses["wrong shape"][1] and "dtype" in statuses["wrong dtype"][1]
        assert all(b["up"] for b in r["bad_requests"])
    # The family ran each batch at its own size: no zero rows; batches held several requests.
    assert rows[0]["padded_rows"] == 0 and rows[0]["mean_batch"] > 1


def test_a_wrong_answer_fails_the_run(served, tmp_path, subprocess_env):
    done = run([*common(served, tmp_path), "--eager", served["wrong_eager"]], subprocess_env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED eager: " in done.stderr and " wrong" in done.stderr, done.stderr
    assert "FAILED stitchcuda" not in done.stderr, done.stderr
    rows = json.loads((tmp_path / "out" / "server_load.json").read_text())["rows"]
    assert rows[0]["wrong"] == 0 and rows[1]["wrong"] > 0


def test_a_server_that_cannot_serve_fails_the_run_with_its_reason(served, tmp_path, subprocess_env):
    not_linear = tmp_path / "relu.stitch"
    b = ProgramBuilder()
    x = b.input([MAX_BATCH, K], name="x")
    y = b.output([MAX_BATCH, K], name="y")
    b.aten("aten::relu", [x], [y])
    b.build().save(not_linear)
    done = run([*common(served, tmp_path), "--eager", not_linear], subprocess_env)
    assert done.returncode == 1
    assert "the eager server did not start listening" in done.stderr and "one step, a matmul" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["--server", "/bin/true"], "--server and --load go together"),
    (["--stitched", __file__], "--stitched and --eager go together"),
    (["--requests", "0"], "--requests: needs a positive whole number, got '0'"),
    (["--clients", "many"], "--clients: needs a positive whole number, got 'many'"),
    (["--model", "/no/such/model.py"], "--model /no/such/model.py: no such file"),
    (["--max-wait-us", "-1"], "--max-wait-us needs a number >= 0"),
])
def test_bad_usage_says_what_is_wrong(args, message, subprocess_env):
    done = run(args, subprocess_env, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_help_names_the_steps(subprocess_env):
    done = run(["--help"], subprocess_env, timeout=60)
    assert done.returncode == 0 and "--requests" in done.stdout and "export_eager.py" in done.stdout
