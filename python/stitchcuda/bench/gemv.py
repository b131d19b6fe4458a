"""The decode GEMV kernel (templates/gemv.py) against cuBLASLt at a Llama's decode projections, in the same run:
ours (the sibling weights in one launch) against torch.nn.functional.linear per weight and against one matmul
over the weights concatenated (a copy ours never makes), with each time's share of the bytes' floor.

    python -m stitchcuda.bench.gemv [--json]

Shapes: the inference bench's Llama (hidden 2048, intermediate 8192, 32 heads, 8 KV heads, head dim 64) at
1, 8 and 16 rows of x, bf16: q, k and v (2048 + 512 + 512 rows of 2048); gate and up with SiLU(gate) * up (two
of 8192 x 2048). Every call is queued behind a busy-wait, as in a decode step's CUDA graph, so the host's launch
latency does not show; the launch count is the difference that remains. Without a GPU it exits with code 3.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F

from .. import jit
from ..graph.templates.gemv import gemv_kernel
from ..verify import hardware
from ..verify.timing import measure

HIDDEN, INTERMEDIATE, Q_ROWS, KV_ROWS = 2048, 8192, 2048, 512
CASES = (("qkv", [Q_ROWS, KV_ROWS, KV_ROWS], "none"), ("gate_up_silu", [INTERMEDIATE, INTERMEDIATE], "silu_mul"))
ROWS = (1, 8, 16)
QUEUED_CYCLES = 1_000_000  # about 0.5 ms of busy-wait before each timed call


def floor_bytes(rows: int, k: int, columns: list[int], outputs: int, element: int = 2) -> int:
    """What the product must move: every weight once, x once, each output once."""
    out_columns = columns[0] if outputs == 1 and len(columns) == 2 else sum(columns)
    return element * (sum(columns) * k + rows * k + rows * out_columns)


def ratios(row: dict, dram_tb_s: float) -> dict:
    """`linear_over_ours` and `concat_over_ours` (above 1: ours ahead) and each time's fraction of the floor."""
    floor_ms = row["bytes"] / (dram_tb_s * 1e9) if dram_tb_s else None
    out = dict(row)
    for key in ("linear", "concat"):
        out[f"{key}_over_ours"] = round(row[f"{key}_ms"] / row["ours_ms"], 3)
    for key in ("ours", "linear", "concat"):
        out[f"{key}_of_floor"] = round(floor_ms / row[f"{key}_ms"], 3) if floor_ms else None
    return out


def _time(fn) -> float:
    with torch.no_grad():
        return measure(fn, repeats=50, warmup=5, busy_cycles=QUEUED_CYCLES).ms


def case_row(name: str, rows: int, columns: list[int], epilogue: str, dram_tb_s: float) -> dict[str, Any]:
    dtype, k = torch.bfloat16, HIDDEN
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    ws = [torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5 for n in columns]
    silu = epilogue == "silu_mul"
    ys = [torch.empty(rows, n, device="cuda", dtype=dtype) for n in ([columns[0]] if silu else columns)]
    code = gemv_kernel(f"bench_gemv_{name}_{rows}", rows=rows, k=k, columns=columns, dtype=dtype, epilogue=epilogue)
    kernel = jit.compile(code.source, code.name)
    tensors = {"x": x, **{f"w{j}": w for j, w in enumerate(ws)}, **{f"y{o}": y for o, y in enumerate(ys)}}
    args = [tensors[key] if kind in ("in", "out") else key for kind, key in code.args]

    def ours() -> None:
        kernel(code.grid, code.block, *args)

    def linear() -> None:
        outs = [F.linear(x, w) for w in ws]
        if silu:
            F.silu(outs[0]) * outs[1]

    concatenated = torch.cat(ws)

    def concat() -> None:
        out = F.linear(x, concatenated)
        if silu:
            gate, up = out.split(columns, dim=1)
            F.silu(gate) * up

    ours()
    torch.cuda.synchronize()
    want = [F.linear(x.double(), w.double()) for w in ws]
    want = [F.silu(want[0]) * want[1]] if silu else want
    error = max(float((y.double() - w).abs().max()) for y, w in zip(ys, want))
    row = {"case": name, "rows": rows, "columns": columns, "k": k, "max_abs_error_vs_fp64": error,
           "bytes": floor_bytes(rows, k, columns, len(ys)), "ours_ms": _time(ours), "linear_ms": _time(linear),
           "concat_ms": _time(concat), "launches_ours": 1, "launches_linear": len(ws) + (2 if silu else 0),
           "launches_concat": 1 + (2 if silu else 0)}
    return ratios(row, dram_tb_s)


def run(json_output: bool = False) -> int:
    from ..cli_support import EXIT_NO_GPU

    if not torch.cuda.is_available():
        print("stitchcuda.bench.gemv: needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured. "
              "Run it on a machine with an NVIDIA GPU.", file=sys.stderr)
        return EXIT_NO_GPU
    gpu = hardware.describe()
    rows = [case_row(name, m, columns, epilogue, gpu.get("dram_tb_s") or 0.0)
            for name, columns, epilogue in CASES for m in ROWS]
    if json_output:
        print(json.dumps({"device": gpu, "rows": rows}))
        return 0
    print(f"{gpu['gpu']}: {gpu['dram_tb_s']} TB/s; bf16 decode projections, queued (ratios: theirs / ours)")
    columns = ["case", "rows", "ours_ms", "linear_over_ours", "concat_over_ours", "ours_of_floor", "linear_of_floor",
               "max_abs_error_vs_fp64"]
    print(" | ".join(columns))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in columns))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stitchcuda.bench.gemv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return run(parser.parse_args(argv).json)


if __name__ == "__main__":
    raise SystemExit(main())
