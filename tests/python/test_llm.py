"""stitchcuda.llm from Python, against a real HTTP server on 127.0.0.1 (tests/python/llm_server.py):
specs and their errors, both protocols plain and streamed, retries and failures, timeouts and
cancellation, the GIL released while waiting, Python callable backends, transcripts and replay.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

import stitchcuda
from stitchcuda import llm
from stitchcuda.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm_server import LocalLlmServer, Reply, openai_events  # noqa: E402

FAST = {"max_attempts": 3, "initial_backoff": 0.005, "jitter": 0.0}


@pytest.fixture
def server():
    s = LocalLlmServer()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _no_real_keys(monkeypatch):
    """A developer's real keys must not reach the test server (nor a missing-key test pass by them)."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)


def local(server: LocalLlmServer, provider: str = "openai", **options) -> llm.Backend:
    return llm.connect(f"{provider}:py-model@{server.url}/v1", **{**FAST, **options})


# ---- specs and connect errors ----

def test_parse_spec_and_known_providers():
    assert llm.parse_spec("openai:qwen3-32b@http://127.0.0.1:8000/v1") == llm.Spec(
        "openai", "qwen3-32b", "http://127.0.0.1:8000/v1")
    assert llm.parse_spec("replay:runs/x/llm.jsonl").model == "runs/x/llm.jsonl"
    assert llm.known_providers() == ["openai", "anthropic", "replay", "scripted"]


def test_unknown_provider_lists_the_known_ones():
    with pytest.raises(stitchcuda.InvalidArgumentError, match="unknown model provider 'mistral'.*known providers: "
                                                              "openai, anthropic, replay, scripted"):
        llm.connect("mistral:large")


@pytest.mark.parametrize("spec", ["gpt-4.1", "openai:", "openai:m@localhost:8000", "python:no_attribute"])
def test_malformed_specs_say_so(spec):
    with pytest.raises(stitchcuda.InvalidArgumentError, match="malformed model spec|must start with http"):
        llm.connect(spec)


def test_missing_api_key_names_the_variable():
    with pytest.raises(stitchcuda.UnavailableError, match="set the environment variable OPENAI_API_KEY"):
        llm.connect("openai:gpt-4.1")
    with pytest.raises(stitchcuda.UnavailableError, match="MY_PROXY_KEY"):
        llm.connect("anthropic:claude-sonnet-4-5", api_key_env="MY_PROXY_KEY")


def test_unknown_options_are_refused(server):
    with pytest.raises(stitchcuda.InvalidArgumentError, match="unknown option 'temprature'"):
        local(server, temprature=0.2)
    with pytest.raises(stitchcuda.InvalidArgumentError, match="unknown call option"):
        local(server).complete("hi", max_token=3)


# ---- the protocols ----

def test_openai_plain_request_and_reply(server):
    backend = local(server, temperature=0.1, api_key="sk-py-test-0123456789")
    reply = backend.complete([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
                             max_tokens=20, json_schema={"type": "object"}, extra={"top_k": 5}, stop="END")
    assert reply.text == "echo: hello"
    assert reply.finish_reason == "stop"
    assert reply.usage == llm.Usage(7, 3, 10)
    assert (reply.model, reply.id, reply.attempts) == ("py-model", "chatcmpl-py", 1)
    assert reply.latency_ms > 0
    seen = server.requests[0]
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["authorization"] == "Bearer sk-py-test-0123456789"
    assert seen.body["temperature"] == 0.1 and seen.body["max_tokens"] == 20 and seen.body["top_k"] == 5
    assert seen.body["stop"] == ["END"]
    assert seen.body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert backend.name == f"openai:py-model@{server.url}/v1"
    assert "sk-py" not in repr(backend)


def test_openai_stream_passes_pieces_to_on_text(server):
    pieces = []
    reply = local(server).complete("stream me", stream=True, on_text=pieces.append)
    assert pieces == ["echo: s", "tream me"]
    assert reply.text == "echo: stream me"
    assert reply.usage.completion_tokens == 2


def test_anthropic_plain_and_streamed(server):
    backend = local(server, "anthropic", api_key="sk-ant-py-0123456789")
    plain = backend.complete([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])
    assert plain.text == "echo: hi" and plain.usage == llm.Usage(9, 4, 13)
    seen = server.requests[0]
    assert seen.headers["x-api-key"] == "sk-ant-py-0123456789"
    assert seen.headers["anthropic-version"] == "2023-06-01"
    assert seen.body["system"] == "s" and seen.body["max_tokens"] == 4096
    pieces = []
    streamed = backend.complete("again", stream=True, on_text=pieces.append)
    assert "".join(pieces) == streamed.text == "echo: again"
    assert streamed.finish_reason == "stop" and streamed.id == "msg_py"


# ---- failures ----

def test_401_fails_at_once_with_status_and_server_message(server):
    server.queue(Reply(status=401, body={"error": {"message": "Invalid API key"}}))
    with pytest.raises(stitchcuda.LLMError, match="HTTP 401 \\(unauthorized\\): Invalid API key") as info:
        local(server).complete("x")
    assert info.value.http_status == 401 and not info.value.transient
    assert len(server.requests) == 1


def test_500_then_success_is_retried(server):
    server.queue(Reply(status=500, body={"error": {"message": "boom"}}))
    backend = local(server)
    reply = backend.complete("again")
    assert reply.text == "echo: again" and reply.attempts == 2
    totals = backend.totals
    assert (totals.calls, totals.attempts, totals.retries, totals.failures) == (1, 2, 1, 0)


def test_429_honours_retry_after(server):
    server.queue(Reply(status=429, body={"error": {"message": "slow"}}, headers={"retry-after-ms": "200"}))
    start = time.perf_counter()
    reply = local(server).complete("x")
    assert time.perf_counter() - start >= 0.19
    assert reply.attempts == 2


def test_stream_cut_mid_way_raises_with_partial_text(server):
    server.queue(Reply(content_type="text/event-stream", events=openai_events(["par", "tial", "never"]), cut_after=2))
    pieces = []
    with pytest.raises(stitchcuda.LLMError, match="cut after 7 characters") as info:
        local(server).complete("x", stream=True, on_text=pieces.append)
    assert "".join(pieces) == info.value.log == "partial"


def test_slow_first_byte_times_out(server):
    server.queue(Reply(body={}, delay=2.0))
    start = time.perf_counter()
    with pytest.raises(stitchcuda.StitchTimeoutError, match="0.3 s timeout") as info:
        local(server).complete("x", timeout=0.3)
    assert isinstance(info.value, TimeoutError)
    assert time.perf_counter() - start < 1.5


def test_not_openai_compatible_and_empty_choices(server):
    server.queue(Reply(body="<html>hi</html>", content_type="text/html"),
                 Reply(body={"choices": []}))
    backend = local(server)
    with pytest.raises(stitchcuda.LLMError, match="not an OpenAI-compatible chat-completions endpoint"):
        backend.complete("x")
    with pytest.raises(stitchcuda.LLMError, match="empty choice list"):
        backend.complete("x")


# ---- waiting: cancellation, the GIL, Ctrl-C ----

def test_cancel_token_stops_a_waiting_call(server):
    server.queue(Reply(body={}, delay=3.0))
    token = llm.CancelToken()
    threading.Timer(0.1, token.cancel).start()
    start = time.perf_counter()
    with pytest.raises(stitchcuda.CancelledError):
        local(server).complete("x", cancel=token)
    assert time.perf_counter() - start < 1.0 and token.cancelled


def test_gil_is_released_while_calls_wait(server):
    for _ in range(8):
        server.queue(Reply(body={"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}, delay=0.3))
    backend = local(server)
    ticks = 0
    stop = threading.Event()

    def count():  # runs only if the waiting threads let go of the GIL
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    start = time.perf_counter()
    threads = [threading.Thread(target=backend.complete, args=("x",)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    stop.set()
    counter.join()
    assert elapsed < 1.5  # 8 × 0.3 s overlapped, not serialized
    assert ticks > 50
    assert backend.totals.calls == 8


def test_an_exception_in_on_text_stops_the_call_and_propagates(server):
    def explode(piece):
        raise ValueError("callback refused " + piece)

    with pytest.raises(ValueError, match="^callback refused ech$"):  # the first piece: "echo: x" halved
        local(server).complete("x", stream=True, on_text=explode)
    assert len(server.requests) == 1  # the original exception, not a retry or an LLMError


def test_a_signal_while_waiting_interrupts_the_call(server):
    server.queue(Reply(body={}, delay=3.0))

    class Interrupted(Exception):
        pass

    def on_signal(signum, frame):
        raise Interrupted()

    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        threading.Timer(0.1, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)).start()
        start = time.perf_counter()
        with pytest.raises(Interrupted):
            local(server).complete("x")
        assert time.perf_counter() - start < 1.0
    finally:
        signal.signal(signal.SIGUSR1, previous)


# ---- Python callables ----

def test_a_function_is_a_backend():
    seen = []

    def answer(messages):
        seen.append(messages)
        return "42"

    backend = llm.connect(answer)
    reply = backend.complete([{"role": "user", "content": "the answer?"}])
    assert reply.text == "42" and reply.finish_reason == "stop"
    assert seen == [[{"role": "user", "content": "the answer?"}]]
    assert backend.name.startswith("python:") and "answer" in backend.name


def test_a_function_taking_options_and_returning_a_dict():
    def answer(messages, options):
        return {"text": f"t={options['temperature']}", "finish_reason": "stop", "model": "mine",
                "usage": {"prompt_tokens": 3, "completion_tokens": 2}}

    backend = llm.connect(answer, temperature=0.5, prompt_price=1.0, completion_price=2.0)
    reply = backend.complete("x")
    assert reply.text == "t=0.5" and reply.model == "mine"
    assert reply.usage == llm.Usage(3, 2, 5)
    assert backend.totals.cost_usd == pytest.approx((3 * 1.0 + 2 * 2.0) / 1e6)


def test_an_object_with_complete_streams_its_reply():
    class Model:
        def complete(self, messages):
            return "streamed whole"

    pieces = []
    reply = llm.connect(Model()).complete("x", stream=True, on_text=pieces.append)
    assert pieces == ["streamed whole"] and reply.text == "streamed whole"


def test_a_raising_function_becomes_llm_error_with_its_traceback():
    def broken(messages):
        raise KeyError("no such prompt")

    with pytest.raises(stitchcuda.LLMError, match="raised KeyError: 'no such prompt'") as info:
        llm.connect(broken).complete("x")
    assert "Traceback" in info.value.log and "broken" in info.value.log


def test_a_function_returning_the_wrong_type_is_named():
    with pytest.raises(stitchcuda.LLMError, match="returned int"):
        llm.connect(lambda messages: 3).complete("x")
    with pytest.raises(stitchcuda.LLMError, match="without 'text'"):
        llm.connect(lambda messages: {"reply": "x"}).complete("x")
    with pytest.raises(stitchcuda.LLMError, match="cannot be read"):
        llm.connect(lambda messages: {"text": "x", "usage": {"prompt_tokens": "many"}}).complete("x")


def test_python_callables_run_concurrently_from_threads():
    def slow(messages):
        time.sleep(0.2)  # sleeps release the GIL, as real client libraries do while waiting
        return messages[-1]["content"].upper()

    backend = llm.connect(slow)
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, backend.complete(f"c{i}").text))
               for i in range(6)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"C{i}" for i in range(6)}
    assert time.perf_counter() - start < 1.0


def test_python_spec_loads_module_attribute(tmp_path, monkeypatch):
    (tmp_path / "my_test_models.py").write_text("def answer(messages):\n    return 'from a module'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert llm.connect("python:my_test_models:answer").complete("x").text == "from a module"


# ---- transcripts and replay ----

def test_record_then_replay_by_hash_and_in_order(tmp_path):
    path = tmp_path / "llm.jsonl"
    backend = llm.connect(lambda messages: "re: " + messages[-1]["content"], record=path, temperature=0.0)
    assert backend.complete("one").text == "re: one"
    assert backend.complete("two").text == "re: two"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["completion"]["text"] for line in lines] == ["re: one", "re: two"]
    assert lines[1]["hash"] == llm.request_hash("two", temperature=0.0)

    replay = llm.connect(f"replay:{path}", temperature=0.0)
    assert replay.complete("two").text == "re: two"
    assert replay.complete("one").text == "re: one"
    with pytest.raises(stitchcuda.NotFoundError, match="replay_match=order"):
        replay.complete("three")
    ordered = llm.connect(f"replay:{path}", replay_match="order")
    assert [ordered.complete("anything").text for _ in range(2)] == ["re: one", "re: two"]


def test_transcripts_hold_no_api_key(server, tmp_path):
    path = tmp_path / "llm.jsonl"
    backend = local(server, api_key="sk-py-secret-transcript-31337", record=path)
    backend.complete("the key is sk-py-secret-transcript-31337")
    text = path.read_text()
    assert "sk-py-secret-transcript-31337" not in text and "[redacted]" in text


def test_scripted_rules_from_python_and_from_a_file(tmp_path):
    backend = llm.scripted({"error": ["fix 1", "fix 2"], ".": "draft"})
    assert [backend.complete(p).text for p in ("write", "error!", "error!", "error!")] == [
        "draft", "fix 1", "fix 2", "fix 2"]
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"pattern": "ping", "reply": "pong"}]))
    assert llm.connect(f"scripted:{rules}").complete("ping?").text == "pong"
    with pytest.raises(stitchcuda.NotFoundError, match="no scripted rule matches"):
        llm.connect(f"scripted:{rules}").complete("other")


# ---- the CLI ----

def test_llm_ping_prints_model_latency_and_usage(server, capsys):
    assert main(["llm", "ping", f"openai:py-model@{server.url}/v1"]) == 0
    out = capsys.readouterr().out
    assert "model      py-model" in out
    assert "latency" in out and " ms" in out
    assert "usage      7 prompt + 3 completion = 10 tokens" in out
    sent = server.requests[0].body["messages"]
    assert sent[0]["role"] == "user" and "pong" in sent[0]["content"]
    assert f"reply      echo: {sent[0]['content']}" in out


def test_llm_ping_json_and_failure(server, capsys):
    assert main(["llm", "ping", f"anthropic:py-claude@{server.url}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "py-claude" and out["usage"]["total_tokens"] == 13
    assert out["backend"] == f"anthropic:py-claude@{server.url}" and out["latency_ms"] > 0
    server.queue(Reply(status=403, body={"error": {"message": "forbidden model"}}))
    assert main(["llm", "ping", f"openai:py-model@{server.url}/v1"]) == 1
    assert "forbidden model" in capsys.readouterr().err
    assert main(["llm", "ping", "nope:x"]) == 1
    assert main(["llm"]) == 2
