"""Sessions: conversation keys, session stores, sticky providers and history hygiene."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from chatroute.session.hygiene import (
    ANTHROPIC,
    OPENAI,
    HistoryHygieneChatClient,
    ProviderFamily,
    clean_history,
    reasoning_family,
)
from chatroute.session.keys import conversation_key
from chatroute.session.sticky import (
    ChainFactory,
    SessionScope,
    StickyOutcome,
    StickyProviderChatClient,
    bind_session,
    current_session,
    request_conversation_key,
)
from chatroute.session.store import InMemorySessionStore, SessionRecord, SessionStore

if TYPE_CHECKING:
    from chatroute.session.redis_store import RedisSessionStore


def __getattr__(name: str) -> Any:
    # The Redis store needs the `redis` extra: loaded only when asked for.
    if name == "RedisSessionStore":
        return importlib.import_module("chatroute.session.redis_store").RedisSessionStore
    raise AttributeError(f"module 'chatroute.session' has no attribute {name!r}")


__all__ = [
    "ANTHROPIC",
    "OPENAI",
    "ChainFactory",
    "HistoryHygieneChatClient",
    "InMemorySessionStore",
    "ProviderFamily",
    "RedisSessionStore",
    "SessionRecord",
    "SessionScope",
    "SessionStore",
    "StickyOutcome",
    "StickyProviderChatClient",
    "bind_session",
    "clean_history",
    "conversation_key",
    "current_session",
    "reasoning_family",
    "request_conversation_key",
]
