"""Tests of the one-shot RoutingChatClient and of RoutingContext (contract sections R and O)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest
from core_doubles import (
    FakeClient,
    FakeStream,
    RecordingRouter,
    always,
    cancel_then,
    chain,
    collect,
    fail,
    messages,
    pause,
    raise_,
    response,
    returns,
    run_in_child,
    stream,
)

from chatroute.chat import ChatClient, ChatOptions, ConfigureOptionsChatClient
from chatroute.failover import FailoverChatClient, OrderedFailoverChatClient
from chatroute.router import RoutingChatClient, RoutingContext

# ----------------------------------------------------------------------- checklist rows


async def test_create_rejects_none_selector() -> None:  # row 1
    with pytest.raises(TypeError):
        RoutingChatClient.create(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RoutingChatClient.create("not callable")  # type: ignore[arg-type]


async def test_create_selects_client_for_request() -> None:  # row 2
    answer = response("chosen")
    chosen = FakeClient("chosen", returns(answer))
    msgs = messages()
    caller_options = ChatOptions(model_id="request")
    seen: list[RoutingContext] = []

    def selector(context: RoutingContext) -> ChatClient:
        seen.append(context)
        assert context.messages is msgs
        assert context.chat_options is not caller_options
        assert context.chat_options is not None
        context.chat_options.model_id = "selected"
        return chosen

    router = RoutingChatClient.create(selector)
    result = await router.get_response(msgs, caller_options)

    assert result is answer
    assert len(seen) == 1
    assert len(chosen.calls) == 1
    sent_messages, sent_options = chosen.calls[0]
    assert sent_messages is msgs
    assert sent_options is seen[0].chat_options
    assert sent_options is not None and sent_options.model_id == "selected"
    assert caller_options.model_id == "request"


async def test_create_does_not_reselect_after_failure() -> None:  # row 3
    boom = RuntimeError("boom")
    client = FakeClient("bad", raise_(boom))
    calls: list[RoutingContext] = []

    def selector(context: RoutingContext) -> ChatClient:
        calls.append(context)
        return client

    router = RoutingChatClient.create(selector)
    with pytest.raises(RuntimeError) as info:
        await router.get_response(messages())
    assert info.value is boom
    assert len(calls) == 1
    assert len(client.calls) == 1


async def test_create_none_selection_raises_runtime_error() -> None:  # row 4
    router = RoutingChatClient.create(lambda _context: None)
    with pytest.raises(RuntimeError, match="select_client"):
        await router.get_response(messages())
    gen = router.get_streaming_response(messages())
    with pytest.raises(RuntimeError, match="select_client"):
        await anext(gen)


async def test_create_rejects_none_messages() -> None:  # row 5
    client = FakeClient("a")
    router = RoutingChatClient.create(always(client))
    with pytest.raises(TypeError):
        await router.get_response(None)  # type: ignore[arg-type]
    gen = router.get_streaming_response(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await anext(gen)
    assert client.all_calls == 0


async def test_create_does_not_close_selected_client() -> None:  # row 6
    client = FakeClient("a")
    router = RoutingChatClient.create(always(client))
    await router.get_response(messages())
    await router.aclose()
    await router.aclose()
    assert client.close_count == 0


async def test_get_service_returns_self_or_none() -> None:  # row 7
    router = RoutingChatClient.create(always(FakeClient("a")))
    assert router.get_service(type(router)) is router
    assert router.get_service(RoutingChatClient) is router
    assert router.get_service(ChatClient) is router
    assert router.get_service(RoutingChatClient, "key") is None
    assert router.get_service(ChatClient, object()) is None
    assert router.get_service(str) is None
    with pytest.raises(TypeError):
        router.get_service(None)  # type: ignore[arg-type]


async def test_routing_context_carries_request_inputs() -> None:  # row 8
    msgs = messages()
    options = ChatOptions(model_id="m", temperature=0.5, stop_sequences=["x"])
    context = RoutingContext(msgs, options)
    assert context.messages is msgs
    assert context.chat_options is not options
    assert context.chat_options == options
    assert context.chat_options is not None
    context.chat_options.model_id = "changed"
    context.chat_options.stop_sequences.append("y")  # type: ignore[union-attr]
    assert options.model_id == "m"
    assert options.stop_sequences == ["x"]
    with pytest.raises(TypeError):
        RoutingContext(None, options)  # type: ignore[arg-type]


async def test_configured_route_overrides_without_touching_request_options() -> None:  # row 17
    inner = FakeClient("inner")

    def configure(options: ChatOptions) -> None:
        options.model_id = "route"

    route = ConfigureOptionsChatClient(inner, configure)
    router = RoutingChatClient.create(always(route))
    caller = ChatOptions(model_id="caller-model", instructions="caller")
    await router.get_response(messages(), caller)

    _, received = inner.calls[0]
    assert received is not caller
    assert received is not None
    assert received.model_id == "route"
    assert received.instructions == "caller"
    assert caller.model_id == "caller-model"


async def test_one_shot_router_propagates_cancellation() -> None:  # row 26
    cancelled = asyncio.CancelledError()
    client = FakeClient("a", cancel_then(lambda: cancelled))
    selections: list[RoutingContext] = []

    def selector(context: RoutingContext) -> ChatClient:
        selections.append(context)
        return client

    router = RoutingChatClient.create(selector)
    outcome = await run_in_child(router.get_response(messages()))
    assert outcome.error is cancelled
    assert len(selections) == 1


# --------------------------------------------------------------- R rules (no upstream test)


async def test_routing_base_is_abstract() -> None:  # R1
    with pytest.raises(TypeError):
        RoutingChatClient()  # type: ignore[abstract]
    with pytest.raises(TypeError):
        FailoverChatClient()  # type: ignore[abstract]


async def test_create_accepts_coroutine_selector() -> None:  # R2
    client = FakeClient("a")

    async def selector(_context: RoutingContext) -> ChatClient:
        await asyncio.sleep(0)
        return client

    router = RoutingChatClient.create(selector)
    result = await router.get_response(messages())
    assert result is client.returned[0]


async def test_create_returns_none_response_unchanged() -> None:  # R3.4
    router = RoutingChatClient.create(always(FakeClient("a", returns(None))))
    assert await router.get_response(messages()) is None


async def test_create_streaming_is_lazy_and_closes_inner() -> None:  # R4
    client = FakeClient("a", streams=[stream("x", "y", "z")])
    selections: list[RoutingContext] = []

    def selector(context: RoutingContext) -> ChatClient:
        selections.append(context)
        return client

    router = RoutingChatClient.create(selector)
    gen = router.get_streaming_response(None)  # type: ignore[arg-type]
    gen2 = router.get_streaming_response(messages())
    assert selections == []  # calling does nothing, not even validation
    await gen.aclose()

    first = await anext(gen2)
    assert first.text == "x"
    assert len(selections) == 1
    inner = client.made_streams[0]
    assert isinstance(inner, FakeStream)
    assert inner.aclose_count == 0
    await gen2.aclose()
    assert inner.aclose_count == 1
    assert len(selections) == 1


async def test_create_streaming_passes_items_through_unchanged() -> None:  # R4
    client = FakeClient("a", streams=[stream("x", "y")])
    router = RoutingChatClient.create(always(client))
    items = [item async for item in router.get_streaming_response(messages())]
    assert [i.text for i in items] == ["x", "y"]
    inner = client.made_streams[0]
    assert items == inner.produced
    assert all(a is b for a, b in zip(items, inner.produced, strict=True))
    assert inner.aclose_count == 1


async def test_create_uses_result_when_cancelling() -> None:  # R6
    answer = response("late")

    async def cancel_then_answer() -> Any:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        return answer

    router = RoutingChatClient.create(always(FakeClient("a", cancel_then_answer)))
    outcome = await run_in_child(router.get_response(messages()))
    # The base never looks at cancellation: the result is used, the cancellation is
    # delivered at the caller's next suspension point.
    assert outcome.result is answer


async def test_create_stream_failure_propagates_unchanged() -> None:  # R6
    boom = ValueError("mid")
    client = FakeClient("a", streams=[stream("x", raise_(boom))])
    router = RoutingChatClient.create(always(client))
    received: list[str] = []
    with pytest.raises(ValueError) as info:
        async for item in router.get_streaming_response(messages()):
            received.append(item.text)
    assert info.value is boom
    assert received == ["x"]
    assert client.made_streams[0].aclose_count == 1


# ------------------------------------------------------------------- O rules (section 3.1)


@pytest.mark.parametrize("kind", ["create", "failover", "ordered"])
async def test_streaming_generator_is_single_use(kind: str) -> None:  # O1
    client = FakeClient("a", streams=[stream("x")])
    router: ChatClient
    if kind == "create":
        router = RoutingChatClient.create(always(client))
    elif kind == "failover":
        router = RecordingRouter(always(client))
    else:
        router = OrderedFailoverChatClient([client])
    gen = router.get_streaming_response(messages())
    assert await collect(gen) == ["x"]
    assert await collect(gen) == []
    with pytest.raises(StopAsyncIteration):
        await anext(gen)
    assert len(client.stream_calls) == 1
    assert await collect(router.get_streaming_response(messages())) == ["x"]
    assert len(client.stream_calls) == 2


async def test_routing_context_rejects_one_shot_iterators() -> None:  # O2
    with pytest.raises(TypeError):
        RoutingContext(iter(messages()), None)
    with pytest.raises(TypeError):
        RoutingContext((m for m in messages()), None)
    with pytest.raises(TypeError):
        RoutingContext(42, None)  # type: ignore[arg-type]
    msgs = tuple(messages())
    assert RoutingContext(msgs, None).messages is msgs


@pytest.mark.parametrize("kind", ["create", "failover", "ordered"])
async def test_routers_reject_one_shot_iterator_messages(kind: str) -> None:  # O2
    client = FakeClient("a")
    router: ChatClient
    if kind == "create":
        router = RoutingChatClient.create(always(client))
    elif kind == "failover":
        router = RecordingRouter(always(client))
    else:
        router = OrderedFailoverChatClient([client])
    with pytest.raises(TypeError):
        await router.get_response(iter(messages()))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await anext(router.get_streaming_response(iter(messages())))  # type: ignore[arg-type]
    assert client.all_calls == 0


async def test_routing_context_keeps_none_options_and_snapshots_options() -> None:  # O3
    assert RoutingContext(messages(), None).chat_options is None
    options = ChatOptions(model_id="before", additional_properties={"k": [1]})
    context = RoutingContext(messages(), options)
    options.model_id = "after"
    options.additional_properties["k2"] = 2  # type: ignore[index]
    assert context.chat_options is not None
    assert context.chat_options.model_id == "before"
    assert context.chat_options.additional_properties is not None
    assert "k2" not in context.chat_options.additional_properties
    # shallow: the values are shared
    assert context.chat_options.additional_properties["k"] is options.additional_properties["k"]  # type: ignore[index]


async def test_routing_context_properties_are_read_only() -> None:  # O7
    context = RoutingContext(messages(), ChatOptions())
    with pytest.raises(AttributeError):
        context.messages = messages()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        context.chat_options = None  # type: ignore[misc]


async def test_routing_context_identity_hash_and_weakref() -> None:  # O8
    msgs = messages()
    options = ChatOptions(model_id="same")
    a = RoutingContext(msgs, options)
    b = RoutingContext(msgs, options)
    assert a == a
    assert a != b
    assert hash(a) == object.__hash__(a)
    assert len({a, b}) == 2
    state: weakref.WeakKeyDictionary[RoutingContext, int] = weakref.WeakKeyDictionary()
    state[a] = 1
    state[b] = 2
    ref = weakref.ref(a)
    assert ref() is a
    del a
    gc.collect()
    assert ref() is None
    assert list(state.values()) == [2]


async def test_create_routers_are_independent_under_concurrency() -> None:  # R10
    client = FakeClient("a", chain(pause(3), returns(response("a"))))
    contexts: list[RoutingContext] = []

    def selector(context: RoutingContext) -> ChatClient:
        contexts.append(context)
        return client

    router = RoutingChatClient.create(selector)
    results = await asyncio.gather(*(router.get_response(messages(str(i))) for i in range(20)))
    assert len(results) == 20
    assert len({id(c) for c in contexts}) == 20
    assert [m[0].text for m, _ in client.calls] == [str(i) for i in range(20)]


async def test_create_failure_does_not_close_or_fail_over() -> None:  # R6, R8
    bad = FakeClient("bad", fail("x"))
    router = RoutingChatClient.create(always(bad))
    with pytest.raises(RuntimeError, match="x"):
        await router.get_response(messages())
    await router.aclose()
    assert bad.close_count == 0
