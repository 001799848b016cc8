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


def test_the_callers_unknown_fields_go_as_pass_through_allows_and_extra_body_wins() -> None:
    from chatroute import ChatMessage, ChatOptions
    from chatroute.providers.mapping import build_request

    options = ChatOptions(
        max_output_tokens=9,
        additional_properties={"top_k": 40, "min_p": 0.1, "logprobs": True},
        pass_through_fields=frozenset({"top_k", "min_p"}),
    )
    messages = [ChatMessage("user", "hi")]

    def body(pass_through: Any, extra_body: Any = None) -> dict[str, Any]:
        return build_request(
            messages,
            options,
            default_model="m",
            stream=False,
            pass_through=pass_through,
            extra_body=extra_body,
        )

    assert {k: body("all")[k] for k in ("top_k", "min_p", "logprobs")} == {
        "top_k": 40,
        "min_p": 0.1,
        "logprobs": True,
    }
    strict = body("none")
    assert "top_k" not in strict and "min_p" not in strict and strict["logprobs"] is True
    assert "min_p" not in body(frozenset({"top_k"})) and body(frozenset({"top_k"}))["top_k"] == 40
    assert body("all", {"top_k": 5})["top_k"] == 5  # the operator's wins
    assert body("all")["max_tokens"] == 9
    options.additional_properties = {"max_completion_tokens": 9}
    sent = body("all")
    assert sent["max_completion_tokens"] == 9 and "max_tokens" not in sent


def test_further_choices_are_kept_by_index() -> None:
    completion = {
        "id": "x",
        "model": "m",
        "choices": [
            {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": "stop"}
            for i, t in enumerate(["a", "b"])
        ],
    }
    response = response_from_openai(completion)
    assert response.text == "a"
    assert response.additional_properties is not None
    (other,) = response.additional_properties["more_choices"]
    assert other.text == "b"
    chunk = {"id": "x", "choices": [{"index": 1, "delta": {"content": "b"}}]}
    update = update_from_openai_chunk(chunk)
    assert update.text == "b" and update.additional_properties == {"choice_index": 1}
