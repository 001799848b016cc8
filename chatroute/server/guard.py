"""Admission checks (bearer keys, body size and time, JSON sanity) and their ASGI middleware."""

from __future__ import annotations

import hmac
import json
import math
import re
from collections.abc import Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatroute._json import UNKNOWN, loads_counted
from chatroute._timer import timeout
from chatroute.server.errors import APIError
from chatroute.server.protocol import connection_of

__all__ = [
    "Admission",
    "Admitted",
    "NotJSON",
    "RequestGuard",
    "parse_json",
    "parse_json_stdlib",
    "send_error",
]


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


class _ConstantRefused(ValueError):
    pass


_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_constant(name: str) -> Any:
    raise _ConstantRefused(f"the body contains {name}, which is not valid JSON")


class NotJSON:
    """What `parse_json` returns for a body that is not JSON at all (`error` says why: a
    `json.JSONDecodeError`, or the `ValueError` of a number too long to convert)."""

    __slots__ = ("error",)

    def __init__(self, error: ValueError) -> None:
        self.error = error


def parse_json(body: bytes, max_depth: int) -> tuple[Any, APIError | None]:
    """The parsed body (a `NotJSON` when it is not JSON at all, which the endpoint explains
    in its own terms) and the error for a JSON body the app must not see, or None.

    Refused: bytes that are not UTF-8, `NaN` / `Infinity` (and numbers too large for a
    float, which would become one), nesting deeper than `max_depth` arrays and objects,
    and strings holding unpaired UTF-16 surrogates (`"\\ud800"`), which cannot be
    encoded to send upstream.

    Most bodies are parsed by orjson (`loads_counted`), which gives the stdlib's value and
    refuses all of the above but the nesting; the stdlib parses the rest, as it always did,
    for its own value or error.
    """
    data, openers = loads_counted(body)
    if data is not UNKNOWN:
        # Nesting cannot exceed the count of `[` and `{` bytes (most bodies need no walk);
        # there is no NaN, overflowed float or unpaired surrogate to look for.
        if openers > max_depth:
            problem = _first_problem(data, max_depth, strings=False, floats=False)
            if problem is not None:
                return None, problem
        return data, None
    return parse_json_stdlib(body, max_depth, openers)


def parse_json_stdlib(
    body: bytes, max_depth: int, openers: int | None = None
) -> tuple[Any, APIError | None]:
    """`parse_json` on the standard library alone: the answer the orjson path must give.

    `openers` is the count of `[` and `{` bytes in `body` when the caller has it.
    """
    if openers is None:
        openers = body.count(b"[") + body.count(b"{")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, APIError(
            400, f"the body is not valid UTF-8 (at byte {exc.start})", code="invalid_encoding"
        )
    overflowed = False

    def parse_float(literal: str) -> float:
        nonlocal overflowed
        value = float(literal)
        if math.isinf(value):
            overflowed = True
        return value

    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=parse_float)
    except _ConstantRefused as exc:
        return None, APIError(400, str(exc), code="invalid_json")
    except RecursionError:
        return None, _too_deep(max_depth)
    except ValueError as exc:
        return NotJSON(exc), None
    # Cheap bounds first: an unpaired surrogate can only come from a `\u` escape (UTF-8
    # cannot encode one), and nesting cannot exceed the count of `[` and `{` bytes. Most
    # bodies need no walk at all.
    strings = b"\\u" in body
    deep = openers > max_depth
    if strings or deep or overflowed:
        problem = _first_problem(data, max_depth, strings=strings, floats=overflowed)
        if problem is not None:
            return None, problem
    return data, None


def _first_problem(data: Any, max_depth: int, *, strings: bool, floats: bool) -> APIError | None:
    """The first problem a depth-first walk of `data` meets; strings and floats are
    checked only when asked (skipping leaves keeps the order the others are met in)."""
    leaves: tuple[type, ...] = ()
    if strings:
        leaves += (str,)
    if floats:
        leaves += (float,)
    kinds = (dict, list, *leaves)
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > max_depth:
                return _too_deep(max_depth)
            for key, item in value.items():
                if strings and _SURROGATE.search(key):
                    return _bad_surrogate()
                if isinstance(item, kinds):
                    stack.append((item, depth + 1))
        elif isinstance(value, list):
            if depth > max_depth:
                return _too_deep(max_depth)
            stack.extend((item, depth + 1) for item in value if isinstance(item, kinds))
        elif isinstance(value, str):
            if _SURROGATE.search(value):
                return _bad_surrogate()
        elif isinstance(value, float) and not math.isfinite(value):
            return APIError(
                400, "the body contains a number too large for JSON", code="invalid_json"
            )
    return None


def _too_deep(max_depth: int) -> APIError:
    return APIError(400, f"the JSON body nests deeper than {max_depth} levels", code="invalid_body")


def _bad_surrogate() -> APIError:
    return APIError(
        400, "the body contains an unpaired UTF-16 surrogate escape", code="invalid_encoding"
    )


class Admitted:
    """A request the admission checks let through: its whole body, and that body parsed
    (a `NotJSON` when it is not JSON; None when there is no body or it is not a `/v1` call)."""

    __slots__ = ("body", "data")

    def __init__(self, body: bytes, data: Any) -> None:
        self.body = body
        self.data = data


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

    async def admit_body(self, scope: Scope, receive: Receive, send: Send) -> Admitted | None:
        """Read the body within the limits and check it; None when the request has been
        answered here (413, 408, 400) or the caller left before sending all of it."""
        try:
            connection = connection_of(scope)
            if connection is not None and connection.body_received():
                body = await self._read_body(scope, receive)  # in hand: nothing to wait for
            else:
                async with timeout(self.body_timeout):
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
        data: Any = None
        if body and scope.get("path", "").startswith("/v1/"):
            data, problem = parse_json(body, self.max_json_depth)
            if problem is not None:
                await send_error(send, problem)
                return None
        return Admitted(body, data)

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
        admitted = await self.admission.admit_body(scope, receive, send)
        if admitted is None:
            return
        body = admitted.body
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
