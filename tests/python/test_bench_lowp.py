"""The low-precision suite (bench/lowp, `stitchcuda bench lowp`): every problem's variants expanded into rows,
each model's full size consistent (built on the meta device), the high-precision reference and its fp32
fallback, the accuracy rule against planted errors just inside and just outside its bound, --compile-only of
two small variants on the CPU, the flags' usage errors, and a timed small variant on a GPU (marked gpu).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stitchcuda.bench import precision, problems, reference, suite
from stitchcuda.cli import main

LOWP = Path(__file__).resolve().parents[2] / "bench" / "lowp"
FILES = sorted(p for p in LOWP.glob("net_*.py"))
KINDS = {"net_llama_gqa", "net_gpt2", "net_bert_base", "net_vit_b16", "net_t5_encdec", "net_resnet50", "net_convnext_t"}


def _module(stem: str, small: bool = True):
    module = problems.load(LOWP / f"{stem}.py")
    return problems.shrink(module) if small else module


def _json(text: str) -> dict:
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


def test_every_model_kind_has_its_three_variants():
    assert {p.stem for p in FILES} == KINDS
    rows = problems.expand_variants(problems.folder_problems(LOWP))
    assert [r.name for r in rows if r.path.stem == "net_gpt2"] == \
        ["net_gpt2[bf16]", "net_gpt2[fp16]", "net_gpt2[autocast-bf16]"]
    assert len(rows) == 3 * len(KINDS)  # _layers.py is a helper, not a problem
    only = "net_gpt2[fp16],net_resnet50"
    picked = problems.expand_variants(problems.model_files(LOWP, only), only)
    assert [r.name for r in picked] == ["net_gpt2[fp16]", "net_resnet50[bf16]", "net_resnet50[fp16]",
                                        "net_resnet50[autocast-bf16]"]
    # --only with a variant selects its file (and only that variant of it).
    assert [p.stem for p in problems.model_files(LOWP, "net_gpt2[fp16]")] == ["net_gpt2"]


def test_a_file_without_variants_is_one_row_and_an_unknown_variant_is_named(tmp_path):
    plain = tmp_path / "op_plain.py"
    plain.write_text("class Model: pass\n")
    assert [r.name for r in problems.expand_variants([plain])] == ["op_plain"]
    with pytest.raises(ValueError, match="unknown variant 'int4'.*bf16, fp16"):
        precision.variant_fields("int4")


@pytest.mark.parametrize("stem", sorted(KINDS))
def test_full_size_builds_on_meta_with_the_variant_dtype(stem):
    """The real sizes are consistent (every layer's shapes agree) and a 16-bit variant moves half the bytes
    of the fp32 weights an autocast variant keeps (problem_work, on the meta device: no memory)."""
    module = _module(stem, small=False)
    bf16, autocast = suite.problem_work(module, "bf16"), suite.problem_work(module, "autocast-bf16")
    # The same work in both (within 1%: SDPA picks another kernel, counted otherwise, for 16-bit inputs).
    assert bf16["flops"] > 1e11 and bf16["flops"] == pytest.approx(autocast["flops"], rel=0.01)
    assert 0.45 < bf16["bytes"] / autocast["bytes"] <= 0.5 + 1e-3  # int64 token ids keep their width


def test_shrink_needs_a_small_dict(tmp_path):
    path = tmp_path / "net_nosmall.py"
    path.write_text("import torch\nclass Model(torch.nn.Module): pass\ndef get_inputs(): return []\n"
                    "def get_init_inputs(): return []\n")
    with pytest.raises(ValueError, match="no SMALL dict"):
        problems.shrink(problems.load(path))


def test_variants_cast_weights_and_floating_inputs_only():
    module = _module("net_t5_encdec")
    torch.manual_seed(0)
    model, inputs = precision.cast_variant(module.Model(*module.get_init_inputs()), tuple(module.get_inputs()),
                                           "fp16")
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert all(t.dtype == torch.int64 for t in inputs)  # token ids stay integers
    module = _module("net_vit_b16")
    model, inputs = precision.cast_variant(module.Model(*module.get_init_inputs()), tuple(module.get_inputs()),
                                           "autocast-bf16")
    assert {p.dtype for p in model.parameters()} == {torch.float32} and inputs[0].dtype == torch.float32
    with torch.no_grad(), precision.variant_autocast("autocast-bf16", "cpu"):
        assert model(*inputs).dtype == torch.bfloat16  # the head's linear ran under autocast


def _eager_and_reference(stem: str, variant: str):
    module = _module(stem)
    torch.manual_seed(0)
    model, inputs = precision.cast_variant(module.Model(*module.get_init_inputs()).eval(),
                                           tuple(module.get_inputs()), variant)
    with torch.no_grad():
        eager = model(*inputs)
    ref, note = reference.fp64_reference(model, inputs, eager)
    assert ref is not None and ref.dtype == torch.float64, note
    return eager, ref


def _planted(ref: torch.Tensor, error: float) -> torch.Tensor:
    """The reference itself (float64, error 0 everywhere) with one element moved by exactly `error`."""
    got = ref.clone()
    got.view(-1)[got.numel() // 2] += error
    return got


@pytest.mark.parametrize("variant", ["bf16", "fp16"])
def test_accuracy_rule_with_planted_errors_just_inside_and_outside_the_bound(variant):
    """A real 16-bit model's eager error against its fp64 reference sets the bound (the Verifier's rule: 2x
    eager's norm-wise error plus one rounding of the format); a candidate whose only error is planted 1% below
    the bound passes, 1% above fails, through fp64_errors and add_accuracy as the bench records them."""
    from stitchcuda.verify.tolerance import ACCURACY_FACTOR, accuracy_floor

    eager, ref = _eager_and_reference("net_llama_gqa", variant)
    eager_error = reference.fp64_errors(eager, ref)["max_rel"]
    assert 0 < eager_error < 0.05  # 16-bit rounding, not a broken model
    floor = accuracy_floor(eager.dtype)
    bound = precision.accuracy_bound(eager_error, floor)
    assert bound == pytest.approx(ACCURACY_FACTOR * eager_error + floor)
    scale = float(ref.abs().max())
    for share, ok in ((0.99, True), (1.01, False)):
        row = {"variant": variant, "dtype": eager.dtype.__repr__().removeprefix("torch."),
               "err_fp64": {"eager": reference.fp64_errors(eager, ref),
                            "stitch": reference.fp64_errors(_planted(ref, share * bound * scale), ref)}}
        assert row["err_fp64"]["stitch"]["max_rel"] == pytest.approx(share * bound, rel=1e-9)
        precision.add_accuracy(row)
        assert row["accurate"] is ok and row["accuracy"]["stitch"]["ok"] is ok
        assert row["accuracy"]["stitch"]["bound"] == pytest.approx(bound)


def test_the_floor_admits_an_exact_eager_and_no_reference_is_unknown():
    floor = precision.row_floor({"variant": "bf16", "dtype": "bfloat16"})
    assert floor == 2.0 ** -8
    assert precision.row_floor({"variant": "autocast-bf16", "dtype": "float32", "output_dtype": "float32"}) == 2.0 ** -8
    assert precision.accuracy_verdict(0.9 * floor, 0.0, floor)["ok"] is True
    assert precision.accuracy_verdict(1.1 * floor, 0.0, floor)["ok"] is False
    row = precision.add_accuracy({"err_fp64": None})
    assert row["accurate"] is None and "accuracy" not in row


def test_reference_falls_back_to_fp32_where_fp64_does_not_fit():
    module = _module("net_gpt2")
    torch.manual_seed(0)
    model, inputs = precision.cast_variant(module.Model(*module.get_init_inputs()).eval(),
                                           tuple(module.get_inputs()), "bf16")
    assert reference.reference_dtype(model, inputs) == torch.float64
    need64 = reference._fp64_bytes([*model.parameters()], inputs)
    assert reference.reference_dtype(model, inputs, budget=need64 - 1) == torch.float32
    ref, note = reference.fp64_reference(model, inputs, None, dtype=torch.float32)
    assert note == "" and ref.dtype == torch.float32
    none, why = reference.fp64_reference(model, inputs, None, budget=16, dtype=torch.float32)
    assert none is None and why.startswith("skipped: the float32 weights")


def test_compile_only_plans_two_small_variants(capsys):
    """`bench lowp --compile-only --small` on the CPU: the named variants as rows, each planned and compiled in
    its dtype (bf16 matmuls for a bf16 model and under autocast), the reference's dtype recorded."""
    code = main(["bench", "lowp", "--compile-only", "--small", "--only",
                 "net_llama_gqa[bf16],net_vit_b16[autocast-bf16]", "--json"])
    report = _json(capsys.readouterr().out)
    assert code == 0, report
    assert report["small"] is True and report["mode"] == "compile-only"
    rows = {r["model"]: r for r in report["models"]}
    assert set(rows) == {"net_llama_gqa[bf16]", "net_vit_b16[autocast-bf16]"}
    llama, vit = rows["net_llama_gqa[bf16]"], rows["net_vit_b16[autocast-bf16]"]
    assert (llama["variant"], llama["dtype"], "autocast" in llama) == ("bf16", "bfloat16", False)
    assert (vit["variant"], vit["dtype"], vit["autocast"]) == ("autocast-bf16", "float32", "bfloat16")
    for row in rows.values():
        assert row["status"] == "compiled", row
        assert row["kernels"] > 0 and row["groups"].get("gemm", 0) > 0
        assert row["reference_dtype"] == "float64" and row["small"] is True and row["correct"] is None
        assert "bf16" in row["matmuls"]  # planned in the model's 16-bit dtype, not fp32


class _Program:
    """optimize()'s result where no GPU can run one: the model's own forward, or that forward 2% off (a
    kernel that loses precision: still within eager's 1e-2 tolerance, far outside the accuracy bound)."""

    def __init__(self, model, off: bool):
        self.program, self.model, self.off = None, model, off
        self.report = SimpleNamespace(status="optimized", reason="", fallbacks=[], groups=[{"kind": "gemm"}],
                                      stage_peak_bytes={})

    def __call__(self, *inputs):
        out = self.model(*inputs)
        return (out.float() * 1.02).to(out.dtype) if self.off else out

    def release(self):
        pass


@pytest.mark.parametrize("off", [False, True])
def test_run_model_judges_every_input_set_by_the_accuracy_rule(monkeypatch, off):
    """run_model of a small bf16 variant on the CPU, the GPU's parts replaced (the timer, .cuda(), torch.compile,
    the program): each of the three input sets gets its own fp64 reference and verdict; a program 2% off passes
    the comparison with eager (1e-2) and fails the rule on every set."""
    from stitchcuda import graph as stitch_graph

    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, device=None: self)
    monkeypatch.setattr(suite, "_to_gpu", tuple)
    monkeypatch.setattr(suite, "_time_ms", lambda fn, warmup=3, repeats=30: (fn(), 1.0)[1])
    monkeypatch.setattr(suite, "_peak_bytes", lambda fn: (fn(), 1000))
    monkeypatch.setattr(suite, "_compiled_ms", lambda model, inputs, mode: (0.5, 2.0))
    monkeypatch.setattr(stitch_graph, "optimize", lambda model, inputs, **kw: _Program(model, off))
    row = suite.run_model(LOWP / "net_llama_gqa.py", variant="bf16", small=True)
    assert row["errors"] == {} and row["model"] == "net_llama_gqa[bf16]" and row["reference_dtype"] == "float64"
    assert [s["inputs"] for s in row["input_sets"]] == ["example", "seed=1", "seed=2"]
    assert all(s["correct"] for s in row["input_sets"])  # within eager's 16-bit tolerance either way
    verdicts = [s["accuracy"] for s in row["input_sets"]]
    assert all(v["ok"] is (not off) and v["eager_error"] > 0 for v in verdicts)
    assert row["accurate"] is (not off) and row["accuracy"]["stitch"]["ok"] is (not off)


@pytest.mark.parametrize("argv, message", [
    (["--compile-modes", "fastest"], "--compile-modes takes max-autotune-no-cudagraphs"),
    (["--compile-modes", "max-autotune-no-cudagraphs", "--compile-only"], "cannot be combined with --compile-only"),
])
def test_compile_modes_usage_errors(capsys, argv, message):
    assert main(["bench", "lowp", *argv, "--json"]) == 2
    captured = capsys.readouterr()
    assert message in _json(captured.out)["error"]


@pytest.mark.gpu
def test_timed_small_variant_records_errors_and_verdicts(tmp_path):
    """On a GPU: a small bf16 variant through every column, max-autotune-no-cudagraphs included, with each
    column's error against the fp64 reference and its accuracy verdict."""
    path = LOWP / "net_gpt2.py"
    with precision.precision_flags("fp32"):
        row = suite.run_model(path, variant="bf16", small=True, compile_modes=("max-autotune-no-cudagraphs",))
    assert row["model"] == "net_gpt2[bf16]" and row["dtype"] == "bfloat16" and row["reference_dtype"] == "float64"
    assert row["max_autotune_no_cudagraphs_first_call_s"] > 0, row["errors"]
    assert row["err_fp64"]["eager"]["max_abs"] > 0
    assert set(row["accuracy"]) >= {"compile", "reduce_overhead", "max_autotune_no_cudagraphs", "stitch"}
    assert row["accurate"] in (True, False)
