"""The program runtime on a GPU: hand-built programs (an MLP with fused cuBLASLt epilogues, a residual
block with a convolution as an ATen step, a program mixing every step kind) against eager PyTorch; graph
replay; several threads on their own streams; an artifact's output bitwise equal to the program's.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import stitchcuda
from stitchcuda import ProgramBuilder, Program
from stitchcuda.program import Executor

pytestmark = pytest.mark.gpu

RESIDUAL_RELU = r"""
extern "C" __global__ void residual_relu(const float* x, const float* h, float* y, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] + fmaxf(h[i], 0.0f);
}
"""

SCALE_SHIFT = r"""
extern "C" __global__ void scale_shift(const float* x, float* y, float scale, float shift, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * scale + shift;
}
"""


@pytest.fixture(autouse=True)
def _exact_fp32():
    """Eager references in true fp32 (the executor follows the same flags)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def mlp_program(w1, b1, w2, b2, batch, epilogue1="bias_relu"):
    b = ProgramBuilder()
    x = b.input([batch, w1.shape[1]], name="x")
    W1, B1 = b.weight(w1, name="w1"), b.weight(b1, name="b1")
    W2, B2 = b.weight(w2, name="w2"), b.weight(b2, name="b2")
    h = b.intermediate([batch, w1.shape[0]], name="h")
    y = b.output([batch, w2.shape[0]], name="y")
    b.matmul(x, W1, h, bias=B1, transpose_b=True, epilogue=epilogue1)
    b.matmul(h, W2, y, bias=B2, transpose_b=True, epilogue="bias")
    return b.build()


def test_mlp_with_fused_epilogues_matches_eager():
    torch.manual_seed(0)
    w1, b1 = torch.randn(512, 256, device="cuda") / 16, torch.randn(512, device="cuda")
    w2, b2 = torch.randn(128, 512, device="cuda") / 22, torch.randn(128, device="cuda")
    for epilogue, act in (("bias_relu", F.relu), ("bias_gelu", lambda t: F.gelu(t, approximate="tanh"))):
        model = stitchcuda.ProgramModule(mlp_program(w1, b1, w2, b2, 64, epilogue))
        for trial in range(3):  # eager, capture + replay, replay
            x = torch.randn(64, 256, device="cuda") * (trial + 1)
            expected = F.linear(act(F.linear(x, w1, b1)), w2, b2)
            torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4)
        stats = model.stats()
        assert stats["eager_runs"] == 1 and stats["captures"] == 1 and stats["replays"] == 2, stats


def residual_program(weight, bias, shape):
    b = ProgramBuilder()
    x = b.input(shape, name="x")
    w, wb = b.weight(weight, name="conv.weight"), b.weight(bias, name="conv.bias")
    h = b.intermediate(shape, name="conv")
    y = b.output(shape, name="y")
    b.aten("aten::convolution", [x, w, wb], [h], stride=[1, 1], padding=[1, 1], dilation=[1, 1],
           transposed=False, output_padding=[0, 0], groups=1)
    k = b.kernel(RESIDUAL_RELU, "residual_relu")
    n = 1
    for e in shape:
        n *= e
    b.launch(k, (n + 255) // 256, 256, [("in", x), ("in", h), ("out", y), ("i64", n)])
    return b.build()


def test_residual_block_with_convolution_as_aten_step():
    torch.manual_seed(1)
    shape = [4, 16, 24, 24]
    weight, bias = torch.randn(16, 16, 3, 3, device="cuda") / 12, torch.randn(16, device="cuda")
    model = stitchcuda.ProgramModule(residual_program(weight, bias, shape))
    for trial in range(3):
        x = torch.randn(*shape, device="cuda")
        expected = x + F.relu(F.conv2d(x, weight, bias, padding=1))
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4)


def mixed_program(w):
    """view -> ATen softmax -> view -> custom kernel -> cuBLASLt matmul: every step kind."""
    b = ProgramBuilder()
    x = b.input([8, 32], name="x")
    W = b.weight(w, name="w")
    x3 = b.view("reshape", x, [8, 4, 8])
    s3 = b.intermediate([8, 4, 8], name="softmax")
    b.aten("aten::_softmax", [x3], [s3], dim=-1, half_to_float=False)
    s2 = b.view("reshape", s3, [8, 32])
    t = b.intermediate([8, 32], name="scaled")
    k = b.kernel(SCALE_SHIFT, "scale_shift")
    b.launch(k, 1, 256, [("in", s2), ("out", t), ("f32", 3.0), ("f32", -0.5), ("i32", 256)])
    y = b.output([8, 16], name="y")
    b.matmul(t, W, y)
    return b.build()


def mixed_reference(x, w):
    s = torch.softmax(x.view(8, 4, 8), dim=-1).view(8, 32)
    return (s * 3.0 - 0.5) @ w


def test_program_mixing_every_step_kind():
    torch.manual_seed(2)
    w = torch.randn(32, 16, device="cuda")
    program = mixed_program(w)
    assert {s["kind"] for s in program.steps} == {"view", "aten", "kernel", "matmul"}
    for graphs in (True, False):
        model = stitchcuda.ProgramModule(program, graphs=graphs)
        for _ in range(3):
            x = torch.randn(8, 32, device="cuda")
            torch.testing.assert_close(model(x), mixed_reference(x, w), atol=1e-4, rtol=1e-4)
        assert model.stats()["replays"] == (2 if graphs else 0)
        assert model.stats()["device_launches"] == 0  # 4 nodes: host replay is faster
        if graphs:
            assert "fewer than device_launch_min_nodes" in model.stats()["host_replay_note"]


def test_replay_reads_new_inputs_and_static_buffers_skip_copies():
    torch.manual_seed(3)
    w = torch.randn(32, 16, device="cuda")
    ex = mixed_program(w).executor()
    x0 = torch.randn(8, 32, device="cuda")
    ex.run([x0])
    ins, outs = ex.static_inputs(), ex.static_outputs()
    for _ in range(3):
        ins[0].copy_(torch.randn(8, 32, device="cuda"))
        got = ex.run(ins, outs)
        torch.testing.assert_close(got[0], mixed_reference(ins[0], w), atol=1e-4, rtol=1e-4)
        assert got[0].data_ptr() == outs[0].data_ptr()
    assert ex.stats()["copies_skipped"] >= 6


def test_threads_on_their_own_streams():
    torch.manual_seed(4)
    w1, b1 = torch.randn(256, 128, device="cuda") / 11, torch.randn(256, device="cuda")
    w2, b2 = torch.randn(64, 256, device="cuda") / 16, torch.randn(64, device="cuda")
    ex = mlp_program(w1, b1, w2, b2, 32).executor()
    failures: list[str] = []

    def serve(seed: int) -> None:
        stream = torch.cuda.Stream()
        gen = torch.Generator(device="cuda").manual_seed(seed)
        with torch.cuda.stream(stream):
            for i in range(40):
                x = torch.randn(32, 128, device="cuda", generator=gen)
                y = ex.run([x], stream=stream)[0]
                expected = F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)
                if not torch.allclose(y, expected, atol=1e-4, rtol=1e-4):
                    failures.append(f"thread {seed}, request {i}: max error {(y - expected).abs().max().item()}")
            stream.synchronize()

    threads = [threading.Thread(target=serve, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]
    stats = ex.stats()
    assert stats["instances"] == 4 and stats["captures"] == 4 and stats["runs"] == 160, stats


def test_saved_artifact_runs_bitwise_identically(tmp_path):
    torch.manual_seed(5)
    weight, bias = torch.randn(16, 16, 3, 3, device="cuda") / 12, torch.randn(16, device="cuda")
    program = residual_program(weight, bias, [2, 16, 12, 12])
    program.compile_kernels()
    assert program.kernels[0]["cubin_bytes"] > 0 and program.kernels[0]["signature"]
    path = tmp_path / "block.stitch"
    program.save(path)
    before, after = stitchcuda.ProgramModule(program), stitchcuda.load(path)
    for _ in range(3):
        x = torch.randn(2, 16, 12, 12, device="cuda")
        assert torch.equal(before(x), after(x))


def test_wrong_inputs_are_clear_errors():
    ex = mixed_program(torch.randn(32, 16, device="cuda")).executor()
    with pytest.raises(stitchcuda.InvalidArgumentError, match=r"input 0 \('x'\) must be f32\[8, 32\]"):
        ex.run([torch.randn(8, 31, device="cuda")])
    with pytest.raises(stitchcuda.InvalidArgumentError, match="is on cpu"):
        ex.run([torch.randn(8, 32)])
    with pytest.raises(stitchcuda.InvalidArgumentError, match="takes 1 input"):
        ex.run([])


def test_shared_weights_are_read_in_place_without_a_copy():
    torch.manual_seed(0)
    w1, b1 = torch.randn(256, 128, device="cuda"), torch.randn(256, device="cuda")
    w2, b2 = torch.randn(64, 256, device="cuda"), torch.randn(64, device="cuda")
    x = torch.randn(32, 128, device="cuda")
    program = mlp_program(w1, b1, w2, b2, 32)
    ids = {b["name"]: b["id"] for b in program.buffers}
    for name, t in (("w1", w1), ("b1", b1), ("w2", w2)):
        program.share_weight(ids[name], t)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ex = program.executor(graphs=False)
    stats = ex.stats()
    shared = (w1.numel() + b1.numel() + w2.numel()) * 4
    assert stats["shared_weight_bytes"] == shared and stats["weight_bytes"] == b2.numel() * 4
    # Only b2 was uploaded (the allocator rounds it up to its 512-byte block).
    assert torch.cuda.memory_allocated() - before == 512
    # Outputs of magnitude ~10-40: cuBLASLt's and F.linear's SGEMM algorithms differ by ~1e-4 there (H200, H100).
    expect = F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)
    torch.testing.assert_close(ex.run([x])[0], expect, rtol=1e-4, atol=1e-3)
    # In place: the next run reads what the shared tensor holds then; a shared weight is not set through
    # the executor (that would write into the caller's tensor).
    w1.mul_(2)
    torch.testing.assert_close(ex.run([x])[0], F.linear(F.relu(F.linear(x, w1, b1)), w2, b2), rtol=1e-4, atol=1e-3)
    with pytest.raises(stitchcuda.InvalidArgumentError, match="is read in place from the tensor shared at creation"):
        ex.set_weight(ids["w1"], w1)
    ex.set_weight(ids["b2"], b2 * 0)  # its own copy: set as before
    torch.testing.assert_close(ex.run([x])[0], F.linear(F.relu(F.linear(x, w1, b1)), w2), rtol=1e-4, atol=1e-3)


def test_a_shared_weight_off_the_device_or_misaligned_is_refused_by_name():
    w1, b1 = torch.randn(256, 128, device="cuda"), torch.randn(256, device="cuda")
    w2, b2 = torch.randn(64, 256, device="cuda"), torch.randn(64, device="cuda")
    program = mlp_program(w1, b1, w2, b2, 32)
    ids = {b["name"]: b["id"] for b in program.buffers}
    program.share_weight(ids["w1"], w1.cpu())
    with pytest.raises(stitchcuda.InvalidArgumentError, match=r"shared weight \d+ \('w1'\) is on cpu but the program "
                                                              r"runs on cuda:0"):
        program.executor()
    program = mlp_program(w1, b1, w2, b2, 32)
    misaligned = torch.empty(64 + 1, device="cuda")[1:]  # 4 bytes past a 512-byte block's start
    misaligned.copy_(b2)
    program.share_weight(ids["b2"], misaligned)
    with pytest.raises(stitchcuda.InvalidArgumentError, match=r"\('b2'\) does not start 256-byte aligned"):
        program.executor()


def test_kernel_argument_mismatch_names_the_step():
    b = ProgramBuilder()
    x, y = b.input([256]), b.output([256])
    k = b.kernel(SCALE_SHIFT, "scale_shift")
    b.launch(k, 1, 256, [("in", x), ("out", y), ("f32", 1.0), ("f32", 0.0), ("i64", 256)])
    with pytest.raises(stitchcuda.InvalidArgumentError, match=r"step 0 \(kernel 'scale_shift'\): argument 4"):
        b.build().executor()


def test_aten_result_of_the_wrong_shape_names_the_step():
    b = ProgramBuilder()
    x, y = b.input([4, 4]), b.output([4, 4])
    b.aten("aten::sum.dim_IntList", [x], [y], dim=[1])
    with pytest.raises(stitchcuda.InvalidArgumentError, match=r"step 0 \(aten aten::sum.dim_IntList\): result 0 is f32\[4\]"):
        b.build().executor().run([torch.randn(4, 4, device="cuda")])


def test_a_program_verified_on_another_gpu_warns():
    b = ProgramBuilder()
    x, y = b.input([256]), b.output([256])
    k = b.kernel(SCALE_SHIFT, "scale_shift")
    b.launch(k, 1, 256, [("in", x), ("out", y), ("f32", 2.0), ("f32", 0.0), ("i32", 256)])
    b.verified_on(device="Another GPU", arch="sm_80")
    with pytest.warns(RuntimeWarning, match=r"verified on Another GPU \(sm_80\) but runs on"):
        model = stitchcuda.ProgramModule(b.build())
    x = torch.randn(256, device="cuda")
    torch.testing.assert_close(model(x), 2 * x)


def chain_program(steps: int, n: int = 1 << 16):
    """`steps` launches of y = x * 1 + 1 in a row: the output is the input plus `steps`, exactly."""
    b = ProgramBuilder()
    k = b.kernel(SCALE_SHIFT, "scale_shift")
    current = b.input([n], name="x")
    for i in range(steps):
        nxt = b.output([n], name="y") if i == steps - 1 else b.intermediate([n])
        b.launch(k, (n + 255) // 256, 256, [("in", current), ("out", nxt), ("f32", 1.0), ("f32", 1.0), ("i32", n)])
        current = nxt
    return b.build()


def test_device_side_replay_is_ordered_with_the_callers_stream():
    """Each replay is one host launch whose kernel tail-launches the forward from the device; the output
    copy after it must see this run's result, never the previous one's (a 200-step chain makes a race
    visible), and host replay must give the same bits."""
    program = chain_program(200)
    device, host = program.executor(), Executor(program, device_launch=False)
    for i in range(6):
        x = torch.randn(1 << 16, device="cuda") * (i + 1)
        a, b = device.run([x])[0], host.run([x])[0]
        assert torch.equal(a, b), f"run {i}: device-side replay differs from host replay"
        torch.testing.assert_close(a, x + 200.0, rtol=0, atol=1e-3 * (i + 1))
    stats = device.stats()
    assert stats["host_replay_note"] == "", stats["host_replay_note"]
    assert stats["replays"] == 5 and stats["device_launches"] == 5, stats
    assert host.stats()["device_launches"] == 0 and host.stats()["replays"] == 5


def test_a_random_op_keeps_replay_on_the_host():
    b = ProgramBuilder()
    x, y = b.input([4096]), b.output([4096])
    b.aten("aten::bernoulli.p", [x], [y], p=0.5)
    ex = Executor(b.build(), device_launch_min_nodes=0)
    for _ in range(3):
        out = ex.run([torch.zeros(4096, device="cuda")])[0]
        assert set(out.unique().tolist()) <= {0.0, 1.0}
    stats = ex.stats()
    assert stats["device_launches"] == 0 and stats["replays"] == 2
    assert "random numbers" in stats["host_replay_note"] and "bernoulli" in stats["host_replay_note"]


@pytest.mark.parametrize("m, n, k, batch, transpose_b, epilogue, block_rows, block_cols, slab", [
    (1024, 768, 4096 + 100, 1, True, "bias_relu", 0, 0, 0),  # a linear layer: eight full K-chunks and a ragged one
    (512, 1024, 300, 1, False, "none", 0, 0, 0),             # K below one chunk: one hi*hi product
    (256, 256, 1536, 8, False, "gelu", 0, 0, 0),             # batched, the second operand broadcast over the batch
    (1000, 768, 2048, 1, True, "bias_gelu", 384, 0, 0),      # a split a block of rows at a time, a shorter last block
    (640, 1000, 1100, 1, True, "bias_gelu", 0, 384, 0),      # b (a weight) a block of its rows at a time: c's columns
    (1000, 1000, 1100, 1, True, "bias_relu", 384, 256, 0),   # both: tiles of c, shorter last blocks of each
    (1024, 768, 4096 + 100, 1, True, "bias_relu", 0, 0, 1024),  # slabs of K, a ragged last one
    (1000, 640, 2100, 1, False, "bias_gelu", 0, 0, 512),     # slabs of a [K, N] weight: contiguous rows of it
    (300, 260, 1030, 1, True, "none", 0, 0, 512),            # a row stride not a multiple of 4: the scalar split
    (1000, 768, 384, 1, True, "bias_gelu", 384, 0, 0),       # K within one chunk (a ViT's), a in blocks of rows
    (700, 1000, 512, 1, True, "bias_relu", 0, 384, 0),       # K of one whole chunk, the weight in blocks
])
@pytest.mark.parametrize("fuse", [0, 1, 2], ids=["apart", "lo-fused", "all-fused"])
def test_tf32x3_matmul_has_fp32_accuracy(m, n, k, batch, transpose_b, epilogue, block_rows, block_cols, slab,
                                         fuse, monkeypatch):
    """tf32x3 (three TF32 tensor-core products on split operands, the big one summed in chunks of K; a
    large a split a block of rows at a time, a large weight a block of its rows, or both a slab of K at a
    time) is as close to exact arithmetic as cuBLAS's SGEMM, and within fp32's tolerance of it; plain TF32
    is not. With STITCHCUDA_TF32X3_FUSE_LO=1 the two lo products run as one over 2K (batch 1 without slabs:
    a [K, N] weight's parts stacked, a transposed one's and a's side by side, blocked or not); with 2 the first
    hi*hi chunk joins that call (all three products in one where K fits one chunk)."""
    from stitchcuda.verify.compare import first_difference, fp64_error

    monkeypatch.setenv("STITCHCUDA_TF32X3_FUSE_LO", str(fuse))
    monkeypatch.setenv("STITCHCUDA_TF32X3_ROWS", str(block_rows))  # 0: every row at once
    monkeypatch.setenv("STITCHCUDA_TF32X3_COLS", str(block_cols))  # 0: every column at once
    monkeypatch.setenv("STITCHCUDA_TF32X3_KBLOCK", str(slab))  # 0: no slabs

    torch.manual_seed(m + k)
    a = torch.randn(batch, m, k, device="cuda") if batch > 1 else torch.randn(m, k, device="cuda")
    # Weights at a linear layer's scale (1/sqrt(k)): outputs of order one, where fp32's absolute tolerance
    # means what it does in a model (unscaled, outputs of a few hundred make SGEMM's own error exceed it).
    w = (torch.randn(n, k, device="cuda") if transpose_b else torch.randn(k, n, device="cuda")) / k ** 0.5
    bias = torch.randn(n, device="cuda") if "bias" in epilogue else None

    def run(precision: str) -> torch.Tensor:
        b = ProgramBuilder()
        x = b.input(list(a.shape), name="a")
        W = b.weight(w, name="w")
        B = b.weight(bias, name="bias") if bias is not None else None
        y = b.output(list(a.shape[:-1]) + [n], name="y")
        b.matmul(x, W, y, bias=B, transpose_b=transpose_b, batch=batch, epilogue=epilogue, precision=precision)
        b.precision(precision)
        return stitchcuda.ProgramModule(b.build(), graphs=False)(a)

    def exact() -> torch.Tensor:
        wt = (w.t() if transpose_b else w).double()
        y = a.double() @ wt + (bias.double() if bias is not None else 0)
        gelu = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731 - cuBLASLt's GELU
        return {"bias_relu": torch.relu, "gelu": gelu, "bias_gelu": gelu}.get(epilogue, lambda t: t)(y)

    ref = exact()
    sgemm, split, tf32 = run("fp32"), run("tf32x3"), run("tf32")
    assert first_difference("y", split, sgemm, 1e-4, 1e-4, reference="SGEMM") is None
    err_sgemm, err_split, err_tf32 = fp64_error(sgemm, ref), fp64_error(split, ref), fp64_error(tf32, ref)
    print(f"[tf32x3] {m}x{n}x{k} batch {batch}: error vs fp64 SGEMM {err_sgemm:.2e} tf32x3 {err_split:.2e} "
          f"tf32 {err_tf32:.2e}")
    # The hi*hi chunk's tensor-core sum truncates (about every 8 terms, up to 2^-24 of the sum each time on
    # average): over one 512-element chunk that bounds the error near 64 * 2^-24 = 3.8e-6, whatever SGEMM's
    # own (a K = 512 product measured 1.3e-6 against SGEMM's 3.0e-7 on an H100, with its three products
    # apart or fused). Dropping a remainder product instead costs TF32's error, ~1e-4.
    assert err_split <= max(4 * err_sgemm, (512 // 8) * 2.0 ** -24), (err_split, err_sgemm)
    assert err_tf32 > 10 * err_split  # the split is what buys the accuracy back


@pytest.mark.parametrize("m, n, k, batch, transpose_b, epilogue, same", [
    (1024, 768, 1024, 1, True, "bias_gelu", False),  # a linear layer with its epilogue
    (512, 1000, 300, 1, False, "none", False),       # a [K, N] weight, ragged sizes
    (128, 128, 512, 4, False, "relu", False),        # batched, the second operand broadcast over the batch
    (256, 256, 384, 1, True, "none", True),          # x @ x^T: one operand, converted once
])
def test_bf16_cast_matmul_runs_bf16_products(m, n, k, batch, transpose_b, epilogue, same, monkeypatch):
    """STITCHCUDA_BF16_CAST=2: a bf16 matmul on fp32 operands converts them to bf16 and runs bf16 products
    with fp32 sums — its result is the exact product of the bf16-rounded operands to fp32 accuracy, not
    TF32's (which CUBLAS_COMPUTE_32F_FAST_16BF gives, STITCHCUDA_BF16_CAST=0), and within bf16's tolerance
    of exact. Unset (1), a product of K >= 256 converts as 2 does."""
    from stitchcuda.verify.compare import fp64_error

    torch.manual_seed(m + k)
    a = torch.randn(batch, m, k, device="cuda") if batch > 1 else torch.randn(m, k, device="cuda")
    if same:
        a = a / k ** 0.25  # x @ x^T of order one off the diagonal
        w = a
    else:
        w = (torch.randn(n, k, device="cuda") if transpose_b else torch.randn(k, n, device="cuda")) / k ** 0.5
    bias = torch.randn(n, device="cuda") if "bias" in epilogue else None

    def run(cast: str) -> torch.Tensor:
        monkeypatch.setenv("STITCHCUDA_BF16_CAST", cast)
        b = ProgramBuilder()
        x = b.input(list(a.shape), name="a")
        W = x if same else b.weight(w, name="w")
        B = b.weight(bias, name="bias") if bias is not None else None
        y = b.output(list(a.shape[:-1]) + [n], name="y")
        b.matmul(x, W, y, bias=B, transpose_b=transpose_b, batch=batch, epilogue=epilogue, precision="bf16")
        b.precision("bf16")
        return stitchcuda.ProgramModule(b.build(), graphs=False)(a)

    def exact(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        y = x.double() @ (wt.t() if transpose_b else wt).double() + (bias.double() if bias is not None else 0)
        gelu = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731 - cuBLASLt's GELU
        return {"relu": torch.relu, "bias_gelu": gelu}.get(epilogue, lambda t: t)(y)

    rounded = exact(a.bfloat16(), w.bfloat16())  # the products of the bf16 operands, summed exactly
    cast, fast = run("2"), run("0")
    assert fp64_error(run(""), rounded) < 1e-5  # unset converts too (every K here is at least 256)
    err_cast, err_fast = fp64_error(cast, rounded), fp64_error(fast, rounded)
    print(f"[bf16] {m}x{n}x{k} batch {batch}: against the bf16 operands' exact product: cast {err_cast:.2e}, "
          f"FAST_16BF {err_fast:.2e}; against exact: {fp64_error(cast, exact(a, w)):.2e}")
    assert err_cast < 1e-5, err_cast  # bf16 products, fp32 sums
    assert err_fast > 10 * err_cast  # FAST_16BF's products are not the bf16 operands'
    torch.testing.assert_close(cast, exact(a, w).float(), atol=1e-2, rtol=1e-2)  # bf16's tolerance


@pytest.mark.parametrize("m,n,k,epilogue,precision,cast", [
    (16384, 256, 1024, "bias", "tf32", "0"),      # tall-skinny: the shape where the heuristic's first may lose
    (2048, 4096, 2048, "bias_gelu", "tf32", "0"),
    (4096, 1024, 1024, "none", "bf16", "2"),      # bf16 copies of the operands, tuned on the copies
])
def test_tuned_matmul_is_correct_and_stable(m, n, k, epilogue, precision, cast, monkeypatch):
    """STITCHCUDA_MATMUL_TUNE=1: the first (direct) run times cuBLASLt's candidates and keeps one; the
    result is the product within the precision's tolerance, and every later call — CUDA graph replays
    included — runs the algorithm chosen then: results identical bit for bit from the first call on."""
    from stitchcuda.verify.compare import fp64_error

    monkeypatch.setenv("STITCHCUDA_MATMUL_TUNE", "1")
    monkeypatch.setenv("STITCHCUDA_BF16_CAST", cast)
    torch.manual_seed(m + n)
    a = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    bias = torch.randn(n, device="cuda") if "bias" in epilogue else None
    b = ProgramBuilder()
    x = b.input([m, k], name="a")
    W = b.weight(w, name="w")
    B = b.weight(bias, name="bias") if bias is not None else None
    y = b.output([m, n], name="y")
    b.matmul(x, W, y, bias=B, transpose_b=True, epilogue=epilogue, precision=precision)
    b.precision(precision)
    module = stitchcuda.ProgramModule(b.build(), graphs=True)
    first = module(a).clone()
    again = [module(a).clone() for _ in range(3)]
    exact = a.double() @ w.double().t() + (bias.double() if bias is not None else 0)
    if epilogue == "bias_gelu":
        exact = F.gelu(exact, approximate="tanh")
    err = fp64_error(first, exact)
    print(f"[tune] {m}x{n}x{k} {epilogue} {precision}: error against exact {err:.2e}")
    assert err < (2e-3 if precision == "tf32" else 1e-2), err
    for out in again:
        assert torch.equal(out, first)


def test_only_a_replaying_instance_holds_static_copies_of_its_inputs_and_outputs():
    """At KernelBench's sizes a copy of every input and output is the largest cost of an instance: one
    that launches its steps directly never allocates them; a replaying one does at its capture."""
    n = 16 << 20  # 64 MiB of fp32
    b = ProgramBuilder()
    x, y = b.input([n], name="x"), b.output([n], name="y")
    k = b.kernel(SCALE_SHIFT, "scale_shift")
    b.launch(k, (n + 255) // 256, 256, [("in", x), ("out", y), ("f32", 2.0), ("f32", 1.0), ("i32", n)])
    program = b.build()
    xs = torch.randn(n, device="cuda")
    tensor_bytes = 4 * n
    for graphs, copies in ((False, 0), (True, 2)):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        executor = program.executor(graphs=graphs)
        out = torch.empty_like(xs)
        for _ in range(3):  # eager warm-up, then (with graphs) capture and replays
            executor.run([xs], [out])
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before - tensor_bytes  # beside the caller's output
        torch.testing.assert_close(out, xs * 2 + 1)
        assert copies * tensor_bytes <= held < copies * tensor_bytes + (4 << 20), (graphs, held)
        del executor, out  # the next round's baseline holds neither


def test_release_gives_the_working_memory_back_and_the_next_run_allocates_it_again():
    """release() frees a replaying instance's arena, static copies and captured graph; the weights stay,
    and the next run allocates and captures again with the same results."""
    n = 16 << 20  # 64 MiB of fp32 per tensor
    b = ProgramBuilder()
    x, y = b.input([n], name="x"), b.output([n], name="y")
    t = b.intermediate([n], name="t")
    k = b.kernel(SCALE_SHIFT, "scale_shift")
    b.launch(k, (n + 255) // 256, 256, [("in", x), ("out", t), ("f32", 2.0), ("f32", 1.0), ("i32", n)])
    b.launch(k, (n + 255) // 256, 256, [("in", t), ("out", y), ("f32", 3.0), ("f32", 0.0), ("i32", n)])
    program = b.build()
    xs = torch.randn(n, device="cuda")
    out = torch.empty_like(xs)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    executor = program.executor(graphs=True)
    for _ in range(3):
        executor.run([xs], [out])
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    # The static input and output (the 64 MiB intermediate is allocated for its steps, in the capture's pool).
    assert held >= 2 * 4 * n, held
    first = out.clone()
    executor.release()
    left = torch.cuda.memory_allocated() - before - 4 * n  # beside `first`
    assert left < (1 << 20), left
    captures = executor.stats()["captures"]
    for _ in range(2):
        executor.run([xs], [out])
    assert executor.stats()["captures"] == captures + 1  # captured again
    torch.testing.assert_close(out, first, rtol=0, atol=0)
    torch.testing.assert_close(out, (xs * 2 + 1) * 3)


def test_a_large_intermediate_is_allocated_for_its_steps_so_the_peak_follows_the_live_set():
    """x -> t -> u (kernels, 64 MiB each; t dies at step 1) -> relu(u) as an ATen step -> y. With one arena
    for t and u, the ATen result would come on top of the whole arena (three tensors at once); allocated for
    their steps, no more than two intermediates are alive at any step. Direct launches and a replay alike
    give the exact result, and a direct run holds nothing after it returns."""
    n = 16 << 20
    b = ProgramBuilder()
    k = b.kernel(SCALE_SHIFT, "scale_shift")
    x, y = b.input([n], name="x"), b.output([n], name="y")
    t, u, a = b.intermediate([n], name="t"), b.intermediate([n], name="u"), b.intermediate([n], name="a")
    b.launch(k, (n + 255) // 256, 256, [("in", x), ("out", t), ("f32", 2.0), ("f32", 0.0), ("i32", n)])
    b.launch(k, (n + 255) // 256, 256, [("in", t), ("out", u), ("f32", 1.0), ("f32", -0.5), ("i32", n)])
    b.aten("aten::relu", [u], [a])
    b.launch(k, (n + 255) // 256, 256, [("in", a), ("out", y), ("f32", 3.0), ("f32", 0.0), ("i32", n)])
    program = b.build()
    plan = program.buffer_plan()
    assert plan["arena_bytes"] == 0 and all(not p["in_arena"] for p in plan["placements"])
    xs = torch.randn(n, device="cuda")
    want = torch.relu(xs * 2 - 0.5) * 3
    for graphs in (False, True):
        out = torch.empty_like(xs)
        executor = program.executor(graphs=graphs)
        executor.run([xs], [out])  # the first run (with graphs=True: launched directly, then captured)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            executor.run([xs], [out])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        if not graphs:
            assert torch.cuda.memory_allocated() == before  # every intermediate let go after its last step
            assert peak <= 2 * 4 * n + (1 << 20), peak  # two of t, u, a at a time, never three
        executor.release()
        del executor


def test_run_that_allocates_its_outputs_gives_each_one_memory_at_its_first_step():
    """run(inputs) allocates an output just before the step that first writes it, and takes an ATen step's
    result as the output itself: x -> t -> u (kernels, 64 MiB each) -> y (a kernel), and x -> t -> relu(t)
    as the output (an ATen step). Neither run holds more than two of the tensors at once (with the outputs
    allocated up front, three); replays give the same values."""
    n = 16 << 20

    def build(last_aten: bool) -> Program:
        b = ProgramBuilder()
        k = b.kernel(SCALE_SHIFT, "scale_shift")
        x, y = b.input([n], name="x"), b.output([n], name="y")
        t = b.intermediate([n], name="t")
        b.launch(k, (n + 255) // 256, 256, [("in", x), ("out", t), ("f32", 2.0), ("f32", -0.5), ("i32", n)])
        if last_aten:
            b.aten("aten::relu", [t], [y])
        else:
            u = b.intermediate([n], name="u")
            b.launch(k, (n + 255) // 256, 256, [("in", t), ("out", u), ("f32", 1.0), ("f32", 1.0), ("i32", n)])
            b.launch(k, (n + 255) // 256, 256, [("in", u), ("out", y), ("f32", 3.0), ("f32", 0.0), ("i32", n)])
        return b.build()

    xs = torch.randn(n, device="cuda")
    for last_aten, want in ((False, (xs * 2 - 0.5 + 1) * 3), (True, torch.relu(xs * 2 - 0.5))):
        program = build(last_aten)
        for graphs in (False, True):
            executor = program.executor(graphs=graphs)
            executor.run([xs])  # the first run (with graphs=True: launched directly, then captured)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            outs = [executor.run([xs])[0] for _ in range(2)]
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
            for out in outs:
                torch.testing.assert_close(out, want, rtol=0, atol=0)
            if not graphs:  # two of t, u, y (or t and relu's result, adopted as y) at a time, never three
                assert peak <= 2 * 4 * n + 4 * n + (1 << 20), (last_aten, peak)  # the first run's output beside
            executor.release()
            del executor, outs


def test_an_instance_allocates_the_workspace_its_matmuls_algorithms_use():
    """The cuBLASLt workspace is the most the chosen algorithms use (chosen within 32 MiB), not the cap:
    what an instance holds after a run is its arena, that workspace and its weights."""
    torch.manual_seed(0)
    w = torch.randn(256, 512, device="cuda")
    b = ProgramBuilder()
    x, W, y = b.input([1024, 512], name="x"), b.weight(w, name="w"), b.output([1024, 256], name="y")
    b.matmul(x, W, y, transpose_b=True)
    program = b.build()
    a = torch.randn(1024, 512, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    executor = program.executor(graphs=False)
    out = executor.run([a])[0]
    torch.cuda.synchronize()
    stats = executor.stats()
    assert 0 <= stats["workspace_bytes"] <= 32 << 20
    held = torch.cuda.memory_allocated() - before - out.numel() * 4
    # the arena (1 byte without intermediates) and the copy of the weight, each rounded to the allocator's blocks
    assert stats["workspace_bytes"] <= held <= stats["workspace_bytes"] + w.numel() * 4 + (2 << 20), (held, stats)
    # fp32 sums in cuBLASLt's order, which the tuned algorithm (a split along K) may change from torch's
    torch.testing.assert_close(out, a @ w.t(), atol=1e-4, rtol=1e-4)
    # Without a matmul: no workspace at all.
    b = ProgramBuilder()
    x, y = b.input([1024], name="x"), b.output([1024], name="y")
    b.aten("aten::relu", [x], [y])
    assert _stats_after_a_run(b.build())["workspace_bytes"] == 0


def _stats_after_a_run(program) -> dict:
    executor = program.executor(graphs=False)
    executor.run([torch.randn(1024, device="cuda")])
    return executor.stats()


@pytest.mark.parametrize("m, n, k, knob, blocked, fewer", [
    # a 128 MiB a beside a 16 MiB weight: 144 MiB of parts blocked (8192 of 16384 rows), 272 MiB whole
    (16384, 1024, 2048, "STITCHCUDA_TF32X3_ROWS", "", 128 << 20),
    # a 128 MiB weight ([N, K]) beside a 16 MiB a: 96 MiB of parts blocked (4096 of its 16384 rows), 288 whole
    (2048, 16384, 2048, "STITCHCUDA_TF32X3_COLS", "", 192 << 20),
    # an MLP's down-projection, a whole (8 Mi outputs): 288 MiB of parts, 36 MiB in slabs of 512 along K
    (8192, 1024, 4096, "STITCHCUDA_TF32X3_KBLOCK", "512", 240 << 20),
    # the same by the executor's own rule: two slabs of 2048, 144 MiB of parts
    (8192, 1024, 4096, "STITCHCUDA_TF32X3_KBLOCK", "", 144 << 20),
])
def test_a_large_tf32x3_operand_is_split_a_block_at_a_time(m, n, k, knob, blocked, fewer, monkeypatch):
    """The split scratch holds one block (or slab of K) of a large operand's parts, not all of them, with
    the same result."""
    a = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    b = ProgramBuilder()
    x, W, y = b.input([m, k], name="a"), b.weight(w, name="w"), b.output([m, n], name="y")
    b.matmul(x, W, y, transpose_b=True, precision="tf32x3")
    b.precision("tf32x3")
    program = b.build()
    held, left, results = {}, {}, {}
    if knob != "STITCHCUDA_TF32X3_KBLOCK":  # blocks whole or not, never slabs of K instead
        monkeypatch.setenv("STITCHCUDA_TF32X3_KBLOCK", "0")
    for value in (blocked, "0"):  # blocks (the executor's choice, or slabs), then the operand whole
        monkeypatch.setenv(knob, value)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        executor = program.executor(graphs=False)
        out = executor.run([a])[0]
        torch.cuda.synchronize()
        # at its step: large split parts are allocated for the matmul's step only
        held[value] = torch.cuda.max_memory_allocated() - before - out.numel() * 4
        left[value] = torch.cuda.memory_allocated() - before - out.numel() * 4
        results[value] = out
        del executor
    assert held["0"] - held[blocked] >= fewer - (8 << 20), held
    # Parts of 32 MiB or more live for their step: after the run the instance holds its 32 MiB cuBLASLt
    # workspace and its copy of the weight, not the parts.
    assert max(left.values()) - w.numel() * 4 <= 33 << 20, left
    torch.testing.assert_close(results[blocked], results["0"])  # the same products, summed in another order
