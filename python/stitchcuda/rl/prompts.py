"""The Coder's prompts as training data: Skill 1 (write from a plan) for every task, Skill 2 (revise a
candidate after the Verifier's feedback) from the attempts recorded in run directories. Each prompt is
rendered by the agents' own Coder (C++ ``Coder::prompt``, the first message ``Coder::write`` sends), from
the shipped prompt files, so a policy trains on exactly the text the agents send.

Each row: ``prompt`` (chat messages), and the columns the reward reads — task_id, reference, skill,
plan (ProblemPlan JSON), asks (what skill compliance is judged against), previous ({code, report, asks}),
feedback — plus prompt_name, prompt_sha256, snippets, set, level, class.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import InvalidArgumentError, NotFoundError

__all__ = ["offline_plan", "coder_prompt", "skill1_rows", "skill2_rows", "skill1_dataset", "skill2_dataset",
           "EMPTY_PREVIOUS"]

#: Skill 1 rows' ``previous`` (one column type for both skills).
EMPTY_PREVIOUS: dict[str, Any] = {"code": "", "report": "", "asks": []}

# Operators by what a kernel does with them, for the offline plan's wording.
_ELEMENTWISE = {"relu", "gelu", "silu", "sigmoid", "tanh", "add", "mul", "sub", "div", "clamp", "where", "exp", "log",
                "softplus", "hardswish", "hardtanh", "leaky_relu", "relu6", "dropout", "abs", "pow", "sqrt", "rsqrt",
                "neg", "maximum", "minimum", "erf", "elu", "mish", "scale"}
_REDUCTIONS = {"sum", "mean", "amax", "max", "min", "argmax", "argmin", "softmax", "log_softmax", "logsumexp",
               "layer_norm", "rms_norm", "group_norm", "batch_norm", "norm", "cumsum", "var", "std",
               "cross_entropy", "kl_div", "huber_loss", "LayerNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d",
               "BatchNorm3d", "RMSNorm", "Softmax"}
_LIBRARY = {"matmul", "mm", "bmm", "linear", "addmm", "einsum", "conv1d", "conv2d", "conv3d", "conv_transpose2d",
            "scaled_dot_product_attention", "Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose2d",
            "ConvTranspose3d", "MultiheadAttention", "LSTM", "GRU"}


def _operators(reference: str) -> list[str]:
    """The operators Model uses, in order of appearance: its submodules' classes and forward's calls."""
    try:
        tree = ast.parse(reference)
    except SyntaxError:
        return []
    model = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model"), None)
    if model is None:
        return []
    seen: list[str] = []

    def add(name: str) -> None:
        if name and name not in seen:
            seen.append(name)

    for node in ast.walk(model):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in _ELEMENTWISE | _REDUCTIONS | _LIBRARY:
                add(name)
        elif isinstance(node, ast.BinOp):
            add({ast.Add: "add", ast.Mult: "mul", ast.Sub: "sub", ast.Div: "div", ast.MatMult: "matmul"}
                .get(type(node.op), ""))
    return seen


def offline_plan(reference: str) -> dict[str, Any]:
    """A ProblemPlan for a task no Planner has planned yet, read from the reference's source: the
    heavy operators to give custom kernels (or a library call with a fused epilogue), the elementwise
    chain to fuse, and the correctness rules every plan carries. It names no technique the problem does
    not call for, so skill compliance judges the candidate against what the problem is."""
    ops = _operators(reference)
    library = [o for o in ops if o in _LIBRARY]
    reductions = [o for o in ops if o in _REDUCTIONS]
    pointwise = [o for o in ops if o in _ELEMENTWISE]
    steps: list[dict[str, str]] = []
    if library:
        steps.append({"title": f"Compute {', '.join(library)} with a custom kernel or a library call whose result "
                               "a custom kernel consumes",
                      "detail": "Tile the GEMM or convolution for reuse in shared memory, or call cuBLAS and fuse the "
                                "work that follows into its epilogue kernel."})
    if reductions:
        steps.append({"title": f"Write a custom reduction kernel for {', '.join(reductions)}",
                      "detail": "One block (or warp) per row; reduce with warp shuffles, accumulate in fp32."})
    if len(pointwise) == 1 and len(ops) > 1:
        steps.append({"title": f"Apply {pointwise[0]} in the kernel that produces its input",
                      "detail": "While the value is still in registers: no separate pass over memory."})
    elif pointwise:
        steps.append({"title": f"Fuse the elementwise operators {', '.join(pointwise)} into one kernel",
                      "detail": "Apply them to each element while it is in registers, after the producing kernel; "
                                "use float4 loads where the row length allows."})
    if not steps:
        steps.append({"title": "Implement the forward pass in custom CUDA kernels",
                      "detail": "One kernel per fusion group; sizes from the input shapes."})
    steps.append({"title": "Guard every index against the tensor bounds and take sizes from the input shapes",
                  "detail": "Handle sizes that are not multiples of the block or tile."})
    groups = [{"ops": pointwise, "kernel": "fused_elementwise",
               "rationale": "each intermediate stays in registers instead of a DRAM round trip"}] if len(pointwise) > 1 else []
    summary = ("Replace the reference's operators (" + (", ".join(ops) if ops else "its forward pass") +
               ") with custom CUDA kernels, fusing what can share one pass over memory.")
    return {"summary": summary, "steps": steps, "fusion_groups": groups,
            "bottlenecks": ["DRAM bandwidth" if not library else "the GEMM or convolution's arithmetic"],
            "risks": ["reductions in low precision", "sizes that are not multiples of the tile"],
            "constraints": ["fp32 outputs within 1e-4 of the reference", "no torch operator computes the answer"]}


def _hardware(hardware: Mapping[str, Any] | None) -> dict[str, Any]:
    from ..agents import hardware as this_machine

    keys = ("gpu", "arch", "sms", "memory_gib", "dram_tb_s", "fp32_tflops", "tf32_tflops", "cuda")
    return {k: v for k, v in dict(hardware if hardware is not None else this_machine()).items() if k in keys}


def _docs_dir(docs: bool | str | os.PathLike) -> str:
    if docs is False:
        return ""
    if docs is True:
        from ..agents import docs_folder

        return os.fspath(docs_folder())
    return os.fspath(docs)


def coder_prompt(reference: str, *, name: str = "problem", skill: int = 1, plan: Mapping[str, Any] | str | None = None,
                 previous: str = "", feedback: str = "", hardware: Mapping[str, Any] | None = None,
                 docs: bool | str | os.PathLike = True, prompts_dir: str | os.PathLike | None = None,
                 doc_snippets: int = 3) -> dict[str, Any]:
    """The Coder's first prompt, rendered by the agents' Coder: {text, prompt_name, prompt_sha256,
    snippets}. Skill 1 needs a plan (a ProblemPlan dict or JSON; default offline_plan(reference)); Skill 2
    the previous candidate and the feedback. hardware: as agents.hardware() gives it (default: this
    machine's, as the agents would say); docs: retrieval from the shipped corpus (True), a folder, or none
    (False); prompts_dir: a folder of prompt files replacing the shipped ones of the same name."""
    from .. import _C
    from ..agents import PROMPTS_DIR

    if skill not in (1, 2):
        raise InvalidArgumentError(f"skill must be 1 (from the plan) or 2 (from feedback), got {skill!r}")
    if plan is None and skill == 1:
        plan = offline_plan(reference)
    plan_text = plan if isinstance(plan, str) else json.dumps(plan) if plan is not None else ""
    problem = {"name": name, "reference": reference, "hardware": _hardware(hardware)}
    options = {"prompts_dir": os.fspath(PROMPTS_DIR), "prompts_override": os.fspath(prompts_dir) if prompts_dir else "",
               "docs_dir": _docs_dir(docs), "doc_snippets": int(doc_snippets)}
    return _C.agents.coder_prompt(problem, skill, plan_text, previous, feedback, options)


def _row(task: Mapping[str, Any], rendered: Mapping[str, Any], *, skill: int, plan: str, asks: list[str],
         previous: Mapping[str, Any], feedback: str) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": rendered["text"]}], "task_id": task["task_id"],
            "reference": task["reference"], "skill": skill, "plan": plan, "asks": asks, "previous": dict(previous),
            "feedback": feedback, "prompt_name": rendered["prompt_name"], "prompt_sha256": rendered["prompt_sha256"],
            "snippets": list(rendered["snippets"]), "set": task.get("set", ""), "level": int(task.get("level", 0) or 0),
            "class": task.get("class", ""), "source": ""}


def _task_rows(tasks: Any) -> list[dict[str, Any]]:
    from .problems import shipped_rows, problem_rows

    if tasks is None:
        return list(shipped_rows().values())
    if isinstance(tasks, (str, os.PathLike)):
        return problem_rows(tasks)
    return [dict(t) for t in tasks]  # a datasets.Dataset or rows


def skill1_rows(tasks: Any = None, *, plans: Mapping[str, Any] | None = None, hardware: Mapping[str, Any] | None = None,
                docs: bool | str | os.PathLike = True, prompts_dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """One Skill 1 row per task (tasks: rows, a Dataset, a folder, or None for the shipped set). plans:
    {task_id: ProblemPlan dict or JSON} from a Planner; a task without one gets offline_plan()."""
    rows = []
    for task in _task_rows(tasks):
        plan = (plans or {}).get(task["task_id"]) or offline_plan(task["reference"])
        plan_json = plan if isinstance(plan, str) else json.dumps(plan)
        rendered = coder_prompt(task["reference"], name=task.get("name") or task["task_id"], skill=1, plan=plan_json,
                                hardware=hardware, docs=docs, prompts_dir=prompts_dir)
        from ..agents import ProblemPlan

        asks = [s["title"] for s in ProblemPlan.parse(plan_json).steps]  # what the loop checks compliance against
        rows.append(_row(task, rendered, skill=1, plan=plan_json, asks=asks, previous=EMPTY_PREVIOUS, feedback=""))
    return rows


def _run_dirs(runs: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Run directories: each given folder that is one (it has problem.py and attempts/), or those inside it."""
    folders = [runs] if isinstance(runs, (str, os.PathLike)) else list(runs)
    found: list[Path] = []
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise NotFoundError(f"the run directory {os.fspath(folder)!r} does not exist")
        if (folder / "attempts").is_dir():
            found.append(folder)
        else:  # a runs/ folder, or graph mode's targets/ of program-mode runs
            found += sorted(p.parents[2] for p in folder.rglob("attempts/*/attempt.json")
                            if (p.parents[2] / "problem.py").is_file())
    return list(dict.fromkeys(found))


def skill2_rows(runs: str | os.PathLike | Iterable[str | os.PathLike], *, hardware: Mapping[str, Any] | None = None,
                docs: bool | str | os.PathLike = True, prompts_dir: str | os.PathLike | None = None,
                kernel_steps: bool = False) -> list[dict[str, Any]]:
    """One Skill 2 row per finished attempt with a candidate, in recorded run directories (a run, or a
    folder of runs): the prompt revising that candidate after its feedback, as the loop's next attempt
    would be asked. hardware: default the run's own (config.json). A task whose reference is a shipped
    one takes its id; others are "run/<problem>". Graph-mode targets answer kernel steps, which the
    reward does not score: left out unless kernel_steps."""
    from .problems import shipped_rows

    by_hash = {hashlib.sha256(r["reference"].encode()).hexdigest(): r for r in shipped_rows().values()}
    rows = []
    for run in _run_dirs(runs):
        reference = (run / "problem.py").read_text(encoding="utf-8")
        try:
            config = json.loads((run / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        problem = config.get("problem") or run.name
        shipped = by_hash.get(hashlib.sha256(reference.encode()).hexdigest())
        task = shipped or {"task_id": f"run/{problem}", "reference": reference, "set": "run", "level": 0, "class": ""}
        machine = hardware if hardware is not None else (config.get("hardware") or None)
        for record in sorted((run / "attempts").glob("*/attempt.json")):
            attempt = json.loads(record.read_text(encoding="utf-8"))
            candidate = attempt.get("candidate") or ""
            if not candidate or (candidate.lstrip().startswith("{") and not kernel_steps):
                continue
            feedback = attempt.get("feedback") or {}
            text = feedback.get("text") or ""
            if not text:
                continue
            plan_path = run / "plans" / f"plan-{attempt.get('plan', 1)}.json"
            plan = plan_path.read_text(encoding="utf-8") if plan_path.is_file() else ""
            report_path = record.parent / "report.json"
            report = report_path.read_text(encoding="utf-8") if report_path.is_file() else ""
            rendered = coder_prompt(reference, name=problem, skill=2, plan=plan or None, previous=candidate,
                                    feedback=text, hardware=machine, docs=docs, prompts_dir=prompts_dir)
            asks = [str(a) for a in feedback.get("asks") or []]
            row = _row(task, rendered, skill=2, plan=plan, asks=asks,
                       previous={"code": candidate, "report": report, "asks": asks}, feedback=text)
            row["source"] = f"{run.name}/attempts/{record.parent.name}"
            rows.append(row)
    return rows


def skill1_dataset(tasks: Any = None, **options: Any):
    """skill1_rows() as a datasets.Dataset."""
    import datasets

    return datasets.Dataset.from_list(skill1_rows(tasks, **options))


def skill2_dataset(runs: str | os.PathLike | Iterable[str | os.PathLike], **options: Any):
    """skill2_rows() as a datasets.Dataset; InvalidArgumentError when the runs hold no revisable attempt."""
    import datasets

    rows = skill2_rows(runs, **options)
    if not rows:
        raise InvalidArgumentError("the run directories hold no finished attempt with a candidate and feedback: run "
                                   "`stitchcuda optimize --mode program` first (docs/agents.md)")
    return datasets.Dataset.from_list(rows)
