"""Benchmark of the reward service: candidates scored per minute end to end through `serve reward` (HTTP,
queue, pool) against the Verifier alone (``rl.score_completion`` called on the same worker processes) and
against the Verifier without its sandbox (workers of their own), all in the same run: the service's
overhead and the sandbox's cost per candidate as ratios, where each candidate's time went (the Verifier's
phases: worker start, set-up, NVRTC and load, trials, timed calls, what follows, the judge), and with more
than one worker the scaling over one worker. Targets on a GPU: >= 60 verified candidates a minute per GPU,
service overhead and sandbox cost <= 5%. Without a GPU it runs in static mode (NVRTC compile + static
rules, unverified) and says so. Bounded: ``--deadline`` ends it with what was measured by then; progress
goes to stderr.

Candidates are the Verifier corpus's own (tests/corpus: honest and hacked, the stitchcuda.jit ones), each
made a fresh NVRTC compile per path by a comment in its CUDA source, as a new RL sample would be. The
target is measured on the honest ones; the mix of honest and hacked is measured beside it.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
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
DEFAULT_DEADLINE_S = 480.0  # the whole run, warm-up included: it fits one 10-minute call on the GPU machine
SAMPLE_S = 0.5  # how often the multi-GPU run reads the queue
DISTURBANCE_REPEATS = 5  # scores of one candidate on GPU 0, alone and with the other GPUs busy
TARGET_EFFICIENCY = 0.9
TARGET_DISTURBANCE = 0.03
CORPUS = Path(__file__).resolve().parents[3] / "tests" / "corpus"
# In every candidate's nonce: a run's candidates are new to the kernel caches of this machine, which outlive
# a run outside the sandbox (a sandboxed pool's cache is private to the pool).
RUN_ID = secrets.token_hex(4)
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
        out.append({"task": task, "completion": reply(fresh(source, f"bench {RUN_ID} {phase} {i}")), "mode": mode})
    return out


class Budget:
    """The run's deadline: work already started finishes, nothing new starts once it has passed, and
    what was measured by then is reported (``deadline_s`` None: no deadline)."""

    def __init__(self, deadline_s: float | None) -> None:
        self.deadline_s = deadline_s
        self.started = time.monotonic()
        self.hit = False

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def expired(self) -> bool:
        if self.deadline_s is not None and self.elapsed() >= self.deadline_s:
            self.hit = True
        return self.hit


def progress(text: str) -> None:
    """One line on stderr (stdout carries the result)."""
    print(f"bench reward: {text}", file=sys.stderr, flush=True)


def _parallel(workers: int, work: list[Any], fn: Callable[[int, Any], Any],
              budget: Budget | None = None) -> tuple[float, list[Any]]:
    """Runs fn(worker index, item) over ``work`` with ``workers`` threads pulling from one list; (seconds,
    results). Past the budget's deadline no thread takes a new item: those left are None."""
    results: list[Any] = [None] * len(work)
    lock = threading.Lock()
    next_index = [0]

    def loop(w: int) -> None:
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(work) or (budget is not None and budget.expired()):
                return
            results[i] = fn(w, work[i])

    threads = [threading.Thread(target=loop, args=(w,)) for w in range(workers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, results


class _Service:
    """A RewardService over ``slots`` on 127.0.0.1 and its client, for as long as the ``with`` lasts."""

    def __init__(self, slots: list, queue_size: int) -> None:
        from ..rl.service import RewardClient, RewardService
        from ..rl.workers import RewardPool

        self.slots = slots
        self.pool = RewardPool(slots=slots, warm=False, cache_size=0, queue_size=max(64, queue_size))
        self.service = RewardService(self.pool, "127.0.0.1", 0)
        self.client: Any = None
        self._client_class = RewardClient

    def __enter__(self) -> "_Service":
        self.service.__enter__()
        self.client = self._client_class(self.service.url)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.service.__exit__(*exc)

    def score(self, items: list[dict[str, Any]], budget: Budget | None = None) -> tuple[float, list[dict[str, Any]]]:
        """The items in batches of BATCH, sent by as many clients as keep every worker busy; (seconds,
        replies in order; None for a batch not sent before the deadline)."""
        batches = [items[i:i + BATCH] for i in range(0, len(items), BATCH)]
        seconds, replies = _parallel(2 * len(self.slots), batches, lambda _w, batch: self.client.score(batch), budget)
        return seconds, [r for batch, got in zip(batches, replies) for r in (got or [None] * len(batch))]


def _through_service(slots: list, items: list[dict[str, Any]], samples: list | None = None
                     ) -> tuple[float, list[dict[str, Any]], dict]:
    """The items through a RewardService over ``slots``; (seconds, replies, the service's metrics). With
    ``samples``, the queue is read every SAMPLE_S meanwhile: (seconds, items queued, items running on each
    device)."""
    done = threading.Event()
    with _Service(slots, len(items)) as service:
        pool = service.pool

        def sample(t0: float) -> None:
            while True:  # one sample at once, then every SAMPLE_S until the items are done
                m = pool.metrics()
                running: dict[str, int] = {}
                for w in m["workers"]:
                    running[w["device"]] = running.get(w["device"], 0) + (w["state"] == "busy")
                samples.append({"t": round(time.perf_counter() - t0, 2), "queued": m["queue_depth"],
                                "running": running})
                if done.wait(SAMPLE_S):
                    return

        sampler = threading.Thread(target=sample, args=(time.perf_counter(),), daemon=True)
        if samples is not None:
            sampler.start()
        try:
            seconds, replies = service.score(items)
        finally:
            done.set()
            if samples is not None:
                sampler.join()
        metrics = service.client.metrics()
    return seconds, replies, metrics


def _warm(slots: list, cands: list[tuple[str, str, str]], mode: str) -> None:
    """Not counted: each worker starts and meets every problem once, through an honest candidate (on a
    GPU: the judge's reference run with its torch.compile baseline, once per problem: the pools share
    their reference runs, as a RewardPool's do)."""
    from ..rl.workers import RewardItem

    warm = {task: source for task, kind, source in reversed(cands) if kind == "honest"}
    items = [RewardItem(task, reply(fresh(source, "bench warm")), mode=mode) for task, source in warm.items()]
    _parallel(len(slots), list(range(len(slots))), lambda _w, s: [slots[s].run(it) for it in items])


# ---- one population -------------------------------------------------------------------------------------

#: The paths a candidate is measured on, in the order of the first chunk (later chunks rotate it).
PATHS = ("alone", "unsandboxed", "service")


def _record(out: dict[str, Any] | None, path: str, seconds: float | None = None) -> dict[str, Any] | None:
    """One scored item as the bench keeps it: run_s, score (None when not scored), error, phases."""
    if out is None:
        return None
    if path == "service":
        service = out.get("service") or {}
        return {"run_s": service.get("run_s"), "score": out.get("score") if "error" not in out else None,
                "error": out.get("error"), "phases": service.get("phases_s") or {}, "verdict": _verdict(out),
                "reason": (out.get("reason") or "")[:80]}
    result = out.get("result") or {}
    return {"run_s": seconds, "score": result.get("score") if "result" in out else None, "error": out.get("error"),
            "phases": out.get("phases_s") or {}, "verdict": _verdict(result) if result else None,
            "reason": (result.get("reason") or "")[:80]}


def _direct(slots: list, items: list[dict[str, Any]], path: str, budget: Budget) -> tuple[float, list]:
    """The items scored by ``score_completion`` on the slots' own worker processes, one thread per slot."""
    from ..rl.workers import RewardItem

    def timed(w: int, item: dict[str, Any]) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        out = slots[w].run(RewardItem(**item))
        return _record(out, path, time.perf_counter() - t0)

    return _parallel(len(slots), items, timed, budget)


def _measure(groups: dict[str, list], cands: list[tuple[str, str, str]], count: int, label: str, mode: str,
             budget: Budget) -> dict[str, Any]:
    """``count`` candidates of ``cands`` on every path of PATHS, ROUNDS rounds, in chunks that keep every
    worker busy: each chunk goes through every path before the next starts, the paths' order rotating, so
    what the machine does meanwhile hits them alike and a deadline leaves every path with the same
    candidates. ``groups``: the sandboxed slots ("alone", and the service's) and the unsandboxed ones."""
    slots = groups["alone"]
    chunk = max(BATCH, 2 * BATCH * len(slots))
    population = [cands[i % len(cands)][:2] for i in range(count)]  # (task, kind) of each candidate
    rounds = []
    for round_ in range(ROUNDS):
        if budget.expired():
            break
        items = {path: _items(cands, count, f"{label} {path} {round_}", mode) for path in PATHS}
        records: dict[str, list] = {path: [] for path in PATHS}
        walls = dict.fromkeys(PATHS, 0.0)
        with _Service(slots, chunk) as service:
            for j, start in enumerate(range(0, count, chunk)):
                if budget.expired():
                    break
                order = PATHS[j % len(PATHS):] + PATHS[:j % len(PATHS)]
                for path in order:
                    part = items[path][start:start + chunk]
                    if path == "service":
                        seconds, got = service.score(part, budget)
                        got = [_record(r, path) for r in got]
                    else:
                        seconds, got = _direct(groups[path], part, path, budget)
                    walls[path] += seconds
                    records[path] += got + [None] * (len(part) - len(got))
                done = sum(all(records[p][i] is not None for p in PATHS) for i in range(len(records["alone"])))
                progress(f"{label} round {round_ + 1}/{ROUNDS}: {done}/{count} candidates on every path, "
                         + ", ".join(f"{p} {60 * _count(records[p]) / walls[p]:.1f}/min" for p in PATHS if walls[p])
                         + f" ({budget.elapsed():.0f} s" + (f" of {budget.deadline_s:.0f})" if budget.deadline_s else ")"))
        rounds.append({"records": records, "walls": walls})
    return _summary(rounds, population, len(slots), mode)


def _count(records: list) -> int:
    return sum(r is not None for r in records)


def _summary(rounds: list[dict[str, Any]], population: list[tuple[str, str]], workers: int,
             mode: str) -> dict[str, Any]:
    """Rates, ratios and where the time went, over the candidates every path scored."""
    kinds = [kind for _, kind in population]
    out: dict[str, Any] = {"candidates": len(kinds), "honest": kinds.count("honest"), "rounds": len(rounds)}
    if not rounds:
        return {**out, "done": 0, "overhead": None, "sandbox_cost": None, "errors": [], "same_scores": None}
    # Per path: the best round's rate (whatever the machine did meanwhile hits every path of a round alike).
    for path in PATHS:
        rates = [(r["walls"][path], _count(r["records"][path])) for r in rounds if _count(r["records"][path])]
        seconds, n = min(rates, key=lambda x: x[0] / x[1]) if rates else (0.0, 0)
        out[path] = {"seconds": seconds, "done": n, "per_minute": 60 * n / seconds if seconds else None,
                     "rounds_s": [r["walls"][path] for r in rounds]}
    out["service"]["batch"] = BATCH
    # Candidates scored on every path, in the round that got the fewest that far.
    out["done"] = min(sum(all(r["records"][p][i] is not None for p in PATHS) for i in range(len(r["records"]["alone"])))
                      for r in rounds)

    def busy(r: dict[str, Any], path: str) -> float:
        return sum(x["run_s"] or 0.0 for x in r["records"][path] if x is not None)

    def both(r: dict[str, Any], a: str, b: str) -> tuple[float, float]:
        """Busy seconds of paths a and b over the candidates both scored."""
        pairs = [(x, y) for x, y in zip(r["records"][a], r["records"][b]) if x is not None and y is not None]
        return sum(x["run_s"] or 0.0 for x, _ in pairs), sum(y["run_s"] or 0.0 for _, y in pairs)

    # The service's own share of its wall time: worker-seconds not spent scoring (HTTP, JSON, queue
    # hand-offs, idle workers), over the scoring time. The candidates' own run-to-run variation cancels
    # here; in the throughput ratio it does not.
    own = [r["walls"]["service"] * workers / busy(r, "service") - 1.0 if busy(r, "service") else None for r in rounds]
    out["overhead"] = _median([o for o in own if o is not None])
    out["overhead_rounds"] = own
    out["throughput_overhead"] = (out["service"]["seconds"] / out["service"]["done"]) / \
        (out["alone"]["seconds"] / out["alone"]["done"]) - 1.0 if out["service"]["done"] and out["alone"]["done"] else None
    # The sandbox's cost per candidate: the same candidates' scoring time with it over without it.
    sandbox = []
    for r in rounds:
        with_, without = both(r, "alone", "unsandboxed")
        sandbox.append(with_ / without - 1.0 if without else None)
    out["sandbox_cost"] = _median([c for c in sandbox if c is not None])
    out["sandbox_cost_rounds"] = sandbox
    last = rounds[-1]["records"]
    out["harness_overhead"] = (rounds[-1]["walls"]["alone"] * workers / busy(rounds[-1], "alone") - 1.0
                               if busy(rounds[-1], "alone") else None)
    errors = [str(x["error"]) for r in rounds for p in PATHS for x in r["records"][p] if x is not None and x["error"]]
    out["errors"] = errors[:10]
    scores = {p: [x["score"] if x is not None else None for x in last[p]] for p in PATHS}
    # Static scores do not depend on the run: every path must agree exactly (timed ones move a little).
    out["same_scores"] = sum(a is not None and a == b == c for a, b, c in zip(*(scores[p] for p in PATHS))) \
        if mode == "static" else None
    out["mean_score"] = {p: _mean(scores[p]) for p in PATHS}
    out["phases"] = {p: _phase_table([x for r in rounds for x in r["records"][p] if x is not None]) for p in PATHS}
    slowest = sorted(({"task": population[i][0], "kind": kinds[i], "run_s": x["run_s"], "reason": x["reason"]}
                      for i, x in enumerate(last["service"]) if x is not None), key=lambda x: -(x["run_s"] or 0))[:5]
    out["slowest"] = slowest
    return out


def _phase_table(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds per phase over ``records``: the total, the mean per candidate, the share of the time."""
    totals: dict[str, float] = {}
    for x in records:
        for name, seconds in (x["phases"] or {}).items():
            totals[name] = totals.get(name, 0.0) + float(seconds)
    whole = sum(totals.values())
    return {name: {"total_s": round(v, 3), "mean_s": round(v / len(records), 4),
                   "share": round(v / whole, 4) if whole else None}
            for name, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _slots(devices: list[str], per_device: int) -> dict[str, list]:
    """The bench's workers: ``per_device`` sandboxed slots a device (the Verifier alone and the service) and
    as many without the sandbox (the baseline of its cost), every pool sharing one cache of reference runs."""
    from ..rl.workers import LocalSlot
    from ..verify.judge import ReferenceCache

    shared = ReferenceCache()
    return {"alone": [LocalSlot(d, f"{d}#{k}", references=shared) for d in devices for k in range(per_device)],
            "unsandboxed": [LocalSlot(d, f"{d}#{k} unsandboxed", sandbox=False, references=shared)
                            for d in devices for k in range(per_device)]}


def run(workers: int | None = None, candidates: int | None = None, json_output: bool = False,
        deadline_s: float | None = DEFAULT_DEADLINE_S) -> int:
    """Runs the benchmark and prints the result (one JSON object with ``json_output``); 0 when every candidate
    measured was scored on every path (stopping at the deadline is no failure: the result says what was
    measured by then). Two populations: the honest candidates (what the throughput target is about: RL
    samples that compile and are judged in full) and the corpus's mix of honest and hacked ones."""
    from ..rl.workers import local_devices

    if not (CORPUS / "honest").is_dir():
        print(f"bench reward: the Verifier corpus is not at {CORPUS}: run it from a source checkout", file=sys.stderr)
        return 2
    budget = Budget(deadline_s)
    devices = local_devices()
    gpu = devices[0].startswith("cuda")
    mode = "gpu" if gpu else "static"
    per_device = workers or (1 if gpu else 2)
    count = candidates or (24 if gpu else 48)  # a static check takes ~0.1 s: more of them for a stable rate
    groups = _slots(devices, per_device)
    slots = groups["alone"]
    mixed = corpus_candidates()
    honest = [c for c in mixed if c[1] == "honest"]
    phases: dict[str, Any] = {}
    scaling: dict[str, Any] | None = None
    try:
        progress(f"warming up {2 * len(slots)} worker(s) on {', '.join(devices)}: each meets every problem once")
        # One group after the other: the judge's baselines, timed once per problem in the first, see a quiet GPU.
        _warm(slots, mixed, mode)
        _warm(groups["unsandboxed"], mixed, mode)
        warm_s = budget.elapsed()
        for label, cands in (("honest", honest), ("mixed", mixed)):
            phases[label] = _measure(groups, cands, count, label, mode, budget)
        if len(slots) > 1 and not budget.expired():
            progress("one worker through the service, for the scaling")
            with _Service(slots[:1], count) as one:
                one_s, got = one.score(_items(honest, count, "one", mode), budget)
            n = sum(r is not None for r in got)
            rate = phases["honest"]["service"]["per_minute"]
            scaling = {"one_worker_seconds": one_s, "one_worker_per_minute": 60 * n / one_s if one_s and n else None,
                       "workers": len(slots), "candidates": n}
            scaling["ratio"] = rate / scaling["one_worker_per_minute"] if rate and scaling["one_worker_per_minute"] else None
    finally:
        for slot in slots + groups["unsandboxed"]:
            slot.close()
    n_gpus = len(devices) if gpu else 0
    target = phases["honest"]
    per_minute = (target.get("service") or {}).get("per_minute")
    result: dict[str, Any] = {
        "benchmark": "reward", "mode": mode,
        "label": "verified on the GPU" if gpu else "static: no GPU (NVRTC compile + static rules, unverified)",
        "devices": devices, "workers": len(slots), **target,
        "deadline_s": deadline_s, "stopped_at_deadline": budget.hit, "elapsed_s": round(budget.elapsed(), 1),
        "warm_s": round(warm_s, 1),
        "per_minute_per_gpu": per_minute / n_gpus if n_gpus and per_minute else None,
        "targets": {"per_minute_per_gpu": TARGET_PER_MINUTE_PER_GPU, "overhead": TARGET_OVERHEAD,
                    "sandbox_cost": TARGET_OVERHEAD, "population": "honest candidates"},
        "target_ok": (per_minute / n_gpus >= TARGET_PER_MINUTE_PER_GPU and (target["overhead"] or 0) <= TARGET_OVERHEAD
                      and (target["sandbox_cost"] or 0) <= TARGET_OVERHEAD)
        if n_gpus and per_minute else None,
        "mixed": phases["mixed"],
        "scaling": scaling,
    }
    if json_output:
        print(json.dumps(result, default=str))
    else:
        print(format_result(result))
    # An item the machinery could not score is a failure; a low rate is a number, a deadline a shorter run.
    return 1 if target.get("errors") or phases["mixed"].get("errors") else 0


def format_result(r: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:+.1f}%"

    def rate(p: dict[str, Any], path: str) -> str:
        x = p.get(path) or {}
        return (f"{x['per_minute']:7.1f} candidates/min ({x['done']} in {x['seconds']:.1f} s)" if x.get("per_minute")
                else "    n/a (none measured before the deadline)")

    def block(name: str, p: dict[str, Any]) -> list[str]:
        head = (f"  {name}: {p['candidates']} corpus candidates a path and round ({p['honest']} honest, "
                f"{p['candidates'] - p['honest']} hacked), {p['rounds']} round(s), {p['done']} on every path")
        if not p["rounds"]:
            return [head + ": not measured (the deadline came first)"]
        lines = [head,
                 f"    Verifier alone       {rate(p, 'alone')}",
                 f"    without the sandbox  {rate(p, 'unsandboxed')}   sandbox cost {pct(p['sandbox_cost'])} "
                 "of the scoring time",
                 f"    through the service  {rate(p, 'service')}   overhead {pct(p['overhead'])} of the Verifier's "
                 f"time (throughput ratio {pct(p['throughput_overhead'])})"]
        table = p["phases"]["alone"]
        if table:
            lines.append("    where the time goes (alone, mean s a candidate): " + ", ".join(
                f"{k} {v['mean_s']:.3f}" for k, v in table.items()))
        return lines

    lines = [f"reward benchmark, {r['label']}: {r['workers']} worker(s) on {', '.join(r['devices'])} (and as many "
             f"without the sandbox), warm-up {r['warm_s']} s",
             *block("honest (the target's population)", r), *block("mixed", r["mixed"])]
    if r["stopped_at_deadline"]:
        lines.append(f"  stopped at the deadline ({r['deadline_s']:.0f} s, --deadline): the figures are those of "
                     "the candidates measured by then")
    if r["per_minute_per_gpu"] is not None:
        lines.append(f"  per GPU              {r['per_minute_per_gpu']:7.1f} verified honest/min (target >= "
                     f"{r['targets']['per_minute_per_gpu']}; service overhead and sandbox cost <= "
                     f"{100 * r['targets']['overhead']:.0f}%) {'OK' if r['target_ok'] else 'MISSED'}")
    if r["scaling"] and r["scaling"].get("ratio"):
        s = r["scaling"]
        lines.append(f"  scaling              {s['ratio']:.2f}x with {s['workers']} workers over 1 "
                     f"({s['one_worker_per_minute']:.1f}/min with one)")
    for name, p in (("honest", r), ("mixed", r["mixed"])):
        if p.get("same_scores") is not None:
            lines.append(f"  agreement ({name})   {p['same_scores']}/{p['done']} scores equal on every path")
        if p.get("errors"):
            lines.append(f"  errors ({name})      {p['errors']}")
    return "\n".join(lines)


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


def run_gpus(gpus: int, workers: int | None = None, candidates: int | None = None, json_output: bool = False,
             deadline_s: float | None = DEFAULT_DEADLINE_S) -> int:
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
    budget = Budget(deadline_s)
    runs: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    try:
        _warm([w for g in groups for w in g], honest, mode)
        base: list[tuple | None] = []
        for k in gpu_counts(gpus):
            if budget.expired():
                progress(f"the deadline ({deadline_s:.0f} s) passed before the run at {k} GPU(s)")
                break
            progress(f"{per_gpu * k} candidates through the service on {k} GPU(s)")
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
        disturbance = ({"skipped": "the deadline passed"} if budget.expired() else
                       _disturbance(groups, honest, mode) if gpu and gpus > 1 else
                       {"skipped": "needs two or more GPUs" if gpu else "needs GPUs (static checks have no timing)"})
    finally:
        for g in groups:
            for w in g:
                w.close()
    result = {
        "benchmark": "reward-gpus", "mode": mode, "gpus": gpus, "devices": names, "workers_per_gpu": per_device,
        "label": "verified on the GPUs" if gpu else "static: no GPU, CPU workers stand in for GPUs (unverified)",
        "candidates_per_gpu": per_gpu, "runs": runs, "queue": samples, "disturbance": disturbance,
        "deadline_s": deadline_s, "stopped_at_deadline": budget.hit, "elapsed_s": round(budget.elapsed(), 1),
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


def register(suites: argparse._SubParsersAction) -> None:
    """`stitchcuda bench reward [--workers N] [--candidates K] [--deadline S] [--gpus N] [--json]`."""
    p = suites.add_parser("reward", help="the RL reward service: candidates/min through it vs the Verifier alone and "
                                         "without its sandbox, where the time goes, "
                                         "overhead, scaling over workers")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="workers per device (default 1 per GPU; 2 on the CPU)")
    p.add_argument("--candidates", type=int, default=None, metavar="K", help="candidates per path and round (default 24 on a GPU, 48 "
                   "in static mode); with --gpus, per GPU (default 24, 48 in static mode)")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                   help=f"stop starting candidates after this many seconds of the whole run (warm-up included) and "
                        f"report what was measured by then (default {DEFAULT_DEADLINE_S:.0f}; 0: no deadline)")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="scale over GPUs instead: the service on 1, 2, 4 ... N GPUs of this host, the same candidates, "
                        "efficiency, queue over time, timing disturbance (CPU workers stand in without a GPU)")
    p.set_defaults(run=_main)


def _main(args: argparse.Namespace) -> int:
    if any(v is not None and v < 1 for v in (args.workers, args.candidates, args.gpus)):
        print("bench reward: --workers, --candidates and --gpus must be at least 1", file=sys.stderr)
        return 2
    if not args.deadline >= 0:  # NaN too
        print("bench reward: --deadline must be 0 (none) or a number of seconds above 0", file=sys.stderr)
        return 2
    deadline = args.deadline or None
    if args.gpus is not None:
        return run_gpus(args.gpus, args.workers, args.candidates, args.json, deadline)
    return run(args.workers, args.candidates, args.json, deadline)


if __name__ == "__main__":  # `stitchcuda bench reward` has the options
    from ..cli_support import module_main

    sys.exit(module_main("python -m stitchcuda.bench.reward", __doc__, lambda as_json: run(json_output=as_json)))
