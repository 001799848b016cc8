"""Tests of OrderedFailoverChatClient: order, exhaustion, per-request state and closing (OF)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest
from core_doubles import (
    FakeClient,
    cancel_then,
    chain,
    collect,
    fail,
    messages,
    pause,
    raise_,
    respond,
    response,
    returns,
    run_in_child,
    stream,
)

from chatroute.chat import ChatClient, ChatOptions, ConfigureOptionsChatClient
from chatroute.failover import FailoverChatClientAttempt, OrderedFailoverChatClient
from chatroute.router import RoutingChatClient, RoutingContext

both = pytest.mark.parametrize("streaming", [False, True])


def failing(name: str) -> FakeClient:
    """Fails on both paths with a new exception on every call."""
    return FakeClient(name, fail(f"{name} failed"), streams=[stream(fail(f"{name} failed"))])


def ok(name: str, text: str | None = None) -> FakeClient:
    text = name if text is None else text
    return FakeClient(name, returns(response(text)), streams=[stream(text)])


class RecordingOrdered(OrderedFailoverChatClient):
    """Records updates and the contexts it saw (weakly); calls super() as OF9 requires."""

    def __init__(self, clients: Any, **kwargs: Any) -> None:
        super().__init__(clients, **kwargs)
        self.contexts: weakref.WeakSet[RoutingContext] = weakref.WeakSet()
        self.flags: list[bool] = []
        self.called: list[str] = []

    async def select_client(self, context: RoutingContext) -> ChatClient:
        client = await super().select_client(context)
        self.called.append(getattr(client, "name", "?"))
        return client

    async def on_routing_update(
        self, context: RoutingContext, attempt: FailoverChatClientAttempt, is_terminal: bool
    ) -> None:
        self.contexts.add(context)
        self.flags.append(is_terminal)
        await super().on_routing_update(context, attempt, is_terminal)


# ----------------------------------------------------------------------- checklist rows


async def test_ordered_rejects_missing_clients() -> None:  # row 46
    client = ok("a")
    with pytest.raises(TypeError):
        OrderedFailoverChatClient(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one client"):
        OrderedFailoverChatClient([])
    with pytest.raises(ValueError):
        OrderedFailoverChatClient([client, None])  # type: ignore[list-item]


@both
async def test_ordered_tries_clients_in_order(streaming: bool) -> None:  # row 47
    first, second = failing("first"), ok("second")
    router = RecordingOrdered([first, second])
    result = await respond(router, streaming)
    assert router.called == ["first", "second"]
    if streaming:
        assert result == ["second"]
    else:
        assert result is second.returned[0]


async def test_ordered_invokes_repeated_client_once_per_position() -> None:  # row 48
    first = FakeClient("first", fail("first 1"), returns(response("first again")))
    second = failing("second")
    router = RecordingOrdered([first, second, first])
    result = await router.get_response(messages())
    assert result.text == "first again"
    assert router.called == ["first", "second", "first"]
    assert router.flags == [False, False, True]


async def test_ordered_repeated_client_exhaustion_reraises_last_failure() -> None:  # row 49
    failure2 = RuntimeError("failure 2")
    inner = FakeClient("inner", fail("failure 1"), raise_(failure2))
    router = OrderedFailoverChatClient([inner, inner])
    with pytest.raises(RuntimeError) as info:
        await router.get_response(messages())
    assert info.value is failure2
    assert len(inner.calls) == 2


async def test_ordered_exhaustion_reraises_last_failure() -> None:  # row 50
    second_failure = RuntimeError("second")
    first = failing("first")
    second = FakeClient("second", raise_(second_failure))
    router = OrderedFailoverChatClient([first, second])
    with pytest.raises(RuntimeError) as info:
        await router.get_response(messages())
    assert info.value is second_failure


async def test_ordered_state_is_scoped_to_one_request() -> None:  # row 51
    first, second = failing("first"), ok("second")
    router = RecordingOrdered([first, second])
    await router.get_response(messages())
    await router.get_response(messages())
    assert len(first.calls) == 2
    assert router.called == ["first", "second", "first", "second"]


async def test_ordered_concurrent_requests_are_independent() -> None:  # row 52
    barrier = asyncio.Barrier(10)

    async def meet_then_fail() -> Any:
        await barrier.wait()
        raise RuntimeError("first failed")

    first = FakeClient("first", meet_then_fail)
    second = ok("second")
    router = OrderedFailoverChatClient([first, second])
    results = await asyncio.gather(*(router.get_response(messages(str(i))) for i in range(10)))
    assert [r.text for r in results] == ["second"] * 10
    assert len(first.calls) == 10
    assert len(second.calls) == 10
    # every request failed over exactly once, each with its own messages
    assert sorted(m[0].text for m, _ in second.calls) == sorted(str(i) for i in range(10))


async def test_ordered_releases_state_when_stream_closed() -> None:  # row 53
    first = failing("first")  # a new exception per call: a kept one would pin the context
    second = FakeClient("second", streams=[stream("one", "two")])
    router = RecordingOrdered([first, second])
    gen = router.get_streaming_response(messages())
    assert (await anext(gen)).text == "one"
    assert len(router.contexts) == 1
    await gen.aclose()
    gc.collect()
    assert len(router.contexts) == 0
    assert router.flags == [False, True]


async def test_ordered_snapshots_clients() -> None:  # row 54
    first, second = failing("first"), ok("second")
    clients: list[ChatClient] = [first, second]
    router = OrderedFailoverChatClient(clients)
    clients.clear()
    result = await router.get_response(messages())
    assert result.text == "second"
    assert router.clients == (first, second)


async def test_ordered_route_options_do_not_leak_between_attempts() -> None:  # row 55
    inner_first, inner_second = failing("first"), ok("second")

    def set_model(name: str) -> Any:
        def configure(options: ChatOptions) -> None:
            options.model_id = name

        return configure

    router = OrderedFailoverChatClient(
        [
            ConfigureOptionsChatClient(inner_first, set_model("first")),
            ConfigureOptionsChatClient(inner_second, set_model("second")),
        ]
    )
    caller = ChatOptions(instructions="caller")
    await router.get_response(messages(), caller)
    seen = [
        (opts.model_id, opts.instructions)
        for _, opts in inner_first.calls + inner_second.calls
        if opts is not None
    ]
    assert seen == [("first", "caller"), ("second", "caller")]
    assert caller.model_id is None


async def test_ordered_streaming_falls_back_before_first_update() -> None:  # row 56
    router = OrderedFailoverChatClient([failing("first"), ok("second", "ok")])
    assert await collect(router.get_streaming_response(messages())) == ["ok"]


async def test_ordered_failure_while_cancelling_does_not_fall_back() -> None:  # row 57
    first = FakeClient("first", cancel_then(lambda: RuntimeError("while cancelling")))
    second = ok("second")
    router = OrderedFailoverChatClient([first, second])
    outcome = await run_in_child(router.get_response(messages()))
    assert isinstance(outcome.error, asyncio.CancelledError)
    assert isinstance(outcome.error.__cause__, RuntimeError)
    assert second.all_calls == 0


class AlwaysEqual(FakeClient):
    """A client that claims to equal every other object and shares one hash."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 42


async def test_ordered_closes_each_client_once() -> None:  # row 58
    a, b = AlwaysEqual("a"), AlwaysEqual("b")
    router = OrderedFailoverChatClient([a, b])
    await router.aclose()
    await router.aclose()
    assert (a.close_count, b.close_count) == (1, 1)


async def test_ordered_leave_open_keeps_clients_open() -> None:  # row 59
    inner = ok("inner")
    router = OrderedFailoverChatClient([inner], leave_open=True)
    await router.get_response(messages())
    await router.aclose()
    await router.aclose()
    assert inner.close_count == 0
    assert router.leave_open is True


async def test_nested_routers_return_leaf_response() -> None:  # row 60
    answer = response("leaf")
    leaf = FakeClient("leaf", returns(answer))
    router = OrderedFailoverChatClient([OrderedFailoverChatClient([leaf])])
    assert await router.get_response(messages()) is answer


# -------------------------------------------------------------- section 3.1 and other OF rules


@both
async def test_ordered_limit_below_list_length(streaming: bool) -> None:  # OF5
    first, second, third = failing("first"), failing("second"), ok("third")
    router = RecordingOrdered([first, second, third])
    router.maximum_attempts_per_request = 2
    with pytest.raises(RuntimeError, match="second failed"):
        await respond(router, streaming)
    assert router.called == ["first", "second"]
    assert router.flags == [False, True]
    assert third.all_calls == 0


async def test_ordered_duplicate_client_closed_once_in_first_appearance_order() -> None:  # OF7
    order: list[str] = []

    class Tracking(FakeClient):
        async def aclose(self) -> None:
            order.append(self.name)
            await super().aclose()

    a, b, c = Tracking("a"), Tracking("b"), Tracking("c")
    router = OrderedFailoverChatClient([b, a, b, c, a])
    await router.aclose()
    await router.aclose()
    assert order == ["b", "a", "c"]
    assert [x.close_count for x in (a, b, c)] == [1, 1, 1]


async def test_ordered_close_continues_after_failure_and_reraises_first() -> None:  # OF7
    a, b, c = ok("a"), ok("b"), ok("c")
    first_error, second_error = OSError("a close"), OSError("c close")
    a.close_error, c.close_error = first_error, second_error
    router = OrderedFailoverChatClient([a, b, c])
    with pytest.raises(OSError) as info:
        await router.aclose()
    assert info.value is first_error
    assert [x.close_count for x in (a, b, c)] == [1, 1, 1]
    await router.aclose()  # idempotent: nothing is closed twice
    assert [x.close_count for x in (a, b, c)] == [1, 1, 1]


async def test_ordered_close_as_async_context_manager() -> None:  # OF7
    a = ok("a")
    async with OrderedFailoverChatClient([a, a]) as router:
        await router.get_response(messages())
    assert a.close_count == 1


async def test_ordered_constructor_type_checks() -> None:  # OF0
    with pytest.raises(TypeError):
        OrderedFailoverChatClient(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        OrderedFailoverChatClient("ab")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        OrderedFailoverChatClient([object()])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        OrderedFailoverChatClient([ok("a")], leave_open="yes")  # type: ignore[arg-type]
    generated = OrderedFailoverChatClient(c for c in [ok("a"), ok("b")])
    assert len(generated.clients) == 2


async def test_ordered_select_client_rejects_none() -> None:  # OF2
    router = OrderedFailoverChatClient([ok("a")])
    with pytest.raises(TypeError):
        await router.select_client(None)  # type: ignore[arg-type]
    context = RoutingContext(messages(), None)
    assert await router.select_client(context) is router.clients[0]


async def test_ordered_state_does_not_exist_before_first_failure() -> None:  # OF1, OF3
    first, second = failing("first"), ok("second")
    states: list[int] = []

    class Peeking(OrderedFailoverChatClient):
        async def select_client(self, context: RoutingContext) -> ChatClient:
            states.append(len(self._positions))
            return await super().select_client(context)

    router = Peeking([first, second])
    await router.get_response(messages())
    assert states == [0, 1]
    assert len(router._positions) == 0


async def test_ordered_nested_streaming_and_exhaustion() -> None:  # OF8
    inner = OrderedFailoverChatClient([failing("x"), failing("y")])
    outer = OrderedFailoverChatClient([inner, ok("z", "from z")])
    assert await collect(outer.get_streaming_response(messages())) == ["from z"]
    assert (await outer.get_response(messages())).text == "from z"


async def test_ordered_over_one_shot_router() -> None:  # OF8
    leaf = ok("leaf")
    one_shot = RoutingChatClient.create(lambda _context: leaf)
    router = OrderedFailoverChatClient([failing("first"), one_shot])
    assert (await router.get_response(messages())).text == "leaf"


async def test_ordered_hook_failure_on_exhaustion_is_last_failure_object() -> None:  # OF3
    last = ValueError("last")
    router = RecordingOrdered([failing("first"), FakeClient("second", raise_(last))])
    with pytest.raises(ValueError) as info:
        await router.get_response(messages())
    assert info.value is last
    # exhaustion ends routing from the nonterminal hook (H5): no terminal update is sent
    assert router.flags == [False, False]


async def test_ordered_routes_through_configured_client_after_slow_failure() -> None:  # OF4, OF6
    slow_fail = FakeClient("slow", chain(pause(), fail("slow")))
    router = RecordingOrdered([slow_fail, ok("b")])
    for _ in range(3):
        assert (await router.get_response(messages())).text == "b"
    assert router.called == ["slow", "b"] * 3


async def test_demo_chain_fails_over_as_it_prints() -> None:  # the `make run` demo
    import io

    from rich.console import Console

    from chatroute.demo import run_demo

    out = io.StringIO()
    router = await run_demo(Console(file=out, width=160))
    names = [(row.request, getattr(row.attempt.client, "name", "")) for row in router.rows]
    assert names[:3] == [(1, "primary-503"), (1, "flaky-backup"), (1, "healthy-backup")]
    # request 4 is cut mid-stream by the flaky client: terminal, no further client
    cut = [row for row in router.rows if row.request == 4]
    assert [r.is_terminal for r in cut] == [False, True]
    assert cut[-1].attempt.output_committed and not cut[-1].attempt.response_completed
    for request in {row.request for row in router.rows}:
        flags = [row.is_terminal for row in router.rows if row.request == request]
        assert flags == [False] * (len(flags) - 1) + [True]
    text = out.getvalue()
    assert "Attempt records" in text and "stream failed after output" in text
    assert len(router._positions) == 0
