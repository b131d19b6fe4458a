"""Fused attention: a FlashAttention-style forward (prefill, encoders) and a split-KV decode pair
(flash-decoding), softmax(scale * Q K^T + mask) V with the scores never written to memory.

Prefill (`flash_attention_kernel`). A block owns BM query rows of one (batch, head); it walks the keys in
tiles of BN, staging K and V through shared memory, and keeps per row a running max and sum (fp32, the
online softmax) and the output accumulator in registers, rescaled when the max grows. Causal blocks stop
at their last row's key tile. The mask is one broadcastable tensor [B|1, H|1, Nq, Nk] read through strides
(0 where broadcast): additive (any float dtype) or boolean (True attends, as SDPA's): a key-padding mask is
a boolean mask with strides (Nk, 0, 0, 1). GQA/MQA read kv head h / (H_q / H_kv). Q, K, V and the output
are read and written through (batch, head, token) strides, so a [B, N, H, D] projection output needs no
copy.

Softmax state and accumulation are fp32 in every dtype; the output is rounded once, to the input dtype.
fp32 inputs: FMAs over fp32 tiles (true fp32, as eager's math is: no TF32), register-tiled (below).
fp16/bf16 inputs (by default): Q K^T and P V on tensor cores with fp32 accumulation, the probabilities
rounded to the input dtype for P V as FlashAttention does: at head dims 64 and 128 through mma.sync with
the scores, probabilities and output in registers (flash_mma.py), at the others (or mma=False) through
WMMA 16x16x16 fragments (`_wmma_source`, 4 warps x 16 query rows); with tensor_cores=False, the FMA kernel
over converted fp32 tiles.

The fp32 FMA kernel's floor. Attention is 4 B H Nq Nk D FLOPs (half under causal), all FMAs at fp32: no
tensor core computes true fp32, and the H100's FP32 rate is 67 TFLOP/s (132 SMs x 128 lanes x 2 x 1.98
GHz). Its bytes (q, k, v, o) are a few percent of that time, so the bound is the FMA issue rate:

    shape (fp32, D = 64)          GFLOP   at 67 TFLOP/s   SDPA memory-efficient, measured (TFLOP/s)
    1x32x2048, causal (Llama)      17.2      256 us          775 us (22)
    64x12x197 (ViT-B)               7.6      114 us          424 us (18)
    32x12x512 (BERT-base)          25.8      385 us          823 us (31)
    32x8x256                        4.3       64 us
    32x16x512                      34.4      513 us
    32x16x1024                    137.4     2051 us

(the measured column: the first benchmark run, docs/attention.md). The memory-efficient backend (CUTLASS
SIMT at fp32) reaches a quarter to a half of the FMA rate; the bar is to beat it.

The old kernel gave a row 4 threads, each reading the query row's element from shared memory for every
key's FMA: one shared-memory load per FMA, bound by shared memory at a fraction of the FMA rate. Now each
thread computes a TM x 4 micro-tile of S (TM query rows x 4 keys) from TM + 4 float4 loads a step of 4
along D, 16 TM FMAs (64 at TM = 4: 8 FMAs a load instruction), and a TM x D/8 tile of O the same way
(TM float4 of P and D/8 float4 of V rows per 4 keys, 4 TM D/8 FMAs). 8 lanes share a row (its max and sum
in 3 shuffles); a warp is 4 row groups x 8 lanes, so a float4 read of Q or P serves 4 rows on 4 distinct
bank groups and of K 8 keys (pads of 4 floats), one 128-byte shared-memory wavefront either way, against
16 TM FMA instructions: at TM = 4 and full FMA rate, half the shared-memory bandwidth in S and 3/8 in P V.
K and V tiles are double-buffered with 16-byte cp.async copies (fp32 with 16-byte aligned rows; element
loads otherwise), the next tile's issued before this one's products. Per tile and thread at D = 64, TM = 4:
2,048 FMAs against about 700 other instructions (loads, the softmax's exp, max and mask, the rescale):
about 73% of the issue slots are FMAs, ~49 TFLOP/s at best, 1.5-2.5x the memory-efficient backend's
rate above; tiles past Nq or Nk waste their share (ViT's 197 tokens: 256 rows x 224 keys computed).
Tiles (`PrefillTiles`): D <= 128: BM = 128, TM = 4, BN = 32, 256 threads, 87 KB of shared memory at D = 64
(two blocks an SM, the launch bound capping the registers at 128: 124-128 used), 151 KB at D = 128 (168-226
registers); D > 128: BM = 64, TM = 2 (the D/8 x TM accumulators), 204 KB at D = 256. Causal grids launch
every head's last query block first; without a mask, tiles inside Nq x Nk (under the diagonal, causal)
skip the per-score tests. Unmeasured: it has not run on a GPU. The tensor-core kernel's budget:
WmmaTiles.

Decode (`decode_attention_kernels`). One to a few query tokens per sequence against a KV cache
[B, H_kv, S_max, D] with a per-sequence length (int32 [B]), a mask, or neither. Its time is its bytes: each
K and V row is read for a few dot products. The floor at the bench's shapes (32 query / 8 KV heads, D = 128,
bf16: K and V are 4,096 bytes per key per sequence over the 8 KV heads; 3.35 TB/s on an H100):

    batch, keys    K + V bytes   at DRAM bandwidth   blocks (splits)   old kernel's blocks (splits)
    1, 512           2.1 MB        0.63 us             64 (8)             256 (8)
    1, 2048          8.4 MB        2.5 us             256 (32)            288 (9)
    8, 512          16.8 MB        5.0 us             320 (5)             512 (2)
    8, 2048         67.1 MB       20.0 us             320 (5)             512 (2)
    32, 512         67.1 MB       20.0 us             512 (2)            1024 (1)
    32, 2048       268.4 MB       80.1 us             512 (2)            1024 (1)

(q and the output add 16 KB per sequence.) Filling 132 SMs twice takes 264 blocks. The old kernel ran one block
per query head: a KV row was read by the 4 heads of its group (4x the bytes through L2, once from DRAM at
best), with 2-byte scalar loads (a warp's load instruction covered 64 bytes of one key; 4 keys, 256 bytes, in
flight a warp), and chose splits per query row, so batch 8 and 32 had 1-2 splits. At batch 1 and 512 keys
the floor is under a microsecond: the two launches, not the bytes, bound it there.

Now a partial block serves one (split, KV head, batch) and all the group x T query rows reading that KV
head (at most DECODE_MAX_ROWS, their q and accumulators in registers; more rows take more row blocks), so each
kept K and V row is loaded from memory once per KV head (`DecodeLayout`): 16-byte loads (8 halves / 4
floats a lane), D / 8 lanes a row at 16 bits (16 at D = 128: two keys a load instruction), 4 loads of K and
4 of V in flight a lane before the first use (8 keys, 4 KB a warp at D = 128 bf16; 2 of each with 8 rows),
the dots of every row from the same registers, reduced over the row's lanes, an online softmax per row and
key group, the key groups merged by shuffles and the 4 warps in shared memory, the split's (max, sum,
accumulator) per row written to an fp32 workspace; a second kernel (one block of D threads per query row)
rescales and sums the splits. Splits (`decode_splits`): batch x KV heads x row blocks x splits fills the SMs
twice, no split under DECODE_MIN_CHUNK keys. Query token t of T sees keys < length - T + t + 1. Under a mask
(a static cache's: every slot there, the ones past the position masked) the block first reads
DECODE_MASK_TILE keys' mask entries for its rows, one key per thread: a tile no row keeps a key of costs its
mask bytes and no K or V load, and in a kept tile a warp loads the rows of the keys some row keeps
(`_decode_mask_loop`); a row that drops a key another row keeps weighs it by probability 0.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

import torch

from ...errors import InvalidArgumentError
from .common import CTYPE, PRELUDE, KernelCode
from .flash_mma import MMA_HEAD_DIMS, MmaTiles, flash_mma_source, mma_tiles

# -inf without <math.h> (NVRTC has none): the bit pattern of -inf.
NEG_INF = "#define NEG_INF __int_as_float(0xff800000)\n"

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 224, 256)  # multiples of 32 (decode lanes) up to 256


# The FMA prefill kernel's thread layout: 8 lanes share a query row (a row's max and sum are 3 shuffles), each
# lane holding 4 of a tile's keys (BN = 32). Fixed, not tuning knobs: _fma_source's indexing (4 row groups a
# warp, V columns 32 x + 4 cg) and its bank-conflict analysis are written for these values.
PREFILL_LANES, PREFILL_KEYS = 8, 4


@dataclass(frozen=True)
class PrefillTiles:
    """Tile sizes of the FMA prefill kernel for one head dim: BM query rows, BN keys a tile, `rows` (TM) query
    rows a thread; BM / TM row groups of 8 lanes (8 BM / TM threads). Shared memory (floats): Q [BM][D + 4], K
    [2][BN][D + 4] and V [2][BN][D] (two stages), P [BM][BN + 8]; the pads put the float4 reads of a warp's
    4 rows of Q and P and 8 keys of K on distinct banks, and P's scalar writes too."""

    bm: int
    bn: int
    head_dim: int
    rows: int

    @property
    def row_groups(self) -> int:
        return self.bm // self.rows

    @property
    def threads(self) -> int:
        return PREFILL_LANES * self.row_groups

    @property
    def blocks_per_sm(self) -> int:
        """Blocks an H100 SM holds by shared memory (228 KB, 1 KB reserved a block): 2 up to D = 80, else 1.
        It is the fp32 kernel's launch bound, so ptxas neither caps the registers below what one block may use
        (it chose 128 and spilled at D = 96) nor lets them exceed 128 where two blocks fit."""
        return 2 if 2 * (self.shared_mem + 1024) <= 228 * 1024 else 1

    @property
    def q_pitch(self) -> int:
        return self.head_dim + 4

    @property
    def k_pitch(self) -> int:
        return self.head_dim + 4

    @property
    def p_pitch(self) -> int:
        return self.bn + 8

    @property
    def shared_mem(self) -> int:
        d = self.head_dim
        return 4 * (self.bm * self.q_pitch + 2 * self.bn * (self.k_pitch + d) + self.bm * self.p_pitch)


def fma_tile_candidates(head_dim: int) -> list[PrefillTiles]:
    """The FMA prefill's tilings bench.attention times side by side at fp32 (the default first): BM x TM of
    128 x 4 (the default), 64 x 4 (two blocks an SM where 128 rows fit one: each block waits at its own
    barriers while the other computes), 64 x 2 (256 threads of at most 128 registers, twice the warps an SM
    at D = 128: more latency hidden, 6 loads per 32 FMAs instead of 8 per 64) and 32 x 2. Those that do not
    fit (shared memory, 4 row groups a warp) are left out."""
    tiles = [prefill_tiles(head_dim)]
    for bm, tm in ((128, 4), (64, 4), (64, 2), (32, 2)):
        t = PrefillTiles(bm, PREFILL_LANES * PREFILL_KEYS, head_dim, tm)
        if t not in tiles and _tiles_fit(t) is None:
            tiles.append(t)
    return tiles


def _tiles_fit(tiles: PrefillTiles) -> str | None:
    """Why the FMA kernel cannot take `tiles` (None: it can)."""
    if tiles.bn != PREFILL_LANES * PREFILL_KEYS:
        return f"BN must be {PREFILL_LANES * PREFILL_KEYS} (8 lanes x 4 keys), not {tiles.bn}"
    if tiles.rows < 1 or tiles.bm % tiles.rows or tiles.row_groups % 4:
        return (f"BM ({tiles.bm}) must be TM ({tiles.rows}) times a multiple of 4 row groups (a warp is 4 row "
                "groups of 8 lanes)")
    if tiles.threads > 1024:
        return f"{tiles.threads} threads a block is over 1,024"
    if tiles.shared_mem > 227 * 1024:
        return f"{tiles.shared_mem} bytes of shared memory is over the H100's 227 KB a block"
    return None


def prefill_tiles(head_dim: int) -> PrefillTiles:
    """BM = 128, 4 rows a thread up to D = 128 (87 KB of shared memory at D = 64: two blocks an SM; 151 KB at
    D = 128); BM = 64, 2 rows a thread above (204 KB at D = 256), so the TM x D / 8 output accumulators stay
    at 64 registers or fewer."""
    if head_dim <= 128:
        return PrefillTiles(128, PREFILL_LANES * PREFILL_KEYS, head_dim, 4)
    return PrefillTiles(64, PREFILL_LANES * PREFILL_KEYS, head_dim, 2)


_CP_ASYNC = r"""
// 16-byte global -> shared copies completing asynchronously (cp.async, sm_80+). Compiled as plain C++ (the CPU
// emulator, where __CUDA_ARCH__ is not defined) they are ordinary copies, and the waits are no-ops.
__device__ __forceinline__ void cp_async16(float* dst, const float* src) {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
#else
  *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(src);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}
"""


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
                           tensor_cores: bool | None = None, mma: bool | None = None,
                           fma_tiles: PrefillTiles | None = None) -> KernelCode:
    """The prefill / encoder kernel for q [B, H, Nq, D], k and v [B, H_kv, Nk, D] (any token and head
    strides, unit stride along D). Arguments, in order: q, k, v, [mask], o, [lse (fp32 [B, H, Nq])], then
    Nq, Nk, H, H / H_kv, the (batch, head, token) strides of q, k, v and o, [the mask's four strides] and
    the scale (f32). The returned `args` carry the contiguous strides; a caller with other layouts
    replaces them. `mask_dtype`: None, torch.bool (True attends) or a float dtype (added to the scores).
    `tensor_cores` (default: for fp16/bf16): the WMMA variant (`_wmma_source`), which also needs token
    strides that are multiples of 8 elements and 16-byte aligned q, k, v; False: the FMA kernel. `mma`
    (default: where it applies, head dims 64 and 128): the tensor-core kernel is the mma.sync one
    (flash_mma.py: scores, probabilities and output in registers) rather than WMMA; same contract.
    `fma_tiles`: the FMA kernel's tiling (default prefill_tiles(head_dim); fma_tile_candidates lists others)."""
    _check(dtype, head_dim)
    if tensor_cores is None:
        tensor_cores = dtype != torch.float32
    if tensor_cores and dtype == torch.float32:
        raise InvalidArgumentError("tensor_cores takes fp16/bf16 inputs; fp32 attention runs on FMAs (true fp32)")
    if mma and not (tensor_cores and head_dim in MMA_HEAD_DIMS):
        raise InvalidArgumentError(f"mma=True takes fp16/bf16 inputs on tensor cores at head dims {MMA_HEAD_DIMS}, "
                                   f"not {dtype} at {head_dim}; leave mma unset to pick the kernel")
    if heads % kv_heads:
        raise InvalidArgumentError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if mask_dtype is not None and mask_dtype not in (torch.bool, *ATTENTION_DTYPES):
        raise InvalidArgumentError(f"an attention mask is boolean or fp32/fp16/bf16, not {mask_dtype}")
    if fma_tiles is not None:
        why = _tiles_fit(fma_tiles) or (None if fma_tiles.head_dim == head_dim else
                                        f"the tiles are for head dim {fma_tiles.head_dim}, not {head_dim}")
        if why is not None or tensor_cores:
            raise InvalidArgumentError(f"fma_tiles: {why or 'the FMA kernel only (tensor_cores=False or fp32)'}; "
                                       "take one of fma_tile_candidates(head_dim)")
    tiles = fma_tiles or prefill_tiles(head_dim)
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
    if tensor_cores and mma is not False and head_dim in MMA_HEAD_DIMS:
        tiles = mma_tiles(head_dim, mask_dtype is not None)
        source = flash_mma_source(name, params, tiles, t, causal, mask_dtype, lse)
        bm, bn = tiles.bm, tiles.bn
    elif tensor_cores:
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
    engine = ("mma.sync tensor cores" if isinstance(tiles, MmaTiles) else "WMMA tensor cores") if tensor_cores else "FMA"
    what += f" {t}, {bm}x{bn} tiles, {engine}"
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
    """The register-tiled FMA kernel (fp32 inputs; fp16/bf16 with tensor_cores=False, over tiles converted to
    fp32). Lane cg (0..7) of row group rg (4 a warp) owns the query rows rg + RG * i (i < TM; RG row groups,
    so a warp's float4 reads of Q and P touch 4 consecutive rows), of S the keys cg + 8 * j (8 consecutive K
    rows a read) and of O the columns 32 * x + 4 * cg + (0..3) (a warp reads 8 consecutive float4 of a V
    row). Per tile: S in registers, its row max and sum over the 8 lanes by shuffles, P through shared
    memory to the lanes of the same rows, O rescaled in registers. K and V are double-buffered: the next
    tile's copies are issued before this one's products."""
    bm, bn, d, tm, tn = tiles.bm, tiles.bn, tiles.head_dim, tiles.rows, PREFILL_KEYS
    rg_total, threads, qp, kp, pp = tiles.row_groups, tiles.threads, tiles.q_pitch, tiles.k_pitch, tiles.p_pitch
    cols, pieces = d // PREFILL_LANES, d // (4 * PREFILL_LANES)
    fp32 = t == "float"
    # K and V tile copies: 16-byte cp.async (fp32, aligned rows; no registers, overlapping the tile computed
    # meanwhile) or element loads converted to fp32 (fp16/bf16, unaligned fp32), the same layout either way.
    copy = f"""      if (vec && in) {{
        cp_async16(Kd + c * {kp} + e, kb + n * ksn + e);
        cp_async16(Vd + c * {d} + e, vb + n * vsn + e);
        continue;
      }}
""" if fp32 else ""
    vec = ("  const bool vec = ((reinterpret_cast<unsigned long long>(kb) | reinterpret_cast<unsigned long long>(vb)) "
           "& 15) == 0 && ksn % 4 == 0 && vsn % 4 == 0;  // 16-byte copies\n") if fp32 else ""
    pv = "\n".join(f"""      #pragma unroll
      for (int x = 0; x < {pieces}; ++x) {{  // key c + {u}
        const float4 vf = *reinterpret_cast<const float4*>(Vt + (c + {u}) * {d} + 32 * x + 4 * cg);
        #pragma unroll
        for (int i = 0; i < {tm}; ++i) {{
          acc[i][4 * x] = fmaf(pf[i].{w}, vf.x, acc[i][4 * x]);
          acc[i][4 * x + 1] = fmaf(pf[i].{w}, vf.y, acc[i][4 * x + 1]);
          acc[i][4 * x + 2] = fmaf(pf[i].{w}, vf.z, acc[i][4 * x + 2]);
          acc[i][4 * x + 3] = fmaf(pf[i].{w}, vf.w, acc[i][4 * x + 3]);
        }}
      }}""" for u, w in enumerate("xyzw"))
    # fp16/bf16 tiles (tensor_cores=False, a fallback) are converted through registers: under the 128-register
    # bound of two blocks an SM ptxas spilled at D = 64, so they ask for one
    blocks = tiles.blocks_per_sm if fp32 else 1
    # Without a mask, a tile inside Nq x Nk (and under the diagonal, causal) keeps every score: it skips the
    # per-score tests (block-uniform), most tiles of a long sequence.
    inside = f"k0 + {bn} <= Nk && q0 + {bm} <= Nq" + (f" && k0 + {bn} <= q0 + 1" if causal else "")
    tested = f"""    #pragma unroll
    for (int j = 0; j < {tm * tn}; ++j) {{
      const long long row = q0 + rg + {rg_total} * (j / {tn}), n = k0 + cg + 8 * (j % {tn});
{chr(10).join(score)}
      s[j] = keep ? x : NEG_INF;
      rmax[j / {tn}] = fmaxf(rmax[j / {tn}], s[j]);
    }}"""
    tested = tested if mask_base else textwrap.indent(tested, "  ")
    whole = "" if mask_base else f"""    if ({inside}) {{
      #pragma unroll
      for (int j = 0; j < {tm * tn}; ++j) {{
        s[j] *= scale;
        rmax[j / {tn}] = fmaxf(rmax[j / {tn}], s[j]);
      }}
    }} else {{
"""
    # causal: blocks launch in linear order; the first gridDim.y run the last query block (the most keys) of every
    # (batch, head), and so on, so the short blocks fill in at the end
    order = ("  const long long lin = (long long)blockIdx.y * gridDim.x + blockIdx.x;\n"
             f"  const long long bh = lin % gridDim.y, q0 = (gridDim.x - 1 - lin / gridDim.y) * {bm};"
             if causal else f"  const long long bh = blockIdx.y, q0 = (long long)blockIdx.x * {bm};")
    return PRELUDE + NEG_INF + _CP_ASYNC + f"""
// Fused attention forward, register-tiled FMAs: {bm} query rows x {bn}-key tiles, D = {d}, {t}; fp32 online
// softmax. {threads} threads: 8 lanes a row group, {rg_total} row groups of {tm} rows (rg + {rg_total} i), each
// lane {tm} x {tn} scores (keys cg + 8 j) and {tm} x {cols} outputs (columns 32 x + 4 cg + 0..3).
extern "C" __global__ void __launch_bounds__({threads}, {blocks}) {name}({", ".join(params)}) {{
  extern __shared__ float smem[];
  float* Qs = smem;  // [{bm}][{qp}]
  float* Ks = Qs + {bm * qp};  // [2][{bn}][{kp}]
  float* Vs = Ks + {2 * bn * kp};  // [2][{bn}][{d}]
  float* Ps = Vs + {2 * bn * d};  // [{bm}][{pp}] this tile's probabilities
  const int tid = threadIdx.x, lane = tid & 31, cg = lane & 7, rg = (tid >> 5) * 4 + (lane >> 3);
{order}
  const long long b = bh / H, h = bh % H, hk = h / group;
  const {t}* qb = q + b * qsb + h * qsh;
  const {t}* kb = k + b * ksb + hk * ksh;
  const {t}* vb = v + b * vsb + hk * vsh;
{mask_base}
{vec}  for (int i = tid; i < {bm * d // 4}; i += {threads}) {{
    const int r = i / {d // 4}, e = (i % {d // 4}) * 4;
    const long long n = q0 + r;
    float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (n < Nq) x = make_float4(ld(qb, n * qsn + e), ld(qb, n * qsn + e + 1), ld(qb, n * qsn + e + 2),
                                ld(qb, n * qsn + e + 3));
    *reinterpret_cast<float4*>(Qs + r * {qp} + e) = x;
  }}
  // The K and V rows of keys [k0, k0 + {bn}) into buffer `buf` (zeros past Nk).
  auto stage = [&](long long k0, int buf) {{
    float* Kd = Ks + buf * {bn * kp};
    float* Vd = Vs + buf * {bn * d};
    for (int i = tid; i < {bn * d // 4}; i += {threads}) {{
      const int c = i / {d // 4}, e = (i % {d // 4}) * 4;
      const long long n = k0 + c;
      const bool in = n < Nk;
{copy}      float4 kx = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vx = kx;
      if (in) {{
        const long long x = n * ksn + e, y = n * vsn + e;
        kx = make_float4(ld(kb, x), ld(kb, x + 1), ld(kb, x + 2), ld(kb, x + 3));
        vx = make_float4(ld(vb, y), ld(vb, y + 1), ld(vb, y + 2), ld(vb, y + 3));
      }}
      *reinterpret_cast<float4*>(Kd + c * {kp} + e) = kx;
      *reinterpret_cast<float4*>(Vd + c * {d} + e) = vx;
    }}
    cp_async_commit();
  }};
  float mr[{tm}], lr[{tm}], acc[{tm}][{cols}];
  #pragma unroll
  for (int i = 0; i < {tm}; ++i) {{
    mr[i] = NEG_INF;
    lr[i] = 0.0f;
    #pragma unroll
    for (int x = 0; x < {cols}; ++x) acc[i][x] = 0.0f;
  }}
  const long long kend = {f"(q0 + {bm} < Nk ? q0 + {bm} : Nk)" if causal else "Nk"};
  if (kend > 0) stage(0, 0);
  int buf = 0;
  for (long long k0 = 0; k0 < kend; k0 += {bn}, buf ^= 1) {{
    cp_async_wait_all();
    __syncthreads();  // this tile is in `buf` (Q too, the first time); every thread is done with the last one
    if (k0 + {bn} < kend) stage(k0 + {bn}, buf ^ 1);  // the next tile lands while this one is computed
    const float* Kt = Ks + buf * {bn * kp};
    const float* Vt = Vs + buf * {bn * d};
    float s[{tm * tn}];
    #pragma unroll
    for (int j = 0; j < {tm * tn}; ++j) s[j] = 0.0f;
    #pragma unroll 2  // two steps' loads in flight; no spill at any head dim (a test checks ptxas's report)
    for (int e = 0; e < {d}; e += 4) {{  // S = Q K^T: {tm} + {tn} float4 loads feed {16 * tm} FMAs
      float4 qf[{tm}], kf[{tn}];
      #pragma unroll
      for (int i = 0; i < {tm}; ++i) qf[i] = *reinterpret_cast<const float4*>(Qs + (rg + {rg_total} * i) * {qp} + e);
      #pragma unroll
      for (int j = 0; j < {tn}; ++j) kf[j] = *reinterpret_cast<const float4*>(Kt + (cg + 8 * j) * {kp} + e);
      #pragma unroll
      for (int i = 0; i < {tm}; ++i) {{
        #pragma unroll
        for (int j = 0; j < {tn}; ++j) {{
          float a = s[i * {tn} + j];
          a = fmaf(qf[i].x, kf[j].x, a);
          a = fmaf(qf[i].y, kf[j].y, a);
          a = fmaf(qf[i].z, kf[j].z, a);
          s[i * {tn} + j] = fmaf(qf[i].w, kf[j].w, a);
        }}
      }}
    }}
    float rmax[{tm}];
    #pragma unroll
    for (int i = 0; i < {tm}; ++i) rmax[i] = NEG_INF;
{whole}{tested}
{"    }" if whole else ""}
    #pragma unroll
    for (int i = 0; i < {tm}; ++i) {{
      float mx = rmax[i];
      const float m = mr[i];
{textwrap.indent(_online_max((1, 2, 4)), "  ")}
      #pragma unroll
      for (int j = 0; j < {tn}; ++j) {{
        const float p = expf(s[i * {tn} + j] - base);
        sum += p;
        Ps[(rg + {rg_total} * i) * {pp} + cg + 8 * j] = p;
      }}
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      lr[i] = lr[i] * alpha + sum;
      mr[i] = mnew;
      #pragma unroll
      for (int x = 0; x < {cols}; ++x) acc[i][x] *= alpha;
    }}
    __syncthreads();  // the tile's probabilities, written by the rows' 8 lanes
    #pragma unroll 2
    for (int c = 0; c < {bn}; c += 4) {{  // O += P V: {tm} + {4 * pieces} float4 loads feed {16 * tm * pieces} FMAs
      float4 pf[{tm}];
      #pragma unroll
      for (int i = 0; i < {tm}; ++i) pf[i] = *reinterpret_cast<const float4*>(Ps + (rg + {rg_total} * i) * {pp} + c);
{pv}
    }}
  }}
  #pragma unroll
  for (int i = 0; i < {tm}; ++i) {{
    const long long row = q0 + rg + {rg_total} * i;
    if (row >= Nq) continue;
    const float inv = 1.0f / lr[i];  // a row with every key masked: 0 / 0, NaN as softmax gives
    {t}* ob = o + b * osb + h * osh + row * osn;
    #pragma unroll
    for (int x = 0; x < {cols}; ++x) st(ob, 32 * (x / 4) + 4 * cg + x % 4, acc[i][x] * inv);
{"    if (cg == 0) lse[bh * Nq + row] = mr[i] + logf(lr[i]);" if lse else ""}
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
    (rows x splits x D), a row being one (batch, query head, token) in that order; `combine` merges them
    into "o" (and "lse")."""

    partial: KernelCode
    combine: KernelCode
    splits: int
    chunk: int  # keys per split
    workspace_ml: int  # floats
    workspace_acc: int  # floats
    layout: "DecodeLayout"


DECODE_MIN_CHUNK = 64  # keys per split at the least: below, a split's fixed cost outweighs its keys
DECODE_MAX_TOKENS = 16  # query tokens per sequence the decode kernels take
DECODE_MASK_TILE = 128  # keys whose mask entries a block reads at once (one per thread) before any K or V
DECODE_WARPS = 4  # warps of a partial block (128 threads: one mask entry each)
DECODE_MAX_ROWS = 8  # query rows a partial block serves at most (their q and accumulators live in registers)


@dataclass(frozen=True)
class DecodeLayout:
    """How a partial block of the decode kernel reads K and V. A block serves one (split, KV head, batch) and
    `rows` of the query rows reading that KV head (the group's heads x the tokens, `row_blocks` blocks when
    there are more than DECODE_MAX_ROWS). Each lane loads `vec` elements at once (16 bytes: 4 floats or 8
    halves); `lanes` lanes cover one K or V row (D / vec rounded up to a power of two, at most 32; a lane
    takes `per` vectors of the row), so one load instruction of a warp covers `keys_per_load` = 32 / lanes
    keys, and each lane issues `unroll` such loads of K and of V before the first use."""

    head_dim: int
    vec: int
    lanes: int
    per: int
    unroll: int
    rows: int
    row_blocks: int

    @property
    def vectors(self) -> int:
        """16-byte vectors in one K or V row."""
        return self.head_dim // self.vec

    @property
    def keys_per_load(self) -> int:
        return 32 // self.lanes

    @property
    def warp_keys(self) -> int:
        """Keys one warp loads per step (every lane's K and V loads in flight together)."""
        return self.keys_per_load * self.unroll

    @property
    def block_keys(self) -> int:
        return DECODE_WARPS * self.warp_keys


def decode_layout(head_dim: int, dtype: torch.dtype, group_rows: int, lanes: int | None = None) -> DecodeLayout:
    """The layout for D = head_dim, the input dtype and `group_rows` (= H / H_kv x T) query rows per KV head:
    16-byte loads, `unroll` chosen so that each lane has 128 bytes of K and V in flight per step, at most
    DECODE_MAX_ROWS rows a block (per lane: rows x vec x per floats of q and as many of the accumulator,
    rows x unroll scores; 8 rows keep that near 160 registers at D = 128 bf16), spread evenly. `lanes` (a power
    of two up to the default, the row's vectors rounded up to a power of two) gives a key fewer lanes, each more
    of its vectors: fewer shuffles per score (log2 lanes steps) for more registers (decode_lane_candidates)."""
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    vectors = head_dim // vec
    widest = min(32, 1 << (vectors - 1).bit_length())
    if lanes is not None and (lanes < 1 or lanes & (lanes - 1) or lanes > widest):
        raise InvalidArgumentError(f"decode lanes must be a power of two from 1 to {widest} at head dim {head_dim} "
                                   f"and {dtype}, not {lanes}; take one of decode_lane_candidates")
    lanes = lanes or widest
    per = math.ceil(vectors / lanes)
    row_blocks = math.ceil(group_rows / DECODE_MAX_ROWS)
    rows = math.ceil(group_rows / row_blocks)
    in_flight = 4 if rows * vec * per <= 32 else 2  # 16-byte vectors of K (and of V) a lane loads per step
    return DecodeLayout(head_dim, vec, lanes, per, max(1, in_flight // per), rows, row_blocks)


def decode_lane_candidates(head_dim: int, dtype: torch.dtype) -> list[int]:
    """Lanes a key the bench times (the default first): the default and half of it, where half still has 4
    lanes (a lane then holds twice the vectors of q and of the accumulator a row)."""
    widest = decode_layout(head_dim, dtype, 1).lanes
    return [widest] + ([widest // 2] if widest // 2 >= 4 else [])


def decode_splits(blocks: int, max_len: int, sms: int = 132) -> int:
    """Splits of the keys: enough that `blocks` (batch x KV heads x row blocks) x splits fills the SMs at
    least twice, no split under DECODE_MIN_CHUNK keys."""
    want = math.ceil(2 * sms / max(blocks, 1))
    return max(1, min(want, math.ceil(max_len / DECODE_MIN_CHUNK)))


# 16-byte loads of K and V rows (`kv_load`: `vec` false where the pointer or the token stride is not 16-byte
# aligned, then element by element) and their conversion to fp32 (`kv_unpack`), for one input dtype: each
# source holds its own dtype's alone (an fp32 source no 16-bit line, which the CPU emulator lacks).
_KV_IO = {
    torch.float32: r"""
typedef float4 kvraw;
__device__ __forceinline__ kvraw kv_zero() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
__device__ __forceinline__ kvraw kv_load(const float* p, long long i, bool vec) {
  return vec ? *reinterpret_cast<const float4*>(p + i) : make_float4(p[i], p[i + 1], p[i + 2], p[i + 3]);
}
__device__ __forceinline__ void kv_unpack(kvraw r, float* f) { f[0] = r.x; f[1] = r.y; f[2] = r.z; f[3] = r.w; }
""",
    torch.float16: r"""
typedef uint4 kvraw;
__device__ __forceinline__ kvraw kv_zero() { return make_uint4(0u, 0u, 0u, 0u); }
__device__ __forceinline__ kvraw kv_load(const __half* p, long long i, bool vec) { if (vec) return *reinterpret_cast<const uint4*>(p + i); const unsigned short* s = reinterpret_cast<const unsigned short*>(p + i); return make_uint4(s[0] | (unsigned)s[1] << 16, s[2] | (unsigned)s[3] << 16, s[4] | (unsigned)s[5] << 16, s[6] | (unsigned)s[7] << 16); }
__device__ __forceinline__ void kv_unpack(kvraw r, float* f) { const __half2* h = reinterpret_cast<const __half2*>(&r); for (int j = 0; j < 4; ++j) { const float2 x = __half22float2(h[j]); f[2 * j] = x.x; f[2 * j + 1] = x.y; } }
""",
    torch.bfloat16: r"""
typedef uint4 kvraw;
__device__ __forceinline__ kvraw kv_zero() { return make_uint4(0u, 0u, 0u, 0u); }
__device__ __forceinline__ kvraw kv_load(const __nv_bfloat16* p, long long i, bool vec) { if (vec) return *reinterpret_cast<const uint4*>(p + i); const unsigned short* s = reinterpret_cast<const unsigned short*>(p + i); return make_uint4(s[0] | (unsigned)s[1] << 16, s[2] | (unsigned)s[3] << 16, s[4] | (unsigned)s[5] << 16, s[6] | (unsigned)s[7] << 16); }
__device__ __forceinline__ void kv_unpack(kvraw r, float* f) { const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r); for (int j = 0; j < 4; ++j) { const float2 x = __bfloat1622float2(h[j]); f[2 * j] = x.x; f[2 * j + 1] = x.y; } }
""",
}


def _decode_step(lay: DecodeLayout, kept: str, bias: str) -> str:
    """One warp's step over its `warp_keys` keys n0 + u * keys_per_load + kg: the K and V rows of the keys for
    which `kept` (a C condition on n) holds are loaded once, 16 bytes a lane, all before the first use; the
    block's query rows' scores are reduced over the row's lanes, `bias` (a C expression on i, the row, and
    n: 0, -inf or the additive mask) added, and each row's (m, l, acc) updated: an online softmax per row
    and key group."""
    u_, p_, v_, r_, f_ = lay.unroll, lay.per, lay.vec, lay.rows, lay.vec * lay.per
    partial = lay.vectors % lay.lanes != 0  # some lanes have no vector of the row
    cin = " && li + {L} * j < {V}".format(L=lay.lanes, V=lay.vectors) if partial else ""
    return f"""    kvraw kr[{u_}][{p_}], vr[{u_}][{p_}];
    bool kok[{u_}];
    #pragma unroll
    for (int u = 0; u < {u_}; ++u) {{
      const long long n = n0 + u * {lay.keys_per_load} + kg;
      kok[u] = {kept};
      #pragma unroll
      for (int j = 0; j < {p_}; ++j)
        kr[u][j] = kok[u]{cin} ? kv_load(kb, n * ksn + (li + {lay.lanes} * j) * {v_}, vec) : kv_zero();
    }}
    #pragma unroll
    for (int u = 0; u < {u_}; ++u) {{
      const long long n = n0 + u * {lay.keys_per_load} + kg;
      #pragma unroll
      for (int j = 0; j < {p_}; ++j)
        vr[u][j] = kok[u]{cin} ? kv_load(vb, n * vsn + (li + {lay.lanes} * j) * {v_}, vec) : kv_zero();
    }}
    float s[{r_}][{u_}];
    #pragma unroll
    for (int u = 0; u < {u_}; ++u) {{
      float kf[{f_}];
      #pragma unroll
      for (int j = 0; j < {p_}; ++j) kv_unpack(kr[u][j], kf + j * {v_});
      #pragma unroll
      for (int i = 0; i < {r_}; ++i) {{
        float d = 0.0f;
        #pragma unroll
        for (int x = 0; x < {f_}; ++x) d = fmaf(qr[i][x], kf[x], d);
        s[i][u] = d;
      }}
    }}
    #pragma unroll
    for (int o = {lay.lanes // 2}; o > 0; o >>= 1) {{  // the row's lanes: every lane ends with the whole dot
      #pragma unroll
      for (int i = 0; i < {r_}; ++i) {{
        #pragma unroll
        for (int u = 0; u < {u_}; ++u) s[i][u] += __shfl_xor_sync(0xffffffffu, s[i][u], o);
      }}
    }}
    #pragma unroll
    for (int i = 0; i < {r_}; ++i) {{
      float mx = NEG_INF;
      #pragma unroll
      for (int u = 0; u < {u_}; ++u) {{
        const long long n = n0 + u * {lay.keys_per_load} + kg;
        s[i][u] = kok[u] ? s[i][u] + ({bias}) : NEG_INF;
        mx = fmaxf(mx, s[i][u]);
      }}
      const float mnew = fmaxf(m[i], mx);
      const float base = mnew == NEG_INF ? 0.0f : mnew;  // a row with no key yet keeps probabilities 0
      const float alpha = expf(m[i] - base);
      float sum = 0.0f;
      #pragma unroll
      for (int u = 0; u < {u_}; ++u) {{ s[i][u] = expf(s[i][u] - base); sum += s[i][u]; }}
      l[i] = l[i] * alpha + sum;
      m[i] = mnew;
      #pragma unroll
      for (int x = 0; x < {f_}; ++x) acc[i][x] *= alpha;
    }}
    #pragma unroll
    for (int u = 0; u < {u_}; ++u) {{
      float vf[{f_}];
      #pragma unroll
      for (int j = 0; j < {p_}; ++j) kv_unpack(vr[u][j], vf + j * {v_});
      #pragma unroll
      for (int i = 0; i < {r_}; ++i) {{
        #pragma unroll
        for (int x = 0; x < {f_}; ++x) acc[i][x] = fmaf(s[i][u], vf[x], acc[i][x]);
      }}
    }}"""


def _decode_mask_loop(lay: DecodeLayout, mask_dtype: torch.dtype) -> str:
    """The keys [s0, s1) under a mask, DECODE_MASK_TILE at a time: the block first reads the tile's mask
    entries for its rows (one key per thread, a byte or two per key and row against 2 x D x dtype bytes of K
    and V), and a tile no row keeps a key of is passed over without a load of K or V; in a kept tile a warp
    step with no kept key is passed over too, and the others load the rows of the keys some row keeps. A key
    is dropped where a boolean mask is False or an additive one is -inf."""
    tile, r_ = DECODE_MASK_TILE, lay.rows
    entry = "(mp[n * msj] ? 0.0f : NEG_INF)" if mask_dtype is torch.bool else "ld(mp, n * msj)"
    step = _decode_step(lay, "n < t1 && keep[n - t0]", "bias[i][n - t0]")
    return f"""  __shared__ float bias[{r_}][{tile}];  // the tile's mask as a score bias per row: NEG_INF drops the key
  __shared__ unsigned char keep[{tile}];   // some row keeps the key
  __shared__ long long kept_tile;          // the last tile with a kept key (a barrier orders its writes)
  if (threadIdx.x == 0) kept_tile = -1;
  for (long long t0 = s0; t0 < s1; t0 += {tile}) {{  // block-uniform
    const long long n = t0 + threadIdx.x;
    bool any = false;
    __syncthreads();  // the previous tile's readers of bias and keep are done
    #pragma unroll
    for (int i = 0; i < {r_}; ++i) {{
      const {CTYPE[mask_dtype]}* mp = mask + moff[i];
      const float x = n < s1 && n < lim[i] ? {entry} : NEG_INF;
      bias[i][threadIdx.x] = x;
      any = any || x != NEG_INF;
    }}
    keep[threadIdx.x] = any;
    if (any) kept_tile = t0;
    __syncthreads();
    if (kept_tile != t0) continue;  // every key of the tile dropped by every row: its K and V are never read
    const long long t1 = t0 + {tile} < s1 ? t0 + {tile} : s1;
    for (long long n0 = t0 + w * {lay.warp_keys}; n0 < t1; n0 += {lay.block_keys}) {{  // warp-uniform
      bool live = false;
      for (int x = 0; x < {lay.warp_keys}; ++x) live = live || (n0 + x < t1 && keep[n0 + x - t0]);
      if (!live) continue;  // the step's keys all dropped
{step}
    }}
  }}"""


def decode_attention_kernels(name: str, *, batch: int, heads: int, kv_heads: int, q_tokens: int, max_len: int,
                             head_dim: int, dtype: torch.dtype, lse: bool = False, splits: int | None = None,
                             sms: int = 132, mask_dtype: torch.dtype | None = None, lengths: bool | None = None,
                             strides: dict[str, tuple[int, ...]] | None = None,
                             lanes: int | None = None) -> DecodeKernels:
    """Split-KV decode of q [B, H, T, D] (T = q_tokens, the newest tokens) against caches k and v
    [B, H_kv, S_max, D]. Which keys a token sees:

    - `lengths` (the default without a mask): `lengths[b]` valid keys (int32 [B], the new tokens' included);
      token t of T sees the keys before position `length - T + t + 1`;
    - `mask_dtype` (torch.bool: True attends; or a float dtype, added to the scores, -inf dropping a key): a
      mask [B|1, H|1, T|1, S_max] read through four strides (0 where broadcast), as SDPA's attn_mask; a
      run of DECODE_MASK_TILE keys the mask drops entirely is never loaded (`_decode_mask_loop`). With
      `lengths` too, both apply;
    - neither (`lengths=False`): every one of the S_max keys.

    A partial block serves one (split, KV head, batch) and the query rows reading that KV head
    (`DecodeLayout`): each K and V row is loaded once per KV head, not once per query head. The partial
    kernel takes q, k, v, [lengths], [mask], ws_ml, ws_acc, H, T, H / H_kv, chunk, the (batch, head, token)
    strides of q, k, v, [the mask's four strides] and the scale; the combine kernel ws_ml, ws_acc, o, [lse],
    H, T, the strides of o. `strides` ("q", "k", "v", "o": three each, "mask": four) replaces the
    contiguous defaults; the unit stride along D is required. K and V are read 16 bytes at a time where
    their pointers and token strides allow it (else element by element, the same result). `lanes`: lanes a
    key (decode_layout; default the widest)."""
    _check(dtype, head_dim)
    if heads % kv_heads:
        raise InvalidArgumentError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if not 1 <= q_tokens <= DECODE_MAX_TOKENS:
        raise InvalidArgumentError(f"the decode kernels take 1 to {DECODE_MAX_TOKENS} query tokens, not {q_tokens}; "
                                   "run a longer query through the prefill kernel or SDPA")
    if mask_dtype is not None and mask_dtype not in (torch.bool, *ATTENTION_DTYPES):
        raise InvalidArgumentError(f"an attention mask is boolean or fp32/fp16/bf16, not {mask_dtype}")
    lengths = mask_dtype is None if lengths is None else lengths
    group = heads // kv_heads
    lay = decode_layout(head_dim, dtype, group * q_tokens, lanes)
    rows = batch * heads * q_tokens
    splits = splits or decode_splits(batch * kv_heads * lay.row_blocks, max_len, sms)
    chunk = math.ceil(max_len / splits)
    d, t, r_, f_ = head_dim, CTYPE[dtype], lay.rows, lay.vec * lay.per
    partial_params = [f"const {t}* __restrict__ q", f"const {t}* __restrict__ k", f"const {t}* __restrict__ v"]
    partial_params += ["const int* __restrict__ lengths"] if lengths else []
    partial_params += [f"const {CTYPE[mask_dtype]}* __restrict__ mask"] if mask_dtype is not None else []
    partial_params += ["float* __restrict__ ws_ml", "float* __restrict__ ws_acc",
                       "long long H", "long long T", "long long group", "long long chunk"]
    partial_params += [f"long long {x}s{s}" for x in "qkv" for s in "bhn"]
    partial_params += ["long long msb", "long long msh", "long long msi", "long long msj"] if mask_dtype else []
    partial_params.append("float scale")
    limit = "(long long)lengths[b] - T + tok + 1" if lengths else f"{max_len}LL"
    if mask_dtype is None:
        keys = (f"  for (long long n0 = s0 + w * {lay.warp_keys}; n0 < s1; n0 += {lay.block_keys}) {{"
                f"  // warp-uniform\n{_decode_step(lay, 'n < s1', 'n < lim[i] ? 0.0f : NEG_INF')}\n  }}")
        moff = ""
    else:
        keys = _decode_mask_loop(lay, mask_dtype)
        moff = f"  __shared__ long long moff[{r_}];  // each row's mask offset\n"
    cin = f"li + {lay.lanes} * j < {lay.vectors}"
    partial = PRELUDE + NEG_INF + _KV_IO[dtype] + f"""
// Split-KV decode, partial: one block per (split, KV head x row block, batch) serving its {r_} query rows
// (the heads sharing the KV head x the tokens); {DECODE_WARPS} warps, each step {lay.warp_keys} keys a warp
// ({lay.lanes} lanes a key, {lay.vec} elements a load, {lay.unroll} loads of K and of V in flight).
extern "C" __global__ void __launch_bounds__({32 * DECODE_WARPS}) {name}_partial({", ".join(partial_params)}) {{
  __shared__ float wm[{DECODE_WARPS}][{r_}], wl[{DECODE_WARPS}][{r_}], wacc[{DECODE_WARPS}][{r_}][{d}];
{moff}  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, kg = lane / {lay.lanes}, li = lane % {lay.lanes};
  const long long b = blockIdx.z, hk = blockIdx.y / {lay.row_blocks}, r0 = (blockIdx.y % {lay.row_blocks}) * {r_};
  const long long R = group * T;
  const {t}* kb = k + b * ksb + hk * ksh;
  const {t}* vb = v + b * vsb + hk * vsh;
  const bool vec = ((reinterpret_cast<unsigned long long>(kb) | reinterpret_cast<unsigned long long>(vb)) & 15) == 0
                   && ksn % {lay.vec} == 0 && vsn % {lay.vec} == 0;  // 16-byte loads
  float qr[{r_}][{f_}], acc[{r_}][{f_}], m[{r_}], l[{r_}];
  long long hi = 0;
  int lim[{r_}];  // the keys each row sees: those before lim
  #pragma unroll
  for (int i = 0; i < {r_}; ++i) {{
    const long long r = r0 + i, h = hk * group + r / T, tok = r % T;
    const bool real = r < R;  // the last row block's rows past R see nothing and are not written
    lim[i] = real ? (int)({limit}) : 0;
    hi = lim[i] > hi ? lim[i] : hi;
    const {t}* qb = q + b * qsb + h * qsh + tok * qsn;
    #pragma unroll
    for (int j = 0; j < {lay.per}; ++j) {{
      #pragma unroll
      for (int e = 0; e < {lay.vec}; ++e)
        qr[i][j * {lay.vec} + e] = real && {cin} ? ld(qb, (li + {lay.lanes} * j) * {lay.vec} + e) * scale : 0.0f;
    }}
    #pragma unroll
    for (int x = 0; x < {f_}; ++x) acc[i][x] = 0.0f;
    m[i] = NEG_INF;
    l[i] = 0.0f;
{"    if (threadIdx.x == 0) moff[i] = b * msb + h * msh + tok * msi;" if mask_dtype is not None else ""}
  }}
  const long long s0 = (long long)blockIdx.x * chunk;
  const long long s1 = s0 + chunk < hi ? s0 + chunk : hi;
{"  __syncthreads();  // moff" if mask_dtype is not None else ""}
{keys}
  // Merge the warp's key groups (lanes kg of every row position), then the warps through shared memory.
  #pragma unroll
  for (int o = {lay.lanes}; o < 32; o <<= 1) {{
    #pragma unroll
    for (int i = 0; i < {r_}; ++i) {{
      const float mo = __shfl_xor_sync(0xffffffffu, m[i], o), lo = __shfl_xor_sync(0xffffffffu, l[i], o);
      const float M = fmaxf(m[i], mo), base = M == NEG_INF ? 0.0f : M;
      const float a = expf(m[i] - base), c = expf(mo - base);
      l[i] = l[i] * a + lo * c;
      m[i] = M;
      #pragma unroll
      for (int x = 0; x < {f_}; ++x) acc[i][x] = acc[i][x] * a + __shfl_xor_sync(0xffffffffu, acc[i][x], o) * c;
    }}
  }}
  if (kg == 0) {{
    #pragma unroll
    for (int i = 0; i < {r_}; ++i) {{
      if (li == 0) {{ wm[w][i] = m[i]; wl[w][i] = l[i]; }}
      #pragma unroll
      for (int j = 0; j < {lay.per}; ++j) {{
        if ({cin}) {{
          #pragma unroll
          for (int e = 0; e < {lay.vec}; ++e)
            wacc[w][i][(li + {lay.lanes} * j) * {lay.vec} + e] = acc[i][j * {lay.vec} + e];
        }}
      }}
    }}
  }}
  __syncthreads();
  for (int x = threadIdx.x; x < {r_ * d}; x += {32 * DECODE_WARPS}) {{
    const int i = x / {d}, c = x % {d};
    const long long r = r0 + i;
    if (r >= R) continue;
    float M = NEG_INF;
    #pragma unroll
    for (int j = 0; j < {DECODE_WARPS}; ++j) M = fmaxf(M, wm[j][i]);
    const float base = M == NEG_INF ? 0.0f : M;  // an empty split: sum 0, accumulator 0
    float a = 0.0f, s = 0.0f;
    #pragma unroll
    for (int j = 0; j < {DECODE_WARPS}; ++j) {{
      const float f = expf(wm[j][i] - base);
      a += wacc[j][i][c] * f;
      s += wl[j][i] * f;
    }}
    const long long row = (b * H + hk * group + r / T) * T + r % T, slot = row * gridDim.x + blockIdx.x;
    ws_acc[slot * {d} + c] = a;
    if (c == 0) {{ ws_ml[slot * 2] = M; ws_ml[slot * 2 + 1] = s; }}
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
                     ("i64", group), ("i64", chunk)]
    partial_args += [("i64", x) for x in (*st["q"], *st["k"], *st["v"])]
    partial_args += [("i64", x) for x in st["mask"]] if mask_dtype is not None else []
    partial_args.append(("f32", 1.0 / math.sqrt(d)))
    combine_args = [("in", "ws_ml"), ("in", "ws_acc"), ("out", "o")] + ([("out", "lse")] if lse else [])
    combine_args += [("i64", heads), ("i64", q_tokens)] + [("i64", x) for x in st["o"]]
    seen = [f"{mask_dtype} mask"] * (mask_dtype is not None) + ["lengths"] * lengths
    what = (f"decode {batch}x{heads}(kv {kv_heads})x{q_tokens} over {max_len} keys ({' and '.join(seen) or 'all'}), "
            f"D = {d}, {t}")
    return DecodeKernels(
        KernelCode(partial, f"{name}_partial", grid=(splits, kv_heads * lay.row_blocks, batch),
                   block=32 * DECODE_WARPS, args=partial_args,
                   description=f"{what}: {splits} splits of {chunk} keys, {lay.rows} query rows a block"),
        KernelCode(PRELUDE + NEG_INF + combine, f"{name}_combine", grid=rows, block=d, args=combine_args,
                   description=f"{what}: combine of {splits} splits"),
        splits, chunk, rows * splits * 2, rows * splits * d, lay)
