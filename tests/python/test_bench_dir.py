"""`stitchcuda bench DIR` over a folder of KernelBench-format problems, on the CPU: the folder as the
argument, compile-only rows (each problem loaded, its work counted on the meta device, captured, planned
and compiled with NVRTC), resuming a run that was killed and chunking, the CSV, KernelBench levels,
fast_p and the geomeans from rows built by hand, the HTML report and its plots, and `runs --json`.
The timed path on a GPU is the last test (marked gpu).
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from stitchcuda.bench import html as bench_html
from stitchcuda.bench import suite
from stitchcuda.cli import main

ROOT = Path(__file__).resolve().parents[2]

SCALE = '''import os
import time

import torch


class Model(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return torch.relu(x * self.w) + 1.0


def get_inputs():
    return [torch.randn(64, 128)]


def get_init_inputs():
    if os.environ.get("STITCHCUDA_TEST_SLOW_INIT"):  # holds a run inside this problem, to be killed there
        time.sleep(120)
    return [128]
'''

LINEAR_GELU = '''import torch


class Model(torch.nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.fc = torch.nn.Linear(k, n)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x))


def get_inputs():
    return [torch.randn(32, 64)]


def get_init_inputs():
    return [64, 96]
'''

BROKEN = '''import torch


class Model(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("broken on purpose")


def get_inputs():
    return [torch.randn(4)]


def get_init_inputs():
    return []
'''

PROBLEMS = {"gemm_linear_gelu": LINEAR_GELU, "net_broken": BROKEN, "op_scale": SCALE, "op_slow": SCALE}


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def write_problems(tmp_path: Path, problems: dict[str, str]) -> Path:
    """A folder of KernelBench-format problem files, {stem: source} (the bench test files share it)."""
    d = tmp_path / "problems"
    d.mkdir()
    for stem, source in problems.items():
        (d / f"{stem}.py").write_text(source)
    return d


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_problems(tmp_path, PROBLEMS)


@pytest.fixture(autouse=True)
def _no_suite_environment(monkeypatch):
    for name in ("STITCHCUDA_SUITE_DIR", "STITCHCUDA_SUITE_ONLY", "STITCHCUDA_SUITE_CHUNK",
                 "STITCHCUDA_TEST_SLOW_INIT"):
        monkeypatch.delenv(name, raising=False)


def _suite_rows(stderr: str) -> list[dict]:
    return [_strict_json(line.removeprefix("[suite-row] ")) for line in stderr.splitlines()
            if line.startswith("[suite-row] ")]


# ---- compile-only rows, resume, chunks, CSV ----


def test_bench_dir_compile_only_rows_csv_and_resume_after_a_chunk(folder, tmp_path, capsys):
    results, table = tmp_path / "rows.jsonl", tmp_path / "rows.csv"
    # The first half (every second problem from the first), through `bench DIR`.
    assert main(["bench", str(folder), "--compile-only", "--chunk", "1/2", "--results", str(results),
                 "--csv", str(table), "--json"]) == 0
    out = capsys.readouterr()
    first = _strict_json(out.out)
    assert [m["model"] for m in first["models"]] == ["gemm_linear_gelu", "op_scale"]
    assert first["mode"] == "compile-only" and first["resumed"] == 0 and first["suite_dir"] == str(folder)
    gemm, scale = first["models"]
    assert gemm["status"] == "compiled" and gemm["kernels"] >= 1 and gemm["groups"].get("gemm") == 1
    assert gemm["correct"] is None and "eager_ms" not in gemm and "speedup_stitch" not in gemm  # nothing timed
    # The work on the meta device: Linear(64 -> 96) on [32, 64] is 2*32*64*96 FLOPs, plus GELU's elements.
    assert gemm["flops"] == 2 * 32 * 64 * 96 + 32 * 96
    assert gemm["bytes"] == 4 * (96 * 64 + 96 + 32 * 64 + 32 * 96)  # weight, bias, input, output
    assert scale["bytes"] == 4 * (128 + 2 * 64 * 128)

    # A killed run: its last line cut short.
    with results.open("a") as f:
        f.write('{"model": "op_slow", "mode": "compile-on')
    assert main(["bench", str(folder), "--compile-only", "--results", str(results), "--csv", str(table),
                 "--json"]) == 0
    out = capsys.readouterr()
    second = _strict_json(out.out)
    assert second["resumed"] == 2  # the first chunk's rows were not measured again
    assert [r["model"] for r in _suite_rows(out.err)] == ["net_broken", "op_slow"]
    rows = {m["model"]: m for m in second["models"]}
    assert list(rows) == ["gemm_linear_gelu", "net_broken", "op_scale", "op_slow"]
    assert rows["net_broken"]["status"] == "not compiled"
    assert "broken on purpose" in rows["net_broken"]["errors"]["stitchcuda"]
    assert second["summary"]["overall"]["compiled"] == 3 and second["summary"]["overall"]["fast_p"]["stitch"] is None

    # Each problem once in the file (the cut line stays, skipped); a timed run would reuse none of them.
    assert set(suite.read_results(results, {"mode": "compile-only"})) == set(rows)
    assert suite.read_results(results, {"mode": "timed"}) == {}
    assert suite.read_results(results).keys() == set(rows)

    with table.open(newline="") as f:
        lines = list(csv.DictReader(f))
    assert tuple(lines[0]) == suite.CSV_COLUMNS
    assert [line["model"] for line in lines] == list(rows)
    by_model = {line["model"]: line for line in lines}
    assert int(by_model["gemm_linear_gelu"]["flops"]) == gemm["flops"]
    assert by_model["gemm_linear_gelu"]["mode"] == "compile-only" and by_model["gemm_linear_gelu"]["eager_ms"] == ""
    assert by_model["net_broken"]["errors"].startswith("stitchcuda: planning without a GPU stopped")
    assert float(by_model["op_scale"]["optimize_s"]) == pytest.approx(rows["op_scale"]["optimize_s"])


@pytest.mark.slow
def test_a_killed_bench_continues_where_it_stopped(folder, tmp_path):
    """A real kill (SIGKILL) while the second problem loads; the second run does only what is left."""
    results = tmp_path / "rows.jsonl"
    env = {**os.environ, "STITCHCUDA_TEST_SLOW_INIT": "1", "STITCHCUDA_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT / "python")}
    (folder / "op_scale.py").write_text(SCALE.replace("STITCHCUDA_TEST_SLOW_INIT", "NOT_SET_HERE"))
    cmd = [sys.executable, "-m", "stitchcuda", "bench", str(folder), "--compile-only", "--only",
           "gemm_linear_gelu,op_scale,op_slow", "--results", str(results)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        # op_scale is the second problem and finishes; op_slow sleeps in get_init_inputs: kill it there.
        while time.monotonic() < deadline and len(suite.read_results(results)) < 2:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert set(suite.read_results(results)) == {"gemm_linear_gelu", "op_scale"}
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    env.pop("STITCHCUDA_TEST_SLOW_INIT")
    done = subprocess.run(cmd + ["--json"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = _strict_json(done.stdout)
    assert report["resumed"] == 2 and [r["model"] for r in _suite_rows(done.stderr)] == ["op_slow"]
    assert [m["model"] for m in report["models"]] == ["gemm_linear_gelu", "op_scale", "op_slow"]
    lines = results.read_text().splitlines()
    assert [_strict_json(line)["model"] for line in lines] == ["gemm_linear_gelu", "op_scale", "op_slow"]


def test_kernelbench_levels_are_rows_and_summary_groups(tmp_path, capsys):
    """KernelBench's own layout: level1/, level2/ under the folder given."""
    top = tmp_path / "KernelBench"
    for level, stem, source in (("level1", "19_ReLU_scale", SCALE), ("level2", "12_Gemm_GELU", LINEAR_GELU),
                                ("level10", "1_Gemm", LINEAR_GELU)):
        (top / level).mkdir(parents=True, exist_ok=True)
        (top / level / f"{stem}.py").write_text(source)
    (top / "results").mkdir()  # not a level: ignored
    (top / "results" / "x.py").write_text(BROKEN)
    assert [(suite.problem_level(p), p.stem) for p in suite.model_files(top)] == [
        ("level1", "19_ReLU_scale"), ("level2", "12_Gemm_GELU"), ("level10", "1_Gemm")]
    assert main(["bench", str(top), "--compile-only", "--only", "19_ReLU_scale,12_Gemm_GELU", "--json"]) == 0
    report = _strict_json(capsys.readouterr().out)
    assert [(m["model"], m["level"]) for m in report["models"]] == [("19_ReLU_scale", "level1"),
                                                                    ("12_Gemm_GELU", "level2")]
    assert list(report["summary"]["levels"]) == ["level1", "level2"]
    assert report["summary"]["levels"]["level2"]["compiled"] == 1
    # A level folder given directly: its rows carry the level too.
    assert main(["bench", str(top / "level1"), "--compile-only", "--json"]) == 0
    assert _strict_json(capsys.readouterr().out)["models"][0]["level"] == "level1"


def test_bench_dir_argument_and_its_usage_errors(folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", str(folder), "--json"]) == 3  # timing needs a GPU; the message says what runs without
    assert "--compile-only" in _strict_json(capsys.readouterr().out)["error"]
    assert main(["bench", str(folder), "--compile-only", "--llm", "openai:gpt-4.1", "--json"]) == 2
    assert "--llm" in _strict_json(capsys.readouterr().out)["error"]
    assert main(["bench", str(tmp_path / "missing" / "dir"), "--compile-only", "--json"]) == 2
    assert "no problem folder" in _strict_json(capsys.readouterr().out)["error"]
    assert main(["bench", "nosuchbench"]) == 2  # not a folder: argparse's invalid choice
    assert "invalid choice" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed: refused before any work
    assert main(["bench", str(folder), "--compile-only", "--html", str(tmp_path / "r.html"), "--json"]) == 2
    error = _strict_json(capsys.readouterr().out)["error"]
    assert "matplotlib" in error and "'.[bench]'" in error and not (tmp_path / "r.html").exists()


def test_bench_dir_skips_modules_without_a_model_which_the_problems_import(tmp_path, capsys):
    """A helper module beside the problems is no problem (skipped, and said so); the problems import it from
    any working folder; a problem that does not load makes the run's answer no (exit 1)."""
    folder = write_problems(tmp_path, {
        "shapes": "ROWS, COLS = 16, 32\n",
        "op_uses_shapes": "from shapes import ROWS, COLS\n" + SCALE.replace("64, 128", "ROWS, COLS").replace(
            "return [128]", "return [COLS]"),
        "op_missing_import": "import no_such_helper\n" + SCALE})
    assert main(["bench", str(folder), "--compile-only", "--json"]) == 1
    out, err = capsys.readouterr()
    report = _strict_json(out)
    rows = {r["model"]: r for r in report["models"]}
    assert set(rows) == {"op_uses_shapes", "op_missing_import"}  # shapes.py is not a row
    assert "skipped shapes.py: no Model" in err
    assert rows["op_uses_shapes"]["status"] == "compiled" and not rows["op_uses_shapes"]["errors"]
    assert rows["op_missing_import"]["correct"] is False and "no_such_helper" in rows["op_missing_import"]["errors"]["eager"]
    assert main(["bench", str(folder), "--compile-only", "--only", "op_uses_shapes", "--json"]) == 0
    capsys.readouterr()


# ---- summary from rows built by hand ----


def _row(model: str, eager: float | None, best: float | None, stitch: float | None, correct: bool | None,
         level: str | None = None, **extra) -> dict:
    row = {"model": model, "class": suite.problem_class(model), "errors": {}, "correct": correct, **extra}
    for key, value in (("eager_ms", eager), ("compile_ms", best), ("stitch_ms", stitch)):
        if value is not None:
            row[key] = value
    if level:
        row["level"] = level
    return suite.add_speedups(row)


def test_fast_p_and_geomeans_by_hand():
    rows = [
        _row("op_a", 2.0, 1.0, 0.5, True, "level1"),      # 4x eager, 2x compile
        _row("op_b", 1.0, 1.0, 1.0, True, "level1"),      # 1x exactly: correct, not faster (p=1 is strict)
        _row("gemm_c", 1.0, 2.0, 2.0, True, "level2"),    # 0.5x exactly: not > 0.5
        _row("gemm_d", 3.0, 1.0, 0.5, False, "level2"),   # 6x but wrong: counts nowhere in fast_p, 1x in geomean
        _row("net_e", None, None, None, False, "level2", errors={"eager": "RuntimeError: x"}),  # failed
    ]
    s = suite.full_summary(rows)
    o = s["overall"]
    assert o["fast_p"]["stitch"] == {"0": 3 / 5, "0.5": 2 / 5, "1": 1 / 5}  # n = all 5, failed ones included
    # Against the faster compile mode: 2x, 1x, 1x (correct ones); 3x for the wrong one does not count.
    assert o["fast_p"]["stitch_vs_best_compile"] == {"0": 3 / 5, "0.5": 3 / 5, "1": 1 / 5}
    assert "agents" not in o["fast_p"]
    assert o["geomean_speedup_stitch"] == pytest.approx((4 * 1 * 0.5 * 1) ** (1 / 4))
    assert o["geomean_stitch_vs_best_compile"] == pytest.approx((2 * 1 * 1 * (1 / 3)) ** (1 / 4))
    assert list(s["levels"]) == ["level1", "level2"]
    l1, l2 = s["levels"].values()
    assert l1["fast_p"]["stitch"] == {"0": 1.0, "0.5": 1.0, "1": 0.5}
    assert l2["fast_p"]["stitch"] == {"0": 1 / 3, "0.5": 0.0, "1": 0.0}
    assert l1["geomean_speedup_stitch"] == pytest.approx(2.0) and l2["geomean_speedup_stitch"] == pytest.approx(
        (0.5 * 1) ** 0.5)
    assert "levels" not in suite.full_summary([_row("op_x", 1.0, 1.0, 0.5, True)])  # no level folders
    assert suite.fast_p([_row("op_x", None, None, None, None)], lambda r: None) is None  # nothing timed


def test_the_agents_column_in_the_summary_and_text():
    rows = [_row("op_a", 2.0, 1.0, 1.0, True, agents_ms=0.5, agents_correct=True),
            _row("op_b", 2.0, 1.0, 1.0, True, agents_ms=0.25, agents_correct=False),  # wrong: 1x
            _row("op_c", 2.0, 1.0, 1.0, True)]  # the agents did not run here
    o = suite.summarize(rows)
    assert o["geomean_speedup_agents"] == pytest.approx((4 * 1) ** 0.5) and o["models_with_speedup_agents"] == 2
    assert o["geomean_agents_vs_best_compile"] == pytest.approx((2 * 0.5) ** 0.5)
    assert o["fast_p"]["agents"] == {"0": 1 / 3, "0.5": 1 / 3, "1": 1 / 3}
    assert o["fast_p"]["agents_vs_best_compile"] == {"0": 1 / 3, "0.5": 1 / 3, "1": 1 / 3}
    text = suite.format_table(rows, suite.full_summary(rows), "test device")
    assert "agents (--llm): geomean 2.000x vs eager" in text
    assert "fast_p (share of all problems correct and faster than p x the baseline): StitchCUDA vs eager " \
           "0:1.00 0.5:1.00 1:1.00" in text


def test_best_so_far_per_attempt():
    assert bench_html.best_so_far([None, 0.8, None, 1.5, 1.2]) == [None, 0.8, 0.8, 1.5, 1.5]
    assert bench_html.best_so_far([]) == []


def test_an_agents_target_keeps_every_attempts_speedup_from_its_run_directory(tmp_path):
    """The attempts as the loop records them (attempts/NNN/attempt.json); a hack, a static-only check and a
    wrong result have no speed-up; an attempt without attempt.json (interrupted) is not one."""
    target_dir = tmp_path / "targets" / "01-t1"
    reports = [{"correct": False, "speedup_eager": None, "error_kind": "compile"},
               {"correct": True, "speedup_eager": 1.4, "findings": []},
               {"correct": True, "speedup_eager": 9.0, "findings": [{"rule": "torch-fallback", "severity": "major"}]},
               {"correct": True, "speedup_eager": 2.5, "static_only": True},
               {"correct": True, "speedup_eager": 1.9, "findings": [{"rule": "hardcoded-shape", "severity": "minor"}]}]
    for i, report in enumerate(reports, 1):
        (target_dir / "attempts" / f"{i:03d}").mkdir(parents=True)
        (target_dir / "attempts" / f"{i:03d}" / "attempt.json").write_text(json.dumps({"index": i, "report": report}))
    (target_dir / "attempts" / "006").mkdir()  # interrupted
    entry = suite._target_entry({"target": "t1", "ops": "cumsum", "winner": "llm", "run_dir": str(target_dir),
                                 "template": {"correct": True, "speedup": 1.2}, "llm": {"speedup": 1.9, "attempt": 5}})
    assert entry["attempts"] == [None, 1.4, None, None, 1.9]
    assert (entry["template_speedup"], entry["llm_speedup"], entry["llm_attempt"]) == (1.2, 1.9, 5)
    assert suite._target_entry({"target": "t2", "winner": "aten", "template": {"correct": False, "speedup": 3.0}}) \
        == {"target": "t2", "ops": None, "winner": "aten", "template_speedup": None, "llm_speedup": None,
            "llm_attempt": None, "attempts": []}


# ---- the HTML report ----


class _Page(HTMLParser):
    """Sections by id, with their <h2> text and the <svg>/<img> elements inside; every table row."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, dict] = {}
        self.current: str | None = None
        self.in_h2 = False
        self.tags: list[str] = []
        self.svg_text: dict[str, str] = {}
        self.in_svg = 0
        self.title = ""
        self.in_title = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "section":
            self.current = attrs.get("id")
            self.sections[self.current] = {"h2": "", "svg": 0, "img": 0, "empty": False, "tr": 0}
        elif self.current:
            sec = self.sections[self.current]
            if tag == "h2":
                self.in_h2 = True
            elif tag in ("svg", "img", "tr"):
                sec[tag] += 1
            if tag == "svg":
                self.in_svg += 1
            if tag == "p" and attrs.get("class") == "empty":
                sec["empty"] = True
        if tag == "title" and not self.in_svg:
            self.in_title = True

    def handle_endtag(self, tag):
        if tag == "h2":
            self.in_h2 = False
        elif tag == "section":
            self.current = None
        elif tag == "svg":
            self.in_svg -= 1
        elif tag == "title":
            self.in_title = False

    def handle_data(self, data):
        if self.in_h2 and self.current:
            self.sections[self.current]["h2"] += data
        if self.in_svg and self.current:
            self.svg_text[self.current] = self.svg_text.get(self.current, "") + data
        if self.in_title:
            self.title += data


def _timed_rows() -> list[dict]:
    rows = [
        _row("op_gelu", 3.0, 1.5, 1.0, True, "level1", flops=2e8, bytes=8e8, status="optimized"),
        _row("gemm_bias", 4.0, 2.0, 2.5, True, "level2", flops=5e11, bytes=1e8, status="optimized",
             agents_ms=1.6, agents_correct=True, agents_targets=[
                 {"target": "t1", "winner": "llm", "attempts": [None, 1.3, 2.1]},
                 {"target": "t2", "winner": "template", "attempts": [None, None]}]),
        _row("net_wrong", 5.0, 4.0, 2.0, False, "level3", flops=1e12, bytes=2e8, status="optimized",
             errors={"stitchcuda": "mismatch"}),
        _row("net_eager", 2.0, 1.0, 2.0, True, "level3", flops=1e9, bytes=1e7, status="eager",
             reason="not faster"),
    ]
    return rows


def test_html_report_has_its_plots_titles_and_rows(tmp_path):
    rows = _timed_rows()
    hardware = {"gpu": "NVIDIA H200", "dram_tb_s": 4.3, "fp32_tflops": 67.0}
    path = bench_html.write_report(tmp_path / "out" / "bench.html", rows, suite.full_summary(rows),
                                   hardware=hardware, title="bench kernelbench (here)")
    text = path.read_text()
    # Self-contained: no script, and every reference points inside the page.
    assert "<script" not in text and re.findall(r'(?:src|href)="([^"#][^"]*)"', text) == []
    page = _Page()
    page.feed(text)
    assert page.title == "StitchCUDA bench kernelbench (here)"
    s = page.sections
    assert list(s) == ["summary", "speedup", "roofline", "attempts", "problems", "notes"]
    assert s["speedup"]["h2"] == "Speed-up per problem against torch.compile" and s["speedup"]["svg"] == 1
    assert s["roofline"]["h2"] == "Roofline" and s["roofline"]["svg"] == 1
    assert s["attempts"]["h2"] == "Agents: best speed-up per attempt" and s["attempts"]["svg"] == 1
    # The bars are labelled with every problem; the roofline has a marker per problem and column with a time
    # (eager 4, best compile 4, StitchCUDA 4, agents 1), the attempts a line per target (one never correct).
    assert all(r["model"] in page.svg_text["speedup"] for r in rows)
    roofline = text[text.index('<section id="roofline">'):text.index('<section id="attempts">')]
    for (_, label, colour, _), points in zip(bench_html.ROOFLINE_COLUMNS, (4, 4, 4, 1)):
        assert roofline.count(f"fill: {colour.lower()}; fill-opacity: 0.85") == points + 1, label  # + its legend
    attempts = page.svg_text["attempts"]
    assert "gemm_bias/t1" in attempts and "gemm_bias/t2 (no correct attempt)" in attempts
    assert "4.30 TB/s, 67.0 TFLOP/s" in page.svg_text["roofline"]
    assert s["problems"]["tr"] == 1 + len(rows)
    assert "fp32, TF32 off" in text  # the run's precision in the header
    tf32 = bench_html.render(rows, suite.full_summary(rows), hardware=hardware, precision="tf32")
    assert "tf32: TF32 matmuls and convolutions" in tf32 and "TF32 off" not in tf32
    assert s["summary"]["tr"] == 1 + 1 + 3 + 3  # header, overall, three levels, three classes
    assert "net_wrong: 1 note(s)" in text and "ran eagerly: not faster" in text


def test_html_report_of_a_compile_only_run_says_nothing_was_timed(folder, tmp_path, capsys):
    html_path = tmp_path / "compile.html"
    assert main(["bench", str(folder), "--compile-only", "--only", "op_scale,net_broken", "--html",
                 str(html_path)]) == 0
    page = _Page()
    page.feed(html_path.read_text())
    s = page.sections
    assert s["speedup"]["svg"] == 0 and s["speedup"]["empty"] and s["roofline"]["empty"]
    assert "attempts" not in s and s["problems"]["tr"] == 3
    assert "NVIDIA H200 (no GPU described)" in html_path.read_text()  # the ceilings it would have drawn


def test_roofline_ceilings_fall_back_to_the_h200_for_an_unknown_gpu():
    bandwidth, peak, source = bench_html.ceilings({"gpu": "Some GPU", "dram_tb_s": 0.0, "fp32_tflops": 0.0})
    assert bandwidth > 1e12 and peak > 1e13 and "does not know Some GPU" in source
    assert bench_html.ceilings({"gpu": "X", "dram_tb_s": 2.0, "fp32_tflops": 30.0}) == (2e12, 30e12, "X")


# ---- runs --json ----


def _fake_run(root: Path, name: str, config: dict, summary: dict | None, speedups: list[float | None]) -> Path:
    """A run directory as the loop writes one (config.json, attempts/NNN/attempt.json, summary.json)."""
    run = root / name
    (run / "attempts").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(config))
    for i, s in enumerate(speedups, 1):
        (run / "attempts" / f"{i:03d}").mkdir()
        report = {"correct": s is not None, "speedup_eager": s, "error_kind": "" if s else "incorrect"}
        (run / "attempts" / f"{i:03d}" / "attempt.json").write_text(
            json.dumps({"index": i, "plan": 1, "skill": 1 if i == 1 else 2, "report": report}))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_runs_list_and_show_json_with_date_and_model(tmp_path, capsys):
    root = tmp_path / "runs"
    _fake_run(root, "20261203-004200-add_relu", {"mode": "program", "problem": "add_relu", "llm": "openai",
                                                 "llm_spec": "openai:gpt-4.1"},
              {"problem": "add_relu", "best_speedup": 1.5, "best_attempt": 2, "verified": True,
               "stop_reason": "target reached", "plans": 1, "usage": {"total_tokens": 1234}}, [None, 1.5])
    named = _fake_run(root, "mine", {"mode": "graph", "model": "ScanModel", "llm": "scripted"}, None, [])
    when = datetime.datetime(2026, 12, 4, 9, 30, tzinfo=datetime.timezone.utc).timestamp()
    os.utime(named / "config.json", (when, when))

    assert main(["runs", "list", "--root", str(root), "--json"]) == 0
    listed = _strict_json(capsys.readouterr().out)
    assert [r["run"] for r in listed] == ["20261203-004200-add_relu", "mine"]
    first, second = listed
    assert (first["date"], first["model"], first["problem"]) == ("2026-12-03T00:42:00Z", "openai:gpt-4.1", "add_relu")
    assert (first["attempts"], first["best_speedup"], first["best_attempt"], first["tokens"]) == (2, 1.5, 2, 1234)
    assert first["finished"] is True and first["verified"] is True
    assert (second["date"], second["model"], second["problem"], second["mode"]) == (
        "2026-12-04T09:30:00Z", "scripted", "ScanModel", "graph")
    assert second["finished"] is False and second["stop_reason"] == "(running or interrupted)"

    assert main(["runs", "list", "--root", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:7] == ["run", "problem", "attempts", "best", "date", "(UTC)", "model"]
    assert lines[1].split()[:7] == ["20261203-004200-add_relu", "add_relu", "2", "1.500x", "2026-12-03", "00:42",
                                    "openai:gpt-4.1"]

    assert main(["runs", "show", "20261203-004200-add_relu", "--root", str(root), "--json"]) == 0
    shown = _strict_json(capsys.readouterr().out)
    assert shown["model"] == "openai:gpt-4.1" and [a["speedup"] for a in shown["attempt_records"]] == [None, 1.5]
    assert main(["runs", "list", "--root", str(tmp_path / "empty-root"), "--json"]) == 2  # no such folder
    assert "no folder" in _strict_json(capsys.readouterr().out)["error"]
    (tmp_path / "empty").mkdir()
    assert main(["runs", "list", "--root", str(tmp_path / "empty"), "--json"]) == 0
    assert _strict_json(capsys.readouterr().out) == []


# ---- on a GPU ----


@pytest.mark.gpu
def test_bench_dir_timed_on_a_gpu(folder, tmp_path, capsys):
    """The real columns: eager, both compile modes, StitchCUDA; the CSV, fast_p and the HTML's plots."""
    results, table, page_path = tmp_path / "r.jsonl", tmp_path / "r.csv", tmp_path / "r.html"
    assert main(["bench", str(folder), "--only", "op_scale,gemm_linear_gelu", "--results", str(results),
                 "--csv", str(table), "--html", str(page_path), "--json"]) == 0
    report = _strict_json(capsys.readouterr().out)
    assert report["mode"] == "timed" and report["hardware"]["gpu"]
    for row in report["models"]:
        assert row["eager_ms"] > 0 and row["stitch_ms"] > 0 and row["correct"] is True, row
        assert row["flops"] > 0 and row["bytes"] > 0
    fp = report["summary"]["overall"]["fast_p"]["stitch"]
    assert fp["0"] == 1.0 and 0.0 <= fp["1"] <= 1.0
    assert math.isfinite(report["summary"]["overall"]["geomean_speedup_stitch"])
    page = _Page()
    page.feed(page_path.read_text())
    assert page.sections["roofline"]["svg"] == 1 and page.sections["problems"]["tr"] == 3
    with table.open(newline="") as f:
        assert [line["mode"] for line in csv.DictReader(f)] == ["timed", "timed"]


SCAN_PROBLEM = '''import torch


class Model(torch.nn.Module):
    def __init__(self, cols):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(cols))

    def forward(self, x):
        return torch.log1p(torch.cumsum(torch.sigmoid(x) * self.w, dim=-1))


def get_inputs():
    return [torch.randn(4096, 4096)]


def get_init_inputs():
    return [4096]
'''


@pytest.mark.gpu
def test_bench_dir_with_the_agents_on_a_gpu(tmp_path, monkeypatch, capsys):
    """--llm: the scripted agents of test_graph_agents_gpu.py (a kernel step that does not compile, one
    that is wrong, one that is right) on the same scan, as a problem file; each attempt's speed-up lands
    in the row and the HTML's attempts plot."""
    (tmp_path / "problems").mkdir()
    (tmp_path / "problems" / "op_scan.py").write_text(SCAN_PROBLEM)
    (tmp_path / "bench_agents_script.py").write_text(
        "from test_graph_agents_gpu import REPLIES, Script\n\nreply = Script(REPLIES)\n")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)  # the agents' run directory: runs/<time>-op_scan here
    from test_graph_agents_gpu import scan_template_off

    scan_template_off(monkeypatch)  # the cumsum stays the agents' target, as in that test
    page_path = tmp_path / "agents.html"
    assert main(["bench", "problems", "--llm", "python:bench_agents_script:reply", "--html", str(page_path),
                 "--json"]) == 0
    [row] = _strict_json(capsys.readouterr().out)["models"]
    assert row["llm"] == "python:bench_agents_script:reply" and row["agents_correct"] is True, row
    assert Path(row["agents_run_dir"]).name.endswith("-op_scan")
    [target] = row["agents_targets"]
    assert target["winner"] == "llm" and target["attempts"][:2] == [None, None] and target["attempts"][2] > 1.0
    page = _Page()
    page.feed(page_path.read_text())
    assert page.sections["attempts"]["svg"] == 1 and "op_scan/t1" in page.svg_text["attempts"]


def test_a_row_keeps_the_titles_of_optimizes_decisions():
    """A benchmark row names what optimize() decided (the variant kept, checks written in place, SGEMM
    fallbacks) a line each, so a run's results can be read without the reports."""
    from types import SimpleNamespace

    from stitchcuda.bench import suite

    report = SimpleNamespace(status="optimized", reason="", groups=[{"kind": "gemm"}],
                             fallbacks=[{"group": "gelu", "kind": "pointwise",
                                         "reason": "oom: the candidate's processes used 13.1 GiB\nof host memory"}],
                             decisions=[("matmuls in true fp32", "PyTorch's default"),
                                        ("1 group check(s) wrote their outputs in place", "a second copy ..."),
                                        ("mm: SGEMM instead of tf32x3", "the whole program did not match (output 0 ...)"),
                                        ("fc: TF32 instead of bf16 products", "the bf16 product failed its check: ...")],
                             memory={}, timing={"eager_ms": 1.0, "stitched_ms": 0.8, "speedup_eager": 1.25,
                                                "rounds_faster": 3, "rounds": 3},
                             stage_seconds={"capture": 1.23456, "generate_and_check": 4.5})
    row = {}
    suite._record_report(row, SimpleNamespace(report=report, program=None))
    assert row["stage_seconds"] == {"capture": 1.235, "generate_and_check": 4.5}  # where optimize_s went
    assert row["decisions"] == ["matmuls in true fp32", "1 group check(s) wrote their outputs in place",
                                "mm: SGEMM instead of tf32x3", "fc: TF32 instead of bf16 products"]
    # The reason of a precision decision stays with the row (what decided the GEMM's speed).
    assert row["precision_decisions"] == {"mm: SGEMM instead of tf32x3": "the whole program did not match (output 0 ...)",
                                          "fc: TF32 instead of bf16 products": "the bf16 product failed its check: ..."}
    assert row["keep_timing"] == {"eager_ms": 1.0, "stitched_ms": 0.8, "rounds_faster": 3, "rounds": 3}
    assert row["matmuls"] == "matmuls in true fp32" and row["groups"] == {"gemm": 1}
    # A group left on ATen keeps the first line of why (a failed check decides a row's speed).
    assert row["fallbacks"] == 1 and row["fallback_reasons"] == {"gelu": "oom: the candidate's processes used 13.1 GiB"}
