"""The provider's own HTTP/1.1 client: keep-alive connections to one URL, parsed by httptools.

A proxied call spends most of its transport time in the general-purpose machinery of an
HTTP client library (request and response objects, header multidicts, timer contexts,
hooks) rather than on the wire. This client does the one thing a provider needs: POST a
JSON body to one URL and hand back the status, the headers and the body as it arrives.
It runs on asyncio protocols with `httptools` (the C parser uvicorn uses) doing the
parsing. Failures are raised as the httpx exceptions an httpx transport raises for them,
so the SDK's error types and the provider's error classification apply unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import zlib
from collections.abc import Sequence
from typing import cast
from urllib.parse import urlsplit

import httptools

from chatroute._timer import TimerQueue, timer_queue
from chatroute.providers._http import http

__all__ = ["H1Pool", "H1Response"]

# The encodings decoded here, and so the only ones asked for.
_ACCEPT_ENCODING = b"gzip, deflate"
# Headers the pool writes itself; the same names given by the caller are left out.
_OWN_HEADERS = frozenset(
    {b"host", b"content-length", b"transfer-encoding", b"accept-encoding", b"connection"}
)
# Body bytes buffered for a slow reader before the socket stops being read.
_HIGH_WATER = 256 * 1024
_LOW_WATER = 64 * 1024


class _Decoder:
    """Decodes a gzip or deflate body (raw deflate included) as it arrives."""

    __slots__ = ("_raw_fallback", "_zlib")

    def __init__(self, encoding: bytes) -> None:
        gzip = encoding == b"gzip" or encoding == b"x-gzip"
        self._zlib = zlib.decompressobj(16 + zlib.MAX_WBITS if gzip else zlib.MAX_WBITS)
        self._raw_fallback = not gzip  # "deflate" is often sent without its zlib header

    def decode(self, data: bytes) -> bytes:
        try:
            out = self._zlib.decompress(data)
        except zlib.error as exc:
            if not self._raw_fallback:
                raise http.DecodingError(f"the body could not be decoded: {exc}") from exc
            self._raw_fallback = False
            self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
            return self.decode(data)
        self._raw_fallback = False
        return out

    def flush(self) -> bytes:
        return self._zlib.flush()


class H1Response:
    """A response whose head has arrived; its body is read with `aread()` or
    `aiter_bytes()`, and `aclose()` releases it.

    A response read to its end has already given its connection back to the pool; one
    closed before its end drops the connection (it is never reused). `aclose()` never
    suspends, so a cancellation cannot interrupt it. While a read waits, `read_timeout`
    bounds the silence (`httpx.ReadTimeout`); a connection that breaks mid-body raises
    `httpx.RemoteProtocolError`, a body that cannot be decompressed `httpx.DecodingError`.
    """

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_decoder",
        "_done",
        "_error",
        "_head_done",
        "_loop",
        "_read_timeout",
        "_timers",
        "_until_close",
        "_waiter",
        "headers",
        "reason",
        "status",
    )

    def __init__(
        self,
        conn: _Connection,
        loop: asyncio.AbstractEventLoop,
        read_timeout: float | None,
        timers: TimerQueue,
    ) -> None:
        self._conn: _Connection | None = conn
        self._loop = loop
        self._read_timeout = read_timeout
        self._timers = timers  # the loop's TimerQueue, for the per-read timeout
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._decoder: _Decoder | None = None
        self._head_done = False
        self._until_close = False  # no length and not chunked: the body ends with the connection
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    # ------------------------------------------------------------ fed by the connection

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_head(self, status: int, keep_alive: bool) -> None:
        chunked = False
        length = False
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"content-encoding":
                encoding = value.strip().lower()
                if encoding in (b"gzip", b"x-gzip", b"deflate"):
                    self._decoder = _Decoder(encoding)
            elif lowered == b"transfer-encoding":
                chunked = chunked or b"chunked" in value.lower()
            elif lowered == b"content-length":
                length = True
        self.status = status
        self._until_close = not (chunked or length or keep_alive)
        self._head_done = True
        self._wake()

    def _on_body(self, data: bytes) -> None:
        decoder = self._decoder
        if decoder is not None:
            try:
                data = decoder.decode(data)
            except http.DecodingError as exc:
                self._fail(exc)
                return
        if data:
            self._chunks.append(data)
            self._buffered += len(data)
            conn = self._conn
            if self._buffered > _HIGH_WATER and conn is not None:
                conn.pause()
        self._wake()

    def _on_complete(self) -> None:
        decoder = self._decoder
        if decoder is not None:
            tail = decoder.flush()
            if tail:
                self._chunks.append(tail)
        self._done = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self._done and self._error is None:
            self._error = error
            self._drop()
        self._wake()

    def _lost(self, exc: BaseException | None) -> None:
        """The connection closed under this response."""
        self._conn = None
        if self._done:
            return
        if self._head_done and self._until_close and exc is None:
            self._on_complete()
            return
        if self._head_done:
            error = http.RemoteProtocolError(
                "peer closed connection without sending complete message body"
            )
        else:
            error = http.RemoteProtocolError("Server disconnected without sending a response.")
        if exc is not None:
            error.__cause__ = exc
        self._fail(error)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # ------------------------------------------------------------ read by the caller

    async def _wait(self) -> None:
        """Wait for the next change (head, data, end, failure), within the read timeout."""
        waiter = self._loop.create_future()
        self._waiter = waiter
        timer = None
        if self._read_timeout is not None:
            timer = self._timers.call_at(
                self._loop.time() + self._read_timeout, self._timed_out, waiter
            )
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _timed_out(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            self._fail(http.ReadTimeout("timed out waiting for the upstream to send data"))

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        conn = self._conn
        if conn is not None and conn._paused:
            conn.resume()
        return data

    async def _next_chunk(self) -> bytes | None:
        """The body bytes received since the last call; None at the end of the body."""
        while True:
            if self._chunks:
                return self._take()
            if self._error is not None:
                raise self._error
            if self._done:
                return None
            await self._wait()

    async def aread(self) -> bytes:
        parts: list[bytes] = []
        while (chunk := await self._next_chunk()) is not None:
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def aiter_bytes(self) -> _Chunks:
        return _Chunks(self)

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._drop()

    def to_httpx(self, content: bytes, request: http.Request) -> http.Response:
        """This (read) response as an httpx response with `content` as its (decoded) body;
        its `Content-Encoding` is left out."""
        headers = [(n, v) for n, v in self.headers if n.lower() != b"content-encoding"]
        extensions: dict[str, object] = {"http_version": b"HTTP/1.1"}
        if self.reason:
            extensions["reason_phrase"] = self.reason
        return http.Response(
            status_code=self.status,
            headers=headers,
            content=content,
            request=request,
            extensions=extensions,
        )


class _Chunks:
    """A response body's bytes as they arrive."""

    __slots__ = ("_response",)

    def __init__(self, response: H1Response) -> None:
        self._response = response

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._response._next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk


class _Connection(asyncio.Protocol):
    """One keep-alive connection: it serves one response at a time (`response`)."""

    def __init__(self, pool: H1Pool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.response: H1Response | None = None
        self.lost = False
        self.idle_since = 0.0
        self._paused = False
        self._drained: asyncio.Future[None] | None = None  # set while writing is paused

    # ---------------------------------------------------------------- asyncio protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio's, but have the same methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.response is None:
            self._unsolicited()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response = self.response
            if response is not None:
                response._fail(http.RemoteProtocolError(f"malformed HTTP response: {exc}"))
            self.close()

    def pause_writing(self) -> None:
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.resume_writing()
        self._pool._forget(self)
        response, self.response = self.response, None
        if response is not None:
            response._lost(exc)

    # ------------------------------------------------------------- httptools callbacks

    def _unsolicited(self) -> None:
        """Bytes nobody asked for (on an idle connection, or after a complete answer):
        the connection is never reused."""
        self.close()

    def on_status(self, reason: bytes) -> None:
        if self.response is None:
            self._unsolicited()
        else:
            self.response.reason = reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is None:
            self._unsolicited()
        else:
            self.response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        if response is None:
            self._unsolicited()
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue and the like): skip it
            response.headers.clear()
            return
        response._on_head(status, self._parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self.response is not None and self.response.status:
            self.response._on_body(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is None or not response.status:
            return  # the end of an interim answer
        self.response = None
        response._conn = None
        keep_alive = self._parser.should_keep_alive()
        response._on_complete()
        if keep_alive and not self.lost:
            if self._paused:
                self.resume()
            self._pool._release(self)
        else:
            self.close()

    # ------------------------------------------------------------------------- control

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.lost:
            self._paused = False
            self.transport.resume_reading()

    async def drain(self, limit: float | None) -> None:
        """Wait until the transport has taken in what was written (`httpx.WriteTimeout`)."""
        drained = self._drained
        if drained is None:
            return
        try:
            async with asyncio.timeout(limit):
                await drained
        except TimeoutError as exc:
            raise http.WriteTimeout("the upstream did not take in the request in time") from exc

    def usable(self) -> bool:
        transport = self.transport
        return not self.lost and transport is not None and not transport.is_closing()

    def close(self) -> None:
        """Drop the connection (it is never reused)."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()


class H1Pool:
    """POSTs to one `http://` or `https://` URL over pooled HTTP/1.1 keep-alive connections.

    - `max_connections`: connections open at once (pooled or in use); a request that finds
      none free waits for one up to `pool_timeout` (`httpx.PoolTimeout`);
    - `keepalive_expiry`: how long an idle pooled connection may be reused;
    - `ssl_context`: the TLS settings of `https` connections (the server name is checked);
    - `connect_timeout`: establishing a connection, TLS included (`httpx.ConnectTimeout`;
      a refused or failed connection is `httpx.ConnectError`); `read_timeout`: the longest
      wait for the next bytes of the answer (`httpx.ReadTimeout`); `write_timeout`: the
      longest wait for the upstream to take in a request body too large for the socket
      buffers (`httpx.WriteTimeout`);
    - no redirects are followed, no proxy or environment settings are used, and no cookies
      are kept; gzip and deflate bodies are asked for and decoded.

    Connections belong to the event loop that opened them; a request on another loop
    starts afresh. `aclose()` closes every connection; the pool cannot be used after it.
    """

    def __init__(
        self,
        url: str,
        *,
        max_connections: int,
        keepalive_expiry: float,
        ssl_context: ssl.SSLContext,
        connect_timeout: float | None,
        read_timeout: float | None,
        pool_timeout: float | None,
        write_timeout: float | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url
        self._tls = ssl_context if parts.scheme == "https" else None
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls is not None else 80)
        default_port = (parts.scheme == "https" and self._port == 443) or (
            parts.scheme == "http" and self._port == 80
        )
        host = self._host if ":" not in self._host else f"[{self._host}]"
        authority = host if default_port else f"{host}:{self._port}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._request_line = b"POST %s HTTP/1.1\r\nhost: %s\r\n" % (
            target.encode("ascii"),
            authority.encode("ascii") if authority.isascii() else authority.encode("idna"),
        )
        self._max = max_connections
        self._keepalive = keepalive_expiry
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._write_timeout = write_timeout
        self._pool_timeout = pool_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timers: TimerQueue | None = None
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self._opening = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._head_source: Sequence[tuple[bytes, bytes]] | None = None
        self._head_block = b""
        self._closed = False

    @property
    def connections(self) -> int:
        """Connections open or being opened."""
        return len(self._all) + self._opening

    # ------------------------------------------------------------------------ requests

    def _head(self, headers: Sequence[tuple[bytes, bytes]], length: int) -> bytes:
        if headers is not self._head_source:
            lines = [self._request_line]
            lines += [
                name + b": " + value + b"\r\n"
                for name, value in headers
                if name.lower() not in _OWN_HEADERS
            ]
            lines.append(b"accept-encoding: " + _ACCEPT_ENCODING + b"\r\n")
            self._head_block = b"".join(lines)
            self._head_source = headers
        return self._head_block + b"content-length: %d\r\n\r\n" % length

    async def post(self, headers: Sequence[tuple[bytes, bytes]], content: bytes) -> H1Response:
        """POST `content` with `headers` and return the response once its head arrived.

        Headers the pool writes itself (host, content-length, transfer-encoding,
        accept-encoding, connection) are not taken from `headers`. Failures raise httpx
        transport errors; an interrupted call drops its connection.
        """
        conn = None
        if not self._closed and self._idle and asyncio.get_running_loop() is self._loop:
            conn = self._take_idle(self._loop.time())  # what _acquire does first
        if conn is None:
            conn = await self._acquire()
        assert conn.transport is not None and self._loop is not None and self._timers is not None
        response = H1Response(conn, self._loop, self._read_timeout, self._timers)
        conn.response = response
        try:
            conn.transport.write(self._head(headers, len(content)) + content)
            if conn._drained is not None:  # a large body the upstream is slow to take
                await conn.drain(self._write_timeout)
            while not response._head_done and response._error is None:  # the head
                await response._wait()
            if response._error is not None:
                raise response._error
        except BaseException:
            await response.aclose()
            raise
        return response

    # ---------------------------------------------------------------------- the pool

    async def _acquire(self) -> _Connection:
        if self._closed:
            raise RuntimeError("the HTTP connection pool is closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._restart(loop)
        while True:
            conn = self._take_idle(loop.time())
            if conn is not None:
                return conn
            if self.connections < self._max:
                return await self._open(loop)
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout(self._pool_timeout):
                    await waiter
            except TimeoutError:
                raise http.PoolTimeout("no connection became free within the pool timeout")
            finally:
                if not waiter.done():
                    waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if self._closed:
                raise RuntimeError("the HTTP connection pool is closed")

    def _take_idle(self, now: float) -> _Connection | None:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.usable():
                continue
            if now - conn.idle_since > self._keepalive:
                conn.close()
                continue
            return conn
        return None

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        self._opening += 1
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self),
                    self._host,
                    self._port,
                    ssl=self._tls,
                    server_hostname=self._host if self._tls is not None else None,
                )
        except TimeoutError as exc:
            raise http.ConnectTimeout(
                f"no connection to {self._host}:{self._port} within the connect timeout"
            ) from exc
        except OSError as exc:  # refused, unreachable, DNS, TLS (ssl.SSLError is an OSError)
            raise http.ConnectError(str(exc) or type(exc).__name__) from exc
        finally:
            self._opening -= 1
            self._wake_one()
        if self._closed or conn.lost:
            conn.close()
            raise http.ConnectError("the connection closed as soon as it opened")
        self._all.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        if self._closed or conn.lost:
            conn.close()
            return
        assert self._loop is not None
        conn.idle_since = self._loop.time()
        self._idle.append(conn)
        if self._waiters:
            self._wake_one()

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _restart(self, loop: asyncio.AbstractEventLoop) -> None:
        """Leave the connections of another event loop behind."""
        for conn in list(self._all):
            if conn.transport is not None:
                # A closed loop raises RuntimeError: its sockets went with it.
                with contextlib.suppress(RuntimeError):
                    conn.transport.abort()
        self._all.clear()
        self._idle.clear()
        self._waiters.clear()
        self._opening = 0
        self._loop = loop
        self._timers = timer_queue(loop)

    async def aclose(self) -> None:
        """Close every connection; idempotent."""
        self._closed = True
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
