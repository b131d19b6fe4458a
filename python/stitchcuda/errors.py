"""Typed exceptions raised by StitchCUDA, one class per C++ ``stitchcuda::ErrorCode``.

The native module builds them through :func:`_from_native`, so C++ and Python share one hierarchy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Diagnostic:
    """One compiler diagnostic, with its line mapped to the source the caller gave."""

    file: str
    line: int  # 1-based; 0 when the compiler did not say
    column: int  # 1-based; 0 when unknown
    severity: str  # "error", "warning" or "remark"
    message: str
    source_line: str  # text of that line when it is in the caller's source, else ""

    def __str__(self) -> str:
        where = self.file
        if self.line:
            where += f":{self.line}"
            if self.column:
                where += f":{self.column}"
        text = f"{where}: {self.severity}: {self.message}"
        if self.source_line:
            text += f"\n    {self.source_line.strip()}"
        return text


class StitchError(Exception):
    """Base class: every failure StitchCUDA reports carries a code, a message and the tool log."""

    code = "Internal"

    def __init__(self, message: str, log: str = "", diagnostics: Iterable[Diagnostic] = (),
                 http_status: int = 0, transient: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.log = log
        self.diagnostics: list[Diagnostic] = list(diagnostics)
        self.http_status = http_status  # HTTP status of the reply that failed; 0 when none
        self.transient = transient  # trying again may succeed (already retried where StitchCUDA retries)

    def __str__(self) -> str:
        from .log import redact  # what is shown of an error never holds a secret (a key, a URL's password)

        if self.log and self.log.strip() and self.log.strip() not in self.message:
            return redact(f"{self.message}\n{self.log.rstrip()}")
        return redact(self.message)

    # Exceptions pickle through self.args (the message only); keep the log and diagnostics so an
    # error raised in an isolated worker process arrives whole in the parent.
    def __reduce__(self):
        return (_rebuild, (self.code, self.message, self.log, self.diagnostics, self.http_status,
                           self.transient))


class InvalidArgumentError(StitchError, ValueError):
    """The caller passed something unusable: a bad option, argument, architecture or configuration."""

    code = "InvalidArgument"


class CompileError(StitchError):
    """NVRTC rejected the source; ``.log`` is the full log, ``.line`` the first error's line."""

    code = "CompileError"

    @property
    def line(self) -> int | None:
        for diagnostic in self.diagnostics:
            if diagnostic.severity == "error" and diagnostic.line > 0:
                return diagnostic.line
        return None


class LaunchError(StitchError):
    """A kernel could not be launched, or failed while running (reported at synchronization)."""

    code = "LaunchError"


class CudaError(StitchError):
    """Any other CUDA driver failure."""

    code = "CudaError"


class NotFoundError(StitchError, LookupError):
    """A named thing (kernel, file, symbol) does not exist; the message lists what does."""

    code = "NotFound"


class UnavailableError(StitchError):
    """A component (driver, NVRTC, GPU) is missing on this machine."""

    code = "Unavailable"


class _OSErrorFromStitch(StitchError):
    """Base of the classes that are also OSErrors: OSError.__init__ would reinterpret
    (message, log, ...) as (errno, strerror, ...), so construction and text bypass it."""

    def __init__(self, message: str, log: str = "", diagnostics: Iterable[Diagnostic] = (),
                 http_status: int = 0, transient: bool = False) -> None:
        StitchError.__init__(self, message, log, diagnostics, http_status, transient)

    def __str__(self) -> str:
        return StitchError.__str__(self)


class StitchIOError(_OSErrorFromStitch, OSError):
    """A file or folder could not be read or written; the message names the path."""

    code = "IoError"


class LLMError(StitchError):
    """A model server failed, refused, or answered with something unusable; ``.http_status`` is the
    HTTP status (0 when the server was not reached), the message says what to check."""

    code = "LlmError"


class StitchTimeoutError(_OSErrorFromStitch, TimeoutError):
    """An operation (a model call, its retries included) did not finish within its time limit."""

    code = "Timeout"


class CancelledError(StitchError):
    """The caller cancelled the operation (a CancelToken, or Ctrl-C while waiting)."""

    code = "Cancelled"


class InternalError(StitchError):
    """A bug in StitchCUDA; please report it with the message."""

    code = "Internal"


_BY_CODE: dict[str, type[StitchError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        CompileError,
        LaunchError,
        CudaError,
        NotFoundError,
        UnavailableError,
        StitchIOError,
        LLMError,
        StitchTimeoutError,
        CancelledError,
        InternalError,
    )
}


def _rebuild(code: str, message: str, log: str, diagnostics: Sequence[Diagnostic], http_status: int = 0,
             transient: bool = False) -> StitchError:
    return _BY_CODE.get(code, InternalError)(message, log, diagnostics, http_status, transient)


def _from_native(
    code: str,
    message: str,
    log: str = "",
    diagnostics: Sequence[tuple[str, int, int, str, str, str]] = (),
    http_status: int = 0,
    transient: bool = False,
) -> StitchError:
    """Builds the exception for a C++ ``stitchcuda::Error`` (called by ``stitchcuda._C``)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        # A new C++ code without a Python class is itself a bug; keep the original text visible.
        cls = InternalError
        message = f"[unknown error code {code!r}] {message}"
    parsed = [Diagnostic(str(f), int(ln), int(col), str(sev), str(msg), str(src))
              for f, ln, col, sev, msg, src in diagnostics]
    return cls(message, log, parsed, int(http_status), bool(transient))


__all__ = [
    "Diagnostic",
    "StitchError",
    "InvalidArgumentError",
    "CompileError",
    "LaunchError",
    "CudaError",
    "NotFoundError",
    "UnavailableError",
    "StitchIOError",
    "LLMError",
    "StitchTimeoutError",
    "CancelledError",
    "InternalError",
]
