"""The one tolerance table: how close an output must be to its reference, by dtype and precision policy.
Candidates (``Tolerance``, per task), graph mode's group checks and whole-program verification
(``tolerance()``), and the benchmarks all read it, so a kernel is never judged by two standards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["TABLE", "REDUCED_PRECISION", "PRECISIONS", "Tolerance", "tolerance"]

# (atol, rtol) by output dtype; |got - expected| <= atol + rtol * |expected|. The KernelBench values:
# fp32 (and fp64) 1e-4, the 16-bit formats 1e-2.
TABLE: dict[str, tuple[float, float]] = {
    "fp32": (1e-4, 1e-4),
    "fp16": (1e-2, 1e-2),
    "bf16": (1e-2, 1e-2),
    "fp64": (1e-4, 1e-4),
}
# Every floating output when the precision policy lets matmuls round their inputs (TF32 keeps 10
# mantissa bits, bf16 7): an fp32 output of such a GEMM is only as close as a 16-bit one.
REDUCED_PRECISION: tuple[float, float] = (1e-2, 1e-2)
# Graph mode's precision policies (OfflinePlanner(precision=...)).
PRECISIONS = ("fp32", "tf32", "bf16")


@dataclass(frozen=True)
class Tolerance:
    """Absolute and relative tolerance per output dtype: ``|got - expected| <= atol + rtol * |expected|``.

    Defaults are :data:`TABLE`; integer and boolean outputs must match exactly.
    """

    fp32: tuple[float, float] = TABLE["fp32"]
    fp16: tuple[float, float] = TABLE["fp16"]
    bf16: tuple[float, float] = TABLE["bf16"]
    fp64: tuple[float, float] = TABLE["fp64"]

    @classmethod
    def uniform(cls, atol: float, rtol: float) -> "Tolerance":
        """The same (atol, rtol) for every floating dtype."""
        pair = (float(atol), float(rtol))
        return cls(pair, pair, pair, pair)

    @classmethod
    def for_precision(cls, precision: str = "fp32") -> "Tolerance":
        """The policy for a precision setting: the table for "fp32", REDUCED_PRECISION for every
        floating dtype otherwise ("tf32", "bf16")."""
        return cls() if precision == "fp32" else cls.uniform(*REDUCED_PRECISION)

    def for_dtype(self, dtype: torch.dtype) -> tuple[float, float]:
        """(atol, rtol) for outputs of ``dtype``; (0, 0) for integers and booleans."""
        if dtype in (torch.float32, torch.complex64):
            return self.fp32
        if dtype in (torch.float64, torch.complex128):
            return self.fp64
        if dtype == torch.bfloat16:
            return self.bf16
        if dtype.is_floating_point:  # float16 and the fp8 formats
            return self.fp16
        return (0.0, 0.0)

    def to_dict(self) -> dict[str, list[float]]:
        return {"fp32": list(self.fp32), "fp16": list(self.fp16), "bf16": list(self.bf16),
                "fp64": list(self.fp64)}

    @classmethod
    def from_dict(cls, data: dict[str, Sequence[float]]) -> "Tolerance":
        return cls(**{k: (float(v[0]), float(v[1])) for k, v in data.items()})


def tolerance(dtype: torch.dtype, precision: str = "fp32") -> tuple[float, float]:
    """(atol, rtol) for an output of ``dtype`` under a precision policy: fp32 1e-4, fp16/bf16 1e-2,
    every float 1e-2 when the policy is not "fp32"; integers and booleans exactly (0, 0)."""
    return Tolerance.for_precision(precision).for_dtype(dtype)
