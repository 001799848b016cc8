"""The provider's own HTTP/1.1 client (`_h1.H1Pool`) against raw-socket servers: framing,
decoding, pooling, limits and the httpx errors it raises."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from chatroute.providers import FailureKind, classify
from chatroute.providers._h1 import H1Pool
from chatroute.providers._http import http
from tests.test_provider_network import read_request

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEADERS = ((b"Content-Type", b"application/json"), (b"Host", b"ignored.example"))


def make_pool(url: str, **settings: float) -> H1Pool:
    options: dict[str, float] = {
        "max_connections": 4,
        "keepalive_expiry": 30.0,
        "connect_timeout": 5.0,
        "read_timeout": 5.0,
        "pool_timeout": 5.0,
        **settings,
    }
    return H1Pool(
        url,
        max_connections=int(options.pop("max_connections")),
        ssl_context=ssl.create_default_context(),
        **options,
    )


@contextlib.asynccontextmanager
async def pool_on(handler: Handler, **settings: float) -> AsyncIterator[H1Pool]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = make_pool(f"http://127.0.0.1:{port}/v1/chat/completions", **settings)
    try:
        yield pool
    finally:
        await pool.aclose()
        server.close()


def answering(*answers: bytes, heads: list[bytes] | None = None) -> Handler:
    """A keep-alive server that answers successive requests on a connection in turn."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for answer in answers:
                head, _ = await read_request(reader)
                if heads is not None:
                    heads.append(head)
                writer.write(answer)
                await writer.drain()
            await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    return handler


def ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n%scontent-length: %d\r\n\r\n%s" % (
        b"".join(e + b"\r\n" for e in extra),
        len(body),
        body,
    )


async def test_the_request_head_is_the_pools_own_and_the_connection_is_kept() -> None:
    heads: list[bytes] = []
    async with pool_on(answering(ok(b"one"), ok(b"two"), heads=heads)) as pool:
        first = await pool.post(HEADERS, b'{"a":1}')
        assert (first.status, await first.aread()) == (200, b"one")
        second = await pool.post(HEADERS, b"{}")
        assert await second.aread() == b"two"
        assert pool.connections == 1
    head = heads[0].decode().lower()
    assert head.startswith("post /v1/chat/completions http/1.1\r\nhost: 127.0.0.1:")
    assert "ignored.example" not in head and "content-length: 7\r\n" in head
    assert "content-type: application/json\r\n" in head


async def test_a_body_without_length_ends_with_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"x":')
        await writer.drain()
        writer.write(b"1}")
        writer.close()

    async with pool_on(handler) as pool:
        response = await pool.post(HEADERS, b"{}")
        assert await response.aread() == b'{"x":1}'
        await asyncio.sleep(0.01)
        assert pool.connections == 0  # not kept: the server closed it


async def test_chunked_and_compressed_bodies_are_decoded_as_they_arrive() -> None:
    text = b"data: " + b"x" * 5000 + b"\n\n"
    packed = zlib.compress(text)[2:-4]  # raw deflate, as some servers send "deflate"
    chunks = [packed[i : i + 700] for i in range(0, len(packed), 700)]
    answer = b"HTTP/1.1 200 OK\r\ncontent-encoding: deflate\r\ntransfer-encoding: chunked\r\n\r\n"
    answer += b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    async with pool_on(answering(answer, ok(b"after"))) as pool:
        response = await pool.post(HEADERS, b"{}")
        received = [chunk async for chunk in response.aiter_bytes()]
        assert b"".join(received) == text
        assert all(
            b"content-encoding" not in n.lower()
            for n, _ in response.to_httpx(b"", http.Request("POST", "http://x")).headers.raw
        )
        assert await (await pool.post(HEADERS, b"{}")).aread() == b"after"  # same connection
        assert pool.connections == 1


async def test_an_interim_answer_is_skipped() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"final", b"x-kind: final")
    async with pool_on(answering(answer)) as pool:
        response = await pool.post(HEADERS, b"{}")
        assert response.status == 200 and (b"x-kind", b"final") in response.headers
        assert await response.aread() == b"final"


async def test_a_malformed_answer_is_a_protocol_error() -> None:
    async with pool_on(answering(b"HTTP/1.1 2OO OK\r\n\r\n")) as pool:
        with pytest.raises(http.RemoteProtocolError) as caught:
            await pool.post(HEADERS, b"{}")
        assert classify(caught.value) is FailureKind.CONNECT


async def test_a_body_cut_short_is_a_protocol_error_and_the_connection_goes() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.close()

    async with pool_on(handler) as pool:
        response = await pool.post(HEADERS, b"{}")
        with pytest.raises(http.RemoteProtocolError, match="complete message body"):
            await response.aread()
        await asyncio.sleep(0.01)
        assert pool.connections == 0


async def test_silence_is_a_read_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(5)
        writer.close()

    async with pool_on(handler, read_timeout=0.2) as pool:
        response = await pool.post(HEADERS, b"{}")
        with pytest.raises(http.ReadTimeout):
            await response.aread()
        assert classify(http.ReadTimeout("x")) is FailureKind.TIMEOUT


async def test_an_upstream_that_takes_nothing_in_is_a_write_timeout() -> None:
    stop = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await stop.wait()  # never reads the request
        writer.close()

    async with pool_on(handler, write_timeout=0.3) as pool:
        with pytest.raises(http.WriteTimeout):
            await pool.post(HEADERS, b"x" * (64 * 1024 * 1024))
        stop.set()


async def test_the_connection_limit_makes_callers_wait_then_times_out() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nfi")
                await writer.drain()
                await release.wait()
                writer.write(b"rs")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async with pool_on(handler, max_connections=1, pool_timeout=0.2) as pool:
        first = await pool.post(HEADERS, b"{}")
        with pytest.raises(http.PoolTimeout):
            await pool.post(HEADERS, b"{}")
        waiting = asyncio.create_task(pool.post(HEADERS, b"{}"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        release.set()
        assert await first.aread() == b"firs"
        second = await asyncio.wait_for(waiting, 2)  # took the freed connection
        assert await second.aread() == b"firs"
        assert pool.connections == 1


async def test_a_lost_connection_frees_its_place_for_a_waiting_caller() -> None:
    drop = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if drop.is_set():  # a connection opened after the first was lost
            await answering(ok(b"fresh"))(reader, writer)
            return
        await read_request(reader)  # the first: half an answer, then the connection is lost
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nfi")
        await drop.wait()
        writer.transport.abort()

    async with pool_on(handler, max_connections=1, pool_timeout=3.0) as pool:
        first = await pool.post(HEADERS, b"{}")
        waiting = asyncio.create_task(pool.post(HEADERS, b"{}"))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the only place is taken
        drop.set()
        with pytest.raises(http.RemoteProtocolError):
            await first.aread()
        second = await asyncio.wait_for(waiting, 1)  # at once, not after the pool timeout
        assert await second.aread() == b"fresh"


async def test_an_answer_that_says_close_is_not_reused_even_while_the_socket_stays_open() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await answering(ok(b"once", b"connection: close"))(reader, writer)  # then lingers

    async with pool_on(handler, read_timeout=1.0) as pool:
        assert await (await pool.post(HEADERS, b"{}")).aread() == b"once"
        assert await (await pool.post(HEADERS, b"{}")).aread() == b"once"  # a new connection
        assert connections == 2


async def test_a_connection_paused_by_an_unread_answer_is_resumed_before_reuse() -> None:
    big = b"x" * (256 * 1024 + 1)  # its last byte, whenever it comes, passes the high water
    async with pool_on(answering(ok(big), ok(b"two")), read_timeout=1.0) as pool:
        first = await pool.post(HEADERS, b"{}")
        await asyncio.sleep(0.05)  # the whole answer arrives unread: reading is paused
        assert await first.aread() == big
        second = await pool.post(HEADERS, b"{}")  # the same connection, reading again
        assert await second.aread() == b"two"
        assert pool.connections == 1


async def test_an_expired_idle_connection_is_not_reused() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await answering(ok(b"a"), ok(b"b"))(reader, writer)

    async with pool_on(handler, keepalive_expiry=0.1) as pool:
        assert await (await pool.post(HEADERS, b"{}")).aread() == b"a"
        await asyncio.sleep(0.2)
        assert await (await pool.post(HEADERS, b"{}")).aread() == b"a"
        assert connections == 2


async def test_closing_a_response_early_drops_its_connection() -> None:
    partial = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nsome"
    hung_up = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answering(partial)(reader, writer)  # then waits for the client to hang up
        hung_up.set()

    async with pool_on(handler) as pool:
        response = await pool.post(HEADERS, b"{}")
        await response.aclose()
        await asyncio.wait_for(hung_up.wait(), 2)
        assert pool.connections == 0
        second = await pool.post(HEADERS, b"{}")  # a new connection
        assert second.status == 200
        await second.aclose()


async def test_a_refused_connection_is_a_connect_error() -> None:
    server = await asyncio.start_server(lambda r, w: asyncio.sleep(0), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    pool = make_pool(f"http://127.0.0.1:{port}/v1", connect_timeout=1)
    with pytest.raises(http.ConnectError):
        await pool.post(HEADERS, b"{}")
    assert pool.connections == 0
    await pool.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await pool.post(HEADERS, b"{}")


def test_only_http_urls_are_taken() -> None:
    with pytest.raises(ValueError, match="not an http"):
        make_pool("ftp://example.com/x")


@pytest.mark.parametrize(
    ("url", "line"),
    [
        (
            "http://[::1]:8080/v1/chat/completions",
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: [::1]:8080\r\n",
        ),
        ("https://api.example.com/v1/x", b"POST /v1/x HTTP/1.1\r\nhost: api.example.com\r\n"),
        (
            "https://api.example.com:8443/v1/x?q=1",
            b"POST /v1/x?q=1 HTTP/1.1\r\nhost: api.example.com:8443\r\n",
        ),
        ("http://b\u00fccher.example/v1", b"POST /v1 HTTP/1.1\r\nhost: xn--bcher-kva.example\r\n"),
    ],
)
def test_the_request_line_and_host_follow_the_url(url: str, line: bytes) -> None:
    pool = make_pool(url, connect_timeout=1)
    assert (
        pool._head((), 2) == line + b"accept-encoding: gzip, deflate\r\ncontent-length: 2\r\n\r\n"
    )


async def test_bytes_after_a_complete_answer_make_its_connection_unusable() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        # One request, two answers in one write: the second was never asked for.
        await answering(ok(b"asked") + ok(b"unasked"), ok(b"never"))(reader, writer)

    async with pool_on(handler) as pool:
        assert await (await pool.post(HEADERS, b"{}")).aread() == b"asked"
        await asyncio.sleep(0.01)
        assert pool.connections == 0
        assert await (await pool.post(HEADERS, b"{}")).aread() == b"asked"  # a new connection
        assert connections == 2
