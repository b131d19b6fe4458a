"""PipelineState: what graph mode's stages (graph/pipeline.py) hand each other, in one typed object — the
call (model, inputs, options), the report being written, and what each stage adds (graph, plan, checked
values, the program built)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .capture import Graph
from .options import OptimizeOptions
from .groups import Group, GraphPlan
from .report import Report

__all__ = ["PipelineState", "Variant"]

# A program variant: (values stored channels-last, convolution epilogues fused in cuDNN).
Variant = tuple[frozenset, bool]


@dataclass
class PipelineState:
    """One optimize() call as it goes through the stages. Each field is filled by the stage named beside
    it and read by the later ones; `fallback` (ids of groups that run on ATen) only grows."""

    model: torch.nn.Module                      # the call: a module in eval mode taking positional tensors
    example_inputs: tuple
    options: OptimizeOptions
    report: Report = field(default_factory=Report)
    steps: Any = None                           # the progress view (stitchcuda.log.StepProgress)
    start_bytes: int = 0                        # GPU memory allocated when optimize() began
    pool: Any = None                            # the Verifier's worker pool for group checks (isolated=True)
    graph: Graph | None = None                  # capture
    plan: GraphPlan | None = None               # plan
    flat_inputs: list[torch.Tensor] = field(default_factory=list)  # plan: the inputs' tensors, flattened
    sm_count: int = 0                           # plan: the GPU's SMs
    fallback: set[int] = field(default_factory=set)                # check, agents, repair
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # check: values computed from weights
    values: dict[str, torch.Tensor] | None = None  # check, with the agents: every recorded value
    offline_groups: list[Group] = field(default_factory=list)     # check: the plan before the agents
    contiguous_inputs: list[torch.Tensor] = field(default_factory=list)  # build
    variants: list[Variant] = field(default_factory=list)         # build: the variants still to choose from
    optimized: Any = None                       # build: the OptimizedModule of the current program
    decided: Any = None                         # a dynamic family's member: the example's timed choices (build.Decided)
    exported: Any = None                        # dynamic: () -> the core-ATen program capture reads, not exporting

    @property
    def passed(self) -> bool:
        """Whether the current program's whole-program verification passed."""
        return bool(self.report.verification.get("passed"))
