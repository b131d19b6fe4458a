"""`stitchcuda doctor`: what this machine has for StitchCUDA, and for each missing piece what to do.

Every probe is guarded, so a broken component shows up as a failed check instead of a traceback.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import _C
from .errors import StitchError
from .settings import settings

CUDA_MAJOR = 13  # the CUDA major version StitchCUDA is built and tested against
CUPTI_LIBRARY = f"libcupti.so.{CUDA_MAJOR}"


@dataclass
class Check:
    """One line of the report. ``required`` checks decide whether the machine is usable."""

    name: str
    ok: bool
    detail: str
    fix: str = ""  # what to do when not ok; a note when ok but limited (e.g. no GPU)
    required: bool = True


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every required check passed (optional ones such as CUPTI may be missing)."""
        return all(c.ok for c in self.checks if c.required)

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": [asdict(c) for c in self.checks]}


def _guarded(name: str, probe, required: bool = True) -> Check:
    try:
        return probe()
    except Exception as exc:  # a probe that breaks is itself a finding, never a crash
        return Check(name, False, f"probe failed: {type(exc).__name__}: {exc}",
                     "report this output with `stitchcuda doctor --json`", required)


def _check_python() -> Check:
    v = sys.version_info
    ok = v >= (3, 10)
    return Check("python", ok, f"{platform.python_version()} at {sys.executable}",
                 "" if ok else "use Python 3.10 or newer")


def _check_stitchcuda() -> Check:
    return Check("stitchcuda", True, f"{_C.version()} ({_C.__file__})")


def _check_nvrtc() -> Check:
    try:
        version, path = _C.nvrtc_version(), _C.nvrtc_path()
    except StitchError as exc:
        return Check("nvrtc", False, exc.message,
                     f"install NVRTC for CUDA {CUDA_MAJOR} (`pip install nvidia-cuda-nvrtc` — torch's "
                     f"cu{CUDA_MAJOR}0 wheels bring it — or the CUDA {CUDA_MAJOR} toolkit), or point "
                     f"STITCHCUDA_NVRTC at libnvrtc.so.{CUDA_MAJOR}")
    major = int(version.split(".")[0]) if version.split(".")[0].isdigit() else 0
    if major != CUDA_MAJOR:
        return Check("nvrtc", False, f"{version} at {path}",
                     f"StitchCUDA needs NVRTC {CUDA_MAJOR}.x: install it or set STITCHCUDA_NVRTC to "
                     f"a libnvrtc.so.{CUDA_MAJOR}")
    return Check("nvrtc", True, f"{version} at {path}")


def _check_archs() -> Check:
    archs = list(_C.supported_archs())
    default = _C.default_arch()
    detail = f"default {default}; supported: {' '.join(archs)}"
    if default.rstrip("a") not in {a.rstrip("a") for a in archs}:
        return Check("architectures", False, detail,
                     f"this NVRTC cannot target {default}: install a newer CUDA {CUDA_MAJOR} NVRTC")
    return Check("architectures", True, detail)


def _check_driver() -> Check:
    ok, reason = _C.driver_available()
    if not ok:
        return Check("driver", False, f"not available: {reason}",
                     "install the NVIDIA driver (580 or newer for CUDA 13) to run kernels; "
                     "compiling works without it", required=False)
    v = int(_C.driver_version())
    detail = f"CUDA driver API {v // 1000}.{(v % 1000) // 10}"
    if v // 1000 < CUDA_MAJOR:
        return Check("driver", False, detail,
                     f"the driver is older than CUDA {CUDA_MAJOR}: upgrade it (580 or newer)",
                     required=False)
    return Check("driver", True, detail)


def _check_gpus() -> Check:
    count = _C.device_count()
    if count == 0:
        return Check("gpu", True, "no GPU found",
                     f"no GPU: compile-only mode; kernels compile for {_C.default_arch()}",
                     required=False)
    lines = []
    for i in range(count):
        d = _C.device_info(i)
        lines.append(f"{i}: {d['name']} ({d['arch']}, {d['multiprocessors']} SMs, "
                     f"{d['total_memory'] / 2**30:.1f} GiB, "
                     f"{d['max_shared_per_block_optin'] // 1024} KiB shared/block)")
    return Check("gpu", True, "; ".join(lines), required=False)


def cuda_home() -> Path:
    """The CUDA toolkit folder: $CUDA_HOME, else $CUDA_PATH, else /usr/local/cuda (the C++ side's order)."""
    return settings().cuda_home or settings().cuda_path or Path("/usr/local/cuda")


def find_nvcc() -> str | None:
    """nvcc in the toolkit folder, else on PATH."""
    candidate = cuda_home() / "bin" / "nvcc"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("nvcc")


def _check_toolkit() -> Check:
    fix = f"install the CUDA {CUDA_MAJOR} toolkit at /usr/local/cuda or set CUDA_HOME"
    nvcc = find_nvcc()
    if nvcc is None:
        return Check("cuda toolkit", False, f"nvcc not found under {cuda_home()} or on PATH",
                     fix + " (needed to build StitchCUDA and for the load_inline baseline, "
                     "not for JIT compiles)", required=False)
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    version = f"{m.group(1)}.{m.group(2)}" if m else "unknown version"
    detail = f"nvcc {version} at {nvcc}"
    if not m or int(m.group(1)) != CUDA_MAJOR:
        return Check("cuda toolkit", False, detail, fix, required=False)
    return Check("cuda toolkit", True, detail)


def _cupti_candidates() -> list[Path]:
    folders: list[Path] = []
    # torch's CUDA wheels: site-packages/nvidia/cu13/lib (older wheels: nvidia/cuda_cupti/lib).
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        folders += [Path(root) / f"cu{CUDA_MAJOR}" / "lib", Path(root) / "cuda_cupti" / "lib"]
    for home in dict.fromkeys([cuda_home(), Path("/usr/local/cuda")]):
        folders += [home / "lib64", home / "extras" / "CUPTI" / "lib64",
                    home / "targets" / "x86_64-linux" / "lib"]
    return [f / CUPTI_LIBRARY for f in folders]


def _check_cupti() -> Check:
    fix = (f"install CUPTI for CUDA {CUDA_MAJOR} (`pip install nvidia-cuda-cupti`, or the toolkit's "
           "extras/CUPTI); only profiling needs it")
    for path in _cupti_candidates():
        if path.is_file():
            return Check("cupti", True, str(path))
    try:  # last resort: the dynamic loader's own search (LD_LIBRARY_PATH, ld.so.cache)
        ctypes.CDLL(CUPTI_LIBRARY)
        return Check("cupti", True, f"{CUPTI_LIBRARY} (found by the dynamic loader)")
    except OSError as exc:
        return Check("cupti", False, f"{CUPTI_LIBRARY} not found ({exc})", fix, required=False)


def _check_torch() -> Check:
    import torch

    with warnings.catch_warnings():  # no driver -> torch warns; the driver check already says so
        warnings.simplefilter("ignore")
        available = torch.cuda.is_available()
    cuda = torch.version.cuda
    detail = f"{torch.__version__}, CUDA {cuda}, torch.cuda.is_available() = {available}"
    if cuda is None:
        return Check("torch", False, detail,
                     f"install a CUDA build of torch (cu{CUDA_MAJOR}0 wheels) so kernels can run on its tensors")
    if int(cuda.split(".")[0]) != CUDA_MAJOR:
        return Check("torch", False, detail,
                     f"torch is built for CUDA {cuda} but StitchCUDA uses CUDA {CUDA_MAJOR}: two CUDA "
                     f"majors in one process do not mix; install torch's cu{CUDA_MAJOR}0 build")
    return Check("torch", True, detail)


def _check_cache() -> Check:
    folder = _C.cache_dir()
    warning = _C.cache_warning()
    if not folder:
        if warning:
            return Check("cache", False, f"memory only: {warning}",
                         "set STITCHCUDA_CACHE_DIR to a writable folder", required=False)
        return Check("cache", True, "memory only (STITCHCUDA_CACHE_DIR is empty)",
                     "set STITCHCUDA_CACHE_DIR to a folder to keep compiled kernels across runs",
                     required=False)
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".doctor-"):
            pass
    except OSError as exc:
        return Check("cache", False, f"{folder} is not writable ({exc})",
                     "make it writable or set STITCHCUDA_CACHE_DIR to a writable folder",
                     required=False)
    return Check("cache", True, f"{folder} (writable)" + (f"; {warning}" if warning else ""))


def doctor() -> Report:
    """Probes the machine: GPUs, driver, toolkit, NVRTC, CUPTI, torch, cache folder, Python."""
    probes = [
        ("gpu", _check_gpus, False),
        ("driver", _check_driver, False),
        ("cuda toolkit", _check_toolkit, False),
        ("nvrtc", _check_nvrtc, True),
        ("architectures", _check_archs, True),
        ("cupti", _check_cupti, False),
        ("torch", _check_torch, True),
        ("cache", _check_cache, False),
        ("python", _check_python, True),
        ("stitchcuda", _check_stitchcuda, True),
    ]
    return Report([_guarded(name, probe, required) for name, probe, required in probes])


def format_report(report: Report) -> str:
    """A readable table: one line per check, then the fix or note indented beneath it."""
    width = max(len(c.name) for c in report.checks)
    lines = []
    for c in report.checks:
        mark = "ok" if c.ok else ("FAIL" if c.required else "--")
        lines.append(f"[{mark:>4}] {c.name:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"{'':7} {'':<{width}}  {'fix' if not c.ok else 'note'}: {c.fix}")
    if report.ok:
        lines.append("All required checks passed.")
    else:
        failed = ", ".join(c.name for c in report.checks if c.required and not c.ok)
        lines.append(f"StitchCUDA is not usable here: fix {failed}.")
    return "\n".join(lines)
