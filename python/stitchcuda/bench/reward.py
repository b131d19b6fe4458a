"""Benchmark of the reward service: candidates scored per minute end to end through `serve reward` (HTTP,
queue, pool) against the Verifier alone (``rl.score_completion`` called on the same worker processes) in
the same run, the service's overhead in %, and with more than one worker the scaling over one worker.
Targets on a GPU: >= 60 verified candidates a minute per GPU, overhead <= 5%. Without a GPU it runs in
static mode (NVRTC compile + static rules, unverified) and says so.

Candidates are the Verifier corpus's own (tests/corpus: honest and hacked, the stitchcuda.jit ones), each
made a fresh NVRTC compile per phase by a comment in its CUDA source, as a new RL sample would be.
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


def _through_service(slots: list, items: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]], dict]:
    """The items through a RewardService over ``slots``, sent in batches of BATCH by as many clients as it takes
    to keep every worker busy; (seconds, replies, the service's metrics)."""
    from ..rl.service import RewardClient, RewardService
    from ..rl.workers import RewardPool

    pool = RewardPool(slots=slots, warm=False, cache_size=0, queue_size=max(64, len(items)))
    with RewardService(pool, "127.0.0.1", 0) as service:
        client = RewardClient(service.url)
        batches = [items[i:i + BATCH] for i in range(0, len(items), BATCH)]
        seconds, replies = _parallel(2 * len(slots), batches, lambda _w, batch: client.score(batch))
        metrics = client.metrics()
    return seconds, [r for batch in replies for r in batch], metrics


def run(workers: int | None = None, candidates: int | None = None, json_output: bool = False) -> int:
    """Runs the benchmark and prints the result (one JSON object with ``json_output``); 0 when every candidate
    was scored both ways."""
    from ..rl.workers import LocalSlot, RewardItem, local_devices

    if not (CORPUS / "honest").is_dir():
        print(f"bench reward: the Verifier corpus is not at {CORPUS}: run it from a source checkout", file=sys.stderr)
        return 2
    devices = local_devices()
    gpu = devices[0].startswith("cuda")
    mode = "gpu" if gpu else "static"
    per_device = workers or (1 if gpu else 2)
    count = candidates or (24 if gpu else 96)  # a static check takes ~0.1 s: more of them for a stable rate
    slots = [LocalSlot(d, f"{d}#{k}") for d in devices for k in range(per_device)]
    cands = corpus_candidates()
    try:
        # Warm-up, not counted: each worker starts and meets every problem once (on a GPU: its torch.compile
        # baseline, compiled once per worker and problem).
        warm = {task: source for task, kind, source in reversed(cands) if kind == "honest"}
        warm_items = [RewardItem(task, reply(fresh(source, "bench warm")), mode=mode) for task, source in warm.items()]
        _parallel(len(slots), list(range(len(slots))), lambda _w, s: [slots[s].run(it) for it in warm_items])

        # Interleaved rounds, the best of each path kept: whatever the machine does meanwhile hits both.
        alone_times, service_times = [], []
        for round_ in range(ROUNDS):
            items = _items(cands, count, f"alone {round_}", mode)
            seconds, alone = _parallel(len(slots), items, lambda w, it: slots[w].run(RewardItem(**it)))
            alone_times.append(seconds)
            seconds, served, metrics = _through_service(slots, _items(cands, count, f"service {round_}", mode))
            service_times.append(seconds)
        alone_s, service_s = min(alone_times), min(service_times)
        scaling = None
        if len(slots) > 1:
            one_s, _, _ = _through_service(slots[:1], _items(cands, count, "one", mode))
            scaling = {"one_worker_seconds": one_s, "one_worker_per_minute": count / one_s * 60,
                       "ratio": one_s / service_s, "workers": len(slots)}
    finally:
        for slot in slots:
            slot.close()
    alone_scores = [o["result"]["score"] if "result" in o else None for o in alone]
    served_scores = [r.get("score") if "error" not in r else None for r in served]
    errors = [r["error"] for r in served if "error" in r] + [o["error"] for o in alone if "error" in o]
    overhead = service_s / alone_s - 1.0
    per_minute = count / service_s * 60
    n_gpus = len(devices) if gpu else 0
    result: dict[str, Any] = {
        "benchmark": "reward", "mode": mode,
        "label": "verified on the GPU" if gpu else "static: no GPU (NVRTC compile + static rules, unverified)",
        "devices": devices, "workers": len(slots), "candidates": count,
        "honest": sum(1 for i in range(count) if cands[i % len(cands)][1] == "honest"),
        "alone": {"seconds": alone_s, "per_minute": count / alone_s * 60, "rounds_s": alone_times},
        "service": {"seconds": service_s, "per_minute": per_minute, "batch": BATCH, "rounds_s": service_times,
                    "latency_s": metrics["latency_s"]},
        "overhead": overhead,
        "per_minute_per_gpu": per_minute / n_gpus if n_gpus else None,
        "targets": {"per_minute_per_gpu": TARGET_PER_MINUTE_PER_GPU, "overhead": TARGET_OVERHEAD},
        "target_ok": (per_minute / n_gpus >= TARGET_PER_MINUTE_PER_GPU and overhead <= TARGET_OVERHEAD)
        if n_gpus else None,
        "scaling": scaling,
        "errors": errors[:10],
        # Static scores do not depend on the run: both paths must agree exactly (timed ones move a little).
        "same_scores": sum(a == b for a, b in zip(alone_scores, served_scores)) if not gpu else None,
        "mean_score": {"alone": _mean(alone_scores), "service": _mean(served_scores)},
    }
    if json_output:
        print(json.dumps(result, default=str))
    else:
        print(format_result(result))
    return 1 if errors else 0  # an item the machinery could not score is a failure; a low rate is a number


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.mean(kept) if kept else None


def format_result(r: dict[str, Any]) -> str:
    lines = [f"reward benchmark, {r['label']}: {r['workers']} worker(s) on {', '.join(r['devices'])}, "
             f"{r['candidates']} corpus candidates ({r['honest']} honest, {r['candidates'] - r['honest']} hacked)",
             f"  Verifier alone    {r['alone']['per_minute']:7.1f} candidates/min ({r['alone']['seconds']:.1f} s, best of "
             f"{len(r['alone']['rounds_s'])})",
             f"  through service   {r['service']['per_minute']:7.1f} candidates/min ({r['service']['seconds']:.1f} s, "
             f"batches of {r['service']['batch']})   overhead {100 * r['overhead']:+.1f}% "
             f"(target <= {100 * r['targets']['overhead']:.0f}% on a GPU)"]
    if r["per_minute_per_gpu"] is not None:
        lines.append(f"  per GPU           {r['per_minute_per_gpu']:7.1f} verified/min (target >= "
                     f"{r['targets']['per_minute_per_gpu']}) {'OK' if r['target_ok'] else 'MISSED'}")
    if r["scaling"]:
        s = r["scaling"]
        lines.append(f"  scaling           {s['ratio']:.2f}x with {s['workers']} workers over 1 "
                     f"({s['one_worker_per_minute']:.1f}/min with one)")
    lat = r["service"]["latency_s"]
    lines.append(f"  latency (s)       queue p50 {lat['queue']['p50']}, run p50 {lat['run']['p50']} / p90 "
                 f"{lat['run']['p90']}, total p90 {lat['total']['p90']}")
    if r["same_scores"] is not None:
        lines.append(f"  agreement         {r['same_scores']}/{r['candidates']} scores equal through the service and alone")
    if r["errors"]:
        lines.append(f"  errors            {r['errors']}")
    return "\n".join(lines)


def register(suites: argparse._SubParsersAction) -> None:
    """`stitchcuda bench reward [--workers N] [--candidates K] [--json]`."""
    p = suites.add_parser("reward", help="the RL reward service: candidates/min through it vs the Verifier alone, "
                                         "overhead, scaling over workers")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="workers per device (default 1 per GPU; 2 on the CPU)")
    p.add_argument("--candidates", type=int, default=None, metavar="K", help="candidates per phase (default 24 on a GPU, 96 in static mode)")
    p.set_defaults(run=_main)


def _main(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1 or args.candidates is not None and args.candidates < 1:
        print("bench reward: --workers and --candidates must be at least 1", file=sys.stderr)
        return 2
    return run(args.workers, args.candidates, args.json)


if __name__ == "__main__":
    sys.exit(run(json_output="--json" in sys.argv))
