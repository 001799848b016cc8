"""RoutingContext: the per-request inputs a routing policy sees, with one options clone."""

from __future__ import annotations

from collections.abc import Sequence

from chatroute.chat.types import ChatMessage, ChatOptions

__all__ = ["RoutingContext"]


class RoutingContext:
    """One request's messages (the caller's object) and a clone of its options.

    Compares and hashes by identity and supports weak references, so per-request policy
    state can be keyed by it (preferably in a `weakref.WeakKeyDictionary`).
    """

    __slots__ = ("__weakref__", "_chat_options", "_messages")

    def __init__(self, messages: Sequence[ChatMessage], chat_options: ChatOptions | None) -> None:
        if messages is None:
            raise TypeError("messages must not be None")
        try:
            iterator: object = iter(messages)
            one_shot = iterator is messages
        except TypeError:
            raise TypeError("messages must be a sequence of ChatMessage") from None
        if one_shot:
            raise TypeError("messages must be a re-iterable sequence, not a one-shot iterator")
        self._messages = messages
        self._chat_options = chat_options.clone() if chat_options is not None else None

    @property
    def messages(self) -> Sequence[ChatMessage]:
        """The caller's messages object itself."""
        return self._messages

    @property
    def chat_options(self) -> ChatOptions | None:
        """The clone of the caller's options taken at construction (None if none were given)."""
        return self._chat_options
