"""The providers' HTTP transport: one pooled aiohttp session per provider, its limits, TLS."""

from __future__ import annotations

import functools
import os
import ssl
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ConnectionKey
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

__all__ = ["MAX_FIELD_SIZE", "MAX_HEAD_LINE", "Transport", "tls_setting"]

# Response head limits: a line of the head, and one header field.
MAX_HEAD_LINE = 16 * 1024
MAX_FIELD_SIZE = 16 * 1024


@functools.cache
def _default_tls() -> ssl.SSLContext:
    """One verifying TLS context for all providers (loading CAs is slow); the system's CA
    bundle, or SSL_CERT_FILE / SSL_CERT_DIR when set."""
    return ssl.create_default_context()


def tls_setting(verify: bool | str | ssl.SSLContext) -> ssl.SSLContext | bool:
    """What the connector takes for a `verify` setting (False: no verification)."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    if verify is True:
        return _default_tls()
    if verify is False:
        return False
    if os.path.isdir(verify):
        return ssl.create_default_context(capath=verify)
    return ssl.create_default_context(cafile=verify)


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, keeping at most `max_idle` idle connections per endpoint (the
    oldest beyond it are closed when a connection comes back)."""

    def __init__(self, *, max_idle: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._max_idle = max_idle

    def _release(
        self, key: ConnectionKey, protocol: ResponseHandler, *, should_close: bool = False
    ) -> None:
        super()._release(key, protocol, should_close=should_close)
        idle = self._conns.get(key)
        while idle is not None and len(idle) > self._max_idle:
            oldest, _ = idle.popleft()
            oldest.close()


class Transport:
    """One provider's `aiohttp.ClientSession`, made on first use (a session belongs to the
    event loop it is made in) and shared with the provider's `with_timeouts` views."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.session: aiohttp.ClientSession | None = None
        self.closed = False

    def get(self) -> aiohttp.ClientSession:
        session = self.session
        if session is None:
            s = self.settings
            idle = s["max_keepalive_connections"]
            connector = _Connector(
                max_idle=idle,
                limit=s["max_connections"],
                force_close=idle == 0,
                keepalive_timeout=s["keepalive_expiry"] if idle else None,
                ssl=s["tls"],
            )
            # The environment's proxy for the endpoint (HTTP(S)_PROXY less NO_PROXY), read
            # once here: aiohttp's trust_env would read it (and ~/.netrc) in a worker thread
            # on every request.
            try:
                proxy, proxy_auth = get_env_proxy_for_url(URL(s["url"]))
            except LookupError:
                proxy, proxy_auth = None, None
            session = aiohttp.ClientSession(
                connector=connector,
                timeout=s["timeout"],
                proxy=proxy,
                proxy_auth=proxy_auth,
                cookie_jar=aiohttp.DummyCookieJar(),  # never share an upstream's cookies
                max_line_size=MAX_HEAD_LINE,
                max_field_size=MAX_FIELD_SIZE,
            )
            self.session = session
        return session

    async def aclose(self) -> None:
        self.closed = True
        if self.session is not None:
            session, self.session = self.session, None
            await session.close()
