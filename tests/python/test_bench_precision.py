"""`stitchcuda bench DIR --precision fp32|tf32|bf16`: torch's flags per problem and their restoration, the
precision in every row and in the JSON, --compile-only planning at that precision, results files that
never mix precisions, the fp64 reference and each column's error against it (on the CPU), the summary's
error ratio, and a timed run at tf32 on a GPU (marked gpu).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from stitchcuda.bench import suite
from stitchcuda.cli import main

from test_bench_dir import LINEAR_GELU, write_problems  # noqa: E402  (the single-process bench tests' problems)

SOFTMAX = '''import torch


class Model(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return torch.softmax(x * self.scale, dim=-1)


def get_inputs():
    return [torch.randn(16, 256)]


def get_init_inputs():
    return [0.5]
'''

# Writes the flags it sees while its row is being made to $STITCHCUDA_TEST_FLAGS, then fails to load.
SEES_FLAGS_THEN_RAISES = '''import json
import os

import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return x


def get_inputs():
    return [torch.randn(4)]


def get_init_inputs():
    with open(os.environ["STITCHCUDA_TEST_FLAGS"], "w") as f:
        json.dump([torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
                   torch.backends.cudnn.allow_tf32], f)
    raise RuntimeError("this problem raises on purpose")
'''

PROBLEMS = {"gemm_linear_gelu": LINEAR_GELU, "op_softmax": SOFTMAX}
EXPECTED_FLAGS = {"fp32": ("highest", False, False), "tf32": ("high", True, True), "bf16": ("medium", True, True)}


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def _flags() -> tuple:
    """torch's precision settings through both of its APIs."""
    knobs = tuple(k.fp32_precision for k in suite.precision_knobs())
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32, knobs)


def _put_back(flags: tuple) -> None:
    """_flags()'s settings again: the legacy flags first, then the per-backend settings they shadow."""
    torch.set_float32_matmul_precision(flags[0])
    torch.backends.cudnn.allow_tf32 = flags[2]
    for knob, value in zip(suite.precision_knobs(), flags[3]):
        knob.fp32_precision = value


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_problems(tmp_path, PROBLEMS)


@pytest.fixture(autouse=True)
def _clean(monkeypatch, stitch_settings):
    for name in ("STITCHCUDA_SUITE_DIR", "STITCHCUDA_SUITE_ONLY", "STITCHCUDA_SUITE_CHUNK"):
        monkeypatch.delenv(name, raising=False)  # for the bench processes the tests start
    stitch_settings(suite_dir=None, suite_only=None, suite_chunk=None)  # and for this one
    before = _flags()
    yield
    assert _flags() == before, "a test left torch's precision flags changed"


# ---- torch's flags ----


@pytest.mark.parametrize("start", ["default", "high", "cudnn off"])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_flags_are_set_for_the_block_and_restored_even_when_it_raises(precision, start):
    previous = _flags()
    try:
        if start == "high":
            torch.set_float32_matmul_precision("high")
        elif start == "cudnn off":
            torch.backends.cudnn.allow_tf32 = False
        before = _flags()
        with pytest.raises(RuntimeError, match="a column failed"):
            with suite.precision_flags(precision) as flags:
                assert flags == suite.TORCH_FLAGS[precision]
                assert _flags()[:3] == EXPECTED_FLAGS[precision]
                raise RuntimeError("a column failed")
        assert _flags() == before
        with suite.precision_flags(precision):
            pass
        assert _flags() == before
    finally:
        _put_back(previous)
    with pytest.raises(ValueError, match="fp32, tf32, bf16"):
        with suite.precision_flags("fp16"):
            pass


def test_a_problem_runs_under_the_flags_and_they_come_back_after_it_raises(folder, tmp_path, monkeypatch, capsys):
    (folder / "op_sees_flags.py").write_text(SEES_FLAGS_THEN_RAISES)
    seen = tmp_path / "flags.json"
    monkeypatch.setenv("STITCHCUDA_TEST_FLAGS", str(seen))
    before = _flags()
    assert main(["bench", str(folder), "--compile-only", "--precision", "bf16", "--only", "op_sees_flags",
                 "--json"]) == 1  # the problem raised: a failed row
    [row] = _strict_json(capsys.readouterr().out)["models"]
    assert "raises on purpose" in row["errors"]["eager"] and row["precision"] == "bf16"
    assert tuple(json.loads(seen.read_text())) == EXPECTED_FLAGS["bf16"]
    assert _flags() == before


# ---- --compile-only at a precision, the JSON, the table ----


@pytest.mark.parametrize("precision, matmuls", [("tf32", "matmuls may use tf32"), ("bf16", "matmuls may use bf16")])
def test_compile_only_plans_at_the_precision_and_says_so(precision, matmuls, folder, tmp_path, capsys):
    results, table = tmp_path / f"{precision}.jsonl", tmp_path / f"{precision}.csv"
    assert main(["bench", str(folder), "--compile-only", "--precision", precision, "--results", str(results),
                 "--csv", str(table), "--json"]) == 0
    report = _strict_json(capsys.readouterr().out)
    assert report["precision"] == precision and report["mode"] == "compile-only"
    assert report["tolerance"] == {"atol": 1e-2, "rtol": 1e-2}  # the Verifier's reduced-precision tolerance
    assert report["torch_flags"] == suite.TORCH_FLAGS[precision]
    rows = {m["model"]: m for m in report["models"]}
    assert set(rows) == set(PROBLEMS)
    for row in rows.values():
        assert row["precision"] == precision and row["status"] == "compiled" and not row["errors"], row
    assert rows["gemm_linear_gelu"]["matmuls"] == matmuls  # OfflinePlanner(precision=...) decided it
    assert rows["gemm_linear_gelu"]["groups"].get("gemm") == 1
    with table.open(newline="") as f:
        assert {line["model"]: line["precision"] for line in csv.DictReader(f)} == dict.fromkeys(PROBLEMS, precision)
    assert {r["precision"] for r in suite.read_results(results).values()} == {precision}

    # The same file again, as text: every row resumed, and the header names the precision and tolerance.
    assert main(["bench", str(folder), "--compile-only", "--precision", precision, "--results", str(results)]) == 0
    text = capsys.readouterr().out
    assert f"precision {suite.PRECISION_WORDS[precision]}" in text and "atol 0.01, rtol 0.01" in text
    assert f"planned with precision={precision} (OfflinePlanner(precision='{precision}')" in text


def test_fp32_stays_true_fp32(folder, capsys):
    assert main(["bench", str(folder), "--compile-only", "--only", "gemm_linear_gelu", "--json"]) == 0
    report = _strict_json(capsys.readouterr().out)
    assert report["precision"] == "fp32" and report["tolerance"] == {"atol": 1e-4, "rtol": 1e-4}
    assert report["torch_flags"] == {"float32_matmul_precision": "highest", "cudnn_allow_tf32": False}
    [row] = report["models"]
    assert row["precision"] == "fp32" and row["matmuls"] == "matmuls in true fp32"


def test_cli_refuses_an_unknown_precision(capsys):
    assert main(["bench", "kernelbench", "--compile-only", "--precision", "fp16"]) == 2
    assert "invalid choice: 'fp16'" in capsys.readouterr().err
    assert suite.run_suite("kernelbench", compile_only=True, precision="fp16", json_output=True) == 2
    assert "--precision must be one of fp32, tf32, bf16" in _strict_json(capsys.readouterr().out)["error"]


# ---- results files never mix precisions ----


def _write_rows(path: Path, *rows: dict) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_results_file_of_another_precision_is_refused(folder, tmp_path, capsys):
    results = tmp_path / "kb.jsonl"
    old = {"model": "op_softmax", "class": "single op", "mode": "compile-only", "errors": {}, "status": "compiled"}
    _write_rows(results, old)  # no precision key: an fp32 row
    text = results.read_text()

    assert main(["bench", str(folder), "--compile-only", "--precision", "tf32", "--results", str(results),
                 "--json"]) == 2
    error = _strict_json(capsys.readouterr().out)["error"]
    assert "holds rows of another precision (1 at fp32)" in error and "this run is --precision tf32" in error
    assert "pass another --results file, or --precision fp32" in error
    assert results.read_text() == text  # nothing measured, nothing appended

    # The same file at fp32 (the default) resumes it: its row counts as done.
    assert main(["bench", str(folder), "--compile-only", "--only", "op_softmax", "--results", str(results),
                 "--json"]) == 0
    report = _strict_json(capsys.readouterr().out)
    assert report["resumed"] == 1 and report["models"][0]["model"] == "op_softmax"

    # Rows a killed --gpus run left beside the file count too, and are left where they are.
    fresh, part = tmp_path / "other.jsonl", tmp_path / "other.jsonl.gpu1"
    _write_rows(part, {**old, "precision": "tf32"}, {**old, "model": "gemm_linear_gelu", "precision": "tf32"})
    assert main(["bench", str(folder), "--compile-only", "--precision", "bf16", "--results", str(fresh)]) == 2
    err = capsys.readouterr().err
    assert "holds rows of another precision (2 at tf32)" in err and part.exists() and not fresh.exists()


def test_read_results_keeps_rows_of_the_precision_asked_for(tmp_path):
    results = tmp_path / "rows.jsonl"
    _write_rows(results, {"model": "a", "mode": "timed"}, {"model": "b", "mode": "timed", "precision": "tf32"})
    assert set(suite.read_results(results, {"mode": "timed", "precision": "fp32"})) == {"a"}
    assert set(suite.read_results(results, {"mode": "timed", "precision": "tf32"})) == {"b"}
    assert suite.precision_conflict(results, "bf16").count(" at ") == 2


# ---- the fp64 reference and the error against it ----


class _Casts(torch.nn.Module):
    def forward(self, x):
        return (x * 2).float()


class _MakesFp32(torch.nn.Module):
    def forward(self, x):
        return x @ torch.ones(x.shape[-1], 3)  # a float32 tensor made inside: no float64 run


def test_fp64_reference_and_each_kind_of_error():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU()).eval()
    x = torch.randn(32, 64)
    with torch.no_grad():
        want = model(x)
    reference, note = suite.fp64_reference(model, (x,), want)
    assert note == "" and reference.dtype == torch.float64 and reference.device.type == "cpu"
    assert model[0].weight.dtype == torch.float32  # the caller's model is untouched

    fp32 = suite.fp64_errors(want, reference, "fp32")
    assert 0 < fp32["max_rel"] < 1e-5 and fp32["tolerance_used"] < 1
    assert fp32["max_abs"] == pytest.approx(float((want.double() - reference).abs().max()))
    assert fp32["max_rel"] == pytest.approx(fp32["max_abs"] / float(reference.abs().max()))

    # An output rounded to bf16: outside the fp32 tolerance of exact arithmetic, inside the reduced one.
    rounded = want.bfloat16().float()
    at_fp32, at_bf16 = suite.fp64_errors(rounded, reference, "fp32"), suite.fp64_errors(rounded, reference, "bf16")
    assert at_fp32["max_rel"] > 100 * fp32["max_rel"] and at_fp32["max_rel"] == at_bf16["max_rel"]
    assert at_fp32["tolerance_used"] > 1 >= at_bf16["tolerance_used"]

    nan = want.clone()
    nan[0, 0] = float("nan")
    assert suite.fp64_errors(nan, reference)["max_abs"] == math.inf
    assert suite.fp64_errors(want[:4], reference)["max_rel"] == math.inf  # another shape
    assert suite.fp64_errors((want, want), reference)["max_abs"] == math.inf  # another number of outputs
    assert suite.fp64_errors(torch.tensor([1]), torch.tensor([1])) is None  # nothing floating to compare

    none, why = suite.fp64_reference(model, (x,), want, budget=1000)
    assert none is None and why.startswith("skipped: the float64 weights, inputs and outputs would take")
    none, why = suite.fp64_reference(_MakesFp32(), (x,), x @ torch.ones(64, 3))
    assert none is None and why.startswith("skipped: the model does not run in float64 (RuntimeError")
    cast, why = suite.fp64_reference(_Casts(), (x,), x)
    assert cast.dtype == torch.float32 and "the model casts" in why


def _row(name: str, eager: float, stitch: float | None, compile_: float | None = None) -> dict:
    errors = {"eager": {"max_abs": eager, "max_rel": eager, "tolerance_used": 0.1}}
    if stitch is not None:
        errors["stitch"] = {"max_abs": stitch, "max_rel": stitch, "tolerance_used": 0.1}
    if compile_ is not None:
        errors["compile"] = {"max_abs": compile_, "max_rel": compile_, "tolerance_used": 0.1}
    return {"model": name, "class": suite.problem_class(name), "mode": "timed", "precision": "tf32", "errors": {},
            "correct": True, "status": "optimized", "eager_ms": 2.0, "stitch_ms": 1.0, "speedup_stitch": 2.0,
            "err_fp64": errors}


def test_summary_table_and_csv_carry_the_error_against_fp64(tmp_path):
    rows = [_row("op_a", 1e-3, 2e-3, 1e-3), _row("op_b", 1e-3, 5e-4), _row("gemm_c", 0.0, 0.0, 0.0),
            {**_row("gemm_d", 1e-3, None), "err_fp64": None, "fp64_note": "skipped: the float64 weights ... budget"}]
    summary = suite.full_summary(rows)
    overall = summary["overall"]
    assert overall["err_ratio_stitch_eager_median"] == pytest.approx(1.0)  # median of 2, 0.5, 1 (both exact)
    assert overall["models_with_err_ratio_stitch_eager"] == 3
    assert overall["err_ratio_compile_eager_median"] == pytest.approx(1.0)
    assert overall["err_fp64_median"]["eager"] == pytest.approx(1e-3)
    assert summary["classes"]["single op"]["err_ratio_stitch_eager_median"] == pytest.approx(1.25)
    assert suite.error_ratio(_row("x", 0.0, 1e-6)) == math.inf

    text = suite.format_table(rows, summary, "test device")
    assert "precision tf32: TF32 matmuls" in text and "atol 0.01, rtol 0.01" in text
    assert "    vs fp64 (max rel): eager 1.00e-03, compile 1.00e-03, stitch 2.00e-03" in text
    assert "    vs fp64: skipped: the float64 weights" in text
    assert "StitchCUDA / eager median 1.00x over 3 problem(s)" in text

    table = tmp_path / "rows.csv"
    suite.write_csv(table, rows)
    with table.open(newline="") as f:
        lines = {line["model"]: line for line in csv.DictReader(f)}
    assert float(lines["op_a"]["err_fp64_stitch_max_rel"]) == 2e-3
    assert lines["op_a"]["err_fp64_reduce_overhead_max_abs"] == ""  # that column has no error recorded
    assert lines["gemm_d"]["fp64_note"].startswith("skipped") and lines["op_a"]["precision"] == "tf32"


def test_run_model_at_tf32_measures_every_column_against_fp64_on_the_cpu(folder, monkeypatch):
    """The timed path with its GPU-only parts replaced (no .cuda(), a fixed timer and peak) and Inductor by
    dynamo's eager backend (no GPU here); optimize() is the real one, which plans only without a GPU and
    keeps the model: StitchCUDA's error is then eager's."""
    compile_ = torch.compile
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, device=None: self)
    monkeypatch.setattr(suite, "_to_gpu", tuple)
    monkeypatch.setattr(suite, "_time_ms", lambda fn, warmup=3, repeats=30: (fn(), 1.0)[1])
    monkeypatch.setattr(suite, "_peak_bytes", lambda fn: (fn(), 1000))
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: compile_(model, backend="eager"))
    with suite.precision_flags("tf32"):
        row = suite.run_model(folder / "gemm_linear_gelu.py", precision="tf32")
    assert row["precision"] == "tf32" and row["errors"] == {}, row
    assert row["status"] == "eager" and row["matmuls"] == "matmuls may use tf32"
    errors = row["err_fp64"]
    assert set(errors) == {"eager", "compile", "reduce_overhead", "stitch"}
    for column, e in errors.items():
        assert 0 < e["max_rel"] < 1e-2 and e["tolerance_used"] <= 1, (column, e)
    assert errors["stitch"] == errors["eager"]


# ---- on a GPU ----

GEMM = LINEAR_GELU.replace("torch.randn(32, 64)", "torch.randn(512, 1024)").replace("[64, 96]", "[1024, 1024]")
assert "randn(512, 1024)" in GEMM and "[1024, 1024]" in GEMM  # a GEMM big enough for TF32 to show


@pytest.mark.gpu
def test_timed_run_at_tf32_has_every_columns_error_against_fp64(tmp_path, capsys):
    (tmp_path / "problems").mkdir()
    (tmp_path / "problems" / "gemm_tf32.py").write_text(GEMM)
    table = tmp_path / "tf32.csv"
    before = _flags()
    assert main(["bench", str(tmp_path / "problems"), "--precision", "tf32", "--csv", str(table), "--json"]) == 0
    assert _flags() == before
    report = _strict_json(capsys.readouterr().out)
    assert report["precision"] == "tf32" and report["tolerance"] == {"atol": 1e-2, "rtol": 1e-2}
    [row] = report["models"]
    assert row["precision"] == "tf32" and row["correct"] is True and "fp64_note" not in row, row
    assert row["matmuls"] == "matmuls may use tf32"
    errors = row["err_fp64"]
    assert set(errors) == {"eager", "compile", "reduce_overhead", "stitch"}, row
    atol, rtol = suite.tolerance("tf32")
    for column, e in errors.items():
        assert math.isfinite(e["max_abs"]) and 0 < e["max_rel"] < rtol, (column, e)
    assert errors["stitch"]["tolerance_used"] <= 1.0  # within the tf32 tolerance of exact arithmetic
    # TF32 was on for eager: true fp32 would be within ~1e-6 of fp64 on K = 1024, TF32 is near 1e-3.
    assert errors["eager"]["max_rel"] > 1e-5
    assert report["summary"]["overall"]["models_with_err_ratio_stitch_eager"] == 1
    with table.open(newline="") as f:
        [line] = list(csv.DictReader(f))
    assert line["precision"] == "tf32" and float(line["err_fp64_stitch_max_rel"]) == errors["stitch"]["max_rel"]
