"""2-D average and max pooling over NCHW input (and NHWC inside a channels-last chain), PyTorch's semantics exactly (ceil mode, count_include_pad,
divisor_override, NaN-propagating max), with the elementwise ops after it applied before the store.

Pooling moves bytes, nothing else: its floor is one read of the input and one write of the output at
DRAM bandwidth (3x3 stride-1 over 128x128x128x128 fp32: 2.15 GB, ~0.5 ms on an H200). Three things keep
a thread's work near that floor:

- each thread computes VEC (4) consecutive outputs of RH output rows (4 when windows overlap vertically,
  stride 1; else 1), so a warp's stores are contiguous along W and each input row a thread reads serves
  every one of its output rows that covers it (6 row reads for 4 output rows of a 3x3, not 12);
- per input row, the VEC outputs' shared input segment is loaded once into registers: in fp32 with W a
  multiple of 4, as 16-byte loads of the thread's own columns, the halo taken from the neighbouring lanes'
  registers by shuffles (a stride-1 3x3 row costs one 16-byte load and two shuffles for four outputs);
- loads are never branched around: padding takes the neutral value (0 for the average, -inf for the
  max), and the 16-byte loads read a clamped address unconditionally, so all loads of the unrolled
  window rows are in flight together.

Border windows need no special case: the neutral value changes no sum and no max.
The average divides by the count PyTorch uses (the window clipped to the padded input, or to the input
when count_include_pad is off, or divisor_override), summing in the order PyTorch sums. The max keeps a
NaN flag beside fmaxf, as PyTorch's max pool propagates NaN.
"""

from __future__ import annotations

import torch

from .common import CTYPE, PRELUDE, KernelCode, RowPrologue, images_extent, nhwc_pixel_loop

__all__ = ["POOL_MAX_TAPS", "POOL_DTYPES", "pool_output_size", "pooling_blocker", "pooling_kernel",
           "pooling_nhwc_kernel"]

POOL_MAX_TAPS = 64  # up to 8x8: every tap is unrolled
POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NEG_INF = "__int_as_float(0xff800000)"
# The 16-byte path holds every input row's values of a thread at once (all loads in flight): at most this
# many floats, so that the registers never spill (a 3x3 at stride 1 holds 36, an 8x8 at stride 1 88).
_HELD_VALUES = 96


def pool_output_size(size: int, kernel: int, stride: int, padding: int, dilation: int = 1,
                     ceil_mode: bool = False) -> int:
    """PyTorch's output extent of a pooling window: floor (or ceil) of the windows that fit the padded
    input, and in ceil mode the last window must start inside the input or its left padding."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def pooling_blocker(kind: str, x_shape: tuple[int, ...], kernel: tuple[int, int], stride: tuple[int, int],
                    padding: tuple[int, int], dilation: tuple[int, int], ceil_mode: bool,
                    dtype: torch.dtype) -> str | None:
    """None when the template computes this pooling, else why not (the Planner's reason for ATen)."""
    if kind not in ("avg", "max"):
        return f"{kind} pooling has no template"
    if len(x_shape) not in (3, 4):
        return f"a {len(x_shape)}-D input (the template pools [N, C, H, W] or [C, H, W])"
    if dtype not in POOL_DTYPES:
        return f"{dtype} pooling (the template reads fp32, fp16 and bf16)"
    if any(e == 0 for e in x_shape):
        return "an empty input"
    if len(kernel) != 2 or len(stride) != 2 or len(padding) != 2 or len(dilation) != 2:
        return "kernel, stride, padding and dilation must each give two sizes"
    if min(*kernel, *stride, *dilation) < 1 or min(padding) < 0:
        return f"kernel {kernel}, stride {stride}, padding {padding}, dilation {dilation}: sizes must be positive"
    if kernel[0] * kernel[1] > POOL_MAX_TAPS:
        return f"a {kernel[0]}x{kernel[1]} window (the template unrolls up to {POOL_MAX_TAPS} taps)"
    if any(p > k // 2 for k, p in zip(kernel, padding)):  # PyTorch refuses it too
        return f"padding {padding} is more than half the {kernel[0]}x{kernel[1]} window"
    h, w = x_shape[-2:]
    oh = pool_output_size(h, kernel[0], stride[0], padding[0], dilation[0], ceil_mode)
    ow = pool_output_size(w, kernel[1], stride[1], padding[1], dilation[1], ceil_mode)
    if oh <= 0 or ow <= 0:
        return f"a {h}x{w} input with a {kernel[0]}x{kernel[1]} window has an empty output"
    return None


def pooling_kernel(name: str, kind: str, x_shape: tuple[int, ...], kernel: tuple[int, int],
                   stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int] = (1, 1),
                   ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None,
                   dtype: torch.dtype = torch.float32, out_dtype: torch.dtype | None = None,
                   output: RowPrologue | None = None, sm_count: int = 132) -> KernelCode:
    """`kind` "avg" (aten::avg_pool2d) or "max" (aten::max_pool2d, the values of max_pool2d_with_indices)
    over a contiguous [N, C, H, W] (or [C, H, W]) input. An `output` function (the elementwise ops after
    the pooling) maps each result (`yv`) before the store, at the output's coordinates, so the pooled
    value is never stored. Arguments: x, [output inputs], y, total (the threads' output groups)."""
    why_not = pooling_blocker(kind, x_shape, kernel, stride, padding, dilation, ceil_mode, dtype)
    if why_not is not None:
        raise ValueError(f"{kind} pooling has no template here: {why_not}")
    if kind == "avg" and tuple(dilation) != (1, 1):
        raise ValueError("average pooling has no dilation (aten::avg_pool2d takes none)")
    if divisor_override is not None and (kind != "avg" or int(divisor_override) <= 0):
        raise ValueError(f"divisor_override={divisor_override!r}: a positive integer, and only for average pooling")
    if output is not None and output.extra != ("yv",):
        raise ValueError(f"an output function reads 'yv', got {output.extra}")
    out_dtype = out_dtype or dtype
    if out_dtype not in POOL_DTYPES:
        raise ValueError(f"{out_dtype} pooling output (the template writes fp32, fp16 and bf16)")
    rank = len(x_shape)
    n_, c_, h, w = (1, *x_shape) if rank == 3 else x_shape
    kh, kw = kernel
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    oh = pool_output_size(h, kh, sh, ph, dh, ceil_mode)
    ow = pool_output_size(w, kw, sw, pw, dw, ceil_mode)
    if output is not None and tuple(output.shape) != ((c_, oh, ow) if rank == 3 else (n_, c_, oh, ow)):
        raise ValueError(f"the output function's shape {output.shape} is not the pooled shape")

    vec = min(4, ow)
    # The 16-byte path: fp32, rows of a multiple of 4, four outputs per thread. A thread loads its own
    # columns [ox*sw, (ox+4)*sw) as `sw` float4s; the `left` values before them and the `right` after
    # them (the windows' overhang) come from the neighbouring lanes' registers.
    left = pw
    right = max(0, (kw - 1) * dw - pw - sw + 1)
    width = left + 4 * sw + right  # values a thread holds per input row
    # Output rows per thread: with stride 1 vertically, neighbouring output rows read all but one of the
    # same input rows, so a thread computing four of them reads each input row once for all four.
    rh = min(4, oh) if sh == 1 and kh > 1 else 1
    if ((rh - 1) * sh + (kh - 1) * dh + 1) * width > _HELD_VALUES:  # tall windows: one row, fewer registers
        rh = 1
    rows = (rh - 1) * sh + (kh - 1) * dh + 1  # input rows a thread reads
    seg = (vec - 1) * sw + (kw - 1) * dw + 1  # input values its VEC outputs read per input row
    owg, ohg = -(-ow // vec), -(-oh // rh)
    total = n_ * c_ * ohg * owg
    T, U = CTYPE[dtype], CTYPE[out_dtype]
    is_max = kind == "max"
    fill = _NEG_INF if is_max else "0.0f"

    wide = (dtype == torch.float32 and w % 4 == 0 and vec == 4 and left <= 4 and right <= 4 and sw <= 4
            and rows * width <= _HELD_VALUES)

    # `total`, the threads' output groups, is an argument: the batch is the launch's.
    params = [f"const {T}* __restrict__ x"] + (output.params() if output else []) + [f"{U}* __restrict__ y",
                                                                                     "long long total"]
    ix_t, sfx = ("unsigned", "u") if total < 2 ** 31 else ("long long", "LL")  # 32-bit division when it fits
    batch = "N" if rank == 4 else 1  # the comment: the source holds no batch
    coords = "c, oy, ox + {j}" if rank == 3 else "n, c, oy, ox + {j}"

    def head(g: str) -> list[str]:  # the thread's outputs: ox.. of rows oy0.., plane n * C + c
        L = [f"    const {ix_t} gi = ({ix_t}){g};",
             f"    const int ox = (int)(gi % {owg}{sfx}) * {vec};",
             f"    const {ix_t} rest = gi / {owg}{sfx};",
             f"    const int oy0 = (int)(rest % {ohg}{sfx}) * {rh};",
             f"    const {ix_t} nc = rest / {ohg}{sfx};  // n * C + c",
             f"    const {T}* xp = x + (long long)nc * {h * w}LL;",
             f"    float acc[{rh}][{vec}];"]
        if is_max:
            L.append(f"    bool bad[{rh}][{vec}];  // a NaN in the window: PyTorch's max pool returns NaN")
        L += ["#pragma unroll",
              f"    for (int i = 0; i < {rh}; ++i)",
              "#pragma unroll",
              f"      for (int j = 0; j < {vec}; ++j) {{ acc[i][j] = {fill};"
              + (" bad[i][j] = false;" if is_max else "") + " }"]
        return L

    combine = ("acc[i][j] = fmaxf(acc[i][j], e); bad[i][j] |= e != e;" if is_max else "acc[i][j] += e;")

    def taps(row: str) -> list[str]:  # input row t (values `row`[0..seg)) into every output row covering it
        return ["#pragma unroll",
                f"      for (int i = 0; i < {rh}; ++i) {{",
                f"        const int r = t - i * {sh};  // this input row is row r of output row oy0 + i's window",
                f"        if (r < 0 || r > {(kh - 1) * dh} || r % {dh} != 0) continue;  // decided when unrolled",
                "#pragma unroll",
                f"        for (int q = 0; q < {kw}; ++q) {{",
                "#pragma unroll",
                f"          for (int j = 0; j < {vec}; ++j) {{ const float e = {row}[j * {sw} + q * {dw}]; {combine} }}",
                "        }",
                "      }"]

    # The divisor of each average: PyTorch's count of the window clipped to the padded input (or to the
    # input without count_include_pad), or divisor_override; constant where no window is ever clipped.
    divisor: list[str] = []
    if is_max:
        result = "(bad[i][{j}] ? __int_as_float(0x7fc00000) : acc[i][{j}])"
    elif divisor_override is not None:
        result = f"(acc[i][{{j}}] / {float(int(divisor_override))!r}f)"
    elif (count_include_pad or ph == pw == 0) and not ceil_mode:
        result = f"(acc[i][{{j}}] / {float(kh * kw)!r}f)"
    else:
        lim_h, lim_w = (h + ph, w + pw) if count_include_pad else (h, w)
        lo = (lambda s: s) if count_include_pad else (lambda s: f"({s} > 0 ? {s} : 0)")
        divisor = [f"    int rows_in[{rh}], cols_in[{vec}];  // the window's extent PyTorch counts",
                   "#pragma unroll",
                   f"    for (int i = 0; i < {rh}; ++i) {{ const int s = (oy0 + i) * {sh} - {ph}; "
                   f"rows_in[i] = (s + {kh} < {lim_h} ? s + {kh} : {lim_h}) - {lo('s')}; }}",
                   "#pragma unroll",
                   f"    for (int j = 0; j < {vec}; ++j) {{ const int s = (ox + j) * {sw} - {pw}; "
                   f"cols_in[j] = (s + {kw} < {lim_w} ? s + {kw} : {lim_w}) - {lo('s')}; }}"]
        result = "(acc[i][{j}] / (float)(rows_in[i] * cols_in[{j}]))"

    def value(j) -> str:  # the stored value of output (oy0 + i, ox + j)
        v = result.format(j=j)
        return v if output is None else f"{name}_oc({coords.format(j=j)}, {v}{output.pointers()})"

    def store(valid: str | None) -> list[str]:
        L = list(divisor)
        if output is not None:
            L += [f"    const long long c = (long long)(nc % {c_}{sfx});"]
            if rank == 4:
                L += [f"    const long long n = (long long)(nc / {c_}{sfx});"]
        if valid:
            L.append(f"    if ({valid}) {{")
        L += ["#pragma unroll",
              f"    for (int i = 0; i < {rh}; ++i) {{",
              "      const int oy = oy0 + i;"]
        if oh % rh:
            L.append(f"      if (oy >= {oh}) break;  // the last rows of a plane: fewer than {rh}")
        L.append(f"      const long long o = (long long)nc * {oh * ow}LL + (long long)oy * {ow} + ox;")
        scalar = ["#pragma unroll",
                  f"      for (int j = 0; j < {vec}; ++j) " + (f"if (ox + j < {ow}) " if ow % vec else "")
                  + f"st(y, o + j, {value('j')});"]
        if out_dtype == torch.float32 and vec == 4 and ow % 4 == 0:
            L += ["      if (wide_y) {",
                  "        *reinterpret_cast<float4*>(y + o) = make_float4("
                  + ", ".join(value(j) for j in range(4)) + ");",
                  "      } else {", *[s if s.startswith("#") else "  " + s for s in scalar], "      }"]
        else:
            L += scalar
        L.append("    }")
        if valid:
            L.append("    }")
        return L

    # The general path: per input row, the segment's values one predicated load each (the neutral value
    # where the column or row is outside the input; the compiler predicates, no branch), then the taps.
    generic = ["  for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < total; "
               "g += (long long)gridDim.x * blockDim.x) {",
               *head("g"),
               "#pragma unroll",
               f"    for (int t = 0; t < {rows}; ++t) {{",
               f"      const int iy = oy0 * {sh} - {ph} + t;",
               f"      const bool row_in = iy >= 0 && iy < {h};",
               f"      float v[{seg}];  // input columns ox * {sw} - {pw} + k",
               "#pragma unroll",
               f"      for (int k = 0; k < {seg}; ++k) {{",
               f"        const int ix = ox * {sw} - {pw} + k;",
               f"        v[k] = (row_in && ix >= 0 && ix < {w}) ? ld(xp, (long long)iy * {w} + ix) : {fill};",
               "      }",
               *taps("v"),
               "    }",
               *store(None),
               "  }"]
    how = "each input row's segment loaded once"
    L = [PRELUDE, *(output.coordinate_function(name) if output else []),
         f"// {name}: {kind} pooling {kh}x{kw} (stride {sh}x{sw}, padding {ph}x{pw}, dilation {dh}x{dw}"
         + (", ceil mode" if ceil_mode else "")
         + ("" if is_max else ", padding counted" if count_include_pad else ", padding not counted")
         + (f", divisor {divisor_override}" if divisor_override is not None else "")
         + f") over [{batch}, {c_}, {h}, {w}] -> [{batch}, {c_}, {oh}, {ow}], {rh}x{vec} outputs per thread",
         f'extern "C" __global__ void __launch_bounds__(256) {name}({", ".join(params)}) {{']
    if out_dtype == torch.float32 and vec == 4 and ow % 4 == 0:
        L.append("  const bool wide_y = (reinterpret_cast<unsigned long long>(y) & 15ULL) == 0;")
    if wide:
        cols = 4 * sw  # the thread's own input columns, v[t][left .. left + cols)
        comp = "xyzw"
        # Every row's own columns first: one 16-byte load per float4, unconditional, from a clamped address
        # (a padding row or columns past the end read data that exists, and take the neutral value instead),
        # so the loads of all rows share one basic block and are in flight together.
        def row_head() -> list[str]:
            return ["#pragma unroll",
                    f"    for (int t = 0; t < {rows}; ++t) {{",
                    f"      const int iy = oy0 * {sh} - {ph} + t;",
                    f"      const bool row_in = iy >= 0 && iy < {h};",
                    f"      const {T}* row = xp + (long long)(iy < 0 ? 0 : iy < {h} ? iy : {h - 1}) * {w};"]

        loads = row_head()
        for k in range(sw):
            loads += [f"      {{ const int cx = ox * {sw} + {4 * k};  // inside the row or wholly past it",
                      f"        const float4 q = *reinterpret_cast<const float4*>(row + (cx < {w} ? cx : {w - 4}));",
                      f"        const bool in = row_in && cx < {w};",
                      "        " + " ".join(f"v[t][{left + 4 * k + j}] = in ? q.{comp[j]} : {fill};" for j in range(4))
                      + " }"]
        loads.append("    }")
        # The halo values no neighbour holds (lanes 0 and 31 of the warp, the ends of an output row): loaded
        # by the few lanes that need them.
        if left or right:
            loads += row_head()
            for k in range(left):  # column ox*sw - left + k
                loads += [f"      {{ const int ix = ox * {sw} - {left - k};",
                          f"        v[t][{k}] = (!from_left && row_in && ix >= 0) ? row[ix] : {fill}; }}"]
            for k in range(right):  # column (ox + 4)*sw + k
                loads += [f"      {{ const int ix = ox * {sw} + {cols + k};",
                          f"        v[t][{left + cols + k}] = (!from_right && row_in && ix < {w}) ? row[ix] : {fill}; }}"]
            loads.append("    }")
        # Then the halo from the neighbours' registers: the left lane's columns cols - left + k, the right
        # lane's columns k. Every lane shuffles; a lane keeps the value when its neighbour holds the
        # next outputs of the same row.
        halo = []
        if left or right:
            halo = ["#pragma unroll", f"    for (int t = 0; t < {rows}; ++t) {{"]
            for k in range(left):
                halo.append(f"      {{ const float nb = __shfl_up_sync(0xffffffffu, v[t][{cols + k}], 1); "
                            f"if (from_left) v[t][{k}] = nb; }}")
            for k in range(right):
                halo.append(f"      {{ const float nb = __shfl_down_sync(0xffffffffu, v[t][{left + k}], 1); "
                            f"if (from_right) v[t][{left + cols + k}] = nb; }}")
            halo.append("    }")
        L += [f"  const bool wide = (reinterpret_cast<unsigned long long>(x) & 15ULL) == 0;",
              "  if (wide) {",
              # Whole warps iterate together (the halo comes through shuffles): lanes past the end compute
              # the last outputs again and store nothing.
              "  const int lane = threadIdx.x & 31;",
              "  for (long long g0 = blockIdx.x * (long long)blockDim.x + (threadIdx.x & ~31); "
              "g0 < total; g0 += (long long)gridDim.x * blockDim.x) {",
              "    const bool valid = g0 + lane < total;",
              "    const long long g = valid ? g0 + lane : total - 1;",
              *head("g"),
              "    const bool from_left = lane != 0 && ox > 0;  // the left lane holds outputs ox - 4 of this row",
              f"    const bool from_right = lane != 31 && ox + 4 < {ow};  // the right lane holds ox + 4",
              f"    float v[{rows}][{left + cols + right}];  // input row oy0 * {sh} - {ph} + t, columns ox * {sw} - {pw} + k",
              *loads, *halo,
              "#pragma unroll",
              f"    for (int t = 0; t < {rows}; ++t) {{",
              *taps("v[t]"),
              "    }",
              *store("valid"),
              "  }",
              "  return;",
              "  }"]
        how = (f"{sw} 16-byte load(s) per input row"
               + (f", {left + right} halo value(s) from neighbouring lanes' registers" if left + right else ""))
    L += generic + ["}"]
    threads = 256
    grid = max(1, min(-(-total // threads), sm_count * 16))
    args = [("in", "x")] + ([("in", i.key) for i in output.inputs] if output else []) + [("out", "y"), ("i64", total)]
    extent = None if rank == 3 else images_extent(total, args, c_ * ohg * owg, threads, sm_count * 16, output,
                                                  2 ** 31 - 1 if total < 2 ** 31 else 0)
    return KernelCode("\n".join(L) + "\n", name, grid, threads, args, extent=extent, description=
                      f"{kind} pooling {kh}x{kw} over {list(x_shape)}, {rh}x{vec} outputs per thread, {how}"
                      + (f", {len(output.body)} elementwise op(s) applied before the store" if output else ""))


def pooling_nhwc_kernel(name: str, kind: str, x_shape: tuple[int, ...], kernel: tuple[int, int],
                        stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int] = (1, 1),
                        ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None,
                        output: RowPrologue | None = None, sm_count: int = 132) -> KernelCode:
    """Pooling inside a channels-last convolution chain: an fp32 [N, C, H, W] input stored NHWC, channels a
    multiple of 4, the result stored NHWC. Each thread pools four consecutive channels of one output pixel:
    every tap of its window is one 16-byte load (adjacent threads read adjacent channels), with PyTorch's
    semantics as pooling_kernel's (the neutral value for padding, the divisor PyTorch counts, a NaN in a
    max window returned), and the `output` function applied before one 16-byte store; max_pool2d's indices
    are never written. Arguments: x, [output inputs], y, total (the threads' groups of four channels)."""
    why_not = pooling_blocker(kind, x_shape, kernel, stride, padding, dilation, ceil_mode, torch.float32)
    if why_not is None and (len(x_shape) != 4 or x_shape[1] % 4):
        why_not = "the channels-last template pools [N, C, H, W] with channels in multiples of 4"
    if why_not is None and kind == "avg" and tuple(dilation) != (1, 1):
        why_not = "average pooling has no dilation"
    if why_not is not None:
        raise ValueError(f"{kind} pooling has no channels-last template here: {why_not}")
    if output is not None and output.extra != ("yv",):
        raise ValueError(f"an output function reads 'yv', got {output.extra}")
    n_, c_, h, w = x_shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    oh = pool_output_size(h, kh, sh, ph, dh, ceil_mode)
    ow = pool_output_size(w, kw, sw, pw, dw, ceil_mode)
    is_max = kind == "max"
    c4 = c_ // 4
    total = n_ * oh * ow * c4
    comp = "xyzw"
    if is_max:
        divide = None
    elif divisor_override is not None:
        divide = f"{float(int(divisor_override))!r}f"
    elif (count_include_pad or ph == pw == 0) and not ceil_mode:
        divide = f"{float(kh * kw)!r}f"
    else:  # the window clipped to the padded input (or to the input), as PyTorch counts it
        lim_h, lim_w = (h + ph, w + pw) if count_include_pad else (h, w)
        lo = (lambda v: v) if count_include_pad else (lambda v: f"({v} > 0 ? {v} : 0)")
        divide = (f"(float)(((hs + {kh} < {lim_h} ? hs + {kh} : {lim_h}) - {lo('hs')}) * "
                  f"((ws + {kw} < {lim_w} ? ws + {kw} : {lim_w}) - {lo('ws')}))")

    def value(j: int) -> str:
        v = f"(bad{j} ? __int_as_float(0x7fc00000) : acc.{comp[j]})" if is_max else f"(acc.{comp[j]} / {divide})"
        return v if output is None else f"{name}_oc(n, c + {j}, oy, ox, {v}{output.pointers()})"

    fill = _NEG_INF if is_max else "0.0f"
    combine = (lambda j: f"acc.{comp[j]} = fmaxf(acc.{comp[j]}, v.{comp[j]}); bad{j} |= v.{comp[j]} != v.{comp[j]};") \
        if is_max else (lambda j: f"acc.{comp[j]} += v.{comp[j]};")
    params = ["const float* __restrict__ x"] + (output.params() if output else []) + ["float* __restrict__ y",
                                                                                     "long long total"]
    L = [PRELUDE, *(output.coordinate_function(name) if output else []),
         f"// {name}: {kind} pooling {kh}x{kw} (stride {sh}x{sw}, padding {ph}x{pw}, dilation {dh}x{dw}"
         + (", ceil mode" if ceil_mode else "") + f") over NHWC [N, {c_}, {h}, {w}] -> NHWC [N, {c_}, {oh}, {ow}], "
         "four channels per thread",
         f'extern "C" __global__ void __launch_bounds__(256) {name}({", ".join(params)}) {{',
         *nhwc_pixel_loop(c4, oh, ow),
         f"    const int hs = oy * {sh} - {ph}, ws = ox * {sw} - {pw};  // the window's first row and column",
         f"    float4 acc = make_float4({fill}, {fill}, {fill}, {fill});",
         *(["    bool bad0 = false, bad1 = false, bad2 = false, bad3 = false;"] if is_max else []),
         "#pragma unroll",
         f"    for (int r = 0; r < {kh}; ++r) {{",
         f"      const int iy = hs + r * {dh};",
         "#pragma unroll",
         f"      for (int q = 0; q < {kw}; ++q) {{",
         f"        const int ix = ws + q * {dw};",
         f"        if (iy < 0 || iy >= {h} || ix < 0 || ix >= {w}) continue;  // padding: the neutral value",
         f"        const float4 v = *reinterpret_cast<const float4*>(x + ((n * {h} + iy) * {w}LL + ix) * {c_}LL + c);",
         *[f"        {combine(j)}" for j in range(4)],
         "      }",
         "    }",
         f"    *reinterpret_cast<float4*>(y + ((n * {oh} + oy) * {ow}LL + ox) * {c_}LL + c) = make_float4("
         + ", ".join(value(j) for j in range(4)) + ");",
         "  }",
         "}"]
    grid = max(1, min(-(-total // 256), sm_count * 16))
    args = [("in", "x")] + ([("in", i.key) for i in output.inputs] if output else []) + [("out", "y"), ("i64", total)]
    extent = images_extent(total, args, oh * ow * c4, 256, sm_count * 16, output)
    return KernelCode("\n".join(L) + "\n", name, grid, 256, args, extent=extent, description=
                      f"{kind} pooling {kh}x{kw} over NHWC [{n_}, {c_}, {h}, {w}], four channels per thread, 16-byte "
                      "loads and stores along the channels"
                      + (f", {len(output.body)} elementwise op(s) applied before the store" if output else ""))
