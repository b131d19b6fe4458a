"""An encoder-decoder laid out like T5-small (RMSNorm pre-norm, bias-free projections, ReLU MLPs, a causal
decoder with cross-attention to the encoder, LM head tied to the shared embedding; learned absolute positions
stand in for T5's relative position buckets): 6 + 6 layers x 512, 8 heads, 8 sequences of 512 source and 128
target tokens; output the target logits. About 0.29 TFLOP per forward."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from _layers import Attention, RMSNorm, init_small, token_ids

VARIANTS = ("bf16", "fp16", "autocast-bf16")
BATCH, SOURCE, TARGET, LAYERS, DIM, HEADS, HIDDEN, VOCAB = 8, 512, 128, 6, 512, 8, 2048, 32128
SMALL = {"BATCH": 1, "SOURCE": 16, "TARGET": 8, "LAYERS": 1, "DIM": 64, "HEADS": 4, "HIDDEN": 128, "VOCAB": 256}


class _Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.wi, self.wo = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.wo(F.relu(self.wi(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = RMSNorm(dim), Attention(dim, heads), RMSNorm(dim), \
            _Mlp(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _DecoderLayer(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.norm1, self.self_attn = RMSNorm(dim), Attention(dim, heads)
        self.norm2, self.cross_attn = RMSNorm(dim), Attention(dim, heads)
        self.norm3, self.mlp = RMSNorm(dim), _Mlp(dim, hidden)

    def forward(self, x, memory):
        x = x + self.self_attn(self.norm1(x), causal=True)
        x = x + self.cross_attn(self.norm2(x), memory=memory)
        return x + self.mlp(self.norm3(x))


class Model(nn.Module):
    def __init__(self, source, target, layers, dim, heads, hidden, vocab):
        super().__init__()
        self.shared = nn.Embedding(vocab, dim)
        self.source_positions, self.target_positions = nn.Embedding(source, dim), nn.Embedding(target, dim)
        self.encoder = nn.ModuleList(_EncoderLayer(dim, heads, hidden) for _ in range(layers))
        self.decoder = nn.ModuleList(_DecoderLayer(dim, heads, hidden) for _ in range(layers))
        self.encoder_norm, self.decoder_norm = RMSNorm(dim), RMSNorm(dim)
        self.scale = dim ** -0.5  # T5 scales the tied head's input
        init_small(self)

    def forward(self, source_ids, target_ids):
        x = self.shared(source_ids) + self.source_positions(torch.arange(source_ids.shape[1], device=source_ids.device))
        for layer in self.encoder:
            x = layer(x)
        memory = self.encoder_norm(x)
        y = self.shared(target_ids) + self.target_positions(torch.arange(target_ids.shape[1], device=target_ids.device))
        for layer in self.decoder:
            y = layer(y, memory)
        return (self.decoder_norm(y) * self.scale) @ self.shared.weight.t()


def get_inputs():
    return [token_ids(BATCH, SOURCE, VOCAB), token_ids(BATCH, TARGET, VOCAB)]


def get_init_inputs():
    return [SOURCE, TARGET, LAYERS, DIM, HEADS, HIDDEN, VOCAB]
