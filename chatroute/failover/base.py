"""FailoverChatClient: the attempt loop that may move a request to another client before output."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from time import perf_counter
from typing import Any, NoReturn

from chatroute.chat.types import ChatMessage, ChatOptions, ChatResponse, ChatResponseUpdate
from chatroute.errors import is_cancelling
from chatroute.failover.attempt import FailoverChatClientAttempt
from chatroute.router.base import RoutingChatClient
from chatroute.router.context import RoutingContext

__all__ = ["FailoverChatClient"]

# What counts as a failure of an attempt (F7). Any other BaseException propagates at once.
_FAILURES = (Exception, asyncio.CancelledError)


def _raise_cancelled(failure: BaseException) -> NoReturn:
    """Raise what the caller gets for a failure that surfaced while it was cancelling (C1)."""
    if isinstance(failure, asyncio.CancelledError):
        raise failure
    raise asyncio.CancelledError() from failure


async def _close_after_interrupt(iterator: Any) -> None:
    """Best-effort close of an inner iterator while a non-failure BaseException propagates."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        # The interrupt that is already propagating takes precedence over a close failure.
        with contextlib.suppress(*_FAILURES):
            await aclose()


class FailoverChatClient(RoutingChatClient):
    """A router that selects again when an attempt fails before any output reached the caller.

    Subclasses implement `select_client` and may override `on_routing_update`, which is
    awaited once after every client invocation with the attempt record and whether the
    request ends there. `get_response` and `get_streaming_response` implement the loop
    and must not be overridden. A request moves to another selection only when the
    failure happened before output was committed, the task is not being cancelled and
    the attempt limit (`maximum_attempts_per_request`, read once per request) allows it.
    """

    _maximum_attempts_per_request: int | None = None

    @property
    def maximum_attempts_per_request(self) -> int | None:
        """The most attempts one request may make; `None` (the default) means unlimited."""
        return self._maximum_attempts_per_request

    @maximum_attempts_per_request.setter
    def maximum_attempts_per_request(self, value: int | None) -> None:
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    "maximum_attempts_per_request must be an int or None, "
                    f"got {type(value).__name__}"
                )
            if value < 1:
                raise ValueError(f"maximum_attempts_per_request must be at least 1, got {value}")
        self._maximum_attempts_per_request = value

    async def on_routing_update(
        self, context: RoutingContext, attempt: FailoverChatClientAttempt, is_terminal: bool
    ) -> None:
        """Called after every client invocation; the default does nothing.

        A nonterminal update always reports a failure before output; whatever the hook
        stores is seen by the next `select_client(context)`. Raising from a terminal
        update replaces the request's outcome; raising from a nonterminal one stops routing.
        """

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        if messages is None:
            raise TypeError("messages must not be None")
        context = RoutingContext(messages, options)
        limit = self._maximum_attempts_per_request
        clock = perf_counter
        attempts = 0
        while True:
            client = await self.select_client(context)
            if client is None:
                raise RuntimeError("select_client returned None")
            attempts += 1
            start = clock()
            try:
                response = await client.get_response(messages, context.chat_options)
            except _FAILURES as exc:
                duration = clock() - start
                failure: BaseException = exc
            else:
                duration = clock() - start
                await self.on_routing_update(
                    context,
                    FailoverChatClientAttempt(client, duration, None, None, True, False),
                    True,
                )
                return response
            cancelled = is_cancelling()
            is_terminal = cancelled or (limit is not None and attempts >= limit)
            await self.on_routing_update(
                context,
                FailoverChatClientAttempt(client, duration, None, failure, False, False),
                is_terminal,
            )
            if cancelled:
                _raise_cancelled(failure)
            if is_terminal:
                raise failure

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        if messages is None:
            raise TypeError("messages must not be None")
        context = RoutingContext(messages, options)
        limit = self._maximum_attempts_per_request
        clock = perf_counter
        attempts = 0
        while True:
            client = await self.select_client(context)
            if client is None:
                raise RuntimeError("select_client returned None")
            attempts += 1
            failure: BaseException | None = None
            ended = False  # the inner stream raised StopAsyncIteration
            time_to_first_update: float | None = None
            iterator: Any = None
            start = clock()
            duration = 0.0

            # Pre-output phase: create the stream, get its iterator, await the first item.
            try:
                iterator = aiter(client.get_streaming_response(messages, context.chat_options))
                next_item = iterator.__anext__
            except _FAILURES as exc:
                duration = clock() - start
                failure = exc
            if failure is None:
                try:
                    item = await next_item()
                except StopAsyncIteration:
                    duration = clock() - start
                    ended = True
                except _FAILURES as exc:
                    duration = clock() - start
                    failure = exc
                except BaseException:
                    await _close_after_interrupt(iterator)
                    raise
                else:
                    # Output phase: the commit point is the yield.
                    while True:
                        duration += clock() - start
                        if time_to_first_update is None:
                            time_to_first_update = duration
                        try:
                            yield item
                        except GeneratorExit:
                            break  # the caller stopped (aclose or finalisation): S7, S8
                        except BaseException as exc:
                            failure = exc  # athrow: S9
                            break
                        start = clock()
                        try:
                            item = await next_item()
                        except StopAsyncIteration:
                            duration += clock() - start
                            ended = True
                            break
                        except _FAILURES as exc:
                            duration += clock() - start
                            failure = exc
                            break
                        except BaseException:
                            await _close_after_interrupt(iterator)
                            raise

            # Cleanup, exactly once per attempt: close, report, then raise/reselect/finish.
            if iterator is not None:
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except _FAILURES as exc:
                        failure = exc
            committed = time_to_first_update is not None
            completed = ended and failure is None
            cancelled = failure is not None and is_cancelling()
            is_terminal = (
                completed or committed or cancelled or (limit is not None and attempts >= limit)
            )
            await self.on_routing_update(
                context,
                FailoverChatClientAttempt(
                    client, duration, time_to_first_update, failure, completed, committed
                ),
                is_terminal,
            )
            if failure is None:
                return
            if cancelled:
                _raise_cancelled(failure)
            if is_terminal:
                raise failure
