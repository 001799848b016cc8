"""The plain-request reader of the chat endpoint against the validating model.

`plain_chat_call` reads the common request straight from its decoded JSON, for speed. It
must give exactly what the model path gives (validation, the message limits, then
`chat_call`), and must decline (None) everything it cannot read that way, so the model can
answer it with its own errors.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatroute.chat.types import ChatRole, TextContent
from chatroute.server import app as app_module
from chatroute.server.app import _check_messages
from chatroute.server.errors import APIError
from chatroute.server.wire import ChatCall, ChatCompletionRequest, chat_call, plain_chat_call
from tests.test_server import harness

MAX_MESSAGES = 3
MAX_CHARS = 20
LIMITS = SimpleNamespace(
    config=SimpleNamespace(
        server=SimpleNamespace(max_messages=MAX_MESSAGES, max_message_chars=MAX_CHARS)
    )
)


def plain(data: Any) -> ChatCall | None:
    return plain_chat_call(data, max_messages=MAX_MESSAGES, max_chars=MAX_CHARS)


def through_model(data: Any) -> ChatCall | None:
    """What the endpoint makes of `data` without the plain reader; None when it refuses."""
    try:
        request = ChatCompletionRequest.model_validate(data)
        _check_messages(LIMITS, request.messages)  # type: ignore[arg-type]
        return chat_call(request)
    except (pydantic.ValidationError, APIError):
        return None


def typed(value: Any) -> tuple[type, Any]:
    return type(value), value


def shape(call: ChatCall) -> tuple[Any, ...]:
    """Everything a call carries, with the types of the option values (1 is not 1.0)."""
    messages = [(m.role, m.author_name, m.contents, m.additional_properties) for m in call.messages]
    options = {name: typed(value) for name, value in vars(call.options).items()}
    return (typed(call.model), messages, options, call.stream, call.include_usage, call.ignored)


def test_the_common_request_is_read_plainly_and_as_the_model_reads_it() -> None:
    data = {
        "model": "code",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "fix this bug", "name": "ann"},
        ],
        "stream": True,
        "temperature": 1,
        "top_p": 0.5,
        "max_tokens": 10,
        "max_completion_tokens": 20,
        "seed": 7,
        "user": "u-1",
        "n": 1,
        "stream_options": {"include_usage": True},
        "stop": "END",
        "presence_penalty": 0.5,
    }
    call = plain(data)
    assert call is not None
    assert [m.role for m in call.messages] == [ChatRole.SYSTEM, ChatRole.USER]
    assert call.messages[1].contents == [TextContent("fix this bug")]
    assert call.messages[1].author_name == "ann"
    assert typed(call.options.temperature) == (float, 1.0)
    assert call.options.max_output_tokens == 20  # max_completion_tokens wins, as in the model
    assert call.stream is True and call.include_usage is True and call.model == "code"
    assert call.options.stop_sequences == ["END"]
    reference = through_model(data)
    assert reference is not None and shape(call) == shape(reference)


@pytest.mark.parametrize(
    "data",
    [
        {"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "tools": []},
        {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"x": True}},
        {"messages": [{"role": "user", "content": "hi"}], "n": 2},
        {"messages": [{"role": "user", "content": "hi"}], "stop": ["a", 1]},
        {"messages": [{"role": "user", "content": "hi"}], "unknown_field": 1},
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 2.5},
        {"messages": [{"role": "user", "content": "hi"}], "temperature": math.nan},
        {"messages": [{"role": "user", "content": "hi"}], "temperature": True},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        {"messages": [{"role": "user", "content": "x" * (MAX_CHARS + 1)}]},
        {"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)},
        {"messages": []},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": ["user"], "content": "hi"}]},
        {"model": 5, "messages": [{"role": "user", "content": "hi"}]},
        [{"role": "user", "content": "hi"}],
    ],
)
def test_what_it_cannot_read_plainly_goes_to_the_model(data: Any) -> None:
    assert plain(data) is None


# Values at and around what each field takes, and wrong in every way JSON can be wrong.
_BAD = [None, True, False, 0, 1, -1, 1.5, "1", "", [], {}, ["x"], {"a": 1}]
_FIELD_VALUES: dict[str, list[Any]] = {
    "model": ["auto", "code", "x" * 200, *_BAD],
    "stream": _BAD,
    "temperature": [-0.001, 0, 0.0, 2, 2.0, 2.001, 3, math.nan, math.inf, -math.inf, *_BAD],
    "top_p": [-0.001, 0, 0.0, 1, 1.0, 1.001, 2, math.nan, math.inf, *_BAD],
    "max_tokens": [2, 2**70, -(2**70), 1.0, *_BAD],
    "max_completion_tokens": [2, 2**70, 1.0, *_BAD],
    "seed": [2**63, 2**70, -(2**70), *_BAD],
    "user": ["u", *_BAD],
    "presence_penalty": [-2, -2.001, 2.0, 2.5, math.nan, *_BAD],
    "frequency_penalty": [-2.0, -3, 0, 2.001, math.inf, *_BAD],
    "n": [2, 1.0, *_BAD],
    "stream_options": [
        {"include_usage": True},
        {"include_usage": False},
        {"include_usage": None},
        {"include_usage": 1},
        {"include_usage": True, "other": 1},
        *_BAD,
    ],
    "stop": ["END", [], ["a", "b"], ["a", 1], [None], *_BAD],
    # Fields the plain reader leaves to the model.
    "tools": [[], None],
    "metadata": [{"k": "v"}],
    "unknown_field": [1, None],
}
_MESSAGE_VALUES: dict[str, list[Any]] = {
    "role": ["system", "developer", "user", "assistant", "tool", "bot", "USER", *_BAD],
    "content": [
        "hi",
        "x" * MAX_CHARS,
        "x" * (MAX_CHARS + 1),
        [{"type": "text", "text": "hi"}],
        [{"type": "image_url"}],
        *_BAD,
    ],
    "name": ["ann", *_BAD],
    "tool_call_id": ["c1", None],
    "tool_calls": [[], None],
    "extra": [1],
}
_BASES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {
        "model": "code",
        "messages": [
            {"role": "system", "content": "be brief", "name": "s"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "fix this bug"},
        ],
        "stream": True,
        "temperature": 0.5,
        "top_p": 1,
        "max_tokens": 5,
        "max_completion_tokens": 9,
        "seed": -3,
        "user": "u",
        "n": 1,
        "stream_options": {"include_usage": True},
        "stop": ["x", "y"],
        "presence_penalty": -1,
        "frequency_penalty": 0.5,
    },
]


def _changed_once(base: dict[str, Any]) -> list[Any]:
    """`base` changed in one place each way: a field, one message's field, the messages,
    or the whole body; and with a field or a message's field removed."""
    out: list[Any] = []
    for name, values in _FIELD_VALUES.items():
        out.extend({**base, name: value} for value in values)
        out.append({k: v for k, v in base.items() if k != name})
    for position in range(len(base["messages"])):
        for key, values in _MESSAGE_VALUES.items():
            for value in [*values, _REMOVE]:
                messages = [dict(m) for m in base["messages"]]
                if value is _REMOVE:
                    messages[position].pop(key, None)
                else:
                    messages[position][key] = value
                out.append({**base, "messages": messages})
    many = base["messages"] * MAX_MESSAGES
    out.extend({**base, "messages": value} for value in [[], many[:MAX_MESSAGES], many, *_BAD])
    out.extend([base["messages"], "text", None, 1])
    return out


_REMOVE = object()


def test_every_single_change_is_read_as_the_model_reads_it_or_declined() -> None:
    read = 0
    for base in _BASES:
        for data in _changed_once(base):
            call = plain(data)
            reference = through_model(data)
            if call is None:
                continue
            read += 1
            assert reference is not None, f"read plainly what the model refuses: {data!r}"
            assert shape(call) == shape(reference), data
    assert read > 50  # the plain reader still reads the plain variations


_TEXT = st.text(max_size=MAX_CHARS + 3)
_ANY_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    _TEXT,
)
_ROLE = st.one_of(
    st.sampled_from(["system", "developer", "user", "assistant", "tool", "bot"]), _ANY_SCALAR
)
_CONTENT = st.one_of(_TEXT, _ANY_SCALAR, st.just([{"type": "text", "text": "hi"}]))


_VALID_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"])},
    optional={"content": st.text(max_size=MAX_CHARS), "name": st.text(max_size=5)},
)
_VALID_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=5),
        "stream": st.booleans(),
        "temperature": st.floats(0, 2),
        "top_p": st.integers(0, 1),
        "max_tokens": st.integers(1, 10**6),
        "max_completion_tokens": st.integers(1, 10**6),
        "seed": st.integers(-(2**63), 2**63),
        "user": st.text(max_size=5),
        "n": st.just(1),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.integers(-2, 2),
    },
)
_FRACTION = st.one_of(st.floats(min_value=-0.5, max_value=2.5), st.integers(-1, 3), _ANY_SCALAR)
_COUNT = st.one_of(st.integers(-1, 2**70), _ANY_SCALAR)
# Values for every field, most of them wrong for it somehow; the last two are fields the
# plain reader leaves to the model.
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.sampled_from(["auto", "code", ""]), _ANY_SCALAR),
    "stream": _ANY_SCALAR,
    "temperature": _FRACTION,
    "top_p": _FRACTION,
    "max_tokens": _COUNT,
    "max_completion_tokens": _COUNT,
    "seed": _COUNT,
    "user": st.one_of(_TEXT, _ANY_SCALAR),
    "n": st.one_of(st.integers(0, 2), _ANY_SCALAR),
    "stream_options": st.one_of(
        st.fixed_dictionaries({}, optional={"include_usage": _ANY_SCALAR}), _ANY_SCALAR
    ),
    "stop": st.one_of(_TEXT, st.lists(st.one_of(_TEXT, _ANY_SCALAR), max_size=2), _ANY_SCALAR),
    "presence_penalty": _FRACTION,
    "frequency_penalty": _FRACTION,
    "metadata": st.just({"k": "v"}),
    "unknown_field": _ANY_SCALAR,
}
assert list(_FIELDS)[-2:] == ["metadata", "unknown_field"]


@st.composite
def _requests(draw: st.DrawFn) -> Any:
    """A valid plain request with a few things changed, each maybe making it invalid."""
    messages = draw(st.lists(_VALID_MESSAGE, min_size=1, max_size=MAX_MESSAGES))
    data: dict[str, Any] = {"messages": messages, **draw(_VALID_FIELDS)}
    for _ in range(draw(st.integers(0, 3))):
        change = draw(st.integers(0, 9))
        if change < 4:  # a field's value
            name = draw(st.sampled_from(list(_FIELDS)))
            data[name] = draw(_FIELDS[name])
        elif change < 8:  # a message
            item = draw(st.sampled_from(messages))
            key = draw(st.sampled_from(["role", "content", "name", "tool_call_id", "extra"]))
            if draw(st.booleans()):
                item[key] = draw(_ROLE if key == "role" else _CONTENT)
            else:
                item.pop(key, None)
        elif change == 8:  # the list of messages
            data["messages"] = draw(
                st.one_of(_ANY_SCALAR, st.just([]), st.just(messages * (MAX_MESSAGES + 1)))
            )
        else:
            data = draw(st.one_of(_ANY_SCALAR, st.just(messages)))
            break
    return data


@settings(max_examples=400, deadline=None)
@given(_requests())
def test_a_plain_reading_is_exactly_the_models(data: Any) -> None:
    call = plain(data)
    if call is None:
        return  # declined: the model answers it, as it always did
    reference = through_model(data)
    assert reference is not None, "read plainly a request that the model refuses"
    assert shape(call) == shape(reference)


@settings(max_examples=300, deadline=None)
@given(st.lists(_VALID_MESSAGE, min_size=1, max_size=MAX_MESSAGES), _VALID_FIELDS)
def test_every_valid_plain_request_is_read_plainly(
    messages: list[dict[str, Any]], fields: dict[str, Any]
) -> None:
    data = {"messages": messages, **fields}
    call = plain(data)
    reference = through_model(data)
    if any("content" not in m for m in messages):  # no content: the model's 400
        assert call is None and reference is None
        return
    assert call is not None and reference is not None
    assert shape(call) == shape(reference)


def test_the_chat_endpoint_reads_plain_requests_without_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Wired in: a plain request is answered without validating the model, the rest with
    it; both reach the provider with the same messages and options."""
    validated: list[Any] = []
    real = app_module._VALIDATE_CHAT

    def counting(payload: Any) -> Any:
        validated.append(payload)
        return real(payload)

    monkeypatch.setattr(app_module, "_VALIDATE_CHAT", counting)
    plain_body = {
        "model": "general",
        "messages": [{"role": "user", "content": "hello"}],
        "temperature": 0.5,
        "stop": ["END"],
    }
    with harness() as h:
        first = h.client.post("/v1/chat/completions", json=plain_body)
        assert first.status_code == 200 and validated == []
        second = h.client.post("/v1/chat/completions", json={**plain_body, "logprobs": False})
        assert second.status_code == 200 and len(validated) == 1
        (plain_messages, plain_options), (model_messages, model_options) = h.strong.calls[-2:]
        assert [(m.role, m.contents) for m in plain_messages] == [
            (m.role, m.contents) for m in model_messages
        ]
        model_options.additional_properties = None  # logprobs: the one difference asked for
        assert plain_options == model_options
        assert plain_options.temperature == 0.5 and plain_options.stop_sequences == ["END"]
