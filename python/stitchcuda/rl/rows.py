"""What a trainer hands the reward for one reply: the task columns of a prompt dataset row, the label a
trainer that carries one string per row packs them in, and OpenRLHF's remote-reward request and reply.
The in-process trainers (rl/trainers.py) and the reward service (rl/service.py) both read them here.

Imports are absolute: verl and OpenRLHF load rl/trainers.py by its path, which then imports this module.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from stitchcuda.errors import InvalidArgumentError
from stitchcuda.rl.score import PART_NAMES, Scored

__all__ = ["TASK_KEYS", "task_of", "task_label", "label_row", "reply_of", "openrlhf_batch", "openrlhf_result"]

# The columns of a prompt dataset row that say what a reply is scored against (stitchcuda.rl.prompts).
TASK_KEYS = ("task_id", "reference", "skill", "previous", "feedback", "asks")


def task_of(row: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(the task score_completion takes, its keywords) from one row's task columns."""
    task_id, reference = row.get("task_id"), row.get("reference")
    if not isinstance(task_id, str) or not task_id:
        raise InvalidArgumentError("a row to score needs a 'task_id' column (stitchcuda.rl.skill1_dataset() rows have "
                                   f"it); got {sorted(map(str, row))[:12]}")
    task: Any = {"task_id": task_id, "reference": reference} if isinstance(reference, str) and reference.strip() else task_id
    skill = row.get("skill") or 1
    if isinstance(skill, bool) or str(skill) not in ("1", "2"):
        raise InvalidArgumentError(f"the row's skill must be 1 (from the plan) or 2 (from feedback), got {skill!r:.40}")
    previous = row.get("previous")
    if isinstance(previous, str):
        try:
            previous = json.loads(previous) if previous.strip().startswith("{") else {"code": previous}
        except (ValueError, RecursionError):
            raise InvalidArgumentError("the row's 'previous' column is not valid JSON: give "
                                       "{\"code\", \"report\", \"asks\"} or the previous candidate's source") from None
    if isinstance(previous, Mapping) and not previous.get("code"):
        previous = None
    asks = row.get("asks")
    if asks is not None:
        asks = list(asks)
    if int(skill) == 2 and not asks:
        asks = None  # score_completion takes them from previous["asks"]
    return task, {"skill": int(skill), "previous": previous, "feedback": row.get("feedback") or "", "asks": asks}


def task_label(row: Mapping[str, Any]) -> str:
    """The JSON a row's task travels as through a trainer that carries one string (verl's ground_truth,
    OpenRLHF's label): task_id, reference, skill, previous, feedback, asks."""
    return json.dumps({k: row.get(k) for k in TASK_KEYS if row.get(k) is not None})


def label_row(label: Any, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A row's task columns from a label (task_label's JSON, a task id, or a dict) and verl's extra_info."""
    row: dict[str, Any] = {}
    if isinstance(label, Mapping):
        row.update(label)
    elif isinstance(label, str) and label.strip().startswith("{"):
        try:
            parsed = json.loads(label)
        except (ValueError, RecursionError):
            raise InvalidArgumentError(f"the label is not valid JSON: {label[:80]!r}") from None
        if not isinstance(parsed, Mapping):
            raise InvalidArgumentError(f"the label must be a JSON object (task_label's), got {label[:80]!r}")
        row.update(parsed)
    elif isinstance(label, str) and label.strip():
        row["task_id"] = label.strip()
    for key in TASK_KEYS:
        if extra and extra.get(key) is not None and key not in row:
            row[key] = extra[key]
    return row


# ---- OpenRLHF's remote reward ------------------------------------------------------------------------


def reply_of(query: str, prompt: str) -> str:
    """The model's reply inside OpenRLHF's query (the prompt and the reply decoded together, special
    tokens kept): what follows the prompt. "" when the prompt cannot be found: never the prompt's own
    example code, which would be scored as if the model had written it."""
    if not prompt:
        return query
    at = query.rfind(prompt)
    if at >= 0:
        return query[at + len(prompt):]
    tail = prompt[-200:]  # a tokenizer round trip may change the prompt's start (BOS, spaces)
    at = query.rfind(tail)
    return query[at + len(tail):] if at >= 0 else ""


def openrlhf_batch(body: Any) -> tuple[list[str], list[str], list[Any]]:
    """(queries, prompts, labels) of OpenRLHF's POST body {"query", "prompts", "labels"}; a body of another
    shape is InvalidArgumentError saying the shape."""
    if not isinstance(body, Mapping) or not isinstance(body.get("query"), list):
        raise InvalidArgumentError("the body must be a JSON object with 'query' (a list of strings), 'prompts' and "
                                   "'labels' (lists of the same length)")
    queries = body["query"]
    if not all(isinstance(q, str) for q in queries):
        raise InvalidArgumentError("'query' must be a list of strings")
    prompts = body.get("prompts") or [""] * len(queries)
    labels = body.get("labels") or [None] * len(queries)
    if not isinstance(prompts, list) or not isinstance(labels, list) or not len(queries) == len(prompts) == len(labels):
        raise InvalidArgumentError(f"'query', 'prompts' and 'labels' must be lists of one length: got "
                                   f"{len(queries)} queries, {len(prompts) if isinstance(prompts, list) else '?'} "
                                   f"prompts, {len(labels) if isinstance(labels, list) else '?'} labels")
    if not all(isinstance(p, str) for p in prompts):
        raise InvalidArgumentError("'prompts' must be a list of strings")
    return list(queries), list(prompts), list(labels)


def openrlhf_result(scored: Sequence[Scored]) -> dict[str, Any]:
    """OpenRLHF's reply: {"rewards", "scores", "extra_logs": {part: [...]}} for the batch."""
    return {"rewards": [s.score for s in scored], "scores": [s.score for s in scored],
            "extra_logs": {p: [float(s.parts[p]) for s in scored] for p in PART_NAMES}}
