"""A request's deadline and the watch on its caller: what cuts a routed call short."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from starlette.types import Receive, Scope

from chatroute.server.errors import APIError
from chatroute.server.service import TIMEOUT_HEADER, Service

__all__ = [
    "CallerGone",
    "Deadline",
    "DeadlineHit",
    "DisconnectWatch",
    "bounded",
    "caller_timeout",
    "deadline_error",
    "deadline_for",
    "watched",
]

T = TypeVar("T")
_TIMEOUT_HEADER_KEY = TIMEOUT_HEADER.encode("latin-1")


class CallerGone(Exception):
    """The HTTP client disconnected while its request was being answered."""


class DeadlineHit(Exception):
    """The request's overall deadline expired on the caller's side."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request deadline of {seconds:g} s was exceeded")
        self.seconds = seconds


@dataclass(frozen=True)
class Deadline:
    """When the request must be over (event-loop time) and the budget it came from."""

    at: float
    seconds: float


def bounded(awaitable: Awaitable[T], deadline: Deadline | None) -> Awaitable[T]:
    """`awaitable` under the request deadline: its expiry cancels the call and raises
    DeadlineHit. Without a deadline, `awaitable` itself (no coroutine level around it).

    The expiry works by cancelling the task, so the failover router treats it as the
    caller cancelling: the running attempt is terminal, no new attempt starts, and the
    provider's health is not charged.
    """
    if deadline is None:
        return awaitable
    return _under_deadline(awaitable, deadline)


async def _under_deadline(awaitable: Awaitable[T], deadline: Deadline) -> T:
    timer = asyncio.timeout_at(deadline.at)
    try:
        async with timer:
            return await awaitable
    except TimeoutError as exc:
        if timer.expired():
            raise DeadlineHit(deadline.seconds) from exc
        raise


class DisconnectWatch:
    """Cancels the current task when the caller disconnects, or when its connection can no
    longer be read (`failure` then holds why).

    One task awaits `receive()` for the server's disconnect message (uvicorn's receive
    answers it once the connection is lost, or once the response is complete).

    Like `asyncio.timeout`, the watch's cancel() is matched by an uncancel() (in `caused`
    or `settle`), so a cancellation from elsewhere still propagates as what it is.
    A callback given to `on_disconnect` runs when the caller disconnects (at once, when
    it already has).
    """

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        self.gone = False
        self.failure: Exception | None = None
        self._on_disconnect: Callable[[], None] | None = None
        self._disconnected = False
        self._watcher = task.get_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception as exc:
            self.failure = exc
            self.gone = True
            self._task.cancel()
        else:
            self._left()

    def _left(self) -> None:
        self._disconnected = True
        if self._on_disconnect is not None:
            self._on_disconnect()
        self.gone = True
        self._task.cancel()

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Run `callback` when the caller disconnects; now, if it already did."""
        self._on_disconnect = callback
        if self._disconnected:
            callback()

    def stop(self) -> None:
        self._watcher.cancel()

    def caused(self, exc: BaseException) -> bool:
        """Whether `exc`, raised in the watched task, is the caller going away (and not also a
        cancellation from elsewhere); consumes the watch's cancellation when it was."""
        if not self.gone:
            return False
        return not (
            self._task.uncancel() > self._cancelling and isinstance(exc, asyncio.CancelledError)
        )

    def settle(self) -> bool:
        """After the work ended normally: whether the caller went away meanwhile (the work
        swallowed the cancellation, which is consumed here)."""
        if self.gone:
            self._task.uncancel()
        return self.gone


async def watched(receive: Receive, work: Awaitable[T], watch: DisconnectWatch | None = None) -> T:
    """Run `work` in the calling task while watching the connection; a disconnect (or a
    connection that cannot be read) cancels it and raises CallerGone, once the cancelled
    work has finished unwinding (its upstream request closed).

    Without `watch`, one is made for the work and stopped after it; a `watch` given is used
    and left running (a stream hands it over to its response).
    """
    own = watch is None
    if watch is None:
        watch = DisconnectWatch(receive)
    try:
        try:
            result = await work
        except (Exception, asyncio.CancelledError) as exc:
            if watch.caused(exc):
                raise CallerGone from None
            raise
        if watch.settle():
            raise CallerGone
        return result
    finally:
        if own:
            watch.stop()


def deadline_error(seconds: float) -> APIError:
    return APIError(
        504,
        f"the request deadline of {seconds:g} s was exceeded",
        type="timeout_error",
        code="deadline_exceeded",
    )


def caller_timeout(service: Service, scope: Scope) -> float | None:
    if not service.config.resilience.caller_deadline:
        return None
    # The raw header list, as `request.headers.get` reads it, without building `Headers`.
    raw = None
    for name, value in scope["headers"]:
        if name == _TIMEOUT_HEADER_KEY:
            raw = value.decode("latin-1")
            break
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise APIError(
            400,
            f"{TIMEOUT_HEADER} must be a positive number of seconds",
            param=TIMEOUT_HEADER,
            code="invalid_header",
        )
    return seconds


def deadline_for(
    service: Service, route: str, caller: float | None, arrived: float
) -> Deadline | None:
    policy = service.engine.resilience.get(route)
    seconds = policy.deadline if policy is not None else None
    if caller is not None and (seconds is None or caller < seconds):
        seconds = caller
    if seconds is None:
        return None
    return Deadline(arrived + seconds, seconds)
