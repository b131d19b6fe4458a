"""The profiler's tracing API over the native CUPTI layer: trace() scopes, the recorded trace, hardware
metrics, the roofline classification and its advice. stitchcuda.profile re-exports it; report.py builds on it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .. import _C
from ..errors import InvalidArgumentError, StitchError, UnavailableError

native = _C.profile  # the C++ profiler module (bindings/profile.cpp)

# The C++ types, as they are (attributes mirror include/stitchcuda/profile.hpp).
Trace = native.Trace
TraceSummary = native.TraceSummary
KernelRecord = native.KernelRecord
MemcpyRecord = native.MemcpyRecord
MemsetRecord = native.MemsetRecord
ApiRecord = native.ApiRecord
KernelGroup = native.KernelGroup
IdleGaps = native.IdleGaps
DeviceCeilings = native.DeviceCeilings
DiagnosisRules = native.DiagnosisRules
KernelMeasurement = native.KernelMeasurement
Finding = native.Finding
KernelMetrics = native.KernelMetrics


def available() -> tuple[bool, str]:
    """(True, "") when tracing can start here; else (False, "profiler unavailable: why, and how to fix")."""
    if _C.device_count() == 0:
        ok, reason = _C.driver_available()
        why = "the driver reports no devices" if ok else reason
        return False, f"profiler unavailable: no CUDA device to trace ({why}); run on a machine with an NVIDIA GPU"
    return native.available()


class RecordedTrace:
    """What a trace() scope recorded: the records as plain Python lists (converted once from the native
    Trace, so indexing in a loop is cheap) and the native summaries. Treat the lists as read-only;
    build a :class:`Trace` to summarize records of your own."""

    def __init__(self, native: Trace) -> None:
        self.native = native
        self.kernels: list[KernelRecord] = native.kernels
        self.memcpys: list[MemcpyRecord] = native.memcpys
        self.memsets: list[MemsetRecord] = native.memsets
        self.api_calls: list[ApiRecord] = native.api_calls
        self.dropped_records: int = native.dropped_records

    def summary(self) -> TraceSummary:
        """Busy time, gaps, launches, per-kernel groups, host time per launch."""
        return self.native.summary()

    def to_chrome_json(self) -> str:
        """Chrome / Perfetto trace-event JSON (open in ui.perfetto.dev)."""
        return self.native.to_chrome_json()

    def __repr__(self) -> str:
        return (f"<RecordedTrace {len(self.kernels)} kernels, {len(self.memcpys)} copies, "
                f"{len(self.memsets)} memsets, {len(self.api_calls)} API calls>")


class TraceScope:
    """A CUPTI trace of the ``with`` block; ``.trace`` holds the records after the block exits.

    Entering raises :class:`~stitchcuda.errors.UnavailableError` (no GPU, no CUPTI, no permission, another
    profiler attached, another trace active). Leaving synchronizes the device and releases CUPTI, so
    ``torch.profiler`` can attach afterwards; a fault inside the block raises
    :class:`~stitchcuda.errors.LaunchError` unless the block already raised.
    """

    def __init__(self, kernels: bool = True, memory: bool = True, api_calls: bool = True,
                 all_api_calls: bool = False, warm_up: bool = True, buffer_bytes: int = 8 << 20) -> None:
        self._options = dict(kernels=kernels, memory=memory, api_calls=api_calls, all_api_calls=all_api_calls,
                             warm_up=warm_up, buffer_bytes=buffer_bytes)
        self._tracer = None
        self._used = False
        self.trace: RecordedTrace | None = None

    def __enter__(self) -> "TraceScope":
        if self._used:
            raise InvalidArgumentError("this trace() scope was already used: make a new one with trace()")
        self._used = True
        self._tracer = native.Tracer.start(**self._options)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        tracer, self._tracer = self._tracer, None
        try:
            self.trace = RecordedTrace(tracer.stop())
        except StitchError:
            if exc_type is None:
                raise
            # The block's own exception says more; CUPTI was released either way.
        return False

    def _recorded(self) -> RecordedTrace:
        if self.trace is None:
            raise InvalidArgumentError("the trace is read after the `with trace() as t:` block has exited")
        return self.trace

    def summary(self) -> TraceSummary:
        """Busy time, gaps, launches, per-kernel groups, host time per launch."""
        return self._recorded().summary()

    def to_chrome_json(self) -> str:
        """Chrome / Perfetto trace-event JSON (open in ui.perfetto.dev)."""
        return self._recorded().to_chrome_json()

    def advise(self, ceilings: DeviceCeilings | None = None) -> list[str]:
        """Short texts on the whole trace: gaps, the dominant kernel, host cost per launch."""
        return native.advise_summary(self.summary(), ceilings or DeviceCeilings())


def trace(kernels: bool = True, memory: bool = True, api_calls: bool = True, all_api_calls: bool = False,
          warm_up: bool = True, buffer_bytes: int = 8 << 20) -> TraceScope:
    """``with trace() as t: ...`` records kernels, memcpy/memset and CUDA API calls inside the block.

    ``api_calls`` records the runtime and driver calls that launch, copy, set or synchronize (what places
    GPU work on the host timeline); ``all_api_calls=True`` records every call, at a higher cost per launch.
    ``warm_up`` runs one empty kernel on entry so that CUPTI's set-up for timing kernels is paid there,
    not inside the block (its records are dropped).
    """
    return TraceScope(kernels=kernels, memory=memory, api_calls=api_calls, all_api_calls=all_api_calls,
                      warm_up=warm_up, buffer_bytes=buffer_bytes)


def classify(measurement: KernelMeasurement, ceilings: DeviceCeilings | None = None,
             rules: DiagnosisRules | None = None) -> Finding:
    """Places a kernel on the roofline and names its limiter ("memory", "compute", "latency", "launch")."""
    return native.classify(measurement, ceilings or DeviceCeilings(), rules or DiagnosisRules())


def advise(what: Finding | TraceSummary, ceilings: DeviceCeilings | None = None,
           rules: DiagnosisRules | None = None) -> list[str]:
    """Texts the Coder can act on, most important first, for a Finding or a whole TraceSummary."""
    rules = rules or DiagnosisRules()
    if isinstance(what, Finding):
        return native.advise_finding(what, rules)
    if isinstance(what, TraceSummary):
        return native.advise_summary(what, ceilings or DeviceCeilings(), rules)
    raise InvalidArgumentError(f"advise() takes a Finding or a TraceSummary, not {type(what).__name__}")


def speed_of_light_metrics() -> list[str]:
    """Nsight Compute's names of the metrics collected by default."""
    return native.speed_of_light_metrics()


def metrics(fn: Callable[..., Any], *args: Any, metric_names: Sequence[str] | None = None,
            max_kernels: int = 1024, **kwargs: Any) -> list[KernelMetrics]:
    """Runs ``fn(*args, **kwargs)`` once under the CUPTI range profiler (each kernel replayed per pass)
    and returns one :class:`KernelMetrics` per kernel launch, in launch order."""
    ok, reason = available()
    if not ok:
        raise UnavailableError(reason)
    return native.collect_metrics(lambda: fn(*args, **kwargs), list(metric_names or []), max_kernels)


def validate_metrics(metric_names: Sequence[str], chip: str) -> None:
    """Raises InvalidArgumentError naming the first metric the chip ("GH100") lacks; needs no GPU."""
    native.validate_metrics(list(metric_names), chip)


def metric_passes(metric_names: Sequence[str], chip: str) -> int:
    """Replay passes the metrics need on a chip (host API only, no GPU)."""
    return native.metric_passes(list(metric_names), chip)


def supported_chips() -> list[str]:
    """Chips the loaded CUPTI can compute metrics for."""
    return native.supported_chips()
