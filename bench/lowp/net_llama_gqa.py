"""A Llama-architecture decoder (RMSNorm, grouped-query attention with rotary embedding, SwiGLU, untied LM head)
at prefill: 4 layers x 2048 hidden, 16 query / 4 key-value heads, 2 x 1024 tokens; output the logits.
About 1.1 TFLOP per forward; the largest tensor is the 2 x 1024 x 32000 logits."""

import torch
import torch.nn as nn

from _layers import Attention, RMSNorm, SwiGLU, init_small, rotary_tables, token_ids

VARIANTS = ("bf16", "fp16", "autocast-bf16")
BATCH, SEQ, LAYERS, DIM, HEADS, KV_HEADS, HIDDEN, VOCAB = 2, 1024, 4, 2048, 16, 4, 5632, 32000
SMALL = {"BATCH": 1, "SEQ": 16, "LAYERS": 1, "DIM": 64, "HEADS": 4, "KV_HEADS": 2, "HIDDEN": 128, "VOCAB": 256}


class _Layer(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, heads, kv_heads)
        self.mlp_norm, self.mlp = RMSNorm(dim), SwiGLU(dim, hidden)

    def forward(self, x, rotary):
        x = x + self.attn(self.attn_norm(x), causal=True, rotary=rotary)
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(self, seq, layers, dim, heads, kv_heads, hidden, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Layer(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm, self.head = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        cos, sin = rotary_tables(seq, dim // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        init_small(self)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, (self.cos, self.sin))
        return self.head(self.norm(x))


def get_inputs():
    return [token_ids(BATCH, SEQ, VOCAB)]


def get_init_inputs():
    return [SEQ, LAYERS, DIM, HEADS, KV_HEADS, HIDDEN, VOCAB]
