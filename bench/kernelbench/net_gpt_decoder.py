"""A GPT-2-style decoder: learned position embeddings added to the input, two pre-norm blocks with causal SDPA and a tanh-GELU MLP, final LayerNorm.
Largest tensor: 201 MB (fp32) MLP hidden activation (1.6 GB of attention scores if materialized); ~570 GFLOP."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, SEQ, DIM, HEADS, DEPTH = 8, 2048, 768, 12, 2


class _DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.c_fc, self.c_out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, s, d))
        return x + self.c_out(F.gelu(self.c_fc(self.ln2(x)), approximate="tanh"))


class Model(nn.Module):
    def __init__(self, seq: int, dim: int, heads: int, depth: int):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(_DecoderBlock(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, x):
        x = x + self.pos
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def get_inputs():
    return [torch.randn(BATCH, SEQ, DIM)]


def get_init_inputs():
    return [SEQ, DIM, HEADS, DEPTH]
