"""The templates' fp16/bf16 paths: 16-byte accesses of eight halves in the elementwise kernels, 8-byte ones of
four in the register-row kernels (norms, softmax, an RMS norm's epilogue), fp32 arithmetic and one rounding
at the store. Each 16-bit kernel compiles with NVRTC for sm_90 and runs on the CPU through the CUDA
emulator with a software fp16/bf16 header (`_SOFT_HALF`: torch's own round-to-nearest-even conversions),
against torch computing in fp32 and rounding once; the same kernels' fp32 instantiations check the index
arithmetic against torch exactly. The `gpu` variants run the same cases on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from stitchcuda import jit
from stitchcuda.graph.templates import PointwiseInput, RowPrologue, pointwise_kernel, row_reduction_kernel
from stitchcuda.graph.templates.pointwise import eight_wide_pointwise_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
from cpu_emulator.emulator import EmulatedJit, EmulatedModule, unavailable  # noqa: E402

emulated = pytest.mark.skipif(unavailable() is not None, reason=f"CUDA emulator: {unavailable()}")

# The emulator has no 16-bit types: these stand in for cuda_fp16.h and cuda_bf16.h with the same layouts
# (two bytes each, pairs of four) and IEEE round-to-nearest-even conversions (g++'s _Float16 for fp16; bf16
# rounded on the bits, NaN kept quiet), so a kernel's 16-bit loads, stores and rounding run as on a GPU.
_SOFT_HALF = r"""
#include <cstring>
struct __half { unsigned short bits; };
struct __nv_bfloat16 { unsigned short bits; };
struct __half2 { __half x, y; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
struct float2 { float x, y; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
inline float __half2float(__half h) { _Float16 f; std::memcpy(&f, &h.bits, 2); return (float)f; }
inline __half __float2half_rn(float v) { _Float16 f = (_Float16)v; __half h; std::memcpy(&h.bits, &f, 2); return h; }
inline float __bfloat162float(__nv_bfloat16 h) { unsigned u = (unsigned)h.bits << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  unsigned u; std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(unsigned short)((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {(unsigned short)(u >> 16)};
}
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
"""

HALVES = [torch.bfloat16, torch.float16]
IDS = ["bf16", "fp16"]


def _soft(source: str) -> str:
    return _SOFT_HALF + "\n".join(l for l in source.splitlines() if not l.startswith("#include <cuda_"))


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return EmulatedJit(tmp_path_factory.mktemp("lowp"))


def _run(emu, code, tensors: dict) -> None:
    """Launches the kernel with the template's geometry: through the emulator, or (emu None) on the GPU."""
    kernel = EmulatedModule(emu, _soft(code.source)).kernel(code.name) if emu is not None else \
        jit.compile(code.source, code.name)
    kernel(code.grid, code.block, *[tensors[k] if kind in ("in", "out") else k for kind, k in code.args],
           shared_mem=code.shared_mem)
    if emu is None:
        torch.cuda.synchronize()


@pytest.fixture(params=["emulated", pytest.param("gpu", marks=pytest.mark.gpu)])
def where(request, tmp_path_factory):
    """(runner, device): the CUDA emulator on CPU tensors, or the GPU (the `gpu` tests) on CUDA ones."""
    if request.param == "gpu":
        return None, "cuda"
    if unavailable() is not None:
        pytest.skip(f"CUDA emulator: {unavailable()}")
    return EmulatedJit(tmp_path_factory.getbasetemp() / "lowp"), "cpu"


def _compiles(code) -> None:
    """NVRTC (no GPU needed) accepts the kernel for sm_90."""
    kernel = jit.compile(code.source, code.name, arch="sm_90")
    assert kernel is not None


def _silu_mul(dtype, n, extra_fp32: bool = False):
    """SwiGLU's product as a bf16 model computes it: silu in fp32, cast back, times up; one result."""
    inputs = [PointwiseInput("in0", dtype, (1,)), PointwiseInput("in1", dtype, (1,))]
    body = ["const float t0 = in0 / (1.0f + expf(-in0));", "const float t1 = t0 * in1;"]
    if extra_fp32:  # an fp32 operand beside the 16-bit ones: two float4 per group of eight
        inputs.append(PointwiseInput("in2", torch.float32, (1,)))
        body.append("const float t2 = t1 + in2;")
    return inputs, body, f"t{len(body) - 1}"


# ---- elementwise: eight halves per 16-byte access ----


@pytest.mark.parametrize("dtype", HALVES, ids=IDS)
def test_a_16_bit_elementwise_kernel_takes_eight_values_per_access_and_compiles(dtype):
    inputs, body, out = _silu_mul(dtype, 4096)
    code = pointwise_kernel("swiglu16", (4096,), inputs, body, [("out0", out, dtype)])
    assert "vectorized 16-bit: eight values per 16-byte access" in code.description and code.vectorized
    assert "load8(p0, v1, a0_0)" in code.source and "store8(q0, v1, b0_0)" in code.source
    assert code.grid == 4096 // 8 // (256 * 2)  # two groups of eight per thread, the tensor covered once
    _compiles(code)
    # Not a multiple of 8, or strided: the scalar form, as before.
    assert "16-bit" not in pointwise_kernel("odd", (4100,), inputs, body, [("out0", out, dtype)]).description


@pytest.mark.parametrize("dtype", HALVES, ids=IDS)
@pytest.mark.parametrize("n, offset", [(8 * 256 * 2 * 3, 0), (8 * 37, 0), (8 * 37, 1)],
                         ids=["full-blocks", "partial-block", "misaligned"])
@pytest.mark.parametrize("fp32_operand", [False, True], ids=["16-bit", "with-fp32"])
def test_a_16_bit_elementwise_kernel_rounds_once_like_torch_in_fp32(where, dtype, n, offset, fp32_operand):
    emu, device = where
    torch.manual_seed(n + offset)
    inputs, body, out = _silu_mul(dtype, n, fp32_operand)
    results = [("out0", out, dtype), ("out1", "t1", torch.float32)]  # the fp32 product stored too
    code = pointwise_kernel("swiglu16", (n,), inputs, body, results)
    assert "16-bit" in code.description
    # A view one element in: its pointer is not 16-byte aligned, so the kernel takes scalar accesses.
    a, b = (torch.randn(n + offset).to(device=device, dtype=dtype)[offset:] for _ in range(2))
    c = torch.randn(n + offset, device=device)[offset:]
    y = torch.full((n + offset,), float("nan"), dtype=dtype, device=device)[offset:]
    y32 = torch.full((n,), float("nan"), device=device)
    _run(emu, code, {"in0": a, "in1": b, "in2": c, "out0": y, "out1": y32})
    t1 = torch.nn.functional.silu(a.float()) * b.float()
    want = (t1 + c if fp32_operand else t1).to(dtype)
    if emu is not None:  # the same rounding, bit for bit
        assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    else:  # the GPU's expf and torch's silu may differ in fp32's last bit: a rare neighbouring 16-bit value
        step = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
        torch.testing.assert_close(y.float(), want.float(), atol=0, rtol=step)
        assert (y != want).float().mean() < 1e-3
    torch.testing.assert_close(y32, t1, atol=1e-6, rtol=1e-6)


@emulated
def test_the_eight_wide_form_indexes_fp32_operands_like_torch(emu):
    # Its fp32 instantiation (the index arithmetic without 16-bit types): each group of eight where it belongs.
    n = 8 * 300
    x, z = torch.arange(n, dtype=torch.float32), torch.randn(n)
    code = eight_wide_pointwise_kernel("wide32", (n,), n, [PointwiseInput("in0", torch.float32, (1,)),
                                                           PointwiseInput("in1", torch.float32, (1,))],
                                       ["const float t0 = in0 * 2.0f + in1;"], [("out0", "t0", torch.float32)],
                                       ["const float* __restrict__ p0", "const float* __restrict__ p1",
                                        "float* __restrict__ q0", "long long n"])
    y = torch.full((n,), float("nan"))
    _run(emu, code, {"in0": x, "in1": z, "out0": y})
    assert torch.equal(y, x * 2.0 + z)


@pytest.mark.parametrize("dtype", HALVES, ids=IDS)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_a_16_bit_broadcast_kernel_reads_four_halves_at_a_time(where, dtype, offset):
    # y = x * scale[c] + r: x contiguous (one 8-byte load of four halves), the per-channel scale one value
    # repeated, r read transposed (four loads); a 16-bit result (8-byte stores) and an fp32 one.
    emu, device = where
    torch.manual_seed(7 + offset)
    shape = (2, 8, 5, 12)
    n = 2 * 8 * 5 * 12
    x = torch.randn(n + offset).to(device=device, dtype=dtype)[offset:].view(shape)
    scale = torch.randn(8).to(device=device, dtype=dtype)
    r = torch.randn(2, 8, 12, 5).to(device=device, dtype=dtype).transpose(2, 3)  # strided over the group
    inputs = [PointwiseInput("in0", dtype, tuple(x.stride())), PointwiseInput("in1", dtype, (0, 1, 0, 0)),
              PointwiseInput("in2", dtype, tuple(r.stride()))]
    body = ["const float t0 = in0 * in1;", "const float t1 = t0 + in2;"]
    code = pointwise_kernel("bcast16", shape, inputs, body, [("out0", "t1", dtype), ("out1", "t0", torch.float32)])
    assert "four outputs per thread" in code.description
    assert "load4(p0 + (" in code.source and "store4(q0 + i, 0, b0, wide);" in code.source
    y = torch.full((n + offset,), float("nan"), dtype=dtype, device=device)[offset:]
    y32 = torch.full((n,), float("nan"), device=device)
    _run(emu, code, {"in0": x, "in1": scale, "in2": r.transpose(2, 3), "out0": y, "out1": y32})  # r's memory
    t0 = x.float() * scale.float().view(1, 8, 1, 1)
    want = (t0 + r.float()).to(dtype)
    assert torch.equal(y.view(shape).view(torch.int16), want.view(torch.int16))  # one rounding, as torch's
    assert torch.equal(y32.view(shape), t0)
    if emu is not None:
        _compiles(code)


# ---- register rows: norms and softmax over 16-bit rows ----


@pytest.mark.parametrize("dtype", HALVES, ids=IDS)
@pytest.mark.parametrize("kind", ["layer_norm", "softmax", "log_softmax"])
def test_16_bit_norm_and_softmax_rows_are_held_in_registers_and_compile(dtype, kind):
    ln = kind == "layer_norm"
    code = row_reduction_kernel(f"r16_{kind}", kind, 64, 768, dtype, has_weight=ln, has_bias=ln)
    assert "row held in registers" in code.description and "16-bit operands" in code.description
    ctype = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half"}[dtype]
    assert f"const {ctype}* __restrict__ x" in code.source and f"{ctype}* __restrict__ y" in code.source
    _compiles(code)


@pytest.mark.parametrize("dtype", HALVES, ids=IDS)
@pytest.mark.parametrize("kind", ["layer_norm", "softmax", "log_softmax", "mean", "amax"])
@pytest.mark.parametrize("rows, cols", [(9, 768), (3, 2052), (2, 40000)],
                         ids=["warp-rows", "block-row-unaligned", "shared-memory"])
def test_16_bit_rows_match_torch_in_fp32_rounded_once(where, dtype, kind, rows, cols):
    emu, device = where
    torch.manual_seed(rows * cols)
    x = (torch.randn(rows, cols) * 3 + 1).to(device=device, dtype=dtype)
    w, b = (1 + 0.1 * torch.randn(cols)).to(device=device, dtype=dtype), (0.1 * torch.randn(cols)).to(device=device, dtype=dtype)
    ln = kind == "layer_norm"
    stat = kind in ("mean", "amax")
    out = torch.float32 if stat else dtype
    code = row_reduction_kernel(f"r16_{kind}", kind, rows, cols, dtype, out, has_weight=ln, has_bias=ln)
    assert "16-bit operands" in code.description
    xf = x.float()
    want = {"layer_norm": lambda: torch.nn.functional.layer_norm(xf, (cols,), w.float(), b.float(), 1e-5),
            "softmax": lambda: torch.softmax(xf, -1), "log_softmax": lambda: torch.log_softmax(xf, -1),
            "mean": lambda: xf.mean(-1), "amax": lambda: xf.amax(-1)}[kind]().to(out)
    y = torch.full(want.shape, float("nan"), dtype=out, device=device)
    _run(emu, code, {"x": x, "weight": w, "bias": b, "y": y})
    # fp32 statistics in another order than torch's: a result may round to the neighbouring 16-bit value.
    ulp = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-5}[out]
    torch.testing.assert_close(y.float(), want.float(), atol=ulp * (2 if kind == "log_softmax" else 1), rtol=ulp)


# A C expression rounding a float expression to the 16-bit type and back, as a cast in the graph does.
_ROUND16 = {torch.bfloat16: "__bfloat162float(__float2bfloat16_rn({}))", torch.float16: "__half2float(__float2half_rn({}))"}
_STEP = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}  # one 16-bit rounding step, relative


def _sum_and_result_match(emu, code, dtype, s, want_s, y, want) -> None:
    """The stored residual sum equals torch's 16-bit add bit for bit; the result is within one 16-bit
    step of torch's (fp32 statistics summed in another order); NVRTC compiles the kernel."""
    assert torch.equal(s, want_s)
    torch.testing.assert_close(y.float(), want.float(), atol=_STEP[dtype], rtol=_STEP[dtype])
    if emu is not None:
        _compiles(code)


def _rms_norm_parts(dtype, shape):
    """An RMS norm as a bf16 Llama computes it, the way the planner fuses it: the prologue squares the fp32
    upcast of x; the epilogue computes the upcast again, scales it by rsqrt(mean + eps), rounds it to
    x's dtype and multiplies by the weight (rounded again: a 16-bit product)."""
    cols = shape[-1]
    prologue = RowPrologue(shape, [PointwiseInput("in0", dtype, (cols, 1))], ["const float t0 = in0;",
                                                                             "const float t1 = t0 * t0;"], "t1")
    round16 = _ROUND16[dtype]
    epilogue = RowPrologue(shape, [PointwiseInput("e0", dtype, (cols, 1)), PointwiseInput("e1", dtype, (0, 1))],
                           ["const float t0 = e0;", "const float t1 = t0 * rsqrtf(stat + 1e-06f);",
                            f"const float t2 = {round16.format('t1')};", f"const float t3 = {round16.format('e1 * t2')};"],
                           "t3", ("stat",))
    return prologue, epilogue


@pytest.mark.parametrize("dtype", HALVES, ids=IDS)
def test_a_16_bit_rms_norm_reads_its_row_once_into_registers_and_compiles(dtype):
    prologue, epilogue = _rms_norm_parts(dtype, (32, 2048))
    code = row_reduction_kernel("rms16", "mean", 32, 2048, torch.float32, dtype, prologue=prologue,
                                epilogue=epilogue, same_row={"e0": "in0"})
    assert "row held in registers" in code.description and "1 operand(s) from the registers" in code.description
    assert "float4 r_in0[VPT]" in code.source  # the 16-bit row kept as fp32 beside the squares
    _compiles(code)


@pytest.mark.parametrize("dtype", HALVES, ids=IDS)
@pytest.mark.parametrize("rows, cols", [(5, 2048), (3, 1028)], ids=["aligned", "odd-rows-unaligned"])
def test_a_16_bit_rms_norm_matches_the_models_arithmetic(where, dtype, rows, cols):
    emu, device = where
    torch.manual_seed(cols)
    prologue, epilogue = _rms_norm_parts(dtype, (rows, cols))
    code = row_reduction_kernel("rms16", "mean", rows, cols, torch.float32, dtype, prologue=prologue,
                                epilogue=epilogue, same_row={"e0": "in0"})
    x, w = torch.randn(rows, cols).to(device=device, dtype=dtype), (1 + 0.1 * torch.randn(cols)).to(device=device, dtype=dtype)
    y = torch.full((rows, cols), float("nan"), dtype=dtype, device=device)
    _run(emu, code, {"in0": x, "e0": x, "e1": w, "y": y})
    h = x.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    # The mean of squares in another summation order than torch's: at most one 16-bit rounding step apart.
    ulp = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    torch.testing.assert_close(y.float(), want.float(), atol=ulp, rtol=ulp)
    assert (y.float() != want.float()).float().mean() < 0.02  # nearly all equal bit for bit


@pytest.mark.parametrize("dtype", HALVES, ids=IDS)
@pytest.mark.parametrize("rows, cols", [(5, 2048), (4, 64), (2, 40000)],
                         ids=["row-in-registers", "warp-per-row", "shared-memory"])
def test_a_16_bit_residual_rms_norm_stores_the_sum_it_adds(where, dtype, rows, cols):
    # s = x + r (a bf16 add: rounded), then the RMS norm of s; the kernel stores s too (`also`), computed
    # again from the registers holding x and r.
    emu, device = where
    torch.manual_seed(cols + 1)
    round16 = _ROUND16[dtype]
    row = (cols, 1)
    prologue = RowPrologue((rows, cols), [PointwiseInput("in0", dtype, row), PointwiseInput("in1", dtype, row)],
                           [f"const float t0 = {round16.format('in0 + in1')};", "const float t1 = t0 * t0;"], "t1")
    epilogue = RowPrologue((rows, cols), [PointwiseInput("e0", dtype, row), PointwiseInput("e1", dtype, row),
                                          PointwiseInput("e2", dtype, (0, 1))],
                           [f"const float t0 = {round16.format('e0 + e1')};",
                            "const float t1 = t0 * rsqrtf(stat + 1e-06f);", f"const float t2 = {round16.format('t1')};",
                            f"const float t3 = {round16.format('e2 * t2')};"], "t3", ("stat",))
    code = row_reduction_kernel("rres16", "mean", rows, cols, torch.float32, dtype, prologue=prologue,
                                epilogue=epilogue, same_row={"e0": "in0", "e1": "in1"}, also=(("t0", dtype),))
    assert "1 more value(s) of the row stored" in code.description
    x, r = (torch.randn(rows, cols).to(device=device, dtype=dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(cols)).to(device=device, dtype=dtype)
    y, s = (torch.full((rows, cols), float("nan"), dtype=dtype, device=device) for _ in range(2))
    _run(emu, code, {"in0": x, "in1": r, "e0": x, "e1": r, "e2": w, "y": y, "y1": s})
    want_s = x + r
    h = want_s.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    _sum_and_result_match(emu, code, dtype, s, want_s, y, want)
    with pytest.raises(ValueError, match="come from an epilogue's body"):
        row_reduction_kernel("bad", "mean", rows, cols, torch.float32, dtype, prologue=prologue, also=(("t0", dtype),))


@pytest.mark.parametrize("dtype", HALVES, ids=IDS)
@pytest.mark.parametrize("rows, cols", [(6, 768), (3, 64)], ids=["row-in-registers", "warp-per-row"])
def test_a_16_bit_layer_norm_stores_the_residual_sum_its_prologue_adds(where, dtype, rows, cols):
    # GPT-2's pre-norm: s = x + r (rounded to 16 bits) feeds the layer norm and the next residual; the norm's
    # kernel stores s as it loads it (keep_input).
    emu, device = where
    torch.manual_seed(cols + 2)
    round16 = _ROUND16[dtype]
    prologue = RowPrologue((rows, cols), [PointwiseInput("in0", dtype, (cols, 1)), PointwiseInput("in1", dtype, (cols, 1))],
                           [f"const float t0 = {round16.format('in0 + in1')};"], "t0")
    code = row_reduction_kernel("ln_res16", "layer_norm", rows, cols, dtype, has_weight=True, has_bias=True,
                                prologue=prologue, keep_input=dtype)
    assert "its input stored as computed" in code.description
    x, r = (torch.randn(rows, cols).to(device=device, dtype=dtype) for _ in range(2))
    w, b = (1 + 0.1 * torch.randn(cols)).to(device=device, dtype=dtype), (0.1 * torch.randn(cols)).to(device=device, dtype=dtype)
    y, s = (torch.full((rows, cols), float("nan"), dtype=dtype, device=device) for _ in range(2))
    _run(emu, code, {"in0": x, "in1": r, "weight": w, "bias": b, "y": y, "xs": s})
    want_s = x + r
    want = torch.nn.functional.layer_norm(want_s.float(), (cols,), w.float(), b.float(), 1e-5).to(dtype)
    _sum_and_result_match(emu, code, dtype, s, want_s, y, want)
    with pytest.raises(ValueError, match="stores what a prologue computes"):
        row_reduction_kernel("bad", "layer_norm", rows, cols, dtype, keep_input=dtype)
