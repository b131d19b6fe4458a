"""Who did the work. At dispatch (``DispatchRecord``): the ATen operators a forward calls, with their FLOPs
and bytes, against the reference's, so torch doing the problem's work is seen however it is spelled
(``a.__matmul__(b)``, a method reached through a dict, ``torch.matmul`` beside an identity kernel) and
on the CPU too; a library the candidate calls itself (its own cuBLASLt binding) never passes the ATen
dispatcher, so only cuBLAS that ATen launched counts against it. On the GPU: the kernels CUPTI saw in the
verified calls, each attributed to the candidate
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
           "summary_line", "FOREIGN_MAJOR", "FOREIGN_MINOR", "EPILOGUE_DONE", "DispatchRecord", "dispatch_summary",
           "dispatch_findings"]

CLASSES = ("own", "library", "layout", "aten", "other")
# Shares of GPU time done by kernels the candidate does not own (ATen, other) that make it a hack
# (major) or worth a look (minor). Library GEMMs/convolutions do not count against it.
FOREIGN_MAJOR = 0.5
FOREIGN_MINOR = 0.2
# Of the reference's work outside FLOP formulas (its epilogue), the share the candidate's ATen calls must do
# for torch to count as having computed the whole result.
EPILOGUE_DONE = 0.9

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


# ---- at dispatch ------------------------------------------------------------------------------------------

# ATen operators that move or make data without computing the problem (views, copies, allocation): reported,
# never counted as work.
_NOT_WORK = re.compile(r"^(empty|empty_like|empty_strided|zeros|zeros_like|ones|ones_like|full|full_like|new_\w+|"
                       r"view|_unsafe_view|reshape|as_strided|expand|permute|transpose|t|squeeze|unsqueeze|"
                       r"contiguous|clone|copy_|_to_copy|to|detach|alias|slice|select|split|split_with_sizes|"
                       r"chunk|unbind|lift_fresh|fill_|zero_|set_|resize_|record_stream|_local_scalar_dense|"
                       r"is_same_size|size|stride|numel|dim|item)$")


class DispatchRecord:
    """A context manager that records every ATen operator called inside it (a TorchDispatchMode): per
    operator the calls, FLOPs (torch.utils.flop_counter's formulas; 0 for an operator it has none for) and
    bytes read and written; "work" is False for operators that only move or make data (views, copies,
    allocation). ``ops``: name -> {"calls", "flops", "formula_flops" (the part counted by a formula),
    "bytes", "work"}."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        record = self
        self.ops: dict[str, dict[str, Any]] = {}

        class _Mode(TorchDispatchMode):
            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                # Not wrapped in dynamo's disable: that would import torch._dynamo at the first operator
                # (seconds, inside the candidate's run limit), and the record compiles nothing.
                return False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: N802 - torch's name
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                record._add(func, args, kwargs, out, flop_registry)
                return out

        self._mode = _Mode()

    def __enter__(self) -> "DispatchRecord":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def _add(self, func: Any, args: Any, kwargs: Any, out: Any, registry: Mapping[Any, Any]) -> None:
        import torch
        import torch.utils._pytree as pytree

        packet = func._overloadpacket
        name = str(packet).split(".")[-1]
        work = not _NOT_WORK.match(name)
        tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        flops = 0
        formula = registry.get(packet)
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - a formula that does not fit these arguments: counted below
                flops = 0
        by_formula = flops
        if work and not flops:
            # No formula (elementwise, reductions): one operation per element of its largest operand, so
            # a product spelled as broadcast-multiply-and-sum is counted like the GEMM it is.
            flops = max((t.numel() for t in tensors), default=0)
        row = self.ops.setdefault(name, {"calls": 0, "flops": 0, "formula_flops": 0, "bytes": 0, "work": work})
        row["calls"] += 1
        row["flops"] += flops
        row["formula_flops"] += by_formula
        row["bytes"] += sum(t.numel() * t.element_size() for t in tensors)


def dispatch_summary(ops: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Totals of a record's operators that compute (FLOPs, bytes) and the heaviest of them."""
    work = {n: r for n, r in ops.items() if r["work"]}
    heavy = sorted(work, key=lambda n: (-work[n]["flops"], -work[n]["bytes"]))
    return {"flops": sum(r["flops"] for r in work.values()), "bytes": sum(r["bytes"] for r in work.values()),
            "formula_flops": sum(r["formula_flops"] for r in work.values()),
            "ops": [{"name": n, **{k: work[n][k] for k in ("calls", "flops", "bytes")}} for n in heavy[:8]]}


def dispatch_findings(candidate: Mapping[str, Any], reference: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """(rule, severity, message, evidence) when ATen operators the candidate's forward called did the
    problem's work: their operations (FLOPs by formula, one per element where there is none) as a share of
    the reference's, major at FOREIGN_MAJOR and minor at FOREIGN_MINOR, as for the kernels' GPU time.

    A library product is not the whole problem: where the reference also has work no FLOP formula covers
    (a bias, an activation, a normalization: its "epilogue") and the candidate's ATen operators did less
    than EPILOGUE_DONE of it, the candidate's own kernels computed that part — a GEMM or convolution left
    to torch with a fused epilogue of one's own is library use, which the rubric weighs (minor). Torch
    computing the product *and* its epilogue, or a problem that is the product alone, stays major."""
    ref_flops, cand_flops = reference["flops"], candidate["flops"]
    if ref_flops <= 0:
        return []
    top = ", ".join(f"aten.{o['name']} x{o['calls']}" for o in candidate["ops"][:3])
    share = cand_flops / ref_flops
    evidence = (f"ATen operators called by the candidate's forward: {cand_flops:.3g} operations, the reference's "
                f"{ref_flops:.3g} ({share:.0%}); {top}")
    ref_rest = ref_flops - reference.get("formula_flops", 0)
    cand_rest = cand_flops - candidate.get("formula_flops", 0)
    epilogue_own = ref_rest > 0 and reference.get("formula_flops", 0) > 0 and cand_rest < EPILOGUE_DONE * ref_rest
    if share >= FOREIGN_MAJOR and not epilogue_own:
        return [("torch-does-the-work", "major", f"ATen operators the candidate's forward called did {share:.0%} "
                 "of the reference's arithmetic: torch, not the candidate, computed the result (however the call "
                 "is spelled).", evidence)]
    if share >= FOREIGN_MINOR:
        rest = (f"; the reference's other work ({ref_rest:.3g} operations: its epilogue) was left to the candidate's "
                f"kernels (ATen did {cand_rest / ref_rest:.0%} of it)" if epilogue_own else "")
        return [("torch-does-the-work", "minor", f"ATen operators the candidate's forward called did {share:.0%} "
                 f"of the reference's arithmetic: part of the problem is left to torch{rest}.", evidence)]
    return []
