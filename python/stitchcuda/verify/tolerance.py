"""The one tolerance table: how close an output must be to its reference, by dtype and precision policy.
Candidates (``Tolerance``, per task), graph mode's group checks and whole-program verification
(``tolerance()``), and the benchmarks all read it, so a kernel is never judged by two standards. For
16-bit outputs and the reduced precision policies it also holds the accuracy rule (``judge_accuracy``):
the candidate's error and eager's, both against a high-precision reference.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from .compare import CHUNK_ELEMENTS, OutputError, compare_output, max_abs_error

__all__ = ["TABLE", "REDUCED_PRECISION", "PRECISIONS", "Tolerance", "tolerance", "ACCURACY_FACTOR", "UNIT_ROUNDOFF",
           "Accuracy", "by_accuracy", "accuracy_error", "accuracy_floor", "judge_accuracy", "reference_dtype",
           "wants_reference", "judge_output", "judge_outputs", "HighPrecision"]

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

    Defaults are :data:`TABLE`; integer and boolean outputs must match exactly. ``precision`` is the policy
    (PRECISIONS) the outputs were computed under: with a high-precision reference at hand, an output the
    accuracy rule covers there (``by_accuracy``) that lies outside the table is judged by the rule.
    """

    fp32: tuple[float, float] = TABLE["fp32"]
    fp16: tuple[float, float] = TABLE["fp16"]
    bf16: tuple[float, float] = TABLE["bf16"]
    fp64: tuple[float, float] = TABLE["fp64"]
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"Tolerance.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")

    @classmethod
    def uniform(cls, atol: float, rtol: float, precision: str = "fp32") -> "Tolerance":
        """The same (atol, rtol) for every floating dtype."""
        pair = (float(atol), float(rtol))
        return cls(pair, pair, pair, pair, precision)

    @classmethod
    def for_precision(cls, precision: str = "fp32") -> "Tolerance":
        """The policy for a precision setting: the table for "fp32", REDUCED_PRECISION for every
        floating dtype otherwise ("tf32", "bf16")."""
        return cls() if precision == "fp32" else cls.uniform(*REDUCED_PRECISION, precision=precision)

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

    def to_dict(self) -> dict[str, Any]:
        return {"fp32": list(self.fp32), "fp16": list(self.fp16), "bf16": list(self.bf16),
                "fp64": list(self.fp64), "precision": self.precision}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Tolerance":
        pairs = {k: (float(v[0]), float(v[1])) for k, v in data.items() if k != "precision"}
        return cls(**pairs, precision=str(data.get("precision", "fp32")))


def tolerance(dtype: torch.dtype, precision: str = "fp32") -> tuple[float, float]:
    """(atol, rtol) for an output of ``dtype`` under a precision policy: fp32 1e-4, fp16/bf16 1e-2,
    every float 1e-2 when the policy is not "fp32"; integers and booleans exactly (0, 0)."""
    return Tolerance.for_precision(precision).for_dtype(dtype)


# ---- the accuracy rule for reduced precision -----------------------------------------------------------
#
# A 16-bit output, or any output under the tf32/bf16 policies, is judged against the truth, not against
# ATen's rounding: the candidate and eager are both compared with a high-precision reference (the same
# model or group run in fp64, fp32 where fp64 does not fit or has no kernel), and the candidate passes when
#
#     error(candidate) <= ACCURACY_FACTOR * error(eager) + floor
#
# ATen's chain of 16-bit ops rounds after every op; a kernel that computes in fp32 and rounds once is
# closer to the truth and may still differ from ATen by an ulp or two, so agreement with ATen is the wrong
# question (Inductor's accuracy checks compare against an fp64 reference for the same reason, with the
# same factor of 2). The factor leaves room for a different but equally valid order of operations; a kernel
# that loses precision (16-bit accumulation, a skipped fp32 step) or is wrong (one bad element) lands well
# above it. The floor is one rounding of the format the result is allowed to be computed in: a result
# rounded correctly once always passes, even where eager is exact (a copy, a reshape).
#
# The error: max |got - ref| / max |ref| over the output (norm-wise relative, the infinity norm). The
# maximum, not a root mean square, because one wrong element in ten million changes an RMS by a factor of
# about three thousand less and would pass; divided by the reference's largest magnitude so the factor and
# the floor need no units; norm-wise, not per element, because per-element ratios explode near zero. A NaN
# or infinity where the reference has none is an infinite error.

ACCURACY_FACTOR = 2.0
# Unit roundoff (half an ulp at 1.0) of the formats a result may be rounded to: the floor of the rule.
UNIT_ROUNDOFF: dict[str, float] = {"fp64": 2.0 ** -53, "fp32": 2.0 ** -24, "tf32": 2.0 ** -11,
                                   "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
_FORMAT = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def by_accuracy(dtype: torch.dtype, precision: str = "fp32") -> bool:
    """Whether outputs of `dtype` under `precision` are judged by the accuracy rule: fp16 and bf16
    outputs, and every fp32 output under the "tf32" and "bf16" policies. fp32 outputs at "fp32" (and fp64,
    integers, booleans) keep the table's allclose rule."""
    if dtype in (torch.float16, torch.bfloat16):
        return True
    return dtype == torch.float32 and precision != "fp32"


def accuracy_floor(dtype: torch.dtype, precision: str = "fp32") -> float:
    """The rule's floor: the unit roundoff of the output's format, or of the policy's product format
    when that is coarser (an fp32 output of TF32 products carries TF32's rounding)."""
    floor = UNIT_ROUNDOFF.get(_FORMAT.get(dtype, "fp32"), UNIT_ROUNDOFF["fp32"])
    return max(floor, UNIT_ROUNDOFF.get(precision, 0.0))


def accuracy_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (max |got - ref| when the reference is all zeros or not finite), a
    slice at a time like every comparison (verify/compare.py); infinite when the shapes differ or `got`
    is NaN or infinite where `ref` is not."""
    if tuple(got.shape) != tuple(ref.shape):
        return float("inf")
    if got.numel() == 0:
        return 0.0
    err = max_abs_error(got, ref)
    flat = ref.detach().reshape(-1)
    scale = max(float(part.double().abs().nan_to_num_(0.0, 0.0, 0.0).max())
                for part in flat.split(CHUNK_ELEMENTS))
    return err / scale if scale > 0 else err


@dataclass(frozen=True)
class Accuracy:
    """One output judged by the accuracy rule: the candidate's and eager's errors against the reference
    (``accuracy_error``), the bound the candidate had to meet, and what the reference was computed in."""

    ok: bool
    error: float
    eager_error: float
    bound: float
    floor: float
    reference: str = "fp64"

    def describe(self) -> str:
        verdict = "within" if self.ok else "above"
        return (f"error {self.error:.3g} against the {self.reference} reference, {verdict} the bound {self.bound:.3g} "
                f"({ACCURACY_FACTOR:g} x eager's {self.eager_error:.3g} + {self.floor:.3g})")

    def to_dict(self) -> dict:
        return {"ok": self.ok, "error": self.error, "eager_error": self.eager_error, "bound": self.bound,
                "floor": self.floor, "reference": self.reference}


def judge_accuracy(got: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor, precision: str = "fp32",
                   reference: str = "fp64") -> Accuracy:
    """The accuracy rule for one output: `got` (the candidate) passes when its error against `ref` (the
    high-precision reference, fp64 or fp32) is at most ACCURACY_FACTOR times `eager`'s error plus the floor
    for eager's dtype under `precision` (``accuracy_floor``). `reference` names what `ref` was computed in."""
    error, eager_error = accuracy_error(got, ref), accuracy_error(eager, ref)
    floor = accuracy_floor(eager.dtype, precision)
    bound = ACCURACY_FACTOR * eager_error + floor
    return Accuracy(bool(error <= bound), error, eager_error, bound, floor, reference)


def reference_dtype(fits_fp64: bool) -> torch.dtype:
    """What the high-precision reference is computed in: fp64, or fp32 where fp64 does not fit in memory
    (or the op has no fp64 kernel). An fp32 reference is still ~2^16 times finer than bf16's rounding."""
    return torch.float64 if fits_fp64 else torch.float32


# ---- the rule in the Verifier's comparison -------------------------------------------------------------


def wants_reference(dtypes: Sequence[torch.dtype], policy: Tolerance) -> bool:
    """Whether outputs of these dtypes are judged by the accuracy rule under `policy`: then the Verifier runs
    the reference in high precision (fp64; fp32 where fp64 does not fit) beside its own forward."""
    return any(by_accuracy(d, policy.precision) for d in dtypes)


def judge_output(index: int, expected: Any, got: Any, policy: Tolerance, atol_scale: float = 1.0,
                 exact: Any = None) -> OutputError:
    """One output of a candidate against the reference's, as graph mode's whole-program check judges it:
    the table's rule, by compare_output; for an output the accuracy rule covers under `policy` and
    `exact` (the reference's forward in fp64, or fp32 for a 16-bit model), the candidate's error and the
    reference's own against `exact` are reported (err_vs_fp64, reference_err_vs_fp64), and an output
    outside the table passes when the rule accepts it (``accuracy`` holds the verdict). Shape, dtype and
    type problems stay failures."""
    atol, rtol = policy.for_dtype(expected.dtype) if isinstance(expected, torch.Tensor) else (0.0, 0.0)
    result = compare_output(index, expected, got, atol, rtol, atol_scale)
    if not (isinstance(expected, torch.Tensor) and by_accuracy(expected.dtype, policy.precision)
            and isinstance(exact, torch.Tensor) and exact.dtype in (torch.float64, torch.float32)
            and exact.dtype.itemsize > expected.dtype.itemsize and tuple(exact.shape) == tuple(expected.shape)
            and type(got) is torch.Tensor and got.dtype == expected.dtype and got.shape == expected.shape):
        return result  # nothing the rule judges: a shape, dtype or type problem, or no finer reference
    verdict = judge_accuracy(got, expected, exact.to(got.device), policy.precision,
                             "fp64" if exact.dtype == torch.float64 else "fp32")
    # JSON has no infinity (a NaN where the truth has a number): None, as compare_output reports it.
    result.err_vs_fp64, result.reference_err_vs_fp64 = _finite(verdict.error), _finite(verdict.eager_error)
    result.accuracy = {k: _finite(v) if isinstance(v, float) else v for k, v in verdict.to_dict().items()}
    if not result.ok and verdict.ok:  # differs from the reference's rounding, not from the truth
        result.ok, result.problem = True, ""
    elif not result.ok:
        result.problem = "; ".join(p for p in (result.problem, f"by the accuracy rule: {verdict.describe()}") if p)
    return result


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def judge_outputs(expected: Sequence[Any], got: Sequence[Any], policy: Tolerance, atol_scale: float = 1.0,
                  exact: Sequence[Any] | None = None) -> list[OutputError]:
    """judge_output for each output (`exact`: the high-precision reference's outputs in the same order, or
    None); a count that differs is one failed entry saying so."""
    if len(got) != len(expected):
        return [OutputError(0, [], "", False, problem=f"the candidate returns {len(got)} outputs, the reference "
                                                      f"{len(expected)}")]
    finer = list(exact) if exact is not None and len(exact) == len(expected) else [None] * len(expected)
    return [judge_output(i, e, g, policy, atol_scale, x) for i, (e, g, x) in enumerate(zip(expected, got, finer))]


class HighPrecision:
    """The reference's forward in fp64, what judge_output's `exact` comes from in the Verifier's trials: one
    deep copy of `model` in fp64, made at the first call (the caller's model is untouched), run on the
    inputs with their floating tensors widened. ``outputs(inputs)``: its output tensors in order, or None
    where the copy or its forward fails (an op without an fp64 kernel), after which ``note`` says why and
    the table alone judges."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.note = ""
        self._copy: torch.nn.Module | None = None

    def outputs(self, inputs: Sequence[Any]) -> list[Any] | None:
        if self.note:
            return None
        try:
            if self._copy is None:
                self._copy = copy.deepcopy(self.model).to(torch.float64)
            wide = [x.to(torch.float64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                    for x in inputs]
            with torch.no_grad():
                return pytree.tree_leaves(self._copy(*wide))
        except Exception as exc:  # no fp64 forward: said once, and the table judges
            self.note = f"no fp64 reference: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            self._copy = None
            return None
