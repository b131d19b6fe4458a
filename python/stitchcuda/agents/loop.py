"""The StitchCUDA optimization loop from Python: a KernelBench problem file and a model in, a run
directory out. The loop itself (Planner, Coder, VerifierAgent, Replanner, Rubric, budgets, run records)
is C++ (``stitchcuda::agents::Optimizer``); this module gives it the machine's description, the
reference's profile and a verify function built on :mod:`stitchcuda.verify`.

    out = stitchcuda.agents.optimize_problem("problems/block_gelu.py", "openai:gpt-4.1", attempts=8)
    print(out["run_dir"], out["best_speedup"], out["stop_reason"])
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import _C
from ..log import get_logger
from ..settings import settings

__all__ = ["PROMPTS_DIR", "hardware", "extract_code", "ProblemPlan", "problem_plan_schema", "PromptLibrary",
           "report_from_json", "optimize_problem", "NO_GPU", "BUDGET_DEFAULTS"]

_native = _C.agents
_log = get_logger(__name__)

#: The prompt templates shipped with the package (planner, coder_plan, coder_feedback, answer_model_new,
#: answer_kernel_step, replanner, verifier).
PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
# The corpus shipped with the package; STITCHCUDA_DOCS_DIR points retrieval at another folder.
CORPUS_DIR = Path(__file__).resolve().parent / "corpus"


def docs_folder() -> Path:
    """The folder the agents retrieve documentation from: STITCHCUDA_DOCS_DIR, else the shipped corpus."""
    return settings().docs_dir or CORPUS_DIR
#: What hardware() calls the machine when there is no GPU: candidates are compiled and checked statically.
NO_GPU = "no GPU (compile-only verification)"

def _gpu_present() -> bool:
    try:
        import torch

        return _C.device_count() > 0 and torch.cuda.is_available()
    except Exception:  # a broken driver is no GPU for this purpose
        _log.debug("no usable GPU: the device query failed", exc_info=True)
        return False


# What the Planner is told of the GPU: the keys the C++ agents' Hardware holds, a subset of the
# Verifier's description (so the DRAM bandwidth in the prompt is the one candidates are judged against).
_PLANNER_KEYS = ("gpu", "arch", "sms", "memory_gib", "dram_tb_s", "fp32_tflops", "tf32_tflops", "cuda")


def hardware() -> dict[str, Any]:
    """The current GPU as the Planner is told of it: {gpu, arch, sms, memory_gib, dram_tb_s, fp32_tflops,
    tf32_tflops, cuda}, read from stitchcuda.verify's description (peaks from the C++ hardware table; 0
    for a GPU it does not know, which the prompt calls unknown); without a GPU, {"gpu": NO_GPU, "cuda": ...}."""
    from ..verify.hardware import describe

    gpu = describe()
    if gpu["gpu"] is None:
        return {"gpu": NO_GPU, "cuda": gpu["cuda"]}
    return {k: gpu[k] for k in _PLANNER_KEYS}


def extract_code(reply: str, finish_reason: str = "") -> dict[str, Any]:
    """The candidate in a Coder's reply: {code, blocks: [{language, code, line, closed}], truncated, notes}.
    LLMError says what to ask the model when there is none (no ModelNew, a cut-off block, an empty reply)."""
    return _native.extract_code(reply, finish_reason)


def problem_plan_schema() -> dict[str, Any]:
    """The JSON Schema a Planner's ProblemPlan follows."""
    return json.loads(_native.problem_plan_schema())


def report_from_json(text: str) -> dict[str, Any]:
    """What the agents read of a VerifyReport JSON (compiled, correct, static_only, speed-ups, findings,
    error_kind, mismatches, bottleneck...): the C++ ``Report::from_json``."""
    return _native.report_from_json(text)


@dataclass
class ProblemPlan:
    """The Planner's validated plan for one problem (not graph mode's GraphPlan, not a Program's buffer
    plan): summary, steps [{title, detail}], fusion_groups [{ops, kernel, rationale}], bottlenecks,
    risks, constraints; ``text`` is the numbered form the Coder reads."""

    summary: str
    steps: list[dict[str, str]]
    fusion_groups: list[dict[str, Any]] = field(default_factory=list)
    bottlenecks: list[str] = field(default_factory=list)
    risks: list[str] = field(default_factory=list)
    constraints: list[str] = field(default_factory=list)
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> "ProblemPlan":
        """A plan from a reply (JSON, possibly inside prose or a ```json fence); InvalidArgumentError lists
        every schema violation."""
        as_json, described = _native.problem_plan_parse(text)
        data = json.loads(as_json)
        return cls(summary=data.get("summary", ""), steps=list(data.get("steps", [])),
                   fusion_groups=list(data.get("fusion_groups", [])), bottlenecks=list(data.get("bottlenecks", [])),
                   risks=list(data.get("risks", [])), constraints=list(data.get("constraints", [])), text=described)

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary, "steps": self.steps, "fusion_groups": self.fusion_groups,
                "bottlenecks": self.bottlenecks, "risks": self.risks, "constraints": self.constraints}


class PromptLibrary:
    """The agents' prompt templates: a folder of ``<name>.md`` (default: the shipped one), with the files
    of ``override_dir`` replacing those of the same name."""

    def __init__(self, native: Any) -> None:
        self._lib = native

    @classmethod
    def load(cls, folder: str | os.PathLike = PROMPTS_DIR, override_dir: str | os.PathLike | None = None) -> "PromptLibrary":
        return cls(_native.PromptLibrary.load(os.fspath(folder), os.fspath(override_dir) if override_dir else ""))

    def prompts(self) -> dict[str, dict[str, str]]:
        """{name: {version, sha256, path, text}}."""
        return self._lib.prompts()

    def render(self, name: str, **values: str) -> str:
        """The template filled in; every placeholder needs a value ("" for none)."""
        return self._lib.render(name, {k: str(v) for k, v in values.items()})


# ---- the loop -----------------------------------------------------------------------------------


# The call options of a connected Backend the agents pass on to every call they make.
_CALL_OPTIONS = ("temperature", "top_p", "max_tokens", "seed", "timeout")


def _native_backend(llm: Any) -> tuple[Any, str, dict[str, Any]]:
    """(the native backend, its name for the config, the call options it was connected with)."""
    from .. import llm as llm_module

    if isinstance(llm, _C.LlmBackend):
        return llm, llm.name, {}
    backend = llm if isinstance(llm, llm_module.Backend) else llm_module.connect(llm)
    defaults = {k: v for k, v in backend._defaults.items() if k in _CALL_OPTIONS and v is not None}
    return backend._native, backend.name, defaults


def _profile_text(task: Any, name: str) -> tuple[str, str]:
    """(the reference's profile as text, a note when there is none)."""
    try:
        import torch

        from .. import profile

        model = task.build_reference(0).cuda().eval()
        inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in task.make_inputs(0)]
        with torch.no_grad():
            return str(profile.profile(model, *inputs, title=name)), ""
    except Exception as exc:  # the loop runs without a profile; the Planner is told less
        return "", f"the reference was not profiled: {type(exc).__name__}: {exc}"


def _verify_config(config: Any) -> Any:
    from ..verify import VerifyConfig

    if config is None or isinstance(config, VerifyConfig):
        return config or VerifyConfig()
    if isinstance(config, Mapping):
        return VerifyConfig.from_dict(dict(config))
    raise TypeError(f"verify_config must be a VerifyConfig or a dict, got {type(config).__name__}")


def _saved_config(run_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


#: A new run's budget where the caller names none (0 = no limit).
BUDGET_DEFAULTS: dict[str, Any] = {"attempts": 8, "replans": 2, "target_speedup": 0.0, "wall_s": 0.0, "tokens": 0}
_BUDGET_TYPES = {"attempts": int, "replans": int, "target_speedup": float, "wall_s": float, "tokens": int,
                 "replan_after_failures": int, "stagnation": int}


def _budget(given: Mapping[str, Any], saved: Mapping[str, Any] | None) -> dict[str, Any]:
    """The budget a run keeps: what the caller gave, else (resuming) what the run was saved with, else
    the defaults. A resumed run made with attempts=1 stays at one attempt unless told otherwise."""
    budget: dict[str, Any] = dict(BUDGET_DEFAULTS)
    for key, kind in _BUDGET_TYPES.items():
        value = (saved or {}).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            budget[key] = kind(value)
    for key, value in given.items():
        if value is not None:
            budget[key] = _BUDGET_TYPES[key](value)
    return budget


class main_module_hidden:
    """While verification workers are spawned, hides the __main__ module from multiprocessing (its
    ``__file__`` and ``__spec__``), so a child does not run the user's script again: one without an
    ``if __name__ == "__main__":`` guard would start the optimization over in every worker and fail with
    multiprocessing's bootstrapping error. Workers run only stitchcuda's own code; they never need it."""

    _KEYS = ("__file__", "__spec__")

    def __enter__(self) -> "main_module_hidden":
        import sys

        self.main = sys.modules.get("__main__")
        self.saved = {k: getattr(self.main, k) for k in self._KEYS if hasattr(self.main, k)}
        if "__file__" in self.saved:
            del self.main.__file__
        if "__spec__" in self.saved:
            self.main.__spec__ = None
        return self

    def __exit__(self, *exc) -> bool:
        for key, value in self.saved.items():
            setattr(self.main, key, value)
        return False


def optimize_problem(problem_path: str | os.PathLike | None, llm: Any, *, attempts: int | None = None,
                     replans: int | None = None, target_speedup: float | None = None, wall_s: float | None = None,
                     tokens: int | None = None,
                     run_dir: str | os.PathLike | None = None, resume: str | os.PathLike | None = None,
                     prompts_dir: str | os.PathLike | None = None,
                     on_event: Callable[[dict[str, Any]], Any] | None = None,
                     verify_config: Any = None, static_only: bool | None = None,
                     judge: bool | None = None, timeout: float | None = None) -> dict[str, Any]:
    """Runs the StitchCUDA loop on a KernelBench-format problem file and returns the outcome.

    ``llm``: a spec string (``openai:gpt-4.1``, ``scripted:rules.json``, ``python:module:fn``), a
    :class:`stitchcuda.llm.Backend` or a callable. ``run_dir``: where the run is recorded (default
    ``runs/<UTC time>-<problem>``); ``resume``: a run directory to continue (its finished attempts count
    against the budget; ``problem_path`` may be None: the run's problem.py is used). The budget
    (``attempts`` 8, ``replans`` 2, ``target_speedup``, ``wall_s`` and ``tokens`` none, by default) of a
    resumed run is the one saved in its config.json, each value given here replacing its saved one; tokens
    count every call of the run, those before the resume too. ``prompts_dir``: a
    folder whose ``<name>.md`` files replace the shipped prompts. ``on_event`` receives {stage, attempt,
    plan, best_speedup, message} as the loop goes. ``verify_config``: a VerifyConfig (or dict) for GPU
    verification. ``static_only``: True compiles and checks candidates statically even where a GPU is
    present (None: only where there is none). ``judge``: True also asks the model to review each
    attempt's rubric items (prompts/rubric_judge.md; it may lower anti-hacking with a reason, never raise
    it; a failed judge leaves the deterministic items); off by default, a resumed run keeps its setting.
    ``timeout``: seconds one model call may take, retries included (default: the backend's, 600); with a
    ``wall_s`` budget no call may take longer than the whole budget either.

    With a GPU, each candidate is verified in a worker pool made for the run (correctness trials, timing,
    anti-hacking rules) and the reference is profiled for the Planner. Without one, candidates are
    compiled with NVRTC and checked statically only: the outcome has ``unverified`` True.

    Returns {run_dir, best, best_attempt, best_speedup, verified, unverified, stop_reason, plans, usage,
    wall_s, overhead_s, attempts: [attempt records], summary, hardware, notes}. Raises InvalidArgumentError
    for an unusable problem or budget, NotFoundError for a missing run directory to resume.
    """
    from ..errors import InvalidArgumentError
    from ..verify import Task, check

    if resume is not None:
        resume_dir = Path(resume)
        if not resume_dir.is_dir():
            from ..errors import NotFoundError
            raise NotFoundError(f"run directory '{resume}' does not exist")
        if problem_path is None:
            problem_path = resume_dir / "problem.py"
    if problem_path is None:
        raise InvalidArgumentError("optimize_problem needs a problem file (or resume= a run directory)")
    path = Path(problem_path)
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"cannot read the problem {os.fspath(path)!r}: {exc}") from None
    name = path.stem
    if resume is not None:
        name = _saved_config(Path(resume)).get("problem") or name
    task = Task.from_source(source, name, filename=os.fspath(path), isolated=True)  # TaskError names what is wrong

    notes: list[str] = []
    gpu = _gpu_present() and not static_only
    machine = hardware()
    profile_text = ""
    if gpu:
        profile_text, note = _profile_text(task, name)
        if note:
            notes.append(note)
    else:
        notes.append("static verification only: candidates are compiled with NVRTC and checked, never run")

    backend, llm_record, call_options = _native_backend(llm)
    config = _verify_config(verify_config) if gpu else None
    pool = None
    if gpu:
        from ..verify import WorkerPool

        pool = WorkerPool()

        def verify(candidate: str) -> str:
            with main_module_hidden():  # workers start lazily, inside check
                return check(task, candidate if "\n" in candidate else candidate + "\n", config=config,
                             pool=pool).to_json()
    else:
        def verify(candidate: str) -> str:
            return check(task, candidate if "\n" in candidate else candidate + "\n", static_only=True).to_json()

    saved_budget = _saved_config(Path(resume)).get("budget") if resume is not None else None
    budget = _budget({"attempts": attempts, "replans": replans, "target_speedup": target_speedup, "wall_s": wall_s,
                      "tokens": tokens}, saved_budget if isinstance(saved_budget, dict) else None)
    if judge is None:
        judge = bool(_saved_config(Path(resume)).get("judge", False)) if resume is not None else False
    if timeout is not None:
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
        call_options = {**call_options, "timeout": float(timeout)}
    if budget.get("wall_s"):  # an in-flight call must not outlive the run's wall-time budget
        call_options = {**call_options, "timeout": min(float(call_options.get("timeout") or 600.0),
                                                       float(budget["wall_s"]))}
    options = {"prompts_dir": os.fspath(PROMPTS_DIR), "prompts_override": os.fspath(prompts_dir) if prompts_dir else "",
               "judge": bool(judge),
               "docs_dir": os.fspath(docs_folder()),
               **call_options}
    run_config = {"mode": "program", "problem": name, "problem_path": os.fspath(path.resolve()), "llm": llm_record,
                  "llm_spec": llm if isinstance(llm, str) else None, "budget": budget, "judge": bool(judge),
                  "prompts_override": options["prompts_override"], "docs_dir": options["docs_dir"],
                  "call_options": call_options,
                  "hardware": machine, "verify": config.to_dict() if config else {"static_only": True},
                  "stitchcuda": _C.version()}
    problem = {"name": name, "reference": source, "profile": profile_text, "hardware": machine}
    try:
        outcome = _native.optimize(problem, backend, verify, budget,
                                   os.fspath(resume if resume is not None else (run_dir or "")),
                                   json.dumps(run_config, default=str), resume is not None, on_event, options)
    finally:
        if pool is not None:
            pool.close()
    outcome["unverified"] = not outcome["verified"]
    outcome["hardware"] = machine
    outcome["notes"] = notes + list(outcome.get("notes", []))
    return outcome
