"""Profiling a PyTorch callable: which kernels dominate, which ATen op launched each, how much time is
lost between launches, what the hardware counters say, and what to do about it.

``profile()`` runs the callable three times after warm-up, each run measuring one thing without
disturbing the others: a plain trace (timings, launches, gaps), a trace under a TorchDispatchMode that
stamps each ATen op's host window on CUPTI's clock (attribution: the launch call of a kernel, found by
correlation id, falls inside the window of the op that made it), and a range-profiler run (metrics,
one range per launch, matched to the first run's launches in launch order).
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from torch.utils._python_dispatch import TorchDispatchMode

from .tracing import (DeviceCeilings, KernelMeasurement, KernelMetrics, RecordedTrace, Trace, TraceSummary, native,
                      advise, available, classify, trace)
from ..errors import InvalidArgumentError, StitchError, UnavailableError

# Percentages averaged (weighted by duration) over a kernel group's launches; byte counts and duration
# are means per launch.
_PCT_FIELDS = ("sm_throughput_pct", "memory_throughput_pct", "dram_throughput_pct", "l1_throughput_pct",
               "l2_throughput_pct", "achieved_occupancy_pct")
_MEAN_FIELDS = ("duration_ns", "dram_bytes_read", "dram_bytes_written")


@dataclass(frozen=True)
class OpWindow:
    """One ATen op's host-side call, on CUPTI's clock."""

    op: str  # "aten::convolution"
    start_ns: int
    end_ns: int


def op_name(func: Any) -> str:
    """"aten::convolution" for an OpOverload; its str() otherwise."""
    schema = getattr(func, "_schema", None)
    return schema.name if schema is not None else str(func)


class OpRecorder(TorchDispatchMode):
    """Stamps every ATen op that reaches the dispatcher below autograd with its host window.

    Ops called inside another op's kernel do not re-enter the mode, so windows do not nest; the clock
    defaults to CUPTI's, the clock of the trace's API records.
    """

    def __init__(self, clock: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.windows: list[OpWindow] = []
        self._clock = clock or native.timestamp_ns

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = self._clock()
        out = func(*args, **(kwargs or {}))
        self.windows.append(OpWindow(op_name(func), start, self._clock()))
        return out


def attribute(recorded: Trace | RecordedTrace, windows: Sequence[OpWindow]) -> dict[str, Counter]:
    """For each kernel name, how many of its launches each ATen op made.

    A kernel's launch time is the start of the outermost API call with its correlation id (a runtime
    call and the driver call inside it share the id); the op is the innermost window containing it.
    Launches outside every window (or without a traced call) count under "".
    """
    launch_at: dict[int, int] = {}
    for call in recorded.api_calls:
        previous = launch_at.get(call.correlation_id)
        if previous is None or call.start_ns < previous:
            launch_at[call.correlation_id] = call.start_ns
    ordered = sorted(windows, key=lambda w: (w.start_ns, w.end_ns))
    starts = [w.start_ns for w in ordered]
    out: dict[str, Counter] = {}
    for kernel in recorded.kernels:
        op = ""
        at = launch_at.get(kernel.correlation_id)
        if at is not None:
            best = None
            i = bisect.bisect_right(starts, at) - 1
            # Windows rarely nest; a short walk back finds an enclosing one if they do.
            for w in ordered[max(0, i - 64):i + 1][::-1]:
                inside = w.start_ns <= at <= w.end_ns
                if inside and (best is None or w.end_ns - w.start_ns < best.end_ns - best.start_ns):
                    best = w
            if best is not None:
                op = best.op
        out.setdefault(kernel.name, Counter())[op] += 1
    return out


def launch_order(recorded: Trace | RecordedTrace) -> list[str]:
    """Kernel names in the order they were launched (correlation ids grow with each call)."""
    return [k.name for k in sorted(recorded.kernels, key=lambda k: (k.correlation_id, k.start_ns))]


def match_metrics(recorded: Trace | RecordedTrace,
                  measured: Sequence[KernelMetrics]) -> tuple[dict[str, list[KernelMetrics]], str]:
    """Groups range-profiler results by the traced kernel name: by launch order when the counts agree,
    else by range name (CUPTI may name a range after the kernel's symbol). Returns (groups, note)."""
    names = launch_order(recorded)
    groups: dict[str, list[KernelMetrics]] = {}
    if len(measured) == len(names):
        for name, m in zip(names, measured):
            groups.setdefault(name, []).append(m)
        return groups, ""
    by_symbol = {}
    for k in recorded.kernels:
        by_symbol[k.mangled_name] = k.name
        by_symbol[k.name] = k.name
    unmatched = 0
    for m in measured:
        name = by_symbol.get(m.name)
        if name is None:
            unmatched += 1
        else:
            groups.setdefault(name, []).append(m)
    note = (f"metrics run saw {len(measured)} launches, the trace {len(names)}"
            + (f"; {unmatched} could not be matched by name" if unmatched else ""))
    return groups, note


def aggregate(measured: Sequence[KernelMetrics]) -> dict[str, float]:
    """One group's metrics: percentages weighted by duration, durations and bytes as means per launch."""
    if not measured:
        return {}
    weights = [max(m.duration_ns, 0.0) for m in measured]
    total = sum(weights)
    if total <= 0:
        weights, total = [1.0] * len(measured), float(len(measured))
    out = {f: sum(getattr(m, f) * w for m, w in zip(measured, weights)) / total for f in _PCT_FIELDS}
    out.update({f: sum(getattr(m, f) for m in measured) / len(measured) for f in _MEAN_FIELDS})
    out["launches_measured"] = float(len(measured))
    return out


@dataclass
class KernelReport:
    """One kernel (all launches of one name) in a profile."""

    name: str
    launches: int
    total_ns: int
    mean_ns: float
    min_ns: int
    max_ns: int
    share: float  # of summed kernel time
    ops: list[tuple[str, int]] = field(default_factory=list)  # ATen ops that launched it, most first
    metrics: dict[str, float] | None = None  # aggregate() of its launches, when collected
    bound: str | None = None  # classify() on the metrics: memory / compute / latency
    advice: list[str] = field(default_factory=list)

    @property
    def op(self) -> str:
        """The ATen op that launched most of its launches ("" when unknown)."""
        return self.ops[0][0] if self.ops else ""


@dataclass
class ProfileReport:
    """What the Planner reads about a reference: top kernels, their ops, launches, gaps, metrics, advice."""

    title: str
    device: str
    span_ns: int
    busy_ns: int
    gap_ns: int
    gap_count: int
    largest_gap_ns: int
    kernel_launches: int
    memcpy_count: int
    memset_count: int
    api_ns_per_launch: float
    kernel_groups: int  # distinct kernel names, shown or not
    kernels: list[KernelReport]  # top-k by total time
    diagnosis: list[str]
    metrics_status: str  # "collected", "off", or why they are missing
    dropped_records: int = 0

    @property
    def busy_fraction(self) -> float:
        return self.busy_ns / self.span_ns if self.span_ns else 0.0

    @property
    def gap_fraction(self) -> float:
        return self.gap_ns / self.span_ns if self.span_ns else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["busy_fraction"] = self.busy_fraction
        d["gap_fraction"] = self.gap_fraction
        for k, kd in zip(self.kernels, d["kernels"]):
            kd["op"] = k.op
            kd["ops"] = [{"op": op, "launches": n} for op, n in k.ops]
        return d

    def __str__(self) -> str:
        lines = [f"profile of {self.title} on {self.device}: {self.kernel_launches} kernel launches"
                 f" ({self.kernel_groups} distinct), {self.memcpy_count} copies, {self.memset_count} memsets",
                 f"GPU busy {100 * self.busy_fraction:.1f}% of {_time(self.span_ns)}; {self.gap_count} gaps"
                 f" total {_time(self.gap_ns)} (largest {_time(self.largest_gap_ns)});"
                 f" {_time(self.api_ns_per_launch)} host time per launch"]
        if self.dropped_records:
            lines.append(f"warning: CUPTI dropped {self.dropped_records} records; numbers are partial")
        if self.kernels:
            with_metrics = any(k.metrics for k in self.kernels)
            header = f"  {'share':>6} {'launches':>8} {'mean':>10}  "
            if with_metrics:
                header += f"{'sm%':>5} {'mem%':>5} {'dram%':>5} {'occ%':>5} {'bound':>8}  "
            lines.append(header + "kernel  [aten op]")
            for k in self.kernels:
                row = f"  {100 * k.share:5.1f}% {k.launches:8d} {_time(k.mean_ns):>10}  "
                if with_metrics:
                    m = k.metrics or {}
                    cells = [f"{m[f]:5.1f}" if f in m else "    -" for f in
                             ("sm_throughput_pct", "memory_throughput_pct", "dram_throughput_pct",
                              "achieved_occupancy_pct")]
                    row += " ".join(cells) + f" {k.bound or '-':>8}  "
                name = k.name if len(k.name) <= 90 else k.name[:87] + "..."
                lines.append(row + name + (f"  [{k.op}]" if k.op else ""))
            hidden = self.kernel_groups - len(self.kernels)
            if hidden > 0:
                lines.append(f"  ... {hidden} more kernel names")
        lines.append(f"metrics: {self.metrics_status}")
        if self.diagnosis:
            lines.append("diagnosis:")
            lines.extend(f"  - {text}" for text in self.diagnosis)
        return "\n".join(lines)


def _time(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} us"
    return f"{ns:.0f} ns"


def build_report(measured: Trace | RecordedTrace, *, title: str = "workload", device: str = "", top_k: int = 10,
                 ops: dict[str, Counter] | None = None,
                 metrics_by_kernel: dict[str, list[KernelMetrics]] | None = None,
                 metrics_status: str = "off", ceilings: DeviceCeilings | None = None) -> ProfileReport:
    """The report from one measured trace plus optional attribution and metrics (pure: no GPU)."""
    if top_k < 1:
        raise InvalidArgumentError(f"top_k must be at least 1, not {top_k}")
    s: TraceSummary = measured.summary()
    ops = ops or {}
    metrics_by_kernel = metrics_by_kernel or {}
    kernels: list[KernelReport] = []
    diagnosis = advise(s, ceilings)
    for group in s.kernels[:top_k]:
        k = KernelReport(name=group.name, launches=group.count, total_ns=group.total_ns, mean_ns=group.mean_ns,
                         min_ns=group.min_ns, max_ns=group.max_ns, share=group.share,
                         ops=[(op, n) for op, n in ops.get(group.name, Counter()).most_common() if op])
        measured_launches = metrics_by_kernel.get(group.name)
        if measured_launches:
            k.metrics = aggregate(measured_launches)
            m = k.metrics
            finding = classify(KernelMeasurement(
                name=group.name, duration_ns=m["duration_ns"],
                dram_bytes=m["dram_bytes_read"] + m["dram_bytes_written"],
                achieved_occupancy=m["achieved_occupancy_pct"] / 100.0,
                sm_throughput=m["sm_throughput_pct"] / 100.0,
                memory_throughput=m["memory_throughput_pct"] / 100.0), ceilings)
            k.bound = finding.bound
            k.advice = advise(finding)
        kernels.append(k)
    # The heaviest kernels' own advice follows the whole-run advice, most expensive first.
    for k in kernels[:3]:
        diagnosis.extend(k.advice[:1])
    return ProfileReport(
        title=title, device=device, span_ns=s.span_ns, busy_ns=s.busy_ns, gap_ns=s.gaps.total_ns,
        gap_count=s.gaps.count, largest_gap_ns=s.gaps.largest_ns, kernel_launches=s.kernel_launches,
        memcpy_count=s.memcpy_count, memset_count=s.memset_count, api_ns_per_launch=s.api_ns_per_launch,
        kernel_groups=len(s.kernels), kernels=kernels, diagnosis=diagnosis, metrics_status=metrics_status,
        dropped_records=measured.dropped_records)


def profile(fn: Callable[..., Any], *inputs: Any, top_k: int = 10, metrics: bool = True, warmup: int = 1,
            title: str | None = None, ceilings: DeviceCeilings | None = None) -> ProfileReport:
    """Profiles ``fn(*inputs)`` on the GPU: top-k kernels by time with the ATen op that launched each,
    launch count, idle gaps, per-kernel hardware metrics (``metrics=True``, where CUPTI allows) and advice.

    Raises UnavailableError where tracing cannot run (no GPU, no CUPTI, another profiler attached).
    Missing metrics (no permission, for one) do not fail the profile: ``metrics_status`` says why.
    """
    import torch

    if top_k < 1:
        raise InvalidArgumentError(f"top_k must be at least 1, not {top_k}")
    if warmup < 0:
        raise InvalidArgumentError(f"warmup must be 0 or more, not {warmup}")
    ok, reason = available()
    if not ok:
        raise UnavailableError(reason)
    title = title or getattr(fn, "__qualname__", None) or type(fn).__name__

    def run() -> None:
        fn(*inputs)

    for _ in range(warmup):
        run()
    torch.cuda.synchronize()

    with trace() as measured:
        run()
    with trace(memory=False) as attributed:
        with OpRecorder() as recorder:
            run()
    ops = attribute(attributed.trace, recorder.windows)

    metrics_by_kernel: dict[str, list[KernelMetrics]] = {}
    status = "off"
    if metrics:
        try:
            collected = native.collect_metrics(run, [], 1024)
            metrics_by_kernel, note = match_metrics(measured.trace, collected)
            status = "collected" + (f" ({note})" if note else "")
        except StitchError as exc:  # permission, another profiler, too many launches: keep the profile
            status = f"not collected: {exc.message}"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return build_report(measured.trace, title=title, device=device, top_k=top_k, ops=ops,
                        metrics_by_kernel=metrics_by_kernel, metrics_status=status, ceilings=ceilings)


__all__ = ["profile", "ProfileReport", "KernelReport", "OpRecorder", "OpWindow", "attribute", "build_report",
           "match_metrics", "aggregate", "launch_order"]
