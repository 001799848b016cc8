"""Per-attempt time limits, one mechanism for wrappers and providers alike; the deadline error."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from chatroute.chat.client import ChatClient, DelegatingChatClient
from chatroute.chat.types import ChatMessage, ChatOptions, ChatResponse, ChatResponseUpdate
from chatroute.errors import (
    FirstTokenTimeoutError,
    ProviderTimeoutError,
    StreamStallTimeoutError,
    is_cancelling,
)

__all__ = [
    "DeadlineExceededError",
    "TimeoutChatClient",
    "check_limit",
    "head_within",
    "stream_within",
    "within",
]

T = TypeVar("T")


class DeadlineExceededError(TimeoutError):
    """The whole request ran out of time before another attempt could start.

    `deadline` is the request deadline in seconds.
    """

    def __init__(self, deadline: float, message: str | None = None) -> None:
        self.deadline = deadline
        super().__init__(message or f"the request deadline of {deadline:g} s was exceeded")


def check_limit(name: str, value: object) -> float | None:
    """A time limit in seconds: a positive number, None (or infinity) for none."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds or None, got {type(value).__name__}")
    number = float(value)
    if math.isnan(number) or number <= 0:
        raise ValueError(f"{name} must be > 0 seconds (or None for no limit), got {value!r}")
    return None if math.isinf(number) else number


async def within(call: Callable[[], Awaitable[T]], limit: float | None, *, name: str | None) -> T:
    """`await call()` within `limit` seconds (None: no limit).

    When the limit expires the call is cancelled and `ProviderTimeoutError` (kind TIMEOUT)
    is raised, the task left not cancelling; a cancellation of the caller passes through.
    """
    return await _bounded(
        call,
        limit,
        lambda: ProviderTimeoutError(
            f"no answer within the attempt timeout of {limit:g} s", provider=name
        ),
    )


async def head_within(
    call: Callable[[], Awaitable[T]], limit: float | None, *, name: str | None
) -> T:
    """`await call()` within the first-token limit (None: no limit): the wait for a
    non-streamed answer to begin (its response head).

    When the limit expires the call is cancelled and `FirstTokenTimeoutError` raised, the
    task left not cancelling; a cancellation of the caller passes through.
    """
    return await _bounded(
        call,
        limit,
        lambda: FirstTokenTimeoutError(
            f"no answer began within the first-token limit of {limit:g} s", provider=name
        ),
    )


async def _bounded(
    call: Callable[[], Awaitable[T]], limit: float | None, expired: Callable[[], Exception]
) -> T:
    """`await call()` within `limit` seconds, raising `expired()` when the limit (and not a
    cancellation of the caller) ended it."""
    if limit is None:
        return await call()
    timer = asyncio.timeout(limit)
    try:
        async with timer:
            return await call()
    except (Exception, asyncio.CancelledError) as exc:
        if timer.expired() and not is_cancelling():
            raise expired() from exc
        raise


async def stream_within(
    stream: AsyncIterator[T],
    *,
    first_token: float | None,
    stall: float | None,
    total: float | None = None,
    name: str | None,
) -> AsyncIterator[T]:
    """`stream`'s items, each within its time limit.

    `first_token` bounds the wait for the first item (counted from the first `__anext__`),
    `stall` the wait for each later one (time the caller spends between items is not
    counted), `total` the whole stream. When one expires the pending read is cancelled,
    `stream` closed, and `FirstTokenTimeoutError`, `StreamStallTimeoutError` or (total)
    `ProviderTimeoutError` raised, the task left not cancelling. `stream` should hold back
    items that carry nothing until content arrives: the first item commits the attempt.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + total if total is not None else None
    first = True
    try:
        while True:
            limit = first_token if first else stall
            deadline = loop.time() + limit if limit is not None else None
            whole = end is not None and (deadline is None or end <= deadline)
            if whole:
                deadline = end
            if deadline is None:
                try:
                    item = await anext(stream)
                except StopAsyncIteration:
                    return
            else:
                timer = asyncio.timeout_at(deadline)
                try:
                    async with timer:
                        item = await anext(stream)
                except StopAsyncIteration:
                    return
                except (Exception, asyncio.CancelledError) as exc:
                    if not timer.expired() or is_cancelling():
                        raise
                    if whole:
                        raise ProviderTimeoutError(
                            f"the stream exceeded the attempt timeout of {total:g} s",
                            provider=name,
                            after_output=not first,
                        ) from exc
                    if first:
                        raise FirstTokenTimeoutError(
                            f"no first update within {limit:g} s", provider=name
                        ) from exc
                    raise StreamStallTimeoutError(
                        f"the stream stalled for {limit:g} s", provider=name, after_output=True
                    ) from exc
            first = False
            yield item
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


class TimeoutChatClient(DelegatingChatClient):
    """Bounds each call to `inner` in time.

    - `attempt_timeout`: the longest a non-streaming `get_response` may take.
    - `first_token_timeout`: the longest a stream may take to produce its first update,
      counted from the first `__anext__()` (so it covers connecting and the response
      headers as well). The inner stream should hold back updates that carry nothing
      (role-only deltas, keep-alives) until content arrives, since the first update is
      the one that commits the attempt.
    - `stall_timeout`: the longest a stream may stay silent between two updates. Time the
      caller spends between items is not counted.

    `None` means no limit. When a limit expires the inner call is cancelled, the inner
    stream is closed, and a `ProviderTimeoutError` (attempt timeout, kind TIMEOUT),
    `FirstTokenTimeoutError` or `StreamStallTimeoutError` from `chatroute.errors` is
    raised: all `TimeoutError`s carrying the failure kind the failover policy acts on.
    The task is left not cancelling, so a failover router treats the expiry as an
    ordinary failure and may fail over. A cancellation of the caller's task passes
    through as the `CancelledError` it is. The HTTP providers apply their own limits with
    the same functions (`within`, `stream_within`).
    `aclose()` closes `inner` unless `leave_open` is set.
    """

    def __init__(
        self,
        inner: ChatClient,
        *,
        attempt_timeout: float | None = None,
        first_token_timeout: float | None = None,
        stall_timeout: float | None = None,
        leave_open: bool = False,
    ) -> None:
        super().__init__(inner)
        if not isinstance(leave_open, bool):
            raise TypeError(f"leave_open must be a bool, got {type(leave_open).__name__}")
        self.attempt_timeout = check_limit("attempt_timeout", attempt_timeout)
        self.first_token_timeout = check_limit("first_token_timeout", first_token_timeout)
        self.stall_timeout = check_limit("stall_timeout", stall_timeout)
        self.leave_open = leave_open

    @property
    def name(self) -> str | None:
        """The inner client's `name`, when it has a str one (so wrapping keeps provider names)."""
        name = getattr(self.inner, "name", None)
        return name if isinstance(name, str) else None

    @property
    def context_window(self) -> int | None:
        """The inner client's `context_window`, when it declares an int one."""
        window = getattr(self.inner, "context_window", None)
        if isinstance(window, int) and not isinstance(window, bool):
            return window
        return None

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        return await within(
            lambda: self.inner.get_response(messages, options),
            self.attempt_timeout,
            name=self.name,
        )

    def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        inner: Any = aiter(self.inner.get_streaming_response(messages, options))
        return stream_within(
            inner,
            first_token=self.first_token_timeout,
            stall=self.stall_timeout,
            name=self.name,
        )

    async def aclose(self) -> None:
        """Close `inner` unless `leave_open` is set."""
        if not self.leave_open:
            await self.inner.aclose()
