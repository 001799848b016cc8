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

        self._replace(owner, attribute, original, wrapper)

    def after(self, owner: Any, attribute: str, name: str) -> None:
        """Mark `name` when a call of `owner.attribute` returns."""
        original = getattr(owner, attribute)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self.mark(name)
            return result

        self._replace(owner, attribute, original, wrapper)

    def after_await(self, owner: Any, attribute: str, name: str) -> None:
        """Mark `name` when an awaited call of `owner.attribute` returns."""
        original: Callable[..., Awaitable[Any]] = getattr(owner, attribute)

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = await original(*args, **kwargs)
            self.mark(name)
            return result

        self._replace(owner, attribute, original, wrapper)

    def _replace(self, owner: Any, attribute: str, original: Any, wrapper: Any) -> None:
        if isinstance(owner, type) and inspect.ismethod(original):
            wrapper = staticmethod(wrapper)  # a classmethod: `original` is bound already
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


async def call(app: Any, points: Points) -> int:
    """One chat request through `app`; its status."""
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
    return status


def instrument(points: Points, app: Any, evict: Evictor, cold: list[bool]) -> None:
    """Wrap the functions whose calls mark the points of `LAYERS`."""
    service = app.state.service
    provider = service.engine.providers["fixed"]
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
    instrument_arrival(points, evict, cold)


def instrument_arrival(points: Points, evict: Evictor, cold: list[bool]) -> None:
    """Mark the upstream answer's first bytes reaching aiohttp (evicting first when cold)."""
    original = ResponseHandler.data_received

    def data_received(handler: ResponseHandler, data: bytes) -> None:
        if "answered" not in points.times and "posting" in points.times:
            if cold[0]:
                started = time.thread_time()
                evict()
                points.evicted = time.thread_time() - started
            points.mark("answered")
        original(handler, data)

    ResponseHandler.data_received = data_received  # type: ignore[method-assign,assignment]
    points._undo.append(lambda: setattr(ResponseHandler, "data_received", original))


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


async def measure(args: argparse.Namespace, upstream: int, config_path: Path) -> str:
    app = create_app(load_config(config_path), config_path=config_path)
    evict = Evictor()
    cold = [False]
    points = Points()
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
    try:
        if getattr(app.state, "service", None) is None:
            raise RuntimeError("the app did not start its service")
        instrument(points, app, evict, cold)
        relay = bare_relay(f"http://127.0.0.1:{upstream}/v1/chat/completions", session, points)
        for _ in range(30):
            for target in (app, relay):
                if await call(target, points) != 200:
                    raise RuntimeError("a call did not answer 200")
        gc.collect()
        gc.freeze()  # as `chatroute serve` does once it is ready
        names = ["in"] + [name for name, _ in LAYERS]
        rows: dict[str, dict[str, list[float]]] = {"cold": {}, "warm": {}}
        bare: dict[str, list[float]] = {
            key: [] for mode in ("cold", "warm") for key in (mode, f"{mode} 7", f"{mode} 8-13")
        }
        for _ in range(args.calls):
            for target in (app, relay):
                for mode in ("cold", "warm"):
                    cold[0] = mode == "cold"
                    if cold[0]:
                        evict()
                    await call(target, points)
                    times = points.times
                    total = times["sent"] - times["in"] - points.evicted
                    if target is relay:
                        bare[mode].append(total)
                        sending = times["answered"] - times["posting"] - points.evicted
                        bare[f"{mode} 7"].append(sending)
                        bare[f"{mode} 8-13"].append(times["sent"] - times["answered"])
                        continue
                    if list(times) != names:
                        raise RuntimeError(f"points out of order: {list(times)}")
                    spans = rows[mode]
                    for before, after in itertools.pairwise(names):
                        span = times[after] - times[before]
                        if after == "answered":
                            span -= points.evicted
                        spans.setdefault(after, []).append(span)
                    spans.setdefault("total", []).append(total)
        clock_cost = min(_clock_cost() for _ in range(5))
    finally:
        points.restore()
        await session.close()
        await lifespan.__aexit__(None, None, None)
    return report(args, rows, bare, clock_cost)


def _clock_cost() -> float:
    started = time.perf_counter()
    for _ in range(1000):
        time.thread_time()
    return (time.perf_counter() - started) / 1000


def report(
    args: argparse.Namespace,
    rows: dict[str, dict[str, list[float]]],
    bare: dict[str, list[float]],
    clock_cost: float,
) -> str:
    def us(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e6:.0f}"

    lines = [
        [f"{i}. {what}", us(rows["cold"][name]), us(rows["warm"][name])]
        for i, (name, what) in enumerate(LAYERS, 1)
    ]
    whole = rows["cold"]["total"], rows["warm"]["total"]
    lines.append(["whole call, chatroute's app", us(whole[0]), us(whole[1])])
    lines.append(["whole call, bare aiohttp relay", us(bare["cold"]), us(bare["warm"])])
    lines.append(["bare relay: as 7", us(bare["cold 7"]), us(bare["warm 7"])])
    lines.append(
        ["bare relay: answer in to last send", us(bare["cold 8-13"]), us(bare["warm 8-13"])]
    )
    chatroute_cold = statistics.median(rows["cold"]["total"]) - statistics.median(bare["cold"])
    chatroute_warm = statistics.median(rows["warm"]["total"]) - statistics.median(bare["warm"])
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
            f"{chatroute_cold * 1e6:.0f} µs cold, {chatroute_warm * 1e6:.0f} µs warm. "
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
