"""Admission checks (bearer keys, body size and time, JSON sanity) and their ASGI middleware."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Sequence
from typing import Any, Final

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatroute.server.errors import APIError

__all__ = ["PARSED_BODY", "Admission", "RequestGuard", "is_json", "parse_json", "send_error"]

PARSED_BODY: Final = "chatroute.json"
"""The scope key under which the guard leaves a `/v1` JSON body it parsed (read it once)."""


async def send_error(send: Send, error: APIError) -> None:
    """Answer an APIError directly over ASGI."""
    body = orjson.dumps(error.body())
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _BodyTooLarge(Exception):
    pass


def is_json(scope: Scope) -> bool:
    """Whether the request says its body is JSON (`application/json` or `application/*+json`),
    as FastAPI decides it; no content type is not JSON (FastAPI's strict default)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media: bytes = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or (
                media.startswith(b"application/") and media.endswith(b"+json")
            )
    return False


_CONSTANTS = (b"NaN", b"-Infinity", b"Infinity")


def parse_json(body: bytes, max_depth: int) -> Any:
    """The parsed body; an APIError (400) for a body that is not JSON, or is JSON the
    service must not take: bytes that are not UTF-8, unpaired UTF-16 surrogates
    (`"\\ud800"`: they cannot be encoded to send upstream), `NaN` / `Infinity`, numbers
    too large for a float, and nesting deeper than `max_depth` arrays and objects.

    orjson refuses all of those but the nesting (its own limit is 1024 levels); the
    message names what it refused and where.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _refused(body, exc) from None
    # Nesting cannot exceed the count of `[` and `{` bytes: most bodies need no walk.
    if body.count(b"[") + body.count(b"{") > max_depth and _depth_over(data, max_depth):
        raise _too_deep(max_depth)
    return data


def _refused(body: bytes, exc: orjson.JSONDecodeError) -> APIError:
    reason = exc.msg
    if "UTF-8" in reason:
        return APIError(400, "the body is not valid UTF-8", code="invalid_encoding")
    if "surrogate" in reason:
        return APIError(
            400, "the body contains an unpaired UTF-16 surrogate escape", code="invalid_encoding"
        )
    if "depth limit" in reason:
        return _too_deep(1024)
    if "infinity" in reason:
        return APIError(400, "the body contains a number too large for JSON", code="invalid_json")
    for constant in _CONSTANTS:  # where orjson stopped, or just after the sign
        if body.startswith(constant, exc.pos) or body.startswith(constant, exc.pos - 1):
            text = constant.decode()
            return APIError(
                400, f"the body contains {text}, which is not valid JSON", code="invalid_json"
            )
    return APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json")


def _depth_over(data: Any, max_depth: int) -> bool:
    stack: list[tuple[Any, int]] = [(data, 1)] if isinstance(data, dict | list) else []
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            return True
        items = value.values() if isinstance(value, dict) else value
        stack.extend((item, depth + 1) for item in items if isinstance(item, dict | list))
    return False


def _too_deep(max_depth: int) -> APIError:
    return APIError(400, f"the JSON body nests deeper than {max_depth} levels", code="invalid_body")


class Admission:
    """The checks every request passes before the app parses it.

    - `/v1/*` calls need a valid `Authorization: Bearer` key (when keys are set): 401.
    - Bodies over `max_body_bytes` are refused (413), and so are bodies that do not arrive
      within `body_timeout` seconds (408: slow senders cannot hold a worker).
    - JSON bodies on `/v1/*` must be UTF-8, nest at most `max_json_depth` levels and carry
      no `NaN`, `Infinity` or unpaired surrogates (400, see `parse_json`).
    """

    def __init__(
        self,
        *,
        api_keys: Sequence[str],
        max_body_bytes: int,
        max_json_depth: int = 64,
        body_timeout: float | None = 30.0,
    ) -> None:
        self._keys = [key.encode() for key in api_keys if key]
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth
        self.body_timeout = body_timeout

    def authorised(self, scope: Scope) -> bool:
        """Whether the request carries one of the keys (always, when there are none)."""
        if not self._keys:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() != b"bearer":
                    return False
                token = token.strip()
                # Compare against every key, so timing does not tell which one nearly matched.
                matched = False
                for key in self._keys:
                    matched |= hmac.compare_digest(token, key)
                return matched
        return False

    async def refuse_unauthorised(self, scope: Scope, send: Send) -> bool:
        """Answer 401 to a `/v1/*` call without a valid key; whether it did."""
        if not scope.get("path", "").startswith("/v1/") or self.authorised(scope):
            return False
        await send_error(
            send,
            APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            ),
        )
        return True

    async def admit_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """Read the body within the limits and check it; None when the request has been
        answered here (413, 408, 400) or the caller left before sending all of it.

        A `/v1` JSON body is parsed here, once, and left in the scope (`PARSED_BODY`).
        """
        try:
            async with asyncio.timeout(self.body_timeout):
                body = await self._read_body(scope, receive)
        except _BodyTooLarge:
            await send_error(
                send,
                APIError(
                    413,
                    f"the request body exceeds the limit of {self.max_body_bytes} bytes",
                    code="request_too_large",
                ),
            )
            return None
        except TimeoutError:
            await send_error(
                send,
                APIError(
                    408,
                    f"the request body did not arrive within {self.body_timeout:g} s",
                    code="request_timeout",
                    headers={"connection": "close"},
                ),
            )
            return None
        if body is None:  # the client left before sending the whole body
            return None
        if body and scope.get("path", "").startswith("/v1/") and is_json(scope):
            try:
                scope[PARSED_BODY] = parse_json(body, self.max_json_depth)
            except APIError as problem:
                await send_error(send, problem)
                return None
        return body

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    raise _BodyTooLarge
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise _BodyTooLarge
                parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


class RequestGuard:
    """ASGI middleware applying an `Admission` to every request.

    The body is read there, bounded, and replayed to the app; later `receive` calls (the
    disconnect message) go to the server as usual.
    """

    def __init__(self, app: ASGIApp, *, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if await self.admission.refuse_unauthorised(scope, send):
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        body = await self.admission.admit_body(scope, receive, send)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
