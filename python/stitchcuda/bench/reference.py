"""Correctness against references: a column's outputs compared with eager's under the Verifier's tolerance, and
the error of each column against an fp64 reference of the problem (exact arithmetic, within a memory budget)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.utils._pytree as pytree

from .results import first_line


# The fp64 reference is skipped when its float64 weights, inputs and outputs would exceed this.
FP64_BUDGET_BYTES = 8 << 30


def compare_outputs(got: Any, want: Any, precision: str = "fp32") -> tuple[bool, float, str]:
    """(all close, max |error|, what differs first) for two output structures, by the Verifier's
    comparator and its tolerance table at `precision`."""
    from ..verify.compare import first_difference, largest_error, max_abs_error
    from ..verify.tolerance import tolerance

    got_flat, want_flat = pytree.tree_flatten(got)[0], pytree.tree_flatten(want)[0]
    if len(got_flat) != len(want_flat):
        return False, math.inf, f"{len(got_flat)} outputs, eager has {len(want_flat)}"
    worst, ok, detail = 0.0, True, ""
    for i, (g, w) in enumerate(zip(got_flat, want_flat)):
        if not isinstance(w, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            return False, math.inf, f"output {i}: {getattr(g, 'dtype', type(g))} {list(getattr(g, 'shape', []))}, " \
                                    f"eager {w.dtype} {list(w.shape)}"
        worst = max(worst, max_abs_error(g, w))
        if ok and first_difference(str(i), g, w, *tolerance(w.dtype, precision)) is not None:
            ok = False
            err, idx = largest_error(g, w)
            detail = (f"output {i}: max |error| {err:.3g} at flat index {idx} (eager "
                      f"{w.flatten()[idx].item():.6g}, StitchCUDA {g.flatten()[idx].item():.6g})")
    return ok, worst, detail


def _float64(value: Any, dtype: torch.dtype = torch.float64) -> Any:
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def _fp64_bytes(*structures: Any, dtype: torch.dtype = torch.float64) -> int:
    """The bytes of the tensors in `structures` once every floating one is float64 (or `dtype`)."""
    tensors = [t for s in structures for t in pytree.tree_flatten(s)[0] if isinstance(t, torch.Tensor)]
    width = torch.finfo(dtype).bits // 8
    return sum(t.numel() * (width if t.is_floating_point() else t.element_size()) for t in tensors)


def reference_dtype(model: torch.nn.Module, inputs: tuple, outputs: Any = None,
                    budget: int = FP64_BUDGET_BYTES) -> torch.dtype:
    """The dtype of a 16-bit model's high-precision reference: float64 where its weights, inputs and
    `outputs` fit in `budget` bytes at 8 bytes a number, else float32 (still exact enough to judge a 16-bit
    model's error, whose unit roundoff is 2^-8 or 2^-11 against fp32's 2^-24)."""
    parts = ([*model.parameters(), *model.buffers()], inputs, outputs)
    return torch.float64 if _fp64_bytes(*parts) <= budget else torch.float32


def fp64_reference(model: torch.nn.Module, inputs: tuple, outputs: Any,
                   budget: int = FP64_BUDGET_BYTES, dtype: torch.dtype = torch.float64) -> tuple[Any, str]:
    """(the model's outputs on `inputs` in float64, in host memory; a note, "" or what the reference is
    not) from a deep copy of the model and the inputs cast to float64 on their device; or (None, why
    there is none): the float64 weights, inputs and `outputs` (eager's) would take more than `budget`
    bytes, or the model cannot be copied to or run in float64. The copy is dropped before returning.
    `dtype` float32: the same in float32 (reference_dtype's choice for a 16-bit model too large for float64)."""
    name = str(dtype).removeprefix("torch.")
    need = _fp64_bytes([*model.parameters(), *model.buffers()], inputs, outputs, dtype=dtype)
    if need > budget:
        return None, (f"skipped: the {name} weights, inputs and outputs would take {need / 2**30:.1f} GiB, above the "
                      f"{budget / 2**30:g} GiB budget")
    try:
        wide = copy.deepcopy(model).to(dtype)
    except Exception as exc:
        return None, f"skipped: the model cannot be copied to {name} ({first_line(exc)})"
    try:
        with torch.no_grad():
            ref = wide(*_float64(inputs, dtype))
    except Exception as exc:  # an op without a float64 kernel, a tensor the model makes in fp32, out of memory
        return None, f"skipped: the model does not run in {name} ({first_line(exc)})"
    finally:
        del wide
    flat = pytree.tree_flatten(ref)[0]
    narrow = [i for i, t in enumerate(flat)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype]
    note = (f"output(s) {narrow} are {flat[narrow[0]].dtype} in the {name} run (the model casts): their error is "
            "against that" if narrow else "")
    return pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, ref), note


def fp64_errors(got: Any, ref: Any, precision: str = "fp32") -> dict | None:
    """{max_abs, max_rel, tolerance_used} of `got` (a column's outputs) against `ref` (fp64_reference's),
    the worst floating output of each: max |got - ref|; that over max |ref| (norm-wise: elementwise ratios
    explode near zero); the largest share of atol + rtol * |ref| an element uses, under the tolerance
    for the output's dtype at `precision` (<= 1: within it). Computed on got's device, in slices.
    None when the reference has no floating output; infinite when the outputs differ in number or shape."""
    from ..verify.compare import CHUNK_ELEMENTS, abs_error, tolerance_used
    from ..verify.tolerance import tolerance

    got_flat, ref_flat = pytree.tree_flatten(got)[0], pytree.tree_flatten(ref)[0]
    floats = [i for i, r in enumerate(ref_flat) if isinstance(r, torch.Tensor) and r.is_floating_point()]
    if not floats:
        return None
    out = {"max_abs": 0.0, "max_rel": 0.0, "tolerance_used": 0.0}
    if len(got_flat) != len(ref_flat):
        return dict.fromkeys(out, math.inf)
    for i in floats:
        g, r = got_flat[i], ref_flat[i]
        if not isinstance(g, torch.Tensor) or g.shape != r.shape:
            return dict.fromkeys(out, math.inf)
        atol, rtol = tolerance(g.dtype if g.is_floating_point() else torch.float32, precision)
        g_flat, r_flat = g.detach().reshape(-1), r.reshape(-1)
        worst = scale = used = 0.0
        for start in range(0, r_flat.numel(), CHUNK_ELEMENTS):
            rc, gc = r_flat[start:start + CHUNK_ELEMENTS].to(g.device), g_flat[start:start + CHUNK_ELEMENTS]
            worst = max(worst, float(abs_error(gc, rc).max()))
            finite = rc[torch.isfinite(rc)]
            if finite.numel():
                scale = max(scale, float(finite.abs().max()))
            used = max(used, tolerance_used(gc, rc, atol, rtol))
        out["max_abs"] = max(out["max_abs"], worst)
        out["max_rel"] = max(out["max_rel"], worst / scale if scale > 0 else worst)
        out["tolerance_used"] = max(out["tolerance_used"], used)
    return out
