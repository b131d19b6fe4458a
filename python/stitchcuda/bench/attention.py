"""The fused attention kernels (graph/templates/attention.py) beside PyTorch's, in one run:
`python -m stitchcuda.bench.attention [--json]`.

Prefill: the fused kernel against SDPA's flash (bf16 only: it has no fp32 kernel), memory-efficient and math
backends and torch.compile of the math form, at bf16 and fp32, on Llama-1B prefill (1x32x2048x64, causal),
ViT-B (64x12x197x64), BERT-base (32x12x512x64) and a head dim of 128 (1x32x2048x128, causal). Decode:
the split-KV pair against SDPA (its own backend
choice) for one new token at batch 1, 8 and 32 over 512 and 2,048 cached keys (32 query heads, 8 kv heads,
D = 128, bf16; timed as called, and with a busy-wait queued ahead, `*_queued_ms`, so the host's launch
latency does not show, as in the decode step's CUDA graph), and the decode step over a static cache of 2,048
slots at positions 100, 1,000 and 2,000 (the masked kernels, reading only the kept keys, against SDPA with the
mask, batch 1 and 8). Each decode and static-cache row also times the pair at other split counts
(`split_candidates`: half, twice and four times the chosen one, queued as above) and reports the best, the
resident blocks per SM and the waves of partial blocks: a count that leaves the last wave part full may lose
to another. Every time is the
Verifier's timer (verify/timing.measure, L2 flushed before each call); ratios are baseline / ours (above 1:
ours is faster) and the speed of light is max(bytes / DRAM bandwidth, FLOPs / peak) from the GPU's table.
Each result is checked against the fp64 math form first. bf16 runs the tensor-core kernel (mma.sync at head
dims 64 and 128, WMMA at others); its WMMA and FMA variants are timed beside it (wmma_kernel, fma_kernel).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import jit
from ..errors import InvalidArgumentError
from ..graph.templates.attention import (DECODE_MIN_CHUNK, decode_attention_kernels, decode_lane_candidates,
                                         flash_attention_kernel, fma_tile_candidates)
from ..verify import hardware
from ..verify.timing import measure

PREFILL = [("llama-1b-prefill", 1, 32, 2048, 64, True), ("vit-b-16", 64, 12, 197, 64, False),
           ("bert-base", 32, 12, 512, 64, False), ("d128-causal", 1, 32, 2048, 128, True)]
DECODE = [(b, n) for b in (1, 8, 32) for n in (512, 2048)]
DECODE_HEADS, DECODE_KV_HEADS, DECODE_DIM = 32, 8, 128
# The decode step over a static cache: its slots, the positions decoded at, the batches.
STATIC_POSITIONS, STATIC_AT, STATIC_BATCHES = 2048, (100, 1000, 2000), (1, 8)


def _math(q, k, v, causal):
    """The math form, as torch.compile sees attention written out."""
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


def _launcher(code, tensors: dict) -> Callable[[], None]:
    kernel = jit.compile(code.source, code.name)  # cached: a second compile of the same source is a lookup
    args = [tensors[key] if kind in ("in", "out") else key for kind, key in code.args]
    return lambda: kernel(code.grid, code.block, *args, shared_mem=code.shared_mem)


def _time(fn, busy_cycles: int = 0, repeats: int = 30) -> float:
    with torch.no_grad():
        return measure(fn, repeats=repeats, warmup=5, busy_cycles=busy_cycles).ms


# A busy-wait queued before each timed decode call (about 0.5 ms), so the host's launch latency never shows:
# the decode step runs replayed as a CUDA graph, where it does not either; at batch 1 the launches dominate.
QUEUED_CYCLES = 1_000_000


def _backend(backend, q, k, v, causal):
    from torch.nn.attention import sdpa_kernel

    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def _error(ours: torch.Tensor, q, k, v, causal) -> float:
    want = _math(q.double(), k.double(), v.double(), causal)
    return (ours.double() - want).abs().max().item()


def prefill(gpu: dict) -> list[dict]:
    from torch.nn.attention import SDPBackend

    rows = []
    for name, b, h, n, d, causal in PREFILL:
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
            o = torch.empty_like(q)
            code = flash_attention_kernel(f"bench_fa_{d}", batch=b, heads=h, kv_heads=h, q_len=n, kv_len=n,
                                          head_dim=d, dtype=dtype, causal=causal)
            ours = _launcher(code, {"q": q, "k": k, "v": v, "o": o})
            ours()
            torch.cuda.synchronize()
            row: dict[str, Any] = {"shape": name, "B": b, "H": h, "N": n, "D": d, "causal": causal,
                                   "dtype": str(dtype).removeprefix("torch."),
                                   "max_abs_error_vs_fp64": _error(o, q, k, v, causal), "ours_ms": _time(ours)}
            baselines = {"sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}
            if dtype != torch.float32:
                baselines = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, **baselines}
            for label, backend in baselines.items():
                try:
                    row[f"{label}_ms"] = _time(_backend(backend, q, k, v, causal))
                except RuntimeError as exc:  # a backend that refuses the shape says so in the table
                    row[f"{label}_ms"] = None
                    row[f"{label}_error"] = str(exc).splitlines()[0][:160]
            compiled = torch.compile(_math)
            try:
                row["compile_math_ms"] = _time(lambda: compiled(q, k, v, causal))
            except Exception as exc:  # noqa: BLE001 — a compile failure is a result to report, not a crash
                row["compile_math_ms"], row["compile_math_error"] = None, str(exc).splitlines()[0][:160]
            if dtype == torch.float32:  # the FMA kernel's other tilings, so one run can pick the default
                row |= _tile_sweep(d, b, h, n, causal, q, k, v)
            if dtype != torch.float32:  # ours' 16-bit alternatives, for the record
                for label, kernel in (("fma_kernel", dict(tensor_cores=False)), ("wmma_kernel", dict(mma=False))):
                    other = flash_attention_kernel(f"bench_fa_{label}_{d}", batch=b, heads=h, kv_heads=h, q_len=n,
                                                   kv_len=n, head_dim=d, dtype=dtype, causal=causal, **kernel)
                    row[f"{label}_ms"] = _time(_launcher(other, {"q": q, "k": k, "v": v, "o": torch.empty_like(q)}))
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            row["ours_tflops"] = round(flops / (row["ours_ms"] * 1e9), 1)  # against the FMA rate at fp32
            size = q.element_size() * 4 * q.numel()
            peak = gpu["bf16_tflops"] if dtype != torch.float32 else gpu["fp32_tflops"]
            row["speed_of_light_ms"] = max(size / (gpu["dram_tb_s"] * 1e9), flops / (peak * 1e9)) if peak else None
            _ratios(row)
            rows.append(row)
            del q, k, v, o
            torch.cuda.empty_cache()
    return rows


def tiles_label(tiles) -> str:
    return f"{tiles.bm}x{tiles.rows}"


def _tile_sweep(d: int, b: int, h: int, n: int, causal: bool, q, k, v) -> dict:
    """The fp32 FMA kernel at each of fma_tile_candidates' tilings (BM x TM): time and error against fp64 each,
    and the fastest correct one (`best_fma_tiles`; errors above twice the default's are wrong)."""
    times, errors = {}, {}
    for tiles in fma_tile_candidates(d):
        o = torch.empty_like(q)
        code = flash_attention_kernel(f"bench_fa_t{tiles.bm}x{tiles.rows}_{d}", batch=b, heads=h, kv_heads=h, q_len=n,
                                      kv_len=n, head_dim=d, dtype=q.dtype, causal=causal, fma_tiles=tiles)
        run = _launcher(code, {"q": q, "k": k, "v": v, "o": o})
        run()
        torch.cuda.synchronize()
        label = tiles_label(tiles)
        errors[label], times[label] = _error(o, q, k, v, causal), _time(run)
    return variant_record("fma_tiles", times, errors)


def variant_record(name: str, times: dict[str, float], errors: dict[str, float]) -> dict:
    """A kernel's variants timed side by side (the default first): `<name>_ms` and `<name>_error` by variant,
    `best_<name>` (the fastest whose error is finite and within twice the default's, or 1e-5) and
    `best_over_default_<name>` (the default's time over the best's)."""
    default = next(iter(times))
    bound = max(2 * errors[default], 1e-5)
    good = [t for t in times if math.isfinite(errors[t]) and errors[t] <= bound]
    best = min(good, key=times.get) if good else None
    return {f"{name}_ms": times, f"{name}_error": errors, f"best_{name}": best,
            f"best_over_default_{name}": times[default] / times[best] if best else None}


def _decode_pair(kernels, tensors: dict) -> Callable[[], None]:
    """The decode pair's two launches as one call, their workspace added to `tensors`; run once."""
    tensors |= {"ws_ml": torch.empty(kernels.workspace_ml, device="cuda"),
                "ws_acc": torch.empty(kernels.workspace_acc, device="cuda")}
    first, second = _launcher(kernels.partial, tensors), _launcher(kernels.combine, tensors)

    def ours():
        first()
        second()
    ours()
    torch.cuda.synchronize()
    return ours


def _decode_error(o: torch.Tensor, q, k, v) -> float:
    """The largest error of a decode output against the fp64 math form over k and v (GQA repeated)."""
    rep = q.shape[1] // k.shape[1]
    want = _math(q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1), False)
    return (o.double() - want).abs().max().item()


# The split counts timed beside the chosen one, as multiples of it (wave quantization: blocks / (SMs x resident)
# a little above a whole number runs a last wave mostly empty, which more or fewer splits may avoid).
SPLIT_FACTORS = (0.5, 2, 4)
SPLIT_REPEATS = 10  # timed calls per alternative split count: the sweep adds little to the bench's time


def split_candidates(chosen: int, max_len: int) -> list[int]:
    """The split counts the bench times for one decode shape, ascending: the chosen one and SPLIT_FACTORS times
    it, each within 1 .. ceil(max_len / DECODE_MIN_CHUNK) (the kernels' smallest chunk), deduplicated."""
    if chosen < 1 or max_len < 1:
        raise InvalidArgumentError(f"split_candidates: the chosen splits and max_len must be >= 1, not {chosen} "
                                   f"and {max_len}")
    top = max(1, -(-max_len // DECODE_MIN_CHUNK))
    return sorted({chosen} | {min(top, max(1, int(chosen * f))) for f in SPLIT_FACTORS})


def split_tolerance(chosen_error: float) -> float:
    """The largest error another split count may have: twice the chosen one's plus 1e-3, the rule the GPU tests
    hold the decode kernels to against SDPA (another count changes only the fp32 summation order; the bf16
    output's rounding dominates both)."""
    return 2 * chosen_error + 1e-3


def split_record(chosen: int, times: dict[int, float], errors: dict[int, float], tolerance: float) -> dict:
    """A row's split sweep from each count's time and error: `ours_ms_at_splits`, `error_at_splits`,
    `wrong_splits` (error above `tolerance`, or NaN), `best_splits` (the fastest correct count),
    `best_over_chosen` (chosen ms / best ms: above 1, the best count beats the chosen one) and
    `best_splits_x` ("best (multiple of the chosen)x"), the printed column."""
    wrong = sorted(s for s, e in errors.items() if not e <= tolerance)
    right = {s: ms for s, ms in times.items() if s not in wrong and ms}
    best = min(right, key=right.__getitem__) if right else None
    record: dict[str, Any] = {"ours_ms_at_splits": dict(sorted(times.items())),
                              "error_at_splits": dict(sorted(errors.items())), "wrong_splits": wrong,
                              "best_splits": best, "best_over_chosen": None, "best_splits_x": None}
    if best is not None and times.get(chosen):
        record["best_over_chosen"] = round(times[chosen] / times[best], 3)
        record["best_splits_x"] = f"{best} ({best / chosen:.2g}x)"
    return record


def _split_kernels(make: Callable[..., Any], chosen, max_len: int) -> dict:
    """The decode pair at each of split_candidates' counts (`make(splits)` builds one; the chosen one reused)."""
    return {s: chosen if s == chosen.splits else make(splits=s) for s in split_candidates(chosen.splits, max_len)}


def _occupancy(kernels, sms: int) -> dict:
    """Resident partial blocks per SM (the driver's occupancy of the compiled kernel; every split count runs
    the same source) and the waves of partial blocks at each split count: blocks / (SMs x resident)."""
    code = next(iter(kernels.values())).partial
    block = math.prod(code.block) if isinstance(code.block, tuple) else code.block
    resident = jit.compile(code.source, code.name).occupancy(block, code.shared_mem)
    waves = {s: round(math.prod(k.partial.grid) / (sms * resident), 2) if resident else None
             for s, k in kernels.items()}
    return {"resident_blocks_per_sm": resident, "waves_at_splits": waves}


def _split_sweep(kernels: dict, chosen: int, tensors: dict, error: Callable[[torch.Tensor], float],
                 chosen_error: float, sms: int) -> dict:
    """Each split count's pair run on `tensors` (its own output and workspace), checked with `error`, and timed
    queued (as the decode step's CUDA graph runs it) with SPLIT_REPEATS calls; split_record's keys, the
    occupancy's and `waves` at the chosen count."""
    times, errors = {}, {}
    for s, pair in kernels.items():
        t = tensors | {"o": torch.empty_like(tensors["o"])}
        ours = _decode_pair(pair, t)
        errors[s] = error(t["o"])
        times[s] = _time(ours, QUEUED_CYCLES, SPLIT_REPEATS)
    record = split_record(chosen, times, errors, split_tolerance(chosen_error)) | _occupancy(kernels, sms)
    record["waves"] = record["waves_at_splits"][chosen]
    return record


def _lane_sweep(make: Callable[..., Any], chosen, tensors: dict, error: Callable[[torch.Tensor], float]) -> dict:
    """The pair at each of decode_lane_candidates' lanes a key (the chosen split count), queued: fewer lanes a key
    take fewer shuffles a score and more registers; variant_record's keys under "lanes"."""
    times, errors = {}, {}
    for lanes in decode_lane_candidates(chosen.layout.head_dim, tensors["q"].dtype):
        pair = chosen if lanes == chosen.layout.lanes else make(splits=chosen.splits, lanes=lanes)
        t = tensors | {"o": torch.empty_like(tensors["o"])}
        ours = _decode_pair(pair, t)
        errors[str(lanes)] = error(t["o"])
        times[str(lanes)] = _time(ours, QUEUED_CYCLES, SPLIT_REPEATS)
    return variant_record("lanes", times, errors)


def decode(gpu: dict) -> list[dict]:
    rows = []
    h, hk, d, dtype = DECODE_HEADS, DECODE_KV_HEADS, DECODE_DIM, torch.bfloat16
    for b, n in DECODE:
        q = torch.randn(b, h, 1, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=dtype) for _ in range(2))
        make = functools.partial(decode_attention_kernels, f"bench_dec_{d}", batch=b, heads=h, kv_heads=hk,
                                 q_tokens=1, max_len=n, head_dim=d, dtype=dtype, sms=gpu["sms"])
        kernels = make()
        t = {"q": q, "k": k, "v": v, "o": torch.empty_like(q),
             "lengths": torch.full((b,), n, dtype=torch.int32, device="cuda")}
        ours = _decode_pair(kernels, t)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        row = {"batch": b, "kv_len": n, "H": h, "H_kv": hk, "D": d, "dtype": "bfloat16", "splits": kernels.splits,
               "blocks": kernels.partial.grid[0] * kernels.partial.grid[1] * kernels.partial.grid[2],
               "max_abs_error_vs_fp64": _decode_error(t["o"], q, k, v), "ours_ms": _time(ours),
               "sdpa_ms": _time(sdpa), "ours_queued_ms": _time(ours, QUEUED_CYCLES),
               "sdpa_queued_ms": _time(sdpa, QUEUED_CYCLES)}
        size = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
        row["speed_of_light_ms"] = size / (gpu["dram_tb_s"] * 1e9)
        _ratios(row)
        row["sdpa_over_ours_queued"] = round(row["sdpa_queued_ms"] / row["ours_queued_ms"], 3)
        row["fraction_of_speed_of_light_queued"] = round(row["speed_of_light_ms"] / row["ours_queued_ms"], 3)
        row |= _split_sweep(_split_kernels(make, kernels, n), kernels.splits, t,
                            lambda o: _decode_error(o, q, k, v), row["max_abs_error_vs_fp64"], gpu["sms"])
        row |= _lane_sweep(make, kernels, t, lambda o: _decode_error(o, q, k, v))
        rows.append(row)
    return rows


def static_cache(gpu: dict) -> list[dict]:
    """The decode step over a static cache of STATIC_POSITIONS slots, as a static-cache model runs it: one new
    token at `position`, the keys past it masked. SDPA with the mask reads every slot; the masked decode
    kernels read the mask, then only the kept keys. bytes_* count what each must read from DRAM (K and V
    rows, the mask once, q and the output); the speed of light is the kept keys' bytes over DRAM bandwidth."""
    rows = []
    h, hk, d, dtype, n = DECODE_HEADS, DECODE_KV_HEADS, DECODE_DIM, torch.bfloat16, STATIC_POSITIONS
    for b in STATIC_BATCHES:
        k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=dtype) for _ in range(2))
        q = torch.randn(b, h, 1, d, device="cuda", dtype=dtype)
        make = functools.partial(decode_attention_kernels, f"bench_dec_mask_{d}", batch=b, heads=h, kv_heads=hk,
                                 q_tokens=1, max_len=n, head_dim=d, dtype=dtype, sms=gpu["sms"],
                                 mask_dtype=torch.bool, strides={"mask": (0, 0, 0, 1)})
        kernels = make()
        sweep = _split_kernels(make, kernels, n)  # built once a batch, run at every position
        for position in STATIC_AT:
            mask = (torch.arange(n, device="cuda") <= position)[None, None, None, :]
            t = {"q": q, "k": k, "v": v, "mask": mask, "o": torch.empty_like(q)}
            ours = _decode_pair(kernels, t)
            kept = position + 1
            row_bytes = 2 * b * hk * d * k.element_size()  # one key's K and V rows over the batch's kv heads
            ends = 2 * q.numel() * q.element_size()
            row = {"batch": b, "cache": n, "position": position, "splits": kernels.splits,
                   "max_abs_error_vs_fp64": _decode_error(t["o"], q, k[:, :, :kept], v[:, :, :kept]),
                   "ours_ms": _time(ours),
                   "sdpa_ms": _time(lambda m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                                                   enable_gqa=True)),
                   "bytes_ours": kept * row_bytes + n + ends, "bytes_sdpa": n * row_bytes + n + ends}
            row["speed_of_light_ms"] = row["bytes_ours"] / (gpu["dram_tb_s"] * 1e9)
            _ratios(row)
            row |= _split_sweep(sweep, kernels.splits, t,
                                lambda o, kept=kept: _decode_error(o, q, k[:, :, :kept], v[:, :, :kept]),
                                row["max_abs_error_vs_fp64"], gpu["sms"])
            rows.append(row)
        del k, v
        torch.cuda.empty_cache()
    return rows


def _ratios(row: dict) -> None:
    """baseline / ours for every baseline measured (above 1: ours faster); ours against the speed of light."""
    ours = row["ours_ms"]
    for key in [k for k in row if k.endswith("_ms") and not k.startswith("ours") and k != "speed_of_light_ms"
                and not k.endswith("_queued_ms")]:
        if row[key]:
            row[key.removesuffix("_ms") + "_over_ours"] = round(row[key] / ours, 3)
    if row.get("speed_of_light_ms"):
        row["fraction_of_speed_of_light"] = round(row["speed_of_light_ms"] / ours, 3)


# Printed headers that differ from the row's key.
HEADERS = {"best_splits_x": "best splits (x of chosen)"}


def _table(rows: list[dict], keys: list[str]) -> str:
    lines = [" | ".join(HEADERS.get(k, k) for k in keys)]
    for r in rows:
        lines.append(" | ".join(f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k)) for k in keys))
    return "\n".join(lines)


def run(json_output: bool = False) -> int:
    from ..cli_support import EXIT_NO_GPU

    if not torch.cuda.is_available():
        print("stitchcuda.bench.attention: needs a CUDA GPU (torch.cuda.is_available() is False); nothing was "
              "measured. Run it on a machine with an NVIDIA GPU.", file=sys.stderr)
        return EXIT_NO_GPU
    gpu = hardware.describe()
    torch.manual_seed(0)
    out = {"device": gpu, "torch": torch.__version__, "prefill": prefill(gpu), "decode": decode(gpu),
           "static_cache": static_cache(gpu)}
    if json_output:
        print(json.dumps(out))
        return 0
    print(f"{gpu['gpu']}: {gpu['dram_tb_s']} TB/s, bf16 {gpu['bf16_tflops']} TFLOP/s, fp32 {gpu['fp32_tflops']}")
    print("\nprefill (ratios: baseline time / ours)")
    print(_table(out["prefill"], ["shape", "dtype", "ours_ms", "sdpa_flash_over_ours", "sdpa_efficient_over_ours",
                                  "sdpa_math_over_ours", "compile_math_over_ours", "fma_kernel_over_ours",
                                  "wmma_kernel_over_ours",
                                  "ours_tflops", "fraction_of_speed_of_light", "max_abs_error_vs_fp64",
                                  "best_fma_tiles", "best_over_default_fma_tiles"]))
    print("\ndecode, bf16, 32 heads / 8 kv heads, D = 128")
    print(_table(out["decode"], ["batch", "kv_len", "splits", "blocks", "ours_ms", "sdpa_over_ours",
                                 "fraction_of_speed_of_light", "ours_queued_ms", "sdpa_over_ours_queued",
                                 "fraction_of_speed_of_light_queued", "max_abs_error_vs_fp64", "resident_blocks_per_sm",
                                 "waves", "best_splits_x", "best_over_chosen", "wrong_splits", "best_lanes",
                                 "best_over_default_lanes"]))
    print(f"\ndecode over a static cache of {STATIC_POSITIONS} slots, keys past the position masked (bf16, as above)")
    print(_table(out["static_cache"], ["batch", "position", "splits", "ours_ms", "sdpa_over_ours", "bytes_ours",
                                       "bytes_sdpa", "fraction_of_speed_of_light", "max_abs_error_vs_fp64",
                                       "resident_blocks_per_sm", "waves", "best_splits_x", "best_over_chosen",
                                       "wrong_splits"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stitchcuda.bench.attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return run(parser.parse_args(argv).json)


if __name__ == "__main__":
    raise SystemExit(main())
