"""OpenAIChatClient: a ChatClient for any OpenAI-compatible chat-completions endpoint."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import orjson
from typing_extensions import Unpack

from chatroute.chat.types import ChatMessage, ChatOptions, ChatResponse, ChatResponseUpdate
from chatroute.errors import UpstreamStreamError, redact
from chatroute.providers.http_base import HTTPChatClient, HTTPSettings, StreamTranslator
from chatroute.providers.mapping import (
    MaxTokensParam,
    build_request,
    response_from_openai,
    update_from_openai_chunk,
)
from chatroute.providers.pass_through import passed_extras

if TYPE_CHECKING:
    from chatroute.config import ProviderConfig

__all__ = ["OpenAIChatClient"]


def _error_event(
    data: Mapping[str, Any], provider: str, secrets: tuple[str, ...]
) -> UpstreamStreamError:
    """The error for an in-band `{"error": ...}` payload (a 200 answer, or a stream event)."""
    error = data.get("error")
    fields = error if isinstance(error, Mapping) else {"message": str(error)}
    message = fields.get("message")
    text = redact(message if isinstance(message, str) and message else "error event", secrets)
    code = fields.get("code")
    etype = fields.get("type")
    return UpstreamStreamError(
        f"the upstream sent an error event: {text}",
        error_type=etype if isinstance(etype, str) else None,
        error_code=str(code) if code is not None else None,
        error_message=text,
        provider=provider,
    )


class _Chunks:
    """Reads one chat-completions stream: `chat.completion.chunk` events, then `[DONE]`."""

    __slots__ = ("client", "done", "ended", "finished", "seen")

    def __init__(self, client: OpenAIChatClient) -> None:
        self.client = client
        self.finished = False  # each choice's finish reason or [DONE] arrived: complete
        self.ended = False  # [DONE] arrived
        self.seen: set[int] = set()  # the choices (n > 1) seen, and those finished
        self.done: set[int] = set()

    def feed(self, event: str | None, data: str) -> ChatResponseUpdate | None:
        if data.strip() == "[DONE]":
            self.ended = self.finished = True
            return None
        payload = orjson.loads(data)
        if not isinstance(payload, dict):
            raise ValueError("the chunk is not a JSON object")
        if payload.get("error") or event == "error":
            raise _error_event(payload, self.client.name, self.client._secrets)
        update = update_from_openai_chunk(payload, provider=self.client.name)
        props = update.additional_properties or {}
        for each in (update, *props.get("more_choices", ())):
            index = (each.additional_properties or {}).get("choice_index", 0)
            if each.contents or each.role is not None or each.finish_reason is not None:
                self.seen.add(index)
            if each.finish_reason is not None:
                self.done.add(index)
        self.finished = bool(self.done) and self.seen <= self.done
        return update


class OpenAIChatClient(HTTPChatClient):
    """A provider for any OpenAI-compatible `base_url` (`POST {base_url}/chat/completions`).

    The transport, time limits, streaming commit rule and error classification are
    `HTTPChatClient`'s; this class translates. Requests carry `ChatOptions` as the OpenAI
    body (`chatroute.providers.mapping.build_request`): `model_id` overrides `model`,
    `max_output_tokens` is sent as `max_tokens_param`, `additional_properties` pass
    through as extra body fields (the caller's unknown fields as `pass_through` allows:
    "all", "none" or a set of names), then `extra_body`; streams ask for usage. Responses name
    the model the upstream reports in `model_id` and this client's `name` in
    `additional_properties["provider"]`. A stream is complete at a finish reason or
    `[DONE]`; an `{"error": ...}` payload in a 200 answer or stream is an
    `UpstreamStreamError`.

    Keys go as `Authorization: Bearer <key>`, or as Azure OpenAI's `api-key: <key>` with
    `api_key_header="api-key"`; without a key no credentials are sent. `default_query`
    parameters (Azure's `api-version`) go on every call.
    """

    path = "chat/completions"
    models_path = "models"
    reserved_body_keys = frozenset({"model", "messages", "stream", "stream_options"})

    def __init__(
        self,
        model: str | None = None,
        *,
        max_tokens_param: MaxTokensParam = "max_tokens",
        include_usage: bool = True,
        send_reasoning: bool = True,
        api_key_header: Literal["authorization", "api-key"] = "authorization",
        **settings: Unpack[HTTPSettings],
    ) -> None:
        if api_key_header not in ("authorization", "api-key"):
            raise ValueError(
                f"api_key_header must be 'authorization' or 'api-key', got {api_key_header!r}"
            )
        if max_tokens_param not in ("max_tokens", "max_completion_tokens"):
            raise ValueError(
                f"max_tokens_param must be 'max_tokens' or 'max_completion_tokens', "
                f"got {max_tokens_param!r}"
            )
        self.api_key_header = api_key_header
        self.max_tokens_param: MaxTokensParam = max_tokens_param
        self.include_usage = include_usage
        self.send_reasoning = send_reasoning
        settings["base_url"] = settings.get("base_url") or "https://api.openai.com/v1"
        super().__init__(model, **settings)

    @classmethod
    def from_config(cls, settings: ProviderConfig, **common: Any) -> OpenAIChatClient:
        """The client a config's provider entry describes (`common`: the settings every
        HTTP provider takes, built by the registry)."""
        return cls(
            max_tokens_param=settings.max_tokens_param,
            api_key_header=settings.api_key_header,
            **common,
        )

    def _auth_headers(self, api_key: str | None) -> dict[str, str]:
        if not api_key:
            return {}  # local servers, vLLM, Ollama: no credentials at all
        if self.api_key_header == "api-key":
            return {"api-key": api_key}  # Azure OpenAI
        return {"Authorization": f"Bearer {api_key}"}

    def _build_body(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None, *, stream: bool
    ) -> dict[str, Any]:
        return build_request(
            messages,
            options,
            default_model=self.model,
            stream=stream,
            max_tokens_param=self.max_tokens_param,
            include_usage=self.include_usage,
            send_reasoning=self.send_reasoning,
            extra_body=self.extra_body,
            pass_through=self.pass_through,
        )

    def _ignored_params(self, options: ChatOptions | None) -> list[str]:
        return passed_extras(options, self.pass_through)[1]

    def _read_answer(self, data: dict[str, Any]) -> ChatResponse:
        if data.get("error"):
            raise _error_event(data, self.name, self._secrets)
        return response_from_openai(data, provider=self.name)

    def _translator(self) -> StreamTranslator:
        return _Chunks(self)
