"""Sticky sessions: a conversation stays on the provider that served it while that one is healthy.

The server opens a `SessionScope` per request (`bind_session`), naming the conversation's key
when the request carries one in a header; the route's `StickyProviderChatClient` reads the
stored record, puts the conversation's provider first in the route's failover order while it
is healthy, records which provider answered, and writes the outcome into the scope
(`new`, `kept`, `switched`, `failover`) for the answer's headers.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from chatroute.chat.client import ChatClient, DelegatingChatClient
from chatroute.chat.types import ChatMessage, ChatOptions, ChatResponse, ChatResponseUpdate
from chatroute.router.base import close_iterator
from chatroute.session.keys import conversation_key
from chatroute.session.store import SessionRecord, SessionStore

__all__ = [
    "ChainFactory",
    "SessionScope",
    "StickyOutcome",
    "StickyProviderChatClient",
    "bind_session",
    "current_session",
    "request_conversation_key",
]

StickyOutcome = Literal["new", "kept", "switched", "failover"]

# Builds a route's failover client over (provider name, client) pairs in the given order.
ChainFactory = Callable[[Sequence[tuple[str, ChatClient]]], ChatClient]


@dataclass(slots=True, eq=False)
class SessionScope:
    """One request's session: the key it came with (None: derive it from the request) and,
    once its sticky route has run, the outcome, the provider that answered, the record
    found, and the family of the provider that produced the conversation's earlier turns."""

    key: str | None = None
    outcome: StickyOutcome | None = None
    route: str | None = None
    provider: str | None = None
    previous: SessionRecord | None = None

    @property
    def history_family(self) -> str | None:
        """The family ("openai", "anthropic") of the provider that served the last turn."""
        return None if self.previous is None else self.previous.family


_SCOPE: contextvars.ContextVar[SessionScope | None] = contextvars.ContextVar(
    "chatroute_session_scope", default=None
)


def bind_session(scope: SessionScope) -> contextvars.Token[SessionScope | None]:
    """Make `scope` the current request's session (before the chat call or the stream's first
    iteration); returns the token for `ContextVar.reset`-style unbinding via `unbind`."""
    if not isinstance(scope, SessionScope):
        raise TypeError("scope must be a SessionScope")
    return _SCOPE.set(scope)


def current_session() -> SessionScope | None:
    """The session scope bound for the current request, if any."""
    return _SCOPE.get()


def request_conversation_key(
    messages: Sequence[ChatMessage], options: ChatOptions | None
) -> str | None:
    """The conversation key a request carries by itself: its `user`, else its
    `prompt_cache_key` (an additional property), with its opening messages."""
    if options is None:
        return None
    cache_key = (options.additional_properties or {}).get("prompt_cache_key")
    return conversation_key(
        messages,
        user=options.user if isinstance(options.user, str) else None,
        prompt_cache_key=cache_key if isinstance(cache_key, str) else None,
    )


@dataclass(slots=True, eq=False)
class _Call:
    served: str | None = None


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "chatroute_sticky_call", default=None
)


class _ProviderTap(DelegatingChatClient):
    """Notes its provider's name on the current sticky call once it has answered."""

    def __init__(self, name: str, inner: ChatClient) -> None:
        super().__init__(inner)
        self.name = name

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        response = await self.inner.get_response(messages, options)
        call = _CALL.get()
        if call is not None:
            call.served = self.name
        return response

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        call = _CALL.get()
        iterator = aiter(self.inner.get_streaming_response(messages, options))
        try:
            async for update in iterator:
                if call is not None and call.served is None:
                    call.served = self.name
                yield update
        finally:
            await close_iterator(iterator)

    async def aclose(self) -> None:  # the sticky client does not own the providers
        return None


class StickyProviderChatClient(ChatClient):
    """A route's providers, with each conversation kept on the provider that served it.

    `providers` is the route's failover order as (name, client) pairs (or a mapping, in
    order); `chain` builds the route's failover client for an order (called once per
    distinct order, the result kept). Per request the conversation key is the bound
    scope's `key`, else `key(messages, options)`; with none the route runs in its
    configured order and no outcome is reported. With a key, the stored record decides:

    - none: configured order, outcome `new`;
    - another route: configured order, `switched`;
    - this route, its provider healthy (`healthy(name)`): that provider first, `kept`
      (or `failover` when another provider ends up answering);
    - this route, its provider not healthy or no longer in the route: `failover`.

    After an answer the record (route, provider, family from `families`) is written back.
    The store is asked once per request and never raises (see `SessionStore`). The client
    owns neither the providers nor the store.
    """

    def __init__(
        self,
        route: str,
        providers: Sequence[tuple[str, ChatClient]] | Mapping[str, ChatClient],
        store: SessionStore,
        chain: ChainFactory,
        *,
        healthy: Callable[[str], bool] | None = None,
        families: Mapping[str, str] | None = None,
        key: Callable[
            [Sequence[ChatMessage], ChatOptions | None], str | None
        ] = request_conversation_key,
    ) -> None:
        if not isinstance(route, str) or not route:
            raise ValueError("route must be a non-empty str")
        pairs = list(providers.items()) if isinstance(providers, Mapping) else list(providers)
        if not pairs:
            raise ValueError("providers must name at least one provider")
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"provider names must be distinct, got {names}")
        for name, client in pairs:
            if not isinstance(name, str) or not isinstance(client, ChatClient):
                raise TypeError("providers must be (str, ChatClient) pairs")
        if store is None or not callable(getattr(store, "get", None)):
            raise TypeError("store must be a SessionStore")
        if not callable(chain):
            raise TypeError("chain must be callable")
        self.route = route
        self._taps = [(name, _ProviderTap(name, client)) for name, client in pairs]
        self._names = tuple(names)
        self._store = store
        self._chain = chain
        self._healthy = healthy or (lambda _name: True)
        self._families = dict(families or {})
        self._key = key
        self._chains: dict[tuple[str, ...], ChatClient] = {}

    @property
    def provider_names(self) -> tuple[str, ...]:
        """The route's providers in their configured order."""
        return self._names

    def chain_for(self, first: str | None) -> ChatClient:
        """The failover client with `first` moved to the front (configured order for None)."""
        order = list(self._taps)
        if first is not None:
            order.sort(key=lambda pair: pair[0] != first)
        names = tuple(name for name, _ in order)
        found = self._chains.get(names)
        if found is None:
            found = self._chains[names] = self._chain(order)
        return found

    async def _plan(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None
    ) -> tuple[SessionScope, str | None, ChatClient]:
        scope = _SCOPE.get() or SessionScope()
        scope.route = self.route
        key = scope.key if scope.key is not None else self._key(messages, options)
        scope.key = key
        if key is None:
            return scope, None, self.chain_for(None)
        record = await self._store.get(key)
        scope.previous = record
        first: str | None = None
        if record is None:
            scope.outcome = "new"
        elif record.route != self.route:
            scope.outcome = "switched"
        elif record.provider in self._names and self._healthy(record.provider):
            scope.outcome = "kept"
            first = record.provider
        else:
            scope.outcome = "failover"
        return scope, key, self.chain_for(first)

    async def _settle(self, scope: SessionScope, key: str | None, call: _Call) -> None:
        scope.provider = call.served
        if key is None or call.served is None:
            return
        previous = scope.previous
        if scope.outcome == "kept" and previous is not None and call.served != previous.provider:
            scope.outcome = "failover"
        # Written on every answer, so the record's time to live runs from the last turn.
        await self._store.put(
            key, SessionRecord(self.route, call.served, self._families.get(call.served))
        )

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        scope, key, chain = await self._plan(messages, options)
        call = _Call()
        token = _CALL.set(call)
        try:
            response = await chain.get_response(messages, options)
        finally:
            _CALL.reset(token)
        await self._settle(scope, key, call)
        return response

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        scope, key, chain = await self._plan(messages, options)
        call = _Call()
        _CALL.set(call)  # not reset: later iterations may run in another task's context copy
        iterator = aiter(chain.get_streaming_response(messages, options))
        settled = False
        try:
            async for update in iterator:
                if not settled and call.served is not None:
                    settled = True
                    await self._settle(scope, key, call)
                yield update
        finally:
            await close_iterator(iterator)

    async def aclose(self) -> None:
        """Owns nothing: the providers and the store belong to the caller."""
