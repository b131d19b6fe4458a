"""Prefill buckets and partial batches of the StaticCacheGenerator: a prompt of any length runs the smallest
power-of-two bucket at least as long, right-padded, with the logits taken at its last real position, and gives
eager's greedy tokens (lengths 1, a prime, a bucket boundary and one past it) because the padding is written
but never read; fewer sequences than the cache's batch run beside dummy rows. The Llama-like model of
test_decode and a transformers Llama over its StaticCache, run by the model itself, by optimize()'s modules
(planned on the CPU) and as lowered programs in the CUDA emulator; a model that is not causal in the positions
is refused, and a generator with buckets does not save.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, unavailable  # noqa: E402
from test_decode import LlamaConfig, Recorder, TinyLlama, eager_greedy, tiny_llama  # noqa: E402
from test_decode_capture import lowered  # noqa: E402  (capture, plan and lower on the CPU)
from test_graph_emulated import run_program  # noqa: E402  (the program's steps on the CPU)

import stitchcuda  # noqa: E402
from stitchcuda import InvalidArgumentError, StaticCacheGenerator, TransformersStaticCacheLM  # noqa: E402
from stitchcuda.graph.decode import (BUCKET_FLOOR, LastPositionLogits, bucket_lengths,  # noqa: E402
                                     check_padded_prefill, prefill_model)

emulated = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")

# Prompt lengths around the buckets 8 and 16 of a 16-position cache: one token, a prime, a bucket's
# boundary and one past it.
LENGTHS = (1, 7, 8, 9)


def bucketed(model, buckets=(8, 16), batch=2, max_length=16, record=False):
    """A generator whose buckets run the model itself (through LastPositionLogits), recording the calls."""
    steps = {b: Recorder(LastPositionLogits(model)) if record else LastPositionLogits(model) for b in buckets}
    return StaticCacheGenerator(model, max_length=max_length, batch_size=batch, caches=model.caches(), buckets=steps)


class RecordLast(Recorder):
    def __call__(self, ids, positions, last):
        self.calls.append((tuple(ids.shape), positions.tolist(), last.tolist()))
        return self.model(ids, positions, last)


def hf_llama(vocab=128, layers=2, hidden=64, seed=0):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def hf_greedy(model, ids, new):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)


class SeesTheWholeCall(TinyLlama):
    """Planted: every token of a call attends to every position the call writes (a prefix-LM's prompt), so
    the padding of a bucket reaches the prompt's tokens."""

    def forward(self, input_ids, cache_position):
        x = self.embed(input_ids)
        freqs = cache_position.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        seen = torch.arange(self.c.max_len, device=input_ids.device)[None, :] <= cache_position.max()
        mask = seen.expand(len(cache_position), -1)
        for blk in self.blocks:
            x = blk(x, cos, sin, cache_position, mask[None, None])
        return self.head(self.norm(x))


# ---- the buckets ---------------------------------------------------------------------------------------------

def test_bucket_lengths_are_powers_of_two_up_to_the_longest_prompt_and_capped_at_the_cache():
    assert bucket_lengths(300, 2048) == [16, 32, 64, 128, 256, 512]
    assert bucket_lengths(16, 2048) == [16] and bucket_lengths(17, 2048) == [16, 32]
    assert bucket_lengths(5, 64) == [BUCKET_FLOOR]  # a short prompt pads to the smallest bucket
    assert bucket_lengths(100, 120) == [16, 32, 64, 120]  # the last bucket never passes the cache
    assert bucket_lengths([1, 7, 8, 9], 16) == [1, 8, 16]  # the lengths to serve: the bucket of each
    assert bucket_lengths((512, 2048), 4096) == [512, 2048]
    for bad, message in ((0, "at least 1 and below max_length"), (16, "below max_length \\(16\\)"),
                         ([3, 16], "each of prompt_lengths"), ([], "is empty"), (2.5, "an int")):
        with pytest.raises(InvalidArgumentError, match=message):
            bucket_lengths(bad, 16)


@pytest.mark.parametrize("tokens", LENGTHS)
def test_a_prompt_runs_the_smallest_bucket_padded_and_gives_eagers_greedy_tokens(tokens):
    model = tiny_llama()
    gen = bucketed(model)
    for length, step in gen.prefill_buckets.items():
        gen.prefill_buckets[length] = RecordLast(step)
    ids = torch.randint(0, 96, (2, tokens))
    with torch.no_grad():
        got = gen.generate(ids, 5)
        expected = eager_greedy(tiny_llama(), ids, 5)
    assert torch.equal(got, expected)
    bucket = 8 if tokens <= 8 else 16
    (call,) = gen.prefill_buckets[bucket].calls  # one call of the bucket: the prompt and its padding
    assert call == ((2, bucket), list(range(bucket)), [tokens - 1])
    assert all(not s.calls for b, s in gen.prefill_buckets.items() if b != bucket)
    assert gen.position == tokens + 4


def test_the_padding_is_written_but_never_read():
    """After a prompt of 5 tokens padded to 8, positions 5..7 hold the padding's keys and values. Replaced by
    large garbage, they change no logit: each step writes its position before its attention reads it, and the
    mask keeps the positions up to its own."""
    model = tiny_llama()
    gen = bucketed(model)
    ids = torch.randint(0, 96, (2, 5))
    with torch.no_grad():
        first = gen.prefill(ids)
        assert all(int(torch.count_nonzero(c[:, :, 5:8])) > 0 for c in model.caches())  # written
        assert all(int(torch.count_nonzero(c[:, :, 8:])) == 0 for c in model.caches())
        garbage = torch.Generator().manual_seed(3)
        for cache in model.caches():
            cache[:, :, 5:].copy_(1e4 * torch.randn(cache[:, :, 5:].shape, generator=garbage))
        token = first.argmax(-1)
        steps = [gen.step(token)]
        for _ in range(3):
            steps.append(gen.step(steps[-1].argmax(-1)))
        twin = tiny_llama()
        expected = eager_greedy(twin, ids, 5)
    assert torch.equal(token, expected[:, 5])
    assert torch.equal(torch.stack([s.argmax(-1) for s in steps], 1), expected[:, 6:])
    assert torch.isfinite(torch.stack(steps)).all()
    for twin_cache, cache in zip(twin.caches(), model.caches()):  # the positions the steps wrote: eager's
        torch.testing.assert_close(cache[:, :, :9], twin_cache[:, :, :9], rtol=1e-5, atol=1e-5)


def test_a_prompt_longer_than_every_bucket_prefills_with_the_model_itself(caplog):
    model = tiny_llama()
    gen = bucketed(model, buckets=(4, 8))
    prefill = Recorder(model)
    gen.prefill_module = prefill
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad(), caplog.at_level("WARNING"):
        got = gen.generate(ids, 4)
        gen.generate(ids, 4)
    assert torch.equal(got, eager_greedy(tiny_llama(), ids, 4))
    assert prefill.calls == [((2, 11), list(range(11)))] * 2
    assert sum("longer than the largest prefill bucket (8)" in r.getMessage() for r in caplog.records) == 1


def test_bucket_programs_beyond_the_resident_ones_give_their_working_memory_back():
    class Releasing(LastPositionLogits):
        released = 0

        def release(self):
            self.released += 1

    model = tiny_llama()
    steps = {b: Releasing(model) for b in (1, 2, 4, 8, 16)}
    gen = StaticCacheGenerator(model, max_length=16, batch_size=2, buckets=steps)
    with torch.no_grad():
        for tokens in (1, 2, 3, 5, 9, 1):  # buckets 1, 2, 4, 8, 16, then 1 again
            gen.prefill(torch.zeros(2, tokens, dtype=torch.long))
    # Four stay resident (MAX_RESIDENT): the fifth bucket's use released bucket 1, bucket 1's return bucket 2.
    assert [steps[b].released for b in (1, 2, 4, 8, 16)] == [1, 1, 0, 0, 0]
    with pytest.raises(InvalidArgumentError, match="a prefill bucket of 32 tokens does not fit the cache of 16"):
        StaticCacheGenerator(model, max_length=16, buckets={32: steps[1]})


# ---- fewer sequences than the batch ---------------------------------------------------------------------------

def test_fewer_sequences_than_the_batch_run_beside_dummy_rows_and_come_back_alone():
    model = tiny_llama()
    single = TinyLlama(LlamaConfig(batch=1)).eval()
    single.load_state_dict(model.state_dict())  # the same weights, a cache for one sequence
    ids = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        expected = eager_greedy(single, ids, 6)
        assert torch.equal(bucketed(model).generate(ids, 6), expected)
        plain = StaticCacheGenerator(model, max_length=16, batch_size=2, caches=model.caches())
        assert torch.equal(plain.generate(ids, 6), expected)
        assert plain.prefill(ids).shape == (1, 96) and plain.step(expected[:, 7]).shape == (1, 96)
    with pytest.raises(InvalidArgumentError, match="step\\(\\) got 2 tokens but prefill\\(\\) started 1 sequences"):
        plain.step(torch.zeros(2, dtype=torch.long))
    with pytest.raises(InvalidArgumentError, match=r"a batch of 3 but the cache was built for 2: pass 1 to 2 "
                                                   r"sequences .*split the batch, or build a generator with batch_size=3"):
        plain.generate(torch.zeros(3, 4, dtype=torch.long), 2)


def test_an_eos_ends_a_partial_batch_once_its_real_sequences_produced_it():
    model = tiny_llama()
    ids = torch.randint(0, 96, (1, 4))
    with torch.no_grad():
        free = StaticCacheGenerator(model, max_length=16, batch_size=2).generate(ids, 8)
        eos = int(free[0, 4 + 1])
        stopped = StaticCacheGenerator(model, max_length=16, batch_size=2).generate(ids, 8, eos_token_id=eos)
    first = int((free[0, 4:] == eos).nonzero()[0])
    assert stopped.shape == (1, 4 + first + 1)  # the dummy row never holds the loop open
    assert torch.equal(stopped[0], free[0, :4 + first + 1])


# ---- what optimize() builds, and what it refuses -------------------------------------------------------------

def test_optimize_builds_a_prefill_per_bucket_and_generates_eagers_tokens_at_every_length():
    model = tiny_llama()
    gen = StaticCacheGenerator.optimize(model, batch_size=2, max_length=16, prompt_lengths=(5, 9), measure=False)
    assert sorted(gen.prefill_buckets) == [8, 16] and gen.prefill_module is model
    for module in (*gen.prefill_buckets.values(), gen.decode_module):
        assert isinstance(module, stitchcuda.OptimizedModule)
    bucket = gen.prefill_buckets[8]
    assert isinstance(bucket.original, LastPositionLogits) and bucket.original.model is model
    with torch.no_grad():
        for tokens in LENGTHS:
            ids = torch.randint(0, 96, (2, tokens))
            assert torch.equal(gen.generate(ids, 4), eager_greedy(tiny_llama(), ids, 4)), tokens
        ids = torch.randint(0, 96, (1, 9))  # one sequence of the two
        single = TinyLlama(LlamaConfig(batch=1)).eval()
        single.load_state_dict(model.state_dict())
        assert torch.equal(gen.generate(ids, 4), eager_greedy(single, ids, 4))
    with pytest.raises(InvalidArgumentError, match="pass prompt_lengths= .* or prompt_length= .*one of the two"):
        StaticCacheGenerator.optimize(model, batch_size=2, max_length=16)
    with pytest.raises(InvalidArgumentError, match="one of the two"):
        StaticCacheGenerator.optimize(model, batch_size=2, max_length=16, prompt_length=4, prompt_lengths=8)


def test_a_model_not_causal_in_the_positions_is_refused_buckets_and_keeps_the_exact_length_prefill():
    torch.manual_seed(0)
    model = SeesTheWholeCall().eval()
    with pytest.raises(InvalidArgumentError, match=r"SeesTheWholeCall is not exact under a padded prefill: a prompt "
                                                   r"of 4 tokens padded to 8 gives logits .* away .*prompt_length="):
        StaticCacheGenerator.optimize(model, batch_size=2, max_length=16, prompt_lengths=(5, 9), measure=False)
    check_padded_prefill(tiny_llama(), LastPositionLogits(tiny_llama()), [8, 16], batch_size=2, max_length=16)
    gen = StaticCacheGenerator.optimize(model, batch_size=2, max_length=16, prompt_length=6, measure=False)
    ids = torch.randint(0, 96, (2, 6))
    torch.manual_seed(0)
    twin = SeesTheWholeCall().eval()
    with torch.no_grad():
        assert torch.equal(gen.generate(ids, 4), eager_greedy(twin, ids, 4))


def test_a_generator_with_buckets_does_not_save_and_says_how_to_build_one_that_does(tmp_path):
    model = tiny_llama()
    gen = StaticCacheGenerator(model, max_length=16, batch_size=2, decode=SimpleNamespace(program=None),
                               buckets={8: SimpleNamespace(program=None), 16: SimpleNamespace(program=None)})
    with pytest.raises(InvalidArgumentError, match=r"prefills through 2 bucket\(s\) of 8, 16 tokens .* one prefill "
                                                   r"for prompts of exactly its length: .*prompt_length=N"):
        gen.save(tmp_path / "buckets.stitch")
    assert not (tmp_path / "buckets.stitch").exists()


# ---- transformers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens", LENGTHS)
def test_a_transformers_llama_through_buckets_gives_its_own_greedy_tokens(tokens):
    model = hf_llama()
    lm = TransformersStaticCacheLM(model, batch_size=1, max_length=20)
    assert prefill_model(lm) is lm  # its LM head reads the last position's hidden state alone
    gen = StaticCacheGenerator(lm, max_length=20, batch_size=1, buckets={8: lm, 16: lm})
    ids = torch.randint(0, 128, (1, tokens))
    with torch.no_grad():
        logits = lm(torch.cat([ids, ids[:, -1:].expand(-1, 16 - tokens)], 1), torch.arange(16), torch.tensor([tokens - 1]))
        assert logits.shape == (1, 1, 128)
        got = gen.generate(ids, 4)
        expected = hf_greedy(model, ids, 4)
    assert torch.equal(got, expected)


def test_a_padded_prefill_moves_a_transformers_layers_write_counter_back_to_the_prompts_end():
    model = hf_llama(layers=1)
    lm = TransformersStaticCacheLM(model, batch_size=1, max_length=20)
    assert lm._counters == ["layer0_cumulative_length"]  # transformers 5 writes where the counter says
    gen = StaticCacheGenerator(lm, max_length=20, batch_size=1, buckets={16: lm})
    with torch.no_grad():
        gen.prefill(torch.randint(0, 128, (1, 5)))
    assert int(lm.layer0_cumulative_length) == 5  # the bucket wrote 16; the next token goes at 5
    with torch.no_grad():  # without it, the step would write at 16, a position its mask hides
        lm.layer0_cumulative_length.fill_(16)
        wrong = gen.step(torch.tensor([3]))
        gen.prefill(torch.randint(0, 128, (1, 5)))
        assert not torch.equal(wrong, gen.step(torch.tensor([3])))


def test_for_transformers_with_buckets_plans_them_and_refuses_a_sliding_window_cache():
    model = hf_llama(layers=1)
    gen = StaticCacheGenerator.for_transformers(model, batch_size=1, max_length=24, prompt_lengths=(6, 9),
                                                measure=False)
    assert sorted(gen.prefill_buckets) == [8, 16]
    with torch.no_grad():
        for tokens in (3, 8, 9):
            ids = torch.randint(0, 128, (1, tokens))
            assert torch.equal(gen.generate(ids, 5), hf_greedy(model, ids, 5)), tokens
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    mistral = transformers.MistralForCausalLM(config).eval()
    with pytest.raises(InvalidArgumentError, match="layer 0 is a StaticSlidingWindowLayer.*prompt_length="):
        StaticCacheGenerator.for_transformers(mistral, batch_size=1, max_length=16, prompt_lengths=8, measure=False)


# ---- the programs on the CPU ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("emulated_buckets"))


@emulated
def test_bucket_programs_in_the_emulator_give_eagers_greedy_tokens_at_every_length(emu):
    model = tiny_llama()
    at_last = LastPositionLogits(model)
    states = {f"model.{name}": t for name, t in model.named_buffers()}

    def run(program, values, names):
        return lambda *inputs: run_program(emu, program, [t.clone() for t in inputs], values, names)[0]

    buckets = {}
    for bucket in (8, 16):
        _, program, values = lowered(at_last, (torch.zeros(2, bucket, dtype=torch.long), torch.arange(bucket),
                                               torch.tensor([bucket - 1])))
        assert [b["shape"] for b in program.buffers if b["role"] == "output"] == [[2, 1, 96]]
        buckets[bucket] = run(program, values, states)
    _, decode, decode_values = lowered(model, (torch.zeros(2, 1, dtype=torch.long), torch.tensor([8])))
    gen = StaticCacheGenerator(model, max_length=16, batch_size=2, decode=run(decode, decode_values,
                                                                              dict(model.named_buffers())),
                               caches=model.caches(), buckets=buckets)
    for tokens in LENGTHS:
        ids = torch.randint(0, 96, (2, tokens))
        got = gen.generate(ids, 4)
        with torch.no_grad():
            expected = eager_greedy(tiny_llama(), ids, 4)
        assert torch.equal(got, expected), tokens
    single = TinyLlama(LlamaConfig(batch=1)).eval()
    single.load_state_dict(model.state_dict())
    ids = torch.randint(0, 96, (1, 5))
    with torch.no_grad():
        expected = eager_greedy(single, ids, 4)
    assert torch.equal(gen.generate(ids, 4), expected)  # one sequence beside a dummy row


@emulated
def test_a_transformers_bucket_program_applies_the_lm_head_to_one_position_and_gives_its_tokens(emu):
    model = hf_llama(vocab=256)
    lm = TransformersStaticCacheLM(model, batch_size=1, max_length=24)
    graph, prefill, prefill_values = lowered(lm, (torch.zeros(1, 16, dtype=torch.long), torch.arange(16),
                                                  torch.tensor([15])))
    _, decode, decode_values = lowered(lm, (torch.zeros(1, 1, dtype=torch.long), torch.tensor([16])))
    # The head's product is [1, 1, 256]: no buffer holds the bucket's logits, [1, 16, 256].
    assert [b["shape"] for b in prefill.buffers if b["role"] == "output"] == [[1, 1, 256]]
    assert not any(b["shape"][-2:] == [16, 256] for b in prefill.buffers)
    prefix = next(iter(graph.state_buffers.values())).rpartition("layer")[0]
    states = {prefix + name: t for name, t in lm.named_buffers()}

    def run(program, values):
        return lambda *inputs: run_program(emu, program, [t.clone() for t in inputs], values, states)[0]

    gen = StaticCacheGenerator(lm, max_length=24, batch_size=1, decode=run(decode, decode_values),
                               buckets={16: run(prefill, prefill_values)})
    for tokens in (9, 16):
        ids = torch.randint(0, 256, (1, tokens))
        got = gen.generate(ids, 5)
        with torch.no_grad():
            assert torch.equal(got, hf_greedy(model, ids, 5)), tokens
