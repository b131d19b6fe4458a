"""Capture: a live nn.Module and example inputs -> a core-ATen dataflow graph the Planner can partition.

`torch.export` (non-strict) traces the module; `run_decompositions()` lowers it to core ATen. The result
mirrors the program layer's graph IR (`stitchcuda::program::Graph`): values (user inputs, weights,
node results) with shape, strides and dtype, and nodes (an ATen op with tensor inputs and non-tensor
arguments). What cannot be captured raises CaptureError with the reason and what to do.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import re
import sys
from operator import getitem

import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

from ..log import get_logger
from ..settings import settings
from .hoist_index import hoist_indexing, indexing_note

__all__ = ["CaptureError", "Value", "Node", "Graph", "capture", "state_updates", "INPLACE_UPDATES", "AUTOCAST_DEVICES", "autocast_in_effect", "autocast_as",
           "under_autocast", "warn_other_autocast", "export_program", "is_transformers_model"]


class CaptureError(Exception):
    """The model could not be captured; the message says why and what to do."""


@dataclass
class Value:
    """A tensor in the graph."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # "input", "weight", "state" (a buffer the forward updates: a KV cache), "node"
    storage_offset: int = 0
    data: torch.Tensor | None = None  # weights: the tensor
    producer: "Node | None" = None
    users: list["Node"] = field(default_factory=list)

    @property
    def numel(self) -> int:
        n = 1
        for e in self.shape:
            n *= e
        return n

    def is_contiguous(self) -> bool:
        expected = 1
        for extent, stride in zip(reversed(self.shape), reversed(self.strides)):
            if extent != 1 and stride != expected:
                return False
            expected *= extent
        return True


@dataclass
class Node:
    """One ATen op: `op` is "aten::name" or "aten::name.overload"; `args` mirror the call with Values in
    place of tensors; `outputs` are the values it produces (several for e.g. native_layer_norm)."""

    name: str
    op: str
    target: Any  # the torch OpOverload
    args: tuple
    kwargs: dict
    outputs: list[Value | None]

    @property
    def inputs(self) -> list[Value]:
        found: list[Value] = []

        def visit(a):
            if isinstance(a, Value):
                if a not in found:
                    found.append(a)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    visit(x)

        visit(self.args)
        visit(tuple(self.kwargs.values()))
        return found

    @property
    def out(self) -> Value:
        assert self.outputs[0] is not None
        return self.outputs[0]


@dataclass
class Graph:
    """A captured forward: user inputs in call order, weights, nodes in topological order, outputs."""

    inputs: list[Value]
    weights: list[Value]
    nodes: list[Node]
    outputs: list[Value]
    out_spec: Any  # pytree spec to rebuild the module's output structure
    in_spec: Any
    exported: Any  # the ExportedProgram (for the reference interpreter)
    notes: list[tuple[str, str]] = field(default_factory=list)  # what capture decided, for the report
    # The output's leaves that are not tensors (a number, a string, None), by position among all leaves.
    output_constants: dict[int, Any] = field(default_factory=dict)
    # The torch.autocast the model was captured under, (device type, dtype), or None: its casts are the
    # graph's own _to_copy nodes, so the graph (and the program) computes that autocast's forward.
    autocast: tuple[str, torch.dtype] | None = None
    # Buffers the forward updates (a static KV cache), kind "state", data the model's buffer itself; for
    # each, by name, the value the forward leaves in it, and where that value is an update of the state
    # computable in place (INPLACE_UPDATES), the node computing it: the program writes it into the state and
    # its readers read the state. Any other new value is copied into the state at the end of the program.
    states: list[Value] = field(default_factory=list)
    state_values: dict[str, Value] = field(default_factory=dict)
    state_updates: dict[str, Node] = field(default_factory=dict)
    state_buffers: dict[str, str] = field(default_factory=dict)  # a state's value name -> the model's buffer name

    def output_leaves(self, tensors: Sequence[Any]) -> list[Any]:
        """All the output's leaves in order: `tensors` (the outputs' values) with the constants put back."""
        given = iter(tensors)
        total = len(self.outputs) + len(self.output_constants)
        return [self.output_constants[k] if k in self.output_constants else next(given) for k in range(total)]

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts

    def working_set_bytes(self) -> int:
        """The eager forward's peak of live intermediate memory, estimated from the graph alone: nodes run
        in order, each value allocated when produced and freed after its last reader (outputs live to the
        end); a view allocates nothing and keeps its source alive while it is read. Inputs and weights are
        not counted (they exist before the forward). What optimize() plans its own memory against."""
        base: dict[str, str] = {}  # a view's value -> the value that owns its memory
        size: dict[str, int] = {}
        for n in self.nodes:
            for v in n.outputs:
                if v is None:
                    continue
                src = n.inputs[0] if n.inputs and n.op in VIEW_OPS else None
                if src is not None and src.kind == "node":
                    base[v.name] = base.get(src.name, src.name)
                elif src is None:
                    size[v.name] = v.numel * v.dtype.itemsize
        last: dict[str, int] = {}
        for i, n in enumerate(self.nodes):
            for v in n.inputs:
                owner = base.get(v.name, v.name)
                if owner in size:
                    last[owner] = i
        end = len(self.nodes)
        for v in self.outputs:
            owner = base.get(v.name, v.name)
            if owner in size:
                last[owner] = end
        live = peak = 0
        for i, n in enumerate(self.nodes):
            for v in n.outputs:
                if v is not None and v.name in size:
                    live += size[v.name]
            peak = max(peak, live)
            for v in n.outputs:  # produced and never read: freed at once
                if v is not None and v.name in size and v.name not in last:
                    live -= size[v.name]
            for name in {base.get(v.name, v.name) for v in n.inputs}:
                if last.get(name) == i:
                    live -= size[name]
        return peak

    def largest_tensor_bytes(self) -> int:
        """The largest input, weight or value of the forward, in bytes."""
        values = [*self.inputs, *self.weights, *(v for n in self.nodes for v in n.outputs if v is not None)]
        return max((v.numel * v.dtype.itemsize for v in values), default=0)


# Ops whose result is a view of their first argument (the planner's view groups; the working-set
# estimate allocates nothing for them).
VIEW_OPS = frozenset({"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::alias", "aten::permute",
                      "aten::transpose.int", "aten::t", "aten::unsqueeze", "aten::squeeze.dim", "aten::squeeze.dims",
                      "aten::squeeze", "aten::expand", "aten::slice.Tensor", "aten::select.int",
                      "aten::split_with_sizes", "aten::split.Tensor", "aten::unbind.int"})


def op_name(target: Any) -> str:
    """"aten::addmm" for aten.addmm.default, "aten::add.Tensor" for aten.add.Tensor."""
    schema = target._schema
    return schema.name + (f".{schema.overload_name}" if schema.overload_name else "")


def _meta(val: Any, name: str) -> tuple:
    if not isinstance(val, torch.Tensor):
        raise CaptureError(f"value '{name}' is a {type(val).__name__}, not a tensor: StitchCUDA programs pass "
                           "tensors between steps (return tensors from forward)")
    if any(not isinstance(s, int) for s in val.shape):
        raise CaptureError(f"value '{name}' has a symbolic shape {tuple(val.shape)}: capture with static shapes")
    return tuple(int(s) for s in val.shape), tuple(int(s) for s in val.stride()), val.dtype, int(val.storage_offset())


# Operators kept whole rather than lowered to core ATen: each runs as one library call (an ATen step)
# that beats what its decomposition would become. scaled_dot_product_attention dispatches to the flash
# or memory-efficient attention kernels (one kernel, scores never in memory); its decomposition is two
# batched GEMMs around a softmax over a materialized [batch, heads, seq, seq] score tensor, plus the
# any/where/full_like steps that guard fully masked rows. The recurrent layers (LSTM, GRU, RNN) run as
# cuDNN's persistent recurrence kernels; decomposed, a 6-layer LSTM over 512 steps unrolls into ~3,000
# matmuls and ~30,000 pointwise ops, thousands of groups to generate and check, slower when done.
KEPT_WHOLE = ("scaled_dot_product_attention.default", "lstm.input", "gru.input", "rnn_tanh.input", "rnn_relu.input",
              "index_copy.default")
# index_copy (a KV cache written at cache_position) is kept too: its decomposition, index_put with None
# indices for the leading dims, has no in-place form a program step can run.

# The functional updates whose result can become a state's new value in place: op -> how the program
# writes it (an in-place overload over the state, or a copy into a slice of it).
INPLACE_UPDATES = {"aten::index_copy": "aten::index_copy_", "aten::copy": "aten::copy_",
                   "aten::slice_scatter": "aten::copy_"}


def _recurrent_outputs(op):
    """The outputs an LSTM/GRU/RNN call returns, made directly from the shapes of its arguments (values
    are never read: only the capture's fake tensors reach it)."""
    names = [a.name for a in op._schema.arguments]

    def outputs(*args, **kwargs):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        x, hx = bound["input"], bound["hx"]
        states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
        directions = 2 if bound["bidirectional"] else 1
        # (seq, batch) or (batch, seq) as the input has them; the features of h, per direction
        out = x.new_empty((x.shape[0], x.shape[1], states[0].shape[2] * directions))
        return (out, *(s.new_empty(s.shape) for s in states))

    return outputs


_RECURRENT = ("lstm.input", "gru.input", "rnn_tanh.input", "rnn_relu.input")


def _on_meta(a: Any) -> Any:
    """fx arguments with every node replaced by a meta tensor of its recorded shape, strides and dtype."""
    if isinstance(a, torch.fx.Node):
        v = a.meta.get("val")
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta") \
            if isinstance(v, torch.Tensor) else v
    if isinstance(a, (list, tuple)):
        return type(a)(_on_meta(x) for x in a)
    if isinstance(a, dict):
        return {k: _on_meta(v) for k, v in a.items()}
    return a


@contextlib.contextmanager
def _recurrent_shapes_only():
    """While tracing, recurrent layers kept whole compute their outputs' shapes directly. Otherwise the
    trace runs torch's Python decomposition of each (registered for autograd, meta and composite keys) on
    fake tensors just to learn the shapes: a cell per step and layer, so the capture's time grows with
    steps x layers (measured in docs/graph.md, "Recurrent layers whole"). Restored afterwards: eager calls
    never see this."""
    from torch._C import DispatchKey

    keys = (DispatchKey.Autograd, DispatchKey.Meta, DispatchKey.CompositeImplicitAutograd)
    saved = []
    for name in _RECURRENT:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload)
        saved.append((op, {k: op.py_kernels[k] for k in keys if k in op.py_kernels}))
        for k in keys:
            op.py_kernels.pop(k, None)
        op.py_kernels[DispatchKey.CompositeImplicitAutograd] = _recurrent_outputs(op)
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernels in saved:
            op.py_kernels.pop(DispatchKey.CompositeImplicitAutograd, None)
            op.py_kernels.update(kernels)
            op._dispatch_cache.clear()


def _decompositions() -> dict:
    table = torch.export.default_decompositions()
    for name in KEPT_WHOLE:
        packet, _, overload = name.partition(".")
        table.pop(getattr(getattr(torch.ops.aten, packet), overload), None)
    return table


@functools.cache
def _fx_names_every_dtype() -> None:
    """torch.fx prints a value's dtype by a short name from a table that lacks the sub-byte and quantized
    dtypes (torch.uint4, torch.int4, ...); with torch's structured trace on (TORCH_TRACE, a handler on its
    trace logger) an export that meets such a value fails there with KeyError instead of giving its graph,
    whose nodes on it become ATen groups that say why. The missing names are added (the dtype's own)."""
    from torch.fx import graph as fx_graph

    table = getattr(fx_graph, "dtype_abbrs", None)
    if isinstance(table, dict):
        for name in dir(torch):
            dtype = getattr(torch, name)
            if isinstance(dtype, torch.dtype) and dtype not in table:
                table[dtype] = str(dtype).removeprefix("torch.")


def export_program(model: torch.nn.Module, example_inputs: Sequence[Any], dynamic_shapes: Any = None) -> Any:
    _fx_names_every_dtype()
    # Without autograd: the program is an inference forward, and tensors made under torch.inference_mode()
    # (an inference server's inputs) cannot be traced with autograd recording; a model loaded there (its
    # parameters inference tensors) is traced in inference mode itself.
    loaded_for_inference = any(t.is_inference() for t in [*model.parameters(), *model.buffers()])
    mode = torch.inference_mode() if loaded_for_inference else torch.no_grad()
    with warnings.catch_warnings(), _recurrent_shapes_only(), mode, _export_quietly():
        # torch's own pytree deprecation notices, raised inside export: not the user's concern.
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
        exported = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic_shapes, strict=False)
        return exported.run_decompositions(_decompositions())


_log = get_logger(__name__)


class _NoUserCode(logging.Filter):
    """Drops torch's "Unable to find user code corresponding to {u0}" (a data-dependent branch): the
    CaptureError that follows says what failed and what to do."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unable to find user code corresponding to")


@contextlib.contextmanager
def _export_quietly() -> Iterator[None]:
    """torch.export without its own stderr noise: on a failed trace it prints the partial FX graph once per
    nested wrapper (twice for a data-dependent `if`). What it writes to stderr is held: written out after a
    capture that succeeds (nothing is lost), logged at DEBUG after one that fails (the CaptureError is the
    message)."""
    held = io.StringIO()
    shapes_log, quiet = logging.getLogger("torch.fx.experimental.symbolic_shapes"), _NoUserCode()
    shapes_log.addFilter(quiet)
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException:
        if held.getvalue().strip():
            _log.debug("torch.export's output before it failed:\n%s", held.getvalue().rstrip())
        raise
    else:
        sys.stderr.write(held.getvalue())
    finally:
        shapes_log.removeFilter(quiet)


def _convolution_biases_apart(exported: Any) -> int:
    """Rewrites `convolution(x, w, b)` as `convolution(x, w, None) + b.view(C, 1, ...)` in the exported
    graph (which the recording also runs) where only elementwise ops read the result: cuDNN's convolution
    adds a bias in a pass of its own over the output (ATen's `output.add_(bias)`), which the generated
    kernel of those ops then does in its loads instead — one read and write of the output fewer. Where
    cuDNN's fused convolution takes the epilogue instead (planner.conv_epilogues), it takes the bias back
    from the add. Grouped convolutions keep their bias (the depthwise template adds its own), as does one
    whose bias is computed in the forward.
    STITCHCUDA_CONV_BIAS_APART=0 turns the rewrite off (to measure it). Returns how many were rewritten."""
    from .templates.ops import is_pointwise

    if not settings().conv_bias_apart:
        return 0
    graph = exported.graph_module.graph
    conv, view, add = torch.ops.aten.convolution.default, torch.ops.aten.view.default, torch.ops.aten.add.Tensor
    count = 0
    for fx in list(graph.nodes):
        if fx.op != "call_function" or fx.target is not conv or len(fx.args) < 9:
            continue
        bias, transposed, groups, out = fx.args[2], fx.args[6], fx.args[8], fx.meta.get("val")
        bias_val = bias.meta.get("val") if isinstance(bias, torch.fx.Node) and bias.op == "placeholder" else None
        users = list(fx.users)
        if bias_val is None or not isinstance(out, torch.Tensor) or groups != 1 or bias_val.dim() != 1 \
                or bias_val.dtype != out.dtype or not users:
            continue
        readers = [op_name(u.target) if u.op == "call_function" and isinstance(u.target, torch._ops.OpOverload)
                   else "" for u in users]
        if not all(is_pointwise(r) for r in readers):
            continue  # a view, a pooling, a concatenation, the output: the bias pass is not saved
        shape = [int(out.shape[1])] + [1] * (out.dim() - 2)
        with graph.inserting_after(fx):
            b = graph.call_function(view, (bias, shape))
        with graph.inserting_after(b):
            y = graph.call_function(add, (fx, b))
        fx.replace_all_uses_with(y, delete_user_cb=lambda u: u is not y)
        fx.args = (*fx.args[:2], None, *fx.args[3:])
        with bias_val.fake_mode if hasattr(bias_val, "fake_mode") else contextlib.nullcontext():
            b.meta["val"] = bias_val.view(shape)
            y.meta["val"] = out + b.meta["val"]
        count += 1
    if count:
        graph.lint()
        exported.graph_module.recompile()
    return count


def _capture_error(exc: Exception, transformers: bool = False) -> CaptureError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    # The cache hint only where the export met an output type it does not know (another of transformers'
    # caches); any other error of a transformers model is the model's own or the export's.
    hint = (" For a transformers model, a cache type without pytree support: pass use_cache=False in kwargs=."
            if transformers and _UNKNOWN_OUTPUT.search(str(exc)) else "")
    return CaptureError(
        f"torch.export could not capture the model ({type(exc).__name__}: {first}). Common causes: "
        "control flow that depends on tensor values, non-tensor inputs that change, unsupported Python "
        f"in forward.{hint} The model runs eagerly instead.")


_UNKNOWN_OUTPUT = re.compile(r"Found <class '([\w.]+)'> in output, which is not a known type")


def is_transformers_model(model: torch.nn.Module, exc: Exception | None = None) -> bool:
    """Whether `model` is (or holds) a transformers model, or failed to export (`exc`) by returning an
    object of that library pytree did not know (a causal LM's DynamicCache). Such a model is exported
    returning its output's tensors, after transformers' own pytree support for its caches (its utility
    for torch.export, idempotent) is registered, so that the output flattens into tensors and rebuilds."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    found = _UNKNOWN_OUTPUT.search(str(exc)) if exc is not None else None
    pretrained = getattr(transformers, "PreTrainedModel", None)
    if not (found and found.group(1).startswith("transformers.")) and not (
            pretrained is not None and any(isinstance(m, pretrained) for m in model.modules())):
        return False
    try:
        from transformers.integrations.executorch import register_dynamic_cache_export_support
    except ImportError:
        return False
    register_dynamic_cache_export_support()
    _register_encoder_decoder_cache()
    return True


def _register_encoder_decoder_cache() -> None:
    """pytree support for transformers' EncoderDecoderCache (an encoder-decoder's output: BART, T5 with its
    cache, Whisper): its two DynamicCaches are its children, and it is rebuilt from them."""
    try:
        from transformers.cache_utils import EncoderDecoderCache
    except ImportError:
        return
    if EncoderDecoderCache in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        EncoderDecoderCache,
        lambda cache: ([cache.self_attention_cache, cache.cross_attention_cache], None),
        lambda children, _: EncoderDecoderCache(*children),
        serialized_type_name=f"{EncoderDecoderCache.__module__}.{EncoderDecoderCache.__name__}")


def _library_types(spec: Any) -> list[str]:
    """The names of the types in an output's pytree spec that no builtin container is (DynamicCache)."""
    names: list[str] = []
    stack = [spec]
    while stack:
        s = stack.pop()
        t = getattr(s, "type", None)
        if t is not None and t.__module__.startswith("transformers.cache_utils") and t.__name__ not in names:
            names.append(t.__name__)
        stack.extend(_children(s))
    return names


def _children(spec: Any) -> list[Any]:
    """A pytree spec's child specs: children() where torch has it (its children_specs attribute warns
    FutureWarning there), else the attribute."""
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else list(getattr(spec, "children_specs", []) or [])


class _FlatOutputs(torch.nn.Module):
    """`model` returning the leaves of its output's pytree (its tensors), recording the structure to
    rebuild it with. Exported instead of `model` when the structure holds an object torch.export does not
    trace through even with pytree support registered (its module call graph loses the inputs)."""

    def __init__(self, model: torch.nn.Module, record: Any) -> None:
        super().__init__()
        self.inner = model
        self._record = record  # a function: export traces a copy of the module's plain attributes

    def forward(self, *args):
        leaves, spec = pytree.tree_flatten(self.inner(*args))
        self._record(spec)
        return tuple(leaves)


def capture(model: torch.nn.Module, example_inputs: Sequence[Any],
            autocast: tuple[str, torch.dtype] | bool | None = None, exported: Any = None) -> Graph:
    """Exports `model` on `example_inputs` and returns its core-ATen graph. A transformers model (or one
    returning an object of that library pytree did not know: a causal LM's DynamicCache) is exported
    returning its output's tensors, and the graph's out_spec rebuilds the output, cache included.
    `autocast`: the torch.autocast to capture the forward under, (device type, dtype); None takes the one
    in effect at the call (autocast_in_effect), False none. Its casts become the graph's _to_copy nodes."""
    autocast = autocast_in_effect() if autocast is None else (autocast or None)
    notes: list[tuple[str, str]] = []
    if autocast is not None:
        device, dtype = autocast
        model = under_autocast(model, autocast)
        notes.append((f"captured under torch.autocast('{device}', dtype={dtype}): its casts are in the graph",
                      "torch.export records an autocast region as a higher-order op, which the lowering to core "
                      "ATen inlines into explicit casts; the program computes what the model computes under this "
                      "autocast, called inside it or not (a call outside it logs a warning once)"))
    with autocast_as(None):  # the export's trace and its decomposition see no autocast but the model's own
        # `exported`: a core-ATen program already made for these inputs (graph/dynamic.py specializes one
        # exported with symbolic sizes), read instead of exporting again.
        exported, out_spec, more = (exported, None, []) if exported is not None else _exported(model, example_inputs)
    notes += more
    apart = _convolution_biases_apart(exported)
    if apart:
        notes.append((f"{apart} convolution bias(es) added by the elementwise kernel after the convolution",
                      "cuDNN's convolution adds its bias in a pass of its own over the output; the kernel that "
                      "reads the output adds it in its loads, one read and write of the output fewer"))
    # an LM's last-position logits: its head on those rows
    moved = hoist_indexing(exported.graph_module.graph) if settings().hoist_index else []
    if moved:
        exported.graph_module.recompile()
        notes.append(indexing_note(moved))
    reader = _GraphReader(exported)
    reader.read()
    notes += reader.notes
    if not reader.inputs:
        raise CaptureError("the model has no tensor inputs")
    updates = state_updates(reader.nodes, reader.states, reader.new_values, reader.targets)
    if reader.states:
        copied = [reader.targets[v.name] for v in reader.states if v.name not in updates]
        notes.append((f"{len(reader.states)} buffer(s) the forward updates are program states: "
                      + ", ".join(f"{reader.targets[name]} ({node.op}, in place)" for name, node in updates.items())
                      + (", " if updates and copied else "") + ", ".join(f"{b} (copied back whole)" for b in copied),
                      "torch.export gives a buffer's update as a new value; the program writes an index_copy_, a "
                      "slice assignment or a copy_ of the buffer into the buffer itself (a KV cache is not copied per "
                      "call) and copies any other new value into it at the end; executors made beside the model "
                      "update the model's own buffer"))
    return Graph(reader.inputs, reader.weights, reader.nodes, reader.outputs, out_spec or exported.call_spec.out_spec,
                 exported.call_spec.in_spec, exported, notes, reader.output_constants, autocast, reader.states,
                 reader.new_values, updates, {v.name: reader.targets[v.name] for v in reader.states})


def state_updates(nodes: Sequence[Node], states: Sequence[Value], new_values: dict[str, Value],
                  buffers: dict[str, str]) -> dict[str, Node]:
    """The states whose new value is an update of the state itself computable in place (one of
    INPLACE_UPDATES applied to it), each with the node computing it. Such an update read again by a node
    after it would see the new value: a CaptureError naming the buffer and the readers."""
    order = {id(n): i for i, n in enumerate(nodes)}
    updates: dict[str, Node] = {}
    for state in states:
        new = new_values[state.name]
        node = new.producer
        if node is None or node.op not in INPLACE_UPDATES or not node.args or node.args[0] is not state \
                or node.outputs[0] is not new:
            continue  # copied back whole at the end
        later = [n.name for n in state.users if order[id(n)] > order[id(node)]]
        if later:
            raise CaptureError(
                f"the forward reads the old value of buffer '{buffers[state.name]}' ({', '.join(later)}) after updating "
                f"it ({node.name}): a program writes the update in place, so a later read would see the new value; "
                "clone the old value before the update")
        updates[state.name] = node
    return updates


# ---- torch.autocast ----------------------------------------------------------------------------------
#
# torch.export ignores an autocast region around the call (the trace sits above autocast's dispatch key)
# and records one inside forward as a higher-order op; a model optimized inside `with torch.autocast(...)`
# would be captured in fp32. So capture() enters the autocast inside a wrapper's forward, where export
# records it and run_decompositions() inlines its casts. The graph is then explicit: replaying it, or
# running the program, under an autocast would cast again (ATen steps dispatch through autocast too), so
# those run with autocast off, and the model's own eager forward (the reference) under the captured one.

AUTOCAST_DEVICES = ("cuda", "cpu")


def autocast_in_effect() -> tuple[str, torch.dtype] | None:
    """The torch.autocast enabled in this thread, (device type, dtype), CUDA's first; None when none is."""
    for device in AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            return device, torch.get_autocast_dtype(device)
    return None


@contextlib.contextmanager
def autocast_as(autocast: tuple[str, torch.dtype] | None) -> Iterator[None]:
    """Exactly `autocast` in effect inside the block, (device type, dtype), every other device's off; None:
    autocast off everywhere (a captured graph's replay, a program's run)."""
    with contextlib.ExitStack() as stack:
        for device in AUTOCAST_DEVICES:
            if device == "cuda" and not torch.cuda.is_available():
                continue  # torch.autocast("cuda") disables itself there, with a warning
            on = autocast is not None and autocast[0] == device
            if on or torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, dtype=autocast[1] if on else None, enabled=on))
        yield


class _UnderAutocast(torch.nn.Module):
    """`inner` called under a torch.autocast: what capture() exports, and the eager reference of a graph
    captured under it. fp64 tensors pass autocast untouched, so an fp64 copy of it stays exact."""

    def __init__(self, inner: torch.nn.Module, autocast: tuple[str, torch.dtype]) -> None:
        super().__init__()
        self.inner = inner
        self.autocast = autocast

    def forward(self, *args, **kwargs):
        with autocast_as(self.autocast):
            return self.inner(*args, **kwargs)


def warn_other_autocast(graph: Graph, warned: set) -> None:
    """Logs a warning, once per autocast setting in `warned`, when the one in effect is not the one `graph`
    was captured under: the program still computes the captured forward, which the caller may not expect."""
    now = autocast_in_effect()
    if now == graph.autocast or ("autocast", now) in warned:
        return
    warned.add(("autocast", now))

    def text(a: tuple[str, torch.dtype] | None) -> str:
        return f"torch.autocast('{a[0]}', dtype={a[1]})" if a else "no autocast"

    _log.warning("this program was captured under %s and computes that forward; it is called under %s and "
                 "still computes it (call stitchcuda.optimize() under the autocast you run it in for a program "
                 "of that forward)", text(graph.autocast), text(now))


def under_autocast(model: torch.nn.Module, autocast: tuple[str, torch.dtype] | None) -> torch.nn.Module:
    """`model` as it runs under `autocast` wherever it is called (itself when None)."""
    return model if autocast is None else _UnderAutocast(model, autocast)


def _exported(model: torch.nn.Module, example_inputs: Sequence[Any]) -> tuple[Any, Any, list[tuple[str, str]]]:
    """(the exported program, the output spec that rebuilds a flattened output or None, the notes): a
    transformers model is exported returning its output's tensors (_FlatOutputs)."""
    out_spec, notes = None, []
    inner = model.inner if isinstance(model, _UnderAutocast) else model
    flat = is_transformers_model(inner)
    if not flat:
        try:
            return export_program(model, example_inputs), None, notes
        except Exception as exc:  # torch raises many types here; the message is what the user needs
            flat = is_transformers_model(inner, exc)
            if not flat:
                raise _capture_error(exc) from exc
    specs: list[Any] = []
    try:
        exported = export_program(_FlatOutputs(model, specs.append), example_inputs)
    except Exception as exc:
        raise _capture_error(exc, transformers=True) from exc
    out_spec = specs[-1]
    caches = _library_types(out_spec)
    notes.append(("the transformers model is exported returning its output's tensors" +
                  (f" (its {', '.join(caches)} included)" if caches else ""),
                  "torch.export does not trace through transformers' output objects as they are" +
                  (" (a DynamicCache loses the call's inputs from its module call graph)" if caches else "") +
                  "; the program returns the tensors and the output is rebuilt around them, so calls return "
                  "what the model returns" +
                  (" (transformers' pytree support for its caches registered)" if caches else "")))
    return exported, out_spec, notes


class _GraphReader:
    """The exported program's FX graph read into the Graph's values and nodes: placeholders become inputs
    or weights, ATen calls nodes (every result of a multi-output op a value, named by its getitem), and
    the output node the graph's outputs (numbers, strings and None beside them kept as constants)."""

    def __init__(self, exported: Any) -> None:
        self.exported = exported
        sig = exported.graph_signature
        self.state = {**exported.state_dict, **exported.constants}
        self.placeholder_target = {spec.arg.name: spec.target for spec in sig.input_specs
                                   if spec.target is not None and hasattr(spec.arg, "name")}
        self.user_inputs = set(sig.user_inputs)
        # output name -> the buffer it becomes (torch.export's buffer mutations)
        self.mutations: dict[str, str] = dict(sig.buffers_to_mutate)
        # output name -> the user input the forward writes in place (relu_(x) of an input): the program
        # computes the value and leaves the caller's tensor as it was (a note says so)
        self.input_mutations: dict[str, str] = dict(getattr(sig, "user_inputs_to_mutate", None) or {})
        self.notes: list[tuple[str, str]] = []
        self.states: list[Value] = []
        self.targets: dict[str, str] = {}  # a state's value name -> its buffer
        self.new_values: dict[str, Value] = {}  # a state's value name -> the value the forward leaves in it
        self.values: dict[str, Value] = {}
        self.inputs: list[Value] = []
        self.weights: list[Value] = []
        self.nodes: list[Node] = []
        self.multi: dict[str, Node] = {}
        self.output_constants: dict[int, Any] = {}
        self.outputs: list[Value] = []

    def read(self) -> None:
        for fx in self.exported.graph.nodes:
            if fx.op == "placeholder":
                self._placeholder(fx)
            elif fx.op == "call_function":
                self._call(fx)
            elif fx.op == "output":
                self._output(fx)
            else:
                raise CaptureError(f"unsupported node kind '{fx.op}' ({fx.name}) in the exported graph")

    def convert(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            if a.name in self.values:
                return self.values[a.name]
            raise CaptureError(f"'{a.name}' is used but produces no tensor StitchCUDA can hold")
        if isinstance(a, (list, tuple)):
            return type(a)(self.convert(x) for x in a)
        # A complex scalar (x * 1j) is kept: the planner makes its node an ATen group, the capture goes on.
        if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format, int, float, complex, bool,
                          str)) or a is None:
            return a
        raise CaptureError(f"unsupported argument of type {type(a).__name__} in the exported graph")

    def _placeholder(self, fx: Any) -> None:
        shape, strides, dtype, offset = _meta(fx.meta.get("val"), fx.name)
        if fx.name in self.user_inputs:
            v = Value(fx.name, shape, strides, dtype, "input", offset)
            self.inputs.append(v)
        else:
            target = self.placeholder_target.get(fx.name)
            data = self.state.get(target) if target is not None else None
            if data is None:
                raise CaptureError(f"graph input '{fx.name}' is neither a user input nor a known weight")
            if target in self.mutations.values():
                v = Value(fx.name, shape, strides, dtype, "state", offset, data=data.detach())
                self.states.append(v)
                self.targets[fx.name] = target
            else:
                v = Value(fx.name, shape, strides, dtype, "weight", offset, data=data.detach())
                self.weights.append(v)
        self.values[fx.name] = v

    def _call(self, fx: Any) -> None:
        if fx.target is getitem:
            self._getitem(fx)
            return
        if not isinstance(fx.target, torch._ops.OpOverload):
            raise CaptureError(f"node '{fx.name}' calls {fx.target}, which is not an ATen operator")
        if not fx.target._schema.returns:
            # Checks with no result (aten._assert_tensor_metadata after .to(dtype), _assert_async...):
            # export already verified them for these shapes, and a program has nothing to hold.
            return
        node = Node(fx.name, op_name(fx.target), fx.target, self.convert(fx.args),
                    {k: self.convert(v) for k, v in fx.kwargs.items()}, [])
        val = fx.meta.get("val")
        if op_name(fx.target).removeprefix("aten::") in _RECURRENT:
            # The re-trace of run_decompositions() records an LSTM's final states with one dimension
            # too many: their shapes are taken from the rule, on meta tensors shaped like the inputs.
            val = _recurrent_outputs(fx.target)(*_on_meta(fx.args), **_on_meta(fx.kwargs))
        if isinstance(val, (list, tuple)):
            # Every result gets a value (an op step needs a buffer for each), named by getitem later.
            self.multi[fx.name] = node
            for k, item in enumerate(val):
                if isinstance(item, torch.Tensor):
                    shape, strides, dtype, offset = _meta(item, f"{fx.name}[{k}]")
                    node.outputs.append(Value(f"{fx.name}.{k}", shape, strides, dtype, "node", offset, producer=node))
                else:
                    node.outputs.append(None)
        else:
            shape, strides, dtype, offset = _meta(val, fx.name)
            v = Value(fx.name, shape, strides, dtype, "node", offset, producer=node)
            node.outputs = [v]
            self.values[fx.name] = v
        for i in node.inputs:
            i.users.append(node)
        self.nodes.append(node)

    def _getitem(self, fx: Any) -> None:
        parent = self.multi.get(fx.args[0].name)
        if parent is None:
            raise CaptureError(f"getitem on '{fx.args[0].name}', which is not a multi-output op")
        index = int(fx.args[1])
        v = parent.outputs[index]
        if v is None:
            raise CaptureError(f"'{fx.name}' selects result {index} of {parent.op}, which is not a tensor")
        self.values.pop(v.name, None)
        v.name = fx.name
        self.values[fx.name] = v

    def _output(self, fx: Any) -> None:
        outs = fx.args[0]
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        # The buffers' and inputs' new values come first; they are the states' updates, not outputs.
        by_target = {self.targets[v.name]: v for v in self.states}
        # (counted, not matched by name: a value the forward also returns is both an update and an output)
        first = len(self.mutations) + len(self.input_mutations)
        updates, outs = outs[:first], outs[first:]
        for o in updates:
            if o.name in self.input_mutations:
                self.notes.append((f"the forward writes its input '{self.input_mutations[o.name]}' in place; the program "
                                   "does not", "a program never writes its inputs: it computes the same outputs and the "
                                   "caller's tensor keeps its values (return the new value to have it)"))
                continue
            new = self.convert(o)
            state = by_target[self.mutations[o.name]]
            if new is not state:  # a buffer left as it was needs no update
                self.new_values[state.name] = new
        for v in [v for v in self.states if v.name not in self.new_values]:
            v.kind = "weight"  # read only, after all
            self.states.remove(v)
            self.weights.append(v)
        leaves = [self.convert(o) for o in outs]
        # A number, string or None beside the tensors (a count, a flag) is the same on every call: the
        # output is rebuilt with it; the program computes the tensors.
        for k, o in enumerate(leaves):
            if not isinstance(o, Value):
                if not isinstance(o, (bool, int, float, str, type(None))):
                    raise CaptureError(f"the model returns a {type(o).__name__} beside its tensors; return "
                                       "tensors (numbers, strings and None may come along)")
                self.output_constants[k] = o
        self.outputs = [o for o in leaves if isinstance(o, Value)]
