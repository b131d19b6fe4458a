"""Graph-mode targets: the groups (or merges of adjacent groups) an LLM Coder is asked to write a kernel
for. A target is a KernelBench-format sub-problem built from its groups' ATen nodes at the recorded
shapes, so program mode's prompts, Verifier, Rubric and run directory serve it unchanged; the Coder's
answer is a *kernel step* (CUDA source, launch configuration as expressions over the shapes, argument
binding) that the Program launches without Python.

    sub = subproblem(graph, [g1, g2, g3], values, name="t1")      # sub.source: Model, get_inputs, ...
    step = KernelStep.parse(text)                                # the Coder's answer, checked
    code = kernel_code(step, sub)                                # a KernelCode the lowering launches
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from .capture import Graph, Node, Value
from .groups import Group, GraphPlan
from .templates import KernelCode

__all__ = ["SubProblem", "KernelStep", "KernelStepError", "Target", "TargetError", "subproblem", "evaluate",
           "kernel_code", "wrapper_source", "group_ids", "describe_graph", "parse_targets", "floor_of",
           "COMPUTING"]

#: Group kinds that do work (views and constants cost nothing on their own).
COMPUTING = ("pointwise", "reduction", "gemm", "conv", "pool", "scan", "aten")


class KernelStepError(ValueError):
    """A kernel step that cannot be bound to its target: the message names the field and the fix."""


class TargetError(ValueError):
    """A target choice the graph does not allow (unknown group, groups not adjacent, used twice)."""


# ---- sub-problems ------------------------------------------------------------------------------


@dataclass
class SubProblem:
    """One target as a KernelBench-format problem: `source` defines Model (its forward runs the ATen
    nodes), get_inputs() (tensors of the recorded shapes and dtypes, values in the recorded ranges) and
    get_init_inputs(). `inputs`/`outputs` are the graph values bound to in0.. / out0..."""

    name: str
    source: str
    inputs: list[Value]
    outputs: list[Value]
    nodes: list[Node]

    def describe(self) -> str:
        """The buffers a kernel step binds, one line each (what the Coder is told)."""
        lines = []
        for k, v in enumerate(self.inputs):
            lines.append(f"- in{k}: {_dtype(v.dtype)}{list(v.shape)} contiguous (graph value `{v.name}`, {v.kind})")
        for k, v in enumerate(self.outputs):
            lines.append(f"- out{k}: {_dtype(v.dtype)}{list(v.shape)} contiguous, written by the kernel (graph value `{v.name}`)")
        return "\n".join(lines)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {**{f"in{k}": tuple(v.shape) for k, v in enumerate(self.inputs)},
                **{f"out{k}": tuple(v.shape) for k, v in enumerate(self.outputs)}}

    def build(self) -> tuple[torch.nn.Module, Any]:
        """(Model(), the module namespace) from the source: this process's own generated code."""
        namespace: dict[str, Any] = {"__name__": f"stitchcuda_subproblem_{self.name}"}
        exec(compile(self.source, f"<subproblem {self.name}>", "exec"), namespace)  # our own code, never a model's
        return namespace["Model"](), namespace


def _ident(name: str) -> str:
    return "v_" + re.sub(r"\W", "_", name)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _literal(value: Any, names: dict[str, str]) -> str:
    """Python source for one argument of an ATen call."""
    if isinstance(value, Value):
        return names[value.name]
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return "in0.device" if "in0" in names.values() else repr(str(value))
    if isinstance(value, torch.memory_format):
        return "torch." + str(value).removeprefix("torch.")
    if isinstance(value, torch.layout):
        return "torch." + str(value).removeprefix("torch.")
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, (bool, int, str)) or value is None:
        return repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_literal(v, names) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    raise KernelStepError(f"argument {value!r} ({type(value).__name__}) has no Python literal")


def _call(node: Node) -> str:
    target = node.target
    op = target._schema.name.split("::", 1)[1]
    return f"torch.ops.{target.namespace}.{op}.{target._overloadname}"


def _input_expr(v: Value, t: torch.Tensor | None) -> str:
    """A get_inputs() entry: values in the recorded range, so ops with a domain (log, sqrt, an index)
    see what they saw at capture."""
    shape = tuple(int(s) for s in v.shape)
    if t is None or t.numel() == 0:
        lo, hi = -1.0, 1.0
    elif t.dtype == torch.bool:
        return f"torch.rand({shape}) < 0.5"
    else:
        lo, hi = float(t.min()), float(t.max())
    if v.dtype.is_floating_point:
        if not (math.isfinite(lo) and math.isfinite(hi)):
            lo, hi = -1.0, 1.0
        return f"_uniform({shape}, {v.dtype}, {lo!r}, {hi!r})"
    return f"torch.randint({int(lo)}, {int(hi) + 1}, {shape}, dtype={v.dtype})"


def subproblem(graph: Graph, groups: Sequence[Group], values: dict[str, torch.Tensor], name: str,
               title: str = "") -> SubProblem:
    """The target made of `groups` (adjacent, in plan order) as a KernelBench-format problem."""
    nodes = [n for g in groups for n in g.nodes]
    merged = Group("target", nodes, "")
    graph_outputs = {v.name for v in graph.outputs}
    inputs = merged.inputs()
    outputs = merged.outputs(graph_outputs)
    if not outputs:
        raise TargetError(f"target {name} produces nothing used after it")
    names = {v.name: f"in{k}" for k, v in enumerate(inputs)}
    body = []
    for n in nodes:
        produced = [v for v in n.outputs if v is not None]
        for v in produced:
            names.setdefault(v.name, _ident(v.name))
        args = [_literal(a, names) for a in n.args] + [f"{k}={_literal(a, names)}" for k, a in n.kwargs.items()]
        call = f"{_call(n)}({', '.join(args)})"
        if len(n.outputs) == 1 and produced:
            body.append(f"        {names[produced[0].name]} = {call}")
        else:
            tmp = _ident(n.name) + "_all"
            body.append(f"        {tmp} = {call}")
            for k, v in enumerate(n.outputs):
                if v is not None:
                    body.append(f"        {names[v.name]} = {tmp}[{k}]")
    returned = ", ".join(names[v.name] for v in outputs)
    body.append(f"        return {returned}" + ("," if len(outputs) > 1 else ""))
    params = ", ".join(f"in{k}" for k in range(len(inputs)))
    made = []
    for v in inputs:
        data = v.data if v.kind == "weight" and v.data is not None else values.get(v.name)
        made.append(_input_expr(v, data))
    ops = ", ".join(n.op.removeprefix("aten::") for n in nodes)
    source = "\n".join([
        f'"""StitchCUDA target {name}{": " + title if title else ""}: {ops}, at the shapes the graph was',
        'captured with. Generated from the graph; every tensor the target reads is an input."""',
        "",
        "import torch",
        "",
        "",
        "def _uniform(shape, dtype, lo, hi):",
        "    return (torch.rand(shape, dtype=torch.float64) * (hi - lo) + lo).to(dtype)",
        "",
        "",
        "class Model(torch.nn.Module):",
        "    def forward(self, " + params + "):",
        *body,
        "",
        "",
        "def get_inputs():",
        "    return [" + ", ".join(made) + "]",
        "",
        "",
        "def get_init_inputs():",
        "    return []",
        "",
    ])
    return SubProblem(name, source, inputs, outputs, nodes)


# ---- kernel steps ------------------------------------------------------------------------------


@dataclass
class KernelStep:
    """A Coder's answer for a target (the C++ `agents::KernelStep`; its canonical text is JSON with
    "kernel_step": 1). Launch fields and scalar arguments are expressions over the target's shapes."""

    source: str
    kernel: str
    grid: list[str]
    block: list[str]
    shared_bytes: str = "0"
    args: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> "KernelStep":
        """From the canonical text, checked by the C++ parser (InvalidArgumentError names each problem)."""
        from .. import _C

        data = json.loads(_C.agents.kernel_step_parse(text))
        return cls(source=data["source"], kernel=data["kernel"], grid=list(data["grid"]), block=list(data["block"]),
                   shared_bytes=data["shared_bytes"], args=list(data["args"]))

    def to_json(self) -> str:
        return json.dumps({"kernel_step": 1, "kernel": self.kernel, "grid": self.grid, "block": self.block,
                           "shared_bytes": self.shared_bytes, "args": self.args, "source": self.source}, indent=2)


_BUFFER = re.compile(r"^(in|out)(\d+)$")


def _python_form(expr: str) -> str:
    """A launch expression as Python over tensors named in0.., out0..: `.numel` is called, `/` floors."""
    text = re.sub(r"\.numel\b(?!\s*\()", ".numel()", expr)
    return re.sub(r"(?<!/)/(?!/)", "//", text)


class _Shape:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def numel(self) -> int:
        return math.prod(self.shape)


def evaluate(expr: str, shapes: dict[str, tuple[int, ...]]) -> int | float:
    """The value of a launch expression for the given shapes ({"in0": (64, 4096), ...}). Only integers
    and floats, + - * / // %, in<k>/out<k>.shape[d] and .numel, ceil_div, min and max are allowed."""
    try:
        tree = ast.parse(_python_form(str(expr)), mode="eval")
    except SyntaxError as exc:
        raise KernelStepError(f"'{expr}' is not an expression: {exc.msg}") from None
    env = {name: _Shape(shape) for name, shape in shapes.items()}

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp):
            a, b = value(node.left), value(node.right)
            ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b,
                   ast.FloorDiv: lambda: a // b, ast.Mod: lambda: a % b}
            if type(node.op) not in ops:
                raise KernelStepError(f"'{expr}': operator {type(node.op).__name__} is not allowed")
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and b == 0:
                raise KernelStepError(f"'{expr}' divides by zero for these shapes")
            return ops[type(node.op)]()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
            args = [value(a) for a in node.args]
            if node.func.id == "ceil_div" and len(args) == 2:
                if args[1] == 0:
                    raise KernelStepError(f"'{expr}' divides by zero for these shapes")
                return -(-args[0] // args[1])
            if node.func.id in ("min", "max") and args:
                return (min if node.func.id == "min" else max)(args)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numel" \
                and not node.args:
            return _buffer(node.func.value).numel()
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
            shape = _buffer(node.value.value).shape
            index = value(node.slice)
            if not isinstance(index, int) or not -len(shape) <= index < len(shape):
                raise KernelStepError(f"'{expr}': dimension {index} does not exist (rank {len(shape)})")
            return shape[index]
        raise KernelStepError(f"'{expr}': {ast.unparse(node)} is not allowed in a launch expression (use in0..,"
                              " out0.., .shape[d], .numel, ceil_div, min, max and integers)")

    def _buffer(node: ast.AST) -> _Shape:
        if isinstance(node, ast.Name) and node.id in env:
            return env[node.id]
        known = ", ".join(sorted(env))
        raise KernelStepError(f"'{expr}': {ast.unparse(node)} is not a buffer of this target (there are {known})")

    return value(tree)


def _param_kinds(step: KernelStep) -> list[str]:
    """PTX kinds of the kernel's parameters (u64 for pointers and 64-bit integers, u32, f32...), from an
    NVRTC compile (no GPU needed; the disk cache keeps it)."""
    from .. import jit
    from ..errors import StitchError

    try:
        return [p.kind for p in jit.compile(step.source, step.kernel).params]
    except StitchError as exc:
        raise KernelStepError(f"the kernel does not compile: {str(exc).splitlines()[0]}") from None


def kernel_code(step: KernelStep, sub: SubProblem, kinds: Sequence[str] | None = None) -> KernelCode:
    """The kernel step as the lowering's KernelCode for `sub`'s recorded shapes: launch dimensions and
    shared memory evaluated, buffers bound to in0.. / out0.., scalars typed by the kernel's parameters."""
    shapes = sub.shapes()
    dims = []
    for what, exprs in (("grid", step.grid), ("block", step.block)):
        values = [evaluate(e, shapes) for e in exprs]
        if any(not isinstance(v, int) or v < 1 for v in values):
            raise KernelStepError(f"{what} {exprs} evaluates to {values} for these shapes: every entry must be a "
                                  "positive integer")
        dims.append(tuple(values) + (1,) * (3 - len(values)))
    grid, block = dims
    if math.prod(block) > 1024:
        raise KernelStepError(f"block {list(block)} has {math.prod(block)} threads; the limit is 1024")
    shared = evaluate(step.shared_bytes, shapes)
    if not isinstance(shared, int) or shared < 0:
        raise KernelStepError(f"shared_bytes '{step.shared_bytes}' evaluates to {shared}: a byte count >= 0")
    kinds = list(kinds) if kinds is not None else _param_kinds(step)
    if len(kinds) != len(step.args):
        raise KernelStepError(f"kernel {step.kernel} takes {len(kinds)} parameters, the step binds {len(step.args)}")
    args: list[tuple[str, object]] = []
    for k, (expr, kind) in enumerate(zip(step.args, kinds)):
        m = _BUFFER.match(expr.strip())
        if m:
            key = f"{m.group(1)}{m.group(2)}"
            if key not in shapes:
                raise KernelStepError(f"args[{k}] = {expr}: the target has no such buffer ({', '.join(shapes)})")
            if kind != "u64":
                raise KernelStepError(f"args[{k}] = {expr} is a buffer, but parameter {k} of {step.kernel} is not a pointer")
            args.append(("in" if m.group(1) == "in" else "out", key))
            continue
        value = evaluate(expr, shapes)
        scalar = {"u64": "i64", "s64": "i64", "u32": "i32", "s32": "i32", "f32": "f32", "f64": "f64"}.get(kind)
        if scalar is None:
            raise KernelStepError(f"args[{k}] = {expr}: parameter {k} of {step.kernel} ({kind}) takes no scalar")
        if scalar.startswith("i") and not isinstance(value, int):
            raise KernelStepError(f"args[{k}] = {expr} is {value}, parameter {k} is an integer")
        args.append((scalar, float(value) if scalar.startswith("f") else int(value)))
    return KernelCode(source=step.source, name=step.kernel, grid=grid, block=block, args=args,
                      description=f"LLM kernel step {step.kernel}", shared_mem=int(shared))


def wrapper_source(step: KernelStep, sub: SubProblem) -> str:
    """A ModelNew for `sub` that launches the kernel step through stitchcuda.jit: how the Verifier judges
    a kernel step with the same trials, timing and rules as any candidate. Launch values are computed
    from the input tensors' shapes at call time, as the Program computes them from the recorded ones."""
    params = ", ".join(f"in{k}" for k in range(len(sub.inputs)))
    lines = ["import torch", "from stitchcuda import jit", "", f"SOURCE = {step.source!r}", "", "",
             "def ceil_div(a, b):", "    return -(-a // b)", "", "",
             "class ModelNew(torch.nn.Module):", "    def __init__(self):", "        super().__init__()",
             f"        self.kernel = jit.compile(SOURCE, {step.kernel!r})", "",
             f"    def forward(self, {params}):"]
    for k in range(len(sub.inputs)):
        lines.append(f"        in{k} = in{k}.contiguous()")
    device = "in0.device" if sub.inputs else "'cuda'"
    for k, v in enumerate(sub.outputs):
        lines.append(f"        out{k} = torch.empty({tuple(int(s) for s in v.shape)}, dtype={v.dtype}, device={device})")
    args = []
    for expr in step.args:
        args.append(expr.strip() if _BUFFER.match(expr.strip()) else _python_form(expr))
    grid = ", ".join(_python_form(e) for e in step.grid)
    block = ", ".join(_python_form(e) for e in step.block)
    lines.append(f"        self.kernel(({grid},), ({block},), {', '.join(args)}, shared_mem={_python_form(step.shared_bytes)})")
    outs = ", ".join(f"out{k}" for k in range(len(sub.outputs)))
    lines.append(f"        return {outs}" + ("," if len(sub.outputs) > 1 else ""))
    return "\n".join(lines) + "\n"


# ---- what the Planner reads and chooses ------------------------------------------------------------


def group_ids(plan: GraphPlan) -> dict[str, Group]:
    """"g0", "g1"... for the plan's groups in order (views and constants included, so ids are stable)."""
    return {f"g{k}": g for k, g in enumerate(plan.groups)}


def floor_of(groups: Sequence[Group], graph: Graph, dram_bytes_per_s: float, flops_per_s: float) -> dict[str, float]:
    """Speed-of-light of a group (or merge): bytes it must read and write at DRAM bandwidth, FLOPs of its
    matmuls and convolutions at the FP32 peak; max of the two (us)."""
    merged = Group("target", [n for g in groups for n in g.nodes], "")
    outputs = {v.name for v in graph.outputs}
    nbytes = sum(v.numel * v.dtype.itemsize for v in merged.inputs()) + \
        sum(v.numel * v.dtype.itemsize for v in merged.outputs(outputs))
    flops = 0.0
    for n in merged.nodes:
        out = n.outputs[0] if n.outputs else None
        if out is None:
            continue
        if n.op in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"):
            a = next((v for v in n.inputs if len(v.shape) >= 2), None)
            k = a.shape[-1] if a is not None else 0
            flops += 2.0 * out.numel() * k
        elif n.op == "aten::convolution":
            w = n.args[1] if len(n.args) > 1 and isinstance(n.args[1], Value) else None
            if w is not None:
                flops += 2.0 * out.numel() * math.prod(w.shape[1:])
    memory_us = nbytes / dram_bytes_per_s * 1e6 if dram_bytes_per_s else 0.0
    compute_us = flops / flops_per_s * 1e6 if flops_per_s else 0.0
    return {"bytes": float(nbytes), "flops": flops, "floor_us": max(memory_us, compute_us)}


def describe_graph(plan: GraphPlan, graph: Graph, profile: dict[str, dict] | None, limit: int = 80) -> str:
    """The compact table the Planner reads: one line per computing group with its ops, shapes, dtypes,
    measured time, floor and the offline strategy (the `limit` heaviest when there are more)."""
    lines = ["| id | kind | ops | reads | writes | measured us | launches | floor us | offline strategy |",
             "|---|---|---|---|---|---:|---:|---:|---|"]
    outputs = {v.name for v in graph.outputs}
    shown = [gid for gid, g in group_ids(plan).items() if g.kind in COMPUTING]
    if len(shown) > limit:  # a large model: the heaviest groups, in graph order, and how many were left out
        heavy = sorted(shown, key=lambda gid: -((profile or {}).get(gid, {}).get("time_us") or 0.0))[:limit]
        keep = set(heavy)
        left_out = len(shown) - limit
        shown = [gid for gid in shown if gid in keep]
    else:
        left_out = 0
    ids = group_ids(plan)
    for gid in shown:
        g = ids[gid]
        ops = ", ".join(n.op.removeprefix("aten::") for n in g.nodes)
        reads = "; ".join(f"{_dtype(v.dtype)}{list(v.shape)}" for v in g.inputs())
        writes = "; ".join(f"{_dtype(v.dtype)}{list(v.shape)}" for v in g.outputs(outputs))
        p = (profile or {}).get(gid, {})
        measured = f"{p['time_us']:.1f}" if p.get("time_us") is not None else "-"
        launches = f"{p['launches']:.0f}" if p.get("launches") is not None else "-"
        floor = f"{p['floor_us']:.1f}" if p.get("floor_us") is not None else "-"
        lines.append(f"| {gid} | {g.kind} | {ops} | {reads} | {writes} | {measured} | {launches} | {floor} | "
                     f"{g.reason} |")
    if left_out:
        lines.append(f"\n({left_out} lighter group(s) not shown; ids are in graph order, gaps between them are "
                     "groups not shown)")
    return "\n".join(lines)


@dataclass
class Target:
    """Groups (adjacent, in plan order) one LLM kernel is to replace, and the Planner's strategy."""

    id: str
    groups: list[str]
    strategy: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "groups": self.groups, "strategy": self.strategy}


def parse_targets(reply: str, plan: GraphPlan, limit: int = 0) -> list[Target]:
    """The Planner's choice: JSON {"targets": [{"groups": ["g3", "g4"], "strategy": "..."}]} (prose or a
    ```json fence around it is fine). Groups must exist, do work, be adjacent (only views and constants
    between them) and belong to one target each. TargetError lists every problem."""
    data = _first_object(reply)
    if not isinstance(data, dict) or not isinstance(data.get("targets"), list):
        raise TargetError('the reply holds no JSON object {"targets": [{"groups": [...], "strategy": "..."}]}')
    ids = group_ids(plan)
    order = list(ids)
    problems: list[str] = []
    used: dict[str, int] = {}
    targets: list[Target] = []
    for k, entry in enumerate(data["targets"]):
        where = f"targets[{k}]"
        if not isinstance(entry, dict):
            problems.append(f"{where}: not an object")
            continue
        groups = entry.get("groups")
        if isinstance(groups, str):
            groups = [groups]
        if not isinstance(groups, list) or not groups or not all(isinstance(g, str) for g in groups):
            problems.append(f"{where}.groups: a non-empty list of group ids")
            continue
        bad = [g for g in groups if g not in ids]
        if bad:
            problems.append(f"{where}.groups: unknown {', '.join(bad)}")
            continue
        idle = [g for g in groups if ids[g].kind not in COMPUTING]
        if idle:
            problems.append(f"{where}.groups: {', '.join(idle)} do no work (views/constants)")
            continue
        positions = sorted(order.index(g) for g in groups)
        between = [order[p] for p in range(positions[0], positions[-1] + 1)]
        gap = [g for g in between if g not in groups and ids[g].kind in COMPUTING]
        if gap:
            problems.append(f"{where}.groups: not adjacent ({', '.join(gap)} lies between them; add it or split the target)")
            continue
        twice = [g for g in groups if g in used]
        if twice:
            problems.append(f"{where}.groups: {', '.join(twice)} already in targets[{used[twice[0]]}]")
            continue
        for g in groups:
            used[g] = k
        strategy = entry.get("strategy", "")
        targets.append(Target(f"t{len(targets) + 1}", [order[p] for p in positions], str(strategy)))
    if limit and len(targets) > limit:
        problems.append(f"{len(targets)} targets; at most {limit} (keep the heaviest)")
    if problems:
        raise TargetError("; ".join(problems))
    return targets


def _first_object(text: str) -> Any:
    """The first balanced JSON object in `text` that parses."""
    start = text.find("{")
    while start >= 0:
        depth, in_str, esc = 0, False, False
        for i in range(start, len(text)):
            c = text[i]
            if in_str:
                esc = (c == "\\") and not esc
                if c == '"' and not esc:
                    in_str = False
                continue
            if c == '"':
                in_str = True
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    try:
                        return json.loads(text[start:i + 1])
                    except ValueError:
                        break
        start = text.find("{", start + 1)
    return None


def merged_group(groups: Iterable[Group], code: KernelCode, sub: SubProblem, winner: str) -> Group:
    """The groups of a target as one group of kind "kernel_step" that the lowering launches as `code`."""
    nodes = [n for g in groups for n in g.nodes]
    return Group("kernel_step", nodes, f"{winner} kernel step {code.name}",
                 params={"code": code, "inputs": sub.inputs, "outputs": sub.outputs})
