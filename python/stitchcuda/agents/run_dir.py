"""The run directory's format on the Python side, one reader and writer for every caller: program mode's loop
writes its runs in C++ (stitchcuda::agents::RunDirectory, src/agents/run_dir.cpp); graph mode's agents write
theirs through RunDir; `stitchcuda runs` and the bench read both through it.

    run = RunDir("runs/20260101-120000-add_relu")
    run.config()["problem"], [a["report"]["speedup_eager"] for a in run.attempts()], run.summary()

A run holds config.json, hardware.json, problem.py, prompts/, plans/, attempts/NNN/ (attempt.json written
last: a folder without it was interrupted), best.py, summary.json (the run ended), trajectories.jsonl,
events.jsonl, and failed.json where the loop ended on an error. A graph-mode run holds a program-mode run
per target under targets/<id>/. Missing or unreadable files read as None (or empty): a run is read while it
is going, or after it was killed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError, NotFoundError

CONFIG, HARDWARE, PROBLEM, BEST = "config.json", "hardware.json", "problem.py", "best.py"
SUMMARY, EVENTS, TRAJECTORIES = "summary.json", "events.jsonl", "trajectories.jsonl"
FAILED = "failed.json"  # beside config.json when the loop ended on an error: what `runs list|show` say of the run
ATTEMPTS, ATTEMPT, TARGETS = "attempts", "attempt.json", "targets"
REDACTED = "<redacted>"
# Keys whose values a written config never holds (the C++ writer redacts the same: RunDirectory::write_config).
SECRET_KEY = re.compile(r"(api_?key|secret|password|authorization|^token$|_token$)", re.I)


def read_json(path: str | os.PathLike) -> Any:
    """The JSON in `path`, or None when it is missing or does not parse (a run being written, or killed)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def redact_keys(value: Any) -> Any:
    """`value` with the non-empty values of secret-naming keys (SECRET_KEY) replaced by REDACTED."""
    if isinstance(value, dict):
        return {k: (REDACTED if SECRET_KEY.search(str(k)) and v not in (None, "") else redact_keys(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact_keys(v) for v in value]
    return value


def write_text(path: str | os.PathLike, text: str) -> Path:
    """`path` replaced atomically (a killed run never leaves half a file), its folders made; no secret this
    process knows is written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(_redact_known(text), encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_json(path: str | os.PathLike, value: Any) -> Path:
    return write_text(path, json.dumps(value, indent=2, default=str))


def append_event(run: str | os.PathLike, record: dict[str, Any]) -> None:
    """One line of the run's events.jsonl (secrets this process knows redacted)."""
    with open(Path(run) / EVENTS, "a", encoding="utf-8") as f:
        f.write(_redact_known(json.dumps(record, default=str)) + "\n")


def _redact_known(text: str) -> str:
    """`text` without any secret this process knows (the C++ secrets registry: API keys read or set)."""
    from .. import _C

    return _C.secrets.redact(text)


class RunDir:
    """One run directory (program mode's, graph mode's, or a graph target's)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({os.fspath(self.path)!r})"

    # ---- making and finding runs ----

    @classmethod
    def create(cls, path: str | os.PathLike) -> RunDir:
        """A new run at `path`, made (with its parents); InvalidArgumentError when it exists and is not empty."""
        root = Path(path)
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise InvalidArgumentError(f"the run directory '{root}' exists and is not empty: choose another or "
                                       "resume it")
        root.mkdir(parents=True, exist_ok=True)
        return cls(root)

    @classmethod
    def open(cls, path: str | os.PathLike, mode: str | None = None) -> RunDir:
        """An existing run to resume; NotFoundError when `path` holds no readable config.json (of `mode`,
        when given: "graph", "program"...)."""
        run = cls(path)
        config = run.config()
        what = f"a {mode}-mode run directory" if mode else "a run directory"
        if not isinstance(config, dict):
            raise NotFoundError(f"'{run.path}' is not {what} (no readable {CONFIG})")
        if mode is not None and (config.get("mode") or "program") != mode:
            raise NotFoundError(f"'{run.path}' is not {what}: its {CONFIG} says mode {config.get('mode')!r}")
        return run

    @staticmethod
    def is_run(path: str | os.PathLike) -> bool:
        """Whether `path` looks like a run directory (a run still starting included)."""
        p = Path(path)
        return p.is_dir() and any((p / n).exists() for n in (CONFIG, PROBLEM, ATTEMPTS))

    @property
    def id(self) -> str:
        """The run's id: its folder's name."""
        return self.path.name

    # ---- reading ----

    def read(self, name: str) -> Any:
        """The JSON file `name` of the run (a path inside it), or None."""
        return read_json(self.path / name)

    def config(self) -> dict[str, Any] | None:
        return self.read(CONFIG)

    def hardware(self) -> dict[str, Any] | None:
        return self.read(HARDWARE)

    def summary(self) -> dict[str, Any] | None:
        """summary.json: present once the run ended."""
        return self.read(SUMMARY)

    def failed(self) -> dict[str, Any] | None:
        """failed.json: {"error", "time"} when the loop ended on an error."""
        return self.read(FAILED)

    def best(self) -> str | None:
        """best.py's text, None when the run has no correct candidate (yet)."""
        try:
            return (self.path / BEST).read_text(encoding="utf-8")
        except OSError:
            return None

    def attempts(self) -> list[dict[str, Any]]:
        """The finished attempts (attempts/NNN/attempt.json), in order; an interrupted one is left out."""
        folder = self.path / ATTEMPTS
        if not folder.is_dir():
            return []
        records = [read_json(p / ATTEMPT) for p in sorted(folder.glob("[0-9]*")) if p.is_dir()]
        return [r for r in records if isinstance(r, dict)]

    def events(self) -> list[dict[str, Any]]:
        """events.jsonl's records; a line cut short by a kill is skipped."""
        return [r for r in (_json_line(line) for line in self._lines(EVENTS)) if isinstance(r, dict)]

    def trajectories(self) -> list[dict[str, Any]]:
        """trajectories.jsonl's records, one per model call."""
        return [r for r in (_json_line(line) for line in self._lines(TRAJECTORIES)) if isinstance(r, dict)]

    def targets(self) -> dict[str, RunDir]:
        """A graph-mode run's targets: {target id: its program-mode run}."""
        folder = self.path / TARGETS
        if not folder.is_dir():
            return {}
        return {p.name: RunDir(p) for p in sorted(folder.iterdir()) if p.is_dir()}

    def _lines(self, name: str) -> list[str]:
        try:
            return (self.path / name).read_text(encoding="utf-8").splitlines()
        except OSError:
            return []

    # ---- writing (graph mode's runs; program mode's loop writes in C++) ----

    def write_text(self, name: str, text: str) -> Path:
        """`name` (a path inside the run) replaced atomically, secrets redacted (write_text)."""
        return write_text(self.path / name, text)

    def write_json(self, name: str, value: Any) -> Path:
        return write_json(self.path / name, value)

    def write_config(self, config: dict[str, Any]) -> Path:
        """config.json, with the values of secret-naming keys redacted."""
        return write_json(self.path / CONFIG, redact_keys(config))

    def append_event(self, record: dict[str, Any]) -> None:
        append_event(self.path, record)

    def write_failed(self, error: str, time: str) -> Path:
        """failed.json: the error the loop ended on, and when (ISO 8601)."""
        path = self.path / FAILED
        path.write_text(json.dumps({"error": error, "time": time}) + "\n", encoding="utf-8")
        return path


def _json_line(line: str) -> Any:
    try:
        return json.loads(line) if line.strip() else None
    except ValueError:
        return None
