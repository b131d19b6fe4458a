"""The reward pool as Ray actors, on a local Ray cluster this test starts (two CPUs, CPU actors, static
checks): the same replies as score_completion called directly and as the local pool, through the Python
API and through `serve reward --ray`'s pool behind the HTTP service. A GPU machine gets one GPU actor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (the project's dev group installs it)")

from stitchcuda.rl import score_completion  # noqa: E402
from stitchcuda.rl.ray_pool import RayRewardPool  # noqa: E402
from stitchcuda.rl.service import RewardClient, RewardService, build_pool, register  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "corpus"
TASK = "corpus/row_softmax"


def reply(path: Path) -> str:
    return f"```python\n{path.read_text().rstrip()}\n```\n"


ITEMS = [{"task": TASK, "completion": reply(CORPUS / "honest" / "softmax_block_reduce.py"), "mode": "static"},
         {"task": TASK, "completion": reply(CORPUS / "honest" / "softmax_online_warp.py"), "mode": "static"},
         {"task": TASK, "completion": reply(CORPUS / "hacks" / "torch_softmax_scratch_kernel.py"), "mode": "static"},
         {"task": TASK, "completion": reply(CORPUS / "hacks" / "uniform_softmax_kernel.py"), "mode": "static"}]


def comparable(d: dict) -> dict:
    d = {k: v for k, v in d.items() if k not in ("service", "wall_s")}
    d["findings"] = sorted(d["findings"], key=lambda f: json.dumps(f, sort_keys=True))
    d["feedback"] = sorted(d["feedback"].splitlines())
    return d


@pytest.fixture(scope="module")
def cluster():
    python = str(ROOT / "python")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (python, os.environ.get("PYTHONPATH"))
                                                                      if p)}})
    yield ray.cluster_resources()
    ray.shutdown()


@pytest.fixture(scope="module")
def direct():
    return [score_completion(it["task"], it["completion"], mode="static").to_dict() for it in ITEMS]


def test_ray_actors_score_as_the_local_pool(cluster, direct):
    gpus = int(cluster.get("GPU", 0))
    with RayRewardPool(cpu_workers=2, deadline_s=300) as pool:
        assert pool.started_ray is False  # it joined the cluster this process started
        replies = pool.score(ITEMS)
        assert [comparable(r) for r in replies] == [comparable(d) for d in direct]
        assert {r["service"]["worker"] for r in replies} <= {s.name for s in pool.slots}
        m = pool.metrics()
        assert len(m["workers"]) == (gpus or 2)
        busy = [w for w in m["workers"] if w["jobs"]]
        assert busy and all(w["node_id"] and w["actor_pid"] and w["pid"] for w in busy)
        assert all(w["name"].startswith("ray-gpu-" if gpus else "ray-cpu-") for w in m["workers"])
        again = pool.score(ITEMS[:1])[0]
        assert again["service"]["cached"] is True and m["cache"]["misses"] == len(ITEMS)


def test_serve_reward_with_ray_answers_over_http(cluster, direct):
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "reward", "--ray", "auto", "--devices", "cpu", "--port", "0"])
    pool = build_pool(args)
    assert type(pool).__name__ == "RayRewardPool"
    with RewardService(pool, port=0) as service:
        client = RewardClient(service.url)
        replies = client.score(ITEMS[:2], deadline_s=300)
        assert [comparable(r) for r in replies] == [comparable(d) for d in direct[:2]]
        health = client.health()
        assert health["status"] == "ok" and health["workers"] == len(pool.slots)
        # An actor that dies (its process, or its node) is replaced and the item tried again.
        ray.kill(pool.slots[0].actor)
        (again,) = client.score(ITEMS[2:3], deadline_s=300)
        assert comparable(again) == comparable(direct[2])
        assert "Ray actor ray-" in again["service"]["retried_because"][0]
        assert client.metrics()["workers"][0]["actor_restarts"] == 1


@pytest.mark.gpu
def test_one_gpu_actor_per_gpu_verifies(cluster):
    with RayRewardPool(deadline_s=600) as pool:
        assert len(pool.slots) == int(cluster["GPU"]) and pool.device.startswith("cuda")
        (r,) = pool.score([{**ITEMS[0], "mode": "auto"}])
        assert r["verified"] is True and r["mode"] == "gpu" and r["parts"]["correct"] == 1.0, r["reason"]
