"""uvicorn's HTTP/1.1 protocol with each response head sent in the same write as its body.

uvicorn writes a response's status line and headers the moment the app sends
`http.response.start`, and the body in a second write. On loopback and on fast networks
the client then wakes twice: once for a head it cannot use yet, once for the body. On a
busy host the first wake-up can also take the CPU away from the service before it has
written the body. `HttpProtocol` holds the head back until the body's first bytes are
written, so both leave in one write (one TCP segment for a small answer). A head whose
body does not follow at once (a stream whose first event is not ready yet, an answer
without a body) is written on the event loop's next turn, so nothing waits longer than
that. Interim `1xx` answers are never held.

It also tells the app about its connection without a task per request: the request's
scope carries the protocol under `scope["extensions"]["chatroute.connection"]["protocol"]`
(`connection_of(scope)`), which can call back when the connection is lost
(`watch_disconnect`) and say whether the whole body has already arrived
(`body_received`). Without it, an app learns both only by awaiting `receive()`, which
for a disconnect means a task parked on it for the whole request. And the keep-alive
timeout armed after each answer is one of the loop's shared timers (`chatroute._timer`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from chatroute._timer import TimerQueue, timer_queue

__all__ = ["CONNECTION_EXTENSION", "CoalescingTransport", "HttpProtocol", "connection_of"]

CONNECTION_EXTENSION: Final = "chatroute.connection"
"""The scope extension naming the `HttpProtocol` a request arrived on."""


class CoalescingTransport:
    """A transport wrapper that joins a response head with the write that follows it.

    Order is always kept: a held head goes out before, or together with, anything
    written after it; closing writes it first; aborting drops it with the connection.
    Everything else is the wrapped transport's.
    """

    __slots__ = (
        "_flush",
        "_held",
        "_loop",
        "_transport",
        "get_extra_info",
        "is_closing",
        "pause_reading",
        "resume_reading",
    )

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._flush: asyncio.Handle | None = None
        # The transport's own methods that the server calls on every request, bound here
        # so that calling them does not go through __getattr__.
        self.is_closing = transport.is_closing
        self.get_extra_info = transport.get_extra_info
        self.pause_reading = transport.pause_reading
        self.resume_reading = transport.resume_reading

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._drop_held()
            self._transport.write(held + data)
        elif (
            # A final response head: uvicorn writes a whole head, status line to blank line,
            # in one call. "HTTP/1.1 1" is an interim answer (100 Continue), which the
            # client waits for: not held.
            data.startswith(b"HTTP/1.1 ") and data[9:10] != b"1" and data.endswith(b"\r\n\r\n")
        ):
            self._held = bytes(data)
            self._flush = self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def flush(self) -> None:
        """Write a held head now (the loop does this on its next turn anyway); a head held
        when the connection was lost is dropped with it."""
        held = self._held
        if held is not None:
            self._drop_held()
            if not self._transport.is_closing():
                self._transport.write(held)

    def _drop_held(self) -> None:
        self._held = None
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._drop_held()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through a `CoalescingTransport`.

    Pass it as uvicorn's `http` setting (`uvicorn.run(app, http=HttpProtocol)`);
    `chatroute serve` does.
    """

    _on_lost: Callable[[], None] | None = None
    _timers: TimerQueue

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        wrapped = CoalescingTransport(transport, self.loop)
        self._timers = timer_queue(self.loop)
        super().connection_made(wrapped)  # type: ignore[arg-type]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # An ASGI extension is a dict of its own data.
        self.scope["extensions"] = {CONNECTION_EXTENSION: {"protocol": self}}

    def connection_lost(self, exc: Exception | None) -> None:
        callback, self._on_lost = self._on_lost, None
        super().connection_lost(exc)
        if callback is not None:
            callback()

    def on_response_complete(self) -> None:
        # uvicorn's own, but the keep-alive timeout armed after every answer (and
        # cancelled by the next request's first bytes) lives on the loop's TimerQueue: on
        # uvloop a loop timer costs about 5 µs to create and cancel, once a request.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        if self.flow.read_paused:
            self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self.timeout_keep_alive_task = self._timers.call_at(  # type: ignore[assignment]
                self.loop.time() + self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def watch_disconnect(self, callback: Callable[[], None]) -> bool:
        """Call `callback` (once, from the event loop) when the connection is lost, until
        `unwatch_disconnect`; False, and no call, when it is already lost. One watch at a
        time: the running request's."""
        cycle = self.cycle
        if self.transport.is_closing() or (cycle is not None and cycle.disconnected):
            return False
        # uvicorn pauses reading under a large body; reading is how a disconnect is seen.
        if self.flow.read_paused:
            self.flow.resume_reading()
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
        return cycle is not None and getattr(cycle, "more_body", True) is False


def connection_of(scope: Mapping[str, Any]) -> HttpProtocol | None:
    """The `HttpProtocol` a request arrived on, when it did (None under other servers)."""
    extensions = scope.get("extensions")
    if not extensions:
        return None
    data = extensions.get(CONNECTION_EXTENSION)
    connection = data.get("protocol") if data else None
    return connection if isinstance(connection, HttpProtocol) else None
