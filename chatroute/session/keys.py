"""Conversation keys: which stored session a chat request belongs to, never holding raw ids."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from chatroute.chat.types import ChatMessage, ChatRole

__all__ = ["MAX_RAW_SESSION_KEY", "conversation_key"]

# A session header value this long or shorter, made of these characters, is kept as given
# (prefixed); anything else is hashed, so a stored key is always short, ASCII and opaque.
MAX_RAW_SESSION_KEY = 128
_RAW_OK = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.:")


def _digest(*parts: str) -> str:
    hasher = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        hasher.update(len(data).to_bytes(8, "little"))
        hasher.update(data)
    return hasher.hexdigest()


def _opening(messages: Sequence[ChatMessage]) -> list[str]:
    """Role and text of the messages up to and including the first user message."""
    parts: list[str] = []
    for message in messages:
        parts.append(message.role.value)
        parts.append(message.text)
        if message.role is ChatRole.USER:
            break
    return parts


def conversation_key(
    messages: Sequence[ChatMessage],
    *,
    session: str | None = None,
    user: str | None = None,
    prompt_cache_key: str | None = None,
) -> str | None:
    """The key of the conversation a request belongs to, or None when it names none.

    - `session` (the `x-chatroute-session` header): kept as `s:<value>` when it is at most
      128 characters of `A-Z a-z 0-9 - _ . :`, else hashed (`s#<hash>`).
    - else `user`, else `prompt_cache_key`, hashed together with the messages up to and
      including the first user message (the conversation's opening, the same in every
      later request of it): `u#<hash>`. The caller's id is never stored raw.
    - None when neither is given: such a request is routed without a session.
    """
    if session is not None and session != "":
        if len(session) <= MAX_RAW_SESSION_KEY and _RAW_OK.issuperset(session):
            return f"s:{session}"
        return f"s#{_digest(session)}"
    owner = user or prompt_cache_key
    if not owner:
        return None
    kind = "user" if user else "cache"
    return f"u#{_digest(kind, owner, *_opening(messages))}"
