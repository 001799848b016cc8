"""Tests of the streaming failover loop: commit point, cleanup, caller stops and timing (S, D)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from typing import Any

import pytest
from core_doubles import (
    FakeClient,
    FakeClock,
    FakeStream,
    RecordingRouter,
    always,
    cancel_then,
    collect,
    fail,
    in_order,
    messages,
    pause,
    raise_,
    run_in_child,
    stream,
    stream_call_fails,
    tick,
    update,
)

import chatroute.failover.base as failover_base
from chatroute.chat import ChatClient, ChatResponseUpdate
from chatroute.failover import FailoverChatClientAttempt, OrderedFailoverChatClient
from chatroute.router import RoutingContext

# Checklist rows 39 and 40 (Streaming_CurrentFailureFallsBackBeforeOutput and
# Streaming_CurrentFailureCancellationIsObservedByNextAttempt) are not applicable: Python
# async iterators have no `Current` getter (`__anext__` returns the item), so a failing
# first `__anext__` is rows 29/30 and the hook-cancellation path is row 31.


def streamer(name: str, *script: Any, **kwargs: Any) -> FakeClient:
    return FakeClient(name, streams=[stream(*script, **kwargs)])


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(failover_base, "perf_counter", fake)
    return fake


# ----------------------------------------------------------------------- checklist rows


async def test_streaming_pre_output_failure_propagates() -> None:  # row 29
    boom = RuntimeError("before output")
    client = streamer("c", raise_(boom))
    router = RecordingRouter(always(client), maximum_attempts_per_request=1)
    with pytest.raises(RuntimeError) as info:
        await collect(router.get_streaming_response(messages()))
    assert info.value is boom
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.exception is boom
    assert only.attempt.output_committed is False
    assert only.attempt.response_completed is False
    assert only.attempt.time_to_first_update is None


async def test_streaming_falls_back_before_first_update() -> None:  # row 30
    first = streamer("first", fail("first"))
    second = streamer("second", "ok")
    router = RecordingRouter(in_order(first, second))
    assert await collect(router.get_streaming_response(messages())) == ["ok"]
    assert len(router.selections) == 2
    assert first.made_streams[0].aclose_count == 1
    assert second.made_streams[0].aclose_count == 1
    assert router.terminal_flags == [False, True]


async def test_streaming_cancel_requested_in_hook_is_seen_by_next_attempt() -> None:  # row 31
    first = streamer("first", fail("first"))
    second = streamer("second", pause(), "never")

    def hook(_c: RoutingContext, _a: FailoverChatClientAttempt, is_terminal: bool) -> None:
        if not is_terminal:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()

    router = RecordingRouter(in_order(first, second), hook)
    outcome = await run_in_child(collect(router.get_streaming_response(messages())))
    assert isinstance(outcome.error, asyncio.CancelledError)
    assert len(router.selections) == 2
    assert router.terminal_flags == [False, True]
    assert first.made_streams[0].aclose_count == 1
    assert second.made_streams[0].aclose_count == 1
    assert router.updates[1].attempt.output_committed is False


async def test_streaming_failure_while_cancelling_does_not_select_next() -> None:  # row 32
    boom = RuntimeError("while cancelling")
    first = streamer("first", cancel_then(lambda: boom))
    second = streamer("second", "ok")
    router = RecordingRouter(in_order(first, second))
    outcome = await run_in_child(collect(router.get_streaming_response(messages())))
    assert isinstance(outcome.error, asyncio.CancelledError)
    assert outcome.error.__cause__ is boom
    assert len(router.selections) == 1
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.exception is boom
    assert only.attempt.output_committed is False
    assert only.attempt.response_completed is False
    assert second.all_calls == 0


async def test_streaming_provider_cancelled_error_fails_over() -> None:  # row 34 [Ordered]
    first = streamer("first", fail("provider", asyncio.CancelledError))
    second = streamer("second", "ok")
    router = OrderedFailoverChatClient([first, second])
    assert await collect(router.get_streaming_response(messages())) == ["ok"]
    assert first.made_streams[0].aclose_count == 1


async def test_streaming_aclose_cancelled_error_fails_over() -> None:  # row 35 [Ordered]
    first = streamer("first", aclose_error=lambda: asyncio.CancelledError("aclose"))
    second = streamer("second", "ok")
    router = OrderedFailoverChatClient([first, second])
    assert await collect(router.get_streaming_response(messages())) == ["ok"]
    assert first.made_streams[0].aclose_count == 1
    assert len(second.stream_calls) == 1


async def test_streaming_attempt_limit_reraises_last_failure() -> None:  # row 36
    failure2 = RuntimeError("failure 2")
    client = FakeClient("c", streams=[stream(fail("failure 1")), stream(raise_(failure2))])
    router = RecordingRouter(always(client), maximum_attempts_per_request=2)
    with pytest.raises(RuntimeError) as info:
        await collect(router.get_streaming_response(messages()))
    assert info.value is failure2
    assert router.terminal_flags == [False, True]
    assert [s.aclose_count for s in client.made_streams] == [1, 1]


async def test_streaming_call_failure_falls_back() -> None:  # row 37
    first = FakeClient("first", streams=[stream_call_fails(lambda: RuntimeError("call"))])
    second = streamer("second", "ok")
    router = RecordingRouter(in_order(first, second))
    assert await collect(router.get_streaming_response(messages())) == ["ok"]
    failed = router.updates[0]
    assert failed.is_terminal is False
    assert str(failed.attempt.exception) == "call"
    assert failed.attempt.output_committed is False


async def test_streaming_aiter_failure_falls_back() -> None:  # row 38
    first = streamer("first", "never", aiter_error=lambda: RuntimeError("aiter"))
    second = streamer("second", "ok")
    router = RecordingRouter(in_order(first, second))
    assert await collect(router.get_streaming_response(messages())) == ["ok"]
    failed = router.updates[0]
    assert failed.is_terminal is False
    assert str(failed.attempt.exception) == "aiter"
    assert first.made_streams[0].anext_count == 0
    # no iterator was obtained, so there was nothing to close
    assert first.made_streams[0].aclose_count == 0


async def test_streaming_empty_stream_aclose_failure_falls_back() -> None:  # row 41
    aclose_error = RuntimeError("aclose")
    first = streamer("first", aclose_error=lambda: aclose_error)
    second = streamer("second", "ok")
    router = RecordingRouter(in_order(first, second))
    assert await collect(router.get_streaming_response(messages())) == ["ok"]
    failed, done = router.updates
    assert failed.is_terminal is False
    assert failed.attempt.exception is aclose_error
    assert failed.attempt.output_committed is False
    assert failed.attempt.response_completed is False
    assert done.is_terminal is True
    assert done.attempt.response_completed is True
    assert first.made_streams[0].aclose_count == 1


async def test_streaming_mid_stream_failure_is_terminal() -> None:  # row 42
    mid = RuntimeError("mid-stream")
    client = streamer("c", "first", raise_(mid))
    second = streamer("second", "never")
    router = RecordingRouter(in_order(client, second))
    received: list[ChatResponseUpdate] = []
    with pytest.raises(RuntimeError) as info:
        async for item in router.get_streaming_response(messages()):
            received.append(item)
    assert info.value is mid
    assert [r.text for r in received] == ["first"]
    assert received[0] is client.made_streams[0].produced[0]
    assert len(router.selections) == 1
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.output_committed is True
    assert only.attempt.response_completed is False
    assert only.attempt.time_to_first_update is not None
    assert only.attempt.duration >= only.attempt.time_to_first_update
    assert client.made_streams[0].aclose_count == 1
    assert second.all_calls == 0


async def test_streaming_completion_notifies_hook() -> None:  # row 43
    client = streamer("c", "a", "b")
    router = RecordingRouter(always(client))
    assert await collect(router.get_streaming_response(messages())) == ["a", "b"]
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.exception is None
    assert only.attempt.output_committed is True
    assert only.attempt.response_completed is True
    assert only.attempt.time_to_first_update is not None


async def test_streaming_empty_completion_notifies_hook() -> None:  # row 44
    client = streamer("c")
    router = RecordingRouter(always(client))
    assert await collect(router.get_streaming_response(messages())) == []
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.exception is None
    assert only.attempt.output_committed is False
    assert only.attempt.response_completed is True
    assert only.attempt.time_to_first_update is None


async def test_streaming_caller_aclose_reports_incomplete() -> None:  # row 45
    client = streamer("c", "a", "b", "c")
    router = RecordingRouter(always(client))
    gen = router.get_streaming_response(messages())
    assert (await anext(gen)).text == "a"
    await gen.aclose()
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.exception is None
    assert only.attempt.output_committed is True
    assert only.attempt.response_completed is False
    assert client.made_streams[0].aclose_count == 1


# ------------------------------------------------------------ section 3.1 and other S rules


async def test_streaming_aclose_failure_after_complete_stream() -> None:  # S11
    aclose_error = RuntimeError("aclose after end")
    client = streamer("c", "a", "b", aclose_error=lambda: aclose_error)
    second = streamer("second", "never")
    router = RecordingRouter(in_order(client, second))
    gen = router.get_streaming_response(messages())
    assert (await anext(gen)).text == "a"
    assert (await anext(gen)).text == "b"
    assert router.updates == []
    with pytest.raises(RuntimeError) as info:
        await anext(gen)
    assert info.value is aclose_error
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.exception is aclose_error
    assert only.attempt.output_committed is True
    assert only.attempt.response_completed is False
    assert second.all_calls == 0


async def test_caller_aclose_really_closes_inner_generator() -> None:  # S7
    closed: list[str] = []

    class GeneratorClient(FakeClient):
        def get_streaming_response(self, messages: Any, options: Any = None) -> Any:
            async def inner() -> AsyncIterator[ChatResponseUpdate]:
                try:
                    for text in ("a", "b", "c"):
                        yield update(text)
                finally:
                    closed.append("closed")

            return inner()

    client = GeneratorClient("gen")
    router = RecordingRouter(always(client))
    async with contextlib.aclosing(router.get_streaming_response(messages())) as gen:
        async for item in gen:
            assert item.text == "a"
            break
        assert closed == []
    assert closed == ["closed"]
    (only,) = router.updates
    assert only.is_terminal and only.attempt.output_committed
    assert not only.attempt.response_completed


async def test_caller_aclose_before_first_anext_does_nothing() -> None:  # S7
    client = streamer("c", "a")
    router = RecordingRouter(always(client))
    gen = router.get_streaming_response(messages())
    await gen.aclose()
    assert router.selections == []
    assert router.updates == []
    assert client.all_calls == 0


async def test_caller_aclose_propagates_inner_aclose_failure() -> None:  # S7
    aclose_error = RuntimeError("inner aclose")
    client = streamer("c", "a", "b", aclose_error=lambda: aclose_error)
    router = RecordingRouter(always(client))
    gen = router.get_streaming_response(messages())
    await anext(gen)
    with pytest.raises(RuntimeError) as info:
        await gen.aclose()
    assert info.value is aclose_error
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.exception is aclose_error
    assert only.attempt.output_committed is True


async def test_abandoned_generator_is_reported_after_finalisation() -> None:  # S8
    client = streamer("c", "a", "b")
    router = RecordingRouter(always(client))
    gen = router.get_streaming_response(messages())
    async for item in gen:
        assert item.text == "a"
        break  # no aclosing: the generator is abandoned
    assert router.updates == []
    del gen, item
    gc.collect()
    for _ in range(10):
        await asyncio.sleep(0)
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.exception is None
    assert only.attempt.output_committed is True
    assert only.attempt.response_completed is False
    assert client.made_streams[0].aclose_count == 1


def test_abandoned_generator_is_reported_at_loop_shutdown() -> None:  # S8
    client = streamer("c", "a", "b")
    router = RecordingRouter(always(client))
    kept: list[Any] = []

    async def main() -> None:
        gen = router.get_streaming_response(messages())
        kept.append(gen)  # still alive when the loop shuts down
        await anext(gen)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
        assert router.updates == []
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
    (only,) = router.updates
    assert only.is_terminal and only.attempt.output_committed
    assert only.attempt.exception is None
    assert client.made_streams[0].aclose_count == 1


async def test_mid_stream_failure_keeps_items_already_received() -> None:  # S5
    mid = ConnectionError("cut")
    client = streamer("c", "one", "two", "three", raise_(mid))
    second = streamer("second", "replayed?")
    router = RecordingRouter(in_order(client, second), maximum_attempts_per_request=5)
    received: list[str] = []
    with pytest.raises(ConnectionError) as info:
        async for item in router.get_streaming_response(messages()):
            received.append(item.text)
    assert info.value is mid
    assert received == ["one", "two", "three"]
    assert second.all_calls == 0
    assert router.terminal_flags == [True]


async def test_athrow_at_yield_is_reported_and_reraised() -> None:  # S9
    client = streamer("c", "a", "b")
    router = RecordingRouter(always(client))
    gen = router.get_streaming_response(messages())
    await anext(gen)
    thrown = ValueError("thrown by caller")
    with pytest.raises(ValueError) as info:
        await gen.athrow(thrown)
    assert info.value is thrown
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.exception is thrown
    assert only.attempt.output_committed is True
    assert client.made_streams[0].aclose_count == 1


async def test_asend_values_are_ignored() -> None:  # S9
    client = streamer("c", "a", "b")
    router = RecordingRouter(always(client))
    gen = router.get_streaming_response(messages())
    assert (await gen.asend(None)).text == "a"
    assert (await gen.asend("ignored")).text == "b"
    with pytest.raises(StopAsyncIteration):
        await gen.asend("ignored")
    assert router.terminal_flags == [True]


async def test_stream_end_is_reported_before_caller_sees_it() -> None:  # S10
    events: list[str] = []

    async def hook(_c: RoutingContext, a: FailoverChatClientAttempt, _t: bool) -> None:
        await asyncio.sleep(0)
        events.append("update")

    class Ordered(FakeStream):
        async def aclose(self) -> None:
            events.append("aclose")
            await super().aclose()

    client = FakeClient("c", streams=[lambda: Ordered("a", aclose_step=pause())])
    router = RecordingRouter(always(client), hook)
    gen = router.get_streaming_response(messages())
    await anext(gen)
    with pytest.raises(StopAsyncIteration):
        await anext(gen)
    events.append("caller saw the end")
    assert events == ["aclose", "update", "caller saw the end"]


async def test_streaming_terminal_hook_failure_replaces_completion() -> None:  # H4
    hook_error = LookupError("hook")

    def hook(_c: RoutingContext, _a: FailoverChatClientAttempt, is_terminal: bool) -> None:
        raise hook_error

    router = RecordingRouter(always(streamer("c", "a")), hook)
    received: list[str] = []
    with pytest.raises(LookupError) as info:
        async for item in router.get_streaming_response(messages()):
            received.append(item.text)
    assert info.value is hook_error
    assert received == ["a"]


async def test_caller_cancelled_mid_stream_after_output() -> None:  # S11
    client = streamer("c", "a", pause(1000), "b")
    router = RecordingRouter(always(client))
    got: list[str] = []

    async def consume() -> None:
        async for item in router.get_streaming_response(messages()):
            got.append(item.text)

    task = asyncio.ensure_future(consume())
    for _ in range(5):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()
    assert got == ["a"]
    (only,) = router.updates
    assert only.is_terminal is True
    assert isinstance(only.attempt.exception, asyncio.CancelledError)
    assert only.attempt.output_committed is True
    assert client.made_streams[0].aclose_count == 1


async def test_streaming_duration_is_active_time_only(clock: FakeClock) -> None:  # D2, D3
    first = FakeClient("first", streams=[stream(tick(clock, 3.0), fail("pre-output"))])
    second = FakeClient(
        "second",
        streams=[
            stream(
                tick(clock, 1.0),
                "a",
                tick(clock, 0.5),
                "b",
                tick(clock, 0.25),
                aclose_step=tick(clock, 7.0),  # closing is not active time
            )
        ],
    )
    picks = iter([first, second])

    async def selector(_context: RoutingContext) -> ChatClient:
        clock.advance(100.0)  # selection is not active time
        return next(picks)

    def hook(_c: RoutingContext, _a: FailoverChatClientAttempt, _t: bool) -> None:
        clock.advance(50.0)  # nor is the hook

    router = RecordingRouter(selector, hook)
    async for _item in router.get_streaming_response(messages()):
        clock.advance(10.0)  # the caller's time between items is not active time
    failed, done = (u.attempt for u in router.updates)
    assert failed.duration == 3.0
    assert failed.time_to_first_update is None
    assert done.time_to_first_update == 1.0
    assert done.duration == 1.75


async def test_empty_stream_has_no_time_to_first_update(clock: FakeClock) -> None:  # D3
    router = RecordingRouter(always(FakeClient("c", streams=[stream(tick(clock, 2.0))])))
    assert await collect(router.get_streaming_response(messages())) == []
    (only,) = router.updates
    assert only.attempt.duration == 2.0
    assert only.attempt.time_to_first_update is None


async def test_stream_and_aclose_both_fail_reports_aclose_failure() -> None:  # D4
    aclose_error = OSError("aclose")
    first = streamer("first", fail("anext"), aclose_error=lambda: aclose_error)
    second = streamer("second", "ok")
    router = RecordingRouter(in_order(first, second))
    assert await collect(router.get_streaming_response(messages())) == ["ok"]
    assert router.updates[0].attempt.exception is aclose_error
    assert router.updates[0].is_terminal is False


async def test_iterator_without_aclose_is_not_closed() -> None:  # 2.0 close convention
    class Bare:
        def __init__(self) -> None:
            self.items = ["x", "y"]

        def __aiter__(self) -> Bare:
            return self

        async def __anext__(self) -> ChatResponseUpdate:
            if not self.items:
                raise StopAsyncIteration
            return update(self.items.pop(0))

    client = FakeClient("bare", streams=[Bare])
    router = RecordingRouter(always(client))
    assert await collect(router.get_streaming_response(messages())) == ["x", "y"]
    assert router.updates[0].attempt.response_completed is True
