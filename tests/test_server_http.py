"""The HTTP protocol the service runs on, over real sockets: head limits, pipelining, and
its coalesced writes."""

from __future__ import annotations

import asyncio
import select
import socket
import time
from typing import Any

from chatroute.server.connection import MAX_HEAD_BYTES, CoalescingTransport

HEAD_TIMEOUT = 0.15  # the head timeout of the server in the head-timeout test


async def _app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    if scope["path"] == "/slow-answer":
        await asyncio.sleep(2 * HEAD_TIMEOUT)
    size = 0
    while True:  # read the whole body, and answer with its size
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b'{"path":"%s","size":%d}' % (scope["path"].encode(), size)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _answers(data: bytes) -> list[tuple[bytes, bytes]]:
    """(status line rest, body) of each answer in a stream of answers."""
    answers = []
    for answer in data.split(b"HTTP/1.1 ")[1:]:
        head, _, body = answer.partition(b"\r\n\r\n")
        answers.append((head, body))
    return answers


def test_a_request_head_over_the_limit_gets_431_and_a_closed_connection(serve_app: Any) -> None:
    with serve_app(_app) as url:
        # A header value that grows across many reads (httptools would buffer it without end):
        # refused once the head passes the limit, before the caller has sent more.
        with _connect(url) as sock:
            sock.sendall(b"GET /big HTTP/1.1\r\nhost: x\r\nx-big: ")
            time.sleep(0.05)  # the head's start arrives on its own
            for _ in range(MAX_HEAD_BYTES // 4096):
                sock.sendall(b"a" * 4096)
            readable, _, _ = select.select([sock], [], [], 10)
            assert readable, "no answer to a head over the limit"
            data = _read_until_closed(sock)
            assert data.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")

        # Many headers over the limit, sent whole: refused before the app sees the request.
        with _connect(url) as sock:
            many = b"".join(b"x-h%d: %s\r\n" % (i, b"b" * 1000) for i in range(70))
            sock.sendall(b"GET /many HTTP/1.1\r\nhost: x\r\n" + many + b"\r\n")
            data = _read_until_closed(sock)
            assert data.startswith(b"HTTP/1.1 431 ") and b'"path"' not in data

        # A large head within the limit is served, and so is the next request after it.
        with _connect(url) as sock:
            big = b"x-big: " + b"a" * (MAX_HEAD_BYTES // 2) + b"\r\n"
            sock.sendall(b"GET /one HTTP/1.1\r\nhost: x\r\n" + big + b"\r\n")
            sock.sendall(b"GET /two HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            answers = _answers(_read_until_closed(sock))
            assert [status[:6] for status, _ in answers] == [b"200 OK", b"200 OK"]
            assert [b'"path":"/one"' in body for _, body in answers] == [True, False]


def test_a_head_not_complete_within_the_head_timeout_closes_the_connection(
    serve_app: Any,
) -> None:
    with serve_app(_app, head_timeout=HEAD_TIMEOUT) as url:
        # A caller that trickles its head is cut off.
        with _connect(url) as sock:
            sock.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n")
            started = time.monotonic()
            closed = False
            while not closed and time.monotonic() - started < 10:
                try:
                    sock.sendall(b"x-a: b\r\n")  # a header line every 50 ms, never the end
                    time.sleep(0.05)
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
            if not closed:
                sock.settimeout(5)
                closed = _read_until_closed(sock) == b""
            assert closed

        # A connection that never sends a byte is closed too.
        with _connect(url) as sock:
            assert _read_until_closed(sock) == b""

        # A head begun while the answer before it is on its way is not cut off by that
        # wait: the answer arrives whole, then the unfinished head's own time runs out.
        with _connect(url) as sock:
            sock.sendall(b"GET /slow-answer HTTP/1.1\r\nhost: x\r\n\r\nGET /next HTTP/1.1\r\n")
            data = _read_until_closed(sock)
            assert data.startswith(b"HTTP/1.1 200 OK") and data.endswith(b'"size":0}')
            assert data.count(b"HTTP/1.1 ") == 1

        # A head sent in time is answered, and the wait between requests is not a head's.
        with _connect(url) as sock:
            sock.sendall(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n")
            first = sock.recv(65536)
            assert first.startswith(b"HTTP/1.1 200 OK") and b'"path":"/a"' in first
            time.sleep(2 * HEAD_TIMEOUT)  # idle past the head timeout: keep-alive is uvicorn's
            sock.sendall(b"GET /b HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            assert b'"path":"/b"' in _read_until_closed(sock)


def test_pipelined_requests_are_answered_in_order_also_after_a_large_body(
    serve_app: Any,
) -> None:
    body = b"x" * (512 * 1024)  # over uvicorn's read buffer limit: reading pauses meanwhile
    with serve_app(_app) as url, _connect(url) as sock:
        requests = [
            b"GET /first HTTP/1.1\r\nhost: x\r\n\r\n",
            b"POST /large HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body,
            b"GET /after HTTP/1.1\r\nhost: x\r\n\r\n",
            b"POST /small HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nab",
            b"GET /last HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        ]
        sock.sendall(b"".join(requests))
        answers = _answers(_read_until_closed(sock))
    assert [status[:6] for status, _ in answers] == [b"200 OK"] * 5
    assert [body for _, body in answers] == [
        b'{"path":"/first","size":0}',
        b'{"path":"/large","size":%d}' % len(body),
        b'{"path":"/after","size":0}',
        b'{"path":"/small","size":2}',
        b'{"path":"/last","size":0}',
    ]


class _RecordingTransport:
    """A transport that records what it is asked to send."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.sent.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 5000) if name == "peername" else default


async def test_a_response_head_leaves_with_the_write_after_it_in_one_send() -> None:
    inner = _RecordingTransport()
    transport = CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(b"before")  # nothing held: straight through
    assert inner.sent == [b"before"]
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n"
    transport.hold_next()
    transport.write(head)
    assert inner.sent == [b"before"]  # held
    assert transport.get_write_buffer_size() == 7 + len(head)
    transport.write(b"body")  # leaves with the head, at once
    assert inner.sent == [b"before", head + b"body"]
    transport.write(b"next")
    assert inner.sent[2:] == [b"next"]
    await asyncio.sleep(0)  # the scheduled flush finds nothing left to send
    assert len(inner.sent) == 3
    assert transport.get_extra_info("peername") == ("127.0.0.1", 5000)  # the rest is inner's


async def test_a_head_alone_in_its_step_leaves_at_the_end_of_the_step() -> None:
    loop = asyncio.get_running_loop()
    inner = _RecordingTransport()
    transport = CoalescingTransport(inner, loop)  # type: ignore[arg-type]
    transport.hold_next()
    transport.write(b"head")
    await asyncio.sleep(0)
    assert inner.sent == [b"head"]
    transport.hold_next()
    transport.write(b"last words")  # closing hands a held write on first
    transport.close()
    assert inner.sent[1:] == [b"last words"] and inner.closed
    other = _RecordingTransport()
    aborted = CoalescingTransport(other, loop)  # type: ignore[arg-type]
    aborted.hold_next()
    aborted.write(b"dropped")
    aborted.abort()  # an abort drops it
    await asyncio.sleep(0)
    assert other.aborted and other.sent == []


async def _stream_app(scope: Any, receive: Any, send: Any) -> None:
    """Streams one chunk, then a second only once the caller has asked for it."""
    if scope["type"] == "lifespan":
        await _app(scope, receive, send)
        return
    if scope["path"] == "/go":
        _GO.set()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"data: one\n\n", "more_body": True})
    await asyncio.wait_for(_GO.wait(), 10)  # never set unless the first chunk went out
    await send({"type": "http.response.body", "body": b"data: two\n\n"})


_GO = asyncio.Event()


def test_a_streamed_chunk_goes_out_without_waiting_for_the_next(serve_app: Any) -> None:
    global _GO
    _GO = asyncio.Event()
    with serve_app(_stream_app) as url, _connect(url) as sock, _connect(url) as other:
        sock.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        received = b""
        while b"data: one" not in received:
            chunk = sock.recv(65536)
            assert chunk, "the connection closed before the first chunk"
            received += chunk
        assert b"data: two" not in received
        other.sendall(b"GET /go HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _read_until_closed(other).startswith(b"HTTP/1.1 204")
        while b"data: two" not in received:
            chunk = sock.recv(65536)
            assert chunk, "the connection closed before the second chunk"
            received += chunk
