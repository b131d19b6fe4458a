"""Benchmark of the Verifier: honest NVRTC candidates verified per minute on a Level-1-sized problem
with the CUPTI cross-check and the attribution on (target >= 60/min on one H200); the sandbox's cost
(each candidate verified in the sandboxed pool and right after in one without it: target <= +5% per
candidate); and agreement of the Verifier's speed-up with a
plain KernelBench-style measurement (CUDA events, L2 flush, mean of 100: stitchcuda.verify.measure's
"kernelbench" protocol) taken in the same run (target within 3%). Both are repeated KB_REPEATS (9) times
per variant, interleaved: the medians are compared, and the spreads of the repeats are reported, since no
agreement can be tighter than they are.

The problem and candidates are our own: a GELU-like sigmoid gate plus a bias over an 8192 x 8192
fp32 matrix (eager PyTorch runs four elementwise kernels; a candidate fuses them into one).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import types
from typing import Any

PROBLEM = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    """y = x * sigmoid(1.702 x) + bias (bias broadcast over rows)."""

    def __init__(self, cols):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(cols))

    def forward(self, x):
        return x * torch.sigmoid(1.702 * x) + self.bias


rows = 8192
cols = 8192


def get_inputs():
    return [torch.rand(rows, cols)]


def get_init_inputs():
    return [cols]
'''

# {variant} makes every candidate a fresh NVRTC compile, as a new Coder attempt would be.
CANDIDATE = '''
import torch
import torch.nn as nn
from stitchcuda import jit

SRC = r"""
// variant {variant}
extern "C" __global__ void __launch_bounds__({block})
gate_bias(const float* __restrict__ x, const float* __restrict__ bias, float* __restrict__ out,
          long long n, int cols) {{
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long n4 = {vec} ? n / 4 : 0;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4* out4 = reinterpret_cast<float4*>(out);
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {{
    const float4 v = x4[i];
    const int c = (int)((i * 4) % cols);
    float4 r;
    r.x = v.x / (1.f + expf(-1.702f * v.x)) + bias[c];
    r.y = v.y / (1.f + expf(-1.702f * v.y)) + bias[c + 1];
    r.z = v.z / (1.f + expf(-1.702f * v.z)) + bias[c + 2];
    r.w = v.w / (1.f + expf(-1.702f * v.w)) + bias[c + 3];
    out4[i] = r;
  }}
  for (long long i = n4 * 4 + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {{
    const float v = x[i];
    out[i] = v / (1.f + expf(-1.702f * v)) + bias[i % cols];
  }}
}}
"""
_gate = jit.compile(SRC, "gate_bias")


class ModelNew(nn.Module):
    def __init__(self, cols):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(cols))

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        vectorized = {vec} and x.shape[-1] % 4 == 0
        work = n // 4 if vectorized else n
        grid = max(1, min((work + {block} - 1) // {block}, 132 * 16))
        _gate(grid, {block}, x, self.bias, out, n, x.shape[-1])
        return out
'''

THROUGHPUT_CANDIDATES = 12
TARGET_PER_MINUTE = 60  # honest candidates a minute, with CUPTI and the attribution on
AGREEMENT_VARIANTS = ((256, 1), (512, 1), (128, 0))
KB_TRIALS = 100
KB_REPEATS = 9  # measurements of each protocol per variant: medians compared, single repeats spread (docs/verify.md)


def candidate_source(variant: str, block: int = 256, vec: int = 1) -> str:
    return CANDIDATE.format(variant=variant, block=block, vec=vec)


def _kernelbench_style(model, inputs, trials: int = KB_TRIALS) -> float:
    """Mean of ``trials`` event-timed calls, L2 flushed before each (no device-wide sync inside): the
    one timer's "kernelbench" protocol, the baseline the Verifier's speed-ups are compared with."""
    import torch

    from ..verify import measure

    with torch.no_grad():
        return measure(model, [inputs], repeats=trials, warmup=10, protocol="kernelbench").mean_ms


def _load(source: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


def run(json_output: bool) -> int:
    """Runs the benchmark and prints the result (one JSON object with ``json_output``); 0 when it ran,
    3 without a GPU."""
    import torch

    from ..cli_support import EXIT_NO_GPU, no_gpu_reason, refuse
    from ..verify import Task, VerifyConfig, WorkerPool, check

    why = no_gpu_reason()
    if why is not None:
        return refuse("bench verify", f"no GPU ({why}); nothing measured", EXIT_NO_GPU, json_output)
    task = Task.from_source(PROBLEM, "gate_bias_8192")
    config = VerifyConfig()
    nonce = f"{os.getpid()}-{time.time_ns()}"
    failures: list[dict[str, Any]] = []
    with WorkerPool(devices=["cuda:0"]) as pool, WorkerPool(devices=["cuda:0"], sandbox=False) as bare:
        # Warm-up (not counted): worker start, input generation, torch.compile of the reference.
        for p in (pool, bare):
            warm = check(task, candidate_source(f"warm-{nonce}-{p.sandbox}"), config=config, pool=p)
            if not warm.correct or warm.hack:
                failures.append({"candidate": f"warm-up (sandbox {p.sandbox})", "error": warm.error,
                                 "findings": [f.rule for f in warm.findings if f.severity == "major"]})
        # Each candidate verified in the sandbox and, right after, without it (a fresh source each time,
        # so that both compile with NVRTC): the same GPU and clocks for both, drift cancels.
        reports, seconds = [], {True: [], False: []}
        for i in range(THROUGHPUT_CANDIDATES):
            block, vec = AGREEMENT_VARIANTS[i % len(AGREEMENT_VARIANTS)]
            for p in (pool, bare):
                t0 = time.perf_counter()
                r = check(task, candidate_source(f"{nonce}-{i}-{p.sandbox}", block, vec), config=config, pool=p)
                seconds[p.sandbox].append(time.perf_counter() - t0)
                if p.sandbox:
                    reports.append(r)
                if not r.correct or r.hack:
                    failures.append({"candidate": i, "sandbox": p.sandbox, "error": r.error,
                                     "findings": [f.rule for f in r.findings if f.severity == "major"]})
        elapsed = sum(seconds[True])
        per_minute = THROUGHPUT_CANDIDATES / elapsed * 60
        sandbox_line = reports[0].timing.get("sandbox", "") if reports else ""
        overhead = statistics.median(seconds[True]) / statistics.median(seconds[False]) - 1.0

        # Agreement: each variant verified, then measured KernelBench-style here, in the same run.
        agreement = []
        init = task.init_inputs()
        for block, vec in AGREEMENT_VARIANTS:
            source = candidate_source(f"agree-{nonce}-{block}-{vec}", block, vec)
            torch.manual_seed(42)
            reference = task.build_reference(42).cuda()
            torch.manual_seed(42)
            candidate = _load(source, f"bench_candidate_{block}_{vec}").ModelNew(*init).cuda()
            inputs = [x.cuda() for x in task.make_inputs(7)]
            # Both protocols KB_REPEATS times over, interleaved so that drift of the GPU's clocks hits both:
            # the medians are compared, the spreads say how far each moves between repeats (no
            # agreement can be tighter than the two together).
            checked, repeats = [], []
            for _ in range(KB_REPEATS):
                checked.append(check(task, source, config=config, pool=pool))
                repeats.append((_kernelbench_style(reference, inputs), _kernelbench_style(candidate, inputs)))
            ratios = [e / c for e, c in repeats]
            mid = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]
            (kb_eager, kb_cand), kb_speedup, speedups = repeats[mid], ratios[mid], sorted(ratios)
            timed = [r for r in checked if r.speedup.get("eager")]
            timed.sort(key=lambda r: r.speedup["eager"])
            report = timed[len(timed) // 2] if timed else checked[0]
            ours = report.speedup.get("eager")
            ours_all = [r.speedup["eager"] for r in timed]
            agreement.append({
                "variant": f"block {block}, {'float4' if vec else 'scalar'}",
                "verifier_speedup": ours, "kernelbench_speedup": kb_speedup,
                "relative_difference": abs(ours - kb_speedup) / kb_speedup if ours else None,
                "verifier_candidate_ms": report.timing.get("candidate_ms"), "kernelbench_candidate_ms": kb_cand,
                "verifier_eager_ms": report.timing.get("eager_ms"), "kernelbench_eager_ms": kb_eager,
                "kernelbench_repeats": speedups, "kernelbench_spread": (speedups[-1] - speedups[0]) / kb_speedup,
                "verifier_repeats": ours_all,
                "verifier_spread": (ours_all[-1] - ours_all[0]) / ours if ours_all else None,
                "compile_speedup": report.speedup.get("compile"),
                "cupti_kernel_ms": report.timing.get("cupti_kernel_ms"),
                "correct": all(r.correct for r in checked), "hack": any(r.hack for r in checked)})
            del reference, candidate, inputs
            torch.cuda.empty_cache()
    diffs = [a["relative_difference"] for a in agreement if a["relative_difference"] is not None]
    result = {
        "benchmark": "verify", "device": torch.cuda.get_device_name(0),
        "problem": "x * sigmoid(1.702 x) + bias, 8192 x 8192 fp32",
        "candidates_verified": THROUGHPUT_CANDIDATES, "seconds": elapsed,
        "candidates_per_minute": per_minute, "target_per_minute": TARGET_PER_MINUTE,
        "throughput_ok": per_minute >= TARGET_PER_MINUTE and not failures,
        "sandbox": sandbox_line, "sandbox_overhead": overhead, "sandbox_overhead_ok": overhead <= 0.05,
        "seconds_per_candidate": {"sandbox": statistics.median(seconds[True]),
                                  "no_sandbox": statistics.median(seconds[False])},
        "agreement": agreement, "max_relative_difference": max(diffs) if diffs else None,
        "agreement_ok": bool(diffs) and max(diffs) <= 0.03 and len(diffs) == len(agreement),
        "failures": failures,
        "mean_report_s": statistics.mean(r.wall_s for r in reports),
    }
    if json_output:
        print(json.dumps(result, default=str))
    else:
        print(format_result(result))
    return 0


def format_result(result: dict[str, Any]) -> str:
    lines = [f"verify benchmark on {result['device']}: {result['problem']}",
             f"  throughput  {result['candidates_per_minute']:.1f} honest NVRTC candidates/min "
             f"({result['candidates_verified']} in {result['seconds']:.1f} s, CUPTI attribution on; target >= "
             f"{result['target_per_minute']}) {'OK' if result['throughput_ok'] else 'MISSED'}",
             f"  sandbox     {100 * result['sandbox_overhead']:+.1f}% per candidate against the same pool without "
             f"it ({result['seconds_per_candidate']['sandbox']:.3f} s vs "
             f"{result['seconds_per_candidate']['no_sandbox']:.3f} s; target <= +5%) "
             f"{'OK' if result['sandbox_overhead_ok'] else 'MISSED'}; {result['sandbox']}"]
    for a in result["agreement"]:
        lines.append(f"  {a['variant']:22} verifier {a['verifier_speedup'] or float('nan'):.3f}x  "
                     f"KernelBench-style {a['kernelbench_speedup']:.3f}x  "
                     f"diff {100 * (a['relative_difference'] or float('nan')):.2f}%  "
                     f"(repeats' spread: KernelBench-style {100 * a['kernelbench_spread']:.1f}%, "
                     f"verifier {100 * (a.get('verifier_spread') or float('nan')):.1f}%)")
    mrd = result["max_relative_difference"]
    lines.append(f"  agreement   max difference {100 * mrd:.2f}% (target <= 3%) "
                 f"{'OK' if result['agreement_ok'] else 'MISSED'}" if mrd is not None else "  agreement   n/a")
    if result["failures"]:
        lines.append(f"  failures    {result['failures']}")
    return "\n".join(lines)


if __name__ == "__main__":
    from ..cli_support import module_main

    sys.exit(module_main("python -m stitchcuda.bench.verify", __doc__, run))
