"""The verification worker's sandbox (stitchcuda/verify/sandbox.py), tried from inside as a candidate
would: each probe runs in ModelNew's constructor and the candidate is correct only if every escape
failed, so a failing test prints what got out. Layers this machine cannot have are skipped with the
reason the pool reports (CI's machine has them all)."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from stitchcuda.settings import override
from stitchcuda.verify import VerifyConfig, WorkerPool, check
from stitchcuda.verify.sandbox import describe
from test_verify_pool import REFERENCE  # the same x * 2 problem

pytestmark = pytest.mark.slow

CONFIG = VerifyConfig(device="cpu", timing_iters=3, warmup=1, compile_time_limit_s=30, run_time_limit_s=10)


def probe(body: str) -> str:
    """A candidate whose constructor runs ``body`` (which appends to ``escaped`` what got out) and
    raises with the list when anything did."""
    return ("import ctypes, os, tempfile\nimport torch\nimport torch.nn as nn\n\n"
            "class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        escaped = []\n" + textwrap.indent(textwrap.dedent(body), " " * 8) + "\n"
            "        if escaped:\n            raise RuntimeError('ESCAPED: ' + repr(escaped))\n\n"
            "    def forward(self, x):\n        return x + x\n")


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(devices=["cpu"]) as p:
        first = check(REFERENCE, probe("pass"), config=CONFIG, pool=p)
        assert first.correct, first.feedback
        yield p


def need(pool, *layers: str) -> None:
    state = pool.sandbox_state or {}
    missing = [name for name in layers if not state.get(name)]
    if missing:
        pytest.skip(f"{describe(state)}; warnings: {state.get('warnings')}")


def run(pool, body: str):
    r = check(REFERENCE, probe(body), config=CONFIG, pool=pool)
    assert r.correct, (r.error or {}).get("message", r.feedback)
    return r


def test_the_report_says_what_isolates_the_candidate(pool):
    r = run(pool, "pass")
    assert r.timing["sandbox"].startswith("sandbox: ") and r.timing["sandbox"] == describe(pool.sandbox_state)


def test_no_other_process_is_visible(pool):
    need(pool, "pid_namespace", "proc_hidden")
    caller = os.getpid()
    run(pool, f'''
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        if {caller} in pids or max(pids) > 64:
            escaped.append(("processes", pids[:20]))
        for name in ("environ", "cmdline", "maps"):
            try:
                escaped.append((name, open("/proc/{caller}/" + name, "rb").read()[:40]))
            except OSError:
                pass
    ''')


def test_the_file_system_is_read_only_but_the_private_folder(pool, tmp_path):
    need(pool, "read_only_root")
    target = tmp_path / "written-by-candidate"
    run(pool, f'''
        for path in ({str(target)!r}, "/usr/lib/stitchcuda-probe", os.path.expanduser("~root") + "/probe"):
            try:
                open(path, "w").write("x")
                escaped.append(("wrote", path))
            except OSError:
                pass
        scratch = tempfile.NamedTemporaryFile(suffix=".cu")  # the private folder works
        scratch.write(b"ok"); scratch.flush()
        if not os.environ["STITCHCUDA_CACHE_DIR"].startswith(os.environ["TMPDIR"].rsplit("/", 1)[0]):
            escaped.append(("kernel cache outside the private folder", os.environ["STITCHCUDA_CACHE_DIR"]))
    ''')
    assert not target.exists()


def test_no_privileges_survive_into_the_worker(pool):
    need(pool, "no_privileges")
    run(pool, '''
        caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith(("CapEff", "CapPrm"))]
        if any(int(c, 16) for c in caps):
            escaped.append(("capabilities", caps))
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(None, b"/", None, 32 | 4096, None) == 0:  # MS_REMOUNT | MS_BIND: read-write again
            escaped.append("remounted / read-write")
        if libc.umount2(b"/proc", 2) == 0:  # MNT_DETACH: the machine's /proc underneath
            escaped.append("unmounted /proc")
    ''')


def test_credential_files_are_covered(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text("aws_secret_access_key = planted-aws-0123456789")
    (home / ".netrc").write_text("machine example login me password planted-netrc-0123456789")
    monkeypatch.setenv("HOME", str(home))
    with WorkerPool(devices=["cpu"]) as fresh:  # started with this HOME
        check(REFERENCE, probe("pass"), config=CONFIG, pool=fresh)
        need(fresh, "user_namespace")
        run(fresh, f'''
            for path in ({str(home / ".aws" / "credentials")!r}, {str(home / ".netrc")!r}):
                try:
                    text = open(path).read()
                    if "planted" in text:
                        escaped.append((path, text[:20]))
                except OSError:
                    pass
        ''')
        # Covered where the home folder is in the worker's view; out of the view (sandbox.SYSTEM_PATHS and
        # the import path are all it shows) it is not there at all.
        state = fresh.sandbox_state
        assert str(home / ".netrc") in state["hidden"] or (state.get("view") and not state["hidden"])


def test_the_probes_do_see_out_without_the_sandbox(tmp_path):
    """The probes are not blind: with the sandbox off the same writes and reads succeed."""
    target = tmp_path / "written-by-candidate"
    caller = os.getpid()
    with WorkerPool(devices=["cpu"], sandbox=False) as bare:
        r = check(REFERENCE, probe(f'''
            open({str(target)!r}, "w").write("x")
            escaped.append(("cmdline", open("/proc/{caller}/cmdline", "rb").read()[:10]))
        '''), config=CONFIG, pool=bare)
        assert "ESCAPED" in r.error["message"] and target.exists()
        assert r.timing["sandbox"].startswith("sandbox: off")


def test_the_sandbox_can_be_turned_off_by_the_environment():
    # The pool reads STITCHCUDA_SANDBOX through the settings (read once per process): set it there.
    with override(STITCHCUDA_SANDBOX="0"), WorkerPool(devices=["cpu"]) as p:
        assert not p.sandbox


def test_a_preprocessor_bomb_in_a_static_check_costs_the_worker_not_the_caller(pool):
    """static_only compiles run in the worker too: a macro that expands to 2^32 tokens is stopped at the
    compile limit (or the memory limit), and the caller's process never runs NVRTC on it."""
    defines = "\\n".join(["#define A0 x"] + [f"#define A{i} A{i - 1} A{i - 1}" for i in range(1, 33)])
    bomb = ("import torch\nimport torch.nn as nn\nfrom stitchcuda import jit\n\n"
            f"SOURCE = '''\n{defines}\nA32\n'''\n\n_k = jit.compile(SOURCE, 'k')\n\n"
            "class ModelNew(nn.Module):\n    def forward(self, x):\n        return x + x\n")
    config = VerifyConfig(device="cpu", compile_time_limit_s=5, run_time_limit_s=5)
    start = time.monotonic()
    r = check(REFERENCE, bomb, config=config, static_only=True, pool=pool)
    elapsed = time.monotonic() - start
    assert r.error is not None and r.error["kind"] in ("timeout", "oom"), r.error
    assert elapsed < 5 + 5 + 2, elapsed  # the limit, the pool's grace, and the report
    honest = check(REFERENCE, probe("pass"), config=CONFIG, static_only=True, pool=pool)
    assert honest.error is None and honest.static_only and honest.undecided
