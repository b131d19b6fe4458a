"""The one comparator: whether an output matches its reference under (atol, rtol), and what to say when
it does not. The Verifier's trials (``compare_output``), graph mode's group and whole-program checks
(``first_difference``, ``max_abs_error``) and the benchmarks all use it, so NaN, infinities and dtype
rules are the same wherever a result is judged.

The rule, elementwise: ``|got - expected| <= atol + rtol * |expected|``, computed in float64; NaN matches
only NaN, an infinity only the same infinity; integers and booleans must be equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["OutputError", "compare_output", "first_difference", "abs_error", "max_abs_error", "largest_error",
           "error_and_outside", "fp64_error", "FIRST_MISMATCHES"]

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
    # The accuracy rule's verdict (verify/tolerance.py, Accuracy.to_dict) where it judged this output
    # against a high-precision reference; None where it did not.
    accuracy: dict[str, Any] | None = None


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex128) if t.is_complex() else t.double()


def abs_error(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|got - expected| elementwise in float64, on expected's device: 0 where both are NaN or both the
    same infinity, +inf where only one is NaN or the infinities differ (inf - inf would read as NaN)."""
    e, g = _wide(expected), _wide(got.to(expected.device))
    diff = torch.sub(g, e)  # a new tensor: the in-place steps below never touch the caller's
    diff = diff.abs() if diff.is_complex() else diff.abs_()
    agree = (torch.isnan(e) & torch.isnan(g)) | (torch.isinf(e) & (g == e))
    return diff.masked_fill_(agree, 0.0).nan_to_num_(nan=float("inf"), posinf=float("inf"))


def _outside(diff: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """Elements outside the tolerance. A non-finite expected value must be matched exactly: its
    relative bound would be infinite and accept anything."""
    if not (expected.is_floating_point() or expected.is_complex()):
        return diff != 0  # integers and booleans: exact
    e = _wide(expected)
    limit = e.abs().mul_(rtol).add_(atol).masked_fill_(~torch.isfinite(e), 0.0)
    return diff > limit


# Elements compared at once: float64 temporaries of 2 Mi elements (16 MiB each), whatever the tensor's
# size, so a comparison adds well under 100 MiB to the GPU's memory. Comparing a 6 GB output whole would
# take ~50 GB of float64 temporaries. Each chunk's answer stays on the device until the last chunk: one
# synchronization per comparison, not one per chunk.
CHUNK_ELEMENTS = 1 << 21


def _chunks(got: torch.Tensor, expected: torch.Tensor):
    """(got, expected) as matching flat slices of at most CHUNK_ELEMENTS, with each slice's offset. A
    reference kept in host memory while `got` is on a GPU (a whole-program check holds a large model
    output there, not beside the program's) comes to the GPU a slice at a time and is compared there."""
    g, e = got.reshape(-1), expected.reshape(-1)
    move = got.device.type == "cuda" and expected.device != got.device
    for start in range(0, e.numel(), CHUNK_ELEMENTS):
        part = e[start:start + CHUNK_ELEMENTS]
        yield start, g[start:start + CHUNK_ELEMENTS], part.to(got.device, non_blocking=True) if move else part


def _any_outside(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> bool:
    """Whether any element of `got` lies outside the tolerance around `expected` (chunk by chunk)."""
    flags = [_outside(abs_error(g, e), e, atol, rtol).any() for _, g, e in _chunks(got, expected)]
    return bool(torch.stack(flags).any()) if flags else False


def error_and_outside(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> tuple[float, bool]:
    """(largest |got - expected|, whether any element lies outside the tolerance) in one pass over the
    two tensors: what a whole-program check needs of every output, with one read of each."""
    maxima, flags = [], []
    for _, g, e in _chunks(got, expected):
        diff = abs_error(g, e)
        maxima.append(diff.max())
        flags.append(_outside(diff, e, atol, rtol).any())
    if not maxima:
        return 0.0, False
    both = torch.stack([torch.stack(maxima).max(), torch.stack(flags).any().double()]).tolist()  # one sync
    return float(both[0]), bool(both[1])


def max_abs_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest |got - expected| (inf for a NaN the reference does not have; 0 for empty tensors)."""
    return largest_error(got, expected)[0]


def _largest(got: torch.Tensor, expected: torch.Tensor, measure) -> tuple[float, int]:
    """(largest measure(got, expected) element, its flat index), chunk by chunk (the first on ties)."""
    maxima, places = [], []
    for start, g, e in _chunks(got, expected):
        values = measure(g, e)
        # Reductions, not values[idx]: an index into them is a view that would keep every chunk's float64
        # temporaries alive until the end (twice the output's size for fp32).
        if values.numel():
            maxima.append(values.max())
            places.append(values.argmax() + start)
    if not maxima:
        return 0.0, 0
    found = torch.stack(maxima)
    k = int(found.argmax())  # the first chunk holding the largest
    return float(found[k]), int(places[k])


def largest_error(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """(largest |got - expected|, its flat index): where to look first (the first such index on ties)."""
    return _largest(got, expected, abs_error)


def _share(g: torch.Tensor, e: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """Each |g - e| as a share of its bound (inf: a mismatch the rule takes exactly)."""
    diff = abs_error(g, e)
    exact = torch.where(diff == 0, 0.0, float("inf"))
    if not (e.is_floating_point() or e.is_complex()):
        return exact
    wide = _wide(e)
    return torch.where(torch.isfinite(wide), diff.div_(wide.abs().mul_(rtol).add_(atol)), exact)


def tolerance_used(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> float:
    """The largest |got - expected| as a share of its bound under the rule above (1.0: at the limit, inf:
    a mismatch the rule takes exactly, such as a non-finite or integer value that differs)."""
    return most_outside(got, expected, atol, rtol)[0]


def most_outside(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> tuple[float, int]:
    """(the largest share of its bound, its flat index): the element furthest outside the tolerance, which
    need not be the one of the largest absolute error (near zero, atol alone bounds it)."""
    return _largest(got, expected, lambda g, e: _share(g, e, atol, rtol))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def first_difference(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float,
                     reference: str = "the reference") -> str | None:
    """None when `got` matches `want` (the rule above), else the first problem in words: the shape, the
    dtype, or the largest error with where it is and both values. `reference` names where `want` came
    from ("ATen", "the model")."""
    if tuple(got.shape) != tuple(want.shape):
        return f"output '{name}' has shape {tuple(got.shape)}, {reference}'s {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"output '{name}' is {_dtype_name(got.dtype)}, {reference}'s {_dtype_name(want.dtype)}"
    if not _any_outside(got, want, atol, rtol):
        return None
    worst, idx = largest_error(got, want)
    text = (f"output '{name}' differs from {reference}: max |error| {worst:.3g} at flat index {idx} "
            f"(expected {want.reshape(-1)[idx].item():.6g}, got {got.reshape(-1)[idx].item():.6g})")
    share, far = most_outside(got, want, atol, rtol)
    if far != idx and math.isfinite(share):  # the largest error is within its bound: say which one is not
        e, g = want.reshape(-1)[far].item(), got.reshape(-1)[far].item()
        text += (f"; furthest outside atol + rtol * |expected| at flat index {far}: |error| {abs(g - e):.3g}, "
                 f"{share:.3g} times its bound (expected {e:.6g}, got {g:.6g})")
    return text


def _num(x: Any) -> float | None:
    x = float(x)
    return x if x == x and abs(x) != float("inf") else None


def _scalar(value: Any) -> Any:
    value = value.item() if isinstance(value, torch.Tensor) else value
    if isinstance(value, complex):
        return str(value)
    if isinstance(value, float) and (value != value or abs(value) == float("inf")):
        return str(value)  # "nan", "inf": JSON has no such numbers
    return value


def compare_output(index: int, expected: Any, got: Any, atol: float, rtol: float,
                   atol_scale: float = 1.0) -> OutputError:
    """Compares one output of a candidate. Shapes and dtypes must match exactly; NaN/Inf must sit where
    the reference has them. ``atol_scale`` widens atol for inputs of larger magnitude than the problem's."""
    if not isinstance(expected, torch.Tensor):
        ok = type(got) is type(expected) and got == expected
        return OutputError(index, [], type(expected).__name__, bool(ok),
                           problem="" if ok else f"expected {expected!r}, got {got!r}")
    shape, dtype = list(expected.shape), _dtype_name(expected.dtype)
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
                           problem=f"dtype {_dtype_name(got.dtype)} where the reference returns {dtype}")
    if got.device != expected.device:
        got = got.to(expected.device)
    if expected.numel() == 0:
        return OutputError(index, shape, dtype, True, 0.0, 0.0)
    if not (expected.is_floating_point() or expected.is_complex()):
        bad = got != expected
        return _finish(index, shape, dtype, expected, got, bad, 0.0 if not bad.any() else None, None)
    diff = abs_error(got, expected)
    bad = _outside(diff, expected, atol * atol_scale, rtol)
    finite = torch.isfinite(diff)
    max_abs = _num(diff[finite].max()) if finite.any() else None
    e = _wide(expected)
    nonzero = finite & (e != 0)
    max_rel = _num((diff[nonzero] / e[nonzero].abs()).max()) if nonzero.any() else (0.0 if max_abs == 0 else None)
    report = _finish(index, shape, dtype, expected, got, bad, max_abs, max_rel)
    if not report.ok:
        nan_got = int((torch.isnan(got) & ~torch.isnan(expected)).sum())
        inf_got = int((torch.isinf(got) & ~torch.isinf(expected)).sum())
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
    """Norm-wise relative error ||got - ref64||_inf / ||ref64||_inf (None for non-float outputs).
    Norm-wise, not elementwise: elementwise ratios explode near zero."""
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
