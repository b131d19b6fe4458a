"""`stitchcuda optimize PROBLEM.py`: optimize a KernelBench-format model file and print the report."""

from __future__ import annotations

import argparse
import json
import sys

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _run(args: argparse.Namespace) -> int:
    import torch

    from ..verify import Task
    from ..verify.task import TaskError
    from .optimize import optimize

    try:
        task = Task.from_file(args.problem)
    except (TaskError, OSError) as exc:
        print(f"stitchcuda optimize: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        model, inputs = task.build_reference(0), task.make_inputs(0)
    except TaskError as exc:  # the user's file raised: one line, no traceback
        print(f"stitchcuda optimize: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if torch.cuda.is_available():
        model, inputs = model.cuda(), [t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs]
    fast = optimize(model, inputs, precision=args.precision, compare_compile=not args.no_compile_baseline,
                    progress=not args.json and None)
    if args.save:
        if fast.report.status == "optimized":
            fast.save(args.save)
        else:
            print(f"stitchcuda optimize: {args.save} not written: the model runs eagerly (see the report)",
                  file=sys.stderr)
    if args.json:
        report = fast.report.to_dict()
        for g in report["groups"]:
            g.pop("source", None)
        print(json.dumps(report, default=str))
    else:
        print(fast.report)
        if args.show_kernels:
            for g in fast.report.kernels:
                print(f"\n// ---- {g['kernel']} ({g['strategy']}) ----\n{g['source']}")
    return EXIT_OK


def register(commands) -> None:
    p = commands.add_parser("optimize", help="optimize a model file (Model, get_inputs, get_init_inputs); print the report")
    p.add_argument("problem", metavar="PROBLEM.py", help="KernelBench-format file")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="fp32",
                   help="what matmuls may trade for speed (default fp32: PyTorch's own flags)")
    p.add_argument("--save", metavar="PATH", help="write the stitched program as a .stitch artifact")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--show-kernels", action="store_true", help="print the generated CUDA")
    p.add_argument("--no-compile-baseline", action="store_true", help="skip timing torch.compile")
    p.set_defaults(run=_run)
