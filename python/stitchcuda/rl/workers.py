"""The reward pool: scoring workers, each a thread that owns one isolated Verifier process, fed from one
bounded queue with per-item deadlines, a result cache and counters. The HTTP service (rl/service.py) and
the Ray pool (rl/ray_pool.py) are this pool with another front or other workers; results are the same.

A worker is a ``Slot``: ``run(item) -> outcome`` never raises, ``state()`` says what it is doing. A
``LocalSlot`` owns a one-process ``verify.WorkerPool`` on its device, so a candidate that crashes, hangs
or leaks memory costs that process (the WorkerPool kills and replaces it), never the pool or its thread.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..errors import InvalidArgumentError, StitchError, UnavailableError
from ..log import redact
from .score import MODES, RewardConfig, score_completion

__all__ = ["RewardItem", "Slot", "LocalSlot", "RewardPool", "Rejected", "resolve_mode", "run_item",
           "local_devices", "MODES", "Ticket", "MAX_DEADLINE_S"]

MAX_COMPLETION_CHARS = 1 << 20  # the Verifier reads at most 1 MiB of candidate source
DEFAULT_DEADLINE_S = 600.0
MAX_DEADLINE_S = 86400.0  # a day: beyond it a deadline means "never", which a queue cannot promise
DEFAULT_QUEUE_PER_WORKER = 64
DEFAULT_CACHE_SIZE = 4096
LATENCY_WINDOW = 2048  # jobs whose latencies the percentiles are taken over


class Rejected(StitchError):
    """The pool refused a batch: ``kind`` is "queue-full" (try again after ``retry_after_s``), "draining"
    (the pool is shutting down) or "too-large" (the batch can never fit: split it)."""

    code = "Unavailable"

    def __init__(self, kind: str, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message, transient=kind != "too-large")
        self.kind = kind
        self.retry_after_s = retry_after_s


# ---- items ------------------------------------------------------------------------------------------


@dataclass
class RewardItem:
    """One completion to score: the arguments of ``rl.score_completion``. ``task`` is a task id of the
    shipped sets, a dataset row mapping (task_id, reference, ...) or a ``verify.Task``; ``completion``
    the reply text or chat messages; ``config`` a ``rl.RewardConfig``, a dict of its fields, or None
    (score_completion's default)."""

    task: Any
    completion: Any
    skill: int = 1
    previous: Any = None
    feedback: str = ""
    mode: str = "auto"
    config: Any = None
    asks: list[str] | None = None

    FIELDS = ("task", "completion", "skill", "previous", "feedback", "mode", "config", "asks")

    @classmethod
    def from_json(cls, data: Any, where: str = "item", config: Any = None, mode: str = "auto") -> "RewardItem":
        """An item from its JSON form, checked; ``config`` and ``mode`` are the defaults for an item that
        names none. Raises InvalidArgumentError naming the field and the fix."""
        if not isinstance(data, Mapping):
            raise InvalidArgumentError(f"{where} must be an object with task and completion, got {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.FIELDS))
        if unknown:
            raise InvalidArgumentError(f"{where} has unknown field(s) {', '.join(unknown)}; known: "
                                       f"{', '.join(cls.FIELDS)}")
        task = data.get("task")
        if not (isinstance(task, str) and task.strip()) and not isinstance(task, Mapping):
            raise InvalidArgumentError(f"{where}.task must be a task id (a string such as \"corpus/row_softmax\") or "
                                       f"a dataset row (an object with task_id and reference), got {type(task).__name__}")
        completion = data.get("completion")
        if not isinstance(completion, (str, list, Mapping)):
            raise InvalidArgumentError(f"{where}.completion must be the reply (a string) or chat messages (a list of "
                                       f"{{role, content}}), got {type(completion).__name__}")
        skill = data.get("skill", 1)
        if isinstance(skill, bool) or skill not in (1, 2):
            raise InvalidArgumentError(f"{where}.skill must be 1 (from the plan) or 2 (from feedback), got {skill!r:.40}")
        feedback = data.get("feedback") or ""
        if not isinstance(feedback, str):
            raise InvalidArgumentError(f"{where}.feedback must be a string, got {type(feedback).__name__}")
        asks = data.get("asks")
        if asks is not None and (not isinstance(asks, list) or not all(isinstance(a, str) for a in asks)):
            raise InvalidArgumentError(f"{where}.asks must be a list of strings")
        raw = data.get("config")
        if raw is not None:
            config = RewardConfig.of(raw, f"{where}.config")
        item = cls(task=dict(task) if isinstance(task, Mapping) else task, completion=completion, skill=skill,
                   previous=data.get("previous"), feedback=feedback, mode=data.get("mode", mode), config=config,
                   asks=asks)
        item.check(where)
        return item

    def to_json(self) -> dict[str, Any]:
        """The JSON form (what RewardClient sends); a verify.Task cannot travel: pass its id or row."""
        if not isinstance(self.task, (str, Mapping)):
            raise InvalidArgumentError("a verify.Task cannot be sent to the reward service: give the task id or the "
                                       "dataset row (task_id, reference) instead")
        out: dict[str, Any] = {"task": self.task, "completion": self.completion, "skill": self.skill,
                               "mode": self.mode}
        if self.previous is not None:
            out["previous"] = self.previous
        if self.feedback:
            out["feedback"] = self.feedback
        if self.asks is not None:
            out["asks"] = list(self.asks)
        if self.config is not None:
            out["config"] = self.config.to_dict() if hasattr(self.config, "to_dict") else dict(self.config)
        return out

    def check(self, where: str = "item") -> None:
        size = len(self.completion) if isinstance(self.completion, str) else len(_canonical(self.completion))
        if size > MAX_COMPLETION_CHARS:
            raise InvalidArgumentError(f"{where}.completion has {size} characters, more than the "
                                       f"{MAX_COMPLETION_CHARS} the Verifier reads")
        if self.mode not in MODES:
            raise InvalidArgumentError(f"{where}.mode must be one of {', '.join(MODES)}, got {self.mode!r:.40}")
        if isinstance(self.skill, bool) or self.skill not in (1, 2):
            raise InvalidArgumentError(f"{where}.skill must be 1 (from the plan) or 2 (from feedback), "
                                       f"got {self.skill!r:.40}")
        if self.config is not None:
            self.config = RewardConfig.of(self.config, f"{where}.config")

    @property
    def task_id(self) -> str:
        """The task's name for logs, metrics and errors."""
        if isinstance(self.task, str):
            return self.task
        if isinstance(self.task, Mapping):
            return str(self.task.get("task_id") or self.task.get("name") or "<row>")
        return str(getattr(self.task, "name", "<task>"))

    def key(self, mode: str) -> str:
        """The cache key: the task, the candidate's hash, the Verifier config, and what else the score
        reads (skill, previous candidate, feedback, the mode it runs in)."""
        h = hashlib.sha256()
        completion = self.completion if isinstance(self.completion, str) else _canonical(self.completion)
        for part in (_task_identity(self.task), _digest(completion), _config_identity(self.config), str(self.skill),
                     _digest(_canonical(self.previous)), _digest(self.feedback), _canonical(self.asks), mode):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def _task_identity(task: Any) -> str:
    if isinstance(task, str):
        return "id:" + task
    if isinstance(task, Mapping):
        return "row:" + _digest(_canonical(task))
    key = getattr(task, "key", None)  # verify.Task: hash of its source or pickled model
    return f"task:{getattr(task, 'name', '')}:{key if isinstance(key, str) else id(task)}"


def _config_identity(config: Any) -> str:
    if config is None:
        return "default"
    data = config.to_dict() if hasattr(config, "to_dict") else config
    return _canonical(data)


def resolve_mode(mode: str, device: str) -> str:
    """What "auto" means on a worker of ``device``: the full check on a GPU, static checks elsewhere."""
    if mode == "auto":
        return "gpu" if device.startswith("cuda") else "static"
    if mode == "gpu" and not device.startswith("cuda"):
        raise InvalidArgumentError("mode 'gpu' needs a GPU worker and this pool has CPU workers only: ask for "
                                   "mode 'static' (or 'auto'), or run the pool on a machine with a GPU")
    return mode


# ---- one scoring -------------------------------------------------------------------------------------


def _killed_from_outside(raw: Mapping[str, Any] | None) -> str | None:
    """Why the worker was lost for reasons outside the candidate's report, or None. The pool reports a
    timeout, an out-of-memory and the candidate's own crash (SIGSEGV, SIGABRT, an exit) as such; a
    SIGKILL it did not send (the kernel's OOM killer, an operator) or a worker that never started is
    not the candidate's result, so the item is tried again on a fresh process."""
    if not raw:
        return None
    error = raw.get("error") or {}
    if error.get("kind") != "crash":
        return None
    message = str(error.get("message", ""))
    if "SIGKILL" in message or "signal 9" in message or "did not start" in message or "could not start" in message \
            or "died while starting" in message:
        return message
    return None


def run_item(item: RewardItem, pool: Any, device: str, retries: int = 1) -> dict[str, Any]:
    """Scores ``item`` with ``rl.score_completion`` on ``pool`` (a one-process ``_RecordingPool``). Never
    raises: returns {"result": Scored.to_dict(), ...} or {"error": {"kind", "message"}, ...}, with the
    resolved mode, the attempts and, when it was retried, why."""
    try:
        mode = resolve_mode(item.mode, device)
    except InvalidArgumentError as exc:
        return {"error": {"kind": "bad-item", "message": str(exc)}, "attempts": 0}
    causes: list[str] = []
    attempts = 0
    while True:
        attempts += 1
        pool.last_raw = None
        try:
            scored = score_completion(item.task, item.completion, skill=item.skill, previous=item.previous,
                           feedback=item.feedback, mode=mode, config=item.config, pool=pool, asks=item.asks)
        except (InvalidArgumentError, LookupError) as exc:  # the caller's task or options, said as such
            return {"error": {"kind": "bad-item", "message": str(exc)}, "attempts": attempts, "mode": mode}
        except UnavailableError as exc:
            return {"error": {"kind": "unavailable", "message": str(exc)}, "attempts": attempts, "mode": mode}
        except Exception as exc:  # noqa: BLE001 - the pool reports, it does not die
            return {"error": {"kind": "internal", "message": redact(f"{type(exc).__name__}: {exc}")},
                    "attempts": attempts, "mode": mode}
        cause = _killed_from_outside(pool.last_raw)
        if cause is None:
            out: dict[str, Any] = {"result": scored.to_dict(), "attempts": attempts, "mode": mode}
            if causes:
                out["retried_because"] = causes
            return out
        causes.append(cause)
        if attempts > retries:
            return {"error": {"kind": "worker-lost",
                              "message": f"the verification worker was lost on each of {attempts} attempts "
                                         f"(last: {cause}); not scored"},
                    "attempts": attempts, "mode": mode, "retried_because": causes}


def item_phases(outcome: Mapping[str, Any], raw: Mapping[str, Any] | None) -> dict[str, float]:
    """Where a scored item's time went: the Verifier's phases (verify.pool.PHASE_NAMES, from the pool's raw
    result of the last attempt) and "caller", the rest of score_completion's time in this process (reading
    the reply, the source rules, the rubric's scorecard)."""
    phases = dict(((raw or {}).get("timing") or {}).get("phases_s") or {})
    wall = (outcome.get("result") or {}).get("wall_s")
    if isinstance(wall, (int, float)):
        phases["caller"] = round(max(0.0, wall - sum(phases.values())), 4)
    return phases


def local_devices() -> list[str]:
    """Every visible GPU as "cuda:i", or ["cpu"] where there is none."""
    try:
        from .. import _C

        count = _C.device_count()
    except Exception:  # noqa: BLE001 - no native module, no GPU
        count = 0
    return [f"cuda:{i}" for i in range(count)] or ["cpu"]


# ---- workers ------------------------------------------------------------------------------------------


class Slot:
    """One scoring worker the pool dispatches to, one item at a time."""

    name: str = "worker"
    device: str = "cpu"

    def run(self, item: RewardItem) -> dict[str, Any]:  # pragma: no cover - interface
        raise NotImplementedError

    def warm(self) -> None:
        """Starts the worker ahead of the first item (optional)."""

    def state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def _recording_pool_class():
    from ..verify import WorkerPool

    class _RecordingPool(WorkerPool):
        """A one-process WorkerPool that keeps the raw result of its last job, so the slot can tell a
        worker killed from outside from the candidate's own failure."""

        last_raw: dict[str, Any] | None = None

        def run(self, job, compile_limit_s, run_limit_s):
            result = super().run(job, compile_limit_s, run_limit_s)
            self.last_raw = result
            return result

    return _RecordingPool


# A problem and a candidate that start a worker process without scoring anything (warm-up).
_WARM_PROBLEM = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x + 1


def get_inputs():
    return [torch.rand(8)]
"""
_WARM_CANDIDATE = """import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return x + 1
"""


class LocalSlot(Slot):
    """A worker of this machine: one isolated, time-limited Verifier process on ``device`` ("cuda:i" or
    "cpu"), started lazily (or by ``warm``) and replaced by its WorkerPool after a crash, hang or leak."""

    def __init__(self, device: str, name: str | None = None, *, retries: int = 1, sandbox: bool | None = None,
                 memory_limit_bytes: int | None = None, references: Any = None) -> None:
        self.device = device
        self.name = name or device
        self.retries = retries
        self._pool = _recording_pool_class()(devices=[device], sandbox=sandbox, memory_limit_bytes=memory_limit_bytes)
        if references is not None:  # a verify.judge.ReferenceCache shared with other slots
            self._pool.references = references
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The worker process's id (its sandbox launcher's: killing it ends the worker), None when none runs."""
        return self._pool.pids[0]

    def run(self, item: RewardItem) -> dict[str, Any]:
        with self._lock:  # one item at a time per process
            out = run_item(item, self._pool, self.device, self.retries)
            out["worker_pid"] = self.pid
            phases = item_phases(out, self._pool.last_raw)
            if phases:
                out["phases_s"] = phases
            return out

    def warm(self) -> None:
        from ..verify import VerifyConfig, check

        with self._lock:
            check(_WARM_PROBLEM, _WARM_CANDIDATE, static_only=True, pool=self._pool,
                  config=VerifyConfig(compile_time_limit_s=120, run_time_limit_s=60))

    def state(self) -> dict[str, Any]:
        return {"pid": self.pid, "replacements": self._pool.replacements, "sandbox": self._pool.sandbox,
                "memory_limit_gib": round(self._pool.memory_limit_bytes / 2**30, 2)}

    def close(self) -> None:
        self._pool.close()


# ---- the pool -----------------------------------------------------------------------------------------


class _Job:
    """One distinct item in the queue or running; every identical item submitted meanwhile waits on it."""

    __slots__ = ("item", "key", "mode", "enqueued", "deadline", "done", "outcome", "started", "worker", "waiters")

    def __init__(self, item: RewardItem, key: str, mode: str, deadline: float) -> None:
        self.item, self.key, self.mode = item, key, mode
        self.enqueued = time.monotonic()
        self.deadline = deadline
        self.done = threading.Event()
        self.outcome: dict[str, Any] | None = None
        self.started: float | None = None
        self.worker: str | None = None
        self.waiters = 1


class Ticket:
    """What ``RewardPool.submit`` gives back for one item: ``result()`` waits up to the item's deadline."""

    def __init__(self, pool: "RewardPool", item: RewardItem, deadline: float, job: _Job | None = None,
                 cached: dict[str, Any] | None = None) -> None:
        self._pool, self.item, self.deadline, self._job, self._cached = pool, item, deadline, job, cached
        self.submitted = time.monotonic()

    def result(self) -> dict[str, Any]:
        """The item's reply: Scored.to_dict() plus "service" (cached, worker, attempts, queue_s, run_s, mode),
        or {"task_id", "error": {"kind", "message"}, "service"}."""
        if self._cached is not None:
            return self._pool._reply(self.item, self._cached, cached=True)
        job = self._job
        assert job is not None
        if not job.done.wait(max(0.0, self.deadline - time.monotonic())):
            return self._pool._deadline_reply(self, job)
        return self._pool._reply(self.item, job.outcome or {}, cached=False, job=job)


class RewardPool:
    """Scoring workers behind one bounded queue: ``workers_per_device`` isolated Verifier processes on each
    of ``devices`` (default every visible GPU, or the CPU), or the given ``slots`` (RayRewardPool's actors).

    ``queue_size``: items waiting (not counting running ones, cache hits and duplicates of queued
    items; default 64 per worker); a batch that does not fit is refused whole with
    ``Rejected("queue-full")`` and a retry-after estimate, never partly accepted or dropped.
    ``deadline_s``: the default time an item may take from submission to reply; past it the item's reply
    is a "deadline" error (a queued item is then never started; a running one finishes and its result is
    cached). ``cache_size``: results kept, keyed by (task, candidate hash, config, skill, previous,
    feedback, mode); identical items in flight share one job. ``retries``: a worker killed from outside
    while scoring (SIGKILL it did not ask for) is replaced and the item tried again this many times.
    ``warm``: start every worker process now, not with its first item.
    """

    def __init__(self, devices: Sequence[str] | None = None, workers_per_device: int = 1, *,
                 slots: Sequence[Slot] | None = None, queue_size: int | None = None,
                 deadline_s: float = DEFAULT_DEADLINE_S, cache_size: int = DEFAULT_CACHE_SIZE, retries: int = 1,
                 sandbox: bool | None = None, memory_limit_bytes: int | None = None, warm: bool = True) -> None:
        self.owns_slots = slots is None  # the pool closes the workers it made; given ones are the giver's
        if slots is None:
            slots = self._local_slots(devices, workers_per_device, retries, sandbox, memory_limit_bytes)
        if not slots:
            raise InvalidArgumentError("RewardPool needs at least one worker")
        if not 0 < deadline_s <= MAX_DEADLINE_S:
            raise InvalidArgumentError(f"RewardPool: deadline_s must be above 0 and at most {MAX_DEADLINE_S:g} s, "
                                       f"got {deadline_s}")
        self.slots = list(slots)
        self.queue_size = int(queue_size if queue_size is not None else DEFAULT_QUEUE_PER_WORKER * len(self.slots))
        if self.queue_size < 1:
            raise InvalidArgumentError(f"RewardPool: queue_size must be at least 1, got {self.queue_size}")
        self.deadline_s = float(deadline_s)
        self.cache_size = max(0, int(cache_size))
        self.device = self.slots[0].device
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._pending: dict[str, _Job] = {}  # queued or running, by key
        self._cache: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._draining = False
        self._closed = False
        self.started = time.time()
        self._counts = collections.Counter()
        self._rejected = collections.Counter()
        self._latency: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=LATENCY_WINDOW)
        self._run_s = collections.deque(maxlen=64)  # recent run times, for the retry-after estimate
        self._states = [{"state": "starting" if warm else "idle", "jobs": 0, "failures": 0, "current": None,
                         "last_error": None} for _ in self.slots]
        self._threads = [threading.Thread(target=self._dispatch, args=(i, warm), daemon=True,
                                          name=f"stitchcuda-reward-{slot.name}") for i, slot in enumerate(self.slots)]
        for t in self._threads:
            t.start()

    @staticmethod
    def _local_slots(devices: Sequence[str] | None, workers_per_device: int, retries: int, sandbox: bool | None,
                     memory_limit_bytes: int | None) -> list[Slot]:
        if isinstance(workers_per_device, bool) or not isinstance(workers_per_device, int) \
                or workers_per_device < 1:
            raise InvalidArgumentError(f"workers_per_device must be an integer >= 1, got {workers_per_device!r}")
        devices = list(devices or local_devices())
        for d in devices:
            if not (d == "cpu" or d.startswith("cuda")):
                raise InvalidArgumentError(f"device {d!r}: use 'cpu' or 'cuda:N'")
        if len({d.startswith("cuda") for d in devices}) > 1:
            raise InvalidArgumentError(f"devices {devices} mix GPUs and the CPU: a pool scores in one mode, so "
                                       "give GPUs only or 'cpu' only")
        # One cache of the judge's reference runs for every worker: a task's reference (its outputs, and its
        # baselines timed with torch.compile) is run once for the pool, not once per worker.
        from ..verify.judge import ReferenceCache

        references = ReferenceCache()
        return [LocalSlot(d, f"{d}#{k}" if workers_per_device > 1 else d, retries=retries, sandbox=sandbox,
                          memory_limit_bytes=memory_limit_bytes, references=references)
                for d in devices for k in range(workers_per_device)]

    # -- submitting ----------------------------------------------------------------------------------

    def resolve_mode(self, mode: str) -> str:
        return resolve_mode(mode, self.device)

    def submit(self, items: Iterable[RewardItem | Mapping[str, Any]], deadline_s: float | None = None) -> list[Ticket]:
        """Queues ``items`` (RewardItem or their JSON mappings) as one batch; all are accepted or none
        (``Rejected``). Bad items raise InvalidArgumentError before anything is queued."""
        items = [it if isinstance(it, RewardItem) else RewardItem.from_json(it, f"items[{i}]")
                 for i, it in enumerate(items)]
        deadline_s = self.deadline_s if deadline_s is None else float(deadline_s)
        if not 0 < deadline_s <= MAX_DEADLINE_S:  # also NaN
            raise InvalidArgumentError(f"deadline_s must be a number of seconds above 0 and at most {MAX_DEADLINE_S:g}, "
                                       f"got {deadline_s!r}")
        modes = []
        for i, it in enumerate(items):
            it.check(f"items[{i}]")
            try:
                modes.append(self.resolve_mode(it.mode))
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"items[{i}]: {exc}") from None
        deadline = time.monotonic() + deadline_s
        with self._cond:
            if self._closed or self._draining:
                self._rejected["draining"] += len(items)
                raise Rejected("draining", "the reward pool is draining (shutting down): it finishes the items it "
                                           "accepted and takes no new ones; send them to another instance")
            keys = [it.key(m) for it, m in zip(items, modes)]
            new = {k for k in keys if k not in self._cache and k not in self._pending}
            if len(new) > self.queue_size:
                self._rejected["too-large"] += len(items)
                raise Rejected("too-large", f"the batch needs {len(new)} queue places and the queue holds "
                                            f"{self.queue_size} in all: split it into batches of at most "
                                            f"{self.queue_size} items")
            if len(self._queue) + len(new) > self.queue_size:
                self._rejected["queue-full"] += len(items)
                wait = self._retry_after()
                raise Rejected("queue-full", f"the queue is full: {len(self._queue)} of {self.queue_size} places "
                                             f"taken and the batch needs {len(new)}; retry in about {wait:.0f} s "
                                             "or send smaller batches", retry_after_s=wait)
            tickets = []
            for it, key, mode in zip(items, keys, modes):
                self._counts["items"] += 1
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    self._counts["cache_hits"] += 1
                    tickets.append(Ticket(self, it, deadline, cached=hit))
                    continue
                job = self._pending.get(key)
                if job is not None:
                    job.waiters += 1
                    job.deadline = max(job.deadline, deadline)
                    self._counts["coalesced"] += 1
                else:
                    self._counts["cache_misses"] += 1
                    job = self._pending[key] = _Job(it, key, mode, deadline)
                    self._queue.append(job)
                tickets.append(Ticket(self, it, deadline, job=job))
            self._counts["batches"] += 1
            self._cond.notify_all()
        return tickets

    def score(self, items: Iterable[RewardItem | Mapping[str, Any]], deadline_s: float | None = None) -> list[dict]:
        """Scores a batch and waits for every reply (see ``Ticket.result``), in the order given."""
        return [t.result() for t in self.submit(items, deadline_s)]

    def _retry_after(self) -> float:
        per_item = (sum(self._run_s) / len(self._run_s)) if self._run_s else 5.0
        return max(1.0, len(self._queue) * per_item / max(1, len(self.slots)))

    # -- replies -------------------------------------------------------------------------------------

    def _reply(self, item: RewardItem, outcome: Mapping[str, Any], cached: bool, job: _Job | None = None) -> dict:
        service = {"cached": cached, "mode": outcome.get("mode"), "attempts": 0 if cached else outcome.get("attempts"),
                   "worker": None if cached else (job.worker if job else None)}
        if job is not None and job.started is not None:
            service["queue_s"] = round(job.started - job.enqueued, 4)
            service["run_s"] = round(outcome.get("run_s", 0.0), 4)
            if outcome.get("phases_s"):
                service["phases_s"] = outcome["phases_s"]
        if outcome.get("retried_because") and not cached:
            service["retried_because"] = outcome["retried_because"]
        if "result" in outcome:
            return {**outcome["result"], "service": service}
        return {"task_id": item.task_id, "error": dict(outcome.get("error") or {"kind": "internal",
                                                                                  "message": "no outcome"}),
                "service": service}

    def _deadline_reply(self, ticket: Ticket, job: _Job) -> dict:
        waited = time.monotonic() - ticket.submitted
        with self._cond:
            self._counts["deadline_exceeded"] += 1
            running = job.started is not None
        if running:
            message = (f"the deadline of {ticket.deadline - ticket.submitted:.1f} s passed while worker {job.worker} "
                       f"was verifying the candidate (running for {time.monotonic() - job.started:.1f} s); it "
                       "finishes and its result is cached: send the same item again to get it")
        else:
            message = (f"the deadline of {ticket.deadline - ticket.submitted:.1f} s passed while the item waited in "
                       f"the queue ({waited:.1f} s, {len(self._queue)} items queued); it was not scored: send it "
                       "again with a longer deadline_s, or add workers")
        return {"task_id": ticket.item.task_id, "error": {"kind": "deadline", "message": message},
                "service": {"cached": False, "worker": job.worker, "running": running}}

    # -- workers -------------------------------------------------------------------------------------

    def _dispatch(self, index: int, warm: bool) -> None:
        slot, state = self.slots[index], self._states[index]
        if warm:
            try:
                slot.warm()
            except Exception as exc:  # noqa: BLE001 - a worker that cannot start says so in its state
                state["last_error"] = f"warm-up failed: {type(exc).__name__}: {exc}"
            with self._cond:
                state["state"] = "idle"
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    state["state"] = "closed"
                    return
                job = self._queue.popleft()
                now = time.monotonic()
                if now >= job.deadline:  # every waiter has given up: never start it
                    self._pending.pop(job.key, None)
                    self._counts["expired"] += 1
                    job.outcome = {"error": {"kind": "deadline", "message": "expired in the queue"}}
                    job.done.set()
                    self._cond.notify_all()
                    continue
                job.started, job.worker = now, slot.name
                state["state"], state["current"] = "busy", {"task_id": job.item.task_id, "since": now}
            t0 = time.monotonic()
            try:
                outcome = slot.run(job.item)
            except Exception as exc:  # noqa: BLE001 - a slot's bug must not stop its thread
                outcome = {"error": {"kind": "internal", "message": f"{type(exc).__name__}: {exc}"}}
            run_s = time.monotonic() - t0
            outcome["run_s"] = run_s
            with self._cond:
                job.outcome = outcome
                self._pending.pop(job.key, None)
                state["jobs"] += 1
                state["state"], state["current"] = "idle", None
                if "result" in outcome:
                    self._counts["done"] += 1
                    if self.cache_size:
                        self._cache[job.key] = outcome
                        while len(self._cache) > self.cache_size:
                            self._cache.popitem(last=False)
                else:
                    self._counts["failed"] += 1
                    state["failures"] += 1
                    state["last_error"] = outcome["error"].get("message")
                if outcome.get("retried_because"):
                    self._counts["retries"] += len(outcome["retried_because"])
                self._run_s.append(run_s)
                self._latency.append((job.started - job.enqueued, run_s, time.monotonic() - job.enqueued))
                job.done.set()
                self._cond.notify_all()

    # -- state ---------------------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    def ready_workers(self) -> int:
        with self._cond:
            return sum(1 for s in self._states if s["state"] in ("idle", "busy"))

    def metrics(self) -> dict[str, Any]:
        """Queue depth, in flight, done, rejected (by reason), cache, latency percentiles, per-worker state."""
        now = time.monotonic()
        with self._cond:
            queued = len(self._queue)
            in_flight = sum(1 for s in self._states if s["state"] == "busy")
            workers = []
            for slot, s in zip(self.slots, self._states):
                current = s["current"]
                workers.append({"name": slot.name, "device": slot.device, "state": s["state"], "jobs": s["jobs"],
                                "failures": s["failures"], "last_error": s["last_error"],
                                "current": {"task_id": current["task_id"], "running_s": round(now - current["since"], 3)}
                                if current else None})
            latency = list(self._latency)
            counts, rejected = dict(self._counts), dict(self._rejected)
            cache_len = len(self._cache)
        for entry, slot in zip(workers, self.slots):
            try:
                entry.update(slot.state())
            except Exception as exc:  # noqa: BLE001 - metrics must answer
                entry["state_error"] = f"{type(exc).__name__}: {exc}"
        hits, misses = counts.get("cache_hits", 0), counts.get("cache_misses", 0)
        return {
            "uptime_s": round(time.time() - self.started, 1), "draining": self._draining, "device": self.device,
            "queue_depth": queued, "queue_size": self.queue_size, "in_flight": in_flight,
            "items": counts.get("items", 0), "batches": counts.get("batches", 0),
            "done": counts.get("done", 0), "failed": counts.get("failed", 0),
            "deadline_exceeded": counts.get("deadline_exceeded", 0), "expired_in_queue": counts.get("expired", 0),
            "retries": counts.get("retries", 0),
            "rejected": sum(rejected.values()), "rejected_by_reason": rejected,
            "cache": {"hits": hits, "misses": misses, "coalesced": counts.get("coalesced", 0), "size": cache_len,
                      "capacity": self.cache_size, "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0},
            "latency_s": {name: _percentiles([x[i] for x in latency]) for i, name in enumerate(("queue", "run", "total"))},
            "workers": workers,
        }

    # -- shutting down -------------------------------------------------------------------------------

    def drain(self, timeout_s: float | None = None) -> bool:
        """Refuses new items and waits until every accepted one is finished (True) or ``timeout_s`` passed."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._draining = True
            while self._queue or self._pending:
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 1.0)
        return True

    def close(self) -> None:
        """Stops the workers (items still queued are answered with a "closed" error) and their processes."""
        with self._cond:
            if self._closed:
                return
            self._closed = self._draining = True
            while self._queue:
                job = self._queue.popleft()
                self._pending.pop(job.key, None)
                job.outcome = {"error": {"kind": "closed", "message": "the reward pool closed before the item ran"}}
                job.done.set()
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        for slot in self.slots if self.owns_slots else ():
            try:
                slot.close()
            except Exception:  # noqa: BLE001 - closing the rest matters more
                pass

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "count": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "count": len(ordered)}
