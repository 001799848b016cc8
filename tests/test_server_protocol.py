"""The service's HTTP/1.1 protocol: what a caller sees on the wire, and what the app sees."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from chatroute.server.protocol import (
    CONNECTION_EXTENSION,
    HttpProtocol,
    connection_of,
)

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"


class RecordingTransport:
    """Records each write as the socket would see it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.late: list[bytes] = []  # written after close (uvloop would raise)
        self.closed = False
        self.aborted = False
        self.eof = False
        self.reading = True

    def write(self, data: bytes) -> None:
        (self.late if self.closed else self.writes).append(bytes(data))

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


async def _app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    body = b'{"ok":true}'
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", b"11")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _connection(app: Any, **settings: Any) -> tuple[RecordingTransport, HttpProtocol]:
    config = uvicorn.Config(app, http=HttpProtocol, log_level="warning", lifespan="off", **settings)
    config.load()
    protocol = HttpProtocol(config, ServerState(), {}, asyncio.get_running_loop())
    raw = RecordingTransport()
    protocol.connection_made(raw)  # type: ignore[arg-type]
    return raw, protocol


async def _exchange(request: bytes) -> tuple[RecordingTransport, HttpProtocol]:
    raw, protocol = await _connection(_app)
    protocol.data_received(request)
    for _ in range(200):
        await asyncio.sleep(0.001)
        if protocol.cycle is None:
            break
    await asyncio.sleep(0)
    return raw, protocol


async def test_an_answer_leaves_in_one_write() -> None:
    raw, protocol = await _exchange(b"GET /json HTTP/1.1\r\nhost: x\r\n\r\n")
    assert len(raw.writes) == 1, raw.writes
    head, _, body = raw.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"content-length: 11" in head
    assert body == b'{"ok":true}'
    protocol.connection_lost(None)


async def test_a_stream_sends_its_first_event_with_the_head_and_later_ones_on_their_own() -> None:
    raw, protocol = await _exchange(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
    assert len(raw.writes) == 3, raw.writes
    assert raw.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding: chunked" in raw.writes[0]
    assert raw.writes[0].endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")
    assert raw.writes[1] == b"9\r\ndata: 2\n\n\r\n"
    assert raw.writes[2] == b"0\r\n\r\n"
    protocol.connection_lost(None)


@pytest.mark.parametrize("path", ["/json", "/stream"])
def test_clients_read_the_answers_over_a_real_socket(serve_app: Any, path: str) -> None:
    with serve_app(_app) as url, httpx.Client(base_url=url, timeout=10) as client:
        for _ in range(3):  # keep-alive reuse: heads are never lost or reordered
            response = client.get(path)
            assert response.status_code == 200
            expected = b'{"ok":true}' if path == "/json" else b"data: 1\n\ndata: 2\n\n"
            assert response.content == expected


def test_pipelined_requests_get_their_answers_whole_and_in_order(serve_app: Any) -> None:
    with serve_app(_app) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            request = b"GET /json HTTP/1.1\r\nhost: x\r\n\r\n"
            sock.sendall(request * 3)
            data = b""
            while data.count(b'{"ok":true}') < 3:
                chunk = sock.recv(65536)
                assert chunk, "the server closed the connection"
                data += chunk
    answers = data.split(b"HTTP/1.1 ")[1:]
    assert len(answers) == 3
    for answer in answers:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"200 OK") and body == b'{"ok":true}'


async def test_the_scope_names_its_connection_and_says_whether_the_body_is_in() -> None:
    seen: list[tuple[bool, bool, bool]] = []
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        connection = connection_of(scope)
        assert connection is not None
        before = connection.body_received()
        await release.wait()
        seen.append((connection is protocol, before, connection.body_received()))
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    _raw, protocol = await _connection(app)
    head = b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\n"
    protocol.data_received(head + b"ab")  # half the body: the app would have to wait
    await asyncio.sleep(0.01)
    protocol.data_received(b"cd")
    release.set()
    await asyncio.sleep(0.01)
    release.clear()
    protocol.data_received(head + b"abcd")  # the whole body with the head
    await asyncio.sleep(0.01)
    release.set()
    await asyncio.sleep(0.01)
    assert seen == [(True, False, True), (True, True, True)]
    assert connection_of({"type": "http"}) is None
    assert connection_of({"type": "http", "extensions": {CONNECTION_EXTENSION: {}}}) is None
    protocol.connection_lost(None)


async def test_a_disconnect_watch_is_called_once_and_not_after_it_is_withdrawn() -> None:
    raw, protocol = await _connection(_app)
    calls: list[str] = []

    def first() -> None:
        calls.append("first")

    def second() -> None:
        calls.append("second")

    assert protocol.watch_disconnect(first)
    protocol.unwatch_disconnect(first)
    assert protocol.watch_disconnect(second)
    protocol.unwatch_disconnect(first)  # not the watch in place: left as it is
    protocol.connection_lost(None)
    protocol.connection_lost(None)
    assert calls == ["second"]
    # Once the connection is gone, a new watch is refused instead of never being called.
    assert not protocol.watch_disconnect(first)
    assert calls == ["second"] and raw.closed


async def test_a_caller_hanging_up_mid_request_reaches_the_watch_over_a_real_socket() -> None:
    called = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _app(scope, receive, send)
            return
        connection = connection_of(scope)
        assert connection is not None and connection.watch_disconnect(called.set)
        await asyncio.sleep(30)  # never answers; the caller gives up

    async with _served(app) as port:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        await asyncio.wait_for(called.wait(), 5)


@contextlib.asynccontextmanager
async def _served(app: Any, keep_alive: float = 5.0) -> AsyncIterator[int]:
    """uvicorn on HttpProtocol and an ephemeral port, in this loop; yields the port."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=HttpProtocol, log_level="warning")
    config.timeout_keep_alive = keep_alive
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        server.force_exit = True
        await serving


async def test_an_idle_keep_alive_connection_is_closed_after_its_timeout_and_not_before() -> None:
    async with _served(_app, keep_alive=1.0) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = b"GET /json HTTP/1.1\r\nhost: x\r\n\r\n"
        try:
            for _ in range(3):  # each answer re-arms the timeout; 0.4 s apart it stays open
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200 OK")
                assert await reader.readexactly(11) == b'{"ok":true}'
                await asyncio.sleep(0.4)
            started = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
            idle = asyncio.get_running_loop().time() - started
            assert 0.3 < idle < 5.0
        finally:
            writer.close()


async def _settle(turns: int = 20) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


async def _answer(send: Any, body: bytes = b"ok", *headers: tuple[bytes, bytes]) -> None:
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": 200, "headers": [length, *headers]})
    await send({"type": "http.response.body", "body": body})


async def test_a_head_whose_body_is_late_goes_out_on_the_next_turn_not_with_the_body() -> None:
    go = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await go.wait()
        await send({"type": "http.response.body", "body": b"late", "more_body": False})

    raw, protocol = await _connection(app)
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await _settle()
    assert len(raw.writes) == 1 and raw.writes[0].endswith(b"transfer-encoding: chunked\r\n\r\n")
    go.set()
    await _settle()
    assert raw.writes[1:] == [b"4\r\nlate\r\n0\r\n\r\n"]
    protocol.connection_lost(None)


async def test_expect_100_continue_is_answered_when_the_app_reads_and_never_held() -> None:
    bodies: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        bodies.append(message["body"])
        await _answer(send)

    raw, protocol = await _connection(app)
    protocol.data_received(
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nexpect: 100-continue\r\n\r\n"
    )
    await _settle()
    assert raw.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    protocol.data_received(b"abc")
    await _settle()
    assert bodies == [b"abc"] and raw.writes[1].startswith(b"HTTP/1.1 200 OK\r\n")
    protocol.connection_lost(None)


async def test_a_chunked_request_body_reaches_the_app_whole() -> None:
    seen: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message["body"]
            if not message["more_body"]:
                break
        seen.append(body)
        await _answer(send)

    raw, protocol = await _connection(app)
    protocol.data_received(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
    protocol.data_received(b"3\r\nabc\r\n")
    await _settle()
    protocol.data_received(b"2\r\nde\r\n0\r\n\r\n")
    await _settle()
    assert seen == [b"abcde"]
    assert raw.writes[0].endswith(b"\r\n\r\nok")
    protocol.connection_lost(None)


async def test_a_pipelined_request_pauses_reading_until_the_one_before_is_answered() -> None:
    """A caller that pipelines is not read ahead of the answers: one request waits,
    parsed, behind the one being answered, and no more are taken in meanwhile."""
    release = asyncio.Event()
    answered: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/slow":
            await release.wait()
        await _answer(send)
        answered.append(scope["path"])

    raw, protocol = await _connection(app)
    protocol.data_received(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
    await _settle()
    assert raw.reading is True  # nothing is waiting behind it
    protocol.data_received(b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n")
    await _settle()
    assert raw.reading is False and answered == []
    release.set()
    await _settle()
    assert answered == ["/slow", "/next"] and raw.reading is True
    assert len(raw.writes) == 2 and not raw.closed
    protocol.connection_lost(None)


async def test_a_large_unread_body_pauses_reading_until_the_app_reads() -> None:
    release = asyncio.Event()
    got: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()
        size = 0
        while True:
            message = await receive()
            size += len(message["body"])
            if not message["more_body"]:
                break
        got.append(size)
        await _answer(send)

    raw, protocol = await _connection(app)
    size = 200_000
    protocol.data_received(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % size)
    protocol.data_received(b"x" * 100_000)
    assert raw.reading is False  # more than the high-water mark is waiting
    release.set()
    await _settle()
    assert raw.reading is True
    protocol.data_received(b"x" * 100_000)
    await _settle()
    assert got == [size]
    protocol.connection_lost(None)


async def test_head_answers_carry_the_length_but_no_body() -> None:
    raw, protocol = await _connection(_app)
    protocol.data_received(b"HEAD /json HTTP/1.1\r\nhost: x\r\n\r\n")
    await _settle()
    assert len(raw.writes) == 1
    head, _, body = raw.writes[0].partition(b"\r\n\r\n")
    assert b"content-length: 11" in head and body == b""
    assert not raw.closed  # the connection stays usable
    protocol.connection_lost(None)


async def test_http_1_0_and_connection_close_end_the_connection_after_the_answer() -> None:
    for request in (
        b"GET /json HTTP/1.0\r\n\r\n",
        # HTTP/1.0's keep-alive extension is not offered (as uvicorn does not)
        b"GET /json HTTP/1.0\r\nconnection: keep-alive\r\n\r\n",
        b"GET /json HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    ):
        raw, protocol = await _connection(_app)
        protocol.data_received(request)
        await _settle()
        assert raw.closed
        head, _, body = raw.writes[0].partition(b"\r\n\r\n")
        assert b"connection: close" in head and body == b'{"ok":true}'


async def test_an_app_that_fails_before_answering_gets_a_500_and_after_a_closed_connection() -> (
    None
):
    async def before(scope: Any, receive: Any, send: Any) -> None:
        raise ValueError("boom")

    async def after(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise ValueError("boom")

    async def silent(scope: Any, receive: Any, send: Any) -> None:
        return None

    for app, expect_500 in ((before, True), (after, False), (silent, True)):
        raw, protocol = await _connection(app)
        protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await _settle()
        wire = b"".join(raw.writes)
        assert raw.closed
        if expect_500:
            assert wire.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
            assert wire.endswith(b"Internal Server Error")
        else:
            assert wire.startswith(b"HTTP/1.1 200 OK\r\n") and not wire.endswith(b"0\r\n\r\n")


async def test_a_body_longer_or_shorter_than_its_length_is_refused_and_the_connection_closed() -> (
    None
):
    errors: list[str] = []

    def app_with(chunks: list[bytes]) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-length", b"4")],
                }
            )
            try:
                for i, chunk in enumerate(chunks):
                    more = i < len(chunks) - 1
                    await send({"type": "http.response.body", "body": chunk, "more_body": more})
            except RuntimeError as exc:
                errors.append(str(exc))
                raise

        return app

    for chunks in ([b"toolong"], [b"ab"]):
        raw, protocol = await _connection(app_with(chunks))
        protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await _settle()
        assert raw.closed
    assert errors == [
        "Response content longer than Content-Length",
        "Response content shorter than Content-Length",
    ]


@pytest.mark.parametrize(
    "header",
    [
        (b"x-evil", b"a\r\nset-cookie: b"),
        (b"x-evil: a\r\nset-cookie", b"b"),
        (b"x evil", b"b"),
        (b"x-ok", b"a\nb"),
    ],
)
async def test_header_injection_is_refused(header: tuple[bytes, bytes]) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await _answer(send, b"ok", (b"x-fine", b"tab\tand spaces"), header)

    raw, protocol = await _connection(app)
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await _settle()
    wire = b"".join(raw.writes)
    assert wire.startswith(b"HTTP/1.1 500 ") and b"set-cookie" not in wire


async def test_an_unparsable_request_gets_a_400_and_a_closed_connection() -> None:
    raw, protocol = await _connection(_app)
    protocol.data_received(b"NOT HTTP AT ALL\r\n\r\n")
    assert raw.closed and raw.writes[0].startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert raw.writes[0].endswith(b"Invalid HTTP request received.")


async def test_past_the_concurrency_limit_the_answer_is_503() -> None:
    raw, protocol = await _connection(_app, limit_concurrency=1)  # this connection is one
    protocol.data_received(b"GET /json HTTP/1.1\r\nhost: x\r\n\r\n")
    await _settle()
    assert raw.writes[0].startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and raw.closed


async def test_the_path_query_and_headers_reach_the_app_as_asgi_says() -> None:
    scopes: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scopes.append(scope)
        await _answer(send)

    _raw, protocol = await _connection(app, root_path="/api")
    protocol.data_received(b"GET /a%20b/c?x=1&y=2 HTTP/1.1\r\nHost: x\r\nX-Thing: V\r\n\r\n")
    await _settle()
    scope = scopes[0]
    assert scope["type"] == "http" and scope["method"] == "GET"
    assert scope["path"] == "/api/a b/c" and scope["raw_path"] == b"/api/a%20b/c"
    assert scope["root_path"] == "/api" and scope["query_string"] == b"x=1&y=2"
    assert scope["headers"] == [(b"host", b"x"), (b"x-thing", b"V")]
    assert scope["client"] == ("127.0.0.1", 5555) and scope["server"] == ("127.0.0.1", 8080)
    assert scope["http_version"] == "1.1" and scope["scheme"] == "http"
    assert connection_of(scope) is protocol
    protocol.connection_lost(None)


async def test_a_disconnect_reaches_a_waiting_receive_and_later_sends_are_dropped() -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(await receive())
        seen.append(await receive())  # waits: the whole body is in; only a disconnect ends it
        await send({"type": "http.response.start", "status": 200, "headers": []})
        seen.append("sent")

    raw, protocol = await _connection(app)
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await _settle()
    assert seen == [{"type": "http.request", "body": b"", "more_body": False}]
    protocol.connection_lost(None)
    await _settle()
    assert seen[1:] == [{"type": "http.disconnect"}, "sent"] and raw.writes == []


async def test_writes_wait_while_the_transport_is_paused() -> None:
    sent: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(3):
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
            sent.append(i)
        await send({"type": "http.response.body", "body": b""})

    raw, protocol = await _connection(app)
    protocol.pause_writing()
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await _settle()
    assert sent == [] and raw.writes == []
    protocol.resume_writing()
    await _settle()
    assert sent == [0, 1, 2] and b"".join(raw.writes).endswith(b"0\r\n\r\n")
    protocol.connection_lost(None)


async def test_shutdown_closes_an_idle_connection_now_and_a_busy_one_after_its_answer() -> None:
    raw, protocol = await _connection(_app)
    protocol.shutdown()
    assert raw.closed

    go = asyncio.Event()

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        await go.wait()
        await _answer(send)

    raw, protocol = await _connection(slow)
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await _settle()
    protocol.shutdown()
    assert not raw.closed
    go.set()
    await _settle()
    assert raw.closed and b"connection: close" in raw.writes[0]


async def test_a_head_answer_without_a_length_is_not_declared_chunked() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ignored for HEAD"})

    raw, protocol = await _connection(app)
    protocol.data_received(b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n")
    await _settle()
    assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\n"] and not raw.closed
    protocol.connection_lost(None)


async def test_an_answer_given_without_reading_a_held_back_body_closes_the_connection() -> None:
    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        await _answer(send, b"no")  # never asks for the body

    raw, protocol = await _connection(refuse)
    protocol.data_received(
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nexpect: 100-continue\r\n\r\n"
    )
    await _settle()
    assert b"100 Continue" not in b"".join(raw.writes)
    assert b"connection: close" in raw.writes[0] and raw.closed


async def test_an_upgrade_request_is_answered_as_plain_http_and_the_connection_closed() -> None:
    raw, protocol = await _connection(_app)
    protocol.data_received(
        b"GET /json HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n"
    )
    await _settle()
    assert raw.writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and raw.closed
    assert raw.writes[0].endswith(b'{"ok":true}')


async def test_a_request_head_over_the_limit_gets_431_and_a_closed_connection() -> None:
    from chatroute.server.protocol import MAX_HEAD_BYTES

    # A header that grows across many reads (httptools would buffer it without end).
    raw, protocol = await _connection(_app)
    protocol.data_received(b"GET /json HTTP/1.1\r\nhost: x\r\nx-big: ")
    sent = 0
    while not raw.closed and sent < 4 * MAX_HEAD_BYTES:
        protocol.data_received(b"a" * 4096)
        sent += 4096
    assert raw.closed and sent <= MAX_HEAD_BYTES + 4096
    assert raw.writes[0].startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")

    # A target over the limit, in one read.
    raw, protocol = await _connection(_app)
    protocol.data_received(b"GET /" + b"a" * MAX_HEAD_BYTES + b" HTTP/1.1\r\n")
    assert raw.closed and raw.writes[0].startswith(b"HTTP/1.1 431 ")

    # Headers over the limit that arrive whole, in one read.
    raw, protocol = await _connection(_app)
    many = b"".join(b"x-h%d: %s\r\n" % (i, b"b" * 1000) for i in range(70))
    protocol.data_received(b"GET /json HTTP/1.1\r\nhost: x\r\n" + many + b"\r\n")
    await _settle()
    assert raw.closed and len(raw.writes) == 1 and raw.writes[0].startswith(b"HTTP/1.1 431 ")

    # A large head within the limit is served, and the next request on the connection too.
    raw, protocol = await _connection(_app)
    big = b"GET /json HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (MAX_HEAD_BYTES // 2) + b"\r\n\r\n"
    for start in range(0, len(big), 4096):
        protocol.data_received(big[start : start + 4096])
    await _settle()
    protocol.data_received(b"GET /json HTTP/1.1\r\nhost: x\r\n\r\n")
    await _settle()
    assert not raw.closed and len(raw.writes) == 2
    assert all(w.startswith(b"HTTP/1.1 200 OK\r\n") for w in raw.writes)
    protocol.connection_lost(None)
