"""`python -m stitchcuda.bench.dynamic`: optimize(dynamic="auto") on a folder of problems (the 40-model
suite by default), each at the batch sizes a serving loop meets — 1, a prime below the example, half the
example, the example, twice it — against eager, the static program at the example shape, and
torch.compile(dynamic=True), timed in one run, outputs checked against eager at every size.

    python -m stitchcuda.bench.dynamic [--dir DIR] [--only a,b] [--small] [--no-compile] [--json]

Columns per problem and size: eager_ms, family_ms (the optimized module, its member built before timing;
"original" where that size runs the model), compile_ms (torch.compile(dynamic=True), warmed at the size),
correct; per problem: the static optimize's and the dynamic one's wall seconds, the members built and how
each size was served (program, padded, original). A padded size also says where its time goes, same run:
member_exact_ms (the serving member's executor run directly on inputs padded beforehand), pad_ms (the
pad into the member's input buffer and the cut of its outputs, without the run), unexplained_ms (what the
family call costs beyond both: routing, Python, anything else) and what the member's executor counted
during the family's timed calls (runs, replays, captures, eager runs, skipped copies, instances); every
program-served size gives host_ms (wall time per call of back-to-back calls; member_exact_host_ms the
member's exact run's). Summary: per size, the geomean speed-up over eager of the
family, of compile and the family over compile, and the family at each size over the static program at
the example shape (the issue's 0.9x target), and optimize()'s wall time with dynamic="auto" over the static
one's (the issue's 2x target), with where each spent it, stage by stage (report.dynamic["wall_s"]).
STITCHCUDA_DYNAMIC_PADDING=off measures exact members.
Progress goes to stderr, the table (or --json) to stdout; exit 1 when any output is wrong.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..settings import settings
from .problems import default_dir, load, model_files, shrink
from .reference import compare_outputs
from .tables import geomean

__all__ = ["batch_sizes", "measure_problem", "summarize_sizes", "wall_line", "executor_counts", "padded_breakdown",
           "padded_line", "main"]

LABELS = ("1", "prime", "half", "example", "2x")
# Executor.stats() counters that say what a run did: a capture, an eager run or a second instance during
# timed calls, or a padded input copied again, shows here.
STAT_KEYS = ("runs", "replays", "device_launches", "eager_runs", "captures", "copies_skipped", "instances")


def batch_sizes(example: int) -> dict[str, int]:
    """The sizes measured, by label: 1, the largest prime below the example (or 1), half, the example, 2x."""
    prime = next((p for p in range(example - 1, 1, -1) if all(p % q for q in range(2, math.isqrt(p) + 1))), 1)
    return {"1": 1, "prime": prime, "half": max(1, example // 2), "example": example, "2x": 2 * example}


def _ms(fn) -> float:
    from ..verify import measure

    return measure(fn, repeats=20, warmup=3).median_ms


def _host_ms(fn, calls: int = 20) -> float:
    """Wall milliseconds per call of `calls` back-to-back calls, synchronized before and after: where the
    host is slower than the GPU, this is the host's time a call."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


def executor_counts(stats: dict) -> dict:
    """The counters of an Executor.stats() that say what its runs did (STAT_KEYS), as ints."""
    return {k: int(stats[k]) for k in STAT_KEYS if k in stats}


def padded_breakdown(family_ms: float, member_exact_ms: float, pad_ms: float, before: dict, after: dict) -> dict:
    """A padded size's columns: the member's exact run, the pad and cut, what the family call costs beyond
    both, the member's executor counters over the family's timed calls (`before`, `after`: executor_counts)
    and notes on what they show: a capture or an eager run during timed calls, more than one instance (the
    pad wrote another instance's buffers than the run read), padded inputs copied again. Eager runs are
    noted only for a member that replays CUDA graphs (one that launches its steps directly runs eagerly)."""
    delta = {k: after[k] - before[k] for k in before if k in after and k != "instances"}
    notes = []
    if delta.get("captures"):
        notes.append(f"{delta['captures']} CUDA graph capture(s) during the timed calls")
    if delta.get("eager_runs") and after.get("replays", 0) > 0:  # a member that launches directly runs eagerly
        notes.append(f"{delta['eager_runs']} eager run(s) during the timed calls (the member's working memory was "
                     "released, or never warmed)")
    if after.get("instances", 0) > 1 or after.get("instances", 0) > before.get("instances", 0):
        notes.append(f"{after['instances']} executor instance(s) after the timed calls ({before.get('instances', 0)} "
                     "before): one per stream is expected")
    if delta.get("replays") and delta.get("copies_skipped", 0) < delta["replays"]:
        notes.append(f"{delta['replays'] - delta.get('copies_skipped', 0)} replay(s) copied the padded input again "
                     "(the pad wrote a buffer the run did not read)")
    return {"member_exact_ms": member_exact_ms, "pad_ms": pad_ms,
            "unexplained_ms": round(family_ms - member_exact_ms - pad_ms, 4),
            "executor": {"delta": delta, "instances": [before.get("instances"), after.get("instances")]},
            "notes": notes}


def padded_line(problem: str, label: str, cell: dict) -> str:
    """One padded size's time, split: the family call against the member's exact run, the pad and cut, the
    rest, and what the member's executor did meanwhile."""
    d = cell["executor"]["delta"]
    counts = ", ".join(f"{k} +{v}" for k, v in d.items())
    return (f"{problem} {label} ({cell['size']} on {cell['member']}): family {cell['family_ms']:.3f} ms = member exact "
            f"{cell['member_exact_ms']:.3f} + pad and cut {cell['pad_ms']:.3f} + unexplained "
            f"{cell['unexplained_ms']:.3f}; host {cell.get('host_ms', 0.0):.3f} ms a call (the member's exact run "
            f"{cell.get('member_exact_host_ms', 0.0):.3f}); executor {counts}, "
            f"instances {cell['executor']['instances'][0]} -> {cell['executor']['instances'][1]}"
            + "".join(f"; {n}" for n in cell["notes"]))


def _family_call(family, xs: tuple) -> tuple[list, tuple]:
    """The call's inputs as DynamicModule.forward passes them on, and its route (sizes, member, why): the
    bench times the family's own pieces, its _route, _pad and _cut."""
    from ..graph.module import positional_call

    ordered = positional_call(xs, {}, family._arity, family._keywords, family._settings)
    call = [v for i, v in enumerate(ordered) if i not in family._settings]
    return call, family._route(call)


def _padded_columns(family, call: list, route: tuple, family_ms: float, before: dict, after: dict) -> dict:
    """padded_breakdown for a padded size, timing the member's executor on inputs padded beforehand (the
    padded ones copied out of the member's buffers) and the pad and cut alone."""
    sizes, member, _ = route
    executor = member.module._runner.executor
    padded = [t.clone() if isinstance(t, torch.Tensor) else t for t in family._pad(member, list(call), sizes)]
    flat = [t for t in pytree.tree_flatten(tuple(padded))[0] if isinstance(t, torch.Tensor)]
    outs = executor.run(flat)
    exact = _ms(lambda: executor.run(flat))
    pad = _ms(lambda: (family._pad(member, list(call), sizes), family._cut(outs, sizes, member.sizes)))
    return {"member": list(member.sizes), "member_exact_host_ms": round(_host_ms(lambda: executor.run(flat)), 4),
            **padded_breakdown(family_ms, exact, pad, before, after)}


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def measure_problem(path: Path, small: bool = False, compile_column: bool = True) -> dict:
    """One problem's row: the static and dynamic optimize, then every size's columns."""
    import stitchcuda
    from ..graph.dynamic import DynamicModule, resized_inputs

    module = shrink(load(path)) if small else load(path)
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).cuda().eval()
    inputs = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in module.get_inputs())
    row: dict[str, Any] = {"problem": path.stem, "padding": settings().dynamic_padding}
    with torch.no_grad():
        t0 = time.perf_counter()
        static = stitchcuda.optimize(model, inputs, compare_compile=False, progress=False)
        row["static_s"] = round(time.perf_counter() - t0, 2)
        row["static_runs"] = "program" if static.report.status == "optimized" else "original"
        row["static_speedup"] = static.report.timing.get("speedup_eager") if row["static_runs"] == "program" else 1.0
        row["static_stages"] = {k: round(v, 3) for k, v in static.report.stage_seconds.items()}
        del static
        gc.collect()
        t0 = time.perf_counter()
        family = stitchcuda.optimize(model, inputs, dynamic="auto", compare_compile=False, progress=False)
        row["dynamic_s"] = round(time.perf_counter() - t0, 2)
        row["refused"] = family.report.dynamic.get("refused", "")
        row["dynamic_wall"] = family.report.dynamic.get("wall_s", {})  # export, example, members, verify
        if not isinstance(family, DynamicModule):
            row["sizes"] = {}
            return row
        dims = family.dims
        compiled = torch.compile(model, dynamic=True) if compile_column else None
        row["sizes"] = {}
        for label, size in batch_sizes(dims[0].example).items():
            if not dims[0].min <= size <= dims[0].max:
                continue
            xs = resized_inputs(inputs, dims, [size])
            want = model(*xs)
            before, pads, t0 = family.other_shape_calls, family.padded_calls, time.perf_counter()
            got = family(*xs)  # builds the member on first use
            first_s = time.perf_counter() - t0
            ok, err, detail = compare_outputs(got, want)
            served = ("original" if family.other_shape_calls > before
                      else ("padded" if family.padded_calls > pads else "program"))
            cell = {"size": size, "correct": ok, "max_abs_error": err, "first_call_s": round(first_s, 3),
                    "served": served, "eager_ms": _ms(lambda: model(*xs))}
            # A padded size: the serving member's counters around the family's timed calls, then its pieces.
            call, route = _family_call(family, xs) if served == "padded" else (None, None)
            counts = executor_counts(route[1].module._runner.executor.stats()) if route else {}
            cell["family_ms"] = _ms(lambda: family(*xs))
            after = executor_counts(route[1].module._runner.executor.stats()) if route else {}
            if served != "original":
                cell["host_ms"] = round(_host_ms(lambda: family(*xs)), 4)
            if route:
                cell.update(_padded_columns(family, call, route, cell["family_ms"], counts, after))
            if not ok:
                cell["detail"] = detail
            if compiled is not None:
                compiled(*xs)
                cell["compile_ms"] = _ms(lambda: compiled(*xs))
            row["sizes"][label] = cell
        row["members"] = family.members
        row["member_builds"] = family.member_builds
    return row


def summarize_sizes(rows: list[dict]) -> dict:
    """Per size label: geomeans of family/eager, compile/eager, family/compile, and family/eager over the
    static program's speed-up at the example; plus correctness and optimize's wall-time ratio."""
    out: dict[str, Any] = {}
    for label in LABELS:
        cells = [(r, r["sizes"][label]) for r in rows if label in r.get("sizes", {})]
        fam = [c["eager_ms"] / c["family_ms"] for _, c in cells if c.get("family_ms")]
        comp = [c["eager_ms"] / c["compile_ms"] for _, c in cells if c.get("compile_ms")]
        vs = [c["compile_ms"] / c["family_ms"] for _, c in cells if c.get("compile_ms") and c.get("family_ms")]
        static = [(c["eager_ms"] / c["family_ms"]) / r["static_speedup"] for r, c in cells
                  if c.get("family_ms") and r.get("static_speedup")]
        out[label] = {"problems": len(cells), "correct": sum(c["correct"] for _, c in cells),
                      "original": sum(c["served"] == "original" for _, c in cells),
                      "family_vs_eager": geomean(fam), "compile_vs_eager": geomean(comp),
                      "family_vs_compile": geomean(vs), "family_over_static_example": geomean(static)}
    walls = [r["dynamic_s"] / r["static_s"] for r in rows if r.get("static_s")]
    out["optimize_wall_ratio"] = {"geomean": geomean(walls), "max": max(walls, default=None)}
    out["refused"] = [r["problem"] for r in rows if r.get("refused")]
    return out


def _table(rows: list[dict], summary: dict) -> str:
    lines = ["problem | static s | dynamic s | " + " | ".join(f"{l} fam/eager (cmp/eager)" for l in LABELS)]
    for r in rows:
        cells = []
        for label in LABELS:
            c = r.get("sizes", {}).get(label)
            if c is None:
                cells.append("-")
                continue
            mark = "" if c["correct"] else " WRONG"
            cmp_ = f" ({c['eager_ms'] / c['compile_ms']:.2f})" if c.get("compile_ms") else ""
            cells.append(f"{c['eager_ms'] / c['family_ms']:.2f}{cmp_} {c['served'][0]}{mark}")
        lines.append(f"{r['problem']} | {r.get('static_s')} | {r.get('dynamic_s')} | " + " | ".join(cells)
                     + (f"  refused: {r['refused'][:80]}" if r.get("refused") else ""))
    lines.append("")
    for label in LABELS:
        s = summary[label]
        lines.append(f"{label:8s} correct {s['correct']}/{s['problems']}, original {s['original']}, family/eager "
                     f"{_f(s['family_vs_eager'])}, compile(dynamic)/eager {_f(s['compile_vs_eager'])}, family/compile "
                     f"{_f(s['family_vs_compile'])}, over static@example {_f(s['family_over_static_example'])}")
    w = summary["optimize_wall_ratio"]
    lines.append(f"optimize wall, dynamic over static: geomean {_f(w['geomean'])}, max {_f(w['max'])}")
    padded = [padded_line(r["problem"], label, c) for r in rows for label, c in r.get("sizes", {}).items()
              if "member_exact_ms" in c]
    if padded:
        lines += ["", "where a padded call's time goes (same run):", *padded]
    lines += ["", "where optimize's seconds went (static: its stages; dynamic: export, the example's program, the "
              "members the range check built and their stages summed, the range check's verification):"]
    lines += [wall_line(r) for r in rows if r.get("static_stages")]
    return "\n".join(lines)


def wall_line(row: dict) -> str:
    """One problem's static and dynamic optimize() seconds, by stage."""
    def stages(d: dict) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in d.items())

    w = row.get("dynamic_wall") or {}
    dynamic = (f"export {w['export']:.2f} + example {w['example']:.2f} + {w['members_built']} member(s) "
               f"{w['members']:.2f} ({stages(w['member_stages'])}) + verify {w['verify']:.2f}" if w
               else "no family (see refused)")
    return (f"{row['problem']}: static {row['static_s']} s ({stages(row['static_stages'])}); dynamic "
            f"{row.get('dynamic_s')} s: {dynamic}")


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stitchcuda.bench.dynamic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="a folder of problem files (default: bench/suite)")
    parser.add_argument("--only", default=None, help="file stems to run, comma-separated")
    parser.add_argument("--small", action="store_true", help="every problem at its SMALL sizes")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile(dynamic=True)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench dynamic: needs a CUDA GPU (it times programs at each size)", file=sys.stderr)
        return 3
    folder = args.dir or default_dir("suite")
    rows = []
    for path in model_files(folder, args.only):
        _log(f"{path.stem} ...")
        try:
            rows.append(measure_problem(path, args.small, not args.no_compile))
        except Exception as exc:  # one problem's failure is its row, the others still run
            rows.append({"problem": path.stem, "error": f"{type(exc).__name__}: {exc}"[:500], "sizes": {}})
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        _log(json.dumps(rows[-1], default=str)[:400])
    summary = summarize_sizes(rows)
    wrong = any(not c["correct"] for r in rows for c in r.get("sizes", {}).values()) or any("error" in r for r in rows)
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows, "summary": summary}, default=str))
    else:
        print(_table(rows, summary))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
