"""The judge cannot be forged, on the CPU: attacks on the worker's pipe run for real through the pool (a
candidate that finds the pipe and sends a pickle whose __reduce__ runs code; one that writes forged results
to every descriptor at import; one that forges a frame of the protocol itself), malformed and oversized
frames, and the typed jobs. The caller runs no payload and every forged verdict scores 0."""

from __future__ import annotations

import multiprocessing.connection
import os
import struct
import textwrap
import threading

import pytest
import torch

from stitchcuda.verify import VerifyConfig, WorkerPool, check
from stitchcuda.verify import jobs, wire
from stitchcuda.verify.judge import ReferenceRun, adjudicate
from stitchcuda.verify.report import VerifyReport
from stitchcuda.verify.task import Tolerance

REFERENCE = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    def get_inputs():
        return [torch.rand(64, 16)]
''')
HONEST = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class ModelNew(nn.Module):
        def forward(self, x):
            return x.clamp(min=0) * 2
''')
CONFIG = VerifyConfig(device="cpu", timing_iters=3, warmup=1, compile_time_limit_s=60, run_time_limit_s=30)

# Attack 1: find the pipe among the worker's objects and send a pickle that runs code where it is loaded.
PICKLE_PAYLOAD = textwrap.dedent('''
    import gc, os
    from multiprocessing.connection import Connection

    class Payload:
        def __reduce__(self):
            return (exec, ("open(%(marker)r, 'w').write(str(__import__('os').getpid()))",))

    for obj in gc.get_objects():
        if isinstance(obj, Connection):
            for message in (("result", Payload()), ("phase", Payload()), Payload()):
                try:
                    obj.send(message)
                except OSError:
                    pass
''')
# Attack 2: a forged result on every open descriptor at import, in the old pickle framing and in this one.
FORGE_EVERY_FD = textwrap.dedent('''
    import os, pickle, struct
    from stitchcuda.verify import wire
    claim = {"compiled": True, "correct": True, "hack": False, "findings": [],
             "speedup": {"eager": 42.0, "compile": 42.0}, "timing": {"candidate_ms": 1e-6}}
    frames = [pickle.dumps(("result", claim)), wire.pack("result", "", {"report": claim})]
    for fd in range(3, 256):
        for frame in frames:
            try:
                os.write(fd, struct.pack("!i", len(frame)) + frame)
            except OSError:
                pass
''')


def candidate(attack: str, **values: str) -> str:
    return (attack % values if values else attack) + HONEST


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(devices=["cpu"]) as p:
        yield p


def test_an_honest_candidate_is_judged_correct_with_the_judges_baseline(pool):
    r = check(REFERENCE, HONEST, config=CONFIG, pool=pool)
    assert r.correct and r.error is None, r.feedback
    assert r.timing["judge"].startswith("outputs compared and baselines timed by the judge")
    assert r.speedup["eager"] == pytest.approx(r.timing["eager_ms"] / r.timing["candidate_ms"])
    assert "eager_ms_in_worker" not in r.timing  # the worker did not time the baseline


def test_a_pickle_sent_on_the_pipe_runs_nothing_in_the_caller(pool, tmp_path):
    marker = tmp_path / "ran-in-caller"
    r = check(REFERENCE, candidate(PICKLE_PAYLOAD, marker=str(marker)), config=CONFIG, pool=pool)
    assert not marker.exists() or marker.read_text() != str(os.getpid())  # never loaded by the caller
    assert not r.correct and r.hack
    assert any(f.rule == "protocol-violation" for f in r.findings), r.feedback


def test_a_result_forged_on_every_descriptor_scores_zero(pool):
    r = check(REFERENCE, candidate(FORGE_EVERY_FD), config=CONFIG, pool=pool)
    assert not r.correct and r.hack and r.speedup == {"eager": None, "compile": None}
    assert any(f.rule == "protocol-violation" for f in r.findings), r.feedback
    # The pool goes on: the next candidate gets a fresh worker and an honest verdict.
    assert check(REFERENCE, HONEST, config=CONFIG, pool=pool).correct


def test_a_claim_with_the_nonce_but_wrong_outputs_is_the_judges_incorrect(pool):
    # Worse than attack 2: the candidate reads the job's nonce out of the worker's memory and sends a
    # well-formed result claiming correct and fast, with outputs it did not compute right.
    forge = textwrap.dedent('''
        import gc, sys, torch
        from multiprocessing.connection import Connection
        from stitchcuda.verify import wire, jobs
        nonce = next(o[0] for o in gc.get_objects() if isinstance(o, tuple) and len(o) == 2
                     and isinstance(o[0], str) and isinstance(o[1], jobs.ModelJob))
        conn = next(o for o in gc.get_objects() if isinstance(o, Connection))
        tensors = []
        outputs = {"trials": [wire.encode_value([torch.zeros(64, 16)], tensors) for _ in range(5)], "timed": []}
        claim = {"compiled": True, "correct": True, "findings": [], "timing": {}}
        conn.send_bytes(wire.pack("result", nonce, {"report": claim, "outputs": outputs}, tensors))
        sys.exit(0)
    ''')
    r = check(REFERENCE, forge + HONEST, config=CONFIG, pool=pool)
    assert not r.correct and r.hack
    assert {"judge-disagrees"} <= {f.rule for f in r.findings} or \
        any(f.rule == "protocol-violation" for f in r.findings), r.feedback


# ---- the judge's reading of a claim, without workers --------------------------------------------------


def _reference_run(outputs, timed=(), facts=None) -> ReferenceRun:
    tensors: list[torch.Tensor] = []
    body = {"outputs": {"trials": [wire.encode_value(o, tensors) for o in outputs],
                        "timed": [wire.encode_value(o, tensors) for o in timed]}}
    report = VerifyReport(correct=True).to_dict()
    report["judge"] = {"trials": [{"seed": 42 + i, "distribution": "problem"} for i in range(len(outputs))],
                       "facts": facts or {}}
    return ReferenceRun(report, body, tensors)


def _claim(outputs, timed=(), **timing):
    tensors: list[torch.Tensor] = []
    body = {"outputs": {"trials": [wire.encode_value(o, tensors) for o in outputs],
                        "timed": [wire.encode_value(o, tensors) for o in timed]}}
    report = VerifyReport(compiled=True, correct=True, timing=dict(timing),
                          speedup={"eager": 42.0, "compile": 42.0}).to_dict()
    return report, body, tensors


def test_the_judge_computes_the_speed_up_from_its_own_baseline_and_holds_the_claim_to_the_floor():
    x = [torch.ones(4)]
    ref = _reference_run([x] * 5, [x], {"eager_ms": 2.0, "speed_of_light_ms": 0.5, "bytes_moved_min": 32})
    config = VerifyConfig(device="cpu", timing_iters=3)
    verdict = adjudicate(*_claim([x] * 5, [x], candidate_ms=1.0, eager_ms=99.0), ref, config, Tolerance())
    assert verdict["correct"] and verdict["speedup"]["eager"] == pytest.approx(2.0)
    assert verdict["timing"]["eager_ms_in_worker"] == 99.0 and verdict["timing"]["eager_ms"] == 2.0
    fast = adjudicate(*_claim([x] * 5, [x], candidate_ms=0.01), ref, config, Tolerance())
    assert any(f["rule"] == "impossible-speed" for f in fast["findings"]) and fast["hack"]
    gemm = _reference_run([x] * 5, [x], {"eager_ms": 2.0, "speed_of_light_ms": 0.001, "compute_floor_ms": 0.2,
                                          "reference_flops": 2e11})
    fast_gemm = adjudicate(*_claim([x] * 5, [x], candidate_ms=0.05), gemm, config, Tolerance())
    beat = [f for f in fast_gemm["findings"] if f["rule"] == "beats-reference-arithmetic"]
    assert beat[0]["severity"] == "minor" and beat[0]["evidence"].endswith("2e+11 FLOPs")
    assert not adjudicate(*_claim([x] * 5, [x], candidate_ms=0.3), gemm, config, Tolerance())["findings"]
    nan = adjudicate(*_claim([x] * 5, [x], candidate_ms=float("nan")), ref, config, Tolerance())
    assert any(f["rule"] == "forged-timing" for f in nan["findings"])


def test_the_judge_rechecks_trials_and_timed_outputs():
    x, y = [torch.ones(4)], [torch.zeros(4)]
    ref = _reference_run([x] * 5, [x], {"eager_ms": 1.0})
    config = VerifyConfig(device="cpu", timing_iters=3)
    wrong_trial = adjudicate(*_claim([x] * 4 + [y], [x], candidate_ms=1.0), ref, config, Tolerance())
    assert not wrong_trial["correct"] and wrong_trial["error"]["kind"] == "incorrect"
    assert "trial 4" in wrong_trial["error"]["message"]
    wrong_timed = adjudicate(*_claim([x] * 5, [y], candidate_ms=1.0), ref, config, Tolerance())
    assert any(f["rule"] == "timed-output-mismatch" for f in wrong_timed["findings"])
    missing = adjudicate(*_claim([x] * 3, [x], candidate_ms=1.0), ref, config, Tolerance())
    assert not missing["correct"] and "3 trials" in missing["error"]["message"]


# ---- the wire --------------------------------------------------------------------------------------------


def test_frames_carry_tensors_of_every_dtype_and_values_exactly():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.ones(2, 2, dtype=torch.bfloat16),
               torch.empty(0, 4), torch.tensor([True, False])]
    message = wire.unpack(wire.pack("result", "n1", {"report": {"x": 1}}, tensors))
    assert message.kind == "result" and message.nonce == "n1" and message.body == {"report": {"x": 1}}
    for a, b in zip(tensors, message.tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("mangle, needle", [
    (lambda f: b"XXXX" + f[4:], "no magic"),
    (lambda f: f[:4] + struct.pack(">I", 1 << 30) + f[8:], "header length"),
    (lambda f: f[:-4], "needs"),
    (lambda f: f + b"tail", "after the last tensor"),
    (lambda f: f[:8] + b"{" * (len(f) - 8), "not JSON"),
])
def test_a_malformed_frame_is_a_wire_error_naming_it(mangle, needle):
    frame = wire.pack("result", "n", {"report": {}}, [torch.ones(4)])
    with pytest.raises(wire.WireError, match=needle):
        wire.unpack(mangle(frame))


def _frame(header: dict, payload: bytes = b"") -> bytes:
    import json

    raw = json.dumps(header).encode()
    return wire.MAGIC + struct.pack(">I", len(raw)) + raw + payload


@pytest.mark.parametrize("header, needle", [
    ({"kind": "result", "nonce": "n", "body": {}, "tensors": [], "extra": 1}, "exactly"),
    ({"kind": "exec", "nonce": "n", "body": {}, "tensors": []}, "kind"),
    ({"kind": "result", "nonce": "n", "body": {}, "tensors": [{"dtype": "object", "shape": [1]}]}, "dtype"),
    ({"kind": "result", "nonce": "n", "body": {}, "tensors": [{"dtype": "float32", "shape": [-1]}]}, "shape"),
    ({"kind": "result", "nonce": "n", "body": {}, "tensors": [{"dtype": "float32", "shape": [1 << 39, 4]}]},
     "needs"),
    ({"kind": "result", "nonce": 7, "body": {}, "tensors": []}, "nonce"),
    ({"kind": "result", "nonce": "n", "body": [], "tensors": []}, "object"),
])
def test_a_frame_outside_the_schema_is_refused_field_by_field(header, needle):
    with pytest.raises(wire.WireError, match=needle):
        wire.unpack(_frame(header))


def test_an_oversized_message_is_refused_before_it_is_read():
    ours, theirs = multiprocessing.connection.Pipe()
    # Its sender blocks once the socket's buffer is full: the receiver reads the length, refuses, and closes.
    sender = threading.Thread(target=_send_quietly, args=(theirs, wire.pack("result", "n", {"report": {}},
                                                                            [torch.zeros(1 << 20)])))
    sender.start()
    try:
        with pytest.raises(wire.WireError, match="longer than"):
            wire.receive(ours, limit_bytes=1 << 10)
    finally:
        ours.close()
        sender.join(10)
        theirs.close()
    assert not sender.is_alive()


def _send_quietly(conn, frame: bytes) -> None:
    try:
        conn.send_bytes(frame)
    except OSError:
        pass


def test_output_descriptions_decode_or_fail_cleanly():
    tensors: list[torch.Tensor] = []
    node = wire.encode_value((torch.ones(2), [3, None], object()), tensors)
    value = wire.decode_value(node, tensors)
    assert torch.equal(value[0], torch.ones(2)) and value[1] == [3, None] and repr(value[2]) == "<object>"
    for bad in ({"tensor": 5}, {"seq": "x"}, {"value": {"a": 1}}, "x", {"tensor": True}):
        with pytest.raises(wire.WireError):
            wire.decode_value(bad, tensors)


# ---- typed jobs --------------------------------------------------------------------------------------------


def test_jobs_are_typed_from_their_dicts_and_unknown_ones_are_refused():
    model = jobs.typed({"reference": {}, "candidate": "x", "config": {}, "candidate_name": "c.py"})
    assert isinstance(model, jobs.ModelJob) and model.kind == "model" and model.baselines == "worker"
    assert isinstance(jobs.typed({"kind": "static", "candidate": "x", "config": {}}), jobs.StaticJob)
    assert isinstance(jobs.typed({"kind": "program", "artifact": b"", "inputs": [], "config": {}}), jobs.ProgramJob)
    assert jobs.as_dict(jobs.ReferenceJob({}, {}))["kind"] == "reference"
    with pytest.raises(ValueError, match="unknown job kind 'shell'"):
        jobs.typed({"kind": "shell"})
    with pytest.raises(ValueError, match="no field"):
        jobs.typed({"kind": "static", "candidate": "x", "config": {}, "command": "rm"})


def test_nothing_below_the_pool_imports_check():
    # The worker's entry and the modules it runs never import the API front (no import circle).
    import ast
    import pathlib

    import stitchcuda.verify as verify

    folder = pathlib.Path(verify.__file__).parent
    for name in ("worker", "harness", "judge", "jobs", "wire", "static_compile", "program", "pool"):
        tree = ast.parse((folder / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "check" not in imported and "stitchcuda.verify.check" not in imported, name


def test_the_judges_quick_pass_agrees_with_the_comparator():
    from stitchcuda.verify.judge import _first_bad

    torch.manual_seed(0)
    e = torch.randn(1000)
    tol = Tolerance()
    assert _first_bad([e], [e + 1e-6], tol, 1.0) == ""  # clearly within: the quick pass
    near = e.clone()
    near[7] += 1.5e-4 + 1e-4 * e[7].abs()  # just outside the bound: the full comparator words it
    assert "1 elements outside tolerance" in _first_bad([e], [near], tol, 1.0)
    nan = e.clone()
    nan[3] = float("nan")
    assert _first_bad([e], [nan], tol, 1.0)
    assert "dtype" in _first_bad([e], [e.double()], tol, 1.0)
