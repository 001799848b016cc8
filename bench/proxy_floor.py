"""The floor under the proxy-overhead target: what each layer of the serving stack adds here.

Run from the repository root:

    .venv/bin/python bench/proxy_floor.py [--pairs 400] [--rounds 3] [--no-write]

It measures, exactly as section a. of bench/service_bench.py does (interleaved pairs at
concurrency 1, the same fixed-latency upstream, the same client), a ladder of pass-through
relays that do nothing but forward the request body and relay the answer (or the event
stream, chunk by chunk), each one layer heavier than the one before:

1. `asyncio` streams on uvloop on both sides: a hand-written HTTP/1.1 relay with one
   upstream connection (non-streaming only): the loop and the kernel, no framework.
2. uvicorn (uvloop, httptools) serving a plain ASGI callable, same upstream side as 1.
3. uvicorn + plain ASGI, posting with one pooled aiohttp session (the transport
   chatroute's providers use).
4. as 3, on the HTTP protocol `chatroute serve` runs (`GuardedHttpProtocol`: uvicorn's
   httptools protocol with the request head's size and time limits), as 5 and 6 are.
5. a FastAPI route (`Request.body()`, `Response`), aiohttp session: the stack of an
   ordinary FastAPI proxy endpoint, which chatroute's chat endpoint is (the floor relay of
   `bench/service_bench.py`).
6. as 5, but posting through the openai SDK's httpx client on its aiohttp transport
   (`openai.DefaultAioHttpClient`, a streamed `send`).

No validation, routing, failover, timeouts, metrics or error handling in any of them. A
streamed answer's head goes out with the upstream's first bytes, never before: chatroute's
commit rule holds its head until the first content, and a head sent while the upstream is
still silent lets the caller parse it off the time to the first token.
Whatever a rung adds over the rung below is what that layer costs on this machine. The
result goes to the `proxy-floor` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import bench_main, command, machine, table
from bench.service_bench import (
    _free_port,
    loadavg,
    overhead,
    running,
    start_upstream,
    uvicorn_stack,
)

RELAYS = r'''
import asyncio
import json
import sys

UPSTREAM_PORT = int(sys.argv[1])
PORT = int(sys.argv[2])
RUNG = sys.argv[3]
PATH = "/v1/chat/completions"
URL = f"http://127.0.0.1:{UPSTREAM_PORT}{PATH}"
HEADERS = {"content-type": "application/json"}


def content_length(head):
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


class RawUpstream:
    """One keep-alive upstream connection; Content-Length answers only."""

    def __init__(self):
        self.reader = self.writer = None

    async def post(self, body):
        if self.reader is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", UPSTREAM_PORT)
        self.writer.write(
            b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (PATH.encode(), len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        return await self.reader.readexactly(content_length(head))


class AiohttpUpstream:
    def __init__(self):
        self.session = None

    def _session(self):
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession()
        return self.session

    async def post(self, body):
        async with self._session().post(URL, data=body, headers=HEADERS) as answer:
            return await answer.read()

    async def stream(self, body):
        answer = await self._session().post(URL, data=body, headers=HEADERS)
        try:
            async for chunk in answer.content.iter_any():
                yield chunk
        finally:
            answer.release()


class SdkHttpUpstream:
    def __init__(self):
        self.client = None

    def _client(self):
        import openai

        if self.client is None:
            self.client = openai.DefaultAioHttpClient()
        return self.client

    async def _send(self, body):
        client = self._client()
        request = client.build_request("POST", URL, content=body, headers=HEADERS)
        return await client.send(request, stream=True)

    async def post(self, body):
        answer = await self._send(body)
        try:
            return await answer.aread()
        finally:
            await answer.aclose()

    async def stream(self, body):
        answer = await self._send(body)
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        finally:
            await answer.aclose()


def is_stream(body):
    return b'"stream":true' in body.replace(b" ", b"")


async def asgi_body(receive):
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


def plain_asgi(upstream):
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = await asgi_body(receive)
        if is_stream(body):
            # The head waits for the upstream's first bytes, as chatroute's commit rule
            # makes it wait: sent earlier, the caller would parse it during the upstream's
            # delay, off the time to the first token.
            chunks = upstream.stream(body)
            first = await anext(chunks)
            start = {"type": "http.response.start", "status": 200,
                     "headers": [(b"content-type", b"text/event-stream")]}
            await send(start)
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        answer = await upstream.post(body)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(answer)).encode()),
        ]})
        await send({"type": "http.response.body", "body": answer})

    return app


def fastapi_app(upstream):
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse

    app = FastAPI()

    @app.post(PATH)
    async def relay(request: Request) -> Response:
        body = await request.body()
        if is_stream(body):
            chunks = upstream.stream(body)
            first = await anext(chunks)  # the head waits for the upstream, as in plain_asgi

            async def relayed():
                yield first
                async for chunk in chunks:
                    yield chunk

            return StreamingResponse(relayed(), media_type="text/event-stream")
        return Response(await upstream.post(body), media_type="application/json")

    return app


async def raw_relay():
    upstream = RawUpstream()

    async def handle(reader, writer):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            answer = await upstream.post(await reader.readexactly(content_length(head)))
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
            )

    server = await asyncio.start_server(handle, "127.0.0.1", PORT)
    async with server:
        await server.serve_forever()


if RUNG == "1":
    import uvloop

    uvloop.run(raw_relay())
else:
    import uvicorn

    from chatroute.server.connection import http_protocol

    app = {
        "2": lambda: plain_asgi(RawUpstream()),
        "3": lambda: plain_asgi(AiohttpUpstream()),
        "4": lambda: plain_asgi(AiohttpUpstream()),
        "5": lambda: fastapi_app(AiohttpUpstream()),
        "6": lambda: fastapi_app(SdkHttpUpstream()),
    }[RUNG]()
    # From rung 4 on, the HTTP protocol `chatroute serve` uses; below, uvicorn's own.
    http = http_protocol() if RUNG in ("4", "5", "6") else "httptools"
    uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning", access_log=False, http=http)
'''

RUNGS = [
    ("1", "asyncio streams relay (uvloop), raw upstream connection", False),
    ("2", "uvicorn + plain ASGI, raw upstream connection", False),
    ("3", "uvicorn + plain ASGI, aiohttp session", True),
    ("4", "as 3, on chatroute's guarded protocol (GuardedHttpProtocol)", True),
    ("5", "as 4, a FastAPI route, aiohttp session", True),
    ("6", "as 5, SDK httpx client on aiohttp", True),
]
FLOOR_RUNG = "5"  # the stack chatroute's chat endpoint runs on, with no chatroute code


def start_relay(stack: ExitStack, rung: str, upstream_port: int, port: int, work: Path) -> int:
    argv = [sys.executable, "-c", RELAYS, str(upstream_port), str(port), rung]
    log = work / f"relay{rung}.log"
    proc = stack.enter_context(running(argv, log=log))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text(encoding="utf-8")[-2000:])
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc.pid
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"relay {rung} did not start within 60 s")


def run(args: argparse.Namespace) -> str:
    load_before = loadavg()
    rows = []
    for rung, label, streams in RUNGS:
        with tempfile.TemporaryDirectory(prefix="chatroute-floor-") as tmp, ExitStack() as stack:
            work = Path(tmp)
            upstream_port = start_upstream(stack, args, work)
            port = _free_port()
            pid = start_relay(stack, rung, upstream_port, port, work)
            direct = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
            through = f"http://127.0.0.1:{port}/v1/chat/completions"
            cells = [f"{rung}. {label}"]
            for stream in (False, True):
                if stream and not streams:
                    cells += ["", "", ""]
                    continue
                result = overhead(direct, through, pid, args.pairs, args.rounds, stream)
                m = result["median"]
                cells += [
                    f"{m['added_p50'] * 1e3:.2f}",
                    f"{m['service_cpu'] * 1e3:.2f}",
                    " / ".join(f"{v * 1e3:.2f}" for v in result["added_p50_rounds"]),
                ]
            rows.append(cells)
            print(" | ".join(cells), flush=True)
    lines = [
        "## Proxy-overhead floor: what each layer of the stack adds",
        "",
        f"- Machine: {machine()}; load average {load_before} before, {loadavg()} after.",
        f"- Command: `{command()}`",
        f"- Relays that only forward the body and relay the answer (uvicorn: {uvicorn_stack()});"
        " no validation, routing, failover or metrics. Upstream: `bench/_fixed_upstream.py`,"
        f" fixed {args.delay_ms:g} ms delay. {args.pairs} interleaved pairs per round,"
        f" {args.rounds} rounds, median round shown (the method of section a. of the service"
        " benchmark). Streaming: time to the first content token; the relay sends its"
        " head with the upstream's first bytes, as chatroute's commit rule requires.",
        "",
        table(
            [
                "relay",
                "added p50 ms",
                "relay CPU ms/req",
                "added p50 per round",
                "streaming: added p50 ms",
                "relay CPU ms/req",
                "added p50 per round",
            ],
            rows,
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    bench_main(parser, run, "proxy-floor")


if __name__ == "__main__":
    main()
