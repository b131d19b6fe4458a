"""The decode step's attention over a static KV cache: the split-KV decode kernels under a mask
(graph/templates/attention.py) read only the keys the mask keeps, and the planner lowers attention of decode's
shape (SDPA calls included) to them. On the CPU through the CUDA emulator: the masked kernels against torch
(boolean prefix and non-prefix masks, additive masks with -inf, batch-broadcast and per-batch masks, GQA,
several query tokens), which K and V elements they load, a cache holding NaN past the kept keys, and a
Llama-like model's decode program generating eager's greedy tokens; on a GPU, every dtype against SDPA.
"""

from __future__ import annotations

import ctypes
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, EmulatedModule, unavailable  # noqa: E402
from test_attention_templates import _fp32_only, _launch, gpu_decode  # noqa: E402  (a template's kernel)
from test_decode import (LlamaConfig, TinyLlama, assert_eagers_greedy_tokens, eager_greedy,  # noqa: E402
                         emulated_generator)  # the static-cache model and its emulated generator
from test_decode_capture import lowered  # noqa: E402  (capture, plan and lower)
from test_graph_emulated import run_program  # noqa: E402  (the program's steps on the CPU)

from stitchcuda import StaticCacheGenerator, TransformersStaticCacheLM, jit  # noqa: E402
from stitchcuda.errors import InvalidArgumentError  # noqa: E402
from stitchcuda.graph import OfflinePlanner, capture  # noqa: E402
from stitchcuda.graph.templates.attention import DECODE_MASK_TILE, decode_attention_kernels  # noqa: E402

emulated = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")


def reference(q, k, v, mask=None):
    """softmax(q k^T / sqrt(D) + mask) v in fp64, GQA by repeating kv heads; a boolean mask keeps True."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, -1) @ v


def mask_strides(mask, shape):
    """The mask's strides over [B, H, T, S], 0 where it is broadcast (as the lowering passes them)."""
    full = mask.expand(shape)
    return tuple(0 if mask.shape[i] == 1 and full.shape[i] != 1 else mask.stride(i) for i in range(4))


def masked_kernels(q, k, mask, splits=None, name="dec_mask"):
    b, h, t, d = q.shape
    strides = {"mask": mask_strides(mask, (b, h, t, k.shape[2]))} if mask is not None else None
    return decode_attention_kernels(name, batch=b, heads=h, kv_heads=k.shape[1], q_tokens=t, max_len=k.shape[2],
                                    head_dim=d, dtype=torch.float32, mask_dtype=None if mask is None else mask.dtype,
                                    lengths=False, splits=splits, strides=strides)


def run_masked(emu, q, k, v, mask, splits=None, source=None):
    """The masked decode pair on the emulator (NaN-filled output and workspace, so a slot nobody writes shows)."""
    kernels = masked_kernels(q, k, mask, splits)
    tensors = {"q": q, "k": k, "v": v, "mask": mask, "o": torch.full_like(q, float("nan")),
               "ws_ml": torch.full((kernels.workspace_ml,), float("nan")),
               "ws_acc": torch.full((kernels.workspace_acc,), float("nan"))}
    if source is None:
        _launch(emu, kernels.partial, tensors)
    else:  # an instrumented partial kernel (read_map)
        source(kernels.partial, tensors)
    _launch(emu, kernels.combine, tensors)
    return tensors["o"], kernels


def _cache(b=2, h=4, hk=2, t=1, s=300, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, t, d, generator=g), torch.randn(b, hk, s, d, generator=g),
            torch.randn(b, hk, s, d, generator=g))


def _masks(b, h, t, s):
    """Name -> mask: the static cache's prefix, a non-prefix pattern, additive ones with -inf, broadcast over
    batch and heads or given per batch, head and token."""
    g = torch.Generator().manual_seed(s)
    prefix = (torch.arange(s) <= 100)[None, None, None, :]                     # [1, 1, 1, S]: position 100
    pattern = torch.zeros(b, 1, 1, s, dtype=torch.bool)                        # [B, 1, 1, S], per sequence
    pattern[0, ..., 3:40] = True                                                # a run in the first split
    pattern[0, ..., 250:260] = True                                             # one in the last, none between
    pattern[1, ..., ::7] = True                                                 # every seventh key
    additive = torch.randn(1, h, t, s, generator=g) * 2                         # [1, H, T, S]
    additive[..., 80:230] = float("-inf")                                       # whole splits dropped
    additive[..., 5] = float("-inf")
    per_token = torch.rand(b, h, t, s, generator=g) < 0.3                       # [B, H, T, S]
    per_token[..., 0] = True  # every row keeps one key (a row with none is NaN, in SDPA too)
    return {"prefix": prefix, "pattern": pattern, "additive": additive, "per-token": per_token}


# ---- the kernels on the emulator, fp32 ----------------------------------------------------------------------

@emulated
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("kind", ["prefix", "pattern", "additive", "per-token"])
def test_masked_decode_matches_torch(emu, kind, tokens):
    q, k, v = _cache(t=tokens, seed=tokens)
    mask = _masks(2, 4, tokens, 300)[kind]
    o, kernels = run_masked(emu, q, k, v, mask, splits=4)
    assert kernels.splits == 4 and kernels.chunk == 75
    torch.testing.assert_close(o.double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5)
    if mask.dtype == torch.bool:  # SDPA itself, as the model calls it
        torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                                     v.repeat_interleave(2, 1), attn_mask=mask),
                                   atol=1e-5, rtol=1e-5)


@emulated
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("kind", ["pattern", "additive", "per-token"])
def test_masked_decode_per_gqa_group_and_tokens(emu, kind, group, tokens):
    """A block's query rows (the group's heads x the tokens, 8 x 5 in five blocks of 8) each under their own
    mask row: per head and token masks, additive ones, per-sequence patterns."""
    q, k, v = _cache(b=2, h=group, hk=1, t=tokens, s=300, seed=group + tokens)
    mask = _masks(2, group, tokens, 300)[kind]
    o, kernels = run_masked(emu, q, k, v, mask, splits=3)
    assert kernels.partial.grid == (3, kernels.layout.row_blocks, 2)
    torch.testing.assert_close(o.double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5)


@emulated
@pytest.mark.parametrize("head_dim", [128, 256])
def test_masked_decode_larger_head_dims_and_no_mask(emu, head_dim):
    q, k, v = _cache(b=1, h=2, hk=1, s=200, d=head_dim, seed=head_dim)
    mask = (torch.arange(200) < 150)[None, None, None, :]
    o, _ = run_masked(emu, q, k, v, mask)
    torch.testing.assert_close(o.double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5)
    o, kernels = run_masked(emu, q, k, v, None)  # no mask, no lengths: every key of the cache
    assert "(all)" in kernels.partial.description
    torch.testing.assert_close(o.double(), reference(q, k, v), atol=1e-5, rtol=1e-5)


@emulated
def test_bf16_inputs_by_the_accuracy_rule(emu):
    """The emulator has no 16-bit types: the bf16 kernel differs from the fp32 one in its loads (bf16 to fp32)
    and its store (rounded to bf16), mirrored here around the fp32 kernel; its error against fp64 stays within
    twice SDPA's own at bf16 plus 1e-3, the rule the GPU tests use."""
    q, k, v = (x.bfloat16() for x in _cache(seed=5))
    for kind, mask in _masks(2, 4, 1, 300).items():
        mask = mask if mask.dtype == torch.bool else mask.bfloat16()
        o, _ = run_masked(emu, q.float(), k.float(), v.float(), mask if mask.dtype == torch.bool else mask.float())
        want = reference(q, k, v, mask)
        sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=mask)
        sdpa_err = (sdpa.double() - want).abs().max().item()
        ours_err = (o.bfloat16().double() - want).abs().max().item()
        assert ours_err <= 2 * sdpa_err + 1e-3, (kind, ours_err, sdpa_err)


# The partial kernel with its K and V loads counted: `kv_load(kb, i, vec)` and `kv_load(vb, i, vec)` also add one
# to each element they read in a count map per cache (set by emu_watch before the launch), and count the loads
# made 16 bytes at once (vec) and element by element.
READ_COUNT = r"""
static const float* emu_k0; static const float* emu_v0;
static int* emu_kcount; static int* emu_vcount; static long long* emu_loads;
extern "C" void emu_watch(const float* k, const float* v, int* kc, int* vc, long long* loads) {
  emu_k0 = k; emu_v0 = v; emu_kcount = kc; emu_vcount = vc; emu_loads = loads;
}
inline void emu_count(int* map, long long at, bool vec) {
  for (int e = 0; e < 4; ++e) __atomic_fetch_add(&map[at + e], 1, __ATOMIC_RELAXED);
  __atomic_fetch_add(&emu_loads[vec ? 0 : 1], 1, __ATOMIC_RELAXED);
}
inline kvraw kv_load_k(const float* p, long long i, bool vec) {
  emu_count(emu_kcount, (p + i) - emu_k0, vec);
  return kv_load(p, i, vec);
}
inline kvraw kv_load_v(const float* p, long long i, bool vec) {
  emu_count(emu_vcount, (p + i) - emu_v0, vec);
  return kv_load(p, i, vec);
}
"""


def read_count(emu, seen):
    """Runs a partial kernel with its loads counted: seen["k"], seen["v"] (int32, the caches' shapes: how many
    times each element was loaded) and seen["loads"] (16-byte loads, element-by-element loads)."""
    def run(code, tensors):
        source = _fp32_only(code.source).replace("kv_load(kb, ", "kv_load_k(kb, ")
        source = source.replace("kv_load(vb, ", "kv_load_v(vb, ")
        assert source.count("kv_load_k(kb, ") == source.count("kv_load_v(vb, ") == 1  # the kernel's one K and V load
        source = source.replace('extern "C" __global__', READ_COUNT + 'extern "C" __global__', 1)
        module = EmulatedModule(emu, source)
        k, v = tensors["k"], tensors["v"]
        seen["k"], seen["v"] = (torch.zeros(x.shape, dtype=torch.int32) for x in (k, v))
        seen["loads"] = torch.zeros(2, dtype=torch.int64)
        module._library.emu_watch(*(ctypes.c_void_p(x.data_ptr()) for x in (k, v, seen["k"], seen["v"], seen["loads"])))
        args = [tensors[key] if kind in ("in", "out") else key for kind, key in code.args]
        module.kernel(code.name)(code.grid, code.block, *args, shared_mem=code.shared_mem)
    return run


def _kept_rows(keep, kv_heads):
    """[B, H_kv, S]: the keys some query head (and token) reading each KV head keeps, from keep [B, H, T, S]."""
    b, h, t, s = keep.shape
    return keep.reshape(b, kv_heads, h // kv_heads, t, s).any(3).any(2)


@emulated
@pytest.mark.parametrize("kind", ["prefix", "pattern", "additive"])
def test_the_kernel_loads_only_the_keys_the_mask_keeps(emu, kind):
    q, k, v = _cache(seed=11)
    mask = _masks(2, 4, 1, 300)[kind]
    seen = {}
    o, _ = run_masked(emu, q, k, v, mask, splits=4, source=read_count(emu, seen))
    torch.testing.assert_close(o.double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5)
    keep = (mask if mask.dtype == torch.bool else mask != float("-inf")).expand(2, 4, 1, 300)
    # a kv head's key is kept where any query head reading it keeps it; every element of its row is read once
    kept = _kept_rows(keep, 2)
    for cache in "kv":
        assert torch.equal(seen[cache], kept[..., None].int().expand_as(seen[cache])), cache
    assert int(kept.sum()) < kept.numel() // 2  # most of the cache is never read
    assert seen["loads"][1] == 0  # aligned fp32 rows: every load 16 bytes


@emulated
@pytest.mark.parametrize("form", ["lengths", "mask"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_each_kept_row_is_loaded_once_per_kv_head_not_per_query_head(emu, group, form):
    """GQA: the `group` query heads sharing a KV head are served by one block, so each kept K and V row is
    read from memory once per KV head (the old kernel, one block per query head, read it `group` times)."""
    hk, s_max = 2, 200
    q, k, v = _cache(b=2, h=group * hk, hk=hk, s=s_max, seed=group)
    seen = {}
    if form == "mask":
        mask = (torch.arange(s_max) <= 120)[None, None, None, :]
        o, kernels = run_masked(emu, q, k, v, mask, splits=3, source=read_count(emu, seen))
        keep = mask.expand(2, group * hk, 1, s_max)
        torch.testing.assert_close(o.double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5)
    else:
        lengths = torch.tensor([200, 77], dtype=torch.int32)
        kernels = decode_attention_kernels("dec_len", batch=2, heads=group * hk, kv_heads=hk, q_tokens=1,
                                           max_len=s_max, head_dim=64, dtype=torch.float32, splits=3)
        tensors = {"q": q, "k": k, "v": v, "lengths": lengths, "o": torch.full_like(q, float("nan")),
                   "ws_ml": torch.empty(kernels.workspace_ml), "ws_acc": torch.empty(kernels.workspace_acc)}
        read_count(emu, seen)(kernels.partial, tensors)
        _launch(emu, kernels.combine, tensors)
        keep = (torch.arange(s_max) < lengths[:, None].long())[:, None, None, :].expand(2, group * hk, 1, s_max)
        torch.testing.assert_close(tensors["o"].double(), reference(q, k, v, keep), atol=1e-5, rtol=1e-5)
    assert kernels.layout.row_blocks == 1 and kernels.partial.grid[1] == hk
    kept = _kept_rows(keep, hk)
    for cache in "kv":
        assert torch.equal(seen[cache], kept[..., None].int().expand_as(seen[cache])), cache
    # 16-byte loads: one per 4 floats of each kept row
    assert seen["loads"].tolist() == [2 * int(kept.sum()) * 64 // 4, 0]


@emulated
def test_unaligned_caches_are_read_element_by_element(emu):
    """K and V one element past a 16-byte boundary (views into a larger buffer) with a token stride of D + 1:
    the kernel takes element loads instead of 16-byte ones (counted), and the same attention."""
    g = torch.Generator().manual_seed(9)
    b, h, hk, s_max, d = 2, 4, 2, 130, 64
    q = torch.randn(b, h, 1, d, generator=g)
    store = torch.randn(2, b * hk * s_max * (d + 1) + 1, generator=g)
    k, v = (x[1:].view(b, hk, s_max, d + 1)[..., :d] for x in store)  # what the kernel reads
    kernels = decode_attention_kernels("dec_unaligned", batch=b, heads=h, kv_heads=hk, q_tokens=1, max_len=s_max,
                                       head_dim=d, dtype=torch.float32, splits=2,
                                       strides={"k": k.stride()[:3], "v": v.stride()[:3]})
    lengths = torch.tensor([130, 67], dtype=torch.int32)
    tensors = {"q": q, "k": store[0, 1:], "v": store[1, 1:], "lengths": lengths,
               "o": torch.full_like(q, float("nan")), "ws_ml": torch.empty(kernels.workspace_ml),
               "ws_acc": torch.empty(kernels.workspace_acc)}
    seen = {}
    read_count(emu, seen)(kernels.partial, tensors)
    _launch(emu, kernels.combine, tensors)
    keep = (torch.arange(s_max) < lengths[:, None].long())[:, None, None, :]
    torch.testing.assert_close(tensors["o"].double(), reference(q, k, v, keep), atol=1e-5, rtol=1e-5)
    assert seen["loads"][0] == 0 and seen["loads"][1] == 2 * int(lengths.sum()) * hk * d // 4


@emulated
def test_a_cache_holding_nan_past_the_kept_keys(emu):
    """Eager SDPA over the whole cache multiplies the NaN of a dropped key by its zero probability and returns
    NaN; the kernel never reads those keys and returns the attention over the kept ones."""
    q, k, v = _cache(seed=3)
    position = 100
    mask = (torch.arange(300) <= position)[None, None, None, :]
    k[:, :, position + 1:], v[:, :, position + 1:] = float("nan"), float("nan")
    eager = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    assert eager.isnan().all()
    o, _ = run_masked(emu, q, k, v, mask, splits=4)
    keep = slice(0, position + 1)
    torch.testing.assert_close(o.double(), reference(q, k[:, :, keep], v[:, :, keep]), atol=1e-5, rtol=1e-5)


@emulated
def test_the_lengths_form_and_a_mask_apply_together(emu):
    q, k, v = _cache(seed=4)
    mask = _masks(2, 4, 1, 300)["pattern"]
    kernels = decode_attention_kernels("dec_both", batch=2, heads=4, kv_heads=2, q_tokens=1, max_len=300,
                                       head_dim=64, dtype=torch.float32, mask_dtype=torch.bool, lengths=True,
                                       splits=3, strides={"mask": mask_strides(mask, (2, 4, 1, 300))})
    tensors = {"q": q, "k": k, "v": v, "mask": mask, "lengths": torch.tensor([255, 300], dtype=torch.int32),
               "o": torch.full_like(q, float("nan")), "ws_ml": torch.empty(kernels.workspace_ml),
               "ws_acc": torch.empty(kernels.workspace_acc)}
    _launch(emu, kernels.partial, tensors)
    _launch(emu, kernels.combine, tensors)
    both = mask & (torch.arange(300) < torch.tensor([255, 300])[:, None])[:, None, None, :]
    torch.testing.assert_close(tensors["o"].double(), reference(q, k, v, both), atol=1e-5, rtol=1e-5)


def test_masked_kernels_compile_for_sm90a_in_every_dtype():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for mask_dtype in (torch.bool, dtype):
            for d in (64, 256):
                pair = decode_attention_kernels("dec_mask", batch=8, heads=32, kv_heads=8, q_tokens=1, max_len=2048,
                                                head_dim=d, dtype=dtype, mask_dtype=mask_dtype)
                for code in (pair.partial, pair.combine):
                    assert jit.compile_module(code.source, arch="sm_90a").kernel(code.name).name == code.name


def test_bad_decode_requests_name_the_fix():
    with pytest.raises(InvalidArgumentError, match="1 to 16 query tokens.*prefill kernel or SDPA"):
        decode_attention_kernels("x", batch=1, heads=2, kv_heads=1, q_tokens=17, max_len=256, head_dim=64,
                                 dtype=torch.float32)
    with pytest.raises(InvalidArgumentError, match="boolean or fp32/fp16/bf16"):
        decode_attention_kernels("x", batch=1, heads=2, kv_heads=1, q_tokens=1, max_len=256, head_dim=64,
                                 dtype=torch.float32, mask_dtype=torch.int32)
    assert DECODE_MASK_TILE == 128  # one mask entry per thread of the 128-thread block


# ---- the planner and the decode program -----------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _decode_kernels_chosen(stitch_settings):
    """auto is the default; set here so that a STITCHCUDA_ATTENTION in the environment changes no test."""
    stitch_settings(attention="auto")


def test_by_default_the_static_cache_decode_step_takes_the_kernels_and_sdpa_keeps_aten(stitch_settings):
    stitch_settings(STITCHCUDA_ATTENTION=None)  # as if unset
    assert OfflinePlanner().attention == "auto"
    _, groups = _attention_groups(llama(), None, 1)
    assert [g.params["impl"] for g in groups] == ["decode", "decode"]
    stitch_settings(STITCHCUDA_ATTENTION="sdpa")
    _, groups = _attention_groups(llama(), None, 1)
    assert groups == []  # the SDPA calls stay the ATen steps the capture keeps whole


class OneTokenOverFilledKeys(torch.nn.Module):
    """Decode's shape over exactly the filled keys (a cache grown by concatenation): no mask says which count."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def test_auto_leaves_decode_over_exactly_the_filled_keys_to_sdpa_and_fused_takes_it():
    """On an H100 the kernels trailed SDPA there (0.63-0.84x) while leading it 2.1-4.9x over a masked static cache."""
    inputs = (torch.randn(2, 8, 1, 64), torch.randn(2, 2, 512, 64), torch.randn(2, 2, 512, 64))
    for attention, impls in (("auto", []), ("fused", ["decode"])):
        plan = OfflinePlanner(attention=attention).plan(capture(OneTokenOverFilledKeys(), inputs))
        assert [g.params["impl"] for g in plan.groups if g.kind == "attention"] == impls, attention


def llama(max_len=160, seed=0):
    torch.manual_seed(seed)
    return TinyLlama(LlamaConfig(dim=128, max_len=max_len)).eval()  # head dim 32, GQA 4 / 2


def _attention_groups(model, attention, tokens):
    inputs = (torch.zeros(2, tokens, dtype=torch.long), torch.arange(tokens))
    plan = OfflinePlanner(attention=attention).plan(capture(model, inputs))
    return plan, [g for g in plan.groups if g.kind == "attention"]


def test_the_decode_step_is_planned_as_the_decode_kernels_and_sdpa_forces_aten():
    model = llama()
    plan, groups = _attention_groups(model, "auto", 1)
    assert [g.params["impl"] for g in groups] == ["decode", "decode"]
    assert "split-KV decode kernels" in groups[0].reason and "an SDPA call" in groups[0].reason
    assert any("as the split-KV decode kernels" in text and "only those the mask keeps" in why
               for text, why in plan.decisions)
    # the GQA repeat of the cache (a copy of it per step) goes with the SDPA call
    assert not any("repeat" in n.op or n.op == "aten::clone" for g in plan.groups for n in g.nodes
                   if g.kind != "attention")
    _, forced = _attention_groups(model, "sdpa", 1)
    assert forced == []  # the SDPA calls stay the ATen steps the capture keeps whole
    _, prefill = _attention_groups(model, "auto", 24)  # 24 query tokens: a prefill, left to SDPA
    assert prefill == []
    _, short = _attention_groups(model, "auto", 6)  # a 6-token prompt: decode's shape, a mask row per token
    assert [g.params["impl"] for g in short] == ["decode", "decode"]


def test_short_caches_and_small_head_dims_stay_sdpa():
    _, groups = _attention_groups(llama(max_len=32), "auto", 1)  # fewer keys than one split
    assert groups == []
    from stitchcuda.graph.attention import decode_blocker, find_attention
    model = TinyLlama(LlamaConfig(max_len=160)).eval()  # head dim 8
    (a, _) = find_attention(capture(model, (torch.zeros(2, 1, dtype=torch.long), torch.tensor([3]))))
    assert "head dims 8 / 8" in decode_blocker(a)


def test_optimize_plans_and_compiles_the_decode_kernels_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU test runs the optimized generator")
    model = llama()
    gen = StaticCacheGenerator.optimize(model, batch_size=2, prompt_length=20, max_length=160, measure=False)
    decode = [text for text, _ in gen.decode_module.report.decisions if "split-KV" in text]
    prefill = [text for text, _ in gen.prefill_module.report.decisions if "split-KV" in text]
    assert len(decode) == 2 and prefill == []  # one per layer; the 20-token prefill stays SDPA
    assert "compiled only" in gen.decode_module.report.reason  # NVRTC built the kernels; no GPU runs them
    ids = torch.randint(0, 96, (2, 20))
    with torch.no_grad():  # here the model itself runs
        assert torch.equal(gen.generate(ids, 4), eager_greedy(llama(), ids, 4))


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("decode_attention"))


@emulated
def test_the_decode_program_runs_the_kernels_and_gives_eagers_greedy_tokens(emu):
    model, twin = llama(), llama()
    prompt, new = 5, 6
    _, prefill, prefill_values = lowered(model, (torch.zeros(2, prompt, dtype=torch.long), torch.arange(prompt)))
    _, decode, decode_values = lowered(model, (torch.zeros(2, 1, dtype=torch.long), torch.tensor([prompt])))
    names = [decode.kernels[s["kernel"]]["name"] for s in decode.steps if s["kind"] == "kernel"]
    assert sum(n.startswith("decode_attention_partial") for n in names) == 2  # one per layer
    assert not any(s["kind"] == "aten" and "scaled_dot_product" in s["op"] for s in decode.steps)
    assert not any(s["kind"] == "aten" and "repeat" in s["op"] for s in decode.steps)
    gen = emulated_generator(emu, model, 160, 2, (prefill, prefill_values), (decode, decode_values),
                             dict(model.named_buffers()))
    assert_eagers_greedy_tokens(gen, model, twin, prompt, new)


@emulated
def test_the_decode_program_never_reads_cache_slots_past_the_position(emu):
    """Slots past the position hold NaN (as an uninitialized cache might): the model's eager SDPA over the whole
    cache returns NaN logits, the decode program, whose attention reads only the kept slots, the clean logits."""
    model, clean = llama(), llama()
    _, decode, values = lowered(model, (torch.zeros(2, 1, dtype=torch.long), torch.tensor([7])))
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        for m in (model, clean):
            m(ids, torch.arange(7))  # the prompt's keys and values at positions 0..6
        for cache in model.caches():
            cache[:, :, 8:] = float("nan")  # the step writes position 7; 8.. are never kept
        token, position = torch.randint(0, 96, (2, 1)), torch.tensor([7])
        want = clean(token, position)
        assert model(token, position).isnan().all()  # eager reads them (and writes position 7, as the program will)
    states = dict(model.named_buffers())
    got = run_program(emu, decode, [token, position.clone()], values, states)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@emulated
def test_a_transformers_llamas_decode_program_runs_the_kernels_and_gives_its_greedy_tokens(emu):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()  # head dim 32
    lm = TransformersStaticCacheLM(model, batch_size=1, max_length=96)
    graph, prefill, prefill_values = lowered(lm, (torch.zeros(1, 20, dtype=torch.long), torch.arange(20)))
    _, decode, decode_values = lowered(lm, (torch.zeros(1, 1, dtype=torch.long), torch.tensor([20])))
    names = [decode.kernels[s["kernel"]]["name"] for s in decode.steps if s["kind"] == "kernel"]
    assert sum(n.startswith("decode_attention_partial") for n in names) == 2  # transformers' SDPA calls
    prefix = next(iter(graph.state_buffers.values())).rpartition("layer")[0]
    gen = emulated_generator(emu, lm, 96, 1, (prefill, prefill_values), (decode, decode_values),
                             {prefix + name: t for name, t in lm.named_buffers()})
    ids = torch.randint(0, 256, (1, 20))
    got = gen.generate(ids, 6)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                                  do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


@emulated
@pytest.mark.parametrize("name", ["additive", "padding-drop", "repeat-gqa"])
def test_written_out_attention_of_decode_shape_runs_the_kernels(emu, name):
    """Attention written with matmuls and a softmax, two query tokens over 200 keys: the same decode kernels,
    the module's output."""
    from test_graph_attention import Additive, PaddingDrop, RepeatGQA, _program
    g = torch.Generator().manual_seed(2)
    kv = 2 if name == "repeat-gqa" else 4
    q = torch.randn(2, 4, 2, 32, generator=g)
    k, v = (torch.randn(2, kv, 200, 32, generator=g) for _ in range(2))
    additive = torch.randn(2, 1, 2, 200, generator=g)
    additive[..., 60:190] = float("-inf")
    pad = torch.zeros(2, 200, dtype=torch.bool)
    pad[0, 30:] = True
    extra = {"additive": (additive,), "padding-drop": (pad,)}.get(name, ())
    module = {"additive": Additive, "padding-drop": PaddingDrop, "repeat-gqa": RepeatGQA}[name]().eval()
    inputs = (q, k, v, *extra)
    graph = capture(module, inputs)
    # the masked forms by default (auto); attention over exactly its keys (no mask) where asked for (fused)
    plan = OfflinePlanner(attention="fused" if name == "repeat-gqa" else None).plan(graph)
    assert [g.params["impl"] for g in plan.groups if g.kind == "attention"] == ["decode"]
    program, values = _program(graph, plan, inputs)
    names = [program.kernels[s["kernel"]]["name"] for s in program.steps if s["kind"] == "kernel"]
    assert any(n.startswith("decode_attention_partial") for n in names)
    (got,) = run_program(emu, program, list(inputs), values)
    with torch.no_grad():
        torch.testing.assert_close(got, module(*inputs), atol=1e-5, rtol=1e-5)


# ---- the GPU ---------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("position", [100, 1000, 2000])
def test_gpu_masked_decode_against_sdpa(dtype, position):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(position)
    b, h, hk, s_max, d = 8, 32, 8, 2048, 128
    q = torch.randn(b, h, 1, d, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(b, hk, s_max, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    k[:, :, position + 1:], v[:, :, position + 1:] = float("nan"), float("nan")  # never read
    mask = (torch.arange(s_max, device="cuda") <= position)[None, None, None, :]
    pair = decode_attention_kernels("dec_gpu_mask", batch=b, heads=h, kv_heads=hk, q_tokens=1, max_len=s_max,
                                    head_dim=d, dtype=dtype, mask_dtype=torch.bool,
                                    strides={"mask": (0, 0, 0, 1)})
    o = gpu_decode(pair, {"q": q, "k": k, "v": v, "mask": mask})
    keep = slice(0, position + 1)
    want = reference(q, k[:, :, keep], v[:, :, keep])
    if dtype == torch.float32:
        torch.testing.assert_close(o.double(), want, atol=1e-4, rtol=1e-4)
        return
    sdpa = F.scaled_dot_product_attention(q, k[:, :, keep], v[:, :, keep], enable_gqa=True)
    sdpa_err = (sdpa.double() - want).abs().max().item()
    assert (o.double() - want).abs().max().item() <= 2 * sdpa_err + 1e-3


@pytest.mark.gpu
def test_gpu_optimized_decode_runs_the_kernels_and_gives_eagers_greedy_tokens():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # eager's fp32 exactly
    try:
        config = LlamaConfig(vocab=512, dim=256, layers=2, heads=8, kv_heads=2, hidden=512, max_len=256, batch=2)
        torch.manual_seed(0)
        model = TinyLlama(config).eval().cuda()
        torch.manual_seed(0)
        twin = TinyLlama(config).eval().cuda()
        gen = StaticCacheGenerator.optimize(model, batch_size=2, prompt_length=12, max_length=256, keep_slower=True,
                                            compare_compile=False)
        assert gen.decode_module.report.status == "optimized", gen.decode_module.report.reason
        names = [k["name"] for k in gen.decode_module.program.kernels]
        assert sum(n.startswith("decode_attention_partial") for n in names) == 1  # both layers: one source
        assert any("split-KV" in text for text, _ in gen.decode_module.report.decisions)
        ids = torch.randint(0, config.vocab, (2, 12), device="cuda")
        with torch.no_grad():
            got = gen.generate(ids, 100)  # positions 12..111: the masked kernels skip most of the 256 slots
            expected = eager_greedy(twin, ids, 100)
        assert torch.equal(got, expected)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
