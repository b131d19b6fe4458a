"""The `stitchcuda` command line (also `python -m stitchcuda`): doctor, demo, benchmarks, llm ping, and the
commands layers keep beside their code (optimize, runs, profile, check).

Exit codes (docs/cli.md has the table): 0 success; 1 the command ran and the answer is no (a check
failed, no usable candidate, a backend error); 2 usage (a bad option, a file that cannot be used); 3 the
machine lacks what the command needs (a CUDA GPU, the profiler), so nothing ran; 130 interrupted.
With --json, stdout holds one JSON object whatever the outcome: {"error": MESSAGE} when the command could
not do its work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

# The exit codes and the early end live on the ground floor (cli_support.py), where the layers' own CLI
# modules import them without climbing back up to this file; re-exported as stitchcuda.cli.EXIT_*.
from .cli_support import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_NO_GPU, EXIT_OK, EXIT_USAGE, at_least,  # noqa: F401
                          no_gpu_reason, refuse)


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import doctor, format_report

    report = doctor()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report))
    return EXIT_OK if report.ok else EXIT_FAILURE


def _demo(args: argparse.Namespace) -> int:
    import torch

    from . import _C, jit
    from .bench.jit import ELEMENTWISE
    from .errors import StitchError

    try:
        start = time.perf_counter()
        kernel = jit.compile(ELEMENTWISE, "add_f32")
        wall_ms = (time.perf_counter() - start) * 1e3
    except StitchError as exc:
        print(f"compile failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    module = kernel.module
    how = {"compiled": f"compiled by NVRTC ({module.compile_ms:.1f} ms)",
           "memory": "from the in-process cache", "disk": "from the disk cache"}.get(module.origin, module.origin)
    print(f"{kernel.name}({', '.join(kernel.signature or [])}) for {module.arch} in {wall_ms:.1f} ms: "
          f"{how}, cache key {module.key[:16]}…")
    print(f"  PTX {len(module.ptx)} chars, CUBIN {len(module.cubin)} bytes, "
          f"params {[p.kind for p in kernel.params]}")

    if _C.device_count() == 0:
        ok, reason = _C.driver_available()
        why = reason if not ok else "the driver reports no GPU"
        print(f"launch skipped: {why} (compile-only mode)")
        return EXIT_OK

    try:
        attrs = kernel.attributes
        print(f"  {attrs.num_registers} registers/thread, {attrs.local_bytes} B local memory, "
              f"{kernel.occupancy(256)} blocks of 256 per SM")
        n = (1 << 20) + 3  # not a multiple of 4: exercises the scalar tail
        a = torch.randn(n, device="cuda")
        b = torch.randn(n, device="cuda")
        out = torch.empty_like(a)
        block = 256
        grid = min((n // 4 + block - 1) // block + 1, 65535)
        kernel(grid, block, a, b, out, n)
        expected = a + b
        torch.cuda.synchronize()
    except StitchError as exc:
        print(f"launch failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    err = (out - expected).abs().max().item()
    print(f"launched on {torch.cuda.get_device_name()}: {n} elements, max |error| vs torch = {err:g}")
    if err != 0.0:  # one fp32 add per element: exactly what torch computes
        print("result differs from torch", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    from .bench import jit as bench_jit

    result = bench_jit.run(repeats=args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        print(bench_jit.format_result(result))
    return EXIT_OK


MODEL_BENCHES = ("suite", "kernelbench", "lowp")  # folders of KernelBench-format problems, run by bench/suite.py


def _bench_suite(args: argparse.Namespace) -> int:
    """Benchmarks that live beside their layer: stitchcuda.bench.<suite>.run(json_output); the model folders
    (suite, kernelbench) go through stitchcuda.bench.suite.run_suite with their options."""
    import importlib

    if args.suite in MODEL_BENCHES:
        from .bench import suite

        return int(suite.run_suite(args.suite, folder=args.dir, only=args.only, chunk=args.chunk,
                                   results=args.results, json_output=args.json, llm=args.llm, csv=args.csv,
                                   html=args.html, compile_only=args.compile_only, no_compile=args.no_compile,
                                   gpus=args.gpus, scaling=args.scaling, queue=args.queue, precision=args.precision,
                                   small=args.small, compile_modes=tuple(filter(None, args.compile_modes.split(",")))))
    module = importlib.import_module(f"stitchcuda.bench.{args.suite}")
    return int(module.run(json_output=args.json))


def _chunk(text: str) -> str:
    """K/N with 1 <= K <= N (checked here, so a typo is a usage error before any GPU work)."""
    from .bench.suite import parse_chunk

    try:
        parse_chunk(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _gpu_count(text: str) -> int:
    """A whole number of GPUs, at least 1 (checked here, so a typo is a usage error before any work)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--gpus takes a whole number of GPUs, at least 1, got {text!r}")
    return int(text)


def _model_bench_options(sub: argparse.ArgumentParser, default_dir: str) -> None:
    """The options of `bench suite` and `bench kernelbench` (docs: stitchcuda/bench/suite.py)."""
    sub.add_argument("--dir", type=Path, default=None, help=f"folder of KernelBench-format problem files "
                     f"(default: {default_dir})")
    sub.add_argument("--only", metavar="A,B", default=None,
                     help="comma-separated file stems to run (default: STITCHCUDA_SUITE_ONLY, else all)")
    sub.add_argument("--chunk", metavar="K/N", type=_chunk, default=None,
                     help="every N-th problem from the K-th (default: STITCHCUDA_SUITE_CHUNK, else all)")
    sub.add_argument("--results", metavar="FILE.jsonl", type=Path, default=None,
                     help="append each finished row here and skip problems already in it (resumable)")
    sub.add_argument("--llm", metavar="SPEC", default=None,
                     help="add the agents' column: optimize(llm=SPEC), e.g. openai:gpt-4.1")
    sub.add_argument("--csv", metavar="FILE.csv", type=Path, default=None, help="write the rows as CSV too")
    sub.add_argument("--html", metavar="FILE.html", type=Path, default=None,
                     help="write a self-contained HTML report with plots (needs matplotlib)")
    sub.add_argument("--compile-only", action="store_true",
                     help="no timing: capture, plan and compile each problem (runs without a GPU)")
    sub.add_argument("--no-compile", action="store_true",
                     help="time eager and StitchCUDA only, without the two torch.compile columns (a quicker "
                          "run for diagnosis; its rows are never reused by a full run)")
    sub.add_argument("--gpus", metavar="N", type=_gpu_count, default=1,
                     help="spread the problems over N GPUs of this machine, one bench process each (default 1: "
                          "this process); with --compile-only, N processes on the CPU")
    sub.add_argument("--scaling", action="store_true",
                     help="run the problems on 1 GPU, then on --gpus N, and report the wall times, the "
                          "efficiency and whether each problem's results agree")
    sub.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="fp32",
                     help="torch's matmul/cuDNN flags for every column and optimize(precision=...): fp32 (TF32 "
                          "off, default), tf32, bf16; the tolerance follows (docs/graph.md)")
    sub.add_argument("--small", action="store_true",
                     help="every problem at its SMALL sizes (a module-level dict of its constants), e.g. for "
                          "--compile-only on a CPU")
    sub.add_argument("--compile-modes", metavar="M,N", default="",
                     help="torch.compile modes timed beside default and reduce-overhead: max-autotune-no-cudagraphs, "
                          "max-autotune (each with its compile seconds)")
    sub.add_argument("--queue", metavar="DIR", type=Path, default=None,
                     help=argparse.SUPPRESS)  # a --gpus run's shared queue, given to its bench processes


def _folder_as_suite(argv: list[str], bench_names: Sequence[str]) -> list[str]:
    """`bench DIR ...` is `bench kernelbench --dir DIR ...`: a first argument after `bench` that names no
    benchmark and is a folder (or a path) is the folder of problems."""
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] not in bench_names and not argv[1].startswith("-") \
            and (Path(argv[1]).is_dir() or "/" in argv[1]):
        return ["bench", "kernelbench", "--dir", argv[1], *argv[2:]]
    return argv


PING_PROMPT = "Reply with the single word: pong"


def _llm_ping(args: argparse.Namespace) -> int:
    from . import llm
    from .errors import StitchError

    try:
        backend = llm.connect(args.spec)
        # allow_truncated: a reasoning model may spend a small budget thinking; an answer is an answer.
        reply = backend.complete([{"role": "user", "content": PING_PROMPT}], max_tokens=args.max_tokens,
                                 timeout=args.timeout, stream=args.stream, allow_truncated=True)
    except StitchError as exc:
        return refuse(f"llm ping {args.spec} failed", str(exc), EXIT_FAILURE, args.json)
    u = reply.usage
    if args.json:
        print(json.dumps({"backend": backend.name, "model": reply.model, "latency_ms": reply.latency_ms,
                          "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                                    "total_tokens": u.total_tokens},
                          "finish_reason": reply.finish_reason, "attempts": reply.attempts, "reply": reply.text}))
        return EXIT_OK
    print(f"backend    {backend.name}")
    print(f"model      {reply.model or '(not reported)'}")
    print(f"latency    {reply.latency_ms:.1f} ms ({reply.attempts} attempt{'s' if reply.attempts > 1 else ''})")
    print(f"usage      {u.prompt_tokens} prompt + {u.completion_tokens} completion = {u.total_tokens} tokens")
    print(f"reply      {reply.text.strip()} [{reply.finish_reason}]")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stitchcuda",
                                     description="StitchCUDA: turns PyTorch models into optimized, verified CUDA programs (optimize), and checks, profiles and benchmarks them.")
    parser.set_defaults(run=None, usage_of=parser)
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = commands.add_parser("doctor", help="check GPU, driver, CUDA, NVRTC, CUPTI, torch, cache")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(run=_doctor)

    demo = commands.add_parser("demo", help="compile a kernel with NVRTC and run it where a GPU exists")
    demo.set_defaults(run=_demo)

    bench = commands.add_parser("bench", help="run a benchmark, or `bench DIR`: a folder of KernelBench-format "
                                              "problems",
                                description="SUITE is a benchmark below, or the path of a folder of "
                                            "KernelBench-format problems (`bench DIR [options]` is `bench "
                                            "kernelbench --dir DIR [options]`).")
    bench.set_defaults(run=None, usage_of=bench)
    suites = bench.add_subparsers(dest="suite", metavar="SUITE")
    jit = suites.add_parser("jit", help="compile, cache and launch costs against nvcc's load_inline (docs/jit.md)")
    jit.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    jit.add_argument("--repeats", type=at_least(5, "(cold compile times are medians)"), default=5, help="cold compiles per kernel (>= 5)")
    for suite, text in (("program", "program runtime: graph replay host time, cuBLASLt epilogues, planning "
                                    "(docs/program.md)"),
                        ("profile", "profiler: Tracer vs events, tracing overhead, metrics vs ncu (docs/profile.md)"),
                        ("verify", "verifier: candidates per minute, speed-up agreement (docs/verify.md)"),
                        ("graph", "optimize(model) end to end: speed-up vs eager and torch.compile (docs/graph.md)"),
                        ("suite", "the bench/suite models: eager vs torch.compile (default, reduce-overhead) vs "
                                  "optimize, correctness, memory (docs/graph.md)"),
                        ("kernelbench", "the same over bench/kernelbench: KernelBench-format problems at large "
                                        "sizes, summarized per class"),
                        ("lowp", "the same over bench/lowp: real models in bf16, fp16 and under autocast, judged by "
                                 "accuracy against an fp64 reference (docs/graph.md)")):
        sub = suites.add_parser(suite, help=text)
        sub.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        if suite in MODEL_BENCHES:
            _model_bench_options(sub, "STITCHCUDA_SUITE_DIR, else bench/suite" if suite == "suite"
                                 else f"bench/{suite}")
        sub.set_defaults(run=_bench_suite)
    from .bench import reward as bench_reward

    bench_reward.register(suites)  # `bench reward`, with its own options
    from .bench import inference as bench_inference

    bench_inference.register(suites)  # `bench inference`, with its own options
    # Both take a minute or more before they print anything: a running stage on stderr says what is happening.
    jit.set_defaults(run=_stepped("bench jit: cold compiles, cache hits, nvcc's load_inline, launches", _bench))
    reward = suites.choices["reward"]
    reward.set_defaults(run=_stepped("bench reward: the Verifier alone, then through the reward service",
                                     reward.get_default("run")))
    parser.bench_names = tuple(suites.choices)  # for `bench DIR` (main)

    llm = commands.add_parser("llm", help="model backends (docs/llm.md)")
    llm.set_defaults(run=None, usage_of=llm)
    llm_commands = llm.add_subparsers(dest="llm_command", metavar="COMMAND")
    ping = llm_commands.add_parser("ping", help="send one short request; print model, latency and usage")
    ping.add_argument("spec", metavar="SPEC", help="PROVIDER:MODEL[@BASE_URL], e.g. openai:gpt-4.1")
    ping.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ping.add_argument("--stream", action="store_true", help="stream the reply")
    ping.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole call (default 60)")
    ping.add_argument("--max-tokens", type=int, default=32, help="completion token limit (default 32)")
    ping.set_defaults(run=_llm_ping)

    # Layers that own a subcommand keep it beside their code.
    from .agents import cli as agents_cli
    from .graph import cli as graph_cli
    from .profile import cli as profile_cli
    from .rl import service as rl_service
    from .verify import cli as verify_cli

    graph_cli.register(commands)  # `optimize`, both modes (--mode graph|program)
    agents_cli.register(commands)  # `runs`
    profile_cli.register(commands)
    verify_cli.register(commands)
    rl_service.register(commands)  # `serve reward`
    return parser


def _stepped(text: str, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run` inside one progress stage (stitchcuda.log.StepProgress, on stderr: stdout keeps the result)."""

    def stepped(args: argparse.Namespace) -> int:
        from .log import StepProgress

        with StepProgress(stream=sys.stderr).step(text):
            return run(args)

    return stepped


def _version() -> str:
    import torch

    from . import __version__

    return f"stitchcuda {__version__} (torch {torch.__version__}, CUDA {torch.version.cuda or 'none'})"


def main(argv: Sequence[str] | None = None) -> int:
    from .log import redacted_output

    with redacted_output():  # nothing the CLI prints holds a secret: keys, a URL's password (log.redact)
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    # As `python -m stitchcuda` does: modules in the current folder import (python:MODULE:FN model specs).
    # Appended, not prepended: an installed package keeps its name.
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))
    parser = build_parser()
    argv = _folder_as_suite(list(sys.argv[1:] if argv is None else argv), parser.bench_names)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 for --help
        return int(exc.code or 0)
    if args.run is None:  # no command, or `bench` / `llm` / `runs` without a subcommand
        args.usage_of.print_usage(sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args)
    except KeyboardInterrupt:  # commands that keep a run say how to resume it themselves
        print(f"stitchcuda {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
