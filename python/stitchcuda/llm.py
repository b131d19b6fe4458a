"""Talk to a model: ``connect(spec_or_callable, **options)`` gives a backend whose ``complete(messages)``
returns a :class:`Completion`.

The work happens in C++ (``stitchcuda::llm``): HTTP through libcurl, retries with back-off, rate
limits, timeouts, transcripts. This module turns Python values into what ``stitchcuda._C`` takes and
wraps Python callables as backends. Specs: ``openai:MODEL[@BASE_URL]``, ``anthropic:MODEL[@BASE_URL]``,
``replay:PATH``, ``scripted:PATH`` and ``python:MODULE:ATTRIBUTE``; see docs/llm.md.
"""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence, Union

from . import _C
from .errors import InvalidArgumentError
from .log import redact, remember_url_credentials

__all__ = [
    "connect",
    "scripted",
    "parse_spec",
    "known_providers",
    "request_hash",
    "Backend",
    "Completion",
    "Usage",
    "Totals",
    "Spec",
    "CancelToken",
]

#: Lets one thread stop a call another is waiting on: ``token.cancel()``; pass it as ``cancel=token``.
CancelToken = _C.LlmCancelToken

# Options of one call; given to connect() they become the backend's defaults.
REQUEST_OPTIONS = ("temperature", "top_p", "max_tokens", "stop", "seed", "json_schema", "extra", "stream",
                   "allow_truncated", "connect_timeout", "timeout", "cancel")
# Options of the connection: server, key, retries, limits, prices, transcript.
CONNECT_OPTIONS = ("api_key_env", "api_key", "organization", "headers", "anthropic_version", "max_reply_bytes",
                   "replay_match", "max_attempts", "initial_backoff", "max_backoff", "jitter", "max_retry_after",
                   "requests_per_minute", "tokens_per_minute", "prompt_price", "completion_price", "record")

MessageLike = Union[str, Mapping[str, Any], Sequence[Mapping[str, Any]]]


@dataclass(frozen=True)
class Usage:
    """Tokens a call (or a run) consumed, as the server counted them (zero where it did not say)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass(frozen=True)
class Completion:
    """A model's answer."""

    text: str
    finish_reason: str  # "stop", "length", "tool_calls"... (Anthropic's reasons in OpenAI's words)
    usage: Usage
    latency_ms: float  # the whole call: retries and waits included
    model: str  # the model the server says answered
    id: str  # the provider's id of the reply
    attempts: int  # requests sent (1 + retries)


@dataclass(frozen=True)
class Totals:
    """What a backend has done since it was connected: the usage and cost of a run."""

    calls: int
    attempts: int
    retries: int
    failures: int
    usage: Usage
    cost_usd: float  # from prompt_price / completion_price (USD per million tokens)


class Spec(NamedTuple):
    """A parsed ``PROVIDER:MODEL[@BASE_URL]``."""

    provider: str
    model: str  # or the file of replay: / scripted:
    base_url: str  # "" for the provider's default


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _native_request_options(options: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        if key in ("json_schema", "extra"):
            value = _json_text(value)  # a dict or a JSON string
        elif key == "stop" and isinstance(value, str):
            value = [value]
        out[key] = value
    return out


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    # OpenAI's list-of-parts form: the text parts, in order.
    if isinstance(content, Sequence) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise TypeError(f"message content must be a str (or a list of text parts), got {type(content).__name__}")


def _messages(messages: MessageLike) -> list[dict[str, str]]:
    """OpenAI-style message dicts; a bare string is one user message."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if isinstance(messages, Mapping):
        messages = [messages]
    out = []
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise TypeError(f"each message must be a dict with 'role' and 'content', got {m!r}")
        out.append({"role": str(m["role"]), "content": _content_text(m["content"])})
    return out


def _usage(raw: Mapping[str, int]) -> Usage:
    return Usage(int(raw["prompt_tokens"]), int(raw["completion_tokens"]), int(raw["total_tokens"]))


def _split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    request, connection = {}, {}
    for key, value in options.items():
        if key in REQUEST_OPTIONS:
            request[key] = value
        elif key in CONNECT_OPTIONS:
            connection[key] = value
        else:
            raise InvalidArgumentError(f"unknown option '{key}'; call options: {', '.join(REQUEST_OPTIONS)}; "
                                       f"connect options: {', '.join(CONNECT_OPTIONS)}")
    if "record" in connection and connection["record"] is not None:
        connection["record"] = str(connection["record"])
    if "headers" in connection and connection["headers"] is not None:
        connection["headers"] = {str(k): str(v) for k, v in dict(connection["headers"]).items()}
    return request, connection


class Backend:
    """A connected model. Thread safe: several threads may call ``complete`` at once; the GIL is
    released while a call waits."""

    __slots__ = ("_native", "_defaults")

    def __init__(self, native: Any, defaults: Mapping[str, Any]) -> None:
        self._native = native
        self._defaults = dict(defaults)

    @property
    def name(self) -> str:
        """What this backend talks to, e.g. ``openai:gpt-4.1`` (never a key, nor a URL's password)."""
        return redact(self._native.name)

    def complete(self, messages: MessageLike, *, on_text: Callable[[str], Any] | None = None,
                 **options: Any) -> Completion:
        """Answers a conversation: a list of ``{"role", "content"}`` dicts (or one user string).

        Options (defaults from :func:`connect`): temperature, top_p, max_tokens, stop, seed,
        json_schema (dict or JSON text), extra (provider fields, dict), stream (pieces go to
        ``on_text`` as they arrive; the same Completion is returned), allow_truncated, timeout (s,
        the whole call), connect_timeout (s), cancel (a CancelToken). Raises LLMError (with
        ``.http_status``), StitchTimeoutError, CancelledError, InvalidArgumentError.
        """
        merged = {**self._defaults, **options}
        unknown = set(merged) - set(REQUEST_OPTIONS)
        if unknown:
            raise InvalidArgumentError(f"unknown call option(s) {sorted(unknown)}; known: {', '.join(REQUEST_OPTIONS)}")
        raw = self._native.complete(_messages(messages), _native_request_options(merged), on_text)
        return Completion(text=raw["text"], finish_reason=raw["finish_reason"], usage=_usage(raw["usage"]),
                          latency_ms=float(raw["latency_ms"]), model=raw["model"], id=raw["id"],
                          attempts=int(raw["attempts"]))

    @property
    def totals(self) -> Totals:
        """Calls, attempts, retries, failures, tokens and cost since this backend was connected."""
        raw = self._native.totals()
        return Totals(calls=raw["calls"], attempts=raw["attempts"], retries=raw["retries"],
                      failures=raw["failures"], usage=_usage(raw["usage"]), cost_usd=raw["cost_usd"])

    def __repr__(self) -> str:
        return f"<stitchcuda.llm.Backend {self.name}>"


def _call_with_options(fn: Callable[..., Any]) -> Callable[[list, dict], Any]:
    """fn as the trampoline calls it, fn(messages, options): whether fn takes the options is read
    from its signature once, not tried per call."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: give messages only
        return lambda messages, options: fn(messages)
    try:
        signature.bind([], {})
    except TypeError:
        return lambda messages, options: fn(messages)
    return fn


def _callable_target(target: Any) -> tuple[Callable[[list, dict], Any], str]:
    method = getattr(target, "complete", None)
    fn = method if callable(method) else target
    if not callable(fn):
        raise TypeError(f"a Python backend must be callable or have a complete() method; got {type(target).__name__}")
    name = getattr(fn, "__qualname__", None) or type(target).__name__
    module = getattr(fn, "__module__", None)
    return _call_with_options(fn), f"python:{module}.{name}" if module else f"python:{name}"


def _load_python_spec(spec: str) -> Any:
    """``python:package.module:attribute`` → the attribute (a function, or an object with complete())."""
    _, _, rest = spec.partition(":")
    module_name, _, attribute = rest.partition(":")
    if not module_name or not attribute:
        raise InvalidArgumentError(f"malformed model spec '{spec}': expected python:MODULE:ATTRIBUTE, "
                                   "e.g. python:my_models:answer")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # not found, or the module raised while importing: the spec cannot be used
        raise InvalidArgumentError(
            f"model spec '{spec}': importing '{module_name}' failed ({type(exc).__name__}: {exc}); the module must "
            "be importable from here: run from its folder (the stitchcuda command adds the current folder) or add "
            "its folder to PYTHONPATH") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidArgumentError(f"model spec '{spec}': '{module_name}' has no attribute '{attribute}'") from None
    return target


def connect(spec: str | Callable[..., Any] | Any, **options: Any) -> Backend:
    """A backend for a spec string, or for a Python callable.

    ``spec``: ``openai:gpt-4.1``, ``openai:qwen3-32b@http://127.0.0.1:8000/v1`` (vLLM, SGLang,
    llama.cpp, Ollama), ``anthropic:claude-sonnet-4-5``, ``replay:runs/x/llm.jsonl``,
    ``scripted:rules.json``, ``python:module:function``; or a function (or an object with a
    ``complete`` method) taking ``messages`` (and optionally an ``options`` dict) and returning the
    reply text or a dict with ``text`` and optionally ``finish_reason``, ``usage``, ``model``, ``id``.

    Options: any call option of :meth:`Backend.complete` (becomes the default), and api_key_env,
    api_key, organization, headers, anthropic_version, max_reply_bytes, replay_match ("hash" or
    "order"), max_attempts, initial_backoff, max_backoff, jitter, max_retry_after (s),
    requests_per_minute, tokens_per_minute, prompt_price, completion_price (USD per million
    tokens), record (a JSONL transcript path). A missing API key, an unknown provider or a
    malformed spec raise at once.
    """
    request, connection = _split_options(options)
    if isinstance(spec, str):
        remember_url_credentials(spec)  # a BASE_URL's user:password is masked wherever it is written from now on
    if isinstance(spec, str) and spec.startswith("python:"):
        spec = _load_python_spec(spec)
    if isinstance(spec, str):
        native = _C.llm_connect(spec, connection)
    else:
        fn, name = _callable_target(spec)
        native = _C.llm_connect_callable(fn, name, connection)
    return Backend(native, request)


def scripted(rules: Mapping[str, str | Sequence[str]] | Iterable[tuple[str, str | Sequence[str]]],
             **options: Any) -> Backend:
    """A backend for tests: the first rule whose pattern (a regular expression) is found in the last
    user message answers; a rule with several replies gives them in turn, the last repeating."""
    request, connection = _split_options(options)
    items = rules.items() if isinstance(rules, Mapping) else rules
    native_rules = [(pattern, [replies] if isinstance(replies, str) else list(replies)) for pattern, replies in items]
    return Backend(_C.llm_scripted(native_rules, "scripted", connection), request)


def parse_spec(spec: str) -> Spec:
    """Splits ``PROVIDER:MODEL[@BASE_URL]``; InvalidArgumentError says what is wrong."""
    return Spec(*_C.llm_parse_spec(spec))


def known_providers() -> list[str]:
    """The providers a spec may name (besides ``python:``)."""
    return list(_C.llm_known_providers())


def request_hash(messages: MessageLike, **options: Any) -> str:
    """The key a transcript stores a request under (SHA-256 of the messages and answer options)."""
    request = {k: v for k, v in options.items() if k in REQUEST_OPTIONS}
    return _C.llm_request_hash(_messages(messages), _native_request_options(request))
