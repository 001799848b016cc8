"""A scripted Anthropic Messages API upstream: `FakeUpstream`'s server speaking `POST /v1/messages`.

The same behaviours script it (`Ok`, `Status`, `Events`, `Reset`, `Hang`, ...), answered in
the Messages API wire format:

- `Ok` answers a message: `reasoning` as a thinking block, `text` as a text block, each
  `ToolCall` as a tool_use block (its `arguments` JSON as the input). `finish_reason` is
  given in OpenAI words and sent as the matching `stop_reason` (`stop` → `end_turn`,
  `length` → `max_tokens`, `tool_calls` → `tool_use`; other words verbatim).
  `prompt_tokens` / `completion_tokens` are the input and output token counts and
  `usage_extra` is merged into the usage. Streams are `message_start`, then per block
  `content_block_start`, deltas (`text_delta`, `thinking_delta` then a `signature_delta`,
  `input_json_delta`) and `content_block_stop`, then `message_delta` with the stop reason
  and `message_stop`, with a `ping` after `message_start`. `cut_after`, `stall_after`,
  `malformed_at` and `error_at` count the content deltas; `error` is the error object of
  the `event: error` sent; `done=False` leaves out `message_stop`; `finish_reason=None`
  leaves out `message_delta` and `message_stop` (a truncated stream).
- `Status` answers the Anthropic error shape
  (`{"type": "error", "error": {"type", "message"}}`); `type` defaults by status.

Point the SDK at `url` (the SDK adds `/v1/messages`).
"""

from __future__ import annotations

import json
from typing import Any

from tests.fakes.upstream import (
    FakeUpstream,
    Ok,
    Request,
    Status,
    _chunked,
    _Conn,
    _scripted_body,
    _scripted_break,
)

__all__ = ["FakeAnthropic", "anthropic_error_body"]

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def _event(name: str, obj: Any) -> bytes:
    return (
        f"event: {name}\ndata: ".encode()
        + json.dumps(obj, separators=(",", ":")).encode()
        + (b"\n\n")
    )


def anthropic_error_body(status: Status) -> bytes:
    """The body a `Status` answers with, in the Anthropic error shape."""
    scripted = _scripted_body(status)
    if scripted is not None:
        return scripted
    etype = status.type or _ERROR_TYPES.get(status.status)
    if etype is None:
        etype = "api_error" if status.status >= 500 else "invalid_request_error"
    message = status.message or f"fake anthropic error {status.status}"
    return json.dumps({"type": "error", "error": {"type": etype, "message": message}}).encode()


class FakeAnthropic(FakeUpstream):
    """A scripted Anthropic Messages API server on 127.0.0.1 (see the module docstring)."""

    chat_path = "/messages"

    @staticmethod
    def _head(
        status: int,
        content_type: str,
        headers: Any,
        keep_alive: bool,
        length: int | None,
    ) -> bytes:
        head = FakeUpstream._head(status, content_type, headers, keep_alive, length)
        return head[:-2] + b"request-id: req_fake\r\n\r\n"

    async def _status(self, conn: _Conn, req: Request, status: Status, keep_alive: bool) -> bool:
        await conn.sleep(status.delay)
        req.status = status.status
        body = anthropic_error_body(status)
        await conn.send(
            self._head(status.status, "application/json", status.headers, keep_alive, len(body))
            + body
        )
        return keep_alive

    def _models_listing(self) -> dict[str, Any]:
        data = [
            {"type": "model", "id": m, "display_name": m, "created_at": "2026-01-01T00:00:00Z"}
            for m in self.models
        ]
        first = data[0]["id"] if data else None
        last = data[-1]["id"] if data else None
        return {"data": data, "has_more": False, "first_id": first, "last_id": last}

    @staticmethod
    def _stop(ok: Ok) -> str | None:
        if ok.finish_reason is None:
            return None
        if ok.finish_reason == "stop" and ok.tool_calls and not ok.text:
            return "tool_use"
        return _STOP.get(ok.finish_reason, ok.finish_reason)

    @staticmethod
    def _usage(ok: Ok, pieces: int) -> dict[str, Any]:
        output = ok.completion_tokens if ok.completion_tokens is not None else pieces
        usage: dict[str, Any] = {"input_tokens": ok.prompt_tokens, "output_tokens": output}
        if ok.usage_extra:
            usage.update(ok.usage_extra)
        return usage

    def _message(self, req: Request, ok: Ok) -> dict[str, Any]:
        return {
            "id": ok.response_id or f"msg_fake_{req.index}",
            "type": "message",
            "role": "assistant",
            "model": ok.model or req.model or "fake-claude",
        }

    async def _complete(self, conn: _Conn, req: Request, ok: Ok, keep_alive: bool) -> bool:
        await conn.sleep(ok.delay + ok.first_token_delay)
        content: list[dict[str, Any]] = []
        if ok.reasoning is not None:
            content.append({"type": "thinking", "thinking": ok.reasoning, "signature": "sig"})
        if ok.text:
            content.append({"type": "text", "text": ok.text})
        for i, tc in enumerate(ok.tool_calls):
            content.append(
                {
                    "type": "tool_use",
                    "id": tc.id or f"toolu_{i}",
                    "name": tc.name,
                    "input": json.loads(tc.arguments or "{}"),
                }
            )
        answer = {
            **self._message(req, ok),
            "content": content,
            "stop_reason": self._stop(ok),
            "stop_sequence": None,
            "usage": self._usage(ok, len(ok.text_pieces())),
        }
        body = json.dumps(answer).encode()
        if ok.malformed_at is not None:
            body = b'{"id": "msg_broken", "content": [ {"type": "te'
        return await self._send_answer(conn, req, ok, body, keep_alive)

    async def _stream(self, conn: _Conn, req: Request, ok: Ok, keep_alive: bool) -> bool:
        await conn.sleep(ok.delay)
        text_pieces = ok.text_pieces()
        # The blocks, each as (start event, its content deltas, closing deltas).
        blocks: list[tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]] = []
        if ok.reasoning:
            blocks.append(
                (
                    {"type": "thinking", "thinking": ""},
                    [
                        {"type": "thinking_delta", "thinking": p}
                        for p in Ok(ok.reasoning).text_pieces()
                    ],
                    [{"type": "signature_delta", "signature": "sig"}],
                )
            )
        if text_pieces:
            blocks.append(
                (
                    {"type": "text", "text": ""},
                    [{"type": "text_delta", "text": p} for p in text_pieces],
                    [],
                )
            )
        for i, tc in enumerate(ok.tool_calls):
            args = Ok(tc.arguments, chunks=tc.chunks).text_pieces() if tc.arguments else []
            blocks.append(
                (
                    {"type": "tool_use", "id": tc.id or f"toolu_{i}", "name": tc.name, "input": {}},
                    [{"type": "input_json_delta", "partial_json": a} for a in args],
                    [],
                )
            )
        start = {
            **self._message(req, ok),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": ok.prompt_tokens, "output_tokens": 1},
        }
        if ok.usage_extra:
            start["usage"].update(ok.usage_extra)

        req.status = 200
        await conn.send(self._head(200, "text/event-stream", ok.headers, keep_alive, None))
        await conn.send(
            _chunked(_event("message_start", {"type": "message_start", "message": start}))
        )
        await conn.send(_chunked(_event("ping", {"type": "ping"})))
        await conn.sleep(ok.first_token_delay)

        sent = 0  # content deltas sent
        for index, (block, deltas, closing) in enumerate(blocks):
            await conn.send(
                _chunked(
                    _event(
                        "content_block_start",
                        {"type": "content_block_start", "index": index, "content_block": block},
                    )
                )
            )
            for delta in deltas:
                if await _scripted_break(conn, ok, sent):
                    return False
                if sent > 0:
                    await conn.sleep(ok.chunk_delay)
                if ok.error_at is not None and sent >= ok.error_at:
                    return await self._error_event(conn, ok, keep_alive)
                sent += 1
                req.chunks_sent += 1  # counted as it is written (see `Request.chunks_sent`)
                if ok.malformed_at == sent - 1:
                    await conn.send(
                        _chunked(b'event: content_block_delta\ndata: {"type": "con\n\n')
                    )
                else:
                    event = {"type": "content_block_delta", "index": index, "delta": delta}
                    await conn.send(_chunked(_event("content_block_delta", event)))
            for delta in closing:
                event = {"type": "content_block_delta", "index": index, "delta": delta}
                await conn.send(_chunked(_event("content_block_delta", event)))
            await conn.send(
                _chunked(
                    _event("content_block_stop", {"type": "content_block_stop", "index": index})
                )
            )
        if await _scripted_break(conn, ok, sent, at_end=True):
            return False
        if ok.error_at is not None:
            return await self._error_event(conn, ok, keep_alive)
        stop = self._stop(ok)
        if stop is not None:
            output = ok.completion_tokens if ok.completion_tokens is not None else len(text_pieces)
            delta_event = {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": output},
            }
            await conn.send(_chunked(_event("message_delta", delta_event)))
            if ok.done:
                await conn.send(_chunked(_event("message_stop", {"type": "message_stop"})))
        if ok.hold_open:
            await conn.eof.wait()
            return False
        if ok.abort_at_end:
            conn.close(rst=ok.rst)
            return False
        await conn.send(b"0\r\n\r\n")
        return keep_alive

    async def _error_event(self, conn: _Conn, ok: Ok, keep_alive: bool) -> bool:
        error = dict(ok.error or {"type": "overloaded_error", "message": "Overloaded"})
        await conn.send(_chunked(_event("error", {"type": "error", "error": error})))
        await conn.send(b"0\r\n\r\n")
        return keep_alive
