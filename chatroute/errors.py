"""Typed provider errors, their failure kinds, and the classification table the failover uses."""

from __future__ import annotations

import asyncio
import email.utils
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "FAILURE_POLICIES",
    "ContextLengthExceededError",
    "FailureKind",
    "FailurePolicy",
    "FirstTokenTimeoutError",
    "MalformedResponseError",
    "ProviderAuthError",
    "ProviderBadRequestError",
    "ProviderConnectionError",
    "ProviderError",
    "ProviderServerError",
    "ProviderStatusError",
    "ProviderTimeoutError",
    "RateLimitedError",
    "StreamInterruptedError",
    "StreamStallTimeoutError",
    "TruncatedStreamError",
    "UpstreamStreamError",
    "classify_failure",
    "error_fields",
    "is_cancelling",
    "kind_for_status",
    "parse_retry_after",
    "redact",
    "status_error",
]


class FailureKind(StrEnum):
    """What went wrong with an attempt, as the failover policy needs to know it.

    `policy` tells what to do about it (see `FAILURE_POLICIES`).
    """

    CONNECT = "connect"
    """Connect error, or the connection reset/closed before any response header."""
    SERVER_ERROR = "server_error"
    """HTTP 5xx or 408."""
    RATE_LIMITED = "rate_limited"
    """HTTP 429; `ProviderError.retry_after` carries the upstream's hint when it sent one."""
    AUTH = "auth"
    """HTTP 401 / 403 / 404: bad key or unknown model; the provider is unhealthy."""
    CONTEXT_LENGTH = "context_length"
    """HTTP 400 (or 413) saying the prompt exceeds the model's context window."""
    CLIENT_ERROR = "client_error"
    """Any other 4xx (bad request, content policy): the caller's problem, returned as is."""
    TIMEOUT = "timeout"
    """A transport timeout or the per-attempt time limit."""
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    """No content-bearing event within the first-token timeout."""
    STALL_TIMEOUT = "stall_timeout"
    """A started stream stopped sending for longer than the inter-chunk stall timeout."""
    STREAM_INTERRUPTED = "stream_interrupted"
    """The connection broke mid-body, or the stream ended without a finish reason."""
    MALFORMED = "malformed"
    """A response body or stream chunk that is not valid OpenAI JSON."""
    STREAM_ERROR = "stream_error"
    """The upstream sent an in-band error event inside a 200 stream."""
    CANCELLED = "cancelled"
    """The caller cancelled or went away; never the provider's fault."""
    UNKNOWN = "unknown"
    """Anything else."""

    @property
    def policy(self) -> FailurePolicy:
        """The row of the error-class table for this kind."""
        return FAILURE_POLICIES[self]


@dataclass(frozen=True)
class FailurePolicy:
    """One row of the error-class table: what the failover does about a failure kind.

    - `fail_over`: another provider may be tried (before output is committed).
    - `retry_same_provider`: the same provider may be tried again in this request.
    - `counts_against_health`: the failure feeds the provider's circuit breaker.
    - `mark_unhealthy`: the provider should be treated as down at once.
    - `return_to_caller`: the error is the answer; no failover.
    - `needs_larger_context`: fail over only to a provider with a larger context window.
    - `honour_retry_after`: wait for Retry-After when it fits the remaining budget.
    """

    fail_over: bool
    retry_same_provider: bool
    counts_against_health: bool
    mark_unhealthy: bool = False
    return_to_caller: bool = False
    needs_larger_context: bool = False
    honour_retry_after: bool = False


FAILURE_POLICIES: Mapping[FailureKind, FailurePolicy] = {
    FailureKind.CONNECT: FailurePolicy(True, True, True),
    FailureKind.SERVER_ERROR: FailurePolicy(True, True, True),
    FailureKind.RATE_LIMITED: FailurePolicy(True, True, True, honour_retry_after=True),
    FailureKind.AUTH: FailurePolicy(True, False, True, mark_unhealthy=True),
    FailureKind.CONTEXT_LENGTH: FailurePolicy(
        True, False, False, return_to_caller=True, needs_larger_context=True
    ),
    FailureKind.CLIENT_ERROR: FailurePolicy(False, False, False, return_to_caller=True),
    FailureKind.TIMEOUT: FailurePolicy(True, True, True),
    FailureKind.FIRST_TOKEN_TIMEOUT: FailurePolicy(True, False, True),
    FailureKind.STALL_TIMEOUT: FailurePolicy(True, False, True),
    FailureKind.STREAM_INTERRUPTED: FailurePolicy(True, True, True),
    FailureKind.MALFORMED: FailurePolicy(True, True, True),
    FailureKind.STREAM_ERROR: FailurePolicy(True, True, True),
    FailureKind.CANCELLED: FailurePolicy(False, False, False),
    FailureKind.UNKNOWN: FailurePolicy(True, True, True),
}

_KEY_PATTERN = re.compile(r"\b(sk|pk|rk|key|api|gsk|xai)[-_][A-Za-z0-9_\-]{6,}")
_CONTEXT_CODES = frozenset(
    {"context_length_exceeded", "context_window_exceeded", "string_above_max_length"}
)
_CONTEXT_PATTERN = re.compile(
    r"maximum context length|context[ _]length|context window|prompt is too long|"
    r"too many (input )?tokens|reduce the length of the (messages|prompt|input)",
    re.IGNORECASE,
)


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """`text` with the given secrets and anything shaped like an API key masked."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return _KEY_PATTERN.sub(lambda m: m.group(1) + "-***", text)


class ProviderError(RuntimeError):
    """A failed provider call, with what the upstream said and how to handle it.

    Attributes: `provider` (the client's name), `kind` (a `FailureKind`), `status_code`,
    `error_type` / `error_code` / `error_message` (the OpenAI error body's fields),
    `retry_after` (seconds, from Retry-After or retry-after-ms), `request_id` (the upstream's
    x-request-id) and `after_output` (whether the client had already yielded output). The
    original exception, if any, is the `__cause__`. Messages never contain API keys.
    """

    default_kind: FailureKind = FailureKind.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        provider: str | None = None,
        kind: FailureKind | None = None,
        status_code: int | None = None,
        error_type: str | None = None,
        error_code: str | None = None,
        error_message: str | None = None,
        retry_after: float | None = None,
        request_id: str | None = None,
        after_output: bool = False,
    ) -> None:
        prefix = f"provider {provider!r}: " if provider else ""
        super().__init__(prefix + redact(message))
        self.provider = provider
        self.kind: FailureKind = kind if kind is not None else self.default_kind
        self.status_code = status_code
        self.error_type = error_type
        self.error_code = error_code
        self.error_message = redact(error_message) if error_message is not None else None
        self.retry_after = retry_after
        self.request_id = request_id
        self.after_output = after_output

    @property
    def policy(self) -> FailurePolicy:
        """The error-class row for this error's kind."""
        return self.kind.policy

    def to_openai_error(self) -> dict[str, Any]:
        """The OpenAI error object (`{"message", "type", "param", "code"}`) for a caller."""
        return {
            "message": self.error_message or str(self),
            "type": self.error_type or _default_error_type(self.kind),
            "param": None,
            "code": self.error_code if self.error_code is not None else self.kind.value,
        }


def _default_error_type(kind: FailureKind) -> str:
    if kind in (FailureKind.CLIENT_ERROR, FailureKind.CONTEXT_LENGTH):
        return "invalid_request_error"
    if kind is FailureKind.RATE_LIMITED:
        return "rate_limit_error"
    if kind is FailureKind.AUTH:
        return "authentication_error"
    return "upstream_error"


class ProviderConnectionError(ProviderError):
    """Could not connect, or the connection failed before any response header."""

    default_kind = FailureKind.CONNECT


class ProviderStatusError(ProviderError):
    """The upstream answered with an HTTP error status."""

    default_kind = FailureKind.SERVER_ERROR


class ProviderServerError(ProviderStatusError):
    """HTTP 5xx or 408."""

    default_kind = FailureKind.SERVER_ERROR


class RateLimitedError(ProviderStatusError):
    """HTTP 429."""

    default_kind = FailureKind.RATE_LIMITED


class ProviderAuthError(ProviderStatusError):
    """HTTP 401 / 403 / 404: bad credentials or unknown model."""

    default_kind = FailureKind.AUTH


class ContextLengthExceededError(ProviderStatusError):
    """The prompt does not fit the model's context window."""

    default_kind = FailureKind.CONTEXT_LENGTH


class ProviderBadRequestError(ProviderStatusError):
    """Any other 4xx (bad request, content policy): to be returned to the caller as is."""

    default_kind = FailureKind.CLIENT_ERROR


class ProviderTimeoutError(ProviderError, TimeoutError):
    """A provider time limit ran out; a `TimeoutError`, so generic code treats it as one."""

    default_kind = FailureKind.TIMEOUT


class FirstTokenTimeoutError(ProviderTimeoutError):
    """No content-bearing event arrived within the first-token timeout."""

    default_kind = FailureKind.FIRST_TOKEN_TIMEOUT


class StreamStallTimeoutError(ProviderTimeoutError):
    """A started stream sent nothing for longer than the inter-chunk stall timeout."""

    default_kind = FailureKind.STALL_TIMEOUT


class StreamInterruptedError(ProviderError):
    """The response broke off: the connection was cut or failed mid-body."""

    default_kind = FailureKind.STREAM_INTERRUPTED


class TruncatedStreamError(StreamInterruptedError):
    """The stream ended cleanly but without a finish reason: the answer is incomplete."""


class MalformedResponseError(ProviderError):
    """The upstream sent a body or chunk that is not valid OpenAI JSON."""

    default_kind = FailureKind.MALFORMED


class UpstreamStreamError(ProviderError):
    """The upstream sent an in-band error event inside a 200 stream."""

    default_kind = FailureKind.STREAM_ERROR


# ---------------------------------------------------------------------------- retry-after


def parse_retry_after(
    headers: Mapping[str, str] | None, *, now: float | None = None
) -> float | None:
    """Seconds to wait from `retry-after-ms` or `Retry-After` (seconds or an HTTP date).

    Returns None when neither header is present or parsable; never negative.
    """
    if not headers:
        return None
    lowered = {k.lower(): v for k, v in headers.items()}
    raw_ms = lowered.get("retry-after-ms")
    if raw_ms is not None:
        try:
            value = float(raw_ms) / 1000.0
            if value == value and value != float("inf"):
                return max(0.0, value)
        except ValueError:
            pass
    raw = lowered.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        value = float(raw)
        if value == value and value != float("inf"):
            return max(0.0, value)
        return None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    current = time.time() if now is None else now
    return max(0.0, when.timestamp() - current)


# ---------------------------------------------------------------------------- classification


def error_fields(body: object) -> tuple[str | None, str | None, str | None]:
    """(type, code, message) from an OpenAI error body (either the envelope or the object)."""
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        body = body["error"]
    if not isinstance(body, Mapping):
        return None, None, None

    def text(value: object) -> str | None:
        if value is None:
            return None
        return value if isinstance(value, str) else json.dumps(value)

    return text(body.get("type")), text(body.get("code")), text(body.get("message"))


def _is_context_length(code: str | None, message: str | None) -> bool:
    if code is not None and code in _CONTEXT_CODES:
        return True
    return message is not None and _CONTEXT_PATTERN.search(message) is not None


def kind_for_status(
    status: int, code: str | None = None, message: str | None = None
) -> FailureKind:
    """The failure kind of an HTTP error status (with the OpenAI error code and message)."""
    if status == 408 or status >= 500:
        return FailureKind.SERVER_ERROR
    if status == 429:
        return FailureKind.RATE_LIMITED
    if status in (401, 403, 404):
        return FailureKind.AUTH
    if status in (400, 413, 422) and _is_context_length(code, message):
        return FailureKind.CONTEXT_LENGTH
    if 400 <= status < 500:
        return FailureKind.CLIENT_ERROR
    return FailureKind.UNKNOWN


_STATUS_CLASSES: Mapping[FailureKind, type[ProviderStatusError]] = {
    FailureKind.SERVER_ERROR: ProviderServerError,
    FailureKind.RATE_LIMITED: RateLimitedError,
    FailureKind.AUTH: ProviderAuthError,
    FailureKind.CONTEXT_LENGTH: ContextLengthExceededError,
    FailureKind.CLIENT_ERROR: ProviderBadRequestError,
    FailureKind.UNKNOWN: ProviderStatusError,
}


def is_cancelling() -> bool:
    """Whether the current task is being cancelled: the caller's cancellation, as opposed to
    a time limit or a failure that surfaced as a `CancelledError`."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _type_names(exc: BaseException) -> frozenset[str]:
    return frozenset(cls.__name__ for cls in type(exc).__mro__)


# Exception types of HTTP libraries and SDKs, known by name so that this module imports
# none of them: httpx's and the openai / anthropic SDKs' timeouts and transport errors.
_TIMEOUT_NAMES = frozenset({"TimeoutException", "APITimeoutError"})
_TRANSPORT_NAMES = frozenset({"TransportError", "APIConnectionError", "ClientConnectionError"})


def classify_failure(exc: BaseException) -> FailureKind:
    """The `FailureKind` of any exception a chat client may raise.

    `ProviderError`s carry their kind; `asyncio.CancelledError` is `CANCELLED`; an
    exception with an integer `status_code` (an SDK's status error) is classified by
    `kind_for_status` with the error body's code and message; timeouts (`TimeoutError`,
    httpx's and the SDKs') are `TIMEOUT`, connection failures `CONNECT`, undecodable JSON
    `MALFORMED`; anything unrecognised is `UNKNOWN` (which fails over).
    """
    if isinstance(exc, ProviderError):
        return exc.kind
    if isinstance(exc, asyncio.CancelledError):
        return FailureKind.CANCELLED
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and not isinstance(status, bool):
        etype, code, message = error_fields(getattr(exc, "body", None))
        fallback = getattr(exc, "message", None)
        return kind_for_status(
            status, code or etype, message or (fallback if isinstance(fallback, str) else None)
        )
    names = _type_names(exc)
    if isinstance(exc, TimeoutError) or names & _TIMEOUT_NAMES:
        return FailureKind.TIMEOUT
    if isinstance(exc, ConnectionError) or names & _TRANSPORT_NAMES:
        return FailureKind.CONNECT
    if isinstance(exc, json.JSONDecodeError) or "APIResponseValidationError" in names:
        return FailureKind.MALFORMED
    if "APIError" in names:
        return FailureKind.STREAM_ERROR
    return FailureKind.UNKNOWN


def status_error(
    status: int,
    fields: tuple[str | None, str | None, str | None],
    fallback: str | None,
    headers: Mapping[str, str],
    *,
    label: str | None,
    request_id: str | None,
    secrets: tuple[str, ...] = (),
    **common: Any,
) -> ProviderStatusError:
    """The typed error of an HTTP error answer: `fields` are the error body's (type, code,
    message), `fallback` the text used when the body has none (the status reason), `label`
    what the message names the error by. Classified by `kind_for_status`; Retry-After
    honoured."""
    etype, code, message = fields
    kind = kind_for_status(status, code or etype, message or fallback)
    text = redact(message or fallback or "", secrets)
    detail = f"HTTP {status}" + (f" ({label})" if label else "") + (f": {text}" if text else "")
    return _STATUS_CLASSES[kind](
        detail,
        kind=kind,
        status_code=status,
        error_type=etype,
        error_code=code,
        error_message=redact(message, secrets) if message is not None else None,
        retry_after=parse_retry_after(headers),
        request_id=request_id,
        **common,
    )
