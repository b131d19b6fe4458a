"""Redaction by value (stitchcuda._C.secrets, include/stitchcuda/secrets.hpp): a planted key, its
fragments and its encodings never reach a file StitchCUDA writes or a message it sends — run
directories (program and graph mode), trajectories, feedback, prompts, Verifier reports."""

from __future__ import annotations

import base64
import json
import os
import secrets as pysecrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stitchcuda import _C, agents
from stitchcuda.verify import Task, check

# Unique per run, so that no other test's text contains its windows by chance.
KEY = "sk-plant-" + pysecrets.token_hex(12) + "Zq"
_C.secrets.remember(KEY)


def leaks(text: str, key: str = KEY) -> list[str]:
    """Every 8-character window of the key, its hex or its base64 spellings found in `text`."""
    spellings = [key, key.encode().hex(), key.encode().hex().upper()]
    for skip in range(3):
        enc = base64.b64encode(key[skip:].encode()).decode().rstrip("=")
        spellings += [enc[:-4], enc[:-4].replace("+", "-").replace("/", "_")]
    found = []
    for s in spellings:
        for i in range(len(s) - 7):
            window = s[i:i + 8]
            if not window.isdigit() and window in text:
                found.append(window)
    return found


def test_fragments_and_encodings_are_masked_and_numbers_kept():
    for planted in (f"key={KEY};", f"part {KEY[5:19]} of it", KEY.encode().hex(), KEY.encode().hex().upper(),
                    base64.b64encode(("x" + KEY).encode()).decode(), base64.b64encode(("xy" + KEY).encode()).decode(),
                    base64.urlsafe_b64encode(("xyz" + KEY).encode()).decode()):
        clean = _C.secrets.redact(planted)
        assert "[redacted]" in clean and not leaks(clean), (planted, clean)
    ordinary = '{"wall_s": 12345678.25, "url": "http://127.0.0.1:8000/v1", "path": "/root/.cache/x"}'
    assert _C.secrets.redact(ordinary) == ordinary
    assert _C.secrets.looks_secret("OPENAI_API_KEY") and _C.secrets.looks_secret("GITHUB_TOKEN")
    assert not _C.secrets.looks_secret("OPENAI_BASE_URL") and not _C.secrets.looks_secret("HF_HOME")


def test_the_environments_secrets_are_known_without_being_told(tmp_path):
    # A letter between the random hex digits: a run of digits alone is never masked (a number in a log
    # must stay a number), so a token ending in several digits would leave them and fail at random.
    token = "ghp_" + "".join(c + "q" for c in pysecrets.token_hex(8))
    code = f"from stitchcuda import _C; print(_C.secrets.redact('x {token[3:20]} y'), _C.secrets.redact('/opt/conf'))"
    env = {**os.environ, "GITHUB_TOKEN": token, "HF_HOME": "/opt/conf", "PYTHONPATH": str(Path(agents.__file__).parents[2])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["x", "[redacted]", "y", "/opt/conf"]


PROBLEM = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x, y):
            return torch.relu(x + y)

    def get_inputs():
        return [torch.randn(128, 64), torch.randn(128, 64)]

    def get_init_inputs():
        return []
''')

LEAKY = textwrap.dedent(f'''
    import torch
    import torch.nn as nn
    from stitchcuda import jit

    STOLEN = "{KEY}"  # what a candidate read from its parent's environment
    SRC = r"""
    #error {KEY}
    extern "C" __global__ void add_relu(const float* x, const float* y, float* out, int n) {{
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) out[i] = fmaxf(x[i] + y[i], 0.f);
    }}
    """
    _kernel = jit.compile(SRC, "add_relu")

    class ModelNew(nn.Module):
        def forward(self, x, y):
            out = torch.empty_like(x)
            _kernel((x.numel() + 255) // 256, 256, x.contiguous(), y.contiguous(), out, x.numel())
            return out
''')

PLAN = json.dumps({"summary": "Fuse add and ReLU.", "steps": [{"title": "One kernel", "detail": "fp32"}],
                   "fusion_groups": [], "bottlenecks": [], "risks": [], "constraints": []})


class EchoingModel:
    """A model that echoes the key in every reply and records every prompt it is sent."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def __call__(self, messages):
        self.prompts += [m["content"] for m in messages]
        first = messages[0]["content"]
        if "You are the Planner" in first:
            return PLAN
        if "You are the Verifier" in first:
            return f"The key is {KEY}, base64 {base64.b64encode(KEY.encode()).decode()}."
        return f"Here it is ({KEY}).\n\n```python\n{LEAKY}```\n"


def test_no_file_of_a_run_and_no_prompt_holds_the_key(tmp_path):
    problem = tmp_path / "add_relu.py"
    problem.write_text(PROBLEM)
    model = EchoingModel()
    run_dir = tmp_path / "run"
    agents.optimize_problem(problem, model, attempts=2, run_dir=run_dir, static_only=True)
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "trajectories.jsonl" for p in files) and len(files) > 10
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        assert not leaks(text), (path, leaks(text))
        if path.suffix in (".json", ".jsonl"):
            for line in (text.splitlines() if path.suffix == ".jsonl" else [text]):
                json.loads(line)  # masking keeps every JSON file valid
    # The second Coder prompt shows the first candidate and its feedback: masked before it was sent.
    assert len(model.prompts) >= 4 and not any(leaks(p) for p in model.prompts)
    assert any("[redacted]" in p for p in model.prompts)


def test_a_verifier_report_never_carries_the_key():
    task = Task.from_source(PROBLEM, "add_relu")
    report = check(task, LEAKY, static_only=True)
    assert not report.compiled  # the #error line
    assert not leaks(report.to_json()) and "[redacted]" in report.compile_log + report.feedback


def test_graph_modes_run_files_are_redacted(tmp_path):
    from stitchcuda.graph import agents as graph_agents

    graph_agents._write(tmp_path / "a.json", json.dumps({"reply": f"echo {KEY}"}))
    assert not leaks((tmp_path / "a.json").read_text())
    assert json.loads((tmp_path / "a.json").read_text())["reply"].startswith("echo [redacted]")


# ---- every message boundary: the CLI's output, log records, errors, the reward service's replies --------

CANDIDATE = (Path(__file__).resolve().parents[1] / "corpus" / "honest" / "softmax_block_reduce.py").read_text()
SOFTMAX = (Path(__file__).resolve().parents[1] / "corpus" / "problems" / "row_softmax.py").read_text()


def test_the_cli_prints_no_key_from_a_file_name_an_exception_or_a_models_url(tmp_path, subprocess_env):
    """The key planted in the environment (as a user's OPENAI_API_KEY) reaches the CLI's messages three ways:
    a file name holding it, a reference that raises with it, and a model URL's password. None gets out."""
    key = "sk-cli-" + pysecrets.token_hex(10) + "Zq"
    password = "pw-" + pysecrets.token_hex(8) + "Q"
    env = {**subprocess_env, "OPENAI_API_KEY": key}
    (tmp_path / "cand.py").write_text(CANDIDATE)
    (tmp_path / "problem.py").write_text(SOFTMAX)
    (tmp_path / "raises.py").write_text("import os\nraise RuntimeError('the key is ' + os.environ['OPENAI_API_KEY'])\n")
    runs = {
        "file name": ["check", "--reference", f"missing-{key}.py", "--candidate", "cand.py", "--device", "cpu"],
        "exception": ["check", "--reference", "raises.py", "--candidate", "cand.py", "--device", "cpu", "--json"],
        "url": ["optimize", "problem.py", "--llm", f"openai:m@http://alice:{password}@127.0.0.1:9/v1"],
    }
    for what, args in runs.items():
        done = subprocess.run([sys.executable, "-m", "stitchcuda", *args], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=300)
        out = done.stdout + done.stderr
        assert done.returncode != 0 and "[redacted]" in out, (what, out[-2000:])
        assert not leaks(out, key) and password not in out and password[3:11] not in out, (what, out[-2000:])


def test_a_crash_past_the_cli_prints_a_redacted_traceback(subprocess_env):
    key = "sk-crash-" + pysecrets.token_hex(10) + "Zq"
    code = ("from stitchcuda.log import redacted_output\n"
            "with redacted_output():\n"
            "    print('the key is', __import__('os').environ['OPENAI_API_KEY'])\n"
            "    raise RuntimeError('a bug that shows ' + __import__('os').environ['OPENAI_API_KEY'])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**subprocess_env, "OPENAI_API_KEY": key})
    assert done.returncode == 1 and "RuntimeError: a bug that shows [redacted]" in done.stderr, done.stderr
    assert done.stdout == "the key is [redacted]\n" and not leaks(done.stdout + done.stderr, key)


def test_log_records_reach_every_handler_redacted():
    import logging

    from stitchcuda import log

    seen: list[str] = []

    class Keep(logging.Handler):  # an application's own handler
        def emit(self, record):
            seen.append(self.format(record))

    logger = log.get_logger("rl.test_secrets")
    handler = Keep()
    logging.getLogger().addHandler(handler)
    try:
        logger.warning("scored with %s at %s", KEY, "http://alice:pw-short@127.0.0.1:1/v1?token=abc123")
        try:
            raise RuntimeError(f"the reference raised {KEY}")
        except RuntimeError:
            logger.exception("while scoring")
    finally:
        logging.getLogger().removeHandler(handler)
    text = "\n".join(seen)
    assert len(seen) == 2 and "RuntimeError" in text and not leaks(text), text
    assert "pw-short" not in text and "abc123" not in text and "http://[redacted]@127.0.0.1:1" in text


def test_errors_and_a_models_name_show_no_credentials():
    from stitchcuda import llm
    from stitchcuda.errors import StitchError

    assert not leaks(str(StitchError(f"cannot read the reference '/tmp/{KEY}.py'")))
    password = "pw-" + pysecrets.token_hex(8) + "Q"
    backend = llm.connect(f"openai:m@http://alice:{password}@127.0.0.1:9/v1", api_key="x" * 12, max_attempts=1,
                          connect_timeout=2, timeout=3)
    assert password not in backend.name + repr(backend) and "http://[redacted]@127.0.0.1:9/v1" in backend.name
    with pytest.raises(StitchError) as info:
        backend.complete("hello")
    assert password not in str(info.value) and "127.0.0.1:9" in str(info.value)
    # Remembered from the URL: masked where it appears alone too (a run directory's config, a transcript).
    assert _C.secrets.redact(f"x {password} y") == "x [redacted] y"


def test_the_reward_services_replies_hold_no_key():
    from stitchcuda.rl import RewardClient, RewardPool, RewardService

    with RewardService(RewardPool(["cpu"], 1, warm=False), port=0) as service:
        (reply,) = RewardClient(service.url).score([{"task": f"corpus/{KEY}", "completion": "x", "mode": "static"}])
    assert reply["error"]["kind"] == "bad-item" and "no shipped task" in reply["error"]["message"]
    assert not leaks(json.dumps(reply)), reply
