"""What ran on the GPU and what limits it: CUPTI tracing, hardware metrics, roofline diagnosis.

``with stitchcuda.profile.trace() as t:`` records every kernel, copy and CUDA call inside the block;
``stitchcuda.profile.profile(fn, *inputs)`` profiles a PyTorch callable (top kernels, the ATen op that
launched each, launch count, gaps, hardware metrics, advice). See docs/profile.md.
"""

from __future__ import annotations

# The tracing API lives in tracing.py and the model-level report in report.py, which builds on it; this
# package only names what users import.
from .report import KernelReport, ProfileReport, profile
from .tracing import (ApiRecord, DeviceCeilings, DiagnosisRules, Finding, IdleGaps, KernelGroup, KernelMeasurement,
                      KernelMetrics, KernelRecord, MemcpyRecord, MemsetRecord, RecordedTrace, Trace, TraceScope,
                      TraceSummary, advise, available, classify, metric_passes, metrics, speed_of_light_metrics,
                      supported_chips, trace, validate_metrics)

__all__ = [
    "available", "trace", "TraceScope", "RecordedTrace", "profile", "ProfileReport", "KernelReport", "metrics",
    "speed_of_light_metrics", "validate_metrics", "metric_passes", "supported_chips", "classify", "advise",
    "Trace", "TraceSummary", "KernelRecord", "MemcpyRecord", "MemsetRecord", "ApiRecord", "KernelGroup",
    "IdleGaps", "DeviceCeilings", "DiagnosisRules", "KernelMeasurement", "Finding", "KernelMetrics",
]
