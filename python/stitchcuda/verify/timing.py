"""The one in-process timer: every GPU time StitchCUDA reports (optimize()'s measurements and replay
choice, the benchmarks) is taken by ``measure``, on the Verifier's own protocol (verify/gpu.py), so a
speed-up printed anywhere means what the Verifier's speed-up means.

Protocol "stitchcuda" (the default, the Verifier's): before each timed call the persisting-L2 state is
reset and L2 is flushed (a buffer twice its size written); CUDA events time the call on its stream, a
device-wide sync follows and charges work left on other streams; the statistic is the median.
Protocol "kernelbench": KernelBench's measurement, L2 flush and events without the persisting reset or
the device-wide join, mean of the calls: kept as the baseline the Verifier's numbers are compared with.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import InvalidArgumentError, UnavailableError

__all__ = ["Timing", "measure", "PROTOCOLS"]

PROTOCOLS = ("stitchcuda", "kernelbench")


@dataclass(frozen=True)
class Timing:
    """What ``measure`` saw: every call's time (ms) and the statistics of them."""

    protocol: str
    times: list[float] = field(repr=False)
    warmup: int
    sync_latency_ms: float | None = None  # the device-wide sync's round trip subtracted ("stitchcuda" only)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.times)

    @property
    def min_ms(self) -> float:
        return min(self.times)

    @property
    def ms(self) -> float:
        """The protocol's statistic: the median for "stitchcuda", the mean for "kernelbench"."""
        return self.mean_ms if self.protocol == "kernelbench" else self.median_ms

    def to_dict(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "ms": self.ms, "median_ms": self.median_ms, "mean_ms": self.mean_ms,
                "min_ms": self.min_ms, "trials": len(self.times), "warmup": self.warmup,
                "sync_latency_ms": self.sync_latency_ms}


def measure(fn: Callable[..., Any], input_sets: Sequence[Sequence[Any]] | None = None, *, repeats: int = 30,
            warmup: int = 3, protocol: str = "stitchcuda", busy_cycles: int = 0) -> Timing:
    """Times ``repeats`` calls of ``fn`` on the current CUDA device after ``warmup`` untimed ones.
    ``input_sets``: argument tuples cycled over the calls (default: ``fn()`` with no arguments); several
    sets keep a result cached for one set of pointers from passing for speed. The caller's autograd mode
    applies (wrap in torch.no_grad() to time inference). ``busy_cycles`` ("stitchcuda" only): a busy-wait
    kernel queued after the flush so that the host's launch latency never shows, for comparing a kernel's
    event time with a profiler's (2_000_000 cycles: about 1 ms at a 2 GHz clock). UnavailableError without a
    GPU."""
    if protocol not in PROTOCOLS:
        raise InvalidArgumentError(f"measure: protocol must be one of {PROTOCOLS}, not {protocol!r}")
    if repeats < 1 or warmup < 0 or busy_cycles < 0:
        raise InvalidArgumentError(f"measure: repeats must be >= 1, warmup and busy_cycles >= 0 (got {repeats}, "
                                   f"{warmup}, {busy_cycles})")
    if busy_cycles and protocol != "stitchcuda":
        raise InvalidArgumentError("measure: busy_cycles belongs to the \"stitchcuda\" protocol "
                                   "(KernelBench's has none)")
    sets = [tuple(s) for s in input_sets] if input_sets is not None else [()]
    if not sets:
        raise InvalidArgumentError("measure: input_sets is empty")
    if not torch.cuda.is_available():
        raise UnavailableError("measure: timing needs a CUDA device (torch.cuda.is_available() is False)")
    from . import gpu

    flush = gpu.L2Flush(torch.device("cuda", torch.cuda.current_device()))
    if protocol == "kernelbench":
        return Timing(protocol, gpu.time_calls_kernelbench(fn, sets, repeats, warmup, flush), warmup)
    sync = gpu.sync_latency(flush)
    times, _ = gpu.time_calls(fn, sets, repeats, warmup, flush, gpu.PersistingL2(), sync, snapshot=False,
                              busy_cycles=busy_cycles)
    return Timing(protocol, times, warmup, sync.typical_ms)
