"""Shared pytest set-up: the `gpu` marker (skipped with a reason where no GPU is present) and a
fresh kernel-cache folder per test, so cache tests never see entries from other tests or runs.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

# Tests run against the source tree (python/) unless the package is installed.
_PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"
if str(_PYTHON_DIR) not in sys.path:
    sys.path.insert(0, str(_PYTHON_DIR))

from stitchcuda import _C, jit  # noqa: E402

# A shell starts a background job (`make test &`) with SIGINT ignored, and an ignored signal stays ignored
# across exec: the tests that interrupt a child would see it run on as if Ctrl-C did nothing. With a
# handler here, the children they start get the default disposition, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped where none is present")
    config.addinivalue_line("markers", "slow: takes seconds (benchmarks, subprocesses)")


def _no_gpu_reason() -> str | None:
    if _C.device_count() > 0:
        return None
    ok, reason = _C.driver_available()
    return "no GPU: " + ("the driver reports no device" if ok else reason)


# Files that hold a worker for minutes (the wheel test builds the C++ package); under pytest-xdist they start
# first, so the other files fill the other workers meanwhile instead of one file running on alone at the end.
LONG_FILES = ("test_packaging.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike, the controller deals files
        items.sort(key=lambda item: item.path.name not in LONG_FILES)  # stable: each file keeps its order
    reason = _no_gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory: pytest.TempPathFactory):
    """Keeps the test run out of the user's cache folder (~/.cache/stitchcuda). Under pytest-xdist the
    workers share one folder (the parent of their own temporary folders), so a kernel one worker compiled
    is not compiled again by the next, as in a serial run; the cache's writes are atomic renames."""
    previous = jit.cache_dir()
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.mktemp("session-kernel-cache")
    else:
        folder = tmp_path_factory.getbasetemp().parent / "session-kernel-cache"
        folder.mkdir(exist_ok=True)
    jit.set_cache_dir(folder)
    yield
    jit.set_cache_dir(previous)


@pytest.fixture
def fresh_cache(tmp_path: Path):
    """A new, empty on-disk cache folder for the test; the previous folder is restored after."""
    previous = jit.cache_dir()
    folder = tmp_path / "kernel-cache"
    folder.mkdir()
    jit.set_cache_dir(folder)
    try:
        yield folder
    finally:
        jit.set_cache_dir(previous)


@pytest.fixture
def stitch_settings():
    """Overrides stitchcuda.settings until the test ends: stitch_settings(relayout=False) or, as the environment
    would hold it, stitch_settings(STITCHCUDA_SUITE_CHUNK="2/2") (None: as if unset)."""
    from contextlib import ExitStack

    from stitchcuda.settings import override

    with ExitStack() as stack:
        yield lambda **values: stack.enter_context(override(**values))


@pytest.fixture
def subprocess_env(tmp_path: Path) -> dict[str, str]:
    """Environment for child Pythons: this source tree importable, a private cache folder."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PYTHON_DIR), env.get("PYTHONPATH")]))
    env["STITCHCUDA_CACHE_DIR"] = str(tmp_path / "child-cache")
    return env

