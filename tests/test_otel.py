"""OpenTelemetry: GenAI spans of chat requests through the real service, trace context continued
from the caller and passed to the upstream."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from chatroute.chat.embedding import EmbeddingGenerator
from chatroute.config import parse_config
from chatroute.server import create_app
from chatroute.server.observe import load_otel, otel_requested
from tests.fakes import FakeUpstream, Ok, ServerError

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
W3C = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


def build(urls: dict[str, str]) -> dict[str, Any]:
    return {
        "routing": {"default_route": "chain", "threshold": 0.2},
        "providers": {
            name: {"base_url": url, "model": f"{name}-model"} for name, url in urls.items()
        },
        "routes": {
            "chain": {
                "targets": ["primary", "fallback"],
                "utterances": ["write a python function", "fix this bug in my code"],
            },
            "chat": {"targets": ["fallback"], "utterances": ["tell me a joke", "how are you"]},
        },
    }


class Stack:
    def __init__(self, url: str, exporter: InMemorySpanExporter, ups: dict[str, FakeUpstream]):
        self.url = url
        self.exporter = exporter
        self.upstreams = ups

    def client(self, **headers: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="k", max_retries=0, default_headers=headers
        )

    def spans(self, timeout: float = 5.0) -> list[ReadableSpan]:
        """The finished spans once the request's server span has ended: it ends on the
        server's thread after the answer's last byte went out, which the client may have
        read first (a span ending late would also leak into the next test's spans)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = list(self.exporter.get_finished_spans())
            if any(s.kind is SpanKind.SERVER for s in spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.01)


@pytest.fixture(scope="module")
def stack(
    default_embedder: Callable[[], EmbeddingGenerator],
    serve_app: Callable[..., contextlib.AbstractContextManager[str]],
) -> Iterator[Stack]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with contextlib.ExitStack() as es:
        ups = {n: es.enter_context(FakeUpstream()) for n in ("primary", "fallback")}
        config = parse_config(build({n: u.base_url for n, u in ups.items()}), environ={})
        app = create_app(config, environ={}, embedder=default_embedder(), tracer_provider=provider)
        url = es.enter_context(serve_app(app))
        yield Stack(url, exporter, ups)


@pytest.fixture
def fresh(stack: Stack) -> Stack:
    stack.exporter.clear()
    for up in stack.upstreams.values():
        up.reset()
        up.default = Ok("Hello from the fake upstream.")
    return stack


def _by_name(spans: list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        found.setdefault(span.name, []).append(span)
    return found


def _traceparent(request: Any) -> str | None:
    headers = {k.lower(): v for k, v in request.headers.items()}
    return headers.get("traceparent")


def test_a_failover_is_one_trace_continued_from_the_caller(fresh: Stack) -> None:
    fresh.upstreams["primary"].script(ServerError(503))
    fresh.upstreams["fallback"].script(
        Ok("done", prompt_tokens=12, completion_tokens=3, headers={"x-request-id": "fb-7"})
    )
    answer = fresh.client(traceparent=TRACEPARENT).chat.completions.create(
        model="auto", messages=[{"role": "user", "content": "write a python function"}]
    )
    assert answer.choices[0].message.content == "done"
    spans = _by_name(fresh.spans())
    (request,) = spans["chat auto"]
    assert request.kind is SpanKind.SERVER
    assert request.context is not None and request.parent is not None
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert format(request.parent.span_id, "016x") == PARENT_ID
    attrs = dict(request.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "auto"
    assert attrs["gen_ai.response.model"] == "fallback-model"
    assert attrs["chatroute.upstream.request_id"] == "fb-7"  # the answering upstream's id
    assert attrs["chatroute.route"] == "chain"
    assert attrs["chatroute.failovers"] == 1
    assert attrs["gen_ai.usage.input_tokens"] == 12
    assert attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["http.response.status_code"] == 200

    (decision,) = spans["chatroute.route"]
    assert decision.parent is not None and decision.parent.span_id == request.context.span_id
    dattrs = dict(decision.attributes or {})
    assert dattrs["chatroute.route"] == "chain"
    assert dattrs["chatroute.route.is_default"] is False
    assert dattrs["chatroute.routing.scoring"] == "prototype"
    assert isinstance(dattrs["chatroute.route.score"], float)

    (failed,) = spans["chat primary-model"]
    (served,) = spans["chat fallback-model"]
    for span, provider in ((failed, "primary"), (served, "fallback")):
        assert span.kind is SpanKind.CLIENT
        assert span.parent is not None and span.parent.span_id == request.context.span_id
        a = dict(span.attributes or {})
        assert a["gen_ai.provider.name"] == "openai"
        assert a["gen_ai.request.model"] == f"{provider}-model"
        assert a["chatroute.provider"] == provider
        assert a["server.address"] == "127.0.0.1"
        # The upstream saw this attempt's span as its parent, in the caller's trace.
        (seen,) = fresh.upstreams[provider].requests
        header = _traceparent(seen)
        assert header is not None
        match = W3C.match(header)
        assert match is not None
        assert match.group(1) == TRACE_ID
        assert span.context is not None
        assert match.group(2) == format(span.context.span_id, "016x")
    assert dict(failed.attributes or {})["chatroute.attempt.outcome"] == "failed"
    assert dict(failed.attributes or {})["error.type"] == "server_error"
    sattrs = dict(served.attributes or {})
    assert sattrs["chatroute.attempt.outcome"] == "success"
    assert sattrs["gen_ai.usage.output_tokens"] == 3
    assert "error.type" not in sattrs


def test_a_stream_records_its_usage_and_ends_with_the_stream(fresh: Stack) -> None:
    fresh.upstreams["fallback"].script(Ok("one two three", prompt_tokens=7, completion_tokens=3))
    stream = fresh.client().chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "one two three"
    spans = _by_name(fresh.spans())
    (request,) = spans["chat chat"]
    attrs = dict(request.attributes or {})
    assert attrs["chatroute.stream"] is True
    assert attrs["gen_ai.usage.input_tokens"] == 7
    assert attrs["gen_ai.usage.output_tokens"] == 3
    assert "chatroute.route" not in spans  # a named route: no routing decision was made
    (attempt,) = spans["chat fallback-model"]
    assert request.context is not None and attempt.parent is not None
    assert attempt.parent.span_id == request.context.span_id
    assert attempt.end_time is not None and request.end_time is not None
    assert attempt.end_time <= request.end_time
    assert request.parent is None  # no traceparent: a trace of its own


@pytest.mark.parametrize(
    "bad",
    [
        "00-zzzz-00f067aa0ba902b7-01",
        f"00-{'0' * 32}-{PARENT_ID}-01",  # an all-zero trace id is invalid
        f"ff-{TRACE_ID}-{PARENT_ID}-01",  # version ff is forbidden
        "not a traceparent; <script>",
        f"00-{TRACE_ID}-{PARENT_ID}-01-" + "a" * 600,  # version 00 allows nothing after flags
    ],
)
def test_a_malformed_traceparent_is_replaced_never_echoed(fresh: Stack, bad: str) -> None:
    answer = fresh.client(traceparent=bad).chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.choices[0].message.content
    (request,) = _by_name(fresh.spans())["chat chat"]
    assert request.parent is None
    (seen,) = fresh.upstreams["fallback"].requests
    header = _traceparent(seen)
    assert header is not None and header != bad
    match = W3C.match(header)
    assert match is not None, header
    assert request.context is not None
    assert match.group(1) == format(request.context.trace_id, "032x")


def test_an_error_answer_is_recorded_on_the_span(fresh: Stack) -> None:
    with pytest.raises(openai.NotFoundError):
        fresh.client().chat.completions.create(
            model="no-such-route", messages=[{"role": "user", "content": "hi"}]
        )
    (request,) = _by_name(fresh.spans())["chat no-such-route"]
    attrs = dict(request.attributes or {})
    assert attrs["http.response.status_code"] == 404
    assert attrs["error.type"] == "404"


def test_without_tracing_nothing_reaches_the_upstream(
    default_embedder: Callable[[], EmbeddingGenerator],
    serve_app: Callable[..., contextlib.AbstractContextManager[str]],
) -> None:
    with FakeUpstream() as up, FakeUpstream() as other:
        urls = {"primary": up.base_url, "fallback": other.base_url}
        config = parse_config(build(urls), environ={})
        app = create_app(config, environ={}, embedder=default_embedder())
        with serve_app(app) as url:
            client = openai.OpenAI(
                base_url=f"{url}/v1",
                api_key="k",
                max_retries=0,
                default_headers={"traceparent": TRACEPARENT},
            )
            client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}]
            )
        (seen,) = other.requests
        assert _traceparent(seen) is None


@pytest.mark.parametrize(
    ("environ", "wanted"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_the_environment_turns_tracing_on(environ: dict[str, str], wanted: bool) -> None:
    assert otel_requested(environ) is wanted


def test_an_exporter_that_is_not_installed_leaves_tracing_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert load_otel({"OTEL_TRACES_EXPORTER": "no-such-exporter"}, None) is None
    assert "no-such-exporter" in caplog.text
    layer = load_otel({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "gw"}, None)
    assert layer is not None and layer.owned
    resource = layer.provider.resource  # type: ignore[attr-defined]
    assert resource.attributes["service.name"] == "gw"
    layer.shutdown()


def test_only_the_service_records_spans_when_a_global_provider_is_configured(
    fresh: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As if the process had a global provider (auto-instrumentation, say): FastAPI's own
    # telemetry is off, so a request is still the service's spans alone, one server span.
    from opentelemetry import trace

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(fresh.exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    fresh.client().chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "tell me a joke"}]
    )
    spans = fresh.spans()
    assert {span.name for span in spans} == {"chat chat", "chat fallback-model"}
    assert [span.kind for span in spans].count(SpanKind.SERVER) == 1
