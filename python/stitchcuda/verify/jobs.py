"""The jobs a verification worker runs, as types: a candidate model (``ModelJob``), a static-only check
(``StaticJob``), a saved program (``ProgramJob``) and the judge's own reference run (``ReferenceJob``).
Jobs travel from the judge to the worker (the trusted direction); what comes back is wire.py's data.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Union

__all__ = ["ModelJob", "StaticJob", "ProgramJob", "ReferenceJob", "Job", "typed", "as_dict"]


@dataclass
class ModelJob:
    """Verify a candidate (``candidate``: its source) against a Task spec. ``baselines``: "judge" when the
    judge times eager and torch.compile itself (the worker times only the candidate), else "worker"."""

    reference: dict[str, Any]
    candidate: str
    config: dict[str, Any]
    candidate_name: str = "<candidate>"
    recycle_after: bool = False
    trusted: bool = False
    baselines: str = "worker"
    kind: str = field(default="model", init=False)


@dataclass
class StaticJob:
    """The source rules and an NVRTC compile of the candidate's literal CUDA (``check(static_only=True)``)."""

    candidate: str
    config: dict[str, Any]
    reference_source: str | None = None
    reference_error: str | None = None
    trusted: bool = False
    kind: str = field(default="static", init=False)


@dataclass
class ProgramJob:
    """A saved program (``artifact``: .stitch bytes) run on ``inputs`` and compared with ``expected``, or
    writing into ``outputs`` (verify/program.py)."""

    artifact: bytes
    inputs: list[Any]
    config: dict[str, Any]
    expected: list[Any] | None = None
    tolerances: list[Any] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    outputs: list[Any] | None = None
    kind: str = field(default="program", init=False)


@dataclass
class ReferenceJob:
    """The judge's run of a Task: the reference's outputs on the trials' inputs and the timed sets, its
    eager (and torch.compile) time and the bytes the problem must move. No candidate code is involved."""

    reference: dict[str, Any]
    config: dict[str, Any]
    kind: str = field(default="reference", init=False)


Job = Union[ModelJob, StaticJob, ProgramJob, ReferenceJob]
_BY_KIND = {"model": ModelJob, "static": StaticJob, "program": ProgramJob, "reference": ReferenceJob}


def typed(job: Job | dict[str, Any]) -> Job:
    """``job`` as its type; a dict (the older form callers still pass) by its "kind" ("model" when absent).
    ValueError naming the unknown kind or fields."""
    if isinstance(job, tuple(_BY_KIND.values())):
        return job
    if not isinstance(job, dict):
        raise ValueError(f"a verification job is a ModelJob, StaticJob, ProgramJob, ReferenceJob or dict, "
                         f"not {type(job).__name__}")
    kind = job.get("kind", "model")
    cls = _BY_KIND.get(kind)
    if cls is None:
        raise ValueError(f"unknown job kind {kind!r}; known: {', '.join(_BY_KIND)}")
    known = {f.name for f in fields(cls) if f.init}
    unknown = sorted(set(job) - known - {"kind"})
    if unknown:
        raise ValueError(f"a {kind} job has no field(s) {', '.join(unknown)}")
    return cls(**{k: v for k, v in job.items() if k in known})


def as_dict(job: Job) -> dict[str, Any]:
    """The job as the dict the runners read (``kind`` included); tensors are kept as they are (asdict
    would deep-copy them)."""
    return {f.name: getattr(job, f.name) for f in fields(job)}

