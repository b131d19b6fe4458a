"""optimize() takes what users have: positional inputs as a tuple, a list or one tensor, keyword inputs,
a plain function or a bound method as well as a module. A model in training mode is refused with the
fix; the result is inference-only. A model with an operator no program buffer can hold (complex values
from torch.fft) is still planned, that operator an ATen fallback group with the reason.

Without a GPU optimize() captures, plans and compiles only (the report says "planned and compiled
only"), which is what the CPU tests here check; the GPU tests run the stitched program.
"""

from __future__ import annotations

import importlib
import logging
import re

import pytest
import torch
import torch.nn as nn

import stitchcuda
from stitchcuda.errors import InvalidArgumentError
from stitchcuda.graph import capture, reference_values

graph_module = importlib.import_module("stitchcuda.graph.module")

HAS_GPU = torch.cuda.is_available()
PLANNED = "planned and compiled only"


class Masked(nn.Module):
    """A forward with a keyword input and a keyword with a default."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)

    def forward(self, x, mask=None, scale=2.0):
        y = torch.relu(self.proj(x))
        if mask is not None:
            y = y * mask
        return y * scale + 1


def _inputs(device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(8, 16, device=device)
    mask = (torch.rand(8, 32, device=device) > 0.5).float()
    return x, mask


def _ops(fast) -> set[str]:
    return set(fast.report.op_counts)


# ---- the input forms, planned without a GPU -----------------------------------------------------------


@pytest.mark.skipif(HAS_GPU, reason="the plan-only path runs where there is no GPU (GPU forms below)")
@pytest.mark.parametrize("form", ["tuple", "list", "tensor"])
def test_positional_inputs_as_tuple_list_or_one_tensor_plan_the_same(form):
    model = Masked().eval()
    x, _ = _inputs()
    args = {"tuple": (x,), "list": [x], "tensor": x}[form]
    fast = stitchcuda.optimize(model, args, progress=False)
    assert PLANNED in fast.report.reason, fast.report.reason
    assert [g["kind"] for g in fast.report.groups] == ["gemm", "pointwise"], fast.report.groups
    assert "aten::mul.Tensor" in _ops(fast)  # the scale, not the mask: none was given
    assert torch.equal(fast(x), model(x))  # no GPU: the original model runs
    assert fast.original is model and fast.report.status == "eager"


@pytest.mark.skipif(HAS_GPU, reason="the plan-only path runs where there is no GPU")
def test_keyword_inputs_are_captured_as_program_inputs_after_the_positional_ones():
    model = Masked().eval()
    x, mask = _inputs()
    fast = stitchcuda.optimize(model, (x,), {"mask": mask}, progress=False)
    assert PLANNED in fast.report.reason, fast.report.reason
    assert fast.report.op_counts["aten::mul.Tensor"] == 2  # * mask, * scale
    assert torch.equal(fast(x, mask=mask), model(x, mask=mask))
    # The order the program takes its inputs in: the graph of the same call, run by ATen on the flat
    # inputs (x, mask), computes the model's value.
    traced = graph_module.KeywordCall(model, 1, ("mask",))
    graph = capture(traced, (x, mask))
    assert [tuple(v.shape) for v in graph.inputs] == [(8, 16), (8, 32)]
    got = reference_values(graph, [x, mask])[graph.outputs[0].name]
    torch.testing.assert_close(got, model(x, mask=mask))


def test_a_call_maps_keywords_to_the_program_order_and_refuses_unseen_ones():
    x, m, s = object(), object(), object()
    # optimize(model, (x,), {"mask": m, "scale": s}) saw one positional input, then mask and scale.
    assert graph_module.positional_call((x,), {"scale": s, "mask": m}, 1, ("mask", "scale")) == (x, m, s)
    assert graph_module.positional_call((x, m), {"scale": s}, 1, ("mask", "scale")) == (x, m, s)
    assert graph_module.positional_call((x, m, s), {}, 1, ("mask", "scale")) == (x, m, s)
    with pytest.raises(InvalidArgumentError, match=r"lacks \['scale'\]"):
        graph_module.positional_call((x,), {"mask": m}, 1, ("mask", "scale"))
    with pytest.raises(InvalidArgumentError, match=r"gives \['bias'\], which optimize\(\) did not see"):
        graph_module.positional_call((x,), {"bias": m}, 1, ())


@pytest.mark.skipif(HAS_GPU, reason="the plan-only path runs where there is no GPU")
def test_inputs_without_a_tensor_are_fixed_at_their_values():
    model = Masked().eval()
    x, mask = _inputs()
    fast = stitchcuda.optimize(model, (x,), {"mask": mask, "scale": 3.0}, progress=False)
    assert PLANNED in fast.report.reason, fast.report.reason
    fixed = [why for d, why in fast.report.decisions if d == "1 input(s) without a tensor fixed at the values optimize() saw"]
    assert fixed and fixed[0].startswith("scale=3.0: the program is specialized to them")
    # The traced call takes the tensors alone; its graph, run by ATen, is the model's call with scale=3.0.
    traced = graph_module.KeywordCall(model, 1, ("mask", "scale"), {2: 3.0})
    graph = capture(traced, (x, mask))
    assert [tuple(v.shape) for v in graph.inputs] == [(8, 16), (8, 32)]
    got = reference_values(graph, [x, mask])[graph.outputs[0].name]
    torch.testing.assert_close(got, model(x, mask=mask, scale=3.0))
    # A positional one too: a None mask passed by position is a fixed input.
    traced = graph_module.KeywordCall(model, 2, (), {1: None})
    graph = capture(traced, (x,))
    torch.testing.assert_close(reference_values(graph, [x])[graph.outputs[0].name], model(x, None))


@pytest.mark.skipif(HAS_GPU, reason="the plan-only path runs where there is no GPU")
def test_tensors_made_under_inference_mode_are_captured():
    # An inference server makes its inputs, and may load its model, under torch.inference_mode(): such
    # tensors cannot be recorded by autograd, so the capture traces without it.
    with torch.inference_mode():
        model = Masked().eval()
        x, mask = _inputs()
    assert x.is_inference() and model.proj.weight.is_inference()
    fast = stitchcuda.optimize(model, (x,), {"mask": mask}, progress=False)
    assert PLANNED in fast.report.reason, fast.report.reason
    graph = capture(graph_module.KeywordCall(model, 1, ("mask",)), (x, mask))
    torch.testing.assert_close(reference_values(graph, [x, mask])[graph.outputs[0].name], model(x, mask=mask))


class _Report(nn.Module):
    """A forward returning a dict whose leaves are not all tensors: a count and a None beside them."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        y = self.proj(x)
        return {"y": y, "parts": (torch.relu(y), None), "count": 3, "kind": "logits"}


def test_numbers_strings_and_none_in_the_output_come_back_around_the_programs_tensors():
    model, (x, _) = _Report().eval(), _inputs()
    graph = capture(model, (x,))
    assert len(graph.outputs) == 2 and sorted(graph.output_constants.values(), key=str) == [3, None, "logits"]
    values = reference_values(graph, [x])
    import torch.utils._pytree as pytree

    got = pytree.tree_unflatten(graph.output_leaves([values[v.name] for v in graph.outputs]), graph.out_spec)
    want = model(x)
    assert got.keys() == want.keys() and got["count"] == 3 and got["kind"] == "logits" and got["parts"][1] is None
    torch.testing.assert_close(got["y"], want["y"])
    torch.testing.assert_close(got["parts"][0], want["parts"][0])


def test_a_call_may_leave_out_a_fixed_keyword_input_and_may_not_change_it():
    x, m = object(), object()
    settings = {2: 3.0}  # optimize(model, (x,), {"mask": m, "scale": 3.0})
    call = graph_module.positional_call
    assert call((x,), {"mask": m}, 1, ("mask", "scale"), settings) == (x, m, 3.0)
    assert call((x,), {"mask": m, "scale": 3.0}, 1, ("mask", "scale"), settings) == (x, m, 3.0)
    assert call((x, m, 3.0), {}, 1, ("mask", "scale"), settings) == (x, m, 3.0)
    with pytest.raises(InvalidArgumentError, match=r"scale=2\.0 differs from the 3\.0 optimize\(\) saw: the program "
                                                   r"is specialized to the inputs without a tensor"):
        call((x,), {"mask": m, "scale": 2.0}, 1, ("mask", "scale"), settings)
    with pytest.raises(InvalidArgumentError, match=r"scale=3 differs from the 3\.0"):  # an int is another value
        call((x,), {"mask": m, "scale": 3}, 1, ("mask", "scale"), settings)
    # A positional one must be given (Python's own rule) and be the same.
    with pytest.raises(InvalidArgumentError, match=r"positional input 1: True differs from the False"):
        call((x, True), {}, 2, (), {1: False})
    with pytest.raises(InvalidArgumentError, match=r"lacks \['mask'\]"):  # a tensor input may not be left out
        call((x,), {}, 1, ("mask", "scale"), settings)


@pytest.mark.skipif(HAS_GPU, reason="the plan-only path runs where there is no GPU")
def test_a_plain_function_and_a_bound_method_are_optimized_like_modules():
    x, mask = _inputs()

    def gate(a, b):
        return torch.sigmoid(a) * b + 1

    fast = stitchcuda.optimize(gate, (x, x), progress=False)
    assert PLANNED in fast.report.reason, fast.report.reason
    assert [g["kind"] for g in fast.report.groups] == ["pointwise"]
    assert torch.equal(fast(x, x), gate(x, x))

    model = Masked().eval()
    fast = stitchcuda.optimize(model.forward, (x,), {"mask": mask}, progress=False)
    assert PLANNED in fast.report.reason, fast.report.reason
    # The method's module came along: its weight is a program weight, folded into the matmul.
    assert [g["kind"] for g in fast.report.groups] == ["gemm", "pointwise"]
    assert torch.equal(fast(x, mask=mask), model(x, mask=mask))


def test_inputs_of_the_wrong_kind_are_refused_with_the_fix():
    model = Masked().eval()
    x, mask = _inputs()
    with pytest.raises(InvalidArgumentError, match="keyword inputs go in kwargs="):
        stitchcuda.optimize(model, {"x": x})
    with pytest.raises(InvalidArgumentError, match="kwargs must be a dict"):
        stitchcuda.optimize(model, (x,), [mask])
    with pytest.raises(InvalidArgumentError, match="nn.Module or a function of tensors, not a int"):
        stitchcuda.optimize(3, (x,))


# ---- inference only -----------------------------------------------------------------------------------


def test_a_model_in_training_mode_is_refused_and_left_as_it_was():
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5))
    x, _ = _inputs()
    with pytest.raises(InvalidArgumentError, match=r"the model is in training mode: call model\.eval\(\) first"):
        stitchcuda.optimize(model, (x,))
    assert all(m.training for m in model.modules())  # optimize() no longer switches modes behind the caller
    model.eval()
    model[1].train()
    with pytest.raises(InvalidArgumentError, match="its submodule '1' is in training mode"):
        stitchcuda.optimize(model, (x,))
    with pytest.raises(InvalidArgumentError, match="inference program"):
        stitchcuda.optimize(model.forward, (x,))  # a bound method brings its module's mode along
    assert not model.training and model[1].training


def test_the_optimized_module_is_inference_only():
    model = Masked().eval()
    x, _ = _inputs("cuda" if HAS_GPU else "cpu")
    fast = stitchcuda.optimize(model.to(x.device), (x,), measure=False, progress=False)
    assert not fast.training and "Inference only" in type(fast).__doc__
    with pytest.raises(InvalidArgumentError, match=r"inference-only.*\.original"):
        fast.train()
    assert fast.eval() is fast and not fast.training
    parent = nn.Sequential(fast)
    with pytest.raises(InvalidArgumentError, match="inference-only"):
        parent.train()  # training a model that holds it is refused the same way


# ---- an operator the program cannot hold ---------------------------------------------------------------


class Spectral(nn.Module):
    """A projection, a real FFT's magnitude (complex values in between), then a fused tail."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        spectrum = torch.fft.rfft(self.proj(x), dim=-1)
        return torch.relu(spectrum.abs()) * 2 + 1


@pytest.mark.skipif(HAS_GPU, reason="the plan-only path runs where there is no GPU (GPU case below)")
def test_an_fft_inside_the_model_is_an_aten_fallback_and_the_rest_is_planned():
    model = Spectral().eval()
    x = torch.randn(4, 16)
    fast = stitchcuda.optimize(model, (x,), progress=False)
    groups = [(g["kind"], g["nodes"]) for g in fast.report.groups]
    assert groups == [("gemm", "addmm"), ("aten (fallback)", "_fft_r2c"), ("aten (fallback)", "abs"),
                      ("pointwise", "relu, mul.Tensor, add.Tensor")], groups
    fft = next(g for g in fast.report.groups if g["nodes"] == "_fft_r2c")
    assert "torch.complex64" in fft["reason"] and "no program buffer holds" in fft["reason"]
    assert [f["group"].rstrip("_0123456789") for f in fast.report.fallbacks] == ["_fft_r2c", "abs"]  # fx names: abs_1
    reason = fast.report.reason
    assert "planned only" in reason and "aten::_fft_r2c" in reason and "the rest of the model is planned" in reason
    assert "stopped" not in reason  # the plan did not abort
    assert torch.equal(fast(x), model(x))


@pytest.mark.skipif(HAS_GPU, reason="the plan-only path runs where there is no GPU")
def test_a_complex_scalar_no_longer_stops_the_capture():
    class Rotate(nn.Module):
        def forward(self, x):
            return torch.view_as_real(x * 1j).sum(-1) + x

    fast = stitchcuda.optimize(Rotate().eval(), (torch.randn(4, 8),), progress=False)
    kinds = {g["nodes"]: g["kind"] for g in fast.report.groups}
    assert kinds["mul.Tensor"] == "aten (fallback)" and kinds["sum.dim_IntList, add.Tensor"] == "reduction", kinds
    assert "complex64" in fast.report.reason


# ---- torch.compile's graphs ------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_GPU, reason="the GPU backend test is in test_gpu_graph.py")
def test_dynamo_graphs_are_not_refused_as_training_mode():
    # Dynamo hands the backend a GraphModule flagged as training whatever the model's mode.
    from stitchcuda.graph import dynamo

    dynamo.register()
    torch._dynamo.reset()
    model = Masked().eval()
    x, _ = _inputs()
    out = torch.compile(model, backend="stitchcuda")(x)
    torch.testing.assert_close(out, model(x))
    assert "no CUDA device" in dynamo.reports[-1].reason and PLANNED in dynamo.reports[-1].reason


# ---- on a GPU: the stitched program runs with each input form ------------------------------------------


def _optimized_masked(**kwargs):
    """The Masked model on the GPU, optimized with a mask (and `kwargs`' other keyword inputs), verified."""
    model = Masked().cuda().eval()
    x, mask = _inputs("cuda")
    fast = stitchcuda.optimize(model, (x,), {"mask": mask, **kwargs}, measure=False, keep_slower=True, progress=False)
    assert fast.report.status == "optimized", fast.report.reason
    return model, x, mask, fast


@pytest.mark.gpu
def test_gpu_keyword_inputs_run_through_the_program():
    model, x, mask, fast = _optimized_masked()
    torch.testing.assert_close(fast(x, mask=mask), model(x, mask=mask))
    torch.testing.assert_close(fast(x, mask), model(x, mask))  # the keyword given positionally
    x2, mask2 = torch.randn_like(x), torch.ones_like(mask)
    torch.testing.assert_close(fast(x2, mask=mask2), model(x2, mask=mask2))
    with pytest.raises(InvalidArgumentError, match="lacks"):
        fast(x)


@pytest.mark.gpu
def test_gpu_an_input_without_a_tensor_is_fixed_in_the_program():
    model, x, mask, fast = _optimized_masked(scale=3.0)
    want = model(x, mask=mask, scale=3.0)
    torch.testing.assert_close(fast(x, mask=mask, scale=3.0), want)
    torch.testing.assert_close(fast(x, mask=mask), want)  # left out: the value optimize() saw
    with pytest.raises(InvalidArgumentError, match=r"scale=2\.0 differs from the 3\.0 optimize\(\) saw"):
        fast(x, mask=mask, scale=2.0)


@pytest.mark.gpu
def test_gpu_inputs_of_other_shapes_run_the_original_model_with_one_warning(caplog):
    model, x, mask, fast = _optimized_masked()
    small, small_mask = x[:3].clone(), mask[:3].clone()
    said = r"inputs \[f32\[3, 16\], f32\[3, 32\]\] differ from the \[f32\[8, 16\], f32\[8, 32\]\] this program was stitched for"
    with caplog.at_level(logging.WARNING, logger="stitchcuda"):
        got = fast(small, mask=small_mask)
        fast(small, mask=small_mask)  # the same shapes again: no second warning
    assert sum(bool(re.search(said, r.getMessage())) for r in caplog.records) == 1
    torch.testing.assert_close(got, model(small, mask=small_mask))
    torch.testing.assert_close(fast(x, mask=mask), model(x, mask=mask))  # the program again
    assert fast.other_shape_calls == 2 and fast._runner.executor.stats()["runs"] >= 1


@pytest.mark.gpu
def test_gpu_numbers_and_none_in_the_output_come_back():
    model = _Report().cuda().eval()
    x, _ = _inputs("cuda")
    fast = stitchcuda.optimize(model, (x,), measure=False, keep_slower=True, progress=False)
    assert fast.report.status == "optimized", fast.report.reason
    got, want = fast(x), model(x)
    assert (got["count"], got["kind"], got["parts"][1]) == (3, "logits", None)
    torch.testing.assert_close(got["y"], want["y"])


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["tensor", "list", "function"])
def test_gpu_each_input_form_runs_the_program(form):
    model = Masked().cuda().eval()
    x, _ = _inputs("cuda")
    if form == "function":
        fn = lambda a: torch.sigmoid(a) * a + 1  # noqa: E731
        fast = stitchcuda.optimize(fn, x, measure=False, keep_slower=True, progress=False)
        expected = fn(x)
    else:
        fast = stitchcuda.optimize(model, x if form == "tensor" else [x], measure=False, keep_slower=True,
                                   progress=False)
        expected = model(x)
    assert fast.report.status == "optimized", fast.report.reason
    torch.testing.assert_close(fast(x), expected)


@pytest.mark.gpu
def test_gpu_an_fft_model_runs_eagerly_with_the_plan_in_the_report():
    model = Spectral().cuda().eval()
    x = torch.randn(4, 16, device="cuda")
    fast = stitchcuda.optimize(model, (x,), measure=False, progress=False)
    assert fast.report.status == "eager" and "cannot be built" in fast.report.reason, fast.report.reason
    assert ("aten (fallback)", "_fft_r2c") in [(g["kind"], g["nodes"]) for g in fast.report.groups]
    torch.testing.assert_close(fast(x), model(x))
