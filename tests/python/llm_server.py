"""A real HTTP server on 127.0.0.1 for the Python llm tests: OpenAI and Anthropic replies (echoing the
last user message), streams, and failures on request (any status and headers, a slow first byte, a
stream cut mid-way).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """What the server does with one request."""

    status: int = 200
    body: Any = None  # a dict (sent as JSON) or a str
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    events: list[str] | None = None  # SSE frames, sent chunked, one write each
    delay: float = 0.0  # seconds before the status line
    cut_after: int | None = None  # close the connection after this many events


@dataclass
class SeenRequest:
    path: str
    headers: dict[str, str]  # lower-case names
    body: dict[str, Any]


def last_user_message(body: dict[str, Any]) -> str:
    users = [m["content"] for m in body.get("messages", []) if m.get("role") == "user"]
    return users[-1] if users else ""


def openai_events(pieces: list[str], finish_reason: str = "stop") -> list[str]:
    base = {"id": "chatcmpl-py", "object": "chat.completion.chunk", "model": "py-model"}
    frames = [{**base, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces]
    frames.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason}]})
    frames.append({**base, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": len(pieces),
                                                    "total_tokens": 7 + len(pieces)}})
    return [f"data: {json.dumps(f)}\n\n" for f in frames] + ["data: [DONE]\n\n"]


def anthropic_events(pieces: list[str]) -> list[str]:
    def event(name: str, data: dict[str, Any]) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

    return ([event("message_start", {"message": {"id": "msg_py", "model": "py-claude",
                                                 "usage": {"input_tokens": 9, "output_tokens": 1}}})]
            + [event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": p}})
               for p in pieces]
            + [event("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": len(pieces)}}),
               event("message_stop", {})])


def echo_reply(path: str, body: dict[str, Any]) -> Reply:
    """The default: "echo: <last user message>" in the protocol the path names."""
    text = "echo: " + last_user_message(body)
    pieces = [text[: len(text) // 2], text[len(text) // 2:]]
    if path.endswith("/chat/completions"):
        if body.get("stream"):
            return Reply(content_type="text/event-stream", events=openai_events(pieces))
        return Reply(body={"id": "chatcmpl-py", "model": "py-model",
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                        "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}})
    if path.endswith("/v1/messages"):
        if body.get("stream"):
            return Reply(content_type="text/event-stream", events=anthropic_events(pieces))
        return Reply(body={"id": "msg_py", "type": "message", "model": "py-claude",
                           "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                           "usage": {"input_tokens": 9, "output_tokens": 4}})
    return Reply(status=404, body={"error": {"message": f"no route {path}"}})


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked replies, as real servers do

    def log_message(self, format: str, *args: Any) -> None:  # quiet in test output
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length)
        body = json.loads(raw) if raw else {}
        owner: LocalLlmServer = self.server.owner  # type: ignore[attr-defined]
        reply = owner._next(SeenRequest(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        if reply.delay:
            time.sleep(reply.delay)
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        if reply.events is None:
            data = (json.dumps(reply.body) if not isinstance(reply.body, str) else reply.body).encode()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i, event in enumerate(reply.events):
                if reply.cut_after is not None and i >= reply.cut_after:
                    self.close_connection = True
                    self.wfile.flush()
                    self.connection.shutdown(2)  # mid-stream, no final chunk
                    return
                data = event.encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the client stopped reading (a cancelled stream)
            self.close_connection = True


class LocalLlmServer:
    """ThreadingHTTPServer on a free port of 127.0.0.1; ``queue`` scripts the next replies."""

    def __init__(self) -> None:
        self._replies: deque[Reply] = deque()
        self._lock = threading.Lock()
        self.requests: list[SeenRequest] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.owner = self  # type: ignore[attr-defined]
        # A short poll interval: shutdown() waits for it, once per test.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def queue(self, *replies: Reply) -> None:
        with self._lock:
            self._replies.extend(replies)

    def _next(self, request: SeenRequest) -> Reply:
        with self._lock:
            self.requests.append(request)
            if self._replies:
                return self._replies.popleft()
        return echo_reply(request.path, request.body)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
