"""A prefill + decode pair saved as one file and read back: StaticCacheGenerator.save over the programs lowered
from the Llama-like model of test_decode (on the CPU: both programs, their weights stored once, the caches as
states paired by name, the cache length), the pair's checks on saving, and, on a GPU, the C++ token loop of
the saved file (stitchcuda.load) giving the Python generator's greedy tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_decode import LlamaConfig, TinyLlama, tiny_llama  # noqa: E402  (the Llama-like static-cache model)
from test_decode_capture import lowered  # noqa: E402  (capture, plan and lower on the CPU)

import stitchcuda  # noqa: E402
from stitchcuda import InvalidArgumentError, StaticCacheGenerator  # noqa: E402
from stitchcuda.graph.module import NoProgramError  # noqa: E402
from stitchcuda.program import DecodePrograms, LoadedGenerator  # noqa: E402

PROMPT, MAX_LEN, BATCH = 5, 16, 2


def programs_of(model, batch: int = BATCH):
    _, prefill, _ = lowered(model, (torch.zeros(batch, PROMPT, dtype=torch.long), torch.arange(PROMPT)))
    _, decode, _ = lowered(model, (torch.zeros(batch, 1, dtype=torch.long), torch.tensor([PROMPT])))
    return prefill, decode


def saved_generator(model, prefill, decode) -> StaticCacheGenerator:
    """A generator whose modules carry the lowered programs (what StaticCacheGenerator.optimize's modules
    carry on a GPU), for save() alone."""
    return StaticCacheGenerator(model, max_length=MAX_LEN, batch_size=BATCH, prefill=SimpleNamespace(program=prefill),
                                decode=SimpleNamespace(program=decode))


@pytest.fixture(scope="module")
def llama_programs():
    model = tiny_llama()
    return model, *programs_of(model)


def test_save_writes_both_programs_once_with_their_weights_pooled_and_the_caches_paired(llama_programs, tmp_path):
    model, prefill, decode = llama_programs
    path = tmp_path / "llama.decode.stitch"
    saved_generator(model, prefill, decode).save(path)
    back = DecodePrograms.load(path)
    assert back.prefill.serialize() == prefill.serialize()  # buffers, steps, kernels, weights
    assert back.decode.serialize() == decode.serialize()
    assert (back.max_length, back.batch_size, back.prompt_length) == (MAX_LEN, BATCH, PROMPT)
    names = {b["id"]: b["name"] for b in back.prefill.buffers if b["role"] == "state"}
    decode_names = {b["id"]: b["name"] for b in back.decode.buffers if b["role"] == "state"}
    pairs = back.state_pairs
    assert sorted(names[a] for a, _ in pairs) == sorted(f"blocks.{i}.attn.{kv}_cache" for i in range(2) for kv in "kv")
    assert all(names[a] == decode_names[b] for a, b in pairs)
    # One model's weights once: the file is about one program's weights smaller than the two files apart.
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert path.stat().st_size < len(prefill.serialize()) + len(decode.serialize()) - weights * 0.9
    assert DecodePrograms.deserialize(path.read_bytes()).decode.serialize() == decode.serialize()
    with pytest.raises(InvalidArgumentError, match="is a prefill \\+ decode pair .*stitchcuda.load in Python"):
        stitchcuda.Program.load(path)


def test_save_refuses_programs_that_do_not_make_a_pair(llama_programs, tmp_path):
    model, prefill, decode = llama_programs
    _, single = programs_of(TinyLlama(LlamaConfig(batch=1)).eval(), batch=1)  # a cache for one sequence
    with pytest.raises(InvalidArgumentError, match="decode's batch is 1, prefill's is 2: both run over one cache"):
        saved_generator(model, prefill, single).save(tmp_path / "mismatched.stitch")
    assert not (tmp_path / "mismatched.stitch").exists()
    short = StaticCacheGenerator(model, max_length=PROMPT, batch_size=BATCH, prefill=SimpleNamespace(program=prefill),
                                 decode=SimpleNamespace(program=decode))
    with pytest.raises(InvalidArgumentError, match="prefill takes prompts of 5 tokens but the cache holds 5 positions"):
        short.save(tmp_path / "short.stitch")
    eager = StaticCacheGenerator(model, max_length=MAX_LEN, batch_size=BATCH)  # the model itself runs both
    with pytest.raises(NoProgramError, match="nothing to save: the prefill runs TinyLlama, not a stitched program"):
        eager.save(tmp_path / "eager.stitch")


def test_a_damaged_pair_file_is_refused_by_name(llama_programs, tmp_path):
    model, prefill, decode = llama_programs
    path = tmp_path / "llama.decode.stitch"
    saved_generator(model, prefill, decode).save(path)
    data = path.read_bytes()
    with pytest.raises(InvalidArgumentError, match=r"not a valid prefill \+ decode file: .*remain \(truncated\?\)"):
        DecodePrograms.deserialize(data[:-3])
    flipped = bytearray(data)
    flipped[-10] ^= 0x40
    with pytest.raises(InvalidArgumentError, match="fails its SHA-256 check"):
        DecodePrograms.deserialize(bytes(flipped))
    with pytest.raises(InvalidArgumentError, match="wrong magic bytes"):
        DecodePrograms.deserialize(prefill.serialize())


def test_a_transformers_llamas_programs_make_a_pair_with_its_cache_tensors_paired(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    lm = stitchcuda.TransformersStaticCacheLM(transformers.LlamaForCausalLM(config).eval(), batch_size=1, max_length=24)
    _, prefill, _ = lowered(lm, (torch.zeros(1, 6, dtype=torch.long), torch.arange(6)))
    _, decode, _ = lowered(lm, (torch.zeros(1, 1, dtype=torch.long), torch.tensor([6])))
    path = tmp_path / "hf.decode.stitch"
    StaticCacheGenerator(lm, max_length=24, batch_size=1, prefill=SimpleNamespace(program=prefill),
                         decode=SimpleNamespace(program=decode)).save(path)
    back = DecodePrograms.load(path)
    names = {b["id"]: b["name"] for b in back.prefill.buffers if b["role"] == "state"}
    # Every tensor the cache's layers hold is a state of both (keys, values and any counter a layer keeps).
    assert {names[a].rpartition(".")[2] for a, _ in back.state_pairs} == {name for name, _ in lm.named_buffers(recurse=False)}
    logits = next(b for b in back.prefill.buffers if b["role"] == "output")
    assert logits["shape"][0] == 1 and logits["shape"][2] == 128  # the last position's logits alone, or all six
    assert (back.prompt_length, back.max_length) == (6, 24)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gives")
def test_loading_the_token_loop_without_a_gpu_says_so(llama_programs, tmp_path):
    model, prefill, decode = llama_programs
    path = tmp_path / "llama.decode.stitch"
    saved_generator(model, prefill, decode).save(path)
    with pytest.raises(stitchcuda.UnavailableError, match="^the prefill program: .*(no CUDA device|CUDA driver)"):
        stitchcuda.load(path)


@pytest.mark.gpu
def test_the_cpp_token_loop_of_a_saved_pair_gives_the_python_generators_tokens(tmp_path):
    model = tiny_llama().cuda()
    gen = StaticCacheGenerator.optimize(model, batch_size=BATCH, prompt_length=PROMPT, max_length=MAX_LEN)
    for module in (gen.prefill_module, gen.decode_module):
        assert module.report.status == "optimized", module.report.reason
    ids = torch.randint(0, 96, (BATCH, PROMPT), device="cuda")
    with torch.no_grad():
        expected = gen.generate(ids, 8)
    path = tmp_path / "llama.decode.stitch"
    gen.save(path)
    loaded = stitchcuda.load(path)
    assert isinstance(loaded, LoadedGenerator)
    for _ in range(2):  # the second call replays the captured decode step from the first
        got = loaded.generate(ids, 8)
        assert torch.equal(got, expected)
    stats = loaded.stats()
    assert (stats["sequences"], stats["tokens"]) == (2, 16)
    assert stats["decode"]["captures"] == 1 and stats["decode"]["replays"] >= 12
    with pytest.raises(InvalidArgumentError, match=r"needs positions 0\.\.16 but the cache holds 16"):
        loaded.generate(ids, 13)
    with pytest.raises(InvalidArgumentError, match=r"the prompt must be integer token ids \[2, 5\]"):
        loaded.generate(ids[:, :4], 3)
    with pytest.raises(InvalidArgumentError, match=r"token ids from 0 to 96 but the vocabulary is 0\.\.95"):
        loaded.generate(torch.cat([ids[:, :4].clamp(min=1) * 0, torch.full((BATCH, 1), 96, device="cuda")], 1), 3)
    assert torch.equal(loaded.generate(ids, 8), expected)  # refused calls leave the loop as it was


@pytest.mark.gpu
def test_the_cpp_token_loop_of_a_transformers_llama_gives_the_python_generators_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().cuda()
    gen = StaticCacheGenerator.for_transformers(model, batch_size=1, prompt_length=6, max_length=24)
    ids = torch.randint(0, 256, (1, 6), device="cuda")
    with torch.no_grad():
        expected = gen.generate(ids, 10)
    path = tmp_path / "hf.decode.stitch"
    gen.save(path)
    loaded = stitchcuda.load(path)
    for _ in range(2):  # each call starts from zeroed caches (a layer's own write counter included)
        assert torch.equal(loaded.generate(ids, 10), expected)


def test_the_pair_check_compares_the_states_memory_not_the_python_objects():
    """A build holds its own `.data` of the model's cache (a new Python object over the same memory): save() on
    the H100 refused a genuine pair because it compared objects. Same memory pairs; a copy or a shifted view
    does not."""
    from stitchcuda.graph.decode import _same_memory

    cache = torch.zeros(2, 4, 16, 8)
    assert cache.data is not cache.data and _same_memory(cache.data, cache.data)
    assert not _same_memory(cache, cache.clone())
    assert not _same_memory(cache, cache[:, :, 1:])
    assert not _same_memory(cache, cache.transpose(2, 3))
