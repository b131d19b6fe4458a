"""Moves an index of one dimension (`x.index_select(d, idx)`, `x[:, -1]`, `x[:, a:b]`) above the ops that compute
each position of that dimension on its own, so they run on the kept positions only: a causal LM's prefill that
keeps the last position's logits computes its final norm and LM head on one row per sequence, not one per token.

The rewrite works on the exported FX graph (capture reads it afterwards, and the reference interpreter runs the
same graph). Which ops an index passes, and what stops it, is in docs/graph.md ("An index moved above row-wise
ops"); in short: pointwise ops and casts, matmuls along their rows, softmax and reductions over another
dimension, layer norm over the trailing dimensions, and views that keep the indexed positions apart, each only
where every reader of its result wants the same positions. Anything that mixes positions (SDPA, a cumulative
sum, a convolution over the sequence, a reduction over the indexed dimension) or a value read elsewhere whole
stays as it was and is indexed where the moved ops read it: the index never makes a value be computed twice,
whole for one reader and in part for another.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.fx import Graph, Node

__all__ = ["Hoisted", "hoist_indexing", "indexing_note"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Rows:
    """The positions of one dimension a value is wanted at: dimension `dim`, whose extent is outer x n x inner
    with the index's own axis of n positions in the middle (a view merging [batch, tokens] into one dimension
    of batch x tokens rows keeps the token axis inside it: outer = batch)."""

    dim: int
    outer: int = 1
    inner: int = 1


# What reading an op's arguments raises where they are not as its rule expects: the op is then left alone.
_UNEXPECTED = (AttributeError, IndexError, KeyError, TypeError, ValueError, ZeroDivisionError)

WHOLE = None  # a reader that takes the value whole: a weight, an operand broadcast along the indexed dimension

Reads = list[tuple[Node, "Rows | None"]]


@dataclass
class Hoisted:
    """One index moved: the index node's name, its op, how many ops now run on `kept` of `extent` positions,
    and the matmuls among them (name, rows before, rows after, multiply-adds saved)."""

    index: str
    op: str
    ops: int
    kept: int
    extent: int
    matmuls: list[tuple[str, int, int, int]] = field(default_factory=list)

    @property
    def macs_saved(self) -> int:
        return sum(m[3] for m in self.matmuls)


@dataclass
class _Index:
    """An index node as the rewrite sees it: positions of `dim` of `source` (a tensor of them, or a slice),
    `kept` of `extent`; `drop`: the dimension is removed afterwards (select)."""

    node: Node
    source: Node
    dim: int
    extent: int
    kept: int
    tensor: Node | None = None
    span: slice | None = None
    drop: bool = False


def hoist_indexing(graph: Graph) -> list[Hoisted]:
    """Rewrites `graph` (an exported core-ATen FX graph, each node's meta["val"] a fake tensor) in place so that
    every index along one dimension reads its positions before the row-wise ops that produced them. Returns
    what moved; a graph with no such index, or whose indexes have nothing row-wise above them, is unchanged."""
    done: list[Hoisted] = []
    alive = set(graph.nodes)
    for node in list(graph.nodes):
        try:
            index = _as_index(node) if node in alive else None  # (not one an earlier rewrite erased)
        except _UNEXPECTED:  # arguments no index of ours has (a symbolic position): left as it is
            index = None
        moved = _hoist(graph, index) if index is not None else None
        if moved is not None:
            done.append(moved)
            alive = set(graph.nodes)
    if done:
        graph.lint()
    return done


# ---- the index ops -------------------------------------------------------------------------------------------

def _as_index(node: Node) -> _Index | None:
    if node.op != "call_function" or not isinstance(node.args[0] if node.args else None, Node):
        return None
    source, shape = node.args[0], _shape(node.args[0])
    if source.op != "call_function" or shape is None or _shape(node) is None:
        return None
    if node.target is aten.index_select.default:
        dim, tensor = _dim(node.args[1], len(shape)), node.args[2]
        if not isinstance(tensor, Node) or _shape(tensor) is None or len(_shape(tensor)) > 1:
            return None
        index = _Index(node, source, dim, shape[dim], _shape(node)[dim], tensor=tensor)
    elif node.target is aten.select.int:
        dim = _dim(node.args[1], len(shape))
        at = int(node.args[2]) % shape[dim]
        index = _Index(node, source, dim, shape[dim], 1, span=slice(at, at + 1, 1), drop=True)
    elif node.target is aten.slice.Tensor:
        b = _bound(node)
        dim = _dim(b["dim"], len(shape))
        start, stop, step = slice(b["start"], b["end"], b["step"]).indices(shape[dim])
        index = _Index(node, source, dim, shape[dim], len(range(start, stop, step)), span=slice(start, stop, step))
    else:
        return None
    return index if 0 < index.kept < index.extent else None


# ---- which ops compute positions apart, and what each reads ---------------------------------------------------

def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return tuple(int(e) for e in val.shape) if isinstance(val, torch.Tensor) else None


def _dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _bound(node: Node) -> dict[str, Any]:
    """The node's arguments by name, defaults filled in."""
    found: dict[str, Any] = {}
    for k, arg in enumerate(node.target._schema.arguments):
        if k < len(node.args):
            found[arg.name] = node.args[k]
        elif arg.name in node.kwargs:
            found[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            found[arg.name] = arg.default_value
    return found


def _elementwise(node: Node, rows: Rows, extent: int) -> Reads | None:
    """Every tensor input aligned to the output from the right (broadcasting): indexed where it has the
    output's extent, read whole where it has 1 there or lacks the dimension (at least one is indexed: the
    output's extent comes from them)."""
    reads = _broadcast(node, rows)
    return reads if reads is not None and any(r is not WHOLE for _, r in reads) else None


def _broadcast(node: Node, rows: Rows) -> Reads | None:
    out = _shape(node)
    reads: Reads = []
    for a in node.all_input_nodes:
        s = _shape(a)
        if s is None:
            return None
        k = rows.dim - (len(out) - len(s))
        if k < 0 or s[k] == 1:
            reads.append((a, WHOLE))
        elif s[k] == out[rows.dim]:
            reads.append((a, Rows(k, rows.outer, rows.inner)))
        else:
            return None
    return reads


def _softmax(node: Node, rows: Rows, extent: int) -> Reads | None:
    if _dim(node.args[1], len(_shape(node))) == rows.dim:
        return None
    return _elementwise(node, rows, extent)


def _reduction(node: Node, rows: Rows, extent: int) -> Reads | None:
    b = _bound(node)
    src = _shape(node.args[0])
    dims = b.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims) or src is None:
        return None  # over every dimension
    dims = {_dim(d, len(src)) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    kept = list(range(len(src))) if b.get("keepdim", False) else [k for k in range(len(src)) if k not in dims]
    k = kept[rows.dim]
    return None if k in dims else [(node.args[0], Rows(k, rows.outer, rows.inner))]


def _layer_norm(node: Node, rows: Rows, extent: int) -> Reads | None:
    x, normalized = node.args[0], node.args[1]
    if rows.dim >= len(_shape(x)) - len(normalized):
        return None
    return [(x, rows)] + [(a, WHOLE) for a in node.all_input_nodes if a is not x]


def _matmul(node: Node, rows: Rows, extent: int) -> Reads | None:
    """mm [M, K] x [K, N] and bmm [B, M, K] x [B, K, N]: each output row reads its row of the left operand (and
    column its column of the right); addmm's bias is indexed where it has the rows, else read whole."""
    b = _bound(node)
    left, right = (b["mat1"], b["mat2"]) if node.target is aten.addmm.default else (b["self"], b["mat2"])
    rank = len(_shape(node))
    if rows.dim == rank - 1:  # columns
        reads: Reads = [(left, WHOLE), (right, Rows(len(_shape(right)) - 1, rows.outer, rows.inner))]
    elif rows.dim == rank - 2:
        reads = [(left, Rows(rows.dim, rows.outer, rows.inner)), (right, WHOLE)]
    else:  # bmm's batch
        reads = [(left, rows), (right, rows)]
    if node.target is aten.addmm.default:
        bias, s = b["self"], _shape(b["self"])
        if s is None:
            return None
        k = rows.dim - (2 - len(s))
        reads.append((bias, WHOLE if k < 0 or s[k] == 1 else Rows(k, rows.outer, rows.inner)))
    return reads


def _view(node: Node, rows: Rows, extent: int) -> Reads | None:
    """A view keeps an axis whose positions are contiguous in row-major order within one input dimension: the
    axis strides `stride` elements in the flat order and spans `stride * extent` of them."""
    out, src = _shape(node), _shape(node.args[0])
    stride = rows.inner * math.prod(out[rows.dim + 1:])
    span = stride * extent
    for k in range(len(src)):
        unit = math.prod(src[k + 1:])
        if stride % unit == 0 and (unit * src[k]) % span == 0:
            inner = stride // unit
            return [(node.args[0], Rows(k, src[k] // (extent * inner), inner))]
    return None


def _expand(node: Node, rows: Rows, extent: int) -> Reads | None:
    return _broadcast(node, rows)  # a broadcast dimension gets its kept extent from the size argument


def _moved(k: int) -> Callable[[Node, Rows, int], Reads | None]:
    """A view whose output dimension d is input dimension `k(node, d)` (None: not a dimension of the input)."""
    def reads(node: Node, rows: Rows, extent: int) -> Reads | None:
        d = k(node, rows.dim)
        return None if d is None else [(node.args[0], Rows(d, rows.outer, rows.inner))]
    return reads


def _permuted(node: Node, d: int) -> int:
    return _dim(node.args[1][d], len(node.args[1]))


def _transposed(node: Node, d: int) -> int:
    rank = len(_shape(node))
    a, b = _dim(node.args[1], rank), _dim(node.args[2], rank)
    return b if d == a else a if d == b else d


def _unsqueezed(node: Node, d: int) -> int | None:
    at = _dim(node.args[1], len(_shape(node)))
    return None if d == at else d if d < at else d - 1


def _squeezed(node: Node, d: int) -> int | None:
    src, listed = _shape(node.args[0]), node.args[1]
    listed = {_dim(k, len(src)) for k in (listed if isinstance(listed, (list, tuple)) else [listed])}
    kept = [k for k in range(len(src)) if not (k in listed and src[k] == 1)]
    # a listed dimension whose extent the index brings to 1 would be squeezed away too
    return None if kept[d] in listed else kept[d]


def _sliced(node: Node, d: int) -> int | None:
    return None if _dim(node.args[1], len(_shape(node))) == d else d


def _selected(node: Node, d: int) -> int:
    at = _dim(node.args[1], len(_shape(node.args[0])))
    return d if d < at else d + 1


def _cat(node: Node, rows: Rows, extent: int) -> Reads | None:
    tensors = node.args[0]
    rank = len(_shape(node))
    if _dim(node.args[1] if len(node.args) > 1 else 0, rank) == rows.dim or \
            any(len(_shape(t) or ()) != rank for t in tensors):
        return None
    return [(t, rows) for t in tensors]


def _embedding(node: Node, rows: Rows, extent: int) -> Reads | None:
    weight, indices = node.args[0], node.args[1]
    if rows.dim >= len(_shape(indices)):
        return None
    return [(weight, WHOLE), (indices, rows)]


def _getitem(node: Node, rows: Rows, extent: int) -> Reads | None:
    return [(node.args[0], rows)]


_VIEWS: dict[Any, Callable] = {
    aten.view.default: _view, aten._unsafe_view.default: _view, aten.reshape.default: _view,
    aten.expand.default: _expand, aten.alias.default: _elementwise,
    aten.permute.default: _moved(_permuted), aten.transpose.int: _moved(_transposed),
    aten.t.default: _moved(lambda node, d: 1 - d if len(_shape(node)) == 2 else d),
    aten.unsqueeze.default: _moved(_unsqueezed), aten.squeeze.dim: _moved(_squeezed),
    aten.squeeze.dims: _moved(_squeezed),
    aten.slice.Tensor: _moved(_sliced), aten.select.int: _moved(_selected),
    operator.getitem: _getitem,
}
_ROWWISE: dict[Any, Callable] = {
    **_VIEWS,
    aten._to_copy.default: _elementwise, aten.clone.default: _elementwise,
    aten._softmax.default: _softmax, aten._log_softmax.default: _softmax,
    aten.native_layer_norm.default: _layer_norm,
    aten.mm.default: _matmul, aten.addmm.default: _matmul, aten.bmm.default: _matmul,
    aten.cat.default: _cat, aten.embedding.default: _embedding,
    **{op: _reduction for op in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
                                 aten.argmax.default, aten.argmin.default, aten.any.dim, aten.any.dims,
                                 aten.prod.dim_int, aten.var.correction, aten.max.dim, aten.min.dim,
                                 aten.logsumexp.default)},
}


def _rule(node: Node) -> Callable | None:
    if node.op != "call_function":
        return None
    rule = _ROWWISE.get(node.target)
    if rule is None and isinstance(node.target, torch._ops.OpOverload):
        tags = node.target.tags
        if torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags:
            rule = _elementwise
    return rule


def _ignorable(user: Node) -> bool:
    """A reader that holds nothing: a check with no result (_assert_tensor_metadata), an unused getitem."""
    if user.op != "call_function":
        return False
    if user.target is operator.getitem:
        return not user.users
    return isinstance(user.target, torch._ops.OpOverload) and not user.target._schema.returns


# ---- the region the index moves above --------------------------------------------------------------------------

def _region(index: _Index) -> tuple[dict[Node, Rows], dict[Node, Reads], dict[tuple[Node, Rows], None]]:
    """The nodes recomputed on the kept positions (each with the positions wanted of it), what each reads, and
    the values indexed where the region reads them (boundaries). A node joins when every reader is the index
    or a node of the region, all want the same positions of it, and it computes them apart; a value read
    whole anywhere else stays whole (the index moves only along its own branch: no work is done twice)."""
    order = {n: k for k, n in enumerate(index.node.graph.nodes)}
    region: dict[Node, Rows] = {}
    reads: dict[Node, Reads] = {index.node: [(index.source, Rows(index.dim))] +
                                ([(index.tensor, WHOLE)] if index.tensor is not None else [])}
    bounds: dict[tuple[Node, Rows], None] = {}
    pending = {index.source}
    while pending:
        node = max(pending, key=order.__getitem__)  # every reader is decided before the value it reads
        pending.discard(node)
        wanted: set[Rows | None] = set()
        outside = False
        for user in node.users:
            if user in reads:
                wanted |= {rows for a, rows in reads[user] if a is node}
            elif not _ignorable(user):
                outside = True
        if wanted == {WHOLE}:
            continue
        rows = next(iter(wanted)) if len(wanted) == 1 else None
        rule = _rule(node)
        found = rule(node, rows, index.extent) if rule and rows and not outside else None
        if found is not None and _consistent(found):
            region[node] = rows
            reads[node] = found
            pending |= {a for a, r in found if r is not WHOLE}
            continue
        for r in wanted - {WHOLE}:
            bounds[(node, r)] = None
        if isinstance(node.meta.get("val"), (list, tuple)):
            for user in node.users:  # a getitem of it is indexed instead: a tuple is no tensor to index
                if user in region:
                    bounds[(user, region.pop(user))] = None
                    reads.pop(user)
            for key in [k for k in bounds if k[0] is node]:
                del bounds[key]
    reads.pop(index.node)
    return region, reads, bounds


def _consistent(found: Reads) -> bool:
    """One node read two ways (whole at one argument, indexed at another) has no single replacement."""
    seen: dict[Node, Rows | None] = {}
    for a, rows in found:
        if seen.setdefault(a, rows) != rows:
            return False
    return True


# ---- the rewrite -----------------------------------------------------------------------------------------------

def _hoist(graph: Graph, index: _Index) -> Hoisted | None:
    try:
        region, reads, bounds = _region(index)
    except _UNEXPECTED:  # arguments no rule expects: left as it is
        return None
    if not any(n.target not in _VIEWS for n in region):
        return None  # only views above the index: nothing computes fewer positions
    mode = torch._guards.detect_fake_mode([index.node.meta.get("val")])
    if mode is None:
        return None
    made: list[Node] = []
    try:
        result, new = _rebuild(graph, index, region, reads, bounds, mode, made)
        got, wanted = result.meta["val"], index.node.meta["val"]
        if got.shape != wanted.shape or got.dtype != wanted.dtype:
            raise ValueError(f"the moved index gives {tuple(got.shape)}, not {tuple(wanted.shape)}")
        graph.lint()  # every new node after what it reads
    except Exception:  # a view the fewer positions cannot take (a slice merged into rows): the graph as it was
        for node in reversed(made):
            graph.erase_node(node)
        return None
    # The index node becomes the last new node (its name is the exported program's name for the output).
    op = str(index.node.target).replace("aten.", "aten::").removesuffix(".default")
    ordered = sorted(region, key=list(graph.nodes).index)
    moved = Hoisted(index.node.name, op, len(region), index.kept, index.extent, _matmuls(ordered, region, new, index))
    index.node.target, index.node.args, index.node.kwargs = result.target, result.args, result.kwargs
    index.node.meta["val"] = result.meta["val"]
    graph.erase_node(result)
    for node in reversed(ordered):
        for user in [u for u in node.users if _ignorable(u)]:
            graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)
    return moved


def _rebuild(graph: Graph, index: _Index, region: dict[Node, Rows], reads: dict[Node, Reads],
             bounds: dict[tuple[Node, Rows], None], mode: Any, made: list[Node]) -> tuple[Node, dict[Node, Node]]:
    """The region's nodes again on the kept positions, each placed just before the node it repeats (or, when it
    comes first, just after an index tensor the forward computes) and each boundary's index just after the
    value, so values live no longer than before. Returns the index's value and each region node's repetition."""
    order = list(graph.nodes)
    placeholders = [n for n in order if n.op == "placeholder"]
    new: dict[Node, Node] = {}
    cut: dict[tuple[Node, Rows], Node] = {}
    taken = {n.name for n in order}

    def add(before: Node | None, after: Node | None, target: Any, args: tuple, kwargs: dict, like: Node) -> Node:
        with graph.inserting_before(before) if before is not None else graph.inserting_after(after):
            node = graph.create_node("call_function", target, args, kwargs, name=_fresh(like.name, taken))
        made.append(node)
        node.meta = {k: v for k, v in like.meta.items() if k != "val"}
        fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        with mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    for (value, rows) in bounds:
        # after the value and the index tensor (after every placeholder: graph inputs come first)
        after = max([value] + ([placeholders[-1]] if value.op == "placeholder" else []) +
                    ([index.tensor] if index.tensor is not None else []), key=order.index)
        cut[(value, rows)] = _take(add, after, value, rows, index)

    # A region node before a computed index tensor (a constant's clone) is repeated just after that tensor.
    late = order[order.index(index.tensor) + 1] if index.tensor is not None else None
    for node in sorted(region, key=order.index):
        rows = region[node]
        how = dict(reads[node])

        def replace(a: Node) -> Node:
            if a in new:
                return new[a]
            return a if how.get(a) is WHOLE else cut[(a, how[a])]

        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), replace)
        args = _resized(node, rows, index, args)
        before = late if late is not None and order.index(node) < order.index(late) else node
        new[node] = add(before, None, node.target, args, kwargs, node)
    result = new[index.source]
    if index.drop:
        result = add(index.node, None, aten.squeeze.dims, (result, [index.dim]), {}, index.node)
    return result, new


def _fresh(base: str, taken: set[str]) -> str:
    """A node name not in `taken` (then in it) after the node it repeats: mm_14 -> mm_14_1. (The graph's own
    namespace does not know every name export gave: a placeholder's.)"""
    k = 1
    while f"{base}_{k}" in taken:
        k += 1
    taken.add(f"{base}_{k}")
    return f"{base}_{k}"


def _take(add: Callable, after: Node, value: Node, rows: Rows, index: _Index) -> Node:
    """`value` at the kept positions of `rows`: the axis split out of its dimension where it shares it (outer x
    extent x inner), indexed, merged back. A slice of several positions is made contiguous: the views after it
    (a [batch, tokens] merge before a matmul) could not read its gaps."""
    shape, k = list(_shape(value)), rows.dim
    shared = rows.outer != 1 or rows.inner != 1
    piece, dim = value, k
    if shared:
        piece = add(None, after, aten.view.default, (piece, shape[:k] + [rows.outer, index.extent, rows.inner] +
                                                     shape[k + 1:]), {}, value)
        dim = k + 1
    if index.tensor is not None:
        piece = add(None, piece if shared else after, aten.index_select.default, (piece, dim, index.tensor), {}, value)
    else:
        span = index.span
        piece = add(None, piece if shared else after, aten.slice.Tensor, (piece, dim, span.start, span.stop, span.step),
                    {}, value)
        if index.kept > 1:
            piece = add(None, piece, aten.clone.default, (piece,), {"memory_format": torch.contiguous_format}, value)
    if shared:
        piece = add(None, piece, aten.view.default,
                    (piece, shape[:k] + [rows.outer * index.kept * rows.inner] + shape[k + 1:]), {}, value)
    return piece


def _resized(node: Node, rows: Rows, index: _Index, args: tuple) -> tuple:
    """A view's or expand's size argument with the indexed dimension at its kept extent."""
    if node.target not in (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default):
        return args
    sizes = list(args[1])
    if node.target is not aten.expand.default or sizes[rows.dim] != -1:
        sizes = list(_shape(node)) if node.target is not aten.expand.default else sizes
        sizes[rows.dim] = rows.outer * index.kept * rows.inner
    return (args[0], sizes, *args[2:])


def _matmuls(ordered: list[Node], region: dict[Node, Rows], new: dict[Node, Node],
             index: _Index) -> list[tuple[str, int, int, int]]:
    """(the new matmul's name, rows before, rows after, multiply-adds saved) for each matmul moved."""
    found = []
    for node in ordered:
        rows = region[node]
        if node.target in (aten.mm.default, aten.addmm.default, aten.bmm.default):
            out = _shape(node)
            k = _shape(node.args[1] if node.target is aten.addmm.default else node.args[0])[-1]
            before = out[rows.dim]
            after = rows.outer * index.kept * rows.inner
            found.append((new[node].name, before, after, (before - after) * math.prod(out) // before * k))
    return found


def indexing_note(moved: list[Hoisted]) -> tuple[str, str]:
    """The capture's note (decision, reason) on what hoist_indexing moved."""
    parts = []
    for h in moved:
        gemms = "".join(f", {name} on {after} of {before} rows" for name, before, after, _ in h.matmuls)
        parts.append(f"{h.index} ({h.op}, {h.kept} of {h.extent} positions) above {h.ops} op(s){gemms}")
    saved = sum(h.macs_saved for h in moved)
    return ("index moved above the row-wise ops that produced its positions: " + "; ".join(parts) +
            (f" ({saved:,} multiply-adds fewer per call)" if saved else ""),
            "those ops compute each position apart, so computing only the kept positions gives the same values; "
            "a causal LM's prefill that keeps its last position runs its final norm and LM head on one row per "
            "sequence instead of every prompt token")
