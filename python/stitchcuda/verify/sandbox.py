"""The sandbox a verification worker runs in: Linux namespaces that need no privileges, set up before
the worker's Python starts.

The pool starts every worker through this file, run as a script by an isolated interpreter
(``python -I -S sandbox.py ARGS``: the standard library only, one thread — the kernel makes a user
namespace only for a single-threaded process, and importing torch starts threads). The launcher

1. starts a session of its own (no controlling terminal: nothing typed into the caller's terminal) and
   sets the worker's limits (no core dumps, files of at most 4 GiB, 4096 open files, at most 512
   processes beyond those its user already runs); where the caller is root it first becomes an
   unprivileged user (``nobody``), so that nothing the kernel checks against root's id (sysctl files,
   root-owned files) is open to a candidate;
2. unshares a user, a mount, a PID and a network namespace and forks. The child is process 1 of the new
   PID namespace: the kernel kills it when the launcher (its keeper, the process the pool knows) dies,
   and it takes every process the candidate started with it, one that starts a session of its own
   included. Process 1 forks the worker and reaps what the candidate leaves behind. The network
   namespace has only a loopback device that is down: no address of the machine is reachable;
3. in the namespace: mounts a fresh ``/proc`` (no other process of the machine is visible) with
   ``/proc/sys`` and the other kernel knobs read-only, a minimal ``/dev`` (null, zero, full, random,
   urandom, tty and the GPU's nodes, read-only, with a private ``/dev/shm``), binds the pool's private
   folder writable, remounts every other file system (``/sys`` and its cgroup folders included)
   read-only, covers the usual credential files of the home and working folders and, for a worker that
   became nobody, each folder closed to others on the way to its interpreter (``/root``: only the entries
   that lead there stay), and gives up every capability (``no_new_privs``);
4. loads a seccomp filter (libseccomp) that refuses the system calls a worker never needs (ptrace,
   mount, new namespaces, kexec, bpf, keyrings, io_uring...; ``SECCOMP_DENIED``);
5. points HOME, TMPDIR and every cache the worker's tools write into the private folder and executes
   the worker's interpreter with the environment the pool gave (no secrets).

Whatever a layer cannot have on this kernel (user namespaces disabled, a container that forbids a new
``/proc``, no libseccomp) is skipped and named in the state the worker reports
(``STITCHCUDA_SANDBOX_STATE``); the pool warns once. Memory is summed over every process of the
worker's namespace (``namespace_rss``), so a child that leaves the process group still counts. Where
the caller's cgroup v2 is delegated to it (``cgroup_parent``), the launcher first moves itself into a
cgroup of its own beside the caller's, whose ``memory.max`` and ``pids.max`` the kernel holds for every
process the worker starts; elsewhere (a v1 hierarchy, a cgroup not delegated) the reading of ``/proc``
is all there is, and the state says why (``cgroup_reason``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
from typing import Any

__all__ = ["LAYERS", "SECCOMP_DENIED", "by_value", "cgroup_parent", "command", "describe", "namespace_rss",
           "state_of_this_process"]

# The layers, in the order they are set up (each may be missing on a given machine).
LAYERS = ("unprivileged_uid", "user_namespace", "pid_namespace", "network_namespace", "proc_hidden",
          "read_only_proc_sys", "view", "minimal_dev", "private_shm", "read_only_root", "read_only_sys", "no_privileges",
          "seccomp", "limits")
STATE_VARIABLE = "STITCHCUDA_SANDBOX_STATE"
SKIPPABLE = ("unprivileged_uid", "network_namespace", "view", "minimal_dev", "seccomp")

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
_CLONE_NEWCGROUP, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x02000000, 0x04000000, 0x08000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC = 32, 1024, 2048, 4096, 16384
_MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS = 1, 28, 38
_SECBIT_NOROOT, _SECBIT_NOROOT_LOCKED = 1, 2
_SIGKILL = 9

FILE_BYTES = 4 << 30  # one file a worker writes (a candidate filling the disk dies of SIGXFSZ)
OPEN_FILES = 4096
EXTRA_PROCESSES = 512
NOBODY = 65534  # the host user a root caller's workers run as (when no "nobody" entry says otherwise)

# Where tools keep credentials, under the home and working folders: readable by the user, so by a
# candidate, unless covered (an empty read-only folder, /dev/null).
CREDENTIAL_PATHS = (".ssh", ".aws", ".azure", ".config/gcloud", ".kube", ".docker", ".netrc", ".git-credentials",
                    ".pypirc", ".huggingface", ".cache/huggingface", ".config/gh", ".gnupg", ".npmrc", ".env")

# The machine's folders a worker sees besides its interpreter, import path, toolkit and private folder.
SYSTEM_PATHS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc/passwd", "/etc/group",
                "/etc/nsswitch.conf", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
                "/etc/localtime", "/etc/os-release", "/etc/hosts", "/etc/ssl", "/etc/nvidia", "/etc/OpenCL")

# The device nodes a worker gets (bound from the machine's /dev), besides the GPU's (/dev/nvidia*).
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# Kernel knobs under the fresh /proc that stay read-only (the rest of /proc is the namespace's own).
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")

# System calls a verification worker never makes (libseccomp names; a name this machine's libseccomp
# does not know is skipped). Each fails with EPERM; clone3 fails with ENOSYS so that the C library
# falls back to clone, whose namespace flags the filter can see.
SECCOMP_DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "unshare", "setns",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "quotactl_fd", "syslog", "sethostname", "setdomainname", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm", "vhangup", "uselib", "lookup_dcookie",
    "bpf", "perf_event_open", "userfaultfd", "fanotify_init",
    "keyctl", "add_key", "request_key",
    "open_by_handle_at", "name_to_handle_at",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)
_TIOCSTI = 0x5412  # ioctl that types into a terminal

# Where the worker's tools write, inside the private folder.
# A worker's cgroup v2 (where one is delegated): beside the caller's, named by the launcher's pid. Its memory
# limit sits above the pool's, whose poller then still reports an `oom` first; the kernel's is the backstop
# for an allocation faster than the poller's four reads a second. Tasks count threads: torch starts one per
# core in every process, torch.compile's workers included, so the cap grows with the machine.
CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_PREFIX = "stitchcuda-worker-"
CGROUP_MEMORY_MARGIN = 1.125
CGROUP_TASKS = max(4096, 64 * (os.cpu_count() or 8))

_WRITABLE = {"HOME": "home", "TMPDIR": "tmp", "XDG_CACHE_HOME": "cache", "TORCHINDUCTOR_CACHE_DIR": "cache/inductor",
             "TRITON_CACHE_DIR": "cache/triton", "TORCH_EXTENSIONS_DIR": "cache/torch_extensions",
             "CUDA_CACHE_PATH": "cache/nv", "STITCHCUDA_CACHE_DIR": "cache/stitchcuda"}


def command(private_dir: str | None, sandbox: bool, worker: list[str], skip: tuple[str, ...] = (),
            memory_bytes: int | None = None) -> list[str]:
    """The command line that starts ``worker`` (an interpreter's command line) through the launcher.
    ``skip`` leaves out some of SKIPPABLE (the cost benchmark measures each layer that way).
    ``memory_bytes``: the pool's memory limit, which a delegated cgroup v2 also holds (``cgroup_parent``)."""
    unknown = set(skip) - set(SKIPPABLE)
    if unknown:
        raise ValueError(f"unknown sandbox layers {sorted(unknown)}: the layers that can be left out are {SKIPPABLE}")
    spec = {"private_dir": private_dir, "sandbox": sandbox, "exec": worker, "needs": _needed_paths(worker),
            "skip": list(skip), "memory_bytes": memory_bytes}
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(spec)]


def _needed_paths(worker: list[str]) -> list[str]:
    """What the worker reads: its interpreter, the interpreter's prefixes, this process's import path and
    main script (the worker gets both), the CUDA toolkit's headers and NVRTC, and the system's folders —
    each also as its real path. The rest of the machine is left out of the worker's view."""
    paths = [worker[0] if worker else sys.executable, sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix,
             sys.base_exec_prefix, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
    shared = {os.path.realpath(p) for p in ("/", "/tmp", "/var/tmp", "/dev/shm", os.path.expanduser("~"),
                                            os.environ.get("TMPDIR") or "/tmp")}
    paths += [p for p in sys.path if p and os.path.realpath(p) not in shared]  # a script in /tmp: not all of /tmp
    paths += list(SYSTEM_PATHS)
    for name in ("LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH"):  # a driver or toolkit outside /usr
        paths += [p for p in os.environ.get(name, "").split(os.pathsep) if p and os.path.realpath(p) not in shared]
    # The host compilers a candidate's torch.utils.cpp_extension.load_inline runs (a g++ in /opt/gcc): each
    # one's install prefix, so its cc1plus, headers and libraries come along.
    for tool in (os.environ.get("CXX"), os.environ.get("CC"), "c++", "g++", "gcc", "cc", "nvcc", "ninja"):
        found = shutil.which(tool) if tool else None
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(found))) if found else None
        if prefix and prefix not in shared:
            paths.append(prefix)
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main:
        paths.append(main)
        folder = os.path.dirname(os.path.abspath(main))
        if os.path.realpath(folder) in shared:  # a script in a home or temporary folder: its modules only
            try:
                paths += [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".py") or
                          os.path.isfile(os.path.join(folder, n, "__init__.py"))]
            except OSError:
                pass
    native = sys.modules.get("stitchcuda._C")
    if native is not None:  # the toolkit may live outside /usr (a wheel's headers, /opt/nvidia)
        try:
            paths += list(native.system_include_paths()) + [os.path.dirname(native.nvrtc_path())]
        except Exception:  # noqa: BLE001 - no NVRTC: nothing to add
            pass
    out: list[str] = []
    for path in paths:
        for p in (os.path.abspath(path), os.path.realpath(path)):
            if p not in out and os.path.lexists(p):
                out.append(p)
    return out


def state_of_this_process() -> dict[str, Any] | None:
    """The layers the launcher set up for this process (None outside a worker)."""
    from ..settings import read  # here, not at the top: the launcher runs this file as a stdlib-only script

    text = read(STATE_VARIABLE)
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
    names = {"unprivileged_uid": "unprivileged user", "user_namespace": "user namespace",
             "pid_namespace": "PID namespace", "network_namespace": "no network", "proc_hidden": "/proc hidden",
             "read_only_proc_sys": "/proc/sys read-only", "view": "only the toolkit, interpreter and system in view",
             "minimal_dev": "minimal /dev",
             "private_shm": "private /dev/shm", "read_only_root": "read-only file system",
             "read_only_sys": "/sys read-only", "no_privileges": "no privileges", "seccomp": "seccomp",
             "limits": "limits"}
    held = [names[k] for k in LAYERS if state.get(k)]
    missing = [names[k] for k in LAYERS if not state.get(k)]
    held += ["cgroup memory and task limits"] if state.get("cgroup") else []  # where one is delegated only
    return "sandbox: " + (", ".join(held) or "no layer") + (f" (missing: {', '.join(missing)})" if missing else "")


def cgroup_parent(root: str = CGROUP_ROOT, membership: str = "/proc/self/cgroup") -> tuple[str | None, str]:
    """Where a worker's cgroup goes: (the folder, "") when this process's cgroup v2 is delegated to it — its
    parent is writable and hands the memory and pids controllers down — else (None, why not). The worker's
    cgroup is a sibling of the caller's: a cgroup that holds processes cannot enable controllers for
    children of its own."""
    if not os.path.exists(os.path.join(root, "cgroup.controllers")):
        return None, f"no cgroup v2 at {root} (a v1 or hybrid hierarchy)"
    try:
        with open(membership) as f:
            path = next((line[3:].strip() for line in f if line.startswith("0::")), None)
        if not path or path == "/":
            return None, "this process is at the root of its cgroup v2 hierarchy: no parent to put a sibling in"
        own = os.path.join(root, path.lstrip("/"))
        with open(os.path.join(own, "cgroup.controllers")) as f:
            given = f.read().split()
    except OSError as exc:
        return None, f"this process's cgroup v2 cannot be read ({exc})"
    missing = [c for c in ("memory", "pids") if c not in given]
    if missing:
        return None, f"the cgroup {path} is not given the {' and '.join(missing)} controller(s) by its parent"
    parent = os.path.dirname(own)
    if not (os.access(parent, os.W_OK) and os.access(os.path.join(parent, "cgroup.procs"), os.W_OK)):
        return None, f"the cgroup above {path} is not delegated to this user (not writable)"
    return parent, ""


def by_value(message: Any) -> bytes:
    """``message`` pickled for a sandboxed worker (send it with ``Connection.send_bytes``; the worker's
    ``recv`` reads it as usual): tensors carry their data, since the handles multiprocessing's reducer would
    send (a descriptor fetched over a socket in the caller's private temporary folder) are out of reach
    of a worker that runs as nobody and has no /tmp in view."""
    import pickle

    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def namespace_rss(keeper_pid: int) -> int:
    """Resident bytes of the launcher ``keeper_pid`` and every process below it — with the sandbox, every
    process of the worker's PID namespace (an orphan there is adopted by the namespace's process 1, so it
    stays below the keeper, whatever session or process group it made) — and of every process still in the
    keeper's process group (the sandbox off). One read of /proc: cheap enough four times a second."""
    page = os.sysconf("SC_PAGE_SIZE")
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    counted: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) <= 21:
            continue
        pid = int(entry)
        rss[pid] = int(fields[21]) * page  # state is field 0 here, ppid 1, process group 2, rss 21
        children.setdefault(int(fields[1]), []).append(pid)
        if int(fields[2]) == keeper_pid:
            counted.add(pid)
    todo = [keeper_pid]
    while todo:
        pid = todo.pop()
        counted.add(pid)
        todo.extend(children.pop(pid, ()))
    return sum(rss.get(pid, 0) for pid in counted)


# ---------------------------------------------------------------------------------------------------
# The launcher (runs as a script, before the worker's interpreter)

_libc: Any = None


def _c() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        _libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return _libc


def _err(what: str) -> str:
    code = ctypes.get_errno()
    return f"{what}: {errno.errorcode.get(code, code)} ({os.strerror(code)})"


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> str | None:
    def enc(s):
        return s.encode() if s is not None else None

    if _c().mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
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
        os.setsid()  # no controlling terminal; the pool kills the group this makes
    except OSError:
        try:
            os.setpgid(0, 0)  # already a session leader (started with start_new_session)
        except OSError:
            pass
    if spec["sandbox"] and private_dir:
        for sub in _WRITABLE.values():
            os.makedirs(os.path.join(private_dir, sub), exist_ok=True)
    if spec["sandbox"]:
        _cgroup(state, spec.get("memory_bytes"))  # before the namespaces: moving needs the caller's rights
    uid, gid, skip = os.getuid(), os.getgid(), set(spec.get("skip") or ())
    target = _unprivileged(state, private_dir) if spec["sandbox"] and "unprivileged_uid" not in skip else None
    running = _processes_of(target[0] if target else uid) if (target or uid != 0) else 0
    # Counted while the machine's /proc is in view. Every pool's workers share nobody's count, threads
    # included (torch and CUDA start dozens per worker): a margin that grows with the machine.
    # The kernel holds root to no process count; the worker that becomes nobody is held.
    _limits(state, running, None if uid == 0 and not target else
            EXTRA_PROCESSES if not target else max(EXTRA_PROCESSES, 64 * (os.cpu_count() or 8)))
    if spec["sandbox"]:
        target = _namespaces(state, uid, gid, target, network="network_namespace" not in skip)
        if state["pid_namespace"]:
            _keep()  # forks; only process 1 of the namespace returns
        if state["user_namespace"]:
            _mounts(state, private_dir, spec.get("needs") or [], target, dev="minimal_dev" not in skip,
                    view="view" not in skip)
        if state["pid_namespace"]:
            _init()  # forks; only the worker returns
        if state["user_namespace"]:
            _drop_privileges(state, target)
        elif target:  # no namespace to map nobody into: become nobody on the machine itself
            _become(state, target)
        if "seccomp" not in skip:
            _seccomp(state)
    env = dict(os.environ)
    if spec["sandbox"] and private_dir:
        for name, sub in _WRITABLE.items():
            env[name] = os.path.join(private_dir, sub)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        os.chdir(os.path.join(private_dir, "tmp"))
    env[STATE_VARIABLE] = json.dumps(state)
    os.execve(worker[0], worker, env)


def _cgroup(state: dict[str, Any], memory_bytes: int | None, **where: str) -> None:
    """Moves this launcher (and so everything it starts) into a cgroup v2 of its own with memory.max and
    pids.max, where one is delegated (``cgroup_parent``); removes the empty cgroups of launchers gone
    before. Anything that fails leaves the launcher where it was, with the reason in the state. ``where``:
    cgroup_parent's arguments."""
    state["cgroup"] = None
    parent, reason = cgroup_parent(**where)
    if parent is None:
        state["cgroup_reason"] = reason
        return
    for name in os.listdir(parent):  # earlier workers' cgroups: only an empty one can be removed
        if name.startswith(CGROUP_PREFIX) and not os.path.exists(f"/proc/{name[len(CGROUP_PREFIX):]}"):
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass
    mine = os.path.join(parent, f"{CGROUP_PREFIX}{os.getpid()}")
    try:
        os.mkdir(mine)
        if memory_bytes:
            _write(os.path.join(mine, "memory.max"), str(int(memory_bytes * CGROUP_MEMORY_MARGIN)))
            try:
                _write(os.path.join(mine, "memory.swap.max"), "0")  # no way around the limit through swap
            except OSError:
                pass  # a kernel without swap accounting
        _write(os.path.join(mine, "pids.max"), str(CGROUP_TASKS))
        _write(os.path.join(mine, "cgroup.procs"), str(os.getpid()))
    except OSError as exc:
        state["cgroup_reason"] = f"a cgroup could not be made in {parent} ({exc})"
        try:
            os.rmdir(mine)
        except OSError:
            pass
        return
    state["cgroup"] = mine


def _unprivileged(state: dict[str, Any], private_dir: str | None) -> tuple[int, int] | None:
    """The (uid, gid) a root caller's worker becomes: ``nobody``, with the private folder handed over to it
    (as root in its namespace, the worker would be root to every check the kernel makes of files and sysctl
    knobs against the caller's id). None for a caller that is not root (already unprivileged)."""
    if os.getuid() != 0:
        state["unprivileged_uid"], state["uid"] = True, os.getuid()
        return None
    try:
        import pwd

        try:
            entry = pwd.getpwnam("nobody")
            uid, gid = entry.pw_uid, entry.pw_gid
        except KeyError:
            uid = gid = NOBODY
        if private_dir:
            for folder, _dirs, files in os.walk(private_dir):
                os.chown(folder, uid, gid)
                for name in files:
                    os.chown(os.path.join(folder, name), uid, gid, follow_symlinks=False)
        os.setgroups([])  # root's supplementary groups would go along
        return uid, gid
    except (OSError, ImportError) as exc:
        state["warnings"].append(f"the worker runs as root: its private folder could not be given to nobody ({exc})")
        return None


def _become(state: dict[str, Any], target: tuple[int, int]) -> None:
    uid, gid = target
    try:
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        state["unprivileged_uid"], state["uid"] = True, uid
    except OSError as exc:
        state["warnings"].append(f"the worker runs as root: it could not become uid {uid} ({exc})")


def _namespaces(state: dict[str, Any], uid: int, gid: int, target: tuple[int, int] | None,
                network: bool = True) -> tuple[int, int] | None:
    """Unshares the namespaces. A root caller maps both root and ``target`` into the user namespace: a
    process of the machine's (a forked helper, still root there) must write such a map, the namespace's
    own process may only map its own id. Returns ``target`` when it is mapped (or no namespace was made)."""
    helper, go = (_map_helper(uid, gid, target) if target else (None, None))
    made = _c().unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWPID | (_CLONE_NEWNET if network else 0)) == 0
    problem = None if made else _err("no user namespace (unshare)")
    if helper is not None:
        os.write(go, b"1" if made else b"0")
        os.close(go)
        _, status = os.waitpid(helper, 0)
        if made and status != 0:
            target = None
            state["warnings"].append("the worker runs as root: nobody could not be mapped into its namespace")
    if not made:
        state["warnings"].append(
            problem + ": other processes' /proc, the network and the whole file system stay visible to "
            "candidates (allow unprivileged user namespaces, e.g. sysctl kernel.unprivileged_userns_clone=1 "
            "or kernel.apparmor_restrict_unprivileged_userns=0, or run each check in a container)")
        return target
    try:
        if target is None or helper is None:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        state["user_namespace"] = state["pid_namespace"] = True
        state["network_namespace"] = network
    except OSError as exc:
        state["warnings"].append(f"user namespace made but its id maps could not be written ({exc})")
    return target


def _map_helper(uid: int, gid: int, target: tuple[int, int]) -> tuple[int, int]:
    """Forks a process that waits until this one unshared, then writes its id maps: the caller's id and
    ``target``, each onto itself. Returns (helper pid, the pipe's write end that says "go")."""
    parent = os.getpid()
    ready, go = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go)
        try:
            if os.read(ready, 1) != b"1":
                os._exit(0)
            _write(f"/proc/{parent}/uid_map", f"{uid} {uid} 1\n{target[0]} {target[0]} 1\n")
            _write(f"/proc/{parent}/gid_map", f"{gid} {gid} 1\n{target[1]} {target[1]} 1\n")
            os._exit(0)
        except BaseException:  # noqa: BLE001 - the launcher reads the status
            os._exit(1)
    os.close(ready)
    return pid, go


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


def _mounts(state: dict[str, Any], private_dir: str, needs: list[str], target: tuple[int, int] | None,
            dev: bool = True, view: bool = True) -> None:
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
        state["read_only_proc_sys"] = _read_only_proc(warn)
    os.makedirs(private_dir, exist_ok=True)
    problem = _mount(private_dir, private_dir, None, _MS_BIND | _MS_REC)
    if problem:
        warn(problem + ": no private writable folder, so the file system is left writable")
        return
    if needs and view:
        state["view"] = _restrict_view(needs + [private_dir], private_dir, warn)
    if target:
        state["opened"] = _open_paths(needs + [private_dir], private_dir, target[0], warn)
    if dev:
        _minimal_dev(state, private_dir)
    failed = []
    for target, options in _mount_points():
        if target == private_dir or _under(target, private_dir) or "ro" in options:
            continue
        if target in ("/proc", "/dev") or target.startswith(("/proc/", "/dev/")):
            continue  # the namespace's own /proc (its knobs read-only above) and /dev (below)
        problem = _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _locked_flags(options))
        if problem:
            failed.append(problem)
    state["hidden"] = _hide_credentials(failed)
    state["read_only_root"] = not any(p.startswith("mount /:") for p in failed)
    state["read_only_sys"] = os.path.isdir("/sys") and not any(p.startswith("mount /sys") for p in failed)
    if failed:
        warn(f"{len(failed)} mount(s) left writable or uncovered: " + "; ".join(failed[:4]))


def _read_only_proc(warn) -> bool:
    """The fresh /proc's kernel knobs (/proc/sys: core_pattern and the rest) bound read-only onto themselves."""
    ok = True
    for name in PROC_READ_ONLY:
        path = "/proc/" + name
        if not os.path.exists(path):
            continue
        problem = _mount(path, path, None, _MS_BIND | _MS_REC) or _mount(
            None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        if problem:
            warn(problem + f": {path} stays writable")
            ok = ok and name != "sys"
    return ok


def _minimal_dev(state: dict[str, Any], private_dir: str) -> None:
    """A read-only tmpfs on /dev holding only DEVICES and the GPU's nodes (bound from the machine's /dev)
    and a private /dev/shm."""
    warn = state["warnings"].append
    keep = [n for n in os.listdir("/dev") if n in DEVICES or n.startswith("nvidia")]
    if not _cover("/dev", keep, private_dir, _MS_NOSUID | _MS_NOEXEC, warn):
        warn("/dev is the machine's")
        return
    for name, link in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                       ("stderr", "/proc/self/fd/2")):
        os.symlink(link, "/dev/" + name)
    os.mkdir("/dev/shm")
    problem = _mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777")
    if problem:
        warn(problem + ": no /dev/shm")
    else:
        state["private_shm"] = True
    problem = _mount(None, "/dev", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NOEXEC)
    if problem:
        warn(problem + ": the namespace's /dev stays writable")
    else:
        state["minimal_dev"] = True


def _cover(folder: str, keep: list[str], private_dir: str, flags: int, warn) -> bool:
    """Mounts an empty tmpfs on ``folder`` and binds its entries named in ``keep`` back into it, reached
    through a bind of the folder in the private folder (held open by a descriptor, since covering /tmp
    covers the private folder's path too) and undone at the end: the rest of the folder disappears."""
    stage = os.path.join(private_dir, ".stage")
    os.makedirs(stage, exist_ok=True)
    problem = _mount(folder, stage, None, _MS_BIND | _MS_REC)
    if problem:
        warn(problem)
        return False
    held = os.open(stage, os.O_PATH | os.O_DIRECTORY)
    staged = f"/proc/self/fd/{held}"
    try:
        problem = _mount("tmpfs", folder, "tmpfs", flags, "mode=755,size=64k")
        if problem:
            warn(problem)
            return False
        for name in sorted(keep):
            source, target = os.path.join(staged, name), os.path.join(folder, name)
            if not os.path.lexists(source) or os.path.lexists(target):
                continue
            if os.path.islink(source):  # the same link: it resolves in the worker's view
                os.symlink(os.readlink(source), target)
                continue
            if os.path.isdir(source):
                os.mkdir(target)
            else:
                open(target, "w").close()
            problem = _mount(source, target, None, _MS_BIND | _MS_REC)
            if problem:
                warn(problem + f": {target} is missing from the worker's view")
        return True
    finally:
        _c().umount2(staged.encode(), _MNT_DETACH)
        os.close(held)
        try:
            os.rmdir(stage)
        except OSError:
            pass


def _restrict_view(keep: list[str], private_dir: str, warn) -> bool:
    """Leaves in view only the paths in ``keep`` (whole) and the folders on the way to them: every other
    folder of the root is covered by an empty tmpfs, and a folder that holds kept paths by one into which
    only the entries on the way are bound back (``_cover``). /proc, /dev and /sys are the namespace's."""
    keep = sorted(set(keep))

    def inside(folder: str) -> list[str]:
        return [k for k in keep if k == folder or k.startswith(folder + "/")]

    def restrict(folder: str) -> bool:
        under = inside(folder)
        if folder in under:
            return True
        children = sorted({k[len(folder) + 1:].split("/")[0] for k in under})
        if not _cover(folder, children, private_dir, _MS_NOSUID | _MS_NODEV, warn):
            return False
        ok = True
        for child in children:
            path = folder + "/" + child
            if os.path.isdir(path) and not os.path.islink(path):
                ok = restrict(path) and ok
        return ok

    ok = True
    for name in sorted(os.listdir("/")):
        path = "/" + name
        if path in ("/proc", "/dev", "/sys") or os.path.islink(path):
            continue
        if not os.path.isdir(path):  # a file at the root (a container's description): emptied
            problem = None if inside(path) else _mount("/dev/null", path, None, _MS_BIND)
        elif inside(path):
            ok = restrict(path) and ok
            continue
        else:
            problem = _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "mode=755,size=16k")
        if problem:
            warn(problem + f": {path} stays in view")
            ok = False
    return ok


def _open_paths(needs: list[str], private_dir: str, uid: int, warn) -> list[str]:
    """Makes each needed path reachable by nobody: a folder on the way that others may not enter (a
    caller's interpreter under /root, mode 700) is covered by an empty tmpfs into which only the needed
    entries are bound back — so the rest of that folder (root's files) disappears from the view. Returns
    the folders covered."""
    covered: list[str] = []
    for _ in range(32):  # each round covers the shallowest closed folder; a covered one is open
        closed: dict[str, set[str]] = {}
        for path in needs:
            parts = path.strip("/").split("/")
            for depth in range(1, len(parts)):
                folder = "/" + "/".join(parts[:depth])
                try:
                    info = os.stat(folder)
                except OSError:
                    break
                if not info.st_mode & 0o001 and info.st_uid != uid:
                    closed.setdefault(folder, set()).add(parts[depth])
                    break
        if not closed:
            return covered
        folder = min(closed, key=lambda f: f.count("/"))
        if not _cover(folder, sorted(closed[folder]), private_dir, _MS_NOSUID | _MS_NODEV, warn):
            warn(f"{folder} stays closed to the worker")
            return covered
        covered.append(folder)
    return covered


def _drop_privileges(state: dict[str, Any], target: tuple[int, int] | None) -> None:
    """No capability survives the exec of the worker: a root caller's worker becomes ``target`` (nobody),
    and for a root that stayed root the kernel is told not to hand root its powers (a candidate could
    otherwise remount the file system)."""
    libc = _c()
    if target:
        _become(state, target)
    ok = libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    if os.getuid() == 0:
        ok = libc.prctl(_PR_SET_SECUREBITS, _SECBIT_NOROOT | _SECBIT_NOROOT_LOCKED, 0, 0, 0) == 0 and ok
    if ok:
        state["no_privileges"] = True
    else:
        state["warnings"].append(_err("capabilities not dropped (prctl)"))


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _seccomp(state: dict[str, Any]) -> None:
    """Loads the filter of SECCOMP_DENIED through libseccomp (the maintained library; loaded by name, so
    a machine without it is a named missing layer). Also refused: clone with a namespace flag, and the
    TIOCSTI ioctl. Other architectures' system call tables (int 0x80) kill the process."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        state["warnings"].append("no seccomp filter: libseccomp is not installed (Debian/Ubuntu: libseccomp2)")
        return
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    allow, deny, nosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    masked_eq = 7  # SCMP_CMP_MASKED_EQ: (argument & datum_a) == datum_b
    ctx = lib.seccomp_init(allow)
    if not ctx:
        state["warnings"].append("no seccomp filter: seccomp_init failed")
        return
    try:
        problems = []

        def rule(action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                return  # not a system call of this architecture
            array = (_ArgCmp * max(1, len(cmps)))(*[_ArgCmp(*c) for c in cmps])
            if lib.seccomp_rule_add_array(ctx, action, number, len(cmps), array) != 0:
                problems.append(name)

        for name in SECCOMP_DENIED:
            rule(deny, name)
        rule(nosys, "clone3")
        for flag in (_CLONE_NEWUSER, _CLONE_NEWNS, _CLONE_NEWPID, _CLONE_NEWNET, _CLONE_NEWCGROUP, _CLONE_NEWUTS,
                     _CLONE_NEWIPC):
            rule(deny, "clone", (0, masked_eq, flag, flag))
        rule(deny, "ioctl", (1, masked_eq, 0xFFFFFFFF, _TIOCSTI))
        if lib.seccomp_load(ctx) != 0:
            state["warnings"].append(_err("no seccomp filter: seccomp_load"))
            return
        state["seccomp"] = True
        if problems:
            state["warnings"].append("seccomp rules not added for: " + ", ".join(problems))
    finally:
        lib.seccomp_release(ctx)


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


def _limits(state: dict[str, Any], running: int, extra: int | None) -> None:
    try:
        import resource

        def cap(kind: int, value: int) -> None:
            soft, hard = resource.getrlimit(kind)
            value = value if hard == resource.RLIM_INFINITY else min(hard, value)
            resource.setrlimit(kind, (value, value))

        cap(resource.RLIMIT_CORE, 0)
        cap(resource.RLIMIT_FSIZE, FILE_BYTES)
        cap(resource.RLIMIT_NOFILE, OPEN_FILES)
        if extra is not None:
            cap(resource.RLIMIT_NPROC, running + extra)
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
