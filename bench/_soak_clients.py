"""The soak's clients: a hand-spoken keep-alive HTTP/1.1 connection per user, and its results."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass


@dataclass
class Result:
    rid: str
    route: str
    stream: bool
    started: float
    ended: float = 0.0
    first_content: float | None = None
    status: int | None = None
    complete: bool = False
    in_band_error: bool = False
    text: str = ""
    attempts_header: int | None = None
    transport_error: str | None = None


def parse_stream(res: Result, body: str) -> None:
    """Fill in what a streamed body said (parsed once it has all arrived: cheaper)."""
    parts: list[str] = []
    for block in body.split("\n\n"):
        if not block.startswith("data: "):
            continue
        data = block[6:]
        if data == "[DONE]":
            res.complete = True
            continue
        event = json.loads(data)
        if "error" in event:
            res.in_band_error = True
        elif event.get("choices"):
            piece = event["choices"][0]["delta"].get("content")
            if piece:
                parts.append(piece)
    res.text = "".join(parts)


class Caller:
    """One user's keep-alive HTTP/1.1 connection to the service, spoken by hand.

    A client library with a shared connection pool (httpx) spends more time managing its
    pool than the service spends routing once hundreds of streams run at once, and would
    set the pace; one plain connection per user keeps the clients cheap.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None

    async def post(self, res: Result, body: bytes) -> bytes:
        """Send one request; fill in status and headers; return the decoded body."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.reader, self.writer
        assert reader is not None
        writer.write(
            (
                f"POST /v1/chat/completions HTTP/1.1\r\nhost: {self.host}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        res.status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        attempts = headers.get("x-chatroute-attempts")
        res.attempts_header = int(attempts) if attempts else None
        out = bytearray()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                data = await reader.readexactly(size + 2)
                if size == 0:
                    break
                if res.first_content is None and b'"content"' in data:
                    res.first_content = time.monotonic()
                out += data[:-2]
        else:
            out += await reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return bytes(out)


async def one_request(caller: Caller, rid: str, route: str, stream: bool, limit: float) -> Result:
    res = Result(rid, route, stream, time.monotonic())
    body = {"model": route, "stream": stream, "messages": [{"role": "user", "content": rid}]}
    try:
        async with asyncio.timeout(limit):
            raw = await caller.post(res, json.dumps(body).encode())
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as exc:
        res.transport_error = repr(exc)
        res.ended = time.monotonic()
        await caller.close()
        return res
    res.ended = time.monotonic()
    try:
        if res.status != 200:
            if "error" not in json.loads(raw):
                raise ValueError("an error answer without an OpenAI error object")
        elif stream:
            parse_stream(res, raw.decode())
        else:
            message = json.loads(raw)["choices"][0]["message"]
            res.text, res.complete = message["content"] or "", True
    except (ValueError, KeyError, TypeError) as exc:
        res.transport_error = f"unreadable answer: {exc!r}"
    return res
