"""The mma.sync prefill kernel (graph/templates/flash_mma.py): every variant compiled by NVRTC for sm_90
(registers, spills, shared memory), the same kernel body run on the CPU emulator with its fragment layouts
emulated lane by lane (fp32 elements standing in for bf16) against fp64, and on a GPU against SDPA at bf16."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, EmulatedModule, unavailable  # noqa: E402
from test_attention_templates import _fp32_only, _spills, reference  # noqa: E402  (fp64 attention, ptxas's report)

from stitchcuda import jit  # noqa: E402
from stitchcuda.errors import InvalidArgumentError  # noqa: E402
from stitchcuda.graph.templates.attention import flash_attention_kernel  # noqa: E402
from stitchcuda.graph.templates.flash_mma import MMA_HEAD_DIMS, flash_mma_source, mma_tiles  # noqa: E402

emulated = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")
HALF = [torch.bfloat16, torch.float16]


# ---- which kernel flash_attention_kernel picks -----------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_the_mma_kernel_serves_head_dims_64_and_128(dtype, head_dim):
    code = flash_attention_kernel("fa", batch=2, heads=8, kv_heads=2, q_len=300, kv_len=300, head_dim=head_dim,
                                  dtype=dtype, causal=True)
    if head_dim in MMA_HEAD_DIMS:
        tiles = mma_tiles(head_dim)  # no mask
        assert "mma.sync tensor cores" in code.description and "mma.sync.aligned.m16n8k16" in code.source
        assert code.grid == (3, 16) and code.block == tiles.threads and code.shared_mem == tiles.shared_mem
        # 128 rows a block: 4 warps of two m16 tiles at D = 64, 8 of one at D = 128
        assert (tiles.bm, tiles.warps, tiles.m_tiles) == ((128, 4, 2) if head_dim == 64 else (128, 8, 1))
    else:
        assert "WMMA tensor cores" in code.description
    wmma = flash_attention_kernel("fa", batch=2, heads=8, kv_heads=2, q_len=300, kv_len=300, head_dim=head_dim,
                                  dtype=dtype, causal=True, mma=False)
    assert "WMMA tensor cores" in wmma.description and wmma.args == code.args  # the same launch arguments


def test_mma_true_where_it_does_not_apply_is_refused_with_the_fix():
    for dtype, head_dim, kw in ((torch.bfloat16, 96, {}), (torch.float32, 64, {}),
                                (torch.bfloat16, 64, dict(tensor_cores=False))):
        with pytest.raises(InvalidArgumentError, match="leave mma unset"):
            flash_attention_kernel("fa", batch=1, heads=2, kv_heads=2, q_len=64, kv_len=64, head_dim=head_dim,
                                   dtype=dtype, mma=True, **kw)
    assert "mma.sync" in flash_attention_kernel("fa", batch=1, heads=2, kv_heads=2, q_len=64, kv_len=64, head_dim=64,
                                                dtype=torch.float16, mma=True).description


# ---- NVRTC, compile only -------------------------------------------------------------------------------

VARIANTS = {"plain": dict(), "causal-lse": dict(causal=True, lse=True), "bool-mask": dict(mask_dtype=torch.bool),
            "additive-mask": dict(mask_dtype="same", lse=True),
            "causal-fp32-mask": dict(causal=True, mask_dtype=torch.float32)}


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("head_dim", MMA_HEAD_DIMS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_compiles_for_sm90_without_spills(dtype, head_dim, variant):
    """Every dtype, head dim and key form assembles for sm_90 with no stack frame and no spill (a spill puts
    the fragments or accumulators in local memory on every key tile), uses mma.sync, ldmatrix and cp.async,
    and fits shared memory (two blocks an SM for the 4-warp kernels, one for the 8-warp ones)."""
    kw = dict(VARIANTS[variant])
    if kw.get("mask_dtype") == "same":
        kw["mask_dtype"] = dtype
    code = flash_attention_kernel("fa_mma", batch=2, heads=8, kv_heads=2, q_len=300, kv_len=300, head_dim=head_dim,
                                  dtype=dtype, **kw)
    module = jit.compile_module(code.source, arch="sm_90")
    ptx = module.ptx
    kind = "bf16" if dtype == torch.bfloat16 else "f16"
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx and "cp.async.cg.shared.global" in ptx
    assert _spills(code) == "0 bytes stack frame, 0 bytes spill stores"
    tiles = mma_tiles(head_dim, kw.get("mask_dtype") is not None)
    assert code.block == tiles.threads and code.shared_mem * (2 if tiles.warps == 4 else 1) <= 227 * 1024


# ---- the CPU emulator: the same kernel, fragments exchanged lane by lane ----------------------------------

# What the emulated helpers need beyond the emulator's CUDA: __syncwarp (the warp's barrier).
EMULATION = ("#define EMULATE_MMA_ON_CPU\n"
             "inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp->bar.arrive_and_wait(); }\n")


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("flash_mma"))


def run_emulated(emu, q, k, v, *, causal=False, mask=None, out=None, scale=None):
    """The kernel over fp32 q, k, v (standing in for bf16: the element type is the only change), the mask's
    broadcast dims read with stride 0; returns the output and the log-sum-exp. q, k, v and `out` (the output
    to write, by default a new contiguous one) may be views at offset 0 of contiguous tensors: the kernel
    gets those tensors and the views' (batch, head, token) strides. `scale`: the kernel's, else 1 / sqrt(D)."""
    b, h, nq, d = q.shape
    mask_dtype = None if mask is None else mask.dtype
    code = flash_attention_kernel("fa_mma_emu", batch=b, heads=h, kv_heads=k.shape[1], q_len=nq, kv_len=k.shape[2],
                                  head_dim=d, dtype=torch.bfloat16, causal=causal, mask_dtype=mask_dtype, lse=True)
    params = re.search(r"fa_mma_emu\((.*?)\) \{", code.source).group(1).replace("__nv_bfloat16", "float")
    source = flash_mma_source("fa_mma_emu", params.split(", "), mma_tiles(d, mask is not None), "float", causal,
                              mask_dtype, True)
    o = torch.full_like(q, float("nan")) if out is None else out
    lse = torch.full((b, h, nq), float("nan"))
    views = {"q": q, "k": k, "v": v, "o": o}
    tensors = {key: x if x._base is None else x._base for key, x in views.items()} | {"mask": mask, "lse": lse}
    args = [tensors[key] if kind in ("in", "out") else key for kind, key in code.args]
    first = sum(kind in ("in", "out") for kind, _ in code.args) + 4  # Nq, Nk, H, group, then the strides
    args[first:first + 12] = [x.stride(i) for x in views.values() for i in range(3)]
    if mask is not None:  # the mask's four strides come before the scale
        full = mask.expand(b, h, nq, k.shape[2])
        strides = [0 if mask.shape[i] == 1 and full.shape[i] != 1 else mask.stride(i) for i in range(4)]
        args[-5:-1] = strides
    if scale is not None:
        args[-1] = scale
    kernel = EmulatedModule(emu, EMULATION + _fp32_only(source)).kernel("fa_mma_emu")
    kernel(code.grid, code.block, *args, shared_mem=2 * code.shared_mem)  # fp32 elements: twice the bytes
    return o, lse


CASES = {  # batch, heads, kv heads, queries, keys, head dim
    "d64-plain-33x70": dict(shape=(1, 2, 2, 33, 70, 64)),
    "d64-causal-130": dict(shape=(1, 1, 1, 130, 130, 64), causal=True),
    "d128-causal-gqa4-130": dict(shape=(1, 4, 1, 130, 130, 128), causal=True),
    "d128-plain-33x130": dict(shape=(2, 2, 1, 33, 130, 128)),
    "d64-additive-gqa4": dict(shape=(1, 4, 1, 33, 70, 64), mask="additive"),
    "d128-key-padding": dict(shape=(2, 1, 1, 33, 130, 128), mask="padding"),
    "d64-causal-bool-mask": dict(shape=(1, 2, 1, 70, 70, 64), causal=True, mask="bool"),
    # five key tiles through the 3 stages (8 warps), three query blocks started last first, warps past the
    # diagonal skipping tiles
    "d128-causal-300": dict(shape=(1, 1, 1, 300, 300, 128), causal=True),
    "d64-padding-300-keys": dict(shape=(2, 1, 1, 40, 300, 64), mask="padding"),
    # causal with Nq != Nk (top-left aligned, as SDPA's is_causal): fewer queries than keys, and more
    "d128-causal-33x130": dict(shape=(1, 2, 1, 33, 130, 128), causal=True),
    "d64-causal-130x70": dict(shape=(1, 1, 1, 130, 70, 64), causal=True),
}


def _case(shape, causal=False, mask=None):
    """Inputs rounded to bf16 (the fp32 the kernel sees holds bf16 values) and the mask."""
    b, h, hk, nq, nk, d = shape
    g = torch.Generator().manual_seed(nq * nk + d + h)
    q, k, v = (torch.randn(b, x, n, d, generator=g).bfloat16().float() for x, n in ((h, nq), (hk, nk), (hk, nk)))
    m = None
    if mask == "additive":  # [1, H, Nq, Nk], one key -inf for every row
        m = torch.randn(1, h, nq, nk, generator=g) * 2
        m[..., 5] = float("-inf")
    elif mask == "padding":  # [B, 1, 1, Nk]: sequence 0 keeps 97 keys (a tile and a half), sequence 1 all
        m = torch.ones(b, 1, 1, nk, dtype=torch.bool)
        m[0, ..., 97:] = False
    elif mask == "bool":  # [1, H, Nq, Nk], a random pattern on top of causal; row 3 keeps nothing (NaN)
        m = torch.rand(1, h, nq, nk, generator=g) > 0.3
        m[:, :, 3] = False
    return q, k, v, causal, m


@emulated
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_kernel_matches_fp64(emu, case):
    """fp32 products with fp32 accumulation over bf16-valued inputs: the fp64 reference at 1e-4. Shapes leave
    partial key tiles (70, 130 keys) and query blocks (33, 70, 130 rows); GQA 4:1; both head dims."""
    q, k, v, causal, mask = _case(**CASES[case])
    o, lse = run_emulated(emu, q, k, v, causal=causal, mask=mask)
    want, want_lse = reference(q, k, v, causal=causal, mask=mask)
    torch.testing.assert_close(o, want.float(), atol=1e-4, rtol=1e-4, equal_nan=True)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-4, rtol=1e-4)
    if case == "d64-causal-bool-mask":  # the row that keeps no key: NaN as softmax gives, lse -inf
        assert o[:, :, 3].isnan().all() and (lse[:, :, 3] == float("-inf")).all()
        assert not o[:, :, 4:].isnan().any()


@emulated
@pytest.mark.parametrize("head_dim", MMA_HEAD_DIMS)
def test_emulated_kernel_reads_and_writes_projection_layouts(emu, head_dim):
    """q, k, v as [B, N, H, D] (a projection's output) read through their strides, GQA 2:1, causal; the output
    written into [B, N, H, D + 1] rows (a token stride that rules out the 16-byte stores: element stores)."""
    g = torch.Generator().manual_seed(head_dim)
    b, h, hk, n = 2, 4, 2, 77
    q = torch.randn(b, n, h, head_dim, generator=g).bfloat16().float().transpose(1, 2)
    k, v = (torch.randn(b, n, hk, head_dim, generator=g).bfloat16().float().transpose(1, 2) for _ in range(2))
    out = torch.full((b, n, h, head_dim + 1), float("nan"))
    o, lse = run_emulated(emu, q, k, v, causal=True, out=out[..., :head_dim].transpose(1, 2))
    want, want_lse = reference(q, k, v, causal=True)
    torch.testing.assert_close(o, want.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-4, rtol=1e-4)
    assert out[..., head_dim].isnan().all()  # the pad column is never written


@emulated
@pytest.mark.parametrize("scale, case", [(-0.3, "d64-causal-130"), (0.0, "d64-causal-130"),
                                         (-0.3, "d64-additive-gqa4")], ids=["negative", "zero", "negative-masked"])
def test_emulated_kernel_takes_any_scale(emu, scale, case):
    """Without a user mask the kernel takes the max of the raw scores and folds the scale into exp2's FFMA,
    which needs a positive factor: a negative scale negates Q's fragments instead, and scale 0 (every kept
    key weighed alike) must not turn the masked keys' -inf into NaN."""
    q, k, v, causal, mask = _case(**CASES[case])
    o, lse = run_emulated(emu, q, k, v, causal=causal, mask=mask, scale=scale)
    want, want_lse = reference(q, k, v, causal=causal, mask=mask, scale=scale)
    torch.testing.assert_close(o, want.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-4, rtol=1e-4)


@emulated
def test_the_comparison_catches_a_swapped_fragment(emu):
    """The tolerance does not hide a layout slip: the same inputs with two keys of one 8-key tile swapped in
    V only (as a wrong ldmatrix.trans row order would read them) fail the check."""
    q, k, v, causal, mask = _case(**CASES["d64-plain-33x70"])
    o, _ = run_emulated(emu, q, k, v)
    v_wrong = v.clone()
    v_wrong[:, :, [2, 3]] = v[:, :, [3, 2]]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(o, reference(q, k, v_wrong)[0].float(), atol=1e-4, rtol=1e-4)


def test_causal_blocks_run_heaviest_first():
    """The causal kernel remaps the launch order: the block launched first is the last query block."""
    code = flash_attention_kernel("fa", batch=1, heads=2, kv_heads=2, q_len=512, kv_len=512, head_dim=64,
                                  dtype=torch.bfloat16, causal=True)
    assert "qblk = gridDim.x - 1 - lin / gridDim.y" in code.source
    plain = flash_attention_kernel("fa", batch=1, heads=2, kv_heads=2, q_len=512, kv_len=512, head_dim=64,
                                   dtype=torch.bfloat16)
    assert "qblk = blockIdx.x" in plain.source


# ---- the GPU: bf16 against SDPA ---------------------------------------------------------------------------

def _gpu_run(code, tensors):
    args = [tensors[key] if kind in ("in", "out") else key for kind, key in code.args]
    jit.compile(code.source, code.name)(code.grid, code.block, *args, shared_mem=code.shared_mem)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("head_dim", MMA_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [333, 2048])
def test_gpu_mma_prefill_against_sdpa(dtype, head_dim, causal, n):
    """GQA 4:1, a partial last tile (333) and a long causal sequence: within 2x SDPA's own error against fp64
    plus 1e-3 (the accuracy rule), the log-sum-exp at 1e-3."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(head_dim + n)
    q = torch.randn(2, 8, n, head_dim, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(2, 2, n, head_dim, device="cuda", generator=g).to(dtype) for _ in range(2))
    code = flash_attention_kernel("fa_mma_gpu", batch=2, heads=8, kv_heads=2, q_len=n, kv_len=n, head_dim=head_dim,
                                  dtype=dtype, causal=causal, lse=True)
    assert "mma.sync" in code.description
    o, lse = torch.empty_like(q), torch.empty(2, 8, n, device="cuda")
    _gpu_run(code, {"q": q, "k": k, "v": v, "o": o, "lse": lse})
    want, want_lse = reference(q, k, v, causal=causal)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    sdpa_err = (sdpa.double() - want).abs().max().item()
    assert (o.double() - want).abs().max().item() <= 2 * sdpa_err + 1e-3
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", MMA_HEAD_DIMS)
@pytest.mark.parametrize("mask", ["padding", "additive"])
def test_gpu_mma_prefill_masks_against_sdpa(head_dim, mask):
    """A key-padding mask (strides (Nk, 0, 0, 1)) and a per-head additive bf16 mask, against SDPA given the
    same mask."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    b, h, n = 2, 4, 200
    q, k, v = (torch.randn(b, h, n, head_dim, device="cuda", generator=g).bfloat16() for _ in range(3))
    if mask == "padding":
        m = torch.ones(b, 1, 1, n, dtype=torch.bool, device="cuda")
        m[0, ..., 150:] = False
        strides = [n, 0, 0, 1]
    else:
        m = (torch.randn(1, h, n, n, device="cuda", generator=g) * 2).bfloat16()
        strides = [0, n * n, n, 1]
    code = flash_attention_kernel("fa_mma_mask", batch=b, heads=h, kv_heads=h, q_len=n, kv_len=n, head_dim=head_dim,
                                  dtype=torch.bfloat16, mask_dtype=m.dtype)
    code.args[-5:-1] = [("i64", s) for s in strides]
    o = torch.empty_like(q)
    _gpu_run(code, {"q": q, "k": k, "v": v, "mask": m, "o": o})
    want = reference(q, k, v, mask=m)[0]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert (o.double() - want).abs().max().item() <= 2 * (sdpa.double() - want).abs().max().item() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", MMA_HEAD_DIMS)
def test_gpu_mma_prefill_reads_projection_layouts(head_dim):
    """q, k, v as [B, N, H, D] views (16-byte aligned token strides: the cp.async copies read them in place),
    GQA 4:1, causal, the output [B, H, N, D]: against SDPA on the same views."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(head_dim + 1)
    b, h, hk, n = 2, 8, 2, 517
    q = torch.randn(b, n, h, head_dim, device="cuda", generator=g).bfloat16().transpose(1, 2)
    k, v = (torch.randn(b, n, hk, head_dim, device="cuda", generator=g).bfloat16().transpose(1, 2) for _ in range(2))
    code = flash_attention_kernel("fa_mma_views", batch=b, heads=h, kv_heads=hk, q_len=n, kv_len=n,
                                  head_dim=head_dim, dtype=torch.bfloat16, causal=True)
    o = torch.empty(b, h, n, head_dim, device="cuda", dtype=torch.bfloat16)
    first = sum(kind in ("in", "out") for kind, _ in code.args) + 4
    code.args[first:first + 9] = [("i64", x.stride(i)) for x in (q, k, v) for i in range(3)]
    _gpu_run(code, {"q": q._base, "k": k._base, "v": v._base, "o": o})  # the launcher takes contiguous tensors
    want = reference(q, k, v, causal=True)[0]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (o.double() - want).abs().max().item() <= 2 * (sdpa.double() - want).abs().max().item() + 1e-3
