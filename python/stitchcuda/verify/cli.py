"""`stitchcuda check --reference ref.py --candidate cand.py [--json] [--static-only] [--trials N]`:
verifies one candidate and prints the verdict (or one JSON object). Exit 0 for a usable candidate, 1 for
one that is not, 2 for bad usage, 3 without a GPU unless --static-only or --device cpu."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..cli_support import (EXIT_FAILURE, EXIT_NO_GPU, EXIT_OK, UsageError, at_least, no_gpu_reason,
                           problem_folder_importable, read_problem, refuse)


def load_problem(path: str | Path, run_model: bool = False):
    """A problem file the commands take (`optimize`, `profile`) as a Task, with `check`'s bounds on its
    reference: a regular file of at most 1 MiB, imported first in a separate sandboxed process
    (verify.task.preflight), so that a file that crashes, exits or hangs while importing is an error naming
    it, never the end of this process; ``run_model``: the preflight also builds the model and runs its
    forward (for a command that runs them in its own process). Modules beside the file import. Raises
    cli_support.UsageError with the one line to show."""
    from .task import Task, TaskError, preflight

    text = read_problem(path)
    problem_folder_importable(path)
    try:
        if run_model:
            preflight(text, str(path), run_model=True)
        return Task.from_source(text, Path(path).stem or "problem", filename=str(path), isolated=True)
    except TaskError as exc:
        raise UsageError(str(exc)) from None


def register(commands) -> None:
    """Adds the `check` subcommand to the CLI's subparsers."""
    check = commands.add_parser("check", help="verify a candidate ModelNew against a reference problem "
                                              "(docs/verify.md)")
    check.add_argument("--reference", required=True, metavar="REF.py", help="KernelBench-format problem file")
    check.add_argument("--candidate", required=True, metavar="CAND.py", help="file defining ModelNew")
    check.add_argument("--json", action="store_true", help="print the report as one JSON object")
    check.add_argument("--static-only", action="store_true",
                       help="only NVRTC compile + static rules (no GPU needed; the verdict is unverified)")
    check.add_argument("--trials", type=at_least(5, "trials"), default=5, help="correctness trials (>= 5, default 5)")
    check.add_argument("--device", choices=("cuda", "cpu"), default=None,
                       help="where the candidate runs (default: cuda when a GPU is present)")
    check.add_argument("--timing-iters", type=int, default=100, help="timed calls per measurement (default 100)")
    check.set_defaults(run=_check)


def _check(args: argparse.Namespace) -> int:
    from .check import check
    from .config import VerifyConfig

    if not args.static_only and args.device != "cpu":
        # Without a GPU a CUDA candidate cannot run: its verdict would be a failure it did not earn.
        why = no_gpu_reason()
        if why is not None:
            return refuse("stitchcuda check", f"this machine has no usable CUDA GPU ({why}), and checking a candidate "
                          "runs it on one. Add --static-only to compile it and apply the static rules here (the "
                          "verdict is then unverified), or --device cpu for a candidate that runs on the CPU",
                          EXIT_NO_GPU, args.json)
    try:
        config = VerifyConfig(trials=args.trials, device=args.device, timing_iters=max(0, args.timing_iters))
        report = check(args.reference, args.candidate, config=config, static_only=args.static_only)
    except Exception as exc:  # check() reports bad input itself; this is the last line of defence
        return refuse("stitchcuda check", f"{type(exc).__name__}: {exc}", EXIT_FAILURE, args.json)
    if args.json:
        print(json.dumps(report.to_dict(), default=str))
    else:
        print(format_report(report))
    ok = report.compiled and not report.hack and (report.static_only or report.correct) and report.error is None
    return EXIT_OK if ok else EXIT_FAILURE


def format_report(report) -> str:
    """A short human-readable verdict."""
    verdict = "static checks only" if report.static_only else ("correct" if report.correct else "NOT correct")
    lines = [f"compiled  {report.compiled}", f"verdict   {verdict}", f"hack      {report.hack}"]
    if report.error:
        lines.append(f"error     {report.error['kind']}: {report.error['message'].splitlines()[0] if report.error['message'] else ''}")
    s = report.speedup
    if any(v is not None for v in s.values()):
        lines.append("speed-up  " + ", ".join(f"{k} {v:.3f}x" for k, v in s.items() if v is not None))
    t = report.timing
    if t.get("candidate_ms") is not None:
        lines.append(f"time      candidate {t['candidate_ms']:.4f} ms (median of {t.get('trials')}), eager "
                     f"{t.get('eager_ms', float('nan')):.4f} ms" +
                     (f", compile {t['compile_ms']:.4f} ms" if t.get("compile_ms") else ""))
    for f in report.findings:
        lines.append(f"{f.severity:5} {f.rule:26} {('line ' + str(f.line)) if f.line else '':9} {f.evidence}")
    if report.feedback:
        lines.append("")
        lines.append(report.feedback)
    return "\n".join(lines)
