"""torch's flags at a bench precision (fp32, tf32, bf16), set around a problem's columns and restored after,
and the tolerance outputs are judged by at that precision."""

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
