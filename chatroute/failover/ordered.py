"""OrderedFailoverChatClient: try a fixed list of clients in order, moving on when one fails."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from chatroute.chat.client import ChatClient
from chatroute.failover.attempt import FailoverChatClientAttempt
from chatroute.failover.base import FailoverChatClient
from chatroute.router.base import close_each_once, snapshot_clients
from chatroute.router.context import RoutingContext

__all__ = ["OrderedFailoverChatClient"]


class OrderedFailoverChatClient(FailoverChatClient):
    """Sends each request to the first client, then to the next one after each failover.

    Every request starts at position 0; nothing is remembered between requests. The
    position of a request that has failed over is kept, keyed weakly by its
    `RoutingContext`, only until the request ends. When the list is exhausted the last
    failure is re-raised. `aclose()` closes each distinct client once unless
    `leave_open` is set. Subclasses that override `select_client` or
    `on_routing_update` must call `super()`.
    """

    def __init__(self, clients: Iterable[ChatClient], *, leave_open: bool = False) -> None:
        snapshot = snapshot_clients(clients)
        if not isinstance(leave_open, bool):
            raise TypeError(f"leave_open must be a bool, got {type(leave_open).__name__}")
        self._clients: tuple[ChatClient, ...] = snapshot
        self._leave_open = leave_open
        self._positions: weakref.WeakKeyDictionary[RoutingContext, int] = (
            weakref.WeakKeyDictionary()
        )
        self._closed = False

    @property
    def clients(self) -> tuple[ChatClient, ...]:
        """The clients in the order they are tried (a snapshot taken at construction)."""
        return self._clients

    @property
    def leave_open(self) -> bool:
        """Whether `aclose()` leaves the clients open."""
        return self._leave_open

    async def select_client(self, context: RoutingContext) -> ChatClient:
        """The client at the request's current position (the first one until it fails over)."""
        if context is None:
            raise TypeError("context must not be None")
        if not isinstance(context, RoutingContext):
            raise TypeError(f"context must be a RoutingContext, got {type(context).__name__}")
        positions = self._positions
        # No entry exists until a request's first failure, so most lookups skip the dict.
        return self._clients[positions.get(context, 0) if positions else 0]

    async def on_routing_update(
        self, context: RoutingContext, attempt: FailoverChatClientAttempt, is_terminal: bool
    ) -> None:
        """Drop the request's state when it ends; otherwise advance, or re-raise at the end."""
        if context is None:
            raise TypeError("context must not be None")
        positions = self._positions
        if is_terminal:
            if positions:
                positions.pop(context, None)
            return
        following = positions.get(context, 0) + 1
        if following < len(self._clients):
            positions[context] = following
            return
        positions.pop(context, None)
        failure = attempt.exception
        if failure is None:  # a nonterminal update always carries a failure (H2)
            raise RuntimeError("a nonterminal routing update carried no exception")
        raise failure

    async def aclose(self) -> None:
        """Discard all state and close each distinct client once, unless `leave_open` is set.

        Idempotent. If a client's `aclose()` fails, the others are still closed and the
        first failure is re-raised afterwards.
        """
        self._positions.clear()
        if self._closed:
            return
        self._closed = True
        if self._leave_open:
            return
        await close_each_once(self._clients)
