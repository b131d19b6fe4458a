"""One reward, three trainers: the StitchCUDA reward (stitchcuda.rl.score_completion) behind the calls TRL,
verl and OpenRLHF make. Whatever the trainer, a reply that holds no code or answers another task is a
reward of 0 with its reason, never an exception; a hack is 0.

- TRL: ``GRPOTrainer(reward_funcs=[TRLReward()])`` (or ``AsyncTRLReward()``): dataset columns arrive as
  keyword lists; each part is logged through TRL's ``log_metric`` and the reason through ``log_extra``.
- verl: ``reward.custom_reward_function.path=pkg://stitchcuda.rl.trainers``, ``name=compute_score``; the
  same function takes the batched keywords of verl's batch reward manager.
- OpenRLHF: ``--remote_rm_url <this file's path>`` loads ``reward_func``; ``openrlhf_reply(body)`` answers
  the remote protocol's POST body.

Imports are absolute: verl and OpenRLHF load this file by its path as well as by its module name.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import threading
from typing import Any, Callable, Mapping, Sequence

from stitchcuda.errors import InvalidArgumentError
from stitchcuda.rl.rows import TASK_KEYS, label_row, openrlhf_batch, openrlhf_result, reply_of, task_label, task_of
from stitchcuda.rl.score import PART_NAMES, RewardConfig, Scored, completion_text, score_completion

__all__ = ["StitchReward", "TRLReward", "AsyncTRLReward", "compute_score", "verl_rows", "reward_func",
           "openrlhf_reply", "openrlhf_rows", "task_label", "DATA_SOURCE"]

#: verl's data_source for StitchCUDA rows.
DATA_SOURCE = "stitchcuda"


class StitchReward:
    """Scores batches: each (row, completion) through score_completion, several at once on threads (the
    Verifier's worker pool decides how many really run together), identical ones once.

    mode: "auto" | "gpu" | "static"; config: a RewardConfig or a dict of its fields; pool: a
    stitchcuda.verify.WorkerPool; max_workers: threads scoring one batch (default 8). service: the URL of
    a reward service (``stitchcuda serve reward``) to score on instead of in this process — a batch is one
    request, its distinct replies scored by the service's GPU pool; deadline_s: the service's deadline
    per item. An item the service could not score (its deadline passed, its worker failed twice) comes
    back as 0 with the reason "not scored: ..." (TRL's functions give None for it: no training signal)."""

    def __init__(self, *, mode: str = "auto", config: RewardConfig | Mapping[str, Any] | None = None, pool: Any = None,
                 max_workers: int = 8, service: str | None = None, deadline_s: float | None = None) -> None:
        if mode not in ("auto", "gpu", "static"):
            raise InvalidArgumentError(f"mode must be 'auto', 'gpu' or 'static', got {mode!r}")
        if not isinstance(max_workers, int) or max_workers < 1:
            raise InvalidArgumentError(f"max_workers must be a positive integer, got {max_workers!r}")
        if service is not None and pool is not None:
            raise InvalidArgumentError("pass a pool (score in this process) or a service URL (score there), not both")
        self.mode = mode
        self.config = config if isinstance(config, RewardConfig) else RewardConfig.from_dict(config)
        self.pool = pool
        self.max_workers = max_workers
        self.deadline_s = deadline_s
        self._client = None
        if service is not None:
            from stitchcuda.rl.service import RewardClient

            self._client = RewardClient(service)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def score_one(self, row: Mapping[str, Any], completion: Any) -> Scored:
        if self._client is not None:
            return self._remote([row], [completion])[0]
        task, keywords = task_of(row)
        return score_completion(task, completion, mode=self.mode, config=self.config, pool=self.pool, **keywords)

    def _remote(self, rows: Sequence[Mapping[str, Any]], completions: Sequence[Any]) -> list[Scored]:
        """The (row, completion) pairs scored by the service, in one request."""
        items = []
        for row, completion in zip(rows, completions):
            task, keywords = task_of(row)
            item = {"task": task, "completion": completion, "skill": keywords["skill"]}
            for key in ("previous", "feedback", "asks"):
                if keywords.get(key):
                    item[key] = keywords[key]
            items.append(item)
        replies = self._client.score(items, deadline_s=self.deadline_s, config=self.config, mode=self.mode)
        # An unscored item's task id is the row's (the service's error reply may not carry it).
        return [Scored.from_reply(reply if "error" not in reply else {"task_id": row.get("task_id"), **reply})
                for row, reply in zip(rows, replies)]

    def _key(self, row: Mapping[str, Any], completion: Any) -> str:
        fields = [str(row.get(k)) for k in TASK_KEYS] + [completion_text(completion)]
        return hashlib.sha256("\x00".join(fields).encode("utf-8", "surrogatepass")).hexdigest()

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="stitchcuda-rl")
            return self._executor

    def score_batch(self, rows: Sequence[Mapping[str, Any]], completions: Sequence[Any]) -> list[Scored]:
        """Scored per (row, completion), in order."""
        if len(rows) != len(completions):
            raise InvalidArgumentError(f"{len(completions)} completions for {len(rows)} rows")
        for row in rows:
            task_of(row)  # a dataset without the task columns fails here, once, before any work
        keys = [self._key(r, c) for r, c in zip(rows, completions)]
        first = {k: i for i, k in reversed(list(enumerate(keys)))}
        if self._client is not None:  # one request; the service scores the distinct replies on its pool
            done = dict(zip(first, self._remote([rows[i] for i in first.values()],
                                                [completions[i] for i in first.values()])))
            return [done[k] for k in keys]
        futures = {k: self._pool().submit(self.score_one, rows[i], completions[i]) for k, i in first.items()}
        return [futures[k].result() for k in keys]

    async def ascore_batch(self, rows: Sequence[Mapping[str, Any]], completions: Sequence[Any]) -> list[Scored]:
        """score_batch for an event loop: every distinct reply scored concurrently."""
        if len(rows) != len(completions):
            raise InvalidArgumentError(f"{len(completions)} completions for {len(rows)} rows")
        for row in rows:
            task_of(row)
        keys = [self._key(r, c) for r, c in zip(rows, completions)]
        first = {k: i for i, k in reversed(list(enumerate(keys)))}
        loop = asyncio.get_running_loop()
        if self._client is not None:  # the request waits on a thread, not on the trainer's event loop
            return await loop.run_in_executor(self._pool(), self.score_batch, rows, completions)
        done = await asyncio.gather(*(loop.run_in_executor(self._pool(), self.score_one, rows[i], completions[i])
                                      for i in first.values()))
        by_key = dict(zip(first, done))
        return [by_key[k] for k in keys]

    def close(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False)
                self._executor = None


# ---- TRL ---------------------------------------------------------------------------------------------


def _rows_from_columns(n: int, columns: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = [{} for _ in range(n)]
    for key, values in columns.items():
        if isinstance(values, (list, tuple)) and len(values) == n:
            for row, value in zip(rows, values):
                row[key] = value
    return rows


class TRLReward(StitchReward):
    """A TRL reward function: ``(prompts, completions, completion_ids=None, **columns) -> list[float | None]``.
    Rows without a task_id (another data source in a mixed dataset) get None: TRL leaves them to the
    other reward functions. With TRL's ``log_metric``, logs each part's batch mean as
    ``stitchcuda/<part>`` (correct, hack, speedup, each rubric item, r_hat...) and the share of replies
    scored 0 by cause (``stitchcuda/zero/<cause>``); with ``log_extra``, each reply's reason."""

    def __init__(self, *, name: str = "stitchcuda", **options: Any) -> None:
        super().__init__(**options)
        self.__name__ = name  # TRL names the reward's column by it

    def _split(self, prompts, completions, kwargs):
        n = len(completions)
        columns = {k: v for k, v in kwargs.items() if k not in ("trainer_state", "log_extra", "log_metric", "environments")}
        rows = _rows_from_columns(n, columns)
        wanted = [i for i, r in enumerate(rows) if r.get("task_id")]
        if not wanted and n:
            raise InvalidArgumentError("no task_id column reached the reward: train on stitchcuda.rl.skill1_dataset() "
                                       "(or keep its task_id, reference, skill, previous, feedback, asks columns)")
        return rows, wanted

    def _finish(self, n: int, wanted: list[int], scored: list[Scored], kwargs: Mapping[str, Any]) -> list[float | None]:
        out: list[float | None] = [None] * n
        for i, s in zip(wanted, scored):
            out[i] = None if s.reason.startswith("not scored:") else s.score  # a service failure is no signal
        log_metric: Callable[[str, float], Any] | None = kwargs.get("log_metric")
        if log_metric is not None and scored:
            for part in PART_NAMES:
                log_metric(f"{self.__name__}/{part}", sum(s.parts[part] for s in scored) / len(scored))
            log_metric(f"{self.__name__}/reward", sum(s.score for s in scored) / len(scored))
            causes: dict[str, int] = {}
            for s in scored:
                if s.score == 0:
                    cause = s.reason.split(":", 1)[0] or "zero"
                    causes[cause] = causes.get(cause, 0) + 1
            for cause in ("no code in the reply", "wrong task", "not compiled", "hack", "incorrect", "unverified"):
                log_metric(f"{self.__name__}/zero/{cause.replace(' ', '_')}", causes.get(cause, 0) / len(scored))
        log_extra = kwargs.get("log_extra")
        if log_extra is not None:
            reasons = [""] * n
            for i, s in zip(wanted, scored):
                reasons[i] = s.reason
            log_extra(f"{self.__name__}_reason", reasons)
        return out

    def __call__(self, prompts: Sequence[Any] | None = None, completions: Sequence[Any] | None = None,
                 completion_ids: Any = None, **kwargs: Any) -> list[float | None]:
        completions = list(completions or [])
        rows, wanted = self._split(prompts, completions, kwargs)
        scored = self.score_batch([rows[i] for i in wanted], [completions[i] for i in wanted])
        return self._finish(len(completions), wanted, scored, kwargs)


class AsyncTRLReward(TRLReward):
    """TRLReward as an ``async`` callable: TRL awaits it on its event loop, and the batch's replies are
    scored concurrently."""

    async def __call__(self, prompts: Sequence[Any] | None = None, completions: Sequence[Any] | None = None,
                       completion_ids: Any = None, **kwargs: Any) -> list[float | None]:
        completions = list(completions or [])
        rows, wanted = self._split(prompts, completions, kwargs)
        scored = await self.ascore_batch([rows[i] for i in wanted], [completions[i] for i in wanted])
        return self._finish(len(completions), wanted, scored, kwargs)


# ---- verl --------------------------------------------------------------------------------------------

_shared: dict[tuple, StitchReward] = {}
_shared_lock = threading.Lock()


def _shared_reward(mode: str, config: Any, service: str | None = None) -> StitchReward:
    """One StitchReward per (mode, config, service) in this process: verl and OpenRLHF call plain functions."""
    key = (mode, json.dumps(config, sort_keys=True, default=str) if config is not None else "", service or "")
    with _shared_lock:
        if key not in _shared:
            _shared[key] = StitchReward(mode=mode, config=config, service=service)
        return _shared[key]


def _verl_result(s: Scored) -> dict[str, Any]:
    return {"score": s.score, **{k: float(v) for k, v in s.parts.items()}, "reason": s.reason}


def compute_score(data_source: str | None = None, solution_str: str | None = None, ground_truth: Any = None,
                  extra_info: Mapping[str, Any] | None = None, *, data_sources: Sequence[str] | None = None,
                  solution_strs: Sequence[str] | None = None, ground_truths: Sequence[Any] | None = None,
                  extra_infos: Sequence[Mapping[str, Any] | None] | None = None, mode: str = "auto",
                  config: Mapping[str, Any] | None = None, service: str | None = None,
                  **_: Any) -> dict[str, Any] | list[dict[str, Any]]:
    """verl's reward: ``{"score": R, <part>: value..., "reason": str}`` for one reply, or a list of them
    for the batched keywords (verl's batch reward manager). ground_truth is task_label()'s JSON or a
    task id; extra_info may carry the task columns instead. mode, config and service (a reward service's
    URL to score on) come from verl's ``custom_reward_function.reward_kwargs``."""
    reward = _shared_reward(mode, config, service)
    if solution_strs is not None:
        n = len(solution_strs)
        infos = list(extra_infos) if extra_infos is not None else [None] * n
        truths = list(ground_truths) if ground_truths is not None else [None] * n
        rows = [label_row(t, e) for t, e in zip(truths, infos)]
        return [_verl_result(s) for s in reward.score_batch(rows, list(solution_strs))]
    row = label_row(ground_truth, extra_info)
    return _verl_result(reward.score_one(row, solution_str or ""))


def verl_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Prompt rows (stitchcuda.rl.skill1_rows/skill2_rows) in verl's RL dataset layout: data_source,
    prompt, ability, reward_model {style, ground_truth}, extra_info {task_id, skill, index}. Write them
    with ``datasets.Dataset.from_list(verl_rows(rows)).to_parquet(path)``."""
    return [{"data_source": DATA_SOURCE, "prompt": list(r["prompt"]), "ability": "cuda",
             "reward_model": {"style": "rule", "ground_truth": task_label(r)},
             "extra_info": {"task_id": r["task_id"], "skill": int(r.get("skill") or 1), "index": i}}
            for i, r in enumerate(rows)]


# ---- OpenRLHF ----------------------------------------------------------------------------------------


def reward_func(queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any], **kwargs: Any) -> dict[str, Any]:
    """OpenRLHF's local reward function (``--remote_rm_url`` naming this file): {"rewards", "scores",
    "extra_logs": {part: [...]}} for the batch. labels: task_label() JSON (``--label_key label`` over
    openrlhf_rows()) or task ids."""
    reward = _shared_reward(kwargs.get("mode", "auto"), kwargs.get("config"), kwargs.get("service"))
    queries, prompts, labels = list(queries), list(prompts or [""] * len(queries)), list(labels or [None] * len(queries))
    if not len(queries) == len(prompts) == len(labels):
        raise InvalidArgumentError(f"{len(queries)} queries, {len(prompts)} prompts and {len(labels)} labels: one each")
    rows = [label_row(label) for label in labels]
    replies = [reply_of(q, p) for q, p in zip(queries, prompts)]
    return openrlhf_result(reward.score_batch(rows, replies))


def openrlhf_reply(body: Mapping[str, Any], *, mode: str = "auto", config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The answer to OpenRLHF's remote reward request: POST {"query": [...], "prompts": [...], "labels": [...]}
    -> {"rewards", "scores", "extra_logs"}. A body that is not that shape is InvalidArgumentError (the
    service answers it with 400)."""
    queries, prompts, labels = openrlhf_batch(body)
    return reward_func(queries, prompts, labels, mode=mode, config=config)


def openrlhf_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Prompt rows in OpenRLHF's layout: ``prompt`` (the chat messages; train with --input_key prompt
    --apply_chat_template) and ``label`` (task_label's JSON; --label_key label)."""
    return [{"prompt": list(r["prompt"]), "label": task_label(r)} for r in rows]
