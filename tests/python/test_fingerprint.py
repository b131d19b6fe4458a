"""The fingerprint command (python -m stitchcuda.bench.fingerprint) on two small bench problems, on the CPU:
the same JSON twice, a hash over its problems, and nothing in it that varies between runs or machines."""

from __future__ import annotations

import json
import re

import pytest

from stitchcuda.bench import fingerprint as fp

PROBLEMS = "gemm_bias_relu,conv_bn_relu"


@pytest.fixture(scope="module")
def two():
    return fp.problem_paths(["suite"], PROBLEMS)


def test_two_problems_fingerprint_the_same_twice(two):
    first, second = fp.fingerprint(two), fp.fingerprint(two)
    assert [key for key, _ in two] == ["suite/conv_bn_relu", "suite/gemm_bias_relu"]
    assert fp.canonical(first) == fp.canonical(second)
    assert first["hash"] == fp._sha(fp.canonical(first["problems"]))
    assert first["schema"] == fp.SCHEMA


def test_a_fingerprint_holds_the_plan_kernels_launches_and_steps(two):
    problems = fp.fingerprint(two)["problems"]
    conv = problems["suite/conv_bn_relu"]
    assert "error" not in conv and conv["ops"]["aten::convolution"] == 1
    kernels = [g["kernel"] for g in conv["plan"]["groups"] if "kernel" in g]
    assert kernels and all(re.fullmatch(r"[0-9a-f]{64}", k["source_sha256"]) and k["grid"] and k["block"]
                           for k in kernels)
    assert any(s["kind"] == "kernel" for s in conv["program"]["steps"])
    gemm = problems["suite/gemm_bias_relu"]
    assert [s["kind"] for s in gemm["program"]["steps"]] == ["matmul"]
    assert gemm["program"]["steps"][0]["epilogue"] == "bias_relu"  # the ReLU went into cuBLASLt's epilogue


def test_the_output_names_no_path_address_or_time(two, tmp_path, capsys):
    out = tmp_path / "fp.json"
    assert fp.main(["--bench", "suite", "--only", PROBLEMS, "--out", str(out)]) == 0
    text = out.read_text()
    assert json.loads(text)["hash"] in capsys.readouterr().err
    assert str(fp.suite.default_dir("suite")) not in text and "/work/" not in text and not re.search(r"0x[0-9a-f]{6,}", text)
    assert not re.search(r'"[a-z_]*(seconds|_s|_ms|time)"\s*:', text)


def test_an_unknown_problem_is_refused(capsys):
    assert fp.main(["--bench", "suite", "--only", "no_such_problem"]) == 2
    assert "no problem matches" in capsys.readouterr().err
