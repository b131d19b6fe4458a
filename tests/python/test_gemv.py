"""The decode GEMV (STITCHCUDA_GEMV; templates/gemv.py, graph/projections.py): the kernel against torch in fp64 on
the CUDA emulator (fp32) and through NVRTC (every dtype), the planner merging a Llama decode step's q, k and v and
its gate, up and SiLU(gate) * up into one launch each, and a transformers Llama generating its own greedy tokens on
the emulator with it on, alone and with the other launch reductions. GPU tests (marked gpu): bf16 at real sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, EmulatedModule, unavailable  # noqa: E402
from test_cache_write import _launches, _transformers_llama, assert_transformers_greedy_tokens  # noqa: E402
from test_decode_capture import lowered  # noqa: E402
from test_graph_emulated import _fp32_only  # noqa: E402

from stitchcuda import TransformersStaticCacheLM, jit  # noqa: E402
from stitchcuda.errors import InvalidArgumentError  # noqa: E402
from stitchcuda.graph.capture import capture  # noqa: E402
from stitchcuda.graph.planner import OfflinePlanner  # noqa: E402
from stitchcuda.graph.templates.gemv import gemv_kernel  # noqa: E402
from stitchcuda.settings import override  # noqa: E402

emulated = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("gemv"))


def _case(rows, k, columns, epilogue="none", bias=None, residual=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    ws = [torch.randn(n, k, generator=g).div(k ** 0.5).to(dtype) for n in columns]
    bias = bias or [False] * len(columns)
    bs = [torch.randn(n, generator=g).to(dtype) if b else None for n, b in zip(columns, bias)]
    outputs = 1 if epilogue == "silu_mul" else len(columns)
    residual = residual or [False] * outputs
    out_cols = [columns[0]] if epilogue == "silu_mul" else columns
    rs = [torch.randn(rows, n, generator=g).to(dtype) if r else None for n, r in zip(out_cols, residual)]
    ys = [F.linear(x.double(), w.double(), None if b is None else b.double()) for w, b in zip(ws, bs)]
    if epilogue == "silu_mul":
        ys = [F.silu(ys[0]) * ys[1]]
    ys = [y + r.double() if r is not None else y for y, r in zip(ys, rs)]
    tensors = {"x": x, **{f"w{j}": w for j, w in enumerate(ws)}, **{f"b{j}": b for j, b in enumerate(bs) if b is not None},
               **{f"r{o}": r for o, r in enumerate(rs) if r is not None},
               **{f"y{o}": torch.full((rows, n), float("nan"), dtype=dtype) for o, n in enumerate(out_cols)}}
    code = gemv_kernel("gemv_t", rows=rows, k=k, columns=columns, dtype=dtype, bias=bias, epilogue=epilogue,
                       residual=residual)
    return code, tensors, ys


@emulated
@pytest.mark.parametrize("rows, k, columns, epilogue, bias, residual", [
    (1, 64, [64, 32, 32], "none", None, None),              # q, k, v of one token
    (3, 96, [40], "none", [True], [True]),                  # a bias and a residual, columns not a warp multiple
    (16, 1024, [33, 7], "none", [False, True], None),       # 16 rows x K past one staged tile (768 columns)
    (2, 100, [24, 24], "none", None, None),                 # K no multiple of 8: element loads
    (5, 128, [48, 48], "silu_mul", [True, True], [True]),   # gate, up, SiLU(gate) * up and a residual
], ids=["qkv", "bias-residual", "tiles", "unaligned-k", "silu-mul"])
def test_the_kernel_matches_torch_in_fp64(emu, rows, k, columns, epilogue, bias, residual):
    code, tensors, want = _case(rows, k, columns, epilogue, bias, residual)
    kernel = EmulatedModule(emu, _fp32_only(code.source)).kernel(code.name)
    kernel(code.grid, code.block, *[tensors[v] if kind in ("in", "out") else v for kind, v in code.args])
    for o, y in enumerate(want):
        torch.testing.assert_close(tensors[f"y{o}"].double(), y, atol=2e-5, rtol=2e-5)


@emulated
def test_the_comparison_catches_a_wrong_column(emu):
    code, tensors, want = _case(2, 64, [32, 32])
    kernel = EmulatedModule(emu, _fp32_only(code.source)).kernel(code.name)
    kernel(code.grid, code.block, *[tensors[v] if kind in ("in", "out") else v for kind, v in code.args])
    shifted = want[1].roll(1, dims=1)  # the second weight's columns off by one
    assert not torch.allclose(tensors["y1"].double(), shifted, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("epilogue", ["none", "silu_mul"])
def test_every_variant_compiles_with_nvrtc(dtype, epilogue):
    columns = [2048, 2048] if epilogue == "silu_mul" else [2048, 256, 256]
    code = gemv_kernel("gemv_c", rows=8, k=2048, columns=columns, dtype=dtype, epilogue=epilogue,
                       bias=[True] * len(columns))
    assert jit.compile(code.source, code.name, arch="sm_90") is not None


def test_bad_requests_name_the_fix():
    for kwargs, message in ((dict(rows=17), "1 to 16"), (dict(columns=[8, 8, 8, 8]), "1 to 3 weights"),
                            (dict(dtype=torch.float64), "fp32, fp16 or bf16"), (dict(epilogue="gelu"), "epilogue"),
                            (dict(columns=[8, 16], epilogue="silu_mul"), "equal rows")):
        args = dict(rows=1, k=64, columns=[8, 8], dtype=torch.float32) | kwargs
        with pytest.raises(InvalidArgumentError, match=message):
            gemv_kernel("g", **args)


STEP = (torch.zeros(1, 1, dtype=torch.long), torch.tensor([6]))


def test_the_planner_merges_a_decode_steps_projections_only_with_the_setting_on():
    lm = TransformersStaticCacheLM(_transformers_llama(torch.bfloat16), batch_size=1, max_length=24)
    with override(gemv=False):
        off = OfflinePlanner().plan(capture(lm, STEP))
        _, before, _ = lowered(lm, STEP)
    with override(gemv=True):
        on = OfflinePlanner().plan(capture(lm, STEP))
        _, after, _ = lowered(lm, STEP)
    assert not any(g.kind == "gemv" for g in off.groups)
    gemv = [g for g in on.groups if g.kind == "gemv"]
    assert [len(g.params["weights"]) for g in gemv] == [3, 2] * 2  # per layer: q, k, v; gate and up
    assert [g.params["epilogue"] for g in gemv] == ["none", "silu_mul"] * 2
    assert sum(g.kind == "gemm" for g in on.groups) == sum(g.kind == "gemm" for g in off.groups) - 5 * 2
    assert any(text.startswith("10 projections of decode's shape as 4 GEMV kernel(s), 2 with SiLU") for text, _ in
               on.decisions)
    # per layer 3 matmuls became one launch, 2 matmuls and the SiLU * up kernel another
    assert _launches(after) == _launches(before) - 4 * 2


def test_a_prefill_keeps_its_matmuls_but_where_one_row_is_left():
    """32 rows of x are a GEMM, cuBLASLt's; but capture moves the logits' last-position index above the last
    layer's MLP, which then runs on that one row: its gate, up and SiLU(gate) * up are the one GEMV."""
    lm = TransformersStaticCacheLM(_transformers_llama(torch.bfloat16), batch_size=1, max_length=40)
    with override(gemv=True):
        plan = OfflinePlanner().plan(capture(lm, (torch.zeros(1, 32, dtype=torch.long), torch.arange(32),
                                                  torch.tensor([31]))))
    gemv = [g for g in plan.groups if g.kind == "gemv"]
    assert [(g.params["rows"], g.params["epilogue"]) for g in gemv] == [(1, "silu_mul")]
    # the first layer's seven projections and the last's q, k and v on 32 rows; its o, down and the head on one
    assert sorted(g.params["a"].shape[0] for g in plan.groups if g.kind == "gemm") == [1] * 3 + [32] * 10


@emulated
@pytest.mark.parametrize("others", [False, True], ids=["gemv", "with-cache-write-and-merging"])
def test_a_transformers_llama_generates_its_greedy_tokens_with_the_gemv(emu, others):
    model = _transformers_llama()
    lm = TransformersStaticCacheLM(model, batch_size=1, max_length=24)
    with override(gemv=True, fuse_cache_write=others, merge_launches=others):
        graph, prefill, prefill_values = lowered(lm, (torch.zeros(1, 6, dtype=torch.long), torch.arange(6)))
        _, decode, decode_values = lowered(lm, STEP)
    with override(gemv=False, fuse_cache_write=False, merge_launches=False):
        _, plain, _ = lowered(lm, STEP)
    assert sum(k["name"].startswith(("gemv", "merged")) for k in decode.kernels) >= 2
    # 55 launches: the GEMV takes 4 a layer away (47); the cache writes 9 more (k's rotary and both writes one
    # launch a layer, the six int64 adds one: 38); merging 5 more (q's rotary beside the write, ...: 33)
    assert (_launches(plain), _launches(decode)) == (55, 33 if others else 47)
    assert_transformers_greedy_tokens(emu, model, lm, graph, (prefill, prefill_values), (decode, decode_values))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_kernel_matches_torch_on_a_gpu_at_llama_sizes(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for rows, columns, epilogue in ((1, [2048, 512, 512], "none"), (8, [8192, 8192], "silu_mul")):
        code, tensors, want = _case(rows, 2048, columns, epilogue, dtype=dtype, seed=rows)
        tensors = {name: t.cuda() for name, t in tensors.items()}
        kernel = jit.compile(code.source, code.name)
        kernel(code.grid, code.block, *[tensors[v] if kind in ("in", "out") else v for kind, v in code.args])
        torch.cuda.synchronize()
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        for o, y in enumerate(want):
            torch.testing.assert_close(tensors[f"y{o}"].double().cpu(), y, atol=tol, rtol=tol)


# ---- the bench (bench/gemv.py) --------------------------------------------------------------------------------

def test_the_benchs_floor_counts_every_weight_once_and_each_output():
    from stitchcuda.bench.gemv import floor_bytes, ratios
    assert floor_bytes(1, 2048, [2048, 512, 512], 3) == 2 * (3072 * 2048 + 2048 + 3072)
    assert floor_bytes(8, 2048, [8192, 8192], 1) == 2 * (16384 * 2048 + 8 * 2048 + 8 * 8192)  # one output: the product
    row = ratios({"bytes": 3_350_000, "ours_ms": 0.002, "linear_ms": 0.004, "concat_ms": 0.003}, 3.35)
    assert (row["linear_over_ours"], row["concat_over_ours"]) == (2.0, 1.5)
    assert (row["ours_of_floor"], row["linear_of_floor"]) == (0.5, 0.25)
    assert ratios({"bytes": 1, "ours_ms": 1.0, "linear_ms": 1.0, "concat_ms": 1.0}, 0.0)["ours_of_floor"] is None


def test_the_bench_without_a_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the bench would run")
    from stitchcuda.bench.gemv import main
    assert main([]) == 3 and "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_bench_times_every_case_and_checks_it(capsys):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import json

    from stitchcuda.bench.gemv import main
    assert main(["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 6 and all(r["max_abs_error_vs_fp64"] < 0.1 and r["ours_ms"] > 0 for r in rows)
