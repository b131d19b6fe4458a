"""What the verification sandbox costs on this machine's CPU, with and without it in the same run, interleaved.
First what a candidate pays: checks through a warm WorkerPool with the sandbox and one without it (the full
judged check of a small problem on the CPU, and a static check: NVRTC and the source rules), medians and
their ratio (target: within 1.05x). Then, with ``--startup``, a worker's start-up (launcher, namespaces,
mounts, seccomp, then importing torch and stitchcuda) and a job run in a fresh process, with the whole
sandbox, without it and with each layer that can be left out (stitchcuda.verify.sandbox.SKIPPABLE) left
out; a worker starts once per pool and device, so its start-up is not paid per candidate. Bounded:
``--deadline`` stops starting measurements and prints what it has. No GPU needed.

    .venv/bin/python bench/sandbox_cost.py [--candidates 12] [--startup] [--repeats 3] [--deadline 240] [--json]
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


# The candidate the per-candidate measurement checks: the tanh GELU written out (torch ops: it runs on the
# CPU), against torch's, at a size where one check takes a few tenths of a second.
PROBLEM = """import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


def get_inputs():
    return [torch.randn(256, 1024)]


def get_init_inputs():
    return []
"""
CANDIDATE = """import math

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
"""
STATIC = """import torch.nn as nn
from stitchcuda import jit

SRC = r\'\'\'
/* NONCE */ extern "C" __global__ void twice(float* y, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] *= 2.0f; }
\'\'\'


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.kernel = jit.compile(SRC, "twice")

    def forward(self, x):
        return x
"""


def per_candidate(count: int, deadline: float) -> dict:
    """``count`` full checks and as many static ones through a warm sandboxed pool and a warm unsandboxed
    one, alternating which goes first; each candidate new (a comment), so nothing is cached between them."""
    from stitchcuda.verify import VerifyConfig, WorkerPool, check

    config = VerifyConfig(device="cpu", timing_iters=20, warmup=2)
    pools = {"sandbox": WorkerPool(["cpu"], sandbox=True), "no sandbox": WorkerPool(["cpu"], sandbox=False)}
    times: dict[str, dict[str, list[float]]] = {kind: {name: [] for name in pools} for kind in ("check", "static")}
    try:
        for name, pool in pools.items():  # not counted: each starts its worker and its judge and meets the problem
            check(PROBLEM, CANDIDATE, config=config, pool=pool)
            check(PROBLEM, STATIC, static_only=True, pool=pool)
        for i in range(count):
            if time.monotonic() >= deadline:
                break
            for name in (list(pools) if i % 2 == 0 else list(pools)[::-1]):
                for kind in ("check", "static"):
                    started = time.perf_counter()
                    nonce = f"candidate {i} {name} {os.getpid()} {time.time_ns()}"  # a new compile, a new source
                    source = CANDIDATE + f"# {nonce}\n" if kind == "check" else STATIC.replace("NONCE", nonce)
                    report = check(PROBLEM, source, config=config, pool=pools[name], static_only=kind == "static")
                    if report.error is not None or (kind == "check" and not report.correct):
                        raise SystemExit(f"the {kind} failed ({name}): {report.error}")
                    times[kind][name].append(time.perf_counter() - started)
        state = pools["sandbox"].sandbox_state
    finally:
        for pool in pools.values():
            pool.close()
    out: dict = {"candidates": len(times["check"]["no sandbox"]), "sandbox": sandbox.describe(state)}
    for kind, by_name in times.items():
        n = min(len(v) for v in by_name.values())
        if not n:
            continue
        med = {name: statistics.median(v[:n]) for name, v in by_name.items()}
        out[kind] = {"sandbox_s": med["sandbox"], "no_sandbox_s": med["no sandbox"],
                     "ratio": med["sandbox"] / med["no sandbox"],
                     "spread_s": {name: [min(v), max(v)] for name, v in by_name.items()}}
    return out


def startup(repeats: int, layers: bool, deadline: float) -> dict:
    """The fresh-process job (start-up and job) per configuration, ``repeats`` rounds while time is left."""
    configs = [("no sandbox", False, ()), ("full sandbox", True, ())]
    if layers:
        configs += [(f"without {layer}", True, (layer,)) for layer in sandbox.SKIPPABLE]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    for _ in range(repeats):  # interleaved: drift of a shared machine hits every configuration alike
        if time.monotonic() >= deadline:
            break
        for name, sandboxed, skip in configs:
            runs[name].append(once(sandboxed, skip))
    if not runs["no sandbox"]:
        return {"rows": [], "repeats": 0}
    base = {k: statistics.median(r[k] for r in runs["no sandbox"]) for k in ("startup_s", "job_s")}
    rows = []
    for name, sandboxed, skip in configs:
        startup_s = statistics.median(r["startup_s"] for r in runs[name])
        job = statistics.median(r["job_s"] for r in runs[name])
        # The launcher alone, a few times: the minimum is the set-up's cost, free of a shared machine's noise.
        launcher = min(launcher_only(sandboxed, skip) for _ in range(3)) if time.monotonic() < deadline else None
        rows.append({"configuration": name, "startup_s": startup_s, "job_s": job,
                     "startup_ratio": startup_s / base["startup_s"], "job_ratio": job / base["job_s"],
                     "job_spread_s": [min(r["job_s"] for r in runs[name]), max(r["job_s"] for r in runs[name])],
                     "launcher_min_s": launcher})
    return {"rows": rows, "repeats": len(runs["no sandbox"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", type=int, default=12, help="checks of each kind through each pool (medians)")
    parser.add_argument("--startup", action="store_true", help="also the fresh-process start-up and job table")
    parser.add_argument("--layers", action="store_true", help="with --startup: each layer of the sandbox left out")
    parser.add_argument("--repeats", type=int, default=3, help="with --startup: runs per configuration (medians)")
    parser.add_argument("--deadline", type=float, default=240.0,
                        help="seconds after which no new measurement starts (default 240)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args(argv)
    if args.candidates < 1 or args.repeats < 1 or not args.deadline > 0:
        parser.error("--candidates and --repeats must be at least 1 and --deadline above 0")
    deadline = time.monotonic() + args.deadline
    started = time.monotonic()
    result = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "deadline_s": args.deadline,
              "per_candidate": per_candidate(args.candidates, deadline)}
    if args.startup:
        result["startup"] = startup(args.repeats, args.layers, deadline)
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    result["stopped_at_deadline"] = time.monotonic() >= deadline
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    pc = result["per_candidate"]
    print(pc["sandbox"])
    print(f"per candidate, warm pools, {pc['candidates']} of each, medians (same run, interleaved):")
    for kind, what in (("check", "full check on the CPU"), ("static", "static check (NVRTC)")):
        if kind in pc:
            k = pc[kind]
            print(f"  {what:<24} sandbox {k['sandbox_s']:.3f} s   no sandbox {k['no_sandbox_s']:.3f} s   "
                  f"ratio {k['ratio']:.3f} (target <= 1.05)")
    for r in (result.get("startup") or {}).get("rows", []):
        if r is result["startup"]["rows"][0]:
            print(f"{'fresh process':<30}{'start-up s':>11}{'x':>7}{'job s':>9}{'x':>7}   job min..max s   launcher min s")
        launcher = f"{r['launcher_min_s']:>15.3f}" if r["launcher_min_s"] is not None else f"{'n/a':>15}"
        print(f"{r['configuration']:<30}{r['startup_s']:>11.3f}{r['startup_ratio']:>7.3f}{r['job_s']:>9.3f}"
              f"{r['job_ratio']:>7.3f}   {r['job_spread_s'][0]:.3f}..{r['job_spread_s'][1]:.3f}{launcher}")
    if result["stopped_at_deadline"]:
        print(f"stopped at the deadline ({args.deadline:.0f} s): the figures are those measured by then")
    return 0


if __name__ == "__main__":
    sys.exit(main())
