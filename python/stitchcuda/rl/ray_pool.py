"""The reward pool on a Ray cluster (``RayRewardPool``, ``stitchcuda serve reward --ray ADDRESS``): the same
queue, deadlines, cache and metrics as the local ``RewardPool``, with Ray actors as its workers — one per
GPU of the cluster, or CPU actors (static checks) where it has none. Each actor owns one isolated
Verifier process exactly as a local worker does, so a candidate that crashes, hangs or leaks costs that
process, never the actor; an actor (or its node) that dies is replaced and its item tried once more.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError, UnavailableError
from .workers import LocalSlot, RewardItem, RewardPool, Slot

__all__ = ["RayRewardPool", "RaySlot"]


def _ray():
    try:
        import ray
    except ImportError:
        raise UnavailableError("RayRewardPool needs Ray: install it with `pip install ray` (or the project's "
                               "optional group: `pip install '.[ray]'` in a StitchCUDA clone, or `pip install ray`)") from None
    return ray


class _ScoreActor:
    """Runs in a Ray worker process: one LocalSlot (one isolated Verifier process) on the actor's device."""

    def __init__(self, device: str, name: str, retries: int, sandbox: bool | None,
                 memory_limit_bytes: int | None) -> None:
        self.slot = LocalSlot(device, name, retries=retries, sandbox=sandbox, memory_limit_bytes=memory_limit_bytes)

    def warm(self) -> dict[str, Any]:
        self.slot.warm()
        return self.where()

    def run(self, item: RewardItem) -> dict[str, Any]:
        out = self.slot.run(item)
        out["where"] = self.where()
        return out

    def where(self) -> dict[str, Any]:
        import socket

        import ray

        return {"host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(),
                "actor_pid": os.getpid(), **self.slot.state()}

    def close(self) -> None:
        self.slot.close()


class RaySlot(Slot):
    """A pool worker that is a Ray actor. ``state()`` answers from what the actor last said (never blocks)."""

    def __init__(self, actor_class: Any, options: dict[str, Any], device: str, name: str, args: tuple) -> None:
        self._actor_class, self._options, self._args = actor_class, options, args
        self.device, self.name = device, name
        self.actor = self._new_actor()
        self.restarts = 0
        self._where: dict[str, Any] = {}

    def _new_actor(self) -> Any:
        return self._actor_class.options(**self._options).remote(*self._args)

    def warm(self) -> None:
        ray = _ray()
        self._where = ray.get(self.actor.warm.remote())

    def run(self, item: RewardItem) -> dict[str, Any]:
        ray = _ray()
        causes = []
        for _attempt in range(2):
            try:
                out = ray.get(self.actor.run.remote(item))
            except ray.exceptions.RayActorError as exc:  # the actor's process or its node died
                causes.append(f"Ray actor {self.name} died: {str(exc).splitlines()[0][:300]}")
                self.restarts += 1
                self.actor = self._new_actor()
                continue
            except ray.exceptions.RayError as exc:
                return {"error": {"kind": "internal", "message": f"{type(exc).__name__}: {str(exc)[:2000]}"}}
            self._where = out.pop("where", self._where)
            if causes:
                out["retried_because"] = causes + list(out.get("retried_because", []))
            return out
        return {"error": {"kind": "worker-lost", "message": "; ".join(causes) + " (twice): not scored"},
                "retried_because": causes}

    def state(self) -> dict[str, Any]:
        return {**self._where, "actor_restarts": self.restarts}

    def close(self) -> None:
        ray = _ray()
        try:
            ray.get(self.actor.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - the actor may be gone already
            pass
        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001
            pass


class RayRewardPool(RewardPool):
    """A RewardPool whose workers are Ray actors: ``workers_per_gpu`` per GPU of the cluster (each asks
    Ray for 1/workers_per_gpu of a GPU), or, on a cluster without GPUs, ``cpu_workers`` CPU actors
    (default one per node) that score in static mode.

    ``address``: None starts a local cluster (``init_options`` go to ``ray.init``, e.g. num_cpus=2);
    "auto" joins the cluster of `ray start`; "ray://host:10001" connects as a client. When Ray is already
    initialized in this process the pool uses that. Other options are RewardPool's (queue_size,
    deadline_s, cache_size, retries, sandbox, memory_limit_bytes, warm).
    """

    def __init__(self, address: str | None = None, *, workers_per_gpu: int = 1, cpu_workers: int | None = None,
                 init_options: dict[str, Any] | None = None, retries: int = 1, sandbox: bool | None = None,
                 memory_limit_bytes: int | None = None, **options: Any) -> None:
        ray = _ray()
        if isinstance(workers_per_gpu, bool) or not isinstance(workers_per_gpu, int) or workers_per_gpu < 1:
            raise InvalidArgumentError(f"workers_per_gpu must be an integer >= 1, got {workers_per_gpu!r}")
        if cpu_workers is not None and (isinstance(cpu_workers, bool) or not isinstance(cpu_workers, int)
                                        or cpu_workers < 1):
            raise InvalidArgumentError(f"cpu_workers must be an integer >= 1 or None, got {cpu_workers!r}")
        self.started_ray = False
        if not ray.is_initialized():
            init = dict(init_options or {})
            if address is None:
                # A local cluster's workers import this StitchCUDA, wherever this process found it.
                package_parent = str(Path(__file__).resolve().parents[2])
                path = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)
                init.setdefault("runtime_env", {"env_vars": {"PYTHONPATH": path}})
                init.setdefault("include_dashboard", False)
            try:
                ray.init(address=address, **init)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise UnavailableError(f"cannot reach the Ray cluster at {address!r}: {exc} (start one with "
                                       "`ray start --head`, or pass address=None for a local one)") from None
            self.started_ray = True
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        actor_class = ray.remote(_ScoreActor)
        args = (retries, sandbox, memory_limit_bytes)
        if gpus:
            count, device, kind = gpus * workers_per_gpu, "cuda:0", "gpu"  # Ray sets CUDA_VISIBLE_DEVICES per actor
            actor_options = {"num_gpus": 1.0 / workers_per_gpu, "num_cpus": 1, "max_restarts": 0}
        else:
            nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
            count, device, kind = cpu_workers or max(1, nodes), "cpu", "cpu"
            actor_options = {"num_cpus": 1, "max_restarts": 0, "scheduling_strategy": "SPREAD"}
        slots = [RaySlot(actor_class, actor_options, device, f"ray-{kind}-{i}", (device, f"ray-{kind}-{i}", *args))
                 for i in range(count)]
        super().__init__(slots=slots, retries=retries, **options)
        self.owns_slots = True
        self.cluster = {"gpus": gpus, "cpus": resources.get("CPU", 0), "actors": count}

    def close(self) -> None:
        super().close()
        if self.started_ray:
            _ray().shutdown()
