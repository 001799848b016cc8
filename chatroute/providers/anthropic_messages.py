"""AnthropicChatClient: Anthropic's Messages API, translated to and from chatroute's chat types."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from typing_extensions import Unpack

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
from chatroute.errors import UpstreamStreamError, error_fields, redact
from chatroute.providers.http_base import HTTPChatClient, HTTPSettings, StreamTranslator
from chatroute.providers.mapping import OPENAI_EXTRA_FIELDS, _result_text, tool_to_openai
from chatroute.providers.pass_through import PassThrough, passed_extras

if TYPE_CHECKING:
    from chatroute.config import ProviderConfig

__all__ = [
    "AnthropicChatClient",
    "build_anthropic_request",
    "finish_reason_from_anthropic",
    "response_from_anthropic",
    "usage_from_anthropic",
]

DEFAULT_BASE_URL = "https://api.anthropic.com"
DEFAULT_MAX_TOKENS = 4096

_FINISH = {
    "end_turn": ChatFinishReason.STOP,
    "stop_sequence": ChatFinishReason.STOP,
    "pause_turn": ChatFinishReason.STOP,
    "max_tokens": ChatFinishReason.LENGTH,
    "model_context_window_exceeded": ChatFinishReason.LENGTH,
    "tool_use": ChatFinishReason.TOOL_CALLS,
    "refusal": ChatFinishReason.CONTENT_FILTER,
}

# Extended-thinking budgets (tokens) for the OpenAI `reasoning_effort` words.
THINKING_BUDGETS: Mapping[str, int] = {
    "minimal": 1024,
    "low": 2048,
    "medium": 8192,
    "high": 24576,
}

# OpenAI request fields that reach `ChatOptions.additional_properties` from the service's
# wire format and have no Messages API counterpart: dropped rather than sent (the API
# refuses unknown fields). `parallel_tool_calls` is translated (see `_tool_choice`).
_OPENAI_ONLY = frozenset({*OPENAI_EXTRA_FIELDS, "max_completion_tokens"})
# Of those, the ones a request's other fields already stand for (not dropped).
_TRANSLATED = frozenset({"parallel_tool_calls", "max_completion_tokens", "n"})
_UNSENT_OPTIONS = ("seed", "frequency_penalty", "presence_penalty")
_RESERVED_BODY_KEYS = frozenset({"model", "messages", "stream", "system", "max_tokens"})


# ---------------------------------------------------------------------------- requests


def _tool_input(call: FunctionCallContent) -> Any:
    text = call.arguments or ""
    if not text.strip():
        return {}
    try:
        return json.loads(text)
    except ValueError:
        raise ValueError(
            f"the arguments of tool call {call.call_id or call.name!r} are not JSON"
        ) from None


# The image types the Messages API takes.
_IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})


def _media_block(content: DataContent | UriContent | HostedFileContent) -> dict[str, Any]:
    """The Messages API block for an image or a document; ValueError for what the API
    cannot take (audio, files uploaded elsewhere, other types)."""
    if isinstance(content, UriContent):
        return {"type": "image", "source": {"type": "url", "url": content.uri}}
    if isinstance(content, HostedFileContent):
        raise ValueError(
            f"file {content.file_id!r} was uploaded to another provider; "
            "the Anthropic Messages API cannot read it"
        )
    media_type = content.media_type
    source = {"type": "base64", "media_type": media_type, "data": content.base64_data}
    if media_type in _IMAGE_TYPES:
        return {"type": "image", "source": source}
    if media_type == "application/pdf":
        block: dict[str, Any] = {"type": "document", "source": source}
    elif media_type == "text/plain":
        try:
            text = content.data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("a text/plain document is not UTF-8") from None
        source = {"type": "text", "media_type": media_type, "data": text}
        block = {"type": "document", "source": source}
    else:
        raise ValueError(
            f"the Anthropic Messages API takes images (jpeg, png, gif, webp) and PDF or "
            f"plain-text documents, not {media_type}"
        )
    if content.name:
        block["title"] = content.name
    return block


def _blocks(message: ChatMessage) -> list[dict[str, Any]]:
    """The Messages API content blocks of one non-system message."""
    blocks: list[dict[str, Any]] = []
    for content in message.contents:
        if isinstance(content, TextContent):
            if content.text:  # the API refuses empty text blocks
                blocks.append({"type": "text", "text": content.text})
        elif isinstance(content, FunctionCallContent):
            blocks.append(
                {
                    "type": "tool_use",
                    "id": content.call_id or f"toolu_{len(blocks)}",
                    "name": content.name or "",
                    "input": _tool_input(content),
                }
            )
        elif isinstance(content, FunctionResultContent):
            blocks.append(
                {
                    "type": "tool_result",
                    "tool_use_id": content.call_id,
                    "content": _result_text(content.result),
                }
            )
        elif isinstance(content, (DataContent, UriContent, HostedFileContent)):
            blocks.append(_media_block(content))
        elif isinstance(content, TextReasoningContent) and content.protected_data:
            # Earlier thinking goes back only with the signature the API issued for it
            # (thinking with tool use needs it); reasoning without one is left out.
            if content.text:
                blocks.append(
                    {
                        "type": "thinking",
                        "thinking": content.text,
                        "signature": content.protected_data,
                    }
                )
            else:
                blocks.append({"type": "redacted_thinking", "data": content.protected_data})
    refusal = (message.additional_properties or {}).get("refusal")
    if isinstance(refusal, str) and refusal and not any(b["type"] == "text" for b in blocks):
        blocks.append({"type": "text", "text": refusal})  # an earlier refusal, as its text
    return blocks


def messages_to_anthropic(
    messages: Sequence[ChatMessage], *, instructions: str | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """The `system` text and the `messages` array for chatroute messages.

    System messages (and `instructions`, first) become the `system` text, joined by blank
    lines. Tool results become `tool_result` blocks of a user turn, assistant tool calls
    `tool_use` blocks. Consecutive turns of the same role are merged into one, as the API
    expects (all results of one assistant turn in the next user turn).
    """
    if messages is None:
        raise TypeError("messages must not be None")
    system: list[str] = [instructions] if instructions else []
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise TypeError(f"messages[{i}] is {type(message).__name__}, not a ChatMessage")
        if message.role is ChatRole.SYSTEM:
            if message.text:
                system.append(message.text)
            continue
        role = "assistant" if message.role is ChatRole.ASSISTANT else "user"
        blocks = _blocks(message)
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})
    for turn in out:  # a turn of one text block is sent as plain text
        content = turn["content"]
        if len(content) == 1 and content[0]["type"] == "text":
            turn["content"] = content[0]["text"]
    return ("\n\n".join(system) if system else None), out


def _tool(tool: Any) -> dict[str, Any]:
    spec = tool_to_openai(tool)
    if spec.get("type") != "function" or not isinstance(spec.get("function"), Mapping):
        # Not an OpenAI function tool: taken to be a Messages API tool already.
        return dict(spec)
    function = spec["function"]
    out: dict[str, Any] = {
        "name": function.get("name", ""),
        "input_schema": function.get("parameters") or {"type": "object", "properties": {}},
    }
    if function.get("description"):
        out["description"] = function["description"]
    return out


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    out: dict[str, Any] | None
    if choice is None:
        out = None
    elif isinstance(choice, str):
        words = {"auto": "auto", "none": "none", "required": "any", "any": "any"}
        out = {"type": words[choice]} if choice in words else {"type": "tool", "name": choice}
    elif isinstance(choice, Mapping):
        function = choice.get("function")
        if choice.get("type") == "function" and isinstance(function, Mapping):
            out = {"type": "tool", "name": function.get("name", "")}
        else:
            out = dict(choice)
    else:
        raise TypeError(f"tool_choice must be a str or a dict, got {type(choice).__name__}")
    if parallel is False:
        out = dict(out) if out is not None else {"type": "auto"}
        if out.get("type") != "none":
            out["disable_parallel_tool_use"] = True
    return out


def _check_response_format(fmt: Any) -> None:
    kind = fmt.get("type") if isinstance(fmt, Mapping) else fmt
    if fmt is None or kind == "text":
        return
    raise ValueError(
        f"response_format {kind!r} is not supported by the Anthropic provider; "
        "describe the JSON shape in the prompt or use a route without it"
    )


def build_anthropic_request(
    messages: Sequence[ChatMessage],
    options: ChatOptions | None,
    *,
    default_model: str | None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    extra_body: Mapping[str, Any] | None = None,
    pass_through: PassThrough = "none",
) -> dict[str, Any]:
    """The Messages API request body for chatroute messages and options.

    `model_id` overrides the default model; `max_output_tokens` is `max_tokens` (which the
    API requires: `default_max_tokens` when unset); `stop_sequences`, `temperature` and
    `top_p` keep their names; `user` becomes `metadata.user_id`; tools and `tool_choice`
    are translated from the OpenAI forms (`parallel_tool_calls: false` sets
    `disable_parallel_tool_use`); a `reasoning` effort turns extended thinking on with the
    budget in `THINKING_BUDGETS` (and `max_tokens` raised to leave room for an answer).
    `seed` and the frequency and presence penalties have no counterpart and are not sent;
    a JSON `response_format` raises ValueError. `additional_properties` are sent as extra
    body fields, less the OpenAI-only ones (`logprobs`, `store`, ...) and the caller's
    unknown fields `pass_through` drops; `extra_body` last (it wins). `n` above 1 raises
    ValueError (the API answers one choice).
    """
    options = options if options is not None else ChatOptions()
    model = options.model_id or default_model
    if not model:
        raise ValueError("no model: set the client's model or ChatOptions.model_id")
    _check_response_format(options.response_format)
    n = (options.additional_properties or {}).get("n")
    if n is not None and n != 1:
        raise ValueError(f"n={n}: the Anthropic Messages API answers one choice; send n=1")
    system, turns = messages_to_anthropic(messages, instructions=options.instructions)
    max_tokens = options.max_output_tokens or default_max_tokens
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": turns}
    if system:
        body["system"] = system
    if options.temperature is not None:
        body["temperature"] = options.temperature
    if options.top_p is not None:
        body["top_p"] = options.top_p
    if options.stop_sequences:
        body["stop_sequences"] = list(options.stop_sequences)
    if options.user:
        body["metadata"] = {"user_id": options.user}
    if options.tools:
        body["tools"] = [_tool(tool) for tool in options.tools]
    extra, _ = passed_extras(options, pass_through)
    choice = _tool_choice(options.tool_choice, extra.get("parallel_tool_calls"))
    if choice is not None:
        body["tool_choice"] = choice
    effort = options.reasoning.get("effort") if isinstance(options.reasoning, Mapping) else None
    if isinstance(effort, str) and effort in THINKING_BUDGETS:
        budget = THINKING_BUDGETS[effort]
        body["thinking"] = {"type": "enabled", "budget_tokens": budget}
        if max_tokens <= budget:
            body["max_tokens"] = budget + max_tokens
    for source in (extra, extra_body or {}):
        for key, value in source.items():
            if key not in _OPENAI_ONLY and key not in _RESERVED_BODY_KEYS:
                body[key] = value
    return body


# ---------------------------------------------------------------------------- responses


def _get(obj: Any, name: str) -> Any:
    """A field of an SDK object or of a plain dict."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def finish_reason_from_anthropic(reason: str | None) -> ChatFinishReason | str | None:
    """The chat finish reason of a Messages API `stop_reason` (unknown ones kept as text)."""
    if reason is None:
        return None
    return _FINISH.get(reason, reason)


def usage_from_anthropic(usage: Any) -> UsageDetails | None:
    """Token counts: input counts cache reads and writes too (as OpenAI's prompt tokens do),
    which are also kept apart in `additional_counts`."""
    if usage is None:
        return None
    base = _get(usage, "input_tokens")
    base = base if isinstance(base, int) else None
    extra: dict[str, int] = {}
    for key in ("cache_creation_input_tokens", "cache_read_input_tokens"):
        value = _get(usage, key)
        if isinstance(value, int) and value:
            extra[key] = value
    output = _get(usage, "output_tokens")
    output = output if isinstance(output, int) else None
    total_input = base + sum(extra.values()) if base is not None else None
    total = total_input + output if total_input is not None and output is not None else None
    cached = extra.get("cache_read_input_tokens", 0) if base is not None else None
    return UsageDetails(total_input, output, total, extra, cached_input_token_count=cached)


def _content_of(block: Any, tool_index: int) -> Content | None:
    kind = _get(block, "type")
    if kind == "text":
        text = _get(block, "text")
        return TextContent(text) if isinstance(text, str) and text else None
    if kind == "thinking":
        text = _get(block, "thinking")
        signature = _get(block, "signature")
        if not isinstance(text, str) or not text:
            return None
        return TextReasoningContent(text, signature if isinstance(signature, str) else None)
    if kind == "redacted_thinking":
        data = _get(block, "data")
        return TextReasoningContent("", data) if isinstance(data, str) and data else None
    if kind == "tool_use":
        arguments = json.dumps(_get(block, "input") or {}, separators=(",", ":"))
        return FunctionCallContent(_get(block, "id"), _get(block, "name"), arguments, tool_index)
    return None  # server tool blocks and the like: nothing to show the caller


def response_from_anthropic(message: Any, *, provider: str | None = None) -> ChatResponse:
    """A `ChatResponse` from a Messages API message (an SDK object or a plain dict)."""
    contents: list[Content] = []
    tools = 0
    for block in _get(message, "content") or ():
        content = _content_of(block, tools)
        if isinstance(content, FunctionCallContent):
            tools += 1
        if content is not None:
            contents.append(content)
    return ChatResponse(
        messages=[ChatMessage(ChatRole.ASSISTANT, contents=contents)],
        model_id=_get(message, "model"),
        finish_reason=finish_reason_from_anthropic(_get(message, "stop_reason")),
        usage=usage_from_anthropic(_get(message, "usage")),
        response_id=_get(message, "id"),
        created_at=time.time(),
        raw_representation=message,
        additional_properties={"provider": provider} if provider else None,
    )


# ---------------------------------------------------------------------------- errors


def in_band_error(
    body: Any,
    *,
    provider: str | None,
    secrets: tuple[str, ...] = (),
    after_output: bool = False,
    fallback: str | None = None,
) -> UpstreamStreamError:
    """The error for an `error` event of a stream (or an error object answered with a 200):
    `body` is the event's JSON, `fallback` the text used when it holds no message."""
    etype, code, message = error_fields(body)
    text = message or fallback
    return UpstreamStreamError(
        f"the upstream sent an error event: {redact(text, secrets) if text else 'error event'}",
        error_type=etype,
        error_code=code,
        error_message=redact(message, secrets) if message is not None else None,
        provider=provider,
        after_output=after_output,
    )


# ---------------------------------------------------------------------------- the client

# The API version the anthropic SDK (2.x) sends, and its key header: a Bearer token.
ANTHROPIC_VERSION = "2026-10-21"


class AnthropicChatClient(HTTPChatClient):
    """A provider for Anthropic's Messages API (`POST {base_url}/v1/messages`).

    The transport, time limits, streaming commit rule and error classification are
    `HTTPChatClient`'s; this class translates. Requests and answers are translated to and
    from chatroute's types (`build_anthropic_request`, `response_from_anthropic`): system
    messages become the `system` text, tool calls and results `tool_use` / `tool_result`
    blocks, thinking blocks `TextReasoningContent`, `stop_reason` the finish reason, and
    usage counts (cache reads and writes included in the input count). HTTP errors are
    classified like the OpenAI provider's (429 with its Retry-After, 529 overloaded as a
    server error, "prompt is too long" as a context-length error); `request-id` is the
    request id.

    Thinking comes back as `TextReasoningContent` whose `protected_data` holds the
    block's signature (a redacted block: empty text, its data), and such reasoning is
    sent back as thinking blocks, as tool use with extended thinking requires; reasoning
    without it is left out of requests. Streamed reasoning carries no signature.

    A stream is complete at `message_delta`'s `stop_reason`; `ping` and unknown events are
    skipped; an `error` event is an `UpstreamStreamError`. `api_key` goes as the anthropic
    SDK sends it (`Authorization: Bearer`, with `anthropic-version: 2026-10-21`); without
    one no credentials are sent (nothing is read from the environment by this class).
    """

    path = "v1/messages"
    models_path = "v1/models"
    default_base_url = DEFAULT_BASE_URL
    default_pass_through = "none"
    reserved_body_keys = _RESERVED_BODY_KEYS
    request_id_headers = ("request-id", "x-request-id")

    def __init__(
        self,
        model: str | None = None,
        *,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        **settings: Unpack[HTTPSettings],
    ) -> None:
        if default_max_tokens < 1:
            raise ValueError("default_max_tokens must be a positive token count")
        self.default_max_tokens = default_max_tokens
        super().__init__(model, **settings)

    @classmethod
    def from_config(cls, settings: ProviderConfig, **common: Any) -> AnthropicChatClient:
        """The client a config's provider entry describes (`common`: the settings every
        HTTP provider takes, built by the registry)."""
        return cls(default_max_tokens=settings.default_max_tokens, **common)

    def _auth_headers(self, api_key: str | None) -> dict[str, str]:
        return {"anthropic-version": ANTHROPIC_VERSION, **super()._auth_headers(api_key)}

    def _status_label(self, etype: str | None, code: str | None) -> str | None:
        return etype or code

    def _build_body(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None, *, stream: bool
    ) -> dict[str, Any]:
        body = build_anthropic_request(
            messages,
            options,
            default_model=self.model,
            default_max_tokens=self.default_max_tokens,
            extra_body=self.extra_body,
            pass_through=self.pass_through,
        )
        body["stream"] = stream
        return body

    def _ignored_params(self, options: ChatOptions | None) -> list[str]:
        """The caller's unknown fields `pass_through` drops, the OpenAI-only fields and
        the options the Messages API has no counterpart for."""
        if options is None:
            return []
        _, dropped = passed_extras(options, self.pass_through)
        extra = options.additional_properties or {}
        dropped += [key for key in extra if key in _OPENAI_ONLY and key not in _TRANSLATED]
        dropped += [name for name in _UNSENT_OPTIONS if getattr(options, name) is not None]
        return sorted(set(dropped))

    def _read_answer(self, data: dict[str, Any]) -> ChatResponse:
        if data.get("type") == "error":
            raise in_band_error(data, provider=self.name, secrets=self._secrets, fallback=str(data))
        return response_from_anthropic(data, provider=self.name)

    def _translator(self) -> StreamTranslator:
        return _StreamState(self.name, self._secrets)


# The stream events read (as the SDK reads them); `ping` and unknown events are skipped.
_STREAM_EVENTS = frozenset(
    {
        "message_start",
        "message_delta",
        "message_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "error",
    }
)


class _StreamState:
    """What a Messages API stream has said so far, and the update each event makes."""

    def __init__(self, provider: str, secrets: tuple[str, ...]) -> None:
        self.provider = provider
        self.secrets = secrets
        self.response_id: str | None = None
        self.model: str | None = None
        self.start_usage: Any = None
        self.finish: ChatFinishReason | str | None = None
        self.ended = False  # message_stop arrived
        self.tool_index: dict[int, int] = {}  # block index -> tool call index

    def _update(self, contents: list[Content], **fields: Any) -> ChatResponseUpdate:
        return ChatResponseUpdate(
            role=ChatRole.ASSISTANT,
            contents=contents,
            model_id=self.model,
            response_id=self.response_id,
            additional_properties={"provider": self.provider},
            **fields,
        )

    @property
    def finished(self) -> bool:
        """Whether the answer is complete (a stop_reason arrived)."""
        return self.finish is not None

    def feed(self, name: str | None, data: str) -> ChatResponseUpdate | None:
        """The update for one server-sent event (None for most)."""
        if name not in _STREAM_EVENTS:
            return None  # ping, and events this client does not know
        if name == "error":  # its data is the error's JSON, or else its text
            try:
                error: Any = orjson.loads(data)
            except orjson.JSONDecodeError:
                error = data
            raise in_band_error(
                error,
                provider=self.provider,
                secrets=self.secrets,
                fallback=data,
            )
        event = orjson.loads(data)
        if not isinstance(event, dict):
            raise ValueError("the event is not a JSON object")
        kind = _get(event, "type")
        if kind == "message_start":
            message = _get(event, "message")
            self.response_id = _get(message, "id")
            self.model = _get(message, "model")
            self.start_usage = _get(message, "usage")
            return None
        if kind == "content_block_start":
            index = _get(event, "index")
            block = _get(event, "content_block")
            if _get(block, "type") == "tool_use":
                self.tool_index[index] = len(self.tool_index)
                call = FunctionCallContent(
                    _get(block, "id"), _get(block, "name"), "", self.tool_index[index]
                )
                return self._update([call])
            # A block's opening text, if any (usually empty); redacted thinking is not
            # output, and signatures are not streamed on (see the class docstring).
            if _get(block, "type") not in ("text", "thinking"):
                return None
            started = _content_of(block, 0)
            if isinstance(started, TextReasoningContent):
                started.protected_data = None
            return self._update([started]) if started is not None else None
        if kind == "content_block_delta":
            delta = _get(event, "delta")
            dtype = _get(delta, "type")
            content: Content | None = None
            if dtype == "text_delta":
                text = _get(delta, "text")
                content = TextContent(text) if text else None
            elif dtype == "thinking_delta":
                text = _get(delta, "thinking")
                content = TextReasoningContent(text) if text else None
            elif dtype == "input_json_delta":
                part = _get(delta, "partial_json")
                index = self.tool_index.get(_get(event, "index"))
                if part and index is not None:
                    content = FunctionCallContent(None, None, part, index)
            return self._update([content]) if content is not None else None
        if kind == "message_delta":
            reason = _get(_get(event, "delta"), "stop_reason")
            if reason is None:
                return None
            self.finish = finish_reason_from_anthropic(reason)
            return self._update([], finish_reason=self.finish, usage=self._usage(event))
        if kind == "message_stop":
            self.ended = True
            return None
        return None  # content_block_stop, ping, unknown events

    def _usage(self, event: Any) -> UsageDetails | None:
        """The closing usage: the counts of `message_delta`, with those only
        `message_start` carried (input and cache counts, in most streams)."""
        closing = _get(event, "usage")
        if closing is None and self.start_usage is None:
            return None
        counts: dict[str, int] = {}
        for key in (
            "input_tokens",
            "cache_creation_input_tokens",
            "cache_read_input_tokens",
            "output_tokens",
        ):
            value = _get(closing, key)
            if not isinstance(value, int) and key != "output_tokens":
                value = _get(self.start_usage, key)
            if isinstance(value, int):
                counts[key] = value
        return usage_from_anthropic(counts)
