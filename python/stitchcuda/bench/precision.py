"""torch's flags at a bench precision (fp32, tf32, bf16), set around a problem's columns and restored after,
and the tolerance outputs are judged by at that precision; a problem's variants (bf16, fp16, autocast: the
dtype its model runs in) and the accuracy rule that judges low-precision outputs against a reference."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch


# --precision: torch's flags for every column of a problem (eager, both torch.compile modes, StitchCUDA),
# and optimize(precision=...) for StitchCUDA. float32_matmul_precision "highest" is allow_tf32 off, "high"
# TF32 matmuls; "medium" lets fp32 matmuls use bf16 where torch has such a path (in torch 2.11 oneDNN's
# CPU matmuls; its CUDA matmuls then use TF32).
TORCH_FLAGS = {"fp32": {"float32_matmul_precision": "highest", "cudnn_allow_tf32": False},
               "tf32": {"float32_matmul_precision": "high", "cudnn_allow_tf32": True},
               "bf16": {"float32_matmul_precision": "medium", "cudnn_allow_tf32": True}}
PRECISION_WORDS = {  # the table's header
    "fp32": "fp32: TF32 off for matmuls and convolutions in every column",
    "tf32": "tf32: TF32 matmuls and cuDNN convolutions in every column, StitchCUDA's matmuls in TF32",
    "bf16": "bf16: torch at float32_matmul_precision 'medium' with cuDNN TF32 in every column, StitchCUDA's "
            "matmuls in bf16"}


def tolerance(precision: str = "fp32") -> tuple[float, float]:
    """(atol, rtol) for an fp32 output at `precision` (the Verifier's table)."""
    from ..verify.tolerance import tolerance as verifier_tolerance

    return verifier_tolerance(torch.float32, precision)


# torch's per-backend fp32_precision settings, the API beside the legacy flags (where this torch has them).
_PRECISION_KNOBS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
                    "mkldnn.rnn")


def precision_knobs() -> list[Any]:
    knobs = []
    for path in _PRECISION_KNOBS:
        knob: Any = torch.backends
        for part in filter(None, path.split(".")):
            knob = getattr(knob, part, None)
        if knob is not None and hasattr(knob, "fp32_precision"):
            knobs.append(knob)
    return knobs


def _readable(get: Callable[[], Any]) -> Any:
    """A legacy flag's value, or None where torch refuses to read it (it was set through both APIs)."""
    try:
        return get()
    except RuntimeError:
        return None


@contextlib.contextmanager
def precision_flags(precision: str):
    """torch's flags at `precision` (TORCH_FLAGS) for the block, restored on the way out, also when the
    block raises. Both of torch's APIs are saved: the legacy flags (float32_matmul_precision,
    cudnn.allow_tf32) and the per-backend fp32_precision settings they shadow, so the caller's settings
    come back as they were (a state that already mixed the two APIs, which torch refuses to read, reads
    consistently afterwards, with the same per-backend settings). Yields the flags."""
    if precision not in TORCH_FLAGS:
        raise ValueError(f"precision must be one of {', '.join(TORCH_FLAGS)}, not {precision!r}")
    flags = TORCH_FLAGS[precision]
    knobs = precision_knobs()
    saved = [knob.fp32_precision for knob in knobs]
    matmul = _readable(torch.get_float32_matmul_precision)
    cudnn = _readable(lambda: torch.backends.cudnn.allow_tf32)
    try:
        torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
        torch.backends.cudnn.allow_tf32 = flags["cudnn_allow_tf32"]
        yield flags
    finally:
        if matmul is not None:
            torch.set_float32_matmul_precision(matmul)
        if cudnn is not None:
            torch.backends.cudnn.allow_tf32 = cudnn
        for knob, value in zip(knobs, saved):
            knob.fp32_precision = value


# ---- variants: one problem file, several dtypes ----------------------------------------------------------
# A problem file may name the ways its model runs in a module-level VARIANTS tuple (bench/lowp does); the
# bench makes one row per variant, `name[variant]`. Each variant is (the dtype of the weights and floating
# inputs, the dtype torch.autocast runs the forward at or None). Autocast keeps fp32 weights, as users of
# mixed precision do: every column (eager, torch.compile, StitchCUDA, optimize() itself) runs inside it.
VARIANT_DTYPES: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "fp16": (torch.float16, None),
    "autocast-bf16": (torch.float32, torch.bfloat16),
    "autocast-fp16": (torch.float32, torch.float16),
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def variant_fields(variant: str) -> dict[str, str]:
    """What a row records of its variant: {variant, dtype (weights and activations), autocast (when it runs
    under autocast)}. ValueError naming the known variants for any other."""
    if variant not in VARIANT_DTYPES:
        raise ValueError(f"unknown variant {variant!r}: a problem's VARIANTS may name {', '.join(VARIANT_DTYPES)}")
    dtype, autocast = VARIANT_DTYPES[variant]
    return {"variant": variant, "dtype": dtype_name(dtype), **({"autocast": dtype_name(autocast)} if autocast else {})}


def cast_variant(model: torch.nn.Module, inputs: tuple, variant: str | None) -> tuple[torch.nn.Module, tuple]:
    """The model and its floating inputs in the variant's dtype (integer inputs, token ids, stay as they are).
    No variant: both unchanged."""
    if variant is None:
        return model, inputs
    dtype = VARIANT_DTYPES[variant][0]
    return model.to(dtype), tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                                  for t in inputs)


def variant_autocast(variant: str | None, device_type: str = "cuda") -> contextlib.AbstractContextManager:
    """torch.autocast at the variant's dtype on `device_type`, or nothing for a variant without autocast."""
    autocast = VARIANT_DTYPES[variant][1] if variant is not None else None
    return torch.autocast(device_type, dtype=autocast) if autocast is not None else contextlib.nullcontext()


def judged_precision(precision: str, variant: str | None) -> str:
    """The tolerance column an autocast row's outputs are compared with eager's under: an fp32 output of
    an autocast forward came through bf16/fp16 matmuls, so it is as close as a 16-bit one ("bf16")."""
    return "bf16" if variant is not None and VARIANT_DTYPES[variant][1] is not None else precision


# ---- the accuracy rule ------------------------------------------------------------------------------------
# The Verifier's (verify.tolerance: judge_accuracy, its reasons there): a candidate's error against the
# high-precision reference within ACCURACY_FACTOR times eager's plus one rounding of the output's format
# (accuracy_floor), the error norm-wise, max |got - ref| / max |ref| — a row's err_fp64 max_rel. Here it
# is applied to a row's recorded errors, column by column.


def accuracy_bound(eager_error: float, floor: float) -> float:
    from ..verify.tolerance import ACCURACY_FACTOR

    return ACCURACY_FACTOR * eager_error + floor


def accuracy_verdict(candidate_error: float | None, eager_error: float | None, floor: float) -> dict[str, Any]:
    """{ok, error, eager_error, bound} of one candidate by the Verifier's accuracy rule (norm-wise errors
    against the reference); ok None (unknown) when either error is missing (no reference)."""
    if candidate_error is None or eager_error is None:
        return {"ok": None, "error": candidate_error, "eager_error": eager_error, "bound": None}
    bound = accuracy_bound(eager_error, floor)
    return {"ok": bool(candidate_error <= bound), "error": candidate_error, "eager_error": eager_error, "bound": bound}


def row_floor(row: dict) -> float:
    """The rule's floor for a row: one rounding of its outputs' dtype (output_dtype, else the variant's
    dtype) under the precision its outputs are judged at (an autocast row's fp32 outputs at bf16's)."""
    from ..verify.tolerance import accuracy_floor

    dtype = getattr(torch, row.get("output_dtype") or row.get("dtype") or "float32")
    return accuracy_floor(dtype, judged_precision(row.get("precision", "fp32"), row.get("variant")))


def add_accuracy(row: dict) -> dict:
    """row["accuracy"]: the accuracy verdict of every column with an error against the reference
    (row["err_fp64"], max_rel) beside eager's; row["accurate"]: StitchCUDA's verdict (None without a
    reference), over every input set where the row's input_sets carry one."""
    errors = row.get("err_fp64") or {}
    eager, floor = (errors.get("eager") or {}).get("max_rel"), row_floor(row)
    verdicts = {column: accuracy_verdict(e.get("max_rel"), eager, floor) for column, e in errors.items()
                if column != "eager" and isinstance(e, dict)}
    if verdicts:
        row["accuracy"] = verdicts
    row["accurate"] = verdicts.get("stitch", {}).get("ok")
    # A program that ran: the rule on each of its input sets too (suite._set_accuracy); every one must pass.
    sets = [s["accuracy"].get("ok") for s in row.get("input_sets") or [] if isinstance(s.get("accuracy"), dict)]
    if sets:
        row["accurate"] = None if None in sets else all(sets)
    return row
