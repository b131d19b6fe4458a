"""Merged launches (graph/merge_launches.py): which launches merge (independent ones, small, of block sizes that fit
together, of generated kernels only), that no order a step depends on changes (random programs, views included),
that NVRTC compiles the merged kernels, and that a program with the pass on gives bit for bit what it gives with
the pass off — on the CUDA emulator (hand-built programs of several block sizes, a small MLP with parallel
branches, a transformers Llama decode step) and on the GPU."""

from __future__ import annotations

import hashlib
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, unavailable  # noqa: E402

from stitchcuda.graph import Lowering, OfflinePlanner, capture, reference_values  # noqa: E402
from stitchcuda.graph.merge_launches import (MAX_BODIES, MergingBuilder, mark_generated, merge_decision,  # noqa: E402
                                             mergeable_source)
from stitchcuda.program import ProgramBuilder  # noqa: E402
from stitchcuda.settings import override  # noqa: E402

emulated = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")

SCALE = """extern "C" __global__ void NAME(const float* __restrict__ x, float* __restrict__ y, long long n, float a) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    y[i] = a * x[i];
}
"""

# A block's partial sum: static shared memory sized by a macro, __syncthreads, one result per block.
BLOCK_SUM = """#define WARPS 4
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(const float* __restrict__ x, float* __restrict__ y,
                                                             long long n) {
  __shared__ float sh[WARPS];
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  float v = warp_sum(i < n ? x[i] : 0.0f);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) y[blockIdx.x] = sh[0] + sh[1] + sh[2] + sh[3];
}
"""


def _kernel(b: ProgramBuilder, source: str, name: str, generated: bool = True) -> int:
    k = b.kernel(source.replace("NAME", name), name)
    if generated:
        mark_generated(b, k)
    return k


def _kernel_steps(program) -> list[dict]:
    return [s for s in program.steps if s["kind"] == "kernel"]


def _names(program) -> list[str]:
    return [program.kernels[s["kernel"]]["name"] for s in _kernel_steps(program)]


def _two_scales(b: MergingBuilder, *, second_reads_first: bool = False, block2: int = 256, generated: bool = True):
    x = b.input([1024])
    y1, y2 = b.output([1024]), b.output([1024])
    k1 = _kernel(b, SCALE, "scale_a")
    k2 = _kernel(b, SCALE, "scale_b", generated)
    b.launch(k1, [4], [256], [("in", x), ("out", y1), ("i64", 1024), ("f32", 2.0)])
    b.launch(k2, [4], [block2], [("in", y1 if second_reads_first else x), ("out", y2), ("i64", 1024), ("f32", 3.0)])
    return b.build()


# ---- what merges ---------------------------------------------------------------------------------------------


def test_independent_launches_become_one_launch_of_both_bodies_on_their_own_block_ranges():
    b = MergingBuilder()
    program = _two_scales(b)
    (step,) = _kernel_steps(program)
    assert step["grid"] == [8, 1, 1] and step["block"] == [256, 1, 1] and step["shared_mem"] == 0
    assert [k for k, _ in step["args"]] == ["in", "out", "i64", "f32"] * 2
    source = program.kernels[step["kernel"]]["source"]
    # The second body sees its own block index and block count, the first its own count.
    assert "(blockIdx.x - 4u)" in source and "(blockIdx.x - 0u)" in source and "(4u)" in source
    assert "if (blockIdx.x < 4u)" in source and "if (blockIdx.x < 8u)" in source
    assert len(program.kernels) == 1  # the originals left the table
    assert b.summary == {"candidates": 2, "groups": [2], "merged": 2, "launches_before": 2, "launches_after": 1}
    title, why = merge_decision(b)
    assert title == "2 kernel launches merged into 1" and "2 launches became 1" in why


def test_a_launch_that_reads_anothers_result_is_never_merged_and_keeps_its_order():
    program = _two_scales(MergingBuilder(), second_reads_first=True)
    assert _names(program) == ["scale_a", "scale_b"]


def test_a_body_of_a_smaller_block_runs_on_the_first_threads_when_it_synchronizes_no_barrier():
    program = _two_scales(MergingBuilder(), block2=128)
    (step,) = _kernel_steps(program)
    source = program.kernels[step["kernel"]]["source"]
    assert step["block"] == [256, 1, 1] and "if (threadIdx.x < 128u) sc_body1::scale_b(" in source
    assert "(128u)" in source and "(256u)" in source  # each body's blockDim.x, its own block size
    # Not a whole number of warps: its warp-wide operations would see other threads.
    assert _names(_two_scales(MergingBuilder(), block2=48)) == ["scale_a", "scale_b"]


def test_a_body_that_synchronizes_its_block_runs_only_at_its_own_block_size():
    b = MergingBuilder()
    x = b.input([1024])
    sums, y = b.output([8]), b.output([1024])
    b.launch(_kernel(b, BLOCK_SUM, "block_sum"), [8], [128], [("in", x), ("out", sums), ("i64", 1024)])
    b.launch(_kernel(b, SCALE, "scale_c"), [4], [256], [("in", x), ("out", y), ("i64", 1024), ("f32", 2.0)])
    assert _names(b.build()) == ["block_sum", "scale_c"]


def test_a_kernel_not_generated_by_a_template_is_never_merged():
    # A kernel step's source (an LLM's or a candidate's) is not marked: it runs as it was verified.
    b = MergingBuilder()
    assert _names(_two_scales(b, generated=False)) == ["scale_a", "scale_b"]
    assert merge_decision(b)[0] == "no launches merged"


def test_the_plain_builder_is_the_lowerings_while_the_setting_is_off():
    from stitchcuda.graph.merge_launches import program_builder

    with override(merge_launches=False):
        assert type(program_builder()) is ProgramBuilder
        mark_generated(program_builder(), 0)  # a no-op on the plain builder
    with override(merge_launches=True):
        assert isinstance(program_builder(), MergingBuilder)
    assert merge_decision(ProgramBuilder()) is None


def test_a_fault_of_the_pass_leaves_the_program_as_built(monkeypatch):
    import stitchcuda.graph.merge_launches as merge_launches

    def broken(parts):
        raise ZeroDivisionError("a fault of the pass")

    monkeypatch.setattr(merge_launches, "merged_kernel", broken)
    b = MergingBuilder()
    program = _two_scales(b)
    assert _names(program) == ["scale_a", "scale_b"]
    program.validate()
    title, why = merge_decision(b)
    assert title == "no launches merged" and "ZeroDivisionError: a fault of the pass" in why


def test_a_program_invalid_on_its_own_raises_the_builders_error():
    from stitchcuda.errors import InvalidArgumentError

    b = MergingBuilder()
    t, y = b.intermediate([64]), b.output([64])
    b.launch(_kernel(b, SCALE, "scale_bad"), [1], [64], [("in", t), ("out", y), ("i64", 64), ("f32", 1.0)])
    with pytest.raises(InvalidArgumentError, match="before any step writes it"):
        b.build()


def _views_program(first: tuple[int, int], second: tuple[int, int], second_writes: bool = True):
    """Two launches over slices of one intermediate: the first writes x[first], the second writes (or reads)
    x[second]; then both slices are read into the outputs."""
    b = MergingBuilder()
    src = b.input([256])
    buf = b.intermediate([256])
    b.aten("aten::clone", [src], [buf])
    k = _kernel(b, SCALE, "scale_v")
    v1 = b.view("slice", buf, [first[1] - first[0]], storage_offset=first[0])
    v2 = b.view("slice", buf, [second[1] - second[0]], storage_offset=second[0])
    o1, o2 = b.output([first[1] - first[0]]), b.output([second[1] - second[0]])
    b.launch(k, [1], [128], [("in", src), ("out", v1), ("i64", first[1] - first[0]), ("f32", 2.0)])
    if second_writes:
        b.launch(k, [1], [128], [("in", src), ("out", v2), ("i64", second[1] - second[0]), ("f32", 3.0)])
    else:
        b.launch(k, [1], [128], [("in", v2), ("out", o2), ("i64", second[1] - second[0]), ("f32", 3.0)])
    b.aten("aten::clone", [v1], [o1])
    if second_writes:
        b.aten("aten::clone", [v2], [o2])
    return b.build()


def test_views_over_disjoint_bytes_of_one_buffer_merge_and_overlapping_ones_do_not():
    assert len(_kernel_steps(_views_program((0, 64), (64, 128)))) == 1
    assert len(_kernel_steps(_views_program((0, 64), (32, 96)))) == 2  # a write over the other's bytes
    assert len(_kernel_steps(_views_program((0, 64), (63, 100), second_writes=False))) == 2  # reads a written byte
    assert len(_kernel_steps(_views_program((0, 64), (64, 100), second_writes=False))) == 1


def test_small_launches_only_and_at_most_max_bodies_per_merged_kernel():
    b = MergingBuilder(sm_count=4)  # a merged launch holds at most 8 blocks
    x = b.input([4096])
    k = _kernel(b, SCALE, "scale_many")
    outs = []
    for j in range(2 * MAX_BODIES + 1):
        outs.append(b.output([64]))
        b.launch(k, [1], [64], [("in", x), ("out", outs[-1]), ("i64", 64), ("f32", float(j))])
    big = b.output([4096])
    b.launch(k, [9], [64], [("in", x), ("out", big), ("i64", 4096), ("f32", 1.0)])  # more than 2 waves of 4 SMs
    program = b.build()
    steps = _kernel_steps(program)
    assert [s["grid"][0] for s in steps] == [8, 8, 1, 9]  # eight bodies, eight, the one left, the big one apart
    tags = [a for s in steps for kind, a in s["args"] if kind == "f32"]
    assert tags == [float(j) for j in range(2 * MAX_BODIES + 1)] + [1.0]  # bodies in program order


def test_merged_kernel_names_are_a_hash_of_their_source():
    first, again = _two_scales(MergingBuilder()), _two_scales(MergingBuilder())
    (k1,), (k2,) = first.kernels, again.kernels
    assert k1["name"] == k2["name"] and k1["source"] == k2["source"]
    assert k1["name"] == "merged_" + hashlib.sha256(k1["source"].replace(k1["name"], "\0").encode()).hexdigest()[:12]
    other = _views_program((0, 64), (64, 128)).kernels[0]
    assert other["name"].startswith("merged_") and other["name"] != k1["name"]


@pytest.mark.parametrize("source, why", [
    ("extern __shared__ float s[];\n" + SCALE, "extern __shared__"),
    (SCALE.replace("blockIdx.x *", "blockIdx.y * 0 + blockIdx.x *"), "blockIdx.y"),
    (SCALE.replace("long long i =", "uint3 b = blockIdx; long long i ="), "reads blockIdx other than through .x"),
    (SCALE + SCALE.replace("NAME", "other"), "not exactly one __global__"),
    (SCALE.replace("long long i =", "dim3 d = blockDim; long long i ="), "reads blockDim other than through"),
    ("#include <cooperative_groups.h>\n" + SCALE, "cooperative_groups"),
    (SCALE.replace("a * x[i]", "a * x[i] + sh[0]").replace("{\n", "{\n  __shared__ float sh[N_UNKNOWN];\n", 1),
     "a __shared__ array whose size the pass cannot read"),
])
def test_sources_the_rewrite_does_not_understand_are_not_merged(source, why):
    answer = mergeable_source(source.replace("NAME", "k"), "k")
    assert not answer.ok and why in answer.why


def test_static_shared_bytes_and_barriers_are_read_from_the_source():
    assert mergeable_source(BLOCK_SUM.replace("NAME", "k"), "k") == (True, "", 16, True)
    assert mergeable_source(SCALE.replace("NAME", "k"), "k") == (True, "", 0, False)


# ---- random programs: no dependence reordered ------------------------------------------------------------------


def _random_program(seed: int):
    """A program of launches (two block sizes, some not generated) and ATen steps over a few buffers and views of
    one of them; each launch carries its number as its f32 argument, each ATen step as its alpha."""
    rng = random.Random(seed)
    b = MergingBuilder(window=rng.choice([4, 48]))
    x = b.input([512])
    pool = b.intermediate([512])
    b.aten("aten::clone", [x], [pool])
    plain = [b.intermediate([128]) for _ in range(4)]
    offsets = (0, 128, 192, 384)  # the second and third views overlap
    views = [b.view("slice", pool, [128], storage_offset=o) for o in offsets]
    storage = {x: ("x", 0, 512), pool: ("pool", 0, 512), **{p: (p, 0, 128) for p in plain},
               **{v: ("pool", o, o + 128) for v, o in zip(views, offsets)}}

    def overlap(p, q) -> bool:
        (rp, sp, ep), (rq, sq, eq) = storage[p], storage[q]
        return rp == rq and sp < eq and sq < ep

    written = {x, pool, *views}
    kernels = [_kernel(b, SCALE, "scale_r"), _kernel(b, SCALE, "scale_s", generated=False)]
    steps = []  # (tag, reads, writes)
    for t in range(rng.randint(6, 30)):
        if rng.random() < 0.7:
            src = rng.choice(sorted(written))
            dst = rng.choice([q for q in [pool, *plain, *views] if not overlap(q, src)])
            b.launch(rng.choice(kernels), [1], [rng.choice([64, 64, 128])],
                     [("in", src), ("out", dst), ("i64", 128), ("f32", float(t))])
        else:  # same-sized operands
            src = rng.choice(sorted(written & {*plain, *views}))
            dst = rng.choice([q for q in [*plain, *views] if not overlap(q, src)])
            b.aten("aten::add.Tensor", [src, src], [dst], alpha=float(t))
        steps.append((t, {src}, {dst}))
        written.add(dst)
    out = b.output([512])
    b.aten("aten::clone", [pool], [out])
    return b, b.build(), steps, overlap


@pytest.mark.parametrize("seed", range(40))
def test_random_programs_keep_every_dependence_in_order(seed):
    b, program, steps, overlap = _random_program(seed)

    def conflict(a, c) -> bool:
        (_, ra, wa), (_, rc, wc) = a, c
        return any(overlap(w, y) for w in wa for y in rc | wc) or any(overlap(w, y) for w in wc for y in ra)

    position = {}
    for k, s in enumerate(program.steps):
        if s["kind"] == "kernel":
            for kind, value in s["args"]:
                if kind == "f32":
                    position[int(value)] = k
        elif s["kind"] == "aten":
            if "alpha" in s["attributes"]:
                position[int(s["attributes"]["alpha"])] = k
    assert sorted(position) == [t for t, _, _ in steps]  # every step once
    for i, a in enumerate(steps):
        for c in steps[i + 1:]:
            if conflict(a, c):
                assert position[a[0]] < position[c[0]], (seed, a, c)
    merged = [s for s in _kernel_steps(program) if program.kernels[s["kernel"]]["name"].startswith("merged_")]
    for s in merged:
        assert "scale_s" not in program.kernels[s["kernel"]]["source"]
    assert b.summary["launches_after"] == len(_kernel_steps(program))


def test_random_programs_do_merge_somewhere():
    # The property above is not vacuous: most of these programs merge some of their launches.
    assert sum(_random_program(seed)[0].summary["groups"] != [] for seed in range(40)) >= 20


# ---- lowered programs: NVRTC, the emulator ---------------------------------------------------------------------


class Branches(torch.nn.Module):
    """A small MLP of three parallel branches, two layers each: its activations are independent small kernels.
    (No biases: the emulator's programs run plain matmul steps.)"""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.first = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.second = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in range(3))

    def forward(self, x):
        a, b, c = (layer(x) for layer in self.first)
        h = [torch.nn.functional.gelu(a) * 0.5, torch.sigmoid(b) + 1.0, torch.tanh(c) - x]
        return (*(torch.tanh(layer(t)) for layer, t in zip(self.second, h)), torch.softmax(x, -1))


def _lowered(model, inputs, merge: bool):
    graph = capture(model, inputs)
    plan = OfflinePlanner().plan(graph)
    values = reference_values(graph, list(inputs))
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    with override(merge_launches=merge):
        lowering = Lowering(graph, plan, constants)
        program = lowering.build(plan.groups, graph.inputs, graph.outputs)
    return program, values, lowering


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvrtc_compiles_the_merged_kernels_of_a_lowered_program(dtype):
    model = Branches().eval().to(dtype)
    x = torch.randn(2, 64, dtype=dtype)
    off, _, _ = _lowered(model, (x,), False)
    on, _, lowering = _lowered(model, (x,), True)
    assert len(_kernel_steps(on)) < len(_kernel_steps(off))
    assert any(n.startswith("merged_") for n in _names(on))
    assert merge_decision(lowering.b)[0] == (f"{lowering.b.summary['merged']} kernel launches merged into "
                                             f"{len(lowering.b.summary['groups'])}")
    on.compile_kernels("sm_90a")
    assert all(k["arch"] == "sm_90a" for k in on.kernels)


def _llama_decode(dtype, merge: bool, max_length: int = 32, **settings):
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_decode_capture import lowered

    from stitchcuda import TransformersStaticCacheLM

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    lm = TransformersStaticCacheLM(transformers.LlamaForCausalLM(config).eval().to(dtype), batch_size=1,
                                   max_length=max_length)
    with override(merge_launches=merge, **settings):
        graph, program, values = lowered(lm, (torch.zeros(1, 1, dtype=torch.long), torch.tensor([5])))
    return lm, graph, program, values


@pytest.mark.parametrize("cache_write", [False, True], ids=["aten-cache-writes", "generated-cache-writes"])
def test_a_bf16_llama_decode_step_launches_fewer_kernels_and_nvrtc_compiles_them(cache_write):
    _, _, off, _ = _llama_decode(torch.bfloat16, False, fuse_cache_write=cache_write)
    _, _, on, _ = _llama_decode(torch.bfloat16, True, fuse_cache_write=cache_write)
    before, after = len(_kernel_steps(off)), len(_kernel_steps(on))
    assert after < before
    assert len(on.steps) == len(off.steps) - (before - after)  # only launches went
    on.compile_kernels("sm_90a")


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("merged"))


def _run(emu, program, inputs, values, states=None):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_graph_emulated import run_program

    return run_program(emu, program, inputs, values, states)


# No bounds check: right only when launched with exactly as many threads as elements.
UNCHECKED = """extern "C" __global__ void NAME(const float* __restrict__ x, float* __restrict__ y) {
  y[blockIdx.x * blockDim.x + threadIdx.x] = 5.0f * x[blockIdx.x * blockDim.x + threadIdx.x];
}
"""


def _mixed_blocks(builder: ProgramBuilder):
    """y1 = 2x (256-thread blocks), y2 = 3x (128: a body of a smaller block), per-block sums of x (128 threads,
    __syncthreads: runs only at its own block size), and z: its first half 5x by a 128-thread kernel without a
    bounds check, its second half x's copy, untouched (only the body's own threads may run it)."""
    x = builder.input([1024])
    y1, y2, sums, out = builder.output([1024]), builder.output([1024]), builder.output([8]), builder.output([256])
    z = builder.intermediate([256])
    builder.aten("aten::clone", [builder.view("slice", x, [256])], [z])
    low, high = builder.view("slice", z, [128]), builder.view("slice", z, [128], storage_offset=128)
    k = _kernel(builder, SCALE, "scale_m")
    builder.launch(k, [4], [256], [("in", x), ("out", y1), ("i64", 1024), ("f32", 2.0)])
    builder.launch(k, [4], [128], [("in", x), ("out", y2), ("i64", 1024), ("f32", 3.0)])
    builder.launch(_kernel(builder, BLOCK_SUM, "block_sum_m"), [8], [128], [("in", x), ("out", sums), ("i64", 1024)])
    builder.launch(_kernel(builder, UNCHECKED, "unchecked_m"), [1], [128], [("in", x), ("out", low)])
    builder.aten("aten::clone", [z], [out])
    return builder.build()


@emulated
def test_bodies_of_other_block_sizes_compute_what_their_launches_did(emu):
    off, on = _mixed_blocks(MergingBuilder(max_bodies=1)), _mixed_blocks(MergingBuilder())
    assert len(_kernel_steps(off)) == 4 and [s["block"][0] for s in _kernel_steps(on)] == [256, 128]
    x = torch.randn(1024)
    got_off, got_on = _run(emu, off, [x], {}), _run(emu, on, [x], {})
    assert all(torch.equal(a, c) for a, c in zip(got_off, got_on))
    torch.testing.assert_close(got_on[0], 2 * x)
    torch.testing.assert_close(got_on[1], 3 * x)
    torch.testing.assert_close(got_on[2], x.view(8, 128).sum(1), rtol=1e-5, atol=1e-5)
    assert torch.equal(got_on[3][:128], 5 * x[:128]) and torch.equal(got_on[3][128:], x[128:256])


@emulated
def test_the_branches_mlp_gives_bit_for_bit_the_same_outputs_with_the_pass_on(emu):
    torch.manual_seed(3)
    model = Branches().eval()
    x = torch.randn(4, 64)
    off, values, _ = _lowered(model, (x,), False)
    on, _, _ = _lowered(model, (x,), True)
    assert len(_kernel_steps(on)) < len(_kernel_steps(off))
    got_off, got_on = _run(emu, off, [x], values), _run(emu, on, [x], values)
    with torch.no_grad():
        torch.testing.assert_close(got_off[0], model(x)[0], rtol=1e-4, atol=1e-5)
    assert all(torch.equal(a, c) for a, c in zip(got_off, got_on))


@emulated
@pytest.mark.parametrize("cache_write", [False, True], ids=["aten-cache-writes", "generated-cache-writes"])
def test_a_transformers_llama_decode_step_gives_bit_for_bit_the_same_logits_and_caches(emu, cache_write):
    # With the cache writes generated (32-thread blocks, beside 256-thread rotary kernels), bodies of smaller
    # blocks run on the first threads of a merged block.
    lm, graph, off, values = _llama_decode(torch.float32, False, fuse_cache_write=cache_write)
    _, _, on, _ = _llama_decode(torch.float32, True, fuse_cache_write=cache_write)
    before, after = len(_kernel_steps(off)), len(_kernel_steps(on))
    assert after < before, (before, after)
    prefix = next(iter(graph.state_buffers.values())).rpartition("layer")[0]
    torch.manual_seed(1)  # caches holding earlier positions' keys and values
    start = {prefix + n: torch.randn_like(t) if t.is_floating_point() else t.clone() for n, t in lm.named_buffers()}
    results = []
    for program in (off, on):
        states = {k: t.clone() for k, t in start.items()}
        logits = _run(emu, program, [torch.tensor([[7]]), torch.tensor([5])], values, states)
        results.append((logits, states))
    (logits_off, states_off), (logits_on, states_on) = results
    assert all(torch.equal(a, c) for a, c in zip(logits_off, logits_on))
    assert all(torch.equal(states_off[k], states_on[k]) for k in start)
    assert any(not torch.equal(states_on[k], start[k]) for k in start)  # the step wrote the caches


# ---- the GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_the_merged_program_gives_bit_for_bit_the_same_outputs(dtype, monkeypatch):
    monkeypatch.setenv("STITCHCUDA_MATMUL_TUNE", "0")  # the heuristic's algorithm in both programs, not a timed pick
    torch.manual_seed(5)
    model = Branches().eval().to("cuda", dtype)
    x = torch.randn(4, 64, device="cuda", dtype=dtype)
    outs = []
    for merge in (False, True):
        program, _, _ = _lowered(model, (x,), merge)
        assert any(n.startswith("merged_") for n in _names(program)) == merge
        for graphs in (False, True):
            outs.append(program.executor(graphs=graphs).run([x]))
    assert all(torch.equal(a, c) for got in outs[1:] for a, c in zip(outs[0], got))


def test_optimize_reports_how_many_launches_it_merged():
    import stitchcuda

    with override(merge_launches=True):
        fast = stitchcuda.optimize(Branches().eval(), (torch.randn(4, 64),))
    merged = [(title, why) for title, why in fast.report.decisions if "STITCHCUDA_MERGE_LAUNCHES=1" in why]
    # The three second-layer activations, and the first layer's fused kernel beside the softmax (128 threads, no
    # barrier: on the first threads of a 256-thread block).
    assert len(merged) == 1 and merged[0][0] == "5 kernel launches merged into 2", fast.report.decisions
    with override(merge_launches=False):
        fast = stitchcuda.optimize(Branches().eval(), (torch.randn(4, 64),))
    assert not any("MERGE_LAUNCHES" in why for _, why in fast.report.decisions)


@pytest.mark.gpu
def test_on_the_gpu_a_llama_decode_with_merged_launches_gives_the_same_logits_and_tokens(monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("STITCHCUDA_MATMUL_TUNE", "0")  # the heuristic's algorithm in both programs, not a timed pick
    from stitchcuda import StaticCacheGenerator

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().cuda()
    ids = torch.randint(0, 256, (1, 8), device="cuda")
    results = []
    for merge in (False, True):
        with override(merge_launches=merge):
            gen = StaticCacheGenerator.for_transformers(model, batch_size=1, prompt_length=8, max_length=64,
                                                        measure=False, keep_slower=True, compare_compile=False)
        program = gen.decode_module.program
        assert program is not None and any(n.startswith("merged_") for n in _names(program)) == merge
        with torch.no_grad():
            first = gen.prefill(ids)
            second = gen.step(first.argmax(-1))
            tokens = gen.generate(ids, 8)
        results.append((first, second, tokens))
    (f0, s0, t0), (f1, s1, t1) = results
    assert torch.equal(f0, f1) and torch.equal(s0, s1) and torch.equal(t0, t1)


def test_shared_array_extents_are_integer_expressions_of_literals_and_macros_only():
    from stitchcuda.graph.merge_launches import _integer, _static_shared_bytes

    assert (_integer("8 * (32 + 1)"), _integer("7 / 2"), _integer("2u * 4")) == (264, 3, 8)
    assert _integer("n") is None and _integer("__import__('os')") is None and _integer("1 << 4") is None
    source = "#define TILE 32\n#define WARPS (TILE / 8)\n#define F(a) ((a) * 2)\n" \
             "__shared__ float t[TILE][TILE + 1];\n__shared__ long long s[WARPS];\n"
    assert _static_shared_bytes(source) == 32 * 33 * 4 + 4 * 8
    assert _static_shared_bytes(source + "__shared__ float u[F(2)];\n") is None  # a function-like macro
