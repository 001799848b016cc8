"""OpenAI-shaped error bodies, and the mapping from failures to HTTP statuses."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from chatroute.embedder.errors import EmbedderOverloadedError
from chatroute.errors import FailureKind, ProviderError, kind_for_status
from chatroute.failover.timeouts import DeadlineExceededError

__all__ = [
    "APIError",
    "Redactor",
    "error_from_exception",
]


class APIError(Exception):
    """An error answered to the caller: an HTTP status and an OpenAI-style error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def error_object(self) -> dict[str, Any]:
        """The inner `{"message", "type", "param", "code"}` object."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def body(self) -> dict[str, Any]:
        """The whole response body: `{"error": {...}}`."""
        return {"error": self.error_object()}

    def sse_event(self) -> bytes:
        """The in-band SSE event that ends a stream which failed after output."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


class Redactor:
    """Replaces known secret values (API keys) in text with `***`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def add(self, secret: str | None) -> None:
        """Remember one more secret value."""
        if secret and len(secret) >= 4 and secret not in self._secrets:
            self._secrets.append(secret)
            self._secrets.sort(key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, "***")
        return text


_KIND_STATUS: dict[FailureKind, int] = {
    FailureKind.CONNECT: 502,
    FailureKind.SERVER_ERROR: 502,
    FailureKind.RATE_LIMITED: 429,
    FailureKind.AUTH: 502,
    FailureKind.CONTEXT_LENGTH: 400,
    FailureKind.CLIENT_ERROR: 400,
    FailureKind.TIMEOUT: 504,
    FailureKind.FIRST_TOKEN_TIMEOUT: 504,
    FailureKind.STALL_TIMEOUT: 504,
    FailureKind.STREAM_INTERRUPTED: 502,
    FailureKind.MALFORMED: 502,
    FailureKind.STREAM_ERROR: 502,
    FailureKind.CANCELLED: 502,
    FailureKind.UNKNOWN: 502,
}


def _caller_status(kind: FailureKind, upstream_status: int | None) -> int:
    """The status our caller gets for a provider failure (upstream 4xx pass through)."""
    if kind is FailureKind.SERVER_ERROR and upstream_status in (503, 504):
        return upstream_status
    if kind is FailureKind.SERVER_ERROR and upstream_status == 408:
        return 504
    if kind in (FailureKind.CLIENT_ERROR, FailureKind.CONTEXT_LENGTH) and upstream_status:
        return upstream_status if 400 <= upstream_status < 500 else 400
    return _KIND_STATUS.get(kind, 502)


def _retry_after(seconds: float | None) -> dict[str, str]:
    if seconds is None or seconds <= 0 or seconds != seconds:
        return {}
    return {"retry-after": str(max(1, math.ceil(seconds)))}


def _from_provider_error(exc: ProviderError, clean: Redactor) -> APIError:
    upstream = exc.to_openai_error()
    status = _caller_status(exc.kind, exc.status_code)
    if exc.kind in (FailureKind.CLIENT_ERROR, FailureKind.CONTEXT_LENGTH):
        # The caller's own mistake, as the provider described it.
        return APIError(
            status,
            clean(str(upstream["message"])),
            type=str(upstream["type"]),
            code=upstream["code"],
        )
    message = str(upstream["message"])
    if exc.provider and exc.status_code is not None and exc.kind is not FailureKind.RATE_LIMITED:
        message = f"provider {exc.provider!r} answered HTTP {exc.status_code}: {message}"
    elif exc.provider and exc.status_code is None and not message.startswith("provider "):
        message = f"provider {exc.provider!r}: {message}"
    headers = _retry_after(exc.retry_after) if status in (429, 503) else {}
    err_type = "rate_limit_error" if status == 429 else "upstream_error"
    return APIError(status, clean(message), type=err_type, code=upstream["code"], headers=headers)


def error_from_exception(exc: BaseException, redact: Redactor | None = None) -> APIError:
    """The APIError to answer for a failure that ended a request.

    Provider errors map by their failure kind: 429 when rate limited, 502 for connection
    failures, upstream 5xx, rejected credentials and broken streams, 503/504 passed on,
    504 for timeouts, and the upstream's own 4xx for the caller's bad requests. A request
    deadline that ran out between attempts is 504 `deadline_exceeded`. An overloaded
    embedder answers 503 with Retry-After.
    """
    clean = redact or Redactor()
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, DeadlineExceededError):
        # The deadline ran out between attempts: say so, and how the last attempt failed.
        message = str(exc)
        cause = exc.__cause__
        if cause is not None:
            message += f"; the last attempt failed: {error_from_exception(cause, clean).message}"
        return APIError(504, clean(message), type="timeout_error", code="deadline_exceeded")
    if isinstance(exc, ProviderError):
        return _from_provider_error(exc, clean)
    if isinstance(exc, EmbedderOverloadedError):
        return APIError(
            503,
            "the router is overloaded, retry shortly",
            type="overloaded_error",
            code="overloaded",
            headers={"retry-after": "1"},
        )
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and 400 <= status <= 599:
        upstream = _upstream_error_object(exc)
        message = upstream.get("message") or str(exc) or f"upstream answered {status}"
        kind = kind_for_status(status, upstream.get("code"), message)
        out = _caller_status(kind, status)
        code = upstream.get("code")
        return APIError(
            out,
            clean(str(message)),
            type="rate_limit_error" if out == 429 else "upstream_error",
            code=code if isinstance(code, str) else None,
        )
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return APIError(
            504, "the upstream provider timed out", type="upstream_error", code="upstream_timeout"
        )
    if isinstance(exc, ConnectionError | httpx.TransportError):
        return APIError(
            502,
            "could not reach the upstream provider",
            type="upstream_error",
            code="upstream_unreachable",
        )
    return APIError(
        502,
        f"the upstream provider failed ({type(exc).__name__})",
        type="upstream_error",
        code="upstream_error",
    )


def _upstream_error_object(exc: BaseException) -> dict[str, Any]:
    """The OpenAI-shaped error an exception carries, as a dict (empty when it has none)."""
    for attribute in ("error", "body"):
        value = getattr(exc, attribute, None)
        if isinstance(value, Mapping):
            inner = value.get("error", value)
            if isinstance(inner, Mapping):
                return dict(inner)
    return {}
