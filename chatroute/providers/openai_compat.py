"""OpenAIChatClient: a ChatClient for any OpenAI-compatible chat-completions endpoint."""

from __future__ import annotations

import asyncio
import copy
import logging
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal

import openai

from chatroute._json import loads as json_loads
from chatroute._timer import timeout, timeout_at
from chatroute.chat.client import ChatClient
from chatroute.chat.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    FunctionCallContent,
    TextContent,
    TextReasoningContent,
)
from chatroute.providers._checks import check_call_args, check_client_args
from chatroute.providers._http import http
from chatroute.providers._sdk_http import (
    SDKTransport,
    _Body,
    _close_uninterruptibly,
    _owned_http_client,
    _SSEReader,
)
from chatroute.providers.errors import (
    FirstTokenTimeoutError,
    MalformedResponseError,
    ProviderError,
    ProviderTimeoutError,
    StreamStallTimeoutError,
    TruncatedStreamError,
    UpstreamStreamError,
    redact,
    translate_openai_error,
)
from chatroute.providers.mapping import (
    MaxTokensParam,
    build_request,
    response_from_openai,
    update_from_openai_chunk,
)

__all__ = ["OpenAIChatClient"]

_log = logging.getLogger(__name__)


class _Keep:
    """The type of `_KEEP`: "leave this setting as it is"."""


_KEEP = _Keep()

_RESERVED_BODY_KEYS = frozenset({"model", "messages", "stream", "stream_options"})


def _positive(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number or None, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return float(value)


_TEXTS = (TextContent, TextReasoningContent)  # a tuple: no union object per call


def _is_content(update: ChatResponseUpdate) -> bool:
    """Whether an update carries content (text, reasoning, a tool call or a refusal), not just
    metadata."""
    for content in update.contents:
        if isinstance(content, _TEXTS):
            if content.text:
                return True
        elif isinstance(content, FunctionCallContent):
            return True
        else:
            return True
    props = update.additional_properties
    return props is not None and "refusal" in props  # set only for refusal text


def _merge(held: list[ChatResponseUpdate], update: ChatResponseUpdate) -> ChatResponseUpdate:
    """Fold the metadata of held non-content updates into `update` (which wins)."""
    for earlier in reversed(held):
        update.role = update.role or earlier.role
        update.response_id = update.response_id or earlier.response_id
        update.model_id = update.model_id or earlier.model_id
        update.created_at = (
            update.created_at if update.created_at is not None else (earlier.created_at)
        )
        update.usage = update.usage or earlier.usage
        update.finish_reason = update.finish_reason or earlier.finish_reason
    return update


class OpenAIChatClient(SDKTransport, ChatClient):
    """A provider over the official `openai` SDK for any OpenAI-compatible `base_url`.

    The SDK's own retries are off (`max_retries=0`): retrying and failing over belong to
    the failover policy. Every failure surfaces as a typed `ProviderError` (see
    `chatroute.providers.errors`) with the original exception as `__cause__`;
    `asyncio.CancelledError` passes through untouched.

    Time limits (seconds, None for none):
      - `connect_timeout`: establishing the TCP connection.
      - `read_timeout`: the longest silence between two socket reads.
      - `request_timeout`: a whole attempt (non-streaming), or a whole stream.
      - `first_token_timeout` (streams): from the call to the first content-bearing event.
        Raises `FirstTokenTimeoutError`.
      - `stall_timeout` (streams): the longest gap between two chunks after the first
        content. Raises `StreamStallTimeoutError`.
      - `tail_timeout` (streams): after the finish reason, the longest wait for the usage
        chunk and the end of the body; when it runs out the stream simply ends.
    All raise `ProviderTimeoutError`s, which are `TimeoutError`s.

    Streaming follows the commit rule: nothing is yielded before the first content-bearing
    event (text, reasoning or a tool call); role-only deltas and empty-choices chunks
    before it are folded into that first update. An in-band error event, a malformed
    chunk or a broken connection raises from the iterator; a stream that ends without a
    finish reason raises `TruncatedStreamError`. Closing the iterator closes the HTTP
    response, and so the connection, at once.

    Requests carry `ChatOptions` as the OpenAI body: `model_id` overrides `model`,
    `max_output_tokens` is sent as `max_tokens_param`, `additional_properties` pass
    through as extra body fields. Responses name the model the upstream reports in
    `model_id` and this client's `name` in `additional_properties["provider"]`.

    Keys go as `Authorization: Bearer <key>`, or as Azure OpenAI's `api-key: <key>` with
    `api_key_header="api-key"`; `default_query` parameters (Azure's `api-version`) go on
    every call.

    TLS: `verify` is True (the system CA bundle, loaded once per process), False, a CA
    bundle path or an `ssl.SSLContext`. The client owns the SDK client and its pooled HTTP
    clients (its connection pool and the SDK's httpx client) unless `http_client` is given
    (then that one is the caller's to close); `aclose()` is idempotent.

    Per-request cost: the SDK client supplies the URL, headers, timeouts and error types,
    but a call does not go through the SDK's per-request machinery; the request the SDK
    would send is built here (see `_send`). An owned client (no `http_client`) sends it
    on its own pool of HTTP/1.1 keep-alive connections (`chatroute.providers._h1`), closed
    by `aclose()`, with no httpx request or response on the way unless the call fails
    (errors are then the SDK's, made from the httpx errors the pool raises); the SDK
    client's own httpx client sends nothing then. A given `http_client` is used as it is:
    the request is an httpx one sent on that client. The owned pool keeps no cookies: what
    an upstream sets for one call is never sent with another. When the environment routes
    `base_url` through a proxy (`HTTPS_PROXY` / `HTTP_PROXY` / `ALL_PROXY`, less
    `NO_PROXY`), an owned client sends on an httpx client that uses it instead of the pool.
    """

    _sdk_timeout_error = openai.APITimeoutError
    _sdk_connection_error = openai.APIConnectionError
    # What the SDK sends for a raw streamed response, which is how this client reads one.
    _sdk_call_headers = {"X-Stainless-Raw-Response": "stream"}

    def __init__(
        self,
        model: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        name: str | None = None,
        connect_timeout: float | None = 5.0,
        read_timeout: float | None = 300.0,
        write_timeout: float | None = 30.0,
        pool_timeout: float | None = 10.0,
        request_timeout: float | None = None,
        first_token_timeout: float | None = None,
        stall_timeout: float | None = None,
        tail_timeout: float = 2.0,
        max_connections: int = 100,
        max_keepalive_connections: int = 20,
        keepalive_expiry: float = 30.0,
        default_headers: Mapping[str, str] | None = None,
        max_tokens_param: MaxTokensParam = "max_tokens",
        include_usage: bool = True,
        send_reasoning: bool = True,
        extra_body: Mapping[str, Any] | None = None,
        context_window: int | None = None,
        verify: bool | str | ssl.SSLContext = True,
        http_client: http.AsyncClient | None = None,
        api_key_header: Literal["authorization", "api-key"] = "authorization",
        default_query: Mapping[str, str] | None = None,
    ) -> None:
        if api_key_header not in ("authorization", "api-key"):
            raise ValueError(
                f"api_key_header must be 'authorization' or 'api-key', got {api_key_header!r}"
            )
        check_client_args(
            model=model,
            max_connections=max_connections,
            max_keepalive_connections=max_keepalive_connections,
            context_window=context_window,
            extra_body=extra_body,
            reserved_body_keys=_RESERVED_BODY_KEYS,
        )
        if base_url is not None and not isinstance(base_url, str):
            raise TypeError("base_url must be a string")
        if api_key is not None and not isinstance(api_key, str):
            raise TypeError("api_key must be a string or None")
        if max_tokens_param not in ("max_tokens", "max_completion_tokens"):
            raise ValueError(
                f"max_tokens_param must be 'max_tokens' or 'max_completion_tokens', "
                f"got {max_tokens_param!r}"
            )
        self.model = model
        self.base_url = base_url or "https://api.openai.com/v1"
        self.name = name or model or self.base_url
        self.connect_timeout = _positive("connect_timeout", connect_timeout)
        self.read_timeout = _positive("read_timeout", read_timeout)
        self.request_timeout = _positive("request_timeout", request_timeout)
        self.first_token_timeout = _positive("first_token_timeout", first_token_timeout)
        self.stall_timeout = _positive("stall_timeout", stall_timeout)
        self.tail_timeout = _positive("tail_timeout", tail_timeout) or 2.0
        self.max_tokens_param: MaxTokensParam = max_tokens_param
        self.include_usage = include_usage
        self.send_reasoning = send_reasoning
        self.extra_body = dict(extra_body) if extra_body else None
        self.context_window = context_window
        self._secrets: tuple[str, ...] = (api_key,) if api_key else ()
        self._closed = False
        self._parent: OpenAIChatClient | None = None

        timeout = http.Timeout(
            connect=self.connect_timeout,
            read=self.read_timeout,
            write=_positive("write_timeout", write_timeout),
            pool=_positive("pool_timeout", pool_timeout),
        )
        self._owns_http = http_client is None
        tls: ssl.SSLContext | None = None  # the own pool's, when it sends
        if http_client is None:
            http_client, tls = _owned_http_client(
                self.base_url,
                timeout=timeout,
                verify=verify,
                max_connections=max_connections,
                max_keepalive_connections=max_keepalive_connections,
                keepalive_expiry=keepalive_expiry,
            )
        self._extra_headers = {}
        if not api_key:
            # No key: send no Authorization header at all (local servers, vLLM, Ollama).
            self._extra_headers["Authorization"] = openai.omit
        elif api_key_header == "api-key":
            # Azure OpenAI's key header, instead of `Authorization: Bearer`.
            self._extra_headers["Authorization"] = openai.omit
            self._extra_headers["api-key"] = api_key
        self._client = openai.AsyncOpenAI(
            api_key=api_key or "unused",
            base_url=self.base_url,
            max_retries=0,
            timeout=timeout,
            default_headers=dict(default_headers) if default_headers else None,
            http_client=http_client,
            default_query=dict(default_query) if default_query else None,
        )
        # An owned client sends on its own connection pool (shared by `with_timeouts`
        # views); a given `http_client` is sent on. Azure's api-version, say, is a default
        # query parameter: on every call.
        self._init_transport(
            self._client,
            http_client,
            b"chat/completions",
            timeout,
            default_query=default_query,
            tls=tls,
            max_connections=max_connections,
            keepalive_expiry=keepalive_expiry,
        )

    def __repr__(self) -> str:
        return (
            f"OpenAIChatClient(name={self.name!r}, model={self.model!r}, "
            f"base_url={self.base_url!r})"
        )

    def with_timeouts(
        self,
        *,
        request_timeout: float | _Keep | None = _KEEP,
        first_token_timeout: float | _Keep | None = _KEEP,
        stall_timeout: float | _Keep | None = _KEEP,
        tail_timeout: float | _Keep = _KEEP,
    ) -> OpenAIChatClient:
        """A view of this provider with other time limits (per route, say).

        The view shares this client's connection pool, name and settings; closing the view
        closes nothing, and it stops working once this client is closed.
        """
        view = copy.copy(self)
        view._owns_http = False
        view._closed = False
        view._parent = self
        if not isinstance(request_timeout, _Keep):
            view.request_timeout = _positive("request_timeout", request_timeout)
        if not isinstance(first_token_timeout, _Keep):
            view.first_token_timeout = _positive("first_token_timeout", first_token_timeout)
        if not isinstance(stall_timeout, _Keep):
            view.stall_timeout = _positive("stall_timeout", stall_timeout)
        if not isinstance(tail_timeout, _Keep):
            view.tail_timeout = _positive("tail_timeout", tail_timeout) or 2.0
        return view

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        """Close, when owned, the connection pool and the SDK's HTTP client; idempotent.

        A `with_timeouts` view closes nothing.
        """
        if self._closed:
            return
        self._closed = True
        if self._owns_http:
            await self._close_transport()

    def _check_open(self) -> None:
        if self._closed or (self._parent is not None and self._parent._closed):
            raise RuntimeError(f"OpenAIChatClient {self.name!r} is closed")

    def _request(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None, *, stream: bool
    ) -> dict[str, Any]:
        check_call_args(messages, options)
        return build_request(
            messages,
            options,
            default_model=self.model,
            stream=stream,
            max_tokens_param=self.max_tokens_param,
            include_usage=self.include_usage,
            send_reasoning=self.send_reasoning,
            extra_body=self.extra_body,
        )

    def _translate(
        self, exc: BaseException, *, in_stream: bool = False, after_output: bool = False
    ) -> BaseException:
        return translate_openai_error(
            exc,
            provider=self.name,
            secrets=self._secrets,
            in_stream=in_stream,
            after_output=after_output,
        )

    async def list_models(self) -> list[str]:
        """The model ids the endpoint lists (`GET /models`), to check a deployment: it is
        reachable, it takes the key, it serves the model. Failures are `ProviderError`s."""
        self._check_open()
        try:
            page = await self._client.models.list(extra_headers=self._extra_headers or None)
            return [model.id async for model in page]
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise self._translate(exc) from exc

    # ------------------------------------------------------------------ non-streaming

    async def _fetch(self, body: dict[str, Any]) -> bytes:
        """POST a non-streamed request and read the whole answer."""
        response = await self._send(body)
        try:
            return await response.aread()
        finally:
            await response.aclose()

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        self._check_open()
        body = self._request(messages, options, stream=False)
        limit = self.request_timeout
        try:
            if limit is None:
                raw = await self._fetch(body)
            else:
                async with timeout(limit):
                    raw = await self._fetch(body)
        except TimeoutError as exc:
            if isinstance(exc, ProviderError):
                raise
            raise ProviderTimeoutError(
                f"no answer within the request timeout of {self.request_timeout} s",
                provider=self.name,
            ) from exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise self._translate(exc) from exc
        try:
            data = json_loads(raw)
        except ValueError as exc:
            raise MalformedResponseError(
                f"the upstream answer is not JSON ({exc})", provider=self.name
            ) from exc
        if isinstance(data, dict) and data.get("error"):
            raise self._error_event(data, after_output=False)
        try:
            return response_from_openai(data, provider=self.name)
        except (ValueError, TypeError, AttributeError) as exc:
            raise MalformedResponseError(
                f"the upstream answer is not a chat completion ({exc})", provider=self.name
            ) from exc

    def _error_event(self, data: Mapping[str, Any], *, after_output: bool) -> ProviderError:
        """The error for an in-band `{"error": ...}` payload in a 200 answer."""
        error = data.get("error")
        fields = error if isinstance(error, Mapping) else {"message": str(error)}
        message = fields.get("message")
        text = message if isinstance(message, str) and message else "error event"
        code = fields.get("code")
        etype = fields.get("type")
        return UpstreamStreamError(
            f"the upstream sent an error event: {redact(text, self._secrets)}",
            provider=self.name,
            error_type=etype if isinstance(etype, str) else None,
            error_code=str(code) if code is not None else None,
            error_message=redact(text, self._secrets),
            after_output=after_output,
        )

    # ------------------------------------------------------------------ streaming

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        self._check_open()
        body = self._request(messages, options, stream=True)
        loop = asyncio.get_running_loop()
        started = loop.time()
        total_deadline = started + self.request_timeout if self.request_timeout else None
        first_deadline = started + self.first_token_timeout if self.first_token_timeout else None
        response: _Body | None = None
        events: _SSEReader | None = None
        committed = False
        finished = False  # a finish reason or [DONE] arrived: the answer is complete
        done = False  # [DONE] arrived

        def limit(phase_deadline: float | None) -> tuple[float | None, bool]:
            """The earliest deadline and whether it is the total one."""
            if total_deadline is not None and (
                phase_deadline is None or total_deadline <= phase_deadline
            ):
                return total_deadline, True
            return phase_deadline, False

        async def next_step() -> Any:
            """Send the request or read the next event, under the phase's time limit."""
            if finished:
                phase: float | None = loop.time() + self.tail_timeout
            elif committed:
                phase = loop.time() + self.stall_timeout if self.stall_timeout else None
            else:
                phase = first_deadline
            deadline, is_total = limit(phase)
            try:
                if deadline is None:
                    if response is None:
                        return await self._send(body)
                    assert events is not None
                    return await events.next()
                async with timeout_at(deadline):
                    if response is None:
                        return await self._send(body)
                    assert events is not None
                    return await events.next()
            except TimeoutError as exc:
                if isinstance(exc, ProviderError) or deadline is None:
                    raise
                if finished and not is_total:
                    return None  # the answer is complete; stop waiting for the tail
                if is_total:
                    raise ProviderTimeoutError(
                        f"the stream exceeded the request timeout of {self.request_timeout} s",
                        provider=self.name,
                        after_output=committed,
                    ) from exc
                if committed:
                    raise StreamStallTimeoutError(
                        f"no chunk for {self.stall_timeout} s (stall timeout)",
                        provider=self.name,
                        after_output=True,
                    ) from exc
                raise FirstTokenTimeoutError(
                    f"no content within the first-token timeout of {self.first_token_timeout} s",
                    provider=self.name,
                ) from exc

        try:
            try:
                response = await next_step()
            except ProviderError:
                raise
            except Exception as exc:
                raise self._translate(exc) from exc
            assert response is not None
            events = _SSEReader(response.aiter_bytes())

            held: list[ChatResponseUpdate] = []
            # Once output flows with no total or stall limit, no read has a time limit
            # until the finish: read events directly, without next_step's bookkeeping.
            unbounded = total_deadline is None and not self.stall_timeout
            while True:
                try:
                    if committed and unbounded and not finished:
                        event = await events.next()
                    else:
                        event = await next_step()
                except Exception as exc:
                    if finished:
                        # The answer is complete (finish reason or [DONE] seen); only the
                        # tail broke, so the stream ends normally.
                        _log.debug("provider %s: error after the finish: %r", self.name, exc)
                        break
                    if isinstance(exc, ProviderError):
                        raise
                    raise self._translate(exc, in_stream=True, after_output=committed) from exc
                if event is None:
                    break
                name, data = event
                if done:
                    continue  # nothing after [DONE] matters
                if data.strip() == "[DONE]":
                    done = finished = True
                    continue
                try:
                    payload = json_loads(data)
                except ValueError as exc:
                    raise MalformedResponseError(
                        f"the upstream sent a chunk that is not JSON ({exc})",
                        provider=self.name,
                        after_output=committed,
                    ) from exc
                if not isinstance(payload, dict):
                    raise MalformedResponseError(
                        "the upstream sent a chunk that is not a JSON object",
                        provider=self.name,
                        after_output=committed,
                    )
                if payload.get("error") or name == "error":
                    raise self._error_event(payload, after_output=committed)
                try:
                    update = update_from_openai_chunk(payload, provider=self.name)
                except (ValueError, TypeError, AttributeError) as exc:
                    raise MalformedResponseError(
                        f"the upstream sent a chunk that is not a chat completion chunk ({exc})",
                        provider=self.name,
                        after_output=committed,
                    ) from exc
                if update.finish_reason is not None:
                    finished = True
                if not committed:
                    if not _is_content(update):
                        held.append(update)
                        continue
                    update = _merge(held, update)
                    held.clear()
                    if update.role is None:
                        update.role = ChatRole.ASSISTANT
                    committed = True
                yield update
            if not finished:
                raise TruncatedStreamError(
                    "the stream ended without a finish reason or [DONE] (truncated)",
                    provider=self.name,
                    after_output=committed,
                )
            if held:
                # A complete answer with no content at all (an empty reply): emit it now.
                merged = held.pop()
                merged = _merge(held, merged)
                if merged.role is None:
                    merged.role = ChatRole.ASSISTANT
                yield merged
        finally:
            if response is not None:
                try:
                    await _close_uninterruptibly(response)
                except Exception as exc:  # closing must never hide the real outcome
                    _log.debug("provider %s: closing the stream failed: %r", self.name, exc)
