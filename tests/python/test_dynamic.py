"""optimize(..., dynamic=): the spec, export's guards, the member choice and the range check's sizes, on
the CPU (the family's programs run in test_dynamic_gpu.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.export import Dim

import stitchcuda
from stitchcuda.errors import InvalidArgumentError
from stitchcuda.graph.dynamic import (DynamicDim, DynamicShapeError, choose_member, export_guards, parse_dynamic,
                                      resized_inputs, stress_sizes)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x, bias):
        return self.b(torch.relu(self.a(x))) + bias


class FixedView(torch.nn.Module):
    def forward(self, x):
        return x.view(8, -1) * 2


class Doubled(torch.nn.Module):
    def forward(self, x):
        return torch.cat([x, x]) + 1


def test_auto_is_the_batch_of_every_input_that_carries_it():
    x, ids, w = torch.randn(6, 4), torch.zeros(6, dtype=torch.long), torch.randn(3, 4)
    (d,) = parse_dynamic("auto", (x, ids, w))
    assert (d.name, d.min, d.max, d.example) == ("batch", 1, 12, 6)
    assert d.inputs == [(0, 0), (1, 0)]  # w's axis 0 (3) is not the batch


def test_export_style_spec_by_name_position_and_list():
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    batch = Dim("batch", min=2, max=64)
    for spec in ({"x": {0: batch}, "y": {0: batch}}, {0: {0: batch}, 1: {0: batch}}, [{0: batch}, {-2: batch}]):
        (d,) = parse_dynamic(spec, (x, y), ["x", "y"])
        assert (d.name, d.min, d.max, d.inputs) == ("batch", 2, 64, [(0, 0), (1, 0)])
    # A (min, max) pair is a dim of its own; Dim's default min 0 reads as 1.
    dims = parse_dynamic({"x": {0: (1, 16)}, "y": {1: Dim("cols", max=9)}}, (x, y), ["x", "y"])
    assert [(d.name, d.min, d.max) for d in dims] == [("x.0", 1, 16), ("cols", 1, 9)]


@pytest.mark.parametrize("spec, message", [
    ("batch", "not understood"),
    ({"z": {0: (1, 4)}}, "does not have"),
    ([{0: (1, 4)}], "one per input"),
    ({"x": {2: (1, 16)}}, "has 2 axes"),
    ({"x": {0: Dim("b")}}, "no maximum"),
    ({"x": {0: (4, 2)}}, "1 <= min <= max"),
    ({"x": {0: (1, 4)}}, "must lie inside the range"),
    ({"x": {0: Dim("b", max=16)}, "y": {0: Dim("b", max=32)}}, "one name is one dim"),
    ({"x": [0]}, "must be a dict"),
    ({"x": {0: "batch"}}, "torch.export.Dim"),
    (3, "must be 'auto'"),
])
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(InvalidArgumentError, match=message):
        parse_dynamic(spec, (torch.randn(8, 16), torch.randn(8, 8)), ["x", "y"])


def test_export_checks_the_model_and_finds_the_output_axes():
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    dims = parse_dynamic("auto", (x, y))
    guards = export_guards(Mlp().eval(), (x, y), dims)
    assert guards == ["'batch' in 1..16"]
    assert dims[0].outputs == [(0, 0)] and dims[0].pad

    dims = parse_dynamic("auto", (torch.randn(8, 16),))
    with pytest.raises(DynamicShapeError, match="fixes 'batch' to 8"):
        export_guards(FixedView().eval(), (torch.randn(8, 16),), dims)

    # An output whose extent is 2 * batch cannot be cut back after padding: that dim is built exactly.
    dims = parse_dynamic("auto", (torch.randn(4, 3),))
    export_guards(Doubled().eval(), (torch.randn(4, 3),), dims)
    assert not dims[0].pad and "2*" in dims[0].why_exact.replace(" ", "")


def test_member_choice_pads_to_the_next_member_or_bucket():
    batch = DynamicDim("batch", 1, 256, [(0, 0)], 48)
    assert choose_member([batch], [(48,)], (48,)) == ((48,), True)
    assert choose_member([batch], [(48,)], (40,)) == ((48,), True)   # the example is within 40's bucket (64)
    assert choose_member([batch], [(48,)], (30,)) == ((32,), False)  # a bucket of its own, to build
    assert choose_member([batch], [(48,)], (200,)) == ((256,), False)
    assert choose_member([batch], [(48,), (256,)], (129,)) == ((256,), True)
    seq = DynamicDim("seq", 1, 512, [(0, 1)], 100, pad=False)
    assert choose_member([batch, seq], [(48, 100)], (40, 100)) == ((48, 100), True)
    assert choose_member([batch, seq], [(48, 100)], (40, 99)) == ((64, 99), False)  # seq only exactly
    narrow = DynamicDim("batch", 3, 6, [(0, 0)], 4)
    assert choose_member([narrow], [(4,)], (5,)) == ((6,), False)  # the bucket (8) clamped to the range


def test_stress_sizes_cover_the_ends_a_prime_and_the_example():
    assert stress_sizes(DynamicDim("batch", 1, 256, [(0, 0)], 128)) == [1, 64, 127, 128, 256]
    assert stress_sizes(DynamicDim("batch", 1, 4, [(0, 0)], 2)) == [1, 2, 4]
    assert stress_sizes(DynamicDim("seq", 30, 40, [(0, 1)], 32)) == [30, 31, 32, 40]


def test_resized_inputs_keep_integer_values_valid():
    ids = torch.tensor([[3, 1], [4, 1], [5, 9]])
    x = torch.randn(3, 5)
    d = DynamicDim("batch", 1, 8, [(0, 0), (1, 0)], 3)
    big, bigx = resized_inputs((ids, x), [d], [7])
    assert big.shape == (7, 2) and bigx.shape == (7, 5)
    assert torch.equal(big[:3], ids) and torch.equal(big[3:6], ids) and torch.equal(bigx[6], x[0])
    small, _ = resized_inputs((ids, x), [d], [1])
    assert torch.equal(small, ids[:1])


def test_optimize_without_a_gpu_records_the_dims_and_guards(caplog):
    model, x, y = Mlp().eval(), torch.randn(8, 16), torch.randn(8, 8)
    fast = stitchcuda.optimize(model, (x, y), dynamic={"x": {0: Dim("batch", max=32)}, "bias": {0: Dim("batch", max=32)}})
    dyn = fast.report.dynamic
    assert [d["name"] for d in dyn["dims"]] == ["batch"] and dyn["dims"][0]["max"] == 32
    assert dyn["guards"] == ["'batch' in 1..32"]
    assert "original model" in dyn["refused"]  # no GPU: the example's program does not run, so no size does
    torch.testing.assert_close(fast(x[:3], y[:3]), model(x[:3], y[:3]))

    with caplog.at_level(logging.WARNING, logger="stitchcuda"):
        fixed = stitchcuda.optimize(FixedView().eval(), (torch.randn(8, 16),), dynamic="auto")
    assert "fixes 'batch' to 8" in fixed.report.dynamic["refused"]
    assert any("fixes 'batch' to 8" in r.getMessage() for r in caplog.records)


def test_padding_can_be_turned_off_to_measure_exact_members(monkeypatch):
    from stitchcuda.settings import reload

    monkeypatch.setenv("STITCHCUDA_DYNAMIC_PADDING", "off")
    reload()
    try:
        (d,) = parse_dynamic("auto", (torch.randn(4, 3),))
        assert not d.pad and d.why_exact == "STITCHCUDA_DYNAMIC_PADDING=off"
    finally:
        monkeypatch.delenv("STITCHCUDA_DYNAMIC_PADDING")
        reload()
    assert parse_dynamic("auto", (torch.randn(4, 3),))[0].pad


def test_bench_sizes_and_summary():
    from stitchcuda.bench.dynamic import batch_sizes, summarize_sizes

    assert batch_sizes(128) == {"1": 1, "prime": 127, "half": 64, "example": 128, "2x": 256}
    assert batch_sizes(2) == {"1": 1, "prime": 1, "half": 1, "example": 2, "2x": 4}
    cell = lambda e, f, c, ok=True, served="program": {"eager_ms": e, "family_ms": f, "compile_ms": c, "correct": ok,
                                                       "served": served}
    rows = [{"problem": "a", "static_s": 10.0, "dynamic_s": 15.0, "static_speedup": 2.0,
             "sizes": {"1": cell(1.0, 0.5, 1.0), "example": cell(4.0, 2.0, 2.0)}},
            {"problem": "b", "static_s": 10.0, "dynamic_s": 30.0, "static_speedup": 1.0, "refused": "fixes batch",
             "sizes": {"1": cell(1.0, 2.0, 0.5, ok=False, served="original")}}]
    s = summarize_sizes(rows)
    assert s["1"]["problems"] == 2 and s["1"]["correct"] == 1 and s["1"]["original"] == 1
    assert s["1"]["family_vs_eager"] == pytest.approx(1.0)          # sqrt(2 * 0.5)
    assert s["1"]["family_vs_compile"] == pytest.approx(0.5 ** 0.5)  # sqrt(2 * 0.25)
    assert s["example"]["family_over_static_example"] == pytest.approx(1.0)
    assert s["optimize_wall_ratio"]["max"] == pytest.approx(3.0) and s["refused"] == ["b"]


class Head(torch.nn.Module):
    """Pointwise chains (one broadcast over the batch), a layer norm and a log-softmax around two GEMMs."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 96)
        self.shift = torch.nn.Parameter(torch.randn(6, 128))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x), approximate="tanh") * 0.5 + self.shift
        return torch.log_softmax(self.b(self.norm(h)), dim=-1)


def _kernel_sources(model, inputs) -> set[str]:
    from stitchcuda.graph import Lowering, OfflinePlanner, capture

    graph = capture(model, inputs)
    plan = OfflinePlanner().plan(graph)
    return {k["source"] for k in Lowering(graph, plan, {}).build(plan.groups, graph.inputs, graph.outputs).kernels}


def test_a_member_at_another_batch_compiles_no_kernel_the_example_did_not():
    # The templates leave the batch to the launch: a member's kernels are the example's sources (the kernel
    # cache compiles them once), launched with their own sizes and grids.
    model = Head().eval()
    x = torch.randn(4, 6, 64)
    dims = parse_dynamic("auto", (x,))
    with torch.no_grad():
        example = _kernel_sources(model, (x,))
        member = _kernel_sources(model, resized_inputs((x,), dims, [16]))
    assert len(example) >= 2 and member == example


def test_members_take_the_example_programs_timed_choices():
    from stitchcuda.graph.build import Decided, member_variants
    from stitchcuda.graph.groups import GraphPlan

    plan = GraphPlan([], [], "fp32", channels_last=frozenset({"conv1", "relu1"}), conv_epilogues={1: {}})
    assert member_variants(plan, Decided(True, True, "graph", "")) == [(plan.channels_last, True)]
    assert member_variants(plan, Decided(False, False, "direct", "")) == [(frozenset(), False)]
    plain = GraphPlan([], [], "fp32")  # nothing channels-last or fusable at this size: the plain variant
    assert member_variants(plain, Decided(True, True, "graph", "")) == [(frozenset(), False)]


def test_the_wall_breakdown_says_what_the_members_repeat():
    from stitchcuda.bench.dynamic import wall_line
    from stitchcuda.graph.dynamic import Member, wall_breakdown
    from stitchcuda.graph.module import OptimizedModule
    from stitchcuda.graph.report import Report

    def module(**stages):
        report = Report()
        report.stage_seconds.update(stages)
        return OptimizedModule(Mlp(), None, None, report)

    example, member = module(capture=0.5, build=1.0), module(capture=0.25, build=0.25)
    members = [Member((8,), example, "", 1.5), Member((16,), member, "", 0.5)]
    checks = [{"build_s": 0.0, "verify_s": 0.125}, {"build_s": 0.5, "verify_s": 0.25}]
    w = wall_breakdown(0.1, 1.5, example, checks, members)
    assert w["members_built"] == 1 and w["members"] == 0.5 and w["verify"] == 0.375
    assert w["member_stages"] == {"capture": 0.25, "build": 0.25} and w["example_stages"]["build"] == 1.0
    line = wall_line({"problem": "p", "static_s": 1.4, "dynamic_s": 2.5, "static_stages": {"capture": 0.5},
                      "dynamic_wall": w})
    assert line == ("p: static 1.4 s (capture 0.50); dynamic 2.5 s: export 0.10 + example 1.50 + 1 member(s) 0.50 "
                    "(capture 0.25, build 0.25) + verify 0.38")


@pytest.mark.parametrize("dtype, precision, truth", [(torch.float32, "fp32", False), (torch.float32, "tf32", True),
                                                     (torch.bfloat16, "fp32", True)])
def test_the_range_check_copies_the_model_to_fp64_only_where_that_decides(dtype, precision, truth):
    from stitchcuda.graph import capture
    from stitchcuda.graph.dynamic import DynamicModule
    from stitchcuda.graph.module import OptimizedModule
    from stitchcuda.graph.options import OptimizeOptions
    from stitchcuda.graph.report import Report

    model, x = Mlp().eval().to(dtype), (torch.randn(8, 16, dtype=dtype), torch.randn(8, 8, dtype=dtype))
    example = OptimizedModule(model, None, capture(model, x), Report())
    family = DynamicModule(model, example, parse_dynamic("auto", x), x, OptimizeOptions(), [])
    assert (family._no_truth_needed(precision) == "") == truth


class Flattened(torch.nn.Module):
    """A view whose extents are computed from the batch (sym_size and arithmetic on it in the export)."""

    def __init__(self):
        super().__init__()
        self.conv, self.lin = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Linear(4 * 5 * 5, 10)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return torch.softmax(self.lin(y.reshape(x.shape[0], -1)), -1).view(x.shape[0] * 2, 5)


def _graph_signature(graph) -> list:
    from stitchcuda.graph import Value

    def arg(a):
        if isinstance(a, Value):
            return a.shape, a.strides, a.dtype, a.storage_offset, a.kind
        return tuple(arg(x) for x in a) if isinstance(a, (list, tuple)) else a

    return [(n.op, arg(n.args), arg(tuple(sorted(n.kwargs.items()))), arg(tuple(n.outputs))) for n in graph.nodes]


@pytest.mark.parametrize("model, example", [(Head(), (torch.randn(4, 6, 64),)), (Flattened(), (torch.randn(3, 3, 5, 5),)),
                                            (Mlp(), (torch.randn(8, 16), torch.randn(8, 8)))],
                         ids=["broadcast-and-norm", "sizes-from-the-batch", "two-carriers"])
def test_one_symbolic_export_specialized_is_the_graph_capture_makes_at_each_size(model, example):
    from stitchcuda.graph import capture
    from stitchcuda.graph.dynamic import dim_symbols, export_symbolic, specialize
    from stitchcuda.graph.lower import reference_values

    model = model.eval()
    dims = parse_dynamic("auto", example)
    with torch.no_grad():
        symbolic = export_symbolic(model, example, dims)
        symbols = dim_symbols(symbolic, dims)
        for size in (dims[0].example, 1, 2 * dims[0].example - 1):
            inputs = resized_inputs(example, dims, [size])
            read = capture(model, inputs, exported=specialize(symbolic, symbols, [size]))
            assert _graph_signature(read) == _graph_signature(capture(model, inputs))
            # The specialized graph runs at its size (the group checks record their values from it).
            values = reference_values(read, list(inputs))
            torch.testing.assert_close(values[read.outputs[0].name], model(*inputs))


def test_the_capture_stage_reads_the_specialized_program_or_exports_when_it_cannot(caplog):
    from stitchcuda.graph import pipeline
    from stitchcuda.graph.dynamic import dim_symbols, export_symbolic, specialize
    from stitchcuda.graph.options import OptimizeOptions
    from stitchcuda.graph.state import PipelineState
    from stitchcuda.log import StepProgress

    model, x = Head().eval(), (torch.randn(4, 6, 64),)
    dims = parse_dynamic("auto", x)
    symbolic = export_symbolic(model, x, dims)
    inputs = resized_inputs(x, dims, [7])

    def stage(exported):
        state = PipelineState(model, inputs, OptimizeOptions(isolated=False), steps=StepProgress(False),
                              exported=exported)
        assert pipeline.capture_stage(state) is None
        return state.graph

    read = stage(lambda: specialize(symbolic, dim_symbols(symbolic, dims), [7]))
    assert isinstance(read.exported, type(specialize(symbolic, dim_symbols(symbolic, dims), [7])))
    assert read.inputs[0].shape == (7, 6, 64)
    with caplog.at_level(logging.INFO, logger="stitchcuda"):
        exported = stage(lambda: specialize(symbolic, [], [7]))  # no size bound: the program cannot be read
    assert not isinstance(exported.exported, type(read.exported)) and exported.inputs[0].shape == (7, 6, 64)
    assert _graph_signature(exported) == _graph_signature(read)
    assert any("exporting at these sizes" in r.getMessage() for r in caplog.records)


def test_a_symbolic_export_that_cannot_be_lowered_still_gives_the_guards(monkeypatch):
    # The guards need export's trace alone; the family then captures each program at its size.
    from stitchcuda.graph import dynamic

    model, x = Mlp().eval(), (torch.randn(8, 16), torch.randn(8, 8))
    dims = parse_dynamic("auto", x)

    def unlowerable(*args, **kwargs):
        raise RuntimeError("a decomposition that branches on a symbolic size")

    monkeypatch.setattr(dynamic, "export_core", unlowerable)
    with pytest.raises(DynamicShapeError, match="branches on a symbolic size"):
        dynamic.export_symbolic(model, x, dims)
    fast = stitchcuda.optimize(model, x, dynamic="auto")
    assert fast.report.dynamic["guards"] == ["'batch' in 1..16"]
    assert fast.report.dynamic["members_captured"].startswith("exported again at each size: the symbolic export was "
                                                             "not lowered")


class RowScaleColumnBias(torch.nn.Module):
    def forward(self, x, row_scale, col_bias):
        return torch.nn.functional.hardtanh(x * row_scale + col_bias) - 0.5 * x


def test_auto_leaves_out_an_input_whose_extent_is_the_batchs_by_chance():
    # A square example: the column bias's 8 is the batch's 8, but the model ties it to x's columns.
    x, row_scale, col_bias = torch.randn(8, 8), torch.rand(8, 1) + 0.5, torch.randn(8)
    fast = stitchcuda.optimize(RowScaleColumnBias().eval(), (x, row_scale, col_bias), dynamic="auto")
    dyn = fast.report.dynamic
    assert dyn["dims"][0]["inputs"] == [(0, 0), (1, 0)] and "fixes" not in dyn.get("refused", "")
    assert any("'auto' varies the batch of 2 of the 3 inputs" in g and "fixes 'batch' to 8" in g for g in dyn["guards"])
    assert dyn["members_captured"] == "specialized from one symbolic export"


def test_a_padded_sizes_time_is_split_and_its_executor_counts_read():
    from stitchcuda.bench.dynamic import executor_counts, padded_breakdown, padded_line

    stats = {"runs": 10, "replays": 8, "device_launches": 0, "eager_runs": 2, "captures": 1, "copies_skipped": 8,
             "instances": 1, "arena_bytes": 4096, "host_replay_note": "few nodes"}
    before = executor_counts(stats)
    assert before == {"runs": 10, "replays": 8, "device_launches": 0, "eager_runs": 2, "captures": 1,
                      "copies_skipped": 8, "instances": 1}
    # 23 timed calls, each a replay whose padded input needed no copy: nothing to note.
    clean = dict(before, runs=33, replays=31, copies_skipped=31)
    cell = padded_breakdown(0.342, 0.089, 0.01, before, clean)
    assert cell["member_exact_ms"] == 0.089 and cell["pad_ms"] == 0.01
    assert cell["unexplained_ms"] == pytest.approx(0.243)
    assert cell["executor"] == {"delta": {"runs": 23, "replays": 23, "device_launches": 0, "eager_runs": 0,
                                          "captures": 0, "copies_skipped": 23}, "instances": [1, 1]}
    assert cell["notes"] == []
    # A capture per call, a second instance, and the padded input copied again are each named.
    bad = dict(before, runs=33, replays=31, captures=24, copies_skipped=8, instances=2)
    notes = padded_breakdown(0.342, 0.089, 0.01, before, bad)["notes"]
    assert [n.split(" ", 2)[1] for n in notes] == ["CUDA", "executor", "replay(s)"]
    assert notes[0].startswith("23 CUDA graph capture(s)") and notes[2].startswith("23 replay(s) copied")
    released = padded_breakdown(0.3, 0.1, 0.0, before, dict(before, runs=33, eager_runs=25))["notes"]
    assert released == ["23 eager run(s) during the timed calls (the member's working memory was released, or "
                        "never warmed)"]
    direct = dict(before, replays=0, captures=0, copies_skipped=0)  # a member that launches its steps directly
    assert padded_breakdown(0.3, 0.1, 0.0, direct, dict(direct, runs=33, eager_runs=25))["notes"] == []
    line = padded_line("conv", "prime", {"size": 7, "member": [8], "family_ms": 0.342, "host_ms": 0.05,
                                         "member_exact_host_ms": 0.02, **cell})
    assert line == ("conv prime (7 on [8]): family 0.342 ms = member exact 0.089 + pad and cut 0.010 + unexplained "
                    "0.243; host 0.050 ms a call (the member's exact run 0.020); executor runs +23, replays +23, "
                    "device_launches +0, eager_runs +0, captures +0, copies_skipped +23, instances 1 -> 1")
