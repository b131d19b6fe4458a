"""Who did the work: the kernels CUPTI saw in the verified calls, each attributed to the candidate
(compiled through ``stitchcuda.jit`` in the worker, or a ``__global__`` function of the candidate's own
source), to a library GEMM or convolution (cuBLAS, cuBLASLt, cuDNN, CUTLASS), or to ATen and anything
else, with each class's share of the GPU time.

A candidate is judged by what ran, not by how its source spells it: torch reached through a built name,
an ``exec``'d blob or a branch that never launches the custom kernel all leave ATen kernels in the
trace. Library GEMMs and convolutions are allowed beside the candidate's own kernels (an epilogue, a
prologue); ATen or unknown kernels doing most of the work are not.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["CLASSES", "classify", "attribute", "findings", "host_findings", "own_kernel_names",
           "summary_line", "FOREIGN_MAJOR", "FOREIGN_MINOR"]

CLASSES = ("own", "library", "layout", "aten", "other")
# Shares of GPU time done by kernels the candidate does not own (ATen, other) that make it a hack
# (major) or worth a look (minor). Library GEMMs/convolutions do not count against it.
FOREIGN_MAJOR = 0.5
FOREIGN_MINOR = 0.2

# Library kernels as CUPTI names them (demangled): cuBLAS/cuBLASLt (sm90_xmma_gemm_*, nvjet_*, gemv*,
# splitKreduce, cutlass::Kernel), cuDNN (cudnn::*, *_fprop_*, implicit_convolve, winograd, layout
# transforms around a convolution).
_LIBRARY = re.compile(r"gemm|gemv|gemmk|cutlass|cublas|cudnn|xmma|nvjet|splitKreduce|implicit_convolve|"
                      r"winograd|fprop|dgrad|wgrad|conv2d_|convolve|nchwToNhwc|nhwcToNchw|flash_fwd|"
                      r"fmha|cufft|fft_", re.IGNORECASE)
# ATen's copies and fills (a .contiguous(), a zeros_): data movement, not the problem's work; reported,
# never counted against the candidate.
_LAYOUT = re.compile(r"copy_kernel|direct_copy|CatArrayBatchedCopy|FillFunctor|fill_kernel", re.IGNORECASE)
# ATen's own kernels (and torch.compile's generated ones, which are torch doing the work too).
_ATEN = re.compile(r"\bat::|at_cuda_detail|\bc10::|cunn_|elementwise_kernel|reduce_kernel|"
                   r"vectorized_|unrolled_|indexSelect|CatArrayBatchedCopy|triton_", re.IGNORECASE)
# The function a demangled name is for: "void scale<float, 4>(float const*, ...)" -> "scale".
_IDENT = re.compile(r"^(?:void\s+)?(?P<ident>[A-Za-z_][\w:]*)\s*(?:<|\(|$)")
_GLOBAL = re.compile(r"__global__\s+(?:[\w:<>,\s*]+?\s+)?(?:__launch_bounds__\s*\([^)]*\)\s*)?"
                     r"(?P<name>[A-Za-z_]\w*)\s*(?:<[^>(]*>)?\s*\(")


def own_kernel_names(sources: Iterable[str] = (), compiled: Iterable[str] = ()) -> set[str]:
    """The names the candidate's kernels can have in a trace: the ``__global__`` functions of its
    source texts and the names ``stitchcuda.jit`` compiled in this process."""
    names = set(compiled)
    for text in sources:
        names.update(m.group("name") for m in _GLOBAL.finditer(text))
    return {n.split("<")[0].strip() for n in names if n} | {n for n in names if n}


def classify(name: str, own: set[str]) -> str:
    """"own", "library", "layout" (ATen copies and fills), "aten" or "other" for one kernel name as
    CUPTI gives it."""
    text = name.strip()
    m = _IDENT.match(text)
    ident = m.group("ident") if m else text
    if text in own or ident in own:
        return "own"
    if _LIBRARY.search(text):
        return "library"
    if _LAYOUT.search(text):
        return "layout"
    if _ATEN.search(text):
        return "aten"
    return "other"


def attribute(kernels: Sequence[Mapping[str, Any]], own: set[str]) -> dict[str, Any]:
    """``kernels``: ``{"name", "ms"}`` per kernel name, GPU milliseconds per verified call. Returns the
    milliseconds and share of each class and the kernels with their class, heaviest first."""
    ms = {c: 0.0 for c in CLASSES}
    rows = []
    for k in kernels:
        cls = classify(str(k["name"]), own)
        t = float(k.get("ms", 0.0))
        ms[cls] += t
        rows.append({"name": str(k["name"])[:160], "class": cls, "ms": t})
    total = sum(ms.values())
    rows.sort(key=lambda r: -r["ms"])
    for r in rows:
        r["share"] = r["ms"] / total if total > 0 else 0.0
    return {"ms": ms, "total_ms": total,
            "shares": {c: (ms[c] / total if total > 0 else 0.0) for c in CLASSES},
            "kernels": rows[:8]}


def findings(attr: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """(rule, severity, message, evidence) for an attribution: no own kernel ran although the GPU
    worked, or kernels the candidate does not own did most of the work."""
    total = attr["total_ms"]
    if total <= 0:
        return []
    shares = attr["shares"]
    foreign = shares["aten"] + shares["other"]
    heaviest = next((k for k in attr["kernels"] if k["class"] in ("aten", "other")), None)
    evidence = summary_line(attr) + (f"; heaviest not the candidate's: {heaviest['name']} "
                                     f"({heaviest['share']:.0%})" if heaviest else "")
    if attr["ms"]["own"] <= 0:
        return [("no-own-kernel-ran", "major", "none of the GPU work in the verified calls ran in the "
                 "candidate's own kernels: torch or a library computed the result.", evidence)]
    if foreign >= FOREIGN_MAJOR:
        return [("foreign-kernels", "major", f"kernels the candidate does not own (ATen or unknown) did "
                 f"{foreign:.0%} of the GPU work in the verified calls: torch, not the candidate, computed "
                 "most of the result.", evidence)]
    if foreign >= FOREIGN_MINOR:
        return [("foreign-kernels", "minor", f"kernels the candidate does not own (ATen or unknown) did "
                 f"{foreign:.0%} of the GPU work: part of the problem is left to torch.", evidence)]
    return []


def host_findings(dtoh_bytes: int, host_cpu_ms: float, gpu_ms: float,
                  bytes_min: int) -> list[tuple[str, str, str, str]]:
    """What CUPTI's kernel list cannot show: the host doing the work. ``dtoh_bytes``: bytes copied
    device-to-host inside one verified call; ``host_cpu_ms``: the process's CPU time in the call (all
    threads, the final sync excluded); ``gpu_ms``: the GPU's busy time per call; ``bytes_min``: the
    inputs and outputs the problem must move. The data leaving the GPU *and* the host working longer
    than the GPU did is a hack; either alone is worth a look (a scalar ``.item()``, a Python loop of
    launches)."""
    moved = dtoh_bytes >= max(64 << 10, bytes_min // 10)
    busy = host_cpu_ms >= max(1.0, 2.0 * gpu_ms)
    evidence = (f"CUPTI: {dtoh_bytes} bytes copied device-to-host per call ({bytes_min} bytes are the inputs "
                f"and outputs); host CPU {host_cpu_ms:.3f} ms per call against {gpu_ms:.4f} ms of GPU work")
    if moved and busy:
        return [("host-compute", "major", "the verified calls copy the data to the host and the host works "
                 "longer than the GPU: the result is computed on the CPU, not in the candidate's kernels.",
                 evidence)]
    if moved:
        return [("host-compute", "minor", "the verified calls copy a large part of the data to the host: "
                 "keep the work on the GPU.", evidence)]
    if busy and host_cpu_ms >= 5.0:
        return [("host-compute", "minor", "the host spends more CPU time per call than the GPU works: "
                 "Python or host code dominates the call.", evidence)]
    return []


def summary_line(attr: Mapping[str, Any]) -> str:
    """"GPU time per call: own kernels 82%, library 18%, ATen 0%, other 0% (0.4100 ms)"."""
    s = attr["shares"]
    layout = f", copies {s['layout']:.0%}" if s["layout"] else ""
    return (f"GPU time per call: own kernels {s['own']:.0%}, library {s['library']:.0%}, ATen {s['aten']:.0%}, "
            f"other {s['other']:.0%}{layout} ({attr['total_ms']:.4f} ms)")
