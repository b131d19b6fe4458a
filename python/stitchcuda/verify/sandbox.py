"""The sandbox a verification worker runs in: Linux namespaces that need no privileges, set up before
the worker's Python starts.

The pool starts every worker through this file, run as a script by an isolated interpreter
(``python -I -S sandbox.py ARGS``: the standard library only, one thread — the kernel makes a user
namespace only for a single-threaded process, and importing torch starts threads). The launcher

1. leads a new process group and sets the worker's limits (no core dumps, files of at most 4 GiB, 4096
   open files; for users other than root, whom the kernel never holds to it, at most 512 processes beyond
   those the user already runs);
2. unshares a user, a mount and a PID namespace and forks. The child is process 1 of the new PID
   namespace: the kernel kills it when the launcher (its keeper, the process the pool knows) dies, and it
   takes every process the candidate started with it, one that starts a session of its own included.
   Process 1 forks the worker and reaps what the candidate leaves behind;
3. in the namespace: mounts a fresh ``/proc`` (no other process of the machine is visible, so no
   ``/proc/<pid>/environ`` of the caller), binds the pool's private folder writable, mounts a private
   ``/dev/shm``, remounts every other file system read-only, covers the usual credential files of the
   home and working folders, and gives up every capability (``no_new_privs``; root loses its powers);
4. points HOME, TMPDIR and every cache the worker's tools write (torch.compile's, Triton's, load_inline's,
   CUDA's, StitchCUDA's kernel cache) into the private folder, so nothing a candidate writes reaches the
   caller's caches, and executes the worker's interpreter with the environment the pool gave (no secrets).

Whatever a layer cannot have on this kernel (user namespaces disabled, a container that forbids a new
``/proc``) is skipped and named in the state the worker reports (``STITCHCUDA_SANDBOX_STATE``); the pool
warns once. Nothing here needs root, and nothing changes outside the worker.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
from typing import Any

__all__ = ["LAYERS", "command", "describe", "state_of_this_process"]

# The layers, in the order they are set up (each may be missing on a given machine).
LAYERS = ("user_namespace", "pid_namespace", "proc_hidden", "read_only_root", "private_shm",
          "no_privileges", "limits")
STATE_VARIABLE = "STITCHCUDA_SANDBOX_STATE"

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID = 0x00020000, 0x10000000, 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC = 32, 1024, 2048, 4096, 16384
_MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
_PR_SET_PDEATHSIG, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS = 1, 28, 38
_SECBIT_NOROOT, _SECBIT_NOROOT_LOCKED = 1, 2
_SIGKILL = 9

FILE_BYTES = 4 << 30  # one file a worker writes (a candidate filling the disk dies of SIGXFSZ)
OPEN_FILES = 4096
EXTRA_PROCESSES = 512

# Where tools keep credentials, under the home and working folders: readable by the user, so by a
# candidate, unless covered (an empty read-only folder, /dev/null).
CREDENTIAL_PATHS = (".ssh", ".aws", ".azure", ".config/gcloud", ".kube", ".docker", ".netrc", ".git-credentials",
                    ".pypirc", ".huggingface", ".cache/huggingface", ".config/gh", ".gnupg", ".npmrc", ".env")

# Where the worker's tools write, inside the private folder.
_WRITABLE = {"HOME": "home", "TMPDIR": "tmp", "XDG_CACHE_HOME": "cache", "TORCHINDUCTOR_CACHE_DIR": "cache/inductor",
             "TRITON_CACHE_DIR": "cache/triton", "TORCH_EXTENSIONS_DIR": "cache/torch_extensions",
             "CUDA_CACHE_PATH": "cache/nv", "STITCHCUDA_CACHE_DIR": "cache/stitchcuda"}


def command(private_dir: str | None, sandbox: bool, worker: list[str]) -> list[str]:
    """The command line that starts ``worker`` (an interpreter's command line) through the launcher."""
    spec = {"private_dir": private_dir, "sandbox": sandbox, "exec": worker}
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(spec)]


def state_of_this_process() -> dict[str, Any] | None:
    """The layers the launcher set up for this process (None outside a worker)."""
    text = os.environ.get(STATE_VARIABLE)
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def describe(state: dict[str, Any] | None) -> str:
    """One line: which layers hold ("sandbox: user namespace, PID namespace, /proc hidden, ...")."""
    if not state:
        return "sandbox: none"
    if not state.get("enabled", True):
        return "sandbox: off (WorkerPool(sandbox=False) or STITCHCUDA_SANDBOX=0); limits only"
    names = {"user_namespace": "user namespace", "pid_namespace": "PID namespace", "proc_hidden": "/proc hidden",
             "read_only_root": "read-only file system", "private_shm": "private /dev/shm",
             "no_privileges": "no privileges", "limits": "limits"}
    held = [names[k] for k in LAYERS if state.get(k)]
    missing = [names[k] for k in LAYERS if not state.get(k)]
    return "sandbox: " + (", ".join(held) or "no layer") + (f" (missing: {', '.join(missing)})" if missing else "")


# ---------------------------------------------------------------------------------------------------
# The launcher (runs as a script, before the worker's interpreter)

_libc: Any = None


def _c() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
        _libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return _libc


def _err(what: str) -> str:
    code = ctypes.get_errno()
    return f"{what}: {errno.errorcode.get(code, code)} ({os.strerror(code)})"


def _mount(source: str | None, target: str, fstype: str | None, flags: int) -> str | None:
    def enc(s):
        return s.encode() if s is not None else None

    if _c().mount(enc(source), enc(target), enc(fstype), flags, None) != 0:
        return _err(f"mount {target}")
    return None


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _launch(spec: dict[str, Any]) -> None:
    private_dir, worker = spec["private_dir"], list(spec["exec"])
    state: dict[str, Any] = {name: False for name in LAYERS}
    state.update(enabled=bool(spec["sandbox"]), warnings=[], private_dir=private_dir)
    try:
        os.setpgid(0, 0)  # the pool kills the group
    except OSError:
        pass
    uid, gid = os.getuid(), os.getgid()
    running = _processes_of(uid) if uid != 0 else 0  # counted while the machine's /proc is in view
    _limits(state, running)
    if spec["sandbox"]:
        _namespaces(state, uid, gid)
        if state["pid_namespace"]:
            _keep()  # forks; only process 1 of the namespace returns
        if state["user_namespace"]:
            _mounts(state, private_dir)
        if state["pid_namespace"]:
            _init()  # forks; only the worker returns
        if state["user_namespace"]:
            _drop_privileges(state)
    env = dict(os.environ)
    if spec["sandbox"] and private_dir:
        for name, sub in _WRITABLE.items():
            path = os.path.join(private_dir, sub)
            os.makedirs(path, exist_ok=True)
            env[name] = path
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        os.chdir(os.path.join(private_dir, "tmp"))
    env[STATE_VARIABLE] = json.dumps(state)
    os.execve(worker[0], worker, env)


def _namespaces(state: dict[str, Any], uid: int, gid: int) -> None:
    if _c().unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWPID) != 0:
        state["warnings"].append(
            _err("no user namespace (unshare)") + ": other processes' /proc and the whole file system stay "
            "visible to candidates (allow unprivileged user namespaces, e.g. sysctl "
            "kernel.unprivileged_userns_clone=1 or kernel.apparmor_restrict_unprivileged_userns=0, or run "
            "each check in a container)")
        return
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        state["user_namespace"] = state["pid_namespace"] = True
    except OSError as exc:
        state["warnings"].append(f"user namespace made but its id maps could not be written ({exc})")


def _keep() -> None:
    """Forks process 1 of the new PID namespace; this process, its keeper (the one the pool knows and
    kills), waits for it and ends the way the worker ended: the same exit status, or the same signal."""
    pid = os.fork()
    if pid == 0:
        _c().prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
        return
    status = _wait_for(pid, reap_all=False)
    import signal

    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    if 128 < code < 128 + 65:  # the signal that ended the worker (process 1 reports it as 128 + signal)
        signal.signal(code - 128, signal.SIG_DFL)
        os.kill(os.getpid(), code - 128)
    os._exit(code)


def _init() -> None:
    """Process 1 of the namespace forks the worker and stays behind: it reaps whatever the candidate left
    (orphans come to process 1) and, when the worker ends, ends too, with 128 + signal if a signal ended
    it (process 1 cannot die of a signal it raises itself). The worker is not process 1, so signals
    behave for it as anywhere (abort() aborts)."""
    pid = os.fork()
    if pid == 0:
        return
    status = _wait_for(pid, reap_all=True)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _wait_for(pid: int, reap_all: bool) -> int:
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # passed on to the worker
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    while True:
        try:
            done, status = os.waitpid(-1 if reap_all else pid, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(1)
        if done == pid:
            return status


def _mounts(state: dict[str, Any], private_dir: str) -> None:
    warn = state["warnings"].append
    problem = _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done here reaches the caller
    if problem:
        warn(problem + ": mounts left as they are")
        return
    problem = _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    if problem:
        warn(problem + ": /proc still lists the machine's processes (a container may forbid a new /proc)")
    else:
        state["proc_hidden"] = True
    os.makedirs(private_dir, exist_ok=True)
    problem = _mount(private_dir, private_dir, None, _MS_BIND | _MS_REC)
    if problem:
        warn(problem + ": no private writable folder, so the file system is left writable")
        return
    if os.path.isdir("/dev/shm"):
        problem = _mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV)
        if problem:
            warn(problem + ": /dev/shm is the machine's")
        else:
            state["private_shm"] = True
    failed = []
    for target, options in _mount_points():
        if target == private_dir or _under(target, private_dir) or "ro" in options:
            continue
        if target in ("/proc", "/dev", "/sys") or target.startswith(("/proc/", "/dev/", "/sys/")):
            continue  # device nodes open for writing on a read-only mount anyway; /sys, /proc are kernel views
        problem = _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _locked_flags(options))
        if problem:
            failed.append(problem)
    state["hidden"] = _hide_credentials(failed)
    state["read_only_root"] = not any(p.startswith("mount /:") for p in failed)
    if failed:
        warn(f"{len(failed)} mount(s) left writable or uncovered: " + "; ".join(failed[:4]))


def _drop_privileges(state: dict[str, Any]) -> None:
    """No capability survives the exec of the worker: its user id is the caller's, and for root the
    kernel is told not to hand root its powers (a candidate could otherwise remount the file system)."""
    libc = _c()
    ok = libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    if os.getuid() == 0:
        ok = libc.prctl(_PR_SET_SECUREBITS, _SECBIT_NOROOT | _SECBIT_NOROOT_LOCKED, 0, 0, 0) == 0 and ok
    if ok:
        state["no_privileges"] = True
    else:
        state["warnings"].append(_err("capabilities not dropped (prctl)"))


def _hide_credentials(failed: list[str]) -> list[str]:
    hidden = []
    for home in sorted({os.path.expanduser("~"), os.getcwd()}):
        for rel in CREDENTIAL_PATHS:
            path = os.path.join(home, rel)
            if os.path.islink(path) or not os.path.exists(path):
                continue
            if os.path.isdir(path):
                problem = _mount("tmpfs", path, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
            else:
                problem = _mount("/dev/null", path, None, _MS_BIND)
            (failed.append(problem) if problem else hidden.append(path))
    return hidden


def _under(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def _mount_points() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of every mount this process sees, parents first."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6:
                target = parts[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
                points.append((target.replace("\\134", "\\"), set(parts[5].split(","))))
    return points


def _locked_flags(options: set[str]) -> int:
    """The flags a remount must repeat: in a user namespace the kernel refuses to clear nosuid, nodev or
    noexec, or to change the atime mode, that a mount came with."""
    flags = 0
    for name, bit in (("nosuid", _MS_NOSUID), ("nodev", _MS_NODEV), ("noexec", _MS_NOEXEC),
                      ("noatime", _MS_NOATIME), ("nodiratime", _MS_NODIRATIME), ("relatime", _MS_RELATIME)):
        if name in options:
            flags |= bit
    if not flags & (_MS_NOATIME | _MS_RELATIME):
        flags |= _MS_STRICTATIME
    return flags


def _limits(state: dict[str, Any], running: int) -> None:
    try:
        import resource

        def cap(kind: int, value: int) -> None:
            soft, hard = resource.getrlimit(kind)
            value = value if hard == resource.RLIM_INFINITY else min(hard, value)
            resource.setrlimit(kind, (value, value))

        cap(resource.RLIMIT_CORE, 0)
        cap(resource.RLIMIT_FSIZE, FILE_BYTES)
        cap(resource.RLIMIT_NOFILE, OPEN_FILES)
        if os.getuid() != 0:
            cap(resource.RLIMIT_NPROC, running + EXTRA_PROCESSES)
        state["limits"] = True
    except (ImportError, ValueError, OSError) as exc:
        state["warnings"].append(f"resource limits not set: {exc}")


def _processes_of(uid: int) -> int:
    """The user's tasks on the machine (threads count as processes for RLIMIT_NPROC)."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
    return count


if __name__ == "__main__":
    _launch(json.loads(sys.argv[1]))
