"""A GRPO smoke run: TRL's GRPOTrainer trains a tiny, randomly initialised Llama for a few steps on
StitchCUDA's Skill 1 prompts with the StitchCUDA reward, and the rewards and every part of them reach the
trainer's logs. Nothing is downloaded: the model comes from a config and the tokenizer is built here.

The tokenizer's words are the prompt's (all unknown to it) plus three whole replies, one token each: an
honest module for the task, a hack of it and prose without code. A random model samples among a few
tokens, so its one-token completions are those replies in varying mixes: the reward sees real code,
the group's rewards differ, and the policy gradient is not zero. On the CPU the reward is static
(unverified); the gpu-marked run verifies each reply on the GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the rl extra is not installed: pip install '.[rl]' in a StitchCUDA clone")

import torch  # noqa: E402

from stitchcuda import _C, rl  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
REPLIES = {
    "honest": "```python\n" + (CORPUS / "honest/bias_gelu_jit.py").read_text() + "```",
    "hack": "```python\n" + (CORPUS / "hacks/torch_does_reference_op.py").read_text() + "```",
    "prose": "I would fuse the bias add and the GELU into one kernel.",
}


def tiny_model_and_tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "[EOS]": 2}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_tokens([AddedToken(text, normalized=False) for text in REPLIES.values()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}answer {% endif %}")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=1, eos_token_id=2, bos_token_id=None)
    return LlamaForCausalLM(config), tokenizer


def train(tmp_path: Path, mode: str, reward) -> list[dict]:
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = tiny_model_and_tokenizer()
    tasks = [rl.find_task("corpus/bias_gelu")]
    dataset = rl.skill1_dataset(tasks * 3, docs=False)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=mode == "static", bf16=False, max_steps=3,
                      per_device_train_batch_size=8, num_generations=8, max_completion_length=1, learning_rate=1e-2,
                      logging_steps=1, report_to=[], save_strategy="no", seed=0, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "reward" in entry]


def check_logs(logs: list[dict], verified: bool) -> None:
    assert len(logs) == 3
    for entry in logs:
        for part in rl.PART_NAMES:
            assert f"stitchcuda/{part}" in entry, (part, sorted(entry))
        assert "rewards/stitchcuda/mean" in entry and "stitchcuda/zero/no_code_in_the_reply" in entry
        if not verified:
            assert entry["stitchcuda/verified"] == 0.0 and entry["stitchcuda/correct"] == 0.0
        # The logged reward is the mean of the replies' rewards, as the reward function computed it.
        assert entry["rewards/stitchcuda/mean"] == pytest.approx(entry["stitchcuda/reward"], abs=1e-6)
    # Over the run, the honest reply was scored above zero and the hack and the prose at zero.
    assert max(e["stitchcuda/reward"] for e in logs) > 0
    assert max(e["stitchcuda/zero/hack"] for e in logs) > 0
    assert max(e["stitchcuda/compiled"] for e in logs) > 0
    assert max(e["grad_norm"] for e in logs) > 0  # the rewards differed within a group: the policy moved
    if verified:  # every reply holding code was run on the GPU
        assert max(e["stitchcuda/verified"] for e in logs) > 0


@pytest.mark.slow
def test_grpo_trains_with_the_static_reward(tmp_path):
    logs = train(tmp_path, "static", rl.TRLReward(mode="static"))
    check_logs(logs, verified=False)


@pytest.mark.slow
def test_grpo_with_the_async_reward(tmp_path):
    logs = train(tmp_path, "static", rl.AsyncTRLReward(mode="static"))
    check_logs(logs, verified=False)


@pytest.mark.gpu
def test_grpo_trains_with_verified_rewards(tmp_path):
    assert _C.device_count() > 0
    logs = train(tmp_path, "gpu", rl.TRLReward(mode="gpu"))
    check_logs(logs, verified=True)
    assert max(e["stitchcuda/correct"] for e in logs) > 0  # the honest module ran correct on the GPU
