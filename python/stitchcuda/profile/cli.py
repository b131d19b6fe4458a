"""`stitchcuda profile PROBLEM.py`: profile a KernelBench-format reference (Model, get_inputs,
get_init_inputs) on the GPU and print its report. Bad input gives one line on stderr (and {"error": ...}
under --json): exit 2 for a file that cannot be used, 3 without a GPU or CUPTI, 1 when the model fails.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..cli_support import EXIT_FAILURE, EXIT_NO_GPU, EXIT_OK, EXIT_USAGE, UsageError, at_least, refuse


def _to_cuda(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cuda(v) for v in value)
    return value


def _run(args: argparse.Namespace) -> int:
    from ..errors import StitchError
    from ..verify.cli import load_problem
    from . import available, profile

    path = Path(args.problem)
    try:  # bounded and imported first in a separate process, as `check` treats its reference
        task = load_problem(path)
    except UsageError as exc:
        return refuse("stitchcuda profile", str(exc), EXIT_USAGE, args.json)
    ok, reason = available()
    if not ok:
        return refuse("stitchcuda profile", reason, EXIT_NO_GPU, args.json)
    import torch

    try:
        model = task.build_reference(0).cuda().eval()
        inputs = _to_cuda(list(task.make_inputs(0)))
    except Exception as exc:  # the user's code
        return refuse("stitchcuda profile", f"{path}: building the model failed: {type(exc).__name__}: {exc}",
                      EXIT_FAILURE, args.json)
    try:
        with torch.inference_mode():
            report = profile(model, *inputs, top_k=args.top_k, metrics=not args.no_metrics, title=path.name)
    except StitchError as exc:
        return refuse("stitchcuda profile", exc.message, EXIT_FAILURE, args.json)
    except Exception as exc:  # the model's forward failed
        return refuse("stitchcuda profile", f"{path}: running the model failed: {type(exc).__name__}: {exc}",
                      EXIT_FAILURE, args.json)
    print(json.dumps(report.to_dict()) if args.json else str(report))
    return EXIT_OK


def register(commands) -> None:
    """Adds the `profile` subcommand to the CLI's subparsers."""
    parser = commands.add_parser("profile", help="profile a KernelBench problem file on the GPU (docs/profile.md)")
    parser.add_argument("problem", metavar="PROBLEM.py", help="file defining Model, get_inputs, get_init_inputs")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--top-k", type=at_least(1), default=10, help="kernels to show (default 10)")
    parser.add_argument("--no-metrics", action="store_true", help="skip hardware metrics (no kernel replay)")
    parser.set_defaults(run=_run)
