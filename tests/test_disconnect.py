"""F17: a caller that disconnects stops the upstream work at once, at every stage of a request.

The caller is a raw TCP client, so the moment it goes away is exact. The service's time
limits are long (30 s) and the fakes never end these requests themselves, so an upstream
connection that closes within the wait below can only have been closed by the service
reacting to the disconnect. (The latency of that reaction is measured in
bench/load_soak.py, not asserted here.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import ServiceStack
from tests.fakes import Hang, Ok, RateLimited, ServerError, SlowFirstToken, Stall

LONG = 30.0
SETTLE = 0.2  # how long we watch for an attempt that must not come (one would come at once)
RETRY_AFTER = 0.5  # the upstreams' Retry-After (the caller leaves 0.1 s into it)


def build(urls: dict[str, str]) -> dict[str, Any]:
    def provider(name: str) -> dict[str, Any]:
        return {
            "base_url": urls[name],
            "model": f"{name}-model",
            "timeouts": {"connect": 5, "read": LONG, "attempt": LONG, "first_token": LONG},
        }

    return {
        "routing": {"default_route": "chain", "threshold": 0.3},
        "resilience": {"deadline": 60, "retry_after_max": 10},
        "providers": {name: provider(name) for name in ("primary", "fallback", "unreachable")},
        "routes": {
            "chain": {"targets": ["primary", "fallback"], "utterances": ["hello there"]},
            "connecting": {"targets": ["unreachable", "fallback"]},
            "backoff": {
                "targets": ["primary", "fallback"],
                "retry_same_provider": True,
                "retry_backoff": 5.0,
            },
        },
    }


def connecting_sockets(port: int) -> int:
    """How many local TCP sockets are still trying to connect (SYN_SENT) to `port`."""
    count = 0
    with open("/proc/net/tcp", encoding="ascii") as table:
        for line in table.read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "02" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


@pytest.fixture(scope="module")
def unreachable() -> Iterator[int]:
    """A port whose accept queue is full, so a connect to it hangs in the handshake (the
    kernel drops the SYNs) until the connecting side gives up: a provider stuck connecting."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    deadline = time.monotonic() + 5
    while connecting_sockets(port) < 1:  # the queue is full: later connects hang
        assert time.monotonic() < deadline, "could not fill the accept queue"
        time.sleep(0.01)
    yield port
    for filler in fillers:
        filler.close()
    listener.close()


@pytest.fixture(scope="module")
def stack(
    service_stack: Callable[..., contextlib.AbstractContextManager[ServiceStack]],
    unreachable: int,
) -> Iterator[ServiceStack]:
    def config(urls: dict[str, str]) -> dict[str, Any]:
        return build({**urls, "unreachable": f"http://127.0.0.1:{unreachable}/v1"})

    with service_stack(config, ["primary", "fallback"]) as made:
        yield made


@pytest.fixture(autouse=True)
def fresh(stack: ServiceStack) -> None:
    stack.reset()


class RawCaller:
    """One HTTP/1.1 request over a raw socket, so the test decides when the caller leaves."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.received = b""
        self.left_at: float | None = None

    @classmethod
    async def post(cls, stack: ServiceStack, body: dict[str, Any]) -> RawCaller:
        parts = urlsplit(stack.url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        data = json.dumps(body).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
            f"authorization: Bearer {stack.key}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n"
        )
        writer.write(head.encode() + data)
        await writer.drain()
        return cls(reader, writer)

    async def read_until(self, marker: bytes, count: int = 1, timeout: float = 5.0) -> None:
        """Read until `marker` occurs `count` times in what was received."""
        async with asyncio.timeout(timeout):
            while self.received.count(marker) < count:
                chunk = await self.reader.read(65536)
                if not chunk:
                    raise AssertionError(f"the service closed early: {self.received!r}")
                self.received += chunk

    async def leave(self) -> float:
        """Close the connection (the caller goes away); returns when, on the monotonic clock."""
        self.left_at = time.monotonic()
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()
        return self.left_at


def chat_body(model: str, stream: bool) -> dict[str, Any]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


async def assert_stopped(
    stack: ServiceStack, upstream: str, left_at: float, *, stage: str, attempts: int = 1
) -> Any:
    """The upstream saw its connection closed after the caller left, nothing more was
    attempted anywhere, the attempt record says cancelled and the breaker is untouched."""
    up = stack.upstreams[upstream]
    closed_at = await up.await_disconnect(attempts - 1, timeout=2.0)
    assert closed_at >= left_at  # closed because the caller left, not before
    await asyncio.sleep(SETTLE)
    expected = {name: 0 for name in stack.upstreams}
    expected[upstream] = attempts
    assert stack.attempts() == expected
    trace = (await asyncio.to_thread(stack.wait_traces, 1))[0]
    assert trace.cancelled == "disconnect" and trace.status == 499
    assert trace.attempts[-1].outcome == "cancelled"
    assert trace.attempts[-1].is_terminal
    assert len(trace.attempts) == attempts
    snapshot = stack.service.engine.breakers.get(upstream).snapshot()
    assert snapshot.failures == 0 and snapshot.state.value == "closed"
    counted = stack.metrics()
    assert (
        f'chatroute_cancelled_requests_total{{reason="disconnect",route="{trace.route}",'
        f'stage="{stage}"}}' in counted
    )
    return trace


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_disconnect_while_connecting_to_the_upstream(
    stack: ServiceStack, unreachable: int, stream: bool
) -> None:
    before = connecting_sockets(unreachable)
    caller = await RawCaller.post(stack, chat_body("connecting", stream))
    deadline = time.monotonic() + 5
    while connecting_sockets(unreachable) <= before:  # the service is in the handshake
        assert time.monotonic() < deadline, "the service never started connecting"
        await asyncio.sleep(0.01)
    await caller.leave()
    while connecting_sockets(unreachable) > before:  # it gave the connect up
        assert time.monotonic() < deadline + 2, "the half-open connect was left behind"
        await asyncio.sleep(0.01)
    await asyncio.sleep(SETTLE)
    assert stack.attempts() == {"primary": 0, "fallback": 0}  # no failover after leaving
    trace = (await asyncio.to_thread(stack.wait_traces, 1))[0]
    assert trace.cancelled == "disconnect" and trace.status == 499
    assert [(r.provider, r.outcome) for r in trace.attempts] == [("unreachable", "cancelled")]
    snapshot = stack.service.engine.breakers.get("unreachable").snapshot()
    assert snapshot.failures == 0 and snapshot.state.value == "closed"
    assert caller.received == b""


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_disconnect_while_the_upstream_has_not_answered(
    stack: ServiceStack, stream: bool
) -> None:
    stack.upstreams["primary"].script(Hang())
    caller = await RawCaller.post(stack, chat_body("chain", stream))
    await stack.upstreams["primary"].await_requests(1)
    left_at = await caller.leave()
    await assert_stopped(stack, "primary", left_at, stage="before_output")


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_disconnect_while_waiting_for_the_first_token(
    stack: ServiceStack, stream: bool
) -> None:
    up = stack.upstreams["primary"]
    up.script(SlowFirstToken(LONG))  # headers and the role delta at once, then silence
    caller = await RawCaller.post(stack, chat_body("chain", stream))
    await up.await_requests(1)
    if stream:
        while up.requests[0].status != 200:  # the upstream answered its headers
            await asyncio.sleep(0.01)
    left_at = await caller.leave()
    await assert_stopped(stack, "primary", left_at, stage="before_output")
    assert caller.received == b""  # nothing was committed to the caller


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_disconnect_during_a_retry_after_wait_makes_no_new_attempt(
    stack: ServiceStack, stream: bool
) -> None:
    up = stack.upstreams["primary"]
    up.script(RateLimited(retry_after=RETRY_AFTER), Ok("too late"))
    stack.upstreams["fallback"].default = RateLimited(retry_after=None)
    caller = await RawCaller.post(stack, chat_body("chain", stream))
    await stack.upstreams["fallback"].await_requests(1)  # both tried; now waiting
    await asyncio.sleep(0.1)
    await caller.leave()
    await asyncio.sleep(RETRY_AFTER + SETTLE)  # past the Retry-After
    assert stack.attempts() == {"primary": 1, "fallback": 1}
    trace = (await asyncio.to_thread(stack.wait_traces, 1))[0]
    assert trace.cancelled == "disconnect" and trace.status == 499
    assert [r.outcome for r in trace.attempts] == ["failed", "failed"]
    assert trace.attempt_count == 2  # no third selection was made


async def test_disconnect_during_a_retry_backoff_makes_no_new_attempt(
    stack: ServiceStack,
) -> None:
    for name in ("primary", "fallback"):
        stack.upstreams[name].script(ServerError(), Ok("too late"))
    caller = await RawCaller.post(stack, chat_body("backoff", True))
    await stack.upstreams["fallback"].await_requests(1)  # both failed once; backoff 5 s
    await asyncio.sleep(0.2)
    await caller.leave()
    await asyncio.sleep(SETTLE)
    trace = (await asyncio.to_thread(stack.wait_traces, 1))[0]
    assert trace.cancelled == "disconnect"
    assert stack.attempts() == {"primary": 1, "fallback": 1}


async def test_disconnect_mid_stream_closes_the_upstream(stack: ServiceStack) -> None:
    up = stack.upstreams["primary"]
    up.script(Stall(2, text="one two three four"))  # two chunks, then silence
    caller = await RawCaller.post(stack, chat_body("chain", True))
    await caller.read_until(b'"content"', count=2)
    left_at = await caller.leave()
    trace = await assert_stopped(stack, "primary", left_at, stage="after_output")
    assert trace.committed
    assert trace.attempts[0].attempt.output_committed


async def test_disconnect_mid_stream_while_chunks_are_flowing(stack: ServiceStack) -> None:
    up = stack.upstreams["primary"]
    up.script(Ok(" ".join(f"w{i}" for i in range(400)), chunk_delay=0.02))
    caller = await RawCaller.post(stack, chat_body("chain", True))
    await caller.read_until(b'"content"', count=3)
    left_at = await caller.leave()
    await assert_stopped(stack, "primary", left_at, stage="after_output")
    assert up.requests[0].chunks_sent < 400  # it did not run to the end


async def test_a_later_request_on_the_same_service_is_unaffected(stack: ServiceStack) -> None:
    stack.upstreams["primary"].script(Hang())
    caller = await RawCaller.post(stack, chat_body("chain", False))
    await stack.upstreams["primary"].await_requests(1)
    await caller.leave()
    await stack.upstreams["primary"].await_disconnect(0, timeout=2.0)
    raw = await asyncio.to_thread(
        stack.client.chat.completions.with_raw_response.create,
        model="chain",
        messages=[{"role": "user", "content": "again"}],
    )
    assert raw.headers["x-chatroute-provider"] == "primary"
    assert raw.parse().choices[0].message.content == "Hello from the fake upstream."
