"""`stitchcuda bench program`: what the program runtime costs and saves, as same-run ratios.

1. Host time per forward under graph replay, for a 50-step and a 500-step program (a chain of small
   kernels), with the graph's static buffers (no copies) and with copies in and out; and eager PyTorch
   running the same number of ops. Each call is timed alone after a device sync, so the number is the
   host's cost, not queueing behind the GPU. Floor: one cudaGraphLaunch (~2-4 us on this driver) plus the
   Python binding call; the point of the graph is that it does not grow with the steps.
2. cuBLASLt matmul with a fused epilogue versus F.linear followed by the activation (separate kernels):
   CUDA events, median of 20. The epilogue saves one read and one write of the output.
3. Liveness planning: arena bytes versus the widest point's live bytes and versus no reuse.
4. An artifact's output against the program's before saving (bitwise).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from ..program import ProgramBuilder, Program, load

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


def _gpu_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_overhead() -> dict:
    out = {}
    for steps in (50, 500):
        n = 4096
        ex = chain_program(steps, n).executor()
        x = torch.randn(n, device="cuda")
        y = torch.empty(n, device="cuda")
        ex.run([x], [y])  # eager warm-up
        ex.run([x], [y])  # capture
        expected = x.double()
        for _ in range(steps):
            expected = 1.0001 * expected + 1e-4
        # fp32 rounding accumulates over the chain: about steps * 2**-24 relative.
        ok = torch.allclose(ex.run([x], [y])[0].double(), expected, rtol=steps * 2e-7, atol=1e-5)
        ins, outs = ex.static_inputs(), ex.static_outputs()
        ins[0].copy_(x)
        replay_static = _host_us(lambda: ex.run(ins, outs))
        replay_copies = _host_us(lambda: ex.run([x], [y]))

        def eager():
            t = x
            for _ in range(steps):
                t = torch.mul(t, 1.0001)
            return t

        eager_host = _host_us(eager, repeats=50 if steps > 100 else 200)
        out[f"{steps}_steps"] = {
            "replay_host_us": round(replay_static, 2),
            "replay_with_copies_host_us": round(replay_copies, 2),
            "eager_torch_host_us": round(eager_host, 2),
            "eager_over_replay": round(eager_host / replay_static, 1),
            "gpu_ms_per_forward": round(_gpu_ms(lambda: ex.run(ins, outs)), 4),
            "correct": bool(ok),
        }
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
                ours = _gpu_ms(lambda: ex.run([x], [y]))
                theirs = _gpu_ms(lambda: act(F.linear(x, w, bias)))
                linear_only = _gpu_ms(lambda: F.linear(x, w, bias))
                err = (ex.run([x], [y])[0] - act(F.linear(x, w, bias))).abs().max().item()
                results[f"{m}x{n}x{k}_{name}"] = {
                    "cublaslt_fused_ms": round(ours, 4), "linear_plus_activation_ms": round(theirs, 4),
                    "linear_alone_ms": round(linear_only, 4), "ratio_fused_over_separate": round(ours / theirs, 3),
                    "max_abs_error": err,
                }
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return results


def planning() -> dict:
    out = {}
    for steps in (50, 500):
        plan = chain_program(steps).plan()
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
    if not torch.cuda.is_available():
        print("bench program: no GPU (torch.cuda.is_available() is False); nothing measured")
        return 3
    report = {"device": torch.cuda.get_device_name(), "host_overhead": host_overhead(), "epilogues": epilogues(),
              "planning": planning(), "artifact": artifact_identity()}
    if json_output:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return 0
