"""What every command line of StitchCUDA shares: the exit codes, the early end (`refuse`), the checks of
a problem file and of an `--llm` spec that run before any work, and argparse value types.

It is on the ground floor (it imports only errors.py at module level) so that the CLI modules beside each
layer (graph/cli.py, agents/cli.py, verify/cli.py, profile/cli.py, the bench commands) use it without
importing the top-level cli.py, which imports them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

# The table of docs/cli.md, "Exit codes"; stitchcuda.cli re-exports them.
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NO_GPU, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

# A problem file is a Python source of kilobytes; the Verifier bounds its inputs at the same 1 MiB
# (verify/check.py, MAX_SOURCE_BYTES), for the same reason: nothing larger is an honest source.
MAX_PROBLEM_BYTES = 1 << 20
# How long `--llm` may take to show that its server answers a TCP connection before any work starts.
LLM_REACH_TIMEOUT_S = 5.0


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


def read_problem(path: str | os.PathLike) -> str:
    """The text of a problem file, bounded as the Verifier bounds its inputs: only a regular file (a FIFO
    would block and /dev/zero never ends), at most MAX_PROBLEM_BYTES, UTF-8. UsageError says what is wrong."""
    path = os.fspath(path)
    try:
        info = os.stat(path)
    except OSError as exc:
        raise UsageError(f"cannot read {path!r}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"{path!r} is not a regular file (a FIFO, device or folder is never read): give a .py "
                         "problem file")
    if info.st_size > MAX_PROBLEM_BYTES:
        raise UsageError(f"{path!r} is {info.st_size} bytes, more than the {MAX_PROBLEM_BYTES} a problem file "
                         "may have")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_PROBLEM_BYTES + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path!r}: {exc.strerror if isinstance(exc, OSError) else exc}") from None
    if len(text) > MAX_PROBLEM_BYTES:  # grew since stat(): still bounded
        raise UsageError(f"{path!r} is more than the {MAX_PROBLEM_BYTES} bytes a problem file may have")
    return text


def problem_folder_importable(path: str | os.PathLike) -> None:
    """Modules beside a problem file import as they do when the file is run as a script (its folder
    first on sys.path), wherever the command was started."""
    folder = str(Path(path).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)


# ---- --llm SPEC ------------------------------------------------------------------------------------


def check_llm(spec: str, timeout_s: float = LLM_REACH_TIMEOUT_S) -> str:
    """Checks an `--llm` spec before any work, sending no request: a spec that does not parse, names an
    unknown provider, a `python:` module that does not import or a replay/scripted file that cannot be read
    is a UsageError; a missing API key, or a server named by URL that accepts no TCP connection within
    `timeout_s`, is a BackendError. Returns the backend's name. A hosted API (no URL in the spec) is checked
    for its key only: whether it answers shows at the first call."""
    from . import llm
    from .errors import InvalidArgumentError, NotFoundError, StitchError, StitchIOError

    try:
        base_url = "" if spec.startswith("python:") else llm.parse_spec(spec).base_url
        backend = llm.connect(spec)
    except (InvalidArgumentError, NotFoundError, StitchIOError) as exc:
        raise UsageError(f"--llm {spec}: {one_line(exc.message)}") from None
    except StitchError as exc:  # a missing key
        raise BackendError(f"--llm {spec}: {one_line(exc.message)}") from None
    if base_url:
        _reachable(spec, base_url, timeout_s)
    return backend.name


def _reachable(spec: str, url: str, timeout_s: float) -> None:
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise UsageError(f"--llm {spec}: the URL's port is not a number") from None
    loopback = host in ("localhost", "127.0.0.1", "::1")
    if not loopback and any(os.environ.get(v) for v in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY",
                                                         "all_proxy", "ALL_PROXY")):
        return  # the HTTP client goes through the proxy: a direct connection says nothing about it
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        why = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
        raise BackendError(f"--llm {spec}: the server at {parts.scheme}://{parts.netloc} is not reachable ({why}, "
                           f"within {timeout_s:g} s): start it, or fix the URL") from None


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
