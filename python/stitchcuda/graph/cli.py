"""`stitchcuda optimize PROBLEM.py`: one command, two modes chosen by `--mode` (docs/cli.md).

- graph (the default): `stitchcuda.optimize(model, inputs)` — capture, partition, stitch the program —
  and the report; with `--llm SPEC` (or `--resume RUN_DIR`) the agents write kernels for the targets the
  Planner picks, recorded in a run directory.
- program: the agents' loop writes one `ModelNew` for the whole file (stitchcuda/agents/cli.py);
  it needs `--llm SPEC` or `--resume RUN_DIR`.

`--resume RUN_DIR` without `--mode` continues the run in the mode its config.json names.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..cli_support import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, BackendError, UsageError, at_least,
                           non_negative_float, one_line, refuse)

MODES = ("graph", "program")

# Options of one mode only (dest: flag), refused in the other so that nothing is silently ignored.
GRAPH_ONLY = {"precision": "--precision", "sgemm": "--sgemm", "save": "--save", "json": "--json",
              "show_kernels": "--show-kernels", "no_compile_baseline": "--no-compile-baseline"}
PROGRAM_ONLY = {"replans": "--replans", "target_speedup": "--target-speedup", "prompts": "--prompts",
                "static_only": "--static-only", "judge": "--judge", "timeout": "--timeout"}
# The agents' options graph mode passes to optimize(model, inputs, ...) when --llm or --resume is set.
AGENT_OPTIONS = {"run_dir": "--run-dir", "attempts": "--attempts", "tokens": "--tokens", "wall_s": "--wall-s"}


def _usage(args: argparse.Namespace, message: str, code: int = EXIT_USAGE) -> int:
    """An early end (a usage error unless `code` says otherwise): the message on stderr and, under --json,
    {"error": ...} on stdout."""
    return refuse("stitchcuda optimize", message.removeprefix("stitchcuda optimize: "), code,
                  getattr(args, "json", False))


def _given(args: argparse.Namespace, options: dict[str, str]) -> list[str]:
    """The flags of `options` the command line set (store_true flags count when true)."""
    return [flag for dest, flag in options.items() if getattr(args, dest, None) not in (None, False)]


def _saved_config(run_dir: str) -> dict[str, Any] | None:
    try:
        config = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def run_mode(config: dict[str, Any] | None) -> str | None:
    """The mode a run directory's config.json records: "graph" or "program"; runs made before graph
    mode had run directories say nothing and were program-mode runs. None without a config."""
    if config is None:
        return None
    return str(config.get("mode") or "program")


def _build(task) -> tuple[Any, list[Any]]:
    """Model(*get_init_inputs()) in eval mode (a problem file's Model is an inference reference, as the
    Verifier runs it) and get_inputs(); the user's code ending the process with sys.exit is reported as such."""
    from ..verify.task import TaskError

    try:
        return task.build_reference(0).eval(), task.make_inputs(0)
    except SystemExit as exc:
        raise TaskError(f"the problem called sys.exit({exc.code!r}) while building the model or its inputs") from None


def _agents_not_run(report, agents: bool) -> str:
    """Why the agents asked for with --llm did not run ("" when they ran or were not asked for)."""
    import torch

    if not agents or report.agents or report.run_dir:
        return ""
    if not torch.cuda.is_available():
        return ("no CUDA GPU here, and they verify and time each kernel they write on one: the plan was made and "
                "compiled only. The --llm set-up was checked before any work (spec, key, server)")
    return report.reason or "optimize() ended before the agents' stage"


def _run_graph(args: argparse.Namespace, config: dict[str, Any] | None) -> int:
    import torch

    from ..agents.cli import check_llm, interrupted
    from ..verify.cli import load_problem
    from ..verify.task import TaskError
    from .optimize import optimize

    agents = args.llm is not None or args.resume is not None
    if not agents and _given(args, AGENT_OPTIONS):
        return _usage(args, f"stitchcuda optimize: {', '.join(_given(args, AGENT_OPTIONS))} needs --llm SPEC (or "
                      "--resume RUN_DIR) in graph mode")
    problem = args.problem or (config or {}).get("problem_path")
    if problem is None:
        return _usage(args, "stitchcuda optimize: give PROBLEM.py" +
                      (" (the model file the run optimized)" if args.resume else ""))
    kwargs: dict[str, Any] = {}
    if agents:
        kwargs = _agent_kwargs(args, config)
        if not kwargs:
            return _usage(args, f"stitchcuda optimize: {args.resume} does not name its model; give --llm SPEC")
    try:
        if agents:  # before any work: a model the agents cannot reach is known now, not after the plan
            check_llm(kwargs["llm"])
        # Graph mode runs the model in this process: its Model() and forward() run once in the preflight's
        # child first, so that one that exits, crashes or hangs there is named, not the end of the command.
        task = load_problem(problem, run_model=True)
        model, inputs = _build(task)
    except (UsageError, TaskError) as exc:  # the user's file, or the spec: one line, no traceback
        return _usage(args, f"stitchcuda optimize: {exc}")
    except BackendError as exc:
        return _usage(args, f"stitchcuda optimize: {exc}", EXIT_FAILURE)
    if torch.cuda.is_available():
        model, inputs = model.cuda(), [t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs]
    from .. import log
    from ..errors import InvalidArgumentError, StitchError

    run_dir = None
    if agents:  # named here, not left to optimize(), so that a Ctrl-C can say which folder to resume
        from .. import _C

        run_dir = args.resume or kwargs.setdefault("run_dir", _C.agents.fresh_run_path("runs", type(model).__name__))
        kwargs["on_event"] = lambda e: log.note(f"{e.get('stage', '')}: {e.get('message', '')}")
    try:
        fast = optimize(model, inputs, precision=args.precision or "fp32", compare_compile=not args.no_compile_baseline,
                        progress=not args.json and None, split_tf32=not args.sgemm, **kwargs)
    except InvalidArgumentError as exc:  # a saved budget or option optimize() refuses
        return _usage(args, f"stitchcuda optimize: {one_line(exc.message) or exc}")
    except StitchError as exc:  # the model backend failed while the agents ran
        return _usage(args, f"stitchcuda optimize: {one_line(exc.message) or exc}", EXIT_FAILURE)
    except KeyboardInterrupt:
        if run_dir is None:
            print("stitchcuda optimize: interrupted (graph mode without --llm records no run: run the command again)",
                  file=sys.stderr)
            return EXIT_INTERRUPTED
        return interrupted(run_dir)
    not_saved = _save(args, fast, torch.cuda.is_available())
    skipped = _agents_not_run(fast.report, agents)
    _print_result(args, fast, skipped)
    if skipped:
        print(f"stitchcuda optimize: the agents did not run: {skipped}", file=sys.stderr)
    if not_saved:  # after the report, so it is the last thing said
        print(f"stitchcuda optimize: {args.save} not written: {not_saved}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _agent_kwargs(args: argparse.Namespace, config: dict[str, Any] | None) -> dict[str, Any]:
    """optimize()'s keyword arguments for the agents: the model spec (given, or the resumed run's), the run to
    resume and only the agent options given (optimize's own defaults otherwise); empty when no model is named."""
    llm = args.llm or (config or {}).get("llm_spec")
    if not isinstance(llm, str) or not llm:
        return {}
    kwargs: dict[str, Any] = {"llm": llm}
    if args.resume is not None:
        kwargs["resume"] = args.resume
    for dest in AGENT_OPTIONS:
        if getattr(args, dest) is not None:
            kwargs[dest] = getattr(args, dest)
    return kwargs


def _save(args: argparse.Namespace, fast: Any, gpu: bool) -> str:
    """Writes --save's artifact; the reason it was not written, or "" (also when --save was not given)."""
    if not args.save:
        return ""
    if fast.report.status != "optimized":
        not_saved = (fast.report.reason or "the model runs eagerly").split(";")[0]
        if not gpu:  # optimize() planned and compiled only: nothing verified to save
            not_saved += (": a .stitch holds a program verified and timed on a GPU; run this on a machine "
                          "with one, or drop --save to see the plan")
        return not_saved
    try:
        fast.save(args.save)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _print_result(args: argparse.Namespace, fast: Any, skipped: str) -> None:
    """The report on stdout: one JSON object (kernel sources left out) or the text, with --show-kernels' sources."""
    if args.json:
        report = fast.report.to_dict()
        for g in report["groups"]:
            g.pop("source", None)
        if skipped:
            report["agents_not_run"] = skipped
        print(json.dumps(report, default=str))
        return
    print(fast.report)
    if args.show_kernels:
        for g in fast.report.kernels:
            print(f"\n// ---- {g['kernel']} ({g['strategy']}) ----\n{g['source']}")


def _run(args: argparse.Namespace) -> int:
    config = None
    mode = args.mode
    if args.resume is not None:
        if not Path(args.resume).is_dir():
            return _usage(args, f"stitchcuda optimize: run directory '{args.resume}' does not exist")
        config = _saved_config(args.resume)
        if config is None:
            return _usage(args, f"stitchcuda optimize: '{args.resume}' is not a run directory: it has no readable "
                          "config.json")
        saved = run_mode(config)
        if saved == "graph-target":
            return _usage(args, f"stitchcuda optimize: {args.resume} is one target of a graph-mode run: resume the "
                          "graph run (the folder above targets/)")
        if mode is not None and saved is not None and saved != mode:
            return _usage(args, f"stitchcuda optimize: {args.resume} is a {saved}-mode run; drop --mode {mode}")
        mode = mode or saved
    mode = mode or "graph"
    wrong = _given(args, PROGRAM_ONLY if mode == "graph" else GRAPH_ONLY)
    if wrong:
        return _usage(args, f"stitchcuda optimize: {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} for "
                      f"--mode {'program' if mode == 'graph' else 'graph'}, not {mode} mode")
    if mode == "program":
        from ..agents import cli as agents_cli

        if args.llm is None and args.resume is None:
            return _usage(args, "stitchcuda optimize --mode program: give --llm SPEC (or --resume RUN_DIR)")
        return agents_cli.run_program(args, config)
    return _run_graph(args, config)


def register(commands) -> None:
    p = commands.add_parser(
        "optimize", help="optimize a model file (Model, get_inputs, get_init_inputs): graph mode, or --mode program",
        description="Graph mode (default): stitch the model into one program and print the report; with --llm the "
                    "agents write kernels for its heaviest parts. Program mode: the agents write one ModelNew.")
    p.add_argument("problem", metavar="PROBLEM.py", nargs="?",
                   help="KernelBench-format file (with --resume: the run's own, where it records one)")
    p.add_argument("--mode", choices=MODES,
                   help="graph (default; with --resume: the run's mode) or program (the agent loop writes a ModelNew; "
                        "needs --llm or --resume)")
    graph = p.add_argument_group("graph mode")
    graph.add_argument("--precision", choices=("fp32", "tf32", "bf16"),
                       help="what matmuls may trade for speed (default fp32: PyTorch's own flags)")
    graph.add_argument("--sgemm", action="store_true",
                       help="at fp32, keep every matmul on cuBLAS's SGEMM (by default a large one may run as three "
                            "TF32 tensor-core products on split operands, at fp32's accuracy: tf32x3)")
    graph.add_argument("--save", metavar="PATH", help="write the stitched program as a .stitch artifact")
    graph.add_argument("--json", action="store_true", help="print the report as one JSON object")
    graph.add_argument("--show-kernels", action="store_true", help="print the generated CUDA")
    graph.add_argument("--no-compile-baseline", action="store_true", help="skip timing torch.compile")
    agents = p.add_argument_group("the agents (graph mode with --llm; program mode)")
    agents.add_argument("--llm", metavar="SPEC", help="the agents' model: openai:MODEL[@URL], anthropic:MODEL, "
                                                      "scripted:RULES.json, python:MODULE:FN")
    agents.add_argument("--run-dir", metavar="DIR", help="record the run here (default runs/<UTC time>-<name>)")
    agents.add_argument("--resume", metavar="RUN_DIR", help="continue the run recorded in RUN_DIR, with its saved budget "
                                                            "unless options below replace it")
    agents.add_argument("--attempts", type=at_least(1), metavar="N",
                        help="candidates to verify (program: 8; graph: per target, 3)")
    agents.add_argument("--tokens", type=at_least(0), metavar="N", help="token budget of the run (default: none)")
    agents.add_argument("--wall-s", type=non_negative_float, metavar="S", help="wall-time budget (default: none)")
    program = p.add_argument_group("program mode")
    program.add_argument("--replans", type=at_least(0), metavar="N", help="new plans after the first (default 2)")
    program.add_argument("--target-speedup", type=non_negative_float, metavar="X",
                         help="stop once a correct candidate is X times faster than eager (default: no target)")
    program.add_argument("--prompts", metavar="DIR", help="prompt files (<name>.md) replacing the shipped ones")
    program.add_argument("--static-only", action="store_true",
                         help="compile and check candidates statically even where a GPU is present")
    program.add_argument("--timeout", type=non_negative_float, metavar="S",
                         help="seconds one model call may take, retries included (default 600; never more than "
                              "--wall-s)")
    program.add_argument("--judge", action="store_true",
                         help="the model also reviews each attempt's rubric items (may lower anti-hacking, "
                              "never raise it; off by default)")
    p.set_defaults(run=_run)
