"""StitchCUDA as a reinforcement-learning environment: the tasks (KernelBench-format problems, a shipped
set of 100+), Skill 1 and Skill 2 prompt datasets rendered with the agents' own prompts, and one reward —
the Verifier, the Rubric and R — behind the interfaces TRL, verl and OpenRLHF call (docs/rl.md).

    import stitchcuda.rl as rl
    ds = rl.skill1_dataset()                                  # prompt + the columns the reward reads
    r = rl.score_completion(ds[0], reply, mode="static")      # Scored: score, parts, reason, verified

Importing stitchcuda does not import this package; it imports neither trl nor datasets until asked.
"""

from __future__ import annotations

from .problems import find_task, read_problem, shipped_dirs, tasks
from .prompts import coder_prompt, offline_plan, skill1_dataset, skill1_rows, skill2_dataset, skill2_rows
from .score import PART_NAMES, RUBRIC_ITEMS, RewardConfig, Scored, completion_text, score_completion
from .trainers import (AsyncTRLReward, StitchReward, TRLReward, compute_score, openrlhf_reply, openrlhf_rows,
                       reward_func, task_label, verl_rows)
# The reward service (docs/reward-service.md); Ray itself is imported only when a RayRewardPool is made.
from .ray_pool import RayRewardPool
from .service import RewardClient, RewardService
from .workers import RewardItem, RewardPool

__all__ = ["tasks", "read_problem", "find_task", "shipped_dirs", "score_completion", "Scored", "RewardConfig",
           "completion_text", "PART_NAMES", "RUBRIC_ITEMS", "skill1_dataset", "skill2_dataset", "skill1_rows",
           "skill2_rows", "offline_plan", "coder_prompt", "StitchReward", "TRLReward", "AsyncTRLReward",
           "compute_score", "verl_rows", "reward_func", "openrlhf_reply", "openrlhf_rows", "task_label"]
__all__ += ["RewardPool", "RewardItem", "RayRewardPool", "RewardService", "RewardClient"]
