"""The Pythonic JIT API: compile CUDA C++ with NVRTC (cached) and launch kernels on torch tensors.

Thin by design: options become the dict ``stitchcuda._C.compile`` takes, and a launch forwards
straight to the native launcher so the per-launch cost stays in C++.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from . import _C
from .errors import InvalidArgumentError

__all__ = [
    "compile",
    "compile_module",
    "Kernel",
    "Module",
    "KernelAttributes",
    "Param",
    "declared_signature",
    "cache_stats",
    "cache_dir",
    "set_cache_dir",
    "clear_memory_cache",
    "synchronize",
    "compiled_kernel_names",
    "check_includes",
    "confine_includes",
    "includes_confined",
]


@dataclass(frozen=True)
class KernelAttributes:
    """Per-device facts about a compiled kernel, as the driver reports them."""

    num_registers: int  # registers per thread
    static_shared_bytes: int  # __shared__ arrays
    max_dynamic_shared_bytes: int  # dynamic shared memory currently allowed
    local_bytes: int  # local memory per thread (spills, stack)
    const_bytes: int  # __constant__ data
    max_threads_per_block: int  # limited by registers and __launch_bounds__
    ptx_version: int  # e.g. 90
    binary_version: int  # e.g. 90


class Param(NamedTuple):
    """One kernel parameter as PTX declares it: kind ("u64" for pointers, "f32", "bytes"...) and size."""

    kind: str
    size: int


_ATTRIBUTE_FIELDS = tuple(f.name for f in fields(KernelAttributes))


class Kernel:
    """A compiled kernel, launchable as ``kernel(grid, block, *args, shared_mem=0, stream=None)``.

    grid, block and cluster are an int or a tuple of 1-3 ints; args are torch tensors (their data
    pointer is passed), ints, floats or bools, in declaration order. The kernel runs on PyTorch's
    current stream of the tensors' device unless ``stream`` (a torch.cuda.Stream or a raw handle) is
    given. Tensor dtypes are checked against ``signature`` when it is known.
    """

    __slots__ = ("_native", "_launch", "_module")

    def __init__(self, native: Any, module: "Module", signature: Sequence[str] | None = None) -> None:
        # The native kernel keeps the signature (declared in the source unless given here), so a
        # launch passes none and nothing is converted per call.
        if signature is not None:
            native.signature = list(signature)
        self._native = native
        # Bound once: __call__ is on the launch hot path, so it avoids attribute lookups per call.
        self._launch = native.launch
        self._module = module

    def __call__(self, grid, block, *args, shared_mem=0, stream=None, cluster=None) -> None:
        self._launch(grid, block, args, shared_mem, stream, cluster)

    def launch(self, grid, block, args: Sequence[Any] = (), shared_mem: int = 0, stream: Any = None,
               cluster: Any = None) -> None:
        """Same as calling the kernel, with the arguments as one sequence."""
        self._launch(grid, block, args, shared_mem, stream, cluster)

    @property
    def name(self) -> str:
        """The name asked for: an extern "C" name or a name expression such as ``scale<float>``."""
        return self._native.name

    @property
    def symbol(self) -> str:
        """The symbol in the binary (mangled unless extern "C")."""
        return self._native.symbol

    @property
    def params(self) -> list[Param]:
        """Parameters in declaration order, as PTX declares them."""
        return [Param(kind, size) for kind, size in self._native.params]

    @property
    def signature(self) -> list[str] | None:
        """Declared parameter types ("const float*", "int") used to check tensors, or None."""
        signature = self._native.signature
        return list(signature) if signature else None

    @property
    def module(self) -> "Module":
        """The compiled module this kernel belongs to (PTX, CUBIN, log, cache origin...)."""
        return self._module

    @property
    def attributes(self) -> KernelAttributes:
        """Registers, shared and local memory, thread limit on the current device (needs a GPU)."""
        return self.attributes_on(-1)

    def attributes_on(self, device: int) -> KernelAttributes:
        """Attributes on one device (-1: the current one)."""
        raw = self._native.attributes(device)
        return KernelAttributes(**{name: int(raw[name]) for name in _ATTRIBUTE_FIELDS})

    def occupancy(self, block_size: int, shared_mem: int = 0, device: int = -1) -> int:
        """Resident blocks per multiprocessor at this block size and dynamic shared memory."""
        return self._native.max_active_blocks_per_sm(block_size, shared_mem, device)

    def __repr__(self) -> str:
        params = ", ".join(self.signature or [kind for kind, _ in self._native.params])
        return f"<stitchcuda.jit.Kernel {self.name}({params}) arch={self._module.arch}>"


class Module:
    """One compiled program: machine code, PTX, the compiler log and where it came from."""

    __slots__ = ("_native", "_source")

    def __init__(self, native: Any, source: str) -> None:
        self._native = native
        self._source = source

    def kernel(self, name: str, signature: Sequence[str] | None = None) -> Kernel:
        """The kernel called ``name`` (extern "C" name, symbol or name expression).

        ``signature`` defaults to the parameter types declared in the source; NotFoundError
        lists the kernels that exist.
        """
        kernel = Kernel(self._native.kernel(name), self, signature)
        _COMPILED.add(name.split("<")[0].strip())
        return kernel

    @property
    def arch(self) -> str:
        """The architecture the CUBIN is for, e.g. "sm_90a"."""
        return self._native.arch

    @property
    def ptx(self) -> str:
        return self._native.ptx

    @property
    def cubin(self) -> bytes:
        """Machine code (empty for compute_XX targets)."""
        return self._native.cubin

    @property
    def log(self) -> str:
        """NVRTC's log (warnings) of the compile that produced this module."""
        return self._native.log

    @property
    def key(self) -> str:
        """Cache key (hex SHA-256) of source, options, headers, NVRTC and library versions, arch."""
        return self._native.key

    @property
    def origin(self) -> str:
        """"compiled", "memory" (in-process cache) or "disk" (on-disk store)."""
        return self._native.origin

    @property
    def compile_ms(self) -> float:
        """Milliseconds NVRTC took (0 when the module came from a cache)."""
        return self._native.compile_ms

    @property
    def kernel_names(self) -> list[str]:
        """Symbols of every kernel entry point in the program."""
        return list(self._native.kernel_names)

    @property
    def lowered_names(self) -> dict[str, str]:
        """Name expression -> symbol, for the name expressions asked for."""
        return dict(self._native.lowered_names)

    @property
    def source(self) -> str:
        return self._source

    def __repr__(self) -> str:
        return (f"<stitchcuda.jit.Module {self.arch} origin={self.origin} "
                f"kernels={self.kernel_names} key={self.key[:12]}>")


def _options(
    *,
    arch: str | None,
    std: int,
    include_paths: Iterable[str | os.PathLike],
    defines: Mapping[str, Any] | None,
    headers: Mapping[str, str] | None,
    fast_math: bool,
    line_info: bool,
    max_registers: int,
    name_expressions: Iterable[str],
    pch: str,
    extra_flags: Iterable[str],
    device_runtime: bool = False,
) -> dict[str, Any]:
    """The options dict of ``_C.compile``; validation of values is left to the native side."""
    options: dict[str, Any] = {
        "std": std,
        "include_paths": [os.fspath(p) for p in include_paths],
        # None gives a bare -DNAME; other values are spelled as C++ would see them.
        "defines": {str(k): ("" if v is None else _define_value(v)) for k, v in (defines or {}).items()},
        "headers": {str(k): str(v) for k, v in (headers or {}).items()},
        "fast_math": bool(fast_math),
        "line_info": bool(line_info),
        "max_registers": max_registers,
        "name_expressions": list(name_expressions),
        "pch": pch,
        "extra_flags": list(extra_flags),
        "device_runtime": bool(device_runtime),
    }
    if arch is not None:
        options["arch"] = arch
    return options


def _define_value(value: Any) -> str:
    if isinstance(value, bool):  # before int: True must become 1, not "True"
        return "1" if value else "0"
    return str(value)


def compile(
    source: str,
    name: str,
    *,
    arch: str | None = None,
    std: int = 17,
    include_paths: Iterable[str | os.PathLike] = (),
    defines: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    fast_math: bool = False,
    line_info: bool = False,
    max_registers: int = 0,
    name_expressions: Iterable[str] = (),
    pch: str = "auto",
    extra_flags: Iterable[str] = (),
    device_runtime: bool = False,
    signature: Sequence[str] | None = None,
    cache: bool = True,
    program_name: str = "kernel.cu",
    confined: bool = False,
) -> Kernel:
    """Compiles ``source`` with NVRTC (through the kernel cache) and returns the kernel ``name``.

    ``name`` is an extern "C" kernel name, a symbol, or a template name expression such as
    ``"scale<float, 4>"`` (added to ``name_expressions`` automatically). ``arch`` defaults to the
    current GPU's architecture, else sm_90a. ``signature`` (parameter types such as
    ``["const float*", "int"]``) defaults to what the source declares; it is used to check tensor
    dtypes at launch. ``device_runtime=True`` compiles relocatable code and links the CUDA device
    runtime (nvJitLink + libcudadevrt.a), for kernels that launch graphs or grids themselves. Raises CompileError (with ``.log``, ``.line``, ``.diagnostics``),
    InvalidArgumentError for bad options and NotFoundError when the kernel does not exist.
    """
    name_expressions = list(name_expressions)
    if "<" in name and name not in name_expressions:
        name_expressions.append(name)
    module = compile_module(
        source, arch=arch, std=std, include_paths=include_paths, defines=defines, headers=headers,
        fast_math=fast_math, line_info=line_info, max_registers=max_registers,
        name_expressions=name_expressions, pch=pch, extra_flags=extra_flags, device_runtime=device_runtime,
        cache=cache, program_name=program_name, confined=confined)
    return module.kernel(name, signature)


def compile_module(
    source: str,
    *,
    arch: str | None = None,
    std: int = 17,
    include_paths: Iterable[str | os.PathLike] = (),
    defines: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    fast_math: bool = False,
    line_info: bool = False,
    max_registers: int = 0,
    name_expressions: Iterable[str] = (),
    pch: str = "auto",
    extra_flags: Iterable[str] = (),
    device_runtime: bool = False,
    cache: bool = True,
    program_name: str = "kernel.cu",
    confined: bool = False,
) -> Module:
    """Compiles a program holding several kernels; take each with ``Module.kernel(name)``.
    ``confined``: the source is untrusted, so the include rule applies (see ``check_includes``)."""
    options = _options(
        arch=arch, std=std, include_paths=include_paths, defines=defines, headers=headers,
        fast_math=fast_math, line_info=line_info, max_registers=max_registers,
        name_expressions=name_expressions, pch=pch, extra_flags=extra_flags, device_runtime=device_runtime)
    options["confined"] = bool(confined)  # the native compile applies the include rule before anything else
    module = Module(_C.compile(source, program_name, options, cache), source)
    _COMPILED.update(module.kernel_names)
    return module


# Every kernel name this process compiled (symbols, and the names kernels were asked for): the
# Verifier's worker attributes the GPU time CUPTI sees to the candidate by them (verify/attribution.py).
_COMPILED: set[str] = set()


def compiled_kernel_names() -> frozenset[str]:
    """The kernels compiled through this module in this process: symbols and requested names."""
    return frozenset(_COMPILED)


def check_includes(source: str, *, include_paths: Iterable[str | os.PathLike] = (),
                   headers: Mapping[str, str] | None = None, extra_flags: Iterable[str] = (),
                   name_expressions: Iterable[str] = (), defines: Mapping[str, Any] | None = None,
                   program_name: str = "kernel.cu") -> None:
    """The include rule for untrusted CUDA, on its own: every ``#include`` names an in-memory header or a
    header inside the CUDA toolkit's include folders (CCCL among them) — no absolute paths, ``..``,
    macro-computed includes or links out of them; include paths inside those folders; extra flags limited
    to code generation and macros. The source is read the way the preprocessor reads it (line splices,
    ``%:`` digraphs, form feeds, comments and string literals, ``__has_include``), a quoted include that a
    same-named file in the working folder would answer is refused, and name expressions, macro values and
    the program name can carry no directive. Raises InvalidArgumentError naming the directive or flag."""
    options = {"include_paths": [os.fspath(p) for p in include_paths],
               "headers": {str(k): str(v) for k, v in (headers or {}).items()}, "extra_flags": list(extra_flags),
               "name_expressions": list(name_expressions),
               "defines": {str(k): ("" if v is None else _define_value(v)) for k, v in (defines or {}).items()}}
    _C.check_includes(source, options, program_name)  # the one implementation: src/jit/includes.cpp


def confine_includes() -> None:
    """Every later compile in this process follows the include rule (``check_includes``); it cannot be
    undone. The Verifier's worker calls it before it loads a candidate."""
    _C.confine_includes()


def includes_confined() -> bool:
    """Whether ``confine_includes()`` was called in this process."""
    return bool(_C.includes_confined())


def declared_signature(source: str, kernel_name: str) -> list[str]:
    """Parameter types of ``__global__ void kernel_name(...)`` in source; [] for templates or if absent."""
    return list(_C.declared_signature(source, kernel_name))


def cache_stats() -> dict[str, int]:
    """Counters of the process-wide cache: memory_hits, disk_hits, misses, compiles,
    corrupt_entries, disk_errors (since the cache folder was last set)."""
    return dict(_C.cache_stats())


def cache_dir() -> str:
    """The on-disk cache folder ("" when the cache is memory only)."""
    return _C.cache_dir()


def set_cache_dir(path: str | os.PathLike) -> None:
    """Moves the process-wide cache to ``path`` ("" = memory only); StitchIOError if unusable."""
    _C.set_cache_dir(os.fspath(path))


def clear_memory_cache() -> None:
    """Drops in-memory cache entries; the disk store stays, so the next compile is a disk hit."""
    _C.cache_clear_memory()


def synchronize(device: int = -1) -> None:
    """Waits for all work on a device; a fault in an earlier kernel is raised here as a StitchError."""
    _C.synchronize(device)
