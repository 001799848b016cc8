"""What the conversation settings of a config build: context policy, session store, routes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from chatroute.chat.client import ChatClient
from chatroute.config import ChatrouteConfig, RoutingConfig
from chatroute.failover.breaker import BreakerState, CircuitBreakerRegistry
from chatroute.router.conversation import ContextPolicy, ConversationPolicy, LastUserPolicy
from chatroute.session.hygiene import ANTHROPIC, OPENAI, HistoryHygieneChatClient, ProviderFamily
from chatroute.session.sticky import StickyProviderChatClient
from chatroute.session.store import InMemorySessionStore, SessionStore
from chatroute.tracing import RecordingFailoverChatClient

__all__ = [
    "build_session_store",
    "context_for",
    "provider_family",
    "route_client",
]

# Builds a route's failover chain over (provider name, client) pairs in the given order.
ChainBuilder = Callable[[Sequence[tuple[str, ChatClient]]], RecordingFailoverChatClient]


def context_for(routing: RoutingConfig) -> ContextPolicy:
    """The context policy `routing.context` names, with `routing.conversation`'s parameters."""
    if routing.context == "last_user":
        return LastUserPolicy()
    return ConversationPolicy(**routing.conversation.model_dump())


def provider_family(provider_type: str) -> ProviderFamily:
    """The history family of a provider type: `anthropic` for the Anthropic Messages API,
    `openai` for every OpenAI-compatible type."""
    return ANTHROPIC if provider_type == ANTHROPIC else OPENAI


def build_session_store(config: ChatrouteConfig, environ: Mapping[str, str]) -> SessionStore | None:
    """The session store `sessions` describes: in Redis when `shared_state` names a Redis
    URL, else in this process; None when sessions are off."""
    settings = config.sessions
    if not settings.enabled:
        return None
    url = config.shared_state.redis_url(environ)
    if url is None:
        return InMemorySessionStore(max_sessions=settings.max_sessions, ttl=settings.ttl)
    from chatroute.session.redis_store import RedisSessionStore

    return RedisSessionStore(
        url,
        prefix=config.shared_state.key_prefix,
        ttl=settings.ttl,
        timeout=settings.redis_timeout,
        retry_after=settings.redis_retry_after,
    )


def route_client(
    route: str,
    members: Sequence[tuple[str, ChatClient]],
    families: Mapping[str, ProviderFamily],
    chain: ChainBuilder,
    *,
    store: SessionStore | None,
    breakers: CircuitBreakerRegistry,
) -> tuple[ChatClient, RecordingFailoverChatClient]:
    """A route's client and its failover chain in the configured order.

    Each provider is wrapped in a `HistoryHygieneChatClient` of its family. With a store,
    the route's client is a `StickyProviderChatClient` that puts a conversation's provider
    first while its breaker is closed (one chain per distinct order, all sharing the
    breakers); without one it is the chain itself.
    """
    cleaned = [(name, HistoryHygieneChatClient(client, families[name])) for name, client in members]
    if store is None:
        built = chain(cleaned)
        return built, built
    chains: list[RecordingFailoverChatClient] = []

    def ordered(order: Sequence[tuple[str, ChatClient]]) -> ChatClient:
        made = chain(order)
        chains.append(made)
        return made

    sticky = StickyProviderChatClient(
        route,
        cleaned,
        store,
        ordered,
        healthy=lambda name: breakers.get(name).state is BreakerState.CLOSED,
        families=families,
    )
    sticky.chain_for(None)  # the configured order's chain, built first
    return sticky, chains[0]
