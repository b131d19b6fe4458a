"""`stitchcuda bench program`: what the program runtime costs and saves, as same-run ratios.

1. Host time per forward under graph replay, for a 50-step and a 500-step program (a chain of small
   kernels), with the graph's static buffers (no copies) and with copies in and out; and eager PyTorch
   running the same number of ops. Each call is timed alone after a device sync, so the number is the
   host's cost, not queueing behind the GPU. Device-side replay (the default: one host launch of a
   single-kernel graph that tail-launches the forward) against host-side cudaGraphLaunch of the whole
   forward, whose cost grows with every kernel node; GPU time per forward for both (the device launch
   adds latency once and runs the nodes sooner: the default uses it from 128 nodes on). Floor: one cudaGraphLaunch
   of a one-node graph plus the Python binding call, whatever the number of steps. The numbers, with their
   runs: docs/program.md, "Measured".
2. cuBLASLt matmul with a fused epilogue versus F.linear followed by the activation (separate kernels):
   the Verifier's timer (stitchcuda.verify.measure: L2 flushed before each call), median of 20. The epilogue saves one read and one write of the output.
3. Liveness planning: arena bytes versus the widest point's live bytes and versus no reuse.
4. An artifact's output against the program's before saving (bitwise).
5. tf32x3 (fp32 matmuls as three TF32 tensor-core products on split operands) against SGEMM and against
   plain TF32, in the same run: milliseconds (the Verifier's timer), the speed-up over SGEMM, the FLOP
   rate, and each one's error against an fp64 product (||got - exact||_inf / ||exact||_inf, and the
   largest share of fp32's tolerance, atol = rtol = 1e-4, used against SGEMM), for the default K-chunk of
   the hi*hi product and for no chunking (STITCHCUDA_TF32X3_CHUNK=0): what the chunking costs and buys;
   and without slabs of K (STITCHCUDA_TF32X3_KBLOCK=0): where the executor splits a shape in slabs, what
   their smaller scratch costs in time. `tf32x3` is the executor's default, the two lo products run as one
   with the first hi*hi chunk (all three one where K fits a chunk); `tf32x3_apart` keeps the three apart
   (STITCHCUDA_TF32X3_FUSE_LO=0), `tf32x3_fused_lo` fuses the lo ones only (=1). Each variant's
   `peak_mib`: the GPU memory its run allocated beside the operands and the result (cuBLASLt's workspace
   and the split parts).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from ..program import Executor, ProgramBuilder, Program, load
from ..verify.compare import first_difference

_CHAIN = r"""
extern "C" __global__ void axpb(const float* x, float* y, float a, float b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + b;
}
"""


def chain_program(steps: int, n: int = 4096) -> Program:
    """x -> axpb -> t0 -> axpb -> t1 ... -> y: `steps` kernel launches over two ping-pong buffers."""
    b = ProgramBuilder()
    x, y = b.input([n], name="x"), b.output([n], name="y")
    k = b.kernel(_CHAIN, "axpb")
    src = x
    for i in range(steps):
        dst = y if i == steps - 1 else b.intermediate([n], name=f"t{i}")
        b.launch(k, (n + 255) // 256, 256, [("in", src), ("out", dst), ("f32", 1.0001), ("f32", 1e-4), ("i32", n)])
        src = dst
    return b.build()


def _host_us(fn, repeats: int = 200) -> float:
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e3


def gpu_ms(fn, repeats: int = 20) -> float:
    """GPU milliseconds per call: the median on the Verifier's protocol (stitchcuda.verify.measure)."""
    from ..verify import measure

    return measure(fn, repeats=repeats, warmup=3).median_ms


def host_overhead() -> dict:
    out = {}
    for steps in (50, 500):
        n = 4096
        program = chain_program(steps, n)
        x = torch.randn(n, device="cuda")
        y = torch.empty(n, device="cuda")
        expected = x.double()
        for _ in range(steps):
            expected = 1.0001 * expected + 1e-4
        row = {}
        # Device-side replay (the default) against host-side cudaGraphLaunch of the whole forward.
        for mode, device_launch in (("device", True), ("host", False)):
            # Device launch forced at every size (the default starts at 128 nodes), to show both sides.
            ex = Executor(program, device_launch=device_launch, device_launch_min_nodes=0)
            ex.run([x], [y])  # eager warm-up
            ex.run([x], [y])  # capture (and, for device replay, its set-up)
            # fp32 rounding accumulates over the chain: about steps * 2**-24 relative.
            ok = first_difference("y", ex.run([x], [y])[0].double(), expected, atol=1e-5, rtol=steps * 2e-7) is None
            ins, outs = ex.static_inputs(), ex.static_outputs()
            ins[0].copy_(x)
            row[f"{mode}_replay_host_us"] = round(_host_us(lambda: ex.run(ins, outs)), 2)
            row[f"{mode}_replay_with_copies_host_us"] = round(_host_us(lambda: ex.run([x], [y])), 2)
            row[f"{mode}_gpu_ms_per_forward"] = round(gpu_ms(lambda: ex.run(ins, outs)), 4)
            row[f"{mode}_correct"] = bool(ok)
            if device_launch:
                stats = ex.stats()
                row["device_launches"] = stats["device_launches"]
                row["host_replay_note"] = stats["host_replay_note"]

        def eager():
            t = x
            for _ in range(steps):
                t = torch.mul(t, 1.0001)
            return t

        row["eager_torch_host_us"] = round(_host_us(eager, repeats=50 if steps > 100 else 200), 2)
        row["eager_over_replay"] = round(row["eager_torch_host_us"] / row["device_replay_host_us"], 1)
        out[f"{steps}_steps"] = row
    # The target: host time per forward independent of the number of steps.
    for mode in ("device", "host"):
        out[f"{mode}_500_over_50_steps"] = round(
            out["500_steps"][f"{mode}_replay_host_us"] / out["50_steps"][f"{mode}_replay_host_us"], 3)
    return out


def epilogues() -> dict:
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # both sides in true fp32
    results = {}
    try:
        for (m, n, k) in ((8192, 4096, 1024), (16384, 1024, 256)):
            x = torch.randn(m, k, device="cuda")
            w = torch.randn(n, k, device="cuda") / k**0.5
            bias = torch.randn(n, device="cuda")
            for name, act in (("bias_relu", F.relu), ("bias_gelu", lambda t: F.gelu(t, approximate="tanh"))):
                b = ProgramBuilder()
                X, W, B, Y = b.input([m, k]), b.weight(w), b.weight(bias), b.output([m, n])
                b.matmul(X, W, Y, bias=B, transpose_b=True, epilogue=name)
                ex = b.build().executor(graphs=False)
                y = torch.empty(m, n, device="cuda")
                ours = gpu_ms(lambda: ex.run([x], [y]))
                theirs = gpu_ms(lambda: act(F.linear(x, w, bias)))
                linear_only = gpu_ms(lambda: F.linear(x, w, bias))
                err = (ex.run([x], [y])[0] - act(F.linear(x, w, bias))).abs().max().item()
                results[f"{m}x{n}x{k}_{name}"] = {
                    "cublaslt_fused_ms": round(ours, 4), "linear_plus_activation_ms": round(theirs, 4),
                    "linear_alone_ms": round(linear_only, 4), "ratio_fused_over_separate": round(ours / theirs, 3),
                    "max_abs_error": err,
                }
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return results


def _matmul_program(m: int, n: int, k: int, w: torch.Tensor, precision: str) -> Program:
    b = ProgramBuilder()
    X, W, Y = b.input([m, k]), b.weight(w), b.output([m, n])
    b.matmul(X, W, Y, transpose_b=True, precision=precision)
    b.precision(precision)
    return b.build()


def tf32_input_conversion() -> str:
    """How cuBLASLt's TF32 matmul turns an fp32 input into TF32 on this GPU: "truncate" or "round" (to
    nearest), read from 1 x 1 products of 1 + 0.75 * 2^-10 (between two TF32 values): what decides whether
    tf32x3 could pass the fp32 operand itself as its TF32 part and store the remainder alone."""
    x = torch.full((8, 8), 1.0 + 0.75 * 2.0 ** -10, device="cuda")
    eye = torch.zeros(8, 8, device="cuda")
    eye[0, 0] = 1.0
    y = _matmul_program(8, 8, 8, eye, "tf32").executor(graphs=False).run([x])[0]
    got = float(y[0, 0])
    return "truncate" if got == 1.0 else "round" if got == 1.0 + 2.0 ** -10 else f"other ({got!r})"


_TF32X3_KNOBS = ("STITCHCUDA_TF32X3_CHUNK", "STITCHCUDA_TF32X3_KBLOCK", "STITCHCUDA_TF32X3_FUSE_LO")
# label, precision, executor settings (the knobs not named are unset)
_TF32X3_VARIANTS = (("sgemm", "fp32", {}), ("tf32x3", "tf32x3", {}),
                    ("tf32x3_apart", "tf32x3", {"STITCHCUDA_TF32X3_FUSE_LO": "0"}),
                    ("tf32x3_unchunked", "tf32x3", {"STITCHCUDA_TF32X3_CHUNK": "0"}),
                    ("tf32x3_no_slabs", "tf32x3", {"STITCHCUDA_TF32X3_KBLOCK": "0"}),
                    ("tf32x3_fused_lo", "tf32x3", {"STITCHCUDA_TF32X3_FUSE_LO": "1"}), ("tf32", "tf32", {}))


def tf32x3(shapes=((8192, 8192, 4096), (4096, 4096, 4096), (8192, 2048, 8192), (2048, 3072, 768),
                   (8192, 1024, 4096), (25216, 1536, 384), (25216, 384, 384))) -> dict:
    """The fifth shape: a transformer encoder's MLP down-projection (4096 -> 1024 over 8192 tokens), whose
    blocks of a stay whole (288 MiB of parts), so the executor splits it in two slabs of K (144 MiB). The
    sixth: a ViT-S/16's MLP up-projection over a batch of 128 images (25,216 tokens, K = 384), where the
    result's passes are a large share of the work (tf32x3_apart: a pass per product after the first); the
    seventh: the same ViT's attention output projection (384 -> 384)."""
    import os

    from ..verify.compare import fp64_error, tolerance_used

    saved = torch.backends.cuda.matmul.allow_tf32, {name: os.environ.get(name) for name in _TF32X3_KNOBS}
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {"tf32_input_conversion": tf32_input_conversion()}
    try:
        for (m, n, k) in shapes:
            torch.manual_seed(m + n + k)
            x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
            exact = x.double() @ w.double().t()
            row: dict = {"gflop": round(2 * m * n * k / 1e9, 1)}
            outs = {}
            for label, precision, settings in _TF32X3_VARIANTS:
                for name in _TF32X3_KNOBS:
                    os.environ.pop(name, None)
                os.environ.update(settings)
                ex = _matmul_program(m, n, k, w, precision).executor(graphs=False)  # reads the knobs at its run
                y = torch.empty(m, n, device="cuda")
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                ex.run([x], [y])
                torch.cuda.synchronize()
                row[f"{label}_peak_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
                ms = gpu_ms(lambda: ex.run([x], [y]))
                ex.run([x], [y])
                outs[label] = y.clone()
                row[f"{label}_ms"] = round(ms, 4)
                row[f"{label}_tflops"] = round(2 * m * n * k / ms / 1e9, 1)
                row[f"{label}_err_fp64"] = fp64_error(y, exact)
                del ex, y
            for label in [v[0] for v in _TF32X3_VARIANTS if v[0] != "sgemm"]:
                row[f"{label}_speedup_over_sgemm"] = round(row["sgemm_ms"] / row[f"{label}_ms"], 3)
                row[f"{label}_tolerance_used_vs_sgemm"] = round(tolerance_used(outs[label], outs["sgemm"], 1e-4, 1e-4), 3)
            results[f"{m}x{n}x{k}"] = row
            del x, w, exact, outs
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        for name, value in saved[1].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return results


def planning() -> dict:
    out = {}
    for steps in (50, 500):
        plan = chain_program(steps).buffer_plan()
        out[f"chain_{steps}"] = {k: plan[k] for k in ("arena_bytes", "live_bound_bytes", "unshared_bytes")}
        out[f"chain_{steps}"]["arena_within_bound"] = plan["arena_bytes"] <= plan["live_bound_bytes"]
    return out


def artifact_identity() -> dict:
    program = chain_program(20)
    program.compile_kernels()
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/chain.stitch"
        program.save(path)
        before, after = program.executor(), load(path)
        x = torch.randn(4096, device="cuda")
        a = before.run([x])[0]
        b = after(x)
        return {"bitwise_equal": bool(torch.equal(a, b)), "cubin_loaded": program.kernels[0]["cubin_bytes"] > 0}


def run(json_output: bool = False) -> int:
    from ..cli_support import EXIT_NO_GPU, no_gpu_reason, refuse

    why = no_gpu_reason()
    if why is not None:
        return refuse("bench program", f"no GPU ({why}); nothing measured", EXIT_NO_GPU, json_output)
    report = {"device": torch.cuda.get_device_name(), "host_overhead": host_overhead(), "epilogues": epilogues(),
              "tf32x3": tf32x3(), "planning": planning(), "artifact": artifact_identity()}
    if json_output:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return 0
