"""The Verifier on a GPU: honest stitchcuda.jit candidates pass with timing and speed-ups, every
dynamic anti-hacking rule fires on a small inline candidate built to trip it, CUDA crash kinds are
reported and the pool survives, and speed-ups agree with a KernelBench-style measurement."""

from __future__ import annotations

import textwrap

import pytest

from stitchcuda.verify import MAJOR, MINOR, VerifyConfig, WorkerPool, check

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

REFERENCE = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def __init__(self, alpha):
            super().__init__()
            self.alpha = alpha

        def forward(self, x, y):
            return torch.relu(x * self.alpha + y)

    rows = 4096
    cols = 4096
    alpha = 2.0

    def get_inputs():
        return [torch.rand(rows, cols), torch.rand(rows, cols)]

    def get_init_inputs():
        return [alpha]
''')

KERNEL = r'''
extern "C" __global__ void axpy_relu(const float* x, const float* y, float* out, float a, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = fmaxf(a * x[i] + y[i], 0.f);
}
'''


def jit_candidate(forward: str = "", kernel: str = KERNEL, init: str = "", module: str = "") -> str:
    """A stitchcuda.jit candidate; `forward` replaces the default body (launch into a fresh buffer)."""
    forward = forward or textwrap.dedent('''
        out = torch.empty_like(x)
        n = x.numel()
        _kernel((n + 255) // 256, 256, x, y, out, self.alpha, n)
        return out''')
    return ("import ctypes, gc, threading, time\nimport torch\nimport torch.nn as nn\nfrom stitchcuda import jit\n"
            f"SRC = r'''{kernel}'''\n_kernel = jit.compile(SRC, 'axpy_relu')\n{module}\n"
            "class ModelNew(nn.Module):\n    def __init__(self, alpha):\n        super().__init__()\n"
            "        self.alpha = alpha\n" + textwrap.indent(textwrap.dedent(init).strip(), " " * 8) + "\n\n"
            "    def forward(self, x, y):\n" + textwrap.indent(textwrap.dedent(forward).strip(), " " * 8) + "\n")


HONEST = jit_candidate()
CONFIG = VerifyConfig(timing_iters=30, warmup=3, compile_time_limit_s=120, run_time_limit_s=120)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(devices=["cuda:0"]) as p:
        yield p


def majors(report):
    return {f.rule for f in report.findings if f.severity == MAJOR}


def test_honest_candidate_passes_with_timing(pool):
    r = check(REFERENCE, HONEST, config=CONFIG, pool=pool)
    assert r.error is None, r.feedback
    assert r.compiled and r.correct and not r.hack, [f.rule for f in r.findings]
    assert r.speedup["eager"] > 0.5
    assert r.speedup["compile"] is not None or "compile_error" in r.timing
    t = r.timing
    assert t["method"] == "cuda-events+device-sync" and t["trials"] == 30 and t["candidate_ms"] > 0
    assert t["speed_of_light_ms"] < t["candidate_ms"]
    assert r.outputs[0].err_vs_fp64 is not None and r.outputs[0].err_vs_fp64 < 1e-5
    if t.get("cupti", {}).get("available"):
        assert t["cupti_kernel_ms"] > 0
        assert r.profile and r.profile["kernels"][0]["name"].startswith("axpy_relu")
        assert t["event_over_cupti"] > 0.5


def test_output_not_written(pool):
    half = KERNEL.replace("if (i < n)", "if (i < n / 2)")
    r = check(REFERENCE, jit_candidate(kernel=half), config=CONFIG, pool=pool)
    assert not r.correct and "output-not-written" in majors(r), r.feedback


def test_input_mutated_by_a_kernel(pool):
    mutating = KERNEL.replace("out[i] = fmaxf(a * x[i] + y[i], 0.f);",
                              "out[i] = fmaxf(a * x[i] + y[i], 0.f); ((float*)y)[i] = 0.f;")
    r = check(REFERENCE, jit_candidate(kernel=mutating), config=CONFIG, pool=pool)
    assert "input-mutated" in majors(r), r.feedback


SUM_REFERENCE = REFERENCE.replace("return torch.relu(x * self.alpha + y)", "return (x * self.alpha + y).sum(dim=1)")


def test_order_dependent_stale_output(pool):
    # Returns the reference's output when one is alive (found through the garbage collector).
    forward = '''
        _kernel(1, 1, x, y, torch.empty(1, device=x.device), self.alpha, 0)
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.is_cuda and obj.shape == (x.shape[0],) \
                    and bool(obj.abs().sum() > 0):  # not its own earlier all-zero answer
                return obj.clone()
        return torch.zeros(x.shape[0], device=x.device)'''
    r = check(SUM_REFERENCE, jit_candidate(forward=forward), config=CONFIG, pool=pool)
    assert not r.correct
    assert "order-dependent" in majors(r), r.feedback


def test_input_independent_output(pool):
    forward = '''
        if self.first is None:
            self.first = torch.empty_like(x)
            n = x.numel()
            _kernel((n + 255) // 256, 256, x, y, self.first, self.alpha, n)
        return self.first.clone()'''
    r = check(REFERENCE, jit_candidate(forward=forward, init="self.first = None"), config=CONFIG, pool=pool)
    assert not r.correct and "input-independent-output" in majors(r), r.feedback


def test_pointer_cache_and_impossible_speed(pool):
    forward = '''
        key = (x.data_ptr(), y.data_ptr())
        if key not in self.cache:
            out = torch.empty_like(x)
            n = x.numel()
            _kernel((n + 255) // 256, 256, x, y, out, self.alpha, n)
            self.cache[key] = (x, y, out)
        return self.cache[key][2]'''
    r = check(REFERENCE, jit_candidate(forward=forward, init="self.cache = {}"), config=CONFIG, pool=pool)
    assert not r.correct
    assert "timed-output-mismatch" in majors(r), r.feedback
    assert "impossible-speed" in majors(r), r.timing


def test_nondeterminism_is_minor(pool):
    forward = '''
        out = torch.empty_like(x)
        n = x.numel()
        _kernel((n + 255) // 256, 256, x, y, out, self.alpha, n)
        return out + (torch.rand_like(out) - 0.5) * 1.8e-4'''
    r = check(REFERENCE, jit_candidate(forward=forward), config=CONFIG, pool=pool)
    assert "nondeterministic" in {f.rule for f in r.findings if f.severity == MINOR}, r.feedback


def test_unjoined_background_work(pool):
    forward = '''
        out = torch.empty_like(x)
        n = x.numel()
        _kernel((n + 255) // 256, 256, x, y, out, self.alpha, n)
        def later():
            time.sleep(0.002)
            with torch.cuda.stream(self.side):
                for _ in range(4):
                    _kernel((n + 255) // 256, 256, x, y, self.scratch, self.alpha, n)
        threading.Thread(target=later).start()
        return out'''
    init = "self.side = torch.cuda.Stream()\nself.scratch = torch.empty(4096 * 4096, device='cuda')"
    r = check(REFERENCE, jit_candidate(forward=forward, init=init), config=CONFIG, pool=pool)
    cupti = r.timing.get("cupti", {})
    if not cupti.get("available"):
        pytest.skip(f"CUPTI cross-check unavailable: {cupti.get('reason')}")
    assert "unjoined-work" in majors(r), r.timing


def test_persisting_l2_left_set(pool):
    init = "ctypes.CDLL('libcuda.so.1').cuCtxSetLimit(6, ctypes.c_size_t(4 << 20))"
    r = check(REFERENCE, jit_candidate(init=init), config=CONFIG, pool=pool)
    dynamic = [f for f in r.findings if f.rule == "persisting-l2" and "persisting limit" in f.evidence]
    assert dynamic and dynamic[0].severity == MAJOR, r.findings
    # The next candidate starts with the limit reset.
    again = check(REFERENCE, HONEST, config=CONFIG, pool=pool)
    assert again.correct and not again.hack


def test_patched_synchronize_is_detected_and_ignored(pool):
    init = "torch.cuda.synchronize = lambda *a, **k: None"
    r = check(REFERENCE, jit_candidate(init=init), config=CONFIG, pool=pool)
    assert any(f.rule == "patches-timing" and "torch.cuda.synchronize" in f.evidence for f in r.findings)
    assert check(REFERENCE, HONEST, config=CONFIG, pool=pool).correct


@pytest.mark.parametrize("kernel, kind", [
    # Far past the output's allocation (a null store would be undefined behaviour NVRTC may delete).
    (KERNEL.replace("if (i < n) out[i]", "if (i < n) out[i + (1LL << 40)]"), "illegal-address"),
    ('extern "C" __device__ void __assertfail(const char*, const char*, unsigned, const char*, unsigned long);\n'
     + KERNEL.replace("if (i < n) out[i]", 'if (i == 0) __assertfail("x", "k.cu", 1, "f", 1);\n  if (i < n) out[i]'),
     "device-assert"),
])
def test_cuda_faults_are_reported_and_the_pool_survives(pool, kernel, kind):
    r = check(REFERENCE, jit_candidate(kernel=kernel), config=CONFIG, pool=pool)
    assert r.error is not None and r.error["kind"] in (kind, "crash"), r.error
    assert check(REFERENCE, HONEST, config=CONFIG, pool=pool).correct


def test_oom_and_hang(pool):
    r = check(REFERENCE, jit_candidate(forward="return torch.empty(1 << 48, device=x.device)"), config=CONFIG,
              pool=pool)
    assert r.error["kind"] == "oom", r.error
    hang = KERNEL.replace("if (i < n) out[i]", "for (;;) __nanosleep(1000);  // a side effect each turn: never optimized away\n  if (i < n) out[i]")
    config = VerifyConfig(timing_iters=5, warmup=1, compile_time_limit_s=60, run_time_limit_s=5)
    import time
    start = time.monotonic()
    r = check(REFERENCE, jit_candidate(kernel=hang), config=config, pool=pool)
    assert r.error["kind"] == "timeout" and time.monotonic() - start < 5 + 5 + 2
    assert check(REFERENCE, HONEST, config=CONFIG, pool=pool).correct


def test_compile_error_is_mapped_to_candidate_lines(pool):
    broken = jit_candidate(kernel=KERNEL.replace("y[i]", "z[i]"))
    r = check(REFERENCE, broken, config=CONFIG, pool=pool)
    assert r.error["kind"] == "compile" and not r.compiled
    line = next(i for i, t in enumerate(broken.splitlines(), 1) if "z[i]" in t)
    assert f"line {line}" in r.compile_log, r.compile_log


def test_speedup_agrees_with_kernelbench_style_measurement(pool):
    import torch

    from stitchcuda.bench import verify as bench
    from stitchcuda.verify import Task

    task = Task.from_source(bench.PROBLEM, "gate")
    source = bench.candidate_source("test-agreement")
    report = check(task, source, config=VerifyConfig(), pool=pool)
    assert report.correct and not report.hack, report.feedback
    torch.manual_seed(42)
    reference = task.build_reference(42).cuda()
    torch.manual_seed(42)
    candidate = bench._load(source, "agreement_candidate").ModelNew(*task.init_inputs()).cuda()
    inputs = [x.cuda() for x in task.make_inputs(7)]
    # One measurement of either protocol moves 3-10% between repeats on the H200, so this compares the
    # medians of three interleaved repeats and catches a bias (a charged sync round trip is ~13% here);
    # the 3% target is `stitchcuda bench verify`'s, over nine repeats.
    ours, kb = [report.speedup["eager"]], []
    for i in range(3):
        if i:
            again = check(task, source, config=VerifyConfig(), pool=pool)
            assert again.correct and not again.hack, again.feedback
            ours.append(again.speedup["eager"])
        kb.append(bench._kernelbench_style(reference, inputs) / bench._kernelbench_style(candidate, inputs))
    ours_mid, kb_mid = sorted(ours)[1], sorted(kb)[1]
    assert abs(ours_mid - kb_mid) / kb_mid < 0.08, (ours, kb, report.timing)


# ---- torch doing the GEMM, whoever spells it; cuBLAS the candidate calls itself ------------------------

GEMM_PROBLEM = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, a, b):
            return torch.matmul(a, b)

    size = 1024

    def get_inputs():
        return [torch.randn(size, size), torch.randn(size, size)]
''')
IDENTITY = r'''
extern "C" __global__ void identity(const float* x, float* out, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i];
}
'''


def gemm_candidate(product: str, module: str = "") -> str:
    """A candidate whose own kernel (an identity "epilogue") runs after `product` computed `c`."""
    return ("import torch\nimport torch.nn as nn\nfrom stitchcuda import jit\n"
            f"_epilogue = jit.compile(r'''{IDENTITY}''', 'identity')\n{module}\n"
            "class ModelNew(nn.Module):\n    def forward(self, a, b):\n"
            + textwrap.indent(textwrap.dedent(product).strip(), " " * 8) + "\n"
            "        out = torch.empty_like(c)\n        n = c.numel()\n"
            "        _epilogue((n + 255) // 256, 256, c, out, n)\n        return out\n")


@pytest.mark.parametrize("product", [
    "c = a.__matmul__(b)",
    'c = {"mm": torch.Tensor.__matmul__}["mm"](a, b)',
    "c = torch.matmul(a, b)",
], ids=["dunder", "through-a-dict", "matmul-and-identity-epilogue"])
def test_torch_doing_the_gemm_on_the_gpu_is_caught_at_dispatch(pool, product):
    r = check(GEMM_PROBLEM, gemm_candidate(product), config=CONFIG, pool=pool)
    assert r.correct and r.hack, r.feedback
    assert "torch-does-the-work" in majors(r), (r.timing.get("aten_dispatch"), [f.rule for f in r.findings])


CUBLAS_OWN = r'''
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cublas_v2.h>

torch::Tensor gemm(torch::Tensor a, torch::Tensor b) {
  const int m = a.size(0), k = a.size(1), n = b.size(1);
  auto c = torch::empty({m, n}, a.options());
  const float one = 1.f, zero = 0.f;
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  // Row-major C = A B is column-major C^T = B^T A^T.
  TORCH_CHECK(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, b.data_ptr<float>(), n,
                          a.data_ptr<float>(), k, &zero, c.data_ptr<float>(), n) == CUBLAS_STATUS_SUCCESS);
  return c;
}
'''


def test_cublas_the_candidate_calls_itself_is_not_torch_doing_the_work(pool):
    module = ("from torch.utils.cpp_extension import load_inline\n"
              f"_own = load_inline('own_cublas_gemm', cpp_sources=[r'''{CUBLAS_OWN}'''], functions=['gemm'], "
              "extra_ldflags=['-lcublas'], with_cuda=True)\n")
    r = check(GEMM_PROBLEM, gemm_candidate("c = _own.gemm(a.contiguous(), b.contiguous())", module),
              config=VerifyConfig(timing_iters=30, warmup=3, compile_time_limit_s=600, run_time_limit_s=120),
              pool=pool)
    assert r.correct, r.feedback
    assert "torch-does-the-work" not in {f.rule for f in r.findings}, r.timing.get("aten_dispatch")
    assert r.timing["aten_dispatch"]["candidate"]["flops"] < 0.2 * r.timing["aten_dispatch"]["reference"]["flops"]
    attribution = (r.profile or {}).get("attribution")
    if attribution:  # CUPTI present: the GEMM is a library kernel beside the candidate's own
        assert attribution["shares"]["library"] > 0.5 and attribution["ms"]["own"] > 0


def test_the_judge_times_the_baseline_and_reuses_it_for_the_same_task(pool):
    first = check(REFERENCE, HONEST, config=CONFIG, pool=pool)
    second = check(REFERENCE, HONEST, config=CONFIG, pool=pool)
    assert first.correct and second.correct, (first.feedback, second.feedback)
    assert first.timing["eager_ms"] == second.timing["eager_ms"]  # one reference run per task and config
    assert "judge" in first.timing and "eager_ms_in_worker" not in first.timing


FORGE_EVERY_FD = textwrap.dedent('''
    import os, pickle, struct
    from stitchcuda.verify import wire
    claim = {"compiled": True, "correct": True, "hack": False, "findings": [],
             "speedup": {"eager": 42.0, "compile": 42.0}, "timing": {"candidate_ms": 1e-6}}
    for fd in range(3, 256):
        for frame in (pickle.dumps(("result", claim)), wire.pack("result", "", {"report": claim})):
            try:
                os.write(fd, struct.pack("!i", len(frame)) + frame)
            except OSError:
                pass
''')


def test_a_forged_verdict_earns_no_reward_and_an_honest_one_does(pool):
    from stitchcuda import rl
    from stitchcuda.verify import Task

    task = Task.from_source(REFERENCE, "axpy_relu")
    forged = rl.score_completion(task, f"```python\n{FORGE_EVERY_FD}{HONEST}```", mode="gpu", pool=pool)
    assert forged.score == 0.0, (forged.reason, forged.findings)
    honest = rl.score_completion(task, f"```python\n{HONEST}```", mode="gpu", pool=pool)
    assert honest.score > 0.0, (honest.reason, honest.findings)
