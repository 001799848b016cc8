"""Tests of FailoverChatClient: the attempt loop, hook semantics and cancellation (F, H, C, D)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import pytest
from core_doubles import (
    FakeClient,
    FakeClock,
    RecordingRouter,
    always,
    block_forever,
    cancel_then,
    chain,
    fail,
    in_order,
    messages,
    pause,
    raise_,
    respond,
    response,
    returns,
    run_in_child,
    stream,
    tick,
)

import chatroute.failover.base as failover_base
from chatroute.chat import ChatClient, ChatOptions
from chatroute.failover import (
    FailoverChatClient,
    FailoverChatClientAttempt,
    OrderedFailoverChatClient,
)
from chatroute.router import RoutingChatClient, RoutingContext

both = pytest.mark.parametrize("streaming", [False, True])


def failing_client(name: str, message: str = "failed") -> FakeClient:
    """A client that fails on both paths, before any output."""
    return FakeClient(name, fail(message), streams=[stream(fail(message))])


def ok_client(name: str = "ok", text: str = "ok") -> FakeClient:
    return FakeClient(name, returns(response(text)), streams=[stream(text)])


def text_of(result: Any) -> Any:
    """The text of a response, or the streamed texts unchanged."""
    return result if isinstance(result, list) else result.text


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(failover_base, "perf_counter", fake)
    return fake


# ----------------------------------------------------------------------- checklist rows


async def test_maximum_attempts_per_request_validates_value() -> None:  # row 9
    router = RecordingRouter(always(ok_client()))
    assert router.maximum_attempts_per_request is None
    router.maximum_attempts_per_request = 2
    assert router.maximum_attempts_per_request == 2
    router.maximum_attempts_per_request = None
    assert router.maximum_attempts_per_request is None
    router.maximum_attempts_per_request = 3
    for bad in (0, -1):
        with pytest.raises(ValueError):
            router.maximum_attempts_per_request = bad
        assert router.maximum_attempts_per_request == 3


async def test_failover_rejects_none_messages() -> None:  # row 10
    client = ok_client()
    router = RecordingRouter(always(client))
    with pytest.raises(TypeError):
        await router.get_response(None)  # type: ignore[arg-type]
    gen = router.get_streaming_response(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await anext(gen)
    assert router.selections == []
    assert client.all_calls == 0


@both
async def test_initial_selection_failure_does_not_report_attempt(streaming: bool) -> None:  # row 11
    boom = RuntimeError("selection")
    seen: list[Any] = []

    def selector(context: RoutingContext) -> ChatClient:
        seen.append(context)
        raise boom

    router = RecordingRouter(selector)
    with pytest.raises(RuntimeError) as info:
        await respond(router, streaming)
    assert info.value is boom
    assert len(seen) == 1
    assert isinstance(seen[0], RoutingContext)
    assert router.updates == []


@both
async def test_selection_failure_while_cancelling_is_not_rewritten(streaming: bool) -> None:  # 12
    boom = RuntimeError("selection while cancelling")

    def selector(_context: RoutingContext) -> ChatClient:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        raise boom

    router = RecordingRouter(selector)
    outcome = await run_in_child(respond(router, streaming))
    assert outcome.error is boom
    assert router.updates == []


@both
async def test_none_selection_does_not_report_attempt(streaming: bool) -> None:  # row 13
    router = RecordingRouter(lambda _context: None)
    with pytest.raises(RuntimeError, match="select_client"):
        await respond(router, streaming)
    assert router.updates == []


async def test_failed_reselection_reports_only_completed_attempt() -> None:  # row 14
    first = failing_client("first", "first failed")
    reselect = RuntimeError("reselect")
    picks = iter([first])

    def selector(_context: RoutingContext) -> ChatClient:
        for client in picks:
            return client
        raise reselect

    router = RecordingRouter(selector)
    with pytest.raises(RuntimeError) as info:
        await router.get_response(messages())
    assert info.value is reselect
    assert len(router.selections) == 2
    assert len(router.updates) == 1
    only = router.updates[0]
    assert only.is_terminal is False
    assert only.attempt.client is first
    assert isinstance(only.attempt.exception, RuntimeError)
    assert str(only.attempt.exception) == "first failed"


async def test_terminal_update_failure_replaces_request_failure() -> None:  # row 15
    hook_error = LookupError("hook")

    def hook(_c: RoutingContext, _a: FailoverChatClientAttempt, is_terminal: bool) -> None:
        assert is_terminal
        raise hook_error

    router = RecordingRouter(always(failing_client("bad")), hook, maximum_attempts_per_request=1)
    with pytest.raises(LookupError) as info:
        await router.get_response(messages())
    assert info.value is hook_error
    assert len(router.updates) == 1


async def test_nonterminal_update_failure_stops_routing() -> None:  # row 16
    boom = RuntimeError("client")
    hook_error = LookupError("hook")
    client = FakeClient("bad", raise_(boom))

    def hook(_c: RoutingContext, attempt: FailoverChatClientAttempt, is_terminal: bool) -> None:
        assert is_terminal is False
        assert attempt.exception is boom
        raise hook_error

    router = RecordingRouter(always(client), hook)
    with pytest.raises(LookupError) as info:
        await router.get_response(messages())
    assert info.value is hook_error
    assert len(router.selections) == 1
    assert len(router.updates) == 1


@both
async def test_every_attempt_gets_the_request_options(streaming: bool) -> None:  # row 18
    first = failing_client("first")
    second = ok_client("second", "ok")
    router = RecordingRouter(in_order(first, second))
    caller = ChatOptions(model_id="caller", temperature=0.7)
    result = await respond(router, streaming, options=caller)
    assert text_of(result) == (["ok"] if streaming else "ok")
    assert len(router.selections) == 2
    calls = (lambda c: c.stream_calls) if streaming else (lambda c: c.calls)
    (_, got1), (_, got2) = calls(first)[0], calls(second)[0]
    assert got1 is got2
    assert got1 is not caller
    assert got1 is router.selections[0].chat_options
    assert got1 is not None and got1.model_id == "caller" and got1.temperature == 0.7
    assert caller == ChatOptions(model_id="caller", temperature=0.7)


@both
async def test_selector_and_client_share_request_options(streaming: bool) -> None:  # row 19
    client = ok_client()

    def selector(context: RoutingContext) -> ChatClient:
        assert context.chat_options is not None
        context.chat_options.temperature = 0.25
        return client

    router = RecordingRouter(selector)
    caller = ChatOptions()
    await respond(router, streaming, options=caller)
    _, got = (client.stream_calls if streaming else client.calls)[0]
    assert got is router.selections[0].chat_options
    assert got is not None and got.temperature == 0.25
    assert caller.temperature is None


async def test_failure_propagates() -> None:  # row 20
    boom = RuntimeError("boom")
    client = FakeClient("bad", raise_(boom))
    router = RecordingRouter(always(client), maximum_attempts_per_request=1)
    with pytest.raises(RuntimeError) as info:
        await router.get_response(messages())
    assert info.value is boom
    assert len(router.updates) == 1
    update = router.updates[0]
    assert update.is_terminal is True
    assert update.attempt.client is client
    assert update.attempt.exception is boom
    assert update.attempt.response_completed is False


async def test_update_state_drives_next_selection() -> None:  # row 21
    failing = FakeClient("failing", fail("failed"))
    answer = response("working")
    working = FakeClient("working", returns(answer))
    state: dict[RoutingContext, bool] = {}
    seen: list[RoutingContext] = []

    def selector(context: RoutingContext) -> ChatClient:
        seen.append(context)
        return working if state.get(context) else failing

    def hook(context: RoutingContext, _a: FailoverChatClientAttempt, is_terminal: bool) -> None:
        seen.append(context)
        if not is_terminal:
            state[context] = True

    router = RecordingRouter(selector, hook)
    result = await router.get_response(messages())
    assert result is answer
    assert len(seen) == 4
    assert all(c is seen[0] for c in seen)
    failed, done = router.updates
    assert failed.is_terminal is False
    assert failed.attempt.client is failing
    assert str(failed.attempt.exception) == "failed"
    assert failed.attempt.duration >= 0
    assert failed.attempt.time_to_first_update is None
    assert failed.attempt.output_committed is False
    assert failed.attempt.response_completed is False
    assert done.is_terminal is True
    assert done.attempt.client is working
    assert done.attempt.exception is None
    assert done.attempt.response_completed is True


async def test_same_client_can_be_selected_again() -> None:  # row 22
    answer = response("second time")
    flaky = FakeClient("flaky", fail("transient"), returns(answer))
    router = RecordingRouter(always(flaky))
    assert await router.get_response(messages()) is answer
    assert len(flaky.calls) == 2
    assert router.terminal_flags == [False, True]


async def test_success_on_last_allowed_attempt_is_returned() -> None:  # row 23
    answer = response("ok")
    client = FakeClient("c", fail("first"), returns(answer))
    router = RecordingRouter(always(client), maximum_attempts_per_request=2)
    assert await router.get_response(messages()) is answer
    assert len(client.calls) == 2


async def test_attempt_limit_reraises_last_failure() -> None:  # row 24
    failure2 = RuntimeError("failure 2")
    client = FakeClient("c", fail("failure 1"), raise_(failure2))
    router = RecordingRouter(always(client), maximum_attempts_per_request=2)
    with pytest.raises(RuntimeError) as info:
        await router.get_response(messages())
    assert info.value is failure2
    assert router.terminal_flags == [False, True]


async def test_none_response_is_a_success() -> None:  # row 25
    client = FakeClient("none", returns(None))
    router = RecordingRouter(always(client))
    assert await router.get_response(messages()) is None
    assert len(router.selections) == 1
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.exception is None
    assert only.attempt.response_completed is True


async def test_failure_while_cancelling_reports_terminal_update() -> None:  # row 27
    boom = RuntimeError("while cancelling")
    client = FakeClient("c", cancel_then(lambda: boom))
    second = ok_client("second")
    router = RecordingRouter(in_order(client, second))
    outcome = await run_in_child(router.get_response(messages()))
    assert isinstance(outcome.error, asyncio.CancelledError)
    assert outcome.error.__cause__ is boom
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.exception is boom
    assert second.all_calls == 0


async def test_cancel_requested_in_hook_is_seen_by_next_attempt() -> None:  # row 28
    first = failing_client("first")
    second = FakeClient("second", chain(pause(), returns(response("never"))))

    def hook(_c: RoutingContext, _a: FailoverChatClientAttempt, is_terminal: bool) -> None:
        if not is_terminal:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()

    router = RecordingRouter(in_order(first, second), hook)
    outcome = await run_in_child(router.get_response(messages()))
    assert isinstance(outcome.error, asyncio.CancelledError)
    assert len(router.selections) == 2
    assert router.terminal_flags == [False, True]
    assert router.updates[1].attempt.client is second
    assert router.updates[1].attempt.exception is outcome.error


async def test_provider_cancelled_error_fails_over() -> None:  # row 33 [Ordered]
    answer = response("second")
    first = FakeClient("first", fail("provider cancelled", asyncio.CancelledError))
    second = FakeClient("second", returns(answer))
    router = OrderedFailoverChatClient([first, second])
    assert await router.get_response(messages()) is answer
    assert len(first.calls) == 1 and len(second.calls) == 1


# ------------------------------------------------------ section 3.1 and other rules (F, D, H, C)


async def test_maximum_attempts_per_request_type_checks() -> None:  # F0
    router = RecordingRouter(always(ok_client()))
    router.maximum_attempts_per_request = 4
    for bad in (True, False, 1.0, "2", 2.5):
        with pytest.raises(TypeError):
            router.maximum_attempts_per_request = bad  # type: ignore[assignment]
        assert router.maximum_attempts_per_request == 4


async def test_attempt_limit_is_read_once_per_request() -> None:  # F1
    client = FakeClient("c", fail("1"), fail("2"), fail("3"), returns(response("fourth")))
    router: RecordingRouter

    def hook(_c: RoutingContext, _a: FailoverChatClientAttempt, _t: bool) -> None:
        router.maximum_attempts_per_request = 1  # too late for the running request

    router = RecordingRouter(always(client), hook, maximum_attempts_per_request=4)
    result = await router.get_response(messages())
    assert result.text == "fourth"
    assert router.terminal_flags == [False, False, False, True]


async def test_streaming_attempt_limit_is_read_when_iteration_starts() -> None:  # S1
    client = FakeClient("c", streams=[stream(fail("1")), stream(fail("2")), stream("third")])
    router: RecordingRouter

    def hook(_c: RoutingContext, _a: FailoverChatClientAttempt, _t: bool) -> None:
        router.maximum_attempts_per_request = 1  # too late for the running iteration

    router = RecordingRouter(always(client), hook)
    gen = router.get_streaming_response(messages())
    router.maximum_attempts_per_request = 3  # before the first __anext__: it applies
    assert [u.text async for u in gen] == ["third"]
    assert router.terminal_flags == [False, False, True]

    client2 = FakeClient("c2", streams=[stream(fail("1")), stream(fail("2")), stream("x")])
    router2 = RecordingRouter(always(client2))
    router2.maximum_attempts_per_request = 1
    gen2 = router2.get_streaming_response(messages())
    router2.maximum_attempts_per_request = 2  # still before iteration: read at first __anext__
    with pytest.raises(RuntimeError, match="2"):
        await anext(gen2)
    assert router2.terminal_flags == [False, True]


@both
async def test_later_selection_sees_options_changed_by_failed_client(streaming: bool) -> None:  # O5
    async def mutate_then_fail() -> Any:
        raise RuntimeError("mutated")

    class Mutating(FakeClient):
        async def get_response(self, messages: Any, options: ChatOptions | None = None) -> Any:
            assert options is not None
            options.instructions = "changed by failed client"
            return await super().get_response(messages, options)

        def get_streaming_response(self, messages: Any, options: ChatOptions | None = None) -> Any:
            assert options is not None
            options.instructions = "changed by failed client"
            return super().get_streaming_response(messages, options)

    first = Mutating("first", mutate_then_fail, streams=[stream(mutate_then_fail)])
    second = ok_client("second")
    seen: list[str | None] = []
    picks = iter([first, second])

    def selector(context: RoutingContext) -> ChatClient:
        assert context.chat_options is not None
        seen.append(context.chat_options.instructions)
        return next(picks)

    router = RecordingRouter(selector)
    caller = ChatOptions(instructions="caller")
    await respond(router, streaming, options=caller)
    assert seen == ["caller", "changed by failed client"]
    _, got = (second.stream_calls if streaming else second.calls)[0]
    assert got is not None and got.instructions == "changed by failed client"
    assert caller.instructions == "caller"


async def test_get_service_on_failover_routers() -> None:  # R7
    client = ok_client()
    routers: list[FailoverChatClient] = [
        RecordingRouter(always(client)),
        OrderedFailoverChatClient([client]),
    ]
    for router in routers:
        assert router.get_service(type(router)) is router
        assert router.get_service(FailoverChatClient) is router
        assert router.get_service(RoutingChatClient) is router
        assert router.get_service(ChatClient) is router
        assert router.get_service(ChatClient, "key") is None
        assert router.get_service(FakeClient) is None  # never asks the clients
        assert router.get_service(int) is None
        with pytest.raises(TypeError):
            router.get_service(None)  # type: ignore[arg-type]


async def test_attempt_record_invariants() -> None:  # D0
    client = ok_client()
    ok = FailoverChatClientAttempt(client, 0.5, 0.25, None, True, True)
    assert ok.duration == 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        ok.duration = 1.0  # type: ignore[misc]
    FailoverChatClientAttempt(client, 0.0, 0.0, None, False, True)
    FailoverChatClientAttempt(client, 1.0, None, RuntimeError("x"), False, False)
    FailoverChatClientAttempt(client, 1.0, 1.0, RuntimeError("x"), False, True)
    bad_values: list[tuple[Any, ...]] = [
        (client, -0.1, None, None, True, False),  # duration < 0
        (client, float("nan"), None, None, True, False),  # duration not >= 0
        (client, 1.0, -0.5, None, True, True),  # ttfu < 0
        (client, 1.0, 2.0, None, True, True),  # ttfu > duration
        (client, 1.0, None, RuntimeError("x"), True, False),  # completed with exception
        (client, 1.0, 0.5, None, True, False),  # ttfu set but not committed
        (client, 1.0, None, None, True, True),  # committed without ttfu
    ]
    for args in bad_values:
        with pytest.raises(ValueError):
            FailoverChatClientAttempt(*args)
    bad_types: list[tuple[Any, ...]] = [
        (None, 1.0, None, None, True, False),
        (client, "1", None, None, True, False),
        (client, True, None, None, True, False),
        (client, 1.0, None, "not an exception", False, False),
        (client, 1.0, None, None, 1, False),
        (client, 1.0, None, None, True, 0),
    ]
    for args in bad_types:
        with pytest.raises(TypeError):
            FailoverChatClientAttempt(*args)


class Interrupt(BaseException):
    """A BaseException that is not a failure (F7)."""


@both
async def test_non_failure_base_exception_propagates_without_update(streaming: bool) -> None:  # F7
    interrupt = Interrupt("stop")
    client = FakeClient("c", raise_(interrupt), streams=[stream(raise_(interrupt))])
    second = ok_client("second")
    router = RecordingRouter(in_order(client, second))
    with pytest.raises(Interrupt) as info:
        await respond(router, streaming)
    assert info.value is interrupt
    assert router.updates == []
    assert len(router.selections) == 1
    assert second.all_calls == 0
    if streaming:
        assert client.made_streams[0].aclose_count == 1


async def test_non_failure_base_exception_after_output_propagates_without_update() -> None:  # F7
    interrupt = KeyboardInterrupt()
    client = FakeClient("c", streams=[stream("a", raise_(interrupt))])
    router = RecordingRouter(always(client))
    gen = router.get_streaming_response(messages())
    assert (await anext(gen)).text == "a"
    with pytest.raises(KeyboardInterrupt) as info:
        await anext(gen)
    assert info.value is interrupt
    assert router.updates == []
    assert client.made_streams[0].aclose_count == 1


async def test_unlimited_loop_ends_only_by_policy() -> None:  # F3
    client = FakeClient("c", fail("again"))
    stop = LookupError("policy gives up")

    def hook(_c: RoutingContext, _a: FailoverChatClientAttempt, is_terminal: bool) -> None:
        assert not is_terminal
        if len(router.updates) == 25:
            raise stop

    router = RecordingRouter(always(client), hook)
    with pytest.raises(LookupError) as info:
        await router.get_response(messages())
    assert info.value is stop
    assert len(client.calls) == 25


@both
async def test_loop_never_suspends_on_its_own(streaming: bool) -> None:  # F5
    # Every double here completes without suspending. If the loop slept, yielded or
    # checked for cancellation with an await, the other task would run before we finish.
    clients = [failing_client(str(i)) for i in range(5)] + [ok_client("last", "done")]
    router = RecordingRouter(in_order(*clients))
    ran = False

    async def other() -> None:
        nonlocal ran
        ran = True

    task = asyncio.ensure_future(other())
    result = await respond(router, streaming)
    assert ran is False
    assert text_of(result) == (["done"] if streaming else "done")
    assert router.terminal_flags == [False] * 5 + [True]
    await task


async def test_success_while_cancelling_is_returned() -> None:  # C3
    answer = response("late")

    async def cancel_then_answer() -> Any:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        return answer

    router = RecordingRouter(always(FakeClient("c", cancel_then_answer)))
    outcome = await run_in_child(router.get_response(messages()))
    assert outcome.result is answer
    (only,) = router.updates
    assert only.is_terminal and only.attempt.response_completed


@both
async def test_caller_cancellation_while_client_awaits(streaming: bool) -> None:  # C1
    caught: list[BaseException] = []

    async def wait_and_record() -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError as exc:
            caught.append(exc)
            raise

    client = FakeClient("slow", wait_and_record, streams=[stream(wait_and_record)])
    second = ok_client("second")
    router = RecordingRouter(in_order(client, second))
    task = asyncio.ensure_future(respond(router, streaming))
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(caught) == 0
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()
    (only,) = router.updates
    assert only.is_terminal is True
    assert only.attempt.exception is caught[0]
    assert only.attempt.response_completed is False
    assert second.all_calls == 0
    if streaming:
        assert client.made_streams[0].aclose_count == 1


@both
async def test_caller_gets_the_same_cancelled_error(streaming: bool) -> None:  # C1
    caught: list[BaseException] = []

    async def wait_and_record() -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError as exc:
            caught.append(exc)
            raise

    client = FakeClient("slow", wait_and_record, streams=[stream(wait_and_record)])
    router = RecordingRouter(always(client))
    result: list[BaseException] = []

    async def caller() -> None:
        try:
            await respond(router, streaming)
        except asyncio.CancelledError as exc:
            result.append(exc)
            raise

    task = asyncio.ensure_future(caller())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait([task])
    assert result[0] is caught[0]
    assert len(router.updates) == 1


@both
async def test_other_failure_while_cancelling_becomes_cancelled_error(streaming: bool) -> None:
    # C1: a failure of another type that surfaces while cancelling
    boom = ValueError("surfaced while cancelling")
    client = FakeClient("c", cancel_then(lambda: boom), streams=[stream(cancel_then(lambda: boom))])
    second = ok_client("second")
    router = RecordingRouter(in_order(client, second), maximum_attempts_per_request=5)
    outcome = await run_in_child(respond(router, streaming))
    assert isinstance(outcome.error, asyncio.CancelledError)
    assert outcome.error.__cause__ is boom
    assert router.terminal_flags == [True]
    assert router.updates[0].attempt.exception is boom
    assert second.all_calls == 0


@both
async def test_asyncio_timeout_counts_as_caller_cancellation(streaming: bool) -> None:  # C6
    client = FakeClient("slow", block_forever(), streams=[stream(block_forever())])
    second = ok_client("second")
    router = RecordingRouter(in_order(client, second))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await respond(router, streaming)
    (only,) = router.updates
    assert only.is_terminal is True
    assert isinstance(only.attempt.exception, asyncio.CancelledError)
    assert second.all_calls == 0


@both
@pytest.mark.parametrize("error", [TimeoutError, asyncio.CancelledError])
async def test_provider_timeout_or_cancellation_fails_over(
    streaming: bool, error: type[BaseException]
) -> None:  # C2
    first = FakeClient("first", fail("provider", error), streams=[stream(fail("provider", error))])
    second = ok_client("second", "ok")
    router = RecordingRouter(in_order(first, second))
    result = await respond(router, streaming)
    assert text_of(result) == (["ok"] if streaming else "ok")
    assert router.terminal_flags == [False, True]
    assert isinstance(router.updates[0].attempt.exception, error)


@both
async def test_provider_cancelled_error_is_reraised_unchanged_at_limit(streaming: bool) -> None:
    # C2: an ordinary failure, re-raised unchanged when the limit ends routing
    provider = asyncio.CancelledError("provider")
    client = FakeClient("c", raise_(provider), streams=[stream(raise_(provider))])
    router = RecordingRouter(always(client), maximum_attempts_per_request=2)
    outcome = await run_in_child(respond(router, streaming))
    assert outcome.error is provider
    assert router.terminal_flags == [False, True]


async def test_cancelling_task_without_uncancel_makes_failures_terminal() -> None:  # C7
    first = FakeClient("first", fail("first"))
    second = ok_client("second")
    router = RecordingRouter(in_order(first, second))

    async def body() -> BaseException | None:
        # swallowed without uncancel(): the task still counts as cancelling
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)
        try:
            await router.get_response(messages())
        except BaseException as exc:
            return exc
        return None

    task = asyncio.ensure_future(body())
    await asyncio.sleep(0)
    task.cancel()
    error = await task
    assert isinstance(error, asyncio.CancelledError)
    assert isinstance(error.__cause__, RuntimeError)
    assert router.terminal_flags == [True]
    assert second.all_calls == 0


async def test_cancellation_while_hook_is_suspended() -> None:  # H8
    first = failing_client("first")
    second = ok_client("second")
    in_hook = asyncio.Event()

    async def hook(_c: RoutingContext, _a: FailoverChatClientAttempt, is_terminal: bool) -> None:
        in_hook.set()
        await asyncio.Event().wait()

    router = RecordingRouter(in_order(first, second), hook)
    task = asyncio.ensure_future(router.get_response(messages()))
    await in_hook.wait()
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()
    assert len(router.selections) == 1
    assert router.terminal_flags == [False]
    assert second.all_calls == 0


async def test_cancelled_error_raised_by_hook_is_not_reclassified() -> None:  # H6
    hook_error = asyncio.CancelledError("from hook")
    second = ok_client("second")

    def hook(_c: RoutingContext, _a: FailoverChatClientAttempt, is_terminal: bool) -> None:
        raise hook_error

    router = RecordingRouter(in_order(failing_client("first"), second), hook)
    outcome = await run_in_child(router.get_response(messages()))
    assert outcome.error is hook_error
    assert len(router.updates) == 1
    assert second.all_calls == 0


async def test_terminal_hook_failure_replaces_success() -> None:  # H4
    hook_error = LookupError("hook")

    def hook(_c: RoutingContext, _a: FailoverChatClientAttempt, is_terminal: bool) -> None:
        raise hook_error

    router = RecordingRouter(always(ok_client()), hook)
    with pytest.raises(LookupError) as info:
        await router.get_response(messages())
    assert info.value is hook_error


async def test_nonterminal_update_carries_pre_output_failure() -> None:  # H2
    router = RecordingRouter(in_order(failing_client("a"), failing_client("b"), ok_client()))
    await router.get_response(messages())
    for update in router.updates[:-1]:
        assert update.is_terminal is False
        assert update.attempt.exception is not None
        assert update.attempt.output_committed is False
        assert update.attempt.response_completed is False


async def test_non_streaming_duration_is_the_client_call_only(clock: FakeClock) -> None:  # D1
    first = FakeClient("first", chain(tick(clock, 2.0), fail("slow failure")))
    second = FakeClient("second", chain(tick(clock, 0.5), returns(response("ok"))))
    picks = iter([first, second])

    async def selector(_context: RoutingContext) -> ChatClient:
        clock.advance(100.0)  # selection time is not part of an attempt
        return next(picks)

    def hook(_c: RoutingContext, _a: FailoverChatClientAttempt, _t: bool) -> None:
        clock.advance(50.0)  # nor is hook time

    router = RecordingRouter(selector, hook)
    await router.get_response(messages())
    assert [u.attempt.duration for u in router.updates] == [2.0, 0.5]
    assert [u.attempt.time_to_first_update for u in router.updates] == [None, None]
