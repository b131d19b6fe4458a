"""The stitched program as a value: build one step by step, validate and plan it, save it as a
`.stitch` artifact, and run it — eagerly or replayed as one CUDA graph — from Python or C++.

    b = stitchcuda.ProgramBuilder()
    x = b.input([64, 256]); w = b.weight([512, 256], data=weight_bytes); bias = b.weight([512], data=...)
    y = b.output([64, 512])
    b.matmul(x, w, y, bias=bias, transpose_b=True, epilogue="bias_relu")
    program = b.build()
    program.save("mlp.stitch")
    model = stitchcuda.load("mlp.stitch")      # an nn.Module
    out = model(torch.randn(64, 256, device="cuda"))

See docs/program.md for the step kinds, the artifact layout and the executor, docs/family.md for
ProgramFamily: one program per member size of a dynamic range (batch buckets), run by FamilyExecutor, and
docs/decode.md for DecodePrograms: a prefill + decode pair over one KV cache, whose token loop
LoadedGenerator runs in C++.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Sequence

import torch

from . import _C
from .errors import InvalidArgumentError

__all__ = ["Program", "ProgramBuilder", "Executor", "ProgramModule", "ProgramFamily", "FamilyExecutor", "FamilyModule",
           "DecodePrograms", "LoadedGenerator", "load", "DTYPES"]

# Program dtype names and the torch dtypes they mean.
DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
    "i32": torch.int32, "i64": torch.int64, "u8": torch.uint8, "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype | str) -> str:
    """The program's name for a torch dtype ("f32" for torch.float32); names pass through."""
    if isinstance(dtype, str):
        return dtype
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"{dtype} has no program dtype; use one of {sorted(DTYPES.values(), key=str)}") from None


class ProgramBuilder:
    """Assembles a Program; every method mirrors C++ `stitchcuda::program::ProgramBuilder`.

    Buffers are integers (their ids). Kernel arguments are pairs: ``("in", buf)``, ``("out", buf)``,
    ``("inout", buf)`` for buffers, ``("i32", n)``, ``("i64", n)``, ``("f32", x)``, ``("f64", x)`` for scalars.
    """

    def __init__(self) -> None:
        self._b = _C.program.ProgramBuilder()

    def input(self, shape: Sequence[int], dtype: torch.dtype | str = "f32", *, strides=None, name: str = "") -> int:
        """A tensor the caller passes to every run."""
        return self._b.input(list(shape), dtype_name(dtype), strides, name)

    def output(self, shape: Sequence[int], dtype: torch.dtype | str = "f32", *, strides=None, name: str = "") -> int:
        """A tensor the program writes and returns."""
        return self._b.output(list(shape), dtype_name(dtype), strides, name)

    def intermediate(self, shape: Sequence[int], dtype: torch.dtype | str = "f32", *, strides=None,
                     name: str = "") -> int:
        """A temporary: placed in the arena by liveness planning, or, from 32 MiB
        (BufferPlan::large_storage_bytes), allocated by the executor for the steps that use it."""
        return self._b.intermediate(list(shape), dtype_name(dtype), strides, name)

    def state(self, shape: Sequence[int], dtype: torch.dtype | str = "f32", *, strides=None, name: str = "") -> int:
        """A tensor the program reads and updates in place across runs (a KV cache): steps may read it before
        any writes it, an executor binds it to the tensor shared for it (Program.share_state) or to zeros
        of its own, and the artifact stores its spec alone (a loaded program starts from zeros)."""
        return self._b.state(list(shape), dtype_name(dtype), strides, name)

    def weight(self, shape: Sequence[int] | torch.Tensor, dtype: torch.dtype | str = "f32", *, data=None,
               strides=None, name: str = "") -> int:
        """Constant data stored in the artifact: pass a tensor (any device), or a shape plus raw bytes. A
        tensor keeps its layout when it is a dense permutation (a channels-last filter stays NHWC in
        memory); any other is stored contiguous."""
        if isinstance(shape, torch.Tensor):
            t = shape.detach().to("cpu")
            if not t.is_contiguous() and _dense(t):  # storage order already dense: keep it
                return self._b.weight(list(t.shape), dtype_name(t.dtype), _storage_bytes(t), list(t.stride()), name)
            t = t.contiguous()
            return self._b.weight(list(t.shape), dtype_name(t.dtype), _tensor_bytes(t), None, name)
        return self._b.weight(list(shape), dtype_name(dtype), data, strides, name)

    def kernel(self, source: str, name: str, *, options: Sequence[str] = (), signature: Sequence[str] = ()) -> int:
        """Adds CUDA source to the kernel table; returns its index for launch()."""
        return self._b.kernel(source, name, list(options), list(signature))

    def launch(self, kernel: int, grid, block, args: Sequence[tuple[str, Any]], *, shared_mem: int = 0) -> "ProgramBuilder":
        """Appends a kernel launch with a fixed configuration."""
        self._b.launch(kernel, _dims(grid), _dims(block), list(args), shared_mem)
        return self

    def matmul(self, a: int, b: int, c: int, *, bias: int | None = None, transpose_a: bool = False,
               transpose_b: bool = False, batch: int = 1, alpha: float = 1.0, beta: float = 0.0,
               epilogue: str = "none", precision: str = "fp32") -> "ProgramBuilder":
        """Appends a cuBLASLt matmul: c = epilogue(alpha * op(a) @ op(b) + beta * c [+ bias]).

        Epilogues: none, relu, gelu, bias, bias_relu, bias_gelu (cuBLASLt's GELU is the tanh approximation,
        ``F.gelu(x, approximate="tanh")``). Precision: fp32, tf32, bf16, capped by the program's policy.
        """
        self._b.matmul(a, b, c, bias, transpose_a, transpose_b, batch, alpha, beta, epilogue, precision)
        return self

    def aten(self, op: str, inputs: Sequence[int], outputs: Sequence[int], **attributes: Any) -> "ProgramBuilder":
        """Appends any ATen op by name and overload ("aten::convolution", "aten::add.Tensor"); tensor
        arguments come from `inputs` in schema order, the others from keyword attributes by schema name."""
        self._b.aten(op, list(inputs), list(outputs), attributes)
        return self

    def view(self, kind: str, source: int, shape: Sequence[int], *, strides=None, storage_offset: int = 0) -> int:
        """A view (reshape, permute, slice) of `source` without a copy; returns the new buffer."""
        return self._b.view(kind, source, list(shape), strides, storage_offset)

    def precision(self, matmul: str = "fp32", *, cudnn_tf32: bool = True) -> "ProgramBuilder":
        """The lossiest matmul precision the program may use (PyTorch's defaults: fp32, cuDNN TF32)."""
        self._b.precision(matmul, cudnn_tf32)
        return self

    def verified_on(self, **hardware: str) -> "ProgramBuilder":
        """Records where the program was verified: device, arch, driver, cuda, torch."""
        self._b.verified_on(**hardware)
        return self

    def build(self) -> "Program":
        """Validates and returns the Program (errors name the first bad step)."""
        return Program(self._b.build())


class Program:
    """A stitched program: buffers, kernel table, steps, weights, precision policy and provenance."""

    def __init__(self, native: Any) -> None:
        self._p = native
        self._shared: dict[int, torch.Tensor] = {}

    def share_weight(self, buffer: int, tensor: torch.Tensor) -> None:
        """Executors made from this Program object read weight `buffer` from `tensor` in place instead of
        uploading a copy of the stored bytes (a program running beside the model it was built from holds
        no second copy of the model's parameters). `tensor` must have the weight's dtype, shape and strides;
        executors check its device and alignment and keep a reference to it. A weight built without bytes
        (data=None) takes them from `tensor` when the program is saved or serialized: the artifact always
        holds every weight, and a loaded program uploads its own copy."""
        self._share(buffer, tensor, "weight", "share the tensor the weight was built from")

    def share_state(self, buffer: int, tensor: torch.Tensor) -> None:
        """Executors made from this Program object read and update state `buffer` in `tensor`, in place (a
        model's KV cache buffer: the program's decode steps write the cache the model holds). `tensor` must
        have the state's dtype, shape and strides; executors check its device and alignment. A state not
        shared starts as zeros of the executor's own (Executor.state reads it)."""
        self._share(buffer, tensor, "state", "share a tensor of the state's layout")

    def _share(self, buffer: int, tensor: torch.Tensor, role: str, fix: str) -> None:
        spec = next((b for b in self.buffers if b["id"] == buffer), None)
        if spec is None or spec["role"] != role:
            raise InvalidArgumentError(f"buffer {buffer} is not a {role} of this program: share_{role} takes a {role}")
        def layout(shape, strides, dtype):  # strides matter along extents above 1 only, as for run()'s inputs
            return list(shape), [st if e > 1 else 0 for st, e in zip(strides, shape)], dtype

        dtype = _NAMES.get(tensor.dtype, str(tensor.dtype))
        if layout(spec["shape"], spec["strides"], spec["dtype"]) != layout(tensor.shape, tensor.stride(), dtype):
            raise InvalidArgumentError(
                f"{role} {buffer} ('{spec['name']}') is {spec['dtype']}{list(spec['shape'])} strides "
                f"{list(spec['strides'])} but the tensor shared for it is {dtype}{list(tensor.shape)} strides "
                f"{list(tensor.stride())}: {fix}")
        self._shared[buffer] = tensor

    @property
    def shared_weights(self) -> dict[int, torch.Tensor]:
        """Weight (and state) buffer id -> the tensor executors read it from (see share_weight, share_state)."""
        return dict(self._shared)

    @property
    def states(self) -> list[int]:
        """The state buffer ids (BufferRole::state), ascending."""
        return sorted(b["id"] for b in self.buffers if b["role"] == "state")

    @staticmethod
    def load(path: str | os.PathLike) -> "Program":
        """Reads a `.stitch` artifact; a truncated, tampered or wrong-version file, or one whose kernel sources
        are not UTF-8 text, raises InvalidArgumentError."""
        return Program._read(_C.program.Program.load(os.fspath(path)), f"the artifact {os.fspath(path)!r}")

    @staticmethod
    def deserialize(data: bytes) -> "Program":
        """Reads `.stitch` bytes (the errors of ``load``)."""
        return Program._read(_C.program.Program.deserialize(data), "the artifact's bytes")

    @staticmethod
    def _read(native: Any, what: str) -> "Program":
        """``native`` once its kernel sources read as text. The checksums only say the file is as it was
        written; a file built by hand can still carry sources in another encoding, which Python cannot read."""
        try:
            kernels = native.kernels
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(
                f"{what} holds a kernel source that is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                f"{exc.start} of a {len(exc.object)}-byte source): StitchCUDA writes UTF-8 only, so the file was "
                "altered or written by something else; rebuild it (optimize(), or ProgramBuilder then save())") from None
        from .jit import check_includes

        for index, kernel in enumerate(kernels):  # read as the preprocessor reads it, as for untrusted CUDA
            try:
                check_includes(kernel["source"], extra_flags=kernel["options"])
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"{what}: kernel {index} ('{kernel['name']}'): {exc.message}") from None
        return Program(native)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the artifact atomically (shared weights with the values their tensors hold now)."""
        with self._shared_bytes():
            self._p.save(os.fspath(path))

    def serialize(self) -> bytes:
        """The `.stitch` bytes (shared weights with the values their tensors hold now)."""
        with self._shared_bytes():
            return self._p.serialize()

    @contextlib.contextmanager
    def _shared_bytes(self):
        """The bytes of shared weights built without them (graph mode stores none for a parameter it reads
        in place), copied from their tensors for the length of a save, then let go of again: an artifact
        always holds every weight, and the host holds no copy of the model's weights in between."""
        weights = {b["id"] for b in self.buffers if b["role"] == "weight"}  # a state stores no bytes
        filled = [bid for bid in self._shared if bid in weights and not self._p.has_weight_data(bid)]
        try:
            for bid in filled:
                self._p.set_weight_data(bid, _storage_bytes(self._shared[bid]))
            yield
        finally:
            for bid in filled:
                self._p.drop_weight_data(bid)

    def validate(self) -> None:
        """Raises InvalidArgumentError naming the first problem."""
        self._p.validate()

    def buffer_plan(self) -> dict:
        """The buffer plan (C++ BufferPlan): liveness planning of the intermediates into one arena:
        arena_bytes, live_bound_bytes, placements..."""
        return self._p.plan()

    def compile_kernels(self, arch: str = "") -> None:
        """Stores CUBINs for `arch` (default: this device's, else sm_90a) so the artifact loads without NVRTC."""
        self._p.compile_kernels(arch)

    @property
    def buffers(self) -> list[dict]:
        return self._p.buffers

    @property
    def steps(self) -> list[dict]:
        return self._p.steps

    @property
    def kernels(self) -> list[dict]:
        return self._p.kernels

    @property
    def precision(self) -> dict:
        return self._p.precision

    @property
    def verified_on(self) -> dict:
        return self._p.verified_on

    @property
    def replay(self) -> dict:
        """{"mode": "graph" | "direct" | "unmeasured", "reason": ...}: how the program ran fastest where it
        was built (optimize times both); executors follow it unless given ``graphs``."""
        return self._p.replay

    def set_replay(self, mode: str, reason: str = "") -> None:
        """Records the measured replay mode ("graph", "direct" or "unmeasured"); saved in the artifact."""
        self._p.set_replay(mode, reason)

    def executor(self, *, graphs: bool | None = None, device: int | None = None) -> "Executor":
        """An Executor for this program (needs a GPU)."""
        return Executor(self, graphs=graphs, device=device)

    def __repr__(self) -> str:
        kinds: dict[str, int] = {}
        for s in self.steps:
            kinds[s["kind"]] = kinds.get(s["kind"], 0) + 1
        steps = ", ".join(f"{n} {k}" for k, n in kinds.items()) or "no steps"
        return f"<stitchcuda.Program: {len(self.buffers)} buffers, {steps}, {len(self.kernels)} kernels>"


class Executor:
    """Runs a Program: eager once, then one CUDA graph replay per call, or every call eagerly (the steps
    launched directly); thread-safe across streams. ``graphs`` (default: the program's measured
    ``replay`` mode, a graph when unmeasured) picks which.

    ``device_launch`` (default): a forward of at least ``device_launch_min_nodes`` graph nodes is
    replayed by one host launch of a single-kernel graph that launches it from the device, so host time
    per call grows little with the number of steps and the GPU runs its nodes sooner; smaller ones are
    launched from the host, which is faster there. ``stats()["host_replay_note"]`` says why a program
    replays from the host."""

    def __init__(self, program: Program, *, graphs: bool | None = None, device: int | None = None,
                 device_launch: bool = True, device_launch_min_nodes: int = 128) -> None:
        self.program = program
        # The kernels it runs are this process's own code, as jit's are (the Verifier's attribution):
        # recorded where they start to run, not for every Program built.
        from . import jit

        jit._COMPILED.update(str(k["name"]) for k in program.kernels if k.get("name"))
        self._e = _C.program.Executor(program._p, graphs, -1 if device is None else int(device), 32 << 20,
                                      bool(device_launch), int(device_launch_min_nodes), program.shared_weights)

    def run(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor] | None = None, *,
            stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
        """Runs on `stream` (default: the current stream); returns the outputs (allocated when not given)."""
        handle = 0 if stream is None else int(stream.cuda_stream)
        return self._e.run(list(inputs), None if outputs is None else list(outputs), handle)

    def static_inputs(self, stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
        """The graph's own input tensors on `stream`: write into them and pass them to run() to skip copies."""
        return self._e.static_inputs(0 if stream is None else int(stream.cuda_stream))

    def static_outputs(self, stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
        """The graph's own output tensors on `stream` (see static_inputs)."""
        return self._e.static_outputs(0 if stream is None else int(stream.cuda_stream))

    def set_weight(self, buffer: int, value: torch.Tensor) -> None:
        """Replaces a weight's values in place (captured graphs see them)."""
        self._e.set_weight(buffer, value)

    def release(self) -> None:
        """Frees what runs allocated (each stream's arena, workspace, static inputs and outputs, captured
        graph), keeping the weights, states and kernels: the next run allocates, and captures, again. Waits
        for the GPU; not while another thread runs the program."""
        self._e.release()

    @property
    def states(self) -> list[int]:
        """The program's state buffer ids, ascending."""
        return list(self._e.states)

    def state(self, buffer: int) -> torch.Tensor:
        """The tensor state `buffer` lives in (the one shared for it, else the executor's own): what the runs
        wrote; writing it between runs changes what the next run reads. Runs of a program with states belong
        on one stream at a time (the states are the executor's, not a stream's)."""
        return self._e.state(buffer)

    def reset_states(self) -> None:
        """Fills every state with zeros (a new sequence); waits for the GPU."""
        self._e.reset_states()

    @property
    def device(self) -> int:
        return self._e.device

    @property
    def warnings(self) -> list[str]:
        """E.g. that the program was verified on another GPU (its kernels were recompiled here)."""
        return self._e.warnings

    def stats(self) -> dict:
        """runs, eager_runs, replays, device_launches, captures, copies_skipped, instances, arena_bytes,
        workspace_bytes (an instance's cuBLASLt workspace: the most its matmuls' chosen algorithms use, none
        without a matmul), weight_bytes (uploaded into its own memory), shared_weight_bytes (read in place from the tensors
        shared with Program.share_weight), state_bytes (its own zero-filled states), shared_state_bytes (states in
        the tensors shared with Program.share_state), host_replay_note."""
        return self._e.stats()


class ProgramModule(torch.nn.Module):
    """An nn.Module that runs a Program: forward(*inputs) returns the output, or a tuple of them."""

    def __init__(self, program: Program, *, graphs: bool | None = None, device: int | None = None) -> None:
        super().__init__()
        self.program = program
        self.executor = Executor(program, graphs=graphs, device=device)
        for text in self.executor.warnings:
            warnings.warn(f"stitchcuda: {text}", RuntimeWarning, stacklevel=2)
        specs = {b["id"]: b for b in program.buffers}
        self._inputs = [specs[i] for i in self.executor._e.inputs]

    def forward(self, *inputs: torch.Tensor):
        if len(inputs) != len(self._inputs):
            raise TypeError(f"the program takes {len(self._inputs)} input(s), {len(inputs)} given")
        ready = []
        for t, spec in zip(inputs, self._inputs):
            if isinstance(t, torch.Tensor) and not t.is_contiguous() and _contiguous_spec(spec):
                t = t.contiguous()
            ready.append(t)
        outs = self.executor.run(ready)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def stats(self) -> dict:
        return self.executor.stats()

    def release(self) -> None:
        """Executor.release: the program's working memory goes back until the next call."""
        self.executor.release()

    def extra_repr(self) -> str:
        return repr(self.program)


class _ProgramsFile:
    """What ProgramFamily and DecodePrograms share: several programs of one model in one file, each distinct
    weight once, checked by their C++ class (``_C.program.<_NATIVE>``) on validate, save and load."""

    _NATIVE = ""  # the C++ class
    _WHAT = ""    # how messages name a file: "the family file"

    def _programs(self) -> list[Program]:
        raise NotImplementedError

    def _make_native(self):
        raise NotImplementedError

    @staticmethod
    def _from_native(native: Any, what: str):
        raise NotImplementedError

    def _native(self, *, with_shared_bytes: bool = False):
        """The C++ value (copies of the programs). ``with_shared_bytes``: weights read in place from a model's
        tensors and stored without bytes take those tensors' values, as Program.save does."""
        with contextlib.ExitStack() as stack:
            if with_shared_bytes:
                for program in self._programs():
                    stack.enter_context(program._shared_bytes())
            return self._make_native()

    def validate(self) -> None:
        """Raises InvalidArgumentError naming what is at fault ("dims[0].max", "decode's state 'k' is ...")."""
        self._native().validate()

    def save(self, path: str | os.PathLike) -> None:
        """Writes the file atomically (validates first): each program once, each distinct weight once."""
        self._native(with_shared_bytes=True).save(os.fspath(path))

    def serialize(self) -> bytes:
        """The file's bytes."""
        return self._native(with_shared_bytes=True).serialize()

    @classmethod
    def load(cls, path: str | os.PathLike):
        """Reads a file ``save`` wrote; a truncated, damaged, wrong-version or invalid one raises InvalidArgumentError."""
        path = os.fspath(path)
        return cls._from_native(getattr(_C.program, cls._NATIVE).load(path), f"{cls._WHAT} {path!r}")

    @classmethod
    def deserialize(cls, data: bytes):
        """Reads the file's bytes (the errors of ``load``)."""
        return cls._from_native(getattr(_C.program, cls._NATIVE).deserialize(data), f"{cls._WHAT}'s bytes")


class ProgramFamily(_ProgramsFile):
    """Programs that differ only in the sizes of some dims — one per member size of a dynamic range (batch
    buckets 1, 2, 4, ..., or sizes built as they occur) — served together by FamilyExecutor.

    ``dims``: ``dict(name=, min=, max=, pad=False, inputs=[(input, axis)], outputs=[(output, axis)])`` each:
    the range of sizes served and the axes carrying the dim (inputs and outputs in buffer-id order, as
    Executor.run takes them). ``pad=True``: a member of a larger size may serve a call, its inputs
    zero-padded and its outputs narrowed back (right where positions along the dim do not mix, as samples
    of a batch). ``members``: ``(sizes, Program)`` pairs, one size per dim. ``validate()`` says what is wrong.
    """

    def __init__(self, dims: Sequence[dict], members: Sequence[tuple[Sequence[int], Program]] = ()) -> None:
        self.dims: list[dict] = [dict(d) for d in dims]
        self.members: list[tuple[tuple[int, ...], Program]] = []
        for sizes, program in members:
            self.add(sizes, program)

    def add(self, sizes: Sequence[int], program: Program) -> None:
        """Appends a member (checked by validate(), save() and FamilyExecutor)."""
        if not isinstance(program, Program):
            raise InvalidArgumentError(f"a family member is a Program, not {type(program).__name__}")
        self.members.append((tuple(int(s) for s in sizes), program))

    _NATIVE, _WHAT = "ProgramFamily", "the family file"

    def _programs(self) -> list[Program]:
        return [program for _, program in self.members]

    def _make_native(self):
        return _C.program.ProgramFamily(self.dims, [(list(sizes), p._p) for sizes, p in self.members])

    @staticmethod
    def _from_native(native: Any, what: str) -> "ProgramFamily":
        family = ProgramFamily(native.dims)
        for i, sizes in enumerate(native.member_sizes):
            family.add(sizes, Program._read(native.program(i), f"{what}, member {i}"))
        return family

    def sizes_of(self, shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
        """Each dim's size in a call whose inputs have these shapes (an error names a size out of range)."""
        if not self.members:
            raise InvalidArgumentError("the family has no members yet: add one before asking for a call's sizes")
        return tuple(_C.program.call_sizes(self.dims, _inputs_of(self.members[0][1]), [list(s) for s in shapes]))

    def select(self, sizes: Sequence[int]) -> int:
        """The index of the member that serves ``sizes``: exactly, else the smallest padded one."""
        return _C.program.select_member(self.dims, [list(s) for s, _ in self.members], list(sizes))

    def __repr__(self) -> str:
        dims = ", ".join(f"{d.get('name')} {d.get('min')}..{d.get('max')}{' padded' if d.get('pad') else ''}" for d in self.dims)
        return f"<stitchcuda.ProgramFamily: {dims}; {len(self.members)} members {[s for s, _ in self.members]}>"


class FamilyExecutor:
    """Runs a ProgramFamily on the GPU: each call goes to the member of its sizes, or a larger one with the
    inputs zero-padded and the outputs narrowed back; a size outside a dim's range raises naming the dim
    and the range. Members' equal weights are uploaded once; at most ``max_resident`` members hold their
    working memory (arena, static buffers, CUDA graph), the least recently run one released first.
    Thread-safe like Executor; ``add_member`` adds a program built later beside running calls."""

    def __init__(self, family: ProgramFamily, *, graphs: bool | None = None, device: int | None = None,
                 max_resident: int = 4) -> None:
        self.family = family
        for _, program in family.members:
            _note_kernels(program)
        self._e = _C.program.FamilyExecutor(family._native(), graphs, -1 if device is None else int(device),
                                            int(max_resident), [p.shared_weights for _, p in family.members])

    def run(self, inputs: Sequence[torch.Tensor], *, stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
        """Runs on ``stream`` (default: the current stream); returns new output tensors."""
        return self._e.run(list(inputs), 0 if stream is None else int(stream.cuda_stream))

    def add_member(self, sizes: Sequence[int], program: Program) -> None:
        """Adds the program built for ``sizes`` (it also joins ``family.members``)."""
        _note_kernels(program)
        self._e.add_member([int(s) for s in sizes], program._p, program.shared_weights)
        self.family.add(sizes, program)

    # release() (every member's working memory back until the next call), device, warnings: as Executor's.
    release = Executor.release
    device = Executor.device
    warnings = Executor.warnings

    @property
    def member_sizes(self) -> list[list[int]]:
        return self._e.member_sizes

    def stats(self) -> dict:
        """runs, padded_runs, releases, resident, weight_bytes (uploaded once for all members),
        shared_weight_bytes, and members: [{sizes, calls, padded_calls, resident, executor: Executor.stats()}]."""
        return self._e.stats()


class FamilyModule(ProgramModule):
    """An nn.Module that runs a ProgramFamily: forward(*inputs) at any size the family serves."""

    def __init__(self, family: ProgramFamily, *, graphs: bool | None = None, device: int | None = None,
                 max_resident: int = 4) -> None:
        torch.nn.Module.__init__(self)
        self.program = family
        self.executor = FamilyExecutor(family, graphs=graphs, device=device, max_resident=max_resident)
        for text in self.executor.warnings:
            warnings.warn(f"stitchcuda: {text}", RuntimeWarning, stacklevel=2)
        self._inputs = _inputs_of(family.members[0][1])


class DecodePrograms(_ProgramsFile):
    """A causal LM's prefill and decode programs over one static KV cache (their states, paired by name),
    as ``StaticCacheGenerator.save`` writes them: ``prefill`` takes the prompt (``[batch, prompt_length]``
    token ids and their positions), ``decode`` one token, both return logits; ``max_length`` is the cache's
    positions. ``validate()`` says what does not make a pair; ``generator()`` runs the token loop in C++."""

    def __init__(self, prefill: Program, decode: Program, *, max_length: int) -> None:
        for role, program in (("prefill", prefill), ("decode", decode)):
            if not isinstance(program, Program):
                raise InvalidArgumentError(f"the {role} is a Program, not {type(program).__name__}")
        self.prefill, self.decode, self.max_length = prefill, decode, int(max_length)

    _NATIVE, _WHAT = "DecodePrograms", "the prefill + decode file"

    def _programs(self) -> list[Program]:
        return [self.prefill, self.decode]

    def _make_native(self):
        return _C.program.DecodePrograms(self.prefill._p, self.decode._p, self.max_length)

    @staticmethod
    def _from_native(native: Any, what: str) -> "DecodePrograms":
        return DecodePrograms(Program._read(native.prefill, f"{what}, prefill"), Program._read(native.decode, f"{what}, decode"),
                              max_length=native.max_length)

    @property
    def state_pairs(self) -> list[tuple[int, int]]:
        """(prefill state id, decode state id) of every state, paired by name."""
        return [tuple(p) for p in self._native().state_pairs]

    @property
    def batch_size(self) -> int:
        return int(_inputs_of(self.prefill)[0]["shape"][0])

    @property
    def prompt_length(self) -> int:
        return int(_inputs_of(self.prefill)[0]["shape"][1])

    def generator(self, *, graphs: bool = True, device: int | None = None) -> "LoadedGenerator":
        """The C++ token loop over these programs (needs a GPU)."""
        return LoadedGenerator(self, graphs=graphs, device=device)

    def __repr__(self) -> str:
        return (f"<stitchcuda.DecodePrograms: batch {self.batch_size}, prompts of {self.prompt_length} tokens, "
                f"{self.max_length} cache positions, {len(self.state_pairs)} states>")


class LoadedGenerator:
    """Generation (greedy or sampled) from a DecodePrograms in C++ (torch::Generator): the prefill, then one
    decode step per token replayed as a CUDA graph, both over one cache the generator owns (zeroed at each
    call); the next token is chosen on the device. What ``stitchcuda.load`` returns for a prefill + decode file."""

    def __init__(self, programs: DecodePrograms, *, graphs: bool = True, device: int | None = None) -> None:
        self.programs = programs
        for program in (programs.prefill, programs.decode):
            _note_kernels(program)
        self._g = _C.program.Generator(programs._native(with_shared_bytes=True), bool(graphs),
                                       -1 if device is None else int(device))
        for text in self._g.warnings:
            warnings.warn(f"stitchcuda: {text}", RuntimeWarning, stacklevel=2)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None, *,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """The prompts ``input_ids`` [batch, prompt_length] followed by ``max_new_tokens`` tokens, greedy or
        sampled, as StaticCacheGenerator.generate returns them (on the GPU); a sample draws from a generator
        started at `seed` each call (StaticCacheGenerator's with torch.Generator('cuda').manual_seed(seed)
        draws the same tokens). Bad sampling options are refused by the C++ Generator's own check (the rules
        StaticCacheGenerator.generate applies), raised here as InvalidArgumentError."""
        options = _C.program.SamplingOptions(
            do_sample=bool(do_sample), temperature=float(temperature), top_k=0 if top_k is None else int(top_k),
            top_p=1.0 if top_p is None else float(top_p), seed=int(seed),
            eos_token_id=-1 if eos_token_id is None else int(eos_token_id))
        new = self._g.generate(input_ids, int(max_new_tokens), 0 if stream is None else int(stream.cuda_stream),
                               options)
        return torch.cat([input_ids.to(new.device, torch.long), new], dim=1)

    @property
    def device(self) -> int:
        return self._g.device

    def stats(self) -> dict:
        """sequences, tokens, and the prefill's and decode's Executor.stats()."""
        return self._g.stats()


def load(path: str | os.PathLike, *, graphs: bool | None = None,
         device: int | None = None) -> ProgramModule | LoadedGenerator:
    """Loads a `.stitch` artifact — one program, or a program family (a FamilyModule) — as a callable
    nn.Module running on the GPU; a prefill + decode file (StaticCacheGenerator.save) as a LoadedGenerator."""
    with contextlib.suppress(OSError), open(path, "rb") as f:
        head = f.read(8)
        if _C.program.is_family_artifact(head):
            return FamilyModule(ProgramFamily.load(path), graphs=graphs, device=device)
        if _C.program.is_decode_artifact(head):
            return LoadedGenerator(DecodePrograms.load(path), graphs=graphs is not False, device=device)
    return ProgramModule(Program.load(path), graphs=graphs, device=device)


def _inputs_of(program: Program) -> list[dict]:
    """The program's input buffers in run() order (buffer id)."""
    return sorted((b for b in program.buffers if b["role"] == "input"), key=lambda b: b["id"])


def _note_kernels(program: Program) -> None:
    """The program's kernels are this process's own code from here on (Executor's note, for the Verifier)."""
    from . import jit

    jit._COMPILED.update(str(k["name"]) for k in program.kernels if k.get("name"))


def _dims(v) -> list[int]:
    return [int(v)] if isinstance(v, int) else [int(x) for x in v]


def _contiguous_spec(spec: dict) -> bool:
    expected, stride = [], 1
    for extent in reversed(spec["shape"]):
        expected.append(stride)
        stride *= max(extent, 1)
    return list(reversed(expected)) == list(spec["strides"])


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its span of storage in some order of its dimensions (a contiguous
    tensor, or a permutation of one: channels-last)."""
    return t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d))).is_contiguous()


def _storage_bytes(t: torch.Tensor) -> bytes:
    """A dense tensor's bytes in storage order (what a weight buffer with its strides holds)."""
    return _tensor_bytes(t.detach().to("cpu").permute(sorted(range(t.dim()), key=lambda d: -t.stride(d))))


def _tensor_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()
