"""A Mamba-2-like selective state-space layer: input projection, causal depthwise conv1d, data-dependent decays, chunked linear-recurrence scan from cumsum/exp/einsum, gated LayerNorm, output projection.
Largest tensor: 558 MB (fp32) input-projection output (268 MB intra-chunk decay matrices); ~460 GFLOP, mostly the projections, plus a memory-bound scan."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, SEQ, DIM, EXPAND, HEADS, STATE, CHUNK, CONV = 8, 4096, 1024, 2, 32, 64, 64, 4


class Model(nn.Module):
    """h_t = exp(dt_t * A) h_{t-1} + dt_t * B_t x_t, y_t = C_t . h_t + D x_t per head, computed chunk by chunk:
    exact within a chunk (a masked T x T decay matrix), chunk-end states carried across chunks by a second
    masked decay matrix over chunks."""

    def __init__(self, dim: int, expand: int, heads: int, state: int, chunk: int, conv: int):
        super().__init__()
        inner = dim * expand
        self.inner, self.heads, self.state, self.chunk = inner, heads, state, chunk
        self.in_proj = nn.Linear(dim, 2 * inner + 2 * state + heads, bias=False)
        conv_channels = inner + 2 * state
        self.conv = nn.Conv1d(conv_channels, conv_channels, conv, groups=conv_channels, padding=conv - 1)
        self.dt_bias = nn.Parameter(torch.rand(heads) * 0.5 - 2.0)
        self.a_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, heads)))
        self.d_skip = nn.Parameter(torch.ones(heads))
        self.norm = nn.LayerNorm(inner)
        self.out_proj = nn.Linear(inner, dim, bias=False)
        self.register_buffer("causal", torch.ones(chunk, chunk, dtype=torch.bool).tril(), persistent=False)

    def forward(self, u):
        b, l, _ = u.shape
        h, n, t = self.heads, self.state, self.chunk
        p, c = self.inner // h, l // t
        z, xbc, dt = torch.split(self.in_proj(u), [self.inner, self.inner + 2 * n, h], dim=-1)
        # causal depthwise conv along the sequence: channels first, then back
        xbc = F.silu(self.conv(xbc.transpose(1, 2))[..., :l].transpose(1, 2))
        x, bmat, cmat = torch.split(xbc, [self.inner, n, n], dim=-1)
        dt = F.softplus(dt + self.dt_bias)  # (b, l, h)
        a = -torch.exp(self.a_log)  # (h,)

        xc = x.reshape(b, c, t, h, p)  # x is a column slice: a reshape of a non-contiguous tensor
        dtc = dt.reshape(b, c, t, h)
        bc, cc = bmat.reshape(b, c, t, n), cmat.reshape(b, c, t, n)
        xdt = xc * dtc.unsqueeze(-1)  # dt-weighted input, (b, c, t, h, p)
        lc = torch.cumsum((dtc * a).permute(0, 3, 1, 2), dim=-1)  # log decay from chunk start, (b, h, c, t)

        # within each chunk: y[t] = sum_{s<=t} exp(lc[t] - lc[s]) (C_t . B_s) xdt[s]
        seg = (lc.unsqueeze(-1) - lc.unsqueeze(-2)).masked_fill(~self.causal, float("-inf"))
        weights = torch.exp(seg) * (cc @ bc.transpose(-1, -2)).unsqueeze(1)  # (b, h, c, t, s)
        y = torch.einsum("bhcts,bcshp->bhctp", weights, xdt)

        # state at each chunk's end, then the state entering each chunk from all earlier chunks
        to_end = torch.exp(lc[..., -1:] - lc)  # (b, h, c, t), all <= 1
        states = torch.einsum("bhcs,bcsn,bcshp->bchpn", to_end, bc, xdt)
        total = lc[..., -1]  # (b, h, c)
        g = torch.cumsum(total, dim=-1)
        earlier = torch.ones(c, c, dtype=torch.bool, device=u.device).tril(-1)
        # chunk i receives chunk j < i decayed by the chunks between: exp(g[i-1] - g[j])
        carry = (g.unsqueeze(-1) - g.unsqueeze(-2) - total.unsqueeze(-1)).masked_fill(~earlier, float("-inf")).exp()
        entering = torch.einsum("bhij,bjhpn->bihpn", carry, states)
        y = y + torch.einsum("bctn,bchpn->bhctp", cc, entering) * torch.exp(lc).unsqueeze(-1)

        y = y + xc.permute(0, 3, 1, 2, 4) * self.d_skip.view(1, h, 1, 1, 1)
        y = y.permute(0, 2, 3, 1, 4).reshape(b, l, self.inner)  # (b, h, c, t, p) -> (b, l, h * p): a copying reshape
        return self.out_proj(self.norm(y * F.silu(z)))


def get_inputs():
    return [torch.randn(BATCH, SEQ, DIM)]


def get_init_inputs():
    return [DIM, EXPAND, HEADS, STATE, CHUNK, CONV]
