"""The service's HTTP protocol: a response head leaves in the same write as its body."""

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
    CoalescingTransport,
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
        pass

    def resume_reading(self) -> None:
        pass


async def test_head_and_body_written_in_the_same_turn_leave_in_one_write() -> None:
    raw = RecordingTransport()
    transport = CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(HEAD)
    assert raw.writes == []
    transport.write(b"hello")
    assert raw.writes == [HEAD + b"hello"]
    await asyncio.sleep(0)  # the cancelled fallback writes nothing more
    assert raw.writes == [HEAD + b"hello"]


async def test_a_head_without_a_body_goes_out_on_the_next_turn() -> None:
    raw = RecordingTransport()
    transport = CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    head = b"HTTP/1.1 204 No Content\r\n\r\n"
    transport.write(head)
    assert raw.writes == []
    await asyncio.sleep(0)
    assert raw.writes == [head]
    transport.write(b"next")  # not held: goes straight through, after the head
    assert raw.writes == [head, b"next"]


async def test_interim_answers_and_body_chunks_are_never_held() -> None:
    raw = RecordingTransport()
    transport = CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert raw.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    transport.write(b"5\r\nhello\r\n")
    transport.writelines([b"0\r\n", b"\r\n"])
    assert raw.writes[1:] == [b"5\r\nhello\r\n", b"0\r\n\r\n"]


async def test_close_writes_a_held_head_first_and_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    raw = RecordingTransport()
    transport = CoalescingTransport(raw, loop)  # type: ignore[arg-type]
    transport.write(HEAD)
    transport.close()
    assert raw.writes == [HEAD] and raw.closed
    await asyncio.sleep(0)
    assert raw.writes == [HEAD] and raw.late == []  # the fallback does not write after close

    raw = RecordingTransport()
    transport = CoalescingTransport(raw, loop)  # type: ignore[arg-type]
    transport.write(HEAD)
    transport.abort()
    await asyncio.sleep(0)
    assert raw.writes == [] and raw.aborted

    raw = RecordingTransport()
    transport = CoalescingTransport(raw, loop)  # type: ignore[arg-type]
    transport.write(HEAD)
    transport.write_eof()
    assert raw.writes == [HEAD] and raw.eof


async def test_a_head_held_when_the_connection_is_lost_is_dropped() -> None:
    raw = RecordingTransport()
    transport = CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(HEAD)
    raw.closed = True  # the peer went away before the loop's next turn
    await asyncio.sleep(0)  # the fallback must not write to the closed transport
    assert raw.writes == [] and raw.late == []


async def test_other_attributes_are_the_wrapped_transports() -> None:
    raw = RecordingTransport()
    transport = CoalescingTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    assert transport.get_extra_info("peername") == ("127.0.0.1", 5555)
    assert transport.is_closing() is False


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


async def _connection(app: Any) -> tuple[RecordingTransport, HttpProtocol]:
    config = uvicorn.Config(app, http=HttpProtocol, log_level="warning", lifespan="off")
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
        if protocol.cycle is not None and protocol.cycle.response_complete:
            break
    await asyncio.sleep(0)
    return raw, protocol


async def test_uvicorn_writes_an_answer_in_one_write_through_the_protocol() -> None:
    raw, protocol = await _exchange(b"GET /json HTTP/1.1\r\nhost: x\r\n\r\n")
    assert len(raw.writes) == 1, raw.writes
    head, _, body = raw.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"content-length: 11" in head
    assert body == b'{"ok":true}'
    protocol.connection_lost(None)


async def test_uvicorn_streams_the_first_event_with_the_head_and_later_ones_on_their_own() -> None:
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
