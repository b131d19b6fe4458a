"""`stitchcuda optimize --mode program PROBLEM.py --llm SPEC`: the agent loop from the command line (the
`optimize` parser and its --mode choice live in stitchcuda/graph/cli.py, which calls run_program here),
and `stitchcuda runs list|show|diff`: what the run directories hold.

Exit codes (docs/cli.md): 0 a run finished with a usable candidate (or a runs command worked), 1 a run found
none or its model backend failed (no API key, no server, an error reply), 2 usage errors (bad arguments, an
unreadable problem, an unknown model spec, a missing run directory), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from ..cli_support import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, BackendError, UsageError, one_line,
                           refuse)
from .run_dir import FAILED, RunDir, read_json  # the run directory's format

# How long `--llm` may take to show that its server answers a TCP connection before any work starts.
LLM_REACH_TIMEOUT_S = 5.0
UNVERIFIED = "UNVERIFIED (no GPU: compile and static checks only)"


# ---- --llm SPEC, in both modes of `optimize` ----------------------------------------------------

def check_llm(spec: str, timeout_s: float = LLM_REACH_TIMEOUT_S) -> str:
    """Checks an `--llm` spec before any work, sending no request: a spec that does not parse, names an
    unknown provider, a `python:` module that does not import or a replay/scripted file that cannot be read
    is a UsageError; a missing API key, or a server named by URL that accepts no TCP connection within
    `timeout_s`, is a BackendError. Returns the backend's name. A hosted API (no URL in the spec) is checked
    for its key only: whether it answers shows at the first call."""
    from .. import llm
    from ..errors import InvalidArgumentError, NotFoundError, StitchError, StitchIOError

    try:
        base_url = "" if spec.startswith("python:") else llm.parse_spec(spec).base_url
        backend = llm.connect(spec)
    except (InvalidArgumentError, NotFoundError, StitchIOError) as exc:
        raise UsageError(f"--llm {spec}: {one_line(exc.message)}") from None
    except StitchError as exc:  # a missing key
        raise BackendError(f"--llm {spec}: {one_line(exc.message)}") from None
    if base_url:
        _reachable(spec, base_url, timeout_s)
    return backend.name


def _reachable(spec: str, url: str, timeout_s: float) -> None:
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise UsageError(f"--llm {spec}: the URL's port is not a number") from None
    loopback = host in ("localhost", "127.0.0.1", "::1")
    if not loopback and any(os.environ.get(v) for v in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY",
                                                         "all_proxy", "ALL_PROXY")):
        return  # the HTTP client goes through the proxy: a direct connection says nothing about it
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        why = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
        raise BackendError(f"--llm {spec}: the server at {parts.scheme}://{parts.netloc} is not reachable ({why}, "
                           f"within {timeout_s:g} s): start it, or fix the URL") from None


# ---- stitchcuda optimize --mode program ------------------------------------------------------------


def interrupted(run_dir: str | Path | None, what: str = "stitchcuda optimize") -> int:
    """After Ctrl-C: says where the run is kept and how to continue it (or that nothing was recorded);
    returns the shell's code for a SIGINT."""
    if run_dir is not None and (Path(run_dir) / "config.json").is_file():
        print(f"{what}: interrupted. The run is kept in {run_dir}; continue it with\n"
              f"  stitchcuda optimize --resume {run_dir}", file=sys.stderr)
    else:
        print(f"{what}: interrupted before the run was recorded: nothing to resume, run the command again",
              file=sys.stderr)
    return EXIT_INTERRUPTED


def run_program(args: argparse.Namespace, config: dict[str, Any] | None = None) -> int:
    """Program mode: the agents' loop on PROBLEM.py (or the run in --resume, with the budget and model it
    was saved with unless the command line gives others). `config`: the resumed run's config.json."""
    from ..errors import InvalidArgumentError, StitchError
    from .loop import optimize_problem

    if args.problem is None and args.resume is None:
        return _usage("stitchcuda optimize: give PROBLEM.py (or --resume RUN_DIR)")
    llm = args.llm
    if llm is None:  # --resume alone: the model the run was started with, when it was named by a spec
        config = config if config is not None else _read_json(Path(args.resume) / "config.json") or {}
        llm = config.get("llm_spec") if isinstance(config.get("llm_spec"), str) else None
        if not llm:
            return _usage(f"stitchcuda optimize: {args.resume} does not name its model; give --llm SPEC")
    try:  # before any work: a model the loop cannot reach is known now, not after the first plan
        check_llm(llm)
    except UsageError as exc:
        return _usage(f"stitchcuda optimize: {exc}")
    except BackendError as exc:
        return _usage(f"stitchcuda optimize: {exc}", EXIT_FAILURE)
    if args.problem is not None:  # the loop reads it again; bounded and imported apart here first
        from ..verify.cli import load_problem

        try:
            load_problem(args.problem)
        except UsageError as exc:
            return _usage(f"stitchcuda optimize: {exc}")
    from .. import _C
    from ..log import LoopProgress

    # Named here, not left to the loop, so that a Ctrl-C can say which folder to resume.
    run_dir = args.resume or args.run_dir or _C.agents.fresh_run_path("runs", Path(args.problem).stem)
    if args.resume is not None:  # the failure it was resumed from is no longer its state
        (Path(run_dir) / FAILED).unlink(missing_ok=True)
    progress = LoopProgress(run_dir, attempts=args.attempts)
    try:
        # None: not given, so a new run's default or a resumed run's saved value.
        out = optimize_problem(args.problem, llm, attempts=args.attempts, replans=args.replans,
                               target_speedup=args.target_speedup, wall_s=args.wall_s, tokens=args.tokens,
                               run_dir=run_dir, resume=args.resume, prompts_dir=args.prompts,
                               on_event=progress, static_only=True if args.static_only else None,
                               judge=True if getattr(args, "judge", False) else None,
                               timeout=getattr(args, "timeout", None) or None)
    except InvalidArgumentError as exc:  # the problem, the run directory, the options
        return _usage(f"stitchcuda optimize: {one_line(exc.message)}")
    except StitchError as exc:  # the model backend or the loop failed (no plan, no reply): the answer is no
        return _failed_run(run_dir, f"stitchcuda optimize: {one_line(exc.message)}")
    except (OSError, ImportError, AttributeError, TypeError, ValueError) as exc:  # a python: spec that does not import
        return _usage(f"stitchcuda optimize: {type(exc).__name__}: {one_line(str(exc))}")
    except KeyboardInterrupt:
        progress.close()
        return interrupted(run_dir)
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


def _failed_run(run_dir: str | Path, message: str) -> int:
    """The loop ended on an error (the model backend, the loop itself): says so, and records it in the run
    directory, which has no summary.json, so that `runs list` tells it from a run still going or killed."""
    command, _, why = message.partition(": ")
    if (Path(run_dir) / "config.json").is_file():
        import datetime

        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        try:
            (Path(run_dir) / FAILED).write_text(json.dumps({"error": why, "time": when}) + "\n", encoding="utf-8")
        except OSError:
            pass  # the message below is what matters; the run directory only repeats it
        why += f" (the run is kept in {run_dir}; continue it with stitchcuda optimize --resume {run_dir})"
    return refuse(command, why, EXIT_FAILURE)


# ---- stitchcuda runs -----------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    return read_json(path)


def _attempt_records(run: Path) -> list[dict[str, Any]]:
    """The finished attempts (attempt.json present), in order."""
    return RunDir(run).attempts()


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
    graph_model = config.get("model") if config.get("mode") == "graph" else None  # graph runs name the nn.Module
    return {"path": run, "problem": summary.get("problem") or config.get("problem") or graph_model or "?",
            "date": _run_date(run), "model": _llm_name(config), "mode": config.get("mode") or "",
            "attempts": attempts, "finished": bool(summary), "summary": summary,
            "best_speedup": summary.get("best_speedup", 0.0), "best_attempt": summary.get("best_attempt", 0),
            "verified": summary.get("verified"), "stop_reason": summary.get("stop_reason") or _unfinished(run),
            "plans": summary.get("plans", 0), "tokens": (summary.get("usage") or {}).get("total_tokens", 0)}


def _unfinished(run: Path) -> str:
    """The stop reason of a run without summary.json: the error it failed on, else still going or killed."""
    failed = _read_json(run / FAILED)
    if isinstance(failed, dict) and failed.get("error"):
        return f"failed: {one_line(failed['error'])}"
    return "(running or interrupted)"


def _run_date(run: Path) -> str:
    """When the run started, in UTC ISO 8601: from its name when it was named by default
    (runs/<yyyymmdd-hhmmss>-<problem>), else from when its config.json was written; "" if neither."""
    import datetime
    import re

    m = re.match(r"(\d{4})(\d{2})(\d{2})-(\d{2})(\d{2})(\d{2})(?:-|$)", run.name)
    if m:
        y, mo, d, h, mi, sec = m.groups()
        return f"{y}-{mo}-{d}T{h}:{mi}:{sec}Z"
    for name in ("config.json", "problem.py"):
        if (run / name).is_file():
            when = datetime.datetime.fromtimestamp((run / name).stat().st_mtime, datetime.timezone.utc)
            return when.strftime("%Y-%m-%dT%H:%M:%SZ")
    return ""


def _llm_name(config: dict[str, Any]) -> str:
    """The model a run used, as it was asked for (the spec, e.g. openai:gpt-4.1), else the backend's name."""
    spec = config.get("llm_spec")
    if isinstance(spec, str) and spec:
        return spec
    return str(config.get("llm") or "?")


def _run_json(info: dict[str, Any], attempts: bool = False) -> dict[str, Any]:
    """A run as `runs list --json` / `runs show --json` print it."""
    out = {"run": info["path"].name, "path": str(info["path"]), "date": info["date"], "model": info["model"],
           "mode": info["mode"], "problem": info["problem"], "attempts": len(info["attempts"]),
           "best_speedup": info["best_speedup"], "best_attempt": info["best_attempt"], "verified": info["verified"],
           "finished": info["finished"], "stop_reason": info["stop_reason"], "plans": info["plans"],
           "tokens": info["tokens"]}
    if attempts:
        out["attempt_records"] = info["attempts"]
    return out


def _is_run(path: Path) -> bool:
    return RunDir.is_run(path)


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
    root = Path(args.root or "runs")
    if args.root is not None and not root.is_dir():  # a folder named on purpose must exist
        return refuse("stitchcuda runs list", f"no folder '{root}'", EXIT_USAGE, args.json)
    # No runs folder yet (the default, nothing run here): no runs, not an error.
    runs = [_run_info(p) for p in sorted(root.iterdir()) if _is_run(p)] if root.is_dir() else []
    if args.json:
        print(json.dumps([_run_json(i) for i in runs]))
        return EXIT_OK
    if not runs:
        print(f"no runs under {root}")
        return EXIT_OK
    rows = [["run", "problem", "attempts", "best", "date (UTC)", "model", "stop reason"]]
    rows += [[i["path"].name, i["problem"], str(len(i["attempts"])), _speed(i),
              i["date"].replace("T", " ")[:16] or "-", i["model"], i["stop_reason"]] for i in runs]
    print(_table(rows))
    return EXIT_OK


SKILLS = {1: "from plan", 2: "from feedback"}


def _runs_show(args: argparse.Namespace) -> int:
    info = _run_info(_find_run(args.run_name, args.root))
    if getattr(args, "json", False):
        print(json.dumps(_run_json(info, attempts=True)))
        return EXIT_OK
    print(f"run          {info['path']}")
    print(f"problem      {info['problem']}")
    print(f"model        {info['model']}")
    print(f"date         {info['date'].replace('T', ' ').removesuffix('Z') + ' UTC' if info['date'] else '-'}")
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
                         f"{a['reward']:.3f}", one_line(a["outcome"])[:100]])
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
            return refuse(f"stitchcuda runs {what}", one_line(exc.message), EXIT_USAGE, getattr(args, "json", False))
    return guarded


def register(commands: argparse._SubParsersAction) -> None:
    """Adds `runs` to the CLI (`optimize` is stitchcuda/graph/cli.py's, in both modes)."""
    runs = commands.add_parser("runs", help="list, show and compare agent run directories")
    runs.set_defaults(run=None, usage_of=runs)
    sub = runs.add_subparsers(dest="runs_command", metavar="COMMAND")
    listing = sub.add_parser("list", help="one line per run: problem, attempts, best speed-up, date, model, "
                                          "stop reason")
    listing.add_argument("--root", default=None, help="folder holding the runs (default runs; when it does not "
                                                      "exist there are no runs)")
    listing.add_argument("--json", action="store_true", help="print a JSON array, one object per run")
    listing.set_defaults(run=_guard(_runs_list, "list"))
    show = sub.add_parser("show", help="a run's summary and one line per attempt")
    show.add_argument("run_name", metavar="RUN", help="a run directory, or its name under --root")
    show.add_argument("--root", default="runs", help="folder holding the runs (default runs)")
    show.add_argument("--json", action="store_true", help="print one JSON object, the attempts included")
    show.set_defaults(run=_guard(_runs_show, "show"))
    diff = sub.add_parser("diff", help="unified diff of two runs' best.py, and how their summaries differ")
    diff.add_argument("a", metavar="A", help="a run directory, or its name under --root")
    diff.add_argument("b", metavar="B", help="a run directory, or its name under --root")
    diff.add_argument("--root", default="runs", help="folder holding the runs (default runs)")
    diff.set_defaults(run=_guard(_runs_diff, "diff"))


# ---- small helpers -------------------------------------------------------------------------------


def _usage(message: str, code: int = EXIT_USAGE) -> int:
    """`stitchcuda optimize: why` / `stitchcuda runs list: why` on stderr; returns `code`."""
    command, _, why = message.partition(": ")
    return refuse(command, why, code)
