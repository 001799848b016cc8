"""The fault matrix F01-F16 and F18, end to end: openai SDK -> uvicorn service -> fake upstreams.

Each test scripts faults per request at real HTTP upstreams on 127.0.0.1 and asserts how
many requests every upstream saw, what the caller received and the attempt records the
service kept (through its trace sink). F17 (caller disconnects) is in test_disconnect.py.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.conftest import ServiceStack
from tests.fakes import (
    ContentPolicy,
    ContextLengthExceeded,
    Cut,
    ErrorEvent,
    Hang,
    Malformed,
    NoDone,
    Ok,
    RateLimited,
    Reset,
    ServerError,
    SlowFirstToken,
    Stall,
    Status,
    Truncated,
    Unavailable,
)

FIRST_TOKEN = 0.3
STALL = 0.3
ATTEMPT = 1.0
DEADLINE = 5.0
COOL_DOWN = 0.5
RETRY_AFTER = 0.3  # an upstream's Retry-After the service waits for (fractional seconds parse)
BACKOFF = 0.6  # the "backoff" route's wait between tries of one provider


def build(urls: dict[str, str]) -> dict[str, Any]:
    def provider(name: str, **extra: Any) -> dict[str, Any]:
        return {
            "base_url": urls[name],
            "model": f"{name}-model",
            "timeouts": {
                "connect": 1,
                "read": 5,
                "attempt": ATTEMPT,
                "first_token": FIRST_TOKEN,
                "stall": STALL,
            },
            **extra,
        }

    return {
        "routing": {"default_route": "chain", "threshold": 0.3},
        "resilience": {
            "deadline": DEADLINE,
            "retry_after_max": 2,
            "breaker": {
                "minimum_requests": 4,
                "failure_rate_threshold": 0.5,
                "window": 30,
                "cool_down": COOL_DOWN,
            },
        },
        "providers": {
            "primary": provider("primary", context_window=8192),
            "fallback": provider("fallback"),
            "big": provider("big", context_window=32768),
        },
        "routes": {
            "chain": {"targets": ["primary", "fallback"], "utterances": ["hello there"]},
            "solo": {"targets": ["primary"]},
            "solo_retry": {
                "targets": ["primary"],
                "retry_same_provider": True,
                "max_tries_per_provider": 3,
            },
            "retry": {
                "targets": ["primary", "fallback"],
                "retry_same_provider": True,
                "max_attempts": 3,
            },
            "ctx": {"targets": ["primary", "big"]},
            "backoff": {
                "targets": ["primary"],
                "retry_same_provider": True,
                "retry_backoff": BACKOFF,
            },
            "slow": {
                "targets": ["primary", "fallback"],
                "deadline": 0.5,
                "timeouts": {"first_token": 5, "attempt": 5},
            },
        },
    }


@pytest.fixture(scope="module")
def stack(
    service_stack: Callable[..., contextlib.AbstractContextManager[ServiceStack]],
) -> Iterator[ServiceStack]:
    with service_stack(build, ["primary", "fallback", "big"]) as made:
        yield made


@pytest.fixture(autouse=True)
def fresh(stack: ServiceStack) -> None:
    stack.reset()


MESSAGES = [{"role": "user", "content": "hello there"}]


def chat(stack: ServiceStack, model: str, **kwargs: Any) -> Any:
    """A non-streamed completion through the SDK, with the raw response (headers)."""
    return stack.client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, **kwargs
    )


def events_of(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream_raw(
    stack: ServiceStack, model: str, headers: dict[str, str] | None = None, **body: Any
) -> tuple[int, dict[str, str], list[Any]]:
    """A streamed completion over plain HTTP: status, headers and the SSE events."""
    payload = {"model": model, "messages": MESSAGES, "stream": True, **body}
    with stack.http.stream(
        "POST", "/v1/chat/completions", json=payload, headers=headers
    ) as response:
        text = response.read().decode()
        status, got = response.status_code, dict(response.headers)
    if status != 200:
        return status, got, [json.loads(text)]
    return status, got, events_of(text)


def content_of(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


def metric(stack: ServiceStack, name: str, **labels: str) -> float:
    """One sample of the service's /metrics (0.0 when it is absent)."""
    return sample_of(stack.metrics(), name, **labels)


def sample_of(exposition: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus exposition text (0.0 when it is absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def records(stack: ServiceStack, n: int = 1) -> list[tuple[str, str, str | None]]:
    """(provider, outcome, failure kind) of each attempt of the n-th finished request."""
    trace = stack.wait_traces(n)[n - 1]
    return [(r.provider, r.outcome, r.failure_kind) for r in trace.attempts]


# ------------------------------------------------------------------------------- F01-F02


def test_f01_retry_after_that_fits_is_waited_for_then_the_provider_is_retried(
    stack: ServiceStack,
) -> None:
    up = stack.upstreams["primary"]
    up.script(RateLimited(retry_after=RETRY_AFTER), Ok("after the wait"))
    raw = chat(stack, "solo")
    assert raw.parse().choices[0].message.content == "after the wait"
    assert stack.attempts() == {"primary": 2, "fallback": 0, "big": 0}
    first, second = up.requests
    assert second.arrived_at - first.arrived_at >= RETRY_AFTER - 0.02  # not before it said
    trace = stack.wait_traces(1)[0]
    assert [(r.provider, r.outcome, r.failure_kind) for r in trace.attempts] == [
        ("primary", "failed", "rate_limited"),
        ("primary", "success", None),
    ]
    assert trace.attempts[1].waited >= RETRY_AFTER - 0.02
    assert raw.headers["x-chatroute-attempts"] == "2"


def test_f01_retry_after_with_a_ready_fallback_fails_over_at_once(stack: ServiceStack) -> None:
    stack.upstreams["primary"].script(RateLimited(retry_after=1))
    raw = chat(stack, "chain")
    assert raw.parse().model == "fallback-model"
    assert stack.attempts() == {"primary": 1, "fallback": 1, "big": 0}
    trace = stack.wait_traces(1)[0]
    assert trace.attempts[1].waited == 0.0
    assert records(stack) == [
        ("primary", "failed", "rate_limited"),
        ("fallback", "success", None),
    ]


def test_f01_retry_after_longer_than_allowed_is_not_waited_for(stack: ServiceStack) -> None:
    stack.upstreams["primary"].script(RateLimited(retry_after=30))
    with pytest.raises(openai.RateLimitError) as caught:
        chat(stack, "solo")
    assert stack.attempts()["primary"] == 1  # budget: one provider, tried once
    assert caught.value.response.headers["x-chatroute-attempts"] == "1"
    assert caught.value.response.headers["retry-after"] == "30"


def test_f02_429_everywhere_without_header_is_a_clear_429_within_the_budget(
    stack: ServiceStack,
) -> None:
    for up in stack.upstreams.values():
        up.default = RateLimited(retry_after=None)
    with pytest.raises(openai.RateLimitError) as caught:
        chat(stack, "retry")  # retries allowed, budget 3
    assert caught.value.status_code == 429
    assert caught.value.body["type"] == "rate_limit_error"  # type: ignore[index]
    assert stack.attempts() == {"primary": 2, "fallback": 1, "big": 0}
    assert caught.value.response.headers["x-chatroute-attempts"] == "3"
    assert [p for p, _, _ in records(stack)] == ["primary", "fallback", "primary"]

    with pytest.raises(openai.RateLimitError):
        chat(stack, "chain")  # no retries: each provider once
    assert stack.attempts() == {"primary": 3, "fallback": 2, "big": 0}


def test_f02_streaming_429_everywhere_is_a_json_429_before_any_byte(
    stack: ServiceStack,
) -> None:
    for up in stack.upstreams.values():
        up.default = RateLimited(retry_after=None)
    status, headers, body = stream_raw(stack, "chain")
    assert status == 429 and headers["content-type"] == "application/json"
    assert body[0]["error"]["type"] == "rate_limit_error"
    assert stack.attempts() == {"primary": 1, "fallback": 1, "big": 0}


# ------------------------------------------------------------------------------- F03-F05


def test_f03_one_500_then_healthy_the_next_attempt_succeeds(stack: ServiceStack) -> None:
    stack.upstreams["primary"].script(ServerError())
    raw = chat(stack, "solo_retry")
    assert raw.parse().model == "primary-model"
    assert stack.attempts() == {"primary": 2, "fallback": 0, "big": 0}
    assert records(stack) == [
        ("primary", "failed", "server_error"),
        ("primary", "success", None),
    ]
    stack.upstreams["primary"].script(ServerError())
    raw = chat(stack, "chain")  # no retries here: the next attempt is the fallback
    assert raw.parse().model == "fallback-model"
    assert stack.attempts() == {"primary": 3, "fallback": 1, "big": 0}


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_f04_primary_always_503_the_fallback_serves(stack: ServiceStack, stream: bool) -> None:
    stack.upstreams["primary"].default = Unavailable()
    stack.upstreams["fallback"].default = Ok("from the fallback")
    failovers = metric(stack, "chatroute_failovers_total", provider="primary", route="chain")
    for n in range(1, 3):
        if stream:
            status, headers, events = stream_raw(stack, "chain")
            assert status == 200 and events[-1] == "[DONE]"
            assert content_of(events) == "from the fallback"
        else:
            raw = chat(stack, "chain")
            headers = dict(raw.headers)
            assert raw.parse().choices[0].message.content == "from the fallback"
        assert headers["x-chatroute-provider"] == "fallback"
        assert headers["x-chatroute-attempts"] == "2"
        assert stack.attempts() == {"primary": n, "fallback": n, "big": 0}
        assert records(stack, n) == [
            ("primary", "failed", "server_error"),
            ("fallback", "success", None),
        ]
    after = metric(stack, "chatroute_failovers_total", provider="primary", route="chain")
    assert after == failovers + 2
    time.sleep(0.1)
    for trace in stack.wait_traces(2):  # a completed response is not a caller leaving
        assert trace.status == 200 and trace.cancelled is None and trace.committed


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_f05_reset_before_headers_fails_over(stack: ServiceStack, stream: bool) -> None:
    stack.upstreams["primary"].script(Reset())
    if stream:
        status, _, events = stream_raw(stack, "chain")
        assert status == 200 and events[-1] == "[DONE]"
    else:
        assert chat(stack, "chain").parse().model == "fallback-model"
    assert stack.attempts() == {"primary": 1, "fallback": 1, "big": 0}
    assert records(stack) == [("primary", "failed", "connect"), ("fallback", "success", None)]


# ------------------------------------------------------------------------------- F06-F07


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_f06_silent_upstream_times_out_then_the_fallback_serves_within_the_deadline(
    stack: ServiceStack, stream: bool
) -> None:
    stack.upstreams["primary"].script(Hang())
    # Streamed or not, the first-token limit (shorter than the attempt's) fails it over:
    # without a stream it bounds the wait for the answer's response head.
    if stream:
        status, headers, events = stream_raw(stack, "chain")
        assert status == 200 and events[-1] == "[DONE]"
    else:
        raw = chat(stack, "chain")  # a 504 would mean the deadline ran out first
        headers = dict(raw.headers)
    expected_kind = "first_token_timeout"
    assert headers["x-chatroute-provider"] == "fallback"
    assert stack.attempts() == {"primary": 1, "fallback": 1, "big": 0}
    assert records(stack) == [
        ("primary", "failed", expected_kind),
        ("fallback", "success", None),
    ]
    stack.upstreams["primary"].wait_for_disconnect(0, timeout=2)  # its connection was closed


def test_f07_first_token_slower_than_the_timeout_fails_over(stack: ServiceStack) -> None:
    stack.upstreams["primary"].script(SlowFirstToken(3.0, "too late"))
    status, _, events = stream_raw(stack, "chain")
    assert status == 200 and content_of(events) == "Hello from the fake upstream."
    assert stack.attempts() == {"primary": 1, "fallback": 1, "big": 0}
    assert records(stack) == [
        ("primary", "failed", "first_token_timeout"),
        ("fallback", "success", None),
    ]


def test_f07_a_provider_that_missed_its_first_token_is_not_retried(stack: ServiceStack) -> None:
    stack.upstreams["primary"].default = SlowFirstToken(3.0)
    status, _, body = stream_raw(stack, "solo_retry")  # retries allowed, but not for this
    assert status == 504
    assert body[0]["error"]["code"] == "first_token_timeout"
    assert stack.attempts()["primary"] == 1


# ------------------------------------------------------------------------------- F08-F11


def _assert_cut_after(events: list[Any], words: list[str]) -> dict[str, Any]:
    """N content chunks, then one in-band error event, and no [DONE]."""
    assert "[DONE]" not in events
    assert "error" in events[-1], events[-1]
    assert content_of(events[:-1]).split() == words
    error: dict[str, Any] = events[-1]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_f08_stream_cut_after_n_chunks_ends_with_an_in_band_error_and_no_fallback(
    stack: ServiceStack,
) -> None:
    stack.upstreams["primary"].script(Cut(2, text="one two three four"))
    status, _, events = stream_raw(stack, "chain")
    assert status == 200
    _assert_cut_after(events, ["one", "two"])
    assert stack.attempts() == {"primary": 1, "fallback": 0, "big": 0}
    assert records(stack) == [("primary", "failed_after_output", "stream_interrupted")]


def test_f08_the_sdk_raises_on_a_cut_stream(stack: ServiceStack) -> None:
    stack.upstreams["primary"].script(Cut(2, text="one two three four"))
    stream = stack.client.chat.completions.create(model="chain", messages=MESSAGES, stream=True)
    received = []
    with pytest.raises(openai.APIError):
        for chunk in stream:
            if chunk.choices:
                received.append(chunk.choices[0].delta.content or "")
    assert "".join(received).split() == ["one", "two"]
    assert stack.attempts()["fallback"] == 0


def test_f09_stream_stall_hits_the_inter_chunk_timeout_then_as_f08(stack: ServiceStack) -> None:
    stack.upstreams["primary"].script(Stall(2, text="one two three four"))
    status, _, events = stream_raw(stack, "chain")
    assert status == 200
    error = _assert_cut_after(events, ["one", "two"])
    assert error["code"] == "stall_timeout"
    assert stack.attempts() == {"primary": 1, "fallback": 0, "big": 0}
    assert records(stack) == [("primary", "failed_after_output", "stall_timeout")]
    stack.upstreams["primary"].wait_for_disconnect(0, timeout=2)


def test_f10_malformed_first_chunk_fails_over(stack: ServiceStack) -> None:
    stack.upstreams["primary"].script(Malformed(0))
    status, headers, events = stream_raw(stack, "chain")
    assert status == 200 and events[-1] == "[DONE]"
    assert headers["x-chatroute-provider"] == "fallback"
    assert stack.attempts() == {"primary": 1, "fallback": 1, "big": 0}
    assert records(stack) == [("primary", "failed", "malformed"), ("fallback", "success", None)]


def test_f10_malformed_later_chunk_is_terminal_like_f08(stack: ServiceStack) -> None:
    stack.upstreams["primary"].script(Malformed(2, text="one two three four"))
    status, _, events = stream_raw(stack, "chain")
    assert status == 200
    _assert_cut_after(events, ["one", "two"])
    assert stack.attempts() == {"primary": 1, "fallback": 0, "big": 0}
    assert records(stack) == [("primary", "failed_after_output", "malformed")]


def test_f10_malformed_non_streamed_answer_fails_over(stack: ServiceStack) -> None:
    stack.upstreams["primary"].script(Malformed(0))
    assert chat(stack, "chain").parse().model == "fallback-model"
    assert records(stack) == [("primary", "failed", "malformed"), ("fallback", "success", None)]


def test_f11_stream_without_done_but_finished_completes_promptly(stack: ServiceStack) -> None:
    stack.upstreams["primary"].script(NoDone("one two three"))
    status, _, events = stream_raw(stack, "chain")
    assert status == 200 and events[-1] == "[DONE]"
    assert content_of(events) == "one two three"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert records(stack) == [("primary", "success", None)]


def test_f11_stream_ending_without_finish_or_done_is_not_reported_complete(
    stack: ServiceStack,
) -> None:
    stack.upstreams["primary"].script(Truncated(2, text="one two three four"))
    status, _, events = stream_raw(stack, "chain")
    assert status == 200
    _assert_cut_after(events, ["one", "two"])
    assert stack.attempts()["fallback"] == 0


# ------------------------------------------------------------------------------- F12-F14


def test_f12_context_length_goes_to_a_larger_context_only(stack: ServiceStack) -> None:
    stack.upstreams["primary"].default = ContextLengthExceeded(8192)
    raw = chat(stack, "ctx")
    assert raw.parse().model == "big-model"
    assert stack.attempts() == {"primary": 1, "fallback": 0, "big": 1}
    assert records(stack) == [("primary", "failed", "context_length"), ("big", "success", None)]


def test_f12_context_length_without_a_larger_provider_is_returned(stack: ServiceStack) -> None:
    stack.upstreams["primary"].default = ContextLengthExceeded(8192)
    with pytest.raises(openai.BadRequestError) as caught:
        chat(stack, "chain")  # the fallback declares no larger window
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        chat(stack, "solo_retry")  # never retried on the same provider
    assert stack.attempts() == {"primary": 2, "fallback": 0, "big": 0}


def test_f13_content_policy_is_returned_as_is(stack: ServiceStack) -> None:
    stack.upstreams["primary"].default = ContentPolicy()
    with pytest.raises(openai.BadRequestError) as caught:
        chat(stack, "retry")
    assert caught.value.status_code == 400
    assert caught.value.code == "content_policy_violation"
    assert "safety system" in caught.value.message
    assert stack.attempts() == {"primary": 1, "fallback": 0, "big": 0}
    assert records(stack) == [("primary", "failed", "client_error")]
    breaker = stack.service.engine.breakers.get("primary").snapshot()
    assert breaker.failures == 0  # the caller's problem, not the provider's


def test_f14_error_event_as_the_first_event_fails_over(stack: ServiceStack) -> None:
    stack.upstreams["primary"].script(ErrorEvent(0))
    status, headers, events = stream_raw(stack, "chain")
    assert status == 200 and events[-1] == "[DONE]"
    assert headers["x-chatroute-provider"] == "fallback"
    assert stack.attempts() == {"primary": 1, "fallback": 1, "big": 0}
    assert records(stack) == [
        ("primary", "failed", "stream_error"),
        ("fallback", "success", None),
    ]


# ------------------------------------------------------------------------------- F15-F16


def test_f15_flapping_primary_opens_the_breaker_then_is_used_again(stack: ServiceStack) -> None:
    primary = stack.upstreams["primary"]
    primary.default = ServerError()
    for _ in range(4):  # minimum_requests 4, all failed: the breaker opens
        assert chat(stack, "chain").parse().model == "fallback-model"
    assert primary.attempts == 4
    breaker = stack.service.engine.breakers.get("primary")
    assert breaker.state.value == "open"
    # Open: the primary is skipped, every route sees it (one breaker per provider).
    assert chat(stack, "chain").parse().model == "fallback-model"
    assert primary.attempts == 4
    assert records(stack, 5) == [("fallback", "success", None)]
    assert metric(stack, "chatroute_breaker_state", provider="primary", state="open") == 1
    assert metric(stack, "chatroute_breaker_state", provider="primary", state="closed") == 0
    opened = metric(
        stack,
        "chatroute_breaker_transitions_total",
        provider="primary",
        from_state="closed",
        to_state="open",
    )
    assert opened >= 1
    # It recovers; after the cool-down one probe goes through and closes the breaker.
    primary.default = Ok("primary is back")
    time.sleep(COOL_DOWN + 0.1)
    raw = chat(stack, "chain")
    assert raw.parse().choices[0].message.content == "primary is back"
    probe = stack.wait_traces(6)[5].attempts
    assert [(r.provider, r.outcome, r.probe) for r in probe] == [("primary", "success", True)]
    assert breaker.state.value == "closed"
    assert chat(stack, "retry").parse().model == "primary-model"
    assert primary.attempts == 6
    assert metric(stack, "chatroute_breaker_state", provider="primary", state="closed") == 1
    for old, new in (("open", "half_open"), ("half_open", "closed")):
        moved = metric(
            stack,
            "chatroute_breaker_transitions_total",
            provider="primary",
            from_state=old,
            to_state=new,
        )
        assert moved >= 1, (old, new)


def test_f15_all_candidates_open_still_makes_one_forced_probe(stack: ServiceStack) -> None:
    for name in ("primary", "fallback"):
        stack.service.engine.breakers.get(name).trip()
    raw = chat(stack, "chain")
    assert raw.parse().model == "primary-model"
    trace = stack.wait_traces(1)[0]
    assert [(r.provider, r.forced_probe) for r in trace.attempts] == [("primary", True)]


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_f16_model_names_the_serving_provider_and_usage_passes_through(
    stack: ServiceStack, stream: bool
) -> None:
    stack.upstreams["primary"].script(Unavailable())
    stack.upstreams["fallback"].default = Ok(
        "counted words here", prompt_tokens=17, completion_tokens=3
    )
    if stream:
        status, _, events = stream_raw(stack, "chain", stream_options={"include_usage": True})
        assert status == 200 and events[-1] == "[DONE]"
        assert {e["model"] for e in events[:-1]} == {"fallback-model"}
        usage = events[-2]["usage"]
    else:
        completion = chat(stack, "chain").parse()
        assert completion.model == "fallback-model"
        assert completion.usage is not None
        usage = completion.usage.model_dump()
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        17,
        3,
        20,
    )


# ------------------------------------------------------------------------------------ F18


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_f18_caller_deadline_expiring_in_a_retry_after_wait_stops_without_a_new_attempt(
    stack: ServiceStack, stream: bool
) -> None:
    primary = stack.upstreams["primary"]
    primary.script(RateLimited(retry_after=2 * RETRY_AFTER), Ok("too late"))
    headers = {"x-chatroute-timeout": str(RETRY_AFTER)}  # ends half-way through the wait
    if stream:
        status, got, body = stream_raw(stack, "solo", headers=headers)
        error = body[0]["error"]
    else:
        with pytest.raises(openai.APIStatusError) as caught:
            stack.client.chat.completions.create(
                model="solo", messages=MESSAGES, extra_headers=headers
            )
        status, got = caught.value.status_code, dict(caught.value.response.headers)
        error = caught.value.body
    assert status == 504
    assert error["code"] == "deadline_exceeded"
    trace = stack.wait_traces(1)[0]
    assert trace.cancelled == "deadline"
    assert [(r.provider, r.failure_kind) for r in trace.attempts] == [("primary", "rate_limited")]
    time.sleep(2 * RETRY_AFTER)  # past the Retry-After: still nothing more was attempted
    assert primary.attempts == 1 and primary.pending == 1
    assert got["x-chatroute-attempts"] == "1"
    assert stack.service.engine.breakers.get("primary").snapshot().failures == 1  # the 429


def test_f18_deadline_in_a_retry_backoff_wait_stops_without_a_new_attempt(
    stack: ServiceStack,
) -> None:
    primary = stack.upstreams["primary"]
    primary.script(ServerError(), Ok("too late"))
    with pytest.raises(openai.APIStatusError) as caught:
        stack.client.chat.completions.create(
            model="backoff", messages=MESSAGES, extra_headers={"x-chatroute-timeout": "0.3"}
        )
    assert caught.value.status_code == 504
    time.sleep(BACKOFF)  # past the backoff: still nothing more was attempted
    assert primary.attempts == 1


def test_f18_route_deadline_during_an_attempt_cancels_it_without_blaming_the_provider(
    stack: ServiceStack,
) -> None:
    primary = stack.upstreams["primary"]
    primary.script(Hang())
    status, _, body = stream_raw(stack, "slow")  # deadline 0.5 s, first-token limit 5 s
    assert status == 504 and body[0]["error"]["code"] == "deadline_exceeded"
    primary.wait_for_disconnect(0, timeout=2)
    trace = stack.wait_traces(1)[0]
    assert [(r.provider, r.outcome) for r in trace.attempts] == [("primary", "cancelled")]
    assert stack.attempts()["fallback"] == 0
    assert stack.service.engine.breakers.get("primary").snapshot().failures == 0


def test_deadline_after_output_ends_the_stream_with_an_in_band_error(
    stack: ServiceStack,
) -> None:
    primary = stack.upstreams["primary"]
    primary.script(Ok(" ".join(f"w{i}" for i in range(40)), chunk_delay=0.05))
    status, _, events = stream_raw(stack, "slow")  # deadline 0.5 s: the stream needs 2 s
    assert status == 200
    assert "[DONE]" not in events
    assert events[-1]["error"]["code"] == "deadline_exceeded"
    assert 0 < len(content_of(events[:-1]).split()) < 40
    primary.wait_for_disconnect(0, timeout=2)
    trace = stack.wait_traces(1)[0]
    assert trace.cancelled == "deadline" and trace.committed and trace.status == 504
    assert [(r.provider, r.outcome) for r in trace.attempts] == [("primary", "cancelled")]
    assert stack.attempts()["fallback"] == 0
    assert stack.service.engine.breakers.get("primary").snapshot().failures == 0


def test_caller_timeout_header_is_checked(stack: ServiceStack) -> None:
    for bad in ("0", "-1", "soon", "nan", "inf"):
        r = stack.http.post(
            "/v1/chat/completions",
            json={"model": "chain", "messages": MESSAGES},
            headers={"x-chatroute-timeout": bad},
        )
        assert r.status_code == 400, bad
        assert r.json()["error"]["param"] == "x-chatroute-timeout"
    assert stack.attempts()["primary"] == 0


def test_every_provider_failing_answers_the_last_failure_each_tried_once(
    stack: ServiceStack,
) -> None:
    primary = stack.upstreams["primary"]
    primary.script(Status(500))
    stack.upstreams["fallback"].script(Status(500))
    with pytest.raises(openai.APIStatusError) as caught:
        chat(stack, "chain")
    assert caught.value.status_code == 502
    assert stack.attempts() == {"primary": 1, "fallback": 1, "big": 0}
