"""The planner's rule for decode-shaped projections (STITCHCUDA_GEMV): GEMM groups of x with at most 16 rows times
nn.Linear weights that share x (a transformer's q, k and v; an MLP's gate and up, with the SiLU(gate) * up reading
both) become one "gemv" group, which Lowering._lower_gemv runs as one templates/gemv.py kernel."""

from __future__ import annotations

from .capture import Node, Value
from .groups import Group
from .templates.gemv import FLOAT_DTYPES, GEMV_MAX_ROWS, GEMV_MAX_WEIGHTS

__all__ = ["merge_projections"]

_RESHAPES = ("aten::view", "aten::_unsafe_view", "aten::reshape", "aten::unsqueeze", "aten::squeeze.dim")


def _sole_user(v: Value, outputs: set[str]) -> Node | None:
    return v.users[0] if len(v.users) == 1 and v.name not in outputs else None


def _projection(g: Group, outputs: set[str]) -> dict | None:
    """A GEMM group the kernel can take: x [M <= 16, K] (a reshape of a contiguous value read by nothing else)
    times a weight's transpose read in place (nn.Linear's x @ W^T, with or without a bias vector), no epilogue
    beyond the bias. Returns its root x, the reshapes and the transpose it absorbs, and its parts."""
    if g.kind != "gemm" or len(g.nodes) != 1 or g.nodes[0].op not in ("aten::mm", "aten::addmm"):
        return None
    p, node = g.params, g.nodes[0]
    a, w, bias = p["a"], p["b"], p.get("bias")
    if not p.get("transpose_b") or p.get("transpose_a") or p.get("epilogue") not in ("none", "bias"):
        return None
    if w.kind != "weight" or len(w.shape) != 2 or not w.is_contiguous() or a.dtype not in FLOAT_DTYPES:
        return None
    if bias is not None and (not isinstance(bias, Value) or bias.kind != "weight" or not bias.is_contiguous()):
        return None
    wt = node.args[2 if node.op == "aten::addmm" else 1]
    a_arg = node.args[1 if node.op == "aten::addmm" else 0]
    transpose = wt.producer
    if a_arg is not a or transpose is None or transpose.op != "aten::permute" or transpose.args[0] is not w \
            or _sole_user(wt, outputs) is not node:
        return None
    rows, k = a.shape
    if rows > GEMV_MAX_ROWS or k != w.shape[1] or not a.is_contiguous():
        return None
    # x through the reshapes that only it reads (a linear layer's view of [B, T, K] as [B * T, K]).
    chain, x = [], a
    while x.producer is not None and x.producer.op in _RESHAPES and _sole_user(x, outputs) is not None:
        source = x.producer.args[0]
        if not isinstance(source, Value) or not source.is_contiguous() or source.numel != a.numel:
            break
        chain.insert(0, x.producer)
        x = source
    if x.kind == "state":
        return None
    return {"x": x, "nodes": chain + [transpose, node], "weight": w, "bias": bias, "result": node.out,
            "rows": rows, "k": k, "columns": w.shape[0], "dtype": a.dtype, "group": g}


def _index(values: list[Value], v: Value) -> int | None:
    """Where `v` is in `values`, by identity (Values compare by their fields, tensors among them)."""
    return next((i for i, x in enumerate(values) if x is v), None)


def _cast_or_reshape(n: Node | None) -> bool:
    return n is not None and (n.op in _RESHAPES or n.op == "aten::_to_copy" and n.out.dtype.is_floating_point)


def _silu_mul(pointwise: Group, results: list[Value], outputs: set[str]) -> dict | None:
    """The elementwise group computing silu(gate) * up from two of `results` (the GEMMs' outputs), in either
    spelling a model has (aten::silu, or gate * sigmoid(gate)) and with the casts around it that a bf16 model
    inserts: its gate's and up's indices into `results`, the reshapes between them and the group, and its one
    output. None where the group computes anything else."""
    if pointwise.kind != "pointwise" or len(pointwise.outputs(outputs)) != 1:
        return None
    inside = {id(n) for n in pointwise.nodes}
    used: set[int] = set()
    between: list[Node] = []

    def root(v: Value) -> Value:  # through casts inside the group and reshapes between a GEMM and it
        while v.producer is not None and _cast_or_reshape(v.producer) and _index(results, v) is None:
            if id(v.producer) in inside:
                used.add(id(v.producer))
            elif v.producer.op in _RESHAPES and v.name not in outputs and all(id(u) in inside for u in v.users):
                if not any(b is v.producer for b in between):  # read by the group alone (fp32's gate: twice)
                    between.append(v.producer)
            else:
                break
            v = v.producer.args[0]
        return v

    def silu_of(v: Value) -> Value | None:
        v = root(v)
        n = v.producer
        if n is None or id(n) not in inside:
            return None
        if n.op == "aten::silu":
            used.add(id(n))
            return root(n.args[0])
        if n.op == "aten::mul.Tensor" and all(isinstance(a, Value) for a in n.args[:2]):
            for s, other in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
                sig = root(s).producer
                if sig is not None and id(sig) in inside and sig.op == "aten::sigmoid" and \
                        root(sig.args[0]) is root(other):
                    used.update((id(n), id(sig)))
                    return root(other)
        return None

    last = pointwise.nodes[-1]
    if last.op != "aten::mul.Tensor" or not all(isinstance(a, Value) for a in last.args[:2]) or len(last.args) > 2:
        return None
    for gate_arg, up_arg in ((last.args[0], last.args[1]), (last.args[1], last.args[0])):
        used.clear()
        between.clear()
        gate, up = silu_of(gate_arg), root(up_arg)
        if gate is not None and gate is not up and _index(results, gate) is not None and \
                _index(results, up) is not None:
            used.add(id(last))
            if used != inside:
                return None  # the group computes something more
            return {"gate": _index(results, gate), "up": _index(results, up), "between": list(between),
                    "output": last.out}
    return None


def merge_projections(groups: list[Group], outputs: set[str], decisions: list[tuple[str, str]]) -> list[Group]:
    """GEMM groups of decode's shape (x of at most 16 rows times nn.Linear weights) that read the same x,
    each a weight of the same K, become one "gemv" group a kernel of gemv_kernel runs (up to three weights:
    q, k and v), placed where the first of them was (every input exists by then); two such weights whose
    results only an elementwise silu(gate) * up reads (a Llama MLP, casts included) become one group with
    that product as its epilogue and its only output. The weights stay the model's: one pointer each."""
    found = [(i, _projection(g, outputs)) for i, g in enumerate(groups)]
    siblings: dict[tuple, list[tuple[int, dict]]] = {}
    for i, p in found:
        if p is not None:
            siblings.setdefault((p["x"].name, p["rows"], p["k"], p["dtype"]), []).append((i, p))
    owner = {id(n): g for g in groups for n in g.nodes}
    replaced: dict[int, Group] = {}  # index of the first sibling -> the merged group
    dropped: set[int] = set()  # ids of the groups it replaces
    merged = 0
    for members in siblings.values():
        for start in range(0, len(members), GEMV_MAX_WEIGHTS):
            run = members[start:start + GEMV_MAX_WEIGHTS]
            if len(run) < 2:
                continue
            parts = [p for _, p in run]
            group = _silu_group(parts, groups, owner, outputs, dropped) if len(parts) == 2 else None
            if group is None:
                nodes = [n for p in parts for n in p["nodes"]]
                group = Group("gemv", nodes, f"{len(parts)} projections of {parts[0]['rows']} row(s) sharing x "
                                             f"({parts[0]['x'].name}) as one GEMV kernel", _params(parts, "none"))
                group.params["results"] = [p["result"] for p in parts]
            for p in parts:
                dropped.add(id(p["group"]))
                for n in p["nodes"][:-1]:  # the reshapes (views) and the weight's transpose (a constant) until now
                    view = owner.get(id(n))
                    if view is not None and view.kind in ("view", "constant") and len(view.nodes) == 1:
                        dropped.add(id(view))
            replaced[run[0][0]] = group
            merged += 1
    if not merged:
        return groups
    kept = [n for g in replaced.values() for n in g.nodes]
    missing = [n for n in kept if owner.get(id(n)) is not None and id(owner[id(n)]) not in dropped]
    if missing:  # a reshape another group holds with more: leave every projection as it was
        return groups
    result = [replaced.get(i, g) for i, g in enumerate(groups) if i in replaced or id(g) not in dropped]
    epilogues = sum(g.params["epilogue"] == "silu_mul" for g in replaced.values())
    decisions.append((f"{sum(len(g.params['weights']) for g in replaced.values())} projections of decode's shape as "
                      f"{merged} GEMV kernel(s){f', {epilogues} with SiLU(gate) * up fused' if epilogues else ''}",
                      "a few rows of x times a weight is a pass over the weight: sibling weights sharing x read in "
                      "one launch instead of one each (STITCHCUDA_GEMV=1)"))
    return result


def _params(parts: list[dict], epilogue: str) -> dict:
    first = parts[0]
    return {"x": first["x"], "rows": first["rows"], "k": first["k"], "weights": [p["weight"] for p in parts],
            "biases": [p["bias"] for p in parts], "epilogue": epilogue}


def _silu_group(parts: list[dict], groups: list[Group], owner: dict[int, Group], outputs: set[str],
                dropped: set[int]) -> Group | None:
    """Two projections and the elementwise group reading both their results as silu(gate) * up, as one group
    (gate first), or None."""
    results = [p["result"] for p in parts]
    readers = {id(owner.get(id(u))) for r in results for u in _readers(r)}
    candidates = [g for g in groups if id(g) in readers and g.kind == "pointwise"]
    if len(candidates) != 1 or len(readers) != 1 or parts[0]["columns"] != parts[1]["columns"] \
            or any(r.name in outputs for r in results):
        return None  # a result someone else reads too
    match = _silu_mul(candidates[0], results, outputs)
    if match is None or any(owner.get(id(n)) is None or owner[id(n)].kind != "view" or len(owner[id(n)].nodes) != 1
                            for n in match["between"]):
        return None
    ordered = [parts[match["gate"]], parts[match["up"]]]
    dropped.add(id(candidates[0]))
    dropped.update(id(owner[id(n)]) for n in match["between"])
    nodes = [n for p in ordered for n in p["nodes"]] + match["between"] + candidates[0].nodes
    group = Group("gemv", nodes, f"gate and up projections of {ordered[0]['rows']} row(s) sharing x "
                                 f"({ordered[0]['x'].name}) and SiLU(gate) * up as one GEMV kernel",
                  _params(ordered, "silu_mul"))
    group.params["results"] = [match["output"]]
    return group


def _readers(v: Value) -> list[Node]:
    """The nodes reading `v`, through reshapes read by nothing else."""
    found = []
    for u in v.users:
        if u.op in _RESHAPES:
            found += _readers(u.out)
        else:
            found.append(u)
    return found
