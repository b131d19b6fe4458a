"""Finds attention in a captured graph: SDPA calls and attention written out (matmul -> scale -> mask ->
softmax -> dropout in eval -> matmul), through the views, transposes and GQA repeats around it, and describes
each as an `Attention` (q, k, v, scale, causal, mask, sizes) that the fused attention kernels can compute.

The planner replaces written-out attention, and SDPA calls of decode's shape, by one step that never builds
the scores (OfflinePlanner's attention groups): what that step can take (`sdpa_blocker`, `template_blocker`,
`decode_blocker`), the nodes it replaces (`replaced_nodes`) and its reference without the scores, computed
in slices of query rows (`reference`) are here beside the recognizer. See docs/attention.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .capture import Graph, Node, Value

__all__ = ["Attention", "find_attention", "sdpa_blocker", "template_blocker", "decode_blocker", "replaced_nodes",
           "attention_inputs", "reference", "reference_values", "REFERENCE_SLICE_BYTES"]

# Ops that change no value, only how it is seen: the matmul's operand reshapes, dropout in eval (a clone).
_SAME_VALUES = {"view", "_unsafe_view", "reshape", "clone", "alias", "contiguous", "expand"}
_SOFTMAX = {"_softmax", "softmax"}
_SDPA = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}
# A fill at or below this masks a key exactly: exp(fill - max) is 0 in fp32 for any finite row max it meets.
_MASKING_FILL = -1e9
_FOLD_LIMIT = 1 << 24  # elements: a constant mask larger than this is not evaluated


@dataclass(eq=False)  # one found attention is itself: groups holding it compare by identity, not by graph walks
class Attention:
    """One attention found in a graph: out = softmax(scale * q k^T [+ mask]) v over the last two dims.

    q [.., Nq, D], k [.., Nk, D], v [.., Nk, Dv] are the values as the attention reads them, k and v before
    any GQA repeat (so their head count is `kv_heads`; query head h reads kv head h // (heads / kv_heads)).
    `mask_kind`: None, "additive" (added to the scaled scores), "keep" (boolean, True attends) or "drop"
    (boolean, True is filled with `mask_value`). `causal` is set when the mask is the causal pattern (a
    constant lower triangle, top-left aligned), which then is not kept as `mask`. `nodes`: the nodes the
    fused kernel replaces, in graph order."""

    kind: str  # "sdpa" or "written"
    q: Value
    k: Value
    v: Value
    output: Value
    scale: float
    causal: bool = False
    mask: Value | None = None
    mask_kind: str | None = None
    mask_value: float | None = None
    dropout_p: float = 0.0
    nodes: list[Node] = field(default_factory=list, repr=False)

    def __repr__(self) -> str:  # the values' names and shapes: a Value's own repr walks the whole graph
        mask = f", mask={self.mask.name} ({self.mask_kind})" if self.mask is not None else ""
        return (f"Attention({self.kind}: q={self.q.name}{list(self.q.shape)}, k={self.k.name}{list(self.k.shape)}, "
                f"v={self.v.name}{list(self.v.shape)} -> {self.output.name}, scale={self.scale:.6g}, "
                f"causal={self.causal}{mask}, {len(self.nodes)} nodes)")

    @property
    def heads(self) -> int:
        return self.q.shape[-3] if len(self.q.shape) >= 3 else 1

    @property
    def kv_heads(self) -> int:
        return self.k.shape[-3] if len(self.k.shape) >= 3 else 1

    @property
    def batch(self) -> int:
        return math.prod(self.q.shape[:-3])

    @property
    def q_len(self) -> int:
        return self.q.shape[-2]

    @property
    def kv_len(self) -> int:
        return self.k.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def value_dim(self) -> int:
        return self.v.shape[-1]


def _op(node: Node | None) -> str:
    return "" if node is None else node.op.removeprefix("aten::").split(".")[0]


def _is_cast(node: Node | None) -> bool:
    """A float-to-float dtype conversion (a softmax taken in fp32 between bf16 matmuls): the fused kernel's
    softmax is fp32 whatever the inputs, so such casts around it are absorbed."""
    return _op(node) == "_to_copy" and len(node.args) == 1 and node.args[0].dtype.is_floating_point \
        and node.outputs[0].dtype.is_floating_point


def _is_scalar(a: Any) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


class _Finder:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.outputs = {id(v) for v in graph.outputs}
        self.folded: dict[int, torch.Tensor | None] = {}

    # ---- helpers ------------------------------------------------------------------------------------

    def private(self, v: Value, user: Node) -> bool:
        """`v` is read by `user` alone and is not a graph output: the fused kernel may drop it."""
        return len(v.users) == 1 and v.users[0] is user and id(v) not in self.outputs

    def peel(self, v: Value, seen: list[Node]) -> Value:
        """Back through value-preserving ops that keep the last two dims ([.., N, D] stays [.., N, D]), stopping
        at a GQA repeat's result (kv_source reads through it)."""
        while True:
            p = v.producer
            if len(v.shape) == 4 and self.kv_source(v, v.shape[1], []) is not v:
                return v
            if _op(p) not in _SAME_VALUES or not isinstance(p.args[0], Value):
                return v
            src = p.args[0]
            if src.shape[-2:] != v.shape[-2:] or (_op(p) == "expand" and src.shape != v.shape):
                return v  # a reshape of the matrix dims, or a real broadcast
            seen.append(p)
            v = src

    def scalar_of(self, a: Any) -> float | None:
        if _is_scalar(a):
            return float(a)
        if isinstance(a, Value) and a.numel == 1:
            t = self.fold(a)
            return None if t is None else float(t.reshape(()).item())
        return None

    def fold(self, v: Value) -> torch.Tensor | None:
        """The value of `v` when it depends on no user input (a mask built from arange/triu/full or a
        registered buffer), else None."""
        if id(v) in self.folded:
            return self.folded[id(v)]
        result = None
        if v.kind == "weight" and v.data is not None:
            result = v.data
        elif v.kind == "node" and v.numel <= _FOLD_LIMIT and v.producer is not None:
            p = v.producer
            ok = True

            def resolve(a):
                nonlocal ok
                if isinstance(a, Value):
                    t = self.fold(a)
                    ok = ok and t is not None
                    return t
                if isinstance(a, (list, tuple)):
                    return type(a)(resolve(x) for x in a)
                return a

            args, kwargs = resolve(p.args), {k: resolve(x) for k, x in p.kwargs.items()}
            if ok:
                try:
                    out = p.target(*args, **kwargs)
                    if isinstance(out, (list, tuple)):
                        out = out[next(i for i, o in enumerate(p.outputs) if o is v)]
                    result = out
                except Exception:  # an op that cannot run here: the mask is then taken as a tensor
                    result = None
        self.folded[id(v)] = result
        return result

    def kv_source(self, kv: Value, heads: int, seen: list[Node]) -> Value:
        """Through a GQA repeat (repeat_interleave / [:, :, None].expand().reshape() along the head dim):
        the [B, H_kv, N, D] tensor it repeats, else `kv` itself."""
        p = kv.producer
        if _op(p) not in ("view", "_unsafe_view", "reshape") or len(kv.shape) != 4:
            return kv
        chain = [p]
        x = p.args[0]
        if _op(x.producer) == "clone":
            chain.append(x.producer)
            x = x.producer.args[0]
        if _op(x.producer) != "expand" or len(x.shape) != 5:
            return kv
        chain.append(x.producer)
        src = x.producer.args[0]
        b, hkv, rep, n, d = x.shape
        if (src.shape != (b, hkv, 1, n, d) or hkv * rep != heads or kv.shape != (b, heads, n, d)):
            return kv  # a tile (repeat) puts head h on kv head h % H_kv: read as is
        if _op(src.producer) in ("unsqueeze", "view", "reshape", "_unsafe_view") and \
                src.producer.args[0].shape == (b, hkv, n, d):
            chain.append(src.producer)
            src = src.producer.args[0]
        else:
            return kv
        seen += chain
        return src

    # ---- SDPA calls ---------------------------------------------------------------------------------

    def sdpa(self, node: Node) -> Attention | None:
        names = [a.name for a in node.target._schema.arguments]  # the same for every SDPA variant
        call = dict(zip(names, node.args)) | node.kwargs
        q, k, v = call["query"], call["key"], call["value"]
        seen: list[Node] = []
        heads = q.shape[-3] if len(q.shape) >= 3 else 1
        ks, vs = self.kv_source(k, heads, seen), self.kv_source(v, heads, seen)
        if (ks is k) != (vs is v):  # one repeated, the other not: read both as they are
            ks, vs, seen = k, v, []
        mask = call.get("attn_mask", call.get("attn_bias"))
        scale = call.get("scale")
        found = Attention("sdpa", q, ks, vs, node.outputs[0],
                          float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
                          causal=bool(call.get("is_causal", False)), dropout_p=float(call.get("dropout_p", 0.0)),
                          nodes=seen + [node])
        if mask is not None:
            found.mask = mask
            found.mask_kind = "keep" if mask.dtype == torch.bool else "additive"
            if mask.dtype == torch.bool:  # SDPA drops a False key outright: the fill of -inf
                found.mask_value = float("-inf")
        return found

    # ---- written out --------------------------------------------------------------------------------

    def written(self, softmax: Node) -> Attention | None:
        x = softmax.args[0]
        dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
        if not isinstance(x, Value) or len(x.shape) < 2 or dim not in (-1, len(x.shape) - 1):
            return None
        seen: list[Node] = [softmax]
        after = self.probabilities_to_output(softmax.outputs[0], seen)
        scores = self.scores_to_matmul(x, softmax, seen) if after is not None else None
        operands = self.query_and_key(scores[0].producer, scores[1], seen) if scores is not None else None
        if operands is None:
            return None
        (v, out), (_, _, mask, mask_kind, mask_value), (q, k, scale) = after, scores, operands
        if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or q.shape[:-2] != k.shape[:-2]:
            return None
        heads = q.shape[-3] if len(q.shape) >= 3 else 1
        ks, vs = self.kv_source(k, heads, seen), self.kv_source(v, heads, seen)
        if (ks is k) != (vs is v):
            ks, vs = k, v
        order = {id(n): i for i, n in enumerate(self.graph.nodes)}
        unique = {id(n): n for n in seen}
        found = Attention("written", q, ks, vs, out, scale, nodes=sorted(unique.values(), key=lambda n: order[id(n)]))
        causal = False
        if mask is not None:
            causal = self.causal_pattern(mask, mask_kind, mask_value, q.shape[-2], k.shape[-2])
            if not causal:
                found.mask, found.mask_kind, found.mask_value = mask, mask_kind, mask_value
        found.causal = causal
        return found

    def probabilities_to_output(self, probs: Value, seen: list[Node]) -> tuple[Value, Value] | None:
        """Forward from the softmax: dropout in eval (a clone), casts and the operand views into the second
        matmul's left side. (v, the attention's output past its reshapes), or None."""
        y = probs
        while True:
            if id(y) in self.outputs or len(y.users) != 1:
                return None  # the probabilities are read elsewhere (returned attention weights)
            user = y.users[0]
            after = user.outputs[0]
            if _is_cast(user) or _op(user) in _SAME_VALUES and user.args[0] is y and after.shape[-2:] == y.shape[-2:] \
                    and (_op(user) != "expand" or after.shape == y.shape):
                seen.append(user)
                y = user.outputs[0]
                continue
            break
        pv = y.users[0]
        if _op(pv) not in ("bmm", "mm") or pv.args[0] is not y:
            return None
        seen.append(pv)
        v = self.peel(pv.args[1], seen)
        out = pv.outputs[0]
        while len(out.users) == 1 and _op(out.users[0]) in ("view", "_unsafe_view", "reshape") \
                and out.users[0].outputs[0].shape[-2:] == out.shape[-2:] and id(out) not in self.outputs:
            seen.append(out.users[0])
            out = out.users[0].outputs[0]
        return v, out

    def scores_to_matmul(self, x: Value, softmax: Node, seen: list[Node]) -> tuple | None:
        """Backward from the softmax's input: scale, mask and views down to the scores' matmul.
        (the scores value, scale, mask, mask kind, mask value), or None."""
        scale, mask, mask_kind, mask_value = 1.0, None, None, None
        s, consumer = x, softmax
        while True:
            p = s.producer
            if p is None or not self.private(s, consumer):
                return None  # the scores are read elsewhere: they would be built anyway
            kind = _op(p)
            if kind in ("mul", "div"):
                c = self.scalar_of(p.args[1]) if isinstance(p.args[0], Value) else None
                if c is None or c == 0:
                    return None  # a tensor factor (a learned temperature): not a scalar scale
                scale = scale * c if kind == "mul" else scale / c
                s = p.args[0]
            elif kind == "add" and all(isinstance(a, Value) for a in p.args[:2]) and mask is None:
                a, b = p.args[0], p.args[1]
                s, mask = (a, b) if self.reaches_matmul(a) else (b, a)
                if len(p.args) > 2 or p.kwargs.get("alpha", 1) != 1:
                    return None
                mask_kind = "additive"
            elif kind == "where" and mask is None:
                cond, a, b = p.args[:3]
                if self.reaches_matmul(b) and self.scalar_of(a) is not None:
                    s, mask, mask_kind, mask_value = b, cond, "drop", self.scalar_of(a)
                elif self.reaches_matmul(a) and self.scalar_of(b) is not None:
                    s, mask, mask_kind, mask_value = a, cond, "keep", self.scalar_of(b)
                else:
                    return None
            elif kind == "masked_fill" and mask is None:
                s, mask, mask_kind, mask_value = p.args[0], p.args[1], "drop", self.scalar_of(p.args[2])
            elif kind in ("view", "_unsafe_view", "reshape", "clone") and p.args[0].shape[-2:] == s.shape[-2:] \
                    or _is_cast(p):
                s = p.args[0]
            elif kind in ("bmm", "mm"):
                return s, scale, mask, mask_kind, mask_value
            else:
                return None
            seen.append(p)
            consumer = p

    def query_and_key(self, qk: Node, scale: float, seen: list[Node]) -> tuple[Value, Value, float] | None:
        """The scores' matmul's operands: q (with a scale folded into it, as nn.MultiheadAttention does) and k
        under its transpose. (q, k, the whole scale), or None when the right operand is no transposed key."""
        seen.append(qk)
        q = self.peel(qk.args[0], seen)
        while _op(q.producer) in ("mul", "div") and self.scalar_of(q.producer.args[1]) is not None:
            c = self.scalar_of(q.producer.args[1])
            scale = scale * c if _op(q.producer) == "mul" else scale / c
            seen.append(q.producer)
            q = self.peel(q.producer.args[0], seen)
        kt = self.peel(qk.args[1], seen)
        p = kt.producer
        nd = len(kt.shape)
        swap = list(range(nd - 2)) + [nd - 1, nd - 2]
        if _op(p) == "permute" and [d % nd for d in p.args[1]] == swap:
            k = p.args[0]
        elif _op(p) == "transpose" and sorted(d % nd for d in p.args[1:3]) == [nd - 2, nd - 1]:
            k = p.args[0]
        else:
            return None
        seen.append(p)
        return q, self.peel(k, seen), scale

    def reaches_matmul(self, v: Value) -> bool:
        """`v` is the scores' path: back through scale, views and casts it meets a matmul."""
        for _ in range(8):
            p = v.producer
            if _op(p) in ("bmm", "mm"):
                return True
            if _op(p) not in ("mul", "div", "view", "_unsafe_view", "reshape", "clone", "add", "where", "_to_copy"):
                return False
            v = next((a for a in p.args if isinstance(a, Value) and a.shape[-2:] == v.shape[-2:]
                      and self.fold(a) is None), None)
            if v is None:
                return False
        return False

    def causal_pattern(self, mask: Value, kind: str, value: float | None, nq: int, nk: int) -> bool:
        """The mask is a constant that hides exactly the keys after each query (top-left aligned)."""
        t = self.fold(mask)
        if t is None or t.shape[-2:] not in ((nq, nk),):
            return False
        masked = torch.ones(nq, nk, dtype=torch.bool, device=t.device).triu(1)
        every = t.reshape(-1, nq, nk)
        if kind == "additive":
            return bool(((every == float("-inf")) == masked).all() and (every[:, ~masked] == 0).all())
        if value is None or value > _MASKING_FILL:
            return False
        return bool(((every if kind == "drop" else ~every) == masked).all())

def find_attention(graph: Graph) -> list[Attention]:
    """Every attention in `graph`, in graph order: SDPA calls and written-out attention whose scores and
    probabilities nothing else reads."""
    finder = _Finder(graph)
    found = []
    for node in graph.nodes:
        if _op(node) in _SDPA:
            hit = finder.sdpa(node)
        elif _op(node) in _SOFTMAX:
            hit = finder.written(node)
        else:
            continue
        if hit is not None:
            found.append(hit)
    return found


# ---- the planner's view: what one attention step can take ------------------------------------------------

_STEP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def sdpa_blocker(a: Attention) -> str | None:
    """None when `a` can run as one ATen scaled_dot_product_attention step (ATen then picks the flash or
    memory-efficient kernel, the scores never in memory), else why not."""
    q, k, v = a.q, a.k, a.v
    if a.dropout_p:
        return "dropout in training mode"
    if len({q.dtype, k.dtype, v.dtype}) != 1 or q.dtype not in _STEP_DTYPES:
        return f"q, k, v of {q.dtype}, {k.dtype}, {v.dtype} (one of fp32, fp16, bf16 for all three)"
    if not 3 <= len(q.shape) <= 4 or len(k.shape) != len(q.shape) or len(v.shape) != len(q.shape):
        return f"q, k, v of ranks {len(q.shape)}, {len(k.shape)}, {len(v.shape)} (3 or 4 for all three)"
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-1] != v.shape[:-1] or a.heads % a.kv_heads:
        return f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not share batch, heads and keys"
    if a.mask is not None:
        m = a.mask
        if len(m.shape) > 4:
            return f"a mask of rank {len(m.shape)}"
        if a.mask_kind == "additive" and m.dtype not in (torch.float32, q.dtype):
            return f"an additive mask of {m.dtype} beside {q.dtype} scores"
        if a.mask_kind in ("keep", "drop") and (m.dtype != torch.bool or a.mask_value is None
                                                or a.mask_value > _MASKING_FILL):
            return (f"a boolean mask filled with {a.mask_value} (a fill of {_MASKING_FILL:g} or below masks a key, "
                    "as a boolean attention mask does)")
        try:
            torch.broadcast_shapes(tuple(m.shape), (*q.shape[:-1], k.shape[-2]))
        except RuntimeError:
            return f"a mask of shape {list(m.shape)} that does not broadcast to the scores"
    return None


def template_blocker(a: Attention) -> str | None:
    """None when the fused prefill template (templates/attention.py) computes `a` too, else why not."""
    from .templates.attention import HEAD_DIMS  # the recognizer alone needs no template

    why = sdpa_blocker(a)
    if why is not None:
        return why
    if a.head_dim not in HEAD_DIMS or a.value_dim != a.head_dim:
        return f"head dims {a.head_dim} / {a.value_dim} (the template: equal, one of {HEAD_DIMS})"
    return None


# Where the fused prefill template was measured ahead of SDPA (bench.attention on an H100, docs/attention.md):
# the mma.sync kernel at fp16/bf16 and head dims 64 and 128 (1.02-1.36x SDPA's flash backend), the FMA kernel
# at fp32 and head dim 64 (1.08-1.17x the memory-efficient backend; 0.83x at 128), causal or not, no mask,
# 197 to 2,048 queries.
PREFILL_AHEAD = {torch.float16: (64, 128), torch.bfloat16: (64, 128), torch.float32: (64,)}
PREFILL_MIN_QUERIES = 128  # the measured shapes had 197 to 2,048 queries; a query block is 64-128 rows


def prefill_blocker(a: Attention) -> str | None:
    """None when attention="auto" takes `a` as the fused prefill template (where the template computes it and
    was measured ahead of SDPA: PREFILL_AHEAD, no mask), else why SDPA keeps it."""
    why = template_blocker(a)
    if why is not None:
        return why
    if a.head_dim not in PREFILL_AHEAD.get(a.q.dtype, ()):
        where = "; ".join(f"{str(t).removeprefix('torch.')}: {', '.join(map(str, d))}" for t, d in PREFILL_AHEAD.items())
        return (f"head dim {a.head_dim} at {str(a.q.dtype).removeprefix('torch.')} (the template measured ahead of "
                f"SDPA at head dims {where})")
    if a.mask is not None:
        return "a mask (the template's masked form is not measured against SDPA yet)"
    if a.q_len < PREFILL_MIN_QUERIES:
        return f"{a.q_len} query tokens (measured ahead from {PREFILL_MIN_QUERIES}: a block's rows fill)"
    return None


def decode_blocker(a: Attention) -> str | None:
    """None when `a` has decode's shape and the split-KV decode kernels (templates/attention.py) compute it,
    else why not. Decode's shape: at most DECODE_MAX_TOKENS query tokens against at least DECODE_MIN_CHUNK
    keys. A few query rows per head make attention a pass over the keys, each K and V row read for a few
    dot products: its time is its bytes read. Over a static cache SDPA reads every one of the max_length
    keys and leaves the masked ones to the softmax; the decode kernels split the keys across blocks
    (one per split, so a sequence's keys fill the GPU) and read only the ones the mask keeps. Below
    DECODE_MIN_CHUNK keys there is one split and little to pass over."""
    from .templates.attention import DECODE_MAX_TOKENS, DECODE_MIN_CHUNK

    why = template_blocker(a)
    if why is not None:
        return why
    if a.q_len > DECODE_MAX_TOKENS:
        return f"{a.q_len} query tokens (decode: at most {DECODE_MAX_TOKENS})"
    if a.kv_len < DECODE_MIN_CHUNK:
        return f"{a.kv_len} keys (decode: at least {DECODE_MIN_CHUNK}, one split's worth)"
    if a.causal:  # SDPA's is_causal is top-left aligned: over a cache it would hide the cache, not the future
        return "a causal flag over a cache (decode takes the mask that says which positions are filled)"
    return None


def replaced_nodes(a: Attention, outputs: set[str]) -> list[Node]:
    """The nodes of `a` one step replaces: its nodes less those whose results something outside reads
    (a view of q that another op reads too stays, and feeds the step its source), repeated until none is."""
    kept = list(a.nodes)
    while True:
        inside = {id(n) for n in kept}
        shared = [n for n in kept if any(v is not None and v is not a.output and
                                         (v.name in outputs or any(id(u) not in inside for u in v.users))
                                         for v in n.outputs)]
        if not shared:
            return kept
        kept = [n for n in kept if n not in shared]


def attention_inputs(a: Attention) -> list[Value]:
    """The values one attention step reads: q, k, v (before any GQA repeat) and the mask, if kept."""
    out: list[Value] = []
    for v in (a.q, a.k, a.v, a.mask):
        if v is not None and all(v is not w for w in out):
            out.append(v)
    return out


# A reference computed in slices of query rows holds at most this many bytes of one slice's scores.
REFERENCE_SLICE_BYTES = 64 << 20


def reference(a: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float64, slice_bytes: int = REFERENCE_SLICE_BYTES,
              slices: list[int] | None = None) -> torch.Tensor:
    """`a`'s output computed from its inputs in `dtype`, the math form over slices of query rows whose
    scores hold at most `slice_bytes` (one row at the least): the check of an attention group never
    builds the N x N scores, as the step it checks does not. Shaped as `a.output`. `slices` receives each
    slice's row count."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    rep = a.heads // a.kv_heads
    if rep > 1:
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    nq, nk = q.shape[-2], k.shape[-2]
    per_row = math.prod(q.shape[:-2]) * nk * torch.empty((), dtype=dtype).element_size()
    step = max(1, slice_bytes // max(per_row, 1))
    if mask is not None:
        mask = mask if mask.dtype == torch.bool else mask.to(dtype)
        mask = mask.expand(*mask.shape[:-2], nq, nk) if mask.dim() >= 2 else mask.expand(nq, nk)
    parts = []
    for r0 in range(0, nq, step):
        r1 = min(nq, r0 + step)
        s = (q[..., r0:r1, :] @ k.transpose(-1, -2)) * a.scale
        if a.causal:
            s = s.masked_fill(torch.ones(r1 - r0, nk, dtype=torch.bool, device=s.device).triu(r0 + 1), float("-inf"))
        if mask is not None:
            m = mask[..., r0:r1, :]
            if a.mask_kind == "additive":
                s = s + m
            else:  # the fill, as the module applies it: to the scores where the mask hides a key
                s = s.masked_fill(m if a.mask_kind == "drop" else ~m, a.mask_value)
        parts.append(torch.softmax(s, -1) @ v)
        if slices is not None:
            slices.append(r1 - r0)
        del s
    return torch.cat(parts, -2).reshape(a.output.shape)


def reference_values(a: Attention, values: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`reference` on recorded values by name (weights from their Values): {output name: tensor}, what the
    accuracy rule reads of an attention group's subgraph instead of running its nodes (which would build
    the scores)."""
    def get(x: Value | None) -> torch.Tensor | None:
        return None if x is None else x.data.detach() if x.kind == "weight" else values[x.name]

    return {a.output.name: reference(a, get(a.q), get(a.k), get(a.v), get(a.mask), dtype)}
