"""HTTPChatClient: the HTTP providers' base (transport, limits, SSE, commit rule, errors)."""

from __future__ import annotations

import asyncio
import copy
import datetime
import logging
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypedDict

import aiohttp
import orjson
import pydantic

from chatroute import __version__
from chatroute.chat.client import ChatClient
from chatroute.chat.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    carries_content,
)
from chatroute.errors import (
    MalformedResponseError,
    ProviderBadRequestError,
    ProviderConnectionError,
    ProviderError,
    ProviderStatusError,
    ProviderTimeoutError,
    StreamInterruptedError,
    StreamStallTimeoutError,
    TruncatedStreamError,
    error_fields,
    redact,
    status_error,
)
from chatroute.failover.timeouts import check_limit, head_within, stream_within, within
from chatroute.providers import request_hooks
from chatroute.providers.pass_through import PassThrough, report_ignored
from chatroute.providers.sse import SSEReader
from chatroute.providers.transport import Transport, tls_setting
from chatroute.tracing import note_upstream_request_id

if TYPE_CHECKING:
    from chatroute.config import ProviderConfig

__all__ = ["HTTPChatClient", "HTTPSettings", "StreamTranslator", "check_header_value"]

_log = logging.getLogger(__name__)

# The most of an error answer's body read to describe it (the rest is dropped with the
# connection).
MAX_ERROR_BODY = 64 * 1024


def _fits_a_header(value: str) -> bool:
    """Whether an upstream's id can be passed back in an answer header as it is."""
    return len(value) <= 200 and value.isascii() and value.isprintable()


class HTTPSettings(TypedDict, total=False):
    """The keyword arguments every HTTP provider takes (see `HTTPChatClient`), for a vendor
    class's `**settings`."""

    base_url: str | None
    api_key: str | None
    name: str | None
    connect_timeout: float | None
    read_timeout: float | None
    write_timeout: float | None
    pool_timeout: float | None
    request_timeout: float | None
    first_token_timeout: float | None
    stall_timeout: float | None
    tail_timeout: float
    max_connections: int
    max_keepalive_connections: int
    keepalive_expiry: float
    default_headers: Mapping[str, str] | None
    extra_body: Mapping[str, Any] | None
    context_window: int | None
    verify: bool | str | ssl.SSLContext
    default_query: Mapping[str, str] | None
    pass_through: PassThrough | None


class _Keep:
    """The type of `_KEEP`: "leave this setting as it is"."""


_KEEP = _Keep()


def check_header_value(name: str, value: str) -> None:
    """Raise ValueError naming the header when its name or value could split the request
    head (CR, LF or NUL)."""
    for text in (name, value):
        if "\r" in text or "\n" in text or "\0" in text:
            raise ValueError(f"header {name!r}: names and values may not contain CR, LF or NUL")


class StreamTranslator(Protocol):
    """What a vendor supplies to read one stream: `feed` turns each server-sent event into
    an update (or None), raising a `ProviderError` for an in-band error and ValueError /
    TypeError / KeyError for a malformed event; `finished` tells that the answer is
    complete (a finish reason arrived), `ended` that nothing after this event matters."""

    @property
    def finished(self) -> bool: ...

    @property
    def ended(self) -> bool: ...

    def feed(self, event: str | None, data: str) -> ChatResponseUpdate | None: ...


def _merge(held: list[ChatResponseUpdate], update: ChatResponseUpdate) -> ChatResponseUpdate:
    """Fold the metadata of held non-content updates into `update` (which wins)."""
    for earlier in reversed(held):
        update.role = update.role or earlier.role
        update.response_id = update.response_id or earlier.response_id
        update.model_id = update.model_id or earlier.model_id
        if update.created_at is None:
            update.created_at = earlier.created_at
        update.usage = update.usage or earlier.usage
        update.finish_reason = update.finish_reason or earlier.finish_reason
    if update.role is None:
        update.role = ChatRole.ASSISTANT
    return update


def _json_default(value: object) -> Any:
    """The JSON form of the non-JSON values a request may carry (models, datetimes)."""
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(exclude_unset=True, mode="json", by_alias=True)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _positive(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number or None, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return float(value)


class HTTPChatClient(ChatClient):
    """A ChatClient over one vendor's HTTP JSON API; subclasses supply the translation.

    The base owns the transport: one `aiohttp.ClientSession` per provider (and its
    `with_timeouts` views), pooled (`max_connections`, at most `max_keepalive_connections`
    idle ones, each kept `keepalive_expiry` seconds), with bounded response heads, no
    cookie jar (what an upstream sets for one call is never sent with another), the
    environment's proxy (`HTTPS_PROXY` / `HTTP_PROXY`, less `NO_PROXY`, read when the
    session is made on the first call) and TLS `verify`
    (True: the system CAs; False; a CA bundle path; an `ssl.SSLContext`). No redirects
    are followed and no retries made: retrying and failing over belong to the failover.

    Time limits (seconds, None for none):
      - `connect_timeout`: establishing the connection; `pool_timeout`: waiting for a free
        one as well. `read_timeout`: the longest silence between two socket reads (each
        read, not the whole head). `write_timeout` is accepted for compatibility; aiohttp
        bounds no single write, and a whole attempt is bounded by `request_timeout`.
      - `request_timeout`: a whole attempt (non-streaming), or a whole stream.
      - `first_token_timeout`: from the call to a stream's first content-bearing update,
        or to a non-streamed answer's response head (`FirstTokenTimeoutError`);
        `stall_timeout`: the longest gap between two updates of a stream after it
        (`StreamStallTimeoutError`). Applied as `chatroute.failover.timeouts` does.
      - `tail_timeout` (streams): after the finish reason, the longest wait for the rest
        (a usage event, the end of the body); when it runs out the stream simply ends.

    Streams follow the commit rule (`carries_content`): nothing is yielded before the
    first update that carries content; updates before it are folded into it. An in-band
    error event, a malformed event or a broken connection raises from the iterator; a
    stream that ends before the answer is complete raises `TruncatedStreamError`. Closing
    the iterator closes the response, and its connection, at once. Every failure is a
    typed `ProviderError` with the original exception as `__cause__`; keys never appear in
    messages; `asyncio.CancelledError` passes through.

    A subclass sets `path` (the endpoint below `base_url`), `models_path`, and
    `default_base_url` when the vendor has one, and implements `_auth_headers`,
    `_build_body`, `_read_answer` and `_translator`.
    """

    path: ClassVar[str] = ""
    models_path: ClassVar[str] = "models"
    default_base_url: ClassVar[str | None] = None
    default_pass_through: ClassVar[PassThrough] = "all"
    reserved_body_keys: ClassVar[frozenset[str]] = frozenset({"model", "messages", "stream"})
    request_id_headers: ClassVar[tuple[str, ...]] = ("x-request-id",)

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
        extra_body: Mapping[str, Any] | None = None,
        context_window: int | None = None,
        verify: bool | str | ssl.SSLContext = True,
        default_query: Mapping[str, str] | None = None,
        pass_through: PassThrough | None = None,
    ) -> None:
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError("model must be a non-empty string or None")
        if max_connections < 1 or max_keepalive_connections < 0:
            raise ValueError("max_connections must be >= 1 and max_keepalive_connections >= 0")
        if context_window is not None and context_window < 1:
            raise ValueError("context_window must be a positive token count")
        reserved = self.reserved_body_keys & set(extra_body or ())
        if reserved:
            raise ValueError(f"extra_body may not set {sorted(reserved)}")
        if base_url is not None and not isinstance(base_url, str):
            raise TypeError("base_url must be a string")
        if api_key is not None and not isinstance(api_key, str):
            raise TypeError("api_key must be a string or None")
        base = base_url or self.default_base_url
        if not base:
            raise ValueError(f"{type(self).__name__} needs a base_url")
        self.model = model
        self.base_url = base
        self.name = name or model or base
        self.read_timeout = _positive("read_timeout", read_timeout)
        self.request_timeout = check_limit("request_timeout", request_timeout)
        self.first_token_timeout = check_limit("first_token_timeout", first_token_timeout)
        self.stall_timeout = check_limit("stall_timeout", stall_timeout)
        self.tail_timeout = _positive("tail_timeout", tail_timeout) or 2.0
        self.extra_body = dict(extra_body) if extra_body else None
        self.pass_through = self.default_pass_through if pass_through is None else pass_through
        self.context_window = context_window
        self._secrets: tuple[str, ...] = (api_key,) if api_key else ()
        self._closed = False
        self._parent: HTTPChatClient | None = None
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "User-Agent": f"chatroute/{__version__}",
            **(default_headers or {}),
            **self._auth_headers(api_key),
        }
        for key, value in headers.items():
            check_header_value(key, value)
        self._headers = headers
        # The served request's id goes upstream unless the operator set that header.
        self._forward_request_id = all(key.lower() != "x-request-id" for key in headers)
        self._query = dict(default_query) if default_query else None
        self._url = self.base_url.rstrip("/") + "/"
        connect = _positive("connect_timeout", connect_timeout)
        pool = _positive("pool_timeout", pool_timeout)
        _positive("write_timeout", write_timeout)
        self._transport = Transport(
            url=self._url,
            max_connections=max_connections,
            max_keepalive_connections=max_keepalive_connections,
            keepalive_expiry=keepalive_expiry,
            tls=tls_setting(verify),
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=(connect + pool) if connect is not None and pool is not None else None,
                sock_connect=connect,
                sock_read=self.read_timeout,
            ),
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, model={self.model!r}, "
            f"base_url={self.base_url!r})"
        )

    # ------------------------------------------------------------------ for subclasses

    @classmethod
    def from_config(cls, settings: ProviderConfig, **common: Any) -> HTTPChatClient:
        """The client a config's provider entry describes: `common` holds the settings every
        HTTP provider takes (see `registry.build_from_config`); a vendor reads its own
        fields of `settings` by overriding this."""
        return cls(**common)

    def _auth_headers(self, api_key: str | None) -> dict[str, str]:
        """The headers that carry the key (none without one)."""
        return {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _build_body(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None, *, stream: bool
    ) -> dict[str, Any]:
        """The JSON request body; ValueError for options the vendor cannot take."""
        raise NotImplementedError

    def _read_answer(self, data: dict[str, Any]) -> ChatResponse:
        """The response for a decoded 2xx answer; a `ProviderError` for an in-band error,
        ValueError / TypeError / KeyError for an answer of the wrong shape."""
        raise NotImplementedError

    def _translator(self) -> StreamTranslator:
        """A reader of one stream's events."""
        raise NotImplementedError

    def _ignored_params(self, options: ChatOptions | None) -> list[str]:
        """The request fields this provider does not send (x-chatroute-ignored-params)."""
        return []

    def _status_label(self, etype: str | None, code: str | None) -> str | None:
        """What an HTTP error's message names it by."""
        return code

    # ------------------------------------------------------------------ lifecycle

    def with_timeouts(
        self,
        *,
        request_timeout: float | _Keep | None = _KEEP,
        first_token_timeout: float | _Keep | None = _KEEP,
        stall_timeout: float | _Keep | None = _KEEP,
        tail_timeout: float | _Keep = _KEEP,
    ) -> HTTPChatClient:
        """A view of this provider with other time limits (per route, say).

        The view shares this client's connection pool, name and settings; closing the view
        closes nothing, and it stops working once this client is closed.
        """
        view = copy.copy(self)
        view._closed = False
        view._parent = self
        if not isinstance(request_timeout, _Keep):
            view.request_timeout = check_limit("request_timeout", request_timeout)
        if not isinstance(first_token_timeout, _Keep):
            view.first_token_timeout = check_limit("first_token_timeout", first_token_timeout)
        if not isinstance(stall_timeout, _Keep):
            view.stall_timeout = check_limit("stall_timeout", stall_timeout)
        if not isinstance(tail_timeout, _Keep):
            view.tail_timeout = _positive("tail_timeout", tail_timeout) or 2.0
        return view

    async def aclose(self) -> None:
        """Close the connection pool (a `with_timeouts` view closes nothing); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._parent is None:
            await self._transport.aclose()

    def _session(self) -> aiohttp.ClientSession:
        if self._closed or self._transport.closed:
            raise RuntimeError(f"{type(self).__name__} {self.name!r} is closed")
        return self._transport.get()

    def _check_call(self, messages: Sequence[ChatMessage] | None, options: object) -> None:
        if self._closed or self._transport.closed:
            raise RuntimeError(f"{type(self).__name__} {self.name!r} is closed")
        if messages is None:
            raise TypeError("messages must not be None")
        if options is not None and not isinstance(options, ChatOptions):
            raise TypeError(f"options must be ChatOptions or None, got {type(options).__name__}")

    def _body(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None, *, stream: bool
    ) -> bytes:
        self._check_call(messages, options)
        try:
            body = self._build_body(messages, options, stream=stream)
            return orjson.dumps(body, default=_json_default)
        except (ValueError, TypeError) as exc:
            raise ProviderBadRequestError(str(exc), provider=self.name) from exc

    # ------------------------------------------------------------------ HTTP

    def _transport_error(
        self, exc: BaseException, *, in_stream: bool, after_output: bool = False
    ) -> ProviderError:
        """The typed error for a failure of the transport (`exc` is its cause)."""
        common: dict[str, Any] = {"provider": self.name, "after_output": after_output}
        text = redact(f"{type(exc).__name__}: {exc}", self._secrets)
        if isinstance(exc, TimeoutError):  # aiohttp's connect and socket-read timeouts
            if in_stream:
                return StreamStallTimeoutError(
                    f"the stream timed out while reading ({text})", **common
                )
            return ProviderTimeoutError(f"the request timed out ({text})", **common)
        broken = isinstance(exc, aiohttp.ClientConnectionError | OSError)
        if not broken and isinstance(exc, aiohttp.ClientResponseError):  # an unreadable head
            return MalformedResponseError(f"the answer is not valid HTTP ({text})", **common)
        if not broken and isinstance(exc, ValueError):  # an event too large, say
            return MalformedResponseError(f"the answer cannot be read ({text})", **common)
        if in_stream:
            return StreamInterruptedError(
                f"the connection broke while reading the stream ({text})", **common
            )
        return ProviderConnectionError(f"connection failed ({text})", **common)

    async def _post(self, body: bytes) -> aiohttp.ClientResponse:
        """POST the body; the unread response of a 2xx answer, else the typed error."""
        session = self._session()
        headers = self._headers
        if request_hooks.header_hook is not None:  # trace context for the upstream
            headers = request_hooks.added_headers(self, headers)
        forwarded = request_hooks.request_id.get()
        if forwarded is not None and self._forward_request_id:
            headers = {**headers, "x-request-id": forwarded}
        note_upstream_request_id(None)  # this attempt's upstream has not answered yet
        try:
            response = await session.post(
                self._url + self.path,
                data=body,
                headers=headers,
                params=self._query,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise self._transport_error(exc, in_stream=False) from exc
        if not 200 <= response.status < 300:
            raise await self._status_error(response)
        upstream_id = self._upstream_request_id(response.headers)
        if upstream_id is not None and _fits_a_header(upstream_id):
            note_upstream_request_id(upstream_id)
        encoding = response.headers.get("Content-Encoding", "")
        if "," in encoding:  # aiohttp decodes one coding; a stack would come back encoded
            response.release()
            raise MalformedResponseError(
                f"the answer is encoded {encoding!r}; only one content coding is read",
                provider=self.name,
            )
        return response

    def _upstream_request_id(self, headers: Mapping[str, str]) -> str | None:
        """The id the upstream gave the call, from the first of `request_id_headers` it sent."""
        return next((headers[h] for h in self.request_id_headers if h in headers), None)

    async def _status_error(self, response: aiohttp.ClientResponse) -> ProviderStatusError:
        """The typed error for a non-2xx answer, read (the first `MAX_ERROR_BODY` bytes of
        an error answer) and released."""
        raw = b""
        try:
            if response.status >= 400:
                while len(raw) < MAX_ERROR_BODY:
                    chunk = await response.content.read(MAX_ERROR_BODY - len(raw))
                    if not chunk:
                        break
                    raw += chunk
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            _log.debug("provider %s: reading an error answer failed: %r", self.name, exc)
        finally:
            response.release()
        try:
            data: Any = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            data = None
        etype, code, message = error_fields(data)
        if message is None and raw and data is None:
            message = raw[:500].decode("utf-8", "replace")
        headers = response.headers
        return status_error(
            response.status,
            (etype, code, message),
            response.reason or None,
            headers,
            label=self._status_label(etype, code),
            request_id=self._upstream_request_id(headers),
            secrets=self._secrets,
            provider=self.name,
        )

    # ------------------------------------------------------------------ calls

    async def list_models(self) -> list[str]:
        """The model ids the endpoint lists (`GET models_path`), to check a deployment: it is
        reachable, it takes the key, it serves the model. Failures are `ProviderError`s."""
        session = self._session()
        ids: list[str] = []
        query = dict(self._query or {})
        while True:
            try:
                async with session.get(
                    self._url + self.models_path,
                    headers=self._headers,
                    params=query,
                    allow_redirects=False,
                ) as response:
                    if not 200 <= response.status < 300:
                        raise await self._status_error(response)
                    raw = await response.read()
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                raise self._transport_error(exc, in_stream=False) from exc
            try:
                page = orjson.loads(raw)
                ids.extend(str(item["id"]) for item in page["data"])
            except (ValueError, TypeError, KeyError) as exc:
                raise MalformedResponseError(
                    f"the model list is not one ({exc})", provider=self.name
                ) from exc
            if not (page.get("has_more") and page.get("last_id")):
                return ids
            query["after_id"] = str(page["last_id"])

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        body = self._body(messages, options, stream=False)
        answer = await within(lambda: self._answer(body), self.request_timeout, name=self.name)
        report_ignored(answer, self._ignored_params(options))  # for the service's header
        return answer

    async def _answer(self, body: bytes) -> ChatResponse:
        limit = self.first_token_timeout  # the head: most servers send it with the answer
        response = await head_within(lambda: self._post(body), limit, name=self.name)
        try:
            raw = await response.read()
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise self._transport_error(exc, in_stream=False) from exc
        finally:
            response.release()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise MalformedResponseError(
                f"the upstream answer is not JSON ({exc})", provider=self.name
            ) from exc
        if not isinstance(data, dict):
            raise MalformedResponseError(
                "the upstream answer is not a JSON object", provider=self.name
            )
        try:
            return self._read_answer(data)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise MalformedResponseError(
                f"the upstream answer is not one this provider reads ({exc})", provider=self.name
            ) from exc

    def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        stream = self._stream(messages, options)
        if (
            self.request_timeout is None
            and self.first_token_timeout is None
            and self.stall_timeout is None
        ):
            return stream
        return stream_within(
            stream,
            first_token=self.first_token_timeout,
            stall=self.stall_timeout,
            total=self.request_timeout,
            name=self.name,
        )

    async def _stream(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None
    ) -> AsyncIterator[ChatResponseUpdate]:
        response = await self._post(self._body(messages, options, stream=True))
        translator = self._translator()
        events = SSEReader(response.content.iter_any())
        held: list[ChatResponseUpdate] = []
        committed = False
        try:
            while True:
                try:
                    if translator.finished:
                        try:
                            async with asyncio.timeout(self.tail_timeout):
                                event = await events.next()
                        except TimeoutError:
                            break  # the answer is complete; stop waiting for the tail
                    else:
                        event = await events.next()
                except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                    if translator.finished:
                        _log.debug("provider %s: error after the finish: %r", self.name, exc)
                        break
                    raise self._transport_error(
                        exc, in_stream=True, after_output=committed
                    ) from exc
                if event is None:
                    break
                if translator.ended:
                    continue  # nothing after the end matters; read on to reuse the connection
                try:
                    update = translator.feed(*event)
                except ProviderError as exc:
                    exc.after_output = committed
                    raise
                except (ValueError, TypeError, KeyError, AttributeError) as exc:
                    raise MalformedResponseError(
                        f"the upstream sent an event this provider cannot read ({exc})",
                        provider=self.name,
                        after_output=committed,
                    ) from exc
                if update is None:
                    continue
                if not committed:
                    if not carries_content(update):
                        held.append(update)
                        continue
                    update = _merge(held, update)
                    held.clear()
                    committed = True
                    report_ignored(update, self._ignored_params(options))
                yield update
            if not translator.finished:
                raise TruncatedStreamError(
                    "the stream ended before the answer was complete (truncated)",
                    provider=self.name,
                    after_output=committed,
                )
            if held:  # a complete answer with no content at all (an empty reply)
                yield _merge(held[:-1], held[-1])
        finally:
            response.release()
