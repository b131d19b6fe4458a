"""Capture's index hoisting (graph/hoist_index.py): an index along one dimension (index_select, x[:, -1], a slice)
moves above the ops that compute each position on its own, so a causal LM's last-position logits come from an LM
head (and final norm) run on one row per sequence. Checked on the captured graph (the matmuls' shapes), on its
outputs (bit for bit where the moved ops are the same ops on fewer rows), and on what must stay as it was: an
index after a cumulative sum, a softmax over the indexed dimension or attention, a value another reader needs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit  # noqa: E402
from test_decode import RMSNorm, emulated, tiny_llama  # noqa: E402  (a Llama-like LM over a static KV cache)
from test_decode_buckets import hf_llama  # noqa: E402
from test_decode_capture import lowered  # noqa: E402  (capture, plan and lower)
from test_graph_emulated import run_program  # noqa: E402  (a program's steps on the CPU)

from stitchcuda import TransformersStaticCacheLM  # noqa: E402
from stitchcuda.graph import capture  # noqa: E402
from stitchcuda.graph.capture import export_program  # noqa: E402
from stitchcuda.graph.decode import LastPositionLogits  # noqa: E402
from stitchcuda.graph.hoist_index import hoist_indexing  # noqa: E402
from stitchcuda.graph.lower import reference_values  # noqa: E402

VOCAB = 96


def outputs(graph, inputs) -> list[torch.Tensor]:
    """The captured graph's outputs, run by ATen (the exported graph capture rewrote)."""
    values = reference_values(graph, list(inputs))
    return [values[v.name] for v in graph.outputs]


def unrewritten(model: nn.Module, inputs) -> torch.fx.GraphModule:
    """The model's core-ATen graph as torch.export gives it, no index moved."""
    return export_program(model, inputs).module()


def matmuls(graph) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(left operand's shape, output's shape) of every mm/addmm in the graph, in order."""
    found = []
    for n in graph.nodes:
        if n.op == "aten::mm":
            found.append((n.inputs[0].shape, n.out.shape))
        elif n.op == "aten::addmm":
            found.append((n.args[1].shape, n.out.shape))
    return found


def head_rows(graph) -> int:
    """Rows of the LM head's matmul: the one whose output has the vocabulary's width."""
    (rows,) = [out[0] for _, out in matmuls(graph) if out[-1] == VOCAB]
    return rows


class Tail(nn.Module):
    """A final norm and LM head over hidden states (an LM's last steps), returning `pick(logits)`."""

    def __init__(self, pick, dim: int = 32, bias: bool = True) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, 1e-5)
        self.head = nn.Linear(dim, VOCAB, bias=bias)
        self.pick = pick

    def forward(self, h):
        return self.pick(self.head(self.norm(h)))


# ---- a Llama-like LM's prefill at its last prompt position -----------------------------------------------------

def test_the_llama_prefills_lm_head_runs_on_one_row_per_sequence_and_gives_the_same_logits():
    torch.manual_seed(0)
    model = LastPositionLogits(tiny_llama())
    inputs = (torch.randint(0, VOCAB, (2, 8)), torch.arange(8), torch.tensor([5]))
    graph = capture(model, inputs)
    assert head_rows(graph) == 2  # batch 2 x 1 position, not 2 x 8
    # the final norm too: its mean of squares is over [2, 1, 32]
    means = [n for n in graph.nodes if n.op == "aten::mean.dim"]
    assert means[-1].inputs[0].shape == (2, 1, 32)
    # the last block's MLP and output projection follow the index up to the attention, which mixes positions
    assert [out for _, out in matmuls(graph)][-5:] == [(2, 32), (2, 64), (2, 64), (2, 32), (2, VOCAB)]
    assert any(n.op == "aten::scaled_dot_product_attention" and n.out.shape == (2, 4, 8, 8) for n in graph.nodes)
    assert any("index moved above" in text and "on 2 of 16 rows" in text for text, _ in graph.notes)

    (got,) = [o for o in outputs(graph, inputs) if o.shape == (2, 1, VOCAB)]
    with torch.no_grad():
        for c in model.model.caches():
            c.zero_()
        expected = model(*inputs)
    # Each GEMM row is the same dot products; the CPU BLAS blocks 2 rows and 16 differently, so the last
    # bits may differ (the exact comparison is the next test's, where both sides run the same shapes).
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_moved_ops_are_the_same_ops_on_fewer_rows_bit_for_bit():
    torch.manual_seed(1)
    model = Tail(lambda logits: logits[:, -1]).eval()
    h = torch.randn(3, 10, 32)
    graph = capture(model, (h,))
    assert head_rows(graph) == 3
    (got,) = outputs(graph, (h,))
    with torch.no_grad():
        by_hand = model.head(model.norm(h[:, -1]))  # what a person indexing first writes
    assert got.shape == (3, VOCAB)
    assert torch.equal(got, by_hand)


def test_without_a_matmul_the_rewritten_graph_equals_the_original_bit_for_bit():
    class Scores(nn.Module):  # layer norm, GELU, a cast, log_softmax over the features: all row by row
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(24)

        def forward(self, x, last):
            y = F.gelu(self.norm(x)).double() * 0.5
            return torch.log_softmax(y, dim=-1).float().index_select(1, last)

    torch.manual_seed(2)
    model = Scores().eval()
    inputs = (torch.randn(2, 12, 24), torch.tensor([3, 11]))
    graph = capture(model, inputs)
    norms = [n for n in graph.nodes if n.op == "aten::native_layer_norm"]
    assert norms[0].inputs[0].shape == (2, 2, 24)  # the index is the first step now
    (got,) = outputs(graph, inputs)
    with torch.no_grad():
        (original,) = [unrewritten(model, inputs)(*inputs)]
    assert torch.equal(got, original)


def test_a_slice_of_several_positions_merged_into_gemm_rows():
    torch.manual_seed(3)
    model = Tail(lambda logits: logits[:, -4:, :]).eval()
    h = torch.randn(2, 9, 32)
    graph = capture(model, (h,))
    assert head_rows(graph) == 8  # 2 sequences x 4 positions
    (got,) = outputs(graph, (h,))
    with torch.no_grad():
        by_hand = model.head(model.norm(h[:, -4:]))
    assert torch.equal(got, by_hand)



def test_hand_written_attention_passes_the_index_to_its_query_rows_and_keeps_keys_and_values_whole():
    # Each query row of softmax(q k^T + mask) v is its own: the index moves through P @ V, the softmax over the
    # keys, the masking (its [tokens, tokens] mask indexed too) and q k^T to the rows of q; k and v, and the
    # projection they share with q, keep every position.
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out, self.head = nn.Linear(32, 96), nn.Linear(32, 32), nn.Linear(32, VOCAB)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1),
                                                                      float("-inf"))
            y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
            return self.head(self.out(y))[:, -1]

    torch.manual_seed(6)
    model = Attention().eval()
    x = torch.randn(2, 10, 32)
    graph = capture(model, (x,))
    products = [n.out.shape for n in graph.nodes if n.op == "aten::bmm"]
    assert products == [(8, 1, 10), (8, 1, 8)]  # one query row per head against all 10 keys
    assert [out for _, out in matmuls(graph)] == [(20, 96), (2, 32), (2, VOCAB)]
    (got,) = outputs(graph, (x,))
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-6)


def test_the_rewrite_can_be_turned_off_to_measure_it(monkeypatch):
    from stitchcuda.settings import reload

    model, h = Tail(lambda logits: logits[:, -1]).eval(), torch.randn(3, 10, 32)
    monkeypatch.setenv("STITCHCUDA_HOIST_INDEX", "0")
    reload()
    try:
        graph = capture(model, (h,))
    finally:
        monkeypatch.delenv("STITCHCUDA_HOIST_INDEX")
        reload()
    assert head_rows(graph) == 30 and not any("index moved" in text for text, _ in graph.notes)
    assert head_rows(capture(model, (h,))) == 3


def test_an_index_tensor_the_forward_makes_moves_up_too():
    class Picked(nn.Module):  # positions 7, 0, 7, 3: a constant the forward builds, after the ops it moves above
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.proj = nn.LayerNorm(16), nn.Linear(16, 12)

        def forward(self, x):
            return F.gelu(self.proj(self.norm(x))).index_select(1, torch.tensor([7, 0, 7, 3]))

    torch.manual_seed(7)
    model, x = Picked().eval(), torch.randn(2, 8, 16)
    graph = capture(model, (x,))
    assert [left for left, _ in matmuls(graph)] == [(8, 16)]  # 2 sequences x 4 picks
    (got,) = outputs(graph, (x,))
    with torch.no_grad():
        assert torch.equal(got, F.gelu(model.proj(model.norm(x.index_select(1, torch.tensor([7, 0, 7, 3]))))))

# ---- where the index stays -------------------------------------------------------------------------------------

def test_an_index_after_ops_that_mix_positions_leaves_the_graph_as_it_was():
    class Mixing(nn.Module):
        def __init__(self, how, dim: int) -> None:
            super().__init__()
            self.how, self.dim = how, dim

        def forward(self, x):
            return self.how(x).select(self.dim, -1)

    tokens = torch.randn(2, 6, 8)
    cases = {
        "a cumulative sum over the tokens": (lambda x: torch.cumsum(x.exp(), dim=1), 1, tokens),
        "a softmax over the tokens": (lambda x: torch.softmax(x * 2, dim=1), 1, tokens),
        "attention": (lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True), 2, torch.randn(2, 4, 6, 8)),
        "a convolution over the sequence": (nn.Conv1d(8, 8, 3, padding=1), 2, tokens.transpose(1, 2)),
        "only views above the index": (lambda x: x.transpose(1, 2).reshape(2, 8, 6), 2, tokens),
    }
    for what, (how, dim, x) in cases.items():
        model = Mixing(how, dim).eval()
        exported = export_program(model, (x,))
        before = [n.format_node() for n in exported.graph.nodes]
        assert hoist_indexing(exported.graph_module.graph) == [], what  # nothing moves ...
        assert [n.format_node() for n in exported.graph.nodes] == before, what  # ... and nothing changes
        graph = capture(model, (x,))
        assert not any("index moved" in text for text, _ in graph.notes), what
        (got,) = outputs(graph, (x,))
        with torch.no_grad():
            assert torch.equal(got, model(x)), what


def test_a_reduction_over_the_tokens_stays_whole_and_the_op_reading_it_moves():
    class Centered(nn.Module):
        def forward(self, x):
            return torch.tanh(x - x.mean(1, keepdim=True))[:, -1]

    x = torch.randn(2, 6, 8)
    graph = capture(Centered(), (x,))
    (mean,) = [n for n in graph.nodes if n.op == "aten::mean.dim"]
    assert mean.inputs[0].shape == (2, 6, 8)  # every position, read whole by the subtraction
    (tanh,) = [n for n in graph.nodes if n.op == "aten::tanh"]
    assert tanh.out.shape == (2, 1, 8)
    (got,) = outputs(graph, (x,))
    assert torch.equal(got, Centered()(x))


def test_the_index_moves_only_up_its_own_branch_of_a_value_another_output_reads():
    class TwoReaders(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(32, 1e-5)
            self.head = nn.Linear(32, VOCAB)

        def forward(self, h):
            y = self.norm(h)
            return self.head(y)[:, -1], y.sum(dim=(1, 2))  # y is needed whole by the sum

    torch.manual_seed(4)
    model = TwoReaders().eval()
    h = torch.randn(2, 7, 32)
    graph = capture(model, (h,))
    assert head_rows(graph) == 2  # the head follows the index ...
    means = [n for n in graph.nodes if n.op == "aten::mean.dim"]
    assert [m.inputs[0].shape for m in means] == [(2, 7, 32)]  # ... the norm is computed once, whole
    assert sum(n.op == "aten::rsqrt" for n in graph.nodes) == 1  # and not again on the kept row
    logits, total = outputs(graph, (h,))
    with torch.no_grad():
        y = model.norm(h)
        assert torch.equal(logits, model.head(y[:, -1]))
        assert torch.equal(total, y.sum(dim=(1, 2)))


def test_a_value_read_by_two_ops_of_the_moved_branch_moves_with_them():
    # RMSNorm reads its input twice (the mean of squares and the product): both readers move, so the input's
    # producer (the residual add) moves too
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(32, 1e-5)
            self.head = nn.Linear(32, VOCAB, bias=False)

        def forward(self, a, b):
            return self.head(self.norm(a + b))[:, -1]

    model = Residual().eval()
    a, b = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    graph = capture(model, (a, b))
    (add,) = [n for n in graph.nodes if n.op == "aten::add.Tensor" and n.out.shape[-1] == 32]
    assert add.out.shape == (2, 1, 32)
    (got,) = outputs(graph, (a, b))
    with torch.no_grad():
        assert torch.equal(got, model.head(model.norm(a[:, -1] + b[:, -1])))


def test_a_transformers_llamas_index_moves_from_its_head_up_to_the_last_attention():
    lm = TransformersStaticCacheLM(hf_llama(vocab=256), batch_size=1, max_length=24)
    graph = capture(lm, (torch.zeros(1, 16, dtype=torch.long), torch.arange(16), torch.tensor([15])))
    rows = [n.out.shape for n in graph.nodes if n.op == "aten::mm"]
    # two layers: q, k, v, o, gate, up, down each; the last layer's o and MLP and the head on the one position
    assert rows[-5:] == [(1, 64), (1, 128), (1, 128), (1, 64), (1, 256)]
    assert all(r[0] == 16 for r in rows[:-5])


# ---- the rewritten graphs as programs (CUDA emulator) ----------------------------------------------------------

class Shared(nn.Module):
    """The GEMM's input, [batch x tokens, dim], is read whole by a second output: the index is taken from it
    with the token axis split out of its rows ([batch, tokens, dim]) and merged back."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(32, 1e-5)
        self.head = nn.Linear(32, VOCAB, bias=False)  # (the emulator runs plain cuBLASLt products)

    def forward(self, h, last):
        flat = self.norm(h).reshape(-1, 32)
        logits = self.head(flat).view(h.shape[0], h.shape[1], VOCAB)
        return logits.index_select(1, last), flat.sum(0)


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("emulated_rewrites"))


@emulated
def test_the_rewritten_graphs_lower_to_programs_that_compute_the_models_outputs(emu):
    torch.manual_seed(5)
    cases = {
        "a slice of four positions": (Tail(lambda logits: logits[:, -4:], bias=False).eval(), (torch.randn(2, 9, 32),)),
        "the index taken inside GEMM rows": (Shared().eval(), (torch.randn(2, 6, 32), torch.tensor([2, 5]))),
    }
    for what, (model, inputs) in cases.items():
        graph, program, values = lowered(model, inputs)
        assert any("index moved" in text for text, _ in graph.notes), what
        got = run_program(emu, program, list(inputs), values)
        with torch.no_grad():
            expected = model(*inputs)
        expected = expected if isinstance(expected, tuple) else (expected,)
        assert len(got) == len(expected), what
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=what)
