"""The template Coder: readable CUDA C++ for each fused group the offline Planner forms, one module per
kind of kernel.

- `pointwise`: one expression body per element (`ops` holds each op's C expression); broadcasting and
  any input strides through index arithmetic; a 16-byte (float4) path when every operand is contiguous
  fp32 of the output's shape, four outputs per step when broadcast operands allow;
- `rows`: reductions over the trailing contiguous dimensions — online softmax / log-softmax, layer and
  group norm, sum / mean / amax / amin and sum_exp (a log-sum-exp in one pass); fp32 rows of 128 to
  32,768 elements held in registers (a warp per row up to 1,024, a block above), up to 57,344 in shared
  memory (a vocabulary's logits), and softmax / log-softmax / layer norm rows up to 409,600 split over a
  Hopper thread-block cluster, each block holding its part in shared memory and the statistics combined
  through distributed shared memory (a 128K-entry vocabulary), so memory sees one read
  (and one write) per element with 16-byte accesses; elementwise prologues (computing the input on
  load), epilogues (applying a statistic to its row) and output functions (on each result before the
  store) fuse the ops around a reduction into its kernel; a few very long rows (a loss summed over a
  whole tensor) split into chunks reduced by their own blocks, then a second pass over the chunks; a
  softmax / log-softmax rows that only per-row readers read (statistics of elementwise ops over them,
  gathers of one column) are normalized in registers inside the readers' kernel (a KL divergence of two
  log-softmaxes, a cross entropy's picked log-probability and smoothing sum: the logits read once);
- `columns`: sum / mean / amax / amin over a block of middle dimensions, argmax / argmin over one;
- `depthwise`: one-filter-per-channel convolution with its output function, over NCHW or, inside a
  channels-last convolution chain, NHWC data (four channels per thread, 16-byte accesses);
- `pooling`: 2-D average and max pooling (PyTorch's ceil mode, padding count and NaN rules) with its
  output function, several outputs per thread and each input row loaded once for them; inside a
  channels-last chain over NHWC data, four channels per thread;
- `scan`: cumsum / cumprod along one dimension in ATen's own combining order (eager's results bit for
  bit), rows in registers and warp shuffles, elementwise ops fused on load and on store;
- `transpose`: a channels-last chain's edges: NCHW to NHWC at its input, 32 x 32 tiles through shared
  memory, and at its output the elementwise ops writing an NCHW result from NHWC operands staged through
  the same tiles;
- `scatter`: a KV cache's `index_copy_` into a program state, its source's elementwise producers (RoPE) and
  its int64 bookkeeping (positions, a counter; exact in 64-bit integers) in the same launch, eight values
  per thread stored 16 bytes at a time; small int64 adds alone in one block;
- `common`: the prelude every kernel includes, KernelCode, and the inputs and elementwise functions the
  others share.

Every kernel is `extern "C"`, computes in fp32 (fp16/bf16 are converted on load and store) and takes its
sizes as arguments where they vary; shapes that select the code path are baked in as constants.
"""

from .attention import DecodeKernels, decode_attention_kernels, flash_attention_kernel  # noqa: F401 (docs/attention.md)
from .columns import column_reduction_kernel
from .common import FUSABLE_DTYPES, CatPiece, KernelCode, PointwiseInput, RowPrologue
from .depthwise import DEPTHWISE_MAX_TAPS, depthwise_conv_kernel, depthwise_conv_nhwc_kernel
from .ops import POINTWISE_OPS, is_pointwise
from .pooling import POOL_MAX_TAPS, pool_output_size, pooling_blocker, pooling_kernel, pooling_nhwc_kernel
from .pointwise import pointwise_kernel
from .rows import (CACHED_ROW_MAX, CACHED_ROW_MIN, CLUSTER_ROW_MAX, NORMALIZING, REDUCTIONS, SHARED_ROW_MAX,
                   STATISTICS, RowProduct, cluster_size, normalized_rows_kernel, row_reduction_kernel, split_rows)
from .scan import SCAN_EXTENT_MAX, SCANS, aten_tile, scan_kernel
from .transpose import nchw_to_nhwc_kernel, pointwise_from_nhwc_kernel

__all__ = ["KernelCode", "PointwiseInput", "CatPiece", "RowPrologue", "pointwise_kernel", "row_reduction_kernel",
           "column_reduction_kernel", "depthwise_conv_kernel", "depthwise_conv_nhwc_kernel", "POINTWISE_OPS",
           "REDUCTIONS", "NORMALIZING", "STATISTICS", "FUSABLE_DTYPES", "CACHED_ROW_MAX", "CACHED_ROW_MIN",
           "SHARED_ROW_MAX", "CLUSTER_ROW_MAX", "cluster_size", "DEPTHWISE_MAX_TAPS", "is_pointwise",
           "pooling_kernel", "pooling_nhwc_kernel", "pooling_blocker", "pool_output_size", "POOL_MAX_TAPS",
           "scan_kernel", "aten_tile", "SCANS", "SCAN_EXTENT_MAX", "split_rows",
           "nchw_to_nhwc_kernel", "pointwise_from_nhwc_kernel", "normalized_rows_kernel", "RowProduct"]
