"""The transformer-inference bench (stitchcuda/bench/inference.py): the decode's speed-of-light arithmetic, the
rows' derived numbers and tables, token identity, the options, and the refusals where the machine lacks a GPU
or transformers; tiny transformers models on the CPU where transformers is installed, the whole bench on a GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import pytest
import torch

from stitchcuda import cli
from stitchcuda.bench import inference as inf

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


# ---- the speed of light ----------------------------------------------------------------------------------

def test_speed_of_light_counts_every_step_weights_and_the_growing_cache():
    # 4 new tokens: 3 decode steps over caches of 11, 12 and 13 positions, for 2 sequences.
    sol = inf.decode_speed_of_light(10**9, 1000, batch=2, prompt=10, new_tokens=4, dram_tb_s=1.0)
    want_bytes = 3 * 10**9 + 2 * 1000 * (11 + 12 + 13)
    assert sol["steps"] == 3 and sol["bytes"] == want_bytes
    assert sol["ms"] == pytest.approx(want_bytes / 1e12 * 1e3)
    assert sol["tokens_per_s"] == pytest.approx(2 * 3 / (want_bytes / 1e12))
    assert sol["first_step_ms"] == pytest.approx((10**9 + 2 * 1000 * 11) / 1e9)


def test_speed_of_light_sums_like_a_loop_at_the_issue_sizes():
    w, kv, b, p, n = 2_075_000_000, 32768, 8, 2048, 256
    sol = inf.decode_speed_of_light(w, kv, b, p, n, dram_tb_s=3.35)
    assert sol["bytes"] == sum(w + b * kv * (p + j) for j in range(1, n))


def test_speed_of_light_without_a_bandwidth_or_a_decode():
    sol = inf.decode_speed_of_light(100, 10, 1, 4, 3, dram_tb_s=0.0)
    assert sol["bytes"] == 2 * 100 + 10 * (5 + 6) and sol["ms"] is None and sol["tokens_per_s"] is None
    with pytest.raises(ValueError, match="at least 2 new tokens"):
        inf.decode_speed_of_light(100, 10, 1, 4, 1, dram_tb_s=1.0)


# ---- rows ------------------------------------------------------------------------------------------------------

def _causal_row(**times):
    return {"model": "llama", "dtype": "bf16", "batch": 8, "prompt": 512, "new_tokens": 257,
            "weight_bytes": 2 * 10**9, "kv_bytes_per_position": 32768, **times}


def test_derive_causal_rates_fractions_and_ratios():
    row = inf.derive_causal(_causal_row(eager_prefill_ms=100.0, eager_generate_ms=100.0 + 256 * 20.0,
                                        compile_prefill_ms=80.0, compile_generate_ms=80.0 + 256 * 8.0,
                                        stitch_prefill_ms=50.0, stitch_generate_ms=50.0 + 256 * 5.0), dram_tb_s=4.0)
    assert row["eager_ms_per_step"] == pytest.approx(20.0)
    assert row["eager_tokens_per_s"] == pytest.approx(8 * 256 / (256 * 20.0 / 1e3))  # 400
    assert row["stitch_tokens_per_s"] == pytest.approx(8 / 5e-3)
    assert row["stitch_decode_over_compile"] == pytest.approx(8 / 5, abs=1e-3)
    assert row["stitch_prefill_over_compile"] == pytest.approx(80 / 50, abs=1e-3)
    assert row["compile_decode_over_eager"] == pytest.approx(20 / 8, abs=1e-3)
    sol = row["speed_of_light"]["tokens_per_s"]
    assert row["stitch_fraction_of_speed_of_light"] == pytest.approx(row["stitch_tokens_per_s"] / sol, abs=1e-3)


def test_derive_causal_leaves_missing_and_noisy_columns_without_rates():
    row = inf.derive_causal(_causal_row(eager_prefill_ms=100.0, eager_generate_ms=99.0,
                                        stitch_error="StitchCUDA decode is not available"), dram_tb_s=4.0)
    assert row["eager_tokens_per_s"] is None and "eager_fraction_of_speed_of_light" not in row
    assert "stitch_tokens_per_s" not in row and not any(k.startswith("stitch_decode_over") for k in row)


def test_derive_forward_picks_the_fastest_compile_mode():
    row = inf.derive_forward({"eager_ms": 10.0, "compile_default_ms": 8.0, "compile_reduce_overhead_ms": 5.0,
                              "stitch_ms": 4.0})
    assert row["best_compile_mode"] == "reduce-overhead" and row["best_compile_ms"] == 5.0
    assert row["stitch_over_best_compile"] == 1.25 and row["best_compile_over_eager"] == 2.0
    assert row["stitch_over_eager"] == 2.5
    failed = inf.derive_forward({"eager_ms": 10.0, "compile_default_ms": 8.0, "compile_reduce_overhead_error": "x"})
    assert failed["best_compile_mode"] == "default" and "stitch_over_best_compile" not in failed


def test_token_identity_counts_and_finds_the_first_difference():
    want = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert inf.token_identity(want.clone(), want) == {"identical": 8, "compared": 8, "first_difference": None}
    got = want.clone()
    got[1, 2:] = 0
    assert inf.token_identity(got, want) == {"identical": 6, "compared": 8, "first_difference": 2}
    short = inf.token_identity(want[:, :3], want)
    assert short["identical"] == 0 and "shape" in short["note"]


def test_tables_show_rows_errors_and_what_the_deadline_left_out():
    causal = inf.derive_causal(_causal_row(eager_prefill_ms=100.0, eager_generate_ms=5220.0,
                                           stitch_error="StitchCUDA decode is not available in this build"), 3.35)
    causal["compile_tokens"] = {"identical": 2050, "compared": 2056, "first_difference": 40}
    forward = inf.derive_forward({"model": "bert", "dtype": "fp32", "input_shape": [32, 512], "eager_ms": 10.0,
                                  "compile_default_ms": 8.0, "stitch_ms": 6.0, "stitch_correct": True})
    text = inf.format_tables({"device": {"gpu": "NVIDIA H100", "dram_tb_s": 3.35}, "torch": "2.11", "transformers": "5",
                              "settings": {"new_tokens": 257}, "causal": [causal], "forward": [forward],
                              "not_run": ["vit[bf16]"]})
    lines = text.splitlines()
    header = lines.index(" | ".join(inf.CAUSAL_TABLE))
    cells = dict(zip(inf.CAUSAL_TABLE, lines[header + 1].split(" | ")))
    assert cells["eager_tokens_per_s"] == f"{8 * 256 / 5.12:.4g}" and cells["stitch_tokens_per_s"] == "-"
    assert cells["compile_identical"] == "2050/2056"
    assert "llama[bf16] batch 8 prompt 512 stitch_error: StitchCUDA decode is not available in this build" in text
    assert cells["stitch_accurate"] == "-"  # no verdict without the column
    fwd = dict(zip(inf.FORWARD_TABLE, lines[lines.index(" | ".join(inf.FORWARD_TABLE)) + 1].split(" | ")))
    assert fwd["stitch_over_best_compile"] == "1.333" and fwd["correct_or_accurate"] == "True"
    assert lines[-1] == "not run (the deadline passed): vit[bf16]"


def test_tables_show_verdicts_and_rows_cut_short():
    accurate = inf.derive_causal(_causal_row(accuracy={"prefill": {"ok": True}, "first_decode_step": {"ok": True}}),
                                 3.35)
    wrong = inf.derive_causal(_causal_row(accuracy={"prefill": {"ok": True}, "first_decode_step": {"ok": False}},
                                          not_run=["stitch"], incomplete=True), 3.35)
    stopped = inf.derive_causal(_causal_row(batch=32, interrupted=True), 3.35)
    text = inf.format_tables({"device": {"gpu": "NVIDIA H100", "dram_tb_s": 3.35}, "torch": "2.11", "transformers": "5",
                              "settings": {"new_tokens": 257}, "causal": [accurate, wrong, stopped], "forward": [],
                              "not_run": [], "interrupted": True})
    lines = text.splitlines()
    first = lines.index(" | ".join(inf.CAUSAL_TABLE)) + 1
    verdicts = [dict(zip(inf.CAUSAL_TABLE, line.split(" | ")))["stitch_accurate"] for line in lines[first:first + 3]]
    assert verdicts == ["True", "False", "-"]
    assert "  llama[bf16] batch 8 prompt 512: columns not run (the deadline passed): stitch" in lines
    assert "  llama[bf16] batch 32 prompt 512: stopped by a signal" in lines
    assert lines[-1] == "stopped by a signal: the rows above are what was measured"


# ---- options and refusals -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--only", "llama,t5"], ["--batches", "0"], ["--prompts", "a"], ["--new-tokens", "1"],
                                  ["--dtypes", "fp16"], ["--deadline", "-1"], ["--repeats", "0"]])
def test_bad_options_are_usage_errors(argv, capsys):
    assert inf.main(argv) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.slow
def test_the_module_answers_help_and_measures_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-m", "stitchcuda.bench.inference", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage:") and done.stderr == "", done.stderr
    assert "--deadline SECONDS" in done.stdout and "--new-tokens N" in done.stdout


def test_lengths_past_the_models_positions_are_refused_before_anything_runs(capsys):
    assert inf.main(["--prompts", "4000", "--json"]) == 2
    assert "4096 positions" in json.loads(capsys.readouterr().out)["error"]
    assert inf.main(["--small", "--prompts", "1000", "--new-tokens", "100"]) == 2
    assert "1024 positions (--small)" in capsys.readouterr().err
    no_lm = inf.settings_from(cli.build_parser().parse_args(["bench", "inference", "--only", "bert", "--prompts",
                                                             "4000"]))
    assert no_lm.prompts == (4000,)  # no causal LM runs: its positions do not bound the lengths


def test_small_runs_take_short_lengths_unless_told():
    parse = cli.build_parser().parse_args
    small = inf.settings_from(parse(["bench", "inference", "--small"]))
    assert (small.prompts, small.new_tokens, small.small) == (inf.SMALL_PROMPTS, inf.SMALL_NEW_TOKENS, True)
    told = inf.settings_from(parse(["bench", "inference", "--small", "--prompts", "64", "--new-tokens", "3"]))
    assert (told.prompts, told.new_tokens) == ((64,), 3)


def test_the_command_line_parses_the_bench_and_its_options():
    args = cli.build_parser().parse_args(["bench", "inference", "--only", "llama,bert", "--batches", "1,8",
                                          "--prompts", "128", "--new-tokens", "16", "--dtypes", "bf16",
                                          "--deadline", "30", "--json"])
    settings = inf.settings_from(args)
    assert args.run is inf.command
    assert (settings.only, settings.batches, settings.prompts, settings.new_tokens, settings.dtypes) == \
        (("llama", "bert"), (1, 8), (128,), 16, ("bf16",))
    assert settings.deadline_s == 30.0 and not settings.small and settings.repeats == 3
    defaults = inf.settings_from(cli.build_parser().parse_args(["bench", "inference"]))
    assert defaults.to_dict() == {"only": list(inf.MODELS), "batches": [1, 8, 32], "prompts": [512, 2048],
                                  "new_tokens": 256, "dtypes": ["bf16", "fp32"], "small": False, "repeats": 3,
                                  "deadline_s": None}


def test_the_deadline_counts_from_the_start_of_the_run():
    started = time.perf_counter() - 10.0
    assert inf.Settings(deadline_s=5.0, start=started).expired()
    assert not inf.Settings(deadline_s=60.0, start=started).expired()
    assert not inf.Settings(deadline_s=None, start=started - 1e6).expired()


@pytest.mark.skipif(torch.cuda.is_available() and HAS_TRANSFORMERS, reason="this machine has a GPU and transformers: "
                    "the bench would run (the GPU test below runs it)")
def test_a_machine_without_a_gpu_or_transformers_gets_exit_3_and_the_reasons(capsys):
    assert cli.main(["bench", "inference", "--json"]) == 3
    error = json.loads(capsys.readouterr().out)["error"]
    assert error.startswith("needs ") and error.endswith("nothing was measured")
    assert ("a CUDA GPU (torch.cuda.is_available() is False" in error) == (not torch.cuda.is_available())
    assert ("pip install transformers" in error) == (not HAS_TRANSFORMERS)


def test_transformers_that_cannot_be_imported_is_named_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # how Python marks a module that cannot be imported
    missing = inf.missing_requirements()
    assert any(m.startswith("the transformers package (ModuleNotFoundError") and "pip install transformers" in m
               for m in missing), missing
    assert any("CUDA GPU" in m for m in missing) == (not torch.cuda.is_available())


# ---- real models ----------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (the bench's models come from it)")
def test_decode_sizes_of_the_llama_like_model():
    import transformers as tf

    with torch.device("meta"):  # the full 1.1B-parameter config, no memory
        model = tf.LlamaForCausalLM(inf.llama_config(tf, small=False)).to(torch.bfloat16)
    sizes = inf.decode_sizes(model)
    layer = 2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192 + 2 * 2048  # q, o; k, v; the MLP; two norms
    assert sizes["params"] == 16 * layer + 2 * 32000 * 2048 + 2048
    assert sizes["weight_bytes"] == 2 * (sizes["params"] - 32000 * 2048)  # the input table is gathered, not read
    assert sizes["kv_bytes_per_position"] == 2 * 16 * 8 * 64 * 2
    assert inf.cache_keyword(model) in ("cache", "past_key_values")


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (the bench's models come from it)")
def test_repeated_sequences_and_the_logit_accuracy_of_a_static_cache_generator_on_the_cpu():
    import transformers as tf

    decode = pytest.importorskip("stitchcuda.graph.decode")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(inf.llama_config(tf, small=True)).eval()
    ids = torch.randint(2, 256, (2, 8))
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)[:, 8:]
        # The model itself runs the steps (nothing optimized): eager's numbers.
        lm = decode.TransformersStaticCacheLM(model, batch_size=2, max_length=12)
        gen = decode.StaticCacheGenerator(lm, max_length=12, batch_size=2)
        for _ in range(2):  # a second sequence on the same cache: prefill zeroes it, position counters too
            assert inf.token_identity(gen.generate(ids, 4)[:, 8:], eager)["identical"] == 8
        accuracy = inf._logit_accuracy(model, gen, ids, eager[:, 0])
    for stage in ("prefill", "first_decode_step"):
        assert accuracy[stage]["ok"] is True and accuracy[stage]["error"] <= accuracy[stage]["bound"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (the bench's models come from it)")
def test_the_bench_runs_tiny_models_on_a_gpu(capsys):
    argv = ["--small", "--only", "llama,bert", "--batches", "2", "--prompts", "16", "--new-tokens", "8",
            "--dtypes", "bf16", "--repeats", "1", "--json"]
    assert inf.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"]["gpu"] and not out["deadline_reached"]
    (row,) = out["causal"]
    assert row["eager_prefill_ms"] > 0 and row["eager_tokens_per_s"] > 0, row
    assert row["compile_tokens"]["compared"] == 2 * 8 and row.get("compile_s") is not None, row
    # StitchCUDA's column: numbers with its programs' status, or the reason it has none.
    assert ("stitch_tokens" in row and row["stitch_prefill_status"]) or row.get("stitch_error"), row
    assert 0 < row["speed_of_light"]["tokens_per_s"]
    (fwd,) = out["forward"]
    assert fwd["model"] == "bert" and fwd["eager_ms"] > 0 and fwd["best_compile_mode"] in inf.COMPILE_MODES, fwd
    assert fwd.get("stitch_ms") or fwd.get("stitch_error"), fwd
    assert "stitch" in fwd["accuracy"] or fwd.get("stitch_error"), fwd
