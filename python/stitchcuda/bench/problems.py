"""The problems a bench run measures: the folders it knows by name, the KernelBench-format files in a folder
(level subfolders included), their selection (--only, --chunk), class and level, and loading one."""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ..cli_support import problem_folder_importable
from ..settings import settings


# The file name's prefix names the problem's class; the summary is kept per class and overall.
CLASSES = {"op": "single op", "conv": "conv + epilogue", "gemm": "GEMM + epilogue", "net": "whole network",
           "model": "whole network"}
CLASS_ORDER = ("single op", "conv + epilogue", "GEMM + epilogue", "whole network", "other")
BENCHES = ("suite", "kernelbench", "lowp")  # the folders under bench/ this runner knows by name
LEVEL_FOLDER = re.compile(r"level\d+")


def problem_class(stem: str) -> str:
    """The class of a problem file's stem: its prefix before the first `_` (none: "other")."""
    prefix, sep, _ = stem.partition("_")
    return CLASSES.get(prefix, "other") if sep else "other"


def _repository_folder(name: str) -> Path | None:
    """The nearest `bench/<name>` above this file (the repository's)."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "bench" / name).is_dir():
            return parent / "bench" / name
    return None


def suite_dir() -> Path | None:
    """STITCHCUDA_SUITE_DIR, else the nearest `bench/suite` above this file (the repository's)."""
    return settings().suite_dir or _repository_folder("suite")


def default_dir(bench: str) -> Path | None:
    """The folder `stitchcuda bench <bench>` runs without --dir."""
    return suite_dir() if bench == "suite" else _repository_folder(bench)


def parse_chunk(chunk: str) -> tuple[int, int]:
    """(K, N) of "K/N" with 1 <= K <= N; ValueError otherwise."""
    k, _, n = chunk.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"--chunk / STITCHCUDA_SUITE_CHUNK must be K/N with 1 <= K <= N, got {chunk!r}")
    return int(k), int(n)


def only_names(only: str | None) -> set[str]:
    return {s.strip() for s in (only or "").split(",") if s.strip()}


def problem_level(path: Path) -> str | None:
    """The KernelBench level a problem file belongs to: the name of its folder when that is `level<N>`
    (KernelBench's own layout: level1/ single ops, level2/ fusions, level3/ whole networks), else None."""
    return path.parent.name if LEVEL_FOLDER.fullmatch(path.parent.name) else None


def folder_problems(folder: Path) -> list[Path]:
    """Every problem file of `folder`: its own *.py, then those of its `level<N>` subfolders in level
    order, each folder sorted by name, so KernelBench's top folder runs whole. A helper is not a problem:
    a file whose name starts with an underscore, or one that defines no Model (helper_files)."""
    return [p for p in _python_files(folder) if defines_model(p)]


def helper_files(folder: Path) -> list[Path]:
    """The files folder_problems leaves out because they define no Model: modules the problems import."""
    return [p for p in _python_files(folder) if not defines_model(p)]


def _python_files(folder: Path) -> list[Path]:
    levels = sorted((d for d in folder.iterdir() if d.is_dir() and LEVEL_FOLDER.fullmatch(d.name)),
                    key=lambda d: level_key(d.name))
    return [p for d in [folder, *levels] for p in sorted(d.glob("*.py")) if not p.name.startswith("_")]


def defines_model(path: Path) -> bool:
    """Whether the file names `Model` at its top level (a class, an assignment or an import), read without
    running it. A file that cannot be read or parsed counts as a problem: its row says what is wrong."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return True
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Model":
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "Model" for t in node.targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == "Model" for a in node.names):
            return True
    return False


def model_files(folder: Path, only: str | None = None, chunk: str | None = None) -> list[Path]:
    """The folder's problem files (with those of its `level<N>` subfolders), sorted; `only` is a
    comma-separated list of stems; `chunk` "K/N" keeps every N-th file from the K-th (1-based), so N
    runs cover the folder once, each with a mix of kinds."""
    files = folder_problems(folder)
    wanted = only_names(only)
    if wanted:
        files = [p for p in files if p.stem in {w.partition("[")[0] for w in wanted}]  # stem[variant] too
    if chunk:
        try:
            k, n = parse_chunk(chunk)
        except ValueError as exc:
            raise SystemExit(f"bench suite: {exc}") from None
        files = files[k - 1::n]
    return files


@dataclass(frozen=True)
class Problem:
    """One row of a run: a problem file, and the variant its model runs as (None: as the file builds it)."""
    path: Path
    variant: str | None = None

    @property
    def name(self) -> str:
        """The row's name: the file's stem, with the variant in brackets (`net_gpt2[bf16]`)."""
        return f"{self.path.stem}[{self.variant}]" if self.variant else self.path.stem

    stem = name  # where the driver keys rows by a file's stem, a variant's row is keyed by its name


def problem_variants(path: Path) -> tuple[str, ...]:
    """The file's module-level VARIANTS (a tuple of variant names, precision.VARIANT_DTYPES), read without
    running it; () when it has none or it is not a literal tuple of strings."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return ()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "VARIANTS" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return ()
            return tuple(value) if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value) else ()
    return ()


def expand_variants(files: list[Path], only: str | None = None) -> list[Problem]:
    """The rows of `files`: one per variant of a file that names VARIANTS, else one; `only` entries of the
    form `stem[variant]` keep only those variants of that file (a bare stem keeps them all)."""
    wanted = only_names(only)
    problems = []
    for path in files:
        picked = {w[len(path.stem) + 1:-1] for w in wanted if w.startswith(path.stem + "[") and w.endswith("]")}
        variants = problem_variants(path)
        if path.stem in wanted or not picked:
            picked = set(variants)
        problems += [Problem(path, v) for v in variants if v in picked] if variants else [Problem(path)]
    return problems


def shrink(module: ModuleType) -> ModuleType:
    """--small: the module's constants replaced by its SMALL dict ({"HIDDEN": 64, ...}), so Model,
    get_inputs and get_init_inputs build the same architecture at a size a CPU plans in seconds.
    ValueError when the file has no SMALL."""
    small = getattr(module, "SMALL", None)
    if not isinstance(small, dict):
        raise ValueError(f"{module.__file__} has no SMALL dict of its constants' small values (--small needs one)")
    unknown = [k for k in small if not hasattr(module, k)]
    if unknown:
        raise ValueError(f"{module.__file__}: SMALL names {', '.join(unknown)}, which the file does not define")
    vars(module).update(small)
    return module


def load(path: Path) -> ModuleType:
    """Imports a KernelBench-format file (Model, get_inputs, get_init_inputs) as a module; the modules beside
    it import, as when the file is run as a script."""
    problem_folder_importable(path)
    spec = importlib.util.spec_from_file_location(f"stitchcuda_suite_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(module, name):
            raise AttributeError(f"{path.name} has no {name} (KernelBench format: Model, get_inputs, get_init_inputs)")
    return module


def level_key(level: str) -> tuple[int, str]:
    digits = level.removeprefix("level")
    return (int(digits) if digits.isdigit() else 1 << 30, level)
