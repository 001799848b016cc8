"""Images, audio and files in messages: the content types and their OpenAI and Anthropic forms."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from chatroute import (
    ChatMessage,
    ChatRole,
    DataContent,
    HostedFileContent,
    TextContent,
    UriContent,
)
from chatroute.providers.anthropic_messages import messages_to_anthropic
from chatroute.providers.mapping import (
    message_from_openai,
    messages_to_openai,
    update_from_openai_chunk,
)

PNG_BYTES = b"\x89PNG\r\n\x1a\n\x00\x00"
PNG = "data:image/png;base64," + base64.b64encode(PNG_BYTES).decode()


def test_data_content_keeps_its_uri_and_decodes_on_demand() -> None:
    content = DataContent(PNG, additional_properties={"detail": "low"})
    assert content.uri == PNG  # kept as given: nothing is re-encoded on the way through
    assert content.media_type == "image/png"
    assert content.data == PNG_BYTES
    assert content.has_top_level_media_type("image")
    assert not content.has_top_level_media_type("audio")
    assert DataContent.from_bytes(PNG_BYTES, "image/png") == DataContent(PNG)
    assert "base64 characters" in repr(content) and content.base64_data not in repr(content)


def test_data_content_reads_parameters_and_case_in_the_media_type() -> None:
    content = DataContent("data:Text/Plain;charset=utf-8;base64,aGk=")
    assert content.media_type == "text/plain"
    assert content.data == b"hi"


@pytest.mark.parametrize(
    "uri",
    [
        "https://example.com/a.png",  # not a data URI
        "data:image/png,abc",  # not base64
        "data:;base64,abc",  # no media type
        "data:png;base64,abc",  # not type/subtype
    ],
)
def test_data_content_refuses_what_is_not_a_base64_data_uri(uri: str) -> None:
    with pytest.raises(ValueError):
        DataContent(uri)


def test_bad_base64_is_found_when_the_data_is_read() -> None:
    content = DataContent("data:image/png;base64,not base64!")
    with pytest.raises(ValueError, match="base64"):
        _ = content.data


def test_media_do_not_count_as_text() -> None:
    message = ChatMessage(ChatRole.USER, contents=[TextContent("a"), DataContent(PNG)])
    assert message.text == "a"


def test_openai_parts_round_trip_in_order() -> None:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": PNG, "detail": "auto"}},
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
        {"type": "input_audio", "input_audio": {"data": "SUQz", "format": "mp3"}},
        {
            "type": "file",
            "file": {"file_data": "data:application/pdf;base64,JVBE", "filename": "x.pdf"},
        },
        {"type": "file", "file": {"file_id": "file-1", "filename": "y.pdf"}},
    ]
    message = message_from_openai({"role": "user", "content": parts})
    assert [type(c) for c in message.contents] == [
        DataContent,
        TextContent,
        UriContent,
        DataContent,
        DataContent,
        HostedFileContent,
    ]
    assert message.text == "what is this?"
    assert messages_to_openai([message]) == [{"role": "user", "content": parts}]


def test_text_only_parts_are_still_sent_as_one_string() -> None:
    message = message_from_openai(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert message.contents == [TextContent("ab")]
    assert messages_to_openai([message]) == [{"role": "user", "content": "ab"}]


def test_media_from_bytes_take_their_openai_form_by_media_type() -> None:
    message = ChatMessage(
        ChatRole.USER,
        contents=[
            DataContent.from_bytes(b"RIFF", "audio/wav"),
            DataContent.from_bytes(b"col\n", "text/csv", name="t.csv"),
            UriContent("https://example.com/i.webp", "image/webp", {"detail": "low"}),
        ],
    )
    assert messages_to_openai([message])[0]["content"] == [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {
            "type": "file",
            "file": {"file_data": "data:text/csv;base64,Y29sCg==", "filename": "t.csv"},
        },
        {"type": "image_url", "image_url": {"url": "https://example.com/i.webp", "detail": "low"}},
    ]


def test_a_malformed_media_part_from_openai_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="image_url"):
        message_from_openai({"role": "user", "content": [{"type": "image_url", "image_url": {}}]})


def test_a_streamed_delta_with_parts_keeps_its_text() -> None:
    update = update_from_openai_chunk(
        {"choices": [{"index": 0, "delta": {"content": [{"type": "text", "text": "hi"}]}}]}
    )
    assert update.contents == [TextContent("hi")]


def test_anthropic_blocks_for_images_and_documents() -> None:
    message = ChatMessage(
        ChatRole.USER,
        contents=[
            TextContent("read"),
            DataContent(PNG),
            DataContent.from_bytes(b"plain words", "text/plain", name="notes.txt"),
        ],
    )
    _, turns = messages_to_anthropic([message])
    assert turns[0]["content"] == [
        {"type": "text", "text": "read"},
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": PNG.split(",")[1]},
        },
        {
            "type": "document",
            "source": {"type": "text", "media_type": "text/plain", "data": "plain words"},
            "title": "notes.txt",
        },
    ]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (DataContent.from_bytes(b"x", "audio/wav"), "audio/wav"),
        (DataContent.from_bytes(b"x", "image/bmp"), "image/bmp"),
        (HostedFileContent("file-9"), "file-9"),
        (DataContent.from_bytes(b"\xff\xfe", "text/plain"), "UTF-8"),
    ],
)
def test_what_anthropic_cannot_take_is_a_value_error(content: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        messages_to_anthropic([ChatMessage(ChatRole.USER, contents=[content])])


def test_an_earlier_refusal_goes_to_anthropic_as_the_turn_text() -> None:
    refused = ChatMessage(ChatRole.ASSISTANT, additional_properties={"refusal": "No."})
    _, turns = messages_to_anthropic([ChatMessage(ChatRole.USER, "q"), refused])
    assert turns[1] == {"role": "assistant", "content": "No."}
