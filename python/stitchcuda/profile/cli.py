"""`stitchcuda profile PROBLEM.py`: profile a KernelBench-format reference (Model, get_inputs,
get_init_inputs) on the GPU and print its report. Bad input gives one line on stderr (and {"error": ...}
under --json): exit 2 for a file that cannot be used, 3 without a GPU or CUPTI, 1 when the model fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType


class _BadProblem(Exception):
    """The problem file cannot be used; the message is the one line the user sees."""


def _load_problem(path: Path) -> ModuleType:
    if not path.is_file():
        raise _BadProblem(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(f"_stitchcuda_problem_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise _BadProblem(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: any failure is reported, never a traceback
        raise _BadProblem(f"{path}: failed to load: {type(exc).__name__}: {exc}") from exc
    missing = [name for name in ("Model", "get_inputs", "get_init_inputs") if not hasattr(module, name)]
    if missing:
        raise _BadProblem(f"{path}: not a KernelBench problem: it defines no {', '.join(missing)}")
    return module


def _to_cuda(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cuda(v) for v in value)
    return value


def _run(args: argparse.Namespace) -> int:
    from ..cli import EXIT_FAILURE, EXIT_NO_GPU, EXIT_OK, EXIT_USAGE, refuse
    from ..errors import StitchError
    from . import available, profile

    path = Path(args.problem)
    try:
        problem = _load_problem(path)
    except _BadProblem as exc:
        return refuse("stitchcuda profile", str(exc), EXIT_USAGE, args.json)
    ok, reason = available()
    if not ok:
        return refuse("stitchcuda profile", reason, EXIT_NO_GPU, args.json)
    import torch

    try:
        init_inputs = problem.get_init_inputs()
        model = problem.Model(*init_inputs).cuda().eval()
        inputs = _to_cuda(list(problem.get_inputs()))
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


def _top_k(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("at least 1")
    return value


def register(commands) -> None:
    """Adds the `profile` subcommand to the CLI's subparsers."""
    parser = commands.add_parser("profile", help="profile a KernelBench problem file on the GPU (docs/profile.md)")
    parser.add_argument("problem", metavar="PROBLEM.py", help="file defining Model, get_inputs, get_init_inputs")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--top-k", type=_top_k, default=10, help="kernels to show (default 10)")
    parser.add_argument("--no-metrics", action="store_true", help="skip hardware metrics (no kernel replay)")
    parser.set_defaults(run=_run)
