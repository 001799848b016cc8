"""Sticky sessions in the service: each chat request's session scope and its answer header."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Final

from starlette.types import Scope

from chatroute.chat.types import ChatMessage
from chatroute.engine import Engine
from chatroute.session.keys import conversation_key
from chatroute.session.sticky import SessionScope, bind_session

__all__ = ["SESSION_HEADER", "STICKY_HEADER", "StickyHeaders", "open_session"]

SESSION_HEADER: Final = "x-chatroute-session"
STICKY_HEADER: Final = "x-chatroute-sticky"
_SESSION_HEADER_KEY: Final = SESSION_HEADER.encode("latin-1")


def open_session(
    engine: Engine, scope: Scope, messages: Sequence[ChatMessage]
) -> SessionScope | None:
    """Bind a session scope for this request when sessions are on (None when they are off).

    Its key is the `x-chatroute-session` header's (kept short and ASCII, else hashed) when
    the request has one; otherwise the route's sticky client derives it from the request's
    `user` or `prompt_cache_key` and its opening messages.
    """
    if engine.sessions is None:
        return None
    raw: str | None = None
    for name, value in scope["headers"]:
        if name == _SESSION_HEADER_KEY:
            raw = value.decode("latin-1")
            break
    session = SessionScope(key=conversation_key(messages, session=raw) if raw else None)
    bind_session(session)
    return session


class StickyHeaders(Mapping[str, str]):
    """Extra answer headers plus `x-chatroute-sticky: new|kept|switched|failover`, read
    when the headers are written: present once a provider of the route has answered."""

    def __init__(self, base: Mapping[str, str], session: SessionScope) -> None:
        self._base = base
        self._session = session

    def _all(self) -> dict[str, str]:
        headers = dict(self._base)
        session = self._session
        if session.outcome is not None and session.provider is not None:
            headers[STICKY_HEADER] = session.outcome
        return headers

    def __getitem__(self, key: str) -> str:
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())
