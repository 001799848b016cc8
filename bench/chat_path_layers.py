"""What each layer of chatroute's chat path costs inside a real call, in CPU time.

Run from the repository root:

    .venv/bin/python bench/chat_path_layers.py [--calls 300] [--delay-ms 10] [--no-write]

`bench/proxy_floor.py` prices the serving stack under chatroute (uvicorn, FastAPI, the
aiohttp transport) and `bench/cold_path.py` chatroute's own steps one at a time. This one
prices chatroute's layers where they run: the service's app (the same config and stack as
`chatroute serve` in the peer bench: a route named as the model, one OpenAI-compatible
provider, live reload on), called in-process as an ASGI app on uvloop, its provider
posting over aiohttp to the fixed-latency upstream (`bench/_fixed_upstream.py`) in a
process of its own. uvicorn is left out: the floor bench prices it.

The call is timed at points along its path with the thread's CPU clock, by wrapping the
functions that mark them (the endpoint's first call, validation, the conversion to chat
types, the disconnect watch, the provider's body, its POST, its answer mapping, the reply
encoding, the final `send`, and the moment the upstream's answer reaches aiohttp). Each
call runs twice in a row:

- cold: the CPU caches are evicted (by copying a buffer twice the last-level cache)
  before the call and again when the upstream's answer arrives, as happens to each half of
  a call on a machine that runs other work while the service waits (the eviction's own
  time is left out);
- warm: the next call, without evictions.

In the same run, a bare relay (an ASGI callable that posts the body through an aiohttp
session and sends the answer back as it came) is timed the same way: the transport and
the loop with none of chatroute's work. Medians over `--calls` calls. The result goes to
the `chat-path-layers` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
import uvloop
import yaml
from aiohttp.client_proto import ResponseHandler

from bench._common import bench_main, command, machine, table
from bench._service_start import make_config, start_upstream
from bench.cold_path import Evictor
from bench.proxy_compare import TRAIN
from chatroute.config import load_config
from chatroute.server import chat as chat_module
from chatroute.server.app import create_app
from chatroute.server.wire import ChatCompletionRequest

_INHERITED = object()
QUESTION = "What is the capital of France, and why is it the capital?"
BODY = json.dumps(
    {"model": "general", "messages": [{"role": "user", "content": QUESTION}], "stream": False}
).encode()

# The points a call passes, in order, and what lies between each and the one before.
LAYERS = [
    ("endpoint", "middleware in (request id, reload, admission: key, body, JSON) + routing"),
    ("validated", "validate the body (pydantic)"),
    ("converted", "check the limits, convert to chat types"),
    ("watching", "route, trace, deadline, override headers, session"),
    ("provider", "sticky session, failover, timeouts, down to the provider"),
    ("posting", "build and encode the upstream body"),
    ("answered", "aiohttp: send the request; the loop while it waits"),
    ("head", "aiohttp: read the answer's head"),
    ("body", "read the answer's body, parse its JSON"),
    ("mapped", "map it to a ChatResponse"),
    ("back", "back up through failover, the deadline and the watch"),
    ("encoded", "encode the reply"),
    ("sent", "reply headers and response, middleware out, to the last send"),
]


class Points:
    """Thread-CPU timestamps at named points of one call, and the wrapping that takes them."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.cold = False  # whether this call evicts the caches when the answer arrives
        self.evicted = 0.0  # CPU spent evicting the caches inside the call
        self._undo: list[Callable[[], None]] = []

    def mark(self, name: str) -> None:
        self.times[name] = time.thread_time()

    def before(self, owner: Any, attribute: str, name: str) -> None:
        """Mark `name` when `owner.attribute` is called."""
        original = getattr(owner, attribute)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.mark(name)
            return original(*args, **kwargs)

        self.replace(owner, attribute, wrapper)

    def after(self, owner: Any, attribute: str, name: str) -> None:
        """Mark `name` when a call of `owner.attribute` returns."""
        original = getattr(owner, attribute)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self.mark(name)
            return result

        self.replace(owner, attribute, wrapper)

    def after_await(self, owner: Any, attribute: str, name: str) -> None:
        """Mark `name` when an awaited call of `owner.attribute` returns."""
        original: Callable[..., Awaitable[Any]] = getattr(owner, attribute)

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = await original(*args, **kwargs)
            self.mark(name)
            return result

        self.replace(owner, attribute, wrapper)

    def replace(self, owner: Any, attribute: str, wrapper: Any) -> None:
        """Put `wrapper` in place of `owner.attribute` until `restore()`."""
        if isinstance(owner, type) and inspect.ismethod(getattr(owner, attribute)):
            wrapper = staticmethod(wrapper)  # a classmethod: the wrapped one is bound already
        own = vars(owner).get(attribute, _INHERITED)
        setattr(owner, attribute, wrapper)
        if own is _INHERITED:  # found on a class above: uncover it again
            self._undo.append(lambda: delattr(owner, attribute))
        else:
            self._undo.append(lambda: setattr(owner, attribute, own))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def scope() -> dict[str, Any]:
    headers = [
        (b"host", b"127.0.0.1:8080"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
        (b"accept", b"application/json"),
    ]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "server": ("127.0.0.1", 8080),
        "client": ("127.0.0.1", 50000),
        "scheme": "http",
        "method": "POST",
        "root_path": "",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": headers,
        "state": {},
    }


async def call(app: Any, points: Points) -> None:
    """One chat request through `app`, its points in `points.times`; it must answer 200."""
    status = 0
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.Event().wait()  # the caller stays connected
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif not message.get("more_body"):
            points.mark("sent")

    points.times.clear()
    points.evicted = 0.0
    points.mark("in")
    await app(scope(), receive, send)
    if status != 200:
        raise RuntimeError(f"a call answered {status}")


def instrument(points: Points, app: Any, evict: Evictor) -> None:
    """Wrap the functions whose calls mark the points of `LAYERS`."""
    provider = app.state.service.engine.providers["fixed"]
    points.before(chat_module, "ready_service", "endpoint")
    points.after(ChatCompletionRequest, "model_validate", "validated")
    points.after(chat_module, "chat_call", "converted")
    points.before(chat_module, "watched", "watching")
    points.before(provider, "_body", "provider")
    points.before(provider, "_post", "posting")
    points.after_await(provider, "_post", "head")
    points.before(provider, "_read_answer", "body")
    points.after(provider, "_read_answer", "mapped")
    points.before(chat_module, "completion_body", "back")
    points.after(chat_module, "completion_body", "encoded")
    original = ResponseHandler.data_received

    def data_received(handler: ResponseHandler, data: bytes) -> None:
        # The upstream answer's first bytes reach aiohttp (the caches evicted first when cold).
        if "answered" not in points.times and "posting" in points.times:
            if points.cold:
                started = time.thread_time()
                evict()
                points.evicted = time.thread_time() - started
            points.mark("answered")
        original(handler, data)

    points.replace(ResponseHandler, "data_received", data_received)


def bare_relay(url: str, session: aiohttp.ClientSession, points: Points) -> Any:
    async def relay(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        points.mark("posting")
        headers = {"content-type": "application/json"}
        async with session.post(url, data=body, headers=headers) as response:
            answer = await response.read()
        await send({"type": "http.response.start", "status": response.status, "headers": []})
        await send({"type": "http.response.body", "body": answer})

    return relay


APP_POINTS = ["in", *(name for name, _ in LAYERS)]
RELAY_POINTS = ["in", "posting", "answered", "sent"]
Spans = dict[str, list[float]]  # a span's name (the point it ends at, or "total") -> CPU s


def record(spans: Spans, points: Points, expected: list[str]) -> None:
    """Add one call's spans between consecutive points, and its total, to `spans`."""
    times = points.times
    if list(times) != expected:
        raise RuntimeError(f"points out of order: {list(times)}")
    for before, after in itertools.pairwise(expected):
        span = times[after] - times[before]
        if after == "answered":
            span -= points.evicted
        spans.setdefault(after, []).append(span)
    spans.setdefault("total", []).append(times["sent"] - times["in"] - points.evicted)


async def measure(args: argparse.Namespace, upstream: int, config_path: Path) -> str:
    app = create_app(load_config(config_path), config_path=config_path)
    evict = Evictor()
    points = Points()
    samples: dict[str, dict[str, Spans]] = {
        target: {"cold": {}, "warm": {}} for target in ("app", "relay")
    }
    async with (
        app.router.lifespan_context(app),
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session,
    ):
        relay = bare_relay(f"http://127.0.0.1:{upstream}/v1/chat/completions", session, points)
        targets = {"app": (app, APP_POINTS), "relay": (relay, RELAY_POINTS)}
        try:
            instrument(points, app, evict)
            for _ in range(30):
                for target, _ in targets.values():
                    await call(target, points)
            gc.collect()
            gc.freeze()  # as `chatroute serve` does once it is ready
            for _ in range(args.calls):
                for name, (target, expected) in targets.items():
                    for mode in ("cold", "warm"):
                        points.cold = mode == "cold"
                        if points.cold:
                            evict()
                        await call(target, points)
                        record(samples[name][mode], points, expected)
        finally:
            points.restore()
    clock_cost = min(timeit.repeat(time.thread_time, number=1000, repeat=5)) / 1000
    return report(args, samples["app"], samples["relay"], clock_cost)


def report(
    args: argparse.Namespace,
    rows: dict[str, Spans],
    bare: dict[str, Spans],
    clock_cost: float,
) -> str:
    def us(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e6:.0f}"

    lines = [
        [f"{i}. {what}", us(rows["cold"][name]), us(rows["warm"][name])]
        for i, (name, what) in enumerate(LAYERS, 1)
    ]
    for label, spans, span in (
        ("whole call, chatroute's app", rows, "total"),
        ("whole call, bare aiohttp relay", bare, "total"),
        ("bare relay: as 7", bare, "answered"),
        ("bare relay: answer in to last send", bare, "sent"),
    ):
        lines.append([label, us(spans["cold"][span]), us(spans["warm"][span])])

    def own(mode: str) -> float:  # the app's whole call less the bare relay's
        return statistics.median(rows[mode]["total"]) - statistics.median(bare[mode]["total"])

    return "\n".join(
        [
            "## What each layer of the chat path costs inside a real call (CPU µs)",
            "",
            f"- Machine: {machine()}.",
            f"- Command: `{command()}`",
            f"- chatroute's app in-process on uvloop (no uvicorn: see the floor bench), one "
            f"forced route, one OpenAI-compatible provider over aiohttp to the fixed "
            f"upstream ({args.delay_ms:g} ms delay). Thread CPU time between points of the "
            f"call, medians of {args.calls} calls; cold: caches evicted before the call "
            "and when the answer arrives; warm: the next call.",
            f"- Each point's clock read costs about {clock_cost * 1e6:.1f} µs and is "
            "included in the spans.",
            "",
            table(["span", "cold µs", "warm µs"], lines),
            "",
            f"chatroute's own work, the app's whole call less the bare relay's: "
            f"{own('cold') * 1e6:.0f} µs cold, {own('warm') * 1e6:.0f} µs warm. "
            "The spans of aiohttp (7, 8 and part of 9) are what any proxy on this "
            "transport pays; the rest is the framework's (1, 13) and chatroute's. "
            "Medians of spans do not add up to the median of wholes.",
        ]
    )


def run(args: argparse.Namespace) -> str:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="chatroute-layers-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        upstream = start_upstream(stack, args, work)
        config_path = work / "chatroute.yaml"
        config_path.write_text(yaml.safe_dump(make_config(TRAIN, upstream, 8080, 10)))
        return uvloop.run(measure(args, upstream, config_path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=300)
    bench_main(parser, run, "chat-path-layers")


if __name__ == "__main__":
    main()
