"""`stitchcuda optimize --mode program PROBLEM.py --llm SPEC`: the agent loop from the command line (the
`optimize` parser and its --mode choice live in stitchcuda/graph/cli.py, which calls run_program here),
and `stitchcuda runs list|show|diff`: what the run directories hold.

Exit codes: 0 a run finished with a usable candidate (or a runs command worked), 1 a run found none,
2 usage errors (bad arguments, unreadable problem, unknown model spec, missing run directory).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
UNVERIFIED = "UNVERIFIED (no GPU: compile and static checks only)"


# ---- stitchcuda optimize --mode program ------------------------------------------------------------


class Progress:
    """One line per loop event; on a terminal the line is rewritten in place (\\r) and kept at the end."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.width = 0

    @staticmethod
    def format(event: dict[str, Any]) -> str:
        best = f"{event['best_speedup']:.2f}x" if event["best_speedup"] > 0 else "-"
        return (f"[{event['stage']}] plan {event['plan']}, {event['attempt']} attempts done, best {best}: "
                f"{event['message']}")

    def __call__(self, event: dict[str, Any]) -> None:
        line = self.format(event)
        if self.tty:
            line = line.splitlines()[0] if line else ""
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()


def run_program(args: argparse.Namespace, config: dict[str, Any] | None = None) -> int:
    """Program mode: the agents' loop on PROBLEM.py (or the run in --resume, with the budget and model it
    was saved with unless the command line gives others). `config`: the resumed run's config.json."""
    from ..errors import StitchError
    from .loop import optimize_problem

    if args.problem is None and args.resume is None:
        return _usage("stitchcuda optimize: give PROBLEM.py (or --resume RUN_DIR)")
    llm = args.llm
    if llm is None:  # --resume alone: the model the run was started with, when it was named by a spec
        config = config if config is not None else _read_json(Path(args.resume) / "config.json") or {}
        llm = config.get("llm_spec") if isinstance(config.get("llm_spec"), str) else None
        if not llm:
            return _usage(f"stitchcuda optimize: {args.resume} does not name its model; give --llm SPEC")
    progress = Progress(sys.stdout)
    try:
        # None: not given, so a new run's default or a resumed run's saved value.
        out = optimize_problem(args.problem, llm, attempts=args.attempts, replans=args.replans,
                               target_speedup=args.target_speedup, wall_s=args.wall_s, tokens=args.tokens,
                               run_dir=args.run_dir, resume=args.resume, prompts_dir=args.prompts,
                               on_event=progress, static_only=True if args.static_only else None,
                               judge=True if getattr(args, "judge", False) else None,
                               timeout=getattr(args, "timeout", None) or None)
    except StitchError as exc:
        return _usage(f"stitchcuda optimize: {_one_line(exc.message)}")
    except (OSError, ImportError, AttributeError, TypeError, ValueError) as exc:  # a python: spec that does not import
        return _usage(f"stitchcuda optimize: {type(exc).__name__}: {_one_line(str(exc))}")
    finally:
        progress.close()
    print(f"run dir      {out['run_dir']}")
    if out["best_attempt"]:
        speed = f"{out['best_speedup']:.3f}x" if out["best_speedup"] > 0 else "not timed"
        print(f"best         {speed} (attempt {out['best_attempt']}, {Path(out['run_dir']) / 'best.py'})")
    else:
        print("best         none: no attempt produced a usable candidate")
    print(f"stop reason  {out['stop_reason']}")
    print(f"attempts     {len(out['attempts'])} over {out['plans']} plan(s); "
          f"{out['usage']['total_tokens']} tokens; {out['wall_s']:.1f} s")
    for note in out["notes"]:
        print(f"note         {note}")
    if out["unverified"]:
        print(UNVERIFIED)
    return EXIT_OK if out["best_attempt"] else EXIT_FAILURE


# ---- stitchcuda runs -----------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _attempt_records(run: Path) -> list[dict[str, Any]]:
    """The finished attempts (attempt.json present), in order."""
    folders = sorted(p for p in (run / "attempts").glob("[0-9]*") if p.is_dir()) if (run / "attempts").is_dir() else []
    records = [_read_json(p / "attempt.json") for p in folders]
    return [r for r in records if isinstance(r, dict)]


def _run_info(run: Path) -> dict[str, Any]:
    """What a run directory says about itself: summary.json when the run ended, else what the attempts show."""
    summary = _read_json(run / "summary.json") or {}
    config = _read_json(run / "config.json") or {}
    records = _attempt_records(run)
    attempts = []
    for r in records:
        report = r.get("report") or {}
        attempts.append({"index": r.get("index"), "plan": r.get("plan"), "skill": r.get("skill"),
                         "feedback_kind": (r.get("feedback") or {}).get("kind", ""),
                         "speedup": report.get("speedup_eager"), "reward": (r.get("reward") or {}).get("value", 0.0),
                         "outcome": report.get("error_kind") or ""})
    for a in attempts:  # summary.json words the outcome best
        for s in summary.get("attempts", []) if isinstance(summary.get("attempts"), list) else []:
            if isinstance(s, dict) and s.get("index") == a["index"]:
                a["outcome"] = s.get("outcome", a["outcome"])
    return {"path": run, "problem": summary.get("problem") or config.get("problem") or "?",
            "attempts": attempts, "finished": bool(summary), "summary": summary,
            "best_speedup": summary.get("best_speedup", 0.0), "best_attempt": summary.get("best_attempt", 0),
            "verified": summary.get("verified"), "stop_reason": summary.get("stop_reason") or "(running or interrupted)",
            "plans": summary.get("plans", 0), "tokens": (summary.get("usage") or {}).get("total_tokens", 0)}


def _is_run(path: Path) -> bool:
    return path.is_dir() and any((path / n).exists() for n in ("config.json", "problem.py", "attempts"))


def _find_run(name: str, root: str) -> Path:
    from ..errors import NotFoundError

    for path in (Path(name), Path(root) / name):
        if _is_run(path):
            return path
    raise NotFoundError(f"no run directory '{name}' (looked in . and {root}/)")


def _speed(info: dict[str, Any]) -> str:
    if not info["best_attempt"]:
        return "-"
    text = f"{info['best_speedup']:.3f}x" if info["best_speedup"] else "untimed"
    return text + (" (unverified)" if info["verified"] is False else "")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip() for r in rows)


def _runs_list(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not root.is_dir():
        return _usage(f"stitchcuda runs list: no folder '{root}'")
    runs = [_run_info(p) for p in sorted(root.iterdir()) if _is_run(p)]
    if not runs:
        print(f"no runs under {root}")
        return EXIT_OK
    rows = [["run", "problem", "attempts", "best", "stop reason"]]
    rows += [[i["path"].name, i["problem"], str(len(i["attempts"])), _speed(i), i["stop_reason"]] for i in runs]
    print(_table(rows))
    return EXIT_OK


SKILLS = {1: "from plan", 2: "from feedback"}


def _runs_show(args: argparse.Namespace) -> int:
    info = _run_info(_find_run(args.run_name, args.root))
    print(f"run          {info['path']}")
    print(f"problem      {info['problem']}")
    print(f"best         {_speed(info)}" + (f" (attempt {info['best_attempt']})" if info["best_attempt"] else ""))
    print(f"stop reason  {info['stop_reason']}")
    print(f"plans        {info['plans']}; tokens {info['tokens']}")
    if info["verified"] is False:
        print(UNVERIFIED)
    if info["attempts"]:
        rows = [["#", "plan", "skill", "feedback", "speed-up", "reward", "outcome"]]
        for a in info["attempts"]:
            rows.append([f"{a['index']:03d}", str(a["plan"]), SKILLS.get(a["skill"], str(a["skill"])),
                         a["feedback_kind"] or "-", f"{a['speedup']:.3f}x" if a["speedup"] else "-",
                         f"{a['reward']:.3f}", _one_line(a["outcome"])[:100]])
        print()
        print(_table(rows))
    return EXIT_OK


DIFF_KEYS = ("problem", "best_speedup", "best_attempt", "verified", "stop_reason", "plans", "tokens")


def _runs_diff(args: argparse.Namespace) -> int:
    a, b = (_run_info(_find_run(name, args.root)) for name in (args.a, args.b))
    texts = []
    for info in (a, b):
        best = info["path"] / "best.py"
        texts.append(best.read_text(encoding="utf-8").splitlines(keepends=True) if best.is_file() else [])
    diff = list(difflib.unified_diff(texts[0], texts[1], fromfile=str(a["path"] / "best.py"),
                                     tofile=str(b["path"] / "best.py")))
    if not texts[0] or not texts[1]:
        missing = [str(i["path"]) for i, t in zip((a, b), texts) if not t]
        print(f"no best.py in {', '.join(missing)}")
    sys.stdout.writelines(diff)
    if diff and not diff[-1].endswith("\n"):
        print()
    if not diff and texts[0] and texts[1]:
        print("best.py: identical")
    print("summary:")
    changed = False
    for key in DIFF_KEYS + ("attempts",):
        va = len(a[key]) if key == "attempts" else a[key]
        vb = len(b[key]) if key == "attempts" else b[key]
        if va != vb:
            changed = True
            print(f"  {key}: {va} -> {vb}")
    if not changed:
        print("  no differences")
    return EXIT_OK


def _guard(run: Callable[[argparse.Namespace], int], what: str) -> Callable[[argparse.Namespace], int]:
    def guarded(args: argparse.Namespace) -> int:
        from ..errors import StitchError

        try:
            return run(args)
        except StitchError as exc:
            return _usage(f"stitchcuda runs {what}: {_one_line(exc.message)}")
    return guarded


def register(commands: argparse._SubParsersAction) -> None:
    """Adds `runs` to the CLI (`optimize` is stitchcuda/graph/cli.py's, in both modes)."""
    runs = commands.add_parser("runs", help="list, show and compare agent run directories")
    runs.set_defaults(run=None, usage_of=runs)
    sub = runs.add_subparsers(dest="runs_command", metavar="COMMAND")
    listing = sub.add_parser("list", help="one line per run: problem, attempts, best speed-up, stop reason")
    listing.add_argument("--root", default="runs", help="folder holding the runs (default runs)")
    listing.set_defaults(run=_guard(_runs_list, "list"))
    show = sub.add_parser("show", help="a run's summary and one line per attempt")
    show.add_argument("run_name", metavar="RUN", help="a run directory, or its name under --root")
    show.add_argument("--root", default="runs", help="folder holding the runs (default runs)")
    show.set_defaults(run=_guard(_runs_show, "show"))
    diff = sub.add_parser("diff", help="unified diff of two runs' best.py, and how their summaries differ")
    diff.add_argument("a", metavar="A", help="a run directory, or its name under --root")
    diff.add_argument("b", metavar="B", help="a run directory, or its name under --root")
    diff.add_argument("--root", default="runs", help="folder holding the runs (default runs)")
    diff.set_defaults(run=_guard(_runs_diff, "diff"))


# ---- small helpers -------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _usage(message: str) -> int:
    print(message, file=sys.stderr)
    return EXIT_USAGE
