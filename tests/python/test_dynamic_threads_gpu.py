"""A program family called from several threads at once on one stream: a padded call writes its rows into
the member's own input buffer, so another thread's call to that member in between (padded or exact) must
wait until the run has read them; every thread gets its own answer."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import stitchcuda

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Rows(torch.nn.Module):
    """Rows independent along the batch, so the family pads."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(128, 512), torch.nn.Linear(512, 128)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_concurrent_calls_to_one_member_each_get_their_own_rows():
    torch.manual_seed(0)
    model = Rows().cuda().eval()
    with torch.no_grad():
        fast = stitchcuda.optimize(model, (torch.randn(16, 128, device="cuda"),), dynamic="auto",
                                   compare_compile=False, keep_slower=True)
        assert "refused" not in fast.report.dynamic, fast.report.dynamic.get("refused")
        # Sizes 13 and 11 run padded on the batch-16 member, 16 runs it exactly: all three share its buffers.
        inputs = [torch.randn(n, 128, device="cuda") for n in (13, 11, 16, 13)]
        wanted = [model(x) for x in inputs]
        got: list[list[torch.Tensor]] = [[] for _ in inputs]
        errors: list[BaseException] = []

        def calls(k: int) -> None:
            try:
                with torch.no_grad():
                    for _ in range(60):
                        got[k].append(fast(inputs[k]))
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        fast(inputs[0])  # the member's graph captured before the threads start
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # threads switch between a call's pad and its run as often as they can
        try:
            threads = [threading.Thread(target=calls, args=(k,)) for k in range(len(inputs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sys.setswitchinterval(interval)
        torch.cuda.synchronize()
    assert not errors, errors
    assert fast.padded_calls >= 3 * 60
    for k, (want, outs) in enumerate(zip(wanted, got)):
        assert len(outs) == 60
        for i, out in enumerate(outs):
            torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, k=k, i=i: f"thread {k}, call {i}: {m}")
