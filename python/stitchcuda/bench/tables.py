"""What a bench run's rows add up to: the speed-ups of a row, geomeans and fast_p per class, per level and
overall, the error summary, and the text table a run prints."""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable

from .precision import PRECISION_WORDS, tolerance
from .problems import CLASS_ORDER, level_key, problem_class
from .results import ERROR_COLUMNS


SLOW = 0.98  # a StitchCUDA speed-up below this is a slowdown, not noise
# eager_after_ms against eager_ms: a move beyond this share (either way) counts in the summary's eager_drifted.
EAGER_DRIFT = 0.03


FAST_P = (0.0, 0.5, 1.0)  # the thresholds of fast_p in the summary


# torch.compile's modes and the row's column of each (<column>_ms, <column>_first_call_s): default and
# reduce-overhead always, the others when --compile-modes adds them.
COMPILE_MODES = {"default": "compile", "reduce-overhead": "reduce_overhead",
                 "max-autotune-no-cudagraphs": "max_autotune_no_cudagraphs", "max-autotune": "max_autotune"}
EXTRA_COMPILE_MODES = ("max-autotune-no-cudagraphs", "max-autotune")


def add_speedups(row: dict) -> dict:
    """The row's best compile mode and its speed-ups over eager (and StitchCUDA's over the best mode)."""
    modes = [(row[f"{column}_ms"], mode) for mode, column in COMPILE_MODES.items() if row.get(f"{column}_ms")]
    if modes:
        row["best_compile_ms"], row["best_compile_mode"] = min(modes)
    for key, name in (("compile_ms", "speedup_compile"), ("reduce_overhead_ms", "speedup_reduce_overhead"),
                      ("max_autotune_no_cudagraphs_ms", "speedup_max_autotune_no_cudagraphs"),
                      ("max_autotune_ms", "speedup_max_autotune"), ("best_compile_ms", "speedup_best_compile"), ("stitch_ms", "speedup_stitch"),
                      ("agents_ms", "speedup_agents")):
        if row.get(key) and row.get("eager_ms"):
            row[name] = row["eager_ms"] / row[key]
    for key, name in (("stitch_ms", "stitch_vs_best_compile"), ("agents_ms", "agents_vs_best_compile")):
        if row.get(key) and row.get("best_compile_ms"):
            row[name] = row["best_compile_ms"] / row[key]
    return row


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _stitch_speedup(row: dict) -> float | None:
    """StitchCUDA's speed-up as the geomeans count it: a wrong result earns nothing (1x, eager speed)."""
    if "speedup_stitch" not in row:
        return None
    return row["speedup_stitch"] if row.get("correct") else 1.0


def _agents_speedup(row: dict) -> float | None:
    """The agents' column as the geomeans count it (a wrong result: 1x)."""
    if "speedup_agents" not in row:
        return None
    return row["speedup_agents"] if row.get("agents_correct") else 1.0


def fast_p(rows: list[dict], speedup: Callable[[dict], float | None]) -> dict[str, float] | None:
    """KernelBench's fast_p for p in FAST_P: the share of ALL the rows (failed ones too) whose result is
    correct and whose speed-up over the baseline is strictly greater than p. `speedup(row)` is the
    row's speed-up when its result is correct, else None. fast_0 is the share correct; fast_1 the
    share correct and faster than the baseline. None when no row has a speed-up (nothing was timed)."""
    values = [speedup(r) for r in rows]
    if not rows or all(v is None for v in values):
        return None
    return {format(p, "g"): sum(v is not None and v > p for v in values) / len(rows) for p in FAST_P}


def _when_correct(key: str, correct: str = "correct") -> Callable[[dict], float | None]:
    return lambda r: r.get(key) if r.get(correct) and r.get(key) else None


def _best_compile_speedup(row: dict) -> float | None:
    """The faster torch.compile mode for this problem (rows from older files have no best column; rows
    written by other tools may have the best column only)."""
    present = [row[f"speedup_{c}"] for c in COMPILE_MODES.values() if row.get(f"speedup_{c}")]
    return max(present) if present else row.get("speedup_best_compile")


def summarize(rows: list[dict]) -> dict:
    """Counts and geomean speed-ups over eager of one group of rows (each geomean over the problems that
    column has a time for; StitchCUDA's wrong results count as 1x)."""
    out: dict[str, Any] = {"models": len(rows), "correct": sum(bool(r.get("correct")) for r in rows)}
    out["share_correct"] = out["correct"] / len(rows) if rows else 0.0
    out["optimized"] = sum(r.get("status") == "optimized" for r in rows)
    out["compiled"] = sum(r.get("status") == "compiled" for r in rows)  # --compile-only rows
    # Variant rows: StitchCUDA's accuracy verdict against the high-precision reference (precision.add_accuracy).
    out["accurate"] = sum(r.get("accurate") is True for r in rows)
    out["models_with_accuracy"] = sum(r.get("accurate") is not None for r in rows)
    best = {id(r): _best_compile_speedup(r) for r in rows}
    columns: dict[str, list[float]] = {
        "speedup_compile": [r["speedup_compile"] for r in rows if "speedup_compile" in r],
        "speedup_reduce_overhead": [r["speedup_reduce_overhead"] for r in rows if "speedup_reduce_overhead" in r],
        "speedup_best_compile": [b for b in best.values() if b],
        "speedup_stitch": [s for s in map(_stitch_speedup, rows) if s is not None],
        "stitch_vs_best_compile": [_stitch_speedup(r) / best[id(r)] for r in rows
                                   if _stitch_speedup(r) is not None and best[id(r)]],
        "speedup_agents": [s for s in map(_agents_speedup, rows) if s is not None],
        "agents_vs_best_compile": [_agents_speedup(r) / best[id(r)] for r in rows
                                   if _agents_speedup(r) is not None and best[id(r)]],
    }
    for name, values in columns.items():
        out[f"geomean_{name}"] = geomean(values)
        out[f"models_with_{name}"] = len(values)
    # Baselines: eager (KernelBench's) and the faster torch.compile mode; the agents only when they ran.
    out["fast_p"] = {"stitch": fast_p(rows, _when_correct("speedup_stitch")),
                     "stitch_vs_best_compile": fast_p(rows, _when_correct("stitch_vs_best_compile"))}
    if any("agents_ms" in r or "agents_correct" in r for r in rows):
        out["fast_p"]["agents"] = fast_p(rows, _when_correct("speedup_agents", "agents_correct"))
        out["fast_p"]["agents_vs_best_compile"] = fast_p(rows, _when_correct("agents_vs_best_compile",
                                                                             "agents_correct"))
    out["slower_than_eager"] = sum(r["speedup_stitch"] < SLOW for r in rows if r.get("speedup_stitch"))
    walls = [r["optimize_s"] for r in rows if isinstance(r.get("optimize_s"), (int, float))]
    out["optimize_s_median"] = statistics.median(walls) if walls else None
    out["optimize_s_max"] = max(walls) if walls else None
    ratios = [r["memory_ratio"] for r in rows if isinstance(r.get("memory_ratio"), (int, float))]
    out["memory_over_target"] = sum(x > 1 for x in ratios)
    out["memory_over_target_forward"] = sum(r["memory_ratio_forward"] > 1 for r in rows
                                            if isinstance(r.get("memory_ratio_forward"), (int, float)))
    out["models_with_memory_ratio"] = len(ratios)
    # Eager timed at the end of a row against its first timing: the rows whose eager moved by more than
    # EAGER_DRIFT either way (their speed-ups are read against a baseline that moved within the row).
    drifts = [r["eager_after_ms"] / r["eager_ms"] for r in rows
              if isinstance(r.get("eager_after_ms"), (int, float)) and r.get("eager_ms")]
    out["eager_drifted"] = sum(abs(d - 1) > EAGER_DRIFT for d in drifts)
    out["models_with_eager_after"] = len(drifts)
    out.update(_error_summary(rows))
    return out


def _max_rel(row: dict, column: str) -> float | None:
    value = ((row.get("err_fp64") or {}).get(column) or {}).get("max_rel")
    return value if isinstance(value, (int, float)) else None


def error_ratio(row: dict, column: str = "stitch") -> float | None:
    """The column's max_rel against the fp64 reference over eager's (1.0 when both are exact, inf when only
    eager is); None without both."""
    got, eager = _max_rel(row, column), _max_rel(row, "eager")
    if got is None or eager is None:
        return None
    if eager == 0:
        return 1.0 if got == 0 else math.inf
    return got / eager


def _error_summary(rows: list[dict]) -> dict:
    """err_fp64_median: each column's median max_rel against the fp64 reference; the median ratios
    StitchCUDA / eager and torch.compile (default) / eager (error_ratio), each over the rows that have both."""
    medians = {}
    for column in ERROR_COLUMNS:
        values = [v for v in (_max_rel(r, column) for r in rows) if v is not None]
        if values:
            medians[column] = statistics.median(values)
    out: dict[str, Any] = {"err_fp64_median": medians}
    for column, key in (("stitch", "stitch_eager"), ("compile", "compile_eager")):
        values = [v for v in (error_ratio(r, column) for r in rows) if v is not None]
        out[f"err_ratio_{key}_median"] = statistics.median(values) if values else None
        out[f"models_with_err_ratio_{key}"] = len(values)
    return out


def summarize_classes(rows: list[dict]) -> dict[str, dict]:
    """summarize() per problem class, in CLASS_ORDER, for the classes present."""
    by_class: dict[str, list[dict]] = {}
    for r in rows:
        by_class.setdefault(r.get("class") or problem_class(r.get("model", "")), []).append(r)
    return {c: summarize(by_class[c]) for c in CLASS_ORDER if c in by_class}


def summarize_levels(rows: list[dict]) -> dict[str, dict]:
    """summarize() per KernelBench level (level1, level2, ...), for the rows that have one."""
    by_level: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("level"):
            by_level.setdefault(r["level"], []).append(r)
    return {name: summarize(by_level[name]) for name in sorted(by_level, key=level_key)}


def full_summary(rows: list[dict]) -> dict:
    """{overall, classes} and, when any row comes from a `level<N>` folder, levels."""
    summary = {"overall": summarize(rows), "classes": summarize_classes(rows)}
    levels = summarize_levels(rows)
    if levels:
        summary["levels"] = levels
    return summary


def fmt(v: Any, spec: str) -> str:
    """`v` formatted with `spec`, or a dash as wide as the column when there is no number."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, spec)
    width = spec.split(".")[0].rstrip("df")
    return format("-", f">{width}") if width else "-"


def _row_line(r: dict) -> str:
    passed = [s["correct"] for s in r.get("input_sets", [])]
    ok = ("-" if r.get("correct", False) is None else "yes" if r.get("correct") else "NO") + \
        (f" {sum(passed)}/{len(passed)}" if passed else "")  # None: not run (--compile-only)
    return (f"{r['model'][:34]:34} {str(r.get('class', '-'))[:15]:15} {fmt(r.get('eager_ms'), '8.4f')} "
            f"{fmt(r.get('compile_ms'), '8.4f')} {fmt(r.get('reduce_overhead_ms'), '8.4f')} "
            f"{fmt(r.get('stitch_ms'), '8.4f')} {fmt(r.get('speedup_compile'), '7.2f')} "
            f"{fmt(r.get('speedup_reduce_overhead'), '7.2f')} {fmt(r.get('speedup_best_compile'), '7.2f')} "
            f"{fmt(r.get('speedup_stitch'), '8.2f')} {fmt(r.get('stitch_vs_best_compile'), '7.2f')} {ok:>7} "
            f"{str(r.get('status', '-')):>9} {fmt(r.get('fallbacks'), '3d')} {fmt(r.get('optimize_s'), '6.1f')} "
            f"{fmt(r.get('memory_ratio'), '5.2f')}")


def _memory_note(r: dict) -> str:
    """Where optimize's memory went, for a row over its target: the device peak, the stage that first
    reached it (the stage peaks are cumulative), the budget's parts and what the kept program holds."""
    from ..graph.report import program_memory_text

    ratio, peak = r.get("memory_ratio"), r.get("optimize_device_peak_bytes") or r.get("optimize_peak_bytes")
    if not isinstance(ratio, (int, float)) or ratio <= 1 or not peak:
        return ""
    stages = r.get("stage_peak_bytes") or {}
    at = next((stage for stage, b in stages.items() if b >= 0.99 * peak), None)
    gib = 2 ** 30
    return (f"    memory: {peak / gib:.2f} GiB peak" + (f", reached by {at}" if at else "") +
            f"; eager peak {(r.get('eager_peak_bytes') or 0) / gib:.2f} GiB, largest tensor "
            f"{(r.get('largest_tensor_bytes') or 0) / gib:.2f} GiB" +
            (f" (the forward's {r['forward_largest_tensor_bytes'] / gib:.2f}: ratio "
             f"{fmt(r.get('memory_ratio_forward'), '.2f')})" if r.get("forward_largest_tensor_bytes") else "") +
            "; stages: " +
            ", ".join(f"{stage} {b / gib:.2f}" for stage, b in stages.items()) +
            (f"; program: {program_memory_text(r['program_memory'])}" if r.get("program_memory") else ""))


def _row_notes(r: dict) -> list[str]:
    lines = [f"    {stage} error: {err}" for stage, err in r.get("errors", {}).items()]
    lines += [f"    {s['inputs']} wrong: {s.get('mismatch') or s.get('error')}"
              for s in r.get("input_sets", []) if not s.get("correct")]
    if r.get("mismatch") and not r.get("input_sets"):
        lines.append(f"    mismatch: {r['mismatch']}")
    if r.get("status") == "eager" and r.get("reason"):
        lines.append(f"    eager because: {r['reason'][:200]}")
    memory = _memory_note(r)
    if memory:
        lines.append(memory)
    errors = r.get("err_fp64")
    if errors:
        names = {"eager": "eager", "compile": "compile", "reduce_overhead": "r-o", "stitch": "stitch",
                 "agents": "agents"}
        lines.append("    vs fp64 (max rel): " + ", ".join(f"{names[c]} {fmt(errors[c].get('max_rel'), '.2e')}"
                                                         for c in ERROR_COLUMNS if c in errors))
    elif r.get("fp64_note") and r.get("mode") != "compile-only":
        lines.append(f"    vs fp64: {r['fp64_note'][:200]}")
    accuracy = r.get("accuracy")
    if accuracy:  # a variant's row: each candidate by the accuracy rule (precision.accuracy_verdict)
        eager = next(iter(accuracy.values()))["eager_error"]
        lines.append(f"    accuracy vs {r.get('reference_dtype', 'float64')} (max rel; eager {fmt(eager, '.2e')}): " + ", ".join(
            f"{c} {fmt(v['error'], '.2e')} {({True: 'ok', False: 'OVER', None: '?'})[v['ok']]}"
            for c, v in accuracy.items()))
    return lines


def _variant_tolerance(rows: list[dict]) -> str:
    """The header's word on variant rows (bf16, fp16, autocast), whose outputs are judged at the 16-bit
    tolerance (precision.judged_precision and the tolerance table by dtype), not the run's."""
    if not any(r.get("variant") for r in rows):
        return ""
    atol, rtol = tolerance("bf16")
    return f" (bf16, fp16 and autocast rows: atol {atol:g}, rtol {rtol:g}, and the accuracy rule below)"


def _rows_precision(rows: list[dict]) -> str:
    return next((r["precision"] for r in rows if r.get("precision")), "fp32")


def _class_line(name: str, s: dict) -> str:
    return (f"{name[:15]:15} {s['models']:4d} {s['correct']:4d} {fmt(s['geomean_speedup_compile'], '7.2f')} "
            f"{fmt(s['geomean_speedup_reduce_overhead'], '7.2f')} {fmt(s['geomean_speedup_best_compile'], '7.2f')} "
            f"{fmt(s['geomean_speedup_stitch'], '8.2f')} {fmt(s['geomean_stitch_vs_best_compile'], '7.2f')} "
            f"{s['slower_than_eager']:6d} {fmt(s['optimize_s_median'], '7.1f')} {fmt(s['optimize_s_max'], '7.1f')} "
            f"{s['memory_over_target']:5d} {s.get('memory_over_target_forward', 0):5d}")


def format_table(rows: list[dict], summary: dict, device: str, title: str = "suite",
                 precision: str | None = None) -> str:
    """Per-problem rows, a per-class table, then the overall lines. `summary` is full_summary()'s
    {overall, classes}, or summarize()'s flat overall (the classes are then computed from `rows`).
    `precision` (default: the rows') names the flags and the tolerance in the header."""
    overall = summary.get("overall", summary)
    classes = summary.get("classes") or summarize_classes(rows)
    precision = precision or _rows_precision(rows)
    atol, rtol = tolerance(precision)
    head = (f"{'model':34} {'class':15} {'eager':>8} {'compile':>8} {'r-o':>8} {'stitch':>8} {'x comp':>7} "
            f"{'x r-o':>7} {'x best':>7} {'x stitch':>8} {'st/best':>7} {'ok':>7} {'status':>9} {'fb':>3} "
            f"{'opt s':>6} {'mem':>5}")
    lines = [f"StitchCUDA {title} on {device} (ms per forward; precision {PRECISION_WORDS[precision]}; outputs "
             f"within atol {atol:g}, rtol {rtol:g} of eager{_variant_tolerance(rows)}; speed-ups vs eager; st/best: StitchCUDA vs the faster "
             f"compile mode; mem: optimize peak / (eager peak + 2 x largest input or output); class table: "
             f"mem>1 over it, fwd>1 over it with the forward's largest tensor, intermediates included)",
             head, "-" * len(head)]
    for r in rows:
        lines += [_row_line(r), *_row_notes(r)]
    class_head = (f"{'class':15} {'n':>4} {'ok':>4} {'x comp':>7} {'x r-o':>7} {'x best':>7} {'x stitch':>8} "
                  f"{'st/best':>7} {'<0.98':>6} {'opt med':>7} {'opt max':>7} {'mem>1':>5} {'fwd>1':>5}")
    lines += ["", class_head, "-" * len(class_head)]
    lines += [_class_line(name, s) for name, s in classes.items()]
    if summary.get("levels"):
        lines += ["-" * len(class_head)] + [_class_line(name, s) for name, s in summary["levels"].items()]
    lines += ["-" * len(class_head), _class_line("overall", overall), ""]
    s = overall
    lines.append(f"geomean speed-up vs eager: torch.compile {fmt(s['geomean_speedup_compile'], '.3f')}x, "
                 f"reduce-overhead {fmt(s['geomean_speedup_reduce_overhead'], '.3f')}x, "
                 f"best compile mode {fmt(s['geomean_speedup_best_compile'], '.3f')}x, "
                 f"StitchCUDA {fmt(s['geomean_speedup_stitch'], '.3f')}x; StitchCUDA vs best compile mode "
                 f"{fmt(s['geomean_stitch_vs_best_compile'], '.3f')}x")
    if s.get("compiled") and not s.get("models_with_speedup_stitch"):  # a --compile-only run: nothing ran
        planned = "" if precision == "fp32" else \
            f" with precision={precision} (OfflinePlanner(precision={precision!r}): matmuls may use {precision})"
        lines[-1] = (f"compile-only: {s['compiled']}/{s['models']} captured, planned{planned} and compiled; nothing "
                     f"timed or checked; optimize s median {fmt(s['optimize_s_median'], '.1f')} max "
                     f"{fmt(s['optimize_s_max'], '.1f')}")
        return "\n".join(lines)
    lines.append(f"correct: {s['correct']}/{s['models']} ({100 * s['share_correct']:.0f}%), "
                 f"optimized (not eager): {s['optimized']}/{s['models']}, StitchCUDA < {SLOW}x eager: "
                 f"{s['slower_than_eager']}, optimize s median {fmt(s['optimize_s_median'], '.1f')} max "
                 f"{fmt(s['optimize_s_max'], '.1f')}, memory ratio > 1: {s['memory_over_target']}/"
                 f"{s['models_with_memory_ratio']} (against the forward's largest tensor, intermediates "
                 f"included: {s.get('memory_over_target_forward', '-')})")
    if s.get("models_with_accuracy"):
        from ..verify.tolerance import ACCURACY_FACTOR

        lines.append(f"accurate (StitchCUDA's norm-wise error vs the high-precision reference <= {ACCURACY_FACTOR:g} x "
                     f"eager's + one rounding of the output's format, on every input set): "
                     f"{s['accurate']}/{s['models_with_accuracy']}")
    medians = s.get("err_fp64_median") or {}
    if medians:
        names = {"eager": "eager", "compile": "compile", "reduce_overhead": "reduce-overhead", "stitch": "StitchCUDA",
                 "agents": "agents"}
        lines.append("error vs fp64 (median max rel): " + ", ".join(f"{names[c]} {v:.2e}" for c, v in medians.items())
                     + f"; StitchCUDA / eager median {fmt(s.get('err_ratio_stitch_eager_median'), '.2f')}x over "
                       f"{s.get('models_with_err_ratio_stitch_eager', 0)} problem(s)")
    if s.get("geomean_speedup_agents") is not None:
        lines.append(f"agents (--llm): geomean {fmt(s['geomean_speedup_agents'], '.3f')}x vs eager, "
                     f"{fmt(s['geomean_agents_vs_best_compile'], '.3f')}x vs best compile mode")
    names = {"stitch": "StitchCUDA vs eager", "stitch_vs_best_compile": "StitchCUDA vs best compile",
             "agents": "agents vs eager", "agents_vs_best_compile": "agents vs best compile"}
    shares = [f"{names[k]} " + " ".join(f"{p}:{v:.2f}" for p, v in f.items())
              for k, f in (s.get("fast_p") or {}).items() if f]
    if shares:
        lines.append("fast_p (share of all problems correct and faster than p x the baseline): " + "; ".join(shares))
    return "\n".join(lines)
