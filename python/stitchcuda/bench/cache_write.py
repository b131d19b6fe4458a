"""Decode with the KV-cache writes as generated kernels (STITCHCUDA_FUSE_CACHE_WRITE=1) against without (0), in
the same run: a transformers Llama at bf16 built twice, one generator per setting, their decode steps timed
alternately, with each decode program's launches and whether both generate the same greedy tokens.

    python -m stitchcuda.bench.cache_write [--small] [--json]

A GPU and transformers are required (without a GPU it exits with code 3). `off_over_on` above 1 means the fused
writes are ahead: the number that decides the setting's default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch

from ..settings import override

SETTING = "STITCHCUDA_FUSE_CACHE_WRITE"
BATCHES = (1, 8)


def launches(program: Any) -> int:
    """The steps of `program` that launch work on the GPU (kernels, ATen steps other than views, matmuls)."""
    return sum(s["kind"] in ("kernel", "matmul") or (s["kind"] == "aten" and s.get("op") != "aten::view")
               for s in program.steps)


def _generator(model: torch.nn.Module, fused: bool, batch: int, prompt: int, new: int) -> Any:
    from ..graph.decode import StaticCacheGenerator

    with override(fuse_cache_write=fused):  # read while the programs are planned
        return StaticCacheGenerator.for_transformers(model, batch_size=batch, prompt_length=prompt,
                                                     max_length=prompt + new, progress=False, compare_compile=False,
                                                     keep_slower=True)


def row(tf: Any, batch: int, small: bool, repeats: int = 5) -> dict:
    """One batch size: both generators' decode step (ms, median of `repeats` alternating rounds of up to 20 steps
    after a prefill, inside the cache),
    tokens/s, launches per step, and whether their greedy tokens agree."""
    from ..verify.timing import measure
    from .inference import llama_config

    prompt, new = (16, 16) if small else (512, 64)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(llama_config(tf, small)).to(torch.bfloat16).cuda().eval()
    gens = {fused: _generator(model, fused, batch, prompt, new) for fused in (False, True)}
    out: dict = {"batch": batch, "prompt": prompt}
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device="cuda")
    tokens = {}
    with torch.no_grad():
        for fused, gen in gens.items():
            key = "on" if fused else "off"
            module = gen.decode_module
            out[f"status_{key}"] = module.report.status
            out[f"launches_{key}"] = launches(module.program) if module.program is not None else None
            tokens[fused] = gen.generate(ids, new)
    out["same_tokens"] = bool(torch.equal(tokens[False], tokens[True]))
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.no_grad():
        for _ in range(repeats):
            for fused, gen in gens.items():  # alternating, so drift in the GPU's clocks falls on both
                gen.prefill(ids)
                step = tokens[fused][:, prompt:prompt + 1]
                times[fused].append(measure(lambda: gen.step(step), repeats=min(20, new - 4), warmup=2).ms)
    for fused, key in ((False, "off"), (True, "on")):
        out[f"decode_ms_{key}"] = round(statistics.median(times[fused]), 4)
        out[f"tokens_s_{key}"] = round(batch * 1000.0 / out[f"decode_ms_{key}"], 1)
    out["off_over_on"] = round(out["decode_ms_off"] / out["decode_ms_on"], 3)
    return out


def run(small: bool = False, json_output: bool = False) -> int:
    from ..cli_support import EXIT_FAILURE, EXIT_NO_GPU

    if not torch.cuda.is_available():
        print("stitchcuda.bench.cache_write: needs a CUDA GPU (torch.cuda.is_available() is False); nothing was "
              "measured. Run it on a machine with an NVIDIA GPU.", file=sys.stderr)
        return EXIT_NO_GPU
    try:
        import transformers as tf
    except ImportError:
        print("stitchcuda.bench.cache_write: needs the transformers package installed", file=sys.stderr)
        return EXIT_FAILURE
    rows = [row(tf, batch, small) for batch in BATCHES]
    if json_output:
        print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))
        return 0
    print(f"{torch.cuda.get_device_name()}: decode step of a bf16 Llama, {SETTING}=0 (off) and 1 (on), same run")
    columns = ["batch", "prompt", "launches_off", "launches_on", "decode_ms_off", "decode_ms_on", "tokens_s_off",
               "tokens_s_on", "off_over_on", "same_tokens", "status_off", "status_on"]
    print(" | ".join(columns))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in columns))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stitchcuda.bench.cache_write", description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny Llama (checks the bench itself)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    return run(args.small, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
