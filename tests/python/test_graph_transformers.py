"""transformers models as users have them, on any machine: a causal LM returns a DynamicCache beside its
logits, which torch.export cannot trace through as it is; optimize() exports it returning the output's
tensors and rebuilds the output around them (cache included), and a flag such as use_cache=False is an
input without a tensor, fixed at its value. The graphs are checked here by running them with ATen on
the CPU against the model; the GPU tests run the programs."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import stitchcuda
from stitchcuda.graph import capture, reference_values

graph_module = importlib.import_module("stitchcuda.graph.module")

transformers = pytest.importorskip("transformers")

PLANNED = "planned and compiled only"


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256)
    return transformers.LlamaForCausalLM(config).eval()


def _rebuilt(graph, inputs):
    values = reference_values(graph, list(inputs))
    return pytree.tree_unflatten([values[v.name] for v in graph.outputs], graph.out_spec)


def test_a_causal_lm_with_its_cache_is_captured_and_its_output_rebuilt():
    model, ids = _llama(), torch.randint(0, 256, (2, 24))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(model, (ids,))
        want = model(ids)
    assert any("DynamicCache" in note[0] for note in graph.notes), graph.notes
    got = _rebuilt(graph, (ids,))
    # The same structure: logits and a DynamicCache holding each layer's keys and values.
    assert type(got) is type(want) and type(got.past_key_values) is type(want.past_key_values)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert len(got.past_key_values.layers) == len(want.past_key_values.layers) == 2
    for a, b in zip(got.past_key_values.layers, want.past_key_values.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the plan-only path runs where there is no GPU")
def test_optimize_plans_a_causal_lm_with_or_without_its_cache():
    model, ids = _llama(), torch.randint(0, 256, (2, 24))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with_cache = stitchcuda.optimize(model, (ids,), progress=False)
        without = stitchcuda.optimize(model, (ids,), {"use_cache": False}, progress=False)
    for fast in (with_cache, without):
        assert PLANNED in fast.report.reason, fast.report.reason
        assert fast.report.op_counts.get("aten::mm", 0) + fast.report.op_counts.get("aten::addmm", 0) >= 14
    assert any("DynamicCache" in d for d, _ in with_cache.report.decisions)
    fixed = [why for d, why in without.report.decisions if d.startswith("1 input(s) without a tensor fixed")]
    assert fixed and fixed[0].startswith("use_cache=False")
    assert not any("DynamicCache" in d for d, _ in without.report.decisions)


def _architecture(name: str):
    """A small model of each family users bring, with the inputs a user passes."""
    torch.manual_seed(0)
    ids, mask, image = torch.randint(0, 256, (2, 16)), torch.ones(2, 16, dtype=torch.long), torch.randn(2, 3, 64, 64)
    small = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=256)
    if name == "mistral":  # a causal LM with a padding mask (the mask's creation runs as ATen steps)
        return (transformers.MistralForCausalLM(transformers.MistralConfig(**small, num_key_value_heads=2)), (ids,),
                {"attention_mask": mask})
    if name == "bert":  # an encoder classifier with token types
        return (transformers.BertForSequenceClassification(transformers.BertConfig(**small)), (ids,),
                {"attention_mask": mask, "token_type_ids": torch.zeros_like(ids)})
    if name == "vit":
        return (transformers.ViTModel(transformers.ViTConfig(**{k: v for k, v in small.items() if k != "vocab_size"},
                                                             image_size=64, patch_size=8)), (image,), None)
    if name == "convnext":  # depthwise 7x7 convolutions, channels-last layer norms
        return transformers.ConvNextModel(transformers.ConvNextConfig(hidden_sizes=[32, 64], depths=[1, 1],
                                                                       num_stages=2)), (image,), None
    if name == "whisper-encoder":  # audio: convolutions over mel frames, then attention
        config = transformers.WhisperConfig(encoder_layers=2, decoder_layers=1, d_model=64, encoder_attention_heads=4,
                                            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                            num_mel_bins=80, max_source_positions=100)
        return transformers.WhisperModel(config).encoder, (torch.randn(2, 80, 200),), None
    if name == "whisper":  # the whole encoder-decoder: an EncoderDecoderCache beside the decoder's states
        config = transformers.WhisperConfig(encoder_layers=1, decoder_layers=1, d_model=64, encoder_attention_heads=4,
                                            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                            num_mel_bins=80, max_source_positions=100, vocab_size=256, pad_token_id=0,
                                            bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
        return transformers.WhisperModel(config), (torch.randn(2, 80, 200),), {"decoder_input_ids": ids[:, :6]}
    decoders = {"gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4,
                                                                                      vocab_size=256)),
                "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small, num_key_value_heads=2)),
                "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**small, num_key_value_heads=2,
                                                                                     pad_token_id=0)),
                "gemma": lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**small, num_key_value_heads=2,
                                                                                        head_dim=16)),
                "opt": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
                    num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=4, vocab_size=256,
                    word_embed_proj_dim=64)),
                "falcon": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
                    num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)),
                "bloom": lambda: transformers.BloomForCausalLM(transformers.BloomConfig(n_layer=2, hidden_size=64, n_head=4,
                                                                                        vocab_size=256))}
    if name in decoders:  # causal LMs: logits and a DynamicCache
        return decoders[name](), (ids,), None
    if name == "roberta":  # position ids from a cumsum over the padding mask
        return transformers.RobertaModel(transformers.RobertaConfig(**small)), (ids,), {"attention_mask": mask}
    if name == "clip-vision":
        config = transformers.CLIPVisionConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                               num_attention_heads=4, image_size=64, patch_size=8)
        return transformers.CLIPVisionModel(config), (image,), None
    if name == "swin":  # windows: pads, rolls and index gathers
        config = transformers.SwinConfig(image_size=64, patch_size=4, embed_dim=32, depths=[1, 1], num_heads=[2, 4],
                                         window_size=4)
        return transformers.SwinModel(config), (image,), None
    if name == "segformer":
        config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[32, 64],
                                              num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2],
                                              mlp_ratios=[2, 2])
        return transformers.SegformerModel(config), (image,), None
    if name == "wav2vec2":  # raw audio through a convolution stack
        config = transformers.Wav2Vec2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                             num_attention_heads=4, conv_dim=(32, 32), conv_stride=(5, 2),
                                             conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                             num_conv_pos_embedding_groups=4)
        return transformers.Wav2Vec2Model(config), (torch.randn(2, 4000),), None
    if name == "t5":  # encoder-decoder: logits and an EncoderDecoderCache
        config = transformers.T5Config(num_layers=2, d_model=64, d_ff=128, num_heads=4, vocab_size=256, d_kv=16)
        return transformers.T5ForConditionalGeneration(config), (ids,), {"decoder_input_ids": ids[:, :8]}
    if name == "bart":  # decoder inputs shifted from the input ids inside the model
        config = transformers.BartConfig(d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                                         decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                         vocab_size=256)
        return transformers.BartModel(config), (ids,), None
    raise ValueError(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the plan-only path runs where there is no GPU")
@pytest.mark.parametrize("name", ["mistral", "gpt2", "qwen2", "phi3", "gemma", "opt", "falcon", "bloom", "bert", "roberta",
                                  "vit", "clip-vision", "swin", "convnext", "segformer", "whisper-encoder", "wav2vec2",
                                  "t5", "bart", "whisper"])
def test_each_model_family_is_captured_planned_and_compiled(name):
    model, args, kwargs = _architecture(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = stitchcuda.optimize(model.eval(), args, kwargs, progress=False)
    assert PLANNED in fast.report.reason, fast.report.reason
    kinds = {g["kind"] for g in fast.report.groups}
    assert kinds & {"gemm", "conv"} and kinds & {"pointwise", "reduction"}, kinds


def test_an_encoder_decoder_with_its_cache_is_captured_and_its_output_rebuilt():
    # T5 and BART return an EncoderDecoderCache (a self-attention and a cross-attention DynamicCache), which
    # pytree does not know: optimize() registers it, so the graph's outputs rebuild it around the tensors.
    config = transformers.T5Config(num_layers=1, d_model=32, d_ff=64, num_heads=2, vocab_size=64, d_kv=16)
    model, ids = transformers.T5ForConditionalGeneration(config).eval(), torch.randint(0, 64, (1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = graph_module.KeywordCall(model, 1, ("decoder_input_ids",))
        graph = capture(traced, (ids, ids[:, :5]))
        want = model(ids, decoder_input_ids=ids[:, :5])
    assert any("EncoderDecoderCache" in note[0] for note in graph.notes), graph.notes
    got = _rebuilt(graph, (ids, ids[:, :5]))
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.encoder_last_hidden_state, want.encoder_last_hidden_state, rtol=1e-5, atol=1e-5)
    cache, expected = got.past_key_values, want.past_key_values
    assert type(cache) is type(expected)
    for part in ("self_attention_cache", "cross_attention_cache"):  # 5 decoder positions, 8 encoder positions
        for a, b in zip(getattr(cache, part).layers, getattr(expected, part).layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
    assert cache.self_attention_cache.layers[0].keys.shape[-2] == 5
    assert cache.cross_attention_cache.layers[0].keys.shape[-2] == 8


def test_a_cache_type_without_pytree_support_names_the_fix_and_other_errors_do_not():
    from stitchcuda.graph.capture import _capture_error

    unknown = RuntimeError("Found <class 'transformers.cache_utils.StaticCache'> in output, which is not a known type.")
    assert "pass use_cache=False in kwargs=" in str(_capture_error(unknown, transformers=True))
    own = RuntimeError("running_mean should contain 320 elements not 2560")  # the model's own error
    message = str(_capture_error(own, transformers=True))
    assert "running_mean should contain 320" in message and "use_cache" not in message


@pytest.mark.gpu
@pytest.mark.parametrize("use_cache", [True, False])
def test_gpu_a_causal_lm_runs_as_a_program_and_returns_what_the_model_returns(use_cache):
    model = _llama().cuda()
    ids = torch.randint(0, 256, (2, 24), device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = stitchcuda.optimize(model, (ids,), {"use_cache": use_cache}, keep_slower=True, measure=False,
                                   progress=False)
        assert fast.report.status == "optimized", fast.report.reason
        other = torch.randint(0, 256, (2, 24), device="cuda")
        got, want = fast(other, use_cache=use_cache), model(other, use_cache=use_cache)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    if use_cache:
        for a, b in zip(got.past_key_values.layers, want.past_key_values.layers, strict=True):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-4)
    else:
        assert got.past_key_values is None
