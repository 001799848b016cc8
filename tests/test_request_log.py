"""The request log line, request ids, failover and breaker warnings, token and TTFT metrics,
and the start-up summary, over the real service (uvicorn, the openai SDK, fake upstreams)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from chatroute.failover.breaker import BreakerSettings, CircuitBreaker
from chatroute.server.request_log import (
    JsonFormatter,
    RequestIdFilter,
    clean_request_id,
    key_hash,
    random_hex,
)
from chatroute.server.startup import ReadyServer, log_startup, startup_summary
from tests.conftest import ServiceStack
from tests.fakes import Malformed, Ok, ServerError, Status


def build(urls: dict[str, str]) -> dict[str, Any]:
    def provider(name: str) -> dict[str, Any]:
        return {
            "base_url": urls[name],
            "model": f"{name}-model",
            "api_key_env": f"{name.upper()}_KEY",
        }

    return {
        "routing": {"default_route": "chain", "threshold": 0.3},
        "providers": {name: provider(name) for name in ("primary", "fallback")},
        "routes": {
            "chain": {"targets": ["primary", "fallback"], "utterances": ["hello there"]},
            "math": {
                "targets": ["fallback"],
                "utterances": ["solve this equation", "integrate x squared"],
            },
        },
    }


class Capture(logging.Handler):
    """Keeps the records of the `chatroute` loggers (with their request ids), thread-safely."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.changed = threading.Condition()
        self.addFilter(RequestIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        with self.changed:
            self.records.append(record)
            self.changed.notify_all()

    def wait_for(
        self, match: Callable[[logging.LogRecord], bool], timeout: float = 10.0
    ) -> logging.LogRecord:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for record in self.records:
                    if match(record):
                        return record
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("no such log record")
                self.changed.wait(left)

    def request_line(self, request_id: str) -> logging.LogRecord:
        return self.wait_for(
            lambda r: (
                r.name == "chatroute.requests"
                and getattr(r, "request", {}).get("request_id") == request_id
            )
        )

    def text(self) -> str:
        formatter = logging.Formatter("%(levelname)s %(name)s [%(request_id)s]: %(message)s")
        json_formatter = JsonFormatter()
        with self.changed:
            records = list(self.records)
        return "\n".join(formatter.format(r) + "\n" + json_formatter.format(r) for r in records)


@contextlib.contextmanager
def _capture() -> Iterator[Capture]:
    handler = Capture()
    target = logging.getLogger("chatroute")
    level = target.level
    target.addHandler(handler)
    target.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        target.removeHandler(handler)
        target.setLevel(level)


@pytest.fixture
def logs() -> Iterator[Capture]:
    with _capture() as handler:
        yield handler


@pytest.fixture(scope="module")
def stack(
    service_stack: Callable[..., contextlib.AbstractContextManager[ServiceStack]],
) -> Iterator[ServiceStack]:
    with service_stack(build, ["primary", "fallback"]) as running:
        yield running


@pytest.fixture(autouse=True)
def fresh(stack: ServiceStack) -> None:
    stack.reset()


def _chat(stack: ServiceStack, request_id: str | None, **kwargs: Any) -> Any:
    headers = {"x-request-id": request_id} if request_id is not None else {}
    return stack.client.chat.completions.with_raw_response.create(
        model="auto",
        messages=[{"role": "user", "content": "hello there"}],
        extra_headers=headers,
        **kwargs,
    )


def _stream(stack: ServiceStack, request_id: str) -> tuple[str, str]:
    """A streamed chat request with `request_id`: the id the answer carries, and its text."""
    with stack.client.chat.completions.with_streaming_response.create(
        model="auto",
        messages=[{"role": "user", "content": "hello there"}],
        stream=True,
        extra_headers={"x-request-id": request_id},
    ) as response:
        text = "".join(
            chunk.choices[0].delta.content or "" for chunk in response.parse() if chunk.choices
        )
        return response.headers["x-request-id"], text


def test_a_chat_request_logs_one_line_with_route_attempts_tokens_and_key_hash(
    stack: ServiceStack, logs: Capture
) -> None:
    stack.upstreams["primary"].script(Ok("hi", prompt_tokens=12, completion_tokens=3))
    raw = _chat(stack, "req-0001")
    assert raw.headers["x-request-id"] == "req-0001"
    assert raw.parse().choices[0].message.content == "hi"
    record = logs.request_line("req-0001")
    assert record.request_id == "req-0001"  # type: ignore[attr-defined]
    fields = record.request
    assert record.levelno == logging.INFO
    assert fields["route"] == "chain" and fields["default"] is False
    assert 0.5 < fields["score"] <= 1.0
    assert fields["status"] == 200 and fields["path"] == "/v1/chat/completions"
    assert fields["input_tokens"] == 12 and fields["output_tokens"] == 3
    assert [(a["provider"], a["outcome"]) for a in fields["attempts"]] == [("primary", "success")]
    assert fields["latency_ms"] >= fields["attempts"][0]["duration_ms"] >= 0
    assert fields["key"] == key_hash(stack.key)
    text = record.getMessage()
    assert text.startswith("request request_id=req-0001 method=POST")
    assert "route=chain" in text and "attempts=primary:success:" in text
    assert "input_tokens=12 output_tokens=3" in text and f"key={key_hash(stack.key)}" in text
    # JSON: the same fields as keys of one object on one line.
    line = JsonFormatter().format(record)
    assert "\n" not in line
    data = json.loads(line)
    assert data["message"] == "request" and data["level"] == "INFO"
    assert data["request_id"] == "req-0001" and data["route"] == "chain"
    assert data["attempts"][0]["provider"] == "primary" and data["input_tokens"] == 12
    assert stack.key not in logs.text()


def test_every_attempt_sends_the_request_id_upstream(stack: ServiceStack) -> None:
    # The caller's id, on both attempts of a failed-over stream.
    stack.upstreams["primary"].script(ServerError())
    stack.upstreams["fallback"].script(Ok("from the fallback"))
    answered_id, text = _stream(stack, "fwd-1")
    assert answered_id == "fwd-1" and text == "from the fallback"
    seen = [up.requests[0].headers.get("x-request-id") for up in stack.upstreams.values()]
    assert seen == ["fwd-1", "fwd-1"]
    # A generated id reaches the upstream as the caller gets it back.
    stack.reset()
    stack.upstreams["primary"].script(Ok("hi"))
    raw = _chat(stack, None)
    assert raw.parse().choices[0].message.content == "hi"
    generated = raw.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    assert stack.upstreams["primary"].requests[0].headers["x-request-id"] == generated


def test_the_answering_upstreams_own_request_id_is_returned_and_logged(
    stack: ServiceStack, logs: Capture
) -> None:
    # The primary accepts the call (its id: up-A) and then answers garbage; the fallback
    # answers (up-B): the caller and the log line get the fallback's id.
    stack.upstreams["primary"].script(Malformed(at=0, headers={"x-request-id": "up-A"}))
    stack.upstreams["fallback"].script(Ok("served", headers={"x-request-id": "up-B"}))
    raw = _chat(stack, "own-1")
    assert raw.parse().choices[0].message.content == "served"
    assert raw.headers["x-chatroute-provider"] == "fallback"
    assert raw.headers["x-chatroute-upstream-request-id"] == "up-B"
    assert logs.request_line("own-1").request["upstream_request_id"] == "up-B"
    # No attempt answered: the id of the one that was accepted and then failed is not
    # passed off as the answer's.
    stack.upstreams["primary"].script(Malformed(at=0, headers={"x-request-id": "up-A"}))
    stack.upstreams["fallback"].script(Status(500, headers={"x-request-id": "up-E"}))
    with pytest.raises(openai.APIStatusError) as failed:
        _chat(stack, "own-2")
    assert failed.value.response.headers["x-chatroute-provider"] == "fallback"
    assert "x-chatroute-upstream-request-id" not in failed.value.response.headers
    assert "upstream_request_id" not in logs.request_line("own-2").request
    # Streamed: the header goes out with the answer's head.
    stack.upstreams["primary"].script(Ok("streamed", headers={"x-request-id": "up-C"}))
    with stack.client.chat.completions.with_streaming_response.create(
        model="auto",
        messages=[{"role": "user", "content": "hello there"}],
        stream=True,
    ) as response:
        assert response.headers["x-chatroute-upstream-request-id"] == "up-C"
    # The fake's own default id, when nothing else is scripted.
    stack.upstreams["primary"].script(Ok("plain"))
    assert _chat(stack, "own-3").headers["x-chatroute-upstream-request-id"] == "req-fake"


async def test_a_configured_request_id_header_wins_and_none_is_sent_outside_a_request() -> None:
    from chatroute.chat import ChatMessage, ChatRole
    from chatroute.providers import OpenAIChatClient, request_hooks
    from tests.fakes import FakeUpstream

    async with FakeUpstream() as up:
        up.script(Ok("a"), Ok("b"), Ok("c"))
        fixed = OpenAIChatClient(
            base_url=up.base_url, model="m", default_headers={"X-Request-ID": "operator-set"}
        )
        plain = OpenAIChatClient(base_url=up.base_url, model="m")
        messages = [ChatMessage(ChatRole.USER, "hi")]
        token = request_hooks.request_id.set("served-1")
        try:
            await fixed.get_response(messages)
        finally:
            request_hooks.request_id.reset(token)
        await plain.get_response(messages)  # not serving a request: no id of ours
        token = request_hooks.request_id.set("served-2")
        try:
            await plain.get_response(messages)
        finally:
            request_hooks.request_id.reset(token)
        await fixed.aclose()
        await plain.aclose()
    assert [r.headers.get("x-request-id") for r in up.requests] == [
        "operator-set",
        None,
        "served-2",
    ]


def test_a_stream_logs_its_time_to_first_token_and_counts_tokens_in_metrics(
    stack: ServiceStack, logs: Capture
) -> None:
    stack.upstreams["primary"].script(
        Ok(
            "one two three",
            prompt_tokens=7,
            completion_tokens=3,
            usage_extra={
                "prompt_tokens_details": {"cached_tokens": 4},
                "completion_tokens_details": {"reasoning_tokens": 2},
            },
        )
    )
    before = stack.metrics()
    answered_id, text = _stream(stack, "stream-1")
    assert answered_id == "stream-1" and text == "one two three"
    fields = logs.request_line("stream-1").request
    assert fields["stream"] is True and fields["status"] == 200
    assert 0 <= fields["ttft_ms"] <= fields["latency_ms"]
    assert (fields["input_tokens"], fields["output_tokens"]) == (7, 3)
    assert (fields["cached_tokens"], fields["reasoning_tokens"]) == (4, 2)
    after = stack.metrics()
    for kind, count in (("prompt", 7), ("completion", 3), ("cached", 4), ("reasoning", 2)):
        series = f'chatroute_tokens_total{{kind="{kind}",provider="primary",route="chain"}}'
        assert _sample(after, series) - _sample(before, series) == count, kind
    ttft = 'chatroute_time_to_first_token_seconds_count{provider="primary",route="chain"}'
    assert _sample(after, ttft) - _sample(before, ttft) == 1


def _sample(exposition: str, series: str) -> float:
    for line in exposition.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_failover_logs_a_warning_with_the_reason_joined_to_the_request(
    stack: ServiceStack, logs: Capture
) -> None:
    stack.upstreams["primary"].script(ServerError(502))
    stack.upstreams["fallback"].script(Ok("from fallback"))
    raw = _chat(stack, "failover-1")
    assert raw.parse().choices[0].message.content == "from fallback"
    warning = logs.wait_for(
        lambda r: r.levelno == logging.WARNING and "failing over" in r.getMessage()
    )
    assert "provider primary failed (server_error, HTTP 502)" in warning.getMessage()
    assert warning.request_id == "failover-1"  # type: ignore[attr-defined]
    fields = logs.request_line("failover-1").request
    assert [(a["provider"], a["outcome"], a.get("failure")) for a in fields["attempts"]] == [
        ("primary", "failed", "server_error"),
        ("fallback", "success", None),
    ]
    assert "attempts=primary:failed:server_error:" in logs.request_line("failover-1").getMessage()


def test_request_ids_are_generated_or_replaced_when_malformed_and_returned_on_every_answer(
    stack: ServiceStack, logs: Capture
) -> None:
    http = stack.http
    generated = http.post("/v1/route", json={"input": "hello there"})
    assert generated.status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])
    for bad in ("has spaces in it", "x" * 129, "<script>", "a\tb", ""):
        answer = http.post("/v1/route", json={"input": "hi"}, headers={"x-request-id": bad})
        assert answer.headers["x-request-id"] != bad
        assert re.fullmatch(r"[0-9a-f]{32}", answer.headers["x-request-id"])
    answers = {
        "classify": http.post(
            "/v1/classify",
            json={"inputs": ["hello there", "solve this equation"]},
            headers={"x-request-id": "cls-1"},
        ),
        "not found": http.post(
            "/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            headers={"x-request-id": "err-404"},
        ),
        "unauthorised": http.post(
            "/v1/route",
            json={"input": "x"},
            headers={"x-request-id": "err-401", "authorization": "Bearer wrong-key-abcdef"},
        ),
    }
    assert answers["classify"].headers["x-request-id"] == "cls-1"
    assert answers["not found"].status_code == 404
    assert answers["not found"].headers["x-request-id"] == "err-404"
    assert answers["unauthorised"].status_code == 401
    assert answers["unauthorised"].headers["x-request-id"] == "err-401"
    assert logs.request_line("err-404").request["status"] == 404
    denied = logs.request_line("err-401").request
    assert denied["status"] == 401 and denied["key"] == key_hash("wrong-key-abcdef")
    assert logs.request_line("cls-1").request["inputs"] == 2
    assert "wrong-key-abcdef" not in logs.text() and stack.key not in logs.text()
    assert clean_request_id(b"ok_id:1.2/3") == "ok_id:1.2/3"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_generated_ids_are_unique_also_in_a_forked_worker() -> None:
    ids = {random_hex() for _ in range(10_000)}
    assert len(ids) == 10_000 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    # A forked child starts from a copy of the parent's generator: it must not repeat
    # the parent's next ids.
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send its next id and leave without running anything else
        os.write(write, random_hex().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    assert re.fullmatch(r"[0-9a-f]{32}", child)
    assert child != random_hex()


def test_decisions_are_counted_per_endpoint_and_the_scoring_mode_is_exported(
    stack: ServiceStack,
) -> None:
    stack.http.post("/v1/route", json={"input": "solve this equation"})
    stack.http.post("/v1/classify", json={"inputs": ["integrate x squared", "hello there"]})
    metrics = stack.metrics()
    for endpoint in ("route", "classify"):
        series = (
            f'chatroute_route_decisions_total{{default="false",endpoint="{endpoint}",route="math"}}'
        )
        assert series in metrics, endpoint
    mode = stack.service.engine.router.scoring.name
    assert f'chatroute_scoring_info{{mode="{mode}"}} 1.0' in metrics
    assert "chatroute_scoring_training_seconds " in metrics


def test_breaker_transitions_log_warnings_with_the_reason(logs: Capture) -> None:
    now = [0.0]
    breaker = CircuitBreaker(
        "flaky",
        BreakerSettings(failure_rate_threshold=0.5, minimum_requests=2, window=30, cool_down=5),
        clock=lambda: now[0],
    )
    for _ in range(2):
        permit = breaker.try_acquire()
        assert permit is not None
        permit.record_failure()
    now[0] = 6.0
    probe = breaker.try_acquire()
    assert probe is not None
    probe.record_success()
    lines = [
        r.getMessage()
        for r in logs.records
        if r.name == "chatroute.failover.breaker" and r.levelno == logging.WARNING
    ]
    assert lines == [
        "circuit breaker of provider flaky: closed -> open (2 of 2 attempts failed in 30 s)",
        "circuit breaker of provider flaky: open -> half_open (cool-down of 5 s elapsed)",
        "circuit breaker of provider flaky: half_open -> closed (the probe succeeded)",
    ]


def test_the_startup_summary_names_what_runs_and_never_a_key(
    stack: ServiceStack, logs: Capture
) -> None:
    engine = stack.service.engine
    environ = {"PRIMARY_KEY": "sk-secret-primary-000"}
    summary = startup_summary(engine, auth=True, shared_state=False, environ=environ)
    assert summary["version"]
    assert summary["embedder"]["device"] == "cpu" and summary["embedder"]["dtype"] == "fp32"
    assert "MiniLM" in summary["embedder"]["model"]
    inner = getattr(engine.embedder, "inner", engine.embedder)
    assert summary["embedder"]["workers"] == inner.workers >= 1
    assert summary["embedder"]["solo_threads"] == inner.solo_threads
    assert summary["embedder"]["traced"] is inner.traced is True
    assert summary["scoring"] == engine.router.scoring.name
    assert summary["training_seconds"] == engine.router.training_seconds is not None
    assert summary["routes"] == {
        "chain": {"utterances": 1, "failover": ["primary", "fallback"]},
        "math": {"utterances": 2, "failover": ["fallback"]},
    }
    primary = summary["providers"]["primary"]
    assert primary["model"] == "primary-model" and primary["key"] == "set"
    assert primary["endpoint"].startswith("http://127.0.0.1:")
    assert summary["providers"]["fallback"]["key"] == "unset"
    assert summary["auth"] is True and summary["shared_state"] is False
    log_startup(summary)
    text = logs.text()
    assert "auth on; shared state off" in text
    assert f"(fp32, {inner.workers} model threads" in text
    assert ", packed passes traced)" in text
    eager = {**summary["embedder"], "solo_threads": 2, "traced": False}
    log_startup({**summary, "embedder": eager})
    assert "model threads, a lone pass on 2 threads)" in logs.text()
    assert "route chain (default): 1 utterances, failover primary -> fallback" in text
    assert "provider primary: openai primary-model at http://127.0.0.1:" in text
    assert "API key set (PRIMARY_KEY)" in text and "API key NOT set (FALLBACK_KEY)" in text
    assert "sk-secret-primary-000" not in text


def test_ready_is_logged_only_once_the_port_is_bound(
    default_embedder: Callable[[], Any], logs: Capture
) -> None:
    import uvicorn

    from chatroute.config import parse_config
    from chatroute.server import create_app

    config = parse_config(
        build({"primary": "http://127.0.0.1:9", "fallback": "http://127.0.0.1:9"}), environ={}
    )
    app = create_app(config, api_keys=[], environ={}, embedder=default_embedder())
    # Port 0: the port is known only once bound, and "ready" names it.
    server = ReadyServer(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        ready = logs.wait_for(lambda r: r.getMessage().startswith("ready:"), timeout=60)
        found = re.fullmatch(r"ready: listening on 127\.0\.0\.1:(\d+)", ready.getMessage())
        assert found is not None and int(found.group(1)) > 0
        with socket.create_connection(("127.0.0.1", int(found.group(1))), timeout=5):
            pass  # the port named accepts connections
        messages = [r.getMessage() for r in logs.records]
        summary = next(i for i, m in enumerate(messages) if m.startswith("chatroute "))
        assert "auth off" in messages[summary]
        assert summary < messages.index(ready.getMessage())
        assert sum(m.startswith("ready:") for m in messages) == 1
    finally:
        server.should_exit = True
        thread.join(10)


async def test_an_unexpected_500_carries_its_request_id_and_is_logged(
    default_embedder: Callable[[], Any], logs: Capture
) -> None:
    import httpx

    from chatroute.config import parse_config
    from chatroute.server import create_app

    nowhere = "http://127.0.0.1:9"
    config = parse_config(build({"primary": nowhere, "fallback": nowhere}), environ={})
    app = create_app(config, api_keys=[], environ={}, embedder=default_embedder())

    async def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/boom", boom)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        answer = await client.get("/boom", headers={"x-request-id": "boom-1"})
    assert answer.status_code == 500 and answer.headers["x-request-id"] == "boom-1"
    assert logs.request_line("boom-1").request["status"] == 500
