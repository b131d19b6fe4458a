"""The `stitchcuda` command line (also `python -m stitchcuda`): doctor, demo and benchmarks.

Exit codes: 0 success, 1 failure, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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


def _repeats(text: str) -> int:
    value = int(text)
    if value < 5:
        raise argparse.ArgumentTypeError("at least 5 (cold compile times are medians)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stitchcuda",
                                     description="StitchCUDA: in-process CUDA JIT for PyTorch.")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 for --help
        return int(exc.code or 0)
    if args.run is None:  # no command, or `bench` without a suite
        args.usage_of.print_usage(sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
