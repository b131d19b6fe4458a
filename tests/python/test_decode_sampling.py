"""Sampling in StaticCacheGenerator.generate (temperature, top-k, top-p from a seeded torch.Generator) against an
eager loop drawing with the same function, the distributions it draws from, its argument checks, and the eos
check that reads the device every EOS_CHECK_EVERY tokens yet ends exactly where the last sequence did; the C++
Generator's choice of tokens (stitchcuda::torch::next_tokens and SamplingOptions' checks, on the CPU through the
bindings) drawing Python's tokens from the same seed, and on a GPU its token loop of a saved pair doing so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_decode import LlamaConfig, TinyLlama, eager_greedy, tiny_llama  # noqa: E402  (a small static-cache LM)

import stitchcuda  # noqa: E402
from stitchcuda import InvalidArgumentError, StaticCacheGenerator, _C  # noqa: E402
from stitchcuda.graph.decode import EOS_CHECK_EVERY, next_tokens  # noqa: E402

VOCAB = 96


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def eager_sampled(model, ids: torch.Tensor, new: int, **options) -> torch.Tensor:
    """The reference loop, written out: the model itself, then next_tokens over its logits at each step."""
    for c in model.caches():
        c.zero_()
    logits = model(ids, torch.arange(ids.shape[1]))
    out = [ids, next_tokens(logits[:, -1], do_sample=True, **options)[:, None]]
    for pos in range(ids.shape[1], ids.shape[1] + new - 1):
        logits = model(out[-1], torch.tensor([pos]))
        out.append(next_tokens(logits[:, -1], do_sample=True, **options)[:, None])
    return torch.cat(out, dim=1)


def long_llama(seed: int = 0) -> TinyLlama:
    """The tests' Llama-like model with a cache of 48 positions (eos runs past two checks)."""
    torch.manual_seed(seed)
    return TinyLlama(LlamaConfig(max_len=48)).eval()


def generator_of(model) -> StaticCacheGenerator:
    return StaticCacheGenerator(model, max_length=16, batch_size=2, caches=model.caches())


# ---- the token loop ------------------------------------------------------------------------------------------

def test_a_seeded_sample_is_reproducible_and_draws_what_an_eager_loop_draws():
    model, twin = tiny_llama(), tiny_llama()
    gen = generator_of(model)
    ids = torch.randint(0, VOCAB, (2, 4), generator=seeded(1))
    options = dict(temperature=0.8, top_k=20, top_p=0.9)
    with torch.no_grad():
        first = gen.generate(ids, 10, do_sample=True, generator=seeded(5), **options)
        again = gen.generate(ids, 10, do_sample=True, generator=seeded(5), **options)
        expected = eager_sampled(twin, ids, 10, generator=seeded(5), **options)
        other = gen.generate(ids, 10, do_sample=True, generator=seeded(6), **options)
        greedy = gen.generate(ids, 10)
    assert first.shape == (2, 14)
    assert torch.equal(first, again)
    assert torch.equal(first, expected)
    assert not torch.equal(first, other)  # another seed, other draws: the tokens are sampled
    assert not torch.equal(first, greedy)
    assert torch.equal(greedy, eager_greedy(twin, ids, 10))  # greedy stays the default


def test_top_k_of_one_and_a_tiny_top_p_are_greedy():
    model = tiny_llama()
    gen = generator_of(model)
    ids = torch.randint(0, VOCAB, (2, 5), generator=seeded(2))
    with torch.no_grad():
        greedy = gen.generate(ids, 8)
        assert torch.equal(gen.generate(ids, 8, do_sample=True, top_k=1, generator=seeded(0)), greedy)
        assert torch.equal(gen.generate(ids, 8, do_sample=True, top_p=1e-6, temperature=3.0, generator=seeded(0)),
                           greedy)
        assert torch.equal(gen.generate(ids, 8, do_sample=False), greedy)


def test_fewer_sequences_than_the_batch_sample_alone_and_reproducibly():
    model = tiny_llama()
    gen = generator_of(model)
    ids = torch.randint(0, VOCAB, (1, 3), generator=seeded(3))
    with torch.no_grad():
        one = gen.generate(ids, 6, do_sample=True, generator=seeded(9))
        assert one.shape == (1, 9) and torch.equal(one[:, :3], ids)
        assert torch.equal(gen.generate(ids, 6, do_sample=True, generator=seeded(9)), one)


def with_eos(free: torch.Tensor, prompt: int, eos: int) -> torch.Tensor:
    """What generate(eos_token_id=eos) returns given the run without it: each row's tokens up to its first
    eos, then eos, the columns cut after the first where every row has ended."""
    new = free[:, prompt:].clone()
    for row in new:
        hit = (row == eos).nonzero()
        if len(hit):
            row[int(hit[0]):] = eos
    ended = (new == eos).all(0).nonzero()
    end = int(ended[0]) + 1 if len(ended) else new.shape[1]
    return torch.cat([free[:, :prompt], new[:, :end]], dim=1)


def ending_token(new: torch.Tensor) -> int:
    """A token both rows drew, the one whose later first draw comes soonest (the run ends early); or, where
    they drew none alike, the first row's second token (that row ends, the other runs to the end)."""
    first = [{int(t): i for i, t in reversed(list(enumerate(row)))} for row in new]
    common = set(first[0]) & set(first[1])
    return min(common, key=lambda t: max(f[t] for f in first)) if common else int(new[0, 1])


@pytest.mark.parametrize("new", [6, EOS_CHECK_EVERY + 9, 2 * EOS_CHECK_EVERY + 3])
def test_eos_ends_each_row_and_the_result_where_the_last_row_ended(new):
    # A row's draws do not depend on the other rows' logits (multinomial's exponential draws fill the batch in
    # order), so the run with eos equals the run without it with each row cut at its first eos.
    model = long_llama()
    gen = StaticCacheGenerator(model, max_length=48, batch_size=2)
    ids = torch.randint(0, VOCAB, (2, 3), generator=seeded(4))
    with torch.no_grad():
        free = gen.generate(ids, new, do_sample=True, temperature=1.5, top_k=8, generator=seeded(11))
        eos = ending_token(free[:, 3:])
        stopped = gen.generate(ids, new, eos, do_sample=True, temperature=1.5, top_k=8, generator=seeded(11))
        greedy_free = gen.generate(ids, new)
        greedy_eos = int(greedy_free[0, 4])
        greedy_stopped = gen.generate(ids, new, greedy_eos)
    assert torch.equal(stopped, with_eos(free, 3, eos))
    assert (stopped[:, 3:-1] == eos).any()  # a row ended before the last column and shows eos after
    assert torch.equal(greedy_stopped, with_eos(greedy_free, 3, greedy_eos))
    assert greedy_stopped.shape[1] <= greedy_free.shape[1]


def test_eos_steps_past_the_end_only_up_to_the_next_check():
    model = long_llama()
    calls = []

    def decode(ids, positions):
        calls.append(int(positions))
        return model(ids, positions)

    gen = StaticCacheGenerator(model, max_length=48, batch_size=2, decode=decode)
    ids = torch.randint(0, VOCAB, (2, 3), generator=seeded(5))
    with torch.no_grad():
        eos = int(gen.generate(ids, 1)[0, 3])  # the first row's first token ends it at once
        calls.clear()
        out = gen.generate(ids[:1], 40, eos)
    assert out.shape == (1, 4) and int(out[0, 3]) == eos
    assert len(calls) == EOS_CHECK_EVERY - 1  # the steps queued before the flags were read


# ---- the sampling function over fixed logits -----------------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
DRAWS = 40000


def frequencies(**options) -> torch.Tensor:
    rows = LOGITS.expand(DRAWS, -1)
    tokens = next_tokens(rows, do_sample=True, generator=seeded(123), **options)
    return torch.bincount(tokens, minlength=len(LOGITS)).double() / DRAWS


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_distribution_drawn_from(temperature):
    got = frequencies(temperature=temperature)
    expected = (LOGITS.double() / temperature).softmax(-1)
    # 40,000 draws: a frequency's standard deviation is at most 0.0025; 0.012 is beyond 4.5 of them.
    assert (got - expected).abs().max() < 0.012, (got, expected)


def test_a_lower_temperature_concentrates_the_draws():
    cold, hot = frequencies(temperature=0.5), frequencies(temperature=2.0)
    assert cold[0] > 0.75 and hot[0] < 0.45
    assert hot[4] > 5 * cold[4]


def test_top_k_and_top_p_keep_the_likeliest_and_renormalize():
    probs = LOGITS.double().softmax(-1)  # 0.55, 0.20, 0.12, 0.07, 0.03
    top2 = frequencies(top_k=2)
    assert top2[2:].sum() == 0
    assert (top2[:2] - probs[:2] / probs[:2].sum()).abs().max() < 0.012
    # The smallest set reaching 0.8: the first three (0.55 + 0.20 < 0.8 <= 0.55 + 0.20 + 0.12).
    nucleus = frequencies(top_p=0.8)
    assert nucleus[3:].sum() == 0 and (nucleus[:3] - probs[:3] / probs[:3].sum()).abs().max() < 0.012
    assert frequencies(top_p=0.5)[1:].sum() == 0  # the likeliest alone reaches 0.5
    assert torch.equal(frequencies(top_p=1.0), frequencies())


def test_sampling_runs_in_fp32_over_half_precision_logits():
    rows = LOGITS.to(torch.bfloat16).expand(8, -1)
    tokens = next_tokens(rows, do_sample=True, top_p=0.9, generator=seeded(0))
    assert tokens.dtype == torch.int64 and tokens.shape == (8,)
    assert torch.equal(next_tokens(rows), torch.zeros(8, dtype=torch.int64))


# ---- argument checks -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    (dict(do_sample=True, temperature=0), r"temperature of 0 is greedy decoding: pass do_sample=False"),
    (dict(do_sample=True, temperature=-0.5), r"temperature must be above 0"),
    (dict(do_sample=True, temperature=float("nan")), r"temperature must be a finite number"),
    (dict(do_sample=True, top_k=0), r"top_k must be an int >= 1"),
    (dict(do_sample=True, top_k=2.5), r"top_k must be an int >= 1"),
    (dict(do_sample=True, top_p=0), r"top_p must be a number in \(0, 1\]"),
    (dict(do_sample=True, top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    (dict(temperature=0.7), r"do_sample=False decodes greedily .*pass do_sample=True"),
    (dict(top_k=5), r"do_sample=False decodes greedily"),
    (dict(do_sample=True, generator="seed"), r"generator must be a torch.Generator"),
    (dict(eos_token_id=-1), r"eos_token_id is one token id"),
])
def test_unusable_arguments_are_refused_before_anything_runs(options, message):
    model = tiny_llama()
    calls = []
    gen = StaticCacheGenerator(model, max_length=16, batch_size=2, prefill=lambda *a: calls.append(a))
    with pytest.raises(InvalidArgumentError, match=message):
        gen.generate(torch.zeros(2, 3, dtype=torch.long), 4, **options)
    assert calls == []


@pytest.mark.gpu
def test_a_generator_of_another_device_is_refused():
    gen = StaticCacheGenerator(tiny_llama(), max_length=16, batch_size=2)
    with pytest.raises(InvalidArgumentError, match=r"draw from torch.Generator\(device='cpu'\)"):
        gen.generate(torch.zeros(2, 3, dtype=torch.long), 4, do_sample=True,
                     generator=torch.Generator(device="cuda"))


# ---- the C++ Generator's choice of tokens --------------------------------------------------------------------

def cpp_next_tokens(logits: torch.Tensor, **options) -> torch.Tensor:
    return _C.program.next_tokens(logits, _C.program.SamplingOptions(**options))


@pytest.mark.parametrize("options", [{}, dict(do_sample=True), dict(do_sample=True, temperature=0.6),
                                     dict(do_sample=True, top_k=5), dict(do_sample=True, top_p=0.8),
                                     dict(do_sample=True, temperature=1.4, top_k=12, top_p=0.9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_draws_pythons_tokens_from_the_same_seed(options, dtype):
    logits = (2 * torch.randn(64, 50, generator=seeded(0))).to(dtype)
    got = cpp_next_tokens(logits, seed=1234, **options)
    assert got.dtype == torch.int64 and got.shape == (64,)
    assert torch.equal(got, next_tokens(logits, generator=seeded(1234), **options))
    if options:  # a sample: another seed draws other tokens
        assert not torch.equal(cpp_next_tokens(logits, seed=1235, **options), got)


@pytest.mark.parametrize("options, message", [
    (dict(do_sample=True, temperature=0.0), r"temperature of 0 is greedy decoding: set do_sample=false"),
    (dict(do_sample=True, temperature=-1.0), r"temperature must be above 0 .*not -1"),
    (dict(do_sample=True, temperature=float("inf")), r"temperature must be a finite number"),
    (dict(do_sample=True, top_k=-2), r"top_k must be >= 1 .* or 0 \(all\), not -2"),
    (dict(do_sample=True, top_p=0.0), r"top_p must be a number in \(0, 1\]"),
    (dict(do_sample=True, top_p=1.01), r"top_p must be a number in \(0, 1\].*not 1.01"),
    (dict(temperature=0.5), r"do_sample=false decodes greedily .*set do_sample to sample"),
    (dict(top_p=0.9), r"do_sample=false decodes greedily"),
    (dict(eos_token_id=-3), r"eos_token_id is one token id \(>= 0\) or -1 \(none\), not -3"),
])
def test_cpp_sampling_options_are_checked_with_the_fix_named(options, message):
    with pytest.raises(InvalidArgumentError, match=message):
        _C.program.SamplingOptions(**options).check()
    with pytest.raises(InvalidArgumentError, match=message):
        cpp_next_tokens(torch.zeros(2, 8), **options)


def test_cpp_next_tokens_takes_floating_point_rows_of_logits():
    _C.program.SamplingOptions(do_sample=True, temperature=0.5, top_k=3, top_p=0.5, eos_token_id=7).check()
    with pytest.raises(InvalidArgumentError, match=r"floating-point \[rows, vocab\] tensor, not Long \[2, 8\]"):
        cpp_next_tokens(torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(InvalidArgumentError, match=r"floating-point \[rows, vocab\] tensor, not Float \[8\]"):
        cpp_next_tokens(torch.zeros(8), do_sample=True)


@pytest.mark.gpu
def test_the_cpp_token_loop_samples_the_python_generators_tokens_and_stops_at_eos_alike(tmp_path):
    model = long_llama().cuda()
    gen = StaticCacheGenerator.optimize(model, batch_size=2, prompt_length=5, max_length=48)
    for module in (gen.prefill_module, gen.decode_module):
        assert module.report.status == "optimized", module.report.reason
    path = tmp_path / "llama.decode.stitch"
    gen.save(path)
    loaded = stitchcuda.load(path)
    ids = torch.randint(0, VOCAB, (2, 5), generator=seeded(6)).cuda()
    options = dict(do_sample=True, temperature=1.5, top_k=8, top_p=0.95)

    def python(new, eos=None, seed=3):
        with torch.no_grad():
            return gen.generate(ids, new, eos, generator=torch.Generator(device="cuda").manual_seed(seed), **options)

    free = python(40)
    for _ in range(2):  # a call captures the decode step, the next replays it: one seed, one answer
        assert torch.equal(loaded.generate(ids, 40, seed=3, **options), free)
    assert not torch.equal(loaded.generate(ids, 40, seed=4, **options), free)
    eos = ending_token(free[:, 5:].cpu())
    stopped = loaded.generate(ids, 40, eos, seed=3, **options)
    assert torch.equal(stopped, python(40, eos)) and torch.equal(stopped, with_eos(free, 5, eos))
    with torch.no_grad():
        greedy = gen.generate(ids, 12)
    assert torch.equal(loaded.generate(ids, 12), greedy)  # greedy, as before
    with pytest.raises(InvalidArgumentError, match=r"eos_token_id 96 is past the vocabulary 0\.\.95"):
        loaded._g.generate(ids, 4, 0, _C.program.SamplingOptions(eos_token_id=96))
    with pytest.raises(InvalidArgumentError, match=r"temperature of 0 is greedy decoding"):
        loaded.generate(ids, 4, do_sample=True, temperature=0)
