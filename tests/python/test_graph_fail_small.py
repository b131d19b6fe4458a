"""Graph mode fails small, on any machine: a whole-program mismatch is traced to the group that causes it
(trace_mismatch, with the program's run replaced by ATen's values and one group's output perturbed), and
recurrent layers are captured whole (one cuDNN call each), so planning a deep LSTM takes a second, not
minutes. The GPU side (the fallback of the traced group, the time budget, the faster-than-eager rule) is
in test_gpu_graph.py.
"""

from __future__ import annotations

import importlib
import time
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

import stitchcuda
from stitchcuda.graph.capture import capture
from stitchcuda.graph.lower import reference_values
from stitchcuda.graph.planner import GENERATED, OfflinePlanner

repair = importlib.import_module("stitchcuda.graph.repair")
checks = importlib.import_module("stitchcuda.graph.checks")
build = importlib.import_module("stitchcuda.graph.build")
measure = importlib.import_module("stitchcuda.graph.measure")


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 16)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return torch.softmax(self.fc(y) * 0.5, -1)


def _fake_lowering(graph, wrong: dict[str, float], builds: list | None = None):
    """A Lowering whose program returns ATen's values for the outputs it was asked for, shifted by
    `wrong[name]` for the named values: a program with a wrong kernel, without a GPU. Each build's
    (groups, output names) goes into `builds` when given."""

    class Program:
        def __init__(self, outputs):
            self.outputs = outputs

        def compile_kernels(self):
            pass

        def executor(self, graphs=False):
            return self

        def run(self, inputs):
            values = reference_values(graph, inputs)
            return [values[v.name] + wrong.get(v.name, 0.0) for v in self.outputs]

    class Lowering:
        def __init__(self, *args, **kwargs):
            pass

        def build(self, groups, inputs, outputs, fallback=frozenset(), hardware=None):
            if builds is not None:
                builds.append((list(groups), [v.name for v in outputs]))
            return Program(list(outputs))

    return Lowering


def _setup():
    torch.manual_seed(0)
    model = _Head().eval()
    x = torch.randn(2, 4, 6, 6)
    graph = capture(model, (x,))
    # True fp32 convolutions, so the plan is judged at fp32's tolerance (with cuDNN's TF32 on, TF32's).
    with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, allow_tf32=False):
        plan = OfflinePlanner().plan(graph)
    assert plan.tolerance_precision == "fp32"
    generated = [g for g in plan.groups if g.kind in GENERATED]
    return graph, plan, generated, x


def test_the_first_group_outside_its_tolerance_is_the_culprit(monkeypatch):
    graph, plan, generated, x = _setup()
    kinds = [g.kind for g in generated]
    assert kinds == ["reduction", "gemm", "reduction"], kinds
    outputs = {v.name for v in graph.outputs}
    bn_relu_mean = generated[0].outputs(outputs)[0].name
    # The first reduction is wrong by 1e-2: everything after it is wrong too, but it is named.
    monkeypatch.setattr(repair, "Lowering", _fake_lowering(graph, {bn_relu_mean: 1e-2}))
    culprit, why = repair.trace_mismatch(graph, plan, {}, 132, set(), [x])
    assert culprit is generated[0], (culprit, why)
    assert f"'{bn_relu_mean}'" in why and "differs from ATen" in why
    # Once that group is on ATen, nothing outside its tolerance remains: the nearest to its limit is named.
    monkeypatch.setattr(repair, "Lowering", _fake_lowering(graph, {bn_relu_mean: 5e-5}))
    culprit, why = repair.trace_mismatch(graph, plan, {}, 132, set(), [x])
    assert culprit is generated[0] and "nearest its limit" in why, (culprit, why)


def test_a_trace_with_little_room_watches_a_window_at_a_time_and_stops_at_the_culprit(monkeypatch):
    graph, plan, generated, x = _setup()
    outputs = {v.name for v in graph.outputs}
    watched = [g.outputs(outputs)[0] for g in generated]  # one output each: the mean, the GEMM's, the softmax
    sizes = [v.numel * v.dtype.itemsize for v in watched]
    assert sizes == [64, 128, 128], sizes
    position = {id(g): i for i, g in enumerate(plan.groups)}
    # Room for the mean alone, then one of the others at a time: three windows. The GEMM's output is wrong.
    builds: list = []
    monkeypatch.setattr(repair, "Lowering",
                        _fake_lowering(graph, {watched[1].name: 1e-2}, builds))
    culprit, why = repair.trace_mismatch(graph, plan, {}, 132, set(), [x], room=100)
    assert culprit is generated[1] and f"'{watched[1].name}'" in why, (culprit, why)
    # Two diagnostic programs, each built up to its window's group and returning that window alone; the
    # softmax's window never ran: the search stopped at the first window outside its tolerance.
    assert [names for _, names in builds] == [[watched[0].name], [watched[1].name]], builds
    assert [len(groups) for groups, _ in builds] == [position[id(generated[0])] + 1, position[id(generated[1])] + 1]
    # Nothing outside its tolerance: every window runs and the one nearest its limit is named, as with one window.
    builds.clear()
    monkeypatch.setattr(repair, "Lowering", _fake_lowering(graph, {watched[2].name: 5e-5}, builds))
    culprit, why = repair.trace_mismatch(graph, plan, {}, 132, set(), [x], room=100)
    assert culprit is generated[2] and "nearest its limit" in why, (culprit, why)
    assert len(builds) == 3
    # Enough room: one program watches all three.
    builds.clear()
    culprit, _ = repair.trace_mismatch(graph, plan, {}, 132, set(), [x], room=sum(sizes))
    assert culprit is generated[2] and [names for _, names in builds] == [[v.name for v in watched]]


def test_a_trace_runs_at_most_trace_windows_programs_and_atens_forward_only_as_far_as_a_window(monkeypatch):
    graph, plan, generated, x = _setup()
    outputs = {v.name for v in graph.outputs}
    watched = [g.outputs(outputs)[0] for g in generated]
    # No room at all would be a program per output; with TRACE_WINDOWS = 1 the one window holds them all.
    builds: list = []
    monkeypatch.setattr(repair, "Lowering", _fake_lowering(graph, {watched[0].name: 1e-2}, builds))
    monkeypatch.setattr(repair, "TRACE_WINDOWS", 1)
    culprit, _ = repair.trace_mismatch(graph, plan, {}, 132, set(), [x], room=0)
    assert culprit is generated[0] and [names for _, names in builds] == [[v.name for v in watched]], builds
    # Sizes 64, 128, 128 in windows of half their bytes (160) pack as 64 | 128 | 128: three windows, one
    # more than TRACE_WINDOWS = 2 allows; larger windows are taken until two are enough.
    builds.clear()
    monkeypatch.setattr(repair, "Lowering", _fake_lowering(graph, {}, builds))  # every window runs
    monkeypatch.setattr(repair, "TRACE_WINDOWS", 2)
    repair.trace_mismatch(graph, plan, {}, 132, set(), [x], room=0)
    assert 1 <= len(builds) <= 2, builds
    # stream_values(stop_when_done=True) stops the forward once the wanted values were handled.
    from stitchcuda.graph import lower

    ran: list[str] = []
    original = torch.fx.Interpreter.run_node

    def counting(self, n):
        ran.append(n.name)
        return original(self, n)

    monkeypatch.setattr(torch.fx.Interpreter, "run_node", counting)
    seen: dict = {}
    lower.stream_values(graph, [x], {watched[0].name: {watched[0].name}}, lambda k, held: seen.update(held))
    whole = len(ran)
    ran.clear()
    lower.stream_values(graph, [x], {watched[0].name: {watched[0].name}}, lambda k, held: seen.update(held),
                        stop_when_done=True)
    assert watched[0].name in seen and 0 < len(ran) < whole, (len(ran), whole)


def test_groups_already_on_aten_are_not_suspected(monkeypatch):
    graph, plan, generated, x = _setup()
    monkeypatch.setattr(repair, "Lowering", _fake_lowering(graph, {}))
    culprit, why = repair.trace_mismatch(graph, plan, {}, 132, {id(g) for g in generated}, [x])
    assert culprit is None and why == "no generated group is left to suspect"


def test_a_diagnosis_that_cannot_run_names_why_and_blames_nobody(monkeypatch):
    graph, plan, _, x = _setup()

    class Broken:
        def __init__(self, *a, **k):
            pass

        def build(self, *a, **k):
            raise RuntimeError("invalid program: step 3 (view)")

    monkeypatch.setattr(repair, "Lowering", Broken)
    culprit, why = repair.trace_mismatch(graph, plan, {}, 132, set(), [x])
    assert culprit is None and "did not run" in why and "step 3 (view)" in why


class _DeepRecurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(32, 64, num_layers=6, batch_first=True)
        self.gru = nn.GRU(64, 32)
        self.rnn = nn.RNN(32, 16, nonlinearity="relu")

    def forward(self, x):
        y, _ = self.lstm(x)
        z, _ = self.gru(y)
        w, _ = self.rnn(z)
        return w[:, -1]


def test_recurrent_layers_are_captured_whole_and_planned_in_seconds():
    model = _DeepRecurrent().eval()
    x = torch.randn(2, 200, 32)
    graph = capture(model, (x,))
    counts = graph.op_counts()
    assert counts.get("aten::lstm.input") == 1 and counts.get("aten::gru.input") == 1, counts
    assert counts.get("aten::rnn_relu.input") == 1, counts
    assert sum(counts.values()) < 40, counts  # unrolled, 200 steps x 6 layers would be thousands
    t0 = time.perf_counter()
    fast = stitchcuda.optimize(model, (x,))  # no GPU: capture, plan, lower and compile only
    assert time.perf_counter() - t0 < 30
    kinds = {g["nodes"]: g["kind"] for g in fast.report.groups}
    assert kinds.get("lstm.input") == "aten" and kinds.get("gru.input") == "aten", kinds
    assert "planned and compiled only" in fast.report.reason, fast.report.reason


class _ColumnSliceReshape(nn.Module):
    """The selective-scan pattern: a column slice of a projection, its rows split into chunks by a
    reshape (a view of a non-contiguous source), then a copying permute-reshape back."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 40, bias=False)

    def forward(self, u):
        x, gate = torch.split(self.proj(u), [32, 8], dim=-1)
        chunks = x.reshape(2, 4, 8, 4, 8) * torch.sigmoid(gate).reshape(2, 4, 8, 8)[..., :4, None]
        return chunks.permute(0, 3, 1, 2, 4).reshape(2, 32, 32).sum(-1)


def test_a_reshape_of_a_column_slice_is_a_strided_view_not_an_invalid_program():
    model = _ColumnSliceReshape().eval()
    fast = stitchcuda.optimize(model, (torch.randn(2, 32, 16),))  # no GPU: capture, plan, lower, validate
    assert "planned and compiled only" in fast.report.reason, fast.report.reason
    assert "invalid program" not in fast.report.reason


def test_recurrent_steps_say_how_many_inputs_each_tensor_list_takes():
    x = torch.randn(2, 10, 32)
    graph = capture(_DeepRecurrent().eval(), (x,))
    plan = OfflinePlanner().plan(graph)
    values = reference_values(graph, [x])  # the zero initial states are constants, as optimize() makes them
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    program = build.Lowering(graph, plan, constants).build(plan.groups, graph.inputs, graph.outputs)
    steps = {s["op"]: s for s in program.steps if s["kind"] == "aten" and "lstm" in s.get("op", "")}
    lstm = steps["aten::lstm.input"]
    # hx holds h0 and c0; params the 6 layers' 4 tensors each (weights and biases)
    assert lstm["attributes"]["hx:count"] == 2 and lstm["attributes"]["params:count"] == 24, lstm
    assert len(lstm["inputs"]) == 1 + 2 + 24


def test_recurrent_results_have_the_shapes_eager_returns():
    model = nn.LSTM(16, 24, num_layers=3, batch_first=True).eval()
    x = torch.randn(4, 9, 16)
    graph = capture(model, (x,))
    (node,) = [n for n in graph.nodes if n.op == "aten::lstm.input"]
    out, (h, c) = model(x)
    assert [v.shape for v in node.outputs] == [tuple(out.shape), tuple(h.shape), tuple(c.shape)]


def _deep_chain():
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            y = torch.tanh(self.fc1(x)) * 1.5
            y = torch.sigmoid(self.fc2(y)) + 0.25
            return torch.relu(self.fc3(y)).sum(-1)

    model = Chain().eval()
    x = torch.randn(32, 64)
    graph = capture(model, (x,))
    return model, x, graph, OfflinePlanner().plan(graph)


def test_group_checks_stream_the_graph_holding_only_what_pending_checks_read():
    import gc
    import weakref

    from stitchcuda.graph.lower import stream_values

    model, x, graph, plan = _deep_chain()
    outputs = {v.name for v in graph.outputs}
    generated = [g for g in plan.groups if g.kind in GENERATED]
    assert len(generated) >= 3
    wanted = {k: {v.name for v in g.inputs() if v.kind != "weight"} | {v.name for v in g.outputs(outputs)}
              for k, g in enumerate(generated)}
    recorded = reference_values(graph, [x])
    seen: dict[int, dict] = {}
    alive_at: dict[int, set[str]] = {}
    refs: dict[str, weakref.ref] = {}

    def on_ready(key, held):
        gc.collect()
        alive_at[key] = {name for name, ref in refs.items() if ref() is not None}
        seen[key] = {name: t.clone() for name, t in held.items()}
        refs.update({name: weakref.ref(t) for name, t in held.items()})

    kept = stream_values(graph, [x], wanted, on_ready, keep={graph.outputs[0].name})
    # Every group is handled once, with exactly its values, equal to what ATen records.
    assert sorted(seen) == sorted(wanted)
    for key, names in wanted.items():
        assert set(seen[key]) == names
        for name, value in seen[key].items():
            torch.testing.assert_close(value, recorded[name])
    # When the last group is checked, the values only the first group read are gone.
    only_first = wanted[0] - set().union(*(wanted[k] for k in wanted if k != 0)) - {graph.inputs[0].name}
    assert only_first and not (only_first & alive_at[max(wanted)])
    torch.testing.assert_close(kept[graph.outputs[0].name], model(x).detach())


def test_a_group_is_checked_after_the_interpreter_drops_what_its_last_node_read(monkeypatch):
    """The check of a group runs before the next node, not inside the node that completed it: by then a
    value only that node read (a gate's mean, which no check wants and whose shape the product cannot be
    written over) is gone, so a check sits beside the forward's live set between nodes, not its transient
    peak inside one."""
    import gc
    import weakref

    from stitchcuda.graph.lower import stream_values

    class Gate(nn.Module):
        def forward(self, x):
            return torch.tanh(x * torch.sigmoid(x).mean(-1, keepdim=True)) + 1.0

    x = torch.randn(64, 64)
    graph = capture(Gate().eval(), (x,))
    nodes = {n.op: n.out.name for n in graph.nodes if n.outputs}
    mean, mul = nodes["aten::mean.dim"], nodes["aten::mul.Tensor"]
    results: dict[str, weakref.ref] = {}
    run_node = torch.fx.Interpreter.run_node

    def recording(self, n):
        out = run_node(self, n)
        if isinstance(out, torch.Tensor):
            results[n.name] = weakref.ref(out)
        return out

    monkeypatch.setattr(torch.fx.Interpreter, "run_node", recording)
    alive = {}

    def on_ready(key, held):
        gc.collect()
        alive[key] = {name for name, ref in results.items() if ref() is not None}

    stream_values(graph, [x], {"gate": {graph.inputs[0].name, mul}}, on_ready)
    assert mul in alive["gate"] and mean not in alive["gate"], alive


def _binds_before_any_gpu(program) -> None:
    """The program's ATen steps bind to the dispatcher (checked before any GPU is needed): without a
    GPU the executor then stops at the device, with a GPU it loads."""
    if torch.cuda.is_available():
        program.executor()
        return
    try:
        program.executor()
    except stitchcuda.UnavailableError:
        pass


def test_groups_sent_to_aten_bind_their_numbers_and_dtypes():
    """A group on ATen (a fallback) keeps what its ops were given: a number where the schema takes a
    tensor (x / 7 traced as div.Tensor) and a dtype where the schema says `int?` (_to_copy)."""
    from stitchcuda.graph.lower import Lowering

    class Losses(nn.Module):
        def forward(self, x, y):
            z = (x.to(torch.float64) * 2).to(torch.float32)
            return (torch.log_softmax(z, -1) - torch.log_softmax(y, -1)).sum() / 7

    x, y = torch.randn(16, 32), torch.randn(16, 32)
    graph = capture(Losses().eval(), (x, y))
    plan = OfflinePlanner().plan(graph)
    everything = {id(g) for g in plan.groups}
    program = Lowering(graph, plan, {}).build(plan.groups, graph.inputs, graph.outputs, everything)
    ops = [s.get("op") for s in program.steps if s["kind"] == "aten"]
    assert "aten::div.Tensor" in ops and "aten::_to_copy" in ops
    _binds_before_any_gpu(program)


def test_no_fp64_copy_of_a_model_whose_attention_would_materialize_its_scores():
    class Attention(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def plan_of(seq):
        q = torch.randn(1, 2, seq, 16)
        return OfflinePlanner().plan(capture(Attention().eval(), (q, q, q)))

    assert measure.fp64_too_large(plan_of(64)) == ""
    why = measure.fp64_too_large(plan_of(8192))  # 2 heads x 8192 x 8192 x 8 bytes = 1 GiB
    assert "1.0 GiB of scores" in why and "MiB limit" in why


def test_a_model_whose_one_computing_step_stays_on_aten_is_not_built():
    """Attention alone plans as one ATen step, the model's own call: at a size where a CUDA graph replay
    cannot pay for copying q, k, v and the output, optimize() keeps the model without building, verifying
    (a fresh input set as large as q, k and v) or timing a program that cannot win. At a small size the
    program's one launch may still beat the module's Python call, and it is timed. One generated group, a
    constant or a second step is a program worth building at any size."""
    class Attention(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def plan_of(model, *inputs):
        graph = capture(model.eval(), inputs)
        return OfflinePlanner().plan(graph), graph

    big = torch.randn(1, 2, 4096, 256)  # 8 MiB each: 64 MiB read and written by a replay's copies
    plan, graph = plan_of(Attention(), big, big, big)
    why = build.nothing_to_gain(plan, set(), graph)
    assert why.startswith("nothing to gain") and "scaled_dot_product" in why and "32 MiB" in why, why
    small = torch.randn(1, 2, 64, 16)
    plan, graph = plan_of(Attention(), small, small, small)
    assert build.nothing_to_gain(plan, set(), graph) == ""

    class Scaled(nn.Module):  # attention and a generated scale after it
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v) * 2.0

    plan, graph = plan_of(Scaled(), big, big, big)
    assert build.nothing_to_gain(plan, set(), graph) == ""
    # ...unless that group fell back: then the attention and the scale are two ATen steps, and a replay
    # of two steps is still worth measuring
    everything = {id(g) for g in plan.groups if g.kind in GENERATED}
    assert everything and build.nothing_to_gain(plan, everything, graph) == ""

    x = torch.randn(8, 32, 128, 128)  # 16 MiB
    plan, graph = plan_of(nn.Sequential(nn.Conv2d(32, 32, 3), nn.ReLU()), x)
    assert build.nothing_to_gain(plan, set(), graph) == ""  # a fused epilogue
    plan, graph = plan_of(nn.Conv2d(32, 32, 3), x)
    assert build.nothing_to_gain(plan, set(), graph).startswith("nothing to gain")
    plan, graph = plan_of(nn.Flatten(), torch.randn(2, 3, 4))  # views only: nothing to gain at any size
    assert build.nothing_to_gain(plan, set(), graph) == "nothing to gain: the model only views its inputs"


class _Projection(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2048, 2048)

    def forward(self, x):
        return torch.relu(self.proj(x))


def test_a_tf32x3_gemm_that_misses_its_check_is_checked_again_as_sgemm(monkeypatch):
    """The split product failed (fp32's tolerance missed, or the library found no algorithm): the GEMM
    keeps its cuBLASLt step and fused epilogue on SGEMM instead of going to ATen, and the report says so."""
    from stitchcuda.graph.report import Report

    x = torch.randn(2048, 2048)
    graph = capture(_Projection().eval(), (x,))
    plan = OfflinePlanner(peaks={"fp32_tflops": 67.0, "tf32_tflops": 495.0, "dram_tb_s": 4.8}).plan(graph)
    gemm = next(g for g in plan.groups if g.kind == "gemm")
    assert gemm.params["precision"] == "tf32x3"
    tried = []

    in_place = []

    def check_group(graph, plan, g, held, constants, sm_count, pool, stats=None, memo=None, room=None):
        tried.append(g.params["precision"])
        in_place.append(room)
        stats["in_place"] = int(room is not None)  # as check_program says when it wrote in place
        assert set(held) >= {v.name for v in g.outputs({v.name for v in graph.outputs})}  # ATen's values
        stats["worker_peak_bytes"] = 1000 if g.params["precision"] == "tf32x3" else 3000  # the worker's own
        if g.params["precision"] == "tf32x3":
            return False, "output 'relu' differs from ATen: max |error| 0.0021", None
        return True, "matches ATen", None

    monkeypatch.setattr(checks, "check_group", check_group)
    report, fallback = Report(), set()
    checks.check_groups(graph, plan, [x], 132, None, time.perf_counter(), 60.0, report, fallback, keep_all=False)
    assert tried == ["tf32x3", "fp32"] and gemm.params["precision"] == "fp32"
    assert in_place == [None, None]  # no memory target given: no limit on a check
    assert not fallback and not report.fallbacks
    # The GPU memory of a check counts the worker's allocations beside this process's (none on a CPU).
    assert report.stage_peak_bytes["check_with_worker"] == 3000
    assert any(d == f"{gemm.name}: SGEMM instead of tf32x3" and "failed its check: output 'relu' differs" in why
               for d, why in report.decisions), report.decisions
    # A memory target: each check gets what is left of it beside this process's allocations (none on a CPU).
    tried.clear(), in_place.clear()
    report = Report()
    checks.check_groups(graph, plan, [x], 132, None, time.perf_counter(), 60.0, report, set(), keep_all=False,
                        room=12345)
    assert in_place == [12345]
    assert any(d == "1 group check(s) wrote their outputs in place" for d, _ in report.decisions), report.decisions
    assert checks.memory_target(graph) == graph.working_set_bytes() + 2 * 2048 * 2048 * 4


def test_a_bf16_product_gemm_that_misses_its_check_is_checked_again_as_tf32(stitch_settings, monkeypatch):
    """At precision bf16 an fp32 GEMM of K >= 256 multiplies its operands converted to bf16; missing bf16's
    tolerance (an error the graph amplifies) it steps down to TF32, cuBLASLt's step kept, before ATen. A
    short product (K < 256) is planned TF32 from the start, and STITCHCUDA_BF16_CAST=0 plans every one so."""
    from stitchcuda.graph.report import Report

    x = torch.randn(512, 2048)
    graph = capture(_Projection().eval(), (x,))
    plan = OfflinePlanner(precision="bf16").plan(graph)
    gemm = next(g for g in plan.groups if g.kind == "gemm")
    assert gemm.params["precision"] == "bf16" and "bf16 products" in gemm.reason
    tried = []

    def check_group(graph, plan, g, held, constants, sm_count, pool, stats=None, memo=None, room=None):
        tried.append(g.params["precision"])
        if g.params["precision"] == "bf16":
            return False, "output 'relu' differs from ATen: max |error| 0.031", None
        return True, "matches ATen", None

    monkeypatch.setattr(checks, "check_group", check_group)
    report, fallback = Report(), set()
    checks.check_groups(graph, plan, [x], 132, None, time.perf_counter(), 60.0, report, fallback, keep_all=False)
    assert tried == ["bf16", "tf32"] and gemm.params["precision"] == "tf32" and not fallback
    assert any(d == f"{gemm.name}: TF32 instead of bf16 products" and "bf16 product failed its check" in why
               for d, why in report.decisions), report.decisions

    short = torch.randn(512, 128)
    narrow = capture(torch.nn.Linear(128, 64).eval(), (short,))
    (g,) = [g for g in OfflinePlanner(precision="bf16").plan(narrow).groups if g.kind == "gemm"]
    assert g.params["precision"] == "tf32" and "K=128" in g.reason
    stitch_settings(STITCHCUDA_BF16_CAST="0")
    (g,) = [g for g in OfflinePlanner(precision="bf16").plan(graph).groups if g.kind == "gemm"]
    assert g.params["precision"] == "tf32"
    # A bf16 GEMM of bf16 tensors computes in the model's dtype: nothing to step down to.
    stitch_settings(STITCHCUDA_BF16_CAST=None)
    half = capture(_Projection().eval().to(torch.bfloat16), (x.to(torch.bfloat16),))
    (g,) = [g for g in OfflinePlanner(precision="bf16").plan(half).groups if g.kind == "gemm"]
    assert g.params["precision"] == "bf16" and checks.lossy_gemm(g) is None


def test_a_check_without_room_for_a_second_copy_of_its_outputs_checks_them_in_place(monkeypatch):
    """check_group weighs the group's outputs and its program's planned working memory against the room
    it is given: beyond it, large outputs are checked in place (the Verifier writes the candidate into the
    recorded tensor while its values wait in host memory); within it, or without a limit, they are not."""
    from stitchcuda.graph import lower

    x = torch.randn(256, 2048)
    graph = capture(_Projection().eval(), (x,))
    plan = OfflinePlanner().plan(graph)
    gemm = next(g for g in plan.groups if g.kind == "gemm")
    values = lower.reference_values(graph, [x])
    seen = []

    def check_program(program, feed, wants, tolerances, names, pool=None, reference="", stats=None,
                      in_place_from=0):
        seen.append(in_place_from)
        return True, "matches ATen"

    monkeypatch.setattr(lower, "check_program", check_program)
    out_bytes = sum(values[v.name].numel() * 4 for v in gemm.outputs({v.name for v in graph.outputs}))
    for room in (None, 10 * out_bytes, out_bytes // 2):
        assert lower.check_group(graph, plan, gemm, values, {}, 132, room=room)[0]
    assert seen == [0, 0, lower.HOST_REFERENCE_BYTES]


def _restore_late(monkeypatch, lowered, report, build_program, verify):
    """repair.restore_late on a state whose builds and verifications are `build_program()` and
    `verify(program)`; returns the program the state keeps."""
    from stitchcuda.graph.options import OptimizeOptions
    from stitchcuda.graph.state import PipelineState
    from stitchcuda.log import StepProgress

    monkeypatch.setattr(repair, "build_program", lambda state: build_program())
    monkeypatch.setattr(repair, "verify_state", lambda state, program: verify(program))
    state = PipelineState(None, (), OptimizeOptions(), report=report, steps=StepProgress(False), optimized="passing")
    repair.restore_late(state, lowered)
    return state.optimized


def test_after_a_mismatch_only_the_late_tf32x3_gemms_that_keep_it_matching_go_back_to_tf32x3(monkeypatch):
    """A whole-program mismatch sent three tf32x3 GEMMs to SGEMM and the program matched. The latest goes
    back to tf32x3 first (nothing downstream amplifies its error): kept while the program still matches;
    the next one makes it differ (its error feeds an exponential) and stays SGEMM, and the program that
    passed is built again and kept with its verification; the earliest is not tried."""
    from stitchcuda.graph.planner import Group
    from stitchcuda.graph.report import Report

    splits = [Group("gemm", [SimpleNamespace(name=f"gemm{k}")], "", params={"precision": "fp32"}) for k in range(3)]
    report = Report()
    report.decisions += [(f"{g.name}: SGEMM instead of tf32x3", "the whole program did not match") for g in splits]
    report.verification = {"passed": True, "detail": "", "set": "all SGEMM"}
    built = []

    def build():
        built.append(tuple(g.params["precision"] for g in splits))
        return built[-1]

    def verify(program):  # gemm1 as tf32x3 moves the output outside fp32's tolerance
        bad = program[1] == "tf32x3"
        return {"passed": not bad, "detail": "output 0 differs" if bad else "", "set": program}

    lowered = [(g, "tf32x3") for g in splits]
    kept = _restore_late(monkeypatch, lowered, report, build, verify)
    assert built == [("fp32", "fp32", "tf32x3"), ("fp32", "tf32x3", "tf32x3"), ("fp32", "fp32", "tf32x3")]
    assert kept == ("fp32", "fp32", "tf32x3") and [g.params["precision"] for g in splits] == ["fp32", "fp32", "tf32x3"]
    assert report.verification["passed"] and report.verification["set"] == kept  # the kept program's own check
    names = [d for d, _ in report.decisions]
    assert "gemm2: tf32x3 again" in names and "gemm2: SGEMM instead of tf32x3" not in names
    assert "gemm1: SGEMM kept" in names and "gemm0: SGEMM instead of tf32x3" in names

    def failing_build():  # a build that raises is a failed try, not optimize()'s end
        if splits[2].params["precision"] == "tf32x3" and len(built) < 4:
            built.append("raised")
            raise RuntimeError("no cuBLASLt algorithm")
        return build()

    splits[2].params["precision"] = "fp32"
    kept = _restore_late(monkeypatch, lowered[2:], report, failing_build, verify)
    assert kept == ("fp32", "fp32", "fp32") and splits[2].params["precision"] == "fp32"
    assert "no cuBLASLt algorithm" in dict(report.decisions)["gemm2: SGEMM kept"]


def test_after_a_mismatch_a_late_bf16_product_gemm_goes_back_to_bf16_products(monkeypatch):
    """The whole-program step-down covers both lossy kinds, each back to its own precision: the late bf16
    GEMM returns to bf16 products while the program matches, the tf32x3 one before it stays SGEMM."""
    from stitchcuda.graph.planner import Group
    from stitchcuda.graph.report import Report

    early = Group("gemm", [SimpleNamespace(name="qkv")], "", params={"precision": "fp32"})
    late = Group("gemm", [SimpleNamespace(name="out")], "", params={"precision": "tf32"})
    report = Report()
    report.decisions += [("qkv: SGEMM instead of tf32x3", "mismatch"), ("out: TF32 instead of bf16 products", "mismatch")]

    def build():
        return (early.params["precision"], late.params["precision"])

    def verify(program):
        bad = program[0] == "tf32x3"
        return {"passed": not bad, "detail": "output 0 differs" if bad else ""}

    kept = _restore_late(monkeypatch, [(early, "tf32x3"), (late, "bf16")], report, build, verify)
    assert kept == ("fp32", "bf16")
    names = [d for d, _ in report.decisions]
    assert "out: bf16 products again" in names and "out: TF32 instead of bf16 products" not in names
    assert "qkv: SGEMM kept" in names


def test_identical_groups_share_one_check():
    # Two blocks of the same shapes: each block's norm, activation and residual groups lower to the same
    # program, checked once; the second block's take its verdict (the whole program is still verified).
    from stitchcuda.graph.lower import Lowering, _check_key, check_group

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(64) for _ in range(2))
            self.fcs = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(2))

        def forward(self, x):
            for norm, fc in zip(self.norms, self.fcs):
                x = x + torch.nn.functional.gelu(fc(norm(x)))
            return x

    graph = capture(Blocks().eval(), (torch.randn(4, 16, 64),))
    plan = OfflinePlanner().plan(graph)
    outputs = {v.name for v in graph.outputs}
    generated = [g for g in plan.groups if g.kind in ("reduction", "pointwise", "gemm")]

    def key(g):
        return _check_key(Lowering(graph, plan, {}).build([g], list(g.inputs()), g.outputs(outputs)))

    keys = [key(g) for g in generated]
    half = len(generated) // 2
    assert half >= 2 and keys[:half] == keys[half:]  # block 2's groups are block 1's, in the same order
    assert len(set(keys[:half])) == half  # and within a block, no two groups are the same check
    # A verdict in the memo is taken without running anything (this machine has no GPU to run it on).
    memo, stats = {keys[0]: (True, "matches ATen")}, {}
    ok, why, code = check_group(graph, plan, generated[half], {}, {}, 132, stats=stats, memo=memo)
    assert (ok, why, stats) == (True, "matches ATen", {"shared": True})
    # Other shapes are another check.
    other = capture(Blocks().eval(), (torch.randn(4, 32, 64),))
    other_plan = OfflinePlanner().plan(other)
    first = next(g for g in other_plan.groups if g.kind == generated[0].kind)
    assert _check_key(Lowering(other, other_plan, {}).build([first], list(first.inputs()),
                                                           first.outputs({v.name for v in other.outputs}))) != keys[0]


def test_the_keep_decision_times_eager_and_the_program_in_alternating_rounds(monkeypatch):
    """_measure alternates which side is timed first, round by round. A program exactly as fast as eager
    on a machine that speeds up while it is measured (clocks ramping up: every measurement 10% faster than
    the one before) looked 10% faster when eager was always timed first; alternated, it wins only the rounds
    where it goes second, and its median is no better than eager's, so optimize() does not keep it."""
    calls, clock = [], {"ms": 1.0}

    def model(*inputs):
        calls.append("eager")

    class Program:
        def __call__(self, *inputs):
            calls.append("program")

        def release(self):
            pass

    optimized = Program()

    def timed(fn, repeats=30):
        fn()
        clock["ms"] *= 0.9
        return clock["ms"]

    monkeypatch.setattr(measure, "time_ms", timed)
    t = measure.measure_speed(model, optimized, (torch.ones(2),), False)
    assert calls == ["eager", "program", "program", "eager", "eager", "program"]
    assert t["rounds"] == 3 and t["rounds_faster"] == 2  # faster in the two rounds where it went second
    assert t["stitched_ms"] >= t["eager_ms"]  # the medians: not faster, so the model keeps running


def test_the_program_is_kept_only_when_faster_than_the_margin_in_most_rounds():
    """A gain within the timer's spread on one model (KEEP_MARGIN, 2%) keeps the model running; so does a
    median win carried by one round of three."""
    keep = measure.not_faster
    assert measure.KEEP_MARGIN == measure.VARIANT_TIE == 0.02
    assert keep({"eager_ms": 1.0, "stitched_ms": 0.9, "rounds": 3, "rounds_faster": 3}) == ""
    within = keep({"eager_ms": 1.0, "stitched_ms": 0.99, "rounds": 3, "rounds_faster": 3})
    assert "0.9900 ms against eager 1.0000 ms" in within and "2% faster" in within
    assert keep({"eager_ms": 1.0, "stitched_ms": 0.9, "rounds": 3, "rounds_faster": 1})  # one round of three
    assert keep({"eager_ms": 1.0, "stitched_ms": 1.1, "rounds": 3, "rounds_faster": 3})
    assert keep({"eager_ms": 1.0, "stitched_ms": 0.5}) == ""  # a timing without rounds: the medians decide


def test_a_stage_that_runs_again_adds_to_its_seconds(monkeypatch):
    """report.stage_seconds: each timed stage's wall seconds; a stage run twice (a rebuild after a traced
    mismatch) adds up, and a stage that raises still counts the time it took."""
    clock = iter([10.0, 12.5, 20.0, 21.0, 30.0, 30.25])
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(clock))
    report = SimpleNamespace(stage_seconds={"capture": 1.0})
    with measure.timed_stage(report, "trace_and_rebuild"):
        pass
    with measure.timed_stage(report, "trace_and_rebuild"):
        pass
    try:
        with measure.timed_stage(report, "verify"):
            raise RuntimeError("a failed check")
    except RuntimeError:
        pass
    assert report.stage_seconds == {"capture": 1.0, "trace_and_rebuild": 3.5, "verify": 0.25}


def test_checks_that_read_only_the_models_inputs_and_outputs_take_them_from_one_call_of_the_model(monkeypatch):
    """A group that is the whole model (a Huber loss: eight ATen ops in the export, one fused op eager)
    is checked on values from one call of the model, at eager's own peak, not from the decomposed graph
    whose pieces are alive at once; values an intermediate check wants still come from the graph."""
    from stitchcuda.graph.lower import stream_values

    class Huber(nn.Module):
        def forward(self, pred, target):
            return F.huber_loss(pred, target, reduction="none", delta=0.5).mean(dim=1)

    model = Huber().eval()
    pred, target = torch.randn(64, 256), torch.randn(64, 256)
    graph = capture(model, (pred, target))
    ends = {v.name for v in (*graph.inputs, *graph.outputs)}
    calls = {"model": 0, "nodes": 0}
    run_node = torch.fx.Interpreter.run_node

    def counting(self, n):
        calls["nodes"] += 1
        return run_node(self, n)

    monkeypatch.setattr(torch.fx.Interpreter, "run_node", counting)

    def forward():
        calls["model"] += 1
        return model(pred, target)

    seen = {}
    kept = stream_values(graph, [pred, target], {"loss": set(ends)}, lambda key, held: seen.update(held),
                         keep={graph.outputs[0].name}, forward=forward)
    assert calls == {"model": 1, "nodes": 0}, calls
    assert set(seen) == ends and seen[graph.inputs[0].name] is pred
    torch.testing.assert_close(seen[graph.outputs[0].name], model(pred, target))
    assert kept[graph.outputs[0].name] is seen[graph.outputs[0].name]
    # An intermediate wanted: the graph runs, the model is not called.
    inner = next(n.out.name for n in graph.nodes if n.outputs and n.out.name not in ends)
    seen.clear()
    stream_values(graph, [pred, target], {"part": {inner}}, lambda key, held: seen.update(held), forward=forward)
    assert calls["model"] == 1 and calls["nodes"] > 0 and inner in seen
    # Outputs that do not line up with the graph's (another shape): the graph runs instead.
    seen.clear()
    stream_values(graph, [pred, target], {"loss": set(ends)}, lambda key, held: seen.update(held),
                  forward=lambda: model(pred, target)[:-1])
    torch.testing.assert_close(seen[graph.outputs[0].name], model(pred, target))


def _stream_with_storage(graph, inputs, wanted, on_ready, keep=frozenset()):
    """stream_values, and the storage each node's tensor result lives in (name -> data pointer)."""
    import pytest

    from stitchcuda.graph.lower import stream_values

    storage: dict[str, int] = {}
    run_node = torch.fx.Interpreter.run_node

    def recording(self, n):
        out = run_node(self, n)
        if isinstance(out, torch.Tensor):
            storage[n.name] = out.untyped_storage().data_ptr()
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.fx.Interpreter, "run_node", recording)
        kept = stream_values(graph, inputs, wanted, on_ready, keep=keep)
    return storage, kept


def test_recording_runs_an_activation_in_place_where_the_model_did_and_nothing_else_sees_its_input():
    """nn.ReLU(inplace=True) is a functional relu in the export; the recording runs it in place again when
    its input is an earlier op's result read by it alone and wanted by no check, so it holds the eager
    forward's live set. An input a check wants, or a graph input, is never written."""

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.act = nn.ReLU(inplace=True)
            self.act2 = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.act2(self.act(self.conv(x)) * 2.0 - 1.0) + x.relu()

    model = Stage().eval()
    x = torch.randn(2, 4, 8, 8)
    graph = capture(model, (x,))
    conv = next(n.out.name for n in graph.nodes if n.op.startswith("aten::conv"))
    relus = [n.out.name for n in graph.nodes if n.op == "aten::relu"]
    assert len(relus) == 3
    x_before = x.clone()
    seen = {}
    storage, kept = _stream_with_storage(graph, [x], {"out": {graph.outputs[0].name}},
                                         lambda key, held: seen.update(held), keep={graph.outputs[0].name})
    torch.testing.assert_close(seen[graph.outputs[0].name], model(x_before.clone()))
    assert torch.equal(x, x_before)  # the graph input's relu is not run in place
    first = relus[0]
    assert storage[first] == storage[conv]  # the conv's output, read by the relu alone: in place
    # A check that wants the conv's output runs before the relu (and sees the conv's values); a kept conv
    # output (a constant is kept for later groups) is never overwritten: the relu allocates its own.
    seen.clear()
    storage, kept = _stream_with_storage(graph, [x], {"conv": {conv}},
                                         lambda key, held: seen.update({k: v.clone() for k, v in held.items()}),
                                         keep={conv})
    # (the capture moved the convolution's bias into the kernel after it: the node computes it without)
    conv_alone = F.conv2d(x, model.conv.weight, padding=1)
    torch.testing.assert_close(seen[conv], conv_alone)
    assert storage[first] != storage[conv]
    torch.testing.assert_close(kept[conv], conv_alone)


def test_recording_runs_the_pieces_of_a_decomposed_op_over_operands_no_later_node_reads():
    """A decomposed op's pieces (a SiLU's x * sigmoid(x)) each allocate a result in the export: a product
    whose first operand is read again is written over its second, the chain after it over the product,
    and a sum over the operand whose last reader it is, so the recording holds the eager forward's live
    set. Values a check wants, kept ones and the graph's inputs are never written; the recorded results
    are the model's."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            h = self.conv(x)
            y = h * torch.sigmoid(h)  # h is read again below: the product cannot take its memory
            return h + (y - 1.0) / 2.0

    model = Block().eval()
    x = torch.randn(2, 4, 8, 8)
    graph = capture(model, (x,))
    names = {n.op.split(".")[0]: n.out.name for n in graph.nodes}
    x_before = x.clone()
    seen = {}
    storage, _ = _stream_with_storage(graph, [x], {"out": {graph.outputs[0].name}}, lambda key, held: seen.update(held))
    torch.testing.assert_close(seen[graph.outputs[0].name], model(x_before.clone()))
    assert torch.equal(x, x_before)
    conv, sig, mul = names["aten::convolution"], names["aten::sigmoid"], names["aten::mul"]
    sub, div, add = names["aten::sub"], names["aten::div"], names["aten::add"]
    assert storage[mul] == storage[sig]  # h lives on: the product is written over the sigmoid (the swap)
    assert storage[sub] == storage[div] == storage[mul]  # the chain after it reuses the same memory
    assert storage[add] == storage[conv]  # h's last reader: the sum is written over the convolution's output
    # A check that wants the sigmoid's result sees its values, and nothing overwrites them.
    seen.clear()
    storage, _ = _stream_with_storage(graph, [x], {"sig": {sig, mul}},
                                      lambda key, held: seen.update({k: v.clone() for k, v in held.items()}))
    h = model.conv(x)
    torch.testing.assert_close(seen[sig], torch.sigmoid(h))
    torch.testing.assert_close(seen[mul], h * torch.sigmoid(h))
    assert storage[mul] not in (storage[sig], storage[conv])


def test_recording_never_writes_a_model_input_an_op_hands_on_unchanged():
    """x.contiguous() of a contiguous input is the input itself: a relu after it stays out of place."""
    from stitchcuda.graph.lower import stream_values

    class PassThrough(nn.Module):
        def forward(self, x):
            return F.relu(x.contiguous(), inplace=True)

    x = torch.randn(8, 16)
    before = x.clone()
    graph = capture(PassThrough().eval(), (x,))
    assert len(graph.outputs) == 1  # the input's new value is not an output: the program does not write it
    assert any("writes its input 'x' in place" in text for text, _ in graph.notes)
    seen = {}
    stream_values(graph, [x], {"out": {graph.outputs[0].name}}, lambda key, held: seen.update(held))
    assert torch.equal(x, before)
    torch.testing.assert_close(seen[graph.outputs[0].name], before.relu())
