"""`stitchcuda bench profile`: how far the profiler can be trusted, against baselines in the same run
(targets in docs/profile.md): Tracer kernel time vs CUDA events on one kernel, tracing overhead on 1,000 small
launches, DRAM % of a large copy from Metrics vs `ncu --clock-control none`, and profile() of a small
CNN vs torch.profiler run after it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Callable

DRAM_METRIC = "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"
COPY_FLOATS = 256 << 20  # 1 GiB per tensor: far beyond L2

# A copy kernel, not Tensor.copy_: torch turns a contiguous same-type copy into cudaMemcpyAsync, which
# is a memcpy record, not a kernel the range profiler (or ncu) measures.
COPY_SOURCE = r"""
extern "C" __global__ void copy4(const float4* __restrict__ in, float4* __restrict__ out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i];
}
"""

# The same copy, alone in a process so that ncu sees exactly this kernel.
_NCU_SCRIPT = f"""
import torch
from stitchcuda import jit
copy = jit.compile({COPY_SOURCE!r}, "copy4")
n4 = {COPY_FLOATS // 4}
src = torch.empty(4 * n4, device="cuda")
dst = torch.empty_like(src)
copy((n4 + 255) // 256, 256, src, dst, n4)
torch.cuda.synchronize()
"""


def _tracer_vs_events(trials: int = 20) -> dict[str, Any]:
    """The Tracer's kernel time of one GEMM against the one timer's CUDA events (stitchcuda.verify.measure
    with a ~1 ms busy-wait queued ahead of the call: the GPU is busy while the host enqueues the start
    event and the GEMM, so the events time the GEMM and not the host's launch latency, which CUPTI's
    tracing lengthens beyond what the L2 flush alone hides)."""
    import torch

    from .. import profile as prof
    from ..verify import measure

    a = torch.randn(4096, 4096, device="cuda")
    torch.mm(a, a)
    torch.cuda.synchronize()
    # The GEMM's own kernels, by name: the timer's flush and busy-wait kernels run in the same trace.
    with prof.trace(memory=False, api_calls=False) as bare:
        torch.mm(a, a)
    gemm = {k.name for k in bare.trace.kernels}
    ratios, kernel_ms, event_ms = [], [], []
    for _ in range(trials):
        with prof.trace(memory=False, api_calls=False) as t:
            events = measure(lambda: torch.mm(a, a), repeats=1, warmup=0, busy_cycles=2_000_000).median_ms
        traced = sum(k.duration_ns for k in t.trace.kernels if k.name in gemm) / 1e6
        kernel_ms.append(traced)
        event_ms.append(events)
        ratios.append(traced / events)
    return {"kernel": "torch.mm 4096x4096 fp32", "trials": trials, "tracer_ms": statistics.median(kernel_ms),
            "cuda_event_ms": statistics.median(event_ms), "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "target": "within 5% (ratio 0.95..1.05)"}


def _tracing_overhead(launches: int = 1000, rounds: int = 11) -> dict[str, Any]:
    """Traced vs untraced wall time of `launches` host-bound launches, for each trace setting, interleaved
    (drift hits every side alike), medians. A second length (4x) splits the overhead into a per-scope
    part and a per-launch part. torch.profiler on the same workload (`_torch_profiler_overhead`, the
    benchmark's last step) is the reference for what CUPTI tracing costs on this machine."""
    from .. import profile as prof

    workload = _launch_workload(launches)
    settings = {"default": {}, "no_warm_up": {"warm_up": False}, "all_api_calls": {"all_api_calls": True},
                "kernels_only": {"memory": False, "api_calls": False}}
    times: dict[str, list[float]] = {k: [] for k in ["plain", "plain_4x", "default_4x", *settings]}
    scope_cost: list[float] = []
    api_records: dict[str, int] = {}
    for _ in range(rounds):
        times["plain"].append(workload())
        for name, options in settings.items():
            t0 = time.perf_counter()
            with prof.trace(**options) as t:
                times[name].append(workload())
            if name == "default":
                scope_cost.append(time.perf_counter() - t0 - times[name][-1])
            recorded = t.summary().kernel_launches
            if recorded != launches:
                raise RuntimeError(f"the {name} trace recorded {recorded} of {launches} launches")
            api_records[name] = len(t.trace.api_calls)
            launch_calls = sum("Launch" in a.name for a in t.trace.api_calls)
            if options.get("api_calls", True) and launch_calls < launches:
                raise RuntimeError(f"the {name} trace recorded {launch_calls} launch calls for {launches} launches")
        times["plain_4x"].append(workload(4 * launches))
        with prof.trace():
            times["default_4x"].append(workload(4 * launches))
    med = {k: statistics.median(v) for k, v in times.items()}

    def pct(name: str, base: str = "plain") -> float:
        return (med[name] / med[base] - 1.0) * 100.0

    # extra(n) = fixed + n * per_launch, from the two lengths
    extra_1, extra_4 = med["default"] - med["plain"], med["default_4x"] - med["plain_4x"]
    per_launch_s = (extra_4 - extra_1) / (3 * launches)
    result = {"launches": launches, "rounds": rounds, "untraced_ms": med["plain"] * 1e3,
              "host_us_per_launch": med["plain"] / launches * 1e6,
              "traced_ms": med["default"] * 1e3, "overhead_pct": pct("default"),
              "no_warm_up_overhead_pct": pct("no_warm_up"), "all_api_calls_overhead_pct": pct("all_api_calls"),
              "kernels_only_overhead_pct": pct("kernels_only"),
              "overhead_pct_4x_launches": pct("default_4x", "plain_4x"),
              "added_us_per_launch": per_launch_s * 1e6, "added_us_per_scope": (extra_1 - launches * per_launch_s) * 1e6,
              "start_stop_ms": statistics.median(scope_cost) * 1e3, "api_records_per_trace": api_records,
              "target": "<= 3% overhead (default trace: kernels, memory and launch/copy/sync API calls)"}
    return result


def _launch_workload(launches: int) -> Callable[..., float]:
    """Wall seconds of n host-bound launches (`add_` on 256 floats), device idle before and after."""
    import torch

    x = torch.zeros(256, device="cuda")

    def workload(n: int = launches) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    workload()  # warm
    return workload


def _torch_profiler_overhead(launches: int = 1000, rounds: int = 7) -> dict[str, Any]:
    """torch.profiler (CUDA activity only) around the tracing-overhead workload, interleaved with untraced
    runs: what CUPTI tracing costs on this machine through another client. Runs last: torch.profiler
    keeps CUPTI once it has used it."""
    from torch.profiler import ProfilerActivity, profile

    workload = _launch_workload(launches)
    plain, traced = [], []
    for _ in range(rounds):
        plain.append(workload())
        with profile(activities=[ProfilerActivity.CUDA]):
            traced.append(workload())
    return {"launches": launches, "rounds": rounds, "untraced_ms": statistics.median(plain) * 1e3,
            "traced_ms": statistics.median(traced) * 1e3,
            "overhead_pct": (statistics.median(traced) / statistics.median(plain) - 1.0) * 100.0}


def _ncu_dram_pct() -> tuple[float | None, str]:
    ncu = shutil.which("ncu")
    if ncu is None:
        return None, "ncu not on PATH"
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "stitchcuda_ncu_copy.py")  # not copy.py: it would shadow the stdlib copy module
        with open(script, "w") as f:
            f.write(_NCU_SCRIPT)
        cmd = [ncu, "--clock-control", "none", "--kernel-name", "copy4", "--metrics", DRAM_METRIC, "--csv",
               sys.executable, script]
        env = dict(os.environ)
        package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../stitchcuda
        package_parent = os.path.dirname(package_dir)  # the child imports this same stitchcuda
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        except subprocess.TimeoutExpired:
            return None, "ncu timed out"
    values = []
    for line in done.stdout.splitlines():
        if DRAM_METRIC in line:
            cells = [c.strip('"') for c in re.findall(r'"[^"]*"|[^,]+', line)]
            try:
                values.append(float(cells[-1].replace(",", "")))
            except (ValueError, IndexError):
                pass
    if not values:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"ncu gave no value (exit {done.returncode}: {tail[0][:200]})"
    return values[-1], f"{len(values)} kernel(s) measured"


def _dram_from_metrics() -> dict[str, Any]:
    import torch

    from .. import profile as prof
    from ..errors import StitchError

    from .. import jit

    copy = jit.compile(COPY_SOURCE, "copy4")
    n4 = COPY_FLOATS // 4
    src = torch.empty(COPY_FLOATS, device="cuda")
    dst = torch.empty_like(src)
    grid = (n4 + 255) // 256
    copy(grid, 256, src, dst, n4)
    torch.cuda.synchronize()
    out: dict[str, Any] = {"bytes_each_way": COPY_FLOATS * 4}
    try:
        measured = prof.metrics(copy, grid, 256, src, dst, n4)
    except StitchError as exc:
        out["error"] = exc.message
        return out
    del src, dst
    torch.cuda.empty_cache()
    copy = max(measured, key=lambda m: m.duration_ns)
    out.update({"kernel": copy.name, "dram_pct": copy.dram_throughput_pct, "memory_pct": copy.memory_throughput_pct,
                "sm_pct": copy.sm_throughput_pct, "dram_bytes_read": copy.dram_bytes_read,
                "dram_bytes_written": copy.dram_bytes_written,
                "bound": prof.classify(copy.measurement()).bound})
    ncu_pct, note = _ncu_dram_pct()
    out["ncu_dram_pct"] = ncu_pct
    out["ncu_note"] = note
    if ncu_pct is not None:
        out["difference_points"] = copy.dram_throughput_pct - ncu_pct
    out["target"] = "within 5 points of ncu --clock-control none; bound = memory"
    return out


def _cnn_vs_torch_profiler() -> dict[str, Any]:
    import torch

    from .. import profile as prof

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10)).cuda().eval()
    x = torch.randn(32, 3, 64, 64, device="cuda")
    with torch.inference_mode():
        report = prof.profile(model, x, top_k=5, metrics=True, title="small CNN")
        with torch.profiler.profile(activities=activities) as p:
            model(x)
            torch.cuda.synchronize()
    kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    totals: Counter = Counter()
    for e in kernels:
        totals[e.name] += e.device_time
    torch_top = [name for name, _ in totals.most_common(3)]
    ours_top = [k.name for k in report.kernels[:3]]
    return {"launches": report.kernel_launches, "torch_profiler_launches": len(kernels),
            "launches_agree": report.kernel_launches == len(kernels), "top_kernels": ours_top,
            "torch_profiler_top_kernels": torch_top, "top_kernel_agrees": bool(ours_top and torch_top)
            and ours_top[0] == torch_top[0], "top3_overlap": len(set(ours_top) & set(torch_top)),
            "top_ops": [k.op for k in report.kernels[:3]], "metrics": report.metrics_status,
            "gap_fraction": report.gap_fraction}


def measure() -> dict[str, Any]:
    """Every number of the benchmark, as one JSON-ready dict (needs a GPU)."""
    from .. import profile as prof

    ok, reason = prof.available()
    if not ok:
        return {"skipped": reason}
    result: dict[str, Any] = {}
    for key, step in (("tracer_vs_cuda_events", _tracer_vs_events), ("tracing_overhead", _tracing_overhead),
                      ("copy_dram", _dram_from_metrics), ("cnn_vs_torch_profiler", _cnn_vs_torch_profiler),
                      ("torch_profiler_overhead", _torch_profiler_overhead)):
        try:
            result[key] = step()
        except Exception as exc:  # one failing part must not hide the others' numbers
            result[key] = {"error": f"{type(exc).__name__}: {exc}"}
    return result


def run(json_output: bool = False) -> int:
    """Prints the numbers (one JSON object with json_output); 0 when every part produced its numbers,
    1 when a part failed. Without a GPU (or CUPTI) it says why ({"error": ...} as JSON) and returns 3:
    there is nothing to measure."""
    result = measure()
    if "skipped" in result:
        from ..cli_support import EXIT_NO_GPU, refuse

        return refuse("bench profile", result["skipped"], EXIT_NO_GPU, json_output)
    if json_output:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k:28} {v:.4g}" if isinstance(v, float) else f"  {k:28} {v}")
    failed = any(isinstance(v, dict) and "error" in v for v in result.values())
    return 1 if failed else 0
