"""The HTTP protocol the service runs on, over real sockets: head limits and pipelining."""

from __future__ import annotations

import asyncio
import select
import socket
import time
from typing import Any

from chatroute.server.connection import MAX_HEAD_BYTES


async def _app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    if scope["path"] == "/slow-answer":
        await asyncio.sleep(0.6)
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
    with serve_app(_app, head_timeout=0.3) as url:
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
            time.sleep(0.5)  # idle past the head timeout: keep-alive is uvicorn's (30 s here)
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
