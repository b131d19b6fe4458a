"""Decoding on a GPU: the optimized prefill and decode programs of the Llama-like static-cache model give eager's
greedy tokens at fp32, update the model's own caches in place, and the decode program replays as one CUDA
graph per step; a transformers causal LM through TransformersStaticCacheLM gives transformers' own greedy
tokens (skipped where transformers is not installed). Through prefill buckets, prompts of every length (one
token, a prime, a bucket's length and one past it) and fewer sequences than the batch give the same.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_decode import LlamaConfig, TinyLlama, eager_greedy  # noqa: E402

from stitchcuda import ProgramModule, StaticCacheGenerator  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _exact_fp32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_the_optimized_generator_gives_eagers_greedy_tokens_and_replays_decode_as_a_graph():
    config = LlamaConfig(vocab=512, dim=128, layers=2, heads=8, kv_heads=2, hidden=256, max_len=64, batch=2)
    torch.manual_seed(0)
    model = TinyLlama(config).eval().cuda()
    torch.manual_seed(0)
    twin = TinyLlama(config).eval().cuda()
    gen = StaticCacheGenerator.optimize(model, batch_size=2, prompt_length=12, max_length=64, keep_slower=True,
                                        compare_compile=False)
    for fast in (gen.prefill_module, gen.decode_module):
        assert fast.report.status == "optimized", fast.report.reason
        assert sorted(fast.program.states) and len(fast.program.states) == 4
    caches = {c.data_ptr() for c in model.caches()}
    assert {c.data_ptr() for c in gen.caches} == caches  # the programs update the model's buffers
    ids = torch.randint(0, config.vocab, (2, 12), device="cuda")
    with torch.no_grad():
        got = gen.generate(ids, 40)
        expected = eager_greedy(twin, ids, 40)
    assert torch.equal(got, expected)
    for mine, theirs in zip(model.caches(), twin.caches()):
        torch.testing.assert_close(mine[:, :, :51], theirs[:, :, :51], rtol=1e-4, atol=1e-4)
    stats = gen.decode_module._runner.executor.stats()
    assert stats["runs"] >= 39 and stats["shared_state_bytes"] == sum(c.numel() * 4 for c in model.caches())
    # A prompt of another length runs the model itself for its prefill; decode still runs the program.
    shorter = ids[:, :7]
    with torch.no_grad():
        assert torch.equal(gen.generate(shorter, 10), eager_greedy(twin, shorter, 10))
    assert gen.prefill_module.other_shape_calls == 1

    # The decode program replayed as one CUDA graph per step (optimize() keeps whichever of replay and direct
    # launches it timed faster; here replay is asked for), over the same caches.
    replayed = ProgramModule(gen.decode_module.program, graphs=True)
    again = StaticCacheGenerator(model, max_length=64, batch_size=2, prefill=gen.prefill_module, decode=replayed,
                                 caches=gen.caches)
    with torch.no_grad():
        assert torch.equal(again.generate(ids, 40), expected)
    stats = replayed.stats()
    assert stats["captures"] == 1 and stats["replays"] == 38 and stats["eager_runs"] == 1, stats


def test_a_transformers_causal_lm_gives_its_own_greedy_tokens():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().cuda()
    gen = StaticCacheGenerator.for_transformers(model, batch_size=1, prompt_length=10, max_length=48, keep_slower=True,
                                                compare_compile=False)
    assert gen.decode_module.report.status == "optimized", gen.decode_module.report.reason
    ids = torch.randint(0, 256, (1, 10), device="cuda")
    with torch.no_grad():
        got = gen.generate(ids, 16)
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                                  do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    assert gen.decode_module._runner.executor.stats()["runs"] >= 15


def test_prefill_buckets_give_eagers_greedy_tokens_at_every_prompt_length():
    """Prompts of 1, 13 (a prime), 16 (a bucket's length), 17 and 31 tokens through the bucket programs of 16 and
    32 positions, right-padded, the logits at each prompt's last token; one sequence of the two beside a dummy row."""
    config = LlamaConfig(vocab=512, dim=128, layers=2, heads=8, kv_heads=2, hidden=256, max_len=64, batch=2)
    torch.manual_seed(0)
    model = TinyLlama(config).eval().cuda()
    torch.manual_seed(0)
    twin = TinyLlama(config).eval().cuda()
    gen = StaticCacheGenerator.optimize(model, batch_size=2, max_length=64, prompt_lengths=32, keep_slower=True,
                                        compare_compile=False)
    assert sorted(gen.prefill_buckets) == [16, 32]
    for fast in (*gen.prefill_buckets.values(), gen.decode_module):
        assert fast.report.status == "optimized", fast.report.reason
    assert {c.data_ptr() for c in gen.caches} == {c.data_ptr() for c in model.caches()}
    with torch.no_grad():
        for tokens in (1, 13, 16, 17, 31):
            ids = torch.randint(0, config.vocab, (2, tokens), device="cuda")
            assert torch.equal(gen.generate(ids, 24), eager_greedy(twin, ids, 24)), tokens
        for bucket in gen.prefill_buckets.values():
            assert bucket.other_shape_calls == 0  # every prompt ran a program
        single = TinyLlama(dataclasses.replace(config, batch=1)).eval().cuda()
        single.load_state_dict(twin.state_dict())
        ids = torch.randint(0, config.vocab, (1, 13), device="cuda")
        assert torch.equal(gen.generate(ids, 24), eager_greedy(single, ids, 24))


def test_a_transformers_causal_lm_through_prefill_buckets_gives_its_own_greedy_tokens():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().cuda()
    gen = StaticCacheGenerator.for_transformers(model, batch_size=1, max_length=48, prompt_lengths=(12,),
                                                keep_slower=True, compare_compile=False)
    (bucket,) = gen.prefill_buckets.values()
    assert bucket.report.status == "optimized", bucket.report.reason
    with torch.no_grad():
        for tokens in (5, 11, 16):
            ids = torch.randint(0, 256, (1, tokens), device="cuda")
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                      do_sample=False, pad_token_id=0)
            assert torch.equal(gen.generate(ids, 12), expected), tokens
    assert bucket.other_shape_calls == 0
