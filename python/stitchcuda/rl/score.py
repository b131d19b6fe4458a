"""The reward of one Coder reply on one task, as every trainer interface and the reward service see it:
the code is taken from the reply the way the agents take it, judged by the Verifier (on a GPU, or
statically without one), scored by the Rubric and turned into R the way the agents' loop scores an
attempt (docs/rubric.md, docs/rl.md).

    scored = score_completion("kernelbench/op_gelu_6gb", reply_text, mode="static")
    scored.score, scored.parts["cuda-engineering"], scored.reason

A bad reply is never an exception: no code, code for another task, a compile error, a hack — each is
a score of 0 with its reason. Only a bad configuration raises (InvalidArgumentError).

Without a GPU a candidate can be compiled (NVRTC) and read by the static rules, never run: it is
unverified. Such a candidate earns the reward a verified, correct candidate with the same rubric scores
would earn at a speed-up of 0 — τ·(1 + λ·r̂), the least any verified correct candidate with that
scorecard gets — so a static pass never outscores its own verified result, and a hack still scores 0.
``RewardConfig(static_credit=False)`` makes it 0 ("unverified: no GPU").
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Sequence

from ..errors import InvalidArgumentError, StitchError, UnavailableError
from ..log import redact

__all__ = ["Scored", "RewardConfig", "score_completion", "completion_text", "RUBRIC_ITEMS", "PART_NAMES", "MODES"]

#: The rubric's items, by name (docs/rubric.md).
RUBRIC_ITEMS = ("anti-hacking", "cuda-engineering", "operator-coverage", "skill-compliance")
#: Every key of Scored.parts, always present, always a float (1.0/0.0 for yes/no).
PART_NAMES = ("compiled", "correct", "hack", "verified", "speedup", *RUBRIC_ITEMS, "rubric_total", "r_hat", "lambda")
MODES = ("auto", "gpu", "static")


@dataclass
class RewardConfig:
    """The reward's constants (docs/rubric.md) and how candidates are verified.

    tau, r_max, lambda_plan, lambda_feedback: R = I_correct·(1 − I_hack)·min((s + τ)(1 + λ·r̂), R_max).
    static_credit: an unverified candidate (no GPU) that compiles and passes the static rules earns
    τ·(1 + λ·r̂) (True) or 0 (False). verify: a VerifyConfig or a dict of its fields for GPU checks
    (None: the Verifier's defaults, 5 trials and 100 timed calls, but for ``run_hacks``, which is off here
    unless a dict or a VerifyConfig turns it on: a candidate the source rules judge a hack scores 0 whatever
    it does when run, so it is not run — on a GPU a third of a typical mix of samples, and the ones that
    cost their worker a restart)."""

    tau: float = 0.3
    r_max: float = 5.0
    lambda_plan: float = 1.0
    lambda_feedback: float = 0.7
    static_credit: bool = True
    verify: Any = None

    def __post_init__(self) -> None:
        for name in ("tau", "r_max", "lambda_plan", "lambda_feedback"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidArgumentError(f"RewardConfig.{name} must be a finite number, got {value!r}")
        if self.r_max <= 0 or self.tau < 0:
            raise InvalidArgumentError(f"RewardConfig: r_max must be > 0 and tau >= 0 (got r_max={self.r_max}, "
                                       f"tau={self.tau})")
        for name in ("lambda_plan", "lambda_feedback"):
            if not 0 <= getattr(self, name) <= 2:
                raise InvalidArgumentError(f"RewardConfig.{name} must lie in [0, 2] so that 1 + λ·r̂ stays >= 0, "
                                           f"got {getattr(self, name)}")
        if not isinstance(self.static_credit, bool):
            raise InvalidArgumentError(f"RewardConfig.static_credit must be True or False, got {self.static_credit!r}")
        if self.verify is not None:
            from ..verify import VerifyConfig

            if isinstance(self.verify, Mapping):
                self.verify = VerifyConfig.from_dict({"run_hacks": False, **self.verify}, strict=True)
            elif not isinstance(self.verify, VerifyConfig):
                raise InvalidArgumentError(f"RewardConfig.verify must be a VerifyConfig, a dict of its fields or None, "
                                           f"not {type(self.verify).__name__}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "RewardConfig":
        """From a dict (a trainer's YAML); an unknown key is an error naming the known ones."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidArgumentError(f"RewardConfig has no field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def of(cls, raw: Any, where: str = "config") -> "RewardConfig":
        """A RewardConfig from itself, a dict of its fields or None (the defaults); anything else, or a bad
        field, is InvalidArgumentError naming ``where`` (the request field or option it came from)."""
        if raw is None:
            return cls()
        if isinstance(raw, cls):
            return raw
        if not isinstance(raw, Mapping):
            raise InvalidArgumentError(f"{where} must be a RewardConfig or an object of its fields (tau, r_max, "
                                       f"lambda_plan, lambda_feedback, static_credit, verify), not {type(raw).__name__}")
        try:
            return cls.from_dict(raw)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{where}: {exc.message}") from None
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{where}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verify"] = self.verify.to_dict() if self.verify is not None else None
        return data

    def reward_constants(self) -> dict[str, float]:
        return {"tau": float(self.tau), "r_max": float(self.r_max), "lambda_plan": float(self.lambda_plan),
                "lambda_feedback": float(self.lambda_feedback)}


@dataclass
class Scored:
    """One reply's reward and everything it was made of."""

    score: float                 # the reward R (0.0 on any failure)
    parts: dict[str, float]      # PART_NAMES: compiled, correct, hack, verified, speedup, each rubric item, r_hat...
    reason: str                  # "" unless score == 0, then why ("no code in the reply: ...", "hack: rule", ...)
    verified: bool               # True only when the Verifier ran it on a GPU
    task_id: str
    mode: str = ""               # "gpu" or "static": how it was judged ("" when it never reached the Verifier)
    code: str = ""               # the candidate taken from the reply ("" when there was none)
    findings: list[dict[str, Any]] = field(default_factory=list)  # the Verifier's {rule, severity, message, line}
    feedback: str = ""           # the Verifier's feedback text (what a Skill 2 prompt would show)
    asks: list[str] = field(default_factory=list)  # what the rubric's skill compliance was judged against
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (NaN and infinities become None)."""
        def clean(x: Any) -> Any:
            if isinstance(x, float) and not math.isfinite(x):
                return None
            if isinstance(x, dict):
                return {str(k): clean(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [clean(v) for v in x]
            return x

        return clean(asdict(self))

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> "Scored":
        """The Scored a reward service's reply stands for (to_dict() plus its "service" fields); an item
        the service could not score (its "error") is a zero whose reason starts "not scored:"."""
        if "error" in reply:
            error = reply["error"]
            return cls(score=0.0, parts={p: 0.0 for p in PART_NAMES}, reason=f"not scored: {error.get('kind')}: "
                       f"{error.get('message')}", verified=False, task_id=str(reply.get("task_id", "")))
        return cls(**{f.name: reply[f.name] for f in fields(cls) if f.name in reply})


# ---- inputs -----------------------------------------------------------------------------------------


def completion_text(completion: Any) -> str:
    """The reply's text: a string as it is; a chat (a list of {role, content} messages, or one message)
    its last assistant message (content given as parts: their text joined). Anything else: ""."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        completion = [completion]
    if isinstance(completion, Sequence):
        for message in reversed(list(completion)):
            if isinstance(message, Mapping) and message.get("role", "assistant") == "assistant":
                content = message.get("content", "")
                if isinstance(content, str):
                    return content
                if isinstance(content, Sequence):  # [{"type": "text", "text": ...}, ...]
                    return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
                return ""
    return ""


@dataclass
class _TaskInfo:
    task_id: str
    reference: str
    task: Any = None                        # a stitchcuda.verify.Task, built when first needed
    counts: tuple[int | None, int | None] | None = None
    # A reference that may run in this process: a shipped task's, or a Task the caller built. A dataset
    # row's is not (it may come from a reward service's client): it runs in the sandboxed workers only.
    trusted: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def verify_task(self, mode: str):
        """The Task the Verifier judges against. A static check reads only the reference's source, so it
        gets the source as it is; a GPU check of a trusted reference a Task loaded (in a separate process
        first) and checked; of a row's reference the source alone, which the Verifier's worker loads."""
        from ..verify import Task

        name = self.task_id.replace("/", "__")
        if mode == "static" or not self.trusted:
            return self.task if self.task is not None else Task(name=name, source=self.reference)
        with self.lock:
            if self.task is None:
                self.task = Task.from_source(self.reference, name, isolated=True)
            return self.task

    def input_counts(self) -> tuple[int | None, int | None]:
        """(constructor arguments, forward inputs) of the problem; a row's read from its AST alone."""
        from .problems import input_counts

        with self.lock:
            if self.counts is None:
                self.counts = input_counts(self.reference, load=self.trusted)
            return self.counts


_tasks: dict[str, _TaskInfo] = {}
_tasks_lock = threading.Lock()


def _task_info(task: Any) -> _TaskInfo:
    """The task a reply is scored against: a Task, a dataset row or a shipped task id. InvalidArgumentError
    / NotFoundError say what is wrong (a caller's mistake, not the reply's)."""
    from ..verify import Task

    from .problems import find_task

    counts = None
    if isinstance(task, Task):
        if task.source is None:
            return _TaskInfo(task.name, "", task=task, trusted=True)
        task_id, reference, trusted = task.name, task.source, True
    elif isinstance(task, Mapping):
        task_id, reference = task.get("task_id"), task.get("reference")
        if not isinstance(task_id, str) or not isinstance(reference, str) or not reference.strip():
            raise InvalidArgumentError("a task row needs 'task_id' (a string) and 'reference' (the problem's source); "
                                       f"got keys {sorted(map(str, task))[:10]}")
        try:
            shipped = find_task(task_id)
        except (LookupError, InvalidArgumentError):
            shipped = None
        trusted = shipped is not None and shipped["reference"] == reference  # a shipped task's own row
        if trusted:
            counts = _row_counts(shipped)
    elif isinstance(task, str):
        row = find_task(task)
        task_id, reference, trusted, counts = row["task_id"], row["reference"], True, _row_counts(row)
    else:
        raise InvalidArgumentError(f"task must be a stitchcuda.verify.Task, a dataset row or a task id, not "
                                   f"{type(task).__name__}")
    key = f"{'trusted' if trusted else 'row'}:{task_id}:" + hashlib.sha256(reference.encode("utf-8", "surrogatepass")).hexdigest()
    with _tasks_lock:
        info = _tasks.get(key)
        if info is None:
            info = _tasks[key] = _TaskInfo(task_id, reference, task=task if isinstance(task, Task) else None,
                                           counts=counts, trusted=trusted)
            if len(_tasks) > 4096:  # a long run over generated tasks: keep the newest
                _tasks.pop(next(iter(_tasks)))
        return info


def _row_counts(row: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """A shipped row's input counts (read when the set was loaded; -1 where they could not be told)."""
    return tuple(n if isinstance(n, int) and n >= 0 else None for n in (row["num_init_inputs"], row["num_inputs"]))


def _utf8(text: str) -> str:
    """``text`` with each lone UTF-16 surrogate (no character: JSON lets a client send one) as "?": the
    reply reaches the C++ reader, which takes UTF-8 only, and the score says what the code was."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def _previous(previous: Any) -> tuple[str, dict | None, list[str]]:
    """(candidate, its VerifyReport dict or None, feedback asks) of a Skill 2 revision's starting point:
    {"code" or "candidate": source, "report": VerifyReport dict (optional), "asks": [...] (optional)}."""
    if previous is None:
        return "", None, []
    if isinstance(previous, str):
        return previous, None, []
    if not isinstance(previous, Mapping):
        raise InvalidArgumentError(f"previous must be a dict {{'code', 'report', 'asks'}}, a source string or None, not "
                                   f"{type(previous).__name__}")
    code = previous.get("code") or previous.get("candidate") or ""
    report = previous.get("report")
    if isinstance(report, str) and report.strip():
        try:
            report = json.loads(report)
        except ValueError:
            report = None
    asks = previous.get("asks") or []
    return str(code), report if isinstance(report, Mapping) else None, [str(a) for a in asks]


def asks_of_feedback(feedback: str) -> list[str]:
    """The requests a VerifierAgent's feedback ends with (its "What to do next:" list), as the loop's
    asks: what a Skill 2 revision's compliance is judged against when they are not given."""
    asks: list[str] = []
    lines = (feedback or "").splitlines()
    if "What to do next:" not in lines:
        return asks
    for line in lines[lines.index("What to do next:") + 1:]:
        if not line.startswith("- "):
            break
        asks.append(line[2:].strip())
    return asks


# ---- another task's code ----------------------------------------------------------------------------


def _positional_range(fn: ast.FunctionDef | None) -> tuple[int, float]:
    """(fewest, most) positional arguments a method takes after self (most is inf with *args)."""
    if fn is None:  # nn.Module's own __init__: no arguments
        return 0, 0
    args = fn.args
    positional = [*args.posonlyargs, *args.args][1:]
    required = len(positional) - len(args.defaults)
    return max(required, 0), (math.inf if args.vararg else len(positional))


def wrong_task(code: str, reference: str, counts: tuple[int | None, int | None]) -> str:
    """Why `code` cannot be an answer to the problem `reference` ("" when it may be): its ModelNew cannot
    be built with the problem's constructor arguments or called with its inputs — a reply written for
    another problem. Read from the AST; a file that does not parse is left to the Verifier."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError):
        return ""
    model_new = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelNew"), None)
    if model_new is None:
        return ""
    methods = {n.name: n for n in model_new.body if isinstance(n, ast.FunctionDef)}
    if any(not (isinstance(b, ast.Attribute) and b.attr == "Module" or isinstance(b, ast.Name) and b.id == "Module")
           for b in model_new.bases) and "__init__" not in methods:
        return ""  # inherits a constructor the AST does not show
    n_init, n_inputs = counts
    problems = []
    if n_init is not None:
        low, high = _positional_range(methods.get("__init__"))
        if not low <= n_init <= high:
            problems.append(f"ModelNew.__init__ takes {_takes(low, high)} argument(s), the problem's get_init_inputs() "
                            f"gives {n_init}")
    if n_inputs is not None and "forward" in methods:
        low, high = _positional_range(methods["forward"])
        if not low <= n_inputs <= high:
            problems.append(f"ModelNew.forward takes {_takes(low, high)} input(s), the problem's get_inputs() gives "
                            f"{n_inputs}")
    return "; ".join(problems)


def _takes(low: int, high: float) -> str:
    return str(low) if low == high else (f"{low} or more" if high == math.inf else f"{low} to {int(high)}")


# ---- scoring ------------------------------------------------------------------------------------------


def _gpu_present() -> bool:
    from ..verify.hardware import gpu_present

    return gpu_present()


def _mode(mode: str) -> str:
    if mode not in MODES:
        raise InvalidArgumentError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        return "gpu" if _gpu_present() else "static"
    if mode == "gpu" and not _gpu_present():
        raise UnavailableError("mode='gpu' needs a CUDA GPU and this machine has none; use mode='static' (compile "
                               "and static rules, unverified) or mode='auto'")
    return mode


def _zero(task_id: str, reason: str, attempt: Mapping[str, Any], **extra: Any) -> Scored:
    """A reply that never reached the Verifier: 0, with the rubric's floor (every item 1) in its parts."""
    parts = {name: 0.0 for name in PART_NAMES}
    parts.update(_card_parts(attempt["scorecard"]))
    parts.update(r_hat=float(attempt["reward"]["normalized"]), **{"lambda": float(attempt["reward"]["lambda"])})
    return Scored(score=0.0, parts=parts, reason=reason, verified=False, task_id=task_id, **extra)


def _card_parts(card: Mapping[str, Any]) -> dict[str, float]:
    parts = {item["dimension"]: float(item["score"]) for item in card["items"]}
    parts["rubric_total"] = float(card["total"])
    return parts


def score_completion(task: Any, completion: Any, *, skill: int = 1, previous: dict | None = None,
                     feedback: str = "", mode: str = "auto", config: "RewardConfig | None" = None, pool: Any = None,
                     asks: Sequence[str] | None = None) -> Scored:
    """The reward of `completion` (a reply string, or chat messages: the last assistant message) as an
    answer to `task` (a stitchcuda.verify.Task, a dataset row {task_id, reference, ...} or a shipped task
    id). Never raises for the reply; InvalidArgumentError for a bad mode, skill or config, UnavailableError
    for mode="gpu" without a GPU.

    skill 1 (from the plan) or 2 (revising `previous` — {"code", "report", "asks"} — after `feedback`).
    asks: what the rubric's skill compliance checks (the plan's step titles, or the feedback's requests;
    default for Skill 2: previous["asks"], else the feedback's "What to do next:" list; none for Skill 1). mode: "gpu" (the Verifier runs it: 5 trials,
    timing, every rule), "static" (NVRTC compile and the static rules; unverified), "auto" (gpu when a GPU
    is present). pool: the stitchcuda.verify.WorkerPool to run in (default: the process-wide one)."""
    import time

    started = time.perf_counter()
    if skill not in (1, 2) or isinstance(skill, bool):
        raise InvalidArgumentError(f"skill must be 1 (from the plan) or 2 (from feedback), got {skill!r}")
    config = RewardConfig.of(config)
    mode = _mode(mode)
    info = _task_info(task)
    prev_code, prev_report, prev_asks = _previous(previous)
    prev_code, feedback = _utf8(prev_code), _utf8(feedback or "")
    if asks is not None:
        asks = [_utf8(str(a)) for a in asks]
    else:
        asks = [_utf8(a) for a in (prev_asks or asks_of_feedback(feedback))] if skill == 2 else []
    scored = _score(info, _utf8(completion_text(completion)), skill=skill, prev_code=prev_code, prev_report=prev_report,
                    asks=asks, mode=mode, config=config, pool=pool)
    scored.asks = asks
    scored.reason = redact(scored.reason)  # a reference's or a server's error text may hold a secret
    scored.wall_s = time.perf_counter() - started
    return scored


def _score(info: _TaskInfo, reply: str, *, skill: int, prev_code: str, prev_report: dict | None, asks: list[str],
           mode: str, config: RewardConfig, pool: Any) -> Scored:
    from ..agents import extract_code

    try:
        code = extract_code(reply)["code"]
    except StitchError as exc:
        attempt = _score_attempt("", None, skill, asks, prev_code, prev_report, config)
        return _zero(info.task_id, f"no code in the reply: {exc.message}", attempt)
    if info.reference:
        why = wrong_task(code, info.reference, info.input_counts())
        if why:
            attempt = _score_attempt(code, None, skill, asks, prev_code, prev_report, config)
            return _zero(info.task_id, f"wrong task: {why}", attempt, code=code)
    report = _verify(info, code, mode, config, pool)
    attempt = _score_attempt(code, report, skill, asks, prev_code, prev_report, config)
    card, reward = attempt["scorecard"], attempt["reward"]
    if mode == "static" and config.static_credit and report.compiled and not report.hack and report.error is None:
        reward = _static_reward(card, skill, config)
    parts = {name: 0.0 for name in PART_NAMES}
    parts.update(_card_parts(card))
    speedup = report.speedup.get("eager") if mode == "gpu" else None
    parts.update(compiled=float(report.compiled), correct=float(report.correct and mode == "gpu"),
                 hack=float(report.hack), verified=float(mode == "gpu"), speedup=float(speedup or 0.0),
                 r_hat=float(reward["normalized"]), **{"lambda": float(reward["lambda"])})
    value = float(reward["value"])
    reason = "" if value > 0 else _why_zero(report, reward, mode, config)
    findings = [{"rule": f.rule, "severity": f.severity, "message": f.message, "line": f.line, "evidence": f.evidence}
                for f in report.findings]
    return Scored(score=value, parts=parts, reason=reason, verified=mode == "gpu", task_id=info.task_id, mode=mode,
                  code=code, findings=findings, feedback=report.feedback)


def _verify(info: _TaskInfo, code: str, mode: str, config: RewardConfig, pool: Any):
    """The Verifier's report (a VerifyReport); a broken reference or a failing pool is a report, never raised."""
    from ..verify import VerifyConfig, VerifyReport, check

    source = code if code.endswith("\n") else code + "\n"
    try:
        task = info.verify_task(mode)
    except StitchError as exc:  # the task's reference is broken: the caller's data, said in the reason
        return VerifyReport(static_only=mode == "static").fail("bad-reference", exc.message)
    with _main_hidden:
        return check(task, source, static_only=mode == "static", config=config.verify or VerifyConfig(run_hacks=False),
                     pool=pool)


class _MainHidden:
    """The agents' loop's guard (agents.loop.main_module_hidden) for many threads at once: while any
    check runs — workers start inside it — the __main__ module is hidden from multiprocessing, so a
    training script without an ``if __name__ == "__main__":`` guard is not run again in each worker. The
    first thread in hides it, the last one out restores it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0
        self._guard: Any = None

    def __enter__(self) -> "_MainHidden":
        with self._lock:
            if self._inside == 0:
                from ..agents.loop import main_module_hidden

                self._guard = main_module_hidden().__enter__()
            self._inside += 1
        return self

    def __exit__(self, *exc: Any) -> bool:
        with self._lock:
            self._inside -= 1
            if self._inside == 0 and self._guard is not None:
                self._guard.__exit__(None, None, None)
                self._guard = None
        return False


_main_hidden = _MainHidden()


def _score_attempt(code: str, report: Any, skill: int, asks: list[str], prev_code: str, prev_report: Any,
                   config: RewardConfig) -> dict[str, Any]:
    """The scorecard and reward exactly as the agents' loop scores an attempt (C++ agents::score_attempt):
    the same reading of the candidate's inline CUDA, of the report (static-only: unverified), of the asks."""
    from .. import _C

    def as_json(r: Any) -> str:
        if r is None:
            return ""
        return r.to_json() if hasattr(r, "to_json") else json.dumps(dict(r), default=str)

    previous_json = None
    if skill == 2 and prev_code:
        previous_json = as_json(prev_report) if prev_report is not None else None
    try:
        return _C.agents.score_attempt(code, as_json(report), skill, list(asks), prev_code if skill == 2 and prev_code
                                       else None, previous_json, config.reward_constants())
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"the previous candidate's report cannot be read ({exc.message}); pass the "
                                   "VerifyReport dict of that attempt (attempts/NNN/report.json) or none") from None


def _static_reward(card: Mapping[str, Any], skill: int, config: RewardConfig) -> dict[str, Any]:
    """An unverified pass: the least a verified, correct candidate with this scorecard earns — the reward
    at a speed-up of 0, τ·(1 + λ·r̂)."""
    from .. import _C

    scores = [int(item["score"]) for item in card["items"]]
    outcome = {"compiled": True, "correct": True, "verified": True, "speedup": 0.0, "findings": []}
    return _C.rubric.reward(outcome, scores, skill, config.reward_constants())


def _why_zero(report: Any, reward: Mapping[str, Any], mode: str, config: RewardConfig) -> str:
    error = report.error or {}
    majors = [f.rule for f in report.findings if f.severity == "major"]
    if majors:
        return "hack: " + ", ".join(dict.fromkeys(majors))
    if error.get("kind") == "bad-reference":
        return f"wrong task: the reference cannot be used: {error.get('message', '')}"
    if not report.compiled:
        first = next((line.strip() for line in (report.compile_log or "").splitlines() if line.strip()), "")
        return f"not compiled: {error.get('kind', 'compile')}: {error.get('message', '')}" + (f" {first}" if first else "")
    if mode == "static":
        return "unverified: no GPU"
    if error:
        return f"incorrect: {error.get('kind', '')}: {error.get('message', '')}"
    return "incorrect" if not report.correct else (reward.get("zero_reason") or "zero reward")
