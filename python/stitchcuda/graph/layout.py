"""Layout planning: which 4-D values a program stores channels-last (NHWC in memory, NCHW in shape).

cuDNN's tensor-core convolutions work on NHWC data: handed NCHW tensors, they transpose the input in
and the output back out on every call, two extra passes over each activation. A convolution chain
planned channels-last pays for one conversion at each edge instead: the convolutions' inputs, outputs
and weights are NHWC, and the elementwise groups between them (bias, batch norm, activations, residual
adds) iterate in that storage order, so they read and write it with unit stride. Everything else keeps
its layout, and a step that needs a contiguous operand (a row reduction, a GEMM) gets one copy.

The plan is a set of value names; lowering applies it (graph/lower.py: `produce`, `need`, the pointwise
groups' iteration order, the layout ATen gives a step's result).
"""

from __future__ import annotations

import torch

from ..settings import settings
from .capture import Graph, Node, Value
from .groups import Group

__all__ = ["channels_last_values", "channels_last_strides", "contiguous_strides", "is_channels_last",
           "depthwise_nhwc", "CONVOLUTION_OPS"]

CONVOLUTION_OPS = ("aten::convolution",)


def channels_last_strides(shape) -> tuple[int, ...]:
    """The strides of a 4-D `shape` (N, C, H, W) stored N, H, W, C."""
    n, c, h, w = (max(int(e), 1) for e in shape)
    return (h * w * c, 1, w * c, c)


def is_channels_last(shape, strides) -> bool:
    """Whether a 4-D buffer is stored channels-last (and not also contiguous, as a 1x1 image or C=1 is)."""
    if len(shape) != 4:
        return False
    return tuple(strides) == channels_last_strides(shape) and tuple(strides) != contiguous_strides(shape)


def contiguous_strides(shape) -> tuple[int, ...]:
    """Row-major strides of `shape` (a size-0 or size-1 extent counts as 1)."""
    strides, s = [], 1
    for e in reversed(shape):
        strides.append(s)
        s *= max(int(e), 1)
    return tuple(reversed(strides))


# A convolution joins a channels-last chain when NHWC pays: channel counts the tensor-core kernels take
# whole (multiples of 4 for TF32, at least 16 coming in: an RGB stem stays NCHW) and an input large
# enough that passes over memory, not launches, set its time.
MIN_CHANNELS = 16
MIN_ELEMENTS = 1 << 16


def channels_last_mode() -> str:
    """STITCHCUDA_CHANNELS_LAST (settings().channels_last): "auto" (default) plans channels-last chains of
    tensor-core convolutions (tensor_core_convolutions); "on" plans them for every eligible convolution
    whatever its precision (to test or time the NHWC path in true fp32); "off" never. A bad value raises
    SettingsError (a ValueError) naming the variable and the values it takes."""
    return settings().channels_last


def tensor_core_convolutions(dtype: torch.dtype) -> bool:
    """Whether cuDNN may run convolutions of `dtype` on tensor cores: half precision always, fp32 only
    while torch.backends.cudnn.allow_tf32 is on (PyTorch's default) — read at planning time, as the
    convolutions will run under it."""
    return dtype in (torch.float16, torch.bfloat16) or (dtype == torch.float32 and torch.backends.cudnn.allow_tf32)


def _cudnn_convolution(node: Node) -> bool:
    """A 2-D convolution ATen runs through cuDNN that is worth running on NHWC data: one on tensor cores.
    A true-fp32 convolution (TF32 off) stays NCHW: cuDNN's fp32 NHWC kernels are no faster than its NCHW
    ones and hold a workspace of about twice the activation while they run."""
    if node.op not in CONVOLUTION_OPS or len(node.args) < 2:
        return False
    x, w = node.args[0], node.args[1]
    mode = channels_last_mode()
    if mode == "off" or not (isinstance(x, Value) and isinstance(w, Value) and len(x.shape) == 4
                             and len(w.shape) == 4 and x.dtype.is_floating_point
                             and (mode == "on" or tensor_core_convolutions(x.dtype))):
        return False
    c_in, c_out = x.shape[1], node.out.shape[1]
    return c_in >= MIN_CHANNELS and c_in % 4 == 0 and c_out % 4 == 0 and x.numel >= MIN_ELEMENTS


def depthwise_nhwc(node: Node) -> bool:
    """Whether the channels-last depthwise template takes this (template) depthwise convolution: fp32
    input, filter and result, channels a multiple of 4."""
    x, w = node.args[0], node.args[1]
    return (isinstance(x, Value) and isinstance(w, Value) and len(x.shape) == 4 and x.shape[1] % 4 == 0
            and x.dtype == w.dtype == node.out.dtype == torch.float32)


def channels_last_values(graph: Graph, groups: list[Group]) -> frozenset[str]:
    """The values to store channels-last: every cuDNN convolution's input, weight and result, and the
    results of the elementwise groups that read one of those at their full shape and of the template
    depthwise convolutions and pooling steps whose input is one (propagated in program order). Empty when the graph has no such convolution. Graph outputs keep their layout, and
    a graph input named here is converted once (the program's inputs are contiguous)."""
    aten_nodes = [n for g in groups if g.kind == "aten" for n in g.nodes]
    convolutions = [n for n in aten_nodes if _cudnn_convolution(n)]
    if not convolutions:
        return frozenset()
    outputs = {v.name for v in graph.outputs}
    chosen: set[str] = set()
    for n in convolutions:
        chosen.update(v.name for v in n.args[:2])
        chosen.add(n.out.name)
    for g in groups:
        if (g.kind == "conv" and depthwise_nhwc(g.params["node"]) or g.kind == "pool") \
                and g.params["node"].args[0].name in chosen:
            # A depthwise convolution inside the chain (a MobileNet block's, between two 1x1 convolutions)
            # or a pooling step (a VGG stage's) reads and writes NHWC too (the channels-last depthwise and
            # pooling templates, or ATen's NHWC pooling): no conversion around it.
            chosen.update(v.name for v in g.outputs(outputs) if len(v.shape) == 4 and v.name not in outputs)
            continue
        if g.kind != "pointwise" or "relayout" in g.params:  # a copy made for a reader's layout keeps it
            continue
        shape = tuple(g.params.get("shape", ()))
        if len(shape) != 4:
            continue
        reads = any(v.name in chosen and tuple(v.shape) == shape for v in g.inputs())
        produced = g.outputs(outputs)
        if reads or any(v.name in chosen for v in produced):
            chosen.update(v.name for v in produced if tuple(v.shape) == shape and v.name not in outputs)
    return frozenset(chosen - outputs)
