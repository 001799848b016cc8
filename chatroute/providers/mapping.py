"""Conversions between chatroute chat types and the OpenAI chat-completions wire format."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from chatroute.chat.types import (
    ChatFinishReason,
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
)
from chatroute.providers.pass_through import PassThrough, passed_extras

__all__ = [
    "AUDIO_MEDIA_TYPES",
    "OPENAI_EXTRA_FIELDS",
    "build_request",
    "finish_reason_from_openai",
    "media_part_from_openai",
    "media_part_to_openai",
    "message_from_openai",
    "messages_from_openai",
    "messages_to_openai",
    "response_from_openai",
    "tool_to_openai",
    "update_from_openai_chunk",
    "usage_from_openai",
]

MaxTokensParam = Literal["max_tokens", "max_completion_tokens"]

OPENAI_EXTRA_FIELDS: tuple[str, ...] = (
    "n",
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "metadata",
    "store",
    "service_tier",
    "modalities",
    "verbosity",
    "prediction",
    "prompt_cache_key",
    "safety_identifier",
)
"""Chat-completions request fields with no `ChatOptions` field of their own: the service
carries them in `additional_properties`, which OpenAI-compatible providers send as is."""

_FINISH = {
    "stop": ChatFinishReason.STOP,
    "length": ChatFinishReason.LENGTH,
    "tool_calls": ChatFinishReason.TOOL_CALLS,
    "function_call": ChatFinishReason.TOOL_CALLS,
    "content_filter": ChatFinishReason.CONTENT_FILTER,
}
_TOOL_CHOICE_WORDS = frozenset({"auto", "none", "required"})


def _as_dict(obj: Any) -> dict[str, Any]:
    """A plain dict from a mapping or a pydantic model (the SDK's objects)."""
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        result = dump(exclude_none=False)
        if isinstance(result, dict):
            return result
    raise TypeError(f"expected a mapping or a pydantic model, got {type(obj).__name__}")


def _fields(obj: Any) -> Mapping[str, Any]:
    """`obj` itself when it is a dict (decoded JSON), else `_as_dict(obj)`: for reading only."""
    return obj if type(obj) is dict else _as_dict(obj)


# ChatRole by its value, and the OpenAI names that map onto one: a dict lookup instead of
# the Enum's call on every message.
_ROLE_OF: dict[str, ChatRole] = {role.value: role for role in ChatRole}
# Members read per message, as module names (reading one off the Enum class costs about
# ten times a global on Python 3.11).
_TOOL = ChatRole.TOOL
_ASSISTANT = ChatRole.ASSISTANT


def _result_text(result: Any) -> str:
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


# ---------------------------------------------------------------------------- requests

_MEDIA = (DataContent, UriContent, HostedFileContent)  # a tuple: no union object per call
# OpenAI's `input_audio` formats and the media types they travel under; and back, the
# audio media types sent as `input_audio`, with their format.
AUDIO_MEDIA_TYPES: dict[str, str] = {"wav": "audio/wav", "mp3": "audio/mpeg"}
_AUDIO_FORMATS = {
    **{media_type: fmt for fmt, media_type in AUDIO_MEDIA_TYPES.items()},
    "audio/x-wav": "wav",
    "audio/mp3": "mp3",
}


def media_part_to_openai(content: DataContent | UriContent | HostedFileContent) -> dict[str, Any]:
    """The OpenAI content part for an image, audio or file content.

    Images (a data URI of an image type, or any URL) become `image_url` parts, with their
    `detail`; wav and mp3 audio becomes `input_audio`; other data and uploaded files become
    `file` parts.
    """
    if isinstance(content, UriContent):
        image: dict[str, Any] = {"url": content.uri}
        image.update(content.additional_properties or {})
        return {"type": "image_url", "image_url": image}
    if isinstance(content, HostedFileContent):
        file: dict[str, Any] = {"file_id": content.file_id}
        if content.name:
            file["filename"] = content.name
        return {"type": "file", "file": file}
    if content.has_top_level_media_type("image"):
        image = {"url": content.uri}
        image.update(content.additional_properties or {})
        return {"type": "image_url", "image_url": image}
    audio_format = _AUDIO_FORMATS.get(content.media_type)
    if audio_format is not None:
        return {
            "type": "input_audio",
            "input_audio": {"data": content.base64_data, "format": audio_format},
        }
    file = {"file_data": content.uri}
    if content.name:
        file["filename"] = content.name
    return {"type": "file", "file": file}


def _content_parts(contents: Sequence[Any]) -> list[dict[str, Any]] | None:
    """A message's text and media as OpenAI content parts, in order; None when it has no
    image, audio or file (its content is then plain text)."""
    if not any(isinstance(c, _MEDIA) for c in contents):
        return None
    parts: list[dict[str, Any]] = []
    for content in contents:
        if isinstance(content, TextContent):
            if content.text:
                parts.append({"type": "text", "text": content.text})
        elif isinstance(content, _MEDIA):
            parts.append(media_part_to_openai(content))
    return parts


def media_part_from_openai(part: Mapping[str, Any]) -> Content | None:
    """The content of an OpenAI image, audio or file part; None for another type.

    Raises ValueError for a part of one of those types that is malformed.
    """
    kind = part.get("type")
    if kind == "image_url":
        image = _fields(part.get("image_url"))
        url = image.get("url")
        if not isinstance(url, str):
            raise ValueError("an image_url part needs a string 'url'")
        detail = image.get("detail")
        extra = {"detail": detail} if isinstance(detail, str) else None
        if url.startswith("data:"):
            return DataContent(url, additional_properties=extra)
        return UriContent(url, None, extra)
    if kind == "input_audio":
        audio = _fields(part.get("input_audio"))
        data, fmt = audio.get("data"), audio.get("format")
        if not isinstance(data, str) or not isinstance(fmt, str):
            raise ValueError("an input_audio part needs string 'data' and 'format'")
        media_type = AUDIO_MEDIA_TYPES.get(fmt, f"audio/{fmt}")
        return DataContent(f"data:{media_type};base64,{data}")
    if kind == "file":
        file = _fields(part.get("file"))
        name = file.get("filename")
        name = name if isinstance(name, str) else None
        if isinstance(file.get("file_id"), str):
            return HostedFileContent(file["file_id"], name)
        if isinstance(file.get("file_data"), str):
            return DataContent(file["file_data"], name=name)
        raise ValueError("a file part needs a string 'file_data' or 'file_id'")
    return None


def messages_to_openai(
    messages: Sequence[ChatMessage],
    *,
    instructions: str | None = None,
    send_reasoning: bool = True,
) -> list[dict[str, Any]]:
    """The OpenAI `messages` array for chatroute messages.

    Text parts are joined; an assistant's `FunctionCallContent`s become `tool_calls` and its
    `TextReasoningContent` becomes `reasoning_content` (unless `send_reasoning` is False);
    every `FunctionResultContent` becomes its own `tool` message. `instructions` is
    prepended as a system message. `author_name` becomes `name`; `additional_properties`
    are merged into the message object.
    """
    if messages is None:
        raise TypeError("messages must not be None")
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for i, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise TypeError(f"messages[{i}] is {type(message).__name__}, not a ChatMessage")
        text = "".join(c.text for c in message.contents if isinstance(c, TextContent))
        reasoning = "".join(c.text for c in message.contents if isinstance(c, TextReasoningContent))
        calls = [c for c in message.contents if isinstance(c, FunctionCallContent)]
        results = [c for c in message.contents if isinstance(c, FunctionResultContent)]
        extra = dict(message.additional_properties or {})

        if message.role is ChatRole.TOOL or (results and not text and not calls):
            if not results:
                entry: dict[str, Any] = {"role": "tool", "content": text}
                entry.update(extra)
                out.append(entry)
            for result in results:
                entry = {
                    "role": "tool",
                    "tool_call_id": result.call_id,
                    "content": _result_text(result.result),
                }
                entry.update(extra)
                out.append(entry)
            continue

        entry = {"role": message.role.value}
        parts = _content_parts(message.contents)
        if parts is not None and message.role is not ChatRole.ASSISTANT:
            entry["content"] = parts  # text with images, audio or files, in order
        elif message.role is ChatRole.ASSISTANT:
            refused = bool(extra.get("refusal"))
            entry["content"] = text if (text or not (calls or refused)) else None
            if calls:
                entry["tool_calls"] = [
                    {
                        "id": call.call_id or f"call_{n}",
                        "type": "function",
                        "function": {"name": call.name or "", "arguments": call.arguments or ""},
                    }
                    for n, call in enumerate(calls)
                ]
            if reasoning and send_reasoning:
                entry["reasoning_content"] = reasoning
        else:
            entry["content"] = text
        if message.author_name:
            entry["name"] = message.author_name
        entry.update(extra)
        out.append(entry)
        for result in results:
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": result.call_id,
                    "content": _result_text(result.result),
                }
            )
    return out


def tool_to_openai(tool: Any) -> dict[str, Any]:
    """An OpenAI tool definition from a dict or an object with name/description/parameters.

    Accepted: an OpenAI tool (`{"type": "function", "function": {...}}`), a bare function
    definition (`{"name", "description", "parameters"}`), or any object with `name` and
    optional `description` / `parameters` attributes.
    """
    if isinstance(tool, Mapping):
        if "type" in tool:
            return dict(tool)
        if "name" in tool:
            return {"type": "function", "function": dict(tool)}
        raise ValueError(f"a tool dict needs 'type' or 'name': {sorted(tool)}")
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"cannot turn {type(tool).__name__} into an OpenAI tool (no name)")
    function: dict[str, Any] = {"name": name}
    description = getattr(tool, "description", None)
    if description:
        function["description"] = description
    parameters = getattr(tool, "parameters", None)
    if callable(parameters):
        parameters = parameters()
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        if choice in _TOOL_CHOICE_WORDS:
            return choice
        return {"type": "function", "function": {"name": choice}}
    if isinstance(choice, Mapping):
        return dict(choice)
    raise TypeError(f"tool_choice must be a str or a dict, got {type(choice).__name__}")


def _response_format(fmt: Any) -> Any:
    if isinstance(fmt, str):
        if fmt not in ("text", "json_object"):
            raise ValueError(f"response_format string must be 'text' or 'json_object': {fmt!r}")
        return {"type": fmt}
    if isinstance(fmt, Mapping):
        return dict(fmt)
    schema = getattr(fmt, "model_json_schema", None)
    if isinstance(fmt, type) and callable(schema):
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.__name__, "schema": schema()},
        }
    raise TypeError(f"response_format must be a str, a dict or a pydantic model class, got {fmt!r}")


# ChatOptions fields sent under their own names when set, in this order.
_SCALAR_OPTIONS = ("temperature", "top_p", "seed", "user", "frequency_penalty", "presence_penalty")


def build_request(
    messages: Sequence[ChatMessage],
    options: ChatOptions | None,
    *,
    default_model: str | None,
    stream: bool,
    max_tokens_param: MaxTokensParam = "max_tokens",
    include_usage: bool = True,
    send_reasoning: bool = True,
    extra_body: Mapping[str, Any] | None = None,
    pass_through: PassThrough = "all",
) -> dict[str, Any]:
    """The JSON body of a chat-completions request.

    `options.model_id` overrides `default_model`; `max_output_tokens` goes out as
    `max_tokens_param`, or as `max_completion_tokens` when `additional_properties` has
    that key (the caller's own name for it); `reasoning` (an effort string, or a dict with
    "effort") becomes `reasoning_effort`; `additional_properties` (the caller's unknown
    fields as `pass_through` allows) are added after the options, and `extra_body` (the
    operator's) last: it wins.
    """
    opts = options if options is not None else ChatOptions()
    model = opts.model_id or default_model
    if not model:
        raise ValueError("no model: set the provider's model or ChatOptions.model_id")
    body: dict[str, Any] = {
        "model": model,
        "messages": messages_to_openai(
            messages, instructions=opts.instructions, send_reasoning=send_reasoning
        ),
    }
    if not body["messages"]:
        raise ValueError("messages must not be empty")
    for key in _SCALAR_OPTIONS:
        value = getattr(opts, key)
        if value is not None:
            body[key] = value
    extras, _ = passed_extras(opts, pass_through)
    if extras.pop("max_completion_tokens", None) is not None:
        max_tokens_param = "max_completion_tokens"
    if opts.max_output_tokens is not None:
        body[max_tokens_param] = opts.max_output_tokens
    if opts.stop_sequences:
        body["stop"] = list(opts.stop_sequences)
    if opts.tools:
        body["tools"] = [tool_to_openai(t) for t in opts.tools]
    if opts.tool_choice is not None:
        body["tool_choice"] = _tool_choice(opts.tool_choice)
    if opts.response_format is not None:
        body["response_format"] = _response_format(opts.response_format)
    if opts.reasoning is not None:
        effort = opts.reasoning.get("effort") if isinstance(opts.reasoning, Mapping) else None
        body["reasoning_effort"] = effort if effort is not None else opts.reasoning
    if stream:
        body["stream"] = True
        if include_usage:
            body["stream_options"] = {"include_usage": True}
    body.update(extras)
    if extra_body:
        body.update(extra_body)
    return body


# ---------------------------------------------------------------------------- responses


def finish_reason_from_openai(reason: str | None) -> ChatFinishReason | str | None:
    """The chatroute finish reason; unknown strings are kept as they are."""
    if reason is None:
        return None
    if not isinstance(reason, str):
        raise ValueError(f"finish_reason must be a string, got {type(reason).__name__}")
    return _FINISH.get(reason, reason)


_USAGE_TOTALS = frozenset({"prompt_tokens", "completion_tokens", "total_tokens"})


def usage_from_openai(usage: Any) -> UsageDetails | None:
    """UsageDetails from an OpenAI usage object; integer details go to `additional_counts`."""
    if usage is None:
        return None
    data = _fields(usage)
    extra: dict[str, int] = {}
    for key, value in data.items():
        if key in _USAGE_TOTALS:
            continue
        if type(value) is dict or isinstance(value, Mapping):
            for sub, count in value.items():
                if isinstance(count, int) and not isinstance(count, bool):
                    extra[sub] = count
        elif isinstance(value, int) and not isinstance(value, bool):
            extra[key] = value
    return UsageDetails(
        input_token_count=data.get("prompt_tokens"),
        output_token_count=data.get("completion_tokens"),
        total_token_count=data.get("total_tokens"),
        additional_counts=extra,
        cached_input_token_count=_detail(data, "prompt_tokens_details", "cached_tokens"),
        reasoning_token_count=_detail(data, "completion_tokens_details", "reasoning_tokens"),
    )


def _detail(usage: Mapping[str, Any], group: str, name: str) -> int | None:
    """One count of a usage details object (`prompt_tokens_details.cached_tokens`)."""
    details = usage.get(group)
    if details is None:
        return None
    count = _fields(details).get(name)
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _reasoning_of(obj: Mapping[str, Any]) -> str | None:
    for key in ("reasoning_content", "reasoning"):
        value = obj.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _contents_of(data: Mapping[str, Any], *, streaming: bool) -> list[Content]:
    contents: list[Content] = []
    reasoning = _reasoning_of(data)
    if reasoning:
        contents.append(TextReasoningContent(reasoning))
    text = data.get("content")
    if isinstance(text, str) and text:
        contents.append(TextContent(text))
    elif isinstance(text, list):
        parts = [_fields(p) for p in text if isinstance(p, Mapping) or hasattr(p, "model_dump")]
        media = [media_part_from_openai(part) for part in parts]
        if any(m is not None for m in media):  # text with images, audio or files, in order
            for part, item in zip(parts, media, strict=True):
                if item is not None:
                    contents.append(item)
                elif isinstance(part.get("text"), str) and part["text"]:
                    contents.append(TextContent(part["text"]))
        else:
            joined = "".join(t for part in parts if isinstance(t := part.get("text"), str))
            if joined:
                contents.append(TextContent(joined))
    for n, call in enumerate(data.get("tool_calls") or []):
        call = _fields(call)
        function = _fields(call.get("function"))
        index = call.get("index")
        contents.append(
            FunctionCallContent(
                call_id=call.get("id"),
                name=function.get("name"),
                arguments=function.get("arguments") or "",
                index=index if isinstance(index, int) else (None if streaming else n),
            )
        )
    legacy = data.get("function_call")
    if legacy:
        function = _fields(legacy)
        contents.append(
            FunctionCallContent(
                call_id=None,
                name=function.get("name"),
                arguments=function.get("arguments") or "",
                index=0,
            )
        )
    return contents


def message_from_openai(message: Any) -> ChatMessage:
    """A ChatMessage from an OpenAI message (dict or SDK object), any role."""
    data = _fields(message)
    role = data.get("role") or "assistant"
    if role == "developer":
        role = "system"
    chat_role = _ROLE_OF.get(role) if type(role) is str else None
    if chat_role is None:
        try:
            chat_role = ChatRole(role)
        except ValueError:
            raise ValueError(f"unknown message role {role!r}") from None
    if chat_role is ChatRole.TOOL:
        call_id = data.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ValueError("a tool message needs a string tool_call_id")
        content = data.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        return ChatMessage(ChatRole.TOOL, contents=[FunctionResultContent(call_id, content)])
    contents = _contents_of(data, streaming=False)
    extra: dict[str, Any] = {}
    if data.get("refusal"):
        extra["refusal"] = data["refusal"]
    name = data.get("name")
    return ChatMessage(
        chat_role,
        contents=contents,
        author_name=name if isinstance(name, str) else None,
        additional_properties=extra or None,
    )


def messages_from_openai(messages: Sequence[Any]) -> list[ChatMessage]:
    """ChatMessages from an OpenAI `messages` array."""
    return [message_from_openai(m) for m in messages]


def _plain(obj: Any) -> dict[str, Any]:
    """A dict from a decoded JSON object or an SDK model (extra fields included)."""
    if isinstance(obj, dict):
        return obj
    data = _as_dict(obj)
    extra = getattr(obj, "model_extra", None)
    if isinstance(extra, Mapping):
        data.update(extra)
    return data


def _first_choice(data: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The first choice, for reading (the decoded JSON's own dict when it is one)."""
    choices = data.get("choices")
    if choices is None:
        return None
    if not isinstance(choices, list):
        raise ValueError("'choices' is not a list")
    if not choices:
        return None
    choice = choices[0]
    if type(choice) is dict:
        return choice
    if not isinstance(choice, Mapping):
        choice = _plain(choice)
    return dict(choice)


_NUMBER = (int, float)  # a tuple: `int | float` builds a union object on every call


def _created(value: Any) -> float | None:
    if isinstance(value, _NUMBER) and not isinstance(value, bool):
        return float(value)
    return None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def response_from_openai(completion: Any, *, provider: str | None = None) -> ChatResponse:
    """A ChatResponse from an OpenAI chat completion (decoded JSON or SDK object).

    The first choice is the response; with several (`n` > 1) the others are responses of
    their own in `additional_properties["more_choices"]`. Raises ValueError when it is
    not a chat completion.
    """
    data = _plain(completion)
    choice = _first_choice(data)
    if choice is None:
        raise ValueError("the completion has no choices")
    message_data = choice.get("message")
    if type(message_data) is not dict and not isinstance(message_data, Mapping):
        message_data = _plain(message_data) if message_data is not None else None
    if message_data is None:
        raise ValueError("the first choice has no message")
    message = message_from_openai(message_data)
    props: dict[str, Any] = {}
    if provider is not None:
        props["provider"] = provider
    fingerprint = data.get("system_fingerprint")
    if fingerprint:
        props["system_fingerprint"] = fingerprint
    logprobs = choice.get("logprobs")
    if logprobs is not None:
        props["logprobs"] = _plain(logprobs) if not isinstance(logprobs, Mapping) else logprobs
    others = (data.get("choices") or [])[1:]  # n > 1: each further choice as a response of its own
    if others:
        props["more_choices"] = [response_from_openai({**data, "choices": [c]}) for c in others]
    return ChatResponse(
        messages=[message],
        model_id=_str_or_none(data.get("model")),
        finish_reason=finish_reason_from_openai(choice.get("finish_reason")),
        usage=usage_from_openai(data.get("usage")),
        response_id=_str_or_none(data.get("id")),
        created_at=_created(data.get("created")),
        raw_representation=completion,
        additional_properties=props or None,
    )


def update_from_openai_chunk(chunk: Any, *, provider: str | None = None) -> ChatResponseUpdate:
    """A ChatResponseUpdate from one streamed chunk (decoded JSON or SDK object).

    A choice other than the first (`n` > 1) is named by `additional_properties
    ["choice_index"]`; a chunk with several choices gives the first's update with the
    others' in `additional_properties["more_choices"]`. A chunk without choices (usage,
    prompt filter results) gives an update with no contents. Raises ValueError on a malformed chunk.
    """
    data = _plain(chunk)
    choice = _first_choice(data)
    role: ChatRole | None = None
    contents: list[Content] = []
    finish: ChatFinishReason | str | None = None
    props: dict[str, Any] | None = {"provider": provider} if provider is not None else None
    if choice is not None:
        delta = choice.get("delta")
        if delta is None:
            delta = {}
        elif type(delta) is not dict and not isinstance(delta, Mapping):
            delta = _plain(delta)
        raw_role = delta.get("role")
        if raw_role:
            role = _ROLE_OF.get(raw_role) if type(raw_role) is str else None
            if role is None:
                try:
                    role = ChatRole(raw_role)
                except ValueError:
                    role = ChatRole.ASSISTANT
        contents = _contents_of(delta, streaming=True)
        finish = finish_reason_from_openai(choice.get("finish_reason"))
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            props = props or {}
            props["refusal"] = refusal
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            props = props or {}
            props["logprobs"] = logprobs if isinstance(logprobs, Mapping) else _plain(logprobs)
        index = choice.get("index")
        if isinstance(index, int) and index:  # n > 1: which choice this update belongs to
            props = {**(props or {}), "choice_index": index}
        others = (data.get("choices") or [])[1:]  # several choices in one chunk: one update each
        if others:
            more = [
                update_from_openai_chunk({**data, "choices": [c]}, provider=provider)
                for c in others
            ]
            props = {**(props or {}), "more_choices": more}
    return ChatResponseUpdate(
        role=role,
        contents=contents,
        finish_reason=finish,
        model_id=_str_or_none(data.get("model")),
        response_id=_str_or_none(data.get("id")),
        usage=usage_from_openai(data.get("usage")),
        created_at=_created(data.get("created")),
        raw_representation=chunk,
        additional_properties=props,
    )
