"""A minimal asyncio HTTP/1.1 load client for /v1/route and /v1/classify (cheap on a shared CPU)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence


class Conn:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads Content-Length answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int):
        self.reader = reader
        self.writer = writer
        self.host = f"127.0.0.1:{port}".encode()

    @classmethod
    async def open(cls, port: int) -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer, port)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.writer.write(
            b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path.encode(), self.host, len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = None
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if length is None:
            raise RuntimeError("the load client needs Content-Length answers")
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def route_load(port: int, texts: Sequence[str], clients: int) -> tuple[float, list[float]]:
    """Every text once through /v1/route by `clients` concurrent connections."""
    bodies = [json.dumps({"input": t}).encode() for t in texts]
    conns = [await Conn.open(port) for _ in range(clients)]
    for conn in conns:  # warm
        await conn.post("/v1/route", bodies[0])
    latencies: list[float] = []
    queue = iter(bodies)

    async def worker(conn: Conn) -> None:
        for body in queue:
            started = time.perf_counter()
            status, payload = await conn.post("/v1/route", body)
            latencies.append(time.perf_counter() - started)
            if status != 200:
                raise RuntimeError(f"/v1/route: HTTP {status}: {payload[:200]!r}")

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - started
    for conn in conns:
        await conn.close()
    return len(bodies) / elapsed, latencies


async def classify_load(port: int, batches: Sequence[Sequence[str]]) -> float:
    """Inputs per second through /v1/classify, one batch per request, one at a time."""
    bodies = [json.dumps({"inputs": list(b)}).encode() for b in batches]
    conn = await Conn.open(port)
    await conn.post("/v1/classify", bodies[0])
    started = time.perf_counter()
    for body in bodies:
        status, payload = await conn.post("/v1/classify", body)
        if status != 200:
            raise RuntimeError(f"/v1/classify: HTTP {status}: {payload[:200]!r}")
    elapsed = time.perf_counter() - started
    await conn.close()
    return sum(len(b) for b in batches) / elapsed
