"""The planner's KV-cache pass (STITCHCUDA_FUSE_CACHE_WRITE): a cache's index_copy_ into a program state becomes a
generated "cache_write" group that also computes its source's elementwise producers (RoPE), the layer's other
write at the same index, and the small int64 bookkeeping (positions, a counter); other small int64 adds become
"integer" groups. Lowered by Lowering._lower_cache_write / _lower_integer with templates/scatter.py."""

from __future__ import annotations

import math

import torch

from .capture import Graph, Node, Value
from .groups import Group
from .templates import FUSABLE_DTYPES
from .templates.scatter import INTEGER_MAX_ELEMENTS, INTEGER_OPS

__all__ = ["fuse_cache_writes", "integer_blocker", "cache_write_blocker"]


def integer_blocker(node: Node) -> str | None:
    """None when `node` is an int64 add/sub of at most INTEGER_MAX_ELEMENTS elements an integer kernel computes
    exactly (its operands int64 tensors of no higher rank, or ints; alpha an int), else why not."""
    if node.op not in INTEGER_OPS or not node.outputs or node.out is None:
        return f"{node.op} is not an int64 add or sub"
    out = node.out
    if out.dtype != torch.int64 or math.prod(out.shape) > INTEGER_MAX_ELEMENTS or math.prod(out.shape) < 1:
        return f"{node.op} on {out.dtype} of {math.prod(out.shape)} elements"
    for a in node.args[:2]:
        if isinstance(a, Value):
            if a.dtype != torch.int64 or len(a.shape) > len(out.shape):
                return f"an operand of {a.dtype} or higher rank"
        elif isinstance(a, bool) or not isinstance(a, int):
            return f"an operand {a!r} that is not an int"
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
    if isinstance(alpha, bool) or not isinstance(alpha, int):
        return f"alpha {alpha!r} is not an int"
    return None


def cache_write_blocker(node: Node, graph: Graph) -> str | None:
    """None when `node`, an index_copy, is a state's in-place update the cache-write kernel takes (the state's
    dtype elementwise kernels hold, the source's dtype and rank the state's, one int64 position per source
    slice along a dimension before the last), else why not."""
    if node.op != "aten::index_copy" or len(node.args) < 4:
        return "not an index_copy"
    if not any(u is node for u in graph.state_updates.values()):
        return "an index_copy that is not a state's in-place update"
    state, dim, index, source = node.args[:4]
    if not all(isinstance(v, Value) for v in (state, index, source)) or not isinstance(dim, int):
        return "an index_copy without tensor operands"
    rank = len(state.shape)
    dim = dim % rank if rank else 0
    if state.dtype not in FUSABLE_DTYPES or state.dtype == torch.bool or source.dtype != state.dtype:
        return f"an index_copy of {source.dtype} into {state.dtype}"
    if len(source.shape) != rank or not dim < rank - 1:
        return "an index_copy along the last dimension or between ranks"
    if index.dtype != torch.int64 or tuple(index.shape) != (source.shape[dim],):
        return "an index that is not int64 with one position per source slice"
    if any(s != t for d, (s, t) in enumerate(zip(source.shape, state.shape)) if d != dim):
        return "a source whose extents differ from the state's"
    return None


def fuse_cache_writes(groups: list[Group], graph: Graph, outputs: set[str],
                      decisions: list[tuple[str, str]] | None = None) -> list[Group]:
    """`groups` with each cache-writing index_copy's ATen step a cache_write group (its source's pointwise
    producer, the index's integer group and the other write at the same index merged in where the order
    allows) and each small int64 add an integer group, adjacent integer groups merged. `decisions` (the plan's)
    gains one entry saying what the pass took, where it took something."""
    before = sum(g.kind not in ("view", "constant") for g in groups)
    out: list[Group] = []
    for g in groups:
        n = g.nodes[0] if g.kind == "aten" and len(g.nodes) == 1 else None
        if n is not None and cache_write_blocker(n, graph) is None:
            out.append(Group("cache_write", [n], "a KV cache's index_copy_ into its state as a generated kernel: "
                             "each source slice stored at its position", {"writes": [n], "pointwise": [], "integer": []}))
        elif n is not None and integer_blocker(n) is None:
            out.append(Group("integer", [n], "int64 add of a few elements (positions, a counter) as a generated "
                             "kernel, exact in 64-bit integers", {"integer": [n]}))
        else:
            out.append(g)
    out = _merge_integers(out, graph)
    for w in [g for g in out if g.kind == "cache_write"]:
        _take_producers(out, w, graph)
    _pair_writes(out, graph)
    for g in out:
        if g.kind == "cache_write":
            g.nodes = [*g.params["integer"], *g.params["pointwise"], *g.params["writes"]]
            if g.params["pointwise"] or g.params["integer"] or len(g.params["writes"]) > 1:
                g.reason += (f"; {len(g.params['writes'])} write(s) at the same index, "
                             f"{len(g.params['pointwise'])} elementwise op(s) computing the source(s) "
                             f"and {len(g.params['integer'])} int64 op(s) in the same launch")
    writes = [g for g in out if g.kind == "cache_write"]
    if decisions is not None and (writes or any(g.kind == "integer" for g in out)):
        after = sum(g.kind not in ("view", "constant") for g in out)
        decisions.append((f"{sum(len(g.params['writes']) for g in writes)} KV cache write(s) in {len(writes)} generated "
                          f"kernel(s), int64 bookkeeping exact in integers: {before} steps become {after}",
                          "STITCHCUDA_FUSE_CACHE_WRITE=1: a cache write also computes its source's elementwise ops "
                          "(RoPE), the other write at its index and its positions, so k goes from the projection "
                          "to the cache in one launch"))
    return out


def _shape_of_chain(g: Group, node: Node) -> bool:
    """Whether every value `node` reads from `g`'s int64 ops has `node`'s shape (a thread computes one element
    of each chain: no value crosses between chains of other shapes)."""
    made = {v.name: v for m in g.params["integer"] for v in m.outputs if v is not None}
    return all(tuple(made[v.name].shape) == tuple(node.out.shape) for v in node.inputs if v.name in made)


def _merge_integers(groups: list[Group], graph: Graph) -> list[Group]:
    """Each integer group joins the earliest earlier integer group its inputs all exist for (and no state it
    reads is updated in between): one launch for the layer's int64 ops."""
    out: list[Group] = []
    for g in groups:
        host = None
        if g.kind == "integer":
            for i in range(len(out) - 1, -1, -1):
                if out[i].kind == "integer" and _hoistable(out, i, g, graph) and \
                        all(_shape_of_chain(out[i], n) for n in g.params["integer"]):
                    host = out[i]
        if host is None:
            out.append(g)
            continue
        host.params["integer"] += g.params["integer"]
        host.nodes = list(host.params["integer"])
        host.reason = f"{len(host.nodes)} int64 adds of a few elements (positions, a counter) in one generated kernel, " \
                      "exact in 64-bit integers"
    return out


def _made_by(groups: list[Group]) -> set[str]:
    return {v.name for g in groups for n in g.nodes for v in n.outputs if v is not None}


def _hoistable(groups: list[Group], i: int, g: Group, graph: Graph) -> bool:
    """Whether `g`'s nodes can run at position `i` (with groups[i]): every value they read exists by then."""
    made = _made_by(groups[: i + 1])
    later = _made_by(groups[i + 1:])
    return all(v.name in made or v.name not in later for n in g.nodes for v in n.inputs)


def _delayable(groups: list[Group], i: int, j: int, graph: Graph) -> bool:
    """Whether groups[i]'s nodes can run at position j > i instead: no group in between reads what they make
    or updates in place a state they read."""
    made = _made_by([groups[i]])
    read = {v.name for n in groups[i].nodes for v in n.inputs}
    updates = {id(n): state for state, n in graph.state_updates.items()}
    return not any(v.name in made for g in groups[i + 1:j] for n in g.nodes for v in n.inputs) and \
        not any(updates.get(id(n)) in read for g in groups[i + 1:j] for n in g.nodes)


def _index_of(groups: list[Group], g: Group) -> int:
    return next(k for k, h in enumerate(groups) if h is g)


def _take_producers(groups: list[Group], w: Group, graph: Graph) -> None:
    """Merges into cache write `w` the pointwise group computing its source (of the source's shape) and the
    integer group computing its index, where nothing between reads what they make."""
    write = w.params["writes"][0]
    index, source = write.args[2], write.args[3]
    for value, kind in ((source, "pointwise"), (index, "integer")):
        if value.producer is None:
            continue
        k = next((k for k, h in enumerate(groups) if h.kind == kind and any(n is value.producer for n in h.nodes)),
                 None)
        if k is None:
            continue
        p = groups[k]
        if kind == "pointwise" and (tuple(p.params.get("shape", ())) != tuple(source.shape)
                                    or p.params.get("relayout") or p.params.get("prologue")
                                    or any(v is not None and tuple(v.shape) != tuple(source.shape)
                                           for n in p.nodes for v in n.outputs)):
            continue  # the kernel computes (and stores) values of the source's shape only
        w_at = _index_of(groups, w)
        if k < w_at and _delayable(groups, k, w_at, graph):
            w.params[kind] = (p.params["integer"] if kind == "integer" else list(p.nodes)) + w.params[kind]
            groups.pop(k)


def _pair_writes(groups: list[Group], graph: Graph) -> None:
    """Two cache writes of one index, dimension and source shape (a layer's k and v) become one launch: the
    earlier one runs at the later one's place where nothing in between reads what it makes."""
    k = 0
    while k < len(groups):
        a = groups[k]
        if a.kind != "cache_write":
            k += 1
            continue
        wa = a.params["writes"][0]
        for j in range(k + 1, len(groups)):
            b = groups[j]
            if b.kind != "cache_write":
                continue
            wb = b.params["writes"][0]
            same = (wa.args[2].name == wb.args[2].name and wa.args[1] % len(wa.args[0].shape)
                    == wb.args[1] % len(wb.args[0].shape) and tuple(wa.args[3].shape) == tuple(wb.args[3].shape))
            if same and _delayable(groups, k, j, graph):
                for key in ("integer", "pointwise", "writes"):
                    b.params[key] = a.params[key] + b.params[key]
                groups.pop(k)
                k -= 1
                break
        k += 1
