"""Program state from Python (a KV cache the program owns): the builder's state(), validation, the artifact
keeping its spec and no bytes, share_state's checks, in-place ATen overloads refused on anything else; on a
GPU, an executor updating a shared cache in place run after run, replayed as one CUDA graph, and one that
owns zero-filled states of its own.
"""

from __future__ import annotations

import pytest
import torch

from stitchcuda import Program, ProgramBuilder
from stitchcuda.errors import InvalidArgumentError

MAX_LEN, HEADS, DIM = 8, 2, 4


def cache_program() -> tuple[Program, int]:
    """scores = q @ cache^T after cache[:, pos] = k: one decode step's write and read of a K cache."""
    b = ProgramBuilder()
    pos = b.input([1], "i64", name="cache_position")
    k = b.input([HEADS, 1, DIM], name="k")
    q = b.input([HEADS, 1, DIM], name="q")
    cache = b.state([HEADS, MAX_LEN, DIM], name="k_cache")
    scores = b.output([HEADS, 1, MAX_LEN], name="scores")
    b.aten("aten::index_copy_", [cache, pos, k], [cache], dim=1)
    b.matmul(q, cache, scores, transpose_b=True, batch=HEADS)
    return b.build(), cache


def eager_step(cache: torch.Tensor, pos: int, k: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    cache[:, pos] = k[:, 0]
    return q @ cache.transpose(1, 2)


def test_a_state_builds_plans_outside_the_arena_and_keeps_its_spec_in_the_artifact():
    program, cache = cache_program()
    (buf,) = [b for b in program.buffers if b["id"] == cache]
    assert buf["role"] == "state" and buf["shape"] == [HEADS, MAX_LEN, DIM] and buf["name"] == "k_cache"
    assert program.states == [cache]
    assert all(p["buffer"] != cache for p in program.buffer_plan()["placements"])
    loaded = Program.deserialize(program.serialize())
    assert loaded.serialize() == program.serialize()
    assert [b for b in loaded.buffers if b["role"] == "state"] == [buf]
    assert loaded.states == [cache]


def test_an_empty_state_is_refused_naming_it():
    b = ProgramBuilder()
    x = b.input([4])
    b.state([0, 4], name="empty_cache")
    y = b.output([4])
    b.aten("aten::relu", [x], [y])
    with pytest.raises(InvalidArgumentError, match=r"state buffer 'empty_cache'.*at least one element"):
        b.build()


def test_share_state_checks_the_role_and_the_layout():
    program, cache = cache_program()
    with pytest.raises(InvalidArgumentError, match="is not a state of this program"):
        program.share_state(0, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(InvalidArgumentError, match=r"k_cache.*f32\[2, 8, 4\].*f32\[2, 4, 8\]"):
        program.share_state(cache, torch.zeros(HEADS, DIM, MAX_LEN))
    with pytest.raises(InvalidArgumentError, match="is not a weight of this program"):
        program.share_weight(cache, torch.zeros(HEADS, MAX_LEN, DIM))
    program.share_state(cache, torch.zeros(HEADS, MAX_LEN, DIM))
    assert cache in program.shared_weights
    # A shared state's values never go into the artifact: a loaded program starts from zeros.
    assert Program.deserialize(program.serialize()).serialize() == cache_program()[0].serialize()


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_a_shared_cache_is_updated_in_place_run_after_run(graphs):
    torch.manual_seed(0)
    program, cache_id = cache_program()
    cache = torch.zeros(HEADS, MAX_LEN, DIM, device="cuda")
    program.share_state(cache_id, cache)
    executor = program.executor(graphs=graphs)
    assert executor.states == [cache_id]
    assert executor.state(cache_id).data_ptr() == cache.data_ptr()
    reference = torch.zeros_like(cache)
    for pos in range(MAX_LEN):
        k, q = torch.randn(HEADS, 1, DIM, device="cuda"), torch.randn(HEADS, 1, DIM, device="cuda")
        (scores,) = executor.run([torch.tensor([pos], device="cuda"), k, q])
        expected = eager_step(reference, pos, k, q)
        torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache, reference, rtol=0, atol=0)
    stats = executor.stats()
    assert stats["shared_state_bytes"] == cache.numel() * 4 and stats["state_bytes"] == 0
    assert stats["replays"] == (MAX_LEN - 1 if graphs else 0)
    executor.reset_states()
    assert int(torch.count_nonzero(cache)) == 0


@pytest.mark.gpu
def test_an_executor_owns_zero_filled_states_when_none_is_shared():
    program, cache_id = cache_program()
    executor = program.executor(graphs=True)
    own = executor.state(cache_id)
    assert own.shape == (HEADS, MAX_LEN, DIM) and int(torch.count_nonzero(own)) == 0
    k, q = torch.ones(HEADS, 1, DIM, device="cuda"), torch.ones(HEADS, 1, DIM, device="cuda")
    for _ in range(3):  # eager, capture, replay: each writes the same row of the same tensor
        (scores,) = executor.run([torch.tensor([3], device="cuda"), k, q])
    assert executor.state(cache_id).data_ptr() == own.data_ptr()
    assert scores[0, 0].tolist() == [0.0, 0.0, 0.0, float(DIM), 0.0, 0.0, 0.0, 0.0]
    assert executor.stats()["state_bytes"] == own.numel() * 4
    with pytest.raises(InvalidArgumentError, match="is not a state of this program"):
        executor.state(0)
    loaded = Program.deserialize(program.serialize()).executor()
    assert int(torch.count_nonzero(loaded.state(cache_id))) == 0


def test_an_in_place_op_on_anything_but_a_state_is_refused():
    # Binding the steps' ATen ops comes before any device is needed: this fails the same way everywhere.
    b = ProgramBuilder()
    pos = b.input([1], "i64")
    k = b.input([HEADS, 1, DIM])
    base = b.input([HEADS, MAX_LEN, DIM])
    scratch = b.intermediate([HEADS, MAX_LEN, DIM])
    out = b.output([HEADS, MAX_LEN, DIM])
    b.aten("aten::clone", [base], [scratch])
    b.aten("aten::index_copy_", [scratch, pos, k], [scratch], dim=1)
    b.aten("aten::clone", [scratch], [out])
    with pytest.raises(InvalidArgumentError, match=r"index_copy_.*writes its argument 'self' in place"):
        b.build().executor()
