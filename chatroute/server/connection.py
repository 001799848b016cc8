"""uvicorn's httptools protocol with a bounded request head: a size limit (431) and a time limit."""

from __future__ import annotations

import asyncio
from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

__all__ = ["MAX_HEAD_BYTES", "CoalescingTransport", "GuardedHttpProtocol", "http_protocol"]

MAX_HEAD_BYTES: Final = 64 * 1024
"""The most a request's target and headers may take; httptools itself sets no limit."""


class _HeadTooLarge(Exception):
    """Raised from a parser callback when the head passes MAX_HEAD_BYTES (uvicorn then
    answers the parser error with `send_400_response`)."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's own HTTP/1.1 protocol, with two limits on each request head.

    - A head over `MAX_HEAD_BYTES` gets a 431 and the connection is closed (httptools
      would buffer an unfinished header value without end).
    - A head not complete `head_timeout` seconds after its first byte (after the connection
      opened, for the first request) closes the connection, so a caller that trickles its
      head (slowloris) cannot hold a connection. The wait between requests on a kept-alive
      connection stays uvicorn's `timeout_keep_alive`.

    Its writes go through a `CoalescingTransport`. Give `http_protocol(head_timeout)` as
    uvicorn's `http` setting.
    """

    head_timeout: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._writer = CoalescingTransport(transport, self.loop)
        super().connection_made(self._writer)  # type: ignore[arg-type]
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        whole_read_in_head = self._in_head
        super().data_received(data)
        if whole_read_in_head and self._in_head:  # httptools holds an unfinished value
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_large_head()

    def send_400_response(self, msg: str) -> None:
        # uvicorn answers 400 to any parser error, the callback's `_HeadTooLarge` included.
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse_large_head()
        else:
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_head_timer()
        self._writer.hold_next()  # the answer's head leaves with its body
        super().on_headers_complete()

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge

    def _refuse_large_head(self) -> None:
        self.logger.warning("Request head over %d bytes.", MAX_HEAD_BYTES)
        message = b"Request header fields too large."
        content = [STATUS_LINE[431]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.append(b"content-type: text/plain; charset=utf-8\r\n")
        content.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(message))
        content.append(message)
        if not self.transport.is_closing():
            self.transport.write(b"".join(content))
            self.transport.close()

    def _arm_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_expired)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        answering = self.cycle is not None and not self.cycle.response_complete
        if answering or (self.flow is not None and self.flow.read_paused):
            # A pipelined head begun while the request before it is answered (or while
            # reading is paused for it): its wait is not the caller's doing yet.
            self._arm_head_timer()
        elif not self.transport.is_closing():
            self.logger.info("Request head not complete within %g s.", self.head_timeout)
            self.transport.close()


class CoalescingTransport:
    """A connection's transport that sends a response's head together with what follows it.

    uvicorn writes a head on its own, so a caller would wake once for the head and again
    for the body. After `hold_next()` (called when a request's head is complete), the next
    write (the response's head) is held: the write after it leaves with it in one send, at
    once; without one in the same step of the event loop, the head leaves on its own at
    the end of the step. Every other write goes straight through, and everything else is
    the wrapped transport's.
    """

    __slots__ = ("_held", "_hold", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._hold = False
        self._held: bytes | None = None

    def hold_next(self) -> None:
        """Hold the next write until the one after it (or the end of the loop's step)."""
        self._hold = True

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif self._hold and data:
            self._hold = False
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Send a held write now (the callback a held write schedules)."""
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def get_write_buffer_size(self) -> int:
        held = self._held
        return self._transport.get_write_buffer_size() + (len(held) if held else 0)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def http_protocol(
    head_timeout: float = GuardedHttpProtocol.head_timeout,
) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn's `http` setting, with the given head timeout."""
    if head_timeout == GuardedHttpProtocol.head_timeout:
        return GuardedHttpProtocol
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"head_timeout": head_timeout})
