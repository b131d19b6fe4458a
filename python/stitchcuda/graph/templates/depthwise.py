"""Depthwise 2-D convolution: one filter per channel, the ops after it applied before the store."""

from __future__ import annotations

import torch

from .common import CTYPE, PRELUDE, KernelCode, RowPrologue, images_extent, nhwc_pixel_loop


DEPTHWISE_MAX_TAPS = 49  # up to 7x7: the taps are unrolled


def _output_size(h: int, w: int, kernel, stride, padding, dilation, output: RowPrologue | None) -> tuple[int, int]:
    """The output's height and width; ValueError for a geometry no template takes (more than
    DEPTHWISE_MAX_TAPS taps, a non-positive size, an empty output) or an output function that does not
    read `yv`."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    if kh * kw > DEPTHWISE_MAX_TAPS or min(kh, kw, sh, sw, dh, dw) < 1 or min(ph, pw) < 0:
        raise ValueError(f"depthwise convolution of kernel {kernel}, stride {stride}, padding {padding}, "
                         f"dilation {dilation} has no template (up to {DEPTHWISE_MAX_TAPS} taps, positive sizes)")
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if oh <= 0 or ow <= 0:
        raise ValueError(f"depthwise convolution of a {h}x{w} input with kernel {kernel} has an empty output")
    if output is not None and output.extra != ("yv",):
        raise ValueError(f"an output function reads 'yv', got {output.extra}")
    return oh, ow


def depthwise_conv_kernel(name: str, x_shape: tuple[int, int, int, int], kernel: tuple[int, int],
                          stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                          dtype: torch.dtype, out_dtype: torch.dtype | None = None, has_bias: bool = False,
                          output: RowPrologue | None = None, sm_count: int = 132) -> KernelCode:
    """A 2-D convolution with one filter per channel (groups = in = out channels, a [C, 1, kh, kw] weight)
    over a contiguous NCHW input, accumulated in fp32. Each thread computes VEC consecutive outputs of one
    output row: per filter row it loads the input segment those outputs share once (VEC + kw - 1 values at
    stride 1) and applies every tap from registers. An `output` function (a batch norm and activation after
    the convolution) maps each result (`yv`) before the store, so the convolution's output is never stored.
    Arguments: x, weight, [bias], [output inputs], y, n (the number of outputs)."""
    n_, c_, h, w = x_shape
    kh, kw = kernel
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    oh, ow = _output_size(h, w, kernel, stride, padding, dilation, output)
    out_dtype = out_dtype or dtype
    vec = 4 if ow % 4 == 0 else (2 if ow % 2 == 0 else 1)
    seg = (vec - 1) * sw + (kw - 1) * dw + 1  # input values a thread's VEC outputs read per filter row
    owv = ow // vec
    total = n_ * c_ * oh * owv
    T, U = CTYPE[dtype], CTYPE[out_dtype]
    params = [f"const {T}* __restrict__ x", f"const {T}* __restrict__ wt"]
    if has_bias:
        params.append(f"const {T}* __restrict__ bias")
    if output:
        params += output.params()
    params += [f"{U}* __restrict__ y", "long long n"]
    # The output function at the output's coordinates (n, c, oy, ox + j): its per-channel operands are
    # read once for a thread's outputs.
    value = (lambda j, v: v) if output is None else \
        (lambda j, v: f"{name}_oc(n, c, oy, ox + {j}, {v}{output.pointers()})")
    right = kw - 1 - pw  # halo to the right of a thread's four outputs (stride 1, same width)
    # The common case (stride 1, no dilation, fp32, "same" width, a multiple of 4): each thread loads its
    # four inputs of a filter row with one 16-byte load and takes the halo from its neighbours' registers.
    shuffled = (dtype == torch.float32 and (sh, sw, dh, dw) == (1, 1, 1, 1) and vec == 4 and ow == w
                and 0 <= pw <= 4 and 0 <= right <= 4)
    init = "ld(bias, c)" if has_bias else "0.0f"

    ix_t, sfx = ("unsigned", "u") if total < 2 ** 31 else ("long long", "LL")  # 32-bit division when it fits

    def head(g: str) -> list[str]:  # coordinates of the thread's outputs, its planes, accumulators
        return [f"    const {ix_t} gi = ({ix_t}){g};",
                f"    const int ox = (int)(gi % {owv}{sfx}) * {vec};",
                f"    const {ix_t} rest = gi / {owv}{sfx};",
                f"    const int oy = (int)(rest % {oh}{sfx});",
                f"    const {ix_t} nc = rest / {oh}{sfx};  // n * C + c",
                "    const long long plane = (long long)nc;",
                f"    const int c = (int)(nc % {c_}{sfx});",
                f"    const long long n = (long long)(nc / {c_}{sfx});",
                f"    const {T}* xp = x + plane * {h * w}LL;",
                f"    const {T}* wp = wt + c * {kh * kw};",
                f"    float acc[{vec}];",
                "#pragma unroll",
                f"    for (int j = 0; j < {vec}; ++j) acc[j] = {init};",
                "#pragma unroll",
                f"    for (int r = 0; r < {kh}; ++r) {{",
                f"      const int iy = oy * {sh} - {ph} + r * {dh};",
                # Predicated loads, no branch around a row: every load of the unrolled taps stays in one
                # basic block, all in flight together.
                f"      const bool row_in = iy >= 0 && iy < {h};",
                f"      float in[{seg}];"]

    taps = ["#pragma unroll",
            f"      for (int q = 0; q < {kw}; ++q) {{",
            f"        const float tap = ld(wp, r * {kw} + q);",
            "#pragma unroll",
            f"        for (int j = 0; j < {vec}; ++j) acc[j] += tap * in[j * {sw} + q * {dw}];",
            "      }",
            "    }",
            f"    const long long o = plane * {oh * ow}LL + (long long)oy * {ow} + ox;"]
    generic = ["  for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < total; "
               "g += (long long)gridDim.x * blockDim.x) {",
               *head("g"),
               f"      const int x0 = ox * {sw} - {pw};",
               "#pragma unroll",
               f"      for (int k = 0; k < {seg}; ++k) {{",
               "        const int ix = x0 + k;",
               f"        in[k] = (row_in && ix >= 0 && ix < {w}) ? ld(xp, (long long)iy * {w} + ix) : 0.0f;",
               "      }",
               *taps,
               "#pragma unroll",
               f"    for (int j = 0; j < {vec}; ++j) st(y, o + j, {value('j', 'acc[j]')});",
               "  }"]
    L = [PRELUDE, *(output.coordinate_function(name) if output else []),
         f"// {name}: depthwise {kh}x{kw} convolution (stride {sh}x{sw}, padding {ph}x{pw}, dilation {dh}x{dw}) "
         f"over [N, {c_}, {h}, {w}] -> [N, {c_}, {oh}, {ow}], {vec} output(s) per thread",
         f'extern "C" __global__ void __launch_bounds__(256) {name}({", ".join(params)}) {{',
         f"  const long long total = n / {vec};  // the threads' groups of {vec} outputs: the batch is n's"]
    if shuffled:
        comp = "xyzw"
        wide_ptrs = ["x"] + (["y"] if out_dtype == torch.float32 else [])
        aligned = " | ".join(f"reinterpret_cast<unsigned long long>({p})" for p in wide_ptrs)
        left_halo, right_halo = [], []
        for k in range(pw):  # input ox - pw + k: the left neighbour's component 4 - pw + k
            left_halo += [f"      {{ const float nb = __shfl_up_sync(0xffffffffu, mid.{comp[4 - pw + k]}, 1);",
                          f"        const int ix = ox - {pw - k};",
                          f"        in[{k}] = ix < 0 ? 0.0f : lane != 0 ? nb : (row_in ? xp[(long long)iy * {w} + ix] : 0.0f); }}"]
        for k in range(right):  # input ox + 4 + k: the right neighbour's component k
            right_halo += [f"      {{ const float nb = __shfl_down_sync(0xffffffffu, mid.{comp[k]}, 1);",
                           f"        const int ix = ox + {4 + k};",
                           f"        in[{pw + 4 + k}] = ix >= {w} ? 0.0f : lane != 31 ? nb : "
                           f"(row_in ? xp[(long long)iy * {w} + ix] : 0.0f); }}"]
        store = (["      *reinterpret_cast<float4*>(y + o) = make_float4("
                  + ", ".join(value(str(j), f"acc[{j}]") for j in range(4)) + ");"]
                 if out_dtype == torch.float32 else
                 ["#pragma unroll", f"      for (int j = 0; j < 4; ++j) st(y, o + j, {value('j', 'acc[j]')});"])
        L += [f"  const bool wide = (({aligned}) & 15ULL) == 0;",
              "  if (wide) {",
              # Whole warps iterate together (the halo comes through shuffles): lanes past the end compute
              # the last group again and store nothing.
              "  const int lane = threadIdx.x & 31;",
              "  for (long long g0 = blockIdx.x * (long long)blockDim.x + (threadIdx.x & ~31); "
              "g0 < total; g0 += (long long)gridDim.x * blockDim.x) {",
              "    const bool valid = g0 + lane < total;",
              "    const long long g = valid ? g0 + lane : total - 1;",
              *head("g"),
              f"      const float4 mid = row_in ? *reinterpret_cast<const float4*>(xp + (long long)iy * {w} + ox)"
              " : make_float4(0.0f, 0.0f, 0.0f, 0.0f);",
              *[f"      in[{pw + j}] = mid.{comp[j]};" for j in range(4)],
              *left_halo, *right_halo,
              *taps,
              "    if (valid) {", *store, "    }",
              "  }",
              "  return;",
              "  }"]
    L += generic + ["}"]
    how = ("one 16-byte load per filter row, the halo from neighbouring lanes' registers" if shuffled
           else "each filter row's input segment loaded once")
    threads = 256
    grid = max(1, min(-(-total // threads), sm_count * 16))
    args = [("in", "x"), ("in", "weight")] + ([("in", "bias")] if has_bias else [])
    args += [("in", i.key) for i in output.inputs] if output else []
    args += [("out", "y"), ("i64", n_ * c_ * oh * ow)]
    # n, the outputs, gives the batch: a 32-bit index while the groups number below 2^31.
    extent = images_extent(n_ * c_ * oh * ow, args, c_ * oh * ow, threads * vec, sm_count * 16, output,
                           ((2 ** 31 - 1) * vec) if total < 2 ** 31 else 0)
    return KernelCode("\n".join(L) + "\n", name, grid, threads, args, extent=extent, description=
                      f"depthwise {kh}x{kw} convolution over [{n_}, {c_}, {h}, {w}], {vec} outputs per thread, "
                      f"{how}"
                      + (f", {len(output.body)} elementwise op(s) applied before the store" if output else ""))


def depthwise_conv_nhwc_kernel(name: str, x_shape: tuple[int, int, int, int], kernel: tuple[int, int],
                               stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                               has_bias: bool = False, output: RowPrologue | None = None,
                               sm_count: int = 132) -> KernelCode:
    """The depthwise convolution of a channels-last chain: fp32 input and output stored NHWC (a MobileNet
    block between two 1x1 convolutions that cuDNN runs on NHWC data), channels a multiple of 4. Each thread
    computes four consecutive channels of one output pixel: every tap is one 16-byte load of the four
    channels' inputs (adjacent threads read adjacent channels: coalesced), the weights' four taps come from
    the [C, 1, kh, kw] filter, and the `output` function (batch norm, activation) applies before one 16-byte
    store. Arguments as depthwise_conv_kernel's."""
    n_, c_, h, w = x_shape
    kh, kw = kernel
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    if c_ % 4:
        raise ValueError(f"the channels-last depthwise template takes channels in multiples of 4, not {c_}")
    oh, ow = _output_size(h, w, kernel, stride, padding, dilation, output)
    c4 = c_ // 4
    total = n_ * oh * ow * c4
    params = ["const float* __restrict__ x", "const float* __restrict__ wt"]
    if has_bias:
        params.append("const float* __restrict__ bias")
    if output:
        params += output.params()
    params += ["float* __restrict__ y", "long long n"]
    value = (lambda j, v: v) if output is None else \
        (lambda j, v: f"{name}_oc(n, c + {j}, oy, ox, {v}{output.pointers()})")
    init = (lambda j: f"bias[c + {j}]") if has_bias else (lambda j: "0.0f")
    comp = "xyzw"
    L = [PRELUDE, *(output.coordinate_function(name) if output else []),
         f"// {name}: depthwise {kh}x{kw} convolution (stride {sh}x{sw}, padding {ph}x{pw}, dilation {dh}x{dw}) "
         f"over NHWC [N, {c_}, {h}, {w}] -> NHWC [N, {c_}, {oh}, {ow}], four channels per thread",
         f'extern "C" __global__ void __launch_bounds__(256) {name}({", ".join(params)}) {{',
         "  const long long total = n / 4;  // the threads' groups of four channels: the batch is n's",
         *nhwc_pixel_loop(c4, oh, ow),
         "    float acc[4] = {" + ", ".join(init(j) for j in range(4)) + "};",
         "#pragma unroll",
         f"    for (int r = 0; r < {kh}; ++r) {{",
         f"      const int iy = oy * {sh} - {ph} + r * {dh};",
         "#pragma unroll",
         f"      for (int q = 0; q < {kw}; ++q) {{",
         f"        const int ix = ox * {sw} - {pw} + q * {dw};",
         f"        const bool in = iy >= 0 && iy < {h} && ix >= 0 && ix < {w};",
         f"        const float4 v = in ? *reinterpret_cast<const float4*>(x + ((n * {h} + iy) * {w}LL + ix) * {c_}LL + c)"
         " : make_float4(0.0f, 0.0f, 0.0f, 0.0f);",
         *[f"        acc[{j}] += wt[(c + {j}) * {kh * kw} + r * {kw} + q] * v.{comp[j]};" for j in range(4)],
         "      }",
         "    }",
         f"    *reinterpret_cast<float4*>(y + ((n * {oh} + oy) * {ow}LL + ox) * {c_}LL + c) = make_float4("
         + ", ".join(value(str(j), f"acc[{j}]") for j in range(4)) + ");",
         "  }",
         "}"]
    grid = max(1, min(-(-total // 256), sm_count * 16))
    args = [("in", "x"), ("in", "weight")] + ([("in", "bias")] if has_bias else [])
    args += [("in", i.key) for i in output.inputs] if output else []
    args += [("out", "y"), ("i64", n_ * c_ * oh * ow)]
    extent = images_extent(n_ * c_ * oh * ow, args, c_ * oh * ow, 4 * 256, sm_count * 16, output)
    return KernelCode("\n".join(L) + "\n", name, grid, 256, args, extent=extent, description=
                      f"depthwise {kh}x{kw} convolution over NHWC [{n_}, {c_}, {h}, {w}], four channels per thread, "
                      "16-byte loads and stores along the channels"
                      + (f", {len(output.body)} elementwise op(s) applied before the store" if output else ""))
