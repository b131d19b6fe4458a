"""The Verifier: judges a candidate solution against a reference problem.

:func:`check` proves a candidate correct over varied trials, times it against eager PyTorch and
torch.compile, and applies the anti-hacking rules: static ones (:func:`analyze`, reading the source
without running it) and dynamic ones (poisoned outputs, both run orders, re-checked timed calls,
CUPTI). Candidates run in isolated worker processes (:class:`WorkerPool`). docs/verify.md has the rules.
"""

from __future__ import annotations

from .check import check, compile_static
from .config import VerifyConfig
from .pool import WorkerPool, default_pool
from .report import ERROR_KINDS, OutputError, VerifyReport
from .static import MAJOR, MINOR, Finding, analyze
from .task import Task, TaskError, Tolerance

__all__ = ["analyze", "Finding", "MAJOR", "MINOR", "check", "compile_static", "VerifyConfig",
           "VerifyReport", "OutputError", "ERROR_KINDS", "Task", "TaskError", "Tolerance", "WorkerPool",
           "default_pool"]
