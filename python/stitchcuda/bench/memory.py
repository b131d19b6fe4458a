"""Where a peak of GPU memory comes from: PyTorch's allocator history recorded around a call (every
allocation and free with the Python stack that made it), replayed to find the moment the live bytes
peaked, and the blocks alive then grouped by the code that allocated them.

    with memory.recording():
        optimize(model, inputs)
        snapshot = torch.cuda.memory._snapshot()
    print(memory.peak_sites(snapshot))   # {"peak_bytes": ..., "sites": [{"bytes", "blocks", "where"}, ...]}

`stitchcuda bench kernelbench` adds the sites of optimize()'s peak to each row (`peak_sites`) when
STITCHCUDA_MEMORY_SITES is set (to how many sites to keep). Recording stacks slows every allocation:
this is a diagnostic, not a default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

# Allocations and frees the allocator's ring buffer keeps; the oldest go first past it.
MAX_ENTRIES = 1_000_000
PACKAGE = "stitchcuda"


@contextlib.contextmanager
def recording(max_entries: int = MAX_ENTRIES) -> Iterator[None]:
    """Records the CUDA caching allocator's history (Python stacks) while the block runs; take the
    snapshot (torch.cuda.memory._snapshot()) inside it. The history is cleared on the way out."""
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=max_entries)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _where(frames: list[dict], package: str, depth: int) -> str:
    """The allocating code: the innermost `depth` frames of `package` (innermost first, as the allocator
    records them), "file:line function" each, joined by " < "; the innermost frame of all when none
    belongs to the package (a model's own forward)."""
    ours = [f for f in frames if f"/{package}/" in f.get("filename", "").replace("\\", "/")]
    chosen = ours[:depth] or frames[:1]
    if not chosen:
        return "unknown (no stack recorded)"
    return " < ".join(f"{f['filename'].replace(chr(92), '/').rsplit('/', 1)[-1]}:{f.get('line', 0)} {f.get('name', '?')}"
                      for f in chosen)


def peak_sites(snapshot: dict[str, Any], device: int = 0, top: int = 8, package: str = PACKAGE,
               depth: int = 3) -> dict[str, Any]:
    """The recorded trace of `device` replayed: bytes are live from an allocation until its free
    completes (a block freed on one stream but in use on another is live until then, as the allocator
    counts it). At the moment the live bytes peaked: {"peak_bytes": the live bytes above the trace's
    start, "sites": the `top` largest groups of the blocks alive then, by allocating code, each {"bytes",
    "blocks", "where"}, "other_bytes": the rest}. Blocks allocated before the recording began are not in
    the trace: the peak is relative to the start, like torch.cuda.max_memory_allocated after a reset."""
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for e in events:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif action == "free_completed":
            gone = live.pop(e["addr"], None)
            if gone is not None:
                total -= gone["size"]
    groups: dict[str, list[int]] = {}
    for e in at_peak:
        g = groups.setdefault(_where(e.get("frames") or [], package, depth), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    sites = [{"bytes": b, "blocks": n, "where": where} for where, (b, n) in ranked[:top]]
    return {"peak_bytes": peak, "sites": sites, "other_bytes": sum(b for _, (b, _) in ranked[top:])}


def format_sites(result: dict[str, Any]) -> str:
    """peak_sites' result as lines of MiB, largest first."""
    lines = [f"peak {result['peak_bytes'] / 2**20:,.0f} MiB above the recording's start:"]
    lines += [f"  {s['bytes'] / 2**20:9,.1f} MiB  {s['blocks']:4d} block(s)  {s['where']}" for s in result["sites"]]
    if result.get("other_bytes"):
        lines.append(f"  {result['other_bytes'] / 2**20:9,.1f} MiB  elsewhere")
    return "\n".join(lines)


# ---- the sizes a bench row's memory ratio is measured against ----


def largest_tensor_bytes(*structures: Any) -> int:
    """The bytes of the largest single tensor in the given (nested) inputs and outputs."""
    tensors = [t for s in structures for t in pytree.tree_flatten(s)[0] if isinstance(t, torch.Tensor)]
    return max((t.numel() * t.element_size() for t in tensors), default=0)


def forward_largest_tensor_bytes(model: torch.nn.Module, inputs: tuple) -> int:
    """The bytes of the largest tensor one eager forward of `model` makes (every ATen op's result, the
    intermediates included), at least its inputs' largest."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.largest = max(self.largest, largest_tensor_bytes(out))
            return out

    mode = Largest()
    mode.largest = largest_tensor_bytes(inputs)
    with torch.no_grad(), mode:
        model(*inputs)
    return mode.largest


def memory_ratio(optimize_peak: int | None, eager_peak: int | None, largest: int | None) -> float | None:
    """optimize peak / (eager peak + 2 x largest tensor): optimize may hold the model's working set plus an
    input and an output copy (a reference and a candidate) before it costs more than the target of 1."""
    if optimize_peak is None or eager_peak is None or largest is None:
        return None
    budget = eager_peak + 2 * largest
    return optimize_peak / budget if budget > 0 else None
