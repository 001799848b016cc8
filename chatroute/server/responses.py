"""The chat answers: a JSON completion recorded once sent, and the event stream of a stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from chatroute.chat.types import ChatResponseUpdate
from chatroute.router.base import close_iterator
from chatroute.server.deadlines import (
    Deadline,
    DeadlineHit,
    DisconnectWatch,
    bounded,
    deadline_error,
)
from chatroute.server.errors import error_from_exception
from chatroute.server.service import CLIENT_CLOSED, Service
from chatroute.server.wire import StreamEncoder
from chatroute.tracing import RequestTrace

__all__ = ["RecordedResponse", "SSEResponse", "sse_body"]

logger = logging.getLogger("chatroute.server")


def _raw_headers(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """ASGI header pairs (lower-case names), as Starlette's Response encodes them."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


class SSEResponse(Response):
    """An event stream sent from the request's own task (no task group per stream).

    The watch that guarded the wait for the first update (`watch`, one task for the whole
    request) goes on cancelling the sending when the caller disconnects before the last
    message was sent, and marks the trace. The body and the routed stream behind it are
    always closed, however sending ends (even when the body never started).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        routed: Any,
        trace: RequestTrace,
        unsent: Callable[[], None],
        headers: Mapping[str, str],
        watch: DisconnectWatch,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.body_iterator = content
        self._routed = routed
        self._trace = trace
        self._unsent = unsent  # records the request when the body never got to run
        self._sent = False
        self._watch = watch
        # What Response.init_headers would set (no content-length: the body is streamed).
        self.raw_headers = [
            *_raw_headers(headers),
            (b"content-type", b"text/event-stream; charset=utf-8"),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        trace = self._trace

        def caller_left() -> None:
            # The server also says "disconnect" once the response is complete: not a
            # caller leaving.
            if not self._sent and trace.cancelled is None:
                trace.cancelled = "disconnect"

        watch = self._watch
        watch.on_disconnect(caller_left)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self._sent = True  # before the server can report the completed response
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError as exc:
            if not watch.caused(exc):
                raise
            if watch.failure is not None:
                raise watch.failure from None
        except OSError:
            if trace.cancelled is None:
                trace.cancelled = "disconnect"
            raise
        else:
            watch.settle()  # the watch's cancellation may have been swallowed on the way
        finally:
            watch.stop()
            with anyio.CancelScope(shield=True):
                await close_iterator(self.body_iterator)
                await close_iterator(self._routed)
            if trace.status is None:
                self._unsent()


class RecordedResponse(Response):
    """A JSON answer that records its request once sent: the recording (metrics, trace
    sink, log) runs after the last byte, off the caller's latency, and runs exactly once
    however sending ends."""

    media_type = "application/json"

    def __init__(self, body: bytes, headers: Mapping[str, str], record: Callable[[], None]) -> None:
        # What Response.__init__ would set, without its generic header merging.
        self.status_code = 200
        self.background = None
        self.body = body
        self.raw_headers = [
            (b"content-length", str(len(body)).encode("latin-1")),
            (b"content-type", b"application/json"),
            *_raw_headers(headers),
        ]
        self._record = record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.body})
        finally:
            self._record()


async def sse_body(
    service: Service,
    iterator: AsyncIterator[ChatResponseUpdate],
    pending: list[ChatResponseUpdate],
    finished: bool,
    encoder: StreamEncoder,
    trace: RequestTrace,
    started: float,
    deadline: Deadline | None,
) -> AsyncIterator[bytes]:
    status = 200
    route = trace.route or ""
    try:
        for update in pending:
            chunk = encoder.encode(update)
            if chunk:
                trace.committed = True
                yield chunk
        if not finished:
            while True:
                try:
                    update = await bounded(anext(iterator), deadline)
                except StopAsyncIteration:
                    break
                chunk = encoder.encode(update)
                if chunk:
                    trace.committed = True
                    yield chunk
        yield encoder.finish()
    except DeadlineHit as exc:  # after commit: in-band error, and no [DONE]
        trace.cancelled = "deadline"
        status = 504
        yield deadline_error(exc.seconds).sse_event()
    except Exception as exc:  # after commit: in-band error, and no [DONE]
        error = error_from_exception(exc, service.redact)
        status = error.status
        logger.warning(
            "stream on route %s failed after output: %s", route, service.redact(str(error))
        )
        yield error.sse_event()
    finally:
        with anyio.CancelScope(shield=True):
            await close_iterator(iterator)
        if trace.cancelled == "disconnect":
            status = CLIENT_CLOSED
        trace.usage = encoder.usage
        service.finish(trace, status, started)
