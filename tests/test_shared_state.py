"""Breaker state shared by replicas through a real redis-server that the tests start."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis

from chatroute.chat import EmbeddingGenerator
from chatroute.config import parse_config
from chatroute.failover.breaker import BreakerSettings, BreakerState, CircuitBreakerRegistry
from chatroute.server import create_app
from chatroute.server.shared import SharedBreakerState
from tests.fakes import FakeUpstream, Ok, ServerError

_prefixes = itertools.count()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def _redis_server(port: int) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (`make test` installs it)")
    with tempfile.TemporaryDirectory() as workdir:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", workdir]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=port, socket_connect_timeout=0.5)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.05)
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with _redis_server(_free_port()) as url:
        yield url


@pytest.fixture
def prefix() -> str:
    return f"test{next(_prefixes)}-{time.monotonic_ns()}"


def _registry(cool_down: float = 30.0) -> CircuitBreakerRegistry:
    registry = CircuitBreakerRegistry(BreakerSettings(cool_down=cool_down))
    registry.get("primary")
    registry.get("backup")
    return registry


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


class Events:
    def __init__(self) -> None:
        self.counts = {"sent": 0, "received": 0}

    def __call__(self, direction: str) -> None:
        self.counts[direction] += 1


async def test_an_opening_and_a_closing_reach_the_other_replica(
    redis_url: str, prefix: str
) -> None:
    a, b = _registry(), _registry()
    seen_a, seen_b = Events(), Events()
    one = SharedBreakerState(a, redis_url, prefix=prefix, on_event=seen_a)
    two = SharedBreakerState(b, redis_url, prefix=prefix, on_event=seen_b)
    await one.start()
    await two.start()
    assert one.connected and two.connected
    try:
        a.get("primary").trip()
        await _until(lambda: b.get("primary").state is BreakerState.OPEN)
        assert b.get("backup").state is BreakerState.CLOSED
        assert b.get("primary").remaining_cool_down() == pytest.approx(30.0, abs=1.0)
        a.get("primary").reset()  # say a probe succeeded on this replica
        await _until(lambda: b.get("primary").state is BreakerState.CLOSED)
        await asyncio.sleep(0.2)  # anything echoed back would have arrived by now
        assert seen_a.counts == {"sent": 2, "received": 0}
        assert seen_b.counts == {"sent": 0, "received": 2}
        assert a.get("primary").state is BreakerState.CLOSED
    finally:
        await one.aclose()
        await two.aclose()


async def test_applied_events_are_not_sent_back_out(redis_url: str, prefix: str) -> None:
    a, b = _registry(), _registry()
    one = SharedBreakerState(a, redis_url, prefix=prefix)
    two = SharedBreakerState(b, redis_url, prefix=prefix)
    listener = aioredis.Redis.from_url(redis_url)
    pubsub = listener.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(f"{prefix}:breakers")
    await one.start()
    await two.start()
    try:
        a.get("backup").trip()
        await _until(lambda: b.get("backup").state is BreakerState.OPEN)
        messages = []  # an echo from the replica that applied it would come at once
        quiet_until = time.monotonic() + 0.4
        while time.monotonic() < quiet_until:
            message = await pubsub.get_message(timeout=0.1)
            if message is not None:
                messages.append(message)
        assert len(messages) == 1
        assert b'"from": "%s"' % one.replica.encode() in messages[0]["data"]
        # The key carries the cool-down for replicas that arrive later.
        ttl = await listener.pttl(f"{prefix}:breaker:backup")
        assert 28_000 < ttl <= 30_000
    finally:
        await one.aclose()
        await two.aclose()
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        await listener.aclose()


async def test_a_replica_that_starts_later_catches_up(redis_url: str, prefix: str) -> None:
    a = _registry(cool_down=20.0)
    one = SharedBreakerState(a, redis_url, prefix=prefix)
    await one.start()
    try:
        a.get("primary").trip()
        await _until(lambda: not one._pending)
        late = _registry(cool_down=20.0)
        three = SharedBreakerState(late, redis_url, prefix=prefix)
        await three.start()
        try:
            assert late.get("primary").state is BreakerState.OPEN  # before start() returned
            assert late.get("primary").remaining_cool_down() == pytest.approx(20.0, abs=1.0)
            assert late.get("backup").state is BreakerState.CLOSED
        finally:
            await three.aclose()
    finally:
        await one.aclose()


async def test_malformed_events_are_ignored(redis_url: str, prefix: str) -> None:
    b = _registry()
    two = SharedBreakerState(b, redis_url, prefix=prefix)
    await two.start()
    sender = aioredis.Redis.from_url(redis_url)
    try:
        channel = f"{prefix}:breakers"
        for junk in (b"not json", b'{"state": "open"}', b'{"provider": "primary"}'):
            await sender.publish(channel, junk)
        await sender.publish(
            channel,
            b'{"provider": "unknown", "state": "open", "until": 1e12, "from": "x"}',
        )
        until = time.time() + 10
        await sender.publish(
            channel,
            json.dumps({"provider": "primary", "state": "open", "until": until, "from": "x"}),
        )
        await _until(lambda: b.get("primary").state is BreakerState.OPEN)
        assert b.get("primary").remaining_cool_down() == pytest.approx(10.0, abs=1.0)
        assert "unknown" not in b
        assert two.connected
    finally:
        await two.aclose()
        await sender.aclose()


async def test_redis_down_keeps_breakers_local_until_it_comes_up(prefix: str) -> None:
    port = _free_port()
    a, b = _registry(), _registry()
    one = SharedBreakerState(a, f"redis://127.0.0.1:{port}/0", prefix=prefix)
    started = time.monotonic()
    await one.start()
    assert time.monotonic() - started < 3.0  # start-up does not wait for Redis
    assert not one.connected
    a.get("primary").trip()  # nowhere to send it: logged, nothing raised
    assert a.get("primary").state is BreakerState.OPEN
    try:
        with _redis_server(port) as url:
            two = SharedBreakerState(b, url, prefix=prefix)
            await two.start()
            try:
                await _until(lambda: one.connected, timeout=15.0)  # reconnected by itself
                a.get("backup").trip()
                await _until(lambda: b.get("backup").state is BreakerState.OPEN)
            finally:
                await two.aclose()
    finally:
        await one.aclose()


# ---------------------------------------------------------------------------- the service


def _service_config(primary: FakeUpstream, backup: FakeUpstream, prefix: str) -> dict[str, Any]:
    return {
        "routing": {"top_k": 3, "threshold": 0.25, "default_route": "general"},
        "resilience": {
            "breaker": {"minimum_requests": 2, "failure_rate_threshold": 0.5, "cool_down": 60}
        },
        "shared_state": {"redis_url_env": "TEST_REDIS_URL", "key_prefix": prefix},
        "providers": {
            "primary": {"base_url": primary.base_url, "model": "primary-model"},
            "backup": {"base_url": backup.base_url, "model": "backup-model"},
        },
        "routes": {
            "general": {"utterances": ["hello there"], "targets": ["primary", "backup"]},
        },
    }


def test_replicas_of_the_service_share_an_open_breaker(
    redis_url: str,
    prefix: str,
    default_embedder: Callable[[], EmbeddingGenerator],
    serve_app: Callable[..., contextlib.AbstractContextManager[str]],
) -> None:
    with (
        FakeUpstream(default=ServerError(500)) as primary,
        FakeUpstream(default=Ok("from the backup")) as backup,
    ):
        environ = {"TEST_REDIS_URL": redis_url}
        config = parse_config(_service_config(primary, backup, prefix), environ=environ)
        first = create_app(config, api_keys=[], environ=environ, embedder=default_embedder())
        second = create_app(config, api_keys=[], environ=environ, embedder=default_embedder())
        with serve_app(first) as url_one, serve_app(second) as url_two:
            one = openai.OpenAI(base_url=f"{url_one}/v1", api_key="x", max_retries=0)
            two = openai.OpenAI(base_url=f"{url_two}/v1", api_key="x", max_retries=0)
            ask = [{"role": "user", "content": "hello"}]
            for _ in range(2):  # the primary fails twice on the first replica: it opens
                raw = one.chat.completions.with_raw_response.create(model="general", messages=ask)
                assert raw.headers["x-chatroute-provider"] == "backup"
            assert primary.attempts == 2
            breakers = second.state.service.engine.breakers
            deadline = time.monotonic() + 5
            while breakers.get("primary").state is not BreakerState.OPEN:
                assert time.monotonic() < deadline, "the opening did not reach the other replica"
                time.sleep(0.01)
            # The second replica has never called the primary, yet goes straight to the backup.
            raw = two.chat.completions.with_raw_response.create(model="general", messages=ask)
            assert raw.headers["x-chatroute-provider"] == "backup"
            assert raw.headers["x-chatroute-attempts"] == "1"
            assert primary.attempts == 2
            metrics = httpx.get(f"{url_two}/metrics").text
            assert "chatroute_shared_state_up 1.0" in metrics
            assert 'chatroute_shared_breaker_events_total{direction="received"} 1.0' in metrics
            one.close()
            two.close()
