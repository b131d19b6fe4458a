"""bench.memory: the allocator trace replayed to the moment of its peak, the live blocks grouped by the
code that allocated them. The trace format is PyTorch's (torch.cuda.memory._snapshot()'s device_traces);
the traces here are written by hand so that the peak and its owners are known."""

from __future__ import annotations

import pytest
import torch

from stitchcuda.bench import memory
from stitchcuda.settings import settings

MiB = 1 << 20


def _frames(*where: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


RUNNER = _frames(("/site/stitchcuda/program.py", 350, "forward"), ("/site/stitchcuda/graph/optimize.py", 372, "timed"),
                 ("/site/stitchcuda/graph/optimize.py", 640, "build_one"), ("/site/torch/nn/modules/module.py", 1, "x"))
FLUSH = _frames(("/site/stitchcuda/verify/timing.py", 80, "flush"), ("/site/stitchcuda/graph/optimize.py", 372, "timed"))
MODEL = _frames(("/site/torch/nn/functional.py", 2000, "gelu"), ("/user/model.py", 12, "forward"))


def _event(action: str, addr: int, size: int, frames: list[dict]) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames}


def test_the_sites_are_those_alive_at_the_peak_not_at_the_end():
    trace = [
        _event("alloc", 1, 300 * MiB, RUNNER),           # the runner's arena
        _event("alloc", 2, 100 * MiB, FLUSH),            # a flush beside it: 400 live, the peak
        _event("free_requested", 2, 100 * MiB, FLUSH),
        _event("free_completed", 2, 100 * MiB, FLUSH),   # 300
        _event("free_requested", 1, 300 * MiB, RUNNER),  # requested, still live until completed
        _event("alloc", 3, 50 * MiB, MODEL),             # 350: below the peak
        _event("free_completed", 1, 300 * MiB, RUNNER),  # 50
        _event("alloc", 4, 120 * MiB, MODEL),            # 170
    ]
    result = memory.peak_sites({"segments": [], "device_traces": [trace]}, top=8)
    assert result["peak_bytes"] == 400 * MiB
    assert [(s["bytes"], s["blocks"]) for s in result["sites"]] == [(300 * MiB, 1), (100 * MiB, 1)]
    # Innermost package frames first; torch's own frames are not the package's.
    assert result["sites"][0]["where"] == "program.py:350 forward < optimize.py:372 timed < optimize.py:640 build_one"
    assert result["sites"][1]["where"] == "timing.py:80 flush < optimize.py:372 timed"
    assert result["other_bytes"] == 0
    text = memory.format_sites(result)
    assert "peak 400 MiB" in text and "300.0 MiB" in text


def test_blocks_of_the_same_code_add_up_and_the_rest_is_counted():
    trace = [_event("alloc", i, (i + 1) * MiB, RUNNER if i % 2 else MODEL) for i in range(6)]
    trace.append(_event("alloc", 99, 7 * MiB, FLUSH))
    result = memory.peak_sites({"device_traces": [trace]}, top=1, depth=1)
    assert result["peak_bytes"] == (21 + 7) * MiB
    (site,) = result["sites"]
    # Odd blocks from the runner: 2 + 4 + 6 MiB; even ones from the model, named by its innermost frame.
    assert (site["where"], site["bytes"], site["blocks"]) == ("program.py:350 forward", 12 * MiB, 3)
    assert result["other_bytes"] == (1 + 3 + 5 + 7) * MiB


def test_no_trace_is_no_peak():
    assert memory.peak_sites({"device_traces": []}) == {"peak_bytes": 0, "sites": [], "other_bytes": 0}
    unnamed = memory.peak_sites({"device_traces": [[_event("alloc", 1, MiB, [])]]})
    assert unnamed["sites"][0]["where"] == "unknown (no stack recorded)"


def test_the_bench_setting_is_a_count(stitch_settings):
    stitch_settings(STITCHCUDA_MEMORY_SITES=None)
    assert settings().memory_sites == 0
    stitch_settings(STITCHCUDA_MEMORY_SITES="6")
    assert settings().memory_sites == 6
    stitch_settings(STITCHCUDA_MEMORY_SITES="all")
    with pytest.raises(ValueError, match="STITCHCUDA_MEMORY_SITES must be a whole number"):
        settings().memory_sites


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_recorded_peak_names_the_allocating_test():
    torch.cuda.synchronize()
    with memory.recording():
        a = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
        del a, b
        c = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        snapshot = torch.cuda.memory._snapshot()
    del c
    result = memory.peak_sites(snapshot, package="tests", depth=1)
    assert result["peak_bytes"] == 96 * MiB
    # a's and b's lines, largest first: c came after the peak.
    assert [s["bytes"] for s in result["sites"]] == [64 * MiB, 32 * MiB]
    assert all("test_a_recorded_peak_names_the_allocating_test" in s["where"] for s in result["sites"])
