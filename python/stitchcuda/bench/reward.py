"""Benchmark of the reward service: candidates scored per minute end to end through `serve reward` (HTTP,
queue, pool) against the Verifier alone (``rl.score_completion`` called on the same worker processes) in
the same run, the service's overhead in %, and with more than one worker the scaling over one worker.
Targets on a GPU: >= 60 verified candidates a minute per GPU, overhead <= 5%. Without a GPU it runs in
static mode (NVRTC compile + static rules, unverified) and says so.

Candidates are the Verifier corpus's own (tests/corpus: honest and hacked, the stitchcuda.jit ones), each
made a fresh NVRTC compile per phase by a comment in its CUDA source, as a new RL sample would be. The
target is measured on the honest ones; the mix of honest and hacked is measured beside it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

TARGET_PER_MINUTE_PER_GPU = 60
TARGET_OVERHEAD = 0.05
BATCH = 4  # items per request, as a trainer sends a group of samples
ROUNDS = 2  # measurements of each path, interleaved
SAMPLE_S = 0.5  # how often the multi-GPU run reads the queue
DISTURBANCE_REPEATS = 5  # scores of one candidate on GPU 0, alone and with the other GPUs busy
TARGET_EFFICIENCY = 0.9
TARGET_DISTURBANCE = 0.03
CORPUS = Path(__file__).resolve().parents[3] / "tests" / "corpus"
# Problems with several honest and hacked stitchcuda.jit candidates each.
PROBLEMS = ("row_softmax", "gemm", "layer_norm", "rms_norm", "log_softmax")


def corpus_candidates(problems: Sequence[str] = PROBLEMS) -> list[tuple[str, str, str]]:
    """(task id, kind "honest"/"hack", source) of the corpus's stitchcuda.jit candidates for ``problems``,
    honest and hacked interleaved."""
    found: dict[str, list[tuple[str, str, str]]] = {"honest": [], "hack": []}
    for kind, folder in (("honest", "honest"), ("hack", "hacks")):
        for path in sorted((CORPUS / folder).glob("*.py")):
            source = path.read_text()
            header = re.match(r"# corpus: (\w+) problem=(\w+)", source)
            if header and header.group(2) in problems and "load_inline" not in source:
                found[kind].append((f"corpus/{header.group(2)}", kind, source))
    out = []
    for i in range(max(len(found["honest"]), len(found["hack"]))):
        out += [group[i] for group in (found["honest"], found["hack"]) if i < len(group)]
    return out


def fresh(source: str, nonce: str) -> str:
    """The candidate with a comment in its CUDA source, so its NVRTC compile is new (the kernel cache keys on
    the source); a candidate without a kernel is unchanged."""
    return source.replace("__global__", f"/* {nonce} */ __global__", 1)


def reply(source: str) -> str:
    return f"Here is the optimized model.\n\n```python\n{source.rstrip()}\n```\n"


def _items(candidates: list[tuple[str, str, str]], count: int, phase: str, mode: str) -> list[dict[str, Any]]:
    out = []
    for i in range(count):
        task, _, source = candidates[i % len(candidates)]
        out.append({"task": task, "completion": reply(fresh(source, f"bench {phase} {i}")), "mode": mode})
    return out


def _parallel(workers: int, work: list[Any], fn: Callable[[int, Any], Any]) -> tuple[float, list[Any]]:
    """Runs fn(worker index, item) over ``work`` with ``workers`` threads pulling from one list; (seconds, results)."""
    results: list[Any] = [None] * len(work)
    lock = threading.Lock()
    next_index = [0]

    def loop(w: int) -> None:
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(work):
                return
            results[i] = fn(w, work[i])

    threads = [threading.Thread(target=loop, args=(w,)) for w in range(workers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, results


def _through_service(slots: list, items: list[dict[str, Any]], samples: list | None = None
                     ) -> tuple[float, list[dict[str, Any]], dict]:
    """The items through a RewardService over ``slots``, sent in batches of BATCH by as many clients as it takes
    to keep every worker busy; (seconds, replies, the service's metrics). With ``samples``, the queue is read
    every SAMPLE_S meanwhile: (seconds, items queued, items running on each device)."""
    from ..rl.service import RewardClient, RewardService
    from ..rl.workers import RewardPool

    pool = RewardPool(slots=slots, warm=False, cache_size=0, queue_size=max(64, len(items)))
    done = threading.Event()

    def sample(t0: float) -> None:
        while True:  # one sample at once, then every SAMPLE_S until the items are done
            m = pool.metrics()
            running: dict[str, int] = {}
            for w in m["workers"]:
                running[w["device"]] = running.get(w["device"], 0) + (w["state"] == "busy")
            samples.append({"t": round(time.perf_counter() - t0, 2), "queued": m["queue_depth"], "running": running})
            if done.wait(SAMPLE_S):
                return

    with RewardService(pool, "127.0.0.1", 0) as service:
        client = RewardClient(service.url)
        batches = [items[i:i + BATCH] for i in range(0, len(items), BATCH)]
        sampler = threading.Thread(target=sample, args=(time.perf_counter(),), daemon=True)
        if samples is not None:
            sampler.start()
        try:
            seconds, replies = _parallel(2 * len(slots), batches, lambda _w, batch: client.score(batch))
        finally:
            done.set()
            if samples is not None:
                sampler.join()
        metrics = client.metrics()
    return seconds, [r for batch in replies for r in batch], metrics


def _warm(slots: list, cands: list[tuple[str, str, str]], mode: str) -> None:
    """Not counted: each worker starts and meets every problem once, through an honest candidate (on a
    GPU: its torch.compile baseline, compiled once per worker and problem)."""
    from ..rl.workers import RewardItem

    warm = {task: source for task, kind, source in reversed(cands) if kind == "honest"}
    items = [RewardItem(task, reply(fresh(source, "bench warm")), mode=mode) for task, source in warm.items()]
    _parallel(len(slots), list(range(len(slots))), lambda _w, s: [slots[s].run(it) for it in items])


def _measure(slots: list, cands: list[tuple[str, str, str]], count: int, label: str, mode: str) -> dict[str, Any]:
    """``count`` candidates of ``cands`` through the Verifier alone (score_completion on the slots' worker
    processes) and through the service, ROUNDS interleaved rounds, the best of each path kept: whatever the
    machine does meanwhile hits both."""
    from ..rl.workers import RewardItem

    def timed(w: int, item: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        out = slots[w].run(RewardItem(**item))
        return {**out, "run_s": time.perf_counter() - t0}

    alone_times, service_times, own = [], [], []
    for round_ in range(ROUNDS):
        seconds, alone = _parallel(len(slots), _items(cands, count, f"{label} alone {round_}", mode), timed)
        alone_times.append(seconds)
        seconds, served, metrics = _through_service(slots, _items(cands, count, f"{label} service {round_}", mode))
        service_times.append(seconds)
        # The service's own share of its wall time: worker-seconds not spent scoring (HTTP, JSON, queue
        # hand-offs, idle workers), over the scoring time. The candidates' own run-to-run variation
        # (a few % between rounds, NVRTC and timing loops) cancels here; in the throughput ratio it does not.
        busy = sum(r.get("service", {}).get("run_s") or 0.0 for r in served)
        own.append(seconds * len(slots) / busy - 1.0 if busy else None)
    alone_s, service_s = min(alone_times), min(service_times)
    alone_busy = sum(o["run_s"] for o in alone)
    alone_scores = [o["result"]["score"] if "result" in o else None for o in alone]
    served_scores = [r.get("score") if "error" not in r else None for r in served]
    kinds = [cands[i % len(cands)][1] for i in range(count)]
    # The slowest items of the last service round: where a worker's time goes.
    slowest = sorted(({"task": cands[i % len(cands)][0], "kind": kinds[i], "run_s": r.get("service", {}).get("run_s"),
                       "reason": (r.get("reason") or "")[:80]} for i, r in enumerate(served)),
                     key=lambda x: -(x["run_s"] or 0))[:5]
    return {"candidates": count, "honest": kinds.count("honest"),
            "alone": {"seconds": alone_s, "per_minute": count / alone_s * 60, "rounds_s": alone_times},
            "service": {"seconds": service_s, "per_minute": count / service_s * 60, "batch": BATCH,
                        "rounds_s": service_times, "latency_s": metrics["latency_s"]},
            # The target's figure: the service's own time over the Verifier's (median of the rounds); beside
            # it the plain throughput ratio and the bench harness's own share on the direct path.
            "overhead": statistics.median([o for o in own if o is not None]) if any(o is not None for o in own) else None,
            "overhead_rounds": own,
            "throughput_overhead": service_s / alone_s - 1.0,
            "harness_overhead": alone_s * len(slots) / alone_busy - 1.0 if alone_busy else None,
            "errors": ([r["error"] for r in served if "error" in r] + [o["error"] for o in alone if "error" in o])[:10],
            # Static scores do not depend on the run: both paths must agree exactly (timed ones move a little).
            "same_scores": sum(a == b for a, b in zip(alone_scores, served_scores)) if mode == "static" else None,
            "mean_score": {"alone": _mean(alone_scores), "service": _mean(served_scores)},
            "slowest": slowest}


def run(workers: int | None = None, candidates: int | None = None, json_output: bool = False) -> int:
    """Runs the benchmark and prints the result (one JSON object with ``json_output``); 0 when every candidate
    was scored both ways. Two populations: the honest candidates (what the throughput target is about:
    RL samples that compile and are judged in full) and the corpus's mix of honest and hacked ones."""
    from ..rl.workers import LocalSlot, local_devices

    if not (CORPUS / "honest").is_dir():
        print(f"bench reward: the Verifier corpus is not at {CORPUS}: run it from a source checkout", file=sys.stderr)
        return 2
    devices = local_devices()
    gpu = devices[0].startswith("cuda")
    mode = "gpu" if gpu else "static"
    per_device = workers or (1 if gpu else 2)
    count = candidates or (24 if gpu else 96)  # a static check takes ~0.1 s: more of them for a stable rate
    slots = [LocalSlot(d, f"{d}#{k}") for d in devices for k in range(per_device)]
    mixed = corpus_candidates()
    honest = [c for c in mixed if c[1] == "honest"]
    try:
        _warm(slots, mixed, mode)
        phases = {"honest": _measure(slots, honest, count, "honest", mode),
                  "mixed": _measure(slots, mixed, count, "mixed", mode)}
        scaling = None
        if len(slots) > 1:
            one_s, _, _ = _through_service(slots[:1], _items(honest, count, "one", mode))
            scaling = {"one_worker_seconds": one_s, "one_worker_per_minute": count / one_s * 60,
                       "ratio": one_s / phases["honest"]["service"]["seconds"], "workers": len(slots)}
    finally:
        for slot in slots:
            slot.close()
    n_gpus = len(devices) if gpu else 0
    target = phases["honest"]
    per_minute = target["service"]["per_minute"]
    result: dict[str, Any] = {
        "benchmark": "reward", "mode": mode,
        "label": "verified on the GPU" if gpu else "static: no GPU (NVRTC compile + static rules, unverified)",
        "devices": devices, "workers": len(slots), **target,
        "per_minute_per_gpu": per_minute / n_gpus if n_gpus else None,
        "targets": {"per_minute_per_gpu": TARGET_PER_MINUTE_PER_GPU, "overhead": TARGET_OVERHEAD,
                    "population": "honest candidates"},
        "target_ok": (per_minute / n_gpus >= TARGET_PER_MINUTE_PER_GPU and (target["overhead"] or 0) <= TARGET_OVERHEAD)
        if n_gpus else None,
        "mixed": phases["mixed"],
        "scaling": scaling,
    }
    if json_output:
        print(json.dumps(result, default=str))
    else:
        print(format_result(result))
    # An item the machinery could not score is a failure; a low rate is a number.
    return 1 if target["errors"] or phases["mixed"]["errors"] else 0


def gpu_counts(gpus: int) -> list[int]:
    """The GPU counts a scaling run measures: 1, 2, 4, ... below ``gpus``, and ``gpus``."""
    counts, k = [], 1
    while k < gpus:
        counts.append(k)
        k *= 2
    return counts + [gpus]


def _verdict(reply: dict[str, Any]) -> tuple | None:
    parts = reply.get("parts")
    return None if "error" in reply or not parts else (parts["compiled"], parts["correct"], parts["hack"])


def _disturbance(groups: list[list], cands: list[tuple[str, str, str]], mode: str) -> dict[str, Any]:
    """The speed-up one honest candidate gets on the first GPU alone, then while every other GPU's workers
    score a stream of candidates: DISTURBANCE_REPEATS scores each, medians compared."""
    from ..rl.workers import RewardItem

    task, _, source = cands[0]
    slot = groups[0][0]

    def speedups(tag: str) -> list[float]:
        out = []
        for r in range(DISTURBANCE_REPEATS):
            got = slot.run(RewardItem(task, reply(fresh(source, f"disturbance {tag} {r}")), mode=mode))
            out.append(got["result"]["parts"]["speedup"] if "result" in got else float("nan"))
        return out

    alone = speedups("alone")
    stop = threading.Event()
    loaded = [0]

    def load(other, j: int) -> None:
        n = 0
        while not stop.is_set():
            t, _, src = cands[(j + n) % len(cands)]
            other.run(RewardItem(t, reply(fresh(src, f"disturbance load {j} {n}")), mode=mode))
            n += 1
            loaded[0] += 1

    others = [threading.Thread(target=load, args=(o, j)) for j, o in enumerate(w for g in groups[1:] for w in g)]
    for t in others:
        t.start()
    time.sleep(1.0)  # every other GPU busy before the first measurement
    busy = speedups("busy")
    stop.set()
    for t in others:
        t.join()
    ratio = statistics.median(busy) / statistics.median(alone) if statistics.median(alone) else None
    return {"task": task, "alone": alone, "busy": busy, "ratio": ratio, "load_items": loaded[0],
            "ok": ratio is not None and abs(ratio - 1.0) <= TARGET_DISTURBANCE}


def run_gpus(gpus: int, workers: int | None = None, candidates: int | None = None, json_output: bool = False) -> int:
    """The reward service over 1, 2, 4 ... ``gpus`` GPUs of this host, the same honest candidates at every count
    (``candidates`` per GPU): verified candidates a minute, scaling efficiency, the queue over time at the
    largest count, the same verdicts as on one GPU, and whether one GPU's timing moves while the others work.
    Without a GPU, CPU workers in static mode stand in for the GPUs (the machinery, not the figures)."""
    from ..rl.workers import LocalSlot, local_devices

    if not (CORPUS / "honest").is_dir():
        print(f"bench reward: the Verifier corpus is not at {CORPUS}: run it from a source checkout", file=sys.stderr)
        return 2
    devices = local_devices()
    gpu = devices[0].startswith("cuda")
    if gpu and gpus > len(devices):
        print(f"bench reward: --gpus {gpus} asks for more GPUs than the {len(devices)} visible here "
              f"({', '.join(devices)}); pass --gpus {len(devices)} or fewer", file=sys.stderr)
        return 2
    mode = "gpu" if gpu else "static"
    per_device = workers or 1
    per_gpu = candidates or (24 if gpu else 48)
    names = devices[:gpus] if gpu else [f"cpu (stand-in for GPU {i})" for i in range(gpus)]
    groups = [[LocalSlot(devices[i] if gpu else "cpu", f"{names[i]}#{k}") for k in range(per_device)]
              for i in range(gpus)]
    honest = [c for c in corpus_candidates() if c[1] == "honest"]
    runs: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    try:
        _warm([w for g in groups for w in g], honest, mode)
        base: list[tuple | None] = []
        for k in gpu_counts(gpus):
            slots = [w for g in groups[:k] for w in g]
            count = per_gpu * k
            seconds, served, _ = _through_service(slots, _items(honest, count, f"gpus {k}", mode),
                                                  samples if k == gpus else None)
            verdicts = [_verdict(r) for r in served]
            if k == 1:
                base = verdicts
            same = sum(v == base[i % len(base)] for i, v in enumerate(verdicts)) if base else None
            rate = count / seconds * 60
            runs.append({"gpus": k, "workers": len(slots), "candidates": count, "seconds": seconds, "per_minute": rate,
                         "per_minute_per_gpu": rate / k, "same_verdicts_as_one_gpu": same,
                         "errors": [r["error"] for r in served if "error" in r][:5]})
        one = runs[0]["per_minute"]
        for r in runs:
            r["efficiency"] = r["per_minute"] / (r["gpus"] * one)
        disturbance = (_disturbance(groups, honest, mode) if gpu and gpus > 1 else
                       {"skipped": "needs two or more GPUs" if gpu else "needs GPUs (static checks have no timing)"})
    finally:
        for g in groups:
            for w in g:
                w.close()
    result = {
        "benchmark": "reward-gpus", "mode": mode, "gpus": gpus, "devices": names, "workers_per_gpu": per_device,
        "label": "verified on the GPUs" if gpu else "static: no GPU, CPU workers stand in for GPUs (unverified)",
        "candidates_per_gpu": per_gpu, "runs": runs, "queue": samples, "disturbance": disturbance,
        "targets": {"efficiency": TARGET_EFFICIENCY, "disturbance": TARGET_DISTURBANCE},
        "efficiency_ok": all(r["efficiency"] >= TARGET_EFFICIENCY for r in runs),
        "same_verdicts": all(r["same_verdicts_as_one_gpu"] == r["candidates"] for r in runs),
    }
    if json_output:
        print(json.dumps(result, default=str))
    else:
        print(format_gpus(result))
    return 1 if any(r["errors"] for r in runs) else 0


def format_gpus(r: dict[str, Any]) -> str:
    lines = [f"reward service over GPUs, {r['label']}: {r['workers_per_gpu']} worker(s) per GPU, "
             f"{r['candidates_per_gpu']} honest corpus candidates per GPU",
             f"  {'gpus':>4} {'candidates':>10} {'seconds':>8} {'per min':>8} {'per GPU':>8} {'efficiency':>10} "
             f"{'same verdicts':>13}"]
    for x in r["runs"]:
        lines.append(f"  {x['gpus']:>4} {x['candidates']:>10} {x['seconds']:>8.1f} {x['per_minute']:>8.1f} "
                     f"{x['per_minute_per_gpu']:>8.1f} {x['efficiency']:>10.2f} "
                     f"{x['same_verdicts_as_one_gpu']}/{x['candidates']:<}")
    if len(r["runs"]) == 1:
        lines.append("  one GPU only: efficiency is 1 by definition; the scaling needs a machine with more GPUs")
    d = r["disturbance"]
    if "skipped" in d:
        lines.append(f"  disturbance: not measured ({d['skipped']})")
    else:
        lines.append(f"  disturbance: {d['task']} speed-up on GPU 0 alone {statistics.median(d['alone']):.3f}, "
                     f"with the other GPUs busy {statistics.median(d['busy']):.3f} (ratio {d['ratio']:.3f}, target "
                     f"within {100 * r['targets']['disturbance']:.0f}%) {'OK' if d['ok'] else 'MISSED'}")
    if r["queue"]:
        peak = max(s["queued"] for s in r["queue"])
        lines.append(f"  queue at {r['gpus']} GPU(s): {len(r['queue'])} samples, peak {peak} queued; "
                     "JSON has each sample's per-device running count")
    return "\n".join(lines)


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.mean(kept) if kept else None


def format_result(r: dict[str, Any]) -> str:
    def rates(name: str, p: dict[str, Any]) -> list[str]:
        return [f"  {name}: {p['candidates']} corpus candidates ({p['honest']} honest, "
                f"{p['candidates'] - p['honest']} hacked)",
                f"    Verifier alone    {p['alone']['per_minute']:7.1f} candidates/min ({p['alone']['seconds']:.1f} s, "
                f"best of {len(p['alone']['rounds_s'])})",
                f"    through service   {p['service']['per_minute']:7.1f} candidates/min ({p['service']['seconds']:.1f} s, "
                f"batches of {p['service']['batch']})   overhead {100 * p['overhead']:+.1f}% of the Verifier's time "
                f"(throughput ratio {100 * p['throughput_overhead']:+.1f}%)",
                "    slowest           " + ", ".join(f"{x['task']} {x['kind']} {x['run_s']} s" for x in p["slowest"][:3])]

    lines = [f"reward benchmark, {r['label']}: {r['workers']} worker(s) on {', '.join(r['devices'])}",
             *rates("honest (the target's population)", r), *rates("mixed", r["mixed"])]
    if r["per_minute_per_gpu"] is not None:
        lines.append(f"  per GPU           {r['per_minute_per_gpu']:7.1f} verified honest/min (target >= "
                     f"{r['targets']['per_minute_per_gpu']}, overhead <= {100 * r['targets']['overhead']:.0f}%) "
                     f"{'OK' if r['target_ok'] else 'MISSED'}")
    if r["scaling"]:
        s = r["scaling"]
        lines.append(f"  scaling           {s['ratio']:.2f}x with {s['workers']} workers over 1 "
                     f"({s['one_worker_per_minute']:.1f}/min with one)")
    lat = r["service"]["latency_s"]
    lines.append(f"  latency (s)       queue p50 {lat['queue']['p50']}, run p50 {lat['run']['p50']} / p90 "
                 f"{lat['run']['p90']}, total p90 {lat['total']['p90']}")
    for name, p in (("honest", r), ("mixed", r["mixed"])):
        if p["same_scores"] is not None:
            lines.append(f"  agreement ({name}) {p['same_scores']}/{p['candidates']} scores equal through the service "
                         "and alone")
        if p["errors"]:
            lines.append(f"  errors ({name})   {p['errors']}")
    return "\n".join(lines)


def register(suites: argparse._SubParsersAction) -> None:
    """`stitchcuda bench reward [--workers N] [--candidates K] [--gpus N] [--json]`."""
    p = suites.add_parser("reward", help="the RL reward service: candidates/min through it vs the Verifier alone, "
                                         "overhead, scaling over workers")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="workers per device (default 1 per GPU; 2 on the CPU)")
    p.add_argument("--candidates", type=int, default=None, metavar="K", help="candidates per phase (default 24 on a GPU, 96 in "
                   "static mode); with --gpus, per GPU (default 24, 48 in static mode)")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="scale over GPUs instead: the service on 1, 2, 4 ... N GPUs of this host, the same candidates, "
                        "efficiency, queue over time, timing disturbance (CPU workers stand in without a GPU)")
    p.set_defaults(run=_main)


def _main(args: argparse.Namespace) -> int:
    if any(v is not None and v < 1 for v in (args.workers, args.candidates, args.gpus)):
        print("bench reward: --workers, --candidates and --gpus must be at least 1", file=sys.stderr)
        return 2
    if args.gpus is not None:
        return run_gpus(args.gpus, args.workers, args.candidates, args.json)
    return run(args.workers, args.candidates, args.json)


if __name__ == "__main__":  # `stitchcuda bench reward` has the options
    from ..cli_support import module_main

    sys.exit(module_main("python -m stitchcuda.bench.reward", __doc__, lambda as_json: run(json_output=as_json)))
