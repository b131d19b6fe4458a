"""``check(reference, candidate)``: the Verifier's entry point. Static analysis runs here (it never
executes the candidate); everything that runs candidate code happens in a pool worker.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ..cli_support import read_bounded_text
from .config import VerifyConfig
from .pool import WorkerPool, default_pool
from .report import VerifyReport, build_feedback
from .static import MAJOR, analyze
from .static_compile import STATIC_UNDECIDED, compile_static  # noqa: F401 - re-exported
from .task import Task, TaskError

__all__ = ["check", "compile_static", "load_candidate_source"]


# A problem or a candidate is a Python file of kilobytes; one of megabytes is no honest source, and the
# static analysis, which runs in the caller, takes time in proportion to the size (docs/security.md gives
# the measurement): 1 MiB bounds it.
MAX_SOURCE_BYTES = 1 << 20


def _read(obj: Any, what: str, limit: int | None = MAX_SOURCE_BYTES) -> tuple[str, str]:
    """(source, name) from a path or source text; ValueError with a clear reason. A path is read as every
    entry reads a source (cli_support.read_bounded_text: a regular file, at most ``limit`` bytes)."""
    if isinstance(obj, os.PathLike) or (isinstance(obj, str) and "\n" not in obj
                                        and (obj.strip().endswith(".py") or os.path.exists(obj))):
        path = os.fspath(obj)
        return read_bounded_text(path, limit, label=f"the {what} {path!r}", kind="source file",
                                 fix="pass a .py file", error=ValueError), path
    if isinstance(obj, str):
        if not obj.strip():
            raise ValueError(f"the {what} is empty.")
        if limit is not None and len(obj) > limit:
            raise ValueError(f"the {what} is {len(obj)} characters, more than the {limit} a source may have")
        return obj, f"<{what}>"
    raise ValueError(f"the {what} must be a path or Python source, got {type(obj).__name__}.")


def load_candidate_source(candidate: Any) -> tuple[str, str]:
    """(source, file name used in tracebacks) of a candidate given as a path or as source text."""
    return _read(candidate, "candidate")


def check(reference: Task | str | os.PathLike, candidate: str | os.PathLike, *,
          config: VerifyConfig | None = None, static_only: bool = False,
          pool: WorkerPool | None = None, trusted: bool = False) -> VerifyReport:
    """Verifies ``candidate`` (a path or source defining ModelNew) against ``reference`` (a Task, or a
    KernelBench problem as a path or source). Never raises for bad input: the report's ``error`` says
    what is wrong. ``static_only`` compiles the candidate's CUDA with NVRTC and applies the static
    rules, needing no GPU; otherwise the candidate runs in ``pool`` (default: a process-wide pool).
    ``trusted``: the candidate is StitchCUDA's own code (the template path of a graph-mode target): the
    source rules, written for untrusted code, are skipped; correctness, timing and the dynamic rules apply."""
    started = time.perf_counter()
    if isinstance(config, dict):
        config = VerifyConfig.from_dict(config, strict=True)
    elif config is not None and not isinstance(config, VerifyConfig):
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"check: config must be a VerifyConfig, a dict of its fields or None, not "
                                   f"{type(config).__name__} {config!r:.60}")
    config = config or VerifyConfig()
    report = VerifyReport(static_only=static_only)

    # Candidate first: its static findings are useful even when the reference is broken.
    try:
        # StitchCUDA's own programs (trusted) may embed their kernels and constants: no size bound for them.
        cand_source, cand_name = _read(candidate, "candidate", None if trusted else MAX_SOURCE_BYTES)
    except ValueError as exc:
        return _finish(report.fail("bad-candidate", str(exc)), started)

    task: Task | None = None
    ref_error = None
    if isinstance(reference, Task):
        task = reference
    else:
        try:
            ref_source, ref_name = _read(reference, "reference")
            name = os.path.splitext(os.path.basename(ref_name))[0] if not ref_name.startswith("<") else "problem"
            task = Task.from_source(ref_source, name, filename=ref_name if not ref_name.startswith("<") else None,
                                    isolated=True)
        except (ValueError, TaskError) as exc:
            ref_error = str(exc)

    if static_only:
        # The analysis and NVRTC run in the sandboxed worker, under the compile limit and the pool's
        # memory limit: a preprocessor bomb or a pathological source costs the worker, not the caller.
        job = {"kind": "static", "candidate": cand_source, "reference_source": task.source if task is not None else None,
               "reference_error": ref_error, "trusted": trusted, "config": config.to_dict()}
        try:
            result = (pool or default_pool()).run(job, config.compile_time_limit_s, config.run_time_limit_s)
        except Exception as exc:  # the pool itself failed: report it, never raise
            return _finish(report.fail("crash", f"the verification worker pool failed: {type(exc).__name__}: {exc}"),
                           started)
        static = VerifyReport.from_dict(result)
        static.static_only = True
        return _finish(static, started, static.compile_log)

    report.findings = [] if trusted else list(analyze(cand_source, task.source if task is not None else None))
    if any(f.rule in ("syntax-error", "no-model-new") for f in report.findings):
        f = next(f for f in report.findings if f.rule in ("syntax-error", "no-model-new"))
        report.fail("bad-candidate", f.message + (f" (line {f.line})" if f.line else ""))
        return _finish(report, started)
    if ref_error is not None:
        return _finish(report.fail("bad-reference", ref_error), started)
    if not config.run_hacks and any(f.severity == MAJOR for f in report.findings):
        report.hack = True
        report.timing["not_run"] = ("the source rules found a hack and VerifyConfig.run_hacks is off: the "
                                    "candidate was neither compiled nor run")
        return _finish(report, started)

    job = {"reference": task.to_spec(), "candidate": cand_source, "candidate_name": cand_name,
           "config": config.to_dict(),
           "recycle_after": any(f.rule == "patches-timing" for f in report.findings), "trusted": trusted}
    try:
        pool = pool or default_pool()
        result = pool.run(job, config.compile_time_limit_s, config.run_time_limit_s)
    except Exception as exc:  # the pool itself failed: report it, never raise
        return _finish(report.fail("crash", f"the verification worker pool failed: {type(exc).__name__}: {exc}"),
                       started)
    dynamic = VerifyReport.from_dict(result)
    dynamic.static_only = False
    static = [f for f in report.findings]
    dynamic.findings = _merge(static, dynamic.findings)
    dynamic.hack = any(f.severity == MAJOR for f in dynamic.findings)
    return _finish(dynamic, started)


def _merge(static, dynamic):
    seen = set()
    out = []
    for f in [*static, *dynamic]:
        key = (f.rule, f.line, f.evidence)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def _finish(report: VerifyReport, started: float, compile_log: str = "") -> VerifyReport:
    report.hack = any(f.severity == MAJOR for f in report.findings)
    if report.error is not None:
        report.correct = False
    if compile_log:
        report.compile_log = compile_log
    report.feedback = build_feedback(report)
    report.wall_s = time.perf_counter() - started
    return _redacted(report)


def _redacted(report: VerifyReport) -> VerifyReport:
    """The report without any secret the process knows: a candidate that read a key (from a file, the
    parent's environment) cannot send it back through its outputs, errors or logs."""
    from .. import _C

    text = report.to_json()
    clean = _C.secrets.redact(text)
    if clean == text:
        return report
    try:
        again = VerifyReport.from_dict(json.loads(clean))
    except ValueError:  # masking never breaks JSON (digits are kept); if it did, drop the text fields
        again = report
        again.feedback = again.compile_log = "[redacted]"
        return again
    again.static_only = report.static_only
    return again
