"""A BERT-base-like encoder (word, position and segment embeddings, post-LayerNorm layers with GELU MLPs,
bidirectional attention with biases): 12 layers x 768, 12 heads, 32 x 512 tokens; output the last hidden
states. About 3.1 TFLOP per forward; the largest tensor is a 32 x 512 x 3072 MLP activation."""

import torch
import torch.nn as nn

from _layers import EncoderLayer, init_small, token_ids

VARIANTS = ("bf16", "fp16", "autocast-bf16")
BATCH, SEQ, LAYERS, DIM, HEADS, VOCAB = 32, 512, 12, 768, 12, 30522
SMALL = {"BATCH": 2, "SEQ": 16, "LAYERS": 1, "DIM": 64, "HEADS": 4, "VOCAB": 256}


class Model(nn.Module):
    def __init__(self, seq, layers, dim, heads, vocab):
        super().__init__()
        self.words, self.positions, self.segments = nn.Embedding(vocab, dim), nn.Embedding(seq, dim), \
            nn.Embedding(2, dim)
        self.norm = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, 4 * dim, pre_norm=False) for _ in range(layers))
        init_small(self)

    def forward(self, ids, segments):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.norm(self.words(ids) + self.positions(positions) + self.segments(segments))
        for layer in self.layers:
            x = layer(x)
        return x


def get_inputs():
    return [token_ids(BATCH, SEQ, VOCAB), torch.randint(0, 2, (BATCH, SEQ))]


def get_init_inputs():
    return [SEQ, LAYERS, DIM, HEADS, VOCAB]
