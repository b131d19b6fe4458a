"""stitchcuda.profile: the trace scope, summaries and Chrome JSON from synthetic records, roofline
diagnosis, metric names against a chip, ATen-op attribution on CPU tensors, the report, and the
`stitchcuda profile` command's bad-input paths; on a GPU (mark `gpu`) the real thing, checked
against torch.profiler and CUDA events.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

import stitchcuda
import torch

import stitchcuda.profile as prof
from stitchcuda import _C
from stitchcuda.errors import InvalidArgumentError, UnavailableError
from stitchcuda.profile import report as rep

HAS_GPU = _C.device_count() > 0
TORCH_ACTIVITIES = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
CUPTI_OK = _C.profile.available()[0]


def kernel(name, start, end, stream=7, correlation=0, mangled=None):
    k = prof.KernelRecord()
    k.name, k.mangled_name = name, mangled or name
    k.start_ns, k.end_ns, k.stream_id, k.correlation_id = start, end, stream, correlation
    k.grid, k.block = (4, 1, 1), (256, 1, 1)
    return k


def api(name, start, end, correlation, domain="runtime"):
    a = prof.ApiRecord()
    a.name, a.domain, a.start_ns, a.end_ns, a.correlation_id = name, domain, start, end, correlation
    return a


def synthetic_trace():
    t = prof.Trace()
    t.kernels = [kernel("gemm", 1000, 5000, correlation=1), kernel("relu", 6000, 7000, correlation=2),
                 kernel("gemm", 8000, 12000, correlation=3), kernel("relu", 12000, 13000, stream=9, correlation=4)]
    t.api_calls = [api("cudaLaunchKernel", 100, 900, 1), api("cuLaunchKernel", 200, 800, 1, "driver"),
                   api("cudaLaunchKernel", 950, 1100, 2), api("cudaLaunchKernel", 1200, 1400, 3),
                   api("cudaLaunchKernel", 1500, 1700, 4)]
    return t


# ---- availability and the trace scope ----

def test_available_says_why_not():
    ok, reason = prof.available()
    assert isinstance(ok, bool)
    if not HAS_GPU:
        assert not ok and reason.startswith("profiler unavailable:") and "no CUDA device" in reason
    elif ok:
        assert reason == ""


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU error; a GPU is present")
def test_trace_without_gpu_raises_unavailable_and_profile_too():
    scope = prof.trace()
    with pytest.raises(UnavailableError, match="profiler unavailable: no CUDA device"):
        with scope:
            pass
    assert scope.trace is None
    with pytest.raises(InvalidArgumentError, match="already used"):
        with scope:
            pass
    with pytest.raises(InvalidArgumentError, match="after the"):
        scope.summary()
    with pytest.raises(UnavailableError, match="profiler unavailable"):
        prof.profile(lambda: None)
    with pytest.raises(UnavailableError, match="profiler unavailable"):
        prof.metrics(lambda: None)


# ---- records, summaries, JSON (synthetic) ----

def test_summary_of_synthetic_records():
    t = synthetic_trace()
    assert [k.duration_ns for k in t.kernels] == [4000, 1000, 4000, 1000]
    assert t.kernels[0].grid == (4, 1, 1) and t.kernels[0].block == (256, 1, 1)
    s = t.summary()
    assert s.span_ns == 12000
    assert s.busy_ns == 4000 + 1000 + 5000  # 8000..13000 merges across streams
    assert s.gaps.count == 2 and s.gaps.total_ns == 2000 and s.gaps.largest_ns == 1000
    assert s.busy_ns + s.gaps.total_ns == s.span_ns
    assert s.kernel_launches == 4
    assert [(g.name, g.count, g.total_ns) for g in s.kernels] == [("gemm", 2, 8000), ("relu", 2, 2000)]
    assert sum(g.share for g in s.kernels) == pytest.approx(1.0)
    assert s.launches_with_api == 4
    assert s.api_ns_per_launch == pytest.approx((800 + 150 + 200 + 200) / 4)  # outermost call per id
    assert s.busy_fraction == pytest.approx(10000 / 12000)
    assert s.gap_fraction == pytest.approx(2000 / 12000)


def test_recorded_trace_is_plain_lists_over_the_native_trace():
    native = synthetic_trace()
    r = prof.RecordedTrace(native)
    assert isinstance(r.kernels, list) and [k.name for k in r.kernels] == ["gemm", "relu", "gemm", "relu"]
    assert r.kernels[2].start_ns == 8000 and r.kernels[2].duration_ns == 4000 and r.kernels[3].stream_id == 9
    assert len(r.api_calls) == 5 and r.memcpys == [] and r.memsets == [] and r.dropped_records == 0
    assert r.summary().busy_ns == native.summary().busy_ns
    assert json.loads(r.to_chrome_json()) == json.loads(native.to_chrome_json())
    assert "4 kernels" in repr(r)
    assert rep.build_report(r, top_k=2).kernel_launches == 4


def test_chrome_json_of_synthetic_records():
    doc = json.loads(synthetic_trace().to_chrome_json())
    events = doc["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert len(kernels) == 4 and {e["name"] for e in kernels} == {"gemm", "relu"}
    assert all(e["ph"] == "X" for e in kernels)
    assert {e["tid"] for e in kernels} == {7, 9}
    assert any(e.get("ph") == "s" for e in events) and any(e.get("ph") == "f" for e in events)


def test_empty_trace_summary_and_advice():
    s = prof.Trace().summary()
    assert s.span_ns == 0 and s.kernel_launches == 0 and s.busy_fraction == 0.0
    assert prof.advise(s) == ["nothing ran on the GPU inside the trace"]


# ---- roofline ----

def test_classify_and_advise_from_python():
    copy = prof.KernelMeasurement(name="copy", duration_ns=0.6e6, dram_bytes=2.0 * (1 << 30))
    f = prof.classify(copy)
    assert f.bound == "memory" and f.memory_fraction == pytest.approx(2.0 * (1 << 30) / 4.3e12 / 0.6e-3)
    assert any("memory-bound" in text for text in prof.advise(f))
    fma = prof.KernelMeasurement(name="fma", duration_ns=1e5, sm_throughput=0.9, memory_throughput=0.05)
    assert prof.classify(fma).bound == "compute" and prof.classify(fma).measured and not f.measured
    slow_ceiling = prof.DeviceCeilings(name="slow", dram_bytes_per_s=1e9)
    assert prof.classify(copy, slow_ceiling).roofline_fraction > 1.0
    with pytest.raises(InvalidArgumentError):
        prof.KernelMeasurement(unit="fp64")
    with pytest.raises(InvalidArgumentError):
        prof.advise("not a finding")


# ---- metric names (profiler host API: no GPU needed) ----

@pytest.mark.skipif(not CUPTI_OK, reason="CUPTI (libcupti.so.13) is not loadable here")
def test_metric_names_checked_against_gh100_without_gpu():
    names = prof.speed_of_light_metrics()
    assert "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed" in names and len(names) == 9
    assert "GH100" in prof.supported_chips()
    prof.validate_metrics(names, "GH100")
    assert prof.metric_passes(names, "GH100") >= 1
    with pytest.raises(InvalidArgumentError, match="lts__made_up.sum"):
        prof.validate_metrics(["gpu__time_duration.sum", "lts__made_up.sum"], "GH100")
    with pytest.raises(UnavailableError, match="QQ100"):
        prof.validate_metrics(names, "QQ100")


# ---- attribution to ATen ops ----

def test_op_recorder_stamps_aten_ops_on_cpu_tensors():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    clock = iter(range(0, 10_000, 10))
    with rep.OpRecorder(clock=lambda: next(clock)) as recorder:
        torch.relu(a @ b + 1)
    ops = [w.op for w in recorder.windows]
    assert ops == ["aten::mm", "aten::add", "aten::relu"]
    assert all(w.start_ns < w.end_ns for w in recorder.windows)
    assert all(x.end_ns <= y.start_ns for x, y in zip(recorder.windows, recorder.windows[1:]))


@pytest.mark.skipif(not CUPTI_OK, reason="CUPTI (libcupti.so.13) is not loadable here")
def test_op_recorder_uses_cuptis_clock_by_default():
    before = _C.profile.timestamp_ns()
    with rep.OpRecorder() as recorder:
        torch.ones(3).sum()
    after = _C.profile.timestamp_ns()
    assert recorder.windows and all(before <= w.start_ns <= w.end_ns <= after for w in recorder.windows)


def test_attribute_matches_launch_calls_to_op_windows():
    windows = [rep.OpWindow("aten::mm", 50, 1000), rep.OpWindow("aten::relu", 1000 + 1, 1150),
               rep.OpWindow("aten::addmm", 1150, 1450)]
    ops = rep.attribute(synthetic_trace(), windows)
    # kernel 1 launched at 100 (the runtime call, not the driver call inside it) -> mm; 2 at 950 -> mm;
    # 3 at 1200 -> addmm; 4 at 1500 -> outside every window
    assert ops["gemm"] == Counter({"aten::mm": 1, "aten::addmm": 1})
    assert ops["relu"] == Counter({"aten::mm": 1, "": 1})


def test_metrics_matched_by_launch_order_or_by_name():
    t = synthetic_trace()
    assert rep.launch_order(t) == ["gemm", "relu", "gemm", "relu"]
    measured = [_C.profile.make_kernel_metrics(f"range{i}", i, [("gpu__time_duration.sum", 10.0 * (i + 1))])
                for i in range(4)]
    groups, note = rep.match_metrics(t, measured)
    assert note == "" and [m.index for m in groups["gemm"]] == [0, 2] and [m.index for m in groups["relu"]] == [1, 3]
    by_name = [_C.profile.make_kernel_metrics("gemm", 0, []), _C.profile.make_kernel_metrics("mystery", 1, [])]
    groups, note = rep.match_metrics(t, by_name)
    assert list(groups) == ["gemm"] and "1 could not be matched" in note


def test_aggregate_weights_percentages_by_duration():
    a = _C.profile.make_kernel_metrics("k", 0, [("gpu__time_duration.sum", 100.0),
                                                ("sm__throughput.avg.pct_of_peak_sustained_elapsed", 90.0),
                                                ("dram__bytes_read.sum", 1000.0)])
    b = _C.profile.make_kernel_metrics("k", 1, [("gpu__time_duration.sum", 300.0),
                                                ("sm__throughput.avg.pct_of_peak_sustained_elapsed", 10.0),
                                                ("dram__bytes_read.sum", 3000.0)])
    m = rep.aggregate([a, b])
    assert m["sm_throughput_pct"] == pytest.approx(30.0)
    assert m["duration_ns"] == pytest.approx(200.0) and m["dram_bytes_read"] == pytest.approx(2000.0)
    assert m["launches_measured"] == 2
    assert rep.aggregate([]) == {}


def test_report_from_synthetic_trace():
    t = synthetic_trace()
    ops = {"gemm": Counter({"aten::mm": 2}), "relu": Counter({"aten::relu": 1, "": 1})}
    metric_values = [("gpu__time_duration.sum", 4000.0),
                     ("sm__throughput.avg.pct_of_peak_sustained_elapsed", 85.0),
                     ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", 20.0),
                     ("sm__warps_active.avg.pct_of_peak_sustained_active", 50.0)]
    by_kernel = {"gemm": [_C.profile.make_kernel_metrics("gemm", i, metric_values) for i in (0, 2)]}
    r = rep.build_report(t, title="tiny", device="Test GPU", top_k=1, ops=ops, metrics_by_kernel=by_kernel,
                         metrics_status="collected")
    assert r.kernel_launches == 4 and r.kernel_groups == 2 and len(r.kernels) == 1
    top = r.kernels[0]
    assert (top.name, top.launches, top.total_ns, top.op) == ("gemm", 2, 8000, "aten::mm")
    assert top.bound == "compute" and top.metrics["sm_throughput_pct"] == pytest.approx(85.0)
    assert r.gap_ns == 2000 and r.gap_count == 2 and r.busy_fraction == pytest.approx(10000 / 12000)
    assert any("compute-bound with its SMs at 85%" in text for text in r.diagnosis)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["kernels"][0]["ops"] == [{"op": "aten::mm", "launches": 2}] and d["kernels"][0]["op"] == "aten::mm"
    assert d["busy_fraction"] == pytest.approx(r.busy_fraction)
    text = str(r)
    assert "tiny" in text and "Test GPU" in text and "gemm" in text and "[aten::mm]" in text
    assert "1 more kernel names" in text and "compute" in text
    with pytest.raises(InvalidArgumentError):
        rep.build_report(t, top_k=0)
    empty = rep.build_report(prof.Trace())
    assert empty.kernels == [] and "nothing ran" in str(empty)


# ---- the command line ----

def _cli(args, capsys):
    from stitchcuda.cli import main
    rc = main(["profile", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_missing_file_is_one_line(capsys, tmp_path):
    rc, out, err = _cli([str(tmp_path / "nope.py")], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "no such file" in err.lower()


def test_cli_not_a_problem_and_broken_problem(capsys, tmp_path):
    plain = tmp_path / "plain.py"
    plain.write_text("x = 1\n")
    rc, _, err = _cli([str(plain)], capsys)
    assert rc == 2 and "does not define Model or get_inputs" in err and err.count("\n") == 1
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    rc, _, err = _cli([str(broken)], capsys)
    assert rc == 2 and "RuntimeError: boom" in err and "Traceback" not in err


PROBLEM = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def __init__(self, channels):
            super().__init__()
            self.conv = nn.Conv2d(3, channels, 3, padding=1)
            self.fc = nn.Linear(channels, 10)

        def forward(self, x):
            x = torch.relu(self.conv(x))
            return self.fc(x.mean(dim=(2, 3)))

    def get_inputs():
        return [torch.rand(4, 3, 32, 32)]

    def get_init_inputs():
        return [16]
""")


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU error; a GPU is present")
def test_cli_without_gpu_fails_with_the_reason(capsys, tmp_path):
    problem = tmp_path / "cnn.py"
    problem.write_text(PROBLEM)
    rc, out, err = _cli([str(problem)], capsys)
    assert rc == 3 and out == "" and err.count("\n") == 1 and "profiler unavailable" in err  # 3: no GPU


def test_cli_rejects_bad_top_k(capsys, tmp_path):
    rc, _, err = _cli([str(tmp_path / "x.py"), "--top-k", "0"], capsys)
    assert rc == 2 and "at least 1" in err


# ---- on a GPU ----

@pytest.mark.gpu
def test_default_trace_keeps_the_calls_that_place_work_and_all_api_calls_the_rest():
    x = torch.randn(1 << 16, device="cuda")
    torch.cuda.synchronize()
    with prof.trace() as selected:
        torch.relu(x).sum().item()
    with prof.trace(all_api_calls=True) as every:
        torch.relu(x).sum().item()
    work = ("Launch", "Memcpy", "Memset", "Synchronize")
    names = [a.name for a in selected.trace.api_calls]
    assert sum("Launch" in n for n in names) >= 2 and any("Memcpy" in n for n in names), names
    assert all(any(part in n for part in work) for n in names), names
    others = [a.name for a in every.trace.api_calls if not any(part in a.name for part in work)]
    assert others and len(every.trace.api_calls) > len(names), others
    # The warm-up kernel of trace() (on by default) is run and dropped before the block: both traces hold
    # the block's kernels (relu, sum) and nothing else, as many as a trace without the warm-up.
    with prof.trace(warm_up=False) as cold:
        torch.relu(x).sum().item()
    assert len(selected.trace.kernels) == len(every.trace.kernels) == len(cold.trace.kernels) >= 2
    assert not any("warm_up" in k.name for t in (selected, every, cold) for k in t.trace.kernels)


@pytest.mark.gpu
def test_trace_records_torch_kernels_and_releases_cupti():
    x = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with prof.trace() as t:
        y = x * 2
        z = torch.relu(y) + 1
        host = z.cpu()
    assert host.shape == x.shape
    kernels = t.trace.kernels
    assert len(kernels) >= 3
    for k in kernels:
        assert k.end_ns > k.start_ns and k.duration_ns == k.end_ns - k.start_ns and k.name and k.stream_id >= 0
    assert len(t.trace.memcpys) >= 1 and t.trace.memcpys[-1].kind == "DtoH"
    assert any(a.name.startswith("cudaLaunchKernel") or a.name.startswith("cuLaunchKernel") for a in t.trace.api_calls)
    s = t.summary()
    assert s.kernel_launches == len(kernels) and s.busy_ns + s.gaps.total_ns == s.span_ns
    assert json.loads(t.to_chrome_json())["traceEvents"]
    # Scopes do not nest.
    with prof.trace():
        with pytest.raises(UnavailableError, match="another stitchcuda::profile::Tracer"):
            with prof.trace():
                pass


@pytest.mark.gpu
def test_trace_of_nothing_is_empty_and_block_errors_propagate():
    with prof.trace() as t:
        pass
    assert t.trace.kernels == [] and t.summary().kernel_launches == 0
    with pytest.raises(ZeroDivisionError):
        with prof.trace() as t2:
            1 / 0
    assert t2.trace is not None  # recorded and released even though the block raised
    with prof.trace() as t3:
        torch.ones(4, device="cuda").sum()
    assert t3.summary().kernel_launches >= 1


@pytest.mark.gpu
def test_tracer_duration_agrees_with_cuda_events():
    a = torch.randn(4096, 4096, device="cuda")
    torch.mm(a, a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with prof.trace() as t:
        torch.cuda._sleep(2_000_000)  # the GPU waits on this while the host enqueues the timed work
        start.record()
        torch.mm(a, a)
        end.record()
    event_ns = start.elapsed_time(end) * 1e6
    kernel_ns = sum(k.duration_ns for k in t.trace.kernels if "spin" not in k.name)
    assert kernel_ns == pytest.approx(event_ns, rel=0.05)


@pytest.mark.gpu
def test_metrics_of_a_large_copy_show_dram_bound():
    from stitchcuda import jit
    from stitchcuda.bench.profile import COPY_SOURCE

    # A kernel: torch's own contiguous copy_ is a cudaMemcpyAsync, which the range profiler does not see.
    copy = jit.compile(COPY_SOURCE, "copy4")
    n4 = 16 << 20  # 256 MiB each way
    src = torch.empty(4 * n4, device="cuda")
    dst = torch.empty_like(src)
    grid = (n4 + 255) // 256
    copy(grid, 256, src, dst, n4)
    torch.cuda.synchronize()
    try:
        measured = prof.metrics(copy, grid, 256, src, dst, n4)
    except UnavailableError as exc:
        pytest.skip(f"range profiler unavailable here: {exc}")
    assert len(measured) == 1
    m = measured[0]
    assert m.dram_throughput_pct > 60.0
    assert m.dram_bytes_read == pytest.approx(16.0 * n4, rel=0.25)  # an L2 may stay cached between passes
    assert prof.classify(m.measurement()).bound == "memory"
    with pytest.raises(InvalidArgumentError, match="bogus__metric.sum"):
        prof.metrics(copy, grid, 256, src, dst, n4, metric_names=["bogus__metric.sum"])

    def fails():
        copy(grid, 256, src, dst, n4)
        raise KeyError("from the workload")

    with pytest.raises(KeyError, match="from the workload"):
        prof.metrics(fails)
    # CUPTI was released on the way out: both profilers start again.
    again = prof.metrics(copy, grid, 256, src, dst, n4, metric_names=["gpu__time_duration.sum"])
    assert len(again) == 1 and again[0].duration_ns > 0
    with prof.trace() as t:
        copy(grid, 256, src, dst, n4)
    assert [k.name for k in t.trace.kernels] == ["copy4"]


@pytest.mark.gpu
def test_cli_profiles_a_problem_file(tmp_path, subprocess_env):
    problem = tmp_path / "cnn.py"
    problem.write_text(PROBLEM)
    result = subprocess.run([sys.executable, "-m", "stitchcuda", "profile", str(problem), "--json", "--top-k", "3"],
                            env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    d = json.loads(result.stdout)
    assert d["kernel_launches"] >= 3 and 1 <= len(d["kernels"]) <= 3
    text = subprocess.run([sys.executable, "-m", "stitchcuda", "profile", str(problem), "--no-metrics"],
                          env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0 and "kernel launches" in text.stdout and "metrics: off" in text.stdout


# torch.profiler (Kineto) attaches to CUPTI itself: these run last, so that a failure to share CUPTI
# shows up here and not as a confusing failure of an earlier test.

@pytest.mark.gpu
def test_profile_of_a_small_cnn_agrees_with_torch_profiler(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(32 * 16 * 16, 10)).cuda().eval()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    with torch.inference_mode():
        report = prof.profile(model, x, top_k=5, metrics=True)
        with torch.profiler.profile(activities=TORCH_ACTIVITIES) as p:
            model(x)
            torch.cuda.synchronize()
    torch_kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and not e.name.startswith("Memcpy") and not e.name.startswith("Memset")]
    assert report.kernel_launches == len(torch_kernels)
    totals = Counter()
    for e in torch_kernels:
        totals[e.name] += e.device_time
    top_torch = totals.most_common(1)[0][0]
    assert top_torch in {k.name for k in report.kernels[:3]}
    assert len(report.kernels) <= 5 and all(k.launches >= 1 for k in report.kernels)
    ops = {op for k in report.kernels for op, _ in k.ops}
    assert ops & {"aten::convolution", "aten::cudnn_convolution", "aten::addmm", "aten::relu",
                  "aten::max_pool2d_with_indices"}
    if report.metrics_status.startswith("collected"):
        assert all(k.metrics for k in report.kernels) and all(k.bound for k in report.kernels)
    assert json.dumps(report.to_dict()) and str(report)


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path; a GPU is present")
def test_bench_without_gpu_says_why_and_measures_nothing(capsys):
    from stitchcuda.bench import profile as bench

    assert bench.run(json_output=True) == 3  # 3: what the command needs is missing, nothing measured
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["error"] and out["error"].startswith("profiler unavailable")


def test_cupti_absent_is_a_clear_error_not_a_crash(subprocess_env, tmp_path):
    env = dict(subprocess_env, STITCHCUDA_CUPTI=str(tmp_path / "libcupti.so.13"))
    code = textwrap.dedent("""
        import stitchcuda.profile as prof
        from stitchcuda import _C
        from stitchcuda.errors import UnavailableError
        ok, reason = _C.profile.available()
        print(ok)
        print(reason)
        try:
            prof.validate_metrics(prof.speed_of_light_metrics(), "GH100")
        except UnavailableError as exc:
            print("raised", exc.message)
    """)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "False"
    assert lines[1].startswith("profiler unavailable: STITCHCUDA_CUPTI points to") and "libcupti.so.13" in lines[1]
    assert lines[2].startswith("raised profiler unavailable: STITCHCUDA_CUPTI")


# In a fresh process: once torch.profiler has run, CUPTI stays taken for the rest of the process, so an
# earlier test's torch.profiler must not decide this one.
TORCH_PROFILER_AFTER_TRACE = textwrap.dedent("""
    import torch, stitchcuda, stitchcuda.profile as prof
    x = torch.randn(1 << 16, device="cuda")
    with prof.trace() as t:
        torch.relu(x)
    print("traced", t.summary().kernel_launches)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as p:
        torch.relu(x)
        torch.cuda.synchronize()
    print("torch", any(e.device_type == torch.autograd.DeviceType.CUDA for e in p.events()))
    try:
        with prof.trace():
            torch.relu(x)
        print("second trace ran")
    except stitchcuda.UnavailableError as exc:
        print("refused", exc)
""")


@pytest.mark.gpu
def test_torch_profiler_attaches_after_a_trace_and_then_holds_cupti(subprocess_env):
    result = subprocess.run([sys.executable, "-c", TORCH_PROFILER_AFTER_TRACE], env=subprocess_env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("traced ") and int(lines[0].split()[1]) >= 1
    assert lines[1] == "torch True"  # the Tracer released CUPTI: torch.profiler saw the GPU kernel
    # Kineto stays subscribed to CUPTI for the rest of the process: a trace after it is refused with the
    # typed "another CUPTI client" reason rather than crashing or hanging.
    assert lines[2].startswith("refused ") and "another CUPTI client" in lines[2], lines[2]
