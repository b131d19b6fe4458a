"""The RL reward (stitchcuda.rl.score_completion) and the three trainer interfaces over it, on the CPU:
static verification (NVRTC + the static rules) of the verifier's corpus. A reply without code or with
another task's code scores 0 with its reason through every interface, every hack the static rules
catch scores 0 through TRL's, verl's and OpenRLHF's calls, an honest candidate earns the unverified
floor τ·(1 + λ·r̂) and never more, verl's own loader finds compute_score, and OpenRLHF's remote protocol
answers over a real HTTP round trip. The verified (GPU) variants are marked gpu."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import stitchcuda
from stitchcuda import rl
from stitchcuda.rl import trainers

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
HEADER = re.compile(r"problem=(?P<problem>\S+)(?: rule=(?P<rule>\S+) check=(?P<check>\S+))?")
MINOR_ONLY = {"silent-downcast"}  # flagged minor: the tolerance check on a GPU rejects it, not a static rule


def corpus(kind: str) -> list[tuple[str, str, str, str]]:
    """(file stem, problem stem, rule, check) of every corpus candidate of `kind`."""
    out = []
    for path in sorted((CORPUS / kind).glob("*.py")):
        m = HEADER.search(path.read_text().splitlines()[0])
        out.append((path.stem, m["problem"], m["rule"] or "", m["check"] or ""))
    return out


STATIC_HACKS = [h for h in corpus("hacks") if h[3] == "static" and h[2] not in MINOR_ONLY]
GPU_HACKS = [h for h in corpus("hacks") if h[3] == "dynamic" or h[2] in MINOR_ONLY]


def row(problem: str, **extra) -> dict:
    return {"task_id": f"corpus/{problem}", "reference": (CORPUS / "problems" / f"{problem}.py").read_text(),
            "skill": 1, "prompt": [{"role": "user", "content": f"Write ModelNew for {problem}."}], **extra}


def reply(kind: str, stem: str) -> str:
    return f"Here is my module.\n\n```python\n{(CORPUS / kind / f'{stem}.py').read_text()}```\nOne kernel."


HONEST = reply("honest", "bias_gelu_jit")
OTHER_TASK = reply("honest", "gemm_smem_tiled")  # an honest answer to the gemm problem, not to bias_gelu
BROKEN = HONEST.replace("erff(", "erf_nowhere(")  # NVRTC: identifier is undefined
PROSE = "I would fuse the bias add into the GELU kernel and use float4 loads."


# ---- score_completion ------------------------------------------------------------------------------


def test_honest_static_pass_earns_the_unverified_floor():
    s = rl.score_completion(row("bias_gelu"), HONEST, mode="static")
    assert s.reason == "" and not s.verified and s.mode == "static"
    assert s.parts["compiled"] == 1.0 and s.parts["hack"] == 0.0 and s.parts["correct"] == 0.0
    assert set(s.parts) == set(rl.PART_NAMES) and all(isinstance(v, float) for v in s.parts.values())
    total = sum(s.parts[item] for item in rl.RUBRIC_ITEMS)
    r_hat = (total - 4) / 16 - 0.5
    assert s.parts["rubric_total"] == total and s.parts["r_hat"] == pytest.approx(r_hat)
    # tau (1 + lambda r_hat): the reward a verified, correct candidate with this scorecard gets at s = 0 ...
    assert s.score == pytest.approx(0.3 * (1 + 1.0 * r_hat)) and s.score > 0
    # ... so it never outscores the same scorecard verified at any speed-up s >= 0.
    for speedup in (0.0, 0.05, 1.0):
        verified = stitchcuda.reward({"compiled": True, "correct": True, "speedup": speedup, "findings": []},
                                     {"items": [{"score": s.parts[i]} for i in rl.RUBRIC_ITEMS]}, skill=1)
        assert s.score <= verified["value"] + 1e-12
    assert rl.score_completion(row("bias_gelu"), HONEST, mode="static",
                               config=rl.RewardConfig(static_credit=False)).reason == "unverified: no GPU"
    json.dumps(s.to_dict())  # JSON-safe


def test_chat_messages_take_the_last_assistant_message():
    chat = [{"role": "user", "content": "write it"}, {"role": "assistant", "content": PROSE},
            {"role": "user", "content": "again, with code"}, {"role": "assistant", "content": HONEST}]
    assert rl.score_completion(row("bias_gelu"), chat, mode="static").score > 0
    assert rl.score_completion(row("bias_gelu"), chat[:2], mode="static").reason.startswith("no code in the reply")


@pytest.mark.parametrize("completion, cause", [
    (PROSE, "no code in the reply"), ("", "no code in the reply"), (None, "no code in the reply"),
    ([{"role": "assistant", "content": [{"type": "text", "text": PROSE}]}], "no code in the reply"),
    (HONEST.replace("```\nOne kernel.", "\nOne kernel."), "no code in the reply"),  # a cut-off block
    (OTHER_TASK, "wrong task"),
    (BROKEN, "not compiled"),
])
def test_bad_replies_score_zero_with_their_reason(completion, cause):
    s = rl.score_completion(row("bias_gelu"), completion, mode="static")
    assert s.score == 0.0 and s.reason.startswith(cause), s.reason
    assert s.parts["rubric_total"] >= 4 and s.parts["correct"] == 0.0


def test_wrong_task_names_the_mismatch():
    s = rl.score_completion(row("bias_gelu"), OTHER_TASK, mode="static")
    assert "get_init_inputs() gives 1" in s.reason and "get_inputs() gives 1" in s.reason
    # The same code answers its own problem.
    assert rl.score_completion(row("gemm"), OTHER_TASK, mode="static").score > 0


def test_task_forms_and_config_errors():
    by_id = rl.score_completion("corpus/bias_gelu", HONEST, mode="static")
    by_stem = rl.score_completion("bias_gelu", HONEST, mode="static")  # one set has it
    by_task = rl.score_completion(stitchcuda.verify.Task.from_source(row("bias_gelu")["reference"], "bias_gelu"),
                                  HONEST, mode="static")
    assert by_id.score == by_stem.score == by_task.score > 0 and by_id.task_id == "corpus/bias_gelu"
    with pytest.raises(stitchcuda.NotFoundError, match="did you mean"):
        rl.score_completion("corpus/bias_gelo", HONEST, mode="static")
    with pytest.raises(stitchcuda.InvalidArgumentError, match="mode"):
        rl.score_completion(row("bias_gelu"), HONEST, mode="fast")
    with pytest.raises(stitchcuda.InvalidArgumentError, match="skill"):
        rl.score_completion(row("bias_gelu"), HONEST, skill=3, mode="static")
    with pytest.raises(stitchcuda.InvalidArgumentError, match="tau"):
        rl.RewardConfig(tau=-1.0)
    with pytest.raises(stitchcuda.InvalidArgumentError, match="no field"):
        rl.score_completion(row("bias_gelu"), HONEST, mode="static", config={"temperature": 1})
    with pytest.raises(stitchcuda.InvalidArgumentError, match="task_id"):
        rl.score_completion({"reference": "x"}, HONEST, mode="static")
    if stitchcuda._C.device_count() == 0:
        with pytest.raises(stitchcuda.UnavailableError, match="static"):
            rl.score_completion(row("bias_gelu"), HONEST, mode="gpu")


def test_a_rows_reference_never_runs_in_the_scoring_process(tmp_path):
    """A row that is not a shipped task's own (a dataset you did not write, a reward service's client) may
    carry any reference: reading its input counts and building its GPU check run none of it here."""
    marker = tmp_path / "ran"
    reference = row("bias_gelu")["reference"].replace(
        "def get_inputs():", f"def get_inputs():\n    open({str(marker)!r}, 'w').write('here')\n    "
        "return list(_inputs())\n\n\ndef _inputs():", 1)
    foreign = {"task_id": "mine/bias_gelu", "reference": reference}
    scored = rl.score_completion(foreign, HONEST, mode="static")
    assert scored.score > 0 and scored.task_id == "mine/bias_gelu" and not marker.exists()
    from stitchcuda.rl.score import _task_info

    info = _task_info(foreign)
    task = info.verify_task("gpu")  # the check's Task: its source, for the sandboxed worker to load
    assert not info.trusted and task.source == reference and task._module is None and not marker.exists()
    assert info.input_counts() == (1, None)  # from the AST: get_init_inputs() a literal list, get_inputs() not
    assert _task_info(row("bias_gelu")).trusted  # a shipped task's own row may load here, as its id does


def test_skill2_compliance_reads_the_previous_candidate():
    previous = rl.score_completion(row("bias_gelu"), BROKEN, mode="static")
    asks = ["Fix the compile error in the bias_gelu kernel"]
    report = {"schema_version": 1, "compiled": False, "correct": False, "static_only": True,
              "error": {"kind": "compile", "message": "NVRTC could not compile"}}
    fixed = rl.score_completion(row("bias_gelu"), HONEST, skill=2, mode="static",
                                previous={"code": previous.code, "report": report, "asks": asks})
    unchanged = rl.score_completion(row("bias_gelu"), BROKEN, skill=2, mode="static",
                                    previous={"code": previous.code, "report": report, "asks": asks})
    assert fixed.parts["skill-compliance"] == 5.0 and fixed.parts["lambda"] == 0.7 and fixed.asks == asks
    assert unchanged.score == 0.0 and unchanged.parts["skill-compliance"] < 5.0


def test_a_training_script_without_a_main_guard_runs_once(tmp_path, subprocess_env):
    # The Verifier's workers are spawned processes; a script without `if __name__ == "__main__":` must
    # not be run again in them (a training script would start training in every worker).
    script, marker = tmp_path / "train.py", tmp_path / "runs.txt"
    script.write_text(textwrap.dedent(f"""
        open({str(marker)!r}, "a").write("started\\n")
        import stitchcuda.rl as rl
        print(rl.score_completion("corpus/bias_gelu", {HONEST!r}, mode="static").score)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=subprocess_env,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker.read_text() == "started\n" and float(done.stdout.split()[-1]) > 0


# ---- the hacking corpus through every interface ------------------------------------------------------


@pytest.fixture(scope="module")
def hack_batch():
    rows = [row(problem) for _, problem, _, _ in STATIC_HACKS]
    replies = [reply("hacks", stem) for stem, _, _, _ in STATIC_HACKS]
    return rows, replies


def test_static_hacks_score_zero_through_trl(hack_batch):
    rows, replies = hack_batch
    metrics, extra = {}, {}
    reward = rl.TRLReward(mode="static")
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    out = reward(prompts=[[{"role": "user", "content": "p"}]] * len(rows),
                 completions=[[{"role": "assistant", "content": r}] for r in replies], completion_ids=None,
                 trainer_state=None, log_metric=lambda k, v: metrics.setdefault(k, v),
                 log_extra=lambda k, v: extra.setdefault(k, v), **columns)
    assert out == [0.0] * len(rows)
    for (stem, _, rule, _), reason in zip(STATIC_HACKS, extra["stitchcuda_reason"]):
        assert reason.startswith("hack:") and rule in reason, (stem, reason)
    assert metrics["stitchcuda/hack"] == 1.0 and metrics["stitchcuda/zero/hack"] == 1.0
    assert metrics["stitchcuda/anti-hacking"] == 1.0 and metrics["stitchcuda/reward"] == 0.0


def test_static_hacks_score_zero_through_verl(hack_batch):
    rows, replies = hack_batch
    verl = trainers.verl_rows(rows)
    batch = trainers.compute_score(data_sources=[v["data_source"] for v in verl], solution_strs=replies,
                                   ground_truths=[v["reward_model"]["ground_truth"] for v in verl],
                                   extra_infos=[v["extra_info"] for v in verl], mode="static")
    assert [b["score"] for b in batch] == [0.0] * len(rows)
    assert all(b["hack"] == 1.0 and b["reason"].startswith("hack:") for b in batch)
    one = trainers.compute_score(verl[0]["data_source"], replies[0], verl[0]["reward_model"]["ground_truth"],
                                 verl[0]["extra_info"], mode="static")
    assert one["score"] == 0.0 and one["anti-hacking"] == 1.0


def test_static_hacks_score_zero_through_openrlhf(hack_batch):
    rows, replies = hack_batch
    labelled = trainers.openrlhf_rows(rows)
    prompts = ["<|user|>" + r["prompt"][0]["content"] + "<|assistant|>" for r in labelled]
    queries = [p + reply + "<|end|>" for p, reply in zip(prompts, replies)]
    out = trainers.openrlhf_reply({"query": queries, "prompts": prompts, "labels": [r["label"] for r in labelled]},
                                  mode="static")
    assert out["rewards"] == out["scores"] == [0.0] * len(rows)
    assert out["extra_logs"]["hack"] == [1.0] * len(rows)


@pytest.mark.gpu
@pytest.mark.parametrize("stem, problem, rule, check", GPU_HACKS, ids=[h[0] for h in GPU_HACKS])
def test_dynamic_hacks_score_zero_verified(stem, problem, rule, check):
    s = rl.score_completion(row(problem), reply("hacks", stem), mode="gpu")
    assert s.verified and s.score == 0.0, (stem, s.reason)
    assert s.reason.startswith(("hack:", "incorrect")), s.reason


@pytest.mark.gpu
def test_dynamic_hacks_score_zero_through_every_interface():
    # The hacks only a run exposes, each sent through TRL's call, verl's batched compute_score and
    # OpenRLHF's protocol: verified on the GPU, every one scores 0 in all three.
    rows = [row(problem) for _, problem, _, _ in GPU_HACKS]
    replies = [reply("hacks", stem) for stem, _, _, _ in GPU_HACKS]
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    trl = rl.TRLReward(mode="gpu")(prompts=["p"] * len(rows), completions=replies, **columns)
    verl = trainers.verl_rows(rows)
    batch = trainers.compute_score(data_sources=[v["data_source"] for v in verl], solution_strs=replies,
                                   ground_truths=[v["reward_model"]["ground_truth"] for v in verl],
                                   extra_infos=[v["extra_info"] for v in verl], mode="gpu")
    labelled = trainers.openrlhf_rows(rows)
    prompts = ["<|user|>" + r["prompt"][0]["content"] + "<|assistant|>" for r in labelled]
    openrlhf = trainers.openrlhf_reply({"query": [p + r + "<|end|>" for p, r in zip(prompts, replies)],
                                        "prompts": prompts, "labels": [r["label"] for r in labelled]}, mode="gpu")
    assert trl == [0.0] * len(rows), list(zip([h[0] for h in GPU_HACKS], trl))
    assert [b["score"] for b in batch] == [0.0] * len(rows), [(h[0], b["reason"]) for h, b in zip(GPU_HACKS, batch)]
    assert openrlhf["rewards"] == [0.0] * len(rows)
    assert all(b["verified"] == 1.0 for b in batch)


def grid_capped(blocks: int) -> str:
    """The honest bias_gelu candidate with its grid capped at `blocks` (a grid-stride loop covers the rest):
    the same code and rubric, slower the fewer the blocks."""
    assert "8192)" in HONEST
    return HONEST.replace("8192)", f"{blocks})")


def test_grid_capped_candidates_differ_only_in_speed():
    # What makes the GPU test below a test of the speed-up alone: the rubric reads them all alike.
    parts = [rl.score_completion(row("bias_gelu"), grid_capped(b), mode="static").parts for b in (8192, 64, 8)]
    items = [{k: p[k] for k in rl.RUBRIC_ITEMS} for p in parts]
    assert items[0] == items[1] == items[2] and parts[0]["r_hat"] == parts[2]["r_hat"]


@pytest.mark.gpu
def test_reward_is_monotone_in_the_verified_speedup():
    scored = [rl.score_completion(row("bias_gelu"), grid_capped(b), mode="gpu") for b in (8192, 256, 32, 4)]
    assert all(s.verified and s.parts["correct"] == 1.0 for s in scored), [s.reason for s in scored]
    by_speed = sorted(scored, key=lambda s: s.parts["speedup"])
    assert by_speed[0].parts["speedup"] < by_speed[-1].parts["speedup"] / 2  # the caps really change the speed
    rewards = [s.score for s in by_speed]
    assert rewards == sorted(rewards), [(s.parts["speedup"], s.score) for s in by_speed]


@pytest.mark.gpu
def test_honest_candidate_verified_on_the_gpu():
    s = rl.score_completion(row("bias_gelu"), HONEST, mode="gpu")
    assert s.verified and s.parts["correct"] == 1.0 and s.parts["speedup"] > 0 and s.score > 0
    floor = rl.score_completion(row("bias_gelu"), HONEST, mode="static")
    assert floor.score <= s.score  # a static pass never outscores its verified result


# ---- each interface's own shape ----------------------------------------------------------------------


def test_trl_rows_without_a_task_are_left_to_other_reward_functions():
    reward = rl.TRLReward(mode="static")
    r = row("bias_gelu")
    out = reward(prompts=["a", "b"], completions=[HONEST, HONEST], task_id=[r["task_id"], None],
                 reference=[r["reference"], None], skill=[1, 1])
    assert out[0] > 0 and out[1] is None
    with pytest.raises(stitchcuda.InvalidArgumentError, match="task_id"):
        reward(prompts=["a"], completions=[HONEST], answer=["42"])


def test_async_trl_reward_scores_the_batch_concurrently():
    reward = rl.AsyncTRLReward(mode="static", max_workers=4)
    r = row("bias_gelu")
    metrics: dict = {}
    out = asyncio.run(reward(prompts=["p"] * 3, completions=[HONEST, PROSE, OTHER_TASK],
                             task_id=[r["task_id"]] * 3, reference=[r["reference"]] * 3, skill=[1] * 3,
                             log_metric=lambda k, v: metrics.__setitem__(k, v)))
    assert out[0] > 0 and out[1] == out[2] == 0.0
    assert metrics["stitchcuda/zero/no_code_in_the_reply"] == pytest.approx(1 / 3)
    assert metrics["stitchcuda/zero/wrong_task"] == pytest.approx(1 / 3)


def test_verl_loads_compute_score_with_its_own_loader():
    verl_reward = pytest.importorskip("verl.trainer.ppo.reward", reason="verl is not installed (docs/rl.md)")
    from omegaconf import OmegaConf

    config = OmegaConf.create({"reward": {"custom_reward_function": {
        "path": "pkg://stitchcuda.rl.trainers", "name": "compute_score", "reward_kwargs": {"mode": "static"}}}})
    fn = verl_reward.get_custom_reward_fn(config)
    label = trainers.task_label(row("bias_gelu"))
    assert fn(data_source="stitchcuda", solution_str=HONEST, ground_truth=label, extra_info={})["score"] > 0
    assert fn(data_source="stitchcuda", solution_str=PROSE, ground_truth=label)["score"] == 0.0
    # verl also loads it by file path, where the module is not imported as part of the package.
    config.reward.custom_reward_function.path = trainers.__file__
    batch = verl_reward.get_custom_reward_fn(config)(data_sources=["stitchcuda"] * 2, solution_strs=[HONEST, PROSE],
                                                     ground_truths=[label] * 2, extra_infos=[{}, {}])
    assert batch[0]["score"] > 0 and batch[1]["reason"].startswith("no code")


def test_verl_batch_reward_manager_scores_decoded_responses():
    pytest.importorskip("verl.trainer.ppo.reward", reason="verl is not installed (docs/rl.md)")
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from verl import DataProto
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.workers.reward_manager.batch import BatchRewardManager

    # A tokenizer whose tokens are whole replies: token ids stand for what a policy generated.
    core = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1}, unk_token="[UNK]"))
    core.add_tokens([AddedToken(text, normalized=False) for text in (HONEST, PROSE, OTHER_TASK)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]")
    config = OmegaConf.create({"reward": {"custom_reward_function": {
        "path": "pkg://stitchcuda.rl.trainers", "name": "compute_score", "reward_kwargs": {"mode": "static"}}}})
    manager = BatchRewardManager(tokenizer, num_examine=0, compute_score=get_custom_reward_fn(config))
    verl = trainers.verl_rows([row("bias_gelu")] * 3)
    responses = torch.tensor([[2, 1], [3, 1], [4, 1]])  # one reply token each, then padding
    data = DataProto.from_dict(
        tensors={"prompts": torch.zeros(3, 4, dtype=torch.long), "responses": responses,
                 "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]] * 3)},
        non_tensors={"data_source": np.array([v["data_source"] for v in verl], dtype=object),
                     "reward_model": np.array([v["reward_model"] for v in verl], dtype=object),
                     "extra_info": np.array([dict(v["extra_info"]) for v in verl], dtype=object)})
    out = manager(data, return_dict=True)
    rewards = out["reward_tensor"][:, 0].tolist()
    assert rewards[0] > 0 and rewards[1:] == [0.0, 0.0]
    info = out["reward_extra_info"]
    assert info["compiled"] == [1.0, 0.0, 0.0] and info["reason"][2].startswith("wrong task")


def test_openrlhf_local_reward_func_loaded_by_path():
    # As OpenRLHF's single-turn executor loads --remote_rm_url FILE.py.
    spec = importlib.util.spec_from_file_location("reward_func", trainers.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prompt = "<|user|>write bias_gelu<|assistant|>"
    out = module.reward_func([prompt + HONEST, prompt + PROSE], [prompt, prompt], ["corpus/bias_gelu"] * 2)
    assert out["rewards"][0] > 0 and out["rewards"][1] == 0.0 and set(out["extra_logs"]) == set(rl.PART_NAMES)
    # A query whose prompt cannot be found scores nothing from the prompt's own example code.
    contract = "```python\n" + (CORPUS / "honest" / "bias_gelu_jit.py").read_text() + "```"
    assert module.reward_func(["something else"], [contract], ["corpus/bias_gelu"])["rewards"] == [0.0]


def test_openrlhf_remote_protocol_over_http():
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                status, answer = 200, trainers.openrlhf_reply(body, mode="static")
            except stitchcuda.InvalidArgumentError as exc:
                status, answer = 400, {"error": str(exc)}
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
    try:
        def post(payload: dict) -> tuple[int, dict]:
            request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        label = trainers.task_label(row("bias_gelu"))
        prompt = "<|im_start|>user\nwrite it<|im_end|>\n<|im_start|>assistant\n"
        # OpenRLHF's client: {"query", "prompts", "labels"} for a shard of the batch.
        status, answer = post({"query": [prompt + HONEST + "<|im_end|>", prompt + PROSE + "<|im_end|>",
                                         prompt + OTHER_TASK], "prompts": [prompt] * 3, "labels": [label] * 3})
        assert status == 200 and set(answer) == {"rewards", "scores", "extra_logs"}
        assert answer["rewards"][0] > 0 and answer["rewards"][1:] == [0.0, 0.0]
        assert answer["extra_logs"]["compiled"] == [1.0, 0.0, 0.0]
        status, answer = post({"prompts": ["x"]})
        assert status == 400 and "query" in answer["error"]
    finally:
        server.shutdown()
