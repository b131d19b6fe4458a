"""Saying why a program loses (graph/measure.py): the kernels that cost more than the ATen ops they replace,
biggest loss first, in the report's timing and in the fallback's reason. The comparison is pure Python and is
tested on synthetic timing tables; the kernel names come from a real plan's report entries; the timing itself
(CUPTI around the program and each group's ATen ops) runs on a GPU."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import stitchcuda
from stitchcuda.graph import OfflinePlanner, capture
from stitchcuda.graph import measure
from stitchcuda.graph.groups import GENERATED
from stitchcuda.graph.measure import (LOSSES_LISTED, OTHER_STEPS, explain_loss, kernels_of_groups, loss_text,
                                      losing_groups)
from stitchcuda.graph.options import OptimizeOptions
from stitchcuda.graph.report import Report, report_schema, time_bars
from stitchcuda.graph.state import PipelineState

HAS_GPU = torch.cuda.is_available()

TABLE = [
    {"kernel": "norm_1a2b", "kind": "reduction", "nodes": "native_layer_norm", "groups": 12, "us": 310.0,
     "aten_us": 180.0},
    {"kernel": "gelu_3c4d", "kind": "pointwise", "nodes": "mul, erf, add, mul", "groups": 12, "us": 95.0,
     "aten_us": 160.0},
    {"kernel": "", "kind": OTHER_STEPS, "nodes": "", "groups": 60, "us": 4200.0, "aten_us": 4150.0},
    {"kernel": "softmax_5e6f", "kind": "reduction", "nodes": "_softmax", "groups": 12, "us": 40.0, "aten_us": None},
]


def test_the_losing_rows_biggest_loss_first():
    losses = losing_groups(TABLE)
    assert [r["kernel"] for r in losses] == ["norm_1a2b", ""]  # the GELU wins; the softmax was not timed
    assert [r["loss_us"] for r in losses] == [130.0, 50.0]
    assert all("loss_us" not in r for r in TABLE)  # the table is left as it was
    assert losing_groups([]) == [] and losing_groups([{**TABLE[1]}]) == []


def test_the_sentence_names_each_loss_and_how_many_more():
    text = loss_text(losing_groups(TABLE))
    assert text.startswith("kernels slower than their ATen ops, biggest loss first: ")
    assert "kernel norm_1a2b (12 groups: native_layer_norm) 310.0 us against ATen's 180.0 us (+130.0 us)" in text
    assert f"{OTHER_STEPS} (60 groups: ) 4200.0 us" in text
    assert text.index("norm_1a2b") < text.index(OTHER_STEPS) and "more in" not in text
    many = [{"kernel": f"k{i}", "kind": "pointwise", "nodes": "add", "groups": 1, "us": 10.0 + i, "aten_us": 5.0}
            for i in range(LOSSES_LISTED + 3)]
    text = loss_text(losing_groups(many))
    assert f"kernel k{LOSSES_LISTED + 2} " in text and "kernel k0 " not in text
    assert text.endswith("; 3 more in report.timing['slower_groups']") and loss_text([]) == ""


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(32, 64), nn.LayerNorm(64)

    def forward(self, x):
        h = self.fc(x).view(4, 8, 64).transpose(0, 1)
        return torch.softmax(self.norm(h) * 2, -1).sum(0) + 1


@pytest.mark.skipif(HAS_GPU, reason="the plan-only path runs where there is no GPU")
def test_each_generated_group_is_matched_to_the_kernel_of_its_report_entry():
    torch.manual_seed(0)
    model, x = _Block().eval(), torch.randn(32, 32)
    fast = stitchcuda.optimize(model, (x,), progress=False)
    entries = fast.report.groups
    plan = OfflinePlanner().plan(capture(model, (x,)))
    found = kernels_of_groups(plan, entries)
    named = [e for e in entries if e.get("kernel")]
    assert named and sorted(found.values()) == sorted(e["kernel"] for e in named)
    for g in plan.groups:
        if id(g) in found:
            entry = next(e for e in named if e["kernel"] == found[id(g)])
            assert g.kind in GENERATED and entry["nodes"] == ", ".join(n.op.removeprefix("aten::") for n in g.nodes)


def _state(rows, why=""):
    state = PipelineState(nn.Identity(), (torch.zeros(1),), OptimizeOptions())
    state.report.timing = {"eager_ms": 1.0, "stitched_ms": 1.3}
    state.report.groups = [{"kind": "reduction", "nodes": "native_layer_norm", "reason": "", "kernel": "norm_1a2b"},
                           {"kind": "gemm", "nodes": "addmm", "reason": ""}]
    return state, (lambda s: (rows, why))


def test_explain_loss_records_the_table_and_returns_the_sentence(monkeypatch):
    state, timed = _state(TABLE)
    monkeypatch.setattr(measure, "group_times", timed)  # the GPU's measurement, as a table
    text = explain_loss(state)
    slower = state.report.timing["slower_groups"]
    assert [r["kernel"] for r in slower] == ["norm_1a2b", ""] and text == loss_text(slower)
    printed = str(state.report)
    norm, gemm = state.report.groups
    assert (norm["us"], norm["aten_us"]) == (310.0 / 12, 180.0 / 12) and "us" not in gemm  # the plot's bars
    assert time_bars(state.report)[0][-1] == ("reduction: native_layer_norm", 0.015, 310.0 / 12 / 1e3)
    assert "slower than ATen: norm_1a2b (12 group(s): native_layer_norm) 310.0 us vs 180.0 us, +130.0 us" in printed
    state, timed = _state([], "not measured: UnavailableError: CUPTI is not available")
    monkeypatch.setattr(measure, "group_times", timed)
    assert explain_loss(state) == ""
    assert state.report.timing["slower_groups_note"].startswith("not measured: UnavailableError")


def test_the_slower_groups_are_in_the_reports_schema_and_read_back(monkeypatch):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the dev group (make setup)")
    state, timed = _state(TABLE)
    monkeypatch.setattr(measure, "group_times", timed)
    explain_loss(state)
    data = json.loads(json.dumps(state.report.to_dict(), allow_nan=False))
    jsonschema.validate(data, report_schema(), cls=jsonschema.Draft202012Validator)
    assert Report.from_dict(data).timing["slower_groups"] == state.report.timing["slower_groups"]
    bad = {**data, "timing": {**data["timing"], "slower_groups": [{"us": "fast"}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, report_schema(), cls=jsonschema.Draft202012Validator)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_on_a_gpu_every_kernel_of_the_program_is_timed_against_its_aten_ops():
    from stitchcuda.graph.pipeline import STAGES, run_stages
    from stitchcuda.log import StepProgress

    torch.manual_seed(0)
    model, x = _Block().cuda().eval(), torch.randn(32, 32, device="cuda")
    state = PipelineState(model, (x,), OptimizeOptions(progress=False), steps=StepProgress(False))
    run_stages(state, tuple(s for s in STAGES if s[0] not in ("agents", "measure")))
    assert state.optimized is not None and state.optimized.program is not None, state.report.reason
    rows, why = measure.group_times(state)
    assert why == "", why
    kernels = {e["kernel"] for e in state.report.groups if e.get("kernel") and e["kind"] != "gemm"}
    assert kernels <= {r["kernel"] for r in rows}
    assert all(r["us"] > 0 and r["aten_us"] > 0 for r in rows if r["kernel"]), rows
    assert sum(r["groups"] for r in rows) >= len(kernels)
