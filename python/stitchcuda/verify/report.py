"""The Verifier's verdict on one candidate (``VerifyReport``), output comparison under a tolerance,
and the feedback text the Coder reads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from .static import MAJOR, MINOR, Finding

__all__ = ["VerifyReport", "OutputError", "ERROR_KINDS", "compare_output", "build_feedback"]

ERROR_KINDS = ("load", "compile", "runtime", "crash", "timeout", "oom", "illegal-address",
               "device-assert", "incorrect", "bad-reference", "bad-candidate")
FIRST_MISMATCHES = 5


@dataclass
class OutputError:
    """How one output of the candidate compares with the reference's."""

    index: int  # position in the forward's returned tuple (0 for a single tensor)
    shape: list[int]
    dtype: str
    ok: bool
    max_abs_err: float | None = None
    max_rel_err: float | None = None  # max |got - expected| / |expected| over nonzero expected
    mismatches: int = 0  # elements outside atol + rtol * |expected|
    err_vs_fp64: float | None = None  # ||got - ref64||_inf / ||ref64||_inf; None without an fp64 run
    reference_err_vs_fp64: float | None = None  # the same for the reference itself, for scale
    first_mismatches: list[dict[str, Any]] = field(default_factory=list)  # {"index", "expected", "got"}
    problem: str = ""  # shape/dtype/NaN/Inf/type problem in words, "" when none


@dataclass
class VerifyReport:
    """Everything the Verifier found about one candidate; ``to_dict()``/``to_json()`` for records."""

    compiled: bool = False
    correct: bool = False
    hack: bool = False  # any major finding
    findings: list[Finding] = field(default_factory=list)
    outputs: list[OutputError] = field(default_factory=list)
    speedup: dict[str, float | None] = field(default_factory=lambda: {"eager": None, "compile": None})
    timing: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] | None = None
    error: dict[str, str] | None = None  # {"kind": one of ERROR_KINDS, "message": ...}
    feedback: str = ""
    compile_log: str = ""  # compiler (or loader) messages, lines mapped to the candidate file
    trials: list[dict[str, Any]] = field(default_factory=list)  # seed, distribution, ok per trial
    static_only: bool = False
    wall_s: float = 0.0

    def add(self, rule: str, severity: str, message: str, evidence: str = "", line: int | None = None) -> None:
        """Records a dynamic finding (once per rule and evidence)."""
        finding = Finding(rule, severity, message, line, evidence)
        if not any(f.rule == rule and f.evidence == evidence for f in self.findings):
            self.findings.append(finding)
        self.hack = any(f.severity == MAJOR for f in self.findings)

    def fail(self, kind: str, message: str) -> "VerifyReport":
        assert kind in ERROR_KINDS, kind
        if self.error is None:  # the first cause is the one to fix
            self.error = {"kind": kind, "message": message}
        self.correct = False
        return self

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hack"] = any(f.severity == MAJOR for f in self.findings)
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), default=_json_default, **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VerifyReport":
        known = {f.name for f in fields(cls)} - {"findings", "outputs"}
        report = cls(**{k: v for k, v in data.items() if k in known})
        report.findings = [Finding(**f) for f in data.get("findings", [])]
        out_fields = {f.name for f in fields(OutputError)}
        report.outputs = [OutputError(**{k: v for k, v in o.items() if k in out_fields}) for o in data.get("outputs", [])]
        report.hack = any(f.severity == MAJOR for f in report.findings)
        return report


def _json_default(value: Any) -> Any:
    if isinstance(value, float):
        return value
    return str(value)


def _num(x: float) -> float | None:
    x = float(x)
    return x if x == x and abs(x) != float("inf") else None


def _scalar(value: Any) -> Any:
    value = value.item() if isinstance(value, torch.Tensor) else value
    if isinstance(value, float) and (value != value or abs(value) == float("inf")):
        return str(value)  # "nan", "inf": JSON has no such numbers
    return value


def compare_output(index: int, expected: Any, got: Any, atol: float, rtol: float,
                   atol_scale: float = 1.0) -> OutputError:
    """Compares one output. Shapes and dtypes must match exactly; NaN/Inf must sit where the
    reference has them. ``atol_scale`` widens atol for inputs of larger magnitude than the problem's."""
    if not isinstance(expected, torch.Tensor):
        ok = type(got) is type(expected) and got == expected
        return OutputError(index, [], type(expected).__name__, bool(ok),
                           problem="" if ok else f"expected {expected!r}, got {got!r}")
    shape, dtype = list(expected.shape), str(expected.dtype).replace("torch.", "")
    if not isinstance(got, torch.Tensor):
        return OutputError(index, shape, dtype, False, problem=f"expected a tensor, got {type(got).__name__}")
    if type(got) is not torch.Tensor and not isinstance(got, torch.nn.Parameter):
        return OutputError(index, shape, dtype, False,
                           problem=f"the output is a {type(got).__name__}, a tensor subclass, not a plain tensor")
    if list(got.shape) != shape:
        return OutputError(index, shape, dtype, False,
                           problem=f"shape {list(got.shape)} where the reference returns {shape}")
    if got.dtype != expected.dtype:
        return OutputError(index, shape, dtype, False,
                           problem=f"dtype {str(got.dtype).replace('torch.', '')} where the reference returns {dtype}")
    if got.device != expected.device:
        got = got.to(expected.device)
    if expected.numel() == 0:
        return OutputError(index, shape, dtype, True, 0.0, 0.0)
    if not (expected.is_floating_point() or expected.is_complex()):
        bad = got != expected
        return _finish(index, shape, dtype, expected, got, bad, 0.0 if not bad.any() else None, None)
    e = expected.double()
    g = got.double()
    atol = atol * atol_scale
    diff = (g - e).abs()
    both_nan = torch.isnan(e) & torch.isnan(g)
    same_inf = torch.isinf(e) & (g == e)
    bad = ~(diff <= atol + rtol * e.abs()) & ~both_nan & ~same_inf
    finite = torch.isfinite(diff)
    max_abs = _num(diff[finite].max()) if finite.any() else None
    nonzero = finite & (e != 0)
    max_rel = _num((diff[nonzero] / e[nonzero].abs()).max()) if nonzero.any() else (0.0 if max_abs == 0 else None)
    report = _finish(index, shape, dtype, expected, got, bad, max_abs, max_rel)
    if not report.ok:
        nan_got = int((torch.isnan(g) & ~torch.isnan(e)).sum())
        inf_got = int((torch.isinf(g) & ~torch.isinf(e)).sum())
        parts = []
        if nan_got:
            parts.append(f"{nan_got} NaN where the reference is a number")
        if inf_got:
            parts.append(f"{inf_got} Inf where the reference is finite")
        if parts:
            report.problem = "; ".join(parts)
    return report


def _finish(index, shape, dtype, expected, got, bad, max_abs, max_rel) -> OutputError:
    count = int(bad.sum())
    first = []
    if count:
        flat = bad.reshape(-1).nonzero()[:FIRST_MISMATCHES, 0].tolist()
        for k in flat:
            idx = list(torch.unravel_index(torch.tensor(k), expected.shape)) if expected.dim() else []
            first.append({"index": [int(i) for i in idx], "expected": _scalar(expected.reshape(-1)[k]),
                          "got": _scalar(got.reshape(-1)[k])})
    return OutputError(index, shape, dtype, count == 0, max_abs, max_rel, count, first_mismatches=first)


def fp64_error(got: torch.Tensor, ref64: torch.Tensor) -> float | None:
    """Norm-wise relative error ||got - ref64||_inf / ||ref64||_inf (None for non-float outputs)."""
    if not (isinstance(got, torch.Tensor) and isinstance(ref64, torch.Tensor)) or got.shape != ref64.shape \
            or not ref64.is_floating_point() or ref64.numel() == 0:
        return None
    g, r = got.double().to(ref64.device), ref64.double()
    finite = torch.isfinite(r) & torch.isfinite(g)
    if not finite.any():
        return None
    scale = float(r[finite].abs().max())
    err = float((g[finite] - r[finite]).abs().max())
    return err / scale if scale > 0 else err


def build_feedback(report: VerifyReport) -> str:
    """Plain text for the Coder: what failed first, where, and what to do next."""
    lines: list[str] = []
    compile_log = report.compile_log
    if report.error:
        lines.append(f"FAILED ({report.error['kind']}): {report.error['message']}")
    if compile_log:
        lines.append("Compiler log (lines are the candidate file's):")
        lines.append(compile_log.rstrip())
    bad = [o for o in report.outputs if not o.ok]
    for o in bad[:3]:
        what = o.problem or f"{o.mismatches} elements outside tolerance (max abs err {o.max_abs_err}, " \
                            f"max rel err {o.max_rel_err})"
        lines.append(f"Output {o.index} {o.shape} {o.dtype}: {what}")
        for m in o.first_mismatches:
            lines.append(f"  at {m['index']}: expected {m['expected']}, got {m['got']}")
    failed = [t for t in report.trials if not t.get("ok", True)]
    if failed:
        lines.append("Failing trials: " + ", ".join(f"seed {t['seed']} ({t['distribution']}, "
                                                     f"{t.get('order', 'after')} the reference)" for t in failed[:5]))
    majors = [f for f in report.findings if f.severity == MAJOR]
    minors = [f for f in report.findings if f.severity == MINOR]
    if majors:
        lines.append("The result cannot be trusted (fix these first):")
        lines += [f"  [{f.rule}]{' line ' + str(f.line) if f.line else ''}: {f.message}"
                  + (f" Evidence: {f.evidence}" if f.evidence else "") for f in majors]
    if minors:
        lines.append("Worth a look:")
        lines += [f"  [{f.rule}]{' line ' + str(f.line) if f.line else ''}: {f.message}" for f in minors]
    if report.correct and not report.hack:
        s = report.speedup
        lines.append("Correct. Speed-up: " + ", ".join(f"{k} {v:.3f}x" for k, v in s.items() if v is not None)
                     if any(v is not None for v in s.values()) else "Correct (not timed).")
        if report.profile and report.profile.get("bottleneck"):
            lines.append(f"Bottleneck: {report.profile['bottleneck']}")
        elif report.profile and report.profile.get("kernels"):
            top = report.profile["kernels"][0]
            lines.append(f"Most time: kernel {top['name']} ({top['share'] * 100:.0f}% of GPU time). "
                         "Optimize it next.")
        sol = report.timing.get("speed_of_light_ms")
        med = report.timing.get("candidate_ms")
        if sol and med:
            lines.append(f"Memory-bound floor {sol:.4f} ms; candidate {med:.4f} ms "
                         f"({sol / med * 100:.0f}% of DRAM bandwidth).")
    elif not lines:
        lines.append("Incorrect." if not report.correct else "")
    return "\n".join(line for line in lines if line)
