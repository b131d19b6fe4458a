"""The RL environment's data, on the CPU: the shipped task set (100+ of the project's own problems) and
task folders read without building a model or allocating a tensor; Skill 1 prompts that are exactly
what the agents' Coder sends for a plan, and Skill 2 prompts from a recorded run directory that are
exactly what the loop's next Coder call sent (compared with the run's trajectories.jsonl); the rows
carry what the reward reads, and verl's and OpenRLHF's layouts round-trip through parquet."""

from __future__ import annotations

import json
import textwrap
import tracemalloc
from pathlib import Path

import pytest
import torch

import stitchcuda
from stitchcuda import agents, rl
from stitchcuda.rl import trainers

ROOT = Path(__file__).resolve().parents[2]

# The problem and its honest candidate the agents' loop tests use: one task, two views of it.
from test_agents_loop import GOOD, PROBLEM  # noqa: E402

BROKEN = GOOD.replace("x[i] + y[i]", "x[i] + z[i]")
PLAN = json.dumps({"summary": "Fuse the add and the ReLU into one elementwise kernel.",
                   "steps": [{"title": "Write one fused add+ReLU kernel", "detail": "One thread per element."}]})


class ScriptedModel:
    """The agents' model: a plan, a broken candidate, then the fix; records every conversation."""

    def __init__(self) -> None:
        self.sent: list[list[dict]] = []

    def __call__(self, messages: list[dict[str, str]]) -> str:
        self.sent.append(messages)
        first = messages[0]["content"]
        if "You are the Planner" in first:
            return PLAN
        if "Implement the plan below" in first:
            return f"```python\n{BROKEN}```"
        if "Revise your previous candidate" in first:
            return f"```python\n{GOOD}```"
        return "The kernel reads z, which is not declared; read y."


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, ScriptedModel]:
    folder = tmp_path_factory.mktemp("rl-run")
    (folder / "add_relu.py").write_text(PROBLEM)
    model = ScriptedModel()
    agents.optimize_problem(folder / "add_relu.py", model, attempts=3, run_dir=folder / "run", static_only=True)
    return folder / "run", model


# ---- tasks -------------------------------------------------------------------------------------------


def test_the_shipped_task_set():
    ds = rl.tasks()
    assert len(ds) >= 60 and len(set(ds["task_id"])) == len(ds)
    assert {"kernelbench", "suite", "corpus"} <= set(ds["set"]) and {1, 2, 3} <= set(ds["level"])
    for column in ("task_id", "set", "level", "class", "name", "reference", "init_inputs", "inputs",
                   "num_init_inputs", "num_inputs", "sizes", "sha256"):
        assert column in ds.column_names
    assert all(r["num_inputs"] >= 1 and "class Model" in r["reference"] for r in ds)
    names = {Path(p).stem for p in (ROOT / "bench" / "kernelbench").glob("*.py")}
    assert names <= {r["name"] for r in ds if r["set"] == "kernelbench"}


def test_inputs_are_read_on_the_meta_device():
    row = rl.find_task("corpus/bias_gelu")
    ns: dict = {}
    exec(row["reference"], ns)
    real = ns["get_inputs"]()
    assert [s["shape"] for s in row["inputs"]] == [list(t.shape) for t in real]
    assert [s["dtype"] for s in row["inputs"]] == ["float32"] and row["init_inputs"][0]["value"] == "4096"
    # Six gigabytes of input, described without allocating them.
    tracemalloc.start()
    big = rl.read_problem(ROOT / "bench" / "kernelbench" / "op_gelu_6gb.py", set_name="kernelbench")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    numel = torch.Size(big["inputs"][0]["shape"]).numel()
    assert numel * 4 >= 5 * 2**30 and peak < 64 * 2**20
    assert big["task_id"] == "kernelbench/op_gelu_6gb" and big["level"] == 1 and big["class"] == "op"


def test_a_folder_in_kernelbench_layout(tmp_path):
    (tmp_path / "level2").mkdir()
    (tmp_path / "level2" / "7_add_relu.py").write_text(PROBLEM)
    (tmp_path / "level1").mkdir()
    (tmp_path / "level1" / "1_relu.py").write_text(PROBLEM.replace("x + y", "x"))
    (tmp_path / "_helpers.py").write_text("X = 1\n")  # skipped: not a problem
    ds = rl.tasks(tmp_path)
    assert sorted(ds["task_id"]) == [f"{tmp_path.name}/level1/1_relu", f"{tmp_path.name}/level2/7_add_relu"]
    assert {r["name"]: r["level"] for r in ds} == {"1_relu": 1, "7_add_relu": 2}
    assert all(r["num_inputs"] == 2 and r["num_init_inputs"] == 0 for r in ds)

    (tmp_path / "level1" / "notes.py").write_text("print('not a problem')\n")
    with pytest.raises(stitchcuda.InvalidArgumentError, match="notes.*does not define Model"):
        rl.tasks(tmp_path)
    with pytest.raises(stitchcuda.NotFoundError, match="does not exist"):
        rl.tasks(tmp_path / "missing")


def test_find_task_names_what_is_ambiguous_or_missing():
    assert rl.find_task("op_gelu_6gb")["task_id"] == "kernelbench/op_gelu_6gb"
    with pytest.raises(stitchcuda.NotFoundError, match="kernelbench/conv_strided_bn_leaky.*suite/conv_strided_bn_leaky"):
        rl.find_task("conv_strided_bn_leaky")
    with pytest.raises(stitchcuda.NotFoundError, match="did you mean"):
        rl.find_task("kernelbench/op_gelu_6gbb")


# ---- prompts -----------------------------------------------------------------------------------------


def test_skill1_prompt_is_what_the_agents_coder_sends(run):
    run_dir, model = run
    coder = next(m for m in model.sent if "Implement the plan below" in m[0]["content"])
    rendered = rl.coder_prompt(PROBLEM, name="add_relu", skill=1, plan=PLAN, hardware=agents.hardware())
    assert rendered["text"] == coder[0]["content"]
    assert rendered["prompt_sha256"] == agents.PromptLibrary.load().prompts()["coder_plan"]["sha256"]


def test_skill1_dataset_rows():
    tasks = [rl.find_task("corpus/bias_gelu"), rl.find_task("kernelbench/net_lstm_stack")]
    ds = rl.skill1_dataset(tasks)
    assert len(ds) == 2 and set(ds["skill"]) == {1} and ds["task_id"] == [t["task_id"] for t in tasks]
    first = ds[0]
    assert first["prompt"][0]["role"] == "user" and "Implement the plan below" in first["prompt"][0]["content"]
    assert tasks[0]["reference"] in first["prompt"][0]["content"] and "class ModelNew" in first["prompt"][0]["content"]
    assert first["asks"] == [s["title"] for s in json.loads(first["plan"])["steps"]]
    assert "gelu" in first["plan"] and first["previous"] == {"code": "", "report": "", "asks": []}
    assert first["prompt_name"] == "coder_plan" and len(first["prompt_sha256"]) == 64
    # The plan a Planner wrote is used when given.
    planned = rl.skill1_rows([tasks[0]], plans={"corpus/bias_gelu": PLAN}, docs=False)[0]
    assert planned["asks"] == ["Write one fused add+ReLU kernel"] and planned["snippets"] == []
    assert "Fuse the add and the ReLU" in planned["prompt"][0]["content"]
    # A row is what the reward takes.
    honest = (ROOT / "tests/corpus/honest/bias_gelu_jit.py").read_text()
    assert rl.score_completion(first, f"```python\n{honest}```", mode="static").score > 0


def test_skill2_rows_are_the_loops_next_prompts(run):
    run_dir, _ = run
    rows = rl.skill2_rows(run_dir)
    assert [r["source"] for r in rows] == ["run/attempts/001", "run/attempts/002"]
    first = rows[0]
    assert first["skill"] == 2 and first["task_id"] == "run/add_relu" and first["previous"]["code"] == BROKEN
    assert '"z" is undefined' in first["feedback"] and json.loads(first["previous"]["report"])["compiled"] is False
    # The Coder's Skill 2 call of attempt 2, as trajectories.jsonl recorded it, revised attempt 1.
    records = agents.read_trajectories(run_dir)
    sent = next(r for r in records if r["agent"] == "coder" and r["skill"] == 2)
    assert first["prompt"] == sent["prompt"][:1] and first["prompt_sha256"] == sent["prompt_sha256"]
    assert first["snippets"] == sent["snippets"]
    # The reward reads the row: the fix of the compile error follows the feedback's asks.
    scored = rl.score_completion(first, f"```python\n{GOOD}```", skill=2, previous=first["previous"],
                                 feedback=first["feedback"], mode="static")
    assert scored.score > 0 and scored.parts["lambda"] == 0.7 and scored.asks == first["asks"] != []
    # Without the asks, they are read from the feedback's "What to do next:" list, as the agent wrote them.
    from_text = rl.score_completion(first, f"```python\n{GOOD}```", skill=2, feedback=first["feedback"],
                                    previous={"code": BROKEN, "report": first["previous"]["report"]}, mode="static")
    assert from_text.asks == first["asks"] and from_text.parts["skill-compliance"] == scored.parts["skill-compliance"]
    # A folder of runs works too; a folder with none says so.
    assert len(rl.skill2_dataset(run_dir.parent)) == 2
    with pytest.raises(stitchcuda.InvalidArgumentError, match="no finished attempt"):
        rl.skill2_dataset(run_dir / "prompts")


def test_trainer_layouts_round_trip_through_parquet(tmp_path, run):
    import datasets

    rows = rl.skill1_rows([rl.find_task("corpus/bias_gelu")], docs=False) + rl.skill2_rows(run[0], docs=False)
    verl = datasets.Dataset.from_list(trainers.verl_rows(rows))
    verl.to_parquet(tmp_path / "train.parquet")
    back = datasets.Dataset.from_parquet(str(tmp_path / "train.parquet"))
    assert back[0]["data_source"] == "stitchcuda" and back[0]["prompt"] == rows[0]["prompt"]
    label = json.loads(back[1]["reward_model"]["ground_truth"])
    assert label["task_id"] == "run/add_relu" and label["skill"] == 2 and label["previous"]["code"] == BROKEN
    fixed = trainers.compute_score("stitchcuda", f"```python\n{GOOD}```", back[1]["reward_model"]["ground_truth"],
                                   back[1]["extra_info"], mode="static")
    assert fixed["score"] > 0 and fixed["lambda"] == 0.7
    openrlhf = datasets.Dataset.from_list(trainers.openrlhf_rows(rows))
    assert openrlhf.column_names == ["prompt", "label"] and json.loads(openrlhf[0]["label"])["skill"] == 1
