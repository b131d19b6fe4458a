"""The Verifier: judges a candidate solution against a reference problem.

:func:`check` proves a candidate correct over varied trials, times it against eager PyTorch and
torch.compile, and applies the anti-hacking rules: static ones (:func:`analyze`, reading the source
without running it) and dynamic ones (poisoned outputs, both run orders, re-checked timed calls,
CUPTI). Candidates run in isolated worker processes (:class:`WorkerPool`). docs/verify.md has the rules.

It is also the one judge of everything else StitchCUDA measures or checks: :func:`measure` (the only
timer), :func:`tolerance` and :func:`first_difference` (the tolerance table and the comparator),
:func:`describe` (the GPU and its peaks), :func:`check_program` and :func:`verify_whole` (graph mode's
programs), and :func:`report_schema` (the versioned JSON of a report).
"""

from __future__ import annotations

from .check import check, compile_static
from .compare import compare_output, first_difference, fp64_error, max_abs_error
from .config import VerifyConfig
from .hardware import describe
from .pool import WorkerPool, default_pool, trusted_pool
from .program import check_program, verify_whole
from .report import ERROR_KINDS, SCHEMA_VERSION, OutputError, VerifyReport, report_schema
from .static import MAJOR, MINOR, Finding, analyze
from .task import Task, TaskError
from .timing import Timing, measure
from .tolerance import Tolerance, tolerance

__all__ = ["analyze", "Finding", "MAJOR", "MINOR", "check", "compile_static", "VerifyConfig",
           "VerifyReport", "OutputError", "ERROR_KINDS", "SCHEMA_VERSION", "report_schema", "Task", "TaskError",
           "Tolerance", "tolerance", "WorkerPool", "default_pool", "trusted_pool", "measure", "Timing", "describe",
           "compare_output", "first_difference", "fp64_error", "max_abs_error", "check_program", "verify_whole"]
