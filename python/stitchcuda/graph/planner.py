"""The offline Planner: partitions a captured core-ATen graph into groups, each with a strategy and the
reason for it, plus the host decisions (CUDA graph, precision). No LLM: rules a compiler engineer would
apply first.

- GEMMs (`mm`, `addmm`, `bmm`; `linear` arrives as `permute` + `addmm`) become cuBLASLt steps; a weight's
  transpose is folded into the step, a bias into the bias epilogue, and a following ReLU or tanh-GELU
  into the epilogue too. Whatever else follows (an exact GELU, a residual add) is a pointwise group.
  An fp32 GEMM large enough to be bound by fp32 arithmetic runs as three TF32 tensor-core products on
  split operands (tf32x3: fp32's accuracy, checked at fp32's tolerance) where the GPU's peaks say that
  is faster (`split_tf32_choice`).
- Pointwise chains of the same shape (with broadcasting, dtype casts, inference batch norm) become one
  fused kernel; values used only inside the chain never touch memory.
- Row reductions over the trailing contiguous dimensions (softmax, log-softmax, layer norm, sum, mean,
  amax, amin) become template kernels, and so do sum/mean/amax/amin over a block of middle dimensions and
  argmax/argmin over one (a class map); an elementwise chain that only computes a reduction's input
  (a residual add before a layer norm, a scale before a softmax) is fused into its loads,
  elementwise ops that apply a sum/mean/amax/amin back to its row (an RMS norm) into the same kernel,
  and an elementwise chain reading only a normalized result (GroupNorm -> SiLU) into its store.
- Depthwise convolutions (one filter per channel, a MobileNet block's 3x3) become a template kernel, with
  the elementwise chain reading only its result (an inference batch norm and activation) applied before
  the store; other convolutions go to cuDNN.
- 2-D average and max pooling (`avg_pool2d`, `max_pool2d`, and `max_pool2d_with_indices` whose indices
  nothing reads) become a template kernel, with the elementwise chain reading only its result applied
  before the store; 3-D pooling, used indices and other dtypes stay ATen steps.
- fp32 `cumsum` and `cumprod` along one dimension become a scan template kernel that combines in ATen's
  own order (eager's results bit for bit), with an elementwise chain computing only its input fused into
  its loads and one reading only its result applied before the store; a tensor that is one row (ATen's
  CUB scan) and other dtypes stay ATen steps.
- Attention written out (matmul -> scale -> mask -> softmax -> matmul, graph/attention.py) becomes one
  attention group: an ATen scaled_dot_product_attention step by default (ATen picks flash or
  memory-efficient at run time), or the fused template where asked (`attention="fused"`); either way the
  N x N scores are never in memory. Attention of decode's shape over a static cache (a few query tokens
  over every cached position, a mask saying which are filled), written out or an SDPA call, becomes the
  split-KV decode kernels, which read only the keys the mask keeps (the default, `attention="auto"`; 2.1 to
  4.9x SDPA on an H100, which reads every position); over exactly the filled keys (no mask) SDPA is ahead and
  stays. Prefill attention (written out or an SDPA call) becomes the fused prefill template where it was
  measured ahead of SDPA's kernels (attention.PREFILL_AHEAD: fp16/bf16 at head dims 64 and 128, fp32 at head
  dim 64; no mask; 128 queries or more). Other SDPA calls stay the ATen steps the capture keeps whole.
- Views become View steps (no copy) where the source's layout allows.
- Values computed only from weights are folded into constants.
- Everything else (other convolutions through cuDNN, other pooling, indexing, ...) stays an ATen step.
"""

from __future__ import annotations

import torch

from ..program import DTYPES as PROGRAM_DTYPES
from ..settings import settings
from .attention import (attention_inputs, decode_blocker, find_attention, prefill_blocker, replaced_nodes,
                        sdpa_blocker, template_blocker)
from .capture import VIEW_OPS, Graph, Node, Value
from .cache_write import fuse_cache_writes
from .gemm_precision import bf16_products, split_tf32_choice
from .groups import GENERATED, Group, GraphPlan
from .layout import channels_last_values
from .templates import (CACHED_ROW_MAX, CACHED_ROW_MIN, CLUSTER_ROW_MAX, DEPTHWISE_MAX_TAPS, FUSABLE_DTYPES, NORMALIZING,
                        POINTWISE_OPS, SCAN_EXTENT_MAX, SHARED_ROW_MAX, STATISTICS, aten_tile, cluster_size,
                        pooling_blocker, split_rows)
from .projections import merge_projections

__all__ = ["Group", "GraphPlan", "OfflinePlanner", "GENERATED", "unheld_dtype", "split_tf32_choice", "conv_epilogues",
           "ATTENTION_STEPS", "merge_identical_casts"]


_VIEW_OPS = VIEW_OPS
_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm"}
_SAME_SHAPE_VIEWS = {"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::expand", "aten::alias"}
# Ops whose result depends on their arguments' values alone (no tensor input): a causal mask's arange and
# full, a scalar_tensor(-inf). Folded into constants up to this many bytes.
_FACTORY_OPS = {"aten::arange", "aten::arange.start", "aten::arange.start_step", "aten::full", "aten::scalar_tensor",
                "aten::zeros", "aten::ones"}
_FACTORY_FOLD_BYTES = 64 << 20
_REDUCTION_OPS = {"aten::_softmax": "softmax", "aten::_log_softmax": "log_softmax",
                  "aten::native_layer_norm": "layer_norm", "aten::native_group_norm": "group_norm",
                  "aten::sum.dim_IntList": "sum", "aten::sum": "sum",  # the second: over every element
                  "aten::mean.dim": "mean", "aten::mean": "mean", "aten::amax": "amax", "aten::amin": "amin",
                  "aten::argmax": "argmax", "aten::argmin": "argmin"}
_POOL_OPS = {"aten::avg_pool2d": "avg", "aten::max_pool2d_with_indices": "max", "aten::max_pool2d": "max"}
_SCAN_OPS = {"aten::cumsum": "cumsum", "aten::cumprod": "cumprod"}
# What attention becomes (OfflinePlanner's `attention`, STITCHCUDA_ATTENTION by default). "auto" (the
# default): attention of decode's shape over a static cache (a few query tokens, a mask over the cached
# positions; SDPA calls included) the split-KV decode kernels, prefill attention where the fused template
# was measured ahead of SDPA (attention.prefill_blocker) that template, other attention as "sdpa"; "sdpa": written-out
# attention one ATen SDPA step, SDPA calls their own; "fused": the decode kernels wherever decode's shape
# allows, else the fused prefill template where it computes the attention (else the SDPA step); "off":
# written-out attention stays the matmul and softmax groups. Why "auto" draws the line at the mask
# (docs/attention.md, H100): over a 2,048-position static cache the kernels ran 2.1-4.9x SDPA, which reads
# every position; over exactly the filled keys SDPA's kernel was ahead (ours 0.63-0.84x of it). The prefill
# template ran 1.02-1.36x SDPA's flash backend at bf16 (the mma.sync kernel) and 1.08-1.17x its memory-
# efficient backend at fp32 with head dim 64, 0.83x at 128.
ATTENTION_STEPS = ("auto", "sdpa", "fused", "off")


def unheld_dtype(node: Node) -> torch.dtype | None:
    """The first dtype among the node's inputs and results that no program buffer holds (complex
    numbers, from torch.fft for instance), else None. Such a node is an ATen group whatever its op."""
    held = PROGRAM_DTYPES.values()
    for v in [*node.inputs, *node.outputs]:
        if v is not None and v.dtype not in held:
            return v.dtype

    def scalar(a) -> bool:  # a Python complex argument (x * 1j) is a complex128 value
        return isinstance(a, complex) or (isinstance(a, (list, tuple)) and any(scalar(x) for x in a))

    return torch.complex128 if scalar(node.args) or scalar(tuple(node.kwargs.values())) else None


_BATCH_NORM = "aten::_native_batch_norm_legit_no_training"
_CUDNN_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def conv_epilogues(groups: list[Group], outputs: set[str]) -> dict[int, dict]:
    """The convolutions whose elementwise epilogue cuDNN's fused convolutions compute: a 2-D cuDNN
    convolution whose result only a pointwise group reads, that group being [batch norm] [+ z] relu
    (conv -> BN -> ReLU, a residual block's conv -> BN -> add -> ReLU, conv with bias -> ReLU). The
    inference batch norm folds into the filter and bias (w * s, (b - mean) * s + beta with
    s = gamma / sqrt(var + eps)); `aten::cudnn_convolution_relu` or `aten::cudnn_convolution_add_relu`
    then computes relu(conv(x, w') + b' [+ z]) in one cuDNN call. Returns, by id of the pointwise group:
    {"conv_group", "conv", "bn" (or None), "z" (or None), "out"}."""
    found: dict[int, dict] = {}
    conv_of: dict[str, Group] = {}
    for g in groups:
        if g.kind == "aten" and len(g.nodes) == 1 and g.nodes[0].op == "aten::convolution":
            conv_of[g.nodes[0].out.name] = g
    for g in groups:
        first = g.nodes[0].args[0] if g.kind == "pointwise" and g.nodes and g.nodes[0].args \
            and "relayout" not in g.params else None
        conv_group = conv_of.get(first.name) if isinstance(first, Value) else None
        if conv_group is None:
            continue
        match = _conv_epilogue(conv_group.nodes[0], g, outputs)
        if match is not None:
            found[id(g)] = {"conv_group": conv_group, **match}
    return found


def _conv_epilogue(conv: Node, g: Group, outputs: set[str]) -> dict | None:
    """conv_epilogues' match of one convolution and the pointwise group reading its result, else None."""
    weight, bias = conv.args[1], conv.args[2]
    if conv.args[6] or not isinstance(weight, Value) or len(weight.shape) != 4 or weight.kind != "weight" \
            or (bias is not None and getattr(bias, "kind", None) != "weight"):
        return None  # transposed, not 2-D, or a filter computed in the forward
    y = conv.out
    if y.dtype not in _CUDNN_FUSED_DTYPES or y.name in outputs or len(y.users) != 1 or y.users[0] is not g.nodes[0]:
        return None
    nodes = list(g.nodes)
    moved = _channel_bias(nodes[0], y) if bias is None else None  # the capture's bias, after the conv
    bias_add = nodes.pop(0) if moved is not None else None
    bias = moved if moved is not None else bias
    bn = nodes.pop(0) if nodes and nodes[0].op == _BATCH_NORM else None
    if bn is not None:
        gamma, beta, mean, var = bn.args[1:5]
        if mean is None or var is None or any(p is not None and (not isinstance(p, Value) or p.kind != "weight")
                                              for p in (gamma, beta, mean, var)):
            return None
    add = nodes.pop(0) if nodes and nodes[0].op == "aten::add.Tensor" else None
    if len(nodes) != 1 or nodes[0].op != "aten::relu":
        return None
    relu = nodes[0]
    value, z = y, None
    for n in (bias_add, bn, add, relu):  # each link reads the one before it, which nothing else reads
        if n is None:
            continue
        if value is not y and (value.name in outputs or len(value.users) != 1 or value.users[0] is not n):
            return None
        if n is add:
            if add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2 or value not in add.args:
                return None
            z = add.args[1] if add.args[0] is value else add.args[0]
            if not isinstance(z, Value) or z is value or tuple(z.shape) != tuple(y.shape) or z.dtype != y.dtype:
                return None  # x + x, a broadcast or a scalar: not cuDNN's z
        elif n is not bias_add and n.args[0] is not value:  # _channel_bias checked the add reads y
            return None
        value = n.out
    if g.outputs(outputs) != [relu.out]:
        return None
    return {"conv": conv, "bn": bn, "z": z, "out": relu.out, "bias": bias}


def _channel_bias(node: Node, y: Value) -> Value | None:
    """The weight `b` when `node` is y + b.view(C, 1, 1) (or [1, C, 1, 1]), a convolution's bias the
    capture moved after it (capture._convolution_biases_apart), else None."""
    if node.op != "aten::add.Tensor" or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2 or y not in node.args:
        return None
    other = node.args[1] if node.args[0] is y else node.args[0]
    view = other.producer if isinstance(other, Value) else None
    if view is None or view.op != "aten::view" or not view.args or not isinstance(view.args[0], Value):
        return None
    b, channels = view.args[0], y.shape[1]
    if b.kind != "weight" or tuple(b.shape) != (channels,) or b.dtype != y.dtype \
            or tuple(other.shape) not in ((channels, 1, 1), (1, channels, 1, 1)):
        return None
    return b


def _low_precision_matmuls(graph: Graph) -> str:
    """"bf16" or "fp16" when the graph has matmuls and all of them work on that dtype, else ""."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    dtypes = {n.out.dtype for n in graph.nodes if n.op in _GEMM_OPS and n.outputs and n.outputs[0] is not None}
    return names.get(next(iter(dtypes)), "") if len(dtypes) == 1 else ""


def rotate_half_source(node: Node) -> tuple[Value, int] | None:
    """(x, h) when `node` is cat((-x[..., h:], x[..., :h]), dim=-1) over x's last dimension of 2h — RoPE's
    rotate_half, which a fused kernel reads as x with its halves swapped — else None. The halves are two
    slices of x, or the two pieces of one split of x (`x1, x2 = x.chunk(2, dim=-1)`, how the transformer
    libraries write it)."""
    if node.op != "aten::cat" or not node.args or not isinstance(node.args[0], (list, tuple)) \
            or len(node.args[0]) != 2 or not node.outputs or node.outputs[0] is None:
        return None
    out = node.out
    rank = len(out.shape)
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    first, second = node.args[0]
    if rank == 0 or dim % rank != rank - 1 or not isinstance(first, Value) or not isinstance(second, Value):
        return None
    neg, low = first.producer, second.producer
    high = neg.args[0].producer if neg is not None and neg.op == "aten::neg" else None
    if high is not None and high is low and high.op in ("aten::split_with_sizes", "aten::split.Tensor"):
        return _split_halves(high, neg.args[0], second, out)
    if high is None or low is None or high.op != "aten::slice.Tensor" or low.op != "aten::slice.Tensor":
        return None
    x = low.args[0]
    d = x.shape[-1] if isinstance(x, Value) and x.shape else 0
    if high.args[0] is not x or d % 2 or tuple(x.shape) != tuple(out.shape):
        return None

    def bounds(s: Node) -> tuple[int, int, int, int]:
        a = list(s.args) + [None] * (5 - len(s.args))
        return (a[1] % rank if a[1] is not None else 0, a[2] or 0, min(a[3] if a[3] is not None else d, d), a[4] or 1)

    if bounds(low) != (rank - 1, 0, d // 2, 1) or bounds(high) != (rank - 1, d // 2, d, 1):
        return None
    return x, d // 2


def _split_halves(split: Node, high: Value, low: Value, out: Value) -> tuple[Value, int] | None:
    """rotate_half_source's (x, h) when `split` cuts x's last dimension of 2h into two halves, `low` its
    first piece and `high` its second, else None."""
    x = split.args[0] if split.args else None
    if not isinstance(x, Value) or not x.shape or tuple(x.shape) != tuple(out.shape) or x.shape[-1] % 2 \
            or len(split.outputs) != 2 or split.outputs[0] is not low or split.outputs[1] is not high:
        return None
    rank, d = len(x.shape), x.shape[-1]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    sizes = split.args[1] if len(split.args) > 1 else None
    halves = list(sizes) == [d // 2, d // 2] if isinstance(sizes, (list, tuple)) else sizes == d // 2
    return (x, d // 2) if dim % rank == rank - 1 and halves else None


# Views an elementwise chain's result may reach its reader through while the chain runs in the reader's
# layout (OfflinePlanner._relaid_out_copies): relabelings of the same elements, no offset.
RELAYOUT_VIEWS = frozenset({"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::alias", "aten::permute",
                            "aten::transpose.int", "aten::t", "aten::unsqueeze", "aten::squeeze.dim",
                            "aten::squeeze.dims", "aten::squeeze", "aten::expand"})


def broadcast_strides(vshape: tuple[int, ...], vstrides: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides over `shape` of a tensor of `vshape` with `vstrides` broadcast to it (aligned at the
    last dimension): 0 along the dimensions it lacks or has at extent 1 where `shape` does not."""
    rank = len(shape)
    strides = [0] * rank
    for d in range(rank):
        di = d - (rank - len(vshape))
        if di >= 0 and not (vshape[di] == 1 and shape[d] != 1):
            strides[d] = vstrides[di]
    return tuple(strides)


def relayout_strides(shape: tuple[int, ...], strides: tuple[int, ...], chain: list[Node]) -> tuple[int, ...] | None:
    """The strides over the chain's result of a tensor of `shape` with `strides` (0 where broadcast) taken
    through the view nodes `chain`, as torch computes them on the meta device; None where a view cannot
    relabel those strides (a reshape that would have to copy)."""
    t = torch.empty_strided(tuple(shape), tuple(strides), device="meta")
    try:
        for n in chain:
            if n.op in ("aten::reshape", "aten::_unsafe_view"):  # a view or nothing: never reshape's copy
                t = torch.ops.aten.view.default(t, n.args[1])
            else:
                t = n.target(t, *n.args[1:], **n.kwargs)
    except RuntimeError:
        return None
    return tuple(t.stride())


def in_place_cat(node: Node) -> bool:
    """Whether `node` is a concatenation an elementwise kernel reads in place (its pieces loaded by range;
    RoPE's rotate_half is the other cat such a kernel reads)."""
    return node.op == "aten::cat" and rotate_half_source(node) is None


def _reads_pieces(g: Group | None) -> bool:
    """Whether the elementwise group reads a concatenation in place: only its own kernel can (the
    reduction, scan and row templates load each operand whole), so it is not fused into them."""
    return g is not None and any(in_place_cat(n) for n in g.nodes)


# Pieces of one concatenation read in place: a pointer each, a branch each per element.
CAT_MAX_PIECES = 16


def _broadcast_matrix(v: Value) -> Value | None:
    """The single matrix behind a bmm operand that is its expansion over the batch (expand of a [K, N]
    or [1, K, N] value to [B, K, N], possibly viewed again at that shape), else None."""
    while v.producer is not None and v.producer.op in ("aten::view", "aten::_unsafe_view") \
            and tuple(v.producer.args[0].shape) == tuple(v.shape):
        v = v.producer.args[0]
    p = v.producer
    if p is None or p.op != "aten::expand" or len(v.shape) != 3:
        return None
    source = p.args[0]
    if not isinstance(source, Value) or tuple(source.shape) not in (tuple(v.shape[1:]), (1, *v.shape[1:])):
        return None
    return source


def _dims(dims, rank: int) -> list[int]:
    # No dims and an empty list both mean every dim: ATen's sum/mean/amax/amin over dim=[] reduce it all.
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % rank if rank else 0 for d in dims)


def _output_function(g: Group, nxt: Group, outputs: set[str]) -> Group | None:
    """The reduction `g` with the elementwise group `nxt` applied to its results before the store, when
    `nxt` has the result's shape, is the only reader of the result, and leaves one float value."""
    y = g.params["node"].out
    inside = {id(n) for n in nxt.nodes}
    if nxt.kind != "pointwise" or _reads_pieces(nxt) or nxt.params["shape"] != y.shape or y.name in outputs or not y.users \
            or any(id(u) not in inside for u in y.users):
        return None
    leaving = nxt.outputs(outputs)
    if len(leaving) != 1 or leaving[0].dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    ops = ", ".join(n.op.removeprefix("aten::") for n in nxt.nodes)
    return Group(g.kind, [*g.nodes, *nxt.nodes],
                 f"{g.reason}; then {len(nxt.nodes)} elementwise op(s) ({ops}) applied before the store",
                 {**g.params, "output": list(nxt.nodes), "result": leaving[0]})


def merge_identical_casts(graph: Graph, outputs: set[str]) -> int:
    """Points the readers of a `_to_copy` that repeats an earlier one (the same tensor, the same arguments:
    autocast casting a norm's fp32 output to bf16 once per projection that reads it) at the earlier cast's
    result and drops the repeat from `graph.nodes`, so the one cast can join its producer's kernel.
    A repeat that is a graph output keeps its node (an output owns its buffer). The exported program is
    untouched: the reference run still computes both, equal values. Returns how many were merged."""
    first: dict[tuple, Node] = {}
    gone: set[int] = set()

    def swap(a, old: Value, new: Value):
        if a is old:
            return new
        if isinstance(a, (list, tuple)):
            return type(a)(swap(x, old, new) for x in a)
        return a

    for n in graph.nodes:
        src = n.args[0] if n.op == "aten::_to_copy" and len(n.args) == 1 else None
        if not isinstance(src, Value) or len(n.outputs) != 1 or n.outputs[0] is None:
            continue
        key = (src.name, tuple(sorted((k, repr(v)) for k, v in n.kwargs.items())))
        seen = first.setdefault(key, n)
        out, kept = n.out, seen.out
        if seen is n or out.name in outputs or (tuple(out.shape), tuple(out.strides), out.dtype) != \
                (tuple(kept.shape), tuple(kept.strides), kept.dtype):
            continue
        for u in out.users:
            u.args = swap(u.args, out, kept)
            u.kwargs = {k: swap(v, out, kept) for k, v in u.kwargs.items()}
            if all(u is not w for w in kept.users):
                kept.users.append(u)
        out.users = []
        src.users = [u for u in src.users if u is not n]
        gone.add(id(n))
    if gone:
        graph.nodes = [n for n in graph.nodes if id(n) not in gone]
    return len(gone)


# Row-shaped values of the absorbed chain that the rest of the model reads and the norm's kernel stores
# besides its result (a residual sum; two for a block that keeps two streams).
ROW_STORES_MAX = 2


def _row_producer_into_loads(out: list[Group], g: Group, outputs: set[str]) -> None:
    """Moves into the loads of the reduction `g` (a statistic applied back to its row) the elementwise group
    just before it (`out[-1]`): an RMS norm's fp32 upcast and square, whose upcast value the row's scaling
    reads too (`x.float()` read by `pow` and by `h * rsqrt(...)`), so the open chain could not be the
    reduction's prologue whole. The upcast value is computed again by the epilogue from the same loaded
    row (`Lowering._lower_reduction`), never stored: a bf16 norm reads its row once in 16-bit instead of
    writing and reading it back twice in fp32. What the rest of the model reads (the residual sum before
    the norm), up to ROW_STORES_MAX row-shaped values, the norm's kernel stores too (`params["stores"]`),
    computed again from the rows it loads, so the add is not a kernel of its own; beyond that, those values
    and what they are computed from stay in the group before, stored as before."""
    pre = out[-1] if out else None
    node = g.params["node"]
    x = node.args[0]
    if pre is None or pre.kind != "pointwise" or g.params.get("prologue") or "split" in g.params \
            or g.params.get("layout") == "column" or "relayout" in pre.params or _reads_pieces(pre) \
            or not isinstance(x, Value) or tuple(pre.params["shape"]) != tuple(x.shape) or x.name in outputs \
            or [id(u) for u in x.users] != [id(node)] or all(x.producer is not n for n in pre.nodes) \
            or any(rotate_half_source(n) is not None for n in pre.nodes):
        return
    inside = {id(n) for n in g.nodes} | {id(n) for n in pre.nodes}
    made_by = {v.name: n for n in pre.nodes for v in n.outputs if v is not None}
    kept: set[int] = set()
    leaving = [v for n in pre.nodes for v in n.outputs if v is not None
               and (v.name in outputs or any(id(u) not in inside for u in v.users))]
    if len(leaving) > ROW_STORES_MAX or any(v.dtype not in (torch.float32, torch.float16, torch.bfloat16)
                                            or tuple(v.shape) != tuple(x.shape) for v in leaving):
        stack = [v.producer for v in leaving]
        leaving = []
    else:
        # What the rest of the model reads (the residual sum) is written by the norm's kernel too, computed
        # again from the rows it loads: the group before it goes.
        stack = []
    while stack:  # what leaves the group, and what it is computed from, stays
        n = stack.pop()
        if id(n) not in kept:
            kept.add(id(n))
            stack += [made_by[v.name] for v in n.inputs if v.name in made_by]
    moved = [n for n in pre.nodes if id(n) not in kept]
    if not moved:
        return
    if len(moved) == len(pre.nodes):
        out.pop()
    else:
        pre.nodes = [n for n in pre.nodes if id(n) in kept]
        pre.reason = (f"{len(pre.nodes)} elementwise op(s) ({', '.join(n.op.removeprefix('aten::') for n in pre.nodes)})"
                      " fused into one kernel")
    ops = ", ".join(n.op.removeprefix("aten::") for n in moved)
    g.params["prologue"] = moved
    g.nodes = [*moved, *g.nodes]
    g.reason += f"; {len(moved)} elementwise op(s) ({ops}) fused into its loads, recomputed where the row's ops read them"
    if leaving:
        g.params["stores"] = leaving
        g.reason += f", {len(leaving)} of their results ({', '.join(v.name for v in leaving)}) stored by the same kernel"


class OfflinePlanner:
    """Rules-based partitioning (no LLM). `precision`: "fp32" follows PyTorch's flags at call time;
    "tf32" or "bf16" allow faster matmuls."""

    def __init__(self, precision: str = "fp32", graphs: bool = True, peaks: dict | None = None,
                 split_tf32: bool = True, attention: str | None = None) -> None:
        if precision not in ("fp32", "tf32", "bf16"):
            raise ValueError(f"precision must be 'fp32', 'tf32' or 'bf16', not {precision!r}")
        attention = settings().attention if attention is None else attention
        if attention not in ATTENTION_STEPS:
            raise ValueError(f"attention must be one of {ATTENTION_STEPS}, not {attention!r}")
        self.attention = attention
        self.precision = precision
        self.graphs = graphs
        # The GPU's peaks (verify.hardware.describe()) for tf32x3's cost model; None: every fp32 GEMM is SGEMM.
        self.peaks = peaks
        self.split_tf32 = split_tf32

    def plan(self, graph: Graph) -> GraphPlan:
        decisions, matmul_precision = self._precision_decisions(graph)
        # A buffer's new value (a program state's) is stored like an output: the state is written from it.
        outputs = {v.name for v in (*graph.outputs, *graph.state_values.values())}
        merged = merge_identical_casts(graph, outputs)
        if merged:
            decisions.append((f"{merged} repeated cast(s) merged with an identical earlier one",
                              "torch.autocast casts a value again for each op that reads it (a norm's output "
                              "before the q, k and v projections): one cast, read by all of them, joins the "
                              "norm's kernel as its store instead of standing as kernels of their own"))
        attention = self._attention(graph, outputs, decisions)
        groups = _Partition(self, graph, outputs, matmul_precision, attention).groups()
        if attention:  # a causal mask the steps no longer read, built for the scores alone
            groups = _without_unread_groups(groups, outputs)
        groups = self._without_unread_negations(groups, outputs)
        if settings().gemv:  # sibling projections of decode's shape as one GEMV kernel (graph/projections.py)
            groups = merge_projections(groups, outputs, decisions)
        if settings().fuse_cache_write:  # KV cache writes and int64 bookkeeping as generated kernels
            groups = fuse_cache_writes(groups, graph, outputs, decisions)
        self._split_decision(groups, decisions)
        if matmul_precision == "fp32_or_split":
            matmul_precision = "fp32"
        plan = GraphPlan(self._relaid_out_copies(self._normalized_inputs(
            self._online_sum_exp(self._row_epilogues(groups, outputs), outputs), outputs), outputs),
            decisions, matmul_precision)
        tf32_convs = sum(n.op == "aten::convolution" and isinstance(n.args[0], Value)
                         and n.args[0].dtype == torch.float32 for n in graph.nodes)
        if matmul_precision == "fp32" and tf32_convs and torch.backends.cudnn.allow_tf32:
            plan.judged_at = "tf32"
            decisions.append(("outputs judged at TF32's tolerance",
                              f"the model runs its {tf32_convs} fp32 convolution(s) with TF32 "
                              "(torch.backends.cudnn.allow_tf32, PyTorch's default): its own result carries TF32's "
                              "rounding, and another cuDNN algorithm (NHWC data, a batch norm folded into the filter) "
                              "rounds differently by more than fp32's 1e-4 — set the flag off for true fp32 "
                              "convolutions judged at 1e-4"))

        plan.channels_last = channels_last_values(graph, plan.groups)
        plan.conv_epilogues = conv_epilogues(plan.groups, outputs)
        if plan.channels_last:
            convs = sum(n.op == "aten::convolution" for g in plan.groups if g.kind == "aten" for n in g.nodes)
            decisions.append((f"convolution chains channels-last ({len(plan.channels_last)} values NHWC in memory)",
                              f"cuDNN's tensor-core convolutions ({convs}) run on NHWC data: one conversion at each "
                              "chain's edge instead of a transpose in and out of every convolution; the elementwise "
                              "groups between them iterate in NHWC order"))
        return plan

    def _attention(self, graph: Graph, outputs: set[str], decisions: list[tuple[str, str]]) -> dict[int, Group]:
        """Attention written out (graph/attention.py), and SDPA calls of decode's shape, as one group each, by
        the id of every node it takes: one step that never builds the N x N scores, placed where the
        attention's output is made. Decode's shape (`decode_blocker`: a few query tokens over many keys)
        becomes the split-KV decode kernels with `attention="fused"`, and with "auto" where a mask says which
        keys count (a static cache): SDPA reads every key, the kernels only those the mask keeps. Where no step can take written-out attention (a learned
        scale aside, which the recognizer already refuses: dropout in training, mixed dtypes, a finite fill
        that does not mask), the decisions say why and the matmul and softmax groups stay."""
        if self.attention == "off":
            return {}
        taken: dict[int, Group] = {}
        for a in find_attention(graph):
            decode = ((self.attention == "fused" or self.attention == "auto" and a.mask is not None)
                      and decode_blocker(a) is None)
            ahead = not decode and self.attention == "auto" and prefill_blocker(a) is None
            if a.kind != "written" and not decode and not ahead:
                continue  # an SDPA call: already one ATen step (capture's KEPT_WHOLE)
            why_not = sdpa_blocker(a)
            if why_not is not None:
                decisions.append((f"attention at {a.output.name} kept as written (matmul and softmax groups)",
                                  f"one attention step cannot take it: {why_not}"))
                continue
            template = template_blocker(a)
            impl = ("decode" if decode else "fused" if (self.attention == "fused" or ahead) and template is None
                    else "sdpa")
            what = (f"{'causal ' if a.causal else ''}attention {a.batch}x{a.heads}"
                    f"{f'(kv {a.kv_heads})' if a.kv_heads != a.heads else ''}x{a.q_len}x{a.kv_len}x{a.head_dim}"
                    f"{f', {a.mask_kind} mask' if a.mask is not None else ''}")
            how = {"decode": "the split-KV decode kernels (the keys cut into splits across blocks, a key the mask "
                             "drops never read)",
                   "fused": "the fused attention template (online softmax, the scores in registers)",
                   "sdpa": "one ATen scaled_dot_product_attention step (ATen picks flash or memory-efficient at "
                           "run time)"}[impl]
            nodes = replaced_nodes(a, outputs)
            source = f"written out ({len(nodes)} ops)" if a.kind == "written" else f"an SDPA call ({len(nodes)} ops)"
            group = Group("attention", nodes,
                          f"{what} {source} as {how}: the {a.q_len}x{a.kv_len} scores never in memory"
                          + (f"; the template cannot: {template}" if self.attention == "fused" and impl == "sdpa"
                             else ""),
                          {"attention": a, "impl": impl, "inputs": attention_inputs(a), "template": template})
            if decode:
                decisions.append((f"attention at {a.output.name} ({what}) as the split-KV decode kernels",
                                  f"{a.q_len} query token(s) over {a.kv_len} keys: the attention is a pass over "
                                  "the keys, its time its bytes read; SDPA reads all of them, the decode kernels "
                                  "only those the mask keeps (attention=\"sdpa\" keeps the ATen step)"))
            elif ahead:
                decisions.append((f"attention at {a.output.name} ({what}) as the fused prefill template",
                                  f"{str(a.q.dtype).removeprefix('torch.')} at head dim {a.head_dim}, no mask: where the "
                                  "template was measured ahead of SDPA's kernels (attention=\"sdpa\" keeps the ATen "
                                  "step)"))
            for n in nodes:
                taken[id(n)] = group
        return taken

    def _precision_decisions(self, graph: Graph) -> tuple[list[tuple[str, str]], str]:
        """The host decisions (matmul and convolution precision, CUDA graph replay) and the precision the
        GEMMs are planned at ("fp32_or_split": each fp32 GEMM decides between SGEMM and tf32x3)."""
        decisions: list[tuple[str, str]] = []
        matmul_precision = self.precision
        if self.precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
            matmul_precision = "tf32"
            decisions.append(("matmuls may use TF32", "torch.backends.cuda.matmul.allow_tf32 is on at call time"))
        elif self.precision == "fp32" and _low_precision_matmuls(graph):
            decisions.append((f"matmuls in {_low_precision_matmuls(graph)}, the model's dtype",
                              "every matmul's operands are half-precision tensors: tensor-core products accumulated "
                              "in fp32, as eager PyTorch computes them"))
        elif self.precision == "fp32":
            decisions.append(("matmuls in true fp32", "PyTorch's default (allow_tf32 off); pass precision='tf32' or "
                                                      "'bf16' to allow faster tensor-core math"))
            if self.split_tf32:
                matmul_precision = "fp32_or_split"  # _gemm decides per GEMM; the plan's precision stays fp32
        else:
            decisions.append((f"matmuls may use {self.precision}", "requested by the caller"))
        decisions.append(("convolutions through cuDNN with TF32" if torch.backends.cudnn.allow_tf32 else
                          "convolutions through cuDNN in fp32", "torch.backends.cudnn.allow_tf32 at call time"))
        decisions.append(("replay as one CUDA graph or launch the steps directly, whichever is faster"
                          if self.graphs else "launch the steps directly (no CUDA graph)",
                          "static shapes allow one capture and a single launch per forward, but a replay copies the "
                          "inputs and outputs through the graph's own buffers: both are timed on the example inputs "
                          "once the program is built" if self.graphs else "graphs=False was requested"))

        return decisions, matmul_precision

    @staticmethod
    def _without_unread_negations(groups: list[Group], outputs: set[str]) -> list[Group]:
        """`groups` without the negated halves a fused rotate_half reads from x itself, and each elementwise
        chain's reason naming its ops."""
        # The negated half a fused rotate_half reads from x itself is computed by nobody else: its group goes.
        rotated = {id(n) for g in groups if g.kind == "pointwise" for n in g.nodes if rotate_half_source(n)}

        def unread(g: Group) -> bool:
            neg = g.nodes[0]
            return (g.kind == "pointwise" and len(g.nodes) == 1 and neg.op == "aten::neg" and neg.out.name not in outputs
                    and bool(neg.out.users) and all(id(u) in rotated for u in neg.out.users))

        groups = [g for g in groups if not unread(g)]
        for g in groups:
            if g.kind == "pointwise":
                ops = ", ".join(n.op.removeprefix("aten::") for n in g.nodes)
                g.reason = f"{len(g.nodes)} elementwise op(s) ({ops}) fused into one kernel"
        return groups

    @staticmethod
    def _split_decision(groups: list[Group], decisions: list[tuple[str, str]]) -> None:
        """Rewrites the fp32 matmul decision to say which GEMMs run as tf32x3, and why."""
        split = [g for g in groups if g.kind == "gemm" and g.params.get("precision") == "tf32x3"]
        if split:  # the decision says which fp32 matmuls are not SGEMM, and why
            gemms = sum(g.kind == "gemm" for g in groups)
            at = next(i for i, d in enumerate(decisions) if d[0] == "matmuls in true fp32")
            decisions[at] = (f"matmuls at fp32 accuracy: {len(split)} of {gemms} as 3xTF32 (tf32x3), the rest SGEMM",
                             "operands split into a TF32 part and its remainder, three tensor-core products (fp32's "
                             "accuracy, held to fp32's tolerance by every check) where the GPU's peaks say it is faster "
                             "than SGEMM (" + "; ".join(f"{g.name}: {g.params['split_why']}" for g in split[:3]) +
                             ("; ..." if len(split) > 3 else "") + "); split_tf32=False keeps SGEMM for all")

    @staticmethod
    def _relaid_out_copies(groups: list[Group], outputs: set[str]) -> list[Group]:
        """An elementwise chain whose one result only other elementwise groups read, each through views
        that relabel it to its shape (an einsum's permute and contiguous clone before its bmm; a
        transposed sum), is computed in each reader's kernel, in the reader's layout: its inputs' strides
        are taken through the same views, so the result is never written in its own layout and read back.
        Several readers each compute the chain where that moves no more bytes than storing it: its inputs
        read once per reader, against the result written once and read by each."""
        if not settings().relayout:
            return groups
        producer: dict[str, Group] = {}
        for g in groups:
            if g.kind == "pointwise":
                for n in g.nodes:
                    for v in n.outputs:
                        if v is not None:
                            producer[v.name] = g

        def copy_chain(c: Group) -> tuple[Value, list[Node]] | None:
            """The source value and the views from it to the elementwise group `c` that reads their result
            (of c's shape, only there): a contiguous clone (einsum's bmm operand), or any elementwise op."""
            if c.kind != "pointwise" or "relayout" in c.params or _reads_pieces(c):
                return None
            inside = {id(n) for n in c.nodes}
            for read in c.inputs():
                if read.producer is None or read.producer.op not in RELAYOUT_VIEWS or read.name in outputs \
                        or tuple(read.shape) != tuple(c.params["shape"]) or any(id(u) not in inside for u in read.users):
                    continue
                x, chain = read, []
                while isinstance(x, Value) and x.producer is not None and x.producer.op in RELAYOUT_VIEWS \
                        and len(x.users) == 1 and x.name not in outputs:
                    chain.insert(0, x.producer)
                    x = x.producer.args[0]
                if chain and isinstance(x, Value):
                    return x, chain
            return None

        readers: dict[str, list[tuple[Group, list[Node]]]] = {}
        for c in groups:
            found = copy_chain(c)
            if found is not None:
                readers.setdefault(found[0].name, []).append((c, found[1]))
        gone: set[int] = set()
        for name, copies in readers.items():
            g = producer.get(name)
            if g is None or id(g) in gone or any(c is g for c, _ in copies):
                continue
            y = next(v for n in g.nodes for v in n.outputs if v is not None and v.name == name)
            if y.name in outputs or len(y.users) != len(copies) or [v.name for v in g.outputs(outputs)] != [y.name] \
                    or "relayout" in g.params or tuple(g.params["shape"]) != tuple(y.shape) or _reads_pieces(g) \
                    or any(rotate_half_source(n) is not None or n.op == "aten::_native_batch_norm_legit_no_training"
                           for n in g.nodes):
                continue
            shape = tuple(y.shape)
            if any(relayout_strides(shape, broadcast_strides(tuple(v.shape), tuple(v.strides), shape), chain) is None
                   for c, chain in copies for v in g.inputs()):
                continue
            # Bytes moved: each reader reading the chain's inputs, against writing the result once and each
            # reader reading it (several readers of a chain over several large inputs: better stored).
            read = sum(v.numel * v.dtype.itemsize for v in g.inputs())
            if len(copies) * read > read + (1 + len(copies)) * y.numel * y.dtype.itemsize:
                continue
            internal = {v.name for n in g.nodes for v in n.outputs if v is not None}
            for c, chain in copies:
                internal_c = internal | {n.out.name for n in chain}
                ops = ", ".join(n.op.removeprefix("aten::") for n in g.nodes)
                c.nodes = [*g.nodes, *chain, *c.nodes]
                c.params["relayout"] = {"shape": shape, "computed": len(g.nodes), "chain": chain,
                                        "internal": internal_c}
                theirs = ", ".join(n.op.removeprefix("aten::") for n in c.nodes[len(g.nodes) + len(chain):])
                c.reason = (f"{len(g.nodes)} elementwise op(s) ({ops}) computed in the layout of the group that "
                            f"reads their result through {len(chain)} view(s), fused with it ({theirs}) into one "
                            "kernel")
            gone.add(id(g))
            viewed = {id(n) for _, chain in copies for n in chain}  # their view groups go too
            gone.update(id(v) for v in groups if v.kind == "view" and any(id(n) in viewed for n in v.nodes))
        return [g for g in groups if id(g) not in gone]

    @staticmethod
    def _row_epilogues(groups: list[Group], outputs: set[str]) -> list[Group]:
        """Folds `statistic -> [elementwise on the statistic] -> elementwise over the row` into the
        reduction (an RMS norm: mean of squares, then rsqrt(m + eps), then x * that * weight): the kernel
        that computes the row's statistic applies it to the row, and the statistic is never stored."""
        out: list[Group] = []
        i = 0
        while i < len(groups):
            g = groups[i]
            fused = None
            if g.kind == "reduction" and g.params["kind"] in ("sum", "mean", "amax", "amin") \
                    and g.params.get("layout") != "column":
                node = g.params["node"]
                stat, row_shape = node.out, node.args[0].shape
                nxt = groups[i + 1:i + 3]
                on_stat = nxt[0] if nxt and nxt[0].kind == "pointwise" and nxt[0].params["shape"] == stat.shape \
                    and nxt[0].params["shape"] != row_shape and not _reads_pieces(nxt[0]) else None
                over_row = nxt[1 if on_stat else 0] if len(nxt) > (1 if on_stat else 0) else None
                # A split row (few rows, very long) keeps its two passes: a block per row would idle the GPU.
                if over_row is not None and over_row.kind == "pointwise" and over_row.params["shape"] == row_shape \
                        and "split" not in g.params and not _reads_pieces(over_row):
                    epilogue = [*(on_stat.nodes if on_stat else []), *over_row.nodes]
                    inside = {id(n) for n in epilogue}
                    leaving = over_row.outputs(outputs)
                    ok = stat.name not in outputs and stat.users and all(id(u) in inside for u in stat.users) \
                        and len(leaving) == 1 and leaving[0].dtype in (torch.float32, torch.float16, torch.bfloat16)
                    if ok and on_stat is not None:
                        # The statistic's own ops read only it, and only the row's ops read them.
                        ok = [v.name for v in on_stat.inputs()] == [stat.name] and all(
                            v.name not in outputs and all(id(u) in inside for u in v.users)
                            for n in on_stat.nodes for v in n.outputs if v is not None)
                    if ok:
                        ops = ", ".join(n.op.removeprefix("aten::") for n in epilogue)
                        fused = Group("reduction", [*g.nodes, *epilogue],
                                      f"{g.reason}; then {len(epilogue)} elementwise op(s) ({ops}) applying it to "
                                      "the row in the same kernel: the statistic is never stored",
                                      {**g.params, "epilogue": epilogue, "result": leaving[0]})
                        i += 2 + (1 if on_stat else 0)
                        _row_producer_into_loads(out, fused, outputs)
                if fused is None and on_stat is not None:
                    fused = _output_function(g, on_stat, outputs)
                    i += 2 if fused is not None else 0
            elif ((g.kind == "reduction" and g.params["kind"] in NORMALIZING) or g.kind in ("conv", "pool", "scan")) \
                    and i + 1 < len(groups):
                fused = _output_function(g, groups[i + 1], outputs)
                i += 2 if fused is not None else 0
            if fused is None:
                out.append(g)
                i += 1
            else:
                out.append(fused)
        return out

    SINK_WINDOW = 16  # groups looked back over: a SwiGLU's chain is 2-3 back; bounds the planner at O(n)

    @classmethod
    def _sinkable(cls, groups: list[Group], node: Node, also_unread_by: Group | None = None) -> int | None:
        """The index of an earlier pointwise group of `node`'s shape, among the last SINK_WINDOW, that
        produces one of its inputs and whose results no group after it reads (nor `also_unread_by`) —
        delaying it to `node` changes no value anyone reads."""
        wanted = {v.name for v in node.inputs}
        later = [also_unread_by] if also_unread_by is not None else []
        for i in range(len(groups) - 1, max(-1, len(groups) - 1 - cls.SINK_WINDOW), -1):
            g = groups[i]
            if g.kind != "pointwise" or g.params["shape"] != node.out.shape:
                continue
            made = {v.name for n in g.nodes for v in n.outputs if v is not None}
            if not made & wanted:
                continue
            if any(v.name in made for h in [*groups[i + 1:], *later] for v in h.inputs()):
                return None
            return i
        return None

    @staticmethod
    def _normalized_inputs(groups: list[Group], outputs: set[str]) -> list[Group]:
        """Softmax / log-softmax rows whose every reader computes one value per row from them — a sum, mean,
        amax or amin over each row or over the whole tensor, whose fused elementwise loads read them (a KL
        divergence of two log-softmaxes), or a gather of one column per row (a cross entropy's picked
        log-probability) — join their readers in one group: its kernel reads each logits row once into
        registers, normalizes it there and computes every reader's result; the normalized rows are never
        stored and read back. The group takes the place of the first reader, so every other input of
        the readers must exist by then."""
        owner = {id(n): g for g in groups for n in g.nodes}
        place = {id(g): i for i, g in enumerate(groups)}
        made_at = {v.name: i for i, g in enumerate(groups) for n in g.nodes for v in n.outputs if v is not None}
        fused: dict[int, Group] = {}  # the first reader's place -> the group replacing it
        gone: set[int] = set()
        for g in groups:
            if id(g) in gone or not _normalizer(g, outputs):
                continue
            rows, cols = g.params["rows"], g.params["cols"]
            found = _row_readers(g, owner, gone, outputs)
            if found is None:
                continue
            norms, readers, kinds = found
            if not readers or cols * len(norms) > CACHED_ROW_MAX:
                continue
            ys = {m.params["node"].out.name for m in norms}
            first = min(place[id(c)] for c in readers)
            if any(v.name not in ys and made_at.get(v.name, -1) >= first for c in readers for v in _external(c)):
                continue  # a reader needs a value made after the first reader: the readers cannot move there
            for m in [*norms, *readers]:
                gone.add(id(m))
            fused[first] = _normalized_group(norms, readers, kinds, rows, cols)
        return [fused.get(i, g) for i, g in enumerate(groups) if i in fused or id(g) not in gone]

    @staticmethod
    def _online_sum_exp(groups: list[Group], outputs: set[str]) -> list[Group]:
        """`m = amax(x)` then `sum(exp(x - m))` over the same rows (a log-sum-exp or a softmax's
        denominator written by hand) read x twice; the online max-and-sum reads it once. Merged when m has
        the row statistic's keepdim shape and nothing but the subtraction and the sum's output ops read it.
        The one difference: a row of only -inf sums to 0 (a log-sum-exp of -inf, torch.logsumexp's answer)
        where the two-pass form computes exp(-inf - -inf) = NaN."""
        out: list[Group] = []
        for g in groups:
            prev = out[-1] if out else None
            p = g.params
            if g.kind == "reduction" and p.get("kind") == "sum" and prev is not None and prev.kind == "reduction" \
                    and prev.params.get("kind") == "amax" and not prev.params.get("epilogue") \
                    and "split" not in p and "split" not in prev.params \
                    and not prev.params.get("output") and "layout" not in p and "layout" not in prev.params \
                    and not p.get("epilogue") and len(p.get("prologue") or []) == 2 and "kept_input" not in p \
                    and (prev.params["rows"], prev.params["cols"]) == (p["rows"], p["cols"]):
                amax, (sub, exp) = prev.params["node"], p["prologue"]
                x, m = amax.args[0], amax.out
                inside = {id(n) for n in [sub, *(p.get("output") or [])]}
                if sub.op == "aten::sub.Tensor" and sub.kwargs.get("alpha", 1) == 1 and sub.args[0] is x \
                        and sub.args[1] is m and exp.op == "aten::exp" and exp.args[0] is sub.out \
                        and m.name not in outputs and all(id(u) in inside for u in m.users) \
                        and m.shape == (*x.shape[:-1], 1) and p["cols"] == x.shape[-1]:
                    out[-1] = Group("reduction", [*prev.nodes, *g.nodes],
                                    f"{prev.reason}; merged with the sum of exp(x - max) that follows: one online "
                                    "pass keeps the running max and the rescaled sum, the row read once",
                                    {**p, "kind": "sum_exp", "max": m, "node": p["node"], "x": x,
                                     "prologue": prev.params.get("prologue")})
                    continue
            out.append(g)
        return out

    # ---- rules ----

    def _gemm(self, node: Node, outputs: set[str], absorbed: set[int], precision: str) -> Group:
        out = node.out
        if node.op == "aten::addmm":
            bias, a, b = node.args[0], node.args[1], node.args[2]
            beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
            if beta != 1 or alpha != 1:
                return Group("aten", [node], "addmm with alpha/beta other than 1 stays an ATen step")
            if not (isinstance(bias, Value) and bias.shape == (out.shape[-1],) and bias.dtype == out.dtype):
                return Group("aten", [node], f"addmm bias of shape {getattr(bias, 'shape', None)} is not a [N] "
                                             "vector the bias epilogue can add: ATen step")
        else:
            bias, a, b = None, node.args[0], node.args[1]
        if out.dtype not in (torch.float32, torch.float16, torch.bfloat16) or a.dtype != out.dtype or b.dtype != out.dtype:
            return Group("aten", [node], f"{out.dtype} matmul stays an ATen step")
        params = {"a": a, "b": b, "bias": bias, "transpose_a": False, "transpose_b": False, "precision": precision}
        notes = []
        if node.op == "aten::bmm":
            # One matrix expanded over the batch (a linear layer on a 3-D input that matmul turned into a bmm:
            # the weight expanded to [B, K, N]) is read once per product, broadcast, never materialized.
            for key in ("b", "a"):
                source = _broadcast_matrix(params[key])
                if source is not None:
                    params[key] = source
                    notes.append(f"{key} one matrix broadcast over the batch")
        _transposed_in_place(node, params, notes)
        nodes = [node]
        epilogue = "bias" if bias is not None else "none"
        users = out.users
        if len(users) == 1 and out.name not in outputs:
            u = users[0]
            act = None
            if u.op == "aten::relu":
                act = "relu"
            elif u.op == "aten::gelu" and (u.kwargs.get("approximate") == "tanh" or
                                          (len(u.args) > 1 and u.args[1] == "tanh")):
                act = "gelu"
            if act is not None and u.out.dtype == out.dtype:
                epilogue = f"bias_{act}" if bias is not None else act
                nodes.append(u)
                absorbed.add(id(u))
                notes.append(f"{u.op.removeprefix('aten::')} fused into the cuBLASLt epilogue")
        params["epilogue"] = epilogue
        params["result"] = nodes[-1].out
        self._gemm_precision(node, params, notes, precision)
        reason = "cuBLASLt matmul" + (f" with the {epilogue} epilogue" if epilogue != "none" else "")
        if notes:
            reason += " (" + "; ".join(notes) + ")"
        return Group("gemm", nodes, reason, params)

    def _gemm_precision(self, node: Node, params: dict, notes: list[str], precision: str) -> None:
        """The GEMM's precision in `params` (fp32_or_split: SGEMM or tf32x3 by split_tf32_choice; bf16:
        bf16 products where K is long enough, else TF32), with a note on the choice."""
        out = node.out
        if precision == "fp32_or_split":
            params["precision"] = "fp32"
            if out.dtype == torch.float32:
                a_, b_ = params["a"], params["b"]
                k = a_.shape[-2] if params["transpose_a"] else a_.shape[-1]
                m, n = out.shape[-2], out.shape[-1]
                batch = out.shape[0] if node.op == "aten::bmm" else 1
                split, why = split_tf32_choice(m, n, k, batch, a_.numel, b_.numel, self.peaks,
                                               transpose_a=bool(params["transpose_a"]),
                                               transpose_b=bool(params["transpose_b"]))
                if split:
                    params["precision"], params["split_why"] = "tf32x3", why
                    notes.append(f"3xTF32 on split operands, {why}")
        if precision == "bf16" and out.dtype == torch.float32:
            k = params["a"].shape[-2] if params["transpose_a"] else params["a"].shape[-1]
            if bf16_products(k):
                notes.append("bf16 products: operands converted to bf16, fp32 accumulation")
            else:
                params["precision"] = "tf32"  # what cuBLASLt's FAST_16BF computes on fp32 operands anyway
                notes.append(f"TF32 products (K={k}: converting the operands to bf16 would not pay)")

    @staticmethod
    def _reduction(node: Node, outputs: set[str]) -> Group:
        kind = _REDUCTION_OPS[node.op]
        x = node.args[0]
        if not isinstance(x, Value) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return Group("aten", [node], f"{kind} of {getattr(x, 'dtype', '?')} stays an ATen step")
        rank = len(x.shape)
        if kind in ("argmax", "argmin"):  # the first index of the extreme: over a middle dim (a class map)
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            if dim is None or dim % rank == rank - 1:
                where = "every element" if dim is None else "the last dim"
                return Group("aten", [node], f"{kind} over {where} stays an ATen step")
            return OfflinePlanner._column(node, kind, x, [dim % rank])
        if kind in ("softmax", "log_softmax"):
            if node.args[2]:
                return Group("aten", [node], f"{kind} with half_to_float stays an ATen step")
            dims = _dims(node.args[1], rank)
        elif kind in ("layer_norm", "group_norm"):
            if any(v is not None and (v.name in outputs or v.users) for v in node.outputs[1:]):
                return Group("aten", [node], f"{kind.replace('_', ' ')} whose mean/rstd are used stays an ATen step")
            if kind == "layer_norm":
                dims = list(range(rank - len(node.args[1]), rank))
            else:  # (input, weight, bias, N, C, HxW, group, eps): rows are (sample, group) pairs
                channels, groups = int(node.args[4]), int(node.args[6])
                if rank < 2 or groups <= 0 or channels % groups or x.shape[1] != channels:
                    return Group("aten", [node], "group norm of this layout stays an ATen step")
                dims = list(range(1, rank))
        else:
            dims = _dims(node.args[1] if len(node.args) > 1 else None, rank)
            if node.kwargs.get("dtype") is not None:
                return Group("aten", [node], f"{kind} with a dtype argument stays an ATen step")
        if dims != list(range(rank - len(dims), rank)):
            if kind in ("sum", "mean", "amax", "amin") and dims and dims == list(range(dims[0], dims[-1] + 1)):
                return OfflinePlanner._column(node, kind, x, dims)
            return Group("aten", [node], f"{kind} over dims {dims} (neither trailing nor one block of dims) stays "
                                         "an ATen step")
        cols = 1
        for d in dims:
            cols *= x.shape[d]
        if kind == "group_norm":
            cols //= int(node.args[6])
        rows = x.numel // cols if cols else 0
        if rows == 0 or cols == 0:
            return Group("aten", [node], f"{kind} of an empty tensor stays an ATen step")
        params = {"kind": kind, "rows": rows, "cols": cols, "node": node}
        if kind == "layer_norm":
            params["weight"], params["bias"], params["eps"] = node.args[2], node.args[3], float(node.args[4])
        elif kind == "group_norm":
            params["weight"], params["bias"], params["eps"] = node.args[1], node.args[2], float(node.args[7])
            params["groups"], params["group_hw"] = int(node.args[6]), int(node.args[5])
        if any(isinstance(params.get(k), Value) and params[k].dtype != x.dtype for k in ("weight", "bias")):
            return Group("aten", [node], f"{kind} with weights of another dtype stays an ATen step")
        if kind in NORMALIZING and x.dtype == node.out.dtype and x.dtype in (torch.float32, torch.float16, torch.bfloat16) \
                and cols % 4 == 0 and CACHED_ROW_MIN <= cols <= SHARED_ROW_MAX:  # 16-bit rows too (templates/rows.py)
            held = "registers" if cols <= CACHED_ROW_MAX else "shared memory"
            strategy = f"a {'warp' if cols <= 1024 else 'block'} per row, the row held in {held}"
        elif kind in ("softmax", "log_softmax", "layer_norm", "group_norm") and x.dtype == node.out.dtype == torch.float32 \
                and SHARED_ROW_MAX < cols <= CLUSTER_ROW_MAX and cluster_size(cols):
            strategy = (f"a cluster of {cluster_size(cols)} blocks per row, each holding its part of the row in "
                        "shared memory, the statistics combined through distributed shared memory")
        elif kind in STATISTICS and kind != "sum_exp" and (split := split_rows(rows, cols)):
            # A block per row would leave most of the GPU idle (a loss summed over a whole tensor: one row).
            params["split"] = split
            strategy = (f"each row split in {split} chunks of {cols // split} reduced by their own blocks, then "
                        "the chunks' results by a second kernel (two passes, a fixed order)")
        elif cols <= 1024:
            strategy = "a warp per row"
        else:
            strategy = "a block per row"
        return Group("reduction", [node], f"{kind} over {rows} rows of {cols}: template kernel, {strategy}", params)

    @staticmethod
    def _depthwise(node: Node) -> str | None:
        """None when the convolution is one the depthwise template computes, else why not."""
        x, w, bias, stride, padding, dilation, transposed, _, groups = node.args[:9]
        if transposed or not isinstance(x, Value) or not isinstance(w, Value) or len(x.shape) != 4:
            return "not a 2-D, non-transposed convolution"
        c = x.shape[1]
        if groups != c or w.shape[:2] != (c, 1) or node.out.shape[1] != c:
            return "not depthwise (that needs groups = channels and one filter per channel)"
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or w.dtype != x.dtype or \
                node.out.dtype != x.dtype or (isinstance(bias, Value) and bias.dtype != x.dtype):
            return f"{x.dtype} convolution"
        if w.shape[2] * w.shape[3] > DEPTHWISE_MAX_TAPS:
            return f"a {w.shape[2]}x{w.shape[3]} filter (the template unrolls up to {DEPTHWISE_MAX_TAPS} taps)"
        if len(stride) != 2 or len(padding) != 2 or len(dilation) != 2 or x.numel == 0:
            return "unusual stride/padding/dilation"
        return None

    @staticmethod
    def _pool(node: Node, outputs: set[str]) -> Group:
        """A 2-D average or max pooling as a template group, or an ATen group saying why not."""
        kind = _POOL_OPS[node.op]
        what = "average pooling" if kind == "avg" else "max pooling"
        args = {a.name: a.default_value for a in node.target._schema.arguments}
        args.update(zip([a.name for a in node.target._schema.arguments], node.args))
        args.update(node.kwargs)
        x = args["self"]
        if not isinstance(x, Value) or node.outputs[0] is None:
            return Group("aten", [node], f"{what} without a tensor input or result stays an ATen step")
        if any(v is not None and (v.name in outputs or v.users) for v in node.outputs[1:]):
            return Group("aten", [node], f"{what} whose indices are used stays an ATen step (the template computes "
                                         "the values only)")

        def pair(v) -> tuple[int, ...]:  # int[2] arguments: one size stands for both
            v = [int(e) for e in (v if isinstance(v, (list, tuple)) else [v])]
            return tuple(v * 2) if len(v) == 1 else tuple(v)

        kernel = pair(args["kernel_size"])
        stride = pair(args["stride"]) if args["stride"] else kernel
        padding, dilation = pair(args["padding"]), pair(args.get("dilation", 1))
        ceil_mode = bool(args["ceil_mode"])
        why_not = pooling_blocker(kind, tuple(x.shape), kernel, stride, padding, dilation, ceil_mode, x.dtype)
        if why_not is None and node.out.dtype != x.dtype:
            why_not = f"a {node.out.dtype} result of a {x.dtype} input"
        if why_not is not None:
            return Group("aten", [node], f"{what} stays an ATen step: {why_not}")
        params = {"node": node, "pool": kind, "kernel": kernel, "stride": stride, "padding": padding,
                  "dilation": dilation, "ceil_mode": ceil_mode,
                  "count_include_pad": bool(args.get("count_include_pad", True)),
                  "divisor_override": args.get("divisor_override")}
        return Group("pool", [node], f"{what} {kernel[0]}x{kernel[1]} (stride {stride[0]}x{stride[1]}) over "
                                     f"{list(x.shape)}: template kernel, memory-bound: each input read once from "
                                     "memory, several outputs per thread", params)

    @staticmethod
    def _scan(node: Node) -> Group:
        """cumsum / cumprod as a scan template group, or an ATen group saying why not. The template combines
        in ATen's order, which is defined per ATen's dispatch: the innermost dimension in tiles (`aten_tile`),
        any other dimension sequentially; a tensor that is a single row goes to CUB's device-wide scan."""
        kind = _SCAN_OPS[node.op]
        x, out = node.args[0], node.out
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if not isinstance(x, Value) or out is None or not isinstance(dim, int):
            return Group("aten", [node], f"{kind} without a tensor input, result or dimension stays an ATen step")
        if x.dtype in (torch.float16, torch.bfloat16):
            return Group("aten", [node], f"{kind} of {x.dtype} stays an ATen step: ATen rounds each partial result of a "
                                         "16-bit scan to 16 bits, which the fp32 scan template does not reproduce")
        if x.dtype != torch.float32 or out.dtype != torch.float32:
            return Group("aten", [node], f"{kind} of {x.dtype} into {out.dtype} stays an ATen step: the scan template "
                                         "reads and writes fp32")
        shape = tuple(x.shape)
        if not shape or x.numel == 0:
            return Group("aten", [node], f"{kind} of a 0-d or empty tensor stays an ATen step")
        d = dim % len(shape)
        length = shape[d]
        if x.numel == length:
            return Group("aten", [node], f"{kind} of a single row of {length} stays an ATen step: ATen scans it with "
                                         "CUB's device-wide scan, every SM on the one row (at the memory floor), in an "
                                         "order the template does not reproduce")
        if max(x.numel // length, length) > SCAN_EXTENT_MAX:
            return Group("aten", [node], f"{kind} past 32-bit extents stays an ATen step")
        params = {"kind": kind, "node": node, "dim": d}
        if d == len(shape) - 1:
            rows = x.numel // length
            reason = (f"{kind} over {rows} rows of {length}: scan template in ATen's order (tiles of "
                      f"{aten_tile(rows, length)}, a Sklansky network, the running total carried: eager's results bit "
                      "for bit), each tile in registers and warp shuffles, no shared memory or block barrier")
        else:
            columns = x.numel // length
            reason = (f"{kind} along dim {d} of {list(shape)}: scan template, a thread per column ({columns}), "
                      "adding down it in ATen's order, consecutive columns on consecutive lanes")
        return Group("scan", [node], reason, params)

    @staticmethod
    def _conv_reason(node: Node) -> str:
        w = node.args[1]
        return (f"depthwise {w.shape[2]}x{w.shape[3]} convolution over {list(node.args[0].shape)}: direct template "
                "kernel (memory-bound: each input read once from memory)")

    @staticmethod
    def _column(node: Node, kind: str, x: Value, dims: list[int]) -> Group:
        """A reduction over a block of middle dimensions: [outer, reduce, inner] with y = [outer, inner]."""
        outer = reduce = inner = 1
        for d, e in enumerate(x.shape):
            if d < dims[0]:
                outer *= e
            elif d <= dims[-1]:
                reduce *= e
            else:
                inner *= e
        if outer * reduce * inner == 0 or outer > 65535:
            return Group("aten", [node], f"{kind} over dims {dims} of this size stays an ATen step")
        params = {"kind": kind, "layout": "column", "outer": outer, "reduce": reduce, "inner": inner, "node": node,
                  "rows": outer * inner, "cols": reduce}
        return Group("reduction", [node], f"{kind} over the middle extent {reduce} of [{outer}, {reduce}, {inner}]: "
                                          "column template kernel, coalesced columns, 8 warps per block", params)

    @staticmethod
    def _foldable_factory(node: Node) -> bool:
        if node.op not in _FACTORY_OPS or len(node.outputs) != 1 or node.out is None:
            return False
        out = node.out
        return out.numel * torch.empty(0, dtype=out.dtype).element_size() <= _FACTORY_FOLD_BYTES

    @staticmethod
    def _prologue_fits(chain: Group, node: Node, outputs: set[str]) -> bool:
        """Whether the open elementwise chain can be computed inside the reduction's loads: it produces
        the reduction's input, of the reduction's input shape, and nothing else anyone reads."""
        x = node.args[0]
        if not isinstance(x, Value) or x.producer is None or all(n is not x.producer for n in chain.nodes):
            return False
        if chain.params["shape"] != x.shape or x.name in outputs or len(x.users) != 1 or _reads_pieces(chain):
            return False
        leaving = chain.outputs(outputs)
        return len(leaving) == 1 and leaving[0] is x

    @staticmethod
    def _prologue_kept(chain: Group, node: Node, g: Group, outputs: set[str]) -> bool:
        """Whether the open chain can be the row reduction's prologue although later ops read its result,
        the reduction's input, too: the one value it leaves, which the kernel then stores as it loads it
        (rows of a register-row or warp/block kernel: not split, not columns, not a cluster's). For chains
        that touch 16-bit values (a bf16 model, or autocast's bf16 products added to an fp32 residual)
        only, for now: the fp32 suites' plans stay as they were measured until this is timed on them."""
        x = node.args[0]
        p = g.params
        if not any(v is not None and v.dtype in (torch.float16, torch.bfloat16)
                   for n in chain.nodes for v in [*n.inputs, *n.outputs]):
            return False
        if not isinstance(x, Value) or x.producer is None or all(n is not x.producer for n in chain.nodes) \
                or chain.params["shape"] != x.shape or _reads_pieces(chain) \
                or x.dtype not in (torch.float32, torch.float16, torch.bfloat16) \
                or p.get("kind") not in (*NORMALIZING, "sum", "mean", "amax", "amin") or "split" in p \
                or p.get("layout") == "column" or p["cols"] > SHARED_ROW_MAX \
                or any(rotate_half_source(n) is not None for n in chain.nodes):
            return False
        return [v.name for v in chain.outputs(outputs)] == [x.name] and (len(x.users) > 1 or x.name in outputs)

    @staticmethod
    def _cat_blocker(node: Node) -> str | None:
        """None when the elementwise kernel after a concatenation can read its pieces in place (every
        reader an elementwise op over the concatenation's shape: DenseNet's batch norm and ReLU of the
        growing feature map), so the concatenated tensor is never written; else why not."""
        if not settings().cat_in_place:
            return "concatenations read in place are off (STITCHCUDA_CAT_IN_PLACE=0): ATen step"
        pieces = node.args[0] if node.args and isinstance(node.args[0], (list, tuple)) else ()
        out = node.out if node.outputs else None
        if out is None or not pieces or not all(isinstance(v, Value) for v in pieces):
            return "a concatenation without tensor pieces: ATen step"
        # One piece is a copy of it (DenseNet's first layer concatenates its input alone): read in place too.
        if not 1 <= len([v for v in pieces if v.numel]) <= CAT_MAX_PIECES:
            return f"a concatenation of {len(pieces)} pieces stays an ATen step (read in place: 1 to {CAT_MAX_PIECES})"
        if out.dtype not in FUSABLE_DTYPES or any(v.dtype != out.dtype for v in pieces) \
                or any(len(v.shape) != len(out.shape) for v in pieces if v.numel):
            return "a concatenation of mixed dtypes or ranks stays an ATen step"
        readers = out.users
        if not readers or any(u.op not in POINTWISE_OPS or not u.outputs or u.out is None
                              or tuple(u.out.shape) != tuple(out.shape) for u in readers):
            return "a concatenation read by other than elementwise ops of its shape stays an ATen step (copied once)"
        return None

    @staticmethod
    def _pointwise_blocker(node: Node) -> str | None:
        """None when the node can join a fused elementwise kernel, else why not."""
        if rotate_half_source(node) is not None:  # RoPE's rotate_half: the kernel reads x's halves swapped
            return None if node.out.dtype in FUSABLE_DTYPES else f"rotate_half on {node.out.dtype} stays an ATen step"
        if node.op == "aten::cat":
            return OfflinePlanner._cat_blocker(node)
        if node.op not in POINTWISE_OPS:
            return f"{node.op} has no template: ATen step"
        if any(v is None for v in node.outputs[:1]) or not node.outputs:
            return f"{node.op} without a tensor result: ATen step"
        out = node.out
        if node.op == "aten::_native_batch_norm_legit_no_training":
            if len(out.shape) < 2 or any(v is not None and (v.users) for v in node.outputs[1:]):
                return "batch norm whose statistics are used stays an ATen step"
        if node.op == "aten::_to_copy":
            extra = {k: v for k, v in node.kwargs.items() if k not in ("dtype",) and v not in (None, False)}
            if extra:
                return f"_to_copy with {sorted(extra)} stays an ATen step"
        if out.dtype not in FUSABLE_DTYPES or any(v.dtype not in FUSABLE_DTYPES for v in node.inputs):
            return f"{node.op} on {out.dtype} stays an ATen step"
        for v in node.inputs:
            if len(v.shape) > len(out.shape) and node.op != "aten::_native_batch_norm_legit_no_training":
                return f"{node.op} reduces rank: ATen step"
        return None


def _without_unread_groups(groups: list[Group], outputs: set[str]) -> list[Group]:
    """`groups` without those whose results nothing reads, repeated until none is: the mask an attention
    step found causal (`causal=True`, the mask no longer read) and what only it read."""
    while True:
        read = set(outputs)
        for g in groups:
            read.update(v.name for v in (g.params["inputs"] if g.kind == "attention" else g.inputs()))
        kept = [g for g in groups if any(v is not None and v.name in read for n in g.nodes for v in n.outputs)]
        if len(kept) == len(groups):
            return groups
        groups = kept


def _transposed_in_place(node: Node, params: dict, notes: list[str]) -> None:
    """A transposed operand (x @ w.t(); q @ k.transpose(1, 2) in a bmm) is read in place with a transpose
    flag instead of copied: the last two dimensions of a contiguous source swapped, the batch kept."""
    for key, flag in (("b", "transpose_b"), ("a", "transpose_a")):
        v = params[key]
        # Through views that keep the shape (matmul's expand and view of a 3-D operand to the same
        # sizes, as an MLP-Mixer's token projection of a transposed layer norm reaches its bmm).
        while v.producer is not None and v.producer.op in _SAME_SHAPE_VIEWS and \
                isinstance(v.producer.args[0], Value) and tuple(v.producer.args[0].shape) == tuple(v.shape):
            v = v.producer.args[0]
        p = v.producer
        rank = len(v.shape)
        swap = list(range(rank - 2)) + [rank - 1, rank - 2]
        if p is not None and p.op == "aten::permute" and rank in (2, 3) and p.args[0].is_contiguous() \
                and [d % rank for d in p.args[1]] == swap and (rank == 2 or node.op == "aten::bmm"):
            params[key] = p.args[0]
            params[flag] = True
            notes.append(f"{key} transposed in place")


def _normalizer(g: Group, outputs: set[str]) -> bool:
    """A softmax or log-softmax group whose rows the normalized-inputs kernel can hold in registers."""
    q = g.params
    if g.kind != "reduction" or q.get("kind") not in ("softmax", "log_softmax") or q.get("prologue") \
            or q.get("output") or q.get("epilogue"):
        return False
    x, y = q["node"].args[0], q["node"].out
    return x.dtype == y.dtype == torch.float32 and x.is_contiguous() and q["cols"] == x.shape[-1] \
        and q["cols"] % 4 == 0 and CACHED_ROW_MIN <= q["cols"] <= CACHED_ROW_MAX and y.name not in outputs


def _external(g: Group) -> list[Value]:
    """The values `g` reads that it does not make."""
    made = {v.name for n in g.nodes for v in n.outputs if v is not None}
    return [v for n in g.nodes for v in n.inputs if v.name not in made]


def _row_reader(c: Group, y: Value, rows: int, cols: int) -> str | None:
    """How `c` reads the normalized rows `y`: "stat", "gather" or None (not a per-row reader)."""
    q = c.params
    if c.kind == "reduction" and q.get("kind") in ("sum", "mean", "amax", "amin") and not q.get("epilogue") \
            and q.get("layout") != "column" and "kept_input" not in q \
            and ((q["rows"], q["cols"]) == (rows, cols) or (q["rows"], q["cols"]) == (1, rows * cols)):
        x = q["node"].args[0]
        if q.get("prologue"):
            return "stat" if tuple(x.shape) == tuple(y.shape) and any(
                v is y for n in q["prologue"] for v in n.inputs) else None
        return "stat" if x is y else None
    if c.kind == "aten" and len(c.nodes) == 1 and c.nodes[0].op == "aten::gather":
        node = c.nodes[0]
        index = node.args[2] if len(node.args) > 2 else None
        dim = node.args[1]
        if node.args[0] is y and isinstance(dim, int) and dim % len(y.shape) == len(y.shape) - 1 \
                and isinstance(index, Value) and index.dtype == torch.int64 \
                and tuple(index.shape) == (*y.shape[:-1], 1) and not node.kwargs.get("sparse_grad"):
            return "gather"
    return None


def _row_readers(g: Group, owner: dict[int, Group], gone: set[int], outputs: set[str]
                 ) -> tuple[list[Group], list[Group], list[str]] | None:
    """From the normalizer `g`: every normalizer its readers also read (a KL's second log-softmax), the
    readers and how each reads ("stat", "gather"); None when a reader reads the rows otherwise."""
    rows, cols = g.params["rows"], g.params["cols"]
    norms, readers, kinds, todo = [g], [], [], [g]
    while todo:
        n = todo.pop()
        for u in n.params["node"].out.users:
            c = owner.get(id(u))
            if c is not None and any(c is r for r in readers):
                continue
            kind = _row_reader(c, n.params["node"].out, rows, cols) if c is not None else None
            if kind is None or id(c) in gone:  # a reader outside every group is no per-row reader
                return None
            readers.append(c)
            kinds.append(kind)
            for v in _external(c):  # the reader's other normalized inputs join (a KL's second log-softmax)
                src = owner.get(id(v.producer)) if v.producer is not None else None
                if src is not None and _normalizer(src, outputs) and not any(src is m for m in norms) \
                        and src.params["node"].out is v:
                    if (src.params["rows"], src.params["cols"]) != (rows, cols) or id(src) in gone:
                        return None
                    norms.append(src)
                    todo.append(src)
    return norms, readers, kinds


def _normalized_group(norms: list[Group], readers: list[Group], kinds: list[str], rows: int, cols: int) -> Group:
    """The one reduction group of normalizers and their per-row readers, with the reason naming them."""
    described = []
    for c, kind in zip(readers, kinds):
        if kind == "gather":
            described.append("a gather of one column per row")
        else:
            q = c.params
            whole = q["rows"] == 1 and rows != 1
            described.append(f"a {q['kind']}" + (" over the whole tensor" if whole else " per row")
                             + (f" of {len(q['prologue'])} elementwise op(s)" if q.get("prologue") else ""))
    kinds_text = ", ".join(m.params["kind"] for m in norms)
    reason = (f"{kinds_text} over {rows} rows of {cols} and what reads them ({'; '.join(described)}): one kernel "
              "reads each logits row once into registers, normalizes it there and computes every per-row "
              "result; the normalized rows are never stored")
    return Group("reduction", [n for m in norms for n in m.nodes] + [n for c in readers for n in c.nodes],
                 reason, {"kind": "normalized", "rows": rows, "cols": cols,
                          "normalized": [(m.params["node"].out, m.params["node"]) for m in norms],
                          "readers": list(zip(kinds, readers))})


class _Partition:
    """OfflinePlanner.plan's first pass: the graph's nodes, in order, into groups — constants folded to the
    front, GEMMs, convolutions, pooling, reductions and scans (with the elementwise chain computing only their
    input fused into their loads), views, elementwise chains (one open at a time) and ATen steps."""

    def __init__(self, planner: "OfflinePlanner", graph: Graph, outputs: set[str], matmul_precision: str,
                 attention: dict[int, Group] | None = None) -> None:
        self.planner, self.graph, self.outputs, self.matmul_precision = planner, graph, outputs, matmul_precision
        self.attention = attention or {}  # node id -> the attention group that takes it
        self.constant: set[str] = {w.name for w in graph.weights}
        self.list: list[Group] = []
        self.absorbed: set[int] = set()  # nodes a GEMM took into its epilogue
        self.open: Group | None = None  # the elementwise chain later nodes may still join

    def groups(self) -> list[Group]:
        for node in self.graph.nodes:
            if id(node) not in self.absorbed:
                self.add(node)
        return self.list

    def add(self, node: Node) -> None:
        planner, groups = self.planner, self.list
        unheld = unheld_dtype(node)
        attention = self.attention.get(id(node))
        if attention is not None:
            # The step goes where the attention's output is made (every input exists by then); its other
            # nodes make values only it read, so the open chain stays open across them.
            if node is not attention.params["attention"].output.producer:
                return
            groups.append(attention)
        elif unheld is not None:  # before folding: a constant of that dtype could not be stored either
            groups.append(Group("aten", [node], f"ATen fallback: {node.op} works on {unheld} values, which no "
                                                "program buffer holds", {"unheld": unheld}))
        elif self._folded(node):
            return  # the open chain stays open
        elif node.op in _GEMM_OPS:
            groups.append(planner._gemm(node, self.outputs, self.absorbed, self.matmul_precision))
        elif node.op == "aten::convolution":
            why_not = planner._depthwise(node)
            groups.append(Group("conv", [node], planner._conv_reason(node), {"node": node}) if why_not is None
                          else Group("aten", [node], f"convolution through cuDNN: {why_not}"))
        elif node.op in _POOL_OPS:
            groups.append(planner._pool(node, self.outputs))
        elif node.op in _REDUCTION_OPS or node.op in _SCAN_OPS:
            groups.append(self._reduction(node))
        elif node.op in _VIEW_OPS:
            groups.append(Group("view", [node], "a view: no copy where the source's layout allows"))
        else:
            why_not = planner._pointwise_blocker(node)
            if why_not is None:
                self._pointwise(node)
                return  # the chain stays open
            groups.append(Group("aten", [node], why_not))
        self.open = None

    def _folded(self, node: Node) -> bool:
        """Constant folding: a node of which nothing depends on a user input is computed once, before any
        run, from no value of the forward: it goes to the front and the open chain stays open (a causal
        mask's -inf between a scale and the masking, or a weight's transpose between a norm and its output
        ops, no longer splits them)."""
        ins = node.inputs
        if not ((ins and all(v.name in self.constant for v in ins)) or (not ins and self.planner._foldable_factory(node))):
            return False
        for v in node.outputs:
            if v is not None:
                self.constant.add(v.name)
        self.list.insert(0, Group("constant", [node], "depends only on weights: computed once, stored as a constant"))
        return True

    def _reduction(self, node: Node) -> Group:
        planner, chain = self.planner, self.open
        g = planner._reduction(node, self.outputs) if node.op in _REDUCTION_OPS else planner._scan(node)
        if g.kind in ("reduction", "scan") and chain is not None and self.list[-1] is chain and \
                planner._prologue_fits(chain, node, self.outputs):
            # The chain computes only the reduction's input: fuse it into the loads.
            self.list.pop()  # identity, not list.remove: groups compare by value, down to tensors
            ops = ", ".join(n.op.removeprefix("aten::") for n in chain.nodes)
            g.params["prologue"] = list(chain.nodes)
            g.nodes = [*chain.nodes, node]
            g.reason += f", with {len(chain.nodes)} elementwise op(s) ({ops}) fused into its loads"
        elif g.kind == "reduction" and chain is not None and self.list[-1] is chain and \
                planner._prologue_kept(chain, node, g, self.outputs):
            # The chain computes the reduction's input, which later ops read too (a residual sum before a
            # layer norm): fused into the loads all the same, and the kernel stores it as it computes it.
            self.list.pop()
            ops = ", ".join(n.op.removeprefix("aten::") for n in chain.nodes)
            g.params["prologue"] = list(chain.nodes)
            g.params["kept_input"] = node.args[0]
            g.nodes = [*chain.nodes, node]
            g.reason += (f", with {len(chain.nodes)} elementwise op(s) ({ops}) fused into its loads; their result, "
                         "which later ops read too, stored by the same kernel")
        return g

    def _pointwise(self, node: Node) -> None:
        """The open chain is the last unit emitted, so every input already exists: any elementwise node of
        the same shape may join it, a consumer of the chain or an independent branch."""
        planner, groups = self.planner, self.list
        out = node.out
        sunk = None if self.open is not None else planner._sinkable(groups, node)
        rotation = rotate_half_source(node)
        if rotation is not None and self.open is not None and any(rotation[0] in n.outputs for n in self.open.nodes):
            self.open = None  # rotate_half reads x at other elements: x must be in memory, not in the kernel
        if self.open is not None and self.open.params["shape"] == out.shape:
            earlier = planner._sinkable(groups[:-1], node, also_unread_by=self.open)
            if earlier is not None:
                # An earlier chain of this shape that only this node reads (RoPE's q * cos, split from
                # `+ rotate_half(q) * sin` by q's slices): it joins the open chain, computed first.
                self.open.nodes[:0] = groups.pop(earlier).nodes
            self.open.nodes.append(node)
        elif sunk is not None:
            # An earlier chain of this shape that only this node reads (SwiGLU's silu(gate), split from
            # `* up` by the up projection): moved here, it joins the chain and its result never reaches memory.
            self.open = groups.pop(sunk)
            self.open.nodes.append(node)
            groups.append(self.open)
        else:
            self.open = Group("pointwise", [node], "elementwise chain fused into one kernel", {"shape": out.shape})
            groups.append(self.open)
