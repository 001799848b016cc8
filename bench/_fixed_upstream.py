"""A minimal fixed-latency OpenAI-compatible upstream for benchmarks (raw asyncio, HTTP/1.1).

It answers `POST /v1/chat/completions` after a fixed delay, and does as little else as it
can, so that measured differences belong to whatever sits between the client and it:

- non-streaming: after `delay` seconds, one JSON chat completion (Content-Length body);
- streaming: after `delay` seconds the status line, a role delta and the first content
  delta go out in one write (so time-to-first-token is `delay`); then `chunks - 1` more
  content deltas `chunk_delay` seconds apart, a finishing delta, `data: [DONE]`, and the
  end of the chunked body.

`POST /v1/messages` answers the same way in Anthropic's Messages format: one message,
or a stream whose first write carries `message_start`, the text block's start and its
first text delta, then `chunks - 1` more deltas `chunk_delay` seconds apart, the block's
end, `message_delta` and `message_stop`.

Connections are kept alive; any other path answers 404. Run it on its own:

    .venv/bin/python bench/_fixed_upstream.py --port 0 --delay-ms 10

It prints `PORT <n>` on stdout once it listens, then serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time

_COMPLETION_PATH = b"/v1/chat/completions"
_MESSAGES_PATH = b"/v1/messages"
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _completion(model: str, text: str) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-fixed",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20},
        },
        separators=(",", ":"),
    ).encode()


def _chunk(model: str, delta: dict[str, str], finish: str | None = None) -> bytes:
    event = json.dumps(
        {
            "id": "chatcmpl-fixed",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        },
        separators=(",", ":"),
    ).encode()
    return _http_chunk(b"data: " + event + b"\n\n")


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _message(model: str, text: str) -> bytes:
    """An Anthropic Messages API answer."""
    return json.dumps(
        {
            "id": "msg_fixed",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 12, "output_tokens": 8},
        },
        separators=(",", ":"),
    ).encode()


def _event(name: str, obj: dict[str, object]) -> bytes:
    """One event of an Anthropic Messages stream, as one HTTP chunk."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    return _http_chunk(b"event: " + name.encode() + b"\ndata: " + data + b"\n\n")


def _text_delta(text: str) -> bytes:
    delta = {"type": "text_delta", "text": text}
    return _event(
        "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
    )


class FixedUpstream:
    """The server's behaviour: one fixed delay, a fixed answer, optional streamed chunks."""

    def __init__(self, delay: float, chunks: int, chunk_delay: float) -> None:
        self.delay = delay
        self.chunks = max(1, chunks)
        self.chunk_delay = chunk_delay
        self.words = [f"word{i} " for i in range(self.chunks)]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, _, header_block = head.partition(b"\r\n")
                parts = request_line.split(b" ")
                length = 0
                for line in header_block.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                body = await reader.readexactly(length) if length else b""
                path = parts[1] if len(parts) >= 2 else b""
                if path not in (_COMPLETION_PATH, _MESSAGES_PATH):
                    await self._not_found(writer)
                    continue
                request = json.loads(body) if body else {}
                model = str(request.get("model") or "fixed-model")
                if path == _MESSAGES_PATH:
                    await self._messages(writer, model, bool(request.get("stream")))
                elif request.get("stream"):
                    await self._stream(writer, model)
                else:
                    await asyncio.sleep(self.delay)
                    payload = _completion(model, "".join(self.words))
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
                    )
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _not_found(self, writer: asyncio.StreamWriter) -> None:
        payload = b'{"error":{"message":"not found","type":"invalid_request_error"}}'
        writer.write(
            b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        await writer.drain()

    async def _messages(self, writer: asyncio.StreamWriter, model: str, stream: bool) -> None:
        """An answer in Anthropic's Messages format, whole or streamed."""
        await asyncio.sleep(self.delay)
        if not stream:
            payload = _message(model, "".join(self.words))
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
            )
            await writer.drain()
            return
        start = {
            "id": "msg_fixed",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 12, "output_tokens": 1},
        }
        block = {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "text", "text": ""},
        }
        writer.write(
            _SSE_HEAD
            + _event("message_start", {"type": "message_start", "message": start})
            + _event("content_block_start", block)
            + _text_delta(self.words[0])
        )
        await writer.drain()
        for word in self.words[1:]:
            if self.chunk_delay > 0:
                await asyncio.sleep(self.chunk_delay)
            writer.write(_text_delta(word))
            await writer.drain()
        finish = {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": len(self.words)},
        }
        writer.write(
            _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + _event("message_delta", finish)
            + _event("message_stop", {"type": "message_stop"})
            + b"0\r\n\r\n"
        )
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, model: str) -> None:
        await asyncio.sleep(self.delay)
        writer.write(
            _SSE_HEAD
            + _chunk(model, {"role": "assistant", "content": ""})
            + _chunk(model, {"content": self.words[0]})
        )
        await writer.drain()
        for word in self.words[1:]:
            if self.chunk_delay > 0:
                await asyncio.sleep(self.chunk_delay)
            writer.write(_chunk(model, {"content": word}))
            await writer.drain()
        writer.write(
            _chunk(model, {}, finish="stop") + _http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        )
        await writer.drain()


async def _main(args: argparse.Namespace) -> None:
    upstream = FixedUpstream(args.delay_ms / 1000.0, args.chunks, args.chunk_delay_ms / 1000.0)
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", args.port, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    print(f"PORT {port}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-delay-ms", type=float, default=1.0)
    args = parser.parse_args(argv)
    try:
        asyncio.run(_main(args))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
