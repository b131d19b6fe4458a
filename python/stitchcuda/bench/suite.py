"""`stitchcuda bench suite`: every model in `bench/suite/` (KernelBench format) through eager PyTorch,
torch.compile (default and mode="reduce-overhead") and `stitchcuda.optimize`, timed in one run, with
StitchCUDA's outputs checked against eager and geomean speed-ups over eager.

Timing: the Verifier's protocol (stitchcuda.verify.measure: CUDA events, warm-up calls first, L2 flushed
and persisting L2 reset before every trial), median of 30. Outputs are compared by the Verifier's
comparator under its tolerance table (fp32: atol = rtol = 1e-4). Matmuls and cuDNN
convolutions run in true fp32 (TF32 off) for every column, so the comparison and the tolerance are fair.
A model whose optimize falls back to eager counts as correct at its eager time (status "eager"); a wrong
StitchCUDA result counts as 1x in the geomean; an exception in any column is recorded in that model's row
and never stops the run.

Each model compiles inside the timed pass (its first call, not timed): on the H200 the whole suite, 40
models through all four columns, takes about two minutes that way. (A pool of processes compiling every
model first was slower there: eight processes contending for the CPUs did not finish 20 models in nine
minutes.) Each row records the first-call seconds of both torch.compile modes and optimize's seconds.

Environment: STITCHCUDA_SUITE_DIR (the folder of model files; default `bench/suite` found by walking up
from this file), STITCHCUDA_SUITE_ONLY (comma-separated file stems to run, e.g. `gemm_bias_relu,softmax_rows`),
STITCHCUDA_SUITE_CHUNK (`K/N`: every N-th model from the K-th, for runs that must fit a time limit).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

REPEATS = 30


def suite_dir() -> Path | None:
    """STITCHCUDA_SUITE_DIR, else the nearest `bench/suite` above this file (the repository's)."""
    override = os.environ.get("STITCHCUDA_SUITE_DIR")
    if override:
        return Path(override)
    for parent in Path(__file__).resolve().parents:
        if (parent / "bench" / "suite").is_dir():
            return parent / "bench" / "suite"
    return None


def model_files(folder: Path, only: str | None = None, chunk: str | None = None) -> list[Path]:
    """The suite's model files, sorted; `only` is a comma-separated list of stems; `chunk` "K/N" keeps
    every N-th file from the K-th (1-based), so N runs cover the suite once, each with a mix of kinds."""
    files = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    if only:
        wanted = {s.strip() for s in only.split(",") if s.strip()}
        files = [p for p in files if p.stem in wanted]
    if chunk:
        k, _, n = chunk.partition("/")
        if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
            raise SystemExit(f"bench suite: STITCHCUDA_SUITE_CHUNK must be K/N with 1 <= K <= N, got {chunk!r}")
        files = files[int(k) - 1::int(n)]
    return files


def load(path: Path) -> ModuleType:
    """Imports a KernelBench-format file (Model, get_inputs, get_init_inputs) as a module."""
    spec = importlib.util.spec_from_file_location(f"stitchcuda_suite_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(module, name):
            raise AttributeError(f"{path.name} has no {name} (KernelBench format: Model, get_inputs, get_init_inputs)")
    return module


def _time_ms(fn: Callable[[], Any], warmup: int = 3, repeats: int = REPEATS) -> float:
    from ..verify import measure

    return measure(fn, repeats=repeats, warmup=warmup).median_ms


def _fp32_tolerance() -> tuple[float, float]:
    from ..verify.tolerance import tolerance

    return tolerance(torch.float32)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _compare(got: Any, want: Any) -> tuple[bool, float, str]:
    """(all close, max |error|, what differs first) for two output structures, by the Verifier's
    comparator and tolerance table (the suite runs in true fp32)."""
    from ..verify.compare import first_difference, largest_error, max_abs_error
    from ..verify.tolerance import tolerance

    got_flat, want_flat = pytree.tree_flatten(got)[0], pytree.tree_flatten(want)[0]
    if len(got_flat) != len(want_flat):
        return False, math.inf, f"{len(got_flat)} outputs, eager has {len(want_flat)}"
    worst, ok, detail = 0.0, True, ""
    for i, (g, w) in enumerate(zip(got_flat, want_flat)):
        if not isinstance(w, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            return False, math.inf, f"output {i}: {getattr(g, 'dtype', type(g))} {list(getattr(g, 'shape', []))}, " \
                                    f"eager {w.dtype} {list(w.shape)}"
        worst = max(worst, max_abs_error(g, w))
        if ok and first_difference(str(i), g, w, *tolerance(w.dtype)) is not None:
            ok = False
            err, idx = largest_error(g, w)
            detail = (f"output {i}: max |error| {err:.3g} at flat index {idx} (eager "
                      f"{w.flatten()[idx].item():.6g}, StitchCUDA {g.flatten()[idx].item():.6g})")
    return ok, worst, detail


def _compiled_ms(model, inputs, mode: str | None) -> tuple[float, float]:
    """(median milliseconds per call, seconds the first call took: compilation, from the caches if warm)."""
    torch._dynamo.reset()  # a fresh cache per model and mode: no recompilation limits, no cross-talk
    compiled = torch.compile(model, mode=mode) if mode else torch.compile(model)
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled(*inputs)  # compiles (and, for reduce-overhead, starts recording CUDA graphs)
        first_s = time.perf_counter() - t0
        return _time_ms(lambda: compiled(*inputs), warmup=5), first_s


def _on_gpu(path: Path) -> tuple[torch.nn.Module, tuple]:
    """The file's model (seed 0, eval mode) and inputs, on the GPU."""
    module = load(path)
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).cuda().eval()
    return model, tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in module.get_inputs())


def run_model(path: Path) -> dict:
    """One model's row: times, speed-ups, correctness, report status; errors recorded, never raised."""
    from ..graph import optimize

    row: dict[str, Any] = {"model": path.stem, "errors": {}}
    try:
        model, inputs = _on_gpu(path)
        with torch.no_grad():
            want = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, model(*inputs))
            row["eager_ms"] = _time_ms(lambda: model(*inputs))
    except Exception as exc:  # the model itself does not load or run: nothing else can be measured
        row["errors"]["eager"] = _first_line(exc)
        row["correct"] = False
        return row

    for key, mode in (("compile_ms", None), ("reduce_overhead_ms", "reduce-overhead")):
        try:
            row[key], first_s = _compiled_ms(model, inputs, mode)
            row[key.removesuffix("_ms") + "_first_call_s"] = round(first_s, 2)
        except Exception as exc:  # no compiler toolchain, a dynamo failure: the row says so
            row["errors"][key.removesuffix("_ms")] = _first_line(exc)
    torch._dynamo.reset()

    try:
        t0 = time.perf_counter()
        fast = optimize(model, inputs, measure=False, progress=False)
        row["optimize_s"] = time.perf_counter() - t0
        report = fast.report
        kinds = sorted({g["kind"] for g in report.groups})
        row.update(status=report.status, reason=report.reason, fallbacks=len(report.fallbacks),
                   groups={k: sum(g["kind"] == k for g in report.groups) for k in kinds})
        if fast.program is not None:
            row["replay"] = fast.program.replay["mode"]  # graph or direct, as measured by optimize
        if report.status == "optimized":
            with torch.no_grad():
                ok, worst, detail = _compare(fast(*inputs), want)
                row["stitch_ms"] = _time_ms(lambda: fast(*inputs))
            row.update(correct=ok, max_abs_error=worst)
            if detail:
                row["mismatch"] = detail
        else:  # the original model runs: correct by construction, at eager speed
            row.update(correct=True, stitch_ms=row["eager_ms"], max_abs_error=0.0)
    except Exception as exc:
        row["errors"]["stitchcuda"] = _first_line(exc)
        row["traceback"] = traceback.format_exc(limit=6)
        row["correct"] = False

    for key, name in (("compile_ms", "speedup_compile"), ("reduce_overhead_ms", "speedup_reduce_overhead"),
                      ("stitch_ms", "speedup_stitch")):
        if row.get(key):
            row[name] = row["eager_ms"] / row[key]
    del model, inputs, want
    torch.cuda.empty_cache()
    return row


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summarize(rows: list[dict]) -> dict:
    """Geomean speed-ups over eager (over the models each column has a time for; StitchCUDA's wrong results
    count as 1x) and the share correct."""
    out: dict[str, Any] = {"models": len(rows), "correct": sum(bool(r.get("correct")) for r in rows)}
    out["share_correct"] = out["correct"] / len(rows) if rows else 0.0
    for name in ("speedup_compile", "speedup_reduce_overhead", "speedup_stitch"):
        present = [r[name] for r in rows if name in r]
        if name == "speedup_stitch":  # a wrong result earns nothing: such a model counts at eager speed (1x)
            present = [r[name] if r.get("correct") else 1.0 for r in rows if name in r]
        out[f"geomean_{name}"] = _geomean(present)
        out[f"models_with_{name}"] = len(present)
    out["optimized"] = sum(r.get("status") == "optimized" for r in rows)
    return out


def _fmt(v: Any, spec: str) -> str:
    """`v` formatted with `spec`, or a dash as wide as the column when there is no number."""
    if isinstance(v, (int, float)):
        return format(v, spec)
    width = spec.split(".")[0].rstrip("df")
    return format("-", f">{width}") if width else "-"


def format_table(rows: list[dict], summary: dict, device: str) -> str:
    head = (f"{'model':34} {'eager':>8} {'compile':>8} {'r-o':>8} {'stitch':>8} {'x comp':>7} {'x r-o':>7} "
            f"{'x stitch':>8} {'ok':>3} {'status':>9} {'fb':>3} {'opt s':>6}")
    title = f"StitchCUDA suite on {device} (ms per forward, fp32, TF32 off; speed-ups vs eager)"
    lines = [title, head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model'][:34]:34} {_fmt(r.get('eager_ms'), '8.4f')} {_fmt(r.get('compile_ms'), '8.4f')} "
                     f"{_fmt(r.get('reduce_overhead_ms'), '8.4f')} {_fmt(r.get('stitch_ms'), '8.4f')} "
                     f"{_fmt(r.get('speedup_compile'), '7.2f')} {_fmt(r.get('speedup_reduce_overhead'), '7.2f')} "
                     f"{_fmt(r.get('speedup_stitch'), '8.2f')} {'yes' if r.get('correct') else 'NO':>3} "
                     f"{str(r.get('status', '-')):>9} {_fmt(r.get('fallbacks'), '3d')} "
                     f"{_fmt(r.get('optimize_s'), '6.1f')}")
        for stage, err in r.get("errors", {}).items():
            lines.append(f"    {stage} error: {err}")
        if r.get("mismatch"):
            lines.append(f"    mismatch: {r['mismatch']}")
        if r.get("status") == "eager" and r.get("reason"):
            lines.append(f"    eager because: {r['reason'][:200]}")
    s = summary
    lines.append("-" * len(head))
    lines.append(f"geomean speed-up vs eager: torch.compile {_fmt(s['geomean_speedup_compile'], '.3f')}x, "
                 f"reduce-overhead {_fmt(s['geomean_speedup_reduce_overhead'], '.3f')}x, "
                 f"StitchCUDA {_fmt(s['geomean_speedup_stitch'], '.3f')}x")
    lines.append(f"correct: {s['correct']}/{s['models']} ({100 * s['share_correct']:.0f}%), "
                 f"optimized (not eager): {s['optimized']}/{s['models']}")
    return "\n".join(lines)


def run(json_output: bool = False) -> int:
    if not torch.cuda.is_available():
        print("bench suite: no GPU (torch.cuda.is_available() is False); nothing measured")
        return 3
    folder = suite_dir()
    if folder is None or not folder.is_dir():
        print(f"bench suite: no model folder ({folder or 'bench/suite not found above ' + __file__}); "
              "set STITCHCUDA_SUITE_DIR")
        return 2
    only, chunk = os.environ.get("STITCHCUDA_SUITE_ONLY"), os.environ.get("STITCHCUDA_SUITE_CHUNK")
    files = model_files(folder, only, chunk)
    if not files:
        print(f"bench suite: no model files in {folder} match STITCHCUDA_SUITE_ONLY={only!r} "
              f"STITCHCUDA_SUITE_CHUNK={chunk!r}")
        return 2

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # true fp32 everywhere
    rows = []
    try:
        for path in files:
            row = run_model(path)
            rows.append(row)
            # One line per model on stderr as it finishes, so a run cut short still reports what it measured.
            print("[suite-row] " + json.dumps(row, default=str), file=sys.stderr, flush=True)
            if not json_output:
                print(f"[suite] {row['model']}: done", flush=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    summary = summarize(rows)
    device = torch.cuda.get_device_name()
    if json_output:
        atol, rtol = _fp32_tolerance()
        print(json.dumps({"device": device, "suite_dir": str(folder), "tolerance": {"atol": atol, "rtol": rtol},
                          "repeats": REPEATS, "summary": summary, "models": rows}, default=str))
    else:
        print(format_table(rows, summary, device))
    return 0
