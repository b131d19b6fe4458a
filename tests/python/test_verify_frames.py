"""A worker's messages reach the judge in bounded time: the caller reads multiprocessing's framing itself, with
a deadline, so a candidate that writes the start of a frame to the worker's pipe and sleeps costs its
worker (a protocol violation, reward 0) instead of holding the caller's thread for ever. Real sockets and
a real sandboxed worker on the CPU."""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch

from stitchcuda.verify import VerifyConfig, WorkerPool, check, pool as pool_module, wire

PROBLEM = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(8, 32)]


def get_init_inputs():
    return []
"""
# Writes a frame's length and four bytes of it to every descriptor it can, then sleeps at import.
STALLS = """import os
import struct
import time

import torch.nn as nn

for fd in range(3, 256):
    try:
        os.write(fd, struct.pack("!i", 1000) + b"SCW1")
    except OSError:
        pass
time.sleep(600)


class ModelNew(nn.Module):
    def forward(self, x):
        return x.clamp(min=0)
"""


@pytest.fixture()
def pair():
    a, b = socket.socketpair()
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    yield sender, receiver
    sender.close()
    receiver.close()


def test_frames_read_with_a_deadline_are_the_frames_sent(pair):
    sender, receiver = pair
    tensors = [torch.rand(300, 100), torch.arange(7)]  # 120 kB: sent apart from its length
    frame = wire.pack("result", "n1", {"report": {"x": 1}}, tensors)
    threading.Thread(target=sender.send_bytes, args=(frame,)).start()
    got = wire.receive(receiver, kinds=("result",), deadline=time.monotonic() + 10)
    assert got.nonce == "n1" and got.body == {"report": {"x": 1}}
    assert all(torch.equal(a, b) for a, b in zip(tensors, got.tensors))
    sender.send_bytes(wire.pack("phase", "n1", {"phase": "run"}))  # a small one: length and bytes at once
    assert wire.receive(receiver, kinds=("phase",), deadline=time.monotonic() + 10).body == {"phase": "run"}


def test_a_frame_that_stops_arriving_is_refused_at_the_deadline(pair):
    sender, receiver = pair
    sender._send(b"\x00\x00\x03\xe8SCW1")  # a length of 1000, then four bytes of it
    started = time.monotonic()
    with pytest.raises(wire.WireError, match="stopped arriving: 4 of 1000 bytes"):
        wire.receive(receiver, deadline=started + 0.5)
    assert time.monotonic() - started < 5


def test_an_oversized_or_cut_frame_is_refused(pair):
    sender, receiver = pair
    sender.send_bytes(b"x" * 100)
    with pytest.raises(wire.WireError, match="longer than the 50 bytes"):
        wire.receive(receiver, limit_bytes=50, deadline=time.monotonic() + 5)
    sender.close()
    with pytest.raises(EOFError):
        wire.receive(receiver, deadline=time.monotonic() + 5)


def test_a_candidate_that_stalls_the_pipe_loses_its_worker_not_the_caller(monkeypatch):
    monkeypatch.setattr(pool_module, "FRAME_S", 2.0)
    config = VerifyConfig(device="cpu", timing_iters=2, warmup=1, compile_time_limit_s=3, run_time_limit_s=3)
    with WorkerPool(["cpu"]) as pool:
        started, out = time.monotonic(), {}
        # In a thread: were the read unbounded, the test would fail here instead of hanging.
        waiter = threading.Thread(target=lambda: out.update(report=check(PROBLEM, STALLS, config=config, pool=pool)),
                                  daemon=True)
        waiter.start()
        waiter.join(120)
        assert "report" in out, "the caller is still blocked reading the stalled frame"
        report, took = out["report"], time.monotonic() - started
        assert report.hack and not report.correct
        assert any(f.rule == "protocol-violation" for f in report.findings)
        assert "stopped arriving" in report.error["message"] and pool.replacements >= 1
        assert took < 60  # the judge's reference run, the worker's start, 3 s + 2 s: not for ever
        honest = check(PROBLEM, STALLS.split("for fd")[0] + STALLS.split("time.sleep(600)")[1], config=config,
                       pool=pool)
        # The next candidate gets a fresh worker and a verdict of its own (a torch-only one: no custom kernel).
        assert honest.correct and honest.error is None
        assert not any(f.rule == "protocol-violation" for f in honest.findings)


def test_a_frame_read_into_its_own_buffer_is_read_in_place():
    import struct

    first, second = torch.rand(16), torch.arange(7)
    frame = wire.pack("result", "n", {"report": {}}, [first, second])
    start = len(frame) - 16 * 4 - 7 * 8
    assert start % wire.ALIGN == 0  # the header is padded: the first tensor starts aligned
    data = bytearray(frame)
    message = wire.unpack(data, ("result",))
    data[start:start + 4] = struct.pack("<f", 5.0)
    assert message.tensors[0][0].item() == 5.0  # a view of the frame, not a copy
    copied = wire.unpack(bytes(frame), ("result",))
    assert torch.equal(copied.tensors[0], first) and torch.equal(copied.tensors[1], second)
