"""``check(reference, candidate)``: the Verifier's entry point. Static analysis runs here (it never
executes the candidate); everything that runs candidate code happens in a pool worker.
"""

from __future__ import annotations

import ast
import json
import os
import stat
import time
from typing import Any

from ..errors import CompileError, StitchError
from .config import VerifyConfig
from .pool import WorkerPool, default_pool
from .report import VerifyReport, build_feedback
from .static import MAJOR, _Analysis, _Reference, analyze
from .task import Task, TaskError

__all__ = ["check", "compile_static", "load_candidate_source"]


# A problem or a candidate is a Python file of kilobytes; one of megabytes is no honest source, and the
# static analysis, which runs in the caller, takes time in proportion to the size (docs/security.md gives
# the measurement): 1 MiB bounds it.
MAX_SOURCE_BYTES = 1 << 20


def _read(obj: Any, what: str, limit: int | None = MAX_SOURCE_BYTES) -> tuple[str, str]:
    """(source, name) from a path or source text; TaskError-like ValueError with a clear reason.
    Only regular files are read (a FIFO or a device would block or never end), at most MAX_SOURCE_BYTES."""
    if isinstance(obj, os.PathLike) or (isinstance(obj, str) and "\n" not in obj
                                        and (obj.strip().endswith(".py") or os.path.exists(obj))):
        path = os.fspath(obj)
        try:
            info = os.stat(path)
        except OSError as exc:
            raise ValueError(f"cannot read the {what} {path!r}: {exc.strerror}") from None
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"the {what} {path!r} is not a regular file (a FIFO, device or folder is never read): "
                             "pass a .py file")
        if limit is not None and info.st_size > limit:
            raise ValueError(f"the {what} {path!r} is {info.st_size} bytes, more than the {limit} a "
                             "source file may have")
        try:
            with open(path, encoding="utf-8") as f:
                return f.read(limit + 1 if limit is not None else -1), path
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the {what} {path!r}: {exc.strerror if isinstance(exc, OSError) else exc}") \
                from None
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


def run_static_job(job: dict[str, Any]) -> dict[str, Any]:
    """A static-only check, in the worker: the source rules and the NVRTC compile of the candidate's
    literal CUDA sources (``check(..., static_only=True)`` sends it here)."""
    report = VerifyReport(static_only=True)
    started = time.perf_counter()
    source = job["candidate"]
    report.findings = [] if job.get("trusted") else list(analyze(source, job.get("reference_source")))
    bad = next((f for f in report.findings if f.rule in ("syntax-error", "no-model-new")), None)
    if bad is not None:
        report.fail("bad-candidate", bad.message + (f" (line {bad.line})" if bad.line else ""))
    elif job.get("reference_error"):
        report.fail("bad-reference", job["reference_error"])
    else:
        compiled, log, errors = compile_static(source)
        report.compiled = compiled
        report.timing["static_compile"] = errors
        report.undecided = list(STATIC_UNDECIDED)
        report.compile_log = log
        if not compiled:
            report.fail("compile", "NVRTC could not compile the candidate's CUDA.")
    report.hack = any(f.severity == MAJOR for f in report.findings)
    report.wall_s = time.perf_counter() - started
    return report.to_dict()


def _merge(static, dynamic):
    seen = set()
    out = []
    for f in [*static, *dynamic]:
        key = (f.rule, f.line, f.evidence)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


# The hack families a static-only check cannot decide, each with the dynamic check that decides it: a
# static-only report lists them, so "no major finding" is never read as "no hack".
STATIC_UNDECIDED = (
    "correctness: whether every output is right (correctness trials on fresh inputs)",
    "results kept across calls — caches keyed on shapes, values or call counts (inputs refilled between "
    "timed calls, timed outputs re-checked)",
    "work left outside the timer or done on too little data (CUPTI trace window, speed-of-light bound)",
    "whose kernels did the GPU work (CUPTI attribution: the candidate's own, a library's, ATen's)",
    "code the analysis could not read, if any (findings marked opaque-code or introspection)",
)


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


# ----------------------------------------------------------------------------------------------
# static_only: NVRTC compile without a GPU


_OPTION_KEYWORDS = ("arch", "std", "defines", "headers", "fast_math", "line_info", "max_registers",
                    "name_expressions", "extra_flags", "include_paths")


def compile_static(source: str) -> tuple[bool, str, list[dict[str, Any]]]:
    """Compiles every CUDA source the candidate passes to stitchcuda.jit.compile/compile_module with
    NVRTC (no GPU needed). Returns (all compiled, compiler log mapped to candidate lines, one record
    per compile call: line, status "compiled" / "failed" / "skipped", detail)."""
    from .. import jit

    try:
        tree = ast.parse(source)
        analysis = _Analysis(source, tree, _Reference.parse(None))
        analysis.find_compiles()
    except (SyntaxError, ValueError, RecursionError) as exc:
        return False, f"the candidate cannot be parsed: {exc}", []
    records: list[dict[str, Any]] = []
    logs: list[str] = []
    ok = True
    for call in analysis.compiles:
        full = analysis.resolve(call.func) or ""
        last = full.rsplit(".", 1)[-1]
        record: dict[str, Any] = {"line": call.lineno, "call": last}
        records.append(record)
        if last not in ("compile", "compile_module"):
            record.update(status="skipped", detail=f"{last} builds with nvcc at run time; not compiled statically")
            continue
        src_node = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "source"), None)
        parts = analysis._string_parts(src_node) if src_node is not None else []
        if not parts or isinstance(src_node, ast.JoinedStr) or not _fully_literal(analysis, src_node):
            record.update(status="skipped", detail="the CUDA source is computed at run time")
            continue
        text = "".join(p.value for p in parts)
        kwargs: dict[str, Any] = {}
        try:
            for kw in call.keywords:
                if kw.arg in _OPTION_KEYWORDS:
                    kwargs[kw.arg] = ast.literal_eval(kw.value)
            name = None
            if last == "compile":
                name_node = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords
                                                                          if k.arg == "name"), None)
                name = ast.literal_eval(name_node) if name_node is not None else None
        except (ValueError, SyntaxError, TypeError):
            record.update(status="skipped", detail="compile options are computed at run time")
            continue
        try:
            # Untrusted source: the include rule applies (no file outside the toolkit's headers is read).
            if name is not None:
                kernel = jit.compile(text, name, confined=True, **kwargs)
                record.update(status="compiled", kernel=kernel.name, arch=kernel.module.arch)
            else:
                module = jit.compile_module(text, confined=True, **kwargs)
                record.update(status="compiled", kernels=module.kernel_names, arch=module.arch)
        except CompileError as exc:
            ok = False
            record.update(status="failed", detail=exc.message)
            logs.append(_map_diagnostics(exc, parts[0] if len(parts) == 1 else None))
        except StitchError as exc:  # NotFound (wrong kernel name), InvalidArgument (bad option)
            ok = False
            record.update(status="failed", detail=f"{type(exc).__name__}: {exc}")
            logs.append(f"line {call.lineno}: {exc}")
        except TypeError as exc:
            ok = False
            record.update(status="failed", detail=f"bad compile arguments: {exc}")
            logs.append(f"line {call.lineno}: bad compile arguments: {exc}")
    return ok, "\n".join(logs), records


def _fully_literal(analysis: _Analysis, node: ast.AST) -> bool:
    """True when the expression is only string literals, + and names bound to such expressions."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _fully_literal(analysis, node.left) and _fully_literal(analysis, node.right)
    if isinstance(node, ast.Name) and node.id in analysis.strings:
        target = analysis.strings[node.id]
        return target is not node and _fully_literal(analysis, target)
    return False


def _map_diagnostics(exc: CompileError, literal: ast.Constant | None) -> str:
    out = []
    exact = literal is not None and literal.end_lineno - literal.lineno == literal.value.count("\n")
    for d in exc.diagnostics:
        where = f"line {literal.lineno + d.line - 1}" if exact and d.line else f"{d.file}:{d.line}"
        out.append(f"{where}: {d.severity}: {d.message}" + (f"\n    {d.source_line.strip()}" if d.source_line else ""))
    return "\n".join(out) or exc.log or exc.message
