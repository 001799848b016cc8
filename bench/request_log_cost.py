"""CPU cost per request of the request log: the `RequestLog` middleware around a bare app.

Run: `.venv/bin/python bench/request_log_cost.py [--requests 20000]`

A minimal ASGI app answers each request with a one-chunk body after attaching a chat
trace with two attempts and token counts (what a failed-over chat request logs). It is
called directly, then wrapped in `RequestLog` with the `chatroute` logger at WARNING (the
line is not built), at INFO as text and at INFO as JSON (written to an in-memory stream,
so disk and terminal speed stay out). The report gives the microseconds each adds per
request over the bare app: the service's whole per-request cost of request ids and logs.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import command, machine
from chatroute.chat.types import UsageDetails
from chatroute.failover.attempt import FailoverChatClientAttempt
from chatroute.server.request_log import (
    JsonFormatter,
    RequestIdFilter,
    RequestLog,
    note_decision,
    note_trace,
)
from chatroute.tracing import AttemptRecord, RequestTrace

_SCOPE: dict[str, Any] = {
    "type": "http",
    "method": "POST",
    "path": "/v1/chat/completions",
    "headers": [
        (b"authorization", b"Bearer sk-bench-0123456789"),
        (b"content-type", b"application/json"),
        (b"x-request-id", b"bench-request-1"),
    ],
}


def _trace() -> RequestTrace:
    client: Any = _Client()
    failed = FailoverChatClientAttempt(client, 0.035, None, RuntimeError("502"), False, False)
    served = FailoverChatClientAttempt(client, 0.8, 0.3, None, True, True)
    trace = RequestTrace(route="code", status=200, committed=True, stream=True)
    trace.selections = [("code", "primary"), ("code", "fallback")]
    trace.attempts = [
        AttemptRecord("code", "primary", failed, False),
        AttemptRecord("code", "fallback", served, True),
    ]
    trace.usage = UsageDetails(412, 96, 508, cached_input_token_count=128)
    trace.first_output_at = time.perf_counter()
    return trace


class _Client:
    name = "bench"


async def _app(scope: Any, receive: Any, send: Any) -> None:
    note_decision("code", 0.8132, False)
    note_trace(_trace())
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def _noop_send(message: Any) -> None:
    return None


async def _receive() -> Any:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _per_request(app: Any, requests: int) -> float:
    for _ in range(200):  # warm up
        await app(dict(_SCOPE), _receive, _noop_send)
    started = time.perf_counter()
    for _ in range(requests):
        await app(dict(_SCOPE), _receive, _noop_send)
    return (time.perf_counter() - started) / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    args = parser.parse_args()
    target = logging.getLogger("chatroute")
    target.propagate = False
    handler = logging.StreamHandler(io.StringIO())
    handler.addFilter(RequestIdFilter())
    target.addHandler(handler)
    results: dict[str, float] = {}

    async def run() -> None:
        results["bare app"] = await _per_request(_app, args.requests)
        wrapped = RequestLog(_app)
        target.setLevel(logging.WARNING)
        results["RequestLog, log at warning"] = await _per_request(wrapped, args.requests)
        target.setLevel(logging.INFO)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        results["RequestLog, text line"] = await _per_request(wrapped, args.requests)
        handler.setFormatter(JsonFormatter())
        results["RequestLog, JSON line"] = await _per_request(wrapped, args.requests)

    asyncio.run(run())
    print(f"# {machine()}\n# {command()}\n")
    base = results["bare app"]
    for name, micros in results.items():
        added = "" if name == "bare app" else f"  (+{micros - base:.1f} us)"
        print(f"{name:<28} {micros:8.1f} us/request{added}")


if __name__ == "__main__":
    main()
