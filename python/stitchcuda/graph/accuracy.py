"""The accuracy rule (verify/tolerance.py) in a group check: a group with 16-bit outputs, or any group under the
tf32/bf16 policies, whose outputs differ from ATen's recorded ones is judged again against its own ATen
subgraph run in fp64 (fp32 where fp64 would not fit or has no kernel), beside the error ATen made there."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..verify.compare import first_difference
from ..verify.program import output_specs, program_job
from ..verify.tolerance import Accuracy, by_accuracy, judge_accuracy, reference_dtype
from .attention import reference_values
from .capture import Value
from .groups import Group

__all__ = ["group_reference", "candidate_outputs", "judge_group", "rule_precision", "FP64_ROOM_FACTOR", "ACCEPTED"]

# How a check's verdict begins when the rule accepted a group that differs from ATen's rounding.
ACCEPTED = "passes the accuracy rule (it differs from ATen's rounding only)"

# An fp64 reference of a group holds its inputs and outputs in fp64 plus the subgraph's intermediates:
# it is made when this many times the inputs' and outputs' fp64 bytes fit in the check's room.
FP64_ROOM_FACTOR = 3


def _wide(t: Any, dtype: torch.dtype) -> Any:
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def rule_precision(group: Group, precision: str) -> str:
    """The policy the rule judges `group` under: `precision`, except that at "fp32" a group whose arithmetic
    passes through 16-bit values (a bf16 model's norm squares in bf16 and casts the square to fp32) is judged
    as that format, the coarser of bf16 and fp16 it holds: ATen rounds those values and a fused kernel keeps
    them in fp32, so even its fp32 outputs differ from ATen's by the 16-bit rounding, not by a bug."""
    if precision != "fp32":
        return precision
    # Values the group makes, not the ones it reads: from 16-bit inputs ATen and a kernel compute alike.
    held = {v.dtype for n in group.nodes for v in n.outputs if v is not None}
    return "bf16" if torch.bfloat16 in held else "fp16" if torch.float16 in held else precision


def group_reference(group: Group, values: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The group's ATen nodes run in `dtype` (fp64 or fp32) on `values` (name -> tensor: the group's
    recorded inputs and constants; weights come from their Values), every value it produces by name.
    A cast to another floating type (a bf16 model's `.to(torch.bfloat16)`) keeps `dtype`: the reference
    is the same arithmetic without the roundings, which is what "the truth" means for a cast."""
    if group.kind == "attention" and dtype is not None:  # its nodes would build the scores: in slices of rows
        return reference_values(group.params["attention"], values, dtype)
    env: dict[str, Any] = {}

    def arg(a: Any) -> Any:
        if isinstance(a, Value):
            if a.name in env:
                return env[a.name]
            return _wide(a.data.detach() if a.kind == "weight" else values[a.name], dtype)
        if isinstance(a, torch.dtype) and a.is_floating_point:
            return dtype
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        return a

    with torch.no_grad():
        for n in group.nodes:
            result = n.target(*arg(n.args), **{k: arg(v) for k, v in n.kwargs.items()})
            flat = result if isinstance(result, (list, tuple)) else [result]
            for out, r in zip(n.outputs, flat):
                if out is not None and isinstance(r, torch.Tensor):
                    env[out.name] = r
    return env


def candidate_outputs(program: Any, feed: Sequence[torch.Tensor], like: Sequence[torch.Tensor],
                      pool: Any) -> list[torch.Tensor] | None:
    """The group program's outputs on `feed`, laid out as its output buffers (dtype and device of `like`,
    the recorded outputs). With `pool`, the Verifier's worker writes them through CUDA IPC (the program
    stays out of this process); None where it cannot (no CUDA IPC) or the run failed."""
    specs = output_specs(program)
    if len(specs) != len(like):
        return None
    outputs = [torch.empty_strided(b["shape"], b["strides"], dtype=t.dtype, device=t.device)
               for b, t in zip(specs, like)]
    try:
        if pool is None:
            program.executor(graphs=False).run(list(feed), outputs)
        else:
            if not (getattr(pool, "shares_cuda", False) and all(t.is_cuda for t in outputs)):
                return None
            from ..verify.config import VerifyConfig

            job = program_job(program, feed, None, [(0.0, 0.0)] * len(like), [""] * len(like), on_device=True,
                              outputs=outputs)
            config = VerifyConfig.from_dict(job["config"])
            result = pool.run(job, config.compile_time_limit_s, config.run_time_limit_s)
            del job
            torch.cuda.ipc_collect()
            if not result.get("correct"):
                return None
        if any(t.is_cuda for t in outputs):
            torch.cuda.synchronize()
    except Exception:  # the run's failure was the first check's to report
        return None
    return outputs


def judge_group(group: Group, got: Sequence[torch.Tensor], feed: Sequence[torch.Tensor], inputs: Sequence[Value],
                outputs: Sequence[Value], wants: Sequence[torch.Tensor], tolerances: Sequence[tuple[float, float]],
                precision: str, room: int | None = None,
                known: dict[str, torch.Tensor] | None = None) -> tuple[bool, str] | None:
    """The accuracy rule for a group whose outputs `got` (its program's, candidate_outputs) differ from
    ATen's (`wants`, the recorded outputs) on `feed` (the values of `inputs`; `known`: other recorded
    values and constants by name, for a node that reads a value its program does not): (ok, why) naming the candidate's and ATen's errors against the group's subgraph in fp64 (fp32 where
    `room`, the bytes the check may still allocate, does not hold FP64_ROOM_FACTOR times the fp64 inputs
    and outputs, or where an op has no fp64 kernel). Outputs the rule does not cover (fp32 at the fp32
    policy, integers) must still match ATen under their `tolerances`. None when the rule cannot judge (no output it covers, or the reference could not be had)."""
    if not any(by_accuracy(v.dtype, precision) for v in outputs):
        return None
    fp64_bytes = 8 * sum(t.numel() for t in (*feed, *wants))
    fits = room is None or FP64_ROOM_FACTOR * fp64_bytes <= room
    values = {**(known or {}), **{v.name: t for v, t in zip(inputs, feed)}}
    ref, note = None, "" if fits else " (fp32 reference: an fp64 one would not fit the check's memory)"
    for dtype in ((torch.float64, torch.float32) if fits else (torch.float32,)):
        try:
            ref = group_reference(group, values, dtype)
            break
        except Exception as exc:  # an op with no fp64 kernel: the fp32 reference, said so
            note = f" (fp32 reference: {type(exc).__name__} in fp64)"
    if ref is None or any(v.name not in ref for v in outputs):
        return None
    verdicts: list[tuple[str, Accuracy]] = []
    for v, g, w, (atol, rtol) in zip(outputs, got, wants, tolerances):
        if not by_accuracy(v.dtype, precision):
            problem = first_difference(v.name, g, w, atol, rtol, reference="ATen")
            if problem:
                return False, problem
            continue
        r = ref[v.name]
        verdicts.append((v.name, judge_accuracy(g, w, r, precision, "fp64" if r.dtype == torch.float64 else "fp32")))
    worst_name, worst = max(verdicts, key=lambda nv: nv[1].error / nv[1].bound if nv[1].bound > 0 else float("inf"))
    ok = all(a.ok for _, a in verdicts)
    text = f"output '{worst_name}': {worst.describe()}{note}"
    return ok, f"{ACCEPTED if ok else 'fails the accuracy rule'}: {text}"
