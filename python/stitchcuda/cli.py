"""The `stitchcuda` command line (also `python -m stitchcuda`): doctor, demo, benchmarks, llm ping, and the
commands layers keep beside their code (optimize, runs, profile, check).

Exit codes: 0 success, 1 failure, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


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


MODEL_BENCHES = ("suite", "kernelbench")  # folders of KernelBench-format problems, run by bench/suite.py


def _bench_suite(args: argparse.Namespace) -> int:
    """Benchmarks that live beside their layer: stitchcuda.bench.<suite>.run(json_output); the model folders
    (suite, kernelbench) go through stitchcuda.bench.suite.run_suite with their options."""
    import importlib

    if args.suite in MODEL_BENCHES:
        from .bench import suite

        return int(suite.run_suite(args.suite, folder=args.dir, only=args.only, chunk=args.chunk,
                                   results=args.results, json_output=args.json))
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
        print(f"llm ping {args.spec} failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
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


def _repeats(text: str) -> int:
    value = int(text)
    if value < 5:
        raise argparse.ArgumentTypeError("at least 5 (cold compile times are medians)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stitchcuda",
                                     description="StitchCUDA: in-process CUDA JIT for PyTorch, and the model backends its agents use.")
    parser.set_defaults(run=None, usage_of=parser)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = commands.add_parser("doctor", help="check GPU, driver, CUDA, NVRTC, CUPTI, torch, cache")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(run=_doctor)

    demo = commands.add_parser("demo", help="compile a kernel with NVRTC and run it where a GPU exists")
    demo.set_defaults(run=_demo)

    bench = commands.add_parser("bench", help="run a benchmark")
    bench.set_defaults(run=None, usage_of=bench)
    suites = bench.add_subparsers(dest="suite", metavar="SUITE")
    jit = suites.add_parser("jit", help="compile, cache and launch costs (issue 2, section 7)")
    jit.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    jit.add_argument("--repeats", type=_repeats, default=5, help="cold compiles per kernel (>= 5)")
    jit.set_defaults(run=_bench)
    for suite, text in (("program", "program runtime: graph replay host time, cuBLASLt epilogues, planning (issue 7)"),
                        ("profile", "profiler: Tracer vs events, tracing overhead, metrics vs ncu (issue 3)"),
                        ("verify", "verifier: candidates per minute, speed-up agreement (issue 4)"),
                        ("graph", "optimize(model) end to end: speed-up vs eager and torch.compile (issue 8)"),
                        ("suite", "the bench/suite models: eager vs torch.compile (default, reduce-overhead) vs "
                                  "optimize, correctness, memory (issue 8)"),
                        ("kernelbench", "the same over bench/kernelbench: KernelBench-format problems at large "
                                        "sizes, summarized per class")):
        sub = suites.add_parser(suite, help=text)
        sub.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        if suite in MODEL_BENCHES:
            _model_bench_options(sub, "STITCHCUDA_SUITE_DIR, else bench/suite" if suite == "suite"
                                 else "bench/kernelbench")
        sub.set_defaults(run=_bench_suite)

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
    from .verify import cli as verify_cli

    graph_cli.register(commands)  # `optimize`, both modes (--mode graph|program)
    agents_cli.register(commands)  # `runs`
    profile_cli.register(commands)
    verify_cli.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 for --help
        return int(exc.code or 0)
    if args.run is None:  # no command, or `bench` / `llm` / `runs` without a subcommand
        args.usage_of.print_usage(sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
