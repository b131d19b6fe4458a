"""What check() accepts as input: only regular files of a bounded size (a FIFO never blocks it), a
config of the right kind and types, and a static-only report that says what it could not decide."""

from __future__ import annotations

import json
import os

import pytest

from stitchcuda.errors import InvalidArgumentError

from test_jit_includes import REFERENCE, candidate  # the problem and candidate of the include tests

CANDIDATE = candidate("cuda_fp16.h")


def test_files_that_are_not_regular_are_refused_not_read(tmp_path):
    from stitchcuda.verify import check

    fifo = tmp_path / "candidate.py"
    os.mkfifo(fifo)  # opening it would block until a writer came
    report = check(REFERENCE, fifo, static_only=True)
    assert report.error["kind"] == "bad-candidate" and "not a regular file" in report.error["message"]
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * (1 << 20))  # 6 MiB
    report = check(REFERENCE, big, static_only=True)
    assert report.error["kind"] == "bad-candidate" and "bytes, more than" in report.error["message"]
    report = check(tmp_path, CANDIDATE, static_only=True)
    assert report.error["kind"] == "bad-reference" and "not a regular file" in report.error["message"]


def test_a_config_of_the_wrong_kind_is_an_error_that_names_it():
    from stitchcuda.verify import VerifyConfig, check

    with pytest.raises(InvalidArgumentError, match="config must be a VerifyConfig"):
        check(REFERENCE, CANDIDATE, config="bad")
    with pytest.raises(InvalidArgumentError, match="no field.* timing_iter;"):
        check(REFERENCE, CANDIDATE, config={"timing_iter": 3})
    with pytest.raises(InvalidArgumentError, match="timing_iters must be int, got str"):
        VerifyConfig(timing_iters="10")
    with pytest.raises(InvalidArgumentError, match="compile_baseline must be bool"):
        VerifyConfig(compile_baseline="no")
    assert VerifyConfig.from_dict({"timing_iters": 3}, strict=True).timing_iters == 3


def test_a_static_only_report_says_what_it_could_not_decide():
    from stitchcuda.verify import VerifyReport, check
    from stitchcuda.verify.check import STATIC_UNDECIDED

    report = check(REFERENCE, CANDIDATE, static_only=True)
    assert report.compiled and not report.hack and report.undecided == list(STATIC_UNDECIDED)
    assert "Not decided without running it" in report.feedback and "CUPTI attribution" in report.feedback
    again = VerifyReport.from_dict(json.loads(report.to_json()))
    assert again.undecided == report.undecided
    from stitchcuda import agents
    assert agents.report_from_json(report.to_json())["compiled"]  # the C++ reader takes the new field


@pytest.mark.parametrize("module_line, cause", [
    ("import ctypes; ctypes.string_at(0)", "crashed while importing (SIGSEGV)"),
    ("import os; os._exit(0)", "ended the process while importing (exit status 0)"),
    ("import time\nwhile True:\n    time.sleep(0.05)", "did not finish importing within 3 s"),
])
def test_a_reference_that_crashes_exits_or_hangs_at_import_is_an_error_naming_it(tmp_path, monkeypatch,
                                                                                   module_line, cause):
    from stitchcuda.verify import check, task

    monkeypatch.setattr(task, "PREFLIGHT_TIMEOUT_S", 3.0)
    monkeypatch.setattr(task.preflight, "__defaults__", (3.0,))
    bad = tmp_path / "bad_problem.py"
    bad.write_text(module_line + "\n" + REFERENCE)
    report = check(bad, CANDIDATE, static_only=True)  # this process survives to read the report
    assert report.error["kind"] == "bad-reference", report.error
    assert str(bad) in report.error["message"] and cause in report.error["message"], report.error
    assert check(REFERENCE, CANDIDATE, static_only=True).compiled  # and goes on


def test_stitchcudas_own_programs_are_not_held_to_the_source_size_bound():
    from stitchcuda.verify import check

    big = CANDIDATE + "\nPROGRAM = " + repr("A" * (2 << 20)) + "\n"  # an embedded artifact of 2 MiB
    assert "more than" in check(REFERENCE, big, static_only=True).error["message"]
    trusted = check(REFERENCE, big, static_only=True, trusted=True)
    assert trusted.error is None or "more than" not in trusted.error["message"]
