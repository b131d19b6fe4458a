"""Graph mode without a GPU: capture to core ATen, the offline Planner's partition and its reasons, the
template Coder's kernels compiling through NVRTC, lowering to a valid Program, and optimize() falling
back to the eager model with a reason where it cannot proceed.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stitchcuda
from stitchcuda import Program, jit
from stitchcuda.graph import CaptureError, Lowering, OfflinePlanner, capture, reference_values
from stitchcuda.graph.templates import PointwiseInput, depthwise_conv_kernel, pointwise_kernel, row_reduction_kernel


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.ln, self.l2 = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 16)
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x, img):
        h = self.ln(F.gelu(self.l1(x))) * 2 + 1
        y = torch.softmax(F.relu(self.l2(h)), -1)
        z = F.relu(self.bn(self.conv(img)))
        return y, z.mean(dim=(2, 3)), h.transpose(0, 1)


def planned(model, inputs):
    graph = capture(model.eval(), inputs)
    return graph, OfflinePlanner().plan(graph)


def test_planner_partitions_and_explains():
    graph, plan = planned(Block(), (torch.randn(4, 32), torch.randn(2, 3, 8, 8)))
    kinds = [(g.kind, [n.op for n in g.nodes]) for g in plan.groups]
    assert ("gemm", ["aten::addmm", "aten::relu"]) in kinds                      # ReLU in the epilogue
    # Exact GELU is no epilogue: computed on load by the layer norm, its only reader; "* 2 + 1" is
    # applied to the layer norm's results before they are stored.
    assert ("reduction", ["aten::gelu", "aten::native_layer_norm", "aten::mul.Tensor", "aten::add.Tensor"]) in kinds
    assert ("reduction", ["aten::_softmax"]) in kinds
    assert ("aten", ["aten::convolution"]) in kinds
    # NCHW mean over H, W of the convolution's bias (moved after it by the capture), BN and ReLU, which
    # nothing else reads: one kernel, z never stored.
    assert ("reduction", ["aten::add.Tensor", "aten::_native_batch_norm_legit_no_training", "aten::relu",
                          "aten::mean.dim"]) in kinds
    gemm = next(g for g in plan.groups if g.kind == "gemm" and len(g.nodes) == 2)
    assert gemm.params["transpose_b"] and "bias_relu" in gemm.reason
    assert any("fp32" in d for d, _ in plan.decisions) and any("CUDA graph" in d for d, _ in plan.decisions)


def test_lowering_builds_a_valid_program_with_views_and_no_copies_of_weights():
    model = Block().eval()
    inputs = (torch.randn(4, 32), torch.randn(2, 3, 8, 8))
    graph, plan = planned(model, inputs)
    values = reference_values(graph, list(inputs))
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    lowering = Lowering(graph, plan, constants)
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    kinds = [s["kind"] for s in program.steps]
    assert kinds.count("matmul") == 2 and kinds.count("kernel") == 3
    # The weight transposes were folded into the matmuls, so no transposed copy is stored.
    assert [b["shape"] for b in program.buffers if b["name"] == "p_l1_weight"] == [[64, 32]]
    assert not any(b["name"].startswith("permute") and b["role"] == "weight" for b in program.buffers)
    # Every generated kernel compiles with NVRTC (no GPU needed).
    for _, code in lowering.kernels:
        jit.compile(code.source, code.name)
    program.validate()


def test_fused_kernel_source_reads_like_the_ops():
    code = pointwise_kernel("fused_demo", (8, 4), [PointwiseInput("in0", torch.float32, (4, 1)),
                                                   PointwiseInput("in1", torch.float32, (0, 1))],
                            ["const float t0 = (in0 + in1);", "const float t1 = fmaxf(t0, 0.0f);"],
                            [("out0", "t1", torch.float32)])
    # A broadcast input over a last extent of 4: four outputs per step, the row vector one 16-byte load.
    assert "c1 * 1LL" in code.source and "four outputs per thread" in code.description
    assert "reinterpret_cast<const float4*>(p1 + e1)" in code.source
    jit.compile(code.source, code.name)
    odd = pointwise_kernel("fused_odd", (8, 3), [PointwiseInput("in0", torch.float32, (3, 1)),
                                                 PointwiseInput("in1", torch.float32, (0, 1))],
                           ["const float t0 = (in0 + in1);"], [("out0", "t0", torch.float32)])
    assert "float4" not in odd.source and "strided/broadcast" in odd.description  # 3 wide: one per step
    jit.compile(odd.source, odd.name)
    # Coordinates in 32 bits while the flat index fits, 64 past 2^31 elements.
    assert "const unsigned c1 = r % 3u" in odd.source
    huge = pointwise_kernel("fused_huge", (1 << 16, 1 << 15, 3), [PointwiseInput("in0", torch.float32, (0, 3, 1))],
                            ["const float t0 = in0 * 2.0f;"], [("out0", "t0", torch.float32)])
    assert "const long long c1 = r % 32768LL" in huge.source
    jit.compile(huge.source, huge.name)
    vec = pointwise_kernel("fused_vec", (8, 4), [PointwiseInput("in0", torch.float32, (4, 1))],
                           ["const float t0 = in0 * 2.0f;"], [("out0", "t0", torch.float32)])
    assert vec.vectorized and "float4" in vec.source
    for kind in ("softmax", "log_softmax", "layer_norm", "sum", "mean", "amax", "amin"):
        for cols in (16, 3000, 3001, 9000, 32768):  # warp, registers, block, registers, registers at the limit
            code = row_reduction_kernel(f"r_{kind}_{cols}", kind, 8, cols, torch.float32,
                                        has_weight=kind == "layer_norm", has_bias=kind == "layer_norm")
            jit.compile(code.source, code.name)


class MobileBlock(nn.Module):
    """A depthwise 3x3 convolution, inference batch norm and SiLU, then a pointwise (1x1) convolution."""

    def __init__(self, c=8):
        super().__init__()
        self.dw, self.bn = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c)
        self.pw = nn.Conv2d(c, 2 * c, 1)

    def forward(self, x):
        return self.pw(F.silu(self.bn(self.dw(x))))


def test_depthwise_convolution_is_a_template_with_its_activation_before_the_store():
    graph, plan = planned(MobileBlock(), (torch.randn(2, 8, 12, 12),))
    kinds = [(g.kind, [n.op for n in g.nodes]) for g in plan.groups]
    assert ("conv", ["aten::convolution", "aten::_native_batch_norm_legit_no_training", "aten::sigmoid",
                     "aten::mul.Tensor"]) in kinds, kinds
    assert ("aten", ["aten::convolution"]) in kinds  # the 1x1 convolution mixes channels: cuDNN
    lowering = Lowering(graph, plan, {})
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    (group, code), = [(g, c) for g, c in lowering.kernels if g.kind == "conv"]
    assert code.name.startswith("depthwise") and "3 elementwise op(s) applied before the store" in code.description
    jit.compile(code.source, code.name)
    program.validate()
    # Half and bfloat16 take the segment loop (converted on load, fp32 accumulation) and compile too.
    for dtype in (torch.float16, torch.bfloat16):
        half = depthwise_conv_kernel("dw_half", (2, 8, 12, 12), (3, 3), (1, 1), (1, 1), (1, 1), dtype, has_bias=True)
        assert "halo" not in half.description
        jit.compile(half.source, half.name)
    # Not depthwise, or a filter past the unrolled limit: cuDNN.
    for conv in (nn.Conv2d(8, 8, 3, groups=2), nn.Conv2d(8, 8, 9, padding=4, groups=8)):
        graph, plan = planned(conv, (torch.randn(1, 8, 12, 12),))
        assert [g.kind for g in plan.groups if g.kind != "constant"] == ["aten"]


class SwiGLU(nn.Module):
    def __init__(self, d=16, hidden=32, reuse=False):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False), \
            nn.Linear(hidden, d, bias=False)
        self.mix = nn.Linear(hidden, hidden, bias=False) if reuse else None

    def forward(self, x):
        g = F.silu(self.gate(x))
        # reuse: the second product reads the activation, so it cannot wait for the gated product.
        u = self.up(x) if self.mix is None else self.mix(g)
        return self.down(g * u)


def test_an_activation_waits_past_a_matmul_for_the_product_that_reads_it():
    graph, plan = planned(SwiGLU(), (torch.randn(8, 16),))
    kinds = [(g.kind, [n.op.removeprefix("aten::") for n in g.nodes]) for g in plan.groups if g.kind != "view"
             and g.kind != "constant"]
    assert kinds == [("gemm", ["mm"]), ("gemm", ["mm"]), ("pointwise", ["sigmoid", "mul.Tensor", "mul.Tensor"]),
                     ("gemm", ["mm"])], kinds
    lowering = Lowering(graph, plan, {})
    lowering.build(plan.groups, graph.inputs, graph.outputs).validate()
    (code,) = [c for g, c in lowering.kernels if g.kind == "pointwise"]
    assert sum(k == "out" for k, _ in code.args) == 1  # the product alone is stored, silu(gate) never
    # A matmul in between reads the activation: it stays where it was.
    graph, plan = planned(SwiGLU(reuse=True), (torch.randn(8, 16),))
    pointwise = [[n.op.removeprefix("aten::") for n in g.nodes] for g in plan.groups if g.kind == "pointwise"]
    assert ["sigmoid", "mul.Tensor"] in pointwise, pointwise


class ManualLogSumExp(nn.Module):
    def __init__(self, keep_max=False):
        super().__init__()
        self.keep_max = keep_max

    def forward(self, x):
        m = torch.amax(x, dim=-1, keepdim=True)
        lse = m + torch.log(torch.sum(torch.exp(x - m), dim=-1, keepdim=True))
        return (lse, m) if self.keep_max else lse


def test_a_hand_written_log_sum_exp_reads_its_rows_once():
    graph, plan = planned(ManualLogSumExp(), (torch.randn(6, 64),))
    (g,) = [g for g in plan.groups if g.kind == "reduction"]
    assert g.params["kind"] == "sum_exp" and "read once" in g.reason
    assert [n.op.removeprefix("aten::") for n in g.nodes] == ["amax", "sub.Tensor", "exp", "sum.dim_IntList", "log",
                                                             "add.Tensor"]
    lowering = Lowering(graph, plan, {})
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    (_, code), = lowering.kernels
    assert code.args[0] == ("in", "x") and "online" in code.description
    jit.compile(code.source, code.name)
    program.validate()
    # The max is returned too: it must be stored, so the two reductions stay apart.
    graph, plan = planned(ManualLogSumExp(keep_max=True), (torch.randn(6, 64),))
    assert sorted(g.params["kind"] for g in plan.groups if g.kind == "reduction") == ["amax", "sum"]


class LogitsKL(nn.Module):
    def forward(self, s, t):
        return F.kl_div(F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1), reduction="batchmean", log_target=True)


class SumOfSquares(nn.Module):
    def forward(self, x):
        return (x * x).sum() / x.numel()


def test_a_loss_over_the_whole_tensor_is_split_over_many_blocks():
    # A sum over every element (dim=[] as ATen writes it, or no dim): one row of all the elements, which a
    # block per row would reduce on one SM. It is split into equal chunks and reduced in two passes.
    graph, plan = planned(SumOfSquares(), (torch.randn(8, 1 << 15),))
    loss = [g for g in plan.groups if g.kind == "reduction" and g.params["kind"] == "sum"]
    assert len(loss) == 1 and (loss[0].params["rows"], loss[0].params["cols"]) == (1, 1 << 18)
    assert loss[0].params["split"] == 16 and "16 chunks of 16384" in loss[0].reason
    lowering = Lowering(graph, plan, {})
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    chunks, final = [code for g, code in lowering.kernels if g is loss[0]]
    assert chunks.grid == 16 and "1 elementwise op(s) fused into the loads" in chunks.description
    assert final.grid == 1 and "applied before the store" in final.description  # the division
    for code in (chunks, final):
        jit.compile(code.source, code.name)
    program.validate()
    # Many rows already fill the GPU; short rows gain nothing: a block (or a warp) per row as before.
    graph, plan = planned(SumOfSquares(), (torch.randn(4, 64),))
    assert not any("split" in g.params for g in plan.groups)


def test_a_kl_divergence_of_log_softmaxes_reads_its_logits_once():
    # kl_div's sum is over dim=[] (every element); its loads read two log-softmaxes nothing else reads:
    # one kernel normalizes each row of both logits in registers and sums the loss terms, a second sums
    # the rows' results and divides by the batch. The log-softmaxes are never stored.
    graph, plan = planned(LogitsKL(), (torch.randn(8, 4096), torch.randn(8, 4096)))
    (g,) = [g for g in plan.groups if g.kind == "reduction"]
    assert [n.op.removeprefix("aten::") for n in g.nodes] == ["_log_softmax", "_log_softmax", "sub.Tensor", "exp",
                                                               "mul.Tensor", "sum.dim_IntList", "div.Tensor"]
    assert "reads each logits row once" in g.reason and "a sum over the whole tensor" in g.reason
    lowering = Lowering(graph, plan, {})
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    rows, final = [code for _, code in lowering.kernels]
    assert rows.grid == 8 and [a for a in rows.args if a[0] == "in"] == [("in", "x0"), ("in", "x1")]
    assert final.grid == 1 and "applied before the store" in final.description  # the batchmean division
    for code in (rows, final):
        jit.compile(code.source, code.name)
    program.validate()
    # The one intermediate is the rows' results (8 floats), not a log-softmax of the logits' size.
    assert [b["shape"] for b in program.buffers if b["role"] == "intermediate"] == [[8]]
    # A log-softmax that is also returned must be stored: it stays its own group, which the fused kernel
    # reads like any other operand; the other one is still normalized in registers.
    class AlsoReturned(nn.Module):
        def forward(self, s, t):
            ls = F.log_softmax(s, dim=-1)
            return F.kl_div(ls, F.log_softmax(t, dim=-1), reduction="sum", log_target=True), ls

    graph, plan = planned(AlsoReturned(), (torch.randn(8, 4096), torch.randn(8, 4096)))
    kinds = sorted(g.params["kind"] for g in plan.groups if g.kind == "reduction")
    assert kinds == ["log_softmax", "normalized"]
    (fused,) = [g for g in plan.groups if g.params["kind"] == "normalized"]
    assert [n.op.removeprefix("aten::") for n in fused.nodes][:2] == ["_log_softmax", "sub.Tensor"]


class SmoothedCrossEntropy(nn.Module):
    def forward(self, x, target):
        return F.cross_entropy(x, target, label_smoothing=0.1)


def test_a_cross_entropy_reads_its_logits_once():
    # Its log-softmax is read by a gather (the target's log-probability) and a row sum (label smoothing):
    # both are computed in the kernel that normalizes the rows, which are never stored.
    x, target = torch.randn(16, 2048), torch.randint(0, 2048, (16,))
    graph, plan = planned(SmoothedCrossEntropy(), (x, target))
    (g,) = [g for g in plan.groups if g.params.get("kind") == "normalized"]
    assert [n.op.removeprefix("aten::") for n in g.nodes] == ["_log_softmax", "gather", "sum.dim_IntList"]
    assert "a gather of one column per row; a sum per row" in g.reason
    assert not any(n.op == "aten::_log_softmax" for h in plan.groups if h is not g for n in h.nodes)
    values = reference_values(graph, [x, target])
    constants = {h.nodes[0].out.name: values[h.nodes[0].out.name] for h in plan.groups if h.kind == "constant"}
    lowering = Lowering(graph, plan, constants)
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    (code,) = [c for h, c in lowering.kernels if h is g]
    assert code.grid == 16 and ("in", "g0") in code.args and ("out", "y1") in code.args
    jit.compile(code.source, code.name)
    program.validate()
    # The log-softmax is stored where something else reads it too (here: it is returned).
    class AlsoLogProbs(nn.Module):
        def forward(self, x, target):
            ls = F.log_softmax(x, dim=-1)
            return F.nll_loss(ls, target), ls

    graph, plan = planned(AlsoLogProbs(), (x, target))
    assert not any(g.params.get("kind") == "normalized" for g in plan.groups)


def test_data_dependent_control_flow_is_a_capture_error():
    class Branchy(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x - 1

    with pytest.raises(CaptureError, match="torch.export could not capture"):
        capture(Branchy(), (torch.randn(4),))


def test_optimize_without_a_gpu_returns_the_model_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    model = nn.Linear(4, 4).eval()
    fast = stitchcuda.optimize(model, (torch.randn(2, 4),))
    assert fast.report.status == "eager" and "no CUDA device" in fast.report.reason
    x = torch.randn(2, 4)
    assert torch.equal(fast(x), model(x))
    with pytest.raises(RuntimeError, match="nothing to save"):
        fast.save("/tmp/never.stitch")


def test_cli_optimize_plans_a_problem_file_without_a_gpu(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU (the GPU path is tested in test_gpu_graph.py)")
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "stitchcuda", "optimize", str(root / "examples/models/block.py")],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stderr
    assert "planned and compiled only" in run.stdout and "[gemm     ] addmm" in run.stdout
    # The block's attention, written out, is one SDPA step (docs/attention.md): no scores, no softmax group.
    assert "[attention] permute" in run.stdout and "scaled_dot_product_attention step" in run.stdout
    assert "[reduction] div.Tensor, _softmax" not in run.stdout
    assert "Traceback" not in run.stderr
    bad = tmp_path / "nothing.py"
    bad.write_text("x = 1\n")
    run = subprocess.run([sys.executable, "-m", "stitchcuda", "optimize", str(bad)], capture_output=True, text=True,
                         timeout=300, cwd=root)
    assert run.returncode == 2 and "Model" in run.stderr and "Traceback" not in run.stderr


def test_optimize_time_bench_model_is_past_100_ops_and_compiles_here():
    """The optimize-time benchmark's model (`stitchcuda bench graph`): its size, and that its CPU side
    (capture, plan, generate, NVRTC compile, cold then warm cache) runs where there is no GPU."""
    if torch.cuda.is_available():
        pytest.skip("the GPU run of this benchmark happens in scripts/gpu-check")
    from stitchcuda.bench.graph import optimize_time

    cache = jit.cache_dir()
    timing = optimize_time(gpu=False)
    assert timing["ops"] >= 100 and timing["generated_kernels"] > 0, timing
    assert timing["cold_s"] > 0 and timing["warm_s"] > 0 and timing["verified"] is None
    assert "nothing verified" in timing["scope"] and timing["met"] is False
    assert jit.cache_dir() == cache  # the benchmark's temporary cache is gone and the user's restored


def test_group_check_runs_in_the_verifiers_worker_and_reports_back():
    """check_group(..., pool=) ships the group's program (CUBINs included) to a worker process. Without a
    GPU the worker cannot run it: the group falls back with the worker's reason, and this process is
    untouched (on the GPU machine the same path checks the kernels: tests/python/test_gpu_graph.py)."""
    if torch.cuda.is_available():
        pytest.skip("checked with a real GPU in test_gpu_graph.py")
    from stitchcuda.graph.lower import check_group
    from stitchcuda.verify import WorkerPool

    model = Block().eval()
    inputs = (torch.randn(4, 32), torch.randn(2, 3, 8, 8))
    graph, plan = planned(model, inputs)
    values = reference_values(graph, list(inputs))
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    group = next(g for g in plan.groups if g.kind == "reduction" and g.params.get("output"))
    with WorkerPool(["cpu"]) as pool:
        ok, why, code = check_group(graph, plan, group, values, constants, 132, pool)
        worker_pids = pool.pids
    assert not ok and why.startswith("runtime: UnavailableError") and re.search(r"CUDA (device|driver)", why), why
    assert code is not None and code.name in code.source  # the generated kernel is still reported
    assert worker_pids[0] not in (None, __import__("os").getpid())


def test_input_free_factories_fold_into_constants_up_to_a_size(monkeypatch):
    from stitchcuda.graph import planner

    class Masked(nn.Module):
        def forward(self, x):
            mask = torch.arange(8).unsqueeze(0) <= torch.arange(8).unsqueeze(1)
            return torch.where(mask, x, torch.full((8, 8), -1.0))

    graph, plan = planned(Masked(), (torch.randn(8, 8),))
    kinds = {n.op: g.kind for g in plan.groups for n in g.nodes}
    assert kinds["aten::arange.start_step"] == kinds["aten::full"] == kinds["aten::le.Tensor"] == "constant", kinds
    assert kinds["aten::where.self"] == "pointwise"
    monkeypatch.setattr(planner, "_FACTORY_FOLD_BYTES", 8 * 8 * 4 - 1)  # the full no longer fits
    _, plan = planned(Masked(), (torch.randn(8, 8),))
    assert {n.op: g.kind for g in plan.groups for n in g.nodes}["aten::full"] == "aten"


def test_reshape_of_a_strided_buffer_is_a_view_exactly_when_aten_says_so():
    from stitchcuda.graph.lower import _view_layout

    base = torch.empty(3, 2, 4, 5).permute(1, 0, 2, 3)[0:1]  # sliced, permuted: not contiguous
    node = lambda op, out, *args: SimpleNamespace(op=op, args=(None, *args), out=SimpleNamespace(shape=out))
    squeezed = _view_layout(node("aten::squeeze.dims", (3, 4, 5), [0]), base.shape, base.stride())
    assert squeezed == ((3, 4, 5), base.squeeze(0).stride(), 0)
    merged = _view_layout(node("aten::view", (1, 3, 20), [1, 3, 20]), base.shape, base.stride())
    assert merged == ((1, 3, 20), base.view(1, 3, 20).stride(), 0)
    with pytest.raises(RuntimeError):
        base.view(1, 12, 5)  # dims 1 and 2 are not adjacent in memory after the permute
    assert _view_layout(node("aten::view", (1, 12, 5), [1, 12, 5]), base.shape, base.stride()) is None


def test_split_and_unbind_pieces_are_views_at_the_right_offsets():
    class Pieces(nn.Module):
        def forward(self, x):
            a, b, c = x.split([4, 4, 8], dim=-1)
            u, v, w = x.permute(1, 0, 2).unbind(0)
            p, q = (x * 3).split(2, dim=1)
            return a * 2 + b, c.sum(-1), u + v * w, p.sum(1) + q.sum(1)

    x = torch.randn(2, 3, 16)
    graph = capture(Pieces(), (x,))
    plan = OfflinePlanner().plan(graph)
    lowering = Lowering(graph, plan, {})
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    program.validate()
    assert not any(s["kind"] == "aten" and ("split" in s["op"] or "unbind" in s["op"]) for s in program.steps)
    # Replays the view steps (as the executor does, with as_strided) from the program's input and from
    # the reference value of every other source, and compares each piece with PyTorch's.
    values = reference_values(graph, [x])
    buffers = {b["id"]: b for b in program.buffers}
    names = {bid: name for name, bid in lowering.buf.items()}
    held = {b["id"]: values[b["name"]] for b in program.buffers if b.get("name") in values}
    pieces = 0
    for s in program.steps:
        if s["kind"] != "view":
            continue
        src, res = held[s["source"]], buffers[s["result"]]
        held[s["result"]] = src.as_strided(res["shape"], res["strides"], src.storage_offset() + s["storage_offset"])
        name = names.get(s["result"])
        if name in values:
            assert torch.equal(held[s["result"]], values[name]), name
            pieces += 1
    assert pieces >= 3 + 3 + 2


@pytest.mark.parametrize("graph_ms, direct_ms, fails, mode", [
    (0.106, 0.037, None, "direct"),   # a big one-kernel program: the replay's copies cost more
    (0.050, 0.210, None, "graph"),    # many small launches: the replay saves host time
    (0.050, 0.050, None, "graph"),    # a tie keeps the graph (less host time when the host is busy)
    (0.050, 0.010, False, "graph"),   # the faster mode failed to run: the one that ran is kept
    (0.050, 0.010, True, "direct"),
])
def test_the_faster_replay_mode_is_kept_and_recorded_in_the_program(monkeypatch, graph_ms, direct_ms, fails, mode):
    import importlib

    # The module, not the function `optimize` that stitchcuda.graph re-exports under the same name.
    build = importlib.import_module("stitchcuda.graph.build")

    class FakeRunner:  # stands in for a ProgramModule, which needs a GPU
        def __init__(self, program, graphs):
            if graphs is fails:
                raise RuntimeError(f"capture failed ({'graph' if graphs else 'direct'})")
            self.graphs = graphs
            self.executor = SimpleNamespace(run=lambda inputs: graph_ms if graphs else direct_ms)

    monkeypatch.setattr(build, "ProgramModule", FakeRunner)
    monkeypatch.setattr(build, "time_ms", lambda fn: fn())
    b = stitchcuda.ProgramBuilder()
    x, y = b.input([4]), b.output([4])
    b.aten("aten::relu", [x], [y])
    program = b.build()
    runner, (decision, why), ms = build.choose_replay(program, [torch.randn(4)])
    assert runner.graphs is (mode == "graph")
    assert ms == (graph_ms if mode == "graph" else direct_ms)  # the kept mode's time, for the layout choice
    assert decision.startswith("replay as one CUDA graph" if mode == "graph" else "launch the steps directly")
    assert program.replay == {"mode": mode, "reason": why}
    if fails is None:
        assert why == (f"measured on the example inputs: CUDA graph replay {graph_ms:.4f} ms, direct launches "
                       f"{direct_ms:.4f} ms per call")
    else:
        assert why.startswith("the other mode failed: RuntimeError: capture failed")


def test_a_replay_whose_copies_dwarf_its_launches_is_not_even_built(monkeypatch):
    """A one-step program on a 1 GiB tensor: a replay would copy 4 GiB to save one launch, and its static
    copies would add 2 GiB to optimize's memory; the direct runner is the only one built."""
    import importlib

    build = importlib.import_module("stitchcuda.graph.build")
    hardware = importlib.import_module("stitchcuda.verify.hardware")
    built = []

    class FakeRunner:
        def __init__(self, program, graphs):
            built.append(graphs)
            self.graphs = graphs
            self.executor = SimpleNamespace(run=lambda inputs: 0.5)

    monkeypatch.setattr(build, "ProgramModule", FakeRunner)
    monkeypatch.setattr(build, "time_ms", lambda fn: fn())
    monkeypatch.setattr(hardware, "describe", lambda: {"gpu": "H200", "dram_tb_s": 4.8})
    b = stitchcuda.ProgramBuilder()
    x, y = b.input([1 << 28]), b.output([1 << 28])
    b.aten("aten::relu", [x], [y])
    program = b.build()
    copies_ms, saved_ms = build.replay_estimate(program)
    assert copies_ms == pytest.approx(4 * 2**30 / 4.8e12 * 1e3) and saved_ms == pytest.approx(build.LAUNCH_US / 1e3)
    runner, (decision, why), ms = build.choose_replay(program, [torch.empty(0)])
    assert built == [False] and runner.graphs is False and ms == 0.5
    assert decision == "launch the steps directly (no CUDA graph)"
    assert why.startswith("estimated, not measured: a replay copies the inputs and outputs (0.895 ms")
    assert program.replay == {"mode": "direct", "reason": why}


def test_the_report_counts_what_a_program_holds_before_it_runs():
    import importlib

    build = importlib.import_module("stitchcuda.graph.build")
    b = stitchcuda.ProgramBuilder()
    x, w = b.input([4, 16]), b.weight([16, 32], data=bytes(16 * 32 * 4))
    bias = b.weight([32], data=bytes(32 * 4))
    t, y = b.intermediate([4, 32]), b.output([4, 32])
    b.matmul(x, w, t, bias=bias, epilogue="bias")
    b.aten("aten::relu", [t], [y])
    program = b.build()
    # 2176 bytes of weights; the [4, 32] f32 intermediate is 512 bytes, the arena's 256-byte alignment keeps it
    # A call plans the arena and its [4, 32] output: 512 + 512 bytes.
    assert build.program_memory(program) == {"weights_bytes": (16 * 32 + 32) * 4, "shared_weights_bytes": 0,
                                            "arena_bytes": 512, "planned_bytes": 1024}
    # A weight shared with the model's tensor is read in place: counted apart, not as the program's own.
    program.share_weight(w, torch.zeros(16, 32))
    assert build.program_memory(program) == {"weights_bytes": 32 * 4, "shared_weights_bytes": 16 * 32 * 4,
                                            "arena_bytes": 512, "planned_bytes": 1024}


def test_a_weight_is_shared_only_with_a_tensor_of_its_dtype_shape_and_layout():
    b = stitchcuda.ProgramBuilder()
    x, w = b.input([4, 16]), b.weight([16, 32], data=bytes(16 * 32 * 4), name="proj")
    y = b.output([4, 32])
    b.matmul(x, w, y)
    program = b.build()
    assert program.shared_weights == {}
    with pytest.raises(stitchcuda.InvalidArgumentError, match="buffer 0 is not a weight of this program"):
        program.share_weight(x, torch.zeros(4, 16))
    with pytest.raises(stitchcuda.InvalidArgumentError,
                       match=r"weight 1 \('proj'\) is f32\[16, 32\] strides \[32, 1\] but the tensor shared for it is "
                             r"f32\[16, 32\] strides \[1, 16\]: share the tensor the weight was built from"):
        program.share_weight(w, torch.zeros(32, 16).t())  # the right shape, transposed in memory
    with pytest.raises(stitchcuda.InvalidArgumentError, match="is f32.* but the tensor shared for it is f64"):
        program.share_weight(w, torch.zeros(16, 32, dtype=torch.float64))
    kept = torch.zeros(16, 32)
    program.share_weight(w, kept)
    assert program.shared_weights.keys() == {w} and program.shared_weights[w] is kept
    # Sharing is this object's: the artifact keeps the bytes, and a program read back uploads them.
    assert stitchcuda.Program.deserialize(program.serialize()).shared_weights == {}


def test_a_shared_weight_built_without_bytes_is_saved_with_its_tensors_values(tmp_path):
    # Graph mode stores no bytes of a parameter it reads in place; saving takes them from the tensor (in
    # the buffer's storage order: a channels-last filter as NHWC bytes) and lets go of them afterwards.
    b = stitchcuda.ProgramBuilder()
    x = b.input([2, 4, 5, 5])
    filt = torch.randn(8, 4, 3, 3).contiguous(memory_format=torch.channels_last)
    w = b.weight([8, 4, 3, 3], strides=list(filt.stride()), name="filter")
    bias = torch.randn(8)
    bb = b.weight([8], name="bias")
    y = b.output([2, 8, 3, 3])
    b.aten("aten::convolution", [x, w, bb], [y], stride=[1, 1], padding=[0, 0], dilation=[1, 1], transposed=False,
           output_padding=[0, 0], groups=1)
    program = b.build()
    program.share_weight(w, filt)
    program.share_weight(bb, bias)
    assert not program._p.has_weight_data(w) and not program._p.has_weight_data(bb)
    path = tmp_path / "conv.stitch"
    program.save(path)
    for back in (stitchcuda.Program.load(path), stitchcuda.Program.deserialize(program.serialize())):
        assert back._p.has_weight_data(w) and back._p.has_weight_data(bb)
    # The bytes were taken from the tensors as they are at the save, then dropped from this program: the
    # artifact is the one a program built with the bytes makes.
    assert not program._p.has_weight_data(w)

    def built_with_bytes():
        b = stitchcuda.ProgramBuilder()
        x = b.input([2, 4, 5, 5])
        w, bb, y = b.weight(filt, name="filter"), b.weight(bias, name="bias"), b.output([2, 8, 3, 3])
        b.aten("aten::convolution", [x, w, bb], [y], stride=[1, 1], padding=[0, 0], dilation=[1, 1],
               transposed=False, output_padding=[0, 0], groups=1)
        return b.build()

    assert program.serialize() == built_with_bytes().serialize()
    assert path.read_bytes() == built_with_bytes().serialize()


def test_only_constants_with_memory_of_their_own_leave_the_gpu_after_the_checks():
    # A linear layer's transposed weight is a view of the weight: a host copy would free nothing and add host
    # memory. A mask computed from factories is a tensor of its own.
    import importlib

    build = importlib.import_module("stitchcuda.graph.build")

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            mask = torch.arange(8).unsqueeze(0) <= torch.arange(8).unsqueeze(1)
            return torch.where(mask, self.fc(x), torch.full((8, 8), -1.0))

    model = Masked().eval()
    x = torch.randn(8, 8)
    graph, plan = planned(model, (x,))
    values = reference_values(graph, [x])
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    owning = set(build.owning_constants(constants, model))
    views = {n for n, t in constants.items() if t.untyped_storage().data_ptr() == model.fc.weight.untyped_storage().data_ptr()}
    assert views and owning and not views & owning and owning | views == set(constants), (owning, views)


def _basic_blocks(ptx: str) -> list[str]:
    """The PTX split at labels and branches: a load in one block cannot be issued before the branch ahead of it."""
    return re.split(r"\n\$L__\w+:|\n\s*@?%?\w*\s*bra(?:\.uni)?\s+\$L__\w+;", ptx)


@pytest.mark.parametrize("cols", [1000, 3001], ids=["warp", "block"])
@pytest.mark.parametrize("kind", ["sum", "mean", "amax", "amin", "softmax", "log_softmax", "layer_norm"])
def test_reduction_loops_keep_several_loads_in_flight(kind, cols):
    # A reduction reads the row in loops NVRTC unrolls; when a loop's combine step branches (a NaN check,
    # an exp skipped for an empty state, an IEEE division's slow path), each unrolled load sits in its own
    # basic block and a thread has one load in flight. On the H200 that was measured as half the copy
    # bandwidth (amax over 4,096-element rows: 2.1 TB/s; layer norm over 1,024: 127 us for a 64 us floor).
    # Each pass over the row (statistics; then the output for softmax and the norms) must be one such block.
    from stitchcuda.graph.templates import row_reduction_kernel

    code = row_reduction_kernel(f"k_{kind}", kind, 64, cols, torch.float32, eps=1e-5)
    ptx = jit.compile_module(code.source, program_name=f"{kind}.cu").ptx
    unrolled = [b for b in _basic_blocks(ptx) if b.count("ld.global") >= 2]
    passes = 2 if kind in ("softmax", "log_softmax", "layer_norm") else 1
    assert len(unrolled) >= passes, f"{kind}: {len(unrolled)} pass(es) with several loads in one block, want {passes}"
    for block in unrolled:
        assert "div.rn" not in block and "call" not in block, block


# ---- fp32 matmuls as 3xTF32 (tf32x3) ----

H200_PEAKS = {"fp32_tflops": 67.0, "tf32_tflops": 495.0, "dram_tb_s": 4.8}


class _Projection(nn.Module):
    """A large fp32 projection (bound by fp32 arithmetic) and a small one (bound by launches)."""

    def __init__(self):
        super().__init__()
        self.big, self.small = nn.Linear(4096, 4096), nn.Linear(64, 32)

    def forward(self, x, y):
        return torch.relu(self.big(x)), self.small(y)


def _projection_plan(**planner):
    model = _Projection().eval()
    inputs = (torch.randn(4096, 4096), torch.randn(8, 64))
    graph = capture(model, inputs)
    return graph, OfflinePlanner(**planner).plan(graph)


def test_a_large_fp32_gemm_runs_as_tf32x3_where_the_gpu_peaks_say_it_pays():
    graph, plan = _projection_plan(peaks=H200_PEAKS)
    gemms = [g for g in plan.groups if g.kind == "gemm"]
    assert [g.params["precision"] for g in gemms] == ["tf32x3", "fp32"]
    big = gemms[0]
    assert big.params["epilogue"] == "bias_relu"  # the epilogue still fuses (on the last product)
    assert "3xTF32 on split operands, estimated" in big.reason
    decision = next(d for d in plan.decisions if d[0].startswith("matmuls"))
    assert decision[0] == "matmuls at fp32 accuracy: 1 of 2 as 3xTF32 (tf32x3), the rest SGEMM"
    assert "held to fp32's tolerance" in decision[1] and "split_tf32=False keeps SGEMM" in decision[1]
    assert plan.precision == "fp32"  # the tolerance every check applies stays fp32's
    # The program's policy allows tf32x3 and nothing lossier; its big matmul step asks for it.
    program = Lowering(graph, plan, {}).build(plan.groups, graph.inputs, graph.outputs)
    assert program.precision["matmul"] == "tf32x3"
    assert sorted(s["precision"] for s in program.steps if s["kind"] == "matmul") == ["fp32", "tf32x3"]
    # The artifact keeps it.
    again = Program.deserialize(program.serialize())
    assert again.precision["matmul"] == "tf32x3"
    assert sorted(s["precision"] for s in again.steps if s["kind"] == "matmul") == ["fp32", "tf32x3"]


@pytest.mark.parametrize("planner, why", [
    ({}, "no peaks: the planner cannot tell, so SGEMM"),
    ({"peaks": H200_PEAKS, "split_tf32": False}, "the caller asked for SGEMM"),
    ({"peaks": {"fp32_tflops": 82.6, "tf32_tflops": 82.6, "dram_tb_s": 1.0}}, "TF32 no faster than fp32 SIMT"),
])
def test_fp32_gemms_stay_sgemm_when_tf32x3_would_not_pay_or_is_refused(planner, why):
    graph, plan = _projection_plan(**planner)
    assert [g.params["precision"] for g in plan.groups if g.kind == "gemm"] == ["fp32", "fp32"], why
    assert any(d[0] == "matmuls in true fp32" for d in plan.decisions)
    program = Lowering(graph, plan, {}).build(plan.groups, graph.inputs, graph.outputs)
    assert program.precision["matmul"] == "fp32"


def test_tf32x3_cost_model_counts_the_split_and_the_chunked_accumulation():
    from stitchcuda.graph.gemm_precision import split_tf32_choice

    # Square and compute-bound: worth it on an H200.
    ok, why = split_tf32_choice(8192, 8192, 4096, 1, 8192 * 4096, 4096 * 8192, H200_PEAKS)
    assert ok and why.startswith("estimated") and "as 3xTF32 against" in why
    # A small product, and a batch of thin ones (K = 64), cost more split and accumulate than they save.
    assert not split_tf32_choice(256, 768, 768, 1, 256 * 768, 768 * 768, H200_PEAKS)[0]
    assert not split_tf32_choice(1024, 1024, 64, 32, 32 * 1024 * 64, 32 * 64 * 1024, H200_PEAKS)[0]
    # Tall and skinny: moving the split copies of its 1 GiB input costs more than the tensor cores save.
    ok, why = split_tf32_choice(65536, 64, 4096, 1, 65536 * 4096, 4096 * 64, H200_PEAKS)
    assert not ok and why.startswith("estimated")
    # Split operands that would exceed three times the largest tensor are refused for memory (a transposed
    # a is never split in slabs of K, which would hold less).
    ok, why = split_tf32_choice(64, 64, 1 << 20, 1, 64 << 20, 64 << 20, H200_PEAKS, transpose_a=True)
    assert not ok and "would exceed 3 times its largest tensor (256 MiB)" in why
    # The executor splits a large a a block of rows at a time: the scratch counted is b's parts and one
    # block's, so two 4 GiB operands (16 GiB split whole) fit beside their 4 GiB tensors.
    from stitchcuda.graph.gemm_precision import split_blocks

    assert split_blocks(32768, 32768, 32768) == (256, 32768)  # 64 MiB of a's parts, 8 Mi outputs per block
    assert split_blocks(8192, 768, 3072) == (8192, 768)  # 8 Mi outputs need every row: one block
    assert split_blocks(32768, 32768, 32768, batch=4) == (32768, 32768)
    assert split_blocks(4096, 64, 64, transpose_a=True) == (4096, 64)
    # A linear layer's weight ([N, K], b transposed) larger than 128 MiB of parts is split a block of its
    # rows (columns of the result) at a time, a whole: SwiGLU's fused 4096 -> 20480 projection holds
    # 128 + 64 MiB of parts instead of 64 + 640.
    assert split_blocks(4096, 20480, 4096, transpose_b=True) == (4096, 2048)
    assert split_blocks(4096, 4096, 4096, transpose_b=True) == (2048, 4096)  # 128 MiB of b's parts: whole
    # Both large: a in 256 MiB blocks, b's blocks as large (a is split again for each).
    assert split_blocks(16384, 16384, 8192, transpose_b=True) == (4096, 4096)
    ok, why = split_tf32_choice(4096, 20480, 4096, 1, 4096 * 4096, 20480 * 4096, H200_PEAKS, transpose_b=True)
    assert ok, why
    ok, why = split_tf32_choice(32768, 32768, 32768, 1, 1 << 30, 1 << 30, H200_PEAKS)
    assert ok and "would exceed" not in why, why
    # With TF32 tensor cores allowed outright (precision='tf32'), the planner does not split at all.
    torch.backends.cuda.matmul.allow_tf32, before = True, torch.backends.cuda.matmul.allow_tf32
    try:
        _, plan = _projection_plan(peaks=H200_PEAKS)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert {g.params["precision"] for g in plan.groups if g.kind == "gemm"} == {"tf32"}


def test_tf32x3_with_its_lo_products_fused_counts_one_pass_over_the_result_fewer(stitch_settings, monkeypatch):
    """STITCHCUDA_TF32X3_FUSE_LO=1 (the default, 2, does this and more; 0 keeps the three apart): the executor
    runs a_lo b_hi + a_hi b_lo as one product over 2K, so the cost model counts one read-modify-write of c
    fewer — which turns a ViT's K = 384 projections to tf32x3 — for batch 1, a not transposed and K a
    multiple of 4, and never in slabs of K."""
    from stitchcuda.graph.gemm_precision import fuse_lo, k_block, split_tf32_choice

    stitch_settings(STITCHCUDA_TF32X3_KBLOCK=None)
    tokens = 128 * 197  # a ViT-S/16 batch of 128: 25,216 tokens
    h100 = {**H200_PEAKS, "dram_tb_s": 3.35}  # the H100's memory: the result's passes weigh more than on an H200
    fc1 = (tokens, 1536, 384, 1, tokens * 384, 384 * 1536, h100)
    estimate = lambda why: float(why.split()[1])  # noqa: E731 - "estimated X ms as 3xTF32 ..."
    stitch_settings(STITCHCUDA_TF32X3_FUSE_LO="0")
    assert not fuse_lo(384)
    unfused_ok, unfused = split_tf32_choice(*fc1, transpose_b=True)
    stitch_settings(STITCHCUDA_TF32X3_FUSE_LO="1")
    assert fuse_lo(384) and not fuse_lo(384, batch=2) and not fuse_lo(384, transpose_a=True) and not fuse_lo(386)
    fused_ok, fused = split_tf32_choice(*fc1, transpose_b=True)
    c_pass_ms = 2 * 4 * tokens * 1536 / (h100["dram_tb_s"] * 1e12 * 0.8) * 1e3  # one read and write of c
    assert estimate(unfused) - estimate(fused) == pytest.approx(c_pass_ms, abs=1e-3)
    assert fused_ok and not unfused_ok, (fused, unfused)
    # In slabs of K the lo products stay apart: a down-projection's estimate does not move.
    down = (8192, 1024, 4096, 1, 8192 * 4096, 1024 * 4096, H200_PEAKS)
    assert k_block(8192, 1024, 4096, transpose_b=True) > 0
    with_knob = split_tf32_choice(*down, transpose_b=True)[1]
    stitch_settings(STITCHCUDA_TF32X3_FUSE_LO="0")
    assert split_tf32_choice(*down, transpose_b=True)[1] == with_knob


def test_tf32x3_first_hi_chunk_joins_the_fused_lo_products(stitch_settings, monkeypatch):
    """STITCHCUDA_TF32X3_FUSE_LO=2 (the default): the first hi*hi chunk runs in the fused lo products' call, over
    2K + chunk — one pass over the result fewer, for that chunk of a_hi and b_hi written again (4 * chunk / K
    more bytes of split traffic and scratch per operand element). Where K fits one chunk the three products
    are one and the result is written once."""
    from stitchcuda.graph.gemm_precision import fuse_all, fused_hi, split_tf32_choice

    stitch_settings(STITCHCUDA_TF32X3_FUSE_LO=None)  # 2 by default
    assert fused_hi(384) == 384 and fused_hi(1024) == 512
    stitch_settings(STITCHCUDA_TF32X3_KBLOCK=None)
    stitch_settings(STITCHCUDA_TF32X3_CHUNK=None)
    tokens = 128 * 197
    h100 = {**H200_PEAKS, "dram_tb_s": 3.35}
    dram = h100["dram_tb_s"] * 1e12 * 0.8
    estimate = lambda why: float(why.split()[1])  # noqa: E731 - "estimated X ms as 3xTF32 ..."
    # a ViT's fc1 (K within one chunk) and a transformer encoder's 1024 -> 3072 projection (two chunks)
    for m, k, n in ((tokens, 384, 1536), (8192, 1024, 3072)):
        a_elems, b_elems = m * k, k * n
        shape = (m, n, k, 1, a_elems, b_elems, h100)
        stitch_settings(STITCHCUDA_TF32X3_FUSE_LO="1")
        assert fused_hi(k) == 0 and not fuse_all(k)
        _, lo_fused = split_tf32_choice(*shape, transpose_b=True)
        stitch_settings(STITCHCUDA_TF32X3_FUSE_LO="2")
        assert fused_hi(k) == min(k, 512) and fuse_all(k) == (k <= 512)
        _, first_chunk = split_tf32_choice(*shape, transpose_b=True)
        c_pass_ms = 2 * 4 * m * n / dram * 1e3
        extra_split_ms = 4 * min(k, 512) / k * (a_elems + b_elems) / dram * 1e3
        assert estimate(lo_fused) - estimate(first_chunk) == pytest.approx(c_pass_ms - extra_split_ms, abs=1e-3)
    assert split_tf32_choice(tokens, 1536, 384, 1, tokens * 384, 384 * 1536, h100, transpose_b=True)[0]
    assert fused_hi(384, batch=2) == 0 and fused_hi(386) == 0 and not fuse_all(0)


def test_tf32x3_slabs_of_k_where_blocks_stay_large_beside_the_result(stitch_settings, monkeypatch):
    """The executor splits both operands a slab of K at a time where the blocks of its parts would stay large
    beside the result (a down-projection: the 8 Mi-output floor keeps a whole), in two slabs; a square
    product keeps its blocks. The cost model counts the slabs' scratch
    and their two extra passes over c per extra slab; STITCHCUDA_TF32X3_KBLOCK overrides the choice."""
    from stitchcuda.graph.gemm_precision import k_block, split_blocks, split_tf32_choice

    stitch_settings(STITCHCUDA_TF32X3_KBLOCK=None)
    m, n, k = 8192, 1024, 4096  # a transformer encoder's 4096 -> 1024 projection over 8192 tokens
    assert split_blocks(m, n, k, 1, False, True) == (m, n)  # 288 MiB of parts as blocks
    assert k_block(m, n, k, transpose_b=True) == 2048  # 144 MiB in two slabs
    assert k_block(12544, 768, 3072, transpose_b=True) == 1536  # an MLP-Mixer's channel projection
    assert k_block(16384, 768, 3072, transpose_b=True) == 1536  # GPT's MLP output over 16384 tokens
    assert k_block(8192, 1024, 4096 + 100, transpose_b=True) == 2560  # half of K, rounded up to the chunk
    for shape in ((4096, 4096, 4096), (8192, 4096, 8192), (8192, 4096, 1024), (512, 512, 512)):
        assert k_block(*shape, transpose_b=True) == 0, shape  # parts within 4x the result or 160 MiB
    assert k_block(m, n, k, batch=2, transpose_b=True) == 0 and k_block(m, n, k, transpose_a=True) == 0
    args = (m, n, k, 1, m * k, n * k, H200_PEAKS)
    _, two = split_tf32_choice(*args, transpose_b=True)
    stitch_settings(STITCHCUDA_TF32X3_KBLOCK="0")
    assert k_block(m, n, k) == 0
    _, whole = split_tf32_choice(*args, transpose_b=True)
    stitch_settings(STITCHCUDA_TF32X3_KBLOCK="1000")  # rounded down to the 512-element chunk
    assert k_block(m, n, k) == 512 and k_block(m, n, 512) == 0 and k_block(m, n, 4096 + 512) == 512
    _, four = split_tf32_choice(*args, transpose_b=True)
    estimate = lambda why: float(why.split()[1])  # noqa: E731 - "estimated X ms as 3xTF32 ..."
    assert estimate(whole) < estimate(two) < estimate(four)  # two more passes over c per extra slab
    # The scratch is a slab of each: operands whose parts would exceed the cap whole fit in slabs.
    thin = (64, 64, 1 << 20, 1, 64 << 20, 64 << 20, H200_PEAKS)
    assert "would exceed" not in split_tf32_choice(*thin)[1]
    stitch_settings(STITCHCUDA_TF32X3_KBLOCK="0")
    assert "would exceed" in split_tf32_choice(*thin)[1]
    stitch_settings(STITCHCUDA_TF32X3_KBLOCK="64")
    assert k_block(m, n, k) == 512
    stitch_settings(STITCHCUDA_TF32X3_CHUNK="256")
    assert k_block(m, n, k) == 256  # a slab is at least one chunk


# ---- planning optimize()'s memory ----

class _Chain(nn.Module):
    def forward(self, x):
        a = torch.relu(x)               # a alive
        b = (a * 2).reshape(-1)         # a and b alive while b is made; the reshape is a view of b
        c = b + 1                       # b and c
        return c.view(x.shape), x.sum()


def test_the_working_set_estimate_follows_lifetimes_and_views():
    x = torch.randn(64, 1024)
    graph = capture(_Chain(), (x,))
    n = x.numel() * 4
    assert graph.working_set_bytes() == 2 * n  # never three of the chain's tensors at once
    assert graph.largest_tensor_bytes() == n


class _ManyLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])

    def forward(self, x):
        return self.layers(x)


def test_the_fp64_check_is_left_out_when_it_would_exceed_optimizes_memory_allowance(monkeypatch):
    import importlib

    measure = importlib.import_module("stitchcuda.graph.measure")
    program_module = importlib.import_module("stitchcuda.verify.program")
    graph = capture(_ManyLayers().eval(), (torch.randn(8, 256),))
    plan = OfflinePlanner().plan(graph)
    assert measure.fp64_too_large(plan, graph) == ""  # 4 MiB of weights: far below the 256 MiB floor
    monkeypatch.setattr(program_module, "EXACT_COPY_LIMIT_BYTES", 1 << 20)
    why = measure.fp64_too_large(plan, graph)
    # 16 layers of 256 KiB weights against a largest tensor of 256 KiB: the fp64 copy would need 8 MiB+.
    assert why.startswith("an fp64 copy of the model and its forward would take about 8 MiB, above optimize's "
                          "memory allowance of 1 MiB (twice the largest tensor)"), why


# ---- rows longer than a block's shared memory: a thread-block cluster per row ----

def test_cluster_size_splits_long_rows_into_aligned_parts_that_fit_shared_memory():
    from stitchcuda.graph.templates import CLUSTER_ROW_MAX, cluster_size

    assert cluster_size(65536) == 4      # 64 KiB parts: two blocks per SM
    assert cluster_size(128256) == 8     # a 128K vocabulary: 8 parts of 16,032
    assert cluster_size(196608) == 8
    assert cluster_size(256000) == 8     # parts of 125 KiB: one block per SM, still one read
    assert cluster_size(CLUSTER_ROW_MAX) == 8 and cluster_size(CLUSTER_ROW_MAX + 32) == 0  # parts would exceed 200 KiB
    assert cluster_size(196610) == 0     # no split into 16-byte parts


@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "layer_norm"])
@pytest.mark.parametrize("cols", [128256, 196608])
def test_rows_longer_than_shared_memory_compile_as_a_cluster_kernel(kind, cols):
    from stitchcuda.graph.templates import cluster_size

    norm = kind == "layer_norm"
    code = row_reduction_kernel(f"c_{kind}", kind, 6, cols, torch.float32, has_weight=norm, has_bias=norm)
    n = cluster_size(cols)
    assert f"__cluster_dims__(CLUSTER, 1, 1)" in code.source and f"#define CLUSTER {n}" in code.source
    assert code.grid == 6 * n and code.block == 512 and code.shared_mem == 4 * cols // n <= 200 * 1024
    assert "one read and one write" in code.description
    kernel = jit.compile(code.source, code.name)  # NVRTC, for sm_90a: clusters and distributed shared memory
    assert len(kernel.params) == len(code.args)


def test_a_group_norm_over_large_images_runs_as_a_cluster_kernel_reading_weights_by_channel():
    """32 groups of 256 channels of 128 x 128: rows of 131,072 (512 KiB) that a block per row reads twice
    from memory; a cluster of 8 blocks holds each row in shared memory and reads it once."""
    graph = capture(nn.GroupNorm(32, 256).eval(), (torch.randn(2, 256, 128, 128),))
    plan = OfflinePlanner().plan(graph)
    program = Lowering(graph, plan, {}).build(plan.groups, graph.inputs, graph.outputs)
    (kernel,) = program.kernels
    source = kernel["source"]
    assert "__cluster_dims__(CLUSTER, 1, 1)" in source and "#define CLUSTER 8" in source
    # Weight and bias by channel: the row's group times 8 channels per group, plus the column's channel.
    assert "w[((row % 32LL) * 8LL + (part * PART + 4LL * c + 0) / 16384LL)]" in source
    assert "load4(w" not in source  # not indexed as a layer norm's per-column weight
    program.compile_kernels()
    with pytest.raises(ValueError, match="group_hw dividing cols"):
        row_reduction_kernel("bad", "group_norm", 2, 131072, torch.float32, groups=32, group_hw=3)


def test_a_scaled_log_softmax_over_a_vocabulary_fuses_its_scale_into_the_cluster_kernel():
    class Scaled(nn.Module):
        def forward(self, x):
            return torch.log_softmax(x / 0.7, dim=-1)

    graph = capture(Scaled(), (torch.randn(2, 128256),))
    plan = OfflinePlanner().plan(graph)
    (group,) = [g for g in plan.groups if g.kind == "reduction"]
    assert "a cluster of 8 blocks per row" in group.reason and "fused into its loads" in group.reason
    program = Lowering(graph, plan, {}).build(plan.groups, graph.inputs, graph.outputs)
    (kernel,) = program.kernels
    assert "__cluster_dims__" in kernel["source"] and "_x(base + 4LL * c" in kernel["source"]
    program.compile_kernels()  # the scalar prologue path compiles too


def test_a_half_precision_models_matmuls_are_reported_in_its_dtype():
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).to(torch.bfloat16).eval()
    plan = OfflinePlanner().plan(capture(model, (torch.randn(4, 32, dtype=torch.bfloat16),)))
    assert ("matmuls in bf16, the model's dtype" in [d for d, _ in plan.decisions]), plan.decisions
    plan = OfflinePlanner().plan(capture(model.float(), (torch.randn(4, 32),)))
    assert "matmuls in true fp32" in [d for d, _ in plan.decisions]


def test_constants_are_computed_from_the_weights_alone():
    # The plan-only path computes the constants by running only the nodes they depend on: no user input
    # is read (the forward is a model's full cost on a CPU) and the values are reference_values' own.
    from stitchcuda.graph.lower import constant_values

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x):
            mask = torch.full((8, 8), float("-inf")).triu(1)
            return torch.softmax(x @ self.proj.weight.t() * 0.5 + mask[: x.shape[0], : x.shape[0]].sum(), dim=-1)

    x = torch.randn(8, 16)
    graph = capture(Masked().eval(), (x,))
    plan = OfflinePlanner().plan(graph)
    names = {g.nodes[0].out.name for g in plan.groups if g.kind == "constant"}
    assert names
    values = constant_values(graph, names)
    full = reference_values(graph, [x])
    assert values.keys() == names
    for name in names:
        assert torch.equal(values[name], full[name])


class _TorchAttention(nn.Module):
    """nn.MultiheadAttention on batch-first input: its packed input projection traces as a bmm of the
    input against the weight expanded over the batch (197 x 768 x 2304 floats in a ViT-B layer)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def test_a_weight_expanded_over_a_batch_is_read_as_one_broadcast_matrix():
    from stitchcuda.graph.lower import group_inputs

    model = _TorchAttention().eval()
    graph = capture(model, (torch.randn(3, 50, 64),))
    plan = OfflinePlanner().plan(graph)
    bmm = [g for g in plan.groups if g.kind == "gemm" and "broadcast over the batch" in g.reason]
    assert bmm, [g.reason for g in plan.groups if g.kind == "gemm"]
    for g in bmm:
        b = g.params["b"]
        assert len(b.shape) == 2 and b.kind == "weight" and g.params["transpose_b"], (b.name, b.shape)
        # Its check reads the weight itself, not the expansion it was traced on.
        assert b in group_inputs(g) and all(len(v.shape) < 3 or v.kind != "weight" for v in group_inputs(g))
    # The program stores the weights once: no buffer holds an expansion of one.
    program = Lowering(graph, plan, {}).build(plan.groups, graph.inputs, graph.outputs)
    stored = sum(math.prod(b["shape"]) for b in program.buffers if b["role"] == "weight")
    assert stored <= sum(p.numel() for p in model.parameters()), stored
    steps = [s for s in program.steps if s["kind"] == "matmul" and s["batch"] > 1]
    assert steps and all(len(next(b for b in program.buffers if b["id"] == s["b"])["shape"]) == 2 for s in steps)


class _Swap(nn.Module):
    def forward(self, a):
        return torch.cat((a[..., 16:], a[..., :16]), dim=-1) * 2  # halves swapped, none negated


class _Rope(nn.Module):
    """RoPE as Llama writes it: q * cos + rotate_half(q) * sin, rotate_half(x) = cat(-x[..., h:], x[..., :h])."""

    def forward(self, q, cos, sin):
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * cos + rotated * sin


def test_ropes_rotate_half_fuses_into_one_kernel_with_its_products():
    q = torch.randn(2, 4, 16, 32).transpose(1, 2).contiguous().transpose(1, 2)  # heads split from tokens
    cos, sin = torch.randn(16, 32), torch.randn(16, 32)
    graph = capture(_Rope().eval(), (q, cos, sin))
    plan = OfflinePlanner().plan(graph)
    kinds = [(g.kind, sorted(n.op.removeprefix("aten::") for n in g.nodes)) for g in plan.groups if g.kind != "view"]
    # One elementwise group: the products, the sum and the rotation; no negation kernel, no ATen cat.
    assert kinds == [("pointwise", ["add.Tensor", "cat", "mul.Tensor", "mul.Tensor"])], kinds
    lowering = Lowering(graph, plan, {})
    program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    (code,) = [c for _, c in lowering.kernels]
    assert "rotated halves" in code.description
    assert [s["kind"] for s in program.steps] == ["kernel"]
    # A cat that is not a rotation of halves is read as a concatenation: its two pieces by range.
    other = capture(_Swap().eval(), (q,))
    plan = OfflinePlanner().plan(other)
    (group,) = [g for g in plan.groups if any(n.op == "aten::cat" for n in g.nodes)]
    assert group.kind == "pointwise"
    lowering = Lowering(other, plan, {})
    lowering.build(plan.groups, other.inputs, other.outputs)
    (code,) = [c for _, c in lowering.kernels]
    assert "rotated halves" not in code.description and "2 pieces read in place" in code.description


class _TransposedScores(nn.Module):
    def forward(self, q, k):
        return torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.125, dim=-1)


def test_group_checks_record_the_operand_a_gemm_reads_in_place_not_only_its_view():
    """q @ k^T over a batch reads k itself with a transpose flag: its group check is fed k, so the recording
    that streams the checks their values must hold k, not only the transposed view the graph traced (the
    check once failed with KeyError 'k' and left the product on ATen)."""
    from stitchcuda.graph.lower import group_inputs, stream_values
    from stitchcuda.graph.optimize import check_wants
    from stitchcuda.graph.planner import GENERATED

    q, k = torch.randn(2, 24, 16), torch.randn(2, 20, 16)
    graph, plan = planned(_TransposedScores(), (q, k))
    (gemm,) = [g for g in plan.groups if g.kind == "gemm"]
    assert "b transposed in place" in gemm.reason, gemm.reason
    assert graph.inputs[1].name in {v.name for v in group_inputs(gemm)}
    got: dict[int, set[str]] = {}
    stream_values(graph, [q, k], check_wants(graph, plan), lambda key, values: got.__setitem__(key, set(values)))
    for g in plan.groups:
        if g.kind in GENERATED:
            fed = {v.name for v in group_inputs(g) if v.kind != "weight"}
            assert fed <= got[id(g)], (g.kind, fed - got[id(g)])
