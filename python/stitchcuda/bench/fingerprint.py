"""`python -m stitchcuda.bench.fingerprint [--out FILE]`: what graph mode makes of every bench problem —
the plan, each kernel's source, launch configurations and the program's steps — as stable JSON with one hash.

Every problem of `bench/suite` and `bench/kernelbench` (found as `stitchcuda bench suite|kernelbench` finds
them) is captured, planned, lowered and compiled with NVRTC on the CPU, as optimize() does without a GPU;
nothing runs. The output holds no times, no absolute paths and no addresses, and its keys are sorted, so
two runs on the same tree print the same bytes: a change that should not alter what users get (a
refactoring of graph mode) is checked by comparing the file before and after it.

The model's weights are built on the CPU (seeded, as `bench --compile-only` does); the inputs are built on
the meta device and given CPU storage that is never written (`torch.empty`), since capture and planning
read their shapes, strides and dtypes only. So a 6 GB input costs no host memory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.utils._pytree as pytree

from . import suite
from ..graph.capture import capture
from ..graph.lower import Lowering, constant_values
from ..graph.planner import OfflinePlanner

__all__ = ["SCHEMA", "BENCHES", "problem_paths", "problem_fingerprint", "fingerprint", "main"]

SCHEMA = "stitchcuda.fingerprint/1"
BENCHES = ("suite", "kernelbench")


def problem_paths(benches: Iterable[str] = BENCHES, only: str | None = None) -> list[tuple[str, Path]]:
    """(key, path) of every problem of the repository's bench folders, the key "<bench>/<stem>" (no
    absolute path); `only`: comma-separated stems, as `bench --only`."""
    out = []
    for bench in benches:
        folder = suite.default_dir(bench)
        if folder is None:
            raise SystemExit(f"fingerprint: no bench/{bench} folder above {Path(__file__).name}: run it from a "
                             "source checkout")
        out += [(f"{bench}/{path.relative_to(folder).with_suffix('').as_posix()}", path)
                for path in suite.model_files(folder, only)]
    return out


def _lazy_inputs(module: Any) -> tuple:
    """The problem's inputs with their shapes, strides and dtypes, on CPU storage never written (no host
    memory is touched): built on the meta device first. A get_inputs that cannot run there (it reads
    values) builds real ones."""
    try:
        with torch.device("meta"):
            torch.manual_seed(0)
            meta = tuple(module.get_inputs())
    except Exception:
        torch.manual_seed(0)
        return tuple(module.get_inputs())

    def storage(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        return t

    return pytree.tree_map(storage, meta)


def _stable(value: Any) -> Any:
    """A JSON form of `value` that names no address: containers element by element, dtypes by name, graph
    values and nodes by their `name`, floats exactly (repr), other objects by their type's name."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) and value == int(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_stable(v) for v in value), key=json.dumps)
    if isinstance(value, dict):
        return {str(k): _stable(v) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return {type(value).__name__: name}
    return f"<{type(value).__name__}>"


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _group(g: Any, code: Any, on_aten: dict[int, str]) -> dict:
    """One plan group: kind, ops, reason, parameters (kernel code objects by hash) and the main kernel's
    strategy and launch."""
    params = {k: (_sha(v.source) if hasattr(v, "source") else _stable(v)) for k, v in g.params.items()}
    entry = {"name": g.name, "kind": g.kind, "ops": [n.op for n in g.nodes], "reason": g.reason, "params": params}
    if id(g) in on_aten:  # a layout the group's template does not read: it ran as ATen steps
        entry["on_aten"] = on_aten[id(g)]
    if code is not None:
        entry["kernel"] = {"name": code.name, "source_sha256": _sha(code.source), "strategy": code.description,
                           "grid": _stable(code.grid), "block": _stable(code.block),
                           "shared_mem": code.shared_mem}
    return entry


def _program(program: Any) -> dict:
    """The program's buffers (no weight bytes), steps and kernels (source by hash, CUBINs left out: their
    bytes depend on the NVRTC build) and precision."""
    kernels = []
    for k in program.kernels:
        entry = {key: _stable(v) for key, v in k.items() if key not in ("source", "cubin", "ptx", "binary")}
        entry["source_sha256"] = _sha(k.get("source", ""))
        entry["compiled"] = bool(k.get("cubin")) if "cubin" in k else None
        kernels.append(entry)
    buffers = [{key: _stable(v) for key, v in b.items() if key not in ("data",)} for b in program.buffers]
    return {"buffers": buffers, "steps": [_stable(s) for s in program.steps], "kernels": kernels,
            "precision": _stable(program.precision)}


def problem_fingerprint(path: Path, precision: str = "fp32") -> dict:
    """What graph mode plans and compiles for one problem file, on the CPU ({"error": ...} where a stage
    stops: which stage and the exception's first line)."""
    stage = "load"
    try:
        module = suite.load(path)
        torch.manual_seed(0)
        model = module.Model(*module.get_init_inputs()).eval()
        inputs = _lazy_inputs(module)
        stage = "capture"
        graph = capture(model, inputs)
        stage = "plan"
        plan = OfflinePlanner(precision=precision, graphs=True).plan(graph)
        out: dict[str, Any] = {
            "ops": dict(sorted(graph.op_counts().items())),
            "capture_notes": _stable(graph.notes),
            "plan": {"precision": plan.precision, "judged_at": plan.judged_at, "decisions": _stable(plan.decisions),
                     "channels_last": sorted(plan.channels_last), "conv_epilogues": len(plan.conv_epilogues)}}
        unheld = [g.name for g in plan.groups if "unheld" in g.params]
        stage = "build"
        lowering, program = None, None
        if not unheld:  # as optimize() without a GPU: a program is built only when every value fits a buffer
            constants = constant_values(graph, {g.nodes[0].out.name for g in plan.groups
                                                if g.kind == "constant" and g.nodes[0].outputs})
            lowering = Lowering(graph, plan, constants)
            program = lowering.build(plan.groups, graph.inputs, graph.outputs)
            stage = "compile"
            program.compile_kernels()
        codes = lowering.main_kernels if lowering is not None else {}
        on_aten = lowering.on_aten if lowering is not None else {}
        out["plan"]["groups"] = [_group(g, codes.get(id(g)), on_aten) for g in plan.groups]
        out["program"] = _program(program) if program is not None else {"unheld": unheld}
        return out
    except Exception as exc:  # the fingerprint records where a problem stops; the others go on
        return {"error": f"{stage}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}


def fingerprint(paths: list[tuple[str, Path]], precision: str = "fp32", progress: Any = None) -> dict:
    """{"schema", "precision", "problems": {key: fingerprint}, "hash"}: the hash is the SHA-256 of the
    problems' canonical JSON (sorted keys, no whitespace)."""
    problems = {}
    for key, path in paths:
        t0 = time.perf_counter()
        problems[key] = problem_fingerprint(path, precision)
        if progress is not None:
            status = "error: " + problems[key]["error"] if "error" in problems[key] else "ok"
            print(f"fingerprint: {key} {status} ({time.perf_counter() - t0:.1f} s)", file=progress, flush=True)
    body = canonical(problems)
    return {"schema": SCHEMA, "precision": precision, "problems": problems, "hash": _sha(body)}


def canonical(value: Any) -> str:
    """The canonical JSON text the hash is taken over."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stitchcuda.bench.fingerprint", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON here (default: standard output)")
    parser.add_argument("--only", help="comma-separated problem stems (as bench --only)")
    parser.add_argument("--bench", action="append", choices=BENCHES, help="a bench folder (default: both)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"))
    args = parser.parse_args(argv)
    paths = problem_paths(args.bench or BENCHES, args.only)
    if not paths:
        print("fingerprint: no problem matches", file=sys.stderr)
        return 2
    result = fingerprint(paths, args.precision, progress=sys.stderr)
    text = json.dumps(result, sort_keys=True, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    errors = sum("error" in p for p in result["problems"].values())
    print(f"fingerprint: {len(paths)} problem(s), {errors} stopped with an error, hash {result['hash']}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
