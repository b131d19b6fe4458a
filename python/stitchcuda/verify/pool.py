"""Isolated workers for untrusted candidates: spawned processes (never forked), one per GPU, reused
across candidates, each job under a compile and a run time limit. A worker that crashes, hangs or
leaves its CUDA context broken is killed and replaced; the job becomes a failed report with the cause.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import queue
import re
import signal
import threading
import time
from typing import Any, Sequence

__all__ = ["WorkerPool", "default_pool", "scrubbed_environment", "SECRET_PATTERN"]

# Environment variables a candidate must never see: API keys, tokens, passwords, cloud credentials.
SECRET_PATTERN = re.compile(
    r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_?KEY|ACCESS_?KEY|SESSION_?KEY|AUTH)"
    r"|^(AWS_|AZURE_|GOOGLE_APPLICATION_CREDENTIALS|GCP_|GH_|GITHUB_|HF_|HUGGING_?FACE|OPENAI|ANTHROPIC|"
    r"GEMINI|MISTRAL|COHERE|GROQ|DEEPSEEK|TOGETHER|FIREWORKS|OPENROUTER|XAI_|WANDB_API|NPM_|PYPI_|TWINE_|"
    r"SSH_AUTH_SOCK|KUBECONFIG|DOCKER_AUTH|NETRC)", re.I)
GRACE_S = 5.0  # a killed job is reported within its limit + this
READY_LIMIT_S = 300.0  # importing torch and initializing CUDA in a fresh worker
_spawn_lock = threading.Lock()


def is_secret(name: str) -> bool:
    return bool(SECRET_PATTERN.search(name))


class scrubbed_environment:
    """Context manager: removes secret variables from os.environ (and the C environment a spawned
    child inherits) while a worker starts, then puts them back."""

    def __enter__(self):
        self.saved = {k: v for k, v in os.environ.items() if is_secret(k)}
        for k in self.saved:
            del os.environ[k]
        return self

    def __exit__(self, *exc):
        os.environ.update(self.saved)
        return False


# What one worker may write to a single file (caches, a candidate's scratch files): a candidate filling
# the disk is stopped by SIGXFSZ, which the pool reports as a crash.
WORKER_FILE_BYTES = 4 << 30


def _limit_worker() -> None:
    """Its own process group (kill() takes its children along), no core dumps of a crashing candidate,
    and a cap on the size of any file it writes. Address space is left alone: CUDA maps far more virtual
    memory than it uses."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        cap = WORKER_FILE_BYTES if hard == resource.RLIM_INFINITY else min(hard, WORKER_FILE_BYTES)
        resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))
    except (ImportError, ValueError, OSError):
        pass


def _worker_main(conn, device: str | None) -> None:
    """Entry point of a worker process: import once, then verify jobs until told to stop."""
    # A candidate's prints (and a dying C library's messages) must not corrupt the parent's output:
    # everything the worker has to say comes back through the pipe.
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        if not os.environ.get("STITCHCUDA_VERIFY_WORKER_STDERR"):
            os.dup2(null, 2)
    except OSError:
        pass
    for name in [k for k in os.environ if is_secret(k)]:  # belt and braces
        del os.environ[name]
    _limit_worker()
    try:
        import torch

        from . import harness
        from .. import jit

        jit.confine_includes()  # candidates' CUDA may include only the toolkit's headers, from now on
        info = {"pid": os.getpid(), "device": device}
        if device and device.startswith("cuda") and torch.cuda.is_available():
            index = int(device.split(":")[1]) if ":" in device else 0
            torch.cuda.set_device(index)
            torch.zeros(1, device="cuda")  # create the context now, not inside the first job's limit
            from . import gpu  # noqa: F401 - captures the timing functions before any candidate runs
            info["gpu"] = torch.cuda.get_device_name(index)
        conn.send(("ready", info))
    except BaseException as exc:  # noqa: BLE001 - report whatever broke the start-up
        conn.send(("startup-error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        result = harness.run_job(job, lambda phase: conn.send(("phase", phase)))
        conn.send(("result", result))
        if result.get("recycle"):
            return  # the parent replaces this worker


class _Worker:
    def __init__(self, ctx, device: str | None) -> None:
        self.device = device
        self.conn, child = ctx.Pipe(duplex=True)
        with _spawn_lock, scrubbed_environment():
            # Not a daemon: torch.compile's inductor may start compile workers of its own, which a
            # daemonic process may not. Pools close their workers at exit (WorkerPool registers it).
            self.process = ctx.Process(target=_worker_main, args=(child, device), daemon=False,
                                       name=f"stitchcuda-verify-{device or 'cpu'}")
            self.process.start()
        child.close()
        self.ready = False
        self.info: dict[str, Any] = {}

    def wait_ready(self, limit: float) -> str | None:
        """None when ready, else the reason it is not."""
        if self.ready:
            return None
        if not self.conn.poll(limit):
            return f"the worker did not start within {limit:.0f} s"
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            return f"the worker died while starting ({_exit_text(self.process)})"
        if kind != "ready":
            return f"the worker could not start: {payload}"
        self.ready, self.info = True, payload
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

    def __init__(self, devices: Sequence[str] | None = None, ready_limit_s: float = READY_LIMIT_S) -> None:
        if devices is None:
            devices = _visible_devices()
        if not devices:
            raise ValueError("WorkerPool needs at least one device.")
        self.devices = list(devices)
        self.ready_limit_s = ready_limit_s
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: "queue.Queue[int]" = queue.Queue()
        self._workers: list[_Worker | None] = [None] * len(self.devices)
        for i in range(len(self.devices)):
            self._idle.put(i)
        self._closed = False
        self.replacements = 0  # workers replaced after a failure (for tests and benchmarks)
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
        for i, w in enumerate(self._workers):
            if w is not None:
                w.stop()
                self._workers[i] = None

    @property
    def pids(self) -> list[int | None]:
        return [w.process.pid if w is not None and w.process.is_alive() else None for w in self._workers]

    def run(self, job: dict[str, Any], compile_limit_s: float, run_limit_s: float) -> dict[str, Any]:
        """Runs one job; returns the harness's report dict, or a failure dict (crash, timeout...)."""
        if self._closed:
            raise RuntimeError("the WorkerPool is closed")
        slot = self._idle.get()
        try:
            return self._run_on(slot, job, compile_limit_s, run_limit_s)
        finally:
            self._idle.put(slot)

    def _run_on(self, slot: int, job: dict[str, Any], compile_limit_s: float, run_limit_s: float) -> dict[str, Any]:
        worker = self._workers[slot]
        if worker is None or not worker.process.is_alive():
            if worker is not None:
                worker.kill()
            worker = self._workers[slot] = _Worker(self._ctx, self.devices[slot])
        problem = worker.wait_ready(self.ready_limit_s)
        if problem:
            self._replace(slot)
            return _failure("crash", f"verification worker for {self.devices[slot]}: {problem}")
        job = dict(job)
        job["config"] = dict(job["config"], device=_job_device(job["config"].get("device"), self.devices[slot]))
        try:
            worker.conn.send(job)
        except (OSError, BrokenPipeError) as exc:
            self._replace(slot)
            return _failure("crash", f"could not send the job to the worker: {exc}")
        phase, limit = "compile", compile_limit_s
        deadline = time.monotonic() + limit
        compiled = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not worker.conn.poll(max(remaining, 0)):
                if worker.conn.poll(0):  # a message arrived right at the deadline
                    pass
                else:
                    self._replace(slot)
                    where = "loading and compiling the candidate" if phase == "compile" else "running the candidate"
                    return _failure("timeout", f"the candidate exceeded the {limit:g} s limit for {where}; "
                                               "the worker was killed.", compiled=compiled)
            try:
                kind, payload = worker.conn.recv()
            except (EOFError, OSError):
                cause = _exit_text(worker.process)
                self._replace(slot)
                return _failure("crash", f"the worker process died while {'loading' if phase == 'compile' else 'running'} "
                                         f"the candidate ({cause}).", compiled=compiled)
            if kind == "phase":
                if payload == "run":
                    phase, limit, compiled = "run", run_limit_s, True
                    deadline = time.monotonic() + limit
                continue
            if kind == "result":
                if payload.pop("recycle", False):
                    self._replace(slot)
                return payload

    def _replace(self, slot: int) -> None:
        worker = self._workers[slot]
        if worker is not None:
            worker.kill()
        self._workers[slot] = None  # a new one starts with the next job
        self.replacements += 1


def _job_device(asked: str | None, worker_device: str) -> str:
    if worker_device == "cpu":
        return "cpu"
    return "cpu" if asked == "cpu" else "cuda"


def _failure(kind: str, message: str, compiled: bool = False) -> dict[str, Any]:
    from .report import VerifyReport, build_feedback

    report = VerifyReport(compiled=compiled)
    report.fail(kind, message)
    report.feedback = build_feedback(report)
    return report.to_dict()


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
