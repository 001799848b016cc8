"""A lean asyncio network backend for the provider's httpcore pool: one write per request.

httpcore's default backend goes through anyio, which wraps every socket read and write in
a cancel scope and an exception map; for a proxied chat completion those layers cost about
as much CPU as everything else in the HTTP client. This backend speaks to the event loop
directly (an `asyncio.Protocol` with its own buffer, `asyncio.timeout` only when a limit
is set), and holds what the client writes until it next reads, so that a request's head
and body leave in a single write: one TCP segment, one wake-up of the upstream.

It honours the httpcore stream contract: `read` returns b"" at a clean end of stream and
raises `ReadError`/`ReadTimeout`; `write` raises `WriteError`/`WriteTimeout`; connecting
raises `ConnectError`/`ConnectTimeout`; TLS goes through `loop.start_tls`. Outside an
asyncio event loop (trio) connections are made by the wrapped backend unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import select
import socket
import ssl
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar, cast

import sniffio

from chatroute.providers._http import core, http

__all__ = ["AsyncioNetworkBackend", "use_asyncio_network"]

T = TypeVar("T")

_HIGH_WATER = 1024 * 1024  # pause reading the socket past this much unread data
_LOW_WATER = 256 * 1024  # and resume below this
_HOLD_LIMIT = 256 * 1024  # held request bytes are written at once past this


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class _Protocol(asyncio.Protocol):
    """Buffers what the connection receives and wakes the one pending reader or writer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.error: BaseException | None = None
        self.closed = False
        self.reader: asyncio.Future[None] | None = None
        self.writer: asyncio.Future[None] | None = None
        self.write_paused = False
        self.read_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's transports do not derive from asyncio's.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.read_paused and len(self.buffer) > _HIGH_WATER and self.transport:
            self.read_paused = True
            self.transport.pause_reading()
        _wake(self.reader)

    def eof_received(self) -> bool:
        self.eof = True
        _wake(self.reader)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.closed = True
        self.error = exc
        _wake(self.reader)
        _wake(self.writer)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        _wake(self.writer)


class _AsyncioStream(core.AsyncNetworkStream):
    """One connection: reads from the protocol's buffer, holds writes until the next read."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._held: list[bytes] = []
        self._held_size = 0
        self._write_timeout: float | None = None

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        if self._held:
            # As httpcore does for a failed request write: a server may answer (an error,
            # say) before reading the whole request, so go on and read what it sent.
            with contextlib.suppress(core.WriteError):
                await self._flush()
        protocol = self._protocol
        buffer = protocol.buffer
        if not buffer and not protocol.eof:
            waiter = asyncio.get_running_loop().create_future()
            protocol.reader = waiter
            try:
                if timeout is None:
                    await waiter
                else:
                    async with asyncio.timeout(timeout):
                        await waiter
            except TimeoutError as exc:
                raise core.ReadTimeout("timed out reading from the upstream") from exc
            finally:
                protocol.reader = None
        if buffer:
            if len(buffer) <= max_bytes:
                data = bytes(buffer)
                buffer.clear()
            else:
                data = bytes(buffer[:max_bytes])
                del buffer[:max_bytes]
            if protocol.read_paused and len(buffer) < _LOW_WATER and not protocol.closed:
                protocol.read_paused = False
                # Re-registering the reader captures the current context: keep the
                # request's out of the pooled connection (see `_in_clean_context`).
                contextvars.Context().run(self._transport.resume_reading)
            return data
        if protocol.error is not None:
            raise core.ReadError(str(protocol.error) or type(protocol.error).__name__)
        return b""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if not buffer:
            return
        self._held.append(buffer)
        self._held_size += len(buffer)
        self._write_timeout = timeout
        if self._held_size >= _HOLD_LIMIT:
            await self._flush()

    async def _flush(self) -> None:
        data = b"".join(self._held) if len(self._held) > 1 else self._held[0]
        self._held.clear()
        self._held_size = 0
        protocol = self._protocol
        if protocol.closed or self._transport.is_closing():
            raise core.WriteError("the connection is closed")
        self._transport.write(data)
        if protocol.write_paused:
            waiter = asyncio.get_running_loop().create_future()
            protocol.writer = waiter
            try:
                async with asyncio.timeout(self._write_timeout):
                    await waiter
            except TimeoutError as exc:
                raise core.WriteTimeout("timed out writing to the upstream") from exc
            finally:
                protocol.writer = None
            if protocol.closed:
                raise core.WriteError("the connection closed while writing")

    async def aclose(self) -> None:
        self._held.clear()
        self._held_size = 0
        self._transport.close()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
    ) -> core.AsyncNetworkStream:
        if self._held:
            await self._flush()
        if self._protocol.buffer:
            self._transport.close()
            raise core.ConnectError("unexpected data from the server before the TLS handshake")
        loop = asyncio.get_running_loop()
        handshake = loop.start_tls(
            self._transport,
            self._protocol,
            ssl_context,
            server_hostname=server_hostname,
            ssl_handshake_timeout=timeout,
        )
        try:
            tls = await _in_clean_context(handshake, timeout)
        except TimeoutError as exc:
            self._transport.close()
            raise core.ConnectTimeout("timed out in the TLS handshake") from exc
        except (OSError, ssl.SSLError) as exc:
            self._transport.close()
            raise core.ConnectError(str(exc) or type(exc).__name__) from exc
        except BaseException:
            self._transport.close()
            raise
        if tls is None:  # closed during the handshake
            self._transport.close()
            raise core.ConnectError("the connection closed during the TLS handshake")
        self._protocol.transport = tls
        return _AsyncioStream(tls, self._protocol)

    def get_extra_info(self, info: str) -> Any:
        transport = self._transport
        if info == "is_readable":
            # Data or an end of stream already received counts: an idle connection that
            # has either can no longer be used for a new request.
            protocol = self._protocol
            if protocol.buffer or protocol.eof:
                return True
            return _socket_readable(transport.get_extra_info("socket"))
        if info == "ssl_object":
            return transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return transport.get_extra_info("sockname")
        if info == "server_addr":
            return transport.get_extra_info("peername")
        if info == "socket":
            return transport.get_extra_info("socket")
        return None


async def _in_clean_context(work: Coroutine[Any, Any, T], limit: float | None) -> T:
    """Await `work` in a task with an empty context, for at most `limit` seconds.

    The event loop captures the current context in the callbacks a transport registers
    (its socket reader lives as long as the connection). A pooled connection outlives the
    request that opened it, and that request's context holds its state (traces, routing
    contexts, exceptions); made from an empty context the connection keeps none of it.
    Cancelling the caller cancels the work; a result that arrives too late is closed.
    """
    task = asyncio.get_running_loop().create_task(work, context=contextvars.Context())
    try:
        if limit is None:
            return await task
        async with asyncio.timeout(limit):
            return await task
    except BaseException:
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None:
            result = task.result()
            transport = result[0] if isinstance(result, tuple) else result
            close = getattr(transport, "close", None)
            if callable(close):
                close()
        raise


async def _connect(
    connecting: Coroutine[Any, Any, tuple[asyncio.BaseTransport, Any]],
    limit: float | None,
    where: str,
) -> tuple[asyncio.BaseTransport, Any]:
    try:
        return await _in_clean_context(connecting, limit)
    except TimeoutError as exc:
        raise core.ConnectTimeout(f"timed out connecting to {where}") from exc
    except OSError as exc:
        raise core.ConnectError(str(exc) or type(exc).__name__) from exc


def _socket_readable(sock: Any) -> bool:
    """Whether a read on the socket would return at once (data, an end, or no socket)."""
    try:
        fd = -1 if sock is None else sock.fileno()
    except OSError:
        return True
    if fd < 0:
        return True
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    readable, _, _ = select.select([fd], [], [], 0)  # pragma: no cover - Windows
    return bool(readable)


def _running_asyncio() -> bool:
    try:
        return sniffio.current_async_library() == "asyncio"
    except sniffio.AsyncLibraryNotFoundError:
        return False


class AsyncioNetworkBackend(core.AsyncNetworkBackend):
    """httpcore network backend on asyncio transports; other event loops use `fallback`."""

    def __init__(self, fallback: core.AsyncNetworkBackend) -> None:
        self._fallback = fallback

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> core.AsyncNetworkStream:
        if not _running_asyncio():
            return await self._fallback.connect_tcp(
                host,
                port,
                timeout=timeout,
                local_address=local_address,
                socket_options=socket_options,
            )
        loop = asyncio.get_running_loop()
        local = (local_address, 0) if local_address else None
        try:
            connecting = loop.create_connection(
                _Protocol, host, port, local_addr=local, happy_eyeballs_delay=0.25
            )
        except TypeError:  # an event loop without Happy Eyeballs (uvloop)
            connecting = loop.create_connection(_Protocol, host, port, local_addr=local)
        transport, protocol = await _connect(connecting, timeout, f"{host}:{port}")
        return self._stream(transport, protocol, socket_options)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: Iterable[Any] | None = None,
    ) -> core.AsyncNetworkStream:
        if not _running_asyncio():
            return await self._fallback.connect_unix_socket(
                path, timeout=timeout, socket_options=socket_options
            )
        loop = asyncio.get_running_loop()
        connecting = loop.create_unix_connection(_Protocol, path)
        transport, protocol = await _connect(connecting, timeout, path)
        return self._stream(transport, protocol, socket_options)

    @staticmethod
    def _stream(
        transport: asyncio.BaseTransport, protocol: Any, socket_options: Iterable[Any] | None
    ) -> _AsyncioStream:
        assert isinstance(protocol, _Protocol)
        sock = transport.get_extra_info("socket")
        try:
            if sock is not None:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for option in socket_options or ():
                    sock.setsockopt(*option)
        except OSError as exc:
            transport.close()
            raise core.ConnectError(str(exc) or type(exc).__name__) from exc
        return _AsyncioStream(cast(asyncio.Transport, transport), protocol)

    async def sleep(self, seconds: float) -> None:
        if _running_asyncio():
            await asyncio.sleep(seconds)
        else:
            await self._fallback.sleep(seconds)


def use_asyncio_network(client: http.AsyncClient) -> bool:
    """Give `client`'s default transport the asyncio backend; True if it could.

    Only a plain `AsyncHTTPTransport` over a connection pool that has made no connection
    yet is changed (not proxies, not custom transports); any other shape is left as it is
    and False is returned.
    """
    transport = getattr(client, "_transport", None)
    if type(transport) is not http.AsyncHTTPTransport:
        return False
    pool = getattr(transport, "_pool", None)
    if type(pool) is not core.AsyncConnectionPool or pool.connections:
        return False
    backend = getattr(pool, "_network_backend", None)
    if isinstance(backend, AsyncioNetworkBackend):
        return True
    if not isinstance(backend, core.AsyncNetworkBackend):
        return False
    pool._network_backend = AsyncioNetworkBackend(backend)
    return True
