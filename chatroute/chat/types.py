"""Message, content, options and response types shared by every chat client."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "ChatFinishReason",
    "ChatMessage",
    "ChatOptions",
    "ChatResponse",
    "ChatResponseUpdate",
    "ChatRole",
    "Content",
    "DataContent",
    "FunctionCallContent",
    "FunctionResultContent",
    "HostedFileContent",
    "TextContent",
    "TextReasoningContent",
    "UriContent",
    "UsageDetails",
    "carries_content",
]


class ChatRole(str, Enum):
    """The author of a chat message."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class ChatFinishReason(str, Enum):
    """Why a model stopped producing output."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CONTENT_FILTER = "content_filter"


@dataclass
class Content:
    """Base class of the parts a message or an update is made of."""


@dataclass
class TextContent(Content):
    """Plain text."""

    text: str


@dataclass
class TextReasoningContent(Content):
    """Reasoning ("thinking") text that a model produced besides its answer.

    `protected_data` is what the provider needs to accept the reasoning back in a later
    turn (Anthropic's thinking signature, or the data of a redacted thinking block, whose
    `text` is then empty); None when there is none.
    """

    text: str
    protected_data: str | None = None


@dataclass
class FunctionCallContent(Content):
    """A tool call requested by the model; `arguments` is the raw JSON text (possibly partial)."""

    call_id: str | None
    name: str | None
    arguments: str = ""
    index: int | None = None


@dataclass
class FunctionResultContent(Content):
    """The result of a tool call, sent back to the model."""

    call_id: str
    result: Any


def _media_type_of(uri: str) -> str:
    """The media type of a base64 `data:` URI; ValueError for anything else."""
    if not uri.startswith("data:"):
        raise ValueError("a data URI starts with 'data:'")
    header, sep, _ = uri.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError("a data URI needs ';base64,' before its data")
    media_type = header[5:-7].split(";", 1)[0].strip().lower()
    if media_type.count("/") != 1 or " " in media_type or media_type.startswith("/"):
        raise ValueError(f"a data URI needs a media type such as image/png, got {media_type!r}")
    return media_type


@dataclass(init=False)
class DataContent(Content):
    """Inline data (an image, audio, a document) as a base64 `data:` URI.

    The URI is kept as given, so a request passes through a gateway without its data being
    decoded and encoded again; `data` decodes it when asked. `name` is a file name, where
    the format carries one; `additional_properties` holds what a wire format attaches to
    the part (OpenAI's image `detail`, for one).
    """

    uri: str
    media_type: str
    name: str | None
    additional_properties: dict[str, Any] | None

    def __init__(
        self,
        uri: str,
        *,
        name: str | None = None,
        additional_properties: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(uri, str):
            raise TypeError(f"uri must be a str, got {type(uri).__name__}")
        self.media_type = _media_type_of(uri)
        self.uri = uri
        self.name = name
        self.additional_properties = additional_properties

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        media_type: str,
        *,
        name: str | None = None,
        additional_properties: dict[str, Any] | None = None,
    ) -> DataContent:
        """Content from raw bytes and their media type."""
        encoded = base64.b64encode(data).decode("ascii")
        return cls(
            f"data:{media_type};base64,{encoded}",
            name=name,
            additional_properties=additional_properties,
        )

    @property
    def base64_data(self) -> str:
        """The base64 text after the URI's comma."""
        return self.uri.partition(",")[2]

    @property
    def data(self) -> bytes:
        """The decoded bytes; ValueError when the base64 text is not valid."""
        try:
            return base64.b64decode(self.base64_data, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"the data URI's base64 text is not valid: {exc}") from None

    def has_top_level_media_type(self, top: str) -> bool:
        """Whether the media type is `top`/* (image, audio, ...)."""
        return self.media_type.startswith(top + "/")

    def __repr__(self) -> str:  # the data itself can be megabytes
        return (
            f"DataContent(media_type={self.media_type!r}, "
            f"{len(self.base64_data)} base64 characters, name={self.name!r})"
        )


@dataclass
class UriContent(Content):
    """Content referred to by URL (an image on the web); `media_type` when it is known."""

    uri: str
    media_type: str | None = None
    additional_properties: dict[str, Any] | None = None


@dataclass
class HostedFileContent(Content):
    """A file already uploaded to the provider, by the provider's id for it."""

    file_id: str
    name: str | None = None


@dataclass
class UsageDetails:
    """Token accounting reported by a provider."""

    input_token_count: int | None = None
    output_token_count: int | None = None
    total_token_count: int | None = None
    additional_counts: dict[str, int] = field(default_factory=dict)
    # Of the input tokens, those read from the provider's prompt cache; of the output
    # tokens, those spent on reasoning. None where the provider does not say.
    cached_input_token_count: int | None = None
    reasoning_token_count: int | None = None


def _text_of(contents: Iterable[Content]) -> str:
    return "".join(c.text for c in contents if isinstance(c, TextContent))


class ChatMessage:
    """A role and a list of contents; `.text` joins the text parts with no separator."""

    __slots__ = ("additional_properties", "author_name", "contents", "role")

    def __init__(
        self,
        role: ChatRole | str,
        text: str | None = None,
        contents: Sequence[Content] | None = None,
        *,
        author_name: str | None = None,
        additional_properties: dict[str, Any] | None = None,
    ) -> None:
        if role is None:
            raise TypeError("role must not be None")
        self.role: ChatRole = role if isinstance(role, ChatRole) else ChatRole(role)
        if text is not None and not isinstance(text, str):
            raise TypeError("text must be a str")
        parts: list[Content] = list(contents) if contents is not None else []
        if text is not None:
            parts.insert(0, TextContent(text))
        self.contents: list[Content] = parts
        self.author_name = author_name
        self.additional_properties = additional_properties

    @property
    def text(self) -> str:
        """The text parts joined with no separator; other contents are ignored."""
        return _text_of(self.contents)

    def __repr__(self) -> str:
        return f"ChatMessage(role={self.role.value!r}, text={self.text!r})"


@dataclass
class ChatOptions:
    """Per-request options; mutable, and `clone()` is shallow."""

    model_id: str | None = None
    instructions: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    stop_sequences: list[str] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: Any = None
    reasoning: Any = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None
    additional_properties: dict[str, Any] | None = None
    # The names in `additional_properties` the caller sent as fields chatroute does not
    # know: a provider forwards them only as its `pass_through` setting allows.
    pass_through_fields: frozenset[str] | None = None

    def clone(self) -> ChatOptions:
        """A shallow copy: lists and the properties dict are new, their items shared."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        if self.stop_sequences is not None:
            other.stop_sequences = list(self.stop_sequences)
        if self.tools is not None:
            other.tools = list(self.tools)
        if self.additional_properties is not None:
            other.additional_properties = dict(self.additional_properties)
        return other


@dataclass
class ChatResponse:
    """A complete (non-streaming) answer."""

    messages: list[ChatMessage] = field(default_factory=list)
    model_id: str | None = None
    finish_reason: ChatFinishReason | str | None = None
    usage: UsageDetails | None = None
    response_id: str | None = None
    created_at: float | None = None
    raw_representation: Any = None
    additional_properties: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        """The text of every message, joined."""
        return "".join(m.text for m in self.messages)


@dataclass
class ChatResponseUpdate:
    """One streamed piece of an answer."""

    role: ChatRole | None = None
    contents: list[Content] = field(default_factory=list)
    finish_reason: ChatFinishReason | str | None = None
    model_id: str | None = None
    response_id: str | None = None
    usage: UsageDetails | None = None
    created_at: float | None = None
    raw_representation: Any = None
    additional_properties: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        """The text parts of this update, joined."""
        return _text_of(self.contents)


_TEXTS = (TextContent, TextReasoningContent)  # a tuple: no union object per call


def carries_content(update: ChatResponseUpdate) -> bool:
    """Whether an update carries output (the commit rule's test): non-empty text or
    reasoning, a tool call, any other content (media), or a refusal. Role-only deltas,
    keep-alives, usage and a bare finish reason do not."""
    for content in update.contents:
        if not isinstance(content, _TEXTS) or content.text:
            return True
    props = update.additional_properties
    return bool(props and props.get("refusal"))
