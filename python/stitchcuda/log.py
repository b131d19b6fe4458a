"""StitchCUDA's diagnostics and progress: the ``stitchcuda`` loggers, the live view of long jobs, and the
redaction every message passes through on its way out (``redact``).

Diagnostics go through :mod:`logging`, one hierarchy for the package: ``get_logger(__name__)`` in
``stitchcuda.graph.agents`` is ``logging.getLogger("stitchcuda.graph.agents")``. ``STITCHCUDA_LOG``
(``debug``, ``info``, ``warning``, ``error``) sets the level of the ``stitchcuda`` logger; unset, the
logger keeps what the application gave it (by default: warnings and errors). One handler on the
``stitchcuda`` logger writes records to stderr while the application has configured no logging; once the
root logger has a handler, records reach the application's handlers alone, so nothing prints twice. The
root logger is never touched.

Nothing leaves with a secret in it: ``redact(text)`` masks what the C++ secrets registry knows (the
environment's keys and tokens, keys a backend was given, a model URL's password once ``llm.connect`` saw
it) and any URL's ``user:password@`` or credential-named query parameter. Every ``stitchcuda`` logger
redacts its records before any handler sees them, StitchError's text is redacted, and the CLI writes
through ``redacted_output()``.

Progress is not logging: :class:`StepProgress` (optimize()'s stages) and :class:`LoopProgress` (the
agents' attempts) redraw in place on a terminal with rich — cut to the terminal's width, with the elapsed
time — and print plain lines where the output is kept: in CI (``CI`` set) and when stderr is a file or a
pipe. Both write to stderr: stdout carries the command's results.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, TextIO

from .settings import SettingsError, read

__all__ = ["LOGGER", "ENV", "LEVELS", "configure", "get_logger", "in_ci", "live_terminal", "note", "StepProgress",
           "LoopProgress", "redact", "remember_url_credentials", "redacted_output"]

LOGGER = "stitchcuda"
ENV = "STITCHCUDA_LOG"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


# ---- secrets ---------------------------------------------------------------------------------------
# What leaves the process as text (log records, the CLI's output, error messages, reward replies) goes
# through redact(): the secrets the C++ registry knows (the environment's keys and tokens, values it was
# told), and what a URL carries as credentials, whoever wrote it.

# scheme://user:password@host — the part before "@", up to the first character a host cannot hold.
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([^\s/@'\"<>]+)@")
# ?key=... &access_token=... — a query parameter whose name says it holds a credential.
_SECRET_QUERY = re.compile(r"(?i)([?&][a-z0-9_\-]*(?:key|token|secret|password|passwd|signature|auth)[a-z0-9_\-]*=)"
                           r"[^&#\s'\"<>]+")
_MASK = "[redacted]"


def _native_redact(text: str) -> str:
    try:
        from . import _C
    except ImportError:  # the extension is not built (a source tree while it compiles): the patterns only
        return text
    try:
        return _C.secrets.redact(text)
    except (TypeError, UnicodeError):  # a lone surrogate, which the C++ side cannot take: as "?"
        return _C.secrets.redact(text.encode("utf-8", "replace").decode("utf-8"))


def redact(text: Any) -> str:
    """``text`` (made a str) with every secret the process knows masked as "[redacted]" — its fragments of 8
    characters and its hex and base64 spellings too — and every URL's user:password and credential-named
    query parameters masked."""
    text = str(text)
    if not text:
        return text
    text = _URL_CREDENTIALS.sub(lambda m: m.group(1) + _MASK + "@", text)
    text = _SECRET_QUERY.sub(lambda m: m.group(1) + _MASK, text)
    return _native_redact(text)


def remember_url_credentials(text: str) -> None:
    """Tells the secrets registry the credentials of every URL in ``text`` (``user:password@``), so they are
    masked wherever they are written later — run directories and transcripts too — not only in URLs."""
    for match in _URL_CREDENTIALS.finditer(str(text)):
        userinfo = match.group(2)
        try:
            from . import _C

            for value in {userinfo, userinfo.partition(":")[2]}:
                if value:
                    _C.secrets.remember(value)
        except (ImportError, TypeError, UnicodeError):
            return


class _RedactedStream:
    """A text stream whose writes go through redact() to the stream it wraps; everything else is the
    wrapped stream's (isatty, fileno, encoding, buffer...)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def redacted_output() -> Iterator[None]:
    """While the block runs, what is written to sys.stdout and sys.stderr is redacted (the CLI's boundary:
    results, errors, tracebacks, progress). Nested uses wrap once."""
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, _RedactedStream):
        sys.stdout = _RedactedStream(sys.stdout)  # type: ignore[assignment]
    if not isinstance(sys.stderr, _RedactedStream):
        sys.stderr = _RedactedStream(sys.stderr)  # type: ignore[assignment]
    try:
        yield
    except BaseException:
        # An exception that leaves the block ends the program: the traceback Python prints for it is redacted too.
        if not getattr(sys.excepthook, "redacts", False):
            sys.excepthook = _redacting_excepthook(sys.excepthook)
        raise
    finally:
        sys.stdout, sys.stderr = saved


def _redacting_excepthook(previous: Any) -> Any:
    def hook(kind: type, value: BaseException, tb: Any) -> None:
        import traceback

        if issubclass(kind, KeyboardInterrupt):
            return previous(kind, value, tb)
        sys.stderr.write(redact("".join(traceback.format_exception(kind, value, tb))))

    hook.redacts = True  # type: ignore[attr-defined]
    return hook


# ---- logging -------------------------------------------------------------------------------------


class _Redacting(logging.Filter):
    """Makes a record's message its redacted text, so that every handler — the application's too — gets
    it without the secrets (the record's arguments are folded into the message first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: logging reports it at emit time
            return True
        record.msg, record.args = redact(message), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


_REDACTING = _Redacting()


class _StderrHandler(logging.StreamHandler):
    """The package's own handler: the sys.stderr of the moment (a test's capture, rich's redirection while
    a live view runs), and silent while the application's root logger has handlers of its own."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(_Formatter())
        self.addFilter(lambda record: not logging.getLogger().handlers)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # under the handler's lock (Handler.handle)
        super().emit(record)


class _Formatter(logging.Formatter):
    """``[stitchcuda.graph] warning: text``; info records carry no level word."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        text = f"[{record.name}] {level}{record.getMessage()}"
        if record.exc_text or record.exc_info:
            text += "\n" + (record.exc_text or self.formatException(record.exc_info))
        return redact(text)


def configure() -> logging.Logger:
    """Gives the ``stitchcuda`` logger its stderr handler (once) and the level STITCHCUDA_LOG names (read
    again on every call, so a test or a long-lived process can change it). Returns the logger."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    if _REDACTING not in logger.filters:
        logger.addFilter(_REDACTING)
    try:
        level = read(ENV)
    except SettingsError as exc:
        level = None
        logger.setLevel(logging.WARNING)
        logger.warning("%s (warning is used)", exc)
    if level in LEVELS:
        logger.setLevel(LEVELS[level])
    return logger


def get_logger(name: str = LOGGER) -> logging.Logger:
    """The logger for `name` in the ``stitchcuda`` hierarchy: ``get_logger(__name__)`` in a module of the
    package, or a short name (``get_logger("graph")`` is ``stitchcuda.graph``)."""
    if name != LOGGER and not name.startswith(LOGGER + "."):
        name = f"{LOGGER}.{name}"
    logger = logging.getLogger(name)
    if _REDACTING not in logger.filters:  # a logger's filters see the records logged to it, before any handler
        logger.addFilter(_REDACTING)
    return logger


configure()


# ---- where progress goes -------------------------------------------------------------------------


def in_ci() -> bool:
    """True where CI is set to anything but an empty, 0, false or no value (every common CI service sets it)."""
    return bool(read("CI"))


def live_terminal(stream: TextIO) -> bool:
    """Whether progress on `stream` may redraw in place: a terminal (or Jupyter), not CI, not TERM=dumb."""
    if in_ci() or read("TERM") == "dumb":
        return False
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        tty = False
    return tty or _in_jupyter()


def _in_jupyter() -> bool:
    """A notebook's kernel runs this process (rich then draws into the notebook)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class _View:
    """A progress display: "live" (rich, redrawn in place), "plain" (whole lines) or "off".
    `console`: a rich Console to draw on (tests pass Console(force_terminal=True, width=...))."""

    def __init__(self, enabled: bool | None, stream: TextIO | None, console: Any) -> None:
        self._stream = stream
        self._console = console
        self._console_given = console is not None
        self.started = time.monotonic()
        if enabled is False:
            self.mode = "off"
        elif console is not None or live_terminal(self.stream):
            self.mode = "live"
        else:
            self.mode = "plain"

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def console(self) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self.stream)
        return self._console

    def _start_live(self, render) -> Any:
        from rich.live import Live

        # A console handed in (a test's) is redrawn only when asked: its output then says exactly what
        # each event drew. On a real terminal rich redraws four times a second, so the clock moves.
        auto = not self._console_given
        live = Live(get_renderable=render, console=self.console(), auto_refresh=auto, refresh_per_second=4,
                    transient=True, redirect_stdout=auto, redirect_stderr=auto)
        live.start()
        return live

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()


def _one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


# ---- optimize()'s stages -------------------------------------------------------------------------

_SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
_active_step: "StepProgress | None" = None  # the view whose stage is running, for note()


def note(text: str) -> None:
    """Shows `text` beside the running stage of a live StepProgress (the agents' latest event in graph
    mode); nothing otherwise. Safe from any thread."""
    view = _active_step
    if view is not None and view.mode == "live":
        view._note = _one_line(text)
        live = view._live
        if live is not None and not live.auto_refresh:  # a console handed in is redrawn when something changes
            live.refresh()


class StepProgress(_View):
    """optimize()'s long stages, one ``with progress.step("capturing"):`` each. On a terminal the running
    stage shows a clock and its latest note, and a finished one leaves a line with its time; elsewhere
    each stage prints a line when it starts and one when it ends. `enabled`: False silences it; None
    (the default) and True choose by the stream."""

    def __init__(self, enabled: bool | None = None, *, stream: TextIO | None = None, console: Any = None) -> None:
        super().__init__(enabled, stream, console)
        self._text = ""
        self._note = ""
        self._t0 = 0.0
        self._live = None

    def _render(self) -> Any:
        from rich.text import Text

        seconds = time.monotonic() - self._t0
        line = Text(f"{_SPINNER[int(seconds * 8) % len(_SPINNER)]} {self._text}… {_clock(seconds)}", no_wrap=True,
                    overflow="ellipsis")
        if self._note:
            line.append(f"  {self._note}", style="dim")
        return line

    @contextmanager
    def step(self, text: str) -> Iterator[None]:
        global _active_step
        if self.mode == "off":
            yield
            return
        self._text, self._note, self._t0 = text, "", time.monotonic()
        live = None
        if self.mode == "plain":
            self._line(f"[stitchcuda] {text}…")
        else:
            live = self._live = self._start_live(self._render)
            _active_step = self
        outcome = "failed"
        try:
            yield
            outcome = "done"
        except KeyboardInterrupt:
            outcome = "interrupted"
            raise
        finally:
            seconds = time.monotonic() - self._t0
            if live is not None:
                _active_step, self._live = None, None
                live.stop()
                from rich.text import Text

                mark = {"done": "[green]✓[/]", "failed": "[red]✗[/]"}.get(outcome, "[yellow]![/]")
                self.console().print(Text.from_markup(f"{mark} ").append(f"{text} ({outcome}, {seconds:.1f} s)"),
                                     no_wrap=True, overflow="ellipsis", crop=True)
            else:
                self._line(f"[stitchcuda] {text}: {outcome} ({seconds:.1f} s)")


# ---- the agents' loop ----------------------------------------------------------------------------


class _TokenCount:
    """Tokens the run has used so far: the sum of usage.total_tokens over run_dir/trajectories.jsonl, read
    from where the last look stopped (a resume rewrites the file whole: a shorter file is read again)."""

    def __init__(self, run_dir: Path | None) -> None:
        self.path = run_dir / "trajectories.jsonl" if run_dir is not None else None
        self.offset = 0
        self.total = 0
        self._lock = threading.Lock()  # the loop's thread and rich's refresh thread both ask

    def __call__(self) -> int:
        if self.path is None:
            return 0
        with self._lock:
            return self._read()

    def _read(self) -> int:
        try:
            size = self.path.stat().st_size
            if size < self.offset:
                self.offset, self.total = 0, 0
            if size == self.offset:
                return self.total
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read(size - self.offset)
        except OSError:
            return self.total
        end = chunk.rfind(b"\n") + 1  # a line still being written is read next time
        for line in chunk[:end].splitlines():
            try:
                self.total += int((json.loads(line).get("usage") or {}).get("total_tokens") or 0)
            except (ValueError, TypeError, AttributeError):
                continue
        self.offset += end
        return self.total


class LoopProgress(_View):
    """The agents' loop, fed its events (``on_event=progress``): attempt k of N, plan, best speed-up,
    tokens so far, elapsed time and the current step; finished attempts as a table. On a terminal the
    table's latest rows and the status line are redrawn in place and the whole table is printed at
    close(); elsewhere one line per event.

    `run_dir`: the run's folder (the token count is read from its trajectories.jsonl, the attempt budget
    from its config.json when `attempts` is not given)."""

    def __init__(self, run_dir: str | os.PathLike | None = None, *, attempts: int | None = None,
                 enabled: bool | None = None, stream: TextIO | None = None, console: Any = None) -> None:
        super().__init__(enabled, stream, console)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.budget = attempts
        self.tokens = _TokenCount(self.run_dir)
        self.rows: list[dict[str, Any]] = []
        self.event: dict[str, Any] = {"stage": "start", "attempt": 0, "plan": 0, "best_speedup": 0.0, "message": ""}
        self._attempt_started = self.started
        self._live = None
        self._lock = threading.Lock()

    def _attempts_budget(self) -> int | None:
        if self.budget is None and self.run_dir is not None:
            try:
                budget = json.loads((self.run_dir / "config.json").read_text(encoding="utf-8")).get("budget") or {}
                self.budget = int(budget["attempts"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return None
        return self.budget

    def _where(self) -> str:
        """"attempt 3 of 8" while one runs; "5 attempts" once the loop is done."""
        done, n = int(self.event["attempt"]), self._attempts_budget()
        if self.event["stage"] == "done":
            return f"{done} attempt{'s' if done != 1 else ''}"
        current = done + 1 if self.event["stage"] in ("code", "verify") or done == 0 else done
        if n:
            current = min(current, n)
        return f"attempt {current}" + (f" of {n}" if n else "")

    def status(self) -> str:
        """The status line, without the stage: attempt, plan, best, tokens, elapsed, message."""
        e = self.event
        best = f"{e['best_speedup']:.2f}x" if e["best_speedup"] > 0 else "-"
        return (f"{self._where()}, plan {e['plan']}, best {best}, {self.tokens():,} tokens, "
                f"{_clock(time.monotonic() - self.started)}: {_one_line(e['message'])}")

    def __call__(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.event = {**self.event, **event}
            stage = self.event["stage"]
            now = time.monotonic()
            if stage == "code":
                self._attempt_started = now
            elif stage == "feedback":
                index, _, outcome = str(self.event["message"]).partition(": ")
                self.rows.append({"attempt": index.removeprefix("attempt ").strip() or str(self.event["attempt"]),
                                  "plan": self.event["plan"], "outcome": _one_line(outcome or index),
                                  "best": self.event["best_speedup"], "tokens": self.tokens(),
                                  "seconds": now - self._attempt_started})
            if self.mode == "plain":
                self._line(f"[{stage}] {self.status()}")
            elif self.mode == "live":
                if self._live is None:
                    self._live = self._start_live(self._render)
                else:
                    self._live.refresh()

    def _table(self, rows: list[dict[str, Any]]) -> Any:
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", expand=False)
        for name, justify in (("#", "right"), ("plan", "right"), ("best", "right"), ("tokens", "right"),
                              ("time", "right")):
            table.add_column(name, justify=justify, no_wrap=True)
        # Wrappable, so that it is the column that narrows on a small terminal; each cell stays one line.
        table.add_column("outcome")
        for r in rows:
            table.add_row(str(r["attempt"]), str(r["plan"]), f"{r['best']:.2f}x" if r["best"] > 0 else "-",
                          f"{r['tokens']:,}", f"{r['seconds']:.1f} s",
                          Text(r["outcome"], no_wrap=True, overflow="ellipsis"))
        return table

    def _status_text(self) -> Any:
        from rich.text import Text

        line = Text(f"[{self.event['stage']}] ", style="bold", no_wrap=True, overflow="ellipsis")
        line.append(self.status())
        return line

    def _render(self) -> Any:
        from rich.console import Group

        parts = []
        if self.rows:
            room = max(3, self.console().size.height - 4)  # the latest rows that fit above the status line
            parts.append(self._table(self.rows[-room:]))
        parts.append(self._status_text())
        return Group(*parts)

    def close(self) -> None:
        """Ends the live view and prints the whole table and the last status line (live mode only)."""
        with self._lock:
            if self._live is None:
                return
            self._live.stop()
            self._live = None
            console = self.console()
            if self.rows:
                console.print(self._table(self.rows), crop=True)
            console.print(self._status_text(), no_wrap=True, overflow="ellipsis", crop=True)
