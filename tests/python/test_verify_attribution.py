"""Attribution (stitchcuda.verify.attribution), on the CPU: kernel names as CUPTI reports them on Hopper
classified as the candidate's own, a library's, ATen's or other; the findings a share of foreign work
raises; the harness wiring through a fake GPU backend; and the ATen operators a candidate's forward calls,
recorded at dispatch, for every spelling of torch doing a GEMM."""

from __future__ import annotations

import textwrap

import pytest

from stitchcuda import jit
from stitchcuda.verify import attribution, harness
from stitchcuda.verify.attribution import attribute, classify, findings, own_kernel_names
from stitchcuda.verify.config import VerifyConfig
from stitchcuda.verify.report import VerifyReport
from stitchcuda.verify.task import Task

from test_verify_harness import HONEST, fake_gpu, run  # noqa: F401  (the fake GPU backend, the job runner)

CUBLAS = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
NVJET = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"
CUDNN = "void cudnn::ops::nchwToNhwcKernel<float, float, float, false, true, (cudnnKernelDataType_t)2>(cudnn::ops::nchw2nhwc_params_t<float>, float const*, float*)"
ATEN_ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<float>, "
            "std::array<char*, 2ul> >(int, at::native::CUDAFunctorOnSelf_add<float>, std::array<char*, 2ul>)")
ATEN_SOFTMAX = "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)"
INDUCTOR = "triton_poi_fused_add_relu_0"


def test_kernel_names_are_classified_as_cupti_gives_them():
    own = own_kernel_names(['extern "C" __global__ void __launch_bounds__(256) bias_gelu(const float* x) {}\n'
                            "template <int TILE> __global__ void tiled_mm(const float* a) {}"],
                           compiled={"scale_add", "_Z3fooPf"})
    assert {"bias_gelu", "tiled_mm", "scale_add", "_Z3fooPf"} <= own
    assert classify("bias_gelu", own) == "own"
    assert classify("void tiled_mm<32>(float const*)", own) == "own"  # demangled template instance
    assert classify("_Z3fooPf", own) == "own"
    for name in (CUBLAS, NVJET, CUDNN, "cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>"):
        assert classify(name, own) == "library", name
    for name in (ATEN_ADD, ATEN_SOFTMAX, INDUCTOR):
        assert classify(name, own) == "aten", name
    assert classify("mystery_kernel", own) == "other"


def test_a_candidate_kernel_named_like_atens_does_not_make_atens_its_own():
    own = own_kernel_names(['__global__ void vectorized_elementwise_kernel(float* y) {}'])
    assert classify("vectorized_elementwise_kernel", own) == "own"
    assert classify(ATEN_ADD, own) == "aten"  # the qualified name is ATen's, not the candidate's


def shares(**ms):
    kernels = [{"name": name, "ms": t} for name, t in ms.items()]
    return attribute(kernels, {"epilogue", "fused"})


def test_library_gemm_with_an_own_epilogue_is_fine():
    attr = attribute([{"name": CUBLAS, "ms": 0.34}, {"name": "epilogue", "ms": 0.06}], {"epilogue"})
    assert attr["shares"]["library"] == pytest.approx(0.85) and attr["shares"]["own"] == pytest.approx(0.15)
    assert findings(attr) == []
    assert attribution.summary_line(attr) == ("GPU time per call: own kernels 15%, library 85%, ATen 0%, "
                                              "other 0% (0.4000 ms)")
    assert attr["kernels"][0]["name"] == CUBLAS and attr["kernels"][0]["class"] == "library"


def test_no_own_kernel_among_the_work_is_major():
    # A custom kernel launched only under a branch that never runs: the trace holds ATen's alone.
    attr = attribute([{"name": ATEN_SOFTMAX, "ms": 0.2}], {"never_launched"})
    [(rule, severity, message, evidence)] = findings(attr)
    assert (rule, severity) == ("no-own-kernel-ran", "major")
    assert "ATen 100%" in evidence and "cunn_SoftMaxForward" in evidence
    # A library alone (torch.matmul returned) is no better.
    assert findings(attribute([{"name": NVJET, "ms": 0.3}], set()))[0][0] == "no-own-kernel-ran"


def test_foreign_kernels_doing_most_of_the_work_are_major_some_minor():
    major = attribute([{"name": ATEN_SOFTMAX, "ms": 0.7}, {"name": "fused", "ms": 0.3}], {"fused"})
    assert [f[:2] for f in findings(major)] == [("foreign-kernels", "major")]
    minor = attribute([{"name": INDUCTOR, "ms": 0.3}, {"name": "fused", "ms": 0.7}], {"fused"})
    assert [f[:2] for f in findings(minor)] == [("foreign-kernels", "minor")]
    small = attribute([{"name": ATEN_ADD, "ms": 0.05}, {"name": "fused", "ms": 0.95}], {"fused"})
    assert findings(small) == []  # a contiguous() copy beside the real kernel
    assert findings(attribute([], {"fused"})) == []  # nothing ran on the GPU: other rules judge that


def test_the_jit_layer_records_what_it_compiles():
    source = 'extern "C" __global__ void attribution_probe(float* y) { y[0] = 1.0f; }'
    jit.compile(source, "attribution_probe")
    assert "attribution_probe" in jit.compiled_kernel_names()


OWN_SOURCE = 'CUDA = "__global__ void clamp_axpy(const float* x, const float* y, float* out, long long n) {}"\n'


def cupti(by_name):
    return {"available": True, "kernel_ms_per_call": 0.4, "kernels_per_call": 1.0, "streams": [7],
            "outside_window": [], "outside_count": 0, "kernels": [], "summary": None, "advice": [],
            "by_name": by_name}


def test_the_harness_reports_the_attribution_and_flags_foreign_work(fake_gpu):

    fake_gpu(per_call_ms=0.5, cupti=cupti([{"name": ATEN_ADD, "ms": 0.4}]))
    r, _ = run(HONEST)
    assert "no-own-kernel-ran" in {f.rule for f in r.findings if f.severity == "major"} and r.hack
    assert r.profile["attribution"]["shares"]["aten"] == 1.0
    fake_gpu(per_call_ms=0.5, cupti=cupti([{"name": "clamp_axpy", "ms": 0.3}, {"name": CUBLAS, "ms": 0.1}]))
    r, _ = run(OWN_SOURCE + HONEST)
    assert not r.hack and r.profile["attribution"]["shares"]["own"] == pytest.approx(0.75)
    assert "GPU time per call: own kernels 75%, library 25%" in r.feedback


def test_a_trusted_job_is_not_attributed(fake_gpu, monkeypatch):

    fake_gpu(per_call_ms=0.5, cupti=cupti([{"name": ATEN_ADD, "ms": 0.4}]))
    original = harness.run_job

    def trusted(job, progress):
        return original({**job, "trusted": True}, progress)

    monkeypatch.setattr(harness, "run_job", trusted)
    r, _ = run(HONEST)
    assert not r.hack and "attribution" not in (r.profile or {})


def test_atens_copies_and_fills_are_reported_but_not_held_against_the_candidate():
    copy = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
            "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>(int)")
    assert classify(copy, set()) == "layout"
    attr = attribute([{"name": copy, "ms": 0.6}, {"name": "fused", "ms": 0.4}], {"fused"})
    assert findings(attr) == [] and "copies 60%" in attribution.summary_line(attr)


def test_the_host_doing_the_work_is_caught_from_copies_and_cpu_time():
    n = 4096 * 4096 * 4  # one fp32 input and one output of 4096 x 4096
    # The whole input copied to the host and 80 ms of CPU per call against 3 ms of GPU: numpy did it.
    [(rule, severity, _, evidence)] = attribution.host_findings(n, 80.0, 3.0, 2 * n)
    assert (rule, severity) == ("host-compute", "major") and f"{n} bytes copied device-to-host" in evidence
    # The copy without host work (a result staged through the host) or host work without a copy
    # (a Python loop of launches) are worth a look, no more.
    assert [f[:2] for f in attribution.host_findings(n, 0.2, 3.0, 2 * n)] == [("host-compute", "minor")]
    assert [f[:2] for f in attribution.host_findings(0, 40.0, 3.0, 2 * n)] == [("host-compute", "minor")]
    # Honest calls: a scalar .item(), launch overhead far above a tiny kernel's time, a sync that spins.
    assert attribution.host_findings(4, 0.05, 0.01, 2 * n) == []
    assert attribution.host_findings(0, 0.9, 0.01, 2 * n) == []
    assert attribution.host_findings(8, 3.1, 3.0, 2 * n) == []


def test_the_harness_flags_a_host_round_trip(fake_gpu):
    fake_gpu(per_call_ms=0.5, cupti={**cupti([{"name": "clamp_axpy", "ms": 0.01}]), "gpu_ms_per_call": 0.4,
                                     "dtoh_bytes_per_call": 1 << 24, "host_cpu_ms_per_call": 30.0})
    r, _ = run(OWN_SOURCE + HONEST)
    assert r.hack and "host-compute" in {f.rule for f in r.findings if f.severity == "major"}
    assert any("device-to-host" in f.evidence for f in r.findings if f.rule == "host-compute")


# ---- at dispatch: torch doing the work, however it is spelled -------------------------------------------

GEMM_PROBLEM = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, a, b):
            return torch.matmul(a, b)

    def get_inputs():
        return [torch.rand(64, 48), torch.rand(48, 32)]
''')


def gemm_candidate(body: str, module: str = "") -> str:
    return ("import torch\nimport torch.nn as nn\n" + module + "\n\nclass ModelNew(nn.Module):\n"
            "    def forward(self, a, b):\n" + textwrap.indent(textwrap.dedent(body), " " * 8))


# Every spelling computes the product in ATen; none of them is caught by name.
TORCH_SPELLINGS = {
    "dunder method": "return a.__matmul__(b)",
    "method through a dict": 'ops = {"mm": torch.Tensor.__matmul__}\nreturn ops["mm"](a, b)',
    "matmul and an identity epilogue": "out = torch.matmul(a, b)\nreturn out.clone() * 1.0",
    "built name": 'return getattr(torch, "mat" + "mul")(a, b)',
    "operator": "return a @ b",
    "aten op": "return torch.ops.aten.mm.default(a, b)",
    "einsum": 'return torch.einsum("ik,kj->ij", a, b)',
    "linear": "return torch.nn.functional.linear(a, b.t())",
    "addmm": "return torch.addmm(torch.zeros(a.shape[0], b.shape[1]), a, b)",
    "batched": "return torch.bmm(a[None], b[None])[0]",
    "broadcast multiply and sum": "return (a[:, :, None] * b[None]).sum(1)",
    "functional through vars": 'return vars(torch)["mm"](a, b)',
}


def run_gemm(candidate: str) -> VerifyReport:
    job = {"reference": Task.from_source(GEMM_PROBLEM, "gemm").to_spec(), "candidate": candidate,
           "candidate_name": "<candidate>", "config": VerifyConfig(device="cpu", timing_iters=0).to_dict()}
    data = harness.run_job(job, lambda phase: None)
    data.pop("recycle")
    return VerifyReport.from_dict(data)


@pytest.mark.parametrize("spelling", sorted(TORCH_SPELLINGS))
def test_torch_doing_the_gemm_is_caught_at_dispatch_however_it_is_spelled(spelling):
    report = run_gemm(gemm_candidate(TORCH_SPELLINGS[spelling]))
    assert report.correct, report.feedback
    found = [f for f in report.findings if f.rule == "torch-does-the-work"]
    assert found and found[0].severity == "major", (spelling, report.timing.get("aten_dispatch"))
    assert report.hack


def test_a_candidate_that_computes_outside_aten_is_not_attributed_to_torch():
    # The product computed without any ATen operator doing arithmetic (its own loop over rows, writing
    # into an output it allocated): nothing at dispatch counts against it.
    own = textwrap.dedent('''
        out = torch.empty(a.shape[0], b.shape[1])
        rows, cols = a.tolist(), b.t().tolist()
        values = [[sum(x * y for x, y in zip(r, c)) for c in cols] for r in rows]
        out.copy_(torch.tensor(values))
        return out
    ''')
    report = run_gemm(gemm_candidate(own))
    assert report.correct, report.feedback
    assert not [f for f in report.findings if f.rule == "torch-does-the-work"], report.timing["aten_dispatch"]
    dispatch = report.timing["aten_dispatch"]
    assert dispatch["candidate"]["flops"] == 0 and dispatch["reference"]["flops"] == 2 * 64 * 48 * 32


def test_a_small_torch_epilogue_is_minor_or_nothing():
    record = {"flops": 2 * 64 * 48 * 32}
    assert attribution.dispatch_findings({"flops": 0, "ops": []}, record) == []
    minor = attribution.dispatch_findings({"flops": 0.3 * record["flops"], "ops": [{"name": "add", "calls": 1}]},
                                          record)
    assert [f[:2] for f in minor] == [("torch-does-the-work", "minor")]
    assert attribution.dispatch_findings({"flops": 0.1 * record["flops"], "ops": []}, record) == []
    assert attribution.dispatch_findings({"flops": 5, "ops": []}, {"flops": 0}) == []


def test_the_record_counts_flops_by_formula_and_ignores_views_copies_and_allocation():
    import torch

    a, b = torch.rand(16, 8), torch.rand(8, 4)
    with attribution.DispatchRecord() as record:
        c = torch.empty(16, 4)
        c.copy_(a @ b)
        c.t().contiguous().view(-1)
    summary = attribution.dispatch_summary(record.ops)
    assert summary["flops"] == 2 * 16 * 8 * 4 and [o["name"] for o in summary["ops"]] == ["mm"]
    assert not record.ops["empty"]["work"] and not record.ops["copy_"]["work"]


def test_a_library_product_with_the_candidates_own_epilogue_is_minor_not_major():
    # A linear layer's reference: the product by formula plus an epilogue (bias, ReLU) without one.
    product, epilogue = 2 * 512 * 512 * 512, 2 * 512 * 512
    reference = {"flops": product + epilogue, "formula_flops": product}
    own_epilogue = {"flops": product, "formula_flops": product, "ops": [{"name": "mm", "calls": 1}]}
    found = attribution.dispatch_findings(own_epilogue, reference)
    assert [f[:2] for f in found] == [("torch-does-the-work", "minor")] and "epilogue" in found[0][2]
    # Torch computing the epilogue too (or most of it) is torch computing the result.
    everything = {"flops": product + epilogue, "formula_flops": product,
                  "ops": [{"name": "mm", "calls": 1}, {"name": "relu", "calls": 1}]}
    assert [f[:2] for f in attribution.dispatch_findings(everything, reference)] == [("torch-does-the-work", "major")]
    # A problem that is the product alone has no epilogue to leave to the candidate.
    alone = {"flops": product, "formula_flops": product}
    assert [f[:2] for f in attribution.dispatch_findings(own_epilogue, alone)] == [("torch-does-the-work", "major")]
