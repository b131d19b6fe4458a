"""What optimize() tells its caller: the Report (text, HTML, dict); its progress through long steps is
stitchcuda.log.StepProgress."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import NamedTuple, TypedDict

from ..log import StepProgress as _Progress  # optimize()'s stage progress: live on a terminal, plain lines elsewhere

__all__ = ["Report", "SCHEMA", "SCHEMAS_READ", "report_schema", "Decision", "GroupEntry", "FallbackEntry", "Verification",
           "Timing", "TargetRow", "accuracy_text"]

# The version of the dict Report.to_dict() writes. A change of meaning of a key bumps the number here and
# in report_schema() together. /2: internal_error (the traceback of a StitchCUDA bug that stopped optimize()).
SCHEMA = "stitchcuda.graph.report/2"
# The versions from_dict() reads: /1 is /2 without internal_error.
SCHEMAS_READ = ("stitchcuda.graph.report/1", SCHEMA)


# The report's records. Each is what the report's lists and dicts hold, with its keys and their types; they
# stay dicts (and decisions tuples) at run time, so JSON, the bench's rows and older readers take them as
# they are.


class Decision(NamedTuple):
    """A host or planning decision and why it was taken."""

    title: str
    why: str


class GroupEntry(TypedDict, total=False):
    """One group of the program (views and constants that nothing read left out)."""

    kind: str        # gemm, pointwise, reduction, conv, pool, scan, aten, kernel_step, "aten (fallback)", ...
    nodes: str       # its ATen ops, comma-separated, without the aten:: prefix
    reason: str      # the strategy and why
    kernel: str      # the generated kernel's name, where it has one
    source: str      # its CUDA source
    launch: str      # "grid (x, y, z), block (x, y, z)"
    strategy: str    # what the kernel does, in words
    aten_us: float   # per-group times, when recorded
    us: float


class FallbackEntry(TypedDict, total=False):
    """A group that runs on ATen instead of its generated code, and why."""

    group: str
    kind: str
    reason: str


class Verification(TypedDict, total=False):
    """The whole program against the model (the Verifier's verify_whole)."""

    passed: bool
    input_sets: int
    max_abs_error: float | None
    max_rel_error_fp64: float | None
    detail: str | None
    fp64_note: str | None
    precision: str   # the tolerance's precision ("tf32" where the model's convolutions run TF32)
    failed_set: int
    # The accuracy rule's verdicts (16-bit outputs, reduced precision policies: verify/tolerance.py), one
    # per output and input set: {set, output, ok, error, eager_error, bound, floor, reference}.
    accuracy: list[dict]


class Timing(TypedDict, total=False):
    """The measure stage's times, milliseconds per call."""

    eager_ms: float
    stitched_ms: float
    speedup_eager: float
    compile_ms: float
    speedup_compile: float
    compile_error: str
    rounds: int
    rounds_faster: int
    # A program slower than eager: its kernels (and its other steps together) that cost more than the ATen
    # ops they replace, biggest loss first, each {kernel, kind, nodes, groups, us, aten_us, loss_us}
    # (graph/measure.py, explain_loss); or why they could not be timed.
    slower_groups: list[dict]
    slower_groups_note: str


class TargetRow(TypedDict, total=False):
    """With llm=: one agents' target, its candidates and the winner."""

    target: str
    groups: list[str]
    strategy: str
    ops: str
    eager_ms: float | None
    template: dict | None
    llm: dict | None
    winner: str      # llm, template or aten
    note: str
    run_dir: str


@dataclass
class Report:
    """What optimize() did and why: groups, kernels, fallbacks, verification, speed-ups."""

    status: str = "eager"                  # "optimized" or "eager" (nothing replaced)
    reason: str = ""                       # why eager, when it is
    decisions: list[Decision] = field(default_factory=list)  # (title, why) tuples or Decisions
    groups: list[GroupEntry] = field(default_factory=list)
    fallbacks: list[FallbackEntry] = field(default_factory=list)
    verification: Verification = field(default_factory=dict)
    timing: Timing = field(default_factory=dict)
    op_counts: dict[str, int] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # The process's peak of GPU memory allocated by PyTorch at the end of each stage (a running maximum:
    # the stage where it rises is the one that needed the memory).
    stage_peak_bytes: dict[str, int] = field(default_factory=dict)
    # What the kept program holds on the GPU, in bytes: weights_bytes (its own copy of constants and of
    # weights stored in a layout of their own), shared_weights_bytes (the model's parameters its runner
    # reads in place: no copy), arena_bytes (the planned arena of intermediates) and runner_bytes (all the
    # runner held after its timed calls: own weights, arena, split scratch, static copies, the CUDA graph's
    # pool).
    memory: dict[str, int] = field(default_factory=dict)
    dynamic: dict = field(default_factory=dict)  # optimize(dynamic=): dims, guards, members, range check
    targets: list[TargetRow] = field(default_factory=list)  # with llm=: per target, the candidates and the winner
    agents: dict = field(default_factory=dict)          # with llm=: usage, wall and overhead time
    run_dir: str = ""                                   # with llm=: where the agents' run is recorded
    # A StitchCUDA bug that stopped optimize() (the model then runs eagerly): its traceback, to report.
    internal_error: str = ""

    @property
    def kernels(self) -> list[GroupEntry]:
        return [g for g in self.groups if g.get("source")]

    def to_dict(self) -> dict:
        """The report as plain JSON values, versioned by its "schema" key (SCHEMA; report_schema() is its
        JSON Schema): decisions as [decision, why] pairs, non-finite numbers (a failed check's infinite
        error) as null, so json.dumps writes strict JSON."""
        return _plain({"schema": SCHEMA, "status": self.status, "reason": self.reason,
                       "decisions": [[d, why] for d, why in self.decisions], "groups": self.groups,
                       "fallbacks": self.fallbacks, "verification": self.verification, "timing": self.timing,
                       "op_counts": self.op_counts, "stage_seconds": self.stage_seconds,
                       "stage_peak_bytes": self.stage_peak_bytes, "memory": self.memory, "targets": self.targets,
                       "agents": self.agents,
                       "run_dir": self.run_dir, "internal_error": self.internal_error})

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        """A Report from to_dict()'s layout (e.g. read back from JSON), of this schema or an older one
        (SCHEMAS_READ). A dict of another schema, or whose status or lists are not what the schema says, is
        refused (InvalidArgumentError); one without a "schema" key is taken as this version."""
        from ..errors import InvalidArgumentError

        if not isinstance(data, dict):
            raise InvalidArgumentError(f"a report must be a dict (Report.to_dict()'s layout), got "
                                       f"{type(data).__name__}")
        schema = data.get("schema", SCHEMA)
        if schema not in SCHEMAS_READ:
            raise InvalidArgumentError(f"a report of schema {schema!r}; this version reads "
                                       f"{' and '.join(map(repr, SCHEMAS_READ))}")
        if data.get("status", "eager") not in STATUSES:
            raise InvalidArgumentError(f"report status {data.get('status')!r} is not one of {', '.join(STATUSES)}")
        for key in ("decisions", "groups", "fallbacks", "targets"):
            if not isinstance(data.get(key, []), list):
                raise InvalidArgumentError(f"report key {key!r} must be a list, got {type(data[key]).__name__}")
        decisions = data.get("decisions", [])
        if not all(isinstance(d, (list, tuple)) and len(d) == 2 for d in decisions):
            raise InvalidArgumentError("report decisions must be [decision, why] pairs")
        return cls(status=data.get("status", "eager"), reason=data.get("reason", ""),
                   decisions=[Decision(str(d), str(why)) for d, why in decisions], groups=list(data.get("groups", [])),
                   fallbacks=list(data.get("fallbacks", [])), verification=dict(data.get("verification") or {}),
                   timing=dict(data.get("timing") or {}), op_counts=dict(data.get("op_counts") or {}),
                   stage_seconds=dict(data.get("stage_seconds") or {}),
                   stage_peak_bytes=dict(data.get("stage_peak_bytes") or {}), memory=dict(data.get("memory") or {}),
                   targets=list(data.get("targets", [])),
                   agents=dict(data.get("agents") or {}), run_dir=data.get("run_dir") or "",
                   internal_error=data.get("internal_error") or "")

    def __str__(self) -> str:
        lines = [f"StitchCUDA report: {self.status}" + (f" — {self.reason}" if self.reason else "")]
        if self.timing:
            t = self.timing
            lines.append(f"  time per forward: stitched {t.get('stitched_ms', float('nan')):.4f} ms, eager "
                         f"{t.get('eager_ms', float('nan')):.4f} ms"
                         + (f", torch.compile {t['compile_ms']:.4f} ms" if t.get("compile_ms") else ""))
            lines.append(f"  speed-up: {t.get('speedup_eager', float('nan')):.2f}x vs eager"
                         + (f", {t['speedup_compile']:.2f}x vs torch.compile" if t.get("speedup_compile") else ""))
            for r in t.get("slower_groups") or []:
                lines.append(f"  slower than ATen: {r.get('kernel') or r.get('kind')} ({r.get('groups')} group(s): "
                             f"{r.get('nodes')}) {r['us']:.1f} us vs {r['aten_us']:.1f} us, +{r['loss_us']:.1f} us")
        if self.verification:
            v = self.verification
            fp64 = v.get("max_rel_error_fp64")
            worst = v.get("max_abs_error")
            lines.append(f"  verification: {'passed' if v.get('passed') else 'FAILED'} on {v.get('input_sets', 0)} "
                         f"input set(s), max |error| {'-' if worst is None else format(worst, '.3g')}, max relative "
                         "error vs fp64 "
                         + (f"{fp64:.3g}" if fp64 is not None else v.get("fp64_note") or "not computed"))
            if v.get("accuracy"):
                lines.append(f"  accuracy rule: {accuracy_text(v['accuracy'])}")
        if self.memory:
            lines.append(f"  program on the GPU: {program_memory_text(self.memory)}")
        for d, why in self.decisions:
            lines.append(f"  decision: {d} ({why})")
        views = sum(g["kind"] == "view" for g in self.groups)
        for g in self.groups:
            if g["kind"] != "view":
                lines.append(f"  [{g['kind']:9}] {g['nodes']}: {g['reason']}")
        if views:
            lines.append(f"  [view     ] {views} view(s) of buffers without a copy")
        for f in self.fallbacks:
            lines.append(f"  fallback {f['group']}: {f['reason']}")
        for t in self.targets:
            lines.append(f"  target {t['target']} ({', '.join(t['groups'])}: {t['ops']}): winner {t['winner']} — "
                         + ", ".join(_speeds(t)) + (f"; {t['note']}" if t.get("note") else ""))
        if self.run_dir:
            lines.append(f"  agents' run directory: {self.run_dir}")
        if self.internal_error:
            lines.append("  internal error (a StitchCUDA bug; please report it with this traceback):")
            lines += ["    " + line for line in self.internal_error.rstrip().splitlines()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The report in Jupyter: the status and speed-ups first, the time plot, the verification, the
        decisions and fallbacks, the agents' targets, then the groups — views in one line, each kernel's
        source behind a fold."""
        return _html(self)


STATUSES = ("optimized", "eager")


def _plain(value):
    """`value` as JSON values: tuples as lists, non-finite floats as None, keys as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def report_schema() -> dict:
    """The JSON Schema (draft 2020-12) of Report.to_dict(): what a reader of saved reports can rely on.
    Objects may carry more keys than listed (a newer optimize() records more); the listed ones have
    these types."""
    string, number, integer = {"type": "string"}, {"type": ["number", "null"]}, {"type": "integer"}
    entry = {"type": "object", "required": ["kind", "nodes", "reason"],
             "properties": {"kind": string, "nodes": string, "reason": string, "kernel": string, "source": string,
                            "launch": string, "strategy": string,
                            "aten_us": number, "us": number}}  # per-group times, when recorded
    candidate = {"type": ["object", "null"], "properties": {"correct": {"type": "boolean"}, "speedup": number,
                                                            "ms": number, "attempt": {"type": ["integer", "null"]}}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA,
        "title": "StitchCUDA graph-mode report (optimize(model).report.to_dict())",
        "type": "object",
        "required": ["schema", "status", "reason", "decisions", "groups", "fallbacks", "verification", "timing",
                     "op_counts", "stage_seconds", "targets", "agents", "run_dir"],
        "properties": {
            "schema": {"const": SCHEMA},
            "status": {"enum": list(STATUSES), "description": "optimized: the stitched program runs; eager: the model"},
            "reason": {"type": "string", "description": "why the model runs eagerly (or what was only planned)"},
            "decisions": {"type": "array", "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                                     "prefixItems": [string, string]}},
            "groups": {"type": "array", "items": entry},
            "fallbacks": {"type": "array", "items": {
                "type": "object", "required": ["group", "reason"],
                "properties": {"group": string, "kind": string, "reason": string}}},
            "verification": {"type": "object",
                             "properties": {"passed": {"type": "boolean"}, "input_sets": integer,
                                            "max_abs_error": number, "max_rel_error_fp64": number,
                                            "detail": {"type": ["string", "null"]},
                                            "fp64_note": {"type": ["string", "null"]},
                                            "accuracy": {"type": "array", "items": {"type": "object"}}}},
            "timing": {"type": "object",
                       "properties": {"eager_ms": number, "stitched_ms": number, "speedup_eager": number,
                                      "compile_ms": number, "speedup_compile": number, "compile_error": string,
                                      "rounds": integer, "rounds_faster": integer,  # the rounds: since 2026-12
                                      "slower_groups": {"type": "array", "items": {  # absent in older reports
                                          "type": "object", "properties": {
                                              "kernel": string, "kind": string, "nodes": string, "groups": integer,
                                              "us": number, "aten_us": number, "loss_us": number}}},
                                      "slower_groups_note": string}},
            "op_counts": {"type": "object", "additionalProperties": integer},
            "stage_seconds": {"type": "object", "additionalProperties": {"type": "number"}},
            "stage_peak_bytes": {"type": "object", "additionalProperties": integer},  # absent in older reports
            "memory": {"type": "object", "additionalProperties": integer},  # absent in older reports
            "targets": {"type": "array", "items": {
                "type": "object", "required": ["target", "winner"],
                "properties": {"target": string, "groups": {"type": "array", "items": string}, "ops": string,
                               "eager_ms": number, "template": candidate, "llm": candidate,
                               "winner": {"enum": ["llm", "template", "aten"]}, "note": string, "run_dir": string}}},
            "agents": {"type": "object"},
            "run_dir": string,
            "internal_error": {"type": "string", "description": "the traceback of a StitchCUDA bug that stopped "
                                                                "optimize() (empty when none)"},
        },
    }


# ---- HTML (Jupyter) ----

_CSS = """<style>
.stitchcuda-report { font: 13px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 980px; }
.stitchcuda-report .status { font-size: 15px; margin: 0.2em 0 0.5em; }
.stitchcuda-report .ok { color: #1b6e2a; } .stitchcuda-report .eager { color: #9a5b00; }
.stitchcuda-report .bad { color: #b3261e; }
.stitchcuda-report h4 { margin: 1em 0 0.3em; font-size: 13px; }
.stitchcuda-report table { border-collapse: collapse; }
.stitchcuda-report td, .stitchcuda-report th { text-align: left; vertical-align: top; padding: 2px 8px;
  border-bottom: 1px solid #e4e4e4; }
.stitchcuda-report pre { max-height: 28em; max-width: 640px; overflow: auto; font-size: 11px; background: #f7f7f7;
  padding: 6px; }
.stitchcuda-report .note { color: #666; font-size: 12px; }
</style>"""

BEFORE, AFTER = "#999999", "#0072B2"  # the bars: ATen / eager, then StitchCUDA


def _e(text) -> str:
    return html.escape(str(text))


def _ms(value) -> str:
    return f"{value:.4f} ms" if isinstance(value, (int, float)) and math.isfinite(value) else "–"


def time_bars(report: "Report") -> tuple[list[tuple[str, float, float]], str]:
    """The bars of the report's time plot and what they show: (label, before ms, after ms) for the whole
    model when it was timed (eager, then the stitched program), then per group when the groups carry
    times (`aten_us` and `us`), else per agents' target (its ATen ops, then the winning candidate).
    optimize() times each group only when the program lost to eager (measure.explain_loss); otherwise,
    without the agents, the plot is the whole model's."""
    bars, parts = [], []
    t = report.timing
    if isinstance(t.get("eager_ms"), (int, float)) and isinstance(t.get("stitched_ms"), (int, float)):
        bars.append(("whole model", t["eager_ms"], t["stitched_ms"]))
        parts.append("the whole model: eager PyTorch, then the stitched program")
    per_group = [(f"{g['kind']}: {g['nodes']}", g["aten_us"] / 1e3, g["us"] / 1e3) for g in report.groups
                 if isinstance(g.get("aten_us"), (int, float)) and isinstance(g.get("us"), (int, float))]
    per_target = []
    for target in report.targets:
        before, winner = target.get("eager_ms"), target.get("winner")
        after = before if winner == "aten" else ((target.get(winner) or {}).get("ms") if winner else None)
        if isinstance(before, (int, float)) and isinstance(after, (int, float)):
            per_target.append((f"{target.get('target')}: {target.get('ops', '')}", before, after))
    if per_group:
        bars += per_group
        parts.append("each group: its ATen ops alone, then its generated step")
    elif per_target:
        bars += per_target
        parts.append("each agents' target: its ATen ops, then the winning candidate")
    return bars, ("time per call, before (grey) and after (blue): " + "; ".join(parts)) if bars else ""


def bar_svg(bars: list[tuple[str, float, float]], width: int = 560) -> str:
    """A small inline SVG: per label, a grey bar (before) over a blue one (after), both on one scale,
    each with its time; a <title> on each bar shows the exact value on hover."""
    label_w, row_h, bar_h, top = 190, 34, 12, 22
    scale = (width - label_w - 90) / max(max(b, a) for _, b, a in bars)
    height = top + row_h * len(bars) + 6
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'viewBox="0 0 {width} {height}" font-family="system-ui, sans-serif" font-size="11">',
             "<title>time before and after, per part</title>",
             f'<rect x="{label_w}" y="4" width="10" height="10" fill="{BEFORE}"/>'
             f'<text x="{label_w + 14}" y="13">before</text>'
             f'<rect x="{label_w + 70}" y="4" width="10" height="10" fill="{AFTER}"/>'
             f'<text x="{label_w + 84}" y="13">after</text>']
    for i, (label, before, after) in enumerate(bars):
        y = top + i * row_h
        short = label if len(label) <= 32 else label[:31] + "…"
        parts.append(f'<text x="{label_w - 6}" y="{y + bar_h + 4}" text-anchor="end"><title>{_e(label)}</title>'
                     f"{_e(short)}</text>")
        for k, (value, colour) in enumerate(((before, BEFORE), (after, AFTER))):
            w = max(value * scale, 1.0)
            yy = y + k * (bar_h + 2)
            parts.append(f'<rect class="{"before" if k == 0 else "after"}" x="{label_w}" y="{yy}" width="{w:.1f}" '
                         f'height="{bar_h}" fill="{colour}"><title>{_e(label)}: {value:.4f} ms</title></rect>'
                         f'<text x="{label_w + w + 4:.1f}" y="{yy + bar_h - 2}">{value:.3f} ms</text>')
    parts.append("</svg>")
    return "".join(parts)


def _status_html(r: "Report") -> str:
    t = r.timing
    if r.status == "optimized":
        speeds = []
        if isinstance(t.get("speedup_eager"), (int, float)):
            speeds.append(f"<b>{t['speedup_eager']:.2f}x</b> vs eager")
        if isinstance(t.get("speedup_compile"), (int, float)):
            speeds.append(f"<b>{t['speedup_compile']:.2f}x</b> vs torch.compile")
        head = '<span class="ok">optimized</span>' + (" — " + ", ".join(speeds) if speeds else "")
    else:
        head = '<span class="eager">runs eagerly</span>' + (f" — {_e(r.reason)}" if r.reason else "")
    out = [f'<div class="status"><b>StitchCUDA</b>: {head}</div>']
    if t.get("eager_ms") is not None or t.get("stitched_ms") is not None:
        cells = [f"stitched {_ms(t.get('stitched_ms'))}", f"eager {_ms(t.get('eager_ms'))}"]
        if t.get("compile_ms") is not None:
            cells.append(f"torch.compile {_ms(t['compile_ms'])}")
        elif t.get("compile_error"):
            cells.append(f"torch.compile failed: {_e(t['compile_error'])}")
        out.append(f'<div class="timing">time per forward: {", ".join(cells)}</div>')
    return "".join(out)


def accuracy_text(verdicts: list[dict]) -> str:
    """The accuracy rule's closest call among `verdicts` (the largest share of its bound used): the
    candidate's error and eager's against the high-precision reference."""
    worst = max(verdicts, key=lambda a: a["error"] / a["bound"] if a["bound"] > 0 else float("inf"))
    passed = sum(bool(a["ok"]) for a in verdicts)
    return (f"{passed}/{len(verdicts)} output(s) within bound; closest: output {worst['output']} of input set "
            f"{worst['set']}, error {worst['error']:.3g} vs eager's {worst['eager_error']:.3g} against the "
            f"{worst['reference']} reference (bound {worst['bound']:.3g})")


def _verification_html(v: dict) -> str:
    if not v:
        return ""
    worst, fp64 = v.get("max_abs_error"), v.get("max_rel_error_fp64")
    verdict = '<span class="ok">passed</span>' if v.get("passed") else '<span class="bad">FAILED</span>'
    text = (f"verification: {verdict} on {v.get('input_sets', 0)} input set(s), max |error| "
            f"{'–' if worst is None else format(worst, '.3g')}, max relative error vs fp64 "
            + (format(fp64, ".3g") if fp64 is not None else _e(v.get("fp64_note") or "not computed")))
    if v.get("accuracy"):
        text += f"; accuracy rule: {_e(accuracy_text(v['accuracy']))}"
    if not v.get("passed") and v.get("detail"):
        text += f" — {_e(v['detail'])}"
    return f'<div class="verification">{text}</div>'


def _groups_html(groups: list[dict]) -> str:
    views = sum(g.get("kind") == "view" for g in groups)
    rows = []
    for g in groups:
        if g.get("kind") == "view":
            continue
        kernel = ""
        if g.get("source"):
            what = " · ".join(_e(x) for x in (g.get("kernel"), g.get("launch")) if x)
            kernel = (f'<details class="kernel"><summary><code>{what or "kernel"}</code></summary>'
                      f"<pre><code>{_e(g['source'])}</code></pre></details>")
        rows.append(f"<tr><td>{_e(g.get('kind', ''))}</td><td><code>{_e(g.get('nodes', ''))}</code></td>"
                    f"<td>{_e(g.get('reason', ''))}{kernel}</td></tr>")
    if views:
        rows.append(f'<tr class="views"><td>view</td><td colspan="2">{views} view(s) of buffers without a copy '
                    "(reshapes, slices, transposes: no kernel, no step)</td></tr>")
    return ("<table><tr><th>kind</th><th>ops</th><th>what it became and why</th></tr>" + "".join(rows)
            + "</table>")


def _targets_html(targets: list[dict]) -> str:
    rows = "".join(f"<tr><td>{_e(t.get('target'))}</td><td><code>{_e(t.get('ops', ''))}</code></td>"
                   f"<td><b>{_e(t.get('winner'))}</b></td><td>{_e(', '.join(_speeds(t)))}</td>"
                   f"<td>{_e(t.get('note') or '')}</td></tr>" for t in targets)
    return ("<table><tr><th>target</th><th>ops</th><th>winner</th><th>candidates</th><th>note</th></tr>"
            + rows + "</table>")


def _html(r: "Report") -> str:
    parts = [_CSS, '<div class="stitchcuda-report">', _status_html(r)]
    bars, caption = time_bars(r)
    if bars:
        parts.append(f'<figure class="time-plot" style="margin: 0.4em 0">{bar_svg(bars)}'
                     f'<figcaption class="note">{_e(caption)}</figcaption></figure>')
    parts.append(_verification_html(r.verification))
    if r.decisions:
        parts.append(f'<h4>Decisions ({len(r.decisions)})</h4><ul class="decisions">'
                     + "".join(f"<li>{_e(d)} <span class=\"note\">({_e(why)})</span></li>" for d, why in r.decisions)
                     + "</ul>")
    if r.fallbacks:
        parts.append(f'<h4 class="bad">Fallbacks to ATen ({len(r.fallbacks)})</h4><ul class="fallbacks">'
                     + "".join(f"<li><code>{_e(f.get('group'))}</code> ({_e(f.get('kind', ''))}): {_e(f.get('reason'))}"
                               "</li>" for f in r.fallbacks) + "</ul>")
    if r.targets:
        parts.append(f"<h4>Agents' targets ({len(r.targets)})</h4>" + _targets_html(r.targets))
        if r.run_dir:
            parts.append(f'<div class="note">run directory: <code>{_e(r.run_dir)}</code></div>')
    if r.groups:
        kernels = sum(bool(g.get("source")) for g in r.groups)
        parts.append(f"<h4>Groups ({sum(g.get('kind') != 'view' for g in r.groups)}, {kernels} generated "
                     "kernel(s))</h4>" + _groups_html(r.groups))
    if r.stage_seconds:
        peaks = r.stage_peak_bytes or {}
        parts.append('<div class="note">stages: ' + ", ".join(
            f"{_e(k)} {v:.1f} s" + (f" (GPU memory peak {peaks[k] / 2**30:.2f} GiB)" if peaks.get(k) else "")
            for k, v in r.stage_seconds.items()) + "</div>")
    if r.memory:
        parts.append(f'<div class="note">program on the GPU: {_e(program_memory_text(r.memory))}</div>')
    parts.append("</div>")
    return "".join(parts)


def program_memory_text(memory: dict) -> str:
    """Report.memory in words: "own weights 0.00 GiB, weights read in place from the model 0.12 GiB, arena
    0.25 GiB, planned per call 0.75 GiB, runner 0.50 GiB in all"."""
    names = (("weights_bytes", "own weights"), ("shared_weights_bytes", "weights read in place from the model"),
             ("arena_bytes", "arena"), ("planned_bytes", "planned per call"), ("runner_bytes", "runner"))
    parts = [f"{label} {memory[key] / 2**30:.2f} GiB" for key, label in names if memory.get(key) is not None]
    return ", ".join(parts) + (" in all" if memory.get("runner_bytes") is not None else "")


def _speeds(t: dict) -> list[str]:
    """A target's candidates as "ATen 1.00x, template 1.12x, LLM 2.9x (attempt 3)"."""
    out = ["ATen 1.00x"]
    tpl = t.get("template") or {}
    out.append(f"template {tpl['speedup']:.2f}x" if tpl.get("correct") and tpl.get("speedup") else "template -")
    llm = t.get("llm") or {}
    out.append(f"LLM {llm['speedup']:.2f}x (attempt {llm.get('attempt')})" if llm.get("speedup") else
               f"LLM - ({llm.get('attempts', 0)} attempt(s): {llm.get('stop_reason', '')})")
    return out
