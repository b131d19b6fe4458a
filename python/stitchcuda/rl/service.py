"""The reward service: ``rl.score_completion`` over HTTP/JSON for RL trainers (``stitchcuda serve reward``),
and ``RewardClient``, the Python side TRL, verl and OpenRLHF reward functions call. docs/reward-service.md.

The server is the standard library's ThreadingHTTPServer in front of a ``RewardPool`` (rl/workers.py):
a handler thread queues a batch, waits for its items up to their deadline and answers; the pool's workers
score. Routes: POST /score, POST /openrlhf, GET /health, GET /metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable, Mapping, Sequence

from ..errors import InternalError, InvalidArgumentError, StitchError, UnavailableError
from ..log import redact
from .rows import label_row, openrlhf_batch, openrlhf_result, reply_of, task_of
from .score import RewardConfig, Scored
from .workers import MAX_DEADLINE_S, MODES, Rejected, RewardItem, RewardPool

__all__ = ["RewardService", "RewardClient", "register", "DEFAULT_PORT"]

DEFAULT_PORT = 8750
MAX_BODY_BYTES = 64 << 20
# A client that sends nothing for this long (half a request line, half a body, an idle keep-alive) is
# answered 408 or dropped: a slow client ties up one handler thread for at most this long.
READ_TIMEOUT_S = 30.0
# Connections served at once (a handler thread each); the next ones get 503 at once. Bounds the threads a
# crowd of slow clients can make.
MAX_CONNECTIONS = 256
# JSON nested deeper than this is refused before anything walks it (Python's parser and encoder recurse).
MAX_JSON_DEPTH = 64
ROUTES = ("POST /score", "POST /openrlhf", "GET /health", "GET /metrics")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # connections the kernel holds while every handler is busy
    max_connections = MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._open = 0  # connections being served (a thread each)
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            full = self._open >= self.max_connections
            if not full:
                self._open += 1
        if full:  # answered here, without a thread: the reply is small and the socket's buffer takes it
            body = json.dumps(_error("busy", f"the service serves {self.max_connections} connections at once and "
                                             "all are taken; retry in a second")).encode()
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                                + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._closed_one()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed_one()

    def _closed_one(self) -> None:
        with self._open_lock:
            self._open -= 1

    @property
    def open_connections(self) -> int:
        with self._open_lock:
            return self._open


class RewardService:
    """HTTP front of a RewardPool. ``start()`` serves in a background thread; ``shutdown()`` drains:
    new requests get 503, accepted items finish and are answered, then the server and the pool stop.

    ``mode``: the mode of items that name none ("auto": the full check on GPU workers, static checks on
    CPU ones). ``config``: the RewardConfig of items that name none (None: score_completion's default).

    Dataset rows (an item whose task carries its own reference problem) are taken only from the service's
    sources: the shipped sets and the folders of problems in ``sources``, matched by the reference's text;
    any other row is refused (403) unless ``allow_rows`` is set. Whatever its origin, a row's reference
    runs only in the sandboxed Verifier workers, never in this process. ``read_timeout_s`` and
    ``max_connections`` bound what slow or many clients can hold.
    """

    def __init__(self, pool: RewardPool, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, mode: str = "auto",
                 config: Any = None, allow_rows: bool = False, sources: Sequence[str | os.PathLike] = (),
                 max_body_bytes: int = MAX_BODY_BYTES, read_timeout_s: float = READ_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS, log: bool = False) -> None:
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not (isinstance(read_timeout_s, (int, float)) and 0 < read_timeout_s <= 3600):
            raise InvalidArgumentError(f"read_timeout_s must be a number of seconds in (0, 3600], got {read_timeout_s!r}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise InvalidArgumentError(f"max_connections must be an integer >= 1, got {max_connections!r}")
        self.pool = pool
        self.allow_rows = bool(allow_rows)
        self.sources = source_references(sources)
        self.mode = mode
        self.config = RewardConfig.of(config, "config") if config is not None else None
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = float(read_timeout_s)
        self.log = log
        self._active = 0  # POST requests being answered
        self._active_cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        try:
            self.server = _Server((host, port), _handler(self))
        except OSError as exc:
            raise UnavailableError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (pick another --port, or "
                                   "--port 0 for any free one)") from None
        self.server.max_connections = max_connections

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.server_address[:2]
        return host, port

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def start(self) -> "RewardService":
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="stitchcuda-reward-http", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, drain_timeout_s: float | None = None) -> bool:
        """Drains (refuses new items, finishes and answers accepted ones) and stops. True when everything
        accepted was answered within ``drain_timeout_s``."""
        if self._stopped:
            return True
        drained = self.pool.drain(drain_timeout_s)
        end = None if drain_timeout_s is None else time.monotonic() + 10.0
        with self._active_cond:  # the handlers still writing their replies
            while self._active:
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    drained = False
                    break
                self._active_cond.wait(remaining if remaining is not None else 1.0)
        self._stopped = True
        if self._thread is not None:
            self.server.shutdown()
        self.server.server_close()
        self.pool.close()
        return drained

    def __enter__(self) -> "RewardService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown(drain_timeout_s=30)

    # -- requests ------------------------------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, Any]]:
        ready = self.pool.ready_workers()
        status = "draining" if self.pool.draining else ("ok" if ready else "starting")
        m = self.pool.metrics()
        return (503 if self.pool.draining else 200), {
            "status": status, "workers": len(self.pool.slots), "ready_workers": ready, "device": self.pool.device,
            "mode": self.mode, "queue_depth": m["queue_depth"], "queue_size": m["queue_size"],
            "in_flight": m["in_flight"]}

    def score(self, body: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
        """POST /score: {"items": [...], "deadline_s"?, "config"?, "mode"?} or a bare list of items."""
        started = time.monotonic()
        if isinstance(body, list):
            body = {"items": body}
        if not isinstance(body, Mapping):
            return 400, _error("bad-request", "the body must be a JSON object {\"items\": [...]} or a list of items"), {}
        unknown = sorted(set(body) - {"items", "deadline_s", "config", "mode"})
        if unknown:
            return 400, _error("bad-request", f"unknown field(s) {', '.join(unknown)}; known: items, deadline_s, "
                                              "config, mode"), {}
        raw_items = body.get("items")
        if not isinstance(raw_items, list) or not raw_items:
            return 400, _error("bad-request", "'items' must be a non-empty list of {task, completion, ...}"), {}
        deadline = body.get("deadline_s")
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or not 0 < deadline <= MAX_DEADLINE_S):
            return 400, _error("bad-request", f"deadline_s must be a number of seconds above 0 and at most "
                                              f"{MAX_DEADLINE_S:g}, got {deadline!r:.40}"), {}
        try:
            config = RewardConfig.of(body["config"], "config") if body.get("config") is not None else self.config
            mode = body.get("mode", self.mode)
            if mode not in MODES:
                raise InvalidArgumentError(f"mode must be one of {', '.join(MODES)}, got {mode!r:.40}")
            items = [RewardItem.from_json(it, f"items[{i}]", config=config, mode=mode) for i, it in enumerate(raw_items)]
            refused = self._vet_rows(items)
            if refused:
                return 403, _error("row-refused", refused), {}
            tickets = self.pool.submit(items, deadline)
        except InvalidArgumentError as exc:
            return 400, _error("bad-request", str(exc)), {}
        except Rejected as exc:
            return _rejected(exc)
        results = [t.result() for t in tickets]
        return 200, {"results": results, "elapsed_s": round(time.monotonic() - started, 4)}, {}

    def openrlhf(self, body: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
        """POST /openrlhf: OpenRLHF's remote reward protocol, {"query", "prompts", "labels"} ->
        {"rewards", "scores", "extra_logs"}, read and answered as rl.trainers.openrlhf_reply does, each
        reply scored through this pool (queue, cache, deadlines). "reasons" holds each score's reason; an
        item that could not be scored (its deadline passed) gets 0 and says why there."""
        try:
            queries, prompts, labels = openrlhf_batch(body)
            items = []
            for i, (label, query, prompt) in enumerate(zip(labels, queries, prompts)):
                task, keywords = task_of(label_row(label))
                item = RewardItem(task, reply_of(query, prompt), mode=self.mode, config=self.config, **keywords)
                item.check(f"labels[{i}]")
                items.append(item)
            refused = self._vet_rows(items)
            if refused:
                return 403, _error("row-refused", refused), {}
            tickets = self.pool.submit(items)
        except InvalidArgumentError as exc:
            return 400, _error("bad-request", str(exc)), {}
        except Rejected as exc:
            return _rejected(exc)
        scored = [Scored.from_reply(t.result()) for t in tickets]
        reply = openrlhf_result(scored)
        reply["reasons"] = [s.reason for s in scored]  # beside extra_logs, which OpenRLHF logs as numbers
        return 200, reply, {}

    def _vet_rows(self, items: Sequence[RewardItem]) -> str:
        """Turns rows that are a shipped task's own into its id and keeps rows of the configured sources;
        returns why the first other row is refused ("" when none is, or inline rows are allowed)."""
        from .problems import find_task

        for i, item in enumerate(items):
            if not isinstance(item.task, Mapping):
                continue
            task_id, reference = item.task.get("task_id"), item.task.get("reference")
            try:
                shipped = find_task(task_id) if isinstance(task_id, str) else None
            except (LookupError, InvalidArgumentError):
                shipped = None
            if shipped is not None and shipped["reference"] == reference:
                item.task = shipped["task_id"]
                continue
            if self.allow_rows or (isinstance(reference, str) and _digest(reference) in self.sources):
                continue
            where = "the shipped sets" + (f" and {len(self.sources)} problem(s) of --tasks" if self.sources else "")
            return (f"items[{i}].task is a dataset row whose reference problem is not one of this service's sources "
                    f"({where}); rows from elsewhere are refused. Send a shipped task id, add the problem's folder "
                    "with --tasks DIR, or start the service with --allow-rows to score inline rows (their "
                    "references run in the sandboxed workers only)")
        return ""


def source_references(folders: Sequence[str | os.PathLike]) -> frozenset[str]:
    """The SHA-256 of every problem file (``*.py``, recursively) in ``folders``: the rows a service takes
    besides the shipped sets. Read as text, never run; a folder that is missing or holds no problem is an
    InvalidArgumentError naming it."""
    from pathlib import Path

    from .problems import problem_files, read_problem_text

    found: set[str] = set()
    for folder in folders:
        root = Path(folder)
        if not root.is_dir():
            raise InvalidArgumentError(f"--tasks {os.fspath(folder)}: not a folder; give a folder of KernelBench-format "
                                       "problem files")
        paths = list(problem_files(root))
        if not paths:
            raise InvalidArgumentError(f"--tasks {os.fspath(folder)}: holds no .py problem files")
        for path in paths:
            try:
                found.add(_digest(read_problem_text(path)))
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"--tasks {os.fspath(folder)}: {exc.message}") from None
    return frozenset(found)


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def json_problem(value: Any) -> str:
    """Why a request's JSON cannot be taken ("" when it can): nesting deeper than MAX_JSON_DEPTH, or a
    string holding a lone UTF-16 surrogate (JSON's "\\ud800" without its pair), which is no character and
    cannot reach the Verifier as text. Walked without recursion."""
    stack: list[tuple[Any, str, int]] = [(value, "body", 1)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"the body's JSON is nested more than {MAX_JSON_DEPTH} levels deep (at {where[:80]})"
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as exc:
                return (f"{where[:80]} holds a lone UTF-16 surrogate (U+{ord(node[exc.start]):04X} at character "
                        f"{exc.start}): it is no character; send valid Unicode (a character outside the BMP as a "
                        "surrogate pair, or UTF-8)")
        elif isinstance(node, dict):
            for key, item in node.items():
                stack.append((key, f"{where} key", depth + 1))
                stack.append((item, f"{where}.{key}" if where != "body" else str(key), depth + 1))
        elif isinstance(node, list):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(node))
    return ""


def _error(kind: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"kind": kind, "message": message, **extra}}


def _rejected(exc: Rejected) -> tuple[int, dict[str, Any], dict[str, str]]:
    status = {"queue-full": 429, "draining": 503, "too-large": 413}.get(exc.kind, 503)
    headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if exc.kind == "queue-full" else {}
    return status, _error(exc.kind, exc.message, retry_after_s=round(exc.retry_after_s, 1)), headers


def _handler(service: RewardService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "stitchcuda-reward"
        # The status line and headers go out in one write and the body in another: with Nagle's algorithm
        # the body would wait for the client's delayed ACK (~40 ms a reply).
        disable_nagle_algorithm = True
        timeout = service.read_timeout_s  # every read and write of the socket (StreamRequestHandler.setup)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            if service.log:
                sys.stderr.write(f"[reward] {self.address_string()} {format % args}\n")

        def _send(self, status: int, body: Any, headers: Mapping[str, str] | None = None,
                  content_type: str = "application/json") -> None:
            # Every reply is redacted whole: an echoed task id, a reference's error, a candidate's text.
            data = redact(body if isinstance(body, str) else json.dumps(body, default=str)).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                if self.close_connection:
                    self.send_header("Connection", "close")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client went away or stopped reading; the result stays in the cache
                self.close_connection = True

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/health":
                status, body = service.health()
                self._send(status, body)
            elif url.path == "/metrics":
                metrics = service.pool.metrics()
                if urllib.parse.parse_qs(url.query).get("format") == ["prometheus"]:
                    self._send(200, prometheus_text(metrics), content_type="text/plain; version=0.0.4")
                else:
                    self._send(200, metrics)
            else:
                self._send(404, _error("not-found", f"no route GET {url.path}; routes: {', '.join(ROUTES)}"))

        def do_POST(self) -> None:  # noqa: N802
            path = urllib.parse.urlsplit(self.path).path
            length, problem = self._length()
            if problem is None and path not in ("/score", "/openrlhf"):
                problem = 404, _error("not-found", f"no route POST {path}; routes: {', '.join(ROUTES)}")
                if length <= service.max_body_bytes:  # read it, so the connection can serve the next request
                    problem = self._read(length)[1] or problem
                else:
                    self.close_connection = True
            if problem is not None:
                self._send(*problem)
                return
            body, problem = self._read_json(length)
            if problem is not None:
                self._send(*problem)
                return
            # Counted from here: a request whose body is still arriving holds nothing a drain must wait for.
            with service._active_cond:
                service._active += 1
            try:
                status, reply, headers = (service.score if path == "/score" else service.openrlhf)(body)
            except Exception as exc:  # noqa: BLE001 - a bug answers 500 with its text, the server lives on
                status, reply, headers = 500, _error("internal", f"{type(exc).__name__}: {exc}"), {}
            try:
                self._send(status, reply, headers)
            finally:
                with service._active_cond:
                    service._active -= 1
                    service._active_cond.notify_all()

        def _length(self) -> tuple[int, tuple | None]:
            """The body's length from Content-Length, or the 4xx reply for a missing, malformed or too large
            one (the connection is closed then: where the body ends is unknown)."""
            raw = self.headers.get("Content-Length")
            if raw is None or self.headers.get("Transfer-Encoding"):
                self.close_connection = True
                return 0, (411, _error("bad-request", "send the body with a Content-Length header (chunked transfer "
                                                      "encoding is not read)"))
            if not raw.strip().isdigit():
                self.close_connection = True
                return 0, (400, _error("bad-request", f"Content-Length must be a number of bytes, got {raw[:40]!r}"))
            length = int(raw)
            if length > service.max_body_bytes:
                self.close_connection = True
                return length, (413, _error("too-large", f"the body has {length} bytes, more than the "
                                                         f"{service.max_body_bytes} allowed: send smaller batches"))
            return length, None

        def _read(self, length: int) -> tuple[bytes, tuple | None]:
            """The body, or 408 when the client stops sending it for read_timeout_s."""
            try:
                data = self.rfile.read(length)
            except (TimeoutError, OSError):
                data = b""
            if len(data) < length:
                self.close_connection = True
                return data, (408, _error("timeout", f"the body stopped arriving ({len(data)} of {length} bytes after "
                                                     f"{service.read_timeout_s:g} s without data); send it whole"))
            return data, None

        def _read_json(self, length: int) -> tuple[Any, tuple | None]:
            data, problem = self._read(length)
            if problem is not None:
                return None, problem
            try:
                body = json.loads(data)
            except RecursionError:
                return None, (400, _error("bad-request", f"the body's JSON is nested more than {MAX_JSON_DEPTH} levels "
                                                         "deep: send items as {task, completion, ...} objects"))
            except (ValueError, UnicodeDecodeError) as exc:
                return None, (400, _error("bad-request", f"the body is not valid JSON: {exc}"))
            why = json_problem(body)
            if why:
                return None, (400, _error("bad-request", why))
            return body, None

    return Handler


def prometheus_text(metrics: Mapping[str, Any]) -> str:
    """The metrics in Prometheus's text format (GET /metrics?format=prometheus)."""
    lines: list[str] = []

    def put(name: str, kind: str, samples: Iterable[tuple[str, Any]]) -> None:
        lines.append(f"# TYPE stitchcuda_reward_{name} {kind}")
        lines.extend(f"stitchcuda_reward_{name}{labels} {float(value):g}" for labels, value in samples
                     if value is not None)

    for name in ("queue_depth", "queue_size", "in_flight"):
        put(name, "gauge", [("", metrics[name])])
    for name in ("items", "done", "failed", "deadline_exceeded", "retries"):
        put(f"{name}_total", "counter", [("", metrics[name])])
    put("rejected_total", "counter", [(f'{{reason="{r}"}}', n) for r, n in metrics["rejected_by_reason"].items()])
    put("cache_hits_total", "counter", [("", metrics["cache"]["hits"])])
    put("cache_misses_total", "counter", [("", metrics["cache"]["misses"])])
    put("latency_seconds", "gauge", [(f'{{stage="{stage}",quantile="0.{p[1:]}"}}', q[p])
                                     for stage, q in metrics["latency_s"].items() for p in ("p50", "p90", "p99")])
    put("worker_busy", "gauge", [(f'{{worker="{w["name"]}"}}', int(w["state"] == "busy")) for w in metrics["workers"]])
    put("worker_jobs_total", "counter", [(f'{{worker="{w["name"]}"}}', w["jobs"]) for w in metrics["workers"]])
    return "\n".join(lines) + "\n"


# ---- the client -------------------------------------------------------------------------------------


class RewardClient:
    """Calls a reward service: ``RewardClient("http://127.0.0.1:8750").score(items)``.

    Items are ``RewardItem`` or mappings {task, completion, skill?, previous?, feedback?, mode?, config?,
    asks?}; replies are Scored.to_dict() plus "service", or {"task_id", "error", "service"} for an item
    that missed its deadline or could not be scored. A full queue (429) or a draining service (503) is
    retried after the server's Retry-After, up to ``retries`` times; then UnavailableError. Safe to
    share between threads (one connection per call).
    """

    def __init__(self, url: str, *, timeout_s: float | None = None, retries: int = 8,
                 max_retry_wait_s: float = 30.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise InvalidArgumentError(f"RewardClient needs the service's URL such as http://127.0.0.1:{DEFAULT_PORT}, "
                                       f"got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_retry_wait_s = max_retry_wait_s

    def score(self, items: Iterable[RewardItem | Mapping[str, Any]], *, deadline_s: float | None = None,
              config: Any = None, mode: str | None = None) -> list[dict[str, Any]]:
        """Scores a batch; one reply per item, in order."""
        body: dict[str, Any] = {"items": [it.to_json() if isinstance(it, RewardItem) else dict(it) for it in items]}
        if not body["items"]:
            return []
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        if config is not None:
            body["config"] = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        if mode is not None:
            body["mode"] = mode
        timeout = self.timeout_s if self.timeout_s is not None else (deadline_s or 600.0) + 60.0
        return self._call("POST", "/score", body, timeout)["results"]

    def score_one(self, task: Any, completion: Any, **fields: Any) -> dict[str, Any]:
        """Scores one completion (fields: skill, previous, feedback, mode, config, asks, deadline_s)."""
        deadline = fields.pop("deadline_s", None)
        return self.score([RewardItem(task, completion, **fields)], deadline_s=deadline)[0]

    def rewards(self, items: Iterable[RewardItem | Mapping[str, Any]], *, deadline_s: float | None = None,
                on_error: float | None = 0.0) -> list[float]:
        """The scores alone; an item that errored gets ``on_error`` (None: raise UnavailableError)."""
        out = []
        for reply in self.score(items, deadline_s=deadline_s):
            if "error" in reply:
                if on_error is None:
                    raise UnavailableError(f"the reward service could not score {reply.get('task_id')}: "
                                           f"{reply['error'].get('kind')}: {reply['error'].get('message')}")
                out.append(float(on_error))
            else:
                out.append(float(reply["score"]))
        return out

    def openrlhf(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST /openrlhf as OpenRLHF sends it."""
        return self._call("POST", "/openrlhf", dict(body), self.timeout_s or 660.0)

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health", None, 10.0, accept=(200, 503))

    def metrics(self) -> dict[str, Any]:
        return self._call("GET", "/metrics", None, 10.0)

    def _call(self, method: str, path: str, body: Any, timeout: float | None,
              accept: tuple[int, ...] = (200,)) -> dict[str, Any]:
        try:
            data = json.dumps(body).encode() if body is not None else None
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"the request cannot be sent as JSON ({exc}): give tasks as ids or dataset "
                                       "rows and completions as text or chat messages") from None
        attempt = 0
        while True:
            request = urllib.request.Request(self.url + path, data=data, method=method,
                                             headers={"Content-Type": "application/json"} if data else {})
            try:
                with urllib.request.urlopen(request, timeout=timeout) as reply:
                    return json.loads(reply.read())
            except urllib.error.HTTPError as exc:
                status, payload = exc.code, _json_or_text(exc.read())
                if status in accept:
                    return payload
                message = (payload.get("error") or {}).get("message") if isinstance(payload, dict) else None
                message = f"reward service {method} {path}: HTTP {status}: {message or payload}"
                if status in (429, 503) and attempt < self.retries:
                    attempt += 1
                    time.sleep(min(self.max_retry_wait_s, _retry_after(exc.headers.get("Retry-After"), attempt)))
                    continue
                if 400 <= status < 500 and status != 429:  # the request's fault: bad, refused, too large
                    raise InvalidArgumentError(message, http_status=status) from None
                if status in (429, 503):
                    raise UnavailableError(message + f" (after {attempt} retries)", http_status=status,
                                           transient=True) from None
                raise InternalError(message, http_status=status) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise UnavailableError(f"the reward service at {self.url} is not reachable ({reason}); start it with "
                                       "`stitchcuda serve reward` or check the URL", transient=True) from None


def _json_or_text(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode(errors="replace")[:500]


def _retry_after(header: str | None, attempt: int) -> float:
    try:
        return max(0.1, float(header)) if header else 0.5 * 2 ** attempt
    except ValueError:
        return 0.5 * 2 ** attempt


# ---- the command ------------------------------------------------------------------------------------


def register(commands: argparse._SubParsersAction) -> None:
    """Adds `stitchcuda serve reward` to the CLI."""
    serve = commands.add_parser("serve", help="run a StitchCUDA service (reward: docs/reward-service.md)")
    serve.set_defaults(run=None, usage_of=serve)
    services = serve.add_subparsers(dest="service", metavar="SERVICE")
    p = services.add_parser("reward", help="the RL reward over HTTP: POST /score, /openrlhf; GET /health, /metrics",
                            description="Scores Coder replies (rl.score_completion) for RL trainers over HTTP/JSON, "
                                        "in isolated Verifier workers. SIGTERM drains: accepted items finish, new ones "
                                        "get 503, then the process exits 0.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one, printed)")
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="comma-separated devices, e.g. cuda:0,cuda:1 or cpu (default: every GPU, else the CPU)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="isolated Verifier processes per device (default 1; on a GPU, 1 keeps timings clean)")
    p.add_argument("--mode", choices=MODES, default="auto",
                   help="for items that name none: gpu (verified), static (NVRTC + static rules, unverified), "
                        "auto (gpu on GPU workers, else static; default)")
    p.add_argument("--queue", type=int, default=None, metavar="N",
                   help="items that may wait (default 64 per worker); beyond it a batch gets 429")
    p.add_argument("--deadline", type=float, default=600.0, metavar="S",
                   help="default seconds from submission to reply per item (default 600; a request's deadline_s "
                        "overrides)")
    p.add_argument("--cache", type=int, default=4096, metavar="N", help="results kept in memory (default 4096; 0: off)")
    p.add_argument("--config", type=str, default=None, metavar="FILE.json",
                   help="RewardConfig fields as JSON (tau, r_max, ..., verify: VerifyConfig fields) for items "
                        "that name none")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="score on a Ray cluster (one actor per GPU, CPU actors where none): 'auto' joins the running "
                        "cluster, 'local' starts one here, or ray://HOST:PORT")
    p.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                   help="on SIGTERM, longest wait for accepted items (default: --deadline)")
    p.add_argument("--tasks", action="append", default=[], metavar="DIR",
                   help="a folder of KernelBench-format problems whose rows (task_id + the file's text as reference) "
                        "are scored, besides the shipped sets (repeatable); other rows are refused with 403")
    p.add_argument("--allow-rows", action="store_true",
                   help="score dataset rows with any reference problem (every client is trusted to send problems); "
                        "references run in the sandboxed workers only, never in the service's process")
    p.add_argument("--log", action="store_true", help="print one line per HTTP request on stderr")
    p.set_defaults(run=serve_reward)


def _load_config(path: str | None) -> Any:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise InvalidArgumentError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise InvalidArgumentError(f"--config {path}: not valid JSON ({exc})") from None
    return RewardConfig.of(data, f"--config {path}")


def build_pool(args: argparse.Namespace) -> RewardPool:
    """The pool `serve reward` scores with: local workers, or Ray actors with --ray."""
    if args.workers < 1:
        raise InvalidArgumentError(f"--workers must be at least 1, got {args.workers}")
    options = {"queue_size": args.queue, "deadline_s": args.deadline, "cache_size": args.cache}
    if args.ray:
        from .ray_pool import RayRewardPool

        return RayRewardPool(None if args.ray == "local" else args.ray, workers_per_gpu=args.workers,
                             cpu_workers=args.workers if args.devices == "cpu" else None, **options)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    return RewardPool(devices, args.workers, **options)


def serve_reward(args: argparse.Namespace) -> int:
    """`stitchcuda serve reward`: serves until SIGTERM or Ctrl-C, then drains and exits 0 (1 when the drain
    timed out with accepted items unanswered; a second signal stops at once with 1)."""
    stop = threading.Event()
    signals: list[int] = []

    def on_signal(number: int, _frame: Any) -> None:
        signals.append(number)
        if len(signals) > 1:  # a second signal: stop waiting
            os._exit(1)
        stop.set()

    # Installed before the workers start: a signal while they warm up stops the service cleanly too.
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _serve(args, stop, signals)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _serve(args: argparse.Namespace, stop: threading.Event, signals: list[int]) -> int:
    try:
        config = _load_config(args.config)
        sources = source_references(args.tasks)
        pool = build_pool(args)
    except StitchError as exc:
        print(f"serve reward: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidArgumentError) else 1
    try:
        service = RewardService(pool, args.host, args.port, mode=args.mode, config=config,
                                allow_rows=args.allow_rows, log=args.log)
    except StitchError as exc:
        pool.close()
        print(f"serve reward: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidArgumentError) else 1
    service.sources = sources
    service.start()
    kinds = {d.device for d in pool.slots}
    print(f"stitchcuda reward service on {service.url} ({len(pool.slots)} worker(s) on {', '.join(sorted(kinds))}"
          f"{' through Ray' if args.ray else ''}, mode {args.mode}, queue {pool.queue_size}, deadline "
          f"{pool.deadline_s:g} s, {'any' if args.allow_rows else 'source'} rows)", flush=True)
    while not stop.wait(0.5):
        pass
    m = pool.metrics()
    print(f"stitchcuda reward service: {signal.Signals(signals[0]).name}, draining ({m['in_flight']} in flight, "
          f"{m['queue_depth']} queued)", flush=True)
    drained = service.shutdown(args.drain_timeout if args.drain_timeout is not None else args.deadline)
    m = pool.metrics()
    print(f"stitchcuda reward service stopped: {m['done']} scored, {m['failed']} failed, {m['rejected']} rejected, "
          f"{m['cache']['hits']} cache hits{'' if drained else ' (drain timed out)'}", flush=True)
    return 0 if drained else 1
