"""The Pythonic JIT API: compile CUDA C++ with NVRTC (cached) and launch kernels on torch tensors.

Thin by design: options become the dict ``stitchcuda._C.compile`` takes, and a launch forwards
straight to the native launcher so the per-launch cost stays in C++.
"""

from __future__ import annotations

import bisect
import os
import re
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
    options["confined"] = bool(confined)
    if confined or includes_confined():
        _check_untrusted(source, options, program_name)
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
    _check_untrusted(source, options, program_name)
    _C.check_includes(source, {k: options[k] for k in ("include_paths", "headers", "extra_flags")})


# ---------------------------------------------------------------------------------------------------
# The include rule, read as the preprocessor reads the text (a second line behind the native rule, which
# the compile applies too; the Verifier also compiles untrusted CUDA only inside its sandbox).

_RULE = "untrusted CUDA may include only the CUDA toolkit's headers (CCCL among them) and in-memory headers"
_SPLICE = re.compile(r"\\[ \t\f\v]*\n")  # a backslash, blanks, the line's end: one logical line
_STRICT_SPLICE = re.compile(r"\\\n")
_BLANK = " \t\f\v"
_IDENT = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")
_PP_NUMBER = re.compile(r"\.?[0-9](?:[eEpP][+-]|[A-Za-z0-9_.']|\\u[0-9A-Fa-f]{4})*")
_STRING_PREFIXES = ("u8", "u", "U", "L")
_SAFE_EXPRESSION = re.compile(r"[A-Za-z0-9_:<>,*&()\[\] .+\-]*")


def _check_untrusted(source: str, options: Mapping[str, Any], program_name: str) -> None:
    if "/" in program_name or "\\" in program_name or program_name in (".", ".."):
        raise InvalidArgumentError(f"program_name {program_name!r}: untrusted CUDA is compiled under a bare file "
                                   "name (NVRTC searches the program's folder for quoted includes)")
    for expression in options.get("name_expressions") or ():
        if not _SAFE_EXPRESSION.fullmatch(expression):
            raise InvalidArgumentError(f"name expression {expression!r} holds characters no C++ name needs "
                                       "(NVRTC pastes name expressions into the program text)")
    values = list((options.get("defines") or {}).items())
    values += [(f, f) for f in options.get("extra_flags") or ()]
    for name, value in values:
        if any(ord(ch) < 32 for ch in str(name) + str(value)):
            raise InvalidArgumentError(f"macro {str(name)[:40]!r}: a control character (a line break) in a macro "
                                       "or flag would start a directive of its own; remove it")
    headers = dict(options.get("headers") or {})
    texts = [(program_name, source)] + list(headers.items())
    for where, text in texts:
        # Compilers differ on trigraphs and on blanks between a backslash and the line's end: every
        # reading is checked, so that none of them hides a directive another one sees.
        for trigraphs in (False, True):
            for loose in (False, True):
                for line, kind, name, quoted in _directives(text, trigraphs, loose):
                    _check_one(where, line, kind, name, quoted, headers, options, program_name)


def _directives(text: str, trigraphs: bool, loose: bool) -> list[tuple[int, str, str | None, bool]]:
    """(line, kind, header name or None when computed, whether quoted) of every #include-like directive and every
    __has_include in ``text``, read after translation phases 1-3: line ends normalized, trigraphs
    (``trigraphs``) and backslash-newline splices (with blanks before the line end: ``loose``) resolved,
    comments dropped, string and character literals (raw ones included) skipped, ``%:`` read as ``#``,
    any blank (form feed and vertical tab too) before it. A directive name spelled with a universal
    character name or a non-ASCII letter is reported as computed."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if trigraphs:
        text = text.replace("??=", "#").replace("??/", "\\")
    splices: list[int] = []  # offsets in the joined text where a line break was removed

    removed = [0]

    def join(m: re.Match) -> str:
        splices.append(m.start() - removed[0])
        removed[0] += len(m.group(0))
        return ""

    text = (_SPLICE if loose else _STRICT_SPLICE).sub(join, text)

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + bisect.bisect_right(splices, pos) + 1

    found: list[tuple[int, str, str | None, bool]] = []
    n, i, line_start = len(text), 0, True

    def blanks(j: int) -> int:  # blanks and /* */ comments within the line
        while j < n:
            if text[j] in _BLANK:
                j += 1
            elif text.startswith("/*", j):
                end = text.find("*/", j + 2)
                j = n if end < 0 else end + 2
            else:
                return j
        return j

    def header_name(j: int) -> tuple[str | None, int]:
        if j < n and text[j] in "<\"":
            close = ">" if text[j] == "<" else '"'
            end = text.find(close, j + 1)
            newline = text.find("\n", j + 1)
            if end >= 0 and (newline < 0 or end < newline):
                return text[j + 1:end], end + 1
        return None, j

    while i < n:
        c = text[i]
        if c == "\n":
            line_start, i = True, i + 1
        elif c in _BLANK:
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
        elif line_start and (c == "#" or text.startswith("%:", i)):
            line_start = False
            j = blanks(i + (1 if c == "#" else 2))
            m = _IDENT.match(text, j)
            if j < n and (text[j] == "\\" or ord(text[j]) > 127 or (m and m.end() < n and (
                    text[m.end()] == "\\" or ord(text[m.end()]) > 127))):
                found.append((line_of(i), "directive", None, False))  # a name the rule cannot read: refused
                i = j + 1
            elif m and m.group(0) in ("include", "include_next", "import", "embed"):
                start = blanks(m.end())
                name, after = header_name(start)
                found.append((line_of(i), m.group(0), name, text.startswith('"', start)))
                i = after if name is not None else m.end()
            else:
                i = m.end() if m else j
        else:
            line_start = False
            m = _IDENT.match(text, i)
            if m:
                word, i = m.group(0), m.end()
                if i < n and text[i] in "\"'" and word in _STRING_PREFIXES + ("R", "u8R", "uR", "UR", "LR"):
                    i = _skip_literal(text, i, raw=word.endswith("R") and text[i] == '"')
                elif word in ("__has_include", "__has_include_next"):
                    j = blanks(i)
                    name, start = None, j
                    if j < n and text[j] == "(":
                        start = blanks(j + 1)
                        name, after = header_name(start)
                        if name is not None and blanks(after) < n and text[blanks(after)] == ")":
                            i = after
                        else:
                            name = None
                    found.append((line_of(m.start()), word, name, text.startswith('"', start)))
            elif c in "\"'":
                i = _skip_literal(text, i, raw=False)
            else:
                m = _PP_NUMBER.match(text, i)
                i = m.end() if m else i + 1
    return found


def _skip_literal(text: str, i: int, raw: bool) -> int:
    """The offset after the string or character literal that starts at ``text[i]`` (a quote)."""
    if raw:  # R"delim( ... )delim"
        open_paren = text.find("(", i + 1)
        if open_paren < 0 or open_paren - i - 1 > 16:
            return i + 1
        end = text.find(")" + text[i + 1:open_paren] + '"', open_paren)
        return len(text) if end < 0 else end + open_paren - i + 1
    quote, j = text[i], i + 1
    while j < len(text) and text[j] != "\n":
        if text[j] == "\\":
            j += 2
        elif text[j] == quote:
            return j + 1
        else:
            j += 1
    return j


def _check_one(where: str, line: int, kind: str, name: str | None, quoted: bool, headers: Mapping[str, str],
               options: Mapping[str, Any], program_name: str) -> None:
    spelled = kind if kind.startswith("_") else "#" + kind
    at = f"{where}:{line}: {spelled}"
    if kind in ("include_next", "import", "embed", "__has_include_next"):
        raise InvalidArgumentError(f"{at}: {spelled} is not allowed ({_RULE})")
    if kind == "directive":
        raise InvalidArgumentError(f"{where}:{line}: a directive spelled with a universal character name or a "
                                   f"non-ASCII letter is not allowed ({_RULE})")
    if name is None:
        what = "#include (a macro)" if kind == "include" else "__has_include (a macro)"
        raise InvalidArgumentError(f"{at}: a computed {what} cannot be checked ({_RULE})")
    if name in headers:
        return
    directive = f"#include <{name}>\n" if '"' in name else f'#include "{name}"\n'
    try:
        _C.check_includes(directive, {"include_paths": list(options.get("include_paths") or ()),
                                      "headers": {}, "extra_flags": []})
    except InvalidArgumentError as exc:
        # Whether a name is a toolkit header is all __has_include may learn; anything else is refused.
        if kind != "__has_include" or "is not a header of the CUDA toolkit" not in exc.message:
            reason = exc.message.split(": #include ", 1)[-1]
            reason = reason.split(": ", 1)[1] if reason.startswith(("<", '"')) and ": " in reason else reason
            raise InvalidArgumentError(f"{at} '{name}': {reason}") from None
    for folder in (os.getcwd(), os.path.dirname(os.path.abspath(program_name))) if quoted else ():
        if os.path.lexists(os.path.join(folder, name)):  # NVRTC looks there first for a quoted name
            raise InvalidArgumentError(f"{at} '{name}': a file of that name in the working folder would be read "
                                       f"instead of the toolkit's header ({_RULE}); compile elsewhere or pass it "
                                       "as an in-memory header")


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
