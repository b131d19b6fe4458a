"""The benchmark suite (bench/suite/) without a GPU: every model loads and runs on CPU at its own sizes,
captures to core ATen with the same result as eager, is partitioned by the offline Planner, lowers to a
valid Program whose generated kernels compile with NVRTC (sm_90a); golden partitions for representative
models; and `stitchcuda bench suite`'s helpers (discovery, the filter, geomeans, no-GPU exit code).

Models that expose a bug in capture or lowering stay in the suite and are marked xfail(strict=True) with the
exact error, so a fix turns them into unexpected passes and the marker must go.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

from stitchcuda import jit
from stitchcuda.bench import suite
from stitchcuda.graph import CaptureError, Lowering, LoweringError, OfflinePlanner, capture, reference_values

SUITE = Path(__file__).resolve().parents[2] / "bench" / "suite"
STEMS = [p.stem for p in suite.model_files(SUITE)]

# Known bugs the suite exposes (do not work around them in the models: they are what users write).
CAPTURE_BUGS: dict[str, str] = {}
LOWERING_BUGS: dict[str, str] = {}


def _cases(bugs: dict[str, str], error: type[Exception]) -> list:
    return [pytest.param(s, marks=pytest.mark.xfail(strict=True, raises=error, reason=bugs[s])) if s in bugs else s
            for s in STEMS]


# The parametrized tests are grouped by model (scope="module"), so each cache holds one model's tensors at a time.
@functools.lru_cache(maxsize=1)
def _loaded(stem: str):
    module = suite.load(SUITE / f"{stem}.py")
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).eval()
    inputs = tuple(module.get_inputs())
    return module, model, inputs


@functools.lru_cache(maxsize=1)
def _eager(stem: str):
    _, model, inputs = _loaded(stem)
    with torch.no_grad():
        return model(*inputs)


@functools.lru_cache(maxsize=1)
def _captured(stem: str):
    _, model, inputs = _loaded(stem)
    return capture(model, inputs)


@functools.lru_cache(maxsize=1)
def _planned(stem: str, attention: str | None = None):
    return OfflinePlanner(attention=attention).plan(_captured(stem))


@functools.lru_cache(maxsize=1)
def _values(stem: str) -> dict[str, torch.Tensor]:
    _, _, inputs = _loaded(stem)
    return reference_values(_captured(stem), list(inputs))


def _partition(stem: str, attention: str | None = None) -> list[tuple[str, list[str]]]:
    """(kind, ops) of every group that computes something (views and weight-only constants left out)."""
    return [(g.kind, [n.op for n in g.nodes]) for g in _planned(stem, attention).groups
            if g.kind not in ("view", "constant")]


# ---- the suite itself ----


def test_suite_is_large_and_covers_every_category():
    assert len(STEMS) >= 30, STEMS
    prefixes = {s.split("_")[0] for s in STEMS}
    assert {"pointwise", "gemm", "bmm", "conv", "norm", "softmax", "reduce", "attention", "model"} <= prefixes
    for stem in ("model_mlp", "model_cnn", "model_transformer_block", "model_residual_block", "model_mixer_block",
                 "model_unet_block", "attention_sdpa", "norm_rmsnorm", "norm_groupnorm_silu", "conv_depthwise_bn_silu"):
        assert stem in STEMS


@pytest.mark.parametrize("stem", STEMS, scope="module")
def test_file_is_in_kernelbench_format(stem):
    tree = ast.parse((SUITE / f"{stem}.py").read_text())
    doc = ast.get_docstring(tree)
    assert doc and "\n" not in doc.strip(), "a file starts with a one-line docstring"
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    assert {"Model", "get_inputs", "get_init_inputs"} <= names
    constants = [t.id for n in tree.body if isinstance(n, ast.Assign) for t in ast.walk(n.targets[0])
                 if isinstance(t, ast.Name) and t.id.isupper()]
    assert constants, "sizes are module-level constants"


@pytest.mark.parametrize("stem", STEMS, scope="module")
def test_model_runs_on_cpu_at_its_own_sizes(stem):
    module, _, inputs = _loaded(stem)
    assert inputs and all(t.device.type == "cpu" for t in inputs if isinstance(t, torch.Tensor))
    outputs = [t for t in pytree.tree_flatten(_eager(stem))[0] if isinstance(t, torch.Tensor)]
    assert outputs and all(bool(torch.isfinite(t).all()) for t in outputs)
    # Fits an H200 run comfortably: inputs, weights and outputs well under 2 GB (activations are similar).
    _, model, _ = _loaded(stem)
    total = sum(t.numel() * t.element_size() for t in [*inputs, *outputs, *model.state_dict().values()])
    assert total < 1 << 30, f"{total / 2**20:.0f} MiB"


@pytest.mark.parametrize("stem", _cases(CAPTURE_BUGS, CaptureError), scope="module")
def test_capture_gives_core_aten_that_computes_what_eager_does(stem):
    graph = _captured(stem)
    assert graph.nodes and graph.inputs
    assert all(n.op.startswith("aten::") for n in graph.nodes)
    values = _values(stem)
    want = [t for t in pytree.tree_flatten(_eager(stem))[0] if isinstance(t, torch.Tensor)]
    assert len(want) == len(graph.outputs)
    for v, w in zip(graph.outputs, want):
        got = values[v.name] if v.name in values else next(x.data for x in graph.weights if x.name == v.name)
        torch.testing.assert_close(got, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("stem", _cases({**CAPTURE_BUGS, **LOWERING_BUGS}, (CaptureError, LoweringError)),
                         scope="module")
def test_plan_lowers_to_a_valid_program_whose_kernels_compile(stem):
    graph, plan = _captured(stem), _planned(stem)
    assert plan.groups and all(g.reason for g in plan.groups)
    values = _values(stem)
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups
                 if g.kind == "constant" and g.nodes[0].outputs and g.nodes[0].out.name in values}
    lowering = Lowering(graph, plan, constants)
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    program.validate()
    # A pooling group whose input is stored channels-last runs as ATen steps (lowering.on_aten).
    fused = sum(g.kind in ("pointwise", "reduction", "conv", "pool") for g in plan.groups) - len(lowering.on_aten)
    # An attention group is one kernel as the fused template, two as the decode pair, none as the SDPA step.
    fused += sum({"fused": 1, "decode": 2}.get(g.params["impl"], 0) for g in plan.groups if g.kind == "attention")
    # One kernel per fused group, plus one copy to NHWC at the edge of each channels-last convolution chain.
    edges = [code for _, code in lowering.kernels if code.name.startswith("to_nhwc")]
    assert len(lowering.kernels) == fused + len(edges)
    assert len(edges) <= sum(n.op == "aten::convolution" for g in plan.groups for n in g.nodes)
    assert bool(edges) <= bool(plan.channels_last)
    for _, code in lowering.kernels:
        jit.compile(code.source, code.name)  # NVRTC for sm_90a: no GPU needed


# ---- golden partitions ----


def test_golden_linear_relu_is_one_cublaslt_step_with_the_bias_relu_epilogue():
    assert _partition("gemm_bias_relu") == [("gemm", ["aten::addmm", "aten::relu"])]
    gemm = next(g for g in _planned("gemm_bias_relu").groups if g.kind == "gemm")
    assert gemm.params["epilogue"] == "bias_relu" and gemm.params["transpose_b"]


def test_golden_exact_gelu_after_a_linear_is_its_own_kernel():
    assert _partition("gemm_bias_gelu") == [("gemm", ["aten::addmm"]), ("pointwise", ["aten::gelu"])]
    assert next(g for g in _planned("gemm_bias_gelu").groups if g.kind == "gemm").params["epilogue"] == "bias"


def test_golden_broadcast_pointwise_chain_is_one_kernel():
    assert _partition("pointwise_bias_gelu_scale") == [
        ("pointwise", ["aten::add.Tensor", "aten::gelu", "aten::mul.Tensor", "aten::add.Tensor"])]


def test_golden_softmax_and_spatial_amax_are_row_reduction_templates():
    assert _partition("softmax_rows") == [("reduction", ["aten::_softmax"])]
    softmax = _planned("softmax_rows").groups[0]
    assert (softmax.params["rows"], softmax.params["cols"]) == (8192, 4096) and "block per row" in softmax.reason
    amax = next(g for g in _planned("reduce_amax_spatial").groups if g.kind == "reduction")
    assert (amax.params["kind"], amax.params["rows"], amax.params["cols"]) == ("amax", 64 * 256, 64 * 64)


def test_golden_conv_is_an_aten_step_with_a_fused_batch_norm_relu_epilogue():
    assert _partition("conv_bn_relu") == [
        ("aten", ["aten::convolution"]),
        ("pointwise", ["aten::_native_batch_norm_legit_no_training", "aten::relu"])]


def test_golden_rmsnorm_from_torch_ops_is_one_kernel():
    # The square is computed on load, the statistic applied to the row in the same kernel.
    assert _partition("norm_rmsnorm") == [
        ("reduction", ["aten::pow.Tensor_Scalar", "aten::mean.dim", "aten::add.Tensor", "aten::rsqrt",
                       "aten::mul.Tensor", "aten::mul.Tensor"])]
    rms = _planned("norm_rmsnorm").groups[0]
    assert [n.op for n in rms.params["prologue"]] == ["aten::pow.Tensor_Scalar"] and "fused into its loads" in rms.reason
    assert len(rms.params["epilogue"]) == 4 and "the statistic is never stored" in rms.reason
    assert rms.params["result"].shape == rms.params["node"].args[0].shape


def test_golden_logsumexp_is_one_online_kernel():
    # The max and the sum of exp(x - max) in one pass, the log and the max's add applied to what it stores.
    assert _partition("reduce_logsumexp_manual") == [
        ("reduction", ["aten::amax", "aten::sub.Tensor", "aten::exp", "aten::sum.dim_IntList", "aten::log",
                       "aten::add.Tensor"])]
    assert _planned("reduce_logsumexp_manual").groups[0].params["kind"] == "sum_exp"


def test_golden_residual_add_and_temperature_are_prologues_of_long_rows_held_in_registers():
    assert _partition("norm_layernorm_residual") == [("reduction", ["aten::add.Tensor", "aten::native_layer_norm"])]
    assert _partition("softmax_log_temperature") == [("reduction", ["aten::div.Tensor", "aten::_log_softmax"])]
    for stem in ("norm_layernorm_residual", "softmax_log_temperature"):
        reason = _planned(stem).groups[-1].reason
        assert "the row held in registers" in reason and "1 elementwise op(s)" in reason, reason


def test_golden_group_norm_is_a_template_with_its_silu_applied_before_the_store():
    assert _partition("norm_groupnorm_silu") == [
        ("reduction", ["aten::native_group_norm", "aten::sigmoid", "aten::mul.Tensor"])]
    gn = _planned("norm_groupnorm_silu").groups[0]
    assert (gn.params["rows"], gn.params["cols"], gn.params["groups"], gn.params["group_hw"]) == (32 * 32, 8 * 64 * 64, 32, 64 * 64)
    assert "held in registers" in gn.reason and "applied before the store" in gn.reason


def test_a_chain_whose_values_are_used_elsewhere_is_not_a_prologue():
    # model_transformer_block's first layer norm reads the block input, which the residual add reads too,
    # so the add stays out of it; the attention's scaling is inside its one attention group.
    plan = _planned("model_transformer_block")
    reductions = [g for g in plan.groups if g.kind == "reduction"]
    assert [len(g.params.get("prologue") or []) for g in reductions] == [0, 0]
    (attention,) = [g for g in plan.groups if g.kind == "attention"]
    assert "aten::_softmax" in [n.op for n in attention.nodes]


def test_golden_middle_dimension_reductions_are_column_templates():
    assert _partition("reduce_mean_middle") == [("reduction", ["aten::mean.dim"])]
    mean = _planned("reduce_mean_middle").groups[0].params
    assert (mean["layout"], mean["outer"], mean["reduce"], mean["inner"]) == ("column", 128, 1024, 512)
    # The ReLU before a sum over NCHW channels is computed on load.
    assert _partition("reduce_sum_channels") == [("reduction", ["aten::relu", "aten::sum.dim_IntList"])]
    total = _planned("reduce_sum_channels").groups[0].params
    assert (total["outer"], total["reduce"], total["inner"]) == (64, 128, 64 * 64) and total["prologue"]


def test_golden_transformer_block_counts():
    summary = _planned("model_transformer_block").summary()
    # qkv, proj, fc1, fc2; the two LNs; the attention (both bmm and the softmax) as one group
    assert (summary["gemm"], summary["reduction"], summary["attention"]) == (4, 2, 1)


# ---- the benchmark driver's CPU-side behaviour ----


def test_bench_suite_finds_the_repository_folder_and_filters(stitch_settings):
    stitch_settings(STITCHCUDA_SUITE_DIR=None)
    assert suite.suite_dir() == SUITE
    picked = suite.model_files(SUITE, "softmax_rows, gemm_bias_relu,missing")
    assert [p.stem for p in picked] == ["gemm_bias_relu", "softmax_rows"]
    stitch_settings(STITCHCUDA_SUITE_DIR="/elsewhere")
    assert suite.suite_dir() == Path("/elsewhere")


def test_bench_suite_chunks_cover_the_suite_once():
    chunks = [suite.model_files(SUITE, chunk=f"{k}/4") for k in range(1, 5)]
    assert sorted(p.stem for c in chunks for p in c) == STEMS
    assert all(len(c) in (len(STEMS) // 4, len(STEMS) // 4 + 1) for c in chunks)
    assert any(p.stem.startswith("model_") for p in chunks[0]) and any(p.stem.startswith("softmax") or
                                                                       p.stem.startswith("reduce") for p in chunks[0])
    for bad in ("0/4", "5/4", "1of4", "a/b"):
        with pytest.raises(SystemExit, match="STITCHCUDA_SUITE_CHUNK must be K/N"):
            suite.model_files(SUITE, chunk=bad)


def test_bench_suite_summary_geomeans_and_counts_eager_fallbacks_as_correct():
    rows = [{"model": "a", "correct": True, "status": "optimized", "speedup_compile": 2.0, "speedup_stitch": 4.0},
            {"model": "b", "correct": True, "status": "eager", "speedup_compile": 0.5, "speedup_stitch": 1.0},
            {"model": "c", "correct": False, "errors": {"eager": "RuntimeError: x"}},
            {"model": "d", "correct": False, "status": "optimized", "speedup_stitch": 9.0}]  # fast but wrong
    s = suite.summarize(rows)
    assert s["geomean_speedup_compile"] == pytest.approx(1.0)
    assert s["geomean_speedup_stitch"] == pytest.approx(4 ** (1 / 3))  # a 4x, b 1x (eager), d 1x (wrong)
    assert s["geomean_speedup_reduce_overhead"] is None and (s["correct"], s["models"]) == (2, 4)
    assert s["optimized"] == 2 and s["models_with_speedup_stitch"] == 3
    text = suite.format_table(rows, s, "test device")
    assert "geomean speed-up" in text and "eager error: RuntimeError: x" in text


def test_bench_suite_compares_outputs_with_the_suite_tolerance():
    want = (torch.ones(3, 4), torch.zeros(2))
    assert suite.compare_outputs((want[0] + 5e-5, want[1]), want)[0]
    ok, worst, detail = suite.compare_outputs((want[0], torch.tensor([0.0, 1e-3])), want)
    assert not ok and worst == pytest.approx(1e-3) and "output 1" in detail and "flat index 1" in detail
    assert not suite.compare_outputs((want[0],), want)[0]
    assert not suite.compare_outputs((want[0].double(), want[1]), want)[0]


def test_bench_suite_without_a_gpu_says_why_and_returns_3(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert suite.run(json_output=True) == 3
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no GPU" in out


def test_golden_sdpa_is_the_fused_template_by_default_and_one_library_step_under_sdpa():
    # fp32 at head dim 64, causal, no mask: where the template measured ahead of SDPA's memory-efficient
    # kernel, auto takes the SDPA call as the template; either way the attention is one step, never GEMMs
    # around a materialized score tensor.
    sdpa = ["aten::scaled_dot_product_attention"]
    assert _partition("attention_sdpa") == [("gemm", ["aten::addmm"]), ("attention", sdpa), ("gemm", ["aten::addmm"])]
    assert _partition("attention_sdpa", "sdpa") == [("gemm", ["aten::addmm"]), ("aten", sdpa), ("gemm", ["aten::addmm"])]


def test_golden_sdpa_step_is_fed_by_views_without_copies():
    # Under attention="sdpa", scaled_dot_product_attention is kept whole (flash / memory-efficient kernels);
    # q, k and v are strided views of the qkv projection.
    graph, plan = _captured("attention_sdpa"), _planned("attention_sdpa", "sdpa")
    lowering = Lowering(graph, plan, {})
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    program.validate()
    aten = [s["op"] for s in program.steps if s["kind"] == "aten"]
    # The attention's result keeps the layout the capture saw ([B, H, S, D] stored as [B, S, H, D]), so the
    # transpose and the merge of the heads after it are views; the last step fills the output buffer.
    assert aten == ["aten::scaled_dot_product_attention", "aten::view"], aten
    buffers = {b["id"]: b for b in program.buffers}
    last = next(s for s in program.steps if s["kind"] == "aten" and s["op"] == "aten::view")
    assert buffers[last["outputs"][0]]["role"] == "output"
    # Replays every view step from each buffer laid out as the program plans it, holding the reference
    # values, and compares the views with the captured values (a wrong stride shows up here).
    values = _values("attention_sdpa")
    names = {bid: name for name, bid in lowering.buf.items()}
    held = {}
    for bid, name in names.items():
        b = buffers[bid]
        if name in values and b["role"] == "intermediate" and not any(
                s["kind"] == "view" and s["result"] == bid for s in program.steps):
            held[bid] = torch.empty_strided(b["shape"], b["strides"]).copy_(values[name])
    checked = 0
    for step in program.steps:
        if step["kind"] != "view" or step["source"] not in held:
            continue
        src, res = held[step["source"]], buffers[step["result"]]
        held[step["result"]] = src.as_strided(res["shape"], res["strides"], src.storage_offset() + step["storage_offset"])
        if names.get(step["result"]) in values:
            torch.testing.assert_close(held[step["result"]], values[names[step["result"]]], rtol=0, atol=0)
            checked += 1
    assert checked >= 6, checked


def test_a_traced_view_the_planned_layout_cannot_take_copies_contiguous_first(monkeypatch):
    # Were the attention's result planned contiguous, the transpose-and-merge traced after it would not
    # be a view: an ATen view step would fail at run time, so the lowering copies contiguous, then views.
    from stitchcuda.graph import lower

    monkeypatch.setattr(lower, "_dense_permutation", lambda shape, strides: False)
    graph, plan = _captured("attention_sdpa"), _planned("attention_sdpa", "sdpa")
    program = Lowering(graph, plan, {}).build(plan.groups, graph.inputs, graph.outputs)
    program.validate()
    aten = [s["op"] for s in program.steps if s["kind"] == "aten"]
    assert aten == ["aten::scaled_dot_product_attention", "aten::contiguous", "aten::view"], aten


@pytest.mark.parametrize("shape, strides, dense", [
    ((2, 3, 4), (12, 4, 1), True), ((2, 3, 4), (12, 1, 3), True), ((8, 8, 256, 64), (131072, 64, 512, 1), True),
    ((2, 1, 4), (4, 99, 1), True), ((2, 3), (0, 1), False), ((2, 3), (6, 1), False), ((4, 4), (4, 2), False)])
def test_dense_permutation(shape, strides, dense):
    from stitchcuda.graph.lower import _dense_permutation

    assert _dense_permutation(shape, strides) is dense


def test_golden_causal_attention_written_out_is_one_attention_group():
    # bmm -> scale -> causal mask -> softmax -> bmm is one attention step that never builds the scores; the
    # mask's constant lower triangle is recognized as causal, so nothing computes it.
    ((kind, ops),) = _partition("attention_causal_masked")
    assert kind == "attention" and ops.count("aten::bmm") == 2 and "aten::_softmax" in ops
    assert {"aten::mul.Tensor", "aten::where.self"} <= set(ops)
    plan = _planned("attention_causal_masked")
    (attention,) = [g for g in plan.groups if g.kind == "attention"]
    assert attention.params["attention"].causal


