"""The records of trajectories.jsonl: one per model call of a run (Planner, Coder, VerifierAgent,
Replanner), every record with the same keys and value types, so that

    datasets.load_dataset("json", data_files="runs/<run>/trajectories.jsonl")

reads a run as it is. ``messages`` is the whole conversation (what was sent, then the reply as the last,
assistant message); ``prompt`` and ``completion`` are the same conversation split for prompt/completion
trainers (TRL's format). The C++ run directory writes them (src/agents/run_dir.cpp); this module holds
their JSON Schema, a checker, and ``trajectory_record`` for code that writes records of its own (graph
mode's Planner) so that one file keeps one shape. docs/agents.md, "Trajectories", describes each key.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Mapping

__all__ = ["TRAJECTORY_SCHEMA", "TRAJECTORY_KEYS", "AGENTS", "RUBRIC_ITEMS", "validate_trajectory",
           "read_trajectories", "trajectory_record"]

#: The agents whose calls are recorded.
AGENTS = ("planner", "coder", "verifier", "replanner", "judge")
#: The rubric's items, by the names reward.rubric uses (docs/rubric.md).
RUBRIC_ITEMS = ("anti-hacking", "cuda-engineering", "operator-coverage", "skill-compliance")

_MESSAGE = {"type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]},
                           "content": {"type": "string"}}}
_REWARD = {
    "type": "object",
    "required": ["value", "correct", "hack", "speedup", "rubric", "total", "normalized", "lambda", "why_zero"],
    "additionalProperties": False,
    "properties": {
        "value": {"type": "number", "minimum": 0},
        "correct": {"type": "boolean"},
        "hack": {"type": "boolean"},
        "speedup": {"type": "number", "minimum": 0},
        "rubric": {"type": "object", "required": list(RUBRIC_ITEMS), "additionalProperties": False,
                   "properties": {k: {"type": "integer", "minimum": 1, "maximum": 5} for k in RUBRIC_ITEMS}},
        "total": {"type": "integer", "minimum": 0, "maximum": 20},
        "normalized": {"type": "number"},
        "lambda": {"type": "number"},
        # "" unless value is 0; then why, by one of these prefixes (or a shaped reward of 0).
        "why_zero": {"type": "string",
                     "pattern": r"^(|incorrect: .*|hack: .+|no candidate: .*|unverified|shaped reward is 0: .*)$"},
    },
}

#: JSON Schema (draft 2020-12) of one trajectories.jsonl record.
TRAJECTORY_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "StitchCUDA trajectory record",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "run_id": {"type": "string", "minLength": 1},
        "problem": {"type": "string"},
        "model": {"type": "string"},
        "agent": {"type": "string", "enum": list(AGENTS)},
        "prompt_name": {"type": "string"},
        "prompt_sha256": {"type": "string", "pattern": "^([0-9a-f]{64})?$"},
        "plan": {"type": ["integer", "null"], "minimum": 1},
        "attempt": {"type": ["integer", "null"], "minimum": 0},
        "skill": {"type": ["integer", "null"], "enum": [1, 2, None]},
        "messages": {"type": "array", "minItems": 2, "items": _MESSAGE},
        "prompt": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "completion": {"type": "array", "minItems": 1, "maxItems": 1, "items": _MESSAGE},
        "finish_reason": {"type": "string"},
        "error": {"type": "string"},
        "usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                  "additionalProperties": False,
                  "properties": {k: {"type": "integer", "minimum": 0}
                                 for k in ("prompt_tokens", "completion_tokens", "total_tokens")}},
        "latency_s": {"type": "number", "minimum": 0},
        "snippets": {"type": "array", "items": {"type": "string"}},
        "feedback_kind": {"type": "string"},
        "reward": {"oneOf": [{"type": "null"}, _REWARD]},
    },
}
TRAJECTORY_SCHEMA["required"] = list(TRAJECTORY_SCHEMA["properties"])
#: Every key of a record (the run directory writes them in JSON object order: sorted).
TRAJECTORY_KEYS: tuple[str, ...] = tuple(TRAJECTORY_SCHEMA["required"])


# ---- a small checker for the subset of JSON Schema the schema uses ----------------------------------


def _type_ok(value: Any, name: str) -> bool:
    if name == "null":
        return value is None
    if name == "boolean":
        return isinstance(value, bool)
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "string":
        return isinstance(value, str)
    if name == "array":
        return isinstance(value, list)
    if name == "object":
        return isinstance(value, dict)
    raise ValueError(f"schema type {name!r} is not supported")


def _problems(value: Any, schema: Mapping[str, Any], path: str) -> Iterator[str]:
    import re

    if "oneOf" in schema:
        found = [list(_problems(value, s, path)) for s in schema["oneOf"]]
        matching = sum(1 for f in found if not f)
        if matching == 1:
            return
        # Say what is wrong with the alternative of the value's own type (a reward object, not null).
        typed = [f for s, f in zip(schema["oneOf"], found) if "type" not in s or
                 any(_type_ok(value, n) for n in ([s["type"]] if isinstance(s["type"], str) else s["type"]))]
        if matching == 0 and len(typed) == 1:
            yield from typed[0]
        else:
            yield f"{path}: matches {matching} of the alternatives, not exactly one"
        return
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_type_ok(value, n) for n in names):
            yield f"{path}: expected {' or '.join(names)}, got {type(value).__name__}"
            return
    if "enum" in schema and value not in schema["enum"]:
        yield f"{path}: {value!r} is not one of {schema['enum']}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            yield f"{path}: {value} is below {schema['minimum']}"
        if "maximum" in schema and value > schema["maximum"]:
            yield f"{path}: {value} is above {schema['maximum']}"
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            yield f"{path}: shorter than {schema['minLength']}"
        if "pattern" in schema and not re.search(schema["pattern"], value, re.S):
            yield f"{path}: {value[:80]!r} does not match {schema['pattern']}"
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            yield f"{path}: fewer than {schema['minItems']} items"
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            yield f"{path}: more than {schema['maxItems']} items"
        if "items" in schema:
            for i, item in enumerate(value):
                yield from _problems(item, schema["items"], f"{path}[{i}]")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                yield f"{path}.{key}: missing"
        props = schema.get("properties", {})
        for key, item in value.items():
            if key in props:
                yield from _problems(item, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                yield f"{path}.{key}: not a key of the record"


def validate_trajectory(record: Mapping[str, Any]) -> list[str]:
    """Every way `record` departs from TRAJECTORY_SCHEMA ("record.reward.total: expected integer, got
    float"), plus the rules a schema cannot say: messages = prompt + completion, and a reward exactly for
    the Coder's calls. Empty when the record is valid."""
    problems = list(_problems(record, TRAJECTORY_SCHEMA, "record"))
    if problems:
        return problems
    if record["messages"] != record["prompt"] + record["completion"]:
        problems.append("record.messages: is not prompt + completion")
    if record["completion"][0]["role"] != "assistant":
        problems.append("record.completion[0].role: the reply is the assistant's")
    coder = record["agent"] == "coder"
    if coder != (record["reward"] is not None):
        problems.append("record.reward: set for the Coder's calls only")
    if coder != (record["skill"] is not None):
        problems.append("record.skill: set for the Coder's calls only")
    if record["agent"] == "planner" and record["attempt"] is not None:
        problems.append("record.attempt: the first plan precedes every attempt (null)")
    reward = record["reward"]
    if reward is not None and (reward["value"] == 0) == (reward["why_zero"] == ""):
        problems.append("record.reward.why_zero: says why exactly when the value is 0")
    return problems


def read_trajectories(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a trajectories.jsonl (a run directory or the file itself)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "trajectories.jsonl")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def trajectory_record(exchange: Mapping[str, Any], *, run_id: str, problem: str, plan: int | None = None,
                      attempt: int | None = None, skill: int | None = None, feedback_kind: str = "",
                      reward: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A record for one model call, in the run directory's shape. `exchange` is a recorded call as the
    run directory writes it (agent, model, messages, reply, finish_reason, usage, latency_s, error,
    prompt: {name, sha256}, snippets); ``prompt_name`` / ``prompt_sha256`` at its top level are read too."""
    prompt_info = exchange.get("prompt") if isinstance(exchange.get("prompt"), Mapping) else {}
    sent = [{"role": m["role"], "content": m["content"]} for m in exchange.get("messages", [])]
    reply = {"role": "assistant", "content": exchange.get("reply", "") or ""}
    usage = exchange.get("usage") or {}
    record = {
        "run_id": run_id, "problem": problem, "model": exchange.get("model", "") or "",
        "agent": exchange.get("agent", ""),
        "prompt_name": exchange.get("prompt_name", prompt_info.get("name", "")) or "",
        "prompt_sha256": exchange.get("prompt_sha256", prompt_info.get("sha256", "")) or "",
        "plan": plan, "attempt": attempt, "skill": skill,
        "messages": [*sent, reply], "prompt": sent, "completion": [reply],
        "finish_reason": exchange.get("finish_reason", "") or "", "error": exchange.get("error", "") or "",
        "usage": {k: int(usage.get(k, 0) or 0) for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "latency_s": float(exchange.get("latency_s", 0.0) or 0.0),
        "snippets": list(exchange.get("snippets", [])), "feedback_kind": feedback_kind,
        "reward": dict(reward) if reward is not None else None,
    }
    return {key: record[key] for key in TRAJECTORY_KEYS}
