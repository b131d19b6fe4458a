"""optimize()'s Report as a person reads it in Jupyter (_repr_html_: status and speed-ups first, the time
plot, decisions and fallbacks, views in one line, each kernel behind a fold) and as a program reads it
(to_dict with its schema, from_dict); the example notebook run headless. Reports come from a real
optimize() — on the CPU, planned and compiled only — with timings and targets added where a GPU run
would have them.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from html import escape
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import stitchcuda
from stitchcuda.errors import InvalidArgumentError
from stitchcuda.graph.report import SCHEMA, Report, report_schema, time_bars

ROOT = Path(__file__).resolve().parents[2]


def _block() -> tuple[nn.Module, tuple]:
    spec = importlib.util.spec_from_file_location("report_block", ROOT / "examples" / "models" / "block.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.Model(*module.get_init_inputs()).eval(), tuple(module.get_inputs())


@pytest.fixture(scope="module")
def planned() -> Report:
    """The transformer block's report from optimize() without a GPU: groups, kernels, views, decisions."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the planned-only report is the CPU's")
    model, inputs = _block()
    report = stitchcuda.optimize(model, inputs, progress=False).report
    assert report.kernels and any(g["kind"] == "view" for g in report.groups)
    return report


def _as_optimized(report: Report) -> Report:
    """The same report as a GPU run fills it: optimized, timed, verified, one fallback, two agents' targets."""
    r = copy.deepcopy(report)
    r.status, r.reason = "optimized", ""
    r.timing = {"eager_ms": 0.6, "stitched_ms": 0.3, "speedup_eager": 2.0, "compile_ms": 0.45, "speedup_compile": 1.5}
    r.verification = {"passed": True, "input_sets": 3, "max_abs_error": 2e-6, "max_rel_error_fp64": 4e-7,
                      "detail": "", "fp64_note": ""}
    r.fallbacks = [{"group": "g3", "kind": "pointwise", "reason": "NVRTC could not compile it"}]
    r.memory = {"weights_bytes": 3 << 28, "shared_weights_bytes": 1 << 28, "arena_bytes": 1 << 29, "runner_bytes": 1 << 30}
    r.targets = [
        {"target": "t1", "groups": ["g0", "g1"], "ops": "native_layer_norm, addmm", "eager_ms": 0.08,
         "template": {"correct": True, "speedup": 1.3, "ms": 0.06}, "llm": {"attempts": 3, "speedup": 2.0,
                                                                            "attempt": 3, "ms": 0.04},
         "winner": "llm", "note": "", "run_dir": "runs/x/targets/01-t1"},
        {"target": "t2", "groups": ["g5"], "ops": "_softmax", "eager_ms": 0.05,
         "template": {"correct": True, "speedup": 1.1, "ms": 0.045}, "llm": {"attempts": 3, "stop_reason": "budget"},
         "winner": "template", "note": "", "run_dir": "runs/x/targets/02-t2"}]
    r.run_dir = "runs/x"
    r.stage_seconds = {"capture": 0.7, "generate_and_check": 3.2, "agents": 41.0}
    return r


class _Html(HTMLParser):
    """The report's parts, in document order."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []      # classes of the report's top-level parts, as they come
        self.depth = 0
        self.report_depth = None
        self.details = self.views = self.svg = 0
        self.rects: list[tuple[str, float]] = []  # (before|after, width)
        self.text: dict[str, str] = {}
        self.capture: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        cls = attrs.get("class", "")
        self.depth += 1
        if "stitchcuda-report" in cls:
            self.report_depth = self.depth
        elif self.report_depth is not None and self.depth == self.report_depth + 1:
            self.order.append(f"{tag}.{cls}" if cls else tag)
        if tag == "details" and cls == "kernel":
            self.details += 1
        if tag == "tr" and cls == "views":
            self.views += 1
        if tag == "svg":
            self.svg += 1
        if tag == "rect" and cls in ("before", "after"):
            self.rects.append((cls, float(attrs["width"])))
        if cls in ("status", "verification", "timing"):
            self.capture.append(cls)
            self.text[cls] = ""

    def handle_endtag(self, tag):
        self.depth -= 1
        if tag == "div" and self.capture:
            self.capture.pop()

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        self.depth -= 1

    def handle_data(self, data):
        for cls in self.capture:
            self.text[cls] += data


def _parse(report: Report) -> _Html:
    page = _Html()
    page.feed(report._repr_html_())
    return page


# ---- HTML ----


def test_status_and_speedups_come_first_then_plot_decisions_fallbacks_targets_groups(planned):
    report = _as_optimized(planned)
    page = _parse(report)
    parts = page.order
    assert parts[:3] == ["div.status", "div.timing", "figure.time-plot"]
    assert parts.index("div.verification") < parts.index("ul.decisions") < parts.index("ul.fallbacks")
    assert parts.index("ul.fallbacks") < parts.index("table") and parts[-1] == "div.note"  # stage times last
    assert "optimized" in page.text["status"] and "2.00x vs eager" in page.text["status"]
    assert "1.50x vs torch.compile" in page.text["status"]
    assert "stitched 0.3000 ms" in page.text["timing"] and "passed on 3 input set(s)" in page.text["verification"]
    html = report._repr_html_()
    assert "NVRTC could not compile it" in html and "LLM 2.00x (attempt 3)" in html
    assert all(escape(d) in html for d, _ in report.decisions)


def test_every_kernel_is_folded_and_the_views_are_one_line(planned):
    page = _parse(planned)
    views = sum(g["kind"] == "view" for g in planned.groups)
    assert page.details == len(planned.kernels) >= 5  # one fold per generated kernel, its source inside
    assert page.views == 1 and f"{views} view(s) of buffers without a copy" in planned._repr_html_()
    html = planned._repr_html_()
    for g in planned.kernels:
        assert f"<code>{g['kernel']} · {g['launch']}</code>" in html
    assert all(escape(g["source"]) in html for g in planned.kernels)  # each source, escaped, in its fold
    assert html.count("<tr>") == 1 + sum(g["kind"] != "view" for g in planned.groups)  # header + one per group


def test_an_eager_report_says_why_and_has_no_plot(planned):
    page = _parse(planned)
    assert page.order[0] == "div.status" and "runs eagerly" in page.text["status"]
    assert "no CUDA device" in page.text["status"] and page.svg == 0


def test_the_time_plot_is_per_target_after_the_whole_model_and_to_scale(planned):
    report = _as_optimized(planned)
    bars, caption = time_bars(report)
    assert [b[0] for b in bars] == ["whole model", "t1: native_layer_norm, addmm", "t2: _softmax"]
    assert bars[1][1:] == (0.08, 0.04) and bars[2][1:] == (0.05, 0.045)  # the winner's time: LLM, template
    assert "each agents' target" in caption
    page = _parse(report)
    assert page.svg == 1 and [k for k, _ in page.rects] == ["before", "after"] * 3
    widths = [w for _, w in page.rects]
    assert widths[0] / widths[1] == pytest.approx(0.6 / 0.3, rel=1e-2)  # eager over stitched, one scale
    assert widths[2] / widths[0] == pytest.approx(0.08 / 0.6, rel=2e-2)


def test_per_group_times_when_the_groups_carry_them(planned):
    report = _as_optimized(planned)
    report.groups = [dict(g) for g in report.groups]
    timed = [g for g in report.groups if g["kind"] != "view"][:2]
    for g, (aten, ours) in zip(timed, ((30.0, 10.0), (20.0, 25.0))):
        g.update(aten_us=aten, us=ours)
    bars, caption = time_bars(report)
    assert [b[1:] for b in bars] == [(0.6, 0.3), (0.03, 0.01), (0.02, 0.025)] and "each group" in caption


# ---- to_dict / from_dict / schema ----


def test_to_dict_is_strict_json_with_its_schema_and_reads_back(planned):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the dev group (make setup)")
    schema = report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    for report in (planned, _as_optimized(planned)):
        data = report.to_dict()
        assert data["schema"] == SCHEMA == "stitchcuda.graph.report/2"
        text = json.dumps(data, allow_nan=False)
        jsonschema.validate(json.loads(text), schema, cls=jsonschema.Draft202012Validator)
        again = Report.from_dict(json.loads(text))
        assert again == report and again.decisions == report.decisions  # tuples again
        assert isinstance(again.decisions[0], tuple)
    failed = _as_optimized(planned)
    failed.status, failed.verification = "eager", {"passed": False, "input_sets": 1, "max_abs_error": float("inf"),
                                                   "max_rel_error_fp64": float("inf"), "detail": "output 0 differs"}
    data = json.loads(json.dumps(failed.to_dict(), allow_nan=False))  # inf is no JSON: null
    assert data["verification"]["max_abs_error"] is None
    jsonschema.validate(data, schema, cls=jsonschema.Draft202012Validator)
    assert "max |error| -" in str(Report.from_dict(data))
    # What the kept program holds, in words wherever the report is read, and typed by the schema.
    optimized = _as_optimized(planned)
    assert ("program on the GPU: own weights 0.75 GiB, weights read in place from the model 0.25 GiB, arena 0.50 GiB, "
            "runner 1.00 GiB in all") in str(optimized)
    assert "program on the GPU: own weights 0.75 GiB" in optimized._repr_html_()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**optimized.to_dict(), "memory": {"arena_bytes": "a lot"}}, schema,
                            cls=jsonschema.Draft202012Validator)
    # The schema is not vacuous: what from_dict refuses, it refuses too.
    good = planned.to_dict()
    for broken in ({**good, "schema": "stitchcuda.graph.report/3"}, {**good, "status": "maybe"},
                   {**good, "decisions": [["a", "b", "c"]]}, {k: v for k, v in good.items() if k != "groups"},
                   {**good, "groups": [{"kind": "pointwise"}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema, cls=jsonschema.Draft202012Validator)


def test_from_dict_refuses_another_schema_and_bad_values(planned):
    good = planned.to_dict()
    with pytest.raises(InvalidArgumentError, match="schema 'stitchcuda.graph.report/3'"):
        Report.from_dict({**good, "schema": "stitchcuda.graph.report/3"})
    with pytest.raises(InvalidArgumentError, match="status 'maybe'"):
        Report.from_dict({**good, "status": "maybe"})
    with pytest.raises(InvalidArgumentError, match="pairs"):
        Report.from_dict({**good, "decisions": [["only one"]]})
    with pytest.raises(InvalidArgumentError, match="must be a list"):
        Report.from_dict({**good, "groups": "none"})
    with pytest.raises(InvalidArgumentError, match="must be a dict"):
        Report.from_dict([good])
    unversioned = {k: v for k, v in good.items() if k != "schema"}
    assert Report.from_dict(unversioned) == planned  # written before the key existed: this version


# ---- the notebook ----


@pytest.mark.slow
def test_the_example_notebook_runs_headless_and_shows_the_report(tmp_path):
    missing = [name for name in ("nbclient", "nbformat", "ipykernel") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (dev group of pyproject.toml; make setup installs them)")
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples" / "report.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # kept without outputs
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    shown = [o["data"]["text/html"] for o in outputs if o.output_type == "execute_result" and "text/html" in o["data"]]
    assert len(shown) == 1 and 'class="stitchcuda-report"' in shown[0]
    page = _Html()
    page.feed(shown[0])
    assert page.order[0] == "div.status"
    if not torch.cuda.is_available():
        assert "planned and compiled only" in page.text["status"] and page.details >= 1
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o["name"] == "stdout")
    assert "StitchCUDA report:" in printed and f"{SCHEMA} " in printed


# ---- on a GPU ----


@pytest.mark.gpu
def test_a_gpu_report_renders_with_its_plot_and_round_trips():
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.LayerNorm(256)).cuda().eval()
    x = torch.randn(1024, 256, device="cuda")
    report = stitchcuda.optimize(model, (x,), progress=False, keep_slower=True).report
    assert report.status == "optimized", report.reason
    page = _parse(report)
    assert page.order[:3] == ["div.status", "div.timing", "figure.time-plot"] and page.svg == 1
    assert page.details == len(report.kernels)
    assert Report.from_dict(json.loads(json.dumps(report.to_dict(), allow_nan=False))) == report
