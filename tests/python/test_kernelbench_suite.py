"""The large KernelBench-format corpus (bench/kernelbench/) without a GPU and without its memory: every file
has the house format and a known class prefix (op_, conv_, gemm_, net_) in the required numbers; every model
runs forward on the meta device (shapes only, no storage) with outputs of non-zero size; the sizes are the
realistic ones the corpus is for (one op over 5 GB, a median largest input of at least 100 MB, no tensor over
6.5 GB, an estimated peak that leaves an H200 room for torch.compile's copies, an H200 eager floor of
0.4-50 ms from the meta run's FLOPs and bytes); three scaled-down networks, and the selective-scan model
against a step-by-step recurrence, run for real on the CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import statistics
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

KERNELBENCH = Path(__file__).resolve().parents[2] / "bench" / "kernelbench"
FILES = {p.stem: p for p in sorted(KERNELBENCH.glob("*.py")) if not p.name.startswith("_")}
STEMS = list(FILES)
MINIMUMS = {"op": 14, "conv": 8, "gemm": 6, "net": 14}
MIN_TOTAL = 44

GB, MB = 1e9, 1e6
MAX_TENSOR_BYTES = 6.5 * GB  # any single tensor: inputs, outputs and eager intermediates
MAX_PEAK_BYTES = 46 * GB  # a third of an H200: the rest is for the harness's and torch.compile's copies
H200_FLOPS, H200_BYTES_PER_S = 60e12, 4e12  # fp32 without tensor cores; HBM3e bandwidth
FLOOR_MS = (0.4, 50.0)  # the eager forward's roofline floor must land here
CPU_RUNS, CPU_MAX_SETUP_BYTES, CPU_MAX_FLOPS = 3, 200 * MB, 15e9

_counter = itertools.count()


def load(stem: str, **constants) -> ModuleType:
    """A fresh import of the problem file (its own module object), with module constants overridden."""
    spec = importlib.util.spec_from_file_location(f"kernelbench_{stem}_{next(_counter)}", FILES[stem])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, value in constants.items():
        assert hasattr(module, name), f"{stem}: no constant {name}"
        setattr(module, name, value)
    return module


def tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor occupies (an expanded or sliced view counts only what its storage holds)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class _Meter(TorchDispatchMode):
    """Per aten op of a meta-device forward: FLOPs (torch's flop formulas), bytes read and written (inputs and
    outputs of ops that allocate, views are free), the roofline floor on an H200 summed over ops, the largest
    tensor produced, and the peak of live storage (each storage counted once, freed when its last tensor dies)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.moved = 0
        self.floor_s = 0.0
        self.largest = 0
        self.live = 0
        self.peak_live = 0
        self._holders: dict[int, list[int]] = {}  # storage key -> [tensor count, bytes]

    def _release(self, key: int) -> None:
        entry = self._holders[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._holders[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        outs = tensors(out)
        aliasing = any(r.alias_info is not None for r in func._schema.returns)
        moved = 0 if aliasing else sum(storage_bytes(t) for t in tensors((args, kwargs)) + outs)
        self.flops += flops
        self.moved += moved
        self.floor_s += max(flops / H200_FLOPS, moved / H200_BYTES_PER_S)
        for t in outs:
            self.largest = max(self.largest, storage_bytes(t))
            key = t.untyped_storage()._cdata
            if key not in self._holders:
                self._holders[key] = [0, t.untyped_storage().nbytes()]
                self.live += t.untyped_storage().nbytes()
            self._holders[key][0] += 1
            weakref.finalize(t, self._release, key)
        self.peak_live = max(self.peak_live, self.live)
        return out


@dataclass(frozen=True)
class Stats:
    out_shapes: tuple[tuple[int, ...], ...]
    input_bytes: tuple[int, ...]  # per tensor input
    output_bytes: tuple[int, ...]
    param_bytes: int  # parameters and buffers
    largest_intermediate: int
    flops: int
    moved: int
    floor_ms: float
    peak_bytes: int  # parameters + inputs + the most live storage during the forward

    @property
    def largest_input(self) -> int:
        return max(self.input_bytes, default=0)


def _meta_inputs(module: ModuleType) -> list:
    """get_inputs() under the meta device; anything that ignored the device context becomes a meta tensor."""
    inputs = module.get_inputs()
    return [torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) and t.device.type != "meta" else t
            for t in inputs]


@functools.lru_cache(maxsize=None)
def meta_stats(stem: str, constants: tuple[tuple[str, int], ...] = ()) -> Stats:
    """Builds the model and its inputs on the meta device (no memory) and measures one eval-mode forward."""
    module = load(stem, **dict(constants))
    with torch.device("meta"):
        model = module.Model(*module.get_init_inputs()).eval()
        inputs = _meta_inputs(module)
    params = [t for t in itertools.chain(model.parameters(), model.buffers())]
    assert all(t.device.type == "meta" for t in params + tensors(inputs)), f"{stem}: real memory under meta"
    meter = _Meter()
    with torch.no_grad(), meter:
        out = model(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    assert outs and all(isinstance(t, torch.Tensor) for t in outs), f"{stem}: forward returned {type(out)}"
    setup = sum(storage_bytes(t) for t in params + tensors(inputs))
    return Stats(out_shapes=tuple(tuple(t.shape) for t in outs),
                 input_bytes=tuple(storage_bytes(t) for t in tensors(inputs)),
                 output_bytes=tuple(storage_bytes(t) for t in outs),
                 param_bytes=sum(storage_bytes(t) for t in params),
                 largest_intermediate=meter.largest, flops=meter.flops, moved=meter.moved,
                 floor_ms=meter.floor_s * 1e3, peak_bytes=setup + meter.peak_live)


def prefix(stem: str) -> str:
    return stem.split("_", 1)[0]


# ---- the corpus as a whole ----


def test_corpus_has_every_class_in_the_required_numbers():
    counts = {cls: sum(prefix(s) == cls for s in STEMS) for cls in MINIMUMS}
    assert not [s for s in STEMS if prefix(s) not in MINIMUMS], "every file starts with op_, conv_, gemm_ or net_"
    assert all(counts[c] >= n for c, n in MINIMUMS.items()), counts
    assert len(STEMS) >= MIN_TOTAL, counts


@pytest.mark.parametrize("stem", STEMS)
def test_problem_has_the_house_format(stem: str):
    module = load(stem)
    assert isinstance(module.Model, type) and issubclass(module.Model, nn.Module)
    assert callable(module.get_inputs) and callable(module.get_init_inputs)
    assert isinstance(module.get_init_inputs(), (list, tuple))
    doc = (module.__doc__ or "").strip().splitlines()
    assert len(doc) >= 2 and doc[0].strip(), f"{stem}: docstring needs a summary line and a size line"
    assert doc[1].startswith("Largest tensor:"), f"{stem}: second docstring line should give the largest tensor"
    caps = [n for n, v in vars(module).items() if n.isupper() and isinstance(v, int) and not isinstance(v, bool)]
    assert caps, f"{stem}: sizes belong in module-level CAPS constants"


@pytest.mark.parametrize("stem", STEMS)
def test_meta_forward_has_sane_shapes_and_sizes(stem: str):
    s = meta_stats(stem)
    for shape in s.out_shapes:
        assert all(d > 0 for d in shape), f"{stem}: output shape {shape} has an empty dimension"
    assert s.input_bytes and 0 < sum(s.input_bytes) <= 2 * MAX_TENSOR_BYTES, f"{stem}: inputs {s.input_bytes}"
    assert sum(s.input_bytes) + s.param_bytes >= 10 * MB, f"{stem}: inputs and weights are toy-sized"
    biggest = max(s.input_bytes + s.output_bytes)
    assert biggest <= MAX_TENSOR_BYTES, f"{stem}: a {biggest / GB:.2f} GB input/output tensor"
    assert s.largest_intermediate <= MAX_TENSOR_BYTES, f"{stem}: a {s.largest_intermediate / GB:.2f} GB intermediate"
    assert s.peak_bytes <= MAX_PEAK_BYTES, f"{stem}: estimated peak {s.peak_bytes / GB:.1f} GB"
    lo, hi = FLOOR_MS
    assert lo <= s.floor_ms <= hi, (f"{stem}: H200 eager floor {s.floor_ms:.2f} ms ({s.flops / 1e9:.0f} GFLOP, "
                                    f"{s.moved / GB:.2f} GB moved) is outside {lo}-{hi} ms")


def test_sizes_are_realistic():
    stats = {stem: meta_stats(stem) for stem in STEMS}
    huge = [s for s in STEMS if prefix(s) == "op" and stats[s].largest_input >= 5 * GB]
    assert huge, "one op_ problem should read a 5+ GB input"
    median = statistics.median(st.largest_input for st in stats.values())
    assert median >= 100 * MB, f"median largest input {median / MB:.0f} MB"
    for cls in MINIMUMS:  # every class has at least one problem that is heavy for its kind
        assert max(st.floor_ms for s, st in stats.items() if prefix(s) == cls) >= 2.0, cls


# ---- real runs on the CPU ----


def _reads_batch(module: ModuleType) -> bool:
    return hasattr(module, "BATCH") and "BATCH" in module.get_inputs.__code__.co_names


@functools.lru_cache(maxsize=1)
def cpu_picks() -> tuple[tuple[str, tuple], ...]:
    """The net_ problems run for real on the CPU: those whose parameters + inputs are under 200 MB and whose
    forward costs at most 15 GFLOP, at full size where they fit, else with BATCH patched to 1 (only where
    get_inputs reads BATCH: the batch-1 bytes and FLOPs are the full-size meta figures divided by BATCH, every
    net here being batch-linear); the CPU_RUNS cheapest. Chosen at run time, so collecting this file costs
    nothing."""
    found = []
    for stem in (s for s in STEMS if prefix(s) == "net"):
        s, module = meta_stats(stem), load(stem)
        options = [((), sum(s.input_bytes), s.flops)]
        if _reads_batch(module):
            options.append(((("BATCH", 1),), sum(s.input_bytes) / module.BATCH, s.flops / module.BATCH))
        for constants, input_bytes, flops in options:
            if input_bytes + s.param_bytes < CPU_MAX_SETUP_BYTES and flops <= CPU_MAX_FLOPS:
                found.append((flops, stem, constants))
                break
    return tuple((stem, constants) for _, stem, constants in sorted(found)[:CPU_RUNS])


def test_enough_networks_fit_a_cpu_run():
    assert len(cpu_picks()) == CPU_RUNS, cpu_picks()


@pytest.mark.parametrize("rank", range(CPU_RUNS))
def test_network_runs_on_cpu_with_finite_output(rank: int):
    stem, constants = cpu_picks()[rank]
    module = load(stem, **dict(constants))
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).eval()
    inputs = module.get_inputs()
    with torch.no_grad():
        out = model(*inputs)
        again = model(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    assert tuple(tuple(t.shape) for t in outs) == meta_stats(stem, constants).out_shapes
    for t, u in zip(outs, again if isinstance(again, tuple) else (again,)):
        assert torch.isfinite(t).all(), f"{stem}: non-finite output"
        assert t.abs().max() > 0, f"{stem}: all-zero output"
        assert torch.equal(t, u), f"{stem}: forward is not deterministic"


@pytest.mark.parametrize("stem, constants", [
    ("net_efficientnet_se_stage", {"BATCH": 2}),  # batch norms and SiLUs decomposed into elementwise pieces
    ("net_transformer_encoder", {"BATCH": 1, "SEQ": 64}),  # residual sums, GELUs, layer norms
    ("net_vgg_bn", {"BATCH": 1}),  # ReLUs run in place by the model itself
])
def test_the_recording_gives_every_check_the_values_an_unaltered_forward_makes(stem: str, constants: dict):
    """optimize()'s streaming recording runs elementwise ops in place where nothing else holds the operand
    (graph/lower.py): every value a group check reads is bitwise the value a forward that allocates every
    result makes (reference_values)."""
    from stitchcuda.graph.capture import capture
    from stitchcuda.graph.lower import reference_values, stream_values
    from stitchcuda.graph.optimize import check_wants
    from stitchcuda.graph.planner import OfflinePlanner

    module = load(stem, **constants)
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).eval()
    inputs = module.get_inputs()
    graph = capture(model, inputs)
    wanted = check_wants(graph, OfflinePlanner(precision="fp32").plan(graph))
    reference = reference_values(graph, inputs)
    compared, differ = [], []

    def check(key, held):
        for name, value in held.items():
            compared.append(name)
            if not torch.equal(value, reference[name]):
                differ.append(name)

    stream_values(graph, inputs, wanted, check)
    assert len(wanted) >= 10 and len(compared) >= 2 * len(wanted) and not differ, (len(wanted), differ)


def test_selective_scan_matches_a_step_by_step_recurrence():
    """net_selective_scan's chunked scan (masked decay matrices inside chunks, carried states across chunks)
    equals h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = C_t . h_t + D x_t run one step at a time; small sizes,
    float64, several chunks."""
    module = load("net_selective_scan")
    b, l, d, expand, h, n, t, k = 2, 80, 16, 2, 4, 8, 16, 4
    torch.manual_seed(0)
    model = module.Model(d, expand, h, n, t, k).double().eval()
    u = torch.randn(b, l, d, dtype=torch.float64)
    inner, p = d * expand, d * expand // h
    with torch.no_grad():
        got = model(u)
        z, xbc, dt = torch.split(model.in_proj(u), [inner, inner + 2 * n, h], dim=-1)
        xbc = F.silu(model.conv(xbc.transpose(1, 2))[..., :l].transpose(1, 2))
        x, bm, cm = torch.split(xbc, [inner, n, n], dim=-1)
        dt, a = F.softplus(dt + model.dt_bias), -torch.exp(model.a_log)
        x = x.reshape(b, l, h, p)
        state, ys = torch.zeros(b, h, p, n, dtype=torch.float64), []
        for i in range(l):
            state = (torch.exp(dt[:, i] * a)[:, :, None, None] * state
                     + (dt[:, i, :, None] * x[:, i])[..., None] * bm[:, i, None, None, :])
            ys.append(torch.einsum("bhpn,bn->bhp", state, cm[:, i]) + model.d_skip[None, :, None] * x[:, i])
        want = model.out_proj(model.norm(torch.stack(ys, 1).reshape(b, l, inner) * F.silu(z)))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_a_row_over_its_memory_target_says_where_the_peak_was_reached():
    from stitchcuda.bench.tables import _row_notes

    gib = 2 ** 30
    row = {"model": "op", "memory_ratio": 2.5, "optimize_device_peak_bytes": 10 * gib, "eager_peak_bytes": 2 * gib,
           "largest_tensor_bytes": gib, "stage_peak_bytes": {"capture": 0, "generate_and_check": 4 * gib,
                                                             "build": 6 * gib, "verify": 10 * gib,
                                                             "check_with_worker": 5 * gib}}
    (note,) = [line for line in _row_notes(row) if "memory:" in line]
    assert note == ("    memory: 10.00 GiB peak, reached by verify; eager peak 2.00 GiB, largest tensor 1.00 GiB; "
                    "stages: capture 0.00, generate_and_check 4.00, build 6.00, verify 10.00, check_with_worker 5.00")
    row.update(forward_largest_tensor_bytes=2 * gib, memory_ratio_forward=10 / 6)
    (note,) = [line for line in _row_notes(row) if "memory:" in line]
    assert "largest tensor 1.00 GiB (the forward's 2.00: ratio 1.67); stages:" in note
    row["memory_ratio"] = 0.9
    assert not [line for line in _row_notes(row) if "memory:" in line]  # within target: nothing to explain
