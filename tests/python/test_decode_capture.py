"""Capture and lowering of buffers a forward updates (a static KV cache): torch.export's buffer mutations
become program states, the functional update (index_copy, copy, slice_scatter) a step writing the state in
place, and its readers read the state; what cannot be written in place is a CaptureError naming the buffer.
Whole programs run on the CPU (the CUDA emulator for kernels, torch for ATen steps) over the model's own
buffers, call after call, against the eager model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, unavailable  # noqa: E402
from test_graph_emulated import run_program  # noqa: E402  (the program's steps on the CPU)

from stitchcuda.graph import CaptureError, Lowering, OfflinePlanner, capture, reference_values  # noqa: E402
from stitchcuda.graph.capture import state_updates  # noqa: E402
from stitchcuda.program import DTYPES  # noqa: E402

emulated = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")

B, HEADS, MAX_LEN, DIM = 2, 2, 8, 4


class IndexCopyCache(nn.Module):
    """A K cache written at cache_position with index_copy_, then read whole (masked beyond the position)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, HEADS * DIM, bias=False)
        self.register_buffer("k_cache", torch.zeros(B, HEADS, MAX_LEN, DIM))

    def forward(self, x, cache_position):
        k = self.proj(x).view(B, -1, HEADS, DIM).transpose(1, 2)
        self.k_cache.index_copy_(2, cache_position, k)
        scores = torch.einsum("bhtd,bhsd->bhts", k, self.k_cache)
        visible = torch.arange(MAX_LEN)[None, :] <= cache_position[:, None]
        return scores.masked_fill(~visible, 0.0).sum(-1)


class SliceCache(nn.Module):
    """A running state written into a slice (slice_scatter) and a whole-buffer copy_ (copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("history", torch.zeros(MAX_LEN, DIM))
        self.register_buffer("last", torch.zeros(DIM))

    def forward(self, x):
        self.history[2:5] = x
        self.last.copy_(x[-1] * 2)
        return self.history.sum(0) + self.last


class ReadsBeforeUpdate(nn.Module):
    """The old value read before the update (a running statistic), the new one after."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(MAX_LEN, DIM))

    def forward(self, x, pos):
        old = self.cache.sum(0)
        self.cache.index_copy_(0, pos, x)
        return self.cache * old


class UpdatesTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(MAX_LEN, DIM))

    def forward(self, x, pos, after):
        self.cache.index_copy_(0, pos, x)
        self.cache.index_copy_(0, after, x * 2)
        return self.cache.sum(0)


class AddsInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(DIM))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 1.0


def test_a_buffer_the_forward_updates_is_a_state_and_its_update_a_node():
    model = IndexCopyCache()
    graph = capture(model, (torch.randn(B, 3, DIM), torch.arange(3)))
    assert [v.kind for v in graph.states] == ["state"]
    assert graph.state_buffers == {graph.states[0].name: "k_cache"}
    (update,) = graph.state_updates.values()
    assert update.op == "aten::index_copy" and update.args[0] is graph.states[0]
    assert all(w.name != graph.states[0].name for w in graph.weights)
    assert len(graph.outputs) == 1  # the buffer's new value is no output
    assert any("program states: k_cache (aten::index_copy, in place)" in text for text, _ in graph.notes)


def test_the_update_is_lowered_in_place_and_its_readers_read_the_state():
    _, program, _ = lowered(IndexCopyCache(), (torch.randn(B, 3, DIM), torch.arange(3)))
    (state,) = [b for b in program.buffers if b["role"] == "state"]
    assert state["name"] == "k_cache" and state["shape"] == [B, HEADS, MAX_LEN, DIM]
    updates = [s for s in program.steps if s["kind"] == "aten" and s["op"] == "aten::index_copy_"]
    assert len(updates) == 1 and updates[0]["outputs"] == [state["id"]] and updates[0]["inputs"][0] == state["id"]
    later = program.steps[program.steps.index(updates[0]) + 1:]
    assert any(s["kind"] == "view" and s["source"] == state["id"] for s in later)  # the einsum reads the state
    assert program.states == [state["id"]]


def test_reading_the_old_value_after_an_in_place_update_is_a_capture_error():
    # torch.export orders reads of the old value before the update; a graph that does not (the same nodes
    # reordered) cannot be written in place, and the error names the buffer and the reader.
    graph = capture(ReadsBeforeUpdate(), (torch.randn(1, DIM), torch.tensor([2])))
    (update,) = graph.state_updates.values()
    (reader,) = [n for n in graph.states[0].users if n is not update]
    nodes = [n for n in graph.nodes if n is not reader]
    nodes.insert(nodes.index(update) + 1, reader)
    with pytest.raises(CaptureError, match=rf"old value of buffer 'cache' \({reader.name}\) after updating it"):
        state_updates(nodes, graph.states, graph.state_values, graph.state_buffers)
    assert state_updates(graph.nodes, graph.states, graph.state_values, graph.state_buffers) == graph.state_updates


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("emulated_decode"))


def lowered(model: nn.Module, inputs: tuple):
    """The model's graph, its program and the values its weights and constants take (as test_graph_emulated
    lowers)."""
    graph = capture(model, inputs)
    plan = OfflinePlanner().plan(graph)
    values = reference_values(graph, list(inputs))
    constants = {g.nodes[0].out.name: values[g.nodes[0].out.name] for g in plan.groups if g.kind == "constant"}
    program = Lowering(graph, plan, constants).build(plan.groups, graph.inputs, graph.outputs)
    nodes = {n.name: n for n in graph.nodes}
    for b in program.buffers:  # a number the lowering made a 0-dim weight of: "<node>.<argument>"
        if b["role"] == "weight" and b["name"] not in values:
            node = nodes[b["name"].rpartition(".")[0]]
            bound = dict(zip((a.name for a in node.target._schema.arguments), node.args)) | node.kwargs
            values[b["name"]] = torch.tensor(bound[b["name"].rpartition(".")[2]], dtype=DTYPES[b["dtype"]])
    return graph, program, values


@emulated
def test_a_cache_program_updates_the_models_buffer_call_after_call_as_eager_does(emu):
    torch.manual_seed(0)
    model, twin = IndexCopyCache(), IndexCopyCache()
    twin.load_state_dict(model.state_dict())
    _, prefill, values = lowered(model, (torch.randn(B, 3, DIM), torch.arange(3)))
    _, decode, decode_values = lowered(model, (torch.randn(B, 1, DIM), torch.tensor([3])))
    model.k_cache.zero_()
    states = dict(model.named_buffers())
    x = torch.randn(B, 3, DIM)
    (got,) = run_program(emu, prefill, [x, torch.arange(3)], values, states)
    torch.testing.assert_close(got, twin(x, torch.arange(3)), rtol=1e-5, atol=1e-5)
    for pos in range(3, MAX_LEN):
        x = torch.randn(B, 1, DIM)
        (got,) = run_program(emu, decode, [x, torch.tensor([pos])], decode_values, states)
        torch.testing.assert_close(got, twin(x, torch.tensor([pos])), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.k_cache, twin.k_cache, rtol=1e-6, atol=1e-6)
    assert int(torch.count_nonzero(model.k_cache[:, :, MAX_LEN - 1])) > 0


CASES = {  # model, the inputs of call k
    "slice-and-copy": (SliceCache, lambda k: (torch.randn(3, DIM) + k,)),
    "read-before-update": (ReadsBeforeUpdate, lambda k: (torch.randn(1, DIM) + k, torch.tensor([k + 2]))),
    "updated-twice": (UpdatesTwice, lambda k: (torch.randn(1, DIM) + k, torch.tensor([k + 2]), torch.tensor([k + 3]))),
    "add-in-place": (AddsInPlace, lambda k: (torch.randn(DIM) + k,)),
}


@emulated
@pytest.mark.parametrize("kind, in_place, copied", [("slice-and-copy", ["history"], ["last"]),
                                                     ("read-before-update", ["cache"], []),
                                                     ("updated-twice", [], ["cache"]), ("add-in-place", [], ["total"])])
def test_every_update_reaches_the_models_buffer_call_after_call(emu, kind, in_place, copied):
    make, args = CASES[kind]
    torch.manual_seed(1)
    model, twin = make(), make()
    graph, program, values = lowered(model, args(0))
    assert sorted(graph.state_buffers[n] for n in graph.state_updates) == in_place
    assert sorted(graph.state_buffers[v.name] for v in graph.states if v.name not in graph.state_updates) == copied
    writes = [s for s in program.steps if s["kind"] == "aten" and s["op"].endswith("_")]
    assert len(writes) == len(in_place) + len(copied)
    states = dict(model.named_buffers())
    for k in range(3):
        inputs = args(k)
        (got,) = run_program(emu, program, list(inputs), values, states)
        torch.testing.assert_close(got, twin(*inputs), rtol=1e-5, atol=1e-5)
        for name, buffer in twin.named_buffers():
            torch.testing.assert_close(states[name], buffer, rtol=1e-6, atol=1e-6)
