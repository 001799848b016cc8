"""Per-attempt time limits as a wrapping ChatClient, and the request-deadline error."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

from chatroute._timer import timeout
from chatroute.chat.client import ChatClient, DelegatingChatClient
from chatroute.chat.types import ChatMessage, ChatOptions, ChatResponse, ChatResponseUpdate

__all__ = ["DeadlineExceededError", "TimeoutChatClient"]

# The errors raised here are the provider error classes of `chatroute.providers.errors`, so
# that one hierarchy (and one classification table) covers every timeout. That module is
# imported only when a limit expires, which keeps this one importable without the HTTP
# and SDK stack.


class DeadlineExceededError(TimeoutError):
    """The whole request ran out of time before another attempt could start.

    `deadline` is the request deadline in seconds.
    """

    def __init__(self, deadline: float, message: str | None = None) -> None:
        self.deadline = deadline
        super().__init__(message or f"the request deadline of {deadline:g} s was exceeded")


def _limit(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds or None, got {type(value).__name__}")
    number = float(value)
    if math.isnan(number) or number <= 0:
        raise ValueError(f"{name} must be > 0 seconds (or None for no limit), got {value!r}")
    return None if math.isinf(number) else number


def _is_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


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
    `FirstTokenTimeoutError` or `StreamStallTimeoutError` from `chatroute.providers.errors`
    is raised: all `TimeoutError`s carrying the failure kind the failover policy acts on.
    The task is left not cancelling, so a failover router treats the expiry as an
    ordinary failure and may fail over. A cancellation of the caller's task passes
    through as the `CancelledError` it is.
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
        self.attempt_timeout = _limit("attempt_timeout", attempt_timeout)
        self.first_token_timeout = _limit("first_token_timeout", first_token_timeout)
        self.stall_timeout = _limit("stall_timeout", stall_timeout)
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
        limit = self.attempt_timeout
        if limit is None:
            return await self.inner.get_response(messages, options)
        timer = timeout(limit)
        try:
            async with timer:
                return await self.inner.get_response(messages, options)
        except (Exception, asyncio.CancelledError) as exc:
            if timer.expired() and not _is_cancelling():
                from chatroute.providers.errors import ProviderTimeoutError

                raise ProviderTimeoutError(
                    f"no answer within the attempt timeout of {limit:g} s", provider=self.name
                ) from exc
            raise

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        iterator: Any = aiter(self.inner.get_streaming_response(messages, options))
        try:
            first = True
            while True:
                limit = self.first_token_timeout if first else self.stall_timeout
                if limit is None:
                    try:
                        item = await anext(iterator)
                    except StopAsyncIteration:
                        return
                else:
                    timer = timeout(limit)
                    try:
                        async with timer:
                            item = await anext(iterator)
                    except StopAsyncIteration:
                        return
                    except (Exception, asyncio.CancelledError) as exc:
                        if timer.expired() and not _is_cancelling():
                            from chatroute.providers.errors import (
                                FirstTokenTimeoutError,
                                StreamStallTimeoutError,
                            )

                            if first:
                                raise FirstTokenTimeoutError(
                                    f"no first update within {limit:g} s", provider=self.name
                                ) from exc
                            raise StreamStallTimeoutError(
                                f"the stream stalled for {limit:g} s", provider=self.name
                            ) from exc
                        raise
                first = False
                yield item
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    async def aclose(self) -> None:
        """Close `inner` unless `leave_open` is set."""
        if not self.leave_open:
            await self.inner.aclose()
