"""stitchcuda.errors: one Python class per C++ error code, built by _from_native, picklable whole."""

from __future__ import annotations

import pickle

import pytest

import stitchcuda
from stitchcuda import errors

CODES = {
    "InvalidArgument": (errors.InvalidArgumentError, ValueError),
    "CompileError": (errors.CompileError, errors.StitchError),
    "LaunchError": (errors.LaunchError, errors.StitchError),
    "CudaError": (errors.CudaError, errors.StitchError),
    "NotFound": (errors.NotFoundError, LookupError),
    "Unavailable": (errors.UnavailableError, errors.StitchError),
    "IoError": (errors.StitchIOError, OSError),
    "LlmError": (errors.LLMError, errors.StitchError),
    "Timeout": (errors.StitchTimeoutError, TimeoutError),
    "Cancelled": (errors.CancelledError, errors.StitchError),
    "Internal": (errors.InternalError, errors.StitchError),
}


@pytest.mark.parametrize("code", sorted(CODES))
def test_each_native_code_maps_to_its_class(code):
    cls, builtin = CODES[code]
    exc = errors._from_native(code, "what failed", "", [])
    assert type(exc) is cls
    assert isinstance(exc, errors.StitchError) and isinstance(exc, builtin)
    assert exc.code == code and exc.message == "what failed" and str(exc) == "what failed"


def test_top_level_exports_are_the_same_classes():
    assert stitchcuda.CompileError is errors.CompileError
    assert stitchcuda.LaunchError is errors.LaunchError
    assert stitchcuda.StitchIOError is errors.StitchIOError


def test_unknown_code_becomes_internal_error_keeping_the_text():
    exc = errors._from_native("Mystery", "boom", "", [])
    assert type(exc) is errors.InternalError
    assert "Mystery" in str(exc) and "boom" in str(exc)


def test_compile_error_line_is_first_error_not_first_warning():
    exc = errors._from_native("CompileError", "compile failed", "full log text", [
        ("kernel.cu", 2, 3, "warning", "unused variable", "  int unused;"),
        ("kernel.cu", 7, 5, "error", "identifier \"y\" is undefined", "  y = 1;"),
        ("kernel.cu", 9, 1, "error", "second error", "}"),
    ])
    assert exc.line == 7
    assert exc.diagnostics[1] == errors.Diagnostic("kernel.cu", 7, 5, "error",
                                                   "identifier \"y\" is undefined", "  y = 1;")
    assert str(exc) == "compile failed\nfull log text"
    assert str(exc.diagnostics[1]).startswith("kernel.cu:7:5: error: identifier")
    with pytest.raises(Exception):
        exc.diagnostics[0].line = 3  # frozen


def test_http_status_and_transient_survive_pickling():
    exc = errors._from_native("LlmError", "HTTP 503", "body", [], 503, True)
    assert (exc.http_status, exc.transient) == (503, True)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is errors.LLMError and (back.http_status, back.transient, back.log) == (503, True, "body")
    timeout = pickle.loads(pickle.dumps(errors._from_native("Timeout", "too slow")))
    assert isinstance(timeout, TimeoutError) and str(timeout) == "too slow"


def test_compile_error_without_located_error_has_no_line():
    assert errors._from_native("CompileError", "failed", "log", []).line is None


def test_pickle_keeps_log_and_diagnostics():
    exc = errors._from_native("CompileError", "failed", "the log",
                              [("a.cu", 4, 2, "error", "bad", "x")])
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is errors.CompileError
    assert (back.message, back.log, back.line) == ("failed", "the log", 4)
    assert back.diagnostics == exc.diagnostics
