"""Every environment variable StitchCUDA reads, declared once: its type, default and why it exists; read from
the environment once, parsed and validated there, and handed to the code as one typed object.

    from stitchcuda.settings import settings
    if settings().relayout: ...

    with override(tf32x3_chunk=0):                       # a test changes the object, not the environment
        ...
    with override(STITCHCUDA_SUITE_CHUNK="3/2"):         # or gives the text the environment would hold
        ...

The C++ library reads its own variables with getenv (it cannot see this object); they are declared here
too (`side="C++"`), so this one table covers both and docs/environment.md is generated from it:
`python -m stitchcuda.settings --markdown` prints the table, `--write-docs` puts it into the page.
A variable the Python planner mirrors from the C++ runtime (the tf32x3 and bf16 knobs) is `side="both"`:
overriding the Python value in a test does not reach the C++ side, which reads the environment at each run.

A bad value does not stop the package from importing: the setting holds the problem, and the code that
reads it gets a SettingsError (a ValueError) naming the variable, the value and the values it takes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SIDES = ("Python", "both", "C++", "scripts")


class SettingsError(ValueError):
    """An environment variable holds a value its setting does not take."""


# ---- what a variable takes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """How the text of a variable becomes a value. `takes` says in words what it accepts (for errors and the
    docs); parse raises ValueError for anything else. An empty or blank text counts as unset."""

    takes: str

    def parse(self, text: str) -> Any:
        return text


@dataclass(frozen=True)
class Flag(Kind):
    takes: str = "1 or 0 (also true/false, yes/no, on/off)"

    def parse(self, text: str) -> bool:
        word = text.strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise ValueError


@dataclass(frozen=True)
class Truthy(Kind):
    """Any value but 0/false/no is on: variables other tools set (CI=true, CI=woodpecker) are never refused."""

    takes: str = "any value; empty, 0, false and no are off"

    def parse(self, text: str) -> bool:
        return text.strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Count(Kind):
    takes: str = "a whole number (0, 1, 2, ...)"

    def parse(self, text: str) -> int:
        if not text.strip().isdigit():
            raise ValueError
        return int(text.strip())


@dataclass(frozen=True)
class Choice(Kind):
    values: tuple[str, ...] = ()
    as_int: bool = False  # "0"/"1"/"2" levels come back as ints

    def parse(self, text: str) -> Any:
        word = text.strip().lower()
        if word not in self.values:
            raise ValueError
        return int(word) if self.as_int else word


@dataclass(frozen=True)
class Text(Kind):
    takes: str = "text"


@dataclass(frozen=True)
class Folder(Kind):
    takes: str = "a path"

    def parse(self, text: str) -> Path:
        return Path(text)


@dataclass(frozen=True)
class Chunk(Kind):
    takes: str = "K/N with 1 <= K <= N"

    def parse(self, text: str) -> str:
        k, _, n = text.strip().partition("/")
        if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
            raise ValueError
        return text.strip()


def choice(*values: str, as_int: bool = False) -> Choice:
    return Choice(takes="one of " + ", ".join(values), values=values, as_int=as_int)


# ---- the declaration ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One environment variable: `name`, what it takes (`kind`), its value when unset (`default`, and
    `default_text` for the docs where the code decides), `side` (which code reads it: SIDES), `read_by`
    (where), and `reason` (one line: what it is for)."""

    name: str
    kind: Kind
    default: Any
    side: str
    read_by: str
    reason: str
    default_text: str = ""

    def parse(self, text: str | None) -> Any:
        """The value of `text` (None or blank: the default); SettingsError for a value the kind refuses."""
        if text is None or not text.strip():
            return self.default
        try:
            return self.kind.parse(text)
        except ValueError:
            raise SettingsError(f"{self.name} must be {self.kind.takes}, got {text!r}: set one of those or unset "
                                f"it (unset: {self.shown_default()})") from None

    def shown_default(self) -> str:
        if self.default_text:
            return self.default_text
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        return str(self.default)


def _var(name: str, kind: Kind, default: Any, read_by: str, reason: str, *, side: str = "Python",
         default_text: str = "") -> Any:
    """A field of Settings declaring its variable (the field's metadata holds the Setting)."""
    setting = Setting(name, kind, default, side, read_by, reason, default_text)
    return field(default=default, metadata={"setting": setting})


@dataclass(frozen=True)
class _Invalid:
    """What a field holds when its variable's text was refused: reading the field raises the message."""

    message: str


@dataclass(frozen=True, repr=False, eq=False)
class Settings:
    """The variables the Python code reads, one field each (the field's name is the variable's without
    STITCHCUDA_, in lower case). Reading a field whose variable held a bad value raises SettingsError."""

    # graph mode's planner and templates
    tf32x3_chunk: int | None = _var(
        "STITCHCUDA_TF32X3_CHUNK", Count(), None, "graph planner; tf32x3 matmul (C++) at each run",
        "elements of K per hi*hi product of tf32x3 (0: all of K), to measure accuracy against the result's "
        "extra passes", side="both", default_text="512")
    tf32x3_rows: int | None = _var(
        "STITCHCUDA_TF32X3_ROWS", Count(), None, "graph planner; tf32x3 matmul (C++)",
        "rows of a split per block of tf32x3 (0: a whole), for tests and measurements", side="both",
        default_text="chosen by the operands' size")
    tf32x3_cols: int | None = _var(
        "STITCHCUDA_TF32X3_COLS", Count(), None, "graph planner; tf32x3 matmul (C++)",
        "columns of the result per block of a transposed b in tf32x3 (0: a whole)", side="both",
        default_text="chosen by the operands' size")
    tf32x3_kblock: int | None = _var(
        "STITCHCUDA_TF32X3_KBLOCK", Count(), None, "graph planner; tf32x3 matmul (C++)",
        "elements of K per slab when tf32x3 splits both operands a slab of K at a time (0: never), rounded "
        "down to the K chunk", side="both", default_text="two slabs where the parts exceed 160 MiB and 4x the result")
    tf32x3_fuse_lo: int = _var(
        "STITCHCUDA_TF32X3_FUSE_LO", choice("0", "1", "2", as_int=True), 2, "graph planner; tf32x3 matmul (C++)",
        "0: tf32x3's three products apart; 1: the two lo products as one; 2: the first hi*hi chunk with them",
        side="both")
    bf16_cast: int = _var(
        "STITCHCUDA_BF16_CAST", choice("0", "1", "2", as_int=True), 1, "graph planner; bf16 matmul (C++)",
        "bf16 matmuls of fp32 operands as bf16 products: 0 never (TF32), 1 where K >= 256, 2 always",
        side="both")
    relayout: bool = _var(
        "STITCHCUDA_RELAYOUT", Flag(), True, "graph planner",
        "0: an elementwise chain read through views is stored and read back, not computed in its readers' layout")
    cat_in_place: bool = _var(
        "STITCHCUDA_CAT_IN_PLACE", Flag(), True, "graph planner",
        "0: a concatenation is an ATen step, not read in place by the elementwise kernel after it")
    conv_bias_apart: bool = _var(
        "STITCHCUDA_CONV_BIAS_APART", Flag(), True, "graph capture",
        "0: a convolution keeps its bias instead of the generated kernel after it adding it in its loads")
    hoist_index: bool = _var(
        "STITCHCUDA_HOIST_INDEX", Flag(), True, "graph capture",
        "0: an index of some positions (logits[:, -1]) stays where the forward has it, after the row-wise ops "
        "that computed every position (to measure the rewrite)")
    merge_launches: bool = _var(
        "STITCHCUDA_MERGE_LAUNCHES", Flag(), False, "graph lowering (graph/merge_launches.py)",
        "1: small launches of generated kernels that do not depend on one another run as one launch of a merged "
        "kernel (off until measured ahead on the GPU)")
    channels_last: str = _var(
        "STITCHCUDA_CHANNELS_LAST", choice("auto", "on", "off"), "auto", "graph planner (layout)",
        "auto: channels-last chains of tensor-core convolutions; on: of every eligible convolution (the NHWC "
        "path in true fp32); off: never")
    pointwise_loop: str = _var(
        "STITCHCUDA_POINTWISE_LOOP", choice("once", "stride"), "once", "graph's pointwise template",
        "once: a thread per few float4 of each operand, one pass; stride: a grid-stride loop (to measure the two)")
    attention: str = _var(
        "STITCHCUDA_ATTENTION", choice("sdpa", "auto", "fused", "off"), "auto", "graph planner (attention)",
        "auto: attention of decode's shape over a static cache (a few query tokens, a mask over the cached "
        "positions) the split-KV decode kernels, reading only the keys the mask keeps; prefill attention the fused "
        "template where it was measured ahead of SDPA (fp16/bf16 head dims 64 and 128, fp32 head dim 64, no mask); "
        "other attention as sdpa; "
        "sdpa: attention is one ATen SDPA step; fused: the decode kernels wherever decode's shape allows, else the "
        "fused prefill template; off: written-out attention stays its matmul and softmax groups")
    gemv: bool = _var(
        "STITCHCUDA_GEMV", Flag(), False, "graph planner (templates/gemv.py)",
        "1: projections of decode's shape (x of at most 16 rows) that share x run as one generated GEMV kernel "
        "(q, k and v; gate and up with SiLU(gate) * up fused); 0: a cuBLASLt matmul each (until measured on a GPU)")
    dynamic_padding: str = _var(
        "STITCHCUDA_DYNAMIC_PADDING", choice("on", "off"), "on", "optimize(dynamic=)",
        "on: a size is served by a larger member, zero-padded, where the range check allows; off: a member per "
        "size that occurs (to measure the two)")
    fuse_cache_write: bool = _var(
        "STITCHCUDA_FUSE_CACHE_WRITE", Flag(), False, "graph planner (KV cache writes)",
        "1: a KV cache's index_copy_ into a program state is a generated kernel, with its source's elementwise "
        "producers (RoPE), the layer's other cache write at the same index and its small int64 bookkeeping in "
        "the same launch, and small int64 adds are generated kernels; 0: ATen steps (until measured on a GPU)")
    # the agents
    docs_dir: Path | None = _var(
        "STITCHCUDA_DOCS_DIR", Folder(), None, "agents' retrieval (program mode, graph mode's agents, rl prompts)",
        "a folder of markdown files to retrieve from instead of the shipped corpus",
        default_text="python/stitchcuda/agents/corpus")
    # logging and progress
    log: str | None = _var(
        "STITCHCUDA_LOG", choice("debug", "info", "warning", "error"), None, "stitchcuda.log, at import and "
        "log.configure()", "level of the stitchcuda loggers (records go to stderr unless the application "
        "configured logging)", default_text="the root's level (warnings and errors)")
    ci: bool = _var(
        "CI", Truthy(), False, "progress views (stitchcuda.log)",
        "progress as plain lines, never redrawn in place (so is TERM=dumb, and a stderr that is not a terminal)")
    term: str | None = _var(
        "TERM", Text(), None, "progress views (stitchcuda.log)", "dumb: progress as plain lines")
    # the Verifier
    verify_worker_stderr: bool = _var(
        "STITCHCUDA_VERIFY_WORKER_STDERR", Flag(), False, "Verifier worker pool",
        "1 keeps the workers' stderr (for debugging a candidate)",
        default_text="0: workers' output goes to /dev/null")
    sandbox: bool = _var(
        "STITCHCUDA_SANDBOX", Flag(), True, "Verifier worker pool",
        "0 runs candidate workers without the sandbox's layers (namespaces, read-only tree, no network)")
    sandbox_state: str | None = _var(
        "STITCHCUDA_SANDBOX_STATE", Text(), None, "a Verifier worker, at its start",
        "set by the Verifier for its workers, not by users: the sandbox layers set up for the worker (JSON)")
    # the benchmarks
    bench_skip_load_inline: bool = _var(
        "STITCHCUDA_BENCH_SKIP_LOAD_INLINE", Flag(), False, "stitchcuda bench jit",
        "1 skips the load_inline baseline (load_inline_s is null, the reason in notes)",
        default_text="0: the baseline runs where nvcc exists")
    suite_dir: Path | None = _var(
        "STITCHCUDA_SUITE_DIR", Folder(), None, "stitchcuda bench suite", "the folder of suite models",
        default_text="bench/suite of the source tree")
    suite_only: str | None = _var(
        "STITCHCUDA_SUITE_ONLY", Text(), None, "stitchcuda bench suite / kernelbench (--only wins)",
        "a comma-separated subset of the problems' file stems", default_text="every problem")
    suite_chunk: str | None = _var(
        "STITCHCUDA_SUITE_CHUNK", Chunk(), None, "stitchcuda bench suite / kernelbench (--chunk wins)",
        "K/N: every N-th problem from the K-th (N runs cover the folder once)", default_text="every problem")
    memory_sites: int = _var(
        "STITCHCUDA_MEMORY_SITES", Count(), 0, "stitchcuda bench suite / kernelbench",
        "how many allocation sites of optimize()'s memory peak each row keeps (peak_sites); 0 records none")
    # the CUDA toolkit
    cuda_home: Path | None = _var(
        "CUDA_HOME", Folder(), None, "NVRTC and CUPTI loaders, header search (C++); stitchcuda doctor; bench jit",
        "CUDA toolkit folder: lib64 for NVRTC, include for CUDA and CCCL headers, bin/nvcc", side="both",
        default_text="/usr/local/cuda")
    cuda_path: Path | None = _var(
        "CUDA_PATH", Folder(), None, "same as CUDA_HOME",
        "a second toolkit folder, used where CUDA_HOME is unset or lacks the library", side="both")

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if type(value) is _Invalid:
            raise SettingsError(value.message)
        return value

    def __repr__(self) -> str:  # the dataclass's would raise at the first bad field
        return "Settings(" + ", ".join(f"{f.name}={object.__getattribute__(self, f.name)!r}"
                                       for f in dataclasses.fields(self)) + ")"

    def problems(self) -> list[str]:
        """The messages of every variable that held a bad value (empty: all good)."""
        return [v.message for f in dataclasses.fields(self)
                if type(v := object.__getattribute__(self, f.name)) is _Invalid]


# Variables only the C++ library, libcurl or the scripts read: declared here so the table covers them all.
OTHER_VARIABLES = (
    # The C++ library's own table (src/core/settings.cpp, bound as _C.cpp_settings()) declares these rows too;
    # test_settings.py holds the two equal. The tf32x3 and bf16 rows are the fields above (side "both").
    Setting("STITCHCUDA_NVRTC", Folder(), None, "C++", "NVRTC loader",
            "the libnvrtc.so.13 to load instead of searching the process, the toolkit and torch's folders"),
    Setting("STITCHCUDA_NVJITLINK", Folder(), None, "C++", "nvJitLink loader",
            "the libnvJitLink.so.13 to load instead of searching beside NVRTC and in the toolkit"),
    Setting("STITCHCUDA_CUPTI", Folder(), None, "C++", "profiler, when CUPTI is first loaded",
            "the libcupti.so.13 the profiler loads instead of searching the process and the toolkit"),
    Setting("STITCHCUDA_CUBLASLT", Folder(), None, "C++", "executor's matmul steps",
            "the libcublasLt.so.13 the executor's matmuls load instead of the one torch loaded"),
    Setting("STITCHCUDA_LIBCUDA", Folder(), None, "C++", "driver loader",
            "the CUDA driver library to load instead of the system's libcuda.so.1"),
    Setting("STITCHCUDA_CUDADEVRT", Folder(), None, "C++", "device linker, for graphs launched from the device",
            "the libcudadevrt.a linked into device-launched graphs instead of the one beside NVRTC"),
    Setting("STITCHCUDA_CACHE_DIR", Folder(), None, "C++", "kernel cache, at the first compile",
            "where compiled kernels are kept across processes; empty keeps them in memory only",
            "$XDG_CACHE_HOME/stitchcuda or ~/.cache/stitchcuda"),
    Setting("STITCHCUDA_LARGE_STORAGE_BYTES", Count(), None, "C++", "program buffer plan",
            "storages this large or larger live outside the executor's arena; 0 keeps every one inside, to "
            "measure the rule", "33554432"),
    Setting("STITCHCUDA_MATMUL_TUNE", Count(), None, "C++", "cuBLASLt matmul steps, at their first run",
            "1 times cuBLASLt's candidate algorithms at a matmul's first run and keeps the fastest; 0 takes the "
            "heuristic's first", "1"),
    Setting("XDG_CACHE_HOME", Folder(), None, "C++", "kernel cache", "parent of the default cache folder",
            "~/.cache"),
    Setting("OPENAI_API_KEY", Text(), None, "C++", "openai: backends, at connect",
            "the API key (Authorization: Bearer); required for the hosted API, optional for a local server; "
            "never written to errors, logs or transcripts"),
    Setting("ANTHROPIC_API_KEY", Text(), None, "C++", "anthropic: backends, at connect",
            "the API key (x-api-key); required for the hosted API"),
    Setting("HTTPS_PROXY, HTTP_PROXY, https_proxy, http_proxy, ALL_PROXY", Text(), None, "C++",
            "libcurl, for the model backends", "proxy for requests to model servers"),
    Setting("NO_PROXY, no_proxy", Text(), None, "C++", "libcurl, for the model backends",
            "hosts reached without the proxy; 127.0.0.1, localhost and ::1 are always added"),
    Setting("TORCH_CUDA_ARCH_LIST", Text(), None, "Python", "stitchcuda bench jit, through torch's load_inline",
            "architectures nvcc builds the baseline for; unset, the benchmark sets the NVRTC target for the "
            "baseline's duration"),
    Setting("STITCHCUDA_GPU_PYTEST", Text(), None, "scripts", "scripts/gpu-check",
            "pytest arguments instead of the part's tests", "the part's tests"),
    Setting("STITCHCUDA_GPU_BENCHES", Text(), None, "scripts", "scripts/gpu-check", "the benchmarks to run",
            "the part's benchmarks"),
    Setting("STITCHCUDA_GPU_BUILD", Folder(), None, "scripts", "scripts/gpu-check",
            "the build folder; outside a tree copied afresh for every device call, a second call only relinks",
            "build-gpu in the tree"),
    Setting("STITCHCUDA_GPU_PART", choice("1", "2", "3", "4", "5", "6", "7", "8"), None, "scripts", "scripts/gpu-check",
            "one of the check's eight parts, each fitting a 10-minute device call (docs/building.md)", "the whole check"),
)


def declared() -> tuple[Setting, ...]:
    """The one table: every variable, the Python fields' first (in declaration order), then the others."""
    return tuple(f.metadata["setting"] for f in dataclasses.fields(Settings)) + OTHER_VARIABLES


def variable_names() -> set[str]:
    """Every variable name the table declares (a row naming several counts for each)."""
    return {name.strip() for s in declared() for name in s.name.split(",")}


# variable name -> (field name, its Setting), for the fields of Settings
_FIELDS = {f.metadata["setting"].name: (f.name, f.metadata["setting"]) for f in dataclasses.fields(Settings)}


def from_environ(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings parsed from `environ` (default: this process's environment); a refused value is kept as
    the error its field raises when read."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name, (attribute, setting) in _FIELDS.items():
        values[attribute] = _parsed(setting, environ.get(name))
    return Settings(**values)


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One variable parsed afresh from `environ` (default: this process's environment), for the few readers
    that must see a change made after the first settings() call (the log level, progress views); a value the
    setting does not take raises SettingsError."""
    setting = _FIELDS[name][1]
    return setting.parse((os.environ if environ is None else environ).get(name))


def _parsed(setting: Setting, text: str | None) -> Any:
    try:
        return setting.parse(text)
    except SettingsError as exc:
        return _Invalid(str(exc))


_lock = threading.Lock()
_current: Settings | None = None


def settings() -> Settings:
    """The settings of this process, read from the environment at the first call (reload() reads again)."""
    current = _current
    if current is None:
        with _lock:
            current = _current if _current is not None else reload()
    return current


def reload(environ: Mapping[str, str] | None = None) -> Settings:
    """Reads the environment (or `environ`) again; for a process that changed its own environment."""
    global _current
    _current = from_environ(environ)
    return _current


@contextlib.contextmanager
def override(**values: Any) -> Iterator[Settings]:
    """Replaces settings while the block runs. A field's name takes a value of its type
    (override(relayout=False)); a variable's name takes the text the environment would hold, parsed as
    there, a bad one included (override(STITCHCUDA_SUITE_CHUNK="3/2"): reading suite_chunk raises).
    Unknown names are a TypeError naming the known ones."""
    global _current
    attributes = {attribute for attribute, _ in _FIELDS.values()}
    changes: dict[str, Any] = {}
    for key, value in values.items():
        if key in _FIELDS:
            attribute, setting = _FIELDS[key]
            changes[attribute] = _parsed(setting, value)
        elif key in attributes:
            changes[key] = value
        else:
            raise TypeError(f"override() got {key!r}, which is neither a field of Settings nor a variable it reads: "
                            f"use one of {', '.join(sorted(attributes))} (or their variables' names)")
    before = settings()
    # dataclasses.replace would read every field, and a bad one raises: copy the stored values instead
    kept = {attribute: object.__getattribute__(before, attribute) for attribute in attributes}
    _current = Settings(**{**kept, **changes})
    try:
        yield _current
    finally:
        _current = before


# ---- the docs page ------------------------------------------------------------------------------------

DOCS_BEGIN = "<!-- generated from python/stitchcuda/settings (python -m stitchcuda.settings --write-docs): begin -->"
DOCS_END = "<!-- generated: end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _names_cell(name: str) -> str:
    return ", ".join(f"`{n.strip()}`" for n in name.split(","))


def markdown_table() -> str:
    """The table of docs/environment.md: one row per variable, by side, then name."""
    lines = ["| variable | side | read by | what for | takes | default |", "|---|---|---|---|---|---|"]
    for s in sorted(declared(), key=lambda s: (SIDES.index(s.side), s.name)):
        lines.append(f"| {_names_cell(s.name)} | {s.side} | {_cell(s.read_by)} | {_cell(s.reason)} | "
                     f"{_cell(s.kind.takes)} | {_cell(s.shown_default())} |")
    return "\n".join(lines) + "\n"


def with_table(page: str) -> str:
    """`page` with the text between DOCS_BEGIN and DOCS_END replaced by markdown_table(); ValueError when
    the page lacks the markers."""
    pattern = re.compile(re.escape(DOCS_BEGIN) + r"\n.*?" + re.escape(DOCS_END), re.S)
    if not pattern.search(page):
        raise ValueError(f"the page has no generated section: put the lines {DOCS_BEGIN!r} and {DOCS_END!r} "
                         "where the table goes")
    return pattern.sub(lambda _: f"{DOCS_BEGIN}\n{markdown_table()}{DOCS_END}", page, count=1)


def docs_page() -> Path:
    return Path(__file__).resolve().parents[3] / "docs" / "environment.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stitchcuda.settings",
                                     description="StitchCUDA's environment variables: the table, or this "
                                                 "environment's values and problems")
    parser.add_argument("--markdown", action="store_true", help="print the docs page's table")
    parser.add_argument("--write-docs", nargs="?", const=str(docs_page()), metavar="PAGE",
                        help="rewrite the generated section of PAGE (default: docs/environment.md)")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
        return 0
    if args.write_docs:
        page = Path(args.write_docs)
        page.write_text(with_table(page.read_text()))
        print(f"wrote the table into {page}")
        return 0
    current = from_environ()
    for f in dataclasses.fields(current):
        value = object.__getattribute__(current, f.name)
        shown = f"BAD: {value.message}" if type(value) is _Invalid else repr(value)
        print(f"{f.metadata['setting'].name:36} {shown}")
    return 2 if current.problems() else 0
