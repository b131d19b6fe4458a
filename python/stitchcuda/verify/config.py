"""How thoroughly and under what limits a candidate is verified (``VerifyConfig``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..errors import InvalidArgumentError
from .hardware import floor_bandwidth_tb_s
from .task import Tolerance

__all__ = ["VerifyConfig", "DISTRIBUTIONS"]

# Input distributions cycled over the trials: the problem's own get_inputs(), standard normal,
# large magnitude, and uniform values of both signs away from [0, 1).
DISTRIBUTIONS = ("problem", "normal", "large", "shifted")


@dataclass
class VerifyConfig:
    """Settings of one verification. ``device`` is "cuda" (the worker's GPU), "cpu" (correctness and
    the dynamic rules that need no GPU; no L2, CUPTI or torch.compile steps) or None: cuda when a GPU
    is present, else cpu."""

    trials: int = 5  # correctness trials, each with its own seed and distribution (>= 5)
    seeds: list[int] | None = None  # one per trial; default 42, 43, ...
    timing_iters: int = 100  # timed calls per measured function (0: correctness only)
    warmup: int = 10  # untimed calls before timing
    input_sets: int = 2  # rotating input sets in the timing loop
    compile_time_limit_s: float = 180.0  # loading the candidate: imports, NVRTC/nvcc, ModelNew(...)
    run_time_limit_s: float = 180.0  # trials, timing and profiling together
    device: str | None = None
    tolerance: Tolerance | None = None  # None: the task's policy
    compile_baseline: bool = True  # also time the reference under torch.compile (GPU only)
    profile: bool = True  # CUPTI cross-check and kernel summary where stitchcuda.profile works
    # Run a candidate that the source rules already judge a hack (a major finding)? True: the report is
    # complete (correctness, timing, the dynamic rules too). False: it stops at the source rules, not run —
    # what a reward wants, since a hack scores 0 whatever it does when run.
    run_hacks: bool = True
    # DRAM bandwidth of the speed-of-light bound: the hardware table's (DeviceCeilings, measured on the
    # GPU docs/profile.md names), the number the Planner is told; set it when verifying on another GPU.
    bandwidth_tb_s: float = field(default_factory=floor_bandwidth_tb_s)

    def __post_init__(self) -> None:
        # Types first: "10" for timing_iters would compare badly later, far from the mistake.
        kinds = {"trials": int, "timing_iters": int, "warmup": int, "input_sets": int,
                 "compile_time_limit_s": (int, float), "run_time_limit_s": (int, float),
                 "compile_baseline": bool, "profile": bool, "run_hacks": bool, "bandwidth_tb_s": (int, float)}
        for name, kind in kinds.items():
            value = getattr(self, name)
            if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
                raise InvalidArgumentError(f"VerifyConfig.{name} must be {getattr(kind, '__name__', 'a number')}, "
                                           f"got {type(value).__name__} {value!r:.40}.")
        if self.device is not None and not isinstance(self.device, str):
            raise InvalidArgumentError(f"VerifyConfig.device must be 'cuda', 'cpu' or None, got {self.device!r}.")
        if self.trials < 5:
            raise InvalidArgumentError(f"VerifyConfig.trials must be at least 5, got {self.trials}.")
        if self.seeds is not None:
            self.seeds = [int(s) for s in self.seeds]
            if len(self.seeds) < self.trials:
                raise InvalidArgumentError(f"VerifyConfig.seeds has {len(self.seeds)} seeds for "
                                           f"{self.trials} trials.")
        if self.timing_iters < 0 or self.warmup < 0 or self.input_sets < 1:
            raise InvalidArgumentError("VerifyConfig: timing_iters and warmup must be >= 0, input_sets >= 1.")
        if self.compile_time_limit_s <= 0 or self.run_time_limit_s <= 0:
            raise InvalidArgumentError("VerifyConfig: time limits must be positive.")
        if self.device is not None and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise InvalidArgumentError(f"VerifyConfig.device must be 'cuda', 'cpu' or None, got {self.device!r}.")

    def trial_seeds(self) -> list[int]:
        return list(self.seeds[:self.trials]) if self.seeds else [42 + i for i in range(self.trials)]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tolerance"] = self.tolerance.to_dict() if self.tolerance else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], strict: bool = False) -> "VerifyConfig":
        """The config of `data` (to_dict's form). ``strict``: an unknown key is an error (a user's dict)
        instead of being skipped (a report written by another version)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if strict and unknown:
            raise InvalidArgumentError(f"VerifyConfig has no field(s) {', '.join(unknown)}; known: "
                                       f"{', '.join(sorted(known))}.")
        values = {k: v for k, v in data.items() if k in known}
        if values.get("tolerance") is not None:
            values["tolerance"] = Tolerance.from_dict(values["tolerance"])
        return cls(**values)
