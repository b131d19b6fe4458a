"""A bench run's rows on disk: the JSON-lines results file a run appends to and resumes from (the files of a
--gpus run's processes beside it), the settings a row was measured with, a row's start, and the CSV."""

from __future__ import annotations

import glob
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from .problems import problem_class, problem_level


ROW_PREFIX = "[suite-row] "  # a finished row on stderr, as one JSON line after this prefix


ERROR_COLUMNS = ("eager", "compile", "reduce_overhead", "stitch", "agents")  # the keys of a row's err_fp64


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def new_row(path: Path, mode: str, precision: str = "fp32") -> dict:
    row: dict[str, Any] = {"model": path.stem, "class": problem_class(path.stem), "mode": mode,
                           "precision": precision, "errors": {}}
    level = problem_level(path)
    if level:
        row["level"] = level
    return row


def jsonable(value: Any) -> Any:
    """`value` with non-finite floats (an output of the wrong shape has an infinite error) as None, so
    every line and object printed is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def dumps(value: Any) -> str:
    return json.dumps(jsonable(value), default=str, allow_nan=False)


def row_mode(compile_only: bool, no_compile: bool) -> str:
    """A row's mode: how it was measured (ROW_SETTINGS)."""
    return "compile-only" if compile_only else "no-compile" if no_compile else "timed"


# What a row was measured with: a resumed run reuses only rows made the same way (a compile-only row
# is no timed measurement; a row without the agents is not one with them). Rows of older files have no
# such keys and read as these defaults. A file never mixes precisions (precision_conflict).
# --small rows (the problems' SMALL sizes) and rows timed with extra compile modes are not a full run's.
ROW_SETTINGS = {"mode": "timed", "llm": None, "precision": "fp32", "small": False, "compile_modes": []}


def row_settings(row: dict) -> dict:
    return {key: row.get(key, default) for key, default in ROW_SETTINGS.items()}


def read_results(path: Path, settings: dict | None = None) -> dict[str, dict]:
    """The rows already in a results file, by problem (a later line wins); with `settings`, only rows
    made with them (row_settings). A line that does not parse (the last one, cut short by a killed run)
    is skipped, so that problem runs again."""
    rows: dict[str, dict] = {}
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("model"), str):
            if settings is None or row_settings(row) == {**ROW_SETTINGS, **settings}:
                rows[row["model"]] = row
    return rows


def part_files(results: Path) -> list[Path]:
    """The files a --gpus run's processes write beside `results` (F.gpu0, F.gpu1, ...), sorted."""
    if not results.parent.is_dir():
        return []
    return sorted(p for p in results.parent.glob(glob.escape(results.name) + ".gpu*")
                  if PART.fullmatch(p.name[len(results.name):]))


def precision_conflict(results: Path, precision: str) -> str | None:
    """Why `results` cannot take rows of `precision`: it (or a file a killed --gpus run left beside it)
    holds rows of another precision (a row without one is fp32). None when it can."""
    others: dict[str, int] = {}
    for path in [results, *part_files(results)]:
        for row in read_results(path).values():
            other = row.get("precision") or "fp32"
            if other != precision:
                others[other] = others.get(other, 0) + 1
    if not others:
        return None
    held = ", ".join(f"{n} at {p}" for p, n in sorted(others.items()))
    first = sorted(others)[0]
    return (f"--results {results} holds rows of another precision ({held}) and this run is --precision {precision}: "
            f"rows of different precisions never share a results file; pass another --results file, or "
            f"--precision {first} to continue that run")


# The CSV's columns: one line per problem, the row's numbers and verdicts (the JSON-lines file keeps
# everything, the input sets and agents' targets too).
# err_fp64_<column>_<max_abs|max_rel>: a column's error against the fp64 reference (row["err_fp64"]).
_ERROR_CSV = {f"err_fp64_{c}_{stat}": (c, stat) for c in ERROR_COLUMNS[:4] for stat in ("max_abs", "max_rel")}
CSV_COLUMNS = ("model", "level", "class", "mode", "precision", "variant", "dtype", "autocast", "llm", "status",
               "correct", "accurate", "eager_ms", "compile_ms", "reduce_overhead_ms", "max_autotune_no_cudagraphs_ms",
               "max_autotune_no_cudagraphs_first_call_s", "best_compile_mode", "best_compile_ms", "stitch_ms", "eager_after_ms", "agents_ms",
               "speedup_compile", "speedup_reduce_overhead", "speedup_best_compile", "speedup_stitch",
               "speedup_agents", "stitch_vs_best_compile", "agents_vs_best_compile", "agents_correct",
               "optimize_s", "agents_s", "fallbacks", "kernels", "max_abs_error", *_ERROR_CSV, "reference_dtype", "fp64_note", "flops",
               "bytes", "eager_peak_bytes", "optimize_peak_bytes", "optimize_device_peak_bytes", "memory_ratio",
               "forward_largest_tensor_bytes", "memory_ratio_forward", "errors")


def _csv_value(row: dict, key: str) -> Any:
    if key in _ERROR_CSV:
        column, stat = _ERROR_CSV[key]
        value = ((row.get("err_fp64") or {}).get(column) or {}).get(stat)
    else:
        value = row.get(key, "fp32" if key == "precision" else None)
    if key == "errors":
        return "; ".join(f"{stage}: {text}" for stage, text in (value or {}).items())
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    return "" if value is None else value


def write_csv(path: Path, rows: list[dict]) -> None:
    """`rows` as CSV (CSV_COLUMNS, a header line first), replaced whole and atomically: rewritten after
    every problem, so a killed run leaves a CSV of what it finished."""
    import csv
    import io

    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow([_csv_value(row, key) for key in CSV_COLUMNS])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text.getvalue(), encoding="utf-8")
    os.replace(tmp, path)


def append_result(path: Path, row: dict) -> None:
    """Appends one row as one line, on disk before the next problem starts (a kill loses at most that one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as f:  # writes always go to the end; reading may seek
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")  # a killed run's cut-off line stays alone on its line, and is skipped
        f.write((dumps(row) + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


PART = re.compile(r"\.gpu\d+")  # the suffix of a --gpus process's own results file beside --results F


def fold_parts(results: Path) -> int:
    """The rows a --gpus run's processes left in their own files beside `results` (F.gpu0, F.gpu1, ...:
    the run was killed before it merged them) appended to `results`, the files removed; how many rows."""
    count = 0
    for part in part_files(results):
        for row in read_results(part).values():
            append_result(results, row)
            count += 1
        part.unlink()
    return count
