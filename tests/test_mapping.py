"""Mapping of OpenAI answers and chunks to chatroute types, edge cases of decoded JSON."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.chat.chat_completion_chunk import Choice, ChoiceDelta

from chatroute import ChatFinishReason, ChatRole, TextContent, TextReasoningContent
from chatroute.providers.mapping import response_from_openai, update_from_openai_chunk


def _chunk(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "c1",
        "model": "m",
        "created": 1700000000,
        "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}],
    }
    base.update(fields)
    return base


def test_chunk_reads_the_first_choice_and_the_envelope() -> None:
    update = update_from_openai_chunk(_chunk(), provider="p")
    assert [type(c) for c in update.contents] == [TextContent]
    assert update.text == "hi"
    assert update.model_id == "m"
    assert update.response_id == "c1"
    assert update.created_at == 1700000000.0
    assert update.usage is None
    assert update.finish_reason is None
    assert update.additional_properties == {"provider": "p"}


@pytest.mark.parametrize(
    ("created", "expected"),
    [(12, 12.0), (1.5, 1.5), (True, None), ("12", None), (None, None)],
)
def test_chunk_created_is_a_number_that_is_not_a_bool(created: Any, expected: Any) -> None:
    assert update_from_openai_chunk(_chunk(created=created)).created_at == expected


@pytest.mark.parametrize(("value", "expected"), [("", None), (3, None), (None, None), ("x", "x")])
def test_chunk_model_and_id_are_non_empty_strings(value: Any, expected: Any) -> None:
    update = update_from_openai_chunk(_chunk(model=value, id=value))
    assert update.model_id == expected
    assert update.response_id == expected


@pytest.mark.parametrize("choices", [[], None])
def test_chunk_without_choices_has_no_contents(choices: Any) -> None:
    update = update_from_openai_chunk(
        _chunk(choices=choices, usage={"prompt_tokens": 3, "completion_tokens": 4})
    )
    assert update.contents == []
    assert update.finish_reason is None
    assert update.usage is not None
    assert (update.usage.input_token_count, update.usage.output_token_count) == (3, 4)


def test_chunk_with_choices_that_are_not_a_list_is_malformed() -> None:
    with pytest.raises(ValueError, match="not a list"):
        update_from_openai_chunk(_chunk(choices={"index": 0}))


def test_chunk_choice_as_an_sdk_object_is_read_like_a_dict() -> None:
    choice = Choice(index=0, delta=ChoiceDelta(content="obj"), finish_reason="stop")
    update = update_from_openai_chunk(_chunk(choices=[choice]))
    assert update.text == "obj"
    assert update.finish_reason is ChatFinishReason.STOP


@pytest.mark.parametrize(
    ("reason", "expected"),
    [("stop", ChatFinishReason.STOP), ("length", ChatFinishReason.LENGTH), ("odd", "odd")],
)
def test_chunk_finish_reason_known_and_unknown(reason: str, expected: Any) -> None:
    choice = {"index": 0, "delta": {}, "finish_reason": reason}
    assert update_from_openai_chunk(_chunk(choices=[choice])).finish_reason == expected


def test_chunk_finish_reason_that_is_not_a_string_is_malformed() -> None:
    choice = {"index": 0, "delta": {}, "finish_reason": 3}
    with pytest.raises(ValueError, match="finish_reason"):
        update_from_openai_chunk(_chunk(choices=[choice]))


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_chunk_reasoning_comes_before_text(key: str) -> None:
    choice = {"index": 0, "delta": {key: "think", "content": "say"}, "finish_reason": None}
    update = update_from_openai_chunk(_chunk(choices=[choice]))
    assert [type(c) for c in update.contents] == [TextReasoningContent, TextContent]
    assert [c.text for c in update.contents] == ["think", "say"]  # type: ignore[attr-defined]


def test_chunk_role_unknown_becomes_assistant() -> None:
    choice = {"index": 0, "delta": {"role": "narrator", "content": "x"}, "finish_reason": None}
    assert update_from_openai_chunk(_chunk(choices=[choice])).role is ChatRole.ASSISTANT


def _completion(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "r1",
        "model": "m",
        "created": 1700000000,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    base.update(fields)
    return base


def test_completion_maps_message_and_envelope() -> None:
    response = response_from_openai(_completion(system_fingerprint="fp"), provider="p")
    assert response.text == "hi"
    assert response.messages[0].role is ChatRole.ASSISTANT
    assert response.finish_reason is ChatFinishReason.STOP
    assert (response.model_id, response.response_id, response.created_at) == (
        "m",
        "r1",
        1700000000.0,
    )
    assert response.usage is not None and response.usage.total_token_count == 3
    assert response.additional_properties == {"provider": "p", "system_fingerprint": "fp"}


@pytest.mark.parametrize(
    ("field", "value", "attribute", "expected"),
    [
        ("created", True, "created_at", None),
        ("created", 7, "created_at", 7.0),
        ("model", "", "model_id", None),
        ("id", 5, "response_id", None),
    ],
)
def test_completion_envelope_values_of_the_wrong_kind_are_dropped(
    field: str, value: Any, attribute: str, expected: Any
) -> None:
    assert getattr(response_from_openai(_completion(**{field: value})), attribute) == expected


@pytest.mark.parametrize(
    ("choices", "message"),
    [([], "no choices"), ([{"index": 0, "finish_reason": "stop"}], "no message")],
)
def test_completion_without_a_message_is_malformed(choices: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        response_from_openai(_completion(choices=choices))


# The common chunk is read by a shorter path; it must give what the general reading gives.
_CHUNK_FIELDS: dict[str, list[Any]] = {
    "id": ["c1", "", None, 5],
    "model": ["m", "", None, ["m"]],
    "created": [1700000000, 1.5, True, None, "1"],
    "usage": [None, {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}],
}
_CHOICE_FIELDS: dict[str, list[Any]] = {
    "finish_reason": [None, "stop", "length"],
    "logprobs": [None, {"content": []}],
}
_DELTAS: list[Any] = [
    {},
    {"content": "hi"},
    {"content": ""},
    {"content": None},
    {"role": "assistant", "content": ""},
    {"role": "assistant"},
    {"role": "user", "content": "x"},
    {"role": "developer", "content": "x"},
    {"role": "", "content": "x"},
    {"role": 3, "content": "x"},
    {"content": 5},
    {"content": [{"type": "text", "text": "a"}]},
    {"content": "a", "reasoning_content": "r"},
    {"content": "a", "refusal": "no"},
    {"content": "a", "tool_calls": []},
    None,
    [],
]


def _chunks() -> list[Any]:
    base = {
        "id": "c1",
        "model": "m",
        "created": 1700000000,
        "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}],
    }
    out: list[Any] = []
    for delta in _DELTAS:
        chunk = dict(base)
        chunk["choices"] = [{"index": 0, "delta": delta, "finish_reason": None}]
        out.append(chunk)
    for field, values in _CHUNK_FIELDS.items():
        for value in values:
            out.append({**base, field: value})
    for field, values in _CHOICE_FIELDS.items():
        for value in values:
            out.append({**base, "choices": [{**base["choices"][0], field: value}]})
    out += [{**base, "choices": []}, {**base, "choices": [base["choices"][0]] * 2}]
    out += [{**base, "choices": ["x"]}, {k: v for k, v in base.items() if k != "choices"}]
    return out


def _agrees(short: Any, general: Any, value: Any, view: Any) -> None:
    """A short path's result for `value` is None or what the general reading gives (seen
    through `view`); what the general reading refuses, the short path never takes."""
    fast = short(value, "p")
    try:
        expected = general(value, "p")
    except (ValueError, TypeError, AttributeError):
        assert fast is None
        return
    if fast is not None:
        assert view(fast) == view(expected)


def _update_fields(update: Any) -> tuple[Any, ...]:
    return (update, type(update.created_at))


@pytest.mark.parametrize("chunk", _chunks())
def test_the_common_chunk_reads_as_the_general_path_reads_it(chunk: Any) -> None:
    from chatroute.providers.mapping import _plain_update, _read_update

    _agrees(_plain_update, _read_update, chunk, _update_fields)


def test_the_common_chunks_of_a_stream_take_the_short_path() -> None:
    from chatroute.providers.mapping import _plain_update

    base = {"id": "c", "model": "m", "created": 1, "object": "chat.completion.chunk"}
    for delta in ({"role": "assistant", "content": ""}, {"content": "word "}):
        choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
        assert _plain_update({**base, "choices": [choice]}, "p") is not None


# The common answer is read by a shorter path too, held to the general reading the same way.
_ANSWER_FIELDS: dict[str, list[Any]] = {
    "id": ["r1", "", None, 5],
    "model": ["m", "", None, 3],
    "created": [1700000000, 2.5, False, None, "1"],
    "system_fingerprint": ["fp_1", "", None],
    "usage": [
        None,
        {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": True},
        {"prompt_tokens": 1, "completion_tokens": 2},
        {
            "prompt_tokens": 1,
            "completion_tokens": 2,
            "total_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 1},
        },
        "lots",
    ],
}
_ANSWER_CHOICE_FIELDS: dict[str, list[Any]] = {
    "finish_reason": [None, "stop", "length", "tool_calls", "eos", 7],
    "logprobs": [None, {"content": []}],
}
_MESSAGES: list[Any] = [
    {"role": "assistant", "content": "hi"},
    {"role": "assistant", "content": ""},
    {"role": "assistant", "content": None},
    {"content": "hi"},
    {"role": "", "content": "hi"},
    {"role": None, "content": "hi"},
    {"role": "user", "content": "hi"},
    {"role": "developer", "content": "hi"},
    {"role": 0, "content": "hi"},
    {"role": "assistant", "content": 5},
    {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
    {"role": "assistant", "content": "hi", "refusal": None, "annotations": [], "audio": None},
    {"role": "assistant", "content": "hi", "function_call": None, "tool_calls": None},
    {"role": "assistant", "content": None, "refusal": "no"},
    {"role": "assistant", "content": "hi", "name": "bot"},
    {"role": "assistant", "content": "hi", "reasoning_content": "think"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
    {"role": "assistant", "content": "hi", "audio": {"id": "a"}},
    None,
    "hi",
]


def _answers() -> list[Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "hi"},
        "finish_reason": "stop",
    }
    base = {
        "id": "r1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [choice],
    }
    out: list[Any] = [{**base, "choices": [{**choice, "message": m}]} for m in _MESSAGES]
    for field, values in _ANSWER_FIELDS.items():
        out += [{**base, field: value} for value in values]
    for field, values in _ANSWER_CHOICE_FIELDS.items():
        out += [{**base, "choices": [{**choice, field: value}]} for value in values]
    out += [{**base, "choices": []}, {**base, "choices": [choice, choice]}, {**base, "choices": 1}]
    return out


def _response_fields(response: Any) -> tuple[Any, ...]:
    messages = [
        (m.role, m.contents, m.author_name, m.additional_properties) for m in response.messages
    ]
    return (
        messages,
        response.model_id,
        response.finish_reason,
        type(response.finish_reason),
        response.usage,
        response.response_id,
        response.created_at,
        type(response.created_at),
        response.raw_representation,
        response.additional_properties,
    )


@pytest.mark.parametrize("answer", _answers())
def test_the_common_answer_reads_as_the_general_path_reads_it(answer: Any) -> None:
    from chatroute.providers.mapping import _plain_response, _read_response

    _agrees(_plain_response, _read_response, answer, _response_fields)


def test_an_answer_as_openai_sends_it_takes_the_short_path() -> None:
    from chatroute.providers.mapping import _plain_response

    answer = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "hi",
                    "refusal": None,
                    "annotations": [],
                },
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 1,
            "completion_tokens": 1,
            "total_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        },
        "service_tier": "default",
        "system_fingerprint": "fp_1",
    }
    response = _plain_response(answer, "p")
    assert response is not None and response.text == "hi"
    assert response.usage is not None and response.usage.cached_input_token_count == 0
