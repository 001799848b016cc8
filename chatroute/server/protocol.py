"""The service's HTTP/1.1 server protocol: a lean ASGI connection on httptools, run by uvicorn.

uvicorn stays the server (sockets, signals, lifespan, graceful shutdown, the date
header); this is the per-connection protocol it runs when given as its `http` setting
(`uvicorn.run(app, http=HttpProtocol)`, as `chatroute serve` does). It parses with
httptools, the C parser uvicorn's own protocol uses, and speaks ASGI 3 (HTTP spec 2.3) to
the app, but does per request only what a request needs: one scope, one small object
holding the request's state, one task. On the development machine, against the last
revision served on uvicorn's own httptools protocol, the service on it (with the changes
made since) added 0.03-0.13 ms less latency per proxied call and used 0.1 ms less CPU per
call, 0.2-0.3 ms per stream (`bench/proxy_compare.py`, two runs; see BENCHMARKS.md).

What it does on top:

- A response head leaves in the same write as the first bytes of its body, so the
  caller wakes once, not twice, and a small answer is one TCP segment. A head whose body
  does not follow at once is written on the event loop's next turn, so nothing waits
  longer than that. `100 Continue` is never held.
- The request's scope names its connection (`connection_of(scope)`): the app can ask to
  be called back when the connection is lost (`watch_disconnect`) and whether the whole
  body has arrived (`body_received`), without a task parked on `receive()`.
- The keep-alive timeout armed after each answer is one of the loop's shared timers
  (`chatroute._timer`).

HTTP/1.1 as a server owes it: keep-alive and `Connection: close`, HTTP/1.0, pipelined
requests answered in order, chunked request bodies, `Expect: 100-continue`, `HEAD`,
chunked answers when the app sets no length, a length the app set and then broke closes
the connection, read back-pressure for large bodies and write back-pressure for slow
readers, a 400 for unparsable requests, a 431 for a request head over 64 KiB (httptools
itself sets no limit), uvicorn's `limit_concurrency` (503), access
logs when uvicorn's access logger has handlers, and a graceful `shutdown()`. Upgrades
(websockets) are not served: the request is answered as plain HTTP.
"""

from __future__ import annotations

import asyncio
import contextvars
import http
import logging
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, cast
from urllib.parse import unquote

import httptools
from uvicorn.config import Config
from uvicorn.protocols.utils import (
    get_client_addr,
    get_local_addr,
    get_path_with_query_string,
    get_remote_addr,
    is_ssl,
)
from uvicorn.server import ServerState

from chatroute._timer import TimerHandle, TimerQueue, timer_queue

__all__ = ["CONNECTION_EXTENSION", "HttpProtocol", "connection_of"]

CONNECTION_EXTENSION: Final = "chatroute.connection"
"""The scope extension naming the `HttpProtocol` a request arrived on."""

# Request body bytes buffered for an app that has not read them before the socket stops
# being read (uvicorn's figure).
_HIGH_WATER: Final = 65536
# Characters a header name or value must not carry (a name is an RFC 9110 token; a
# value has no control characters but tab): anything else could split the head.
_BAD_NAME: Final = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE: Final = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
# The most a request's target and headers may take (httptools sets no limit): a caller
# that sends more gets a 431 and the connection closed, instead of growing memory.
MAX_HEAD_BYTES: Final = 64 * 1024


class _HeadTooLarge(Exception):
    """Raised from a parser callback when the request head passes MAX_HEAD_BYTES."""


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES: Final = {status: _status_line(status) for status in range(100, 600)}


class _Exchange:
    """One request and its answer: the ASGI `receive` and `send` of one app call."""

    __slots__ = (
        "_flush",
        "_head",
        "_waiter",
        "body",
        "chunked",
        "continue_pending",
        "disconnected",
        "head_only",
        "keep_alive",
        "more_body",
        "protocol",
        "remaining",
        "request_done",
        "response_complete",
        "response_started",
        "scope",
    )

    def __init__(
        self, protocol: HttpProtocol, scope: dict[str, Any], keep_alive: bool, expect: bool
    ) -> None:
        self.protocol = protocol
        self.scope = scope
        self.keep_alive = keep_alive
        self.continue_pending = expect
        self.head_only = scope["method"] == "HEAD"
        # The request: body bytes not yet handed to the app, and whether more will come.
        self.body = b""
        self.more_body = True
        self.request_done = False  # the last http.request message was handed over
        self._waiter: asyncio.Future[None] | None = None
        self.disconnected = False
        # The answer.
        self.response_started = False
        self.response_complete = False
        self.chunked = False
        self.remaining = 0  # body bytes still owed under a Content-Length
        self._head: bytes | None = None  # a head held for the body's first bytes
        self._flush: asyncio.Handle | None = None

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def run(self, app: Callable[..., Any]) -> None:
        """Call the app, and make sure the caller gets an answer or a closed connection."""
        protocol = self.protocol
        try:
            result = await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            protocol.logger.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self._send_500()
            else:
                self._abandon()
        else:
            if result is not None:
                protocol.logger.error("ASGI callable should return None, but returned %r.", result)
                self._abandon()
            elif not self.response_started and not self.disconnected:
                protocol.logger.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                protocol.logger.error("ASGI callable returned without completing response.")
                self._abandon()

    def _abandon(self) -> None:
        """An answer that cannot be finished: the connection is closed under it."""
        self._drop_head()
        self.keep_alive = False
        self.protocol.transport.close()

    async def _send_500(self) -> None:
        await _plain_answer(self.send, 500, b"Internal Server Error")

    async def receive(self) -> dict[str, Any]:
        protocol = self.protocol
        if self.continue_pending:
            self.continue_pending = False
            if not protocol.transport.is_closing():
                protocol.transport.write(_CONTINUE)
        while True:
            if self.disconnected or self.response_complete:
                return {"type": "http.disconnect"}
            if self.body or (not self.more_body and not self.request_done):
                body, self.body = self.body, b""
                more = self.more_body
                if not more:
                    self.request_done = True
                elif protocol.read_paused:
                    protocol.resume_reading_now()
                return {"type": "http.request", "body": body, "more_body": more}
            # Nothing to hand over yet: wait for body bytes, the body's end, a disconnect or
            # the end of the answer (after the whole body, receive() waits for those two).
            if protocol.read_paused:
                protocol.resume_reading_now()
            waiter = self._waiter = protocol.loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    async def send(self, message: Mapping[str, Any]) -> None:
        protocol = self.protocol
        if protocol.write_paused and not self.disconnected:
            await protocol.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.start', but got {kind!r}."
                )
            status = message["status"]
            if self.continue_pending and self.more_body:
                # Answered without asking for the body the caller holds back: the body
                # may never come, so the connection cannot carry another request.
                self.keep_alive = False
            self._head = self._encode_head(status, message.get("headers", ()))  # may refuse
            self.response_started = True
            self.continue_pending = False
            self._flush = protocol.loop.call_soon(self.flush_head)
            if protocol.access_log:
                protocol.access_logger.info(
                    '%s - "%s %s HTTP/%s" %d',
                    get_client_addr(self.scope),  # type: ignore[arg-type]
                    self.scope["method"],
                    get_path_with_query_string(self.scope),  # type: ignore[arg-type]
                    self.scope["http_version"],
                    status,
                )
            return
        if self.response_complete:
            raise RuntimeError(
                f"Unexpected ASGI message {kind!r} sent, after response already completed."
            )
        if kind != "http.response.body":
            raise RuntimeError(f"expected 'http.response.body', got {kind!r}")
        body = message.get("body", b"")
        more_body = message.get("more_body", False)
        if self.head_only:
            data = b""
        elif self.chunked:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more_body:
                data += b"0\r\n\r\n"
        else:
            if len(body) > self.remaining:
                raise RuntimeError("Response content longer than Content-Length")
            self.remaining -= len(body)
            data = body
        head = self._head
        if head is not None:
            self._drop_head()
            data = head + data
        if data and not protocol.transport.is_closing():  # closed under a 400: dropped
            protocol.transport.write(data)
        if more_body:
            return
        if self.remaining and not self.head_only:
            raise RuntimeError("Response content shorter than Content-Length")
        self.response_complete = True
        self.wake()
        if not self.keep_alive:
            protocol.transport.close()
        protocol.on_response_complete(self)

    def _encode_head(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
        parts = [_STATUS_LINES.get(status) or _status_line(status)]
        length: int | None = None
        chunked = False
        closing = False
        pairs = (*self.protocol.server_state.default_headers, *headers)
        # One search over all the names and one over all the values: a character that is
        # not allowed shows in the concatenation exactly when it is in one of them.
        if _BAD_NAME.search(b"".join([name for name, _ in pairs])):
            raise RuntimeError("Invalid HTTP header name.")
        if _BAD_VALUE.search(b"".join([value for _, value in pairs])):
            raise RuntimeError("Invalid HTTP header value.")
        for name, value in pairs:
            name = name.lower()
            if name == b"content-length" and length is None and not chunked:
                length = int(value)
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                chunked, length = True, None
            elif name == b"connection" and b"close" in [
                token.strip().lower() for token in value.split(b",")
            ]:
                closing = True
                self.keep_alive = False
            parts += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not closing:
            parts.append(b"connection: close\r\n")
        if length is None and not chunked:
            if self.head_only or status in (204, 304) or status < 200:
                length = 0  # no body allowed
            else:
                chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
        parts.append(b"\r\n")
        self.chunked = chunked
        self.remaining = length or 0
        return b"".join(parts)

    def flush_head(self) -> None:
        """Write a held head now (the loop does this on its next turn anyway); a head held
        when the connection was lost is dropped with it."""
        head = self._head
        if head is not None:
            self._drop_head()
            if not self.protocol.transport.is_closing():
                self.protocol.transport.write(head)

    def _drop_head(self) -> None:
        self._head = None
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None


class HttpProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection, for uvicorn's `http` setting; `chatroute serve` uses it.

    Its constructor is the one uvicorn calls for a protocol class.
    """

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.config = config
        self.app: Callable[..., Any] = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.logger = logging.getLogger("uvicorn.error")
        self.access_logger = logging.getLogger("uvicorn.access")
        self.access_log = self.access_logger.hasHandlers()
        self.parser = httptools.HttpRequestParser(self)
        # Answer a request even when a pipelined one after it is malformed.
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.root_path = config.root_path
        self._raw_root_path = config.root_path.encode("ascii")
        self.limit_concurrency = config.limit_concurrency
        self.timeout_keep_alive = config.timeout_keep_alive
        self._fresh_context = bool(getattr(config, "reset_contextvars", False))
        self.app_state = app_state
        self.server_state = server_state
        self.connections = server_state.connections
        self.tasks = server_state.tasks
        self._timers: TimerQueue = timer_queue(self.loop)

        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.server: tuple[str, int | None] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.read_paused = False
        self.write_paused = False
        self._drained: list[asyncio.Future[None]] = []
        self._keep_alive_timer: TimerHandle | None = None
        self._on_lost: Callable[[], None] | None = None
        self._lost = False

        # The exchange being answered, and the pipelined ones waiting their turn.
        self.cycle: _Exchange | None = None
        self.pipeline: deque[tuple[_Exchange, Callable[..., Any]]] = deque()
        # The request the parser is filling in.
        self._reading: _Exchange | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect = False
        self._in_head = False  # a request head has begun and not ended
        self._raw_head_bytes = 0  # bytes read while it was unfinished
        self._head_bytes = 0  # its target and headers as parsed

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.connections.add(self)  # type: ignore[arg-type]
        self.transport = transport = cast(asyncio.Transport, transport)
        self.server = get_local_addr(transport)
        self.client = get_remote_addr(transport)
        self.scheme = "https" if is_ssl(transport) else "http"

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)  # type: ignore[arg-type]
        self._lost = True
        for exchange in self._exchanges():
            if not exchange.response_complete:
                exchange.disconnected = True
            exchange.wake()
        self._release_writers()
        if exc is None:
            self.transport.close()
        self._cancel_keep_alive()
        callback, self._on_lost = self._on_lost, None
        if callback is not None:
            callback()

    def eof_received(self) -> None:
        pass  # the transport closes itself

    def data_received(self, data: bytes) -> None:
        self._cancel_keep_alive()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No websockets here: the request is answered as plain HTTP, and the connection
            # closed after it (the parser reads nothing more on it).
            self.logger.warning("Unsupported upgrade request.")
            if self.cycle is not None:
                self.cycle.keep_alive = False
            else:
                self.transport.close()
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):  # raised by a callback here
                self._refuse_large_head()
            else:
                self.logger.warning("Invalid HTTP request received.")
                self._refuse(400, "Invalid HTTP request received.")
            return
        if self._in_head:  # an unfinished head: httptools buffers a header value unbounded
            self._raw_head_bytes += len(data)
            if self._raw_head_bytes > MAX_HEAD_BYTES:
                self._refuse_large_head()

    def _refuse_large_head(self) -> None:
        self.logger.warning("Request head over %d bytes.", MAX_HEAD_BYTES)
        self._refuse(431, "Request header fields too large.")

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._release_writers()

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._expect = False
        self._in_head = True
        self._raw_head_bytes = 0
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self.parser
        http_version = parser.get_http_version()
        url = httptools.parse_url(self._url)
        raw_path: bytes = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": http_version,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "method": parser.get_method().decode("ascii"),
            "root_path": self.root_path,
            "path": self.root_path + path,
            "raw_path": self._raw_root_path + raw_path,
            "query_string": url.query or b"",
            "headers": self._headers,
            "state": self.app_state.copy(),
            # An ASGI extension is a dict of its own data.
            "extensions": {CONNECTION_EXTENSION: {"protocol": self}},
        }
        keep_alive = http_version != "1.0" and parser.should_keep_alive()
        exchange = _Exchange(self, scope, keep_alive, self._expect)
        self._reading = exchange
        app = self.app
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            self.logger.warning("Exceeded concurrency limit.")
            app = _service_unavailable
        if self.cycle is None:
            self.cycle = exchange
            self._start(exchange, app)
        else:  # pipelined behind the one being answered
            self.pipeline.append((exchange, app))
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        exchange = self._reading
        if exchange is None or exchange.response_complete:
            return
        exchange.body += body
        if len(exchange.body) > _HIGH_WATER:
            self._pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        exchange = self._reading
        if exchange is None or exchange.response_complete:
            return
        exchange.more_body = False
        exchange.wake()

    # -- the exchanges

    def _start(self, exchange: _Exchange, app: Callable[..., Any]) -> None:
        if self._fresh_context:
            task = self.loop.create_task(exchange.run(app), context=contextvars.Context())
        else:
            task = self.loop.create_task(exchange.run(app))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def on_response_complete(self, exchange: _Exchange) -> None:
        self.server_state.total_requests += 1
        if self.cycle is exchange:
            self.cycle = None
        if self.transport.is_closing():
            return
        self._cancel_keep_alive()
        if self.read_paused:
            self.resume_reading_now()
        if self.pipeline:
            following, app = self.pipeline.popleft()
            self.cycle = following
            self._start(following, app)
        else:
            self._keep_alive_timer = self._timers.call_at(
                self.loop.time() + self.timeout_keep_alive, self._keep_alive_expired
            )

    def _exchanges(self) -> list[_Exchange]:
        found = [] if self.cycle is None else [self.cycle]
        found += [exchange for exchange, _ in self.pipeline]
        if self._reading is not None and self._reading not in found:
            found.append(self._reading)
        return found

    def shutdown(self) -> None:
        """The server is stopping: close an idle connection now, a busy one after its answer."""
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()
        else:
            self.cycle.keep_alive = False

    def _keep_alive_expired(self) -> None:
        self._keep_alive_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _cancel_keep_alive(self) -> None:
        timer = self._keep_alive_timer
        if timer is not None:
            self._keep_alive_timer = None
            timer.cancel()

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that cannot be read (`status` and `message`) and close."""
        body = message.encode("ascii")
        parts = [_STATUS_LINES[status]]
        for name, value in self.server_state.default_headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        )
        if not self.transport.is_closing():
            self.transport.write(b"".join(parts))
            self.transport.close()

    # -- flow control

    def _pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading_now(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    async def drain(self) -> None:
        """Wait until the transport takes writes again (or the connection is gone)."""
        if not self.write_paused or self._lost:
            return
        waiter = self.loop.create_future()
        self._drained.append(waiter)
        await waiter

    def _release_writers(self) -> None:
        waiters, self._drained = self._drained, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- what the app may ask of its connection (see `connection_of`)

    def watch_disconnect(self, callback: Callable[[], None]) -> bool:
        """Call `callback` (once, from the event loop) when the connection is lost, until
        `unwatch_disconnect`; False, and no call, when it is already lost. One watch at a
        time: the running request's."""
        cycle = self.cycle
        if self._lost or self.transport.is_closing() or (cycle is not None and cycle.disconnected):
            return False
        # Reading is paused under a large body; reading is how a disconnect is seen.
        if self.read_paused:
            self.resume_reading_now()
        self._on_lost = callback
        return True

    def unwatch_disconnect(self, callback: Callable[[], None]) -> None:
        """Stop the watch `callback` was given to (a no-op when it already ran)."""
        if self._on_lost == callback:
            self._on_lost = None

    def body_received(self) -> bool:
        """Whether the running request's whole body has arrived, so that `receive()`
        hands it over without waiting."""
        cycle = self.cycle
        return cycle is not None and not cycle.more_body


async def _plain_answer(send: Callable[..., Any], status: int, text: bytes) -> None:
    """A text answer after which the connection closes."""
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", b"%d" % len(text)),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text})


async def _service_unavailable(scope: Any, receive: Any, send: Any) -> None:
    """The answer past uvicorn's `limit_concurrency`."""
    await _plain_answer(send, 503, b"Service Unavailable")


def connection_of(scope: Mapping[str, Any]) -> HttpProtocol | None:
    """The `HttpProtocol` a request arrived on, when it did (None under other servers)."""
    extensions = scope.get("extensions")
    if not extensions:
        return None
    data = extensions.get(CONNECTION_EXTENSION)
    connection = data.get("protocol") if data else None
    return connection if isinstance(connection, HttpProtocol) else None
