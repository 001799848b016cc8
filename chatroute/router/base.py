"""RoutingChatClient: a ChatClient that picks one backend client per request."""

from __future__ import annotations

import asyncio
import inspect
from abc import abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

from chatroute.chat.client import ChatClient
from chatroute.chat.types import ChatMessage, ChatOptions, ChatResponse, ChatResponseUpdate
from chatroute.router.context import RoutingContext

__all__ = ["RoutingChatClient", "close_each_once", "close_iterator", "snapshot_clients"]

Selector = Callable[[RoutingContext], "ChatClient | Awaitable[ChatClient]"]


async def close_iterator(iterator: Any) -> None:
    """Await `iterator.aclose()` when the iterator has one."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


async def close_each_once(clients: Iterable[Any]) -> None:
    """Close each distinct object (by identity) once, in order; a failing close does not stop
    the others, and the first failure is re-raised after all were tried."""
    first_failure: BaseException | None = None
    seen: set[int] = set()
    for client in clients:
        if id(client) in seen:
            continue
        seen.add(id(client))
        try:
            await client.aclose()
        except (Exception, asyncio.CancelledError) as exc:
            if first_failure is None:
                first_failure = exc
    if first_failure is not None:
        raise first_failure


def snapshot_clients(clients: Iterable[ChatClient]) -> tuple[ChatClient, ...]:
    """The clients as a tuple, after the checks every multi-client router makes."""
    if clients is None:
        raise TypeError("clients must not be None")
    if isinstance(clients, str | bytes):
        raise TypeError("clients must be an iterable of ChatClient, not a string")
    try:
        snapshot = tuple(clients)
    except TypeError:
        raise TypeError(
            f"clients must be an iterable of ChatClient, got {type(clients).__name__}"
        ) from None
    if not snapshot:
        raise ValueError("clients must contain at least one client")
    for position, client in enumerate(snapshot):
        if client is None:
            raise ValueError(f"clients[{position}] is None")
        if not (hasattr(client, "get_response") and hasattr(client, "get_streaming_response")):
            raise TypeError(f"clients[{position}] is not a chat client: {type(client).__name__}")
    return snapshot


def _check_selected(client: ChatClient | None) -> ChatClient:
    if client is None:
        raise RuntimeError("select_client returned None")
    return client


class RoutingChatClient(ChatClient):
    """Makes one selection per request (or per stream iteration) and dispatches to it.

    Subclasses implement `select_client`. The base never retries, keeps no state, owns
    nothing and passes responses, updates and exceptions through untouched.
    """

    @abstractmethod
    async def select_client(self, context: RoutingContext) -> ChatClient:
        """Choose the client that answers the request described by `context`."""

    @staticmethod
    def create(selector: Selector) -> RoutingChatClient:
        """A router whose selection is `selector(context)` (a plain or coroutine function)."""
        if selector is None or not callable(selector):
            raise TypeError("selector must be a callable")
        return _CallbackRoutingChatClient(selector)

    async def _select(self, context: RoutingContext) -> ChatClient:
        return _check_selected(await self.select_client(context))

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        if messages is None:
            raise TypeError("messages must not be None")
        context = RoutingContext(messages, options)
        selected = await self._select(context)
        return await selected.get_response(context.messages, context.chat_options)

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        if messages is None:
            raise TypeError("messages must not be None")
        context = RoutingContext(messages, options)
        selected = await self._select(context)
        stream = selected.get_streaming_response(context.messages, context.chat_options)
        iterator: AsyncIterator[ChatResponseUpdate] | None = None
        try:
            iterator = aiter(stream)
            while True:
                try:
                    item = await anext(iterator)
                except StopAsyncIteration:
                    break
                yield item
        finally:
            if iterator is not None:
                await close_iterator(iterator)


class _CallbackRoutingChatClient(RoutingChatClient):
    """The router built by `RoutingChatClient.create`."""

    def __init__(self, selector: Selector) -> None:
        self._selector = selector

    async def select_client(self, context: RoutingContext) -> ChatClient:
        result = self._selector(context)
        if inspect.isawaitable(result):
            result = await result
        return result  # type: ignore[return-value]
