"""Limits the kernel holds, where the caller's cgroup v2 is delegated to it: each worker's launcher moves into
a cgroup of its own (memory.max above the pool's limit, pids.max), so a candidate's child in a session of its
own cannot pass them even between the pool's reads of /proc. Where no cgroup v2 is delegated (this development
machine has a v1 hierarchy) the worker says why and the PID-namespace accounting is the limit; the test of
the kernel's limits skips there with that reason."""

from __future__ import annotations

import os
import textwrap

import pytest

from stitchcuda.verify import VerifyConfig, WorkerPool, check
from stitchcuda.verify import sandbox

PARENT, REASON = sandbox.cgroup_parent()

REFERENCE = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x):
            return x * 2

    def get_inputs():
        return [torch.rand(16)]
''')
HONEST = "import torch.nn as nn\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x + x\n"
# A child in a session of its own (out of the worker's process group) takes 3 GiB as fast as it can.
HOG = textwrap.dedent('''
    import os, time
    if os.fork() == 0:
        os.setsid()
        blocks = []
        for _ in range(3 * 64):
            blocks.append(bytearray(16 << 20))
        time.sleep(30)
        os._exit(0)
    time.sleep(20)
''') + HONEST
CONFIG = VerifyConfig(device="cpu", timing_iters=0, compile_time_limit_s=60, run_time_limit_s=60)


def test_the_worker_says_whether_a_cgroup_holds_it_and_why_not():
    with WorkerPool(devices=["cpu"]) as pool:
        report = check(REFERENCE, HONEST, config=CONFIG, pool=pool)
        state = pool.sandbox_state
    assert report.correct, report.feedback
    if state is None or not state.get("enabled") or not state.get("user_namespace"):
        pytest.skip(f"no sandboxed worker here: {report.timing.get('sandbox')}")
    if PARENT is None:
        assert state["cgroup"] is None and state["cgroup_reason"] == REASON
        assert "cgroup" not in report.timing["sandbox"]
    else:
        assert state["cgroup"].startswith(PARENT + "/" + sandbox.CGROUP_PREFIX)
        assert "cgroup memory and task limits" in report.timing["sandbox"]


@pytest.mark.skipif(PARENT is None, reason=f"no delegated cgroup v2 here ({REASON}); the worker's memory is summed "
                                           "over its PID namespace by the pool instead (sandbox.namespace_rss)")
def test_the_kernel_holds_a_workers_memory_and_tasks():
    limit = 1 << 30
    with WorkerPool(devices=["cpu"], memory_limit_bytes=limit) as pool:
        assert check(REFERENCE, HONEST, config=CONFIG, pool=pool).correct
        folder = pool.sandbox_state["cgroup"]
        with open(os.path.join(folder, "memory.max")) as f:
            assert int(f.read()) == int(limit * sandbox.CGROUP_MEMORY_MARGIN)
        with open(os.path.join(folder, "pids.max")) as f:
            assert int(f.read()) == sandbox.CGROUP_TASKS
        with open(os.path.join(folder, "cgroup.procs")) as f:
            assert f.read().split()  # the worker's processes are in it
        report = check(REFERENCE, HOG, config=CONFIG, pool=pool)
        # The pool's poller reports an oom, or the kernel killed the child at the cgroup's limit first (then
        # the worker itself may live on): either way the 3 GiB were never held.
        with open(os.path.join(folder, "memory.events")) as f:
            events = dict(line.split() for line in f.read().splitlines())
        assert (report.error or {}).get("kind") == "oom" or int(events.get("oom_kill", 0)) >= 1, (report.feedback,
                                                                                                   events)
        if os.path.exists(os.path.join(folder, "memory.peak")):
            with open(os.path.join(folder, "memory.peak")) as f:
                assert int(f.read()) <= int(limit * sandbox.CGROUP_MEMORY_MARGIN)
        assert check(REFERENCE, HONEST, config=CONFIG, pool=pool).correct  # and the pool goes on


def test_a_cgroup_is_used_only_where_its_parent_is_delegated(tmp_path):
    """cgroup_parent's reading of the hierarchy, on a folder laid out as cgroupfs lays it out (the kernel's
    own behaviour is the test above's, where there is one)."""
    root, membership = tmp_path / "cg", tmp_path / "membership"
    assert sandbox.cgroup_parent(str(root), str(membership))[1].endswith("(a v1 or hybrid hierarchy)")
    (root / "user" / "session").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "user" / "cgroup.procs").write_text("")
    membership.write_text("0::/\n")
    assert "root of its cgroup v2 hierarchy" in sandbox.cgroup_parent(str(root), str(membership))[1]
    membership.write_text("0::/user/session\n")
    (root / "user" / "session" / "cgroup.controllers").write_text("cpu memory\n")
    assert "not given the pids controller" in sandbox.cgroup_parent(str(root), str(membership))[1]
    (root / "user" / "session" / "cgroup.controllers").write_text("cpu memory pids\n")
    assert sandbox.cgroup_parent(str(root), str(membership)) == (str(root / "user"), "")
    state: dict = {}
    stale = root / "user" / f"{sandbox.CGROUP_PREFIX}999999999"  # a launcher long gone: removed
    stale.mkdir()
    sandbox._cgroup(state, 1 << 30, root=str(root), membership=str(membership))
    mine = root / "user" / f"{sandbox.CGROUP_PREFIX}{os.getpid()}"
    assert state["cgroup"] == str(mine) and not stale.exists()
    assert (mine / "memory.max").read_text() == str(int((1 << 30) * sandbox.CGROUP_MEMORY_MARGIN))
    assert (mine / "pids.max").read_text() == str(sandbox.CGROUP_TASKS)
    assert (mine / "cgroup.procs").read_text() == str(os.getpid())
    if os.getuid() != 0:  # root writes anywhere: the permission check means nothing for it
        (root / "user").chmod(0o555)
        try:
            assert "not delegated" in sandbox.cgroup_parent(str(root), str(membership))[1]
        finally:
            (root / "user").chmod(0o755)
