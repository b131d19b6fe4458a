"""The one pipeline's GPU journey: `optimize(model, inputs, llm=...)` on a model whose heavy group the
template Coder cannot serve (a row scan: ATen's cumsum between two template kernels, six passes over
256 MiB). A scripted model plays the Planner, which picks the scan and its neighbours as one target, and
the Coder, whose first kernel step does not compile, second is wrong and third is correct. Verification
is the real one (isolated worker, trials, timing, CUPTI); the winner enters the Program, which is saved
and run by the C++ serving example.

STITCHCUDA_GRAPH_AGENTS_RUN_DIR keeps the run directory there (scripts/gpu-check brings it back).
STITCHCUDA_SERVE names the serving example's binary (scripts/gpu-check builds it through ctest)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

import stitchcuda

DATA = Path(__file__).resolve().parent / "data"
SCAN = (DATA / "scan_kernel.cu").read_text()
ROWS, COLS = 16384, 4096


def scan_template_off(monkeypatch) -> None:
    """Gives the agents ATen's cumsum as their target: the planner's scan template, which would take it
    otherwise (one "scan" group the scripted Planner does not pick), is switched off."""
    from stitchcuda.graph.planner import Group, OfflinePlanner

    monkeypatch.setattr(OfflinePlanner, "_scan", staticmethod(
        lambda node: Group("aten", [node], "cumsum stays an ATen step (the scan template is off in this test)")))


@pytest.fixture(autouse=True)
def _cumsum_on_aten(monkeypatch):
    scan_template_off(monkeypatch)


class ScanModel(torch.nn.Module):
    """log1p(cumsum(sigmoid(x) * w)) over rows: sigmoid+mul, cumsum and log1p are three groups. The
    summands are positive, so fp32 prefix sums stay within 1e-4 of each other in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(COLS))

    def forward(self, x):
        return torch.log1p(torch.cumsum(torch.sigmoid(x) * self.w, dim=-1))


LAUNCH = {"kernel": "scan_sigmoid_log1p", "grid": ["in0.shape[0]"], "block": [1024], "shared_bytes": 0,
          "args": ["in0", "in1", "out0", "in0.shape[0]", "in0.shape[1]"]}


def kernel_step(source: str) -> str:
    return f"One block per row.\n\n```cuda\n{source}```\n\n```json\n{json.dumps(LAUNCH)}\n```\n"


REPLIES = [
    kernel_step(SCAN.replace("v[1] += v[0]; v[2]", "v[1] += v[0] v[2]")),                     # does not compile
    kernel_step(SCAN.replace("(warp > 0 ? warp_sums[warp - 1] : 0.0f)", "0.0f")),                # no cross-warp prefix
    kernel_step(SCAN),                                                                              # correct
]

PLAN = {"summary": "One pass per row: sigmoid times w, the scan and log1p in registers.",
        "steps": [{"title": "Scan each row in one block", "detail": "four elements per thread, warp shuffles"}],
        "fusion_groups": [{"ops": ["sigmoid", "mul", "cumsum", "log1p"], "kernel": "scan_sigmoid_log1p",
                           "rationale": "six passes over DRAM become two"}],
        "bottlenecks": ["DRAM bandwidth"], "risks": ["fp32 summation order"], "constraints": ["fp32"]}


class Script:
    """Plays every agent; the graph Planner picks all computing groups it is shown as one target."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = replies
        self.coder_prompts: list[str] = []
        self.planner_prompt = ""

    def __call__(self, messages):
        first = messages[0]["content"]
        if "## The groups" in first:
            self.planner_prompt = first
            ids = re.findall(r"^\| (g\d+) \| (?:pointwise|aten|reduction) \|", first, re.M)
            return json.dumps({"targets": [{"groups": ids, "strategy": "one block per row, scan in registers"}]})
        if first.startswith("You are the Planner"):
            return json.dumps(PLAN)
        if first.startswith("You are the Verifier"):
            return "Fix the failure first."
        self.coder_prompts.append(messages[-1]["content"])
        return self.replies[min(len(self.coder_prompts), len(self.replies)) - 1]


@pytest.mark.gpu
def test_an_llm_kernel_step_wins_its_target_enters_the_program_and_serves_from_cpp(tmp_path, record_property):
    torch.manual_seed(0)
    model = ScanModel().cuda().eval()
    x = torch.randn(ROWS, COLS, device="cuda")
    run_dir = Path(os.environ.get("STITCHCUDA_GRAPH_AGENTS_RUN_DIR") or tmp_path / "run")
    script = Script(REPLIES)

    offline = stitchcuda.optimize(model, (x,), compare_compile=False)
    fast = stitchcuda.optimize(model, (x,), llm=script, run_dir=run_dir, attempts=3, compare_compile=False)
    report = fast.report
    print(report)
    assert report.status == "optimized", report.reason
    assert "measured us" in script.planner_prompt and "cumsum" in script.planner_prompt

    [target] = report.targets
    assert target["winner"] == "llm", target
    assert target["llm"]["attempt"] == 3
    assert target["template"]["correct"] and target["llm"]["speedup"] > target["template"]["speedup"]
    assert any(k["name"] == "scan_sigmoid_log1p" for k in fast.program.kernels)

    # What the Coder read: the compile error's line, then the first mismatch.
    after_compile, after_wrong = script.coder_prompts[1:3]
    assert re.search(r"error", after_compile) and "expected" in after_compile.lower()
    assert re.search(r"expected -?[0-9.e+-]+, got -?[0-9.e+-]+", after_wrong)

    tdir = run_dir / "targets" / "01-t1"
    attempts = [json.loads((tdir / "attempts" / f"00{k}" / "attempt.json").read_text()) for k in (1, 2, 3)]
    assert [a["feedback"]["kind"] for a in attempts][:2] == ["compile", "incorrect"]
    assert attempts[2]["report"]["correct"] and attempts[2]["reward"]["value"] > 0
    assert json.loads((tdir / "result.json").read_text())["winner"] == "llm"
    lines = [json.loads(l) for l in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert lines[0]["agent"] == "planner" and sum(l["agent"] == "coder" for l in lines) == 3

    with torch.no_grad():
        want = model(x)
        got = fast(x)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)

    artifact = tmp_path / "scan.stitch"
    fast.save(artifact)
    reloaded = stitchcuda.program.load(artifact)
    again = reloaded(x)
    again = again[0] if isinstance(again, (list, tuple)) else again
    assert torch.allclose(again, want, atol=1e-4, rtol=1e-4)
    serve = os.environ.get("STITCHCUDA_SERVE")
    if serve and Path(serve).exists():
        done = subprocess.run([serve, str(artifact), "--threads", "2", "--requests", "20"], capture_output=True,
                              text=True, timeout=300)
        ok = [l for l in done.stdout.splitlines() if l.startswith("ok ")]
        assert done.returncode == 0 and ok and "mismatches=0" in ok[0], done.stdout + done.stderr

    t_off, t_llm = offline.report.timing, report.timing
    summary = json.loads((run_dir / "summary.json").read_text())
    line = (f"journey: target ATen 1.00x, template {target['template']['speedup']:.2f}x, LLM {target['llm']['speedup']:.2f}x; "
          f"whole model: offline {t_off['speedup_eager']:.2f}x, with the agents {t_llm['speedup_eager']:.2f}x over eager "
          f"({t_off['stitched_ms']:.4f} -> {t_llm['stitched_ms']:.4f} ms); loop overhead {summary['overhead_s']:.3f} s "
          f"of {summary['wall_s']:.2f} s")
    print(line)
    # The junit XML that scripts/gpu-check brings back keeps the numbers and the report.
    record_property("journey", line)
    record_property("report", str(report))


HACK = """```python
import torch

class ModelNew(torch.nn.Module):
    def forward(self, in0, in1):
        return torch.log1p(torch.cumsum(torch.sigmoid(in0) * in1, dim=-1))
```
"""


# A timing trick in CUDA: the kernel works on its first call only (a device-global counter), so every
# later call, the timed ones among them, leaves the output as it finds it.
FIRST_CALL_ONLY = kernel_step(SCAN.replace("extern \"C\"", "__device__ unsigned int stitch_calls;\nextern \"C\"", 1)
                              .replace("  const int row = blockIdx.x;\n",
                                       "  __shared__ unsigned skip;\n"
                                       "  if (threadIdx.x == 0) skip = atomicAdd(&stitch_calls, 1u) >= gridDim.x;\n"
                                       "  __syncthreads();\n  if (skip) return;\n  const int row = blockIdx.x;\n", 1))


@pytest.mark.gpu
@pytest.mark.parametrize("reply", [HACK, FIRST_CALL_ONLY], ids=["torch-does-the-work", "works-on-first-call-only"])
def test_a_hacking_reply_never_enters_the_program(tmp_path, reply):
    model = ScanModel().cuda().eval()
    x = torch.randn(256, COLS, device="cuda")
    fast = stitchcuda.optimize(model, (x,), llm=Script([reply]), run_dir=tmp_path / "run", attempts=1,
                               compare_compile=False, measure=False)
    [target] = fast.report.targets
    assert target["winner"] != "llm"
    attempt = json.loads((tmp_path / "run" / "targets" / "01-t1" / "attempts" / "001" / "attempt.json").read_text())
    report = attempt["report"]
    majors = [f for f in report["findings"] if f["severity"] == "major"]
    # Caught as a hack (a major finding) or as wrong on fresh inputs: either way reward 0, and why is recorded.
    assert majors or not report["correct"], report
    assert attempt["reward"]["value"] == 0 and attempt["scorecard"]
    assert attempt["feedback"], "the reason is recorded in the run directory"
    assert all(k["name"] != "scan_sigmoid_log1p" for k in fast.program.kernels)
    if reply is HACK:  # torch doing the work is a hack however right its outputs are: anti-hacking 1 of 5
        anti = next(i for i in attempt["scorecard"]["items"] if i["dimension"] == "anti-hacking")
        assert majors and anti["score"] == 1, attempt["scorecard"]
