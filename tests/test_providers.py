"""OpenAIChatClient: request and response mapping, streaming commit rule and lifecycle."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pydantic
import pytest

from chatroute.chat import (
    ChatFinishReason,
    ChatMessage,
    ChatOptions,
    ChatRole,
    FunctionCallContent,
    FunctionResultContent,
    TextContent,
    TextReasoningContent,
)
from chatroute.providers import (
    FirstTokenTimeoutError,
    OpenAIChatClient,
    ProviderAuthError,
    ProviderBadRequestError,
)
from chatroute.providers.mapping import (
    build_request,
    finish_reason_from_openai,
    messages_from_openai,
    messages_to_openai,
    tool_to_openai,
    usage_from_openai,
)
from tests.fakes import FakeUpstream, Hang, NoDone, Ok, Stall, Status, ToolCall

HI = [ChatMessage(ChatRole.USER, "hi")]


@pytest.fixture
def up() -> Iterator[FakeUpstream]:
    with FakeUpstream() as fake:
        yield fake


@pytest.fixture
async def client(up: FakeUpstream) -> AsyncIterator[OpenAIChatClient]:
    provider = OpenAIChatClient(
        "small-model", base_url=up.base_url, api_key="sk-test-key", name="fast"
    )
    yield provider
    await provider.aclose()


async def collect(client: OpenAIChatClient, messages: Any = HI, options: Any = None) -> list[Any]:
    return [u async for u in client.get_streaming_response(messages, options)]


# ---------------------------------------------------------------------------- request mapping


def conversation() -> list[ChatMessage]:
    return [
        ChatMessage(ChatRole.SYSTEM, "be brief"),
        ChatMessage(ChatRole.USER, "weather in Paris?", author_name="ann"),
        ChatMessage(
            ChatRole.ASSISTANT,
            contents=[
                TextReasoningContent("need the tool"),
                FunctionCallContent("call_1", "get_weather", '{"city":"Paris"}'),
            ],
        ),
        ChatMessage(
            ChatRole.TOOL,
            contents=[
                FunctionResultContent("call_1", {"temp": 21}),
                FunctionResultContent("call_2", "sunny"),
            ],
        ),
        ChatMessage(ChatRole.ASSISTANT, "It is 21 degrees."),
    ]


def test_messages_to_openai_maps_every_role_and_content() -> None:
    wire = messages_to_openai(conversation(), instructions="You are a router test.")
    assert wire == [
        {"role": "system", "content": "You are a router test."},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
            "reasoning_content": "need the tool",
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
        {"role": "assistant", "content": "It is 21 degrees."},
    ]


def test_reasoning_can_be_left_out_of_requests() -> None:
    wire = messages_to_openai(conversation(), send_reasoning=False)
    assert all("reasoning_content" not in m for m in wire)


def test_messages_round_trip_through_the_wire_format() -> None:
    back = messages_from_openai(messages_to_openai(conversation()))
    assert [m.role for m in back] == [
        ChatRole.SYSTEM,
        ChatRole.USER,
        ChatRole.ASSISTANT,
        ChatRole.TOOL,
        ChatRole.TOOL,
        ChatRole.ASSISTANT,
    ]
    assert back[1].author_name == "ann"
    assert back[2].contents == [
        TextReasoningContent("need the tool"),
        FunctionCallContent("call_1", "get_weather", '{"city":"Paris"}', index=0),
    ]
    assert back[3].contents == [FunctionResultContent("call_1", '{"temp": 21}')]
    assert back[5].text == "It is 21 degrees."


def test_messages_from_openai_rejects_bad_roles_and_tool_messages() -> None:
    with pytest.raises(ValueError, match="unknown message role"):
        messages_from_openai([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="tool_call_id"):
        messages_from_openai([{"role": "tool", "content": "x"}])
    assert messages_from_openai([{"role": "developer", "content": "d"}])[0].role is ChatRole.SYSTEM


def test_messages_to_openai_rejects_non_messages() -> None:
    with pytest.raises(TypeError, match=r"messages\[0\]"):
        messages_to_openai([{"role": "user", "content": "x"}])  # type: ignore[list-item]


class Answer(pydantic.BaseModel):
    city: str


def test_build_request_maps_every_option() -> None:
    options = ChatOptions(
        model_id="override-model",
        instructions="sys",
        temperature=0.2,
        top_p=0.9,
        max_output_tokens=64,
        stop_sequences=["END"],
        tools=[
            {"type": "function", "function": {"name": "a"}},
            {"name": "b", "parameters": {"type": "object"}},
        ],
        tool_choice="b",
        response_format=Answer,
        reasoning={"effort": "low"},
        seed=3,
        frequency_penalty=0.1,
        presence_penalty=0.2,
        user="u-1",
        additional_properties={"top_k": 4, "temperature": 0.5},
    )
    body = build_request(
        HI,
        options,
        default_model="provider-model",
        stream=True,
        max_tokens_param="max_completion_tokens",
        extra_body={"repetition_penalty": 1.1},
    )
    assert body["model"] == "override-model"
    assert body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    assert body["temperature"] == 0.5  # additional_properties win
    assert (body["top_p"], body["seed"], body["user"]) == (0.9, 3, "u-1")
    assert (body["frequency_penalty"], body["presence_penalty"]) == (0.1, 0.2)
    assert body["max_completion_tokens"] == 64 and "max_tokens" not in body
    assert body["stop"] == ["END"]
    assert body["tools"] == [
        {"type": "function", "function": {"name": "a"}},
        {"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}},
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "b"}}
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["name"] == "Answer"
    assert body["response_format"]["json_schema"]["schema"]["required"] == ["city"]
    assert body["reasoning_effort"] == "low"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["top_k"] == 4 and body["repetition_penalty"] == 1.1


def test_build_request_defaults_and_errors() -> None:
    body = build_request(HI, None, default_model="m", stream=False)
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert (
        build_request(HI, ChatOptions(max_output_tokens=5), default_model="m", stream=False)[
            "max_tokens"
        ]
        == 5
    )
    streamed = build_request(HI, None, default_model="m", stream=True, include_usage=False)
    assert "stream_options" not in streamed
    with pytest.raises(ValueError, match="no model"):
        build_request(HI, None, default_model=None, stream=False)
    with pytest.raises(ValueError, match="empty"):
        build_request([], None, default_model="m", stream=False)
    with pytest.raises(ValueError, match="json_object"):
        build_request(HI, ChatOptions(response_format="yaml"), default_model="m", stream=False)
    with pytest.raises(TypeError, match="tool_choice"):
        build_request(HI, ChatOptions(tool_choice=3), default_model="m", stream=False)


def test_tool_to_openai_accepts_objects_and_rejects_nameless() -> None:
    class Tool:
        name = "lookup"
        description = "find things"

        def parameters(self) -> dict[str, Any]:
            return {"type": "object"}

    assert tool_to_openai(Tool()) == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "find things",
            "parameters": {"type": "object"},
        },
    }
    with pytest.raises(TypeError, match="no name"):
        tool_to_openai(object())
    with pytest.raises(ValueError, match="'type' or 'name'"):
        tool_to_openai({"description": "x"})


def test_finish_reasons_and_usage_details() -> None:
    assert finish_reason_from_openai("stop") is ChatFinishReason.STOP
    assert finish_reason_from_openai("length") is ChatFinishReason.LENGTH
    assert finish_reason_from_openai("function_call") is ChatFinishReason.TOOL_CALLS
    assert finish_reason_from_openai("content_filter") is ChatFinishReason.CONTENT_FILTER
    assert finish_reason_from_openai("eos") == "eos"
    assert finish_reason_from_openai(None) is None
    usage = usage_from_openai(
        {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "completion_tokens_details": {"reasoning_tokens": 2},
            "prompt_tokens_details": {"cached_tokens": 1},
        }
    )
    assert usage is not None
    assert (usage.input_token_count, usage.output_token_count, usage.total_token_count) == (3, 4, 7)
    assert usage.additional_counts == {"reasoning_tokens": 2, "cached_tokens": 1}
    assert (usage.cached_input_token_count, usage.reasoning_token_count) == (1, 2)
    bare = usage_from_openai({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})
    assert bare is not None
    assert (bare.cached_input_token_count, bare.reasoning_token_count) == (None, None)
    assert usage_from_openai(None) is None


# ---------------------------------------------------------------------------- client, non-streaming


async def test_get_response_maps_the_answer_and_names_the_served_model(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(
        Ok(
            "Paris is sunny.",
            model="small-model-2024",
            reasoning="check weather",
            usage_extra={"completion_tokens_details": {"reasoning_tokens": 3}},
            response_id="chatcmpl-xyz",
        )
    )
    response = await client.get_response(conversation(), ChatOptions(temperature=0.3))
    assert response.text == "Paris is sunny."
    assert response.messages[0].role is ChatRole.ASSISTANT
    assert response.messages[0].contents[0] == TextReasoningContent("check weather")
    assert response.model_id == "small-model-2024"
    assert response.response_id == "chatcmpl-xyz"
    assert response.finish_reason is ChatFinishReason.STOP
    assert response.usage is not None and response.usage.input_token_count == 10
    assert response.usage.additional_counts == {"reasoning_tokens": 3}
    assert response.additional_properties == {"provider": "fast"}
    sent = up.requests[0].json
    assert sent["model"] == "small-model" and sent["temperature"] == 0.3
    assert sent["messages"][2]["tool_calls"][0]["id"] == "call_1"
    assert "stream" not in sent


async def test_get_response_tool_calls(up: FakeUpstream, client: OpenAIChatClient) -> None:
    up.script(Ok("", tool_calls=[ToolCall("get_weather", '{"city": "Rome"}', id="call_9")]))
    response = await client.get_response(HI, ChatOptions(tools=[{"name": "get_weather"}]))
    assert response.finish_reason is ChatFinishReason.TOOL_CALLS
    assert response.messages[0].contents == [
        FunctionCallContent("call_9", "get_weather", '{"city": "Rome"}', index=0)
    ]
    assert up.requests[0].json["tools"] == [
        {"type": "function", "function": {"name": "get_weather"}}
    ]


async def test_model_id_option_overrides_the_provider_model(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    response = await client.get_response(HI, ChatOptions(model_id="other-model"))
    assert up.requests[0].model == "other-model"
    assert response.model_id == "other-model"


async def test_headers_key_and_no_key(up: FakeUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    with_key = OpenAIChatClient(
        "m", base_url=up.base_url, api_key="sk-configured", default_headers={"x-team": "blue"}
    )
    without_key = OpenAIChatClient("m", base_url=up.base_url)
    try:
        await with_key.get_response(HI)
        await without_key.get_response(HI)
    finally:
        await with_key.aclose()
        await without_key.aclose()
    first, second = up.requests
    assert first.headers["authorization"] == "Bearer sk-configured"
    assert first.headers["x-team"] == "blue"
    assert "authorization" not in second.headers
    assert all("sk-from-the-environment" not in v for v in second.headers.values())


async def test_azure_style_key_header_and_api_version(up: FakeUpstream) -> None:
    secret = "azure-secret-0123456789abcdef"
    azure = OpenAIChatClient(
        "gpt-4o",
        base_url=f"{up.url}/openai/deployments/gpt-4o",
        api_key=secret,
        api_key_header="api-key",
        default_query={"api-version": "2024-10-21"},
    )
    up.script(Ok("plain"), Ok("streamed"), Status(401, message=f"bad key {secret}"))
    try:
        assert (await azure.get_response(HI)).text == "plain"
        assert "".join(u.text for u in await collect(azure)) == "streamed"
        with pytest.raises(ProviderAuthError) as info:
            await azure.get_response(HI)
    finally:
        await azure.aclose()
    for request in up.requests:
        assert request.path == "/openai/deployments/gpt-4o/chat/completions"
        assert request.query == "api-version=2024-10-21"
        assert request.headers["api-key"] == secret
        assert "authorization" not in request.headers
    assert secret not in str(info.value)
    with pytest.raises(ValueError, match="api_key_header"):
        OpenAIChatClient("m", base_url=up.base_url, api_key_header="x-key")  # type: ignore[arg-type]


async def test_connections_are_pooled(up: FakeUpstream, client: OpenAIChatClient) -> None:
    for _ in range(3):
        await client.get_response(HI)
    await collect(client)
    assert len({r.connection.id for r in up.requests}) == 1


# ---------------------------------------------------------------------------- client, streaming


async def test_stream_maps_updates_and_merges_pre_content_events(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(
        Ok("a b c", model="served-model", empty_choices_first=True, keepalives=2, response_id="r1")
    )
    updates = await collect(client)
    first = updates[0]
    assert first.role is ChatRole.ASSISTANT
    assert first.contents == [TextContent("a ")]
    assert first.response_id == "r1" and first.model_id == "served-model"
    assert first.additional_properties == {"provider": "fast"}
    assert "".join(u.text for u in updates) == "a b c"
    assert [u.finish_reason for u in updates if u.finish_reason] == [ChatFinishReason.STOP]
    usage = [u.usage for u in updates if u.usage is not None]
    assert len(usage) == 1 and usage[0].total_token_count == 13
    assert updates[-1].usage is not None
    assert up.requests[0].json["stream_options"] == {"include_usage": True}


async def test_stream_without_usage_request(up: FakeUpstream) -> None:
    provider = OpenAIChatClient("m", base_url=up.base_url, include_usage=False)
    try:
        updates = await collect(provider)
    finally:
        await provider.aclose()
    assert "stream_options" not in up.requests[0].json
    assert all(u.usage is None for u in updates)


async def test_stream_reasoning_and_tool_call_deltas(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    call = ToolCall("lookup", '{"q": "x"}', id="call_7", chunks=2)
    up.script(Ok("", reasoning="hmm ok", tool_calls=[call]))
    updates = await collect(client)
    assert updates[0].role is ChatRole.ASSISTANT
    assert updates[0].contents == [TextReasoningContent("hmm ")]
    calls = [c for u in updates for c in u.contents if isinstance(c, FunctionCallContent)]
    assert calls[0] == FunctionCallContent("call_7", "lookup", "", index=0)
    assert "".join(c.arguments for c in calls) == '{"q": "x"}'
    assert {c.index for c in calls} == {0}
    assert updates[-2].finish_reason is ChatFinishReason.TOOL_CALLS


async def test_nothing_is_yielded_before_the_first_content(
    up: FakeUpstream,
) -> None:
    # Role delta, empty-choices chunk and keep-alives arrive, then the upstream stalls: the
    # iterator must fail without having yielded anything.
    provider = OpenAIChatClient("m", base_url=up.base_url, first_token_timeout=0.3)
    received: list[Any] = []
    try:
        await provider.get_response(HI)  # the SDK's one-off first-request work, out of the way
        up.script(Stall(0, empty_choices_first=True, keepalives=3))
        with pytest.raises(FirstTokenTimeoutError):
            async for update in provider.get_streaming_response(HI):
                received.append(update)
    finally:
        await provider.aclose()
    assert received == []
    assert up.requests[1].chunks_sent == 0 and up.requests[1].status == 200


async def test_stream_with_finish_but_no_done_completes(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(NoDone("x y z"))
    updates = await collect(client)
    assert "".join(u.text for u in updates) == "x y z"
    assert updates[-1].usage is not None


async def test_stream_held_open_after_finish_ends_after_the_tail_timeout(
    up: FakeUpstream,
) -> None:
    up.script(Ok("x y", done=False, hold_open=True))
    provider = OpenAIChatClient("m", base_url=up.base_url, tail_timeout=0.2, stall_timeout=30)
    try:
        updates = await collect(provider)
    finally:
        await provider.aclose()
    assert "".join(u.text for u in updates) == "x y"
    await up.await_disconnect(0)


async def test_empty_answer_stream_yields_one_finished_update(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(Ok(""))
    updates = await collect(client)
    assert len(updates) == 1
    assert updates[0].role is ChatRole.ASSISTANT
    assert updates[0].finish_reason is ChatFinishReason.STOP
    assert updates[0].usage is not None


async def test_early_aclose_closes_the_upstream_connection(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(Ok("one two three four five six seven eight", chunk_delay=0.2))
    stream = client.get_streaming_response(HI)
    first = await anext(stream)
    assert first.text == "one "
    await stream.aclose()  # type: ignore[attr-defined]
    await up.await_disconnect(0, timeout=5)
    record = await up.await_finish(0)
    assert record.chunks_sent < 8


async def test_cancelling_a_stream_waiting_for_the_first_token_closes_the_connection(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(Ok("late", first_token_delay=30))

    async def consume() -> None:
        await collect(client)

    task = asyncio.create_task(consume())
    await up.await_requests(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await up.await_disconnect(0, timeout=5)


async def test_cancelling_a_non_streaming_call_closes_the_connection(
    up: FakeUpstream, client: OpenAIChatClient
) -> None:
    up.script(Ok("late", delay=30))
    task = asyncio.create_task(client.get_response(HI))
    await up.await_requests(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await up.await_disconnect(0, timeout=5)
    assert up.attempts == 1


# ---------------------------------------------------------------------------- lifecycle


async def test_aclose_is_idempotent_and_closed_clients_refuse_work(up: FakeUpstream) -> None:
    provider = OpenAIChatClient("m", base_url=up.base_url)
    async with provider:
        await provider.get_response(HI)
    await provider.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await provider.get_response(HI)
    with pytest.raises(RuntimeError, match="closed"):
        await collect(provider)
    await up.await_disconnect(0)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"model": ""}, ValueError),
        ({"base_url": 5}, TypeError),
        ({"api_key": 5}, TypeError),
        ({"max_tokens_param": "tokens"}, ValueError),
        ({"first_token_timeout": 0}, ValueError),
        ({"stall_timeout": -1}, ValueError),
        ({"connect_timeout": "5"}, TypeError),
        ({"max_connections": 0}, ValueError),
        ({"context_window": 0}, ValueError),
        ({"extra_body": {"model": "x"}}, ValueError),
    ],
)
def test_constructor_validates_arguments(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        OpenAIChatClient(**{"model": "m", **kwargs})


async def test_bad_arguments_to_calls(client: OpenAIChatClient) -> None:
    with pytest.raises(TypeError, match="messages"):
        await client.get_response(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="options"):
        await client.get_response(HI, {"temperature": 1})  # type: ignore[arg-type]
    # What the request cannot say is the caller's error, typed (a 400 from the service).
    with pytest.raises(ProviderBadRequestError, match="empty"):
        await collect(client, [])
    nameless = OpenAIChatClient(base_url="http://127.0.0.1:9/v1")
    try:
        with pytest.raises(ProviderBadRequestError, match="no model"):
            await nameless.get_response(HI)
        assert nameless.name == "http://127.0.0.1:9/v1"
    finally:
        await nameless.aclose()


async def test_with_timeouts_shares_the_pool_and_overrides_limits(up: FakeUpstream) -> None:
    base = OpenAIChatClient("m", base_url=up.base_url, name="fast", first_token_timeout=30)
    strict = base.with_timeouts(first_token_timeout=0.2, stall_timeout=1)
    assert (strict.name, strict.first_token_timeout, strict.stall_timeout) == ("fast", 0.2, 1.0)
    assert (base.first_token_timeout, base.stall_timeout) == (30.0, None)
    up.script(Ok("x"), Hang())
    try:
        await base.get_response(HI)
        with pytest.raises(FirstTokenTimeoutError):
            await collect(strict)
        await strict.aclose()  # a view owns nothing
        up.script(Ok("still open"))
        assert (await base.get_response(HI)).text == "still open"
    finally:
        await base.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await strict.get_response(HI)
    with pytest.raises(ValueError):
        base.with_timeouts(stall_timeout=0)


def test_repr_never_shows_the_key() -> None:
    provider = OpenAIChatClient("m", base_url="http://127.0.0.1:9/v1", api_key="sk-very-secret")
    assert "sk-very-secret" not in repr(provider)
    assert "fast" in repr(OpenAIChatClient("m", base_url="http://127.0.0.1:9/v1", name="fast"))


class _Text(TextContent):
    """A TextContent subclass: messages holding one take the general mapping path."""


@pytest.mark.parametrize("role", [ChatRole.SYSTEM, ChatRole.USER, ChatRole.ASSISTANT])
@pytest.mark.parametrize("texts", [[], ["one"], ["one", "", "two"], [""]])
@pytest.mark.parametrize(
    ("author", "extra"), [(None, None), ("ann", None), (None, {"cache": {"type": "x"}})]
)
def test_text_only_messages_map_as_the_general_path_maps_them(
    role: ChatRole, texts: list[str], author: str | None, extra: dict[str, Any] | None
) -> None:
    def message(kind: type[TextContent]) -> ChatMessage:
        return ChatMessage(
            role,
            contents=[kind(text) for text in texts],
            author_name=author,
            additional_properties=extra,
        )

    fast = messages_to_openai([message(TextContent)])
    general = messages_to_openai([message(_Text)])
    assert fast == general
    assert list(fast[0]) == list(general[0])  # the same keys in the same order


def test_header_values_that_could_split_the_request_head_are_refused() -> None:
    with pytest.raises(ValueError, match=r"'x-team'.*CR, LF or NUL"):
        OpenAIChatClient(
            "m", base_url="http://127.0.0.1:9/v1", default_headers={"x-team": "a\r\nb"}
        )
    with pytest.raises(ValueError, match="'Authorization'"):
        OpenAIChatClient("m", base_url="http://127.0.0.1:9/v1", api_key="sk-1\nx-evil: 1")
