"""The KV-cache write as a generated kernel (STITCHCUDA_FUSE_CACHE_WRITE, templates/scatter.py): the kernel against
torch's index_copy_ (fp64 reference) on the CUDA emulator and through NVRTC, the int64 bookkeeping exact past
fp32's integers, the planner fusing a Llama decode step's k rotary, both cache writes and the position adds into
one launch, and our TinyLlama and a transformers Llama generating eager's greedy tokens on the emulator with it on.
GPU tests (marked gpu): the bf16 kernel and a transformers decode with the setting on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, EmulatedModule, unavailable  # noqa: E402
from test_decode import (LlamaConfig, TinyLlama, assert_eagers_greedy_tokens, emulated_generator,  # noqa: E402
                         tiny_llama)
from test_decode_capture import lowered  # noqa: E402
from test_graph_emulated import _fp32_only, run_program  # noqa: E402

from stitchcuda import TransformersStaticCacheLM, jit  # noqa: E402
from stitchcuda.graph.capture import capture  # noqa: E402
from stitchcuda.graph.planner import OfflinePlanner  # noqa: E402
from stitchcuda.graph.templates.common import PointwiseInput  # noqa: E402
from stitchcuda.graph.templates.scatter import (CacheIndex, CacheTarget, IntegerChain, cache_write_kernel,  # noqa: E402
                                                integer_expression, integer_kernel)
from stitchcuda.settings import override  # noqa: E402

emulated = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")
ROTARY = ["const float t0 = in0 * in1;", "const float t1 = in2 * in3;", "const float t2 = t0 + t1;"]


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("cache_write"))


@pytest.fixture
def fused():
    """STITCHCUDA_FUSE_CACHE_WRITE=1 for the test."""
    with override(fuse_cache_write=True):
        yield


def _launch(kernel, code, tensors: dict) -> None:
    kernel(code.grid, code.block, *[tensors[v] if kind in ("in", "out") else v for kind, v in code.args])


def _rotary_write(dtype, batch=2, heads=3, length=10, n=2, dim=16, positions=(0, 9)):
    """A rotary (k * cos + rotate_half(k) * sin) of a source stored [B, n, H, D] and viewed [B, H, n, D], written
    into a [B, H, length, D] cache and a second cache (v) at `positions`; the rotated k also stored. Returns the
    kernel, its tensors and the fp64 expected caches and rotated k."""
    torch.manual_seed(0)
    k = torch.randn(batch, n, heads, dim, dtype=dtype).transpose(1, 2)
    v = torch.randn(batch, n, heads, dim, dtype=dtype).transpose(1, 2)
    cos, sin = torch.randn(n, dim, dtype=dtype), torch.randn(n, dim, dtype=dtype)
    caches = [torch.randn(batch, heads, length, dim, dtype=dtype) for _ in range(2)]
    index = torch.tensor(positions)
    shape = tuple(k.shape)
    kst, vst = tuple(k.stride()), tuple(v.stride())
    inputs = [PointwiseInput("in0", dtype, kst), PointwiseInput("in1", dtype, (0, 0, dim, 1)),
              PointwiseInput("in2", dtype, kst, rotate=dim // 2), PointwiseInput("in3", dtype, (0, 0, dim, 1)),
              PointwiseInput("in4", dtype, vst)]
    targets = [CacheTarget(f"w{j}", dtype, tuple(c.stride()), length, var) for j, (c, var) in enumerate(zip(caches, ("t2", "in4")))]
    code = cache_write_kernel("cw", shape, 2, inputs, ROTARY, targets, CacheIndex("idx", 1), [("q0", "t2", dtype)])
    half = dim // 2
    k64 = k.double()
    rotated = k64 * cos.double() + torch.cat([-k64[..., half:], k64[..., :half]], -1) * sin.double()
    inside = torch.tensor([j for j, p in enumerate(positions) if 0 <= p < length])  # the kernel skips the others
    expected = [caches[0].double().index_copy_(2, index[inside], rotated.to(dtype).double()[:, :, inside]),
                caches[1].double().index_copy_(2, index[inside], v.double()[:, :, inside])]
    out = torch.full(shape, float("nan"), dtype=dtype)
    tensors = {"in0": k, "in1": cos, "in2": k, "in3": sin, "in4": v, "idx": index, "w0": caches[0], "w1": caches[1],
               "q0": out}
    return code, tensors, expected, rotated


def _memory(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor as its pointer sees it (the transposed source's storage, contiguous)."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(order).contiguous() if not t.is_contiguous() else t


@emulated
@pytest.mark.parametrize("positions", [(0, 9), (9, 0), (4, 5)], ids=["ends", "ends-reversed", "middle"])
def test_the_kernel_writes_the_rotated_source_where_index_copy_does(emu, positions):
    code, t, expected, rotated = _rotary_write(torch.float32, positions=positions)
    kernel = EmulatedModule(emu, _fp32_only(code.source)).kernel(code.name)
    _launch(kernel, code, {key: _memory(v) for key, v in t.items()})
    assert code.vectorized and "store8" in code.source and "load8(p2" in code.source  # 16-byte accesses
    for got, want in zip((t["w0"], t["w1"]), expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(t["q0"].double(), rotated, rtol=1e-6, atol=1e-6)


@emulated
def test_a_rotated_half_of_four_is_read_one_value_at_a_time(emu):
    # D = 8: a thread's eight values straddle the two halves, so the rotated input is read element by element.
    code, t, expected, rotated = _rotary_write(torch.float32, dim=8)
    assert "load8(p0" in code.source and "load8(p2" not in code.source
    kernel = EmulatedModule(emu, _fp32_only(code.source)).kernel(code.name)
    _launch(kernel, code, {key: _memory(v) for key, v in t.items()})
    for got, want in zip((t["w0"], t["w1"]), expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(t["q0"].double(), rotated, rtol=1e-6, atol=1e-6)


@emulated
def test_a_position_outside_the_cache_writes_nothing_and_the_rest_is_written(emu):
    code, t, expected, _ = _rotary_write(torch.float32, positions=(10, 3))  # 10: one past the cache's end
    before = [t["w0"].clone(), t["w1"].clone()]
    kernel = EmulatedModule(emu, _fp32_only(code.source)).kernel(code.name)
    _launch(kernel, code, {key: _memory(v) for key, v in t.items()})
    for got, old in zip((t["w0"], t["w1"]), before):
        assert torch.equal(got[:, :, [p for p in range(10) if p != 3]], old[:, :, [p for p in range(10) if p != 3]])
    torch.testing.assert_close(t["w0"][:, :, 3].double(), expected[0][:, :, 3], rtol=1e-6, atol=1e-6)


@emulated
def test_a_cache_stored_transposed_takes_every_value_one_at_a_time(emu):
    # [B, H, L, D] viewed from [B, H, D, L] storage: the last dimension L apart, no 16-byte store.
    src = torch.randn(2, 3, 2, 8)
    storage = torch.zeros(2, 3, 8, 5)
    cache = storage.transpose(2, 3)
    code = cache_write_kernel("tr", (2, 3, 2, 8), 2, [PointwiseInput("in0", torch.float32, tuple(src.stride()))], [],
                              [CacheTarget("w0", torch.float32, tuple(cache.stride()), 5, "in0")], CacheIndex("idx", 1))
    kernel = EmulatedModule(emu, _fp32_only(code.source)).kernel(code.name)
    _launch(kernel, code, {"in0": src, "idx": torch.tensor([4, 0]), "w0": storage})
    assert torch.equal(cache, torch.zeros(2, 3, 5, 8).index_copy_(2, torch.tensor([4, 0]), src))


@emulated
def test_an_odd_head_dim_writes_one_value_at_a_time(emu):
    src = torch.randn(2, 3, 1, 6)
    cache = torch.zeros(2, 3, 5, 6)
    code = cache_write_kernel("odd", (2, 3, 1, 6), 2, [PointwiseInput("in0", torch.float32, tuple(src.stride()))], [],
                              [CacheTarget("w0", torch.float32, tuple(cache.stride()), 5, "in0")], CacheIndex("idx", 1))
    assert not code.vectorized
    kernel = EmulatedModule(emu, _fp32_only(code.source)).kernel(code.name)
    _launch(kernel, code, {"in0": src, "idx": torch.tensor([4]), "w0": cache})
    assert torch.equal(cache, torch.zeros(2, 3, 5, 6).index_copy_(2, torch.tensor([4]), src))


@emulated
def test_int64_bookkeeping_is_exact_past_fp32s_integers(emu):
    big = torch.tensor([2 ** 40 + 1, 2 ** 53 + 3, -(2 ** 33) - 7])
    step = torch.tensor(5)
    chains = [IntegerChain((3,), [PointwiseInput("a", torch.int64, (1,)), PointwiseInput("b", torch.int64, (0,))],
                           [f"const long long t0 = {integer_expression('aten::add.Tensor', 'in0', 'in1')};",
                            f"const long long t1 = {integer_expression('aten::sub.Tensor', 't0', '3LL', 2)};"],
                           [("z0", "t0"), ("z1", "t1")]),
              IntegerChain((), [PointwiseInput("b2", torch.int64, ())],
                           [f"const long long t0 = {integer_expression('aten::add.Tensor', 'in0', '1LL')};"],
                           [("z2", "t0")])]
    code = integer_kernel("ints", chains)
    kernel = EmulatedModule(emu, code.source).kernel(code.name)
    out = {"z0": torch.zeros(3, dtype=torch.long), "z1": torch.zeros(3, dtype=torch.long),
           "z2": torch.zeros((), dtype=torch.long)}
    _launch(kernel, code, {"a": big, "b": step, "b2": step, **out})
    assert torch.equal(out["z0"], big + step)
    assert torch.equal(out["z1"], big + step - 6)
    assert int(out["z2"]) == 6


@emulated
def test_positions_computed_in_the_writing_kernel_and_its_counter_stored_by_it(emu):
    # index = start + offsets, computed by each writing thread in int64; the counter start + n, independent of the
    # writes, stored by the same launch; the positions, which another step reads, stored too.
    src = torch.randn(1, 2, 3, 8)
    cache = torch.zeros(1, 2, 12, 8)
    start, offsets = torch.tensor(9), torch.arange(3)
    add = "aten::add.Tensor"
    chains = [IntegerChain((3,), [PointwiseInput("s", torch.int64, (0,)), PointwiseInput("o", torch.int64, (1,))],
                           [f"const long long t0 = {integer_expression(add, 'in0', 'in1')};"], [("z0", "t0")]),
              IntegerChain((), [PointwiseInput("s", torch.int64, ())],
                           [f"const long long t0 = {integer_expression(add, 'in0', '3LL')};"], [("z1", "t0")])]
    code = cache_write_kernel("cw_chain", (1, 2, 3, 8), 2, [PointwiseInput("in0", torch.float32, tuple(src.stride()))],
                              [], [CacheTarget("w0", torch.float32, tuple(cache.stride()), 12, "in0")],
                              CacheIndex(chain=0, var="t0"), chains=chains)
    kernel = EmulatedModule(emu, _fp32_only(code.source)).kernel(code.name)
    out = {"z0": torch.zeros(3, dtype=torch.long), "z1": torch.zeros((), dtype=torch.long)}
    _launch(kernel, code, {"in0": src, "s": start, "o": offsets, "w0": cache, **out})
    assert torch.equal(out["z0"], start + offsets) and int(out["z1"]) == 12
    want = torch.zeros(1, 2, 12, 8)
    want[:, :, 9:12] = src  # positions 9, 10 and 11: all inside the 12 slots
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_kernel_compiles_with_nvrtc_for_every_dtype(dtype):
    code, *_ = _rotary_write(dtype)
    assert jit.compile(code.source, code.name, arch="sm_90") is not None


def _transformers_llama(dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().to(dtype)


def _launches(program) -> int:
    return sum(s["kind"] in ("kernel", "aten", "matmul") and s.get("op") != "aten::view" for s in program.steps)


def test_the_planner_fuses_a_decode_steps_rotary_cache_writes_and_positions():
    lm = TransformersStaticCacheLM(_transformers_llama(torch.bfloat16), batch_size=1, max_length=24)
    step = (torch.zeros(1, 1, dtype=torch.long), torch.tensor([6]))
    with override(fuse_cache_write=False):
        _, before, _ = lowered(lm, step)
    with override(fuse_cache_write=True):
        plan = OfflinePlanner().plan(capture(lm, step))
        _, after, _ = lowered(lm, step)
    writes = [g for g in plan.groups if g.kind == "cache_write"]
    assert len(writes) == 2  # one per layer: its k and v writes together
    assert any(text.startswith("4 KV cache write(s) in 2 generated kernel(s)") for text, _ in plan.decisions)
    for g in writes:
        ops = [n.op for n in g.nodes]
        assert ops.count("aten::index_copy") == 2 and "aten::cat" in ops and "aten::add.Tensor" in ops  # k rotary
    steps = [s.get("op") for s in after.steps if s["kind"] == "aten"]
    assert "aten::index_copy_" not in steps and "aten::add.Tensor" not in steps
    # Per layer, k's rotary and two index_copy_ steps were three launches, now one; the six int64 adds (the
    # positions before the first layer, each layer's write position and counter) one integer kernel for all.
    old = [s.get("op") for s in before.steps if s["kind"] == "aten"]
    assert old.count("aten::index_copy_") == 4 and old.count("aten::add.Tensor") == 6
    assert sum(k["name"].startswith("integer") for k in after.kernels) == 1
    assert _launches(after) == _launches(before) - (2 + 4 + 6) + (2 + 1)


@emulated
def test_our_llama_generates_eagers_greedy_tokens_with_the_fused_writes(emu, fused):
    model, twin = tiny_llama(), tiny_llama()
    prompt, new = 5, 6
    _, prefill, prefill_values = lowered(model, (torch.zeros(2, prompt, dtype=torch.long), torch.arange(prompt)))
    _, decode, decode_values = lowered(model, (torch.zeros(2, 1, dtype=torch.long), torch.tensor([prompt])))
    for program in (prefill, decode):
        assert not any(s["kind"] == "aten" and s["op"] == "aten::index_copy_" for s in program.steps)
        assert any(k["name"].startswith("cache_write") for k in program.kernels)
    gen = emulated_generator(emu, model, 16, 2, (prefill, prefill_values), (decode, decode_values),
                             dict(model.named_buffers()), caches=model.caches())
    assert_eagers_greedy_tokens(gen, model, twin, prompt, new)


@emulated
def test_without_grouped_query_heads_the_rotated_query_is_stored_by_the_same_launch(emu, fused):
    # q and k have one shape: their rotaries are one elementwise group, which the cache write takes whole and
    # which stores the rotated q the attention reads.
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(kv_heads=4)).eval()
    twin = TinyLlama(LlamaConfig(kv_heads=4)).eval()
    twin.load_state_dict(model.state_dict())
    step = (torch.zeros(2, 1, dtype=torch.long), torch.tensor([5]))
    plan = OfflinePlanner().plan(capture(model, step))
    writes = [g for g in plan.groups if g.kind == "cache_write"]
    assert len(writes) == 2 and all(sum(n.op == "aten::cat" for n in g.nodes) == 2 for g in writes)
    _, prefill, prefill_values = lowered(model, (torch.zeros(2, 5, dtype=torch.long), torch.arange(5)))
    _, decode, decode_values = lowered(model, step)
    gen = emulated_generator(emu, model, 16, 2, (prefill, prefill_values), (decode, decode_values),
                             dict(model.named_buffers()), caches=model.caches())
    assert_eagers_greedy_tokens(gen, model, twin, 5, 6)


@emulated
def test_a_transformers_llama_generates_its_greedy_tokens_with_the_fused_writes(emu, fused):
    model = _transformers_llama()
    lm = TransformersStaticCacheLM(model, batch_size=1, max_length=24)
    graph, prefill, prefill_values = lowered(lm, (torch.zeros(1, 6, dtype=torch.long), torch.arange(6)))
    _, decode, decode_values = lowered(lm, (torch.zeros(1, 1, dtype=torch.long), torch.tensor([6])))
    assert not any(s["kind"] == "aten" and s["op"] in ("aten::index_copy_", "aten::add.Tensor") for s in decode.steps)
    assert_transformers_greedy_tokens(emu, model, lm, graph, (prefill, prefill_values), (decode, decode_values))


def assert_transformers_greedy_tokens(emu, model, lm, graph, prefill, decode) -> None:
    """The emulated prefill and decode programs of `lm` (a 24-slot TransformersStaticCacheLM over `model`) generate
    transformers' own greedy tokens, twice: the second sequence starts from zeroed caches and counters."""
    prefix = next(iter(graph.state_buffers.values())).rpartition("layer")[0]
    states = {prefix + name: t for name, t in lm.named_buffers()}
    gen = emulated_generator(emu, lm, 24, 1, prefill, decode, states)
    for seed in (1, 2):
        torch.manual_seed(seed)
        ids = torch.randint(0, 256, (1, 6))
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                      do_sample=False, pad_token_id=0)
        assert torch.equal(gen.generate(ids, 8), expected)


class CountedCache(nn.Module):
    """k and v written at `length + arange(n)` (an int64 add), then `length += n`: the layer's bookkeeping."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 64, bias=False)
        self.register_buffer("k", torch.zeros(1, 2, 12, 16))
        self.register_buffer("v", torch.zeros(1, 2, 12, 16))
        self.register_buffer("length", torch.tensor(0))

    def forward(self, x):
        n = x.shape[1]
        k, v = self.proj(x).view(1, n, 2, 2, 16).permute(2, 0, 3, 1, 4)
        positions = self.length + torch.arange(n)
        self.k.index_copy_(2, positions, k * 2.0)
        self.v.index_copy_(2, positions, v)
        self.length.add_(n)
        return self.k.sum(-1) + self.v.sum(-1)


@emulated
def test_the_positions_and_the_counter_join_the_writes_launch_and_every_call_matches_eager(emu, fused):
    torch.manual_seed(0)
    model, twin = CountedCache().eval(), CountedCache().eval()
    twin.load_state_dict(model.state_dict())
    graph, program, values = lowered(model, (torch.randn(1, 3, 32),))
    (write,) = [g for g in OfflinePlanner().plan(graph).groups if g.kind == "cache_write"]
    assert [n.op for n in write.nodes].count("aten::add.Tensor") == 2  # the positions and the counter
    assert sum(s["kind"] in ("kernel", "aten") for s in program.steps) == 4  # the write, two sums, the counter's copy
    states = dict(model.named_buffers())
    for _ in range(3):  # positions 0-2, 3-5, 6-8: each call's counter read by the next
        x = torch.randn(1, 3, 32)
        (got,) = run_program(emu, program, [x], values, states)
        with torch.no_grad():
            torch.testing.assert_close(got, twin(x), rtol=1e-5, atol=1e-5)
        for name, buffer in twin.named_buffers():
            torch.testing.assert_close(states[name], buffer, rtol=1e-6, atol=1e-6)
    assert states["length"].dtype == torch.int64 and int(states["length"]) == 9


# ---- on a GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_kernel_matches_index_copy_on_a_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    code, t, expected, rotated = _rotary_write(dtype, positions=(0, 9))
    cuda = {key: _memory(v).cuda() for key, v in t.items()}
    _launch(jit.compile(code.source, code.name), code, cuda)
    # fp32: the kernel's product and sum may contract into one FMA (one rounding fewer than fp32 ops apart)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for key, want in zip(("w0", "w1"), expected):
        torch.testing.assert_close(cuda[key].cpu().double(), want.to(dtype).double(), **tol)
    torch.testing.assert_close(cuda["q0"].cpu().double(), rotated.to(dtype).double(), **tol)


@pytest.mark.gpu
def test_a_transformers_decode_with_the_fused_writes_gives_its_greedy_tokens(fused):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from stitchcuda import StaticCacheGenerator

    model = _transformers_llama().cuda()
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products on both sides: transformers' exact tokens
    try:
        gen = StaticCacheGenerator.for_transformers(model, batch_size=1, prompt_length=8, max_length=64,
                                                    keep_slower=True, compare_compile=False)
        assert gen.decode_module.report.status == "optimized", gen.decode_module.report.reason
        assert any(k["name"].startswith("cache_write") for k in gen.decode_module.program.kernels)
        ids = torch.randint(0, 256, (1, 8), device="cuda")
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                                      do_sample=False, pad_token_id=0)
        assert torch.equal(gen.generate(ids, 16), expected)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
