"""The verification worker's entry: the process a WorkerPool starts (in its sandbox) imports torch once,
then runs typed jobs (jobs.py) until told to stop. Everything it says goes back as wire.py frames, data the
judge checks: this process runs candidate code, so nothing it sends is taken on trust.
"""

from __future__ import annotations

import os
from typing import Any

from ..settings import settings
from . import jobs, wire
from .report import failure_dict

__all__ = ["main"]

# A worker that holds more than this in cached GPU blocks after a job gives them back to the driver.
IDLE_CACHE_BYTES = 1 << 30


def main(conn: Any, device: str | None) -> None:
    """Entry point of a worker process (in its sandbox already): import once, then run jobs until told to
    stop. Each job comes as (nonce, job); every message about it carries the nonce."""
    from .environment import is_secret

    # A candidate's prints (and a dying C library's messages) must not corrupt the parent's output:
    # everything the worker has to say comes back through the pipe.
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        if not settings().verify_worker_stderr:
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

        from .. import jit
        from . import harness, judge  # noqa: F401 - imported once, before the first job's limits start

        jit.confine_includes()  # candidates' CUDA may include only the toolkit's headers, from now on
        info = {"pid": os.getpid(), "device": device, "sandbox": sandboxed}
        if device and device.startswith("cuda") and torch.cuda.is_available():
            index = int(device.split(":")[1]) if ":" in device else 0
            torch.cuda.set_device(index)
            torch.zeros(1, device="cuda")  # create the context now, not inside the first job's limit
            from . import gpu  # noqa: F401 - captures the timing functions before any candidate runs
            info["gpu"] = torch.cuda.get_device_name(index)
        wire.send(conn, "ready", "", info)
    except BaseException as exc:  # noqa: BLE001 - report whatever broke the start-up
        wire.send(conn, "startup-error", "", {"message": f"{type(exc).__name__}: {exc}"[:2000]})
        return
    while True:
        try:
            message = conn.recv()  # from the judge: the trusted direction
        except (EOFError, OSError):
            return
        except Exception as exc:  # noqa: BLE001 - a job that cannot be rebuilt here (CUDA IPC refused)
            data = failure_dict("crash", f"the job could not be received ({type(exc).__name__}: {exc})")
            data["recycle"] = True
            _reply(conn, "", data)
            return
        if message is None:
            return
        nonce, job = message
        data, tensors, outputs = run(job, lambda phase: wire.send(conn, "phase", nonce, {"phase": phase}))
        # Let go of the job's tensors before waiting for the next one: tensors that came as CUDA IPC
        # handles stay allocated in the parent until this process drops them, and cached blocks of
        # several GB would stay reserved on the GPU while the worker idles.
        job = message = None
        if not data.get("recycle") and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > IDLE_CACHE_BYTES:
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - a context the job broke: the parent replaces the worker anyway
                pass
        _reply(conn, nonce, data, tensors, outputs)
        if data.get("recycle"):
            return  # the parent replaces this worker


def run(job: Any, progress: Any) -> tuple[dict[str, Any], list[Any], dict[str, Any] | None]:
    """Runs one job: (its report dict, the tensors it ships, the "outputs" of the result body or None)."""
    job = jobs.typed(job)
    fields = jobs.as_dict(job)
    if isinstance(job, jobs.StaticJob):
        from .static_compile import run_static_job

        return run_static_job(fields), [], None
    if isinstance(job, jobs.ProgramJob):
        from .program import run_program_job

        return run_program_job(fields, progress), [], None
    from .judge import encode_outputs

    shipped: dict[str, Any] = {}
    if isinstance(job, jobs.ReferenceJob):
        from .judge import run_reference_job

        data = run_reference_job(fields, progress, shipped)
    else:
        from .harness import run_job

        data = run_job(fields, progress, shipped)
    tensors: list[Any] = []
    outputs = encode_outputs(shipped, tensors)
    return data, tensors, outputs


def _reply(conn: Any, nonce: str, data: dict[str, Any], tensors: list[Any] = (), outputs: Any = None) -> None:
    body = {"report": data}
    if outputs is not None:
        body["outputs"] = outputs
    try:
        frame = wire.pack("result", nonce, body, tensors)
    except (wire.WireError, TypeError, ValueError) as exc:  # a report or outputs too large for the wire
        failed = failure_dict("crash", f"the worker's result could not be sent: {exc}")
        failed["recycle"] = bool(data.get("recycle"))
        frame = wire.pack("result", nonce, {"report": failed})
    conn.send_bytes(frame)
