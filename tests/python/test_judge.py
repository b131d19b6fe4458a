"""One judge: every timing, comparison, tolerance, GPU peak and report format StitchCUDA uses comes from
the verify layer. Source scans fail when a second timer, flush buffer or comparator appears; the rest
checks that every caller reaches the one implementation and that the pieces agree with each other
(the Planner's DRAM number is the Verifier's floor bandwidth; the C++ reader takes the JSON Python
writes). CPU only, except the tests marked gpu.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import stitchcuda
from stitchcuda import _C, agents, verify
from stitchcuda.errors import InvalidArgumentError, UnavailableError
from stitchcuda.verify import compare, gpu, hardware, harness, timing, worker
from stitchcuda.verify import program as vprogram
from stitchcuda.verify.report import ERROR_KINDS, SCHEMA_VERSION, VerifyReport
from stitchcuda.verify.tolerance import REDUCED_PRECISION, TABLE, Tolerance, tolerance

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "stitchcuda"
# The only file allowed to create or read CUDA events, or to own an L2-flush buffer.
TIMING_MODULE = PACKAGE / "verify" / "gpu.py"
COMPARATOR_MODULE = PACKAGE / "verify" / "compare.py"

TIMER_PATTERNS = [re.compile(p) for p in (
    r"elapsed_time\s*\(", r"Event\s*\(\s*enable_timing", r"torch\.cuda\.Event\s*\(", r"cuda\.Event\b",
    r"cudaEventElapsedTime", r"cuEventElapsedTime", r"cudaEventCreate", r"Event\.record\b")]
# A buffer written only to evict L2: a tensor named like a flush, allocated or zeroed.
FLUSH_PATTERNS = [re.compile(p) for p in (
    r"flush\w*\s*=\s*torch\.(empty|zeros|ones|full)\b", r"\bclass\s+\w*L2Flush\b", r"flush\w*\.zero_\(\)")]
COMPARATOR_PATTERNS = [re.compile(p) for p in (r"\ballclose\s*\(", r"\bisclose\s*\(", r"assert_close\s*\(")]


def scanned_files() -> list[Path]:
    """The package's Python, and every text file under bench/, examples/ and scripts/."""
    files = sorted(PACKAGE.rglob("*.py"))
    for folder in ("bench", "examples", "scripts"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file())
    return files


def hits(paths, patterns) -> list[str]:
    out = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binaries (a built example) hold no timer we could read
        for number, line in enumerate(text.splitlines(), 1):
            if any(p.search(line) for p in patterns):
                out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {line.strip()}")
    return out


# ---- one timer ----------------------------------------------------------------------------------


def test_no_second_timer_outside_the_timing_module():
    found = hits([p for p in scanned_files() if p != TIMING_MODULE], TIMER_PATTERNS)
    assert not found, ("CUDA events outside verify/gpu.py: time with stitchcuda.verify.measure instead:\n"
                       + "\n".join(found))
    assert hits([TIMING_MODULE], TIMER_PATTERNS), "the timing module itself no longer matches: the scan is stale"


def test_the_scans_find_a_planted_timer_flush_and_comparator(tmp_path):
    planted = tmp_path / "second_timer.py"
    planted.write_text("import torch\nstart = torch.cuda.Event(enable_timing=True)\nms = start.elapsed_time(end)\n"
                       "flush = torch.empty(1 << 26, dtype=torch.uint8)\nflush.zero_()\n"
                       "ok = torch.allclose(a, b)\n")
    assert len(hits([planted], TIMER_PATTERNS)) == 2
    assert len(hits([planted], FLUSH_PATTERNS)) == 2
    assert len(hits([planted], COMPARATOR_PATTERNS)) == 1


def test_one_l2_flush_everywhere():
    found = hits([p for p in scanned_files() if p != TIMING_MODULE], FLUSH_PATTERNS)
    assert not found, "an L2 flush outside verify/gpu.py (use stitchcuda.verify.measure):\n" + "\n".join(found)
    assert len(hits([TIMING_MODULE], [re.compile(r"^class L2Flush\b")])) == 1


def test_the_flush_writes_twice_l2_and_at_least_64_mib(monkeypatch):
    # On the CPU the same class allocates its buffer; the device properties are the only GPU input.
    for l2, expected in ((50 << 20, 100 << 20), (4 << 20, 64 << 20)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, l2=l2: SimpleNamespace(L2_cache_size=l2))
        flush = gpu.L2Flush(torch.device("cpu"))
        assert flush.elements * 4 == expected
        written = []
        real_empty = torch.empty
        monkeypatch.setattr(torch, "empty", lambda *a, **k: written.append(real_empty(*a, **k)) or written[-1])
        flush()  # a buffer of that size, taken for this flush and zeroed
        monkeypatch.setattr(torch, "empty", real_empty)
        [buffer] = written
        assert buffer.numel() * buffer.element_size() == expected and int(buffer.count_nonzero()) == 0


class FakeGPU:
    """Stands in for verify/gpu.py's device functions: records what the one timer asked for."""

    def __init__(self, monkeypatch, times=(3.0, 1.0, 2.0, 10.0)):
        self.flushes, self.calls, self.protocols, self.busy = [], [], [], []
        self.times = list(times)
        fake = self

        class Flush:
            def __init__(self, device):
                fake.flushes.append(device)

            def __call__(self):
                pass

        def time_calls(fn, sets, iters, warmup, flush, persisting, sync=None, before_last_round=None, snapshot=True,
                       busy_cycles=0):
            assert isinstance(flush, Flush) and hasattr(persisting, "reset") and sync.typical_ms == 0.01
            assert snapshot is False  # measure keeps no copies of outputs
            fake.busy.append(busy_cycles)
            fake.protocols.append("stitchcuda")
            fake.calls += [fn(*sets[i % len(sets)]) for i in range(warmup + iters)]
            return fake.times[:iters], [None] * len(sets)

        def time_calls_kernelbench(fn, sets, iters, warmup, flush):
            assert isinstance(flush, Flush)
            fake.protocols.append("kernelbench")
            fake.calls += [fn(*sets[i % len(sets)]) for i in range(warmup + iters)]
            return fake.times[:iters]

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(gpu, "L2Flush", Flush)
        monkeypatch.setattr(gpu, "PersistingL2", lambda: SimpleNamespace(reset=lambda: None))
        monkeypatch.setattr(gpu, "sync_latency", lambda flush: gpu.SyncLatency(0.01, 0.02))
        monkeypatch.setattr(gpu, "time_calls", time_calls)
        monkeypatch.setattr(gpu, "time_calls_kernelbench", time_calls_kernelbench)


def test_measure_runs_the_verifiers_protocol_and_reports_its_statistic(monkeypatch):
    fake = FakeGPU(monkeypatch)
    t = timing.measure(lambda a, b: a + b, [(1, 2), (3, 4)], repeats=4, warmup=2)
    assert fake.protocols == ["stitchcuda"] and len(fake.flushes) == 1
    assert fake.calls == [3, 7, 3, 7, 3, 7]  # the input sets cycle through warm-up and timed calls
    assert t.median_ms == 2.5 and t.ms == 2.5 and t.min_ms == 1.0 and t.mean_ms == 4.0
    assert t.sync_latency_ms == 0.01 and t.to_dict()["trials"] == 4
    kb = timing.measure(lambda: 0, repeats=4, protocol="kernelbench")
    assert fake.protocols[-1] == "kernelbench" and kb.ms == kb.mean_ms == 4.0
    with pytest.raises(InvalidArgumentError, match="protocol"):
        timing.measure(lambda: 0, protocol="wallclock")
    with pytest.raises(InvalidArgumentError, match="repeats"):
        timing.measure(lambda: 0, repeats=0)
    timing.measure(lambda: 0, repeats=1, busy_cycles=1000)
    assert fake.busy == [0, 1000]  # passed to the protocol, off unless asked for
    with pytest.raises(InvalidArgumentError, match="busy_cycles"):
        timing.measure(lambda: 0, protocol="kernelbench", busy_cycles=1000)


def test_measure_without_a_gpu_is_unavailable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UnavailableError, match="CUDA device"):
        timing.measure(lambda: 0)


def test_every_timing_caller_goes_through_measure(monkeypatch):
    fake = FakeGPU(monkeypatch, times=[2.0] * 100)
    graph_measure = importlib.import_module("stitchcuda.graph.measure")  # graph mode's timer
    from stitchcuda.bench import program as bench_program
    from stitchcuda.bench import suite
    from stitchcuda.bench import verify as bench_verify

    assert graph_measure.time_ms(lambda: None) == 2.0
    assert suite._time_ms(lambda: None) == 2.0
    assert bench_program.gpu_ms(lambda: None) == 2.0
    assert bench_verify._kernelbench_style(lambda x: x, [torch.ones(1)], trials=5) == 2.0
    assert fake.protocols == ["stitchcuda"] * 3 + ["kernelbench"]
    assert len(fake.flushes) == 4  # one flush per measurement, all the same class


# ---- one comparator, one tolerance table ----------------------------------------------------------


def test_no_second_comparator_outside_the_comparator_module():
    found = hits([p for p in scanned_files() if p != COMPARATOR_MODULE and p.suffix == ".py"], COMPARATOR_PATTERNS)
    assert not found, "compare with stitchcuda.verify.compare instead:\n" + "\n".join(found)


def test_the_tolerance_table():
    assert tolerance(torch.float32) == TABLE["fp32"] == (1e-4, 1e-4)
    assert tolerance(torch.float16) == tolerance(torch.bfloat16) == (1e-2, 1e-2)
    assert tolerance(torch.float64) == (1e-4, 1e-4)
    assert tolerance(torch.int64) == tolerance(torch.bool) == (0.0, 0.0)  # exact
    for precision in ("tf32", "bf16"):
        assert tolerance(torch.float32, precision) == REDUCED_PRECISION == (1e-2, 1e-2)
        assert tolerance(torch.int32, precision) == (0.0, 0.0)
    # The candidate policy and graph mode read the same table.
    assert Tolerance() == Tolerance.for_precision("fp32") and Tolerance().fp32 == TABLE["fp32"]
    from stitchcuda.graph import lower

    assert lower.tolerance is tolerance and verify.Tolerance is Tolerance
    assert verify.task.Tolerance is Tolerance


def test_one_comparator_behind_every_name():
    from stitchcuda.verify import report

    assert harness.first_difference is compare.first_difference is verify.first_difference
    assert report.compare_output is compare.compare_output and report.fp64_error is compare.fp64_error
    assert report.OutputError is compare.OutputError


def test_the_rule_for_nan_and_infinities():
    inf, nan = math.inf, math.nan
    want = torch.tensor([1.0, nan, inf, -inf, 0.0])
    assert compare.first_difference("y", want.clone(), want, 1e-4, 1e-4) is None
    assert compare.compare_output(0, want, want.clone(), 1e-4, 1e-4).ok
    assert compare.max_abs_error(want.clone(), want) == 0.0
    # A finite value where the reference is infinite is no match, however wide rtol * |inf| is.
    got = want.clone()
    got[2] = 5.0
    assert not compare.compare_output(0, want, got, 1e-4, 1e-4).ok
    assert "flat index 2" in compare.first_difference("y", got, want, 1e-4, 1e-4)
    got = want.clone()
    got[3] = inf  # the other infinity
    assert compare.max_abs_error(got, want) == inf
    got = want.clone()
    got[4] = nan
    assert compare.largest_error(got, want) == (inf, 4)
    text = compare.first_difference("y", got, want, 1e-4, 1e-4, reference="ATen")
    assert text.startswith("output 'y' differs from ATen") and "got nan" in text
    assert "is float16, the model's float32" in compare.first_difference(
        "0", want.half(), want, 1e-2, 1e-2, reference="the model")
    ints = torch.tensor([1, 2, 3])
    assert compare.first_difference("i", ints + torch.tensor([0, 0, 1]), ints, *tolerance(ints.dtype))


def test_a_difference_names_the_element_furthest_outside_its_bound_when_the_largest_error_is_within_its_own():
    # A long sum: at 49 the bound is 0.0050 and an error of 3e-4 passes; near zero atol alone bounds it.
    want = torch.tensor([49.0401, 0.0003, -3.0])
    got = torch.tensor([49.0398, 0.00005, -3.0])
    assert compare.most_outside(got, want, 1e-4, 1e-4) == (pytest.approx(2.5, rel=1e-3), 1)
    text = compare.first_difference("sum_1", got, want, 1e-4, 1e-4, reference="ATen")
    assert text.startswith("output 'sum_1' differs from ATen: max |error| 0.000301 at flat index 0")
    assert "furthest outside atol + rtol * |expected| at flat index 1: |error| 0.00025, 2.5 times its bound" in text
    # When the largest error is the one outside its bound, the message names it once.
    assert "furthest" not in compare.first_difference("y", torch.tensor([1.0, 3.0]), torch.tensor([1.0, 2.0]),
                                                      1e-4, 1e-4)


class FakeProgram:
    """A Program's surface as check_program uses it: executor(graphs=False).run(feed), serialize()."""

    def __init__(self, fn):
        self.fn = fn

    def executor(self, graphs=True):
        assert graphs is False  # a check runs the steps as written, never a captured replay
        return SimpleNamespace(run=lambda feed: self.fn(*feed))

    def serialize(self):
        return b"artifact"


def test_check_program_in_this_process():
    x = torch.randn(8)
    good = FakeProgram(lambda t: [t * 2])
    assert vprogram.check_program(good, [x], [x * 2], [tolerance(x.dtype)], ["y"], reference="ATen") == \
        (True, "matches ATen")
    ok, why = vprogram.check_program(FakeProgram(lambda t: [t * 2 + 1]), [x], [x * 2], [(1e-4, 1e-4)], ["y"],
                                     reference="ATen")
    assert not ok and why.startswith("output 'y' differs from ATen: max |error| 1")
    ok, why = vprogram.check_program(FakeProgram(lambda t: [t, t]), [x], [x], [(1e-4, 1e-4)], ["y"])
    assert not ok and "returns 2 outputs" in why

    def boom(t):
        raise RuntimeError("launch failed\nsecond line")

    assert vprogram.check_program(FakeProgram(boom), [x], [x], [(0, 0)], ["y"]) == \
        (False, "RuntimeError: launch failed")


def test_check_program_in_the_worker_ships_a_program_job():
    x = torch.randn(4)
    jobs = []

    class Pool:
        def __init__(self, result):
            self.result = result

        def run(self, job, compile_limit_s, run_limit_s):
            jobs.append(job)
            assert compile_limit_s > 0 and run_limit_s > 0
            return self.result

    ok, why = vprogram.check_program(FakeProgram(None), [x], [x], [(1e-4, 1e-4)], ["y"], pool=Pool({"correct": True}),
                                     reference="ATen")
    assert ok and why == "matches ATen (checked in the Verifier's isolated worker)"
    job = jobs[0]
    assert job["kind"] == "program" and job["artifact"] == b"artifact" and job["names"] == ["y"]
    assert torch.equal(job["inputs"][0], x) and job["tolerances"] == [(1e-4, 1e-4)]
    failed = {"correct": False, "error": {"kind": "runtime", "message": "the reference has no CUDA device"}}
    assert vprogram.check_program(FakeProgram(None), [x], [x], [(0, 0)], ["y"], pool=Pool(failed), reference="ATen") \
        == (False, "runtime: ATen has no CUDA device")


def test_the_worker_side_of_a_program_job(monkeypatch):
    from stitchcuda import program as program_module

    x = torch.arange(4.0)
    program = FakeProgram(lambda t: [t + 1])
    monkeypatch.setattr(program_module.Program, "deserialize", staticmethod(lambda data: program))
    job = vprogram.program_job(FakeProgram(None), [x], [x + 1], [(1e-4, 1e-4)], ["y"])
    assert job["config"]["device"] is None  # CPU tensors: the worker runs on the CPU
    data = worker.run(job, lambda phase: None)[0]  # the worker's entry dispatches on the job's type
    assert data["correct"] and data["schema_version"] == SCHEMA_VERSION and data["recycle"] is False
    job["expected"] = [x]
    data = worker.run(job, lambda phase: None)[0]
    assert not data["correct"] and data["error"]["kind"] == "incorrect"
    assert data["error"]["message"].startswith("output 'y' differs from the reference")


def test_a_program_job_with_the_callers_outputs_writes_them_and_compares_nothing(monkeypatch):
    """check_program's in-place outputs: the worker writes the program's outputs into the tensors it was
    given (the caller's, through CUDA IPC on a GPU) and leaves the comparison to the caller."""
    from stitchcuda import program as program_module

    class Writer:
        def executor(self, graphs=True):
            def run(feed, outputs=None):
                outputs[0].copy_(feed[0] + 1)
                return outputs
            return SimpleNamespace(run=run)

    monkeypatch.setattr(program_module.Program, "deserialize", staticmethod(lambda data: Writer()))
    x, out = torch.arange(4.0), torch.zeros(4)
    job = vprogram.program_job(FakeProgram(None), [x], None, [(1e-4, 1e-4)], ["y"], outputs=[out])
    assert job["expected"] is None and job["outputs"][0] is not None
    data = worker.run(job, lambda phase: None)[0]
    assert data["correct"] and data.get("error") in (None, {})
    assert torch.equal(out, x + 1)  # written into the caller's tensor


def test_an_in_place_check_compares_here_and_gives_the_recorded_values_back():
    """_check_in_place (the tensor side of check_program's in_place_from, on CPU tensors here): the program
    writes into the expected tensor itself, the verdict comes from the saved copy, and the expected tensor
    holds its values again afterwards, whatever the verdict; a worker that crashed on the job answers
    None (the caller checks the usual way)."""

    class Program:
        buffers = [{"id": 0, "role": "input", "shape": [4], "strides": [1]},
                   {"id": 1, "role": "output", "shape": [4], "strides": [1]}]

        def __init__(self, fn):
            self.fn = fn

        def executor(self, graphs=True):
            return SimpleNamespace(run=lambda feed, outputs: [o.copy_(self.fn(feed[0])) for o in outputs])

        def serialize(self):
            return b"artifact"

    x = torch.arange(4.0)
    for fn, ok in ((lambda t: t * 2, True), (lambda t: t * 2 + 1, False)):
        want = x * 2
        saved = {0: want.clone()}
        verdict = vprogram._check_in_place(Program(fn), [x], [want], saved, [(1e-4, 1e-4)], ["y"], None, "ATen", None)
        assert verdict[0] is ok and (ok or "differs from ATen" in verdict[1]), verdict
        assert torch.equal(want, x * 2)  # the recorded values are back

    class Crashed:
        def run(self, job, compile_limit_s, run_limit_s):
            job["outputs"][0].fill_(7.0)  # whatever the worker did before it died
            return {"correct": False, "error": {"kind": "crash", "message": "the worker died"}}

    want = x * 2
    assert vprogram._check_in_place(Program(None), [x], [want], {0: want.clone()}, [(0, 0)], ["y"], Crashed(), "ATen",
                                    {}) is None
    assert torch.equal(want, x * 2)


class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2, (x > 0).sum()


def test_verify_whole_judges_a_model_on_the_example_and_random_sets(monkeypatch):
    model, x = Doubler(), torch.randn(16)
    result = vprogram.verify_whole(model, lambda t: (t + t, (t > 0).sum()), (x,), 3)
    assert result == {"passed": True, "input_sets": 3, "max_abs_error": 0.0, "max_rel_error_fp64": pytest.approx(0.0),
                      "detail": "", "failed_set": None, "fp64_note": ""}
    wrong = vprogram.verify_whole(model, lambda t: (t * 2 + 1e-3, (t > 0).sum()), (x,), 2)
    assert not wrong["passed"] and wrong["detail"].startswith("input set 0, output '0' differs from the model")
    assert wrong["failed_set"] == 0
    # Wrong on the fresh sets only: the failing set is named, and input_set() makes it again.
    later = vprogram.verify_whole(model, lambda t: (t * 2 + (0 if t is x else 1e-3), (t > 0).sum()), (x,), 3)
    assert not later["passed"] and later["failed_set"] == 1 and later["detail"].startswith("input set 1,")
    assert torch.equal(vprogram.input_set((x,), 1)[0], vprogram.input_set((x,), 1)[0])
    assert vprogram.input_set((x,), 0)[0] is x
    assert wrong["max_abs_error"] == pytest.approx(1e-3, rel=1e-3) and wrong["max_rel_error_fp64"] > 0
    # The same error passes under a reduced-precision policy: the table's 1e-2.
    assert vprogram.verify_whole(model, lambda t: (t * 2 + 1e-3, (t > 0).sum()), (x,), 2, "tf32")["passed"]
    # Past the size limit no fp64 copy is made, and the result says why.
    monkeypatch.setattr(vprogram, "EXACT_COPY_LIMIT_BYTES", 8)
    big = vprogram.verify_whole(model, lambda t: (t + t, (t > 0).sum()), (x,), 2)
    assert big["passed"] and big["max_rel_error_fp64"] is None and big["fp64_note"].startswith("not computed")
    monkeypatch.undo()
    shape = vprogram.verify_whole(model, lambda t: (t[:8] * 2, (t > 0).sum()), (x,), 2)
    assert not shape["passed"] and shape["max_abs_error"] == math.inf and "output 0 is" in shape["detail"]
    graph_measure = importlib.import_module("stitchcuda.graph.measure")
    assert graph_measure.verify_program(model, lambda t: (t + t, (t > 0).sum()), (x,), 1,
                                        SimpleNamespace(precision="fp32", tolerance_precision="fp32", groups=[]))["passed"]


def test_verify_whole_releases_the_program_before_each_model_forward_and_judges_its_second_call():
    """With `release`, the program gives its memory back before the model runs on each set (the two
    working sets are never held at once), then runs twice: the second call, a replaying program's
    replay, is the one judged."""
    events: list[str] = []

    class Model(torch.nn.Module):
        def forward(self, x):
            events.append("model")
            return x * 2

    calls = {"n": 0}

    def optimized(t):
        calls["n"] += 1
        events.append("program")
        return t * 2 if calls["n"] % 2 == 0 else t * 3  # the first call of each pair is wrong

    x = torch.randn(64)
    result = vprogram.verify_whole(Model(), optimized, (x,), 2, release=lambda: events.append("release"))
    assert result["passed"], result  # judged on the second call of each set
    # Per set: release, the model (fp64 copy included), then the program twice.
    assert events == ["release", "model", "model", "program", "program"] * 2, events
    # Without `release` the program runs once per set, and that call is judged.
    calls["n"] = 1
    assert vprogram.verify_whole(Model(), optimized, (x,), 1)["passed"]
    calls["n"] = 0
    assert not vprogram.verify_whole(Model(), optimized, (x,), 1)["passed"]


def test_random_inputs_keep_the_examples_distribution_and_integers():
    # Drawn with the example's mean and spread, not at its largest magnitude: a Gaussian example's largest
    # value is about five of its standard deviations, and inputs five times larger than the model's move
    # every rounding error of a product of two computed values 25 times past an absolute tolerance.
    x = torch.randn(100_000) * 50 + 20
    y = vprogram.random_like(x, 7)
    assert y.shape == x.shape and y.dtype == x.dtype and not torch.equal(x, y)
    assert abs(float(y.mean()) - 20) < 1.0 and 0.95 * 50 < float(y.std()) < 1.05 * 50
    assert torch.equal(vprogram.random_like(x, 7), y)  # seeded
    ones = torch.ones(64, dtype=torch.float16)
    z = vprogram.random_like(ones, 7)  # a constant spreads by its magnitude: the fresh set still differs
    assert z.dtype == torch.float16 and not torch.equal(z, ones) and 0.5 < float(z.float().std()) < 1.5
    idx = torch.tensor([3, 1, 2])
    assert torch.equal(vprogram.random_like(idx, 7), idx)


# ---- one GPU description ------------------------------------------------------------------------


H200 = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                       total_memory=150_000_000_000, L2_cache_size=60 << 20)


def test_the_hardware_table_is_the_cpp_profile_layers():
    c = hardware.ceilings("NVIDIA H200")
    assert c.dram_bytes_per_s == 4.3e12 and c.fp32_flops_per_s == 67e12
    assert c.tf32_tensor_flops_per_s == 495e12 and c.bf16_tensor_flops_per_s == 790e12
    assert hardware.ceilings("Tesla T4") is None  # unknown GPUs get no guessed peaks
    h100 = hardware.ceilings("NVIDIA H100 80GB HBM3")  # a datasheet row: tf32x3 can be planned there
    assert h100.tf32_tensor_flops_per_s > 4 * h100.fp32_flops_per_s and h100.dram_bytes_per_s == 3.35e12
    assert stitchcuda.profile.DeviceCeilings().tf32_tensor_flops_per_s == c.tf32_tensor_flops_per_s
    d = hardware._describe(H200, "13.0")
    assert d == {"gpu": "NVIDIA H200", "arch": "sm_90", "sms": 132, "memory_gib": 139.7, "dram_tb_s": 4.3,
                 "fp32_tflops": 67.0, "tf32_tflops": 495.0, "bf16_tflops": 790.0, "l2_bytes": 60 << 20,
                 "cuda": "13.0"}
    unknown = hardware._describe(SimpleNamespace(**{**vars(H200), "name": "Some GPU"}), "13.0")
    assert unknown["dram_tb_s"] == unknown["fp32_tflops"] == unknown["tf32_tflops"] == 0.0


def test_the_planners_dram_number_is_the_verifiers_floor_bandwidth(monkeypatch):
    graph_measure = importlib.import_module("stitchcuda.graph.measure")
    fake = lambda device=None: hardware._describe(H200, "13.0")  # noqa: E731
    monkeypatch.setattr(hardware, "describe", fake)  # graph mode reads it through the module
    told = agents.hardware()
    assert set(told) == {"gpu", "arch", "sms", "memory_gib", "dram_tb_s", "fp32_tflops", "tf32_tflops", "cuda"}
    assert told["dram_tb_s"] == verify.VerifyConfig().bandwidth_tb_s == hardware.floor_bandwidth_tb_s() == 4.3
    assert told["tf32_tflops"] == 495.0 and told["gpu"] == "NVIDIA H200"
    assert graph_measure.device_facts() == (132, "NVIDIA H200")
    monkeypatch.setattr(hardware, "describe", lambda device=None: {"gpu": None, "cuda": "13.0"})
    assert agents.hardware() == {"gpu": agents.NO_GPU, "cuda": "13.0"}


def test_the_floor_bandwidth_is_the_current_gpus_where_cuda_is_in_use(monkeypatch):
    """In a process that uses CUDA the Verifier's bound takes the GPU's own bandwidth from the table (an
    H100's 3.35 TB/s, not the H200's 4.3); a process that has not touched CUDA is not made to (describe()
    would create a context there) and keeps the default ceilings'."""
    asked = []
    h100 = {"gpu": "NVIDIA H100 80GB HBM3", "dram_tb_s": 3.35}
    monkeypatch.setattr(hardware, "describe", lambda device=None: asked.append(1) or h100)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert hardware.floor_bandwidth_tb_s() == verify.VerifyConfig().bandwidth_tb_s == 3.35 and asked
    asked.clear()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert hardware.floor_bandwidth_tb_s() == 4.3 and not asked


def test_the_prompt_quotes_the_verifiers_bandwidth(monkeypatch, tmp_path):
    """End to end: the Planner's prompt, rendered by the C++ agents from agents.hardware(), names the DRAM
    bandwidth the Verifier's speed-of-light bound uses."""
    monkeypatch.setattr(hardware, "describe", lambda device=None: hardware._describe(H200, "13.0"))
    problem = tmp_path / "add_one.py"
    problem.write_text("import torch\nimport torch.nn as nn\n\nclass Model(nn.Module):\n"
                       "    def forward(self, x):\n        return x + 1\n\n"
                       "def get_inputs():\n    return [torch.randn(64)]\n\ndef get_init_inputs():\n    return []\n")
    plan = json.dumps({"summary": "One elementwise kernel.", "steps": [{"title": "Add one", "detail": "fp32."}],
                       "fusion_groups": [], "bottlenecks": [], "risks": [], "constraints": []})
    prompts = []

    def model(messages):
        prompts.append(messages[0]["content"])
        if "You are the Planner" in messages[0]["content"]:
            return plan
        return "```python\nimport torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n" \
               "        return x + 1\n```"

    agents.optimize_problem(problem, model, attempts=1, replans=0, run_dir=tmp_path / "run", static_only=True)
    planner = next(p for p in prompts if "You are the Planner" in p)
    assert f"DRAM {verify.VerifyConfig().bandwidth_tb_s:g} TB/s" in planner, planner


# ---- one report format ----------------------------------------------------------------------------


def validate(instance, schema, where="$") -> list[str]:
    """The draft-07 keywords report_schema() uses (type, const, enum, required, properties, items,
    minimum): every violation, by JSON path."""
    problems = []
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}

    def is_type(value, name):
        if name == "integer":
            return isinstance(value, int) and not isinstance(value, bool)
        if name == "number":
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        return isinstance(value, types[name])

    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(is_type(instance, n) for n in names):
            return [f"{where}: {type(instance).__name__} is not {names}"]
    if "const" in schema and instance != schema["const"]:
        problems.append(f"{where}: {instance!r} is not {schema['const']!r}")
    if "enum" in schema and instance not in schema["enum"]:
        problems.append(f"{where}: {instance!r} not in {schema['enum']}")
    if "minimum" in schema and isinstance(instance, (int, float)) and instance < schema["minimum"]:
        problems.append(f"{where}: {instance} < {schema['minimum']}")
    if isinstance(instance, dict):
        problems += [f"{where}: missing {k}" for k in schema.get("required", []) if k not in instance]
        for key, sub in schema.get("properties", {}).items():
            if key in instance:
                problems += validate(instance[key], sub, f"{where}.{key}")
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            problems += validate(item, schema["items"], f"{where}[{i}]")
    return problems


def real_report() -> VerifyReport:
    """A report as the harness fills one: a compared output with a mismatch, findings, timing, an error."""
    expected = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = expected.clone()
    got[1, 1] = math.nan
    report = VerifyReport(compiled=True)
    report.outputs = [compare.compare_output(0, expected, got, *tolerance(expected.dtype))]
    report.add("input-mutated", "major", "the candidate changed an input tensor in place.", "input 0", line=12)
    report.add("hardcoded-shape", "minor", "assumes 2 columns.")
    report.timing = {"candidate_ms": 0.25, "eager_ms": 0.5, "method": "cuda-events+device-sync"}
    report.trials = [{"seed": 42, "distribution": "problem", "ok": False}]
    report.fail("incorrect", "trial 0 (seed 42, problem inputs): 1 NaN where the reference is a number.")
    report.wall_s = 1.5
    return report


def test_a_real_report_validates_against_the_schema_and_the_cpp_reader_takes_it():
    schema = verify.report_schema()
    assert schema["properties"]["schema_version"]["const"] == SCHEMA_VERSION == 1
    assert schema["properties"]["error"]["properties"]["kind"]["enum"] == list(ERROR_KINDS)
    text = real_report().to_json()
    data = json.loads(text)
    assert data["schema_version"] == SCHEMA_VERSION
    assert validate(data, schema) == []
    assert validate(json.loads(VerifyReport().to_json()), schema) == []
    read = agents.report_from_json(text)
    assert read["compiled"] and not read["correct"] and read["error_kind"] == "incorrect"
    assert any("NaN" in m for m in read["mismatches"]), read
    # The validator is not vacuous: what the reader refuses, the schema refuses too.
    for broken in ({**data, "schema_version": 2}, {k: v for k, v in data.items() if k != "schema_version"},
                   {**data, "error": {"kind": "exploded", "message": ""}}):
        assert validate(broken, schema)


def test_readers_refuse_another_schema_version():
    data = json.loads(real_report().to_json())
    with pytest.raises(stitchcuda.InvalidArgumentError, match="schema_version 2; this reader reads schema_version 1"):
        agents.report_from_json(json.dumps({**data, "schema_version": 2}))
    with pytest.raises(stitchcuda.InvalidArgumentError, match="no schema_version"):
        agents.report_from_json(json.dumps({k: v for k, v in data.items() if k != "schema_version"}))
    with pytest.raises(InvalidArgumentError, match="schema_version 2"):
        VerifyReport.from_dict({**data, "schema_version": 2})
    again = VerifyReport.from_dict(data)
    assert again.error == data["error"] and again.outputs[0].mismatches == 1


# ---- on the GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_measure_on_the_gpu():
    x = torch.randn(1 << 24, device="cuda")
    t = timing.measure(lambda: x.mul(2.0), repeats=10)
    assert len(t.times) == 10 and all(v > 0 for v in t.times) and t.sync_latency_ms is not None
    # 64 MiB read and written at a few TB/s: tens of microseconds, not nanoseconds and not seconds.
    assert 0.01 < t.median_ms < 5.0, t
    kb = timing.measure(lambda: x.mul(2.0), repeats=10, protocol="kernelbench")
    assert 0.01 < kb.mean_ms < 5.0 and kb.sync_latency_ms is None


SCALE_SHIFT = r"""
extern "C" __global__ void scale_shift(const float* x, float* y, float scale, float shift, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * scale + shift;
}
"""


@pytest.mark.gpu
@pytest.mark.parametrize("isolated", [False, True])
def test_a_large_output_is_checked_in_place_and_keeps_its_recorded_values(isolated):
    """With in_place_from, the program writes its output into the expected tensor itself while the
    expected values wait in host memory: no second output-sized tensor, the same verdicts, and the
    expected tensor holds its values again afterwards (a wrong reference stays wrong, untouched)."""
    from stitchcuda import ProgramBuilder

    # 256 MiB: the comparison's own temporaries (float64 slices of 2 Mi elements, about 80 MiB whatever
    # the output's size) stay well below one output-sized tensor.
    n = 64 << 20
    b = ProgramBuilder()
    k = b.kernel(SCALE_SHIFT, "scale_shift")
    x, y = b.input([n], name="x"), b.output([n], name="y")
    b.launch(k, (n + 255) // 256, 256, [("in", x), ("out", y), ("f32", 2.0), ("f32", 1.0), ("i32", n)])
    program = b.build()
    program.compile_kernels()
    xs = torch.randn(n, device="cuda")
    want = xs * 2 + 1
    kept = want.clone()
    pool = verify.trusted_pool() if isolated else None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    stats = {}
    ok, why = vprogram.check_program(program, [xs], [want], [(1e-5, 1e-5)], ["y"], pool=pool, reference="ATen",
                                     stats=stats, in_place_from=1 << 20)
    torch.cuda.synchronize()
    assert ok, why
    assert stats["in_place"] == 1
    assert torch.equal(want, kept)  # the recorded values are back
    assert torch.cuda.max_memory_allocated() - before < n * 4 // 2  # no output-sized tensor allocated here
    wrong = kept.clone()
    wrong[12345] += 1.0
    ok, why = vprogram.check_program(program, [xs], [wrong], [(1e-5, 1e-5)], ["y"], pool=pool, reference="ATen",
                                     in_place_from=1 << 20)
    assert not ok and "at flat index 12345" in why, why
    assert wrong[12345] == kept[12345] + 1.0 and torch.equal(wrong[:12345], kept[:12345])


@pytest.mark.gpu
def test_the_flush_shares_its_memory_with_the_timed_call():
    """The timer's L2 flush takes its buffer for each flush and gives it back before the call: a call that
    allocates as much as the flush raises the peak by about its own size, not by the flush's on top."""
    flush = gpu.L2Flush(torch.device("cuda", torch.cuda.current_device()))
    size = flush.elements * 4
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = verify.measure(lambda: torch.empty(flush.elements, device="cuda").fill_(1.0), repeats=5, warmup=1)
    assert t.ms > 0
    peak = torch.cuda.max_memory_allocated() - base
    assert size <= peak < 1.5 * size, (peak / 2**20, size / 2**20)  # held beside each other: twice the size


@pytest.mark.gpu
def test_describe_on_the_gpu():
    d = verify.describe()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert d["gpu"] == props.name and d["sms"] == props.multi_processor_count and d["l2_bytes"] > 0
    if hardware.ceilings(props.name) is not None:
        assert agents.hardware()["dram_tb_s"] == d["dram_tb_s"] == verify.VerifyConfig().bandwidth_tb_s


def test_comparisons_of_large_outputs_go_in_chunks_with_the_same_answers(monkeypatch):
    from stitchcuda.verify import compare

    want = torch.arange(10, dtype=torch.float32)
    got = want.clone()
    got[7] += 0.5
    got[2] += 0.25
    whole = (compare.largest_error(got, want), compare.first_difference("y", got, want, 1e-4, 1e-4))
    monkeypatch.setattr(compare, "CHUNK_ELEMENTS", 3)  # 10 elements in slices of 3, 3, 3, 1
    assert compare.largest_error(got, want) == whole[0] == (0.5, 7)
    assert compare.first_difference("y", got, want, 1e-4, 1e-4) == whole[1]
    assert "at flat index 7" in whole[1] and compare.max_abs_error(got, want) == 0.5
    assert compare.first_difference("y", want.clone(), want, 1e-4, 1e-4) is None
    assert compare.largest_error(torch.empty(0), torch.empty(0)) == (0.0, 0)


def test_error_and_outside_answers_both_questions_in_one_pass(monkeypatch):
    from stitchcuda.verify import compare

    want = torch.linspace(-3.0, 3.0, 11)
    got = want.clone()
    got[4] += 5e-5  # inside atol + rtol * |want| = 1e-4 + 1e-4 * 0.6
    assert compare.error_and_outside(got, want, 1e-4, 1e-4) == (pytest.approx(5e-5, rel=1e-2), False)
    got[9] += 0.01
    monkeypatch.setattr(compare, "CHUNK_ELEMENTS", 4)  # the worst element and the flag in different chunks
    err, outside = compare.error_and_outside(got, want, 1e-4, 1e-4)
    assert outside and err == pytest.approx(0.01, rel=1e-4) and err == compare.max_abs_error(got, want)
    got[1] = float("nan")  # NaN where the reference has none: infinitely wrong
    assert compare.error_and_outside(got, want, 1e-4, 1e-4) == (float("inf"), True)
    assert compare.error_and_outside(torch.tensor([1, 2]), torch.tensor([1, 3]), 0.0, 0.0) == (1.0, True)
    assert compare.error_and_outside(torch.empty(0), torch.empty(0), 1e-4, 1e-4) == (0.0, False)


@pytest.mark.gpu
def test_a_reference_in_host_memory_is_compared_on_the_gpu_a_slice_at_a_time(monkeypatch):
    from stitchcuda.verify import compare

    want = torch.randn(20_000_000)  # 80 MB; 160 MB in float64
    got = want.cuda()
    got[14_321_000] += 1.0
    monkeypatch.setattr(compare, "CHUNK_ELEMENTS", 1 << 20)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    err, outside = compare.error_and_outside(got, want, 1e-4, 1e-4)
    # float64 slices of 1 Mi elements: a few slices' worth on the GPU, never the whole reference
    assert torch.cuda.max_memory_allocated() - base < 64 << 20
    assert outside and err == pytest.approx(1.0, rel=1e-5)
    assert compare.largest_error(got, want) == (pytest.approx(1.0, rel=1e-5), 14_321_000)
    assert "at flat index 14321000" in compare.first_difference("y", got, want, 1e-4, 1e-4)


def test_tolerance_used_is_the_share_of_the_bound_the_worst_element_takes(monkeypatch):
    from stitchcuda.verify import compare

    want = torch.tensor([1.0, 100.0, float("inf"), 0.0])
    got = want.clone()
    got[1] += 0.5 * (1e-4 + 1e-4 * 100.0)  # half of its bound
    assert compare.tolerance_used(got, want, 1e-4, 1e-4) == pytest.approx(0.5, rel=1e-3)  # fp32 holds 100.01 to ~1e-6
    monkeypatch.setattr(compare, "CHUNK_ELEMENTS", 1)
    assert compare.tolerance_used(got, want, 1e-4, 1e-4) == pytest.approx(0.5, rel=1e-3)  # fp32 holds 100.01 to ~1e-6
    got[2] = 1e30  # a non-finite expected value is matched exactly
    assert compare.tolerance_used(got, want, 1e-4, 1e-4) == float("inf")
    assert compare.tolerance_used(torch.tensor([1, 2]), torch.tensor([1, 2]), 0.0, 0.0) == 0.0
