"""The judge: the verdict on a candidate comes from processes that never run candidate code. Its own worker
(``run_reference_job``) runs the reference on the trials' inputs and the timed sets and times the eager and
torch.compile baselines; ``adjudicate`` then takes the candidate worker's report as a claim: the outputs it
sent are compared here, its time is held to the physics floor, the speed-up is computed from the judge's
own baseline, and its findings are believed only where they accuse (docs/verify.md, "The judge").
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch

from . import harness
from .tolerance import HighPrecision, judge_output, wants_reference
from .config import DISTRIBUTIONS, VerifyConfig
from .report import VerifyReport, build_feedback
from .static import MAJOR, MINOR
from .wire import WireError, decode_value, encode_value

__all__ = ["run_reference_job", "adjudicate", "ReferenceRun", "ReferenceCache", "FLOOR_MARGIN"]

# A claimed time below this share of the memory speed-of-light bound cannot be a real measurement (the
# harness's own rule: 10% for the noise of one event pair).
FLOOR_MARGIN = 0.9
# The judge's clock around the timed phase (the arrival of the worker's "timed" and "timed-end" messages)
# less the empty phase's (calibrate): what the candidate's calls took, give or take these. A message's
# arrival is late by up to one /proc read of the pool's memory poll (CLOCK_SLACK_MS), the empty phase varies
# from run to run (CALIBRATION_MARGIN), and an honest call's median sits below its mean when a few calls are
# slow (FORGED_SHARE: a claimed median under half the judge's per-call time is no measurement).
CLOCK_SLACK_MS = 20.0
CALIBRATION_MARGIN = 1.5
FORGED_SHARE = 0.5


# ---- in the judge's worker ------------------------------------------------------------------------------


def run_reference_job(job: dict[str, Any], progress: Callable[[str], None], shipped: dict[str, Any]) -> dict[str, Any]:
    """The judge's run of ``job`` (a jobs.ReferenceJob as a dict). Returns a VerifyReport dict (an error only
    when the reference is broken) with "judge": the trials' seeds and distributions and the facts (baseline
    times, bytes moved); ``shipped`` receives the reference outputs ("trials", "timed")."""
    from .task import Task, TaskError

    started = time.perf_counter()
    report = VerifyReport()
    cfg = VerifyConfig.from_dict(job["config"])
    facts: dict[str, Any] = {}
    trials: list[dict[str, Any]] = []
    try:
        task = Task.from_spec(job["reference"])
        device = _device(cfg)
        seeds = cfg.trial_seeds()
        reference = task.build_reference(seeds[0]).to(device)
        high, policy = HighPrecision(reference), (cfg.tolerance or task.tolerance)
        exact: dict[str, list] = {"trials": [], "timed": []}  # the fp64 outputs the accuracy rule judges by
        progress("run")
        with torch.no_grad():
            def call(inputs: list[Any], kind: str | None = None) -> list[Any]:
                out = harness.flatten(reference(*harness.clone_inputs(inputs)))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if kind is not None:
                    wide = high.outputs(harness.clone_inputs(inputs)) if wants_reference(
                        [x.dtype for x in out if isinstance(x, torch.Tensor)], policy) else None
                    exact[kind].append([harness.to_host(x) for x in wide] if wide is not None else [])
                return [harness.to_host(x) for x in out]

            problem_non_finite = harness.non_finite(call(harness.trial_inputs(task, seeds[0] - 1, "problem", device)))
            outs = []
            for t, seed in enumerate(seeds):
                dist = DISTRIBUTIONS[t % len(DISTRIBUTIONS)]
                out = call(harness.trial_inputs(task, seed, dist, device), "trials")
                if dist != "problem" and harness.non_finite(out) and not problem_non_finite:
                    dist = "problem (the " + dist + " distribution gives non-finite reference outputs)"
                    exact["trials"].pop()
                    out = call(harness.trial_inputs(task, seed, "problem", device), "trials")
                trials.append({"seed": seed, "distribution": dist})
                outs.append(out)
            timed = []
            sets = []
            for s in harness.timed_seeds(cfg):
                inputs = harness.clone_inputs(harness.trial_inputs(task, s, "problem", device))
                sets.append(harness.clone_inputs(inputs))
                harness.refilled(inputs, harness.trial_inputs(task, s + 1, "problem", device))
                timed.append(call(inputs, "timed"))
            facts.update(_bytes_floor(reference, sets[0], cfg, device))
            if cfg.timing_iters > 0:
                facts.update(_baselines(reference, sets, cfg, device, task.key))
        shipped.update(trials=outs, timed=timed, exact_trials=exact["trials"], exact_timed=exact["timed"])
        report.correct = True
    except TaskError as exc:
        report.fail("bad-reference", str(exc))
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a broken reference is reported, not the candidate's fault
        report.fail("bad-reference", f"the reference failed in the judge's run: {type(exc).__name__}: {exc}"[:2000])
    report.wall_s = time.perf_counter() - started
    data = report.to_dict()
    data["judge"] = {"trials": trials, "facts": facts}
    return data


def _device(cfg: VerifyConfig) -> torch.device:
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            from .task import TaskError

            raise TaskError("device 'cuda' was asked for but the judge's worker sees no GPU; use "
                            "VerifyConfig(device='cpu') for a CPU-only check.")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes_floor(reference: torch.nn.Module, inputs: list[Any], cfg: VerifyConfig, device: torch.device) -> dict:
    """The least the problem must move (harness.bytes_moved) and the time that takes at
    ``cfg.bandwidth_tb_s`` (GPU only: a CPU has no such bound here)."""
    nbytes = harness.bytes_moved(reference, inputs)
    facts: dict[str, Any] = {"bytes_moved_min": nbytes}
    if device.type == "cuda":
        facts["speed_of_light_ms"] = nbytes / (cfg.bandwidth_tb_s * 1e12) * 1e3
        facts.update(_compute_floor(reference, inputs, device))
    return facts


def _compute_floor(reference: torch.nn.Module, inputs: list[Any], device: torch.device) -> dict[str, Any]:
    """The reference's arithmetic (FLOPs of the operators torch has formulas for: GEMMs, convolutions,
    attention) at the fastest this GPU computes (twice its bf16 tensor peak: fp8): no call can do it faster."""
    from . import attribution, hardware

    peak = 2 * float(hardware.describe(device).get("bf16_tflops") or 0.0)
    if peak <= 0:
        return {}
    with attribution.DispatchRecord() as record:
        reference(*harness.clone_inputs(inputs))
    flops = attribution.dispatch_summary(record.ops)["formula_flops"]
    return {"reference_flops": flops, "compute_floor_ms": flops / (peak * 1e12) * 1e3} if flops else {}


def _baselines(reference: torch.nn.Module, sets: list[list[Any]], cfg: VerifyConfig, device: torch.device,
               key: str) -> dict[str, Any]:
    """Eager (and on a GPU torch.compile) time of the reference, measured the way the candidate is."""
    facts: dict[str, Any] = {}
    if device.type != "cuda":
        times, _ = harness.time_cpu(reference, sets, cfg.timing_iters, cfg.warmup, None)
        facts["eager_ms"] = statistics.median(times)
        return facts
    from . import gpu

    persisting = gpu.PersistingL2()
    persisting.reset()
    flush = gpu.L2Flush(device)
    sync = gpu.sync_latency(flush)
    times, _ = gpu.time_calls(reference, sets, cfg.timing_iters, cfg.warmup, flush, persisting, sync)
    facts["eager_ms"] = statistics.median(times)
    if cfg.compile_baseline:
        try:
            compiled = torch.compile(reference)
            times, _ = gpu.time_calls(compiled, sets, cfg.timing_iters, cfg.warmup, flush, persisting, sync)
            facts["compile_ms"] = statistics.median(times)
        except Exception as exc:  # noqa: BLE001 - no compile baseline, said so
            facts["compile_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return facts


# ---- in the judge's process ------------------------------------------------------------------------------


class ReferenceRun:
    """What the judge knows of a task under a config: its report (an error when the reference is broken),
    the trials, the reference outputs and the facts."""

    def __init__(self, report: dict[str, Any], body: dict[str, Any], tensors: Sequence[torch.Tensor]) -> None:
        self.report = report
        judge = report.get("judge") or {}
        self.trials: list[dict[str, Any]] = list(judge.get("trials") or [])
        self.facts: dict[str, Any] = dict(judge.get("facts") or {})
        outputs = body.get("outputs") or {}
        self.outputs = [decode_value(o, tensors) for o in outputs.get("trials", [])] if tensors is not None else []
        self.timed = [decode_value(o, tensors) for o in outputs.get("timed", [])] if tensors is not None else []
        # The fp64 outputs the accuracy rule judges 16-bit ones by, per trial and timed set ([] where none).
        self.exact = [decode_value(o, tensors) for o in outputs.get("exact_trials", [])] if tensors is not None else []
        self.exact_timed = [decode_value(o, tensors) for o in outputs.get("exact_timed", [])] \
            if tensors is not None else []
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors or [])
        self._rms: list[float] | None = None

    @property
    def ok(self) -> bool:
        return not self.report.get("error")

    def rms(self, trial: int) -> float:
        """The RMS of the reference's outputs of ``trial`` (harness.output_rms), computed once for every
        candidate judged against this run: in float64 it costs a GEMM's outputs a second per trial."""
        if self._rms is None:
            self._rms = [harness.output_rms(o) for o in self.outputs]
        return self._rms[trial]


class ReferenceCache:
    """The judge's reference runs by task and config, least recently used first out past ``limit_bytes``
    (default: a sixteenth of the machine's memory, at least 2 GiB): a reward scores many candidates of one
    task, and the reference is run (and timed) once for them. The facts of a run (its baseline times and
    floors: small, and the costly part to make again) are kept for FACTS_KEPT tasks whatever the outputs'
    size, so a task whose outputs were let go runs its reference again without timing its baselines again."""

    FACTS_KEPT = 4096

    def __init__(self, limit_bytes: int | None = None) -> None:
        self.limit_bytes = default_cache_bytes() if limit_bytes is None else limit_bytes
        self._runs: "OrderedDict[tuple, ReferenceRun]" = OrderedDict()
        self._facts: "OrderedDict[tuple, dict[str, Any]]" = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> ReferenceRun | None:
        with self._lock:
            run = self._runs.get(key)
            if run is not None:
                self._runs.move_to_end(key)
            return run

    def facts(self, key: tuple) -> dict[str, Any] | None:
        """The facts of the task's last good run (baseline times, floors), or None."""
        with self._lock:
            found = self._facts.get(key)
            return dict(found) if found is not None else None

    def put(self, key: tuple, run: ReferenceRun) -> None:
        if not run.ok:
            return
        with self._lock:
            self._facts[key] = dict(run.facts)
            self._facts.move_to_end(key)
            while len(self._facts) > self.FACTS_KEPT:
                self._facts.popitem(last=False)
            if run.nbytes > self.limit_bytes:
                return
            self._runs[key] = run
            while sum(r.nbytes for r in self._runs.values()) > self.limit_bytes:
                self._runs.popitem(last=False)


def default_cache_bytes() -> int:
    """A sixteenth of the machine's memory and at least 2 GiB: the five corpus problems' reference outputs
    (a GEMM's 1.75 GiB among them) fit on a GPU host, so none is run again for each candidate."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    return max(2 << 30, total // 16)


def cache_key(job: dict[str, Any], device: str) -> tuple:
    """The reference runs that are the same: the task, where it runs and the config fields they depend on."""
    from .task import spec_key

    cfg = VerifyConfig.from_dict(job["config"])
    return (spec_key(job["reference"]), device, tuple(cfg.trial_seeds()), cfg.input_sets, cfg.timing_iters,
            cfg.warmup, cfg.compile_baseline, cfg.bandwidth_tb_s)


def adjudicate(claim: dict[str, Any], body: dict[str, Any], tensors: Sequence[torch.Tensor], ref: ReferenceRun,
               config: VerifyConfig, tolerance: Any) -> dict[str, Any]:
    """The verdict: ``claim`` (the candidate worker's report dict, its ``body`` and ``tensors``: what it sent)
    checked against ``ref`` (the judge's run). Accusations in the claim stand; correctness and speed stand
    only when the judge can confirm them."""
    report = VerifyReport.from_dict(claim)
    # Speed is the judge's to compute: nothing the worker wrote there stands.
    report.speedup = {"eager": None, "compile": None}
    for name in ("eager_ms", "compile_ms"):
        if name in report.timing:
            report.timing[f"{name}_in_worker"] = report.timing.pop(name)
    if report.error is not None or not report.correct:
        report.correct = False
        return _done(report)  # the worker's own finding against the candidate: nothing to confirm
    try:
        shipped = body.get("outputs") or {}
        got_trials = [decode_value(o, tensors) for o in shipped.get("trials", [])]
        got_timed = [decode_value(o, tensors) for o in shipped.get("timed", [])]
    except WireError as exc:
        return _contradicted(report, f"its outputs could not be read: {exc}")
    if len(got_trials) != len(ref.outputs):
        return _contradicted(report, f"it sent the outputs of {len(got_trials)} trials; the judge ran "
                                     f"{len(ref.outputs)}")
    problem_rms = None
    for t, (expected, got, trial) in enumerate(zip(ref.outputs, got_trials, ref.trials)):
        rms = ref.rms(t)
        problem_rms = rms if t == 0 else problem_rms
        scale = max(1.0, rms / problem_rms) if problem_rms else 1.0
        bad = _first_bad(expected, got, tolerance, scale, ref.exact[t] if t < len(ref.exact) else None)
        if bad:
            return _contradicted(report, f"trial {t} (seed {trial['seed']}, {trial['distribution']} inputs): {bad}")
    timed_ran = config.timing_iters > 0 and "candidate_ms" in report.timing
    if timed_ran:
        if len(got_timed) != len(ref.timed):
            return _contradicted(report, f"it sent the outputs of {len(got_timed)} timed input sets; there are "
                                         f"{len(ref.timed)}")
        for k, (expected, got) in enumerate(zip(ref.timed, got_timed)):
            bad = _first_bad(expected, got, tolerance, 1.0, ref.exact_timed[k] if k < len(ref.exact_timed) else None)
            if bad:
                return _contradicted(report, f"timed input set {k}: {bad}", rule="timed-output-mismatch")
        _judge_speed(report, ref.facts, _judge_clock(report, body.get("judge_clock"), config))
    report.timing["judge"] = ("outputs compared and baselines timed by the judge, a process that runs no "
                              "candidate code")
    return _done(report)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _judge_clock(report: VerifyReport, clock: Any, config: VerifyConfig) -> float | None:
    """Holds the claimed times to the judge's own clock; returns the per-call time the judge will use where
    the claim disagrees with it (None: the claim stands). ``clock``: when each of the worker's phase messages
    arrived (pool.py, monotonic seconds: the first and the last of each phase); None for a claim that came
    some other way (no clock to hold it to).
    The calibration's messages come before any candidate code is loaded; of the timed phase the judge takes
    the first "timed" and the last "timed-end", so a message the candidate forges can only widen the window
    (a candidate that forges its whole result is still held to it and to the floors)."""
    if not isinstance(clock, dict):
        return None
    timing = report.timing
    claimed, total = timing.get("candidate_ms"), timing.get("candidate_total_ms")
    calls = config.timing_iters + config.warmup
    start, ends = (clock.get("timed") or [None])[0], list(clock.get("timed-end") or [])
    if start is None or not ends or ends[-1] <= start:
        report.add("forged-timing", MAJOR, "the worker claims a timed phase the judge's clock never saw (no "
                   "timed-phase messages around it).", f"phase messages seen: {', '.join(sorted(clock))[:200]}")
        return math.inf
    elapsed_ms = (ends[-1] - start) * 1e3
    cal = clock.get("calibrate") or [], clock.get("calibrated") or []
    empty_ms = (cal[1][0] - cal[0][0]) * 1e3 if cal[0] and cal[1] and cal[1][0] > cal[0][0] else 0.0
    floor_ms = max(elapsed_ms - CALIBRATION_MARGIN * empty_ms - CLOCK_SLACK_MS, 0.0) / max(calls, 1)
    timing["judge_clock"] = {"timed_phase_ms": elapsed_ms, "empty_phase_ms": empty_ms, "calls": calls,
                             "per_call_floor_ms": floor_ms}
    if not _number(claimed):
        return None  # _judge_speed's finding
    if not _number(total):
        total = claimed * config.timing_iters
    if total > elapsed_ms + CLOCK_SLACK_MS:
        report.add("forged-timing", MAJOR, "the worker's timed calls add up to more time than the judge's clock "
                   "saw pass around them: the times were not measured.",
                   f"claimed total {total:.3f} ms > {elapsed_ms:.3f} ms on the judge's clock")
        return min(claimed, elapsed_ms / max(config.timing_iters, 1))
    if claimed < FORGED_SHARE * floor_ms:
        report.add("forged-timing", MAJOR, "the worker's time per call is far below what the judge's clock saw "
                   "the timed calls take: the times were not measured (or were rewritten).",
                   f"claimed median {claimed:.5f} ms per call; the judge's clock: {elapsed_ms:.3f} ms for {calls} "
                   f"calls, less {empty_ms:.3f} ms for the same phase with nothing to time = at least "
                   f"{floor_ms:.5f} ms per call")
        return floor_ms
    return None


def _judge_speed(report: VerifyReport, facts: dict[str, Any], judged_ms: float | None = None) -> None:
    """The speed-up from the judge's baselines over the candidate's claimed time (``judged_ms``, the judge's
    clock's, where they disagree), held to the floor."""
    timing = report.timing
    cand = timing.get("candidate_ms")
    if not _number(cand):
        report.add("forged-timing", MAJOR, "the worker's candidate time is not a positive number: no "
                   "measurement gives it.", f"candidate_ms = {str(cand)[:40]}")
        report.speedup = {"eager": None, "compile": None}
        return
    if judged_ms is not None:
        timing["candidate_ms_claimed"] = cand
        cand = timing["candidate_ms"] = judged_ms
        if not math.isfinite(cand):
            report.speedup = {"eager": None, "compile": None}
            return
    for name in ("bytes_moved_min", "speed_of_light_ms", "reference_flops", "compute_floor_ms"):
        if name in facts:
            timing[name] = facts[name]
    memory, compute = facts.get("speed_of_light_ms") or 0.0, facts.get("compute_floor_ms") or 0.0
    if memory and cand < FLOOR_MARGIN * memory:
        report.add("impossible-speed", MAJOR, "the measured time is below the memory speed-of-light bound the "
                   "judge computed: the timed call cannot have read its inputs and written its outputs.",
                   f"claimed median {cand:.5f} ms < bound {memory:.5f} ms ({facts.get('bytes_moved_min')} bytes)")
    elif compute and cand < FLOOR_MARGIN * compute:
        # Minor: an algebraic rewrite (summing before a product) legitimately does less arithmetic than the
        # reference; a time claimed below the reference's arithmetic is worth a look, not a verdict.
        report.add("beats-reference-arithmetic", MINOR, "the time is below what the reference's arithmetic "
                   "takes at this GPU's fastest tensor-core rate: an algebraic simplification, or a time that "
                   "was not measured.",
                   f"claimed median {cand:.5f} ms < {compute:.5f} ms for {facts.get('reference_flops'):.3g} FLOPs")
    for base in ("eager", "compile"):
        value = facts.get(f"{base}_ms")
        if value is not None:
            timing[f"{base}_ms"] = value
            report.speedup[base] = value / cand
    if facts.get("compile_error"):
        timing["compile_error"] = facts["compile_error"]


def _contradicted(report: VerifyReport, why: str, rule: str = "judge-disagrees") -> dict[str, Any]:
    """The worker said correct; the judge's comparison says otherwise."""
    report.add(rule, MAJOR, "the candidate's worker reported correct outputs, but the outputs it sent "
               "do not match the judge's reference.", why[:500])
    report.correct = False
    report.error = None
    report.fail("incorrect", f"the judge's comparison: {why}"[:2000])
    return _done(report)


def _done(report: VerifyReport) -> dict[str, Any]:
    if not report.correct:
        report.speedup = {"eager": None, "compile": None}
    report.hack = any(f.severity == MAJOR for f in report.findings)
    report.feedback = build_feedback(report)
    return report.to_dict()


def _first_bad(expected: Sequence[Any], got: Any, tolerance: Any, scale: float, exact: Sequence[Any] | None = None) -> str:
    """The first output of `got` that the judge does not accept (the table, and the accuracy rule against
    `exact`, the reference's fp64 outputs, where it judges), in words; "" when every one is."""
    got = list(got) if isinstance(got, list) else [got]
    if len(got) != len(expected):
        return f"{len(got)} outputs where the reference returns {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got)):
        atol, rtol = tolerance.for_dtype(e.dtype) if isinstance(e, torch.Tensor) else (0.0, 0.0)
        if _clearly_within(e, g, atol * scale, rtol):
            continue
        result = judge_output(i, e, g, tolerance, scale, exact[i] if exact and i < len(exact) else None)
        if not result.ok:
            return result.problem or f"output {i}: {result.mismatches} elements outside tolerance"
    return ""


# Elements compared at once by the judge's float32 pass: a few MB, so the pass streams through the outputs
# in cache instead of making seven whole-size temporaries (a GEMM's 8192x8192 output: 1.9 s a comparison on
# two cores that way, 0.3 s chunked).
CLEAR_CHUNK = 1 << 19


def _clearly_within(expected: Any, got: Any, atol: float, rtol: float) -> bool:
    """True when every element is within half its bound, computed in float32: then the comparator's float64
    rule passes too (outputs of 32 bits or fewer are exact in float32), at a fraction of its cost on large
    outputs. False sends the output to the full comparator, which also words any problem."""
    if not (type(expected) is torch.Tensor and type(got) is torch.Tensor and got.shape == expected.shape
            and got.dtype == expected.dtype and expected.dtype in (torch.float32, torch.float16, torch.bfloat16)):
        return False
    e, g = expected.reshape(-1), got.reshape(-1)
    n = e.numel()
    size = min(n, CLEAR_CHUNK)
    diff, bound = torch.empty(size), torch.empty(size)
    within = torch.empty(size, dtype=torch.bool)
    for start in range(0, n, CLEAR_CHUNK):
        ec, gc = e[start:start + CLEAR_CHUNK].float(), g[start:start + CLEAR_CHUNK].float()
        k = ec.numel()
        d, b, w = diff[:k], bound[:k], within[:k]
        torch.abs(ec, out=b)
        b.mul_(0.5 * rtol).add_(0.5 * atol)
        # An infinite or NaN expected element makes its bound so: the max is not finite, and the comparator decides.
        if not bool(torch.isfinite(b.max())):
            return False
        torch.sub(gc, ec, out=d)
        d.abs_()
        torch.le(d, b, out=w)  # NaN in got compares False
        if not bool(w.all()):
            return False
    return True


def encode_outputs(shipped: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The "outputs" of a result body: each trial's and timed set's outputs, tensors appended to ``tensors``."""
    encoded = {"trials": [encode_value(list(o), tensors) for o in shipped.get("trials", [])],
               "timed": [encode_value(o, tensors) if o is not None else {"value": None} for o in shipped.get("timed", [])]}
    for key in ("exact_trials", "exact_timed"):  # the reference's fp64 outputs (a reference job's only)
        if key in shipped:
            encoded[key] = [encode_value(list(o), tensors) for o in shipped[key]]
    return encoded
