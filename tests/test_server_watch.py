"""The service's per-request machinery, on its own: the disconnect watch around the routed
call, the event-stream response, the readiness check of the `/v1` endpoints, and the chat
route's answers to every kind of body.

The end-to-end behaviour (a caller leaving at every stage) is in test_disconnect.py; this
pins the cancellation bookkeeping that those tests cannot reach: an outer cancellation, a
deadline and a disconnect in the same request, and the task left not cancelling.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from chatroute.config import parse_config
from chatroute.server import build_engine, create_app
from chatroute.server.deadlines import (
    CallerGone,
    Deadline,
    DeadlineHit,
    DisconnectWatch,
    bounded,
    watched,
)
from chatroute.server.responses import SSEResponse
from chatroute.tracing import RequestTrace
from tests.test_server import CONFIG, BagOfWordsEmbedder, Provider


class Connection:
    """A caller's connection as the watch sees it: an ASGI receive that reports
    `http.disconnect` once the caller `leave()`s."""

    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.scope: dict[str, Any] = {"type": "http"}

    def leave(self) -> None:
        self.left.set()

    async def receive(self) -> dict[str, Any]:
        await self.left.wait()
        return {"type": "http.disconnect"}


async def upstream_call(log: list[str]) -> None:
    """A call that only ends when cancelled, and awaits while it unwinds."""
    try:
        await asyncio.sleep(30)
    finally:
        log.append("unwinding")
        await asyncio.sleep(0.01)
        log.append("closed")


def watched_by(conn: Connection) -> tuple[Any]:
    return (conn.receive,)


def not_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


def others() -> set[asyncio.Task[Any]]:
    return asyncio.all_tasks() - {asyncio.current_task()}  # type: ignore[operator]


async def test_a_disconnect_ends_the_call_once_it_has_unwound() -> None:
    conn, log = Connection(), []
    asyncio.get_running_loop().call_later(0.02, conn.leave)
    with pytest.raises(CallerGone):
        await watched(conn.receive, upstream_call(log))
    assert log == ["unwinding", "closed"]
    assert not_cancelling()


async def test_the_result_and_the_errors_of_the_call_pass_through() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def fail() -> None:
        await asyncio.sleep(0)
        raise ValueError("upstream")

    assert await watched(*watched_by(Connection()), answer()) == 42
    with pytest.raises(ValueError, match="upstream"):
        await watched(*watched_by(Connection()), fail())
    await asyncio.sleep(0)
    assert not others() and not_cancelling()


async def test_a_call_that_swallows_the_cancellation_still_ends_as_the_caller_gone() -> None:
    conn = Connection()

    async def stubborn() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "answered anyway"  # nobody is listening for it any more
        return "not cancelled"

    asyncio.get_running_loop().call_later(0.02, conn.leave)
    with pytest.raises(CallerGone):
        await watched(conn.receive, stubborn())
    assert not_cancelling()  # the swallowed cancellation is not left on the task


async def test_the_deadline_still_works_inside_the_watch() -> None:
    conn, log = Connection(), []
    at = asyncio.get_running_loop().time() + 0.02
    with pytest.raises(DeadlineHit):
        await watched(conn.receive, bounded(upstream_call(log), Deadline(at, 0.02)))
    assert log == ["unwinding", "closed"] and not_cancelling()

    # Both at once: the caller is gone, and the task is left not cancelling.
    at = asyncio.get_running_loop().time() + 0.02
    asyncio.get_running_loop().call_at(at, conn.leave)
    with pytest.raises(CallerGone):
        await watched(conn.receive, bounded(upstream_call([]), Deadline(at, 0.02)))
    assert not_cancelling()


async def test_an_outer_cancellation_propagates_and_stops_the_watch() -> None:
    conn, log = Connection(), []
    request = asyncio.create_task(watched(conn.receive, upstream_call(log)))
    await asyncio.sleep(0.01)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert log == ["unwinding", "closed"]
    await asyncio.sleep(0)
    assert not others()

    # Cancelled from outside while the caller leaves: still a cancellation.
    request = asyncio.create_task(watched(conn.receive, upstream_call([])))
    await asyncio.sleep(0.01)
    conn.leave()
    await asyncio.sleep(0)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request


async def test_an_outer_timeout_expiring_in_the_watch_is_a_timeout() -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await watched(*watched_by(Connection()), upstream_call([]))
    assert not_cancelling()


class Routed:
    def __init__(self, closed: list[str]) -> None:
        self.closed = closed

    async def aclose(self) -> None:
        self.closed.append("routed")


class Stream:
    """An event stream's body and the routed stream behind it, recording their closing."""

    def __init__(self, chunks: int, pause: float = 0.0) -> None:
        self.chunks, self.pause = chunks, pause
        self.closed: list[str] = []
        self.unsent = 0
        self.trace = RequestTrace(route="r")

    async def body(self) -> AsyncIterator[bytes]:
        try:
            for n in range(self.chunks):
                await asyncio.sleep(self.pause)
                yield b"data: %d\n\n" % n
        finally:
            self.closed.append("body")

    def response(self, watch: DisconnectWatch) -> SSEResponse:
        def unsent() -> None:
            self.unsent += 1
            self.trace.status = 499

        return SSEResponse(
            self.body(),
            Routed(self.closed),
            self.trace,
            unsent,
            {"cache-control": "no-cache"},
            watch,
        )


async def serve(
    stream: Stream,
    conn: Connection,
    *,
    fail_send: bool = False,
    watch: DisconnectWatch | None = None,
) -> list[dict[str, Any]]:
    """Serve the stream as `_stream` hands it over: with the request's running watch."""
    if watch is None:
        watch = DisconnectWatch(conn.receive)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        if fail_send:
            raise OSError("connection reset")
        sent.append(message)
        if message["type"] == "http.response.body" and not message["more_body"]:
            conn.leave()  # the server reports the completed response as a disconnect
            await asyncio.sleep(0)

    await stream.response(watch)(conn.scope, conn.receive, send)
    return sent


async def test_a_completed_stream_is_not_a_caller_leaving() -> None:
    stream, conn = Stream(3), Connection()
    sent = await serve(stream, conn)
    assert sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert stream.trace.cancelled is None
    assert stream.closed == ["body", "routed"] and stream.unsent == 1
    await asyncio.sleep(0)
    assert not others() and not_cancelling()


async def test_a_caller_gone_before_the_first_send_is_seen_by_the_handed_over_watch() -> None:
    stream, conn = Stream(1000, pause=0.001), Connection()
    watch = DisconnectWatch(conn.receive)  # started while waiting for the first update
    conn.leave()  # gone before the response started: its watch has not run yet
    sent = await serve(stream, conn, watch=watch)
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert stream.trace.cancelled == "disconnect"
    assert stream.closed == ["body", "routed"]
    await asyncio.sleep(0)
    assert not others() and not_cancelling()


async def test_a_caller_leaving_mid_stream_stops_it_and_closes_everything() -> None:
    stream, conn = Stream(1000, pause=0.001), Connection()
    asyncio.get_running_loop().call_later(0.02, conn.leave)
    sent = await serve(stream, conn)  # returns: the caller is gone, nothing to raise
    assert 1 < len(sent) < 1000 and sent[-1]["more_body"]
    assert stream.trace.cancelled == "disconnect"
    assert stream.closed == ["body", "routed"]
    await asyncio.sleep(0)
    assert not others() and not_cancelling()


async def test_a_failing_send_marks_a_disconnect_and_closes_the_unstarted_body() -> None:
    stream, conn = Stream(3), Connection()
    with pytest.raises(OSError):
        await serve(stream, conn, fail_send=True)
    assert stream.trace.cancelled == "disconnect"
    assert stream.closed == ["routed"]  # the body never started: nothing to unwind in it
    assert stream.unsent == 1


async def test_an_outer_cancellation_of_a_stream_propagates() -> None:
    stream, conn = Stream(1000, pause=0.001), Connection()
    serving = asyncio.create_task(serve(stream, conn))
    await asyncio.sleep(0.02)
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving
    assert stream.trace.cancelled is None
    assert stream.closed == ["body", "routed"]
    await asyncio.sleep(0)
    assert not others()


def test_the_api_answers_not_ready_before_validating_a_body() -> None:
    config = parse_config(
        {
            "routing": {"default_route": "r", "threshold": 0.3},
            "providers": {"p": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
            "routes": {"r": {"targets": ["p"], "utterances": ["hello"]}},
        }
    )
    client = TestClient(create_app(config, api_keys=[]))  # no lifespan: never ready
    valid = {"model": "r", "messages": [{"role": "user", "content": "hi"}]}
    for path, body in [
        ("/v1/chat/completions", valid),
        ("/v1/chat/completions", {"messages": "not a list"}),
        ("/v1/route", {"input": 3}),
        ("/v1/classify", {}),
    ]:
        answer = client.post(path, json=body)
        assert answer.status_code == 503, (path, body)
        assert answer.json()["error"]["code"] == "not_ready"
        assert answer.headers["retry-after"] == "1"
    assert client.get("/v1/models").status_code == 503
    # A body that is not JSON at all is refused before readiness matters, as before.
    answer = client.post(
        "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400


# ------------------------------------------------------------ the chat route over ASGI

# The config of the HTTP-layer tests, with limits the hostile cases below cross.
FAST_CONFIG = {
    **CONFIG,
    "server": {"max_body_bytes": 8192, "max_messages": 4, "max_json_depth": 8},
}

USER = {"role": "user", "content": "please fix this python bug"}
JSON = "application/json"

# (name, body, content type or None, extra headers)
CASES: list[tuple[str, bytes, str | None, dict[str, str]]] = [
    ("auto", json.dumps({"model": "auto", "messages": [USER]}).encode(), JSON, {}),
    ("absent model", json.dumps({"messages": [USER]}).encode(), JSON, {}),
    ("forced", json.dumps({"model": "general", "messages": [USER]}).encode(), JSON, {}),
    ("stream", json.dumps({"messages": [USER], "stream": True}).encode(), JSON, {}),
    (
        "stream usage",
        json.dumps(
            {"messages": [USER], "stream": True, "stream_options": {"include_usage": True}}
        ).encode(),
        JSON,
        {},
    ),
    ("+json type", json.dumps({"messages": [USER]}).encode(), "application/vnd.x+json", {}),
    ("charset", json.dumps({"messages": [USER]}).encode(), "application/json; charset=utf-8", {}),
    ("unknown fields", json.dumps({"messages": [USER], "foo": 1, "bar": 2}).encode(), JSON, {}),
    ("unknown model", json.dumps({"model": "nope", "messages": [USER]}).encode(), JSON, {}),
    ("broken json", b'{"messages": [', JSON, {}),
    ("empty body", b"", JSON, {}),
    ("text/plain", json.dumps({"messages": [USER]}).encode(), "text/plain", {}),
    ("no content type", json.dumps({"messages": [USER]}).encode(), None, {}),
    ("not json, not json type", b"hello", "text/plain", {}),
    ("array body", b"[1, 2]", JSON, {}),
    ("null body", b"null", JSON, {}),
    ("no messages", b"{}", JSON, {}),
    ("empty messages", b'{"messages": []}', JSON, {}),
    ("bad role", json.dumps({"messages": [{"role": "boss", "content": "x"}]}).encode(), JSON, {}),
    ("bad type", json.dumps({"messages": [USER], "temperature": "hot"}).encode(), JSON, {}),
    ("too many", json.dumps({"messages": [USER] * 5}).encode(), JSON, {}),
    ("NaN", b'{"messages": [], "temperature": NaN}', JSON, {}),
    ("huge integer", b'{"messages": [], "seed": ' + b"9" * 5000 + b"}", JSON, {}),
    ("too deep", b'{"messages": ' + b"[" * 10 + b"]" * 10 + b"}", JSON, {}),
    ("not utf-8", b'{"messages": "\xff"}', JSON, {}),
    ("over the size limit", b'{"messages": "' + b"x" * 9000 + b'"}', JSON, {}),
    (
        "bad timeout header",
        json.dumps({"messages": [USER]}).encode(),
        JSON,
        {"x-chatroute-timeout": "soon"},
    ),
]

_COMPARED_HEADERS = (
    "content-type",
    "x-chatroute-route",
    "x-chatroute-provider",
    "x-chatroute-attempts",
    "x-chatroute-ignored-params",
    "www-authenticate",
    "retry-after",
)


def _answer(client: TestClient, body: bytes, ctype: str | None, extra: dict[str, str]) -> Any:
    headers = dict(extra)
    if ctype is not None:
        headers["content-type"] = ctype
    r = client.post("/v1/chat/completions", content=body, headers=headers)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        payload: Any = [
            {k: v for k, v in json.loads(line[6:]).items() if k not in ("id", "created")}
            if line != "data: [DONE]"
            else line
            for line in r.text.split("\n\n")
            if line.startswith("data: ")
        ]
    else:
        payload = r.json() if r.content else None
        if isinstance(payload, dict):
            payload = {k: v for k, v in payload.items() if k not in ("id", "created")}
    return r.status_code, payload, {h: r.headers.get(h) for h in _COMPARED_HEADERS}


def _answers(*, keys: list[str], ready: bool = True, app_hook: Any = None) -> list[Any]:
    config = parse_config(FAST_CONFIG, environ={})
    providers = {"fast": Provider("fast", "quick answer"), "strong": Provider("strong", "sure")}
    engine = build_engine(config, embedder=BagOfWordsEmbedder(), providers=providers, environ={})
    app = create_app(engine, api_keys=keys)
    if app_hook is not None:
        app_hook(app)
    headers = {"authorization": f"Bearer {keys[0]}"} if keys else {}
    client = TestClient(app, headers=headers)
    try:
        if ready:
            with client:
                return [_answer(client, b, c, x) for _, b, c, x in CASES]
        return [_answer(client, b, c, x) for _, b, c, x in CASES]
    finally:
        asyncio.run(engine.aclose())


@pytest.mark.parametrize("ready", [True, False])
@pytest.mark.parametrize("keys", [[], ["sekrit"]])
def test_the_chat_route_answers_each_request_as_its_contract_says(
    ready: bool, keys: list[str]
) -> None:
    answers = _answers(keys=keys, ready=ready)
    statuses = {name: a[0] for (name, *_), a in zip(CASES, answers, strict=True)}
    assert 500 not in statuses.values()
    if ready:
        for name in ("auto", "forced", "stream", "+json type", "charset", "unknown fields"):
            assert statuses[name] == 200, name
        assert statuses["unknown model"] == 404
        assert statuses["over the size limit"] == 413
        assert {statuses[n] for n in ("broken json", "text/plain", "NaN", "too deep")} == {400}
        assert statuses["huge integer"] == 400  # read as a float, it is no valid seed
        by_name = {name: a for (name, *_), a in zip(CASES, answers, strict=True)}
        messages = {name: a[1]["error"]["message"] for name, a in by_name.items() if a[0] == 400}
        assert messages["NaN"] == "the body contains NaN, which is not valid JSON"
        assert messages["text/plain"] == "the body must be a JSON object sent as application/json"
        assert messages["empty body"] == "a JSON object body is required"
        assert messages["broken json"].startswith("the body is not valid JSON: ")
        # Passed on to the provider, so none is named as ignored.
        assert by_name["unknown fields"][2]["x-chatroute-ignored-params"] is None
    else:
        assert statuses["auto"] == 503
        assert statuses["broken json"] == 400  # refused before readiness matters


def test_middleware_added_to_the_app_sees_chat_requests() -> None:
    seen: list[tuple[str, str]] = []

    def add(app: Any) -> None:
        @app.middleware("http")
        async def record(request: Any, call_next: Any) -> Any:
            response = await call_next(request)
            seen.append((request.url.path, response.headers.get("x-chatroute-route", "")))
            response.headers["x-added"] = "yes"
            return response

    answers = _answers(keys=["k1"], app_hook=add)
    auto = answers[0]
    assert auto[0] == 200
    paths = [path for path, _ in seen]
    assert paths == ["/v1/chat/completions"] * len(CASES)
    assert ("/v1/chat/completions", "code") in seen or ("/v1/chat/completions", "general") in seen


def test_a_missing_key_is_refused_on_the_chat_route() -> None:
    config = parse_config(FAST_CONFIG, environ={})
    providers = {"fast": Provider("fast"), "strong": Provider("strong")}
    engine = build_engine(config, embedder=BagOfWordsEmbedder(), providers=providers, environ={})
    app = create_app(engine, api_keys=["k1"])
    with TestClient(app) as client:
        body = {"messages": [USER]}
        missing = client.post("/v1/chat/completions", json=body)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        ok = client.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer k1"})
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["message"]["content"] == "hello"
        answer = client.get("/v1/chat/completions", headers={"authorization": "Bearer k1"})
        assert answer.status_code == 405
    asyncio.run(engine.aclose())


# ------------------------------------------------- recording a non-streamed answer, once

_CHAT_SCOPE = {
    "type": "http",
    "asgi": {"version": "3.0"},
    "http_version": "1.1",
    "method": "POST",
    "scheme": "http",
    "root_path": "",
    "path": "/v1/chat/completions",
    "raw_path": b"/v1/chat/completions",
    "query_string": b"",
    "headers": [(b"content-type", b"application/json")],
    "state": {},
}


async def _drive_chat(failing: str | None) -> tuple[list[str], list[RequestTrace], Any]:
    """One non-streamed chat call straight over ASGI; `failing` names the message type
    whose sending raises. Returns what happened in order, the traces and the metrics."""
    config = parse_config(FAST_CONFIG, environ={})
    providers = {"fast": Provider("fast", "quick answer"), "strong": Provider("strong", "sure")}
    engine = build_engine(config, embedder=BagOfWordsEmbedder(), providers=providers, environ={})
    events: list[str] = []
    traces: list[RequestTrace] = []

    def sink(trace: RequestTrace) -> None:
        events.append(f"recorded {trace.status}")
        traces.append(trace)

    app = create_app(engine, api_keys=[], trace_sink=sink)
    body = json.dumps({"model": "general", "messages": [USER]}).encode()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(30)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == failing:
            raise OSError("connection reset")
        events.append(message["type"])

    try:
        async with app.router.lifespan_context(app):
            try:
                await app(dict(_CHAT_SCOPE), receive, send)
            except OSError:
                events.append("send failed")
    finally:
        await engine.aclose()
    return events, traces, app.state.metrics


def _answered(metrics: Any, status: str) -> float | None:
    value: float | None = metrics.registry.get_sample_value(
        "chatroute_requests_total",
        {"endpoint": "chat_completions", "route": "general", "status": status},
    )
    return value


async def test_a_non_streamed_answer_is_recorded_once_after_its_last_byte() -> None:
    events, traces, metrics = await _drive_chat(failing=None)
    assert events == ["http.response.start", "http.response.body", "recorded 200"]
    assert traces[0].committed and traces[0].provider == "strong"
    assert _answered(metrics, "200") == 1
    await asyncio.sleep(0)
    assert not others()


@pytest.mark.parametrize("failing", ["http.response.start", "http.response.body"])
async def test_a_non_streamed_answer_that_cannot_be_sent_is_still_recorded_once(
    failing: str,
) -> None:
    events, traces, metrics = await _drive_chat(failing=failing)
    assert events[-2:] == ["recorded 200", "send failed"]
    assert events.count("recorded 200") == 1 and len(traces) == 1
    assert _answered(metrics, "200") == 1
    await asyncio.sleep(0)
    assert not others()


@pytest.mark.parametrize("threshold", [12_345, None])
async def test_the_gc_threshold_applies_while_the_service_runs(threshold: int | None) -> None:
    import gc

    config = parse_config({**FAST_CONFIG, "server": {"gc_threshold": threshold}}, environ={})
    providers = {"fast": Provider("fast", "quick answer"), "strong": Provider("strong", "sure")}
    engine = build_engine(config, embedder=BagOfWordsEmbedder(), providers=providers, environ={})
    app = create_app(engine, api_keys=[])
    before = gc.get_threshold()
    try:
        async with app.router.lifespan_context(app):
            expected = before if threshold is None else (threshold, *before[1:])
            assert gc.get_threshold() == expected
    finally:
        await engine.aclose()
    assert gc.get_threshold() == before  # restored at shutdown


def test_a_tiny_gc_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="gc_threshold"):
        parse_config({**FAST_CONFIG, "server": {"gc_threshold": 5}}, environ={})
