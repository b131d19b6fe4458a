"""The plan's data types: a Group (a unit of the plan with its strategy and reason) and the GraphPlan
(groups in execution order and the host decisions), which the Planner writes and every later stage reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from .capture import Node, Value

__all__ = ["Group", "GraphPlan", "GENERATED"]

# Group kinds whose code the template Coder writes (and optimize checks against ATen before use). An
# attention group (written-out attention as one step: SDPA or the fused template) is checked too, and so is a
# gemv group (sibling projections of decode's shape as one kernel, templates/gemv.py).
GENERATED = ("gemm", "pointwise", "reduction", "conv", "pool", "scan", "attention", "gemv")


@dataclass
class Group:
    """A unit of the plan: `kind` in gemm, pointwise, reduction, conv, pool, scan, attention, gemv, view,
    constant, aten."""

    kind: str
    nodes: list[Node]
    reason: str
    params: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.nodes[-1].name if self.nodes else "?"

    def outputs(self, graph_outputs: set[str]) -> list[Value]:
        """Values of the group used after it (by nodes outside it, or as graph outputs)."""
        inside = {id(n) for n in self.nodes}
        internal = self.params.get("relayout", {}).get("internal", ())
        out: list[Value] = []
        for n in self.nodes:
            for v in n.outputs:
                if v is None or v.name in internal:
                    continue
                if v.name in graph_outputs or any(id(u) not in inside for u in v.users):
                    out.append(v)
        return out

    def inputs(self) -> list[Value]:
        """Values the group reads that it does not produce."""
        produced = {v.name for n in self.nodes for v in n.outputs if v is not None}
        seen: dict[str, Value] = {}
        for n in self.nodes:
            for v in n.inputs:
                if v.name not in produced:
                    seen.setdefault(v.name, v)
        return list(seen.values())


@dataclass
class GraphPlan:
    """Groups in execution order and the host-side decisions, each with its reason."""

    groups: list[Group]
    decisions: list[tuple[str, str]]  # (decision, reason)
    precision: str
    channels_last: frozenset[str] = frozenset()  # values stored NHWC (graph/layout.py)
    # Convolutions whose epilogue cuDNN can run fused (conv_epilogues): id of the epilogue's pointwise
    # group -> the match; lowered as one fused ATen step only while fuse_conv_epilogues is on (optimize
    # times the program both ways and keeps the faster).
    conv_epilogues: dict = field(default_factory=dict)
    fuse_conv_epilogues: bool = False
    # The precision whose tolerance judges the program's outputs against the model's ("": `precision`'s):
    # "tf32" for an fp32 plan whose model runs its fp32 convolutions with TF32 (cuDNN's flag, on by
    # PyTorch's default), where the model's own result carries TF32's rounding and another cuDNN
    # algorithm (NHWC, a folded batch norm) rounds differently, beyond fp32's 1e-4.
    judged_at: str = ""

    @property
    def tolerance_precision(self) -> str:
        return self.judged_at or self.precision

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for g in self.groups:
            counts[g.kind] = counts.get(g.kind, 0) + 1
        return counts
