"""How an fp32 GEMM is computed on tensor cores, as the Planner decides it and the executor runs it: the
tf32x3 cost model (split_tf32_choice: three TF32 products on split operands against SGEMM), the blocks and
K-slabs the executor splits operands into (src/torch/matmul.cpp's split_blocks, k_block, fuse_products),
and when a bf16 matmul of fp32 operands multiplies as bf16 products."""

from __future__ import annotations

from ..settings import settings

__all__ = ["split_blocks", "split_chunk", "k_block", "bf16_products", "BF16_CAST_MIN_K", "fuse_lo", "fused_hi",
           "fuse_all", "split_tf32_choice"]

# tf32x3's cost model: the shares of the peaks cuBLAS reaches (fp32 SIMT, TF32 tensor cores, DRAM), the
# K-chunk of its hi*hi product (as the executor runs it), the speed-up it must promise, and the most
# split scratch it may hold: the split copies of both operands (8 bytes per element) up to three times
# the matmul's largest tensor (a projection whose input is twice its weight and its result), or 256 MiB.
# A trade of memory for speed that split_tf32=False declines. The shares are fitted to measured runs
# (docs/graph.md): an 8192 x 8192 x 4096 SGEMM at 10.8-11.0 ms on the H200 and the H100 (the model says
# 10.9); the same product as tf32x3 at 5.4 ms (H200) and about 6.3 ms (H100), which with the memory
# terms below leaves the TF32 products 0.8-0.9 of the tensor cores' peak — 0.75 keeps a margin (at 0.55
# the model put it at 7.7 and 8.2 ms, and on the H100 it turned down every projection of a transformer
# encoder block whose tf32x3 projections had run it at 1.49x eager on the H200).
_SGEMM_SHARE, _TF32_SHARE, _DRAM_SHARE = 0.75, 0.75, 0.8
_SPLIT_CHUNK = 512
_SPLIT_GAIN = 1.25
_SPLIT_SCRATCH_FLOOR = 256 << 20
_SPLIT_SCRATCH_TENSORS = 3
# The executor splits a large operand a block at a time (src/torch/matmul.cpp, split_blocks): a (batch 1,
# not transposed) in rows whose two parts fit 64 MiB, at least 8 Mi outputs per block, a multiple of 128,
# while b's parts fit 128 MiB; a larger b stored as [N, K] (transposed: a linear layer's weight) in blocks
# of its rows, a then whole up to 256 MiB of parts (else blocks of that size, and b's blocks as large).
_SPLIT_BLOCK_BYTES = 64 << 20
_SPLIT_WHOLE_B_BYTES = 128 << 20
_SPLIT_WIDE_BYTES = 256 << 20
_SPLIT_BLOCK_OUTPUTS = 8 << 20
_SLAB_AFTER_BYTES = 160 << 20  # k_block


def split_blocks(m: int, n: int, k: int, batch: int = 1, transpose_a: bool = False,
                 transpose_b: bool = False) -> tuple[int, int]:
    """(rows of a, rows of b = columns of the result) whose split parts a tf32x3 matmul holds at once, as
    the executor chooses them (its STITCHCUDA_TF32X3_ROWS and STITCHCUDA_TF32X3_COLS knobs included): m and
    n when it splits both whole."""
    k1, m1, n1 = max(k, 1), max(m, 1), max(n, 1)
    block_a, block_b = batch == 1 and not transpose_a, batch == 1 and transpose_b

    def rows(budget: int, at_least: int, whole: int) -> int:
        return min(max(-(-max(budget // (8 * k1), at_least) // 128) * 128, 1), whole)

    a_rows, b_rows = m1, n1
    if not block_b or 8 * n1 * k1 <= _SPLIT_WHOLE_B_BYTES:
        if block_a:
            a_rows = rows(_SPLIT_BLOCK_BYTES, -(-_SPLIT_BLOCK_OUTPUTS // n1), m1)
    else:
        if block_a and 8 * m1 * k1 > _SPLIT_WIDE_BYTES:
            a_rows = rows(_SPLIT_WIDE_BYTES, -(-_SPLIT_BLOCK_OUTPUTS // n1), m1)
        b_rows = rows(_SPLIT_WIDE_BYTES if a_rows < m1 else _SPLIT_BLOCK_BYTES, -(-_SPLIT_BLOCK_OUTPUTS // a_rows), n1)

    def knob(value: int | None, chosen: int, whole: int) -> int:  # the executor's override (0: whole)
        return chosen if value is None else whole if value == 0 else min(max(value, 1), whole)

    if block_a:
        a_rows = knob(settings().tf32x3_rows, a_rows, m1)
    if block_b:
        b_rows = knob(settings().tf32x3_cols, b_rows, n1)
    return a_rows, b_rows


def split_chunk(k: int) -> int:
    """Elements of K per hi*hi product (STITCHCUDA_TF32X3_CHUNK, the executor's knob: 0 for the whole K)."""
    override = settings().tf32x3_chunk
    return (override or max(k, 1)) if override is not None else _SPLIT_CHUNK


def k_block(m: int, n: int, k: int, batch: int = 1, transpose_a: bool = False, transpose_b: bool = False) -> int:
    """Elements of K per slab when the executor splits both operands a slab of K at a time, or 0: no slabs.
    Batch 1 and a not transposed only; used when the parts split_blocks holds exceed both 160 MiB and four
    times the result (a down-projection, whose 8 Mi-output floor keeps a whole): two slabs, half of K
    rounded up to the K-chunk, when they hold fewer parts. STITCHCUDA_TF32X3_KBLOCK overrides it (0: never;
    else rounded down to the chunk, at least one). src/torch/matmul.cpp's k_block."""
    if batch != 1 or transpose_a:
        return 0
    chunk = split_chunk(k)
    override = settings().tf32x3_kblock
    if override is not None:
        if override == 0:
            return 0
        kb = max(chunk, override // chunk * chunk)
    else:
        a_rows, b_rows = split_blocks(m, n, k, batch, transpose_a, transpose_b)
        parts, c_bytes = 8 * k * (a_rows + b_rows), 4 * m * n
        if parts <= max(4 * c_bytes, _SLAB_AFTER_BYTES):
            return 0
        kb = -(-((k + 1) // 2) // chunk) * chunk
        if 8 * (m + n) * kb >= parts:
            return 0
    return kb if kb < k else 0


def _fuse_level() -> int:
    """STITCHCUDA_TF32X3_FUSE_LO: 0 the three products apart, 1 the lo ones fused, 2 (default) with the first
    hi*hi chunk too."""
    return settings().tf32x3_fuse_lo


# bf16 products on fp32 operands (the runtime's STITCHCUDA_BF16_CAST, default 1): a matmul step of precision
# bf16 converts each fp32 operand to bf16 and multiplies at the tensor cores' bf16 rate where K is at least
# this, a product long enough that the conversion's pass is small beside the compute it halves. cuBLASLt's
# FAST_16BF mode on fp32 operands computes as TF32 does (measured on an H100), so shorter products are TF32
# steps, and at 0 every one is.
BF16_CAST_MIN_K = 256


def bf16_products(k: int) -> bool:
    """Whether a bf16 matmul of fp32 operands over K=`k` runs as bf16 products (STITCHCUDA_BF16_CAST: 0 never,
    1 (default) where K >= BF16_CAST_MIN_K, 2 always), as the runtime decides it."""
    level = settings().bf16_cast
    return level >= 2 or (level == 1 and k >= BF16_CAST_MIN_K)


def fuse_lo(k: int, batch: int = 1, transpose_a: bool = False) -> bool:
    """Whether tf32x3 runs its two lo products as one product over 2K (batch 1, a not transposed, K a
    multiple of 4, not in slabs of K; STITCHCUDA_TF32X3_FUSE_LO=0 keeps them apart): one read-modify-write
    of the result fewer. src/torch/matmul.cpp's fuse_products."""
    return _fuse_level() != 0 and batch == 1 and not transpose_a and k % 4 == 0


def fused_hi(k: int, batch: int = 1, transpose_a: bool = False) -> int:
    """Elements of K of the hi*hi product tf32x3 runs in the lo products' call (where they fuse, unless
    STITCHCUDA_TF32X3_FUSE_LO=1): its first chunk, over 2K + chunk, one pass over the result fewer — all of
    K where K fits one chunk, the three products then one, the result written once. That much of a_hi and
    b_hi is stored again: 8 + 4 * fused_hi / K bytes of parts per operand element. 0: none.
    src/torch/matmul.cpp's fuse_products."""
    return min(split_chunk(k), k) if fuse_lo(k, batch, transpose_a) and _fuse_level() >= 2 else 0


def fuse_all(k: int, batch: int = 1, transpose_a: bool = False) -> bool:
    """Whether tf32x3 runs its three products as one (fused_hi covers K)."""
    return k > 0 and fused_hi(k, batch, transpose_a) == k


def split_tf32_choice(m: int, n: int, k: int, batch: int, a_elems: int, b_elems: int,
                      peaks: dict | None, transpose_a: bool = False, transpose_b: bool = False) -> tuple[bool, str]:
    """Whether an fp32 matmul (batch x [m, k] @ [k, n]; a_elems and b_elems elements in its operands)
    should run as tf32x3, with the estimate behind the answer. The three TF32 products cost 3x the
    FLOPs at tensor-core rate, plus the split (read 4 bytes, write 8 per operand element) and a
    read-modify-write of the result for every product after the first (two, plus one per extra
    K-chunk); SGEMM costs the FLOPs at the fp32 SIMT rate, and a split again for each block of b when
    both operands are blocked. `peaks`: the Verifier's description of the GPU (fp32_tflops, tf32_tflops,
    dram_tb_s); unknown peaks keep SGEMM. The scratch counted is what the executor holds: one block of
    each operand's parts (split_blocks)."""
    fp32, tf32, dram = ((peaks or {}).get(key) or 0.0 for key in ("fp32_tflops", "tf32_tflops", "dram_tb_s"))
    if not (fp32 > 0 and tf32 > 0 and dram > 0):
        return False, "the GPU's fp32/TF32 peaks are unknown"
    flops = 2.0 * batch * m * n * k
    c_bytes = 4.0 * batch * m * n
    a_rows, b_rows = split_blocks(m, n, k, batch, transpose_a, transpose_b)
    slab = k_block(m, n, k, batch, transpose_a, transpose_b)
    hi_fused = 0 if slab else fused_hi(k, batch, transpose_a)
    part_bytes = 8.0 + 4.0 * hi_fused / max(k, 1)  # the fused hi chunk's a_hi and b_hi stored again
    scratch = part_bytes * ((a_rows * k if a_rows < m else a_elems) + (b_rows * k if b_rows < n else b_elems))
    # a split once, or again for each of b's blocks when both are blocked
    a_splits = -(-n // max(b_rows, 1)) if a_rows < m and b_rows < n else 1
    if slab:  # both operands a slab of K at a time: each split once, two more passes over c per extra slab
        scratch, a_splits = 8.0 * (m + n) * slab, 1
    largest = 4.0 * max(a_elems, b_elems, batch * m * n)
    if scratch > max(_SPLIT_SCRATCH_TENSORS * largest, _SPLIT_SCRATCH_FLOOR):
        return False, (f"its split operands ({scratch / 2**20:.0f} MiB) would exceed {_SPLIT_SCRATCH_TENSORS} times "
                       f"its largest tensor ({largest / 2**20:.0f} MiB)")
    chunk = split_chunk(k)
    chunks = -(-k // chunk) + (2 * (-(-k // slab) - 1) if slab else 0)
    # products after the first, each reading and writing c: the two lo ones (one when fused) and the chunks'
    # (the first chunk's none when it joins the fused lo products)
    rewrites = chunks + (0 if not slab and fuse_lo(k, batch, transpose_a) else 1) - (1 if hi_fused else 0)
    sgemm_s = flops / (fp32 * 1e12 * _SGEMM_SHARE)
    split_s = (3 * flops / (tf32 * 1e12 * _TF32_SHARE)
               + ((4.0 + part_bytes) * (a_splits * a_elems + b_elems) + 2.0 * c_bytes * rewrites)
               / (dram * 1e12 * _DRAM_SHARE))
    why = f"estimated {split_s * 1e3:.3f} ms as 3xTF32 against {sgemm_s * 1e3:.3f} ms as SGEMM"
    return split_s * _SPLIT_GAIN <= sgemm_s, why
