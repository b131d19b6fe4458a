"""Isolated workers for untrusted candidates: spawned processes (never forked), one per GPU, reused
across candidates, each job under a compile and a run time limit. A worker that crashes, hangs or
leaves its CUDA context broken is killed and replaced; the job becomes a failed report with the cause.
What a worker sends back is data (wire.py), never unpickled; a candidate's verdict is the judge's
(judge.py): its outputs compared against a reference run in a worker that runs no candidate code.
"""

from __future__ import annotations

import atexit
import multiprocessing.spawn
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, Sequence

from ..settings import settings
from . import jobs, wire
from .environment import SECRET_PATTERN, is_secret, sandbox_wanted, worker_environment  # noqa: F401 - re-exported
from .sandbox import by_value, namespace_rss
from .report import failure_dict

__all__ = ["WorkerPool", "default_pool", "trusted_pool", "worker_environment", "SECRET_PATTERN"]

GRACE_S = 5.0  # a killed job is reported within its limit + this
FRAME_S = 30.0  # a message that began to arrive is whole within its phase's limit + this (2 GiB at 70 MB/s)
MEMORY_POLL_S = 0.25  # how often a running job's host memory is read
READY_LIMIT_S = 300.0  # importing torch and initializing CUDA in a fresh worker
_spawn_lock = threading.Lock()
# The most one result may bring back (the candidate's outputs of every trial and timed set).
RESULT_LIMIT_BYTES = wire.DEFAULT_LIMIT_BYTES


# The worker's interpreter: reads its start message (the parent's sys.path and main module, as
# multiprocessing's spawn prepares them, and its device) from the pipe it was given, then serves jobs.
_BOOT = """import sys
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
start = conn.recv()
import multiprocessing.spawn
multiprocessing.spawn.prepare(start["prep"])
from stitchcuda.verify.worker import main
main(conn, start["device"])
"""


class _Process:
    """A started worker, as the pool handles it (pid, is_alive, kill, join, exitcode: negative for a
    signal), over the launcher process (verify/sandbox.py) that ends the way the worker ends."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self._popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def kill(self) -> None:
        try:
            self._popen.kill()
        except OSError:
            pass

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()


class _Worker:
    def __init__(self, device: str | None, private_dir: str | None, memory_limit_bytes: int | None = None) -> None:
        from . import sandbox

        if settings().sandbox_state:
            # Only a worker has this variable: its import of the caller's main script reached a check.
            raise RuntimeError("a verification worker may not start workers of its own: the script that calls "
                               "check() or optimize() must guard its entry point with "
                               "`if __name__ == \"__main__\":` (the worker imports it to rebuild pickled models)")
        self.device = device
        self.sandboxed = private_dir is not None
        ours, theirs = socket.socketpair()
        worker = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", _BOOT, str(theirs.fileno())]
        quiet = not settings().verify_worker_stderr
        try:
            with _spawn_lock:
                launch = sandbox.command(private_dir, self.sandboxed, worker, memory_bytes=memory_limit_bytes)
                popen = subprocess.Popen(launch, env=worker_environment(), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL if quiet else None,
                                         pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self.process = _Process(popen)
        self.conn = Connection(ours.detach())
        self.ready = False
        self.info: dict[str, Any] = {}
        prep = multiprocessing.spawn.get_preparation_data(f"stitchcuda-verify-{device or 'cpu'}")
        # Tensors sent over the pipe travel as shared memory handed over by multiprocessing's resource
        # sharer, which checks this key (as a plain spawned process would have it).
        prep["authkey"] = bytes(prep["authkey"])
        try:
            self.conn.send({"prep": prep, "device": device})
        except OSError:
            pass  # the worker died at once: wait_ready says so

    def wait_ready(self, limit: float) -> str | None:
        """None when ready, else the reason it is not."""
        if self.ready:
            return None
        if not self.conn.poll(limit):
            return f"the worker did not start within {limit:.0f} s"
        try:
            message = wire.receive(self.conn, wire.MAX_HEADER_BYTES + 16, kinds=("ready", "startup-error"))
        except (EOFError, OSError):
            return f"the worker died while starting ({_exit_text(self.process)})"
        except wire.WireError as exc:
            return f"the worker's first message is not the protocol's ({exc})"
        if message.kind != "ready":
            return f"the worker could not start: {str(message.body.get('message'))[:2000]}"
        self.ready, self.info = True, message.body
        return None

    def kill(self) -> None:
        try:
            # The worker leads its own process group: whatever the candidate started goes with it (a child
            # that starts a session of its own escapes: docs/security.md).
            pid = self.process.pid
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError, OSError):
                    pass
            if self.process.is_alive():
                self.process.kill()
            # A process stuck in the driver may take a moment to go; it is reaped later if need be.
            self.process.join(timeout=2)
        except (OSError, ValueError, AssertionError):
            pass
        try:
            self.conn.close()
        except OSError:
            pass

    def stop(self) -> None:
        try:
            self.conn.send(None)
            self.process.join(timeout=2)
        except (OSError, ValueError, BrokenPipeError):
            pass
        self.kill()


def _exit_text(process) -> str:
    process.join(timeout=1)
    code = process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class WorkerPool:
    """Worker processes that verify candidates, one per device.

    ``devices``: a list such as ["cuda:0", "cuda:1"] or ["cpu"]; None = every visible GPU, or one
    CPU worker where there is none. Workers start lazily and are replaced after a crash, a timeout,
    a sticky CUDA error or a detected patch of the timing functions. ``run(job)`` blocks until the
    job's report is ready and is safe to call from several threads (one job per worker at a time).
    """

    def __init__(self, devices: Sequence[str] | None = None, ready_limit_s: float = READY_LIMIT_S,
                 sandbox: bool | None = None, memory_limit_bytes: int | None = None, judged: bool = True) -> None:
        if devices is None:
            devices = _visible_devices()
        if not devices:
            raise ValueError("WorkerPool needs at least one device.")
        self.devices = list(devices)
        self.ready_limit_s = ready_limit_s
        # Host memory of a worker and everything it started, checked while a job runs (an address-space
        # limit would break CUDA, which maps far more virtual memory than it uses).
        self.memory_limit_bytes = int(memory_limit_bytes or default_memory_limit())
        # The sandbox (verify/sandbox.py) is on unless asked off here or by STITCHCUDA_SANDBOX=0. Its
        # writable folder lives as long as the pool, so that caches survive a worker's replacement.
        self.sandbox = sandbox_wanted(sandbox)
        self.sandbox_fallback: str | None = None  # why workers run without the sandbox, if they must
        self._private_dir = tempfile.mkdtemp(prefix="stitchcuda-worker-") if self.sandbox else None
        self._warned = False
        self._idle: "queue.Queue[int]" = queue.Queue()
        self._workers: list[_Worker | None] = [None] * len(self.devices)
        for i in range(len(self.devices)):
            self._idle.put(i)
        self._closed = False
        self.replacements = 0  # workers replaced after a failure (for tests and benchmarks)
        # Candidates are judged (judge.py) by workers of a second pool that run reference jobs only; the
        # reference runs are kept per task, so a reward's many candidates of one task cost one.
        from .judge import ReferenceCache

        self.judged = judged
        self._judge: WorkerPool | None = None
        self._judge_lock = threading.Lock()
        self.references = ReferenceCache()
        self.result_limit_bytes = RESULT_LIMIT_BYTES
        # Whether CUDA tensors may cross to the workers as CUDA IPC handles (no copy through host memory):
        # only outside the sandbox, whose private /dev/shm and PID namespace keep torch's IPC bookkeeping
        # from working, and only until a job sent that way fails to arrive (then copies, and a warning).
        self.shares_cuda = not self.sandbox
        self.cuda_ipc_problem: str | None = None
        # Before multiprocessing's own exit handler joins the (non-daemon) workers: stop them first.
        atexit.register(self.close)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stops every worker (a job still running on another thread is cut off)."""
        if self._closed:
            return
        self._closed = True
        if self._judge is not None:
            self._judge.close()
        for i, w in enumerate(self._workers):
            if w is not None:
                w.stop()
                self._workers[i] = None
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)

    @property
    def pids(self) -> list[int | None]:
        return [w.process.pid if w is not None and w.process.is_alive() else None for w in self._workers]

    def start(self) -> None:
        """Starts every idle worker that is not running yet and returns at once, without waiting for it to
        be ready: a caller that sends jobs soon (optimize() before it captures the model) lets the workers
        import torch and make their CUDA context meanwhile, instead of waiting for that at the first job.
        A worker busy with a job is left alone."""
        if self._closed:
            raise RuntimeError("the WorkerPool is closed")
        taken = []
        try:
            while True:
                try:
                    taken.append(self._idle.get_nowait())
                except queue.Empty:
                    break
            for slot in taken:
                self._running(slot)
        finally:
            for slot in taken:
                self._idle.put(slot)

    def run(self, job: jobs.Job | dict[str, Any], compile_limit_s: float, run_limit_s: float) -> dict[str, Any]:
        """Runs one job (a jobs.py type, or its dict); returns the report dict, or a failure dict (crash,
        timeout, a broken protocol...). A candidate model (a ModelJob not marked trusted) is judged: the
        judge's worker runs the reference, and the verdict is judge.adjudicate's, not the worker's word."""
        if self._closed:
            raise RuntimeError("the WorkerPool is closed")
        job = jobs.typed(job)
        slot = self._idle.get()
        try:
            if isinstance(job, jobs.ModelJob) and not job.trusted and self.judged:
                return self._judged(slot, job, compile_limit_s, run_limit_s)
            return self._run_on(slot, job, compile_limit_s, run_limit_s)[0]
        finally:
            self._idle.put(slot)

    def judge_pool(self) -> "WorkerPool":
        """The workers of the judge (one per device of this pool, the same sandbox): they run reference jobs
        only, never a candidate's code. Started with the first judged job (or ``start``)."""
        with self._judge_lock:
            if self._judge is None:
                self._judge = WorkerPool(self.devices, self.ready_limit_s, sandbox=self.sandbox,
                                         memory_limit_bytes=self.memory_limit_bytes, judged=False)
                atexit.unregister(self._judge.close)  # closed with this pool
            return self._judge

    def _judged(self, slot: int, job: jobs.ModelJob, compile_limit_s: float, run_limit_s: float) -> dict[str, Any]:
        from .config import VerifyConfig
        from .judge import ReferenceRun, adjudicate, cache_key
        from .task import Tolerance

        config = VerifyConfig.from_dict(job.config)
        key = cache_key(jobs.as_dict(job), _job_device(config.device, self.devices[slot]))
        ref = self.references.get(key)
        reference_s = None
        if ref is None:
            started = time.monotonic()
            self._running(slot)  # the candidate's worker starts (imports torch) while the judge's works
            # The baselines' times (torch.compile, 2x100 timed calls) are kept apart from the outputs: when
            # only the outputs were let go (too large to keep beside the other tasks'), they alone are made
            # again, not the baselines.
            facts = self.references.facts(key)
            ref_config = job.config if facts is None else dict(job.config, timing_iters=0)
            # On the candidate's slot: the judge's timing never overlaps a candidate's on the same device.
            data, body, tensors = self.judge_pool()._run_on(slot, jobs.ReferenceJob(job.reference, ref_config),
                                                            compile_limit_s, run_limit_s)
            ref = ReferenceRun(data, body or {}, tensors)
            if facts is not None and ref.ok:
                ref.facts = {**ref.facts, **facts}
            self.references.put(key, ref)
            reference_s = time.monotonic() - started
        if not ref.ok:
            data = {k: v for k, v in ref.report.items() if k != "judge"}
            error = dict(data.get("error") or {})
            error["message"] = f"the judge's reference run: {error.get('message', '')}"[:4000]
            data["error"] = error
            return data
        data, body, tensors = self._run_on(slot, replace(job, baselines="judge"), compile_limit_s, run_limit_s)
        phases = dict(data.get("timing", {}).get("phases_s") or {})
        if reference_s is not None:
            phases["reference"] = reference_s
        if body is None:  # no result of the candidate's own: a crash, a timeout, a broken protocol
            data.setdefault("timing", {})["phases_s"] = _rounded(phases)
            return data
        tolerance = config.tolerance or Tolerance.from_dict(job.reference["tolerance"])
        started = time.monotonic()
        verdict = adjudicate(data, body, tensors, ref, config, tolerance)
        phases["judge"] = time.monotonic() - started
        verdict.setdefault("timing", {})["phases_s"] = _rounded(phases)
        if any(f.get("rule") == "forged-timing" for f in verdict.get("findings", [])):
            self._replace(slot)  # whatever rewrote its times may still sit in the worker for the next candidate
        return verdict

    def _running(self, slot: int) -> _Worker:
        """The slot's worker, started (or replaced, when it died) if it is not running."""
        worker = self._workers[slot]
        if worker is None or not worker.process.is_alive():
            if worker is not None:
                worker.kill()
            worker = self._workers[slot] = self._start(slot)
        return worker

    def _run_on(self, slot: int, job: jobs.Job, compile_limit_s: float,
                run_limit_s: float) -> tuple[dict[str, Any], dict[str, Any] | None, list[Any]]:
        """(report dict, the result's body, its tensors); body None when the job ended without a result.
        The report's timing["phases_s"] says where the job's time went, on this process's clock (PHASE_NAMES)."""
        began = time.monotonic()
        worker = self._running(slot)
        started_here = not worker.ready
        if worker.ready and worker.conn.poll(0):
            # Something the last candidate left behind (a thread still writing): a fresh worker for this job.
            self._replace(slot)
            worker = self._running(slot)
        problem = worker.wait_ready(self.ready_limit_s)
        if problem and worker.sandboxed and "did not start within" not in problem:
            # A machine where CUDA or torch cannot start inside the namespaces: verify without them
            # rather than not at all, and say so.
            self.sandbox_fallback = problem
            warnings.warn(f"StitchCUDA: the verification worker could not start in its sandbox ({problem}); "
                          "candidates now run without it (docs/security.md).", RuntimeWarning, stacklevel=3)
            self._replace(slot)
            worker = self._workers[slot] = self._start(slot)
            problem = worker.wait_ready(self.ready_limit_s)
        if problem:
            self._replace(slot)
            return failure_dict("crash", f"verification worker for {self.devices[slot]}: {problem}"), None, []
        self._warn_once(worker.info.get("sandbox"))
        sent = time.monotonic()
        job = replace(job, config=dict(job.config, device=_job_device(job.config.get("device"), self.devices[slot])))
        nonce = secrets.token_hex(16)
        try:
            # A sandboxed worker (nobody, /tmp out of view) cannot reach multiprocessing's fd sharer: tensors go by value.
            worker.conn.send_bytes(by_value((nonce, job))) if worker.sandboxed else worker.conn.send((nonce, job))
        except (OSError, BrokenPipeError) as exc:
            self._replace(slot)
            return failure_dict("crash", f"could not send the job to the worker: {exc}"), None, []
        phase, limit = "compile", compile_limit_s
        deadline = time.monotonic() + limit
        compiled = False
        clock: dict[str, list[float]] = {}  # when phase messages arrived, on the judge's clock (judge.py)
        while True:
            remaining = deadline - time.monotonic()
            if remaining > 0 and not worker.conn.poll(min(remaining, MEMORY_POLL_S)):
                used = namespace_rss(worker.process.pid)  # the whole PID namespace, not the process group
                if used > self.memory_limit_bytes:
                    self._replace(slot)
                    return failure_dict("oom", f"the candidate's processes used {used / 2**30:.1f} GiB of host "
                                               f"memory, above the pool's limit of {self.memory_limit_bytes / 2**30:.1f} "
                                               "GiB (WorkerPool(memory_limit_bytes=...)); the worker was killed.",
                                        compiled=compiled), None, []
                continue
            if remaining <= 0 and not worker.conn.poll(0):
                self._replace(slot)
                where = "loading and compiling the candidate" if phase == "compile" else "running the candidate"
                return failure_dict("timeout", f"the candidate exceeded the {limit:g} s limit for {where}; "
                                               "the worker was killed.", compiled=compiled), None, []
            arrived = time.monotonic()
            try:
                # Bounded: a frame begun must be whole within FRAME_S past the phase's limit (a candidate that
                # writes a frame's start to the pipe and sleeps would otherwise hold this thread for ever).
                message = wire.receive(worker.conn, self.result_limit_bytes, kinds=("phase", "result"),
                                       deadline=max(deadline, arrived) + FRAME_S)
            except (EOFError, OSError):
                cause = _exit_text(worker.process)
                self._replace(slot)
                return failure_dict("crash", f"the worker process died while {'loading' if phase == 'compile' else 'running'} "
                                             f"the candidate ({cause}).", compiled=compiled), None, []
            except wire.WireError as exc:
                return self._violation(slot, str(exc), compiled), None, []
            if message.nonce != nonce:
                return self._violation(slot, f"a {message.kind!r} message without this job's nonce", compiled), None, []
            if message.kind == "phase":
                if message.body.get("phase") not in wire.PHASES or set(message.body) != {"phase"}:
                    return self._violation(slot, "a phase message that names no phase", compiled), None, []
                now = time.monotonic()
                clock.setdefault(message.body["phase"], [now, now])[1] = now  # the first and the last
                if message.body["phase"] == "run":
                    phase, limit, compiled = "run", run_limit_s, True
                    deadline = time.monotonic() + limit
                continue
            data = message.body.get("report")
            problem = _report_problem(data)
            if problem:
                return self._violation(slot, problem, compiled), None, []
            if worker.conn.poll(0):
                return self._violation(slot, "another message right after the result", compiled), None, []
            if data.pop("recycle", False):
                self._replace(slot)
            data.setdefault("timing", {})["sandbox"] = self.sandbox_text(worker)
            data["timing"]["phases_s"] = _rounded(_phases(began if started_here else None, sent, clock, arrived))
            return data, dict(message.body, judge_clock=clock), message.tensors

    def _violation(self, slot: int, what: str, compiled: bool) -> dict[str, Any]:
        """A worker that broke the protocol: replaced, and its candidate's report a major finding."""
        worker = self._workers[slot]
        text = self.sandbox_text(worker) if worker is not None else ""
        self._replace(slot)
        data = failure_dict("crash", f"the verification worker broke the result protocol ({what[:300]}); no "
                                     "verdict it sent is taken", compiled=compiled)
        data["findings"].append({"rule": "protocol-violation", "severity": "major", "line": None,
                                 "message": "the candidate's process sent the judge a message outside the "
                                            "protocol: a forged or corrupted result.", "evidence": what[:300]})
        data["hack"] = True
        data["timing"]["sandbox"] = text
        return data

    def _start(self, slot: int) -> _Worker:
        private = self._private_dir if self.sandbox and self.sandbox_fallback is None else None
        return _Worker(self.devices[slot], private, self.memory_limit_bytes)

    def sandbox_text(self, worker: _Worker | None = None) -> str:
        """What isolates the candidates of this pool, in one line (the report's timing["sandbox"])."""
        from .sandbox import describe

        if not self.sandbox:
            return "sandbox: off (WorkerPool(sandbox=False) or STITCHCUDA_SANDBOX=0)"
        if worker is None or not worker.sandboxed:
            return f"sandbox: none (the worker could not start in it: {self.sandbox_fallback})"
        return describe(worker.info.get("sandbox"))

    @property
    def sandbox_state(self) -> dict[str, Any] | None:
        """The layers of the sandbox a running worker reported (verify/sandbox.py), or None."""
        for w in self._workers:
            if w is not None and w.ready:
                return w.info.get("sandbox")
        return None

    def _warn_once(self, state: dict[str, Any] | None) -> None:
        if self._warned or not self.sandbox or not state or not state.get("warnings"):
            return
        self._warned = True
        warnings.warn("StitchCUDA: the verification sandbox is incomplete on this machine: "
                      + "; ".join(state["warnings"]) + " (docs/security.md).", RuntimeWarning, stacklevel=4)

    def _replace(self, slot: int) -> None:
        worker = self._workers[slot]
        if worker is not None:
            worker.kill()
        self._workers[slot] = None  # a new one starts with the next job
        self.replacements += 1


# Where a job's time goes, in order (timing["phases_s"]): the worker's start when the job had to wait for it;
# the job's set-up in the worker (the task's reference built, before the judge's runs its empty timed phase
# there: "calibration"); loading the candidate (its imports, NVRTC, ModelNew()); the correctness trials
# (reference and candidate runs, the fp64 and dispatch checks); the timed calls; what follows them (the CUPTI
# cross-check, the outputs packed); reading the result frame. A static job has "static" (NVRTC and the rules)
# where the rest are. The judged path adds "reference" (the judge's reference run, when it was not kept) and
# "judge" (the outputs compared). Every figure is on the caller's clock, from the worker's phase messages.
PHASE_NAMES = ("worker_start", "setup", "calibration", "load", "trials", "timed", "after", "static", "receive",
               "reference", "judge")
_MARKS = (("calibrate", "setup"), ("calibrated", "calibration"), ("compile", "setup"), ("run", "load"),
          ("timed", "trials"), ("timed-end", "timed"))


def _phases(began: float | None, sent: float, clock: dict[str, list[float]], arrived: float) -> dict[str, float]:
    """The durations of a job's phases from the arrival times of its phase messages (``clock``: first and
    last of each), the job's sending and its result's arrival; the reading of the frame ends now."""
    out: dict[str, float] = {}
    if began is not None:
        out["worker_start"] = sent - began
    last = sent
    for mark, name in _MARKS:
        at = (clock.get(mark) or [None, None])[-1 if mark == "timed-end" else 0]
        if at is not None and at >= last:
            out[name] = out.get(name, 0.0) + at - last
            last = at
    # What follows the last phase message: after the timed calls, after the trials when nothing was timed.
    rest = "after" if "timed-end" in clock else "trials" if "run" in clock else "load" if "compile" in clock \
        else "setup" if clock else "static"
    out[rest] = out.get(rest, 0.0) + arrived - last
    out["receive"] = time.monotonic() - arrived
    return out


def _rounded(phases: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in phases.items()}


def default_memory_limit() -> int:
    """Half of the machine's memory, and at least 8 GiB (torch and a CUDA context take 2-4 GiB)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    return max(8 << 30, total // 2)


def _job_device(asked: str | None, worker_device: str) -> str:
    if worker_device == "cpu":
        return "cpu"
    return "cpu" if asked == "cpu" else "cuda"


def _report_problem(data: Any) -> str:
    """What makes ``data`` no report a worker may send ("" when it is one): the judge reads nothing else."""
    from .report import VerifyReport

    if not isinstance(data, dict):
        return "a result without a report"
    kinds = {"compiled": bool, "correct": bool, "hack": bool, "findings": list, "outputs": list, "speedup": dict,
             "timing": dict, "feedback": str, "compile_log": str, "trials": list, "wall_s": (int, float)}
    for name, kind in kinds.items():
        if name in data and not isinstance(data[name], kind):
            return f"the report's {name} is not a {getattr(kind, '__name__', 'number')}"
    error = data.get("error")
    if error is not None and not (isinstance(error, dict) and isinstance(error.get("kind"), str)
                                  and isinstance(error.get("message"), str)):
        return "the report's error is malformed"
    try:
        VerifyReport.from_dict(data)
    except Exception as exc:  # noqa: BLE001 - whatever does not rebuild is no report
        return f"the report does not read ({type(exc).__name__})"
    return ""


def _visible_devices() -> list[str]:
    try:
        from .. import _C
        count = _C.device_count()
    except Exception:
        count = 0
    return [f"cuda:{i}" for i in range(count)] or ["cpu"]


_default: WorkerPool | None = None
_default_lock = threading.Lock()


def default_pool() -> WorkerPool:
    """The process-wide pool ``check(..., pool=None)`` uses; closed at exit."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = WorkerPool()
        return _default


_trusted: WorkerPool | None = None


def trusted_pool() -> WorkerPool:
    """The process-wide pool for StitchCUDA's own generated programs (graph mode's group checks): isolated
    processes without the sandbox, so recorded tensors reach them as CUDA IPC handles instead of copies
    through host memory (several GB per group at the scale of large models). Code a model wrote never
    runs here: candidates go to ``default_pool()``."""
    global _trusted
    with _default_lock:
        if _trusted is None or _trusted._closed:
            _trusted = WorkerPool(sandbox=False)
        return _trusted
