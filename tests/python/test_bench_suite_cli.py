"""`stitchcuda bench suite` / `bench kernelbench` without a GPU: the problem classes, the selection by
--only / --chunk (flags over the environment), the per-class and overall summary over synthetic rows, the
resumable results file, one problem's orchestration (three input sets, an out-of-memory column) with the
GPU parts replaced, and the command line's flags and its no-GPU answer (valid JSON under --json).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stitchcuda import graph as stitch_graph
from stitchcuda.bench import suite
from stitchcuda.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]

PROBLEM = '''import torch


class Model(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x * self.w


def get_inputs():
    return [torch.randn(8, 16)]


def get_init_inputs():
    return [16]
'''
STEMS = ["conv_b", "gemm_c", "net_d", "op_a", "other_e"]


def _strict_json(text: str):
    """json.loads that refuses NaN / Infinity (not JSON, though Python writes them by default)."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    d = tmp_path / "problems"
    d.mkdir()
    for stem in STEMS:
        (d / f"{stem}.py").write_text(PROBLEM)
    (d / "_helpers.py").write_text("")  # not a problem: leading underscore
    return d


@pytest.fixture
def fake_gpu(monkeypatch, stitch_settings):
    """A run without a GPU: run_model returns a synthetic row per problem and records which it ran."""
    ran: list[str] = []

    def run_model(path: Path) -> dict:
        ran.append(path.stem)
        if path.stem == "net_d":
            raise RuntimeError("a bug in the bench itself")
        row = {"model": path.stem, "class": suite.problem_class(path.stem), "errors": {}, "eager_ms": 2.0,
               "compile_ms": 1.0, "stitch_ms": 1.0, "correct": True, "status": "optimized",
               "max_abs_error": math.inf, "optimize_s": 3.0, "memory_ratio": 0.5}
        return suite.add_speedups(row)

    for name in ("STITCHCUDA_SUITE_DIR", "STITCHCUDA_SUITE_ONLY", "STITCHCUDA_SUITE_CHUNK"):
        monkeypatch.delenv(name, raising=False)
    stitch_settings(suite_dir=None, suite_only=None, suite_chunk=None)  # this process reads stitchcuda.settings
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(suite, "run_model", run_model)
    monkeypatch.setattr(suite, "_free_gpu", lambda: None)
    return ran


# ---- classes and selection ----


@pytest.mark.parametrize("stem, cls", [
    ("op_softmax_large", "single op"), ("conv_bn_relu", "conv + epilogue"), ("gemm_bias_gelu", "GEMM + epilogue"),
    ("net_resnet_block", "whole network"), ("model_mlp", "whole network"), ("conv1x1_sigmoid_gate", "other"),
    ("attention_sdpa", "other"), ("op", "other"), ("softmax", "other"), ("GEMM_upper", "other")])
def test_problem_class_is_the_prefix_before_the_first_underscore(stem, cls):
    assert suite.problem_class(stem) == cls


def test_selection_by_only_and_chunk(folder):
    assert [p.stem for p in suite.model_files(folder)] == STEMS
    assert [p.stem for p in suite.model_files(folder, " op_a,gemm_c , missing")] == ["gemm_c", "op_a"]
    chunks = [[p.stem for p in suite.model_files(folder, chunk=f"{k}/2")] for k in (1, 2)]
    assert chunks == [["conv_b", "net_d", "other_e"], ["gemm_c", "op_a"]]
    assert [p.stem for p in suite.model_files(folder, "conv_b,net_d,op_a", "2/2")] == ["net_d"]
    for bad in ("0/2", "3/2", "2", "a/b", "1/0"):
        with pytest.raises(ValueError, match="K/N"):
            suite.parse_chunk(bad)
        with pytest.raises(SystemExit, match="STITCHCUDA_SUITE_CHUNK must be K/N"):
            suite.model_files(folder, chunk=bad)


def test_default_folders(stitch_settings):
    stitch_settings(STITCHCUDA_SUITE_DIR="/elsewhere")
    assert suite.default_dir("suite") == Path("/elsewhere")
    # The suite's variable does not redirect kernelbench: its folder is the repository's bench/kernelbench.
    kb = ROOT / "bench" / "kernelbench"
    assert suite.default_dir("kernelbench") == (kb if kb.is_dir() else None)
    stitch_settings(STITCHCUDA_SUITE_DIR=None)
    assert suite.default_dir("suite") == ROOT / "bench" / "suite"


def test_flags_win_over_the_environment(folder, fake_gpu, stitch_settings, capsys):
    stitch_settings(STITCHCUDA_SUITE_ONLY="op_a,conv_b")
    stitch_settings(STITCHCUDA_SUITE_CHUNK="2/2")
    assert suite.run_suite("suite", folder=folder, json_output=True) == 0
    assert fake_gpu == ["op_a"]  # the environment's selection: conv_b, op_a, then the second of 2
    fake_gpu.clear()
    assert suite.run_suite("suite", folder=folder, only="gemm_c,other_e", chunk="1/1", json_output=True) == 0
    assert fake_gpu == ["gemm_c", "other_e"]
    out = capsys.readouterr().out.strip().splitlines()
    assert [[m["model"] for m in _strict_json(line)["models"]] for line in out] == [["op_a"], ["gemm_c", "other_e"]]


def test_suite_dir_from_the_environment_and_a_bad_chunk_from_it(folder, fake_gpu, stitch_settings, capsys):
    stitch_settings(STITCHCUDA_SUITE_DIR=str(folder))
    stitch_settings(STITCHCUDA_SUITE_CHUNK="3/2")
    assert suite.run(json_output=True) == 2
    assert "K/N" in _strict_json(capsys.readouterr().out)["error"] and fake_gpu == []
    stitch_settings(STITCHCUDA_SUITE_CHUNK="1/5")
    assert suite.run(json_output=True) == 0  # run() (scripts/gpu-check's call) takes folder and chunk from the env
    assert fake_gpu == ["conv_b"]
    report = _strict_json(capsys.readouterr().out)
    assert report["suite_dir"] == str(folder) and report["device"] == "fake GPU"


# ---- summary ----


def _synthetic_rows() -> list[dict]:
    rows = [
        # 2x compile, 4x reduce-overhead (best), 2x StitchCUDA: 0.5x the best mode
        {"model": "op_a", "eager_ms": 1.0, "compile_ms": 0.5, "reduce_overhead_ms": 0.25, "stitch_ms": 0.5,
         "correct": True, "status": "optimized", "optimize_s": 10.0, "memory_ratio": 0.5},
        # compile 1x (best), reduce-overhead 0.5x, StitchCUDA 0.9x: slower than eager
        {"model": "op_b", "eager_ms": 1.0, "compile_ms": 1.0, "reduce_overhead_ms": 2.0, "stitch_ms": 1.0 / 0.9,
         "correct": True, "status": "optimized", "optimize_s": 20.0, "memory_ratio": 1.5,
         "memory_ratio_forward": 0.9},
        # compile 2x, no reduce-overhead (it failed), StitchCUDA 8x but wrong: counts as 1x
        {"model": "gemm_c", "eager_ms": 2.0, "compile_ms": 1.0, "stitch_ms": 0.25, "correct": False,
         "status": "optimized", "optimize_s": 30.0, "memory_ratio": 1.0,
         "errors": {"reduce_overhead": "OutOfMemoryError: CUDA out of memory."}},
        # eager itself failed: counted, never correct, in no geomean
        {"model": "net_d", "correct": False, "errors": {"eager": "RuntimeError: x"}},
    ]
    for r in rows:
        r["class"] = suite.problem_class(r["model"])
        suite.add_speedups(r)
    return rows


def test_speedups_and_best_compile_mode_per_problem():
    a, b, c, d = _synthetic_rows()
    assert (a["best_compile_mode"], a["best_compile_ms"]) == ("reduce-overhead", 0.25)
    assert a["speedup_best_compile"] == pytest.approx(4.0) and a["stitch_vs_best_compile"] == pytest.approx(0.5)
    assert (b["best_compile_mode"], b["speedup_best_compile"]) == ("default", pytest.approx(1.0))
    assert b["speedup_reduce_overhead"] == pytest.approx(0.5) and b["speedup_stitch"] == pytest.approx(0.9)
    assert c["best_compile_mode"] == "default" and c["speedup_stitch"] == pytest.approx(8.0)
    assert "best_compile_mode" not in d and "speedup_stitch" not in d


def test_summary_by_hand():
    s = suite.full_summary(_synthetic_rows())
    o = s["overall"]
    assert (o["models"], o["correct"], o["optimized"]) == (4, 2, 3)
    assert o["geomean_speedup_compile"] == pytest.approx((2 * 1 * 2) ** (1 / 3))
    assert o["geomean_speedup_reduce_overhead"] == pytest.approx((4 * 0.5) ** 0.5)
    assert o["geomean_speedup_best_compile"] == pytest.approx((4 * 1 * 2) ** (1 / 3))  # per problem: 4, 1, 2
    assert o["geomean_speedup_stitch"] == pytest.approx((2 * 0.9 * 1) ** (1 / 3))  # gemm_c wrong: 1x, not 8x
    assert o["geomean_stitch_vs_best_compile"] == pytest.approx((0.5 * 0.9 * 0.5) ** (1 / 3))  # 2/4, .9/1, 1/2
    assert o["models_with_speedup_stitch"] == 3 and o["models_with_speedup_best_compile"] == 3
    assert o["slower_than_eager"] == 1  # op_b at 0.9x; gemm_c's wrong 8x is not a slowdown
    assert (o["optimize_s_median"], o["optimize_s_max"]) == (20.0, 30.0)
    assert (o["memory_over_target"], o["models_with_memory_ratio"]) == (1, 3)  # 1.5 only; 1.0 meets the target
    assert o["memory_over_target_forward"] == 0  # op_b: 0.9 against the forward's largest tensor

    assert list(s["classes"]) == ["single op", "GEMM + epilogue", "whole network"]
    ops, gemm, net = s["classes"].values()
    assert (ops["models"], ops["correct"], ops["slower_than_eager"], ops["memory_over_target"]) == (2, 2, 1, 1)
    assert ops["geomean_speedup_best_compile"] == pytest.approx(2.0)  # sqrt(4 x 1)
    assert ops["geomean_speedup_stitch"] == pytest.approx(1.8 ** 0.5)
    assert (gemm["correct"], gemm["geomean_speedup_stitch"]) == (0, pytest.approx(1.0))
    assert gemm["geomean_speedup_reduce_overhead"] is None
    assert net["models"] == 1 and net["geomean_speedup_compile"] is None and net["optimize_s_median"] is None


def test_slower_than_eager_threshold_is_strict():
    rows = [suite.add_speedups({"model": f"op_{i}", "eager_ms": x, "stitch_ms": 1.0, "correct": True})
            for i, x in enumerate((0.98, 0.979, 1.0, 0.5))]
    assert suite.summarize(rows)["slower_than_eager"] == 2


def test_table_has_problem_rows_a_class_table_and_the_overall_line():
    rows = _synthetic_rows()
    text = suite.format_table(rows, suite.full_summary(rows), "test device", title="bench kernelbench")
    lines = text.splitlines()
    assert "bench kernelbench on test device" in lines[0]
    at = {name: next(i for i, line in enumerate(lines) if line.startswith(name))
          for name in ("op_a", "net_d", "single op", "GEMM + epilogue", "whole network", "overall",
                       "geomean speed-up")}
    assert at["op_a"] < at["net_d"] < at["single op"] < at["GEMM + epilogue"] < at["whole network"] < at["overall"]
    assert at["overall"] < at["geomean speed-up"]
    assert lines[at["overall"]].split()[1:3] == ["4", "2"]  # models, correct
    assert "reduce_overhead error: OutOfMemoryError" in text and "eager error: RuntimeError: x" in text
    assert "memory ratio > 1: 1/3" in text and "best compile mode 2.000x" in text
    assert "intermediates included: 0)" in text  # op_b is within the target read with the forward's tensor
    assert lines[at["single op"]].split()[-2:] == ["1", "0"]  # mem>1, fwd>1


# ---- one problem, with the GPU parts replaced ----


class _Fast:
    """optimize()'s result: `program(x)` computes, the report says optimized."""

    def __init__(self, program):
        self.program, self._fn = None, program
        self.report = SimpleNamespace(status="optimized", reason="", fallbacks=[],
                                      groups=[{"kind": "pointwise"}, {"kind": "gemm"}, {"kind": "pointwise"}],
                                      stage_peak_bytes={"capture": 100, "verify": 900})

    def __call__(self, *args):
        return self._fn(*args)

    def release(self):  # OptimizedModule's: the program's buffers go before eager is timed again
        self.released = True


@pytest.fixture
def cpu_columns(monkeypatch):
    """run_model on the CPU: no .cuda(), a fixed timer and peak, torch.compile replaced by `compiled`."""
    state = {"optimize": None, "compile_errors": {}}
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, device=None: self)
    monkeypatch.setattr(suite, "_to_gpu", tuple)
    monkeypatch.setattr(suite, "_time_ms", lambda fn, warmup=3, repeats=30: (fn(), 1.0)[1])
    monkeypatch.setattr(suite, "_peak_bytes", lambda fn: (fn(), 1000))

    def compiled(model, inputs, mode):
        if mode in state["compile_errors"]:
            raise state["compile_errors"][mode]
        return (0.5 if mode is None else 0.8), 2.0

    monkeypatch.setattr(suite, "_compiled_ms", compiled)
    monkeypatch.setattr(stitch_graph, "optimize", lambda model, inputs, **kw: state["optimize"](model, inputs))
    return state


def test_run_model_checks_three_input_sets_and_records_memory(folder, cpu_columns):
    cpu_columns["optimize"] = lambda model, inputs: _Fast(lambda x: model(x))
    row = suite.run_model(folder / "gemm_c.py")
    assert row["class"] == "GEMM + epilogue" and row["correct"] is True
    assert [s["inputs"] for s in row["input_sets"]] == ["example", "seed=1", "seed=2"]
    assert all(s["correct"] and s["max_abs_error"] == 0.0 for s in row["input_sets"])
    assert (row["eager_peak_bytes"], row["optimize_peak_bytes"]) == (1000, 1000)
    assert row["largest_tensor_bytes"] == 8 * 16 * 4  # the input and the output: fp32 [8, 16]
    assert row["memory_ratio"] == pytest.approx(1000 / (1000 + 2 * 512))
    largest = row["forward_largest_tensor_bytes"]  # an intermediate of the forward may be larger
    assert largest >= 512 and row["memory_ratio_forward"] == pytest.approx(1000 / (1000 + 2 * largest))
    assert row["stage_peak_bytes"] == {"capture": 100, "verify": 900}  # where optimize's peak was reached
    assert (row["best_compile_mode"], row["speedup_compile"], row["speedup_stitch"]) == ("default", 2.0, 1.0)
    assert row["groups"] == {"gemm": 1, "pointwise": 2} and row["errors"] == {}
    # Eager timed again after StitchCUDA's column, the program's buffers released first.
    assert row["eager_after_ms"] == 1.0
    summary = suite.summarize([row, dict(row, eager_after_ms=1.2), dict(row, eager_after_ms=0.99)])
    assert (summary["eager_drifted"], summary["models_with_eager_after"]) == (1, 3)


def test_a_program_right_for_the_example_inputs_only_is_wrong(folder, cpu_columns):
    def baked(model, inputs):
        answer = model(*inputs).detach().clone()
        return _Fast(lambda x: answer)  # the example's result, whatever the inputs

    cpu_columns["optimize"] = baked
    row = suite.run_model(folder / "op_a.py")
    assert [s["correct"] for s in row["input_sets"]] == [True, False, False]
    assert row["correct"] is False and row["mismatch"].startswith("seed=1: output 0")
    assert suite.summarize([row])["geomean_speedup_stitch"] == 1.0  # wrong: 1x whatever its time


def test_out_of_memory_is_a_column_error_and_the_run_goes_on(folder, cpu_columns):
    cpu_columns["compile_errors"]["reduce-overhead"] = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried")

    def oom(model, inputs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")

    cpu_columns["optimize"] = oom
    row = suite.run_model(folder / "conv_b.py")
    assert row["errors"]["reduce_overhead"].startswith("OutOfMemoryError: CUDA out of memory")
    assert row["errors"]["stitchcuda"].startswith("OutOfMemoryError: CUDA out of memory")
    assert row["compile_ms"] == 0.5 and row["eager_ms"] == 1.0 and row["correct"] is False
    assert row["best_compile_mode"] == "default" and "stitch_ms" not in row


def test_fallback_to_eager_is_correct_on_every_set(folder, cpu_columns):
    fast = _Fast(lambda x: x)
    fast.report.status, fast.report.reason = "eager", "capture failed"
    cpu_columns["optimize"] = lambda model, inputs: fast
    row = suite.run_model(folder / "net_d.py")
    assert row["correct"] is True and row["stitch_ms"] == row["eager_ms"] and len(row["input_sets"]) == 3


# ---- results file: resume ----


def test_resume_skips_finished_problems_and_summarizes_the_whole_file(folder, fake_gpu, tmp_path, capsys):
    results = tmp_path / "out" / "rows.jsonl"
    results.parent.mkdir()
    earlier = [{"model": "op_a", "class": "single op", "correct": True, "eager_ms": 1.0, "stitch_ms": 0.5,
                "speedup_stitch": 2.0, "errors": {}},
               {"model": "gemm_c", "class": "GEMM + epilogue", "correct": False, "errors": {}},
               {"model": "not_selected", "correct": True, "speedup_stitch": 100.0, "errors": {}}]
    results.write_text("".join(json.dumps(r) + "\n" for r in earlier) + '{"model": "conv_b", "eag')  # killed

    # gemm_c (from the file) is wrong and net_d raises: the run's answer is no.
    assert suite.run_suite("kernelbench", folder=folder, results=results, json_output=True) == 1
    assert fake_gpu == ["conv_b", "net_d", "other_e"]  # op_a and gemm_c were in the file
    captured = capsys.readouterr()
    report = _strict_json(captured.out)
    assert [m["model"] for m in report["models"]] == STEMS and report["resumed"] == 2
    assert report["summary"]["overall"]["models"] == 5 and report["summary"]["overall"]["correct"] == 3
    assert report["summary"]["classes"]["single op"]["geomean_speedup_stitch"] == pytest.approx(2.0)
    net = next(m for m in report["models"] if m["model"] == "net_d")
    assert net["errors"]["bench"].startswith("RuntimeError: a bug") and net["correct"] is False  # the run went on
    assert report["models"][0]["max_abs_error"] is None  # inf is not JSON
    assert captured.err.count("[suite-row] ") == 3

    lines = results.read_text().splitlines()
    assert lines[3] == '{"model": "conv_b", "eag'  # the cut-off line stays alone, and is skipped
    assert [_strict_json(line)["model"] for line in lines[4:]] == ["conv_b", "net_d", "other_e"]
    assert set(suite.read_results(results)) == {"op_a", "gemm_c", "not_selected", "conv_b", "net_d", "other_e"}

    fake_gpu.clear()
    assert suite.run_suite("kernelbench", folder=folder, only="op_a,net_d", results=results) == 1  # net_d raised
    assert fake_gpu == []  # everything selected is in the file
    text = capsys.readouterr().out
    assert "op_a" in text and "net_d" in text and "conv_b" not in text  # the table covers the selection only


def test_the_gpu_is_freed_after_every_problem_even_a_failed_one(folder, fake_gpu, monkeypatch, capsys):
    events: list[str] = []
    monkeypatch.setattr(suite, "_free_gpu", lambda: events.append(f"free after {fake_gpu[-1]}"))
    # net_d raised: the run's answer is no (exit 1), and the GPU was freed after it all the same.
    assert suite.run_suite("suite", folder=folder, only="gemm_c,net_d,op_a", json_output=True) == 1
    assert events == ["free after gemm_c", "free after net_d", "free after op_a"]


def test_without_results_nothing_is_written(folder, fake_gpu, tmp_path, capsys):
    assert suite.run_suite("suite", folder=folder, only="op_a", json_output=False) == 0
    out, err = capsys.readouterr()
    assert "[suite] op_a: done" in err and "geomean speed-up" in out  # progress on stderr, the table on stdout
    assert not list(tmp_path.rglob("*.jsonl"))


# ---- the command line ----


def test_cli_parses_the_new_flags(tmp_path):
    args = build_parser().parse_args(["bench", "kernelbench", "--dir", str(tmp_path), "--only", "op_a,net_b",
                                      "--chunk", "2/3", "--results", str(tmp_path / "r.jsonl"), "--json"])
    assert (args.suite, args.dir, args.only, args.chunk, args.json) == ("kernelbench", tmp_path, "op_a,net_b",
                                                                        "2/3", True)
    assert args.results == tmp_path / "r.jsonl"
    args = build_parser().parse_args(["bench", "suite"])
    assert (args.dir, args.only, args.chunk, args.results, args.json) == (None, None, None, None, False)


def test_cli_bad_chunk_is_a_usage_error(capsys):
    assert main(["bench", "suite", "--chunk", "4/3"]) == 2
    assert "K/N" in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["suite", "kernelbench"])
def test_cli_without_a_gpu_returns_3_and_json_says_why(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", bench, "--json", "--only", "op_a", "--chunk", "1/2"]) == 3
    out = capsys.readouterr().out
    assert _strict_json(out)["error"].startswith("no GPU") and out.count("\n") == 1
    assert main(["bench", bench]) == 3
    assert capsys.readouterr().err.startswith(f"bench {bench}: no GPU")  # a message for a person: stderr


def test_cli_passes_the_flags_through(folder, fake_gpu, tmp_path, stitch_settings, capsys):
    stitch_settings(STITCHCUDA_SUITE_ONLY="conv_b")
    results = tmp_path / "r.jsonl"
    assert main(["bench", "kernelbench", "--dir", str(folder), "--only", "op_a,other_e", "--chunk", "2/2",
                 "--results", str(results), "--json"]) == 0
    assert fake_gpu == ["other_e"]
    report = _strict_json(capsys.readouterr().out)
    assert report["suite_dir"] == str(folder) and [m["model"] for m in report["models"]] == ["other_e"]
    assert set(report["summary"]) == {"overall", "classes"} and list(report["summary"]["classes"]) == ["other"]
    assert [_strict_json(line)["model"] for line in results.read_text().splitlines()] == ["other_e"]


def test_cli_missing_folder_is_a_usage_error_in_json(fake_gpu, tmp_path, capsys):
    assert main(["bench", "kernelbench", "--dir", str(tmp_path / "none"), "--json"]) == 2
    assert "no problem folder" in _strict_json(capsys.readouterr().out)["error"]
    assert main(["bench", "suite", "--dir", str(tmp_path), "--json"]) == 2  # a folder without problems
    assert "no problem files" in _strict_json(capsys.readouterr().out)["error"]


# ---- --no-compile ----


def test_run_model_without_the_compile_columns_times_eager_and_stitchcuda_only(folder, cpu_columns, monkeypatch):
    calls = []
    monkeypatch.setattr(suite, "_compiled_ms", lambda model, inputs, mode: calls.append(mode) or (0.5, 2.0))
    cpu_columns["optimize"] = lambda model, inputs: _Fast(lambda x: model(x))
    row = suite.run_model(folder / "gemm_c.py", compile_columns=False)
    assert calls == [] and row["mode"] == "no-compile" and row["correct"] is True
    assert "compile_ms" not in row and "reduce_overhead_ms" not in row and row.get("speedup_compile") is None
    assert row["speedup_stitch"] == 1.0 and row["memory_ratio"] is not None
    suite.run_model(folder / "gemm_c.py")
    assert calls == [None, "reduce-overhead"]  # a full row still times both modes


def test_no_compile_rows_are_their_own_mode_and_never_reused_by_a_full_run(folder, monkeypatch, tmp_path, capsys):
    ran: list[tuple[str, bool]] = []

    def run_model(path: Path, compile_columns: bool = True) -> dict:
        ran.append((path.stem, compile_columns))
        row = {**suite.new_row(path, "timed" if compile_columns else "no-compile", "fp32"), "eager_ms": 2.0,
               "stitch_ms": 1.0, "correct": True, "status": "optimized"}
        if compile_columns:
            row["compile_ms"] = 1.5
        return suite.add_speedups(row)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(suite, "run_model", run_model)
    monkeypatch.setattr(suite, "_free_gpu", lambda: None)
    results = tmp_path / "r.jsonl"
    base = ["bench", "kernelbench", "--dir", str(folder), "--only", "op_a", "--results", str(results), "--json"]
    assert main([*base, "--no-compile"]) == 0
    report = _strict_json(capsys.readouterr().out)
    assert ran == [("op_a", False)] and report["models"][0]["mode"] == "no-compile"
    assert report["summary"]["overall"]["geomean_speedup_stitch"] == 2.0
    assert report["summary"]["overall"]["geomean_stitch_vs_best_compile"] is None
    assert main([*base, "--no-compile"]) == 0  # resumed: the row is reused by a run made the same way
    capsys.readouterr()
    assert ran == [("op_a", False)]
    assert main(base) == 0  # a full run measures it again, compile columns included
    assert ran == [("op_a", False), ("op_a", True)]
    assert _strict_json(capsys.readouterr().out)["models"][0]["compile_ms"] == 1.5
    assert main([*base, "--no-compile", "--compile-only"]) == 2
    assert "--no-compile" in _strict_json(capsys.readouterr().out)["error"]


def test_a_spread_run_passes_no_compile_to_its_bench_processes(folder, tmp_path):
    spread = suite.Spread("kernelbench", folder, sorted(folder.glob("*.py")), ["0", "1"], tmp_path / "work",
                          [tmp_path / "r.gpu0", tmp_path / "r.gpu1"], llm=None, compile_only=False,
                          json_output=True, no_compile=True)
    assert "--no-compile" in spread._command(0) and "--compile-only" not in spread._command(0)
    assert spread.rows()["op_a"]["mode"] == "no-compile"  # a problem no process measured: its error row


def test_the_forward_largest_tensor_counts_intermediates():
    """The memory target's second reading: the largest tensor the eager forward makes, not only its inputs'
    and outputs' (a [64, 8] input broadcast to [64, 8, 256] before a sum back to [64, 8])."""

    class Widen(torch.nn.Module):
        def forward(self, x):
            return (x.unsqueeze(-1) * torch.ones(256)).sum(-1)

    x = torch.randn(64, 8)
    assert suite.largest_tensor_bytes((x,), Widen()(x)) == 64 * 8 * 4
    assert suite.forward_largest_tensor_bytes(Widen(), (x,)) == 64 * 8 * 256 * 4
    assert suite.forward_largest_tensor_bytes(torch.nn.Identity(), (x,)) == 64 * 8 * 4  # at least the input
