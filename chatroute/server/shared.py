"""Circuit-breaker state shared by the replicas of a service through Redis.

A breaker that opens on one replica opens on every other one for the rest of its cool-down,
and one that a replica's probe closes again closes everywhere: a fleet stops sending traffic
to a failing provider as soon as any replica has seen it fail, instead of each replica
learning it on its own callers' requests.

How: each opening is written as a key (`<prefix>:breaker:<provider>`, expiring with the
cool-down, holding the time it ends) and published on `<prefix>:breakers`; each closing
deletes the key and is published too. Every replica subscribes and applies what the others
publish; a replica that starts, or reconnects, opens the breakers whose keys are still
there. Redis is never on a request's path: publishing runs in the background, and while
Redis is unreachable each replica keeps its own breakers and retries the connection.
Replica clocks need to agree only roughly (the end of a cool-down travels as wall time).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from chatroute.failover.breaker import BreakerState, CircuitBreakerRegistry

__all__ = ["SharedBreakerState"]

logger = logging.getLogger(__name__)

_RETRY_MIN = 0.5
_RETRY_MAX = 10.0


class SharedBreakerState:
    """Keeps the breakers of `breakers` in step with other replicas through Redis at `url`.

    `start()` connects (without waiting when Redis is down) and `aclose()` stops. `connected`
    says whether the subscription is live; `on_connected(bool)` is called as that changes,
    and `on_event(direction)` for each event sent or applied ("sent", "received").
    Provider names are the config's, so replicas must share the provider section.
    """

    def __init__(
        self,
        breakers: CircuitBreakerRegistry,
        url: str,
        *,
        prefix: str = "chatroute",
        replica: str | None = None,
        on_connected: Callable[[bool], None] | None = None,
        on_event: Callable[[str], None] | None = None,
        connect_timeout: float = 2.0,
    ) -> None:
        self.breakers = breakers
        self.prefix = prefix
        self.replica = replica or uuid.uuid4().hex
        self.channel = f"{prefix}:breakers"
        self.connected = False
        self._on_connected = on_connected
        self._on_event = on_event
        self._redis = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout,
            socket_timeout=connect_timeout,
            # The subscription's connection is pinged when idle this long, so a Redis that
            # went away without closing it is noticed (and reconnected to).
            health_check_interval=15,
        )
        self._applying = False  # set while a remote event is applied: not sent back out
        self._pending: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._closed = False
        breakers.add_listener(self._transition)

    def key(self, provider: str) -> str:
        """The Redis key that holds an open breaker of `provider`."""
        return f"{self.prefix}:breaker:{provider}"

    async def start(self) -> None:
        """Start following the other replicas; returns once subscribed, or at once when Redis
        cannot be reached (the connection is retried in the background)."""
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name="chatroute-shared-breakers")
            waiter = asyncio.create_task(self._subscribed.wait())
            await asyncio.wait(
                {waiter, self._task}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED
            )
            waiter.cancel()

    async def aclose(self) -> None:
        """Stop following and publishing, after sending what is already queued; idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(ValueError):
            self.breakers.remove_listener(self._transition)
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=2.0)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self._redis.aclose()

    # -- outgoing ----------------------------------------------------------------------

    def _transition(self, provider: str, old: BreakerState, new: BreakerState) -> None:
        if self._applying or self._closed:
            return
        if new is BreakerState.OPEN:
            breaker = self.breakers.get(provider)
            until = time.time() + breaker.remaining_cool_down()
            self._send(self._publish_open(provider, until))
        elif new is BreakerState.CLOSED:
            self._send(self._publish_closed(provider))

    def _send(self, work: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(work)
        except RuntimeError:  # no loop (a breaker used outside the service): nothing to share
            work.close()
            return
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish_open(self, provider: str, until: float) -> None:
        ttl_ms = int((until - time.time()) * 1000)
        if ttl_ms > 0:
            message = {"provider": provider, "state": "open", "until": until}
            await self._publish(message, json.dumps({"until": until}), ttl_ms)

    async def _publish_closed(self, provider: str) -> None:
        await self._publish({"provider": provider, "state": "closed"}, None, 0)

    async def _publish(self, message: dict[str, Any], value: str | None, ttl_ms: int) -> None:
        """Set (or, with no value, delete) the provider's key and publish the event."""
        provider = message["provider"]
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                if value is None:
                    pipe.delete(self.key(provider))
                else:
                    pipe.set(self.key(provider), value, px=ttl_ms)
                pipe.publish(self.channel, json.dumps({**message, "from": self.replica}))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            logger.warning(
                "could not share the %s breaker of %r: %s", message["state"], provider, exc
            )
            return
        self._count("sent")

    # -- incoming ----------------------------------------------------------------------

    async def _follow(self) -> None:
        """Subscribe, catch up with the open keys, then apply events; reconnect on failure."""
        delay = _RETRY_MIN
        while not self._closed:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                await self._catch_up()
                self._set_connected(True)
                self._subscribed.set()
                delay = _RETRY_MIN
                while True:
                    # A bounded wait: each call may run the idle health check.
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._apply(message.get("data"))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                if self.connected:
                    logger.warning("lost the shared breaker state (Redis): %s", exc)
                else:
                    logger.warning("shared breaker state unavailable (Redis): %s", exc)
                self._set_connected(False)
                self._subscribed.set()  # start() stops waiting: Redis is down
            except Exception:  # a bug, or an answer redis-py could not read: keep going
                logger.exception("shared breaker state failed; reconnecting")
                self._set_connected(False)
                self._subscribed.set()
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX)

    async def _catch_up(self) -> None:
        """Open the local breakers whose keys say they are open elsewhere."""
        names = [breaker.name for breaker in self.breakers]
        if not names:
            return
        values = await self._redis.mget([self.key(name) for name in names])
        for name, raw in zip(names, values, strict=True):
            if raw is not None:
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    self._open(name, float(json.loads(raw)["until"]))

    def _apply(self, data: Any) -> None:
        try:
            event = json.loads(data)
            provider = event["provider"]
            state = event["state"]
        except (ValueError, TypeError, KeyError):
            logger.warning("ignoring a malformed shared breaker event")
            return
        if event.get("from") == self.replica or provider not in self.breakers:
            return
        if state == "open":
            with contextlib.suppress(ValueError, TypeError, KeyError):
                self._open(provider, float(event["until"]))
        elif state == "closed":
            breaker = self.breakers.get(provider)
            if breaker.state is not BreakerState.CLOSED:
                self._applying = True
                try:
                    breaker.reset(reason="closed by another replica")
                finally:
                    self._applying = False
                self._count("received")

    def _open(self, provider: str, until: float) -> None:
        remaining = until - time.time()
        if remaining <= 0 or provider not in self.breakers:
            return
        breaker = self.breakers.get(provider)
        if breaker.state is BreakerState.OPEN and breaker.remaining_cool_down() >= remaining:
            return  # already open at least as long
        self._applying = True
        try:
            breaker.trip(remaining=remaining, reason="opened by another replica")
        finally:
            self._applying = False
        self._count("received")

    def _set_connected(self, value: bool) -> None:
        if value != self.connected:
            self.connected = value
            if self._on_connected is not None:
                self._on_connected(value)

    def _count(self, direction: str) -> None:
        if self._on_event is not None:
            self._on_event(direction)
