"""Isolated workers for untrusted candidates: spawned processes (never forked), one per GPU, reused
across candidates, each job under a compile and a run time limit. A worker that crashes, hangs or
leaves its CUDA context broken is killed and replaced; the job becomes a failed report with the cause.
"""

from __future__ import annotations

import atexit
import multiprocessing.spawn
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from multiprocessing.connection import Connection
from typing import Any, Sequence

__all__ = ["WorkerPool", "default_pool", "trusted_pool", "worker_environment", "SECRET_PATTERN"]

# Environment variables a candidate must never see: API keys, tokens, passwords, cloud credentials.
SECRET_PATTERN = re.compile(
    r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_?KEY|ACCESS_?KEY|SESSION_?KEY|AUTH)"
    r"|^(AWS_|AZURE_|GOOGLE_APPLICATION_CREDENTIALS|GCP_|GH_|GITHUB_|HF_|HUGGING_?FACE|OPENAI|ANTHROPIC|"
    r"GEMINI|MISTRAL|COHERE|GROQ|DEEPSEEK|TOGETHER|FIREWORKS|OPENROUTER|XAI_|WANDB_API|NPM_|PYPI_|TWINE_|"
    r"SSH_AUTH_SOCK|KUBECONFIG|DOCKER_AUTH|NETRC)", re.I)
GRACE_S = 5.0  # a killed job is reported within its limit + this
MEMORY_POLL_S = 0.25  # how often a running job's host memory is read
READY_LIMIT_S = 300.0  # importing torch and initializing CUDA in a fresh worker
_spawn_lock = threading.Lock()


def is_secret(name: str) -> bool:
    return bool(SECRET_PATTERN.search(name))


def worker_environment() -> dict[str, str]:
    """The environment a worker starts with: the caller's, less every variable that looks like a secret
    (so that not even the worker's /proc/self/environ holds one)."""
    return {k: v for k, v in os.environ.items() if not is_secret(k)}


# The worker's interpreter: reads its start message (the parent's sys.path and main module, as
# multiprocessing's spawn prepares them, and its device) from the pipe it was given, then serves jobs.
_BOOT = """import sys
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
start = conn.recv()
import multiprocessing.spawn
multiprocessing.spawn.prepare(start["prep"])
from stitchcuda.verify.pool import _worker_main
_worker_main(conn, start["device"])
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


# A worker that holds more than this in cached GPU blocks after a job gives them back to the driver.
IDLE_CACHE_BYTES = 1 << 30


def _worker_main(conn, device: str | None) -> None:
    """Entry point of a worker process (in its sandbox already): import once, then verify jobs until
    told to stop."""
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
    from .sandbox import state_of_this_process

    sandboxed = state_of_this_process()
    if sandboxed and sandboxed.get("enabled") and os.environ.get("TMPDIR"):
        try:
            os.chdir(os.environ["TMPDIR"])  # the private folder: the rest is read-only
        except OSError:
            pass
    try:
        import torch

        from . import harness
        from .. import jit

        jit.confine_includes()  # candidates' CUDA may include only the toolkit's headers, from now on
        info = {"pid": os.getpid(), "device": device, "sandbox": sandboxed}
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
        except Exception as exc:  # noqa: BLE001 - a job that cannot be rebuilt here (CUDA IPC refused)
            data = _failure("crash", f"the job could not be received ({type(exc).__name__}: {exc})")
            data["recycle"] = True
            conn.send(("result", data))
            return
        if job is None:
            return
        result = harness.run_job(job, lambda phase: conn.send(("phase", phase)))
        # Let go of the job's tensors before waiting for the next one: tensors that came as CUDA IPC
        # handles stay allocated in the parent until this process drops them, and cached blocks of
        # several GB would stay reserved on the GPU while the worker idles.
        job = None
        if not result.get("recycle") and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > IDLE_CACHE_BYTES:
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - a context the job broke: the parent replaces the worker anyway
                pass
        conn.send(("result", result))
        if result.get("recycle"):
            return  # the parent replaces this worker


class _Worker:
    def __init__(self, device: str | None, private_dir: str | None) -> None:
        from . import sandbox

        if os.environ.get(sandbox.STATE_VARIABLE):
            # Only a worker has this variable: its import of the caller's main script reached a check.
            raise RuntimeError("a verification worker may not start workers of its own: the script that calls "
                               "check() or optimize() must guard its entry point with "
                               "`if __name__ == \"__main__\":` (the worker imports it to rebuild pickled models)")
        self.device = device
        self.sandboxed = private_dir is not None
        ours, theirs = socket.socketpair()
        worker = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", _BOOT, str(theirs.fileno())]
        quiet = not os.environ.get("STITCHCUDA_VERIFY_WORKER_STDERR")
        try:
            with _spawn_lock:
                popen = subprocess.Popen(sandbox.command(private_dir, self.sandboxed, worker), env=worker_environment(),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL if quiet else None, pass_fds=(theirs.fileno(),))
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

    def __init__(self, devices: Sequence[str] | None = None, ready_limit_s: float = READY_LIMIT_S,
                 sandbox: bool | None = None, memory_limit_bytes: int | None = None) -> None:
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

    def run(self, job: dict[str, Any], compile_limit_s: float, run_limit_s: float) -> dict[str, Any]:
        """Runs one job; returns the harness's report dict, or a failure dict (crash, timeout...)."""
        if self._closed:
            raise RuntimeError("the WorkerPool is closed")
        slot = self._idle.get()
        try:
            return self._run_on(slot, job, compile_limit_s, run_limit_s)
        finally:
            self._idle.put(slot)

    def _running(self, slot: int) -> _Worker:
        """The slot's worker, started (or replaced, when it died) if it is not running."""
        worker = self._workers[slot]
        if worker is None or not worker.process.is_alive():
            if worker is not None:
                worker.kill()
            worker = self._workers[slot] = self._start(slot)
        return worker

    def _run_on(self, slot: int, job: dict[str, Any], compile_limit_s: float, run_limit_s: float) -> dict[str, Any]:
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
            return _failure("crash", f"verification worker for {self.devices[slot]}: {problem}")
        self._warn_once(worker.info.get("sandbox"))
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
            if remaining > 0 and not worker.conn.poll(min(remaining, MEMORY_POLL_S)):
                used = _group_rss(worker.process.pid)
                if used > self.memory_limit_bytes:
                    self._replace(slot)
                    return _failure("oom", f"the candidate's processes used {used / 2**30:.1f} GiB of host memory, "
                                           f"above the pool's limit of {self.memory_limit_bytes / 2**30:.1f} GiB "
                                           "(WorkerPool(memory_limit_bytes=...)); the worker was killed.",
                                    compiled=compiled)
                continue
            if remaining <= 0 or not worker.conn.poll(0):
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
                payload.setdefault("timing", {})["sandbox"] = self.sandbox_text(worker)
                return payload

    def _start(self, slot: int) -> _Worker:
        private = self._private_dir if self.sandbox and self.sandbox_fallback is None else None
        return _Worker(self.devices[slot], private)

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


def sandbox_wanted(asked: bool | None) -> bool:
    """``asked``, or (None) on unless STITCHCUDA_SANDBOX is 0/off/false/no."""
    if asked is not None:
        return bool(asked)
    return os.environ.get("STITCHCUDA_SANDBOX", "1").strip().lower() not in ("0", "off", "false", "no")


def default_memory_limit() -> int:
    """Half of the machine's memory, and at least 8 GiB (torch and a CUDA context take 2-4 GiB)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    return max(8 << 30, total // 2)


def _group_rss(pgid: int) -> int:
    """Resident bytes of every process of the group ``pgid`` (the worker's: its launcher leads it, and the
    candidate's children stay in it or, in a session of their own, die with the worker's namespace)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 21 and int(fields[2]) == pgid:
            total += int(fields[21]) * page  # rss, in pages
    return total


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
