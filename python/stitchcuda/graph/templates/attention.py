"""Fused attention: a FlashAttention-style forward (prefill, encoders) and a split-KV decode pair
(flash-decoding), softmax(scale * Q K^T + mask) V with the scores never written to memory.

Prefill (`flash_attention_kernel`). A block owns BM query rows of one (batch, head); it walks the keys in
tiles of BN, staging K and V through shared memory, and keeps per row a running max and sum (fp32, the
online softmax) and the output accumulator in registers, rescaled when the max grows. Four threads share a
row: each computes BN/4 of the tile's scores (keys p, p + 4, ..) and owns D/4 of the output columns
(p, p + 4, ..), the row's max and sum combined by two shuffles. Causal blocks stop at their last row's key
tile. The mask is one broadcastable tensor [B|1, H|1, Nq, Nk] read through strides (0 where broadcast):
additive (any float dtype) or boolean (True attends, as SDPA's): a key-padding mask is a boolean mask with
strides (Nk, 0, 0, 1). GQA/MQA read kv head h / (H_q / H_kv). Q, K, V and the output are read and written
through (batch, head, token) strides, so a [B, N, H, D] projection output needs no copy.

Softmax state and accumulation are fp32 in every dtype; the output is rounded once, to the input dtype.
fp32 inputs: plain FMAs over fp32 tiles (true fp32, as eager's math is). fp16/bf16 inputs (by default):
Q K^T and P V on tensor cores through WMMA 16x16x16 fragments with fp32 accumulation (`_wmma_source`,
4 warps x 16 query rows, the probabilities rounded to the input dtype for P V as FlashAttention does);
with tensor_cores=False, the FMA kernel over converted fp32 tiles.

Budget per block of the FMA kernel (fp32 staging, floats): Q BM x (D+1), K BN x (D+1), V BN x D,
P BM x (BN+1) — the +1 pads keep the four-threads-per-row reads of Q, K and P on distinct banks. D <= 128:
BM = 64, BN = 32, 256 threads: 41.6 KB at D = 64, 74 KB at D = 128; D = 256: BM = 32, BN = 32, 128
threads, 103 KB (two blocks per H100 SM's 228 KB). Registers per thread: D/4 accumulators (16..64) +
BN/4 scores (8) + the row state, under the 255 limit at D = 256 and about 64 at D = 64. The tensor-core
kernel's budget: WmmaTiles.

Decode (`decode_attention_kernels`). One to a few query tokens per sequence against a KV cache
[B, H_kv, S_max, D] with a per-sequence length (int32 [B]), a mask, or neither. The keys are cut into `splits`
chunks, one block each (grid splits x (H_q * tokens) x B, 128 threads): each warp takes groups of four
consecutive keys (one group in four, their loads issued together), lanes hold D/32 of q and of the
accumulator, the dot products reduced by shuffles; the four warps' (max, sum, acc) are merged in shared
memory and written to a workspace; a second kernel (one block of D threads per query row) rescales and
sums the splits. Query token t of T sees keys < length - T + t + 1. Under a mask (a static cache's: every
slot there, the ones past the position masked) the block first reads DECODE_MASK_TILE mask entries at a
time, one per thread: a tile the mask drops entirely costs its mask bytes and no K or V load, and in a kept
tile a warp loads the rows of its kept keys alone (`_decode_mask_loop`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import InvalidArgumentError
from .common import CTYPE, PRELUDE, KernelCode

# -inf without <math.h> (NVRTC has none): the bit pattern of -inf.
NEG_INF = "#define NEG_INF __int_as_float(0xff800000)\n"

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 224, 256)  # multiples of 32 (decode lanes) up to 256


@dataclass(frozen=True)
class PrefillTiles:
    """Tile sizes of the prefill kernel for one head dim: BM query rows, BN keys, 4 * BM threads."""

    bm: int
    bn: int
    head_dim: int

    @property
    def threads(self) -> int:
        return 4 * self.bm

    @property
    def shared_mem(self) -> int:
        d = self.head_dim
        return 4 * (self.bm * (d + 1) + self.bn * (d + 1) + self.bn * d + self.bm * (self.bn + 1))


def prefill_tiles(head_dim: int) -> PrefillTiles:
    """BM = 64 up to D = 128 (256 threads, at most 74 KB of shared memory), BM = 32 above (the staged Q
    tile and the D/4 accumulators per thread double with D)."""
    return PrefillTiles(64 if head_dim <= 128 else 32, 32, head_dim)


def _check(dtype: torch.dtype, head_dim: int) -> None:
    if dtype not in ATTENTION_DTYPES:
        raise InvalidArgumentError(f"fused attention takes fp32, fp16 or bf16 inputs, not {dtype}; "
                                   "cast the inputs or leave the call to SDPA")
    if head_dim not in HEAD_DIMS:
        raise InvalidArgumentError(f"fused attention supports head dims {HEAD_DIMS}, not {head_dim}; "
                                   "leave this call to SDPA")


def flash_attention_kernel(name: str, *, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int,
                           head_dim: int, dtype: torch.dtype, causal: bool = False,
                           mask_dtype: torch.dtype | None = None, lse: bool = False,
                           tensor_cores: bool | None = None) -> KernelCode:
    """The prefill / encoder kernel for q [B, H, Nq, D], k and v [B, H_kv, Nk, D] (any token and head
    strides, unit stride along D). Arguments, in order: q, k, v, [mask], o, [lse (fp32 [B, H, Nq])], then
    Nq, Nk, H, H / H_kv, the (batch, head, token) strides of q, k, v and o, [the mask's four strides] and
    the scale (f32). The returned `args` carry the contiguous strides; a caller with other layouts
    replaces them. `mask_dtype`: None, torch.bool (True attends) or a float dtype (added to the scores).
    `tensor_cores` (default: for fp16/bf16): the WMMA variant (`_wmma_source`), which also needs token
    strides that are multiples of 8 elements and 16-byte aligned q, k, v; False: the FMA kernel."""
    _check(dtype, head_dim)
    if tensor_cores is None:
        tensor_cores = dtype != torch.float32
    if tensor_cores and dtype == torch.float32:
        raise InvalidArgumentError("tensor_cores takes fp16/bf16 inputs; fp32 attention runs on FMAs (true fp32)")
    if heads % kv_heads:
        raise InvalidArgumentError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if mask_dtype is not None and mask_dtype not in (torch.bool, *ATTENTION_DTYPES):
        raise InvalidArgumentError(f"an attention mask is boolean or fp32/fp16/bf16, not {mask_dtype}")
    tiles = prefill_tiles(head_dim)
    bm, bn, d = tiles.bm, tiles.bn, head_dim
    t = CTYPE[dtype]
    params = [f"const {t}* __restrict__ q", f"const {t}* __restrict__ k", f"const {t}* __restrict__ v"]
    if mask_dtype is not None:
        params.append(f"const {CTYPE[mask_dtype]}* __restrict__ mask")
    params.append(f"{t}* __restrict__ o")
    if lse:
        params.append("float* __restrict__ lse")
    params += ["long long Nq", "long long Nk", "long long H", "long long group"]
    params += [f"long long {x}s{s}" for x in "qkvo" for s in "bhn"]
    if mask_dtype is not None:
        params += ["long long msb", "long long msh", "long long msi", "long long msj"]
    params.append("float scale")

    score = _score_lines("s[j]", causal, mask_dtype)
    mask_base = f"  const {CTYPE[mask_dtype]}* mb = mask + b * msb + h * msh;" if mask_dtype is not None else ""
    if tensor_cores:
        tiles = wmma_tiles(head_dim)
        source = _wmma_source(name, params, tiles, t, causal, mask_base, lse,
                              _score_lines("Sw[r * SF + c]", causal, mask_dtype))
        bm, bn = tiles.bm, tiles.bn
    else:
        source = _fma_source(name, params, tiles, t, causal, mask_base, lse, score)
    strides = [("i64", x) for x in (heads * q_len * head_dim, q_len * head_dim, head_dim,
                                    kv_heads * kv_len * head_dim, kv_len * head_dim, head_dim,
                                    kv_heads * kv_len * head_dim, kv_len * head_dim, head_dim,
                                    heads * q_len * head_dim, q_len * head_dim, head_dim)]
    args = [("in", "q"), ("in", "k"), ("in", "v")] + ([("in", "mask")] if mask_dtype is not None else [])
    args += [("out", "o")] + ([("out", "lse")] if lse else [])
    args += [("i64", q_len), ("i64", kv_len), ("i64", heads), ("i64", heads // kv_heads)] + strides
    if mask_dtype is not None:  # a full [B, H, Nq, Nk] mask by default; broadcast dims take stride 0
        args += [("i64", heads * q_len * kv_len), ("i64", q_len * kv_len), ("i64", kv_len), ("i64", 1)]
    args.append(("f32", 1.0 / math.sqrt(head_dim)))
    what = f"{'causal ' if causal else ''}attention {batch}x{heads}(kv {kv_heads})x{q_len}x{kv_len}x{head_dim}"
    what += f" {t}, {bm}x{bn} tiles, {'WMMA tensor cores' if tensor_cores else 'FMA'}"
    return KernelCode(source, name, grid=(math.ceil(q_len / bm), batch * heads), block=tiles.threads, args=args,
                      description=what + (f", {mask_dtype} mask" if mask_dtype else ""), shared_mem=tiles.shared_mem)


def _score_lines(value: str, causal: bool, mask_dtype: torch.dtype | None) -> list[str]:
    """The statements turning one raw score `value` of query `row` and key `n` into `x` (scaled, masked)
    and `keep` (False: the key is masked out)."""
    keep = ["n < Nk", "row < Nq"] + (["n <= row"] if causal else [])
    lines = [f"      float x = {value} * scale;", f"      bool keep = {' && '.join(keep)};"]
    if mask_dtype is torch.bool:
        lines.append("      keep = keep && mb[row * msi + n * msj];")
    elif mask_dtype is not None:
        lines.append("      if (keep) x += ld(mb, row * msi + n * msj);")
    return lines


def _online_max(lanes: tuple[int, ...]) -> str:
    """The online softmax's step: the tile's row max `mx` combined over the row's lanes (xor `lanes`), the new
    running max, the factor `alpha` rescaling what was summed under the old one, and `sum` started."""
    return "\n".join([f"    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, {x}));" for x in lanes] + [
        "    const float mnew = fmaxf(m, mx);",
        "    const float base = mnew == NEG_INF ? 0.0f : mnew;  // a row masked so far keeps probabilities 0",
        "    const float alpha = expf(m - base);",
        "    float sum = 0.0f;"])


def _fma_source(name: str, params: list[str], tiles: PrefillTiles, t: str, causal: bool, mask_base: str,
                lse: bool, score: list[str]) -> str:
    bm, bn, d = tiles.bm, tiles.bn, tiles.head_dim
    return PRELUDE + NEG_INF + f"""
// Fused attention forward: {bm} query rows x {bn}-key tiles, D = {d}, {t}; fp32 online softmax.
extern "C" __global__ void __launch_bounds__({4 * bm}) {name}({", ".join(params)}) {{
  extern __shared__ float smem[];
  float* Qs = smem;                    // [{bm}][{d + 1}]
  float* Ks = Qs + {bm * (d + 1)};     // [{bn}][{d + 1}]
  float* Vs = Ks + {bn * (d + 1)};     // [{bn}][{d}]
  float* Ps = Vs + {bn * d};           // [{bm}][{bn + 1}] this tile's probabilities
  const int t = threadIdx.x, r = t >> 2, p = t & 3;
  const long long b = blockIdx.y / H, h = blockIdx.y % H, hk = h / group;
  const long long q0 = (long long)blockIdx.x * {bm}, row = q0 + r;
  const {t}* qb = q + b * qsb + h * qsh;
  const {t}* kb = k + b * ksb + hk * ksh;
  const {t}* vb = v + b * vsb + hk * vsh;
{mask_base}
  for (int i = t; i < {bm * d}; i += {4 * bm}) {{
    const int rr = i / {d}, c = i % {d};
    Qs[rr * {d + 1} + c] = q0 + rr < Nq ? ld(qb, (q0 + rr) * qsn + c) : 0.0f;
  }}
  float m = NEG_INF, l = 0.0f, acc[{d // 4}];
  #pragma unroll
  for (int i = 0; i < {d // 4}; ++i) acc[i] = 0.0f;
  const long long kend = {"(q0 + " + str(bm) + " < Nk ? q0 + " + str(bm) + " : Nk)" if causal else "Nk"};
  for (long long k0 = 0; k0 < kend; k0 += {bn}) {{
    __syncthreads();  // the previous tile's readers are done (and Q is staged, the first time)
    for (int i = t; i < {bn * d}; i += {4 * bm}) {{
      const int c = i / {d}, e = i % {d};
      const bool in = k0 + c < Nk;
      Ks[c * {d + 1} + e] = in ? ld(kb, (k0 + c) * ksn + e) : 0.0f;
      Vs[c * {d} + e] = in ? ld(vb, (k0 + c) * vsn + e) : 0.0f;
    }}
    __syncthreads();
    float s[{bn // 4}];
    #pragma unroll
    for (int j = 0; j < {bn // 4}; ++j) s[j] = 0.0f;
    for (int e = 0; e < {d}; ++e) {{
      const float qe = Qs[r * {d + 1} + e];
      #pragma unroll
      for (int j = 0; j < {bn // 4}; ++j) s[j] = fmaf(qe, Ks[(p + 4 * j) * {d + 1} + e], s[j]);
    }}
    float mx = NEG_INF;
    #pragma unroll
    for (int j = 0; j < {bn // 4}; ++j) {{
      const long long n = k0 + p + 4 * j;
{chr(10).join(score)}
      s[j] = keep ? x : NEG_INF;
      mx = fmaxf(mx, s[j]);
    }}
{_online_max((1, 2))}
    #pragma unroll
    for (int j = 0; j < {bn // 4}; ++j) {{
      const float e = expf(s[j] - base);
      sum += e;
      Ps[r * {bn + 1} + p + 4 * j] = e;
    }}
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    l = l * alpha + sum;
    m = mnew;
    #pragma unroll
    for (int i = 0; i < {d // 4}; ++i) acc[i] *= alpha;
    __syncthreads();  // the row's probabilities, written by its four threads
    for (int c = 0; c < {bn}; ++c) {{
      const float pc = Ps[r * {bn + 1} + c];
      #pragma unroll
      for (int i = 0; i < {d // 4}; ++i) acc[i] = fmaf(pc, Vs[c * {d} + p + 4 * i], acc[i]);
    }}
  }}
  if (row < Nq) {{
    const float inv = 1.0f / l;  // a row with every key masked: 0 / 0, NaN as softmax gives
    {t}* ob = o + b * osb + h * osh + row * osn;
    #pragma unroll
    for (int i = 0; i < {d // 4}; ++i) st(ob, p + 4 * i, acc[i] * inv);
{"    if (p == 0) lse[blockIdx.y * Nq + row] = m + logf(l);" if lse else ""}
  }}
}}
"""


@dataclass(frozen=True)
class WmmaTiles:
    """Tile sizes of the tensor-core prefill: BM = 64 query rows (16 per warp, 4 warps), BN keys per tile.
    Shared memory (bytes): Q, K, V tiles in the input dtype (rows padded by 8 elements: 16 bytes, which keeps
    WMMA's 32-byte fragment alignment and spreads the rows over the banks); per warp its 16 x BN fp32 scores,
    16 x BN probabilities in the input dtype and its 16 x D fp32 output accumulator (rows padded by 4)."""

    bm: int
    bn: int
    head_dim: int

    @property
    def threads(self) -> int:
        return 128

    @property
    def shared_mem(self) -> int:
        d, bm, bn = self.head_dim, self.bm, self.bn
        return 2 * (bm + 2 * bn) * (d + 8) + 4 * 16 * (2 * (bn + 8) + 4 * (bn + 4) + 4 * (d + 4))


def wmma_tiles(head_dim: int) -> WmmaTiles:
    """BN = 64 keys up to D = 128 (110 KB at D = 128, two blocks per H100 SM), 32 above (145 KB at D = 256):
    the fp32 output accumulators (64 x D) and the K/V tiles grow with D."""
    return WmmaTiles(64, 64 if head_dim <= 128 else 32, head_dim)


def _wmma_source(name: str, params: list[str], tiles: WmmaTiles, t: str, causal: bool, mask_base: str, lse: bool,
                 score: list[str]) -> str:
    """Q K^T and P V on tensor cores (WMMA 16x16x16, fp32 accumulation); the online softmax in fp32 with two
    lanes per row. The output accumulator lives in shared memory (a WMMA fragment's element-to-row mapping is
    unspecified, so its rows cannot be rescaled in registers): per key tile it is rescaled by the row's
    factor, loaded into fragments, P V added, and stored back."""
    bm, bn, d = tiles.bm, tiles.bn, tiles.head_dim
    dp, bp, sf, of = d + 8, bn + 8, bn + 4, d + 4
    vec = 4 if t == "float" else 8  # elements per 16-byte copy (float: only the CPU emulator's check uses it)
    return PRELUDE + NEG_INF + f"""#include <mma.h>
// Fused attention forward on tensor cores: {bm} query rows x {bn}-key tiles, D = {d}, {t}.
extern "C" __global__ void __launch_bounds__(128) {name}({", ".join(params)}) {{
  using namespace nvcuda;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  {t}* Qs = reinterpret_cast<{t}*>(smem_raw);  // [{bm}][{dp}]
  {t}* Ks = Qs + {bm * dp};                    // [{bn}][{dp}]
  {t}* Vs = Ks + {bn * dp};                    // [{bn}][{dp}]
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  {t}* Pw = Vs + {bn * dp} + w * {16 * bp};     // this warp's [16][{bp}] probabilities
  float* Sw = reinterpret_cast<float*>(Vs + {bn * dp} + {4 * 16 * bp}) + w * {16 * sf};  // [16][{sf}] scores
  float* Ow = reinterpret_cast<float*>(Vs + {bn * dp} + {4 * 16 * bp}) + {4 * 16 * sf} + w * {16 * of};  // [16][{of}]
  const int SF = {sf};
  const long long b = blockIdx.y / H, h = blockIdx.y % H, hk = h / group;
  const long long q0 = (long long)blockIdx.x * {bm};
  const int r = lane >> 1, half = lane & 1;  // two lanes per row of the warp's 16
  const long long row = q0 + w * 16 + r;
  const {t}* qb = q + b * qsb + h * qsh;
  const {t}* kb = k + b * ksb + hk * ksh;
  const {t}* vb = v + b * vsb + hk * vsh;
{mask_base}
  for (int i = threadIdx.x; i < {bm * d // vec}; i += 128) {{  // 16-byte copies, zero past the last query
    const int rr = i / {d // vec}, c = (i % {d // vec}) * {vec};
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (q0 + rr < Nq) val = *reinterpret_cast<const uint4*>(qb + (q0 + rr) * qsn + c);
    *reinterpret_cast<uint4*>(Qs + rr * {dp} + c) = val;
  }}
  for (int i = lane; i < {16 * d}; i += 32) Ow[(i / {d}) * {of} + i % {d}] = 0.0f;
  float m = NEG_INF, l = 0.0f;
  const long long kend = {"(q0 + " + str(bm) + " < Nk ? q0 + " + str(bm) + " : Nk)" if causal else "Nk"};
  for (long long k0 = 0; k0 < kend; k0 += {bn}) {{
    __syncthreads();  // every warp is done with the previous K, V tile (and Q is staged, the first time)
    for (int i = threadIdx.x; i < {bn * d // vec}; i += 128) {{
      const int c = i / {d // vec}, e = (i % {d // vec}) * {vec};
      uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = make_uint4(0u, 0u, 0u, 0u);
      if (k0 + c < Nk) {{
        kv = *reinterpret_cast<const uint4*>(kb + (k0 + c) * ksn + e);
        vv = *reinterpret_cast<const uint4*>(vb + (k0 + c) * vsn + e);
      }}
      *reinterpret_cast<uint4*>(Ks + c * {dp} + e) = kv;
      *reinterpret_cast<uint4*>(Vs + c * {dp} + e) = vv;
    }}
    __syncthreads();
    #pragma unroll
    for (int j = 0; j < {bn // 16}; ++j) {{  // S = Q K^T, 16 x 16 at a time (K row-major is K^T column-major)
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> s;
      wmma::fill_fragment(s, 0.0f);
      #pragma unroll
      for (int kk = 0; kk < {d // 16}; ++kk) {{
        wmma::fragment<wmma::matrix_a, 16, 16, 16, {t}, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, {t}, wmma::col_major> kt;
        wmma::load_matrix_sync(a, Qs + w * {16 * dp} + kk * 16, {dp});
        wmma::load_matrix_sync(kt, Ks + j * {16 * dp} + kk * 16, {dp});
        wmma::mma_sync(s, a, kt, s);
      }}
      wmma::store_matrix_sync(Sw + j * 16, s, {sf}, wmma::mem_row_major);
    }}
    __syncwarp();
    float mx = NEG_INF;
    for (int j = 0; j < {bn // 2}; ++j) {{
      const int c = half * {bn // 2} + j;
      const long long n = k0 + c;
{chr(10).join(score)}
      x = keep ? x : NEG_INF;
      Sw[r * {sf} + c] = x;
      mx = fmaxf(mx, x);
    }}
{_online_max((1,))}
    for (int j = 0; j < {bn // 2}; ++j) {{
      const int c = half * {bn // 2} + j;
      const float e = expf(Sw[r * {sf} + c] - base);
      sum += e;
      st(Pw, r * {bp} + c, e);
    }}
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = mnew;
    for (int c = half * {d // 2}; c < (half + 1) * {d // 2}; ++c) Ow[r * {of} + c] *= alpha;
    __syncwarp();
    #pragma unroll
    for (int j = 0; j < {d // 16}; ++j) {{  // O += P V
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, Ow + j * 16, {of}, wmma::mem_row_major);
      #pragma unroll
      for (int kk = 0; kk < {bn // 16}; ++kk) {{
        wmma::fragment<wmma::matrix_a, 16, 16, 16, {t}, wmma::row_major> p;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, {t}, wmma::row_major> vf;
        wmma::load_matrix_sync(p, Pw + kk * 16, {bp});
        wmma::load_matrix_sync(vf, Vs + kk * {16 * dp} + j * 16, {dp});
        wmma::mma_sync(acc, p, vf, acc);
      }}
      wmma::store_matrix_sync(Ow + j * 16, acc, {of}, wmma::mem_row_major);
    }}
    __syncwarp();
  }}
  if (row < Nq) {{
    const float inv = 1.0f / l;  // a row with every key masked: 0 / 0, NaN as softmax gives
    {t}* ob = o + b * osb + h * osh + row * osn;
    for (int c = half * {d // 2}; c < (half + 1) * {d // 2}; ++c) st(ob, c, Ow[r * {of} + c] * inv);
{"    if (half == 0) lse[blockIdx.y * Nq + row] = m + logf(l);" if lse else ""}
  }}
}}
"""


@dataclass
class DecodeKernels:
    """The two launches of split-KV decode and the fp32 workspace between them: `partial` writes each
    split's (max, sum) to "ws_ml" (rows x splits x 2) and its unnormalized output to "ws_acc"
    (rows x splits x D); `combine` merges them into "o" (and "lse")."""

    partial: KernelCode
    combine: KernelCode
    splits: int
    chunk: int  # keys per split
    workspace_ml: int  # floats
    workspace_acc: int  # floats


DECODE_KEYS = 4  # keys a warp of the decode kernel loads per step
DECODE_MIN_CHUNK = 64  # keys per split at the least: below, a split's fixed cost outweighs its keys
DECODE_MAX_TOKENS = 16  # query tokens per sequence the decode kernels take (one block each)
DECODE_MASK_TILE = 128  # keys whose mask entries a block reads at once (one per thread) before any K or V


def decode_splits(rows: int, max_len: int, sms: int = 132) -> int:
    """Splits per query row: enough blocks for two per SM, no split under DECODE_MIN_CHUNK keys."""
    want = math.ceil(2 * sms / max(rows, 1))
    return max(1, min(want, math.ceil(max_len / DECODE_MIN_CHUNK)))


def _decode_keys_step(valid: str, bias: str | None, per: int) -> str:
    """One warp's step over DECODE_KEYS keys n0 + u: the dot products of the keys for which `valid` (a C
    condition on u) holds, plus `bias` (a C expression on u: the additive mask) where given, folded into the
    running (m, l, acc). Only valid keys' K and V rows are loaded; the caller runs it when one key is valid
    (so the new max is finite)."""
    add = f"\n    for (int u = 0; u < {DECODE_KEYS}; ++u) dot[u] += {bias};" if bias else ""
    return f"""    float dot[{DECODE_KEYS}];
    #pragma unroll
    for (int u = 0; u < {DECODE_KEYS}; ++u) {{
      dot[u] = 0.0f;
      if ({valid}) {{
        #pragma unroll
        for (int i = 0; i < {per}; ++i) dot[u] = fmaf(qr[i], ld(kb, (n0 + u) * ksn + lane + 32 * i), dot[u]);
      }}
    }}
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {{
      #pragma unroll
      for (int u = 0; u < {DECODE_KEYS}; ++u) dot[u] += __shfl_xor_sync(0xffffffffu, dot[u], o);
    }}{add}
    float mnew = m;
    #pragma unroll
    for (int u = 0; u < {DECODE_KEYS}; ++u) if ({valid}) mnew = fmaxf(mnew, dot[u]);
    const float alpha = expf(m - mnew);  // a valid key exists, so mnew is finite
    float e[{DECODE_KEYS}];
    #pragma unroll
    for (int u = 0; u < {DECODE_KEYS}; ++u) {{
      e[u] = ({valid}) ? expf(dot[u] - mnew) : 0.0f;
      l = (u == 0 ? l * alpha : l) + e[u];
    }}
    m = mnew;
    #pragma unroll
    for (int i = 0; i < {per}; ++i) {{
      float a = acc[i] * alpha;
      #pragma unroll
      for (int u = 0; u < {DECODE_KEYS}; ++u)
        if ({valid}) a = fmaf(e[u], ld(vb, (n0 + u) * vsn + lane + 32 * i), a);
      acc[i] = a;
    }}"""


def _decode_mask_loop(mask_dtype: torch.dtype, per: int) -> str:
    """The keys [s0, s1) under a mask, DECODE_MASK_TILE at a time: the block first reads the tile's mask
    entries (one per thread, a byte or two per key against 2 x D x dtype bytes of K and V), and a tile
    with no kept key is passed over without a load of K or V; in a kept tile each warp reads the rows of
    its kept keys alone. A key is dropped where a boolean mask is False or an additive one is -inf."""
    tile = DECODE_MASK_TILE
    entry = "(mb[n * msj] ? 0.0f : NEG_INF)" if mask_dtype is torch.bool else "ld(mb, n * msj)"
    return f"""  __shared__ float bias[{tile}];  // the tile's mask as a score bias: NEG_INF where a key is dropped
  __shared__ long long kept_tile;   // the last tile with a kept key (a barrier orders its writes; no reset)
  if (threadIdx.x == 0) kept_tile = -1;
  for (long long t0 = s0; t0 < s1; t0 += {tile}) {{  // block-uniform
    const long long n = t0 + threadIdx.x;
    const float mine = n < s1 ? {entry} : NEG_INF;
    __syncthreads();  // the previous tile's readers of bias are done
    bias[threadIdx.x] = mine;
    if (mine != NEG_INF) kept_tile = t0;
    __syncthreads();
    if (kept_tile != t0) continue;  // every key of the tile dropped: its K and V are never read
    const long long t1 = t0 + {tile} < s1 ? t0 + {tile} : s1;
    for (long long n0 = t0 + w * {DECODE_KEYS}; n0 < t1; n0 += {4 * DECODE_KEYS}) {{  // warp-uniform
      float bs[{DECODE_KEYS}];
      bool any = false;
      #pragma unroll
      for (int u = 0; u < {DECODE_KEYS}; ++u) {{
        bs[u] = n0 + u < t1 ? bias[n0 + u - t0] : NEG_INF;
        any = any || bs[u] != NEG_INF;
      }}
      if (!any) continue;  // the warp's four keys dropped
{_decode_keys_step(f"bs[u] != NEG_INF", "bs[u]", per)}
    }}
  }}"""


def decode_attention_kernels(name: str, *, batch: int, heads: int, kv_heads: int, q_tokens: int, max_len: int,
                             head_dim: int, dtype: torch.dtype, lse: bool = False, splits: int | None = None,
                             sms: int = 132, mask_dtype: torch.dtype | None = None, lengths: bool | None = None,
                             strides: dict[str, tuple[int, ...]] | None = None) -> DecodeKernels:
    """Split-KV decode of q [B, H, T, D] (T = q_tokens, the newest tokens) against caches k and v
    [B, H_kv, S_max, D]. Which keys a token sees:

    - `lengths` (the default without a mask): `lengths[b]` valid keys (int32 [B], the new tokens' included);
      token t of T sees the keys before position `length - T + t + 1`;
    - `mask_dtype` (torch.bool: True attends; or a float dtype, added to the scores, -inf dropping a key): a
      mask [B|1, H|1, T|1, S_max] read through four strides (0 where broadcast), as SDPA's attn_mask; a
      run of DECODE_MASK_TILE keys the mask drops entirely is never loaded (`_decode_mask_loop`). With
      `lengths` too, both apply;
    - neither (`lengths=False`): every one of the S_max keys.

    The partial kernel takes q, k, v, [lengths], [mask], ws_ml, ws_acc, H, T, H / H_kv, chunk, the (batch,
    head, token) strides of q, k, v, [the mask's four strides] and the scale; the combine kernel ws_ml,
    ws_acc, o, [lse], H, T, the strides of o. `strides` ("q", "k", "v", "o": three each, "mask": four)
    replaces the contiguous defaults; the unit stride along D is required."""
    _check(dtype, head_dim)
    if heads % kv_heads:
        raise InvalidArgumentError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if not 1 <= q_tokens <= DECODE_MAX_TOKENS:
        raise InvalidArgumentError(f"the decode kernels take 1 to {DECODE_MAX_TOKENS} query tokens, not {q_tokens}; "
                                   "run a longer query through the prefill kernel or SDPA")
    if mask_dtype is not None and mask_dtype not in (torch.bool, *ATTENTION_DTYPES):
        raise InvalidArgumentError(f"an attention mask is boolean or fp32/fp16/bf16, not {mask_dtype}")
    lengths = mask_dtype is None if lengths is None else lengths
    rows = batch * heads * q_tokens
    splits = splits or decode_splits(rows, max_len, sms)
    chunk = math.ceil(max_len / splits)
    d, t, per = head_dim, CTYPE[dtype], head_dim // 32
    partial_params = [f"const {t}* __restrict__ q", f"const {t}* __restrict__ k", f"const {t}* __restrict__ v"]
    partial_params += ["const int* __restrict__ lengths"] if lengths else []
    partial_params += [f"const {CTYPE[mask_dtype]}* __restrict__ mask"] if mask_dtype is not None else []
    partial_params += ["float* __restrict__ ws_ml", "float* __restrict__ ws_acc",
                       "long long H", "long long T", "long long group", "long long chunk"]
    partial_params += [f"long long {x}s{s}" for x in "qkv" for s in "bhn"]
    partial_params += ["long long msb", "long long msh", "long long msi", "long long msj"] if mask_dtype else []
    partial_params.append("float scale")
    limit = ("(long long)lengths[b] - T + tok + 1;  // this token sees the keys before it" if lengths
             else f"{max_len}LL;")
    if mask_dtype is None:
        # Each warp takes DECODE_KEYS consecutive keys per step (every 4 * DECODE_KEYS-th group), their loads
        # issued together: one key at a time leaves a warp waiting on each load's latency (a chain of load,
        # FMAs, five shuffles, exp) with little memory in flight.
        keys = (f"  for (long long n0 = s0 + w * {DECODE_KEYS}; n0 < s1; n0 += {4 * DECODE_KEYS}) {{  // warp-uniform\n"
                f"{_decode_keys_step('n0 + u < s1', None, per)}\n  }}")
        mask_base = ""
    else:
        keys = _decode_mask_loop(mask_dtype, per)
        mask_base = f"  const {CTYPE[mask_dtype]}* mb = mask + b * msb + h * msh + tok * msi;\n"
    partial = PRELUDE + NEG_INF + f"""
// Split-KV decode, partial: one block per (split, head x token, batch); four warps, every fourth key each.
extern "C" __global__ void __launch_bounds__(128) {name}_partial({", ".join(partial_params)}) {{
  __shared__ float wm[4], wl[4], wacc[4][{d}];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long b = blockIdx.z, h = blockIdx.y / T, tok = blockIdx.y % T, hk = h / group;
  const long long limit = {limit}
  const long long s0 = (long long)blockIdx.x * chunk;
  const long long s1 = s0 + chunk < limit ? s0 + chunk : limit;
  const {t}* qb = q + b * qsb + h * qsh + tok * qsn;
  const {t}* kb = k + b * ksb + hk * ksh;
  const {t}* vb = v + b * vsb + hk * vsh;
{mask_base}  float qr[{per}], acc[{per}], m = NEG_INF, l = 0.0f;
  #pragma unroll
  for (int i = 0; i < {per}; ++i) {{ qr[i] = ld(qb, lane + 32 * i) * scale; acc[i] = 0.0f; }}
{keys}
  if (lane == 0) {{ wm[w] = m; wl[w] = l; }}
  #pragma unroll
  for (int i = 0; i < {per}; ++i) wacc[w][lane + 32 * i] = acc[i];
  __syncthreads();
  const float M = fmaxf(fmaxf(wm[0], wm[1]), fmaxf(wm[2], wm[3]));
  const float base = M == NEG_INF ? 0.0f : M;  // an empty split: sum 0, accumulator 0
  const long long slot = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  for (int c = threadIdx.x; c < {d}; c += 128) {{
    float a = 0.0f;
    #pragma unroll
    for (int j = 0; j < 4; ++j) a += wacc[j][c] * expf(wm[j] - base);
    ws_acc[slot * {d} + c] = a;
  }}
  if (threadIdx.x == 0) {{
    float s = 0.0f;
    for (int j = 0; j < 4; ++j) s += wl[j] * expf(wm[j] - base);
    ws_ml[slot * 2] = M;
    ws_ml[slot * 2 + 1] = s;
  }}
}}
"""
    combine_params = ["const float* __restrict__ ws_ml", "const float* __restrict__ ws_acc", f"{t}* __restrict__ o"]
    combine_params += (["float* __restrict__ lse"] if lse else []) + ["long long H", "long long T"]
    combine_params += [f"long long os{s}" for s in "bhn"]
    combine = f"""
// Split-KV decode, combine: one block of D threads per query row, the {splits} splits rescaled to one max.
extern "C" __global__ void __launch_bounds__({d}) {name}_combine({", ".join(combine_params)}) {{
  const long long row = blockIdx.x, b = row / (H * T), h = (row / T) % H, tok = row % T;
  const float* ml = ws_ml + row * {splits * 2};
  float M = NEG_INF;
  for (int s = 0; s < {splits}; ++s) M = fmaxf(M, ml[2 * s]);
  const float base = M == NEG_INF ? 0.0f : M;
  float den = 0.0f, num = 0.0f;
  for (int s = 0; s < {splits}; ++s) {{
    const float f = expf(ml[2 * s] - base);
    den += ml[2 * s + 1] * f;
    num += ws_acc[(row * {splits} + s) * {d} + threadIdx.x] * f;
  }}
  st(o + b * osb + h * osh + tok * osn, threadIdx.x, num / den);  // every key dropped: 0 / 0, NaN as SDPA
{"  if (threadIdx.x == 0) lse[row] = M + logf(den);" if lse else ""}
}}
"""
    qs = (heads * q_tokens * d, q_tokens * d, d)
    kvs = (kv_heads * max_len * d, max_len * d, d)
    given = strides or {}
    st = {"q": qs, "k": kvs, "v": kvs, "o": qs,
          "mask": (heads * q_tokens * max_len, q_tokens * max_len, max_len, 1)} | given
    partial_args = [("in", "q"), ("in", "k"), ("in", "v")] + ([("in", "lengths")] if lengths else [])
    partial_args += [("in", "mask")] if mask_dtype is not None else []
    partial_args += [("out", "ws_ml"), ("out", "ws_acc"), ("i64", heads), ("i64", q_tokens),
                     ("i64", heads // kv_heads), ("i64", chunk)]
    partial_args += [("i64", x) for x in (*st["q"], *st["k"], *st["v"])]
    partial_args += [("i64", x) for x in st["mask"]] if mask_dtype is not None else []
    partial_args.append(("f32", 1.0 / math.sqrt(d)))
    combine_args = [("in", "ws_ml"), ("in", "ws_acc"), ("out", "o")] + ([("out", "lse")] if lse else [])
    combine_args += [("i64", heads), ("i64", q_tokens)] + [("i64", x) for x in st["o"]]
    seen = [f"{mask_dtype} mask"] * (mask_dtype is not None) + ["lengths"] * lengths
    what = (f"decode {batch}x{heads}(kv {kv_heads})x{q_tokens} over {max_len} keys ({' and '.join(seen) or 'all'}), "
            f"D = {d}, {t}")
    return DecodeKernels(
        KernelCode(partial, f"{name}_partial", grid=(splits, heads * q_tokens, batch), block=128, args=partial_args,
                   description=f"{what}: {splits} splits of {chunk} keys"),
        KernelCode(PRELUDE + NEG_INF + combine, f"{name}_combine", grid=rows, block=d, args=combine_args,
                   description=f"{what}: combine of {splits} splits"),
        splits, chunk, rows * splits * 2, rows * splits * d)
