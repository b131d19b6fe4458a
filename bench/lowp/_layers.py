"""Layers the low-precision suite's models share, written the way the common model libraries write them (the
casts a bf16 or fp16 model carries around its norms and rotary embedding included), so the suite sees the
graphs users run. A helper module (leading underscore): not a problem of its own."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """Llama's RMSNorm: the statistics in fp32, the result cast back to the input's dtype before the scale."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim)), eps

    def forward(self, x):
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotary_tables(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (seq, head_dim), computed in fp32."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    """x: (batch, heads, seq, head_dim); the tables cast to x's dtype, as the libraries do."""
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Multi-head attention through SDPA: grouped-query heads when kv_heads < heads, rotary embedding when
    given the tables, causal or not, self- or cross-attention (`memory`)."""

    def __init__(self, dim: int, heads: int, kv_heads: int | None = None, bias: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads or heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=bias)
        self.k = nn.Linear(dim, self.kv_heads * self.head_dim, bias=bias)
        self.v = nn.Linear(dim, self.kv_heads * self.head_dim, bias=bias)
        self.o = nn.Linear(dim, dim, bias=bias)

    def forward(self, x, memory=None, causal: bool = False, rotary=None):
        b, t, _ = x.shape
        src = x if memory is None else memory
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(src).view(b, src.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(src).view(b, src.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if self.kv_heads != self.heads:
            repeat = self.heads // self.kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, approximate: str = "none"):
        super().__init__()
        self.fc1, self.fc2, self.approximate = nn.Linear(dim, hidden), nn.Linear(hidden, dim), approximate

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class EncoderLayer(nn.Module):
    """A transformer encoder layer with biases and GELU: post-norm (BERT) or pre-norm (ViT)."""

    def __init__(self, dim: int, heads: int, hidden: int, pre_norm: bool, eps: float = 1e-12):
        super().__init__()
        self.attn, self.mlp, self.pre_norm = Attention(dim, heads, bias=True), GeluMLP(dim, hidden), pre_norm
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)

    def forward(self, x):
        if self.pre_norm:
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.mlp(x))


def init_small(model: nn.Module, std: float = 0.02) -> nn.Module:
    """Weights as trained transformers have them (normal, std 0.02; norms near 1): the default uniform init
    of wide layers makes activations grow layer after layer, which no deployed model does."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.normal_(module.bias, std=std)
    return model


def token_ids(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))
