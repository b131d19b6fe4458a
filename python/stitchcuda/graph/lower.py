"""Lowering: a GraphPlan's groups -> a stitched Program (buffers, kernels from the template Coder, cuBLASLt
matmuls, ATen steps, views), and the per-group check against the group's ATen subgraph.

Views and constants are materialized lazily, at their first consumer, so a weight transpose folded into
a matmul or a constant nobody reads costs nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ..program import Program, dtype_name
from ..verify.program import HOST_REFERENCE_BYTES, check_program
from ..verify.tolerance import by_accuracy
from ..verify.tolerance import tolerance  # the Verifier's table; re-exported for graph-mode callers
from .accuracy import candidate_outputs, judge_group, rule_precision
from .capture import INPLACE_UPDATES, Graph, Node, Value
from .layout import channels_last_strides, depthwise_nhwc, is_channels_last
from .merge_launches import mark_generated, program_builder
from .layout import contiguous_strides as _contiguous_strides
from .groups import Group, GraphPlan
from .planner import broadcast_strides, in_place_cat, relayout_strides, rotate_half_source
from .templates import (FUSABLE_DTYPES, POINTWISE_OPS, CatPiece, KernelCode, PointwiseInput, RowProduct, RowPrologue,
                        column_reduction_kernel, depthwise_conv_kernel, depthwise_conv_nhwc_kernel, nchw_to_nhwc_kernel,
                        normalized_rows_kernel, pointwise_from_nhwc_kernel, pointwise_kernel, pooling_kernel,
                        pooling_nhwc_kernel, row_reduction_kernel, scan_kernel)
from .templates.attention import decode_attention_kernels, flash_attention_kernel
from .templates.gemv import gemv_kernel
from .templates.scatter import (CacheIndex, CacheTarget, IntegerChain, cache_write_kernel, integer_expression,
                                integer_kernel)

__all__ = ["LoweringError", "Lowering", "reference_values", "stream_values", "check_group", "working_bytes", "tolerance"]


class LoweringError(Exception):
    """A group cannot be expressed as program steps; the message says why."""


def reference_values(graph: Graph, inputs: list[torch.Tensor], keep: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Runs the exported graph with ATen, recording every value by name (weights included), or only the
    values named in `keep` (the interpreter frees the others after their last use: at the scale of
    large models, recording every intermediate at once costs more memory than the model's forward)."""
    env: dict[str, torch.Tensor] = {}
    gm = graph.exported.graph_module
    weights = {w.name: w.data for w in (*graph.weights, *graph.states)}  # the states as the call finds them
    user = {v.name: t for v, t in zip(graph.inputs, inputs)}
    args = []
    for fx in gm.graph.nodes:
        if fx.op == "placeholder":
            args.append(user[fx.name] if fx.name in user else weights[fx.name])

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if isinstance(result, torch.Tensor):
                if keep is None or n.name in keep:
                    env[n.name] = result
            elif isinstance(result, (list, tuple)):
                for k, r in enumerate(result):
                    if isinstance(r, torch.Tensor) and (keep is None or f"{n.name}.{k}" in keep):
                        env[f"{n.name}.{k}"] = r
            return result

    with torch.no_grad():
        Recorder(gm).run(*args)
    return env


def constant_values(graph: Graph, names: set[str]) -> dict[str, torch.Tensor]:
    """The values named in `names` — constants, computed from weights and factories alone — by running
    only the nodes they depend on (no user input is read: reference_values would run the whole forward,
    which is a model's full cost on a CPU)."""
    gm = graph.exported.graph_module
    by_name = {fx.name: fx for fx in gm.graph.nodes}

    def node_of(name: str) -> str:  # "op.1", a multi-output op's second result, is op's
        return name if name in by_name else name.rpartition(".")[0]

    needed: set[str] = set()
    stack = [node_of(n) for n in names if node_of(n) in by_name]
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        stack.extend(a.name for a in by_name[name].all_input_nodes)
    weights = {w.name: w.data for w in (*graph.weights, *graph.states)}  # the states as the call finds them
    env: dict[str, Any] = {}
    with torch.no_grad():
        for fx in gm.graph.nodes:
            if fx.name not in needed:
                continue
            if fx.op == "placeholder":
                if fx.name not in weights:
                    raise LoweringError(f"constant depends on the user input '{fx.name}'")
                env[fx.name] = weights[fx.name]
            elif fx.op == "call_function":
                args, kwargs = torch.fx.node.map_arg((fx.args, fx.kwargs), lambda a: env[a.name])
                env[fx.name] = fx.target(*args, **kwargs)
            else:
                raise LoweringError(f"constant depends on the {fx.op} node '{fx.name}'")
    out: dict[str, torch.Tensor] = {}
    for n in names:
        value = env.get(node_of(n))
        if n not in by_name and isinstance(value, (list, tuple)):
            value = value[int(n.rpartition(".")[2])]
        if isinstance(value, torch.Tensor):
            out[n] = value
    return out


# An NHWC operand is staged through tiles at a chain's output edge from this many channels on (fewer: the
# gather's stride is short enough for its sectors to be shared by neighbouring pixels' loads).
EDGE_MIN_CHANNELS = 8


def _output_edge(shape: tuple[int, ...], inputs: list[PointwiseInput], outputs: list[Value]) -> bool:
    """Whether a pointwise group iterated in NCHW order reads a full-size operand stored channels-last (a
    convolution chain's value) and writes only results of its own shape (contiguous NCHW)."""
    if len(shape) != 4 or shape[1] < EDGE_MIN_CHANNELS or shape[0] > 65535 or not outputs:
        return False
    if any(tuple(v.shape) != shape for v in outputs):
        return False
    if any(i.pieces for i in inputs):
        return False  # the staged NHWC edge reads each operand whole
    nhwc = channels_last_strides(shape)
    return any(tuple(i.strides) == nhwc and not i.offset for i in inputs)


def _rows_view(shape: tuple[int, ...], inputs: list[PointwiseInput]
               ) -> tuple[tuple[int, int, int], list[PointwiseInput]] | None:
    """An elementwise iteration space of rank >= 3 as [B, R, C]: its middle dimensions merged into R,
    where every operand's strides allow it (over the middle extents above 1, each stride the next's times
    its extent: dense, or broadcast throughout); None otherwise (or with a concatenation read in place)."""
    if len(shape) < 3 or any(i.pieces or i.rotate for i in inputs):
        return None
    middle = [d for d in range(1, len(shape) - 1) if shape[d] != 1]
    merged = []
    for i in inputs:
        if any(i.strides[a] != shape[b] * i.strides[b] for a, b in zip(middle, middle[1:])):
            return None
        merged.append(dataclasses.replace(i, strides=(i.strides[0], i.strides[middle[-1]] if middle else 0,
                                                      i.strides[-1])))
    return (shape[0], math.prod(shape[1:-1]), shape[-1]), merged


def _transposed_operand(shape: tuple[int, int, int], inputs: list[PointwiseInput]) -> bool:
    """Whether a pointwise group iterating [B, R, C] (_rows_view; its results contiguous in that order)
    reads a full-size operand stored [B, C, R'] with R' >= R (unit stride along R, rows of at least R: a
    transposed tensor, or a slice of one — a causal conv1d's output cut to the sequence and transposed
    back): gathered with a stride of R', each 4-byte load would fetch its own 32-byte sector;
    pointwise_from_nhwc_kernel stages it through tiles."""
    if shape[1] < EDGE_MIN_CHANNELS or shape[2] < EDGE_MIN_CHANNELS or shape[0] > 65535 \
            or -(-shape[1] // 32) > 65535:
        return False
    return any(i.strides[1] == 1 and i.strides[2] >= shape[1] and (i.strides[0] or shape[0] == 1) and not i.offset
               for i in inputs)


def _with_unit_w(i: PointwiseInput) -> PointwiseInput:
    """A 3-D operand of a [B, R, C] group as one of [B, R, C, 1]: the unit W's stride that of C, so an
    operand with unit stride along R is staged (pointwise_from_nhwc_kernel) unless broadcast along C."""
    return dataclasses.replace(i, strides=(*i.strides, i.strides[2]))


class _StreamDone(Exception):
    """stream_values' early stop: every wanted key was handled."""


def stream_values(graph: Graph, inputs: list[torch.Tensor], wanted: dict[Any, set[str]],
                  on_ready: Callable[[Any, dict[str, torch.Tensor]], None],
                  keep: set[str] = frozenset(), kept: dict[str, torch.Tensor] | None = None,
                  forward: Callable[[], Any] | None = None, stop_when_done: bool = False) -> dict[str, torch.Tensor]:
    """Runs the exported graph with ATen once and calls `on_ready(key, values)` for each key of `wanted`
    (a set of value names: a group's inputs and outputs) once all of its values exist, before the next
    node runs (when the interpreter has dropped what the last node read for the last time); a value is
    dropped once every key that wants it has been handled (and the interpreter no longer needs it), so
    the recorded values alive at once are the ones a pending check still reads — not every intermediate
    of the graph. Keys whose values never all appear are handled at the end with what exists. Returns
    the values named in `keep` (recorded, never dropped), written into `kept` as they arrive when given
    (so that `on_ready` can read the earlier ones: a group's constants are computed before it).

    `forward`, when given, calls the model itself on the inputs: where every value wanted or kept is an
    input or an output of the graph (one group that is the whole model: a loss, an activation chain), one
    call of it gives them at the eager forward's own peak, where the exported graph's ATen decomposition
    holds its pieces at once (a Huber loss's difference, square, linear branch and mask: 3 GB for a 1 GB
    eager peak). Outputs that do not line up with the graph's (count, shape, dtype) fall back to the graph.

    `stop_when_done`: with nothing to keep, the graph stops running once every key is handled (a mismatch
    traced a window of early groups at a time needs only the forward up to them)."""
    user = {v.name: t for v, t in zip(graph.inputs, inputs)}
    kept = {} if kept is None else kept
    if forward is not None and _stream_from_forward(graph, user, wanted, on_ready, keep, kept, forward):
        return kept
    gm = graph.exported.graph_module
    weights = {w.name: w.data for w in (*graph.weights, *graph.states)}  # the states as the call finds them
    args = [user[fx.name] if fx.name in user else weights[fx.name]
            for fx in gm.graph.nodes if fx.op == "placeholder"]
    recording = _Recording(wanted, on_ready, keep, kept)
    # The caller's inputs and the weights: never written, whatever op hands them on unchanged (a
    # contiguous() of a contiguous tensor returns the tensor itself).
    protected = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
    with torch.no_grad():
        try:
            _Streamer(gm, recording, protected, stop_when_done).run(*args)
        except _StreamDone:
            pass
    recording.finish()
    return kept


class _Recording:
    """stream_values' bookkeeping: which keys still wait for values (`pending`), how many pending keys read
    each value (`readers`), the values held for them, and the keys whose values all exist, handled before
    the next node runs (`deferred`)."""

    def __init__(self, wanted: dict[Any, set[str]], on_ready: Callable[[Any, dict[str, torch.Tensor]], None],
                 keep: set[str], kept: dict[str, torch.Tensor]) -> None:
        self.wanted, self.on_ready, self.keep, self.kept = wanted, on_ready, keep, kept
        self.pending = {key: set(names) for key, names in wanted.items()}
        self.readers: dict[str, int] = {}
        for names in self.pending.values():
            for name in names:
                self.readers[name] = self.readers.get(name, 0) + 1
        self.held: dict[str, torch.Tensor] = {}
        self.deferred: list = []

    def handle(self, key) -> None:
        names = self.wanted[key]
        self.on_ready(key, {name: self.held[name] for name in names if name in self.held})
        for name in names:
            self.readers[name] -= 1
            if self.readers[name] == 0:
                self.held.pop(name, None)

    def arrived(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.keep:
            self.kept[name] = tensor
        if self.readers.get(name):
            self.held[name] = tensor
        for key, missing in self.pending.items():
            if name in missing:
                missing.discard(name)
                if not missing:
                    self.deferred.append(key)

    def handle_deferred(self) -> None:
        while self.deferred:
            key = self.deferred.pop(0)
            del self.pending[key]
            self.handle(key)

    def finish(self) -> None:
        """The keys handled at the end: those completed by the last node, and those whose values never all
        appeared (with what exists)."""
        self.handle_deferred()
        for key in list(self.pending):
            del self.pending[key]
            self.handle(key)


class _Streamer(torch.fx.Interpreter):
    """The exported graph run with ATen, each value handed to the recording as it is computed."""

    def __init__(self, gm: torch.fx.GraphModule, recording: _Recording, protected: set[int],
                 stop_when_done: bool) -> None:
        super().__init__(gm)
        self.recording, self.protected, self.stop_when_done = recording, protected, stop_when_done

    def call_function(self, target, args, kwargs):
        # An activation the model ran in place (nn.ReLU(inplace=True)) is functional in the export, and
        # an op it decomposed (a SiLU, a batch norm) allocates a result per piece: run each elementwise
        # one in place where nothing else can see the operand it writes over, so the recording holds the
        # eager forward's live set, not an extra activation-sized tensor per block (a VGG stage's, an
        # EfficientNet block's).
        rec = self.recording
        own = _in_place_ok(self._node, args, rec.readers, rec.keep, self.env, self.protected, (rec.held, rec.kept),
                           getattr(self, "user_to_last_uses", {}).get(self._node, ()))
        if own is not None:
            return own(*args, **kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, n):
        self._node = n
        rec = self.recording
        # The keys a node completed are handled when the next node is about to run: by then the
        # interpreter has let go of the values that node read last (a SiLU's sigmoid, a batch norm's
        # output), so a check runs beside the forward's live set between two nodes, not beside the
        # transient peak inside one.
        rec.handle_deferred()
        if self.stop_when_done and not rec.pending and not rec.keep:
            raise _StreamDone
        result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            rec.arrived(n.name, result)
        elif isinstance(result, (list, tuple)):
            for k, r in enumerate(result):
                if isinstance(r, torch.Tensor):
                    rec.arrived(f"{n.name}.{k}", r)
        return result


# Elementwise ops and their in-place forms. An activation an inplace=True module ran, and the pieces of an
# op the export decomposed (a SiLU's x * sigmoid(x), a batch norm's scale and shift): each writes over an
# operand the forward no longer reads, as the eager op would not have allocated it.
_IN_PLACE = {getattr(torch.ops.aten, name).default: getattr(torch.ops.aten, name + "_").default
             for name in ("relu", "hardtanh", "silu", "hardswish", "hardsigmoid", "leaky_relu", "elu", "mish",
                          "threshold", "sigmoid", "tanh", "exp", "neg", "abs", "sqrt", "rsqrt", "reciprocal",
                          "gelu", "clamp")
             if hasattr(torch.ops.aten, name) and hasattr(torch.ops.aten, name + "_")}
# Binary ones: (in-place form, whether the operands may swap: the result written over the second).
_IN_PLACE_BINARY = {torch.ops.aten.mul.Tensor: (torch.ops.aten.mul_.Tensor, True),
                    torch.ops.aten.add.Tensor: (torch.ops.aten.add_.Tensor, True),
                    torch.ops.aten.sub.Tensor: (torch.ops.aten.sub_.Tensor, False),
                    torch.ops.aten.div.Tensor: (torch.ops.aten.div_.Tensor, False)}


def _in_place_ok(node: Any, args: tuple, readers: dict[str, int], keep: set[str], env: dict,
                 protected: set[int], recorded: tuple[dict, ...], last_uses: list) -> Any:
    """A callable that runs `node`'s elementwise op in place over one of its operands when that changes
    nothing anyone can see, or None. The operand: the result of an earlier op (not an input, weight or
    constant, nor in their memory: `protected`), read by no later node (`last_uses`: the values whose last
    reader `node` is), wanted by no pending check nor kept, not a view, of the result's shape and dtype,
    and sharing its memory with no other live value: the interpreter's, or the `recorded` ones (values held
    for pending checks, kept values; an op may hand one on unchanged)."""
    target = getattr(node, "target", None)
    unary, binary = _IN_PLACE.get(target), _IN_PLACE_BINARY.get(target)
    if unary is None and binary is None:
        return None

    def reusable(i: int) -> bool:
        if i >= len(args) or i >= len(node.args) or not isinstance(args[i], torch.Tensor):
            return False
        source, x = node.args[i], args[i]
        if not isinstance(source, torch.fx.Node) or source.op != "call_function" or source not in last_uses:
            return False
        if readers.get(source.name) or source.name in keep or x._base is not None:
            return False
        if unary is not None and not x.is_floating_point():
            return False
        if binary is not None:
            other = args[1 - i]
            shape = torch.broadcast_shapes(x.shape, other.shape) if isinstance(other, torch.Tensor) else x.shape
            if tuple(shape) != tuple(x.shape) or torch.result_type(*args[:2]) != x.dtype:
                return False
        where = x.untyped_storage().data_ptr()
        if where in protected:
            return False
        live = [v for other, v in env.items() if other is not source] + [v for d in recorded for v in d.values()]
        for value in live:
            for t in value if isinstance(value, (list, tuple)) else (value,):  # a multi-output op's results too
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == where:
                    return False
        return True

    if unary is not None:
        return unary if reusable(0) else None
    op, swaps = binary
    if len(args) != 2 or not isinstance(args[1], torch.Tensor) and not isinstance(args[1], (int, float, bool)):
        return None
    if reusable(0):
        return op
    if swaps and isinstance(args[1], torch.Tensor) and node.kwargs.get("alpha", 1) == 1 and reusable(1):
        return lambda a, b, **kwargs: op(b, a, **kwargs)
    return None


def _stream_from_forward(graph: Graph, user: dict[str, torch.Tensor], wanted: dict[Any, set[str]],
                         on_ready: Callable[[Any, dict[str, torch.Tensor]], None], keep: set[str],
                         kept: dict[str, torch.Tensor], forward: Callable[[], Any]) -> bool:
    """stream_values from one call of the model, when every value named is a graph input or output and the
    model's tensor outputs line up with the graph's; False (nothing called back) otherwise."""
    names = set(keep).union(*wanted.values()) if wanted else set(keep)
    outputs = [v.name for v in graph.outputs]
    if not names <= set(user) | set(outputs):
        return False
    with torch.no_grad():
        got = [t for t in pytree.tree_flatten(forward())[0] if isinstance(t, torch.Tensor)]
    if len(got) != len(graph.outputs) or any(tuple(t.shape) != tuple(v.shape) or t.dtype != v.dtype
                                             for t, v in zip(got, graph.outputs)):
        return False
    values = {**user, **dict(zip(outputs, got))}
    kept.update({name: values[name] for name in keep if name in values})
    for key, wants in wanted.items():
        on_ready(key, {name: values[name] for name in wants if name in values})
    return True


class Lowering:
    """Builds one Program from groups. `externals`: values that are program inputs (in order)."""

    def __init__(self, graph: Graph, plan: GraphPlan, constants: dict[str, torch.Tensor], sm_count: int = 132) -> None:
        self.graph, self.plan, self.constants, self.sm_count = graph, plan, constants, sm_count
        self.b = program_builder(sm_count)  # STITCHCUDA_MERGE_LAUNCHES=1: merges small independent launches
        self.buf: dict[str, int] = {}
        self.spec: dict[int, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]] = {}
        self.pending: dict[str, Group] = {}
        self.kernels: list[tuple[Group, KernelCode]] = []
        self.main_kernels: dict[int, KernelCode] = {}  # id(group) -> its last kernel other than a layout conversion
        self.notes: list[str] = []
        self._names = itertools.count()
        self.channels_last: frozenset[str] = getattr(plan, "channels_last", frozenset())
        self.nhwc_copies: dict[str, int] = {}  # a convolution input's channels-last copy, made once
        self.on_aten: dict[int, str] = {}  # generated groups this layout runs as ATen steps: id -> why
        self.shared: dict[int, torch.Tensor] = {}  # weight buffer -> the GPU tensor executors read in place
        self.shared_states: dict[int, torch.Tensor] = {}  # state buffer -> the model's buffer executors update
        self.updates = {id(n) for n in graph.state_updates.values()}  # nodes lowered in place (_update_in_place)
        self.updated: set[str] = set()  # states whose update is lowered: their old value is gone
        self.state_values = {v.name for v in graph.state_values.values()}  # stored like outputs (copied in)
        self.kernel_ids: dict[str, int] = {}  # a kernel's source -> its index in the kernel table
        self.prefixes: dict[str, str] = {}  # provisional kernel name (_name) -> its prefix

    # ---- buffers ----

    def _record(self, value: Value, bid: int, shape, strides, dtype) -> int:
        self.buf[value.name] = bid
        self.spec[bid] = (tuple(shape), tuple(strides), dtype)
        return bid

    def need(self, v: Value, contiguous: bool = False) -> int:
        """The buffer holding `v`, materializing views and constants on first use."""
        if v.kind == "state" and v.name in self.updated:
            raise LoweringError(f"state '{v.name}' is read after the step that updates it in place: this read wants "
                                "its old value; the plan must order it before the update")
        if v.name not in self.buf:
            if v.name in self.pending:
                self._lower_view(self.pending.pop(v.name))
            elif v.kind == "state":
                self._record(v, self._state(v), v.shape, v.strides, v.dtype)
            elif v.kind == "weight" or v.name in self.constants:
                self._record(v, *self._store_weight(self._data(v), v.name, v.name in self.channels_last))
            else:
                raise LoweringError(f"value '{v.name}' is used before any step produces it")
        bid = self.buf[v.name]
        shape, strides, dtype = self.spec[bid]
        if contiguous and strides != _contiguous_strides(shape):
            out = self.b.intermediate(list(shape), dtype_name(dtype), name=f"{v.name}.contiguous")
            self.b.aten("aten::contiguous", [bid], [out])
            self.spec[out] = (shape, _contiguous_strides(shape), dtype)
            self.buf[v.name] = out
            return out
        return bid

    def _data(self, v: Value) -> torch.Tensor:
        """A weight's or a constant's tensor."""
        return (v.data if v.kind == "weight" else self.constants[v.name]).detach()

    def _store_weight(self, source: torch.Tensor, name: str,
                      nhwc: bool = False) -> tuple[int, tuple, tuple, torch.dtype]:
        """A weight buffer holding `source` (contiguous; with `nhwc`, a 4-D float filter stored as cuDNN's
        NHWC kernels read it: bytes in N, H, W, C order): (buffer, shape, strides, dtype)."""
        data = source.contiguous()
        strides = _contiguous_strides(data.shape)
        if nhwc and data.dim() == 4 and data.is_floating_point():
            data = data.contiguous(memory_format=torch.channels_last)
            strides = strides if data.is_contiguous() else tuple(data.stride())
        if data.is_cuda and data.data_ptr() == source.data_ptr() and data.data_ptr() % 256 == 0:
            # Already in the program's layout on the GPU (a model's parameter, used as it is): the
            # program's executors read it in place instead of uploading a second copy, and the program
            # stores no bytes of it until it is saved (Program.share_weight).
            bid = self.b.weight(list(data.shape), data.dtype, strides=list(strides), name=name)
            self.shared[bid] = source
        else:
            bid = self.b.weight(data, name=name)
        return bid, tuple(data.shape), strides, data.dtype

    def _state(self, v: Value) -> int:
        """A state buffer for the model's buffer `v` (a KV cache), in its layout; executors made beside the
        model update the buffer itself, in place, where it is on the GPU (Program.share_state)."""
        name = self.graph.state_buffers.get(v.name, v.name)
        bid = self.b.state(list(v.shape), v.dtype, strides=list(v.strides), name=name)
        if v.data is not None and v.data.is_cuda:
            if v.data.data_ptr() % 256:  # a state of the executor's own would leave the model's buffer behind
                raise LoweringError(f"buffer '{name}' does not start 256-byte aligned (a view into a larger tensor): "
                                    "the program cannot update it in place; register a tensor of its own")
            self.shared_states[bid] = v.data
        return bid

    def _update_in_place(self, n: Node, inputs: list[int], attributes: dict[str, Any]) -> None:
        """`n`, the functional update whose result is a state's new value (capture's state_updates), as a step
        writing the state in place; its result's readers read the state."""
        state = n.args[0]
        sbid = self.need(state)
        if n.op == "aten::slice_scatter":  # the source copied into the slice of the state it replaces
            names = [a.name for a in n.target._schema.arguments]
            bound = dict(zip(names, n.args))
            bound.update(n.kwargs)
            meta = torch.empty_strided(state.shape, state.strides, dtype=state.dtype, device="meta")
            part = torch.ops.aten.slice.Tensor(meta, bound.get("dim", 0), bound.get("start"), bound.get("end"),
                                               bound.get("step", 1))
            view = self.b.view("slice", sbid, list(part.shape), strides=list(part.stride()),
                               storage_offset=part.storage_offset())
            self.b.aten("aten::copy_", [view, self.need(bound["src"])], [view])
        else:
            self.b.aten(INPLACE_UPDATES[n.op], inputs, [sbid], **attributes)
        self._record(n.out, sbid, state.shape, state.strides, state.dtype)
        self.updated.add(state.name)

    def produce(self, v: Value, captured_layout: bool = False, strides: tuple[int, ...] | None = None) -> int:
        """A fresh buffer for `v` (the output buffer when `v` is a graph output): contiguous, or, with
        `captured_layout`, laid out as the capture saw it when that is a dense permutation. (An ATen
        step's result keeps its own layout: scaled_dot_product_attention returns [B, H, S, D] stored as
        [B, S, H, D], and the transpose-and-view traced after it is a view only in that layout.) Explicit
        `strides` (a dense layout the step writes: channels-last) win over both, except for a graph output."""
        if v.name in self.buf:
            raise LoweringError(f"value '{v.name}' is produced twice")
        chosen = strides
        strides = _contiguous_strides(v.shape)
        if v.name in self.output_ids and v.name not in self.written:
            self.written.add(v.name)
            bid = self.output_ids[v.name]
        else:
            if chosen is not None and _dense_permutation(v.shape, chosen):
                strides = tuple(chosen)
            elif captured_layout and not v.is_contiguous() and _dense_permutation(v.shape, v.strides):
                strides = tuple(v.strides)
            bid = self.b.intermediate(list(v.shape), dtype_name(v.dtype), strides=list(strides), name=v.name)
        return self._record(v, bid, v.shape, strides, v.dtype)

    # ---- the program ----

    def build(self, groups: list[Group], inputs: list[Value], outputs: list[Value], fallback: set[int] = frozenset(),
              hardware: dict[str, str] | None = None) -> Program:
        self.output_ids: dict[str, int] = {}
        self.written: set[str] = set()
        for v in inputs:
            self._record(v, self.b.input(list(v.shape), dtype_name(v.dtype), name=v.name), v.shape,
                         _contiguous_strides(v.shape), v.dtype)
        extra_outputs: list[tuple[Value, int]] = []
        for v in outputs:
            bid = self.b.output(list(v.shape), dtype_name(v.dtype), name=v.name)
            if v.name in self.output_ids:
                extra_outputs.append((v, bid))
            else:
                self.output_ids[v.name] = bid
        # Convolutions whose epilogue runs fused in cuDNN (when the plan asks; an epilogue that fell back
        # keeps its convolution apart).
        present = {id(g) for g in groups}
        fused = {key: match for key, match in self.plan.conv_epilogues.items()
                 if self.plan.fuse_conv_epilogues and key not in fallback and key in present
                 and id(match["conv_group"]) in present}
        fused_convs = {id(match["conv_group"]) for match in fused.values()}
        for g in groups:
            if g.kind in ("view",):
                for v in g.nodes[0].outputs:  # a split has several: the first use lowers them all
                    if v is not None:
                        self.pending[v.name] = g
            elif g.kind == "constant":
                continue  # values already in self.constants; weights are created at first use
            elif id(g) in fused_convs:
                continue  # computed by its epilogue's fused cuDNN step
            elif id(g) in fused:
                self._lower_conv_epilogue(g, fused[id(g)])
            elif id(g) in fallback or g.kind == "aten":
                for n in g.nodes:
                    self._lower_aten(n, group=g)
            elif g.kind == "gemm":
                self._lower_gemm(g)
            elif g.kind == "pointwise":
                self._lower_pointwise(g)
            elif g.kind == "reduction":
                self._lower_reduction(g)
            elif g.kind == "conv":
                self._lower_conv(g)
            elif g.kind == "pool":
                self._lower_pool(g)
            elif g.kind == "scan":
                self._lower_scan(g)
            elif g.kind == "kernel_step":
                self._lower_kernel_step(g)
            elif g.kind == "gemv":
                self._lower_gemv(g)
            elif g.kind == "attention":
                self._lower_attention(g)
            elif g.kind in ("cache_write", "integer"):  # graph/cache_write.py's groups
                self._lower_cache_write(g)
            else:
                raise LoweringError(f"unknown group kind {g.kind}")
        # Outputs nothing wrote (a returned input, weight, constant or view, or a value returned twice).
        for v in outputs:
            if v.name in self.output_ids and v.name not in self.written:
                src = self.need(v)  # may lower a pending view straight into the output buffer
                if v.name not in self.written:
                    self.b.aten("aten::clone", [src], [self.output_ids[v.name]])
                    self.written.add(v.name)
        for v, bid in extra_outputs:
            self.b.aten("aten::clone", [self.need(v)], [bid])
        # States whose new value is not an in-place update of them: copied in last, after every read of the
        # old value (a running total's add_, a whole-buffer copy_ export folds into its source's op). Only in
        # the whole forward's program: a group's own program (its check) leaves the states alone.
        whole = [v.name for v in inputs] == [v.name for v in self.graph.inputs]
        for state in self.graph.states if whole else ():
            new = self.graph.state_values.get(state.name)
            if new is not None and state.name not in self.graph.state_updates:
                source = self.need(new)
                target = self.need(state)
                self.b.aten("aten::copy_", [target, source], [target])
        # The policy caps the steps: an fp32 plan whose GEMMs run as tf32x3 (fp32's accuracy on TF32 tensor
        # cores) allows exactly that and nothing lossier.
        split = self.plan.precision == "fp32" and any(
            g.kind == "gemm" and id(g) not in fallback and g.params.get("precision") == "tf32x3" for g in groups)
        self.b.precision("tf32x3" if split else self.plan.precision)
        if hardware:
            self.b.verified_on(**hardware)
        for state, node in self.graph.state_updates.items() if whole else ():
            if self.buf.get(node.out.name) != self.buf.get(state):
                raise LoweringError(f"the update of state '{state}' ({node.op}) was not lowered in place: its group "
                                    "must run as an ATen step")
        program = self.b.build()
        for bid, tensor in self.shared.items():
            program.share_weight(bid, tensor)
        for bid, tensor in self.shared_states.items():
            program.share_state(bid, tensor)
        return program

    # ---- groups ----

    def _name(self, prefix: str, group: Group) -> str:
        """A provisional entry point name for a kernel of `group`; _launch names the kernel after its
        prefix and its source (the same code has the same name in every program)."""
        name = f"{prefix}_g{next(self._names)}"
        self.prefixes[name] = prefix
        return name

    def _lower_gemm(self, g: Group) -> None:
        p = g.params
        node = g.nodes[0]
        a, b = self.need(p["a"], contiguous=True), self.need(p["b"], contiguous=True)
        bias = self.need(p["bias"], contiguous=True) if p["bias"] is not None else None
        c = self.produce(p["result"])
        batch = p["result"].shape[0] if node.op == "aten::bmm" else 1
        self.b.matmul(a, b, c, bias=bias, transpose_a=p["transpose_a"], transpose_b=p["transpose_b"], batch=batch,
                      epilogue=p["epilogue"], precision=p["precision"])

    def _lower_gemv(self, g: Group) -> None:
        """Sibling projections sharing x (graph/projections.py) as one GEMV launch (templates/gemv.py): x and each
        weight and bias read in place (the model's own), one output each, or one with the SiLU epilogue."""
        p = g.params
        buffers = {"x": self.need(p["x"], contiguous=True)}
        for j, (w, b) in enumerate(zip(p["weights"], p["biases"])):
            buffers[f"w{j}"] = self.need(w, contiguous=True)
            if b is not None:
                buffers[f"b{j}"] = self.need(b, contiguous=True)
        for o, v in enumerate(p["results"]):
            buffers[f"y{o}"] = self.produce(v)
        code = gemv_kernel(self._name("gemv", g), rows=p["rows"], k=p["k"], columns=[w.shape[0] for w in p["weights"]],
                           dtype=p["x"].dtype, bias=[b is not None for b in p["biases"]], epilogue=p["epilogue"],
                           sms=self.sm_count)
        self._launch(g, code, buffers)

    def _lower_reduction(self, g: Group) -> None:
        p = g.params
        if p.get("normalized"):
            self._lower_normalized(g)
            return
        node = p.get("node") or g.nodes[-1]
        x = p.get("x") or node.args[0]  # sum_exp: the sum's input is exp(x - max), computed in the kernel
        result = p.get("result") or node.out
        has_w = p.get("weight") is not None
        has_b = p.get("bias") is not None
        prologue, epilogue, buffers = None, None, {}
        if p.get("prologue"):  # the elementwise ops producing x, computed on load: x is never stored
            inputs, buffers, body, var = self._elementwise(p["prologue"], tuple(x.shape))
            prologue = RowPrologue(tuple(x.shape), inputs, body, var[x.name])
        same_row: dict[str, str] = {}
        if p.get("epilogue"):  # elementwise ops over the row reading its statistic: the statistic is never stored
            # Prologue values the row's ops read (an RMS norm's fp32 upcast of x), and those the kernel stores
            # besides its result (the residual sum before the norm, p["stores"]), are computed again from the
            # same loads.
            stores = p.get("stores") or []
            again = _read_by(p.get("prologue") or [], [*p["epilogue"], *(v.producer for v in stores)], stores)
            inputs, more, body, var = self._elementwise([*again, *p["epilogue"]], tuple(x.shape),
                                                        {node.out.name: "stat"}, "e")
            epilogue = RowPrologue(tuple(x.shape), inputs, body, var[result.name], ("stat",))
            # The epilogue's reads of the row the reduction reads (an RMS norm's x): from the kernel's registers.
            read = ({i.key: (buffers[i.key], i) for i in prologue.inputs} if prologue else
                    {"x": (self.need(x, contiguous=True), None)})
            for e in inputs:
                for key, (bid, inp) in read.items():
                    if more[e.key] == bid and (inp is None or (inp.strides, inp.offset, inp.rotate, inp.dtype)
                                               == (e.strides, e.offset, e.rotate, e.dtype)):
                        same_row[e.key] = key
            buffers.update(more)
        if p.get("layout") == "column":
            code = column_reduction_kernel(self._name(p["kind"], g), p["kind"], p["outer"], p["reduce"], p["inner"],
                                           x.dtype, result.dtype, prologue)
            if prologue is None:
                buffers["x"] = self.need(x, contiguous=True)
            buffers["y"] = self.produce(result)
            self._launch(g, code, buffers)
            return
        output = None
        if p.get("output"):  # elementwise ops on each result before it is stored (a SiLU after a group norm)
            known = {node.out.name: "yv", **({p["max"].name: "mx"} if "max" in p else {})}
            inputs, more, body, var = self._elementwise(p["output"], tuple(node.out.shape), known, "o")
            output = RowPrologue(tuple(node.out.shape), inputs, body, var[result.name], tuple(known.values()))
            buffers.update(more)
        if p.get("split") and epilogue is None and not has_w and not has_b:
            # Two passes: each row's `split` chunks reduced by their own blocks into an fp32 scratch row
            # (the chunk is the row of a (rows * split, cols / split) view: same linear index, so the
            # prologue reads the same elements), then the chunks' results reduced and stored. Equal chunks
            # make a mean of means the mean; sum, amax and amin combine as themselves.
            split = p["split"]
            partial = self.b.intermediate([p["rows"], split], torch.float32)
            first = row_reduction_kernel(self._name(f"{p['kind']}_chunks", g), p["kind"], p["rows"] * split,
                                         p["cols"] // split, x.dtype, torch.float32, sm_count=self.sm_count,
                                         prologue=prologue)
            if prologue is None:
                buffers["x"] = self.need(x, contiguous=True)
            self._launch(g, first, {**buffers, "y": partial})
            code = row_reduction_kernel(self._name(p["kind"], g), p["kind"], p["rows"], split, torch.float32,
                                        result.dtype, sm_count=self.sm_count, output=output)
            self._launch(g, code, {**buffers, "x": partial, "y": self.produce(result)})
            return
        code = row_reduction_kernel(self._name(p["kind"], g), p["kind"], p["rows"], p["cols"], x.dtype,
                                    result.dtype, eps=p.get("eps", 1e-5), has_weight=has_w, has_bias=has_b,
                                    sm_count=self.sm_count, prologue=prologue, epilogue=epilogue, output=output,
                                    groups=p.get("groups", 0), group_hw=p.get("group_hw", 0), same_row=same_row,
                                    also=tuple((var[v.name], v.dtype) for v in p.get("stores") or []),
                                    keep_input=p["kept_input"].dtype if p.get("kept_input") is not None else None)
        if prologue is None:
            buffers["x"] = self.need(x, contiguous=True)
        if has_w:
            buffers["weight"] = self.need(p["weight"], contiguous=True)
        if has_b:
            buffers["bias"] = self.need(p["bias"], contiguous=True)
        buffers["y"] = self.produce(result)
        for j, v in enumerate(p.get("stores") or []):
            buffers[f"y{j + 1}"] = self.produce(v)
        if p.get("kept_input") is not None:  # the prologue's result, which later groups read
            buffers["xs"] = self.produce(p["kept_input"])
        self._launch(g, code, buffers)

    def _lower_normalized(self, g: Group) -> None:
        """Softmax / log-softmax rows and their per-row readers (OfflinePlanner._normalized_inputs): one
        kernel reads the logits rows, normalizes them in registers and computes each reader's result; a
        statistic over the whole tensor stores one value per row and a second kernel reduces those (a mean
        of the rows' means, equal rows; a sum of sums; a max of maxima)."""
        p = g.params
        rows, cols = p["rows"], p["cols"]
        names = {v.name: f"nrm{j}" for j, (v, _) in enumerate(p["normalized"])}
        extra = tuple(names.values())
        buffers = {f"x{j}": self.need(node.args[0], contiguous=True) for j, (_, node) in enumerate(p["normalized"])}
        products, finals = [], []
        for k, (kind, reader) in enumerate(p["readers"]):
            if kind == "gather":
                node = reader.nodes[0]
                buffers[f"g{k}"] = self.need(node.args[2], contiguous=True)
                buffers[f"y{k}"] = self.produce(node.out)
                products.append(RowProduct("gather", source=list(names).index(node.args[0].name), index=f"g{k}",
                                           out_dtype=node.out.dtype))
                continue
            q = reader.params
            node = q["node"]
            x, result = node.args[0], q.get("result") or node.out
            if q.get("prologue"):
                inputs, more, body, var = self._elementwise(q["prologue"], tuple(x.shape), names, f"a{k}i")
                prologue = RowPrologue(tuple(x.shape), inputs, body, var[x.name], extra)
                buffers.update(more)
            else:  # the normalized values themselves
                prologue = RowPrologue(tuple(x.shape), [], [], names[x.name], extra)
            output = None
            if q.get("output"):
                o_inputs, more, o_body, o_var = self._elementwise(q["output"], tuple(node.out.shape),
                                                                  {node.out.name: "yv"}, f"a{k}o")
                output = RowPrologue(tuple(node.out.shape), o_inputs, o_body, o_var[result.name], ("yv",))
                buffers.update(more)
            if q["rows"] == 1 and rows != 1:  # over the whole tensor: one value per row, then a second kernel
                buffers[f"y{k}"] = self.b.intermediate([rows], torch.float32)
                products.append(RowProduct(q["kind"], prologue))
                finals.append((q["kind"], buffers[f"y{k}"], output, result))
            else:
                buffers[f"y{k}"] = self.produce(result)
                products.append(RowProduct(q["kind"], prologue, output, out_dtype=result.dtype))
        norms = [node.op.removeprefix("aten::_") for _, node in p["normalized"]]
        self._launch(g, normalized_rows_kernel(self._name("normalized", g), rows, cols, norms, products), buffers)
        for kind, partial, output, result in finals:
            final = row_reduction_kernel(self._name(kind, g), kind, 1, rows, torch.float32, result.dtype,
                                         sm_count=self.sm_count, output=output)
            self._launch(g, final, {**buffers, "x": partial, "y": self.produce(result)})

    def _lower_conv(self, g: Group) -> None:
        p = g.params
        node = p["node"]
        x, w, bias, stride, padding, dilation = node.args[:6]
        result = p.get("result") or node.out
        buffers = {}
        output = None
        if p.get("output"):  # elementwise ops on each result before it is stored (batch norm, SiLU)
            inputs, buffers, body, var = self._elementwise(p["output"], tuple(node.out.shape), {node.out.name: "yv"}, "o")
            output = RowPrologue(tuple(node.out.shape), inputs, body, var[result.name], ("yv",))
        has_bias = isinstance(bias, Value)
        if x.name in self.channels_last and result.name in self.channels_last and depthwise_nhwc(node):
            # Inside a channels-last chain: NHWC in, NHWC out, no conversion around the convolution.
            code = depthwise_conv_nhwc_kernel(self._name("depthwise_nhwc", g), tuple(x.shape), tuple(w.shape[2:]),
                                              tuple(stride), tuple(padding), tuple(dilation), has_bias, output,
                                              self.sm_count)
            buffers["x"] = self._channels_last_copy(x, g)
            nhwc = channels_last_strides(tuple(result.shape))
            if result.name in self.output_ids:
                # A result the program returns in the model's layout (the group checked alone, or the model's
                # own output): written NHWC as inside the chain, then one copy into the returned buffer, so
                # a group check runs the kernel the program will.
                y = self.b.intermediate(list(result.shape), dtype_name(result.dtype), strides=list(nhwc),
                                        name=f"{result.name}.nhwc")
                self.spec[y] = (tuple(result.shape), nhwc, result.dtype)
                self.produce(result)
            else:
                y = self.produce(result, strides=nhwc)
        else:
            code = depthwise_conv_kernel(self._name("depthwise", g), tuple(x.shape), tuple(w.shape[2:]), tuple(stride),
                                         tuple(padding), tuple(dilation), x.dtype, result.dtype, has_bias, output,
                                         self.sm_count)
            buffers["x"] = self.need(x, contiguous=True)
            y = self.produce(result)
        buffers["weight"] = self.need(w, contiguous=True)
        if has_bias:
            buffers["bias"] = self.need(bias, contiguous=True)
        buffers["y"] = y
        self._launch(g, code, buffers)
        if buffers["y"] != self.buf[result.name]:
            self.b.aten("aten::contiguous", [buffers["y"]], [self.buf[result.name]])

    def _lower_pool(self, g: Group) -> None:
        """A pooling template kernel. The indices of max_pool2d_with_indices are not produced (the Planner
        makes a group only when nothing reads them). An input stored channels-last (a convolution chain's
        value, graph/layout.py) is pooled in NHWC, the result NHWC too for the next convolution: by the
        channels-last template (fp32, channels in multiples of 4, a result the program keeps), else by
        ATen in place; a conversion each way would cost more."""
        p = g.params
        node = p["node"]
        x = node.args[0]
        result = p.get("result") or node.out
        xb = self.need(x)
        nhwc = is_channels_last(*self.spec[xb][:2])
        template_nhwc = (nhwc and len(x.shape) == 4 and x.shape[1] % 4 == 0 and result.name not in self.output_ids
                         and x.dtype == result.dtype == torch.float32)
        if nhwc and not template_nhwc:
            self.on_aten[id(g)] = "its input is stored channels-last: ATen pools it in place (NHWC)"
            for n in g.nodes:
                self._lower_aten(n, group=g)
            return
        buffers = {}
        output = None
        if p.get("output"):  # elementwise ops on each pooled value before it is stored
            inputs, buffers, body, var = self._elementwise(p["output"], tuple(node.out.shape), {node.out.name: "yv"}, "o")
            output = RowPrologue(tuple(node.out.shape), inputs, body, var[result.name], ("yv",))
        settings = (p["kernel"], p["stride"], p["padding"], p["dilation"], p["ceil_mode"], p["count_include_pad"],
                    p["divisor_override"])
        if template_nhwc:
            code = pooling_nhwc_kernel(self._name(f"{p['pool']}pool_nhwc", g), p["pool"], tuple(x.shape), *settings,
                                       output, self.sm_count)
            buffers["x"] = xb
            buffers["y"] = self.produce(result, strides=channels_last_strides(tuple(result.shape)))
        else:
            code = pooling_kernel(self._name(f"{p['pool']}pool", g), p["pool"], tuple(x.shape), *settings, x.dtype,
                                  result.dtype, output, self.sm_count)
            buffers["x"] = self.need(x, contiguous=True)
            buffers["y"] = self.produce(result)
        self._launch(g, code, buffers)

    def _lower_scan(self, g: Group) -> None:
        """A cumsum / cumprod template kernel, in ATen's combining order (templates/scan.py); its prologue's
        ops compute the scanned input on load, its output function's ops each result before the store."""
        p = g.params
        node = p["node"]
        x = node.args[0]
        result = p.get("result") or node.out
        shape = tuple(x.shape)
        prologue, output, buffers = None, None, {}
        if p.get("prologue"):  # the elementwise ops producing x, computed on load: x is never stored
            inputs, buffers, body, var = self._elementwise(p["prologue"], shape)
            prologue = RowPrologue(shape, inputs, body, var[x.name])
        if p.get("output"):  # elementwise ops on each result before it is stored
            inputs, more, body, var = self._elementwise(p["output"], shape, {node.out.name: "yv"}, "o")
            output = RowPrologue(shape, inputs, body, var[result.name], ("yv",))
            buffers.update(more)
        code = scan_kernel(self._name(p["kind"], g), p["kind"], shape, p["dim"], prologue, output, result.dtype)
        if prologue is None:
            buffers["x"] = self.need(x, contiguous=True)
        buffers["y"] = self.produce(result)
        self._launch(g, code, buffers)

    def _launch(self, g: Group, code: KernelCode, buffers: dict[str, int], main: bool = True) -> None:
        # Kernels are named after their code: the same template over the same shapes (every layer's norm and
        # activation of a transformer, a group and its check) is the same source in every program, compiled
        # once (the kernel cache) and one kernel table entry per program.
        key = code.source.replace(code.name, "\0")
        template = code.name in self.prefixes  # a template's own code: only such launches may merge
        if code.name in self.prefixes:
            name = f"{self.prefixes[code.name]}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
            code = dataclasses.replace(code, name=name, source=key.replace("\0", name))
        k = self.kernel_ids.get(code.source)
        if k is None:
            k = self.kernel_ids[code.source] = self.b.kernel(code.source, code.name)
        if template:
            mark_generated(self.b, k)
        args = []
        for kind, key in code.args:
            args.append((kind, buffers[key]) if kind in ("in", "out") else (kind, key))
        self.b.launch(k, code.grid, code.block, args, shared_mem=code.shared_mem)
        self.kernels.append((g, code))
        if main:  # a layout conversion at the group's edge is not the kernel the group became
            self.main_kernels[id(g)] = code

    def _lower_kernel_step(self, g: Group) -> None:
        """A target's kernel step (an LLM's or a template's, verified as its sub-problem): in0.. are the
        target's inputs, contiguous, out0.. its outputs."""
        code: KernelCode = g.params["code"]
        buffers = {f"in{k}": self.need(v, contiguous=True) for k, v in enumerate(g.params["inputs"])}
        for k, v in enumerate(g.params["outputs"]):
            buffers[f"out{k}"] = self.produce(v)
        self._launch(g, code, buffers)

    # ---- KV cache writes and int64 bookkeeping (graph/cache_write.py, templates/scatter.py) ----

    def _lower_cache_write(self, g: Group) -> None:
        """A cache_write group (its states written in place at the index, their sources' elementwise producers and
        its int64 ops in the same kernel) or an integer group (int64 ops alone)."""
        outputs = g.outputs(set(self.output_ids) | self.state_values)
        index = g.params["writes"][0].args[2] if g.kind == "cache_write" else None
        stored = [*outputs, *([index] if index is not None and index.name not in {v.name for v in outputs} else [])]
        chains, buffers, ints = self._integer_chains(g.params["integer"], stored)
        if g.kind == "integer":
            self._launch(g, integer_kernel(self._name("integer", g), chains), buffers)
            return
        writes = g.params["writes"]
        dim, shape = writes[0].args[1] % len(writes[0].out.shape), tuple(writes[0].args[3].shape)
        inputs, more, body, var = self._elementwise(g.params["pointwise"], shape, rotations=True, cats=True)
        buffers.update(more)
        for n in writes:  # a source no op of the group computes is read as it lies
            source = n.args[3]
            if source.name not in var:
                key = var[source.name] = f"in{len(inputs)}"
                buffers[key] = self.need(source)
                vshape, vstrides, _ = self.spec[buffers[key]]
                inputs.append(PointwiseInput(key, source.dtype, broadcast_strides(tuple(vshape), tuple(vstrides), shape)))
        if index.name in ints:  # computed by the thread that writes at it
            where = CacheIndex(chain=int(ints[index.name][1:].partition("_")[0]), var=ints[index.name])
        else:
            buffers["idx"] = self.need(index)
            where = CacheIndex("idx", self.spec[buffers["idx"]][1][0])
        targets = []
        for k, n in enumerate(writes):
            state = n.args[0]
            buffers[f"w{k}"] = sbid = self.need(state)
            sshape, sstrides, _ = self.spec[sbid]
            targets.append(CacheTarget(f"w{k}", state.dtype, tuple(sstrides), sshape[dim], var[n.args[3].name]))
        made = {v.name for n in g.params["pointwise"] for v in n.outputs if v is not None}
        stores = [(f"q{k}", var[v.name], v.dtype) for k, v in enumerate(o for o in outputs if o.name in made)]
        for (key, _, _), v in zip(stores, [o for o in outputs if o.name in made]):
            buffers[key] = self.produce(v)
        code = cache_write_kernel(self._name("cache_write", g), shape, dim, inputs, body, targets, where, stores,
                                  chains)
        self._launch(g, code, buffers)
        for n in writes:  # the update's readers read the state
            state = n.args[0]
            self._record(n.out, self.buf[state.name], state.shape, state.strides, state.dtype)
            self.updated.add(state.name)

    def _integer_chains(self, nodes: list[Node], outputs: list[Value]
                        ) -> tuple[list[IntegerChain], dict[str, int], dict[str, str]]:
        """`nodes` (int64 add/sub) as integer chains, one per result shape, in 64-bit C: each chain's results are
        its values among `outputs` (buffers keyed z{chain}_{k}). Also returns the buffers the chains read and
        each value's variable (c{chain}_t{k})."""
        chains: dict[tuple, IntegerChain] = {}
        buffers: dict[str, int] = {}
        var: dict[str, str] = {}
        read: dict[tuple[int, str], str] = {}  # (chain, tensor) -> its variable in the chain
        for n in nodes:
            shape = tuple(n.out.shape)
            c = chains.setdefault(shape, IntegerChain(shape, [], [], []))
            at = list(chains).index(shape)
            operands = []
            for a in n.args[:2]:
                if not isinstance(a, Value):
                    operands.append(f"{int(a)}LL")
                elif a.name in var and var[a.name].startswith(f"c{at}_"):
                    operands.append(var[a.name])
                else:
                    if (at, a.name) not in read:  # each tensor loaded once per chain
                        key = f"j{at}_{len(c.inputs)}"
                        buffers[key] = self.need(a)
                        vshape, vstrides, _ = self.spec[buffers[key]]
                        c.inputs.append(PointwiseInput(key, torch.int64,
                                                       broadcast_strides(tuple(vshape), tuple(vstrides), shape)))
                        read[(at, a.name)] = f"in{len(c.inputs) - 1}"
                    operands.append(read[(at, a.name)])
            alpha = int(n.kwargs.get("alpha", n.args[2] if len(n.args) > 2 else 1))
            var[n.out.name] = f"c{at}_t{len(c.body)}"
            c.body.append(f"const long long {var[n.out.name]} = {integer_expression(n.op, *operands, alpha)};")
        for v in outputs:
            if v.name in var:
                at = int(var[v.name][1:].partition("_")[0])
                key = f"z{at}_{len(list(chains.values())[at].results)}"
                list(chains.values())[at].results.append((key, var[v.name]))
                buffers[key] = self.produce(v)
        return list(chains.values()), buffers, var

    # ---- attention: one step, the scores never in memory ----

    def _lower_attention(self, g: Group) -> None:
        """Written-out attention (the planner's attention group) as ATen's scaled_dot_product_attention or
        the fused template (`impl`), on q, k, v as the attention reads them (before a GQA repeat)."""
        a = g.params["attention"]
        mask = self._attention_mask(a)
        if g.params["impl"] == "fused":
            self._lower_fused_attention(g, a, mask)
            return
        if g.params["impl"] == "decode":
            self._lower_decode_attention(g, a, mask)
            return
        rank = len(a.q.shape)
        rep = a.heads // a.kv_heads
        # Flash takes GQA as it is (enable_gqa); the memory-efficient kernel (fp32) reads repeated heads.
        gqa = rep > 1 and a.q.dtype != torch.float32
        lead = (1,) * (4 - rank)  # the fused SDPA kernels take 4-D q, k, v only: [B*H, N, D] gets a leading 1
        ins = [self._lifted(self._repeated(self.need(x), rep, rank - 3) if x is not a.q and rep > 1 and not gqa
                            else self.need(x), lead) for x in (a.q, a.k, a.v)]
        if mask is not None:
            ins.append(mask)
        shape = (*lead, *a.q.shape[:-1], a.value_dim)
        out = self._attention_result(a, shape)
        self.b.aten("aten::scaled_dot_product_attention", ins, [out], dropout_p=0.0, is_causal=a.causal,
                    scale=a.scale, enable_gqa=gqa)
        self._attention_viewed(a, out)

    def _attention_mask(self, a) -> int | None:
        """The mask buffer as both attention steps read it: additive in the scores' dtype or fp32, boolean
        True where a key is attended (a masked_fill's mask, True where hidden, is negated once)."""
        if a.mask is None:
            return None
        bid = self.need(a.mask)
        shape, _, dtype = self.spec[bid]
        target = torch.bool if a.mask_kind != "additive" else dtype if dtype in (torch.float32, a.q.dtype) else a.q.dtype
        if a.mask_kind == "drop" or target != dtype:
            out = self.b.intermediate(list(shape), dtype_name(target), name=f"{a.mask.name}.attention")
            if a.mask_kind == "drop":
                self.b.aten("aten::logical_not", [bid], [out])
            else:
                self.b.aten("aten::_to_copy", [bid], [out], dtype=dtype_name(target))
            self.spec[out] = (tuple(shape), _contiguous_strides(shape), target)
            bid = out
        return bid

    def _repeated(self, bid: int, rep: int, dim: int) -> int:
        """The buffer's heads (dim `dim`) each repeated `rep` times in a buffer of its own (GQA's kv heads)."""
        shape, _, dtype = self.spec[bid]
        shape = tuple(x * rep if d == dim else x for d, x in enumerate(shape))
        out = self.b.intermediate(list(shape), dtype_name(dtype))
        self.b.aten("aten::repeat_interleave.self_int", [bid], [out], repeats=rep, dim=dim)
        self.spec[out] = (shape, _contiguous_strides(shape), dtype)
        return out

    def _lifted(self, bid: int, lead: tuple[int, ...]) -> int:
        """A view of the buffer with `lead` extents of 1 in front."""
        if not lead:
            return bid
        shape, strides, dtype = self.spec[bid]
        out_shape = (*lead, *shape)
        out_strides = (*(shape[0] * strides[0] for _ in lead), *strides)
        out = self.b.view("slice", bid, list(out_shape), strides=list(out_strides))
        self.spec[out] = (out_shape, out_strides, dtype)
        return out

    def _attention_result(self, a, shape: tuple[int, ...]) -> int:
        """The buffer an attention step writes, contiguous `shape`: the output's own where the shapes agree,
        else a buffer of its own (viewed as the output by _attention_viewed once the step is written)."""
        if tuple(shape) == tuple(a.output.shape):
            return self.produce(a.output)
        out = self.b.intermediate(list(shape), dtype_name(a.output.dtype), name=f"{a.output.name}.attention")
        self.spec[out] = (tuple(shape), _contiguous_strides(shape), a.output.dtype)
        return out

    def _attention_viewed(self, a, out: int) -> None:
        """The attention's output as a view of the step's result of another shape (an output buffer then
        gets a copy at the end of the program, as any output nothing wrote)."""
        if a.output.name not in self.buf:
            contiguous = _contiguous_strides(a.output.shape)
            view = self.b.view("reshape", out, list(a.output.shape), strides=list(contiguous))
            self._record(a.output, view, a.output.shape, contiguous, a.output.dtype)

    def _lower_fused_attention(self, g: Group, a, mask: int | None) -> None:
        """The fused prefill template (templates/attention.py) reading q, k, v through their (batch, head,
        token) strides; a layout it cannot read (D not unit-stride; for the tensor-core kernel, 16-byte
        copies) is copied contiguous first."""
        rank, dtype = len(a.q.shape), a.q.dtype
        wmma = dtype != torch.float32
        strides = []
        bids = {}
        for key, x in (("q", a.q), ("k", a.k), ("v", a.v)):
            bid = self.need(x)
            _, st, _ = self.spec[bid]
            if st[-1] != 1 or (wmma and any(s % 8 for s in st[:-1])):
                bid = self.need(x, contiguous=True)
                _, st, _ = self.spec[bid]
            bids[key] = bid
            strides += [st[0] if rank == 4 else 0, st[-3], st[-2]]
        heads, nq, d = a.heads, a.q_len, a.head_dim
        strides += [heads * nq * d, nq * d, d]  # the output, contiguous
        full = (a.batch, heads, nq, a.kv_len)
        code = flash_attention_kernel(self._name("attention", g), batch=a.batch, heads=heads, kv_heads=a.kv_heads,
                                      q_len=nq, kv_len=a.kv_len, head_dim=d, dtype=dtype, causal=a.causal,
                                      mask_dtype=None if mask is None else self.spec[mask][2])
        buffers = {**bids, "o": self._attention_result(a, (*a.q.shape[:-1], d))}
        ends = [x for x in code.args if x[0] in ("in", "out")]
        args = ends + code.args[len(ends):len(ends) + 4] + [("i64", s) for s in strides]
        if mask is not None:
            shape, st, _ = self.spec[mask]
            args += [("i64", s) for s in broadcast_strides(shape, st, full)]
            buffers["mask"] = mask
        code = dataclasses.replace(code, args=args + [("f32", a.scale)])
        self._launch(g, code, buffers)
        self._attention_viewed(a, buffers["o"])

    def _lower_decode_attention(self, g: Group, a, mask: int | None) -> None:
        """The split-KV decode pair (templates/attention.py) reading q, k, v (a KV cache state in place) and
        the mask through their strides; its fp32 workspace (each split's max, sum and partial output) two
        intermediates, placed in the arena."""
        rank = len(a.q.shape)
        bids, strides = {}, {}
        for key, x in (("q", a.q), ("k", a.k), ("v", a.v)):
            bid = self.need(x)
            if self.spec[bid][1][-1] != 1:
                bid = self.need(x, contiguous=True)
            st = self.spec[bid][1]
            bids[key], strides[key] = bid, (st[0] if rank == 4 else 0, st[-3], st[-2])
        heads, tokens, d = a.heads, a.q_len, a.head_dim
        strides["o"] = (heads * tokens * d, tokens * d, d)  # the result, contiguous
        if mask is not None:
            shape, st, _ = self.spec[mask]
            strides["mask"] = broadcast_strides(shape, st, (a.batch, heads, tokens, a.kv_len))
            bids["mask"] = mask
        name = self._name("decode_attention", g)
        for part in ("partial", "combine"):  # named after their source, as _launch names every kernel
            self.prefixes[f"{name}_{part}"] = f"decode_attention_{part}"
        pair = decode_attention_kernels(name, batch=a.batch, heads=heads,
                                        kv_heads=a.kv_heads, q_tokens=tokens, max_len=a.kv_len, head_dim=d,
                                        dtype=a.q.dtype, sms=self.sm_count, lengths=False, strides=strides,
                                        mask_dtype=None if mask is None else self.spec[mask][2])
        buffers = {**bids, "o": self._attention_result(a, (*a.q.shape[:-1], d))}
        for key, floats in (("ws_ml", pair.workspace_ml), ("ws_acc", pair.workspace_acc)):
            buffers[key] = self.b.intermediate([floats], "f32", name=f"{a.output.name}.{key}")
            self.spec[buffers[key]] = ((floats,), (1,), torch.float32)
        partial = dataclasses.replace(pair.partial, args=pair.partial.args[:-1] + [("f32", a.scale)])
        self._launch(g, partial, buffers)
        self._launch(g, pair.combine, buffers, main=False)
        self._attention_viewed(a, buffers["o"])

    def _lower_pointwise(self, g: Group) -> None:
        shape = tuple(g.params["shape"])
        outputs = g.outputs(set(self.output_ids) | self.state_values)
        inputs, buffers, body, var = self._elementwise(g.nodes, shape, rotations=True, cats=True,
                                                       relayout=g.params.get("relayout"))
        rotated = any(i.rotate for i in inputs)
        results = []
        for v in outputs:
            key = f"out{len(results)}"
            results.append((key, var[v.name], v.dtype))
        # Every result stored channels-last: the kernel runs over (N, H, W, C), each operand's strides
        # permuted alike, so its stores, and the loads of NHWC operands, are unit-stride.
        nhwc = (len(shape) == 4 and bool(outputs) and not rotated and all(
            v.name in self.channels_last and v.name not in self.output_ids and tuple(v.shape) == shape for v in outputs))
        order = (0, 2, 3, 1) if nhwc else tuple(range(len(shape)))
        if nhwc:
            inputs = [PointwiseInput(i.key, i.dtype, tuple(i.strides[d] for d in order), i.offset) if not i.pieces
                      else PointwiseInput(i.key, i.dtype, (), pieces=tuple(
                          dataclasses.replace(piece, strides=tuple(piece.strides[d] for d in order))
                          for piece in i.pieces), cat_dim=order.index(i.cat_dim)) for i in inputs]
        rows = None if rotated or not outputs or any(tuple(v.shape) != shape for v in outputs) else \
            _rows_view(tuple(shape[d] for d in order), inputs)
        if not nhwc and not rotated and _output_edge(shape, inputs, outputs):
            # A chain's output edge: NCHW results from NHWC operands, staged through shared-memory tiles
            # instead of gathered with a stride of C.
            code = pointwise_from_nhwc_kernel(self._name("fused_edge", g), shape, inputs, body, results)
        elif rows is not None and _transposed_operand(*rows):
            # [B, R, C] results (in the order iterated) from an operand stored [B, C, R]: an MLP-Mixer's
            # token MLP added back transposed, an NCHW value read by an NHWC chain's group (R = H * W).
            # The same tiles, as [B, R, C, 1] with that operand "channels-last".
            code = pointwise_from_nhwc_kernel(self._name("fused_transposed", g), (*rows[0], 1),
                                              [_with_unit_w(i) for i in rows[1]], body, results)
        else:
            code = pointwise_kernel(self._name("fused", g), tuple(shape[d] for d in order), inputs, body, results,
                                    self.sm_count)
        for (key, _, _), v in zip(results, outputs):
            buffers[key] = self.produce(v, strides=channels_last_strides(shape) if nhwc else None)
        self._launch(g, code, buffers)

    def _lower_conv_epilogue(self, g: Group, match: dict) -> None:
        """A convolution and its epilogue (planner.conv_epilogues) as one cuDNN call:
        relu(conv(x, w') + b' [+ z]) through aten::cudnn_convolution_relu or _add_relu, the inference batch
        norm folded into w' and b' (in float64, then the filter's dtype), stored as constants of the
        program's own. The filter is stored NHWC in a channels-last plan; the result takes the layout cuDNN
        gives it (NHWC when the input or the filter is)."""
        conv, bn, z = match["conv"], match["bn"], match["z"]
        x, weight = conv.args[0], conv.args[1]
        bias = match.get("bias", conv.args[2])  # the capture's bias moved after the convolution, or its own
        w = self._data(weight)
        b = self._data(bias) if bias is not None else None
        if bn is not None:
            gamma, beta, mean, var = (self._data(a) if a is not None else None for a in bn.args[1:5])
            eps = float(bn.args[6]) if len(bn.args) > 6 else float(bn.kwargs.get("eps", 1e-5))
            w, b = fold_batch_norm(w, b, gamma, beta, mean, var, eps)
        elif b is None:
            b = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)  # the op takes a bias
        nhwc = weight.name in self.channels_last
        wid, *_ = self._store_weight(w, f"{weight.name}.folded" if bn is not None else weight.name, nhwc)
        bid, *_ = self._store_weight(b, f"{conv.out.name}.bias")
        if x.name in self.channels_last:
            if x.name not in self.nhwc_copies:
                self.nhwc_copies[x.name] = self._channels_last_copy(x, g)
            xid = self.nhwc_copies[x.name]
        else:
            xid = self.need(x)
        out = match["out"]
        x_nhwc = is_channels_last(*self.spec[xid][:2])
        strides = channels_last_strides(out.shape) if (x_nhwc or nhwc) and len(out.shape) == 4 else None
        geometry = {"stride": list(conv.args[3]), "padding": list(conv.args[4]), "dilation": list(conv.args[5]),
                    "groups": int(conv.args[8])}
        if z is None:
            op = "aten::cudnn_convolution_relu"
            self.b.aten(op, [xid, wid, bid], [self.produce(out, strides=strides)], **geometry)
        else:
            op = "aten::cudnn_convolution_add_relu"
            # The residual in the input's layout where the program holds it so (a block's input is often
            # both x and z): given NCHW beside an NHWC x, the op would make its own channels-last copy.
            zid = self.nhwc_copies[z.name] if x_nhwc and z.name in self.nhwc_copies else self.need(z)
            self.b.aten(op, [xid, wid, zid, bid], [self.produce(out, strides=strides)], alpha=1.0, **geometry)
        self.on_aten[id(g)] = f"fused with its convolution in cuDNN's {op.removeprefix('aten::')}"

    def _channels_last_copy(self, v: Value, g: Group) -> int:
        """`v`'s buffer converted to channels-last by one generated copy (the edge of a convolution chain:
        a program input, or a result some step wrote contiguous)."""
        bid = self.need(v)
        shape, strides, dtype = self.spec[bid]
        if tuple(strides) == channels_last_strides(shape):  # already NHWC (or C = 1, H = W = 1)
            return bid
        order = (0, 2, 3, 1)
        if tuple(strides) == _contiguous_strides(shape) and dtype in FUSABLE_DTYPES and shape[0] <= 65535:
            # The usual edge, a contiguous NCHW value: a tiled transpose, coalesced on both sides.
            code = nchw_to_nhwc_kernel(self._name("to_nhwc", g), tuple(shape), dtype)
        else:  # any other strides: an elementwise copy in NHWC order, its reads gathered
            code = pointwise_kernel(self._name("to_nhwc", g), tuple(shape[d] for d in order),
                                    [PointwiseInput("in0", dtype, tuple(strides[d] for d in order))], [],
                                    [("out0", "in0", dtype)], self.sm_count)
        out = self.b.intermediate(list(shape), dtype_name(dtype), strides=list(channels_last_strides(shape)),
                                  name=f"{v.name}.nhwc")
        self.spec[out] = (tuple(shape), channels_last_strides(shape), dtype)
        self._launch(g, code, {"in0": bid, "out0": out}, main=False)
        return out

    def _elementwise(self, nodes: list[Node], shape: tuple[int, ...], known: dict[str, str] | None = None,
                     prefix: str = "in", rotations: bool = False, cats: bool = False, relayout: dict | None = None
                     ) -> tuple[list[PointwiseInput], dict[str, int], list[str], dict[str, str]]:
        """C statements computing `nodes` (elementwise, over `shape`) as float variables t0..: the inputs
        they read (keys {prefix}0.., strides over `shape`), their buffers, the statements, and each value's
        variable. `known` maps values the kernel already holds (a reduction's statistic) to C variables.
        `relayout` (planner._relaid_out_copies): its first `computed` nodes compute over its own `shape`,
        their operands' strides taken through the views of its `chain` to `shape`, the chain's nodes alias."""
        body = _ElementwiseBody(self, shape, known, prefix, relayout)
        for j, n in enumerate(nodes):
            body.add(j, n, rotations, cats)
        return body.inputs, body.buffers, body.lines, body.var

    def _lower_view(self, g: Group) -> None:
        n = g.nodes[0]
        src = n.args[0]
        sbid = self.need(src)
        sshape, sstrides, dtype = self.spec[sbid]
        if n.op in _SPLIT_OPS:
            self._lower_split(n, sbid, sshape, sstrides, dtype)
            return
        out = n.out
        result = _view_layout(n, sshape, sstrides)
        if result is not None and out.name not in self.output_ids:
            shape, strides, offset = result
            kind = "permute" if n.op in ("aten::permute", "aten::transpose.int", "aten::t") else \
                "slice" if n.op in ("aten::slice.Tensor", "aten::select.int") else "reshape"
            if kind == "reshape" and (tuple(strides) != _contiguous_strides(shape)
                                      or tuple(sstrides) != _contiguous_strides(sshape)):
                # A strided reshape (a squeeze of a slice, a split of a column slice's rows): the IR's
                # general strided view; its reshape kind is for contiguous source and result only.
                kind = "slice"
            bid = self.b.view(kind, sbid, list(shape), strides=list(strides), storage_offset=offset)
            self._record(out, bid, shape, strides, dtype)
            return
        if result is None and n.op in _RESHAPES and out.name not in self.output_ids:
            # The capture traced a view of a layout the program's buffer does not have: an ATen view step
            # would fail at run time, so the source is copied contiguous and viewed.
            sbid = self.need(src, contiguous=True)
            shape, strides, offset = _view_layout(n, *self.spec[sbid][:2])
            bid = self.b.view("reshape", sbid, list(shape), strides=list(strides), storage_offset=offset)
            self._record(out, bid, shape, strides, dtype)
            return
        self._lower_aten(n, captured_layout=False)

    def _lower_split(self, n: Node, sbid: int, shape, strides, dtype) -> None:
        """Every piece of a split or unbind at once: views of the source, unless a piece is a graph output
        (outputs own their buffers), in which case the ATen step copies them all."""
        for v in n.outputs:
            if v is not None:
                self.pending.pop(v.name, None)
        layouts = _split_layouts(n, shape, strides)
        used = [(v, layout) for v, layout in zip(n.outputs, layouts) if v is not None]
        if len(layouts) != len(n.outputs) or any(v.name in self.output_ids for v, _ in used) or \
                any(tuple(v.shape) != layout[0] for v, layout in used):
            self._lower_aten(n, captured_layout=False)
            return
        for v, (piece, piece_strides, offset) in used:
            bid = self.b.view("slice", sbid, list(piece), strides=list(piece_strides), storage_offset=offset)
            self._record(v, bid, piece, piece_strides, dtype)

    def _lower_aten(self, n: Node, captured_layout: bool = True, group: Group | None = None) -> None:
        """`n` as an ATen step. Its results keep the layout the capture saw (see `produce`), except for a
        view op that could not be a view step: its result is a copy, planned contiguous. A step reading a
        channels-last buffer gets the layout ATen gives its result for those inputs (a convolution over
        NHWC data returns NHWC), so the result is used where it lies instead of copied; a convolution of a
        channels-last plan reads its input converted once (graph/layout.py)."""
        nhwc_input = None
        if (group is not None and n.op == "aten::convolution" and isinstance(n.args[0], Value)
                and n.args[0].name in self.channels_last):
            x = n.args[0]
            if x.name not in self.nhwc_copies:
                self.nhwc_copies[x.name] = self._channels_last_copy(x, group)
            nhwc_input = (x.name, self.nhwc_copies[x.name])
        schema = n.target._schema
        inputs: list[int] = []
        attributes: dict[str, Any] = {}
        positional = list(n.args)
        arguments = list(schema.arguments)
        tensor_positions = [i for i, a in enumerate(arguments) if "Tensor" in str(a.type)]
        for i, arg in enumerate(arguments):
            if i < len(positional) and not arg.kwarg_only:
                value = positional[i]
            elif arg.name in n.kwargs:
                value = n.kwargs[arg.name]
            else:
                continue  # the schema's default
            t = str(arg.type)
            if "Tensor" in t:
                if isinstance(value, Value):
                    inputs.append(nhwc_input[1] if nhwc_input and value.name == nhwc_input[0] else self.need(value))
                elif isinstance(value, (bool, int, float)):
                    # A number where the schema takes a tensor (x / 2 traced as div.Tensor(x, 2.0)): a 0-dim
                    # constant, which ATen's type promotion treats as it treats the number (a dimensioned
                    # operand of the same kind keeps its dtype), so fp64/int64 lose nothing.
                    dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) \
                        else torch.float64
                    inputs.append(self.b.weight(torch.tensor(value, dtype=dtype), name=f"{n.name}.{arg.name}"))
                elif isinstance(value, (list, tuple)):
                    if any(v is None for v in value):  # Tensor?[]: x[:, idx] is index.Tensor(x, [None, idx])
                        attributes[f"{arg.name}:present"] = [int(v is not None) for v in value]
                    inputs.extend(self.need(v) for v in value if v is not None)
                    if sum(str(a.type) == "List[Tensor]" for a in arguments) > 1:
                        attributes[f"{arg.name}:count"] = len(value)  # lstm: hx, then params
                elif value is None and any(p > i for p in tensor_positions):
                    attributes[arg.name] = "none"
                continue
            if value is None:
                continue
            if isinstance(value, torch.memory_format):
                continue  # only strides: the step's result is copied into its planned buffer anyway
            if isinstance(value, torch.layout):
                if value != torch.strided:
                    raise LoweringError(f"{n.op}: layout {value} is not supported (programs hold strided tensors)")
                continue  # the default
            attributes[arg.name] = _attribute(value, n, arg.name)
        if id(n) in self.updates:
            self._update_in_place(n, inputs, attributes)
            return
        layouts = self._aten_result_strides(n, nhwc_input) if captured_layout else None
        outs = []
        for k, v in enumerate(n.outputs):
            if v is None:
                raise LoweringError(f"{n.op} returns a non-tensor value: no buffer can hold it")
            outs.append(self.produce(v, captured_layout=captured_layout,
                                     strides=layouts[k] if layouts and k < len(layouts) else None))
        self.b.aten(n.op, inputs, outs, **attributes)

    def _aten_result_strides(self, n: Node, nhwc_input: tuple[str, int] | None) -> list[tuple[int, ...] | None] | None:
        """The strides ATen gives `n`'s results for its inputs' buffer layouts (the op run on meta tensors),
        when some input is channels-last; None otherwise, or when the op has no meta kernel."""
        specs: dict[str, tuple] = {}

        def spec(v: Value) -> tuple:
            bid = nhwc_input[1] if nhwc_input and v.name == nhwc_input[0] else self.buf.get(v.name)
            return self.spec[bid] if bid is not None else (tuple(v.shape), _contiguous_strides(v.shape), v.dtype)

        for a in list(n.args) + list(n.kwargs.values()):
            for v in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(v, Value):
                    specs[v.name] = spec(v)
        if not any(is_channels_last(shape, strides) for shape, strides, _ in specs.values()):
            return None
        if n.op == "aten::convolution" and len(n.out.shape) == 4:
            # cuDNN's rule (ATen's meta kernel answers for the CPU's): NHWC results when the input or the
            # filter is NHWC.
            return [channels_last_strides(n.out.shape)]

        def meta(a):
            if isinstance(a, Value):
                shape, strides, dtype = specs[a.name]
                return torch.empty_strided(shape, strides, dtype=dtype, device="meta")
            if isinstance(a, (list, tuple)):
                return type(a)(meta(x) for x in a)
            return a

        try:
            with torch.no_grad():
                result = n.target(*[meta(a) for a in n.args], **{k: meta(a) for k, a in n.kwargs.items()})
        except Exception:  # no meta kernel: the captured layout stands
            return None
        results = result if isinstance(result, (list, tuple)) else [result]
        return [tuple(r.stride()) if isinstance(r, torch.Tensor) else None for r in results]



class _ElementwiseBody:
    """Lowering._elementwise's statements, one node at a time: each operand read once per way it is read
    (broadcast, per channel, rotated) as an input of the kernel, with its buffer."""

    def __init__(self, lowering: Lowering, shape: tuple[int, ...], known: dict[str, str] | None, prefix: str,
                 relayout: dict | None) -> None:
        self.lowering, self.shape, self.rank, self.prefix, self.relayout = lowering, shape, len(shape), prefix, relayout
        self.inputs: list[PointwiseInput] = []
        self.buffers: dict[str, int] = {}
        self.var: dict[str, str] = dict(known or {})
        self.keyed: dict[tuple[str, str, bool], str] = {}
        self.chain = {id(n) for n in relayout["chain"]} if relayout else set()
        self.relaid = False  # whether the node being lowered computes over relayout["shape"]
        self.lines: list[str] = []

    def add(self, j: int, n: Node, rotations: bool, cats: bool) -> None:
        self.relaid = bool(self.relayout) and j < self.relayout["computed"]
        if id(n) in self.chain:  # a view of the value computed in this layout: the same variable
            self.var[n.out.name] = self.var[n.args[0].name]
            return
        if in_place_cat(n):
            if not cats:
                raise LoweringError("a concatenation is read in place by elementwise kernels only")
            expr = self.concatenation(n)
        elif rotate_half_source(n) is not None:
            rotation = rotate_half_source(n)  # RoPE's rotate_half(x): x read with its halves swapped, the first negated
            if not rotations or rotation[0].name in self.var:
                raise LoweringError("rotate_half reads its input from memory, in elementwise kernels only")
            expr = self.operand(rotation[0], "rotate")
        else:
            expr = self.expression(n)
        self.lines.append(f"const float t{j} = {expr};")
        self.var[n.out.name] = f"t{j}"

    def expression(self, n: Node) -> str:
        """The C expression of one elementwise node, its result rounded as its dtype rounds."""
        batch_norm = n.op == "aten::_native_batch_norm_legit_no_training"
        args = []
        for k, a in enumerate(n.args):
            if isinstance(a, Value):
                args.append(self.operand(a, "channel" if batch_norm and k in (1, 2, 3, 4) else "broadcast"))
            elif a is None:
                args.append(None)
            else:
                s = _scalar_literal(a)
                args.append(s if s is not None else a)
        kwargs = {}
        for k, a in n.kwargs.items():
            if isinstance(a, Value):
                kwargs[k] = self.operand(a)
            else:
                s = _scalar_literal(a)
                kwargs[k] = s if s is not None else a
        expr = POINTWISE_OPS[n.op](args, kwargs)
        out = n.out
        if n.op == "aten::_to_copy" and out.dtype == torch.float16:
            expr = f"__half2float(__float2half_rn({expr}))"
        elif n.op == "aten::_to_copy" and out.dtype == torch.bfloat16:
            expr = f"__bfloat162float(__float2bfloat16_rn({expr}))"
        elif out.dtype == torch.bool:
            expr = f"(({expr}) != 0.0f ? 1.0f : 0.0f)"
        return expr

    def operand(self, v: Value, mode: str = "broadcast") -> str:
        if v.name in self.var and mode == "broadcast":
            return self.var[v.name]
        if (v.name, mode, self.relaid) in self.keyed:
            return self.keyed[(v.name, mode, self.relaid)]
        bid = self.lowering.need(v)
        vshape, vstrides, vdtype = self.lowering.spec[bid]
        over = tuple(self.relayout["shape"]) if self.relaid else self.shape
        if mode == "channel":  # batch norm parameters: [C] along dimension 1
            strides = [0] * len(over)
            strides[1] = vstrides[0] if vshape[0] != 1 else 0
        else:
            strides = list(broadcast_strides(tuple(vshape), tuple(vstrides), over))
        if self.relaid:
            moved = relayout_strides(over, tuple(strides), self.relayout["chain"])
            if moved is None or len(moved) != self.rank:
                raise LoweringError(f"'{v.name}' (strides {tuple(vstrides)}) cannot be read through the views "
                                    "of the copy its chain is computed in")
            strides = list(moved)
        key = f"{self.prefix}{len(self.inputs)}"
        self.inputs.append(PointwiseInput(key, vdtype, tuple(strides), rotate=vshape[-1] // 2 if mode == "rotate" else 0))
        self.buffers[key] = bid
        self.keyed[(v.name, mode, self.relaid)] = key
        return key

    def concatenation(self, n: Node) -> str:
        """A concatenation read in place: one input whose pieces are loaded by range (planner: the cat has
        the group's shape, so each piece's strides are its own over the group's dimensions)."""
        pieces, start = [], 0
        dim = int(n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % self.rank
        key = f"{self.prefix}{len(self.inputs)}"
        for j, v in enumerate(n.args[0]):
            if not v.numel:
                continue  # an empty piece covers no range (and a legacy empty 1-D one has another rank)
            bid = self.lowering.need(v)
            vshape, vstrides, _ = self.lowering.spec[bid]
            if len(vshape) != self.rank:
                raise LoweringError(f"concatenation piece '{v.name}' of rank {len(vshape)} in a group of rank {self.rank}")
            pieces.append(CatPiece(f"{key}_{j}", tuple(vstrides), start, start + vshape[dim]))
            self.buffers[f"{key}_{j}"] = bid
            start += vshape[dim]
        self.inputs.append(PointwiseInput(key, n.out.dtype, (), pieces=tuple(pieces), cat_dim=dim))
        return key

def _scalar_literal(a) -> str | None:
    from .templates.ops import scalar_literal

    return scalar_literal(a)


def fold_batch_norm(w: torch.Tensor, b: torch.Tensor | None, gamma: torch.Tensor | None, beta: torch.Tensor | None,
                    mean: torch.Tensor, var: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """An inference batch norm after a convolution, folded into its filter and bias: with
    s = gamma / sqrt(var + eps), conv(x, w * s) + (b - mean) * s + beta equals the batch norm of
    conv(x, w) + b. Computed in float64, returned in the filter's dtype."""
    scale = (var.double() + eps).rsqrt() * (gamma.double() if gamma is not None else 1.0)
    shift = (beta.double() if beta is not None else 0.0) - mean.double() * scale
    bias = (b.double() * scale if b is not None else 0.0) + shift
    return (w.double() * scale.view(-1, *([1] * (w.dim() - 1)))).to(w.dtype), bias.to(w.dtype)


def _attribute(value: Any, node: Node, name: str) -> Any:
    if isinstance(value, torch.dtype):
        try:
            return dtype_name(value)
        except TypeError as exc:
            raise LoweringError(f"{node.op}: argument '{name}' is {value}, which programs cannot hold") from exc
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        return list(value)
    raise LoweringError(f"{node.op}: argument '{name}' = {value!r} cannot be expressed as a program attribute")


def _read_by(prologue: list[Node], nodes: list[Node], values: list[Value] = ()) -> list[Node]:
    """The prologue's nodes whose values `nodes` read, directly or through each other, and those making
    `values`, in prologue order."""
    made_by = {v.name: n for n in prologue for v in n.outputs if v is not None}
    wanted: set[int] = {id(made_by[v.name]) for v in values if v.name in made_by}
    stack = [made_by[v.name] for n in [*nodes, *(made_by[v.name] for v in values if v.name in made_by)]
             for v in n.inputs if v.name in made_by]
    while stack:
        n = stack.pop()
        if id(n) not in wanted:
            wanted.add(id(n))
            stack += [made_by[v.name] for v in n.inputs if v.name in made_by]
    return [n for n in prologue if id(n) in wanted]


_SPLIT_OPS = ("aten::split_with_sizes", "aten::split.Tensor", "aten::unbind.int")
_RESHAPES = ("aten::view", "aten::_unsafe_view", "aten::reshape")


def _dense_permutation(shape, strides) -> bool:
    """Whether `strides` lay `shape` out with no gaps or overlaps (contiguous after some permutation)."""
    dims = sorted((st, ex) for ex, st in zip(shape, strides) if ex != 1)
    expected = 1
    for st, ex in dims:
        if st != expected:
            return False
        expected *= ex
    return True


def _split_layouts(n: Node, shape, strides) -> list[tuple[tuple, tuple, int]]:
    """(shape, strides, storage offset) of each piece of a split or unbind: every piece is a view."""
    rank = len(shape)
    dim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) if n.op != "aten::unbind.int" else \
        (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0))
    dim %= rank
    if n.op == "aten::unbind.int":
        rest = tuple(s for d, s in enumerate(shape) if d != dim), tuple(t for d, t in enumerate(strides) if d != dim)
        return [(rest[0], rest[1], i * strides[dim]) for i in range(shape[dim])]
    if n.op == "aten::split.Tensor":
        size = int(n.args[1])
        sizes = [min(size, shape[dim] - start) for start in range(0, shape[dim], size)] or [0]
    else:
        sizes = [int(x) for x in n.args[1]]
    pieces, start = [], 0
    for size in sizes:
        piece = list(shape)
        piece[dim] = size
        pieces.append((tuple(piece), tuple(strides), start * strides[dim]))
        start += size
    return pieces


def _view_layout(n: Node, shape, strides):
    """(shape, strides, storage offset) of a view of a buffer with `shape`/`strides`, or None when the
    layout does not allow a view without a copy."""
    rank = len(shape)
    contiguous = tuple(strides) == _contiguous_strides(shape)
    op, args = n.op, n.args
    out_shape = n.out.shape
    if op in ("aten::view", "aten::_unsafe_view", "aten::reshape", "aten::alias", "aten::unsqueeze",
              "aten::squeeze.dim", "aten::squeeze.dims", "aten::squeeze"):
        if contiguous:
            return out_shape, _contiguous_strides(out_shape), 0
        # A strided source: ATen's own rule (view() on a meta tensor of that layout) says whether the new
        # shape is a view and with which strides (a squeeze of a sliced, permuted buffer always is).
        try:
            viewed = torch.empty_strided(tuple(shape), tuple(strides), device="meta").view(tuple(out_shape))
        except RuntimeError:
            return None
        return out_shape, tuple(viewed.stride()), 0
    if op == "aten::permute":
        dims = [d % rank for d in args[1]]
        return tuple(shape[d] for d in dims), tuple(strides[d] for d in dims), 0
    if op == "aten::transpose.int":
        d0, d1 = args[1] % rank, args[2] % rank
        s, t = list(shape), list(strides)
        s[d0], s[d1], t[d0], t[d1] = s[d1], s[d0], t[d1], t[d0]
        return tuple(s), tuple(t), 0
    if op == "aten::t":
        return tuple(reversed(shape)), tuple(reversed(strides)), 0
    if op == "aten::expand":
        # Only an expand that broadcasts nothing is a view the program can hold (stride-0 buffers would
        # alias); a real broadcast is materialized by the ATen step, and fused kernels broadcast by strides.
        new = [int(e) for e in args[1]]
        lead = len(new) - rank
        if lead == 0 and all(e == -1 or e == s for e, s in zip(new, shape)) and contiguous:
            return tuple(shape), tuple(strides), 0
        return None
    if op == "aten::slice.Tensor":
        dim = args[1] % rank if len(args) > 1 else 0
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        step = args[4] if len(args) > 4 else 1
        start = max(0, min(start + shape[dim] if start < 0 else start, shape[dim]))
        t = list(strides)
        t[dim] = strides[dim] * step
        return out_shape, tuple(t), start * strides[dim]
    if op == "aten::select.int":
        dim, index = args[1] % rank, args[2]
        index = index + shape[dim] if index < 0 else index
        t = [s for d, s in enumerate(strides) if d != dim]
        return out_shape, tuple(t), index * strides[dim]
    return None


def check_group(graph: Graph, plan: GraphPlan, group: Group, values: dict[str, torch.Tensor],
                constants: dict[str, torch.Tensor], sm_count: int,
                pool: Any = None, stats: dict | None = None,
                memo: dict | None = None, room: int | None = None) -> tuple[bool, str, KernelCode | None]:
    """Runs `group` alone as a program on recorded inputs and compares with ATen's recorded outputs:
    returns (ok, why, the group's generated kernel or None).

    Lowering builds the group's program; the Verifier judges it (verify.program.check_program) under
    the tolerance table for the plan's precision. With `pool` (a stitchcuda.verify.WorkerPool) the
    program runs in the Verifier's isolated worker, saved as an artifact with its CUBINs: a fault, a
    hang or a crash of generated code is a fallback reason, never the caller's process. Without it, in
    this process (generated templates only). `stats` receives the worker's GPU memory for the check
    (verify.program.check_program). With `memo`, a group whose program is the same as one checked
    before (the same kernels over the same shapes: every layer's copy of a block's norm) takes that
    check's verdict instead of running again, and `stats["shared"]` says so; the whole program is still
    verified against the model. `room`: the bytes this check may allocate beside what is allocated
    already (None: no limit); when the program's outputs and its planned working memory (its buffer plan:
    arena and the largest set of other intermediates alive at one step) would pass it, recorded outputs of
    HOST_REFERENCE_BYTES or more take the program's output in their own memory while their values wait in
    host memory (verify.program.check_program's in_place_from), so the check holds one tensor of that
    size, not two. A group whose 16-bit (or reduced-policy) outputs differ from ATen's is judged again by
    the accuracy rule against its subgraph in fp64 (graph/accuracy.py), which decides."""
    outputs_all = {v.name for v in (*graph.outputs, *graph.state_values.values())}
    # The group's weights and constants are inputs of its program too, fed like the recorded values
    # (through CUDA IPC with a pool), not bytes in its artifact: the worker would upload a copy of each,
    # and a projection's weight is as large as its activations. Its kernels are the same either way:
    # lowering inlines no weight's values.
    inputs = group_inputs(group)
    outputs = group.outputs(outputs_all)
    lowering = Lowering(graph, plan, constants, sm_count)
    key = None
    try:
        program = lowering.build([group], inputs, outputs)
        code = lowering.main_kernels.get(id(group))
        key = _check_key(program) if memo is not None else None
        if key is not None and key in memo:
            if stats is not None:
                stats["shared"] = True
            return (*memo[key], code)
        if pool is not None:
            program.compile_kernels()  # the worker loads CUBINs, compiles nothing
    except Exception as exc:  # a compile error is a fallback reason, not a crash
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if key is not None:
            memo[key] = (False, why)
        return False, why, None
    feed = [(v.data.detach() if v.kind in ("weight", "state") else constants[v.name] if v.name in constants
             else values[v.name]).contiguous() for v in inputs]
    wants = [values[v.name] for v in outputs]
    # A template convolution is judged as the whole program is: against ATen's, which may have run with TF32.
    judged = plan.tolerance_precision if group.kind == "conv" else plan.precision
    tolerances = [tolerance(v.dtype, judged) for v in outputs]
    in_place_from = 0
    if room is not None and sum(t.numel() * t.element_size() for t in wants) + working_bytes(program) > room:
        in_place_from = HOST_REFERENCE_BYTES
    ok, why = check_program(program, feed, wants, tolerances, [v.name for v in outputs], pool=pool, reference="ATen",
                            stats=stats, in_place_from=in_place_from)
    rule = rule_precision(group, judged)
    if not ok and "differs from ATen" in why and any(by_accuracy(v.dtype, rule) for v in outputs):
        # 16-bit values or a reduced policy: ATen's rounding is not the truth (graph/accuracy.py)
        got = candidate_outputs(program, feed, wants, pool)
        again = None if got is None else judge_group(
            group, got, feed, inputs, outputs, wants, tolerances, rule,
            None if room is None else room - 2 * sum(t.numel() * t.element_size() for t in wants),
            known={**values, **constants})
        if again is not None:
            ok, why = again
        del got
    if key is not None:
        memo[key] = (ok, why if ok else f"{why} (checked on an identical group's values)")
    return ok, why, code


def working_bytes(program: Program) -> int:
    """The GPU memory a run of `program` plans for beside its inputs and outputs: its arena plus the most
    bytes of storages outside it (ATen results, large intermediates) alive at one step."""
    plan = program.buffer_plan()
    outside = [p for p in plan["placements"] if not p["in_arena"] and p["buffer"] == p["storage"]]
    widest = max((sum(p["bytes"] for p in outside if p["first_step"] <= step <= p["last_step"])
                  for step in range(len(program.steps))), default=0)
    return int(plan["arena_bytes"]) + widest


def group_inputs(group: Group) -> list[Value]:
    """The values `group`'s program reads: its nodes' inputs, except that a GEMM reads the operands its
    plan chose (a weight for its transposed view, one matrix for its expansion over a batch), not the
    views it was traced on (an expanded weight made contiguous to feed a check can be gigabytes)."""
    if group.kind == "attention":  # q, k, v and the mask: not the constants of a causal mask it found
        return list(group.params["inputs"])
    if group.kind != "gemm":
        return list(group.inputs())
    p = group.params
    produced = {v.name for n in group.nodes for v in n.outputs if v is not None}
    chosen = [p["a"], p["b"]] + ([p["bias"]] if isinstance(p.get("bias"), Value) else [])
    traced = {v.name for v in group.nodes[0].inputs}
    rest = [v for v in group.inputs() if v.name not in traced and v.name not in produced]
    seen: dict[str, Value] = {}
    for v in chosen + rest:
        seen.setdefault(v.name, v)
    return list(seen.values())


def _check_key(program: Program) -> str | None:
    """What makes two group checks the same check: the group program's buffers (role, shape, strides,
    dtype), steps and kernel sources, value names aside. None when it stores a weight (values of its own,
    which may differ)."""
    buffers = program.buffers
    if any(b["role"] == "weight" for b in buffers):
        return None
    layout = [(b["role"], list(b["shape"]), list(b["strides"]), b["dtype"]) for b in buffers]
    return json.dumps([layout, program.steps, [k["source"] for k in program.kernels]], sort_keys=True, default=str)
