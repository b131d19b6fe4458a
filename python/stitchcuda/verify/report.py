"""The Verifier's verdict on one candidate (``VerifyReport``), its versioned JSON format (``SCHEMA_VERSION``,
``report_schema()``: the schema the C++ agents' ``Report::from_json`` checks), and the feedback text the
Coder reads. Output comparison lives in compare.py (re-exported here).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..errors import InvalidArgumentError
from .compare import FIRST_MISMATCHES, OutputError, compare_output, fp64_error
from .static import MAJOR, MINOR, Finding

__all__ = ["VerifyReport", "OutputError", "ERROR_KINDS", "SCHEMA_VERSION", "report_schema", "compare_output",
           "fp64_error", "build_feedback", "failure_dict"]

ERROR_KINDS = ("load", "compile", "runtime", "crash", "timeout", "oom", "illegal-address",
               "device-assert", "incorrect", "bad-reference", "bad-candidate")
# The version of the JSON a VerifyReport writes. Readers (the C++ agents) refuse any other, so a change
# of meaning of a key must bump it here and in report_schema() (src/agents/report.cpp) together.
SCHEMA_VERSION = 1


def report_schema() -> dict[str, Any]:
    """The JSON Schema of ``VerifyReport.to_json()`` (draft-07), as the C++ side defines and checks it."""
    from .. import _C

    return json.loads(_C.agents.report_schema())


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
    # Static-only reports: what static analysis cannot decide, each with the check that would (empty otherwise).
    undecided: list[str] = field(default_factory=list)

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
        data = {"schema_version": SCHEMA_VERSION, **asdict(self)}
        data["hack"] = any(f.severity == MAJOR for f in self.findings)
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), default=_json_default, **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VerifyReport":
        """From ``to_dict()``'s layout. A dict of another schema_version is refused (InvalidArgumentError);
        one without a version is taken as this process's own (every writer here goes through to_dict)."""
        version = data.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise InvalidArgumentError(f"a VerifyReport of schema_version {version!r}; this reader reads "
                                       f"schema_version {SCHEMA_VERSION}")
        known = {f.name for f in fields(cls)} - {"findings", "outputs"}
        report = cls(**{k: v for k, v in data.items() if k in known})
        report.findings = [Finding(**f) for f in data.get("findings", [])]
        out_fields = {f.name for f in fields(OutputError)}
        report.outputs = [OutputError(**{k: v for k, v in o.items() if k in out_fields}) for o in data.get("outputs", [])]
        report.hack = any(f.severity == MAJOR for f in report.findings)
        return report


def failure_dict(kind: str, message: str, compiled: bool = False) -> dict[str, Any]:
    """The report dict of a job that ended in ``kind`` (ERROR_KINDS) before it could say more."""
    report = VerifyReport(compiled=compiled)
    report.fail(kind, message)
    report.feedback = build_feedback(report)
    return report.to_dict()


def _json_default(value: Any) -> Any:
    if isinstance(value, float):
        return value
    return str(value)


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
        attribution = (report.profile or {}).get("attribution")
        if attribution and attribution.get("total_ms"):
            from .attribution import summary_line

            lines.append(summary_line(attribution))
        sol = report.timing.get("speed_of_light_ms")
        med = report.timing.get("candidate_ms")
        if sol and med:
            lines.append(f"Memory-bound floor {sol:.4f} ms; candidate {med:.4f} ms "
                         f"({sol / med * 100:.0f}% of DRAM bandwidth).")
    elif not lines and report.static_only:
        lines.append("No problem found statically; correctness is not known until it runs on a GPU.")
    elif not lines:
        lines.append("Incorrect." if not report.correct else "")
    if report.undecided:
        lines.append("Not decided without running it (static checks only):")
        lines += [f"  - {u}" for u in report.undecided]
    return "\n".join(line for line in lines if line)
