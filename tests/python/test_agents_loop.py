"""The optimization loop from Python and the command line, on the CPU with scripted models: a candidate
with a CUDA error gets compile feedback, the revised candidate compiles (static verification: the run
says it is unverified), everything lands in the run directory, a run resumes where it stopped, and
`stitchcuda optimize --mode program --llm` / `stitchcuda runs list|show|diff` work end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stitchcuda
from stitchcuda import _C, agents

pytestmark = pytest.mark.slow

PROBLEM = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()

        def forward(self, x, y):
            return torch.relu(x + y)

    rows = 128
    cols = 64

    def get_inputs():
        return [torch.randn(rows, cols), torch.randn(rows, cols)]

    def get_init_inputs():
        return []
''')

GOOD = textwrap.dedent('''
    import torch
    import torch.nn as nn
    from stitchcuda import jit

    SRC = r"""
    extern "C" __global__ void add_relu(const float* x, const float* y, float* out, int n) {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) out[i] = fmaxf(x[i] + y[i], 0.f);
    }
    """
    _kernel = jit.compile(SRC, "add_relu")

    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()

        def forward(self, x, y):
            x, y = x.contiguous(), y.contiguous()
            out = torch.empty_like(x)
            n = x.numel()
            _kernel((n + 255) // 256, 256, x, y, out, n)
            return out
''')
BROKEN = GOOD.replace("x[i] + y[i]", "x[i] + z[i]")  # z is undefined: NVRTC rejects it

PLAN = json.dumps({
    "summary": "Fuse the add and the ReLU into one elementwise kernel: one read of each input, one write.",
    "steps": [{"title": "Write one fused add+ReLU kernel", "detail": "One thread per element, fp32."}],
    "fusion_groups": [{"ops": ["add", "relu"], "kernel": "add_relu", "rationale": "saves a round trip to DRAM"}],
    "bottlenecks": ["DRAM bandwidth"], "risks": ["non-contiguous inputs"], "constraints": ["fp32 outputs"],
})

# Which prompt a request was rendered from, by a sentence only that template holds.
PLANNER, CODER_PLAN, CODER_FEEDBACK, VERIFIER = ("You are the Planner", "Implement the plan below",
                                                 "Revise your previous candidate", "You are the Verifier")


def fenced(code: str) -> str:
    return f"Here is the module.\n\n```python\n{code}```\nOne fused kernel."


class ScriptedModel:
    """Answers by the prompt a conversation started from; counts the requests of each kind."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __call__(self, messages: list[dict[str, str]]) -> str:
        first = messages[0]["content"]
        for marker, reply in ((PLANNER, PLAN), (CODER_PLAN, fenced(BROKEN)), (CODER_FEEDBACK, fenced(GOOD)),
                              (VERIFIER, "The kernel reads z, which is not declared; read y instead.")):
            if marker in first:
                self.calls[marker] = self.calls.get(marker, 0) + 1
                return reply
        raise AssertionError(f"unexpected prompt: {first[:200]}")


@pytest.fixture
def problem(tmp_path: Path) -> Path:
    path = tmp_path / "add_relu.py"
    path.write_text(PROBLEM)
    return path


def kinds(outcome: dict) -> list[str]:
    return [a["feedback"]["kind"] for a in outcome["attempts"]]


# ---- the pieces Python sees ------------------------------------------------------------------------


def test_prompts_extraction_and_plans():
    prompts = agents.PromptLibrary.load().prompts()
    assert set(prompts) >= {"planner", "coder_plan", "coder_feedback", "answer_model_new", "answer_kernel_step",
                            "replanner", "verifier"}
    assert all(len(p["sha256"]) == 64 and p["path"].startswith(str(agents.PROMPTS_DIR)) for p in prompts.values())

    extraction = agents.extract_code("```cuda\n__global__ void k() {}\n```\n" + fenced(GOOD))
    assert "class ModelNew" in extraction["code"] and len(extraction["blocks"]) == 2
    with pytest.raises(stitchcuda.LLMError, match="ModelNew"):
        agents.extract_code("I could not do it.")

    plan = agents.ProblemPlan.parse("Sure:\n```json\n" + PLAN + "\n```")
    assert plan.steps[0]["title"] == "Write one fused add+ReLU kernel" and "1." in plan.text
    with pytest.raises(stitchcuda.InvalidArgumentError, match="steps"):
        agents.ProblemPlan.parse('{"summary": "no steps"}')
    assert "steps" in agents.problem_plan_schema()["required"]


def test_hardware_describes_this_machine():
    hw = agents.hardware()
    if _C.device_count() == 0:
        assert hw["gpu"] == agents.NO_GPU
    else:
        assert hw["arch"].startswith("sm_") and hw["sms"] > 0 and hw["memory_gib"] > 0


# ---- the loop --------------------------------------------------------------------------------------


def test_compile_error_then_fix_static_verification(problem, tmp_path):
    model = ScriptedModel()
    events: list[dict] = []
    run_dir = tmp_path / "run"
    out = agents.optimize_problem(problem, model, attempts=4, run_dir=run_dir, on_event=events.append,
                                  static_only=True)

    assert kinds(out) == ["compile", "unverified"]
    first, second = out["attempts"]
    assert first["skill"] == 1 and not first["report"]["compiled"] and first["report"]["error_kind"] == "compile"
    assert '"z" is undefined' in first["report"]["compile_log"]
    assert second["skill"] == 2 and second["report"]["compiled"] and second["report"]["static_only"]
    assert out["unverified"] and not out["verified"] and "unverified" in out["stop_reason"]
    assert out["best_attempt"] == 2 and out["best"] == GOOD
    assert model.calls == {PLANNER: 1, CODER_PLAN: 1, CODER_FEEDBACK: 1, VERIFIER: 2}

    # The run directory holds everything, prompts with their hashes included.
    for name in ("config.json", "hardware.json", "problem.py", "plans/plan-1.json", "best.py", "summary.json",
                 "trajectories.jsonl", "events.jsonl", "prompts/index.json"):
        assert (run_dir / name).is_file(), name
    for n in ("001", "002"):
        for name in ("candidate.py", "report.json", "feedback.md", "rubric.json", "reward.json", "attempt.json"):
            assert (run_dir / "attempts" / n / name).is_file(), (n, name)
    assert (run_dir / "best.py").read_text() == GOOD
    assert "z[i]" in (run_dir / "attempts/001/candidate.py").read_text()
    assert "line" in (run_dir / "attempts/001/feedback.md").read_text()
    index = json.loads((run_dir / "prompts/index.json").read_text())
    assert index["planner"]["sha256"] == agents.PromptLibrary.load().prompts()["planner"]["sha256"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["problem"] == "add_relu" and summary["verified"] is False
    config = json.loads((run_dir / "config.json").read_text())
    assert config["problem"] == "add_relu" and config["budget"]["attempts"] == 4

    stages = [e["stage"] for e in events]
    assert stages[0] == "plan" and stages[-1] == "done" and {"code", "verify", "feedback"} <= set(stages)
    assert len((run_dir / "events.jsonl").read_text().splitlines()) == len(events)


def test_resume_continues_without_repeating(problem, tmp_path):
    run_dir = tmp_path / "run"
    first = ScriptedModel()
    out = agents.optimize_problem(problem, first, attempts=1, run_dir=run_dir, static_only=True)
    assert kinds(out) == ["compile"] and out["stop_reason"].startswith("attempt budget spent")
    assert out["best_attempt"] == 0 and not (run_dir / "best.py").exists()

    second = ScriptedModel()
    out = agents.optimize_problem(None, second, attempts=3, resume=run_dir, static_only=True)
    assert kinds(out) == ["compile", "unverified"] and out["best_attempt"] == 2
    assert second.calls.get(PLANNER) is None and second.calls.get(CODER_PLAN) is None  # plan 1 and attempt 1 read back
    assert second.calls[CODER_FEEDBACK] == 1
    assert (run_dir / "best.py").read_text() == GOOD


def test_a_new_run_refuses_a_used_directory(problem, tmp_path):
    run_dir = tmp_path / "run"
    agents.optimize_problem(problem, ScriptedModel(), attempts=1, run_dir=run_dir, static_only=True)
    with pytest.raises(stitchcuda.InvalidArgumentError, match="--resume"):
        agents.optimize_problem(problem, ScriptedModel(), attempts=1, run_dir=run_dir, static_only=True)


def test_a_raising_verify_function_is_a_crash_report(tmp_path):
    def verify(candidate: str) -> str:
        raise ValueError("the harness broke")

    backend = stitchcuda.llm.connect(ScriptedModel())
    out = _C.agents.optimize({"name": "add_relu", "reference": PROBLEM}, backend._native, verify,
                             {"attempts": 1}, str(tmp_path / "run"), "{}", False, None,
                             {"prompts_dir": str(agents.PROMPTS_DIR), "verifier_llm": False})
    report = out["attempts"][0]["report"]
    assert report["error_kind"] == "crash" and "ValueError: the harness broke" in report["error_message"]
    assert out["attempts"][0]["feedback"]["kind"] == "runtime"


def test_an_exception_in_the_progress_callback_stops_the_run(problem, tmp_path):
    def on_event(event: dict) -> None:
        if event["stage"] == "code":
            raise KeyError("progress view broke")

    with pytest.raises(KeyError, match="progress view broke"):
        agents.optimize_problem(problem, ScriptedModel(), attempts=3, run_dir=tmp_path / "run", on_event=on_event,
                                static_only=True)


def test_a_bad_problem_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n")
    with pytest.raises(stitchcuda.InvalidArgumentError, match="Model"):
        agents.optimize_problem(bad, ScriptedModel(), static_only=True)


# ---- the command line ----------------------------------------------------------------------------


def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stitchcuda", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def write_rules(path: Path, coder_plan_reply: str) -> Path:
    rules = [{"pattern": PLANNER, "reply": PLAN},
             {"pattern": CODER_PLAN, "reply": fenced(coder_plan_reply)},
             {"pattern": CODER_FEEDBACK, "reply": fenced(GOOD)},
             {"pattern": VERIFIER, "reply": "Read y, not z."}]
    path.write_text(json.dumps(rules))
    return path


def test_cli_optimize_and_runs(problem, tmp_path, subprocess_env):
    rules = write_rules(tmp_path / "rules.json", BROKEN)
    result = run_cli(["optimize", "--mode", "program", str(problem), "--llm", f"scripted:{rules}", "--attempts", "4",
                      "--run-dir", "runs/first", "--static-only"], subprocess_env, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "runs/first" in result.stdout and "UNVERIFIED (no GPU: compile and static checks only)" in result.stdout
    # Progress goes to stderr, as plain lines off a TTY (tests/python/test_logging.py has the terminal view).
    assert "[plan]" in result.stderr and "[verify]" in result.stderr and "[plan]" not in result.stdout
    assert "\r" not in result.stdout + result.stderr

    # A second run whose first candidate already compiles.
    rules_b = write_rules(tmp_path / "rules_b.json", GOOD.replace("256", "128"))
    result = run_cli(["optimize", "--mode", "program", str(problem), "--llm", f"scripted:{rules_b}", "--run-dir",
                      "runs/second",
                      "--static-only"], subprocess_env, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr

    listed = run_cli(["runs", "list"], subprocess_env, tmp_path)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:3] == ["run", "problem", "attempts"]
    assert any(line.split()[:3] == ["first", "add_relu", "2"] for line in lines), listed.stdout
    assert any(line.split()[:3] == ["second", "add_relu", "1"] for line in lines), listed.stdout

    shown = run_cli(["runs", "show", "runs/first"], subprocess_env, tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "add_relu" in shown.stdout and "compile" in shown.stdout and "unverified" in shown.stdout
    attempt_lines = [line for line in shown.stdout.splitlines() if line.lstrip().startswith(("001", "002"))]
    assert len(attempt_lines) == 2 and "from plan" in attempt_lines[0] and "from feedback" in attempt_lines[1]

    diff = run_cli(["runs", "diff", "first", "second"], subprocess_env, tmp_path)  # names under ./runs
    assert diff.returncode == 0, diff.stderr
    assert "-        _kernel((n + 255) // 256, 256, x, y, out, n)" in diff.stdout
    assert "+        _kernel((n + 255) // 128, 128, x, y, out, n)" in diff.stdout
    assert "best_attempt: 2 -> 1" in diff.stdout and "attempts: 2 -> 1" in diff.stdout

    # Resume without --llm or --mode takes both from config.json; nothing is left to do once the run
    # stopped on a candidate that compiled.
    resumed = run_cli(["optimize", "--resume", "runs/first", "--static-only"], subprocess_env, tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "attempt 2" in resumed.stdout
    assert json.loads((tmp_path / "runs/first/summary.json").read_text())["best_attempt"] == 2
    assert len(list((tmp_path / "runs/first/attempts").iterdir())) == 2


def test_cli_errors_are_one_line_and_exit_2(problem, tmp_path, subprocess_env):
    result = run_cli(["optimize", "--mode", "program", str(problem), "--llm", "nosuchprovider:model"], subprocess_env,
                     tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = run_cli(["runs", "show", "nope"], subprocess_env, tmp_path)
    assert result.returncode == 2 and "nope" in result.stderr
    result = run_cli(["optimize", "--resume", str(tmp_path / "missing"), "--llm", "scripted:x.json"],
                     subprocess_env, tmp_path)
    assert result.returncode == 2 and "missing" in result.stderr


def test_ctrl_c_stops_a_run_promptly(problem, tmp_path, subprocess_env):
    # A model that takes 1 s per answer; Ctrl-C during the first one ends the run after it, not after
    # the whole budget: the loop runs with the GIL released and the main thread watches for signals.
    (tmp_path / "slow_model.py").write_text(textwrap.dedent(f'''
        import time
        import sys
        def answer(messages):
            sys.stdout.write("model called\\n")
            sys.stdout.flush()
            time.sleep(1.0)
            return {PLAN!r}
    '''))
    env = dict(subprocess_env, PYTHONPATH=f"{tmp_path}:{subprocess_env['PYTHONPATH']}")
    child = subprocess.Popen([sys.executable, "-m", "stitchcuda", "optimize", "--mode", "program", str(problem), "--llm",
                              "python:slow_model:answer", "--attempts", "50", "--static-only"], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stderr.readline().startswith("[plan]")  # the progress line, on stderr
    assert child.stdout.readline() == "model called\n"
    child.send_signal(__import__("signal").SIGINT)
    started = __import__("time").monotonic()
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 130, stderr
    assert __import__("time").monotonic() - started < 10


@pytest.mark.gpu
def test_gpu_verification_times_the_fixed_candidate(problem, tmp_path):
    model = ScriptedModel()
    out = agents.optimize_problem(problem, model, attempts=2, run_dir=tmp_path / "run",
                                  verify_config={"timing_iters": 10, "warmup": 2})
    assert out["verified"] and not out["unverified"]
    assert kinds(out)[0] == "compile" and kinds(out)[1] in ("correct", "slow")
    assert out["attempts"][1]["report"]["correct"] and out["best_attempt"] == 2 and out["best_speedup"] > 0
    assert out["stop_reason"].startswith("attempt budget spent")
    assert out["hardware"]["arch"].startswith("sm_")


def test_prompt_override_is_used_and_recorded(problem, tmp_path):
    override = tmp_path / "prompts"
    override.mkdir()
    (override / "verifier.md").write_text("<!-- version: 7 -->\nYou are the Verifier. Report:\n{{report}}\n")
    out = agents.optimize_problem(problem, ScriptedModel(), attempts=2, run_dir=tmp_path / "run",
                                  prompts_dir=override, static_only=True)
    index = json.loads((tmp_path / "run/prompts/index.json").read_text())
    assert index["verifier"]["version"] == "7" and index["verifier"]["path"].startswith(str(override))
    assert index["planner"]["path"].startswith(str(agents.PROMPTS_DIR))
    exchange = out["attempts"][0]["feedback"]["exchange"]
    assert exchange["prompt"]["sha256"] == index["verifier"]["sha256"]


# ---- resume keeps the budget and the totals ---------------------------------------------------------


class CountedModel(ScriptedModel):
    """ScriptedModel whose every answer reports 1000 tokens (600 prompt + 400 completion)."""

    def __call__(self, messages: list[dict[str, str]]) -> dict:
        return {"text": super().__call__(messages),
                "usage": {"prompt_tokens": 600, "completion_tokens": 400, "total_tokens": 1000}}


def test_resume_keeps_the_saved_budget_unless_told_otherwise(problem, tmp_path):
    run_dir = tmp_path / "run"
    out = agents.optimize_problem(problem, CountedModel(), attempts=1, run_dir=run_dir, static_only=True)
    # The plan, attempt 1's Coder call and its VerifierAgent call.
    assert len(out["attempts"]) == 1 and out["usage"]["total_tokens"] == 3000

    # No budget given: the saved one (one attempt) holds, nothing is asked, the totals stay.
    idle = CountedModel()
    out = agents.optimize_problem(None, idle, resume=run_dir, static_only=True)
    assert idle.calls == {} and len(out["attempts"]) == 1
    assert out["stop_reason"] == "attempt budget spent (1)"
    assert out["usage"] == {"prompt_tokens": 1800, "completion_tokens": 1200, "total_tokens": 3000}
    assert json.loads((run_dir / "summary.json").read_text())["usage"]["total_tokens"] == 3000

    # A budget given on resume replaces the saved one; config.json and events.jsonl say so.
    more = CountedModel()
    out = agents.optimize_problem(None, more, attempts=3, resume=run_dir, static_only=True)
    assert kinds(out) == ["compile", "unverified"] and more.calls == {CODER_FEEDBACK: 1, VERIFIER: 1}
    assert out["usage"]["total_tokens"] == 5000
    config = json.loads((run_dir / "config.json").read_text())
    assert config["mode"] == "program" and config["budget"]["attempts"] == 3
    assert [r["budget_changes"] for r in config["resumes"]] == [{}, {"attempts": {"saved": 1, "now": 3}}]
    resumes = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
               if json.loads(line)["stage"] == "resume"]
    assert [e["message"].split("; ")[1] for e in resumes] == ["budget as saved", "budget attempts 1 -> 3"]


def test_totals_are_the_same_after_a_kill_and_a_resume(problem, tmp_path):
    run_dir = tmp_path / "run"
    whole = agents.optimize_problem(problem, CountedModel(), attempts=2, run_dir=run_dir, static_only=True)
    assert whole["usage"]["total_tokens"] == 5000
    (run_dir / "attempts/002/attempt.json").unlink()  # killed before attempt 2 was recorded
    (run_dir / "summary.json").unlink()
    resumed = agents.optimize_problem(None, CountedModel(), resume=run_dir, static_only=True)
    assert len(resumed["attempts"]) == 2 and resumed["usage"] == whole["usage"]
    assert json.loads((run_dir / "summary.json").read_text())["usage"] == whole["usage"]
    # The records of the killed attempt were dropped and written again once: none missing, none twice.
    records = agents.read_trajectories(run_dir)
    assert [(r["agent"], r["attempt"]) for r in records] == [("planner", None), ("coder", 1), ("verifier", 1),
                                                             ("coder", 2), ("verifier", 2)]
    assert sum(r["usage"]["total_tokens"] for r in records) == whole["usage"]["total_tokens"]


def test_a_token_budget_holds_across_resumes(problem, tmp_path):
    run_dir = tmp_path / "run"
    out = agents.optimize_problem(problem, CountedModel(), attempts=5, tokens=2500, run_dir=run_dir, static_only=True)
    assert out["stop_reason"] == "token budget spent (3000 tokens)"
    again = CountedModel()
    out = agents.optimize_problem(None, again, resume=run_dir, static_only=True)  # tokens=2500 from config.json
    assert again.calls == {} and out["stop_reason"] == "token budget spent (3000 tokens)"


# ---- trajectories.jsonl ----------------------------------------------------------------------------


def test_trajectories_load_as_a_dataset(problem, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # nothing to fetch: the json builder ships with datasets
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    datasets = pytest.importorskip("datasets")
    run_dir = tmp_path / "20261203-004200-add_relu"
    agents.optimize_problem(problem, CountedModel(), attempts=4, run_dir=run_dir, static_only=True)

    records = agents.read_trajectories(run_dir)
    assert [r["agent"] for r in records] == ["planner", "coder", "verifier", "coder", "verifier"]
    for record in records:
        assert agents.validate_trajectory(record) == [], record["agent"]
        assert set(record) == set(agents.TRAJECTORY_KEYS)

    ds = datasets.load_dataset("json", data_files=str(run_dir / "trajectories.jsonl"), split="train",
                               cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == 5 and set(ds.column_names) == set(agents.TRAJECTORY_KEYS)
    assert ds["agent"] == ["planner", "coder", "verifier", "coder", "verifier"]
    assert set(ds["run_id"]) == {"20261203-004200-add_relu"} and set(ds["problem"]) == {"add_relu"}
    assert ds["skill"] == [None, 1, None, 2, None] and ds["attempt"] == [None, 1, 1, 2, 2]
    assert ds["prompt_name"] == ["planner", "coder_plan", "verifier", "coder_feedback", "verifier"]
    coder = ds.filter(lambda r: r["agent"] == "coder")
    first, second = coder[0], coder[1]
    # prompt/completion as TRL reads them; messages is the same conversation whole.
    assert first["prompt"][0]["role"] == "user" and "Implement the plan below" in first["prompt"][0]["content"]
    assert first["completion"] == [{"role": "assistant", "content": fenced(BROKEN)}]
    assert first["messages"] == first["prompt"] + first["completion"]
    assert first["reward"]["value"] == 0.0 and first["reward"]["why_zero"].startswith("incorrect: compile")
    assert second["reward"]["why_zero"] == "unverified" and not second["reward"]["correct"]
    assert set(second["reward"]["rubric"]) == set(agents.trajectories.RUBRIC_ITEMS)
    assert second["reward"]["total"] == sum(second["reward"]["rubric"].values())
    assert ds[0]["reward"] is None and ds[2]["reward"] is None  # the Planner's and the VerifierAgent's calls
    assert ds[1]["usage"]["total_tokens"] == 1000


def test_the_trajectory_checker_names_what_is_wrong(problem, tmp_path):
    run_dir = tmp_path / "run"
    agents.optimize_problem(problem, ScriptedModel(), attempts=1, run_dir=run_dir, static_only=True)
    planner, coder = agents.read_trajectories(run_dir)[:2]
    assert agents.validate_trajectory(coder) == []

    assert "record.reward: missing" in agents.validate_trajectory({k: v for k, v in coder.items() if k != "reward"})
    assert any("record.reward.total" in p for p in agents.validate_trajectory(
        {**coder, "reward": {**coder["reward"], "total": 14.0}}))
    assert "record.reward: set for the Coder's calls only" in agents.validate_trajectory({**planner, "reward": coder["reward"]})
    assert "record.messages: is not prompt + completion" in agents.validate_trajectory({**coder, "messages": coder["prompt"]
                                                                                         + coder["prompt"]})
    assert any("why_zero" in p for p in agents.validate_trajectory(
        {**coder, "reward": {**coder["reward"], "why_zero": ""}}))  # value 0 must say why
    assert "record.extra: not a key of the record" in agents.validate_trajectory({**coder, "extra": 1})

    # A record made in Python (graph mode's Planner) has the run directory's shape.
    made = agents.trajectory_record({"agent": "planner", "model": "m", "messages": planner["prompt"], "reply": "{}",
                                     "prompt_name": "graph_planner", "prompt_sha256": "0" * 64},
                                    run_id="r", problem="graph")
    assert set(made) == set(agents.TRAJECTORY_KEYS) and agents.validate_trajectory(made) == []


# ---- a user's own script without a main guard -------------------------------------------------------


def test_a_script_without_a_main_guard_spawns_workers(tmp_path, subprocess_env):
    # multiprocessing's spawn re-runs the parent's main script in the child; the loop hides it while its
    # Verifier workers start, so an unguarded script does not start over in each of them.
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent('''
        import multiprocessing, sys, time
        from stitchcuda.agents.loop import main_module_hidden
        print("script body ran", flush=True)
        ctx = multiprocessing.get_context("spawn")
        if sys.argv[1] == "hidden":
            with main_module_hidden():
                child = ctx.Process(target=time.sleep, args=(0,))
                child.start()
            assert __file__.endswith("user_script.py")  # put back after the start
        else:
            child = ctx.Process(target=time.sleep, args=(0,))
            child.start()
        child.join()
        print("child exit", child.exitcode, flush=True)
    '''))
    hidden = subprocess.run([sys.executable, str(script), "hidden"], env=subprocess_env, capture_output=True,
                            text=True, timeout=120)
    assert hidden.returncode == 0, hidden.stderr
    assert hidden.stdout.splitlines() == ["script body ran", "child exit 0"]
    plain = subprocess.run([sys.executable, str(script), "plain"], env=subprocess_env, capture_output=True, text=True,
                           timeout=120)
    assert plain.stdout.count("script body ran") == 2 and "child exit 1" in plain.stdout  # what it prevents


class JudgedModel(ScriptedModel):
    """ScriptedModel that also answers the rubric judge: anti-hacking lowered to 3, with its reason."""

    JUDGE = "You are the Rubric judge"

    def __call__(self, messages):
        if self.JUDGE in messages[0]["content"]:
            self.calls[self.JUDGE] = self.calls.get(self.JUDGE, 0) + 1
            return json.dumps({"items": [
                {"dimension": "anti-hacking", "score": 3, "reason": "forward calls contiguous() on the inputs"},
                {"dimension": "cuda-engineering", "score": 2, "reason": "scalar loads"},
                {"dimension": "operator-coverage", "score": 5, "reason": "the kernel does all of it"},
                {"dimension": "skill-compliance", "score": 4, "reason": "as asked"}]})
        return super().__call__(messages)


def test_the_rubric_judge_is_off_by_default_and_recorded_when_on(problem, tmp_path):
    plain = ScriptedModel()
    out = agents.optimize_problem(problem, plain, attempts=2, run_dir=tmp_path / "plain", static_only=True)
    assert JudgedModel.JUDGE not in plain.calls
    assert not any(i for a in out["attempts"] for i in a["judge_exchanges"])

    model = JudgedModel()
    run_dir = tmp_path / "judged"
    out = agents.optimize_problem(problem, model, attempts=2, run_dir=run_dir, static_only=True, judge=True)
    # The first attempt does not compile: scored 1 on every item, no judge asked; the second is reviewed.
    assert model.calls[JudgedModel.JUDGE] == 1
    assert out["attempts"][0]["judge_exchanges"] == []
    second = out["attempts"][1]
    card = json.loads((run_dir / "attempts/002/rubric.json").read_text())
    assert card["judged"] is True
    anti = next(i for i in card["items"] if i["dimension"] == "anti-hacking")
    assert anti["score"] <= 3 and "contiguous()" in " ".join(anti["evidence"]), card
    assert second["judge_exchanges"][0]["agent"] == "judge"
    assert json.loads((run_dir / "config.json").read_text())["judge"] is True
    records = agents.read_trajectories(run_dir)
    judged = [r for r in records if r["agent"] == "judge"]
    assert len(judged) == 1 and judged[0]["attempt"] == 2 and judged[0]["reward"] is None and judged[0]["skill"] is None
    assert all(agents.validate_trajectory(r) == [] for r in records)
    index = json.loads((run_dir / "prompts/index.json").read_text())
    assert judged[0]["prompt_sha256"] == index["rubric_judge"]["sha256"]


def test_a_wall_time_budget_bounds_an_in_flight_model_call(problem, tmp_path):
    """A server that takes 30 s to answer: with wall_s=2 the call ends at the budget, not 30 s later, and
    the run says why; timeout= alone bounds each call the same way."""
    import time

    sys.path.insert(0, str(Path(__file__).parent))
    from llm_server import LocalLlmServer, Reply

    server = LocalLlmServer()
    try:
        for kwargs in ({"wall_s": 2.0}, {"timeout": 2.0}):
            server.queue(Reply(body={"choices": []}, delay=30.0))
            started = time.monotonic()
            with pytest.raises(stitchcuda.StitchError) as caught:
                agents.optimize_problem(problem, f"openai:py-model@{server.url}/v1", attempts=1, static_only=True,
                                        run_dir=tmp_path / f"run-{len(kwargs)}-{list(kwargs)[0]}", **kwargs)
            assert time.monotonic() - started < 15, kwargs
            assert "timeout" in caught.value.message.lower(), caught.value.message
    finally:
        server.close()
    with pytest.raises(stitchcuda.InvalidArgumentError, match="timeout must be a positive number"):
        agents.optimize_problem(problem, ScriptedModel(), timeout=-1, static_only=True, run_dir=tmp_path / "bad")
