"""optimize(..., dynamic=...): one optimized module for every size, in a declared range, of the input dims
that may vary (the batch, a sequence length).

How it works. The dims and their ranges come from `dynamic=` ("auto": the batch; or torch.export's
dynamic_shapes spec with torch.export.Dim). torch.export checks them against the model first: a model that
fixes a dim ("x.view(8, -1)") cannot vary it, and the guards export derives (a range it narrows) are
recorded. Graph mode's kernels are generated for concrete sizes, so the module is a *family* of programs,
each built by the whole pipeline (captured, planned, every group checked, verified, timed against eager)
for one member size and kept only where it is correct and faster there:

- a dim whose rows are independent (the batch) is served by **padding**: a call of size s runs the
  smallest member of size >= s (built on first use at the next power of two, or the example's size when
  that is between), its inputs zero-padded along the dim and its outputs cut back to s. At most
  log2(max) + 2 members serve the whole range.
- a dim where padding changes the answer (a sequence that a softmax or a mean reads whole) is served
  **exactly**: a member per size that occurs, built on first use.

What the programs share, so that a member costs a fraction of the first: one export (the symbolic one that
checks the dims, lowered to core ATen once; each program's graph is it at the program's sizes,
`specialize`), the choices timed on the example's program (its variant and runner, build.Decided) and the
compiled kernels (the templates leave the batch to the launch, so a member's sources are the example's).
Each is still planned, checked group by group, verified and timed against eager at its own size.

optimize() verifies the family over the range before returning: at the range's ends, a prime, half the
example and the example, on fresh inputs, through the same calls a user makes; a dim whose padded sizes do
not match the model is switched to exact members. At most MAX_RESIDENT members hold their working memory
(arena, CUDA graph) at a time; the others give it back to PyTorch's allocator until their next call.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from ..errors import InvalidArgumentError
from ..log import get_logger
from ..settings import settings
# capture's export (no autograd, its core-ATen decompositions), here with symbolic sizes; and its test for a
# transformers model, whose output capture flattens (a specialized program keeps export's own).
from .capture import autocast_in_effect, export_program as export_core, is_transformers_model
from .capture import under_autocast, warn_other_autocast
from .measure import no_truth_needed
from .module import OptimizedModule, model_name, positional_call, shapes_text
from .options import OptimizeOptions

__all__ = ["DynamicDim", "DynamicModule", "parse_dynamic", "export_guards", "choose_member", "stress_sizes",
           "resized_inputs", "optimize_dynamic", "wall_breakdown", "parameter_names", "MAX_RESIDENT", "AUTO"]

log = get_logger(__name__)

AUTO = "auto"
# Members holding their working memory at once; the least recently used others release it between calls.
MAX_RESIDENT = 4
LARGEST = (1 << 31) - 1
MAX_ROUTES = 4096  # shape sets remembered with their member


@dataclass
class DynamicDim:
    """A dim that may vary: its name, range (inclusive), the (input, axis) pairs that carry it — input by
    position among the call's tensors — and the (output leaf, axis) pairs it reaches. `pad`: whether a
    larger member may serve a size (zero-padded inputs, outputs cut back); `why_exact` says why not."""

    name: str
    min: int
    max: int
    inputs: list[tuple[int, int]]
    example: int
    outputs: list[tuple[int, int]] = field(default_factory=list)
    pad: bool = True
    why_exact: str = ""

    def text(self) -> str:
        where = ", ".join(f"input {i} axis {a}" for i, a in self.inputs)
        return f"'{self.name}' {self.min}..{self.max} ({where}; example {self.example})"


# ---- the spec ---------------------------------------------------------------------------------------------

def parameter_names(model: torch.nn.Module) -> list[str]:
    try:
        return [p.name for p in inspect.signature(model.forward).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return []


def parse_dynamic(spec: Any, tensors: Sequence[Any], names: Sequence[str] = ()) -> list[DynamicDim]:
    """The dims `spec` declares over the call's inputs `tensors` (positional, keyword inputs after them;
    `names`: each input's name, for a spec keyed by name). `spec`: "auto" — the batch: axis 0 of every
    tensor input whose axis 0 has the first tensor input's extent, over 1..2x that extent — or torch.export's
    dynamic_shapes form: a list/tuple with one entry per input, or a dict by input name or position, each
    entry None or {axis: torch.export.Dim(name, min=, max=) or a (min, max) pair}. One Dim object (or one
    name) on several inputs is one dim. Raises InvalidArgumentError naming the entry and the fix."""
    if isinstance(spec, str):
        if spec != AUTO:
            raise InvalidArgumentError(f"dynamic={spec!r} is not understood: give dynamic='auto' (the batch dim) or "
                                       "torch.export's dynamic_shapes form, e.g. dynamic=[{0: Dim('batch', max=64)}]")
        return _auto(tensors)
    entries: list[tuple[int, Any]]
    if isinstance(spec, dict):
        entries = []
        for key, entry in spec.items():
            if isinstance(key, int) and 0 <= key < len(tensors):
                entries.append((key, entry))
            elif isinstance(key, str) and key in names:
                entries.append((list(names).index(key), entry))
            else:
                known = ", ".join(repr(n) for n in names) or "none"
                raise InvalidArgumentError(f"dynamic= names input {key!r}, which the call does not have (its inputs: "
                                           f"{known}; or a position 0..{len(tensors) - 1})")
    elif isinstance(spec, (list, tuple)):
        if len(spec) != len(tensors):
            raise InvalidArgumentError(f"dynamic= has {len(spec)} entries for a call with {len(tensors)} inputs: give "
                                       "one per input (None for an input whose shape is fixed)")
        entries = list(enumerate(spec))
    else:
        raise InvalidArgumentError(f"dynamic= must be 'auto', a list or a dict, not a {type(spec).__name__}")
    dims: dict[str, DynamicDim] = {}
    for position, entry in entries:
        if entry is None:
            continue
        t = tensors[position]
        label = names[position] if position < len(names) else f"input {position}"
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"dynamic= gives dims for {label}, which is a {type(t).__name__}: dims may vary "
                                       "on tensor inputs only")
        if not isinstance(entry, dict):
            raise InvalidArgumentError(f"dynamic= entry for {label} must be a dict {{axis: Dim}}, not "
                                       f"{type(entry).__name__}")
        for axis, dim in entry.items():
            if not isinstance(axis, int) or not -t.dim() <= axis < t.dim():
                raise InvalidArgumentError(f"dynamic= gives axis {axis!r} of {label}, which has {t.dim()} axes")
            axis %= t.dim()
            name, low, high = _dim_range(dim, f"{label}.{axis}".replace(" ", "_"))
            extent = int(t.shape[axis])
            if not low <= extent <= high:
                raise InvalidArgumentError(f"dim '{name}' ranges {low}..{high} but {label} has {extent} on axis {axis}: "
                                           "the example inputs must lie inside the range")
            known = dims.get(name)
            if known is None:
                dims[name] = DynamicDim(name, low, high, [(position, axis)], extent)
            elif (known.min, known.max) != (low, high) or known.example != extent:
                raise InvalidArgumentError(f"dim '{name}' is given twice with different ranges or example sizes "
                                           f"({known.min}..{known.max} at {known.example}, {low}..{high} at {extent}): "
                                           "one name is one dim")
            else:
                known.inputs.append((position, axis))
    return _padding_setting(list(dims.values()))


def _padding_setting(dims: list[DynamicDim]) -> list[DynamicDim]:
    if settings().dynamic_padding == "off":
        for d in dims:
            d.pad, d.why_exact = False, "STITCHCUDA_DYNAMIC_PADDING=off"
    return dims


def _dim_range(dim: Any, default_name: str) -> tuple[str, int, int]:
    if isinstance(dim, tuple) and len(dim) == 2 and all(isinstance(v, int) for v in dim):
        name, low, high = default_name, dim[0], dim[1]
    elif hasattr(dim, "min") and hasattr(dim, "max") and hasattr(dim, "__name__"):  # torch.export.Dim
        # Dim's default min is 0; an empty batch has nothing to run, so the range starts at 1.
        name, low = dim.__name__, max(1, int(dim.min))
        try:
            high = int(dim.max)
        except (TypeError, ValueError, AttributeError, OverflowError):  # no max given: sympy's infinity
            high = LARGEST
    else:
        raise InvalidArgumentError(f"dynamic= wants torch.export.Dim('name', min=, max=) or a (min, max) pair for "
                                   f"{default_name}, not {dim!r}")
    if high >= LARGEST or high < 0:
        raise InvalidArgumentError(f"dim '{name}' has no maximum: give one (Dim('{name}', max=...)); a program family "
                                   "plans its memory and its members for the largest size")
    if not 1 <= low <= high:
        raise InvalidArgumentError(f"dim '{name}' ranges {low}..{high}: a range needs 1 <= min <= max")
    return name, low, high


def _auto(tensors: Sequence[Any]) -> list[DynamicDim]:
    first = next((t for t in tensors if isinstance(t, torch.Tensor) and t.dim() >= 1), None)
    if first is None:
        raise InvalidArgumentError("dynamic='auto' varies the batch, axis 0 of the tensor inputs, but the call has no "
                                   "tensor input with an axis")
    batch = int(first.shape[0])
    carriers = [(i, 0) for i, t in enumerate(tensors)
                if isinstance(t, torch.Tensor) and t.dim() >= 1 and int(t.shape[0]) == batch]
    return _padding_setting([DynamicDim("batch", 1, max(2 * batch, 2), carriers, batch)])


# ---- export's guards --------------------------------------------------------------------------------------

class DynamicShapeError(Exception):
    """The model cannot vary a declared dim (torch.export's reason is in the message)."""


def export_symbolic(model: torch.nn.Module, tensors: Sequence[Any], dims: list[DynamicDim], lower: bool = True) -> Any:
    """`model` exported once with the dims symbolic (torch.export.Dim per dim), as capture exports a model
    (no autograd, lowered to its core ATen; `lower=False`: torch.export's program as it traced it): a
    model that fixes a dim raises DynamicShapeError with export's reason. Every member's graph is the
    lowered program at the member's sizes (specialize)."""
    from torch.export import Dim, export

    symbols = {d.name: Dim(_identifier(d.name), min=d.min, max=d.max) for d in dims}
    shapes: list[Any] = [None] * len(tensors)
    for d in dims:
        for i, axis in d.inputs:
            shapes[i] = dict(shapes[i] or {})
            shapes[i][axis] = symbols[d.name]
    spec: tuple = tuple(shapes)
    if _takes_varargs(model):  # forward(*inputs) (a keyword call, a Dynamo graph's wrapper): one entry, the tuple
        spec = (spec,)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not lower:
                return export(model, tuple(tensors), dynamic_shapes=spec, strict=False)
            return export_core(model, tuple(tensors), dynamic_shapes=spec)
    except Exception as exc:  # export's constraint violations and anything it cannot trace symbolically
        raise DynamicShapeError(_export_reason(exc, dims)) from exc


def export_guards(model: torch.nn.Module, tensors: Sequence[Any], dims: list[DynamicDim],
                  exported: Any = None) -> list[str]:
    """The guards of `model`'s symbolic export (`exported`, or export_symbolic's, which raises
    DynamicShapeError where the model fixes a dim): a range export narrows (the model needs batch >= 2)
    narrows the dim. Sets each dim's output axes from the symbolic output shapes (an output extent that is
    not the dim itself, 2 * batch, leaves that dim without padding). Returns the guards, as text."""
    if exported is None:
        exported = export_symbolic(model, tensors, dims)
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    user = [n for n, spec in zip(placeholders, exported.graph_signature.input_specs)
            if spec.kind.name == "USER_INPUT"]
    symbol_of: dict[Any, DynamicDim] = {}
    for d in dims:
        i, axis = d.inputs[0]
        if i < len(user):
            expr = user[i].meta["val"].shape[axis]
            if isinstance(expr, torch.SymInt):
                symbol_of[expr.node.expr] = d
    guards = []
    for symbol, bounds in exported.range_constraints.items():
        d = symbol_of.get(symbol)
        low, high = int(bounds.lower), int(min(bounds.upper, LARGEST))
        if d is not None and (low > d.min or high < d.max):
            guards.append(f"'{d.name}' narrowed by the model to {max(low, d.min)}..{min(high, d.max)}")
            d.min, d.max = max(low, d.min), min(high, d.max)
        elif d is not None:
            guards.append(f"'{d.name}' in {d.min}..{d.max}")
    outputs = [n for n in exported.graph.nodes if n.op == "output"][0].args[0]
    leaves = pytree.tree_flatten(outputs)[0]
    tensor_leaves = [v for v in (getattr(leaf, "meta", {}).get("val") if hasattr(leaf, "meta") else None
                                 for leaf in leaves) if isinstance(v, torch.Tensor)]
    for j, val in enumerate(tensor_leaves):  # j: the program's output j (the output's tensor leaves, in order)
        for axis, extent in enumerate(val.shape):
            if not isinstance(extent, torch.SymInt):
                continue
            expr = extent.node.expr
            d = symbol_of.get(expr)
            if d is not None:
                d.outputs.append((j, axis))
            else:
                for free in getattr(expr, "free_symbols", ()):
                    other = symbol_of.get(free)
                    if other is not None and other.pad:
                        other.pad = False
                        other.why_exact = (f"output {j} axis {axis} is {expr} in '{other.name}', not the dim itself: "
                                           "padding cannot be cut back there")
    return guards


def _takes_varargs(model: torch.nn.Module) -> bool:
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].kind is inspect.Parameter.VAR_POSITIONAL


def _export_reason(exc: Exception, dims: list[DynamicDim]) -> str:
    """export's refusal in one line: which dim the model fixes and to what, or export's first line."""
    text = str(exc)
    fixed = re.findall(r"marked (\w+) as dynamic but your code specialized it to be a constant \((\d+)\)", text)
    if fixed:
        said = "; ".join(f"the model fixes '{name}' to {value}" for name, value in dict(fixed).items())
        return (f"{said}, so it cannot vary (torch.export found code that depends on the size: a view, an "
                "expand or a loop written for the example's)")
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return (f"the model cannot vary {', '.join(repr(d.name) for d in dims)}: torch.export with symbolic sizes "
            f"stopped ({type(exc).__name__}: {first[:300]})")


def _identifier(name: str) -> str:
    text = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return text if text and not text[0].isdigit() else f"d_{text}"


# ---- one export, every member's graph ----------------------------------------------------------------------

class SpecializedProgram:
    """The symbolic export's core-ATen program at concrete sizes, as capture() reads an exported program:
    its FX graph and module (each value's metadata at these sizes, the size computations folded into
    constants), the export's signature, weights and call spec. The weights are the model's tensors."""

    def __init__(self, exported: Any, module: torch.fx.GraphModule) -> None:
        self.graph_module, self.graph = module, module.graph
        self.graph_signature, self.state_dict = exported.graph_signature, exported.state_dict
        self.constants, self.call_spec = exported.constants, exported.call_spec


def dim_symbols(exported: Any, dims: list[DynamicDim]) -> list[Any] | None:
    """Each dim's symbol in the symbolic export (the extent of its first carrier), or None where one is not
    a plain symbol (export tied it to an expression of another): such a program is not specialized."""
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    user = [n for n, spec in zip(placeholders, exported.graph_signature.input_specs) if spec.kind.name == "USER_INPUT"]
    found = []
    for d in dims:
        i, axis = d.inputs[0]
        extent = user[i].meta["val"].shape[axis] if i < len(user) else None
        if not isinstance(extent, torch.SymInt) or not extent.node.expr.is_Symbol:
            return None
        found.append(extent.node.expr)
    return found


def specialize(exported: Any, symbols: Sequence[Any], sizes: Sequence[int]) -> SpecializedProgram:
    """`exported` (export_symbolic's) at `sizes`, one per symbol: a copy of its graph where every value's
    metadata is a fake tensor of its concrete shape, strides and offset, and every node computing a size
    (sym_size, the arithmetic on it) is replaced by its value in the nodes that read it. Milliseconds,
    where exporting the model again at each size costs a trace and a decomposition."""
    import sympy
    from torch._subclasses.fake_tensor import FakeTensorMode

    bound = {sym: sympy.Integer(size) for sym, size in zip(symbols, sizes)}

    def value(x: Any) -> Any:
        if isinstance(x, torch.SymBool):
            return bool(x.node.expr.xreplace(bound))
        if isinstance(x, torch.SymInt):
            return int(x.node.expr.xreplace(bound))
        if isinstance(x, torch.SymFloat):
            return float(x.node.expr.xreplace(bound))
        return x

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return value(t)
        shape, strides = [value(e) for e in t.shape], [value(e) for e in t.stride()]
        with mode:
            return torch.empty_strided(shape, strides, dtype=t.dtype, device=t.device).as_strided(
                shape, strides, value(t.storage_offset()))

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(exported.graph_module.graph, {}))
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
            size = value(val)
            for user in list(node.users):
                user.args = torch.fx.node.map_arg(user.args, lambda a: size if a is node else a)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: size if a is node else a)
            graph.erase_node(node)
        elif val is not None:
            node.meta = {**node.meta, "val": pytree.tree_map(fake, val)}
    return SpecializedProgram(exported, torch.fx.GraphModule(exported.graph_module, graph))


def specializable(model: torch.nn.Module) -> str:
    """Why members are exported again rather than specialized from the symbolic export, or "": under
    torch.autocast capture enters it inside the forward, and a transformers model's output is flattened
    into tensors for export (the symbolic export is of neither)."""
    if autocast_in_effect() is not None:
        return "optimize() was called under torch.autocast"
    if is_transformers_model(model):
        return "a transformers model's output is flattened for export"
    return ""


# ---- members ----------------------------------------------------------------------------------------------

def _bucket(size: int, d: DynamicDim) -> int:
    """The member size a padded dim builds for `size`: the next power of two, within the range."""
    return max(d.min, min(1 << max(0, math.ceil(math.log2(size))), d.max))


def choose_member(dims: list[DynamicDim], members: Sequence[tuple[int, ...]], sizes: tuple[int, ...]
                  ) -> tuple[tuple[int, ...], bool]:
    """The member that serves a call of `sizes` (one per dim), and whether it exists yet. The exact one if
    built; else, for every padded dim, the smallest existing size between the call's and its bucket (the
    next power of two), or the bucket itself (to be built); a dim without padding keeps the call's size."""
    if sizes in members:
        return sizes, True
    choice = []
    for k, (d, s) in enumerate(zip(dims, sizes)):
        if not d.pad:
            choice.append(s)
            continue
        bucket = _bucket(s, d)
        others = [m for m in members if all(m[j] == sizes[j] or (dims[j].pad and m[j] >= sizes[j])
                                            for j in range(len(dims)) if j != k)]
        near = sorted(m[k] for m in others if s <= m[k] <= bucket)
        choice.append(near[0] if near else bucket)
    key = tuple(choice)
    return key, key in members


def _primes_below(n: int) -> int | None:
    for p in range(n - 1, 1, -1):
        if all(p % q for q in range(2, int(math.isqrt(p)) + 1)):
            return p
    return None


def stress_sizes(d: DynamicDim) -> list[int]:
    """The sizes the family is verified at, for one dim: the range's ends, the example, half of it and a
    prime below it (a tail no power of two divides), within the range, in order."""
    sizes = {d.min, d.max, d.example, max(d.min, d.example // 2)}
    prime = _primes_below(d.example)
    if prime is not None and prime >= d.min:
        sizes.add(prime)
    return sorted(s for s in sizes if d.min <= s <= d.max)


def resized_inputs(tensors: Sequence[Any], dims: list[DynamicDim], sizes: Sequence[int]) -> tuple:
    """The example inputs at other `sizes`: each carrying axis repeated and cut to the size, so integer
    inputs (token ids, positions) stay valid values."""
    out = list(tensors)
    for d, s in zip(dims, sizes):
        for i, axis in d.inputs:
            t = out[i]
            n = int(t.shape[axis])
            if s > n:
                reps = [1] * t.dim()
                reps[axis] = -(-s // n)
                t = t.repeat(*reps)
            out[i] = t.narrow(axis, 0, s).contiguous()
    return tuple(out)


def _first_leaves(inputs: Sequence[Any]) -> list[int]:
    """For each of the call's inputs, the index of its first tensor among all the call's tensor leaves (the
    program's inputs, in order)."""
    first, k = [], 0
    for t in inputs:
        first.append(k)
        k += sum(isinstance(v, torch.Tensor) for v in pytree.tree_flatten(t)[0])
    return first


@dataclass
class Member:
    """One size's program (an OptimizedModule of the pipeline) or, where it was not built or lost to eager
    there, the reason the original model runs for that size."""

    sizes: tuple[int, ...]
    module: OptimizedModule | None
    reason: str
    seconds: float
    last_used: float = 0.0
    # Held from a padded call's write into the program's input buffer until its run has read it, and by
    # every other run of the member: another thread's call in between would overwrite the rows (or copy
    # its own input into that buffer) before the run reads them.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def runs_program(self) -> bool:
        return self.module is not None and self.module._runner is not None

    def row(self, dims: list[DynamicDim]) -> dict:
        rep = self.module.report if self.module is not None else None
        timing = rep.timing if rep is not None else {}
        return {"sizes": dict(zip((d.name for d in dims), self.sizes)), "runs": "program" if self.runs_program
                else "original", "reason": self.reason, "build_s": round(self.seconds, 3),
                "speedup_eager": timing.get("speedup_eager"),
                "stage_s": {k: round(v, 2) for k, v in (rep.stage_seconds if rep is not None else {}).items()}}


class DynamicModule(OptimizedModule):
    """optimize(..., dynamic=...)'s module: a family of programs, one per member size, built by the pipeline
    on first use (optimize() builds those its range check needs). A call in range runs the member that
    serves its sizes (zero-padded along the padded dims, outputs cut back); a call outside the range, or
    with other fixed dims or dtypes, runs the original model, logged once per shape at WARNING.
    `.report.dynamic` lists the dims, guards, members and the range check."""

    def __init__(self, model: torch.nn.Module, example: OptimizedModule, dims: list[DynamicDim],
                 example_inputs: tuple, options: OptimizeOptions, guards: list[str],
                 symbolic: Any = None, symbols: Sequence[Any] | None = None) -> None:
        super().__init__(model, example.program, example._graph, example.report, options.graphs, example._runner)
        self._dims, self._options, self._guards = dims, options, guards
        self._decided = getattr(example, "decided", None)  # the example's timed choices, reused by every member
        # The symbolic export (export_symbolic) and its dims' symbols: each member's graph is read from it.
        self._symbolic, self._symbols = symbolic, symbols
        self._traced = model
        self._example_inputs = example_inputs
        self._fixed = self._fixed_signature(example_inputs)
        self._members: OrderedDict[tuple[int, ...], Member] = OrderedDict()
        self._lock = threading.RLock()
        sizes = tuple(d.example for d in dims)
        self._add(Member(sizes, example, "" if example._runner is not None else example.report.reason,
                         sum(example.report.stage_seconds.values())))
        self.member_builds = 0
        self.padded_calls = 0
        self._routes: dict[tuple, tuple] = {}  # a call's (shape, dtype) per input -> _route's answer
        self._first_leaf = _first_leaves(example_inputs)  # input position -> its first tensor among the program's
        self._last: Member | None = None

    # what a call's inputs must keep: every axis no dim names, and the dtypes
    def _fixed_signature(self, tensors: Sequence[Any]) -> list:
        varying = {(i, a) for d in self._dims for i, a in d.inputs}
        sig = []
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor):
                sig.append((t.dtype, tuple(None if (i, a) in varying else int(e) for a, e in enumerate(t.shape))))
            else:  # a list of tensors: every leaf's dtype and shape fixed
                sig.append(tuple((v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v
                                 for v in pytree.tree_flatten(t)[0]))
        return sig

    def _add(self, member: Member) -> None:
        member.last_used = time.monotonic()
        self._members[member.sizes] = member
        self._members.move_to_end(member.sizes)

    def _sizes(self, tensors: Sequence[Any]) -> tuple[tuple[int, ...] | None, str]:
        if self._fixed_signature(tensors) != self._fixed or len(tensors) != len(self._fixed):
            given = [(tuple(t.shape), t.dtype) for t in tensors if isinstance(t, torch.Tensor)]
            wanted = [(tuple(v.shape), v.dtype) for v in self._graph.inputs] if self._graph is not None else []
            return None, (f"inputs {shapes_text(given)} differ from the {shapes_text(wanted)} this program family was "
                          "built for in a dim or dtype that does not vary")
        sizes = []
        for d in self._dims:
            seen = {int(tensors[i].shape[a]) for i, a in d.inputs}
            if len(seen) > 1:
                return None, f"the inputs carrying dim '{d.name}' disagree on its size ({sorted(seen)})"
            s = seen.pop()
            if not d.min <= s <= d.max:
                return None, (f"dim '{d.name}' is {s}, outside the {d.min}..{d.max} this program family covers "
                              "(give optimize() a wider dynamic= range for a program there)")
            sizes.append(s)
        return tuple(sizes), ""

    def forward(self, *args, **kwargs):
        ordered = positional_call(args, kwargs, self._arity, self._keywords, self._settings)
        call = [v for i, v in enumerate(ordered) if i not in self._settings]
        return self._run_call(call, lambda: under_autocast(self.original, self._graph.autocast)(*args, **kwargs))

    def _run_call(self, call: list, original: Any):
        """The call's inputs in the traced model's order (keyword inputs after the positional ones, inputs
        without a tensor left out) through the member that serves their sizes; `original()` otherwise.
        A shape set seen before takes its route from a dict (no size arithmetic, no lock)."""
        key = tuple((t.shape, t.dtype) if isinstance(t, torch.Tensor) else None for t in call)
        route = self._routes.get(key) if None not in key else None
        if route is None:
            route = self._route(call)
            if None not in key and len(self._routes) < MAX_ROUTES:
                self._routes[key] = route
        sizes, member, why = route
        if member is None:
            return self._original(why, original)
        padded = member.sizes != sizes
        graph = member.module._graph
        warn_other_autocast(graph, self._warned)
        with member.lock:
            if padded:
                self.padded_calls += 1
                call = self._pad(member, call, sizes)
            tensors = [t for t in pytree.tree_flatten(tuple(call))[0] if isinstance(t, torch.Tensor)]
            outs = member.module._runner.executor.run([t.contiguous() for t in tensors])  # ATen steps exclude autocast
        if padded:
            outs = self._cut(outs, sizes, member.sizes)
        if member is not self._last:  # another member ran: the least recently used give their memory back
            self._last = member
            member.last_used = time.monotonic()
            with self._lock:
                self._members.move_to_end(member.sizes)
            self._release_idle()
        return pytree.tree_unflatten(graph.output_leaves(outs), graph.out_spec)

    def _route(self, call: list) -> tuple[tuple[int, ...] | None, Member | None, str]:
        """(the call's sizes, the member that runs them or None, why the original model runs instead)."""
        sizes, why = self._sizes(call)
        if sizes is None:
            return None, None, why
        member = self.member_for(sizes)
        if not member.runs_program:
            named = dict(zip((d.name for d in self._dims), member.sizes))
            return sizes, None, f"at sizes {named} {member.reason}"
        return sizes, member, ""

    def _original(self, why: str, original: Any):
        self.other_shape_calls += 1
        if why not in self._warned:
            self._warned.add(why)
            log.warning("%s: %s: the original model runs for these inputs", model_name(self.original), why)
        return original()

    def _pad(self, member: Member, call: list, sizes: tuple) -> list:
        """The call's inputs at the member's sizes: each padded input written straight into the program's
        own input buffer (the executor's static input, which run() then does not copy again), its tail
        along the padded axes zeroed — one copy of the call's rows, as an unpadded call makes."""
        axes: dict[int, dict[int, tuple[int, int]]] = {}
        for d, s, m in zip(self._dims, sizes, member.sizes):
            if s != m:
                for i, axis in d.inputs:
                    axes.setdefault(i, {})[axis] = (s, m)
        statics = member.module._runner.executor.static_inputs(torch.cuda.current_stream())
        out = list(call)
        for i, padded in axes.items():
            buf, t = statics[self._first_leaf[i]], out[i]
            region = buf
            for axis, (s, _) in padded.items():
                region = region.narrow(axis, 0, s)
            if len(padded) > 1:
                buf.zero_()
            else:
                ((axis, (s, m)),) = padded.items()
                buf.narrow(axis, s, m - s).zero_()
            region.copy_(t)
            out[i] = buf
        return out

    def _cut(self, outs: list, sizes: tuple, member: tuple) -> list:
        outs = list(outs)
        for d, s, m in zip(self._dims, sizes, member):
            if s != m:
                for j, axis in d.outputs:
                    outs[j] = outs[j].narrow(axis, 0, s)
        return outs

    def member_for(self, sizes: tuple[int, ...], any_larger: bool = False) -> Member:
        """The member serving `sizes`, built now (the whole pipeline at its size) when it is not yet.
        `any_larger`: a padded size goes to the smallest member already built that covers it, whatever
        its bucket (the range check builds only what no member covers)."""
        with self._lock:
            key, built = choose_member(self._dims, list(self._members), sizes)
            if not built and any_larger:
                covering = [m for m in self._members
                            if all(m[j] == s or (d.pad and m[j] >= s) for j, (d, s) in enumerate(zip(self._dims, sizes)))]
                if covering:
                    key, built = min(covering, key=math.prod), True
            if not built:
                self._add(self._build(key))
                self._routes.clear()  # a new member may serve shapes routed before more closely
            member = self._members[key]
            member.last_used = time.monotonic()
            self._members.move_to_end(key)
            return member

    def _build(self, sizes: tuple[int, ...]) -> Member:
        from .pipeline import run_pipeline

        t0 = time.perf_counter()
        named = dict(zip((d.name for d in self._dims), sizes))
        log.info("%s: building the program for %s (first call at these sizes)", model_name(self.original), named)
        inputs = resized_inputs(self._example_inputs, self._dims, sizes)
        # A member is judged like the example's program (every group checked, verified, faster than eager
        # at its size), without torch.compile's time, on its inputs and one fresh set (the resized
        # example repeats its rows: a kernel mixing rows up would pass on it alone).
        options = dataclasses.replace(self._options, compare_compile=False, progress=False,
                                      verify_sets=min(self._options.verify_sets, 2), llm=None, resume=None,
                                      run_dir=None)
        self.release()  # the member's build and checks never hold the others' working memory
        exported = None
        if self._symbolic is not None and self._symbols is not None:
            exported = lambda: specialize(self._symbolic, self._symbols, sizes)  # noqa: E731
        module = run_pipeline(self._traced, inputs, options, decided=self._decided, exported=exported)
        self.member_builds += 1
        reason = "" if module._runner is not None else module.report.reason
        if reason:
            log.warning("%s: at %s the original model runs: %s", model_name(self.original), named, reason)
        return Member(sizes, module, reason, time.perf_counter() - t0)

    def _release_idle(self) -> None:
        resident = [m for m in reversed(list(self._members.values())) if m.runs_program]
        for m in resident[MAX_RESIDENT:]:
            with m.lock:  # never under another thread's run of it (the executor frees what that run uses)
                m.module.release()

    def release(self) -> None:
        for m in list(self._members.values()):
            if m.runs_program:
                with m.lock:
                    m.module.release()

    @property
    def dims(self) -> list[DynamicDim]:
        """The dims that vary, as the range check left them (a dim may have lost its padding)."""
        return list(self._dims)

    @property
    def members(self) -> list[dict]:
        return [m.row(self._dims) for m in self._members.values()]

    def check_range(self) -> list[dict]:
        """Verifies the family at each dim's stress sizes (the others at the example), one call each, on fresh
        inputs against the original model; a padded dim that fails at a padded size is switched to exact
        members and checked again. Returns one row per size."""
        from ..verify.program import input_set, verify_whole

        rows = []
        for k, d in enumerate(self._dims):
            for s in stress_sizes(d):
                sizes = tuple(s if j == k else o.example for j, o in enumerate(self._dims))
                row = self._check_at(sizes, input_set, verify_whole)
                if not row["passed"] and row["padded"] and d.pad:
                    d.pad = False
                    self._routes.clear()
                    d.why_exact = f"padding {d.name} {s} -> {row['member'][k]} differs from the model: {row['detail']}"
                    log.warning("%s: %s; its sizes are built exactly", model_name(self.original), d.why_exact)
                    row = self._check_at(sizes, input_set, verify_whole)
                rows.append(row)
        return rows

    def _check_at(self, sizes, input_set, verify_whole) -> dict:
        t0 = time.perf_counter()
        builds = self.member_builds
        member = self.member_for(sizes, any_larger=True)
        built_s = time.perf_counter() - t0 if self.member_builds > builds else 0.0
        row = self._verify_at(sizes, member, input_set, verify_whole)
        # Where the range check's time goes: building a member, or verifying the call against the model.
        row["build_s"], row["verify_s"] = round(built_s, 3), round(time.perf_counter() - t0 - built_s, 3)
        return row

    def _verify_at(self, sizes, member: Member, input_set, verify_whole) -> dict:
        inputs = input_set(resized_inputs(self._example_inputs, self._dims, sizes), 1)
        row = {"sizes": dict(zip((d.name for d in self._dims), sizes)), "member": member.sizes,
               "padded": member.sizes != sizes, "runs": "program" if member.runs_program else "original"}
        if not member.runs_program:
            return {**row, "passed": True, "detail": member.reason}
        # Judged as the member's own verification judged it (TF32 convolutions: the model's own rounding).
        precision = member.module.report.verification.get("precision", self._options.precision)
        model = under_autocast(self._traced, self._graph.autocast)
        verdict = verify_whole(model, lambda *xs: self._run_call(list(xs), lambda: model(*xs)), inputs, 1,
                               precision, no_exact=self._no_truth_needed(precision), release=self.release)
        return {**row, "passed": bool(verdict.get("passed")), "detail": verdict.get("detail") or "",
                "max_abs_error": verdict.get("max_abs_error")}

    def _no_truth_needed(self, precision: str) -> str:
        """Why the range check makes no fp64 copy of the model (measure.no_truth_needed), or ""."""
        return no_truth_needed(self._graph, precision)

    def save(self, path) -> None:
        from ..program import ProgramFamily  # the artifact that holds every member

        members = [(m.sizes, m.module.program) for m in self._members.values() if m.runs_program]
        if not members:
            return super().save(path)
        # The family file counts inputs as the program does: the call's tensor leaves, in order.
        dims = [dict(name=d.name, min=d.min, max=d.max, pad=d.pad, inputs=[(self._first_leaf[i], a) for i, a in d.inputs],
                     outputs=list(d.outputs)) for d in self._dims]
        ProgramFamily(dims=dims, members=members).save(path)


def wall_breakdown(export_s: float, example_s: float, example: OptimizedModule, checks: list[dict],
                   members: Any) -> dict:
    """Where a dynamic optimize()'s wall time went, in seconds: export's symbolic trace, the example's
    program (and its stages), the members the range check built (and their stages, summed), and the range
    check's verification of each size against the model. What the members repeat of the example's work
    is what the family costs over a static optimize()."""
    built = [m for m in members if m.module is not None and m.module is not example]
    stages: dict[str, float] = {}
    for m in built:
        for k, v in m.module.report.stage_seconds.items():
            stages[k] = stages.get(k, 0.0) + v
    return {"export": round(export_s, 3), "example": round(example_s, 3),
            "example_stages": {k: round(v, 3) for k, v in example.report.stage_seconds.items()},
            "members": round(sum(r.get("build_s", 0.0) for r in checks), 3), "members_built": len(built),
            "member_stages": {k: round(v, 3) for k, v in stages.items()},
            "verify": round(sum(r.get("verify_s", 0.0) for r in checks), 3)}


def _family_export(model: torch.nn.Module, tensors: Sequence[Any], dims: list[DynamicDim]) -> tuple[Any, list[str], str]:
    """(the symbolic export lowered to core ATen or None, the guards, why it was not lowered): the guards
    need export's trace alone, so a lowering that fails leaves the family without specialized programs, not
    without its dims. DynamicShapeError where the model cannot vary them."""
    symbolic, unlowered = None, ""
    try:
        symbolic = export_symbolic(model, tensors, dims)
    except DynamicShapeError as exc:  # the trace, or its lowering to core ATen
        if str(exc).startswith("the model fixes"):  # the trace itself refused the dims
            raise
        unlowered = str(exc)
    guards = export_guards(model, tensors, dims, symbolic or export_symbolic(model, tensors, dims, lower=False))
    return symbolic, guards, unlowered


def _same_rank_carriers(dims: list[DynamicDim], tensors: Sequence[Any]) -> list[DynamicDim] | None:
    """"auto"'s batch on the inputs of the first carrier's rank only (a column bias whose extent is the
    batch's by chance is left out), or None where that leaves out none."""
    (d,) = dims
    rank = tensors[d.inputs[0][0]].dim()
    kept = [(i, a) for i, a in d.inputs if tensors[i].dim() == rank]
    return None if len(kept) == len(d.inputs) else [dataclasses.replace(d, inputs=kept, outputs=[])]


def optimize_dynamic(model: torch.nn.Module, tensors: tuple, options: OptimizeOptions,
                     names: Sequence[str] = ()) -> OptimizedModule:
    """run_pipeline for a call whose dims in `options.dynamic` may vary: the example's program, then the
    family around it (DynamicModule), checked over the range. A model that cannot vary the dims gets the
    example's program alone, and the report says why."""
    from .pipeline import run_pipeline

    dims = parse_dynamic(options.dynamic, tensors, names or parameter_names(model))
    t0 = time.perf_counter()
    symbols, exported, dropped = None, None, ""
    try:
        symbolic, guards, unlowered = _family_export(model, tensors, dims)
        refused = ""
    except DynamicShapeError as exc:
        symbolic, guards, unlowered, refused = None, [], "", str(exc)
        fewer = _same_rank_carriers(dims, tensors) if options.dynamic == AUTO else None
        if fewer is not None:  # "auto" may have taken an input whose axis 0 has the batch's extent by chance
            try:
                symbolic, guards, unlowered = _family_export(model, tensors, fewer)
                dropped = (f"'auto' varies the batch of {len(fewer[0].inputs)} of the {len(dims[0].inputs)} inputs "
                           f"whose axis 0 has its extent: with all of them, {refused}")
                dims, refused = fewer, ""
            except DynamicShapeError:
                pass
    # Every program of the family, the example's first, is read from the one symbolic export at its sizes
    # where it can be (graph/pipeline.py exports the model as usual where reading it fails).
    exported_again = specializable(model) if symbolic is not None else (
        f"the symbolic export was not lowered ({unlowered[:200]})" if unlowered else "no symbolic export")
    if not exported_again:
        symbols = dim_symbols(symbolic, dims)
        exported_again = "" if symbols is not None else "export tied a dim to an expression of another"
    if not exported_again:
        exported = lambda: specialize(symbolic, symbols, [d.example for d in dims])  # noqa: E731
    export_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    fast = run_pipeline(model, tensors, options, exported=exported)
    example_s = time.perf_counter() - t1
    if dropped:
        guards.append(dropped)
    info = {"dims": [dataclasses.asdict(d) for d in dims], "guards": guards, "export_s": round(export_s, 3),
            "members_captured": "exported again at each size: " + exported_again if exported_again
            else "specialized from one symbolic export"}
    fast.report.dynamic = info
    if refused:
        info["refused"] = refused
        log.warning("optimize(%s): %s; the program serves the example's shapes only", model_name(model), refused)
        fast.report.decisions.append(("dynamic= refused: the program serves the example's shapes only", refused))
        return fast
    if fast._runner is None:
        info["refused"] = "the example's program runs the original model, so every size does"
        return fast
    family = DynamicModule(model, fast, dims, tensors, options, guards, None if exported_again else symbolic, symbols)
    t1 = time.perf_counter()
    info["range_check"] = family.check_range()
    info["range_check_s"] = round(time.perf_counter() - t1, 3)
    info["wall_s"] = wall_breakdown(export_s, example_s, fast, info["range_check"], family._members.values())
    info["dims"] = [dataclasses.asdict(d) for d in dims]  # after the check: a dim may have lost its padding
    info["members"] = family.members
    passed = all(r["passed"] for r in info["range_check"])
    fast.report.decisions.append((
        f"dynamic: {len(dims)} dim(s) vary, {len(family._members)} member program(s) built so far",
        "; ".join(d.text() + (" padded to members" if d.pad else f" exact members ({d.why_exact})") for d in dims)))
    if not passed:
        bad = next(r for r in info["range_check"] if not r["passed"])
        info["refused"] = f"the family does not match the model at {bad['sizes']}: {bad['detail']}"
        log.warning("optimize(%s): %s; the program serves the example's shapes only", model_name(model),
                    info["refused"])
        return fast
    return family
