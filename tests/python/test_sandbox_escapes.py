"""Ways out of the verification worker's sandbox that a hostile candidate tries:
the network, the machine's /dev, /sys and /proc/sys, root's id, a child that leaves the process group to
hold memory past the limit, and system calls the seccomp filter refuses. Each attack is written the way a
candidate would, runs in ModelNew's constructor inside a real pool worker, and the candidate is correct
only if every attempt failed; a layer this kernel cannot have is skipped with the pool's reason."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import pytest

from stitchcuda.verify import VerifyConfig, WorkerPool, check
from stitchcuda.verify.sandbox import SECCOMP_DENIED, _needed_paths, namespace_rss
from test_verify_pool import REFERENCE
from test_verify_sandbox import CONFIG, need, pool, probe, run  # noqa: F401 - pool: the module-scoped fixture

pytestmark = pytest.mark.slow


@pytest.fixture
def server():
    """A TCP server on the machine's 127.0.0.1 (where a reward service or a model server would listen) that
    records every connection it accepts."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[str] = []

    def serve() -> None:
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            accepted.append(str(peer))
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], accepted
    listener.close()


CONNECT = '''
import socket
for host in ("127.0.0.1", "localhost", "::1"):
    try:
        socket.create_connection((host, {port}), timeout=2).close()
        escaped.append(("connected", host))
    except OSError:
        pass
'''


def test_no_address_of_the_machine_is_reachable(pool, server):
    need(pool, "network_namespace")
    port, accepted = server
    run(pool, CONNECT.format(port=port))
    assert accepted == []


def test_the_network_probe_connects_without_the_sandbox(server):
    """The probe is not blind: from a worker without the sandbox the same code reaches the server."""
    port, accepted = server
    with WorkerPool(devices=["cpu"], sandbox=False) as bare:
        r = check(REFERENCE, probe(CONNECT.format(port=port)), config=CONFIG, pool=bare)
    assert "ESCAPED" in r.error["message"] and accepted


def test_the_machine_s_dev_sys_and_proc_sys_cannot_be_written(pool):
    need(pool, "minimal_dev", "read_only_sys", "read_only_proc_sys")
    run(pool, '''
        for path in ("/dev/stitchcuda-probe", "/dev/shm/../probe", "/sys/fs/cgroup/stitchcuda-probe",
                     "/sys/fs/cgroup/memory/stitchcuda-probe", "/sys/kernel/stitchcuda-probe"):
            try:
                open(path, "w").write("x")
                escaped.append(("wrote", path))
            except OSError:
                pass
        for path in ("/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches", "/proc/sysrq-trigger"):
            try:
                open(path, "w").close()
                escaped.append(("opened for writing", path))
            except OSError:
                pass
        for path in ("/sys/fs/cgroup", "/sys/fs/cgroup/memory"):
            try:
                os.mkdir(path + "/stitchcuda-probe")
                escaped.append(("made a cgroup", path))
            except OSError:
                pass
        devices = sorted(os.listdir("/dev"))
        if any(d.startswith(("vd", "sd", "nvme", "loop", "kvm", "mem", "kmsg", "port", "btrfs")) for d in devices):
            escaped.append(("machine devices", devices))
        open("/dev/null", "w").write("x")  # the minimal /dev still works
        if len(open("/dev/urandom", "rb").read(16)) != 16 or open("/dev/zero", "rb").read(4) != bytes(4):
            escaped.append("no /dev/urandom or /dev/zero")
        with open("/dev/shm/private", "w") as f:  # and so does the private /dev/shm
            f.write("ok")
    ''')
    assert not os.path.exists("/dev/stitchcuda-probe") and not os.path.exists("/sys/fs/cgroup/stitchcuda-probe")


def test_a_root_caller_s_worker_is_nobody(pool):
    """Root's id would let a candidate read root-only files and write sysctl knobs: a root caller's worker
    runs as nobody, and a folder closed to others on the way to the interpreter (/root) shows it only the
    entries that lead there."""
    if os.getuid() != 0:
        pytest.skip("the caller is not root: its workers run as its own unprivileged id")
    need(pool, "unprivileged_uid")
    home = os.path.expanduser("~root")
    leads = sorted({p[len(home) + 1:].split("/")[0] for p in _needed_paths([sys.executable])
                    if p.startswith(home + "/")})
    run(pool, f'''
        if os.getuid() == 0 or os.geteuid() == 0 or 0 in os.getgroups():
            escaped.append(("root", os.getuid(), os.getgroups()))
        import resource
        if resource.getrlimit(resource.RLIMIT_NPROC)[0] == resource.RLIM_INFINITY:
            escaped.append("no process count limit (a fork bomb)")
        try:
            escaped.append(("read /etc/shadow", open("/etc/shadow").read(20)))
        except OSError:
            pass
        try:
            seen = sorted(os.listdir({home!r}))
            if os.stat({home!r}).st_mode & 0o001 == 0 or not set(seen) <= set({leads!r}):
                escaped.append(("root's folder", seen[:8]))
        except OSError:
            pass
    ''')
    assert pool.sandbox_state["uid"] != 0


SECCOMP_PROBE = '''
import errno
libc = ctypes.CDLL(None, use_errno=True)
calls = {
    "ptrace": lambda: libc.syscall(101, 0, 0, 0, 0),  # PTRACE_TRACEME
    "unshare": lambda: libc.unshare(0x10000000),
    "mount": lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None),
    "bpf": lambda: libc.syscall(321, 0, 0, 0),
    "keyctl": lambda: libc.syscall(250, 0, 0, 0, 0, 0),
    "userfaultfd": lambda: libc.syscall(323, 0),
    "perf_event_open": lambda: libc.syscall(298, 0, 0, -1, -1, 0),
    "io_uring_setup": lambda: libc.syscall(425, 1, 0),
    "open_by_handle_at": lambda: libc.syscall(304, -100, 0, 0),
    "kexec_load": lambda: libc.syscall(246, 0, 0, 0, 0),
    "setns": lambda: libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0),
    "clone(CLONE_NEWUSER)": lambda: libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0),
}
for name, call in calls.items():
    if call() != -1 or ctypes.get_errno() != errno.EPERM:
        escaped.append((name, ctypes.get_errno()))
pid = os.fork()  # an ordinary fork still works
if pid == 0:
    os._exit(7)
if os.WEXITSTATUS(os.waitpid(pid, 0)[1]) != 7:
    escaped.append("fork broken")
'''


def test_the_seccomp_filter_refuses_what_a_worker_never_needs(pool):
    need(pool, "seccomp")
    assert {"ptrace", "mount", "unshare", "setns", "bpf", "kexec_load", "keyctl", "userfaultfd"} <= set(SECCOMP_DENIED)
    run(pool, SECCOMP_PROBE)


def test_a_child_in_a_session_of_its_own_counts_toward_the_memory_limit():
    """A child that calls setsid() leaves the worker's process group; it still belongs to the worker's PID
    namespace, which the pool sums: holding 1.5 GiB under a 1 GiB limit ends in an oom report."""
    hog = '''
        import time
        pid = os.fork()
        if pid == 0:
            os.setsid()
            if os.fork():
                os._exit(0)  # the grandchild is adopted by the namespace's first process
            block = bytearray(b"\\x01") * (1536 << 20)
            time.sleep(60)
            os._exit(0)
        time.sleep(30)
    '''
    config = VerifyConfig(device="cpu", compile_time_limit_s=40, run_time_limit_s=10)
    with WorkerPool(devices=["cpu"], memory_limit_bytes=1 << 30) as p:
        warm = check(REFERENCE, probe("pass"), config=CONFIG, pool=p)
        if warm.correct is False:
            pytest.fail(warm.feedback)
        need(p, "pid_namespace")
        started = time.monotonic()
        r = check(REFERENCE, probe(hog), config=config, pool=p)
        assert r.error is not None and r.error["kind"] == "oom", r.error
        assert time.monotonic() - started < 30


def test_namespace_rss_sums_the_process_tree_not_only_the_group():
    """namespace_rss over a real process tree: a child in a session of its own is counted."""
    import subprocess

    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    b = bytearray(b'\\x01') * (200 << 20)\n"
            "    print(os.getpid(), flush=True)\n    time.sleep(30)\n    os._exit(0)\ntime.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    grandchild = 0
    try:
        grandchild = int(child.stdout.readline())
        assert os.getpgid(grandchild) != child.pid
        assert namespace_rss(child.pid) > 200 << 20
    finally:
        for pid in (grandchild, child.pid):
            if pid:
                os.kill(pid, 9)
        child.wait()


def test_the_worker_sees_only_its_view(pool, tmp_path):
    """Beyond its interpreter, import path, the toolkit, the system's folders and its private folder, the
    machine is out of the worker's view: a file planted in a temporary folder, the home folders and /var
    are not there (so NVRTC cannot read them either, whatever a candidate's CUDA spells)."""
    need(pool, "view")
    planted = tmp_path / "planted-secret.txt"
    planted.write_text("sk-planted-view-0123456789")
    run(pool, f'''
        for path in ({str(planted)!r}, {str(tmp_path)!r}):
            if os.path.exists(path):
                escaped.append(("in view", path))
        for folder in ("/home", "/var", "/run", "/mnt"):
            if os.path.isdir(folder) and os.listdir(folder):
                escaped.append(("in view", folder, os.listdir(folder)[:5]))
        if not os.path.isdir(os.path.dirname(torch.__file__)):
            escaped.append("the import path is missing")
    ''')


def test_tensors_reach_a_sandboxed_worker_by_value(tmp_path):
    """A worker that runs as nobody with no /tmp in view cannot fetch a tensor's shared-memory descriptor
    from multiprocessing's sharer (a socket in the caller's temporary folder); sent with sandbox.by_value,
    the tensor carries its data and arrives."""
    import subprocess
    from multiprocessing.connection import Connection

    import torch

    from stitchcuda.verify import sandbox

    receiver = ("import sys\nfrom multiprocessing.connection import Connection\nimport torch\n"
                "c = Connection(int(sys.argv[1]))\n"
                "try:\n    c.send(('ok', c.recv().tolist()))\n"
                "except Exception as exc:\n    c.send(('error', type(exc).__name__))\n")
    ours, theirs = socket.socketpair()
    worker = subprocess.Popen(sandbox.command(str(tmp_path / "private"), True,
                                              [sys.executable, "-c", receiver, str(theirs.fileno())]),
                              pass_fds=(theirs.fileno(),))
    theirs.close()
    conn = Connection(ours.detach())
    try:
        conn.send_bytes(sandbox.by_value(torch.arange(4.0)))
        assert conn.poll(120), "the worker did not answer"
        assert conn.recv() == ("ok", [0.0, 1.0, 2.0, 3.0])
    finally:
        conn.close()
        worker.wait(30)


@pytest.mark.gpu
def test_a_gpu_worker_runs_a_cuda_candidate_with_every_layer():
    """On a GPU the worker needs the driver's nodes, /proc/driver, /sys and the driver's libraries through
    the minimal /dev and the view, as nobody, under the seccomp filter (perf_event_open refused): a CUDA
    candidate is verified there, with its kernel trace, and no layer is missing or fell back."""
    from stitchcuda.verify import Task
    from test_jit_includes import REFERENCE as TWICE
    from test_jit_includes import candidate

    with WorkerPool(devices=["cuda:0"]) as p:
        r = check(Task.from_source(TWICE, "twice"), candidate("cuda_fp16.h"), config=VerifyConfig(), pool=p)
        assert p.sandbox_fallback is None, p.sandbox_fallback
        assert r.error is None and r.correct, r.feedback
        assert "missing" not in r.timing["sandbox"] and "seccomp" in r.timing["sandbox"], r.timing["sandbox"]
