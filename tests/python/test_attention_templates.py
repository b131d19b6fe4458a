"""The fused attention kernels (graph/templates/attention.py): compiled by NVRTC for sm_90a in every dtype and
head dim, the fp32 kernels run on the CPU through the corpus's CUDA emulator against torch's math attention,
and on a GPU every dtype against SDPA."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, EmulatedModule, unavailable  # noqa: E402

from stitchcuda import jit  # noqa: E402
from stitchcuda.errors import InvalidArgumentError  # noqa: E402
from stitchcuda.graph.templates.attention import (HEAD_DIMS, PrefillTiles, _wmma_source,  # noqa: E402
                                                  decode_attention_kernels, decode_lane_candidates, decode_layout,
                                                  flash_attention_kernel, fma_tile_candidates, prefill_tiles,
                                                  wmma_tiles)

emulated = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference(q, k, v, *, causal=False, mask=None, scale=None):
    """softmax(scale q k^T + mask) v in fp64, written out (the math form), GQA by repeating kv heads."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


# ---- NVRTC, compile only -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_kernel_compiles_for_sm90a(dtype, head_dim):
    prefill = flash_attention_kernel("fa", batch=2, heads=8, kv_heads=2, q_len=300, kv_len=300, head_dim=head_dim,
                                     dtype=dtype, causal=True, mask_dtype=torch.bool, lse=True, tensor_cores=False)
    decode = decode_attention_kernels("dec", batch=4, heads=8, kv_heads=2, q_tokens=1, max_len=2048,
                                      head_dim=head_dim, dtype=dtype, lse=True)
    for code in (prefill, decode.partial, decode.combine):
        module = jit.compile_module(code.source, arch="sm_90a")
        assert module.kernel(code.name).name == code.name
    assert prefill.shared_mem == prefill_tiles(head_dim).shared_mem <= 227 * 1024


def _spills(code) -> str:
    """ptxas's report for a kernel (NVRTC's log with -v): its stack frame and spills."""
    log = jit.compile_module(code.source, arch="sm_90a", extra_flags=["--ptxas-options=-v"]).log
    return re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log).group(0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group, tokens, mask", [(1, 1, None), (4, 1, None), (8, 1, torch.bool), (4, 5, "add"),
                                                 (8, 16, None)], ids=["mha", "gqa4", "gqa8-mask", "gqa4-t5-add",
                                                                     "gqa8-t16"])
def test_every_decode_variant_compiles_without_spills(dtype, head_dim, group, tokens, mask):
    """Every head dim, dtype, GQA group (up to DECODE_MAX_ROWS query rows a block, in registers) and key form
    compiles for sm_90a with no stack frame and no spill: a spill would put the q rows or accumulators in
    local memory on every key."""
    pair = decode_attention_kernels("dec_v", batch=2, heads=8 * group, kv_heads=8, q_tokens=tokens, max_len=2048,
                                    head_dim=head_dim, dtype=dtype, mask_dtype=dtype if mask == "add" else mask)
    assert _spills(pair.partial) == "0 bytes stack frame, 0 bytes spill stores"
    assert jit.compile_module(pair.combine.source, arch="sm_90a").kernel(pair.combine.name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal, mask", [(False, None), (True, torch.bool), (False, "add")],
                         ids=["plain", "causal-bool", "additive"])
def test_fma_prefill_keeps_its_tiles_in_registers(dtype, head_dim, causal, mask):
    """The FMA prefill (fp32, and fp16/bf16 with tensor_cores=False) at every head dim: its TM x 4 scores and
    TM x D / 8 accumulators a thread stay in registers (no stack frame, no spill, which would put them in
    local memory inside the FMA loops), 256 threads, and its shared memory within the H100's 227 KB."""
    code = flash_attention_kernel("fa_regs", batch=2, heads=8, kv_heads=2, q_len=300, kv_len=300, head_dim=head_dim,
                                  dtype=dtype, causal=causal, mask_dtype=dtype if mask == "add" else mask, lse=True,
                                  tensor_cores=False)
    tiles = prefill_tiles(head_dim)
    assert _spills(code) == "0 bytes stack frame, 0 bytes spill stores"
    assert code.block == tiles.threads == 256 and code.grid == (math.ceil(300 / tiles.bm), 16)
    assert code.shared_mem == tiles.shared_mem <= 227 * 1024


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_fp32_tilings_the_bench_sweeps_fit_and_keep_their_tiles_in_registers(head_dim):
    """Each tiling bench.attention times beside the default (64 x 2 gives 256 threads at most 128 registers: two
    blocks an SM, twice the warps of 128 x 4 at D = 128) compiles without spills, its block and grid as its
    BM and TM say."""
    candidates = fma_tile_candidates(head_dim)
    assert candidates[0] == prefill_tiles(head_dim)
    assert [(t.bm, t.rows) for t in candidates] == [(128, 4), (64, 4), (64, 2), (32, 2)]
    for tiles in candidates[1:]:
        for mask in (None, torch.bool):
            code = flash_attention_kernel("fa_t", batch=1, heads=4, kv_heads=4, q_len=300, kv_len=300,
                                          head_dim=head_dim, dtype=torch.float32, causal=True, mask_dtype=mask,
                                          lse=True, fma_tiles=tiles)
            assert _spills(code) == "0 bytes stack frame, 0 bytes spill stores", (tiles, mask)
            assert code.block == tiles.threads == 8 * tiles.bm // tiles.rows
            assert code.grid == (math.ceil(300 / tiles.bm), 4) and code.shared_mem == tiles.shared_mem


def test_a_tiling_the_kernel_cannot_take_is_refused_with_the_fix():
    for tiles, why in ((PrefillTiles(64, 16, 64, 2), "BN must be 32"), (PrefillTiles(40, 32, 64, 4), "multiple of 4"),
                       (PrefillTiles(256, 32, 256, 2), "shared memory"), (PrefillTiles(64, 32, 128, 2), "head dim 128")):
        with pytest.raises(InvalidArgumentError, match=f"fma_tiles: .*{why}.*fma_tile_candidates"):
            flash_attention_kernel("x", batch=1, heads=1, kv_heads=1, q_len=8, kv_len=8, head_dim=64,
                                   dtype=torch.float32, fma_tiles=tiles)
    with pytest.raises(InvalidArgumentError, match="FMA kernel only"):
        flash_attention_kernel("x", batch=1, heads=1, kv_heads=1, q_len=8, kv_len=8, head_dim=64,
                               dtype=torch.bfloat16, fma_tiles=PrefillTiles(64, 32, 64, 2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_tensor_core_prefill_compiles_for_sm90a(dtype, head_dim):
    code = flash_attention_kernel("fa_tc", batch=2, heads=8, kv_heads=2, q_len=300, kv_len=300, head_dim=head_dim,
                                  dtype=dtype, causal=True, mask_dtype=torch.bool, lse=True, tensor_cores=True,
                                  mma=False)  # the WMMA kernel (test_flash_mma.py tests the mma.sync one)
    assert jit.compile_module(code.source, arch="sm_90a").kernel(code.name).name == code.name
    assert code.block == 128 and code.shared_mem == wmma_tiles(head_dim).shared_mem <= 227 * 1024


def test_additive_mask_kernels_compile_in_every_mask_dtype():
    for mask_dtype in DTYPES:
        code = flash_attention_kernel("fa_add", batch=1, heads=4, kv_heads=4, q_len=64, kv_len=64, head_dim=64,
                                      dtype=torch.bfloat16, mask_dtype=mask_dtype)
        assert jit.compile_module(code.source, arch="sm_90a").kernel(code.name).name == code.name


def test_unsupported_inputs_are_refused_with_the_fix():
    with pytest.raises(InvalidArgumentError, match="head dims"):
        flash_attention_kernel("x", batch=1, heads=1, kv_heads=1, q_len=8, kv_len=8, head_dim=40,
                               dtype=torch.float32)
    with pytest.raises(InvalidArgumentError, match="multiple of kv heads"):
        decode_attention_kernels("x", batch=1, heads=6, kv_heads=4, q_tokens=1, max_len=64, head_dim=64,
                                 dtype=torch.float32)
    with pytest.raises(InvalidArgumentError, match="true fp32"):
        flash_attention_kernel("x", batch=1, heads=1, kv_heads=1, q_len=8, kv_len=8, head_dim=64,
                               dtype=torch.float32, tensor_cores=True)
    with pytest.raises(InvalidArgumentError, match="cast the inputs"):
        flash_attention_kernel("x", batch=1, heads=1, kv_heads=1, q_len=8, kv_len=8, head_dim=64,
                               dtype=torch.float64)


# ---- the CPU emulator, fp32 ---------------------------------------------------------------------------

def _fp32_only(source: str) -> str:
    """The emulator has no fp16/bf16 types: drop their includes and overloads (fp32 kernels do not use them)."""
    return "\n".join(l for l in source.splitlines() if not re.search(r"__half|__nv_bfloat16|#include <cuda_", l))


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("attention"))


def _launch(emu, code, tensors, overrides=None):
    args = []
    for i, (kind, key) in enumerate(code.args):
        value = tensors[key] if kind in ("in", "out") else key
        args.append((overrides or {}).get(i, value))
    EmulatedModule(emu, _fp32_only(code.source)).kernel(code.name)(code.grid, code.block, *args,
                                                                  shared_mem=code.shared_mem)


def run_prefill(emu, q, k, v, *, causal=False, mask=None, lse=False):
    b, h, nq, d = q.shape
    code = flash_attention_kernel("fa_emu", batch=b, heads=h, kv_heads=k.shape[1], q_len=nq, kv_len=k.shape[2],
                                  head_dim=d, dtype=q.dtype, causal=causal,
                                  mask_dtype=None if mask is None else mask.dtype, lse=lse)
    o = torch.full_like(q, float("nan"))
    out_lse = torch.full((b, h, nq), float("nan"))
    overrides = {}
    if mask is not None:  # broadcast dimensions read with stride 0, as a caller passes them
        full = mask.expand(b, h, nq, k.shape[2])
        strides = [0 if mask.shape[i] == 1 and full.shape[i] != 1 else mask.stride(i) for i in range(4)]
        start = len(code.args) - 5  # the mask's four strides come before the scale
        overrides = {start + i: s for i, s in enumerate(strides)}
    _launch(emu, code, {"q": q, "k": k, "v": v, "mask": mask, "o": o, "lse": out_lse}, overrides)
    return o, out_lse


CASES = {
    "plain": dict(shape=(1, 2, 2, 37, 37, 64)),
    "causal": dict(shape=(1, 2, 2, 70, 70, 64), causal=True),
    "gqa-causal": dict(shape=(2, 4, 2, 33, 33, 64), causal=True),
    "mqa-cross": dict(shape=(1, 3, 1, 20, 45, 64)),
    "additive-mask": dict(shape=(1, 2, 2, 40, 40, 64), mask="additive"),
    "key-padding": dict(shape=(2, 2, 2, 24, 40, 64), mask="padding"),
    "head-dim-32": dict(shape=(2, 2, 1, 65, 65, 32), causal=True),
    "head-dim-96": dict(shape=(1, 1, 1, 17, 50, 96), causal=True),
    "head-dim-256": dict(shape=(1, 1, 1, 40, 40, 256)),
    # fp32 prefill tiles are 128 (64 above D = 128) query rows x 32 keys: ragged query and key counts, Nq < Nk
    "ragged-d128-causal": dict(shape=(1, 2, 1, 33, 70, 128), causal=True),
    "ragged-d32-additive": dict(shape=(2, 2, 2, 33, 70, 32), mask="additive"),
    "ragged-d256-gqa-padding": dict(shape=(2, 4, 2, 33, 70, 256), mask="padding"),
    "d160-causal": dict(shape=(1, 2, 2, 70, 70, 160), causal=True),
    # three query blocks (started last first under causal) over ten key tiles through both K/V buffers
    "three-blocks-d64-causal": dict(shape=(1, 1, 1, 300, 300, 64), causal=True),
    # no mask: tiles inside Nq x Nk skip the per-score tests (the first block's first three), the rest keep them
    "two-blocks-d64-cross": dict(shape=(1, 2, 2, 200, 100, 64)),
    # causal blocks are remapped across (batch, head) too: every head's last query block launches first
    "two-blocks-8-heads-gqa-causal": dict(shape=(2, 4, 2, 150, 150, 32), causal=True),
}


def _case(shape, causal=False, mask=None):
    b, h, hk, nq, nk, d = shape
    g = torch.Generator().manual_seed(nq * nk + d)
    q, k, v = (torch.randn(b, x, n, d, generator=g) for x, n in ((h, nq), (hk, nk), (hk, nk)))
    m = None
    if mask == "additive":  # [1, H, Nq, Nk], some keys pushed far down, one hard -inf
        m = torch.randn(1, h, nq, nk, generator=g) * 2
        m[..., 3] = float("-inf")
    elif mask == "padding":  # [B, 1, 1, Nk], True attends; sequence 0 keeps 29 keys, sequence 1 all
        m = torch.ones(b, 1, 1, nk, dtype=torch.bool)
        m[0, ..., 29:] = False
    return q, k, v, causal, m


@emulated
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_matches_math_attention(emu, case):
    q, k, v, causal, mask = _case(**CASES[case])
    o, lse = run_prefill(emu, q, k, v, causal=causal, mask=mask, lse=True)
    want, want_lse = reference(q, k, v, causal=causal, mask=mask)
    torch.testing.assert_close(o, want.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-4, rtol=1e-4)


@emulated
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_fp32_tiling_matches_math_attention(emu, head_dim):
    """The tilings the bench sweeps compute what the default does: ragged query and key counts over several
    query blocks (causal, remapped) and both K/V buffers, GQA."""
    q, k, v, causal, mask = _case((1, 4, 2, 150, 150, head_dim), causal=True)
    want, want_lse = reference(q, k, v, causal=True)
    for tiles in fma_tile_candidates(head_dim)[1:]:
        code = flash_attention_kernel("fa_tiles", batch=1, heads=4, kv_heads=2, q_len=150, kv_len=150,
                                      head_dim=head_dim, dtype=torch.float32, causal=True, lse=True, fma_tiles=tiles)
        o, lse = torch.full_like(q, float("nan")), torch.full((1, 4, 150), float("nan"))
        _launch(emu, code, {"q": q, "k": k, "v": v, "o": o, "lse": lse})
        torch.testing.assert_close(o, want.float(), atol=1e-4, rtol=1e-4, msg=lambda m: f"{tiles}: {m}")
        torch.testing.assert_close(lse, want_lse.float(), atol=1e-4, rtol=1e-4)


@emulated
@pytest.mark.parametrize("pad", [0, 1], ids=["aligned", "rows-padded-by-one"])
def test_prefill_reads_projection_layouts_in_place(emu, pad):
    """q, k, v and the output as [B, N, H, D] (a projection's layout) read and written through their strides.
    Rows padded by one float make the K and V token strides odd: the kernel then stages K and V with element
    loads instead of 16-byte asynchronous copies, with the same result."""
    g = torch.Generator().manual_seed(11 + pad)
    b, h, hk, nq, nk, d = 2, 4, 2, 45, 70, 64
    qs, ks, vs = (torch.randn(b, n, x, d + pad, generator=g) for x, n in ((h, nq), (hk, nk), (hk, nk)))
    q, k, v = (x[..., :d].transpose(1, 2) for x in (qs, ks, vs))
    code = flash_attention_kernel("fa_strided", batch=b, heads=h, kv_heads=hk, q_len=nq, kv_len=nk, head_dim=d,
                                  dtype=torch.float32, causal=True, lse=True)
    o, lse = torch.full((b, nq, h, d), float("nan")), torch.full((b, h, nq), float("nan"))
    first = [kind for kind, _ in code.args].index("i64") + 4  # after Nq, Nk, H, group: the strides
    strides = [x.stride(i) for x in (q, k, v, o.transpose(1, 2)) for i in range(3)]
    _launch(emu, code, {"q": qs, "k": ks, "v": vs, "o": o, "lse": lse},
            {first + i: stride for i, stride in enumerate(strides)})
    want, want_lse = reference(q, k, v, causal=True)
    assert (k.stride(2) % 4 != 0) == bool(pad)
    torch.testing.assert_close(o.transpose(1, 2), want.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-4, rtol=1e-4)


@emulated
def test_the_comparison_catches_a_planted_bug(emu):
    """The same check against a reference with the causal mask shifted by one key fails: the tolerance does
    not hide an off-by-one."""
    q, k, v, causal, mask = _case(**CASES["causal"])
    o, _ = run_prefill(emu, q, k, v, causal=True)
    s = (q @ k.transpose(-1, -2)) / 8
    wrong = torch.softmax(s.masked_fill(torch.ones(70, 70, dtype=torch.bool).triu(2), float("-inf")), -1) @ v
    with pytest.raises(AssertionError):
        torch.testing.assert_close(o, wrong, atol=1e-4, rtol=1e-4)


# WMMA on the CPU: a fragment is the whole 16 x 16 tile in every lane (loads, stores and products are warp-wide
# and synchronizing, as the *_sync calls are on the GPU), so the tensor-core kernel's indexing, tiling and
# online softmax run here with fp32 tiles (the GPU kernel takes fp16/bf16; the arithmetic is the same fp32
# accumulation of exact products).
WMMA_ON_CPU = r"""
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp->bar.arrive_and_wait(); }
namespace nvcuda { namespace wmma {
struct row_major {}; struct col_major {}; struct matrix_a {}; struct matrix_b {}; struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };
template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment { float x[16][16]; };
template <class F> void fill_fragment(F& f, float v) { for (auto& r : f.x) for (auto& e : r) e = v; }
template <class Use, class T, class L>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ld) {
  __syncwarp();
  for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j)
    f.x[i][j] = std::is_same<L, col_major>::value ? p[i + j * ld] : p[i * ld + j];
  __syncwarp();
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ld, layout_t) {
  __syncwarp();
  for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) f.x[i][j] = p[i * ld + j];
  __syncwarp();
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ld, layout_t) {
  __syncwarp();
  if (emu_lane == 0) for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) p[i * ld + j] = f.x[i][j];
  __syncwarp();
}
template <class A, class B>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const A& a, const B& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  fragment<accumulator, 16, 16, 16, float> r;
  for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) {
    float s = c.x[i][j];
    for (int k = 0; k < 16; ++k) s += a.x[i][k] * b.x[k][j];
    r.x[i][j] = s;
  }
  d = r;
}
}}
"""


def run_wmma_prefill(emu, q, k, v, *, causal=False, mask=None):
    b, h, nq, d = q.shape
    code = flash_attention_kernel("fa_tc_emu", batch=b, heads=h, kv_heads=k.shape[1], q_len=nq, kv_len=k.shape[2],
                                  head_dim=d, dtype=torch.float16, causal=causal,
                                  mask_dtype=None if mask is None else mask.dtype, lse=True, tensor_cores=True,
                                  mma=False)
    params = re.search(r"fa_tc_emu\((.*?)\) \{", code.source).group(1).replace("__half", "float").split(", ")
    from stitchcuda.graph.templates.attention import _score_lines
    source = _wmma_source("fa_tc_emu", params, wmma_tiles(d), "float", causal,
                          "  const bool* mb = mask + b * msb + h * msh;" if mask is not None else "", True,
                          _score_lines("Sw[r * SF + c]", causal, None if mask is None else mask.dtype))
    source = source.replace("#include <mma.h>", "#include <type_traits>\n" + WMMA_ON_CPU).replace(
        "extern __shared__ __align__(128) unsigned char smem_raw[];", "extern __shared__ float smem_raw[];")
    o, lse = torch.full_like(q, float("nan")), torch.full((b, h, nq), float("nan"))
    tensors = {"q": q, "k": k, "v": v, "mask": mask, "o": o, "lse": lse}
    args = [tensors[key] if kind in ("in", "out") else key for kind, key in code.args]
    kernel = EmulatedModule(emu, _fp32_only(source)).kernel("fa_tc_emu")
    kernel(code.grid, code.block, *args, shared_mem=wmma_tiles(d).shared_mem * 2)  # fp32 tiles: twice the bytes
    return o, lse


@emulated
@pytest.mark.parametrize("case", ["plain", "causal", "gqa-causal", "mqa-cross", "head-dim-32", "head-dim-256"])
def test_tensor_core_prefill_logic_matches_math_attention(emu, case):
    q, k, v, causal, mask = _case(**CASES[case])
    o, lse = run_wmma_prefill(emu, q, k, v, causal=causal)
    want, want_lse = reference(q, k, v, causal=causal)
    torch.testing.assert_close(o, want.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-4, rtol=1e-4)


def run_decode(emu, q, k_cache, v_cache, lengths, *, splits=None, lanes=None):
    b, h, t, d = q.shape
    kernels = decode_attention_kernels("dec_emu", batch=b, heads=h, kv_heads=k_cache.shape[1], q_tokens=t,
                                       max_len=k_cache.shape[2], head_dim=d, dtype=q.dtype, lse=True, splits=splits,
                                       lanes=lanes)
    tensors = {"q": q, "k": k_cache, "v": v_cache, "lengths": lengths.int(), "o": torch.full_like(q, float("nan")),
               "ws_ml": torch.full((kernels.workspace_ml,), float("nan")),
               "ws_acc": torch.full((kernels.workspace_acc,), float("nan")), "lse": torch.zeros(b, h, t)}
    _launch(emu, kernels.partial, tensors)
    _launch(emu, kernels.combine, tensors)
    return tensors["o"], tensors["lse"], kernels


def _check_lengths(o, lse, q, k, v, lengths):
    """Each sequence against the math form over its first `length` keys, its T new tokens (the last T of
    the cache) causal among themselves, bottom-right aligned."""
    tokens = q.shape[2]
    for i, n in enumerate(lengths.tolist()):
        causal_mask = torch.ones(tokens, n, dtype=torch.bool).tril(n - tokens)
        want, want_lse = reference(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], mask=causal_mask)
        torch.testing.assert_close(o[i:i + 1], want.float(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse[i:i + 1], want_lse.float(), atol=1e-4, rtol=1e-4)


@emulated
@pytest.mark.parametrize("tokens", [1, 3])
def test_decode_with_ragged_lengths_and_splits(emu, tokens):
    g = torch.Generator().manual_seed(tokens)
    b, h, hk, s_max, d = 3, 4, 2, 300, 64
    q = torch.randn(b, h, tokens, d, generator=g)
    k, v = torch.randn(b, hk, s_max, d, generator=g), torch.randn(b, hk, s_max, d, generator=g)
    lengths = torch.tensor([300, 5, 131])
    o, lse, kernels = run_decode(emu, q, k, v, lengths, splits=4)
    assert kernels.splits == 4 and kernels.chunk == 75  # the 5-key sequence leaves three splits empty
    _check_lengths(o, lse, q, k, v, lengths)


@emulated
def test_decode_head_dim_128_one_split(emu):
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(1, 2, 1, 128, generator=g), torch.randn(1, 1, 64, 128, generator=g), torch.randn(
        1, 1, 64, 128, generator=g)
    o, _, kernels = run_decode(emu, q, k, v, torch.tensor([64]))
    assert kernels.splits == 1
    torch.testing.assert_close(o, reference(q, k, v)[0].float(), atol=1e-4, rtol=1e-4)


@emulated
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_gqa_groups_head_dims_and_tokens(emu, group, head_dim, tokens):
    """A block serves the query rows of one KV head: 1, 4 or 8 heads x 1 or 5 tokens (8 x 5 = 40 rows: five
    blocks of 8; 4 x 5 = 20 rows: three of 7, the last with a row past the group), ragged lengths."""
    g = torch.Generator().manual_seed(group * 1000 + head_dim + tokens)
    hk, s_max = 2 if group < 8 else 1, 150
    q = torch.randn(2, group * hk, tokens, head_dim, generator=g)
    k, v = (torch.randn(2, hk, s_max, head_dim, generator=g) for _ in range(2))
    lengths = torch.tensor([150, 71])
    o, lse, kernels = run_decode(emu, q, k, v, lengths, splits=2)
    lay = kernels.layout
    assert lay.rows * lay.row_blocks >= group * tokens > lay.rows * (lay.row_blocks - 1) and lay.rows <= 8
    assert kernels.partial.grid == (2, hk * lay.row_blocks, 2)
    _check_lengths(o, lse, q, k, v, lengths)


@emulated
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_with_fewer_lanes_a_key_matches(emu, head_dim):
    """The bench's other lane count (half the default: a lane holds two vectors of a row, one shuffle step less a
    score) computes the same attention: GQA group 4, two tokens, ragged lengths over splits."""
    lanes = decode_lane_candidates(head_dim, torch.float32)
    assert lanes == {64: [16, 8], 128: [32, 16]}[head_dim]  # fp32: 4 elements a 16-byte vector
    g = torch.Generator().manual_seed(head_dim + 3)
    q = torch.randn(2, 8, 2, head_dim, generator=g)
    k, v = (torch.randn(2, 2, 150, head_dim, generator=g) for _ in range(2))
    lengths = torch.tensor([150, 71])
    o, lse, kernels = run_decode(emu, q, k, v, lengths, splits=2, lanes=lanes[1])
    assert kernels.layout.lanes == lanes[1] and kernels.layout.per == 2 * decode_layout(head_dim, torch.float32, 8).per
    _check_lengths(o, lse, q, k, v, lengths)


def test_the_lanes_a_key_are_a_power_of_two_within_the_row():
    assert decode_lane_candidates(128, torch.bfloat16) == [16, 8]
    pair = decode_attention_kernels("dec_l", batch=32, heads=32, kv_heads=8, q_tokens=1, max_len=2048, head_dim=128,
                                    dtype=torch.bfloat16, lanes=8)
    assert _spills(pair.partial) == "0 bytes stack frame, 0 bytes spill stores"  # the bench's shape, group 4
    for lanes in (0, 3, 32):
        with pytest.raises(InvalidArgumentError, match=f"power of two from 1 to 16 .* not {lanes}; take one of"):
            decode_layout(128, torch.bfloat16, 4, lanes)


@emulated
@pytest.mark.parametrize("head_dim", [96, 160])
def test_decode_head_dims_that_leave_lanes_idle(emu, head_dim):
    """Rows of 24 and 40 float4 vectors on 32 lanes: some lanes hold no vector of a row (96), or a second one
    only on the first 8 lanes (160)."""
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(2, 8, 3, head_dim, generator=g)
    k, v = (torch.randn(2, 2, 140, head_dim, generator=g) for _ in range(2))
    lengths = torch.tensor([140, 66])
    o, lse, kernels = run_decode(emu, q, k, v, lengths, splits=2)
    assert (kernels.layout.lanes, kernels.layout.per) == ((32, 1) if head_dim == 96 else (32, 2))
    _check_lengths(o, lse, q, k, v, lengths)


def test_decode_splits_fill_the_gpu_without_tiny_chunks():
    from stitchcuda.graph.templates.attention import decode_splits
    assert decode_splits(blocks=64, max_len=2048) == 5  # 64 blocks x 5 splits >= 2 blocks per SM of 132
    assert decode_splits(blocks=1024, max_len=2048) == 1
    assert decode_splits(blocks=1, max_len=100) == 2  # never below 64 keys a split


# The bench's decode shapes (32 query heads, 8 KV heads, D = 128, bf16, one token): batch, keys -> splits.
# A block serves a (split, KV head, batch): batch 1 is cut finest, capped by the 64-key minimum at 512 keys.
BENCH_SPLITS = {(1, 512): 8, (1, 2048): 32, (8, 512): 5, (8, 2048): 5, (32, 512): 2, (32, 2048): 2}


@pytest.mark.parametrize("batch, keys", list(BENCH_SPLITS))
def test_the_split_count_for_the_benchs_shapes(batch, keys):
    pair = decode_attention_kernels("dec", batch=batch, heads=32, kv_heads=8, q_tokens=1, max_len=keys,
                                    head_dim=128, dtype=torch.bfloat16)
    lay = pair.layout
    assert pair.splits == BENCH_SPLITS[batch, keys]
    assert pair.partial.grid == (pair.splits, 8, batch) and pair.partial.block == 128  # one block per KV head
    assert pair.chunk >= 64 and (pair.chunk * pair.splits >= keys > pair.chunk * (pair.splits - 1))
    blocks = batch * 8 * pair.splits
    assert blocks >= 2 * 132 or pair.chunk < 2 * 64  # twice the SMs unless the minimum chunk stops it
    # 16-byte loads of bf16 rows: 8 elements a lane, 16 lanes a 128-element row, two keys a load instruction,
    # four loads of K and four of V in flight a lane; the group's four query rows in one block
    assert (lay.vec, lay.lanes, lay.keys_per_load, lay.unroll, lay.rows, lay.row_blocks) == (8, 16, 2, 4, 4, 1)
    assert pair.workspace_acc == batch * 32 * pair.splits * 128


# ---- the GPU: every dtype against SDPA --------------------------------------------------------------------

def _gpu_prefill(q, k, v, causal, tensor_cores, padding=None):
    """The prefill kernel on the GPU; `padding`: a boolean key-padding mask [B, 1, 1, Nk] (strides (Nk, 0, 0, 1))."""
    b, h, n, d = q.shape
    code = flash_attention_kernel("fa_gpu", batch=b, heads=h, kv_heads=k.shape[1], q_len=n, kv_len=k.shape[2],
                                  head_dim=d, dtype=q.dtype, causal=causal, tensor_cores=tensor_cores,
                                  mask_dtype=None if padding is None else torch.bool)
    o = torch.empty_like(q)
    args = [{"q": q, "k": k, "v": v, "o": o, "mask": padding}[key] if kind in ("in", "out") else key
            for kind, key in code.args]
    if padding is not None:  # the mask's four strides come before the scale
        args[-5:-1] = [k.shape[2], 0, 0, 1]
    jit.compile(code.source, code.name)(code.grid, code.block, *args, shared_mem=code.shared_mem)
    return o


def gpu_decode(kernels, tensors: dict) -> torch.Tensor:
    """Runs a decode pair on the GPU over `tensors` (q, k, v, lengths or mask; the output and the workspace
    are added) and returns the output."""
    q = tensors["q"]
    tensors |= {"o": torch.empty_like(q), "ws_ml": torch.empty(kernels.workspace_ml, device=q.device),
                "ws_acc": torch.empty(kernels.workspace_acc, device=q.device)}
    for code in (kernels.partial, kernels.combine):
        args = [tensors[key] if kind in ("in", "out") else key for kind, key in code.args]
        jit.compile(code.source, code.name)(code.grid, code.block, *args, shared_mem=code.shared_mem)
    return tensors["o"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tensor_cores", [(torch.float32, False), (torch.float16, True), (torch.float16, False),
                                                 (torch.bfloat16, True), (torch.bfloat16, False)],
                         ids=["fp32", "fp16-wmma", "fp16-fma", "bf16-wmma", "bf16-fma"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_gpu_prefill_against_sdpa(dtype, tensor_cores, causal, head_dim):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    q = torch.randn(2, 8, 333, head_dim, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 333, head_dim, device="cuda", generator=g).to(dtype) for _ in range(2))
    want = reference(q, k, v, causal=causal)[0]
    ours = _gpu_prefill(q, k, v, causal, tensor_cores)
    if dtype == torch.float32:
        torch.testing.assert_close(ours.double(), want, atol=1e-4, rtol=1e-4)
        return
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    sdpa_err = (sdpa.double() - want).abs().max().item()
    our_err = (ours.double() - want).abs().max().item()
    assert our_err <= 2 * sdpa_err + 1e-3, (our_err, sdpa_err)  # the accuracy rule: SDPA's own error, a floor


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["plain", "causal", "key-padding"])
def test_gpu_fp32_prefill_at_a_kernelbench_size_matches_sdpa(form):
    """fp32 at a KernelBench-like size (batch 32, 16 heads, 512 tokens, D = 64: four query blocks of 128 rows,
    sixteen key tiles through both buffers, 16-byte asynchronous copies): within 1e-4 of SDPA (its
    memory-efficient backend at fp32) and of the fp64 math form."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(54)
    b, h, n, d = 32, 16, 512, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g) for _ in range(3))
    padding = None
    if form == "key-padding":  # every other sequence keeps its first 300 keys
        padding = torch.ones(b, 1, 1, n, dtype=torch.bool, device="cuda")
        padding[::2, ..., 300:] = False
    ours = _gpu_prefill(q, k, v, form == "causal", False, padding)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=padding, is_causal=form == "causal")
    torch.testing.assert_close(ours, sdpa, atol=1e-4, rtol=1e-4)
    want = reference(q, k, v, causal=form == "causal", mask=padding)[0]
    assert (ours.double() - want).abs().max().item() <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_decode_against_sdpa(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(1)
    b, h, hk, s_max, d = 8, 32, 8, 2048, 128
    q = torch.randn(b, h, 1, d, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(b, hk, s_max, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    lengths = torch.randint(1, s_max + 1, (b,), device="cuda", generator=g).int()
    kernels = decode_attention_kernels("dec_gpu", batch=b, heads=h, kv_heads=hk, q_tokens=1, max_len=s_max,
                                       head_dim=d, dtype=dtype)
    o = gpu_decode(kernels, {"q": q, "k": k, "v": v, "lengths": lengths})
    for i, n in enumerate(lengths.tolist()):
        want = reference(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n])[0]
        if dtype == torch.float32:
            torch.testing.assert_close(o[i:i + 1].double(), want, atol=1e-4, rtol=1e-4)
            continue
        sdpa = torch.nn.functional.scaled_dot_product_attention(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n],
                                                                enable_gqa=True)
        sdpa_err = (sdpa.double() - want).abs().max().item()
        assert (o[i:i + 1].double() - want).abs().max().item() <= 2 * sdpa_err + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group, tokens, head_dim, offset", [(1, 1, 64, 0), (8, 5, 256, 0), (4, 3, 80, 0),
                                                             (4, 1, 128, 1)],
                         ids=["mha-d64", "gqa8-t5-d256", "gqa4-t3-d80", "gqa4-unaligned"])
def test_gpu_decode_groups_tokens_and_alignment(dtype, group, tokens, head_dim, offset):
    """The block layouts on the GPU: one row block and eight (8 x 5 rows), a head dim whose rows leave lanes
    idle (80), and caches one element off a 16-byte boundary (element loads), against fp64."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(group * tokens + head_dim)
    b, hk, s_max = 3, 4, 700
    q = torch.randn(b, group * hk, tokens, head_dim, device="cuda", generator=g).to(dtype)
    size = b * hk * s_max * head_dim
    store = torch.randn(2, size + offset, device="cuda", generator=g).to(dtype)
    k, v = (x[offset:].view(b, hk, s_max, head_dim) for x in store)
    lengths = torch.tensor([700, 9, 333], dtype=torch.int32, device="cuda")
    kernels = decode_attention_kernels("dec_gpu_layout", batch=b, heads=group * hk, kv_heads=hk, q_tokens=tokens,
                                       max_len=s_max, head_dim=head_dim, dtype=dtype)
    o = gpu_decode(kernels, {"q": q, "k": k, "v": v, "lengths": lengths})
    for i, n in enumerate(lengths.tolist()):
        causal_mask = torch.ones(tokens, n, dtype=torch.bool, device="cuda").tril(n - tokens)
        want = reference(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], mask=causal_mask)[0]
        err = (o[i:i + 1].double() - want).abs().max().item()
        if dtype == torch.float32:
            assert err <= 1e-4, err
            continue
        # SDPA's rounding is the yardstick, on copies: given the cache one element off a 16-byte boundary, its
        # fp16/bf16 kernel faulted (misaligned address, torch 2.11 on an H100) after ours had run and matched.
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q[i:i + 1], k[i:i + 1, :, :n].contiguous(), v[i:i + 1, :, :n].contiguous(), attn_mask=causal_mask,
            enable_gqa=True)
        assert err <= 2 * (sdpa.double() - want).abs().max().item() + 1e-3


# ---- the benchmark -----------------------------------------------------------------------------------------

def test_the_benchmark_says_it_needs_a_gpu():
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    done = subprocess.run([sys.executable, "-m", "stitchcuda.bench.attention", "--json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 3 and "needs a CUDA GPU" in done.stderr and done.stdout == ""


def test_the_benchmark_ratios_are_baseline_over_ours():
    from stitchcuda.bench.attention import _ratios
    row = {"ours_ms": 2.0, "sdpa_flash_ms": 1.0, "sdpa_math_ms": None, "speed_of_light_ms": 0.5,
           "ours_queued_ms": 1.5, "sdpa_queued_ms": 0.9}
    _ratios(row)
    assert row["sdpa_flash_over_ours"] == 0.5 and "sdpa_math_over_ours" not in row
    assert not any(key.startswith(("ours_queued_over", "sdpa_queued_over")) for key in row)  # queued: like for like
    assert row["fraction_of_speed_of_light"] == 0.25


# ---- the benchmark's split sweep -------------------------------------------------------------------------

# The split counts the bench times for its decode shapes (BENCH_SPLITS' chosen ones; the static cache's 2,048
# slots at batch 1 and 8 are (1, 2048) and (8, 2048)): half, twice and four times the chosen one, capped at
# keys / 64 (DECODE_MIN_CHUNK) and at least 1.
BENCH_SPLIT_CANDIDATES = {(1, 512): [4, 8], (1, 2048): [16, 32], (8, 512): [2, 5, 8], (8, 2048): [2, 5, 10, 20],
                          (32, 512): [1, 2, 4, 8], (32, 2048): [1, 2, 4, 8]}


@pytest.mark.parametrize("batch, keys", list(BENCH_SPLIT_CANDIDATES))
def test_the_benchs_split_candidates_for_its_shapes(batch, keys):
    from functools import partial

    from stitchcuda.bench.attention import _split_kernels, split_candidates
    chosen = BENCH_SPLITS[batch, keys]
    assert split_candidates(chosen, keys) == BENCH_SPLIT_CANDIDATES[batch, keys]
    # the row builder's kernels: one pair per candidate, the chosen one reused, every split given keys (an
    # empty split would time blocks that do nothing) and none under the 64-key minimum
    make = partial(decode_attention_kernels, "dec", batch=batch, heads=32, kv_heads=8, q_tokens=1, max_len=keys,
                   head_dim=128, dtype=torch.bfloat16)
    pair = make()
    pairs = _split_kernels(make, pair, keys)
    assert list(pairs) == BENCH_SPLIT_CANDIDATES[batch, keys] and pairs[chosen] is pair
    for splits, other in pairs.items():
        assert other.splits == splits and other.partial.grid == (splits, 8, batch)
        assert other.chunk >= 64 and other.chunk * (splits - 1) < keys
        assert other.partial.source == pair.partial.source  # one compiled partial kernel: the same occupancy


def test_split_candidates_bounds_and_bad_input():
    from stitchcuda.bench.attention import split_candidates
    assert split_candidates(1, 64) == [1]  # one chunk's worth of keys: nothing else to try
    assert split_candidates(1, 4096) == [1, 2, 4]
    assert split_candidates(3, 100) == [1, 2, 3]  # 100 keys: at most 2 splits of >= 64, the chosen one kept
    with pytest.raises(InvalidArgumentError, match="must be >= 1"):
        split_candidates(0, 2048)


def test_the_split_record_picks_the_fastest_correct_count():
    from stitchcuda.bench.attention import split_record, split_tolerance
    tolerance = split_tolerance(4e-3)
    assert tolerance == pytest.approx(9e-3)
    times = {2: 0.145, 1: 0.2, 4: 0.1, 8: 0.09}
    errors = {1: 4e-3, 2: 4e-3, 4: 5e-3, 8: 0.25}  # 8 splits fastest but wrong: not the best
    record = split_record(2, times, errors, tolerance)
    assert list(record["ours_ms_at_splits"]) == [1, 2, 4, 8]
    assert record["wrong_splits"] == [8] and record["best_splits"] == 4
    assert record["best_over_chosen"] == 1.45 and record["best_splits_x"] == "4 (2x)"
    record = split_record(2, {1: 0.3, 2: 0.145}, {1: float("nan"), 2: 4e-3}, tolerance)
    assert record["wrong_splits"] == [1] and record["best_splits"] == 2 and record["best_over_chosen"] == 1.0
    assert record["best_splits_x"] == "2 (1x)"


def test_the_variant_record_picks_the_fastest_correct_variant():
    from stitchcuda.bench.attention import variant_record
    record = variant_record("fma_tiles", {"128x4": 1.16, "64x4": 1.0, "64x2": 0.9, "32x2": 0.8},
                            {"128x4": 3e-6, "64x4": 4e-6, "64x2": 5e-6, "32x2": 2e-3})  # 32 x 2 fastest but wrong
    assert record["best_fma_tiles"] == "64x2" and record["best_over_default_fma_tiles"] == pytest.approx(1.16 / 0.9)
    assert list(record["fma_tiles_ms"]) == ["128x4", "64x4", "64x2", "32x2"]
    record = variant_record("lanes", {"16": 1.0, "8": 0.5}, {"16": 3e-6, "8": float("nan")})
    assert record["best_lanes"] == "16" and record["best_over_default_lanes"] == 1.0


@pytest.mark.gpu
def test_gpu_the_benchs_split_sweep_times_and_checks_every_count():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from functools import partial

    from stitchcuda.bench.attention import _decode_error, _decode_pair, _split_kernels, _split_sweep
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    b, n = 8, 2048
    q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, 8, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    make = partial(decode_attention_kernels, "bench_sweep", batch=b, heads=32, kv_heads=8, q_tokens=1, max_len=n,
                   head_dim=128, dtype=torch.bfloat16, sms=sms)
    pair = make()
    t = {"q": q, "k": k, "v": v, "o": torch.empty_like(q), "lengths": torch.full((b,), n, dtype=torch.int32,
                                                                                 device="cuda")}
    _decode_pair(pair, t)
    chosen_error = _decode_error(t["o"], q, k, v)
    record = _split_sweep(_split_kernels(make, pair, n), pair.splits, t, lambda o: _decode_error(o, q, k, v),
                          chosen_error, sms)
    assert set(record["ours_ms_at_splits"]) == set(record["error_at_splits"]) == set(record["waves_at_splits"])
    assert all(ms > 0 for ms in record["ours_ms_at_splits"].values()) and record["wrong_splits"] == []
    assert record["best_splits"] in record["ours_ms_at_splits"] and record["best_over_chosen"] >= 1.0
    resident = record["resident_blocks_per_sm"]
    assert resident >= 1
    assert record["waves"] == round(pair.splits * 8 * b / (sms * resident), 2)
