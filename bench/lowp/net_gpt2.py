"""A GPT-2-small-like decoder (learned positions, pre-LayerNorm, tanh-GELU MLP, causal attention with biases,
LM head tied to the embedding): 12 layers x 768, 12 heads, 4 x 1024 tokens; output the logits.
About 1.2 TFLOP per forward; the largest tensor is the 4 x 1024 x 50257 logits."""

import torch
import torch.nn as nn

from _layers import Attention, GeluMLP, init_small, token_ids

VARIANTS = ("bf16", "fp16", "autocast-bf16")
BATCH, SEQ, LAYERS, DIM, HEADS, VOCAB = 4, 1024, 12, 768, 12, 50257
SMALL = {"BATCH": 1, "SEQ": 16, "LAYERS": 1, "DIM": 64, "HEADS": 4, "VOCAB": 256}


class _Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads, bias=True)
        self.ln2, self.mlp = nn.LayerNorm(dim), GeluMLP(dim, 4 * dim, approximate="tanh")

    def forward(self, x):
        x = x + self.attn(self.ln1(x), causal=True)
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self, seq, layers, dim, heads, vocab):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        init_small(self)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tokens.weight.t()


def get_inputs():
    return [token_ids(BATCH, SEQ, VOCAB)]


def get_init_inputs():
    return [SEQ, LAYERS, DIM, HEADS, VOCAB]
