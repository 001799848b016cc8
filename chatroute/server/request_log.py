"""Request ids and the one log line per request (logfmt text, or JSON), and the log setup."""

from __future__ import annotations

import contextvars
import datetime
import hashlib
import json
import logging
import os
import random
import re
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatroute.providers import request_hooks
from chatroute.tracing import RequestTrace

__all__ = [
    "REQUEST_ID_HEADER",
    "JsonFormatter",
    "RequestIdFilter",
    "RequestLog",
    "RequestRecord",
    "clean_request_id",
    "configure_logging",
    "current_request",
    "key_hash",
    "logfmt",
    "note_decision",
    "note_inputs",
    "note_trace",
    "random_hex",
    "request_fields",
]

REQUEST_ID_HEADER: Final = "x-request-id"
MAX_REQUEST_ID: Final = 128
_ID_PATTERN: Final = re.compile(rb"[A-Za-z0-9._:@+=/-]{1,%d}" % MAX_REQUEST_ID)
_QUIET_PATHS: Final = frozenset({"/healthz", "/readyz", "/metrics"})

logger = logging.getLogger("chatroute.requests")


# Ids need to be unique, not secret: a generator seeded from the OS once (again in a forked
# child), instead of `uuid4()`'s `os.urandom` per id. That call releases the GIL, and under
# load the event loop then waited for a model or tokeniser thread to give it back: 0.19 ms a
# request (profiled, 64 clients on /v1/embeddings), against under 1 us here.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def random_hex() -> str:
    """A new random id: 32 hex digits (128 bits), unique across requests and processes."""
    return f"{_ids.getrandbits(128):032x}"


def clean_request_id(raw: bytes | None) -> str:
    """The caller's request id when it is 1-128 characters of `A-Za-z0-9._:@+=/-`;
    otherwise (none, too long, other characters) a new random one (32 hex digits)."""
    if raw is not None and _ID_PATTERN.fullmatch(raw):
        return raw.decode("ascii")
    return random_hex()


def key_hash(token: bytes | str) -> str:
    """A short, stable digest of an API key (12 hex digits of SHA-256): tells callers
    apart in the log without writing their key."""
    data = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(data).hexdigest()[:12]


@dataclass(eq=False)
class RequestRecord:
    """What one HTTP request did, filled in by the endpoints while it runs."""

    request_id: str
    method: str
    path: str
    started: float
    key: str | None = None
    status: int | None = None
    route: str | None = None
    score: float | None = None
    is_default: bool | None = None
    inputs: int | None = None
    trace: RequestTrace | None = None


# A weak reference, as in chatroute.tracing: callbacks scheduled during a request copy
# the context and may outlive it; they must not keep its record (and trace) alive.
_current: contextvars.ContextVar[weakref.ref[RequestRecord] | None] = contextvars.ContextVar(
    "chatroute_request_record", default=None
)


def current_request() -> RequestRecord | None:
    """The record of the HTTP request running in the current context, if any."""
    ref = _current.get()
    return ref() if ref is not None else None


def note_decision(route: str, score: float | None, is_default: bool) -> None:
    """Record the routing decision of the current request (for its log line)."""
    record = current_request()
    if record is not None:
        record.route, record.score, record.is_default = route, score, is_default


def note_inputs(count: int) -> None:
    """Record how many inputs the current request classified."""
    record = current_request()
    if record is not None:
        record.inputs = count


def note_trace(trace: RequestTrace) -> None:
    """Attach a finished chat request's trace to the current request's record."""
    record = current_request()
    if record is not None:
        record.trace = trace


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def request_fields(record: RequestRecord, latency: float) -> dict[str, Any]:
    """The fields of a request's log line, in order; absent values are left out."""
    trace = record.trace
    status = trace.status if trace is not None and trace.status is not None else record.status
    fields: dict[str, Any] = {
        "request_id": record.request_id,
        "method": record.method,
        "path": record.path,
        "status": status,
    }
    route = record.route if record.route is not None else (trace.route if trace else None)
    if route is not None:
        fields["route"] = route
    if record.score is not None:
        fields["score"] = round(record.score, 4)
    if record.is_default is not None:
        fields["default"] = record.is_default
    if record.inputs is not None:
        fields["inputs"] = record.inputs
    fields["latency_ms"] = _ms(latency)
    if trace is not None:
        if trace.first_output_at is not None:
            fields["ttft_ms"] = _ms(max(0.0, trace.first_output_at - record.started))
        fields["stream"] = trace.stream
        attempts = []
        for attempt in trace.attempts:
            entry: dict[str, Any] = {"provider": attempt.provider, "outcome": attempt.outcome}
            failure = attempt.failure_kind
            if failure is not None:
                entry["failure"] = failure
            entry["duration_ms"] = _ms(attempt.attempt.duration)
            attempts.append(entry)
        fields["attempts"] = attempts
        if trace.upstream_request_id is not None:
            fields["upstream_request_id"] = trace.upstream_request_id
        if trace.cancelled is not None:
            fields["cancelled"] = trace.cancelled
        usage = trace.usage
        if usage is not None:
            for name, value in (
                ("input_tokens", usage.input_token_count),
                ("output_tokens", usage.output_token_count),
                ("cached_tokens", usage.cached_input_token_count),
                ("reasoning_tokens", usage.reasoning_token_count),
            ):
                if value is not None:
                    fields[name] = value
    if record.key is not None:
        fields["key"] = record.key
    return fields


_BARE: Final = re.compile(r"[A-Za-z0-9._:,@+/-]+")


def _value(value: Any) -> str:
    kind = type(value)
    if kind is bool:
        return "true" if value else "false"
    if kind is int or kind is float:
        return str(value)
    if value is None:
        return "-"
    text = str(value)
    return text if _BARE.fullmatch(text) else json.dumps(text)


def logfmt(fields: dict[str, Any]) -> str:
    """`key=value` pairs (logfmt): values with spaces, quotes or control characters are
    JSON-quoted; attempts read `provider:outcome[:failure]:duration_ms`."""
    parts = []
    for name, value in fields.items():
        if name == "attempts":
            if not value:
                continue
            value = ",".join(":".join(map(str, attempt.values())) for attempt in value)
        parts.append(f"{name}={_value(value)}")
    return " ".join(parts)


def _log_request(record: RequestRecord) -> None:
    level = logging.DEBUG if record.path in _QUIET_PATHS else logging.INFO
    if not logger.isEnabledFor(level):
        return
    fields = request_fields(record, time.perf_counter() - record.started)
    logger.log(level, "request %s", logfmt(fields), extra={"request": fields})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


def _caller_key(scope: Scope) -> str | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(b" ")
    token = token.strip() if scheme.lower() == b"bearer" else value
    return key_hash(token) if token else None


class RequestLog:
    """ASGI middleware (outermost): gives each request an id (the caller's `x-request-id`
    when well-formed, else a new one), returns it on every answer, and logs one line per
    request when it ends (`/healthz`, `/readyz`, `/metrics` at DEBUG, the rest at INFO)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = clean_request_id(_header(scope, b"x-request-id"))
        record = RequestRecord(
            request_id,
            scope.get("method", ""),
            scope.get("path", ""),
            time.perf_counter(),
            key=_caller_key(scope),
        )
        raw_id = request_id.encode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [
                    (k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"
                ]
                headers.append((b"x-request-id", raw_id))
                message = {**message, "headers": headers}
            await send(message)

        token = _current.set(weakref.ref(record))
        upstream_token = request_hooks.request_id.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if record.status is None:
                record.status = 500
            raise
        finally:
            if record.status is None and record.trace is None:
                record.status = 499  # nothing was answered: the caller left first
            _log_request(record)
            request_hooks.request_id.reset(upstream_token)
            _current.reset(token)


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id` to the id of the request being served ("-" outside one),
    so every line a request causes (a failover, an error) can be joined to its log line."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = current_request()
        record.request_id = current.request_id if current is not None else "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger and message, plus a
    request log line's fields (with `message` "request"), the request id of a line logged
    while a request ran, the start-up summary (`startup`) and any exception's text."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] | None = getattr(record, "request", None)
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        body: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": "request" if fields is not None else record.getMessage(),
        }
        if fields is not None:
            body.update(fields)
        else:
            request_id = getattr(record, "request_id", "-")
            if request_id != "-":
                body["request_id"] = request_id
        startup = getattr(record, "startup", None)
        if isinstance(startup, dict):
            body["startup"] = startup
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(body, default=str).decode()


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is when a line is logged (not when it was made)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


def configure_logging(level: str, log_format: Literal["text", "json"] = "text") -> logging.Handler:
    """Send the `chatroute` loggers to stderr at `level`, as text or JSON lines; returns
    the handler (uvicorn's own loggers are set up by `uvicorn_log_config`)."""
    handler = _StderrHandler()
    formatter: logging.Formatter = (
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    handler.setFormatter(formatter)
    handler.addFilter(RequestIdFilter())
    chatroute_logger = logging.getLogger("chatroute")
    for old in list(chatroute_logger.handlers):
        if getattr(old, "_chatroute", False):
            chatroute_logger.removeHandler(old)
    handler._chatroute = True  # type: ignore[attr-defined]
    chatroute_logger.addHandler(handler)
    chatroute_logger.setLevel(level.upper())
    chatroute_logger.propagate = False
    return handler


def uvicorn_log_config(log_format: Literal["text", "json"]) -> dict[str, Any] | None:
    """uvicorn's `log_config` for the format: None (uvicorn's own) for text, its loggers
    as JSON lines for json."""
    if log_format != "json":
        return None
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {"default": handler},
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
            "uvicorn.access": {"handlers": ["default"], "level": "INFO", "propagate": False},
        },
    }
