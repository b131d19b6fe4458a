"""The one description of the GPU: its identity from the device, its peaks from the C++ profile layer's
table (``DeviceCeilings``, include/stitchcuda/profile.hpp). The Verifier's speed-of-light bound, the
Planner's prompt (agents.hardware()), graph mode's artifacts and the roofline all read it, so the DRAM
bandwidth a candidate is judged against is the one the Planner was told.
"""

from __future__ import annotations

from typing import Any

import torch

from ..log import get_logger

__all__ = ["describe", "ceilings", "default_ceilings", "floor_bandwidth_tb_s", "gpu_present"]


def _table():
    from .. import _C

    return _C.profile.DeviceCeilings


def ceilings(device_name: str) -> Any | None:
    """The table's ceilings (a stitchcuda.profile.DeviceCeilings) for a device name as the driver gives
    it ("NVIDIA H200"), or None for a GPU the table does not know."""
    return _table().for_device(device_name)


def default_ceilings() -> Any:
    """The ceilings of the GPU StitchCUDA's numbers were measured on (the H200): what a bound uses when
    it must be computed without asking the device."""
    return _table().h200()


def floor_bandwidth_tb_s() -> float:
    """DRAM bandwidth (TB/s) of the Verifier's memory speed-of-light bound (VerifyConfig.bandwidth_tb_s's
    default): the current GPU's from the table, the number describe() gives the Planner, in a process
    that already uses CUDA; otherwise (no GPU, one the table does not know, or a process that has not
    touched CUDA, such as a service front end that only hands checks to GPU workers: asking would create
    a CUDA context there) the default ceilings' (the H200's)."""
    if torch.cuda.is_initialized():
        gpu = describe()
        if gpu.get("gpu") and gpu.get("dram_tb_s"):
            return float(gpu["dram_tb_s"])
    return _tb(default_ceilings().dram_bytes_per_s)


def gpu_present() -> bool:
    """A usable CUDA device: the driver sees one and torch can use it (a broken driver is no GPU here)."""
    try:
        from .. import _C

        return _C.device_count() > 0 and torch.cuda.is_available()
    except Exception:  # a broken driver is no GPU here
        get_logger(__name__).debug("no usable GPU: the device query failed", exc_info=True)
        return False


def _tb(x: float) -> float:
    # TB/s and TFLOP/s as people write them: 4.3, not 4.300000000000001.
    return round(x / 1e12, 3)


def _describe(props: Any, cuda: str) -> dict[str, Any]:
    c = ceilings(props.name)
    return {"gpu": props.name, "arch": f"sm_{props.major}{props.minor}", "sms": int(props.multi_processor_count),
            "memory_gib": round(props.total_memory / 2**30, 1),
            # 0 for a GPU the table does not know: the prompt then says "unknown" instead of guessing.
            "dram_tb_s": _tb(c.dram_bytes_per_s) if c else 0.0,
            "fp32_tflops": _tb(c.fp32_flops_per_s) if c else 0.0,
            "tf32_tflops": _tb(c.tf32_tensor_flops_per_s) if c else 0.0,
            "bf16_tflops": _tb(c.bf16_tensor_flops_per_s) if c else 0.0,
            "l2_bytes": int(getattr(props, "L2_cache_size", 0) or 0), "cuda": cuda}


def describe(device: int | torch.device | None = None) -> dict[str, Any]:
    """The GPU (``device``, default the current one): {gpu, arch, sms, memory_gib, dram_tb_s, fp32_tflops,
    tf32_tflops, bf16_tflops, l2_bytes, cuda}. Peaks come from the table (0 when it does not know the
    GPU). Without a GPU: {"gpu": None, "cuda": torch's CUDA version}."""
    cuda = torch.version.cuda or ""
    if not gpu_present():
        return {"gpu": None, "cuda": cuda}
    return _describe(torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device),
                     cuda)
