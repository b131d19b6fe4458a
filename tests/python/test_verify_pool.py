"""Isolation on the CPU: a candidate that aborts, segfaults, hangs or exhausts memory becomes a failed
report with the cause, within its time limit + 5 s, and the pool keeps working; secrets never reach
the worker's environment."""

from __future__ import annotations

import os
import secrets
import textwrap
import time

import pytest

from stitchcuda.verify import VerifyConfig, WorkerPool, check
from stitchcuda.verify.pool import is_secret, worker_environment

pytestmark = pytest.mark.slow

REFERENCE = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x):
            return x * 2

    def get_inputs():
        return [torch.rand(64, 16)]

    def get_init_inputs():
        return []
''')


def cand(forward: str = "return x + x", init: str = "pass", module: str = "") -> str:
    return ("import os, sys, time, ctypes\nimport torch\nimport torch.nn as nn\n" + module + "\n"
            "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            + textwrap.indent(init, " " * 8) + "\n\n    def forward(self, x):\n"
            + textwrap.indent(forward, " " * 8) + "\n")


HONEST = cand()
SEGFAULT = "ctypes.string_at(0)"
CONFIG = VerifyConfig(device="cpu", timing_iters=3, warmup=1, compile_time_limit_s=20, run_time_limit_s=3)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(devices=["cpu"]) as p:
        yield p


def test_honest_baseline(pool):
    r = check(REFERENCE, HONEST, config=CONFIG, pool=pool)
    assert r.correct, r.feedback


@pytest.mark.parametrize("source, kind, needle", [
    (cand(forward="os.abort()"), "crash", "SIGABRT"),
    (cand(forward=SEGFAULT), "crash", "SIGSEGV"),
    (cand(init=SEGFAULT), "crash", "SIGSEGV"),
    (cand(module="os._exit(3)"), "crash", "exit status 3"),
    (cand(forward="raise MemoryError()"), "oom", "MemoryError"),
])
def test_crashes_become_reports_and_the_pool_survives(pool, source, kind, needle):
    before = pool.replacements
    r = check(REFERENCE, source, config=CONFIG, pool=pool)
    assert r.error is not None and r.error["kind"] == kind, r.error
    assert needle in r.error["message"]
    assert not r.correct
    if kind == "crash":
        assert pool.replacements == before + 1
    assert check(REFERENCE, HONEST, config=CONFIG, pool=pool).correct


def test_crash_in_init_is_not_compiled(pool):
    r = check(REFERENCE, cand(init=SEGFAULT), config=CONFIG, pool=pool)
    assert r.error["kind"] == "crash" and not r.compiled and "loading" in r.error["message"]
    r = check(REFERENCE, cand(forward=SEGFAULT), config=CONFIG, pool=pool)
    assert r.error["kind"] == "crash" and r.compiled and "running" in r.error["message"]


@pytest.mark.parametrize("where", ["forward", "init"])
def test_hangs_time_out_within_the_limit_plus_5s(pool, where):
    config = VerifyConfig(device="cpu", timing_iters=3, warmup=1, compile_time_limit_s=3, run_time_limit_s=3)
    source = cand(forward="while True:\n    pass") if where == "forward" else cand(init="while True:\n    pass")
    # A ready worker (and the judge's reference run done): the limit counts from the job, not from a start-up.
    assert check(REFERENCE, HONEST, config=config, pool=pool).correct
    start = time.monotonic()
    r = check(REFERENCE, source, config=config, pool=pool)
    elapsed = time.monotonic() - start
    assert r.error["kind"] == "timeout" and "3 s limit" in r.error["message"]
    assert elapsed < 3 + 5
    assert check(REFERENCE, HONEST, config=CONFIG, pool=pool).correct


def test_twenty_crashes_in_a_row(pool):
    kinds = [check(REFERENCE, cand(forward="os.abort()" if i % 2 else SEGFAULT), config=CONFIG, pool=pool)
             .error["kind"] for i in range(20)]
    assert kinds == ["crash"] * 20
    assert check(REFERENCE, HONEST, config=CONFIG, pool=pool).correct


def test_worker_is_reused_between_candidates(pool):
    check(REFERENCE, HONEST, config=CONFIG, pool=pool)
    pid = pool.pids[0]
    check(REFERENCE, HONEST, config=CONFIG, pool=pool)
    assert pool.pids[0] == pid and pid is not None and pid != os.getpid()


def test_start_launches_idle_workers_without_waiting_and_the_next_job_uses_them():
    """start() (optimize() calls it before capturing the model) spawns the worker and returns while it is
    still starting; a second start() spawns nothing more, and the next job runs on the worker it made."""
    with WorkerPool(devices=["cpu"]) as p:
        assert p.pids == [None]  # workers start lazily
        p.start()
        pid = p.pids[0]
        assert pid is not None and not p._workers[0].ready  # spawned, not waited for
        p.start()
        assert p.pids == [pid]
        r = check(REFERENCE, HONEST, config=CONFIG, pool=p)
        assert r.correct, r.feedback
        assert p.pids == [pid]
    with pytest.raises(RuntimeError, match="closed"):
        p.start()


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "ANTHROPIC_API_KEY", "MY_SERVICE_TOKEN", "DB_PASSWORD",
                                  "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "GITHUB_TOKEN",
                                  "CLIENT_SECRET", "some_api_key"])
def test_secret_names(name):
    assert is_secret(name)


@pytest.mark.parametrize("name", ["PATH", "HOME", "CUDA_VISIBLE_DEVICES", "PYTHONPATH", "STITCHCUDA_CACHE_DIR",
                                  "LD_LIBRARY_PATH", "OMP_NUM_THREADS"])
def test_ordinary_names_are_kept(name):
    assert not is_secret(name)


def test_the_worker_environment_leaves_the_callers_alone(monkeypatch):
    monkeypatch.setenv("TEST_API_KEY", "sk-123")
    monkeypatch.setenv("TEST_PLAIN", "kept")
    env = worker_environment()
    assert "TEST_API_KEY" not in env and env["TEST_PLAIN"] == "kept"
    assert os.environ["TEST_API_KEY"] == "sk-123"  # the caller's own environment is never touched


def test_secrets_never_reach_the_worker(monkeypatch):
    secrets = {"OPENAI_API_KEY": "sk-test-1", "VERIFY_TEST_TOKEN": "tok-2", "AWS_SECRET_ACCESS_KEY": "aws-3",
               "DB_PASSWORD": "pw-4"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("VERIFY_TEST_PLAIN", "visible")
    spy = cand(forward=textwrap.dedent('''
        raw = open("/proc/self/environ", "rb").read().decode(errors="replace")
        leaked = [k for k in %r if k in os.environ or k in raw]
        if leaked or os.environ.get("VERIFY_TEST_PLAIN") != "visible":
            raise RuntimeError("environment: leaked=%%s plain=%%s" %% (leaked, os.environ.get("VERIFY_TEST_PLAIN")))
        return x + x''' % (sorted(secrets),)).strip())
    with WorkerPool(devices=["cpu"]) as fresh:  # started after the variables were set
        r = check(REFERENCE, spy, config=CONFIG, pool=fresh)
    assert r.error is None, r.error
    assert r.correct


def test_a_candidate_that_patches_torch_does_not_poison_the_next_one(pool):
    relu_ref = REFERENCE.replace("return x * 2", "return torch.relu(x) * 2")
    patcher = cand(init="torch.relu = lambda t: t * 0", forward="return torch.relu(x) * 2")
    before = pool.replacements
    r = check(relu_ref, patcher, config=CONFIG, pool=pool)
    assert "patches-timing" in {f.rule for f in r.findings if f.severity == "major"}
    assert pool.replacements == before + 1  # the worker that ran it is gone
    honest = cand(forward="return x.clamp(min=0) * 2")
    assert check(relu_ref, honest, config=CONFIG, pool=pool).correct


def _processes_with_argument(argument: str) -> list[int]:
    """Live (not zombie) processes of this machine whose command line holds ``argument``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if argument.encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(") ", 1)[1][0] == "Z":
                    continue
        except (OSError, IndexError):
            continue
        found.append(int(entry))
    return found


@pytest.mark.parametrize("own_session", [False, True], ids=["same-session", "own-session"])
def test_a_killed_worker_takes_the_candidates_children_along(pool, own_session):
    """A candidate that starts a process and hangs: when the worker is killed at the limit, the child goes
    with it (the worker leads its own process group; in the sandbox's PID namespace even a child that
    starts a session of its own dies with the namespace's first process)."""
    if own_session:
        check(REFERENCE, HONEST, config=CONFIG, pool=pool)
        if not (pool.sandbox_state or {}).get("pid_namespace"):
            pytest.skip("no PID namespace on this machine: a child in a session of its own escapes (docs/security.md)")
    argument = f"{300 + secrets.randbelow(10**6) / 10**7:.7f}"  # a command line no other process has
    start_child = (f"import subprocess\nchild = subprocess.Popen(['sleep', {argument!r}], "
                   f"start_new_session={own_session})\nwhile True:\n    pass")
    config = VerifyConfig(device="cpu", timing_iters=3, warmup=1, compile_time_limit_s=3, run_time_limit_s=3)
    r = check(REFERENCE, cand(init=start_child), config=config, pool=pool)
    assert r.error["kind"] == "timeout"
    deadline = time.monotonic() + 5
    while _processes_with_argument(argument) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _processes_with_argument(argument), "the candidate's child outlived the killed worker"
    assert check(REFERENCE, HONEST, config=CONFIG, pool=pool).correct


def test_host_memory_beyond_the_pools_limit_is_an_oom_report():
    """An address-space limit would break CUDA, so the pool reads the worker group's resident memory
    while a job runs and kills it above the limit: the report says so, and the next worker is fine."""
    hog = cand(init="chunks = []\nwhile True:\n    chunks.append(b'x' * (256 << 20))")
    config = VerifyConfig(device="cpu", timing_iters=3, warmup=1, compile_time_limit_s=60, run_time_limit_s=10)
    with WorkerPool(devices=["cpu"], memory_limit_bytes=2 << 30) as small:
        start = time.monotonic()
        r = check(REFERENCE, hog, config=config, pool=small)
        assert r.error["kind"] == "oom" and "above the pool's limit of 2.0 GiB" in r.error["message"], r.error
        assert time.monotonic() - start < 30
        assert check(REFERENCE, HONEST, config=CONFIG, pool=small).correct
