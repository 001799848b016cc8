"""A session store in Redis, shared by a service's replicas; never makes a request wait on it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from chatroute.session.store import SessionRecord, check_positive

__all__ = ["RedisSessionStore"]

logger = logging.getLogger(__name__)

_FAULTS = (RedisError, OSError, TimeoutError, asyncio.TimeoutError, ValueError)


class RedisSessionStore:
    """Session records under `<prefix>:session:<key>` in the Redis at `url`, expiring `ttl`
    seconds after their last write.

    Redis is kept off a request's critical path: a read waits at most `timeout` seconds
    (then the conversation is treated as new), writes run in the background, and after a
    fault the store answers None at once for `retry_after` seconds before it tries again.
    `available` says whether the last exchange with Redis worked.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "chatroute",
        ttl: float = 3600.0,
        timeout: float = 0.05,
        retry_after: float = 5.0,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError("url must be a redis:// URL")
        self._ttl_ms = max(1, int(check_positive("ttl", ttl) * 1000))
        self._timeout = check_positive("timeout", timeout)
        self._retry_after = check_positive("retry_after", retry_after)
        self.prefix = prefix
        self._redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=self._timeout, socket_timeout=self._timeout
        )
        self._down_until = 0.0
        self._pending: set[asyncio.Task[None]] = set()
        self._closed = False
        self.available = True

    def redis_key(self, key: str) -> str:
        """The Redis key that holds the record of conversation `key`."""
        return f"{self.prefix}:session:{key}"

    def _usable(self) -> bool:
        return not self._closed and time.monotonic() >= self._down_until

    def _fault(self, exc: BaseException) -> None:
        if self.available:
            logger.warning("session store: Redis unreachable (%s)", type(exc).__name__)
        self.available = False
        self._down_until = time.monotonic() + self._retry_after

    async def get(self, key: str) -> SessionRecord | None:
        if not self._usable():
            return None
        try:
            raw = await asyncio.wait_for(self._redis.get(self.redis_key(key)), self._timeout)
        except _FAULTS as exc:
            self._fault(exc)
            return None
        self.available = True
        return _decode(raw)

    async def put(self, key: str, record: SessionRecord) -> None:
        """Schedule the write and return at once (see `flush`)."""
        if not isinstance(record, SessionRecord):
            raise TypeError("record must be a SessionRecord")
        if not self._usable():
            return
        value = json.dumps(
            {"route": record.route, "provider": record.provider, "family": record.family}
        )
        task = asyncio.get_running_loop().create_task(self._write(self.redis_key(key), value))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(self, redis_key: str, value: str) -> None:
        try:
            await asyncio.wait_for(
                self._redis.set(redis_key, value, px=self._ttl_ms), self._timeout
            )
        except _FAULTS as exc:
            self._fault(exc)
        else:
            self.available = True

    async def flush(self) -> None:
        """Wait for the writes already scheduled (each is bounded by `timeout`)."""
        while self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.flush()
        await self._redis.aclose()


def _decode(raw: Any) -> SessionRecord | None:
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        route, provider, family = data["route"], data["provider"], data.get("family")
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(route, str) or not isinstance(provider, str):
        return None
    return SessionRecord(route, provider, family if isinstance(family, str) else None)
