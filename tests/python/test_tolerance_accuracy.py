"""The accuracy rule for reduced precision (verify/tolerance.py): a candidate and eager both against a
high-precision reference, the candidate within ACCURACY_FACTOR x eager's error plus the format's unit roundoff.
Planted errors just above and just below the bound, a lossy kernel caught, fp32 at the fp32 policy untouched."""

from __future__ import annotations

import math

import pytest
import torch

from stitchcuda.verify.tolerance import (ACCURACY_FACTOR, UNIT_ROUNDOFF, accuracy_error, accuracy_floor, by_accuracy,
                                         judge_accuracy, reference_dtype, tolerance)


def _case(dtype: torch.dtype, n: int = 4096, seed: int = 0):
    """(reference in fp64, eager: a chain of 16-bit ops rounding after each, the same math in fp32 rounded once)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    w = torch.randn(n, generator=gen, dtype=torch.float64)
    xs, ws = x.to(dtype), w.to(dtype)
    eager = torch.tanh(xs * 1.7 + ws) * ws - xs * 0.3  # every op rounds to `dtype`
    once = (torch.tanh(xs.float() * 1.7 + ws.float()) * ws.float() - xs.float() * 0.3).to(dtype)
    ref = torch.tanh(xs.double() * 1.7 + ws.double()) * ws.double() - xs.double() * 0.3  # the truth for these inputs
    return ref, eager, once


def test_who_the_rule_covers():
    assert by_accuracy(torch.bfloat16) and by_accuracy(torch.float16)
    assert not by_accuracy(torch.float32) and not by_accuracy(torch.float64) and not by_accuracy(torch.int32)
    assert by_accuracy(torch.float32, "tf32") and by_accuracy(torch.float32, "bf16")
    # fp32 at the fp32 policy keeps the allclose table, unchanged
    assert tolerance(torch.float32) == (1e-4, 1e-4) and tolerance(torch.bfloat16) == (1e-2, 1e-2)


def test_floor_is_one_rounding_of_the_format_or_the_policy():
    assert accuracy_floor(torch.bfloat16) == 2.0 ** -8 and accuracy_floor(torch.float16) == 2.0 ** -11
    assert accuracy_floor(torch.float32, "tf32") == UNIT_ROUNDOFF["tf32"]
    assert accuracy_floor(torch.float32, "bf16") == UNIT_ROUNDOFF["bf16"]
    assert reference_dtype(True) == torch.float64 and reference_dtype(False) == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_once_in_fp32_passes_though_it_differs_from_eager(dtype):
    ref, eager, once = _case(dtype)
    verdict = judge_accuracy(once, eager, ref)
    assert verdict.ok, verdict.describe()
    assert verdict.error <= verdict.eager_error  # the fp32 kernel is the more accurate of the two
    assert not torch.equal(once, eager)  # and it is not ATen's answer
    assert "eager's" in verdict.describe() and verdict.to_dict()["reference"] == "fp64"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("share, ok", [(0.97, True), (1.03, False)])
def test_planted_error_just_below_and_just_above_the_bound(dtype, share, ok):
    """One element of a correct output moved so its error is `share` of the bound: kept in fp64 so the
    planted size is exact (the rule is about the error, whatever dtype carries it)."""
    ref, eager, once = _case(dtype)
    bound = ACCURACY_FACTOR * accuracy_error(eager, ref) + accuracy_floor(dtype)
    scale = float(ref.abs().max())
    planted = once.double().clone()
    k = int((ref - planted).abs().argmin())  # an element the candidate had right: the planted error is its own
    planted[k] = ref[k] + share * bound * scale
    verdict = judge_accuracy(planted, eager, ref)
    assert verdict.ok is ok, verdict.describe()
    assert math.isclose(verdict.error, share * bound, rel_tol=1e-6)


def test_a_kernel_accumulating_in_16_bits_is_caught():
    """A sum of 4096 products accumulated in fp16 (a kernel that skipped fp32 accumulation) against
    eager's fp16 matmul, which accumulates in fp32."""
    gen = torch.Generator().manual_seed(1)
    a = torch.rand(8, 4096, generator=gen).half()
    b = torch.rand(4096, 8, generator=gen).half()
    ref = a.double() @ b.double()
    eager = (a.float() @ b.float()).half()
    lossy = torch.zeros(8, 8, dtype=torch.float16)
    for k in range(0, 4096, 64):  # 16-bit running sum
        lossy = lossy + (a[:, k:k + 64].float() @ b[k:k + 64].float()).half()
    verdict = judge_accuracy(lossy, eager, ref)
    assert not verdict.ok, verdict.describe()


def test_nan_and_shape():
    ref, eager, once = _case(torch.bfloat16, n=64)
    bad = once.clone()
    bad[3] = float("nan")
    assert accuracy_error(bad, ref) == math.inf and not judge_accuracy(bad, eager, ref).ok
    assert accuracy_error(once[:10], ref) == math.inf
    inf_ref = ref.clone()
    inf_ref[0] = math.inf
    same = once.clone()
    same[0] = math.inf
    assert math.isfinite(accuracy_error(same, inf_ref))  # the same infinity matches


def test_an_exact_eager_still_leaves_one_rounding():
    """A copy: eager is exact, a candidate one rounding away (half an ulp at the largest magnitude) passes,
    two roundings away does not."""
    ref = torch.linspace(-4, 4, 257, dtype=torch.float64).bfloat16().double()
    eager = ref.bfloat16()
    scale = float(ref.abs().max())
    near, far = ref.clone(), ref.clone()
    near[10] += 0.99 * 2.0 ** -8 * scale
    far[10] += 1.01 * 2.0 ** -8 * scale
    assert judge_accuracy(near, eager, ref).ok and not judge_accuracy(far, eager, ref).ok
    assert judge_accuracy(near, eager, ref).eager_error == 0.0
