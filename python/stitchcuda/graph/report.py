"""What optimize() tells its caller: the Report (text, HTML, dict) and the progress lines of long steps."""

from __future__ import annotations

import html
import os
import sys
import time
from dataclasses import dataclass, field

__all__ = ["Report"]


class _Progress:
    """One line per long step on a terminal or in Jupyter; silent in logs and CI."""

    def __init__(self, enabled: bool | None) -> None:
        if enabled is None:
            enabled = (sys.stderr.isatty() or "ipykernel" in sys.modules) and not os.environ.get("CI")
        self.enabled = enabled

    def step(self, text: str):
        progress = self

        class _Step:
            def __enter__(self):
                self.t0 = time.perf_counter()
                if progress.enabled:
                    print(f"[stitchcuda] {text}…", end="", file=sys.stderr, flush=True)
                return self

            def __exit__(self, *exc):
                if progress.enabled:
                    print(f" {'failed' if exc[0] else 'done'} ({time.perf_counter() - self.t0:.1f} s)",
                          file=sys.stderr, flush=True)
                return False

        return _Step()


@dataclass
class Report:
    """What optimize() did and why: groups, kernels, fallbacks, verification, speed-ups."""

    status: str = "eager"                  # "optimized" or "eager" (nothing replaced)
    reason: str = ""                       # why eager, when it is
    decisions: list[tuple[str, str]] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)
    fallbacks: list[dict] = field(default_factory=list)
    verification: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    op_counts: dict = field(default_factory=dict)
    stage_seconds: dict = field(default_factory=dict)
    targets: list[dict] = field(default_factory=list)  # with llm=: per target, the candidates and the winner
    agents: dict = field(default_factory=dict)          # with llm=: usage, wall and overhead time
    run_dir: str = ""                                   # with llm=: where the agents' run is recorded

    @property
    def kernels(self) -> list[dict]:
        return [g for g in self.groups if g.get("source")]

    def to_dict(self) -> dict:
        return {"status": self.status, "reason": self.reason, "decisions": self.decisions, "groups": self.groups,
                "fallbacks": self.fallbacks, "verification": self.verification, "timing": self.timing,
                "op_counts": self.op_counts, "stage_seconds": self.stage_seconds, "targets": self.targets,
                "agents": self.agents, "run_dir": self.run_dir}

    def __str__(self) -> str:
        lines = [f"StitchCUDA report: {self.status}" + (f" — {self.reason}" if self.reason else "")]
        if self.timing:
            t = self.timing
            lines.append(f"  time per forward: stitched {t.get('stitched_ms', float('nan')):.4f} ms, eager "
                         f"{t.get('eager_ms', float('nan')):.4f} ms"
                         + (f", torch.compile {t['compile_ms']:.4f} ms" if t.get("compile_ms") else ""))
            lines.append(f"  speed-up: {t.get('speedup_eager', float('nan')):.2f}x vs eager"
                         + (f", {t['speedup_compile']:.2f}x vs torch.compile" if t.get("speedup_compile") else ""))
        if self.verification:
            v = self.verification
            fp64 = v.get("max_rel_error_fp64")
            lines.append(f"  verification: {'passed' if v.get('passed') else 'FAILED'} on {v.get('input_sets', 0)} "
                         f"input set(s), max |error| {v.get('max_abs_error', 0):.3g}, max relative error vs fp64 "
                         + (f"{fp64:.3g}" if fp64 is not None else v.get("fp64_note") or "not computed"))
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
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(g['kind'])}</td><td><code>{html.escape(g['nodes'])}</code></td>"
                       f"<td>{html.escape(g['reason'])}</td></tr>" for g in self.groups)
        head = html.escape(str(self).splitlines()[0])
        timing = "<br>".join(html.escape(l.strip()) for l in str(self).splitlines()[1:4])
        return (f"<div><b>{head}</b><br>{timing}<table><tr><th>kind</th><th>ops</th><th>why</th></tr>{rows}"
                "</table></div>")


def _speeds(t: dict) -> list[str]:
    """A target's candidates as "ATen 1.00x, template 1.12x, LLM 2.9x (attempt 3)"."""
    out = ["ATen 1.00x"]
    tpl = t.get("template") or {}
    out.append(f"template {tpl['speedup']:.2f}x" if tpl.get("correct") and tpl.get("speedup") else "template -")
    llm = t.get("llm") or {}
    out.append(f"LLM {llm['speedup']:.2f}x (attempt {llm.get('attempt')})" if llm.get("speedup") else
               f"LLM - ({llm.get('attempts', 0)} attempt(s): {llm.get('stop_reason', '')})")
    return out
