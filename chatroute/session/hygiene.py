"""History hygiene: drop reasoning from earlier turns that another provider family cannot take."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Final, Literal

from chatroute.chat.client import ChatClient, DelegatingChatClient
from chatroute.chat.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    TextReasoningContent,
)
from chatroute.session.sticky import current_session

__all__ = [
    "ANTHROPIC",
    "OPENAI",
    "HistoryHygieneChatClient",
    "ProviderFamily",
    "clean_history",
    "reasoning_family",
]

ProviderFamily = Literal["openai", "anthropic"]
OPENAI: Final = "openai"
ANTHROPIC: Final = "anthropic"
_FAMILIES = (OPENAI, ANTHROPIC)

# Assistant-message properties in which OpenAI-compatible providers hand back reasoning
# (plain or encrypted); they are sent back as is, so only the same family may see them.
OPENAI_REASONING_PROPERTIES: Final = frozenset(
    {"reasoning", "reasoning_content", "reasoning_details", "encrypted_content"}
)


def reasoning_family(content: TextReasoningContent) -> ProviderFamily:
    """Which family a reasoning part comes from when nothing else says: a part with
    `protected_data` (a signature, or redacted data) is Anthropic's, any other OpenAI's."""
    return ANTHROPIC if content.protected_data else OPENAI


def _check_family(name: str, value: object) -> None:
    if value not in _FAMILIES:
        raise ValueError(f"{name} must be one of {_FAMILIES}, got {value!r}")


def clean_history(
    messages: Sequence[ChatMessage],
    target: ProviderFamily,
    *,
    source: ProviderFamily | None = None,
) -> Sequence[ChatMessage]:
    """`messages` as a provider of family `target` can take them.

    In assistant messages, reasoning parts produced by the other family are dropped (for
    `target` "anthropic": OpenAI reasoning, and reasoning properties such as
    `reasoning_content`; for "openai": Anthropic thinking with its signature and redacted
    thinking). `source` is the family that produced the earlier turns when known (for
    example from the conversation's session record), else each part's family is read
    from the part (`reasoning_family`). Visible text, tool calls and every other message
    are kept. The caller's list and messages are never changed: a message that loses
    something is copied, and when nothing changes `messages` itself is returned.
    """
    _check_family("target", target)
    if source is not None:
        _check_family("source", source)
    cleaned: list[ChatMessage] | None = None
    for position, message in enumerate(messages):
        replacement = (
            _clean(message, target, source) if message.role is ChatRole.ASSISTANT else None
        )
        if replacement is not None and cleaned is None:
            cleaned = list(messages[:position])
        if cleaned is not None:
            cleaned.append(message if replacement is None else replacement)
    return messages if cleaned is None else cleaned


def _clean(
    message: ChatMessage, target: ProviderFamily, source: ProviderFamily | None
) -> ChatMessage | None:
    """A copy of an assistant message without what `target` cannot take; None if unchanged."""
    contents = [
        content
        for content in message.contents
        if not isinstance(content, TextReasoningContent)
        or (source or reasoning_family(content)) == target
    ]
    properties = message.additional_properties
    if (
        properties
        and target == ANTHROPIC
        and not OPENAI_REASONING_PROPERTIES.isdisjoint(properties)
    ):
        properties = {k: v for k, v in properties.items() if k not in OPENAI_REASONING_PROPERTIES}
    if len(contents) == len(message.contents) and properties is message.additional_properties:
        return None
    return ChatMessage(
        message.role,
        contents=contents,
        author_name=message.author_name,
        additional_properties=properties or None,
    )


class HistoryHygieneChatClient(DelegatingChatClient):
    """Forwards to a provider of family `family` the history it can take (`clean_history`).

    `source()` names the family that produced the conversation's earlier turns when it is
    known (by default the bound session's record: the provider that last served the
    conversation); otherwise each reasoning part's own family decides.
    """

    def __init__(
        self,
        inner: ChatClient,
        family: ProviderFamily,
        *,
        source: Callable[[], ProviderFamily | None] | None = None,
    ) -> None:
        super().__init__(inner)
        _check_family("family", family)
        self.family: ProviderFamily = family
        self._source = source or _session_family

    def _messages(self, messages: Sequence[ChatMessage]) -> Sequence[ChatMessage]:
        if messages is None:
            raise TypeError("messages must not be None")
        source = self._source()
        return clean_history(messages, self.family, source=source if source in _FAMILIES else None)

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        return await self.inner.get_response(self._messages(messages), options)

    def get_streaming_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        return self.inner.get_streaming_response(self._messages(messages), options)


def _session_family() -> ProviderFamily | None:
    scope = current_session()
    family = None if scope is None else scope.history_family
    return family if family in _FAMILIES else None  # type: ignore[return-value]
