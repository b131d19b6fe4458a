"""The tasks an RL Coder trains on: KernelBench-format problem files read into rows (task id, set, level,
class, reference source, the constructor and forward inputs as specs), and the task set StitchCUDA ships.

Inputs are read without building the model or allocating a tensor: the problem's ``get_init_inputs()``
and ``get_inputs()`` run under PyTorch's meta device (shapes and dtypes, no data), falling back to the
AST (how many values the function returns) when they need a real device.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Iterable

from ..errors import InvalidArgumentError, NotFoundError

__all__ = ["SHIPPED_SETS", "shipped_dirs", "shipped_rows", "read_problem", "problem_rows", "problem_files", "tasks",
           "find_task", "input_counts", "read_problem_text"]

# The sets the package ships, by name: (folder in the installed package, folder in a source checkout).
# A wheel carries them under stitchcuda/rl/problems/ (CMakeLists.txt installs them); a checkout reads the
# repository's own folders, so the files exist once in git.
_PACKAGE_DIR = Path(__file__).resolve().parent / "problems"
_REPO_DIR = Path(__file__).resolve().parents[3]
SHIPPED_SETS: dict[str, tuple[Path, Path]] = {
    "kernelbench": (_PACKAGE_DIR / "kernelbench", _REPO_DIR / "bench" / "kernelbench"),
    "suite": (_PACKAGE_DIR / "suite", _REPO_DIR / "bench" / "suite"),
    "corpus": (_PACKAGE_DIR / "corpus", _REPO_DIR / "tests" / "corpus" / "problems"),
}

# KernelBench's levels by the file-name prefix our problems use: 1 = one operator, 2 = a fused chain
# around a GEMM, convolution or attention, 3 = a whole network or block.
_LEVELS = {"op": 1, "pointwise": 1, "reduce": 1, "softmax": 1, "norm": 1, "gemm": 2, "conv": 2, "conv1x1": 2,
           "bmm": 2, "attention": 2, "net": 3, "model": 3}
# The corpus's problems are named for what they compute; these are fusions, the rest single operators.
_CORPUS_LEVEL2 = {"bias_gelu", "conv_bn_relu", "linear_relu", "matmul_scale_residual", "scaled_residual_add",
                  "broadcast_sigmoid"}


def shipped_dirs() -> dict[str, Path]:
    """{set name: folder} of the shipped sets found here (the installed copy first, else the checkout's)."""
    found = {}
    for name, (packaged, repo) in SHIPPED_SETS.items():
        for folder in (packaged, repo):
            if folder.is_dir() and any(folder.glob("*.py")):
                found[name] = folder
                break
    return found


# ---- one problem ----------------------------------------------------------------------------------


def _spec_of(value: Any) -> dict[str, Any]:
    """One input as a row holds it: the same keys for every kind, so a dataset column has one type."""
    import torch

    spec = {"kind": "other", "shape": [], "dtype": "", "value": ""}
    if isinstance(value, torch.Tensor):
        spec.update(kind="tensor", shape=[int(d) for d in value.shape], dtype=str(value.dtype).replace("torch.", ""))
    elif isinstance(value, bool):
        spec.update(kind="bool", value=json.dumps(value))
    elif isinstance(value, int):
        spec.update(kind="int", value=json.dumps(value))
    elif isinstance(value, float):
        spec.update(kind="float", value=json.dumps(value))
    else:
        spec.update(value=repr(value)[:200])
    return spec


def _returned_length(tree: ast.Module, function: str) -> int | None:
    """How many values `function` returns, read from its last `return [...]` (a list or tuple literal)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            returns = [n for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None]
            if returns and isinstance(returns[-1].value, (ast.List, ast.Tuple)):
                elts = returns[-1].value.elts
                if not any(isinstance(e, ast.Starred) for e in elts):
                    return len(elts)
            return None
    return 0 if function == "get_init_inputs" else None


def _meta_inputs(source: str, name: str) -> tuple[list | None, list | None, dict, str]:
    """(init inputs, forward inputs, module-level sizes, why not) from running the two input functions on
    the meta device: no data is allocated and no model is built."""
    import torch

    from ..verify.task import load_source_module

    try:
        module = load_source_module(source, f"<problem {name}>", "rl_problem")
    except (Exception, SystemExit) as exc:
        return None, None, {}, f"the problem raised while loading: {type(exc).__name__}: {exc}"
    sizes = {k: v for k, v in vars(module).items() if not k.startswith("_") and type(v) in (int, float)}
    out: list[list | None] = []
    why = ""
    for function in ("get_init_inputs", "get_inputs"):
        fn = getattr(module, function, None)
        if fn is None:
            out.append([] if function == "get_init_inputs" else None)
            continue
        try:
            with torch.device("meta"):
                value = fn()
            out.append(list(value) if isinstance(value, (list, tuple)) else [value])
        except Exception as exc:  # .cuda(), data-dependent code: the AST count is what is left
            out.append(None)
            why = f"{function}() does not run on the meta device ({type(exc).__name__}: {exc})"
    import sys

    sys.modules.pop(module.__name__, None)
    return out[0], out[1], sizes, why


def _level(set_name: str, stem: str, relative: Path) -> tuple[int, str]:
    for part in relative.parts[:-1]:  # KernelBench's own layout: level1/, level_2/ ...
        digits = "".join(c for c in part if c.isdigit())
        if part.lower().startswith("level") and digits:
            return int(digits), part.lower()
    kind = stem.split("_", 1)[0]
    if set_name == "corpus":
        return (2 if stem in _CORPUS_LEVEL2 else 1), "corpus"
    return _LEVELS.get(kind, 1), kind


def _description(tree: ast.Module, source: str) -> str:
    doc = ast.get_docstring(tree)
    if doc:
        return doc.strip().splitlines()[0]
    for line in source.splitlines():  # the corpus opens with a comment line instead
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


def read_problem(path: str | os.PathLike | None = None, *, source: str | None = None, task_id: str | None = None,
                 set_name: str = "", relative: str | os.PathLike | None = None) -> dict[str, Any]:
    """One KernelBench-format problem as a task row: task_id, set, level, class, name, description,
    reference, init_inputs and inputs (specs: kind, shape, dtype, value), num_init_inputs, num_inputs,
    sizes (JSON), sha256. InvalidArgumentError names a file that is not a problem."""
    if source is None:
        if path is None:
            raise InvalidArgumentError("read_problem needs a path or source=")
        source = read_problem_text(path)
    rel = Path(relative) if relative is not None else Path(Path(path).name if path else "problem.py")
    stem = rel.stem
    name = task_id or (f"{set_name}/" if set_name else "") + rel.with_suffix("").as_posix()
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise InvalidArgumentError(f"the problem {name!r} is not valid Python: {exc.msg} (line {exc.lineno})") from None
    defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    missing = [n for n in ("Model", "get_inputs") if n not in defined]
    if missing:
        raise InvalidArgumentError(f"the problem {name!r} does not define {' or '.join(missing)}: a KernelBench "
                                   "problem has class Model(nn.Module), get_inputs() and get_init_inputs()")
    init, inputs, sizes, _ = _meta_inputs(source, name)
    level, kind = _level(set_name, stem, rel)
    n_init = len(init) if init is not None else _returned_length(tree, "get_init_inputs")
    n_inputs = len(inputs) if inputs is not None else _returned_length(tree, "get_inputs")
    return {
        "task_id": name, "set": set_name, "level": level, "class": kind, "name": stem,
        "description": _description(tree, source), "reference": source,
        "init_inputs": [_spec_of(v) for v in init or []], "inputs": [_spec_of(v) for v in inputs or []],
        "num_init_inputs": -1 if n_init is None else n_init, "num_inputs": -1 if n_inputs is None else n_inputs,
        "sizes": json.dumps(sizes, sort_keys=True),
        "sha256": hashlib.sha256(source.encode()).hexdigest(),
    }


def read_problem_text(path: str | os.PathLike) -> str:
    """A problem file's text, bounded as every entry bounds it (a regular file of at most 1 MiB, UTF-8: a
    FIFO or /dev/zero in a task folder would hang or fill the process); InvalidArgumentError names it."""
    from ..cli_support import UsageError, read_problem as read_bounded

    try:
        return read_bounded(path)
    except UsageError as exc:
        raise InvalidArgumentError(f"the problem {exc}") from None


def input_counts(source: str, *, load: bool = True) -> tuple[int | None, int | None]:
    """(constructor arguments, forward inputs) a problem gives, None where it cannot be told; cached.
    Read from the AST (a returned list literal); only a problem whose functions build their lists
    otherwise is loaded, and its functions run on the meta device — in this process, so ``load=False``
    for a problem this process must not run (a client's dataset row): the AST alone."""
    key = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
    with _lock:
        if key in _counts:
            return _counts[key]
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return None, None
    counts = (_returned_length(tree, "get_init_inputs"), _returned_length(tree, "get_inputs"))
    if None in counts and not load:
        return counts
    if None in counts:
        init, inputs, _, _ = _meta_inputs(source, "reference")
        counts = (len(init) if init is not None else counts[0], len(inputs) if inputs is not None else counts[1])
    with _lock:
        _counts[key] = counts
    return counts


_lock = threading.Lock()
_counts: dict[str, tuple[int | None, int | None]] = {}


# ---- folders and the shipped set --------------------------------------------------------------------


def problem_files(folder: Path) -> Iterable[Path]:
    """The problem files of ``folder``: ``*.py`` at any depth, less those (or folders) named ``_*`` or ``.*``."""
    for path in sorted(folder.rglob("*.py")):
        if path.name.startswith("_") or any(p.startswith((".", "_")) for p in path.relative_to(folder).parts[:-1]):
            continue
        yield path


def problem_rows(folder: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The rows of every problem in `folder` (recursively; files starting with "_" skipped), or of the
    shipped sets when None. A file that is not a problem is an error naming it."""
    rows: list[dict[str, Any]] = []
    if folder is None:
        found = shipped_dirs()
        if not found:
            raise NotFoundError("the shipped task set is missing: neither stitchcuda/rl/problems/ (an installed "
                                "wheel) nor the repository's bench/ folders exist; pass a folder of problems")
        for set_name, path in found.items():
            rows += [read_problem(p, set_name=set_name, relative=p.relative_to(path)) for p in problem_files(path)]
        return rows
    root = Path(folder)
    if not root.is_dir():
        raise NotFoundError(f"the task folder {os.fspath(folder)!r} does not exist or is not a folder")
    set_name = root.name
    rows = [read_problem(p, set_name=set_name, relative=p.relative_to(root)) for p in problem_files(root)]
    if not rows:
        raise InvalidArgumentError(f"the task folder {os.fspath(folder)!r} holds no .py problem files")
    return rows


_shipped: dict[str, dict[str, Any]] | None = None


def shipped_rows() -> dict[str, dict[str, Any]]:
    """{task id: row} of the shipped sets, read once per process."""
    global _shipped
    with _lock:
        if _shipped is not None:
            return _shipped
    rows = {r["task_id"]: r for r in problem_rows(None)}
    with _lock:
        _shipped = rows
    return rows


def find_task(task_id: str) -> dict[str, Any]:
    """The shipped task called `task_id` ("kernelbench/op_gelu_6gb", or a stem such as "op_gelu_6gb" when
    only one set has it). NotFoundError lists near names."""
    rows = shipped_rows()
    if task_id in rows:
        return rows[task_id]
    by_stem = [r for r in rows.values() if r["name"] == task_id]
    if len(by_stem) == 1:
        return by_stem[0]
    if len(by_stem) > 1:
        raise NotFoundError(f"task {task_id!r} is in several sets; name one of: "
                            + ", ".join(r["task_id"] for r in by_stem))
    import difflib

    near = difflib.get_close_matches(task_id, list(rows), n=5, cutoff=0.4)
    raise NotFoundError(f"no shipped task {task_id!r}" + (f"; did you mean {', '.join(near)}?" if near else
                        f"; there are {len(rows)}, e.g. {', '.join(list(rows)[:3])}"))


def tasks(folder: str | os.PathLike | None = None):
    """A ``datasets.Dataset`` of the problems in `folder` (default: the shipped set of 100+ problems), one
    row per problem (read_problem's columns)."""
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("stitchcuda.rl.tasks needs the datasets package: pip install '.[rl]' in a StitchCUDA clone, or pip install datasets") from exc
    rows = list(shipped_rows().values()) if folder is None else problem_rows(folder)
    return datasets.Dataset.from_list(rows)
