"""The decode step of a bf16 transformers Llama with each setting that stays off until a GPU measures it ahead,
against all of them off, in the same run: the KV-cache writes as generated kernels (STITCHCUDA_FUSE_CACHE_WRITE),
small independent launches merged (STITCHCUDA_MERGE_LAUNCHES), sibling projections as one GEMV launch
(STITCHCUDA_GEMV), and the three together.

    python -m stitchcuda.bench.decode_ab [--small] [--batches 1,8] [--only off,all] [--json]

Each variant is a StaticCacheGenerator of its own over the same model (a 16-token prompt, a cache of 256 slots),
built with its settings; the decode steps are timed round-robin after the same prefill, so drift in the GPU's
clocks falls on every variant alike. Per variant and batch: the decode program's launches, ms a step, tokens/s,
`off_over` (the all-off step's ms over this one's: above 1 means the setting is ahead) and how far its greedy
tokens follow the all-off variant's (bf16: a product summed in another order may flip a near-tie, so
`first_difference` says where, not only whether). That ratio, with the tokens, decides each default. A GPU and
transformers are required (without a GPU it exits with code 3).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch

from ..settings import override

VARIANTS: dict[str, dict[str, bool]] = {
    "off": {},
    "cache_write": {"fuse_cache_write": True},
    "merge_launches": {"merge_launches": True},
    "gemv": {"gemv": True},
    "all": {"fuse_cache_write": True, "merge_launches": True, "gemv": True},
}
SETTINGS = ("fuse_cache_write", "merge_launches", "gemv")
BATCHES = (1, 8)
PROMPT, CACHE, NEW = 16, 256, 48


def launches(program: Any) -> int:
    """The steps of `program` that launch work on the GPU (kernels, matmuls, ATen steps other than views)."""
    return sum(s["kind"] in ("kernel", "matmul") or (s["kind"] == "aten" and s.get("op") != "aten::view")
               for s in program.steps)


def variant_settings(name: str) -> dict[str, bool]:
    """Every setting of SETTINGS at its value in variant `name` (the others off, whatever the environment says)."""
    return {s: VARIANTS[name].get(s, False) for s in SETTINGS}


def summarize(batch: int, times: dict[str, list[float]], launch_counts: dict[str, int | None],
              identity: dict[str, dict], status: dict[str, str]) -> list[dict]:
    """One row per variant from its step times (ms), launches, token identity against "off" and status."""
    base = statistics.median(times["off"]) if times.get("off") else None
    rows = []
    for name, ms in times.items():
        step = statistics.median(ms)
        rows.append({"batch": batch, "variant": name, "launches": launch_counts.get(name), "decode_ms": round(step, 4),
                     "tokens_s": round(batch * 1000.0 / step, 1),
                     "off_over": round(base / step, 3) if base else None, "status": status.get(name),
                     **{f"tokens_{k}": v for k, v in identity.get(name, {}).items()}})
    return rows


def batch_rows(model: torch.nn.Module, batch: int, variants: list[str], rounds: int = 5) -> list[dict]:
    from ..graph.decode import StaticCacheGenerator
    from ..verify.timing import measure
    from .inference import token_identity

    gens = {}
    for name in variants:
        with override(**variant_settings(name)):
            gens[name] = StaticCacheGenerator.for_transformers(model, batch_size=batch, prompt_length=PROMPT,
                                                               max_length=CACHE, progress=False,
                                                               compare_compile=False, keep_slower=True)
    ids = torch.randint(3, model.config.vocab_size, (batch, PROMPT), device="cuda")
    tokens, counts, status = {}, {}, {}
    with torch.no_grad():
        for name, gen in gens.items():
            module = gen.decode_module
            status[name] = module.report.status
            counts[name] = launches(module.program) if module.program is not None else None
            tokens[name] = gen.generate(ids, NEW)[:, PROMPT:]
    identity = {name: token_identity(t, tokens["off"]) for name, t in tokens.items()} if "off" in tokens else {}
    times: dict[str, list[float]] = {name: [] for name in gens}
    with torch.no_grad():
        for _ in range(rounds):
            for name, gen in gens.items():  # round-robin: the clocks' drift falls on every variant
                gen.prefill(ids)
                step = tokens[name][:, :1]
                times[name].append(measure(lambda: gen.step(step), repeats=NEW - 8, warmup=2).ms)
    return summarize(batch, times, counts, identity, status)


def run(small: bool = False, batches: tuple[int, ...] = BATCHES, variants: list[str] | None = None,
        json_output: bool = False) -> int:
    from ..cli_support import EXIT_FAILURE, EXIT_NO_GPU
    from .inference import llama_config

    if not torch.cuda.is_available():
        print("stitchcuda.bench.decode_ab: needs a CUDA GPU (torch.cuda.is_available() is False); nothing was "
              "measured. Run it on a machine with an NVIDIA GPU.", file=sys.stderr)
        return EXIT_NO_GPU
    try:
        import transformers as tf
    except ImportError:
        print("stitchcuda.bench.decode_ab: needs the transformers package (pip install transformers)", file=sys.stderr)
        return EXIT_FAILURE
    variants = variants or list(VARIANTS)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(llama_config(tf, small)).to(torch.bfloat16).cuda().eval()
    rows = [r for b in batches for r in batch_rows(model, b, variants)]
    if json_output:
        print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))
        return 0
    print(f"{torch.cuda.get_device_name()}: decode step of a bf16 Llama ({'tiny' if small else '1.1B'}), "
          f"each variant's settings on and the others off, same run")
    columns = ["batch", "variant", "launches", "decode_ms", "tokens_s", "off_over", "tokens_identical",
               "tokens_compared", "tokens_first_difference", "status"]
    print(" | ".join(columns))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in columns))
    return 0


def _variants(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown or text!r}: use some of {', '.join(VARIANTS)}")
    return names


def _batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batches are positive integers separated by commas, not {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stitchcuda.bench.decode_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny Llama (checks the bench itself)")
    parser.add_argument("--batches", type=_batches, default=BATCHES, metavar="N,M")
    parser.add_argument("--only", type=_variants, default=None, metavar="A,B",
                        help=f"variants to build (default all: {', '.join(VARIANTS)}; 'off' is the baseline)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    return run(args.small, args.batches, args.only, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
