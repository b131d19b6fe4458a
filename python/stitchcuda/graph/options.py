"""OptimizeOptions: optimize()'s keyword arguments as one typed object the pipeline's stages read
(graph/pipeline.py); optimize(model, args, kwargs, **options) builds it."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["OptimizeOptions", "BUDGET_S"]

# Seconds of generating and checking groups after which the rest stay on ATen (optimize's budget_s).
BUDGET_S = 60.0


@dataclass(frozen=True)
class OptimizeOptions:
    """What optimize() was asked to do; each field is the keyword argument of the same name (optimize()'s
    docstring says what each does)."""

    llm: Any = None
    precision: str = "fp32"
    graphs: bool = True
    verify_sets: int = 3
    measure: bool = True
    compare_compile: bool = True
    progress: bool | None = None
    isolated: bool = True
    run_dir: str | os.PathLike | None = None
    resume: str | os.PathLike | None = None
    attempts: int = 3
    tokens: int = 0
    wall_s: float = 0.0
    max_targets: int = 4
    concurrency: int = 4
    on_event: Any = None
    budget_s: float = BUDGET_S
    keep_slower: bool = False
    split_tf32: bool = True
    dynamic: Any = None

    @property
    def agents(self) -> bool:
        """Whether the agents join in after the offline plan (an LLM, or a run to resume)."""
        return self.llm is not None or self.resume is not None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
