"""The HTML report of a `stitchcuda bench` run (`--html FILE`): one self-contained file — plots as inline
SVG drawn with matplotlib, no scripts, nothing fetched — with the summary and fast_p, each problem's
speed-up against torch.compile, a roofline of every problem against the GPU's ceilings, the agents' best
speed-up per attempt, and the rows. matplotlib is an optional dependency (the `bench` extra: `pip install '.[bench]'` in a clone).
"""

from __future__ import annotations

import datetime
import html
import io
import math
from pathlib import Path
from typing import Any

__all__ = ["INSTALL_HINT", "matplotlib_missing", "render", "write_report", "speedup_svg", "roofline_svg",
           "attempts_svg"]

INSTALL_HINT = "pip install matplotlib (or, in a StitchCUDA clone, pip install '.[bench]')"
# The header's words for a run's --precision (every column ran under the same torch flags).
PRECISION_LABELS = {"fp32": "fp32, TF32 off", "tf32": "tf32: TF32 matmuls and convolutions",
                    "bf16": "bf16 matmuls for StitchCUDA, torch at 'medium'"}

# Colours a reader can tell apart in print and with the common colour-vision deficiencies (Okabe-Ito).
BLUE, ORANGE, GREEN, RED, GREY = "#0072B2", "#E69F00", "#009E73", "#D55E00", "#999999"

# One marker per column in the roofline: (row key of the time, label, colour, marker).
ROOFLINE_COLUMNS = (("eager_ms", "eager", GREY, "o"), ("best_compile_ms", "torch.compile (best mode)", ORANGE, "s"),
                    ("stitch_ms", "StitchCUDA", BLUE, "D"), ("agents_ms", "StitchCUDA + agents", GREEN, "^"))


def matplotlib_missing() -> str:
    """"" when matplotlib imports, else what to install (the message of a usage error)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"--html needs matplotlib, which is not installed: {INSTALL_HINT}"
    return ""


def _figure(width: float, height: float) -> Any:
    """A matplotlib Figure not tied to pyplot (no global state, no GUI backend: safe inside Jupyter)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        from ..errors import UnavailableError

        raise UnavailableError(f"the HTML report needs matplotlib: {INSTALL_HINT}") from exc
    return Figure(figsize=(width, height), layout="constrained")


def _svg(fig: Any) -> str:
    """The figure as an inline <svg> element: text kept as text (small, searchable), no XML prolog."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "stitchcuda"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})  # the same rows draw the same SVG
    text = buf.getvalue()
    return text[text.index("<svg"):]


# ---- the plots ----


def speedup_svg(rows: list[dict]) -> str | None:
    """Horizontal bars, one per problem: the faster torch.compile mode's time over StitchCUDA's (>1:
    StitchCUDA is faster), and the agents' beside it when they ran; wrong results hatched in red, a
    problem that fell back to eager in grey. None when no row has both times."""
    shown = [r for r in rows if r.get("stitch_vs_best_compile")]
    if not shown:
        return None
    agents = any(r.get("agents_vs_best_compile") for r in shown)
    shown.sort(key=lambda r: r["stitch_vs_best_compile"])
    n = len(shown)
    fig = _figure(8.0, 1.2 + 0.24 * n * (1.6 if agents else 1.0))
    ax = fig.subplots()
    height = 0.4 if agents else 0.7
    # Bars grow from 1x: to the right where StitchCUDA is faster, to the left where it is slower.
    for i, r in enumerate(shown):
        wrong = not r.get("correct")
        colour = RED if wrong else GREY if r.get("status") == "eager" else BLUE
        ax.barh(i + (height / 2 if agents else 0), r["stitch_vs_best_compile"] - 1.0, left=1.0, height=height,
                color=colour, hatch="//" if wrong else None, edgecolor="black" if wrong else "white", linewidth=0.3)
        if agents and r.get("agents_vs_best_compile"):
            wrong = not r.get("agents_correct")
            ax.barh(i - height / 2, r["agents_vs_best_compile"] - 1.0, left=1.0, height=height,
                    color=RED if wrong else GREEN, hatch="//" if wrong else None, linewidth=0.3)
    ax.set_yticks(range(n), [r["model"] for r in shown], fontsize=7)
    ax.set_xscale("log")
    values = [r[k] for r in shown for k in ("stitch_vs_best_compile", "agents_vs_best_compile") if r.get(k)]
    lo, hi = min(values + [1.0]) / 1.15, max(values + [1.0]) * 1.15
    ax.set_xlim(lo, hi)
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ticks = [t for t in (0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 3, 5, 10, 20, 50) if lo <= t <= hi]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speed-up over torch.compile (best of default and reduce-overhead; log scale)")
    ax.set_ylim(-0.7, n - 0.3)
    from matplotlib.patches import Patch

    legend = [Patch(color=BLUE, label="StitchCUDA"), Patch(color=GREY, label="fell back to eager"),
              Patch(facecolor=RED, hatch="//", label="wrong result")]
    if agents:
        legend.insert(1, Patch(color=GREEN, label="StitchCUDA + agents"))
    ax.legend(handles=legend, loc="lower right", fontsize=7)
    return _svg(fig)


def ceilings(hardware: dict | None) -> tuple[float, float, str]:
    """(DRAM bytes/s, FP32 FLOP/s, where they come from): the described GPU's peaks, else the H200's
    (the GPU StitchCUDA's numbers were measured on) with a note saying so."""
    hw = hardware or {}
    if hw.get("dram_tb_s") and hw.get("fp32_tflops"):
        return hw["dram_tb_s"] * 1e12, hw["fp32_tflops"] * 1e12, str(hw.get("gpu") or "this GPU")
    from ..verify.hardware import default_ceilings

    c = default_ceilings()
    why = f"the ceilings table does not know {hw['gpu']}" if hw.get("gpu") else "no GPU described"
    return float(c.dram_bytes_per_s), float(c.fp32_flops_per_s), f"{c.name} ({why})"


def roofline_svg(rows: list[dict], hardware: dict | None) -> str | None:
    """Each problem's achieved FLOP rate (FLOPs / time) against its arithmetic intensity (FLOPs per byte
    that must move), one marker per column, under the roofline min(FP32 peak, intensity x DRAM
    bandwidth). A point's height under the line is the share of the GPU's speed of light it reached.
    None when no row has work and a time."""
    points = {key: [] for key, *_ in ROOFLINE_COLUMNS}
    for r in rows:
        flops, nbytes = r.get("flops"), r.get("bytes")
        if not flops or not nbytes:
            continue
        for key, *_ in ROOFLINE_COLUMNS:
            if r.get(key):
                points[key].append((flops / nbytes, flops / (r[key] * 1e-3) / 1e12))
    if not any(points.values()):
        return None
    bandwidth, peak, source = ceilings(hardware)
    xs = [x for pts in points.values() for x, _ in pts]
    lo, hi = min(xs + [peak / bandwidth]) / 4, max(xs + [peak / bandwidth]) * 4
    fig = _figure(7.0, 4.6)
    ax = fig.subplots()
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak, x * bandwidth) / 1e12 for x in grid], color="black", linewidth=1.2,
            label=f"roofline: {bandwidth / 1e12:.2f} TB/s, {peak / 1e12:.1f} TFLOP/s FP32")
    for key, label, colour, marker in ROOFLINE_COLUMNS:
        if points[key]:
            ax.scatter([x for x, _ in points[key]], [y for _, y in points[key]], s=18, color=colour,
                       marker=marker, label=label, alpha=0.85, edgecolors="none")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte of inputs, parameters and outputs)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.legend(fontsize=7, loc="lower right")
    return _svg(fig)


def best_so_far(speedups: list[float | None]) -> list[float | None]:
    """The best speed-up after each attempt (None until an attempt is correct)."""
    out: list[float | None] = []
    best = None
    for s in speedups:
        if s is not None and (best is None or s > best):
            best = s
        out.append(best)
    return out


def attempts_svg(rows: list[dict]) -> str | None:
    """One line per agents' target: the best verified speed-up over the target's ATen ops after each
    attempt. None when no row has an agents' target with attempts."""
    lines = [(f"{r['model']}/{t.get('target')}", best_so_far(t["attempts"]))
             for r in rows for t in r.get("agents_targets") or [] if t.get("attempts")]
    if not lines:
        return None
    fig = _figure(8.0 if len(lines) <= 16 else 7.0, 4.0)
    ax = fig.subplots()
    for label, best in lines:
        xs = [i + 1 for i, b in enumerate(best) if b is not None]
        ys = [b for b in best if b is not None]
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1, label=label)
        else:  # no correct attempt: a mark at 0 on the x axis would lie; a note in the legend does not
            ax.plot([], [], label=f"{label} (no correct attempt)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("attempt")
    ax.set_ylabel("best speed-up so far (over the target's ATen ops)")
    ax.set_xlim(0.8, max(len(best) for _, best in lines) + 0.2)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if len(lines) <= 16:  # beside the plot, where it hides no line
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _svg(fig)


# ---- the page ----

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 2em; }
table { border-collapse: collapse; font-size: 12px; margin: 0.5em 0; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: right; white-space: nowrap; }
th { background: #f4f4f4; white-space: normal; vertical-align: bottom; } td.l, th.l { text-align: left; }
.meta { color: #555; } .bad { color: #b3261e; font-weight: 600; } .good { color: #1b6e2a; }
.note { color: #555; font-size: 12px; max-width: 60em; } figure { margin: 0.5em 0; }
figure svg { max-width: 100%; height: auto; } details { margin: 0.3em 0; } code { font-size: 12px; }
.wide { overflow-x: auto; }
"""


def _e(text: Any) -> str:
    return html.escape(str(text))


def _num(value: Any, spec: str, suffix: str = "") -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return format(value, spec) + suffix
    return "–"


def _summary_table(summary: dict) -> str:
    groups = [("overall", summary.get("overall") or summary)]
    groups += [(name, s) for name, s in (summary.get("levels") or {}).items()]
    groups += [(name, s) for name, s in (summary.get("classes") or {}).items()]
    agents = any(s.get("models_with_speedup_agents") for _, s in groups)
    head = ["group", "problems", "correct", "x compile", "x best compile", "x StitchCUDA", "StitchCUDA / best compile"]
    head += ["x agents"] if agents else []
    head += ["fast_0", "fast_0.5", "fast_1", "fast_1 vs compile", "optimize s (median)"]
    out = ["<div class=wide><table><tr>" + "".join(f"<th{' class=l' if i == 0 else ''}>{_e(h)}</th>"
                                                   for i, h in enumerate(head)) + "</tr>"]
    for name, s in groups:
        fp = (s.get("fast_p") or {}).get("stitch") or {}
        fpc = (s.get("fast_p") or {}).get("stitch_vs_best_compile") or {}
        cells = [f"<td class=l><b>{_e(name)}</b></td>", f"<td>{s.get('models', 0)}</td>",
                 f"<td>{s.get('correct', 0)}</td>", f"<td>{_num(s.get('geomean_speedup_compile'), '.2f', 'x')}</td>",
                 f"<td>{_num(s.get('geomean_speedup_best_compile'), '.2f', 'x')}</td>",
                 f"<td><b>{_num(s.get('geomean_speedup_stitch'), '.2f', 'x')}</b></td>",
                 f"<td>{_num(s.get('geomean_stitch_vs_best_compile'), '.2f', 'x')}</td>"]
        if agents:
            cells.append(f"<td>{_num(s.get('geomean_speedup_agents'), '.2f', 'x')}</td>")
        cells += [f"<td>{_num(fp.get(p), '.2f')}</td>" for p in ("0", "0.5", "1")]
        cells += [f"<td>{_num(fpc.get('1'), '.2f')}</td>", f"<td>{_num(s.get('optimize_s_median'), '.1f')}</td>"]
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(out) + "</table></div>"


def _rows_table(rows: list[dict], bandwidth: float, peak: float) -> str:
    head = ["problem", "level", "class", "eager ms", "best compile", "StitchCUDA ms", "x eager", "vs compile",
            "agents ms", "correct", "status", "optimize s", "FLOP/byte", "of roofline"]
    out = ["<div class=wide><table><tr>" + "".join(f"<th{' class=l' if i < 3 or h == 'status' else ''}>{_e(h)}</th>"
                                                   for i, h in enumerate(head)) + "</tr>"]
    for r in rows:
        floor_ms = None
        if r.get("flops") is not None and r.get("bytes"):
            floor_ms = max(r["flops"] / peak, r["bytes"] / bandwidth) * 1e3
        of_roofline = floor_ms / r["stitch_ms"] if floor_ms and r.get("stitch_ms") else None
        intensity = r["flops"] / r["bytes"] if r.get("flops") is not None and r.get("bytes") else None
        correct = r.get("correct")
        verdict = ("<span class=good>yes</span>" if correct else "–" if correct is None
                   else "<span class=bad>NO</span>")
        compile_cell = _num(r.get("best_compile_ms"), ".3f") + (f" ({_e(r['best_compile_mode'])})"
                                                               if r.get("best_compile_mode") else "")
        cells = [f"<td class=l>{_e(r.get('model'))}</td>", f"<td class=l>{_e(r.get('level') or '')}</td>",
                 f"<td class=l>{_e(r.get('class') or '')}</td>", f"<td>{_num(r.get('eager_ms'), '.3f')}</td>",
                 f"<td>{compile_cell}</td>", f"<td>{_num(r.get('stitch_ms'), '.3f')}</td>",
                 f"<td>{_num(r.get('speedup_stitch'), '.2f', 'x')}</td>",
                 f"<td>{_num(r.get('stitch_vs_best_compile'), '.2f', 'x')}</td>",
                 f"<td>{_num(r.get('agents_ms'), '.3f')}</td>", f"<td>{verdict}</td>",
                 f"<td class=l>{_e(r.get('status') or '–')}</td>", f"<td>{_num(r.get('optimize_s'), '.1f')}</td>",
                 f"<td>{_num(intensity, '.3g')}</td>",
                 f"<td>{_num(100 * of_roofline if of_roofline else None, '.0f', '%')}</td>"]
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(out) + "</table></div>"


def _problems_notes(rows: list[dict]) -> str:
    """What went wrong, per problem, behind one fold each."""
    items = []
    for r in rows:
        notes = [f"{stage}: {text}" for stage, text in (r.get("errors") or {}).items()]
        notes += [f"{s['inputs']} wrong: {s.get('mismatch') or s.get('error')}" for s in r.get("input_sets") or []
                  if not s.get("correct")]
        if r.get("status") == "eager" and r.get("reason"):
            notes.append(f"ran eagerly: {r['reason']}")
        if notes:
            items.append(f"<details><summary>{_e(r['model'])}: {len(notes)} note(s)</summary><ul>"
                         + "".join(f"<li><code>{_e(n)}</code></li>" for n in notes) + "</ul></details>")
    return "\n".join(items) or "<p class=note>No errors, mismatches or fallbacks.</p>"


def _section(anchor: str, title: str, svg: str | None, note: str, empty: str) -> str:
    body = f"<figure>{svg}</figure>" if svg else f"<p class=empty>{_e(empty)}</p>"
    return f'<section id="{anchor}"><h2>{_e(title)}</h2>{body}<p class=note>{note}</p></section>'


def render(rows: list[dict], summary: dict, *, hardware: dict | None = None, title: str = "bench",
           mode: str = "timed", precision: str = "fp32") -> str:
    """The report as one HTML document (a string)."""
    from .. import __version__

    bandwidth, peak, source = ceilings(hardware)
    hw = hardware or {}
    gpu = hw.get("gpu") or "no GPU"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    overall = summary.get("overall") or summary
    timed = mode != "compile-only"
    parts = [f"<h1>StitchCUDA {_e(title)}</h1>",
             f"<p class=meta>{_e(gpu)} · {len(rows)} problem(s) · {'timed' if timed else 'compile-only (no timing)'}"
             f" · {_e(PRECISION_LABELS.get(precision, precision))} · stitchcuda {_e(__version__)} · {stamp}</p>",
             "<section id=summary><h2>Summary</h2>", _summary_table(summary),
             "<p class=note>Speed-ups are geomeans over eager PyTorch (a wrong StitchCUDA result counts as 1x). "
             "fast_p, KernelBench's metric: the share of all the problems, failed ones included, whose result is "
             "correct and whose speed-up over the baseline (eager; last fast_p column: the faster torch.compile "
             "mode) is strictly greater than p.</p></section>"]
    if not timed:
        empty = "compile-only run: nothing was timed"
    else:
        empty = "no problem has both a StitchCUDA and a torch.compile time"
    parts.append(_section("speedup", "Speed-up per problem against torch.compile", speedup_svg(rows),
                          "The faster torch.compile mode's time over StitchCUDA's, per problem (right of the line: "
                          "StitchCUDA is faster).", empty))
    parts.append(_section("roofline", "Roofline", roofline_svg(rows, hardware),
                          f"Ceilings: {_e(source)}. Work per problem on the meta device: FLOPs by torch's formulas "
                          "for matmuls, convolutions and attention, one per element for other ops; bytes: "
                          "parameters, inputs and outputs moved once.",
                          empty if not timed else "no problem has FLOPs, bytes and a time"))
    if any(r.get("agents_targets") for r in rows) or overall.get("models_with_speedup_agents"):
        parts.append(_section("attempts", "Agents: best speed-up per attempt", attempts_svg(rows),
                              "Each line is one target the agents worked on; its height after attempt k is the best "
                              "verified speed-up over the target's ATen ops so far.",
                              "no agents' target recorded any attempt"))
    parts += ["<section id=problems><h2>Problems</h2>", _rows_table(rows, bandwidth, peak), "</section>",
              "<section id=notes><h2>Errors, mismatches and fallbacks</h2>", _problems_notes(rows), "</section>"]
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f"<title>StitchCUDA {_e(title)}</title><style>{STYLE}</style></head><body>\n"
            + "\n".join(parts) + "\n</body></html>\n")


def write_report(path: Path | str, rows: list[dict], summary: dict, *, hardware: dict | None = None,
                 title: str = "bench", mode: str = "timed", precision: str = "fp32") -> Path:
    """Writes render()'s document to `path` (atomically) and returns the path."""
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(rows, summary, hardware=hardware, title=title, mode=mode, precision=precision),
                   encoding="utf-8")
    os.replace(tmp, path)
    return path

