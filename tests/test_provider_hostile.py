"""Hostile upstreams on 127.0.0.1: each gets a typed ProviderError (and a failover), never a
hang, unbounded memory or a traceback in the log; the pool keeps its limits."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from chatroute.chat import ChatMessage, ChatRole
from chatroute.errors import (
    FailureKind,
    MalformedResponseError,
    ProviderError,
    ProviderStatusError,
    ProviderTimeoutError,
    classify_failure,
)
from chatroute.failover import OrderedFailoverChatClient
from chatroute.providers import OpenAIChatClient

HI = [ChatMessage(ChatRole.USER, "hi")]

COMPLETION = json.dumps(
    {
        "id": "c1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "fine"},
                "finish_reason": "stop",
            }
        ],
    }
).encode()

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return await reader.readexactly(length)


def answer(body: bytes = COMPLETION, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
        % (extra, len(body), body)
    )


class Upstream:
    """A raw-socket upstream running `handler` per connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.accepted = 0
        self.open = 0
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"


@contextlib.asynccontextmanager
async def upstream(handler: Handler) -> AsyncIterator[Upstream]:
    up = Upstream(handler)
    up.server = await asyncio.start_server(up._serve, "127.0.0.1", 0)
    try:
        yield up
    finally:
        up.server.close()


async def eventually(check: Callable[[], bool]) -> None:
    """Wait until `check()` holds (the loop must see closes happen); fails after 10 s."""
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.01)


async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await read_request(reader)
        writer.write(answer())
        await writer.drain()


# ------------------------------------------------------------------------ a huge head


async def test_a_huge_response_header_is_malformed_with_bounded_reading_and_fails_over() -> None:
    sent = 0

    async def endless_header(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nx-huge: ")
        block = b"a" * 65536
        while sent < 256 * 1024 * 1024:  # a 256 MB header line, unless the client hangs up
            writer.write(block)
            await writer.drain()
            sent += len(block)

    async with upstream(endless_header) as hostile, upstream(keep_alive) as good:
        bad = OpenAIChatClient("m", base_url=hostile.url, name="hostile")
        fine = OpenAIChatClient("m", base_url=good.url, name="good")
        router = OrderedFailoverChatClient([bad, fine])
        try:
            with pytest.raises(MalformedResponseError) as caught:
                await bad.get_response(HI)
            assert classify_failure(caught.value) is FailureKind.MALFORMED
            assert "not valid HTTP" in str(caught.value)
            # The client stopped reading at its head limit and hung up: the upstream could
            # not push more than the socket buffers hold beyond it.
            await eventually(lambda: hostile.open == 0)
            assert sent < 16 * 1024 * 1024
            assert (await router.get_response(HI)).text == "fine"  # and it fails over
        finally:
            await router.aclose()


# ------------------------------------------------------------------------ the pool


async def test_the_pool_keeps_at_most_max_keepalive_idle_connections_and_expires_them() -> None:
    release = asyncio.Event()

    async def slow_keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await release.wait()
            writer.write(answer())
            await writer.drain()

    async with upstream(slow_keep_alive) as up:
        client = OpenAIChatClient(
            "m", base_url=up.url, max_keepalive_connections=1, keepalive_expiry=0.5
        )
        try:
            calls = [asyncio.create_task(client.get_response(HI)) for _ in range(4)]
            await eventually(lambda: up.accepted == 4)  # four at once: four connections
            release.set()
            assert [r.text for r in await asyncio.gather(*calls)] == ["fine"] * 4
            await eventually(lambda: up.open == 1)  # one idle connection kept, three closed
            assert (await client.get_response(HI)).text == "fine"
            assert up.accepted == 4  # the kept one was reused
            await eventually(lambda: up.open == 0)  # and closed once idle past its expiry
        finally:
            await client.aclose()


async def test_no_keepalive_closes_every_connection_after_its_call() -> None:
    async with upstream(keep_alive) as up:
        client = OpenAIChatClient("m", base_url=up.url, max_keepalive_connections=0)
        try:
            for _ in range(2):
                assert (await client.get_response(HI)).text == "fine"
                await eventually(lambda: up.open == 0)
            assert up.accepted == 2
        finally:
            await client.aclose()


# ------------------------------------------------------------------------ per-read timeout


async def test_the_read_timeout_bounds_each_read_not_the_whole_answer() -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        for byte in answer(extra=b"x-pad: " + b"p" * 24 + b"\r\n"):
            writer.write(bytes([byte]))  # the head and body a byte at a time
            await writer.drain()
            await asyncio.sleep(0.002)

    async with upstream(trickle) as up:
        # The whole answer takes longer than the read timeout; no single read does.
        client = OpenAIChatClient("m", base_url=up.url, read_timeout=0.25)
        try:
            assert (await client.get_response(HI)).text == "fine"
        finally:
            await client.aclose()


async def test_a_silence_inside_the_head_longer_than_the_read_timeout_fails() -> None:
    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: appl")
        await writer.drain()
        await asyncio.sleep(30)

    async with upstream(stalls) as up:
        client = OpenAIChatClient("m", base_url=up.url, read_timeout=0.2)
        try:
            with pytest.raises(ProviderTimeoutError) as caught:
                await client.get_response(HI)
            assert caught.value.kind is FailureKind.TIMEOUT
        finally:
            await client.aclose()


# ------------------------------------------------------------------------ odd answers


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_stacked_content_encodings_are_a_clean_malformed_error(stream: bool) -> None:
    async def stacked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        body = gzip.compress(gzip.compress(COMPLETION))
        writer.write(answer(body, b"content-encoding: gzip, gzip\r\n"))
        await writer.drain()

    async with upstream(stacked) as up:
        client = OpenAIChatClient("m", base_url=up.url)
        try:
            with pytest.raises(MalformedResponseError, match="gzip, gzip"):
                if stream:
                    [u async for u in client.get_streaming_response(HI)]
                else:
                    await client.get_response(HI)
        finally:
            await client.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_a_101_answer_is_a_typed_error_with_no_traceback_in_the_log(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async def switching(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n"
        )
        await writer.drain()
        await reader.read()  # until the client hangs up

    caplog.set_level(logging.DEBUG)
    async with upstream(switching) as up, upstream(keep_alive) as good:
        client = OpenAIChatClient("m", base_url=up.url, name="switching")
        router = OrderedFailoverChatClient([client, OpenAIChatClient("m", base_url=good.url)])
        try:
            with pytest.raises(ProviderStatusError) as caught:
                if stream:
                    [u async for u in client.get_streaming_response(HI)]
                else:
                    await client.get_response(HI)
            assert caught.value.status_code == 101
            assert isinstance(caught.value, ProviderError) and caught.value.policy.fail_over
            await eventually(lambda: up.open == 0)  # the upgraded connection is dropped
            assert (await router.get_response(HI)).text == "fine"  # the next provider answers
        finally:
            await router.aclose()
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
