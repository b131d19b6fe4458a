"""Transformer inference end to end, eager against torch.compile against StitchCUDA, in one run:
`python -m stitchcuda.bench.inference` (also `stitchcuda bench inference`). Models come from `transformers`
configs with random weights (nothing is downloaded): a Llama-like causal LM (GQA, RoPE, RMSNorm, SwiGLU; 16
layers x 2048, 32 heads / 8 kv heads, 8192 intermediate, 32000 vocab: 1.1B parameters), and GPT-2-like
(small), BERT-like (base) and ViT-like (B/16) forwards.

Causal LMs, per dtype, batch and prompt length: the prefill latency (time to the first token) and decode
tokens/s over `--new-tokens` greedy tokens, in three columns: eager (transformers' generate() with its
DynamicCache), transformers' torch.compile static-cache recipe (the forward compiled with
mode="reduce-overhead", fullgraph=True, generating into a StaticCache; its compile seconds recorded) and
StitchCUDA (StaticCacheGenerator.for_transformers, graph/decode.py: a prefill and a decode program over a
cache they own). Decode time is the whole generation's time less the prefill's; the speed of light of the
decode is (weight bytes + the KV-cache bytes each step reads) / the GPU's DRAM bandwidth (verify/hardware.py),
and each column's tokens/s is reported as a fraction of it. Correctness beside the times: the greedy tokens
of each column against eager's (identical count) and, at bf16, the accuracy rule (bench/precision.py) on
StitchCUDA's logits of the prefill and of the first decode step, against a wide reference of the model.

Forwards (GPT-2-like logits, BERT-like and ViT-like last hidden states), per dtype: eager, torch.compile in
modes default and reduce-overhead (the best of them is the baseline) and stitchcuda.optimize() on the module;
ratios over the best compile mode; outputs against eager's (fp32: the Verifier's tolerance; bf16: the accuracy
rule against a wide reference).

Every time is the Verifier's timer (verify/timing.measure); optimize() runs without its own torch.compile
comparison (compare_compile=False: the compile columns are here). --deadline bounds the run: no row or
column starts after it and the rows finished are reported; SIGINT or SIGTERM ends it with the rows so far
printed (exit 130). --json prints one object, otherwise tables. Exit 3 when the machine lacks a CUDA GPU or
transformers (nothing ran), 2 for bad options. Docs: docs/inference.md.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..cli_support import (EXIT_INTERRUPTED, EXIT_NO_GPU, EXIT_OK, EXIT_USAGE, at_least, no_gpu_reason,
                           non_negative_float, refuse)
from .precision import accuracy_verdict, precision_flags, row_floor
from .reference import compare_outputs, fp64_errors, fp64_reference, reference_dtype
from .results import first_line

PROG = "stitchcuda bench inference"
CAUSAL_MODELS = ("llama",)
FORWARD_MODELS = ("gpt2", "bert", "vit")
MODELS = CAUSAL_MODELS + FORWARD_MODELS
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COMPILE_MODES = ("default", "reduce-overhead")
BATCHES, PROMPTS, NEW_TOKENS = (1, 8, 32), (512, 2048), 256
SMALL_PROMPTS, SMALL_NEW_TOKENS = (32,), 8  # --small's, unless told
COMPILE_RECIPE = ("model.forward = torch.compile(model.forward, mode='reduce-overhead', fullgraph=True); "
                  "generate() into a StaticCache(config, max_cache_len=prompt + new_tokens) passed as its cache "
                  "(generation_config.disable_compile: generate() does not compile the compiled forward again)")


# ---- the models ---------------------------------------------------------------------------------------------
# Full sizes: the models people deploy at these scales; --small: tiny configs of the same architectures
# (CPU-sized), for a quick run that checks the bench itself.

def llama_config(tf: Any, small: bool) -> Any:
    """The Llama-like causal LM's config (`tf`: the transformers module): 1.1B parameters, or tiny."""
    sizes = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024) if small else
             dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096))
    # No end-of-sequence token: every column generates exactly --new-tokens tokens.
    return tf.LlamaConfig(**sizes, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                          eos_token_id=None, pad_token_id=0)


class _Field(torch.nn.Module):
    """A transformers model's forward with one output tensor (`name` of its output), so every column of a
    forward row times and compares the same thing."""

    def __init__(self, model: torch.nn.Module, name: str, **options: Any) -> None:
        super().__init__()
        self.model, self.name, self.options = model, name, options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(x, **self.options), self.name)


def forward_model(tf: Any, name: str, small: bool, device: str = "cuda") -> tuple[torch.nn.Module, Callable[[], tuple]]:
    """(the model, a function making its inputs on `device`) of a forward row, in eval mode."""
    if name == "gpt2":
        sizes = (dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
                 if small else dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024))
        config = tf.GPT2Config(**sizes)
        batch, seq = (1, 16) if small else (4, 1024)
        model = _Field(tf.GPT2LMHeadModel(config), "logits", use_cache=False)
        return model.eval(), lambda: (torch.randint(0, config.vocab_size, (batch, seq), device=device),)
    if name == "bert":
        config = tf.BertConfig(**(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, vocab_size=256) if small else {}))
        batch, seq = (2, 16) if small else (32, 512)
        model = _Field(tf.BertModel(config, add_pooling_layer=False), "last_hidden_state")
        return model.eval(), lambda: (torch.randint(0, config.vocab_size, (batch, seq), device=device),)
    if name == "vit":
        config = tf.ViTConfig(**(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, image_size=32, patch_size=8) if small else {}))
        batch = 2 if small else 64
        model = _Field(tf.ViTModel(config, add_pooling_layer=False), "last_hidden_state")
        return model.eval(), lambda: (torch.randn(batch, 3, config.image_size, config.image_size, device=device),)
    raise ValueError(f"no forward model {name!r}: one of {', '.join(FORWARD_MODELS)}")


# ---- the speed of light of a decode ---------------------------------------------------------------------------

def decode_sizes(model: torch.nn.Module) -> dict[str, int]:
    """What one decode step must read of a causal LM: {params, weight_bytes, kv_bytes_per_position}. The
    weights are every parameter but the input embedding table (a step gathers `batch` of its rows), unless
    the output projection shares it; the KV bytes are one position of one sequence's cache, keys and
    values of every layer, in the model's dtype."""
    params = list(model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is not None and (head is None or head.weight is not embed.weight):
        weight_bytes -= embed.weight.numel() * embed.weight.element_size()
    kv_heads, head_dim = _kv_shape(model.config)
    width = params[0].element_size()
    return {"params": sum(p.numel() for p in params), "weight_bytes": int(weight_bytes),
            "kv_bytes_per_position": 2 * model.config.num_hidden_layers * kv_heads * head_dim * width}


def _kv_shape(config: Any) -> tuple[int, int]:
    """(key-value heads, head dim) of a causal LM's config."""
    heads = config.num_attention_heads
    return (getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads)


def decode_speed_of_light(weight_bytes: int, kv_bytes_per_position: int, batch: int, prompt: int, new_tokens: int,
                          dram_tb_s: float) -> dict[str, Any]:
    """The fastest decode the GPU's memory allows: `new_tokens` - 1 steps (the first new token comes from
    the prefill), the j-th reading every weight once and the cache of `prompt` + j positions of each of
    `batch` sequences, at `dram_tb_s` TB/s. {steps, bytes, ms, tokens_per_s, first_step_ms}; ms and rates
    None when the bandwidth is unknown (0)."""
    if new_tokens < 2:
        raise ValueError(f"a decode needs at least 2 new tokens (the first comes from the prefill), not {new_tokens}")
    steps = new_tokens - 1
    positions = steps * prompt + steps * (steps + 1) // 2  # sum over j = 1..steps of (prompt + j)
    total = steps * weight_bytes + batch * kv_bytes_per_position * positions
    out: dict[str, Any] = {"steps": steps, "bytes": total, "ms": None, "tokens_per_s": None, "first_step_ms": None}
    if dram_tb_s > 0:
        seconds = total / (dram_tb_s * 1e12)
        out.update(ms=seconds * 1e3, tokens_per_s=batch * steps / seconds,
                   first_step_ms=(weight_bytes + batch * kv_bytes_per_position * (prompt + 1)) / (dram_tb_s * 1e9))
    return out


# ---- the rows' numbers ----------------------------------------------------------------------------------------

CAUSAL_COLUMNS = ("eager", "compile", "stitch")


def token_identity(got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    """How far greedy tokens `got` [batch, new] follow `want` (eager's): {identical (count), compared, first_difference
    (the earliest step at which any sequence differs, None when none does)}."""
    if got.shape != want.shape:
        return {"identical": 0, "compared": want.numel(), "first_difference": 0,
                "note": f"shape {list(got.shape)}, eager {list(want.shape)}"}
    same = got.cpu() == want.cpu()
    differing = (~same).any(0).nonzero()
    return {"identical": int(same.sum()), "compared": same.numel(),
            "first_difference": int(differing[0]) if differing.numel() else None}


def derive_causal(row: dict, dram_tb_s: float) -> dict:
    """A causal row's derived numbers from its measured ones: per column with both a prefill and a
    generation time, the decode's time (generation less prefill), ms per step and tokens/s (batch x steps
    over that time), the fraction of the speed of light; StitchCUDA's and the compile recipe's ratios. A
    decode time that is not positive (noise above a short decode) leaves that column's rates None."""
    steps = row["new_tokens"] - 1
    sol = decode_speed_of_light(row["weight_bytes"], row["kv_bytes_per_position"], row["batch"], row["prompt"],
                                row["new_tokens"], dram_tb_s)
    row["speed_of_light"] = sol
    for col in CAUSAL_COLUMNS:
        prefill, whole = row.get(f"{col}_prefill_ms"), row.get(f"{col}_generate_ms")
        if prefill is None or whole is None:
            continue
        decode_ms = whole - prefill
        row[f"{col}_decode_ms"] = decode_ms
        if decode_ms <= 0:
            row[f"{col}_tokens_per_s"] = None
            continue
        row[f"{col}_ms_per_step"] = decode_ms / steps
        row[f"{col}_tokens_per_s"] = row["batch"] * steps / (decode_ms / 1e3)
        if sol["tokens_per_s"]:
            row[f"{col}_fraction_of_speed_of_light"] = round(row[f"{col}_tokens_per_s"] / sol["tokens_per_s"], 3)
    for col in ("stitch", "compile"):
        for base in ("compile", "eager"):
            if col == base:
                continue
            ours, theirs = row.get(f"{col}_tokens_per_s"), row.get(f"{base}_tokens_per_s")
            if ours and theirs:
                row[f"{col}_decode_over_{base}"] = round(ours / theirs, 3)
            ours, theirs = row.get(f"{col}_prefill_ms"), row.get(f"{base}_prefill_ms")
            if ours and theirs:
                row[f"{col}_prefill_over_{base}"] = round(theirs / ours, 3)
    return row


def derive_forward(row: dict) -> dict:
    """A forward row's best compile mode (the fastest mode timed) and the ratios: best compile over eager,
    StitchCUDA over eager and over the best compile mode (above 1: the numerator's column is faster)."""
    timed = {mode: row[f"compile_{_key(mode)}_ms"] for mode in COMPILE_MODES if row.get(f"compile_{_key(mode)}_ms")}
    if timed:
        row["best_compile_mode"] = min(timed, key=timed.get)
        row["best_compile_ms"] = timed[row["best_compile_mode"]]
    eager, best, ours = row.get("eager_ms"), row.get("best_compile_ms"), row.get("stitch_ms")
    if eager and best:
        row["best_compile_over_eager"] = round(eager / best, 3)
    if eager and ours:
        row["stitch_over_eager"] = round(eager / ours, 3)
    if best and ours:
        row["stitch_over_best_compile"] = round(best / ours, 3)
    return row


def _key(mode: str) -> str:
    return mode.replace("-", "_")


# ---- running ----------------------------------------------------------------------------------------------------

@dataclass
class Settings:
    """What one run measures (the command line's options)."""

    only: tuple[str, ...] = MODELS
    batches: tuple[int, ...] = BATCHES
    prompts: tuple[int, ...] = PROMPTS
    new_tokens: int = NEW_TOKENS
    dtypes: tuple[str, ...] = ("bf16", "fp32")
    small: bool = False
    repeats: int = 3
    deadline_s: float | None = None  # seconds of the whole run after which no row or column starts
    start: float = field(default_factory=time.perf_counter)

    def expired(self) -> bool:
        return self.deadline_s is not None and time.perf_counter() - self.start > self.deadline_s

    def to_dict(self) -> dict:
        return {"only": list(self.only), "batches": list(self.batches), "prompts": list(self.prompts),
                "new_tokens": self.new_tokens, "dtypes": list(self.dtypes), "small": self.small,
                "repeats": self.repeats, "deadline_s": self.deadline_s}


def missing_requirements() -> list[str]:
    """What this machine lacks to run the bench, in words (empty: nothing): a CUDA GPU, transformers."""
    missing = []
    gpu = no_gpu_reason()
    if gpu:
        missing.append(f"a CUDA GPU ({gpu})")
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        missing.append(f"the transformers package ({first_line(exc)}; install it with pip install transformers, "
                       "the models are built from its configs)")
    return missing


def cache_keyword(model: torch.nn.Module) -> str:
    """The name this transformers version's forward and generate() take a cache by: `cache` (5.x renamed
    it) or `past_key_values` (before); the model output's field has the same name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    from ..verify.timing import measure

    with torch.no_grad():
        return measure(fn, repeats=repeats, warmup=warmup).ms


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _Deadline(Exception):
    """The run's deadline passed before a column started."""


def _column(row: dict, settings: Settings, name: str, body: Callable[[], None]) -> None:
    """Runs one column of a row: the deadline checked first; a failure is the column's result (its
    error in the row), never the end of the run."""
    if settings.expired():
        row.setdefault("not_run", []).append(name)
        raise _Deadline
    try:
        body()
    except torch.cuda.OutOfMemoryError as exc:
        row[f"{name}_error"] = f"out of GPU memory: {first_line(exc)}"
    except Exception as exc:  # noqa: BLE001 — a column that fails is a result to report, not a crash
        row[f"{name}_error"] = first_line(exc)
    finally:
        _release()


def causal_row(tf: Any, model: torch.nn.Module, settings: Settings, batch: int, prompt: int, dtype: str,
               gpu: dict, row: dict | None = None) -> dict:
    """One causal LM row (filled into `row` as it is measured): the three columns at `batch` x `prompt`
    tokens, then the derived numbers."""
    n = settings.new_tokens
    row = {} if row is None else row
    row.update({"model": "llama", "dtype": dtype, "batch": batch, "prompt": prompt, "new_tokens": n,
                **decode_sizes(model)})
    torch.manual_seed(prompt * 1000 + batch)
    ids = torch.randint(2, model.config.vocab_size, (batch, prompt), device=model.device)
    mask = torch.ones_like(ids)
    tokens: dict[str, torch.Tensor] = {}

    def generate(new: int, **extra: Any) -> torch.Tensor:
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **extra)

    def eager() -> None:
        with torch.no_grad():
            tokens["eager"] = generate(n)[:, prompt:]
        row["eager_prefill_ms"] = _time(lambda: generate(1), settings.repeats)
        row["eager_generate_ms"] = _time(lambda: generate(n), settings.repeats, warmup=0)

    def compiled() -> None:
        cache = tf.StaticCache(config=model.config, max_cache_len=prompt + n)
        if hasattr(cache, "early_initialization"):  # allocated now: the compiled prefill must not allocate it
            kv_heads, head_dim = _kv_shape(model.config)
            cache.early_initialization(batch_size=batch, num_heads=kv_heads, head_dim=head_dim, dtype=model.dtype,
                                       device=model.device)
        keyword = cache_keyword(model)  # read before the forward is replaced by its compiled wrapper
        disabled = model.generation_config.disable_compile
        model.generation_config.disable_compile = True
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        try:
            def run(new: int) -> torch.Tensor:
                cache.reset()
                return generate(new, **{keyword: cache})
            with torch.no_grad():
                t0 = time.perf_counter()
                run(n)
                _sync()
                first = time.perf_counter() - t0
                tokens["compile"] = run(n)[:, prompt:]  # CUDA graphs are recorded on a later call than the first
            row["compile_prefill_ms"] = _time(lambda: run(1), settings.repeats)
            row["compile_generate_ms"] = _time(lambda: run(n), settings.repeats)
            row["compile_s"] = round(first - row["compile_generate_ms"] / 1e3, 2)  # the first call less a steady one
        finally:
            del model.forward  # the instance attribute: the class's forward again
            model.generation_config.disable_compile = disabled
            torch._dynamo.reset()

    def stitch() -> None:
        try:
            from ..graph.decode import StaticCacheGenerator
        except ImportError as exc:
            row["stitch_error"] = f"StitchCUDA decode is not available in this build ({first_line(exc)})"
            return
        t0 = time.perf_counter()
        gen = StaticCacheGenerator.for_transformers(model, batch_size=batch, prompt_length=prompt,
                                                    max_length=prompt + n, progress=False, precision="fp32",
                                                    compare_compile=False)
        row["stitch_optimize_s"] = round(time.perf_counter() - t0, 2)
        for stage in ("prefill", "decode"):  # a program that fell back runs the model: the row says so
            report = getattr(getattr(gen, f"{stage}_module", None), "report", None)
            row[f"stitch_{stage}_status"] = getattr(report, "status", f"unknown (no report on the generator's "
                                                                       f"{stage}_module)")
            if getattr(report, "reason", ""):
                row[f"stitch_{stage}_reason"] = report.reason
        def prefill() -> torch.Tensor:
            return gen.prefill(ids)  # a new sequence from zeroed caches, as a server starts each request

        def whole() -> torch.Tensor:
            return gen.generate(ids, n)

        with torch.no_grad():
            tokens["stitch"] = whole()[:, prompt:]
            if dtype == "bf16" and "eager" in tokens:
                row["accuracy"] = _logit_accuracy(model, gen, ids, tokens["eager"][:, 0])
        row["stitch_prefill_ms"] = _time(lambda: prefill().argmax(-1), settings.repeats)
        row["stitch_generate_ms"] = _time(whole, settings.repeats)

    try:
        for name, body in (("eager", eager), ("compile", compiled), ("stitch", stitch)):
            _column(row, settings, name, body)
    except _Deadline:
        row["incomplete"] = True
    for col in ("compile", "stitch"):
        if col in tokens and "eager" in tokens:
            row[f"{col}_tokens"] = token_identity(tokens[col], tokens["eager"])
    return derive_causal(row, gpu.get("dram_tb_s") or 0.0)


class _LastLogits(torch.nn.Module):
    """A causal LM's logits of the last position, without a cache: the reference's forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, use_cache=False, logits_to_keep=1).logits[:, -1]


def _logit_accuracy(model: torch.nn.Module, gen: Any, ids: torch.Tensor, first: torch.Tensor) -> dict:
    """The accuracy rule on StitchCUDA's logits beside eager's, both against a wide reference (fp64, or fp32
    where fp64 would not fit: reference_dtype): the prefill's last position, and the first decode step
    fed eager's first token (the same input for both, whatever each would have chosen)."""
    out: dict[str, Any] = {}
    ahead = torch.cat([ids, first[:, None]], dim=1)
    eager_prefill = model(ids, logits_to_keep=1)
    name = cache_keyword(model)
    eager_step = model(first[:, None], **{name: getattr(eager_prefill, name)}).logits[:, -1]
    ours_prefill = gen.prefill(ids)
    ours_step = gen.step(first)
    floor = row_floor({"dtype": "bfloat16", "precision": "fp32"})
    last = _LastLogits(model)
    for stage, inputs, eager_out, ours in (("prefill", ids, eager_prefill.logits[:, -1], ours_prefill),
                                           ("first_decode_step", ahead, eager_step, ours_step)):
        ref, note = fp64_reference(last, (inputs,), eager_out, dtype=reference_dtype(last, (inputs,), eager_out))
        if ref is None:
            out[stage] = {"ok": None, "note": note}
            continue
        eager_err, ours_err = fp64_errors(eager_out, ref), fp64_errors(ours, ref)
        out[stage] = accuracy_verdict(ours_err["max_rel"], eager_err["max_rel"], floor)
    return out


def forward_row(model: torch.nn.Module, inputs: tuple, name: str, dtype: str, settings: Settings,
                row: dict | None = None) -> dict:
    """One forward row (filled into `row` as it is measured): eager, each compile mode, optimize(); outputs
    checked against eager's."""
    from ..graph import optimize

    row = {} if row is None else row
    row.update({"model": name, "dtype": dtype, "input_shape": list(inputs[0].shape),
                "params": sum(p.numel() for p in model.parameters())})
    outputs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        want = model(*inputs)

    def eager() -> None:
        row["eager_ms"] = _time(lambda: model(*inputs), settings.repeats * 10)

    def compile_mode(mode: str) -> Callable[[], None]:
        def body() -> None:
            torch._dynamo.reset()
            compiled = torch.compile(model, mode=None if mode == "default" else mode)
            with torch.no_grad():
                t0 = time.perf_counter()
                # a CUDA graph's output is overwritten by its next replay: a copy
                outputs[f"compile_{_key(mode)}"] = compiled(*inputs).clone()
                _sync()
            row[f"compile_{_key(mode)}_s"] = round(time.perf_counter() - t0, 2)
            row[f"compile_{_key(mode)}_ms"] = _time(lambda: compiled(*inputs), settings.repeats * 10, warmup=3)
        return body

    def stitch() -> None:
        t0 = time.perf_counter()
        fast = optimize(model, inputs, progress=False, precision="fp32", compare_compile=False)
        row["optimize_s"] = round(time.perf_counter() - t0, 2)
        row["stitch_status"] = fast.report.status
        if fast.report.reason:
            row["stitch_reason"] = fast.report.reason
        with torch.no_grad():
            outputs["stitch"] = fast(*inputs).clone()  # the program's output buffer is reused by the next call
        row["stitch_ms"] = _time(lambda: fast(*inputs), settings.repeats * 10, warmup=3)

    try:
        for column, body in (("eager", eager), *((f"compile_{_key(m)}", compile_mode(m)) for m in COMPILE_MODES),
                             ("stitch", stitch)):
            _column(row, settings, column, body)
    except _Deadline:
        row["incomplete"] = True
    torch._dynamo.reset()
    _judge_forward(row, model, inputs, want, outputs, dtype)
    return derive_forward(row)


def _judge_forward(row: dict, model: torch.nn.Module, inputs: tuple, want: torch.Tensor,
                   outputs: dict[str, torch.Tensor], dtype: str) -> None:
    """fp32: each column's output against eager's under the Verifier's tolerance; bf16: the accuracy rule
    against a wide reference, beside eager's own error."""
    if dtype == "fp32":
        for column, got in outputs.items():
            ok, err, detail = compare_outputs(got, want, "fp32")
            row[f"{column}_correct"], row[f"{column}_max_abs_error"] = ok, err
            if detail:
                row[f"{column}_difference"] = detail
        return
    ref, note = fp64_reference(model, inputs, want, dtype=reference_dtype(model, inputs, want))
    if ref is None:
        row["accuracy_note"] = note
        return
    eager_err = fp64_errors(want, ref)["max_rel"]
    floor = row_floor({"dtype": "bfloat16", "precision": "fp32"})
    row["accuracy"] = {column: accuracy_verdict(fp64_errors(got, ref)["max_rel"], eager_err, floor)
                       for column, got in outputs.items()}


def run(settings: Settings, json_output: bool = False) -> int:
    """The whole bench: the refusal when the machine lacks something, else every row, printed (the rows
    finished so far, and exit 130, when SIGINT or SIGTERM stops it)."""
    missing = missing_requirements()
    if missing:
        return refuse(PROG, "needs " + " and ".join(missing) + "; nothing was measured", EXIT_NO_GPU, json_output)
    import transformers as tf

    from ..verify import hardware

    gpu = hardware.describe()
    out: dict[str, Any] = {"device": gpu, "torch": torch.__version__, "transformers": tf.__version__,
                           "settings": settings.to_dict(), "compile_recipe": COMPILE_RECIPE, "causal": [],
                           "forward": [], "deadline_reached": False, "not_run": [], "interrupted": False}
    current: list[dict] = []  # the row being measured: marked when a signal stops it
    stop = signal.getsignal(signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:  # a killed run (a job's time limit) still prints what it measured
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        with precision_flags("fp32"):  # TF32 off in every column: fp32 means fp32
            _measure(tf, settings, gpu, out, current)
    except KeyboardInterrupt:
        out["interrupted"] = True
        for row in current:
            row["interrupted"] = True
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, stop)
    for row in out["causal"]:  # a row a signal stopped gets what its columns allow too
        if "weight_bytes" in row:
            derive_causal(row, gpu.get("dram_tb_s") or 0.0)
    for row in out["forward"]:
        derive_forward(row)
    out["deadline_reached"] = bool(out["not_run"]) or any(r.get("incomplete") for r in out["causal"] + out["forward"])
    out["wall_s"] = round(time.perf_counter() - settings.start, 1)
    print(json.dumps(out) if json_output else format_tables(out), flush=True)
    return EXIT_INTERRUPTED if out["interrupted"] else EXIT_OK


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _measure(tf: Any, settings: Settings, gpu: dict, out: dict, current: list[dict]) -> None:
    """Every row of the plan into `out` (a row is in `out` from its start, `current` while it runs)."""
    for name, dtype in [(name, dtype) for name in settings.only for dtype in settings.dtypes]:
        shapes = [(b, p) for b in settings.batches for p in settings.prompts] if name in CAUSAL_MODELS else [None]
        labels = [f"{name}[{dtype}]" + (f" batch {s[0]} prompt {s[1]}" if s else "") for s in shapes]
        if settings.expired():
            out["not_run"] += labels
            continue
        with torch.device("cuda"):
            torch.manual_seed(0)
            if name in CAUSAL_MODELS:
                model = tf.LlamaForCausalLM(llama_config(tf, settings.small)).to(DTYPES[dtype]).eval()
            else:
                model, make_inputs = forward_model(tf, name, settings.small)
                model = model.to(DTYPES[dtype])
        for label, shape in zip(labels, shapes):
            if settings.expired():
                out["not_run"].append(label)
                continue
            row: dict[str, Any] = {}
            current[:] = [row]
            if shape is not None:
                out["causal"].append(row)
                causal_row(tf, model, settings, *shape, dtype, gpu, row)
            else:
                out["forward"].append(row)
                inputs = tuple(t.to(DTYPES[dtype]) if t.is_floating_point() else t for t in make_inputs())
                forward_row(model, inputs, name, dtype, settings, row)
            current.clear()
            _progress(row)
        del model
        _release()


def _progress(row: dict) -> None:
    """One line on stderr per finished row: a long run says where it is."""
    what = " ".join(f"{k}={row[k]}" for k in ("model", "dtype", "batch", "prompt") if k in row)
    print(f"{PROG}: finished {what}", file=sys.stderr, flush=True)


# ---- the tables ----------------------------------------------------------------------------------------------

CAUSAL_TABLE = ("dtype", "batch", "prompt", "eager_prefill_ms", "compile_prefill_ms", "stitch_prefill_ms",
                "eager_tokens_per_s", "compile_tokens_per_s", "stitch_tokens_per_s", "speed_of_light_tokens_per_s",
                "stitch_fraction_of_speed_of_light", "compile_fraction_of_speed_of_light", "stitch_decode_over_compile",
                "stitch_prefill_over_compile", "compile_s", "stitch_optimize_s", "compile_identical",
                "stitch_identical", "stitch_accurate")
FORWARD_TABLE = ("model", "dtype", "input_shape", "eager_ms", "best_compile_mode", "best_compile_ms", "stitch_ms",
                 "stitch_over_best_compile", "best_compile_over_eager", "stitch_status", "correct_or_accurate",
                 "optimize_s")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _table_row(row: dict, keys: tuple[str, ...]) -> dict:
    flat = dict(row)
    flat["speed_of_light_tokens_per_s"] = (row.get("speed_of_light") or {}).get("tokens_per_s")
    for col in ("compile", "stitch"):
        t = row.get(f"{col}_tokens")
        flat[f"{col}_identical"] = f"{t['identical']}/{t['compared']}" if t else None
    verdicts = row.get("accuracy") or {}
    flat["correct_or_accurate"] = (row.get("stitch_correct") if row.get("dtype") == "fp32"
                                   else (verdicts.get("stitch") or {}).get("ok"))
    if "batch" in row and verdicts:  # a causal row: the rule on the prefill and on the first decode step
        oks = [v.get("ok") for v in verdicts.values()]
        flat["stitch_accurate"] = None if None in oks else all(oks)
    return {k: flat.get(k) for k in keys}


def _label(row: dict) -> str:
    shape = f" batch {row['batch']} prompt {row['prompt']}" if "batch" in row else ""
    return f"{row.get('model')}[{row.get('dtype')}]{shape}"


def format_tables(out: dict) -> str:
    """The run as text: the device, a table of causal rows and one of forward rows, errors and what the
    deadline left out."""
    gpu = out["device"]
    lines = [f"{gpu.get('gpu')}: {gpu.get('dram_tb_s')} TB/s; torch {out['torch']}, transformers "
             f"{out['transformers']}; {out['settings']['new_tokens']} new tokens"]
    for title, rows, keys in (("causal LM (llama-like): prefill ms, decode tokens/s", out["causal"], CAUSAL_TABLE),
                              ("forwards (ratios: baseline time / ours)", out["forward"], FORWARD_TABLE)):
        if not rows:
            continue
        lines += ["", title, " | ".join(keys)]
        lines += [" | ".join(_cell(v) for v in _table_row(r, keys).values()) for r in rows]
        for r in rows:
            lines += [f"  {_label(r)} {k}: {v}" for k, v in r.items() if k.endswith(("_error", "_reason"))]
            if r.get("interrupted"):
                lines.append(f"  {_label(r)}: stopped by a signal")
            elif r.get("not_run"):
                lines.append(f"  {_label(r)}: columns not run (the deadline passed): {', '.join(r['not_run'])}")
    if out["not_run"]:
        lines += ["", f"not run (the deadline passed): {', '.join(out['not_run'])}"]
    if out.get("interrupted"):
        lines += ["", "stopped by a signal: the rows above are what was measured"]
    return "\n".join(lines)


# ---- the command line -------------------------------------------------------------------------------------------

def _csv(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in MODELS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"models are {', '.join(MODELS)}; got {text!r}")
    return names


def _dtypes(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or any(n not in DTYPES for n in names):
        raise argparse.ArgumentTypeError(f"dtypes are {', '.join(DTYPES)}; got {text!r}")
    return names


def _counts(text: str) -> tuple[int, ...]:
    parse = at_least(1)
    values = tuple(parse(n.strip()) for n in text.split(",") if n.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"a comma-separated list of whole numbers >= 1, got {text!r}")
    return values


def add_options(parser: argparse.ArgumentParser) -> None:
    """The bench's options (shared by `python -m stitchcuda.bench.inference` and `stitchcuda bench inference`)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--only", type=_names, default=MODELS, metavar="A,B",
                        help=f"models to run, in this order (default {','.join(MODELS)})")
    parser.add_argument("--batches", type=_counts, default=BATCHES, metavar="N,M",
                        help=f"causal LM batch sizes (default {_csv(BATCHES)})")
    parser.add_argument("--prompts", type=_counts, default=None, metavar="N,M",
                        help=f"causal LM prompt lengths in tokens (default {_csv(PROMPTS)}; --small: "
                             f"{_csv(SMALL_PROMPTS)})")
    parser.add_argument("--new-tokens", type=at_least(2, "(the first comes from the prefill)"), default=None,
                        metavar="N", help=f"greedy tokens generated per sequence (default {NEW_TOKENS}; --small: "
                                          f"{SMALL_NEW_TOKENS})")
    parser.add_argument("--dtypes", type=_dtypes, default=("bf16", "fp32"), metavar="A,B",
                        help="model dtypes (default bf16,fp32)")
    parser.add_argument("--small", action="store_true", help="tiny configs of the same architectures, short "
                        "prompts (checks the bench itself; compiling takes most of its time)")
    parser.add_argument("--repeats", type=at_least(1), default=3, metavar="N",
                        help="timed generations per column (forwards: ten times as many calls; default 3)")
    parser.add_argument("--deadline", type=non_negative_float, default=0.0, metavar="SECONDS",
                        help="start no row or column after this many seconds and report the rows finished "
                             "(default 0: none)")


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from parsed options (lengths not given: the defaults of the model size); ValueError for
    combinations argparse cannot see."""
    prompts = args.prompts or (SMALL_PROMPTS if args.small else PROMPTS)
    new_tokens = args.new_tokens or (SMALL_NEW_TOKENS if args.small else NEW_TOKENS)
    positions = 1024 if args.small else 4096
    if "llama" in args.only and max(prompts) + new_tokens > positions:
        raise ValueError(f"a prompt of {max(prompts)} tokens and {new_tokens} new ones pass the Llama-like "
                         f"model's {positions} positions{' (--small)' if args.small else ''}: ask for fewer")
    return Settings(only=args.only, batches=args.batches, prompts=prompts, new_tokens=new_tokens,
                    dtypes=args.dtypes, small=args.small, repeats=args.repeats, deadline_s=args.deadline or None)


def command(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
    except ValueError as exc:
        return refuse(PROG, str(exc), EXIT_USAGE, args.json)
    return run(settings, args.json)


def register(suites: argparse._SubParsersAction) -> None:
    """`stitchcuda bench inference [options]`."""
    sub = suites.add_parser("inference", help="transformer inference: a Llama-like LM's prefill and decode, GPT-2-, "
                                              "BERT- and ViT-like forwards; eager vs torch.compile vs StitchCUDA "
                                              "(docs/inference.md)")
    add_options(sub)
    sub.set_defaults(run=command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stitchcuda.bench.inference",
                                     description=(__doc__ or "").split("\n\n")[0])
    add_options(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad option (2), already printed
        return int(exc.code or 0)
    return command(args)


if __name__ == "__main__":
    raise SystemExit(main())
