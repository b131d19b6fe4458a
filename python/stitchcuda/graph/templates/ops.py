"""The elementwise ops a pointwise body can hold, each as the C expression it becomes over float values."""

from __future__ import annotations

import math
from typing import Callable

def float_literal(x: float) -> str:
    x = float(x)
    if math.isnan(x):
        return "__int_as_float(0x7fc00000)"
    if math.isinf(x):
        return "__int_as_float(0x7f800000)" if x > 0 else "__int_as_float(0xff800000)"
    return f"{x!r}f"


def scalar_literal(a) -> str | None:
    if isinstance(a, bool):
        return "1.0f" if a else "0.0f"
    if isinstance(a, (int, float)):
        return float_literal(a)
    return None


# Each entry: (op name, function of (args as C expressions or Python scalars, kwargs) -> C expression).
def _binary(fmt: str) -> Callable:
    def emit(a, kw):
        x, y = a[0], a[1]
        alpha = kw.get("alpha", a[2] if len(a) > 2 else None)
        if alpha not in (1, 1.0, None, "1.0f"):
            y = f"({alpha if isinstance(alpha, str) else float_literal(alpha)} * {y})"
        return fmt.format(x=x, y=y)
    return emit


def _unary(fmt: str) -> Callable:
    return lambda a, kw: fmt.format(x=a[0])


def _gelu(a, kw):
    approximate = kw.get("approximate", a[1] if len(a) > 1 else "none")
    x = a[0]
    if approximate == "tanh":
        return f"(0.5f * {x} * (1.0f + tanhf(0.7978845608028654f * ({x} + 0.044715f * {x} * {x} * {x}))))"
    return f"({x} * 0.5f * (1.0f + erff({x} * 0.7071067811865476f)))"


def _clamp(a, kw):
    x = a[0]
    lo = kw.get("min", a[1] if len(a) > 1 else None)
    hi = kw.get("max", a[2] if len(a) > 2 else None)
    if lo is not None:
        x = f"nanmax({x}, {lo})"
    if hi is not None:
        x = f"nanmin({x}, {hi})"
    return x


def _pow(a, kw):
    e = a[1]
    if e in ("2.0f", "2"):
        return f"({a[0]} * {a[0]})"
    if e in ("0.5f",):
        return f"sqrtf({a[0]})"
    return f"powf({a[0]}, {e})"


def _where(a, kw):
    return f"(({a[0]}) != 0.0f ? ({a[1]}) : ({a[2]}))"


def _hardtanh(a, kw):
    lo = a[1] if len(a) > 1 else "-1.0f"
    hi = a[2] if len(a) > 2 else "1.0f"
    return f"nanmin(nanmax({a[0]}, {lo}), {hi})"


def _leaky(a, kw):
    slope = a[1] if len(a) > 1 else kw.get("negative_slope", "0.01f")
    return f"({a[0]} > 0.0f ? {a[0]} : {a[0]} * {slope})"


def _batch_norm(a, kw):
    # _native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps)
    x, w, b, mean, var = a[0], a[1], a[2], a[3], a[4]
    eps = a[6] if len(a) > 6 else kw.get("eps", "1e-05f")
    y = f"(({x} - {mean}) * rsqrtf({var} + {eps}))"
    if w not in (None, "None"):
        y = f"({y} * {w})"
    if b not in (None, "None"):
        y = f"({y} + {b})"
    return y


POINTWISE_OPS: dict[str, Callable] = {
    "aten::add.Tensor": _binary("({x} + {y})"), "aten::add.Scalar": _binary("({x} + {y})"),
    "aten::sub.Tensor": _binary("({x} - {y})"), "aten::sub.Scalar": _binary("({x} - {y})"),
    "aten::rsub.Scalar": _binary("({y} - {x})"),
    "aten::mul.Tensor": _binary("({x} * {y})"), "aten::mul.Scalar": _binary("({x} * {y})"),
    "aten::div.Tensor": _binary("({x} / {y})"), "aten::div.Scalar": _binary("({x} / {y})"),
    "aten::maximum": _binary("nanmax({x}, {y})"), "aten::minimum": _binary("nanmin({x}, {y})"),
    "aten::neg": _unary("(-{x})"), "aten::relu": _unary("({x} != {x} ? {x} : fmaxf({x}, 0.0f))"),
    "aten::sigmoid": _unary("(1.0f / (1.0f + expf(-{x})))"), "aten::tanh": _unary("tanhf({x})"),
    "aten::exp": _unary("expf({x})"), "aten::log": _unary("logf({x})"), "aten::log1p": _unary("log1pf({x})"),
    "aten::expm1": _unary("expm1f({x})"), "aten::sqrt": _unary("sqrtf({x})"), "aten::rsqrt": _unary("rsqrtf({x})"),
    "aten::abs": _unary("fabsf({x})"), "aten::sin": _unary("sinf({x})"), "aten::cos": _unary("cosf({x})"),
    "aten::erf": _unary("erff({x})"), "aten::reciprocal": _unary("(1.0f / {x})"),
    "aten::floor": _unary("floorf({x})"), "aten::ceil": _unary("ceilf({x})"), "aten::trunc": _unary("truncf({x})"),
    "aten::silu": _unary("({x} / (1.0f + expf(-{x})))"), "aten::gelu": _gelu,
    "aten::clamp": _clamp, "aten::clamp_min": lambda a, kw: f"nanmax({a[0]}, {a[1]})",
    "aten::clamp_max": lambda a, kw: f"nanmin({a[0]}, {a[1]})",
    "aten::pow.Tensor_Scalar": _pow, "aten::pow.Tensor_Tensor": lambda a, kw: f"powf({a[0]}, {a[1]})",
    "aten::where.self": _where, "aten::hardtanh": _hardtanh, "aten::leaky_relu": _leaky,
    "aten::eq.Tensor": _binary("(float)({x} == {y})"), "aten::eq.Scalar": _binary("(float)({x} == {y})"),
    "aten::ne.Tensor": _binary("(float)({x} != {y})"), "aten::ne.Scalar": _binary("(float)({x} != {y})"),
    "aten::gt.Tensor": _binary("(float)({x} > {y})"), "aten::gt.Scalar": _binary("(float)({x} > {y})"),
    "aten::ge.Tensor": _binary("(float)({x} >= {y})"), "aten::ge.Scalar": _binary("(float)({x} >= {y})"),
    "aten::lt.Tensor": _binary("(float)({x} < {y})"), "aten::lt.Scalar": _binary("(float)({x} < {y})"),
    "aten::le.Tensor": _binary("(float)({x} <= {y})"), "aten::le.Scalar": _binary("(float)({x} <= {y})"),
    "aten::logical_not": _unary("(float)({x} == 0.0f)"),
    "aten::_to_copy": _unary("{x}"), "aten::clone": _unary("{x}"), "aten::alias": _unary("{x}"),
    "aten::_native_batch_norm_legit_no_training": _batch_norm,
}


def is_pointwise(op: str) -> bool:
    return op in POINTWISE_OPS
