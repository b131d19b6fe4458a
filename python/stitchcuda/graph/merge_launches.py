"""Horizontal fusion of a lowered program's launches: small launches of generated kernels that do not depend on
one another run as ONE launch of a generated kernel that calls each original body on its own range of blocks.

At batch 1 a forward is many small kernels (a decode step's rotary of q and of k, its two cache writes), and each
launch costs a microsecond or more in a CUDA graph whatever its size; merging k of them saves k - 1 of those.

Why the merged kernel computes exactly what the launches did: every block of the merged launch runs exactly one
original body, as its own function, with its own arguments (the same pointers and scalars), and ``blockIdx.x`` /
``gridDim.x`` / ``blockDim.x`` replaced by the block index, block count and block size it had in its own launch
(``blockIdx.x - offset`` and constants). The merged launch has the largest block of its bodies; a body of a smaller
block runs on its first threads and the others return at once, which is exact only for a body that synchronizes
no barrier and fills whole warps (such a body is merged only then). So each thread of each body performs the same
operations on the same elements in the same order as before; ``__syncthreads`` stays correct because a block
never mixes bodies and a body that synchronizes runs at its own block size.

The bodies of one merged launch run concurrently, so the pass only merges launches no step orders between: no
body reads or writes bytes another body writes (views share their base's storage: accesses are compared as byte
ranges of one root storage), and the launch lands where no step it depends on, or that depends on it, is crossed.
Only the templates' own kernels are merged (never a kernel step's source, an LLM's or a candidate's), and only
those whose text the rewrite understands: one ``__global__`` function, a one-dimensional grid and block, no
dynamic shared memory, no cluster or grid-wide synchronization, no block index read through assembly.

``program_builder(sm_count)`` is the Lowering's builder: a plain ProgramBuilder, or with
STITCHCUDA_MERGE_LAUNCHES=1 a MergingBuilder, which records the steps and applies the pass at build().
See docs/graph.md, "Merged launches".
"""

from __future__ import annotations

import ast
import hashlib
import heapq
import math
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import torch

from ..log import get_logger
from ..program import Program, ProgramBuilder, dtype_name
from ..settings import settings

__all__ = ["MergingBuilder", "program_builder", "mark_generated", "merge_decision", "with_merge_decision",
           "Mergeable", "mergeable_source", "Part", "fits", "merged_kernel", "MAX_BODIES", "WINDOW"]

MAX_BODIES = 8         # bodies per merged kernel: its dispatch is a chain of comparisons, and the source grows
WINDOW = 48            # steps between the first and the last launch of a merge: reordering stays local
WAVES = 2              # a merged launch holds at most WAVES * sm_count blocks: a big kernel gains nothing
SHARED_LIMIT = 32 << 10  # static shared bytes of all bodies together (each body's arrays are its own)

log = get_logger(__name__)

_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i32": 4, "i64": 8, "u8": 1, "bool": 1}
_SCALAR_TYPES = {"i32": "int", "i64": "long long", "f32": "float", "f64": "double"}
_TYPE_BYTES = {"float": 4, "int": 4, "unsigned": 4, "unsigned int": 4, "long long": 8, "unsigned long long": 8,
               "double": 8, "char": 1, "unsigned char": 1, "bool": 1, "short": 2, "__half": 2, "__nv_bfloat16": 2,
               "float2": 8, "float4": 16, "int4": 16, "int2": 8, "half2": 4, "__half2": 4, "__nv_bfloat162": 4}


def program_builder(sm_count: int = 132) -> ProgramBuilder:
    """The builder a Lowering assembles its program with: merging small launches when the setting is on."""
    return MergingBuilder(sm_count) if settings().merge_launches else ProgramBuilder()


def mark_generated(builder: ProgramBuilder, kernel: int) -> None:
    """Kernel table entry `kernel` holds a template's own source: a MergingBuilder may merge its launches."""
    if isinstance(builder, MergingBuilder):
        builder.generated.add(kernel)


def merge_decision(builder: ProgramBuilder) -> tuple[str, str] | None:
    """The report's decision on the launches the pass merged in the program `builder` built, or None."""
    if not isinstance(builder, MergingBuilder) or builder.summary is None:
        return None
    s = builder.summary
    if "error" in s:
        return ("no launches merged", f"the pass failed ({s['error']}): the program runs its launches apart, as "
                "built (STITCHCUDA_MERGE_LAUNCHES=1)")
    if not s["groups"]:
        return ("no launches merged", f"no two of the {s['candidates']} small launches of generated kernels were "
                "independent, near enough and of block sizes that fit together (STITCHCUDA_MERGE_LAUNCHES=1)")
    return (f"{s['merged']} kernel launches merged into {len(s['groups'])}",
            f"small launches of generated kernels that no step orders between run as one launch each "
            f"({', '.join(str(n) for n in s['groups'])} bodies); {s['launches_before']} launches became "
            f"{s['launches_after']} (STITCHCUDA_MERGE_LAUNCHES=1)")


def with_merge_decision(decisions: list, builder: ProgramBuilder) -> list:
    """`decisions` with the decision on the program `builder` built in place of one on an earlier build (a
    variant built again)."""
    kept = [d for d in decisions if "STITCHCUDA_MERGE_LAUNCHES=1" not in d[1]]
    decision = merge_decision(builder)
    return kept + ([decision] if decision else [])


# ---- which kernels can merge, and the merged source ----------------------------------------------------------

_GLOBAL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^()]*\)\s*)?(\w+)\s*\(')
_INDEX = re.compile(r"\b(blockIdx|gridDim|blockDim)\s*\.\s*x\b")
_REFUSED = re.compile(r"extern\s+__shared__|cooperative_groups|this_grid|grid_group|__cluster_dims__|clusterDim|"
                      r"%n?ctaid|%cluster|%nclusterid|blockIdx\s*\.\s*[yz]|gridDim\s*\.\s*[yz]")
_BARRIER = re.compile(r"__syncthreads|\bbar(?:rier)?\.|__barrier|thread_block|cooperative_groups")
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(\([^)]*\))?(?:[ \t]+(.*))?$", re.M)  # name, (params), body
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[^\n]*$", re.M)
_SHARED = re.compile(r"__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([A-Za-z_][\w ]*?)\s+(\w+)\s*"
                     r"((?:\[[^\]]*\]\s*)*);")


@dataclass(frozen=True)
class Part:
    """One launch to merge: its kernel's source and name, its grid (blocks along x), block (threads along x: blocks
    are one-dimensional), arguments, and whether the kernel synchronizes its block."""

    source: str
    name: str
    blocks: int
    threads: int
    args: tuple[tuple[str, Any], ...]
    barrier: bool = False


def fits(parts: Sequence[Part]) -> bool:
    """Whether `parts` can be bodies of one merged kernel, launched with the largest block among them: a body of a
    smaller block runs on its first threads (the others return at once), so it must synchronize no barrier (threads
    that returned would be missing from it) and fill whole warps (its warp-wide operations see full warps)."""
    threads = max(p.threads for p in parts)
    return all(p.threads == threads or (not p.barrier and p.threads % 32 == 0) for p in parts)


class Mergeable(NamedTuple):
    """mergeable_source's answer: whether a launch of the kernel may be a body of a merged kernel (`why` not),
    its static shared bytes, and whether it synchronizes its block (a body that does runs only at the merged
    launch's own block size)."""

    ok: bool
    why: str = ""
    shared: int = 0
    barrier: bool = False


def mergeable_source(source: str, name: str) -> Mergeable:
    """Whether the rewrite understands the kernel's source (see the module's docstring)."""
    kernels = _GLOBAL.findall(source)
    if len(re.findall(r"\b__global__\b", source)) != 1 or kernels != [name]:
        return Mergeable(False, "not exactly one __global__ function, the named one")
    if source.count('extern "C"') != 1:
        return Mergeable(False, 'another extern "C" declaration')
    refused = _REFUSED.search(source)
    if refused:
        return Mergeable(False, f"reads '{refused.group(0)}' (a grid of more than one dimension, clusters or dynamic "
                                "shared memory)")
    for word, parts in (("blockIdx", "x"), ("gridDim", "x"), ("blockDim", "xyz")):  # .y, .z of the grid refused above
        if len(re.findall(rf"\b{word}\b", source)) != len(re.findall(rf"\b{word}\s*\.\s*[{parts}]\b", source)):
            return Mergeable(False, f"reads {word} other than through {', '.join('.' + p for p in parts)}")
    shared = _static_shared_bytes(source)
    if shared is None:
        return Mergeable(False, "a __shared__ array whose size the pass cannot read")
    return Mergeable(True, "", shared, bool(_BARRIER.search(source)))


def _static_shared_bytes(source: str) -> int | None:
    """The bytes of the source's static __shared__ arrays, from their declarations and the integer macros they
    use; None when a type or an extent is not a plain number."""
    macros = {m.group(1): (m.group(3) or "").strip() for m in _DEFINE.finditer(source) if m.group(2) is None}
    total = 0
    for m in _SHARED.finditer(source):
        size = _TYPE_BYTES.get(" ".join(m.group(1).split()))
        if size is None:
            return None
        for extent in re.findall(r"\[([^\]]*)\]", m.group(3)):
            for _ in range(4):  # macros defined through other macros
                extent = re.sub(r"\b[A-Za-z_]\w*\b", lambda w: f"({macros[w.group(0)]})" if w.group(0) in macros
                                else w.group(0), extent)
            count = _integer(extent)
            if count is None:
                return None
            size *= count
        total += size
    if len(re.findall(r"\b__shared__\b", source)) != len(_SHARED.findall(source)):
        return None  # a declaration the pattern did not read
    return total


def _integer(text: str) -> int | None:
    """The value of an integer expression of literals, + - * / % and parentheses (C's division of non-negative
    numbers); None for anything else."""
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise ValueError

    try:
        return value(ast.parse(re.sub(r"(?<=\d)[uUlL]+\b", "", text.strip()), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return None


def _body(part: Part, index: int, offset: int) -> tuple[list[str], str]:
    """(the part's #include lines, its source as __device__ code in a namespace of its own): the kernel becomes a
    function of that name, blockIdx.x its block index in its own launch, gridDim.x and blockDim.x its own block
    count and block size."""
    includes = [line.strip() for line in _INCLUDE.findall(part.source)]
    text = _INCLUDE.sub("", part.source)
    text = _GLOBAL.sub(lambda m: f"__device__ __forceinline__ void {m.group(1)}(", text)
    own = {"gridDim": f"({part.blocks}u)", "blockDim": f"({part.threads}u)"}
    text = _INDEX.sub(lambda m: f"(blockIdx.x - {offset}u)" if m.group(1) == "blockIdx" else own[m.group(1)], text)
    undefs = "".join(f"#undef {m}\n" for m in dict.fromkeys(m.group(1) for m in _DEFINE.finditer(text)))
    return includes, f"namespace sc_body{index} {{\n{text}\n}}  // namespace sc_body{index}\n{undefs}"


def merged_kernel(parts: Sequence[Part]) -> tuple[str, str, list[tuple[str, Any]]]:
    """(source, entry point name, arguments) of the kernel running `parts` as one launch of sum(blocks) blocks of
    the largest block among them (`fits`), block b of part k at offset o_k running part k's body as its block
    b - o_k on its first threads. The name is a hash of the source, so the same parts give the same kernel in
    every program (the kernel cache compiles it once)."""
    threads = max(p.threads for p in parts)
    includes: list[str] = []
    bodies, params, calls, args = [], [], [], []
    offset = 0
    for k, part in enumerate(parts):
        inc, body = _body(part, k, offset)
        includes += [i for i in inc if i not in includes]
        bodies.append(body)
        names = []
        for j, (kind, value) in enumerate(part.args):
            pname = f"a{k}_{j}"
            if kind in ("in", "out", "inout"):
                params.append(f"void* {pname}")
                names.append(f"sc_pointer{{{pname}}}")
            else:
                params.append(f"{_SCALAR_TYPES[kind]} {pname}")
                names.append(pname)
            args.append((kind, value))
        offset += part.blocks
        call = f"sc_body{k}::{part.name}({', '.join(names)});"
        if part.threads < threads:
            call = f"if (threadIdx.x < {part.threads}u) {call}"
        calls.append(f"  if (blockIdx.x < {offset}u) {{ {call} return; }}")
    source = "\n".join([
        *includes,
        "// A merged launch (graph/merge_launches.py): each block runs one body below on its own block range.",
        *bodies,
        "// A buffer argument, converted to the pointer type the body declares.",
        "struct sc_pointer {",
        "  void* p;",
        "  template <class T> __device__ __forceinline__ operator T*() const { return static_cast<T*>(p); }",
        "};",
        f'extern "C" __global__ void __launch_bounds__({threads}) \0({", ".join(params)}) {{',
        *calls,
        "}",
        ""])
    name = "merged_" + hashlib.sha256(source.encode()).hexdigest()[:12]
    return source.replace("\0", name), name, args


# ---- the builder that records steps, and the pass ------------------------------------------------------------


@dataclass
class _Step:
    kind: str                     # launch, matmul, aten, view
    call: tuple                   # (args, kwargs) to replay
    reads: list[int] = field(default_factory=list)
    writes: list[int] = field(default_factory=list)
    part: Part | None = None      # a launch the pass may merge
    shared: int = 0


class MergingBuilder(ProgramBuilder):
    """A ProgramBuilder that records every call and, at build(), replays them into the native builder with the
    pass applied: the buffer ids it returns are the ones the native builder gives on replay (ids are dense, in
    creation order), kernel indices are its own (the built program's table holds the kernels its steps use)."""

    def __init__(self, sm_count: int = 132, *, max_bodies: int = MAX_BODIES, window: int = WINDOW) -> None:
        super().__init__()
        self.sm_count, self.max_bodies, self.window = max(1, int(sm_count)), int(max_bodies), int(window)
        self.generated: set[int] = set()
        self.summary: dict | None = None
        self._log: list[tuple[str, tuple, dict] | _Step] = []  # buffer creations and steps, in call order
        self._ids = 0
        self._storage: dict[int, tuple[int, int, float, str]] = {}  # buffer -> (root, first byte, end byte, dtype)
        self._kernels: list[tuple[str, str, tuple, dict]] = []
        self._settings: list[tuple[str, tuple, dict]] = []
        self._mergeable: dict[int, Mergeable] = {}  # kernel -> mergeable_source's answer

    # buffers: ids as the native builder will number them
    def _buffer(self, method: str, dtype: str, args: tuple, kwargs: dict) -> int:
        bid = self._ids
        self._ids += 1
        self._log.append((method, args, kwargs))
        self._storage[bid] = (bid, 0, float("inf"), dtype)
        return bid

    def input(self, shape, dtype="f32", **kw) -> int:
        return self._buffer("input", dtype_name(dtype), (shape, dtype), kw)

    def output(self, shape, dtype="f32", **kw) -> int:
        return self._buffer("output", dtype_name(dtype), (shape, dtype), kw)

    def intermediate(self, shape, dtype="f32", **kw) -> int:
        return self._buffer("intermediate", dtype_name(dtype), (shape, dtype), kw)

    def state(self, shape, dtype="f32", **kw) -> int:
        return self._buffer("state", dtype_name(dtype), (shape, dtype), kw)

    def weight(self, shape, dtype="f32", **kw) -> int:
        return self._buffer("weight", dtype_name(shape.dtype if isinstance(shape, torch.Tensor) else dtype),
                            (shape, dtype), kw)

    def view(self, kind: str, source: int, shape, *, strides=None, storage_offset: int = 0) -> int:
        bid = self._ids
        self._ids += 1
        root, first, _, dtype = self._storage[source]
        size = _ITEMSIZE.get(dtype)
        if size is None or first == float("inf"):
            self._storage[bid] = (root, 0, float("inf"), dtype)
        else:
            start = first + storage_offset * size
            self._storage[bid] = (root, start, start + _span(shape, strides) * size, dtype)
        self._log.append(_Step("view", ((kind, source, shape), dict(strides=strides, storage_offset=storage_offset)),
                               [source], [bid]))
        return bid

    def kernel(self, source: str, name: str, **kw) -> int:
        self._kernels.append((source, name, (), kw))
        return len(self._kernels) - 1

    def launch(self, kernel: int, grid, block, args, *, shared_mem: int = 0) -> "MergingBuilder":
        args = [tuple(a) for a in args]
        step = _Step("launch", ((kernel, grid, block, args), dict(shared_mem=shared_mem)))
        for kind, value in args:
            if kind in ("in", "inout"):
                step.reads.append(value)
            if kind in ("out", "inout"):
                step.writes.append(value)
        self._log.append(step)
        return self

    def matmul(self, a: int, b: int, c: int, *, bias: int | None = None, beta: float = 0.0, **kw) -> "MergingBuilder":
        reads = [a, b] + ([bias] if bias is not None else []) + ([c] if beta != 0.0 else [])
        self._log.append(_Step("matmul", ((a, b, c), dict(bias=bias, beta=beta, **kw)), reads, [c]))
        return self

    def aten(self, op: str, inputs, outputs, **attributes) -> "MergingBuilder":
        self._log.append(_Step("aten", ((op, list(inputs), list(outputs)), attributes), list(inputs), list(outputs)))
        return self

    def precision(self, *args, **kw) -> "MergingBuilder":
        self._settings.append(("precision", args, kw))
        return self

    def verified_on(self, **hardware: str) -> "MergingBuilder":
        self._settings.append(("verified_on", (), hardware))
        return self

    def build(self) -> Program:
        steps = [s for s in self._log if isinstance(s, _Step)]
        launches = sum(s.kind == "launch" for s in steps)
        try:
            for s in steps:
                self._candidate(s)
            order, groups = self._schedule(steps)
            program = self._replay(steps, order)
        except Exception as exc:
            # The program as recorded, unmerged: a fault of the pass costs the merging, not the program. (A
            # program invalid on its own raises again here, with the builder's own message.)
            self._b = ProgramBuilder()._b
            for s in steps:
                s.part = None
            program = self._replay(steps, [[i] for i in range(len(steps))])
            log.warning("merging launches failed, the program runs them apart: %s: %s", type(exc).__name__, exc)
            self.summary = {"candidates": 0, "groups": [], "merged": 0, "launches_before": launches,
                            "launches_after": launches, "error": f"{type(exc).__name__}: {exc}"}
            return program
        merged = sum(len(g) for g in groups)
        self.summary = {"candidates": sum(s.part is not None for s in steps), "groups": [len(g) for g in groups],
                        "merged": merged, "launches_before": launches,
                        "launches_after": launches - merged + len(groups)}
        return program

    # ---- the pass ----

    def _candidate(self, s: _Step) -> None:
        """Marks a launch the pass may merge: a template's kernel, a small one-dimensional grid, no dynamic
        shared memory, a source the rewrite understands."""
        if s.kind != "launch":
            return
        (kernel, grid, block, args), kw = s.call
        grid, block = _dims3(grid), _dims3(block)
        if kernel not in self.generated or kw.get("shared_mem", 0) or grid[1] != 1 or grid[2] != 1:
            return
        if self._kernels[kernel][3].get("options"):
            return  # NVRTC options of its own: the merged kernel compiles with none
        if grid[0] > WAVES * self.sm_count:
            return  # not small
        if any(kind not in ("in", "out", "inout", *_SCALAR_TYPES) for kind, _ in args):
            return
        source, name = self._kernels[kernel][:2]
        if kernel not in self._mergeable:
            self._mergeable[kernel] = mergeable_source(source, name)
        ok, _, shared, barrier = self._mergeable[kernel]
        if ok and shared <= SHARED_LIMIT and block[1] == block[2] == 1:
            s.part, s.shared = Part(source, name, grid[0], block[0], tuple(args), barrier), shared

    def _accesses(self, s: _Step) -> list[tuple[int, float, float, bool]]:
        """(root storage, first byte, end byte, writes) of each buffer the step reads or writes."""
        return [(*self._storage[b][:3], write) for write, buffers in ((False, s.reads), (True, s.writes))
                for b in buffers]

    def _conflicts(self, steps: list[_Step]) -> list[set[int]]:
        """For each mergeable launch, the other steps it must stay ordered with: those touching overlapping bytes
        of one storage, one of the two writing."""
        by_root: dict[int, list[tuple[int, float, float, bool]]] = {}
        for j, t in enumerate(steps):
            for root, first, end, write in self._accesses(t):
                by_root.setdefault(root, []).append((j, first, end, write))
        out: list[set[int]] = [set() for _ in steps]
        for i, s in enumerate(steps):
            if s.part is None:
                continue
            for root, first, end, write in self._accesses(s):
                out[i].update(j for j, f, e, w in by_root[root] if j != i and (write or w) and first < e and f < end)
        return out

    def _schedule(self, steps: list[_Step]) -> tuple[list[list[int]], list[list[int]]]:
        """(the steps' new order as nodes — a node is one step or a merged group of launches — and the groups).
        Steps other than mergeable launches keep their order; a mergeable launch keeps its order against every
        step it conflicts with; a group forms only where that leaves the order acyclic."""
        n = len(steps)
        succ: list[set[int]] = [set() for _ in range(n)]
        fixed = [i for i, s in enumerate(steps) if s.part is None]
        for a, b in zip(fixed, fixed[1:]):
            succ[a].add(b)
        for i, others in enumerate(self._conflicts(steps)):
            for j in others:
                succ[min(i, j)].add(max(i, j))
        rep = list(range(n))
        members: dict[int, list[int]] = {i: [i] for i in range(n)}
        desc = _descendants(n, succ, rep, members)
        open_groups: list[int] = []  # representatives of groups that may still grow
        for c in range(n):
            part = steps[c].part
            if part is None:
                continue
            for g in list(open_groups):
                first = members[g][0]
                parts = [steps[m] for m in members[g]]
                if c - first > self.window:
                    open_groups.remove(g)
                    continue
                if (not fits([p.part for p in parts] + [part]) or len(parts) >= self.max_bodies
                        or sum(p.part.blocks for p in parts) + part.blocks > WAVES * self.sm_count
                        or sum(p.shared for p in parts) + steps[c].shared > SHARED_LIMIT):
                    continue
                mask_g = sum(1 << m for m in members[g])
                if desc[g] >> c & 1 or desc[c] & mask_g:
                    continue  # a path between them: merging would put a step both before and after the group
                members[g].append(c)
                del members[c]
                rep[c] = g
                # The merged node reaches what either reached; whatever reached either now reaches both.
                mask = mask_g | 1 << c
                reach = (desc[g] | desc.pop(c)) & ~mask
                desc[g] = reach
                for u, d in desc.items():
                    if d & mask and u != g:
                        desc[u] = d | reach | mask
                break
            else:
                open_groups.append(c)
        order = _topological(n, succ, rep, members)
        return order, [m for m in members.values() if len(m) > 1]

    def _replay(self, steps: list[_Step], order: list[list[int]]) -> Program:
        """Replays the log into the native builder: buffers in creation order (same ids), fixed steps in their
        order, each mergeable launch or group where the schedule put it (before the next fixed step)."""
        index = {id(s): i for i, s in enumerate(steps)}
        kernels: dict[str, int] = {}

        def kernel(source: str, name: str, kw: dict) -> int:
            if source not in kernels:
                kernels[source] = ProgramBuilder.kernel(self, source, name, **kw)
            return kernels[source]

        def emit(node: list[int]) -> None:
            s = steps[node[0]]
            if s.kind == "view":
                bid = ProgramBuilder.view(self, *s.call[0], **s.call[1])
                if bid != s.writes[0]:
                    raise RuntimeError(f"merge_launches: replayed view got buffer {bid}, recorded {s.writes[0]}")
            elif s.kind == "launch" and len(node) == 1:
                (k, grid, block, args), kw = s.call
                source, name, _, kkw = self._kernels[k]
                ProgramBuilder.launch(self, kernel(source, name, kkw), grid, block, args, **kw)
            elif s.kind == "launch":
                parts = [steps[i].part for i in node]
                source, name, args = merged_kernel(parts)
                ProgramBuilder.launch(self, kernel(source, name, {}), [sum(p.blocks for p in parts)],
                                      [max(p.threads for p in parts)], args)
            else:
                getattr(ProgramBuilder, s.kind)(self, *s.call[0], **s.call[1])

        position = {node[0]: k for k, node in enumerate(order)}
        floating = [node for node in order if steps[node[0]].part is not None]
        queue = iter(floating)
        pending = next(queue, None)
        expected = 0  # the id the native builder gives the next buffer
        for entry in self._log:
            if isinstance(entry, _Step):
                i = index[id(entry)]
                if entry.part is not None:
                    continue  # emitted where the schedule put it
                while pending is not None and position[pending[0]] < position[i]:
                    emit(pending)
                    pending = next(queue, None)
                emit([i])
                expected += entry.kind == "view"
            else:
                method, args, kw = entry
                bid = getattr(ProgramBuilder, method)(self, *args, **kw)
                if bid != expected:
                    raise RuntimeError(f"merge_launches: replayed {method} got buffer {bid}, recorded {expected}")
                expected += 1
        while pending is not None:
            emit(pending)
            pending = next(queue, None)
        for method, args, kw in self._settings:
            getattr(ProgramBuilder, method)(self, *args, **kw)
        return ProgramBuilder.build(self)


def _dims3(v) -> tuple[int, int, int]:
    d = [int(v)] if isinstance(v, int) else [int(x) for x in v]
    return tuple(d + [1] * (3 - len(d)))  # type: ignore[return-value]


def _span(shape, strides) -> int:
    """Elements from a view's first to its last, plus one (0 when empty)."""
    shape = list(shape)
    if any(e == 0 for e in shape):
        return 0
    if strides is None:
        return math.prod(int(e) for e in shape)
    return 1 + sum((e - 1) * abs(st) for e, st in zip(shape, strides))


def _contracted(n: int, succ: list[set[int]], rep: list[int], members: dict[int, list[int]]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {g: set() for g in members}
    for i in range(n):
        for j in succ[i]:
            if rep[i] != rep[j]:
                out[rep[i]].add(rep[j])
    return out


def _topological(n: int, succ, rep, members) -> list[list[int]]:
    """The nodes (groups of steps) in an order every edge agrees with, the earliest original step first where
    several are ready."""
    edges = _contracted(n, succ, rep, members)
    indegree = {g: 0 for g in members}
    for g, outs in edges.items():
        for h in outs:
            indegree[h] += 1
    ready = [g for g, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        g = heapq.heappop(ready)
        order.append(members[g])
        for h in edges[g]:
            indegree[h] -= 1
            if indegree[h] == 0:
                heapq.heappush(ready, h)
    if len(order) != len(members):
        raise RuntimeError("merge_launches: the merged schedule has a cycle (a bug of the pass)")
    return order


def _descendants(n: int, succ, rep, members) -> dict[int, int]:
    """Every node's descendants as a bit mask of original step indices (a group's bit is each member's)."""
    edges = _contracted(n, succ, rep, members)
    desc: dict[int, int] = {}
    for group in reversed(_topological(n, succ, rep, members)):
        g = rep[group[0]]
        mask = 0
        for h in edges[g]:
            mask |= desc[h] | sum(1 << m for m in members[h])
        desc[g] = mask
    return desc
