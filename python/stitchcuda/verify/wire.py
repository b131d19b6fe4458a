"""What a verification worker may say to the judge, as bytes: one frame per message, a JSON header and the
raw bytes of its tensors (dtype and shape in the header), bounded in size and read field by field. Nothing
that arrives from a worker is unpickled: a worker runs candidate code, so its messages are data to check.

Frame: b"SCW1", the header's length (4 bytes, big-endian), the header (UTF-8 JSON: kind, nonce, body,
tensors), then the tensors' bytes back to back, exactly as many as the header's dtypes and shapes make.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

__all__ = ["WireError", "Message", "pack", "unpack", "send", "receive", "KINDS", "MAX_HEADER_BYTES",
           "DEFAULT_LIMIT_BYTES", "encode_value", "decode_value"]

MAGIC = b"SCW1"
# A report with its compile log (20 kB at most) and profile is tens of kB: 4 MiB is generous and bounds
# what the judge parses as JSON.
MAX_HEADER_BYTES = 4 << 20
# The most a worker may send in one message unless the judge allows more (outputs of the trials).
DEFAULT_LIMIT_BYTES = 2 << 30
KINDS = ("ready", "startup-error", "phase", "result")
# "calibrate"/"calibrated" bracket the empty timed phase run before the candidate loads, "timed"/"timed-end"
# the candidate's timed calls: the judge clocks both (judge.py, "the judge's clock").
PHASES = ("compile", "run", "calibrate", "calibrated", "timed", "timed-end")
MAX_DIMS = 16
# A frame's first tensor starts at a multiple of this many bytes (the header is padded to it), and each next
# one where the sizes before it allow, so the judge reads them in place.
ALIGN = 64

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2)}


class WireError(ValueError):
    """A message that is not a well-formed frame of this protocol; the text says what is wrong with it."""


@dataclass
class Message:
    kind: str
    nonce: str
    body: dict[str, Any]
    tensors: list[torch.Tensor] = field(default_factory=list)


def pack(kind: str, nonce: str, body: dict[str, Any], tensors: Sequence[torch.Tensor] = ()) -> bytearray:
    """One frame. Tensors go as their contiguous CPU bytes, each copied once into the frame (a result carries
    the outputs of every trial: a GEMM's are gigabytes, and each extra copy costs a second of host time)."""
    hosts, specs = [], []
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        specs.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)})
        hosts.append(t.reshape(-1).view(torch.uint8))
    header = json.dumps({"kind": kind, "nonce": nonce, "body": body, "tensors": specs},
                        default=_plain).encode("utf-8")
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(f"a {kind!r} header of {len(header)} bytes is more than the {MAX_HEADER_BYTES} allowed")
    header += b" " * (-(8 + len(header)) % ALIGN)  # JSON's trailing blanks: the tensors start aligned
    frame = bytearray(8 + len(header) + sum(h.numel() for h in hosts))
    frame[:8] = MAGIC + struct.pack(">I", len(header))
    offset = 8 + len(header)
    frame[8:offset] = header
    view = memoryview(frame)
    for h in hosts:
        if h.numel():
            view[offset:offset + h.numel()] = h.numpy()
            offset += h.numel()
    return frame


def unpack(data: bytes | bytearray, kinds: Sequence[str] = KINDS) -> Message:
    """The message in ``data``; WireError naming the first thing that is wrong with it."""
    view = memoryview(data)
    if len(data) < 8 or data[:4] != MAGIC:
        raise WireError("not a frame of the worker protocol (no magic)")
    (size,) = struct.unpack(">I", data[4:8])
    if size > MAX_HEADER_BYTES or 8 + size > len(data):
        raise WireError(f"a header length of {size} bytes in a frame of {len(data)}")
    try:
        header = json.loads(bytes(view[8:8 + size]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"the header is not JSON: {type(exc).__name__}") from None
    if not isinstance(header, dict) or set(header) != {"kind", "nonce", "body", "tensors"}:
        raise WireError("the header must hold exactly kind, nonce, body and tensors")
    kind, nonce, body, specs = header["kind"], header["nonce"], header["body"], header["tensors"]
    if kind not in kinds:
        raise WireError(f"a message of kind {str(kind)[:40]!r} where {', '.join(kinds)} may come")
    if not isinstance(nonce, str) or len(nonce) > 64:
        raise WireError("the nonce must be a short string")
    if not isinstance(body, dict) or not isinstance(specs, list):
        raise WireError("body must be an object and tensors a list")
    tensors, offset = [], 8 + size
    for i, spec in enumerate(specs):
        dtype, shape = _spec(i, spec)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > len(data):
            raise WireError(f"tensor {i} ({spec['dtype']} {shape}) needs {nbytes} bytes; the frame has "
                            f"{len(data) - offset} left")
        if not nbytes:
            tensor = torch.empty(0, dtype=torch.uint8)
        elif isinstance(data, bytearray) and offset % dtype.itemsize == 0:
            # A view of the frame (read into a buffer of its own: receive with a deadline), not a copy.
            tensor = torch.frombuffer(data, dtype=torch.uint8, offset=offset, count=nbytes)
        else:
            tensor = torch.frombuffer(bytearray(view[offset:offset + nbytes]), dtype=torch.uint8)  # owns a copy
        tensors.append(tensor.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype))
        offset += nbytes
    if offset != len(data):
        raise WireError(f"{len(data) - offset} bytes after the last tensor")
    return Message(kind, nonce, body, tensors)


def _spec(i: int, spec: Any) -> tuple[torch.dtype, list[int]]:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape"}:
        raise WireError(f"tensor {i}: a description must hold exactly dtype and shape")
    dtype = _DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise WireError(f"tensor {i}: dtype {str(spec['dtype'])[:40]!r} is not one a result may have")
    shape = spec["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or \
            not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
        raise WireError(f"tensor {i}: the shape must be a list of at most {MAX_DIMS} sizes")
    return dtype, shape


def send(conn: Any, kind: str, nonce: str, body: dict[str, Any], tensors: Sequence[torch.Tensor] = ()) -> None:
    """Writes one frame to a multiprocessing Connection (``send_bytes``: its own length prefix, no pickle)."""
    conn.send_bytes(pack(kind, nonce, body, tensors))


def receive(conn: Any, limit_bytes: int = DEFAULT_LIMIT_BYTES, kinds: Sequence[str] = KINDS,
            deadline: float | None = None) -> Message:
    """Reads one frame of at most ``limit_bytes``. EOFError when the worker is gone; WireError for anything
    that is not a frame (too long, malformed, or with ``deadline``, a time.monotonic() value, not complete
    by then): the stream is then out of step and the worker must go."""
    if deadline is not None:
        return unpack(_read_frame(conn.fileno(), limit_bytes, deadline), kinds)
    try:
        data = conn.recv_bytes(limit_bytes)
    except OSError as exc:
        if "bad message length" in str(exc):
            raise WireError(f"a message longer than the {limit_bytes} bytes allowed") from None
        raise
    return unpack(data, kinds)


def _read_frame(fd: int, limit_bytes: int, deadline: float) -> bytearray:
    """One message of multiprocessing.Connection's framing (a 4-byte big-endian length, or -1 and an 8-byte
    one), read straight into one buffer, waiting for each part at most until ``deadline``: a worker that
    writes the start of a frame and stops is a WireError then, not a caller blocked for ever."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)

    def exactly(n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise WireError(f"a message stopped arriving: {got} of {n} bytes came before the deadline")
            k = os.readv(fd, [view[got:]])
            if k == 0:
                raise EOFError
            got += k
        return buf

    (size,) = struct.unpack("!i", exactly(4))
    if size == -1:
        (size,) = struct.unpack("!Q", exactly(8))
    if not 0 <= size <= limit_bytes:
        raise WireError(f"a message longer than the {limit_bytes} bytes allowed")
    return exactly(size)


def encode_value(value: Any, tensors: list[torch.Tensor]) -> Any:
    """A forward's output as JSON, its tensors appended to ``tensors`` (referred to by position)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"tensor": len(tensors) - 1, "plain": type(value) is torch.Tensor}
    if isinstance(value, (list, tuple)):
        return {"seq": [encode_value(v, tensors) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    return {"opaque": type(value).__name__[:60]}


def decode_value(node: Any, tensors: Sequence[torch.Tensor], depth: int = 0) -> Any:
    """The inverse of ``encode_value`` (flattened sequences come back as lists); WireError when malformed."""
    if depth > 32 or not isinstance(node, dict) or len(node) > 2:
        raise WireError("an output description is malformed")
    if "tensor" in node:
        k = node["tensor"]
        if type(k) is not int or not 0 <= k < len(tensors):
            raise WireError(f"an output refers to tensor {str(k)[:20]}, of {len(tensors)} sent")
        return tensors[k]
    if "seq" in node and isinstance(node["seq"], list):
        return [decode_value(v, tensors, depth + 1) for v in node["seq"]]
    if "value" in node and (node["value"] is None or isinstance(node["value"], (bool, int, float, str))):
        return node["value"]
    if "opaque" in node:
        return _Opaque(str(node["opaque"]))
    raise WireError("an output description is malformed")


class _Opaque:
    """An output that was neither a tensor nor a plain value: it matches nothing."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)
