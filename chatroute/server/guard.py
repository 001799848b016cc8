"""ASGI middleware: bearer keys on /v1/* and a cap on body size, checked before the app runs."""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatroute.server.errors import APIError

__all__ = ["RequestGuard", "send_error"]


async def send_error(send: Send, error: APIError) -> None:
    """Answer an APIError directly over ASGI."""
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _BodyTooLarge(Exception):
    pass


class RequestGuard:
    """Rejects `/v1/*` calls without a valid `Authorization: Bearer` key (when keys are set),
    and bodies over `max_body_bytes` (413), before any parsing happens.

    The body is read here, bounded, and replayed to the app; later `receive` calls (the
    disconnect message) go to the server as usual.
    """

    def __init__(self, app: ASGIApp, *, api_keys: Sequence[str], max_body_bytes: int) -> None:
        self.app = app
        self._keys = [key.encode() for key in api_keys if key]
        self.max_body_bytes = max_body_bytes

    def _authorised(self, scope: Scope) -> bool:
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if path.startswith("/v1/") and not self._authorised(scope):
            await send_error(
                send,
                APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                ),
            )
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
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
            return
        if body is None:  # the client left before sending the whole body
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

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
