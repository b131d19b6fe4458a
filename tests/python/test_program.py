"""The program layer from Python without a GPU: building, validation errors that name the step,
liveness planning, the artifact round trip and its corruption checks, and the executor's checks that run
before any GPU is needed (unknown ATen ops, arguments that do not fit the op's schema).
"""

from __future__ import annotations

import pytest
import torch

import stitchcuda
from stitchcuda import Program, ProgramBuilder


def mlp(batch=4):
    b = ProgramBuilder()
    x = b.input([batch, 8], name="x")
    w = b.weight(torch.arange(128, dtype=torch.float32).reshape(16, 8), name="w")
    bias = b.weight(torch.ones(16), name="bias")
    h = b.intermediate([batch, 16], name="h")
    y = b.output([batch, 16], name="y")
    b.matmul(x, w, h, bias=bias, transpose_b=True, epilogue="bias_relu")
    b.aten("aten::gelu", [h], [y], approximate="none")
    return b.build()


def test_build_describes_buffers_steps_and_weights():
    p = mlp()
    assert [b["role"] for b in p.buffers] == ["input", "weight", "weight", "intermediate", "output"]
    assert [s["kind"] for s in p.steps] == ["matmul", "aten"]
    assert p.steps[0]["epilogue"] == "bias_relu" and p.steps[0]["transpose_b"] is True
    assert p.steps[1]["attributes"] == {"approximate": "none"}
    assert p.buffer_plan()["arena_bytes"] == 256  # one [4, 16] f32 intermediate, aligned to 256 bytes
    assert "2 steps" not in repr(p) and "1 matmul, 1 aten" in repr(p)


def test_an_aten_steps_result_is_its_own_tensor_outside_the_arena():
    """The plan says which intermediates the arena holds: what a matmul writes first is placed; what an
    ATen step writes first is the op's own result (the executor adopts it and frees it after last_step)."""
    b = ProgramBuilder()
    x = b.input([4, 8], name="x")
    w = b.weight(torch.ones(16, 8), name="w")
    conv = b.intermediate([4, 8], name="conv")
    h = b.intermediate([4, 16], name="h")
    y = b.output([4, 16], name="y")
    b.aten("aten::relu", [x], [conv])
    b.matmul(conv, w, h, transpose_b=True)
    b.aten("aten::gelu", [h], [y], approximate="none")
    plan = b.build().buffer_plan()
    by_id = {p["buffer"]: p for p in plan["placements"]}
    assert by_id[conv]["in_arena"] is False and by_id[conv]["last_step"] == 1
    assert by_id[h]["in_arena"] is True
    assert plan["arena_bytes"] == 256  # h alone ([4, 16] f32, aligned)


def test_a_large_intermediate_is_allocated_for_its_steps_not_held_in_the_arena():
    """From 32 MiB an intermediate a kernel writes first is outside the arena too: the executor allocates it
    before its first step and lets it go after its last, so it never sits in the arena beside an ATen
    result produced after it died."""
    n = 8 << 20  # 32 MiB of fp32
    b = ProgramBuilder()
    k = b.kernel("extern \"C\" __global__ void k(const float* x, float* y) {}", "k")
    x = b.input([n], name="x")
    t = b.intermediate([n], name="t")
    small = b.intermediate([64], name="small")
    u = b.intermediate([n], name="u")
    y = b.output([n], name="y")
    b.launch(k, 1, 32, [("in", x), ("out", t)])      # 0
    b.launch(k, 1, 32, [("in", t), ("out", small)])  # 1: t's last use
    b.aten("aten::relu", [x], [u])                    # 2: an ATen result, after t died
    b.launch(k, 1, 32, [("in", u), ("out", y)])      # 3
    plan = b.build().buffer_plan()
    by_id = {p["buffer"]: p for p in plan["placements"]}
    assert by_id[t]["in_arena"] is False and by_id[t]["allocated"] is True
    assert (by_id[t]["first_step"], by_id[t]["last_step"]) == (0, 1)
    assert by_id[u]["in_arena"] is False and by_id[u]["allocated"] is False  # adopted from relu
    assert by_id[small]["in_arena"] is True and by_id[small]["allocated"] is False
    assert plan["arena_bytes"] == 256  # `small` alone


def test_round_trip_is_byte_identical_and_keeps_weights(tmp_path):
    p = mlp()
    path = tmp_path / "mlp.stitch"
    p.save(path)
    q = Program.load(path)
    assert q.serialize() == p.serialize()
    assert q.buffers == p.buffers and q.steps == p.steps


def test_the_measured_replay_mode_travels_in_the_artifact(tmp_path):
    p = mlp()
    assert p.replay == {"mode": "unmeasured", "reason": ""}
    p.set_replay("direct", "CUDA graph replay 0.106 ms, direct launches 0.037 ms per call")
    p.save(tmp_path / "mlp.stitch")
    q = Program.load(tmp_path / "mlp.stitch")
    assert q.replay == {"mode": "direct", "reason": "CUDA graph replay 0.106 ms, direct launches 0.037 ms per call"}
    assert q.serialize() == p.serialize() != mlp().serialize()
    with pytest.raises(stitchcuda.InvalidArgumentError, match="unknown replay mode 'often': use one of unmeasured, graph, direct"):
        p.set_replay("often")


def test_corrupted_truncated_and_wrong_version_artifacts_are_clear_errors(tmp_path):
    data = bytearray(mlp().serialize())
    with pytest.raises(stitchcuda.InvalidArgumentError):
        Program.deserialize(bytes(data[: len(data) // 2]))
    tampered = bytearray(data)
    tampered[-5] ^= 0xFF  # inside the last section (weights): its checksum no longer matches
    with pytest.raises(stitchcuda.InvalidArgumentError, match="fails its SHA-256 check"):
        Program.deserialize(bytes(tampered))
    newer = bytearray(data)
    newer[8:12] = (2).to_bytes(4, "little")  # format version 2, from a future StitchCUDA
    with pytest.raises(stitchcuda.InvalidArgumentError, match="version"):
        Program.deserialize(bytes(newer))
    with pytest.raises(stitchcuda.StitchError):
        Program.deserialize(b"not an artifact at all")
    with pytest.raises(stitchcuda.StitchError, match="no artifact at"):
        Program.load(tmp_path / "missing.stitch")


def with_section(data: bytes, name: str, payload: bytes) -> bytes:
    """The artifact `data` with section `name` replaced by `payload`, every checksum made right again: a
    file someone built on purpose, which the checksums cannot catch."""
    import hashlib
    import json

    size = int.from_bytes(data[12:20], "little")
    manifest = json.loads(data[52:52 + size])
    body = data[52 + size:]
    parts, offset = [], 0
    for s in manifest["sections"]:
        chunk = payload if s["name"] == name else body[s["offset"]:s["offset"] + s["size"]]
        s.update(offset=offset, size=len(chunk), sha256=hashlib.sha256(chunk).hexdigest())
        parts.append(chunk)
        offset += len(chunk)
    text = json.dumps(manifest, indent=1).encode()
    return (data[:12] + len(text).to_bytes(8, "little") + hashlib.sha256(text).digest() + text + b"".join(parts))


def test_a_kernel_source_that_is_not_utf8_is_a_clear_error(tmp_path):
    b = ProgramBuilder()
    x, y = b.input([4]), b.output([4])
    k = b.kernel('extern "C" __global__ void copy(const float* x, float* y) { y[threadIdx.x] = x[threadIdx.x]; }',
                 "copy", signature=["const float*", "float*"])
    b.launch(k, [1, 1, 1], [4, 1, 1], [("in", x), ("out", y)])
    data = b.build().serialize()
    assert Program.deserialize(with_section(data, "kernel.0.source", Program.deserialize(data).kernels[0]["source"]
                                            .encode())).kernels  # the rebuilt file reads when nothing changed
    bad = with_section(data, "kernel.0.source", b"// caf\xe9 in Latin-1\n" + b"extern \"C\" __global__ void copy() {}")
    path = tmp_path / "latin1.stitch"
    path.write_bytes(bad)
    for load in (lambda: Program.load(path), lambda: stitchcuda.program.load(path),
                 lambda: Program.deserialize(bad)):
        with pytest.raises(stitchcuda.InvalidArgumentError, match=r"kernel source that is not UTF-8.*byte 0xe9 at offset 6") as info:
            load()
        assert "rebuild" in str(info.value)
    with pytest.raises(stitchcuda.InvalidArgumentError, match="latin1.stitch"):
        Program.load(path)


def test_validation_names_the_step():
    b = ProgramBuilder()
    x = b.input([4, 8])
    w = b.weight([5, 8])
    y = b.output([4, 4])
    b.matmul(x, w, y, transpose_b=True)
    with pytest.raises(stitchcuda.InvalidArgumentError, match="step 0"):
        b.build()


def test_bad_builder_arguments():
    b = ProgramBuilder()
    with pytest.raises(stitchcuda.InvalidArgumentError, match="unknown dtype 'f8'"):
        b.input([4], "f8")
    x = b.input([4])
    y = b.output([4])
    with pytest.raises(stitchcuda.InvalidArgumentError, match="unknown epilogue 'swish'"):
        b.matmul(x, x, y, epilogue="swish")
    with pytest.raises(stitchcuda.InvalidArgumentError, match="kernel argument kind 'ptr'"):
        b.launch(0, 1, 1, [("ptr", x)])
    with pytest.raises(stitchcuda.InvalidArgumentError, match="24 bytes were given"):
        b.weight([4, 4], data=b"\0" * 24)


@pytest.mark.parametrize(
    "op, attributes, message",
    [
        ("aten::nosuch", {}, "unknown ATen op 'aten::nosuch'"),
        ("aten::gelu", {"approx": "tanh"}, "has no argument 'approx'"),
        ("aten::gelu", {"approximate": 3}, "argument 'approximate': int 3 does not fit"),
        ("aten::transpose.int", {"dim0": 0}, "needs argument 'dim1'"),
        ("aten::relu_", {}, "in place"),
    ],
)
def test_aten_steps_are_checked_against_the_dispatcher_before_any_gpu(op, attributes, message):
    b = ProgramBuilder()
    x, y = b.input([4, 4]), b.output([4, 4])
    b.aten(op, [x], [y], **attributes)
    with pytest.raises(stitchcuda.InvalidArgumentError, match=rf"step 0 \(aten {op}\): .*{message}"):
        b.build().executor()


def _indexing(present):
    """y = x[:, idx] as the capture gives it: index.Tensor(x, [None, idx]), the absent entry marked."""
    b = ProgramBuilder()
    x, idx, y = b.input([4, 6]), b.input([2], "i64"), b.output([4, 2])
    b.aten("aten::index.Tensor", [x, idx], [y], **({"indices:present": present} if present is not None else {}))
    return b.build()


@pytest.mark.parametrize("present, message", [([0, 2], "list of 0 \\(absent\\) and 1"),
                                              ([1, 1], "one 1 for each of the 1 input\\(s\\) left")])
def test_an_optional_tensor_list_marks_its_absent_entries(present, message):
    with pytest.raises(stitchcuda.InvalidArgumentError, match=rf"aten::index.Tensor.*{message}"):
        _indexing(present).executor()


def test_an_optional_tensor_list_binds_before_any_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU tests run such steps")
    for present in ([0, 1], None):  # x[:, idx], and x[idx] with every entry given
        with pytest.raises(stitchcuda.UnavailableError):  # past the binding: only the device is missing
            _indexing(present).executor()


def test_executor_without_a_gpu_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(stitchcuda.UnavailableError):
        mlp().executor()
    with pytest.raises(stitchcuda.UnavailableError):
        stitchcuda.load(_saved(mlp()))


def _saved(p: Program) -> str:
    import tempfile

    path = tempfile.mkdtemp() + "/p.stitch"
    p.save(path)
    return path
