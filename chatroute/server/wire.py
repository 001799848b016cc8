"""The OpenAI chat wire format: request models, and conversions to and from chatroute's types."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from chatroute.chat.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    Content,
    DataContent,
    FunctionCallContent,
    FunctionResultContent,
    HostedFileContent,
    TextContent,
    TextReasoningContent,
    UriContent,
    UsageDetails,
    carries_content,
)
from chatroute.providers.mapping import AUDIO_MEDIA_TYPES, OPENAI_EXTRA_FIELDS
from chatroute.server.errors import APIError
from chatroute.server.request_log import random_hex

__all__ = [
    "ChatCall",
    "ChatCompletionRequest",
    "ClassifyRequest",
    "RouteRequest",
    "StreamEncoder",
    "WireMessage",
    "chat_call",
    "completion_body",
    "has_content",
    "query_text",
    "to_chat_messages",
    "to_chat_options",
]

_ROLES = {
    "system": ChatRole.SYSTEM,
    "developer": ChatRole.SYSTEM,
    "user": ChatRole.USER,
    "assistant": ChatRole.ASSISTANT,
    "tool": ChatRole.TOOL,
}


# Types are strict everywhere (no "yes" for a bool, no "0.5" for a number, no 5 for a
# string), as the OpenAI API itself checks them.


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    # Unknown fields are kept aside (in `model_extra`) and ignored: OpenAI clients send
    # fields a gateway has no use for, and rejecting them breaks those clients.
    model_config = ConfigDict(extra="allow", strict=True)


class ImageURL(_Lenient):
    """An image part's image: an http(s) URL or a base64 `data:` URI."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class InputAudio(_Lenient):
    """An audio part's sound: base64 data and its format."""

    data: str
    format: str


class FilePart(_Lenient):
    """A file part's file: its data as a `data:` URI, or the id of an uploaded file."""

    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class ContentPart(_Lenient):
    """One part of a message's content: text, or (in user messages) an image, audio or a
    file, in the field its type names."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None
    file: FilePart | None = None


class ToolCallFunction(_Lenient):
    """The function a tool call names, and its JSON arguments."""

    name: str
    arguments: str = ""


class ToolCall(_Lenient):
    """A tool call an assistant message made."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class WireMessage(_Lenient):
    """A chat message as the OpenAI API sends it."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an assistant's refusal, as the API returned it


class FunctionDefinition(_Lenient):
    """A function a model may call."""

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    """A tool offered to the model."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class StreamOptions(_Lenient):
    """Options of a streamed answer."""

    include_usage: bool | None = None


Temperature = Annotated[float, Field(ge=0, le=2)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class ChatCompletionRequest(_Open):
    """The body of `POST /v1/chat/completions`; unknown fields are kept for the providers
    to pass on (each as its `pass_through` setting allows)."""

    model: str | None = None
    messages: list[WireMessage] = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: int | None = None
    user: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class RouteRequest(_Strict):
    """The body of `POST /v1/route`: a text or a conversation."""

    input: str | None = None
    messages: list[WireMessage] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> RouteRequest:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of 'input' or 'messages'")
        return self


class ConversationInput(_Strict):
    """One classify input given as a conversation."""

    messages: list[WireMessage]


class ClassifyRequest(_Strict):
    """The body of `POST /v1/classify`: texts or conversations, classified as one batch."""

    inputs: list[str | ConversationInput]


# ----------------------------------------------------------------------------- requests


def _invalid_part(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_content")


def _media_part(part: ContentPart, param: str) -> Content:
    """The content of one image, audio or file part; APIError naming the field at fault when
    the part is not one of those or is malformed."""
    if part.type == "image_url":
        image = part.image_url
        if image is None:
            raise _invalid_part(f"{param}.image_url", "an image_url part needs 'image_url'")
        extra = {"detail": image.detail} if image.detail is not None else None
        url = image.url
        if url.startswith(("https://", "http://")):
            return UriContent(url, None, extra)
        if url.startswith("data:"):
            try:
                return DataContent(url, additional_properties=extra)
            except ValueError as exc:
                raise _invalid_part(f"{param}.image_url.url", str(exc)) from None
        raise _invalid_part(
            f"{param}.image_url.url", "image_url.url must be http(s):// or a base64 data: URI"
        )
    if part.type == "input_audio":
        audio = part.input_audio
        if audio is None:
            raise _invalid_part(f"{param}.input_audio", "an input_audio part needs 'input_audio'")
        media_type = AUDIO_MEDIA_TYPES.get(audio.format)
        if media_type is None:
            raise _invalid_part(
                f"{param}.input_audio.format",
                f"input_audio.format {audio.format!r} is not one of wav, mp3",
            )
        return DataContent(f"data:{media_type};base64,{audio.data}")
    if part.type == "file":
        file = part.file
        if file is None:
            raise _invalid_part(f"{param}.file", "a file part needs 'file'")
        if file.file_id is not None and file.file_data is None:
            return HostedFileContent(file.file_id, file.filename)
        if file.file_data is not None and file.file_id is None:
            try:
                return DataContent(file.file_data, name=file.filename)
            except ValueError as exc:
                raise _invalid_part(f"{param}.file.file_data", str(exc)) from None
        raise _invalid_part(f"{param}.file", "a file part needs one of file_data or file_id")
    raise APIError(
        400,
        f"content part type {part.type!r} is not supported; "
        "use text, image_url, input_audio or file",
        param=param,
        code="unsupported_content",
    )


def _message_contents(
    message: WireMessage, position: int, prefix: str
) -> tuple[str | None, list[Content], str | None]:
    """A message's text (its text parts joined; None for no content); when it has image,
    audio or file parts, all its parts in order as contents (else an empty list); and an
    assistant's refusal (its `refusal` field and refusal parts), else None."""
    content = message.content
    assistant = message.role == "assistant"
    refusal = message.refusal if assistant else None
    if content is None or isinstance(content, str):
        return content, [], refusal
    texts: list[str] = []
    refusals: list[str] = [refusal] if refusal else []
    parts: list[Content] = []
    media = False
    for index, part in enumerate(content):
        param = f"{prefix}[{position}].content[{index}]"
        if part.type == "text" and part.text is not None:
            texts.append(part.text)
            if part.text:
                parts.append(TextContent(part.text))
            continue
        if part.type == "refusal" and assistant and part.refusal is not None:
            refusals.append(part.refusal)
            continue
        if part.type != "text" and message.role == "user":
            parts.append(_media_part(part, param))
            media = True
            continue
        if part.type in ("text", "refusal"):
            raise APIError(400, f"{param}: a {part.type} part needs its '{part.type}'", param=param)
        raise APIError(
            400,
            f"content part type {part.type!r} is not supported in a {message.role} message; "
            "images, audio and files go in user messages",
            param=param,
            code="unsupported_content",
        )
    return "".join(texts), parts if media else [], "".join(refusals) or None


def to_chat_messages(wire: Sequence[WireMessage], *, prefix: str = "messages") -> list[ChatMessage]:
    """Convert wire messages; roles are mapped (`developer` becomes system)."""
    out: list[ChatMessage] = []
    for position, message in enumerate(wire):
        param = f"{prefix}[{position}]"
        text, media, refusal = _message_contents(message, position, prefix)
        role = _ROLES[message.role]
        if media:  # a user message with images, audio or files: its parts in order
            out.append(ChatMessage(role, contents=media, author_name=message.name))
            continue
        contents: list[Content] = []
        if role is ChatRole.TOOL:
            if not message.tool_call_id:
                raise APIError(400, f"{param}: a tool message needs tool_call_id", param=param)
            contents.append(FunctionResultContent(message.tool_call_id, text or ""))
            out.append(ChatMessage(role, contents=contents, author_name=message.name))
            continue
        if text:
            contents.append(TextContent(text))
        if message.tool_calls:
            if role is not ChatRole.ASSISTANT:
                raise APIError(
                    400, f"{param}: only assistant messages carry tool_calls", param=param
                )
            for index, call in enumerate(message.tool_calls):
                contents.append(
                    FunctionCallContent(call.id, call.function.name, call.function.arguments, index)
                )
        if text is None and not message.tool_calls and refusal is None:
            raise APIError(400, f"{param}: content is required", param=f"{param}.content")
        out.append(
            ChatMessage(
                role,
                contents=contents,
                author_name=message.name,
                additional_properties={"refusal": refusal} if refusal is not None else None,
            )
        )
    return out


def query_text(messages: Sequence[ChatMessage]) -> str:
    """The text the semantic router reads: the last user message's text ('' when none)."""
    for message in reversed(messages):
        if message.role is ChatRole.USER:
            return message.text
    return ""


def to_chat_options(request: ChatCompletionRequest) -> ChatOptions:
    """The chat options a request asks for; the `model` field is left to the route."""
    options = ChatOptions(
        temperature=request.temperature,
        top_p=request.top_p,
        max_output_tokens=request.max_completion_tokens or request.max_tokens,
        seed=request.seed,
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        user=request.user,
        tool_choice=request.tool_choice,
        response_format=request.response_format,
    )
    if request.stop is not None:
        options.stop_sequences = [request.stop] if isinstance(request.stop, str) else request.stop
    if request.tools is not None:
        options.tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    if request.reasoning_effort is not None:
        options.reasoning = {"effort": request.reasoning_effort}
    # request.model_fields_set, without the property; none given: nothing to read
    if not request.__pydantic_fields_set__.isdisjoint(OPENAI_EXTRA_FIELDS):
        extra = {
            name: getattr(request, name)
            for name in OPENAI_EXTRA_FIELDS
            if getattr(request, name) is not None
        }
        if extra:
            options.additional_properties = extra
    if request.max_completion_tokens is not None:  # sent on under the caller's name
        options.additional_properties = {
            **(options.additional_properties or {}),
            "max_completion_tokens": request.max_completion_tokens,
        }
    unknown = request.__pydantic_extra__  # request.model_extra, without the property
    if unknown:
        options.additional_properties = {**unknown, **(options.additional_properties or {})}
        options.pass_through_fields = frozenset(unknown)
    return options


@dataclass(slots=True)
class ChatCall:
    """A chat-completions request in chatroute's terms: what routing and the providers use."""

    model: str | None
    messages: list[ChatMessage]
    options: ChatOptions
    stream: bool
    include_usage: bool
    ignored: list[str]  # the unknown fields the request carried, sorted


def chat_call(request: ChatCompletionRequest) -> ChatCall:
    """A validated request in chatroute's terms (raises APIError on unsupported content)."""
    stream_options = request.stream_options
    return ChatCall(
        model=request.model,
        messages=to_chat_messages(request.messages),
        options=to_chat_options(request),
        stream=bool(request.stream),
        include_usage=bool(stream_options and stream_options.include_usage),
        # request.model_extra, without the property
        ignored=sorted(request.__pydantic_extra__ or {}),
    )


def _finish(reason: object) -> str | None:
    if reason is None:
        return None
    if isinstance(reason, Enum):
        return str(reason._value_)  # .value, without the enum property's calls
    return str(getattr(reason, "value", reason))


def usage_body(usage: UsageDetails) -> dict[str, Any]:
    """OpenAI's usage object."""
    prompt = usage.input_token_count or 0
    completion = usage.output_token_count or 0
    total = usage.total_token_count if usage.total_token_count is not None else prompt + completion
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": total,
    }
    if usage.cached_input_token_count is not None:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_input_token_count}
    if usage.reasoning_token_count is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_token_count}
    return body


def _tool_call(call: FunctionCallContent) -> dict[str, Any]:
    return {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def completion_body(response: ChatResponse, *, model: str, created: int | None = None) -> bytes:
    """The JSON body of a non-streamed chat completion (every choice, when `n` > 1)."""
    props = response.additional_properties
    choices = [_choice_body(response, 0)]
    for index, other in enumerate((props or {}).get("more_choices", ()), 1):
        choices.append(_choice_body(other, index))
    body: dict[str, Any] = {
        "id": response.response_id or _new_id(),
        "object": "chat.completion",
        "created": created or int(response.created_at or time.time()),
        "model": response.model_id or model,
        "choices": choices,
    }
    fingerprint = props.get("system_fingerprint") if props else None
    if fingerprint:
        body["system_fingerprint"] = fingerprint
    if response.usage is not None:
        body["usage"] = usage_body(response.usage)
    return orjson.dumps(body)


def _choice_body(response: ChatResponse, index: int) -> dict[str, Any]:
    """One choice of a completion: the response's messages as one assistant message."""
    text: list[str] = []
    reasoning: list[str] = []
    refusal: list[str] = []
    calls: list[dict[str, Any]] = []
    for message in response.messages:
        extra = message.additional_properties
        if extra and isinstance(extra.get("refusal"), str):
            refusal.append(extra["refusal"])
        for content in message.contents:
            if isinstance(content, TextContent):
                text.append(content.text)
            elif isinstance(content, TextReasoningContent):
                reasoning.append(content.text)
            elif isinstance(content, FunctionCallContent):
                calls.append(_tool_call(content))
    message_body: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if refusal:
        message_body["refusal"] = "".join(refusal)
    if reasoning:
        message_body["reasoning_content"] = "".join(reasoning)
    if calls:
        message_body["tool_calls"] = calls
    finish = _finish(response.finish_reason) or ("tool_calls" if calls else "stop")
    choice: dict[str, Any] = {"index": index, "message": message_body, "finish_reason": finish}
    props = response.additional_properties
    if props and props.get("logprobs") is not None:
        choice["logprobs"] = props["logprobs"]
    return choice


def _new_id() -> str:
    return f"chatcmpl-{random_hex()}"


_TEXTS = (TextContent, TextReasoningContent)  # a tuple: no union object per call


# The commit rule's test, one definition for the providers and the service.
has_content = carries_content


class StreamEncoder:
    """Turns a stream of updates into OpenAI `chat.completion.chunk` SSE events."""

    def __init__(self, *, model: str, include_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        self.response_id: str | None = None
        self.usage: UsageDetails | None = None
        self._role_sent: set[int] = set()  # the choices (n > 1) whose role went out
        self._tool_indices: dict[tuple[int, str], int] = {}

    def _chunk(self, choices: list[dict[str, Any]], model: str | None) -> dict[str, Any]:
        if self.response_id is None:
            self.response_id = _new_id()
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": model or self.model,
            "choices": choices,
        }

    def _tool_index(self, call: FunctionCallContent, choice: int) -> int:
        if call.index is not None:
            return call.index
        key = (choice, call.call_id or "")
        if key not in self._tool_indices:
            self._tool_indices[key] = sum(1 for c, _ in self._tool_indices if c == choice)
        return self._tool_indices[key]

    def encode(self, update: ChatResponseUpdate) -> bytes:
        """The SSE event(s) for one update (empty bytes when it carries nothing to send)."""
        props = update.additional_properties
        out = self._encode(update, props.get("choice_index", 0) if props else 0)
        for other in props.get("more_choices", ()) if props else ():
            out += self.encode(other)
        return out

    def _encode(self, update: ChatResponseUpdate, index: int) -> bytes:
        if self.response_id is None and update.response_id:
            self.response_id = update.response_id
        if update.model_id:
            self.model = update.model_id
        if update.usage is not None:
            self.usage = update.usage
        delta: dict[str, Any] = {}
        text = []
        reasoning = []
        calls = []
        for content in update.contents:
            if isinstance(content, TextContent):
                text.append(content.text)
            elif isinstance(content, TextReasoningContent):
                reasoning.append(content.text)
            elif isinstance(content, FunctionCallContent):
                call: dict[str, Any] = {"index": self._tool_index(content, index)}
                if content.call_id is not None:
                    call["id"] = content.call_id
                    call["type"] = "function"
                function: dict[str, Any] = {}
                if content.name is not None:
                    function["name"] = content.name
                function["arguments"] = content.arguments
                call["function"] = function
                calls.append(call)
        if text:
            delta["content"] = "".join(text)
        if reasoning:
            delta["reasoning_content"] = "".join(reasoning)
        if calls:
            delta["tool_calls"] = calls
        props = update.additional_properties
        logprobs = None
        if props:
            refusal = props.get("refusal")
            if isinstance(refusal, str) and refusal:
                delta["refusal"] = refusal
            logprobs = props.get("logprobs")
        finish = _finish(update.finish_reason)
        if index not in self._role_sent:
            if not delta and finish is None:
                return b""
            delta = {"role": "assistant", **delta}
            self._role_sent.add(index)
        elif not delta and finish is None:
            return b""
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
        chunk = self._chunk([choice], update.model_id)
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return _sse(chunk)

    def finish(self) -> bytes:
        """The closing events: the usage chunk when asked for, then `[DONE]`."""
        out = b""
        if self.include_usage and self.usage is not None:
            chunk = self._chunk([], None)
            chunk["usage"] = usage_body(self.usage)
            out += _sse(chunk)
        return out + b"data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
