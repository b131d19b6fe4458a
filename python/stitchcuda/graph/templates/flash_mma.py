"""The fp16/bf16 prefill kernel on tensor cores through `mma.sync` (FlashAttention-2's design): the scores,
the probabilities and the output accumulator stay in registers, K and V tiles stream through shared memory
by `cp.async`, double-buffered. `flash_attention_kernel` (attention.py) picks it for head dims 64 and 128.

The floor. FLOPs are 4 B H Nq Nk D (Q K^T and P V), half that causal; bytes are q, k, v and o once
(bf16). On an H100 SXM: 989 TFLOP/s dense bf16 (wgmma; `mma.sync` reaches about two thirds of it),
3.35 TB/s of DRAM; FlashAttention-2 (SDPA's flash backend) reaches about 35% of the dense peak at long
sequences, less at short ones and causal:

    shape (B x H/H_kv x N x D)          GFLOP    MB    at 989 TF   at 350 TF   bytes at 3.35 TB/s
    Llama-1B 1x32/32x2048x64 causal     17.2    33.6    17.4 us     49.1 us      10.0 us
    ViT-B 64x12/12x197x64               7.6     77.5     7.7 us     21.8 us      23.1 us
    BERT-base 32x12/12x512x64           25.8   100.7    26.0 us     73.6 us      30.0 us
    1x32/32x2048x128 causal             34.4    67.1    34.7 us     98.2 us      20.0 us
    8x32/8x2048x128 causal             274.9   335.5   277.8 us    785.4 us     100.2 us
    8x32/8x512x128 causal               17.2    83.9    17.4 us     49.1 us      25.0 us

(the first four are the bench's prefill rows; its first measurement had SDPA's flash backend at 0.128,
0.11 and 0.128 ms on the first three, timer included: 0.9x of it is the target). So the kernel is matrix-bound except
at ViT's short sequences, where the bytes are as large as the FLOPs.

Two things bound a block below the tensor rate. Shared memory: a warp reads every K and V element of a
tile through `ldmatrix` for its 16 query rows (a 256-byte B fragment per m16n8k16 product, 4096 FLOPs), and
an SM reads 128 bytes of shared memory a clock: at 16 rows a warp, 2 clocks a product per SM, 2048
FLOP/clk, about 470 TFLOP/s over 132 SMs at 1.75 GHz, above FlashAttention-2 and under the `mma.sync` rate.
And L2: each K and V tile a block loads serves its BM query rows, 4 x BM FLOPs per byte at D = 64 and
2 x BM at D = 128; at 64 rows and D = 128, 470 TFLOP/s would need 7 TB/s from L2, more than it delivers,
so a block has 128 rows (as FlashAttention-2's). At D = 64 a warp owns 32 of them (two m16 tiles), reusing
each K and V fragment twice, which halves the shared-memory cost; there the exponentials (one per score,
16 a clock per SM, against 4 D = 256 FLOPs per score) come close to the products. At D = 128 two m16 tiles'
state (Q fragments 64 registers, output 128, scores 64) cannot fit in 255 registers: 8 warps of 16 rows,
one block an SM, and a third stage so two tiles are in flight while one is computed.

Design (one block per 128 query rows of one (batch, head); `MmaTiles`):
- Q is copied to shared memory once and loaded into registers by `ldmatrix` (A fragments for the whole
  loop). K and V tiles of 64 keys are copied by `cp.async` (16 bytes a thread, zero-filled past Nk) into
  2 or 3 stages: the next tiles load while this one is computed, one barrier per tile. Rows are padded by
  8 elements (16 bytes), so the 8 row addresses of an `ldmatrix` phase fall on distinct bank groups.
- S = Q K^T with `mma.sync.m16n8k16` (K fragments by `ldmatrix`, V's by `ldmatrix.trans`): each lane holds
  2 scores of rows g and g + 8 per 8-key tile (g = lane / 4); a row's 4 lanes combine max and sum by two
  shuffles. Without a user mask the max is of the raw scores and p = exp2(s x sl2 - max) is one FFMA and
  one MUFU (sl2 = scale x log2(e), kept positive: Q's fragments are negated for a negative scale); masking
  (bounds, causal) runs only on the tiles that need it (the last, and causal blocks' diagonal). A user mask
  (on every tile) is applied to the scaled scores.
- The m16n8k16 accumulators of two 8-key tiles are, element for element, the A fragment of one 16-key
  step, so P is rounded to the input dtype in registers and multiplied by V at once: no shared memory
  between S, P and O. The output accumulators are rescaled per tile, each lane's partial row sum is
  combined over the quad once at the end, and the output is written once (staged through the warp's own
  Q rows for 16-byte stores), with the log-sum-exp if asked.
- Causal blocks stop at their last row's key tile, a warp whose rows all precede a tile skips it, and the
  heaviest (last) query blocks run first: the block index is remapped so every (batch, head)'s last block
  comes before any second-to-last one, so the grid's tail is short blocks.

The CPU emulator runs this same kernel body: every PTX instruction (`mma`, `ldmatrix`, `cp.async`) sits
in a small helper with a `EMULATE_MMA_ON_CPU` alternative written from the instruction's per-lane
fragment layout over fp32 elements (the lanes' registers exchanged through a per-warp shared array,
one exchange per instruction; a copy lands when a wait retires its group), so the layouts and the
pipeline's waits are exercised exactly (tests/python/test_flash_mma.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import CTYPE, PRELUDE

MMA_HEAD_DIMS = (64, 128)
MMA_DTYPES = (torch.float16, torch.bfloat16)
NEG_INF = "#define NEG_INF __int_as_float(0xff800000)\n"

# Per input dtype: the PTX type of the products and the packing of two fp32 values into one register.
_PTX = {"__half": ("f16", "__floats2half2_rn", "__half2"),
        "__nv_bfloat16": ("bf16", "__floats2bfloat162_rn", "__nv_bfloat162")}


@dataclass(frozen=True)
class MmaTiles:
    """Tiles of the mma.sync prefill: BM = 128 query rows a block, `warps` warps of `m_tiles` x 16 rows,
    BN = 64 keys a tile; shared memory holds Q [BM][D + 8] and `stages` stages of K and V [64][D + 8] in the
    input dtype. Two m16 tiles a warp (4 warps) at D = 64 without a user mask: each K and V fragment serves
    both. At D = 128 two tiles' state (Q fragments, output, scores: 256 registers) would not fit, nor under a
    mask at D = 64 (its entries, 16 a row per lane and tile at run-time strides): 8 warps of one tile, one
    block an SM (134-244 registers a thread), so three stages keep two tiles in flight."""

    head_dim: int
    masked: bool = False

    @property
    def m_tiles(self) -> int:
        return 2 if self.head_dim <= 64 and not self.masked else 1

    @property
    def warps(self) -> int:
        return 8 // self.m_tiles

    @property
    def bm(self) -> int:
        return 128

    @property
    def bn(self) -> int:
        return 64

    @property
    def stages(self) -> int:
        return 2 if self.warps == 4 else 3

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def shared_mem(self) -> int:
        return 2 * (self.head_dim + 8) * (self.bm + 2 * self.stages * self.bn)


def mma_tiles(head_dim: int, masked: bool = False) -> MmaTiles:
    """D = 64: 4 warps x 32 rows, 2 stages, 55 KB of shared memory (two blocks an SM); under a user mask 8 x 16
    rows, 3 stages, 92 KB. D = 128: 8 warps x 16 rows, 3 stages, 139 KB (one block an SM). 128 rows a block
    either way: each K and V tile read from L2 serves 128 query rows (64 would double the L2 traffic, about
    7 TB/s at D = 128 at 470 TFLOP/s, past what the L2 delivers)."""
    return MmaTiles(head_dim, masked)


def _helpers(t: str) -> str:
    """The PTX helpers and their emulated alternatives (per-lane semantics over fp32 elements)."""
    if t in _PTX:
        kind, pack2, half2 = _PTX[t]
        real_pack = (f"__device__ __forceinline__ pk pack(float a, float b) {{ const {half2} h = {pack2}(a, b); "
                     "return *reinterpret_cast<const unsigned*>(&h); }")
    else:  # the emulated build (t = float) never compiles the PTX branch
        kind, real_pack = "", '#error "the mma.sync prefill takes fp16 or bf16 inputs"'
    return rf"""
#ifdef EMULATE_MMA_ON_CPU
// The CPU emulator: a fragment register holds two fp32 elements; a lane reads the other lanes' registers
// through a per-warp array (one exchange per instruction, as the instruction moves them between lanes).
struct pk {{ float x, y; }};
struct chunk {{ float v[8]; }};
__device__ __forceinline__ pk pack(float a, float b) {{ return {{a, b}}; }}
__device__ __forceinline__ pk negate(pk x) {{ return {{-x.x, -x.y}}; }}
__device__ __forceinline__ float* lanes_of_warp() {{
  __shared__ float x[8][32][12];  // at most 8 warps a block
  return &x[threadIdx.x >> 5][0][0];
}}
// cp.async: a copy lands in shared memory only when a wait retires its group (the latest the GPU may land
// it), so a wait count or barrier too few reads stale data here too.
struct emu_copies {{ T* dst[64]; chunk val[64]; int group[64]; int n, committed; }};
__device__ __forceinline__ emu_copies& pending_copies() {{ static thread_local emu_copies c{{}}; return c; }}
__device__ __forceinline__ void cp_async8(T* base, int off, const T* src, bool valid) {{
  emu_copies& c = pending_copies();
  c.dst[c.n] = base + off;
  c.val[c.n] = valid ? *reinterpret_cast<const chunk*>(src) : chunk{{}};
  c.group[c.n++] = c.committed;
}}
__device__ __forceinline__ void cp_async_commit() {{ ++pending_copies().committed; }}
template <int N> __device__ __forceinline__ void cp_async_wait() {{
  emu_copies& c = pending_copies();
  int kept = 0;
  for (int i = 0; i < c.n; ++i) {{
    if (c.group[i] < c.committed - N) {{ *reinterpret_cast<chunk*>(c.dst[i]) = c.val[i]; continue; }}
    c.dst[kept] = c.dst[i]; c.val[kept] = c.val[i]; c.group[kept++] = c.group[i];
  }}
  c.n = kept;
}}
// ldmatrix .x4: lane l addresses row l % 8 of matrix l / 8 and receives, of matrix j, elements (l / 4, 2 (l % 4))
// and (l / 4, 2 (l % 4) + 1) in r[j]; .trans: elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
__device__ __forceinline__ void ldsm_x4(pk r[4], const T* base, int off, bool trans) {{
  const int lane = threadIdx.x & 31, g = lane >> 2, c = 2 * (lane & 3);
  float* x = lanes_of_warp();
  x[lane * 12] = (float)off;  // exact: shared-memory offsets are far below 2^24
  __syncwarp();
  for (int j = 0; j < 4; ++j) {{
    if (trans) r[j] = pack(base[(int)x[(8 * j + c) * 12] + g], base[(int)x[(8 * j + c + 1) * 12] + g]);
    else r[j] = pack(base[(int)x[(8 * j + g) * 12] + c], base[(int)x[(8 * j + g) * 12] + c + 1]);
  }}
  __syncwarp();
}}
// m16n8k16, row.col: A[r][k] is in lane 4 (r % 8) + (k % 8) / 2, register r / 8 + 2 (k / 8), half k % 2;
// B[k][n] in lane 4 n + (k % 8) / 2, register k / 8, half k % 2; C[r][n] in lane 4 (r % 8) + n / 2,
// element 2 (r / 8) + n % 2.
__device__ __forceinline__ void mma16816(float c[4], const pk a[4], const pk b[2]) {{
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  float* x = lanes_of_warp();
  for (int i = 0; i < 4; ++i) {{ x[lane * 12 + 2 * i] = a[i].x; x[lane * 12 + 2 * i + 1] = a[i].y; }}
  for (int i = 0; i < 2; ++i) {{ x[lane * 12 + 8 + 2 * i] = b[i].x; x[lane * 12 + 9 + 2 * i] = b[i].y; }}
  __syncwarp();
  for (int i = 0; i < 4; ++i) {{
    const int r = g + 8 * (i >> 1), n = 2 * tq + (i & 1);
    float s = c[i];
    for (int k = 0; k < 16; ++k)
      s += x[(4 * (r & 7) + ((k & 7) >> 1)) * 12 + 2 * ((r >> 3) + 2 * (k >> 3)) + (k & 1)]
           * x[(4 * n + ((k & 7) >> 1)) * 12 + 8 + 2 * (k >> 3) + (k & 1)];
    c[i] = s;
  }}
  __syncwarp();
}}
#else
typedef unsigned pk;    // two fp16/bf16 elements, the lower index in the low half
typedef uint4 chunk;    // eight elements: one 16-byte copy
{real_pack}
__device__ __forceinline__ pk negate(pk x) {{ return x ^ 0x80008000u; }}  // both elements' sign bits
// Shared-memory addresses are 32-bit: base + off computed there, not as 64-bit generic pointers.
__device__ __forceinline__ unsigned smem_u32(const T* base, int off) {{
  return (unsigned)__cvta_generic_to_shared(base) + (unsigned)(off * (int)sizeof(T));
}}
// 16 bytes global -> shared, asynchronous; src-size 0 writes zeros (rows past the last key or query).
__device__ __forceinline__ void cp_async8(T* base, int off, const T* src, bool valid) {{
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_u32(base, off)), "l"(src), "r"(valid ? 16 : 0));
}}
__device__ __forceinline__ void cp_async_commit() {{ asm volatile("cp.async.commit_group;\n" ::); }}
// Wait until at most N of this thread's committed copy groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {{
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}}
__device__ __forceinline__ void ldsm_x4(pk r[4], const T* base, int off, bool trans) {{
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{%0, %1, %2, %3}}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(base, off)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%0, %1, %2, %3}}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(base, off)));
}}
__device__ __forceinline__ void mma16816(float c[4], const pk a[4], const pk b[2]) {{
  asm("mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, "
      "{{%0, %1, %2, %3}};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}}
#endif
"""


def _scores(causal: bool, mask_dtype: torch.dtype | None, bn: int) -> tuple[str, str]:
    """The masking of a tile's scores, per row (`row`) and per score `x` (raw Q K^T of key k0 + c): `lim`, the
    keys kept for c < lim (bounds and causal), computed only on the tiles that need it (`edge`). Without a
    user mask the scores stay raw (sl2 >= 0 scales them in the max and in exp2's FFMA, as FlashAttention-2
    does) and a tile that is not `edge` runs no masking code at all; under one (read through `mr`, the row's
    entries from key k0; a row past Nq reads row Nq - 1's, never written out) every score is turned into log2
    units or NEG_INF. Offsets within the tile are 32-bit."""
    bound = "Nk - k0" + (", rc = row - k0 + 1" if causal else "")
    limit = "r < rc ? r : rc" if causal else "r"
    lim = f"""          const long long r = {bound};
          const long long x = {limit};
          const int lim = x <= 0 ? 0 : x < {bn} ? (int)x : {bn};"""
    if mask_dtype is None:
        return f"""        if (edge) {{  // block-uniform: the last tile, a causal block's diagonal
{lim}
          #pragma unroll
          for (int nt = 0; nt < {bn // 8}; ++nt) {{
            #pragma unroll
            for (int e = 0; e < 2; ++e) {{
              if (nt * 8 + 2 * tq + e >= lim) s[i][nt][2 * hr + e] = NEG_INF;
            }}
          }}
        }}""", ""
    row = f"""        int lim = {bn};
        if (edge) {{
{lim.replace("const int lim", "lim")}
        }}
        const auto* mr = mb + (row < Nq ? row : Nq - 1) * msi + k0 * msj;"""
    if mask_dtype is torch.bool:
        return row, """            x = c < lim && mr[c * msj] ? x * sl2 : NEG_INF;"""
    return row, """            x = c < lim ? fmaf(ld(mr, c * msj), 1.4426950408889634f, x * sl2) : NEG_INF;"""


def flash_mma_source(name: str, params: list[str], tiles: MmaTiles, t: str, causal: bool,
                     mask_dtype: torch.dtype | None, lse: bool) -> str:
    """The kernel's source: `params` as flash_attention_kernel declares them, `t` the element type (float
    only for the emulator, with EMULATE_MMA_ON_CPU defined)."""
    d, bm, bn, mt, nt_, st = tiles.head_dim, tiles.bm, tiles.bn, tiles.m_tiles, tiles.threads, tiles.stages
    ld_ = d + 8
    mask_base = (f"  const {CTYPE[mask_dtype]}* mb = mask + b * msb + h * msh;" if mask_dtype is not None else "")
    if causal:  # every (batch, head)'s last query block first, then the second-to-last, ...: heavy blocks lead
        block = """  const long long lin = (long long)blockIdx.y * gridDim.x + blockIdx.x;
  const long long bh = lin % gridDim.y, qblk = gridDim.x - 1 - lin / gridDim.y;"""
        kend = f"(q0 + {bm} < Nk ? q0 + {bm} : Nk)"
        edge = f"k0 + {bn} > Nk || k0 + {bn - 1} > q0"
    else:
        block = "  const long long bh = blockIdx.y, qblk = blockIdx.x;"
        kend, edge = "Nk", f"k0 + {bn} > Nk"
    per_row, per_score = _scores(causal, mask_dtype, bn)
    per_score = (f"""            const int c = nt * 8 + 2 * tq + e;
            float x = s[i][nt][2 * hr + e];
{per_score}
            s[i][nt][2 * hr + e] = x;
            mx = fmaxf(mx, x);""" if per_score else "            mx = fmaxf(mx, s[i][nt][2 * hr + e]);")
    if mask_dtype is None:  # raw scores: Q negated where the scale is, so sl2 >= 0 and max(raw) x sl2 is the max
        scale_lines = """  const bool flip = scale < 0.0f;
  // exp(x scale) = exp2(x sl2): log2 e folded into the scale; sl2 > 0 also at scale 0, where -inf x 0 is NaN
  const float sl2 = fmaxf(fabsf(scale) * 1.4426950408889634f, 1e-30f);"""
        flip = "          if (flip) for (int r = 0; r < 4; ++r) qf[i][kk][r] = negate(qf[i][kk][r]);"
        tile_max, exponent = "mx * sl2", "fmaf(s[i][nt][2 * hr + e], sl2, -base)"
    else:
        scale_lines = "  const float sl2 = scale * 1.4426950408889634f;  // exp(x scale) = exp2(x sl2)"
        flip, tile_max, exponent = "", "mx", "s[i][nt][2 * hr + e] - base"
    rs = nt_ // (d // 8)  # rows between one thread's 16-byte copies of a tile
    live = (f"    if (k0 > q0 + w * {16 * mt} + {16 * mt - 1}) continue;  // every row of this warp is before the tile"
            if causal else "")
    lse_line = ("      if (tq == 0 && row < Nq) lse[bh * Nq + row] = (m[i][hr] + log2f(lt)) * 0.6931471805599453f;"
                if lse else "")
    return PRELUDE + NEG_INF + f"typedef {t} T;\n" + _helpers(t) + f"""
// Fused attention forward, mma.sync m16n8k16: {bm} query rows ({tiles.warps} warps of {mt} x 16) x {bn}-key
// tiles in {st} stages, D = {d}.
extern "C" __global__ void __launch_bounds__({nt_}) {name}({", ".join(params)}) {{
  extern __shared__ float4 smem4[];  // 16-byte aligned: cp.async and ldmatrix rows
  T* Qs = reinterpret_cast<T*>(smem4);  // [{bm}][{ld_}]
  T* Ks = Qs + {bm * ld_};  // [{st}][{bn}][{ld_}]
  T* Vs = Ks + {st * bn * ld_};  // [{st}][{bn}][{ld_}]
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
{block}
  const long long b = bh / H, h = bh % H, hk = h / group, q0 = qblk * {bm};
  const T* qb = q + b * qsb + h * qsh;
  const T* kb = k + b * ksb + hk * ksh;
  const T* vb = v + b * vsb + hk * vsh;
{mask_base}
  const long long kend = {kend};
  const int tiles = (int)((kend + {bn - 1}) / {bn});
  #pragma unroll
  for (int x = 0; x < {bm * d // 8 // nt_}; ++x) {{  // Q: 16-byte copies, zeros past the last query
    const int i = tid + {nt_} * x, r = i / {d // 8}, c = (i % {d // 8}) * 8;
    const bool in = q0 + r < Nq;
    cp_async8(Qs, r * {ld_} + c, qb + (in ? q0 + r : 0) * qsn + c, in);
  }}
  // A thread's copies of a K or V tile: rows cr, cr + {rs}, ... at column cc (16 bytes each), its pointers
  // stepped by {rs} rows, so no per-copy 64-bit offset is kept live across the loop.
  const int cr = tid / {d // 8}, cc = (tid % {d // 8}) * 8;
  const long long kstep = {rs} * ksn, vstep = {rs} * vsn;
  auto load_tile = [&](int j) {{  // K and V of key tile j into stage j % {st}, zeros past the last key
    const long long n0 = (long long)j * {bn} + cr;
    const T* kp = kb + n0 * ksn + cc;
    const T* vp = vb + n0 * vsn + cc;
    const int so = (j % {st}) * {bn * ld_} + cr * {ld_} + cc;  // this thread's first element of the stage
    #pragma unroll
    for (int x = 0; x < {bn // rs}; ++x) {{
      const bool in = n0 + x * {rs} < Nk;
      cp_async8(Ks, so + x * {rs * ld_}, in ? kp : kb, in);
      cp_async8(Vs, so + x * {rs * ld_}, in ? vp : vb, in);
      kp += kstep;
      vp += vstep;
    }}
  }};
  // Tiles 0 .. {st - 2} in flight (the first group with Q); one group is committed per tile below, empty
  // past the last, so "tile j landed" is always "at most {st - 2} groups pending".
  #pragma unroll
  for (int j = 0; j < {st - 1}; ++j) {{
    if (j < tiles) load_tile(j);
    cp_async_commit();
  }}
{scale_lines}
  pk qf[{mt}][{d // 16}][4];
  float acc[{mt}][{d // 8}][4], m[{mt}][2], l[{mt}][2];
  #pragma unroll
  for (int i = 0; i < {mt}; ++i) {{
    #pragma unroll
    for (int dt = 0; dt < {d // 8}; ++dt) acc[i][dt][0] = acc[i][dt][1] = acc[i][dt][2] = acc[i][dt][3] = 0.0f;
    m[i][0] = m[i][1] = NEG_INF;
    l[i][0] = l[i][1] = 0.0f;
  }}
  for (int j = 0; j < tiles; ++j) {{
    cp_async_wait<{st - 2}>();  // this thread's copies of tile j (and Q) landed
    __syncthreads();  // everyone's have, and everyone is done with tile j - 1, whose stage tile j + {st - 1} takes
    if (j + {st - 1} < tiles) load_tile(j + {st - 1});
    cp_async_commit();
    if (j == 0) {{  // Q's A fragments, held for the whole loop
      #pragma unroll
      for (int i = 0; i < {mt}; ++i) {{
        #pragma unroll
        for (int kk = 0; kk < {d // 16}; ++kk) {{
          ldsm_x4(qf[i][kk], Qs, (w * {16 * mt} + i * 16 + (lane & 15)) * {ld_} + kk * 16 + (lane >> 4) * 8, false);
{flip}
        }}
      }}
    }}
    const int so = (j % {st}) * {bn * ld_};  // the stage of tile j, in K's and V's buffers
    const long long k0 = (long long)j * {bn};
{live}
    const bool edge = {edge};
    float s[{mt}][{bn // 8}][4];
    #pragma unroll
    for (int i = 0; i < {mt}; ++i) {{
      #pragma unroll
      for (int nt = 0; nt < {bn // 8}; ++nt) s[i][nt][0] = s[i][nt][1] = s[i][nt][2] = s[i][nt][3] = 0.0f;
    }}
    #pragma unroll
    for (int np = 0; np < {bn // 16}; ++np) {{  // S = Q K^T: two 8-key tiles per ldmatrix of K
      #pragma unroll
      for (int kk = 0; kk < {d // 16}; ++kk) {{
        pk kf[4];
        ldsm_x4(kf, Ks, so + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * {ld_} + kk * 16 + ((lane >> 3) & 1) * 8, false);
        #pragma unroll
        for (int i = 0; i < {mt}; ++i) {{
          mma16816(s[i][2 * np], qf[i][kk], kf);
          mma16816(s[i][2 * np + 1], qf[i][kk], kf + 2);
        }}
      }}
    }}
    #pragma unroll
    for (int i = 0; i < {mt}; ++i) {{
      #pragma unroll
      for (int hr = 0; hr < 2; ++hr) {{  // rows g and g + 8 of the m-tile: elements 2 hr, 2 hr + 1
        const long long row = q0 + w * {16 * mt} + i * 16 + g + 8 * hr;
{per_row}
        float mx = NEG_INF;
        #pragma unroll
        for (int nt = 0; nt < {bn // 8}; ++nt) {{
          #pragma unroll
          for (int e = 0; e < 2; ++e) {{
{per_score}
          }}
        }}
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the row's four lanes
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mnew = fmaxf(m[i][hr], {tile_max});
        const float base = mnew == NEG_INF ? 0.0f : mnew;  // a row masked so far keeps probabilities 0
        const float alpha = exp2f(m[i][hr] - base);
        m[i][hr] = mnew;
        float sum = 0.0f;
        #pragma unroll
        for (int nt = 0; nt < {bn // 8}; ++nt) {{
          #pragma unroll
          for (int e = 0; e < 2; ++e) {{
            const float p = exp2f({exponent});
            s[i][nt][2 * hr + e] = p;
            sum += p;
          }}
        }}
        l[i][hr] = l[i][hr] * alpha + sum;  // this lane's share of the row sum; the quad's are added at the end
        #pragma unroll
        for (int dt = 0; dt < {d // 8}; ++dt) {{ acc[i][dt][2 * hr] *= alpha; acc[i][dt][2 * hr + 1] *= alpha; }}
      }}
    }}
    #pragma unroll
    for (int kk = 0; kk < {bn // 16}; ++kk) {{  // O += P V; S's 8-key tiles 2kk, 2kk + 1 are P's A fragment
      pk pf[{mt}][4];
      #pragma unroll
      for (int i = 0; i < {mt}; ++i) {{
        pf[i][0] = pack(s[i][2 * kk][0], s[i][2 * kk][1]);
        pf[i][1] = pack(s[i][2 * kk][2], s[i][2 * kk][3]);
        pf[i][2] = pack(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);
        pf[i][3] = pack(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);
      }}
      #pragma unroll
      for (int dp = 0; dp < {d // 16}; ++dp) {{
        pk vf[4];
        ldsm_x4(vf, Vs, so + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * {ld_} + dp * 16 + (lane >> 4) * 8, true);
        #pragma unroll
        for (int i = 0; i < {mt}; ++i) {{
          mma16816(acc[i][2 * dp], pf[i], vf);
          mma16816(acc[i][2 * dp + 1], pf[i], vf + 2);
        }}
      }}
    }}
  }}
  // The output: normalized, rounded once, staged in the warp's own Q rows (read only by this warp, at j = 0),
  // then written with 16-byte stores where the output's pointer and token stride allow.
  if (tiles == 0) {{  // no key (Nk = 0): Q's copies are still in flight into the rows staged below
    cp_async_wait<0>();
    __syncthreads();
  }}
  T* stage = Qs + w * {16 * mt * ld_};
  #pragma unroll
  for (int i = 0; i < {mt}; ++i) {{
    #pragma unroll
    for (int hr = 0; hr < 2; ++hr) {{
      const long long row = q0 + w * {16 * mt} + i * 16 + g + 8 * hr;
      float lt = l[i][hr];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const float inv = 1.0f / lt;  // a row with every key masked: 0 / 0, NaN as softmax gives
      #pragma unroll
      for (int dt = 0; dt < {d // 8}; ++dt)
        *reinterpret_cast<pk*>(stage + (i * 16 + g + 8 * hr) * {ld_} + dt * 8 + 2 * tq) =
            pack(acc[i][dt][2 * hr] * inv, acc[i][dt][2 * hr + 1] * inv);
{lse_line}
    }}
  }}
  __syncwarp();
  T* ob = o + b * osb + h * osh;
  const bool vec = ((reinterpret_cast<unsigned long long>(ob) | (unsigned long long)(osn * sizeof(T))) & 15) == 0;
  #pragma unroll
  for (int x = 0; x < {16 * mt * d // 8 // 32}; ++x) {{
    const int i = lane + 32 * x, r = i / {d // 8}, c = (i % {d // 8}) * 8;
    const long long row = q0 + w * {16 * mt} + r;
    if (row >= Nq) continue;
    if (vec) *reinterpret_cast<chunk*>(ob + row * osn + c) = *reinterpret_cast<const chunk*>(stage + r * {ld_} + c);
    else {{
      #pragma unroll
      for (int e = 0; e < 8; ++e) ob[row * osn + c + e] = stage[r * {ld_} + c + e];
    }}
  }}
}}
"""
