"""What the verification sandbox costs on this machine's CPU: a worker's start-up (launcher, namespaces,
mounts, seccomp, then importing torch and stitchcuda) and a job's run inside it, with the whole sandbox,
without it, and with each layer that can be left out (stitchcuda.verify.sandbox.SKIPPABLE) left out.
Prints a table of medians with ratios to the sandbox-off baseline (target: a job within 1.05x; a worker
starts once per pool and device, so its start-up is not paid per candidate). No GPU needed.

    .venv/bin/python bench/sandbox_cost.py [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from stitchcuda.verify import sandbox
from stitchcuda.verify.pool import worker_environment

# The job: what a CPU verification does many times over — tensor work in torch, file and process system
# calls (each one through the seccomp filter), an NVRTC compile without the cache — timed inside the
# worker, so the start-up is not in it.
JOB = r'''
import json, os, sys, time
t0 = time.perf_counter()
import torch
from stitchcuda import jit
imported = time.perf_counter() - t0
t1 = time.perf_counter()
x = torch.randn(256, 256)
for _ in range(50):
    x = torch.tanh(x @ x.T / 256)
for i in range(1000):
    os.stat(sys.executable)
    with open(os.devnull, "rb") as f:
        f.read(1)
for i in range(20):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
src = 'extern "C" __global__ void k%d(float* y) { y[threadIdx.x] *= 2.0f; }' % os.getpid()
jit.compile(src, "k%d" % os.getpid(), arch="sm_90a", cache=False, confined=True)
print(json.dumps({"import_s": imported, "job_s": time.perf_counter() - t1,
                  "state": os.environ.get("STITCHCUDA_SANDBOX_STATE")}))
'''


def once(sandboxed: bool, skip: tuple[str, ...]) -> dict:
    private = tempfile.mkdtemp(prefix="stitchcuda-bench-sandbox-")
    try:
        cmd = sandbox.command(private, sandboxed, [sys.executable, "-c", JOB], skip=skip)
        started = time.perf_counter()
        # A fresh TMPDIR for every configuration: NVRTC keeps its precompiled header there, which a sandboxed
        # worker finds in its private folder only (a pool's worker keeps it for the pool's life).
        env = dict(worker_environment(), TMPDIR=private)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        total = time.perf_counter() - started
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"the job failed ({'sandbox' if sandboxed else 'no sandbox'}, skip {skip}): "
                         f"{done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["startup_s"] = total - out["job_s"]  # launcher, namespaces, mounts, interpreter and imports
    return out


def launcher_only(sandboxed: bool, skip: tuple[str, ...]) -> float:
    """Seconds to start an interpreter that does nothing through the launcher: the sandbox's own set-up
    (namespaces, mounts, the view, seccomp), without torch's import, which dominates a worker's start."""
    private = tempfile.mkdtemp(prefix="stitchcuda-bench-sandbox-")
    try:
        started = time.perf_counter()
        subprocess.run(sandbox.command(private, sandboxed, [sys.executable, "-S", "-c", "pass"], skip=skip),
                       check=True, env=worker_environment(), timeout=120)
        return time.perf_counter() - started
    finally:
        shutil.rmtree(private, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per configuration (medians are reported)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    configs = [("no sandbox", False, ()), ("full sandbox", True, ())]
    configs += [(f"without {layer}", True, (layer,)) for layer in sandbox.SKIPPABLE]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    for _ in range(args.repeats):  # interleaved: drift of a shared machine hits every configuration alike
        for name, sandboxed, skip in configs:
            runs[name].append(once(sandboxed, skip))
    base = {k: statistics.median(r[k] for r in runs["no sandbox"]) for k in ("startup_s", "job_s")}
    rows = []
    for name, _, _ in configs:
        startup = statistics.median(r["startup_s"] for r in runs[name])
        job = statistics.median(r["job_s"] for r in runs[name])
        rows.append({"configuration": name, "startup_s": startup, "job_s": job,
                     "startup_ratio": startup / base["startup_s"], "job_ratio": job / base["job_s"],
                     "job_spread_s": [min(r["job_s"] for r in runs[name]), max(r["job_s"] for r in runs[name])]})
    # The launcher alone, many times: the minimum is the set-up's cost, free of a shared machine's noise.
    launch = {name: min(launcher_only(sandboxed, skip) for _ in range(5 * args.repeats))
              for name, sandboxed, skip in configs}
    for row in rows:
        row["launcher_min_s"] = launch[row["configuration"]]
    state = json.loads(runs["full sandbox"][0]["state"] or "{}")
    result = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "repeats": args.repeats,
              "sandbox": sandbox.describe(state), "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(result["sandbox"])
    print(f"{'configuration':<30}{'start-up s':>11}{'x':>7}{'job s':>9}{'x':>7}   job min..max s   launcher min s")
    for r in rows:
        print(f"{r['configuration']:<30}{r['startup_s']:>11.3f}{r['startup_ratio']:>7.3f}{r['job_s']:>9.3f}"
              f"{r['job_ratio']:>7.3f}   {r['job_spread_s'][0]:.3f}..{r['job_spread_s'][1]:.3f}"
              f"{r['launcher_min_s']:>15.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
