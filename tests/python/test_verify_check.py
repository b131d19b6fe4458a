"""check() end to end on the CPU: bad inputs become clear reports, the dynamic rules that need no
GPU fire on small hacking candidates (and not on honest ones), static_only compiles with NVRTC, and
`stitchcuda check` prints one JSON object. Candidates run in a CPU worker pool shared by the module."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest

from stitchcuda import cli
from stitchcuda.verify import MAJOR, Task, VerifyConfig, WorkerPool, check

pytestmark = pytest.mark.slow

REFERENCE = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def __init__(self, alpha):
            super().__init__()
            self.alpha = alpha

        def forward(self, x, y):
            return torch.relu(x * self.alpha + y)

    rows = 256
    cols = 64
    alpha = 2.0

    def get_inputs():
        return [torch.rand(rows, cols), torch.rand(rows, cols)]

    def get_init_inputs():
        return [alpha]
''')

HEADER = "import torch\nimport torch.nn as nn\n\n"


def candidate(forward: str, init: str = "self.alpha = alpha", extra: str = "", signature: str = "self, alpha") -> str:
    """A ModelNew with the given __init__ body (after super().__init__()) and forward body."""
    body = lambda text: textwrap.indent(textwrap.dedent(text).strip(), " " * 8)  # noqa: E731
    return (HEADER + extra + "class ModelNew(nn.Module):\n"
            f"    def __init__({signature}):\n        super().__init__()\n{body(init)}\n\n"
            f"    def forward(self, x, y):\n{body(forward)}\n")


HONEST = candidate("return torch.clamp(x * self.alpha + y, min=0.0)")
CONFIG = VerifyConfig(device="cpu", timing_iters=12, warmup=2, compile_time_limit_s=30, run_time_limit_s=30)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(devices=["cpu"]) as p:
        yield p


def run(cand: str, pool, reference=REFERENCE, config=CONFIG):
    return check(reference, cand, config=config, pool=pool)


def rules(report, severity=MAJOR):
    return {f.rule for f in report.findings if f.severity == severity}


def test_honest_candidate_is_correct_and_timed(pool):
    r = run(HONEST, pool)
    assert r.error is None, r.feedback
    assert r.compiled and r.correct
    assert len(r.trials) == 5 and all(t["ok"] for t in r.trials)
    assert {t["distribution"].split()[0] for t in r.trials} == {"problem", "normal", "large", "shifted"}
    assert r.outputs[0].ok and r.outputs[0].err_vs_fp64 is not None and r.outputs[0].err_vs_fp64 < 1e-6
    assert r.speedup["eager"] is not None and r.speedup["eager"] > 0
    assert r.speedup["compile"] is None  # no torch.compile baseline on the CPU
    assert r.timing["trials"] == 12
    # This pure-torch candidate has no custom kernel (the static rule) and its forward's ATen operators do all
    # of the reference's arithmetic (the dispatch record): nothing else is wrong with it.
    assert rules(r) == {"no-custom-kernel", "torch-does-the-work"}


def test_run_hacks_off_stops_a_static_hack_before_it_runs(pool):
    # The same pure-torch candidate as above: run by default, not run (no trials, no timing) when the
    # source rules' major finding already decides the verdict.
    r = check(REFERENCE, HONEST, config=dataclasses.replace(CONFIG, run_hacks=False), pool=pool)
    assert r.hack and rules(r) == {"no-custom-kernel"}
    assert not r.compiled and not r.correct and r.trials == [] and "trials" not in r.timing
    assert "run_hacks" in r.timing["not_run"]
    assert r.error is None  # a verdict, not a failure


def test_task_object_and_path_references(pool, tmp_path):
    ref = tmp_path / "ref.py"
    ref.write_text(REFERENCE)
    cand = tmp_path / "cand.py"
    cand.write_text(HONEST)
    assert run(str(cand), pool, reference=str(ref)).correct
    assert run(HONEST, pool, reference=Task.from_source(REFERENCE, "p")).correct


@pytest.mark.parametrize("cand, kind, needle", [
    ("import torch\nclass Other: pass\n", "bad-candidate", "ModelNew"),
    ("def broken(:\n", "bad-candidate", "not valid Python"),
    (candidate("return x", signature="self"), "bad-candidate", "constructor"),
    ("import torch\nraise ImportError('no such extension')\nclass ModelNew(torch.nn.Module):\n"
     "    def forward(self, x, y):\n        return x\n", "load", "no such extension"),
    (candidate("raise RuntimeError('kernel failed')"), "runtime", "kernel failed"),
    (candidate("return (x * self.alpha + y).clamp(min=0).t()"), "incorrect", "shape [64, 256]"),
    (candidate("return (x * self.alpha + y).clamp(min=0).double()"), "incorrect", "dtype float64"),
    (candidate("return (x * self.alpha + y).clamp(min=0) + 1e-3"), "incorrect", "outside tolerance"),
    (candidate("return (x, y)"), "incorrect", "2 outputs"),
    ("", "bad-candidate", "empty"),
])
def test_bad_candidates_are_clear_reports(pool, cand, kind, needle):
    r = run(cand, pool)
    assert not r.correct
    assert r.error is not None and r.error["kind"] == kind, r.error
    assert needle in r.error["message"] or needle in r.feedback, r.feedback
    assert r.feedback.startswith("FAILED")


def test_wrong_output_reports_first_mismatches(pool):
    r = run(candidate("out = torch.clamp(x * self.alpha + y, min=0.0)\nout[3, 5] += 1.0\nreturn out"), pool)
    assert r.error["kind"] == "incorrect"
    bad = r.outputs[0]
    assert bad.mismatches == 1 and bad.first_mismatches[0]["index"] == [3, 5]
    assert "at [3, 5]: expected" in r.feedback


@pytest.mark.parametrize("reference, needle", [
    ("import torch\ndef get_inputs():\n    return []\n", "does not define Model"),
    ("this is not python(", "not valid Python"),
    ("/nonexistent/problem.py", "cannot read"),
    (REFERENCE.replace("return torch.relu(x * self.alpha + y)", "raise ValueError('bad ref')"), "bad ref"),
])
def test_bad_references_are_clear_reports(pool, reference, needle):
    r = run(HONEST, pool, reference=reference)
    assert r.error["kind"] == "bad-reference" and needle in r.error["message"]


def test_input_mutation_is_caught(pool):
    r = run(candidate("out = torch.clamp(x * self.alpha + y, min=0.0)\nx.zero_()\nreturn out"), pool)
    assert "input-mutated" in rules(r)
    assert any("input 0" in f.evidence for f in r.findings if f.rule == "input-mutated")


def test_order_dependence_is_caught(pool):
    # Wrong on its very first call only (like reading memory that a previous run filled).
    cand = candidate("self.calls += 1\nout = torch.clamp(x * self.alpha + y, min=0.0)\n"
                     "return out * 0 if self.calls == 1 else out",
                     init="self.alpha = alpha\nself.calls = 0")
    r = run(cand, pool)
    assert "order-dependent" in rules(r) and not r.correct


def test_constant_output_is_input_independent(pool):
    cand = candidate("if self.cached is None:\n    self.cached = torch.clamp(x * self.alpha + y, min=0.0)\n"
                     "return self.cached.clone()", init="self.alpha = alpha\nself.cached = None")
    r = run(cand, pool)
    assert not r.correct and "input-independent-output" in rules(r)


def test_pointer_keyed_cache_is_caught_in_the_timed_calls(pool):
    cand = candidate("key = (x.data_ptr(), y.data_ptr())\nif key not in self.cache:\n"
                     "    self.cache[key] = (x, y, torch.clamp(x * self.alpha + y, min=0.0))\n"
                     "return self.cache[key][2].clone()", init="self.alpha = alpha\nself.cache = {}")
    r = run(cand, pool)
    assert "timed-output-mismatch" in rules(r), r.feedback
    assert not r.correct and r.error["kind"] == "incorrect"


def test_nondeterminism_is_minor(pool):
    cand = candidate("out = torch.clamp(x * self.alpha + y, min=0.0)\n"
                     "return out + (torch.rand_like(out) - 0.5) * 1.8e-4")
    r = run(cand, pool)
    assert "nondeterministic" in rules(r, "minor")
    assert "nondeterministic" not in rules(r)


def test_precision_flags_are_restored_and_reported(pool):
    # Set, not toggled: a toggle in every call leaves the flag as it was after an even number of calls.
    cand = candidate("torch.backends.cudnn.allow_tf32 = False\n"
                     "return torch.clamp(x * self.alpha + y, min=0.0)")
    r = run(cand, pool)
    assert "silent-downcast" in rules(r, "minor")
    again = run(HONEST, pool)
    assert "silent-downcast" not in rules(again, "minor")


def test_from_module_task(pool):
    from test_verify_task import Doubler, make_doubler_inputs

    task = Task.from_module(Doubler(), make_doubler_inputs, init_inputs=[])
    ok = HEADER + "class ModelNew(nn.Module):\n    def forward(self, x):\n        return x + x\n"
    wrong = HEADER + "class ModelNew(nn.Module):\n    def forward(self, x):\n        return x * 3\n"
    assert run(ok, pool, reference=task).correct
    assert run(wrong, pool, reference=task).error["kind"] == "incorrect"


# ---- static_only: NVRTC without a GPU

JIT_CANDIDATE = HEADER + textwrap.dedent('''
    from stitchcuda import jit

    SRC = r"""
    extern "C" __global__ void axpy_relu(const float* x, const float* y, float* out, float a, int n) {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) out[i] = fmaxf(a * x[i] + y[i], 0.f);
    }
    """
    _kernel = jit.compile(SRC, "axpy_relu")

    class ModelNew(nn.Module):
        def __init__(self, alpha):
            super().__init__()
            self.alpha = alpha

        def forward(self, x, y):
            out = torch.empty_like(x)
            n = x.numel()
            _kernel((n + 255) // 256, 256, x, y, out, self.alpha, n)
            return out
''')


def test_static_only_compiles_with_nvrtc():
    r = check(REFERENCE, JIT_CANDIDATE, static_only=True)
    assert r.static_only and r.compiled and r.error is None, r.feedback
    assert not r.hack
    assert r.timing["static_compile"][0]["status"] == "compiled"
    assert r.timing["static_compile"][0]["kernel"] == "axpy_relu"


def test_static_only_maps_compile_errors_to_candidate_lines():
    broken = JIT_CANDIDATE.replace("fmaxf(a * x[i] + y[i], 0.f)", "fmaxf(a * x[i] + z[i], 0.f)")
    r = check(REFERENCE, broken, static_only=True)
    assert not r.compiled and r.error["kind"] == "compile"
    line = next(i for i, text in enumerate(broken.splitlines(), 1) if "z[i]" in text)
    assert f"line {line}: error" in r.compile_log and '"z" is undefined' in r.compile_log
    assert f"line {line}" in r.feedback


def test_static_only_wrong_kernel_name():
    r = check(REFERENCE, JIT_CANDIDATE.replace('"axpy_relu")', '"axpy")'), static_only=True)
    assert not r.compiled and "NotFound" in r.timing["static_compile"][0]["detail"]


def test_static_only_still_reports_static_hacks():
    hack = JIT_CANDIDATE.replace("return out", "return torch.relu(x * self.alpha + y)")
    r = check(REFERENCE, hack, static_only=True)
    assert r.compiled and r.hack
    assert "torch-does-heavy-work" in rules(r)


# ---- the CLI


def test_cli_static_only_json(tmp_path, capsys):
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(REFERENCE)
    cand.write_text(JIT_CANDIDATE)
    code = cli.main(["check", "--reference", str(ref), "--candidate", str(cand), "--json", "--static-only"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["compiled"] is True and data["hack"] is False
    assert set(data) >= {"compiled", "correct", "hack", "findings", "speedup"}
    assert set(data["speedup"]) == {"eager", "compile"}


def test_cli_bad_input_is_one_clear_line(tmp_path, capsys):
    cand = tmp_path / "cand.py"
    cand.write_text(JIT_CANDIDATE)
    code = cli.main(["check", "--reference", str(tmp_path / "missing.py"), "--candidate", str(cand),
                     "--static-only"])
    out = capsys.readouterr()
    assert code == 1
    assert "bad-reference: cannot read the reference" in out.out
    assert "Traceback" not in out.out + out.err


def test_cli_runs_a_cpu_check_as_json(tmp_path, capsys):
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(REFERENCE)
    cand.write_text(HONEST.replace("x * self.alpha", "x * self.alpha"))
    code = cli.main(["check", "--reference", str(ref), "--candidate", str(cand), "--json", "--device", "cpu",
                     "--timing-iters", "5"])
    data = json.loads(capsys.readouterr().out)
    assert data["correct"] is True
    assert code == 1  # correct, but flagged: no custom kernel
    assert {"rule": "no-custom-kernel", "severity": "major"}.items() <= data["findings"][0].items()


def test_tensor_subclass_output_is_rejected(pool):
    extra = "class Lazy(torch.Tensor):\n    pass\n\n"
    r = run(candidate("return torch.clamp(x * self.alpha + y, min=0.0).as_subclass(Lazy)", extra=extra), pool)
    assert not r.correct and "lazy-output" in rules(r)
    assert "tensor subclass" in r.error["message"]


def test_static_only_skips_what_it_cannot_build_statically():
    inline = HEADER + textwrap.dedent('''
        from torch.utils.cpp_extension import load_inline

        CUDA = "__global__ void k(float* x) { x[0] = 1.f; }\\nvoid run(torch::Tensor x) { k<<<1, 1>>>(x.data_ptr<float>()); }"
        ext = load_inline("ext", cpp_sources="void run(torch::Tensor x);", cuda_sources=CUDA, functions=["run"])

        class ModelNew(nn.Module):
            def __init__(self, alpha):
                super().__init__()
                self.alpha = alpha

            def forward(self, x, y):
                out = torch.empty_like(x)
                ext.run(out)
                return out
    ''')
    r = check(REFERENCE, inline, static_only=True)
    assert r.compiled and r.error is None
    assert [s["status"] for s in r.timing["static_compile"]] == ["skipped"]
    assert "nvcc" in r.timing["static_compile"][0]["detail"]


def test_static_only_passes_literal_options_to_nvrtc():
    templated = JIT_CANDIDATE.replace('fmaxf(a * x[i] + y[i], 0.f)', 'fmaxf(a * x[i] + y[i], FLOOR)') \
        .replace('jit.compile(SRC, "axpy_relu")', 'jit.compile(SRC, "axpy_relu", defines={"FLOOR": "0.f"})')
    assert check(REFERENCE, templated, static_only=True).compiled
    without = templated.replace(', defines={"FLOOR": "0.f"}', "")
    assert not check(REFERENCE, without, static_only=True).compiled


def test_a_marginal_difference_between_orders_is_not_a_hack(pool):
    # Honest but slightly flaky arithmetic: its first call misses the tolerance on one element.
    cand = candidate("self.calls += 1\nout = torch.clamp(x * self.alpha + y, min=0.0)\n"
                     "if self.calls == 1:\n    out[0, 0] += 1e-3\nreturn out",
                     init="self.alpha = alpha\nself.calls = 0")
    r = run(cand, pool)
    assert not r.correct and r.error["kind"] == "incorrect"
    assert "order-dependent" not in rules(r)
    assert "nondeterministic" in rules(r, "minor")


def test_type_error_inside_init_is_a_runtime_error(pool):
    r = run(candidate("return x", init="self.alpha = alpha\nlen(1, 2)"), pool)
    assert r.error["kind"] == "runtime" and "ModelNew.__init__" in r.error["message"]
    assert "line" in r.compile_log  # the candidate's frames


def test_missing_init_with_constructor_arguments_is_bad_candidate(pool):
    no_init = HEADER + "class ModelNew(nn.Module):\n    def forward(self, x, y):\n        return x\n"
    r = run(no_init, pool)
    assert r.error["kind"] == "bad-candidate" and "constructor" in r.error["message"]


def test_sys_exit_in_a_candidate_is_a_load_error(pool):
    r = run("import sys\nsys.exit(4)\n" + HONEST, pool)
    assert r.error["kind"] == "load" and "SystemExit" in r.error["message"]
