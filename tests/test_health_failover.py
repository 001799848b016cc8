"""HealthAwareFailoverChatClient: selection, breaker feedback, error classes, waits, deadline."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from chatroute.chat import (
    ChatClient,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    TextContent,
)
from chatroute.errors import (
    ContextLengthExceededError,
    ProviderAuthError,
    ProviderBadRequestError,
    ProviderConnectionError,
    ProviderServerError,
    RateLimitedError,
    StreamInterruptedError,
)
from chatroute.failover import FailoverChatClientAttempt
from chatroute.failover.breaker import BreakerSettings, BreakerState, CircuitBreakerRegistry
from chatroute.failover.health import HealthAwareFailoverChatClient, Selection
from chatroute.failover.timeouts import DeadlineExceededError, TimeoutChatClient
from chatroute.router import RoutingContext

MESSAGES = [ChatMessage(ChatRole.USER, "hi")]
HANG = "hang"


class Clock:
    """The router's clock and sleep: time moves only when a test (or a fake call) moves it."""

    def __init__(self) -> None:
        self.now = 50.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def server_error() -> ProviderServerError:
    return ProviderServerError("HTTP 500", status_code=500, provider="x")


class Provider(ChatClient):
    """A scripted provider: each call takes the next step (the last one repeats).

    A step is a text to answer, an exception (or a factory of one) to raise, HANG to wait
    until cancelled, or an ("advance", seconds, step) tuple that moves the clock first.
    """

    def __init__(self, name: str, *script: Any, clock: Clock | None = None) -> None:
        self.name = name
        self.script = list(script) or ["ok"]
        self.clock = clock
        self.calls = 0
        self.closed = 0
        self.streams_closed = 0

    def _step(self) -> Any:
        step = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        return step

    async def _run(self, step: Any) -> str:
        if isinstance(step, tuple) and step[0] == "advance":
            assert self.clock is not None
            self.clock.advance(step[1])
            step = step[2]
        if step == HANG:
            await asyncio.Event().wait()
        if isinstance(step, BaseException):
            raise step
        if callable(step):
            raise step()
        return f"{self.name}:{step}"

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        text = await self._run(self._step())
        return ChatResponse(messages=[ChatMessage(ChatRole.ASSISTANT, text)])

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        step = self._step()
        try:
            if isinstance(step, list):  # a list scripts the stream item by item
                for part in step:
                    text = await self._run(part)
                    yield ChatResponseUpdate(contents=[TextContent(text)])
            else:
                text = await self._run(step)
                yield ChatResponseUpdate(contents=[TextContent(text)])
        finally:
            self.streams_closed += 1

    async def aclose(self) -> None:
        self.closed += 1


class Recording(HealthAwareFailoverChatClient):
    """Records each selection (with its forced-probe flag) and each update."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.selections: list[Selection] = []
        self.updates: list[tuple[FailoverChatClientAttempt, bool]] = []
        self.contexts: list[weakref.ref[RoutingContext]] = []

    async def select_client(self, context: RoutingContext) -> ChatClient:
        client = await super().select_client(context)
        selection = self.current_selection(context)
        assert selection is not None
        self.selections.append(selection)
        self.contexts.append(weakref.ref(context))
        return client

    async def on_routing_update(
        self, context: RoutingContext, attempt: FailoverChatClientAttempt, is_terminal: bool
    ) -> None:
        self.updates.append((attempt, is_terminal))
        await super().on_routing_update(context, attempt, is_terminal)

    @property
    def chosen(self) -> list[str]:
        return [s.provider for s in self.selections]


def router(
    *providers: ChatClient, clock: Clock, minimum: int = 2, cool_down: float = 10.0, **kwargs: Any
) -> Recording:
    kwargs.setdefault(
        "breaker_settings",
        BreakerSettings(
            failure_rate_threshold=0.5, minimum_requests=minimum, window=60.0, cool_down=cool_down
        ),
    )
    return Recording(list(providers), clock=clock, sleep=clock.sleep, **kwargs)


async def text_of(r: HealthAwareFailoverChatClient) -> str:
    return (await r.get_response(MESSAGES)).text


async def stream_text(r: HealthAwareFailoverChatClient) -> list[str]:
    return [u.text async for u in r.get_streaming_response(MESSAGES)]


# ----------------------------------------------------------------------------- selection


async def test_fails_over_in_order_and_feeds_the_breakers() -> None:
    clock = Clock()
    a, b = Provider("a", server_error), Provider("b")
    r = router(a, b, clock=clock)
    assert await text_of(r) == "b:ok"
    assert r.chosen == ["a", "b"]
    assert [terminal for _, terminal in r.updates] == [False, True]
    assert r.breakers["a"].snapshot().failures == 1
    assert r.breakers["b"].snapshot().successes == 1
    assert r.active_requests() == 0


async def test_a_provider_is_tried_once_per_request_and_exhaustion_raises_the_last_failure() -> (
    None
):
    clock = Clock()
    last = ProviderConnectionError("refused")
    a, b = Provider("a", server_error), Provider("b", last)
    r = router(a, Provider("a-again", server_error), b, clock=clock, names=["a", "a", "b"])
    with pytest.raises(ProviderConnectionError) as info:
        await text_of(r)
    assert info.value is last
    assert (a.calls, b.calls) == (1, 1)
    assert r.active_requests() == 0


async def test_retry_same_client_retries_a_transient_failure() -> None:
    clock = Clock()
    a = Provider("a", server_error, "ok")
    r = router(a, clock=clock, retry_same_client=True, retry_backoff=0.25)
    assert await text_of(r) == "a:ok"
    assert a.calls == 2
    assert clock.slept == [0.25]


async def test_retry_same_client_goes_round_the_list_least_tried_first() -> None:
    clock = Clock()
    a, b = Provider("a", server_error), Provider("b", server_error)
    r = router(a, b, clock=clock, retry_same_client=True, max_tries_per_client=2, minimum=10)
    with pytest.raises(ProviderServerError):
        await text_of(r)
    assert r.chosen == ["a", "b", "a", "b"]


async def test_the_attempt_budget_bounds_retries_and_fallbacks_together() -> None:
    clock = Clock()
    a, b, c = (Provider(n, server_error) for n in "abc")
    r = router(
        a, b, c, clock=clock, retry_same_client=True, maximum_attempts_per_request=2, minimum=10
    )
    with pytest.raises(ProviderServerError):
        await text_of(r)
    assert (a.calls, b.calls, c.calls) == (1, 1, 0)
    assert r.updates[-1][1] is True
    assert r.active_requests() == 0


async def test_open_providers_are_skipped() -> None:
    clock = Clock()
    a, b = Provider("a"), Provider("b")
    r = router(a, b, clock=clock)
    r.breakers["a"].trip()
    assert await text_of(r) == "b:ok"
    assert a.calls == 0
    assert r.selections[0].forced_probe is False


async def test_when_every_candidate_is_open_one_forced_probe_is_made() -> None:
    clock = Clock()
    first = server_error()
    a, b = Provider("a", first), Provider("b", server_error)
    r = router(a, b, clock=clock)
    r.breakers["a"].trip()
    r.breakers["b"].trip()
    with pytest.raises(ProviderServerError) as info:
        await text_of(r)
    assert info.value is first
    assert (a.calls, b.calls) == (1, 0)  # one probe, not one per candidate
    assert r.selections[0].forced_probe is True
    assert r.breakers["a"].state is BreakerState.OPEN
    assert r.active_requests() == 0


async def test_a_successful_forced_probe_closes_the_breaker() -> None:
    clock = Clock()
    a, b = Provider("a"), Provider("b")
    r = router(a, b, clock=clock)
    r.breakers["a"].trip()
    r.breakers["b"].trip()
    assert await text_of(r) == "a:ok"
    assert r.selections[0].forced_probe
    assert r.breakers["a"].state is BreakerState.CLOSED
    assert r.breakers["b"].state is BreakerState.OPEN


async def test_half_open_lets_one_probe_through_while_others_use_the_fallback() -> None:
    clock = Clock()
    gate = asyncio.Event()

    class Slow(Provider):
        async def get_response(
            self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
        ) -> ChatResponse:
            self.calls += 1
            await gate.wait()
            return ChatResponse(messages=[ChatMessage(ChatRole.ASSISTANT, "a:ok")])

    a, b = Slow("a"), Provider("b")
    r = router(a, b, clock=clock, cool_down=10.0)
    r.breakers["a"].trip()
    clock.advance(10.0)
    probe_request = asyncio.create_task(text_of(r))
    await asyncio.sleep(0)
    assert r.breakers["a"].probe_in_flight
    assert [await text_of(r) for _ in range(3)] == ["b:ok"] * 3
    assert a.calls == 1
    gate.set()
    assert await probe_request == "a:ok"
    assert r.selections[0].probe is True
    assert r.breakers["a"].state is BreakerState.CLOSED
    assert await text_of(r) == "a:ok"


# ----------------------------------------------------------------------------- cancellation


async def test_caller_cancellation_is_not_counted_against_the_provider() -> None:
    clock = Clock()
    a, b = Provider("a", HANG), Provider("b")
    r = router(a, b, clock=clock, minimum=1)
    task = asyncio.create_task(text_of(r))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b.calls == 0
    snap = r.breakers["a"].snapshot()
    assert (snap.state, snap.total) == (BreakerState.CLOSED, 0)
    assert r.updates[-1][1] is True
    assert r.active_requests() == 0


async def test_any_failure_while_the_caller_cancels_is_not_counted() -> None:
    clock = Clock()

    class Translating(Provider):
        """Turns the caller's cancellation into its own error, as an SDK might."""

        async def get_response(
            self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
        ) -> ChatResponse:
            self.calls += 1
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise ProviderConnectionError("connection closed") from None
            raise AssertionError("unreachable")

    a, b = Translating("a"), Provider("b")
    r = router(a, b, clock=clock, minimum=1)
    task = asyncio.create_task(text_of(r))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert isinstance(r.updates[-1][0].exception, ProviderConnectionError)
    assert b.calls == 0
    assert r.breakers["a"].snapshot().total == 0
    assert r.breakers["a"].state is BreakerState.CLOSED


async def test_cancelling_a_probe_frees_the_probe_slot() -> None:
    clock = Clock()
    a, b = Provider("a", HANG, "ok"), Provider("b")
    r = router(a, b, clock=clock)
    r.breakers["a"].trip()
    clock.advance(10.0)
    task = asyncio.create_task(text_of(r))
    await asyncio.sleep(0)
    assert r.breakers["a"].probe_in_flight
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not r.breakers["a"].probe_in_flight
    assert r.breakers["a"].state is BreakerState.HALF_OPEN
    assert await text_of(r) == "a:ok"  # the next request probes and closes it
    assert r.breakers["a"].state is BreakerState.CLOSED


async def test_cancellation_during_a_retry_after_wait_releases_the_request() -> None:
    clock = Clock()
    a = Provider("a", RateLimitedError("429", status_code=429, retry_after=1.0))
    waiting = asyncio.Event()

    async def sleep_forever(seconds: float) -> None:
        waiting.set()
        await asyncio.Event().wait()

    r = Recording([a], clock=clock, sleep=sleep_forever)
    task = asyncio.create_task(text_of(r))
    await asyncio.wait(
        [task, asyncio.create_task(waiting.wait())],
        timeout=5.0,
        return_when=asyncio.FIRST_COMPLETED,
    )
    assert waiting.is_set() and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert a.calls == 1  # no new attempt
    assert r.active_requests() == 0


async def test_a_cancelled_error_raised_by_the_provider_fails_over_without_counting() -> None:
    clock = Clock()
    a, b = Provider("a", asyncio.CancelledError), Provider("b")
    r = router(a, b, clock=clock, minimum=1)
    assert await text_of(r) == "b:ok"
    assert r.breakers["a"].snapshot().total == 0


# ----------------------------------------------------------------------------- error classes


async def test_other_4xx_is_returned_as_is_without_failover() -> None:
    clock = Clock()
    bad = ProviderBadRequestError("content policy", status_code=400)
    a, b = Provider("a", bad), Provider("b")
    r = router(a, b, clock=clock, minimum=1)
    with pytest.raises(ProviderBadRequestError) as info:
        await text_of(r)
    assert info.value is bad
    assert b.calls == 0
    assert r.breakers["a"].snapshot().total == 0  # the caller's problem, not the provider's
    assert r.active_requests() == 0


@pytest.mark.parametrize("status", [401, 403, 404])
async def test_auth_errors_fail_over_and_mark_the_provider_unhealthy(status: int) -> None:
    clock = Clock()
    a = Provider("a", ProviderAuthError(f"HTTP {status}", status_code=status))
    b = Provider("b")
    r = router(a, b, clock=clock, minimum=100)
    assert await text_of(r) == "b:ok"
    assert r.breakers["a"].state is BreakerState.OPEN
    assert await text_of(r) == "b:ok"
    assert a.calls == 1


def context_error() -> ContextLengthExceededError:
    return ContextLengthExceededError("too long", status_code=400)


async def test_context_length_fails_over_only_to_a_larger_window() -> None:
    clock = Clock()
    a, b, c = Provider("a", context_error), Provider("b"), Provider("c")
    r = router(a, b, c, clock=clock, context_windows={"a": 8000, "b": 8000, "c": 128000})
    assert await text_of(r) == "c:ok"
    assert r.chosen == ["a", "c"]
    assert r.breakers["a"].snapshot().total == 0


async def test_context_length_with_no_larger_window_returns_the_error() -> None:
    clock = Clock()
    error = context_error()
    a, b = Provider("a", error), Provider("b")
    r = router(a, b, clock=clock, context_windows={"a": 32000, "b": 8000})
    with pytest.raises(ContextLengthExceededError) as info:
        await text_of(r)
    assert info.value is error
    assert b.calls == 0
    assert r.active_requests() == 0


async def test_context_length_with_an_unknown_window_stops() -> None:
    clock = Clock()
    a, b = Provider("a", context_error), Provider("b")
    r = router(a, b, clock=clock, context_windows={"b": 128000})
    with pytest.raises(ContextLengthExceededError):
        await text_of(r)
    assert b.calls == 0


async def test_context_windows_are_read_from_the_clients() -> None:
    clock = Clock()
    a, b = Provider("a", context_error), Provider("b")
    a.context_window = 4000  # type: ignore[attr-defined]
    b.context_window = 16000  # type: ignore[attr-defined]
    r = router(a, b, clock=clock)
    assert await text_of(r) == "b:ok"


# ----------------------------------------------------------------------------- Retry-After


def rate_limited(seconds: float | None) -> RateLimitedError:
    return RateLimitedError("429", status_code=429, retry_after=seconds)


async def test_retry_after_is_honoured_when_it_fits_the_deadline() -> None:
    clock = Clock()
    a = Provider("a", rate_limited(1.0), "ok")
    r = router(a, clock=clock, request_deadline=10.0)
    assert await text_of(r) == "a:ok"
    assert clock.slept == [1.0]
    assert r.selections[1].waited == pytest.approx(1.0)


async def test_retry_after_beyond_the_deadline_fails_at_once() -> None:
    clock = Clock()
    error = rate_limited(5.0)
    a = Provider("a", error, "ok")
    r = router(a, clock=clock, request_deadline=2.0)
    with pytest.raises(RateLimitedError) as info:
        await text_of(r)
    assert info.value is error
    assert clock.slept == []
    assert a.calls == 1


async def test_retry_after_above_the_maximum_is_not_honoured_even_with_retries() -> None:
    clock = Clock()
    a, b = Provider("a", rate_limited(30.0), "ok"), Provider("b", server_error)
    r = router(a, b, clock=clock, retry_same_client=True, retry_after_max=5.0, minimum=10)
    with pytest.raises(ProviderServerError):
        await text_of(r)
    assert r.chosen == ["a", "b", "b"]
    assert clock.slept == []


async def test_a_rate_limited_provider_is_not_waited_for_when_another_is_ready() -> None:
    clock = Clock()
    a, b = Provider("a", rate_limited(1.0)), Provider("b")
    r = router(a, b, clock=clock, request_deadline=10.0)
    assert await text_of(r) == "b:ok"
    assert clock.slept == []


async def test_429_without_retry_after_fails_over() -> None:
    clock = Clock()
    a, b = Provider("a", rate_limited(None)), Provider("b", rate_limited(None))
    r = router(a, b, clock=clock)
    with pytest.raises(RateLimitedError):
        await text_of(r)
    assert (a.calls, b.calls) == (1, 1)
    assert clock.slept == []


# ----------------------------------------------------------------------------- deadline


async def test_the_deadline_stops_before_a_new_attempt() -> None:
    clock = Clock()
    slow_failure = server_error()
    a = Provider("a", ("advance", 3.0, slow_failure), clock=clock)
    b = Provider("b")
    r = router(a, b, clock=clock, request_deadline=2.0)
    with pytest.raises(DeadlineExceededError) as info:
        await text_of(r)
    assert isinstance(info.value, TimeoutError)
    assert info.value.__cause__ is slow_failure
    assert b.calls == 0
    assert r.active_requests() == 0


async def test_time_left_allows_the_next_attempt() -> None:
    clock = Clock()
    a = Provider("a", ("advance", 1.0, server_error()), clock=clock)
    r = router(a, Provider("b"), clock=clock, request_deadline=2.0)
    assert await text_of(r) == "b:ok"


# ----------------------------------------------------------------------------- F15


async def test_flapping_primary_opens_then_is_used_again_after_a_successful_probe() -> None:
    clock = Clock()
    healthy = {"up": False}

    def primary_step() -> BaseException:
        return server_error()

    class Flapping(Provider):
        async def get_response(
            self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
        ) -> ChatResponse:
            self.calls += 1
            if not healthy["up"]:
                raise primary_step()
            return ChatResponse(messages=[ChatMessage(ChatRole.ASSISTANT, "primary:ok")])

    primary, fallback = Flapping("primary"), Provider("fallback")
    transitions: list[tuple[str, BreakerState, BreakerState]] = []
    registry = CircuitBreakerRegistry(
        BreakerSettings(minimum_requests=3, failure_rate_threshold=0.5, cool_down=30.0),
        clock=clock,
    )
    registry.add_listener(lambda n, old, new: transitions.append((n, old, new)))
    r = Recording([primary, fallback], breaker_factory=registry.get, clock=clock, sleep=clock.sleep)

    served = [await text_of(r) for _ in range(6)]
    assert served == ["fallback:ok"] * 6
    assert primary.calls == 3  # the breaker opened after three failures
    assert registry.get("primary").state is BreakerState.OPEN

    healthy["up"] = True
    clock.advance(10.0)
    assert await text_of(r) == "fallback:ok"  # still cooling down
    clock.advance(20.0)
    assert await text_of(r) == "primary:ok"  # the probe
    assert [await text_of(r) for _ in range(3)] == ["primary:ok"] * 3
    assert [(old, new) for _, old, new in transitions] == [
        (BreakerState.CLOSED, BreakerState.OPEN),
        (BreakerState.OPEN, BreakerState.HALF_OPEN),
        (BreakerState.HALF_OPEN, BreakerState.CLOSED),
    ]


# ----------------------------------------------------------------------------- streaming


async def test_streaming_fails_over_before_output() -> None:
    clock = Clock()
    a, b = Provider("a", server_error), Provider("b", ["x", "y"])
    r = router(a, b, clock=clock)
    assert await stream_text(r) == ["b:x", "b:y"]
    assert a.streams_closed == 1
    assert r.breakers["a"].snapshot().failures == 1
    assert r.breakers["b"].snapshot().successes == 1


async def test_a_failure_after_output_is_terminal_and_counted() -> None:
    clock = Clock()
    cut = StreamInterruptedError("cut", after_output=True)
    a, b = Provider("a", ["x", cut]), Provider("b")
    r = router(a, b, clock=clock)
    received: list[str] = []
    with pytest.raises(StreamInterruptedError) as info:
        async for item in r.get_streaming_response(MESSAGES):
            received.append(item.text)
    assert info.value is cut
    assert received == ["a:x"]
    assert b.calls == 0
    assert r.breakers["a"].snapshot().failures == 1
    assert r.active_requests() == 0


async def test_a_caller_that_stops_a_stream_does_not_count_against_the_provider() -> None:
    clock = Clock()
    a = Provider("a", ["x", "y", "z"])
    r = router(a, clock=clock, minimum=1)
    stream = r.get_streaming_response(MESSAGES)
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        assert (await anext(stream)).text == "a:x"
    assert a.streams_closed == 1
    snap = r.breakers["a"].snapshot()
    assert (snap.state, snap.failures) == (BreakerState.CLOSED, 0)
    assert r.active_requests() == 0


async def test_a_first_token_timeout_is_never_retried_on_the_same_provider() -> None:
    clock = Clock()
    silent = Provider("silent", HANG)
    other = Provider("other", server_error)
    r = router(
        TimeoutChatClient(silent, first_token_timeout=0.01),
        other,
        clock=clock,
        retry_same_client=True,
        max_tries_per_client=3,
        minimum=10,
    )
    with pytest.raises(ProviderServerError):
        await stream_text(r)
    assert r.chosen == ["silent", "other", "other", "other"]
    assert silent.calls == 1
    assert silent.streams_closed == 1


# ----------------------------------------------------------------------------- concurrency


async def test_concurrent_requests_have_independent_state_that_is_released() -> None:
    clock = Clock()
    counter = {"n": 0}

    class Alternating(Provider):
        async def get_response(
            self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
        ) -> ChatResponse:
            counter["n"] += 1
            turn = counter["n"]
            await asyncio.sleep(0)
            if turn % 2:
                raise server_error()
            return ChatResponse(messages=[ChatMessage(ChatRole.ASSISTANT, f"a:{messages[0].text}")])

    class Echo(Provider):
        async def get_response(
            self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
        ) -> ChatResponse:
            await asyncio.sleep(0)
            return ChatResponse(messages=[ChatMessage(ChatRole.ASSISTANT, f"b:{messages[0].text}")])

    r = router(Alternating("a"), Echo("b"), clock=clock, minimum=100_000)

    async def one(i: int) -> str:
        response = await r.get_response([ChatMessage(ChatRole.USER, str(i))])
        return response.text

    results = await asyncio.gather(*(one(i) for i in range(300)))
    assert [text.split(":")[1] for text in results] == [str(i) for i in range(300)]
    assert {text.split(":")[0] for text in results} == {"a", "b"}
    assert r.active_requests() == 0
    assert len(r.updates) == len(r.selections)
    # The recorded failures' tracebacks hold the finished frames (and so the contexts);
    # that is the test's state, not the router's.
    r.updates.clear()
    gc.collect()
    assert all(ref() is None for ref in r.contexts)


async def test_concurrent_streams_fail_over_independently() -> None:
    clock = Clock()
    turns = {"n": 0}

    class Flaky(Provider):
        async def get_streaming_response(  # type: ignore[override]
            self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
        ) -> AsyncIterator[ChatResponseUpdate]:
            turns["n"] += 1
            fails = turns["n"] % 3 == 0
            await asyncio.sleep(0)
            if fails:
                raise server_error()
            for part in ("1", "2"):
                await asyncio.sleep(0)
                yield ChatResponseUpdate(contents=[TextContent(f"a{messages[0].text}.{part}")])

    class Echo(Provider):
        async def get_streaming_response(  # type: ignore[override]
            self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
        ) -> AsyncIterator[ChatResponseUpdate]:
            for part in ("1", "2"):
                await asyncio.sleep(0)
                yield ChatResponseUpdate(contents=[TextContent(f"b{messages[0].text}.{part}")])

    r = router(Flaky("a"), Echo("b"), clock=clock, minimum=100_000)

    async def one(i: int) -> list[str]:
        stream = r.get_streaming_response([ChatMessage(ChatRole.USER, str(i))])
        return [u.text async for u in stream]

    results = await asyncio.gather(*(one(i) for i in range(150)))
    for i, items in enumerate(results):
        assert [item[1:] for item in items] == [f"{i}.1", f"{i}.2"]
        assert items[0][0] == items[1][0]  # one provider served the whole stream
    served_by_b = sum(items[0][0] == "b" for items in results)
    assert served_by_b == 50
    assert r.active_requests() == 0


async def test_abandoned_stream_state_is_collected() -> None:
    clock = Clock()
    a = Provider("a", ["x", "y"])
    r = router(a, clock=clock)
    stream = r.get_streaming_response(MESSAGES)
    await anext(stream)
    assert r.active_requests() == 1
    await stream.aclose()  # type: ignore[attr-defined]
    del stream
    gc.collect()
    assert r.active_requests() == 0
    assert all(ref() is None for ref in r.contexts)


# ----------------------------------------------------------------------------- configuration


async def test_routers_share_breakers_through_a_registry() -> None:
    clock = Clock()
    registry = CircuitBreakerRegistry(clock=clock)
    a = Provider("a")
    one = HealthAwareFailoverChatClient([a], breaker_factory=registry.get, clock=clock)
    two = HealthAwareFailoverChatClient([a, Provider("b")], breaker_factory=registry.get)
    assert one.breakers["a"] is two.breakers["a"] is registry.get("a")
    registry.get("a").trip()
    assert await text_of(two) == "b:ok"


def test_names_come_from_the_argument_or_the_client() -> None:
    a, b = Provider("a"), Provider("b")
    assert HealthAwareFailoverChatClient([a, b]).provider_names == ("a", "b")
    assert HealthAwareFailoverChatClient([a, b], names=["x", "y"]).provider_names == ("x", "y")
    mapped = HealthAwareFailoverChatClient([a, b, a], names={a: "first"})
    assert mapped.provider_names == ("first", "b", "first")
    assert mapped.provider_name(a) == "first"
    with pytest.raises(ValueError, match="not one of"):
        mapped.provider_name(Provider("z"))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"names": ["only-one"]}, ValueError),
        ({"names": "ab"}, TypeError),
        ({"names": [1, 2]}, TypeError),
        ({"retry_same_client": 1}, TypeError),
        ({"max_tries_per_client": 0}, ValueError),
        ({"max_tries_per_client": True}, TypeError),
        ({"retry_after_max": -1}, ValueError),
        ({"request_deadline": 0}, ValueError),
        ({"request_deadline": "5"}, TypeError),
        ({"context_windows": {"zzz": 10}}, ValueError),
        ({"context_windows": {"a": 0}}, ValueError),
        ({"context_windows": [1, 2]}, TypeError),
        ({"maximum_attempts_per_request": 0}, ValueError),
        ({"breaker_settings": BreakerSettings(), "breaker_factory": lambda n: None}, ValueError),
        ({"breaker_factory": lambda n: object()}, TypeError),
        ({"clock": 3}, TypeError),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        HealthAwareFailoverChatClient([Provider("a"), Provider("b")], **kwargs)


@pytest.mark.parametrize(
    ("clients", "error"),
    [(None, TypeError), ([], ValueError), ([None], ValueError), ([1], TypeError)],
)
def test_bad_client_lists_are_rejected(clients: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        HealthAwareFailoverChatClient(clients)


async def test_select_client_rejects_a_missing_context() -> None:
    with pytest.raises(TypeError):
        await HealthAwareFailoverChatClient([Provider("a")]).select_client(None)  # type: ignore[arg-type]


async def test_aclose_closes_each_distinct_client_once_unless_left_open() -> None:
    a, b = Provider("a"), Provider("b")
    r = HealthAwareFailoverChatClient([a, b, a])
    await r.aclose()
    await r.aclose()
    assert (a.closed, b.closed) == (1, 1)
    kept = Provider("k")
    await HealthAwareFailoverChatClient([kept], leave_open=True).aclose()
    assert kept.closed == 0


async def test_a_nonterminal_update_for_an_unknown_request_stops_routing() -> None:
    a = Provider("a")
    r = HealthAwareFailoverChatClient([a, Provider("b")])
    context = RoutingContext(MESSAGES, None)
    failure = server_error()
    attempt = FailoverChatClientAttempt(a, 0.0, None, failure, False, False)
    with pytest.raises(ProviderServerError) as info:
        await r.on_routing_update(context, attempt, False)
    assert info.value is failure
    assert r.current_selection(context) is None
    assert r.active_requests() == 0


async def test_a_selection_hook_that_raises_releases_the_request_state() -> None:
    class Failing(HealthAwareFailoverChatClient):
        def selected(self, selection: Selection) -> None:
            raise RuntimeError("hook failed")

    a = Provider("a")
    r = Failing([a], clock=Clock())
    with pytest.raises(RuntimeError, match="hook failed"):
        await r.get_response(MESSAGES)
    assert a.calls == 0
    context = RoutingContext(MESSAGES, None)  # alive: its state cannot go with it
    with pytest.raises(RuntimeError, match="hook failed"):
        await r.select_client(context)
    assert r.active_requests() == 0
    assert r.current_selection(context) is None
