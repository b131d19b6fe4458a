"""The worker's side of a static-only check (``check(..., static_only=True)``): the source rules and the
NVRTC compile of the candidate's literal CUDA sources, which needs no GPU and runs no candidate code.
"""

from __future__ import annotations

import ast
import time
from typing import Any

from ..errors import CompileError, StitchError
from .report import VerifyReport
from .static import MAJOR, Analysis, Reference, analyze

__all__ = ["run_static_job", "compile_static", "STATIC_UNDECIDED"]


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


# The hack families a static-only check cannot decide, each with the dynamic check that decides it: a
# static-only report lists them, so "no major finding" is never read as "no hack".
STATIC_UNDECIDED = (
    "correctness: whether every output is right (correctness trials on fresh inputs)",
    "results kept across calls — caches keyed on shapes, values or call counts (inputs refilled between "
    "timed calls, timed outputs re-checked)",
    "work left outside the timer or done on too little data (CUPTI trace window, speed-of-light bound)",
    "whose kernels did the GPU work (CUPTI attribution: the candidate's own, a library's, ATen's)",
    "whether torch does the problem's arithmetic however the call is spelled (the ATen operators its forward "
    "calls, recorded at dispatch)",
    "code the analysis could not read, if any (findings marked opaque-code or introspection)",
)


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
        analysis = Analysis(source, tree, Reference.parse(None))
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


def _fully_literal(analysis: Analysis, node: ast.AST) -> bool:
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
