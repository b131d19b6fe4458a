"""What every command line of StitchCUDA shares: the exit codes, the early end (`refuse`), the bounded read
of a source file (a problem file here, a candidate or reference in verify/check.py), and argparse value types.

It is on the ground floor (it imports nothing of StitchCUDA but the native module) so that the CLI modules beside each
layer (graph/cli.py, agents/cli.py, verify/cli.py, profile/cli.py, the bench commands) use it without
importing the top-level cli.py, which imports them.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path
from typing import Callable

# The table of docs/cli.md, "Exit codes"; stitchcuda.cli re-exports them.
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NO_GPU, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

# A problem file is a Python source of kilobytes; the Verifier bounds its inputs at the same 1 MiB
# (verify/check.py, MAX_SOURCE_BYTES), for the same reason: nothing larger is an honest source.
MAX_PROBLEM_BYTES = 1 << 20


class UsageError(Exception):
    """Bad input the caller must fix (exit 2); the message is the one line the user sees."""


class BackendError(Exception):
    """A model backend that cannot be used (no key, no server): the command ran and the answer is no (exit 1)."""


def refuse(command: str, message: str, code: int, json_output: bool = False) -> int:
    """An early end: `command: message` on stderr and, under --json, {"error": message} on stdout (which
    stays one JSON object). Returns `code`."""
    print(f"{command}: {message}", file=sys.stderr)
    if json_output:
        print(json.dumps({"error": message}))
    return code


def one_line(text: object) -> str:
    """The first non-blank line of `text`, stripped: what a one-line error message shows."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def no_gpu_reason() -> str | None:
    """None when torch sees a CUDA GPU, else why not, in words."""
    import torch

    if torch.cuda.is_available():
        return None
    from . import _C

    ok, reason = _C.driver_available()
    return "torch.cuda.is_available() is False: " + (reason if not ok else "the driver reports no GPU")


# ---- problem files ---------------------------------------------------------------------------------


def read_bounded_text(path: str | os.PathLike, limit: int | None, *, label: str, kind: str, fix: str,
                      error: type[Exception]) -> str:
    """The UTF-8 text of the file ``path``, read as every entry of StitchCUDA reads a source it is given:
    only a regular file (a FIFO would block, /dev/zero never ends), at most ``limit`` bytes (None: no bound).
    Anything else raises ``error`` in the caller's words: ``label`` names the file ("'x.py'", "the candidate
    'x.py'"), ``kind`` what it is ("problem file"), ``fix`` what to give instead ("give a .py problem file")."""
    path = os.fspath(path)
    try:
        info = os.stat(path)
    except OSError as exc:
        raise error(f"cannot read {label}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{label} is not a regular file (a FIFO, device or folder is never read): {fix}")
    if limit is not None and info.st_size > limit:
        raise error(f"{label} is {info.st_size} bytes, more than the {limit} a {kind} may have")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(limit + 1 if limit is not None else -1)
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {label}: {exc.strerror if isinstance(exc, OSError) else exc}") from None
    if limit is not None and len(text) > limit:  # grew since stat(): still bounded
        raise error(f"{label} is more than the {limit} bytes a {kind} may have")
    return text


def read_problem(path: str | os.PathLike) -> str:
    """The text of a problem file, bounded as the Verifier bounds its inputs (``read_bounded_text``: a
    regular file of at most MAX_PROBLEM_BYTES, UTF-8). UsageError says what is wrong."""
    return read_bounded_text(path, MAX_PROBLEM_BYTES, label=repr(os.fspath(path)), kind="problem file",
                             fix="give a .py problem file", error=UsageError)


def problem_folder_importable(path: str | os.PathLike) -> None:
    """Modules beside a problem file import as they do when the file is run as a script (its folder
    first on sys.path), wherever the command was started."""
    folder = str(Path(path).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)


def module_main(prog: str, doc: str | None, run: Callable[[bool], int], argv: list[str] | None = None) -> int:
    """The `python -m MODULE [--json]` entry of a benchmark module: `--help` says what it measures (the
    module docstring's first paragraph) and runs nothing; `--json` is passed to `run`; anything else is a
    usage error (exit 2)."""
    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n\n")[0] or None)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad option (2), already printed
        return int(exc.code or 0)
    return int(run(args.json))


# ---- argparse value types --------------------------------------------------------------------------


def _number(parse: Callable[[str], float], text: str) -> float:
    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def at_least(minimum: int, what: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number >= minimum (`what` names the unit in the message)."""

    def parse(text: str) -> int:
        value = int(_number(int, text))
        if value < minimum:
            raise argparse.ArgumentTypeError(f"at least {minimum}{' ' + what if what else ''}, got {text}")
        return value

    return parse


def non_negative_float(text: str) -> float:
    """An argparse type: a number >= 0 (seconds, a speed-up)."""
    value = _number(float, text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"0 or more, got {text}")
    return value
