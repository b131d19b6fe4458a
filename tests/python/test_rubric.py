"""The Rubric through Python: items from source and findings, and the reward formula with the released
constants (R = I_correct · (1 − I_hack) · min((s + τ)(1 + λ·r̂), R_max))."""

from __future__ import annotations

import pytest

import stitchcuda
from stitchcuda.errors import InvalidArgumentError

TILED = r"""
extern "C" __global__ void gemm(const float* a, const float* b, float* c, int n) {
  __shared__ float ta[32][33];
  __shared__ float tb[32][33];
  // float4 in a comment does not count
  ta[threadIdx.y][threadIdx.x] = a[threadIdx.x];
  __syncthreads();
  float v = ta[0][threadIdx.x];
  v += __shfl_xor_sync(0xffffffff, v, 16);
  c[threadIdx.x] = v;
}
"""


def report(**kw):
    base = {"compiled": True, "correct": True, "speedup": {"eager": 2.0, "compile": 1.2}, "findings": []}
    base.update(kw)
    return base


def test_items_come_from_the_source_and_the_findings():
    card = stitchcuda.rubric.score(report(), cuda=[TILED], asks=["tile the GEMM in shared memory"])
    items = {i["dimension"]: i for i in card["items"]}
    assert items["anti-hacking"]["score"] == 5
    assert items["cuda-engineering"]["score"] == 3  # shared tiling + warp shuffles; the float4 is a comment
    assert items["skill-compliance"]["score"] >= 4
    hacked = stitchcuda.rubric.score(report(findings=[{"rule": "torch-does-heavy-work", "severity": "major",
                                                       "evidence": "torch.matmul(a, b)"}]), cuda=[TILED])
    assert {i["dimension"]: i["score"] for i in hacked["items"]}["anti-hacking"] == 1


def test_reward_formula_with_released_constants():
    card = {"items": [{"score": s} for s in (5, 4, 4, 3)]}  # total 16 -> r = 0.25
    r1 = stitchcuda.reward(report(), card, skill=1)
    assert r1["value"] == pytest.approx(min((2.0 + 0.3) * (1 + 1.0 * 0.25), 5.0))  # 2.875
    r2 = stitchcuda.reward(report(), card, skill=2)
    assert r2["value"] == pytest.approx((2.0 + 0.3) * (1 + 0.7 * 0.25))
    assert stitchcuda.reward(report(speedup={"eager": 9.0}), card)["value"] == 5.0  # R_max
    assert stitchcuda.reward(report(correct=False), card)["value"] == 0.0
    hack = report(findings=[{"rule": "gc-object-scan", "severity": "major", "evidence": "gc.get_objects()"}])
    zero = stitchcuda.reward(hack, card)
    assert zero["value"] == 0.0 and "gc-object-scan" in zero["zero_reason"]
    assert stitchcuda.reward(report(), card, tau=0.0, r_max=10.0)["value"] == pytest.approx(2.0 * 1.25)


def test_bad_input_is_a_clear_error():
    with pytest.raises(InvalidArgumentError, match="skill"):
        stitchcuda.reward(report(), {"items": [{"score": 3}] * 4}, skill=3)
    with pytest.raises(InvalidArgumentError):
        stitchcuda.reward(report(), {"items": [{"score": 9}] * 4})


def test_unverified_uncompiled_and_repairs_through_the_bindings():
    from stitchcuda import _C

    # Compiled and checked statically, never run: unverified, not incorrect.
    unrun = {"compiled": True, "correct": False, "speedup": 0.0, "findings": [], "verified": False}
    card = _C.rubric.score({"candidate": {"cuda": [TILED]}, "outcome": unrun})
    r = _C.rubric.reward(unrun, [i["score"] for i in card["items"]], 1, {})
    assert r["value"] == 0.0 and r["zero_reason"] == "unverified"

    # A candidate that did not compile is credited nothing, however rich its source.
    broken = dict(unrun, compiled=False)
    assert _C.rubric.score({"candidate": {"cuda": [TILED]}, "outcome": broken})["total"] == 4
    assert _C.rubric.score({"candidate": {"cuda": [TILED]}, "outcome": unrun})["total"] > 4

    # A compile error the feedback asked to fix is fixed once the candidate compiles, run or not.
    task = {"skill": 2, "asks": ["fix the compile error at line 3: expected a \";\""],
            "previous": {"cuda": ["__global__ void k() { int x }"]}, "previous_outcome": broken}
    fixed = _C.rubric.score({"candidate": {"cuda": [TILED]}, "outcome": unrun, "task": task})
    compliance = {i["dimension"]: i for i in fixed["items"]}["skill-compliance"]
    assert compliance["score"] == 5 and "compiles now" in compliance["evidence"][0]
