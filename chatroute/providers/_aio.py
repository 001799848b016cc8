"""The provider's own aiohttp plumbing: a pooled session, its responses and httpx-typed errors."""

from __future__ import annotations

import ssl
from collections.abc import Sequence

import aiohttp
import yarl

from chatroute.providers._http import http

__all__ = ["AioResponse", "AioSession", "map_error"]

# aiohttp exception -> the httpx exception the SDK's aiohttp transport raises for it (the
# table and the choice rule of `openai._vendor.httpx_aiohttp.transport`, kept in that order)
# so that errors are classified exactly as through that transport (see `errors.is_timeout`).
_EXC_MAP: tuple[tuple[type[BaseException], type[http.TransportError]], ...] = (
    (aiohttp.ServerTimeoutError, http.TimeoutException),
    (aiohttp.SocketTimeoutError, http.ReadTimeout),
    (aiohttp.ClientConnectionError, http.ConnectTimeout),
    (aiohttp.ClientConnectorError, http.ConnectError),
    (aiohttp.ClientPayloadError, http.ReadError),
    (aiohttp.ClientProxyConnectionError, http.ProxyError),
    (aiohttp.ClientHttpProxyError, http.ProxyError),
    (aiohttp.NonHttpUrlClientError, http.UnsupportedProtocol),
    (aiohttp.InvalidUrlClientError, http.UnsupportedProtocol),
)
_MAPPED: dict[type[BaseException], type[http.TransportError] | None] = {}


def _mapped_type(kind: type[BaseException]) -> type[http.TransportError] | None:
    try:
        return _MAPPED[kind]
    except KeyError:
        pass
    chosen: type[http.TransportError] | None = None
    for source, target in _EXC_MAP:
        if issubclass(kind, source) and (chosen is None or issubclass(target, chosen)):
            chosen = target
    _MAPPED[kind] = chosen
    return chosen


def map_error(exc: aiohttp.ClientError) -> BaseException:
    """The httpx exception for an aiohttp one (raise it `from exc`), or `exc` when unmapped."""
    mapped = _mapped_type(type(exc))
    return exc if mapped is None else mapped(str(exc))


class _Chunks:
    """A response body's chunks as they arrive (`iter_any`), aiohttp errors mapped."""

    __slots__ = ("_chunks",)

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._chunks = response.content.iter_any()

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except aiohttp.ClientError as exc:
            raise map_error(exc) from exc


class AioResponse:
    """A started aiohttp response, with the few methods of an httpx response the provider uses.

    `aread()` reads the whole body, `aiter_bytes()` iterates over it as it arrives and
    `aclose()` closes it: a response read to its end has already handed its connection
    back to the pool, one closed before its end drops its connection (it is never reused).
    `aclose()` never suspends, so a cancellation cannot interrupt it. aiohttp errors come
    out as the httpx errors the SDK's aiohttp transport maps them to, the aiohttp error as
    the `__cause__`.
    """

    __slots__ = ("_response", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status

    async def aread(self) -> bytes:
        try:
            return await self._response.read()
        except aiohttp.ClientError as exc:
            raise map_error(exc) from exc

    def aiter_bytes(self) -> _Chunks:
        return _Chunks(self._response)

    async def aclose(self) -> None:
        self._response.close()

    def to_httpx(self, content: bytes, request: http.Request) -> http.Response:
        """This (read) response as an httpx response with `content` as its body.

        aiohttp decodes a compressed body, so its `Content-Encoding` is left out.
        """
        response = self._response
        headers = [
            (name, value)
            for name, value in response.raw_headers
            if name.lower() != b"content-encoding"
        ]
        extensions: dict[str, object] = {"http_version": b"HTTP/1.1"}
        if response.reason:
            extensions["reason_phrase"] = response.reason.encode("latin-1", "replace")
        return http.Response(
            status_code=self.status,
            headers=headers,
            content=content,
            request=request,
            extensions=extensions,
        )


class AioSession:
    """POSTs to one URL on an `aiohttp.ClientSession` made on first use (on the running loop).

    The session's settings:
    - `max_connections`: the connector's `limit` (connections open at once, pooled or in use);
    - `keepalive_expiry`: how long an idle pooled connection is kept (`keepalive_timeout`);
    - `ssl_context`: the TLS settings of every connection;
    - `connect_timeout` (`sock_connect`): establishing a connection; `read_timeout`
      (`sock_read`): the longest silence between two socket reads; `pool_timeout`
      (`connect`): getting a connection, waiting for a pooled one included;
    - no redirects are followed, no proxy or environment settings are used, and cookies are
      neither kept nor sent (`DummyCookieJar`): one caller's cookies never reach another's
      request;
    - compressed bodies (gzip, deflate: what the request headers accept) are decoded.

    `aclose()` closes the session and its connections; the session is not made again.
    """

    __slots__ = ("_closed", "_connector_settings", "_session", "_timeout", "url")

    def __init__(
        self,
        url: str,
        *,
        max_connections: int,
        keepalive_expiry: float,
        ssl_context: ssl.SSLContext,
        connect_timeout: float | None,
        read_timeout: float | None,
        pool_timeout: float | None,
    ) -> None:
        self.url = yarl.URL(url, encoded=True)
        self._connector_settings = (max_connections, keepalive_expiry, ssl_context)
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=pool_timeout, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The session, once a request has made it."""
        return self._session

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("the HTTP session is closed")
        limit, keepalive, ssl_context = self._connector_settings
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=limit, keepalive_timeout=keepalive, ssl=ssl_context
            ),
            timeout=self._timeout,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
        )
        return self._session

    async def post(self, headers: Sequence[tuple[str, str]], content: bytes) -> AioResponse:
        """POST `content` to `url` and return the response once its headers have arrived.

        Transport failures raise the httpx errors `map_error` gives.
        """
        session = self._session or self._open()
        try:
            response = await session.post(
                self.url, data=content, headers=headers, allow_redirects=False
            )
        except aiohttp.ClientError as exc:
            raise map_error(exc) from exc
        return AioResponse(response)

    async def aclose(self) -> None:
        """Close the session (when made) and its pooled connections; idempotent."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()
