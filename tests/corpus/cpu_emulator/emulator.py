"""Runs the CUDA of stitchcuda.jit candidates on the CPU (see cuda_on_cpu.hpp), so honest candidates
can be checked for the right answer on machines without a GPU.

``EmulatedJit(workdir).install(monkeypatch)`` replaces ``jit.compile`` / ``jit.compile_module``:
each source is built with g++ into a shared library and its kernels are launched, like
``stitchcuda.jit.Kernel``, as ``kernel(grid, block, *args, shared_mem=0)`` on CPU tensors. Launch
arguments are checked as the real launcher checks them (count, contiguity, dtype, scalar kinds).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from stitchcuda import jit

HERE = Path(__file__).resolve().parent
_SCALARS = {"int": ctypes.c_int, "unsigned": ctypes.c_uint, "long long": ctypes.c_longlong,
            "int64_t": ctypes.c_longlong, "float": ctypes.c_float, "double": ctypes.c_double,
            "bool": ctypes.c_bool}
_DTYPES = {"float": torch.float32, "float4": torch.float32, "int": torch.int32, "long long": torch.int64}


def unavailable() -> str | None:
    """Why the emulator cannot run here (no C++20 compiler with <barrier>), or None."""
    if shutil.which("g++") is None:
        return "g++ not found"
    probe = subprocess.run(["g++", "-std=c++20", "-fsyntax-only", "-x", "c++", "-"],
                           input="#include <barrier>\nstd::barrier<> b{1};\n", text=True,
                           capture_output=True)
    return None if probe.returncode == 0 else "g++ lacks C++20 <barrier>"


class EmulatedKernel:
    def __init__(self, library: ctypes.CDLL, launch, source: str, name: str) -> None:
        self.name = name
        self.signature = jit.declared_signature(source, name)
        if not self.signature:
            raise ValueError(f"kernel {name}: no declared signature (templates are not emulated)")
        self._fn = getattr(library, name)
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p if t.endswith("*") else _SCALARS[t.replace("const ", "").strip()]
                             for t in self.signature]
        self._launch = launch

    def __call__(self, grid, block, *args, shared_mem=0, stream=None, cluster=None) -> None:
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name} takes {len(self.signature)} arguments, {len(args)} given")
        if stream is not None or cluster is not None:
            raise NotImplementedError("the emulator runs on one implicit stream, without clusters")
        values = []
        for i, (arg, decl) in enumerate(zip(args, self.signature)):
            where = f"{self.name} argument {i} ({decl})"
            if torch.is_tensor(arg):
                if not decl.endswith("*"):
                    raise TypeError(f"{where}: a tensor where a value is declared")
                if not arg.is_contiguous():
                    raise ValueError(f"{where}: not contiguous")
                want = _DTYPES.get(decl.replace("const", "").replace("*", "").strip())
                if want is not None and arg.dtype != want:
                    raise TypeError(f"{where}: {arg.dtype}, expected {want}")
                values.append(arg.data_ptr())
            else:
                if decl.endswith("*"):
                    raise TypeError(f"{where}: {arg!r} where a pointer is declared")
                if isinstance(arg, float) and "float" not in decl and "double" not in decl:
                    raise TypeError(f"{where}: a float where an integer is declared")
                values.append(arg)
        dims = []
        for value in (grid, block):
            d = list(value) if isinstance(value, (tuple, list)) else [value]
            dims.append(d + [1] * (3 - len(d)))
        (gx, gy, gz), (bx, by, bz) = dims
        if min(gx, gy, gz, bx, by, bz) <= 0 or bx * by * bz > 1024 or (bx * by * bz) % 32:
            raise ValueError(f"{self.name}: launch geometry {grid} x {block} is not emulated")
        fn = self._fn
        body = ctypes.CFUNCTYPE(None)(lambda: fn(*values))  # ctypes drops the GIL inside fn
        self._launch(gx, gy, gz, bx, by, bz, shared_mem, ctypes.cast(body, ctypes.c_void_p))


class EmulatedModule:
    def __init__(self, emulator: "EmulatedJit", source: str) -> None:
        self._source = source
        self._library = emulator.build(source)
        self._launch = self._library.emu_launch
        self._launch.argtypes = [ctypes.c_int] * 6 + [ctypes.c_size_t, ctypes.c_void_p]
        self._launch.restype = None

    def kernel(self, name: str, signature=None) -> EmulatedKernel:
        return EmulatedKernel(self._library, self._launch, self._source, name)


def _cache_dir() -> Path:
    """Where built kernels are kept between runs (like ccache for the C++ build): STITCHCUDA_EMULATOR_CACHE,
    else the user's cache folder. Entries are keyed by everything that goes into the build."""
    folder = os.environ.get("STITCHCUDA_EMULATOR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stitchcuda", "emulator")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    return path


_FLAGS = ["-std=c++20", "-O1", "-fPIC"]


def _toolchain_key() -> str:
    """The compiler and the emulator's own sources: a change to any of them builds everything again."""
    version = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    parts = [version, " ".join(_FLAGS), (HERE / "cuda_on_cpu.hpp").read_text(), (HERE / "launch.cpp").read_text()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


class EmulatedJit:
    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._cache = _cache_dir()
        self._key = _toolchain_key()
        self._runtime = self._cache / f"launch-{self._key}.o"
        if not self._runtime.exists():
            built = self.workdir / "launch.o"
            subprocess.run(["g++", *_FLAGS, "-c", str(HERE / "launch.cpp"), "-o", str(built)], check=True)
            os.replace(built, self._runtime)  # atomic: parallel test workers may build it at once

    def build(self, source: str) -> ctypes.CDLL:
        text = re.sub(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;",
                      r"\1* \2 = reinterpret_cast<\1*>(emu_dynamic_shared);", source)
        digest = hashlib.sha256((self._key + text).encode()).hexdigest()[:24]
        library = self._cache / f"k{digest}.so"
        if not library.exists():
            cpp = self.workdir / f"k{digest}.cpp"
            cpp.write_text('#include "cuda_on_cpu.hpp"\n' + text)
            built = self.workdir / f"k{digest}.so"
            done = subprocess.run(["g++", *_FLAGS, "-shared", "-w", f"-I{HERE}", str(cpp), str(self._runtime),
                                   "-o", str(built), "-lpthread"], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"emulator build failed:\n{done.stderr[-4000:]}")
            os.replace(built, library)
        return ctypes.CDLL(str(library))

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(jit, "compile", lambda source, name, **_: EmulatedModule(self, source).kernel(name))
        monkeypatch.setattr(jit, "compile_module", lambda source, **_: EmulatedModule(self, source))
