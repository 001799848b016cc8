"""The providers' HTTP plumbing: the pooled aiohttp session, transport failures, TLS and
the SSE event reader."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import gzip
import json
import random
import ssl
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from chatroute.chat import ChatMessage, ChatRole
from chatroute.providers import (
    FailureKind,
    OpenAIChatClient,
    ProviderConnectionError,
    ProviderTimeoutError,
    RateLimitedError,
    StreamInterruptedError,
    classify_failure,
)
from chatroute.providers.sse import SSEReader
from tests.fakes import FakeUpstream, Ok

HI = [ChatMessage(ChatRole.USER, "hi")]


class Marker:
    """Stands for per-request state kept in a context variable (a trace, say)."""


REQUEST_STATE: contextvars.ContextVar[Marker] = contextvars.ContextVar("request_state")

# A self-signed certificate for 127.0.0.1 and localhost, valid 2000-2100 (test use only).
CERT = """-----BEGIN CERTIFICATE-----
MIIBlzCCAT6gAwIBAgIBATAKBggqhkjOPQQDAjAUMRIwEAYDVQQDDAkxMjcuMC4w
LjEwIBcNMDAwMTAxMDAwMDAwWhgPMjEwMDAxMDEwMDAwMDBaMBQxEjAQBgNVBAMM
CTEyNy4wLjAuMTBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABIzsdvHqPtfadeHa
Ktk6KWpB7KhbAZMHKi+GKUG99uoxVJoTM9Km/8UOC8hC9rQ8Vh/ykka9AGN2dcg3
4eoX1Y2jfzB9MBoGA1UdEQQTMBGHBH8AAAGCCWxvY2FsaG9zdDAPBgNVHRMBAf8E
BTADAQH/MA4GA1UdDwEB/wQEAwIChDAdBgNVHQ4EFgQUGvC1v3EJcPqOYiaiyOeb
ZxWYTDAwHwYDVR0jBBgwFoAUGvC1v3EJcPqOYiaiyOebZxWYTDAwCgYIKoZIzj0E
AwIDRwAwRAIgZZ81a4dqh8LQ/3u32hD6EQFAqEOi8aaE4uTaF5LnjMICIAjf1Lag
JmxyYeZuxHiiC/2f36HDChDS+bN/2bB5OMiV
-----END CERTIFICATE-----
"""
KEY = """-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg4AKOx6HQm+JcnsRr
Y1beQVGe/yYtQ/XVEH19bh3b3emhRANCAASM7Hbx6j7X2nXh2irZOilqQeyoWwGT
ByovhilBvfbqMVSaEzPSpv/FDgvIQva0PFYf8pJGvQBjdnXIN+HqF9WN
-----END PRIVATE KEY-----
"""

COMPLETION = {
    "id": "c1",
    "object": "chat.completion",
    "created": 1,
    "model": "tls-model",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "over tls"},
            "finish_reason": "stop",
        }
    ],
}


# ------------------------------------------------------------------------- a tiny HTTP server

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


def json_answer(payload: dict[str, Any], *, close: bool = False) -> bytes:
    body = json.dumps(payload).encode()
    extra = b"connection: close\r\n" if close else b""
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
        % (extra, len(body), body)
    )


def sse_answer(events: list[str]) -> bytes:
    out = [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    ]
    for event in events:
        data = f"data: {event}\n\n".encode()
        out.append(b"%x\r\n%s\r\n" % (len(data), data))
    out.append(b"0\r\n\r\n")
    return b"".join(out)


def chunk_event(content: str | None, finish: str | None = None) -> str:
    delta = {} if content is None else {"content": content}
    return json.dumps(
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "tls-model",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text(CERT, encoding="ascii")
    key.write_text(KEY, encoding="ascii")
    return cert, key


async def serve(handler: Handler, ssl_context: ssl.SSLContext | None = None) -> asyncio.Server:
    return await asyncio.start_server(handler, "127.0.0.1", 0, ssl=ssl_context)


def port_of(server: asyncio.Server) -> int:
    port: int = server.sockets[0].getsockname()[1]
    return port


# ------------------------------------------------------------- the pooled client and its errors


@contextlib.asynccontextmanager
async def provider_on(handler: Handler, **settings: Any) -> AsyncIterator[OpenAIChatClient]:
    """A provider pointed at a scripted raw-socket upstream; both are closed afterwards."""
    server = await serve(handler)
    client = OpenAIChatClient("m", base_url=f"http://127.0.0.1:{port_of(server)}/v1", **settings)
    try:
        yield client
    finally:
        await client.aclose()
        server.close()


_OPENED: weakref.WeakKeyDictionary[asyncio.Server, list[int]] = weakref.WeakKeyDictionary()


def server_connections(server: asyncio.Server) -> int:
    """How many connections a `keep_alive_server` has accepted."""
    return _OPENED[server][0]


def open_connections(server: asyncio.Server) -> int:
    """How many of them are still open (the client has not hung up)."""
    return _OPENED[server][1]


async def wait_for_condition(check: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


async def keep_alive_server(
    answer: Callable[[bytes, bytes], bytes], heads: list[bytes]
) -> asyncio.Server:
    """A raw-socket upstream that answers each request on a connection with `answer(head, body)`
    and records the request heads (and counts connections: `server_connections`)."""
    counts = [0, 0]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counts[0] += 1
        counts[1] += 1
        try:
            while True:
                head, body = await read_request(reader)
                heads.append(head)
                writer.write(answer(head, body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
        finally:
            counts[1] -= 1

    server = await serve(handler)
    _OPENED[server] = counts
    return server


def completion_or_stream(head: bytes, body: bytes) -> bytes:
    if json.loads(body).get("stream"):
        events = [chunk_event("over "), chunk_event("tls"), chunk_event(None, "stop")]
        return sse_answer([*events, "[DONE]"])
    return json_answer(COMPLETION)


async def test_calls_share_one_keep_alive_connection_and_send_a_plain_head() -> None:
    heads: list[bytes] = []
    server = await keep_alive_server(completion_or_stream, heads)
    client = OpenAIChatClient("m", base_url=f"http://127.0.0.1:{port_of(server)}/v1")
    try:
        assert (await client.get_response(HI)).text == "over tls"
        assert "".join([u.text async for u in client.get_streaming_response(HI)]) == "over tls"
        assert (await client.get_response(HI)).text == "over tls"
        assert len(heads) == 3 and server_connections(server) == 1
        sent = heads[0].decode("latin-1").lower()
        assert sent.startswith("post /v1/chat/completions http/1.1\r\n")
        assert f"host: 127.0.0.1:{port_of(server)}\r\n" in sent
        assert "accept-encoding: gzip, deflate" in sent  # what the session decodes
        assert sent.count("accept-encoding") == 1 and sent.count("content-length") == 1
        assert "content-type: application/json\r\n" in sent
        assert "authorization" not in sent  # no key, no credentials
    finally:
        await client.aclose()
        server.close()


async def test_a_compressed_answer_is_decoded() -> None:
    def gzipped(head: bytes, body: bytes) -> bytes:
        if json.loads(body).get("stream"):
            events = [chunk_event("over "), chunk_event("tls"), chunk_event(None, "stop")]
            payload = b"".join(f"data: {e}\n\n".encode() for e in [*events, "[DONE]"])
            kind = b"text/event-stream"
        else:
            payload, kind = json.dumps(COMPLETION).encode(), b"application/json"
        packed = gzip.compress(payload)
        return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-encoding: gzip\r\n" % kind + (
            b"content-length: %d\r\n\r\n%s" % (len(packed), packed)
        )

    server = await keep_alive_server(gzipped, [])
    client = OpenAIChatClient("m", base_url=f"http://127.0.0.1:{port_of(server)}/v1")
    try:
        assert (await client.get_response(HI)).text == "over tls"
        assert "".join([u.text async for u in client.get_streaming_response(HI)]) == "over tls"
    finally:
        await client.aclose()
        server.close()


async def test_a_compressed_error_answer_keeps_its_status_error() -> None:
    def limited(head: bytes, body: bytes) -> bytes:
        packed = gzip.compress(json.dumps({"error": {"message": "slow down"}}).encode())
        return (
            b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
            b"content-encoding: gzip\r\nretry-after: 7\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(packed), packed)
        )

    server = await keep_alive_server(limited, [])
    client = OpenAIChatClient("m", base_url=f"http://127.0.0.1:{port_of(server)}/v1")
    try:
        with pytest.raises(RateLimitedError) as caught:
            await client.get_response(HI)
        assert caught.value.retry_after == 7 and caught.value.status_code == 429
        assert caught.value.error_message == "slow down"
    finally:
        await client.aclose()
        server.close()


async def test_cookies_set_by_the_upstream_are_never_sent_back() -> None:
    heads: list[bytes] = []

    def with_cookie(head: bytes, body: bytes) -> bytes:
        answer = completion_or_stream(head, body)
        status, _, rest = answer.partition(b"\r\n")
        return status + b"\r\nset-cookie: session=caller-one; Path=/\r\n" + rest

    server = await keep_alive_server(with_cookie, heads)
    client = OpenAIChatClient("m", base_url=f"http://127.0.0.1:{port_of(server)}/v1")
    view = client.with_timeouts(request_timeout=30)
    try:
        await client.get_response(HI)
        await client.get_response(HI)
        [u async for u in client.get_streaming_response(HI)]
        await view.get_response(HI)
        assert len(heads) == 4
        assert all(b"cookie" not in head.lower() for head in heads)
    finally:
        await client.aclose()
        server.close()


async def test_aclose_closes_the_pool_and_a_view_closes_nothing() -> None:
    heads: list[bytes] = []
    server = await keep_alive_server(completion_or_stream, heads)
    client = OpenAIChatClient("m", base_url=f"http://127.0.0.1:{port_of(server)}/v1")
    view = client.with_timeouts(first_token_timeout=30)
    try:
        # The client and its views share one pool.
        assert "".join([u.text async for u in view.get_streaming_response(HI)]) == "over tls"
        await view.aclose()
        with pytest.raises(RuntimeError):
            await view.get_response(HI)
        assert (await client.get_response(HI)).text == "over tls"  # the same connection
        assert len(heads) == 2 and server_connections(server) == 1
        await client.aclose()
        await wait_for_condition(lambda: open_connections(server) == 0)
    finally:
        await client.aclose()
        server.close()
    await client.aclose()  # idempotent
    with pytest.raises(RuntimeError):
        await client.get_response(HI)


async def test_cancelling_a_started_stream_drops_its_connection() -> None:
    connections = 0
    hung_up = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while True:
                _, body = await read_request(reader)
                if json.loads(body).get("stream"):
                    answer = sse_answer([chunk_event("one "), chunk_event("two")])
                    writer.write(answer[: answer.index(b"0\r\n\r\n") - 20])  # then silence
                    await writer.drain()
                    await reader.read()  # until the client hangs up
                    hung_up.set()
                    break
                writer.write(json_answer(COMPLETION))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async with provider_on(handler) as client:
        assert (await client.get_response(HI)).text == "over tls"
        received: list[str] = []
        started = asyncio.Event()

        async def consume() -> None:
            async for update in client.get_streaming_response(HI):
                received.append(update.text)
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert received == ["one "]
        await asyncio.wait_for(hung_up.wait(), 5)  # closed at once, not left to the pool
        assert (await client.get_response(HI)).text == "over tls"
        assert connections == 2


async def test_a_refused_connection_is_a_connect_failure_not_a_timeout() -> None:
    server = await serve(lambda r, w: asyncio.sleep(0))
    port = port_of(server)
    server.close()
    await server.wait_closed()
    client = OpenAIChatClient("m", base_url=f"http://127.0.0.1:{port}/v1")
    try:
        with pytest.raises(ProviderConnectionError) as caught:
            await client.get_response(HI)
        assert caught.value.kind is FailureKind.CONNECT
        assert classify_failure(caught.value.__cause__) is FailureKind.CONNECT  # type: ignore[arg-type]
    finally:
        await client.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_an_upstream_hanging_up_before_answering_is_a_connect_failure(stream: bool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()  # hang up without a status line

    async with provider_on(handler) as client:
        with pytest.raises(ProviderConnectionError) as caught:
            if stream:
                [u async for u in client.get_streaming_response(HI)]
            else:
                await client.get_response(HI)
        assert caught.value.kind is FailureKind.CONNECT


async def test_a_silent_upstream_is_a_read_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)  # never answers within the read timeout
        writer.close()

    async with provider_on(handler, read_timeout=0.2) as client:
        with pytest.raises(ProviderTimeoutError) as caught:
            await client.get_response(HI)
        assert caught.value.kind is FailureKind.TIMEOUT


async def test_a_body_cut_mid_stream_is_an_interrupted_stream() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        answer = sse_answer([chunk_event("one "), chunk_event("two")])
        writer.write(answer[: answer.index(b"0\r\n\r\n") - 20])  # cut inside a chunk
        await writer.drain()
        writer.close()

    async with provider_on(handler) as client:
        received = []
        with pytest.raises(StreamInterruptedError):
            async for update in client.get_streaming_response(HI):
                received.append(update.text)
        assert received == ["one "]


# ------------------------------------------------------------------- end to end, TCP and TLS


async def test_a_pooled_connection_closed_by_the_upstream_is_replaced() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(json_answer(COMPLETION))  # keep-alive announced, then closed anyway
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        closed.set()

    server = await serve(handler)
    client = OpenAIChatClient("m", base_url=f"http://127.0.0.1:{port_of(server)}/v1")
    try:
        for _ in range(3):
            closed = asyncio.Event()
            response = await client.get_response(HI)
            assert response.text == "over tls"
            await closed.wait()
            await asyncio.sleep(0.01)  # the client's event loop sees the close
        assert connections == 3
    finally:
        await client.aclose()
        server.close()


async def test_request_contexts_do_not_pile_up_behind_pooled_connections() -> None:
    """Per-request state (context variables) may outlive a request for a while: asyncio keeps
    a cancelled timer, and the context it was made in, until it purges cancelled timers
    (once they are over 100 and half of all timers), and a pooled connection keeps the
    context of the request that opened it. It never piles up with traffic."""
    async with FakeUpstream() as up:
        up.default = Ok("pooled")
        client = OpenAIChatClient("m", base_url=up.base_url)
        markers: list[weakref.ref[Marker]] = []
        try:

            async def request() -> weakref.ref[Marker]:
                marker = Marker()
                REQUEST_STATE.set(marker)
                assert (await client.get_response(HI)).text == "pooled"
                return weakref.ref(marker)

            # Each request runs in its own task (and context), as the server's do.
            for _ in range(400):
                markers.append(await asyncio.create_task(request()))
            for _ in range(3):
                await asyncio.sleep(0)  # let the finished requests' callbacks run
            gc.collect()
            # The connection's reader keeps the context of the request that opened it.
            assert all(ref() is None for ref in markers[1:300])
            assert sum(ref() is not None for ref in markers) <= 110
            assert len({r.connection.id for r in up.requests}) == 1
        finally:
            await client.aclose()


async def test_tls_upstream(tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                _, body = await read_request(reader)
                requests.append(body)
                if json.loads(body).get("stream"):
                    events = [chunk_event("over "), chunk_event("tls"), chunk_event(None, "stop")]
                    writer.write(sse_answer([*events, "[DONE]"]))
                else:
                    writer.write(json_answer(COMPLETION))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await serve(handler, server_context)
    base_url = f"https://127.0.0.1:{port_of(server)}/v1"
    trust = ssl.create_default_context(cafile=str(cert))
    trusting = OpenAIChatClient("m", base_url=base_url, verify=trust)
    default_trust = OpenAIChatClient("m", base_url=base_url)
    try:
        assert (await trusting.get_response(HI)).text == "over tls"
        text = "".join([u.text async for u in trusting.get_streaming_response(HI)])
        assert text == "over tls"
        assert (await trusting.get_response(HI)).text == "over tls"
        assert len(requests) == 3
        with pytest.raises(ProviderConnectionError):
            await default_trust.get_response(HI)  # a self-signed certificate is refused
    finally:
        await trusting.aclose()
        await default_trust.aclose()
        server.close()


async def test_requests_through_the_fake_upstream_share_one_connection() -> None:
    async with FakeUpstream() as up:
        up.default = Ok("pooled")
        client = OpenAIChatClient("m", base_url=up.base_url)
        try:
            for _ in range(3):
                assert (await client.get_response(HI)).text == "pooled"
        finally:
            await client.aclose()
        assert len({r.connection.id for r in up.requests}) == 1


# ------------------------------------------------------------------------------- SSE reader


def reference_events(body: bytes) -> list[tuple[str | None, str]]:
    """SSE parsing of a whole body at once, line by line (the behaviour to match)."""
    text = body.decode("utf-8", "replace")
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    events: list[tuple[str | None, str]] = []
    data: list[str] = []
    event: str | None = None
    for line in lines:
        if not line:
            if data:
                events.append((event, "\n".join(data)))
                data, event = [], None
            else:
                event = None
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
    if data:
        events.append((event, "\n".join(data)))
    return events


async def read_all(chunks: list[bytes]) -> list[tuple[str | None, str]]:
    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    reader = SSEReader(source())
    out = []
    while (event := await reader.next()) is not None:
        out.append(event)
    return out


BODIES = [
    b'data: {"a": 1}\n\ndata: [DONE]\n\n',
    b": keep-alive\r\n\r\ndata: one\r\ndata: two\r\n\r\nevent: error\r\ndata: {}\r\n\r\n",
    b"data:no-space\r\rdata:  two spaces\r\revent: x\r\r\rdata: after blank\n\n",
    b"event: named\ndata: x\n\nid: 7\nretry: 10\ndata: y\n\ndata: unterminated",
    "data: caf\u00e9 \u2713\n\n".encode() + b"data: bad \xff byte\n\n",
    b"\n\n\ndata: late\n\n",
    b"",
]


@pytest.mark.parametrize("body", BODIES)
async def test_sse_reader_matches_whole_body_parsing_at_every_split(body: bytes) -> None:
    expected = reference_events(body)
    assert await read_all([body]) == expected
    for cut in range(1, len(body)):
        assert await read_all([body[:cut], body[cut:]]) == expected, cut
    rng = random.Random(len(body))
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, max(2, len(body))), k=min(4, max(0, len(body) - 2))))
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        assert await read_all(parts) == expected


async def test_sse_reader_examples() -> None:
    assert await read_all([b"data: a\r", b"\ndata: b\r\n", b"\r\n"]) == [(None, "a\nb")]
    assert await read_all([b"event: error\ndata: {}\n\n"]) == [("error", "{}")]
    assert await read_all([b": ping\n\n", b"data: x"]) == [(None, "x")]
    assert await read_all([]) == []


# ------------------------------------------------------------------------------- list_models


async def test_list_models_reads_every_page_and_types_its_failures() -> None:
    from aiohttp import web

    from chatroute.providers import AnthropicChatClient, ProviderAuthError

    seen: list[tuple[str, str, str | None]] = []

    async def models(request: web.Request) -> web.Response:
        seen.append((request.path, request.query_string, request.headers.get("Authorization")))
        if request.headers.get("Authorization") == "Bearer sk-wrong-123":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        if request.path == "/v1/models" and "after_id" not in request.query:
            return web.json_response({"data": [{"id": "a"}], "has_more": True, "last_id": "a"})
        return web.json_response({"data": [{"id": "b"}], "has_more": False})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        async with AnthropicChatClient("c", base_url=url, api_key="sk-right-123") as claude:
            assert await claude.list_models() == ["a", "b"]  # two pages
        async with OpenAIChatClient("m", base_url=f"{url}/v1", api_key="sk-wrong-123") as bad:
            with pytest.raises(ProviderAuthError) as caught:
                await bad.list_models()
            assert caught.value.error_message == "bad key"
    finally:
        await runner.cleanup()
    assert [(path, query) for path, query, _ in seen] == [
        ("/v1/models", ""),
        ("/v1/models", "after_id=a"),
        ("/v1/models", ""),
    ]
