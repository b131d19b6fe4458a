"""The Rubric from Python: score a candidate on the four items and compute the reward
R = I_correct · (1 − I_hack) · min((s + τ)(1 + λ·r̂), R_max) (C++ `stitchcuda::rubric`; docs/rubric.md).

    card = stitchcuda.rubric.score(report, cuda=[kernel_source], python=candidate_source, skill=1,
                                   asks=plan_steps)
    r = stitchcuda.reward(report, card, skill=1)     # {"value": 2.875, "text": "R=2.875 (...)", ...}

`report` is a `stitchcuda.verify.VerifyReport` or a dict with compiled, correct, speedup (a number, or
{"eager": ...}) and findings ([{rule, severity, evidence}]).
"""

from __future__ import annotations

from typing import Any, Sequence

from . import _C

__all__ = ["score", "reward", "outcome_of"]


def _field(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def outcome_of(report: Any) -> dict:
    """The Verifier outcome the rubric reads, from a VerifyReport or a dict."""
    speedup = _field(report, "speedup")
    if isinstance(speedup, dict):
        speedup = speedup.get("eager")
    findings = []
    for f in _field(report, "findings", []) or []:
        findings.append({"rule": str(_field(f, "rule", "")), "severity": str(_field(f, "severity", "minor")),
                         "evidence": str(_field(f, "evidence", "") or "")})
    return {"compiled": bool(_field(report, "compiled", False)), "correct": bool(_field(report, "correct", False)),
            "speedup": float(speedup or 0.0), "findings": findings}


def score(report: Any, *, cuda: Sequence[str] = (), python: str = "", skill: int = 1, asks: Sequence[str] = (),
          previous: dict | None = None, summary: str = "", facts: dict | None = None) -> dict:
    """The scorecard: {"items": [{dimension, score, reason, evidence}] x 4, "total", "text", ...}.

    `facts` (optional): reference_launches, candidate_launches, operators ([{op, share, covered}]),
    kernels ([{name, registers, shared_bytes}]). `previous` ({"cuda": [...], "python": ...}) is the
    revised candidate for Skill 2.
    """
    return _C.rubric.score({"candidate": {"cuda": list(cuda), "python": python}, "outcome": outcome_of(report),
                            "facts": facts, "task": {"skill": skill, "asks": list(asks), "previous": previous,
                                                     "summary": summary}})


def reward(report: Any, scorecard: dict, skill: int = 1, **config: float) -> dict:
    """R and its parts; `config` may set tau, r_max, lambda_plan, lambda_feedback."""
    scores = [int(item["score"]) for item in scorecard["items"]]
    return _C.rubric.reward(outcome_of(report), scores, skill, config)
