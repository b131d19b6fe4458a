"""The problems a bench run measures: the folders it knows by name, the KernelBench-format files in a folder
(level subfolders included), their selection (--only, --chunk), class and level, and loading one."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from ..settings import settings


# The file name's prefix names the problem's class; the summary is kept per class and overall.
CLASSES = {"op": "single op", "conv": "conv + epilogue", "gemm": "GEMM + epilogue", "net": "whole network",
           "model": "whole network"}
CLASS_ORDER = ("single op", "conv + epilogue", "GEMM + epilogue", "whole network", "other")
BENCHES = ("suite", "kernelbench")  # the folders under bench/ this runner knows by name
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
    order, each folder sorted by name, so KernelBench's top folder runs whole (a leading underscore marks
    a helper, not a problem)."""
    levels = sorted((d for d in folder.iterdir() if d.is_dir() and LEVEL_FOLDER.fullmatch(d.name)),
                    key=lambda d: level_key(d.name))
    return [p for d in [folder, *levels] for p in sorted(d.glob("*.py")) if not p.name.startswith("_")]


def model_files(folder: Path, only: str | None = None, chunk: str | None = None) -> list[Path]:
    """The folder's problem files (with those of its `level<N>` subfolders), sorted; `only` is a
    comma-separated list of stems; `chunk` "K/N" keeps every N-th file from the K-th (1-based), so N
    runs cover the folder once, each with a mix of kinds."""
    files = folder_problems(folder)
    wanted = only_names(only)
    if wanted:
        files = [p for p in files if p.stem in wanted]
    if chunk:
        try:
            k, n = parse_chunk(chunk)
        except ValueError as exc:
            raise SystemExit(f"bench suite: {exc}") from None
        files = files[k - 1::n]
    return files


def load(path: Path) -> ModuleType:
    """Imports a KernelBench-format file (Model, get_inputs, get_init_inputs) as a module."""
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
