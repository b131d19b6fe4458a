"""The reward service on the CPU (static mode: NVRTC compile + static rules): a real HTTP server on
127.0.0.1 in front of real isolated Verifier workers, scoring the Verifier corpus's honest and hacked
candidates. Concurrency (equal to score_completion called directly), deadlines, back-pressure at 10x the
queue, a worker killed mid-job, the cache, SIGTERM drain of `stitchcuda serve reward`, the client's errors.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from stitchcuda.errors import InvalidArgumentError, UnavailableError
from stitchcuda.rl import score_completion
from stitchcuda.rl.service import RewardClient, RewardService, prometheus_text
from stitchcuda.rl.workers import RewardItem, RewardPool

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "corpus"
TASK = "corpus/row_softmax"


def reply(source: str) -> str:
    return f"Here is the kernel.\n\n```python\n{source.rstrip()}\n```\n"


def corpus(problem: str = "row_softmax") -> list[tuple[str, str]]:
    """(file name, reply) of the corpus's candidates for `problem`, honest and hacked."""
    out = []
    for folder in ("honest", "hacks"):
        for path in sorted((CORPUS / folder).glob("*.py")):
            text = path.read_text()
            if re.match(rf"# corpus: \w+ problem={problem}\b", text):
                out.append((f"{folder}/{path.name}", reply(text)))
    return out


HONEST = (CORPUS / "honest" / "softmax_block_reduce.py").read_text()
RUN = time.time_ns()  # in slow candidates: never a kernel-cache hit from an earlier run


def variant(n: int, source: str = HONEST) -> str:
    """The honest softmax with a comment in its CUDA: a new candidate (new hash, new NVRTC compile)."""
    return reply(source.replace("__global__", f"/* variant {n} */ __global__", 1))


def slow(loops: int, tag: str) -> str:
    """The honest softmax plus a second kernel whose full unrolling keeps NVRTC busy for about a second per
    loop on this machine: a candidate whose static check takes long, deterministically."""
    body = "\n".join(f"#pragma unroll\n  for (int k = 0; k < 2000; ++k) a = a * 0.999f + __sinf(a + k * {j + 1});"
                     for j in range(loops))
    extra = (f'\nTABLES = r"""\n// {tag} {RUN}\nextern "C" __global__ void tables(float* x, int n) {{\n'
             f'  int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i >= n) return;\n  float a = x[i];\n'
             f'  {body}\n  x[i] = a;\n}}\n"""\n_tables = jit.compile(TABLES, "tables")\n')
    marker = '_softmax = jit.compile(SOURCE, "softmax_rows")\n'
    return reply(HONEST.replace(marker, marker + extra))


def without_run_fields(d: dict) -> dict:
    """A reply as comparable across processes: no service fields or wall time, and findings (and the
    feedback's lines) in a fixed order — the static rules list two findings on one line in an order that
    varies with the process's string hashing."""
    d = dict(d)
    d.pop("service", None)
    d.pop("wall_s", None)
    d["findings"] = sorted(d.get("findings", []), key=lambda f: json.dumps(f, sort_keys=True))
    d["feedback"] = sorted(d.get("feedback", "").splitlines())
    return d


def post(url: str, body, timeout: float = 120.0):
    """(status, headers, JSON body) of a raw POST (no client retries)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def get(url: str, timeout: float = 10.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_for(predicate, timeout: float, what: str, step: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def service():
    """Two CPU workers, the default queue."""
    with RewardService(RewardPool(["cpu"], 2, deadline_s=300), port=0) as s:
        wait_for(lambda: s.pool.ready_workers() == 2, 120, "two warm workers")
        yield s


@pytest.fixture(scope="module")
def small():
    """One CPU worker and a queue of 4 items."""
    with RewardService(RewardPool(["cpu"], 1, queue_size=4, deadline_s=300), port=0) as s:
        wait_for(lambda: s.pool.ready_workers() == 1, 120, "a warm worker")
        yield s


def test_parallel_clients_get_what_score_completion_gives(service):
    candidates = corpus()
    assert len(candidates) >= 8  # honest and hacked
    client = RewardClient(service.url)
    items = [{"task": TASK, "completion": text, "mode": "static"} for _, text in candidates]
    replies: dict[int, dict] = {}
    errors = []

    def one(i: int) -> None:
        try:
            replies[i] = client.score([items[i]])[0]
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(replies) == len(items)
    workers = {replies[i]["service"]["worker"] for i in replies if not replies[i]["service"]["cached"]}
    assert workers == {"cpu#0", "cpu#1"}  # both workers scored
    hacks_caught = 0
    for i, (name, text) in enumerate(candidates):
        direct = score_completion(TASK, text, mode="static").to_dict()
        assert without_run_fields(replies[i]) == without_run_fields(direct), name
        hacks_caught += name.startswith("hacks/") and replies[i]["parts"]["hack"] == 1.0
        if name.startswith("honest/"):
            assert replies[i]["score"] > 0 and replies[i]["parts"]["compiled"] == 1.0, (name, replies[i]["reason"])
    assert hacks_caught >= 3  # the static hacks of this problem score 0 with their rule


def test_second_identical_item_is_a_cache_hit(service):
    client = RewardClient(service.url)
    item = {"task": TASK, "completion": variant(1001), "mode": "static"}
    before = client.metrics()["cache"]
    first = client.score([item])[0]
    second = client.score([item])[0]
    after = client.metrics()["cache"]
    assert first["service"]["cached"] is False and second["service"]["cached"] is True
    assert without_run_fields(first) == without_run_fields(second)
    assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"] + 1
    # Another config is another key: not a hit.
    third = client.score([{**item, "config": {"tau": 0.5}}])[0]
    assert third["service"]["cached"] is False and third["score"] != first["score"]


def test_metrics_and_health(service):
    status, health = get(service.url + "/health")
    assert status == 200 and health["status"] == "ok" and health["ready_workers"] == 2
    status, m = get(service.url + "/metrics")
    assert status == 200
    for key in ("queue_depth", "in_flight", "done", "rejected", "cache", "latency_s", "workers"):
        assert key in m
    assert m["done"] >= 1 and m["latency_s"]["run"]["p50"] is not None
    assert [w["name"] for w in m["workers"]] == ["cpu#0", "cpu#1"]
    assert all(w["pid"] and w["state"] in ("idle", "busy") for w in m["workers"])
    text = prometheus_text(m)
    assert f"stitchcuda_reward_done_total {m['done']}" in text


def test_bad_requests_say_what_is_wrong(service):
    status, _, body = post(service.url + "/score", {"items": [{"task": TASK}]})
    assert status == 400 and "items[0].completion" in body["error"]["message"]
    status, _, body = post(service.url + "/score", {"items": [{"task": TASK, "completion": "x", "mode": "gpu"}]})
    assert status == 400 and "mode 'gpu' needs a GPU" in body["error"]["message"]
    status, _, body = post(service.url + "/score", {"items": [{"task": TASK, "completion": "x", "sklil": 2}]})
    assert status == 400 and "sklil" in body["error"]["message"]
    status, _, body = post(service.url + "/nowhere", {})
    assert status == 404 and "/score" in body["error"]["message"]
    with pytest.raises(InvalidArgumentError, match="deadline_s"):
        RewardClient(service.url).score([{"task": TASK, "completion": "x"}], deadline_s=-1)
    # An unknown task is the item's error, not the batch's.
    good, bad = RewardClient(service.url).score([{"task": TASK, "completion": variant(1002), "mode": "static"},
                                                  {"task": "corpus/no_such_problem", "completion": "x"}])
    assert "score" in good and bad["error"]["kind"] == "bad-item" and "no_such_problem" in bad["error"]["message"]


def test_openrlhf_route_answers_as_the_trainers_function(service):
    from stitchcuda.rl.trainers import openrlhf_reply

    prompt = "<|user|>Write ModelNew for the row softmax problem.<|assistant|>"
    candidates = corpus()[:3]
    body = {"query": [prompt + text for _, text in candidates], "prompts": [prompt] * len(candidates),
            "labels": [TASK] * len(candidates)}
    status, _, served = post(service.url + "/openrlhf", body)
    assert status == 200, served
    direct = openrlhf_reply(body, mode="static")
    assert served["rewards"] == direct["rewards"] and served["scores"] == direct["scores"]
    assert served["extra_logs"] == direct["extra_logs"]
    assert len(served["reasons"]) == len(candidates)
    status, _, bad = post(service.url + "/openrlhf", {"query": ["a", "b"], "prompts": ["a"], "labels": [TASK] * 2})
    assert status == 400 and "one length" in bad["error"]["message"]


def test_the_trainers_functions_score_on_the_service(service):
    # TRL's, verl's and OpenRLHF's functions with service=URL: one request per batch, the same scores
    # the in-process reward gives; an item the service cannot score is None for TRL (no signal), never 0.
    from stitchcuda.rl import TRLReward, find_task, skill1_rows, trainers

    rows = skill1_rows([find_task(TASK)], docs=False) * 3
    replies = [variant(901), "no code here", variant(901)]  # the duplicate goes once
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    before = service.pool.metrics()["batches"]
    remote = TRLReward(mode="static", service=service.url)(prompts=["p"] * 3, completions=replies, **columns)
    assert service.pool.metrics()["batches"] == before + 1
    local = TRLReward(mode="static")(prompts=["p"] * 3, completions=replies, **columns)
    assert remote == local and remote[0] > 0 and remote[1] == 0.0
    verl = trainers.verl_rows(rows)
    batch = trainers.compute_score(data_sources=[v["data_source"] for v in verl], solution_strs=replies,
                                   ground_truths=[v["reward_model"]["ground_truth"] for v in verl],
                                   extra_infos=[v["extra_info"] for v in verl], mode="static", service=service.url)
    assert [b["score"] for b in batch] == local and batch[1]["reason"].startswith("no code")
    labels = [r["label"] for r in trainers.openrlhf_rows(rows)]
    prompt = "<|user|>Write ModelNew.<|assistant|>"
    out = trainers.reward_func([prompt + r for r in replies], [prompt] * 3, labels, mode="static", service=service.url)
    assert out["rewards"] == local
    # A deadline the service cannot meet: not a score of 0 (which would train the model), None.
    late = TRLReward(mode="static", service=service.url, deadline_s=0.001)
    assert late(prompts=["p"], completions=[slow(2, "trainer deadline")], **{k: v[:1] for k, v in columns.items()}) \
        == [None]
    with pytest.raises(InvalidArgumentError, match="not both"):
        TRLReward(service=service.url, pool=object())


def test_rows_come_from_the_services_sources_unless_inline_rows_are_allowed(service, tmp_path):
    from stitchcuda.rl import find_task
    from stitchcuda.rl.service import source_references

    shipped = find_task(TASK)
    row = {"task_id": TASK, "reference": shipped["reference"]}
    mine = shipped["reference"].replace("dim = 8192", "dim = 4096")
    own = {"task_id": "mine/softmax", "reference": mine}
    completion = variant(6001)
    assert not service.allow_rows and not service.sources  # the default, whatever the host
    status, _, body = post(service.url + "/score", {"items": [{"task": own, "completion": completion}]})
    assert status == 403 and body["error"]["kind"] == "row-refused", body
    assert "items[0].task" in body["error"]["message"] and "--allow-rows" in body["error"]["message"]
    with pytest.raises(InvalidArgumentError, match="not one of this service's sources"):
        RewardClient(service.url).score([{"task": own, "completion": completion}])
    status, _, body = post(service.url + "/score", {"items": [{"task": row, "completion": completion}]})
    assert status == 200 and body["results"][0]["task_id"] == TASK  # a shipped task's own row is its id
    # OpenRLHF's labels carry rows too: the same rule.
    status, _, body = post(service.url + "/openrlhf", {"query": [completion], "prompts": [""],
                                                       "labels": [json.dumps(own)]})
    assert status == 403 and body["error"]["kind"] == "row-refused", body
    # A configured source: the folder's problem file, matched by its text.
    (tmp_path / "softmax_4096.py").write_text(mine)
    service.sources = source_references([tmp_path])
    try:
        status, _, body = post(service.url + "/score", {"items": [{"task": own, "completion": completion,
                                                                   "mode": "static"}]})
        assert status == 200 and body["results"][0]["task_id"] == "mine/softmax" and body["results"][0]["score"] > 0
        other = dict(own, reference=mine + "\n# one more line\n")
        assert post(service.url + "/score", {"items": [{"task": other, "completion": completion}]})[0] == 403
    finally:
        service.sources = frozenset()
    service.allow_rows = True  # --allow-rows
    try:
        by_row = RewardClient(service.url).score([{"task": own, "completion": variant(6002), "mode": "static"}])[0]
    finally:
        service.allow_rows = False
    assert by_row["task_id"] == "mine/softmax" and by_row["score"] > 0
    with pytest.raises(InvalidArgumentError, match="not a folder"):
        source_references([tmp_path / "missing"])


def test_task_folders_are_read_bounded(tmp_path):
    """--tasks DIR reads its files as the other entries do: a FIFO named like a problem never blocks the
    service's start, a file that is not UTF-8 is named."""
    from stitchcuda.rl.service import source_references

    fifo = tmp_path / "fifo" / "problem.py"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="not a regular file"):
        source_references([fifo.parent])
    assert time.monotonic() - started < 5
    latin = tmp_path / "latin" / "problem.py"
    latin.parent.mkdir()
    latin.write_bytes(b"# caf\xe9\nclass Model: pass\n")
    with pytest.raises(InvalidArgumentError, match=r"--tasks .*latin.*problem\.py.*utf-8"):
        source_references([latin.parent])


def test_client_says_when_no_service_listens():
    with pytest.raises(UnavailableError, match="not reachable"):
        RewardClient("http://127.0.0.1:9").health()
    with pytest.raises(InvalidArgumentError, match="URL"):
        RewardClient("127.0.0.1:8750")


def test_deadline_while_running_then_the_cached_result(small):
    client = RewardClient(small.url)
    item = {"task": TASK, "completion": slow(2, "deadline-running"), "mode": "static"}
    late = client.score([item], deadline_s=0.3)[0]
    assert late["error"]["kind"] == "deadline"
    assert "while worker cpu was verifying" in late["error"]["message"] and "cached" in late["error"]["message"]
    wait_for(lambda: client.metrics()["in_flight"] == 0, 120, "the slow item to finish")
    again = client.score([item], deadline_s=5)[0]
    assert again["service"]["cached"] is True and again["score"] > 0


def test_deadline_while_queued(small):
    client = RewardClient(small.url)
    before = client.metrics()
    first: list = []
    t = threading.Thread(target=lambda: first.extend(
        client.score([{"task": TASK, "completion": slow(2, "deadline-queued"), "mode": "static"}], deadline_s=120)))
    t.start()
    wait_for(lambda: client.metrics()["in_flight"] == 1, 30, "the slow item to start")
    queued = client.score([{"task": TASK, "completion": variant(2001), "mode": "static"}], deadline_s=0.2)[0]
    assert queued["error"]["kind"] == "deadline"
    assert "waited in the queue" in queued["error"]["message"] and "not scored" in queued["error"]["message"]
    t.join(120)
    assert first and "score" in first[0]
    after = wait_for(lambda: (m := client.metrics())["queue_depth"] == 0 and m, 30, "the queue to empty")
    assert after["expired_in_queue"] == before["expired_in_queue"] + 1  # never started
    assert after["deadline_exceeded"] == before["deadline_exceeded"] + 1


def test_back_pressure_at_ten_times_capacity(small):
    capacity = small.pool.queue_size + len(small.pool.slots)  # waiting + running
    requests = 10 * capacity
    before = get(small.url + "/metrics")[1]
    start = threading.Barrier(requests + 1)
    answers: list = [None] * requests

    def one(i: int) -> None:
        body = {"items": [{"task": TASK, "completion": slow(1, f"pressure {i}"), "mode": "static"}], "deadline_s": 300}
        start.wait()
        answers[i] = post(small.url + "/score", body, timeout=300)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for t in threads:
        t.start()
    start.wait()
    # The service keeps answering while its queue is full.
    time.sleep(0.3)
    t0 = time.monotonic()
    status, health = get(small.url + "/health")
    assert status == 200 and health["status"] == "ok" and time.monotonic() - t0 < 2.0
    for t in threads:
        t.join(300)
    assert all(a is not None for a in answers)  # every request was answered
    accepted = [a for a in answers if a[0] == 200]
    rejected = [a for a in answers if a[0] != 200]
    assert len(accepted) + len(rejected) == requests
    assert rejected and len(accepted) >= small.pool.queue_size
    for status, headers, body in rejected:
        assert status == 429, body
        assert body["error"]["kind"] == "queue-full" and "queue is full" in body["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
    for _, _, body in accepted:
        assert "score" in body["results"][0], body  # accepted means scored, none dropped
    after = get(small.url + "/metrics")[1]
    assert after["rejected_by_reason"].get("queue-full", 0) - before["rejected_by_reason"].get("queue-full", 0) \
        == len(rejected)
    assert after["done"] - before["done"] == len(accepted)


def test_a_worker_killed_mid_job_costs_the_worker_not_the_service(small):
    client = RewardClient(small.url)
    before = client.metrics()
    items = [{"task": TASK, "completion": variant(3001), "mode": "static"},
             {"task": TASK, "completion": slow(3, "killed"), "mode": "static"},
             {"task": TASK, "completion": variant(3002), "mode": "static"}]
    replies: list = []
    t = threading.Thread(target=lambda: replies.extend(client.score(items, deadline_s=300)))
    t.start()

    def busy_with_the_slow_one():
        m = client.metrics()
        w = m["workers"][0]
        return m["done"] >= before["done"] + 1 and w["state"] == "busy" and w["current"]["running_s"] > 0.3 and w["pid"]

    pid = wait_for(busy_with_the_slow_one, 60, "the worker to be busy with the slow item")
    os.kill(pid, signal.SIGKILL)
    assert get(small.url + "/health")[0] == 200  # the service answers meanwhile
    t.join(300)
    assert len(replies) == 3 and all("score" in r for r in replies), replies
    killed = replies[1]
    assert killed["service"]["attempts"] == 2 and "SIGKILL" in killed["service"]["retried_because"][0]
    for item, r in zip(items, replies):  # results, the retried one included, are the direct ones
        assert without_run_fields(r) == without_run_fields(score_completion(TASK, item["completion"], mode="static").to_dict())
    after = client.metrics()
    assert after["retries"] == before["retries"] + 1
    assert after["workers"][0]["replacements"] == before["workers"][0]["replacements"] + 1
    assert after["workers"][0]["pid"] != pid
    # The finished results were kept: all three are cache hits now.
    assert all(r["service"]["cached"] for r in client.score(items))


def test_sigterm_drains_the_command(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "stitchcuda", "serve", "reward", "--port", "0", "--devices", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    try:
        first = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", first)
        assert url, first
        url = url.group(0)
        wait_for(lambda: get(url + "/health")[1]["status"] == "ok", 120, "the service's worker")
        answer: list = []
        t = threading.Thread(target=lambda: answer.append(post(url + "/score", {"items": [
            {"task": TASK, "completion": slow(3, "drain"), "mode": "static"}]})))
        t.start()
        wait_for(lambda: get(url + "/metrics")[1]["in_flight"] == 1, 30, "the request to be running")
        proc.send_signal(signal.SIGTERM)
        # Once the signal is handled, health says so and new items are refused with the reason.
        def draining():
            status, health = get(url + "/health")
            return status == 503 and health["status"] == "draining"

        wait_for(draining, 10, "health to say draining")
        status, _, body = post(url + "/score", {"items": [{"task": TASK, "completion": variant(4001), "mode": "static"}]})
        assert status == 503 and body["error"]["kind"] == "draining"
        t.join(120)
        assert answer and answer[0][0] == 200 and "score" in answer[0][2]["results"][0]
        assert proc.wait(60) == 0
        out = proc.stdout.read()
        assert "draining" in out and "stopped: 1 scored" in out, out
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        print("serve reward said:\n" + proc.stdout.read())
        raise


def exiting_row(marker: Path) -> dict:
    """A dataset row whose reference writes its process id to `marker` and calls os._exit(0) while its inputs
    are read; its get_inputs() builds its list (no literal to count), so reading the input count runs it."""
    reference = textwrap.dedent(f'''
        import os
        import pathlib

        import torch
        import torch.nn as nn


        class Model(nn.Module):
            def forward(self, x):
                return torch.softmax(x, dim=-1)


        def get_inputs():
            pathlib.Path({str(marker)!r}).write_text(str(os.getpid()))
            os._exit(0)
            return list(torch.randn(1, 4, 8192))
    ''')
    return {"task_id": "attack/exit_while_inputs_are_read", "reference": reference}


def test_a_row_that_exits_reaches_no_service_process_and_sigterm_drains(tmp_path):
    """`serve reward --allow-rows` as a user runs it: a row whose reference calls os._exit(0) while its inputs
    are read is answered and a good batch after it too (the reference never ran in the service); a client
    that sends half a body holds nothing: SIGTERM with nothing accepted pending exits 0 at once."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "stitchcuda", "serve", "reward", "--port", "0", "--devices", "cpu",
                             "--allow-rows"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=tmp_path)
    marker = tmp_path / "reference-ran"
    try:
        first = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:(\d+)", first)
        assert url, first
        port, url = int(url.group(1)), url.group(0)
        wait_for(lambda: get(url + "/health")[1]["status"] == "ok", 120, "the service's worker")
        status, _, bad = post(url + "/score", {"items": [{"task": exiting_row(marker), "completion": variant(7001),
                                                          "mode": "static"}]})
        assert status == 200 and ("score" in bad["results"][0] or bad["results"][0]["error"]["message"]), bad
        assert not marker.exists() or int(marker.read_text()) != proc.pid  # never in the service's process
        status, _, good = post(url + "/score", {"items": [{"task": TASK, "completion": variant(7002), "mode": "static"}]})
        assert status == 200 and good["results"][0]["score"] > 0 and proc.poll() is None
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n"
                     b"\r\n{\"items\": [")
        wait_for(lambda: get(url + "/metrics")[1]["in_flight"] == 0, 10, "nothing running")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert time.monotonic() - started < 8  # the half-sent request was not waited for
        half.close()
        out = proc.stdout.read()
        assert "stopped: 2 scored" in out and "drain timed out" not in out, out
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        print("serve reward said:\n" + proc.stdout.read())
        raise


def raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """What the server answers to `data` sent as is, until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1."), answer[:200]
    return int(answer.split(b" ", 2)[1])


def test_bad_input_gets_a_4xx_with_its_reason(service):
    port = service.address[1]
    item = {"task": TASK, "completion": variant(8001), "mode": "static"}
    status, _, body = post(service.url + "/score", {"items": [item], "deadline_s": 1e300})
    assert status == 400 and "deadline_s" in body["error"]["message"] and "86400" in body["error"]["message"]
    for depth in (100, 100000):  # beyond the service's limit, and beyond the JSON parser's recursion
        data = ("[" * depth + "]" * depth).encode()
        answer = raw(port, b"POST /score HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: "
                     + str(len(data)).encode() + b"\r\n\r\n" + data)
        assert status_of(answer) == 400 and b"nested more than 64 levels" in answer, answer[-300:]
    for length in (b"abc", b"-5", b"1e9"):
        answer = raw(port, b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n{}")
        assert status_of(answer) == 400 and b"Content-Length must be a number" in answer, answer
    data = json.dumps({"items": [dict(item, completion="\ud800 " + item["completion"])]}).encode()
    assert b"\\ud800" in data  # JSON's escape of a lone surrogate
    status, _, body = post(service.url + "/score", json.loads(data))
    assert status == 400 and "items[0].completion" in body["error"]["message"] and "surrogate" in body["error"]["message"]
    # In Python, a lone surrogate is scored (as "?"), never a TypeError from the C++ reader.
    scored = score_completion(TASK, "\ud800" + item["completion"], mode="static")
    assert scored.score > 0 and scored.code
    assert get(service.url + "/health")[0] == 200  # and the service lives on


def test_slow_clients_time_out_and_cannot_grow_threads():
    with RewardService(RewardPool(["cpu"], 1, warm=False), port=0, read_timeout_s=1.0, max_connections=4) as s:
        port = s.address[1]
        before = threading.active_count()
        held = []
        for i in range(12):  # half a request line each: a slow client's connections
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"POST /sco")
            held.append(sock)
        time.sleep(0.3)
        assert threading.active_count() <= before + 4 and s.server.open_connections <= 4
        answers = []
        for sock in held:  # the four served time out after 1 s of silence; the rest were told 503 at once
            chunks = []
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                chunks.append(chunk)
            answers.append(b"".join(chunks))
            sock.close()
        busy = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert len(busy) == 8 and all(b"Retry-After: 1" in a for a in busy), answers
        assert all(not a or a.startswith(b"HTTP/1.1 408") for a in answers if a not in busy), answers
        wait_for(lambda: s.server.open_connections == 0, 5, "the slow connections to close")
        wait_for(lambda: threading.active_count() <= before, 5, "their threads to end")
        # Half a body: 408 with the reason, after read_timeout_s.
        answer = raw(port, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"items\"")
        assert status_of(answer) == 408 and b"stopped arriving" in answer, answer
        assert get(s.url + "/health")[0] in (200, 503)


def test_pool_api_without_http():
    """The same pool in Python: RewardItem objects, results equal to the direct call, then close."""
    with RewardPool(["cpu"], 1, warm=False) as pool:
        item = RewardItem(TASK, variant(5001), mode="static")
        (r,) = pool.score([item])
        assert without_run_fields(r) == without_run_fields(score_completion(TASK, item.completion, mode="static").to_dict())
        assert r["service"]["worker"] == "cpu" and r["service"]["mode"] == "static"
        with pytest.raises(InvalidArgumentError, match="skill"):
            pool.submit([RewardItem(TASK, "x", skill=3)])


@pytest.mark.gpu
def test_gpu_workers_verify():
    """On a GPU the service verifies (trials, timing, the dynamic rules): an honest candidate is correct and
    earns a reward, a dynamic hack the static rules miss is caught by running it."""
    honest = reply(HONEST)
    hack = reply((CORPUS / "hacks" / "uniform_softmax_kernel.py").read_text())
    with RewardService(RewardPool(["cuda:0"], 1, deadline_s=600), port=0) as s:
        good, bad = RewardClient(s.url).score([{"task": TASK, "completion": honest},
                                               {"task": TASK, "completion": hack}])
    assert good["verified"] is True and good["mode"] == "gpu" and good["parts"]["correct"] == 1.0, good["reason"]
    assert good["score"] > 0 and good["service"]["worker"] == "cuda:0"
    assert bad["verified"] is True and bad["score"] == 0.0 and bad["reason"], bad


@pytest.mark.gpu
def test_gpu_a_rows_reference_runs_in_the_sandboxed_worker_only(tmp_path):
    """On a GPU a row's reference must run for the check: in the Verifier's worker, never in the service. One
    that exits while its inputs are read costs that worker; its item is answered with the reason, and the
    next batch is scored."""
    marker = tmp_path / "reference-ran"
    with RewardService(RewardPool(["cuda:0"], 1, deadline_s=600), port=0, allow_rows=True) as s:
        bad = RewardClient(s.url).score([{"task": exiting_row(marker), "completion": reply(HONEST)}])[0]
        good = RewardClient(s.url).score([{"task": TASK, "completion": reply(HONEST)}])[0]
    why = bad.get("reason") or bad.get("error", {}).get("message")
    assert bad.get("score", 0.0) == 0.0 and why, bad
    assert not marker.exists() or int(marker.read_text()) != os.getpid()
    assert good["verified"] is True and good["score"] > 0, good
